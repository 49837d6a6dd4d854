"""No clobbered input (issue 33, case 9): no output of a command may be one of its
inputs, another of its outputs, or a file inside the folder a run owns (--checkpoint);
such a command is refused before any work with one line and exit 2, every file as it
was. Paths are compared resolved, so a symlink or a detour (``d/../x``) is no way round."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from hostile import (
    PLAN,
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
)

import hyperpipe.exec.launch as launch
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import check_outputs

CLUSTERS = Path(__file__).resolve().parents[2] / "hyperpipe" / "data" / "clusters"
WORKLOAD = ["--model", "tiny-gpt", "--global-batch", "4"]
CASES = {
    "run --trace x --chrome x": ["run", "--plan", "p.json", "--trace", "x.json",
                                 "--chrome", "x.json"],
    "run --trace <the plan>": ["run", "--plan", "p.json", "--trace", "p.json"],
    "run --trace <the plan, by a detour>": ["run", "--plan", "p.json",
                                            "--trace", "ck/../p.json"],
    "run --trace <a link to the plan>": ["run", "--plan", "p.json", "--trace", "link.json"],
    "run --checkpoint ck --trace ck/run.json": ["run", "--plan", "p.json", "--checkpoint",
                                                "ck", "--trace", "ck/run.json"],
    "run --checkpoint ck --chrome ck/step-1/c.json": [
        "run", "--plan", "p.json", "--checkpoint", "ck", "--chrome", "ck/step-1/c.json"],
    "calibrate --trace t --out t": ["calibrate", "--trace", "t.json", "--out", "t.json"],
    "search --cluster c --out c": ["search", "--cluster", "c.yaml", *WORKLOAD,
                                   "--out", "c.yaml"],
    "search --model m --out m": ["search", "--cluster", "demo-hetero", "--model", "m.yaml",
                                 "--global-batch", "4", "--out", "m.yaml"],
    "simulate --plan p --trace p": ["simulate", "--plan", "p.json", "--trace", "p.json"],
    "simulate --trace x --chrome x": ["simulate", "--plan", "p.json", "--trace", "x.json",
                                      "--chrome", "x.json"],
    "export --plan p --out p": ["export", "--plan", "p.json", "--to", "megatron",
                                "--out", "p.json"],
    "schedule --plan p --out p": ["schedule", "--kind", "synth", "--plan", "p.json",
                                  "--out", "p.json"],
    "whatif --cluster c.pdf --plot c.pdf": ["whatif", "--cluster", "c.pdf", *WORKLOAD,
                                            "--vary", "model=tiny-gpt", "--plot", "c.pdf"],
}


@pytest.fixture
def no_ranks(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(launch, "launch_local", started)


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_output_never_overwrites_an_input_or_another_output(case, tmp_path, capsys,
                                                               monkeypatch, no_ranks):
    monkeypatch.chdir(tmp_path)
    Path("p.json").write_text(json.dumps(PLAN))
    Path("link.json").symlink_to(tmp_path / "p.json")
    shutil.copy(CLUSTERS / "demo-hetero.yaml", "c.yaml")
    shutil.copy(CLUSTERS / "demo-hetero.yaml", "c.pdf")      # a YAML file all the same
    Path("m.yaml").write_text("preset: tiny-gpt\n")
    Path("t.json").write_text(json.dumps({"format": "hyperpipe.trace/1", "events": []}))
    Path("ck").mkdir()
    before = _digests(tmp_path)
    rc, out, err = cli(capsys, CASES[case])
    assert_one_line(rc, err, 2, "expected a")
    assert out == ""
    assert _digests(tmp_path) == before
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        ["p.json", "link.json", "c.yaml", "c.pdf", "m.yaml", "t.json", "ck"])


def test_check_outputs(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text("{}")
    check_outputs([("--plan", a), ("--model", "tiny-gpt"), ("--cluster", None)],
                   [("--trace", b), ("--chrome", tmp_path / "c.json"), ("--out", None)],
                   [("--checkpoint", tmp_path / "ck")])
    check_outputs([("--plan", tmp_path / "missing.json")], [("--out", tmp_path / "m.json")])
    (tmp_path / "ck2").mkdir()
    check_outputs([], [("--trace", tmp_path / "ck2x" / "t.json")],
                   [("--checkpoint", tmp_path / "ck2")])
    link = tmp_path / "link.json"
    link.symlink_to(a)
    for inputs, outputs, folders, words in (
            ([("--plan", a)], [("--trace", link)], [], "input --plan"),
            ([], [("--trace", b), ("--chrome", tmp_path / "." / "b.json")], [],
             "output --trace"),
            ([], [("--trace", tmp_path / "ck" / "t.json")], [("--checkpoint",
                                                             tmp_path / "ck")],
             "outside --checkpoint")):
        with pytest.raises(BadInput, match=words):
            check_outputs(inputs, outputs, folders)
