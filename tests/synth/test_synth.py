"""Synthesised schedules (kind synth): list scheduling, synthesis, plan field
`schedule.actions`.

Oracles: the fixed kinds' closed-form makespans (unit times, `test_schedule.makespan`),
the simulator's price of every fixed kind for the same stages (synthesis may never be
slower nor over memory), and the IR validator.
"""

from __future__ import annotations

import json

import pytest
from factories import bounds_of, chain_plan, cluster_doc, device_type, synthetic_doc
from oracles import makespan, unit_costs

from hyperpipe.cli import main
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.plan.kinds import generate
from hyperpipe.plan.plan import (
    PipelinePlan,
    Plan,
    StagePlan,
    load_plan,
    plan_from_dict,
    schedule_for,
)
from hyperpipe.plan.schedule import Schedule, validate
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.replay import PipeCosts
from hyperpipe.sim.simulator import simulate
from hyperpipe.synth.listsched import Policy, list_schedule
from hyperpipe.synth.synthesise import fixed_kinds, synthesise


@pytest.mark.parametrize("p", [2, 4, 6])
def test_list_schedule_reaches_the_zero_bubble_closed_forms(p):
    for m in (p, 2 * p, 3 * p + 1):
        rows = list_schedule(unit_costs(p, p), p, m, "loop", Policy(0, "fill"))
        s = Schedule("synth", p, p, m, rows)
        validate(s)
        assert makespan(s) == 3 * m + p - 1                # ZB-H1's, Qi et al. 2023
        eager = Schedule("synth", p, p, m,
                         list_schedule(unit_costs(p, p), p, m, "loop", Policy(0, "eager")))
        validate(eager)
        assert makespan(eager) <= 3 * (m + p - 1)          # never behind 1F1B
    for m in (2 * p, 4 * p):
        rows = list_schedule(unit_costs(2 * p, p), p, m, "v", Policy(None, "fill"))
        s = Schedule("synth", p, 2 * p, m, rows, "v")
        validate(s)
        assert makespan(s) == 6 * m + p - 1                # ZB-V's


def test_list_schedule_respects_the_memory_budget_or_gives_up():
    p, m = 4, 8
    c = unit_costs(p, p)
    tight = PipeCosts(c.f_s, c.i_s, c.w_s, c.stash_bytes, c.fwd_link_s, c.bwd_link_s,
                      (2.0, 2.0, 2.0, 1.0))
    rows = list_schedule(tight, p, m, "loop", Policy(None, "fill"))
    for d, row in enumerate(rows):
        live = peak = 0
        for a in row:
            live += 1 if a.op == "F" else -1 if a.op == "W" else 0
            peak = max(peak, live)
        assert peak <= tight.budget_bytes[d]
    starved = PipeCosts(c.f_s, c.i_s, c.w_s, c.stash_bytes, c.fwd_link_s, c.bwd_link_s,
                        (1.0, 0.5, 1.0, 1.0))
    assert list_schedule(starved, p, m, "loop", Policy(0, "fill")) is None


@pytest.mark.parametrize("m", [8, 12])
def test_every_policy_reaches_the_memory_capped_bound(m):
    # p = 4, unit times, ranks 2 and 3 hold 2 stashes (freed by W). The last rank starts
    # at p - 1 and works 3m; at most 2 of its W's can follow its last I, whose gradient
    # then needs p - 1 more I's and stage 0's W: makespan >= 3m + 2p - 3, reached.
    from hyperpipe.synth.synthesise import POLICIES
    p = 4
    c = unit_costs(p, p)
    capped = PipeCosts(c.f_s, c.i_s, c.w_s, c.stash_bytes, c.fwd_link_s, c.bwd_link_s,
                       (1e9, 1e9, 2.0, 2.0))
    best = []
    for policy in POLICIES:
        rows = list_schedule(capped, p, m, "loop", policy)
        assert rows is not None
        s = Schedule("synth", p, p, m, rows)
        validate(s)
        assert makespan(s) >= 3 * m + 2 * p - 3
        best.append(makespan(s))
    assert min(best) == 3 * m + 2 * p - 3


# ---------------------------------------------------------------- synthesis on plans

