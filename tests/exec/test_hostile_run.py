"""Hostile runs (issue 16): everything a run needs is checked before any rank starts
(exit 2, one line), and a rank that sees a non-finite loss stops the run naming the
rank and the step (exit 1, one line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hostile import (
    PLAN,
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
    temp_files,
)

import hyperpipe.exec.launch as launch


@pytest.fixture
def plan_path(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN))
    return path


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if any rank is started."""
    def started(*args, **kwargs):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(launch, "launch_local", started)


@pytest.mark.parametrize("case", ["trace-in-proc", "trace-is-fifo", "chrome-is-dir",
                                  "checkpoint-is-file", "checkpoint-under-file",
                                  "checkpoint-in-proc", "seed-2**63", "seed-2**39"])
def test_run_inputs_are_checked_before_any_rank_starts(case, plan_path, tmp_path, capsys,
                                                       no_ranks):
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    extra = {"trace-in-proc": ["--trace", "/proc/hyperpipe/t.json"],
             "trace-is-fifo": ["--trace", tmp_path / "fifo"],
             "chrome-is-dir": ["--chrome", tmp_path],
             "checkpoint-is-file": ["--checkpoint", tmp_path / "file"],
             "checkpoint-under-file": ["--checkpoint", tmp_path / "file" / "ck"],
             "checkpoint-in-proc": ["--checkpoint", "/proc/hyperpipe-ck"],
             "seed-2**63": ["--seed", str(2**63)],
             # issue 33, case 15: seed * 2**24 + step must fit torch's signed 64 bits
             "seed-2**39": ["--seed", str(2**39)]}[case]
    rc, _, err = cli(capsys, ["run", "--plan", plan_path, "--no-emulate", *extra])
    assert_one_line(rc, err, 2)
    assert temp_files(tmp_path) == []


@pytest.mark.slow
def test_nan_weights_stop_the_run_naming_rank_and_step(plan_path, tmp_path, capsys):
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, ["run", "--plan", plan_path, "--no-emulate", "--steps", "1",
                              "--checkpoint", ck])
    assert rc == 0, err
    rank0 = ck / "step-00000001" / "rank-00000.pt"
    state = torch.load(rank0, weights_only=True)
    poisoned = 0

    def poison(obj):
        nonlocal poisoned
        if isinstance(obj, torch.Tensor) and obj.is_floating_point():
            obj.fill_(float("nan"))
            poisoned += 1
        elif isinstance(obj, dict):
            for v in obj.values():
                poison(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                poison(v)
    poison({k: v for k, v in state.items() if k not in ("rng", "step")})
    assert poisoned > 0
    torch.save(state, rank0)
    rc, out, err = cli(capsys, ["run", "--plan", plan_path, "--no-emulate", "--steps", "3",
                                "--checkpoint", ck, "--resume"])
    line = assert_one_line(rc, err, 1, "NonFiniteLoss", "at step 1")
    assert "rank 1 (n/1) failed" in line            # the last stage computes the loss
    assert not (ck / "step-00000002").exists()      # the poisoned step is not kept


@pytest.mark.slow
def test_empty_and_corrupt_rank_files_name_the_file(plan_path, tmp_path, capsys,
                                                     monkeypatch):
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, ["run", "--plan", plan_path, "--no-emulate", "--steps", "1",
                              "--checkpoint", ck])
    assert rc == 0, err
    rank1 = ck / "step-00000001" / "rank-00001.pt"
    rank1.write_bytes(b"")
    resume = ["run", "--plan", plan_path, "--no-emulate", "--steps", "2", "--checkpoint", ck,
              "--resume"]
    with monkeypatch.context() as m:
        m.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("a rank was started"))
        rc, _, err = cli(capsys, resume)
    assert_one_line(rc, err, 2, "rank-00001.pt", "empty")
    rank1.write_bytes(b"\x80\x02garbage" * 10)
    rc, _, err = cli(capsys, resume)
    # issue 33, case 18: a corrupt file is bad input (2), whichever process reads it
    assert_one_line(rc, err, 2, "rank 1 on n/1", "rank-00001.pt")
    # a file that loads but holds another rank's stages (it had exited 1: KeyError)
    rank1.write_bytes((ck / "step-00000001" / "rank-00000.pt").read_bytes())
    rc, _, err = cli(capsys, resume)
    assert_one_line(rc, err, 2, "rank-00001.pt", "the state of rank 1's stages [1]")
    # this rank's file of another checkpoint of the run (it hung until the timeout,
    # then blamed a peer)
    ck2 = tmp_path / "ck2"
    for steps in ("1", "2"):
        rc, _, err = cli(capsys, ["run", "--plan", plan_path, "--no-emulate", "--steps",
                                  steps, "--checkpoint", ck2] + (["--resume"] if steps == "2"
                                                                 else []))
        assert rc == 0, err
    (ck2 / "step-00000002" / "rank-00001.pt").write_bytes(
        (ck2 / "step-00000001" / "rank-00001.pt").read_bytes())
    rc, _, err = cli(capsys, ["run", "--plan", plan_path, "--no-emulate", "--steps", "3",
                              "--checkpoint", ck2, "--resume"])
    assert_one_line(rc, err, 2, "rank-00001.pt", "the state after step 2",
                    "the state after step 1")


