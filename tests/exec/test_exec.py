"""The real executor's pure parts, and its refusals of bad input (no process starts).

Multi-process runs are in test_exec_dist.py.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from factories import plan_doc

from hyperpipe.cli import main as cli_main
from hyperpipe.core.errors import BadInput
from hyperpipe.exec import RunOptions, run_plan
from hyperpipe.exec import checkpoint as ckpt
from hyperpipe.exec.comm import GRADIENT, message_tag
from hyperpipe.exec.data import micro_batch_of, step_batch
from hyperpipe.exec.emulation import (
    compute_clock,
    compute_s,
    cpu_clock,
    device_factors,
    emulation_factors,
    stretch,
)
from hyperpipe.exec.placement import (
    adjacent_pairs,
    check_runnable,
    dp_groups,
    dp_slices,
    layer_holders,
    placements,
)
from hyperpipe.models import load_model
from hyperpipe.plan.plan import plan_from_dict

HETERO = {
    "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
    "global_batch": 16, "schedule": "1f1b",
    "pipelines": [
        {"micro_batch": 2, "num_microbatches": 3,
         "stages": [{"layers": [0, 5], "devices": ["a100/0"]},
                    {"layers": [5, 8], "devices": ["v100/0"]}]},
        {"micro_batch": 2, "num_microbatches": 5,
         "stages": [{"layers": [0, 2], "devices": ["a100/1"]},
                    {"layers": [2, 6], "devices": ["v100/1"]},
                    {"layers": [6, 8], "devices": ["v100/1"]}]}]}


def plan_with(**changes):
    return plan_from_dict({**HETERO, **changes})


def two_stage(**changes):
    doc = {**HETERO, "global_batch": 6, "pipelines": [HETERO["pipelines"][0]]}
    return plan_from_dict({**doc, **changes})


# ------------------------------------------------------------------ placement
def test_placements_follow_plan_device_order_and_looped_stages():
    plan = two_stage(schedule={"kind": "interleaved-1f1b", "chunks": 2}, pipelines=[
        {"micro_batch": 1, "num_microbatches": 6, "stages": [
            {"layers": [0, 2], "devices": ["a100/0"]}, {"layers": [2, 4], "devices": ["v100/0"]},
            {"layers": [4, 6], "devices": ["a100/0"]}, {"layers": [6, 8], "devices": ["v100/0"]}]}])
    ranks = placements(plan)
    assert [(r.device, r.stages) for r in ranks] == [("a100/0", (0, 2)), ("v100/0", (1, 3))]
    assert [ranks[0].rank_of_stage(s) for s in range(4)] == [0, 1, 0, 1]
    assert adjacent_pairs(plan) == [(0, 1)]


def test_dp_groups_match_brute_force_holders():
    plan = plan_with(pipelines=[
        HETERO["pipelines"][0],
        {"micro_batch": 2, "num_microbatches": 5, "stages": [
            {"layers": [0, 2], "devices": ["a100/1"]}, {"layers": [2, 8], "devices": ["v100/1"]}]}])
    # brute force: who holds each layer, straight from the plan's stage ranges
    rank_of = {d: r for r, d in enumerate(plan.devices)}
    holders: dict[int, set[int]] = {}
    for pipe in plan.pipelines:
        for st in pipe.stages:
            for layer in range(*st.layers):
                holders.setdefault(layer, set()).add(rank_of[st.devices[0]])
    assert {k: set(v) for k, v in layer_holders(plan).items()} == holders
    groups = dp_groups(plan)
    covered = [layer for _, layers in groups for layer in layers]
    assert sorted(covered) == sorted(holders)              # each layer in exactly one group
    for ranks, layers in groups:
        assert all(holders[layer] == set(ranks) for layer in layers)
    # one group per distinct holder set, in order of first layer
    assert sorted(g[0] for g in groups) == sorted({tuple(sorted(h)) for h in holders.values()})
    assert [g[1][0] for g in groups] == sorted(g[1][0] for g in groups)


def test_replicas_of_mixed_tp_reduce_each_slice_once_with_every_replica():
    # layers 0-4 on tp 1 (rank 0) and tp 2 (ranks 2, 3); layers 5-7 on tp 1 twice
    plan = plan_from_dict({**HETERO, "global_batch": 8, "pipelines": [
        {"micro_batch": 2, "num_microbatches": 2, "stages": [
            {"layers": [0, 5], "devices": ["a100/0"]},
            {"layers": [5, 8], "devices": ["a100/1"]}]},
        {"micro_batch": 2, "num_microbatches": 2, "stages": [
            {"layers": [0, 5], "devices": ["v100/0", "v100/1"], "tp": 2},
            {"layers": [5, 8], "devices": ["a100/2"]}]}],
        "cluster": {"nodes": [{"name": "a100", "device": "A100-80GB", "count": 3},
                              {"name": "v100", "device": "V100-32GB", "count": 2}]}})
    check_runnable(plan, plan.load_model())
    rank = {d: r for r, d in enumerate(plan.devices)}
    a, b, v0, v1 = (rank[d] for d in ("a100/0", "a100/2", "v100/0", "v100/1"))
    mixed = tuple(range(5))
    assert sorted(dp_groups(plan)) == sorted([
        ((a, v0), mixed), ((a, v1), mixed), ((rank["a100/1"], b), (5, 6, 7))])
    # brute force over slices: every (layer, slice of tp 2) is summed over one rank of
    # each replica exactly once; rank a halves its tensors, the tp=2 ranks do not
    assert dp_slices(plan, a) == {((a, v0), mixed): (2, 0), ((a, v1), mixed): (2, 1)}
    assert dp_slices(plan, v0) == dp_slices(plan, v1) == dp_slices(plan, b) == {}
    held = {}
    for ranks, layers in dp_groups(plan):
        for r in ranks:
            parts, q = dp_slices(plan, r).get((ranks, layers), (1, 0))
            tp_index = {v0: 0, v1: 1}.get(r, 0)
            for layer in layers:
                held.setdefault((layer, (tp_index * parts + q) if layer < 5 else 0),
                                []).append(r)
    assert held == {**{(layer, 0): [a, v0] for layer in mixed},
                    **{(layer, 1): [a, v1] for layer in mixed},
                    **{(layer, 0): [rank["a100/1"], b] for layer in (5, 6, 7)}}


def _mixed(first: dict, second: dict, **top) -> object:
    return plan_from_dict(plan_doc([
        {"micro_batch": 2, "num_microbatches": 2, "stages": [first]},
        {"micro_batch": 2, "num_microbatches": 2, "stages": [second]}], **top))


@pytest.mark.parametrize("plan,needle", [
    # tp 2 beside tp 3 (6 heads of 16): no ring of the largest degree holds both
    (lambda: _mixed({"layers": [0, 8], "devices": ["n/0", "n/1"], "tp": 2},
                    {"layers": [0, 8], "devices": ["n/2", "n/3", "n/4"], "tp": 3},
                    model={"preset": "tiny-gpt", "n_head": 6, "d_model": 96}),
     "a divisor of tp=3"),
    # context parallelism on the mixed layers (no dropout: the ring attention has none)
    (lambda: _mixed({"layers": [0, 8], "devices": ["n/0", "n/1"], "tp": 1, "cp": 2},
                    {"layers": [0, 8], "devices": ["n/2", "n/3", "n/4", "n/5"], "tp": 2,
                     "cp": 2}, model={"preset": "tiny-gpt", "dropout": 0.0}),
     "with context parallelism"),
    # expert parallelism on other layers: the experts' regrouping has no rings of slices
    (lambda: plan_from_dict(plan_doc([
        {"micro_batch": 2, "num_microbatches": 2, "stages": [
            {"layers": [0, 4], "devices": ["n/0"], "ep": 2},
            {"layers": [4, 6], "devices": ["n/1", "n/2"], "tp": 2}]},
        {"micro_batch": 2, "num_microbatches": 2, "stages": [
            {"layers": [0, 4], "devices": ["n/3"], "ep": 2},
            {"layers": [4, 6], "devices": ["n/4"], "tp": 1}]}], model="tiny-moe")),
     "in a plan with expert parallelism"),
])
def test_replicas_of_mixed_tp_are_refused_where_no_ring_reduces_them(plan, needle):
    plan = plan()
    with pytest.raises(BadInput, match=needle) as err:
        check_runnable(plan, plan.load_model())
    assert "or one degree" in str(err.value)


def test_message_tags_are_unique():
    tags = {message_tag(k, s, m, 7) for k in (0, GRADIENT) for s in range(9) for m in range(7)}
    assert len(tags) == 2 * 9 * 7


# ------------------------------------------------------------------ emulation, data
def test_emulation_factors_are_speed_ratios_to_the_clusters_fastest():
    cluster = plan_with().load_cluster()
    speed = {d.name: d.type.achievable_flops for d in cluster.devices}
    fastest = max(speed.values())
    f = device_factors(list(speed), cluster, 2.0)
    assert f == pytest.approx({d: 2.0 * fastest / s for d, s in speed.items()})
    assert min(f.values()) == pytest.approx(2.0) and max(f.values()) > 2.0
    # a plan of the slow devices alone still runs them slow: the reference is the cluster
    slow = [d for d, s in speed.items() if s < fastest]
    assert device_factors(slow, cluster) == pytest.approx(
        {d: fastest / speed[d] for d in slow})
    by_type = emulation_factors(cluster)
    assert all(f[d] == pytest.approx(2.0 * by_type[cluster.device(d).type.name])
               for d in speed)
    # a straggler node's devices are stretched by its slowdown on top of their type's
    from hyperpipe.cluster.cluster import load_cluster
    straggling = load_cluster({"nodes": [
        {"name": "a", "device": "A100-80GB", "count": 2},
        {"name": "s", "device": "A100-80GB", "count": 2, "slowdown": 3.0}]})
    got = device_factors(["a/0", "s/1"], straggling, 2.0)
    assert got == pytest.approx({"a/0": 2.0, "s/1": 6.0})


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_stretch_makes_compute_take_factor_times_its_cpu_time(monkeypatch):
    import hyperpipe.exec.emulation as emulation
    slept = []
    real_sleep = time.sleep

    def sleep(seconds):
        slept.append(seconds)
        real_sleep(seconds)
    monkeypatch.setattr(emulation.time, "sleep", sleep)
    start, cpu = time.perf_counter(), cpu_clock()
    _busy(0.02)                                        # the "compute": all CPU
    used = cpu_clock() - cpu
    end = stretch(start, cpu, 3.0)
    # (a loaded machine oversleeps; the lower bound is the claim)
    assert 3.0 * used - 0.005 <= end - start <= 3.0 * used + 0.25
    assert slept
    # a wait that uses no CPU (a rank descheduled, contending for a core) is not
    # stretched: it already took longer than 2 x its CPU time, so nothing sleeps
    slept.clear()
    start, cpu = time.perf_counter(), cpu_clock()
    real_sleep(0.05)
    _busy(0.01)
    stretch(start, cpu, 2.0)
    assert slept == []
    start = time.perf_counter()
    assert stretch(start, cpu_clock(), 1.0) - start < 0.05   # factor 1: no sleep
    assert slept == []


def test_compute_time_with_threads_is_wall_time_not_summed_cpu_time():
    # Several threads: CPU time sums over them (about N x the wall time); the action took
    # the wall time, which emulation must stretch (the old --threads N bug: N x slower).
    import threading

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
    t0 = compute_clock()
    threads = [threading.Thread(target=spin, args=(0.05,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t1 = compute_clock()
    wall, cpu = t1[0] - t0[0], t1[1] - t0[1]
    assert compute_s(t0, t1) == min(wall, cpu)
    assert compute_s(t0, t1) <= wall + 1e-9
    # one thread that waited for a core: the CPU time, not the wait
    assert compute_s((0.0, 0.0), (0.3, 0.1)) == pytest.approx(0.1)
    assert compute_s((0.0, 0.0), (0.1, 0.2)) == pytest.approx(0.1)


def test_data_stream_is_deterministic_and_sliced_by_pipeline():
    spec = load_model("tiny-gpt")
    x, y = step_batch(spec, 16, 3, 7)
    x2, y2 = step_batch(spec, 16, 3, 7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, step_batch(spec, 16, 4, 7)[0])
    assert not torch.equal(x, step_batch(spec, 16, 3, 8)[0])
    assert x.shape == (16, spec.seq_len) and torch.equal(x[:, 1:], y[:, :-1])
    assert 0 <= int(x.min()) and int(x.max()) < spec.config.vocab_size
    # pipeline 1 of HETERO starts after pipeline 0's 6 samples
    parts = [micro_batch_of((x, y), 0, 2, i)[0] for i in range(3)] + \
        [micro_batch_of((x, y), 6, 2, i)[0] for i in range(5)]
    assert torch.equal(torch.cat(parts), x)


# ------------------------------------------------------------------ checkpoints
def test_checkpoint_round_trip_and_completeness(tmp_path):
    plan = two_stage()
    spec = plan.load_model()
    fp = ckpt.fingerprint(plan, spec, 0)
    assert fp != ckpt.fingerprint(plan, spec, 1)
    assert fp != ckpt.fingerprint(two_stage(global_batch=8, pipelines=[
        {**HETERO["pipelines"][0], "num_microbatches": 4}]), spec, 0)
    assert ckpt.resume_step(tmp_path, fp, 2) is None
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"step": 2, "rng": ckpt.rng_state(), "stages": {"0": model.state_dict()},
             "optimizer": opt.state_dict()}
    for step in (2, 4, 6):
        ckpt.save_rank(tmp_path, step, 0, state)
        ckpt.save_rank(tmp_path, step, 1, state)
        if step < 6:
            ckpt.write_manifest(tmp_path, step, fp, plan.devices)
    # step 6 has no manifest: incomplete, ignored; KEEP complete ones remain
    assert ckpt.complete_steps(tmp_path) == [2, 4][-ckpt.KEEP:]
    assert ckpt.resume_step(tmp_path, fp, 2) == 4
    back = ckpt.load_rank(tmp_path, 4, 1)
    assert torch.equal(back["stages"]["0"]["weight"], model.weight)
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    opt2.load_state_dict(back["optimizer"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(BadInput, match="another run"):
        ckpt.resume_step(tmp_path, ckpt.fingerprint(plan, spec, 5), 2)
    with pytest.raises(BadInput, match="world_size"):
        ckpt.resume_step(tmp_path, fp, 3)
    manifest = json.loads((ckpt.step_dir(tmp_path, 4) / ckpt.MANIFEST).read_text())
    assert manifest["step"] == 4 and manifest["devices"] == plan.devices
    assert not list(tmp_path.rglob(".*tmp*"))           # no temporary files left


# ------------------------------------------------------------------ refusals, exit 2
@pytest.mark.parametrize("changes,needle", [
    ({"pipelines": [{"micro_batch": 2, "num_microbatches": 3, "stages": [
        {"layers": [0, 5], "devices": ["a100/0"]},
        {"layers": [5, 8], "devices": ["nope/0"]}]}]}, "devices"),
    ({"pipelines": [{"micro_batch": 2, "num_microbatches": 3, "stages": [
        {"layers": [0, 5], "devices": ["a100/0"]},
        {"layers": [5, 7], "devices": ["v100/0"]}]}]}, "layers covering"),
    ({"global_batch": 12, "pipelines": [
        {"micro_batch": 2, "num_microbatches": 3, "stages": [
            {"layers": [0, 5], "devices": ["a100/0", "a100/1"], "tp": 2},
            {"layers": [5, 8], "devices": ["v100/0"]}]},
        {"micro_batch": 2, "num_microbatches": 3, "stages": [
            {"layers": [0, 8], "devices": ["v100/1"]}]}],
      "distributed_optimizer": True}, "differ in tensor-parallel degree"),
])
def test_bad_plans_exit_2_before_any_rank_starts(changes, needle, tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({**HETERO, "global_batch": 6, **changes}))
    assert cli_main(["run", "--plan", str(plan_file)]) == 2
    assert needle in capsys.readouterr().err


def test_bad_run_options_are_refused():
    with pytest.raises(BadInput, match="steps"):
        RunOptions(steps=0)
    with pytest.raises(BadInput, match="emulation_scale"):
        RunOptions(emulation_scale=0.5)
    with pytest.raises(BadInput, match="checkpoint directory"):
        RunOptions(resume=True)
    with pytest.raises(BadInput, match="rank below 2"):
        run_plan(two_stage(), RunOptions(inject_fault=(2, 0)))


def test_cli_rejects_malformed_fault_and_wrong_torchrun_world(tmp_path, monkeypatch, capsys):
    plan_file = tmp_path / "plan.json"
    two_stage().save(plan_file)
    assert cli_main(["run", "--plan", str(plan_file), "--inject-fault", "one"]) == 2
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert cli_main(["run", "--plan", str(plan_file)]) == 2
    assert "WORLD_SIZE" in capsys.readouterr().err


def test_trace_plan_inlines_file_refs_so_calibration_can_load_it(tmp_path, monkeypatch):
    from hyperpipe.exec.job import portable_plan, prepare
    from hyperpipe.plan.plan import load_plan
    (tmp_path / "m.yaml").write_text("preset: tiny-gpt\nn_layer: 2\n")
    (tmp_path / "c.yaml").write_text("nodes:\n  - {name: x, device: V100-32GB, count: 2}\n")
    (tmp_path / "p.json").write_text(json.dumps({
        **HETERO, "model": "m.yaml", "cluster": "c.yaml", "global_batch": 2, "pipelines": [
            {"micro_batch": 1, "num_microbatches": 2, "stages": [
                {"layers": [0, 2], "devices": ["x/0"]}, {"layers": [2, 4], "devices": ["x/1"]}]}]}))
    prep = prepare(load_plan(tmp_path / "p.json"), RunOptions())
    monkeypatch.chdir(tmp_path.parent)                   # the relative paths no longer resolve
    again = plan_from_dict(portable_plan(prep))
    assert again.load_model() == prep.spec
    assert [d.type.name for d in again.load_cluster().devices] == ["V100-32GB"] * 2
    assert portable_plan(prepare(two_stage(), RunOptions()))["cluster"] == "demo-hetero"


# ------------------------------------------------------------------ measured memory
def test_memory_meter_counts_params_grads_state_and_saved_tensors_at_their_peak():
    from hyperpipe.exec.memory import MemoryMeter, state_tensors
    lin = torch.nn.Linear(8, 8, bias=False)
    opt = torch.optim.AdamW(lin.parameters())
    meter = MemoryMeter(torch.device("cpu"), list(lin.parameters()),
                        lambda: state_tensors(opt))
    param_bytes = 4 * 64
    x = torch.randn(4, 8, requires_grad=True)
    meter.start_step()
    assert meter.peak_bytes == param_bytes
    with meter.saving():
        y = torch.tanh(lin(x))           # saves x (not the weight: a parameter) and tanh's out
    saved = x.nbytes + y.nbytes
    assert meter.peak_bytes == param_bytes + saved
    y.sum().backward()
    del y                                # autograd let go of what it saved
    meter.sample()
    assert meter.peak_bytes == param_bytes + saved       # the peak stays
    opt.step()                                           # Adam state: m and v (+ steps)
    state = sum(t.nbytes for t in state_tensors(opt))
    assert state >= 2 * param_bytes
    assert meter.step_peak() == param_bytes + param_bytes + state    # params+grads+state


def test_profile_reference_of_a_recomputing_backward_adds_the_redone_forward():
    # emulation stretches each action to factor x its reference: a backward under full
    # recompute must be stretched to (its own + the stage's forward) compute, as the
    # simulator costs it (B = F + B), or the run would hide the recompute's cost
    from types import SimpleNamespace

    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.exec.reference import reference_from
    from hyperpipe.plan.schedule import Action
    from hyperpipe.sim.costmodel import CostModel

    plans = {}
    for recompute in ("none", "full"):
        plans[recompute] = plan_from_dict({
            "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
            "global_batch": 4, "schedule": {"kind": "1f1b"},
            "pipelines": [{"micro_batch": 2, "num_microbatches": 2, "stages": [
                {"layers": [1, 5], "devices": ["a100/0"], "recompute": recompute}]}]})
    cost = CostModel(load_model("tiny-gpt"), load_cluster("demo-hetero"))
    refs = {}
    for recompute, plan in plans.items():
        rt = SimpleNamespace(plan=plan, where=SimpleNamespace(pipeline=0), name="a100/0",
                             micro_batch=2, stages={0: None},
                             actions=[Action(0, "F", 0), Action(0, "B", 0)])
        refs[recompute] = reference_from(rt, cost)
    f = cost.stage_compute_s((1, 5), "A100-80GB", 2, "F")
    assert refs["full"][(0, "F")] == pytest.approx(refs["none"][(0, "F")])
    assert refs["full"][(0, "B")] == pytest.approx(refs["none"][(0, "B")] + f)


def test_memory_meter_lets_go_of_what_an_input_weight_split_saved():
    # The I/W split runs the input backward with retain_graph; what the meter packed must
    # still be released once W has run, step after step (it leaked ~300 tensors a step),
    # and the split's gradients must equal a plain backward's without the meter.
    from hyperpipe.exec import compute
    from hyperpipe.exec.memory import MemoryMeter
    from hyperpipe.models import build_stage, example_batch

    spec = load_model("tiny-gpt")
    stage = build_stage(spec, 0, spec.num_layers, 0)
    layers, params = list(stage.layers.values()), list(stage.parameters())
    tokens, targets = example_batch(spec, 2, 0)
    meter = MemoryMeter(torch.device("cpu"), params, lambda: [])
    peaks = []
    for _ in range(3):
        meter.start_step()
        with meter.saving():
            entry = compute.forward(layers, tokens, targets, cut_after_first=True)
        compute.input_grad(params, entry, None)
        compute.weight_grad(params, entry)
        del entry
        assert meter._saved == {}
        peaks.append(meter.step_peak())
    assert peaks[2] == peaks[1]
    split = [p.grad.clone() / 3 for p in params]
    for p in params:
        p.grad = None
    compute.backward(compute.forward(layers, tokens, targets, cut_after_first=True), None)
    for a, p in zip(split, params, strict=True):
        assert torch.allclose(a, p.grad, atol=1e-6)
