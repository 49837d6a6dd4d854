"""Units, clusters, the cost model, plans, profiles and traces."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from plan_docs import edited

from hyperpipe.cluster.catalog import (
    DEFAULT_COLLECTIVE_EFFICIENCY,
    NIC_COLLECTIVE_EFFICIENCY,
    builtin_device_types,
)
from hyperpipe.cluster.cluster import builtin_cluster_names, cluster_from_dict, load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.core.units import parse_quantity
from hyperpipe.models import load_model
from hyperpipe.plan.plan import load_plan, plan_from_dict
from hyperpipe.plan.profile import Fit, Profile, load_profile
from hyperpipe.plan.trace import Trace, TraceEvent, load_trace
from hyperpipe.sim.costmodel import CostModel

# ------------------------------------------------------------------ units


@pytest.mark.parametrize("text,dim,value", [
    ("312 TFLOP/s", "flops", 312e12),
    ("1 TFLOP/s", "flops", 1e12),
    ("80 GB", "bytes", 80e9),
    ("80 GiB", "bytes", 80 * 2**30),
    ("600 GB/s", "bandwidth", 600e9),
    ("100 Gbit/s", "bandwidth", 100e9 / 8),
    ("400Gbps", "bandwidth", 400e9 / 8),
    ("2 us", "time", 2e-6),
    ("5 ms", "time", 5e-3),
    ("1.5e3 s", "time", 1500.0),
    (7, "bytes", 7.0),
    ("0", "time", 0.0),
])
def test_parse_quantity(text, dim, value):
    assert parse_quantity(text, dim, where="x") == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("text,dim", [
    ("5 parsecs", "time"), ("80 GB", "time"), ("-3 GB", "bytes"), ("fast", "flops"),
    ("nan GB", "bytes"), (True, "bytes"), (None, "bytes"), ("1e999 B", "bytes"),
    ("100 Gs", "time"),
])
def test_parse_quantity_rejects(text, dim):
    with pytest.raises(BadInput) as err:
        parse_quantity(text, dim, where="c.yaml: nodes[0].x")
    assert str(err.value).startswith("c.yaml: nodes[0].x: expected")
    assert "\n" not in str(err.value)


@given(st.just(0.0) | st.floats(min_value=1e-3, max_value=1e6),  # units.QUANTITY_RANGE
       st.sampled_from([("k", 1e3), ("M", 1e6), ("G", 1e9), ("Ki", 1024.0), ("Gi", 2.0**30)]))
def test_parse_quantity_prefixes(number, prefix):
    text = f"{number!r} {prefix[0]}B"
    assert parse_quantity(text, "bytes", where="x") == pytest.approx(number * prefix[1])


# ------------------------------------------------------------------ catalog and clusters


def test_catalog_entries_have_sources_and_sane_values():
    catalog = builtin_device_types()
    for name in ("V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe",
                 "H200", "L4", "T4", "A10", "RTX-3090", "RTX-4090", "MI250X", "MI300X"):
        d = catalog[name]
        assert d.source and "datasheet" in d.source or "whitepaper" in d.source
        assert 10e12 < d.peak_flops < 2e15
        assert 8e9 <= d.memory_bytes <= 200e9
        assert 0 < d.efficiency <= 1
    assert catalog["A100-80GB"].peak_flops / catalog["V100-32GB"].peak_flops == \
        pytest.approx(312 / 125)


def test_node_prices_take_units():
    c = cluster_from_dict({"nodes": [{"name": "n", "device": "T4", "count": 1,
                                      "price_per_hour": "0.35 $/h"}]}, where="x", name="x")
    assert c.price_per_hour("n/0") == pytest.approx(0.35)


def test_builtin_clusters_load():
    names = builtin_cluster_names()
    assert {"demo-hetero", "a100-v100", "h100-a100-l4", "scale-1024"} <= set(names)
    sizes = {n: len(load_cluster(n).devices) for n in names}
    assert sizes["scale-1024"] == 1024
    assert len({d.type.name for d in load_cluster("scale-1024").devices}) == 4
    assert len({d.type.name for d in load_cluster("h100-a100-l4").devices}) == 3


def test_cluster_file_and_paths(tmp_path):
    doc = tmp_path / "c.yaml"
    doc.write_text("""
device_types:
  fast: {peak_flops: "1 TFLOP/s", efficiency: 1.0, memory: "80 GB"}
nodes:
  - {name: n0, device: A100-80GB, count: 8, intra_link: {bandwidth: "600 GB/s", latency: "2 us"}}
  - {name: n1, device: fast, count: 2}
