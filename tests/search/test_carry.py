"""`SearchContext.carry_from`: a search of a cluster less a node, given the caches of
the whole cluster's search, finds exactly what it finds without them, and the caches
are refused wherever they might not hold."""

from __future__ import annotations

import pytest

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.search import context
from hyperpipe.search import templates as T
from hyperpipe.search.caches import BookKey
from hyperpipe.search.context import PhaseStats, SearchContext
from hyperpipe.search.space import SearchConstraints
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.whatif.failures import without_node

MIX = {"name": "mix", "nodes": [
    {"name": "a", "device": "A100-80GB", "count": 4, "repeat": 3},
    {"name": "v", "device": "V100-32GB", "count": 4, "repeat": 2}],
    "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}}


def _ctx(model, cluster, batch: int = 32) -> SearchContext:
    return SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=batch))


def _templates(ctx: SearchContext) -> dict:
    T.templates_phase(ctx, PhaseStats("t"), False, None)
    return dict(ctx.book)


def test_carried_caches_give_the_templates_of_a_fresh_search():
    """Phase 1 on the cluster less a node, after phase 1 on the whole cluster: with the
    carried caches the same templates (every field) as without, while most of the cuts
    it asks for are found in them; the templates of the group whose class lost no node
    (the V100s) are carried, not cut again, and no group with the A100s is."""
    model, full = load_model("gpt2-medium"), load_cluster(MIX)
    small = without_node(full, "a0")
    whole = _ctx(model, full)
    _templates(whole)
    warm = _ctx(model, small)
    assert warm.carry_from(whole)
    carried = len(warm.cuts)
    assert carried == len(whole.cuts) > 0
    assert list(warm.book) == [BookKey(("V100-32GB",), None)]
    assert warm.book[BookKey(("V100-32GB",), None)]
    got = _templates(warm)
    cold = _ctx(model, small)
    want = _templates(cold)
    # (repr: no price is NaN, != itself)
    assert {k: repr(v) for k, v in got.items()} == {k: repr(v) for k, v in want.items()}
    assert want
    # the cuts it asked for: the cold search's; those it had to make: the new entries
    made = len(warm.cuts) - carried
    assert made < len(cold.cuts)


@pytest.mark.parametrize("change", ["class", "moe", "constraints", "node"])
def test_caches_are_refused_where_they_might_not_hold(change):
    """A class of the same name but another kind of node, a model with MoE blocks,
    other constraints, a node the old cluster lacks: nothing is carried."""
    model, full = load_model("gpt2-medium"), load_cluster(MIX)
    whole = _ctx(model, full)
    _templates(whole)
    other = dict(MIX)
    if change == "class":      # "A100-80GB" now names nodes of two devices each
        other["nodes"] = [{**MIX["nodes"][0], "count": 2}, MIX["nodes"][1]]
        new = _ctx(model, load_cluster(other))
    elif change == "node":     # a third V100 node
        other["nodes"] = [MIX["nodes"][0], {**MIX["nodes"][1], "repeat": 3}]
        new = _ctx(model, load_cluster(other))
    elif change == "moe":      # (the caches need not even be filled to be refused)
        moe = load_model("mixtral-8x7b")
        whole = _ctx(moe, full)
        whole.tables.update({"filled": None})
        new = _ctx(moe, without_node(full, "a0"))
    else:
        new = SearchContext(CostModel(model, without_node(full, "a0")),
                            SearchConstraints(global_batch=64))
    assert not new.carry_from(whole)
    assert not new.tables and not new.cuts and not new.row_cuts


def test_a_worker_carries_its_last_context_over(monkeypatch):
    """`worker_context` for a cluster less a node, in a worker whose last context was the
    whole cluster's: a new context (its own inputs) that starts with the old caches."""
    monkeypatch.setattr(context, "_last_context", [])
    model, full = load_model("gpt2-medium"), load_cluster(MIX)
    c = SearchConstraints(global_batch=32)
    first = context.worker_context(model, full, None, c)
    _templates(first)
    small = without_node(full, "a0")
    second = context.worker_context(model, small, None, c)
    assert second is not first and second.cluster == small
    assert second.cuts == first.cuts and second.cuts
    assert context.worker_context(model, small, None, c) is second


def test_failure_study_over_one_pool_is_the_one_without_it():
    """`whatif --failures` with two workers runs both searches on one pool, the re-plan
    on caches carried over: the same study (today's plan, its table, the re-plan) as
    with one process."""
    from hyperpipe.whatif.failures import FailureOptions, failure_whatif
    from hyperpipe.whatif.variants import Planning
    model = load_model("gpt2-medium")
    cluster = load_cluster({**MIX, "nodes": [{**n, "mtbf": "3 days"} for n in MIX["nodes"]]})
    studies = [failure_whatif(model, cluster, FailureOptions(
        Planning(global_batch=32, workers=workers), restart_s=600.0, write_s=30.0))
        for workers in (1, 2)]
    one, two = (s.to_dict() for s in studies)
    assert one == two
    assert studies[0].replan is not None and studies[0].failed_node == "a0"


def test_a_search_carried_from_the_whole_clusters_is_the_search_without():
    """`search(carry=...)` on the cluster less a node, from the whole cluster's search:
    the same ranking (plans and simulated metrics) as a search of its own, with fewer
    templates walked (the V100 group's are carried)."""
    from hyperpipe.search.search import search
    model, full = load_model("gpt2-medium"), load_cluster(MIX)
    small = without_node(full, "a0")
    c = SearchConstraints(global_batch=32)
    first = search(model, full, c, top=3, peers=False, keep_context=True)
    warm = search(model, small, c, top=3, peers=False, carry=first)
    cold = search(model, small, c, top=3, peers=False)
    assert [(x.plan, x.metrics) for x in warm.ranked] == \
        [(x.plan, x.metrics) for x in cold.ranked]
    assert warm.phases[0]["seen"] < cold.phases[0]["seen"]
    # only a result searched with keep_context holds the caches; carrying from one
    # without them is a search of its own
    assert warm.context is None and cold.context is None
    bare = search(model, small, c, top=3, peers=False, carry=warm)
    assert bare.phases[0]["seen"] == cold.phases[0]["seen"]


def test_the_failure_studys_replan_starts_from_the_first_searchs_caches(monkeypatch):
    """`whatif --failures` keeps its first search's context and hands it to the re-plan
    (`search(keep_context=True)`, then `carry`), so the re-plan walks fewer templates."""
    from hyperpipe.whatif import failures
    from hyperpipe.whatif.failures import FailureOptions, failure_whatif
    from hyperpipe.whatif.variants import Planning
    calls = []
    real = failures.search

    def recording(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append((kwargs.get("carry"), result))
        return result

    monkeypatch.setattr(failures, "search", recording)
    cluster = load_cluster({**MIX, "nodes": [{**n, "mtbf": "3 days"} for n in MIX["nodes"]]})
    failure_whatif(load_model("gpt2-medium"), cluster, FailureOptions(
        Planning(global_batch=32), restart_s=600.0, write_s=30.0))
    (none, first), (carried, replan) = calls
    assert none is None and carried is first and first.context is not None
    assert replan.context is None
