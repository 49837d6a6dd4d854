"""The analytic tier: closed forms and recurrences per plan, for pruning the search.

`estimate(plan, cost)` returns the same `Metrics` as `simulate`, from the cost model's
per-stage times and no events. With t_r rank r's work per micro-batch, c the busiest
hop's share of the pipeline's transfers per micro-batch and T = max(max_r t_r, c):
gpipe, 1f1b and zb-h1 take the most of m max_r t_r + a fill (the other ranks' t_r and
the link times; zb-h1 fills with the non-bottleneck ranks' F + I - W), the busiest
hop's span (its m transfers one after another, with the least work before the first
and after the last), and for 1f1b and zb-h1 their forwards' rounds (a rank running h
forwards ahead starts each h-th one a round trip, its stage to the last and back with
the sends, after the one before; zb-h1's way back is its I's, its pace the slowest
F + I, its W's left to wait but stage 0's last), for gpipe its two phases (all
forwards, then all backwards, each at the pace of its slowest op or of its own way's
busiest hop); interleaved-1f1b takes m T + the fill divided by v, at least, per
stage, the first micro-batch's way to it and back and its own m forwards and backwards
(what sets it when m < p), plus, where its rounds of p leave a last round of k < p
micro-batches, (v - 1)(p - k) of the least backward; zb-v, dualpipe-v and synth replay
the orders for min(m, 2p) micro-batches (exact on free links), then T per further
micro-batch. When the plan's stack sends blocking, each send is part of its sender's
action (its link time added to that F or backward, none left on the link).
Each stage's data-parallel all-reduce (ring flows in buckets, overlapped with its last
backward or after the flush, as the stack says) and optimizer step follow; a hop serves
the rings that cross it one after another at best; with tied embeddings the first and
last stage then all-reduce the embedding's gradient before their optimizer steps. Peak
memory: static state plus the in-flight count times one micro-batch's stash.

Left out (the simulator has them): link sharing between replicas' point-to-point
traffic and with the all-reduces, and for the closed-form kinds the exact interleaving
of unequal stages and of a round trip's sends with the other micro-batches' work. Equal
to the simulation with equal stages on free links whose sends wait for no round trip,
but for interleaved-1f1b in padded rounds with v > 2 (within about 1%:
experiments/analytic_accuracy.py).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import accumulate, chain, pairwise
from operator import attrgetter, itemgetter
from typing import NamedTuple

import numpy as np

from hyperpipe.plan.kinds import generate, schedule_kind
from hyperpipe.plan.plan import (
    PipelinePlan,
    Plan,
    StagePlan,
    pipeline_placement,
    ring_member,
    schedule_for,
)
from hyperpipe.plan.schedule import Schedule, rank_peaks, rank_stages
from hyperpipe.plan.stack import DDP_BUCKET_BYTES
from hyperpipe.sim.analytic_cache import (
    AnalyticCache,
    Devices,
    LinkCost,
    RingCost,
    StageBytes,
    cache_for,
)
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.experts import (
    alltoall_s,
    expert_dp_rings,
    expert_extra_s,
    expert_share,
    expert_stash_extra_bytes,
    expert_state,
    paired_fraction,
)
from hyperpipe.sim.memory import peak_in_flight
from hyperpipe.sim.metrics import Metrics, RankUse, summarize
from hyperpipe.sim.network import bucket_count, p2p_edges, p2p_spec, ring_spec, tie_spec
from hyperpipe.sim.options import Execution, accumulate_extra_s, execution_of
from hyperpipe.sim.replay import schedule_makespan_s
from hyperpipe.sim.replicas import shape_classes, stage_holding
from hyperpipe.sim.sharding import (
    dp_shards,
    fill_delay_s,
    first_gather,
    fsdp_extra_s,
    rank_static_bytes,
    ring_attention_extra_s,
    stage_waits,
)

_DEVICES, _FIRST, _STAGES = attrgetter("devices"), itemgetter(0), attrgetter("stages")


class GradReady(NamedTuple):
    """When a stage's gradients are complete, as its all-reduce needs to know."""

    end_s: float           # its last backward action ends
    last_s: float          # that action's length (buckets stream during it)


class OpTimes(NamedTuple):
    """Per-stage compute times (seconds) of one micro-batch, by op."""

    f: list[float]
    i: list[float] | None          # None when neither split nor replayed
    w: list[float] | None
    b: list[float]                 # the whole backward: B, or I + W when split
    last: list[float]              # the last backward action: B, or W when split
    split: bool                    # I and W run apart


class ClassEstimate(NamedTuple):
    """One replica class's pipeline, estimated through its first member."""

    span_s: float                              # the pipeline's compute makespan
    ranks: list[RankUse]
    ready: dict[int, GradReady]                # stage -> when its gradients are ready
    rank_ends: list[tuple[float, list[int]]]   # per rank: compute end, its stages
    stage_devices: dict[int, Devices]          # stage -> its rank's devices, every member


