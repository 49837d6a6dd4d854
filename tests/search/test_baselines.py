"""Tuned baselines: the pruned grid walk against an exhaustive one, device subsets."""

from __future__ import annotations

import dataclasses

import pytest
from factories import FREE_LINK as FREE

from hyperpipe.cluster.cluster import cluster_from_dict, load_cluster
from hyperpipe.core.errors import InfeasiblePlan
from hyperpipe.models import load_model
from hyperpipe.search.baselines import (
    BASELINE_SHORT_LIST,
    baseline_grid,
    proportional_plan,
    sketch,
    tuned_baselines,
    uniform_plan,
)
from hyperpipe.search.evaluate import estimate, rank_key
from hyperpipe.search.search import SearchConstraints, search
from hyperpipe.search.templates import PhaseStats, SearchContext
from hyperpipe.sim.costmodel import CostModel


def compute_bound_s(ctx, plan) -> float:
    """Oracle: the busiest device's F + B compute over all its micro-batches, read off
    the built plan (every replica, no cache)."""
    worst = 0.0
    for pipe in plan.pipelines:
        load: dict[str, float] = {}
        for st in pipe.stages:
            load[st.devices[0]] = load.get(st.devices[0], 0.0) + sum(
                ctx.cost.stage_time_s(st.layers, st.devices, pipe.micro_batch, op)
                for op in ("F", "B"))
        worst = max(worst, pipe.num_microbatches * max(load.values()))
    return worst


def state_fits(ctx, plan) -> bool:
    """Oracle: every device's weights, gradients and optimizer state fit it."""
    held: dict[str, float] = {}
    for pipe in plan.pipelines:
        for st in pipe.stages:
            held[st.devices[0]] = held.get(st.devices[0], 0.0) + \
                ctx.cost.state_bytes(st.layers, st.tp)
    return all(b + ctx.cluster.device(d).type.runtime_reserve_bytes
               <= ctx.cluster.device(d).type.memory_bytes for d, b in held.items())


def test_pruned_short_list_is_the_exhaustive_one():
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=16))
    phase = PhaseStats("baselines")
    got = tuned_baselines(ctx, phase)["uniform"]
    assert phase.pruned > 0                      # the bound did cut something
    # oracle: every plan of the grid estimated, no bound
    scored = []
    for _, dims in baseline_grid(ctx):
        try:
            plan = uniform_plan(model, cluster, **dims)
        except Exception:
            continue
        if state_fits(ctx, plan):
            m = estimate(plan, ctx.cost)
            assert compute_bound_s(ctx, plan) <= m.iteration_time_s * (1 + 1e-9)
            scored.append((rank_key(ctx.c, m), plan))
    scored.sort(key=lambda x: x[0])
    best_keys = [k for k, _ in scored[:BASELINE_SHORT_LIST]]
    got_keys = sorted(rank_key(ctx.c, estimate(p, ctx.cost)) for p in got)
    assert [k[1] for k in got_keys] == [k[1] for k in best_keys]


@pytest.mark.parametrize("cluster_name", ["demo-hetero", "straggler", "small-memory"])
def test_sketch_is_what_the_built_plan_gives(cluster_name):
    """Oracle: every grid point built as a plan, its state check and bound computed on
    the plan (every replica), against the sketch (distinct replicas only)."""
    model = load_model("tiny-gpt")
    cluster = load_cluster("demo-hetero")
    if cluster_name == "straggler":       # one slow device: replicas no longer alike
        cluster = _with_straggler(cluster)
    if cluster_name == "small-memory":    # room for the state of about a third of it
        room = CostModel(model, cluster).state_bytes((0, model.num_layers)) / 3
        cluster = dataclasses.replace(cluster, device_types={
            k: dataclasses.replace(t, memory_bytes=t.runtime_reserve_bytes + room)
            for k, t in cluster.device_types.items()})
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=16))
    n, tps, fits = 0, set(), set()
    for name, make in (("uniform", uniform_plan), ("proportional", proportional_plan)):
        for subset, dims in baseline_grid(ctx):
            got = sketch(ctx, name, subset, dims)
            try:
                plan = make(model, cluster, **dims)
            except InfeasiblePlan:
                assert got is None, dims
                continue
            assert got is not None, dims
            n += 1
            tps.add(dims["tp"])
            fits.add(got[0])
            assert got[0] == state_fits(ctx, plan), dims
            assert got[1] == pytest.approx(compute_bound_s(ctx, plan), rel=1e-12), dims
    assert n > 20 and tps == {1, 2}    # tensor-parallel groups compared too
    if cluster_name == "small-memory":
        assert fits == {True, False}


def _with_straggler(cluster):
    first = cluster.nodes[0]
    slow = dataclasses.replace(first, slowdown=(1.0,) * (first.count - 1) + (1.7,))
    return dataclasses.replace(cluster, nodes=(slow, *cluster.nodes[1:]))


