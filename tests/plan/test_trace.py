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
