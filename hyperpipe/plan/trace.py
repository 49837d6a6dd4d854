"""Traces: one record per executed action, the same for the simulator and the executor.

Compute records carry op F, B, I or W. Communication and other records use the ops
``send`` (device -> peer, `bytes` moved), ``recv`` (the wait for a receive, measured
runs only), ``allreduce`` (data-parallel gradient reduction), ``allgather`` and
``reducescatter`` (ZeRO-2/3's parameter gathers and gradient reduce-scatters),
``alltoall`` (an expert-parallel dispatch or combine: `bytes` sent to its peers) and
``optimizer``.
Times are seconds from the start of the run (a measured run aligns its ranks' clocks
to a common start). A trace exports to Chrome trace JSON, which Perfetto and
chrome://tracing open.

File format (``hyperpipe.trace/1``)::

    {"format": "hyperpipe.trace/1",
     "meta": {"source": "simulated" | "measured", "emulated": bool, "plan": {...},
              "device_types": {"n0/0": "A100-80GB", ...}, ...},
     "columns": ["device", "op", "stage", "microbatch", "start_s", "end_s", "bytes",
                 "peer", "step"],
     "events": [["n0/0", "F", 0, 0, 0.0, 0.0012, 0, "", 0], ...]}
"""

from __future__ import annotations

import json
import math
from dataclasses import astuple, dataclass, field, fields
from pathlib import Path
from typing import Any

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import Fields, load_document, write_atomic

TRACE_FORMAT = "hyperpipe.trace/1"
COMPUTE_OPS = ("F", "B", "I", "W")
# One colour per op, shared by every drawing (schedules and timelines).
OP_COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868",
             "optimizer": "#222222", "send": "#8c8c8c", "recv": "#d0d0d0",
             "allreduce": "#8172b3", "allgather": "#937860", "reducescatter": "#da8bc3",
             "alltoall": "#64b5cd"}
OTHER_OPS = ("send", "recv", "allreduce", "allgather", "reducescatter", "alltoall",
             "optimizer")


@dataclass(frozen=True)
class TraceEvent:
    device: str
    op: str
    stage: int
    microbatch: int
    start_s: float
    end_s: float
    bytes: float = 0.0
    peer: str = ""          # the other device of a send/recv
    step: int = 0           # training iteration

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def label(self) -> str:
        """The action's text form, e.g. ``2F0``; comm ops get e.g. ``send 2F0``."""
        text = f"{self.stage}{self.op}{self.microbatch}"
        return text if self.op in COMPUTE_OPS else f"{self.op} {self.stage}:{self.microbatch}"


COLUMNS = [f.name for f in fields(TraceEvent)]


@dataclass(frozen=True)
class Trace:
    events: tuple[TraceEvent, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def emulated(self) -> bool:
        return bool(self.meta.get("emulated", False))

    def devices(self) -> list[str]:
        """Devices in order of first appearance (stage order for pipelines)."""
        seen: dict[str, None] = {}
        for e in self.events:
            seen.setdefault(e.device, None)
        return list(seen)

    def compute(self) -> list[TraceEvent]:
        return [e for e in self.events if e.op in COMPUTE_OPS]

    def makespan_s(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end_s for e in self.events) - min(e.start_s for e in self.events)

    def step_times_s(self) -> dict[int, float]:
        """Wall time of each training step: first start to last end of that step."""
        spans: dict[int, list[float]] = {}
        for e in self.events:
            lo_hi = spans.setdefault(e.step, [e.start_s, e.end_s])
            lo_hi[0] = min(lo_hi[0], e.start_s)
            lo_hi[1] = max(lo_hi[1], e.end_s)
        return {k: v[1] - v[0] for k, v in sorted(spans.items())}

    # ---------------------------------------------------------------- files
    def to_dict(self) -> dict[str, Any]:
        return {"format": TRACE_FORMAT, "meta": self.meta, "columns": COLUMNS,
                "events": [list(astuple(e)) for e in self.events]}

    def save(self, path: str | Path) -> None:
        write_atomic(path, json.dumps(self.to_dict(), separators=(",", ":")) + "\n")

    def to_chrome(self) -> dict[str, Any]:
        """Chrome trace JSON: one process per device, complete ("X") events in microseconds."""
        pids = {d: i for i, d in enumerate(self.devices())}
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": dev}}
            for dev, pid in pids.items()]
        for e in self.events:
            out.append({"name": e.label, "cat": e.op, "ph": "X", "pid": pids[e.device],
                        "tid": 0 if e.op in COMPUTE_OPS else 1,
                        "ts": e.start_s * 1e6, "dur": max(e.duration_s, 0.0) * 1e6,
                        "args": {"stage": e.stage, "microbatch": e.microbatch,
                                 "bytes": e.bytes, "peer": e.peer, "step": e.step}})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {k: v for k, v in self.meta.items() if k != "plan"}}

    def save_chrome(self, path: str | Path) -> None:
        write_atomic(path, json.dumps(self.to_chrome()) + "\n")


