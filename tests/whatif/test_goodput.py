"""Failures and goodput: Daly's expected goodput and the Young/Daly optima against a
Monte-Carlo run of failures (an independent walk through drawn failure times), the
optimum against its stationarity condition, and `whatif --failures` end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hyperpipe.cli import main
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.whatif.failures import without_node
from hyperpipe.whatif.goodput import (
    Checkpointing,
    best_interval_s,
    combined_mtbf_s,
    daly_interval_s,
    expected_goodput,
    monte_carlo_goodput,
    young_interval_s,
)

# scale-1024's 128 nodes at 5 days each; a 13B model's 182 GB checkpoint at 10 GB/s
MTBF_S = 5 * 86400 / 128
CKPT = Checkpointing(write_s=18.2, restart_s=600.0)


def test_closed_forms_by_hand():
    assert combined_mtbf_s([5 * 86400] * 128) == pytest.approx(MTBF_S)
    assert young_interval_s(18.2, MTBF_S) == pytest.approx(math.sqrt(2 * 18.2 * 3375))
    assert daly_interval_s(18.2, MTBF_S) == pytest.approx(math.sqrt(2 * 18.2 * 3375) - 18.2)
    assert daly_interval_s(10.0, 4.0) == 4.0              # delta >= 2M: M
    # no failures in sight: goodput tends to tau / (tau + delta) (only checkpoint cost)
    assert expected_goodput(100.0, Checkpointing(1.0, 0.0), 1e15) == pytest.approx(
        100 / 101, rel=1e-6)


def test_exact_optimum_solves_the_stationarity_condition():
    # d/dtau [tau / (e^((tau+delta)/M) - 1)] = 0  <=>  e^((tau+delta)/M) (1 - tau/M) = 1
    tau = best_interval_s(CKPT, MTBF_S)
    x, d = tau / MTBF_S, CKPT.write_s / MTBF_S
    assert math.exp(x + d) * (1 - x) == pytest.approx(1.0, abs=1e-9)
    for other in (0.9 * tau, 1.1 * tau):
        assert expected_goodput(other, CKPT, MTBF_S) < expected_goodput(tau, CKPT, MTBF_S)


def test_goodput_matches_monte_carlo_run():
    taus = [60.0, 200.0, 350.0, 1000.0, 3000.0]
    mc = monte_carlo_goodput(taus, CKPT, MTBF_S, failures=200_000, seed=1)
    for tau, g in zip(taus, mc, strict=True):
        assert g == pytest.approx(expected_goodput(tau, CKPT, MTBF_S), rel=0.01)


@pytest.mark.parametrize("write_s,restart_s", [(18.2, 600.0), (60.0, 300.0), (5.0, 0.0)])
def test_young_daly_optimum_within_5_percent_of_monte_carlo(write_s, restart_s):
    ckpt = Checkpointing(write_s, restart_s)
    daly = daly_interval_s(write_s, MTBF_S)
    grid = np.geomspace(daly / 3, daly * 3, 121)
    mc = np.array(monte_carlo_goodput(grid, ckpt, MTBF_S, failures=200_000, seed=2))
    # the run's optimum: a parabola through the top of its (flat) curve in log tau
    top = mc >= mc.max() - 0.01 * (mc.max() - mc.min())
    a, b, _ = np.polyfit(np.log(grid[top]), mc[top], 2)
    mc_best = math.exp(-b / (2 * a))
    assert daly == pytest.approx(mc_best, rel=0.05)
    # Young's lacks Daly's "- delta": as close only while delta is small against tau
    assert young_interval_s(write_s, MTBF_S) == pytest.approx(mc_best, rel=0.1)
    # and the goodput there is the run's best, to its noise
    assert expected_goodput(daly, ckpt, MTBF_S) == pytest.approx(mc.max(), rel=0.01)


def test_without_node_takes_one_out_of_a_repeat_group():
    c = load_cluster("scale-1024")
    smaller = without_node(c, "a100l-3")
    names = [n.name for n in smaller.nodes]
    assert len(names) == 127 and "a100l-3" not in names
    assert names[:34] == [n.name for n in c.nodes if n.name != "a100l-3"][:34]
    assert smaller.device("a100l-4/7").type == c.device("a100l-4/7").type


def _files(tmp_path, mtbf="2 days"):
    cluster = {"name": "fail", "device_types": {"fast": {
        "peak_flops": "2 TFLOP/s", "efficiency": 1.0, "memory": "100 GB",
        "mem_bandwidth": "1e15 B/s"}},
        "nodes": [{"name": "a", "device": "fast", "count": 2, "mtbf": mtbf},
                  {"name": "b", "device": "fast", "count": 2}],
        "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}}
    model = {"kind": "synthetic", "name": "m", "layers": 4, "seq_len": 1,
             "fwd_flops_per_sample": 1.0e10, "activation_bytes_per_sample": 1.0e6,
             "params_per_layer": 10**8}
    (tmp_path / "c.json").write_text(json.dumps(cluster))
    (tmp_path / "m.json").write_text(json.dumps(model))
    return ["--cluster", str(tmp_path / "c.json"), "--model", str(tmp_path / "m.json"),
            "--global-batch", "8", "--micro-batch", "1"]


def test_whatif_failures_cli(tmp_path, capsys):
    png = tmp_path / "goodput.png"
    rc = main(["whatif", "--failures", *_files(tmp_path), "--mtbf", "5 days",
               "--storage-bandwidth", "1 GB/s", "--restart-time", "10 min",
               "--checkpoint-interval", "1 h", "--plot", str(png), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    # every used node fails: a at 2 days (its own field), b at 5 days (--mtbf)
    used = {d.split("/")[0] for p in doc["plan"]["plan"]["pipelines"]
            for s in p["stages"] for d in s["devices"]}
    rates = {"a": 1 / (2 * 86400), "b": 1 / (5 * 86400)}
    assert doc["mtbf_s"] == pytest.approx(1 / sum(rates[n] for n in used))
    assert doc["checkpoint_bytes"] == 14 * 4 * 10**8
    assert doc["checkpoint_write_s"] == pytest.approx(5.6)
    assert "given" in [r["label"] for r in doc["intervals"]]
    best = max(doc["intervals"], key=lambda r: r["goodput"])
    assert best["label"] == "optimum"
    assert doc["failed_node"] == "a" and doc["replan"]["plan"]["pipelines"]
    assert all(not d.startswith("a/") for p in doc["replan"]["plan"]["pipelines"]
               for s in p["stages"] for d in s["devices"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # an interval shorter than one iteration has no checkpoint to write: refused
    png.unlink()
    rc = main(["whatif", "--failures", *_files(tmp_path), "--mtbf", "5 days",
               "--storage-bandwidth", "1 GB/s", "--restart-time", "10 min",
               "--checkpoint-interval", "1 us", "--plot", str(png)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--checkpoint-interval: expected at least one " \
        "iteration" in err[0], err
    assert not png.exists()
    bw, mtbf, restart = ["--storage-bandwidth", "1 GB/s"], ["--mtbf", "1 day"], \
        ["--restart-time", "1 h"]
    for missing, flags in (("mtbf", bw + restart), ("--storage-bandwidth", mtbf + restart),
                           ("--restart-time", mtbf + bw)):
        rc = main(["whatif", "--failures", *_files(tmp_path, mtbf=None), *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and missing in err[0], err


@pytest.mark.parametrize("flag,value", [
    ("--mtbf", "5 days"), ("--storage-bandwidth", "1 GB/s"), ("--checkpoint-size", "1 GB"),
    ("--checkpoint-write-time", "30 s"), ("--restart-time", "10 min"),
    ("--checkpoint-interval", "1 h")])
def test_a_failures_flag_without_failures_is_refused(flag, value, tmp_path, capsys):
    """A sweep read none of them: accepted and ignored, as if it had studied them.
    Refused in one line naming the flag, before the sweep writes anything."""
    png = tmp_path / "sweep.png"
    rc = main(["whatif", *_files(tmp_path), "--vary", "global_batch=4,8", flag, value,
               "--plot", str(png)])
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert rc == 2 and out == "" and err == [
        f"hyperpipe: error: {flag}: expected --failures beside it (only the failure study "
        "reads it; a sweep does not)"], err
    assert not png.exists()


def test_storage_bandwidth_beside_a_write_time_is_refused(tmp_path, capsys):
    """The write time given is the write time (`FailureOptions.write_s`): a storage
    bandwidth beside it went unread."""
    png = tmp_path / "goodput.png"
    flags = ["whatif", "--failures", *_files(tmp_path), "--restart-time", "10 min",
             "--checkpoint-write-time", "30 s", "--plot", str(png)]
    rc = main([*flags, "--storage-bandwidth", "1 GB/s"])
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert rc == 2 and out == "" and len(err) == 1 and err[0].startswith(
        "hyperpipe: error: --storage-bandwidth: expected no --checkpoint-write-time beside "
        "it (which gives the write time itself"), err
    assert not png.exists()
    assert main(flags) == 0                      # the write time alone: the study runs
    assert "written in 30 s" in capsys.readouterr().out and png.exists()


def _four_replicas(tmp_path):
    """The `_files` cluster and model, and a plan of four one-stage replicas, one per
    device (a/0 a/1 b/0 b/1), micro-batch 1, the global batch of 8 as 3, 1, 2, 2."""
    from hyperpipe.models import load_model
    from hyperpipe.plan.plan import plan_from_dict
    _files(tmp_path)
    cluster = load_cluster(json.loads((tmp_path / "c.json").read_text()))
    spec = load_model(json.loads((tmp_path / "m.json").read_text()))
    plan = plan_from_dict({
        "format": "hyperpipe.plan/1", "model": spec.to_dict(), "cluster": "fail",
        "global_batch": 8, "schedule": {"kind": "1f1b"},
        "pipelines": [{"micro_batch": 1, "num_microbatches": m,
                       "stages": [{"layers": [0, 4], "devices": [d]}]}
                      for d, m in (("a/0", 3), ("a/1", 1), ("b/0", 2), ("b/1", 2))]})
    return cluster, spec, plan


def test_surviving_replicas_drop_the_lost_node_and_split_the_batch_again(tmp_path):
    from hyperpipe.whatif.failures import surviving_replicas
    cluster, spec, plan = _four_replicas(tmp_path)
    # without b: a/0 and a/1 had 3 and 1 micro-batches; 8 split in that proportion
    (kept,) = surviving_replicas(plan, spec, without_node(cluster, "b"))
    assert [(p.devices(), p.num_microbatches) for p in kept.pipelines] == \
        [(["a/0"], 6), (["a/1"], 2)]
    # without a: b/0 and b/1 had 2 each
    (kept,) = surviving_replicas(plan, spec, without_node(cluster, "a"))
    assert [p.num_microbatches for p in kept.pipelines] == [4, 4]
    assert surviving_replicas(plan, spec, cluster) == []            # nothing lost


def test_surviving_replicas_of_a_synthesised_plan_take_each_fixed_kind(tmp_path):
    """A synthesised schedule was built for the old micro-batch counts: the surviving
    pipelines run each fixed kind of their placement instead (1f1b, gpipe, ... for one
    chunk looped), every one a valid plan."""
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.synth.synthesise import POLICIES, fixed_kinds, synth_plan
    from hyperpipe.whatif.failures import surviving_replicas
    cluster, spec, plan = _four_replicas(tmp_path)
    synth = synth_plan(plan, CostModel(spec, cluster), POLICIES[0])
    assert synth.schedule == "synth" and synth.actions      # a plan that carries actions
    kept = surviving_replicas(synth, spec, without_node(cluster, "b"))
    assert [k.schedule for k in kept] == fixed_kinds(plan) and all(
        k.actions is None and len(k.pipelines) == 2 for k in kept)


def test_failure_replan_is_never_worse_than_the_surviving_replicas(tmp_path, monkeypatch):
    """With the search unable to find anything, the re-plan is today's plan less its
    pipelines on the failed node; with it, whichever is faster."""
    from hyperpipe.core.errors import InfeasiblePlan
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import SimOptions, simulate
    from hyperpipe.whatif import failures
    cluster, spec, plan = _four_replicas(tmp_path)
    smaller = without_node(cluster, "a")
    (kept,) = failures.surviving_replicas(plan, spec, smaller)
    kept_s = simulate(kept, CostModel(spec, smaller), SimOptions(trace=False)
                      ).metrics.iteration_time_s
    c = failures.SearchConstraints(global_batch=8, micro_batch=1)
    got, error, _, origin = failures._replan(spec, cluster, "a", c, None, 1, None, plan)
    assert error is None and got.metrics.iteration_time_s <= kept_s * (1 + 1e-12)

    def nothing(*args, **kwargs):
        raise InfeasiblePlan("nothing fits")
    monkeypatch.setattr(failures, "search", nothing)
    got, error, _, origin = failures._replan(spec, cluster, "a", c, None, 1, None, plan)
    assert origin == "surviving replicas" and error is None
    assert got.metrics.iteration_time_s == pytest.approx(kept_s, rel=1e-12)
    # a user who fixed four replicas gets no survivors (two are left): nothing fits
    fixed = failures.SearchConstraints(global_batch=8, micro_batch=1, dp=4)
    got, error, _, _ = failures._replan(spec, cluster, "a", fixed, None, 1, None, plan)
    assert got is None and error == "nothing fits"


def test_failure_replan_synthesises_the_survivors_when_today_was_synthesised(
        tmp_path, monkeypatch):
    """Today's plan synthesised: the survivors' schedule is synthesised again, no slower
    than any fixed kind of their placement."""
    from hyperpipe.core.errors import InfeasiblePlan
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import SimOptions, simulate
    from hyperpipe.synth.synthesise import POLICIES, synth_plan
    from hyperpipe.whatif import failures
    cluster, spec, plan = _four_replicas(tmp_path)
    today = synth_plan(plan, CostModel(spec, cluster), POLICIES[0])
    smaller = without_node(cluster, "a")
    fixed_s = min(simulate(k, CostModel(spec, smaller), SimOptions(trace=False))
                  .metrics.iteration_time_s
                  for k in failures.surviving_replicas(today, spec, smaller))

    def nothing(*args, **kwargs):
        raise InfeasiblePlan("nothing fits")
    monkeypatch.setattr(failures, "search", nothing)
    c = failures.SearchConstraints(global_batch=8, micro_batch=1)
    got, error, _, origin = failures._replan(spec, cluster, "a", c, None, 1, None, today)
    assert origin == "surviving replicas" and error is None
    assert {d for d in got.plan.devices} == {"b/0", "b/1"}
    assert got.metrics.iteration_time_s <= fixed_s * (1 + 1e-12)


def test_checkpoint_counts_a_tied_embedding_once(tmp_path, capsys):
    """A tied head shares the embedding's matrix: the checkpoint holds it once, 14 bytes
    a parameter (`CHECKPOINT_BYTES_PER_PARAM`) of every layer's less one vocab x d_model."""
    args = _files(tmp_path)
    model = {"preset": "tiny-gpt", "tie_embeddings": True}
    (tmp_path / "tied.json").write_text(json.dumps(model))
    args[args.index("--model") + 1] = str(tmp_path / "tied.json")
    rc = main(["whatif", "--failures", *args, "--mtbf", "5 days",
               "--storage-bandwidth", "1 GB/s", "--restart-time", "10 min", "--json"])
    assert rc == 0
    spec = load_model(model)
    c = spec.config
    once = sum(layer.params for layer in spec.layers) - c.vocab_size * c.d_model
    assert json.loads(capsys.readouterr().out)["checkpoint_bytes"] == 14 * once


