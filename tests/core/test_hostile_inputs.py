"""Hostile input files and flags (issue 16): alias bombs, deep nesting, huge files and
counts, special files, files that are not ours (no content may leak into an error), and
every number a flag takes. Each case: exit 2 (or 0), one line, no traceback, quickly,
within 2 GB."""

from __future__ import annotations

import json
import os
import time

import pytest
from hostile import (
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
    mkfifo,
    peak_rss_bytes,
    temp_files,
)

from hyperpipe.core import limits
from hyperpipe.core.files import load_document

SIM = ["--model", "tiny-gpt", "--pp", "2", "--micro-batch", "1", "--global-batch", "2"]
GOOD_CLUSTER = "nodes:\n  - {name: a, device: A100-80GB, count: 2}\n"


def _simulate_cluster(capsys, path, *words):
    t0 = time.process_time()
    rc, _, err = cli(capsys, ["simulate", "--cluster", path, *SIM])
    line = assert_one_line(rc, err, 2, *words)
    assert time.process_time() - t0 < 20
    assert peak_rss_bytes() < 2 * 2**30
    return line


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n"
    for i in range(9))


@pytest.mark.parametrize("name,text,words", [
    ("alias-bomb", BOMB, ["aliases expanded"]),
    ("recursive-alias", "a: &a [1, *a]\n", ["recursive"]),
    ("recursive-mapping", "a: &a {b: *a}\n", ["recursive"]),
    ("deep-list", "[" * 100_000 + "]" * 100_000, ["nest"]),
    ("deep-mapping", "a: " + "{a: " * 5000 + "1" + "}" * 5000, ["nest"]),
    ("deep-block", "".join("  " * i + "a:\n" for i in range(200)), ["nest"]),
    ("python-tag", "!!python/object/apply:os.system ['touch pwned']\n", ["YAML"]),
    ("date", GOOD_CLUSTER + "description: 2024-01-01\n", ["description", "dates"]),
    ("binary", None, []),
    ("empty", "", []),
    ("two-documents", GOOD_CLUSTER + "---\n" + GOOD_CLUSTER, ["YAML"]),
    ("long-unknown-key", GOOD_CLUSTER + "k" * 1000 + ": 1\n", ["known keys"]),
    ("undefined-alias", "nodes: *nothing\n", ["YAML"]),
])
def test_hostile_yaml(name, text, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "c.yaml"
    if text is None:
        path.write_bytes(os.urandom(4096))
    else:
        path.write_text(text)
    line = _simulate_cluster(capsys, path, *words)
    assert len(line) < 700
    assert not (tmp_path / "pwned").exists()


def test_alias_bomb_is_refused_before_objects_are_built(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    assert len(BOMB) < 600
    t0 = time.process_time()
    with pytest.raises(Exception, match="aliases expanded"):
        load_document(path)
    assert time.process_time() - t0 < 5


def test_aliases_within_the_limit_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("link: &l {bandwidth: 1 GB/s, latency: 1 us}\n"
                    "nodes:\n  - {device: T4, count: 1, intra_link: *l}\n"
                    "  - {device: T4, count: 1, intra_link: *l}\n")
    doc = load_document(path)
    assert doc["nodes"][1]["intra_link"] == {"bandwidth": "1 GB/s", "latency": "1 us"}


def test_oversized_yaml_is_refused_by_size(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    line = "# " + "x" * 1000 + "\n"
    path.write_text(GOOD_CLUSTER + line * (limits.MAX_YAML_BYTES // len(line) + 1))
    _simulate_cluster(capsys, path, "at most", "bytes")


def test_yaml_just_under_the_size_cap_parses_in_seconds(tmp_path):
    rows = "".join(f"  - {{name: n{i}, device: T4, count: 1, price_per_hour: 1.5}}\n"
                   for i in range(30_000))
    path = tmp_path / "wide.yaml"
    path.write_text("nodes:\n" + rows)
    assert 0.5 * limits.MAX_YAML_BYTES < path.stat().st_size <= limits.MAX_YAML_BYTES
    t0 = time.process_time()
    assert len(load_document(path)["nodes"]) == 30_000
    assert time.process_time() - t0 < 30


def test_deeply_nested_json_plan(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    rc, _, err = cli(capsys, ["simulate", "--plan", path])
    assert_one_line(rc, err, 2, "nested")


SECRET_LINES = [f"root:$6$SECRETSALT{i}$" + "Q" * 60 + ":19000:0:99999:7:::" for i in range(3)]


@pytest.mark.parametrize("form", ["shadow", "yaml-key", "yaml-value", "json"])
@pytest.mark.parametrize("role", ["plan-cluster", "plan-model", "flag-cluster", "flag-model"])
def test_errors_never_echo_a_line_of_a_foreign_file(form, role, tmp_path, capsys):
    secret = tmp_path / ("shadow.json" if form == "json" else "shadow")
    secret.write_text({
        "shadow": "\n".join(SECRET_LINES) + "\n",
        "yaml-key": "".join(f"{line.replace(':', '_')}: 1\n" for line in SECRET_LINES),
        "yaml-value": "nodes:\n" + "".join(f"  - {line.replace(': ', '_')}\n"
                                           for line in SECRET_LINES),
        "json": "{\"nodes\": [" + ", ".join(json.dumps(x) for x in SECRET_LINES) + "]}",
    }[form])
    if role.startswith("plan"):
        field = role.split("-")[1]
        plan = {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
                "global_batch": 2, "schedule": "1f1b",
                "pipelines": [{"micro_batch": 1, "num_microbatches": 2,
                               "stages": [{"layers": [0, 8], "devices": ["a100/0"]}]}]}
        plan[field] = str(secret)
        (tmp_path / "p.json").write_text(json.dumps(plan))
        argv = ["simulate", "--plan", tmp_path / "p.json"]
    elif role == "flag-cluster":
        argv = ["simulate", "--cluster", secret, *SIM]
    else:
        argv = ["simulate", "--cluster", "demo-hetero", "--model", secret, "--pp", "2",
                "--micro-batch", "1", "--global-batch", "2"]
    rc, out, err = cli(capsys, argv)
    assert_one_line(rc, err, 2)
    for line in SECRET_LINES:
        for piece in (line, line.replace(":", "_"), "Q" * 40, "SECRETSALT0$"):
            assert piece not in err and piece not in out


@pytest.mark.parametrize("special", ["fifo", "dev-zero", "pagemap", "directory", "long",
                                     "missing", "dev-null"])
@pytest.mark.parametrize("flag", ["--cluster", "--plan", "--profile", "calibrate-trace"])
def test_special_files_as_inputs(special, flag, tmp_path, capsys):
    path = {"fifo": lambda: str(mkfifo(tmp_path / "in.yaml")), "dev-zero": lambda: "/dev/zero",
            "pagemap": lambda: "/proc/self/pagemap", "directory": lambda: str(tmp_path),
            "long": lambda: str(tmp_path / ("x" * 300) / "c.yaml"),
            "missing": lambda: str(tmp_path / "missing.yaml"),
            "dev-null": lambda: "/dev/null"}[special]()
    argv = {"--cluster": ["simulate", "--cluster", path, *SIM],
            "--plan": ["simulate", "--plan", path],
            "--profile": ["simulate", "--cluster", "demo-hetero", *SIM, "--profile", path],
            "calibrate-trace": ["calibrate", "--trace", path, "--out", tmp_path / "p.json"],
            }[flag]
    t0 = time.process_time()
    rc, _, err = cli(capsys, argv)
    assert_one_line(rc, err, 2)
    assert time.process_time() - t0 < 20
    assert not (tmp_path / "p.json").exists() and temp_files(tmp_path) == []


def test_plan_naming_a_5000_char_cluster_path(tmp_path, capsys):
    plan = {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "c" * 5000,
            "global_batch": 2, "schedule": "1f1b",
            "pipelines": [{"micro_batch": 1, "num_microbatches": 2,
                           "stages": [{"layers": [0, 8], "devices": ["a/0"]}]}]}
    (tmp_path / "p.json").write_text(json.dumps(plan))
    rc, _, err = cli(capsys, ["simulate", "--plan", tmp_path / "p.json"])
    assert len(assert_one_line(rc, err, 2)) < 700


HUGE_CLUSTERS = {
    "count-1e9": "nodes:\n  - {device: T4, count: 1000000000}\n",
    "repeat-1e5": "nodes:\n  - {device: T4, count: 8, repeat: 100000}\n",
    "total-devices": "".join(["nodes:\n"] + [f"  - {{name: n{i}, device: T4, count: 1024}}\n"
                                             for i in range(65)]),
    "nics-1e9": "nodes:\n  - {device: T4, count: 1, nics: {count: 1000000000}}\n",
}


@pytest.mark.parametrize("name", list(HUGE_CLUSTERS))
def test_huge_counts_in_clusters(name, tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(HUGE_CLUSTERS[name])
    _simulate_cluster(capsys, tmp_path / "c.yaml", "hyperpipe.core.limits")


@pytest.mark.parametrize("doc", [
    {"kind": "synthetic", "layers": 10**7, "fwd_flops_per_sample": 1e9},
    {"kind": "synthetic", "layers": [{"fwd_flops_per_sample": 1}] * (limits.MAX_LAYERS + 1)},
    {"preset": "gpt2-small", "n_layer": 10**7},
    {"preset": "gpt2-small", "d_model": 10**9},
    {"preset": "gpt2-small", "vocab_size": 10**400},
    {"kind": "synthetic", "layers": 2, "hidden": 10**9},
], ids=["layers-1e7", "layer-list", "n_layer", "d_model", "vocab-400-digits", "hidden"])
def test_huge_counts_in_models(doc, tmp_path, capsys):
    (tmp_path / "m.json").write_text(json.dumps(doc))
    rc, _, err = cli(capsys, ["simulate", "--cluster", "demo-hetero", "--model",
                              tmp_path / "m.json", "--pp", "2", "--micro-batch", "1",
                              "--global-batch", "2"])
    assert_one_line(rc, err, 2)


W = ["--cluster", "demo-hetero", "--model", "tiny-gpt"]
RUN = ["run", "--plan", "p.json"]
FLAG_CASES = {
    "workers-10000": ["search", *W, "--global-batch", "8", "--workers", "10000"],
    "whatif-workers": ["whatif", *W, "--global-batch", "8", "--workers", "0"],
    "demo-workers": ["demo", "--workers", "65"],
    "top-0": ["search", *W, "--global-batch", "8", "--top", "0"],
    "global-batch-1e12": ["search", *W, "--global-batch", "1000000000000"],
    "global-batch-400-digits": ["search", *W, "--global-batch", "9" * 400],
    "micro-batch-0": ["search", *W, "--global-batch", "8", "--micro-batch", "0"],
    "pp-neg": ["search", *W, "--global-batch", "8", "--pp", "-1"],
    "tp-1e9": ["simulate", *W, "--pp", "2", "--micro-batch", "1", "--global-batch", "2",
               "--tp", "1000000000"],
    "dp-hex": ["simulate", *W, "--pp", "2", "--micro-batch", "1", "--global-batch", "2",
               "--dp", "0x10"],
    "chunks-0": ["schedule", "--kind", "interleaved-1f1b", "--devices", "2",
                 "--microbatches", "4", "--chunks", "0"],
    "schedule-devices-1e5": ["schedule", "--kind", "1f1b", "--devices", "100000",
                             "--microbatches", "4"],
    "schedule-microbatches-1e6": ["schedule", "--kind", "1f1b", "--devices", "2",
                                  "--microbatches", "1000000"],
    "emulation-scale-neg": ["demo", "--emulation-scale", "-1"],
    "emulation-scale-0": ["demo", "--emulation-scale", "0"],
    "emulation-scale-nan": [*RUN, "--emulation-scale", "nan"],
    "calibrate-emulation-inf": ["calibrate", "--measure", "--model", "tiny-gpt", "--out",
                                "p.json", "--emulation-scale", "inf"],
    "micro-batches-huge": ["calibrate", "--measure", "--model", "tiny-gpt", "--out", "p.json",
                           "--micro-batches", "1,99999999999"],
    "inject-fault-past-steps": [*RUN, "--inject-fault", "0:9", "--steps", "3"],
    "inject-fault-malformed": [*RUN, "--inject-fault", "zero:one"],
    "seed-2**64": [*RUN, "--seed", str(2**64)],
    "seed-neg": [*RUN, "--seed", "-1"],
    "steps-1e30": [*RUN, "--steps", "1" + "0" * 30],
    "steps-0": [*RUN, "--steps", "0"],
    "threads-1e6": [*RUN, "--threads", "1000000"],
    "timeout-0": [*RUN, "--timeout", "0"],
    "timeout-inf": [*RUN, "--timeout", "inf"],
    "lr-nan": [*RUN, "--lr", "nan"],
    "lr-1e308": [*RUN, "--lr", "1e308"],
    "checkpoint-every-neg": [*RUN, "--checkpoint-every", "-5"],
    "vary-nodes=3": ["whatif", *W, "--global-batch", "8", "--vary", "nodes=3"],
    "vary-no-equals": ["whatif", *W, "--global-batch", "8", "--vary", "nodes"],
    "vary-grid-too-big": ["whatif", *W, "--global-batch", "8",
                          "--vary", "global_batch=" + ",".join(map(str, range(1, 100))),
                          "--vary", "inter_node.latency=" + ",".join(f"{i} us"
                                                                    for i in range(1, 100))],
    "path-5000": ["simulate", "--plan", "p" * 5000],
    "path-nul": ["simulate", "--plan", "p\0.json"],
    "out-5000": ["schedule", "--kind", "1f1b", "--devices", "2", "--microbatches", "2",
                 "--out", "o" * 5000],
}


@pytest.mark.parametrize("name", list(FLAG_CASES))
def test_every_cli_number_is_checked_at_parse_time(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t0 = time.process_time()
    rc, _, err = cli(capsys, FLAG_CASES[name])
    assert_one_line(rc, err, 2)
    assert time.process_time() - t0 < 20         # refused before any work starts
    assert list(tmp_path.iterdir()) == []


def test_plan_with_a_million_microbatches(tmp_path, capsys):
    plan = {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
            "global_batch": 10**6, "schedule": "1f1b",
            "pipelines": [{"micro_batch": 1, "num_microbatches": 10**6,
                           "stages": [{"layers": [0, 8], "devices": ["a100/0"]}]}]}
    (tmp_path / "p.json").write_text(json.dumps(plan))
    rc, _, err = cli(capsys, ["simulate", "--plan", tmp_path / "p.json"])
    assert_one_line(rc, err, 2, "num_microbatches", "hyperpipe.core.limits")
