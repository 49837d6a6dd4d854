"""What the subcommands read beyond their flags: the calibration profile (checked
against the model and cluster it will price) and comma-separated integer lists.
Bad input raises BadInput naming the flag (exit 2).
"""

from __future__ import annotations

from typing import Any

from hyperpipe.cli.flags import ProfileOptions, as_flags
from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput


def load_checked_profile(opts: ProfileOptions, model: Any, cluster: Any,
                         devices: Any = None) -> Any:
    """The profile at `opts.path` (None without one), checked to belong to `model` and
    cover the device types in use (of `devices`, or of the whole `cluster`)."""
    if opts.path is None:
        return None
    from hyperpipe.plan.profile import check_profile, load_profile
    profile = load_profile(opts.path)
    with as_flags():
        check_profile(profile, model, cluster, where=f"--profile {opts.path}",
                      allow_mismatch=opts.allow_mismatch, devices=devices)
    return profile


def int_list(text: str, where: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4): at most 64 integers from 1 to MAX_GLOBAL_BATCH."""
    try:
        values = tuple(int(x) for x in text.split(",")) if len(text) <= 400 else ()
    except ValueError:
        values = ()
    if not values or min(values) < 1 or max(values) > limits.MAX_GLOBAL_BATCH \
            or len(values) > 64:
        raise BadInput(where, "a comma-separated list of at most 64 integers from 1 to "
                       f"{limits.MAX_GLOBAL_BATCH}", text)
    return values
