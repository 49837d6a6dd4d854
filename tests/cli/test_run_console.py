"""Runs that say what they do and refuse what cannot work: checkpoint directories that
belong to one run, the lock, the pre-launch memory check, live step lines.

Oracles: the files in the checkpoint directory (written by hand here), the closed form of
a plan's state bytes (16 bytes per parameter for weights, gradients and AdamW state) for
the memory check, and hand-made rank reports for the step merge.
"""

from __future__ import annotations

import io
import json

import pytest

from hyperpipe.cli import main as cli_main
from hyperpipe.cli.run_console import (
    RANK_OVERHEAD_BYTES,
    ConsoleMonitor,
    Prediction,
    check_memory,
    predict,
)
from hyperpipe.core.errors import BadInput
from hyperpipe.exec import checkpoint as ckpt
from hyperpipe.exec.monitor import Collector, FileReporter
from hyperpipe.plan.plan import plan_from_dict

TINY = {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
        "global_batch": 8, "schedule": {"kind": "1f1b", "chunks": 1},
        "pipelines": [{"micro_batch": 2, "num_microbatches": 4, "stages": [
            {"layers": [0, 5], "devices": ["a100/0"]},
            {"layers": [5, 8], "devices": ["v100/0"]}]}]}


def test_fresh_run_into_another_runs_directory_is_refused_unless_overwrite(tmp_path):
    ckpt.write_manifest(tmp_path, 20, "old" * 20, ["a", "b"])   # an older run, step 20
    with pytest.raises(BadInput, match=r"another run .*up to 20 steps \(0 to 19\).*--overwrite"):
        ckpt.check_directory(tmp_path, "new" * 20, 0, 2, steps=5, resume=False,
                             overwrite=False)
    assert ckpt.check_directory(tmp_path, "new" * 20, 0, 2, steps=5, resume=False,
                                overwrite=True) is None
    lock = ckpt.claim_directory(tmp_path, "new" * 20, 0, 2, resume=False, overwrite=True)
    try:
        assert ckpt.complete_steps(tmp_path) == []          # the stale step 20 is gone
        assert ckpt.read_run_record(tmp_path)["fingerprint"] == "new" * 20
        with pytest.raises(BadInput, match="no other run is using"):
            ckpt.claim_directory(tmp_path, "new" * 20, 0, 2, resume=False, overwrite=False)
    finally:
        lock.close()
    # unlocked once closed; resuming another run's directory is refused by its record
    ckpt.claim_directory(tmp_path, "new" * 20, 0, 2, resume=False, overwrite=False).close()
    with pytest.raises(BadInput, match="belongs to run"):
        ckpt.check_directory(tmp_path, "other" * 12, 1, 2, steps=5, resume=True,
                             overwrite=False)


def test_resume_past_the_requested_steps_is_refused(tmp_path):
    ckpt.write_manifest(tmp_path, 4, "f" * 64, ["a", "b"])
    with pytest.raises(BadInput, match=r"already holds 4 steps \(0 to 3\)"):
        ckpt.check_directory(tmp_path, "f" * 64, 0, 2, steps=4, resume=True, overwrite=False)
    assert ckpt.check_directory(tmp_path, "f" * 64, 0, 2, steps=6, resume=True,
                                overwrite=False) == 4


def test_resume_at_another_learning_rate_is_refused(tmp_path):
    """The optimizer state restores the learning rate it was saved with, so a resumed run
    given another --lr trained at the old one, silently; the run record keeps the rate
    and resuming at another is refused before anything runs."""
    ckpt.claim_directory(tmp_path, "f" * 64, 0, 2, resume=False, overwrite=False,
                         lr=0.001).close()
    ckpt.write_manifest(tmp_path, 4, "f" * 64, ["a", "b"])
    with pytest.raises(BadInput, match=r"--lr: expected the learning rate of the run in "
                                       r".* \(0\.001\) to resume it, got 0\.05"):
        ckpt.check_directory(tmp_path, "f" * 64, 0, 2, steps=6, resume=True,
                             overwrite=False, lr=0.05)
    assert ckpt.check_directory(tmp_path, "f" * 64, 0, 2, steps=6, resume=True,
                                overwrite=False, lr=0.001) == 4
    # a record whose rate is not a number is not compared (it had raised TypeError)
    import json
    record = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "run.json").write_text(json.dumps({**record, "lr": None}))
    assert ckpt.check_directory(tmp_path, "f" * 64, 0, 2, steps=6, resume=True,
                                overwrite=False, lr=0.05) == 4


def test_resume_of_a_directory_without_a_checkpoint_takes_any_learning_rate(tmp_path):
    """Nothing to restore, so nothing to contradict: --resume --lr starts at step 0."""
    ckpt.claim_directory(tmp_path, "f" * 64, 0, 2, resume=False, overwrite=False,
                         lr=0.001).close()
    assert ckpt.check_directory(tmp_path, "f" * 64, 0, 2, steps=6, resume=True,
                                overwrite=False, lr=0.05) is None