def estimate(plan: Plan, cost: CostModel, *, cache: AnalyticCache | None = None,
             bucket_bytes: float = DDP_BUCKET_BYTES, include_optimizer: bool = True
             ) -> Metrics:
    """Closed-form metrics of one iteration of `plan` (see the module doc), on the
    plan's stack (`options.execution_of`).

    Fast: no events, one pass over each distinct pipeline's stages. Per-device and
    per-ring look-ups are kept between plans in the cost model's own cache
    (`AnalyticCache.of`), or in `cache` when a caller passes one.
    """
    cache = cache_for(cost, cache)
    ex = execution_of(plan, cost)
    classes, own = _classes(plan, cost, cache)
    per_class = [_class_estimate(plan, cost, members, own.get(members[0]), ex, cache)
                 for members in classes]
    ready = {(c, s): at for c, e in enumerate(per_class) for s, at in e.ready.items()}
    ties = [tie_spec(cost, plan, members, ex.tie_bytes_per_param) for members in classes]
    # a stack that reduces the tie first (`Execution.tied_reduce_first`): when both ends
    # have run their last action, then their data-parallel syncs
    first_done = {}
    for c, (e, tie) in enumerate(zip(per_class, ties, strict=True)):
        last = len(plan.pipelines[classes[c][0]].stages) - 1
        at_ends = [(end, mine) for end, mine in e.rank_ends if {0, last} & set(mine)]
        if tie is None or not ex.tied_reduce_first or not at_ends:
            continue
        first_done[c] = max(end for end, _ in at_ends) + tie.time_s
        if ex.overlap_dp_allreduce:
            continue                     # their buckets went during the last backward
        for _, mine in at_ends:
            for s in mine:
                ready[(c, s)] = ready[(c, s)]._replace(
                    end_s=max(ready[(c, s)].end_s, first_done[c]))
    rank_devices = {(c, s): devices for c, e in enumerate(per_class)
                    for s, devices in e.stage_devices.items()}
    done = _allreduce_done(plan, cost, classes, ready, rank_devices, cache, bucket_bytes,
                           ex)
    pipeline_s = max(e.span_s for e in per_class)
    iteration = pipeline_s
    for c, e in enumerate(per_class):
        stages = plan.pipelines[classes[c][0]].stages
        tie = ties[c]
        tied = (0, len(stages) - 1) if tie is not None else ()

        def finish(end: float, mine: list[int], tie_done: float, c=c, stages=stages,
                   tied=tied) -> tuple[float, dict[int, float]]:
            """When a rank is done, and when it reached each tied stage."""
            t, reached = end, {}
            for s in sorted(mine, key=lambda s: ready[(c, s)].end_s):
                t = max(t, done.get((c, s), 0.0))
                if s in tied:
                    reached[s] = t
                    t = max(t, tie_done)
                if include_optimizer:
                    t += _optimizer_s(cost, stages[s],
                                      dp_shards(plan, stages[s], cost.cluster), cache,
                                      expert_state(cost, plan, stages[s]))
            return t, reached

        tie_done = first_done.get(c, 0.0)
        if c not in first_done and tie is not None:
            # both ends reduced over data parallelism, then the tie
            arrivals = [at for end, mine in e.rank_ends
                        for at in finish(end, mine, 0.0)[1].values()]
            tie_done = max(arrivals) + tie.time_s
            iteration = max(iteration, tie_done)
        for end, mine in e.rank_ends:
            iteration = max(iteration, finish(end, mine, tie_done)[0])
    extra = {"tier": "analytic", "pipeline_s": pipeline_s, "replica_classes": classes}
    ranks = [r for e in per_class for r in e.ranks]
    return summarize(plan, cost, iteration, ranks, extra, cache)


def _classes(plan: Plan, cost: CostModel, cache: AnalyticCache
             ) -> tuple[list[list[int]], dict[int, Schedule]]:
    """The replica classes (`replicas.shape_classes`), and for kind synth each member's
    own schedule, which joins its class key (as in `replicas.replica_classes`)."""
    try:
        classes = shape_classes(plan, cache.class_names)
    except KeyError:                     # devices not seen yet: look their types up
        _learn_devices(plan, cost, cache)
        classes = shape_classes(plan, cache.class_names)
    own: dict[int, Schedule] = {}
    if not schedule_kind(plan.schedule).carries_actions:
        return list(classes.values()), own
    split: dict[tuple, list[int]] = {}
    for key, members in classes.items():
        for q in members:
            own[q] = schedule_for(plan, q)
            split.setdefault((key, own[q].actions), []).append(q)
    return list(split.values()), own


def _learn_devices(plan: Plan, cost: CostModel, cache: AnalyticCache) -> None:
    """Look up the type of every stage's first device the cache does not know yet."""
    names = cache.class_names
    every_stage = chain.from_iterable(map(_STAGES, plan.pipelines))
    for dev in sorted(set(map(_FIRST, map(_DEVICES, every_stage))) - names.keys()):
        device = cost.cluster.device(dev)
        kind = cache.device_types[dev] = device.type
        slow = device.slowdown              # a straggler is a class of its own
        names[dev] = kind.name if slow == 1.0 else f"{kind.name}@x{slow:g}"


