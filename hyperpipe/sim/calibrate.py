"""Calibration: fit the cost model to measured traces.

* Compute: for each (device type, op) the time of a stage's action is the sum over its
  layers of ``a_kind + b_kind · FLOPs``; the coefficients of each layer kind come from a
  least-squares fit over every measured action. When the traces cannot tell layer kinds
  apart (every stage holds the same mix), the kinds share one (a, b) fit.
* Links: an alpha-beta fit (time = latency + bytes / bandwidth) of the point-to-point
  probe messages the executor records before its first step (``send`` events with step
  -1), per link class and over all classes (``"*"``).
* All-reduce and optimizer: time = a + b · x with x the ring's bytes per device
  (2(n-1)/n · bytes) or the parameters a device holds.

The first step of a run (warm-up) is left out of compute fits.
"""

from __future__ import annotations

import platform
import socket
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from hyperpipe.errors import BadInput
from hyperpipe.models import ModelSpec
from hyperpipe.sim.cluster import Cluster, Link
from hyperpipe.sim.costmodel import op_flops
from hyperpipe.sim.plan import Plan, plan_from_dict
from hyperpipe.sim.profile import Fit, Profile
from hyperpipe.sim.trace import COMPUTE_OPS, Trace


@dataclass(frozen=True)
class _Sample:
    """One measured compute action: per layer kind (count, FLOPs) and the time it took."""

    device_type: str
    op: str
    kinds: dict[str, tuple[int, float]]
    time_s: float


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


def _rel_rmse(pred: list[float], ys: list[float]) -> float:
    mean = float(np.mean(ys)) or 1.0
    return float(np.sqrt(np.mean((np.asarray(pred) - np.asarray(ys)) ** 2)) / mean)


def _compute_samples(trace: Trace, plan: Plan, model: ModelSpec,
                     device_types: dict[str, str]) -> list[_Sample]:
    stage_of: dict[tuple[str, int], tuple[tuple[int, int], int]] = {}
    for pipe in plan.pipelines:
        for k, stage in enumerate(pipe.stages):
            for d in stage.devices:
                stage_of[(d, k)] = (stage.layers, pipe.micro_batch)
    out = []
    for e in trace.events:
        if e.op not in COMPUTE_OPS or e.step < 1:
            continue
        layers, mb = stage_of[(e.device, e.stage)]
        kinds: dict[str, tuple[int, float]] = {}
        for i in range(*layers):
            n, f = kinds.get(model.layers[i].kind, (0, 0.0))
            kinds[model.layers[i].kind] = (n + 1, f + op_flops(model, i, mb, e.op))
        out.append(_Sample(device_types[e.device], e.op, kinds, e.duration_s))
    return out


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
        per_kind = {k: (float(coef[2 * i]), float(coef[2 * i + 1])) for i, k in enumerate(kinds)}
        if rank < 2 * len(kinds):
            # The traces cannot tell the kinds apart: one shared line for all of them.
            totals = [[sum(n for n, _ in s.kinds.values()), sum(f for _, f in s.kinds.values())]
                      for s in group]
            (a, b), _ = _lstsq(totals, ys)
            per_kind = {k: (float(a), float(b)) for k in kinds}
        pred = [sum(n * per_kind[k][0] + f * per_kind[k][1] for k, (n, f) in s.kinds.items())
                for s in group]
        err = _rel_rmse(pred, ys)
        for k, (a, b) in per_kind.items():
            fits[Profile.key(dtype, k, op)] = Fit(a, b, len(group), err)
    return fits


def _fit_links(traces: list[tuple[Trace, Cluster]]) -> dict[str, Link]:
    by_class: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for trace, cluster in traces:
        for e in trace.events:
            if e.op == "send" and e.step < 0 and e.peer:
                cls = cluster.path(e.device, e.peer).link_class
                by_class[cls].append((e.bytes, e.duration_s))
                by_class["*"].append((e.bytes, e.duration_s))
    links = {}
    for cls, pts in sorted(by_class.items()):
        fit = fit_line([b for b, _ in pts], [t for _, t in pts])
        bw = 1.0 / fit.b_s_per_unit if fit.b_s_per_unit > 0 else float("inf")
        links[cls] = Link(bw, fit.a_s)
    return links


def _fit_misc(traces, op: str, x_of) -> dict[str, Fit]:
    pts: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for trace, plan, model, dtypes in traces:
        for e in trace.events:
            if e.op == op and e.step >= 1:
                key, x = x_of(e, plan, model, dtypes)
                pts[key].append((x, e.duration_s))
    return {k: fit_line([x for x, _ in v], [t for _, t in v]) for k, v in sorted(pts.items())}


def _allreduce_x(e, plan, model, dtypes):
    n = len(e.peer.split(",")) + 1 if e.peer else 2
    return "*", 2 * (n - 1) / n * e.bytes


def _optimizer_x(e, plan, model, dtypes):
    params = 0
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            if e.device in stage.devices:
                params += sum(model.layers[i].params for i in range(*stage.layers)) // stage.tp
    return dtypes[e.device], float(params)


def calibrate(traces: list[Trace], *, sources: list[str] | None = None) -> Profile:
    """Fit a Profile to measured traces (each must carry its plan in ``meta["plan"]``)."""
    if not traces:
        raise BadInput("--trace", "at least one measured trace", has_got=False)
    samples: list[_Sample] = []
    with_cluster: list[tuple[Trace, Cluster]] = []
    misc = []
    for n, trace in enumerate(traces):
        where = (sources or [f"trace {n}"] * len(traces))[n]
        if "plan" not in trace.meta:
            raise BadInput(f"{where}: meta.plan", "the plan the trace was measured on",
                           has_got=False)
        plan = plan_from_dict(trace.meta["plan"], where=f"{where}: meta.plan")
        model, cluster = plan.load_model(), plan.load_cluster()
        dtypes = {d: cluster.device(d).type.name for d in plan.devices}
        samples += _compute_samples(trace, plan, model, dtypes)
        with_cluster.append((trace, cluster))
        misc.append((trace, plan, model, dtypes))
    if not samples:
        raise BadInput("--trace", "compute events after the warm-up step (run --steps 2 or "
                       "more)", has_got=False)
    return Profile(
        compute=_fit_compute(samples),
        links=_fit_links(with_cluster),
        optimizer=_fit_misc(misc, "optimizer", _optimizer_x),
        allreduce=_fit_misc(misc, "allreduce", _allreduce_x),
        provenance={
            "traces": list(sources or []),
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "torch": next((t.meta.get("torch") for t in traces if t.meta.get("torch")), None),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "emulated": any(t.emulated for t in traces),
            "compute_samples": len(samples),
        })
