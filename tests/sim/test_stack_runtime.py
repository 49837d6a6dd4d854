"""What the plan's stack changes in the simulator and the analytic tier: blocking sends,
gradient reduction after the flush, the bytes the data-parallel sync moves."""

from __future__ import annotations

import pytest
from factories import chain_plan, cluster_doc, device_type, synthetic_model

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.plan.stack import resolve_runtime
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.search.evaluate import rank_key
from hyperpipe.search.search import SearchConstraints
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate

BW, LAT = 1e9, 1e-5
LINK = {"bandwidth": BW, "latency": LAT}


def nodes(n: int, per_node: int = 1):
    """n nodes of `per_node` 1 TFLOP/s devices, every link BW, LAT."""
    return load_cluster(cluster_doc({"unit": device_type(1e12)},
                                    [(f"n{i}", "unit", per_node) for i in range(n)],
                                    intra_link=LINK, inter_node=LINK, name="t"))


def chain(layers: int = 8, act: float = 1e6, params: int = 0):
    """1 ms of F, I and W per layer and sample; `act` bytes sent on per sample."""
    return synthetic_model(layers, fwd_flops_per_sample=1e9, params_per_layer=params,
                           activation_bytes_per_sample=act, stash_bytes_per_sample=1e3)


def test_megatron_deepspeed_is_blocking_sends_and_the_reduction_after_the_flush():
    model = chain(params=1_000_000)
    cluster = nodes(2, 2)
    cost = CostModel(model, cluster)
    plan = uniform_plan(model, cluster, pp=2, dp=2, micro_batch=1, global_batch=8)
    ds = simulate(plan.on_stack("megatron-deepspeed"), cost).metrics
    same = simulate(plan.on_stack(p2p="blocking", overlap_grad_reduce=False), cost).metrics
    lm = simulate(plan, cost).metrics
    assert ds.iteration_time_s == same.iteration_time_s
    assert ds.iteration_time_s > lm.iteration_time_s


def two_nodes_of_four(nics: int = 1, slowdown: float | None = None):
    """Two nodes of four 1 TFLOP/s devices, links BW and LAT, `nics` NICs of BW per
    node; device n1/1 `slowdown` times slower when given."""
    return load_cluster({"name": "t", "device_types": {"unit": device_type(1e12)},
                         "inter_node": LINK, "nodes": [
        {"name": f"n{i}", "device": "unit", "count": 4, "intra_link": LINK,
         "nics": {"count": nics, "bandwidth": BW},
         **({"slowdown": {1: slowdown}} if slowdown and i == 1 else {})}
        for i in range(2)]})


@pytest.mark.parametrize("kind,chunks", [("1f1b", 1), ("zb-v", 2), ("gpipe", 1)])
def test_a_blocking_send_waits_while_the_replicas_share_its_nic(kind, chunks):
    """Four replicas of pp 2 cross one NIC per node (1 GB/s), each send 1 MB against 1
    ms of compute per layer. A blocking sender waits until its message lands, sharing
    the NIC with the other replicas' sends: simulating every replica on its own gives
    what their collapsed class gives (one representative whose flows carry the four);
    a NIC per device is faster, a straggler slower."""
    model = chain(layers=8)
    plan = uniform_plan(model, two_nodes_of_four(), pp=2, dp=4, micro_batch=1,
                        global_batch=32, schedule=kind, chunks=chunks
                        ).on_stack(p2p="blocking")

    def simulated(cluster, collapse: bool = False):
        return simulate(plan, CostModel(model, cluster), SimOptions(
            trace=False, include_optimizer=False, collapse_replicas=collapse)).metrics

    collapsed, full = simulated(two_nodes_of_four(), True), simulated(two_nodes_of_four())
    assert (len(collapsed.extra["replica_classes"]), len(full.extra["replica_classes"])) \
        == (1, 4)
    assert full.iteration_time_s == pytest.approx(collapsed.iteration_time_s, rel=1e-9)
    assert simulated(two_nodes_of_four(nics=4)).iteration_time_s < full.iteration_time_s
    assert simulated(two_nodes_of_four(slowdown=1.5)).iteration_time_s > \
        full.iteration_time_s


@pytest.mark.parametrize("pp,kind,chunks,tolerance", [
    (4, "gpipe", 1, 1e-9), (2, "zb-v", 2, 1e-9), (2, "1f1b", 1, 1e-9),
    (4, "1f1b", 1, 0.02), (4, "zb-h1", 1, 0.05), (2, "interleaved-1f1b", 2, 0.01)])