def _class_estimate(plan: Plan, cost: CostModel, members: list[int],
                    sched: Schedule | None, ex: Execution, cache: AnalyticCache
                    ) -> ClassEstimate:
    """The pipeline of one replica class: its span, each rank's use, when each stage's
    gradients are ready. `sched`: kind synth's own orders, else None. With blocking
    sends (`ex.blocking_p2p`) each send is waited out by its sender (`_blocking`);
    ZeRO-2/3's gathers and scatters (`sharding.fsdp_extra_s`) and the engine's fp32
    gradient accumulation (`options.accumulate_extra_s`) join the actions, and
    without resharding the once-a-step gathers delay the fill (`_gather_delay_s`)."""
    blocking = ex.blocking_p2p

    def add(k: int, op: str) -> float:
        extra = fsdp_extra_s(cost, plan, members[0], k, op,
                             reshard=ex.reshard_after_forward,
                             grad_bytes_per_param=ex.grad_bytes_per_param) + \
            expert_extra_s(cost, plan, members[0], k, op) + \
            accumulate_extra_s(cost, plan, ex, members[0], k, op)
        a2a = alltoall_s(cost, plan, members[0], k, op)
        if schedule_kind(plan.schedule).overlaps_alltoall and a2a > 0:
            # DualPipe's pairs run it beside their compute, the other actions after it:
            # on average over the stage's actions of this op (`experts.paired_fraction`)
            mine = _stage_s(cost, plan.pipelines[members[0]].stages[k],
                            plan.pipelines[members[0]].micro_batch, op) + extra
            paired = paired_fraction(plan, members[0], k, op)
            return extra + paired * max(0.0, a2a - mine) + (1 - paired) * a2a
        return extra + a2a
    v, kind = plan.chunks, plan.schedule
    pipe = plan.pipelines[members[0]]
    st, m = pipe.stages, pipe.num_microbatches
    p = len(st) // v
    sched = _class_schedule(plan, pipe, sched)
    times = _op_times(cost, pipe, kind, sched, add)
    homes = [rank_stages(r, p, v, pipeline_placement(plan, pipe)) for r in range(p)]
    sizes = _sizes(cost, plan, members[0], ex, cache)
    crossed = [_link(cost, x, y, sizes[k].send_bytes, cache)
               for k, (x, y) in enumerate(pairwise(st))]
    # each hop's least span, on the sends' own times (blocking only waits longer)
    hops_s = _hops_s(m, times, crossed) if sched is None and v == 1 else 0.0
    whole_b = None          # a split kind's replayed B's, when the sends are folded in
    if blocking:
        times, crossed, whole_b = _blocking(cost, pipe, times, crossed, add)
    work = [sum(times.f[s] + times.b[s] for s in homes[r]) for r in range(p)]
    span = _span_s(cost, pipe, kind, times, sched, v, crossed, work, whole_b, add, hops_s)
    if plan.zero == 3 and not ex.reshard_after_forward:
        span += _gather_delay_s(cost, plan, members[0], homes, times.f, crossed, ex)
    # The last backward wave leaves stage s after the stages below it have run
    # theirs: a rank's chunks end their backwards (and start their rings) apart. A
    # split kind's W's wait to fill that wave: stage s ends what the stages below
    # take longer over their I's than over their W's before the end (exact on equal
    # stages with I >= W; all end together when I = W; with W > I the generated orders
    # end them apart again, the last stage last, which is not modelled).
    if times.split and sched is None and v == 1:
        below = [0.0, *accumulate(max(i - w, 0.0)
                                  for i, w in zip(times.i, times.w, strict=True))]
    else:
        below = [0.0, *accumulate(times.b)]
    ready = {s: GradReady(span - below[s], times.last[s]) for s in range(len(st))}
    peaks = _rank_peaks(cost, plan, pipe, homes, sizes, sched, ex, cache)
    columns = list(zip(*[plan.pipelines[q].stages for q in members], strict=True))
    ranks, rank_ends, stage_devices = [], [], {}
    for r in range(p):
        mine = homes[r]
        rank_ends.append((span - min(below[s] for s in mine), mine))
        device_type = cache.device_types[st[r].devices[0]]
        devices = tuple(chain.from_iterable(map(_DEVICES, columns[r])))
        stage_devices.update(dict.fromkeys(mine, devices))
        ranks.append(RankUse(devices, device_type, tuple(mine), peaks[r], m * work[r]))
    return ClassEstimate(span, ranks, ready, rank_ends, stage_devices)


def _class_schedule(plan: Plan, pipe: PipelinePlan, sched: Schedule | None
                    ) -> Schedule | None:
    """What a replica class is priced off: kind synth's own orders (`sched`), a kind
    without closed forms' generated IR, else None (the closed forms)."""
    if sched is not None:
        return sched
    return _generated(plan.schedule, len(pipe.stages) // plan.chunks,
                      pipe.num_microbatches, plan.chunks)


def _generated(kind: str, p: int, m: int, v: int) -> Schedule | None:
    """The IR a kind without closed forms is priced off; None for the closed forms."""
    if schedule_kind(kind).closed_form:
        return None
    # peaks stop growing at m = 2p (tests/test_schedule_v.py), the fill nearly so
    return generate(kind, p, min(m, 2 * p), v)


def _held(kind: str, p: int, m: int, v: int, sched: Schedule | None) -> list[int]:
    """Per rank, the micro-batches whose stashes it holds at its peak: `sched`'s
    (`_class_schedule`), or the closed forms'."""
    if sched is None:
        return [peak_in_flight(kind, p, m, v, r) for r in range(p)]
    return list(rank_peaks(sched))


def held_micro_batches(kind: str, p: int, m: int, v: int = 1) -> list[int]:
    """Per rank of a pipeline of a fixed `kind` (p ranks, m micro-batches, v chunks),
    the micro-batches whose stashes it holds at its peak, as `estimate` counts them."""
    return _held(kind, p, m, v, _generated(kind, p, m, v))


