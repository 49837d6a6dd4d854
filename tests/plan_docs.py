"""Test helper: a copy of a plan document with some fields changed."""

from __future__ import annotations

import json
from typing import Any


def edited(doc: dict, **changes: Any) -> dict:
    """`doc` deep-copied, with each "a/0/b" path set to its value (digits index lists)."""
    out = json.loads(json.dumps(doc))
    for key, value in changes.items():
        target = out
        *path, last = key.split("/")
        for p in path:
            target = target[int(p)] if p.isdigit() else target[p]
        target[last] = value
    return out
