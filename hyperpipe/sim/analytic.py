"""The analytic tier: closed forms and recurrences per plan, for pruning the search.

`estimate(plan, cost)` returns the same `Metrics` as `simulate`, from per-stage times
of the cost model and no events. With t_r the work of rank r per micro-batch (F + B of
its stages; F + I + W for zb-h1), c the busiest hop's (a NIC's, one way) share of the
pipeline's transfers per micro-batch and T = max(max_r t_r, c) the period:

* gpipe, 1f1b:            m T + (sum_r t_r - max_r t_r) + sum of link times
  (for equal stages and free links: (m + p - 1)(t_F + t_B), the GPipe/1F1B closed form);
* interleaved-1f1b (v):   m T + (sum_r t_r - max_r t_r) / v + sum of link times / v
  (equal chunks: 3 m v t + 3 (p - 1) t, Megatron's (p - 1) / v bubble);
* zb-h1:                  m T + sum over non-bottleneck ranks of (F + I - W) + links
  (equal F = I = W = t: 3 m t + (p - 1) t, Qi et al. 2023);
* zb-v, dualpipe-v (V placement, rank r holds stages r and 2p-1-r): the generator's
  orders for min(m, 2p) micro-batches replayed with the stage and link times
  (`improve.schedule_makespan_s`, exact on free links), then T per further micro-batch
  (equal chunks of F = I = W = t and m >= 2p: 6 m t + (p - 1) t);
* synth: each pipeline's own orders replayed (exact on free links).

Stage s ends its last backward about sum_{s' < s} (backward of s') before the pipeline
ends (the last micro-batch's backward wave, so a rank's chunks end theirs apart); its
data-parallel all-reduce (the simulator's ring flow, `network.ring_spec`, in buckets,
overlapped with that last backward as the simulator does) and its optimizer step follow.
Every hop (a NIC, a port) serves the rings of all layer ranges that cross it at best one
after another, so none ends before the hop has moved them all since they started (nodes
with fewer NICs than devices). Like replicas are computed once. Peak memory is static
state plus the in-flight count (closed form, or read off the replayed orders) times the
stash of one micro-batch.

Left out (the simulator has them): link sharing between replicas' point-to-point traffic
and with the all-reduces (bounded only among the all-reduces), and for the closed-form
kinds the exact interleaving of unequal stages. Tested: equal to the simulation on free
links (equal stages; unequal too for the replayed kinds), the gap bounded elsewhere.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from itertools import accumulate, chain, pairwise, repeat
from operator import attrgetter, eq, itemgetter

import numpy as np

from hyperpipe.cluster.catalog import DeviceType
from hyperpipe.plan.generators import SYNTH, generate
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.plan_schedule import pipeline_placement, rank_peaks, schedule_for
from hyperpipe.plan.schedule import rank_stages
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.memory import oom_detail, peak_in_flight
from hyperpipe.sim.metrics import Metrics
from hyperpipe.sim.network import p2p_edges, p2p_spec, ring_spec
from hyperpipe.sim.replay import schedule_makespan_s

_SPLIT = frozenset({"zb-h1", "zb-v", "dualpipe-v"})       # kinds that run I and W apart
_REPLAYED = frozenset({"zb-v", "dualpipe-v", SYNTH})      # time and in-flight off the IR
DDP_BUCKET_BYTES = 25e6      # PyTorch DDP's default bucket_cap_mb=25, as SimOptions


@dataclass(frozen=True)
class RankUse:
    """What one pipeline rank used in an iteration, for every device it stands for
    (its tensor-parallel group, in every replica with the same timing)."""

    devices: tuple[str, ...]
    device_type: DeviceType
    stages: tuple[int, ...]
    peak_bytes: float
    busy_s: float                  # compute time per device (F, B, I, W)


def summarize(plan: Plan, cost: CostModel, iteration_s: float, ranks: list[RankUse],
              extra: dict, cache: dict | None = None) -> Metrics:
    """DESIGN.md's metrics from an iteration time and per-rank usage (both tiers)."""
    cache = _cache_for(cost, cache)
    model = cost.model
    t = iteration_s
    throughput = plan.global_batch / t if t > 0 else 0.0
    sizes = set(map(_MB, plan.pipelines))
    if len(sizes) == 1:                  # one micro-batch size: no loop over pipelines
        model_flops = sum(map(_M, plan.pipelines)) * _model_flops(cost, sizes.pop(), cache)
    else:
        model_flops = sum(p.num_microbatches * _model_flops(cost, p.micro_batch, cache)
                          for p in plan.pipelines)
    n_dev = busy = peak_flops = 0.0
    peaks: dict[str, float] = {}
    oom: list[str] = []
    detail: list[dict] = []
    for r in ranks:
        n = len(r.devices)
        n_dev += n
        busy += r.busy_s * n
        peak_flops += r.device_type.peak_flops * n
        peaks.update(dict.fromkeys(r.devices, r.peak_bytes))
        if r.peak_bytes > r.device_type.memory_bytes:
            oom += r.devices
            detail.append(oom_detail(r.devices, r.stages, r.peak_bytes,
                                     r.device_type.memory_bytes))
    if detail:
        extra = {**extra, "oom_detail": detail}
    price = _price_per_s(cost.cluster, ranks, cache)
    tokens_per_s = throughput * model.seq_len
    return Metrics(
        iteration_time_s=t,
        throughput_samples_per_s=throughput,
        tokens_per_s=tokens_per_s,
        bubble_fraction=1.0 - busy / (t * n_dev) if t > 0 and n_dev else 0.0,
        mfu=model_flops / (t * peak_flops) if t > 0 and peak_flops else 0.0,
        peak_memory_bytes=peaks, oom=oom,
        cost_per_million_tokens=price / tokens_per_s * 1e6
        if price is not None and tokens_per_s > 0 else None,
        extra=extra)


