"""Calibration fits one model: traces of different models (by shape, not name) are
refused with one line naming both files and writing nothing; the profile written records
the model, so that `simulate` refuses it for another."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from factories import chain_plan

from hyperpipe.cli import main as cli_main
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.profile import load_profile, model_fingerprint
from hyperpipe.plan.trace import Trace
from hyperpipe.sim.calibrate import calibrate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate

TINY_GPT_SEQ32 = {"preset": "tiny-gpt", "seq_len": 32}   # same name, other shapes


def _plan(model, cuts: list[int]) -> Plan:
    return chain_plan(model, "demo-hetero", cuts, ["a100/0", "v100/0"], 2, 2)


def _measured_like(plan: Plan) -> Trace:
    """A simulated trace of `plan` with its step repeated as step 1 (calibration leaves
    step 0, the warm-up, out), standing in for a measured one (`meta.source`
    "measured": calibration refuses a simulated trace)."""
    trace = simulate(plan, CostModel(plan.load_model(), plan.load_cluster())).trace
    end = max(e.end_s for e in trace.events)
    again = tuple(replace(e, start_s=e.start_s + end, end_s=e.end_s + end, step=1)
                  for e in trace.events)
    return Trace(trace.events + again, {**trace.meta, "source": "measured"})


@pytest.fixture(scope="module")
def traces() -> dict[str, Trace]:
    return {"gpt": _measured_like(_plan("tiny-gpt", [0, 4, 8])),
            "moe": _measured_like(_plan("tiny-moe", [0, 3, 6])),
            "gpt-seq32": _measured_like(_plan(TINY_GPT_SEQ32, [0, 4, 8]))}


@pytest.mark.parametrize("other,needles", [
    ("moe", ["tiny-moe"]),
    ("gpt-seq32", []),         # told apart by fingerprint although both say tiny-gpt
])
def test_calibrate_refuses_traces_of_different_models(traces, other, needles, tmp_path,
                                                      capsys):
    a, b = tmp_path / "A.json", tmp_path / "B.json"
    traces["gpt"].save(a)
    traces[other].save(b)
    out = tmp_path / "p.json"
    assert cli_main(["calibrate", "--trace", str(a), str(b), "--out", str(out)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    fp_a = model_fingerprint(load_model("tiny-gpt"))
    for word in [str(a), str(b), "meta.plan.model", "tiny-gpt", fp_a, *needles]:
        assert word in lines[0], (word, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A.json", "B.json"]  # nothing written


def test_calibrate_library_names_the_sources(traces):
    with pytest.raises(BadInput, match=r"^t0, t1: meta\.plan\.model: expected traces of one "
                       r"model.*t0 ran tiny-gpt .*t1 ran tiny-moe"):
        calibrate([traces["gpt"], traces["moe"]], sources=["t0", "t1"])


def test_calibrated_profile_records_its_model_and_is_refused_for_another(traces, tmp_path,
                                                                         capsys):
    a, b = tmp_path / "A.json", tmp_path / "B.json"
    traces["gpt"].save(a)
    traces["gpt"].save(b)
    out = tmp_path / "p.json"
    assert cli_main(["calibrate", "--trace", str(a), str(b), "--out", str(out)]) == 0
    prov = load_profile(out).provenance
    assert (prov["model"], prov["model_fingerprint"]) == \
        ("tiny-gpt", model_fingerprint(load_model("tiny-gpt")))
    capsys.readouterr()
    other = tmp_path / "moe-plan.json"
    _plan("tiny-moe", [0, 3, 6]).save(other)
    assert cli_main(["simulate", "--plan", str(other), "--profile", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "measured on tiny-gpt" in err and str(out) in err
    assert Path(out).exists()


def test_a_base_profile_of_another_model_is_refused(traces, tmp_path, capsys):
    """`calibrate --base` scales a layer profile to the traces: one measured on another
    model (here tiny-moe's, for tiny-gpt traces) is refused in one line naming the
    --base file, nothing written; the traces' own model's profile is taken."""
    moe, gpt = tmp_path / "moe.json", tmp_path / "gpt.json"
    calibrate([traces["moe"]]).save(moe)
    calibrate([traces["gpt"]]).save(gpt)
    a = tmp_path / "A.json"
    traces["gpt"].save(a)
    out = tmp_path / "p.json"
    assert cli_main(["calibrate", "--trace", str(a), "--base", str(moe), "--out",
                     str(out)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--base {moe}" in lines[0] and "tiny-moe" in lines[0]
    assert not out.exists()
    assert cli_main(["calibrate", "--trace", str(a), "--base", str(gpt), "--out",
                     str(out)]) == 0
    # a library caller may scale another model's layer profile on purpose (an MoE
    # model's layer kinds for dense runs: experiments/accuracy_moe.py, which the check
    # had stopped); its fits are the traces' model's
    base = calibrate([traces["moe"]])
    with pytest.raises(BadInput, match="tiny-moe"):
        calibrate([traces["gpt"]], base=base)
    fitted = calibrate([traces["gpt"]], base=base, allow_base_mismatch=True)
    assert fitted.provenance["model"] == "tiny-gpt" and fitted.compute


@pytest.mark.parametrize("meta_a,meta_b,words", [
    ({"emulated": False}, {"emulated": True, "emulation_scale": 3.0},
     ["run natively", "emulated at scale 3"]),
    ({"emulated": True, "emulation_scale": 1.0}, {"emulated": True, "emulation_scale": 3.0},
     ["emulated at scale 1", "emulated at scale 3"]),
])
def test_calibrate_refuses_traces_timed_apart(traces, meta_a, meta_b, words):
    """One profile per time base: a native trace beside an emulated one, or emulated runs
    at two scales, were fitted together (the worst residual rose to 52% in a review's
    case) and the profile said only 'emulated'."""
    a = Trace(traces["gpt"].events, {**traces["gpt"].meta, **meta_a})
    b = Trace(traces["gpt"].events, {**traces["gpt"].meta, **meta_b})
    with pytest.raises(BadInput) as err:
        calibrate([a, b], sources=["A", "B"])
    for word in ["A, B: meta.emulated", *words]:
        assert word in str(err.value), (word, str(err.value))
    assert calibrate([a, a], sources=["A", "A2"]).compute      # alike: fitted together