def _sizes(cost: CostModel, plan: Plan, q: int, ex: Execution, cache: AnalyticCache
           ) -> list[StageBytes]:
    """Each stage of pipeline q: its stash per micro-batch (with the routed experts'
    extra) and the bytes it sends on."""
    pipe = plan.pipelines[q]
    sizes = [_stage_bytes(cost, s, pipe.micro_batch, cache, ex.keeps_stage_outputs)
             for s in pipe.stages]
    return [z._replace(stash_bytes=z.stash_bytes + extra) if extra else z
            for z, extra in ((z, expert_stash_extra_bytes(cost, plan, q, k))
                             for k, z in enumerate(sizes))]


def _rank_peaks(cost: CostModel, plan: Plan, pipe: PipelinePlan,
                homes: list[tuple[int, ...]], sizes: list[StageBytes],
                sched: Schedule | None, ex: Execution, cache: AnalyticCache
                ) -> list[float]:
    """Per rank of `pipe`, its peak bytes: static state plus its in-flight count times
    its stages' mean stash (`sched`: `_class_schedule`'s)."""
    st, m, b, v = pipe.stages, pipe.num_microbatches, pipe.micro_batch, plan.chunks
    p = len(st) // v
    held = _held(plan.schedule, p, m, v, sched)
    peaks = []
    for r in range(p):
        mine = homes[r]
        stash = sum(sizes[s].stash_bytes for s in mine) / len(mine)
        device_type = cache.device_types[st[r].devices[0]]
        peaks.append(_static_bytes(cost, plan, [st[s] for s in mine], device_type.name,
                                   b, ex, cache) + stash * held[r])
    return peaks


def out_of_memory(plan: Plan, cost: CostModel, *, cache: AnalyticCache | None = None
                  ) -> bool:
    """Whether `estimate(plan, cost)` puts a device over its memory (a non-empty
    `Metrics.oom`), from the same peaks, without pricing any time."""
    cache = cache_for(cost, cache)
    ex = execution_of(plan, cost)
    classes, own = _classes(plan, cost, cache)
    for members in classes:
        pipe = plan.pipelines[members[0]]
        p = len(pipe.stages) // plan.chunks
        homes = [rank_stages(r, p, plan.chunks, pipeline_placement(plan, pipe))
                 for r in range(p)]
        sizes = _sizes(cost, plan, members[0], ex, cache)
        sched = _class_schedule(plan, pipe, own.get(members[0]))
        peaks = _rank_peaks(cost, plan, pipe, homes, sizes, sched, ex, cache)
        if any(peak > cache.device_types[pipe.stages[r].devices[0]].memory_bytes
               for r, peak in enumerate(peaks)):
            return True
    return False


def _gather_delay_s(cost: CostModel, plan: Plan, q: int, homes: list[tuple[int, ...]],
                    forward_s: list[float], crossed: list[LinkCost], ex: Execution
                    ) -> float:
    """ZeRO-3 without resharding: how much later the first micro-batch's forward path
    (stage by stage, with its sends) ends when each stage's first forward waits for its
    once-a-step gather (`sharding.first_forwards`; a rank's stages meet their first
    forwards in stage order). The path is the fill's: the schedule's span moves with it."""
    gathers = [first_gather(cost, plan, q, k, ex.grad_bytes_per_param)
               for k in range(len(forward_s))]
    links = [link.fwd_s for link in crossed] + [0.0]
    return fill_delay_s(stage_waits(gathers, homes),
                        [f + x for f, x in zip(forward_s, links, strict=True)])


def _no_add(k: int, op: str) -> float:
    return 0.0


def _op_times(cost: CostModel, pipe: PipelinePlan, kind: str, sched: Schedule | None,
              add=_no_add) -> OpTimes:
    """Per-stage F, I, W and backward times of one micro-batch of `pipe`; `add(k, op)`:
    seconds added to stage k's op (ZeRO-2/3)."""
    st, b = pipe.stages, pipe.micro_batch
    t_f = [_stage_s(cost, s, b, "F") + add(k, "F") for k, s in enumerate(st)]
    split = schedule_kind(kind).splits_backward or (
        sched is not None and schedule_kind(sched.kind).carries_actions
        and any(a.op == "W" for row in sched.actions for a in row))
    t_i = t_w = None
    if split or sched is not None:
        t_i = [_stage_s(cost, s, b, "I") + add(k, "I") for k, s in enumerate(st)]
        t_w = [_stage_s(cost, s, b, "W") + add(k, "W") for k, s in enumerate(st)]
    if split:
        t_b = [i + w for i, w in zip(t_i, t_w, strict=True)]
        return OpTimes(t_f, t_i, t_w, t_b, t_w, True)
    t_b = [_stage_s(cost, s, b, "B") + add(k, "B") for k, s in enumerate(st)]
    return OpTimes(t_f, t_i, t_w, t_b, t_b, False)