def _stage_s(cost: CostModel, stage, micro_batch: int, op: str) -> float:
    """`CostModel.stage_time_s` of a plan stage, with its recompute and sequence
    parallelism."""
    return cost.stage_time_s(stage.layers, stage.devices, micro_batch, op, stage.recompute,
                             stage.sequence_parallel)


def _cache_for(cost: CostModel, cache: dict | None) -> dict:
    """`cache` emptied unless it was filled for this very cost model (look-ups that
    depend only on the cost model, kept between plans); None: the cost model's own."""
    if cache is None:
        cache = cost.memo("analytic")
    if cache.get("cost") is not cost:
        cache.clear()
        cache["cost"] = cost
    return cache


def _model_flops(cost: CostModel, micro_batch: int, cache: dict) -> float:
    """F + I + W FLOPs of the whole model for one micro-batch (what MFU counts)."""
    key = ("flops", micro_batch)
    if key not in cache:
        cache[key] = sum(cost.op_flops(i, micro_batch, op)
                         for i in range(cost.model.num_layers) for op in "FIW")
    return cache[key]


def _price_per_s(cluster, ranks: list[RankUse], cache: dict) -> float | None:
    """USD per second of every used device, or None if one has no price."""
    prices = cache.get("prices")
    if prices is None:
        prices = cache["prices"] = {}
    total = 0.0
    for r in ranks:
        price = prices.get(r.devices)
        if price is None:
            each = [cluster.price_per_hour(dev) for dev in r.devices]
            if None in each:
                return None
            price = prices[r.devices] = sum(each)
        total += price
    return total / 3600.0


# ---------------------------------------------------------------------------- estimate

