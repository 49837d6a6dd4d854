"""Gain attribution: switching the one factor two plans differ in gives the other plan."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.attribution import attribute
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.search.evaluate import Candidate, simulate_one
from hyperpipe.sim.costmodel import CostModel


@pytest.mark.parametrize("field", ["schedule", "micro_batch"])
def test_one_factor_apart_gives_the_other_plans_time(field):
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    cost = CostModel(model, cluster)
    best = uniform_plan(model, cluster, pp=4, micro_batch=1, global_batch=8)
    if field == "schedule":
        other = replace(best, schedule="gpipe")
    else:
        other = uniform_plan(model, cluster, pp=4, micro_batch=2, global_batch=8)
    b, o = (Candidate(p, simulate_one(p, cost)) for p in (best, other))
    gains = {g.factor: g for g in attribute(b, o, "uniform", cost)}
    moved = "schedule kind" if field == "schedule" else "micro-batching"
    assert gains[moved].time_s == pytest.approx(o.metrics.iteration_time_s)
    assert gains[moved].ratio == pytest.approx(o.metrics.iteration_time_s /
                                               b.metrics.iteration_time_s)
    for name, g in gains.items():
        if name != moved:
            assert g.same, name


def synthesised_pick(other_mb: int):
    """(cost, B, O): a tiny-gpt pick synthesised from 1F1B over four stages, and a
    uniform plan of two replicas of two stages at micro-batch `other_mb`, simulated."""
    from hyperpipe.synth.synthesise import POLICIES, synth_plan
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    cost = CostModel(model, cluster)
    fixed = uniform_plan(model, cluster, pp=4, micro_batch=1, global_batch=8)
    best = synth_plan(fixed, cost, POLICIES[0])
    other = uniform_plan(model, cluster, pp=2, dp=2, micro_batch=other_mb, global_batch=8)
    b, o = (Candidate(p, simulate_one(p, cost)) for p in (best, other))
    return cost, b, o


def test_a_synthesised_pick_gets_every_factor_priced():
    """A synth pick's action lists fit its own stages only: the schedule kind's variant
    drops them (and is then exactly O), the others get a schedule synthesised."""
    cost, b, o = synthesised_pick(other_mb=2)
    best = b.plan
    gains = {g.factor: g for g in attribute(b, o, "uniform", cost)}
    for name in ("device choice", "layer partition", "schedule kind", "micro-batching"):
        assert gains[name].time_s is not None, (name, gains[name].note)
    kind_only = replace(best, schedule="1f1b", actions=None)
    assert gains["schedule kind"].time_s == pytest.approx(
        simulate_one(kind_only, cost).iteration_time_s)


def test_a_synthesised_other_gives_the_pick_a_synthesis_for_the_schedule_kind():
    """O synthesised, B not: O's action lists are for O's stages, so "schedule kind"
    (O's choice for B's stages) is a synthesis of B's stages, priced as the search
    prices one (the best of its orders and the fixed kinds); it had read "n/a (not a
    valid plan: ... expected per-device action lists for kind 'synth')"."""
    from hyperpipe.search.attribution import _synthesis_of
    cost, o, b = synthesised_pick(other_mb=2)          # the roles swapped
    gains = {g.factor: g for g in attribute(b, o, "uniform", cost)}
    kind = gains["schedule kind"]
    assert kind.time_s is not None, kind.note
    variant = replace(b.plan, schedule="synth", chunks=o.plan.chunks, actions=None)
    assert kind.time_s == pytest.approx(_synthesis_of(variant, cost)()[0].metrics
                                        .iteration_time_s)


def test_a_synthesised_pick_is_not_resynthesised_for_factors_both_agree_on(monkeypatch):
    """Synthesis is the slow part of the report (24 s of one process at 1,024 GPUs): a
    factor B and O share is reported "same in both" without one."""
    from hyperpipe.search import attribution
    cost, b, o = synthesised_pick(other_mb=1)
    calls = []
    real = attribution._synthesis_of
    monkeypatch.setattr(attribution, "_synthesis_of",
                        lambda plan, c, pool=None: calls.append(plan) or real(plan, c, pool))
    gains = {g.factor: g for g in attribute(b, o, "uniform", cost)}
    assert gains["micro-batching"].same and gains["recompute"].same
    assert not gains["device choice"].same and not gains["layer partition"].same
    assert len(calls) == 2          # device choice and layer partition only


@pytest.mark.parametrize("other_pp", [2, 4])
def test_a_v_placed_pick_gets_valid_device_and_partition_variants(other_pp):
    """A zb-v pick puts stage p with stage p - 1 (a V): the variants that recut its layers
    keep that placement, so they are valid plans of the pick's kind."""
    from hyperpipe.search.attribution import variants
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    cost = CostModel(model, cluster)
    best = uniform_plan(model, cluster, pp=4, micro_batch=1, global_batch=8, schedule="zb-v")
    other = uniform_plan(model, cluster, pp=other_pp, micro_batch=1, global_batch=8)
    got = variants(best, other, "proportional", cost)
    for factor in ("device choice", "layer partition"):
        plan = got[factor]
        assert not isinstance(plan, str), plan
        plan.check(model, cluster)
        assert plan.schedule == "zb-v"
        assert len({st.devices for st in plan.pipelines[0].stages}) == other_pp \
            if factor == "device choice" else 4


def test_the_variants_over_a_pool_are_priced_as_here():
    """The report simulates (and synthesises) its variants over the search's workers:
    the same gains as one process, factor for factor."""
    from hyperpipe.search.backends import process_pool
    cost, b, o = synthesised_pick(other_mb=2)
    here = attribute(b, o, "uniform", cost)
    with process_pool(2) as pool:
        there = attribute(b, o, "uniform", cost, pool)
    assert there == here
    assert sum(g.time_s is not None and not g.same for g in here) >= 3
