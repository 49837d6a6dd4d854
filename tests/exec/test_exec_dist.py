"""The real executor with real processes (gloo, 2-5 local ranks, tiny-gpt in fp32).

Oracle: a single-process run of the same model, seed and batch (`build_model` and the
same data stream); pipelined loss and every parameter's gradient must match it. Each
test is one launch (the fork server makes a launch cost well under a second after the
first); they all run in CI, marked slow.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from factories import A100_NODE, plan_doc
from oracles import BF16_LOSS_TOL, close_bf16

from hyperpipe.cli import main as cli_main
from hyperpipe.exec import RunFailed, RunOptions, run_plan
from hyperpipe.exec.data import step_batch
from hyperpipe.models import build_model
from hyperpipe.plan.kinds import schedule_kind
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.plan.schedule import stage_rank
from hyperpipe.plan.trace import load_trace

pytestmark = pytest.mark.slow

TOL = 1e-5


def make_plan(kind: str, pipelines: list[tuple[int, int, list[tuple[int, int]]]],
              chunks: int = 1, cluster=None):
    """pipelines: (micro_batch, num_microbatches, [layer ranges]); devices n/0, n/1, ..."""
    dev = iter(range(64))
    pipes = []
    for mb, m, ranges in pipelines:
        p = len(ranges) // chunks
        names = [f"n/{next(dev)}" for _ in range(p)]
        pipes.append({"micro_batch": mb, "num_microbatches": m, "stages": [
            {"layers": list(r), "devices": [names[stage_rank(k, p, schedule_kind(kind).placement)]]}
            for k, r in enumerate(ranges)]})
    return plan_from_dict(plan_doc(pipes, schedule={"kind": kind, "chunks": chunks},
                                   cluster=cluster or A100_NODE))


def reference(plan, seed: int = 0):
    """Loss and gradients of the whole model on the whole batch of step 0, one process."""
    spec = plan.load_model()
    model = build_model(spec, seed)
    x, y = step_batch(spec, plan.global_batch, 0, seed)
    loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def check_against_reference(plan, result, seed: int = 0) -> None:
    ref_loss, ref_grads = reference(plan, seed)
    assert abs(result.losses[0] - ref_loss) <= TOL
    seen = set()
    for rank_state in result.state:          # every replica of a layer must match
        for name, st in rank_state.items():
            diff = (st["grad"] - ref_grads[name]).abs().max().item()
            assert diff <= TOL, (name, diff)
            seen.add(name)
    assert seen == set(ref_grads)


@pytest.mark.parametrize("kind,pipeline,chunks", [
    ("gpipe", (2, 4, [(0, 4), (4, 8)]), 1),
    ("1f1b", (1, 6, [(0, 2), (2, 4), (4, 6), (6, 8)]), 1),
    ("zb-h1", (2, 5, [(0, 3), (3, 6), (6, 8)]), 1),
    ("zb-h1", (1, 3, [(0, 1), (1, 8)]), 1),          # a first stage of the embedding alone
    ("interleaved-1f1b", (1, 5, [(0, 2), (2, 4), (4, 6), (6, 8)]), 2),
    ("zb-v", (1, 5, [(0, 2), (2, 4), (4, 6), (6, 8)]), 2),      # rank 0: stages 0, 3
    ("dualpipe-v", (1, 6, [(0, 1), (1, 3), (3, 4), (4, 5), (5, 7), (7, 8)]), 2),
])
def test_pipelined_gradients_equal_single_process(kind, pipeline, chunks):
    plan = make_plan(kind, [pipeline], chunks)
    result = run_plan(plan, RunOptions(steps=1, emulate=False, capture_state=True,
                                       probe_links=False))
    check_against_reference(plan, result)


def test_heterogeneous_data_parallel_equals_full_batch(tmp_path):
    # Two pipelines cut differently, with different micro-batch counts (and a different
    # number of stages): layers 0-1, 2-4, 5 and 6-7 each reduce over a different pair.
    plan = make_plan("1f1b", [(2, 3, [(0, 5), (5, 8)]),
                              (2, 5, [(0, 2), (2, 6), (6, 8)])])
    trace_path, chrome_path = tmp_path / "t.json", tmp_path / "c.json"
    result = run_plan(plan, RunOptions(steps=1, emulate=False, capture_state=True,
                                       trace_path=str(trace_path),
                                       chrome_path=str(chrome_path)))
    check_against_reference(plan, result)
    # the trace: every action of both pipelines, the reductions, the link probe
    trace = load_trace(trace_path)
    compute = trace.compute()
    assert len(compute) == 2 * (2 * 3 + 3 * 5)          # F and B per stage, micro-batch
    assert {e.device for e in trace.events if e.op == "allreduce"} == set(plan.devices)
    probe = [e for e in trace.events if e.step == -1]
    assert probe and all(e.op == "send" and e.bytes > 0 and e.end_s > e.start_s
                         for e in probe)
    assert {e.bytes for e in probe} >= {1024.0, 4194304.0}
    assert trace.meta["source"] == "measured" and trace.meta["emulated"] is False
    assert trace.meta["device_types"] == {d: "A100-80GB" for d in plan.devices}
    chrome = json.loads(chrome_path.read_text())
    assert sum(1 for e in chrome["traceEvents"] if e["ph"] == "X") == len(trace.events)


def test_fault_stops_every_rank_and_resume_matches_uninterrupted(tmp_path):
    plan = make_plan("1f1b", [(2, 4, [(0, 4), (4, 8)])])
    base = dict(steps=4, emulate=False, capture_state=True, probe_links=False)
    straight = run_plan(plan, RunOptions(**base))

    ckpt = str(tmp_path / "ckpt")
    t = time.monotonic()
    with pytest.raises(RunFailed) as info:
        run_plan(plan, RunOptions(**base, checkpoint_dir=ckpt, checkpoint_every=2,
                                  inject_fault=(1, 3)))
    assert time.monotonic() - t < 30
    assert str(info.value).startswith("rank 1 (n/1) failed: InjectedFault")
    assert all(code is not None and code != 0 for code in info.value.exit_codes.values())

    resumed = run_plan(plan, RunOptions(**base, checkpoint_dir=ckpt, resume=True))
    assert resumed.first_step == 2 and len(resumed.losses) == 2
    assert resumed.losses == straight.losses[2:]
    for a, b in zip(straight.state, resumed.state, strict=True):
        for name in a:
            assert torch.equal(a[name]["param"], b[name]["param"]), name

    # a checkpoint of another run (another seed) is refused before anything runs
    assert cli_main(["run", "--plan", _save(plan, tmp_path), "--checkpoint", ckpt,
                     "--resume", "--seed", "1"]) == 2


def test_cli_run_emulated_writes_trace(tmp_path, capsys):
    # a100 and v100 of the built-in demo cluster: the V100 is emulated 2.5x slower
    plan = make_plan("gpipe", [(2, 2, [(0, 5), (5, 8)])], cluster="demo-hetero")
    plan = plan_from_dict({**plan.to_dict(), "pipelines": [{
        **plan.to_dict()["pipelines"][0], "stages": [
            {"layers": [0, 5], "devices": ["a100/0"]},
            {"layers": [5, 8], "devices": ["v100/0"]}]}]})
    trace_path = tmp_path / "t.json"
    assert cli_main(["run", "--plan", _save(plan, tmp_path), "--steps", "2",
                     "--trace", str(trace_path)]) == 0
    out = capsys.readouterr().out
    assert "step 1" in out and str(trace_path) in out and "emulated" in out
    trace = load_trace(trace_path)
    assert trace.meta["emulated"] is True
    cluster = plan.load_cluster()
    speed = {d: cluster.device(d).type.achievable_flops for d in ("a100/0", "v100/0")}
    assert trace.meta["emulation_factors"] == pytest.approx(
        {"a100/0": 1.0, "v100/0": speed["a100/0"] / speed["v100/0"]})
    assert speed["a100/0"] > speed["v100/0"]


def test_cli_injected_fault_exits_nonzero_naming_the_rank(tmp_path, capsys):
    plan = make_plan("gpipe", [(1, 2, [(0, 4), (4, 8)])])
    code = cli_main(["run", "--plan", _save(plan, tmp_path), "--steps", "2",
                     "--inject-fault", "0:1", "--no-emulate"])
    assert code == 1
    assert "rank 0 (n/0) failed: InjectedFault: injected fault at step 1" in \
        capsys.readouterr().err


def _save(plan, tmp_path) -> str:
    path = tmp_path / "plan.json"
    plan.save(path)
    return str(path)


def _torch_csv_rank(rank, world, store, plan, csv_path, seed):
    """One rank of torch's _PipelineScheduleRuntime replaying our schedule's CSV."""
    import torch.distributed as dist

    from hyperpipe.exec.placement import placements
    from hyperpipe.exec.torch_pipelining import torch_schedule, torch_stages
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    spec = plan.load_model()
    where = placements(plan)[rank]
    stages = torch_stages(plan, spec, where, seed, torch.device("cpu"))
    sched = torch_schedule(plan.schedule, stages, plan.pipelines[0].num_microbatches, spec,
                           csv_path)
    x, y = step_batch(spec, plan.global_batch, 0, seed)
    losses: list = []
    holds_last = any(s.is_last for s in stages)
    sched.step(*([x] if any(s.is_first for s in stages) else []),
               target=y if holds_last else None, losses=losses if holds_last else None)
    dist.destroy_process_group()
    grads = {n: p.grad.clone() for s in stages for n, p in s.submod.named_parameters()}
    loss = torch.stack(losses).mean().item() if holds_last else None
    return loss, grads


@pytest.mark.parametrize("kind,chunks", [("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_torch_runtime_replays_our_csv_with_our_results(kind, chunks, tmp_path):
    from hyperpipe.exec.launch import launch_local
    ranges = [(0, 2), (2, 4), (4, 6), (6, 8)] if chunks == 2 else [(0, 4), (4, 8)]
    plan = make_plan(kind, [(2, 4, ranges)], chunks)
    csv_path = tmp_path / "schedule.csv"
    assert cli_main(["schedule", "--kind", kind, "--devices", "2", "--microbatches", "4",
                     "--chunks", str(chunks), "--format", "torch-csv",
                     "--out", str(csv_path)]) == 0
    theirs = launch_local(_torch_csv_rank, (plan, str(csv_path), 0), plan.devices)
    ours = run_plan(plan, RunOptions(steps=1, emulate=False, capture_state=True,
                                     probe_links=False))
    assert abs(theirs[1][0] - ours.losses[0]) <= TOL
    for (_, their_grads), our_state in zip(theirs, ours.state, strict=True):
        assert set(their_grads) == set(our_state)
        for name, grad in their_grads.items():
            assert (grad - our_state[name]["grad"]).abs().max().item() <= TOL, name


# ------------------------------------------------------------------ CUDA / NCCL path
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA GPU here: the NCCL path needs one")
@needs_gpu
def test_nccl_rank_matches_cpu_reference():
    # one GPU is enough: one rank holding two stages (interleaved, looped placement)
    plan = make_plan("interleaved-1f1b", [(2, 4, [(0, 4), (4, 8)])], chunks=2)
    result = run_plan(plan, RunOptions(steps=1, capture_state=True))
    meta = result.trace.meta
    assert meta["backend"] == "nccl" and meta["precision"] == "bf16-autocast"
    assert result.emulated is False
    ref_loss, ref_grads = reference(plan)
    assert abs(result.losses[0] - ref_loss) <= BF16_LOSS_TOL
    for name, st in result.state[0].items():
        assert close_bf16(st["grad"].float(), ref_grads[name]), name


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL point-to-point needs two GPUs (one rank per GPU)")
def test_nccl_two_ranks_match_cpu_reference():
    plan = make_plan("zb-h1", [(2, 4, [(0, 4), (4, 8)])])
    result = run_plan(plan, RunOptions(steps=1, capture_state=True))
    assert result.trace.meta["backend"] == "nccl"
    ref_loss, ref_grads = reference(plan)
    assert abs(result.losses[0] - ref_loss) <= BF16_LOSS_TOL
    for rank_state in result.state:
        for name, st in rank_state.items():
            assert close_bf16(st["grad"].float(), ref_grads[name]), name


def test_synthesised_schedule_runs_with_single_process_losses(tmp_path):
    # A demo-hetero plan (fast A100 first, V100 second, uneven cut), its schedule
    # synthesised from the cost model and saved as `schedule.actions`: the executor
    # replays the lists and gets the single-process loss and gradients.
    from hyperpipe.plan.plan import load_plan
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.synth.listsched import Policy
    from hyperpipe.synth.synthesise import synth_plan
    base = plan_from_dict({
        "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
        "global_batch": 6, "schedule": "zb-h1",
        "pipelines": [{"micro_batch": 1, "num_microbatches": 6, "stages": [
            {"layers": [0, 5], "devices": ["a100/0"]},
            {"layers": [5, 8], "devices": ["v100/0"]}]}]})
    plan = synth_plan(base, CostModel(base.load_model(), base.load_cluster()),
                      Policy(None, "fill"))
    path = tmp_path / "synth.json"
    plan.save(path)
    plan = load_plan(path)
    assert plan.schedule == "synth" and plan.actions
    result = run_plan(plan, RunOptions(steps=1, emulate=False, capture_state=True,
                                       probe_links=False))
    check_against_reference(plan, result)


def test_emulated_gradient_buckets_start_when_the_last_backward_ends(tmp_path):
    # Under emulation the real compute makes every gradient in the first 1/factor of an
    # action; the device it stands for makes the last of them at the action's end, which
    # is when the simulator starts a stage's (single) bucket. So must the executor.
    plan = make_plan("1f1b", [(2, 2, [(0, 4), (4, 8)]), (2, 2, [(0, 4), (4, 8)])])
    trace_path = tmp_path / "t.json"
    run_plan(plan, RunOptions(steps=2, emulation_scale=3.0, probe_links=False,
                              trace_path=str(trace_path)))
    trace = load_trace(trace_path)
    assert trace.meta["emulated"] is True
    for e in (e for e in trace.events if e.op == "allreduce"):
        last_grad_end = max(c.end_s for c in trace.events if c.device == e.device
                            and c.step == e.step and c.op in ("B", "W"))
        assert e.start_s >= last_grad_end - 1e-6


@pytest.mark.parametrize("emulate", [False, True])
def test_dropout_is_seeded_and_a_resumed_run_draws_the_same_masks(emulate, tmp_path):
    """With dropout, two runs of one seed give the same losses, and a run resumed from
    its step-2 checkpoint ends with the weights of the uninterrupted run: the dropout
    stream is seeded by (seed, tensor-parallel group) and the emulated reference passes
    draw their masks from a stream of their own (the emulated resume fails without)."""
    doc = make_plan("1f1b", [(2, 4, [(0, 4), (4, 8)])]).to_dict()
    plan = plan_from_dict({**doc, "model": {"preset": "tiny-gpt", "dropout": 0.1}})
    base = dict(steps=4, emulate=emulate, capture_state=True, probe_links=False)
    straight = run_plan(plan, RunOptions(**base))
    again = run_plan(plan, RunOptions(**base))
    assert again.losses == straight.losses
    ckpt = str(tmp_path / "ckpt")
    run_plan(plan, RunOptions(**{**base, "steps": 2}, checkpoint_dir=ckpt,
                              checkpoint_every=2))
    resumed = run_plan(plan, RunOptions(**base, checkpoint_dir=ckpt, resume=True))
    assert resumed.first_step == 2
    assert resumed.losses == straight.losses[2:]
    for a, b in zip(straight.state, resumed.state, strict=True):
        for name in a:
            assert torch.equal(a[name]["param"], b[name]["param"]), name


@pytest.mark.slow
def test_torchrun_console_shows_the_whole_step(tmp_path):
    """Under torchrun, rank 0 (the first stage) prints each step's loss, which the last
    stage holds: its step lines read the losses a local run of the plan gives, not 0.
    (Unemulated: the gathered emulation scale is not exercised here.)"""
    import re
    import subprocess
    import sys
    plan = make_plan("gpipe", [(2, 2, [(0, 4), (4, 8)])])
    path = _save(plan, tmp_path)
    local = run_plan(plan, RunOptions(steps=2, emulate=False, probe_links=False))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "hyperpipe", "run", "--plan", path,
                           "--steps", "2", "--no-emulate"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"\| loss (\d+\.\d+) \|", done.stdout)]
    assert losses == pytest.approx(local.losses, abs=5e-5), done.stdout


def test_tensor_parallel_ranks_draw_the_same_dropout_masks():
    """With dropout, the two ranks of a tp = 2 stage keep the parameters they both hold
    whole (position embedding, norms, the row-parallel projection's bias) equal: they
    drop the same elements of the activations they both hold, one stream per
    tensor-parallel group."""
    doc = plan_doc([{"micro_batch": 2, "num_microbatches": 2, "stages": [
        {"layers": [0, 8], "devices": ["n/0", "n/1"], "tp": 2}]}],
        model={"preset": "tiny-gpt", "dropout": 0.1})
    result = run_plan(plan_from_dict(doc), RunOptions(steps=2, emulate=False,
                                                      capture_state=True, probe_links=False))
    a, b = result.state
    whole = [n for n in a if any(k in n for k in ("wpe", "ln_", "c_proj.bias"))]
    assert len(whole) >= 4
    for name in whole:
        assert torch.equal(a[name]["param"], b[name]["param"]), name
