"""Hostile environment (issue 33, case 13): stdout closed, a full device or over
`ulimit -f` ends in one line on stderr and exit status 1, no traceback, and never in
exit 0 with part of the output written. A reader that leaves early (`| head`) is not a
failure."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
from hostile import CLUSTER, PLAN

COMMANDS = {
    "list": ["list", "devices"],
    "search-json": ["search", "--cluster", "PLAN_CLUSTER", "--model", "tiny-gpt",
                    "--global-batch", "2", "--json"],
    "simulate": ["simulate", "--plan", "PLAN"],
    "schedule": ["schedule", "--kind", "1f1b", "--devices", "16", "--microbatches", "64"],
}
LONGER_THAN_1_KIB = ("list", "schedule")     # the outputs `ulimit -f 1` cuts


def _argv(tmp_path, name: str) -> list[str]:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(CLUSTER))
    return [str(plan) if a == "PLAN" else str(cluster) if a == "PLAN_CLUSTER" else a
            for a in COMMANDS[name]]


def _fsize_1k() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))


def _hyperpipe(argv: list[str], how: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    kw: dict = {"stderr": subprocess.PIPE, "text": True, "env": env, "timeout": 120,
                "cwd": os.getcwd()}
    if how == "closed":
        # the child starts with fd 1 closed (a shell's `>&-`)
        cmd = [sys.executable, "-c", "import os, runpy, sys; os.close(1); "
               "sys.argv = ['hyperpipe'] + sys.argv[1:]; "
               "runpy.run_module('hyperpipe', run_name='__main__')", *argv]
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, **kw)
    cmd = [sys.executable, "-m", "hyperpipe", *argv]
    if how == "full":
        with open("/dev/full", "w") as full:
            return subprocess.run(cmd, stdout=full, **kw)
    with open(tmp_path / "out.txt", "w") as out:
        return subprocess.run(cmd, stdout=out, preexec_fn=_fsize_1k, **kw)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize(("name", "how"),
                         [(name, how) for name in sorted(COMMANDS) for how in ("closed", "full")]
                         + [(name, "ulimit-f") for name in LONGER_THAN_1_KIB])
def test_stdout_that_cannot_be_written(name, how, tmp_path):
    argv = _argv(tmp_path, name)
    if how == "ulimit-f":       # the case is void unless the limit cuts the output
        whole = subprocess.run([sys.executable, "-m", "hyperpipe", *argv], timeout=120,
                               capture_output=True, text=True)
        assert whole.returncode == 0, whole.stderr
        assert len(whole.stdout.encode()) > 1024
    proc = _hyperpipe(argv, how, tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert len(lines) == 1 and "stdout" in lines[0], proc.stderr


def test_a_reader_that_leaves_early_is_not_a_failure(tmp_path):
    argv = ["schedule", "--kind", "1f1b", "--devices", "64", "--microbatches", "512"]
    proc = subprocess.Popen([sys.executable, "-m", "hyperpipe", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err, err
