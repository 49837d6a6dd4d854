"""Expert parallelism in the simulator and the analytic tier: the all-to-all against its
closed form (one node over NVLink; two nodes through one shared NIC), the expert
compute of an expert-parallel rank, memory per device, the expert-data-parallel
reduction, DualPipe's overlap, speed-aware placement, and the analytic tier against
the simulator."""

from __future__ import annotations

from itertools import combinations

import pytest
from factories import assert_analytic_matches_simulator

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.models.spec import MoEConfig
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.experts import (
    alltoall_edge_bytes,
    alltoall_edges,
    alltoall_spec,
    expert_extra_s,
)
from hyperpipe.sim.options import SimOptions
from hyperpipe.sim.sharding import fsdp_extra_s, overlapped_pass_s
from hyperpipe.sim.simulator import simulate

H, FE, E, K, S, V = 256, 512, 8, 2, 1024, 512
NVLINK_BPS, NIC_BPS, LAT_S, NIC_LAT_S = 100e9, 5e9, 2e-6, 5e-6


def _model(imbalance=1.0, cf=None, n_layer=4, dtype="bf16", routing="learned"):
    return load_model({"kind": "gpt", "name": "moe-test", "vocab_size": V, "n_layer": n_layer,
                       "n_head": 4, "d_model": H, "seq_len": S, "ffn_hidden": 4 * H,
                       "dtype": dtype, "tie_embeddings": False,
                       "moe": {"experts": E, "top_k": K, "expert_hidden": FE,
                               "capacity_factor": cf, "imbalance": imbalance,
                               "routing": routing}})


def _cluster(nodes=1, per_node=4, nics=1, types=("fast",), nic_bps=NIC_BPS):
    return load_cluster({
        "device_types": {"fast": {"peak_flops": "100 TFLOP/s", "efficiency": 1.0,
                                  "memory": "80 GB", "mem_bandwidth": "1000 TB/s"},
                         "slow": {"peak_flops": "25 TFLOP/s", "efficiency": 1.0,
                                  "memory": "80 GB", "mem_bandwidth": "1000 TB/s"}},
        "nodes": [{"name": f"n{i}", "device": types[i % len(types)], "count": per_node,
                   "intra_link": {"bandwidth": f"{NVLINK_BPS / 1e9:g} GB/s",
                                  "latency": f"{LAT_S * 1e6:g} us"},
                   "nics": {"count": nics, "bandwidth": f"{nic_bps / 1e9:g} GB/s"}}
                  for i in range(nodes)],
        "inter_node": {"bandwidth": f"{NIC_BPS / 1e9:g} GB/s",
                       "latency": f"{NIC_LAT_S * 1e6:g} us"}})


def _plan(devices, ep, model, kind="1f1b", m=4, mb=1, pp=1, zero=0, runtime=None):
    """One pipeline per entry of `devices` (each a list of pp devices; for the V kinds
    2 stages per device)."""
    n = model.num_layers
    v = 2 if kind in ("zb-v", "dualpipe-v") else 1
    cuts = [round(i * n / (pp * v)) for i in range(pp * v + 1)]
    pipes = []
    for devs in devices:
        order = list(devs) + list(reversed(devs)) if v == 2 else list(devs)
        pipes.append({"micro_batch": mb, "num_microbatches": m, "stages": [
            {"layers": [cuts[i], cuts[i + 1]], "devices": [order[i]], "ep": ep}
            for i in range(pp * v)]})
    doc = {"format": "hyperpipe.plan/1", "model": model.to_dict(), "cluster": "inline",
           "global_batch": mb * m * len(devices), "schedule": kind, "pipelines": pipes,
           "zero": zero}
    if runtime:
        doc["runtime"] = runtime
    return plan_from_dict(doc)


def _pair_bytes(model, mb=1):
    """Bytes one rank sends each other rank of its group per exchange (dropless, even):
    T·top_k·h·d / ep with T = b·s."""
    return mb * S * K * H * model.dtype_bytes


