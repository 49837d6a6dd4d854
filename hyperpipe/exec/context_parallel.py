"""Context parallelism in a real run: the sequence split over a stage's cp ranks, and
ring attention over gloo point-to-point.

**Layout.** The sequence of S tokens is cut into 2·cp equal chunks and context rank c
holds chunks c and 2cp - 1 - c (causal load balancing: every rank gets as much of the
causal triangle as the others), as Megatron-LM and TransformerEngine place them
(TransformerEngine transformer_engine/pytorch/attention/dot_product_attention/
context_parallel.py, `get_seq_chunk_ids_for_reordering_before_attn`: chunk ids 2r and
2cp - 2r - 1 of the zig-zag order; Megatron-LM megatron/core/utils.py
`get_batch_on_this_cp_rank`). `local_positions` gives a rank's global token positions;
the embedding (learned positions) and RoPE use them, so every token keeps its place.
Embedding, MLP, norms and head work on the local tokens only; the loss of a micro-batch
is each rank's mean over its tokens divided by cp, so that the sum over the context
ranks (the data-parallel reduction runs over dp x cp, as Megatron-LM reduces over
`get_data_parallel_group(with_context_parallel=True)`) is the mean over all tokens.

**Ring attention** (Liu et al. 2023, "Ring Attention with Blockwise Transformers";
TransformerEngine's `AttnFuncWithCPAndKVP2P` with `flash_attn_p2p_communicate` for K/V
and dK/dV; torch's own torch/distributed/tensor/experimental/_attention.py, which
torchtitan's `context_parallel` uses). Forward: cp steps; at step i a rank holds the
keys and values of context rank c - i, sends them on to rank c + 1 while it computes
its queries against them (the next block's exchange overlaps this block's compute), and
merges the step's partial result with the log-sum-exp rule of the online softmax
(Milakov and Gimelshein 2018). Backward (a custom autograd Function with its own ring
pass, FlashAttention's backward per block, Dao et al. 2022, alg. 2): the keys and
values travel the ring again, and each block's dK/dV accumulator travels with its block,
one hop behind it: rank c adds its share for the block it holds and passes the sum on;
after cp steps each accumulator reaches its owner. So a forward moves cp - 1 K/V
hops per rank; a backward cp - 1 K/V hops and cp dK/dV hops, the last one exposed.

Masks come from global positions (a query sees a key at or before its position), so the
result equals full causal attention exactly (up to rounding). With `keep_scores`
(eager attention) a rank keeps each step's s/cp x s/cp scores for the backward, 1/cp of
the whole s x s, as the memory model counts eager attention under cp; without it
(flash attention, or selective recompute) the backward recomputes them.

**Emulated links** (exec.links): each hop is a flow of the link emulator from this
rank to the next, posted when sent, queued behind the earlier hops of the same edge,
and the receiver holds the data until the flow has arrived; never timed by the
simulator's cost model. Every hop becomes a `send` event and every wait for one a
`recv` event, stamped with the action (stage, micro-batch) that ran it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hyperpipe.exec.comm import wait
from hyperpipe.plan.trace import TraceEvent

TAG_SPACE = 1 << 20         # gloo tags of a ring's hops: a running count modulo this


def local_positions(seq_len: int, cp: int, c: int) -> torch.Tensor:
    """Global positions (long, length seq_len / cp) of context rank c's tokens: chunks c
    and 2cp - 1 - c of 2·cp equal chunks, in that order."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} does not split into 2 x {cp} chunks")
    if not 0 <= c < cp:
        raise ValueError(f"context rank {c} of {cp}")
    n = seq_len // (2 * cp)
    first = torch.arange(c * n, (c + 1) * n)
    second = torch.arange((2 * cp - 1 - c) * n, (2 * cp - c) * n)
    return torch.cat([first, second])


