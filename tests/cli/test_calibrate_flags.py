"""`hyperpipe calibrate`: options of the other mode are refused, not ignored, and the
flag a refusal names exists."""

from __future__ import annotations

import pytest

from hyperpipe.cli import main
from hyperpipe.plan.profile import Fit, Profile


@pytest.mark.parametrize("flags,named", [
    (["--trace", "t.json", "--model", "tiny-moe"], "--model: expected only with --measure"),
    (["--trace", "t.json", "--cluster", "demo-hetero"], "--cluster"),
    (["--trace", "t.json", "--micro-batches", "1,2"], "--micro-batches"),
    (["--measure", "--model", "tiny-gpt", "--base", "b.json"],
     "--base: expected only with --trace")])
def test_an_option_of_the_other_mode_is_refused(flags, named, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.json").write_text("{}")
    (tmp_path / "b.json").write_text("{}")
    rc = main(["calibrate", *flags, "--out", "p.json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and named in err[0]
    assert not (tmp_path / "p.json").exists()


def test_a_base_for_other_device_types_is_used_when_asked(tmp_path, capsys):
    """The refusal of a --base lacking the traces' device types names
    --allow-profile-mismatch, which calibrate now takes."""
    from factories import chain_plan

    from hyperpipe.plan.trace import Trace, TraceEvent
    plan = chain_plan("tiny-gpt", "demo-hetero", [0, 4, 8], ["a100/0", "v100/0"], 2, 2)
    events = [TraceEvent(dev, op, k, mb, 0.0, 1e-3 * (1 + k), step=step)
              for step in range(3) for k, dev in enumerate(("a100/0", "v100/0"))
              for mb in range(2) for op in "FB"]
    Trace(tuple(events), {"source": "measured", "plan": plan.to_dict()}).save(
        tmp_path / "t.json")
    fit = Fit(1e-4, 1e-12, 2, 0.0)
    Profile(compute={Profile.key("local", k, op): fit for k in ("embedding", "block", "head")
                     for op in "FB"}).save(tmp_path / "base.json")
    args = ["calibrate", "--trace", str(tmp_path / "t.json"), "--base",
            str(tmp_path / "base.json"), "--out", str(tmp_path / "p.json")]
    assert main(args) == 2
    assert "--allow-profile-mismatch" in capsys.readouterr().err
    assert main([*args, "--allow-profile-mismatch"]) == 0


def test_a_simulated_trace_is_refused_naming_its_file_and_field(tmp_path, monkeypatch,
                                                                 capsys):
    """A trace of `hyperpipe simulate --trace` (meta.source "simulated") would fit the
    cost model to its own predictions: refused, alone or beside a measured trace, with
    exit 2 and no profile written (it had been taken silently, or listed and unused)."""
    import json

    from factories import chain_plan

    from hyperpipe.plan.trace import Trace, TraceEvent
    monkeypatch.chdir(tmp_path)
    plan = chain_plan("tiny-gpt", "demo-hetero", [0, 4, 8], ["a100/0", "v100/0"], 2, 2)
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))
    assert main(["simulate", "--plan", "plan.json", "--trace", "s.json"]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["meta"]["source"] == "simulated"
    events = [TraceEvent(dev, op, k, mb, 0.0, 1e-3 * (1 + k), step=step)
              for step in range(3) for k, dev in enumerate(("a100/0", "v100/0"))
              for mb in range(2) for op in "FB"]
    Trace(tuple(events), {"source": "measured", "plan": plan.to_dict()}).save("m.json")
    capsys.readouterr()
    for traces in (["s.json"], ["m.json", "s.json"]):
        rc = main(["calibrate", "--trace", *traces, "--out", "p.json"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert "s.json: meta.source" in err[0] and "measured" in err[0] \
            and "simulated" in err[0]
        assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("change,field", [
    (lambda doc: doc["events"][5].__setitem__(4, -5.0), "events[5][4]: expected start_s"),
    (lambda doc: doc["events"][5].__setitem__(8, 1.5), "events[5][8]: expected step"),
    (lambda doc: doc["events"][5].__setitem__(3, 99), "events[5][3]: expected a micro-batch"),
    (lambda doc: doc["meta"]["plan"].__setitem__("global_batch", 7),
     "meta.plan: global_batch: expected"),
    (lambda doc: doc["meta"].__setitem__("emulated", "yes"), "meta.emulated: expected"),
    (lambda doc: doc["meta"].__setitem__("emulation_scale", 0),
     "meta.emulation_scale: expected"),
    (lambda doc: doc["meta"].__setitem__("device_types", {"a100/0": "H100-SXM"}),
     "meta.device_types.a100/0: expected 'A100-80GB'"),
    (lambda doc: doc["events"].append(list(doc["events"][20])),
     "events[48]: expected one event per compute action"),
    (lambda doc: [e.__setitem__(8, 1001) for e in doc["events"] if e[8] == 1],
     "events[16][8]: expected step, a step of the run"),
    (lambda doc: [e.__setitem__(5, e[4]) for e in doc["events"] if e[:2] == ["a100/0", "F"]],
     "events[16][5]: expected end_s after start_s for some F of a100/0"),
    (lambda doc: doc["meta"].__setitem__("model", "gpt2-small"),
     "meta.model: expected 'tiny-gpt'")])
def test_an_impossible_trace_is_refused_in_one_line_and_nothing_written(
        change, field, tmp_path, monkeypatch, capsys):
    """Each had been fitted (exit 0): a start of -5 s into a per-layer time 100x too large,
    a step 1.5 as step 1, micro-batch 99 of a plan of 4, a plan whose batch does not add
    up, `emulated: "yes"`, an emulation scale of 0, a device recorded as another type, an
    action recorded twice, a step 1001 between steps 0 and 2, forwards of 0 s and
    `meta.model` naming another model than `meta.plan`. Each is bad input: exit 2, one
    line naming the trace and the field."""
    import json

    from factories import chain_plan

    from hyperpipe.plan.trace import Trace, TraceEvent
    monkeypatch.chdir(tmp_path)
    plan = chain_plan("tiny-gpt", "demo-hetero", [0, 4, 8], ["a100/0", "v100/0"], 2, 4)
    events = [TraceEvent(dev, op, k, mb, 0.01 * step, 0.01 * step + 1e-3 * (1 + k),
                         step=step)
              for step in range(3) for k, dev in enumerate(("a100/0", "v100/0"))
              for mb in range(4) for op in "FB"]
    Trace(tuple(events), {"source": "measured", "emulated": True, "emulation_scale": 1.0,
                          "plan": plan.to_dict()}).save("m.json")
    assert main(["calibrate", "--trace", "m.json", "--out", "p.json"]) == 0
    (tmp_path / "p.json").unlink()
    doc = json.loads((tmp_path / "m.json").read_text())
    change(doc)
    (tmp_path / "m.json").write_text(json.dumps(doc))
    capsys.readouterr()
    rc = main(["calibrate", "--trace", "m.json", "--out", "p.json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert f"m.json: {field}" in err[0]
    assert not (tmp_path / "p.json").exists()
