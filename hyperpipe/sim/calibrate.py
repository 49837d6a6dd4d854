"""Calibration: fit the cost model to measured traces (times in seconds, sizes in bytes).

* Compute: per (device type, op), a stage's action takes the sum over its layers of
  ``a_kind + b_kind · FLOPs`` (a tensor or context rank's share of them), fitted by
  least squares over every measured action (one shared fit when the traces cannot tell
  layer kinds apart), each action's time taken less what the simulator prices apart
  (the stage's tensor-parallel collectives and context parallelism's exposed ring
  exchange, over the fitted links) and over its `Cluster.slowdown`; backwards of stages
  with recompute also less the forward they redo, as the fits of the other actions
  price it (then everything is fitted again). With a base profile from per-layer
  profiling, instead ``c + k · base time`` per device type.
* Links: an alpha-beta fit (latency + bytes / bandwidth) of the executor's probe
  messages (``send`` events of step -1), per link class and over all (``"*"``); the
  latency then from training-step messages whose receiver was already waiting.
* All-reduce (one per group class: across nodes, or inside one node) and optimizer:
  ``a + b · x``, x the ring's bytes per device
  (2(n-1)/n · bytes; the shortest event of each group and step) or the parameters a
  device holds; where x varied too little to split a from b, the base profile's line
  scaled, or time proportional to x (`fit_bulk`); the optimizer's parameters are those
  the simulator's step counts (ZeRO's shard, the rank's share of the experts).

Time between a rank's actions that no event accounts for (outside the union of its
events: one nested in another, such as a ring receive inside a forward, is not idle)
joins the per-action overhead.
The first step of a run (warm-up; `meta.first_step` of a resumed one) is left out of
every fit.
"""

from __future__ import annotations

import itertools
import platform
import socket
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hyperpipe.cluster.cluster import Cluster, Link
from hyperpipe.core.errors import BadInput
from hyperpipe.models import ModelSpec
from hyperpipe.plan.plan import Plan, StagePlan, plan_from_dict
from hyperpipe.plan.profile import Fit, Profile, check_profile, model_fingerprint
from hyperpipe.plan.trace import COMPUTE_OPS, Trace, TraceEvent
from hyperpipe.sim.costmodel import CostModel, op_flops
from hyperpipe.sim.experts import expert_state
from hyperpipe.sim.options import execution_of
from hyperpipe.sim.program import action_extra_s
from hyperpipe.sim.recorded import check_recorded, fitted_from
from hyperpipe.sim.sharding import dp_shards, ring_attention_extra_s


class _Line(NamedTuple):
    """A layer kind's compute fit: a per layer plus b per FLOP."""

    per_layer_s: float
    per_flop_s: float


class _Point(NamedTuple):
    """One all-reduce measurement: x (ring bytes per device) and its time."""

    x: float
    t_s: float


@dataclass(frozen=True)
class _Sample:
    """One measured compute action: per layer kind (count, FLOPs) and the time it took."""

    device_type: str
    op: str
    kinds: dict[str, tuple[int, float]]
    time_s: float
    base_s: float = 0.0      # the base profile's time of the same action (its layers' sum)


def _lstsq(rows: list[list[float]], ys: list[float]) -> tuple[np.ndarray, int]:
    """Non-negative least squares by dropping negative terms and refitting (the columns
    here are few, and a negative per-call time or time per FLOP is noise, not physics).
    Returns the coefficients and the rank of the full design matrix."""
    a = np.asarray(rows, dtype=float)
    y = np.asarray(ys, dtype=float)
    # Columns differ by orders of magnitude (counts vs FLOPs): scale them for conditioning.
    scale = np.abs(a).max(axis=0)
    active = scale > 0       # an all-zero column (a layer kind with no FLOPs) plays no part
    scale[~active] = 1.0
    a = a / scale
    rank = int(np.linalg.matrix_rank(a[:, active])) + int((~active).sum())
    coef = np.zeros(a.shape[1])
    while active.any():
        coef[:] = 0.0
        coef[active] = np.linalg.lstsq(a[:, active], y, rcond=None)[0]
        if (coef >= 0).all():
            break
        active &= coef > 0
    return coef / scale, rank