def _blocking(cost: CostModel, pipe: PipelinePlan, times: OpTimes,
              crossed: list[LinkCost], add=_no_add
              ) -> tuple[OpTimes, list[LinkCost], list[float]]:
    """Blocking sends (the sender waits until its message is delivered): each link time
    joins the action that sends it (F of stage k sends to k + 1; its B or I to k - 1),
    the message arriving as that longer action ends, so no link delay is left between
    them; the hops stay as busy. Returns the new times, links and (for the replay) each
    stage's B with its send."""
    n = len(times.f)
    fwd = [crossed[k].fwd_s if k < n - 1 else 0.0 for k in range(n)]
    bwd = [crossed[k - 1].bwd_s if k > 0 else 0.0 for k in range(n)]

    def plus(xs: list[float] | None, add: list[float]) -> list[float] | None:
        return None if xs is None else [x + a for x, a in zip(xs, add, strict=True)]

    b = plus(times.b, bwd)
    new = OpTimes(plus(times.f, fwd), plus(times.i, bwd), times.w, b,
                  times.w if times.split else b, times.split)
    whole_b = plus([_stage_s(cost, s, pipe.micro_batch, "B") + add(k, "B")
                    for k, s in enumerate(pipe.stages)], bwd) \
        if times.split else b
    return new, [LinkCost(0.0, 0.0, c.fwd_busy, c.bwd_busy) for c in crossed], whole_b


def _span_s(cost: CostModel, pipe: PipelinePlan, kind: str, times: OpTimes,
            sched: Schedule | None, v: int, crossed: list[LinkCost], work: list[float],
            whole_b: list[float] | None = None, add=_no_add, hops_s: float = 0.0
            ) -> float:
    """The pipeline's compute makespan: the replayed orders, then the period per further
    micro-batch; or the closed form (see the module doc). `whole_b`: each stage's B time
    for the replay (None: `times.b`, or B priced afresh for a split kind). `hops_s`: the
    least span its busiest hop allows (`_hops_s`; one chunk per rank)."""
    m = pipe.num_microbatches
    links = [(c.fwd_s, c.bwd_s) for c in crossed]
    top = max(range(len(work)), key=work.__getitem__)
    hop = _busiest_hop_s(chain.from_iterable(c.busy for c in crossed))
    period = max(work[top], hop)
    if sched is not None:
        # the order itself, replayed on free links; the rest at the period
        b_s = whole_b if whole_b is not None else times.b if not times.split else \
            [_stage_s(cost, s, pipe.micro_batch, "B") + add(k, "B")
             for k, s in enumerate(pipe.stages)]
        return schedule_makespan_s(sched, times.f, times.i, times.w, b_s, links) + \
            (m - sched.num_microbatches) * period
    link_sum = sum(fwd + bwd for fwd, bwd in links)
    if times.split:
        # a rank's W's fill its bubble at best: never less than no bubble at all
        fill = sum(max(times.f[r] + times.i[r] - times.w[r], 0.0) for r in range(len(work))
                   if r != top) + link_sum / v
    else:
        fill = (sum(work) - work[top] + link_sum) / v
    if v > 1:
        # at least, per stage: the first micro-batch's way to it, its own m forwards and
        # backwards, and the last one's way back to stage 0 (any order; equal stages
        # with fewer micro-batches than ranks: 3 (p v + m - 1) t, the last stage's)
        way = [0.0, *accumulate(times.f[k] + times.b[k] + sum(links[k])
                                for k in range(len(times.f) - 1))]
        own = max(way[k] + m * (times.f[k] + times.b[k]) for k in range(len(times.f)))
        span = max(m * period + fill, own)
        built = schedule_kind(kind).built_microbatches
        p = len(work)
        if built is not None and built(p, m) != m:
            # a last round of k < p micro-batches (the phantoms' dropped): each of its
            # v - 1 loops back leaves p - k backwards' slots idle, each at least the
            # least backward (exact with equal stages whose backward is at least their
            # forward, up to a step or two with v > 2 and small k)
            span += (v - 1) * (p - m % p) * min(times.b)
        return span
    # one chunk per rank: the busiest rank's work with the others' fill, the busiest
    # hop's span, and the forwards' rounds (GPipe: its two phases). A split kind's
    # gradient goes down by its I's, and its W's may wait: its forwards and I's keep
    # the pace of the slowest F + I, and after the last I only stage 0's last W is left
    kind_of = schedule_kind(kind)
    ahead = [kind_of.ahead(len(work), m, 1, r) for r in range(len(work))]
    on, pace, last = times, period, 0.0
    if times.split:
        on, last = times._replace(b=times.i), times.w[0]
        pace = max(max(f + i for f, i in zip(times.f, times.i, strict=True)), hop)
    if any(m > h for h in ahead):
        other = _held_rounds_s(ahead, m, on, links, pace) + last
    else:
        other = _phases_s(m, on, links, crossed) + last
    # and per rank: the first forward's way to it, then its own m micro-batches' work
    # (what a split kind's fill misses where W exceeds I: its last rank's span)
    arrive = accumulate((times.f[k] + links[k][0] for k in range(len(work) - 1)), initial=0.0)
    own = max(a + m * t for a, t in zip(arrive, work, strict=True))
    return max(m * work[top] + fill, hops_s, other, own)


