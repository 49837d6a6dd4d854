"""The real executor: launch one rank per device (locally or under torchrun), build each
rank's stage modules from the model spec, replay the plan's schedule IR with real sends
and receives, tensor and data parallelism, recompute and checkpoints, trace every
action, and stop every rank when one fails. On a CPU it emulates a hypothetical
cluster's device speeds and links (docs/emulation.md). From `sim` it uses only the cost
model and calibration. Importing this package does not import torch; `run_plan` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hyperpipe.exec.options import RunOptions, RunResult

if TYPE_CHECKING:
    from hyperpipe.exec.launch import RunFailed, run_plan


def __getattr__(name: str) -> Any:
    if name in ("run_plan", "RunFailed"):
        from hyperpipe.exec import launch
        return getattr(launch, name)
    raise AttributeError(f"module 'hyperpipe.exec' has no attribute {name!r}")


__all__ = ["RunOptions", "RunResult", "RunFailed", "run_plan"]