def test_gpt3_6_7b_plan_is_refused_before_launch_with_the_figures(tmp_path, capsys):
    plan = {**TINY, "model": "gpt3-6.7b", "pipelines": [{**TINY["pipelines"][0], "stages": [
        {"layers": [0, 17], "devices": ["a100/0"]}, {"layers": [17, 35], "devices": ["v100/0"]}
    ]}]}
    n_layers = plan_from_dict(plan).load_model().layers
    plan["pipelines"][0]["stages"][1]["layers"][1] = len(n_layers)
    path = tmp_path / "big.json"
    path.write_text(json.dumps(plan))
    pred = predict(plan_from_dict(plan))
    params = sum(layer.params for layer in n_layers)
    assert sum(pred.peak_memory_bytes.values()) >= 16 * params     # state alone, closed form
    with pytest.raises(BadInput, match=r"need .* GB .* has 20\.0 GB available"):
        check_memory(plan_from_dict(plan), pred, str(path), gpus=None, host_bytes=20e9)
    assert cli_main(["run", "--plan", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "GB" in err and "ranks need" in err and len(err.strip().splitlines()) == 1


def test_cpu_ranks_need_no_gpu_runtime_reserve(tmp_path):
    # the README's tiny plan: a few MB of tensors per rank, while the catalog's GPU
    # runtime reserve (CUDA context, NCCL, fragmentation) is GBs that a CPU rank never
    # holds; oracle: the simulator's peaks less DeviceType.reserve_for(the GPU's memory)
    from hyperpipe.cluster.catalog import DeviceType
    plan = plan_from_dict(TINY)
    pred = predict(plan)
    cluster = plan.load_cluster()
    tensors = sum(pred.peak_memory_bytes[d] - DeviceType.reserve_for(
        cluster.device(d).type.memory_bytes) for d in plan.devices)
    assert 0 < tensors < 0.2e9
    need = tensors + RANK_OVERHEAD_BYTES * len(plan.devices)
    line = check_memory(plan, pred, "tiny.json", gpus=None, host_bytes=need + 0.05e9)
    assert f"ranks need {need / 1e9:.2f} GB" in line
    with pytest.raises(BadInput, match="fits this host"):
        check_memory(plan, pred, "tiny.json", gpus=None, host_bytes=need - 0.05e9)
    # on GPUs the reserve is real: an A100 rank needs more than its tensors
    with pytest.raises(BadInput, match="rank 0 .a100/0."):
        check_memory(plan, pred, "tiny.json", gpus=[1e9, 100e9], host_bytes=None)


def test_step_lines_merge_every_ranks_report_as_each_step_ends(tmp_path):
    out = io.StringIO()
    pred = Prediction(0.5, 1000.0, {}, {"a": 0.2, "b": 0.2})
    mon = ConsoleMonitor(pred, 2, stream=out, progress=False)
    col = Collector(tmp_path, 2, mon)
    reps = [FileReporter(tmp_path, r) for r in range(2)]
    reps[0]("expected", device="a", busy_s=40.0)
    reps[1]("expected", device="b", busy_s=40.0)
    reps[0]("step", step=0, start_s=1.0, end_s=2.0, loss=0.0, device="a",
            peak_memory_bytes=1e9, busy_s=0.5)
    col.poll()
    assert "step 0" not in out.getvalue()        # rank 1 has not finished step 0
    assert "scale here 200x" in out.getvalue()   # (40 + 40) / (0.2 + 0.2)
    reps[1]("step", step=0, start_s=1.5, end_s=3.0, loss=2.5, device="b",
            peak_memory_bytes=2e9, busy_s=0.7)
    col.poll()
    line = out.getvalue().splitlines()[-1]
    # step 0, 2.0 s from first start to last end, predicted 0.5 s x 200, summed loss,
    # 1000 tokens / 2 s, the largest peak
    assert line == ("step 0: 2000.0 ms measured, 100000.0 ms predicted here | loss 2.5000 "
                    "| 500 tokens/s | peak memory 2.00 GB/rank")


@pytest.mark.slow
def test_cli_run_prints_each_step_and_resumes_where_it_says(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(TINY))
    ck = str(tmp_path / "ck")
    assert cli_main(["run", "--plan", str(path), "--steps", "2", "--checkpoint", ck]) == 0
    out = capsys.readouterr().out
    assert "timing each rank's actions" in out and "emulation scale here" in out
    rows = [x.split() for x in out.splitlines() if x.startswith("step ")]
    assert [r[1] for r in rows] == ["0:", "1:"] and all(float(r[5]) > 0 for r in rows)
    assert "on 2 rank(s)" in out
    assert cli_main(["run", "--plan", str(path), "--steps", "2", "--checkpoint", ck]) == 2
    assert "--resume" in capsys.readouterr().err
    assert cli_main(["run", "--plan", str(path), "--steps", "3", "--checkpoint", ck,
                     "--resume"]) == 0
    out = capsys.readouterr().out
    assert "holds 2 steps (0 to 1): next is step 2" in out
    assert [x.split()[1] for x in out.splitlines() if x.startswith("step ")] == ["2:"]


def test_layer_profiling_says_what_it_does_and_holds_to_its_budget():
    from hyperpipe.exec.profiler import measure_profile
    lines: list[str] = []
    prof = measure_profile("tiny-gpt", None, micro_batches=(1,), log=lines.append)
    assert lines[0].startswith("profiling F/I/W/B of 3 layer kinds of tiny-gpt")
    # one line per layer kind (each kind timed once), then the optimizer's two
    assert len(lines) == 1 + 3 + 2 and all("(10 timed rounds" in x for x in lines[1:4])
    assert lines[4].startswith("  timing an AdamW step") and "AdamW step:" in lines[5]
    from hyperpipe.exec.profiler import profile_layers
    from hyperpipe.models import load_model
    from hyperpipe.plan.profile import Profile
    lines.clear()
    over = profile_layers(load_model("tiny-gpt"), {"local": 1.0}, micro_batches=(1, 2, 4),
                          budget_s=0.0, log=lines.append)
    timed = [x for x in lines if "timed round" in x]
    # over budget: the trial round and one timed round; a third size is skipped, as the
    # two before it determine the linear fit
    assert len(timed) == 3 * 2 and all("(1 timed round," in x for x in timed)
    assert sum("micro-batch 4: skipped" in x for x in lines) == 3
    assert sorted(over.provenance["skipped"]) == ["block@4", "embedding@4", "head@4"]
    assert all(Profile.key("local", kind, op) in over.compute
               for kind in ("embedding", "block", "head") for op in ("F", "I", "W", "B"))
    assert prof.provenance["model"] == "tiny-gpt" and prof.provenance["model_fingerprint"]


def test_predicted_here_stretches_compute_and_keeps_links():
    """The step predicted here for a plan whose time is mostly a slow link: stretching
    compute by k adds (k - 1) x the compute on the critical path, not (k - 1) x the link
    time. One stage on each of two devices over 1 Gbit/s, gpipe, one micro-batch: the
    step is F0 + send + F1 + B1 + send back + B0, then both optimizer steps at once, so
    stretching by k moves it by (k - 1) x (the four passes + the longer optimizer
    step), the links' part unchanged."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.plan.plan import plan_from_dict
    cluster = {"name": "slow", "inter_node": {"bandwidth": "1 Gbit/s", "latency": "1 ms"},
               "nodes": [{"name": "a", "device": "A100-80GB", "count": 1},
                         {"name": "b", "device": "A100-80GB", "count": 1}]}
    plan = plan_from_dict({"format": "hyperpipe.plan/1", "model": "tiny-gpt",
                           "cluster": cluster, "global_batch": 2,
                           "schedule": {"kind": "gpipe"},
                           "pipelines": [{"micro_batch": 2, "num_microbatches": 1,
                                          "stages": [{"layers": [0, 4], "devices": ["a/0"]},
                                                     {"layers": [4, 8], "devices": ["b/0"]}]}]})
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate
    pred = predict(plan)
    events = simulate(plan, CostModel(plan.load_model(), plan.load_cluster())).trace.events
    passes = sum(e.duration_s for e in events if e.op in ("F", "B", "I", "W"))
    busy = passes + max(e.duration_s for e in events if e.op == "optimizer")
    k = 50.0
    here = pred.stretched_s(k)
    assert here == pytest.approx(pred.iteration_time_s + (k - 1) * busy, rel=1e-6)
    assert pred.iteration_time_s - busy > 0.5e-3      # the links' part: what k leaves
    assert load_cluster(cluster) == plan.load_cluster()   # the plan's cluster untouched


@pytest.mark.parametrize("case", ["a file", "another run's folder"])
def test_a_bad_checkpoint_folder_is_refused_before_anything_is_printed(case, tmp_path,
                                                                       capsys):
    """`--checkpoint keep.txt` (a regular file) and a folder of another run had printed
    the memory line on stdout before the refusal; the run's inputs and outputs are
    checked first, so the refusal comes alone and the file is left as it was."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(TINY))
    target = tmp_path / "keep"
    if case == "a file":
        target.write_text("mine\n")
    else:
        target.mkdir()
        ckpt.write_manifest(target, 2, "old" * 20, ["a", "b"])
    assert cli_main(["run", "--plan", str(path), "--steps", "2", "--checkpoint",
                     str(target)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "--checkpoint" in err, err
    assert case != "a file" or target.read_text() == "mine\n"
