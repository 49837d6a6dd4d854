"""Schedule generators: one pure function per schedule kind, and a registry.

Each generator takes p (pipeline ranks), m (micro-batches) and, where the kind has them,
v (chunks, i.e. stages per rank, looped placement: stage k on rank k % p), and returns a
new `Schedule`. The V-shaped kinds (`zb-v`, `dualpipe-v`, two chunks per rank in a V)
live in `generators_v`. Timings quoted below take F = I = W = t (so B = 2t) and free
links.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from types import MappingProxyType

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput, InfeasiblePlan
from hyperpipe.plan.generators_v import dualpipe_v, zb_v
from hyperpipe.plan.schedule import Action, Schedule


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward.

    Backwards run in forward micro-batch order (first in, first out, as torch's
    ScheduleGPipe does); all m micro-batches are stashed on every stage at the peak.
    Makespan 3 (m + p - 1) t.
    """
    rows = tuple(
        tuple(Action(d, "F", mb) for mb in range(m)) + tuple(Action(d, "B", mb) for mb in range(m))
        for d in range(p)
    )
    return Schedule("gpipe", p, p, m, rows)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): warmup, one forward one backward, cooldown.

    Rank d runs min(p - 1 - d, m) warmup forwards, then alternates F and B, then drains the
    remaining backwards, so at most min(p - d, m) micro-batches are stashed on stage d.
    Makespan 3 (m + p - 1) t.
    """
    rows = []
    for d in range(p):
        warmup = min(p - 1 - d, m)
        row = [Action(d, "F", mb) for mb in range(warmup)]
        for i in range(m - warmup):
            row += [Action(d, "F", warmup + i), Action(d, "B", i)]
        row += [Action(d, "B", mb) for mb in range(m - warmup, m)]
        rows.append(tuple(row))
    return Schedule("1f1b", p, p, m, tuple(rows))


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021) with v chunks per rank.

    Forwards go in rounds of p micro-batches through chunks 0..v-1; backwards visit the
    same rounds with the chunks reversed. Rank d runs (v - 1) p + 2 (p - 1 - d) warmup
    forwards (v = 1: 1F1B's p - 1 - d, so v = 1 gives exactly `one_f_one_b`), then
    alternates F and B, then drains.

    When p does not divide m, the order is built for m rounded up to a multiple of p and
    the phantom micro-batches' actions are dropped, leaving a smaller last round. That
    keeps it deadlock-free: the dropped actions depend only on each other, so the
    original run order minus them is still a valid run order. (Simply shortening the last
    round deadlocks, e.g. p=4, m=5, v=3.) With p | m the makespan is 3 m v t + 3 (p - 1) t,
    t being one chunk's forward time and B = 2t.
    """
    padded = -(-m // p) * p
    rounds = [range(start, start + p) for start in range(0, padded, p)]
    order = [(c, mb) for rnd in rounds for c in range(v) for mb in rnd]
    back = [(c, mb) for rnd in rounds for c in reversed(range(v)) for mb in rnd]
    total = padded * v
    rows = []
    for d in range(p):
        warmup = (v - 1) * p + 2 * (p - 1 - d) if v > 1 else p - 1 - d
        warmup = min(warmup, total)
        fwd = [Action(c * p + d, "F", mb) for c, mb in order]
        bwd = [Action(c * p + d, "B", mb) for c, mb in back]
        row = fwd[:warmup]
        for i in range(total - warmup):
            row += [fwd[warmup + i], bwd[i]]
        row += bwd[total - warmup :]
        rows.append(tuple(a for a in row if a.microbatch < m))
    return Schedule("interleaved-1f1b", p, p * v, m, tuple(rows))


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"), one chunk per rank.

    1F1B with each backward split into I (input gradient, the paper's "B") and W (weight
    gradient). Rank d keeps 1F1B's warmup and its F/I alternation, so stage d holds at
    most min(p - d, m) micro-batches between F and I, exactly as 1F1B. The first d
    steady-state W's are deferred: W(k) runs after I(k + d), and the deferred W's fill the
    cooldown bubbles. Counting a micro-batch from its F until its W, stage d then holds
    up to min(p, m), which is 1F1B's peak over all stages (the paper's memory claim).
    Makespan 3 m t + (p - 1) t for m >= p.
    """
    rows = []
    for d in range(p):
        warmup = min(p - 1 - d, m)
        row = [Action(d, "F", mb) for mb in range(warmup)]
        weights = 0
        for i in range(m):
            if warmup + i < m:
                row.append(Action(d, "F", warmup + i))
            row.append(Action(d, "I", i))
            if i >= d:
                row.append(Action(d, "W", weights))
                weights += 1
        row += [Action(d, "W", mb) for mb in range(weights, m)]
        rows.append(tuple(row))
    return Schedule("zb-h1", p, p, m, tuple(rows))


SCHEDULE_KINDS: Mapping[str, Callable[..., Schedule]] = MappingProxyType({
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "dualpipe-v": dualpipe_v,
})
_TAKES_CHUNKS = frozenset({"interleaved-1f1b"})
_V_KINDS = frozenset({"zb-v", "dualpipe-v"})       # exactly 2 chunks, V placement
SYNTH = "synth"      # a plan's own action lists (`schedule.actions`), no generator


def takes_chunks(kind: str) -> bool:
    """Whether schedules of `kind` take any chunk count (stages per device) >= 1."""
    return kind in _TAKES_CHUNKS


def default_chunks(kind: str) -> int:
    """Chunks per device when none is given: 2 for the V kinds, else 1."""
    return 2 if kind in _V_KINDS else 1


def allowed_chunks(kind: str, chunks: int) -> bool:
    """Whether `kind` can place `chunks` stages per device."""
    return takes_chunks(kind) or kind == SYNTH or chunks == default_chunks(kind)


def placement_of(kind: str) -> str:
    """How `kind` places its chunks on devices: ``v`` or ``loop`` (see `stage_rank`)."""
    return "v" if kind in _V_KINDS else "loop"


def generate(kind: str, num_devices: int, num_microbatches: int,
             chunks: int | None = None) -> Schedule:
    """Build the `kind` schedule for p = num_devices, m = num_microbatches, v = chunks
    (None: the kind's default, 2 for the V kinds, else 1).

    Raises BadInput for an unknown kind, non-positive counts, or a chunk count the kind
    cannot take (1 for single-stage kinds, 2 for the V kinds). Schedules are immutable
    and a pure function of these four values, so they are memoised: a search simulates
    the same shapes many times.
    """
    if chunks is None:
        chunks = default_chunks(kind)
    return _generate(kind, num_devices, num_microbatches, chunks)


def over_action_limit(kind: str, num_devices: int, num_microbatches: int,
                      chunks: int) -> str | None:
    """Why a schedule of this shape is not built (over `limits.MAX_SCHEDULE_ACTIONS`,
    counting F, I and W per stage and micro-batch), or None when it is within it."""
    actions = 3 * num_devices * chunks * num_microbatches
    if actions <= limits.MAX_SCHEDULE_ACTIONS:
        return None
    return (f"a {kind} schedule of {num_devices} devices x {chunks} chunks x "
            f"{num_microbatches} micro-batches (up to {actions} actions) is over the limit "
            f"of {limits.MAX_SCHEDULE_ACTIONS} actions (hyperpipe.core.limits)")


@lru_cache(maxsize=256)
def _generate(kind: str, num_devices: int, num_microbatches: int, chunks: int) -> Schedule:
    if kind not in SCHEDULE_KINDS:
        raise BadInput("schedule kind", f"one of {', '.join(SCHEDULE_KINDS)}", kind)
    for name, value in (
        ("devices", num_devices),
        ("microbatches", num_microbatches),
        ("chunks", chunks),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadInput(f"schedule {name}", "a positive integer", value)
    over = over_action_limit(kind, num_devices, num_microbatches, chunks)
    if over:
        raise InfeasiblePlan(over)
    if kind in _TAKES_CHUNKS:
        return SCHEDULE_KINDS[kind](num_devices, num_microbatches, chunks)
    want = default_chunks(kind)
    if chunks != want:
        what = "two stages per device in a V" if want == 2 else "one stage per device"
        raise BadInput(f"schedule chunks for kind {kind!r}", f"{want} ({what})", chunks)
    return SCHEDULE_KINDS[kind](num_devices, num_microbatches)
