"""Stragglers: the node/device `slowdown` field, its effect on simulated times, and the
simulator without replica symmetry (collapsed replica classes against every replica
simulated on its own).

Oracles: FLOPs / peak x slowdown worked out here; a one-stage pipeline's makespan
m x (F + B) x slowdown; the simulator with `collapse_replicas=False` (each replica its
own SimPy processes, no class weights) for the collapsed engine.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from factories import cluster_doc, device_type, synthetic_model

from hyperpipe.cli import main
from hyperpipe.cluster.cluster import cluster_from_dict, cluster_ref, load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.search.evaluate import Candidate
from hyperpipe.search.search import search
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate
from hyperpipe.whatif.failures import (
    SHOWN_GAIN,
    FailureOptions,
    failure_whatif,
    format_failures,
    without_node,
)
from hyperpipe.whatif.stragglers import format_stragglers, plot_stragglers
from hyperpipe.whatif.sweep import Planning, SweepOptions, whatif

FLOPS = 1e12
LAYER_FLOPS = 1e9          # per sample per layer: 1 ms of F, I and W each on a unit device


def doc(slowdown=None, *, bandwidth=1e30, nodes=1, count=4) -> dict:
    link = {"bandwidth": bandwidth, "latency": 0.0}
    out = cluster_doc({"unit": device_type(FLOPS)},
                      [(f"n{i}", "unit", count) for i in range(nodes)],
                      intra_link=link, inter_node=link, name="s")
    if slowdown is not None:
        out["nodes"][0]["slowdown"] = slowdown
    return out


def model(layers=4, act=0.0, params=0):
    return synthetic_model(layers, fwd_flops_per_sample=LAYER_FLOPS,
                           activation_bytes_per_sample=act, params_per_layer=params)


def test_slowdown_field_loads_per_node_and_per_device():
    c = cluster_from_dict(doc(1.5), where="c.yaml", name="c")
    assert [d.slowdown for d in c.devices] == [1.5] * 4
    c = cluster_from_dict(doc({2: 1.3, "0": 2}), where="c.yaml", name="c")
    assert [d.slowdown for d in c.devices] == [2.0, 1.0, 1.3, 1.0]
    assert c.slowdown(("n0/1", "n0/2")) == 1.3          # a TP group runs at its slowest
    healthy = cluster_from_dict(doc(), where="c.yaml", name="c")
    assert healthy.slowdown(("n0/0",)) == 1.0 and healthy == cluster_from_dict(
        doc(1.0), where="c.yaml", name="c")              # 1.0 is the default, not a change
    for bad, field in ((0, "slowdown"), (-1.2, "slowdown"), ("fast", "slowdown"),
                       ({7: 1.3}, "slowdown.7"), ({1: 0}, "slowdown.1")):
        with pytest.raises(BadInput, match=f"c.yaml: nodes\\[0\\].{field}"):
            cluster_from_dict(doc(bad), where="c.yaml", name="c")
    assert load_cluster("a100-v100").slowdown(("a100/0",)) == 1.0   # old files load


def test_mtbf_field_loads_with_units():
    d = doc()
    d["nodes"][0]["mtbf"] = "5 days"
    c = cluster_from_dict(d, where="c.yaml", name="c")
    assert c.nodes[0].mtbf_s == 5 * 86400
    d["nodes"][0]["mtbf"] = "-3 h"
    with pytest.raises(BadInput, match="nodes\\[0\\].mtbf"):
        cluster_from_dict(d, where="c.yaml", name="c")


def test_cost_model_stretches_compute_and_optimizer_only():
    spec = model(params=1000)
    slow = CostModel(spec, cluster_from_dict(doc({1: 1.3}), where="c", name="c"))
    for op in ("F", "B", "I", "W"):
        flops = LAYER_FLOPS * (2 if op == "B" else 1) * 2     # two layers, micro-batch 1
        assert slow.stage_time_s((0, 2), ("n0/0",), 1, op) == pytest.approx(flops / FLOPS)
        assert slow.stage_time_s((0, 2), ("n0/1",), 1, op) == pytest.approx(
            1.3 * flops / FLOPS)
    t = slow.optimizer_time_s((0, 2), "unit", 1)
    assert slow.optimizer_time_s((0, 2), "unit", 1, devices=("n0/1",)) == pytest.approx(1.3 * t)


@pytest.mark.parametrize("factor", [1.0, 1.3, 2.0])
def test_straggler_replica_sets_the_iteration(factor):
    # One stage per pipeline, two replicas, no parameters (no all-reduce): each replica
    # takes m x (F + B); the iteration is the slower one's, m x 3 ms x factor.
    spec, m = model(layers=1), 8
    cluster = cluster_from_dict(doc({1: factor}, count=2), where="c", name="c")
    plan = uniform_plan(spec, cluster, pp=1, dp=2, micro_batch=1, global_batch=2 * m)
    result = simulate(plan, CostModel(spec, cluster))
    assert result.metrics.iteration_time_s == pytest.approx(m * 3e-3 * factor, rel=1e-9)
    est = estimate(plan, CostModel(spec, cluster))
    assert est.iteration_time_s == pytest.approx(m * 3e-3 * factor, rel=1e-9)
    assert len(result.metrics.extra["replica_classes"]) == (1 if factor == 1.0 else 2)


def test_collapsed_classes_match_every_replica_simulated():
    # PP 2 x DP 16 over four nodes of 8 (Megatron order: stage 0 of replicas 0-7 on n0,
    # 8-15 on n1; stage 1 on n2, n3), activations over NICs eight replicas share,
    # gradients all-reduced; one straggler. Its NIC neighbours see its traffic out of
    # step, so they must not stand in for the others: the collapsed run must equal the
    # full one.
    spec = model(layers=4, act=2e6, params=100_000)
    cluster = cluster_from_dict(doc({3: 1.3}, bandwidth=2e9, nodes=4, count=8),
                                where="c", name="c")
    plan = uniform_plan(spec, cluster, pp=2, dp=16, micro_batch=1, global_batch=128)
    cost = CostModel(spec, cluster)
    collapsed = simulate(plan, cost, SimOptions(trace=False)).metrics
    full = simulate(plan, cost, SimOptions(trace=False, collapse_replicas=False)).metrics
    assert collapsed.extra["replica_classes"] == [[0, 1, 2, 4, 5, 6, 7], [3],
                                                  list(range(8, 16))]
    assert len(full.extra["replica_classes"]) == 16
    assert collapsed.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-9)
    # every replica's ranks end when its class representative's do
    assert _rank_ends(collapsed) == pytest.approx(_rank_ends(full), rel=1e-9)
    assert collapsed.extra["simulated_actions"] < full.extra["simulated_actions"]
    healthy = cluster_from_dict(doc(bandwidth=2e9, nodes=4, count=8), where="c", name="c")
    base = simulate(plan, CostModel(spec, healthy), SimOptions(trace=False)).metrics
    assert collapsed.iteration_time_s > base.iteration_time_s


def _rank_ends(metrics) -> dict[tuple[int, int], float]:
    """(replica, rank) -> when the rank's pipeline actions end, members of a class
    taking their representative's times."""
    ends = {(r["pipeline"], r["rank"]): r["compute_end_s"] for r in metrics.extra["ranks"]}
    return {(q, d): ends[(members[0], d)] for members in metrics.extra["replica_classes"]
            for q in members for (rep, d) in ends if rep == members[0]}