def fit_line(xs: Iterable[float], ys: Iterable[float]) -> Fit:
    """Least-squares time = a + b·x, with the relative RMS residual of the fit."""
    xs, ys = list(xs), list(ys)
    if len(xs) == 0:
        raise BadInput("calibration", "at least one measurement to fit", has_got=False)
    if len(set(xs)) < 2:  # a single x: a pure per-call time
        a = float(np.mean(ys))
        return Fit(a, 0.0, len(ys), _rel_rmse([a] * len(ys), ys))
    (a, b), _ = _lstsq([[1.0, x] for x in xs], ys)
    pred = [a + b * x for x in xs]
    return Fit(float(a), float(b), len(xs), _rel_rmse(pred, ys))


# x must span at least this ratio (largest / smallest) for a fit to tell a per-call
# time from a per-unit one; over a narrower span the split is noise
MIN_SPAN = 2.0


def fit_bulk(xs: Iterable[float], ys: Iterable[float], prior: Fit | None = None) -> Fit:
    """time = a + b·x for work that scales with its size (an optimizer step over x
    parameters, a reduction of x bytes). Over a span of x too narrow to separate a from b
    (one run shape, `MIN_SPAN`), keep the shape of `prior` (e.g. per-layer profiling's
    fit, which saw many sizes) scaled to the measurements, or without one take the time
    as proportional to x: extrapolating a per-call constant to a model twice the size
    would predict the same time for twice the work."""
    xs, ys = list(xs), list(ys)
    if len(xs) and min(xs) > 0 and max(xs) / min(xs) >= MIN_SPAN:
        return fit_line(xs, ys)
    if not xs:
        raise BadInput("calibration", "at least one measurement to fit", has_got=False)
    if prior is not None and (prior_sum := sum(prior.a_s + prior.b_s_per_unit * x
                                               for x in xs)) > 0:
        k = sum(ys) / prior_sum
        a, b = k * prior.a_s, k * prior.b_s_per_unit
    elif (sxx := sum(x * x for x in xs)) > 0:
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sxx
    else:
        a, b = float(np.mean(ys)), 0.0
    return Fit(float(a), float(b), len(xs), _rel_rmse([a + b * x for x in xs], ys))


def _rel_rmse(pred: list[float], ys: list[float]) -> float:
    mean = float(np.mean(ys)) or 1.0
    return float(np.sqrt(np.mean((np.asarray(pred) - np.asarray(ys)) ** 2)) / mean)


def _compute_samples(run: _Run, base: CostModel | None, price: CostModel,
                     recomputed: CostModel | None = None) -> list[_Sample]:
    """One sample per measured compute action after the warm-up, in the terms the
    simulator prices it (`program.op_shape`): per-device FLOPs (a tensor or context
    rank's share, as `CostModel.layer_time_s` evaluates a fit), the time less what the
    simulator adds besides compute (the stage's tensor-parallel collectives, context
    parallelism's exposed ring exchange, ZeRO-2/3's, expert parallelism's and the fp32
    accumulation's extra time: `program.action_extra_s`; priced by `price`, the fitted
    links, and with its compute where they need one) and over the group's
    `Cluster.slowdown`; a ZeRO-3 stage's first forward of a step, which gathers its
    weights when it does not reshard, is left out. The backwards (B, I) of a stage with
    recompute also hold the forward they redo: without `recomputed` they are left out;
    with it (a cost model holding the fits of the other actions) they alone are
    returned, less that forward as it prices it (`CostModel.recompute_s`)."""
    trace, plan, model = run.trace, run.plan, run.model
    stage_of: dict[tuple[str, int], tuple[StagePlan, int, int]] = {}
    for q, pipe in enumerate(plan.pipelines):
        for k, stage in enumerate(pipe.stages):
            for d in stage.devices:
                stage_of[(d, k)] = (stage, pipe.micro_batch, q)
    out = []
    first = fitted_from(trace)
    ex = execution_of(plan, price)
    # ZeRO-3 without resharding gathers a stage's weights in its first forward of a step
    # (`program._first_forward_gathers`): those forwards are not fitted
    gathered: set[tuple[str, int, int]] = set()
    skip_first = plan.zero == 3 and not ex.reshard_after_forward
    for e in sorted(trace.events, key=lambda e: e.start_s) if skip_first else trace.events:
        if e.op not in COMPUTE_OPS or e.step < first:
            continue
        stage, mb, q = stage_of[(e.device, e.stage)]
        if skip_first and e.op == "F" and (e.device, e.stage, e.step) not in gathered:
            gathered.add((e.device, e.stage, e.step))
            continue
        redo = e.op in ("B", "I") and stage.recompute != "none"
        if redo != (recomputed is not None):
            continue
        share = stage.tp * stage.cp
        kinds: dict[str, tuple[int, float]] = {}
        for i in range(*stage.layers):
            n, f = kinds.get(model.layers[i].kind, (0, 0.0))
            kinds[model.layers[i].kind] = (n + 1, f + op_flops(model, i, mb, e.op) / share)
        dtype = run.dtypes[e.device]
        base_s = 0.0 if base is None else sum(
            base.layer_time_s(i, dtype, mb, e.op, stage.tp, stage.sequence_parallel, stage.cp)
            for i in range(*stage.layers))
        other_s = price.stage_tp_comm_s(stage.layers, stage.devices, mb, e.op, "none",
                                        stage.cp)[0] + ring_attention_extra_s(
            price, stage, mb, e.op) + action_extra_s(price, plan, ex, q, e.stage, e.op)
        if redo:
            other_s += recomputed.recompute_s(stage.layers, stage.devices, mb,
                                              stage.recompute, stage.sequence_parallel,
                                              stage.cp)
        time_s = max(e.duration_s - other_s, 0.0) / price.cluster.slowdown(stage.devices)
        out.append(_Sample(dtype, e.op, kinds, time_s, base_s))
    return out


