"""How well a simulated plan matches a measured run of the same plan.

The measured iteration time is the median period between the ends of consecutive steps
(so the first step, which warms up allocators and caches, counts only as the start of
the second); per-action times are means over the steps after the first, matched to the
simulated actions by (device, op, stage, micro-batch).
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from hyperpipe.core.errors import BadInput
from hyperpipe.plan.trace import COMPUTE_OPS, Trace


def step_periods_s(trace: Trace) -> list[float]:
    """The periods between the ends of consecutive steps of a measured run, in step
    order (empty with fewer than two steps)."""
    ends: dict[int, float] = {}
    for e in trace.events:
        if e.step >= 0:
            ends[e.step] = max(ends.get(e.step, e.end_s), e.end_s)
    steps = sorted(ends)
    return [ends[b] - ends[a] for a, b in zip(steps, steps[1:], strict=False) if b == a + 1]


def measured_iteration_s(trace: Trace) -> float:
    """The steady-state iteration time of a measured run: the median period between the
    ends of consecutive steps (the end of a step: its last event, usually an optimizer
    step). Not a step's own span from first event to last, which counts the early
    ranks' wait for the first activation of the step, time they would otherwise idle
    at the end of the previous one. With fewer than two steps, the span of the one."""
    ends: dict[int, float] = {}
    for e in trace.events:
        if e.step >= 0:
            ends[e.step] = max(ends.get(e.step, e.end_s), e.end_s)
    if not ends:
        raise BadInput("trace", "events of at least one training step", has_got=False)
    steps = sorted(ends)
    periods = [ends[b] - ends[a] for a, b in zip(steps, steps[1:], strict=False) if b == a + 1]
    if not periods:
        return trace.step_times_s()[steps[0]]
    return statistics.median(periods)


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def mape(predicted: list[float], measured: list[float]) -> float:
    """Mean absolute relative error of paired predictions (a fraction)."""
    return sum(relative_error(p, m) for p, m in zip(predicted, measured, strict=True)) \
        / len(measured)


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-a between two rankings of the same items (pairs tied in either
    count as neither): +1 when they order every pair alike, -1 when oppositely."""
    pairs = list(itertools.combinations(range(len(xs)), 2))
    score = sum((1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 else
                 -1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) < 0 else 0) for i, j in pairs)
    return score / len(pairs)


@dataclass(frozen=True)
class OpError:
    device: str
    op: str
    predicted_s: float       # mean duration of this (device, op) in the simulation
    measured_s: float        # mean duration in the measured steps after warm-up
    error: float


@dataclass(frozen=True)
class AccuracyReport:
    predicted_iteration_s: float
    measured_iteration_s: float
    error: float
    per_device_op: list[OpError] = field(default_factory=list)
    action_mape: float = 0.0  # mean |pred - meas| / meas over matched compute actions

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        lines = [f"{'device':<12}{'op':<4}{'predicted':>12}{'measured':>12}{'error':>8}"]
        for r in self.per_device_op:
            lines.append(f"{r.device:<12}{r.op:<4}{r.predicted_s * 1e3:>10.3f}ms"
                         f"{r.measured_s * 1e3:>10.3f}ms{r.error:>8.1%}")
        return "\n".join(lines)


def compare(predicted_iteration_s: float, predicted: Trace, measured: Trace) -> AccuracyReport:
    """Compare a simulation (its iteration time and trace) with a measured trace."""
    meas_iter = measured_iteration_s(measured)
    pred_actions: dict[tuple, float] = {}
    for e in predicted.events:
        if e.op in COMPUTE_OPS and e.step == 0:
            pred_actions[(e.device, e.op, e.stage, e.microbatch)] = e.duration_s
    meas_actions: dict[tuple, list[float]] = defaultdict(list)
    for e in measured.events:
        if e.op in COMPUTE_OPS and e.step >= 1:
            meas_actions[(e.device, e.op, e.stage, e.microbatch)].append(e.duration_s)
    by_dev_op: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    action_errors = []
    for key, durations in sorted(meas_actions.items()):
        if key not in pred_actions:
            continue
        m = statistics.fmean(durations)
        by_dev_op[key[:2]].append((pred_actions[key], m))
        if m > 0:
            action_errors.append(relative_error(pred_actions[key], m))
    rows = []
    for (dev, op), pairs in sorted(by_dev_op.items()):
        p = statistics.fmean(x for x, _ in pairs)
        m = statistics.fmean(y for _, y in pairs)
        rows.append(OpError(dev, op, p, m, relative_error(p, m) if m > 0 else 0.0))
    return AccuracyReport(predicted_iteration_s, meas_iter,
                          relative_error(predicted_iteration_s, meas_iter), rows,
                          statistics.fmean(action_errors) if action_errors else 0.0)


def compute_only_s(plan, cost) -> float:
    """The null model of an iteration: the busiest device's forward and backward compute
    over all its micro-batches, from the same (calibrated) per-layer times as the
    simulator, and nothing else: no communication, no bubble or overlap, no per-action
    overhead, no all-reduce or optimizer step. Seconds."""
    busy: dict[str, float] = defaultdict(float)
    for pipe in plan.pipelines:
        for st in pipe.stages:
            dtype = cost.cluster.device(st.devices[0]).type.name
            per_mb = sum(cost.layer_time_s(i, dtype, pipe.micro_batch, op, st.tp,
                                           st.sequence_parallel, st.cp)
                         for i in range(*st.layers) for op in ("F", "B"))
            busy[st.devices[0]] += pipe.num_microbatches * per_mb
    return max(busy.values())