def setup(memory=("100 GB", "100 GB"), stash=1e6, count=4):
    link = {"bandwidth": 1e10, "latency": 1e-5}
    cluster = load_cluster(cluster_doc(
        {"big": device_type(1e12, memory=memory[0]), "small": device_type(1e12, memory=memory[1])},
        [("a", "big", count), ("b", "small", count)], intra_link=link, inter_node=link,
        name="t"))
    model = load_model(_model_doc(stash))
    return model, cluster


def _model_doc(stash=1e6):
    """40 layers of 1e9 FLOPs forward per sample, 1e5 bytes sent, `stash` bytes kept."""
    return synthetic_doc(40, fwd_flops_per_sample=1e9, params_per_layer=0,
                         activation_bytes_per_sample=1e5, stash_bytes_per_sample=stash)


def plan_of(counts, devices, m, kind="1f1b"):
    assert len(counts) == len(devices), (counts, devices)
    return chain_plan(_model_doc(), "inline", bounds_of(counts), devices, 1, m, schedule=kind)


@pytest.mark.parametrize("counts", [[10, 10, 10, 10], [8, 14, 9, 9], [13, 9, 9, 9]])
def test_synthesis_is_never_slower_than_any_fixed_kind(counts):
    model, cluster = setup()
    cost = CostModel(model, cluster)
    plan = plan_of(counts, ["a/0", "a/1", "b/0", "b/1"], 8)
    result = synthesise(plan, cost)
    best_fixed = min(simulate(plan.__class__(**{**plan.__dict__, "schedule": k}), cost)
                     .metrics.iteration_time_s for k in fixed_kinds(plan))
    assert result.fixed_time_s == pytest.approx(best_fixed)
    assert result.metrics.iteration_time_s <= best_fixed * (1 + 1e-12)
    assert not result.metrics.oom
    again = simulate(result.plan, cost).metrics.iteration_time_s
    assert again == pytest.approx(result.metrics.iteration_time_s)
    # the analytic tier replays the synthesised orders: exact on these uncontended links
    # (priced as zb-h1 it was 5-9% over on the unequal cuts)
    assert result.plan.schedule == "synth"
    assert estimate(result.plan, cost).iteration_time_s == pytest.approx(again, rel=1e-9)


def test_analytic_tier_prices_each_pipelines_own_synthesised_order():
    """Two like pipelines, one given the synthesised order and one 1F1B's (as B's): the
    analytic tier prices each by its own order, so it ends with the slower one, as the
    simulator does, a link latency apart (pricing both by the first pipeline's order, it
    ended 11% early)."""
    model, cluster = setup()
    cost = CostModel(model, cluster)
    counts = [8, 14, 9, 9]
    fast = synthesise(plan_of(counts, ["a/0", "a/1", "b/0", "b/1"], 8), cost).plan
    assert fast.schedule == "synth"
    slow = generate("1f1b", 4, 8)
    second = plan_of(counts, ["a/2", "a/3", "b/2", "b/3"], 8).pipelines[0]
    lists = dict(fast.actions) | {dev: slow.actions[d] for d, dev in
                                  enumerate(["a/2", "a/3", "b/2", "b/3"])}
    both = Plan(fast.model, fast.cluster, 16, "synth", 1,
                (fast.pipelines[0], second), actions=tuple(sorted(lists.items())))
    sim = simulate(both, cost).metrics.iteration_time_s
    assert sim > simulate(fast, cost).metrics.iteration_time_s * 1.01
    assert estimate(both, cost).iteration_time_s == pytest.approx(sim, rel=1e-4)


def test_binding_memory_synthesis_beats_1f1b_where_zero_bubble_does_not_fit():
    # Stage stash 10 layers x 1 MB = 10 MB. The small devices (stages 2, 3) hold 25 MB:
    # zb-h1 keeps min(p, m) = 4 stashes on every stage and does not fit; 1F1B (p - d
    # stashes) fits; a synthesised order can still fill bubbles with W's under the cap.
    model, cluster = setup(memory=("100 MB", "25 MB"))
    cost = CostModel(model, cluster)
    plan = plan_of([10, 10, 10, 10], ["a/0", "a/1", "b/0", "b/1"], 8)
    zb = simulate(Plan(**{**plan.__dict__, "schedule": "zb-h1"}), cost).metrics
    assert zb.oom                                              # the cap binds
    result = synthesise(plan, cost)
    assert result.fixed_kind == "1f1b"
    assert result.plan.schedule == "synth" and not result.metrics.oom
    assert result.gain > 1.05
    for dev, peak in result.metrics.peak_memory_bytes.items():
        assert peak <= cluster.device(dev).type.memory_bytes