def _fit_samples(samples: list[_Sample], base: Profile | None
                 ) -> tuple[dict[str, Fit], dict[str, float]]:
    """(compute fits, per-action overheads): per-kind lines (`_fit_compute`), or the
    base profile scaled (`_fit_to_base`)."""
    return (_fit_compute(samples), {}) if base is None else _fit_to_base(samples, base)


def _fit_compute(samples: list[_Sample]) -> dict[str, Fit]:
    groups: dict[tuple[str, str], list[_Sample]] = defaultdict(list)
    for s in samples:
        groups[(s.device_type, s.op)].append(s)
    fits: dict[str, Fit] = {}
    for (dtype, op), group in sorted(groups.items()):
        kinds = sorted({k for s in group for k in s.kinds})
        rows = [[v for k in kinds for v in (s.kinds.get(k, (0, 0.0)))] for s in group]
        ys = [s.time_s for s in group]
        coef, rank = _lstsq(rows, ys)
        per_kind = {k: _Line(float(coef[2 * i]), float(coef[2 * i + 1]))
                    for i, k in enumerate(kinds)}
        if rank < 2 * len(kinds):
            # The traces cannot tell the kinds apart: one shared line for all of them.
            totals = [[sum(n for n, _ in s.kinds.values()), sum(f for _, f in s.kinds.values())]
                      for s in group]
            (a, b), _ = _lstsq(totals, ys)
            per_kind = {k: _Line(float(a), float(b)) for k in kinds}
        pred = [sum(n * per_kind[k].per_layer_s + f * per_kind[k].per_flop_s
                    for k, (n, f) in s.kinds.items()) for s in group]
        err = _rel_rmse(pred, ys)
        for k, (a, b) in per_kind.items():
            fits[Profile.key(dtype, k, op)] = Fit(a, b, len(group), err)
    return fits


def _in_run_delays(trace: Trace) -> list[tuple[str, str, float, float]]:
    """(src, dst, bytes, delay_s) of messages of the training steps whose receiver was
    already waiting when the sender posted them: delay = the receiver's wait end - the
    send's start, i.e. what the simulator calls a transfer (sender's action end to data
    at the receiver), wake-ups and all. Sends and receives of one (step, src, dst,
    micro-batch) pair up in time order (an activation always precedes the gradient)."""
    sends: dict[tuple, list] = defaultdict(list)
    recvs: dict[tuple, list] = defaultdict(list)
    for e in trace.events:
        if e.step < 0 or not e.peer:
            continue
        if e.op == "send":
            sends[(e.step, e.device, e.peer, e.microbatch)].append(e)
        elif e.op == "recv":
            recvs[(e.step, e.peer, e.device, e.microbatch)].append(e)
    out = []
    for key, rs in recvs.items():
        ss = sorted(sends.get(key, []), key=lambda e: e.start_s)
        for r, s in zip(sorted(rs, key=lambda e: e.end_s), ss, strict=False):
            if r.start_s <= s.start_s <= r.end_s:
                out.append((s.device, r.device, r.bytes, r.end_s - s.start_s))
    return out


