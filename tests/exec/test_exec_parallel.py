"""Tensor parallelism, sequence parallelism, activation recompute and the distributed
optimizer in real runs (gloo, tiny-gpt in fp32), alone and together.

Oracle: a single process training the whole model on the whole batch (`build_model`,
the same data stream, torch's own AdamW). Every gradient of the last step must match it
within 1e-5 on every rank that holds the layer; after more than one step (the last
step's gradients then depend on the updated weights), so must every loss, and every
weight within lr / 2: AdamW's first steps move each weight by about lr
whatever the gradient's size (m / sqrt(v)), so an element whose gradient is near zero
turns a 1e-7 rounding difference into a visible step; a wrong, missing or doubled
shard update is off by lr = 1e-3 or more.
"""

from __future__ import annotations

import pytest
import torch
from factories import assert_trains_like_single_process, plan_doc, single_process

from hyperpipe.exec import RunOptions, run_plan
from hyperpipe.plan.plan import plan_from_dict

pytestmark = pytest.mark.slow

TOL = 1e-5
LR = 1e-3


def plan_of(pipelines: list[dict], kind: str = "1f1b", **top) -> object:
    return plan_from_dict(plan_doc(pipelines, schedule=kind, **top))


def stage(layers, devices, **fields) -> dict:
    return {"layers": list(layers), "devices": [f"n/{d}" for d in devices],
            "tp": len(devices), **fields}


def check(plan, steps: int = 1, **options):
    """`factories.assert_trains_like_single_process` at this file's tolerances."""
    return assert_trains_like_single_process(plan, steps, loss_tol=1e-5, grad_tol=TOL,
                                             lr=LR, **options)


@pytest.mark.parametrize("kind,stages,steps", [
    # issue 10's plan: two tp=2 stages, sequence parallelism and full recompute on the
    # first, selective on the second; three steps (AdamW on the local shards)
    ("1f1b", [stage((0, 4), (0, 1), sequence_parallel=True, recompute="full"),
              stage((4, 8), (2, 3), recompute="selective")], 3),
    # tp=1 feeds tp=2 with sequence parallelism (both ranks receive), under the I/W split
    ("zb-h1", [stage((0, 3), (0,)), stage((3, 8), (1, 2), sequence_parallel=True)], 1),
    # sequence parallelism on a stage that sends on, under the I/W split: its output is
    # the all-gather's view, which torch's I cannot detach in place (every rank failed)
    ("zb-h1", [stage((0, 4), (0, 1), sequence_parallel=True), stage((4, 8), (2,))], 1),
    ("zb-v", [stage((0, 2), (0, 1), sequence_parallel=True), stage((2, 4), (2,)),
              stage((4, 6), (2,)), stage((6, 8), (0, 1), sequence_parallel=True)], 1),
])
def test_tensor_and_sequence_parallel_train_like_single_process(kind, stages, steps):
    check(plan_of([{"micro_batch": 2, "num_microbatches": 4, "stages": stages}], kind), steps)


def test_heads_wider_than_d_model_over_n_head_split_like_single_process():
    # Qwen3-style attention: 4 heads of 48 on d_model 128 (Q and the output projection
    # 192 wide), split over tp 2 with sequence parallelism
    check(plan_of([{"micro_batch": 2, "num_microbatches": 2, "stages": [
        stage((0, 4), (0, 1), sequence_parallel=True), stage((4, 8), (2,))]}],
        model={"preset": "tiny-gpt", "head_dim": 48}))


def test_recompute_full_and_selective_gradients_equal_single_process():
    check(plan_of([{"micro_batch": 2, "num_microbatches": 3, "stages": [
        stage((0, 4), (0,), recompute="full"), stage((4, 8), (1,), recompute="selective")]}],
        "zb-h1"))


def test_distributed_optimizer_with_unequal_replicas_trains_like_single_process():
    # two replicas cut differently (heterogeneous data parallelism), 2 and 5 micro-batches:
    # three reduce-scatter groups (layers 0-2, 3, 4-7), weights after two AdamW steps
    check(plan_of([
        {"micro_batch": 2, "num_microbatches": 2, "stages": [stage((0, 4), (0,)),
                                                             stage((4, 8), (1,))]},
        {"micro_batch": 1, "num_microbatches": 5, "stages": [stage((0, 3), (2,)),
                                                             stage((3, 8), (3,))]}],
        distributed_optimizer=True), steps=2)


@pytest.mark.parametrize("distributed", [False, True])
def test_bucketed_reduction_overlaps_backward_and_trains_like_single_process(distributed):
    # small buckets (20 kB of fp32 gradient: a few parameters each), unequal replicas
    plan = plan_of([
        {"micro_batch": 2, "num_microbatches": 3, "stages": [stage((0, 4), (0,)),
                                                             stage((4, 8), (1,))]},
        {"micro_batch": 1, "num_microbatches": 2, "stages": [stage((0, 4), (2,)),
                                                             stage((4, 8), (3,))]}],
        distributed_optimizer=distributed)
    result = check(plan, steps=2, bucket_bytes=2e4)
    events = [e for e in result.trace.events if e.step == 1]
    for device in ("n/1", "n/3"):       # last stages: their last B ends their step
        last_b = max((e for e in events if e.device == device and e.op == "B"),
                     key=lambda e: e.end_s)
        starts = sorted(e.start_s for e in events
                        if e.device == device and e.op == "allreduce")
        assert len(starts) > 3
        # hooks started the first buckets while that backward was still running
        assert starts[0] < last_b.end_s