# ---------------------------------------------------------------- plan field and CLI

def synth_doc():
    return {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
            "global_batch": 4,
            "schedule": {"kind": "synth", "actions": {
                "a100/0": ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"],
                "v100/0": ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]}},
            "pipelines": [{"micro_batch": 2, "num_microbatches": 2, "stages": [
                {"layers": [0, 5], "devices": ["a100/0"]},
                {"layers": [5, 8], "devices": ["v100/0"]}]}]}


def test_actions_round_trip_and_replay_exactly(tmp_path):
    plan = plan_from_dict(synth_doc())
    plan.check(plan.load_model(), plan.load_cluster())
    s = schedule_for(plan)
    assert [str(a) for a in s.actions[1]] == synth_doc()["schedule"]["actions"]["v100/0"]
    path = tmp_path / "p.json"
    plan.save(path)
    again = load_plan(path)
    assert again.actions == plan.actions and again.to_dict() == plan.to_dict()
    cost = CostModel(plan.load_model(), plan.load_cluster())
    trace = simulate(plan, cost).trace
    order = [str(e.stage) + e.op + str(e.microbatch) for e in
             sorted(trace.events, key=lambda e: e.start_s) if e.device == "v100/0"
             and e.op in "FBIW"]
    assert order == synth_doc()["schedule"]["actions"]["v100/0"]


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["schedule"]["actions"]["v100/0"].__setitem__(2, "1X1"),
     ["v100/0", "step 2", "1X1"]),
    (lambda d: d["schedule"]["actions"]["v100/0"].__setitem__(0, "1I0"),
     ["device v100/0", "1I0"]),
    (lambda d: d["schedule"]["actions"].pop("a100/0"), ["a100/0"]),
    (lambda d: d["schedule"].pop("actions"), ["schedule.actions"]),
    (lambda d: d["schedule"].__setitem__("kind", "1f1b"), ["schedule.actions"]),
])
def test_bad_actions_are_bad_input_naming_device_and_step(edit, words, tmp_path, capsys):
    doc = synth_doc()
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(BadInput) as err:
        plan = load_plan(path)
        plan.check(plan.load_model(), plan.load_cluster())
    text = str(err.value)
    assert "\n" not in text and str(path) in text
    for w in words:
        assert w in text, (w, text)
    assert main(["simulate", "--plan", str(path)]) == 2