def test_analytic_tier_prices_blocking_sends_as_the_simulator(pp, kind, chunks, tolerance):
    """Sends of 1 ms (1 MB at 1 GB/s) against 1 ms of compute per layer: blocking them
    lengthens the iteration, and the analytic tier, which folds each send into the
    action that makes it, follows the simulation. It folds each at its time alone: where
    a stage's forward and backward sends leave its node's one NIC at once (zb-h1, pp 4:
    3 ms of 77.19), the simulator's blocked sender waits for them to share it, and the
    estimate is below the simulation there (74.20 ms); it is above it by 2% at most."""
    model = chain()
    cluster = nodes(pp)
    cost = CostModel(model, cluster)
    plan = uniform_plan(model, cluster, pp=pp, micro_batch=1, global_batch=8, schedule=kind,
                        chunks=chunks)
    options = SimOptions(include_optimizer=False)
    blocking = plan.on_stack(p2p="blocking")
    sim = simulate(blocking, cost, options).metrics.iteration_time_s
    est = estimate(blocking, cost, include_optimizer=False).iteration_time_s
    assert est == pytest.approx(sim, rel=tolerance)
    assert est <= sim * (1 + 0.02)
    assert sim > simulate(plan, cost, options).metrics.iteration_time_s
    assert est > estimate(plan, cost, include_optimizer=False).iteration_time_s


@pytest.mark.parametrize("dtype,stack,distributed,expected", [
    # gradient bytes per parameter; with the distributed optimizer a reduce-scatter of
    # them and an all-gather of the weights, (grad + weight) / 2 in all-reduce terms,
    # or, where the stack all-reduces the gradients in full, grad + weight / 2
    ("bf16", "megatron-lm", False, 4.0), ("bf16", "megatron-lm", True, 3.0),
    ("bf16", "megatron-deepspeed", False, 4.0), ("bf16", "megatron-deepspeed", True, 5.0),
    ("bf16", "torchtitan", True, 3.0),
    ("fp16", "megatron-lm", False, 2.0), ("fp16", "megatron-deepspeed", True, 2.0),
    ("fp16", "torchtitan", False, 4.0), ("fp16", "torchtitan", True, 3.0),
])
def test_sync_bytes_per_parameter(dtype, stack, distributed, expected):
    cost = CostModel(load_model({"preset": "gpt2-small", "dtype": dtype}), nodes(2))
    assert cost.dp_sync_bytes_per_param(distributed, resolve_runtime(stack)) == expected


def test_grad_reduce_dtype_halves_the_ring():
    """One bucket, reduced after the backward on a ring of one device per node: the
    event takes 2(n-1)/n x params x bytes / BW + 2(n-1) latencies, 4 bytes a gradient
    on torchtitan (fp32 reductions), 2 with `grad_reduce_dtype: bf16`."""
    params, n = 2_000_000, 4
    model = chain(layers=2, act=0.0, params=params)
    cluster = nodes(n)
    cost = CostModel(model, cluster)
    plan = uniform_plan(model, cluster, pp=1, dp=n, micro_batch=1, global_batch=n)
    for runtime, nbytes in (({}, 4), ({"grad_reduce_dtype": "bf16"}, 2)):
        on = plan.on_stack("torchtitan", overlap_grad_reduce=False, **runtime)
        trace = simulate(on, cost, SimOptions(bucket_bytes=1e12)).trace
        (event,) = [e for e in trace.events if e.op == "allreduce"]
        ring = 2 * (n - 1) / n * 2 * params * nbytes / BW + 2 * (n - 1) * LAT
        assert event.duration_s == pytest.approx(ring, rel=1e-9)
        est = estimate(on, cost, bucket_bytes=1e12, include_optimizer=False)
        assert est.iteration_time_s - est.extra["pipeline_s"] == pytest.approx(ring, rel=1e-9)


MEM_BW = 1e11     # bytes/s of the test device's memory


def accumulating(dtype: str, layers: int = 8, params: int = 1_000_000):
    """`chain` in `dtype` on devices with `MEM_BW` of memory bandwidth."""
    model = synthetic_model(layers, fwd_flops_per_sample=1e9, params_per_layer=params,
                            activation_bytes_per_sample=1e6, stash_bytes_per_sample=1e3,
                            dtype=dtype)
    cluster = load_cluster(cluster_doc({"unit": device_type(1e12, mem_bandwidth=MEM_BW)},
                                       [("n0", "unit", 2)], intra_link=LINK, name="t"))
    return model, cluster


