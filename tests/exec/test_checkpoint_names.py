"""Checkpoint folders a user (or a hostile neighbour) named (issue 33, case 7): only
``step-`` and up to 18 ASCII digits name a step; ``step-²`` is not one and must not raise
ValueError while looking for the last complete step."""

from __future__ import annotations

import pytest

from hyperpipe.exec.checkpoint import MANIFEST, complete_steps


@pytest.mark.parametrize("name", ["step-\u00b2", "step-\u0663", "step-" + "9" * 200,
                                  "step-", "step-1a"])
def test_odd_step_folders_are_not_steps(name, tmp_path):
    for folder in ("step-00000002", name):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / MANIFEST).write_text("{}")
    assert complete_steps(tmp_path) == [2]
