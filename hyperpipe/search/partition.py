"""Cutting a model's layers into pipeline stages on a given sequence of devices.

`partition` is a dynamic program over (stage, first layer not yet placed) that minimises
the bottleneck: the largest per-micro-batch time (seconds) of any stage, its forward and
backward compute (tensor-parallel all-reduces included) plus the link after it. Memory
is a hard constraint: a cut whose weights, optimizer state and stashes do not fit the
stage's devices is never taken. Among the cuts of least bottleneck it takes the one of
least total time (fill and drain). Costs come from `CostModel` as per-layer prefix sums
(`LayerTables`), with what each action costs once per stage (a calibration profile's
overhead) and a split backward priced as I + W, as the simulator runs them; each stage's
(L+1) x (L+1) cost table is built with numpy. The classic
linear-partition DP with a min-max objective (PipeDream, Narayanan et al. 2019, sec.
3.1; HetPipe and AMP use the same recurrence on heterogeneous devices). Where a device
holds several stages (V and interleaved placements), `balance_devices` then moves
boundary layers to even out the devices' loads, which the DP does not see.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from hyperpipe.plan.plan import StagePlan
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.experts import (
    alltoall_count,
    alltoall_edge_bytes,
    alltoall_time_s,
    routed_expert_s,
)
from hyperpipe.sim.sharding import ring_attention_extra_s

_INF = float("inf")


@dataclass(frozen=True)
class Slot:
    """One pipeline stage position: its tensor-parallel group, how many micro-batches'
    activations it holds at its peak, and its memory per device (bytes)."""

    devices: tuple[str, ...]          # the stage's tp group
    inflight: int                     # micro-batches whose stash it holds at the peak
    capacity_bytes: float             # memory per device available to this stage


@dataclass(frozen=True)
class Partition:
    bounds: tuple[int, ...]           # cut points 0 = b0 < b1 < ... < bP = L
    stage_s: tuple[float, ...]        # per-micro-batch time of each stage incl. its link
    bottleneck_s: float               # max(stage_s)
    total_s: float                    # sum(stage_s)
    forward_s: float                  # sum of the stages' forward times (zero-bubble fill)
    last_backward_s: float            # the last stage's backward time
    # one micro-batch's way through every stage and back: total_s, less the W's of every
    # stage but the first where the backward is split (each runs beside the I's below it)
    trip_s: float

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return list(itertools.pairwise(self.bounds))


class ActionTimes(NamedTuple):
    """What each action of a stage costs once, whatever its layers (seconds): a
    calibration profile's per-action overhead of F, B, I and W (0 without one)."""

    f_s: float = 0.0
    b_s: float = 0.0
    i_s: float = 0.0
    w_s: float = 0.0

    def backward_s(self, split: bool) -> float:
        """A stage's backward share: B, or I and W when `split`."""
        return self.i_s + self.w_s if split else self.b_s

    def per_microbatch_s(self, split: bool) -> float:
        """A stage's per-micro-batch share: F and `backward_s`."""
        return self.f_s + self.backward_s(split)


