"""How much of the search's result the V-shaped kinds and synthesised schedules bring.

On the clusters and models of `experiments/search_quality.py`, one search each (all
kinds on, synthesis on for its best plans). From its simulated ranking (the short
list, every plan priced by the same simulator) three figures per case:

- ``old``: the best plan of the older kinds (gpipe, 1f1b, interleaved-1f1b,
  zb-h1);
- ``+V``: the best plan of any fixed kind (adds zb-v, dualpipe-v);
- ``+synth``: the search's pick (adds synthesised schedules).

``v_gain = old / +V`` and ``synth_gain = +V / +synth`` (>= 1 each; their product is
what the new schedules bring to the pick). Baselines are left out on purpose: this
splits the pick's own time, not its lead over others (search_quality.py reports that).
Last line ``geomean_v_gain=A geomean_synth_gain=B geomean_total=C n_cases=N``.

    python experiments/schedule_gain.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from hyperpipe.core.errors import InfeasiblePlan
from hyperpipe.models import load_model
from hyperpipe.search.search import SearchConstraints, search

sys.path.insert(0, str(Path(__file__).resolve().parent))
from search_quality import CLUSTERS, GLOBAL_BATCH, MODELS, _cluster  # noqa: E402

OLD_KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def best_time(ranked, kinds=None) -> float:
    times = [c.metrics.iteration_time_s for c in ranked if c.metrics.feasible
             and (kinds is None or c.plan.schedule in kinds)]
    return min(times, default=math.inf)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="first model only")
    args = ap.parse_args()
    print(f"{'cluster':<15} {'model':<11} {'old s':>9} {'+V s':>9} {'+synth s':>9} "
          f"{'v_gain':>7} {'synth_gain':>10}  pick")
    v_gains, s_gains = [], []
    for cname in CLUSTERS:
        cluster = _cluster(cname)
        for mname in MODELS[:1] if args.quick else MODELS:
            try:
                res = search(load_model(mname), cluster,
                             SearchConstraints(global_batch=GLOBAL_BATCH), top=10_000)
            except InfeasiblePlan:
                continue
            old = best_time(res.ranked, OLD_KINDS)
            fixed = best_time(res.ranked, [k for k in (*OLD_KINDS, "zb-v", "dualpipe-v")])
            pick = best_time(res.ranked)
            if not math.isfinite(old):
                print(f"{cname:<15} {mname:<11} no old-kind plan on the short list: skipped")
                continue
            v_gains.append(old / fixed)
            s_gains.append(fixed / pick)
            print(f"{cname:<15} {mname:<11} {old:9.3f} {fixed:9.3f} {pick:9.3f} "
                  f"{old / fixed:7.3f} {fixed / pick:10.3f}  {res.best.plan.schedule}",
                  flush=True)
    if not v_gains:
        return 1

    def geo(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs))

    total = [a * b for a, b in zip(v_gains, s_gains, strict=True)]
    print(f"geomean_v_gain={geo(v_gains):.3f} geomean_synth_gain={geo(s_gains):.3f} "
          f"geomean_total={geo(total):.3f} n_cases={len(total)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