def estimate(plan: Plan, cost: CostModel, *, cache: dict | None = None,
             bucket_bytes: float = DDP_BUCKET_BYTES, overlap_dp_allreduce: bool = True,
             include_optimizer: bool = True) -> Metrics:
    """Closed-form metrics of one iteration of `plan` (see the module doc).

    Fast: no events, one pass over each distinct pipeline's stages. Per-device and
    per-ring look-ups are kept between plans in the cost model's own cache
    (`CostModel.memo`), or in `cache` when a caller passes one.
    """
    cache = _cache_for(cost, cache)
    cluster = cost.cluster
    v, kind = plan.chunks, plan.schedule
    types: dict = cache.setdefault("types", {})          # device -> its DeviceType
    names: dict = cache.setdefault("type_names", {})     # device -> its type's name
    try:
        classes = _classes(plan, names)
    except KeyError:                     # devices not seen yet: look their types up
        every_stage = chain.from_iterable(map(_STAGES, plan.pipelines))
        for dev in sorted(set(map(_FIRST, map(_DEVICES, every_stage))) - names.keys()):
            types[dev] = cluster.device(dev).type
            slow = cluster.device(dev).slowdown     # a straggler is a class of its own
            names[dev] = types[dev].name if slow == 1.0 else f"{types[dev].name}@x{slow:g}"
        classes = _classes(plan, names)
    own = {}                 # kind synth: each pipeline's own schedule, in its class key
    if kind == SYNTH:        # (as `replica_classes`)
        split: dict[tuple, list[int]] = {}
        for key, members in classes.items():
            for q in members:
                own[q] = schedule_for(plan, q)
                split.setdefault((key, own[q].actions), []).append(q)
        classes = split

    ranks: list[RankUse] = []
    ready: dict[tuple[int, int], tuple[float, float]] = {}  # (class, stage) -> (end, last)
    rank_info = []        # (class, compute end, stages of the rank)
    rank_devices: dict[tuple[int, int], tuple[str, ...]] = {}   # (class, stage) -> devices
    spans = []
    shards = len(plan.pipelines) if plan.distributed_optimizer else 1
    for c, members in enumerate(classes.values()):
        pipe = plan.pipelines[members[0]]
        st, m, b = pipe.stages, pipe.num_microbatches, pipe.micro_batch
        n_st = len(st)
        p = n_st // v
        t_f = [_stage_s(cost, s, b, "F") for s in st]
        sched = own.get(members[0])         # synth: the class's own; else none yet
        if kind in _REPLAYED and sched is None:
            # peaks stop growing at m = 2p (tests/test_schedule_v.py), the fill nearly so
            sched = generate(kind, p, min(m, 2 * p), v)
        split = kind in _SPLIT or (sched is not None and sched.kind == SYNTH and any(
            a.op == "W" for row in sched.actions for a in row))
        placement = pipeline_placement(plan, pipe)
        homes = [rank_stages(r, p, v, placement) for r in range(p)]
        if split or sched is not None:
            t_i = [_stage_s(cost, s, b, "I") for s in st]
            t_w = [_stage_s(cost, s, b, "W") for s in st]
        if split:
            t_b = [i + w for i, w in zip(t_i, t_w, strict=True)]
            last = t_w
        else:
            t_b = last = [_stage_s(cost, s, b, "B")
                          for s in st]
        sizes = [_stage_bytes(cost, s, b, cache) for s in st]
        crossed = [_link(cost, x, y, sizes[k][1], cache) for k, (x, y) in enumerate(pairwise(st))]
        links = [times for times, _ in crossed]
        work = [sum(t_f[s] + t_b[s] for s in homes[r]) for r in range(p)]
        top = max(range(p), key=work.__getitem__)
        per_hop: dict[str, float] = defaultdict(float)   # a NIC's way: its transfers
        for hop, busy_s in chain.from_iterable(busy for _, busy in crossed):
            per_hop[hop] += busy_s
        period = max([work[top], *per_hop.values()])
        if sched is not None:
            # the order itself, replayed on free links; the rest at the period
            b_s = t_b if not split else [_stage_s(cost, s, b, "B") for s in st]
            span = schedule_makespan_s(sched, t_f, t_i, t_w, b_s, links) + \
                (m - sched.num_microbatches) * period
        else:
            link_sum = sum(fwd + bwd for fwd, bwd in links)
            if split:
                fill = sum(t_f[r] + t_i[r] - t_w[r] for r in range(p) if r != top) + \
                    link_sum / v
            else:
                fill = (sum(work) - work[top] + link_sum) / v
            span = m * period + fill
        spans.append(span)
        # The last backward wave leaves stage s after the stages below it have run
        # theirs: a rank's chunks end their backwards (and start their rings) apart.
        below = [0.0, *accumulate(t_b)]
        columns = list(zip(*[plan.pipelines[q].stages for q in members], strict=True))
        held = [peak_in_flight(kind, p, m, v, r) for r in range(p)] if sched is None \
            else rank_peaks(sched)
        for r in range(p):
            mine = homes[r]
            for s in mine:
                ready[(c, s)] = (span - below[s], last[s])
            rank_info.append((c, span - min(below[s] for s in mine), mine))
            stash = sum(sizes[s][0] for s in mine) / len(mine)
            peak = _static_bytes(cost, [st[s] for s in mine], types[st[r].devices[0]].name,
                                 b, shards, cache) + stash * held[r]
            devices = tuple(chain.from_iterable(map(_DEVICES, columns[r])))
            for s in mine:
                rank_devices[(c, s)] = devices
            ranks.append(RankUse(devices, types[st[r].devices[0]], tuple(mine), peak,
                                 m * work[r]))

    reps = [members[0] for members in classes.values()]
    done = _allreduce_done(plan, cost, list(classes.values()), ready, rank_devices, cache,
                           bucket_bytes, overlap_dp_allreduce)
    iteration = max(spans)
    for c, end, mine in rank_info:
        t = end
        for s in sorted(mine, key=lambda s, c=c: ready[(c, s)][0]):
            t = max(t, done.get((c, s), 0.0))
            if include_optimizer:
                t += _optimizer_s(cost, plan.pipelines[reps[c]].stages[s], types, shards,
                                  cache)
        iteration = max(iteration, t)
    extra = {"tier": "analytic", "pipeline_s": max(spans),
             "replica_classes": list(classes.values())}
    return summarize(plan, cost, iteration, ranks, extra, cache)


