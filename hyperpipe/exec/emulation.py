"""Replaying a heterogeneous cluster's speed ratios on one CPU machine.

All ranks of a local run compute on the same kind of core, so a plan for, say, two A100
and two V100 would run at one speed. Emulation stretches each compute action of a
device of type T to ``scale · ratio_T`` times its measured CPU time, by sleeping for the
difference after the real compute, where ``ratio_T = achievable FLOP/s of the cluster's
fastest device type / achievable FLOP/s of T`` (from the device catalog). The reference
is the cluster, not the plan, so that a device type runs at one emulated speed whatever
plan uses it (a plan of V100s only is slower than one of A100s, as on the real cluster),
and `hyperpipe calibrate --measure` (exec.profiler) stretches its per-layer timings by
the same factors. The fastest type keeps its native speed at scale 1; scale > 1
stretches every device, which keeps the cores free (sleeping ranks do not compete) when
more ranks than cores run. Traces of emulated runs say so (``meta.emulated``) and carry
the factors per device.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hyperpipe.cluster.cluster import Cluster


def emulation_factors(cluster: Cluster, scale: float = 1.0) -> dict[str, float]:
    """Device type name -> stretch factor (>= scale) of its compute times."""
    speed = {name: t.achievable_flops for name, t in cluster.device_types.items()}
    fastest = max(speed.values())
    return {name: scale * fastest / s for name, s in speed.items()}


def auto_emulation_scale(ranks: int, cores: int) -> float:
    """A stretch of every device for runs of `ranks` ranks on `cores` cores. With more
    ranks than cores, a rank's real compute can take up to ranks/cores times its
    uncontended time; emulation stretches each action to factor x that uncontended
    time, so the fastest type's factor must exceed the contention with room to spare
    (1.5x), or contention, not the emulated device, sets the time. At least 2; 4 ranks
    on 2 cores: 3."""
    return max(2.0, 1.5 * ranks / max(cores, 1))


def device_factors(devices: list[str], cluster: Cluster, scale: float = 1.0
                   ) -> dict[str, float]:
    """Device name -> stretch factor of its compute times: its type's factor times its
    node's `slowdown` (a straggler computes `slowdown` times slower, as the simulator
    prices it)."""
    by_type = emulation_factors(cluster, scale)
    return {d: by_type[cluster.device(d).type.name] * cluster.device(d).slowdown
            for d in devices}


def cpu_clock() -> float:
    """CPU seconds used by this process (all its threads)."""
    return time.process_time()


def compute_clock() -> tuple[float, float]:
    """(wall, CPU) seconds now; `compute_s` of two readings is the compute between them."""
    return time.perf_counter(), time.process_time()


def compute_s(start: tuple[float, float], end: tuple[float, float]) -> float:
    """Seconds of compute between two `compute_clock` readings: the smaller of the wall
    and the CPU time. With one thread, CPU time (never more than the wall time) leaves out
    the waits for a busy core; with N threads it sums over the threads, about N times the
    wall time the action took, so then the wall time is the action's time."""
    return min(end[0] - start[0], end[1] - start[1])


def stretch(start_s: float, start_cpu_s: float, factor: float,
            clock: Callable[[], float] = time.perf_counter, *,
            reference_s: float | None = None) -> float:
    """Sleep so that the compute that began at `start_s` (on `clock`) with the process
    at `start_cpu_s` CPU seconds (`cpu_clock`), and has just ended, ends `factor` times
    its reference time after it began, or, without a reference, `factor` times the CPU
    time it used; return the end time on `clock`.

    Why not the wall time it took: when more ranks than cores compute at once (or two
    share a core's hyperthreads), a rank's compute takes longer than alone, which the
    device it stands for would not. The reference is the same action timed alone
    before the run (RankRuntime.measure_reference); CPU time (the wall time if less, as
    with several threads: `compute_s`) is the fallback, immune to waiting for a core but
    not to sharing one. With factor 1 (no emulation) the native
    wall time stands.
    """
    end_s = clock()
    if factor > 1.0:
        used_s = reference_s if reference_s is not None else \
            compute_s((start_s, start_cpu_s), (end_s, cpu_clock()))
        target_s = start_s + used_s * factor
        while (left_s := target_s - clock()) > 0:
            time.sleep(left_s)
        end_s = clock()
    return end_s
