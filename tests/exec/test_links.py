"""The link emulator (exec.fabric, exec.links, exec.collectives): links shared by the
flows on them, from the cluster file's nominal figures alone.

Oracles: closed forms of fair sharing worked out by hand (in each test's docstring), and,
for the multi-process tests, the same closed forms against wall-clock time (within 10%).
"""

from __future__ import annotations

import math
import statistics
import threading
import time

import pytest
import torch

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.exec import links
from hyperpipe.exec.collectives import RingCollectives, node_groups, ring_order
from hyperpipe.exec.fabric import Fabric, topology

GB = 1e9


# ---------------------------------------------------------------------------- the model
def deliveries(fabric: Fabric, until_s: float = 1e6) -> dict:
    fabric.advance(until_s)
    return {d.key: d.arrival_s for d in fabric.take_deliveries()}


def test_two_flows_on_one_hop_each_take_twice_as_long_as_one_alone():
    # one flow of S bytes alone on a hop of bandwidth B: S / B, then the latency; two
    # flows started together: each gets B / 2, so both end at 2 S / B
    f = Fabric({"h": 1 * GB})
    f.start("alone", ("h",), 1e8, 1e-3, at_s=0.0)
    assert deliveries(f, 10.0) == {"alone": pytest.approx(0.1 + 1e-3)}
    f.start("a", ("h",), 1e8, 1e-3, at_s=20.0)
    f.start("b", ("h",), 1e8, 1e-3, at_s=20.0)
    assert deliveries(f) == {"a": pytest.approx(20.201), "b": pytest.approx(20.201)}


def test_rates_are_max_min_fair_and_follow_flows_that_end():
    # h1 0.5 GB/s, h2 2 GB/s. Flow a crosses h1 and h2, flow b only h2. Max-min: a is held
    # to 0.5 by h1, b takes the 1.5 GB/s of h2 that a leaves. b (3e8 bytes) ends at 0.2 s;
    # a has then moved 1e8 of its 2e8 and keeps 0.5 GB/s (h1 is its bottleneck): 0.4 s.
    # A third flow c on h1 alone from 0.1 s: h1's 0.5 splits in two, a moves 0.25 GB/s.
    f = Fabric({"h1": 0.5 * GB, "h2": 2 * GB})
    f.start("a", ("h1", "h2"), 2e8, 0.0, at_s=0.0)
    f.start("b", ("h2",), 3e8, 0.0, at_s=0.0)
    assert deliveries(f) == {"b": pytest.approx(0.2), "a": pytest.approx(0.4)}
    g = Fabric({"h1": 0.5 * GB, "h2": 2 * GB})
    g.start("a", ("h1", "h2"), 2e8, 0.0, at_s=0.0)
    g.start("c", ("h1",), 0.5e8, 0.0, at_s=0.1)
    # at 0.1 s a has 1.5e8 left; both at 0.25 GB/s until c's 0.5e8 end at 0.3 s, when a
    # has 1.0e8 left, alone again at 0.5 GB/s: 0.5 s
    assert deliveries(g) == {"c": pytest.approx(0.3), "a": pytest.approx(0.5)}


def test_flows_of_one_queue_cross_one_after_another():
    # a communicator's connection: the second message starts when the first's bytes end
    # (not its latency), then both arrive a latency after their own bytes
    f = Fabric({"h": 1 * GB})
    f.start("m0", ("h",), 1e8, 5e-3, at_s=0.0, queue="q")
    f.start("m1", ("h",), 1e8, 5e-3, at_s=0.0, queue="q")
    f.start("other", ("h",), 1e8, 0.0, at_s=0.0)
    # m0 and other share h (0.5 GB/s each) until 0.2 s; m1 then alone: 0.1 s more
    assert deliveries(f) == {"m0": pytest.approx(0.205), "other": pytest.approx(0.2),
                             "m1": pytest.approx(0.305)}


def test_topology_takes_the_cluster_files_nominal_figures():
    cluster = load_cluster({"nodes": [
        {"name": "x", "device": "A100-80GB", "count": 2,
         "intra_link": {"bandwidth": "100 GB/s", "latency": "10 us"}},
        {"name": "y", "device": "V100-32GB", "count": 2,
         "nics": {"count": 2, "bandwidth": "25 Gbit/s"}}],
        "inter_node": {"bandwidth": "10 Gbit/s", "latency": "20 us"}})
    topo = topology(cluster, ["x/0", "x/1", "y/0", "y/1"])
    assert topo.route(0, 1).hops == ("x/0:out", "x/1:in")
    assert topo.route(0, 1).latency_s == pytest.approx(10e-6)
    assert topo.route(1, 3).hops == ("x:nic-out", "y:nic1-in")
    assert topo.route(1, 3).latency_s == pytest.approx(20e-6)
    assert topo.bandwidth_bytes_per_s["x/0:out"] == pytest.approx(100e9)
    assert topo.bandwidth_bytes_per_s["x:nic-out"] == pytest.approx(10e9 / 8)
    assert topo.bandwidth_bytes_per_s["y:nic1-in"] == pytest.approx(25e9 / 8)


