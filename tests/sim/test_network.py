"""Links as shared resources: alpha-beta transfers, equal time-sharing, ring all-reduce.

Expected times are written from the link numbers (latency + bytes / bandwidth, and
Patarasuk and Yuan's ring: 2(n-1)/n of the bytes plus 2(n-1) latencies), not from the
cost model's code.
"""

from __future__ import annotations

import itertools

import pytest
import simpy
from factories import cluster_doc, device_type, synthetic_model

from hyperpipe.cluster.cluster import cluster_ref, load_cluster
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.network import Network, p2p_edges, p2p_spec, ring_spec
from hyperpipe.sim.simulator import SimOptions, simulate

BW = 1e9         # bytes/s between nodes
LAT = 1e-4       # s


def cluster_dict(nodes, *, bandwidth, latency):
    """`nodes`: (name, count) of 1 TFLOP/s devices; every link `bandwidth`, `latency`."""
    link = {"bandwidth": bandwidth, "latency": latency}
    return cluster_doc({"unit": device_type(1e12)}, [(n, "unit", c) for n, c in nodes],
                       intra_link=link, inter_node=link, name="test")


def synthetic(layers, *, params=0, act=0.0, stash=1e6):
    """1 ms of F, I and W per layer and sample on a 1 TFLOP/s device."""
    return synthetic_model(layers, fwd_flops_per_sample=1e9, params_per_layer=params,
                           activation_bytes_per_sample=act, stash_bytes_per_sample=stash)


def run_flows(flows):
    """flows: (start_s, hops, work_s, latency_s). Returns each flow's delivery time."""
    env = simpy.Environment()
    net = Network(env)
    done = {}

    def starter(i, start, hops, work, lat):
        yield env.timeout(start)
        net.start(hops, work, lat, lambda token: done.__setitem__(token, env.now), i)

    for i, flow in enumerate(flows):
        env.process(starter(i, *flow))
    env.run()
    return [done[i] for i in range(len(flows))]


def test_one_flow_takes_latency_plus_work():
    assert run_flows([(0.5, (("h", 1),), 2.0, 0.25)]) == [pytest.approx(2.75)]


def test_two_flows_on_one_hop_each_take_twice_as_long():
    hop = (("h", 1),)
    assert run_flows([(0.0, hop, 1.0, 0.1), (0.0, hop, 1.0, 0.1)]) == \
        [pytest.approx(2.1), pytest.approx(2.1)]
    # Overlap only: the second starts half-way; both run at half speed while together.
    # First: 0.5 alone + 0.5 of work at 1/2 -> 1.5. Second: 0.5 done by 1.5, rest alone.
    assert run_flows([(0.0, hop, 1.0, 0.0), (0.5, hop, 1.0, 0.0)]) == \
        [pytest.approx(1.5), pytest.approx(2.0)]
    # Flows on different hops do not interact; a weight-2 flow is two in lock step.
    assert run_flows([(0.0, (("a", 1),), 1.0, 0.0), (0.0, (("b", 1),), 1.0, 0.0)]) == \
        [pytest.approx(1.0), pytest.approx(1.0)]
    assert run_flows([(0.0, (("a", 2),), 1.0, 0.0)]) == [pytest.approx(2.0)]
    # A flow is as slow as its most loaded hop: x shares "a" with y, and y "b" with z.
    assert run_flows([(0.0, (("a", 1),), 1.0, 0.0), (0.0, (("a", 1), ("b", 1)), 1.0, 0.0),
                      (0.0, (("b", 1),), 1.0, 0.0)]) == [pytest.approx(2.0)] * 3


def two_nodes(per_node=2, **kw):
    return load_cluster(cluster_dict([("a", per_node), ("b", per_node)],
                                     bandwidth=BW, latency=LAT, **kw))


