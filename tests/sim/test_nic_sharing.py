"""The GPUs of a node share its NICs: the all-reduce across nodes and the data-parallel
sync it prices, in the cost model, the simulator and the analytic tier.

Closed forms (derived here, not read off the code). Two nodes (N = 2) of k devices each,
n = 2k devices in all, one data-parallel all-reduce of B bytes per device over all of
them; each node has c NICs of bandwidth b_nic (device i uses NIC i·c // k), each device
a port of b_in, latencies λ_in inside a node and λ across.

* Rings (NCCL without in-switch reduction): k rings at once, each B/k of the bytes, the
  r-th visiting each node's devices from its r-th on, so that it leaves every node from
  another device. Each ring moves 2(n-1)/n of its bytes over every edge. A device's port
  carries the edges of the k-1 rings it does not leave the node in, b_in / (k-1) each:
  2(n-1)/n · (B/k) · (k-1) / b_in; each NIC carries the k/c rings that leave through it,
  c · b_nic / k each: 2(n-1)/n · (B/k) · k / (c · b_nic). Every ring steps in lock step
  at its slowest edge: 2(n-1)/n · B · max((k-1)/k / b_in, 1 / (c · b_nic)) + 2(n-1) ·
  max(λ_in, λ).
* Hierarchical (nodes whose switch reduces, NVLink SHARP): intra-node reduce-scatter and
  all-gather, (k-1)/k · B each over a device's port; each device's B/k shard
  all-reduced over its rail of N nodes, 2(N-1)/N · (B/k), the k rails sharing the c
  NICs (b_nic / (k/c) each): 2(N-1)/N · B / (c · b_nic). Pipelined in chunks: the bytes
  take the slower, each phase's latencies add: max(2(k-1)/k · B / b_in, 2(N-1)/N · B /
  (c · b_nic)) + 2(k-1) · λ_in + 2(N-1) · λ.

Either way one NIC makes the NICs' part k times longer than k NICs.
"""

from __future__ import annotations

import json

import pytest
from factories import device_type, synthetic_model

from hyperpipe.cli import main as cli_main
from hyperpipe.cluster.cluster import Hop, Link, Route, load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import CostModel, shared_bandwidths_bytes_per_s
from hyperpipe.sim.simulator import SimOptions, simulate

B_IN, LAT_IN = 50e9, 2e-6        # intra-node port, bytes/s and s
B_NIC, LAT = 1.25e9, 5e-6        # each NIC (10 Gbit/s) and the inter-node latency


def two_nodes(k: int, nics: int, switch_reduces: bool = False, b_in: float = B_IN) -> dict:
    """Two nodes of k user-defined devices (collective and NIC efficiency 1.0), `nics`
    NICs of B_NIC each, ports of `b_in`; `switch_reduces`: the type's `nvlink_sharp`.
    The cluster's `inter_node` is 100 times faster: the nodes' `nics` must set the pace,
    one NIC or several."""
    node = {"device": "unit", "count": k, "repeat": 2,
            "intra_link": {"bandwidth": b_in, "latency": LAT_IN},
            "nics": {"count": nics, "bandwidth": B_NIC}}
    unit = device_type(1e12, nvlink_sharp=switch_reduces)
    return {"name": f"two-{k}x{nics}", "device_types": {"unit": unit},
            "nodes": [{"name": "n", **node}],
            "inter_node": {"bandwidth": 100 * B_NIC, "latency": LAT}}


def closed_form_s(k: int, nics: int, nbytes: float, switch_reduces: bool = False,
                  b_in: float = B_IN) -> float:
    """The module doc's all-reduce time over two nodes of k."""
    if switch_reduces:
        intra_s = 2 * (k - 1) / k * nbytes / b_in
        inter_s = 2 * (2 - 1) / 2 * nbytes / (nics * B_NIC)
        return max(intra_s, inter_s) + 2 * (k - 1) * LAT_IN + 2 * (2 - 1) * LAT
    n = 2 * k
    return 2 * (n - 1) / n * nbytes * max((k - 1) / k / b_in, 1 / (nics * B_NIC)) + \
        2 * (n - 1) * max(LAT_IN, LAT)


def test_a_single_nic_runs_at_its_own_bandwidth():
    """`nics: {count: 1, bandwidth}` sets the node's one NIC, whatever `inter_node` says:
    a send between nodes leaves at the slower of the two ends' NICs."""
    cluster = load_cluster({"name": "one-nic", "inter_node": {"bandwidth": "100 Gbit/s"},
                            "nodes": [{"name": "a", "device": "V100-32GB", "count": 2,
                                       "nics": {"count": 1, "bandwidth": "10 Gbit/s"}},
                                      {"name": "b", "device": "V100-32GB", "count": 2,
                                       "nics": {"count": 1, "bandwidth": "25 Gbit/s"}},
                                      {"name": "c", "device": "V100-32GB", "count": 2}]})
    assert cluster.path("a/1", "b/0").bandwidth_bytes_per_s == pytest.approx(1.25e9)
    assert cluster.path("b/0", "c/1").bandwidth_bytes_per_s == pytest.approx(3.125e9)
    assert cluster.path("c/0", "c/1").link_class == "intra:c"


