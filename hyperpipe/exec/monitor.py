"""Live news from the ranks of a run: phases, progress ticks and finished steps.

Ranks report through a `Reporter` (a callable ``report(kind, **data)``); a local run's
ranks write each report as a small JSON file into the launcher's private run directory
(`FileReporter`), and the launcher, while it waits for the ranks, hands them to a
`Collector`. The collector calls the `Monitor` (the command line prints, a library
caller may ignore it) with one `StepReport` per step once every rank has finished that
step, so a step line appears as the step ends, not when the run ends.

Kinds: ``phase`` (text, total: a silent phase starts, `total` ticks to come), ``tick``
(one unit of that phase done), ``expected`` (device, busy_s: the compute seconds one
step of that rank should take here, from its reference timing), ``step`` (step,
start_s, end_s, loss, peak_memory_bytes, busy_s).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

Reporter = Callable[..., None]


@dataclass(frozen=True)
class StepReport:
    """One finished training step over all ranks: wall time from the first rank's start
    to the last rank's end (s), full-batch loss, the largest peak memory of a rank
    (bytes; resident set size on CPU, allocated device memory on CUDA) and every
    device's compute-busy seconds in the step."""

    step: int
    time_s: float
    loss: float
    peak_memory_bytes: float
    busy_s: dict[str, float]


class Monitor(Protocol):
    """What a run tells its caller while it runs (every method may do nothing)."""

    def phase(self, text: str, total: int) -> None: ...

    def tick(self) -> None: ...

    def expected(self, busy_s: dict[str, float]) -> None: ...

    def step(self, report: StepReport) -> None: ...


def peak_memory_bytes(device: Any) -> float:
    """This process's peak memory so far: CUDA allocator peak on a GPU, else the peak
    resident set size (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch
        return float(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss if sys.platform == "darwin" else rss * 1024)


class FileReporter:
    """A rank's reporter in a local run: one JSON file per report in `directory`,
    written under a temporary name and renamed, so the launcher never reads half."""

    def __init__(self, directory: str | os.PathLike, rank: int):
        self.directory = Path(directory)
        self.rank = rank
        self.seq = 0

    def __call__(self, kind: str, **data: Any) -> None:
        self.directory.mkdir(exist_ok=True)
        name = f"{self.rank:05d}-{self.seq:08d}.json"
        self.seq += 1
        tmp = self.directory / f".{name}.tmp"
        tmp.write_text(json.dumps({"kind": kind, "rank": self.rank, **data}))
        os.replace(tmp, self.directory / name)


class Collector:
    """Launcher side: read the ranks' report files in order and tell the monitor.
    Phases and ticks come from rank 0 (they are global); steps are merged over all
    `world` ranks."""

    def __init__(self, directory: str | os.PathLike, world: int, monitor: Monitor | None):
        self.directory = Path(directory)
        self.world = world
        self.monitor = monitor
        self.seen: set[str] = set()
        self.steps: dict[int, list[dict]] = {}
        self.busy: dict[str, float] = {}

    def poll(self) -> None:
        if self.monitor is None or not self.directory.is_dir():
            return
        for path in sorted(self.directory.glob("[0-9]*.json")):
            if path.name in self.seen:
                continue
            self.seen.add(path.name)
            try:
                self.handle(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue

    def handle(self, event: dict) -> None:
        """One report (under torchrun called directly on rank 0 with every rank's part of
        the reports all of them make, `launch._gathering_reporter`)."""
        if self.monitor is None:
            return
        kind = event["kind"]
        if kind == "phase" and event["rank"] == 0:
            self.monitor.phase(event["text"], int(event.get("total", 0)))
        elif kind == "tick":
            self.monitor.tick()
        elif kind == "expected":
            self.busy[event["device"]] = float(event["busy_s"])
            if len(self.busy) == self.world:
                self.monitor.expected(dict(self.busy))
        elif kind == "step":
            got = self.steps.setdefault(int(event["step"]), [])
            got.append(event)
            if len(got) == self.world:
                del self.steps[int(event["step"])]
                self.monitor.step(StepReport(
                    step=int(event["step"]),
                    time_s=max(e["end_s"] for e in got) - min(e["start_s"] for e in got),
                    loss=sum(e["loss"] for e in got),
                    peak_memory_bytes=max(e["peak_memory_bytes"] for e in got),
                    busy_s={e["device"]: e["busy_s"] for e in got}))
