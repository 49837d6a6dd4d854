"""`bounds.LayerCaps`: the vectorised per-position capacity against its scalar rule."""

from __future__ import annotations

import numpy as np

from hyperpipe.search.bounds import LayerCaps


def test_memory_at_equals_memory_per_position():
    """`memory_at` (every position at once) against `memory` one position at a time
    (sort, prefix sums, searchsorted), on random layer tables, rooms and in-flight
    counts, ties and empty rooms included."""
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
        assert list(caps.memory_at(held)) == [caps.memory(h, x) for h, x in held]