def _forward_s(res, device):
    """Micro-batch 0's forward as simulated, all-to-alls sharing links included: from
    its start to the start of its backward, which follows it at once on a one-stage
    pipeline (a trace event's own length is its time on idle links)."""
    events = [e for e in res.trace.events if e.device == device and e.microbatch == 0]
    f = next(e for e in events if e.op == "F")
    b = next(e for e in events if e.op == "B")
    return b.start_s - f.start_s


def test_alltoall_on_one_node_matches_its_closed_form():
    model, cluster = _model(), _cluster()
    cost = CostModel(model, cluster)
    ep = 4
    plan = _plan([[f"n0/{i}"] for i in range(4)], ep, model)
    eff = cluster.device("n0/0").type.collective_efficiency
    # each rank's out-port carries its ep - 1 sends of T·k·h·d / ep bytes
    one = (ep - 1) * _pair_bytes(model) / ep / (NVLINK_BPS * eff) + LAT_S
    moe_blocks = sum(layer.kind == "moe" for layer in model.layers)
    spec = alltoall_spec(cost, plan, 0, 0, "F")
    assert spec.time_s == pytest.approx(2 * moe_blocks * one, rel=1e-12)
    # in the simulation: F = compute + its all-to-alls, on otherwise idle links
    res = simulate(plan, cost, SimOptions(include_optimizer=False,
                                                collapse_replicas=False))
    compute = cost.stage_time_s((0, model.num_layers), ("n0/0",), 1, "F")
    assert _forward_s(res, "n0/0") == pytest.approx(compute + 2 * moe_blocks * one, rel=1e-9)
    # the backward's pair (the transposes) too, none in W
    assert alltoall_spec(cost, plan, 0, 0, "B").time_s == pytest.approx(spec.time_s)
    assert alltoall_spec(cost, plan, 0, 0, "W") is None


def test_hit_fraction_matches_brute_force():
    """A token's chance of meeting a set of experts: every top-k set equally likely
    ("learned"), and NeMo Automodel's benchmark gate ("contiguous": token t to experts
    t·k .. t·k+k-1 mod E), each counted out over all cases."""
    for experts, k in ((8, 2), (12, 3), (16, 8)):
        moe = MoEConfig(experts=experts, top_k=k, expert_hidden=4)
        gate = MoEConfig(experts=experts, top_k=k, expert_hidden=4, routing="contiguous")
        sets = list(combinations(range(experts), k))
        tokens = [[(t * k + j) % experts for j in range(k)] for t in range(experts * k)]
        for held in (range(1), range(2), range(3, 7), (0, 5, experts - 1)):
            held = set(held)
            learned = sum(bool(held & set(c)) for c in sets) / len(sets)
            assert moe.hit_fraction(held) == pytest.approx(learned, rel=1e-12)
            window = sum(bool(held & set(t)) for t in tokens) / len(tokens)
            assert gate.hit_fraction(held) == pytest.approx(window, rel=1e-12)


def test_deepep_sends_a_token_once_per_rank_on_one_node():
    """One node, ep 4 (2 experts a rank), top-2 windows aligned to a rank's pair: each
    token meets one rank, so "deepep" sends T·h·d / 4 to each peer where "alltoall"
    sends its k = 2 pairs' share, T·2·h·d / 4; learned routing meets a rank with
    probability 1 - C(6, 2) / C(8, 2) = 13/28."""
    cluster = _cluster()
    devices = [[f"n0/{i}"] for i in range(4)]
    token = S * H * 2
    eff = cluster.device("n0/0").type.collective_efficiency
    blocks = sum(layer.kind == "moe" for layer in _model().layers)
    for routing, hit in (("contiguous", 1 / 4), ("learned", 13 / 28)):
        model = _model(routing=routing)
        cost = CostModel(model, cluster)
        flat = alltoall_spec(cost, _plan(devices, 4, model), 0, 0, "F")
        plan = _plan(devices, 4, model, runtime={"moe_dispatcher": "deepep"})
        st = plan.pipelines[0].stages[0]
        edges = alltoall_edges(plan, 0, 0)
        assert alltoall_edge_bytes(cost, st, 1, edges, "deepep") == \
            pytest.approx([token * hit] * 12, rel=1e-12)
        one = 3 * token * hit / (NVLINK_BPS * eff) + LAT_S
        spec = alltoall_spec(cost, plan, 0, 0, "F")
        assert spec.time_s == pytest.approx(2 * blocks * one, rel=1e-12)
        assert spec.time_s < flat.time_s
        res = simulate(plan, cost, SimOptions(include_optimizer=False,
                                              collapse_replicas=False))
        compute = cost.stage_time_s((0, model.num_layers), ("n0/0",), 1, "F")
        assert _forward_s(res, "n0/0") == pytest.approx(compute + 2 * blocks * one,
                                                        rel=1e-9)