def local_sequence(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The tokens of `positions` along dim 1 of `x` ((B, S, ...) -> (B, S/cp, ...))."""
    return x.index_select(1, positions.to(x.device))


@dataclass
class _Hop:
    """One exchange in flight: this rank's block to the next rank, the previous rank's
    into `buf`."""

    seq: int
    send: dist.Work
    recv: dist.Work
    buf: torch.Tensor
    sent: torch.Tensor      # kept alive until the send is done
    start_s: float
    nbytes: float


@dataclass
class Ring:
    """One rank's place in its context-parallel ring: the ring's global ranks in context
    order (`ranks[c]` is context rank c, all of one tensor-parallel index), this rank's
    index, the ring's process group, and what timing and tracing need.

    Every rank of the ring calls `exchange` the same number of times in the same order
    (they run the same actions on the same shapes), which names the hops alike on all of
    them: the running count is the gloo tag and the link emulator's flow name."""

    ranks: tuple[int, ...]
    index: int
    group: dist.ProcessGroup | None
    seq_len: int
    timeout_s: float = 300.0
    devices: Sequence[str] = ()     # device name of every global rank (traces)
    clock: Callable[[], float] = field(default=lambda: 0.0)
    links: object | None = None     # exec.links.Links when emulating; None: loopback speed
    keep_scores: bool = False       # eager attention: keep each step's scores for backward
    recording: bool = True          # make trace events (off while timing references)
    step: int = 0                   # stamped on events: the training step ...
    action: tuple[int, int] = (-1, -1)      # ... and the (stage, micro-batch) running
    events: list[TraceEvent] = field(default_factory=list)
    _seq: int = 0

    def __post_init__(self) -> None:
        cp = len(self.ranks)
        self.positions = local_positions(self.seq_len, cp, self.index)
        # masks[j]: which keys of context rank j each of this rank's queries may see
        self.masks = [self.positions[:, None] >= local_positions(self.seq_len, cp, j)[None, :]
                      for j in range(cp)]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.index - 1) % self.size]

    def source(self, i: int) -> int:
        """The context rank whose block this rank holds at ring step i."""
        return (self.index - i) % self.size

    def take_events(self) -> list[TraceEvent]:
        out, self.events = self.events, []
        return out

    # ------------------------------------------------------------------ hops
    def exchange(self, block: torch.Tensor) -> _Hop:
        """Send `block` to the next rank and receive the previous rank's block of the
        same shape, asynchronously; `finish` the returned hop for the received block."""
        self._seq += 1
        seq, me = self._seq, self.ranks[self.index]
        block = block.contiguous()
        buf = torch.empty_like(block)
        nbytes = float(block.numel() * block.element_size())
        start = self.clock()
        if self.links is not None:      # a flow over the emulated links, queued per edge
            self.links.post(("cp", self.ranks[0], seq, me), me, self.next_rank, nbytes,
                            queue=("cp", me, self.next_rank))
        tag = seq % TAG_SPACE
        send = dist.isend(block, self.next_rank, group=self.group, tag=tag)
        recv = dist.irecv(buf, self.prev_rank, group=self.group, tag=tag)
        return _Hop(seq, send, recv, buf, block, start, nbytes)

    def finish(self, hop: _Hop) -> torch.Tensor:
        """Wait for `hop`'s incoming block (held until its emulated flow has arrived) and
        for its send; trace both."""
        start = self.clock()
        what = f"context-parallel exchange with rank {self.prev_rank}"
        wait(hop.recv, self.timeout_s, what)
        if self.links is not None:
            self.links.deliver(("cp", self.ranks[0], hop.seq, self.prev_rank))
        end = self.clock()
        wait(hop.send, self.timeout_s, f"context-parallel exchange with rank {self.next_rank}")
        if self.recording and self.devices:
            me = self.devices[self.ranks[self.index]]
            stage, mb = self.action
            self.events.append(TraceEvent(me, "recv", stage, mb, start, end, hop.nbytes,
                                          self.devices[self.prev_rank], self.step))
            self.events.append(TraceEvent(me, "send", stage, mb, hop.start_s, self.clock(),
                                          hop.nbytes, self.devices[self.next_rank],
                                          self.step))
        return hop.buf

    # ------------------------------------------------------------------ attention
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  keep_scores: bool | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries against every rank's keys:
        q (B, H, T, hd), k and v (B, Hkv, T, hd) of the local T = S/cp tokens ->
        (B, H, T, hd). H must be a multiple of Hkv (grouped-query attention)."""
        keep = self.keep_scores if keep_scores is None else keep_scores
        return _RingAttention.apply(q, k, v, self, keep)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, T, hd) -> (B, Hkv·groups, T, hd): each K/V head serves `groups` queries."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of `_expand`: (B, Hkv·groups, T, hd) -> (B, Hkv, T, hd), summed."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x.view(b, h // groups, groups, t, d).sum(dim=2)


class _RingAttention(torch.autograd.Function):
    """Ring attention with its own ring pass in the backward (see the module doc)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                keep_scores: bool) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        # merged in fp32 at least (bf16 under CUDA autocast), returned in the inputs' dtypes
        dtypes = (q.dtype, k.dtype)
        work = torch.promote_types(q.dtype, torch.float32)
        q, k, v = q.to(work), k.to(work), v.to(work)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=work, device=q.device)
        block = torch.stack((k, v))                         # (2, B, Hkv, T, hd)
        scores = []
        for i in range(ring.size):
            hop = ring.exchange(block) if i + 1 < ring.size else None
            kk, vv = _expand(block[0], groups), _expand(block[1], groups)
            s = (q @ kk.transpose(-2, -1)) * scale                          # (B, H, T, T)
            s = s.masked_fill(~ring.masks[ring.source(i)].to(s.device), float("-inf"))
            new = torch.logaddexp(lse, torch.logsumexp(s, dim=-1))          # (B, H, T)
            # rescale what is merged so far to the new normaliser, add this block's share
            out = out * torch.exp(lse - new).unsqueeze(-1) + \
                torch.exp(s - new.unsqueeze(-1)) @ vv
            lse = new
            if keep_scores:
                scores.append(s)
            if hop is not None:
                block = ring.finish(hop)
        ctx.ring, ctx.groups, ctx.scale, ctx.dtypes = ring, groups, scale, dtypes
        ctx.save_for_backward(q, k, v, out, lse, *scores)
        return out.to(dtypes[0])

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        ring, groups, scale = ctx.ring, ctx.groups, ctx.scale
        q, k, v, out, lse, *scores = ctx.saved_tensors
        dout = dout.to(q.dtype)
        delta = (dout * out).sum(dim=-1, keepdim=True)                     # (B, H, T, 1)
        dq = torch.zeros_like(q)
        block = torch.stack((k, v))
        incoming = None         # the accumulator of the block held now, from rank c - 1
        for i in range(ring.size):
            hop = ring.exchange(block) if i + 1 < ring.size else None
            kk, vv = _expand(block[0], groups), _expand(block[1], groups)
            if scores:
                s = scores[i]
            else:
                s = (q @ kk.transpose(-2, -1)) * scale
                s = s.masked_fill(~ring.masks[ring.source(i)].to(s.device), float("-inf"))
            p = torch.exp(s - lse.unsqueeze(-1))                            # (B, H, T, T)
            dv = p.transpose(-2, -1) @ dout
            ds = p * (dout @ vv.transpose(-2, -1) - delta)
            dq += (ds @ kk) * scale
            dk = (ds.transpose(-2, -1) @ q) * scale
            mine = torch.stack((_fold(dk, groups), _fold(dv, groups)))
            acc = mine if incoming is None else ring.finish(incoming) + mine
            incoming = ring.exchange(acc)       # on to the next rank, one hop behind K/V
            if hop is not None:
                block = ring.finish(hop)
        dkv = ring.finish(incoming)             # every rank's share of our own block
        q_dtype, kv_dtype = ctx.dtypes
        return dq.to(q_dtype), dkv[0].to(kv_dtype), dkv[1].to(kv_dtype), None, None


def attach(layers: Sequence[torch.nn.Module], ring: Ring) -> None:
    """Point the embeddings and attention modules among `layers` (and their children)
    at the ring: global positions for learned positions and RoPE, and the ring as the
    attention core (models.gpt's hooks)."""
    from hyperpipe.models.gpt import CausalSelfAttention, Embedding
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, Embedding):
                m.positions = ring.positions
            elif isinstance(m, CausalSelfAttention):
                m.positions = ring.positions
                m.context = ring


__all__ = ["Ring", "attach", "local_positions", "local_sequence"]
