"""The real executor: run a plan with torch.distributed, trace every action, survive faults.

* `launch`: `run_plan` (local ranks or torchrun), failure propagation, `RunFailed`.
* `job`: checks before any rank starts; one rank's whole run (`rank_main`), gathered.
* `runtime`: one rank's stages replaying its schedule actions, one primitive per kind.
* `comm`: point-to-point transfers, the link probe, the data-parallel all-reduce.
* `placement`: which rank runs which stages; data-parallel reduction groups.
* `emulation`: stretching compute to replay a heterogeneous cluster on one CPU machine.
* `checkpoint`: atomic per-rank checkpoints, fingerprints, resuming.
* `data`: the deterministic synthetic token stream.
* `options`: `RunOptions`, `RunResult`.
* `torch_pipelining`: our stages under torch.distributed.pipelining (interop, benchmark).

Importing this package does not import torch; `run_plan` does.
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