def test_tuned_uniform_leaves_a_hopeless_device_type_out():
    # one type 100x slower than the other, free links: any uniform split that uses it
    # is bound by it, so the tuned baseline runs on the fast type alone
    cluster = cluster_from_dict({
        "device_types": {t: {"peak_flops": f"{tf} TFLOP/s", "efficiency": 1.0,
                             "memory": "1000 GB", "mem_bandwidth": "1e15 B/s"}
                         for t, tf in (("fast", 100), ("slow", 1))},
        "nodes": [{"name": "f", "device": "fast", "count": 2, "intra_link": FREE},
                  {"name": "s", "device": "slow", "count": 2, "intra_link": FREE}],
        "inter_node": FREE}, where="test", name="two-speed")
    model = load_model({"kind": "synthetic", "layers": 8,
                             "fwd_flops_per_sample": 1e12, "activation_bytes_per_sample": 0,
                             "params_per_layer": 0, "name": "syn"})
    res = search(model, cluster, SearchConstraints(global_batch=8))
    for name in ("uniform", "proportional"):
        devices = res.baselines[name].plan.devices
        assert devices and all(d.startswith("f/") for d in devices), (name, devices)
    # the search's pick is its own, judged by the same simulator as the baselines
    assert res.best.metrics.iteration_time_s <= \
        min(c.metrics.iteration_time_s for c in res.baselines.values()) * 1.001


def _tight(model, cluster, share: float):
    """`cluster` with each device's room (beyond its reserve) `share` x the model's
    whole state: stages fit by their state, many not with their stashes."""
    room = CostModel(model, cluster).state_bytes((0, model.num_layers)) * share
    return dataclasses.replace(cluster, device_types={
        k: dataclasses.replace(t, memory_bytes=t.runtime_reserve_bytes + room)
        for k, t in cluster.device_types.items()})


@pytest.mark.parametrize("share", [0.6, 0.3])
def test_short_list_with_plans_out_of_memory_is_the_exhaustive_one(share):
    """Plans the analytic tier puts out of memory are estimated only when fewer than
    BASELINE_SHORT_LIST plans fit; the short list is the exhaustive walk's either way
    (oracle: every grid point built and estimated, ranked by `rank_key`, ties to the
    earlier bound). At share 0.3 none fits: plans out of memory fill it."""
    model = load_model("tiny-gpt")
    cluster = _tight(model, load_cluster("demo-hetero"), share)
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=16))
    for name, make in (("uniform", uniform_plan), ("proportional", proportional_plan)):
        phase = PhaseStats("baselines")
        got = tuned_baselines(ctx, phase, (name,)).get(name, [])
        scored = []
        for subset, dims in baseline_grid(ctx):
            sk = sketch(ctx, name, subset, dims)
            if sk is None or not sk[0]:
                continue
            plan = make(model, cluster, **dims)
            scored.append((rank_key(ctx.c, estimate(plan, ctx.cost)), sk[1], plan))
        scored.sort(key=lambda x: (x[0], x[1]))
        want = [k for k, _, _ in scored[:BASELINE_SHORT_LIST]]
        fitting = sum(1 for k, _, _ in scored if not k[0])
        assert any(k[0] for k, _, _ in scored)        # some plans are out of memory
        assert (fitting >= BASELINE_SHORT_LIST) == (share == 0.6), fitting
        assert [rank_key(ctx.c, estimate(p, ctx.cost)) for p in got] == want, name


@pytest.mark.parametrize("model_name,share", [("tiny-gpt", 0.6), ("tiny-gpt", 1.0),
                                              ("tiny-moe", 0.6)])
def test_stashes_that_do_not_fit_in_the_sketch_are_out_of_memory(model_name, share):
    """`stashes_fit` is False only where the analytic tier puts the built plan out of
    memory (oracle: `estimate`'s `oom` on every grid point, every schedule kind), and it
    does say so for some."""
    from hyperpipe.search.baselines import stashes_fit
    model = load_model(model_name)
    cluster = _tight(model, load_cluster("demo-hetero"), share)
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=16))
    said, kinds = set(), set()
    for name, make in (("uniform", uniform_plan), ("proportional", proportional_plan)):
        for subset, dims in baseline_grid(ctx):
            got = sketch(ctx, name, subset, dims)
            if got is None or not got.fits:
                continue
            fit = stashes_fit(ctx, got, dims)
            said.add(fit)
            kinds.add(dims["schedule"])
            if not fit:
                assert estimate(make(model, cluster, **dims), ctx.cost).oom, dims
    assert said == {True, False} and {"zb-v", "1f1b", "gpipe"} <= kinds


def test_too_few_devices_names_the_context_parallel_degree():
    """pp 2 x dp 2 x cp 2 on four devices: the refusal counts cp as cp (it had printed
    "pp x dp x tp = 2 x 2 x 2" for tp 1)."""
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    with pytest.raises(InfeasiblePlan, match=r"pp x dp x tp x cp = 2 x 2 x 1 x 2 = 8 "
                                             r"devices needed, 4 available"):
        uniform_plan(model, cluster, pp=2, dp=2, cp=2, micro_batch=4, global_batch=32)
