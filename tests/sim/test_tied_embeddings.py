"""Tied input/output embeddings in the cost model, the simulator and the analytic tier:
one matrix where both ends sit together, a copy on the last stage otherwise, and the
first and last stage's all-reduce of its gradient before their optimizer steps."""

from __future__ import annotations

import pytest
from factories import device_type

from hyperpipe.cluster.cluster import cluster_ref, load_cluster
from hyperpipe.models import load_model
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import STATE_BYTES_PER_PARAM, CostModel
from hyperpipe.sim.simulator import SimOptions, simulate

BW, LAT = 1e9, 1e-4
V, H = 1000, 64


def gpt(tie: bool, dtype: str = "bf16"):
    """A GPT of two blocks: embedding, 2 blocks, head (4 layers)."""
    return load_model({"kind": "gpt", "vocab_size": V, "n_layer": 2, "n_head": 2,
                       "d_model": H, "seq_len": 16, "tie_embeddings": tie, "dtype": dtype})


CLUSTER = load_cluster({
    "name": "two-nodes", "device_types": {"unit": device_type(1e15)},
    "nodes": [{"name": "a", "device": "unit", "count": 2},
              {"name": "b", "device": "unit", "count": 2}],
    "inter_node": {"bandwidth": BW, "latency": LAT}})


def plan_of(model, dp: int, cut: int | None = 2, **extra):
    """dp pipelines; stage 0 on a/r, stage 1 on b/r (cut at layer `cut`), or one stage
    on a/r (cut None); `extra`: more plan fields (stack, runtime)."""
    def stages(r):
        if cut is None:
            return [{"layers": [0, 4], "devices": [f"a/{r}"]}]
        return [{"layers": [0, cut], "devices": [f"a/{r}"]},
                {"layers": [cut, 4], "devices": [f"b/{r}"]}]
    return plan_from_dict({
        "format": "hyperpipe.plan/1", "model": model.to_dict(), "cluster": cluster_ref(CLUSTER),
        "global_batch": 2 * dp, "schedule": "1f1b",
        "pipelines": [{"micro_batch": 1, "num_microbatches": 2, "stages": stages(r)}
                      for r in range(dp)], **extra})


def test_gpt2_small_counts_its_published_parameters():
    # 124,439,808: the parameter count of the released GPT-2 small checkpoint
    # (openai-community/gpt2 on the Hugging Face hub), whose head is its embedding
    assert load_model("gpt2-small").params == 124_439_808
    assert load_model({"preset": "gpt2-small", "tie_embeddings": False}).params == \
        124_439_808 + 50257 * 768
    assert not load_model("llama2-7b").config.tie_embeddings


def test_one_matrix_where_both_ends_sit_together_a_copy_otherwise():
    tied, untied = CostModel(gpt(True), CLUSTER), CostModel(gpt(False), CLUSTER)
    whole = (0, 4)
    assert untied.stage_params(whole) - tied.stage_params(whole) == V * H
    assert tied.model.params == tied.stage_params(whole)
    for layers in ((0, 2), (2, 4)):      # each end keeps its own copy
        assert tied.stage_params(layers) == untied.stage_params(layers)
    kept, shardable = STATE_BYTES_PER_PARAM["bf16"]
    assert untied.state_bytes(whole) - tied.state_bytes(whole) == V * H * (kept + shardable)


def tie_events(trace):
    return [e for e in trace.events if e.op == "allreduce" and e.microbatch == -1]


