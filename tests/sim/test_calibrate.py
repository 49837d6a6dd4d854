"""Calibration recovers known parameters from synthetic traces."""

from __future__ import annotations

import random

import pytest
from factories import chain_plan

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.profile import Fit, Profile, load_profile
from hyperpipe.plan.trace import Trace, TraceEvent
from hyperpipe.sim.calibrate import MIN_SPAN, calibrate, fit_bulk, fit_line
from hyperpipe.sim.costmodel import CostModel, op_flops

# Known truth: seconds per call and per FLOP, per (device type, layer kind), same for ops.
TRUTH = {
    ("A100-80GB", "embedding"): (2e-4, 0.0),
    ("A100-80GB", "block"): (1e-4, 2e-11),
    ("A100-80GB", "head"): (3e-4, 4e-11),
    ("V100-32GB", "embedding"): (5e-4, 0.0),
    ("V100-32GB", "block"): (2.5e-4, 5e-11),
    ("V100-32GB", "head"): (7e-4, 1e-10),
}
LINK_LATENCY_S, LINK_BW = 60e-6, 2e9
OPT_A, OPT_B = 1e-3, 3e-9


def _plan(cuts: list[int], devices: list[str], micro_batch: int, m: int) -> Plan:
    return chain_plan("tiny-gpt", "demo-hetero", [0, *cuts, 8], devices, micro_batch, m)


def _synthetic_trace(plan: Plan, rng: random.Random, noise: float) -> Trace:
    model = load_model("tiny-gpt")
    cluster = load_cluster("demo-hetero")
    events = []
    pipe = plan.pipelines[0]
    # link probes before step 0
    for k in range(len(pipe.stages) - 1):
        a, b = pipe.stages[k].devices[0], pipe.stages[k + 1].devices[0]
        for size in (1e3, 1e5, 1e6, 4e6):
            t = (LINK_LATENCY_S + size / LINK_BW) * (1 + rng.uniform(-noise, noise))
            events.append(TraceEvent(a, "send", k, 0, 0.0, t, size, b, -1))
    for step in range(3):
        for k, stage in enumerate(pipe.stages):
            dev = stage.devices[0]
            dtype = cluster.device(dev).type.name
            for mb in range(pipe.num_microbatches):
                for op in ("F", "I", "W"):
                    t = 0.0
                    for i in range(*stage.layers):
                        a, b = TRUTH[(dtype, model.layers[i].kind)]
                        t += a + b * op_flops(model, i, pipe.micro_batch, op)
                    t *= 1 + rng.uniform(-noise, noise)
                    events.append(TraceEvent(dev, op, k, mb, 0.0, t, step=step))
            params = sum(model.layers[i].params for i in range(*stage.layers))
            events.append(TraceEvent(dev, "optimizer", k, 0, 0.0, OPT_A + OPT_B * params,
                                     step=step))
    return Trace(tuple(events), {"source": "measured", "emulated": True,
                                 "plan": plan.to_dict()})


def _calibration_plans() -> list[Plan]:
    """Four partitions, device orders and micro-batch sizes: enough to tell kinds apart."""
    return [
        _plan([1, 4, 6], ["a100/0", "a100/1", "v100/0", "v100/1"], 2, 4),
        _plan([3, 5, 7], ["v100/0", "a100/0", "v100/1", "a100/1"], 4, 4),
        _plan([2, 6, 7], ["a100/1", "v100/1", "a100/0", "v100/0"], 1, 4),
        _plan([1, 2, 5], ["v100/1", "v100/0", "a100/1", "a100/0"], 8, 2),
    ]


def test_fit_line_recovers_known_line():
    xs = [1e3, 1e4, 1e5, 1e6]
    fit = fit_line(xs, [2e-5 + 3e-9 * x for x in xs])
    assert fit.a_s == pytest.approx(2e-5, rel=1e-6)
    assert fit.b_s_per_unit == pytest.approx(3e-9, rel=1e-6)
    assert fit.rel_rmse < 1e-9


def test_calibration_recovers_parameters_within_2_percent(tmp_path):
    rng = random.Random(0)
    plans = _calibration_plans()
    traces = [_synthetic_trace(p, rng, noise=0.0) for p in plans]
    profile = calibrate(traces, sources=[f"t{i}" for i in range(len(traces))])
    model = load_model("tiny-gpt")
    cluster = load_cluster("demo-hetero")
    cost = CostModel(model, cluster, profile)
    # Recovered per-layer times (not raw coefficients, which trade off when FLOPs are
    # proportional to the call count) within 2% of the truth at every micro-batch size.
    for (dtype, kind), (a, b) in TRUTH.items():
        i = next(j for j, layer in enumerate(model.layers) if layer.kind == kind)
        for mb in (1, 2, 4, 8):
            for op in ("F", "I", "W"):
                true_t = a + b * op_flops(model, i, mb, op)
                assert cost.layer_time_s(i, dtype, mb, op) == pytest.approx(true_t, rel=0.02)
    link = profile.link("inter")
    assert link.latency_s == pytest.approx(LINK_LATENCY_S, rel=0.02)
    assert link.bandwidth_bytes_per_s == pytest.approx(LINK_BW, rel=0.02)
    opt = profile.optimizer["A100-80GB"]
    assert opt.a_s == pytest.approx(OPT_A, rel=0.02)
    assert opt.b_s_per_unit == pytest.approx(OPT_B, rel=0.02)
    assert profile.emulated and profile.provenance["traces"] == ["t0", "t1", "t2", "t3"]
    profile.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile


