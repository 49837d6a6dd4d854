"""Every command of README.md's usage block runs and exits 0.

The block is the first ```sh fence under `## Usage`; each line that starts with
`hyperpipe ` (a trailing backslash continues it, `#` starts a comment) is run, in order,
in one temporary directory, as `python -m hyperpipe ...`.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SECONDS_PER_COMMAND = 300


def usage_block(text: str) -> str:
    """The first ```sh block of the `## Usage` section, or fail saying what is missing."""
    section = re.search(r"^## Usage\s*$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    if section is None:
        pytest.fail("README.md has no '## Usage' section")
    block = re.search(r"^```sh\s*$(.*?)^```", section.group(1), re.MULTILINE | re.DOTALL)
    if block is None:
        pytest.fail("README.md's '## Usage' section has no ```sh code block")
    return block.group(1)


def hyperpipe_commands(block: str) -> list[list[str]]:
    """The argument lists of the block's `hyperpipe ...` lines, continuations joined and
    comments dropped."""
    logical, pending = [], ""
    for line in block.splitlines():
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        logical.append(pending.strip())
        pending = ""
    if pending.strip():
        logical.append(pending.strip())
    return [shlex.split(line, comments=True)[1:]
            for line in logical if line.startswith("hyperpipe ")]


def test_commands_are_read_from_the_block():
    block = "# a comment\nhyperpipe list models\nhyperpipe simulate --plan p.json \\\n" \
            "    --json   # why\npip install x\n"
    assert hyperpipe_commands(block) == [["list", "models"],
                                         ["simulate", "--plan", "p.json", "--json"]]


@pytest.mark.slow
def test_every_usage_command_exits_0(tmp_path):
    commands = hyperpipe_commands(usage_block(README.read_text(encoding="utf-8")))
    assert commands, "README.md's usage block has no line starting with 'hyperpipe '"
    for words in commands:
        done = subprocess.run([sys.executable, "-m", "hyperpipe", *words], cwd=tmp_path,
                              capture_output=True, text=True, timeout=SECONDS_PER_COMMAND)
        assert done.returncode == 0, (
            f"hyperpipe {shlex.join(words)} exited {done.returncode}:\n"
            f"{done.stderr[-2000:]}")
