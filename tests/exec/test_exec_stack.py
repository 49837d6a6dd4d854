"""A plan's stack in real runs: `runtime.p2p: blocking` holds a sender until its message
is delivered, and `runtime.overlap_grad_reduce: false` reduces gradients after the
rank's last action (both were ignored: every run sent asynchronously and overlapped).

Oracle: the run's own trace (what each rank did, in its order) and a single process
(the losses and gradients do not change with how the messages are timed)."""

from __future__ import annotations

import pytest
from factories import assert_trains_like_single_process

from hyperpipe.exec import RunOptions, run_plan
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.plan.trace import load_trace

pytestmark = pytest.mark.slow


SLOW_BYTES_PER_S = 12.5e6       # 100 Mbit/s between the two nodes


def _plan(runtime: dict, **top) -> object:
    def pipe(r):
        return {"micro_batch": 2, "num_microbatches": 4, "stages": [
            {"layers": [0, 4], "devices": [f"a/{r}"]},
            {"layers": [4, 8], "devices": [f"v/{r}"]}]}
    link = {"bandwidth": SLOW_BYTES_PER_S, "latency": 1e-4}
    cluster = {"name": "slow", "nodes": [{"name": "a", "device": "A100-80GB", "count": 2},
                                         {"name": "v", "device": "V100-32GB", "count": 2}],
               "inter_node": link}
    return plan_from_dict({"format": "hyperpipe.plan/1", "model": "tiny-gpt",
                           "cluster": cluster, "global_batch": 16,
                           "schedule": {"kind": "1f1b", "chunks": 1},
                           "stack": "megatron-deepspeed", "runtime": runtime,
                           "pipelines": [pipe(0), pipe(1)], **top})


def _step0(plan, tmp_path, emulate: bool) -> list:
    path = tmp_path / "t.json"
    run_plan(plan, RunOptions(steps=1, emulate=emulate, trace_path=str(path),
                              probe_links=False, emulation_scale=1.0))
    return [e for e in load_trace(path).events if e.step == 0]


@pytest.mark.parametrize("emulate", [True, False])
def test_blocking_sends_and_reduction_after_the_flush(tmp_path, emulate):
    plan = _plan({"p2p": "blocking", "overlap_grad_reduce": False})
    events = _step0(plan, tmp_path, emulate)
    for dev in plan.devices:
        mine = sorted((e for e in events if e.device == dev), key=lambda e: e.start_s)
        compute = [e for e in mine if e.op in ("F", "B")]
        sends = [e for e in mine if e.op == "send"]
        for send in sends:
            after = [c for c in compute if c.start_s >= send.start_s]
            # the sender's next action starts once the message is delivered
            assert not after or after[0].start_s >= send.end_s - 1e-6, (dev, send)
            if emulate:     # delivered: across the emulated 100 Mbit/s link
                assert send.end_s - send.start_s >= 0.95 * send.bytes / SLOW_BYTES_PER_S
        assert sends, dev
        last = max(c.end_s for c in compute)
        reduce = [e for e in mine if e.op == "allreduce"]
        assert reduce and min(e.start_s for e in reduce) >= last - 1e-6, dev


def test_zero2_scatters_every_micro_batch_without_overlap(tmp_path):
    """ZeRO-2 frees each micro-batch's gradients by reduce-scattering them (the
    simulator prices it so whatever the overlap): without overlap it had waited for the
    flush, one scatter a step, ZeRO-1's behaviour and memory."""
    plan = _plan({"overlap_grad_reduce": False}, zero=2)
    events = _step0(plan, tmp_path, emulate=False)
    for dev in plan.devices:
        assert sum(1 for e in events if e.device == dev and e.op == "reducescatter") == 4


def test_the_stack_does_not_change_what_is_learnt():
    assert_trains_like_single_process(_plan({"p2p": "blocking",
                                             "overlap_grad_reduce": False}), 2,
                                      loss_tol=1e-5, grad_tol=1e-5)