def test_point_to_point_transfer_in_the_simulator():
    nbytes = 2e6                                     # activations per sample
    model = synthetic(2, act=nbytes)
    cluster = two_nodes(1)
    plan = uniform_plan(model, cluster, pp=2, micro_batch=1, global_batch=1)
    sends = [e for e in simulate(plan, CostModel(model, cluster)).trace.events
             if e.op == "send"]
    assert [(e.device, e.peer) for e in sends] == [("a/0", "b/0"), ("b/0", "a/0")]
    for e in sends:
        assert e.duration_s == pytest.approx(LAT + nbytes / BW)
        assert e.bytes == nbytes


def test_replicas_sharing_a_nic_share_its_bandwidth():
    nbytes = 2e6
    model = synthetic(2, act=nbytes)
    cluster = two_nodes(2)
    # Megatron order: stage 0 of both replicas on node a, stage 1 on node b, so both
    # replicas' activations cross a's NIC at the same time: each at half speed.
    plan = uniform_plan(model, cluster, pp=2, dp=2, micro_batch=1, global_batch=2)
    assert [s.devices for s in plan.pipelines[1].stages] == [("a/1",), ("b/1",)]
    sends = [e for e in simulate(plan, CostModel(model, cluster)).trace.events
             if e.op == "send"]
    assert sends and all(e.duration_s == pytest.approx(LAT + 2 * nbytes / BW) for e in sends)


def test_sends_of_one_stage_pair_go_one_after_another():
    nbytes = 2e6
    model = synthetic(2, act=nbytes, stash=0)
    cluster = two_nodes(1)
    plan = uniform_plan(model, cluster, pp=2, micro_batch=1, global_batch=3,
                        schedule="gpipe")
    fwd = [e for e in simulate(plan, CostModel(model, cluster)).trace.events
           if e.op == "send" and e.device == "a/0"]
    one = LAT + nbytes / BW
    assert [e.duration_s for e in fwd] == [pytest.approx(one)] * 3
    # F takes 1 ms < one transfer (2.1 ms): each send starts when the one before lands.
    assert [e.start_s for e in fwd] == [pytest.approx(1e-3 + i * one) for i in range(3)]


@pytest.mark.parametrize("n", [2, 4])
def test_ring_allreduce_matches_its_formula(n):
    params = 1_500_000                  # 2 layers: 12 MB of fp32 main grads (bf16 model)
    model = synthetic(2, params=params)
    cluster = load_cluster(cluster_dict([(f"n{i}", 1) for i in range(n)],
                                        bandwidth=BW, latency=LAT))
    cost = CostModel(model, cluster)
    grad = 2 * params * cost.grad_bytes_per_param          # 4 bytes each
    expected = 2 * (n - 1) / n * grad / BW + 2 * (n - 1) * LAT
    spec = ring_spec(cost, [[d.name for d in cluster.devices]], grad)
    assert spec.time_s == pytest.approx(expected)
    plan = uniform_plan(model, cluster, pp=1, dp=n, micro_batch=1, global_batch=n)
    for overlap in (True, False):
        result = simulate(plan.on_stack(overlap_grad_reduce=overlap), cost,
                          SimOptions(bucket_bytes=1e12))
        reduce = [e for e in result.trace.events if e.op == "allreduce"]
        assert len(reduce) == 1 and reduce[0].duration_s == pytest.approx(expected)
        compute_end = max(e.end_s for e in result.trace.events if e.op in "FB")
        assert reduce[0].start_s == pytest.approx(compute_end)   # one bucket: at the end
    # Buckets overlap the backward (F 2 ms, B 4 ms): 4 buckets of 3 MB, the first ready
    # after a quarter of the backward; the link-bound queue then runs them back to back.
    result = simulate(plan, cost, SimOptions(bucket_bytes=3e6))
    reduce = [e for e in result.trace.events if e.op == "allreduce"]
    bucket = 2 * (n - 1) / n * 3e6 / BW + 2 * (n - 1) * LAT
    assert len(reduce) == 4
    assert reduce[0].start_s == pytest.approx(2e-3 + 0.25 * 4e-3)
    assert bucket > 1e-3                  # slower than the backward makes them: queued
    assert [e.start_s for e in reduce] == \
        [pytest.approx(reduce[0].start_s + j * bucket) for j in range(4)]
    assert reduce[-1].end_s == pytest.approx(reduce[0].start_s + 4 * bucket)