def test_rings_visit_nodes_one_after_another():
    nodes = ["x", "y", "x", "y", "z"]
    assert ring_order([0, 1, 2, 3, 4], nodes) == (0, 2, 1, 3, 4)
    assert node_groups((0, 2, 1, 3, 4), nodes) == [(0, 2), (1, 3), (4,)]


# ---------------------------------------------------------------------------- processes
def two_nodes(nics: int = 1, nic: str = "1 GB/s") -> dict:
    """Two nodes of two devices, `nics` NICs of `nic` each per node, fast intra links."""
    node = {"device": "A100-80GB", "count": 2, "nics": {"count": nics, "bandwidth": nic},
            "intra_link": {"bandwidth": "100 GB/s", "latency": "10 us"}}
    return {"nodes": [{"name": "x", **node}, {"name": "y", **node}],
            "inter_node": {"bandwidth": nic, "latency": "1 ms"}}


DEVICES = ["x/0", "x/1", "y/0", "y/1"]


@pytest.mark.slow
def test_two_flows_through_one_emulated_hop_take_twice_as_long_as_one():
    """x/0 -> y/0 and x/1 -> y/1 both cross x's one NIC and y's (1 GB/s). S = 100 MB:
    alone S / B + L = 0.101 s; together each gets B / 2: 2 S / B + L = 0.201 s. Measured
    by threads of this process as ranks, through the emulator process; the median of
    three rounds each, within 10%."""
    emulator = links.start(topology(load_cluster(two_nodes()), DEVICES))
    try:
        client = links.Links(emulator.address, emulator.authkey, 0, 30.0)
        took: dict = {}

        def flow(key, src, dst):
            t0 = time.perf_counter()
            client.post(key, src, dst, 1e8)
            took[key] = client.deliver(key) - t0

        alone, both = [], []
        for rnd in range(3):
            flow(("alone", rnd), 0, 2)
            alone.append(took[("alone", rnd)])
            threads = [threading.Thread(target=flow, args=(("both", rnd, s), s, d))
                       for s, d in ((0, 2), (1, 3))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            both += [took[("both", rnd, 0)], took[("both", rnd, 1)]]
        client.close()
    finally:
        emulator.stop()
    assert statistics.median(alone) == pytest.approx(0.101, rel=0.10)
    assert statistics.median(both) == pytest.approx(0.201, rel=0.10)
    assert statistics.median(both) / statistics.median(alone) == pytest.approx(2.0, rel=0.10)


ROUNDS = 3      # timed all-reduces per rank: the median round is compared (noise only adds)


def _all_reduce_rank(rank, world, store, address, authkey, nodes, nbytes,
                     switch_nodes=frozenset()):
    """One rank: ROUNDS RingCollectives.all_reduce calls of rank-dependent data; (seconds
    of each, whether every sum is right)."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    client = links.Links(address, authkey, rank, 60.0)
    ranks = tuple(range(world))
    ring = RingCollectives(ranks, dist.new_group(list(ranks)), rank, nodes, client, 60.0,
                           "test", switch_nodes)
    n = int(nbytes // 4)
    base = torch.arange(n, dtype=torch.float32) % 997       # sums exact in fp32
    warm = torch.ones(world * 4)
    ring.all_reduce(warm).result(60.0)          # connections and threads up
    took, right = [], True
    for _ in range(ROUNDS):
        data = base * (rank + 1)
        dist.barrier()
        t0 = time.perf_counter()
        ring.all_reduce(data).result(60.0)
        took.append(time.perf_counter() - t0)
        right = right and bool(torch.equal(data, base * 10))
    dist.barrier()
    client.close()
    dist.destroy_process_group()
    return took, right


@pytest.mark.slow
@pytest.mark.parametrize("nics", [1, 2])
def test_ring_all_reduce_of_four_ranks_on_a_shared_nic_takes_its_closed_form(nics):
    """Four ranks, two nodes of two (x/0 x/1 | y/0 y/1), S bytes each, NICs of B = 50
    Mbit/s and latency L = 1 ms, intra-node ports of Bi = 100 GB/s and Li = 10 us. The
    all-reduce is two rings at once (exec.collectives: x/0 x/1 y/0 y/1 and x/1 x/0 y/1
    y/0), S/2 each, each step a flow of the emulator: 2(n-1) = 6 steps of S/8 per ring.
    At each step every ring has one edge leaving each node, x/1 -> y/0 and x/0 -> y/1
    out of x: with one NIC per node they share it (B/2 each), S/8 / (B/2) + L = S/(4B) +
    L a step; with two NICs each has its own, S/(8B) + L; the port edges (Bi) finish
    first. S = 2 MB: one NIC 6 (0.08 + 0.001) s = 0.486 s, two NICs 6 (0.04 + 0.001) s
    = 0.246 s. The slowest rank's wall time, median of ROUNDS rounds, within 10%; the
    sum is exact on every rank. (Small S over a slow NIC: the request round trips to the
    emulator, a fraction of a millisecond per step, stay far below the emulated time.)"""
    from hyperpipe.exec.launch import launch_local
    S, B, L = 2e6, 50e6 / 8, 1e-3
    edge_bw = B if nics == 2 else B / 2         # each ring's edge out of a node
    closed = 6 * (S / 8 / edge_bw + L)
    cluster = load_cluster(two_nodes(nics, "50 Mbit/s"))
    emulator = links.start(topology(cluster, DEVICES))
    try:
        nodes = [cluster.device(d).node for d in DEVICES]
        out = launch_local(_all_reduce_rank, (emulator.address, emulator.authkey, nodes, S),
                           DEVICES)
    finally:
        emulator.stop()
    assert all(ok for _, ok in out)
    slowest = [max(took[r] for took, _ in out) for r in range(ROUNDS)]   # per round
    assert statistics.median(slowest) == pytest.approx(closed, rel=0.10)


@pytest.mark.slow
def test_large_hierarchical_all_reduce_pipelines_its_phases_in_chunks():
    """Four ranks on two nodes of two (x/0 x/1 | y/0 y/1) whose switch reduces (NVLink
    SHARP: a hierarchical all-reduce), one NIC of B = 50 MB/s and
    L = 1 ms a node, node ports of Bi = 100 MB/s and Li = 10 us; S = 32 MB per rank, so
    c = S / PIPELINE_CHUNK_BYTES rounded up = 8 chunks of Sc = S/c (exec.collectives).
    Per chunk: the node reduce-scatter is one step of Sc/2 over the ports, r = Sc/(2 Bi)
    + Li; the rails' all-reduce two steps of Sc/4, both rails through the one NIC (B/2
    each), a = Sc/B + 2L; the node all-gather g = r. The rails are the bottleneck even
    while a reduce-scatter and an all-gather share a port (2r < a), so the pipeline takes
    r + c·a + g; the phases one after another would take c·(r + a + g), 40% more. The
    slowest rank's wall time, median of ROUNDS rounds, within 10%; the sums exact."""
    from hyperpipe.exec.collectives import PIPELINE_CHUNK_BYTES
    from hyperpipe.exec.launch import launch_local
    S, B, L, Bi, Li = 32e6, 50e6, 1e-3, 100e6, 10e-6
    c = math.ceil(S / PIPELINE_CHUNK_BYTES)
    Sc = S / c
    r, a = Sc / (2 * Bi) + Li, Sc / B + 2 * L
    assert c == 8 and 2 * r < a
    closed = r + c * a + r
    doc = two_nodes(1, "50 MB/s")
    doc["device_types"] = {"switched": {"base": "A100-80GB", "nvlink_sharp": True}}
    for node in doc["nodes"]:
        node["intra_link"] = {"bandwidth": "100 MB/s", "latency": "10 us"}
        node["device"] = "switched"
    cluster = load_cluster(doc)
    emulator = links.start(topology(cluster, DEVICES))
    try:
        nodes = [cluster.device(d).node for d in DEVICES]
        out = launch_local(_all_reduce_rank, (emulator.address, emulator.authkey, nodes, S,
                                              frozenset(("x", "y"))), DEVICES)
    finally:
        emulator.stop()
    assert all(ok for _, ok in out)
    slowest = [max(took[r] for took, _ in out) for r in range(ROUNDS)]
    assert statistics.median(slowest) == pytest.approx(closed, rel=0.10)


@pytest.mark.slow
def test_emulated_tied_embedding_sum_matches_one_matrix():
    # the tied-embedding gradient sum (exec.tied) as ring steps over the emulated links:
    # first and last stage on two nodes; gradients against a single process whose head
    # is the embedding's Parameter
    from factories import plan_doc
    from test_exec_tied import HEAD, LR, SHARED, TIED, TOL, single_process

    from hyperpipe.exec import RunOptions, run_plan
    from hyperpipe.plan.plan import plan_from_dict
    plan = plan_from_dict(plan_doc([{"micro_batch": 2, "num_microbatches": 2, "stages": [
        {"layers": [0, 4], "devices": ["x/0"]}, {"layers": [4, 8], "devices": ["y/0"]}]}],
        model=TIED, cluster=two_nodes(nic="1 Gbit/s")))
    result = run_plan(plan, RunOptions(steps=1, capture_state=True, probe_links=False,
                                       lr=LR))
    assert result.emulated
    _, grads, _ = single_process(plan, 1)
    for rank_state in result.state:
        for name, st in rank_state.items():
            ref = SHARED if name == HEAD else name
            assert (st["grad"] - grads[ref]).abs().max().item() <= TOL, name
