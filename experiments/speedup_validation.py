"""Real runs judge the speed-up: the search's pick against the best other plan, run for
real (tiny-gpt, device speeds emulated on this CPU) on four small heterogeneous clusters
(two types over a slow link, a fast type beside a much slower one, and a straggler node
the pick may leave idle).

Per cluster: profile the layers here; run one calibration plan (the uniform 1F1B
pipeline over every device, micro-batch 1: a plan chosen before any search) and
calibrate from it alone; search with that profile; take the pick and the best other
plan (fastest of the tuned baselines and the peer planners, by the simulator); predict
both, then run both. What it tests: the simulated speed-up against runs whose compute
follows the layer profile and whose links are emulated from the cluster file by the
link emulator (exec.links), independently of the simulator; not real GPUs or links.
The predicted speed-up is made before either plan runs (out of sample, unless a pair
plan is the calibration plan itself, which is said).

Per pair: ``speedup_measured=... speedup_predicted=... n_pairs=N`` and whether the pick
measured at least as fast as the other within the two runs' spreads (each the half-range
of its step periods over their median); last line ``speedup_error_max=E`` (|predicted -
measured| / measured over the pairs).

    python experiments/speedup_validation.py [--steps 6] [--emulation-scale S]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from hyperpipe.cluster.cluster import cluster_from_dict, cluster_ref, load_cluster
from hyperpipe.exec import RunOptions, run_plan
from hyperpipe.exec.emulation import auto_emulation_scale, emulation_factors
from hyperpipe.exec.profiler import emulated_profile, measure_profile
from hyperpipe.models import load_model
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.search.report import best_other, describe_plan
from hyperpipe.search.search import SearchConstraints, search
from hyperpipe.sim.accuracy import measured_iteration_s, relative_error, step_periods_s
from hyperpipe.sim.calibrate import calibrate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate

MODEL = "tiny-gpt"
GLOBAL_BATCH, MICRO_BATCH = 16, 2
# the second small cluster: two A100-40GB beside two A10 (312 vs 125 TFLOP/s) over
# 25 Gbit/s Ethernet
MINI_A100_A10 = {"nodes": [{"name": "a100", "device": "A100-40GB", "count": 2},
                           {"name": "a10", "device": "A10", "count": 2}],
                 "inter_node": {"bandwidth": "25 Gbit/s", "latency": "10 us"}}
# the third: two H100-SXM beside two L4 (989 vs 121 TFLOP/s dense bf16, the catalog's
# vendor figures) over 10 Gbit/s: a type worth leaving out, or not
MINI_H100_L4 = {"nodes": [{"name": "h100", "device": "H100-SXM", "count": 2},
                          {"name": "l4", "device": "L4", "count": 2}],
                "inter_node": {"bandwidth": "10 Gbit/s", "latency": "10 us"}}
# the fourth: four one-GPU A100-80GB nodes, one a straggler at a third of its speed. The
# straggler is a device type of its own (A100-80GB with a third of its 312 TFLOP/s peak)
# rather than a node `slowdown`: the executor's emulation stretches compute per device
# type (`exec.emulation.emulation_factors`) and does not apply a node's slowdown, so a
# slowed node would run at full speed and the pair would test nothing.
MINI_STRAGGLER = {"device_types": {"A100-80GB-slow": {"base": "A100-80GB",
                                                      "peak_flops": "104 TFLOP/s"}},
                  "nodes": [{"name": "a", "device": "A100-80GB", "count": 1, "repeat": 3},
                            {"name": "slow", "device": "A100-80GB-slow", "count": 1}],
                  "inter_node": {"bandwidth": "25 Gbit/s", "latency": "10 us"}}


def _clusters():
    return [load_cluster("demo-hetero"),
            cluster_from_dict(MINI_A100_A10, where="mini-a100-a10", name="mini-a100-a10"),
            cluster_from_dict(MINI_H100_L4, where="mini-h100-l4", name="mini-h100-l4"),
            cluster_from_dict(MINI_STRAGGLER, where="mini-straggler", name="mini-straggler")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--emulation-scale", type=float, default=None,
                    help="default: exec.emulation.auto_emulation_scale for 4 ranks plus "
                         "the processes already runnable (the 1-minute load average)")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"load average before the runs: {load:.2f} on {os.cpu_count()} cores", flush=True)
    if args.emulation_scale is None:
        # other processes contend for the cores as the ranks do: count them, or the
        # contention, not the emulated devices, sets the measured times
        args.emulation_scale = auto_emulation_scale(4 + math.ceil(load),
                                                    os.cpu_count() or 1)
    t0 = time.perf_counter()
    model = load_model(MODEL)
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for cluster in _clusters():
            errors.append(_pair(args, model, cluster, Path(tmp) / cluster.name))
    print(f"(tiny-gpt, emulation scale {args.emulation_scale}, {args.steps} steps per run, "
          f"median step period, {time.perf_counter() - t0:.0f} s)")
    print(f"speedup_error_max={max(errors):.4f}")
    return 0


def _pair(args, model, cluster, where: Path) -> float:
    where.mkdir(parents=True)
    native = measure_profile(MODEL, cluster_ref(cluster), emulate=False)
    native.save(where / "native.json")
    base = emulated_profile(native, emulation_factors(cluster, args.emulation_scale))
    opts = RunOptions(steps=args.steps, emulation_scale=args.emulation_scale,
                      reference_profile=str(where / "native.json"))
    cal_plan = uniform_plan(model, cluster, pp=len(cluster.devices), micro_batch=1,
                            global_batch=GLOBAL_BATCH)
    cal = run_plan(cal_plan, opts).trace
    profile = calibrate([cal], sources=["calibration"], base=base)
    res = search(model, cluster, SearchConstraints(global_batch=GLOBAL_BATCH,
                                                   micro_batch=MICRO_BATCH, tp=1),
                 profile=profile)
    name, other = best_other(res)
    cost = CostModel(model, cluster, profile)
    pred = {k: simulate(p, cost).metrics.iteration_time_s
            for k, p in (("pick", res.best.plan), (name, other.plan))}
    traces = {k: run_plan(p, opts).trace for k, p in (("pick", res.best.plan),
                                                     (name, other.plan))}
    meas = {k: measured_iteration_s(t) for k, t in traces.items()}
    # spread: the half-range of the step periods over their median, per run
    spread = {k: (max(ps) - min(ps)) / 2 / meas[k] if (ps := step_periods_s(t)) else 0.0
              for k, t in traces.items()}
    s_pred, s_meas = pred[name] / pred["pick"], meas[name] / meas["pick"]
    err = relative_error(s_pred, s_meas)
    for k, p in (("pick", res.best.plan), (name, other.plan)):
        same = " (the calibration plan: in-sample)" if p == cal_plan else ""
        idle = len(cluster.devices) - len(p.devices)
        print(f"  {cluster.name} {k:<12} predicted {pred[k] * 1e3:7.1f} ms  measured "
              f"{meas[k] * 1e3:7.1f} ms +-{spread[k]:.1%}{same}  {idle} idle  "
              f"{describe_plan(p, cluster)}", flush=True)
    within = s_meas >= 1 - spread["pick"] - spread[name]
    print(f"{cluster.name}: pick vs {name}: speedup_measured={s_meas:.3f} "
          f"speedup_predicted={s_pred:.3f} n_pairs=1 error={err:.3f} "
          f"pick_at_least_as_fast_within_spread={within}", flush=True)
    return err


if __name__ == "__main__":
    sys.exit(main())
