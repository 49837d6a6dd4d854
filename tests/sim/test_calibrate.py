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
    cluster = plan.load_cluster()
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


def _parallel_trace(plan: Plan, first_step: int = 0, extras: bool = False) -> Trace:
    """A run of `plan` as the executor times it: a compute action holds its tensor
    rank's compute (TRUTH at FLOPs / tp) and the stage's tensor-parallel all-reduces,
    priced over the probed links (`LINK_BW`, `LINK_LATENCY_S`); the optimizer updates
    the parameters the device holds, ZeRO's shard of them. The run's first step (its
    warm-up) takes twice as long."""
    from hyperpipe.cluster.cluster import Link
    from hyperpipe.sim.calibrate import _params_on
    from hyperpipe.sim.options import execution_of
    from hyperpipe.sim.program import action_extra_s
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    link = Link(LINK_BW, LINK_LATENCY_S)
    price = CostModel(model, cluster, Profile(links={"inter": link, "*": link}))
    pipe = plan.pipelines[0]
    events = [TraceEvent(pipe.stages[0].devices[0], "send", 0, 0, 0.0,
                         LINK_LATENCY_S + size / LINK_BW, size, pipe.stages[1].devices[0], -1)
              for size in (1e3, 1e5, 1e6, 4e6)]
    for step in range(first_step, first_step + 3):
        warm = 2.0 if step == first_step else 1.0
        for q, line in enumerate(plan.pipelines):
            for k, stage in enumerate(line.stages):
                for dev in stage.devices:
                    dtype = cluster.device(dev).type.name
                    for mb in range(line.num_microbatches):
                        for op in ("F", "I", "W"):
                            t = sum(TRUTH[(dtype, model.layers[i].kind)][0]
                                    + TRUTH[(dtype, model.layers[i].kind)][1]
                                    * op_flops(model, i, line.micro_batch, op) / stage.tp
                                    for i in range(*stage.layers))
                            t += price.stage_tp_comm_s(stage.layers, stage.devices,
                                                       line.micro_batch, op)[0]
                            if extras:          # ZeRO-2/3's time inside the action
                                t += action_extra_s(price, plan, execution_of(plan, price),
                                                    q, k, op)
                            events.append(TraceEvent(dev, op, k, mb, 0.0, warm * t,
                                                     step=step))
                    events.append(TraceEvent(dev, "optimizer", k, 0, 0.0, warm * (
                        OPT_A + OPT_B * _params_on(dev, plan, price)), step=step))
    return Trace(tuple(events), {"source": "measured", "emulated": True,
                                 "plan": plan.to_dict(), "first_step": first_step})


def _parallel_plan(cut: int, micro_batch: int, tp: int, zero: int = 0) -> Plan:
    from hyperpipe.plan.plan import plan_from_dict
    dp = 2 // tp
    return plan_from_dict({
        "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
        "global_batch": 8 * micro_batch, "zero": zero, "schedule": {"kind": "1f1b"},
        "pipelines": [{"micro_batch": micro_batch, "num_microbatches": 8 // dp, "stages": [
            {"layers": [0, cut], "devices": [f"a100/{r * tp + t}" for t in range(tp)],
             "tp": tp},
            {"layers": [cut, 8], "devices": [f"v100/{r * tp + t}" for t in range(tp)],
             "tp": tp}]} for r in range(dp)]}, where="test")


def test_a_tensor_parallel_run_is_reproduced_by_its_own_profile():
    """The profile of tp-2 runs prices each of their actions at what it took: the fit is
    read at a tensor rank's FLOPs, as the simulator reads it, and the all-reduces the
    actions held are not counted twice (they had been: the a100's F read 1.6x)."""
    plans = [_parallel_plan(cut, mb, 2) for cut, mb in ((2, 1), (4, 2), (5, 4), (3, 8))]
    profile = calibrate([_parallel_trace(p) for p in plans])
    model = load_model("tiny-gpt")
    cost = CostModel(model, load_cluster("demo-hetero"), profile)
    price = CostModel(model, load_cluster("demo-hetero"), Profile(links=profile.links))
    for plan in plans:
        for stage in plan.pipelines[0].stages:
            dtype = cost.cluster.device(stage.devices[0]).type.name
            for op in ("F", "I", "W"):
                took = sum(TRUTH[(dtype, model.layers[i].kind)][0]
                           + TRUTH[(dtype, model.layers[i].kind)][1]
                           * op_flops(model, i, plan.pipelines[0].micro_batch, op) / 2
                           for i in range(*stage.layers)) + price.stage_tp_comm_s(
                    stage.layers, stage.devices, plan.pipelines[0].micro_batch, op)[0]
                assert cost.stage_time_s(stage.layers, stage.devices,
                                         plan.pipelines[0].micro_batch, op) == \
                    pytest.approx(took, rel=0.02)


