"""Local improvement of synthesised orders (`hyperpipe.synth.improve`).

Oracles: test_schedule's unit-time recurrence (written apart from the replay here) for
the fixed kinds' orders, the IR validator, and the stash count per rank.
"""

from __future__ import annotations

import pytest
from oracles import makespan, oracle_times, unit_costs

from hyperpipe.plan.kinds import generate
from hyperpipe.plan.schedule import Schedule, validate
from hyperpipe.sim.replay import PipeCosts, replay
from hyperpipe.synth.improve import improve


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2),
                                    ("zb-v", 2), ("dualpipe-v", 2)])
@pytest.mark.parametrize("p", [2, 4])
def test_replay_times_equal_the_unit_time_oracle(kind, v, p):
    s = generate(kind, p, 2 * p, v)
    timing = replay(unit_costs(p * v, p), s.actions, s.placement)
    oracle = oracle_times(s)
    assert timing is not None
    assert set(timing) == set(oracle)
    for a, (_, start, end) in timing.items():
        assert (start, end) == pytest.approx(oracle[a]), a


def peak_stashes(rows) -> list[int]:
    out = []
    for row in rows:
        live = peak = 0
        for a in row:
            live += 1 if a.op == "F" else -1 if a.op in "WB" else 0
            peak = max(peak, live)
        out.append(peak)
    return out


@pytest.mark.parametrize("budget", [(1e9,) * 4, (4.0, 3.0, 2.0, 2.0)])
def test_improve_never_lengthens_and_keeps_valid_orders_within_memory(budget):
    p, m = 4, 8
    c = unit_costs(p, p)
    c = PipeCosts(c.f_s, c.i_s, (0.5, 2.0, 1.0, 1.5), c.stash_bytes, c.fwd_link_s,
                  c.bwd_link_s, budget)
    start = generate("1f1b", p, m)
    before = replay(c, start.actions, "loop")
    rows, spent = improve(c, start.actions, "loop", budget=200)
    after = replay(c, rows, "loop")
    assert 1 <= spent <= 200 and after is not None
    end = max(e for _, _, e in after.values())
    assert end <= max(e for _, _, e in before.values()) + 1e-12
    validate(Schedule("synth", p, p, m, rows))
    assert all(n <= b for n, b in zip(peak_stashes(rows), budget, strict=True))
    if budget[0] > 1e6:      # 1F1B's order splits no W off: moving W's earlier must pay
        assert end < max(e for _, _, e in before.values())


def test_replay_refuses_orders_over_budget_or_deadlocked():
    p, m = 2, 2
    c = unit_costs(p, p)
    s = generate("gpipe", p, m)                    # both F's before any backward: 2 stashes
    tight = PipeCosts(c.f_s, c.i_s, c.w_s, c.stash_bytes, c.fwd_link_s, c.bwd_link_s,
                      (1.0, 2.0))
    assert replay(tight, s.actions, "loop") is None
    rows = (s.actions[0], tuple(reversed(s.actions[1])))   # a backward before its forward
    assert replay(c, rows, "loop") is None
    assert makespan(s) == max(e for _, _, e in replay(c, s.actions, "loop").values())
