"""How close are the simulator's predictions to real runs?

Calibrates once (per-layer profiling here, scaled to two short runs of calibration
plans), then predicts and measures thirteen other
plans on the demo cluster (tiny-gpt, device speeds emulated on this CPU) that differ in
partition, schedule (gpipe, 1f1b, interleaved-1f1b, zb-h1), micro-batch count, data
parallelism and the device types they use. Each plan is also predicted by a null model
(`hyperpipe.sim.accuracy.compute_only_s`: the busiest device's calibrated compute,
nothing else: no communication, bubble, overlap, per-action overhead or optimizer), so
the figure says how much the simulator knows beyond compute. In-sample: the two
CALIBRATION plans (profile fitted to them); out-of-sample: the PLANS, which are all
the figures. Prints a table and, last,
``mape=X mape_null=Y residual_mape=Z kendall_tau=T n_plans=N``, residual_mape being the
error on the non-compute part (|predicted - measured| / (measured - null compute)).

    python experiments/accuracy.py [--steps 5] [--emulation-scale S]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.exec import RunOptions, run_plan
from hyperpipe.exec.emulation import auto_emulation_scale, emulation_factors
from hyperpipe.exec.profiler import emulated_profile, measure_profile
from hyperpipe.plan.plan import PipelinePlan, Plan, StagePlan
from hyperpipe.sim.accuracy import compute_only_s, measured_iteration_s, relative_error
from hyperpipe.sim.calibrate import calibrate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate

A0, A1, V0, V1 = "a100/0", "a100/1", "v100/0", "v100/1"
# why: the residual error divides by the measured non-compute part; below this share of
# the iteration that part is within noise and the ratio means nothing
RESIDUAL_MIN = 0.05


def pipeline(micro_batch: int, count: int, cuts: list[int], devices: list[str],
             recompute: str = "none") -> PipelinePlan:
    """Stages between the cuts of tiny-gpt's 8 layers, on `devices` (looped if fewer)."""
    bounds = [0, *cuts, 8]
    stages = tuple(StagePlan((bounds[i], bounds[i + 1]), (devices[i % len(devices)],),
                             recompute=recompute)
                   for i in range(len(bounds) - 1))
    return PipelinePlan(micro_batch, count, stages)


def plan(kind: str, *pipes: PipelinePlan, chunks: int = 1) -> Plan:
    return Plan("tiny-gpt", "demo-hetero", sum(p.samples for p in pipes), kind, chunks,
                tuple(pipes))


CALIBRATION = {
    "cal-1f1b-mb1": plan("1f1b", pipeline(1, 8, [2, 5, 7], [V0, A0, V1, A1])),
    "cal-zb-dp-mb4": plan("zb-h1", pipeline(4, 2, [3], [A1, V1]), pipeline(4, 2, [5], [A0, V0])),
}

