"""What a measured trace may hold, read against the plan it records (`meta.plan`): the
checks `hyperpipe calibrate` makes before fitting, each a BadInput naming the trace's
field, so that a trace no run can have recorded, or one the fits would read wrongly, is
refused rather than fitted (`check_recorded`); and which steps a fit reads
(`fitted_from`). What needs no plan `hyperpipe.plan.trace` checks as it reads a trace."""

from __future__ import annotations

from collections import defaultdict

from hyperpipe.cluster.cluster import Cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import ModelSpec
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.trace import COMPUTE_OPS, Trace


def check_recorded(trace: Trace, plan: Plan, model: ModelSpec, cluster: Cluster,
                   where: str) -> None:
    """Every check below of `trace` (from the file `where`) against its `plan`, `model`
    and `cluster`: its events' devices, stages and micro-batches, its steps, its
    actions, its model's name and its devices' types."""
    _check_events(trace, plan, where)
    _check_steps(trace, where)
    _check_actions(trace, plan, where)
    _check_model_name(trace, model, where)
    _check_device_types(trace, plan, cluster, where)


def _check_events(trace: Trace, plan: Plan, where: str) -> None:
    """BadInput for an event the trace's own plan cannot have made: a device not in the
    plan, a send or receive to one, a compute action on a stage its device lacks or of a
    micro-batch outside its pipeline's ``0 .. num_microbatches - 1``."""
    devices = set(plan.devices)
    # (device, stage) -> the micro-batches of the stage's pipeline
    stages = {(d, k): pipe.num_microbatches for pipe in plan.pipelines
              for k, stage in enumerate(pipe.stages) for d in stage.devices}
    for i, e in enumerate(trace.events):
        if e.device not in devices:
            raise BadInput(f"{where}: events[{i}][0]", "a device of the plan in meta.plan",
                           e.device)
        if e.op in ("send", "recv") and e.peer and e.peer not in devices:
            raise BadInput(f"{where}: events[{i}][7]", "a device of the plan in meta.plan",
                           e.peer)
        if e.op in COMPUTE_OPS and (e.device, e.stage) not in stages:
            raise BadInput(f"{where}: events[{i}][2]", "a stage the plan in meta.plan puts "
                           "on the event's device", e.stage)
        if e.op in COMPUTE_OPS and not 0 <= e.microbatch < stages[e.device, e.stage]:
            raise BadInput(f"{where}: events[{i}][3]", "a micro-batch of the stage's "
                           f"pipeline in meta.plan, 0 to {stages[e.device, e.stage] - 1}",
                           e.microbatch)


def _check_steps(trace: Trace, where: str) -> None:
    """BadInput naming the first event of a step no run records: a run records every step
    it runs, one after another from `meta.first_step` (0, or the step a resumed run starts
    at), so the steps of a trace (-1 aside: none, e.g. the link probes) are
    ``first_step, first_step + 1, ...`` without a gap. Which step is the warm-up, and so
    left out of the fits (`fitted_from`), rests on it."""
    first = trace.meta.get("first_step", 0)        # checked by `trace_from_dict`
    steps = {e.step for e in trace.events if e.step >= 0}
    if not steps:
        return
    if min(steps) < first:
        i, step = next((i, e.step) for i, e in enumerate(trace.events) if 0 <= e.step < first)
        raise BadInput(f"{where}: events[{i}][8]", f"step, a step of the run: from "
                       f"meta.first_step {first} on", step)
    gap = next(s for s in range(first, max(steps) + 2) if s not in steps)
    if gap <= max(steps):
        i, step = next((i, e.step) for i, e in enumerate(trace.events) if e.step > gap)
        raise BadInput(f"{where}: events[{i}][8]", "step, a step of the run: a run records "
                       f"its steps one after another from meta.first_step {first}, and no "
                       f"event has step {gap}", step)