@dataclass(frozen=True)
class LayerTables:
    """Per-layer prefix sums for one kind of stage (device type, tp group, micro-batch).
    A stage's per-micro-batch time is its layers' F and B (with `split_s` when the
    schedule splits the backward into I and W) plus `actions` once."""

    fwd_s: np.ndarray          # prefix sums, length L+1: forward time
    bwd_s: np.ndarray          # prefix sums: backward (B) time
    state_bytes: np.ndarray    # prefix sums: weights + grads + optimizer state per device
    stash_bytes: np.ndarray    # prefix sums: activations one micro-batch stashes
    work_bytes: float = 0.0    # the largest one-layer recompute working set (not summed)
    # per in-flight micro-batch, what a stage ending at layer j keeps of its output
    # (index j; a stack that keeps stage outputs: `Runtime.keeps_stage_outputs`), or None
    out_bytes: np.ndarray | None = None
    # prefix sums of I + W - B per layer; None where the cost model prices B as I + W
    split_s: np.ndarray | None = None
    actions: ActionTimes = ActionTimes()
    wgt_s: np.ndarray | None = None    # prefix sums: W time (a split backward's weights)

    def splits(self, kind_splits: bool) -> bool:
        """Whether a schedule that does (`kind_splits`) or does not split the backward
        prices this stage kind apart from one that does not."""
        return kind_splits and (self.split_s is not None or self.actions.b_s !=
                                self.actions.i_s + self.actions.w_s)

    def stage_prefix_s(self, split: bool) -> np.ndarray:
        """Prefix sums of a stage's per-micro-batch layer time (no per-action part)."""
        t = self.fwd_s + self.bwd_s
        return t + self.split_s if split and self.split_s is not None else t

    def least_whole_s(self) -> float:
        """The whole model's `least_layer_s`, summed."""
        t = float(self.fwd_s[-1] + self.bwd_s[-1])
        return t if self.split_s is None else \
            t + float(np.minimum(np.diff(self.split_s), 0.0).sum())

    def trip_layer_s(self, split: bool) -> np.ndarray:
        """Per layer, the least it adds to one micro-batch's whole trip (no per-action
        part): `least_layer_s`, or where the schedule splits the backward its F + I (its
        W may run beside the way back: `Partition.trip_s`)."""
        if not split or self.wgt_s is None:
            return self.least_layer_s()
        back = self.bwd_s if self.split_s is None else self.bwd_s + self.split_s
        return np.diff(self.fwd_s + back - self.wgt_s)

    def least_layer_s(self) -> np.ndarray:
        """Per layer, the least of its F + B and F + I + W (no per-action part): what
        any schedule spends on it at least."""
        t = np.diff(self.fwd_s + self.bwd_s)
        return t if self.split_s is None else t + np.minimum(np.diff(self.split_s), 0.0)


def layer_tables(cost: CostModel, devices: tuple[str, ...], micro_batch: int, *,
                 recompute: str = "none", sequence_parallel: bool = False,
                 dp_shards: int = 1) -> LayerTables:
    """Prefix sums over layers of the costs of one stage kind; `devices` is its tp group,
    with its recompute, sequence parallelism and optimizer shards (the distributed
    optimizer's replicas; 1 without it)."""
    fwd, bwd = layer_times(cost, devices, micro_batch, recompute, sequence_parallel)
    split, wgt, actions = action_times(cost, devices, micro_batch, recompute,
                                       sequence_parallel)
    return replace(layer_memory(cost, len(devices), micro_batch, fwd, bwd, recompute,
                                sequence_parallel, dp_shards), split_s=split, actions=actions,
                   wgt_s=wgt)


def action_times(cost: CostModel, devices: tuple[str, ...], micro_batch: int,
                 recompute: str = "none", sequence_parallel: bool = False, cp: int = 1
                 ) -> tuple[np.ndarray | None, np.ndarray, ActionTimes]:
    """(`LayerTables.split_s`, `LayerTables.wgt_s`, `LayerTables.actions`) of one stage
    kind: per layer what a split backward's I + W costs beyond B, as
    `CostModel.stage_time_s` prices each action (None where that is B to the last few
    ulps, as op-by-op pricing gives it), the prefix sums of its W alone, and the
    per-action overheads, each once per stage (`CostModel.action_overhead_s`)."""
    over = ActionTimes(*(cost.action_overhead_s(devices, op) for op in "FBIW"))
    n = cost.model.num_layers
    extra = np.zeros(n + 1)
    wgt = np.zeros(n + 1)
    for j in range(n):
        one = (j, j + 1)
        b, i, w = (cost.stage_time_s(one, devices, micro_batch, op, recompute,
                                     sequence_parallel, cp) for op in "BIW")
        e = (i - over.i_s) + (w - over.w_s) - (b - over.b_s)
        extra[j + 1] = 0.0 if abs(e) <= 1e-9 * abs(b) else e
        wgt[j + 1] = w - over.w_s
    return (np.cumsum(extra) if extra.any() else None), np.cumsum(wgt), over


