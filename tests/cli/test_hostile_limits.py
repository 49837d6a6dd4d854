"""Hostile environment (issue 33, case 15): a host limit too low for the work (`ulimit
-n 12`) ends in one line and exit 1 before any rank starts, no traceback."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
from hostile import CLUSTER, PLAN

from hyperpipe.exec import preflight


def _hyperpipe_with_files(limit: int, argv: list[str], cwd) -> subprocess.CompletedProcess:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-m", "hyperpipe", *argv], cwd=cwd, env=env,
                          preexec_fn=lower, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", ["run", "search"])
def test_too_few_open_files_is_one_line(command, tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    (tmp_path / "cluster.json").write_text(json.dumps(CLUSTER))
    argv = {"run": ["run", "--plan", "plan.json", "--steps", "1"],
            "search": ["search", "--cluster", "cluster.json", "--model", "tiny-gpt",
                       "--global-batch", "4", "--workers", "4"]}[command]
    proc = _hyperpipe_with_files(12, argv, tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hyperpipe:")]
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and "open files" in lines[0], proc.stderr


def test_the_soft_limit_is_raised_within_the_hard_one(tmp_path):
    """A soft limit below the need but a hard limit above it: the run raises its own soft
    limit rather than refusing (the need of two ranks is FDS_BASE + 2 FDS_PER_RANK)."""
    need = preflight.FDS_BASE + 2 * preflight.FDS_PER_RANK
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}

    def lower_soft() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (12, max(need, 1024)))
    proc = subprocess.run([sys.executable, "-m", "hyperpipe", "run", "--plan", "plan.json",
                           "--steps", "1", "--no-emulate"], cwd=tmp_path, env=env,
                          preexec_fn=lower_soft, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
