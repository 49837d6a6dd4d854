"""Generators of the looped schedule kinds, and their closed forms of stashes in flight.

Each generator is a pure function of p (pipeline ranks), m (micro-batches) and, for
interleaved 1F1B, v (chunks: stages per rank, looped placement, stage k on rank k % p),
returning a new `Schedule`. Each `*_peak` function is the closed form of the most
(stage, micro-batch) stashes a rank holds at once under that generator's order,
``(p, m, v, rank) -> count``, counted from an F until its B (or its W when the backward
is split). Timings quoted below take F = I = W = t (so B = 2t) and free links.
"""

from __future__ import annotations

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


def interleaved_round(p: int, m: int) -> int:
    """Micro-batches per round of `interleaved_1f1b`: torch's flexible rounds
    (ScheduleInterleaved1F1B: max(1, m // p) rounds of m / that each, where that count
    divides m; so p when p divides m), else p, m being padded to a multiple of p."""
    rounds = max(1, m // p)
    return m // rounds if m % rounds == 0 else p


def interleaved_built(p: int, m: int) -> int:
    """Micro-batches `interleaved_1f1b` builds for m: m in torch's flexible rounds, else
    m rounded up to a multiple of p (phantoms dropped after)."""
    size = interleaved_round(p, m)
    return -(-m // size) * size


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021) with v chunks per rank.

    Forwards go in rounds of r micro-batches through chunks 0..v-1; backwards visit the
    same rounds with the chunks reversed. Rank d runs (v - 1) r + 2 (p - 1 - d) warmup
    forwards (v = 1: 1F1B's p - 1 - d, so v = 1 gives exactly `one_f_one_b`), then
    alternates F and B, then drains. r is `interleaved_round`: p where p divides m,
    else torch's flexible rounds of more than p, so that with v > 1 the order is
    torch's ScheduleInterleaved1F1B's wherever torch builds one.

    Where torch builds none (the rounds would not divide m), the order is built for m
    rounded up to a multiple of p and the phantom micro-batches' actions are dropped,
    leaving a smaller last round. That keeps it deadlock-free: the dropped actions
    depend only on each other, so the original run order minus them is still a valid
    run order. (Simply shortening the last round deadlocks, e.g. p=4, m=5, v=3.) With
    p | m the makespan is 3 m v t + 3 (p - 1) t, t being one chunk's forward time and
    B = 2t.
    """
    size = interleaved_round(p, m)
    built = interleaved_built(p, m)
    rounds = [range(start, start + size) for start in range(0, built, size)]
    order = [(c, mb) for rnd in rounds for c in range(v) for mb in rnd]
    back = [(c, mb) for rnd in rounds for c in reversed(range(v)) for mb in rnd]
    total = built * v
    rows = []
    for d in range(p):
        warmup = (v - 1) * size + 2 * (p - 1 - d) if v > 1 else p - 1 - d
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


def gpipe_peak(p: int, m: int, v: int, rank: int) -> int:
    """GPipe stashes every micro-batch before its first backward: m."""
    return m


def one_f_one_b_peak(p: int, m: int, v: int, rank: int) -> int:
    """1F1B: its warmup plus the one in flight, min(p - rank, m)."""
    return min(p - rank, m)


def interleaved_1f1b_peak(p: int, m: int, v: int, rank: int) -> int:
    """Interleaved 1F1B: the warmup (v - 1) r + 2 (p - 1 - rank) forwards plus one, r
    its round (`interleaved_round`), at most m v (exact in torch's rounds, an upper
    bound with padded ones); 1F1B's when v = 1."""
    if v > 1:
        return min((v - 1) * interleaved_round(p, m) + 2 * (p - 1 - rank) + 1, m * v)
    return one_f_one_b_peak(p, m, v, rank)


def zb_h1_peak(p: int, m: int, v: int, rank: int) -> int:
    """ZB-H1 counts a micro-batch until its W, which the generator defers by `rank` steps:
    min(p, m)."""
    return min(p, m)
