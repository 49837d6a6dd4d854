"""Reading user files safely, and checking their fields with clear errors.

Every loader in HyperPipe reads through `load_document` (YAML safe loading or JSON, with
a size limit; no code runs from data files) and checks fields through a `Fields` view,
which names the file and the field path in each error and rejects unknown keys.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from hyperpipe.errors import BadInput
from hyperpipe.units import parse_quantity

MAX_INPUT_BYTES = 16 * 2**20  # a plan of a 1024-GPU cluster is well under 1 MiB


def load_document(path: str | os.PathLike) -> Any:
    """Parse a YAML or JSON file (by extension; YAML otherwise) into plain data."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(str(p), "an existing file", has_got=False)
    size = p.stat().st_size
    if size > MAX_INPUT_BYTES:
        raise BadInput(str(p), f"a file of at most {MAX_INPUT_BYTES} bytes", f"{size} bytes")
    text = p.read_text(encoding="utf-8", errors="replace")
    if p.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadInput(str(p), f"valid JSON ({exc.msg} at line {exc.lineno})",
                           has_got=False) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise BadInput(str(p), f"valid YAML ({getattr(exc, 'problem', 'parse error')}{line})",
                       has_got=False) from None


def write_atomic(path: str | os.PathLike, text: str | bytes) -> None:
    """Write `text` to `path` through a temporary file and a rename: never half-written.
    A path that cannot be written is bad input (one line, exit 2), with no file left."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            tmp.write_bytes(text)
        else:
            tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, p)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise BadInput(str(p), f"a writable file path ({exc.strerror or exc})",
                       has_got=False) from None


def save_figure(fig: Any, path: str | os.PathLike, *, dpi: int = 110) -> None:
    """Save a matplotlib figure as PNG atomically (through `write_atomic`)."""
    import io
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    write_atomic(path, buf.getvalue())


class Fields:
    """A checked view of one mapping in a user file.

    >>> f = Fields({"count": 2}, "c.yaml: nodes[0]")
    >>> f.positive_int("count")
    2
    """

    def __init__(self, data: Any, where: str, allowed: Iterable[str] | None = None):
        if not isinstance(data, dict):
            raise BadInput(where, "a mapping", type(data).__name__)
        self.data = data
        self.where = where
        if allowed is not None:
            unknown = sorted(set(map(str, data)) - set(allowed))
            if unknown:
                raise BadInput(f"{where}.{unknown[0]}",
                               f"one of the known keys {sorted(allowed)}", "an unknown key",
                               has_got=False)

    def at(self, key: str) -> str:
        return f"{self.where}.{key}"

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = ...) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise BadInput(self.at(key), "a value (the field is required)", has_got=False)
            return default
        return self.data[key]

    def sub(self, key: str, allowed: Iterable[str] | None = None) -> Fields:
        return Fields(self.raw(key), self.at(key), allowed)

    def string(self, key: str, default: Any = ...) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str) or not value:
            raise BadInput(self.at(key), "a non-empty string", value)
        return value

    def positive_int(self, key: str, default: Any = ..., *, allow_zero: bool = False) -> int:
        value = self.raw(key, default)
        return check_int(value, self.at(key), allow_zero=allow_zero)

    def number(self, key: str, default: Any = ..., *, positive: bool = False,
               at_most: float | None = None) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0 or (positive and value == 0) \
                or (at_most is not None and value > at_most):
            want = "a positive number" if positive else "a non-negative number"
            if at_most is not None:
                want += f" of at most {at_most}"
            raise BadInput(self.at(key), want, value)
        return float(value)

    def quantity(self, key: str, dimension: str, default: Any = ..., *,
                 positive: bool = True) -> float:
        value = self.raw(key, default)
        return parse_quantity(value, dimension, where=self.at(key), allow_zero=not positive)

    def choice(self, key: str, options: Iterable[str], default: Any = ...) -> str:
        value = self.raw(key, default)
        options = list(options)
        if value not in options:
            raise BadInput(self.at(key), f"one of {options}", value)
        return value

    def items(self, key: str, default: Any = ...) -> list:
        value = self.raw(key, default)
        if not isinstance(value, list):
            raise BadInput(self.at(key), "a list", type(value).__name__)
        return value


def check_int(value: Any, where: str, *, allow_zero: bool = False) -> int:
    """Return `value` if it is a positive (or non-negative) integer, else raise BadInput."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 \
            or (value == 0 and not allow_zero):
        want = "a non-negative integer" if allow_zero else "a positive integer"
        raise BadInput(where, want, value)
    return value


def resolve_ref(ref: str, base_dir: Path | None) -> Path | None:
    """A file path inside a document is relative to that document's folder."""
    p = Path(ref)
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    return p
