"""What the subcommands write: exit statuses, JSON on stdout, and text to a file or
stdout. Exit status: 0 success, 1 anything else, 2 bad input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT = 0, 1, 2


def print_json(obj: Any) -> None:
    """`obj` as indented JSON on stdout (paths as strings)."""
    json.dump(obj, sys.stdout, indent=1, default=_json_default)
    sys.stdout.write("\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_text(text: str, out: str | None) -> None:
    """`text` written atomically to `out`, or to stdout without one."""
    if out:
        from hyperpipe.core.files import write_atomic
        write_atomic(out, text)
    else:
        sys.stdout.write(text)
