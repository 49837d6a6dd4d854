"""Incremental replay (`hyperpipe.sim.replay.Replayer.rerun`) against a replay from
scratch: every move `improve` may try (one action moved earlier on its rank), on fixed
kinds' orders with uneven random costs, links and memory budgets, gives the same times
bit for bit, and None exactly where the full replay does (deadlock, over a budget)."""

from __future__ import annotations

import random

import pytest

from hyperpipe.plan.kinds import generate
from hyperpipe.sim.replay import PipeCosts, Replayer, encode_rows


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
    nones = 0
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
        if full is None:
            nones += 1
            continue
        assert fast.times == full.times, (d, i, to)
        assert fast.done_f == full.done_f and fast.done_b == full.done_b
        if rng.random() < 0.3:      # go on from the moved rows, as `improve` does
            codes, state = trial, fast
    assert 0 < nones < 300          # deadlocking moves were among them, not only those
