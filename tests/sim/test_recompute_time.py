"""Recompute and distributed-optimizer time (issue 9) against closed forms: full
recompute makes a uniform stage's backward take F + B; selective recompute adds the
attention core; the distributed optimizer's sync moves (grad + weight) / 2 bytes per
parameter in all-reduce terms and its optimizer step is sharded."""

from __future__ import annotations

from dataclasses import replace

import pytest
from factories import cluster_doc, device_type, synthetic_model

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate

FLOPS = 1e12            # "unit" device: 1 TFLOP/s at efficiency 1, free memory traffic
LAYER_FLOPS = 1e9       # per sample per layer: 1 ms of F, I and W each


def _free(devices: int, layers: int, params: int = 0, mem_bandwidth: float = 1e30):
    link = {"bandwidth": 1e30, "latency": 0.0}
    cluster = load_cluster(cluster_doc(
        {"unit": device_type(FLOPS, mem_bandwidth=mem_bandwidth)}, [("n0", "unit", devices)],
        intra_link=link, inter_node=link, name="free"))
    model = synthetic_model(layers, fwd_flops_per_sample=LAYER_FLOPS, params_per_layer=params,
                            activation_bytes_per_sample=0, stash_bytes_per_sample=1e6)
    return model, cluster


def _with(plan, **stage_fields):
    pipes = [replace(p, stages=tuple(replace(s, **stage_fields) for s in p.stages))
             for p in plan.pipelines]
    return plan.with_pipelines(pipes)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (4, 8), (3, 7)])
def test_full_recompute_backward_is_f_plus_b(kind, p, m):
    per_stage = 2
    model, cluster = _free(p, p * per_stage)
    plan = _with(uniform_plan(model, cluster, pp=p, micro_batch=1, global_batch=m,
                              schedule=kind), recompute="full")
    cost = CostModel(model, cluster)
    t_f = per_stage * LAYER_FLOPS / FLOPS
    t_b = 2 * t_f
    result = simulate(plan, cost)
    for e in result.trace.events:
        if e.op == "B":
            assert e.duration_s == pytest.approx(t_f + t_b, rel=1e-9)
        elif e.op == "F":
            assert e.duration_s == pytest.approx(t_f, rel=1e-9)
    # the 1F1B/GPipe closed form with a backward of F + B
    expected = (m + p - 1) * (t_f + t_f + t_b)
    assert result.metrics.iteration_time_s == pytest.approx(expected, rel=5e-3)
    assert estimate(plan, cost).iteration_time_s == pytest.approx(expected, rel=5e-3)
    # MFU counts model FLOPs only: the recomputed forward is not in it
    plain = simulate(uniform_plan(model, cluster, pp=p, micro_batch=1, global_batch=m,
                                  schedule=kind), cost).metrics
    assert result.metrics.mfu == pytest.approx(
        plain.mfu * plain.iteration_time_s / result.metrics.iteration_time_s, rel=1e-9)


def test_full_recompute_redoes_the_forward_in_i_of_zero_bubble():
    model, cluster = _free(4, 4)
    plan = _with(uniform_plan(model, cluster, pp=4, micro_batch=1, global_batch=8,
                              schedule="zb-h1"), recompute="full")
    t = LAYER_FLOPS / FLOPS
    durations = {}
    for e in simulate(plan, CostModel(model, cluster)).trace.events:
        durations.setdefault(e.op, set()).add(round(e.duration_s / t, 9))
    assert durations["F"] == {1.0} and durations["I"] == {2.0} and durations["W"] == {1.0}


def test_selective_recompute_adds_the_attention_core():
    cluster = load_cluster("a100-1024")
    devices = ("dgx-0/0", "dgx-0/1")
    for attention in ("eager", "flash"):
        model = load_model({"preset": "gpt3-1.3b", "n_layer": 2, "attention": attention})
        cost = CostModel(model, cluster)
        c, b = model.config, 2
        block = (1, 2)
        f = cost.stage_time_s(block, devices, b, "F")
        base = cost.stage_time_s(block, devices, b, "B")
        sel = cost.stage_time_s(block, devices, b, "B", "selective")
        full = cost.stage_time_s(block, devices, b, "B", "full")
        assert full == pytest.approx(base + f, rel=1e-12)       # incl. its TP collectives
        if attention == "flash":
            assert sel == base               # the kernel recomputes its scores by itself
            continue
        s, h = c.seq_len, c.d_model
        fwd = 24 * b * s * h * h + 4 * b * s * s * h            # Narayanan et al.'s count
        core = 4 * b * s * s * h / fwd
        compute_f = f - cost.tp_comm_s(block, devices, b, "F")
        assert sel - base == pytest.approx(core * compute_f, rel=1e-9)
        assert 0 < sel - base < full - base


def test_distributed_optimizer_sync_bytes_and_sharded_step():
    params = 1_500_000
    model, cluster = _free(2, 2, params=params, mem_bandwidth=1e12)   # optimizer: 84 us
    cost = CostModel(model, cluster)
    plan = uniform_plan(model, cluster, pp=1, dp=2, micro_batch=1, global_batch=2)
    opts = SimOptions(bucket_bytes=1e12)
    plain = simulate(plan, cost, opts).trace.events
    sharded = simulate(replace(plan, zero=1), cost, opts).trace.events

    def one(events, op):
        return [e for e in events if e.op == op and e.device == "n0/0"]

    # bf16: fp32 grads all-reduced (4 B) vs reduce-scatter of 4 B + all-gather of 2 B
    assert one(plain, "allreduce")[0].bytes == 2 * params * 4
    assert one(sharded, "allreduce")[0].bytes == 2 * params * (4 + 2) / 2
    opt_plain, opt_sharded = one(plain, "optimizer"), one(sharded, "optimizer")
    assert opt_plain and sum(e.duration_s for e in opt_plain) > 0
    assert sum(e.duration_s for e in opt_sharded) == pytest.approx(
        sum(e.duration_s for e in opt_plain) / 2, rel=1e-9)
