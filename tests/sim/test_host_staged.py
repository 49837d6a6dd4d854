"""GPUs without peer-to-peer: NCCL stages intra-node transfers through host memory.

Closed forms (derived here from the public figures, not read off the code). A node of k
GPUs on PCIe Gen3 x16 (16 GB/s per direction) without peer-to-peer:

* a ring all-reduce of B bytes per device moves 2(k-1)/k · B at the host-staged bus
  bandwidth, 3.9 GB/s (nccl-tests over SHM on PCIe Gen3 x16, NVIDIA/nccl issue #384),
  plus 2(k-1) host-staged steps of 20.36/2 us (an 8-byte all-reduce of two T4s over SHM
  took 20.36 us, two ring steps: NVIDIA/nccl issue #428);
* a point-to-point send of B bytes takes 20.36/2 us + B / 10.31 GB/s (one direction
  over SHM: broadcast between two GPUs, issue #384).

With peer-to-peer the same node prices the link at its bandwidth x the part's
`collective_efficiency`, at its own latency.
"""

from __future__ import annotations

import json

import pytest
from factories import synthetic_model

from hyperpipe.cli import main as cli_main
from hyperpipe.cluster.catalog import builtin_device_types
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.models.ops import block_launches, layer_work
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate

SHM_BUS_BYTES_PER_S = 3.9e9         # NVIDIA/nccl issue #384: all-reduce over SHM, Gen3 x16
SHM_SEND_BYTES_PER_S = 10.31e9      # the same issue: broadcast (one direction)
SHM_STEP_S = 20.36e-6 / 2           # NVIDIA/nccl issue #428: 8 B all-reduce of 2 T4s


def t4_node(count: int = 4, **node) -> dict:
    return {"name": "t4s", "nodes": [{"name": "g4", "device": "T4", "count": count,
                                      **node}]}


def cost_on(doc: dict) -> CostModel:
    return CostModel(synthetic_model(1, fwd_flops_per_sample=1e9), load_cluster(doc))


@pytest.mark.parametrize("k", [2, 4])
def test_allreduce_without_peer_to_peer_is_the_shm_closed_form(k):
    cost = cost_on(t4_node(k))
    devices = [d.name for d in cost.cluster.devices]
    nbytes = 64e6
    expected = 2 * (k - 1) / k * nbytes / SHM_BUS_BYTES_PER_S + 2 * (k - 1) * SHM_STEP_S
    assert cost.allreduce_time_s(devices, nbytes) == pytest.approx(expected, rel=1e-12)


def test_send_without_peer_to_peer_is_the_shm_closed_form():
    cost = cost_on(t4_node(2))
    a, b = (d.name for d in cost.cluster.devices)
    nbytes = 2 * 2**20
    assert cost.transfer_time_s(a, b, nbytes) == pytest.approx(
        SHM_STEP_S + nbytes / SHM_SEND_BYTES_PER_S, rel=1e-12)


def test_a_node_that_declares_peer_to_peer_gets_the_link_at_its_efficiency():
    t4 = builtin_device_types()["T4"]
    cost = cost_on(t4_node(4, peer_to_peer=True))
    devices = [d.name for d in cost.cluster.devices]
    nbytes = 64e6
    bus = t4.link_bandwidth_bytes_per_s * t4.collective_efficiency
    expected = 2 * 3 / 4 * nbytes / bus + 2 * 3 * t4.link_latency_s
    assert cost.allreduce_time_s(devices, nbytes) == pytest.approx(expected, rel=1e-12)
    assert cost_on(t4_node(4)).allreduce_time_s(devices, nbytes) > 2 * expected


def test_catalog_marks_the_parts_without_peer_to_peer():
    types = builtin_device_types()
    assert not any(types[n].peer_to_peer for n in ("T4", "L4", "RTX-3090", "RTX-4090",
                                                   "RTX-2080Ti", "RTX-3080", "RTX-4080"))
    assert all(types[n].peer_to_peer for n in ("A100-80GB", "H100-SXM", "V100-16GB"))


