"""One model on many GPUs: Lambda's measured BERT-Large training throughput, simulated.

The stock catalog's compute model (GEMM curves, memory-bound kernels, per-dtype peaks)
checked across GPU generations and classes, consumer parts included, against runs
nobody here produced: Lambda's single-GPU benchmarks (public repository
lambdal/deeplearning-benchmark; rows, commits and what they mean in
`experiments/data/lambda_bert_large_squad.json`) of NVIDIA DeepLearningExamples'
BERT-Large SQuAD fine-tuning, sequence 384, apex AMP O2 (fp16), one step per batch;
and, on the parts without TF32 (Volta, Turing), the same in fp32.

The model, read off DeepLearningExamples' PyTorch/LanguageModeling/BERT/modeling.py:
24 blocks of hidden 1024, 16 heads, GeLU MLP of 4096, biases, learned positions,
dropout 0.1, eager attention (`torch.matmul`, then scale, mask add, softmax and dropout
as separate kernels, and dropout then residual add before each LayerNorm:
`fused_elementwise: false`; its bias+GeLU is one scripted kernel and its linear biases
ride in the GEMM, which that setting prices as separate passes, a slight over-count).
The head is SQuAD's 1024 x 2 projection: the vocabulary is set to 2 so that the
spec's tied head is that projection, which leaves the 31M-parameter word embedding
out of the optimizer step (about 9% of the parameters; the step is 0.7-9.4% of an
iteration here, so under 1% of it is left out). apex O2 keeps fp16 weights and
gradients and fp32 master weights and moments: the spec's default "mixed" state; the
fp32 rows are the model in fp32 (priced at the part's fp32 peak). Each row is one
device, one stage, one micro-batch of the row's batch, the optimizer step included.

Null models, each out of sample (leave one out): every GPU at the mean fraction of
its peak in the row's precision that the other GPUs of the block reached
(`null_peak`), and at the mean throughput per byte/s of memory bandwidth of the others
(`null_bandwidth`).

Caveats. The measured figure is end to end over 100 steps or more (the first, slow
ones included) and truncated to an integer; batches differ by GPU (the largest that fit
Lambda's template for the card's memory). The two tables ran different software
(NGC 22.09 against 20.01/20.10: the same RTX 3090 reads 52 and 47), so each fp16 table
is scored on its own; the seven fp32 rows (the Volta and Turing parts of both tables)
are one block. Nothing here is fitted to these rows; they were first simulated after the
catalog figures they test were in place.

Printed: one line per row, then per table

    bert_gpus_mape=X bert_gpus_max_ape=M bert_gpus_tau=T bert_gpus_null_peak_mape=P
    bert_gpus_null_bandwidth_mape=B n_rows=N n_oom=K

(prefix `bert_gpus_2020_` for the older fp16 table, `bert_gpus_fp32_` for the fp32
rows; fractions, four decimals; tau: Kendall's tau-a of predicted against measured
throughput).

Run: python experiments/published_gpus.py
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hyperpipe.cluster.cluster import Cluster, cluster_ref, load_cluster
from hyperpipe.models import ModelSpec, load_model
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.sim.accuracy import kendall_tau, mape, relative_error
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate

DATA = Path(__file__).resolve().parent / "data" / "lambda_bert_large_squad.json"
SEQ = 384
# (line prefix, table or None for every table, precision), in the order printed
BLOCKS = (("bert_gpus", "ngc-22.09", "fp16"), ("bert_gpus_2020", "ngc-20.01", "fp16"),
          ("bert_gpus_fp32", None, "fp32"))
OPTIONS = SimOptions(trace=False)


@dataclass(frozen=True)
class Row:
    """One GPU's measured run: the catalog device, sequences per step and per second,
    the table (software era) and the precision (fp16 or fp32)."""

    name_gpu: str
    device: str
    batch: int
    seq_per_s: float
    table: str
    precision: str


@dataclass(frozen=True)
class Predicted:
    """A row simulated: predicted sequences per second, peak memory and whether it
    fits."""

    row: Row
    seq_per_s: float
    peak_gb: float
    fits: bool


def load_rows(path: Path = DATA) -> list[Row]:
    return [Row(r["name_gpu"], r["device"], r["batch"], float(r["seq_per_s"]), r["table"],
                r["precision"]) for r in json.loads(path.read_text())["rows"]]


def bert_large(dtype: str = "fp16") -> ModelSpec:
    """BERT-Large as DeepLearningExamples' SQuAD fine-tuning runs it (module doc)."""
    return load_model({"kind": "gpt", "name": "bert-large-squad", "vocab_size": 2,
                       "n_layer": 24, "n_head": 16, "d_model": 1024, "seq_len": SEQ,
                       "dtype": dtype, "attention": "eager", "dropout": 0.1,
                       "fused_elementwise": False})


