"""What a run is asked to do (`RunOptions`) and what it hands back (`RunResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import check_int
from hyperpipe.plan.stack import DDP_BUCKET_BYTES
from hyperpipe.plan.trace import Trace


@dataclass(frozen=True)
class RunOptions:
    """Options of `run_plan`. Times in seconds.

    `inject_fault` is ``(rank, step)``: that rank raises at the start of that step (for
    tests and drills); ``(rank, step, "stop")`` makes it SIGSTOP itself instead (a drill
    of the watchdog: the run must fail naming that rank). `emulation_scale` stretches
    every device's compute by this factor on top of its speed ratio (scale > 1 keeps CPU
    contention low when more ranks than cores run). `timeout_s` bounds every blocking
    wait (process-group and receive waits).
    `capture_state` makes every rank hand back its parameters and the last step's
    gradients (for tests that compare with a single-process run). `probe_links` runs the
    point-to-point ping-pong before step 0 that calibration fits links to.
    `overwrite` lets a fresh run replace the checkpoints of another run in
    `checkpoint_dir` (refused without it). `reference_profile` (a profile JSON of native
    speeds, `hyperpipe calibrate --measure --no-emulate`) gives emulation its compute
    references instead of timing each action before the run (see RankRuntime.reference_from).
    """

    steps: int = 1
    seed: int = 0
    trace_path: str | None = None
    chrome_path: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    overwrite: bool = False
    inject_fault: tuple[int, int] | tuple[int, int, str] | None = None
    emulate: bool = True
    emulation_scale: float = 1.0
    threads_per_rank: int = 1
    timeout_s: float = 30.0
    lr: float = 1e-3
    capture_state: bool = False
    probe_links: bool = True
    reference_profile: str | None = None
    # gradient buckets (bytes of fp32 gradient) reduced during the last backward, as the
    # simulator's SimOptions of the same names; off: every bucket after the last action
    bucket_bytes: float = DDP_BUCKET_BYTES
    overlap_dp_allreduce: bool = True

    def __post_init__(self) -> None:
        for name, high in (("steps", limits.MAX_STEPS), ("threads_per_rank", limits.MAX_THREADS)):
            check_int(getattr(self, name), f"run option {name}", at_most=high)
        for name, high in (("seed", limits.MAX_SEED), ("checkpoint_every", limits.MAX_STEPS)):
            check_int(getattr(self, name), f"run option {name}", allow_zero=True, at_most=high)
        for name, high in (("emulation_scale", limits.MAX_EMULATION_SCALE),
                           ("timeout_s", limits.MAX_TIMEOUT_S), ("lr", 10.0),
                           ("bucket_bytes", float(limits.MAX_INT))):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value <= high:
                raise BadInput(f"run option {name}", f"a positive number of at most {high:g}",
                               value)
        if self.emulation_scale < 1.0:
            raise BadInput("run option emulation_scale", "a number >= 1 (emulation can only "
                           "slow a device down)", self.emulation_scale)
        if self.checkpoint_every and not self.checkpoint_dir:
            raise BadInput("run option checkpoint_every", "a checkpoint directory with it",
                           has_got=False)
        if self.resume and not self.checkpoint_dir:
            raise BadInput("run option resume", "a checkpoint directory to resume from",
                           has_got=False)
        if self.inject_fault is not None:
            fault = self.inject_fault
            if len(fault) not in (2, 3) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0
                    for x in fault[:2]) or fault[2:] not in ((), ("raise",), ("stop",)):
                raise BadInput("run option inject_fault", "(rank, step) of two non-negative "
                               "integers, and optionally 'raise' or 'stop'", fault)
            if fault[1] >= self.steps:
                raise BadInput("run option inject_fault", f"a step below steps ({self.steps})",
                               fault[1])


@dataclass(frozen=True)
class RunResult:
    """A finished run: its measured trace (all ranks, aligned clocks), the wall time of
    each step (first rank's start to last rank's end, seconds), the full-batch mean loss
    of each step, and whether compute times were emulated. Steps resumed from a
    checkpoint are not in the lists. `state` (only with `capture_state`): one dict per
    rank, parameter name -> {"param", "grad"} tensors after the last step."""

    trace: Trace
    step_times_s: list[float]
    losses: list[float]
    emulated: bool
    first_step: int = 0
    state: list[dict[str, Any]] | None = field(default=None, repr=False)
