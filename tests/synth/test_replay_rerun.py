"""Incremental replay (`hyperpipe.sim.replay.Replayer.rerun`) against a replay from
scratch: every move `improve` may try (one action moved earlier on its rank), on fixed
kinds' orders with uneven random costs, links and memory budgets, gives the same times
bit for bit, and None exactly where the full replay does (deadlock, over a budget); and
some of those reruns stop early (time fewer actions than those that started after the
moved one), so that the copy of what is left is what the comparison checks. With a
limit on the makespan, None exactly where the full replay ends past it."""

from __future__ import annotations

import random

import pytest

from hyperpipe.plan.kinds import generate
from hyperpipe.sim.replay import PipeCosts, Replayer, encode_rows, rows_score


def _costs(rng: random.Random, n_st: int, p: int, tight: bool) -> PipeCosts:
    def draw(lo, hi):
        return tuple(rng.uniform(lo, hi) for _ in range(n_st))
    links = n_st - 1
    budget = tuple(rng.uniform(2.0, 5.0) if tight else 1e9 for _ in range(p))
    return PipeCosts(draw(0.5, 2.0), draw(0.5, 2.0), draw(0.0, 1.5), (1.0,) * n_st,
                     tuple(rng.uniform(0.0, 0.7) for _ in range(links)),
                     tuple(rng.uniform(0.0, 0.7) for _ in range(links)), budget,
                     draw(1.0, 3.0))


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2),
                                    ("zb-v", 2)])
@pytest.mark.parametrize("tight", [False, True])
def test_rerun_equals_a_replay_from_scratch_after_any_move(kind, v, tight):
    rng = random.Random(f"{kind}-{v}-{tight}")
    p, m = 4, 6
    sched = generate(kind, p, m, v)
    c = _costs(rng, p * v, p, tight)
    codes = encode_rows(sched.actions)
    rep = Replayer(c, p, sched.placement, codes)
    state = rep.run(codes)
    if state is None:       # over a budget from the start: loosen it
        c = _costs(rng, p * v, p, False)
        rep = Replayer(c, p, sched.placement, codes)
        state = rep.run(codes)
    nones = early = 0
    total = sum(map(len, codes))
    for _ in range(300):            # random moves: rank d's action i moved to slot `to`
        d = rng.randrange(p)
        row = codes[d]
        i = rng.randrange(1, len(row))
        to = rng.randrange(i)
        new = row[:to] + (row[i],) + row[to:i] + row[i + 1:]
        trial = codes[:d] + [new] + codes[d + 1:]
        full = rep.run(trial)
        fast = rep.rerun(state, trial, d, to)
        assert (full is None) == (fast is None), (d, i, to)
        # with a limit (the old makespan, as `improve` passes): None exactly where the
        # full replay fails or some action of it ends past the limit
        limit = rows_score(state.times).makespan_s
        capped = rep.rerun(state, trial, d, to, limit)
        over = full is None or rows_score(full.times).makespan_s > limit
        assert (capped is None) == over, (d, i, to)
        assert over or capped.times == full.times
        if full is None:
            nones += 1
            continue
        assert fast.times == full.times, (d, i, to)
        assert fast.done_f == full.done_f and fast.done_b == full.done_b
        t0 = state.times[d][to][1]
        kept = sum(1 for e, ts in enumerate(state.times) for x, t in enumerate(ts)
                   if t[1] < t0 and (e != d or x < to))
        early += fast.timed < total - kept
        if rng.random() < 0.3:      # go on from the moved rows, as `improve` does
            codes, state = trial, fast
    assert 0 < nones < 300          # deadlocking moves were among them, not only those
    assert early > 0