def test_noisy_calibration_predicts_unseen_stages_within_2_percent():
    rng = random.Random(2)
    plans = _calibration_plans()
    profile = calibrate([_synthetic_trace(p, rng, noise=0.01) for p in plans])
    model = load_model("tiny-gpt")
    cost = CostModel(model, load_cluster("demo-hetero"), profile)
    for stage in ((0, 3), (3, 8), (2, 5), (0, 8)):          # partitions no trace had
        for dtype in ("A100-80GB", "V100-32GB"):
            for mb, op in ((3, "F"), (6, "I"), (2, "W")):
                true_t = sum(TRUTH[(dtype, model.layers[i].kind)][0]
                             + TRUTH[(dtype, model.layers[i].kind)][1]
                             * op_flops(model, i, mb, op) for i in range(*stage))
                assert cost.stage_compute_s(stage, dtype, mb, op) == \
                    pytest.approx(true_t, rel=0.02)


def test_calibration_shares_a_fit_when_kinds_are_not_identifiable():
    rng = random.Random(1)
    plan = _plan([4], ["a100/0", "v100/0"], 2, 4)
    profile = calibrate([_synthetic_trace(plan, rng, noise=0.0)])
    model = load_model("tiny-gpt")
    cost = CostModel(model, load_cluster("demo-hetero"), profile)
    # The stage sums it was fitted on are reproduced even so.
    for stage, dtype in (((0, 4), "A100-80GB"), ((4, 8), "V100-32GB")):
        true_t = sum(TRUTH[(dtype, model.layers[i].kind)][0] + TRUTH[(dtype, model.layers[i]
                     .kind)][1] * op_flops(model, i, 2, "F") for i in range(*stage))
        assert cost.stage_compute_s(stage, dtype, 2, "F") == pytest.approx(true_t, rel=0.02)
    assert Profile.key("A100-80GB", "block", "F") in profile.compute


def test_bulk_fit_over_one_size_is_proportional_or_the_prior_scaled():
    # one size only: a per-call constant would predict the same time for twice the work
    fit = fit_bulk([1e6, 1e6, 1e6], [0.010, 0.012, 0.011])
    assert fit.a_s == 0.0
    assert fit.a_s + fit.b_s_per_unit * 2e6 == pytest.approx(0.022)
    # with a prior line (per-layer profiling saw many sizes) its shape is kept, scaled
    prior = Fit(1e-3, 1e-8, 4, 0.0)
    fit = fit_bulk([1e6], [2 * (1e-3 + 1e-8 * 1e6)], prior)
    assert (fit.a_s, fit.b_s_per_unit) == pytest.approx((2e-3, 2e-8))
    # sizes spanning MIN_SPAN or more: the data decide, as fit_line
    xs = [1e6, MIN_SPAN * 1e6, 3 * MIN_SPAN * 1e6]
    ys = [4e-3 + 2e-9 * x for x in xs]
    assert (fit_bulk(xs, ys).a_s, fit_bulk(xs, ys).b_s_per_unit) == pytest.approx((4e-3, 2e-9))


def test_optimizer_of_one_run_shape_extrapolates_with_the_parameters():
    # every device type held one parameter count in this run; a plan holding twice the
    # parameters must be predicted about twice the optimizer time (truth: OPT_A + OPT_B x)
    plan = _plan([4], ["a100/0", "v100/0"], 2, 4)
    profile = calibrate([_synthetic_trace(plan, random.Random(0), 0.0)])
    model = load_model("tiny-gpt")
    half = sum(model.layers[i].params for i in range(0, 4))
    fit = profile.optimizer["A100-80GB"]
    truth_2x = OPT_A + OPT_B * 2 * half
    ours = fit.a_s + fit.b_s_per_unit * 2 * half
    constant = OPT_A + OPT_B * half        # what a per-call fit of this run predicts
    assert ours == pytest.approx(2 * constant)
    assert abs(ours - truth_2x) < abs(constant - truth_2x)


def test_probes_without_a_per_byte_cost_give_a_finite_bandwidth(tmp_path):
    # noise can make the probe's slope <= 0; the profile must still save and load
    plan = _plan([4], ["a100/0", "v100/0"], 2, 4)
    trace = _synthetic_trace(plan, random.Random(0), 0.0)
    flat = tuple(TraceEvent(e.device, e.op, e.stage, e.microbatch, 0.0, 1e-3, e.bytes,
                            e.peer, e.step) if e.step < 0 else e for e in trace.events)
    profile = calibrate([Trace(flat, trace.meta)])
    link = profile.links["*"]
    assert 0 < link.bandwidth_bytes_per_s < float("inf")
    assert link.bandwidth_bytes_per_s == pytest.approx(4e6 / 1e-3)   # largest probe
    profile.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").links["*"] == link
