"""Search scale: GPT-3 175B on the built-in 1,024-GPU four-type cluster and on the
8,192-GPU two-type cluster.

Per cluster, the search runs in a process of its own (so that its peak memory is its
own), with a progress bar on a terminal; the script prints the phases and the best
plan, then one line per cluster:
``cluster=C devices=N search_time_s=T peak_rss_bytes=R candidates=K``. Targets on 2
cores: T <= 30 s at 1,024 GPUs, T <= 300 s and R <= 8 GB at 8,192, each with a valid,
memory-feasible plan. R is the search process's peak resident set plus its largest
worker's (an upper bound on what they held at once).

With ``--node-removed``: the 1,024-GPU cluster is also searched without one node of
each device class (re-plans, as `whatif --failures` does); the last line compares the
best of them with the whole cluster's pick, which may leave any node idle itself:
``node_removed_best_samples_per_s=X pick_samples_per_s=Y pick_at_least_as_fast=B``.

    python experiments/search_scale.py [--model llama2-70b] [--workers 2]
        [--clusters scale-1024 h100-a100-8192] [--node-removed]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import time

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.report import describe_plan, format_search
from hyperpipe.search.search import SearchConstraints, search
from hyperpipe.search.space import device_classes
from hyperpipe.sim.costmodel import CostModel

CLUSTERS = ("scale-1024", "h100-a100-8192")


def _run(args, cluster_name: str, without: str | None, out) -> None:
    """One search (in a child process): sends back its text, figures and pick."""
    model, cluster = load_model(args.model), load_cluster(cluster_name)
    if without is not None:
        from hyperpipe.whatif.failures import without_node
        cluster = without_node(cluster, without)
    t0 = time.perf_counter()
    result = search(model, cluster, SearchConstraints(global_batch=args.global_batch),
                    top=3, workers=args.workers, progress=sys.stderr.isatty())
    wall = time.perf_counter() - t0
    best = result.best
    best.plan.check(model, cluster)                # valid ...
    text = "" if without is not None else format_search(result, CostModel(model, cluster))
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # KiB on Linux
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    out.send({"text": text, "oom": best.metrics.oom[:4], "time_s": result.search_time_s,
              "wall_s": wall, "rss": own + workers, "candidates": result.candidates_evaluated,
              "devices": len(cluster.devices), "used": len(best.plan.devices),
              "samples_per_s": best.metrics.throughput_samples_per_s,
              "plan": describe_plan(best.plan, cluster)})


def _search(args, cluster_name: str, without: str | None = None) -> dict:
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run, args=(args, cluster_name, without, send))
    proc.start()
    got = recv.recv()
    proc.join()
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    # GPT-3 175B trained with 3.2M-token batches: 1536 sequences of 2048 (Brown et al.
    # 2020, table 2.1)
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--node-removed", action="store_true",
                    help="also re-plan scale-1024 without one node of each class")
    args = ap.parse_args()
    lines, status = [], 0
    picks = {}
    for name in args.clusters:
        got = _search(args, name)
        if got["oom"]:                             # ... and memory-feasible
            print(f"{name}: best plan is out of memory on {got['oom']}", file=sys.stderr)
            status = 1
        sys.stdout.write(got["text"])
        print(f"devices used by the best plan: {got['used']} of {got['devices']}",
              flush=True)
        picks[name] = got
        lines.append(f"cluster={name} devices={got['devices']} "
                     f"search_time_s={got['time_s']:.1f} peak_rss_bytes={got['rss']} "
                     f"candidates={got['candidates']}")
    if args.node_removed:
        name = "scale-1024"
        pick = picks.get(name) or _search(args, name)
        removed = []
        for cls in device_classes(load_cluster(name)).values():
            got = _search(args, name, cls.nodes[0])
            print(f"without {cls.nodes[0]} ({cls.name}): {got['samples_per_s']:.3f} "
                  f"samples/s in {got['time_s']:.1f} s: {got['plan'][:120]}", flush=True)
            removed.append(got["samples_per_s"])
        lines.append(f"node_removed_best_samples_per_s={max(removed):.3f} "
                     f"pick_samples_per_s={pick['samples_per_s']:.3f} "
                     f"pick_at_least_as_fast={pick['samples_per_s'] >= max(removed)}")
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
