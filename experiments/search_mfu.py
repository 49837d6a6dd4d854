"""Search MFU: GPT-3 175B on 1024 A100-80GB (issue 9), against the published ranges.

The issue's ranges come from Megatron-LM's own runs on A100s: about 33-40% MFU with
full recompute (Narayanan et al. SC'21, Table 1: 135-163 TFLOP/s of hardware FLOPs per
GPU, about 33-40% MFU; Korthikanti et al. 2022, table 5: GPT-3 175B at 40.0%) and about 50-55%
with selective recompute and sequence parallelism (Korthikanti, table 5: 175B at 52.8%;
both MFUs from the iteration times in `published.py`). All were run on the stack of the
time: eager attention, fp16, dropout 0.1, vocabulary 51,200, tp 8, and no distributed
optimizer (it reached Megatron-LM after those papers).

The search is run on the built-in `a100-1024` cluster (128 DGX A100, one 200 Gbit/s NIC
per GPU), global batch 1536 (GPT-3's 3.2M tokens), once per case:

* `megatron-2022`: that stack, as a model file and `distributed_optimizer=False`;
  recompute fixed to full, then to selective with sequence parallelism; then both again
  with Megatron's tensor-parallel degree (8) fixed as well;
* `current`: the `gpt3-175b` preset (FlashAttention, bf16, no dropout), every memory
  option left to the search, then recompute fixed to full.

One line per case (the pick's layout, time, MFU and the published range when the case
has one), then ``in_range=K of N``. Nothing here is fitted: stock catalog, no profile.

    python experiments/search_mfu.py [--cases megatron-2022-full,current]
"""

from __future__ import annotations

import argparse
import sys
import time

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.search import SearchConstraints, search

# Megatron-LM's GPT-3 175B (Narayanan et al. 2021, Table 1): 96 layers, 96 heads,
# hidden 12288, sequence 2048, vocabulary 51,200; the stack of 2021-22 (see above).
MEGATRON_2022 = {"kind": "gpt", "name": "gpt3-175b-megatron-2022", "vocab_size": 51200,
                 "n_layer": 96, "n_head": 96, "d_model": 12288, "seq_len": 2048,
                 "dtype": "fp16", "attention": "eager", "dropout": 0.1}

# case -> (model, constraints beyond the batch, published MFU range or None)
CASES = {
    "megatron-2022-full": (MEGATRON_2022, {"recompute": "full",
                                           "distributed_optimizer": False}, (0.33, 0.40)),
    "megatron-2022-selective": (MEGATRON_2022, {"recompute": "selective",
                                                "sequence_parallel": True,
                                                "distributed_optimizer": False},
                                (0.50, 0.55)),
    # the same with Megatron's tensor-parallel degree, 8 (one DGX node)
    "megatron-2022-full-tp8": (MEGATRON_2022, {"recompute": "full", "tp": 8,
                                               "distributed_optimizer": False},
                               (0.33, 0.40)),
    "megatron-2022-selective-tp8": (MEGATRON_2022, {"recompute": "selective", "tp": 8,
                                                    "sequence_parallel": True,
                                                    "distributed_optimizer": False},
                                    (0.50, 0.55)),
    "current": ("gpt3-175b", {}, None),
    "current-full": ("gpt3-175b", {"recompute": "full"}, None),
}


def describe(plan) -> str:
    """tp x pp x dp, schedule, micro-batch and memory options of a plan."""
    stages = [s for p in plan.pipelines for s in p.stages]
    tps = sorted({s.tp for s in stages})
    pp = len(plan.pipelines[0].stages) // plan.chunks
    rec = "/".join(sorted({s.recompute for s in stages}))
    sp = "+SP" if any(s.sequence_parallel for s in stages) else ""
    opt = " dist-opt" if plan.distributed_optimizer else ""
    return (f"tp {'/'.join(map(str, tps))} pp {pp} dp {len(plan.pipelines)} "
            f"{plan.schedule} v={plan.chunks} mb {plan.pipelines[0].micro_batch} "
            f"{rec}{sp}{opt}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"search_mfu: --cases: expected names of {', '.join(CASES)}, got {unknown}",
              file=sys.stderr)
        return 2
    cluster = load_cluster("a100-1024")
    in_range = checked = 0
    for name in names:
        ref, fixed, published = CASES[name]
        model = load_model(ref)
        t0 = time.perf_counter()
        result = search(model, cluster, SearchConstraints(global_batch=args.global_batch,
                                                          **fixed),
                        top=1, workers=args.workers, progress=sys.stderr.isatty())
        best = result.best
        m = best.metrics
        line = (f"{name:24s} {describe(best.plan)}: {m.iteration_time_s:.2f} s, "
                f"MFU {m.mfu:.1%}, fits {not m.oom}, search {time.perf_counter() - t0:.0f} s")
        if published is not None:
            ok = published[0] <= m.mfu <= published[1] and not m.oom
            checked += 1
            in_range += ok
            line += (f"; published {published[0]:.0%}-{published[1]:.0%}: "
                     f"{'in range' if ok else 'OUT of range'}")
        print(line, flush=True)
    print(f"in_range={in_range} of {checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
