"""What a profile file must hold before it prices a plan: `compute` entries for every
device type in use (an empty `compute` covers none), non-negative fits, and, when it
records a provenance, the model it was measured on. Each refusal is exit 2 with one line
naming the file and the field; `--allow-profile-mismatch` lifts the model and coverage
checks, not the number checks."""

from __future__ import annotations

import copy
import json

import pytest
from factories import chain_plan

from hyperpipe.cli import main as cli_main
from hyperpipe.models import load_model
from hyperpipe.plan.profile import Fit, Profile, model_fingerprint

TYPES = ("A100-80GB", "V100-32GB")
KINDS = ("embedding", "block", "head")


def _profile_doc() -> dict:
    """A valid tiny-gpt profile for demo-hetero, as `Profile.save` writes it."""
    fit = Fit(1e-4, 1e-12, 4, 0.01)
    prof = Profile(compute={Profile.key(t, k, op): fit for t in TYPES for k in KINDS
                            for op in "FIW"},
                   optimizer={t: fit for t in TYPES}, allreduce={"*": fit},
                   overhead={f"{t}|F": 1e-5 for t in TYPES},
                   provenance={"model": "tiny-gpt",
                               "model_fingerprint": model_fingerprint(load_model("tiny-gpt")),
                               "emulated": True})
    return prof.to_dict()


def _simulate(tmp_path, capsys, doc: dict, *extra: str) -> tuple[int, str]:
    plan = tmp_path / "plan.json"
    chain_plan("tiny-gpt", "demo-hetero", [0, 4, 8], ["a100/0", "v100/0"], 2, 4).save(plan)
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps(doc))
    capsys.readouterr()
    rc = cli_main(["simulate", "--plan", str(plan), "--profile", str(prof), *extra])
    return rc, capsys.readouterr().err