def layer_times(cost: CostModel, devices: tuple[str, ...], micro_batch: int,
                recompute: str = "none", sequence_parallel: bool = False, cp: int = 1,
                ep: int = 1, a2a_edges: tuple[tuple[str, str], ...] = (),
                dispatcher: str = "alltoall") -> tuple[np.ndarray, np.ndarray]:
    """Prefix sums of the per-layer forward and backward (B, with its recompute) times,
    without a profile's per-action overhead (`action_times`); `devices` is cp tp groups
    with context parallelism, each layer's exposed ring exchange included
    (`sim.sharding.ring_attention_extra_s`). ZeRO-2/3's per
    micro-batch collectives are left to the analytic tier and the simulator (they
    overlap the compute; the search tries them only where ZeRO-1 does not fit)."""
    n = cost.model.num_layers
    fwd = np.zeros(n + 1)
    bwd = np.zeros(n + 1)
    tp = len(devices) // cp
    # a profile's per-action overhead is paid once per stage (`action_times`), not per layer
    over_f, over_b = (cost.action_overhead_s(devices, op) for op in "FB")
    for i in range(n):
        one = (i, i + 1)
        fwd[i + 1] = cost.stage_time_s(one, devices, micro_batch, "F",
                                       sequence_parallel=sequence_parallel, cp=cp) - over_f
        bwd[i + 1] = cost.stage_time_s(one, devices, micro_batch, "B", recompute,
                                       sequence_parallel, cp) - over_b
        if cp > 1:
            st = StagePlan(one, devices, tp, recompute, sequence_parallel, cp)
            fwd[i + 1] += ring_attention_extra_s(cost, st, micro_batch, "F")
            bwd[i + 1] += ring_attention_extra_s(cost, st, micro_batch, "B")
        if ep > 1 and cost.model.layers[i].kind == "moe":
            st = StagePlan(one, devices, tp, recompute, sequence_parallel, cp, ep)
            fwd[i + 1] += expert_parallel_extra_s(cost, st, micro_batch, "F", a2a_edges,
                                                  dispatcher)
            bwd[i + 1] += expert_parallel_extra_s(cost, st, micro_batch, "B", a2a_edges,
                                                  dispatcher)
    return np.cumsum(fwd), np.cumsum(bwd)