MAX_TRACE_NUMBER = 1e18   # seconds (epoch times are ~1.7e9), bytes, indices


def _finite_number(x: Any) -> bool:
    """A real number (not a string, not bool) that is finite and not absurdly large."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return abs(x) <= MAX_TRACE_NUMBER and (isinstance(x, int) or math.isfinite(x))


def trace_from_dict(data: Any, *, where: str) -> Trace:
    """The Trace a ``hyperpipe.trace/1`` document holds; BadInput naming the field (`where`
    the file) for what no run can have recorded: an unknown op, a value that is not a
    finite number, a stage, micro-batch or step that is not a whole number of at least -1
    (-1: none, e.g. the link probes before step 0), a start before the run's start (times
    are seconds from it), an end before the start, negative bytes, and in `meta`
    (`_check_meta`) a `first_step`, `emulated` or `emulation_scale` of another type or
    range. Other meta keys are kept as they are. What needs the plan or the shape of a
    measured run (devices, stages, micro-batches in range, steps one after another from
    `first_step`, each action once) the calibration checks (`sim.recorded.check_recorded`)."""
    top = Fields(data, where, ("format", "meta", "columns", "events"))
    if top.raw("format", None) != TRACE_FORMAT:
        raise BadInput(top.at("format"), repr(TRACE_FORMAT), top.raw("format", None))
    columns = top.items("columns", COLUMNS)
    if columns != COLUMNS:
        raise BadInput(top.at("columns"), f"{COLUMNS}", columns)
    events = []
    for i, row in enumerate(top.items("events")):
        if not isinstance(row, list) or len(row) != len(COLUMNS):
            raise BadInput(f"{where}: events[{i}]", f"a list of {len(COLUMNS)} values", row)
        dev, op, stage, mb, start, end, nbytes, peer, step = row
        if op not in COMPUTE_OPS + OTHER_OPS:
            raise BadInput(f"{where}: events[{i}][1]", f"an op in {COMPUTE_OPS + OTHER_OPS}",
                           op)
        numbers = (stage, mb, start, end, nbytes, step)
        if not all(_finite_number(x) for x in numbers):
            raise BadInput(f"{where}: events[{i}]", "finite numbers of magnitude at most "
                           f"{MAX_TRACE_NUMBER:g} for stage, microbatch, times, bytes and step",
                           row)
        for col, x in ((2, stage), (3, mb), (8, step)):
            if not float(x).is_integer() or x < -1:
                raise BadInput(f"{where}: events[{i}][{col}]", f"{COLUMNS[col]}, a whole "
                               "number >= -1 (-1: none)", x)
        if start < 0:
            raise BadInput(f"{where}: events[{i}][4]", "start_s, a number >= 0 (seconds "
                           "from the start of the run)", start)
        events.append(TraceEvent(str(dev), op, int(stage), int(mb), float(start),
                                 float(end), float(nbytes), str(peer), int(step)))
        if events[-1].end_s < events[-1].start_s:
            raise BadInput(f"{where}: events[{i}]", "end_s >= start_s", row)
        if events[-1].bytes < 0:
            raise BadInput(f"{where}: events[{i}][6]", "bytes >= 0", nbytes)
    meta = top.raw("meta", {})
    if not isinstance(meta, dict):
        raise BadInput(top.at("meta"), "a mapping", meta)
    _check_meta(meta, f"{where}: meta")
    return Trace(tuple(events), meta)


def _check_meta(meta: dict[str, Any], where: str) -> None:
    """BadInput naming the key of `meta` (at `where`) that the readers of a trace rely on
    and that no run can have written: `first_step` not an integer >= 0, `emulated` not a
    bool, `emulation_scale` not a number in [1, MAX_EMULATION_SCALE] (as `hyperpipe run
    --emulation-scale` takes it), `device_types` not a mapping of device to type name.
    Unknown keys are kept: a trace may carry what its writer knew."""
    first = meta.get("first_step", 0)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise BadInput(f"{where}.first_step", "the run's first step, an integer >= 0", first)
    if not isinstance(meta.get("emulated", False), bool):
        raise BadInput(f"{where}.emulated", "true or false", meta["emulated"])
    scale = meta.get("emulation_scale", 1.0)
    if isinstance(scale, bool) or not _finite_number(scale) or \
            not 1.0 <= scale <= limits.MAX_EMULATION_SCALE:
        raise BadInput(f"{where}.emulation_scale", "the run's --emulation-scale, a number "
                       f"from 1 to {limits.MAX_EMULATION_SCALE:g}", scale)
    types = meta.get("device_types", {})
    if not isinstance(types, dict) or not all(isinstance(t, str) for t in types.values()):
        raise BadInput(f"{where}.device_types", "a mapping of device (NODE/INDEX) to its "
                       "device type's name", types)


def load_trace(path: str | Path) -> Trace:
    return trace_from_dict(load_document(path), where=str(path))