# ---------------------------------------------------------------- what-if: keep or re-plan

def two_nodes(slow: float = 1.0) -> dict:
    d = doc(slow if slow != 1.0 else None, bandwidth="10 Gbit/s", nodes=2, count=2)
    d["nodes"][0]["name"], d["nodes"][1]["name"] = "a", "b"
    return d


WHATIF_MODEL = {"kind": "synthetic", "name": "sweep", "layers": 8, "seq_len": 1,
                "fwd_flops_per_sample": 1.0e10, "activation_bytes_per_sample": 1.0e6,
                "params_per_layer": 0}


ONE_SLOW_DEVICE = {"name": "onedev", "nodes": [
    {"name": "a100", "device": "A100-80GB", "count": 8, "slowdown": {3: 4.0}},
    {"name": "v100", "device": "V100-32GB", "count": 8}],
    "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}}


def test_whatif_searches_a_straggler_cluster_as_search_does():
    # One slow device in a node: the search tells it apart from its healthy neighbours;
    # a what-if variant identical to the file (and --failures' today's plan) must get
    # the search's pick, not one made for a node whose every device is slow.
    spec = load_model("gpt2-small")
    cluster = load_cluster(ONE_SLOW_DEVICE)
    c = Planning(global_batch=32).constraints()
    picked = search(spec, cluster, c, top=1, peers=False).best
    (row,) = whatif(spec, cluster, SweepOptions(Planning(global_batch=32), vary=(
        "inter_node.bandwidth=100 Gbit/s",))).rows
    assert row.best.plan.pipelines == picked.plan.pipelines
    assert row.best.metrics.iteration_time_s == pytest.approx(
        picked.metrics.iteration_time_s, rel=1e-12)
    study = failure_whatif(spec, cluster, FailureOptions(
        Planning(global_batch=32), restart_s=600.0, write_s=30.0, mtbf_s=5 * 86400.0))
    assert study.plan.plan.pipelines == picked.plan.pipelines
    assert study.plan.metrics.iteration_time_s == pytest.approx(
        picked.metrics.iteration_time_s, rel=1e-12)
    # the re-plan without the node most likely to fail (the first on ties) is at least
    # as fast as the search's pick on the cluster without it
    smaller = without_node(cluster, study.failed_node)
    again = search(spec, smaller, c, top=1, peers=False).best
    assert study.replan.metrics.iteration_time_s <= again.metrics.iteration_time_s * (1 + 1e-12)


def test_losing_a_node_is_measured_against_the_re_plan_on_the_whole_cluster():
    # 8 A100 + 8 V100 over 10 Gbit/s, tiny-gpt, gb 16: the search's pick simulates
    # slower than the re-plan without the A100 node, which runs on the whole cluster as
    # well: the study says so, and measures losing the node against that plan, not as a
    # gain over today's
    spec = load_model("tiny-gpt")
    cluster = cluster_from_dict({
        "nodes": [{"name": "a100", "device": "A100-80GB", "count": 8},
                  {"name": "v100", "device": "V100-32GB", "count": 8}],
        "inter_node": {"bandwidth": "10 Gbit/s", "latency": "5 us"}}, where="c", name="c")
    study = failure_whatif(spec, cluster, FailureOptions(
        Planning(global_batch=16), restart_s=600.0, write_s=1e-3, mtbf_s=86400.0))
    assert study.failed_node == "a100"
    whole = study.replan_whole                # the case this test is for
    assert whole is not None and whole.plan.pipelines == study.replan.plan.pipelines
    # the oracle: the re-plan simulated on the whole cluster by hand
    plan = replace(study.replan.plan, cluster=cluster_ref(cluster))
    by_hand = simulate(plan, CostModel(spec, cluster)).metrics
    assert whole.metrics.iteration_time_s == pytest.approx(by_hand.iteration_time_s)
    assert by_hand.iteration_time_s < study.plan.metrics.iteration_time_s
    assert study.replan.metrics.throughput_samples_per_s <= \
        whole.metrics.throughput_samples_per_s * (1 + 1e-9)
    text = format_failures(study)
    assert "runs on the whole cluster too" in text and "the search missed it" in text
    assert "replan_on_whole_cluster" in study.to_dict()
    # a given plan: its re-plan on the whole cluster is faster than the given plan, not
    # something the search missed; a re-plan no faster than today's is not named
    given = plan_from_dict({
        "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
        "global_batch": 16, "schedule": "gpipe", "pipelines": [
            {"micro_batch": 1, "num_microbatches": 16, "stages": [
                {"layers": [0, 2], "devices": ["a100/0"]},
                {"layers": [2, 8], "devices": ["v100/0"]}]}]})
    study = failure_whatif(spec, load_cluster("demo-hetero"), FailureOptions(
        Planning(global_batch=16, plan=given), restart_s=600.0, write_s=1.0,
        mtbf_s=86400.0))
    assert study.plan_given and "(given)" in format_failures(study)
    assert study.replan_whole.metrics.iteration_time_s < study.plan.metrics.iteration_time_s
    study = failure_whatif(spec, load_cluster("demo-hetero"), FailureOptions(
        Planning(global_batch=16), restart_s=600.0, write_s=1.0, mtbf_s=86400.0))
    assert study.replan_whole is None or study.replan_whole.metrics.iteration_time_s < \
        study.plan.metrics.iteration_time_s * (1 - SHOWN_GAIN)


def test_straggler_whatif_keep_against_replan(tmp_path):
    res = whatif(load_model(WHATIF_MODEL), load_cluster(two_nodes()), SweepOptions(
        Planning(global_batch=8, micro_batch=1), vary=("nodes.a.slowdown=1.0,1.5,3.0",)))
    assert res.kind == "stragglers"
    today = res.rows[0].kept.plan
    spec = load_model(WHATIF_MODEL)
    for row, factor in zip(res.rows, (1.0, 1.5, 3.0), strict=True):
        # keep: today's plan, simulated here on the degraded cluster
        assert row.kept.plan.pipelines == today.pipelines
        degraded = cluster_from_dict(two_nodes(factor), where="c", name="c")
        assert row.kept.metrics.iteration_time_s == pytest.approx(simulate(
            today, CostModel(spec, degraded)).metrics.iteration_time_s, rel=1e-12)
        # re-plan is never slower, and is what the simulator says of its plan
        assert row.best.metrics.iteration_time_s <= row.kept.metrics.iteration_time_s
        assert row.best.metrics.iteration_time_s == pytest.approx(simulate(
            row.best.plan, CostModel(spec, degraded)).metrics.iteration_time_s, rel=1e-12)
    assert res.rows[0].best.metrics.iteration_time_s == pytest.approx(
        res.rows[0].kept.metrics.iteration_time_s)
    kept = [r.kept.metrics.iteration_time_s for r in res.rows]
    assert kept == sorted(kept) and kept[2] > kept[0]
    # with a node 3x slow, shifting work off it pays
    assert res.rows[2].best.metrics.iteration_time_s < 0.9 * kept[2]
    text = format_stragglers(res)
    assert "keep" in text and "re-plan" in text and "nodes.a.slowdown=3.0" in text
    png = tmp_path / "s.png"
    plot_stragglers(res, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replan_slower_than_kept_keeps_the_plan(monkeypatch):
    # Make the search return a poor plan (everything on the slow node); the answer must
    # then be the kept plan, flagged.
    from hyperpipe.whatif import sweep as whatif_module
    spec = load_model(WHATIF_MODEL)
    slow = cluster_from_dict(two_nodes(3.0), where="c", name="c")
    today = uniform_plan(spec, slow, pp=2, dp=2, micro_batch=1, global_batch=8)
    poor = uniform_plan(spec, slow, pp=1, dp=2, micro_batch=1, global_batch=8)
    real_search = whatif_module.search

    def poor_search(model, cluster, *args, **kwargs):
        # the poor plan as the search reports a pick: simulated on the cluster searched
        res = real_search(model, cluster, *args, **kwargs)
        return replace(res, best=Candidate(poor, simulate(
            poor, CostModel(model, cluster), SimOptions(trace=False)).metrics))
    monkeypatch.setattr(whatif_module, "search", poor_search)
    res = whatif(spec, load_cluster(two_nodes()), SweepOptions(
        Planning(global_batch=8, micro_batch=1, plan=today), vary=("nodes.a.slowdown=3.0",)))
    (row,) = res.rows
    assert row.kept_is_answer and row.best is row.kept
    assert "search's pick was slower" in format_stragglers(res)
    assert simulate(poor, CostModel(spec, slow)).metrics.iteration_time_s > \
        row.kept.metrics.iteration_time_s


def test_straggler_whatif_cli(tmp_path, capsys):
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(two_nodes()))
    model = tmp_path / "m.json"
    model.write_text(json.dumps(WHATIF_MODEL))
    png = tmp_path / "s.png"
    rc = main(["whatif", "--cluster", str(cluster), "--model", str(model), "--global-batch",
               "8", "--micro-batch", "1", "--vary", "nodes.a.slowdown=1.0,2.0",
               "--plot", str(png), "--json"])
    assert rc == 0
    doc_ = json.loads(capsys.readouterr().out)
    assert doc_["kind"] == "stragglers"
    for r in doc_["rows"]:
        assert r["replan_gain"] >= 0 and r["kept"]["metrics"]["iteration_time_s"] > 0
    assert png.exists()
    rc = main(["whatif", "--cluster", str(cluster), "--model", str(model), "--global-batch",
               "8", "--vary", "nodes.a.slowdown=1.0,0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "slowdown" in err[0]


def test_straggler_table_shows_short_iterations_to_the_digits_of_their_gap():
    """Iterations of a few ms printed as '0.004 s' next to '0.003 s' read +33% beside a
    gap of +18.6%: each is shown in ms to at least 5 significant digits, so the two shown
    give the gap shown (to its 0.1%)."""
    import re
    spec = synthetic_model(4, fwd_flops_per_sample=1e8, activation_bytes_per_sample=0.0,
                           params_per_layer=0)
    res = whatif(load_model(spec), load_cluster(doc(nodes=2, count=2)), SweepOptions(
        Planning(global_batch=8, micro_batch=1), vary=("nodes.n0.slowdown=1,1.5",)))
    assert all(r.best.metrics.iteration_time_s < 0.01 for r in res.rows)
    lines = format_stragglers(res).splitlines()
    assert "keep (ms)" in lines[3] and "re-plan (ms)" in lines[3]
    gaps = []
    for r, line in zip(res.rows, lines[4:], strict=False):
        numbers = re.findall(r" (\d+\.\d+)", line[len(r.label):])
        keep, best = float(numbers[0]), float(numbers[2])
        gap = float(re.search(r"([+-]\d+\.\d)%", line).group(1))
        assert keep == pytest.approx(r.kept.metrics.iteration_time_s * 1e3, rel=1e-4)
        assert best == pytest.approx(r.best.metrics.iteration_time_s * 1e3, rel=1e-4)
        assert abs((keep / best - 1) * 100 - gap) <= 0.06, line
        gaps.append(gap)
    assert gaps[0] == 0.0 and gaps[1] > 1.0          # a gap that the digits must carry