def test_the_optimizer_fit_counts_zero_shards_and_skips_a_resumed_warm_up():
    """With ZeRO 1 over 2 replicas a device updates half its stage's parameters: the fit
    recovers the truth (it had read 2x fast), and a resumed run's first step (its
    warm-up, twice as slow here) is left out."""
    from hyperpipe.sim.sharding import dp_shards
    plans = [_parallel_plan(cut, 2, 1, zero=1) for cut in (2, 4, 6)]
    profile = calibrate([_parallel_trace(p, first_step=5) for p in plans])
    opt = profile.optimizer["A100-80GB"]
    assert (opt.a_s, opt.b_s_per_unit) == pytest.approx((OPT_A, OPT_B), rel=0.02)
    cost = CostModel(load_model("tiny-gpt"), load_cluster("demo-hetero"), profile)
    stage = plans[1].pipelines[0].stages[0]
    params = sum(cost.model.layers[i].params for i in range(*stage.layers))
    assert cost.optimizer_time_s(stage.layers, "A100-80GB", 1, dp_shards(plans[1], stage)) \
        == pytest.approx(OPT_A + OPT_B * params / 2, rel=0.02)
    a, b = TRUTH[("A100-80GB", "block")]
    assert cost.layer_time_s(1, "A100-80GB", 2, "F") == \
        pytest.approx(a + b * op_flops(cost.model, 1, 2, "F"), rel=0.02)


def test_a_whole_backward_fit_prices_a_split_backward_by_flops():
    """A profile of 1F1B runs has B fits only: a zero-bubble plan's I and W take B's
    time in proportion to their FLOPs (they had fallen back to the analytic model, at
    the catalog GPU's speed beside CPU-measured F and B)."""
    model = load_model("tiny-gpt")
    fit = Fit(1e-4, 3e-11, 4, 0.0)
    profile = Profile(compute={Profile.key("A100-80GB", kind, op): fit
                               for kind in ("embedding", "block", "head") for op in "FB"})
    cost = CostModel(model, load_cluster("demo-hetero"), profile)
    for mb in (1, 4):
        whole = cost.layer_time_s(1, "A100-80GB", mb, "B")
        i, w = (cost.layer_time_s(1, "A100-80GB", mb, op) for op in "IW")
        assert i + w == pytest.approx(whole)
        assert i / w == pytest.approx(op_flops(model, 1, mb, "I") / op_flops(model, 1, mb, "W"))
    # with an I fit of its own, B is not split: I is its fit, W the catalog's
    own_i = Fit(5e-4, 0.0, 4, 0.0)
    cost = CostModel(model, load_cluster("demo-hetero"), Profile(compute={
        **profile.compute, Profile.key("A100-80GB", "block", "I"): own_i}))
    assert cost.layer_time_s(1, "A100-80GB", 2, "I") == pytest.approx(5e-4)
    assert cost.layer_time_s(1, "A100-80GB", 2, "W") == pytest.approx(
        CostModel(model, load_cluster("demo-hetero")).layer_time_s(1, "A100-80GB", 2, "W"))