def _fit_to_base(samples: list[_Sample], base: Profile) -> tuple[dict[str, Fit],
                                                                 dict[str, float]]:
    """Scale a base profile (per-layer profiling, which knows every layer kind at every
    micro-batch size) to the runs: per device type, time = c + k · base time over all
    its ops, c being a per-action overhead (dispatch, wake-ups). One (c, k) per device
    type rather than per op: the runs then pin it down from many shapes, where a fit
    per op would extrapolate from the few it ran. Device types no trace saw keep the
    base as it is."""
    groups: dict[str, list[_Sample]] = defaultdict(list)
    for s in samples:
        groups[s.device_type].append(s)
    scale: dict[str, tuple[float, float, int, float]] = {}
    for dtype, group in sorted(groups.items()):
        xs, ys = [s.base_s for s in group], [s.time_s for s in group]
        (c, k), rank = _lstsq([[1.0, x] for x in xs], ys)
        if rank < 2:  # one action shape only: a pure ratio
            c, k = 0.0, float(np.mean(ys)) / max(float(np.mean(xs)), 1e-30)
        scale[dtype] = (float(k), float(c), len(group),
                        _rel_rmse([c + k * x for x in xs], ys))
    compute: dict[str, Fit] = {}
    overhead: dict[str, float] = {}
    for key, fit in base.compute.items():
        dtype, _, op = key.split("|")
        k, c, n, err = scale.get(dtype, (1.0, base.action_overhead_s(dtype, op), fit.samples,
                                         fit.rel_rmse))
        compute[key] = Fit(k * fit.a_s, k * fit.b_s_per_unit, n, err)
        overhead[f"{dtype}|{op}"] = c
    return compute, overhead


def _action_gaps(runs: list[_Run]) -> dict[str, float]:
    """Device type -> mean seconds a rank spends between one action and the next that no
    event accounts for (posting sends and receives, Python between actions): per rank
    and step, the time between its first and last non-send event that lies outside the
    union of those events (`_idle_s`: a ring receive inside a context-parallel F or B, a
    ZeRO-3 gather inside an action, is time the action already holds, not idle), over
    its compute actions, each rank's over its group's slowdown (the simulator stretches
    overheads by it). Sends are left out: a posted send runs beside what follows it."""
    idle_s: dict[str, float] = defaultdict(float)
    actions: dict[str, int] = defaultdict(int)
    for run in runs:
        trace, dtypes = run.trace, run.dtypes
        rows: dict[tuple[str, int], list] = defaultdict(list)
        for e in trace.events:
            if e.step >= fitted_from(trace) and e.op != "send":
                rows[(e.device, e.step)].append(e)
        for (device, _), events in rows.items():
            idle = _idle_s(events)
            idle_s[dtypes[device]] += idle / _group_slowdown(device, run.plan, run.cluster)
            actions[dtypes[device]] += sum(1 for e in events if e.op in COMPUTE_OPS)
    return {k: idle_s[k] / n for k, n in actions.items() if n}


def _idle_s(events: Iterable[TraceEvent]) -> float:
    """Seconds between the first start and the last end of `events` (one rank's
    timeline) that no event covers: the gaps in the union of their intervals, so that
    an event nested in another (or overlapping it) adds no idle time."""
    idle, covered_to = 0.0, None
    for e in sorted(events, key=lambda e: e.start_s):
        if covered_to is not None and e.start_s > covered_to:
            idle += e.start_s - covered_to
        covered_to = e.end_s if covered_to is None else max(covered_to, e.end_s)
    return idle


