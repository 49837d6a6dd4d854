"""Device memory over an iteration: static state plus stashed activations, and OOM.

Model (bytes per device):

* static: weights, gradients and optimizer state of every stage the device holds
  (`CostModel.state_bytes`, mixed-precision Adam by default, divided by tp);
* stash: each in-flight micro-batch of a stage keeps `CostModel.stash_bytes` from the
  start of its forward until the end of its backward, that is its B, or its W when the
  backward is split into I and W (the weight gradient still needs the layer inputs).

The simulator records the running total at every change (`memory_timeline`); the peak
over the iteration is compared with the device type's memory. A plan over memory is
reported (``Metrics.oom`` and ``extra["oom_detail"]``), never raised on: the search
needs to count it and a what-if user to see by how much it missed.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperpipe.plan.kinds import schedule_kind


def peak_of(timeline: Sequence[tuple[float, float]]) -> float:
    """Largest bytes value of a (time_s, bytes) timeline (0 when empty)."""
    return max((b for _, b in timeline), default=0.0)


def oom_detail(devices: Sequence[str], stages: Sequence[int], peak_bytes: float,
               capacity_bytes: float) -> dict:
    """One ``extra["oom_detail"]`` entry: devices with the same use (a rank's
    tensor-parallel group in every replica like it), the stages they hold, their peak,
    their capacity and by how many bytes the peak exceeds it."""
    return {"device": devices[0], "devices": list(devices), "stages": list(stages),
            "peak_bytes": peak_bytes, "capacity_bytes": capacity_bytes,
            "bytes_over": peak_bytes - capacity_bytes}


def peak_in_flight(kind: str, p: int, m: int, v: int, rank: int) -> int:
    """Closed form of the most (stage, micro-batch) stashes rank `rank` holds at once,
    for the kinds that have one (`ScheduleKind.peak_in_flight`, beside each generator)."""
    closed = schedule_kind(kind).peak_in_flight
    if closed is None:
        raise ValueError(f"schedule kind {kind!r} has no closed form of stashes in "
                         "flight: count them off its schedule")
    return closed(p, m, v, rank)