inter_node: {bandwidth: "100 Gbit/s", latency: "5 us"}
""")
    c = load_cluster(str(doc))
    assert [d.name for d in c.devices][:2] == ["n0/0", "n0/1"]
    assert c.device("n1/1").type.peak_flops == 1e12
    assert c.device("n1/1").type.achievable_flops == 1e12
    intra = c.path("n0/0", "n0/3")
    assert [h.name for h in intra.hops] == ["n0/0:out", "n0/3:in"]
    assert intra.time_s(600e9) == pytest.approx(1 + 2e-6)
    inter = c.path("n0/0", "n1/0")
    assert [h.name for h in inter.hops] == ["n0:nic-out", "n1:nic-in"]
    assert inter.time_s(12.5e9) == pytest.approx(1 + 5e-6)
    assert c.path("n0/1", "n0/1").time_s(1e9) == 0.0


def _cluster(**over):
    doc = {"nodes": [{"name": "n0", "device": "A100-80GB", "count": 2}]}
    doc.update(over)
    return doc


@pytest.mark.parametrize("doc,field", [
    ({"nodes": []}, "nodes"),
    ({"nodes": [{"device": "B200X", "count": 2}]}, "nodes[0].device"),
    ({"nodes": [{"device": "A100-80GB", "count": -2}]}, "nodes[0].count"),
    ({"nodes": [{"device": "A100-80GB", "count": "two"}]}, "nodes[0].count"),
    ({"nodes": [{"device": "A100-80GB", "count": 2, "colour": "red"}]}, "nodes[0].colour"),
    (_cluster(inter_node={"bandwidth": "fast"}), "inter_node.bandwidth"),
    (_cluster(inter_node={"bandwidth": "10 GB"}), "inter_node.bandwidth"),
    (_cluster(device_types={"x": {"memory": "8 GB"}}), "device_types.x.peak_flops"),
    (_cluster(device_types={"x": {"peak_flops": "1 TFLOP/s", "memory": "8 GB",
                                  "efficiency": 1.5}}), "device_types.x.efficiency"),
    ({"nodes": [{"name": "a", "device": "T4", "count": 1},
                {"name": "a", "device": "T4", "count": 1}]}, "nodes[1].name"),
    ([1, 2], "c.yaml"),
])
def test_cluster_rejects(doc, field):
    with pytest.raises(BadInput) as err:
        cluster_from_dict(doc, where="c.yaml", name="c")
    assert field in str(err.value)


# ------------------------------------------------------------------ cost model


def _free_cluster(types):
    """Devices of the given peak FLOP/s (efficiency 1), links of huge bandwidth."""
    return cluster_from_dict({
        "device_types": {f"t{i}": {"peak_flops": f, "memory": "80 GB", "efficiency": 1.0,
                                   "mem_bandwidth": "1e18 B/s"}
                         for i, f in enumerate(types)},
        "nodes": [{"name": f"n{i}", "device": f"t{i}", "count": 1} for i in range(len(types))],
        "inter_node": {"bandwidth": "1e18 B/s", "latency": "0 s"},
    }, where="x", name="free")


def test_cost_model_roofline_closed_form():
    model = load_model({"kind": "synthetic", "layers": 4, "fwd_flops_per_sample": 1e9,
                        "activation_bytes_per_sample": 1e6, "params_per_layer": 1000})
    cluster = _free_cluster([1e12, 4e12])
    cost = CostModel(model, cluster)
    # 1e9 FLOPs per sample x 2 samples / 1e12 FLOP/s = 2 ms per layer
    assert cost.layer_time_s(0, "t0", 2, "F") == pytest.approx(2e-3)
    assert cost.layer_time_s(0, "t1", 2, "F") == pytest.approx(0.5e-3)
    assert cost.layer_time_s(0, "t0", 2, "B") == pytest.approx(4e-3)
    assert cost.stage_time_s((0, 3), ("n0/0",), 2, "F") == pytest.approx(6e-3)
    assert cost.send_bytes((0, 2), 3) == pytest.approx(3e6)
    assert cost.state_bytes((0, 4)) == 4 * 1000 * 18       # bf16: 2 + 4 + 12 (Megatron)


def test_cost_model_transfer_and_allreduce():
    model = load_model("tiny-gpt")
    cluster = load_cluster("demo-hetero")
    cost = CostModel(model, cluster)
    bw = 10e9 / 8
    assert cost.transfer_time_s("a100/0", "v100/0", 1e6) == pytest.approx(10e-6 + 1e6 / bw)
    assert cost.transfer_time_s("a100/0", "a100/0", 1e6) == 0.0
    # one device per node: a ring, 2(n-1)/n * bytes at the NIC's bus bandwidth + 2(n-1) lat
    nic = bw * NIC_COLLECTIVE_EFFICIENCY
    assert cost.allreduce_time_s(["a100/0", "v100/0"], 8e6) == \
        pytest.approx(8e6 / nic + 2 * 10e-6)
    # two devices on each of two nodes: hierarchical. Intra-node reduce-scatter and
    # all-gather of 1/2 the bytes on the slower node (V100 NVLink 150 GB/s at its bus
    # efficiency, 2 us), a ring of the 4 MB shards between the nodes.
    devs = [d.name for d in cluster.devices]
    intra = 150e9 * DEFAULT_COLLECTIVE_EFFICIENCY
    phase = 0.5 * 8e6 / intra + 2e-6
    assert cost.allreduce_time_s(devs, 8e6) == \
        pytest.approx(2 * phase + 4e6 / nic + 2 * 10e-6)


def test_profile_overrides_cost_model(tmp_path):
    model = load_model({"kind": "synthetic", "layers": 2, "fwd_flops_per_sample": 1e9,
                        "activation_bytes_per_sample": 0, "params_per_layer": 0})
    cluster = _free_cluster([1e12])
    from hyperpipe.cluster.cluster import Link
    prof = Profile(compute={Profile.key("t0", "synthetic", "F"): Fit(1e-3, 2e-12, 5, 0.01)},
                   links={"*": Link(1e9, 1e-4)}, provenance={"emulated": True})
    path = tmp_path / "p.json"
    prof.save(path)
    again = load_profile(path)
    assert again == prof and again.emulated
    cost = CostModel(model, cluster, again)
    assert cost.layer_time_s(0, "t0", 1, "F") == pytest.approx(1e-3 + 2e-12 * 1e9)
    assert cost.layer_time_s(0, "t0", 1, "W") == pytest.approx(1e-3)  # analytic: 1e9/1e12


# ------------------------------------------------------------------ plans

PLAN = {
    "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
    "global_batch": 32, "schedule": {"kind": "1f1b", "chunks": 1},
    "pipelines": [{"micro_batch": 2, "num_microbatches": 16,
                   "stages": [{"layers": [0, 5], "devices": ["a100/0"], "tp": 1},
                              {"layers": [5, 8], "devices": ["v100/0"], "tp": 1}]}],
}


def test_plan_round_trip_and_check(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN))
    plan = load_plan(path)
    plan.check(plan.load_model(), plan.load_cluster())
    assert plan.to_dict() == PLAN
    plan.save(tmp_path / "again.json")
    assert load_plan(tmp_path / "again.json") == plan
    assert plan.devices == ["a100/0", "v100/0"]


def _plan(**changes):
    return edited(PLAN, **changes)


@pytest.mark.parametrize("doc,field", [
    (_plan(format="hyperpipe.plan/9"), "format"),
    (_plan(global_batch=30), "global_batch"),
    (_plan(schedule={"kind": "zigzag"}), "schedule.kind"),
    (_plan(schedule={"kind": "1f1b", "chunks": 2}), "schedule.chunks"),
    (_plan(**{"pipelines/0/stages/1/layers": [4, 8]}), "stages[1].layers"),
    (_plan(**{"pipelines/0/stages/1/layers": [6, 8]}), "stages[1].layers"),
    (_plan(**{"pipelines/0/stages/1/layers": [5, 7]}), "pipelines[0].stages"),
    (_plan(**{"pipelines/0/stages/1/devices": ["v100/9"]}), "stages[1].devices"),
    (_plan(**{"pipelines/0/stages/1/devices": ["a100/0"]}), "stages[1].devices"),
    (_plan(**{"pipelines/0/micro_batch": 0}), "micro_batch"),
    (_plan(**{"pipelines/0/num_microbatches": "many"}), "num_microbatches"),
    (_plan(**{"pipelines/0/stages/0/tp": 2}), "stages[0].devices"),
    (_plan(pipelines=[]), "pipelines"),
    (_plan(extra=1), "extra"),
])
def test_plan_rejects(doc, field):
    with pytest.raises(BadInput) as err:
        plan = plan_from_dict(doc, where="p.json")
        plan.check(plan.load_model(), plan.load_cluster(), where="p.json")
    assert field in str(err.value)
    assert str(err.value).startswith("p.json")


# ------------------------------------------------------------------ traces


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
