"""ZeRO-2/3 (FSDP) against closed forms: the overlapped gather/compute/scatter pass,
state bytes per device over the data-parallel group, the unsharded working set, the
bytes the step-end sync moves, the time a gather adds to an action, and the analytic
tier against the simulator on ZeRO plans."""

from __future__ import annotations

from dataclasses import replace

import pytest
from factories import assert_analytic_matches_simulator, cluster_doc, device_type, synthetic_model

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.sharding import (
    FirstForward,
    FsdpCost,
    fill_delay_s,
    first_forwards,
    first_gather,
    fsdp_extra_s,
    overlapped_pass_s,
    shard_group,
    stage_waits,
)
from hyperpipe.sim.simulator import SimOptions, simulate

FLOPS = 1e12
LAYER_FLOPS = 1e9            # per sample per layer: 1 ms of F, I and W each


def _unit_cluster(devices: int, bandwidth: float = 1e30):
    link = {"bandwidth": bandwidth, "latency": 0.0}
    return load_cluster(cluster_doc(
        {"unit": device_type(FLOPS)},
        [("n0", "unit", devices)], intra_link=link, inter_node=link, name="unit"))


@pytest.mark.parametrize("n,t,g,r", [(5, 1.0, 0.3, 0.2), (8, 2.0, 1.0, 1.0),
                                     (3, 1.0, 0.0, 0.0)])
def test_overlapped_pass_hides_communication_under_compute(n, t, g, r):
    # g + r <= t: only the first gather and the last scatter show
    assert overlapped_pass_s([t] * n, [g] * n, [r] * n) == pytest.approx(g + n * t + r)


@pytest.mark.parametrize("n,t,g", [(4, 1.0, 3.0), (6, 0.5, 2.0)])
def test_overlapped_pass_bound_by_gathers(n, t, g):
    # communication-bound, no scatters: n gathers back to back, then the last compute
    assert overlapped_pass_s([t] * n, [g] * n, [0.0] * n) == pytest.approx(n * g + t)


def test_overlapped_pass_never_beats_either_stream():
    compute, gather, scatter = [1.0, 3.0, 0.5, 2.0], [0.7, 2.5, 0.1, 1.0], [0.2, 0.4, 2.0, 0.3]
    total = overlapped_pass_s(compute, gather, scatter)
    assert total >= sum(compute) + gather[0]
    assert total >= sum(gather) + sum(scatter)
    assert total <= sum(compute) + sum(gather) + sum(scatter)


def _gpt_plan(zero: int, dp: int = 4, **runtime):
    model = load_model("tiny-gpt")              # fp32: 8 + 8 bytes per parameter
    cluster = _unit_cluster(dp)
    plan = uniform_plan(model, cluster, pp=1, dp=dp, micro_batch=1, global_batch=dp)
    plan = plan.with_memory(zero=zero)
    if runtime:
        plan = plan.on_stack(None, **runtime)
    return plan, CostModel(model, cluster)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_state_bytes_per_device_over_the_group(zero):
    dp = 4
    plan, cost = _gpt_plan(zero, dp)
    params = sum(layer.params for layer in cost.model.layers)
    # fp32 Adam: weight 4 + gradient 4 + two moments 8 (Rajbhandari et al. 2020, fig. 1)
    expected = {0: 16 * params, 1: (8 + 8 / dp) * params,
                2: (4 + (4 + 8) / dp) * params, 3: 16 * params / dp}[zero]
    assert cost.state_bytes((0, cost.model.num_layers), 1, dp, zero) == \
        pytest.approx(expected)


@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_peak_is_shards_plus_unsharded_working_set(reshard):
    dp = 4
    base, cost = _gpt_plan(0, dp)
    z3, _ = _gpt_plan(3, dp, reshard_after_forward=reshard)
    opts = SimOptions(trace=False)
    peak0 = simulate(base, cost, opts).metrics.peak_memory_bytes["n0/0"]
    peak3 = simulate(z3, cost, opts).metrics.peak_memory_bytes["n0/0"]
    layers = [layer.params for layer in cost.model.layers]
    params = sum(layers)
    # resharding: two layers' weights (computing, prefetched) and one layer's gradient,
    # fp32: 4 + 4 + 4 bytes; without: every weight and gradient, 4 + 4 bytes
    working = 12 * max(layers) if reshard else 8 * params
    assert peak0 - peak3 == pytest.approx(16 * params - 16 * params / dp - working)


@pytest.mark.parametrize("zero,reshard,per_param,op", [
    (2, True, 4 / 2, "allgather"), (3, False, 4 / 2, "reducescatter"),
    (3, True, 0.0, "reducescatter"), (1, True, (4 + 4) / 2, "allreduce")])