def test_simulated_and_estimated_sync_on_a_host_staged_node():
    """pp 1, dp 4 on one node of 4 T4s, one bucket after the backward: the simulator's
    all-reduce event and the analytic tier's sync phase take the SHM closed form."""
    params = 2_000_000
    model = synthetic_model(2, fwd_flops_per_sample=1e9, params_per_layer=params,
                            activation_bytes_per_sample=0, stash_bytes_per_sample=0)
    cluster = load_cluster(t4_node(4))
    cost = CostModel(model, cluster)
    plan = uniform_plan(model, cluster, pp=1, dp=4, micro_batch=1, global_batch=4
                        ).on_stack(overlap_grad_reduce=False)
    nbytes = 2 * params * cost.grad_bytes_per_param
    expected = 2 * 3 / 4 * nbytes / SHM_BUS_BYTES_PER_S + 2 * 3 * SHM_STEP_S
    sim = simulate(plan, cost, SimOptions(bucket_bytes=1e12, include_optimizer=False))
    (event,) = [e for e in sim.trace.events if e.op == "allreduce"]
    assert event.duration_s == pytest.approx(expected, rel=1e-9)
    est = estimate(plan, cost, bucket_bytes=1e12, include_optimizer=False)
    assert est.iteration_time_s - est.extra["pipeline_s"] == pytest.approx(expected,
                                                                           rel=1e-9)


def test_peer_to_peer_must_be_a_boolean(tmp_path, capsys):
    with pytest.raises(BadInput, match="peer_to_peer"):
        load_cluster(t4_node(4, peer_to_peer="no"))
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(t4_node(4, peer_to_peer=1)))
    assert cli_main(["simulate", "--cluster", str(path), "--model", "gpt2-small",
                     "--pp", "1", "--dp", "4", "--micro-batch", "1",
                     "--global-batch", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "peer_to_peer" in err[0] and "true or false" in err[0]


# ---------------------------------------------------------------- unfused elementwise work

def gpt2_medium(fused: bool):
    return load_model({"kind": "gpt", "vocab_size": 50304, "n_layer": 2, "n_head": 16,
                       "d_model": 1024, "seq_len": 1024, "dtype": "fp16",
                       "attention": "eager", "dropout": 0.1, "fused_elementwise": fused})


@pytest.mark.parametrize("b,t", [(1, 1), (2, 4)])
def test_unfused_chains_add_their_round_trips(b, t):
    """Unfused, each link of a chain reads and writes its tensor: the forward adds the
    mask's pass over the scores (2·S·d, S = b·a·s²/t scores per rank), the MLP's bias
    add (2·F·d, F = b·s·4h/t) and on each of the two residual branches a bias add and a
    dropout of their own (2 x (2·H·d + 2·H·d), H = b·s·h, where the fused kernel reads
    x and the residual and writes once); the backward adds the mask's gradient pass
    (2·S·d); nothing else moves."""
    fused, unfused = gpt2_medium(True), gpt2_medium(False)
    block = next(i for i, layer in enumerate(fused.layers) if layer.kind == "block")
    s, h, a, d = 1024, 1024, 16, 2
    scores, mlp, hidden = b * a * s * s / t, b * s * 4 * h / t, b * s * h
    extra = {"F": 2 * scores * d + 2 * mlp * d + 2 * (2 + 2) * hidden * d,
             "I": 2 * scores * d, "W": 0.0}
    for op, want in extra.items():
        f = layer_work(fused.layers[block], op, b, s, d, t, False)
        u = layer_work(unfused.layers[block], op, b, s, d, t, False)
        assert u.gemms == f.gemms
        assert u.mem_bytes - f.mem_bytes == pytest.approx(want, rel=1e-12)
    # one more kernel per link: the mask, three bias adds (QKV's is in its GEMM)
    config_f, config_u = fused.config, unfused.config
    assert block_launches(config_u, "F") - block_launches(config_f, "F") == 4
    assert block_launches(config_u, "W") == block_launches(config_f, "W")


def test_megatron_fusion_flags_round_trip():
    """Any of Megatron-LM's `--no-*-fusion` switches imports as an unfused model, none
    as a fused one; an unfused model exports with the three switches, a fused one
    with none."""
    from hyperpipe.frameworks.export import megatron_model_args
    from hyperpipe.frameworks.megatron import read_megatron
    line = ("pretrain_gpt.py --num-layers 2 --hidden-size 1024 --num-attention-heads 16 "
            "--seq-length 1024 --max-position-embeddings 1024 --vocab-size 50304 "
            "--micro-batch-size 1 --global-batch-size 8 --fp16")
    assert read_megatron(line, "job.sh").model["fused_elementwise"] is True
    job = read_megatron(line + " --no-masked-softmax-fusion", "job.sh")
    assert job.model["fused_elementwise"] is False
    args = megatron_model_args(gpt2_medium(False), 1, [])
    assert {"--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--no-masked-softmax-fusion"} <= set(args)
    assert not any("fusion" in a for a in megatron_model_args(gpt2_medium(True), 1, []))
