"""Hostile input (issue 33, cases 16 and part of 18): an output name of 255 bytes in
multi-byte characters is written (the temporary name is cut in bytes, not characters),
and a YAML or JSON document that repeats a key is refused with one line, not read
last-wins."""

from __future__ import annotations

import json

import pytest
from hostile import (
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
    temp_files,
)

from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import load_document, write_atomic

CLUSTER_YAML = """\
name: c
nodes:
  - name: a
    device: A100-80GB
    count: 2
"""


@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_output_name_of_255_bytes_in_multibyte_characters(char, tmp_path):
    stem = char * ((255 - 5) // len(char.encode()))
    name = stem + "x" * (255 - 5 - len(stem.encode())) + ".json"
    assert len(name.encode()) == 255
    write_atomic(tmp_path / name, "{}\n")
    assert (tmp_path / name).read_text() == "{}\n"
    assert temp_files(tmp_path) == []


def test_cli_writes_a_255_byte_multibyte_name(tmp_path, capsys):
    name = "é" * 125 + ".json"                  # 250 + 5 bytes
    out = tmp_path / name
    rc, _, err = cli(capsys, ["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                              "--global-batch", "8", "--out", out])
    assert rc == 0, err
    assert json.loads(out.read_text())["format"] == "hyperpipe.plan/1"


DUPLICATES = {
    "yaml-top": ("c.yaml", CLUSTER_YAML + "name: d\n"),
    "yaml-nested": ("c.yaml", CLUSTER_YAML + "    count: 4\n"),
    "json-top": ("c.json", '{"name": "c", "nodes": [], "name": "d"}'),
    "json-nested": ("c.json", '{"nodes": [{"name": "a", "device": "A100-80GB", '
                              '"count": 2, "count": 4}]}'),
}


@pytest.mark.parametrize("case", sorted(DUPLICATES))
def test_repeated_key_is_refused(case, tmp_path, capsys):
    name, text = DUPLICATES[case]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(BadInput, match="repeated"):
        load_document(path)
    rc, out, err = cli(capsys, ["search", "--cluster", path, "--model", "tiny-gpt",
                                "--global-batch", "8"])
    assert_one_line(rc, err, 2, name, "repeated")
    assert out == ""


def test_repeated_key_that_is_a_private_line_is_not_shown(tmp_path):
    path = tmp_path / "shadow.yaml"
    path.write_text("root:$6$abc:19000:0:99999:7::: 1\nroot:$6$abc:19000:0:99999:7::: 2\n")
    with pytest.raises(BadInput) as info:
        load_document(path)
    assert "$6$" not in str(info.value)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("base: &b {a: 1, b: 2}\nm:\n  <<: *b\n  a: 3\n")
    assert load_document(path)["m"] == {"a": 3, "b": 2}
