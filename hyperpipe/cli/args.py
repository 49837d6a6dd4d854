"""Checked argument types of the `hyperpipe` command: every number and path a flag takes
is checked when the command line is parsed, against the documented bounds of
`hyperpipe.core.limits`, so that a bad flag is one line and exit 2 before any work starts.

>>> count(1, 64)("8")
8
>>> real(1.0, 1000.0)("2.5")
2.5
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from hyperpipe.core import limits
from hyperpipe.core.errors import short

NAME_MAX = 255          # bytes of one path component on Linux file systems


def count(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high` (inclusive)."""
    def parse(text: str) -> int:
        digits = text.strip().lstrip("+-")
        if len(digits) > 20 or not (digits.isascii() and digits.isdigit()):
            raise argparse.ArgumentTypeError(
                f"expected an integer from {low} to {high}, got {short(text)}")
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected an integer from {low} to {high} (hyperpipe.core.limits), got {value}")
        return value
    parse.__name__ = "count"
    return parse


def real(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (or (low, high] if `low_open`)."""
    bracket = "(" if low_open else "["
    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= 40 else math.nan
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (low < value if low_open else low <= value) \
            and value <= high
        if not ok:
            raise argparse.ArgumentTypeError(
                f"expected a finite number in {bracket}{low:g}, {high:g}], got {short(text)}")
        return value
    parse.__name__ = "real"
    return parse


def path(text: str) -> str:
    """An argparse type: a file path short enough for the OS, without NUL bytes."""
    if "\0" in text or not text:
        raise argparse.ArgumentTypeError("expected a non-empty path without NUL bytes")
    if len(os.fsencode(text)) > limits.MAX_PATH_CHARS or \
            any(len(os.fsencode(part)) > NAME_MAX for part in text.split("/")):
        raise argparse.ArgumentTypeError(
            f"expected a path of at most {limits.MAX_PATH_CHARS} bytes with names of at "
            f"most {NAME_MAX}, got one of {len(text)} characters")
    return text


# The types of the flags shared by several subcommands.
PIPELINE_DEVICES = count(1, limits.MAX_PIPELINE_DEVICES)
REPLICAS = count(1, limits.MAX_CLUSTER_DEVICES)
TENSOR_PARALLEL = count(1, limits.MAX_NODE_DEVICES)
BATCH = count(1, limits.MAX_GLOBAL_BATCH)
MICROBATCHES = count(1, limits.MAX_MICROBATCHES)
CHUNKS = count(1, limits.MAX_CHUNKS)
WORKERS = count(1, limits.MAX_WORKERS)
TOP = count(1, limits.MAX_TOP)
STEPS = count(1, limits.MAX_STEPS)
EVERY = count(0, limits.MAX_STEPS)
THREADS = count(1, limits.MAX_THREADS)
SEED = count(0, limits.MAX_SEED)
EMULATION_SCALE = real(1.0, limits.MAX_EMULATION_SCALE)
TIMEOUT_S = real(0.0, limits.MAX_TIMEOUT_S, low_open=True)
LEARNING_RATE = real(0.0, 10.0, low_open=True)


def check_vary_size(vary: list[str]) -> None:
    """Refuse a what-if grid of more than MAX_VARIANTS variants (BadInput, exit 2)."""
    from hyperpipe.core.errors import BadInput
    size = 1
    for text in vary:
        size *= max(1, len([v for v in text.partition("=")[2].split(",") if v.strip()]))
    if size > limits.MAX_VARIANTS:
        raise BadInput("--vary", f"a grid of at most {limits.MAX_VARIANTS} variants "
                       "(hyperpipe.core.limits)", f"{size} variants")
