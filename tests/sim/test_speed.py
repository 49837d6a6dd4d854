"""Shape-dependent compute and NCCL-like collectives (issue 9, speed half): the GEMM
efficiency curve, memory-bound op costs and the hierarchical all-reduce, each against a
closed form or an invariant that could fail."""

from __future__ import annotations

import itertools

import pytest

from hyperpipe.cluster.catalog import GemmCurve, builtin_device_types
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.models.ops import Gemm, layer_work
from hyperpipe.sim.compute import gemm_time_s, pass_time_s
from hyperpipe.sim.costmodel import CostModel

SIZES = (64, 256, 1024, 4096, 16384)


@pytest.mark.parametrize("name", sorted(builtin_device_types()))
def test_gemm_curve_monotone_and_below_peak(name):
    curve = builtin_device_types()[name].gemm
    assert curve is not None
    ceiling = curve.ceiling
    assert 0 < ceiling <= 1
    for m, n, k in itertools.product(SIZES, repeat=3):
        e = curve.efficiency(m, n, k)
        assert 0 < e <= ceiling
        # growing any one dimension never lowers the efficiency
        assert curve.efficiency(2 * m, n, k) >= e
        assert curve.efficiency(m, 2 * n, k) >= e
        assert curve.efficiency(m, n, 2 * k) >= e
    # small GEMMs far below peak, large ones near the ceiling
    assert curve.efficiency(128, 128, 128) < 0.2 * ceiling
    assert curve.efficiency(16384, 16384, 16384) > 0.9 * ceiling


def test_gemm_curve_passes_through_its_measurement():
    curve = GemmCurve(0.7, (4096, 8192, 2048), sms=100)
    assert curve.efficiency(4096, 8192, 2048) == pytest.approx(0.7)
    # closed form: waves W = M N / (tile sms), fill W/(W+1/2), depth K/(K+k_fill)
    w = 4096 * 8192 / (256 * 128 * 100)
    assert curve.ceiling == pytest.approx(0.7 / (w / (w + 0.5) * 2048 / (2048 + 128)))


def test_gemm_time_is_the_slower_of_compute_and_operand_traffic():
    # the 40 GB part (1,555 GB/s): its outer product is past the ridge; the 80 GB part's
    # sits within a few percent of it
    dev = builtin_device_types()["A100-40GB"]
    # large square GEMM: compute-bound at the curve's efficiency
    big = gemm_time_s(dev, 8192, 8192, 8192, 1, 2)
    assert big == pytest.approx(2 * 8192**3 / (dev.peak_flops * dev.gemm.efficiency(
        8192, 8192, 8192)))
    # an outer product (K = 1) moves far more bytes than it computes: memory-bound
    m = n = 16384
    io = (m + n + m * n) * 2 / dev.achievable_mem_bandwidth_bytes_per_s
    compute = 2 * m * n / (dev.peak_flops * dev.gemm.efficiency(m, n, 1))
    assert gemm_time_s(dev, m, n, 1, 1, 2) == pytest.approx(max(io, compute))
    assert io > compute


def _gpt(**over):
    return load_model({"kind": "gpt", "vocab_size": 1024, "n_layer": 2, "n_head": 8,
                       "d_model": 512, "seq_len": 256, **over})


def test_memory_bound_bytes_closed_form_eager_block():
    """Forward of one eager block with dropout, tp=2, no sequence parallelism, d = 2:
    norms 2·2·T·h·d, bias+dropout+add 2·T·h·(3d+1), GeLU 2·T·(f/t)·d, softmax
    2·(b·a/t)·s²·d, attention dropout (b·a/t)·s²·(2d+1)."""
    model = _gpt(attention="eager", dropout=0.1)
    b, s, h, f, a, t, d = 2, 256, 512, 2048, 8, 2, 2
    T = b * s
    e_s = b * a / t * s * s
    expect = 4 * T * h * d + 2 * T * h * (3 * d + 1) + 2 * T * f / t * d \
        + 2 * e_s * d + e_s * (2 * d + 1)
    work = layer_work(model.layers[1], "F", b, s, d, tp=t)
    assert work.mem_bytes == pytest.approx(expect)
    # flash attention keeps nothing of size s² in memory
    flash = layer_work(_gpt(attention="flash", dropout=0.1).layers[1], "F", b, s, d, tp=t)
    assert flash.mem_bytes == pytest.approx(expect - 2 * e_s * d - e_s * (2 * d + 1))
    # sequence parallelism divides the norm/dropout/residual traffic by t
    sp = layer_work(model.layers[1], "F", b, s, d, tp=t, sequence_parallel=True)
    assert sp.mem_bytes == pytest.approx(expect - (4 * T * h * d + 2 * T * h * (3 * d + 1))
                                         / 2)


