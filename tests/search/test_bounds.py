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