def _hops_s(m: int, times: OpTimes, crossed: list[LinkCost]) -> float:
    """A lower bound on a one-chunk pipeline's span (seconds) from its hops: a hop serves
    its m micro-batches' transfers one after another, the first no earlier than the
    first micro-batch's way to it (every forward before it, and for a gradient every
    backward after it, on idle links), and the last followed at least by the way on
    (the later forwards, then every backward down to stage 0; for a split kind the
    input gradients, then stage 0's last W). Per hop: that start, m x its busy seconds
    per micro-batch, and that remainder, each the least over the transfers it serves;
    the latest hop counts (0.0 without any)."""
    p = len(times.f)
    back = times.i if times.split else times.b
    last = times.w[0] if times.split else 0.0
    fwd = [c.fwd_s for c in crossed]
    bwd = [c.bwd_s for c in crossed]
    f_done = list(accumulate(times.f[k] + (fwd[k - 1] if k else 0.0) for k in range(p)))
    # the first micro-batch's backward ends at stage k, down from the last stage
    b_done = [0.0] * p
    at = f_done[-1]
    for k in range(p - 1, -1, -1):
        at += back[k]
        b_done[k] = at
        at += bwd[k - 1] if k else 0.0          # its gradient's way to stage k - 1
    down = sum(back) + sum(bwd) + last            # every backward to stage 0, and after
    start: dict[str, float] = {}
    busy: dict[str, float] = defaultdict(float)
    tail: dict[str, float] = {}

    def serve(hops, first_s: float, rest_s: float) -> None:
        for hop, busy_s in hops:
            busy[hop] += busy_s
            start[hop] = min(start.get(hop, first_s), first_s)
            tail[hop] = min(tail.get(hop, rest_s), rest_s)
    for k, c in enumerate(crossed):
        serve(c.fwd_busy, f_done[k],
              sum(times.f[k + 1:]) + sum(fwd[k + 1:]) + down)
        serve(c.bwd_busy, b_done[k + 1],
              sum(back[:k + 1]) + sum(bwd[:k]) + last)
    return max((start[h] + m * busy[h] + tail[h] for h in busy), default=0.0)


def _phases_s(m: int, times: OpTimes, links: list[tuple[float, float]],
              crossed: list[LinkCost]) -> float:
    """The span where every rank holds every micro-batch (GPipe; one stage per rank): all
    forwards, then all backwards, each phase one micro-batch's way through the pipeline
    and then, per further micro-batch, its period: the slowest stage's op or the
    busiest hop's share of that phase's sends (one way only: the activations go before
    any gradient comes back)."""
    forward = max(*times.f, _busiest_hop_s(chain.from_iterable(c.fwd_busy
                                                                for c in crossed)))
    backward = max(*times.b, _busiest_hop_s(chain.from_iterable(c.bwd_busy
                                                                 for c in crossed)))
    trip = sum(times.f) + sum(times.b) + sum(f + b for f, b in links)
    return (m - 1) * (forward + backward) + trip


def _busiest_hop_s(busy) -> float:
    """The most seconds any hop (a NIC's way) is busy with the (hop, seconds) transfers
    of `busy` per micro-batch; 0.0 without any."""
    per_hop: dict[str, float] = defaultdict(float)
    for hop, busy_s in busy:
        per_hop[hop] += busy_s
    return max(per_hop.values(), default=0.0)


def _held_rounds_s(held: list[int], m: int, times: OpTimes,
                   links: list[tuple[float, float]], period: float) -> float:
    """The span where ranks may hold fewer micro-batches than there are (1F1B; one stage
    per rank): rank r, holding held[r] = h, starts its forward of micro-batch j + h only
    after its backward of j, a round trip R_r later (its forward, every later stage's
    forward and backward, the sends between, its backward), so its forwards come in
    rounds of h, one round trip apart, the last round's each at least `period` after the
    one before. Per rank: the first forward's arrival, floor((m - 1) / h) + 1 round
    trips, the last round's further micro-batches at the period, and the last backward's
    way down to stage 0; the latest rank counts (0.0 where no rank holds fewer than m)."""
    p = len(times.f)
    down = [(times.f[k] + links[k][0], times.b[k] + links[k][1]) for k in range(p - 1)]
    arrive = [0.0, *accumulate(f for f, _ in down)]
    back = [0.0, *accumulate(b for _, b in down)]
    worst, trip = 0.0, 0.0
    for r in range(p - 1, -1, -1):
        trip += times.f[r] + times.b[r] + (sum(links[r]) if r < p - 1 else 0.0)
        if m > held[r]:
            rounds = (m - 1) // held[r]
            worst = max(worst, arrive[r] + (rounds + 1) * trip +
                        (m - 1 - rounds * held[r]) * period + back[r])
    return worst


def _stage_s(cost: CostModel, stage: StagePlan, micro_batch: int, op: str) -> float:
    """`CostModel.stage_time_s` of a plan stage, with its recompute, sequence and
    context parallelism (and the ring exchange it leaves exposed)."""
    return cost.stage_time_s(stage.layers, stage.devices, micro_batch, op, stage.recompute,
                             stage.sequence_parallel, stage.cp) + \
        ring_attention_extra_s(cost, stage, micro_batch, op)


def _stage_bytes(cost: CostModel, stage: StagePlan, micro_batch: int, cache: AnalyticCache,
                 keeps_outputs: bool = False) -> StageBytes:
    """A stage's stash per micro-batch (with the stage output the engine keeps, when
    `keeps_outputs`) and bytes sent on, per device."""
    key = ((stage.layers, stage.tp, stage.recompute, stage.sequence_parallel, stage.cp),
           micro_batch, keeps_outputs)
    got = cache.stage_bytes.get(key)
    if got is None:
        got = cache.stage_bytes[key] = StageBytes(cost.stage_stash_bytes(stage, micro_batch,
                                                                         keeps_outputs),
                                                  cost.send_bytes(stage.layers, micro_batch))
    return got