def test_tensor_parallel_transfer_is_split_over_the_group():
    cluster = two_nodes(2)
    cost = CostModel(synthetic(2), cluster)
    edges = p2p_edges(("a/0", "a/1"), ("b/0", "b/1"))
    assert edges == [("a/0", "b/0"), ("a/1", "b/1")]
    spec = p2p_spec(cost, edges, 4e6)
    # Two half-size streams through one NIC each way: as long as one full-size stream.
    assert dict(spec.hops) == {"a:nic-out": 2, "b:nic-in": 2}
    assert run_flows([(0.0, spec.hops, spec.work_s, spec.latency_s)]) == \
        [pytest.approx(LAT + 4e6 / BW)]
    assert p2p_spec(cost, p2p_edges(("a/0",), ("a/0",)), 4e6) is None    # same device


def test_buckets_faster_than_the_backward_start_as_they_become_ready():
    params = 1_500_000                    # 12 MB of fp32 main grads: 4 buckets of 3 MB
    model = synthetic(2, params=params)
    cluster = load_cluster(cluster_dict([("n0", 1), ("n1", 1)], bandwidth=1e11, latency=0.0))
    plan = uniform_plan(model, cluster, pp=1, dp=2, micro_batch=1, global_batch=2)
    result = simulate(plan, CostModel(model, cluster), SimOptions(bucket_bytes=3e6))
    reduce = [e for e in result.trace.events if e.op == "allreduce"]
    bucket = 3e6 / 1e11                   # 2(n-1)/n = 1 for n = 2: 30 us << 1 ms
    # Backward 2..6 ms; bucket j is ready after (j + 1) / 4 of it and starts right away.
    assert [e.start_s for e in reduce] == [pytest.approx(2e-3 + (j + 1) * 1e-3)
                                           for j in range(4)]
    assert result.metrics.iteration_time_s == pytest.approx(6e-3 + bucket)


def test_lazy_flow_delayed_by_a_later_one():
    env = simpy.Environment()
    delayed, done = [], {}
    net = Network(env, on_delay=delayed.append)
    hop = (("h", 1),)

    def go():
        assert net.start(hop, 1.0, 0.1, lambda t: done.__setitem__(t, env.now), "a",
                         lazy=True) == pytest.approx(1.1)       # alone: no event needed
        yield env.timeout(0.5)
        assert net.start(hop, 1.0, 0.1, lambda t: done.__setitem__(t, env.now), "b",
                         lazy=True) is None                     # shares: time not known yet

    env.process(go())
    env.run()
    assert delayed == ["a"]
    assert done == {"a": pytest.approx(1.6), "b": pytest.approx(2.1)}


def test_a_reader_waiting_on_a_delayed_message_starts_at_its_real_arrival():
    """Two replicas with different cuts send through one NIC, 1 ms apart. Replica 0's
    message is alone at first (arrival 3.1 ms) until replica 1's joins at 2 ms: both then
    move at half speed, so replica 0's lands at 4.1 ms, replica 1's at 5.1 ms."""
    from hyperpipe.plan.plan import PipelinePlan, Plan, StagePlan
    model = synthetic(3, act=2e6)
    cluster = two_nodes(2)
    a = PipelinePlan(1, 1, (StagePlan((0, 1), ("a/0",)), StagePlan((1, 3), ("b/0",))))
    b = PipelinePlan(1, 1, (StagePlan((0, 2), ("a/1",)), StagePlan((2, 3), ("b/1",))))
    plan = Plan("inline", "inline", 2, "1f1b", 1, (a, b))
    events = simulate(plan, CostModel(model, cluster)).trace.events
    start = {(e.device, e.op): e.start_s for e in events}
    end = {(e.device, e.op): e.end_s for e in events}
    assert end[("a/0", "send")] == pytest.approx(4.1e-3)
    assert end[("a/1", "send")] == pytest.approx(5.1e-3)
    assert start[("b/0", "F")] == pytest.approx(4.1e-3)
    assert start[("b/1", "F")] == pytest.approx(5.1e-3)


