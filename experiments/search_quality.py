"""Search quality: the search's own pick against the strongest alternatives a user has.

For every (heterogeneous cluster, model) case, `hyperpipe.search.search` returns its pick
and, beside it, the tuned `uniform` and `proportional` baselines (Megatron/DeepSpeed
layouts tuned over pp, dp, tp, micro-batch, schedule kind, chunks and device-type
subsets) and the plans of two peer planners re-implemented from their papers (Metis,
AMP), each chosen with its own cost model. The competitors are fair: the tuned
baselines and both peers may leave whole device classes out (every subset is theirs to
choose, as their users would), and the tuned baselines' picks get the same schedule
synthesis as the search's (the script prints each one's freedoms first). Every plan is
judged by the same SimPy simulator (so this figure tests the search against other
planners under our cost model; it does not test the cost model: see
experiments/accuracy.py and speedup_validation.py). The tuned baselines' plans are
points of the search's own space and join its ranking as seeds, so the pick is never
slower than either of them: the ``seed`` column says when the pick is one, and the
search's own best (``own``, what it picks without the seeds) is compared too.

Per case: simulated iteration times of the pick and of each other plan, and the pick's
speed-up over the best other (the fastest feasible baseline or peer). What the newer schedule
kinds bring: ``old kinds`` is the best plan of the older kinds (gpipe,
1f1b, interleaved-1f1b, zb-h1) among the search's own simulated plans (the same short
list: an estimate of the search without zb-v, dualpipe-v and synthesis, which would
have simulated other plans in their place), and ``new share`` the part of the pick's
log speed-up over the best other that the new kinds and synthesis bring,
log(old kinds / pick) / log(best other / pick). The baselines are tuned over every
kind, the new ones included, either way. Last lines:
``geomean_vs_best_other_old_kinds=X geomean_new_kinds_gain=G new_kinds_share=S`` and
``own_geomean_vs_best_other=X own_min_vs_best_other=Y picks_from_seeds=K`` and
``geomean_vs_best_other=X min_vs_best_other=Y n_cases=N``.

    python experiments/search_quality.py [--workers 2] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from hyperpipe.cluster.cluster import cluster_from_dict, load_cluster
from hyperpipe.core.errors import InfeasiblePlan
from hyperpipe.models import load_model
from hyperpipe.search.report import best_other, competitor_freedoms, describe_plan
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
    # leaving a type out is right: T4s (65 vs 989 TFLOP/s, 16 GB) behind a 10 Gbit/s link
    # cost more in pipeline traffic and all-reduce than the little compute they add
    "h100-t4-slow": {
        "nodes": [{"name": "h100", "device": "H100-SXM", "count": 8},
                  {"name": "t4-", "device": "T4", "count": 4, "repeat": 2}],
        "inter_node": {"bandwidth": "10 Gbit/s", "latency": "10 us"},
    },
}
CLUSTERS = ["a100-v100", "h100-a100-l4", *EXTRA_CLUSTERS]
MODELS = ["gpt2-xl", "gpt3-6.7b", "llama2-13b"]
GLOBAL_BATCH = 256
OTHERS = ("uniform", "proportional", "metis", "amp")
# the kinds before zb-v, dualpipe-v and synth
OLD_KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def _cluster(name: str):
    if name in EXTRA_CLUSTERS:
        return cluster_from_dict(EXTRA_CLUSTERS[name], where=f"cluster {name}", name=name)
    return load_cluster(name)


def _cell(cand) -> str:
    if cand is None:
        return f"{'-':>9}"
    if cand.metrics.oom:
        return f"{'OOM':>9}"
    return f"{cand.metrics.iteration_time_s:9.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    ap.add_argument("--quick", action="store_true", help="first model only")
    args = ap.parse_args()
    models = MODELS[:1] if args.quick else MODELS
    print("what each competitor may choose (all judged by the same simulator):")
    for name, text in competitor_freedoms().items():
        print(f"  {name:<13}{text}")
    print(f"{'cluster':<15} {'model':<11} {'pick':>9} " + " ".join(f"{k[:9]:>9}" for k in OTHERS)
          + f" {'vs other':>9} {'own':>9} {'seed':>12} {'old kinds':>9} {'new gain':>8} "
          f"{'search':>7}  pick's plan",
          flush=True)
    ratios, losses, old_ratios, new_gains = [], [], [], []
    own_ratios, seeded = [], 0
    for cname in CLUSTERS:
        cluster = _cluster(cname)
        for mname in models:
            model = load_model(mname)
            t0 = time.perf_counter()
            try:
                res = search(model, cluster, SearchConstraints(global_batch=args.global_batch),
                             top=3, workers=args.workers)
            except InfeasiblePlan as exc:
                print(f"{cname:<15} {mname:<11} no plan fits: {exc}", file=sys.stderr)
                continue
            took = time.perf_counter() - t0
            found = best_other(res)
            if found is None:
                print(f"{cname:<15} {mname:<11} no other plan fits: skipped", file=sys.stderr)
                continue
            name, other = found
            ratio = other.metrics.iteration_time_s / res.best.metrics.iteration_time_s
            ratios.append(ratio)
            if ratio < 1:
                losses.append((cname, mname, name, ratio))
            own = res.own_best or res.best
            own_ratios.append(other.metrics.iteration_time_s / own.metrics.iteration_time_s)
            seeded += res.seeded_from is not None
            pick_s = res.best.metrics.iteration_time_s
            old_s = min((c.metrics.iteration_time_s for c in res.simulated
                         if c.plan.schedule in OLD_KINDS), default=math.inf)
            if math.isfinite(old_s):
                old_ratios.append(other.metrics.iteration_time_s / old_s)
                new_gains.append(old_s / pick_s)
            used = sorted({cluster.device(d).type.name for d in res.best.plan.devices})
            print(f"{cname:<15} {mname:<11} {_cell(res.best)} "
                  + " ".join(_cell(res.baselines.get(k)) for k in OTHERS)
                  + f" {ratio:8.2f}x {_cell(own)} {res.seeded_from or '-':>12}"
                  f" {old_s:9.3f} {old_s / pick_s:7.3f}x {took:6.1f}s"
                  f"  [{'+'.join(used)}] "
                  f"{describe_plan(res.best.plan, cluster)[:80]}", flush=True)
    if not ratios:
        print("no comparable case", file=sys.stderr)
        return 1
    print("iteration times in seconds, simulated; vs other = best other's time / pick's "
          "time (the best other: fastest feasible of " + ", ".join(OTHERS) + ")")
    for cname, mname, name, ratio in losses:
        print(f"search loses: {cname} {mname} to {name} ({ratio:.3f}x)")
    print("old kinds: the best simulated plan of " + ", ".join(OLD_KINDS) + " on the "
          "search's short list; new gain = old kinds / pick (zb-v, dualpipe-v, synth)")
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    if old_ratios:
        geo_old = math.exp(sum(map(math.log, old_ratios)) / len(old_ratios))
        geo_new = math.exp(sum(map(math.log, new_gains)) / len(new_gains))
        share = math.log(geo_new) / math.log(geo) if geo > 1 else math.nan
        print(f"geomean_vs_best_other_old_kinds={geo_old:.3f} "
              f"geomean_new_kinds_gain={geo_new:.3f} new_kinds_share={share:.2f} "
              f"n_cases={len(old_ratios)}")
    own_geo = math.exp(sum(map(math.log, own_ratios)) / len(own_ratios))
    print("own: the search's best plan without the seeds; seed: the tuned baseline the "
          "pick is, if it is one")
    print(f"own_geomean_vs_best_other={own_geo:.4f} own_min_vs_best_other="
          f"{min(own_ratios):.4f} picks_from_seeds={seeded}")
    print(f"geomean_vs_best_other={geo:.4f} min_vs_best_other={min(ratios):.4f} "
          f"n_cases={len(ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
