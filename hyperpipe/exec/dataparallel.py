"""Data-parallel gradient reduction and the optimizer step of one rank.

Gradients are summed over the ranks that hold the same slice of the same layers
(placement.dp_groups: the same shard where the replicas share a tensor-parallel degree;
`placement.dp_slices` where they do not); each micro-batch's loss is already scaled by
micro_batch / global_batch, so the sum is the full-batch mean's gradient whatever each
replica's micro-batch count (the right weighting for heterogeneous replicas). As PyTorch DDP does
(Li et al. 2020) and the simulator models, each group's gradients are cut into buckets
of `bucket_bytes` (fp32, last layer first), each reduced asynchronously once the stage's
last backward action has produced it; without `overlap`, after the rank's last action.
With emulated links (exec.links) every collective runs as its ring steps over them
(exec.collectives), on a worker thread per group; otherwise gloo or NCCL runs it whole.

The optimizer is AdamW on the rank's local tensors (never DTensors). With the
distributed optimizer (ZeRO stage 1/2 as in Megatron's; Rajbhandari et al. 2020) each
bucket is reduce-scattered, AdamW updates this rank's slice alone and an all-gather
brings back the whole: the same update with 1/k of the optimizer state. Every rank
constructs its DataParallel at the same time, with the same groups in the same order.

ZeRO-2 (`zero=2`; DeepSpeed's stage 2, deepspeed/runtime/zero/stage_1_and_2.py, as
`hyperpipe.sim.sharding` models it) also shards the gradients: after every backward
action that produces a stage's weight gradients (B, or W after I) each of its buckets is
reduce-scattered and the whole gradients are freed, this rank keeping the sum of its
slices (1/k of the gradient memory); after the step the updated slices are
all-gathered (the data-parallel segment). Its buckets never span two stages
(`stage_dp_groups`) and, where every parameter is a plain tensor, a bucket's
parameters are views into one flat buffer whose slice is what AdamW steps: no master
copy (fp32 training needs none; the simulator counts none).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from hyperpipe.exec.collectives import RingCollectives
from hyperpipe.exec.comm import PeerFailure, wait
from hyperpipe.exec.links import Links
from hyperpipe.exec.placement import dp_groups
from hyperpipe.exec.tensor_parallel import GradSlices, local
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.stack import DDP_BUCKET_BYTES
from hyperpipe.plan.trace import TraceEvent


def stage_dp_groups(plan: Plan) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """`placement.dp_groups` with each group's layers cut at the stage boundaries of
    the first pipeline (ZeRO-2/3 plans cut every replica alike), so that a group's
    gradients come from one stage's backward actions. The same order on every rank."""
    bounds = {st.layers[0] for st in plan.pipelines[0].stages}
    out = []
    for ranks, layers in dp_groups(plan):
        run: list[int] = []
        for layer in layers:
            if run and (layer in bounds or layer != run[-1] + 1):
                out.append((ranks, tuple(run)))
                run = []
            run.append(layer)
        if run:
            out.append((ranks, tuple(run)))
    return out


