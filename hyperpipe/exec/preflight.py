"""Checks of a run before any rank starts, and the one check every rank makes per step.

Before: a path that cannot be written fails now, as bad input (exit 2), not after the
ranks have trained for minutes; a checkpoint to resume from has every rank's file, each
non-empty.

During: a rank whose loss is NaN or infinite stops the run (`NonFiniteLoss`; the
launcher reports ``rank R (device) failed: NonFiniteLoss: loss nan at step S``, exit 1)
before that step is checkpointed, rather than training on poisoned weights.

The output files (--trace, --chrome) must be new paths or regular files in a folder we
can write (a temporary file is created there and removed, which is a true test even for
root and read-only file systems); the checkpoint folder must be a folder we can write,
or a path where one can be made.
"""

from __future__ import annotations

import math
import os
import resource
from pathlib import Path

from hyperpipe.core.errors import BadInput, HyperPipeError
from hyperpipe.core.files import check_writable, probe_folder, show_path
from hyperpipe.exec import checkpoint
from hyperpipe.exec.options import RunOptions


def check_outputs(options: RunOptions) -> None:
    """Raise BadInput unless every output path of `options` can be written."""
    for flag, path in (("--trace", options.trace_path), ("--chrome", options.chrome_path)):
        if path is not None:
            try:
                check_writable(path)
            except BadInput as exc:
                raise BadInput(f"{flag} {exc.where}", exc.expected, has_got=False) from None
    if options.checkpoint_dir is not None:
        root = Path(options.checkpoint_dir)
        if os.path.lexists(root) and not root.is_dir():
            raise BadInput(f"--checkpoint {show_path(root)}", "a directory (or a new path)",
                           has_got=False)
        try:
            probe_folder(root)
        except BadInput as exc:
            raise BadInput(f"--checkpoint {exc.where}", exc.expected, has_got=False) from None


# File descriptors a run needs, per process: the launcher holds a pipe and a sentinel per
# rank, a gloo rank a socket pair and an epoll set per peer. Measured here (torch 2.13,
# gloo, CPU): 2 ranks ran under `ulimit -n 32`, 4 ranks needed 40; twice that margin.
FDS_BASE = 32
FDS_PER_RANK = 8


class TooFewFiles(HyperPipeError):
    """The open-file limit is below what the run's ranks need (exit 1)."""


def check_open_files(world: int) -> None:
    """Raise the soft open-file limit as far as a run of `world` ranks needs, within the
    hard limit; raise TooFewFiles if the hard limit is lower."""
    need = FDS_BASE + FDS_PER_RANK * world
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise TooFewFiles(f"{world} ranks need about {need} open files; the limit is {hard} "
                          "(raise it with `ulimit -n`)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def check_rank_files(root: str | os.PathLike, step: int, world: int) -> None:
    """Raise BadInput naming the file unless every rank's checkpoint file of `step`
    exists and is not empty (a truncated file would fail inside a rank, later)."""
    for rank in range(world):
        path = checkpoint.rank_file(root, step, rank)
        try:
            size = os.stat(path).st_size
        except OSError as exc:
            raise BadInput(show_path(path), f"rank {rank}'s checkpoint file of step {step} "
                           f"({exc.strerror})", has_got=False) from None
        if size == 0:
            raise BadInput(show_path(path), f"rank {rank}'s checkpoint file of step {step}",
                           "an empty file")


class NonFiniteLoss(HyperPipeError):
    """A step's loss is NaN or infinite: the weights or the data are poisoned."""


def check_loss(loss: float, step: int) -> None:
    """Raise NonFiniteLoss if this rank's loss of `step` is not finite."""
    if not math.isfinite(loss):
        raise NonFiniteLoss(f"loss {loss} at step {step} (weights or data hold NaN/Inf; "
                            "this step was not checkpointed)")