def test_head_memory_bytes_closed_form_megatron_loss():
    """The head's memory-bound bytes, counted kernel by kernel from Megatron's
    `VocabParallelCrossEntropy` over a tp-rank's vocabulary slice (V/t logits per
    token), d = 2: forward the final norm 2·T·h·d, then cast (d + 4), max (4), subtract
    in place (8), exp in place (8), sum (4), divide in place (8); backward multiply in
    place (8), cast back (4 + d), the norm's backward 3·T·h·d; W moves nothing."""
    model = _gpt()
    b, s, h, v, t, d = 2, 256, 512, 1024, 2, 2
    T = b * s
    head = model.layers[-1]
    f = layer_work(head, "F", b, s, d, tp=t)
    assert f.mem_bytes == pytest.approx(2 * T * h * d + T * v / t * (d + 4 + 4 + 8 + 8 + 4 + 8))
    i = layer_work(head, "I", b, s, d, tp=t)
    assert i.mem_bytes == pytest.approx(T * v / t * (8 + 4 + d) + 3 * T * h * d)
    assert layer_work(head, "W", b, s, d, tp=t).mem_bytes == 0


def test_pass_flops_match_the_layer_totals():
    """Op by op, F, I and W FLOPs add up to the spec's per-pass totals (eager), and the
    backward is counted per pass, not as twice the forward."""
    model = _gpt(attention="eager")
    for i in range(1, model.num_layers):     # the embedding's scatter-add is memory work
        c = model.layer_cost(i, 2)
        for op, total in (("F", c.fwd_flops), ("I", c.i_flops), ("W", c.w_flops)):
            work = layer_work(model.layers[i], op, 2, 256, 2, tp=1)
            assert work.flops == pytest.approx(total)
        tp2 = layer_work(model.layers[i], "F", 2, 256, 2, tp=2)
        assert tp2.flops == pytest.approx(c.fwd_flops / 2)


def test_memory_bound_time_added_not_hidden():
    """On a catalog device the layer time is the GEMM times plus bytes / achievable
    bandwidth (a sum, not a max)."""
    model = _gpt(attention="eager", dropout=0.1)
    cluster = load_cluster({"nodes": [{"device": "A100-80GB", "count": 1}]})
    cost = CostModel(model, cluster)
    dev = cluster.device_types["A100-80GB"]
    work = layer_work(model.layers[1], "F", 2, 256, 2)
    gemms = sum(gemm_time_s(dev, g.m, g.n, g.k, g.batch, 2) for g in work.gemms)
    mem = work.mem_bytes / dev.achievable_mem_bandwidth_bytes_per_s
    assert cost.layer_time_s(1, "A100-80GB", 2, "F") == pytest.approx(gemms + mem)
    assert pass_time_s(dev, work, 2) == pytest.approx(gemms + mem)
    assert mem > 0 and gemms > 0
    # B is I + W, op by op
    assert cost.layer_time_s(1, "A100-80GB", 2, "B") == pytest.approx(
        cost.layer_time_s(1, "A100-80GB", 2, "I") + cost.layer_time_s(1, "A100-80GB", 2, "W"))


def test_gemm_batched_flops():
    assert Gemm(4, 5, 6, 3).flops == 2 * 4 * 5 * 6 * 3


