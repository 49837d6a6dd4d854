"""The analytic tier against the SimPy simulator, per schedule kind.

Two blocks, every plan built by `uniform_plan` on synthetic layers (1 TFLOP/s devices,
one per node), each timed by both tiers:

1. Equal stages on free links, where both tiers must agree with the closed forms
   (DESIGN.md): every fixed kind, p in {1, 2, 3, 4, 6, 8, 12}, m from 1 to 29, the
   chunk counts each kind takes (interleaved 2-4). Printed: the cases that differ by
   more than 1e-9 relative, then ``equal_cases=N equal_mismatches=K equal_worst=W``.
2. Random chains (seeded): layers of 0.3-3 GFLOP per sample, activations of 0, 0.1, 1
   or 10 MB per sample, inter-node links of 1, 10 or 100 GB/s; p, m drawn per plan.
   Per kind: the mean absolute relative error of the estimate against the simulation,
   and its worst over and under: ``chains_<kind>_mae=X`` lines.

    python experiments/analytic_accuracy.py [--chains 60] [--seed 7]
"""

from __future__ import annotations

import argparse
import random
import statistics

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput, InfeasiblePlan
from hyperpipe.models import load_model
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate

CHUNKS = {"gpipe": (1,), "1f1b": (1,), "zb-h1": (1,), "interleaved-1f1b": (2, 3, 4),
          "zb-v": (2,), "dualpipe-v": (2,)}
OPTIONS = SimOptions(trace=False)


def _cluster(bandwidth: str) -> dict:
    return {"name": "chain",
            "device_types": {"unit": {"peak_flops": "1 TFLOP/s", "efficiency": 1.0,
                                      "memory": "80 GB"}},
            "nodes": [{"name": f"n{i}", "device": "unit", "count": 1} for i in range(12)],
            "inter_node": {"bandwidth": bandwidth, "latency": "0 s"}}


def _both(model, cluster, cost, kind: str, p: int, v: int, m: int
          ) -> tuple[float, float] | None:
    """(simulated, estimated) seconds of one plan, or None where it cannot be built."""
    try:
        plan = uniform_plan(model, cluster, pp=p, micro_batch=1, global_batch=m,
                            schedule=kind, chunks=v)
    except (BadInput, InfeasiblePlan):
        return None
    return (simulate(plan, cost, OPTIONS).metrics.iteration_time_s,
            estimate(plan, cost).iteration_time_s)


def equal_stages() -> None:
    model = load_model({"kind": "synthetic", "layers": 48, "fwd_flops_per_sample": 1e9})
    cluster = load_cluster(_cluster("1e30 B/s"))
    cost = CostModel(model, cluster)
    n = bad = 0
    worst = 0.0
    for kind, chunk_counts in CHUNKS.items():
        for p in (1, 2, 3, 4, 6, 8, 12):
            for v in chunk_counts:
                if 48 % (p * v):
                    continue
                for m in range(1, 30):
                    got = _both(model, cluster, cost, kind, p, v, m)
                    if got is None:
                        continue
                    sim, est = got
                    n += 1
                    err = (est - sim) / sim
                    if abs(err) > 1e-9:
                        bad += 1
                        worst = max(worst, abs(err), key=abs)
                        print(f"  {kind} p={p} v={v} m={m}: simulated {sim * 1e3:.3f} ms, "
                              f"estimated {est * 1e3:.3f} ms ({err:+.4f})")
    print(f"equal_cases={n} equal_mismatches={bad} equal_worst={worst:.4f}")


def random_chains(count: int, seed: int) -> None:
    rng = random.Random(seed)
    errors: dict[str, list[float]] = {}
    for _ in range(count):
        n_layers = rng.choice([12, 24, 48])
        model = load_model({
            "kind": "synthetic",
            "layers": [{"fwd_flops_per_sample": rng.uniform(0.3, 3) * 1e9}
                       for _ in range(n_layers)],
            "activation_bytes_per_sample": rng.choice([0, 1e5, 1e6, 1e7])})
        cluster = load_cluster(_cluster(rng.choice(["1 GB/s", "10 GB/s", "100 GB/s"])))
        cost = CostModel(model, cluster)
        for kind, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                        ("interleaved-1f1b", 2), ("interleaved-1f1b", 3)):
            p = rng.choice([2, 3, 4, 6, 8])
            m = rng.randint(1, 3 * p)
            if n_layers % (p * v):
                continue
            got = _both(model, cluster, cost, kind, p, v, m)
            if got is not None:
                errors.setdefault(f"{kind}_v{v}", []).append((got[1] - got[0]) / got[0])
    for name, errs in errors.items():
        print(f"chains_{name}_mae={statistics.mean(abs(e) for e in errs):.4f} "
              f"worst_over={max(errs):+.4f} worst_under={min(errs):+.4f} n={len(errs)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=int, default=60)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    print("equal stages, free links (closed forms):")
    equal_stages()
    print(f"random chains ({args.chains}, seed {args.seed}):")
    random_chains(args.chains, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