def test_deepep_sends_a_token_once_per_node_through_a_shared_nic():
    """Two nodes of two, ep 4, learned routing: a token crosses to the other node once
    if any of its 2 experts is among that node's 4, 1 - C(4, 2) / C(8, 2) = 22/28, split
    over the node's 2 receivers; each GPU's 2 remote sends share the node's one NIC."""
    model, cluster = _model(), _cluster(nodes=2, per_node=2, nics=1)
    cost = CostModel(model, cluster)
    plan = _plan([["n0/0"], ["n0/1"], ["n1/0"], ["n1/1"]], 4, model,
                 runtime={"moe_dispatcher": "deepep"})
    token = S * H * 2
    remote = token * (22 / 28) / 2
    local = token * (13 / 28)
    st = plan.pipelines[0].stages[0]
    edges = alltoall_edges(plan, 0, 0)
    got = alltoall_edge_bytes(cost, st, 1, edges, "deepep")
    for (a, b), nbytes in zip(edges, got, strict=True):
        same = a.split("/")[0] == b.split("/")[0]
        assert nbytes == pytest.approx(local if same else remote, rel=1e-12)
    dev = cluster.device("n0/0").type
    nic_s = 4 * remote / (NIC_BPS * dev.nic_efficiency)
    port_s = local / (NVLINK_BPS * dev.collective_efficiency)
    blocks = sum(layer.kind == "moe" for layer in model.layers)
    assert alltoall_spec(cost, plan, 0, 0, "F").time_s == pytest.approx(
        2 * blocks * (max(nic_s, port_s) + NIC_LAT_S), rel=1e-12)


def test_moe_dispatcher_and_routing_are_checked():
    model = _model()
    with pytest.raises(BadInput, match="moe_dispatcher"):
        _plan([["n0/0"], ["n0/1"]], 2, model, runtime={"moe_dispatcher": "nccl"})
    with pytest.raises(BadInput, match="routing"):
        _model(routing="random")
    plan = _plan([["n0/0"], ["n0/1"]], 2, model, runtime={"moe_dispatcher": "deepep"})
    assert plan.to_dict()["runtime"] == {"moe_dispatcher": "deepep"}
    assert plan_from_dict(plan.to_dict()).runtime_settings().moe_dispatcher == "deepep"


