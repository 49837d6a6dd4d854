"""Layer work op by op: the GEMMs and the memory-bound bytes of each pass, per device.

`LayerCost` (in `hyperpipe.models.spec`) gives a layer's totals; this module breaks one
pass of one layer on one device of a tensor-parallel group into what a cost model needs
to price it by shape: the matrix multiplications with their (M, N, K) and the bytes the
memory-bound kernels move (norms, softmax, dropout, residual adds, activations, bias
gradients, cross-entropy). Passes are counted separately, not as multiples of the
forward: `F` forward, `I` input gradient, `W` weight gradient (torch.distributed.
pipelining's names).

Shape conventions (tensor and sequence parallelism, attention, fused kernels) are stated
above `_block`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperpipe.models.spec import (
    EmbeddingLayer,
    GPTConfig,
    HeadLayer,
    Layer,
    MoEBlock,
    TransformerBlock,
)

PASSES = ("F", "I", "W")
MASK_BYTES = 1            # a dropout mask element (torch keeps bool/uint8 masks)
LOGIT_BYTES = 4           # cross-entropy works on fp32 logits
CAUSAL_FRACTION = 1 / 1.75  # a causal flash kernel's time over the full square's: "around
                            # 1.7-1.8x speedup" (FlashAttention-2, Dao 2023, sec. 3.1.1)


@dataclass(frozen=True)
class Gemm:
    """`batch` matrix multiplications C[M,N] = A[M,K] B[K,N] run as one kernel."""

    m: float
    n: float
    k: float
    batch: float = 1
    linear: bool = False
    """A block's linear layer (QKV, attention output, MLP, experts): what FP8 recipes
    multiply in fp8 (Transformer Engine's `Linear` and `LayerNormMLP`). The attention
    core's batched GEMMs, the logits and the router stay in the higher precision
    (`hyperpipe.sim.compute.gemm_dtype`)."""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch

    @property
    def io_bytes_per_element(self) -> float:
        """Elements read and written once (A, B, C) per batch, for the memory roofline."""
        return (self.m * self.k + self.k * self.n + self.m * self.n) * self.batch


@dataclass(frozen=True)
class PassWork:
    """One pass of one layer on one device: its GEMMs and its memory-bound bytes."""

    gemms: tuple[Gemm, ...]
    mem_bytes: float

    @property
    def flops(self) -> float:
        return sum(g.flops for g in self.gemms)


def layer_work(layer: Layer, op: str, micro_batch: int, seq_len: int, dtype_bytes: int,
               tp: int = 1, sequence_parallel: bool = False, cp: int = 1
               ) -> PassWork | None:
    """The work of pass `op` ("F", "I" or "W") of `layer` on one device of a
    tensor-parallel group of `tp` in context rank of `cp` (the sequence split over cp
    ranks, ring attention: each rank's queries meet every key, cp steps of s/cp keys);
    None for layers without shapes (synthetic)."""
    if op not in PASSES:
        raise ValueError(f"op must be one of {PASSES}, got {op!r}")
    args = (layer.config, op, micro_batch, seq_len, dtype_bytes, tp, sequence_parallel) \
        if hasattr(layer, "config") else None
    if isinstance(layer, MoEBlock):
        base, routed = _moe_block(layer, *args[1:], cp)
        return PassWork(base.gemms + routed.gemms, base.mem_bytes + routed.mem_bytes)
    if isinstance(layer, TransformerBlock):
        return _block(*args, cp)
    if args is not None and cp > 1:             # embedding, head: s/cp tokens per rank
        args = (*args[:3], seq_len / cp, *args[4:])
    if isinstance(layer, HeadLayer):
        return _head(*args)
    if isinstance(layer, EmbeddingLayer):
        return _embedding(*args)
    return None


def _weight_gemms(op: str, tokens: float, shapes: list[tuple[float, float]],
                  linear: bool = True) -> list[Gemm]:
    """Forward (T, out, in), I (T, in, out), W (in, out, T) of weight GEMMs given as
    (in, out) pairs; `linear`: a block's linear layers (`Gemm.linear`)."""
    if op == "F":
        return [Gemm(tokens, o, i, 1, linear) for i, o in shapes]
    if op == "I":
        return [Gemm(tokens, i, o, 1, linear) for i, o in shapes]
    return [Gemm(i, o, tokens, 1, linear) for i, o in shapes]


# Conventions (Megatron-LM tensor parallelism, Shoeybi et al. 2019; sequence parallelism,
# Korthikanti et al. 2022, arXiv 2205.05198), with b micro-batch, s sequence, h d_model,
# f ffn_hidden, a heads, h_kv the K/V width, t the tensor-parallel degree, d bytes per
# element, T = b·s tokens:
#
# * weight GEMMs are split over t: QKV and MLP-up column-parallel (N/t), out-projection and
#   MLP-down row-parallel (K/t); the LM head is vocabulary-parallel (N = V/t);
# * a weight GEMM (M, N, K) = (T, out, in) has backward dX = (T, in, out) in `I` and
#   dW = (in, out, T) in `W`;
# * eager attention: QKᵀ is a batch of b·a/t GEMMs (s, s, hd) and AV (s, hd, s); the
#   backward computes dP (s, s, hd), dV, dQ, dK (s, hd, s), all in `I` (no weights);
#   scale-mask-softmax is one fused kernel (Megatron's FusedScaleMaskSoftmax) reading and
#   writing the b·a·s²/t scores, and dropout reads them, writes them and a 1-byte mask;
# * flash attention (Dao 2022; FlashAttention-2, Dao 2023): one fused kernel whose main
#   loop runs over the key sequence, so both of its GEMMs are costed with depth s; nothing
#   of size s² touches memory; its backward recomputes QKᵀ (5 GEMMs instead of 4);
#   with the causal mask it skips the key blocks above the diagonal ("about half of the
#   blocks for large sequence length ... around 1.7-1.8x speedup", FlashAttention-2, Dao
#   2023, sec. 3.1.1; the flash-attention repository's benchmarks/
#   benchmark_flash_attention.py counts a causal pass as 4·b·s²·a·hd / 2), so its GEMMs
#   run on CAUSAL_FRACTION of the tiles' time (the batch scaled: the same tile shapes,
#   fewer of them; the diagonal tiles are masked); with context parallelism and two chunks
#   per rank each rank gets the same half (Megatron-LM/TransformerEngine's load
#   balancing). Eager attention computes the whole square and masks it. The layer's
#   FLOP count (`TransformerBlock`, what MFU reports) keeps the whole square;
# * elementwise kernels are fused as Megatron fuses them (bias+GeLU, bias+dropout+add);
#   without sequence parallelism the norms, dropouts and residual adds run on the whole
#   (T, h) activation on every tensor-parallel rank, with it on T/t tokens;
# * unfused (`GPTConfig.fused_elementwise` false; Megatron-LM v1.1.5's `bias_dropout_add`,
#   `activation_func(x + bias)` and `FusedScaleMaskSoftmax`'s torch fallback): each link
#   of a chain reads its input and writes its output. Forward: bias add then GeLU (or
#   silu(gate) then x up), bias add, dropout, residual add, and mask (`masked_fill`)
#   then softmax; backward: the mask's gradient is one more pass over the scores; the
#   other backward chains move what the fused kernels move.
def attention_gemms(c: GPTConfig, op: str, b: int, s: float, t: int, cp: int = 1
                    ) -> list[Gemm]:
    """The attention core's GEMMs (no weights) of pass `op` on one device: b·a/t heads;
    with context parallelism cp ring steps, each the rank's s/cp queries against s/cp
    keys, run as one batch of cp x the heads; a flash kernel's causal half of them (see
    the conventions above `_block`)."""
    a, hd = c.n_head, c.head_dim
    q = s / cp
    flash = getattr(c, "attention", "flash") == "flash"
    heads = b * a / t * cp * (CAUSAL_FRACTION if flash else 1.0)
    if op == "F":
        return [Gemm(q, hd, q, heads)] * 2 if flash else \
            [Gemm(q, q, hd, heads), Gemm(q, hd, q, heads)]
    if op == "I":
        return [Gemm(q, hd, q, heads)] * 5 if flash else \
            [Gemm(q, q, hd, heads)] + [Gemm(q, hd, q, heads)] * 3
    return []


def _block(c: GPTConfig, op: str, b: int, s: int, d: int, t: int, sp: bool, cp: int = 1
           ) -> PassWork:
    h, f, a, kv, q = c.d_model, c.ffn_hidden, c.n_head, c.kv_dim, c.q_dim
    tokens = b * s / cp
    swiglu = c.mlp == "swiglu"
    up = (2 if swiglu else 1) * f / t                   # gate and up, or up
    shapes = [(h, (q + 2 * kv) / t), (q / t, h), (h, up), (f / t, h)]
    gemms = _weight_gemms(op, tokens, shapes) + attention_gemms(c, op, b, s, t, cp)
    heads = b * a / t
    flash = getattr(c, "attention", "flash") == "flash"
    # memory-bound kernels (elements x bytes)
    e_h = tokens * h / (t if sp else 1)                 # norm/dropout/residual activations
    e_f = tokens * f / t                                # MLP hidden, per rank
    e_s = heads * s * s / cp                            # attention scores, per rank
    drop = c.dropout > 0
    mask = MASK_BYTES if drop else 0
    rope = c.position == "rope"
    fused = getattr(c, "fused_elementwise", True)
    if op == "F":
        norms = 2 * 2 * e_h * d                         # two norms: read x, write y
        if fused:
            resid = 2 * e_h * (3 * d + mask)            # bias(+dropout)+add: 2 reads, 1 write
            act = (3 if swiglu else 2) * e_f * d        # bias+GeLU or silu(gate)*up
        else:       # (bias add) (dropout) residual add; (bias add) GeLU or silu, then x up
            resid = 2 * e_h * ((2 * d if c.bias else 0) + (2 * d + mask if drop else 0)
                               + 3 * d)
            act = ((5 if swiglu else 2) + (2 if c.bias else 0)) * e_f * d
        rot = 2 * tokens * (q + kv) / t * d if rope else 0
        softmax = 2 * e_s * d * (1 if fused else 2)     # (mask, then) softmax
        attn = 0.0 if flash else softmax + (e_s * (2 * d + mask) if drop else 0)
        return PassWork(tuple(gemms), norms + resid + act + rot + attn)
    if op == "I":
        norms = 2 * 3 * e_h * d                         # read x and dy, write dx
        resid = 2 * e_h * (2 * d + mask) + 2 * 3 * e_h * d   # dropout bwd, grad add
        act = (5 if swiglu else 3) * e_f * d
        rot = 2 * tokens * (q + kv) / t * d if rope else 0
        softmax = 3 * e_s * d + (0 if fused else 2 * e_s * d)   # (and the mask's) backward
        attn = 0.0 if flash else softmax + (e_s * (2 * d + mask) if drop else 0)
        return PassWork(tuple(gemms), norms + resid + act + rot + attn)
    # W: bias gradients reduce dY over the tokens (read once)
    bias = tokens * ((q + 2 * kv) / t + h + up + h) * d if c.bias else 0.0
    return PassWork(tuple(gemms), bias)


def routed_expert_work(layer: MoEBlock, op: str, micro_batch: int, seq_len: int,
                       dtype_bytes: int, tp: int = 1, sequence_parallel: bool = False,
                       cp: int = 1) -> PassWork:
    """The routed experts' share of `layer_work` of an MoE block (their GEMMs, their
    activation kernels, the permutation of dispatched tokens): the part expert
    parallelism spreads over its ranks."""
    if op not in PASSES:
        raise ValueError(f"op must be one of {PASSES}, got {op!r}")
    return _moe_block(layer, op, micro_batch, seq_len, dtype_bytes, tp, sequence_parallel,
                      cp)[1]


def _expert_gemms(op: str, tokens: float, count: float, h: float, up: float, f: float
                  ) -> list[Gemm]:
    """`count` experts of `tokens` tokens each, batched: up (and gate) (h -> up) and down
    (f -> h), forward (T, out, in), I (T, in, out), W (in, out, T)."""
    if count <= 0 or tokens <= 0:
        return []
    shapes = [(h, up), (f, h)]
    if op == "F":
        return [Gemm(tokens, o, i, count, True) for i, o in shapes]
    if op == "I":
        return [Gemm(tokens, i, o, count, True) for i, o in shapes]
    return [Gemm(i, o, tokens, count, True) for i, o in shapes]


def _moe_block(layer: MoEBlock, op: str, b: int, s: int, d: int, t: int, sp: bool,
               cp: int = 1) -> tuple[PassWork, PassWork]:
    """(attention, router and shared experts; routed experts) of an MoE block's pass.
    The dense block's work less its MLP, the router (h x E, on every tensor rank, no
    bias), S shared experts on all T tokens, and the E routed experts as E batched GEMMs
    of the mean P/E pairs each (P: `MoEConfig.routed_pairs`), split over the tensor
    group as the dense MLP (Megatron-Core's expert_tensor_parallel_size = tp). The
    permutation reads and writes every dispatched token (h wide) before the experts
    and again after them (Megatron-Core's `permute`/`unpermute`), in F and in I."""
    c, m = layer.config, layer.moe
    h, fe = c.d_model, m.expert_hidden
    swiglu = c.mlp == "swiglu"
    tokens = b * s / cp
    dense = _block(c, op, b, s, d, t, sp, cp)
    up_d = (2 if swiglu else 1) * c.ffn_hidden / t
    mlp = _weight_gemms(op, tokens, [(h, up_d), (c.ffn_hidden / t, h)])
    gemms = list(dense.gemms)
    for g in mlp:
        gemms.remove(g)
    e_f = tokens * c.ffn_hidden / t
    mem = dense.mem_bytes
    if op == "F":
        mem -= (3 if swiglu else 2) * e_f * d
    elif op == "I":
        mem -= (5 if swiglu else 3) * e_f * d
    elif c.bias:
        mem -= tokens * (up_d + h) * d
    routed = m.routed_pairs(tokens)
    shared = m.shared_experts * tokens
    up = (2 if swiglu else 1) * fe / t
    act = {"F": 3 if swiglu else 2, "I": 5 if swiglu else 3, "W": 0}[op]
    bias = (up + h) * d if c.bias and op == "W" else 0.0
    if m.experts > 1:
        gemms += _weight_gemms(op, tokens, [(h, m.experts)], linear=False)   # router
        mem += tokens * m.experts * 4 * 2 if op != "W" else 0.0        # fp32 softmax
    gemms += _expert_gemms(op, tokens, m.shared_experts, h, up, fe / t)
    mem += shared * (act * fe / t * d + bias)
    routed_gemms = _expert_gemms(op, routed / m.experts, m.experts, h, up, fe / t)
    routed_mem = routed * (act * fe / t * d + bias)
    if m.experts > 1 and op != "W":
        routed_mem += 2 * 2 * routed * h * d                           # permute, unpermute
    return PassWork(tuple(gemms), mem), PassWork(tuple(routed_gemms), routed_mem)


# Kernel launches of one pass of a block, as an eager framework issues them (torch
# modules; Megatron-Core's MoE layer, megatron/core/transformer/moe/moe_layer.py: router
# `TopKRouter` (gating GEMM, softmax, top-k, normalisation), token dispatcher `permute`
# (sort by expert, count, gather), experts, `unpermute` (scale by the gates,
# scatter-add)). Views and reshapes launch nothing. A forward kernel has one backward
# kernel in I (FlashAttention's backward: one); W launches one weight-gradient GEMM per
# weight and one reduction per bias. `SequentialMLP` (megatron/core/transformer/moe/
# experts.py), Hugging Face's Mixtral block and hyperpipe's executor (`models.gpt.MoE`)
# run each local expert as its own MLP, its own GEMM launches; a grouped GEMM
# (`GroupedMLP`, `TEGroupedMLP`) launches once for all (`grouped`).
ROUTER_KERNELS = 4        # gating GEMM, softmax, top-k, renormalise
PERMUTE_KERNELS = 3       # sort by expert, count per expert, gather the rows
UNPERMUTE_KERNELS = 2     # scale by the gates, scatter-add


def _mlp_launches(c: GPTConfig, op: str) -> int:
    """One MLP's launches: its GEMMs (up, gate with SwiGLU, down) and its activation
    (GeLU, or SiLU and the product), W: a GEMM per weight and a reduction per bias."""
    gemms = 3 if c.mlp == "swiglu" else 2
    if op == "W":
        return gemms * (2 if c.bias else 1)
    return gemms + (2 if c.mlp == "swiglu" else 1)


def pass_launches(layer: Layer, op: str, local_experts: int | None = None,
                  grouped: bool = False) -> int:
    """Kernels one pass ("F", "I", "W") of a block launches (see the conventions above):
    a dense block's norms, weight GEMMs, attention core, activation and residual adds;
    an MoE block's instead of its MLP, the router, permute and unpermute and each of
    `local_experts` routed experts (None: all) and each shared expert as its own MLP, or
    one grouped MLP when `grouped`. 0 for other layers."""
    if op not in PASSES:
        raise ValueError(f"op must be one of {PASSES}, got {op!r}")
    if not isinstance(layer, TransformerBlock):
        return 0
    c = layer.config
    n = block_launches(c, op)
    if not isinstance(layer, MoEBlock):
        return n
    m = layer.moe
    local = m.experts if local_experts is None else local_experts
    n -= _mlp_launches(c, op)
    n += (1 if grouped else local) * _mlp_launches(c, op) if local else 0
    n += m.shared_experts * _mlp_launches(c, op)
    if m.experts > 1:
        n += 1 if op == "W" else ROUTER_KERNELS + PERMUTE_KERNELS + UNPERMUTE_KERNELS
    return n


def block_launches(c: GPTConfig, op: str) -> int:
    """Kernels one pass of a dense block of `c` launches (`pass_launches`)."""
    flash = getattr(c, "attention", "flash") == "flash"
    drop = c.dropout > 0
    if op == "W":
        attn = 2 * (2 if c.bias else 1)                 # QKV and out-projection
        n = attn + _mlp_launches(c, "W")
    else:
        norms, resid = 2, 2 * (2 if drop else 1)        # (dropout +) add, twice
        core = 1 if flash else 3 + (1 if drop else 0)   # QK^T, mask-softmax, AV (dropout)
        rope = 2 if c.position == "rope" else 0
        n = norms + resid + 2 + core + rope + _mlp_launches(c, op)
        if not getattr(c, "fused_elementwise", True):   # the links of the unfused chains
            n += (0 if flash else 1) + (3 if c.bias else 0)   # mask; three bias adds
    return n


# The loss over the logits, as Megatron computes it (`VocabParallelCrossEntropy`,
# megatron/core/tensor_parallel/cross_entropy.py; the same passes in Megatron-LM v1.1.5's
# mpu/cross_entropy.py, which Megatron-DeepSpeed runs after DeepSpeed's `fp16_to_fp32`
# layer), one kernel per line, in bytes per logit element of the rank's vocabulary
# slice: forward: cast to fp32 (read d, write 4), max (read 4), subtract the max in
# place (read and write), exp in place (read and write), sum (read), divide by the sum
# in place, which is the softmax saved for the backward (read and write): d + 9 x 4.
# Backward: the saved softmax becomes the gradient (one subtracted at each target, a
# gather's worth), multiplied by the loss gradient in place (read and write), cast back
# to the model dtype (read 4, write d): 3 x 4 + d. (PyTorch's `F.cross_entropy`, which
# torchtitan calls on `.float()` logits, moves about as much: d + 5 x 4 forward, a max,
# a sum and an output pass; d + 5 x 4 backward, the zeroed NLL gradient and the
# log-softmax backward.)
LOSS_FORWARD_LOGIT_PASSES = 9           # fp32 reads and writes per element, forward
LOSS_BACKWARD_LOGIT_PASSES = 3          # fp32 reads and writes per element, backward


def _head(c: GPTConfig, op: str, b: int, s: int, d: int, t: int, sp: bool) -> PassWork:
    h, v = c.d_model, c.vocab_size
    tokens = b * s
    gemms = _weight_gemms(op, tokens, [(h, v / t)], linear=False)
    e_h = tokens * h / (t if sp else 1)
    e_v = tokens * v / t
    if op == "F":
        # final norm (read x, write y); the loss over the fp32 logits (see above)
        return PassWork(tuple(gemms), 2 * e_h * d
                        + e_v * (d + LOSS_FORWARD_LOGIT_PASSES * LOGIT_BYTES))
    if op == "I":
        # the loss's backward (see above); the norm's backward (read x and dy, write dx)
        return PassWork(tuple(gemms), e_v * (LOSS_BACKWARD_LOGIT_PASSES * LOGIT_BYTES + d)
                        + 3 * e_h * d)
    return PassWork(tuple(gemms), 0.0)


def _embedding(c: GPTConfig, op: str, b: int, s: int, d: int, t: int, sp: bool
               ) -> PassWork:
    h = c.d_model
    tokens = b * s
    tables = 2 if c.position == "learned" else 1
    if op == "F":      # gather rows (read + write), position add, dropout
        drop = (2 * d + MASK_BYTES) if c.dropout > 0 else 0
        return PassWork((), tokens * h * (2 * d + (3 * d if tables == 2 else 0) + drop))
    if op == "I":      # token ids have no gradient
        return PassWork((), 0.0)
    return PassWork((), tables * tokens * h * 3 * d)   # scatter-add: read dy, read+write row


__all__ = ["Gemm", "PassWork", "attention_gemms", "block_launches", "layer_work",
           "pass_launches",
           "routed_expert_work", "PASSES"]
