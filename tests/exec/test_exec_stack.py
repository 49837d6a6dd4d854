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


def _plan(runtime: dict) -> object:
    def pipe(r):
        return {"micro_batch": 2, "num_microbatches": 4, "stages": [
            {"layers": [0, 4], "devices": [f"a100/{r}"]},
            {"layers": [4, 8], "devices": [f"v100/{r}"]}]}
    return plan_from_dict({"format": "hyperpipe.plan/1", "model": "tiny-gpt",
                           "cluster": "demo-hetero", "global_batch": 16,
                           "schedule": {"kind": "1f1b", "chunks": 1},
                           "stack": "megatron-deepspeed", "runtime": runtime,
                           "pipelines": [pipe(0), pipe(1)]})


@pytest.mark.parametrize("emulate", [True, False])
def test_blocking_sends_and_reduction_after_the_flush(tmp_path, emulate):
    plan = _plan({"p2p": "blocking", "overlap_grad_reduce": False})
    path = tmp_path / "t.json"
    run_plan(plan, RunOptions(steps=1, emulate=emulate, trace_path=str(path),
                              probe_links=False, emulation_scale=1.0))
    events = [e for e in load_trace(path).events if e.step == 0]
    for dev in plan.devices:
        mine = sorted((e for e in events if e.device == dev), key=lambda e: e.start_s)
        compute = [e for e in mine if e.op in ("F", "B")]
        for send in (e for e in mine if e.op == "send"):
            after = [c for c in compute if c.start_s >= send.start_s]
            # the sender's next action starts once the message is delivered
            assert not after or after[0].start_s >= send.end_s - 1e-6, (dev, send)
        last = max(c.end_s for c in compute)
        reduce = [e for e in mine if e.op == "allreduce"]
        assert reduce and min(e.start_s for e in reduce) >= last - 1e-6, dev


def test_the_stack_does_not_change_what_is_learnt():
    assert_trains_like_single_process(_plan({"p2p": "blocking",
                                             "overlap_grad_reduce": False}), 2,
                                      loss_tol=1e-5, grad_tol=1e-5)
