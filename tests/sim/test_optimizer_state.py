"""What the optimizer keeps per parameter (`ModelSpec.optimizer_state`): state bytes
under ZeRO 0-3 against hand counts, the Adam step's traffic, ZeRO-3's working set of
experts that nothing gathers, the simulated peak, and the model field's input checks."""

from __future__ import annotations

import json

import pytest
from factories import device_type

from hyperpipe.cli.main import main
from hyperpipe.cluster.cluster import cluster_ref, load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate

CLUSTER = load_cluster({
    "name": "one-node", "device_types": {"unit": device_type(1e15)},
    "nodes": [{"name": "a", "device": "unit", "count": 4}],
    "inter_node": {"bandwidth": 1e9, "latency": 1e-5}})
GPT = {"kind": "gpt", "vocab_size": 1000, "n_layer": 2, "n_head": 2, "d_model": 64,
       "seq_len": 16, "tie_embeddings": False}
# bytes per parameter by hand, (kept on every replica, sharded by ZeRO-1, ZeRO-3's):
# bf16 weight 2 + fp32 main grad 4, fp32 master 4 + Adam moments 4 + 4 ("mixed");
# the moments at 2 bytes each ("bf16-moments"); bf16 weight 2 + bf16 grad 2, moments
# 2 + 2, no master ("model-dtype"); fp32 weight 4 + fp32 grad 4, fp32 moments 4 + 4, no
# bf16 copy kept ("autocast")
HAND = {"mixed": (6, 12, 16), "bf16-moments": (6, 8, 12), "model-dtype": (4, 4, 8),
        "autocast": (8, 8, 16)}


@pytest.mark.parametrize("state", sorted(HAND))
def test_state_bytes_match_a_hand_count(state):
    cost = CostModel(load_model({**GPT, "optimizer_state": state}), CLUSTER)
    whole = (0, cost.model.num_layers)
    params = cost.stage_params(whole)
    kept, shardable, zero3 = HAND[state]
    assert cost.state_bytes(whole, 1, 4, 0) == pytest.approx(params * (kept + shardable))
    assert cost.state_bytes(whole, 1, 4, 1) == pytest.approx(params * (kept + shardable / 4))
    assert cost.state_bytes(whole, 1, 4, 3) == pytest.approx(params * zero3 / 4)
    assert cost.state_bytes_per_param == kept + shardable


@pytest.mark.parametrize("state", sorted(set(HAND) - {"mixed"}))
def test_fp32_training_is_the_same_under_every_optimizer_state(state):
    """docs/formats.md: fp32 training keeps fp32 weight, gradient and moments whatever
    `optimizer_state` says (16 bytes a parameter; no master copy to drop, no moments
    kept narrower than the weights). bf16-moments had charged 12."""
    mixed = CostModel(load_model({**GPT, "dtype": "fp32"}), CLUSTER)
    other = CostModel(load_model({**GPT, "dtype": "fp32", "optimizer_state": state}),
                      CLUSTER)
    whole = (0, mixed.model.num_layers)
    assert mixed.state_bytes(whole, 1, 4, 0) == pytest.approx(
        16 * mixed.stage_params(whole))
    for zero in (0, 1, 2, 3):
        assert other.state_bytes(whole, 1, 4, zero) == mixed.state_bytes(whole, 1, 4, zero)
    assert other.optimizer_time_s(whole, "unit") == mixed.optimizer_time_s(whole, "unit")


def test_adam_step_moves_what_it_keeps():
    # mixed: reads and writes master and moments (2 x 12), reads the grad, writes the
    # weight: 28 bytes; model-dtype: reads the grad (2), reads and writes the weight and
    # both moments (2 x 6): 14 bytes
    mixed = CostModel(load_model(GPT), CLUSTER)
    plain = CostModel(load_model({**GPT, "optimizer_state": "model-dtype"}), CLUSTER)
    whole = (0, mixed.model.num_layers)
    assert plain.optimizer_time_s(whole, "unit") == pytest.approx(
        mixed.optimizer_time_s(whole, "unit") * 14 / 28)


def test_zero3_gathers_no_expert_whose_shard_group_is_one_rank():
    moe = {"experts": 4, "top_k": 2, "expert_hidden": 64}
    plain = CostModel(load_model({**GPT, "moe": moe, "optimizer_state": "model-dtype"}),
                      CLUSTER)
    mixed = CostModel(load_model({**GPT, "moe": moe}), CLUSTER)
    whole = (0, plain.model.num_layers)
    experts = plain.expert_params(whole)
    dense = plain.stage_params(whole) - experts
    # without resharding: every weight and its gradient, 2 + 2 bytes (model-dtype) or
    # 2 + 4 (bf16 weight and fp32 grad); a one-rank shard group's experts are the
    # weights the optimizer steps, so model-dtype gathers none of them
    assert plain.zero3_working_bytes(whole, 1, False, expert_share=0.5, expert_shards=1) \
        == pytest.approx(4 * dense)
    assert plain.zero3_working_bytes(whole, 1, False, expert_share=0.5, expert_shards=2) \
        == pytest.approx(4 * (dense + experts / 2))
    assert mixed.zero3_working_bytes(whole, 1, False, expert_share=0.5, expert_shards=1) \
        == pytest.approx(6 * (dense + experts / 2))


