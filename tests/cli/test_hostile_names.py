"""Hostile input (issue 33, case 14 and the `$` part of 7): terminal escapes and line
breaks in cluster, node and model names reach no terminal raw (simulate, search), and
`$...$` in names or --vary values is drawn as written, not parsed as mathtext."""

from __future__ import annotations

import json

import pytest
from hostile import (
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
)

ESC = "\x1b[31m"
CLUSTER = {"name": f"cl{ESC}RED\nFAKE LINE",
           "nodes": [{"name": f"n{ESC}x\ry", "device": "A100-80GB", "count": 2}]}
MODEL = {"kind": "synthetic", "name": f"mo{ESC}G\nFAKE2", "layers": 4,
         "fwd_flops_per_sample": 1e9, "activation_bytes_per_sample": 1e6,
         "params_per_layer": 1000, "seq_len": 16, "hidden": 8}


def _write(tmp_path, name: str, doc) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def _clean(out: str) -> None:
    assert "\x1b" not in out and "\r" not in out
    assert not any(line.startswith(("FAKE", "RED")) for line in out.splitlines())


def test_search_and_simulate_print_names_escaped(tmp_path, capsys):
    cluster, model = _write(tmp_path, "c.json", CLUSTER), _write(tmp_path, "m.json", MODEL)
    plan = tmp_path / "p.json"
    rc, out, err = cli(capsys, ["search", "--cluster", cluster, "--model", model,
                                "--global-batch", "4", "--out", plan])
    assert rc == 0, err
    _clean(out + err)
    assert "\\x1b[31mRED\\nFAKE LINE" in out
    rc, out, err = cli(capsys, ["simulate", "--plan", plan])       # the plan loads back
    assert rc == 0, err
    _clean(out + err)
    assert "n\\x1b[31mx\\ry/0" in out


@pytest.mark.parametrize("name", ["$x^$", "$\\frac{$", "a$b", "$$"])
def test_dollar_names_are_drawn_as_written(name, tmp_path, capsys):
    cluster = _write(tmp_path, "c.json", {**CLUSTER, "name": name})
    rc, out, err = cli(capsys, ["simulate", "--cluster", cluster, "--model", "tiny-gpt",
                                "--pp", "2", "--micro-batch", "1", "--global-batch", "4",
                                "--timeline", tmp_path / "t.png"])
    assert rc == 0, err
    assert (tmp_path / "t.png").stat().st_size > 0


def test_dollar_vary_values_are_drawn_as_written(tmp_path, capsys):
    cluster = _write(tmp_path, "c.json", {"nodes": CLUSTER["nodes"]})
    rc, out, err = cli(capsys, ["whatif", "--cluster", cluster, "--model", "tiny-gpt",
                                "--global-batch", "4", "--vary", "name=$x^$,b",
                                "--plot", tmp_path / "w.png"])
    assert rc == 0, err
    assert (tmp_path / "w.png").stat().st_size > 0


def test_device_type_names_are_printed_escaped(tmp_path, capsys):
    """A device type named with an escape and a line break (defined under device_types,
    used by a node) reaches neither search's nor whatif's table raw."""
    kind = f"gpu{ESC}\nFAKE3"
    cluster = _write(tmp_path, "c.json", {
        "device_types": {kind: {"base": "A100-80GB"}},
        "nodes": [{"name": "n", "device": kind, "count": 2}]})
    for argv in (["search", "--cluster", cluster, "--model", "tiny-gpt", "--global-batch",
                  "4"],
                 ["whatif", "--cluster", cluster, "--model", "tiny-gpt", "--global-batch",
                  "4", "--vary", "inter_node.bandwidth=10 Gbit/s,100 Gbit/s"]):
        rc, out, err = cli(capsys, argv)
        assert rc == 0, err
        _clean(out + err)
        assert "gpu\\x1b[31m\\nFAKE3" in out


def test_vary_values_are_printed_escaped(tmp_path, capsys):
    """A --vary value naming a model file whose name holds an escape is shown escaped in
    the table and on the plot's labels."""
    model = _write(tmp_path, f"m{ESC}.json", {**MODEL, "name": "plain"})
    rc, out, err = cli(capsys, ["whatif", "--cluster",
                                _write(tmp_path, "c.json", {"nodes": CLUSTER["nodes"]}),
                                "--model", "tiny-gpt", "--global-batch", "4",
                                "--vary", f"model=tiny-gpt,{model}",
                                "--plot", tmp_path / "w.png"])
    assert rc == 0, err
    _clean(out + err)
    assert "m\\x1b[31m.json" in out
