"""Stopping a real run from outside: SIGTERM/SIGHUP to the launcher stop every rank
(exit 143/129, one line saying so); SIGKILL to the launcher leaves no rank behind.

Oracle: the process table. The run starts in a session of its own, so every process it
starts (ranks, fork server, resource tracker), even one reparented to PID 1, keeps that
session id; none may be left once the run is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")]

PLAN = {"format": "hyperpipe.plan/1", "model": "tiny-gpt",
        "cluster": {"nodes": [{"name": "n", "device": "A100-80GB", "count": 2}]},
        "global_batch": 4, "schedule": {"kind": "1f1b", "chunks": 1},
        "pipelines": [{"micro_batch": 1, "num_microbatches": 4, "stages": [
            {"layers": [0, 4], "devices": ["n/0"]}, {"layers": [4, 8], "devices": ["n/1"]}]}]}


def session_pids(sid: int) -> set[int]:
    """Live (non-zombie) processes whose session id is `sid`."""
    found = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found.add(int(d.name))
    return found


def start_run(tmp_path: Path, *extra: str) -> subprocess.Popen:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hyperpipe", "run", "--plan", str(plan), "--steps", "100000",
         "--no-emulate", "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
         *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    # running: launcher, fork server, resource tracker and both ranks, and a checkpoint
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if len(session_pids(proc.pid)) >= 5 and \
                list((tmp_path / "ckpt").glob("step-*/manifest.json")):
            return proc
        if proc.poll() is not None:
            pytest.fail(f"run ended early: {proc.communicate()}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("run did not start within 120 s")


def wait_gone(sid: int, within_s: float) -> set[int]:
    deadline = time.monotonic() + within_s
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return session_pids(sid)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_stop_signal_stops_every_rank_with_one_line(tmp_path, sig, code):
    proc = start_run(tmp_path)
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        left = wait_gone(proc.pid, 10)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == code, err
    assert not left, f"processes left behind: {left}"
    lines = [x for x in err.splitlines() if x.startswith("hyperpipe:")]
    assert len(lines) == 1, err
    assert f"stopped by {sig.name}: all 2 rank(s) stopped" in lines[0]
    assert "last complete checkpoint" in lines[0]
    assert "Traceback" not in err


def test_sigkill_of_the_launcher_leaves_no_rank_behind(tmp_path):
    proc = start_run(tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    left = wait_gone(proc.pid, 30)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind 30 s after SIGKILL: {left}"


def test_ctrl_c_to_the_process_group_is_one_line_and_130(tmp_path):
    """Issue 33 case 12: Ctrl-C reaches every process of the group; only the launcher
    speaks (the ranks' reports are never printed), exit 130, nothing left."""
    proc = start_run(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        left = wait_gone(proc.pid, 10)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert not left, f"processes left behind: {left}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert [x for x in err.splitlines() if x.strip()] == \
        [x for x in err.splitlines() if x.startswith("hyperpipe: stopped by SIGINT")], err


SLOW_WRITER = '''
import pathlib, time
from hyperpipe.core.files import atomic_output

def target(rank, world, store, folder):
    out = pathlib.Path(folder) / "step-00000001" / f"rank-{rank:05d}.pt"
    with atomic_output(out) as f:
        f.write(b"x" * 1000)
        (pathlib.Path(folder) / f"ready-{rank}").write_text("")
        for _ in range(600):
            time.sleep(0.1)
'''

LAUNCHER = '''
import sys
import slow_writer
from hyperpipe.cli.main import sigterm_as_exit
from hyperpipe.exec.launch import launch_local

if __name__ == "__main__":
    with sigterm_as_exit():
        launch_local(slow_writer.target, (sys.argv[1],), ["n/0", "n/1"])
'''


def test_sigterm_while_ranks_write_checkpoints_leaves_no_temporary(tmp_path):
    """Issue 33 case 17: ranks stopped half-way through writing their checkpoint files
    remove the temporaries (`.rank-*.pt.*.tmp`)."""
    (tmp_path / "slow_writer.py").write_text(SLOW_WRITER)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while not all((ckpt / f"ready-{r}").exists() for r in range(2)):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"ranks did not start writing: {proc.communicate()}")
        time.sleep(0.1)
    assert len(list(ckpt.glob("step-*/.rank-*.pt.*.tmp"))) == 2      # both mid-write
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        left = wait_gone(proc.pid, 10)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert not left
    assert list(ckpt.rglob("*.tmp")) == [], err


def test_sigterm_in_the_first_seconds_always_ends_well():
    """Issue 33 case 2, a handful of the trials of experiments/signal_trials.py: SIGTERM
    early in `run` and `calibrate --measure` (torch still importing) exits 143, without
    a traceback, a process or a temporary file left."""
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "experiments" / "signal_trials.py"
    spec = importlib.util.spec_from_file_location("signal_trials", path)
    trials = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trials)
    problems = {}
    for kind in ("run", "calibrate"):
        for delay in (0.15, 0.5, 0.9):       # torch importing, then the run starting
            problem = trials.trial(kind, delay)
            if problem not in (None, "early"):
                problems[kind, delay] = problem
    assert not problems


def test_a_cause_keeps_the_line_a_message_announces():
    """The one line naming a failed rank's cause: torch's 'Failed to run stage backward
    input:' says what failed on its next line, which the launcher dropped."""
    from hyperpipe.exec.launch import _cause
    assert _cause(RuntimeError("Failed to run stage backward input:\n"
                               "Can't detach views in-place.\nmore")) == \
        "RuntimeError: Failed to run stage backward input: Can't detach views in-place."
    assert _cause(ValueError("bad size\ndetail")) == "ValueError: bad size"
    assert _cause(KeyError()) == "KeyError"
