"""No leaked line (issue 33, case 4): a file that is not in the expected format (here a
shadow-like password file) is refused with one line that names the file and what was
expected, and never quotes a line of it, whichever flag reads it."""

from __future__ import annotations

import pytest
from hostile import (
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
)

from hyperpipe.core.errors import BadInput, key_name
from hyperpipe.core.files import Fields, check_values

SHADOW = ("root:$6$secretSALT$secretHASHsecretHASH:19000:0:99999:7:::\n"
          "daemon:*:19000:0:99999:7:::\n"
          "alice:$y$j9T$secretHASH2:19000:0:99999:7:::\n")
SECRETS = ("secret", "$6$", "$y$", "19000", "99999", "root", "daemon", "alice")
SIM = ["--pp", "2", "--micro-batch", "1", "--global-batch", "2"]
CASES = {
    "simulate --model": ["simulate", "--model", "{f}", "--cluster", "demo-hetero", *SIM],
    "simulate --cluster": ["simulate", "--model", "tiny-gpt", "--cluster", "{f}", *SIM],
    "simulate --plan": ["simulate", "--plan", "{f}"],
    "simulate --profile": ["simulate", "--model", "tiny-gpt", "--cluster", "demo-hetero",
                           *SIM, "--profile", "{f}"],
    "search --profile": ["search", "--model", "tiny-gpt", "--cluster", "demo-hetero",
                         "--global-batch", "4", "--profile", "{f}"],
    "calibrate --trace": ["calibrate", "--trace", "{f}", "--out", "{d}/p.json"],
    "whatif --vary model=": ["whatif", "--model", "tiny-gpt", "--cluster", "demo-hetero",
                             "--global-batch", "4", "--vary", "model={f}"],
}


@pytest.mark.parametrize("name", ["shadow", "shadow.yaml", "shadow.yml"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_private_file_is_never_quoted(case, name, tmp_path, capsys):
    f = tmp_path / name
    f.write_text(SHADOW)
    argv = [a.replace("{f}", str(f)).replace("{d}", str(tmp_path)) for a in CASES[case]]
    rc, out, err = cli(capsys, argv)
    line = assert_one_line(rc, err, 2, name)
    shown = line.replace(str(tmp_path), "")
    for word in SECRETS:
        assert word not in shown, line
        assert word not in out


def test_key_name_shows_field_names_and_hides_lines():
    for ok in ("n_layer", "device_types", "A100-80GB", "A100|block|F", "n0/gpu1", "x.y", "7"):
        assert key_name(ok) == ok
    for bad in ("root:$6$secret:19000:0:99999:7::", "a b", "x" * 41, "line\nbreak", "",
                "\x1b[31mred"):
        shown = key_name(bad)
        assert bad not in shown or not bad, shown
        assert "characters, not shown" in shown
        assert shown.isprintable()


def test_unknown_key_and_value_paths_hide_a_line():
    line = "root:$6$secretHASH:19000:0:99999:7::"
    with pytest.raises(BadInput) as info:
        Fields({line: None}, "f.yaml", ("name",))
    assert "secret" not in str(info.value) and "f.yaml" in str(info.value)
    with pytest.raises(BadInput) as info:
        check_values({line: {"x": float("nan")}}, "f.yaml")
    assert "secret" not in str(info.value) and "a finite number" in str(info.value)
    with pytest.raises(BadInput, match=r"f\.yaml\.devics: expected one of the known keys"):
        Fields({"devics": 1}, "f.yaml", ("devices",))
