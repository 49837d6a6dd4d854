"""The inputs of experiments/published_hetero.py: AMP's published runs (homogeneous T4
cluster and heterogeneous V100 + T4 cluster) and the plans and profiles the script makes
of them, checked against what AMP's own files say (DeepSpeed's topology, AMP's rank map,
AMP's per-layer profiles)."""

from __future__ import annotations

import pytest
from factories import experiment

from hyperpipe.sim.costmodel import CostModel


@pytest.fixture(scope="module")
def script():
    return experiment("published_hetero")


@pytest.mark.parametrize("which", ["homogeneous", "heterogeneous"])
def test_every_run_becomes_the_plan_deepspeed_placed(script, which):
    """Each row: 16 ranks, its partition over DeepSpeed's 30 layers, a global batch of 32;
    its plan puts stage k of replica r, tensor rank t on global rank (k·dp + r)·tp + t
    (DeepSpeed's PipeModelDataParallelTopology), ranks 4i..4i+3 on node i (AMP's rank
    map): on the heterogeneous cluster nodes 0-2 are V100s, node 3 T4s."""
    path = script.RUNS_FILE if which == "homogeneous" else script.HET_RUNS_FILE
    cluster = script.g4dn_cluster() if which == "homogeneous" else script.het_cluster()
    rows = script.load_rows(path)
    assert len(rows) == (52 if which == "homogeneous" else 53)
    for row in rows:
        assert row.tp * row.dp * row.pp == 16
        assert row.partition[0] == 0 and row.partition[-1] == 30
        assert list(row.partition) == sorted(set(row.partition))
        assert 32 % (row.dp * row.micro_batch) == 0
        plan = script.plan_for(row, script.model_for(row.tp), cluster)
        for r, pipe in enumerate(plan.pipelines):
            assert pipe.micro_batch * pipe.num_microbatches * row.dp == 32
            ranks = [[(k * row.dp + r) * row.tp + t for t in range(row.tp)]
                     for k in range(row.pp)]
            used = [k for k in range(row.pp) if script.hp_boundary(row.partition[k])
                    != script.hp_boundary(row.partition[k + 1])]
            assert [list(st.devices) for st in pipe.stages] == \
                [[cluster.devices[g].name for g in ranks[k]] for k in used]
            for st in pipe.stages:
                for d in st.devices:
                    rank = [x.name for x in cluster.devices].index(d)
                    want = "T4" if which == "homogeneous" or rank >= 12 else "V100-16GB"
                    assert cluster.device(d).type.name == want


@pytest.mark.parametrize("device,key", [("V100-16GB", "gpt2_P3_1"), ("T4", "gpt2_G4_1")])
def test_profile_gives_each_type_its_own_measured_block(script, device, key):
    """At tensor parallelism 1 and micro-batch 1 (what AMP profiled) a block's forward
    on each device type of the heterogeneous cluster costs the mean of AMP's 24 measured
    block forwards for that type (no collectives at tp 1), and its backward twice that."""
    import json
    measured = json.loads(script.PROFILE_FILE.read_text())["profiles"][key]
    want_s = sum(measured[2:26]) / 24
    cluster = script.het_cluster()
    model = script.model_for(1)
    cost = CostModel(model, cluster, script.amp_profile(1, cluster))
    block = next(i for i, spec in enumerate(model.layers) if spec.kind == "block")
    assert cost.layer_time_s(block, device, 1, "F") == pytest.approx(want_s, rel=1e-9)
    assert cost.layer_time_s(block, device, 1, "B") == pytest.approx(2 * want_s, rel=1e-9)


def test_backward_doubles_the_forwards_compute_not_its_all_reduces(script):
    """At tp 2 (AMP's T4 profile gpt2_G4_2) a block's forward, its all-reduces
    included, costs what AMP measured; its backward costs twice the measured forward
    less the forward's all-reduces, plus the backward's own all-reduces (as many as the
    forward's), priced by the stock model, so that AMP's x3 rule's extra all-reduces
    are not counted."""
    import json
    measured = json.loads(script.PROFILE_FILE.read_text())["profiles"]["gpt2_G4_2"]
    fwd_s = sum(measured[2:26]) / 24
    cluster = script.g4dn_cluster()
    model = script.model_for(2)
    block = next(i for i, spec in enumerate(model.layers) if spec.kind == "block")
    group = tuple(d.name for d in cluster.devices[:2])
    stock = CostModel(model, cluster)

    def comm_s(op: str) -> float:
        return (stock.stage_time_s((block, block + 1), group, 1, op)
                - stock.layer_time_s(block, "T4", 1, op, 2))

    calibrated = CostModel(model, cluster, script.amp_profile(2, cluster))
    f_s = calibrated.stage_time_s((block, block + 1), group, 1, "F")
    b_s = calibrated.stage_time_s((block, block + 1), group, 1, "B")
    assert comm_s("F") > 0.1e-3 and comm_s("B") == pytest.approx(comm_s("F"), rel=0.01)
    assert f_s == pytest.approx(fwd_s, rel=1e-9)
    assert b_s == pytest.approx(2 * (fwd_s - comm_s("F")) + comm_s("B"), rel=1e-9)
    assert b_s < 2 * fwd_s - 0.5 * comm_s("F")


def test_t4_at_tp_4_takes_the_tp_2_block_and_the_rule_is_as_good_as_scaling(script):
    """No T4 profile at tp 4: a block's forward at micro-batch 1, its tensor-parallel
    collectives included, costs the tp-2 measurement. Where a tp-4 profile exists (the
    V100's), holding the tp-2 time misses it by as much as scaling it by the stock
    model's tp-4/tp-2 ratio does, in the other direction (the docstring's figures)."""
    import json
    profiles = json.loads(script.PROFILE_FILE.read_text())["profiles"]

    def block_s(key: str) -> float:
        return sum(profiles[key][2:26]) / 24

    def stage_f_s(cost: CostModel, model, device: str, tp: int) -> float:
        members = tuple(d.name for d in cost.cluster.devices if d.type.name == device)
        block = next(i for i, spec in enumerate(model.layers) if spec.kind == "block")
        return cost.stage_time_s((block, block + 1), members[:tp], 1, "F")

    cluster = script.het_cluster()
    model = script.model_for(4)
    calibrated = CostModel(model, cluster, script.amp_profile(4, cluster))
    assert stage_f_s(calibrated, model, "T4", 4) == pytest.approx(block_s("gpt2_G4_2"),
                                                                  rel=1e-9)
    stock = [stage_f_s(CostModel(script.model_for(tp), cluster), script.model_for(tp),
                       "V100-16GB", tp) for tp in (2, 4)]
    held = block_s("gpt2_P3_2") / block_s("gpt2_P3_4") - 1
    scaled = block_s("gpt2_P3_2") * stock[1] / stock[0] / block_s("gpt2_P3_4") - 1
    assert held == pytest.approx(0.16, abs=0.005) and scaled == pytest.approx(-0.16, abs=0.005)
