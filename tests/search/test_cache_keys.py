"""Cache keys the search hashes on its hot path: they must name exactly what their
entries depend on (so a hit is the value a fresh computation gives)."""

from __future__ import annotations

import itertools

import pytest

from hyperpipe.cluster.cluster import Link, Nics, link_sig, load_cluster
from hyperpipe.models import load_model
from hyperpipe.search import space
from hyperpipe.search.caches import Placement
from hyperpipe.search.context import SearchContext
from hyperpipe.search.templates import _assign, _position, _ring_cost
from hyperpipe.sim.costmodel import CostModel


def test_link_sig_is_the_numbers_of_the_link():
    assert link_sig(None) is None
    assert link_sig(Link(25e9, 2e-6)) == (25e9, 2e-6)
    assert link_sig(Nics(4, 12.5e9)) == (4, 12.5e9)
    # equal links, distinct objects: one key
    assert link_sig(Link(25e9, 2e-6)) == link_sig(Link(25e9, 2.0e-6))
    assert link_sig(Link(25e9, 2e-6)) != link_sig(Link(25e9, 3e-6))


CLUSTER = {"name": "mixed", "nodes": [
    {"name": "a", "device": "A100-80GB", "count": 8, "repeat": 3,
     "nics": {"count": 1, "bandwidth": "100 Gbit/s"}},
    {"name": "v", "device": "V100-32GB", "count": 8, "repeat": 2,
     "nics": {"count": 4, "bandwidth": "25 Gbit/s"}}]}


@pytest.mark.parametrize("tp", [1, 2])
def test_position_key_names_the_units_and_the_ring(tp):
    """Over every stage order and layout of a few recipes and replica counts: two row
    positions with one `PositionKey` hold the same units in every replica, and the ring
    cached under it is the ring of those units priced afresh."""
    model = load_model("gpt2-medium")
    cluster = load_cluster(CLUSTER)
    ctx = SearchContext(CostModel(model, cluster), space.SearchConstraints(global_batch=64))
    pools = ctx.pools(tp)
    seen: dict = {}
    checked = 0
    for recipe, dp in (({"A100-80GB": 2, "V100-32GB": 1}, 4), ({"A100-80GB": 1,
                       "V100-32GB": 2}, 2), ({"A100-80GB": 3, "V100-32GB": 2}, 2)):
        kinds = [t for t in recipe for _ in range(recipe[t])]
        for order in dict.fromkeys(itertools.permutations(kinds)):
            for layout in space.layouts(dp, recipe):
                slots = _assign(pools, recipe, dp, order, layout)
                placement = Placement(tp, dp, layout, order, tuple(sorted(recipe.items())))
                for d in range(len(order)):
                    units = tuple(row[d] for row in slots)
                    key = _position(placement, d)
                    assert seen.setdefault(key, units) == units
                    cached = ctx.position_rings.memo(key, lambda u=units: _ring_cost(ctx, u))
                    fresh = _ring_cost(SearchContext(CostModel(model, cluster), ctx.c), units)
                    assert cached == pytest.approx(fresh)
                    checked += 1
    assert checked > 50 and len(seen) < checked        # keys shared across placements
