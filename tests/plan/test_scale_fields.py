"""The file fields for training at scale (issue 9): stage `recompute` and
`sequence_parallel`, plan `distributed_optimizer`, model `attention`, node `nics`.
Parsed, checked (bad values are BadInput, exit 2), round-tripped, defaulted when absent."""

from __future__ import annotations

import json

import pytest
from plan_docs import edited

from hyperpipe.cli import main
from hyperpipe.cluster.cluster import Nics, cluster_from_dict, load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.plan.plan import plan_from_dict

PLAN = {
    "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
    "global_batch": 8, "schedule": {"kind": "1f1b", "chunks": 1},
    "pipelines": [{"micro_batch": 2, "num_microbatches": 4,
                   "stages": [{"layers": [0, 5], "devices": ["a100/0", "a100/1"], "tp": 2},
                              {"layers": [5, 8], "devices": ["v100/0"], "tp": 1}]}],
}


def test_old_plan_gets_the_defaults_and_writes_as_before():
    plan = plan_from_dict(PLAN)
    assert not plan.distributed_optimizer
    assert [(s.recompute, s.sequence_parallel) for s in plan.pipelines[0].stages] == \
        [("none", False), ("none", False)]
    # as before, plus the stack it runs on (absent: megatron-lm), which plans now carry
    assert plan.to_dict() == {**PLAN, "stack": "megatron-lm"}


def test_new_plan_fields_round_trip():
    doc = edited(PLAN, distributed_optimizer=True,
                 **{"pipelines/0/stages/0/recompute": "selective",
                    "pipelines/0/stages/0/sequence_parallel": True,
                    "pipelines/0/stages/1/recompute": "full"})
    plan = plan_from_dict(doc)
    assert plan.distributed_optimizer
    s0, s1 = plan.pipelines[0].stages
    assert (s0.recompute, s0.sequence_parallel) == ("selective", True)
    assert (s1.recompute, s1.sequence_parallel) == ("full", False)
    again = plan_from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.to_dict() == plan.to_dict()
    plan.check(plan.load_model(), plan.load_cluster())


@pytest.mark.parametrize("changes,field", [
    ({"pipelines/0/stages/0/recompute": "some"}, "stages[0].recompute"),
    ({"pipelines/0/stages/0/recompute": True}, "stages[0].recompute"),
    ({"pipelines/0/stages/0/sequence_parallel": "yes"}, "stages[0].sequence_parallel"),
    ({"pipelines/0/stages/1/sequence_parallel": True}, "stages[1].sequence_parallel"),
    ({"distributed_optimizer": 1}, "distributed_optimizer"),
])
def test_bad_plan_fields_are_bad_input(changes, field, tmp_path, capsys):
    with pytest.raises(BadInput, match=field.replace("[", r"\[").replace("]", r"\]")):
        plan_from_dict(edited(PLAN, **changes))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(edited(PLAN, **changes)))
    assert main(["simulate", "--plan", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and "\n" not in err


def test_attention_field():
    assert load_model("gpt3-175b").config.attention == "flash"      # presets: flash
    assert load_model("tiny-gpt").config.attention == "eager"       # its CPU module
    eager = load_model({"preset": "gpt2-small", "attention": "eager"})
    assert eager.config.attention == "eager"
    assert load_model(eager.to_dict()) == eager
    old = {"kind": "gpt", "vocab_size": 64, "n_layer": 2, "n_head": 2, "d_model": 16,
           "seq_len": 8}
    assert load_model(old).config.attention == "flash"
    with pytest.raises(BadInput, match="m.yaml: attention"):
        load_model({**old, "attention": "sparse"}, where="m.yaml")


def test_nics_field_and_default():
    doc = {"nodes": [{"name": "a", "device": "A100-80GB", "count": 8,
                      "nics": {"count": 8, "bandwidth": "200 Gbit/s"}},
                     {"name": "b", "device": "A100-80GB", "count": 8}],
           "inter_node": {"bandwidth": "100 Gbit/s"}}
    c = cluster_from_dict(doc, where="c.yaml", name="c")
    assert c.node("a").nics == Nics(8, 25e9)
    assert c.node("a").nics.total_bandwidth_bytes_per_s == 200e9
    assert c.node("b").nics == Nics(1, 12.5e9)       # one NIC at inter_node's bandwidth
    only_count = {**doc, "nodes": [{**doc["nodes"][0], "nics": {"count": 4}}]}
    assert cluster_from_dict(only_count, where="c", name="c").node("a").nics == Nics(4, 12.5e9)
    for bad, what in (({"count": 0}, "nics.count"), ({"count": 2, "bandwidth": "fast"},
                                                     "nics.bandwidth"),
                      ({"count": 2, "speed": 1}, "nics.speed")):
        with pytest.raises(BadInput, match=what):
            cluster_from_dict({**doc, "nodes": [{**doc["nodes"][0], "nics": bad}]},
                              where="c.yaml", name="c")


@pytest.mark.parametrize("name, device, nic_bytes_per_s, nvlink_bytes_per_s", [
    ("a100-1024", "A100-80GB", 25e9, 300e9), ("h100-1024", "H100-SXM", 50e9, 450e9)])
def test_dgx_1024_clusters(name, device, nic_bytes_per_s, nvlink_bytes_per_s):
    c = load_cluster(name)
    assert len(c.devices) == 1024 and len(c.nodes) == 128
    assert {d.type.name for d in c.devices} == {device}
    assert all(n.nics == Nics(8, nic_bytes_per_s) for n in c.nodes)
    assert c.node("dgx-0").intra_link.bandwidth_bytes_per_s == nvlink_bytes_per_s
