"""SIGTERM at a random moment of a command's first seconds: does it always end well?

Each trial starts `hyperpipe run --plan P --steps 400` (checkpointing every step, so that
ranks are often writing one) or `hyperpipe calibrate --measure --model tiny-gpt` in a
session of its own with a private TMPDIR, sends SIGTERM after a random delay in
[0, --within) seconds, and counts the trial ok when: the exit status is 143, stderr has
no traceback, no process of the session is left (oracle: /proc), and no temporary file
is left (nothing in the private TMPDIR but torch's compile cache, no ``*.tmp`` in the
output folder). A signal that comes while the interpreter itself starts, before any line
of HyperPipe runs, kills it by the default action (status -15 here, 143 in a shell): such
trials are counted apart (``killed_before_python_started``), neither ok nor failed. Prints
one line per command, ``<command> trials=N ok=K killed_before_python_started=E``, and the
first failures.

    python experiments/signal_trials.py --trials 100 [--only run|calibrate] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAN = {"format": "hyperpipe.plan/1", "model": "tiny-gpt",
        "cluster": {"nodes": [{"name": "n", "device": "A100-80GB", "count": 2}]},
        "global_batch": 4, "schedule": {"kind": "1f1b", "chunks": 1},
        "pipelines": [{"micro_batch": 1, "num_microbatches": 4, "stages": [
            {"layers": [0, 4], "devices": ["n/0"]}, {"layers": [4, 8], "devices": ["n/1"]}]}]}
GRACE_S = 10.0            # how long the stopped processes get to go away


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


def command(kind: str, work: Path) -> list[str]:
    hp = [sys.executable, "-m", "hyperpipe"]
    if kind == "run":
        plan = work / "plan.json"
        plan.write_text(json.dumps(PLAN))
        return [*hp, "run", "--plan", str(plan), "--steps", "400",
                "--checkpoint", str(work / "ckpt"), "--checkpoint-every", "1"]
    return [*hp, "calibrate", "--measure", "--model", "tiny-gpt",
            "--out", str(work / "profile.json")]


def trial(kind: str, delay: float, sig: int = signal.SIGTERM) -> str | None:
    """None if the trial ended well, else what went wrong."""
    work = Path(tempfile.mkdtemp(prefix="hp-trial-"))
    tmpdir = work / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.Popen(command(kind, work), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        time.sleep(delay)
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return "did not stop within 120 s"
        deadline = time.monotonic() + GRACE_S
        while session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = session_pids(proc.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        problems = []
        if proc.returncode == -sig:
            # killed by the default action: the signal came while the interpreter started,
            # before it ran a line of HyperPipe (a shell sees 128 + signal all the same)
            problems.append("early")
        elif proc.returncode != 128 + sig:
            problems.append(f"exit {proc.returncode}")
        if "Traceback" in err or "terminate called" in err:
            problems.append("traceback: " + err.strip().splitlines()[-1][:160])
        if left:
            problems.append(f"{len(left)} process(es) left")
        # torch's compile cache folder (torchinductor_USER) is made on import, not ours
        temps = [p for p in tmpdir.rglob("*") if not p.relative_to(tmpdir).parts[0]
                 .startswith("torchinductor_")] + list(work.rglob("*.tmp"))
        if temps:
            problems.append(f"temporary files left: {[str(p) for p in temps[:3]]}")
        return "; ".join(problems) or None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100, help="trials per command")
    ap.add_argument("--within", type=float, default=2.0, help="latest signal time, s")
    ap.add_argument("--only", choices=("run", "calibrate"), help="one command only")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    for kind in ("run", "calibrate"):
        if args.only and kind != args.only:
            continue
        failures, early = [], 0
        for _ in range(args.trials):
            delay = rng.uniform(0.0, args.within)
            problem = trial(kind, delay)
            if problem == "early":
                early += 1
            elif problem:
                failures.append((delay, problem))
        print(f"{kind} trials={args.trials} ok={args.trials - len(failures) - early} "
              f"killed_before_python_started={early}", flush=True)
        for delay, problem in failures[:5]:
            print(f"  after {delay:.3f} s: {problem}", flush=True)


if __name__ == "__main__":
    main()
