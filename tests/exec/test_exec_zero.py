"""ZeRO-2 and ZeRO-3 (FSDP2) in real runs (gloo, tiny-gpt in fp32), alone and inside a
two-stage pipeline.

Oracle: a single process training the whole model on the whole batch
(`factories.single_process`). Losses of three steps within 2e-4, the last step's
gradients within 1e-5 and the final weights within lr / 2 (see test_exec_parallel for
why weights get that tolerance) on every rank holding each layer. Memory: the
parameter bytes FSDP2 leaves on each rank against the closed form of dim-0 sharding.
"""

from __future__ import annotations

import math

import pytest
import torch
from factories import assert_trains_like_single_process, plan_doc

from hyperpipe.core.errors import BadInput
from hyperpipe.exec.placement import check_runnable
from hyperpipe.models import build_stage, load_model
from hyperpipe.plan.plan import plan_from_dict

LOSS_TOL = 2e-4
TOL = 1e-5
LR = 1e-3


def _stage(layers, device: int) -> dict:
    return {"layers": list(layers), "devices": [f"n/{device}"], "tp": 1}


def _plan(zero: int, pp: int, reshard: bool | None = None, kind: str = "1f1b", **top):
    cuts = [(0, 8)] if pp == 1 else [(0, 4), (4, 8)]
    pipes = [{"micro_batch": 2, "num_microbatches": 2,
              "stages": [_stage(c, q * pp + k) for k, c in enumerate(cuts)]} for q in (0, 1)]
    if reshard is not None:
        top["runtime"] = {"reshard_after_forward": reshard}
    return plan_from_dict(plan_doc(pipes, schedule=kind, zero=zero, **top))


def _trains_like_single_process(plan, steps: int, *, emulate: bool):
    """`factories.assert_trains_like_single_process` at this file's tolerances."""
    return assert_trains_like_single_process(plan, steps, loss_tol=LOSS_TOL, grad_tol=TOL,
                                             lr=LR, emulate=emulate)


@pytest.mark.slow
@pytest.mark.parametrize("zero,pp,reshard", [
    (3, 1, None),       # not pipelined: FSDP's default, gathered again for backward
    (3, 2, None),       # pipelined: torchtitan's default, one gather, one scatter a step
    (3, 2, True),       # gathered and reduce-scattered every micro-batch
    (2, 1, None),
    (2, 2, None),
])
def test_zero_trains_like_single_process(zero, pp, reshard):
    plan = _plan(zero, pp, reshard)
    result = _trains_like_single_process(plan, 3, emulate=False)
    ops = {e.op for e in result.trace.events}
    assert {"allgather", "reducescatter"} <= ops
    scatters = [e for e in result.trace.events if e.op == "reducescatter" and e.step == 2
                and e.device == "n/0"]
    if zero == 2:       # every micro-batch's backward scatters each bucket
        assert len(scatters) >= plan.pipelines[0].num_microbatches
    if zero == 3:
        units = 8 // pp                          # one per layer of the rank's stage
        resharding = reshard if reshard is not None else pp == 1
        m = plan.pipelines[0].num_microbatches
        assert len(scatters) == units * (m if resharding else 1)


@pytest.mark.slow
def test_zero3_interleaved_gathers_every_stage_at_the_step_start():
    # pp 2 x 2 chunks x dp 2, zero 3 without resharding: a rank of two stages issues
    # all four of its units' gathers before its first forward ends, and trains like
    # one process
    cuts = [(0, 2), (2, 4), (4, 6), (6, 8)]
    pipes = [{"micro_batch": 2, "num_microbatches": 2,
              "stages": [_stage(c, q * 2 + k % 2) for k, c in enumerate(cuts)]}
             for q in (0, 1)]
    plan = plan_from_dict(plan_doc(pipes, schedule={"kind": "interleaved-1f1b",
                                                    "chunks": 2}, zero=3))
    result = _trains_like_single_process(plan, 3, emulate=False)
    for device in ("n/0", "n/1"):
        events = [e for e in result.trace.events if e.step == 2 and e.device == device]
        first_f = min((e for e in events if e.op == "F"), key=lambda e: e.start_s)
        gathers = [e for e in events if e.op == "allgather"]
        assert len(gathers) == 4                       # two units a stage, once a step
        assert max(e.start_s for e in gathers) <= first_f.end_s


