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


@pytest.mark.parametrize("slow", ["links", "nics"])
def test_a_context_ring_over_nodes_is_keyed_by_its_links(slow):
    """Two context-parallel groups of two single-device nodes, one whose nodes talk over
    a slow path (a region link, or slow NICs), one over fast NICs: their tables differ
    (29 s against 0.48 s of forward for GPT-3 1.3B at cp 2), so their keys differ, and
    each table read from a context that priced the other first is the one a fresh
    context prices (before, the first group priced set both: their key held only the
    count of nodes spanned)."""
    from hyperpipe.cluster.cluster import cluster_from_dict
    from hyperpipe.search.search import SearchConstraints
    from hyperpipe.search.space import MemoryMode
    fast = {"device": "A100-80GB", "count": 1,
            "nic": {"bandwidth": "100 Gbit/s", "latency": "5 us"}}
    slow_node = {**fast, "nic": {"bandwidth": "1 Gbit/s", "latency": "20 ms"}} \
        if slow == "nics" else fast
    doc = {"name": "cp", "nodes": [{"name": "a", "region": "eu", "repeat": 2, **slow_node},
                                   {"name": "b", "region": "us", "repeat": 2, **fast}]}
    if slow == "links":
        doc["links"] = [{"between": ["eu", "eu"], "bandwidth": "1 Gbit/s",
                         "latency": "20 ms"}]
    cluster = cluster_from_dict(doc, where="cp", name="cp")
    model, c, mode = load_model("gpt3-1.3b"), SearchConstraints(global_batch=8), \
        MemoryMode(cp=2)
    groups = (("a0/0", "a1/0"), ("b0/0", "b1/0"))

    def fwd(ctx, group):
        return float(ctx.table_of(ctx.table_key(group, 1, mode), group).fwd_s.sum())

    fresh = {g: fwd(SearchContext(CostModel(model, cluster), c), g) for g in groups}
    assert fresh[groups[0]] > 10 * fresh[groups[1]]
    for order in (groups, groups[::-1]):
        shared = SearchContext(CostModel(model, cluster), c)
        assert {g: fwd(shared, g) for g in order} == fresh
