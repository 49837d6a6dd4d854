"""Search scale: GPT-3 175B on the built-in 1024-GPU, four-type cluster.

Prints the search's phases and best plan, then as its last line
``search_time_s=T candidates=N``. Target: T <= 60 s on 2 cores, with a valid,
memory-feasible plan.

    python experiments/search_scale.py [--model llama2-70b] [--workers 2]
"""

from __future__ import annotations

import argparse
import sys

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.report import format_search
from hyperpipe.search.search import SearchConstraints, search
from hyperpipe.sim.costmodel import CostModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--cluster", default="scale-1024")
    # GPT-3 175B trained with 3.2M-token batches: 1536 sequences of 2048 (Brown et al.
    # 2020, table 2.1)
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    model, cluster = load_model(args.model), load_cluster(args.cluster)
    result = search(model, cluster, SearchConstraints(global_batch=args.global_batch),
                    top=3, workers=args.workers, progress=sys.stderr.isatty())
    best = result.best
    best.plan.check(model, cluster)            # valid ...
    if best.metrics.oom:                       # ... and memory-feasible
        print(f"best plan is out of memory on {best.metrics.oom[:4]}", file=sys.stderr)
        return 1
    sys.stdout.write(format_search(result, CostModel(model, cluster)))
    print(f"devices used by the best plan: {len(best.plan.devices)} of "
          f"{len(cluster.devices)}")
    print(f"search_time_s={result.search_time_s:.1f} candidates={result.candidates_evaluated}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
