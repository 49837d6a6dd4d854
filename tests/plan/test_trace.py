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