@pytest.mark.parametrize("dtype,added", [("bf16", True), ("fp16", False)])
def test_deepspeed_bf16_adds_each_micro_batch_into_fp32_gradients(dtype, added):
    """DeepSpeed's BF16_Optimizer adds every micro-batch's gradients into fp32 buffers:
    on one device, m micro-batches take m x params x 18 bytes / bandwidth longer than on
    the same stack without it (blocking sends, reduction after the flush: megatron-lm
    overridden), in the simulator and the analytic tier alike; fp16 keeps autograd's
    accumulation (nothing added)."""
    model, cluster = accumulating(dtype)
    cost = CostModel(model, cluster)
    m, params = 6, 8 * 1_000_000
    plan = uniform_plan(model, cluster, pp=1, micro_batch=1, global_batch=m)
    ds = plan.on_stack("megatron-deepspeed")
    same = plan.on_stack(p2p="blocking", overlap_grad_reduce=False)
    closed = m * params * 18 / (MEM_BW * cluster.device_types["unit"].mem_efficiency)
    for price in (lambda p: simulate(p, cost).metrics.iteration_time_s,
                  lambda p: estimate(p, cost).iteration_time_s):
        gap = price(ds) - price(same)
        assert gap == pytest.approx(closed if added else 0.0, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("kind,chunks,tolerance", [
    ("1f1b", 1, 1e-9), ("zb-h1", 1, 0.03), ("interleaved-1f1b", 2, 0.02)])
def test_analytic_tier_prices_the_fp32_accumulation_as_the_simulator(kind, chunks, tolerance):
    """Over two stages (B, or W where the schedule splits the backward, carries the add:
    here as long as the pass itself) the analytic tier follows the simulator, within
    what it does without the add on split and interleaved kinds, and both grow by it."""
    model, cluster = accumulating("bf16", params=20_000_000)
    cost = CostModel(model, cluster)
    plan = uniform_plan(model, cluster, pp=2, micro_batch=1, global_batch=8, schedule=kind,
                        chunks=chunks)
    ds = plan.on_stack("megatron-deepspeed")
    same = plan.on_stack(p2p="blocking", overlap_grad_reduce=False)
    options = SimOptions(include_optimizer=False)
    sim = simulate(ds, cost, options).metrics.iteration_time_s
    est = estimate(ds, cost, include_optimizer=False).iteration_time_s
    assert est == pytest.approx(sim, rel=tolerance)
    assert sim > simulate(same, cost, options).metrics.iteration_time_s
    assert est > estimate(same, cost, include_optimizer=False).iteration_time_s


def embedding_alone(dtype: str, first: int = 1):
    """tiny-gpt in `dtype` on two devices, stage 0 holding layers [0, first)."""
    model = load_model({"preset": "tiny-gpt", "dtype": dtype})
    cluster = nodes(2)
    plan = chain_plan(model, cluster, [0, first, model.num_layers],
                      [d.name for d in cluster.devices], 1, 4)
    return model, cluster, plan


@pytest.mark.parametrize("dtype,stack,first,refused", [
    ("fp16", "megatron-deepspeed", 1, True),     # the embedding alone: no bias, no norm
    ("fp16", "megatron-deepspeed", 2, False),    # with a block: both groups filled
    ("bf16", "megatron-deepspeed", 1, False),    # the BF16_Optimizer path
    ("fp16", "megatron-lm", 1, False),
])
def test_deepspeed_fp16_refuses_a_stage_of_only_the_embedding(dtype, stack, first, refused):
    """DeepSpeed's FP16_Optimizer flattens Megatron's no-decay group (biases and norms),
    which a stage holding only the embedding leaves empty: the simulator and the
    analytic tier say the plan is refused (not feasible, `refused` in its JSON), and
    nothing else changes."""
    model, cluster, plan = embedding_alone(dtype, first)
    cost = CostModel(model, cluster)
    on = plan.on_stack(stack)
    assert (on.stack_refusal(model) is not None) == refused
    for m in (simulate(on, cost).metrics, estimate(on, cost)):
        assert (m.refused is not None) == refused
        assert m.feasible == (not refused and not m.oom)
        assert ("refused" in m.to_dict()) == refused
        if refused:
            assert "pipelines[0].stages[0]" in m.refused


def test_a_refused_plan_ranks_after_every_feasible_one():
    model, cluster, plan = embedding_alone("fp16")
    cost = CostModel(model, cluster)
    refused = estimate(plan.on_stack("megatron-deepspeed"), cost)
    fine = estimate(embedding_alone("fp16", 2)[2].on_stack("megatron-deepspeed"), cost)
    c = SearchConstraints(global_batch=4)
    assert rank_key(c, fine) < rank_key(c, refused)