def _classes(plan: Plan, names: dict) -> dict[tuple, list[int]]:
    """Pipelines grouped by micro-batches, cuts, tp and device types (`names`: device ->
    type name; KeyError for a device not in it). C-level maps where it can: this sees
    every stage of a 1024-GPU plan."""
    pipes = plan.pipelines
    if _all_alike(pipes, names, len(pipes[0].stages) // plan.chunks):
        return {(): list(range(len(pipes)))}
    classes: dict[tuple, list[int]] = {}
    for q, pipe in enumerate(pipes):
        st = pipe.stages
        key = (pipe.micro_batch, pipe.num_microbatches, tuple(map(_LAYERS, st)),
               tuple(map(_TP, st)), tuple(map(names.__getitem__, map(_FIRST, map(_DEVICES, st)))),
               tuple(map(_MEMORY_MODE, st)))
        classes.setdefault(key, []).append(q)
    return classes


def _all_alike(pipes, names: dict, p: int) -> bool:
    """Whether every pipeline has the same micro-batches, cuts, tp and device types per
    stage: one column at a time, with C-level maps (the common data-parallel case).
    Device types are checked on the first `p` stages: chunk c's stages sit on the same
    devices (looped placement, `Plan.check`)."""
    if len(set(map(_MB, pipes))) > 1 or len(set(map(_M, pipes))) > 1 or \
            len(set(map(len, map(_STAGES, pipes)))) > 1:
        return False
    for k, column in enumerate(zip(*[p.stages for p in pipes], strict=True)):
        head = column[0]
        if not all(map(eq, map(_LAYERS, column), repeat(head.layers))) or \
                not all(map(eq, map(_TP, column), repeat(head.tp))) or \
                not all(map(eq, map(_MEMORY_MODE, column), repeat(_MEMORY_MODE(head)))):
            return False
        if k < p and not all(map(eq, map(names.__getitem__, map(_FIRST, map(_DEVICES, column))),
                                 repeat(names[head.devices[0]]))):
            return False
    return True


_LAYERS, _TP, _DEVICES, _FIRST = (attrgetter("layers"), attrgetter("tp"),
                                  attrgetter("devices"), itemgetter(0))
_MEMORY_MODE = attrgetter("recompute", "sequence_parallel")
_MB, _M, _STAGES = (attrgetter("micro_batch"), attrgetter("num_microbatches"),
                    attrgetter("stages"))


def bucket_count(nbytes: float, bucket_bytes: float) -> int:
    """Buckets a gradient of `nbytes` fills at `bucket_bytes` each (DDP); 1 if unbounded."""
    if not 0 < bucket_bytes < float("inf"):
        return 1
    return max(1, math.ceil(nbytes / bucket_bytes))


def _stage_bytes(cost: CostModel, stage, micro_batch: int, cache: dict
                 ) -> tuple[float, float]:
    """(stash per micro-batch, bytes sent on) of a stage, per device."""
    key = ("bytes", stage.layers, micro_batch, stage.tp, stage.recompute,
           stage.sequence_parallel)
    if key not in cache:
        cache[key] = (cost.stage_stash_bytes(stage, micro_batch),
                      cost.send_bytes(stage.layers, micro_batch))
    return cache[key]


def _static_bytes(cost: CostModel, stages: list, type_name: str, micro_batch: int,
                  shards: int, cache: dict) -> float:
    """`CostModel.device_static_bytes` of a rank's stages, cached by their shape and
    device type."""
    key = ("static", tuple((s.layers, s.tp, s.recompute, s.sequence_parallel)
                           for s in stages), type_name, micro_batch, shards)
    if key not in cache:
        cache[key] = cost.device_static_bytes(stages, micro_batch, shards)
    return cache[key]


def _link(cost: CostModel, x, y, nbytes: float, cache: dict):
    """The activations x -> y and the gradients y -> x: their idle-link times (seconds),
    and (hop, seconds busy) of every hop they cross."""
    key = ("link", x.devices, y.devices, nbytes)
    if key not in cache:
        fwd = p2p_spec(cost, p2p_edges(x.devices, y.devices), nbytes)
        bwd = p2p_spec(cost, p2p_edges(y.devices, x.devices), nbytes)
        cache[key] = ((fwd.time_s if fwd else 0.0, bwd.time_s if bwd else 0.0),
                      (fwd.busy_s() if fwd else ()) + (bwd.busy_s() if bwd else ()))
    return cache[key]


def _optimizer_s(cost: CostModel, stage, types: dict, shards: int, cache: dict) -> float:
    name = types[stage.devices[0]].name
    key = ("opt", stage.layers, name, stage.tp, shards)
    if key not in cache:
        cache[key] = cost.optimizer_time_s(stage.layers, name, stage.tp, shards)
    return cache[key] * cost.cluster.slowdown(stage.devices)


def _allreduce_done(plan: Plan, cost: CostModel, classes: list[list[int]],
                    ready: dict[tuple[int, int], tuple[float, float]],
                    rank_devices: dict[tuple[int, int], tuple[str, ...]], cache: dict,
                    bucket_bytes: float, overlap: bool) -> dict[tuple[int, int], float]:
    """When each (class, stage)'s gradient all-reduce ends: per layer range held by one
    stage in every replica, the ring flow's time (`_ring`) in buckets, and not before
    its busiest hop has served every ring that crosses it (`_served`); with `overlap`
    the buckets stream during the last backward (bucket j ready after (j+1)/k of it)."""
    grad_bytes = cost.dp_sync_bytes_per_param(plan.distributed_optimizer)
    pipes = plan.pipelines
    done: dict[tuple[int, int], float] = {}
    if len(pipes) == 1:
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
                  _holding(pipes[members[0]].stages, start))
                 for c, members in enumerate(classes)]
        start = end
        if ("params", layers) not in cache:
            cache[("params", layers)] = cost.stage_params(layers)
        params = cache[("params", layers)]
        tps = [pipes[classes[c][0]].stages[k].tp for c, k in parts]
        # Ring i syncs the i-th of tp slices (a device of a smaller group is in several
        # rings, one slice each), as the simulator's `program.prepare_collectives`.
        tp = max(tps)
        nbytes = params * grad_bytes / tp
        if nbytes <= 0:
            continue
        k = bucket_count(nbytes, bucket_bytes)
        if tp == min(tps):
            # Every member's group, class by class: the devices its ranks stand for.
            flat = rank_devices[parts[0]] if len(parts) == 1 else \
                tuple([d for part in parts for d in rank_devices[part]])
            key = ("ring", flat, tp, nbytes / k)
            if key not in cache:
                cache[key] = _ring(cost, [list(flat[i::tp]) for i in range(tp)], nbytes / k,
                                   cache)
        else:
            groups = tuple([pipes[q].stages[k].devices for (_, k), members
                            in zip(parts, classes, strict=True) for q in members])
            key = ("ring", groups, nbytes / k)
            if key not in cache:
                cache[key] = _ring(cost, [[g[i % len(g)] for g in groups] for i in range(tp)],
                                   nbytes / k, cache)
        a, lat, hops, busy = cache[key]
        ends = [ready[part] for part in parts]
        if overlap:
            s0 = max(e - length for e, length in ends)
            d = max(length for _, length in ends) / k
            finish = s0 + max(d + k * a, k * d + a)   # the buckets' queue, see the doc
            s0 += d
        else:
            s0 = max(e for e, _ in ends)
            finish = s0 + k * a
        owners.append((parts, finish, lat))
        starts.append(s0)
        crossed.append(hops)
        busy_s.append(k * busy)
    # A hop serves the rings of every layer range that cross it one after another at best
    # (equal time-sharing, as the simulator's network): none ends before its busy time.
    served = _served(starts, crossed, busy_s)
    for (parts, finish, lat), end in zip(owners, served, strict=True):
        finish = max(finish, end + lat)
        for part in parts:
            done[part] = max(done.get(part, 0.0), finish)
    return done