def _check_actions(trace: Trace, plan: Plan, where: str) -> None:
    """BadInput for compute events no run records and the fits would take in (after
    `_check_events`): an action (device, op, stage, micro-batch, step) recorded twice (a
    rank runs each action of a step once), a rank's step whose optimizer event lacks a
    forward or backward of the rank's stages (it runs its optimizer step after all of
    them; a missing one would read as idle time between actions, `_action_gaps`), and a
    device's op whose every event in the fitted steps lasts 0 s (fitted as free)."""
    done: dict[tuple[str, int, str, int, int], int] = {}    # action -> its event's index
    for i, e in enumerate(trace.events):
        if e.op not in COMPUTE_OPS:
            continue
        action = (e.device, e.step, e.op, e.stage, e.microbatch)
        if action in done:
            raise BadInput(f"{where}: events[{i}]", "one event per compute action (a run "
                           f"records each action of a step once); events[{done[action]}] "
                           f"already records {e.label} of step {e.step} on {e.device}",
                           has_got=False)
        done[action] = i
    on_device: dict[str, list[tuple[int, int]]] = defaultdict(list)   # (stage, micro-batches)
    for pipe in plan.pipelines:
        for k, stage in enumerate(pipe.stages):
            for d in stage.devices:
                on_device[d].append((k, pipe.num_microbatches))
    for i, e in enumerate(trace.events):
        if e.op != "optimizer" or e.step < 0:
            continue
        for k, m in on_device[e.device]:
            for mb in range(m):
                ran = {op for op in COMPUTE_OPS if (e.device, e.step, op, k, mb) in done}
                backward = "B" in ran or {"I", "W"} <= ran
                if "F" not in ran or not backward:
                    missing = "F" if "F" not in ran else "B (or I and W)"
                    raise BadInput(f"{where}: events[{i}]", f"{e.device}'s optimizer step "
                                   f"of step {e.step} after all its actions of that step (F "
                                   "and B, or F, I and W, of each micro-batch of its stages "
                                   f"in meta.plan); no {missing} of stage {k}, micro-batch "
                                   f"{mb} was recorded", has_got=False)
    first = fitted_from(trace)
    untimed: dict[tuple[str, str], int] = {}      # (device, op) -> its first fitted event
    timed: set[tuple[str, str]] = set()
    for i, e in enumerate(trace.events):
        if e.op in COMPUTE_OPS and e.step >= first:
            untimed.setdefault((e.device, e.op), i)
            if e.end_s > e.start_s:
                timed.add((e.device, e.op))
    for (device, op), i in untimed.items():
        if (device, op) not in timed:
            raise BadInput(f"{where}: events[{i}][5]", f"end_s after start_s for some {op} "
                           f"of {device} after the warm-up step (a measured compute action "
                           f"takes time); every one lasts 0 s, which would fit {op} as free",
                           has_got=False)


def _check_model_name(trace: Trace, model: ModelSpec, where: str) -> None:
    """BadInput unless `meta.model` (optional) is the name of the model in `meta.plan`: a
    run records both from the one model it ran, so a trace that names two cannot say
    which one its times are of."""
    name = trace.meta.get("model", model.name)
    if name != model.name:
        raise BadInput(f"{where}: meta.model", f"{model.name!r}, the name of the model of "
                       "meta.plan (a run records the model it ran in both)", name)


def _check_device_types(trace: Trace, plan: Plan, cluster: Cluster, where: str) -> None:
    """BadInput unless every entry of `meta.device_types` (optional) names a device of
    the plan and the type its cluster gives that device: the fits are keyed by the
    cluster's type, so a trace recorded as another type would be fitted as the wrong
    one."""
    for device, name in trace.meta.get("device_types", {}).items():
        if device not in plan.devices:
            raise BadInput(f"{where}: meta.device_types", "devices of the plan in meta.plan",
                           device)
        own = cluster.device(device).type.name
        if name != own:
            raise BadInput(f"{where}: meta.device_types.{device}", f"{own!r}, the type "
                           f"cluster {cluster.name!r} of meta.plan gives {device}", name)


def fitted_from(trace: Trace) -> int:
    """The first step a fit reads: the one after the run's first (warm-up) step,
    `meta.first_step` of a resumed run, else 0."""
    return trace.meta.get("first_step", 0) + 1        # checked by `trace_from_dict`
