"""Hostile input (issue 33, case 8): `export` and `whatif --plan` refuse what simulate and
run refuse (the one plan check, `Plan.check`), with one line and exit 2, where they used
to exit 0 with a configuration or a sweep."""

from __future__ import annotations

import copy
import json

import pytest
from factories import A100_NODE, plan_doc
from hostile import (
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
)

STAGES = [{"layers": [0, 4], "devices": ["n/0"], "tp": 1},
          {"layers": [4, 8], "devices": ["n/1"], "tp": 1}]
GOOD = plan_doc([{"micro_batch": 1, "num_microbatches": 4, "stages": STAGES}])
SYNTH = {"n/0": ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
         "n/1": ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]}


def _edit(path: str, value) -> dict:
    doc = copy.deepcopy(GOOD)
    *keys, last = path.split(".")
    at = doc
    for k in keys:
        at = at[int(k)] if k.isdigit() else at[k]
    at[int(last) if last.isdigit() else last] = value
    return doc


def _synth(change) -> dict:
    actions = copy.deepcopy(SYNTH)
    change(actions)
    return _edit("schedule", {"kind": "synth", "chunks": 1, "actions": actions})


BAD = {
    "layers-beyond-the-model": _edit("pipelines.0.stages.1.layers", [4, 12]),
    "duplicate-device": _edit("pipelines.0.stages.1.devices", ["n/0"]),
    "duplicate-tp-device": _edit("pipelines.0.stages.1", {"layers": [4, 8], "tp": 2,
                                                          "devices": ["n/1", "n/1"]}),
    "deadlocking-synth": _synth(lambda a: a.update({"n/1": ["1B0"] + a["n/1"][:1]
                                                    + a["n/1"][2:]})),
    "duplicate-synth-action": _synth(lambda a: a["n/0"].__setitem__(1, "0F0")),
    "missing-action": _synth(lambda a: a["n/0"].pop()),
    "wrong-stage-synth-action": _synth(lambda a: a["n/0"].__setitem__(0, "1F0")),
    "actions-on-a-non-synth-kind": _edit("schedule", {"kind": "1f1b", "chunks": 1,
                                                      "actions": SYNTH}),
}


def _write(tmp_path, name: str, doc) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("case", sorted(BAD))
def test_simulate_refuses_each_case(case, tmp_path, capsys):
    """The premise: simulate refuses every one of these plans."""
    rc, _, err = cli(capsys, ["simulate", "--plan", _write(tmp_path, "p.json", BAD[case])])
    assert_one_line(rc, err, 2)


@pytest.mark.parametrize("framework", ["megatron", "torchtitan", "deepspeed"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_export_refuses_what_simulate_refuses(case, framework, tmp_path, capsys):
    plan = _write(tmp_path, "p.json", BAD[case])
    rc, out, err = cli(capsys, ["export", "--plan", plan, "--to", framework])
    assert_one_line(rc, err, 2, "p.json")
    assert out == ""


@pytest.mark.parametrize("framework", ["megatron", "torchtitan", "deepspeed"])
def test_export_of_a_good_plan_still_works(framework, tmp_path, capsys):
    for doc in (GOOD, _synth(lambda a: None)):
        plan = _write(tmp_path, "p.json", doc)
        rc, out, err = cli(capsys, ["export", "--plan", plan, "--to", framework])
        assert rc == 0, err
        assert out


@pytest.mark.parametrize("case", ["deadlocking-synth", "layers-beyond-the-model"])
def test_whatif_plan_refuses_what_simulate_refuses(case, tmp_path, capsys):
    plan = _write(tmp_path, "p.json", BAD[case])
    cluster = _write(tmp_path, "c.json", A100_NODE)
    rc, out, err = cli(capsys, ["whatif", "--plan", plan, "--cluster", cluster, "--model",
                                "tiny-gpt", "--global-batch", "4", "--vary",
                                "nodes.n.slowdown=1.5"])
    assert_one_line(rc, err, 2)


def test_whatif_plan_of_another_model_is_refused(tmp_path, capsys):
    plan = _write(tmp_path, "p.json", GOOD)
    cluster = _write(tmp_path, "c.json", A100_NODE)
    model = _write(tmp_path, "m.json", {"kind": "synthetic", "layers": 12,
                                        "fwd_flops_per_sample": 1e9,
                                        "activation_bytes_per_sample": 1e6,
                                        "params_per_layer": 1000, "seq_len": 16,
                                        "hidden": 8})
    rc, out, err = cli(capsys, ["whatif", "--plan", plan, "--cluster", cluster, "--model",
                                model, "--global-batch", "4", "--vary", "nodes.n.slowdown=1.5"])
    assert_one_line(rc, err, 2, "layers")


def test_whatif_with_a_good_plan_still_sweeps(tmp_path, capsys):
    plan = _write(tmp_path, "p.json", GOOD)
    cluster = _write(tmp_path, "c.json", A100_NODE)
    rc, out, err = cli(capsys, ["whatif", "--plan", plan, "--cluster", cluster, "--model",
                                "tiny-gpt", "--global-batch", "4", "--vary",
                                "nodes.n.slowdown=1.5"])
    assert rc == 0, err
    assert "nodes.n.slowdown=1.5" in out
