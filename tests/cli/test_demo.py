"""`hyperpipe demo` end to end, shortened (the README's main job)."""

from __future__ import annotations

import json
import math

import pytest

from hyperpipe.cli import main
from hyperpipe.cli.demo import output_names
from hyperpipe.plan.plan import load_plan
from hyperpipe.plan.profile import load_profile
from hyperpipe.plan.trace import load_trace

REPORT_KEYS = ("error_out_of_sample", "predicted_iteration_time_out_of_sample_s",
               "measured_spread", "plan", "baseline_plan", "measured_iteration_time_s",
               "predicted_iteration_time_s", "error_before_calibration",
               "error_after_calibration", "speedup_vs_uniform_measured",
               "speedup_vs_uniform_predicted", "emulated")


@pytest.mark.slow
def test_demo_writes_a_consistent_report(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--steps", "3"]) == 0
    printed = capsys.readouterr().out
    assert "speed-up of best over uniform" in printed
    report = json.loads((out / "report.json").read_text())
    for key in REPORT_KEYS:
        assert key in report, key
    assert report["emulated"] is True
    measured, predicted = report["measured_iteration_time_s"], report["predicted_iteration_time_s"]
    assert 0 < measured < 10 and 0 < predicted < 10
    # the report's figures are the ones its parts say
    assert report["error_after_calibration"] == pytest.approx(
        abs(predicted - measured) / measured)
    assert report["speedup_vs_uniform_measured"] == pytest.approx(
        report["baseline"]["measured_s"] / measured)
    # the speed-up that counts: over the tuned baseline (run, or one of the two plans)
    assert "over the tuned baseline" in printed
    assert report["tuned_baseline_run"] in ("tuned", "uniform", "best")
    assert report["speedup_vs_tuned_measured"] == pytest.approx(
        report["tuned_baseline"]["measured_s"] / measured)
    # out of sample: the prediction made before the best plan ran, against its run
    assert report["error_out_of_sample"] == pytest.approx(
        abs(report["predicted_iteration_time_out_of_sample_s"] - measured) / measured)
    periods = report["measured_step_periods_s"]
    assert len(periods) == 2 and measured == pytest.approx(sorted(periods)[0] / 2
                                                           + sorted(periods)[1] / 2)
    assert printed.index("out of sample") < printed.index("in-sample")
    # how close is a figure of experiments/, not a timed assertion (the machine is shared)
    assert math.isfinite(report["error_after_calibration"])
    assert math.isfinite(report["error_before_calibration"])
    best = load_plan(out / "plan_best.json")
    assert best.to_dict() == report["plan"]
    trace = load_trace(out / "trace_best_measured.json")
    assert trace.meta["emulated"] and {e.step for e in trace.events} >= {0, 1, 2}
    assert load_profile(out / "profile_calibrated.json").provenance["traces"]
    for name in ("timeline_best.png", "timeline_uniform.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    chrome = json.loads((out / "chrome_best_measured.json").read_text())
    assert any(e.get("ph") == "X" for e in chrome["traceEvents"])
    # what the demo checks before it starts is what it writes
    assert {p.name for p in out.iterdir()} <= set(output_names())


def test_demo_refuses_an_output_it_cannot_write_before_any_work(tmp_path, capsys):
    """A folder where the demo writes report.json: exit 2 at once, one line naming it,
    and nothing written."""
    out = tmp_path / "demo"
    (out / "report.json").mkdir(parents=True)
    assert main(["demo", "--out", str(out), "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "report.json" in err[0]
    assert [p.name for p in out.iterdir()] == ["report.json"]