def one_gpu(device: str) -> Cluster:
    return load_cluster({"name": f"one-{device}",
                         "nodes": [{"name": "gpu", "device": device, "count": 1}]})


def simulate_row(row: Row, model: ModelSpec) -> Predicted:
    cluster = one_gpu(row.device)
    plan = plan_from_dict({
        "format": "hyperpipe.plan/1", "model": model.to_dict(),
        "cluster": cluster_ref(cluster), "global_batch": row.batch,
        "schedule": {"kind": "1f1b"},
        "pipelines": [{"micro_batch": row.batch, "num_microbatches": 1, "stages": [
            {"layers": [0, model.num_layers], "devices": [cluster.devices[0].name]}]}]})
    m = simulate(plan, CostModel(model, cluster), OPTIONS).metrics
    return Predicted(row, row.batch / m.iteration_time_s,
                     max(m.peak_memory_bytes.values()) / 1e9, not m.oom)


def leave_one_out(rows: list[Row], scale) -> list[float]:
    """Each row's throughput at the mean measured throughput per unit of `scale(row)`
    of the other rows."""
    out = []
    for i, row in enumerate(rows):
        others = [r.seq_per_s / scale(r) for j, r in enumerate(rows) if j != i]
        out.append(scale(row) * sum(others) / len(others))
    return out


def block(rows: list[Row], key: str, model: ModelSpec) -> None:
    """Print a table's rows and its figures line (module doc)."""
    catalog = {r.device: one_gpu(r.device).device_types[r.device] for r in rows}
    got = [simulate_row(r, model) for r in rows]
    peak = leave_one_out(rows, lambda r: catalog[r.device].peaks.get(
        r.precision, catalog[r.device].peak_flops))
    band = leave_one_out(rows, lambda r: catalog[r.device].mem_bandwidth_bytes_per_s)
    print(f"{'GPU':>22} {'device':>11} {'table':>9} {'batch':>5} {'measured':>8} "
          f"{'predicted':>9} "
          f"{'error':>8} {'null peak':>9} {'null bw':>8}  memory")
    for p, np_, nb in zip(got, peak, band, strict=True):
        r = p.row
        print(f"{r.name_gpu:>22} {r.device:>11} {r.table:>9} {r.batch:5d} {r.seq_per_s:8.1f} "
              f"{p.seq_per_s:9.1f} {p.seq_per_s / r.seq_per_s - 1:+8.4f} "
              f"{np_ / r.seq_per_s - 1:+9.4f} {nb / r.seq_per_s - 1:+8.4f}  "
              f"{'fits' if p.fits else 'OUT OF MEMORY'} ({p.peak_gb:.1f} GB)")
    meas = [r.seq_per_s for r in rows]
    pred = [p.seq_per_s for p in got]
    print(f"{key}_mape={mape(pred, meas):.4f} "
          f"{key}_max_ape={max(map(relative_error, pred, meas)):.4f} "
          f"{key}_tau={kendall_tau(pred, meas):.4f} "
          f"{key}_null_peak_mape={mape(peak, meas):.4f} "
          f"{key}_null_bandwidth_mape={mape(band, meas):.4f} "
          f"n_rows={len(rows)} n_oom={sum(not p.fits for p in got)}")


def main() -> int:
    rows = load_rows()
    for key, table, precision in BLOCKS:
        print(f"\nBERT-Large SQuAD fine-tuning, {precision}, one GPU, "
              f"{'table ' + table if table else 'both tables'} "
              "(sequences per second; errors as predicted / measured - 1):")
        block([r for r in rows if r.precision == precision and table in (None, r.table)],
              key, bert_large(precision))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
