"""AMP's measured runs on 16 T4s, simulated: the stock catalog, then calibrated.

Li et al., "AMP: Automatically Finding Model Parallel Strategies with Heterogeneity
Awareness" (NeurIPS 2022) ran 52 plans of GPT-2 (24 layers, hidden 1024, 16 heads,
sequence 1024, global batch 32, fp16) with Megatron-LM v1.1.5 on DeepSpeed's pipeline
engine on four AWS g4dn.12xlarge (4 NVIDIA T4 each on PCIe, one 50 Gbit/s NIC per node)
and published, per plan, the measured seconds per iteration (5 runs failed) and their
own cost model's prediction (`experiments/data/amp_homogeneous_results.json`, copied
from DachengLi1/AMP with its source).

Pass 1 ("amp"): every plan simulated with the stock catalog and no profile, on the
`megatron-deepspeed` stack with AMP's `fp32_allreduce` (plan runtime
`grad_reduce_dtype: fp32`). Nothing here is fitted to these rows: the T4's figures
come from public sources on the T4 (`hyperpipe.cluster.catalog`).

Pass 2 ("calibrated"): the same plans with the per-layer profile AMP measured on the
same GPUs (`experiments/data/amp_known_cost.json`, AMP's src/known_cost/gpt2_G4_<tp>.npy)
written into HyperPipe's profile format (`amp_profile`). What the numbers mean, from
AMP's cost model (src/cost_homo.py: `cur_profile_cost = 3 * np.load(...)`, "We model
backward time as forward time * 2", `cur_layer = bs * profile_cost[str(mp)][layer]`) and
profiling script (generate_known_cost.py: micro-batch 1, one profile per model-parallel
degree): seconds of one layer's FORWARD for ONE sample on a T4 of a tensor-parallel group
of the file's degree, the layer's tensor-parallel all-reduces included.

Memory verdicts (pass 1) count what the T4 gives a process (14.75 GiB with ECC), the
stage outputs DeepSpeed's engine keeps until each backward (on the last stage the fp32
logits, counted apart from the cross-entropy's softmax as today's Megatron-DeepSpeed
holds them; v1.1.5 shared one buffer: docs/accuracy.md) and the head backward's fp16
copy of the fp32 logit gradient (`CostModel.stage_output_bytes`,
`head_backward_work_bytes`).

Out of sample, the same two passes over the 53 plans AMP ran on its heterogeneous
cluster (`experiments/data/amp_het_cluster_results.json`, from src/results/
het_cluster_results.txt): three p3.8xlarge (4 V100 on NVLink, 10 Gbit/s) and one
g4dn.12xlarge (4 T4), `het_cluster`; the calibrated pass gives the V100s AMP's P3
profiles. Their rows were first read after everything else here was built.

Printed: one row per plan (measured, AMP's prediction, both passes, memory verdicts),
AMP's own prediction as the peer model, the heterogeneous block's line

    amp_het_mape=X amp_het_tau=T amp_het_peer_mape=Y amp_het_peer_tau=U
    amp_het_null_mape=N amp_het_calibrated_mape=Z amp_het_calibrated_tau=V
    amp_het_failed_predicted=K/M amp_het_false_alarms=F amp_het_n_rows=R

(null: every run at the block's mean measured time), and a last line

    amp_mape=X amp_tau=T amp_peer_mape=Y amp_peer_tau=U calibrated_mape=Z
    calibrated_tau=V failed_predicted=K/N n_rows=R

(fractions; MAPE and Kendall's tau-a over the rows that ran; failed_predicted: the failed
runs that a pass-1 simulation predicts out of memory or refuses).

Run: python experiments/published_hetero.py
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hyperpipe.cluster.cluster import Cluster, cluster_ref, load_cluster
from hyperpipe.core.errors import BadInput, InfeasiblePlan
from hyperpipe.frameworks.megatron import GPT2_VOCAB, VOCAB_DIVISIBLE_BY, padded_vocab
from hyperpipe.models import ModelSpec, load_model
from hyperpipe.plan.plan import Plan, plan_from_dict
from hyperpipe.plan.profile import Fit, Profile
from hyperpipe.sim.accuracy import kendall_tau, mape
from hyperpipe.sim.costmodel import CostModel, op_flops
from hyperpipe.sim.simulator import SimOptions, simulate

DATA = Path(__file__).resolve().parent / "data"
RUNS_FILE = DATA / "amp_homogeneous_results.json"
HET_RUNS_FILE = DATA / "amp_het_cluster_results.json"
PROFILE_FILE = DATA / "amp_known_cost.json"
GLOBAL_BATCH = 32
NODES, PER_NODE = 4, 4
# GPT-2's BPE vocabulary (50,257) is padded as Megatron-LM v1.1.5 pads it: to a multiple
# of 128 x the model-parallel size (megatron/tokenizer/tokenizer.py
# `_vocab_size_with_padding`, `--make-vocab-size-divisible-by 128`; `model_for`).
DS_LAYERS = 30      # DeepSpeed's pipeline layers: embedding, no-op, 24 blocks, 2, head, 1
OPTIONS = SimOptions(trace=False)


@dataclass(frozen=True)
class Row:
    """One of AMP's plans: its layout, AMP's prediction and the measured time (None:
    the run failed)."""

    trial: int
    micro_batch: int
    tp: int
    dp: int
    pp: int
    partition: tuple[int, ...]
    amp_predicted_s: float
    measured_s: float | None


def load_rows(path: Path = RUNS_FILE) -> list[Row]:
    doc = json.loads(path.read_text())
    return [Row(r["trial"], r["micro_batch"], r["tp"], r["dp"], r["pp"],
                tuple(r["partition"]), r["amp_predicted_s"], r["measured_s"])
            for r in doc["rows"]]


def model_for(tp: int) -> ModelSpec:
    """GPT-2 medium as AMP's Megatron-LM v1.1.5 trains it: learned positions, GeLU,
    biases, dropout 0.1, eager attention, tied output embedding, and no elementwise
    fusion: that version's `--scaled-upper-triang-masked-softmax-fusion`,
    `--scaled-masked-softmax-fusion`, `--bias-gelu-fusion` and `--bias-dropout-fusion`
    are opt-in switches (megatron/arguments.py, `action='store_true'`) that AMP's launch
    script (examples/ds_pretrain_gpt2_pipe.sh, run by amp_utils.py `simulate`) does not
    pass."""
    return load_model({"kind": "gpt", "name": f"gpt2-medium-amp-tp{tp}",
                       "vocab_size": padded_vocab(GPT2_VOCAB, VOCAB_DIVISIBLE_BY, tp),
                       "n_layer": 24, "n_head": 16,
                       "d_model": 1024, "seq_len": 1024, "dtype": "fp16",
                       "attention": "eager", "dropout": 0.1, "tie_embeddings": True,
                       "fused_elementwise": False})


def g4dn_cluster() -> Cluster:
    """Four g4dn.12xlarge: 4 T4 on PCIe (the catalog's T4 link, without peer-to-peer:
    NCCL stages through host memory) and one 50 Gbit/s NIC each (AWS EC2 G4 instance
    specifications)."""
    return load_cluster({
        "name": "g4dn-12xlarge-x4",
        "nodes": [{"name": "g4dn", "device": "T4", "count": PER_NODE, "repeat": NODES}],
        "inter_node": {"bandwidth": "50 Gbit/s"}})


def het_cluster() -> Cluster:
    """AMP's heterogeneous cluster (src/het_cluster.py `cluster_info`, node i holding
    ranks 4i..4i+3): three p3.8xlarge (4 V100-SXM2-16GB on NVLink; "up to 10 Gigabit"
    network, AWS EC2 P3 instance specifications) and one g4dn.12xlarge (4 T4 on PCIe, 50
    Gbit/s); a transfer between nodes runs at the slower end's NIC."""
    return load_cluster({
        "name": "p3-8xlarge-x3-g4dn-12xlarge",
        "nodes": [{"name": "p3-", "device": "V100-16GB", "count": PER_NODE, "repeat": 3,
                   "nic": {"bandwidth": "10 Gbit/s"}},
                  {"name": "g4dn", "device": "T4", "count": PER_NODE,
                   "nic": {"bandwidth": "50 Gbit/s"}}],
        "inter_node": {"bandwidth": "50 Gbit/s"}})