def test_mixed_tp_replicas_sync_each_gradient_once():
    """Replica A holds the layers on one device (tp 1), replica B on two (tp 2). Two
    rings, one per half of the parameters: A's device is in both and carries each half
    once (all its gradients), B's devices one half each. Both rings cross A's and B's
    NICs, so they share them: together 2(n-1)/n x (all gradients) / BW, n = 2."""
    params = 1_500_000
    model = synthetic(2, params=params)
    cluster = load_cluster(cluster_dict([("a", 1), ("b", 2)], bandwidth=BW, latency=LAT))
    cost = CostModel(model, cluster)
    grad = 2 * params * cost.grad_bytes_per_param
    plan = plan_from_dict({
        "format": "hyperpipe.plan/1", "model": model.to_dict(), "cluster": cluster_ref(cluster),
        "global_batch": 2, "schedule": {"kind": "1f1b"},
        "pipelines": [{"micro_batch": 1, "num_microbatches": 1,
                       "stages": [{"layers": [0, 2], "devices": devices, "tp": len(devices)}]}
                      for devices in (["a/0"], ["b/0", "b/1"])]})
    result = simulate(plan.on_stack(overlap_grad_reduce=False), cost,
                      SimOptions(bucket_bytes=1e12))
    reduce = [e for e in result.trace.events if e.op == "allreduce"]
    compute_end = max(e.end_s for e in result.trace.events if e.op in "FB")
    sync = max(e.end_s for e in reduce) - compute_end
    # each ring: 2 latencies; their byte streams share the NICs, their latencies overlap
    assert sync == pytest.approx(grad / BW + 2 * LAT, rel=1e-6)


def test_a_send_due_as_the_channel_frees_queues_behind_the_ones_waiting():
    """GPipe on two pipelines of three tp stages (2, 2 and 4 devices), 2 and 9
    micro-batches, the first stages on one node: pipeline 1's stage 0 sends its
    activations to stage 1 one at a time. A send due exactly as the channel's current
    message landed had gone ahead of the one queued behind it, and the queued one was
    never sent (a deadlock: stage 1 waited for micro-batch 3 forever). Every message now
    goes, in micro-batch order, one after another on each channel."""
    from hyperpipe.plan.plan import PipelinePlan, Plan, StagePlan
    cluster = load_cluster(cluster_doc({"unit": device_type(1e12)},
                                       [(f"n{i}", "unit", 4) for i in range(12)],
                                       intra_link={"bandwidth": 1e11, "latency": 0},
                                       inter_node={"bandwidth": 1e9, "latency": 0}, name="t"))
    model = synthetic_model(6, fwd_flops_per_sample=1e9, params_per_layer=0,
                            activation_bytes_per_sample=1e6, stash_bytes_per_sample=1e6)
    devices = [[("n9/0", "n9/1"), ("n8/0", "n8/1"), ("n6/0", "n6/1", "n6/2", "n6/3")],
               [("n9/2", "n9/3"), ("n3/0", "n3/1"), ("n0/0", "n0/1", "n0/2", "n0/3")]]
    bounds = [0, 2, 4, 6]
    pipes = tuple(PipelinePlan(1, m, tuple(StagePlan((bounds[s], bounds[s + 1]), d[s],
                                                     len(d[s])) for s in range(3)))
                  for m, d in zip([2, 9], devices, strict=True))
    plan = Plan(model=model, cluster=cluster, global_batch=11, schedule="gpipe", chunks=1,
                pipelines=pipes)
    result = simulate(plan, CostModel(model, cluster), SimOptions(include_optimizer=False))
    sends = [e for e in result.trace.events if e.op == "send" and e.device == "n9/2"]
    forward = [e for e in sends if e.peer.startswith("n3/")]
    assert [e.microbatch for e in forward] == list(range(9))
    assert all(a.end_s <= b.start_s + 1e-12 for a, b in itertools.pairwise(forward))
