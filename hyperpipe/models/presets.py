"""Built-in models: published GPT-2, GPT-3 and Llama shapes, and a tiny GPT for CPUs.

Each entry names its source. Sequence lengths are the published training contexts:
GPT-2 1024, GPT-3 2048, Llama 2 4096, Llama 3 8192. All presets train in bf16 except
`tiny-gpt`, which runs on a CPU in fp32. Dropout is 0 everywhere (today's pretraining
default); set `dropout: 0.1` to model the original GPT-2/3 runs. Attention is `flash`
(a fused kernel that keeps no s x s scores) everywhere except `tiny-gpt` (`eager`, as its
CPU module runs); set `attention: eager` to model the Megatron papers' runs.
Embeddings are tied (the head reuses the token embedding) as GPT-2 and GPT-3 ship them,
untied for Llama and for `tiny-gpt`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hyperpipe.models.spec import GPTConfig, MoEConfig


@dataclass(frozen=True)
class Preset:
    config: GPTConfig
    dtype: str = "bf16"


def _gpt2(n_layer: int, n_head: int, d_model: int) -> Preset:
    # GPT-2 vocabulary: 50257 byte-level BPE tokens; context 1024 (Radford et al. 2019).
    # Tied embeddings: the released checkpoints have no separate head (Hugging Face
    # transformers models/gpt2/modeling_gpt2.py, GPT2LMHeadModel `_tied_weights_keys =
    # ["lm_head.weight"]`; openai/gpt-2 src/model.py computes the logits with `wte`).
    return Preset(GPTConfig(vocab_size=50257, n_layer=n_layer, n_head=n_head,
                            d_model=d_model, seq_len=1024, tie_embeddings=True))


def _gpt3(n_layer: int, n_head: int, d_model: int) -> Preset:
    # GPT-3 keeps GPT-2's tokenizer and learned positions; context 2048. Its alternating
    # locally banded sparse attention is not modelled (dense everywhere, as in Megatron).
    # Tied embeddings as GPT-2 ("the same model and architecture as GPT-2", Brown et al.
    # 2020, sec. 2.1), and as Megatron-LM trains it by default (tied unless
    # `--untie-embeddings-and-output-weights`, megatron/training/arguments.py).
    return Preset(GPTConfig(vocab_size=50257, n_layer=n_layer, n_head=n_head,
                            d_model=d_model, seq_len=2048, tie_embeddings=True))


def _llama(n_layer: int, n_head: int, d_model: int, ffn: int, *, vocab: int = 32000,
           n_kv_head: int | None = None, seq_len: int = 4096,
           rope_theta: float = 10000.0) -> Preset:
    # Llama: RMSNorm, SwiGLU, RoPE, no biases (Touvron et al. 2023); an untied output
    # head (`"tie_word_embeddings": false` in meta-llama/Llama-2-7b-hf and
    # Meta-Llama-3-8B config.json; a separate `output` Linear in meta-llama/llama
    # llama/model.py).
    return Preset(GPTConfig(vocab_size=vocab, n_layer=n_layer, n_head=n_head,
                            d_model=d_model, seq_len=seq_len, ffn_hidden=ffn,
                            n_kv_head=n_kv_head, mlp="swiglu", norm="rmsnorm",
                            position="rope", bias=False, rope_theta=rope_theta,
                            tie_embeddings=False))


PRESETS: Mapping[str, Preset] = MappingProxyType({
    # GPT-2: Radford et al. 2019, "Language Models are Unsupervised Multitask Learners",
    # table 2 (layers, d_model); heads from the Hugging Face configs openai-community/gpt2,
    # gpt2-medium, gpt2-large, gpt2-xl (n_head 12, 16, 20, 25).
    "gpt2-small": _gpt2(12, 12, 768),
    "gpt2-medium": _gpt2(24, 16, 1024),
    "gpt2-large": _gpt2(36, 20, 1280),
    "gpt2-xl": _gpt2(48, 25, 1600),
    # GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", table 2.1.
    "gpt3-1.3b": _gpt3(24, 16, 2048),
    "gpt3-2.7b": _gpt3(32, 32, 2560),
    "gpt3-6.7b": _gpt3(32, 32, 4096),
    # Table 2.1 prints d_model 5140 with 40 heads of 128, which do not divide; 40 x 128 =
    # 5120, as Megatron-LM and OPT-13B use.
    "gpt3-13b": _gpt3(40, 40, 5120),
    "gpt3-175b": _gpt3(96, 96, 12288),
    # Llama 2: Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models",
    # table 1 and sec. 2.2 (GQA for 70B), with d_model / ffn from the released
    # config.json files (meta-llama/Llama-2-{7b,13b,70b}-hf).
    "llama2-7b": _llama(32, 32, 4096, 11008),
    "llama2-13b": _llama(40, 40, 5120, 13824),
    "llama2-70b": _llama(80, 64, 8192, 28672, n_kv_head=8),
    # Llama 3 8B: Meta's model card and config.json (meta-llama/Meta-Llama-3-8B):
    # 128256-token vocabulary, GQA with 8 KV heads, ffn 14336, RoPE base 500000.
    "llama3-8b": _llama(32, 32, 4096, 14336, vocab=128256, n_kv_head=8, seq_len=8192,
                        rope_theta=500000.0),
    # Llama 3 405B: Llama Team, "The Llama 3 Herd of Models" (arXiv 2407.21783, 2024),
    # table 3: 126 layers, model dimension 16,384, FFN dimension 53,248, 128 attention
    # heads, 8 key/value heads, vocabulary 128,000 (128,256 in the released config.json,
    # meta-llama/Llama-3.1-405B, which is what the model computes with), RoPE base
    # 500,000; pretrained at sequence 8,192, then lengthened to 131,072.
    "llama3-405b": _llama(126, 128, 16384, 53248, vocab=128256, n_kv_head=8, seq_len=8192,
                          rope_theta=500000.0),
    # Ours: 8 layers in all (embedding, 6 blocks, head); byte-level vocabulary so it
    # needs no tokenizer; one micro-batch of 2 x 64 tokens takes milliseconds per block
    # on one CPU thread. fp32 because it runs on CPUs; eager attention because its CPU
    # module computes the scores explicitly (hyperpipe.models.gpt) and keeps them;
    # untied, so that no weight spans stages (set `tie_embeddings: true` to run the tie).
    "tiny-gpt": Preset(GPTConfig(vocab_size=256, n_layer=6, n_head=4, d_model=128,
                                 seq_len=64, attention="eager", tie_embeddings=False),
                       dtype="fp32"),
    # Ours: tiny-gpt's shape with 4 blocks, every other one (blocks 0 and 2) a mixture of
    # 4 GELU experts of hidden 256, each token routed to 2, dropless; runs on a CPU.
    "tiny-moe": Preset(GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128,
                                 seq_len=64, attention="eager", tie_embeddings=False,
                                 moe=MoEConfig(experts=4, top_k=2, expert_hidden=256,
                                               capacity_factor=None, every=2)),
                       dtype="fp32"),
})
