"""`bounds.LayerCaps`: the vectorised per-position capacity against its scalar rule."""

from __future__ import annotations

import numpy as np

from hyperpipe.search.bounds import LayerCaps


def _layers_that_fit(caps: LayerCaps, inflight: int, extra: int) -> int:
    """The rule one position at a time: sort the layers by state plus `inflight`
    stashes, sum them in that order, count the sums within the room less `extra`
    stashes of the smallest layer."""
    need = np.cumsum(np.sort(caps.state_bytes + inflight * caps.stash_bytes))
    room = caps.room_bytes - extra * float(caps.stash_bytes.min(initial=0.0))
    return int(np.searchsorted(need, room, side="right"))


def test_memory_at_equals_the_rule_per_position():
    """`memory_at` (every position at once) against the rule one position at a time,
    on random layer tables, rooms and in-flight counts, ties and empty rooms included."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 60))
        state = rng.random(n) * 1e9
        stash = rng.random(n) * 1e8
        if trial % 5 == 0:
            state[: n // 2] = state[0]          # ties in the sort
        caps = LayerCaps(np.cumsum(rng.random(n)), 1.0, state, stash,
                         float(rng.random() * 3e10) - (1e9 if trial % 7 == 0 else 0.0), 0)
        held = tuple((int(rng.integers(0, 40)), int(rng.integers(0, 20)))
                     for _ in range(int(rng.integers(1, 30))))
        assert list(caps.memory_at(held)) == [_layers_that_fit(caps, h, x) for h, x in held]


def test_least_load_is_the_first_step_of_the_union_that_holds_the_layers():
    """`bounds._least_load_s` (bisection per class) against the plain rule: every step
    of every class's time prefix, in order, the first at which the units hold n layers
    (sum over classes and rooms r_j of min(layers in time, r_j)), else the last step."""

    from hyperpipe.search import bounds as B
    rng = np.random.default_rng(11)
    for _ in range(400):
        n_layers = int(rng.integers(2, 30))
        caps, room = {}, {}
        for t in range(int(rng.integers(1, 4))):
            times = np.round(rng.uniform(0.5, 3.0, n_layers), int(rng.integers(0, 3)))
            prefix = np.cumsum(np.sort(times))
            caps[f"c{t}"] = B.LayerCaps(prefix, 1.0, np.zeros(n_layers), np.zeros(n_layers),
                                        1.0, 0)
            room[f"c{t}"] = rng.integers(0, n_layers + 1, int(rng.integers(1, 6)))
        need = int(rng.integers(1, 2 * n_layers))
        steps = sorted({float(x) for c in caps.values() for x in c.time_prefix_s})
        want = steps[-1]
        for s in steps:
            held = sum(min(int(np.searchsorted(caps[t].time_prefix_s, s * (1 + 1e-12),
                                                  side="right")), int(r))
                       for t in caps for r in room[t])
            if held >= need:
                want = s
                break
        assert B._least_load_s(caps, room, need) == want


def test_greedy_reach_is_the_brute_force_over_every_cut():
    """`bounds._reaches` (greedy stages, each taking all it may) against every cut of n
    layers into the stages: some cut, its stages maybe empty, keeps every stage within
    the time budget and its room exactly when the greedy walk holds all n layers; so
    when it does not, no cut of at least one layer per stage does either."""
    import itertools

    from hyperpipe.search import bounds as B
    rng = np.random.default_rng(5)
    hits = 0
    for _ in range(500):
        n = int(rng.integers(1, 9))
        stages = int(rng.integers(1, 5))
        rows = []
        for _ in range(stages):
            times = np.round(rng.uniform(0.1, 2.0, n), 1)
            use = np.round(rng.uniform(0.0, 3.0, n), 1)
            rows.append(B.ProbeRow(np.concatenate([[0.0], np.cumsum(times)]).tolist(),
                                   np.concatenate([[0.0], np.cumsum(use)]).tolist(),
                                   float(rng.choice([0.0, 0.3])), float(rng.uniform(1, 8))))
        budget = float(rng.uniform(0.5, 6.0))

        loose = _some_cut_fits(rows, n, budget, itertools.combinations_with_replacement(
            range(n + 1), stages - 1))
        strict = _some_cut_fits(rows, n, budget,
                                itertools.combinations(range(1, n), stages - 1))
        assert B._reaches(rows, n, budget) == loose
        assert loose or not strict
        hits += loose
    assert 50 < hits < 450            # both answers came up often


def _some_cut_fits(rows, n: int, budget: float, cuts) -> bool:
    """Whether one of `cuts` (inner cut points of n layers) keeps every stage within
    `budget` seconds and its room."""
    import itertools

    def fits(r, a: int, b: int) -> bool:
        return (r.time_prefix_s[b] - r.time_prefix_s[a] + r.actions_s <= budget
                and r.use_prefix_bytes[b] - r.use_prefix_bytes[a] <= r.room_bytes)
    return any(all(fits(rows[k], a, b) for k, (a, b) in
                   enumerate(itertools.pairwise((0, *c, n)))) for c in cuts)
