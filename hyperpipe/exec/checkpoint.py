"""Checkpoints: each rank's stages, optimizer, step and RNG state, written atomically.

Layout: ``DIR/step-00000004/rank-00001.pt`` per rank, then ``DIR/step-00000004/
manifest.json``, written last (by rank 0, after every rank has written its file), marks
the checkpoint complete. Every file goes through a temporary name and a rename, so a run
killed at any moment leaves either a complete checkpoint or an incomplete one that
resuming ignores. A manifest carries a fingerprint of the plan, the model and the seed;
resuming from a checkpoint of another run is refused (BadInput, exit 2), never silently
mixed in. Files are read back with torch's weights-only loader.

A directory belongs to one run: ``DIR/run.json`` records its fingerprint, seed, rank
count and learning rate (resuming at another one is refused: the optimizer state
restores the saved one). A fresh run into a directory that holds another run's record or
checkpoints is refused (BadInput) unless asked to overwrite it, so that stale checkpoints
can never outlive the new ones (pruning keeps the highest steps) and be resumed by
mistake.
``DIR/.lock`` (an exclusive `flock`, released by the kernel when its holder dies, even
by SIGKILL) keeps two runs out of one directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import IO, Any

import torch

from hyperpipe.core.errors import BadInput, one_line
from hyperpipe.core.files import atomic_output, open_lock_file, write_atomic
from hyperpipe.models.spec import ModelSpec
from hyperpipe.plan.plan import Plan

MANIFEST = "manifest.json"
CHECKPOINT_FORMAT = "hyperpipe.checkpoint/1"
KEEP = 2                       # complete checkpoints kept; older ones are removed
RUN_RECORD = "run.json"
RUN_FORMAT = "hyperpipe.checkpoint-run/1"
LOCK = ".lock"


def fingerprint(plan: Plan, spec: ModelSpec, seed: int) -> str:
    """sha256 of the plan, the resolved model and the seed: what must match to resume."""
    doc = {"plan": plan.to_dict(), "model": spec.to_dict(), "seed": seed}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def rank_file(root: str | os.PathLike, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}.pt"


def complete_steps(root: str | os.PathLike) -> list[int]:
    """Steps (number of finished training steps) of the complete checkpoints, ascending."""
    base = Path(root)
    if not base.is_dir():
        return []
    steps = []
    for d in base.glob("step-*"):
        tail = d.name[len("step-"):]
        if tail.isascii() and tail.isdigit() and len(tail) <= 18 and (d / MANIFEST).is_file():
            steps.append(int(tail))
    return sorted(steps)


def resume_step(root: str | os.PathLike, expected_fingerprint: str, world_size: int
                ) -> int | None:
    """The step of the last complete checkpoint under `root` (None if there is none).
    Raises BadInput if it belongs to another plan, model or seed."""
    steps = complete_steps(root)
    if not steps:
        return None
    path = step_dir(root, steps[-1]) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInput(str(path), "a readable checkpoint manifest", str(exc)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        raise BadInput(f"{path}: format", repr(CHECKPOINT_FORMAT),
                       manifest.get("format") if isinstance(manifest, dict) else manifest)
    got = manifest.get("fingerprint")
    if got != expected_fingerprint:
        raise BadInput(f"{path}: fingerprint", "a checkpoint of this plan, model and seed "
                       f"({expected_fingerprint[:12]}); it comes from another run",
                       str(got)[:12])
    if manifest.get("world_size") != world_size:
        raise BadInput(f"{path}: world_size", f"{world_size} ranks",
                       manifest.get("world_size"))
    return steps[-1]


def read_run_record(root: str | os.PathLike) -> dict | None:
    """DIR/run.json, the run a checkpoint directory belongs to (None if absent)."""
    path = Path(root) / RUN_RECORD
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInput(str(path), "a readable checkpoint run record", str(exc)) from None
    if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT:
        raise BadInput(f"{path}: format", repr(RUN_FORMAT), doc)
    return doc


def steps_done(n: int) -> str:
    """`n` completed steps in the step lines' numbering (from 0): '4 steps (0 to 3)'. A
    checkpoint's step number counts the steps it holds; the next step run is step `n`."""
    return f"{n} step{'s' if n != 1 else ''} ({'0' if n == 1 else f'0 to {n - 1}'})"