def test_cli_schedule_synth_text_csv_png(tmp_path, capsys):
    doc = synth_doc()
    doc["schedule"] = "1f1b"
    doc["pipelines"][0]["num_microbatches"], doc["global_batch"] = 4, 8
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    assert main(["schedule", "--kind", "synth", "--plan", str(path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# ") and "best fixed kind" in text
    s = Schedule.from_text(text)
    validate(s)
    assert (s.num_devices, s.num_stages, s.num_microbatches) == (2, 2, 4)
    assert main(["schedule", "--kind", "synth", "--plan", str(path), "--format",
                 "torch-csv"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert [r.split(",") for r in rows] == [[str(a) for a in row] for row in s.actions]
    png = tmp_path / "s.png"
    assert main(["schedule", "--kind", "synth", "--plan", str(path), "--format", "png",
                 "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["schedule", "--kind", "synth", "--devices", "2", "--microbatches",
                 "4"]) == 2
    assert "--plan" in capsys.readouterr().err


def test_search_records_synthesised_actions_that_replay(tmp_path):
    from hyperpipe.search.search import SearchConstraints, search
    model, cluster = setup(memory=("100 MB", "25 MB"), count=2)
    result = search(model, cluster, SearchConstraints(global_batch=8, micro_batch=1, pp=4,
                                                      dp=1, tp=1))
    synth = [c for c in result.ranked if c.plan.schedule == "synth"]
    assert synth, [c.plan.schedule for c in result.ranked]
    plan = synth[0].plan
    path = tmp_path / "p.json"
    plan.save(path)
    again = load_plan(path)
    assert again.actions == plan.actions
    replay = simulate(again, CostModel(model, cluster)).metrics
    assert replay.iteration_time_s == pytest.approx(synth[0].metrics.iteration_time_s)
    assert not replay.oom


# ---------------------------------------------------------------- V kinds in the search

@pytest.mark.parametrize("kind", ["zb-v", "dualpipe-v"])
@pytest.mark.parametrize("counts", [[5, 5, 5, 5, 5, 5, 5, 5], [3, 9, 4, 4, 6, 4, 6, 4]])
def test_busiest_device_bound_is_below_the_simulated_time(kind, counts):
    from hyperpipe.search.context import SearchContext
    from hyperpipe.search.search import SearchConstraints
    from hyperpipe.search.synthesis import busiest_device_bound_s
    model, cluster = setup()
    cost = CostModel(model, cluster)
    devices = ["a/0", "a/1", "b/0", "b/1"]
    v_devices = devices + devices[::-1]          # V placement: rank r holds r and 2p-1-r
    v = Plan(**{**plan_of(counts[:4], devices, 8).__dict__, "schedule": kind, "chunks": 2})
    stages, a = [], 0
    for n, dev in zip(counts, v_devices, strict=True):
        stages.append(StagePlan((a, a + n), (dev,), 1))
        a += n
    plan = Plan(**{**v.__dict__, "pipelines": (PipelinePlan(1, 8, tuple(stages)),)})
    ctx = SearchContext(cost, SearchConstraints(global_batch=8))
    bound = busiest_device_bound_s(ctx, plan)
    simulated = simulate(plan, cost).metrics.iteration_time_s
    assert 0 < bound <= simulated
    busiest = max(sum(c for c, d in zip(counts, v_devices, strict=True) if d == dev)
                  for dev in devices)
    assert bound == pytest.approx(8 * busiest * 3 * 1e9 / 1e12)   # F = I = W = 1 ms/layer


def test_v_pruning_keeps_the_pick_and_prunes(monkeypatch):
    import hyperpipe.search.search as S
    model, cluster = setup(count=2)
    c = S.SearchConstraints(global_batch=16, micro_batch=1, tp=1)
    pruned = S.search(model, cluster, c)
    monkeypatch.setattr(S, "ruled_out", lambda ctx, cand, best: False)
    full = S.search(model, cluster, c)
    assert pruned.best.metrics.iteration_time_s == full.best.metrics.iteration_time_s
    sim = [ph for ph in pruned.phases if ph["name"] == "simulate"][0]
    sim_full = [ph for ph in full.phases if ph["name"] == "simulate"][0]
    assert sim["pruned"] > sim_full["pruned"] == 0


def test_a_synthesised_order_that_ties_a_fixed_kind_leaves_the_fixed_kind():
    """A synthesised order faster than the best fixed kind only in the last bits (the
    same actions summed in another order) does not win: the plan stays the fixed kind,
    without action lists; faster by more than that, it wins."""
    from hyperpipe.sim.metrics import IMPROVEMENT_REL
    from hyperpipe.synth.synthesise import Priced, synth_result
    model = load_model(_model_doc())
    cluster = load_cluster(cluster_doc({"u": device_type(1e12)}, [("n", "u", 2)]))
    plan = chain_plan(model, cluster, [0, 20, 40], ["n/0", "n/1"], 1, 4)
    cost = CostModel(model, cluster)
    metrics = simulate(plan, cost).metrics
    t = metrics.iteration_time_s
    fixed = {"1f1b": Priced(t, plan, metrics, None, "1f1b")}
    synth_plan = synthesise(plan, cost).synth_plan or plan
    for gain, wins in ((1e-15, False), (10 * IMPROVEMENT_REL, True)):
        got = synth_result(fixed, Priced(t * (1 - gain), synth_plan, metrics,
                                         Policy()), 1, 0.0)
        assert (got.plan is synth_plan) == wins, gain
