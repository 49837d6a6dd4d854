"""The `frameworks` marker: tests that run the frameworks' own code (deepspeed, torchtitan,
megatron-core, installed by ``pip install -e '.[frameworks]'``; CI's .ci/run installs
them). Without the extra such a test is skipped with the install line as its reason, so
the core install stays green and says what it did not check; under CI (CI=true) a missing
extra fails the test instead, so that CI never passes without running them."""

from __future__ import annotations

import importlib.util
import os

import pytest

EXTRA = ("deepspeed", "torchtitan", "megatron.core")


def missing() -> list[str]:
    out = []
    for name in EXTRA:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            out.append(name)
    return out


def pytest_collection_modifyitems(config, items):
    gone = missing()
    if not gone or os.environ.get("CI") == "true":     # under CI they run, and fail
        return
    why = (f"the frameworks extra is not installed ({', '.join(gone)} missing): "
           "pip install -e '.[frameworks]'")
    for item in items:
        if item.get_closest_marker("frameworks") is None:
            continue
        item.add_marker(pytest.mark.skip(reason=why))
