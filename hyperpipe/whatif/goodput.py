"""Failures, checkpoints and goodput: how much of the wall time trains.

Model (Daly 2006, Future Generation Computer Systems 22(3)): failures arrive as a
Poisson process of mean time between failures M (independent nodes: M = 1 / sum 1/M_i).
The job computes for tau (`interval_s`), writes a checkpoint for delta (`write_s`); a
failure loses the work since the last completed checkpoint and costs R (`restart_s`),
restarted over if another failure hits it. The expected wall time per unit of work is

    T_wall / T_work = M e^(R/M) (e^((tau + delta)/M) - 1) / tau

and the **goodput** is its inverse. First-order optima: Young's tau = sqrt(2 delta M)
(Young 1974, CACM 17(9)) and Daly's sqrt(2 delta M) - delta (for delta < 2M);
`best_interval_s` finds the exact one numerically, and `monte_carlo_goodput` checks the
model independently by walking a long drawn run of failures.

Times in seconds; goodput a fraction in [0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# A checkpoint keeps what mixed-precision Adam needs to resume: bf16 weights (2 bytes),
# fp32 master weights (4) and two fp32 moments (8) per parameter; the gradients (the
# other 2 of ZeRO's 16 bytes, Rajbhandari et al. 2020, sec. 3.1) are not saved.
CHECKPOINT_BYTES_PER_PARAM = 14


@dataclass(frozen=True)
class Checkpointing:
    """How a job checkpoints and restarts (seconds)."""

    write_s: float                 # time to write one checkpoint (delta)
    restart_s: float               # failure to training again (R)

    def __post_init__(self) -> None:
        for name in ("write_s", "restart_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def combined_mtbf_s(mtbfs_s: Sequence[float]) -> float:
    """MTBF of a job that stops when any of its parts fails (independent exponential
    failures: the rates add)."""
    if not mtbfs_s or min(mtbfs_s) <= 0:
        raise ValueError(f"MTBFs must be positive, got {list(mtbfs_s)!r}")
    return 1.0 / sum(1.0 / m for m in mtbfs_s)


def expected_goodput(interval_s: float, ckpt: Checkpointing, mtbf_s: float) -> float:
    """Useful time over wall time with checkpoints every `interval_s` of work (Daly
    2006's expected wall time, inverted)."""
    if interval_s <= 0:
        return 0.0
    r, x = ckpt.restart_s / mtbf_s, (interval_s + ckpt.write_s) / mtbf_s
    if r > 700.0 or x > 700.0:
        # math.exp would raise OverflowError; the goodput is below e^-700 anyway
        return 0.0
    wall_per_work = mtbf_s * math.exp(r) * math.expm1(x) / interval_s   # inf: goodput 0
    return 1.0 / wall_per_work


def young_interval_s(write_s: float, mtbf_s: float) -> float:
    """Young 1974: sqrt(2 delta M)."""
    return math.sqrt(2.0 * write_s * mtbf_s)


def daly_interval_s(write_s: float, mtbf_s: float) -> float:
    """Daly 2006, first order: sqrt(2 delta M) - delta for delta < 2M, else M."""
    if write_s >= 2.0 * mtbf_s:
        return mtbf_s
    return math.sqrt(2.0 * write_s * mtbf_s) - write_s


def best_interval_s(ckpt: Checkpointing, mtbf_s: float) -> float:
    """The interval that maximises `expected_goodput` (golden-section search; the
    goodput is unimodal in the interval)."""
    lo, hi = 1e-9 * mtbf_s, 10.0 * mtbf_s + 10.0 * ckpt.write_s
    inv = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - inv * (hi - lo), lo + inv * (hi - lo)
    fa, fb = expected_goodput(a, ckpt, mtbf_s), expected_goodput(b, ckpt, mtbf_s)
    for _ in range(200):
        if fa < fb:
            lo, a, fa = a, b, fb
            b = lo + inv * (hi - lo)
            fb = expected_goodput(b, ckpt, mtbf_s)
        else:
            hi, b, fb = b, a, fa
            a = hi - inv * (hi - lo)
            fa = expected_goodput(a, ckpt, mtbf_s)
    return (lo + hi) / 2.0


def monte_carlo_goodput(intervals_s: Sequence[float], ckpt: Checkpointing, mtbf_s: float,
                        *, failures: int = 100_000, seed: int = 0) -> list[float]:
    """Goodput of each interval over one long simulated run with `failures` failures.

    Failure times are drawn once (exponential gaps of mean `mtbf_s`, a fixed `seed`)
    and shared by every interval, so that the curve over intervals is smooth. Between
    two failures the job first restarts (a gap shorter than the restart saves
    nothing), then completes whole (work + checkpoint) segments; the segment a failure
    interrupts is lost.
    """
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(mtbf_s, size=failures)
    wall = float(gaps.sum())
    usable = np.maximum(gaps - ckpt.restart_s, 0.0)
    out = []
    for tau in intervals_s:
        segments = np.floor(usable / (tau + ckpt.write_s))
        out.append(float(tau * segments.sum()) / wall)
    return out