def hp_boundary(ds: int, n_blocks: int = 24) -> int:
    """A stage boundary over DeepSpeed's 30 layers as one over HyperPipe's embedding,
    blocks and head: DeepSpeed layers 0-1 are the embedding (and a no-op), 2..25 the
    blocks, 26-27 a no-op and the final norm (HyperPipe's head holds it), 28 the head,
    29 a no-op."""
    if ds <= 0:
        return 0
    if ds <= 2:
        return 1
    return min(ds - 1, n_blocks + 1) if ds <= 26 else (n_blocks + 1 if ds <= 28
                                                       else n_blocks + 2)


def plan_for(row: Row, model: ModelSpec, cluster: Cluster) -> Plan:
    """The row's plan on DeepSpeed's topology (`PipeModelDataParallelTopology`: rank =
    (stage · dp + replica) · tp + tp rank, four ranks per node). A DeepSpeed stage that
    holds only no-ops maps to no HyperPipe layer: it is left out (its GPU idles)."""
    bounds = [hp_boundary(b) for b in row.partition]
    devices = [d.name for d in cluster.devices]
    pipelines = []
    for r in range(row.dp):
        stages = []
        for k in range(row.pp):
            a, b = bounds[k], bounds[k + 1]
            if a == b:
                continue
            first = (k * row.dp + r) * row.tp
            stages.append({"layers": [a, b], "devices": devices[first:first + row.tp],
                           "tp": row.tp})
        pipelines.append({"micro_batch": row.micro_batch, "stages": stages,
                          "num_microbatches": GLOBAL_BATCH // row.dp // row.micro_batch})
    return plan_from_dict({"format": "hyperpipe.plan/1", "model": model.to_dict(),
                           "cluster": cluster_ref(cluster), "global_batch": GLOBAL_BATCH,
                           "schedule": {"kind": "1f1b"}, "stack": "megatron-deepspeed",
                           "runtime": {"grad_reduce_dtype": "fp32"},
                           "pipelines": pipelines})


def simulate_row(row: Row, cluster: Cluster, profile: Profile | None = None
                 ) -> tuple[float | None, str]:
    """(predicted seconds or None, verdict: "fits (peak GB)", "out of memory (...)" or
    "refused: WHY")."""
    model = model_for(row.tp)
    try:
        plan = plan_for(row, model, cluster)
        m = simulate(plan, CostModel(model, cluster, profile), OPTIONS).metrics
    except (BadInput, InfeasiblePlan) as exc:
        return None, f"refused: {exc}"
    peak_gb = max(m.peak_memory_bytes.values()) / 1e9
    if m.refused is not None:
        return m.iteration_time_s, f"refused: {m.refused}"
    if m.oom:
        return m.iteration_time_s, f"out of memory ({len(m.oom)} GPUs, peak {peak_gb:.1f} GB)"
    return m.iteration_time_s, f"fits (peak {peak_gb:.1f} GB)"


# AMP's 30 profiled layers grouped by the HyperPipe layer that holds them (`hp_boundary`)
AMP_KINDS = {"embedding": range(0, 2), "block": range(2, 26), "head": range(26, 30)}
# AMP's profiles per device type: the file prefix (G4: g4dn's T4, P3: p3's V100) and the
# tensor-parallel degrees profiled; a degree without one takes the largest below it
AMP_PROFILES = {"T4": ("G4", (1, 2)), "V100-16GB": ("P3", (1, 2, 4))}


def amp_profile(tp: int, cluster: Cluster) -> Profile:
    """AMP's per-layer profile of one tensor-parallel degree in HyperPipe's format.

    AMP measured one micro-batch size (1) per layer: its forward seconds on a T4 of a
    tensor-parallel group, the group's all-reduces included (`AMP_KINDS` groups the 30
    layers; the 24 blocks by their mean). AMP's cost model reads the backward as twice
    the forward, collectives included; here twice the forward's compute (the measured
    forward less the stock model's collectives), plus the backward's own collectives,
    which the simulator prices: Megatron's tensor-parallel regions all-reduce once
    forward and once backward (`RowParallelLinear`'s output, `ColumnParallelLinear`'s
    input gradient), so a block's backward has as many all-reduces as its forward, not
    twice as many. One point cannot split a per-action cost from a per-FLOP one, so the
    per-FLOP slope is the stock cost model's at that point (its compute seconds per
    FLOP, micro-batch 1) and the intercept is what the measured compute has beyond the
    stock estimate: at micro-batch 1 a layer's forward costs exactly what AMP measured,
    and it grows with the micro-batch as the stock model says compute grows. T4
    profiles exist for tp 1 and 2 (src/known_cost has no G4_4 in the public
    repository; DeepSpeed/.../known_cost/gpt2_G4_4.npy there is binary and was not
    read): tp 4 takes the tp-2 profile (a block's forward did
    not shrink from tp 1 to tp 2 but grew, 5.47 to 5.96 ms). The V100's (P3) cover tp
    1, 2 and 4, which tests that rule where it can be: holding the tp-2 block (5.24 ms)
    reads tp 4 16% slow (4.52 measured), scaling it by the stock model's tp-4/tp-2
    ratio 16% fast (3.79); neither is better, so the simpler rule stays. Each device
    type of `cluster` gets its own."""
    doc = json.loads(PROFILE_FILE.read_text())["profiles"]
    model = model_for(tp)
    stock = CostModel(model, cluster)
    compute = {}
    for device, (prefix, degrees) in AMP_PROFILES.items():
        members = [d.name for d in cluster.devices if d.type.name == device]
        if not members:
            continue
        measured = doc[f"gpt2_{prefix}_{max(d for d in degrees if d <= tp)}"]
        group = tuple(members[:tp])
        for kind, ds_layers in AMP_KINDS.items():
            fwd_s = sum(measured[i] for i in ds_layers)
            if kind == "block":
                fwd_s /= len(ds_layers)
            layer = next(i for i, spec in enumerate(model.layers) if spec.kind == kind)
            # the forward's own compute: the measurement less its all-reduces
            own_f_s = fwd_s - stock.tp_comm_s((layer, layer + 1), group, 1, "F")
            for op, own_s in (("F", own_f_s), ("B", 2 * own_f_s)):
                flops = op_flops(model, layer, 1, op) / tp
                compute_s = stock.layer_time_s(layer, device, 1, op, tp)
                slope = compute_s / flops if flops > 0 else 0.0     # the embedding: none
                compute[Profile.key(device, kind, op)] = Fit(own_s - slope * flops, slope,
                                                             samples=1)
    return Profile(compute=compute, provenance={
        "source": "DachengLi1/AMP src/known_cost/gpt2_{G4,P3}_*.npy (experiments/data/"
                  "amp_known_cost.json)", "model": model.name})


def table(rows: list[Row], cluster: Cluster) -> tuple[list, list]:
    """Print one line per row (measured, AMP's prediction, both passes, the stock pass's
    memory verdict); return (rows that ran, rows that failed), each as (row, stock,
    calibrated, verdict)."""
    print(f"{'trial':>5} {'mb':>3} {'tp':>2} {'dp':>2} {'pp':>2} {'measured':>8} "
          f"{'AMP':>7} {'stock':>7} {'calib':>7}  stock memory verdict")
    profiles = {tp: amp_profile(tp, cluster) for tp in sorted({r.tp for r in rows})}
    ran, failed = [], []
    for row in rows:
        stock, verdict = simulate_row(row, cluster)
        calib, _ = simulate_row(row, cluster, profiles[row.tp])
        shown = "failed" if row.measured_s is None else f"{row.measured_s:8.2f}"
        print(f"{row.trial:5d} {row.micro_batch:3d} {row.tp:2d} {row.dp:2d} {row.pp:2d} "
              f"{shown:>8} {row.amp_predicted_s:7.2f} "
              f"{stock if stock is not None else float('nan'):7.2f} "
              f"{calib if calib is not None else float('nan'):7.2f}  {verdict}")
        (failed if row.measured_s is None else ran).append((row, stock, calib, verdict))
    return ran, failed


@dataclass(frozen=True)
class Figures:
    """One block's MAPE and Kendall's tau over the rows that ran: the stock pass, AMP's
    own model (the peer), the calibrated pass and the mean measured time (a null); the
    failed runs, those the stock pass predicts out of memory or refuses, and the runs
    that ran but were predicted not to."""

    mape: float
    tau: float
    peer_mape: float
    peer_tau: float
    calibrated_mape: float
    calibrated_tau: float
    mean_null_mape: float
    failed: int
    predicted_failed: int
    false_alarms: int


def figures(ran: list, failed: list) -> Figures:
    """The `Figures` of a block, from `table`'s two lists."""
    meas = [r.measured_s for r, *_ in ran]
    stock = [s for _, s, _, _ in ran]
    calib = [c for _, _, c, _ in ran]
    peer = [r.amp_predicted_s for r, *_ in ran]
    return Figures(mape(stock, meas), kendall_tau(stock, meas), mape(peer, meas),
                   kendall_tau(peer, meas), mape(calib, meas), kendall_tau(calib, meas),
                   mape([sum(meas) / len(meas)] * len(meas), meas), len(failed),
                   sum(1 for *_, v in failed if not v.startswith("fits")),
                   sum(1 for *_, v in ran if not v.startswith("fits")))


def main() -> int:
    print("seconds per iteration: measured, AMP's prediction, HyperPipe stock catalog "
          "(no profile), HyperPipe with AMP's per-layer profile")
    rows = load_rows()
    ran, failed = table(rows, g4dn_cluster())
    f = figures(ran, failed)
    print(f"failed runs: {f.failed}; predicted out of memory or refused: "
          f"{f.predicted_failed}; runs that ran but were predicted not to: {f.false_alarms}")
    print(f"AMP's own cost model (peer): mape={f.peer_mape:.4f} tau={f.peer_tau:.4f}")
    # out of sample: AMP's heterogeneous cluster, never looked at while building the
    # model (nothing here is fitted to either file)
    print("\nout of sample, AMP's heterogeneous cluster (3 x p3.8xlarge: 4 V100 each, "
          "10 Gbit/s; 1 x g4dn.12xlarge: 4 T4, 50 Gbit/s):")
    het_rows = load_rows(HET_RUNS_FILE)
    h = figures(*table(het_rows, het_cluster()))
    print(f"amp_het_mape={h.mape:.4f} amp_het_tau={h.tau:.4f} "
          f"amp_het_peer_mape={h.peer_mape:.4f} amp_het_peer_tau={h.peer_tau:.4f} "
          f"amp_het_null_mape={h.mean_null_mape:.4f} "
          f"amp_het_calibrated_mape={h.calibrated_mape:.4f} "
          f"amp_het_calibrated_tau={h.calibrated_tau:.4f} "
          f"amp_het_failed_predicted={h.predicted_failed}/{h.failed} "
          f"amp_het_false_alarms={h.false_alarms} amp_het_n_rows={len(het_rows)}")
    print(f"amp_mape={f.mape:.4f} amp_tau={f.tau:.4f} "
          f"amp_peer_mape={f.peer_mape:.4f} amp_peer_tau={f.peer_tau:.4f} "
          f"calibrated_mape={f.calibrated_mape:.4f} calibrated_tau={f.calibrated_tau:.4f} "
          f"failed_predicted={f.predicted_failed}/{f.failed} n_rows={len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