def test_table_intervals_are_whole_iterations_and_the_optimum_the_best_of_them():
    """With failures every second the continuous optimum (44 ms) was shorter than one
    94.6 ms iteration, a checkpoint interval the study refuses when typed; every row is
    now a whole number of iterations, at least one, and the optimum the better of the
    two multiples around the continuous one (checked against every multiple)."""
    from hyperpipe.whatif.failures import _interval_rows
    from hyperpipe.whatif.goodput import Checkpointing, expected_goodput
    ckpt, step_s = Checkpointing(1e-3, 1e-3), 0.0946
    for mtbf_s in (1.0, 60.0, 3600.0):
        rows = _interval_rows(ckpt, mtbf_s, (), step_s)
        assert all(r.interval_s >= step_s and abs(r.interval_s / step_s
                                                  - round(r.interval_s / step_s)) < 1e-9
                   for r in rows)
        best = next(r for r in rows if r.label == "optimum")
        brute = max((k * step_s for k in range(1, 2000)),
                    key=lambda t: expected_goodput(t, ckpt, mtbf_s))
        assert best.interval_s == pytest.approx(brute)


def test_without_node_reads_a_repeat_written_as_a_float(tmp_path):
    # `repeat: 2e0` (YAML 1.1 reads it as a string) is 2, as for `count`
    path = tmp_path / "c.yaml"
    path.write_text("nodes:\n"
                    "  - {name: a, device: A100-80GB, count: 2, repeat: 2e0, mtbf: 3 days}\n"
                    "  - {name: v, device: V100-32GB, count: 2, mtbf: 9 days}\n")
    c = load_cluster(str(path))
    smaller = without_node(c, "a0")
    assert [n.name for n in smaller.nodes] == ["a1", "v"]
    assert [n.mtbf_s for n in smaller.nodes] == [3 * 86400, 9 * 86400]