@dataclass(eq=False)
class _Bucket:
    """Consecutive parameters (in backward order) of one data-parallel group."""

    pg: dist.ProcessGroup
    size: int                           # ranks in the group
    index: int                          # this rank's place in it
    params: list[nn.Parameter]
    peers: str                          # the other devices, for messages and traces
    numel: int                          # elements of the local tensors, flattened
    after: _Bucket | None = None        # the group's previous bucket (starts first)
    next: _Bucket | None = None
    shard: torch.Tensor | None = None   # distributed optimizer: this rank's slice
    work: tuple | None = None           # this step: (work, buffer, start time) once started
    flat: torch.Tensor | None = None    # ZeRO-2: the buffer the parameters are views of
    pending: list = field(default_factory=list)   # ZeRO-2: reduce-scatters not yet summed
    grad_sum: torch.Tensor | None = None    # ZeRO-2: this rank's slice of the gradient
    ranks: tuple[int, ...] = ()         # the group's global ranks
    ring: RingCollectives | None = None  # emulated links: the group's collectives
    part: int = 0                       # which slice of sliced gradients (`GradSlices`)

    @property
    def padded(self) -> int:
        return -(-self.numel // self.size) * self.size


class DataParallel:
    """Sums gradients over data-parallel groups in buckets overlapped with backward, and
    steps AdamW (optionally sharded).

    `groups`: (ranks, layers) of every group of the job (placement.dp_groups);
    `params_by_layer`: this rank's parameters by global layer index. Per step:
    `zero_grad`, then `arm` before each stage's last backward action and `produced`
    after it, `reduce` after the rank's last action, then `step`. With `links` (the link
    emulator's client; `nodes[r]`: the node of global rank r; `switch_nodes`: the nodes
    whose switch reduces) the collectives run as their steps over the emulated links.
    With `zero=2` (which implies the distributed optimizer) `produced` and `retire` run
    after every backward action that produces weight gradients (`per_microbatch`), and
    the groups must be `stage_dp_groups`. Replicas of different tensor-parallel degrees
    (zero 0 only): `slices` (by parameter id) splits this rank's gradients of a layer
    whose largest degree is above its own, and `slice_index` (by group, as
    `placement.dp_slices` keys it) says which slice a group reduces; a parameter is then
    in several groups' buckets.
    """

    def __init__(self, groups: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], rank: int,
                 params_by_layer: dict[int, list[nn.Parameter]], devices: Sequence[str],
                 timeout_s: float, *, lr: float, distributed_optimizer: bool = False,
                 bucket_bytes: float = DDP_BUCKET_BYTES, overlap: bool = True,
                 links: Links | None = None, nodes: Sequence[str] = (),
                 switch_nodes: frozenset[str] = frozenset(),
                 apart: Sequence[nn.Parameter] = (), zero: int | None = None,
                 slices: Mapping[int, GradSlices] | None = None,
                 slice_index: Mapping[tuple[tuple[int, ...], tuple[int, ...]], int]
                 | None = None):
        # `apart`: parameters reduced elsewhere (tied embeddings, exec.tied), kept out
        # of the buckets and stepped like the others
        self._timeout_s = timeout_s
        self.zero = (1 if distributed_optimizer else 0) if zero is None else zero
        self.per_microbatch = self.zero == 2
        self.distributed, self.overlap = self.zero >= 1, overlap
        self._slices = dict(slices or {})
        if self._slices and self.distributed:
            raise ValueError("sliced gradients (replicas of different tp) need zero 0")
        self.params = [p for layer in sorted(params_by_layer) for p in params_by_layer[layer]]
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, list[_Bucket]] = {}     # a parameter's buckets
        for ranks, layers in groups:
            pg = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
            if rank not in ranks:
                continue
            params = [p for layer in reversed(layers)
                      for p in reversed(params_by_layer.get(layer, []))
                      if all(p is not q for q in apart)]                  # backward order
            peers = ",".join(devices[r] for r in ranks if r != rank)
            ring = None if links is None else RingCollectives(
                ranks, pg, rank, nodes, links, timeout_s, ("dp", tuple(ranks), layers[0]),
                switch_nodes)
            previous = None
            part = (slice_index or {}).get((tuple(ranks), tuple(layers)))
            if part is None:
                if any(id(p) in self._slices for p in params):
                    raise ValueError(f"group {ranks} reduces sliced gradients of layers "
                                     f"{layers} without a slice index")
                part = 0
            for chunk in _chunks(params, bucket_bytes, self._numel):
                b = _Bucket(pg, len(ranks), ranks.index(rank), chunk, peers,
                            sum(map(self._numel, chunk)), after=previous,
                            ranks=tuple(ranks), ring=ring, part=part)
                if previous is not None:
                    previous.next = b
                self._buckets.append(b)
                for p in chunk:
                    self._bucket_of.setdefault(id(p), []).append(b)
                previous = b
        solo = [p for p in self.params if id(p) not in self._bucket_of]
        # (parameter, the tensor AdamW updates): the parameter itself, or the local shard
        # of a DTensor parameter (the same storage; this very object gets the gradient)
        self._updated = [(p, local(p)) for p in (solo if self.distributed else self.params)]
        targets: list[torch.Tensor] = [t for _, t in self._updated]
        if self.distributed:
            for b in self._buckets:
                flat = self._flat([local(p).detach() for p in b.params], b.padded)
                n = b.padded // b.size
                if self.per_microbatch and not any(local(p) is not p for p in b.params):
                    b.flat = flat           # parameters become views of it: no master copy
                    offset = 0
                    for p in b.params:
                        p.data = flat[offset:offset + p.numel()].view_as(p)
                        offset += p.numel()
                    b.shard = flat[b.index * n:(b.index + 1) * n]
                else:
                    b.shard = nn.Parameter(flat[b.index * n:(b.index + 1) * n].clone())
                targets.append(b.shard)
        self.optimizer = torch.optim.AdamW(targets, lr=lr)
        self._armed: set[int] = set()
        self._ready: set[int] = set()
        self._clock: Callable[[], float] = lambda: 0.0
        # A bucket starts when its last gradient is accumulated. Gradients that torch's
        # I/W split accumulates by hand, and a sequence-parallel stage's partial norm
        # gradients (first summed over the tensor-parallel group), are final when that
        # action ends. A group's buckets start in order.
        for p in self.params:
            if id(p) in self._bucket_of:
                p.register_post_accumulate_grad_hook(self._accumulated)

    @staticmethod
    def _flat(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
        flat = torch.zeros(length, dtype=torch.float32,
                           device=tensors[0].device if tensors else "cpu")
        offset = 0
        for t in tensors:
            flat[offset:offset + t.numel()] = t.reshape(-1)
            offset += t.numel()
        return flat

    def zero_grad(self, clock: Callable[[], float] | None = None) -> None:
        """Start a step: gradients cleared, no bucket ready; `clock` times the events."""
        for p in self.params:
            p.grad = None
        self._armed.clear()
        self._ready.clear()
        if clock is not None:
            self._clock = clock
        for b in self._buckets:
            b.work = None
            b.pending.clear()
            b.grad_sum = None

    def _numel(self, p: nn.Parameter) -> int:
        """Elements of `p`'s gradient a bucket holding it reduces: its slice's or all."""
        cut = self._slices.get(id(p))
        return local(p).numel() if cut is None else cut.numel(local(p).numel())

    def _pieces(self, b: _Bucket) -> list[torch.Tensor]:
        """What bucket `b` reduces of each of its parameters' local gradients: the
        whole, or its slice `b.part`."""
        return [t if (cut := self._slices.get(id(p))) is None else cut.take(t, b.part)
                for p, t in zip(b.params, self._grads(b.params), strict=True)]

    def _grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Local gradients; a layer that saw no data (zero micro-batches) contributes 0."""
        out = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(local(p.grad))
        return out

    # ------------------------------------------------------------------ buckets
    def arm(self, params: list[nn.Parameter], *, hooks: bool = True) -> None:
        """The next backward action is the last one for `params`: a gradient accumulated
        into them from now on is final (with `hooks`; off for a stage whose gradients
        need a tensor-parallel sum first)."""
        if self.overlap and hooks:
            self._armed.update(id(p) for p in params)

    def _accumulated(self, p: nn.Parameter) -> None:
        if id(p) in self._armed:
            self._ready.add(id(p))
            for b in self._bucket_of[id(p)]:
                self._start_ready(b)

    def produced(self, params: list[nn.Parameter]) -> None:
        """The last backward action for `params` has ended: their gradients are final.
        Without overlap they wait for the flush, except under ZeRO-2, whose
        reduce-scatter of every micro-batch's gradients is what frees them (the
        simulator prices it so whatever the overlap)."""
        if not self.overlap and not self.per_microbatch:
            return
        self._ready.update(id(p) for p in params)
        for p in params:
            for b in self._bucket_of.get(id(p), ()):
                self._start_ready(b)

    def retire(self, params: list[nn.Parameter]) -> None:
        """ZeRO-2, after `produced(params)`: the buckets of `params` (started) are set
        aside for summing and their whole gradients freed; the next backward action
        fills them anew. No-op otherwise."""
        if not self.per_microbatch:
            return
        ids = {id(p) for p in params}
        for b in self._buckets:
            if b.work is None or not any(id(p) in ids for p in b.params):
                continue
            b.pending.append(b.work)
            b.work = None
            for p in b.params:
                p.grad = None
                self._ready.discard(id(p))
                self._armed.discard(id(p))

    def _start_ready(self, b: _Bucket | None) -> None:
        """Start bucket `b` if every gradient in it is final and the group's previous
        bucket has started; then the buckets after it that have become startable."""
        while b is not None and b.work is None and (b.after is None or b.after.work
                                                     is not None):
            if not all(id(p) in self._ready for p in b.params):
                return
            self._start(b)
            b = b.next

    def _start(self, b: _Bucket) -> None:
        start = self._clock()
        flat = self._flat(self._pieces(b), b.padded)
        if self.distributed:
            mine = torch.empty(b.padded // b.size, dtype=flat.dtype, device=flat.device)
            b.work = (b.ring.reduce_scatter(flat, mine) if b.ring else
                      dist.reduce_scatter_single(mine, flat, group=b.pg, async_op=True),
                      mine, start)
        else:
            b.work = (b.ring.all_reduce(flat) if b.ring else
                      dist.all_reduce(flat, group=b.pg, async_op=True), flat, start)

    def reduce(self, device_name: str, step: int, clock: Callable[[], float]
               ) -> list[TraceEvent]:
        """Start what has not started, wait for every bucket, put the sums in place (the
        gradients, or the shard's gradient with the distributed optimizer); one
        `allreduce` event per bucket, from its start to when its sum was seen."""
        self._clock = clock
        if self.per_microbatch:
            return self._sum_slices(device_name, step, clock)
        for b in self._buckets:
            if b.work is None:
                self._start(b)
        events = []
        for b in self._buckets:
            work, buf, start = b.work
            _wait(work, self._timeout_s, f"gradient reduction with {b.peers}")
            if self.distributed:
                b.shard.grad = buf
            else:
                offset = 0
                for p, t in zip(b.params, self._grads(b.params), strict=True):
                    n = self._numel(p)
                    cut = self._slices.get(id(p))
                    if cut is None:
                        t.copy_(buf[offset:offset + n].view_as(t))
                    else:
                        cut.put(t, b.part, buf[offset:offset + n])
                    offset += n
            events.append(TraceEvent(device_name, "allreduce", -1, -1, start, clock(),
                                     float(b.numel * buf.element_size()), b.peers, step))
        return events

    def _sum_slices(self, device_name: str, step: int, clock: Callable[[], float]
                    ) -> list[TraceEvent]:
        """ZeRO-2: wait for every bucket's reduce-scatters of the step (a bucket that
        saw no backward scatters zeros once) and sum them into its slice's gradient; one
        `reducescatter` event each, from its start to when its sum was seen."""
        events = []
        for b in self._buckets:
            if b.work is not None:
                b.pending.append(b.work)
                b.work = None
            if not b.pending:
                self._start(b)
                b.pending.append(b.work)
                b.work = None
            for work, buf, start in b.pending:
                _wait(work, self._timeout_s, f"gradient reduce-scatter with {b.peers}")
                b.grad_sum = buf if b.grad_sum is None else b.grad_sum.add_(buf)
                events.append(TraceEvent(device_name, "reducescatter", -1, -1, start,
                                         clock(), float(b.numel * buf.element_size()),
                                         b.peers, step))
            b.pending.clear()
            b.shard.grad = b.grad_sum
            for p in b.params:
                p.grad = None
        return events

    @torch.no_grad()
    def step(self, device_name: str = "", step: int = -1,
             clock: Callable[[], float] | None = None) -> list[TraceEvent]:
        """AdamW on this rank's parameters (or slices); with the distributed optimizer,
        then all-gather every group's updated slices into its parameters. ZeRO-2's
        all-gathers are returned as `allgather` events (with `clock`)."""
        for p, t in self._updated:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if t is not p:
                t.grad = local(p.grad)
        self.optimizer.step()
        events: list[TraceEvent] = []
        if not self.distributed:
            return events
        for g in self._buckets:
            start = clock() if clock is not None else 0.0
            mine = g.shard.detach()
            whole = g.flat
            if whole is None:
                whole = torch.empty(g.padded, dtype=g.shard.dtype, device=g.shard.device)
            else:
                mine = mine.clone()             # gathered into the buffer it is a view of
            _wait(g.ring.all_gather(whole, mine) if g.ring else
                  dist.all_gather_single(whole, mine, group=g.pg, async_op=True),
                  self._timeout_s, f"parameter all-gather with {g.peers}")
            if self.per_microbatch and clock is not None:
                events.append(TraceEvent(device_name, "allgather", -1, -1, start, clock(),
                                         float(whole.numel() * whole.element_size()),
                                         g.peers, step))
            if g.flat is not None:
                continue
            offset = 0
            for p in g.params:
                t = local(p)
                t.copy_(whole[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return events

    @torch.no_grad()
    def gather_grads(self) -> None:
        """With the distributed optimizer, put the reduced whole gradients back into
        ``.grad`` (each rank kept only its slice): for inspection (RankRuntime.captured),
        not for training. Collective over the data-parallel groups."""
        if not self.distributed:
            return
        for g in self._buckets:
            if g.shard.grad is None:
                continue
            whole = torch.empty(g.padded, dtype=g.shard.dtype, device=g.shard.device)
            wait(dist.all_gather_single(whole, g.shard.grad, group=g.pg, async_op=True),
                 self._timeout_s, f"gradient all-gather with {g.peers}")
            offset = 0
            for t in self._grads(g.params):
                t.copy_(whole[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def master_tensors(self) -> list[torch.Tensor]:
        """What the data-parallel state holds beside parameters and optimizer state: the
        distributed optimizer's slices of the parameters (its fp32 master copies; none
        where they are views of the parameters) and ZeRO-2's gradient slices."""
        out = [b.shard for b in self._buckets if b.shard is not None and b.flat is None]
        out += [b.grad_sum for b in self._buckets if b.grad_sum is not None]
        out += [buf for b in self._buckets for _, buf, _ in b.pending]
        return out

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
        if self.distributed:        # the shards are the master copy: refresh from params
            for g in self._buckets:
                if g.flat is not None:      # views of the parameters: nothing to do
                    continue
                flat = self._flat([local(p).detach() for p in g.params], g.padded)
                n = g.padded // g.size
                with torch.no_grad():
                    g.shard.copy_(flat[g.index * n:(g.index + 1) * n])


def _wait(work: dist.Work | Future, timeout_s: float, what: str) -> None:
    """Wait for a collective started by gloo/NCCL (`dist.Work`) or by RingCollectives (a
    Future); PeerFailure naming `what` if it fails or `timeout_s` passes."""
    if not isinstance(work, Future):
        wait(work, timeout_s, what)
        return
    try:
        work.result(timeout=timeout_s)
    except FutureTimeout:
        raise PeerFailure(f"{what}: no answer within {timeout_s:g} s") from None


def _chunks(params: list[nn.Parameter], bucket_bytes: float,
            numel: Callable[[nn.Parameter], int]) -> list[list[nn.Parameter]]:
    """Consecutive runs of `params` of about `bucket_bytes` of fp32 gradient each (a
    bucket closes once it reaches the cap, as DDP's do)."""
    out: list[list[nn.Parameter]] = [[]]
    size = 0.0
    for p in params:
        if out[-1] and size >= bucket_bytes:
            out.append([])
            size = 0.0
        out[-1].append(p)
        size += numel(p) * 4
    return [c for c in out if c]
