"""Does the simulator price a mixture-of-experts layer as the executor runs it?

Calibrates on dense runs only (two short runs of tiny-gpt, a per-layer profile taken
here as the base, as experiments/accuracy.py does), then predicts and measures runs of
tiny-moe (blocks 0 and 2 of 4 are MoE: 4 GELU experts of hidden 256, top 2, dropless)
with and without expert parallelism on a cluster of two nodes of two A100 (device
speeds emulated on this CPU; links emulated by exec.links from the cluster file's
nominal figures, independently of the simulator). The executor computes real experts
(routing, gathers, per-expert GEMMs) and sends the real routed rows over the emulated
links; nothing is fitted to the MoE runs: every MoE figure is out of sample.

Two calibrations of the simulator, from the same dense runs:

- `profiled` (the workflow `hyperpipe calibrate --measure` then `--trace` gives): the
  base is a per-layer profile of the MoE model's layer kinds (tiny-moe's: its MoE
  block timed alone, every expert local), scaled to the dense runs;
- `dense-rate`: the base knows dense layers only (tiny-gpt's), so an MoE block is
  priced by CostModel's rule without an MoE entry: the dense block's fit at the MoE
  block's FLOPs plus the kernels it launches beyond a dense block (router, permute,
  one MLP per local expert, unpermute: `models.ops.pass_launches`) at the dense fit's
  intercept per launch.

Emulated compute follows native per-layer profiles taken once here (as accuracy.py's
default `--reference profile`: a shared machine's speed drifts by tens of percent
between runs): tiny-gpt's for the dense runs, tiny-moe's for the MoE runs. So under
`profiled` the compute of the MoE runs agrees by construction up to the dense runs'
scaling, and what the figure tests is the rest: the expert-parallel compute split, the
all-to-alls over NVLink and a shared NIC, their place in the schedule, and the
emulator's own costs; `dense-rate` tests the MoE block's compute too. An expert-
parallel rank's reference is its stage at ep 1: under even routing a rank of ep ranks
computes as many (token, expert) pairs as one holding every expert.

The figure: per MoE run, every (device, stage, op) action holding an MoE block, its
mean duration over the steps after the first (with ep > 1 an action's all-to-alls are
part of it, in both tiers), predicted against measured: ``moe_layer_mape`` (profiled)
and ``moe_layer_mape_dense_rate``; beside each a null model, the same calibrated
compute of the stage alone, as if every expert were on the rank and nothing were
exchanged (`CostModel.stage_compute_s`); and the iteration time against the measured
one, with `compute_only_s` as its null.

Why 100 Mbit/s between the nodes: emulated compute is this CPU's, thousands of times
slower than an A100, so a link matters only when slowed alike; at 100 Mbit/s one
all-to-all of a micro-batch of 2 (about 65 KB each way per peer) takes about 5 ms, a
sizeable share of a stage's forward. Chosen before any of these runs. On a loaded
machine give `--emulation-scale` well above the load (e.g. 8): below it, contention and
not the emulated device sets the time (docs/emulation.md).

Prints one line per action kind of each run, then ``moe_layer_mape=X
moe_layer_mape_null=Y moe_layer_mape_dense_rate=Z moe_layer_mape_dense_rate_null=W
iteration_mape=... iteration_mape_null=... n_runs=N``.

    python experiments/accuracy_moe.py [--steps 4] [--emulation-scale S]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.exec import RunOptions, run_plan
from hyperpipe.exec.emulation import auto_emulation_scale, emulation_factors
from hyperpipe.exec.profiler import emulated_profile, measure_profile
from hyperpipe.models import load_model
from hyperpipe.plan.plan import Plan, plan_from_dict
from hyperpipe.plan.trace import COMPUTE_OPS, Trace
from hyperpipe.sim.accuracy import compute_only_s, measured_iteration_s, relative_error
from hyperpipe.sim.calibrate import calibrate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.options import SimOptions
from hyperpipe.sim.simulator import simulate

CLUSTER = {"name": "moe-2x2", "nodes": [{"name": "x", "device": "A100-80GB", "count": 2},
                                        {"name": "y", "device": "A100-80GB", "count": 2}],
           "inter_node": {"bandwidth": "100 Mbit/s", "latency": "50 us"}}


def plan(model: str, pipes: list[list[str]], bounds: list[int], *, ep: int = 1,
         micro_batch: int = 2, count: int = 4, kind: str = "1f1b") -> Plan:
    """One pipeline per entry of `pipes` (its stages' devices), stage s holding layers
    [bounds[s], bounds[s + 1]), each with expert-parallel degree `ep`."""
    extra = {"ep": ep} if ep > 1 else {}
    return plan_from_dict({
        "format": "hyperpipe.plan/1", "model": model, "cluster": CLUSTER,
        "global_batch": micro_batch * count * len(pipes), "schedule": kind,
        "pipelines": [{"micro_batch": micro_batch, "num_microbatches": count, "stages": [
            {"layers": [bounds[s], bounds[s + 1]], "devices": [d], **extra}
            for s, d in enumerate(devs)]} for devs in pipes]})


# dense tiny-gpt (8 layers): a pipeline across the NIC, and two replicas on one node
CALIBRATION = {
    "cal-dense-pp2": plan("tiny-gpt", [["x/0", "y/0"]], [0, 4, 8]),
    "cal-dense-dp2-zb": plan("tiny-gpt", [["x/0"], ["x/1"]], [0, 8], kind="zb-h1"),
}
# tiny-moe (6 layers, MoE at layers 1 and 3)
MOE_RUNS = {
    "moe-ep1-pp2": plan("tiny-moe", [["x/0", "x/1"]], [0, 3, 6]),
    "moe-ep2-1node": plan("tiny-moe", [["x/0"], ["x/1"]], [0, 6], ep=2),
    "moe-ep2-2nodes": plan("tiny-moe", [["x/0"], ["y/0"]], [0, 6], ep=2),
    # both pairs' all-to-alls cross the one NIC of each node at once
    "moe-ep2-pp2-2nodes": plan("tiny-moe", [["x/0", "x/1"], ["y/0", "y/1"]], [0, 3, 6],
                               ep=2),
}


def action_means(trace: Trace, first_step: int = 1) -> dict[tuple[str, int, str], float]:
    """(device, stage, op) -> mean duration of its compute actions (steps from
    `first_step` on: the first one warms up)."""
    spans: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    for e in trace.events:
        if e.op in COMPUTE_OPS and e.step >= first_step:
            spans[(e.device, e.stage, e.op)].append(e.duration_s)
    return {k: statistics.fmean(v) for k, v in spans.items()}


def moe_stages(p: Plan) -> dict[tuple[int, int], tuple[tuple[int, int], str, int]]:
    """(pipeline, stage) -> (layers, device, ep) of every stage holding an MoE block."""
    spec = p.load_model()
    out = {}
    for q, pipe in enumerate(p.pipelines):
        for k, st in enumerate(pipe.stages):
            if any(spec.layers[i].kind == "moe" for i in range(*st.layers)):
                out[(q, k)] = (st.layers, st.devices[0], st.ep)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--emulation-scale", type=float, default=None,
                        help="default: exec.emulation.auto_emulation_scale for 4 ranks")
    args = parser.parse_args()
    t0 = time.perf_counter()
    cluster = load_cluster(CLUSTER)
    scale = args.emulation_scale or auto_emulation_scale(len(cluster.devices),
                                                         os.cpu_count() or 1)
    print("profiling tiny-gpt's and tiny-moe's layers here", flush=True)
    native = {"dense-rate": measure_profile("tiny-gpt", CLUSTER, emulate=False),
              "profiled": measure_profile("tiny-moe", CLUSTER, emulate=False)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, prof in native.items():
            prof.save(Path(tmp) / f"{name}.json")
        return _study(args, scale, cluster, native, Path(tmp), t0)


@dataclass
class Figures:
    """Errors of one calibration over the MoE runs."""

    layer: list[float] = field(default_factory=list)
    layer_null: list[float] = field(default_factory=list)
    iteration: list[float] = field(default_factory=list)
    iteration_null: list[float] = field(default_factory=list)


def _study(args, scale: float, cluster, native: dict, folder: Path, t0: float) -> int:
    factors = emulation_factors(cluster, scale)
    opts = RunOptions(steps=args.steps, emulation_scale=scale,
                      reference_profile=str(folder / "dense-rate.json"))
    traces = []
    for name, p in CALIBRATION.items():
        traces.append(run_plan(p, opts).trace)
        print(f"  calibration {name}: {measured_iteration_s(traces[-1]) * 1e3:.1f} ms",
              flush=True)
    # the `profiled` base is tiny-moe's layer profile scaled to tiny-gpt's runs, by design
    profiles = {name: calibrate(traces, sources=list(CALIBRATION),
                                base=emulated_profile(prof, factors),
                                allow_base_mismatch=name == "profiled")
                for name, prof in native.items()}
    figures = {name: Figures() for name in profiles}
    run_opts = RunOptions(steps=args.steps, emulation_scale=scale, probe_links=False,
                          reference_profile=str(folder / "profiled.json"))
    every_replica = SimOptions(collapse_replicas=False)
    spec = load_model("tiny-moe")
    print(f"\n{'run':<20}{'device':>7}{'stage':>6}{'op':>4}{'measured':>11}"
          + "".join(f"{name:>12}{'error':>8}{'null':>10}{'null err':>9}"
                    for name in profiles))
    for run_name, p in MOE_RUNS.items():
        trace = run_plan(p, run_opts).trace
        measured = action_means(trace)
        costs = {name: CostModel(spec, cluster, prof) for name, prof in profiles.items()}
        sims = {name: simulate(p, cost, every_replica) for name, cost in costs.items()}
        predicted = {name: action_means(sim.trace, 0) for name, sim in sims.items()}
        for (q, k), (layers, device, _) in sorted(moe_stages(p).items()):
            dtype = cluster.device(device).type.name
            for op in COMPUTE_OPS:
                key = (device, k, op)
                if key not in measured:
                    continue
                line = f"{run_name:<20}{device:>7}{k:>6}{op:>4}{measured[key] * 1e3:>9.2f}ms"
                for name, cost in costs.items():
                    null_s = cost.stage_compute_s(layers, dtype, p.pipelines[q].micro_batch,
                                                  op, 1, False)
                    err = relative_error(predicted[name][key], measured[key])
                    nerr = relative_error(null_s, measured[key])
                    figures[name].layer.append(err)
                    figures[name].layer_null.append(nerr)
                    line += (f"{predicted[name][key] * 1e3:>10.2f}ms{err:>8.1%}"
                             f"{null_s * 1e3:>8.2f}ms{nerr:>9.1%}")
                print(line, flush=True)
        it_meas = measured_iteration_s(trace)
        line = f"{run_name:<20} iteration measured {it_meas * 1e3:.1f} ms;"
        for name, cost in costs.items():
            it_pred = sims[name].metrics.iteration_time_s
            figures[name].iteration.append(relative_error(it_pred, it_meas))
            figures[name].iteration_null.append(relative_error(compute_only_s(p, cost),
                                                               it_meas))
            line += (f" {name} {it_pred * 1e3:.1f} ms ({figures[name].iteration[-1]:.1%}, "
                     f"null {figures[name].iteration_null[-1]:.1%})")
        print(line, flush=True)
    print(f"\n(emulation scale {scale}, {args.steps} steps per run, emulation references "
          f"from the native profiles, {time.perf_counter() - t0:.0f} s)")
    n = len(figures["profiled"].layer)
    print(f"in sample: {', '.join(CALIBRATION)} (dense; no figure below is theirs); "
          f"out of sample: {len(MOE_RUNS)} MoE runs, {n} MoE-stage actions")
    out = []
    for name, f in figures.items():
        tag = "" if name == "profiled" else "_dense_rate"
        out += [f"moe_layer_mape{tag}={statistics.fmean(f.layer):.4f}",
                f"moe_layer_mape{tag}_null={statistics.fmean(f.layer_null):.4f}",
                f"iteration_mape{tag}={statistics.fmean(f.iteration):.4f}",
                f"iteration_mape{tag}_null={statistics.fmean(f.iteration_null):.4f}"]
    print(" ".join(out) + f" n_runs={len(MOE_RUNS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
