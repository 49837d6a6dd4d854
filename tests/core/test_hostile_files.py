"""Hostile input (issue 33, cases 16 and part of 18): an output name of 255 bytes in
multi-byte characters is written (the temporary name is cut in bytes, not characters),
and a YAML or JSON document that repeats a key is refused with one line, not read
last-wins. Also: a UTF-8 byte-order mark is read past, and a number in exponent form
that YAML 1.1 reads as a string is read as the number."""

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
from hyperpipe.core.files import Fields, load_document, whole_number, write_atomic

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


@pytest.mark.parametrize("name, text", [
    ("c.json", '{"name": "c", "nodes": [{"name": "a", "device": "A100-80GB", "count": 2}]}'),
    ("c.yaml", CLUSTER_YAML),
])
def test_a_utf8_byte_order_mark_is_read_past(name, text, tmp_path, capsys):
    """A file saved with a BOM (Windows editors) reads as without one: JSON had been
    refused ("Unexpected UTF-8 BOM") while YAML was read."""
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_document(path)["nodes"][0]["count"] == 2
    rc, _, err = cli(capsys, ["simulate", "--cluster", path, "--model", "tiny-gpt",
                              "--pp", "2", "--micro-batch", "1", "--global-batch", "2"])
    assert rc == 0, err


@pytest.mark.parametrize("text, value", [("5e-1", 0.5), ("25E-2", 0.25), ("1e0", 1.0),
                                         (".5e0", 0.5), ("+5e-1", 0.5)])
def test_a_number_in_exponent_form_is_that_number(text, value, tmp_path):
    """YAML 1.1 reads `efficiency: 5e-1` as the string '5e-1'; a plain-number field reads
    it as the number, as a count reads `1e6` (it had been refused: "expected a positive
    number ..., got '5e-1'")."""
    path = tmp_path / "f.yaml"
    path.write_text(f"efficiency: {text}\n")
    doc = load_document(path)
    assert doc["efficiency"] == text                 # what YAML 1.1 gives
    assert Fields(doc, "f.yaml").number("efficiency", positive=True) == value


@pytest.mark.parametrize("value", ["5e-1x", "0x1p-1", "1e", "e5", "\uff15e-1", "5 e-1",
                                   "0.5", "nan", "1e999"])
def test_a_string_that_is_not_in_exponent_form_is_still_refused(value):
    """Only the exponent form (ASCII digits) is read: a quoted plain decimal stays a string,
    as a count's "4" does, and an exponent beyond a float is no finite number."""
    with pytest.raises(BadInput, match=r"^f\.yaml\.efficiency: expected a positive number"):
        Fields({"efficiency": value}, "f.yaml").number("efficiency", positive=True)


@pytest.mark.parametrize("value, read", [("4e0", 4), (4.0, 4), ("1E3", 1000), ("2.5e0", 2.5),
                                         ("4", "4"), ("\uff14e0", "\uff14e0")])
def test_whole_numbers_and_plain_numbers_read_by_one_form(value, read):
    assert whole_number(value) == read and type(whole_number(value)) is type(read)