def test_streams_share_each_hop_equally():
    """Two routes through one hop of 10 get 5 each; a route alone keeps its bandwidth."""
    nic, other, own = Hop("n0:nic-out", 10.0), Hop("n1:nic-in", 10.0), Hop("n1:nic1-in", 4.0)
    link = Link(10.0, 0.0)
    a, b = Route((nic, other), link, "inter"), Route((nic, own), link, "inter")
    assert shared_bandwidths_bytes_per_s([a, b]) == [5.0, 4.0]
    assert shared_bandwidths_bytes_per_s([a]) == [10.0]
    assert shared_bandwidths_bytes_per_s([Route((), link, "local")]) == [float("inf")]


@pytest.mark.parametrize("switch_reduces", [False, True])
@pytest.mark.parametrize("k,nics", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
def test_allreduce_across_nodes_is_the_closed_form(k, nics, switch_reduces):
    # fast ports: the NICs bound every case; ports of 1 GB/s bind some (k 4, 2 NICs)
    for b_in in (B_IN, 1e9):
        cluster = load_cluster(two_nodes(k, nics, switch_reduces, b_in))
        cost = CostModel(synthetic_model(1, fwd_flops_per_sample=1e9), cluster)
        devices = [d.name for d in cluster.devices]
        assert cost.allreduce_time_s(devices, 64e6) == pytest.approx(
            closed_form_s(k, nics, 64e6, switch_reduces, b_in), rel=1e-12)


@pytest.mark.parametrize("nics", [1, 4])
def test_simulated_and_estimated_sync_is_the_closed_form(nics):
    """pp 1, dp 8 over two nodes of 4, one bucket, reduced after the backward: the
    simulator's all-reduce event and the analytic tier's sync phase both take the
    closed form's time for the gradient bytes (4 per parameter: fp32 main grads)."""
    k, params = 4, 2_000_000
    model = synthetic_model(2, fwd_flops_per_sample=1e9, params_per_layer=params,
                            activation_bytes_per_sample=0, stash_bytes_per_sample=0)
    cluster = load_cluster(two_nodes(k, nics))
    cost = CostModel(model, cluster)
    plan = uniform_plan(model, cluster, pp=1, dp=2 * k, micro_batch=1, global_batch=2 * k
                        ).on_stack(overlap_grad_reduce=False)
    expected = closed_form_s(k, nics, 2 * params * 4)
    sim = simulate(plan, cost, SimOptions(bucket_bytes=1e12, include_optimizer=False))
    (event,) = [e for e in sim.trace.events if e.op == "allreduce"]
    assert event.duration_s == pytest.approx(expected, rel=1e-9)
    est = estimate(plan, cost, bucket_bytes=1e12, include_optimizer=False)
    assert est.iteration_time_s - est.extra["pipeline_s"] == pytest.approx(expected, rel=1e-9)


def test_issue_repro_one_nic_against_four(tmp_path, capsys):
    """The issue's repro: two nodes of 4 x V100-16GB, inter_node 10 Gbit/s, one or four
    NICs of 10 Gbit/s; gpt2-medium, pp 1, dp 8, no overlap. The NICs bind both, and
    only their part differs: the all-reduces' difference is (1 - 1/4) x 2(n-1)/n x B /
    (NIC bandwidth x the V100's NIC efficiency), B the gradient bytes per device, n = 8
    devices in the rings, summed over buckets (one after another: it adds up exactly)."""
    times = {}
    for nics in (1, 4):
        path = tmp_path / f"nic{nics}.json"
        path.write_text(json.dumps({
            "name": f"v100-nic{nics}",
            "nodes": [{"name": "n", "device": "V100-16GB", "count": 4, "repeat": 2,
                       "nics": {"count": nics, "bandwidth": "10 Gbit/s"}}],
            "inter_node": {"bandwidth": "10 Gbit/s", "latency": "5 us"}}))
        assert cli_main(["simulate", "--cluster", str(path), "--model", "gpt2-medium",
                         "--pp", "1", "--dp", "8", "--micro-batch", "1", "--global-batch",
                         "8", "--no-overlap", "--json"]) == 0
        phases = json.loads(capsys.readouterr().out)["extra"]["phases"]
        times[nics] = phases["dp_allreduce_end_s"] - phases["pipeline_s"]
    model = load_model("gpt2-medium")
    cluster = load_cluster(json.loads((tmp_path / "nic1.json").read_text()))
    cost = CostModel(model, cluster)
    nbytes = model.params * cost.grad_bytes_per_param
    bus = 1.25e9 * cluster.devices[0].type.nic_efficiency
    assert times[1] - times[4] == pytest.approx(2 * 7 / 8 * 0.75 * nbytes / bus, rel=1e-6)
    assert times[1] / times[4] > 3.0           # the inter phase dominates on 10 Gbit/s


SHARED_NICS = {"name": "shared-nics", "inter_node": {"bandwidth": "100 Gbit/s"}, "nodes": [
    {"name": "a", "device": "A100-80GB", "count": 8, "repeat": 4,
     "nics": {"count": 2, "bandwidth": "200 Gbit/s"}},
    {"name": "v", "device": "V100-32GB", "count": 4, "repeat": 4},
    {"name": "h", "device": "H100-SXM", "count": 8, "repeat": 2,
     "nics": {"count": 8, "bandwidth": "400 Gbit/s"}}]}


@pytest.mark.parametrize("which", ["scale-1024", "shared-nics"])
def test_all_reduce_lines_shared_by_ring_pattern_are_each_tuples_own(which):
    """`CostModel.allreduce_time_s` prices a device tuple once per `ring_pattern` (node
    kinds, nodes in order of appearance, NICs in order of appearance on each node): on
    scale-1024 (four node kinds, a NIC per device) and on nodes where 4 devices share a
    NIC beside nodes of one NIC and of one per device, every ring, rails across nodes and
    random ones, costs exactly what its own `_allreduce_line` computes afresh, and rails
    of one shape share one line."""
    import random

    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    from hyperpipe.sim.costmodel import CostModel
    cluster = load_cluster(which if which == "scale-1024" else SHARED_NICS)
    cost = CostModel(load_model("gpt2-medium"), cluster)
    rng = random.Random(3)
    names = [d.name for d in cluster.devices]
    rings = []
    for _ in range(600):
        n = rng.choice([2, 3, 4, 8, 16, 32])
        if rng.random() < 0.5:           # a rail: device i of n nodes
            i = rng.randrange(min(node.count for node in cluster.nodes))
            rings.append(tuple(f"{cluster.nodes[k].name}/{i}" for k in
                               rng.sample(range(len(cluster.nodes)),
                                          min(n, len(cluster.nodes)))))
        else:
            rings.append(tuple(rng.sample(names, n)))
    for ring in rings:
        fixed_s, per_byte_s = CostModel(cost.model, cluster)._allreduce_line(ring)
        assert cost.allreduce_time_s(ring, 1e9) == fixed_s + per_byte_s * 1e9
    assert len(cost._tables.allreduce_patterns) < len(cost._tables.allreduce_s)


def test_two_h100_nodes_take_a_published_nccl_tests_time():
    """A published measurement as the oracle: nccl-tests' all_reduce_perf over two nodes
    of 8 H100 80GB with 8 NICs of 200 Gbit/s each (Google Cloud a3-mega), 16 ranks, 8 GiB
    per rank: 47,535 us out of place (public repository lessizzmore/create-a3mega-ztan-
    fork, file ztan-NCCL-test-result). The H100's switch reduces (NVLink SHARP): the
    catalog's H100 prices the hierarchical scheme within 10%; its phases one after
    another, or rings through every GPU, would take 1.7-2x as long."""
    cluster = load_cluster({
        "name": "a3-mega-x2",
        "nodes": [{"name": "a3", "device": "H100-SXM", "count": 8, "repeat": 2,
                   "nics": {"count": 8, "bandwidth": "200 Gbit/s"}}],
        "inter_node": {"bandwidth": "200 Gbit/s"}})
    cost = CostModel(load_model("gpt2-medium"), cluster)
    devices = [d.name for d in cluster.devices]
    nbytes = 8 * 2**30
    measured_s = 47_535e-6
    assert cost.allreduce_time_s(devices, nbytes) == pytest.approx(measured_s, rel=0.10)
    # one after another: the node's reduce-scatter and all-gather, then one rail's ring
    # of its 1/8 shard (each rail has a NIC of its own)
    serial_s = 2 * cost.allgather_time_s(devices[:8], nbytes) + \
        cost.allreduce_time_s(devices[::8], nbytes / 8)
    assert serial_s > 1.8 * measured_s
    # and rings, as on nodes whose switch does not reduce, would take 1.7x as long
    rings = load_cluster({**cluster.source, "device_types": {
        "H100-SXM": {"base": "H100-SXM", "nvlink_sharp": False}}})
    rings_s = CostModel(load_model("gpt2-medium"), rings).allreduce_time_s(devices, nbytes)
    assert rings_s > 1.6 * measured_s


@pytest.mark.parametrize("nodes,device,nbytes,bus_gbs", [
    # NVIDIA/nccl issue #1048: two nodes of 8 A100, four 200 Gbit/s NICs each,
    # all_reduce_perf -e 4G: 86 GB/s bus bandwidth
    (2, "A100-80GB", 4 * 2**30, 86.0),
    # NVIDIA/nccl-tests issue #119: three nodes of 8 A100-SXM4-40GB, four HDR (200
    # Gbit/s) NICs each, all_reduce_perf up to 128 MiB: peak 96 GB/s bus bandwidth
    (3, "A100-40GB", 128 * 2**20, 96.0),
])
def test_a100_nodes_take_published_nccl_tests_times(nodes, device, nbytes, bus_gbs):
    """Published measurements as the oracle, nodes without in-switch reduction: their
    rings through all GPUs give the bus bandwidth of the nodes' NICs, within 12% of
    what was measured; the hierarchical scheme's shorter inter-node part would give
    about 1.4x (three nodes) and 1.9x (two) that."""
    cluster = load_cluster({
        "name": f"a100-x{nodes}",
        "nodes": [{"name": "a", "device": device, "count": 8, "repeat": nodes,
                   "nics": {"count": 4, "bandwidth": "200 Gbit/s"}}],
        "inter_node": {"bandwidth": "200 Gbit/s"}})
    cost = CostModel(load_model("gpt2-medium"), cluster)
    devices = [d.name for d in cluster.devices]
    n = len(devices)
    bus_s = 2 * (n - 1) / n * nbytes / (bus_gbs * 1e9)
    assert cost.allreduce_time_s(devices, nbytes) == pytest.approx(bus_s, rel=0.12)
    switched = load_cluster({**cluster.source, "device_types": {
        device: {"base": device, "nvlink_sharp": True}}})
    hierarchical_s = CostModel(load_model("gpt2-medium"), switched).allreduce_time_s(
        devices, nbytes)
    assert hierarchical_s < bus_s / 1.3


def test_catalog_marks_the_parts_whose_switch_reduces():
    from hyperpipe.cluster.catalog import builtin_device_types
    types = builtin_device_types()
    assert types["H100-SXM"].nvlink_sharp and types["H200"].nvlink_sharp
    assert not any(types[n].nvlink_sharp for n in ("A100-80GB", "A100-40GB", "V100-16GB",
                                                   "H100-PCIe", "T4", "RTX-4090"))


def test_nvlink_sharp_must_be_a_boolean(tmp_path, capsys):
    from hyperpipe.core.errors import BadInput
    doc = two_nodes(2, 1)
    doc["device_types"]["unit"]["nvlink_sharp"] = "yes"
    with pytest.raises(BadInput, match="nvlink_sharp"):
        load_cluster(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert cli_main(["simulate", "--cluster", str(path), "--model", "gpt2-small",
                     "--pp", "1", "--dp", "4", "--micro-batch", "1",
                     "--global-batch", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nvlink_sharp" in err[0] and "true or false" in err[0]


def test_ring_pattern_tells_shared_nics_from_separate_ones():
    """Two devices of a node of 8 with 2 NICs leave through one NIC (devices 0 and 1)
    or through both (0 and 4): rings over them cost differently and their patterns
    differ; devices 4 and 5 share a NIC as 0 and 1 do: the same pattern and the same
    price, each computed afresh."""
    from hyperpipe.models import load_model
    cluster = load_cluster(SHARED_NICS)
    model = load_model("gpt2-medium")

    def ring(i: int, j: int) -> tuple[str, ...]:
        return (f"a0/{i}", f"a0/{j}", f"a1/{i}", f"a1/{j}")

    def fresh(devices: tuple[str, ...]) -> float:
        return CostModel(model, cluster).allreduce_time_s(devices, 1e9)

    cost = CostModel(model, cluster)
    assert fresh(ring(0, 1)) > fresh(ring(0, 4))
    assert cost.ring_pattern(ring(0, 1)) != cost.ring_pattern(ring(0, 4))
    assert fresh(ring(4, 5)) == fresh(ring(0, 1))
    assert cost.ring_pattern(ring(4, 5)) == cost.ring_pattern(ring(0, 1))
    assert cost.allreduce_time_s(ring(0, 1), 1e9) == fresh(ring(0, 1))
    assert cost.allreduce_time_s(ring(0, 4), 1e9) == fresh(ring(0, 4))
