"""Memory at scale (issue 9): per-layer activations against Korthikanti et al. 2022's
formulas, state bytes against Megatron's documented per-parameter counts, and the
simulator's peak against the closed form with recompute and the distributed optimizer."""

from __future__ import annotations

import pytest

from hyperpipe.cluster.catalog import FRAGMENTATION_FRACTION, RUNTIME_FIXED_BYTES
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.models.spec import GPTConfig, TransformerBlock
from hyperpipe.plan.plan import PipelinePlan, Plan, StagePlan
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate

# Korthikanti et al.'s setting: 16-bit activations, dropout on, eager attention
S, B, H, A = 2048, 2, 1024, 16
SBH = S * B * H


def _block(attention: str = "eager", dropout: float = 0.1) -> TransformerBlock:
    return TransformerBlock(GPTConfig(vocab_size=1000, n_layer=2, n_head=A, d_model=H,
                                      seq_len=S, dropout=dropout, attention=attention))


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_block_activations_match_korthikanti(t):
    blk = _block()

    def stash(**kw):
        return blk.stash_bytes(B, S, 2, tp=t, **kw)

    core = 5 * A * S / H                     # 5as²b / sbh
    # sec. 4.2.2, eq. (2): tensor parallelism without sequence parallelism
    assert stash() == pytest.approx(SBH * (10 + 24 / t + core / t), rel=1e-12)
    if t > 1:                                # sec. 4.2.3, eq. (4): with it
        assert stash(sequence_parallel=True) == pytest.approx(SBH / t * (34 + core),
                                                               rel=1e-12)
        # sec. 5 / table 2: selective recompute with sequence parallelism
        assert stash(sequence_parallel=True, recompute="selective") == \
            pytest.approx(34 * SBH / t, rel=1e-12)
        assert stash(sequence_parallel=True, recompute="full") == pytest.approx(2 * SBH / t)
    assert stash(recompute="selective") == pytest.approx(SBH * (10 + 24 / t), rel=1e-12)
    assert stash(recompute="full") == pytest.approx(2 * SBH)   # sec. 4.3: the block input


def test_flash_keeps_no_scores():
    eager, flash = _block("eager"), _block("flash")
    # flash drops the 5as²b scores/softmax/dropout and keeps its fp32 log-sum-exp
    assert flash.stash_bytes(B, S, 2) == pytest.approx(34 * SBH + 4 * A * S * B)
    assert eager.stash_bytes(B, S, 2) - flash.stash_bytes(B, S, 2) == \
        pytest.approx(5 * A * S * S * B - 4 * A * S * B)
    # nothing left to recompute selectively under flash
    assert flash.stash_bytes(B, S, 2, recompute="selective") == flash.stash_bytes(B, S, 2)
    # the layer's own cost agrees with the plain (tp 1, no recompute) stash
    assert eager.cost(B, S, 2).stash_bytes == eager.stash_bytes(B, S, 2)


@pytest.mark.parametrize("dtype,kept,shardable", [
    ("bf16", 6, 12), ("fp16", 4, 16), ("fp32", 8, 8)])
def test_state_bytes_per_parameter(dtype, kept, shardable):
    # Megatron Core "Distributed Optimizer": 18 / 20 / 16 bytes, 6 + 12/d, 4 + 16/d, 8 + 8/d
    model = load_model({"preset": "gpt3-1.3b", "dtype": dtype})
    cost = CostModel(model, load_cluster("a100-v100"))
    n = cost.stage_params((1, 5))
    assert cost.state_bytes_per_param == kept + shardable
    assert cost.state_bytes((1, 5)) == pytest.approx(n * (kept + shardable))
    assert cost.state_bytes((1, 5), tp=4) == pytest.approx(n * (kept + shardable) / 4)
    assert cost.state_bytes((1, 5), tp=2, dp_shards=8) == \
        pytest.approx(n * (kept + shardable / 8) / 2)
    assert cost.grad_bytes_per_param == (2 if dtype == "fp16" else 4)


def test_runtime_reserve_in_catalog():
    a100 = load_cluster("a100-1024").device_types["A100-80GB"]
    assert a100.runtime_reserve_bytes == pytest.approx(
        RUNTIME_FIXED_BYTES + FRAGMENTATION_FRACTION * 80 * 2**30)    # "80 GB": 80 GiB
    assert 3e9 < a100.runtime_reserve_bytes < 8e9        # a few GB of an 80 GB part
    user = load_cluster({"device_types": {"x": {"peak_flops": "1 TFLOP/s", "memory": "1 GB"}},
                         "nodes": [{"device": "x", "count": 1}]})
    assert user.device_types["x"].runtime_reserve_bytes == 0.0
    small = load_cluster({"device_types": {"A100-80GB": {"memory": "40 GB"}},
                          "nodes": [{"device": "A100-80GB", "count": 1}]})
    assert small.device_types["A100-80GB"].runtime_reserve_bytes == pytest.approx(
        RUNTIME_FIXED_BYTES + FRAGMENTATION_FRACTION * 40e9)