def check_directory(root: str | os.PathLike, fp: str, seed: int, world_size: int, *,
                    steps: int, resume: bool, overwrite: bool,
                    lr: float | None = None) -> int | None:
    """Check that a run may use checkpoint directory `root`; return the step to resume
    from (None: start at step 0). Raises BadInput, before anything is written, when
    `root` holds another run (unless `overwrite`), when `resume` finds a checkpoint of
    another run or one already at or past `steps`, or a run recorded with a learning
    rate other than `lr` (the optimizer state would restore its own; None: unchecked)."""
    base = Path(root)
    if base.exists() and not base.is_dir():
        raise BadInput("--checkpoint", "a directory", str(base))
    record = read_run_record(base)
    done = complete_steps(base)
    if resume:
        if record is not None and record.get("fingerprint") != fp:
            raise BadInput(f"{base / RUN_RECORD}: fingerprint", "a checkpoint directory of "
                           f"this plan, model and seed ({fp[:12]}); it belongs to run "
                           f"{str(record.get('fingerprint'))[:12]} (seed "
                           f"{record.get('seed')})", has_got=False)
        step = resume_step(base, fp, world_size)
        saved = record.get("lr") if record is not None else None
        if step is not None and lr is not None and isinstance(saved, (int, float)) \
                and not isinstance(saved, bool) and saved != lr:
            raise BadInput("--lr", f"the learning rate of the run in {base} ({saved:g}) "
                           "to resume it", lr)
        if step is not None and step >= steps:
            raise BadInput("--steps", f"more than {step}: the checkpoint in {base} already "
                           f"holds {steps_done(step)}, so --steps {steps} leaves nothing to "
                           "run", has_got=False)
        return step
    if overwrite or (record is None and not done):
        return None
    if record is not None and record.get("fingerprint") == fp and not done:
        return None                 # this run's own directory, nothing saved yet
    owner = "another run" if record is None or record.get("fingerprint") != fp else \
        "an earlier run of this plan and seed"
    held = f"checkpoints of up to {steps_done(done[-1])}" if done else \
        "no complete checkpoint"
    who = f" ({str(record.get('fingerprint'))[:12]}, seed {record.get('seed')})" \
        if record is not None else ""
    raise BadInput(f"--checkpoint {base}", f"a directory of this run or an empty one; it "
                   f"belongs to {owner}{who} and holds {held}: add --resume to continue "
                   "it, or --overwrite to replace it", has_got=False)


def claim_directory(root: str | os.PathLike, fp: str, seed: int, world_size: int, *,
                    resume: bool, overwrite: bool, lr: float | None = None) -> IO:
    """Lock `root` for this run and record the run in it (after check_directory), with
    its learning rate `lr` when given. With
    `overwrite` (and no resume) the old checkpoints are removed first. Returns the open
    lock file: keep it open for the whole run (closing it, or exiting, unlocks)."""
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    lock = open_lock_file(base / LOCK)  # never through a planted link or special file
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = one_line(lock.read(40).strip(), 40) or "unknown"
        lock.close()
        raise BadInput(f"--checkpoint {base}", "a directory no other run is using; "
                       f"process {holder} holds {base / LOCK}", has_got=False) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    if overwrite and not resume:
        for step in complete_steps(base):
            shutil.rmtree(step_dir(base, step), ignore_errors=True)
        for d in base.glob("step-*"):       # incomplete ones too
            shutil.rmtree(d, ignore_errors=True)
    doc = {"format": RUN_FORMAT, "fingerprint": fp, "seed": seed, "world_size": world_size}
    if lr is not None:
        doc["lr"] = lr
    write_atomic(base / RUN_RECORD, json.dumps(doc, indent=1) + "\n")
    return lock


def save_rank(root: str | os.PathLike, step: int, rank: int, state: dict[str, Any]) -> None:
    """Write one rank's state through the safe writer (`files.atomic_output`)."""
    with atomic_output(rank_file(root, step, rank)) as f:
        torch.save(state, f)


def remove_temporaries(root: str | os.PathLike) -> None:
    """Remove the temporary files of rank files and manifests that stopped ranks left in
    the step directories (a rank killed mid-write cannot remove its own). Call only
    once every rank of the run is gone."""
    for pattern in ("step-*/.rank-*.pt.*.tmp", "step-*/.manifest.json.*.tmp"):
        for tmp in Path(root).glob(pattern):
            try:
                if stat.S_ISREG(tmp.lstat().st_mode):
                    tmp.unlink()
            except OSError:
                pass


def write_manifest(root: str | os.PathLike, step: int, fp: str, devices: list[str]) -> None:
    """Mark the checkpoint of `step` complete (call after every rank's save), then drop
    complete checkpoints older than the last KEEP."""
    doc = {"format": CHECKPOINT_FORMAT, "step": step, "fingerprint": fp,
           "world_size": len(devices), "devices": devices}
    write_atomic(step_dir(root, step) / MANIFEST, json.dumps(doc, indent=1) + "\n")
    for old in complete_steps(root)[:-KEEP]:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)


def load_rank(root: str | os.PathLike, step: int, rank: int) -> dict[str, Any]:
    path = rank_file(root, step, rank)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:    # a truncated or foreign file: EOFError, pickle errors ...
        first = (str(exc).splitlines() or [""])[0][:80]
        raise BadInput(str(path), "a readable checkpoint file", f"{type(exc).__name__}: "
                       f"{first}") from None


def rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
