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