def _plan(model, recompute="none", seq_par=False, dp=1, dist_opt=False, tp=2, m=4):
    """pp 2 x dp `dp` on one DGX node of a100-1024, tp `tp`, 1F1B, micro-batch 1."""
    n = model.num_layers
    pipes = []
    for r in range(dp):
        devs = [tuple(f"dgx-0/{(r * 2 + k) * tp + i}" for i in range(tp)) for k in range(2)]
        stages = (StagePlan((0, n // 2), devs[0], tp, recompute, seq_par),
                  StagePlan((n // 2, n), devs[1], tp, recompute, seq_par))
        pipes.append(PipelinePlan(1, m, stages))
    return Plan(model="x", cluster="a100-1024", global_batch=dp * m, schedule="1f1b",
                chunks=1, pipelines=tuple(pipes), zero=1 if dist_opt else 0)


@pytest.mark.parametrize("recompute,seq_par", [("none", False), ("selective", True),
                                               ("full", True), ("full", False)])
def test_simulated_peak_is_the_closed_form(recompute, seq_par):
    model = load_model({"preset": "gpt3-1.3b", "n_layer": 6, "attention": "eager"})
    cluster = load_cluster("a100-1024")
    cost = CostModel(model, cluster)
    plan = _plan(model, recompute, seq_par)
    plan.check(model, cluster)
    peak = simulate(plan, cost).metrics.peak_memory_bytes
    s, h, a, t, v = model.seq_len, model.config.d_model, model.config.n_head, 2, 50257
    sbh = s * h                                  # micro-batch 1
    per_block = {("none", False): sbh * (10 + 24 / t) * 2 / 2 + 2 * a * s * s / t,
                 ("selective", True): 34 * sbh / t,
                 ("full", True): 2 * sbh / t, ("full", False): 2 * sbh}[(recompute, seq_par)]
    # dropout 0 in the preset: no masks (the 1-byte ones of the 34), so correct for them
    if recompute != "full":
        per_block -= 2 * sbh / (t if seq_par else 1)
    r = t if seq_par else 1
    full_block = sbh * (8 / r + 24 / t) + 2 * a * s * s / t   # no dropout, eager
    work = 0.0 if recompute == "none" else full_block - per_block
    if recompute == "selective":
        work = 2 * a * s * s / t                          # one layer's recomputed scores
    reserve = cluster.device_types["A100-80GB"].runtime_reserve_bytes
    norm = 2 * sbh * 2 / r
    first = s * 8 + 3 * per_block                         # embedding ids + blocks 1..3
    last = 3 * per_block + norm + s * v * 4 / t           # blocks 4..6 + head
    params = [cost.stage_params((0, 4)), cost.stage_params((4, 8))]
    # the head's backward casts the fp32 logit gradient to bf16 while the fp32 one lives;
    # it runs before any block of its stage is recomputed, so the larger of the two counts
    head_work = s * v * 2 / t
    for k, (stash, inflight) in enumerate(((first, 2), (last, 1))):
        held = work if k == 0 else max(work, head_work)
        expected = reserve + params[k] * 18 / t + held + inflight * stash
        for dev in plan.pipelines[0].stages[k].devices:
            assert peak[dev] == pytest.approx(expected, rel=1e-9)


def test_distributed_optimizer_shards_the_optimizer_state():
    model = load_model({"preset": "gpt3-1.3b", "n_layer": 6})
    cost = CostModel(model, load_cluster("a100-1024"))
    plain = simulate(_plan(model, dp=2), cost).metrics.peak_memory_bytes
    sharded = simulate(_plan(model, dp=2, dist_opt=True), cost).metrics.peak_memory_bytes
    n = cost.stage_params((0, 4))
    # 12 bytes of fp32 master + Adam moments per parameter, split over 2 replicas, per tp 2
    assert plain["dgx-0/0"] - sharded["dgx-0/0"] == pytest.approx(n * 12 / 2 / 2)


def test_cpu_fp32_model_keeps_its_figures():
    tiny = load_model("tiny-gpt")
    cost = CostModel(tiny, load_cluster("demo-hetero"))
    assert tiny.dtype == "fp32" and cost.state_bytes_per_param == 16   # fp32 Adam: 4+4+8
    c = tiny.config
    b, s, h, a = 2, c.seq_len, c.d_model, c.n_head
    # eager, fp32 (4 bytes), no dropout: 4 norm/inputs + QKV, out-proj, GELU in and out,
    # and the softmax output
    assert cost.stash_bytes((1, 2), b) == pytest.approx(
        4 * (b * s * h * (4 + 4 + 8) + a * s * s * b))
