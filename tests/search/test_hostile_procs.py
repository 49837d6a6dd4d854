"""Search workers do not outlive a killed parent (issue 16)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostile import clean_case  # noqa: F401 (autouse: no temp file, no process)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
                != "Z")
    except OSError:
        return False


@pytest.mark.slow
def test_search_workers_die_with_a_killed_parent():
    proc = subprocess.Popen([sys.executable, "-m", "hyperpipe", "search", "--cluster",
                             "a100-v100", "--model", "gpt3-13b", "--global-batch", "512",
                             "--workers", "2"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and len(workers) < 2 and proc.poll() is None:
            time.sleep(0.1)
            workers = _children(proc.pid)
        assert len(workers) >= 2, "the search finished or never started its workers"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:                   # never leave an orphan, even when failing
            if _alive(w):
                os.kill(w, signal.SIGKILL)