@pytest.mark.slow
def test_zero3_parameter_bytes_per_rank_are_the_dim0_shards(tmp_path):
    """FSDP2 shards every parameter on dim 0 into ceil(d0 / dp) rows per rank (the last
    ranks fewer): each rank keeps about 1/dp of the parameters, all ranks together
    exactly all of them."""
    spec = load_model("tiny-gpt")
    module = build_stage(spec, 0, spec.num_layers, 0)
    dp = 2
    expected = [0] * dp
    for p in module.parameters():
        rows = math.ceil(p.shape[0] / dp)
        for r in range(dp):
            expected[r] += max(0, min(rows, p.shape[0] - r * rows)) * (p.numel() // p.shape[0])
    torch.multiprocessing.spawn(_shard_sizes, args=(dp, str(tmp_path)), nprocs=dp, join=True)
    got = [int((tmp_path / f"{r}.txt").read_text()) for r in range(dp)]
    assert got == expected
    total = sum(p.numel() for p in module.parameters())
    assert sum(got) == total
    assert max(got) == pytest.approx(total / dp, rel=0.01)


def _shard_sizes(rank: int, world: int, where: str) -> None:
    import torch.distributed as dist

    from hyperpipe.exec.fsdp import ShardedStages
    from hyperpipe.exec.tensor_parallel import local
    store = dist.FileStore(f"{where}/store", world)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    spec = load_model("tiny-gpt")
    module = build_stage(spec, 0, spec.num_layers, 0)
    sharded = ShardedStages([(tuple(range(world)), tuple(range(spec.num_layers)))], rank,
                            {0: (module, list(module.layers.values()))}, ["a", "b"],
                            reshard=True, timeout_s=60, clock=lambda: 0.0)
    assert sharded.roots
    n = sum(local(p).numel() for p in module.parameters())
    with open(f"{where}/{rank}.txt", "w") as f:
        f.write(str(n))
    dist.destroy_process_group()


@pytest.mark.parametrize("plan,field", [
    (lambda: _plan(3, 2, kind="zb-h1"), "schedule"),
    (lambda: plan_from_dict(plan_doc([{"micro_batch": 2, "num_microbatches": 2, "stages": [
        {"layers": [0, 8], "devices": [f"n/{2 * q}", f"n/{2 * q + 1}"], "tp": 2}]}
        for q in (0, 1)], zero=3)), "tp"),
    (lambda: plan_from_dict(plan_doc([{"micro_batch": 2, "num_microbatches": m, "stages": [
        _stage((0, 8), q)]} for q, m in ((0, 2), (1, 3))], zero=2)), "num_microbatches"),
    (lambda: plan_from_dict(plan_doc([
        {"micro_batch": 2, "num_microbatches": 2, "stages": [_stage((0, 4), 0),
                                                             _stage((4, 8), 1)]},
        {"micro_batch": 2, "num_microbatches": 2, "stages": [_stage((0, 5), 2),
                                                             _stage((5, 8), 3)]}],
        zero=3)), "stages"),
])
def test_zero_plans_the_executor_cannot_shard_are_refused(plan, field):
    p = plan()
    with pytest.raises(BadInput, match=field):
        check_runnable(p, p.load_model())


# two nodes of one A100 each behind a slow NIC: every ZeRO-3 gather and reduce-scatter
# crosses it, as a flow of the link emulator
SLOW_NODES = {"nodes": [{"name": "x", "device": "A100-80GB", "count": 1},
                        {"name": "y", "device": "A100-80GB", "count": 1}],
              "inter_node": {"bandwidth": "200 Mbit/s", "latency": "100 us"}}


@pytest.mark.slow
def test_emulated_zero3_collectives_take_their_link_time_and_train_alike():
    plan = plan_from_dict(plan_doc(
        [{"micro_batch": 2, "num_microbatches": 2, "stages": [
            {"layers": [0, 8], "devices": [d], "tp": 1}]} for d in ("x/0", "y/0")],
        cluster=SLOW_NODES, zero=3))
    result = _trains_like_single_process(plan, 2, emulate=True)
    bandwidth = 200e6 / 8
    for device in ("x/0", "y/0"):
        events = [e for e in result.trace.events if e.step == 1 and e.device == device]
        comm = [e for e in events if e.op in ("allgather", "reducescatter")]
        # closed form: each collective of a pair is one ring step of half its bytes
        # from the peer, over the peer's NIC and this one, one after another
        bound_s = sum(e.bytes / 2 for e in comm) / bandwidth
        span = max(e.end_s for e in events) - min(e.start_s for e in events)
        # not pipelined, so resharded after forward: every micro-batch reduce-scatters
        # each of the 8 units and gathers each for its forward and again its backward
        assert sum(e.op == "reducescatter" for e in comm) == 8 * 2
        assert sum(e.op == "allgather" for e in comm) >= 8 * 2
        assert span >= bound_s