def _static_bytes(cost: CostModel, plan: Plan, stages: list[StagePlan], type_name: str,
                  micro_batch: int, ex: Execution, cache: AnalyticCache) -> float:
    """`CostModel.device_static_bytes` of a rank's stages, cached by their shape, shards,
    ZeRO stage and device type."""
    shards = tuple(dp_shards(plan, s, cost.cluster) for s in stages)
    experts = tuple(expert_state(cost, plan, s) for s in stages)
    key = (tuple((s.layers, s.tp, s.recompute, s.sequence_parallel, s.cp) for s in stages),
           type_name, micro_batch, shards, ex.zero, ex.reshard_after_forward, experts)
    got = cache.static_bytes.get(key)
    if got is None:
        got = cache.static_bytes[key] = rank_static_bytes(cost, plan, stages, micro_batch,
                                                          ex.reshard_after_forward)
    return got


def _link(cost: CostModel, x: StagePlan, y: StagePlan, nbytes: float, cache: AnalyticCache
          ) -> LinkCost:
    """The activations x -> y and the gradients y -> x: their idle-link times, and the
    seconds each hop they cross is busy."""
    key = (x.devices, y.devices, nbytes)
    got = cache.links.get(key)
    if got is None:
        fwd = p2p_spec(cost, p2p_edges(x.devices, y.devices), nbytes)
        bwd = p2p_spec(cost, p2p_edges(y.devices, x.devices), nbytes)
        got = cache.links[key] = LinkCost(
            fwd.time_s if fwd else 0.0, bwd.time_s if bwd else 0.0,
            fwd.busy_s() if fwd else (), bwd.busy_s() if bwd else ())
    return got


def _optimizer_s(cost: CostModel, stage: StagePlan, shards: int, cache: AnalyticCache,
                 experts: tuple[float, int | None] = (1.0, None)) -> float:
    """A stage's optimizer step on its devices (their slowdown included); `experts`:
    its share of the routed experts and their shards (`experts.expert_state`)."""
    name = cache.device_types[stage.devices[0]].name
    key = (stage.layers, name, stage.tp, shards, experts)
    got = cache.optimizer_s.get(key)
    if got is None:
        got = cache.optimizer_s[key] = cost.optimizer_time_s(
            stage.layers, name, stage.tp, shards, expert_share=experts[0],
            expert_shards=experts[1])
    return got * cost.cluster.slowdown(stage.devices)


def _params(cost: CostModel, layers: tuple[int, int], cache: AnalyticCache) -> float:
    got = cache.params.get(layers)
    if got is None:
        got = cache.params[layers] = cost.stage_params(layers)
    return got


def _allreduce_done(plan: Plan, cost: CostModel, classes: list[list[int]],
                    ready: dict[tuple[int, int], GradReady],
                    rank_devices: dict[tuple[int, int], Devices], cache: AnalyticCache,
                    bucket_bytes: float, ex: Execution) -> dict[tuple[int, int], float]:
    """When each (class, stage)'s gradient all-reduce ends: per layer range held by one
    stage in every replica, the ring flow's time (`_ring`) in buckets, and not before
    its busiest hop has served every ring that crosses it (`_served`); with `overlap`
    the buckets stream during the last backward (bucket j ready after (j+1)/k of it)."""
    grad_bytes, overlap = ex.dp_sync_bytes_per_param, ex.overlap_dp_allreduce
    pipes = plan.pipelines
    done: dict[tuple[int, int], float] = {}
    if len(pipes) == 1 and all(s.cp == 1 for s in pipes[0].stages):
        return done
    cuts = sorted({s.layers[1] for members in classes for s in pipes[members[0]].stages})
    # Members of a class share their cuts: the stage holding each layer, once per class.
    firsts = [{s.layers[0]: k for k, s in enumerate(pipes[members[0]].stages)}
              for members in classes]
    owners = []                          # per layer range: (parts, own finish, latency)
    starts, crossed, busy_s = [], [], []   # ... when its rings start, hops, busy seconds
    start = 0
    for end in cuts:
        layers = (start, end)
        parts = [(c, firsts[c][start] if start in firsts[c] else
                  stage_holding(pipes[members[0]].stages, start))
                 for c, members in enumerate(classes)]
        start = end
        tps = [pipes[classes[c][0]].stages[k].tp for c, k in parts]
        # Ring i syncs the i-th of tp slices (a device of a smaller group is in several
        # rings, one slice each), as the simulator's `program.prepare_collectives`.
        tp = max(tps)
        # Under expert parallelism the routed experts' gradients go over their own
        # expert-data-parallel rings (`experts.expert_dp_rings`), the rest as usual.
        q0 = classes[0][0]
        k0 = stage_holding(pipes[q0].stages, layers[0])
        experts = cost.expert_params(layers) if pipes[q0].stages[k0].ep > 1 else 0
        jobs = [((_params(cost, layers, cache) - experts) * grad_bytes / tp, None)]
        if experts:
            jobs.append((experts * expert_share(cost, plan, q0, k0) * grad_bytes / tp,
                         expert_dp_rings(plan, q0, k0)))
        for nbytes, rings in jobs:
            if nbytes <= 0 or (rings is not None and len(rings[0]) <= 1):
                continue
            k = bucket_count(nbytes, bucket_bytes)
            ring = _bucket_ring(cost, pipes, classes, parts, rank_devices, tps, nbytes / k,
                                cache) if rings is None else _ring(cost, rings, nbytes / k,
                                                                   cache)
            ends = [ready[part] for part in parts]
            if overlap:
                s0 = max(e - length for e, length in ends)
                d = max(length for _, length in ends) / k
                finish = s0 + max(d + k * ring.time_s, k * d + ring.time_s)   # buckets
                s0 += d
            else:
                s0 = max(e for e, _ in ends)
                finish = s0 + k * ring.time_s
            owners.append((parts, finish, ring.latency_s))
            starts.append(s0)
            crossed.append(ring.hops)
            busy_s.append(k * ring.busy_s)
    # A hop serves the rings of every layer range that cross it one after another at best
    # (equal time-sharing, as the simulator's network): none ends before its busy time.
    served = _served(starts, [cache.hop_rank(h) for h in crossed], busy_s)
    for (parts, finish, lat), end in zip(owners, served, strict=True):
        finish = max(finish, end + lat)
        for part in parts:
            done[part] = max(done.get(part, 0.0), finish)
    return done