def test_hierarchical_allreduce_closed_form_with_rails():
    """Two nodes of four devices, four 100 Gbit/s NICs each. Without in-switch
    reduction four rings of 1/4 of the bytes, 2(n-1)/n of it over each edge, three
    rings through each port and one through each NIC; with it (NVLink SHARP) a
    reduce-scatter inside the node, a ring of 1/4 shards over each device's own rail,
    all-gather inside, pipelined: the bytes over the slower of ports and rails, every
    phase's latency."""
    cluster = load_cluster({
        "device_types": {"g": {"peak_flops": "100 TFLOP/s", "memory": "80 GB"}},
        "nodes": [{"name": "n", "device": "g", "count": 4, "repeat": 2,
                   "intra_link": {"bandwidth": "100 GB/s", "latency": "1 us"},
                   "nics": {"count": 4, "bandwidth": "100 Gbit/s"}}],
        "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}})
    cost = CostModel(load_model("tiny-gpt"), cluster)
    devs = [f"n{i}/{j}" for i in range(2) for j in range(4)]
    nbytes = 64e6
    ring = nbytes / 4 * 2 * 7 / 8                       # user types: efficiency 1
    assert cost.allreduce_time_s(devs, nbytes) == pytest.approx(
        max(3 * ring / 100e9, ring / 12.5e9) + 2 * 7 * 5e-6)
    doc = {**cluster.source, "device_types": {"g": {**cluster.source["device_types"]["g"],
                                                    "nvlink_sharp": True}}}
    cost = CostModel(load_model("tiny-gpt"), load_cluster(doc))
    intra = 2 * 3 / 4 * nbytes / 100e9
    inter = 2 * 1 / 2 * (nbytes / 4) / 12.5e9
    assert cost.allreduce_time_s(devs, nbytes) == pytest.approx(
        max(intra, inter) + 2 * 3 * 1e-6 + 2 * 5e-6)
    # each device has its own rail: device 2 of a node crosses NIC 2
    assert [h.name for h in cluster.path("n0/2", "n1/2").hops] == ["n0:nic2-out",
                                                                  "n1:nic2-in"]
    # one device per node: a plain ring over the rail
    assert cost.allreduce_time_s(["n0/1", "n1/1"], nbytes) == pytest.approx(
        nbytes / 12.5e9 + 2 * 5e-6)


# ----------------------------------------------------------------------------- TP on links

def _tp_setup(nodes: int):
    """A tiny GPT on user-defined devices (flat efficiency 1) joined by 2 GB/s ports;
    one NIC per device as fast as the ports, so only sharing tells the layouts apart."""
    link = {"bandwidth": "2 GB/s", "latency": "0 us"}
    cluster = load_cluster({
        "device_types": {"u": {"peak_flops": "1 TFLOP/s", "efficiency": 1.0,
                               "memory": "1000 GB"}},
        "nodes": [{"name": "n", "device": "u", "count": 4 // nodes, "repeat": nodes,
                   "intra_link": link, "nics": {"count": 4 // nodes, "bandwidth": "2 GB/s"}}],
        "inter_node": link})
    model = _gpt(n_layer=2, n_head=4, d_model=256, seq_len=128, vocab_size=512)
    return model, cluster


def _tp_plan(groups, m: int = 4):
    from hyperpipe.plan.plan import plan_from_dict
    return plan_from_dict({
        "format": "hyperpipe.plan/1", "model": "x", "cluster": "x", "global_batch": m * len(groups),
        "schedule": {"kind": "1f1b"},
        "pipelines": [{"micro_batch": 1, "num_microbatches": m,
                       "stages": [{"layers": [0, 4], "devices": g, "tp": 2}]}
                      for g in groups]})


def test_tp_collectives_on_idle_links_keep_the_closed_form():
    """One tensor-parallel stage: m (F + B) plus the optimizer step, each action exactly
    its `stage_time_s` (compute + all-reduces) when its ports are idle."""
    from hyperpipe.sim.simulator import SimOptions, simulate
    model, cluster = _tp_setup(1)
    cost = CostModel(model, cluster)
    plan = _tp_plan([["n/0", "n/1"]])
    devs = ("n/0", "n/1")
    f = cost.stage_time_s((0, 4), devs, 1, "F")
    b = cost.stage_time_s((0, 4), devs, 1, "B")
    assert cost.stage_tp_comm_s((0, 4), devs, 1, "F")[0] > 0
    opt = cost.optimizer_time_s((0, 4), "u", 2)
    got = simulate(plan, cost, SimOptions(check_plan=False)).metrics.iteration_time_s
    assert got == pytest.approx(4 * (f + b) + opt)


def test_tp_collectives_compete_with_data_parallel_rings():
    """Two replicas of a tp=2 stage. On one node their data-parallel rings (n/0-n/2,
    n/1-n/3) cross the same ports as the tensor-parallel rings and slow each other; on
    two nodes (NICs as fast as the ports) they do not. Folded into compute time, the
    two layouts would take the same time."""
    from hyperpipe.sim.simulator import SimOptions, simulate
    model, one = _tp_setup(1)
    _, two = _tp_setup(2)
    shared = simulate(_tp_plan([["n/0", "n/1"], ["n/2", "n/3"]]), CostModel(model, one),
                      SimOptions(check_plan=False)).metrics.iteration_time_s
    apart = simulate(_tp_plan([["n0/0", "n0/1"], ["n1/0", "n1/1"]]), CostModel(model, two),
                     SimOptions(check_plan=False)).metrics.iteration_time_s
    assert shared > apart * 1.001
