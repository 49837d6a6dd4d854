"""Layer profiling on this machine, and the accuracy comparison."""

from __future__ import annotations

import pytest

from hyperpipe.exec.profiler import measure_op_times, profile_layers
from hyperpipe.models import load_model
from hyperpipe.plan.profile import Profile
from hyperpipe.plan.trace import Trace, TraceEvent
from hyperpipe.sim.accuracy import compare, measured_iteration_s


def test_profile_layers_covers_every_kind_and_op_and_scales_exactly():
    model = load_model("tiny-gpt")
    prof = profile_layers(model, {"slow": 3.0, "fast": 1.0}, micro_batches=(1, 2),
                          repeats=2, warmup=1, progress=False)
    for kind in ("embedding", "block", "head"):
        for op in ("F", "I", "W", "B"):
            fast = prof.compute[Profile.key("fast", kind, op)]
            slow = prof.compute[Profile.key("slow", kind, op)]
            assert slow.a_s == pytest.approx(3 * fast.a_s)
            assert slow.b_s_per_unit == pytest.approx(3 * fast.b_s_per_unit)
    block_f = prof.compute[Profile.key("fast", "block", "F")]
    assert block_f.a_s + block_f.b_s_per_unit > 0
    assert prof.emulated and prof.provenance["device_types"] == {"slow": 3.0, "fast": 1.0}


def test_one_micro_batch_size_extrapolates_in_proportion_to_flops():
    """One size cannot split a per-call time from a per-FLOP one: the block's time is
    taken as proportional to its FLOPs, so micro-batch 4 costs four times micro-batch
    1 (a constant would have priced it as micro-batch 1)."""
    from hyperpipe.sim.costmodel import op_flops
    model = load_model("tiny-gpt")
    prof = profile_layers(model, {"local": 1.0}, micro_batches=(1,), repeats=2, warmup=1,
                          progress=False)
    block = next(i for i, layer in enumerate(model.layers) if layer.kind == "block")
    fit = prof.compute[Profile.key("local", "block", "F")]
    one, four = (fit(op_flops(model, block, mb, "F")) for mb in (1, 4))
    assert one > 0 and fit.a_s == 0.0
    assert four == pytest.approx(4 * one)


def test_measured_op_times_are_positive_and_embedding_has_no_input_gradient():
    model = load_model("tiny-gpt")
    block = measure_op_times(model, 1, 2, repeats=2, warmup=1)
    assert all(block[op] > 0 for op in ("F", "I", "W", "B"))
    emb = measure_op_times(model, 0, 2, repeats=2, warmup=1)
    assert emb["I"] < emb["W"]


def _ev(dev, op, start, end, step, stage=0, mb=0):
    return TraceEvent(dev, op, stage, mb, start, end, step=step)


def test_compare_uses_the_median_period_between_steps():
    measured = Trace((
        _ev("a", "F", 0.0, 5.0, 0),                       # warm-up step, ignored
        _ev("a", "F", 10.0, 11.0, 1), _ev("a", "B", 11.0, 13.0, 1),
        _ev("a", "F", 20.0, 21.2, 2), _ev("a", "B", 21.2, 23.4, 2),
        _ev("a", "F", 30.0, 31.0, 3), _ev("a", "B", 31.0, 33.6, 3),
    ))
    # step ends 5.0, 13.0, 23.4, 33.6: periods 8.0, 10.4, 10.2 -> median 10.2
    assert measured_iteration_s(measured) == pytest.approx(10.2)
    predicted = Trace((_ev("a", "F", 0.0, 1.0, 0), _ev("a", "B", 1.0, 3.5, 0)))
    report = compare(10.0, predicted, measured)
    assert report.error == pytest.approx(0.2 / 10.2)
    rows = {r.op: r for r in report.per_device_op}
    assert rows["F"].measured_s == pytest.approx((1.0 + 1.2 + 1.0) / 3)
    assert rows["B"].predicted_s == pytest.approx(2.5)
