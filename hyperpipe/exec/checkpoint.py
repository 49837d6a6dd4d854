"""Checkpoints: each rank's stages, optimizer, step and RNG state, written atomically.

Layout: ``DIR/step-00000004/rank-00001.pt`` per rank, then ``DIR/step-00000004/
manifest.json``, written last (by rank 0, after every rank has written its file), marks
the checkpoint complete. Every file goes through a temporary name and a rename, so a run
killed at any moment leaves either a complete checkpoint or an incomplete one that
resuming ignores. A manifest carries a fingerprint of the plan, the model and the seed;
resuming from a checkpoint of another run is refused (BadInput, exit 2), never silently
mixed in. Files are read back with torch's weights-only loader.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from hyperpipe.errors import BadInput
from hyperpipe.files import atomic_output, write_atomic
from hyperpipe.models.spec import ModelSpec
from hyperpipe.plan.plan import Plan

MANIFEST = "manifest.json"
CHECKPOINT_FORMAT = "hyperpipe.checkpoint/1"
KEEP = 2                       # complete checkpoints kept; older ones are removed


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
        if tail.isdigit() and (d / MANIFEST).is_file():
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


def save_rank(root: str | os.PathLike, step: int, rank: int, state: dict[str, Any]) -> None:
    """Write one rank's state through the safe writer (`files.atomic_output`)."""
    with atomic_output(rank_file(root, step, rank)) as f:
        torch.save(state, f)


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
