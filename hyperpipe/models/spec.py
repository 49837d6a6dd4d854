"""Layer-level model specs: what each layer costs, from its shapes, with sources.

A model is an ordered tuple of small frozen layer specs (embedding, N transformer blocks,
head; or synthetic layers). Each layer answers `cost(micro_batch, seq_len, dtype_bytes)`
with a `LayerCost` for one micro-batch: FLOPs of the forward, the input-gradient (I; the
zero-bubble paper calls it "B") and the weight-gradient (W) backward, counting
multiply-adds as 2 and only matrix multiplications; bytes sent to the next layer,
stashed until the backward, and moved through device memory (the elementwise work).
The torch modules built from the same spec live in `hyperpipe.models.gpt`; reading a
model from a name, file or dict is `hyperpipe.models.loader`.

>>> from hyperpipe.models import load_model
>>> spec = load_model("gpt2-small")
>>> spec.num_layers, spec.params
(14, 124439808)
>>> spec.layer_cost(1, micro_batch=8).fwd_flops / 1e12    # one block, 8 x 1024 tokens
0.141733920768
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from math import comb
from types import MappingProxyType
from typing import Any, ClassVar

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import check_int

# Training dtypes and what each stores weights, activations, gradients and messages in:
# "tf32" is an fp32 model whose matmuls run on TF32 tensor cores
# (`torch.backends.cuda.matmul.allow_tf32`; NVIDIA's NGC PyTorch containers turn it on);
# "fp8" a bf16 mixed-precision model whose blocks' linear layers multiply in FP8
# (Transformer Engine's `fp8_autocast`: Megatron-LM `--fp8-format`, torchtitan's
# "float8" converter), the attention core and the logits staying in bf16
# (`hyperpipe.models.ops.Gemm.linear`). The dtype picks a device's peak
# (`DeviceType.peak_for`); the storage dtype sets bytes and optimizer state.
STORAGE_DTYPES: Mapping[str, str] = MappingProxyType({
    "fp32": "fp32", "tf32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16"})
_STORAGE_BYTES = MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2})
# Bytes per stored element of each training dtype (its storage dtype's).
DTYPE_BYTES: Mapping[str, int] = MappingProxyType(
    {d: _STORAGE_BYTES[s] for d, s in STORAGE_DTYPES.items()})
# What the optimizer keeps per parameter (`hyperpipe.sim.costmodel.param_bytes`):
# "mixed" fp32 master weights and Adam moments; "bf16-moments" fp32 master weights with
# 2-byte moments (DeepSeek-V3); "model-dtype" no master copy, everything in the dtype;
# "autocast" fp32 weights, gradients and moments, cast to the dtype at every use (torch AMP).
OPTIMIZER_STATES = ("mixed", "bf16-moments", "model-dtype", "autocast")

MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "rope")
# "flash": a fused attention kernel (FlashAttention, Dao et al. 2022; torch SDPA) that
# recomputes the s x s scores in its backward and keeps none of them; "eager": the scores,
# softmax and dropout are materialised and kept for the backward, as in the Megatron papers.
ATTENTION_KINDS = ("flash", "eager")

TOKEN_ID_BYTES = 8  # token ids are int64 (torch.long), the index type nn.Embedding takes


@dataclass(frozen=True)
class LayerCost:
    """Costs of one layer for ONE micro-batch of `micro_batch` samples (FLOPs and bytes)."""

    fwd_flops: float    # forward FLOPs
    i_flops: float      # input-gradient backward FLOPs ("I"; the zero-bubble paper's "B")
    w_flops: float      # weight-gradient backward FLOPs ("W")
    send_bytes: float   # activation bytes sent to the next layer/stage (0 for the head)
    stash_bytes: float  # bytes kept from forward until backward
    mem_bytes: float    # bytes moved through device memory by the forward (roofline)


# --------------------------------------------------------------------------- config

@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs (the model field `moe`, docs/formats.md): in every `every`-th
    transformer block after the first `first_dense` (block i, counted from 0, is an MoE
    block when i >= first_dense and (i - first_dense) % every == 0, Megatron-LM's
    `--moe-layer-freq` rule), the MLP is replaced by `experts` routed experts of hidden
    size `expert_hidden` (same MLP kind as the model: GELU or SwiGLU), of which a learned
    router sends each token to `top_k`, plus `shared_experts` experts every token passes
    through (DeepSeek-V3's shared expert; 0 for Mixtral).

    `capacity_factor`: each expert takes at most capacity_factor · tokens · top_k /
    experts tokens of a micro-batch and drops the rest (GShard, Lepikhin et al. 2020);
    None: dropless (every routed token is computed, as Mixtral and DeepSeek-V3 train).

    `imbalance`: the busiest expert's tokens over the mean (T · top_k / experts for T
    tokens), the router's load imbalance that the cost model prices (`expert_loads`).
    Default 1.25: Fedus et al. 2022 (Switch Transformers, JMLR 23, sec. 2.2 and
    table 1) train with capacity factors 1.0 to 1.25, the headroom over an even split
    their balanced routers need to drop few tokens; GShard (Lepikhin et al. 2020,
    sec. 2.2) likewise sizes capacity at about 2 T/E for top-2. Ma et al. 2026 (DODOCO,
    arXiv 2605.20982) measure that this max/mean ratio is a property of the trained
    router, changing by at most 5% from 4 to 32 expert-parallel ranks, so one figure
    per model, independent of `ep`, is what they support. At least 1 (perfectly
    even); priced at most experts / top_k (every token's choices include the busiest
    expert), so the default holds for any shape.

    `routing`: which experts a token's top_k are, as far as a deduplicating dispatcher
    (`hit_fraction`) cares. "learned" (default): a trained router's choices, taken as
    top_k distinct experts with no locality, every set equally likely. "contiguous":
    token t goes to experts t·top_k, ..., t·top_k + top_k - 1 (mod experts), the
    benchmark gate of NVIDIA NeMo Automodel (`FakeBalancedGate`, nemo_automodel/
    components/moe/layers.py), which its published MoE throughput table runs with; it
    loads every expert evenly, so `imbalance` does not apply to it.
    """

    experts: int
    top_k: int
    expert_hidden: int
    capacity_factor: float | None = 1.25
    every: int = 1
    first_dense: int = 0
    shared_experts: int = 0
    imbalance: float = 1.25
    routing: str = "learned"

    def __post_init__(self):
        check_moe(asdict(self), lambda key: f"MoEConfig: {key}")

    def hit_fraction(self, held: Collection[int]) -> float:
        """Probability that a token has at least one of its top_k experts among `held`
        (expert indices 0 .. experts-1): what one copy of the token sent to a rank or a
        node holding those experts carries, under `routing`. "learned": 1 - C(E - n, k) /
        C(E, k) for n held of E experts; "contiguous": the share of the gate's windows of
        k consecutive experts (starting at every multiple of k, mod E) that meet `held`."""
        e, k = self.experts, self.top_k
        ids = {i % e for i in held}
        if self.routing == "contiguous":
            starts = {(t * k) % e for t in range(e)}
            hits = sum(any((s + j) % e in ids for j in range(k)) for s in starts)
            return hits / len(starts)
        return 1.0 - comb(e - len(ids), k) / comb(e, k)

    def is_moe_block(self, block: int) -> bool:
        """Whether transformer block `block` (0-based, embedding not counted) is MoE."""
        return block >= self.first_dense and (block - self.first_dense) % self.every == 0

    def expert_loads(self, tokens: float) -> tuple[float, float]:
        """Token-expert pairs the busiest expert and each other expert compute for
        `tokens` tokens (a two-level load: the busiest at `imbalance` x the mean
        T·top_k/experts, 1 x under "contiguous" routing, the rest sharing the remainder
        evenly), each capped at the capacity capacity_factor · T·top_k/experts (GShard;
        a dropped pair costs nothing); dropless: no cap. With one expert: (T·top_k, 0)."""
        e, mean = self.experts, tokens * self.top_k / self.experts
        imb = 1.0 if self.routing == "contiguous" else min(self.imbalance, e / self.top_k)
        busiest = imb * mean if e > 1 else mean
        other = (e - imb) / (e - 1) * mean if e > 1 else 0.0
        if self.capacity_factor is not None:
            cap = self.capacity_factor * mean
            busiest, other = min(busiest, cap), min(other, cap)
        return busiest, other

    def routed_pairs(self, tokens: float) -> float:
        """Token-expert pairs all routed experts compute for `tokens` tokens (T·top_k
        less the pairs capacity drops): busiest + (experts - 1) · other."""
        busiest, other = self.expert_loads(tokens)
        return busiest + (self.experts - 1) * other

    def rank_pairs(self, tokens: float, experts_here: int) -> float:
        """Token-expert pairs an expert-parallel rank holding `experts_here` experts
        computes when it holds the busiest one (the time-setting rank): busiest +
        (experts_here - 1) · other, for `tokens` tokens of the whole group."""
        busiest, other = self.expert_loads(tokens)
        return busiest + (experts_here - 1) * other