def test_everything_together_trains_like_single_process():
    # tp=2 with sequence parallelism and full recompute feeding tp=1 with selective
    # recompute (one sender, two gradient receivers), two replicas of unequal
    # micro-batch counts, distributed optimizer
    def pipe(devices, mb, m):
        return {"micro_batch": mb, "num_microbatches": m, "stages": [
            stage((0, 5), devices[:2], sequence_parallel=True, recompute="full"),
            stage((5, 8), devices[2:], recompute="selective")]}
    check(plan_of([pipe((0, 1, 2), 2, 1), pipe((3, 4, 5), 1, 3)],
                  distributed_optimizer=True), steps=2)


@pytest.mark.parametrize("model", ["tiny-gpt", {"preset": "tiny-gpt", "n_head": 8,
                                                 "n_kv_head": 4}])
def test_replicas_of_different_tp_train_like_single_process(model):
    # one layer's replicas sharded to tp 1, 2 and 4 (the search's heterogeneous
    # replicas): ring i of the largest degree reduces slice i of every replica's
    # gradients, a smaller degree's rank taking part in several rings with its sub-slices
    # (grouped-query QKV rows included), its whole copy of a replicated parameter in each
    check(plan_of([
        {"micro_batch": 2, "num_microbatches": 2, "stages": [stage((0, 8), (0,))]},
        {"micro_batch": 1, "num_microbatches": 3, "stages": [
            stage((0, 5), (1, 2), sequence_parallel=True), stage((5, 8), (3,))]},
        {"micro_batch": 1, "num_microbatches": 2, "stages": [
            stage((0, 8), (4, 5, 6, 7), recompute="selective")]}], model=model), steps=2)


# two nodes of three, one slow NIC each: every message, ring step and tensor-parallel
# collective of an emulated run crosses the link emulator (exec.links)
TWO_NODES = {"nodes": [{"name": "x", "device": "A100-80GB", "count": 3},
                       {"name": "y", "device": "V100-32GB", "count": 3}],
             "inter_node": {"bandwidth": "1 Gbit/s", "latency": "100 us"}}


@pytest.mark.parametrize("distributed", [False, True])
def test_emulated_links_train_like_single_process(distributed):
    # four replicas of one stage over two nodes of two (x/0 x/1 | y/0 y/1): without the
    # distributed optimizer a hierarchical all-reduce (node, rails, node), with it a ring
    # reduce-scatter and all-gather; then a tp=2 stage on x feeding y/2: tensor-parallel
    # ring steps and point-to-point messages over the emulated links
    def one(device, m):
        return {"micro_batch": 1, "num_microbatches": m,
                "stages": [{"layers": [0, 8], "devices": [device]}]}
    dp = plan_from_dict(plan_doc([one(d, m) for d, m in
                                  (("x/0", 2), ("x/1", 1), ("y/0", 3), ("y/1", 2))],
                                 cluster=TWO_NODES, distributed_optimizer=distributed))
    result = check(dp, steps=2, emulate=True, probe_links=True, bucket_bytes=1e6)
    assert result.emulated
    tp = plan_from_dict(plan_doc([{"micro_batch": 2, "num_microbatches": 2, "stages": [
        {"layers": [0, 5], "devices": ["x/0", "x/1"], "tp": 2,
         "sequence_parallel": distributed},
        {"layers": [5, 8], "devices": ["y/2"], "tp": 1}]}], cluster=TWO_NODES))
    check(tp, steps=2, emulate=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL tensor parallelism needs two GPUs (one rank per GPU)")
def test_nccl_bf16_tensor_parallel_matches_cpu_reference():
    from oracles import BF16_LOSS_TOL, close_bf16
    plan = plan_of([{"micro_batch": 2, "num_microbatches": 2, "stages": [
        stage((0, 8), (0, 1), sequence_parallel=True, recompute="selective")]}])
    result = run_plan(plan, RunOptions(steps=1, capture_state=True, probe_links=False))
    meta = result.trace.meta
    assert meta["backend"] == "nccl" and meta["precision"] == "bf16-autocast"
    losses, grads, _ = single_process(plan, 1, lr=LR)
    assert abs(result.losses[0] - losses[0]) <= BF16_LOSS_TOL
    for rank_state in result.state:
        for name, st in rank_state.items():
            assert close_bf16(st["grad"].float(), grads[name]), name


def test_link_emulation_holds_messages_until_the_route_delivers_them():
    # two nodes behind a 20 Mbit/s, 1 ms link: each 64 KiB activation (2 x 64 x 128 fp32)
    # takes 26.2 ms on the wire, one after another, then 1 ms of latency
    slow = {"nodes": [{"name": "a", "device": "A100-80GB", "count": 1},
                      {"name": "b", "device": "A100-80GB", "count": 1}],
            "inter_node": {"bandwidth": "20 Mbit/s", "latency": "1 ms"}}
    plan = plan_from_dict({
        "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": slow,
        "global_batch": 8, "schedule": "gpipe", "pipelines": [{
            "micro_batch": 2, "num_microbatches": 4,
            "stages": [{"layers": [0, 4], "devices": ["a/0"]},
                       {"layers": [4, 8], "devices": ["b/0"]}]}]})
    result = run_plan(plan, RunOptions(steps=2, probe_links=False))
    assert result.emulated
    wire_s, latency_s = 2 * 64 * 128 * 4 / 2.5e6, 1e-3
    events = [e for e in result.trace.events if e.step == 1]
    first_send = min(e.start_s for e in events if e.op == "send" and e.device == "a/0")
    arrivals = sorted(e.end_s for e in events if e.op == "recv" and e.device == "b/0")
    assert len(arrivals) == 4
    for k, end in enumerate(arrivals):      # closed form: serialised on the route
        assert end >= first_send + (k + 1) * wire_s + latency_s - 1e-3, k
    # the whole step: at least the 8 messages' wire time (4 forward, then 4 back)
    assert result.step_times_s[1] >= 8 * wire_s