def _bucket_ring(cost: CostModel, pipes: tuple[PipelinePlan, ...], classes: list[list[int]],
                 parts: list[tuple[int, int]], rank_devices: dict[tuple[int, int], Devices],
                 tps: list[int], nbytes: float, cache: AnalyticCache) -> RingCost:
    """One bucket's rings for the layer range held by `parts` ((class, stage) pairs):
    ring i joins tensor-parallel rank i (modulo its group's size) of every replica."""
    tp = max(tps)
    if tp == min(tps):
        # Every member's group, class by class: the devices its ranks stand for.
        flat = rank_devices[parts[0]] if len(parts) == 1 else \
            tuple([d for part in parts for d in rank_devices[part]])
        key = (flat, tp, nbytes)
        got = cache.even_rings.get(key)
        if got is None:
            got = cache.even_rings[key] = _ring(
                cost, [list(flat[i::tp]) for i in range(tp)], nbytes, cache)
        return got
    held = tuple([pipes[q].stages[k] for (_, k), members
                  in zip(parts, classes, strict=True) for q in members])
    groups = tuple(st.devices for st in held)
    got = cache.mixed_rings.get((groups, nbytes))
    if got is None:
        # ring i: the tensor rank holding slice i of tp (`ring_member`) of every
        # context rank
        got = cache.mixed_rings[(groups, nbytes)] = _ring(
            cost, [[st.devices[c * st.tp + ring_member(i, st.tp, tp)] for st in held
                    for c in range(st.cp)]
                   for i in range(tp)], nbytes, cache)
    return got


def _ring(cost: CostModel, rings: list[list[str]], nbytes: float, cache: AnalyticCache
          ) -> RingCost:
    """A bucket's all-reduce on `rings` at once, as the simulator runs it
    (`network.ring_spec`): rings that cross one hop share it; hops numbered in
    `cache.hop_numbers`."""
    spec = ring_spec(cost, rings, nbytes)
    if spec is None:
        return RingCost(0.0, 0.0, np.zeros(0, dtype=np.int64), np.zeros(0))
    number = cache.hop_numbers
    busy = spec.busy_s()
    hops = np.array([number.setdefault(hop, len(number)) for hop, _ in busy], dtype=np.int64)
    return RingCost(spec.time_s, spec.latency_s, hops, np.array([s for _, s in busy]))


def _served(starts: list[float], hops: list[np.ndarray], busy: list[np.ndarray]
            ) -> np.ndarray:
    """Per job (a ring that starts at starts[j] and keeps hops[j] busy for busy[j]
    seconds each): when the last of its hops is done, at the earliest. A hop serving
    jobs one at a time ends no earlier than, over release times t, t + the work released
    at or after t (the single-machine bound, tight when the hop never idles). Hops are
    numbered by `AnalyticCache.hop_rank` (their names' order), so that the running sums
    below, and the result to its last bit, do not depend on which plans the cache saw
    first."""
    sizes = np.array([len(h) for h in hops], dtype=np.int64)
    if not sizes.sum():
        return np.zeros(len(starts))
    hop = np.concatenate(hops)
    work = np.concatenate(busy)
    start = np.repeat(np.asarray(starts), sizes)
    order = np.lexsort((-start, hop))            # by hop, latest release first
    hop_o, run = hop[order], np.cumsum(work[order])
    first = np.flatnonzero(np.r_[True, hop_o[1:] != hop_o[:-1]])
    counts = np.diff(np.r_[first, len(hop_o)])
    before = np.repeat(run[first] - work[order][first], counts)
    ends = np.maximum.reduceat(start[order] + run - before, first)   # per hop
    at = np.empty(len(hop), dtype=float)
    at[order] = np.repeat(ends, counts)
    edges = np.r_[0, np.cumsum(sizes)[:-1]]
    out = np.zeros(len(starts))
    some = sizes > 0
    out[some] = np.maximum.reduceat(at, edges[some])
    return out