def test_step_end_sync_bytes(zero, reshard, per_param, op):
    # zero 2: the updated weights' all-gather (weight bytes / 2 in all-reduce terms);
    # zero 3 without resharding: the gradients' one reduce-scatter (grad bytes / 2);
    # with resharding nothing is left for the end of the step. The trace names each as
    # the executor does (`exec.dataparallel`: allgather, reducescatter), and no other
    # step-end collective appears
    plan, cost = _gpt_plan(zero, 2, reshard_after_forward=reshard)
    events = simulate(plan, cost, SimOptions(bucket_bytes=1e15)).trace.events
    step_end = {"allreduce", "allgather", "reducescatter"}
    assert {e.op for e in events if e.op in step_end} <= {op}
    reduced = [e for e in events if e.op == op and e.device == "n0/0"]
    params = sum(layer.params for layer in cost.model.layers)
    assert sum(e.bytes for e in reduced) == pytest.approx(params * per_param)


def test_zero3_gather_bound_forward_takes_the_gathers():
    # 4 layers of 1 ms F; each layer's all-gather among 2 devices of 4e9 bf16 weights at
    # 1e12 B/s (x the bus efficiency) moves half of 8e9 bytes: several ms, so the
    # forward is gather-bound: 4 gathers back to back, then the last layer's compute
    params, layers = 4_000_000_000, 4
    model = synthetic_model(layers, fwd_flops_per_sample=LAYER_FLOPS,
                            params_per_layer=params, activation_bytes_per_sample=0)
    cluster = _unit_cluster(2, bandwidth=1e12)
    cost = CostModel(model, cluster)
    plan = uniform_plan(model, cluster, pp=1, dp=2, micro_batch=1, global_batch=2)
    plan = plan.with_memory(zero=3)
    assert shard_group(plan, 0, 0) == ("n0/0", "n0/1")
    eff = cluster.device_types["unit"].collective_efficiency
    gather_s = params * model.dtype_bytes / 2 / (1e12 * eff)
    assert gather_s > 1e-3
    extra = fsdp_extra_s(cost, plan, 0, 0, "F", reshard=True)
    assert extra == pytest.approx(layers * gather_s + 1e-3 - layers * 1e-3)
    events = simulate(plan, cost).trace.events
    f = [e for e in events if e.op == "F" and e.device == "n0/0"]
    assert f[0].duration_s == pytest.approx(layers * gather_s + 1e-3)


def test_zero3_gathers_the_stored_weights_under_autocast():
    # autocast keeps the weights in fp32 and FSDP gathers them so (param_dtype None):
    # the gather-bound forward above moves 4 bytes a parameter, not the model dtype's 2
    params, layers = 4_000_000_000, 4
    doc = synthetic_model(layers, fwd_flops_per_sample=LAYER_FLOPS, params_per_layer=params,
                          activation_bytes_per_sample=0).to_dict()
    model = load_model({**doc, "optimizer_state": "autocast"})
    cluster = _unit_cluster(2, bandwidth=1e12)
    cost = CostModel(model, cluster)
    plan = uniform_plan(model, cluster, pp=1, dp=2, micro_batch=1, global_batch=2)
    plan = plan.with_memory(zero=3)
    eff = cluster.device_types["unit"].collective_efficiency
    gather_s = params * 4 / 2 / (1e12 * eff)
    assert fsdp_extra_s(cost, plan, 0, 0, "F", reshard=True) == pytest.approx(
        layers * gather_s + 1e-3 - layers * 1e-3)
    assert first_gather(cost, plan, 0, 0).gather_s == pytest.approx(layers * gather_s)


def test_first_forwards_closed_form():
    # three stages of one rank, gathers of 2, 3 and 1 s issued back to back at 0: each
    # first forward may start once the gathers before it are done, plus its own exposed
    # part; one stage alone gathers when its forward starts, which takes that longer
    costs = [FsdpCost(1.5, 2.0), FsdpCost(0.5, 3.0), FsdpCost(1.0, 1.0)]
    assert first_forwards(costs) == [FirstForward(1.5, 0.0), FirstForward(2.0 + 0.5, 0.0),
                                     FirstForward(2.0 + 3.0 + 1.0, 0.0)]
    assert first_forwards(costs[:1]) == [FirstForward(0.0, 1.5)]


def test_stage_waits_take_each_ranks_stages_in_order():
    # two ranks of two stages (0, 2 and 1, 3): each rank's gathers back to back; a
    # pipeline of one stage a rank adds each exposed part instead
    g = [FsdpCost(0.5, 1.0), FsdpCost(0.25, 2.0), FsdpCost(0.75, 3.0), FsdpCost(1.5, 4.0)]
    assert stage_waits(g, [(0, 2), (1, 3)]) == [
        FirstForward(0.5, 0.0), FirstForward(0.25, 0.0),
        FirstForward(1.0 + 0.75, 0.0), FirstForward(2.0 + 1.5, 0.0)]
    assert stage_waits(g[:2], [(0,), (1,)]) == [FirstForward(0.0, 0.5),
                                                FirstForward(0.0, 0.25)]