def _fit_links(runs: list[_Run]) -> dict[str, Link]:
    """Bandwidth from the probe's alpha-beta fit; latency from the probe, or, where the
    training steps have enough blocked receives, their mean delay less the bandwidth
    term (under load a message costs more than an idle ping-pong shows). A link class
    is one fit: traces (their `where` names them) of different clusters whose probes give a
    class other nominal links are refused (calibrate each cluster apart); one cluster's
    traces are fitted together, as before, whatever its links."""
    probes: dict[str, list[tuple[float, float]]] = defaultdict(list)
    delays: dict[str, list[tuple[float, float]]] = defaultdict(list)
    # per cluster (the first trace of it names it): link class -> nominal links probed
    nominal: list[tuple[Cluster, str, dict[str, set[Link]]]] = []
    for where, trace, _, _, cluster, _ in runs:
        seen = next((links for c, _, links in nominal if c == cluster), None)
        if seen is None:
            nominal.append((cluster, where, seen := defaultdict(set)))
        for e in trace.events:
            if e.op == "send" and e.step < 0 and e.peer:
                route = cluster.path(e.device, e.peer)
                seen[route.link_class].add(route.link)
                for c in (route.link_class, "*"):
                    probes[c].append((e.bytes, e.duration_s))
    for (_, a, one), (_, b, other) in itertools.combinations(nominal, 2):
        for cls in one.keys() & other.keys():
            if one[cls] != other[cls]:
                raise BadInput(f"{a}, {b}", f"traces whose clusters give link class {cls} "
                               f"the same nominal links (calibrate each cluster apart); "
                               f"they give {_links_text(one[cls])} and "
                               f"{_links_text(other[cls])}", has_got=False)
    for _, trace, _, _, cluster, _ in runs:
        for src, dst, nbytes, delay in _in_run_delays(trace):
            for c in (cluster.path(src, dst).link_class, "*"):
                delays[c].append((nbytes, delay))
    links = {}
    for cls, pts in sorted(probes.items()):
        fit = fit_line([b for b, _ in pts], [t for _, t in pts])
        if fit.b_s_per_unit > 0:
            bw, latency = 1.0 / fit.b_s_per_unit, fit.a_s
        else:
            # the probe's sizes did not show a per-byte cost above its noise: bound the
            # bandwidth from below by the largest message, taking all its time as transfer
            big_bytes, big_s = max(pts)
            if big_bytes <= 0:          # empty probes say nothing of a bandwidth
                continue
            bw, latency = big_bytes / max(big_s, 1e-9), fit.a_s
        if len(delays.get(cls, [])) >= MIN_IN_RUN_SAMPLES:
            latency = float(np.mean([d - b / bw for b, d in delays[cls]]))
        links[cls] = Link(bw, max(latency, 0.0))
    return links


MIN_IN_RUN_SAMPLES = 5


def _links_text(links: set[Link]) -> str:
    return " / ".join(sorted(f"{link.bandwidth_bytes_per_s * 8 / 1e9:.4g} Gbit/s, "
                             f"{link.latency_s * 1e6:.4g} us" for link in links))


def _fit_optimizer(runs: list[_Run], prior: dict[str, Fit]) -> dict[str, Fit]:
    """time = a + b x per device type, x the parameters a device's optimizer updates as
    the simulator counts them (`_params_on`), the time over its group's slowdown (as the
    simulator stretches a stage's step by it)."""
    pts: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run in runs:
        first = fitted_from(run.trace)
        cost = CostModel(run.model, run.cluster)
        for e in run.trace.events:
            if e.op == "optimizer" and e.step >= first:
                pts[run.dtypes[e.device]].append((
                    _params_on(e.device, run.plan, cost),
                    e.duration_s / _group_slowdown(e.device, run.plan, run.cluster)))
    return {k: fit_bulk([x for x, _ in v], [t for _, t in v], prior.get(k))
            for k, v in sorted(pts.items())}


def _fit_allreduce(runs: list[_Run], prior: dict[str, Fit]) -> dict[str, Fit]:
    """One fit per group class the traces' all-reduces ran on ("inter": a group across
    nodes, "intra:NODE": inside node NODE; `Profile.allreduce_fit`), so that groups of
    another class (a tensor-parallel group inside a node, where the measured ones were
    data-parallel across nodes) stay priced by their links. A rank's all-reduce event
    also holds its wait for the group's last member; the last to arrive waits least, so
    each (step, group) contributes its shortest event. x is the ring's bytes per device,
    2(n-1)/n · bytes. `prior`: the base profile's fits (a class's own, else its "*"),
    the line a fit over too narrow a spread of x scales."""
    shortest: dict[tuple, _Point] = {}
    for n_trace, run in enumerate(runs):
        for e in run.trace.events:
            if e.op != "allreduce" or e.step < fitted_from(run.trace):
                continue
            group = frozenset([e.device, *filter(None, e.peer.split(","))])
            cls = run.cluster.group_class(group)
            n = len(group)
            key = (cls, n_trace, e.step, group, e.bytes)
            x = 2 * (n - 1) / n * e.bytes
            if key not in shortest or e.duration_s < shortest[key].t_s:
                shortest[key] = _Point(x, e.duration_s)
    by_class: dict[str, list[_Point]] = defaultdict(list)
    for (cls, *_), point in shortest.items():
        by_class[cls].append(point)
    prior_of = Profile(allreduce=prior).allreduce_fit      # the class's, else "*"'s
    return {cls: fit_bulk([x for x, _ in pts], [t for _, t in pts], prior_of(cls))
            for cls, pts in sorted(by_class.items())}


