"""Malformed input: exit status 2, one line on stderr naming the file and field, no
traceback, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from plan_docs import edited

from hyperpipe.cli import main

GOOD_PLAN = {
    "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
    "global_batch": 8, "schedule": {"kind": "1f1b", "chunks": 1},
    "pipelines": [{"micro_batch": 2, "num_microbatches": 4,
                   "stages": [{"layers": [0, 5], "devices": ["a100/0"], "tp": 1},
                              {"layers": [5, 8], "devices": ["v100/0"], "tp": 1}]}],
}


def _plan_with(**changes) -> str:
    return json.dumps(edited(GOOD_PLAN, **changes))


GOOD_CLUSTER = "nodes:\n  - {name: n0, device: A100-80GB, count: 2}\n"

# (case id, files to write {name: text}, argv with {dir} for the folder, words the error
# line must contain)
CASES = [
    ("plan-missing-file", {}, ["simulate", "--plan", "{dir}/nope.json"], ["nope.json"]),
    ("unknown-option", {}, ["run", "--plan", "{dir}/p.json", "--json"],
     ["hyperpipe run: expected only the options `hyperpipe run --help` lists",
      "got '--json'"]),
    ("required-option", {}, ["run"], ["hyperpipe run: expected --plan (required)"]),
    ("plan-bad-json", {"p.json": "{\"format\": "}, ["simulate", "--plan", "{dir}/p.json"],
     ["p.json", "JSON"]),
    ("plan-format", {"p.json": _plan_with(format="hyperpipe.plan/7")},
     ["simulate", "--plan", "{dir}/p.json"], ["p.json", "format"]),
    ("plan-kind", {"p.json": _plan_with(schedule={"kind": "zigzag"})},
     ["simulate", "--plan", "{dir}/p.json"], ["schedule.kind", "zigzag"]),
    ("plan-cluster-missing", {"p.json": _plan_with(cluster="missing.yaml")},
     ["simulate", "--plan", "{dir}/p.json"], ["p.json: cluster", "missing.yaml"]),
    # a missing model file is named as a missing cluster file is: the plan and its field
    ("plan-model-missing", {"p.json": _plan_with(model="missing.yaml")},
     ["simulate", "--plan", "{dir}/p.json"], ["p.json: model: expected", "missing.yaml"]),
    ("plan-model-unknown", {"p.json": _plan_with(model="nomodel")},
     ["simulate", "--plan", "{dir}/p.json"], ["p.json: model", "nomodel"]),
    ("plan-inline-cluster", {"p.json": _plan_with(cluster={"nodes": [
        {"name": "a100", "device": "A100-80GB", "count": -1}]})},
     ["simulate", "--plan", "{dir}/p.json"], ["p.json: cluster: nodes[0].count"]),
    ("plan-batch", {"p.json": _plan_with(global_batch=9)},
     ["simulate", "--plan", "{dir}/p.json"], ["global_batch"]),
    ("plan-overlap", {"p.json": _plan_with(**{"pipelines/0/stages/1/layers": [4, 8]})},
     ["simulate", "--plan", "{dir}/p.json"], ["stages[1].layers", "overlapping"]),
    ("plan-gap", {"p.json": _plan_with(**{"pipelines/0/stages/1/layers": [6, 8]})},
     ["simulate", "--plan", "{dir}/p.json"], ["stages[1].layers", "missing"]),
    ("plan-short", {"p.json": _plan_with(**{"pipelines/0/stages/1/layers": [5, 7]})},
     ["simulate", "--plan", "{dir}/p.json"], ["stages", "0..8"]),
    ("plan-no-device", {"p.json": _plan_with(**{"pipelines/0/stages/1/devices": ["v100/7"]})},
     ["simulate", "--plan", "{dir}/p.json"], ["devices", "v100/7"]),
    ("plan-device-twice", {"p.json": _plan_with(**{"pipelines/0/stages/1/devices":
                                                   ["a100/0"]})},
     ["simulate", "--plan", "{dir}/p.json"], ["devices", "a100/0"]),
    ("plan-negative-mb", {"p.json": _plan_with(**{"pipelines/0/micro_batch": -2})},
     ["simulate", "--plan", "{dir}/p.json"], ["micro_batch", "positive"]),
    ("plan-text-count", {"p.json": _plan_with(**{"pipelines/0/num_microbatches": "four"})},
     ["simulate", "--plan", "{dir}/p.json"], ["num_microbatches"]),
    ("plan-unknown-key", {"p.json": _plan_with(colour="red")},
     ["simulate", "--plan", "{dir}/p.json"], ["colour"]),
    ("plan-bad-model", {"p.json": _plan_with(model="gpt-9")},
     ["simulate", "--plan", "{dir}/p.json"], ["gpt-9"]),
    ("cluster-bad-yaml", {"c.yaml": "nodes: [ {name: n0"},
     ["simulate", "--plan", "{dir}/p.json", "--cluster", "{dir}/c.yaml"], ["c.yaml", "YAML"]),
    ("cluster-unknown-type", {"c.yaml": "nodes:\n  - {device: B300, count: 2}\n"},
     ["simulate", "--plan", "{dir}/p.json", "--cluster", "{dir}/c.yaml"],
     ["c.yaml", "nodes[0].device", "B300"]),
    ("cluster-negative-count", {"c.yaml": "nodes:\n  - {device: T4, count: -2}\n"},
     ["simulate", "--plan", "{dir}/p.json", "--cluster", "{dir}/c.yaml"],
     ["nodes[0].count", "-2"]),
    ("cluster-text-count", {"c.yaml": "nodes:\n  - {device: T4, count: many}\n"},
     ["simulate", "--plan", "{dir}/p.json", "--cluster", "{dir}/c.yaml"],
     ["nodes[0].count"]),
    ("cluster-unit", {"c.yaml": GOOD_CLUSTER + "inter_node: {bandwidth: '100 Gparsec/s'}\n"},
     ["simulate", "--plan", "{dir}/p.json", "--cluster", "{dir}/c.yaml"],
     ["inter_node.bandwidth", "Gparsec"]),
    ("cluster-unknown-key", {"c.yaml": GOOD_CLUSTER + "colour: red\n"},
     ["simulate", "--plan", "{dir}/p.json", "--cluster", "{dir}/c.yaml"], ["colour"]),
    ("cluster-no-nodes", {"c.yaml": "nodes: []\n"},
     ["simulate", "--plan", "{dir}/p.json", "--cluster", "{dir}/c.yaml"], ["nodes"]),
    ("cluster-python-tag", {"c.yaml": "nodes: !!python/object/apply:os.system ['true']\n"},
     ["simulate", "--plan", "{dir}/p.json", "--cluster", "{dir}/c.yaml"], ["c.yaml"]),
    ("model-unknown-preset", {"m.yaml": "preset: gpt5-huge\n"},
     ["simulate", "--plan", "{dir}/p.json", "--model", "{dir}/m.yaml"], ["m.yaml", "gpt5"]),
    ("model-bad-yaml", {"m.yaml": "preset: [gpt2"},
     ["simulate", "--plan", "{dir}/p.json", "--model", "{dir}/m.yaml"], ["m.yaml", "YAML"]),
    ("model-negative-layers", {"m.yaml": "preset: gpt2-small\nn_layer: -3\n"},
     ["simulate", "--plan", "{dir}/p.json", "--model", "{dir}/m.yaml"], ["n_layer", "-3"]),
    ("model-heads", {"m.yaml": "preset: gpt2-small\nn_head: 7\n"},
     ["simulate", "--plan", "{dir}/p.json", "--model", "{dir}/m.yaml"], ["n_head"]),
    ("model-synthetic-flops", {"m.yaml": "kind: synthetic\nlayers: 8\n"
                               "fwd_flops_per_sample: -1\n"},
     ["simulate", "--plan", "{dir}/p.json", "--model", "{dir}/m.yaml"],
     ["fwd_flops_per_sample"]),
    ("model-unknown-key", {"m.yaml": "preset: gpt2-small\nwidth: 3\n"},
     ["simulate", "--plan", "{dir}/p.json", "--model", "{dir}/m.yaml"], ["width"]),
    ("profile-bad", {"f.json": "{\"format\": \"hyperpipe.profile/1\", \"compute\": "
                     "{\"A100|block\": {\"a_s\": 1, \"b_s_per_unit\": 0}}}"},
     ["simulate", "--plan", "{dir}/p.json", "--profile", "{dir}/f.json"], ["f.json", "compute"]),
    ("schedule-kind", {}, ["schedule", "--kind", "zigzag", "--devices", "2",
                           "--microbatches", "4"], ["zigzag"]),
    ("schedule-devices", {}, ["schedule", "--kind", "1f1b", "--devices", "0",
                              "--microbatches", "4"], ["0"]),
    ("schedule-chunks", {}, ["schedule", "--kind", "1f1b", "--devices", "2",
                             "--microbatches", "4", "--chunks", "3"], ["chunks"]),
    ("schedule-not-int", {}, ["schedule", "--kind", "1f1b", "--devices", "two",
                              "--microbatches", "4"], ["--devices"]),
    ("unknown-command", {}, ["teleport"], ["teleport"]),
    ("schedule-out-is-a-dir", {}, ["schedule", "--kind", "1f1b", "--devices", "2",
                                   "--microbatches", "2", "--out", "{dir}"], ["writable"]),
    ("simulate-plan-and-options", {}, ["simulate", "--plan", "{dir}/p.json", "--dp", "2"],
     ["--dp"]),
    ("search-chunks-without-interleaving", {},
     ["search", "--cluster", "demo-hetero", "--model", "tiny-gpt", "--global-batch", "8",
      "--schedule", "gpipe", "--chunks", "2"], ["--chunks", "gpipe"]),
    ("search-too-many-pipelines", {},
     ["search", "--cluster", "demo-hetero", "--model", "tiny-gpt", "--global-batch", "3",
      "--dp", "4"], ["--dp"]),
    ("simulate-synth-from-options", {},
     ["simulate", "--cluster", "demo-hetero", "--model", "tiny-gpt", "--pp", "2",
      "--micro-batch", "1", "--global-batch", "8", "--schedule", "synth"],
     ["--schedule: expected a fixed kind", "search", "got 'synth'"]),
    ("simulate-tp-splits-no-heads", {},
     ["simulate", "--cluster", "h100-a100-l4", "--model", "gpt2-small", "--pp", "1",
      "--tp", "8", "--micro-batch", "1", "--global-batch", "8"],
     ["--tp: expected a divisor of the model's n_head (12)", "got 8"]),
    ("option-before-command", {},
     ["--json", "search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
      "--global-batch", "8"],
     ["hyperpipe: expected a command's options after its name (hyperpipe search ...)",
      "got '--json'"]),
    ("search-sequence-parallel-splits-no-tokens", {"m.json": '{"preset": "gpt2-small", '
                                                  '"seq_len": 1023}'},
     ["search", "--cluster", "demo-hetero", "--model", "{dir}/m.json", "--global-batch",
      "8", "--sequence-parallel"],
     ["--sequence-parallel: expected a tensor-parallel degree above 1 that splits the "
      "model's 1023 tokens"]),
    ("vary-links-without-links", {},
     ["whatif", "--cluster", "demo-hetero", "--model", "tiny-gpt", "--global-batch", "8",
      "--vary", "links.0.bandwidth=1 Gbit/s"],
     ["--vary links.0.bandwidth: expected a cluster with paths to vary"]),
    ("calibrate-bad-trace", {"t.json": "{\"format\": \"hyperpipe.trace/1\", \"events\": [[1]]}"},
     ["calibrate", "--trace", "{dir}/t.json", "--out", "{dir}/out.json"], ["t.json", "events"]),
    # plan options name the flag, not "plan: schedule.chunks"
    ("simulate-chunks", {}, ["simulate", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                             "--pp", "2", "--micro-batch", "2", "--global-batch", "8",
                             "--schedule", "zb-h1", "--chunks", "2"],
     ["--chunks: expected 1 for schedule 'zb-h1' (only interleaved-1f1b and synth take "
      "other chunk counts)"]),
    ("schedule-plan-and-shape", {}, ["schedule", "--kind", "synth", "--plan", "{dir}/p.json",
                                     "--devices", "7"],
     ["--devices", "--plan"]),
    ("calibrate-no-plan", {"t.json": "{\"format\": \"hyperpipe.trace/1\", \"events\": []}"},
     ["calibrate", "--trace", "{dir}/t.json", "--out", "{dir}/out.json"], ["t.json", "plan"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    _, files, argv, words = case
    (tmp_path / "p.json").write_text(json.dumps(GOOD_PLAN))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = main([a.replace("{dir}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing half-written


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    (tmp_path / "c.yaml").write_text("nodes:\n  - {device: T4, count: -1}\n")
    proc = subprocess.run([sys.executable, "-m", "hyperpipe", "search", "--cluster",
                           str(tmp_path / "c.yaml"), "--model", "tiny-gpt",
                           "--global-batch", "8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "nodes[0].count" in proc.stderr