def _pids_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 0])
def test_a_stopped_rank_is_blamed_and_no_process_is_left(rank, plan_path, capsys,
                                                          monkeypatch):
    """SIGSTOP one rank (the last, then the first) mid-run: the watchdog names it, not
    the peer whose receive timed out waiting for it, and every rank process is gone."""
    from multiprocessing.context import ForkServerProcess
    started = []
    real_start = ForkServerProcess.start

    def start(self):
        real_start(self)
        started.append(self.pid)
    monkeypatch.setattr(ForkServerProcess, "start", start)
    rc, _, err = cli(capsys, ["run", "--plan", plan_path, "--no-emulate", "--steps", "3",
                              "--timeout", "3", "--inject-fault", f"{rank}:1:stop"])
    line = assert_one_line(rc, err, 1, f"rank {rank} (n/{rank}) failed", "stopped answering")
    assert "process stopped" in line
    assert len(started) == 2 and _pids_alive(started) == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11+")
def test_a_module_in_the_working_directory_does_not_run_in_the_ranks(plan_path, tmp_path):
    """`hyperpipe run` from a directory holding a ``grp.py`` (a standard module's name,
    which the forkserver's start-up imports) must not execute it: the forkserver starts
    without the working directory on its path (`launch._safe_path`)."""
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "ran"
    (work / "grp.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                 "raise ImportError('not the real grp')\n")
    exe = Path(sys.executable).parent / "hyperpipe"
    done = subprocess.run([str(exe), "run", "--plan", str(plan_path), "--steps", "1"],
                          cwd=work, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists()


def test_a_synthetic_model_without_widths_names_the_plan_file(tmp_path, capsys):
    """`run` needs a synthetic model's widths; the plan that holds the model is the file
    to fix (the line named only the model)."""
    plan = tmp_path / "syn.json"
    plan.write_text(json.dumps({
        "format": "hyperpipe.plan/1", "global_batch": 4, "schedule": {"kind": "1f1b"},
        "model": {"kind": "synthetic", "layers": 2, "fwd_flops_per_sample": 1e9,
                  "activation_bytes_per_sample": 1000, "params_per_layer": 1000},
        "cluster": {"nodes": [{"name": "n", "device": "A100-80GB", "count": 2}]},
        "pipelines": [{"micro_batch": 1, "num_microbatches": 4, "stages": [
            {"layers": [0, 1], "devices": ["n/0"]}, {"layers": [1, 2], "devices": ["n/1"]}]}]}))
    rc, _, err = cli(capsys, ["run", "--plan", plan, "--no-emulate"])
    assert_one_line(rc, err, 2, f"{plan}: model: layers[0].hidden", "a width")
    # in a file of its own, named as the plan names it (relative to the plan): the
    # line names that file where it is, from any working directory
    doc = json.loads(plan.read_text())
    (tmp_path / "m.json").write_text(json.dumps(doc["model"]))
    plan.write_text(json.dumps({**doc, "model": "m.json"}))
    rc, _, err = cli(capsys, ["run", "--plan", plan, "--no-emulate"])
    assert_one_line(rc, err, 2, f"{tmp_path / 'm.json'}: layers[0].hidden")