def _group_slowdown(device: str, plan: Plan, cluster: Cluster) -> float:
    """`Cluster.slowdown` of the group (tensor and context ranks) of `device`'s first
    stage: what the simulator stretches the device's actions and steps by."""
    stage = next(st for pipe in plan.pipelines for st in pipe.stages
                 if device in st.devices)
    return cluster.slowdown(stage.devices)


def _params_on(device: str, plan: Plan, cost: CostModel) -> float:
    """Parameters `device`'s optimizer updates: those of each of its stages that the
    simulator's optimizer step counts (`CostModel.rank_params`: its tensor rank's share,
    sharded over the data-parallel ranks with ZeRO, its share of the routed experts)."""
    params = 0.0
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            if device in stage.devices:
                share, shards = expert_state(cost, plan, stage)
                params += cost.rank_params(stage.layers, stage.tp,
                                           dp_shards(plan, stage, cost.cluster),
                                           expert_share=share, expert_shards=shards)
    return params


def calibrate(traces: list[Trace], *, sources: list[str] | None = None,
              base: Profile | None = None, base_source: str = "base profile",
              allow_base_mismatch: bool = False) -> Profile:
    """Fit a Profile to measured traces (each must carry its plan in ``meta["plan"]``;
    one whose ``meta["source"]`` says other than ``"measured"``, a simulated trace, is
    refused: BadInput naming it). A trace no run can have recorded, or that would be
    fitted wrongly, is refused too, naming its field (`sim.recorded.check_recorded`).

    Every trace must have run the same model (by fingerprint, `_check_one_model`): a
    profile prices the model it was measured on and records it in its provenance
    (``model``, ``model_fingerprint``). Traces may come from different clusters (the
    fits are keyed by device type and link class) whose links of one class are alike.

    With `base` (a profile from per-layer profiling, `hyperpipe calibrate --measure`,
    refused as `check_profile` refuses a profile for a simulation when it was measured
    on another model or lacks a device type of the traces, unless `allow_base_mismatch`
    (another model's layer kinds on purpose: experiments/accuracy_moe.py scales an MoE
    model's layer profile to dense runs); `base_source` names it), its
    per-layer shape is kept and scaled to the runs (`_fit_to_base`); without it,
    per-layer-kind lines are fitted from the traces alone. Links, all-reduce and
    optimizer come from the traces (or the base where the traces have none)."""
    if not traces:
        raise BadInput("trace", "at least one measured trace", has_got=False)
    runs: list[_Run] = []
    for n, trace in enumerate(traces):
        where = (sources or [f"trace {n}"] * len(traces))[n]
        if trace.meta.get("source", "measured") != "measured":
            raise BadInput(f"{where}: meta.source", "\"measured\" (a trace of `hyperpipe "
                           "run --trace`; a simulated one would fit the cost model to its "
                           "own predictions)", trace.meta["source"])
        if "plan" not in trace.meta:
            raise BadInput(f"{where}: meta.plan", "the plan the trace was measured on",
                           has_got=False)
        plan = plan_from_dict(trace.meta["plan"], where=f"{where}: meta.plan")
        model, cluster = plan.load_model(), plan.load_cluster()
        # plan_from_dict reads the plan; its rules (batch sizes add up...) are checked here
        plan.check(model, cluster, where=f"{where}: meta.plan")
        run = _Run(where, trace, plan, model, cluster,
                   {d: cluster.device(d).type.name for d in plan.devices})
        _check_one_model(runs[0] if runs else run, run)
        _check_one_clock(runs[0] if runs else run, run)
        check_recorded(trace, plan, model, cluster, where)
        if base is not None:    # a layer profile of this model and these device types
            check_profile(base, model, cluster, where=base_source, devices=plan.devices,
                          allow_mismatch=allow_base_mismatch)
        runs.append(run)
    links = {**(base.links if base else {}), **_fit_links(runs)}
    allreduce = {**(base.allreduce if base else {}),
                 **_fit_allreduce(runs, base.allreduce if base else {})}
    # per run: the base profile's cost model, and the fitted links' (what compute is not)
    costs = [(None if base is None else CostModel(run.model, run.cluster, base),
              CostModel(run.model, run.cluster, Profile(links=links, allreduce=allreduce)))
             for run in runs]
    samples = [s for run, (b, price) in zip(runs, costs, strict=True)
               for s in _compute_samples(run, b, price)]
    if not samples:
        raise BadInput("trace", "compute events after the warm-up step (run `steps` 2 or "
                       "more)", has_got=False)
    compute, overhead = _fit_samples(samples, base)
    # backwards that redo their forward: less it, as the fits so far price it; then all
    redone = [s for run, (b, price) in zip(runs, costs, strict=True)
              for s in _compute_samples(run, b, price, CostModel(
                  run.model, run.cluster, Profile(compute=compute, links=links,
                                                  allreduce=allreduce)))]
    if redone:
        samples += redone
        compute, overhead = _fit_samples(samples, base)
    # what a rank spends between actions is part of each action's cost, as it occupies
    # the rank's stream (the simulator's model of one compute stream per rank)
    for dtype, gap in _action_gaps(runs).items():
        for op in COMPUTE_OPS:
            key = f"{dtype}|{op}"
            overhead[key] = overhead.get(key, 0.0) + gap
    return Profile(
        compute=compute,
        links=links,
        optimizer={**(base.optimizer if base else {}),
                   **_fit_optimizer(runs, base.optimizer if base else {})},
        allreduce=allreduce,
        overhead=overhead,
        provenance={
            **_measured_on([run.model for run in runs]),
            "traces": list(sources or []),
            "base": None if base is None else base.provenance,
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "torch": next((t.meta.get("torch") for t in traces if t.meta.get("torch")), None),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "emulated": any(t.emulated for t in traces),
            "compute_samples": len(samples),
        })