MOE_KEYS = ("experts", "top_k", "expert_hidden", "capacity_factor", "every",
            "first_dense", "shared_experts", "imbalance", "routing")
MOE_ROUTINGS = ("learned", "contiguous")


def check_moe(v: Mapping[str, Any], at: Callable[[str], str]) -> None:
    """Raise BadInput (naming the field through `at`) unless `v` is a valid MoE config."""
    unknown = sorted(set(map(str, v)) - set(MOE_KEYS))
    if unknown:
        raise BadInput(at(unknown[0]), f"one of the known keys {list(MOE_KEYS)}",
                       "an unknown key", has_got=False)
    for key in ("experts", "top_k", "expert_hidden"):
        if key not in v:
            raise BadInput(at(key), "a value (the field is required)", has_got=False)
        check_int(v[key], at(key), at_most=limits.MAX_MODEL_DIM)
    for key in ("every", "first_dense", "shared_experts"):
        if key in v:
            check_int(v[key], at(key), allow_zero=key != "every",
                      at_most=limits.MAX_LAYERS if key != "shared_experts"
                      else limits.MAX_MODEL_DIM)
    if v["top_k"] > v["experts"]:
        raise BadInput(at("top_k"), f"at most experts ({v['experts']})", v["top_k"])
    cf = v.get("capacity_factor", 1.25)
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))
                           or not 0 < cf < float("inf")):
        raise BadInput(at("capacity_factor"), "a positive number, or null for dropless",
                       cf)
    imb = v.get("imbalance", 1.25)
    if isinstance(imb, bool) or not isinstance(imb, (int, float)) \
            or not 1 <= imb < float("inf"):
        raise BadInput(at("imbalance"), "a number of at least 1: the busiest expert's "
                       "tokens over the mean", imb)
    routing = v.get("routing", "learned")
    if routing not in MOE_ROUTINGS:
        raise BadInput(at("routing"), f"one of {list(MOE_ROUTINGS)}", routing)


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-style decoder (GPT-2/3 and Llama are all points in this space)."""

    vocab_size: int
    n_layer: int                    # transformer blocks (the spec adds embedding and head)
    n_head: int
    d_model: int
    seq_len: int                    # tokens per sample; also the learned position table size
    ffn_hidden: int | None = None   # None -> 4 * d_model (GPT-2/3)
    n_kv_head: int | None = None    # None -> n_head (no grouped-query attention)
    mlp: str = "gelu"               # "gelu" (GPT) or "swiglu" (Llama: gate, up, down)
    norm: str = "layernorm"         # "layernorm" (GPT) or "rmsnorm" (Llama)
    position: str = "learned"       # "learned" table (GPT) or "rope" (Llama)
    dropout: float = 0.0            # 0.0: pretraining at scale uses none (nanoGPT's default)
    bias: bool = True               # biases in linears and layernorms (GPT: yes, Llama: no)
    rope_theta: float = 10000.0     # RoPE base (Su et al. 2021); Llama 3 uses 500000
    attention: str = "flash"        # one of ATTENTION_KINDS: fused kernels are the default today
    # Elementwise work fused as Megatron-LM fuses it (bias+GeLU, bias+dropout+add, scale-
    # mask-softmax: one kernel each, its default since v2); False: each a chain of
    # PyTorch kernels, every link a round trip through memory (Megatron-LM v1.x without
    # its `--*-fusion` flags, or with today's `--no-*-fusion`).
    fused_elementwise: bool = True
    # The head's output projection reuses the token embedding's V x h matrix (GPT-2,
    # OPT, Megatron-LM's GPT default: its flag is `--untie-embeddings-and-output-weights`);
    # False: the head has its own (Llama). Absent from a model file: true.
    tie_embeddings: bool = True
    # Mixture-of-experts MLPs in some blocks (MoEConfig); None: every block is dense.
    # A file gives it as a mapping with MoEConfig's fields.
    moe: MoEConfig | None = None
    # Width of one attention head; None -> d_model // n_head. Set where a model's heads
    # are wider or narrower than that (Qwen3: 32 heads of 128 on d_model 2048), so that
    # Q and the output projection are n_head x head_dim wide (`q_dim`), not d_model.
    head_dim: int | None = None

    def __post_init__(self):
        if isinstance(self.moe, Mapping):
            check_moe(self.moe, lambda key: f"GPTConfig: moe.{key}")
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.d_model)
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        check_config(asdict(self), lambda key: f"GPTConfig: {key}")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.d_model // self.n_head)

    @property
    def q_dim(self) -> int:
        """Width of Q and of the output projection's input: n_head * head_dim."""
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): head_dim * n_kv_head."""
        return self.head_dim * self.n_kv_head


def check_config(v: Mapping[str, Any], at: Callable[[str], str]) -> None:
    """Raise BadInput (naming the field through `at`) unless `v` is a valid GPT config."""
    for key in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len", "ffn_hidden",
                "n_kv_head"):
        check_int(v[key], at(key),
                  at_most=limits.MAX_LAYERS if key == "n_layer" else limits.MAX_MODEL_DIM)
    for key, options in (("mlp", MLP_KINDS), ("norm", NORM_KINDS),
                         ("position", POSITION_KINDS), ("attention", ATTENTION_KINDS)):
        if v[key] not in options:
            raise BadInput(at(key), f"one of {list(options)}", v[key])
    dropout = v["dropout"]
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
            or not 0 <= dropout < 1:
        raise BadInput(at("dropout"), "a number in [0, 1)", dropout)
    for key in ("bias", "tie_embeddings", "fused_elementwise"):
        if not isinstance(v[key], bool):
            raise BadInput(at(key), "true or false", v[key])
    moe = v.get("moe")
    if moe is not None and not isinstance(moe, MoEConfig):
        if not isinstance(moe, Mapping):
            raise BadInput(at("moe"), "a mapping of MoE fields (experts, top_k, "
                           "expert_hidden, ...) or null", type(moe).__name__)
        check_moe(moe, lambda key: at(f"moe.{key}"))
        if moe.get("first_dense", 0) >= v["n_layer"]:
            raise BadInput(at("moe.first_dense"), f"below n_layer ({v['n_layer']})",
                           moe.get("first_dense"))
    theta = v["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0 \
            or theta == float("inf"):
        raise BadInput(at("rope_theta"), "a positive number", theta)
    head_dim = v.get("head_dim")
    if head_dim is None and v["d_model"] % v["n_head"]:
        raise BadInput(at("n_head"), f"a divisor of d_model ({v['d_model']}), or a "
                       "head_dim", v["n_head"])
    if head_dim is not None:
        check_int(head_dim, at("head_dim"), at_most=limits.MAX_MODEL_DIM)
    if v["n_head"] % v["n_kv_head"]:
        raise BadInput(at("n_kv_head"), f"a divisor of n_head ({v['n_head']})",
                       v["n_kv_head"])
    if v["position"] == "rope" and (head_dim or v["d_model"] // v["n_head"]) % 2:
        raise BadInput(at("head_dim" if head_dim else "d_model"), "an even head size "
                       "(head_dim, or d_model / n_head) with rope",
                       head_dim or f"{v['d_model']} / {v['n_head']}")


# --------------------------------------------------------------------------- layers

@dataclass(frozen=True)
class EmbeddingLayer:
    """Token embedding (plus the learned position table, if any): (B, S) ids -> (B, S, D).

    No matrix multiplication: a row lookup, memory-bound. FLOPs counted: none forward, no
    input gradient (token ids have none), and b·s·h adds per table for the gradient
    scatter (W).
    """

    config: GPTConfig
    kind: ClassVar[str] = "embedding"

    @property
    def params(self) -> int:
        c = self.config
        return c.vocab_size * c.d_model + (c.seq_len * c.d_model if _learned(c) else 0)

    def cost(self, micro_batch: int, seq_len: int, dtype_bytes: int) -> LayerCost:
        c = self.config
        b, s, h, d = micro_batch, seq_len, c.d_model, dtype_bytes
        tables = 2 if _learned(c) else 1
        out_bytes = b * s * h * d                       # (B, S, D) activations written
        ids_bytes = b * s * TOKEN_ID_BYTES              # kept for the backward scatter
        rows_bytes = b * s * h * d + (s * h * d if _learned(c) else 0)
        stash = self.stash_bytes(b, s, d)
        return LayerCost(
            fwd_flops=0.0, i_flops=0.0, w_flops=float(tables * b * s * h),
            send_bytes=float(out_bytes), stash_bytes=float(stash),
            mem_bytes=float(ids_bytes + rows_bytes + out_bytes))

    def stash_bytes(self, micro_batch: int, seq_len: int, dtype_bytes: int, *, tp: int = 1,
                    sequence_parallel: bool = False, recompute: str = "none") -> float:
        """Token ids (every rank of a tensor-parallel group keeps them) and, with dropout,
        its 1-byte mask (split by sequence parallelism). Recompute does not apply: Megatron
        checkpoints transformer blocks only."""
        b, s = micro_batch, seq_len
        mask = b * s * self.config.d_model if self.config.dropout > 0 else 0
        return float(b * s * TOKEN_ID_BYTES + mask / (tp if sequence_parallel else 1))


@dataclass(frozen=True)
class TransformerBlock:
    """One pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)).

    With b micro-batch, s sequence, h d_model, f ffn_hidden, a heads, h_kv the K/V width
    (head_dim · n_kv_head), forward FLOPs (2 per multiply-add, matmuls only), written for
    Q as wide as h (head_dim = h / a; otherwise Q, the s² matmuls and the output
    projection are `q_dim` = a · head_dim wide where h stands for Q's width below):

    * QKV projection 2bsh(h + 2h_kv); scores QKᵀ 2bs²h and weighted sum AV 2bs²h, counted
      over the full s x s square (causal kernels may skip half; the papers and torch's
      FLOP counter count it all); output projection 2bsh²; MLP 2bshf · (2 for GELU:
      up and down; 3 for SwiGLU: gate, up and down).
    * For f = 4h and no GQA this is 24bsh² + 4bs²h, Narayanan et al. 2021 ("Efficient
      Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", sec. 5.1,
      per-layer term of the FLOPs formula).
    * Backward: every weight matmul Y = XW costs its forward again for dX (I) and again for
      dW (W). The two s² matmuls have no weights: both their operands are activations, so
      all of their backward (2 x forward) is input gradient. Hence
      I = matmul + 2 · attention-s², W = matmul, and I + W = 2 · forward.

    Stash (bytes kept for the backward), Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models", sec. 4.1), who get sbh(34 + 5as/h) at 16
    bits with dropout. Generalised to d bytes per element, GQA, any f and SwiGLU, with the
    1-byte dropout masks (and the dropped-out copy of the probabilities) only when
    dropout > 0:

    * attention: QKV input sbh·d, Q sbh·d, K and V 2·sb·h_kv·d (5sbh·d without GQA, their
      11sbh at d = 2 less the 1-byte mask), output-projection input sbh·d; with eager
      attention the softmax output as²b·d, and with dropout also its mask as²b and dropout
      output as²b·d (their 5as²b); with flash attention none of the s² part, only its
      fp32 log-sum-exp 4·asb; with dropout the residual dropout mask sbh.
    * MLP: input sbh·d; GELU input and output 2·sbf·d (their 16sbh at f = 4h, d = 2);
      SwiGLU gate, up, silu(gate) and their product 4·sbf·d; with dropout a mask sbh.
    * two norms: their inputs 2·sbh·d (per-token mean and rstd are negligible).
    * `stash_bytes` gives it under tensor parallelism, sequence parallelism and recompute.

    send bytes: the (B, S, D) output, b·s·h·d. mem_bytes (a lower bound for the roofline):
    weights read once, stashed tensors and the output written once.
    """

    config: GPTConfig
    kind: ClassVar[str] = "block"

    @property
    def params(self) -> int:
        c = self.config
        h, f, kv, q = c.d_model, c.ffn_hidden, c.kv_dim, c.q_dim
        n_in = 2 if c.mlp == "swiglu" else 1                  # gate and up, or just up
        weights = h * (q + 2 * kv) + q * h + n_in * h * f + f * h
        biases = (q + 2 * kv) + h + n_in * f + h if c.bias else 0
        return weights + biases + 2 * _norm_params(c)

    def cost(self, micro_batch: int, seq_len: int, dtype_bytes: int) -> LayerCost:
        c = self.config
        mlp = 2 * micro_batch * seq_len * c.d_model * c.ffn_hidden * \
            (3 if c.mlp == "swiglu" else 2)
        return _block_cost(self, micro_batch, seq_len, dtype_bytes, mlp)


    def stash_parts(self, micro_batch: int, seq_len: int, dtype_bytes: int
                    ) -> tuple[float, float, float]:
        """The stash without recompute, split as tensor parallelism splits it (bytes):
        (outside the tensor-parallel regions: norm inputs, the attention and MLP inputs,
        residual dropout masks — Korthikanti's 10sbh, divided by t only with sequence
        parallelism; inside them: Q, K, V, the output-projection input and the MLP
        intermediates — their 24sbh, divided by t; the attention core kept for backward:
        eager attention's softmax output (+ dropout mask and output) — their 5as²b,
        divided by t; with flash attention only its fp32 log-sum-exp per query and head,
        4·abs bytes, Dao et al. 2022, sec. 3.1)."""
        c = self.config
        b, s, h, f, a, d = micro_batch, seq_len, c.d_model, c.ffn_hidden, c.n_head, dtype_bytes
        tokens = b * s
        outside = 4 * tokens * h * d                   # 2 norm inputs, attn and MLP inputs
        inside = tokens * (2 * c.q_dim + 2 * c.kv_dim) * d + \
            (4 if c.mlp == "swiglu" else 2) * \
            tokens * f * d                              # Q, K, V, out-proj input, MLP
        if c.attention == "eager":
            core = a * s * s * b * d                    # softmax output
            if c.dropout > 0:
                core += a * s * s * b * (1 + d)         # its dropout mask and output
        else:
            core = 4 * a * s * b                        # flash: fp32 log-sum-exp
        if c.dropout > 0:
            outside += 2 * tokens * h                   # the two residual dropout masks
        return float(outside), float(inside), float(core)

    def recompute_fraction(self, micro_batch: int, seq_len: int, recompute: str) -> float:
        """The part of the forward the backward runs again: all of it with "full"; with
        "selective" and eager attention the attention core, the s² matmuls QKᵀ and AV
        (4bs²h of the forward's FLOPs; Korthikanti et al. 2022, sec. 5); none else (a
        flash kernel's backward recomputes its scores by itself, within its own time)."""
        if recompute == "full":
            return 1.0
        if recompute == "selective" and self.config.attention == "eager":
            c = self.cost(micro_batch, seq_len, 2)
            return 4 * micro_batch * seq_len * seq_len * self.config.q_dim / c.fwd_flops
        return 0.0

    def stash_bytes(self, micro_batch: int, seq_len: int, dtype_bytes: int, *, tp: int = 1,
                    sequence_parallel: bool = False, recompute: str = "none") -> float:
        """Bytes one micro-batch keeps until its backward, per device of a tensor-parallel
        group of `tp` (Korthikanti et al. 2022, sec. 4, table 2): recompute none
        sbh(10 + 24/t + 5as/(ht)) at 16 bits with eager attention and dropout, all of it
        over t with sequence parallelism; "selective" drops the attention core (it is
        recomputed), so 34sbh/t with sequence parallelism; "full" keeps only the block
        input, 2sbh (over t with sequence parallelism)."""
        outside, inside, core = self.stash_parts(micro_batch, seq_len, dtype_bytes)
        r = tp if sequence_parallel else 1
        if recompute == "full":
            return micro_batch * seq_len * self.config.d_model * dtype_bytes / r
        if recompute == "selective" and self.config.attention == "eager":
            core = 0.0
        return outside / r + (inside + core) / tp


def _mlp_params(c: GPTConfig, hidden: int) -> int:
    """Parameters of one MLP of width `hidden`: up (and gate) and down, their biases."""
    n_in = 2 if c.mlp == "swiglu" else 1
    h = c.d_model
    return n_in * h * hidden + hidden * h + ((n_in * hidden + h) if c.bias else 0)


def _mlp_flops_per_token(c: GPTConfig, hidden: int) -> int:
    """Forward FLOPs of one MLP of width `hidden` on one token: 2 h f x (2 for GELU: up
    and down; 3 for SwiGLU: gate, up and down)."""
    return 2 * c.d_model * hidden * (3 if c.mlp == "swiglu" else 2)


@dataclass(frozen=True)
class MoEBlock(TransformerBlock):
    """A transformer block whose MLP is a mixture of experts (`GPTConfig.moe`, built by
    `gpt_spec` where `MoEConfig.is_moe_block`): attention exactly as `TransformerBlock`;
    the MLP replaced by a router, `experts` routed experts and `shared_experts` always-on
    experts, each an MLP of width fe = `expert_hidden` of the model's kind (GELU or
    SwiGLU), as Mixtral (Jiang et al. 2024, sec. 2.1) and DeepSeek-V3 (DeepSeek-AI 2024,
    arXiv 2412.19437, sec. 2.1.2, shared plus fine-grained routed experts) build it.

    With T = b·s tokens, E experts, k = top_k, S shared experts, P the token-expert
    pairs the routed experts compute (`MoEConfig.routed_pairs`: T·k less what the
    capacity drops; dropless T·k), forward FLOPs (2 per multiply-add):

    * attention as `TransformerBlock` (QKV, the s² matmuls, output projection);
    * router 2·T·h·E (a bias-free h x E linear: Mixtral's `gate`, Megatron-Core's
      `TopKRouter`); none with one expert (its gate is the constant 1, nothing to route);
    * experts (P + S·T) · 2·h·fe · (2 GELU | 3 SwiGLU).

    I = matmuls + 2 · attention-s², W = matmuls, as the dense block. Parameters count
    every expert; `active_params` counts k routed and the S shared ones. Stash: the dense
    block's with the MLP intermediates of every computed pair, (P + S·T)·(2|4)·fe·d
    (inside the tensor-parallel region: experts are split over the tensor-parallel group,
    Megatron-Core's default expert_tensor_parallel_size = tp), plus, with E > 1, the
    dispatched (permuted) token copies each expert's weight gradient needs, P·h·d, and
    the router's fp32 probabilities T·E·4 (outside the region). A dense-equivalent MoE
    (one expert, top_k 1, fe = ffn_hidden, no shared expert, dropless) costs exactly the
    dense block.
    """

    kind: ClassVar[str] = "moe"

    @property
    def moe(self) -> MoEConfig:
        if self.config.moe is None:
            raise TypeError("an MoE block needs GPTConfig.moe")
        return self.config.moe

    @property
    def _attention_params(self) -> int:
        return TransformerBlock(self.config).params - _mlp_params(self.config,
                                                                  self.config.ffn_hidden)

    @property
    def router_params(self) -> int:
        """The router's h x E weight (none with one expert)."""
        e = self.moe.experts
        return self.config.d_model * e if e > 1 else 0

    @property
    def expert_params(self) -> int:
        """Parameters of all routed experts: what expert parallelism splits over its ranks."""
        return self.moe.experts * _mlp_params(self.config, self.moe.expert_hidden)

    @property
    def params(self) -> int:
        m = self.moe
        return self._attention_params + self.router_params + self.expert_params + \
            m.shared_experts * _mlp_params(self.config, m.expert_hidden)

    @property
    def active_params(self) -> int:
        """Parameters a token meets: attention, router, top_k routed and the shared ones."""
        m = self.moe
        return self._attention_params + self.router_params + \
            (m.top_k + m.shared_experts) * _mlp_params(self.config, m.expert_hidden)

    def expert_pairs(self, micro_batch: int, seq_len: int) -> tuple[float, float]:
        """(routed pairs P, shared pairs S·T) of one micro-batch."""
        tokens = micro_batch * seq_len
        return self.moe.routed_pairs(tokens), float(self.moe.shared_experts * tokens)

    def cost(self, micro_batch: int, seq_len: int, dtype_bytes: int) -> LayerCost:
        c, m = self.config, self.moe
        b, s = micro_batch, seq_len
        routed, shared = self.expert_pairs(b, s)
        router = 2 * b * s * c.d_model * m.experts if m.experts > 1 else 0
        experts = (routed + shared) * _mlp_flops_per_token(c, m.expert_hidden)
        return _block_cost(self, b, s, dtype_bytes, router + experts)

    def stash_parts(self, micro_batch: int, seq_len: int, dtype_bytes: int
                    ) -> tuple[float, float, float]:
        """`TransformerBlock.stash_parts` with the MLP's part replaced (see the class
        doc): (outside + dispatched tokens + router probabilities, inside with every
        computed pair's expert intermediates, attention core)."""
        c, m = self.config, self.moe
        outside, inside, core = TransformerBlock(c).stash_parts(micro_batch, seq_len,
                                                                dtype_bytes)
        tokens = micro_batch * seq_len
        per_f = (4 if c.mlp == "swiglu" else 2) * dtype_bytes
        routed, shared = self.expert_pairs(micro_batch, seq_len)
        inside += per_f * ((routed + shared) * m.expert_hidden - tokens * c.ffn_hidden)
        if m.experts > 1:
            outside += routed * c.d_model * dtype_bytes + tokens * m.experts * 4
        return outside, inside, core


@dataclass(frozen=True)
class HeadLayer:
    """Final norm, LM head (D -> V, no bias) and cross-entropy: (B, S, D) -> scalar loss.

    FLOPs: the LM head 2bshV forward, the same again for I and for W (a weight matmul).
    Stash: norm input and output 2·bsh·d, and the fp32 logits b·s·V·4 that cross-entropy
    keeps (its softmax). It counts its own V·h parameters even with tied embeddings
    (`GPTConfig.tie_embeddings`): a stage holding the head without the embedding keeps a
    copy; `ModelSpec.params` and `CostModel.stage_params` count the matrix once where
    both sit together. Sends nothing: the loss ends the forward.
    """

    config: GPTConfig
    kind: ClassVar[str] = "head"

    @property
    def params(self) -> int:
        c = self.config
        return c.vocab_size * c.d_model + _norm_params(c)

    def cost(self, micro_batch: int, seq_len: int, dtype_bytes: int) -> LayerCost:
        c = self.config
        b, s, h, v, d = micro_batch, seq_len, c.d_model, c.vocab_size, dtype_bytes
        lm = 2 * b * s * h * v
        stash = self.stash_bytes(b, s, d)
        return LayerCost(
            fwd_flops=float(lm), i_flops=float(lm), w_flops=float(lm), send_bytes=0.0,
            stash_bytes=float(stash), mem_bytes=float(self.params * d + stash))

    def stash_bytes(self, micro_batch: int, seq_len: int, dtype_bytes: int, *, tp: int = 1,
                    sequence_parallel: bool = False, recompute: str = "none") -> float:
        """Norm input and output (split by sequence parallelism) and the fp32 logits, split
        over the vocabulary by tensor parallelism (Megatron's vocab-parallel
        cross-entropy). Not recomputed (Megatron checkpoints blocks only)."""
        b, s, h = micro_batch, seq_len, self.config.d_model
        norm = 2 * b * s * h * dtype_bytes / (tp if sequence_parallel else 1)
        return float(norm + b * s * self.config.vocab_size * 4 / tp)


@dataclass(frozen=True)
class SyntheticLayer:
    """A layer given by its costs per sample, for what-if and test work (docs/formats.md).

    All `*_per_sample` values already include the sequence and the dtype, so `cost` only
    multiplies by the micro-batch. `hidden` (optional) is the width of the small module
    (Linear(hidden, hidden) + tanh) built when a synthetic model is run for real.
    """

    fwd_flops_per_sample: float
    i_flops_per_sample: float
    w_flops_per_sample: float
    activation_bytes_per_sample: float
    stash_bytes_per_sample: float
    params: int = 0
    hidden: int | None = None
    kind: ClassVar[str] = "synthetic"

    def cost(self, micro_batch: int, seq_len: int, dtype_bytes: int) -> LayerCost:
        b = micro_batch
        send = b * self.activation_bytes_per_sample
        return LayerCost(
            fwd_flops=b * self.fwd_flops_per_sample, i_flops=b * self.i_flops_per_sample,
            w_flops=b * self.w_flops_per_sample, send_bytes=float(send),
            stash_bytes=b * self.stash_bytes_per_sample,
            mem_bytes=float(self.params * dtype_bytes + send))

    def recompute_fraction(self, micro_batch: int, seq_len: int, recompute: str) -> float:
        """All of its forward runs again with "full" recompute, none of it otherwise."""
        return 1.0 if recompute == "full" else 0.0

    def stash_bytes(self, micro_batch: int, seq_len: int, dtype_bytes: int, *, tp: int = 1,
                    sequence_parallel: bool = False, recompute: str = "none") -> float:
        """Its stash split over tp; with full recompute only its input, taken to be the
        size of its output (a synthetic layer does not say more)."""
        if recompute == "full":
            return micro_batch * self.activation_bytes_per_sample / \
                (tp if sequence_parallel else 1)
        return micro_batch * self.stash_bytes_per_sample / tp


Layer = EmbeddingLayer | TransformerBlock | MoEBlock | HeadLayer | SyntheticLayer


def _block_cost(block: TransformerBlock, b: int, s: int, d: int, mlp_flops: float
                ) -> LayerCost:
    """One micro-batch's cost of a pre-norm block whose MLP part (dense MLP, or router
    and experts) does `mlp_flops` of forward matmuls: attention as `TransformerBlock`'s
    docstring counts it (QKV and output projections, the two weightless s² matmuls),
    I = matmul + 2 · attention-s², W = matmul."""
    c = block.config
    h, q = c.d_model, c.q_dim
    qkv = 2 * b * s * h * (q + 2 * c.kv_dim)
    attn_s2 = 4 * b * s * s * q             # QKᵀ and AV; no weights
    out_proj = 2 * b * s * q * h
    matmul = qkv + out_proj + mlp_flops
    stash = block.stash_bytes(b, s, d)
    out = b * s * h * d
    return LayerCost(
        fwd_flops=float(matmul + attn_s2), i_flops=float(matmul + 2 * attn_s2),
        w_flops=float(matmul), send_bytes=float(out), stash_bytes=float(stash),
        mem_bytes=float(block.params * d + stash + out))


def _learned(c: GPTConfig) -> bool:
    return c.position == "learned"


def _norm_params(c: GPTConfig) -> int:
    """LayerNorm: weight (+ bias when c.bias); RMSNorm: weight only."""
    return c.d_model * (2 if c.norm == "layernorm" and c.bias else 1)


# --------------------------------------------------------------------------- model

@dataclass(frozen=True)
class ModelSpec:
    """An ordered tuple of layers: embedding, N blocks, head (or synthetic layers)."""

    name: str
    layers: tuple[Layer, ...]
    seq_len: int                        # tokens per sample
    dtype: str = "bf16"                 # training dtype of weights and activations
    config: GPTConfig | None = None     # None for synthetic models
    optimizer_state: str = "mixed"      # one of OPTIMIZER_STATES

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise BadInput(f"model {self.name}: layers", "at least one layer", 0)
        check_int(self.seq_len, f"model {self.name}: seq_len")
        if self.dtype not in DTYPE_BYTES:
            raise BadInput(f"model {self.name}: dtype", f"one of {list(DTYPE_BYTES)}",
                           self.dtype)
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise BadInput(f"model {self.name}: optimizer_state",
                           f"one of {list(OPTIMIZER_STATES)}", self.optimizer_state)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def params(self) -> int:
        """Distinct parameters: a tied embedding matrix counted once."""
        return sum(layer.params for layer in self.layers) - self.tied_params

    @property
    def active_params(self) -> int:
        """Parameters one token meets (`MoEBlock.active_params` for MoE blocks, all of
        any other layer), a tied embedding counted once: DeepSeek-V3's "37B activated"."""
        return sum(getattr(layer, "active_params", layer.params) for layer in self.layers) \
            - self.tied_params

    @property
    def tied_params(self) -> int:
        """Parameters of the token-embedding matrix that the head reuses as its output
        projection (V x h), 0 when the embeddings are untied or the model is synthetic.
        The head layer still counts it: a pipeline stage holding the head alone keeps
        its own copy."""
        c = self.config
        return c.vocab_size * c.d_model if c is not None and c.tie_embeddings else 0

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def storage_dtype(self) -> str:
        """What weights, activations and gradients are kept in (`STORAGE_DTYPES`): the
        dtype, but fp32 for tf32 and bf16 for fp8."""
        return STORAGE_DTYPES[self.dtype]

    def layer_cost(self, index: int, micro_batch: int) -> LayerCost:
        """Cost of layer `index` for one micro-batch of `micro_batch` samples."""
        if not 0 <= index < len(self.layers):
            raise IndexError(f"layer {index} of a {len(self.layers)}-layer model")
        if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) \
                or micro_batch < 1:
            raise ValueError(f"micro_batch must be a positive integer, got {micro_batch!r}")
        return self.layers[index].cost(micro_batch, self.seq_len, self.dtype_bytes)

    def stash_bytes(self, index: int, micro_batch: int, *, tp: int = 1,
                    sequence_parallel: bool = False, recompute: str = "none") -> float:
        """Bytes layer `index` keeps from its forward until its backward for one
        micro-batch, per device of a tensor-parallel group of `tp`."""
        return self.layers[index].stash_bytes(
            micro_batch, self.seq_len, self.dtype_bytes, tp=tp,
            sequence_parallel=sequence_parallel, recompute=recompute)

    def recompute_fraction(self, index: int, micro_batch: int, recompute: str) -> float:
        """Fraction of layer `index`'s forward that its backward runs again under
        `recompute` (0 for layers that are not checkpointed: embedding and head)."""
        layer = self.layers[index]
        if not hasattr(layer, "recompute_fraction"):
            return 0.0
        return layer.recompute_fraction(micro_batch, self.seq_len, recompute)

    def to_dict(self) -> dict:
        """A JSON-able form that `load_model` reads back to an equal spec."""
        state = {} if self.optimizer_state == "mixed" else \
            {"optimizer_state": self.optimizer_state}
        if self.config is not None:
            return {"kind": "gpt", "name": self.name, "dtype": self.dtype, **state,
                    **asdict(self.config)}
        rows = [_synthetic_row(layer) for layer in self.layers]
        out: dict[str, Any] = {"kind": "synthetic", "name": self.name, "dtype": self.dtype,
                               **state, "seq_len": self.seq_len}
        if all(row == rows[0] for row in rows):
            out.update(rows[0], layers=len(rows))
        else:
            out["layers"] = rows
        return out


def is_moe_layer(spec: ModelSpec, index: int) -> bool:
    """Whether layer `index` of a GPT spec (layer 0 the embedding, so block index - 1)
    is a mixture-of-experts block."""
    c = spec.config
    return (c is not None and c.moe is not None and 0 < index <= c.n_layer
            and c.moe.is_moe_block(index - 1))


def gpt_spec(name: str, config: GPTConfig, dtype: str = "bf16",
             optimizer_state: str = "mixed") -> ModelSpec:
    """The layers of a GPT: embedding, config.n_layer blocks (MoE blocks where
    `MoEConfig.is_moe_block`), head."""
    block = TransformerBlock(config)
    moe = MoEBlock(config) if config.moe is not None else None
    blocks = [moe if moe is not None and config.moe.is_moe_block(i) else block
              for i in range(config.n_layer)]
    layers = (EmbeddingLayer(config), *blocks, HeadLayer(config))
    return ModelSpec(name=name, layers=layers, seq_len=config.seq_len, dtype=dtype,
                     config=config, optimizer_state=optimizer_state)


def _synthetic_row(layer: Layer) -> dict:
    if not isinstance(layer, SyntheticLayer):
        raise TypeError(f"a model without a GPT config holds {type(layer).__name__}")
    row = {"fwd_flops_per_sample": layer.fwd_flops_per_sample,
           "i_flops_per_sample": layer.i_flops_per_sample,
           "w_flops_per_sample": layer.w_flops_per_sample,
           "activation_bytes_per_sample": layer.activation_bytes_per_sample,
           "stash_bytes_per_sample": layer.stash_bytes_per_sample,
           "params_per_layer": layer.params}
    if layer.hidden is not None:
        row["hidden"] = layer.hidden
    return row


__all__ = [
    "ATTENTION_KINDS", "DTYPE_BYTES", "LayerCost", "MoEConfig", "MOE_KEYS", "check_moe",
    "GPTConfig", "EmbeddingLayer", "MoEBlock",
    "TransformerBlock", "HeadLayer", "SyntheticLayer", "Layer", "ModelSpec", "gpt_spec",
    "check_config", "is_moe_layer",
]