@pytest.mark.parametrize("dp", [1, 2])
def test_first_and_last_stage_all_reduce_the_embedding_gradient(dp):
    """The tie is a ring of two (first stage's device, last stage's) moving the V x h
    gradient in fp32 main grads (bf16 model): 2(n-1)/n x 4 V h / BW + 2(n-1) latencies,
    n = 2; with two replicas their ties cross the same two NICs at once (one per node),
    so the bytes take twice as long. It comes after the backward and before the
    optimizer, so the iteration grows by exactly that much (no data-parallel reduction
    to overlap: the copies of the two replicas' tie run side by side)."""
    opts = SimOptions(include_optimizer=False)
    tied, untied = gpt(True), gpt(False)
    sim_t = simulate(plan_of(tied, dp), CostModel(tied, CLUSTER), opts)
    sim_u = simulate(plan_of(untied, dp), CostModel(untied, CLUSTER), opts)
    tie_s = dp * 4 * V * H / BW + 2 * LAT
    events = tie_events(sim_t.trace)
    assert {e.device for e in events} == {"a/0", "b/0"}        # the class's first member
    assert all(e.duration_s == pytest.approx(tie_s, rel=1e-9) for e in events)
    assert not tie_events(sim_u.trace)
    if dp == 1:             # no data-parallel reduction: the tie follows the flush
        assert sim_t.metrics.iteration_time_s - sim_u.metrics.iteration_time_s == \
            pytest.approx(tie_s, rel=1e-9)
    est_t = estimate(plan_of(tied, dp), CostModel(tied, CLUSTER), include_optimizer=False)
    end = max(e.end_s for e in events)
    assert est_t.iteration_time_s == pytest.approx(sim_t.metrics.iteration_time_s,
                                                   abs=2 * LAT)
    assert sim_t.metrics.iteration_time_s == pytest.approx(end)
    # the summary's phases name it: its end, the iteration's here (no optimizer)
    phases = sim_t.metrics.extra["phases"]
    assert phases["tied_allreduce_end_s"] == pytest.approx(end)
    assert sim_u.metrics.extra["phases"]["tied_allreduce_end_s"] == 0.0


@pytest.mark.parametrize("stack, tie_bytes", [("megatron-lm", 4), ("megatron-deepspeed", 2)])
def test_the_tie_moves_the_gradient_as_the_stack_holds_it(stack, tie_bytes):
    """An fp16 model whose data-parallel sync is cast to fp32 (`grad_reduce_dtype`, as
    DeepSpeed's `fp32_allreduce`): Megatron-LM's tie reduces the fp32 main grad (4 bytes
    an element), DeepSpeed's pipeline engine the parameter's own fp16 gradient (2):
    2(n-1)/n x bytes V h / BW + 2(n-1) latencies for the ring of two."""
    model = gpt(True, "fp16")
    plan = plan_of(model, 1, stack=stack, runtime={"grad_reduce_dtype": "fp32"})
    (event, *_) = tie_events(simulate(plan, CostModel(model, CLUSTER)).trace)
    assert event.duration_s == pytest.approx(tie_bytes * V * H / BW + 2 * LAT, rel=1e-9)


@pytest.mark.parametrize("stack", ["megatron-lm", "megatron-deepspeed"])
def test_deepspeed_reduces_the_tie_before_the_data_parallel_sync(stack):
    """Two replicas of two stages, the last stage's replicas on node b. Megatron-LM
    syncs over data parallelism first (the last stage's ring starts while stage 0
    drains), then the tie; DeepSpeed's engine runs `ReduceTiedGrads` before
    `ReduceGrads`, so the tie starts when both ends have run their last action (stage
    0's, the later) and every data-parallel ring of a tied rank after it. The analytic
    tier agrees with the simulator to the latencies."""
    model = gpt(True, "fp16")
    plan = plan_of(model, 2, stack=stack, runtime={"overlap_grad_reduce": False})
    cost = CostModel(model, CLUSTER)
    sim = simulate(plan, cost, SimOptions(include_optimizer=False))
    ranks = {r["device"]: r for r in sim.metrics.extra["ranks"]}
    (tie, *_) = tie_events(sim.trace)
    syncs = [e for e in sim.trace.events if e.op == "allreduce" and e.microbatch != -1]
    assert len(syncs) == 2                       # stage 0's ring on a, stage 1's on b
    first_sync = min(e.start_s for e in syncs)
    if stack == "megatron-deepspeed":
        assert tie.start_s == pytest.approx(max(r["compute_end_s"] for r in ranks.values()))
        assert first_sync >= tie.end_s - 1e-12
    else:
        assert first_sync < ranks["a/0"]["compute_end_s"]    # b's ring in a's drain
        assert tie.start_s >= min(e.end_s for e in syncs) - 1e-12
    est = estimate(plan, cost, include_optimizer=False)
    assert est.iteration_time_s == pytest.approx(sim.metrics.iteration_time_s, abs=4 * LAT)


def test_no_tie_when_one_stage_holds_both_ends():
    tied = gpt(True)
    sim = simulate(plan_of(tied, 2, cut=None), CostModel(tied, CLUSTER))
    assert not tie_events(sim.trace)
    # and the data-parallel ring moves the shared matrix once: (params - V h) x 4 bytes
    cost = CostModel(tied, CLUSTER)
    (event,) = [e for e in sim.trace.events if e.op == "allreduce"]
    assert event.bytes == pytest.approx(cost.stage_params((0, 4)) * 4)
    assert cost.stage_params((0, 4)) == gpt(False).params - V * H
