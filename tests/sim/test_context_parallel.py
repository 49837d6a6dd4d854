"""Context parallelism against closed forms: activations and compute per device / cp,
the ring exchange's cp - 1 steps each overlapped with one step's attention, the
gradient sync joining the context ranks, and the analytic tier against the simulator."""

from __future__ import annotations

from dataclasses import replace

import pytest
from factories import assert_analytic_matches_simulator, cluster_doc, device_type

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.plan.plan import StagePlan
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.sharding import ring_attention_extra_s, ring_edges, ring_exposed_s
from hyperpipe.sim.simulator import SimOptions, simulate

FLOPS = 1e12


def _flat(devices: int, bandwidth: float = 1e30, nodes: int = 1):
    """`nodes` nodes of `devices` flat-roofline devices (no GEMM curve)."""
    link = {"bandwidth": bandwidth, "latency": 0.0}
    return load_cluster(cluster_doc(
        {"unit": device_type(FLOPS)}, [(f"n{i}", "unit", devices) for i in range(nodes)],
        intra_link=link, inter_node=link, name="flat"))


def _gpt(seq: int = 256):
    return load_model({"preset": "tiny-gpt", "seq_len": seq, "dtype": "bf16",
                       "attention": "flash"})


def _cp_plan(model, cluster, cp: int, tp: int = 1, pp: int = 1, dp: int = 1, zero: int = 0,
             micro_batch: int = 2, m: int = 4, kind: str = "1f1b"):
    plan = uniform_plan(model, cluster, pp=pp, dp=dp, tp=tp * cp, micro_batch=micro_batch,
                        global_batch=micro_batch * m * dp, schedule=kind)
    plan = plan.with_pipelines([replace(p, stages=tuple(replace(s, tp=tp, cp=cp)
                                                        for s in p.stages))
                                for p in plan.pipelines])
    return plan.with_memory(zero=zero)


@pytest.mark.parametrize("cp", [2, 4])
def test_activations_and_compute_per_device_over_cp(cp):
    model, cluster = _gpt(), _flat(8)
    cost = CostModel(model, cluster)
    layers = (0, model.num_layers)
    one = sum(model.stash_bytes(i, 2) for i in range(*layers))
    assert cost.stash_bytes(layers, 2, cp=cp) == pytest.approx(one / cp)
    devices = tuple(d.name for d in cluster.devices[:cp])
    for op in "FIWB":
        flops = sum(cost.op_flops(i, 2, op) for i in range(*layers))
        # flat roofline: every FLOP of the layer split evenly over the context ranks
        assert cost.stage_time_s(layers, devices, 2, op, cp=cp) == \
            pytest.approx(flops / cp / FLOPS)


def _ring_oracle(model, cp: int, tp: int, b: int, bandwidth: float, eff: float):
    """(exchange, step) seconds of one forward ring step, from the shapes."""
    c = model.config
    q = model.seq_len / cp
    kv_bytes = b * q * 2 * c.kv_dim / tp * model.dtype_bytes
    step_flops = 4 * b * q * q * c.d_model / tp        # QK^T and AV for s/cp keys
    return kv_bytes / (bandwidth * eff), step_flops / FLOPS


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_exchange_exposed_beyond_each_step(cp):
    model = _gpt(seq=1024)
    bandwidth = 2e6                    # slow enough that the exchange shows
    cluster = _flat(8, bandwidth)
    cost = CostModel(model, cluster)
    devices = tuple(d.name for d in cluster.devices[:cp])
    blocks = sum(1 for layer in model.layers if layer.kind == "block")
    stage = StagePlan((0, model.num_layers), devices, 1, cp=cp)
    assert len(ring_edges(stage)) == cp
    eff = cluster.device_types["unit"].collective_efficiency
    kv, step = _ring_oracle(model, cp, 1, 2, bandwidth, eff)
    assert kv > step
    # cp - 1 exchanges, each hidden under one step's attention at best
    assert ring_attention_extra_s(cost, stage, 2, "F") == \
        pytest.approx(blocks * (cp - 1) * (kv - step))
    assert ring_exposed_s(cp - 1, kv, step) == pytest.approx((cp - 1) * (kv - step))
    assert ring_attention_extra_s(cost, stage, 2, "W") == 0.0
    # the backward sends keys, values and their gradients: twice the bytes
    kv_i, _ = _ring_oracle(model, cp, 1, 2, bandwidth, eff)
    step_i = 5 / 2 * step            # flash backward: 5 GEMMs to the forward's 2 (ops.py)
    assert ring_attention_extra_s(cost, stage, 2, "I") == \
        pytest.approx(blocks * (cp - 1) * max(0.0, 2 * kv_i - step_i))
    # the simulated F takes its compute plus the exposed exchange
    plan = _cp_plan(model, cluster, cp)
    events = simulate(plan, cost).trace.events
    f = next(e for e in events if e.op == "F")
    compute = sum(cost.op_flops(i, 2, "F") for i in range(model.num_layers)) / cp / FLOPS
    assert f.duration_s == pytest.approx(compute + blocks * (cp - 1) * (kv - step))


def test_fast_ring_hides_under_attention():
    model, cluster = _gpt(seq=1024), _flat(8)
    stage = StagePlan((0, model.num_layers), ("n0/0", "n0/1"), 1, cp=2)
    assert ring_attention_extra_s(CostModel(model, cluster), stage, 2, "F") == 0.0


def test_context_ranks_join_the_gradient_sync():
    # one pipeline, cp 2: the two context ranks all-reduce every gradient
    model, cluster = _gpt(), _flat(8)
    cost = CostModel(model, cluster)
    plan = _cp_plan(model, cluster, cp=2)
    events = simulate(plan, cost, SimOptions(bucket_bytes=1e15)).trace.events
    reduced = [e for e in events if e.op == "allreduce" and e.device == "n0/0"]
    params = sum(layer.params for layer in model.layers)
    assert sum(e.bytes for e in reduced) == pytest.approx(params * cost.grad_bytes_per_param)
    # ZeRO-1 over dp x cp = 2 x 2 ranks: the optimizer step updates a quarter
    plan = _cp_plan(model, cluster, cp=2, dp=2, zero=1)
    opt = [e for e in simulate(plan, cost).trace.events if e.op == "optimizer"]
    assert sum(e.duration_s for e in opt if e.device == "n0/0") == pytest.approx(
        cost.optimizer_time_s((0, model.num_layers), "unit", 1, 4))


@pytest.mark.parametrize("cp,tp,pp,dp,zero,nodes", [
    (2, 1, 2, 2, 0, 1), (2, 2, 2, 1, 3, 2), (4, 2, 1, 2, 1, 2), (2, 1, 2, 2, 2, 1)])
def test_analytic_prices_cp_plans_like_the_simulator(cp, tp, pp, dp, zero, nodes):
    model = load_model({"preset": "gpt2-medium", "seq_len": 4096})
    cluster = load_cluster({"nodes": [{"name": "n", "device": "H100-SXM", "count": 8,
                                       "repeat": nodes}],
                            "inter_node": {"bandwidth": "400 Gbit/s", "latency": "5 us"}})
    plan = _cp_plan(model, cluster, cp, tp, pp, dp, zero, micro_batch=1, m=8)
    cost = CostModel(model, cluster)
    assert_analytic_matches_simulator(plan, cost)
