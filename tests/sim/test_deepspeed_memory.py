"""Memory that DeepSpeed's pipeline engine and Megatron's loss hold beyond autograd's
stash, against closed forms: each in-flight stage output kept until its backward (on the
last stage the fp32 logits of `GPTModelPipe`'s `float16_to_fp32`), and the head
backward's cast of the fp32 logit gradient."""

from __future__ import annotations

import pytest
from factories import chain_plan, cluster_doc, device_type

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.plan.plan import StagePlan
from hyperpipe.plan.stack import resolve_runtime
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate

B, S, H, V = 2, 128, 64, 1000        # micro-batch, sequence, width, vocabulary
FP16 = 2
FP32 = 4


def small_gpt():
    return load_model({"kind": "gpt", "name": "t", "vocab_size": V, "n_layer": 4,
                       "n_head": 4, "d_model": H, "seq_len": S, "dtype": "fp16"})


def two_devices():
    link = {"bandwidth": 1e9, "latency": 1e-5}
    return load_cluster(cluster_doc({"unit": device_type(1e12)}, [("n0", "unit", 2)],
                                    intra_link=link, name="t"))


def test_only_deepspeed_keeps_stage_outputs():
    assert resolve_runtime("megatron-deepspeed").keeps_stage_outputs
    assert not resolve_runtime("megatron-lm").keeps_stage_outputs
    assert not resolve_runtime("torchtitan").keeps_stage_outputs


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_stage_output_bytes_closed_form(tp):
    cost = CostModel(small_gpt(), two_devices())
    n = cost.model.num_layers
    assert cost.stage_output_bytes((0, 3), B, tp) == B * S * H * FP16 / tp
    assert cost.stage_output_bytes((3, n), B, tp) == B * S * V * FP32 / tp
    assert cost.head_backward_work_bytes((3, n), B, tp) == B * S * V * FP16 / tp
    assert cost.head_backward_work_bytes((0, 3), B, tp) == 0.0
    stage = StagePlan((3, n), ("n0/0",), 1)
    assert cost.stage_stash_bytes(stage, B, True) - cost.stage_stash_bytes(stage, B) == \
        B * S * V * FP32


def test_head_backward_work_is_static_on_the_head_stage_only():
    cost = CostModel(small_gpt(), two_devices())
    n = cost.model.num_layers
    first, last = StagePlan((0, 3), ("n0/0",), 1), StagePlan((3, n), ("n0/1",), 1)
    with_head = cost.device_static_bytes([last], B)
    without = cost.state_bytes(last.layers) + cost.runtime_reserve_bytes("unit")
    assert with_head - without == pytest.approx(B * S * V * FP16)
    assert cost.device_static_bytes([first], B) == pytest.approx(
        cost.state_bytes(first.layers) + cost.runtime_reserve_bytes("unit"))


def test_simulated_and_estimated_peaks_grow_by_the_kept_outputs():
    """1F1B over 2 stages and 4 micro-batches: the first stage has 2 micro-batches in
    flight at its peak, the last 1; on megatron-deepspeed each keeps its output beside
    the stash, so the peaks grow by 2 activations and by 1 micro-batch's fp32 logits."""
    model, cluster = small_gpt(), two_devices()
    cost = CostModel(model, cluster)
    n = model.num_layers
    plan = chain_plan(model, cluster, [0, 3, n], ["n0/0", "n0/1"], B, 4)
    opts = SimOptions(include_optimizer=False)
    lm = simulate(plan, cost, opts).metrics.peak_memory_bytes
    ds_plan = plan.on_stack("megatron-deepspeed")
    ds = simulate(ds_plan, cost, opts).metrics.peak_memory_bytes
    est = estimate(ds_plan, cost).peak_memory_bytes
    assert ds["n0/0"] - lm["n0/0"] == pytest.approx(2 * B * S * H * FP16)
    assert ds["n0/1"] - lm["n0/1"] == pytest.approx(B * S * V * FP32)
    for dev in ("n0/0", "n0/1"):
        assert est[dev] == pytest.approx(ds[dev])


def test_head_and_recompute_working_sets_do_not_add():
    """The head's backward runs before its stage's blocks are recomputed: the static
    working set is the larger of the two, not their sum."""
    cost = CostModel(small_gpt(), two_devices())
    n = cost.model.num_layers
    last = StagePlan((3, n), ("n0/1",), 1, recompute="full")
    recompute = cost.recompute_work_bytes(last.layers, B, recompute="full")
    head = cost.head_backward_work_bytes(last.layers, B)
    assert recompute > 0 and head > 0
    extra = cost.device_static_bytes([last], B) - cost.state_bytes(last.layers) \
        - cost.runtime_reserve_bytes("unit")
    assert extra == pytest.approx(max(recompute, head))