def _ring(cost: CostModel, rings: list[list[str]], nbytes: float, cache: dict
          ) -> tuple[float, float, np.ndarray, np.ndarray]:
    """A bucket's all-reduce on `rings` at once, as the simulator runs it
    (`network.ring_spec`): its time on otherwise idle hops (rings that cross one hop
    share it), its latency (paid after the bytes), the hops it crosses (numbered in
    `cache`) and the seconds each is busy with it."""
    spec = ring_spec(cost, rings, nbytes)
    if spec is None:
        return 0.0, 0.0, np.zeros(0, dtype=np.int64), np.zeros(0)
    number = cache.setdefault("hop numbers", {})
    busy = spec.busy_s()
    hops = np.array([number.setdefault(hop, len(number)) for hop, _ in busy], dtype=np.int64)
    return spec.time_s, spec.latency_s, hops, np.array([s for _, s in busy])


def _served(starts: list[float], hops: list[np.ndarray], busy: list[np.ndarray]
            ) -> np.ndarray:
    """Per job (a ring that starts at starts[j] and keeps hops[j] busy for busy[j]
    seconds each): when the last of its hops is done, at the earliest. A hop serving
    jobs one at a time ends no earlier than, over release times t, t + the work released
    at or after t (the single-machine bound, tight when the hop never idles)."""
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


def _holding(stages, layer: int) -> int:
    """Index of the stage whose layer range holds `layer`."""
    for k, s in enumerate(stages):
        if s.layers[0] <= layer < s.layers[1]:
            return k
    raise ValueError(f"no stage holds layer {layer}")
