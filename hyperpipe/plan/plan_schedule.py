"""The schedule a plan runs, per pipeline: generated from its kind, or its own action
lists (`kind: synth`, plan field ``schedule.actions``), and where its stages sit.

``schedule.actions`` maps each pipeline rank's device (the first device of its
tensor-parallel group) to that rank's actions in the IR's text form::

    {"a100/0": ["0F0", "0F1", "0I0", ...], "v100/0": ["1F0", ...]}

The simulator and the executor both call `schedule_for`, so they replay the same order.
Pure functions of the plan (no torch, no processes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hyperpipe.core.errors import BadInput
from hyperpipe.plan.generators import SYNTH, generate, over_action_limit, placement_of
from hyperpipe.plan.schedule import Action, Schedule, ScheduleError, stage_rank, validate

if TYPE_CHECKING:
    from hyperpipe.plan.plan import PipelinePlan, Plan

ActionLists = tuple[tuple[str, tuple[Action, ...]], ...]     # (device, its actions), sorted


def parse_actions(data: Any, where: str) -> ActionLists:
    """Read ``schedule.actions`` (device -> list of ``"2F0"`` strings); BadInput names the
    device and step of the first bad entry."""
    if not isinstance(data, Mapping) or not data:
        raise BadInput(where, "a mapping of device name to a list of actions like '0F0'",
                       data)
    out = []
    for device, row in data.items():
        if not isinstance(device, str) or not device:
            raise BadInput(where, "device names (NODE/INDEX) as keys", device)
        if not isinstance(row, list):
            raise BadInput(f"{where}[{device!r}]", "a list of actions like '0F0'", row)
        actions = []
        for step, text in enumerate(row):
            try:
                actions.append(Action.from_str(text))
            except ScheduleError:
                raise BadInput(f"{where}[{device!r}] step {step}", "an action like '2F0' "
                               "(stage, op in F/B/I/W, micro-batch)", text) from None
        out.append((device, tuple(actions)))
    return tuple(sorted(out))


def actions_to_dict(actions: ActionLists) -> dict[str, list[str]]:
    """The JSON form of `parse_actions`' result."""
    return {device: [str(a) for a in row] for device, row in actions}


def pipeline_placement(plan: Plan, pipe: PipelinePlan) -> str:
    """``v`` or ``loop``: fixed by the kind, or for `synth` read off the stages' devices
    (V when stage p sits with stage p - 1)."""
    if plan.schedule != SYNTH:
        return placement_of(plan.schedule)
    p = len(pipe.stages) // plan.chunks
    if plan.chunks > 1 and p > 1 and pipe.stages[p].devices == pipe.stages[p - 1].devices:
        return "v"
    return "loop"


def plan_over_action_limit(plan: Plan) -> str | None:
    """Why some pipeline's generated schedule would be over the action limit (the
    simulator and executor could not build it), or None. Synthesised plans carry their
    actions and are never over."""
    if plan.schedule == SYNTH:
        return None
    for pipe in plan.pipelines:
        over = over_action_limit(plan.schedule, len(pipe.stages) // plan.chunks,
                                 pipe.num_microbatches, plan.chunks)
        if over:
            return over
    return None


def schedule_for(plan: Plan, q: int = 0) -> Schedule:
    """The schedule pipeline `q` of `plan` runs (not validated; `check_actions` does)."""
    pipe = plan.pipelines[q]
    p = len(pipe.stages) // plan.chunks
    if plan.schedule != SYNTH:
        return generate(plan.schedule, p, pipe.num_microbatches, plan.chunks)
    lists = dict(plan.actions or ())
    rows = []
    for d in range(p):
        device = pipe.stages[d].devices[0]
        if device not in lists:
            raise BadInput(f"{plan.source}: schedule.actions", f"an action list for device "
                           f"{device!r} (pipeline {q} rank {d})", sorted(lists))
        rows.append(lists[device])
    return Schedule(SYNTH, p, len(pipe.stages), pipe.num_microbatches, tuple(rows),
                    pipeline_placement(plan, pipe))


def check_actions(plan: Plan, where: str) -> None:
    """BadInput unless `schedule.actions` is there exactly for kind synth, covers the
    plan's ranks and no other device, and every pipeline's lists validate (the message
    names the device and step)."""
    if plan.schedule != SYNTH:
        if plan.actions:
            raise BadInput(f"{where}: schedule.actions", "no action lists unless kind is "
                           f"'{SYNTH}'", plan.schedule)
        return
    if not plan.actions:
        raise BadInput(f"{where}: schedule.actions", f"per-device action lists for kind "
                       f"'{SYNTH}'", None)
    used = set()
    for q, pipe in enumerate(plan.pipelines):
        sched = schedule_for(plan, q)
        names = [pipe.stages[d].devices[0] for d in range(sched.num_devices)]
        used.update(names)
        try:
            validate(sched)
        except ScheduleError as err:
            text = re.sub(r"rank (\d+)", lambda mt, names=names: f"device {names[int(mt[1])]}",
                          str(err))
            raise _bad(where, f"pipeline {q}: {text}") from None
    extra = sorted(set(dict(plan.actions)) - used)
    if extra:
        raise BadInput(f"{where}: schedule.actions", "lists only for the first device of "
                       "each pipeline rank", extra[0])


def _bad(where: str, text: str) -> BadInput:
    err = BadInput(f"{where}: schedule.actions", "a runnable order", None, has_got=False)
    err.args = (f"{where}: schedule.actions: {text}",)
    return err


def home_stage(plan: Plan, pipe: PipelinePlan, k: int) -> int:
    """The stage among the first p whose devices stage k shares (its rank)."""
    p = len(pipe.stages) // plan.chunks
    return stage_rank(k, p, pipeline_placement(plan, pipe))


def rank_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) activation stashes held at once: from an
    F until the pair's B, or its W when the backward is split."""
    peaks = []
    for row in schedule.actions:
        live = peak = 0
        for a in row:
            live += 1 if a.op == "F" else -1 if a.op in "BW" else 0
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)
