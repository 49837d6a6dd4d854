"""Traces: the JSON round trip and the Chrome trace export."""

from __future__ import annotations

import pytest

from hyperpipe.plan.trace import Trace, TraceEvent, load_trace


def test_trace_round_trip_and_chrome(tmp_path):
    events = (TraceEvent("a/0", "F", 0, 0, 0.0, 1e-3), TraceEvent("a/0", "send", 0, 0, 1e-3,
                                                                  2e-3, 4096, "b/0"),
              TraceEvent("b/0", "F", 1, 0, 2e-3, 3.5e-3, step=0))
    trace = Trace(events, {"source": "simulated", "emulated": False})
    trace.save(tmp_path / "t.json")
    again = load_trace(tmp_path / "t.json")
    assert again == trace
    assert again.makespan_s() == pytest.approx(3.5e-3)
    chrome = trace.to_chrome()
    xs = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in xs] == ["0F0", "send 0:0", "1F0"]
    assert xs[2]["ts"] == pytest.approx(2000.0) and xs[2]["dur"] == pytest.approx(1500.0)


@pytest.mark.parametrize("change,field", [
    (lambda doc: doc["events"][1].__setitem__(6, -100.0), "events[1][6]: expected bytes >= 0"),
    (lambda doc: doc["meta"].__setitem__("first_step", -1), "meta.first_step"),
    (lambda doc: doc["meta"].__setitem__("first_step", "2"), "meta.first_step")])
def test_negative_bytes_and_a_bad_first_step_are_refused(tmp_path, change, field):
    """A send of -100 bytes had calibrated a link of -22.9 kB/s, which simulate then
    refused; the trace is refused where the error is."""
    import json

    from hyperpipe.core.errors import BadInput
    events = (TraceEvent("a/0", "F", 0, 0, 0.0, 1e-3),
              TraceEvent("a/0", "send", 0, 0, 1e-3, 2e-3, 4096, "b/0"))
    Trace(events, {"source": "measured"}).save(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    change(doc)
    (tmp_path / "t.json").write_text(json.dumps(doc))
    with pytest.raises(BadInput, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_trace(tmp_path / "t.json")


def _saved_doc(tmp_path, meta=None):
    """A small measured trace's document as saved (two compute events, one probe)."""
    import json
    events = (TraceEvent("a/0", "send", -1, 0, 0.0, 1e-4, 1024, "b/0", -1),
              TraceEvent("a/0", "F", 0, 0, 1e-3, 2e-3, step=1),
              TraceEvent("b/0", "F", 1, 0, 2e-3, 3e-3, step=1))
    Trace(events, {"source": "measured", **(meta or {})}).save(tmp_path / "t.json")
    return json.loads((tmp_path / "t.json").read_text())


@pytest.mark.parametrize("change,field,got", [
    (lambda doc: doc["events"][1].__setitem__(4, -5.0), "events[1][4]: expected start_s",
     "-5.0"),
    (lambda doc: doc["events"][1].__setitem__(8, 1.5), "events[1][8]: expected step", "1.5"),
    (lambda doc: doc["events"][2].__setitem__(2, 0.5), "events[2][2]: expected stage", "0.5"),
    (lambda doc: doc["events"][2].__setitem__(3, -2), "events[2][3]: expected microbatch",
     "-2"),
    (lambda doc: doc["events"][0].__setitem__(8, -7), "events[0][8]: expected step", "-7"),
    (lambda doc: doc["meta"].__setitem__("emulated", "yes"), "meta.emulated: expected true "
     "or false", "'yes'"),
    (lambda doc: doc["meta"].__setitem__("emulation_scale", 0), "meta.emulation_scale: "
     "expected", "0"),
    (lambda doc: doc["meta"].__setitem__("emulation_scale", -2.0), "meta.emulation_scale: "
     "expected", "-2.0"),
    (lambda doc: doc["meta"].__setitem__("emulation_scale", "2"), "meta.emulation_scale: "
     "expected", "'2'"),
    (lambda doc: doc["meta"].__setitem__("device_types", ["A100-80GB"]),
     "meta.device_types: expected", "['A100-80GB']")])
def test_values_no_run_can_record_are_refused_naming_the_field(tmp_path, change, field, got):
    """A start of -5 s had been fitted (a per-layer time 100x too large), a step of 1.5
    read as step 1, `emulated: "yes"` as true and an emulation scale of 0 kept: each is
    refused with the file and the field, in one line."""
    import json

    from hyperpipe.core.errors import BadInput
    doc = _saved_doc(tmp_path)
    change(doc)
    (tmp_path / "t.json").write_text(json.dumps(doc))
    with pytest.raises(BadInput) as err:
        load_trace(tmp_path / "t.json")
    text = str(err.value)
    assert text.startswith(f"{tmp_path / 't.json'}: {field}") and text.endswith(f"got {got}")
    assert "\n" not in text


def test_a_probe_and_unknown_meta_keys_are_read(tmp_path):
    """Step -1 (the link probe), stage and micro-batch -1 (none), whole numbers written
    as floats and meta keys the reader does not know stay accepted."""
    import json
    doc = _saved_doc(tmp_path, {"emulated": True, "emulation_scale": 3.0, "note": "x",
                                "device_types": {"a/0": "A100-80GB"}})
    doc["events"][1][8] = 1.0
    doc["events"].append(["a/0", "optimizer", -1, -1, 3e-3, 4e-3, 0, "", 1])
    (tmp_path / "t.json").write_text(json.dumps(doc))
    trace = load_trace(tmp_path / "t.json")
    assert [e.step for e in trace.events] == [-1, 1, 1, 1]
    assert type(trace.events[1].step) is int and trace.meta["note"] == "x"