def _one_line(err: str, *words: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def test_the_valid_profile_prices_the_plan(tmp_path, capsys):
    rc, err = _simulate(tmp_path, capsys, _profile_doc())
    assert rc == 0, err


def test_empty_compute_is_refused_like_a_missing_device_type(tmp_path, capsys):
    doc = _profile_doc()
    doc["compute"] = {}
    rc, err = _simulate(tmp_path, capsys, doc)
    assert rc == 2
    _one_line(err, "prof.json", "compute", "none for A100-80GB, V100-32GB", "covers none",
              "--allow-profile-mismatch")
    # as with one device type missing (the documented behaviour it now shares)
    doc = _profile_doc()
    doc["compute"] = {k: v for k, v in doc["compute"].items() if not k.startswith("V100")}
    rc, err = _simulate(tmp_path, capsys, doc)
    assert rc == 2
    _one_line(err, "prof.json", "compute", "none for V100-32GB", "covers A100-80GB")
    # asked for explicitly, it is used (analytic costs where it has none)
    doc["compute"] = {}
    assert _simulate(tmp_path, capsys, doc, "--allow-profile-mismatch")[0] == 0


@pytest.mark.parametrize("section,key", [
    ("compute", "A100-80GB|block|F"), ("compute", "V100-32GB|head|W"),
    ("optimizer", "A100-80GB"), ("allreduce", "*")])
@pytest.mark.parametrize("field", ["a_s", "b_s_per_unit"])
def test_negative_fits_are_refused_as_a_negative_overhead_is(section, key, field, tmp_path,
                                                             capsys):
    doc = _profile_doc()
    doc[section][key][field] = -1e-6
    for extra in ((), ("--allow-profile-mismatch",)):
        rc, err = _simulate(tmp_path, capsys, doc, *extra)
        assert rc == 2
        _one_line(err, "prof.json", f"{section}.{key}.{field}", "non-negative", "-1e-06")


def test_a_negative_fit_is_refused_in_the_words_of_a_negative_overhead(tmp_path, capsys):
    said = []
    for section, key, field in (("overhead", "A100-80GB|F", None),
                                ("compute", "A100-80GB|block|F", "a_s")):
        doc = _profile_doc()
        if field is None:
            doc[section][key] = -1e-6
        else:
            doc[section][key][field] = -1e-6
        rc, err = _simulate(tmp_path, capsys, doc)
        assert rc == 2
        said.append(_one_line(err, "prof.json", key).split(": expected ")[1])
    assert said[0] == said[1]


def test_zero_fits_are_still_accepted(tmp_path, capsys):
    doc = _profile_doc()
    doc["compute"]["A100-80GB|embedding|F"].update(a_s=0.0, b_s_per_unit=0.0)
    doc["compute"]["A100-80GB|block|F"].update(a_s=-0.0)
    assert _simulate(tmp_path, capsys, doc)[0] == 0


@pytest.mark.parametrize("how", ["deleted", "null"])
def test_provenance_without_a_model_is_refused(how, tmp_path, capsys):
    doc = _profile_doc()
    for key in ("model_fingerprint", "model"):
        if how == "deleted":
            del doc["provenance"][key]
        else:
            doc["provenance"][key] = None
    rc, err = _simulate(tmp_path, capsys, doc)
    assert rc == 2
    _one_line(err, "prof.json", "provenance.model_fingerprint", "tiny-gpt",
              "--allow-profile-mismatch")
    assert _simulate(tmp_path, capsys, doc, "--allow-profile-mismatch")[0] == 0


def test_a_name_alone_is_still_checked_and_no_provenance_is_not(tmp_path, capsys):
    # a profile older than the fingerprint: checked by name
    doc = _profile_doc()
    del doc["provenance"]["model_fingerprint"]
    assert _simulate(tmp_path, capsys, doc)[0] == 0
    other = copy.deepcopy(doc)
    other["provenance"]["model"] = "gpt2-small"
    rc, err = _simulate(tmp_path, capsys, other)
    assert rc == 2
    _one_line(err, "prof.json", "measured on gpt2-small")
    # a hand-written profile records no provenance at all: documented as unchecked
    for empty in ({}, None):
        doc = _profile_doc()
        if empty is None:
            del doc["provenance"]
        else:
            doc["provenance"] = empty
        assert _simulate(tmp_path, capsys, doc)[0] == 0


def test_a_same_named_model_of_other_shapes_is_named_as_such():
    """A profile of tiny-gpt at another sequence length: the refusal says it was measured
    on another tiny-gpt (other shapes), not the same name twice as if they matched."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.core.errors import BadInput
    from hyperpipe.plan.profile import check_profile
    measured = load_model({"preset": "tiny-gpt", "seq_len": 32})
    prov = {"model": "tiny-gpt", "model_fingerprint": model_fingerprint(measured)}
    with pytest.raises(BadInput, match=r"measured on another tiny-gpt \(other shapes, "):
        check_profile(Profile(provenance=prov), load_model("tiny-gpt"),
                      load_cluster("demo-hetero"), where="p.json")


@pytest.mark.parametrize("section,good,bad,words", [
    ("compute", "A100-80GB|block|F", "A100-80GB|block|Q", ("compute.A100-80GB|block|Q",
                                                          "OP one of F, B, I, W")),
    ("overhead", "A100-80GB|F", "A100-80GB|X", ("overhead.A100-80GB|X", "OP one of")),
    ("allreduce", "*", "local", ("allreduce.local", "a group class key")),
    ("links", None, "local", ("links.local", "a link class key")),
    ("compute", "A100-80GB|block|F", "A100-80GB|blok|F", ("compute", "layer kinds of model "
                                                          "tiny-gpt", "blok")),
    ("optimizer", "A100-80GB", "A100-80G", ("optimizer", "it has entries for A100-80G"))])
def test_a_misspelt_key_is_refused_not_ignored(section, good, bad, words, tmp_path, capsys):
    """An entry nothing reads (a misspelt op, link class, layer kind or device type; an
    all-reduce fit or a link of a device to itself) had left the plan priced without
    it, silently."""
    doc = _profile_doc()
    doc.setdefault(section, {})[bad] = doc[section][good] if good else \
        {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5}
    rc, err = _simulate(tmp_path, capsys, doc)
    assert rc == 2
    _one_line(err, "prof.json", *words)


def test_block_entries_are_read_for_a_model_of_moe_blocks_only(tmp_path, capsys):
    """An MoE layer without moe fits is priced by block's (`_moe_at_dense_rate_s`), so a
    dense profile is no stray for a model whose blocks are all MoE."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.plan.profile import check_profile
    model = load_model({"preset": "tiny-moe", "moe": {"experts": 4, "top_k": 2,
                                                      "expert_hidden": 256, "every": 1}})
    assert "block" not in {layer.kind for layer in model.layers}
    prof = Profile(compute={Profile.key(t, k, "F"): Fit(1e-4, 1e-12)
                            for t in TYPES for k in ("embedding", "block", "head")})
    check_profile(prof, model, load_cluster("demo-hetero"), where="p.json")