@pytest.mark.parametrize("nics", [1, 2])
def test_alltoall_across_two_nodes_shares_the_nic(nics):
    model, cluster = _model(), _cluster(nodes=2, per_node=2, nics=nics)
    cost = CostModel(model, cluster)
    ep = 4                       # one group: n0/0, n0/1, n1/0, n1/1
    plan = _plan([["n0/0"], ["n0/1"], ["n1/0"], ["n1/1"]], ep, model)
    pair = _pair_bytes(model) / ep
    dev = cluster.device("n0/0").type
    # a node's 2 GPUs each send 2 remote pairs through the node's NIC(s): 4 streams over
    # one NIC, 2 over each of two; the NVLink port carries 1 local pair
    nic_s = (4 // nics) * pair / (NIC_BPS * dev.nic_efficiency)
    port_s = pair / (NVLINK_BPS * dev.collective_efficiency)
    one = max(nic_s, port_s) + NIC_LAT_S
    blocks = sum(layer.kind == "moe" for layer in model.layers)
    assert alltoall_spec(cost, plan, 0, 0, "F").time_s == pytest.approx(2 * blocks * one)
    res = simulate(plan, cost, SimOptions(include_optimizer=False,
                                                collapse_replicas=False))
    compute = cost.stage_time_s((0, model.num_layers), ("n1/1",), 1, "F")
    for dev in ("n0/0", "n1/1"):
        assert _forward_s(res, dev) == pytest.approx(compute + 2 * blocks * one, rel=1e-9)


def test_expert_rank_compute_matches_the_load_closed_form():
    imb = 1.5
    model, cluster = _model(imbalance=imb), _cluster()
    cost = CostModel(model, cluster)
    ep = 4
    plan = _plan([[f"n0/{i}"] for i in range(4)], ep, model)
    peak = cluster.device("n0/0").type.achievable_flops_for(model.dtype)
    t = S                                                    # tokens per rank
    expert_f = t * K * 2 * H * FE * 2 / peak                # GELU: up and down, ep 1
    # the rank with the busiest expert: imb x mean + (E/ep - 1) x the others' share of
    # the group's ep·T tokens, over the T·k pairs it computes at ep 1
    mean = ep * t * K / E
    rank = imb * mean + (E // ep - 1) * (E - imb) / (E - 1) * mean
    blocks = sum(layer.kind == "moe" for layer in model.layers)
    want = blocks * expert_f * (rank / (t * K) - 1)
    assert expert_extra_s(cost, plan, 0, 0, "F") == pytest.approx(want, rel=1e-9)
    even = _model(imbalance=1.0)
    assert expert_extra_s(CostModel(even, cluster), _plan([[f"n0/{i}"] for i in range(4)],
                                                          ep, even), 0, 0, "F") == \
        pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("zero", [0, 1])
def test_memory_per_device_splits_the_experts(zero):
    model, cluster = _model(), _cluster()
    cost = CostModel(model, cluster)
    ep, dp = 2, 4
    opt = SimOptions(include_optimizer=False)
    devices = [[f"n0/{i}"] for i in range(dp)]
    plan = _plan(devices, ep, model, zero=zero)
    res = simulate(plan, cost, opt)
    whole = simulate(_plan(devices, 1, model, zero=zero), cost, opt)
    experts = sum(getattr(layer, "expert_params", 0) for layer in model.layers)
    # bf16 with Adam: 6 bytes kept + 12 shardable (Megatron); with ZeRO-1 the shardable
    # part over the dp replicas (ep 1) or the dp / ep expert-data-parallel ones; a rank
    # holds 1/ep of the experts, everything else as before
    def per(n):
        return 6 + 12 / (n if zero else 1)
    saved = experts * per(dp) - experts / ep * per(dp // ep)
    static = res.memory_timeline["n0/0"][0][1]
    assert whole.memory_timeline["n0/0"][0][1] - static == pytest.approx(saved, rel=1e-12)
    assert estimate(plan, cost).peak_memory_bytes["n0/0"] == \
        pytest.approx(res.metrics.peak_memory_bytes["n0/0"], rel=1e-9)


def test_expert_gradients_reduce_over_their_own_group():
    model, cluster = _model(), _cluster()
    cost = CostModel(model, cluster)
    plan = _plan([[f"n0/{i}"] for i in range(4)], 2, model)
    res = simulate(plan, cost)
    sizes = sorted({e.bytes for e in res.trace.events
                    if e.op == "allreduce" and e.device == "n0/0"})
    experts = sum(getattr(layer, "expert_params", 0) for layer in model.layers)
    dense = sum(layer.params for layer in model.layers) - experts
    grad = cost.grad_bytes_per_param
    assert sum(sizes) == pytest.approx(dense * grad + experts / 2 * grad)


def test_dualpipe_overlap_beats_1f1b_by_at_most_the_alltoall_time():
    model = _model(n_layer=8)
    cluster = _cluster(nodes=2, per_node=4, nics=4, nic_bps=10 * NIC_BPS)
    cost = CostModel(model, cluster)
    devices = [[f"n0/{i}", f"n1/{i}"] for i in range(4)]
    opt = SimOptions(include_optimizer=False)

    def time_s(kind, ep):
        """The pipeline's span (the data-parallel reduction apart: ep changes it)."""
        return simulate(_plan(devices, ep, model, kind, m=16, pp=2), cost,
                        opt).metrics.extra["phases"]["pipeline_s"]
    dual_plan = _plan(devices, 4, model, "dualpipe-v", m=16, pp=2)
    assert time_s("dualpipe-v", 4) < time_s("1f1b", 4)
    # imbalance 1: ep 4 differs from ep 1 only by the all-to-alls, so what dualpipe-v
    # gains over 1f1b beyond its gain without them is the overlap: positive, and at
    # most the all-to-all time of the pipeline's critical path, itself at most every
    # stage's all-to-alls over the step (m x each stage's F and B)
    overlap = (time_s("1f1b", 4) - time_s("dualpipe-v", 4)) - \
        (time_s("1f1b", 1) - time_s("dualpipe-v", 1))
    a2a = sum(16 * (alltoall_spec(cost, dual_plan, 0, k, "F").time_s
                    + alltoall_spec(cost, dual_plan, 0, k, "B").time_s) for k in range(4))
    assert 0 < overlap <= a2a


def test_speed_placement_gives_the_fast_devices_more_experts():
    model = _model()
    cluster = _cluster(nodes=2, per_node=2, types=("fast", "slow"))
    cost = CostModel(model, cluster)
    devices = [["n0/0"], ["n1/0"]]            # one fast, one slow, one group
    even = simulate(_plan(devices, 2, model), cost)
    speed = simulate(_plan(devices, 2, model, runtime={"expert_placement": "speed"}), cost)
    assert speed.metrics.iteration_time_s < even.metrics.iteration_time_s
    # even: the slow device's experts set the time of both
    plan = _plan(devices, 2, model)
    assert expert_extra_s(cost, plan, 0, 0, "F") > 0                   # the fast one waits
    assert expert_extra_s(cost, plan, 1, 0, "F") == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("kind,ep,pp,imb,nics,dispatcher", [
    ("1f1b", 2, 1, 1.25, 1, "alltoall"), ("1f1b", 4, 1, 1.0, 1, "alltoall"),
    ("1f1b", 4, 2, 1.0, 4, "alltoall"), ("gpipe", 2, 2, 1.5, 4, "alltoall"),
    ("dualpipe-v", 4, 2, 1.25, 4, "alltoall"), ("1f1b", 4, 1, 1.0, 1, "deepep"),
    ("dualpipe-v", 4, 2, 1.25, 4, "deepep")])
def test_analytic_tier_prices_moe_plans_within_five_percent(kind, ep, pp, imb, nics,
                                                            dispatcher):
    """Pipelines over both nodes (pp 2, one NIC per GPU: the analytic tier leaves out
    replicas sharing a NIC for their point-to-point sends), or one-stage replicas
    alternating between the nodes so that a group of 4 spans both (one shared NIC)."""
    model = _model(imbalance=imb, n_layer=8)
    cluster = _cluster(nodes=2, per_node=4, nics=nics, nic_bps=10 * NIC_BPS)
    cost = CostModel(model, cluster)
    devices = [[f"n0/{i}", f"n1/{i}"] for i in range(4)] if pp == 2 else \
        [[f"n{i % 2}/{i // 2}"] for i in range(8)]
    plan = _plan(devices, ep, model, kind, m=8, pp=pp,
                 runtime={"moe_dispatcher": dispatcher})
    sim = simulate(plan, cost).metrics.iteration_time_s
    est = estimate(plan, cost).iteration_time_s
    assert est == pytest.approx(sim, rel=0.05)


def test_a_dense_calibration_prices_moe_blocks_at_its_fitted_rate():
    """A profile fitted on dense blocks (kind "block") prices an MoE block's FLOPs with
    the same fit, plus its extra kernel launches at the dense fit's intercept per launch
    (counted by hand from the module structure)."""
    from hyperpipe.plan.profile import Fit, Profile
    model, cluster = _model(), _cluster()
    a = 1e-4
    fit = Fit(a, 1e-12)
    prof = Profile(compute={Profile.key("fast", "block", op): fit for op in "FIW"})
    cost = CostModel(model, cluster, prof)
    moe = next(i for i, layer in enumerate(model.layers) if layer.kind == "moe")
    # GELU MLP with biases, flash attention, learned positions, no dropout. Dense F (and
    # I): 2 norms, 2 residual adds, QKV and out-projection, 1 flash kernel, up, GeLU,
    # down = 10; the MoE block: less the MLP's 3, router 4 + permute 3 + unpermute 2, and
    # 8 experts x 3 = 40. W: 4 weights and 4 biases = 8; MoE: 8 - 4 + router 1 + 8 x 4 = 37
    per = {"F": a / 10, "I": a / 10, "W": a / 8}
    extra = {"F": 30, "I": 30, "W": 29}
    for op in "FIW":
        flops = cost.op_flops(moe, 1, op)
        assert cost.layer_time_s(moe, "fast", 1, op) == pytest.approx(
            a + 1e-12 * flops + extra[op] * per[op], rel=1e-12)
    b = cost.layer_time_s(moe, "fast", 1, "I") + cost.layer_time_s(moe, "fast", 1, "W")
    assert cost.layer_time_s(moe, "fast", 1, "B") == pytest.approx(b, rel=1e-12)
    # a rank of ep 2 runs the MLPs of 4 experts: 4 x 3 fewer launches in F
    assert cost.expert_launch_delta_s(moe, "fast", 1, "F", local_experts=4) == \
        pytest.approx(-12 * per["F"], rel=1e-12)


def test_the_busiest_rank_stashes_the_tokens_routed_to_it():
    imb, ep = 1.5, 2
    model, cluster = _model(imbalance=imb), _cluster()
    cost = CostModel(model, cluster)
    devices = [[f"n0/{i}"] for i in range(4)]

    def stash(ep):
        line = simulate(_plan(devices, ep, model), cost).memory_timeline["n0/0"]
        return line[1][1] - line[0][1]             # one micro-batch's, after its F starts
    # the rank holding the busiest expert keeps, per MoE block, the pairs routed to its
    # E/ep experts from the group's ep·T tokens instead of its own T·k, each pair its
    # dispatched token (h·d) and its GELU intermediates (2·fe·d)
    t = S
    mean = ep * t * K / E
    rank = imb * mean + (E // ep - 1) * (E - imb) / (E - 1) * mean
    blocks = sum(layer.kind == "moe" for layer in model.layers)
    d = model.dtype_bytes
    want = blocks * (rank - t * K) * (H * d + 2 * FE * d)
    assert stash(ep) - stash(1) == pytest.approx(want, rel=1e-12)


def _zero3_moe(reshard, ep=2, dp=4):
    model, cluster = _model(), _cluster()
    cost = CostModel(model, cluster)
    devices = [[f"n0/{i}"] for i in range(dp)]
    plan = _plan(devices, ep, model, zero=3,
                 runtime={"reshard_after_forward": reshard})
    return model, cluster, cost, plan


@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_holds_and_gathers_only_the_rank_s_experts(reshard):
    # torchtitan shards the routed experts over the dp·cp / ep expert-data-parallel mesh
    # and the rest over all dp·cp ranks; a rank holds and gathers 1/ep of the experts
    ep, dp = 2, 4
    model, cluster, cost, plan = _zero3_moe(reshard, ep, dp)
    opt = SimOptions(include_optimizer=False)
    z3 = simulate(plan, cost, opt).memory_timeline["n0/0"][0][1]
    z0 = simulate(_plan([[f"n0/{i}"] for i in range(dp)], ep, model, zero=0), cost,
                  opt).memory_timeline["n0/0"][0][1]
    experts = [getattr(layer, "expert_params", 0) for layer in model.layers]
    held = [layer.params - e + e / ep for layer, e in zip(model.layers, experts,
                                                          strict=True)]
    dense = sum(layer.params for layer in model.layers) - sum(experts)
    # bf16: 18 bytes a parameter without ZeRO (Megatron); ZeRO-3 16 over its group, the
    # dense part over dp, the rank's experts over dp / ep; unsharded: two units' bf16
    # weights and one unit's fp32 gradient (2 + 2 + 4) when resharding, else every
    # held weight and gradient (2 + 4)
    state0 = 18 * (dense + sum(experts) / ep)
    state3 = 16 * dense / dp + 16 * sum(experts) / ep / (dp // ep)
    working = 8 * max(held) if reshard else 6 * sum(held)
    assert z0 - z3 == pytest.approx(state0 - state3 - working, rel=1e-12)
    assert estimate(plan, cost).peak_memory_bytes["n0/0"] == pytest.approx(
        simulate(plan, cost, opt).metrics.peak_memory_bytes["n0/0"], rel=1e-9)


def test_zero3_gathers_experts_over_the_expert_data_parallel_ring():
    ep, dp = 2, 4
    model, cluster, cost, plan = _zero3_moe(True, ep, dp)
    eff = cluster.device("n0/0").type.collective_efficiency
    d = model.dtype_bytes

    def gather_s(n, nbytes):
        # a ring all-gather on one node: (n-1)/n of the bytes, n-1 latencies
        if n == 1 or nbytes == 0:
            return 0.0
        return (n - 1) / n * nbytes / (NVLINK_BPS * eff) + (n - 1) * LAT_S

    st = plan.pipelines[0].stages[0]
    compute, gathers = [], []
    for i in range(*st.layers):
        layer = model.layers[i]
        e = getattr(layer, "expert_params", 0)
        compute.append(cost.stage_time_s((i, i + 1), st.devices, 1, "F"))
        gathers.append(gather_s(dp, (layer.params - e) * d) +
                       gather_s(dp // ep, e / ep * d))
    assert any(getattr(layer, "expert_params", 0) for layer in model.layers)
    expected = overlapped_pass_s(compute, gathers, [0.0] * len(compute)) - sum(compute)
    assert fsdp_extra_s(cost, plan, 0, 0, "F") == pytest.approx(expected, rel=1e-9)
    # the simulated forward (all-to-alls included) is longer by the gathers' share
    def forward(p):
        return next(e for e in simulate(p, cost).trace.events
                    if e.op == "F" and e.device == "n0/0").duration_s
    plain = _plan([[f"n0/{i}"] for i in range(dp)], ep, model, zero=0)
    assert forward(plan) - forward(plain) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("reshard", [True, False])
def test_analytic_prices_zero3_with_ep_like_the_simulator(reshard):
    _, _, cost, plan = _zero3_moe(reshard)
    assert_analytic_matches_simulator(plan, cost)


def test_synthesis_budgets_the_same_expert_share_as_the_simulator():
    # the list scheduler's stash budget is device memory less what the simulator holds
    # static: with ep 2 a rank keeps half of the experts, so its budget grows by them
    from hyperpipe.synth.synthesise import pipe_costs
    model, cluster = _model(), _cluster()
    cost = CostModel(model, cluster)
    plan = _plan([[f"n0/{i}"] for i in range(4)], 2, model, zero=1)
    static = simulate(plan, cost, SimOptions(include_optimizer=False)) \
        .memory_timeline["n0/0"][0][1]
    budget = pipe_costs(plan, cost, 0).budget_bytes[0]
    assert budget == pytest.approx(cluster.device("n0/0").type.memory_bytes - static,
                                   rel=1e-12)