def test_traces_of_clusters_with_other_links_of_one_class_are_refused():
    """A 10 Gbit/s and a 100 Mbit/s run had been fitted as one 'inter' link of 0.2
    Gbit/s, good for neither."""
    from hyperpipe.core.errors import BadInput
    rng = random.Random(0)
    plan = _plan([4], ["a100/0", "v100/0"], 2, 4)
    slow = {"name": "slow", "inter_node": {"bandwidth": "100 Mbit/s", "latency": "10 us"},
            "nodes": [{"name": "a100", "device": "A100-80GB", "count": 2},
                      {"name": "v100", "device": "V100-32GB", "count": 2}]}
    from hyperpipe.plan.plan import plan_from_dict
    other = plan_from_dict({**plan.to_dict(), "cluster": slow}, where="slow")
    traces = [_synthetic_trace(plan, rng, 0.0), _synthetic_trace(other, rng, 0.0)]
    with pytest.raises(BadInput, match=r"^fast, slow: expected traces whose clusters give "
                       r"link class inter the same nominal links"):
        calibrate(traces, sources=["fast", "slow"])
    assert calibrate(traces[:1] * 2, sources=["fast", "again"]).link("inter") is not None
    # one cluster whose inter links differ by node pair: its traces are fitted together
    mixed = {"name": "mixed", "nodes": [
        {"name": "n0", "device": "A100-80GB", "count": 1, "nics": {"bandwidth": "200 Gbit/s"}},
        {"name": "n1", "device": "A100-80GB", "count": 1, "nics": {"bandwidth": "200 Gbit/s"}},
        {"name": "n2", "device": "V100-32GB", "count": 1}],
        "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}}
    one = plan_from_dict({**_plan([4], ["a100/0", "v100/0"], 2, 4).to_dict(),
                          "cluster": mixed}, where="mixed")
    pairs = [("n0/0", "n1/0"), ("n1/0", "n2/0")]
    runs = []
    for a, b in pairs:
        doc = one.to_dict()
        doc["pipelines"][0]["stages"][0]["devices"] = [a]
        doc["pipelines"][0]["stages"][1]["devices"] = [b]
        runs.append(_synthetic_trace(plan_from_dict(doc, where="mixed"), rng, 0.0))
    assert calibrate(runs, sources=["a", "b"]).link("inter") is not None


def test_backwards_that_recompute_are_fitted_less_the_forward_they_redo():
    """With full recompute a backward holds the forward again: its samples had been
    dropped, leaving no B fit at all (B then priced by the catalog). They are now
    fitted less the forward as the F fits price it, and the profile reproduces them."""
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")

    def took(dtype: str, layers, mb: int, op: str) -> float:
        return sum(TRUTH[(dtype, model.layers[i].kind)][0]
                   + TRUTH[(dtype, model.layers[i].kind)][1] * op_flops(model, i, mb, op)
                   for i in range(*layers))
    plans = [_parallel_plan(cut, mb, 1).with_memory(recompute="full")
             for cut, mb in ((2, 1), (4, 2), (5, 4), (3, 8))]
    traces = []
    for plan in plans:
        events = []
        for step in range(3):
            for line in plan.pipelines:
                for k, stage in enumerate(line.stages):
                    dev = stage.devices[0]
                    dtype = cluster.device(dev).type.name
                    f = took(dtype, stage.layers, line.micro_batch, "F")
                    b = took(dtype, stage.layers, line.micro_batch, "B") + f
                    events += [TraceEvent(dev, op, k, j, 0.0, t, step=step)
                               for j in range(line.num_microbatches)
                               for op, t in (("F", f), ("B", b))]
        traces.append(Trace(tuple(events), {"source": "measured", "plan": plan.to_dict()}))
    profile = calibrate(traces)
    assert Profile.key("A100-80GB", "block", "B") in profile.compute
    cost = CostModel(model, cluster, profile)
    for mb in (1, 4):
        for dtype in ("A100-80GB", "V100-32GB"):
            assert cost.layer_time_s(1, dtype, mb, "B") == \
                pytest.approx(took(dtype, (1, 2), mb, "B"), rel=0.02)
    stage = plans[1].pipelines[0].stages[0]
    assert cost.stage_time_s(stage.layers, stage.devices, 2, "B", "full") == \
        pytest.approx(took("A100-80GB", stage.layers, 2, "B")
                      + took("A100-80GB", stage.layers, 2, "F"), rel=0.02)


def test_zero_2_time_inside_actions_is_not_fitted_as_compute():
    """ZeRO-2's exposed reduce-scatters sit inside the measured actions; the simulator
    adds them apart (`program.action_extra_s`), so the fit must leave them out."""
    from hyperpipe.sim.options import execution_of
    from hyperpipe.sim.program import action_extra_s
    plans = [_parallel_plan(cut, mb, 1, zero=2) for cut, mb in ((2, 1), (4, 2), (5, 4),
                                                                 (3, 8))]
    profile = calibrate([_parallel_trace(p, extras=True) for p in plans])
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    price = CostModel(model, cluster, Profile(links=profile.links))
    assert any(action_extra_s(price, p, execution_of(p, price), 0, k, op) > 0
               for p in plans for k in (0, 1) for op in "FIW")     # the case is real
    cost = CostModel(model, cluster, profile)
    for dtype in ("A100-80GB", "V100-32GB"):
        for mb, op in ((1, "F"), (4, "W"), (8, "I")):
            a, b = TRUTH[(dtype, "block")]
            assert cost.layer_time_s(1, dtype, mb, op) == \
                pytest.approx(a + b * op_flops(model, 1, mb, op), rel=0.02)


def test_a_straggler_group_is_fitted_at_its_own_speed():
    """The simulator stretches a stage's optimizer step by its group's slowdown (its
    slowest member's). A healthy context rank beside a straggler node steps as slowly
    as the group; it had been fitted over its own slowdown (1), reading 3x slow."""
    from dataclasses import replace

    from hyperpipe.plan.plan import plan_from_dict
    from hyperpipe.sim.calibrate import _params_on
    mixed = {"name": "mixed", "nodes": [
        {"name": "a", "device": "A100-80GB", "count": 1},
        {"name": "b", "device": "A100-80GB", "count": 1, "slowdown": 3.0},
        {"name": "v", "device": "V100-32GB", "count": 2}]}
    traces = []
    for cut in (2, 4, 6):
        doc = _plan([cut], ["a100/0", "v100/0"], 2, 4).to_dict()
        doc["cluster"] = mixed
        doc["pipelines"][0]["stages"][0].update(devices=["a/0", "b/0"], cp=2)
        doc["pipelines"][0]["stages"][1]["devices"] = ["v/0"]
        plan = plan_from_dict(doc, where="mixed")
        cost = CostModel(plan.load_model(), plan.load_cluster())
        trace = _synthetic_trace(plan, random.Random(0), 0.0)
        traces.append(Trace(tuple(
            replace(e, end_s=e.start_s + 3.0 * (OPT_A + OPT_B * _params_on(e.device, plan,
                                                                            cost)))
            if e.op == "optimizer" and e.device == "a/0" else e
            for e in trace.events), trace.meta))
    opt = calibrate(traces).optimizer["A100-80GB"]
    assert (opt.a_s, opt.b_s_per_unit) == pytest.approx((OPT_A, OPT_B), rel=0.02)


def test_an_all_reduce_fit_prices_only_groups_of_the_class_it_was_measured_on():
    """All-reduces measured across nodes (a100/0 with v100/0) give a fit of class "inter",
    which prices every group across nodes; a group inside a node (tensor parallelism on
    the a100 node) stays priced by its links, as without the fit. One fit read for every
    group had priced a tp-2 plan inside one node 21x slower from a profile whose
    all-reduces crossed a slow network."""
    plan = _plan([1, 4, 6], ["a100/0", "a100/1", "v100/0", "v100/1"], 2, 4)
    trace = _synthetic_trace(plan, random.Random(3), 0.0)
    reduce = [TraceEvent(dev, "allreduce", -1, -1, 0.0, 2e-3 + 4e-9 * x, x,
                         "v100/0" if dev == "a100/0" else "a100/0", step)
              for step in range(3) for x in (1e6, 8e6) for dev in ("a100/0", "v100/0")]
    trace = Trace(trace.events + tuple(reduce), trace.meta)
    profile = calibrate([trace])
    assert set(profile.allreduce) == {"inter"}
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    cost = CostModel(model, cluster, profile)
    # a ring of two moves 2(n-1)/n = 1 x the bytes
    assert cost.allreduce_time_s(["a100/1", "v100/1"], 5e6) == \
        pytest.approx(2e-3 + 4e-9 * 5e6, rel=1e-6)
    by_links = CostModel(model, cluster, Profile(links=profile.links))
    inside = cost.allreduce_time_s(["a100/0", "a100/1"], 5e6)
    assert inside == by_links.allreduce_time_s(["a100/0", "a100/1"], 5e6)
    assert inside != pytest.approx(2e-3 + 4e-9 * 5e6, rel=0.05)
    # "*" (a hand-written profile) still prices every group
    every = CostModel(model, cluster, Profile(allreduce={"*": Fit(2e-3, 4e-9)}))
    assert every.allreduce_time_s(["a100/0", "a100/1"], 5e6) == \
        pytest.approx(2e-3 + 4e-9 * 5e6, rel=1e-12)


def test_one_all_reduce_size_scales_the_base_profiles_line_of_any_class():
    """All-reduces of one size cannot split the per-call from the per-byte cost: the
    base profile's line is scaled to them, its "*" fit standing for a class it has no
    fit of (the class fit had fallen back to time proportional to the bytes)."""
    plan = _plan([1, 4, 6], ["a100/0", "a100/1", "v100/0", "v100/1"], 2, 4)
    trace = _synthetic_trace(plan, random.Random(3), 0.0)
    took = 2e-3 + 4e-9 * 4e6
    reduce = [TraceEvent(dev, "allreduce", -1, -1, 0.0, took, 4e6,
                         "v100/0" if dev == "a100/0" else "a100/0", step)
              for step in range(3) for dev in ("a100/0", "v100/0")]
    base = calibrate([_synthetic_trace(p, random.Random(4), 0.0)
                      for p in _calibration_plans()])
    base = Profile(compute=base.compute, links=base.links, optimizer=base.optimizer,
                   allreduce={"*": Fit(2e-3, 4e-9)}, provenance=base.provenance)
    profile = calibrate([Trace(trace.events + tuple(reduce), trace.meta)], base=base)
    fit = profile.allreduce["inter"]
    assert (fit.a_s, fit.b_s_per_unit) == pytest.approx((2e-3, 4e-9), rel=1e-6)


def test_idle_time_is_what_lies_outside_the_union_of_a_ranks_events():
    """A context-parallel ring receive (or a ZeRO-3 gather) runs inside the action that
    waits for it: only the time no event covers is a rank's idle time. On a100/0 in the
    fitted step: F 0-10 ms holding a recv 2-4 ms and an allgather 5-11 ms (past F's
    end), then B 12-20 ms; a send 10-30 ms runs beside B and is not counted. Idle: 1 ms
    (11-12), over two actions 0.5 ms each; the gaps between consecutive events had
    read ((5 - 4) + (12 - 11)) / 2 = 1 ms."""
    from hyperpipe.sim.calibrate import _action_gaps, _Run
    plan = _plan([4], ["a100/0", "v100/0"], 2, 1)
    cluster = plan.load_cluster()
    ms = 1e-3
    events = [TraceEvent("a100/0", "F", 0, 0, 0.0, 50 * ms, step=0),     # warm-up: unread
              TraceEvent("a100/0", "F", 0, 0, 100 + 0 * ms, 100 + 10 * ms, step=1),
              TraceEvent("a100/0", "recv", 0, 0, 100 + 2 * ms, 100 + 4 * ms, 1e3,
                         "v100/0", step=1),
              TraceEvent("a100/0", "allgather", 0, 0, 100 + 5 * ms, 100 + 11 * ms, 1e3,
                         "v100/0", step=1),
              TraceEvent("a100/0", "send", 0, 0, 100 + 10 * ms, 100 + 30 * ms, 1e3,
                         "v100/0", step=1),
              TraceEvent("a100/0", "B", 0, 0, 100 + 12 * ms, 100 + 20 * ms, step=1)]
    trace = Trace(tuple(events), {"source": "measured", "plan": plan.to_dict()})
    run = _Run("t.json", trace, plan, plan.load_model(), cluster,
               {d: cluster.device(d).type.name for d in plan.devices})
    assert cluster.slowdown(["a100/0"]) == 1.0
    assert _action_gaps([run]) == {"A100-80GB": pytest.approx(0.5 * ms, rel=1e-6)}


@pytest.mark.parametrize("case,match", [
    ("microbatch", r"^t: events\[\d+\]\[3\]: expected a micro-batch of the stage's pipeline "
                   r"in meta\.plan, 0 to 3, got 4$"),
    ("global_batch", r"^t: meta\.plan: global_batch: expected the sum over pipelines of "
                     r"micro_batch x num_microbatches \(8\), got 7$"),
    ("device_type", r"^t: meta\.device_types\.a100/0: expected 'A100-80GB', the type "
                    r"cluster 'demo-hetero' of meta\.plan gives a100/0, got 'H100-SXM'$"),
    ("device", r"^t: meta\.device_types: expected devices of the plan in meta\.plan, "
               r"got 'zz/0'$")])
def test_a_trace_its_own_plan_cannot_have_made_is_refused(case, match):
    """A micro-batch 99 of a plan of 4, a plan whose batch does not add up (global_batch
    7 = 2 x 4) and device types other than the cluster's had been fitted silently."""
    from hyperpipe.core.errors import BadInput
    plan = _plan([4], ["a100/0", "v100/0"], 2, 4)
    trace = _synthetic_trace(plan, random.Random(0), 0.0)
    events, meta = list(trace.events), dict(trace.meta)
    if case == "microbatch":
        i = next(i for i, e in enumerate(events) if e.op == "F" and e.step == 1)
        events[i] = TraceEvent(events[i].device, "F", events[i].stage, 4, 0.0, 1e-3, step=1)
    elif case == "global_batch":
        meta["plan"] = {**meta["plan"], "global_batch": 7}
    else:
        meta["device_types"] = {"a100/0": "H100-SXM"} if case == "device_type" else \
            {"zz/0": "A100-80GB"}
    with pytest.raises(BadInput, match=match):
        calibrate([Trace(tuple(events), meta)], sources=["t"])
    meta = {**trace.meta, "device_types": {"a100/0": "A100-80GB", "v100/0": "V100-32GB"}}
    assert calibrate([Trace(trace.events, meta)], sources=["t"]).compute      # as recorded


@pytest.mark.parametrize("case,match", [
    ("twice", r"^t: events\[\d+\]: expected one event per compute action \(a run records "
              r"each action of a step once\); events\[\d+\] already records 0F0 of step 1 "
              r"on a100/0$"),
    ("no_stage", r"^t: events\[\d+\]: expected v100/0's optimizer step of step 0 after all "
                 r"its actions of that step .*; no F of stage 1, micro-batch 0 was "
                 r"recorded$"),
    ("no_backward", r"^t: events\[\d+\]: expected a100/0's optimizer step of step 2 .*; "
                    r"no B \(or I and W\) of stage 0, micro-batch 3 was recorded$"),
    ("step_gap", r"^t: events\[\d+\]\[8\]: expected step, a step of the run: a run records "
                 r"its steps one after another from meta\.first_step 0, and no event has "
                 r"step 1, got 1001$"),
    ("before_first", r"^t: events\[\d+\]\[8\]: expected step, a step of the run: from "
                     r"meta\.first_step 1 on, got 0$"),
    ("zero_time", r"^t: events\[\d+\]\[5\]: expected end_s after start_s for some F of "
                  r"a100/0 after the warm-up step .*which would fit F as free$"),
    ("model", r"^t: meta\.model: expected 'tiny-gpt', the name of the model of meta\.plan "
              r"\(a run records the model it ran in both\), got 'gpt2-small'$")])
def test_a_trace_no_run_records_is_refused(case, match):
    """Each had been fitted (from a bug hunt): every action recorded twice (each fitted
    twice), a rank's compute missing from steps it ran its optimizer in (its idle time
    read as overhead), a step 1001 between steps 0 and 2, steps before the run's first,
    compute that takes 0 s (fitted as free), and `meta.model` naming another model than
    `meta.plan`. The trace as recorded, or with its first step left out, is fitted."""
    from dataclasses import replace

    from hyperpipe.core.errors import BadInput
    plan = _plan([4], ["a100/0", "v100/0"], 2, 4)
    trace = _synthetic_trace(plan, random.Random(0), 0.0)
    events, meta = list(trace.events), dict(trace.meta)
    if case == "twice":
        events += [e for e in events if e.step == 1]
    elif case == "no_stage":
        events = [e for e in events if not (e.device == "v100/0" and e.op in "FIW")]
    elif case == "no_backward":
        events = [e for e in events if (e.device, e.op, e.microbatch, e.step) not in {
            ("a100/0", "I", 3, 2), ("a100/0", "W", 3, 2)}]
    elif case == "step_gap":
        events = [replace(e, step=1001) if e.step == 1 else e for e in events]
    elif case == "before_first":
        meta["first_step"] = 1
    elif case == "zero_time":
        events = [replace(e, end_s=e.start_s) if e.device == "a100/0" and e.op == "F" else e
                  for e in events]
    else:
        meta["model"] = "gpt2-small"
    with pytest.raises(BadInput, match=match):
        calibrate([Trace(tuple(events), meta)], sources=["t"])
    assert calibrate([Trace(trace.events, {**trace.meta, "model": "tiny-gpt"})],
                     sources=["t"]).compute
    later = [e for e in trace.events if e.step != 0]      # a run resumed after step 0
    assert calibrate([Trace(tuple(later), {**trace.meta, "first_step": 1})]).compute