PLANS = {
    "gpipe-4x2": plan("gpipe", pipeline(2, 8, [2, 4, 6], [A0, A1, V0, V1])),
    "1f1b-4-uneven": plan("1f1b", pipeline(2, 8, [3, 6, 7], [A0, A1, V0, V1])),
    "zb-h1-4-uneven": plan("zb-h1", pipeline(2, 8, [3, 6, 7], [A0, A1, V0, V1])),
    "interleaved-2x2": plan("interleaved-1f1b", pipeline(2, 8, [2, 4, 6], [A0, V0]),
                            chunks=2),
    "1f1b-2-mb4": plan("1f1b", pipeline(4, 4, [5], [A0, V0])),
    "1f1b-dp2": plan("1f1b", pipeline(2, 4, [5], [A0, V0]), pipeline(2, 4, [5], [A1, V1])),
    "gpipe-3-mb1": plan("gpipe", pipeline(1, 16, [2, 6], [V0, A0, V1])),
    "zb-h1-a100-only": plan("zb-h1", pipeline(2, 8, [6], [A0, A1])),
    "1f1b-v100-only": plan("1f1b", pipeline(2, 8, [4], [V0, V1])),
    "hetero-dp": plan("1f1b", pipeline(2, 5, [], [A0]), pipeline(2, 3, [4], [V0, V1])),
    "1f1b-recompute-full": plan("1f1b", pipeline(2, 8, [4], [A0, V0], recompute="full")),
    # cut across the 10 Gbit/s inter-node link with large messages (link emulation holds
    # each until the route would have delivered it)
    "link-gpipe-mb8": plan("gpipe", pipeline(8, 2, [4], [A0, V0])),
    "link-zb-dp2-mb8": plan("zb-h1", pipeline(8, 1, [3], [A0, V0]),
                            pipeline(8, 1, [5], [A1, V1])),
}


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-a between two rankings (pairs tied in either count as neither)."""
    pairs = list(itertools.combinations(range(len(xs)), 2))
    score = sum((1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 else
                 -1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) < 0 else 0) for i, j in pairs)
    return score / len(pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--emulation-scale", type=float, default=None,
                        help="default: exec.emulation.auto_emulation_scale for 4 ranks")
    parser.add_argument("--reference", choices=["profile", "measured"], default="profile",
                        help="emulation's compute reference: the layer profile taken once "
                        "(default), or each run's own timing of its actions")
    args = parser.parse_args()
    t0 = time.perf_counter()

    print("profiling each layer kind here (the base of calibration and, with "
          "--reference profile, of emulation)", flush=True)
    cluster = load_cluster("demo-hetero")
    if args.emulation_scale is None:
        args.emulation_scale = auto_emulation_scale(len(cluster.devices), os.cpu_count() or 1)
    native = measure_profile("tiny-gpt", "demo-hetero", emulate=False)
    base = emulated_profile(native, emulation_factors(cluster, args.emulation_scale))
    with tempfile.TemporaryDirectory() as tmp:
        return _study(args, native, base, Path(tmp) / "native.json", t0)


def _study(args, native, base, native_path: Path, t0: float) -> int:
    native.save(native_path)
    opts = RunOptions(steps=args.steps, emulation_scale=args.emulation_scale,
                      reference_profile=str(native_path) if args.reference == "profile"
                      else None)
    print(f"calibration runs ({len(CALIBRATION)}):", flush=True)
    traces = []
    for name, p in CALIBRATION.items():
        traces.append(run_plan(p, opts).trace)
        print(f"  {name}: {measured_iteration_s(traces[-1]) * 1e3:.1f} ms", flush=True)
    profile = calibrate(traces, sources=list(CALIBRATION), base=base)

    rows = []
    for name, p in PLANS.items():
        model, cluster = p.load_model(), p.load_cluster()
        cost = CostModel(model, cluster, profile)
        predicted = simulate(p, cost).metrics.iteration_time_s
        null = compute_only_s(p, cost)
        measured = measured_iteration_s(run_plan(p, opts).trace)
        rest = measured - null         # the non-compute part, as measured
        rows.append((name, predicted, measured, relative_error(predicted, measured), null,
                     relative_error(null, measured),
                     abs(predicted - measured) / rest if rest > RESIDUAL_MIN * measured
                     else math.nan))
        print(f"  {name:<18} predicted {predicted * 1e3:7.1f} ms  measured "
              f"{measured * 1e3:7.1f} ms  error {rows[-1][3]:6.1%}", flush=True)

    print(f"\n{'plan':<18}{'predicted':>12}{'measured':>12}{'error':>9}{'null':>12}"
          f"{'null err':>10}{'resid err':>10}")
    for name, p_s, m_s, err, n_s, n_err, r_err in rows:
        print(f"{name:<18}{p_s * 1e3:>10.1f}ms{m_s * 1e3:>10.1f}ms{err:>9.1%}"
              f"{n_s * 1e3:>10.1f}ms{n_err:>10.1%}"
              + (f"{r_err:>10.1%}" if not math.isnan(r_err) else f"{'n/a':>10}"))
    errors = [r[3] for r in rows]
    tau = kendall_tau([r[1] for r in rows], [r[2] for r in rows])
    print(f"(emulation scale {args.emulation_scale}, reference {args.reference}, "
          f"{args.steps} steps per run, "
          f"{time.perf_counter() - t0:.0f} s)")
    resid = [r[6] for r in rows if not math.isnan(r[6])]
    print(f"out of sample: {len(rows)} plans; calibrated on: {', '.join(CALIBRATION)}; "
          f"max_ape={max(errors):.4f}; residual over the {len(resid)} plans whose measured "
          f"non-compute part is over {RESIDUAL_MIN:.0%} of the iteration (else n/a)")
    print(f"mape={statistics.fmean(errors):.4f} "
          f"mape_null={statistics.fmean(r[5] for r in rows):.4f} "
          f"residual_mape={statistics.fmean(resid) if resid else math.nan:.4f} "
          f"kendall_tau={tau:.3f} n_plans={len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