def expert_parallel_extra_s(cost: CostModel, stage: StagePlan, micro_batch: int, op: str,
                            a2a_edges: tuple[tuple[str, str], ...],
                            dispatcher: str = "alltoall") -> float:
    """Seconds expert parallelism adds to `op` (F or B) of the one MoE layer of `stage`
    on its devices, beyond `CostModel.stage_time_s` (every expert on the rank, ep 1), as
    `sim.experts` prices it for a group of alike ranks with experts placed evenly: the
    all-to-alls of the op (`alltoall_count`) over `a2a_edges` (every (sender, receiver)
    pair of the groups that exchange at once) on idle links, each carrying what
    `dispatcher` sends (`alltoall_edge_bytes`), plus the busiest rank's
    extra expert work: its experts / ep experts, one of them the busiest, over all ep·T
    tokens, against its own ep-1 share (`MoEConfig.rank_pairs` over `routed_pairs`).
    A full-recompute backward counts its recomputed forward's expert work too."""
    layer = stage.layers[0]
    moe = cost.model.layers[layer].moe
    n = alltoall_count(cost, stage, op)
    a2a = alltoall_time_s(cost, list(a2a_edges), alltoall_edge_bytes(
        cost, stage, micro_batch, a2a_edges, dispatcher))[0] if n else 0.0
    tokens = micro_batch * cost.model.seq_len / stage.cp
    ratio = moe.rank_pairs(stage.ep * tokens, moe.experts // stage.ep) / \
        moe.routed_pairs(tokens) - 1.0
    passes = (op, "F") if op == "B" and stage.recompute == "full" else (op,)
    dev = cost.cluster.device(stage.devices[0]).type.name
    work = sum(routed_expert_s(cost, layer, dev, micro_batch, p, stage.tp,
                               stage.sequence_parallel, stage.cp) for p in passes)
    return n * a2a + work * ratio * cost.cluster.slowdown(stage.devices)


def layer_memory(cost: CostModel, tp: int, micro_batch: int, fwd_s: np.ndarray,
                 bwd_s: np.ndarray, recompute: str = "none", sequence_parallel: bool = False,
                 dp_shards: int = 1, *, zero: int | None = None, cp: int = 1,
                 reshard: bool = True, ep: int = 1, keeps_outputs: bool = False
                 ) -> LayerTables:
    """`LayerTables` of the given time prefix sums and the per-device memory of a stage
    kind (memory does not depend on the device type), by the simulator's rules
    (`CostModel.device_static_bytes`): state with the ZeRO stage `zero` over
    `dp_shards` ranks (None: ZeRO-1's split over them), stashes of s/cp tokens; ZeRO-3's
    unsharded working set per layer without resharding (the stage's whole weights and
    gradient), else the largest unit's, counted once like the recompute working set;
    the head's backward working set with the head (`CostModel.head_backward_work_bytes`);
    with `keeps_outputs` each stage end's kept output (`CostModel.stage_output_bytes`
    per 1/cp, as `CostModel.stage_stash_bytes` adds it)."""
    n = cost.model.num_layers
    state = np.zeros(n + 1)
    stash = np.zeros(n + 1)
    kw = {"recompute": recompute, "sequence_parallel": sequence_parallel, "cp": cp}
    for i in range(n):
        one = (i, i + 1)
        state[i + 1] = cost.state_bytes(one, tp, dp_shards, zero, **expert_state(ep, zero,
                                                                             dp_shards))
        if zero == 3 and not reshard:
            state[i + 1] += cost.zero3_working_bytes(one, tp, False,
                                                     **expert_state(ep, zero, dp_shards))
        # the head's backward working set, counted with the head's layer (on top of the
        # recompute working set: the simulator takes the larger of the two)
        state[i + 1] += cost.head_backward_work_bytes(one, micro_batch, tp, cp)
        stash[i + 1] = cost.stash_bytes(one, micro_batch, tp, **kw)
    work = cost.recompute_work_bytes((0, n), micro_batch, tp, **kw)
    if zero == 3 and reshard:
        work += cost.zero3_working_bytes((0, n), tp, True,
                                         **expert_state(ep, zero, dp_shards))
    out = None
    if keeps_outputs:
        out = np.array([0.0] + [cost.stage_output_bytes((j - 1, j), micro_batch, tp) / cp
                                for j in range(1, n + 1)])
    return LayerTables(fwd_s, bwd_s, np.cumsum(state), np.cumsum(stash), work, out_bytes=out)


def expert_state(ep: int, zero: int | None, dp_shards: int) -> dict:
    """`CostModel.state_bytes`'s expert arguments for a stage of `ep` alike ranks with
    experts placed evenly (`sim.experts.expert_state`): a 1/ep share of the routed
    experts, their state sharded with ZeRO 1 and up (None: ZeRO-1) over the
    expert-data-parallel group, the `dp_shards` data-parallel x context ranks over ep."""
    if ep == 1:
        return {}
    return {"expert_share": 1.0 / ep,
            "expert_shards": max(1, dp_shards // ep) if zero is None or zero >= 1 else 1}


def link_costs(cost: CostModel, src: str, dst: str, micro_batch: int) -> np.ndarray:
    """link[j]: time to send the output of layer j-1 from `src` to `dst` and its gradient
    back (index 0 unused). Only distinct message sizes are costed (GPT blocks all send
    the same b x s x h tensor)."""
    n = cost.model.num_layers
    sizes = [cost.send_bytes((j - 1, j), micro_batch) for j in range(1, n + 1)]
    times = {b: cost.transfer_time_s(src, dst, b) + cost.transfer_time_s(dst, src, b)
             for b in set(sizes)}
    return np.array([0.0] + [times[b] for b in sizes])


def time_matrix(tables: LayerTables, link: np.ndarray | None, split: bool = False
                ) -> np.ndarray:
    """T[i, j]: per-micro-batch time of a stage holding layers [i, j), its per-action
    part and the link after it included (inf where j <= i); `split`: its backward runs
    as I and W (`LayerTables.splits`)."""
    t = tables.stage_prefix_s(split)
    c = t[None, :] - t[:, None] + tables.actions.per_microbatch_s(split)
    if link is not None:
        c = c + link[None, :]
    c[np.tril_indices_from(c)] = _INF
    return c


@dataclass(frozen=True)
class StageCost:
    """C[i, j] of one stage, kept lazy: `times[i, j]` (layers [i, j), the link after it
    included) where the layers fit in the slot's memory (j <= last[i]), inf elsewhere;
    `last` None when everything fits. `partition` reads only the blocks it can reach."""

    times: np.ndarray
    last: np.ndarray | None = None

    def block(self, i0: int, j0: int, size: int) -> np.ndarray:
        """C[i0:i0+size, j0:j0+size]."""
        t = self.times[i0:i0 + size, j0:j0 + size]
        if self.last is None:
            return t
        cols = np.arange(j0, j0 + size)
        return np.where(cols[None, :] > self.last[i0:i0 + size, None], _INF, t)

    def at(self, i: int, j: int) -> float:
        """C[i, j] of one stage of layers [i, j) (inf where none or they do not fit)."""
        if j - i < 1 or (self.last is not None and j > self.last[i]):
            return _INF
        return float(self.times[i, j])


def stage_matrix(tables: LayerTables, slot: Slot, times: np.ndarray) -> StageCost:
    """C[i, j]: `times` where layers [i, j) fit in the slot's memory (weights, optimizer
    state, `inflight` stashes and, where the stack keeps them, `inflight` outputs of its
    last layer), inf elsewhere. Memory grows with j, so the last layer that fits after i
    is a binary search on the prefix sums (no n x n memory table); kept outputs that
    shrink with j (none of a GPT's do) are taken at the largest before j, which may
    refuse a range that fits but never admits one that does not."""
    use = _use(tables, slot)
    end = use if tables.out_bytes is None else \
        np.maximum.accumulate(use + slot.inflight * tables.out_bytes)
    if end[-1] - use[0] <= slot.capacity_bytes:
        return StageCost(times)                   # the whole model fits: no limit
    return StageCost(times, np.searchsorted(end, use + slot.capacity_bytes, side="right") - 1)


def _use(table: LayerTables, slot: Slot) -> np.ndarray:
    """Prefix sums of what a stage's layers keep on each device (state and stashes)."""
    return table.state_bytes + slot.inflight * table.stash_bytes


def shared_slots(tables: list[LayerTables], rooms: list[Slot], homes: list[int]
                 ) -> list[Slot]:
    """Stage k on device homes[k], `rooms[k]` with the device's whole room as capacity:
    the slots with the room split among the device's stages in proportion to what each
    keeps under the even cut (as many layers per stage as can be), so that a stage that
    holds more micro-batches, or the embedding, gets more. The capacities of a device
    add up to its room, so any cut the DP finds fits; if the even cut fits, one is found.
    """
    n = len(tables[0].state_bytes) - 1
    stages = len(tables)
    keep = []
    for k, (t, s) in enumerate(zip(tables, rooms, strict=True)):
        u = _use(t, s)
        keep.append(float(u[(k + 1) * n // stages] - u[k * n // stages]))
    total: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    for k, h in enumerate(homes):
        total[h] += keep[k]
        count[h] += 1
    return [replace(s, capacity_bytes=s.capacity_bytes * (
                keep[k] / total[h] if total[h] > 0 else 1 / count[h]))
            for k, (s, h) in enumerate(zip(rooms, homes, strict=True))]


def partition(mats: list[StageCost], *, bottleneck_slack: float = 0.0
              ) -> tuple[int, ...] | None:
    """Optimal cut points for stages with costs `mats` (one per stage, in order).

    First pass: least bottleneck B*. Second pass: least total time among cuts whose every
    stage costs at most B* x (1 + bottleneck_slack) (slack > 0 trades a slightly worse
    bottleneck for a shorter fill and drain). None when no cut fits in memory.
    """
    p = len(mats)
    n = mats[0].times.shape[0] - 1
    if p > n:
        return None
    # Stage s (every stage at least one layer) starts in [s, n - p + s] and ends one to
    # n - p + 1 layers later: both passes work on that window only (the rest is
    # unreachable), which matters for deep pipelines (p near n).
    span = n - p + 1
    # Memory alone first: the last layer that fits grows with the first, so taking all
    # that fits at every stage reaches furthest; if that falls short of n, no cut fits
    # (half of the search's calls end here, without the DP).
    reach = 0
    for s, c in enumerate(mats):
        reach = n if c.last is None else int(c.last[reach])
        if reach <= s:
            return None
    if reach < n:
        return None
    # Both passes keep their state on that window only (f[k]: the stages so far end
    # at layer s + k) and write into one buffer: the same arithmetic as over n + 1.
    blocks = [c.block(s, s + 1, span) for s, c in enumerate(mats)]
    buf = np.empty((span, span))
    f = np.full(span, _INF)
    f[0] = 0.0
    for block in blocks:
        np.maximum(f[:, None], block, out=buf)
        f = buf.min(axis=0)
    best = f[span - 1]
    if not np.isfinite(best):
        return None
    limit = best * (1.0 + bottleneck_slack) * (1.0 + 1e-12) + 1e-15
    g = np.full(span, _INF)
    g[0] = 0.0
    choice = np.zeros((p, n + 1), dtype=np.int64)
    cols = np.arange(span)
    for s, block in enumerate(blocks):
        np.add(g[:, None], block, out=buf)
        np.copyto(buf, _INF, where=~(block <= limit))
        arg = buf.argmin(axis=0)
        choice[s, s + 1:s + 1 + span] = s + arg
        g = buf[arg, cols]
    if not np.isfinite(g[span - 1]):
        return None
    bounds = [n]
    for s in range(p - 1, -1, -1):
        bounds.append(int(choice[s, bounds[-1]]))
    return tuple(reversed(bounds))


class _Move(NamedTuple):
    """One boundary layer moved between `stage` and `neighbour` (the cut between them
    to `cut`), with what it leaves: the busiest device's load and the larger of the two
    devices' (seconds), and the two stages' new times."""

    busiest_s: float
    pair_s: float
    stage: int
    neighbour: int
    cut: int
    stage_s: float
    neighbour_s: float


def balance_devices(bounds: tuple[int, ...], mats: list[StageCost], homes: list[int],
                    sum_per_load: float = 1.0) -> tuple[int, ...]:
    """`bounds` improved for pipelines whose devices hold several stages (`homes[k]`:
    stage k's device): `partition` minimises the busiest STAGE, but a device's load is
    the sum of its stages, so two heavy chunks can meet on one device. Moves of one
    boundary layer between a stage of the busiest device and its neighbour stage on
    another device are taken while one lowers the busiest device's load by some
    amount and adds at most `sum_per_load` times that to the stages' sum (a layer may
    be slower on the other device, which lengthens the fill), or, with others as busy,
    takes this device below them without adding to the sum; the move that leaves the
    least busiest load goes first. So the busiest load never grows, and the sum grows
    by at most `sum_per_load` times what it fell. Each stage keeps at least one layer
    and stays within its memory (`StageCost`).

    `sum_per_load`: what a second of sum costs against a second of busiest load in
    the objective. With m micro-batches, a pipeline of v chunks per device takes about
    (m - 1/v) x load + sum / v round robin (interleaved: fill = sum / v + load (v - 1) /
    v) and m x load + forward / v on a V (fill = load + forward / v): v - 1 and v keep
    any move from lengthening the iteration for every m >= 1."""
    b = list(bounds)
    stages = len(mats)

    stage_s = [mats[k].at(b[k], b[k + 1]) for k in range(stages)]
    load: dict[int, float] = defaultdict(float)
    mine: dict[int, list[int]] = defaultdict(list)
    for k, h in enumerate(homes):
        load[h] += stage_s[k]
        mine[h].append(k)
    while True:
        top = sorted(load, key=load.__getitem__, reverse=True)[:3]
        d = top[0]
        busiest = load[d]
        best: _Move | None = None
        for k in mine[d]:
            for nb, cut in ((k - 1, b[k] + 1), (k + 1, b[k + 1] - 1)):
                if not 0 <= nb < stages or homes[nb] == d:
                    continue
                e = homes[nb]
                lo, hi = (nb, k) if nb < k else (k, nb)
                new_lo, new_hi = mats[lo].at(b[lo], cut), mats[hi].at(cut, b[hi + 1])
                new_k, new_nb = (new_lo, new_hi) if lo == k else (new_hi, new_lo)
                pair = max(busiest - stage_s[k] + new_k, load[e] - stage_s[nb] + new_nb)
                rest = max((load[x] for x in top if x not in (d, e)), default=0.0)
                after = max(pair, rest)
                added = new_k + new_nb - stage_s[k] - stage_s[nb]
                fell = busiest - after
                ok = (fell > busiest * 1e-9 and added <= sum_per_load * fell) or \
                    (fell >= 0 and pair < busiest * (1 - 1e-9) and added <= 0)
                if ok and (best is None or (after, pair) < (best.busiest_s, best.pair_s)):
                    best = _Move(after, pair, k, nb, cut, new_k, new_nb)
        if best is None:
            return tuple(b)
        k, nb = best.stage, best.neighbour
        b[max(k, nb)] = best.cut
        load[d] += best.stage_s - stage_s[k]
        load[homes[nb]] += best.neighbour_s - stage_s[nb]
        stage_s[k], stage_s[nb] = best.stage_s, best.neighbour_s


def describe(bounds: tuple[int, ...], tables: list[LayerTables],
             links: list[np.ndarray | None], split: list[bool] | None = None,
             kind_splits: bool = False) -> Partition:
    """The per-stage times of a cut (the same numbers the DP minimised; `split` per
    stage as `time_matrix`'s); `kind_splits`: the schedule runs I and W apart, so the
    W's of every stage but the first leave one micro-batch's trip (`Partition.trip_s`)."""
    stage, fwd, bwd, beside = [], 0.0, 0.0, 0.0
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        t = tables[s]
        sp = split is not None and split[s]
        f = float(t.fwd_s[b] - t.fwd_s[a]) + t.actions.f_s
        bwd = float(t.bwd_s[b] - t.bwd_s[a]) + t.actions.backward_s(sp)
        if sp and t.split_s is not None:
            bwd += float(t.split_s[b] - t.split_s[a])
        if kind_splits and s > 0 and t.wgt_s is not None:      # W's off the way back
            beside += float(t.wgt_s[b] - t.wgt_s[a]) + t.actions.w_s
        link = 0.0 if links[s] is None else float(links[s][b])
        stage.append(f + bwd + link)
        fwd += f
    total = sum(stage)
    return Partition(tuple(bounds), tuple(stage), max(stage), total, fwd, bwd,
                     total - beside)


def peak_inflight(kind: str, p: int, m: int, chunks: int = 1) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations it holds at once under the
    schedule IR: counted from an F until that micro-batch's last backward op on the stage
    (W when the kind splits the backward, else B). Read off the generated actions, so any
    schedule kind that lands later is counted right without a formula here.

    Beyond a few rounds of p micro-batches the peak no longer grows (it is reached in the
    warm-up), so m is capped at 2p + (m mod p), which keeps interleaved rounds alike. Not
    so for a kind that stashes every micro-batch (GPipe, whose closed form the search
    reads instead, `SearchContext.peak_inflight`).
    """
    from hyperpipe.plan.kinds import generate
    m_eff = m if m <= 3 * p else 2 * p + m % p
    sched = generate(kind, p, m_eff, chunks)
    live = [0] * sched.num_stages
    peak = [0] * sched.num_stages
    for row in sched.actions:
        for a in row:
            if a.op == "F":
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.op in "BW":     # a (stage, mb) has one of them: its last op
                live[a.stage] -= 1
    return tuple(peak)