def test_simulated_peak_drops_by_the_state_difference():
    def peak(state):
        model = load_model({**GPT, "optimizer_state": state})
        plan = plan_from_dict({
            "format": "hyperpipe.plan/1", "model": model.to_dict(),
            "cluster": cluster_ref(CLUSTER), "global_batch": 2, "schedule": "1f1b",
            "pipelines": [{"micro_batch": 1, "num_microbatches": 2,
                           "stages": [{"layers": [0, 4], "devices": ["a/0"]}]}]})
        res = simulate(plan, CostModel(model, CLUSTER), SimOptions(trace=False))
        return res.metrics.peak_memory_bytes["a/0"], model.params
    mixed, params = peak("mixed")
    plain, _ = peak("model-dtype")
    assert mixed - plain == pytest.approx(params * (18 - 8))


def test_optimizer_state_round_trips_and_bad_values_exit_2(tmp_path, capsys):
    model = load_model({**GPT, "optimizer_state": "bf16-moments"})
    assert model.to_dict()["optimizer_state"] == "bf16-moments"
    assert load_model(model.to_dict()) == model
    assert "optimizer_state" not in load_model(GPT).to_dict()
    with pytest.raises(BadInput, match="optimizer_state"):
        load_model({**GPT, "optimizer_state": "fp8"})
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**GPT, "optimizer_state": "fp8"}))
    assert main(["simulate", "--cluster", "demo-hetero", "--model", str(path), "--pp", "1",
                 "--micro-batch", "1", "--global-batch", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "optimizer_state" in err and "model-dtype" in err and "\n" not in err


def test_autocast_casts_each_weight_at_use_and_its_gradient_back():
    # per use: read the fp32 weight (4), write its bf16 copy (2); the gradient's cast back
    # moves as many; F casts, W (and B, which holds it) casts back, I reuses F's casts;
    # the embedding's lookup is not autocast. A100's achievable bandwidth, both tiers of
    # compute pricing: the GEMM curve (catalog A100) and the flat roofline (`unit`).
    catalog = load_cluster({"name": "a100", "nodes": [{"name": "a", "device": "A100-80GB",
                                                       "count": 2}],
                            "inter_node": {"bandwidth": 1e9, "latency": 1e-5}})
    for cluster, device in ((catalog, "A100-80GB"), (CLUSTER, "unit")):
        mixed = CostModel(load_model(GPT), cluster)
        amp = CostModel(load_model({**GPT, "optimizer_state": "autocast"}), cluster)
        bw = cluster.device_types[device].achievable_mem_bandwidth_bytes_per_s
        for i, layer in enumerate(amp.model.layers):
            cast = 0.0 if layer.kind == "embedding" else layer.params * 6 / bw
            for op, casts in (("F", 1), ("I", 0), ("W", 1), ("B", 1)):
                for tp in (1, 2):
                    got = amp.layer_time_s(i, device, 1, op, tp) - \
                        mixed.layer_time_s(i, device, 1, op, tp)
                    assert got == pytest.approx(casts * cast / tp, rel=1e-9, abs=1e-15)


def test_autocast_moves_fp32_weights():
    # ZeRO-1's all-gather of the updated weights and ZeRO-2's carry the stored fp32
    # weight (4 bytes), not a bf16 copy: (fp32 grad 4 + weight 4) / 2 and 4 / 2
    amp = CostModel(load_model({**GPT, "optimizer_state": "autocast"}), CLUSTER)
    mixed = CostModel(load_model(GPT), CLUSTER)
    assert amp.dp_sync_bytes_per_param(zero=1) == pytest.approx((4 + 4) / 2)
    assert mixed.dp_sync_bytes_per_param(zero=1) == pytest.approx((4 + 2) / 2)
    assert amp.dp_sync_bytes_per_param(zero=2) == pytest.approx(4 / 2)
    # Adam reads the fp32 gradient and reads and writes weight and moments: 28 bytes
    whole = (0, amp.model.num_layers)
    assert amp.optimizer_time_s(whole, "unit") == pytest.approx(
        mixed.optimizer_time_s(whole, "unit"))