@pytest.mark.parametrize("waits,forward,delay", [
    # ready at 1 s, then a stage reached at 2.5 s and ready at 3: late by 1 s at the start
    ([(1.0, 0.0), (3.0, 0.0)], [2.5, 1.0], 1.0),
    # late by 0.5 at the start, then reached at 0.5 + 2.5 and ready at 4: 1 s more
    ([(0.5, 0.0), (4.0, 0.0)], [2.5, 1.0], 1.5),
    ([(0.0, 0.0), (1.0, 0.0)], [2.5, 1.0], 0.0),
    # one stage a rank: the exposed parts add up along the path
    ([(0.0, 0.5), (0.0, 0.25)], [2.5, 1.0], 0.75)])
def test_fill_delay_is_a_longest_path(waits, forward, delay):
    assert fill_delay_s([FirstForward(*w) for w in waits], forward) == pytest.approx(delay)


@pytest.mark.parametrize("kind,chunks", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_zero3_once_a_step_gathers(kind, chunks):
    # pp 2 x dp 2, 4 gather-bound layers (gather g > 2 t, t = 1 ms of F a layer), zero 3
    # without resharding.
    params, t = 4_000_000_000, 1e-3
    model = synthetic_model(4, fwd_flops_per_sample=LAYER_FLOPS, params_per_layer=params,
                            activation_bytes_per_sample=0)
    cluster = _unit_cluster(4, bandwidth=1e12)
    cost = CostModel(model, cluster)
    plan = uniform_plan(model, cluster, pp=2, dp=2, micro_batch=1, global_batch=4,
                        schedule=kind, chunks=chunks)
    plan = plan.with_memory(zero=3).on_stack(None, reshard_after_forward=False)
    eff = cluster.device_types["unit"].collective_efficiency
    g = params * model.dtype_bytes / 2 / (1e12 * eff)
    assert g > 2 * t
    events = simulate(plan, cost).trace.events
    first = {}
    for e in sorted(events, key=lambda e: e.start_s):
        if e.op == "F" and e.device in plan.pipelines[0].stages[e.stage].devices:
            first.setdefault(e.stage, e)
    if chunks == 1:
        # a rank of one stage (two layers) gathers in its first forward, the second
        # layer's gather beside the first layer's compute: 2g + t, on each rank in turn
        assert first_gather(cost, plan, 0, 0) == pytest.approx(FsdpCost(2 * g - t, 2 * g))
        assert first[0].start_s == pytest.approx(0.0)
        assert first[0].duration_s == pytest.approx(2 * g + t)
        assert first[1].start_s == pytest.approx(2 * g + t)
        assert first[1].duration_s == pytest.approx(2 * g + t)
    else:
        # ranks of two one-layer stages gather both from the step's start: stage 0 (and
        # 1) ready at g, stage 2 (and 3) at 2g, each forward its compute alone; rank 1
        # gets micro-batch 0 at g + t, rank 0 gets it back at g + 2t < 2g
        assert first_gather(cost, plan, 0, 0) == pytest.approx(FsdpCost(g, g))
        assert [first[k].start_s for k in range(4)] == \
            pytest.approx([g, g + t, 2 * g, 2 * g + t])
        assert all(first[k].duration_s == pytest.approx(t) for k in range(4))
    # the analytic tier's fill moves as much
    assert_analytic_matches_simulator(plan, cost)


def test_zero_plans_need_a_group_to_add_time():
    plan, cost = _gpt_plan(3, 1)
    assert fsdp_extra_s(cost, plan, 0, 0, "F") == 0.0


@pytest.mark.parametrize("zero,reshard,kind,pp,dp", [
    (2, True, "1f1b", 2, 2), (3, True, "1f1b", 2, 2), (3, False, "1f1b", 2, 2),
    (3, False, "interleaved-1f1b", 2, 2), (3, True, "gpipe", 1, 4)])
def test_analytic_prices_zero_plans_like_the_simulator(zero, reshard, kind, pp, dp):
    model = load_model({"preset": "gpt2-medium"})
    cluster = load_cluster({"nodes": [{"name": "n", "device": "A100-80GB", "count": 8}],
                            "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}})
    chunks = 2 if kind == "interleaved-1f1b" else 1
    plan = uniform_plan(model, cluster, pp=pp, dp=dp, micro_batch=2, global_batch=16 * dp,
                        schedule=kind, chunks=chunks)
    plan = replace(plan.with_memory(zero=zero), stack="torchtitan").on_stack(
        None, reshard_after_forward=reshard)
    cost = CostModel(model, cluster)
    assert_analytic_matches_simulator(plan, cost)