class _Run(NamedTuple):
    """A measured trace with what its plan names, loaded once: its source (file name),
    plan, model, cluster and each device's type."""

    where: str
    trace: Trace
    plan: Plan
    model: ModelSpec
    cluster: Cluster
    dtypes: dict[str, str]


def _check_one_model(first: _Run, this: _Run) -> None:
    """BadInput naming both traces when `this` ran another model than `first` (by
    `model_fingerprint`: shapes, not names)."""
    fp_first, fp_this = model_fingerprint(first.model), model_fingerprint(this.model)
    if fp_first != fp_this:
        raise BadInput(f"{first.where}, {this.where}: meta.plan.model",
                       "traces of one model (a profile prices the model it was measured "
                       f"on); {first.where} ran {first.model.name} ({fp_first}), "
                       f"{this.where} ran {this.model.name} ({fp_this}): calibrate each "
                       "model separately", has_got=False)


def _clock(trace: Trace) -> str:
    """What a trace's times measure: the machine's own speed, or devices emulated at one
    scale (`meta.emulation_scale`, compute stretched by it)."""
    if not trace.emulated:
        return "run natively (not emulated)"
    return f"emulated at scale {float(trace.meta.get('emulation_scale', 1.0)):g}"


def _check_one_clock(first: _Run, this: _Run) -> None:
    """BadInput naming both traces when they were timed apart: one native and one
    emulated, or emulated at two scales (their compute times differ by the scale, and a
    fit through both describes neither)."""
    a, b = _clock(first.trace), _clock(this.trace)
    if a != b:
        raise BadInput(f"{first.where}, {this.where}: meta.emulated",
                       f"traces timed alike (one profile per time base); {first.where} "
                       f"was {a}, {this.where} {b}: calibrate each separately",
                       has_got=False)


def _measured_on(models: list) -> dict:
    """The model a profile was fitted on (name and fingerprint), when the traces agree
    (`calibrate` refuses traces that do not, `_check_one_model`)."""
    fps = {model_fingerprint(m) for m in models}
    if len(fps) != 1:
        return {}
    return {"model": models[0].name, "model_fingerprint": fps.pop()}
