"""Checks of a run's outputs before any rank starts: a path that cannot be written fails
now, as bad input (exit 2), not after the ranks have trained for minutes.

The output files (--trace, --chrome) must be new paths or regular files in a folder we
can write (a temporary file is created there and removed, which is a true test even for
root and read-only file systems); the checkpoint folder must be a folder we can write,
or a path where one can be made.
"""

from __future__ import annotations

import os
from pathlib import Path

from hyperpipe.errors import BadInput
from hyperpipe.exec.options import RunOptions
from hyperpipe.files import check_writable, probe_folder, show_path


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
