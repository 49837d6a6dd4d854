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
    TransformerBlock,
)

PASSES = ("F", "I", "W")
MASK_BYTES = 1            # a dropout mask element (torch keeps bool/uint8 masks)
LOGIT_BYTES = 4           # cross-entropy works on fp32 logits


@dataclass(frozen=True)
class Gemm:
    """`batch` matrix multiplications C[M,N] = A[M,K] B[K,N] run as one kernel."""

    m: float
    n: float
    k: float
    batch: float = 1

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
    if isinstance(layer, TransformerBlock):
        return _block(*args, cp)
    if args is not None and cp > 1:             # embedding, head: s/cp tokens per rank
        args = (*args[:3], seq_len / cp, *args[4:])
    if isinstance(layer, HeadLayer):
        return _head(*args)
    if isinstance(layer, EmbeddingLayer):
        return _embedding(*args)
    return None


def _weight_gemms(op: str, tokens: float, shapes: list[tuple[float, float]]
                  ) -> list[Gemm]:
    """Forward (T, out, in), I (T, in, out), W (in, out, T) of weight GEMMs given as
    (in, out) pairs."""
    if op == "F":
        return [Gemm(tokens, o, i) for i, o in shapes]
    if op == "I":
        return [Gemm(tokens, i, o) for i, o in shapes]
    return [Gemm(i, o, tokens) for i, o in shapes]


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
# * elementwise kernels are fused as Megatron fuses them (bias+GeLU, bias+dropout+add);
#   without sequence parallelism the norms, dropouts and residual adds run on the whole
#   (T, h) activation on every tensor-parallel rank, with it on T/t tokens.
def attention_gemms(c: GPTConfig, op: str, b: int, s: float, t: int, cp: int = 1
                    ) -> list[Gemm]:
    """The attention core's GEMMs (no weights) of pass `op` on one device: b·a/t heads;
    with context parallelism cp ring steps, each the rank's s/cp queries against s/cp
    keys, run as one batch of cp x the heads (see the conventions above `_block`)."""
    a, hd = c.n_head, c.head_dim
    q = s / cp
    heads = b * a / t * cp
    flash = getattr(c, "attention", "flash") == "flash"
    if op == "F":
        return [Gemm(q, hd, q, heads)] * 2 if flash else \
            [Gemm(q, q, hd, heads), Gemm(q, hd, q, heads)]
    if op == "I":
        return [Gemm(q, hd, q, heads)] * 5 if flash else \
            [Gemm(q, q, hd, heads)] + [Gemm(q, hd, q, heads)] * 3
    return []


def _block(c: GPTConfig, op: str, b: int, s: int, d: int, t: int, sp: bool, cp: int = 1
           ) -> PassWork:
    h, f, a, kv = c.d_model, c.ffn_hidden, c.n_head, c.kv_dim
    tokens = b * s / cp
    swiglu = c.mlp == "swiglu"
    up = (2 if swiglu else 1) * f / t                   # gate and up, or up
    shapes = [(h, (h + 2 * kv) / t), (h / t, h), (h, up), (f / t, h)]
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
    if op == "F":
        norms = 2 * 2 * e_h * d                         # two norms: read x, write y
        resid = 2 * e_h * (3 * d + mask)                # bias(+dropout)+add: 2 reads, 1 write
        act = (3 if swiglu else 2) * e_f * d            # bias+GeLU or silu(gate)*up
        rot = 2 * tokens * (h + kv) / t * d if rope else 0
        attn = 0.0 if flash else 2 * e_s * d + (e_s * (2 * d + mask) if drop else 0)
        return PassWork(tuple(gemms), norms + resid + act + rot + attn)
    if op == "I":
        norms = 2 * 3 * e_h * d                         # read x and dy, write dx
        resid = 2 * e_h * (2 * d + mask) + 2 * 3 * e_h * d   # dropout bwd, grad add
        act = (5 if swiglu else 3) * e_f * d
        rot = 2 * tokens * (h + kv) / t * d if rope else 0
        attn = 0.0 if flash else 3 * e_s * d + (e_s * (2 * d + mask) if drop else 0)
        return PassWork(tuple(gemms), norms + resid + act + rot + attn)
    # W: bias gradients reduce dY over the tokens (read once)
    bias = tokens * ((h + 2 * kv) / t + h + up + h) * d if c.bias else 0.0
    return PassWork(tuple(gemms), bias)


def _head(c: GPTConfig, op: str, b: int, s: int, d: int, t: int, sp: bool) -> PassWork:
    h, v = c.d_model, c.vocab_size
    tokens = b * s
    gemms = _weight_gemms(op, tokens, [(h, v / t)])
    e_h = tokens * h / (t if sp else 1)
    e_v = tokens * v / t
    if op == "F":
        # final norm; logits cast to fp32, max/sum-exp pass, softmax kept for backward
        return PassWork(tuple(gemms), 2 * e_h * d + e_v * (d + 4 * LOGIT_BYTES))
    if op == "I":
        # d(logits) = softmax - onehot: read fp32 probs, write the gradient; norm backward
        return PassWork(tuple(gemms), e_v * (LOGIT_BYTES + d) + 3 * e_h * d)
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


__all__ = ["Gemm", "PassWork", "attention_gemms", "layer_work", "PASSES"]
