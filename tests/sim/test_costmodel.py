"""The cost model: roofline closed forms, transfers and all-reduce, profile overrides."""

from __future__ import annotations

import pytest
from factories import cluster_doc, device_type

from hyperpipe.cluster.catalog import DEFAULT_COLLECTIVE_EFFICIENCY, NIC_COLLECTIVE_EFFICIENCY
from hyperpipe.cluster.cluster import cluster_from_dict
from hyperpipe.models import load_model
from hyperpipe.plan.profile import Fit, Profile, load_profile
from hyperpipe.sim.costmodel import CostModel


def _free_cluster(types):
    """Devices of the given peak FLOP/s (efficiency 1), links of huge bandwidth."""
    return cluster_from_dict(cluster_doc(
        {f"t{i}": device_type(f, memory="80 GB", mem_bandwidth="1e18 B/s")
         for i, f in enumerate(types)},
        [(f"n{i}", f"t{i}", 1) for i in range(len(types))],
        inter_node={"bandwidth": "1e18 B/s", "latency": "0 s"}), where="x", name="free")


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


def test_cost_model_transfer_and_allreduce(tiny_gpt, demo_hetero):
    cluster = demo_hetero
    cost = CostModel(tiny_gpt, cluster)
    bw = 10e9 / 8
    assert cost.transfer_time_s("a100/0", "v100/0", 1e6) == pytest.approx(10e-6 + 1e6 / bw)
    assert cost.transfer_time_s("a100/0", "a100/0", 1e6) == 0.0
    # one device per node: a ring, 2(n-1)/n * bytes at the NIC's bus bandwidth + 2(n-1) lat
    nic = bw * NIC_COLLECTIVE_EFFICIENCY
    assert cost.allreduce_time_s(["a100/0", "v100/0"], 8e6) == \
        pytest.approx(8e6 / nic + 2 * 10e-6)
    # two devices on each of two nodes (no in-switch reduction): two rings of 4 MB each,
    # 2(n-1)/n of it over every edge; a device's port carries one ring (the slower node's,
    # V100 NVLink 150 GB/s at its bus efficiency), the node's one NIC both (half its
    # bandwidth each); 2(n-1) steps of the slowest latency
    devs = [d.name for d in cluster.devices]
    intra = 150e9 * DEFAULT_COLLECTIVE_EFFICIENCY
    assert cost.allreduce_time_s(devs, 8e6) == pytest.approx(
        1.5 * 4e6 / min(intra, nic / 2) + 6 * 10e-6)


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

