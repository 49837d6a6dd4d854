"""Search quality: the searched plan against the uniform and proportional baselines.

For every (heterogeneous cluster, model) pair, `hyperpipe.search.search` finds a plan and
tunes both baselines over the same (pp, dp, tp, micro-batch) grid; all three are
simulated by the same SimPy simulator. The table gives simulated iteration times and the
speed-up of the best plan over each baseline; the last line is
``min_speedup=A geomean_speedup=B`` (best over uniform). Target (issue 5): B >= 1.3.

    python experiments/search_quality.py [--workers 2] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from hyperpipe.cluster.cluster import cluster_from_dict, load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.report import describe_plan
from hyperpipe.search.search import SearchConstraints, search

# Clusters beyond the built-ins, inline so the study is self-contained.
EXTRA_CLUSTERS = {
    # two types 2.4x apart in peak FLOP/s (756 vs 312 TFLOP/s), NVLink inside each node
    "h100pcie-a100": {
        "nodes": [{"name": "h100p", "device": "H100-PCIe", "count": 8},
                  {"name": "a100", "device": "A100-80GB", "count": 8, "repeat": 2}],
        "inter_node": {"bandwidth": "200 Gbit/s", "latency": "5 us"},
    },
    # a slow inter-node link: two A100 nodes and two V100 nodes over 25 Gbit/s Ethernet
    "a100-v100-slow": {
        "nodes": [{"name": "a", "device": "A100-40GB", "count": 8, "repeat": 2},
                  {"name": "v", "device": "V100-32GB", "count": 8, "repeat": 2}],
        "inter_node": {"bandwidth": "25 Gbit/s", "latency": "10 us"},
    },
    # a three-type consumer/datacenter mix: RTX 4090 and A10 boxes beside one A100 node
    "a100-4090-a10": {
        "nodes": [{"name": "a100", "device": "A100-80GB", "count": 8},
                  {"name": "rtx", "device": "RTX-4090", "count": 8},
                  {"name": "a10", "device": "A10", "count": 8}],
        "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"},
    },
}
CLUSTERS = ["a100-v100", "h100-a100-l4", *EXTRA_CLUSTERS]
MODELS = ["gpt2-xl", "gpt3-6.7b", "llama2-13b"]
GLOBAL_BATCH = 256


def _cluster(name: str):
    if name in EXTRA_CLUSTERS:
        return cluster_from_dict(EXTRA_CLUSTERS[name], where=f"cluster {name}", name=name)
    return load_cluster(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    ap.add_argument("--quick", action="store_true", help="first model only")
    args = ap.parse_args()
    models = MODELS[:1] if args.quick else MODELS
    print(f"{'cluster':<15} {'model':<11} {'best':>9} {'uniform':>9} {'proport.':>9} "
          f"{'vs uni':>7} {'vs prop':>7} {'search':>7}  best plan")
    speedups = []
    for cname in CLUSTERS:
        cluster = _cluster(cname)
        for mname in models:
            model = load_model(mname)
            t0 = time.perf_counter()
            res = search(model, cluster, SearchConstraints(global_batch=args.global_batch),
                         top=3, workers=args.workers)
            took = time.perf_counter() - t0
            best = res.best.metrics.iteration_time_s
            uni = res.baselines["uniform"].metrics
            prop = res.baselines["proportional"].metrics
            if uni.oom:
                print(f"{cname:<15} {mname:<11} uniform baseline out of memory: skipped",
                      file=sys.stderr)
                continue
            s_uni = uni.iteration_time_s / best
            s_prop = prop.iteration_time_s / best if not prop.oom else math.nan
            speedups.append(s_uni)
            print(f"{cname:<15} {mname:<11} {best:9.3f} {uni.iteration_time_s:9.3f} "
                  f"{prop.iteration_time_s:9.3f} {s_uni:6.2f}x {s_prop:6.2f}x {took:6.1f}s  "
                  f"{describe_plan(res.best.plan, cluster)[:90]}", flush=True)
    if not speedups:
        print("no comparable case", file=sys.stderr)
        return 1
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    print("iteration times in seconds, simulated; speed-up = baseline time / best time")
    print(f"min_speedup={min(speedups):.3f} geomean_speedup={geo:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
