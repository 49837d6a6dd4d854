"""What synthesis leaves unsimulated (`order_bound_s`, `known`) changes nothing.

Oracles: the simulator's price of every order synthesis builds (the bound must be
below it), and synthesis with every candidate simulated (the same winner, times and
fixed kind)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import hyperpipe.synth.synthesise as S
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate


# uneven stages of two device types over real, shared links, tensor parallelism among them
def replace_schedule(plan, kind):
    return replace(plan, schedule=kind, actions=None)


CASES = [("gpt2-medium", "a100-v100", 4, 1, "1f1b"), ("gpt2-medium", "a100-v100", 4, 2, "1f1b"),
         ("gpt2-medium", "a100-v100", 4, 1, "interleaved-1f1b"),
         ("tiny-gpt", "demo-hetero", 2, 1, "zb-v")]


def _plan(model_name, cluster_name, pp, tp, kind):
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    cost = CostModel(model, cluster)
    devs = [d.name for d in cluster.devices]
    devs = devs[::max(1, len(devs) // (pp * tp))][:pp * tp] if tp == 1 else devs[:pp * tp]
    chunks = 2 if kind in ("interleaved-1f1b", "zb-v") else None
    plan = uniform_plan(model, cluster, pp=pp, micro_batch=2, global_batch=32, tp=tp,
                        schedule=kind, chunks=chunks, devices=devs)
    return plan, cost


@pytest.mark.parametrize("case", CASES)
def test_order_bound_is_below_the_simulated_time_of_every_order(case):
    plan, cost = _plan(*case)
    costs = [S.pipe_costs(plan, cost, q) for q in range(len(plan.pipelines))]
    orders = [replace_schedule(plan, k) for k in S.fixed_kinds(plan)]
    orders += [o for pol in S.POLICIES if (o := S.synth_plan(plan, cost, pol, costs))]
    assert len(orders) > 4
    for order in orders:
        bound = S.order_bound_s(order, S.bound_costs(plan, cost, costs))
        sim = simulate(order, cost, SimOptions(trace=False)).metrics.iteration_time_s
        assert 0.5 * sim < bound <= sim * (1 + 1e-9), order.schedule


@pytest.mark.parametrize("case", CASES)
def test_synthesis_with_pruning_and_known_kinds_equals_simulating_everything(
        case, monkeypatch):
    plan, cost = _plan(*case)
    pruned = S.synthesise(plan, cost)
    kind = S.fixed_kinds(plan)[0]
    known = {kind: simulate(replace_schedule(plan, kind), cost,
                            SimOptions(trace=False)).metrics}
    reused = S.synthesise(plan, cost, known=known)
    monkeypatch.setattr(S, "order_bound_s", lambda plan, lower: 0.0)
    full = S.synthesise(plan, cost)
    for got in (pruned, reused):
        assert got.plan == full.plan and got.metrics == full.metrics
        assert (got.fixed_kind, got.fixed_time_s, got.synth_time_s, got.policy) == \
            (full.fixed_kind, full.fixed_time_s, full.synth_time_s, full.policy)
    assert reused.candidates == pruned.candidates - 1
    assert pruned.candidates <= full.candidates
    if case == CASES[1]:        # the bound prunes here (13 orders simulated without it)
        assert pruned.candidates < full.candidates


def test_order_bound_holds_where_transfers_split_over_tensor_parallel_ranks():
    """tp 4 stages over a 25 Gbit/s link: the simulator sends a stage's output as four
    streams (`network.p2p_edges`), so the whole tensor's time on one edge (the list
    scheduler's link time) would put the replay above the simulated 1F1B; the bound's
    own link times (`bound_costs`) keep it below every order, and so does
    `schedule_bound_s` (the bound on any order of these stages)."""
    from hyperpipe.cluster.cluster import cluster_from_dict
    from hyperpipe.search.baselines import proportional_plan
    doc = {"nodes": [{"name": "a", "device": "A100-40GB", "count": 8, "repeat": 2},
                     {"name": "v", "device": "V100-32GB", "count": 8, "repeat": 2}],
           "inter_node": {"bandwidth": "25 Gbit/s", "latency": "10 us"}}
    cluster = cluster_from_dict(doc, where="test", name="slow-link")
    model = load_model("llama2-13b")
    cost = CostModel(model, cluster)
    plan = proportional_plan(model, cluster, global_batch=64, schedule="1f1b", pp=8, dp=1,
                             tp=4, micro_batch=1)
    costs = [S.pipe_costs(plan, cost, q) for q in range(len(plan.pipelines))]
    lower = S.bound_costs(plan, cost, costs)
    orders = [replace_schedule(plan, k) for k in S.fixed_kinds(plan)]
    orders += [o for pol in S.POLICIES if (o := S.synth_plan(plan, cost, pol, costs))]
    from hyperpipe.search.context import SearchContext
    from hyperpipe.search.search import SearchConstraints
    from hyperpipe.search.synthesis import schedule_bound_s
    any_order = schedule_bound_s(SearchContext(cost, SearchConstraints(global_batch=64)), plan)
    for order in orders:
        sim = simulate(order, cost, SimOptions(trace=False)).metrics.iteration_time_s
        assert S.order_bound_s(order, lower) <= sim * (1 + 1e-9), order.schedule
        assert any_order <= sim * (1 + 1e-9), order.schedule
    whole = [replace(c, budget_bytes=(float("inf"),) * len(c.budget_bytes)) for c in costs]
    sim = simulate(plan, cost, SimOptions(trace=False)).metrics.iteration_time_s
    assert S.order_bound_s(plan, whole) > sim


@pytest.mark.parametrize("case", CASES[:2])
def test_fixed_kinds_above_the_best_known_one_are_not_simulated(case, monkeypatch):
    # the caller knows the fastest fixed kind (zb-h1 here): the kinds whose order bound
    # is above it are left unsimulated, and the result is the same as simulating them
    plan, cost = _plan(*case)
    opts = SimOptions(trace=False)
    times = {k: simulate(replace_schedule(plan, k), cost, opts).metrics
             for k in S.fixed_kinds(plan)}
    fastest = min(times, key=lambda k: times[k].iteration_time_s)
    known = {fastest: times[fastest]}
    pruned = S.synthesise(plan, cost, known=known)
    monkeypatch.setattr(S, "order_bound_s", lambda plan, lower: 0.0)
    full = S.synthesise(plan, cost, known=known)
    assert pruned.plan == full.plan and pruned.metrics == full.metrics
    assert (pruned.fixed_kind, pruned.fixed_time_s) == (full.fixed_kind, full.fixed_time_s)
    assert pruned.fixed_kind == fastest
    # every other fixed kind is simulated without the bound, none with it
    assert full.candidates - pruned.candidates >= len(times) - 1


def test_synthesis_spread_over_a_pool_equals_one_process():
    """`search.synthesis.synthesise_all` runs each synthesis over a worker pool as its
    policies in parts, its fixed kinds, then the improvement of the parts' best; oracle:
    `synthesise` in this process,
    plan by plan (the same winners, metrics, times, fixed kinds, policies and best
    synthesised orders). One call with several plans, one with a fixed kind known."""
    from hyperpipe.search.backends import process_pool
    from hyperpipe.search.context import SearchContext
    from hyperpipe.search.search import SearchConstraints
    from hyperpipe.search.synthesis import synthesise_all
    by_model: dict = {}
    for case in CASES:
        plan, cost = _plan(*case)
        by_model.setdefault(case[:2], (cost, []))[1].append(plan)
    winners = set()
    with process_pool(2) as pool:
        for cost, plans in by_model.values():
            ctx = SearchContext(cost, SearchConstraints(global_batch=32))
            first = S.fixed_kinds(plans[0])[0]
            known = {first: simulate(replace_schedule(plans[0], first), cost,
                                     SimOptions(trace=False)).metrics}
            items = [(p, known if i == 0 else None) for i, p in enumerate(plans)]
            spread = synthesise_all(ctx, items, pool)
            for (plan, kn), got in zip(items, spread, strict=True):
                one = S.synthesise(plan, cost, known=kn)
                assert got.plan == one.plan and got.metrics == one.metrics
                assert (got.fixed_kind, got.fixed_time_s, got.synth_time_s, got.policy) == \
                    (one.fixed_kind, one.fixed_time_s, one.synth_time_s, one.policy)
                assert got.synth_plan == one.synth_plan
                assert got.candidates >= one.candidates
                winners.add(got.plan.schedule == "synth")
    assert winners == {True, False}          # both a synthesised and a fixed winner
