"""How close are the simulator's predictions to real runs?

Calibrates once (per-layer profiling here, scaled to two short runs of calibration
plans), then predicts and measures other plans (tiny-gpt, device speeds emulated on this
CPU, links emulated by exec.links from the cluster file's nominal figures, independently
of the simulator):

- PLANS, thirteen on the demo cluster, that differ in partition, schedule (gpipe, 1f1b,
  interleaved-1f1b, zb-h1), micro-batch count, data parallelism and device types;
- CONTENTION, plans whose flows of different rank pairs share a hop, on slow variants
  of the demo cluster (a link that takes a sizeable share of a micro-batch's compute,
  where sharing it shows): two pipelines' sends through one NIC, and the same with two
  NICs per node; a data-parallel all-reduce across the NIC beside pipeline sends, with
  one NIC and with two; a tensor-parallel stage next to a pipeline hop on one node's
  slow intra-node ports. The simulator prices them with the calibrated compute and the
  cluster file's links (calibration saw the demo cluster's links only).

Two null models predict each plan from the same calibrated compute:
`hyperpipe.sim.accuracy.compute_only_s` (the busiest device's compute, nothing else), and
`bubble_null_s`, a null that knows about bubbles: (m + p - 1) x the busiest stage's
forward and backward of one micro-batch, plus the data-parallel all-reduce alone on idle
links. In-sample: the two CALIBRATION plans (profile fitted to them); out-of-sample:
every other plan, which are all the figures. Prints a table, each group's figures apart,
``residual_mape=Z kendall_tau=T`` (residual: the error on the non-compute part,
|predicted - measured| / (measured - null compute)) and, last,
``mape=X mape_null=Y mape_null_bubble=W n_plans=N n_contention=C`` over all plans.

    python experiments/accuracy.py [--steps 5] [--emulation-scale S]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.exec import RunOptions, run_plan
from hyperpipe.exec.emulation import auto_emulation_scale, emulation_factors
from hyperpipe.exec.placement import dp_groups, placements
from hyperpipe.exec.profiler import emulated_profile, measure_profile
from hyperpipe.plan.plan import PipelinePlan, Plan, StagePlan
from hyperpipe.plan.profile import Profile
from hyperpipe.sim.accuracy import (
    compute_only_s,
    kendall_tau,
    measured_iteration_s,
    relative_error,
)
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


def plan(kind: str, *pipes: PipelinePlan, chunks: int = 1,
         cluster: str | dict = "demo-hetero") -> Plan:
    return Plan("tiny-gpt", cluster, sum(p.samples for p in pipes), kind, chunks,
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

# Slow variants of demo-hetero for the contention plans. Why these speeds: emulated
# compute is this CPU's, thousands of times slower than the devices it stands for, so a
# link matters only when it is slowed alike; at 200 Mbit/s a micro-batch of 8 (256 KiB
# of activation) takes about 10 ms, a sizeable share of a stage's compute, and a
# tiny-gpt all-reduce of a few MB about a hundred ms. Chosen from those shares before
# any of these plans ran; nothing is fitted to them.
SLOW_NIC = "200 Mbit/s"
SLOW = {"name": "demo-hetero-slow",
        "nodes": [{"name": "a100", "device": "A100-80GB", "count": 2},
                  {"name": "v100", "device": "V100-32GB", "count": 2}],
        "inter_node": {"bandwidth": SLOW_NIC, "latency": "50 us"}}
# the same with two NICs per node of the same speed each: device i on NIC i
SLOW_2NIC = {**SLOW, "name": "demo-hetero-slow-2nic",
             "nodes": [{**n, "nics": {"count": 2, "bandwidth": SLOW_NIC}}
                       for n in SLOW["nodes"]]}
# three A100 on one node behind slow intra-node ports (as slow as SLOW's NIC, in bytes)
SLOW_PORTS = {"name": "a100x3-slow-ports",
              "nodes": [{"name": "a100", "device": "A100-80GB", "count": 3,
                         "intra_link": {"bandwidth": "25 MB/s", "latency": "10 us"}}]}


def tp_next_to_hop() -> Plan:
    """Stage 0 (layers 0-4) tensor-parallel over a100/0 and a100/1, stage 1 on a100/2:
    the hop a100/0 -> a100/2 (and back to both) shares a100/0's and a100/1's ports with
    the tensor-parallel ring."""
    stages = (StagePlan((0, 5), ("a100/0", "a100/1"), 2), StagePlan((5, 8), ("a100/2",), 1))
    return Plan("tiny-gpt", SLOW_PORTS, 32, "1f1b", 1, (PipelinePlan(8, 4, stages),))


CONTENTION = {
    # both pipelines' activations cross a100's one NIC out and v100's one NIC in
    "c-2pipes-1nic": plan("1f1b", pipeline(8, 4, [4], [A0, V0]),
                          pipeline(8, 4, [4], [A1, V1]), cluster=SLOW),
    "c-2pipes-2nic": plan("1f1b", pipeline(8, 4, [4], [A0, V0]),
                          pipeline(8, 4, [4], [A1, V1]), cluster=SLOW_2NIC),
    # the pipelines run in opposite directions: both data-parallel groups cross the NIC
    # (a100/0 with v100/1, v100/0 with a100/1), the last stages' all-reduce while the
    # first stages still receive gradients over it
    "c-dp-beside-sends-1nic": plan("1f1b", pipeline(8, 4, [4], [A0, V0]),
                                   pipeline(8, 4, [4], [V1, A1]), cluster=SLOW),
    "c-dp-beside-sends-2nic": plan("1f1b", pipeline(8, 4, [4], [A0, V0]),
                                   pipeline(8, 4, [4], [V1, A1]), cluster=SLOW_2NIC),
    "c-tp-beside-hop": tp_next_to_hop(),
}


def bubble_null_s(plan: Plan, cost: CostModel) -> float:
    """A null model that knows about bubbles: per pipeline (m + p - 1) x its busiest
    position's forward and backward of one micro-batch (p positions, m micro-batches;
    a position's chunks summed), the largest over pipelines, plus the slowest rank's
    data-parallel all-reduces of its fp32 gradients, one after another on idle links
    (`CostModel.allreduce_time_s`). No overlap, no per-action overhead beyond the
    profile's, no optimizer, no point-to-point transfer. Seconds."""
    pipe_s = 0.0
    for pipe in plan.pipelines:
        p = len(pipe.stages) // plan.chunks
        busy = [0.0] * p
        for k, st in enumerate(pipe.stages):
            dtype = cost.cluster.device(st.devices[0]).type.name
            busy[k % p] += sum(cost.stage_compute_s(st.layers, dtype, pipe.micro_batch, op,
                                                    st.tp, st.sequence_parallel, st.cp)
                               for op in ("F", "B"))
        pipe_s = max(pipe_s, (pipe.num_microbatches + p - 1) * max(busy))
    model = plan.load_model()
    reduce_s = [0.0] * len(plan.devices)
    for ranks, layers in dp_groups(plan):
        tp = next(r for r in placements(plan) if r.rank == ranks[0])
        tp_degree = len(tp.tp_ranks)
        nbytes = 4.0 * sum(model.layers[i].params for i in layers) / tp_degree
        t = cost.allreduce_time_s([plan.devices[r] for r in ranks], nbytes)
        for r in ranks:
            reduce_s[r] += t
    return pipe_s + max(reduce_s)


def profile_for(p: Plan, profile):
    """The calibrated profile for plan `p`: as it is on the demo cluster it was fitted
    on; on another cluster without its links and all-reduce fits (the demo cluster's,
    fitted from its runs' probes and collectives), so that the simulator prices that
    cluster's links from its file."""
    return profile if p.cluster == "demo-hetero" else replace(profile, links={},
                                                                  allreduce={})


def profiles(args) -> tuple[Profile, Profile]:
    """(tiny-gpt's layer profile measured natively here, the same stretched to
    demo-hetero's emulated device speeds); fills in `args.emulation_scale` when None
    (`auto_emulation_scale` for the cluster's ranks on this machine's cores)."""
    cluster = load_cluster("demo-hetero")
    if args.emulation_scale is None:
        args.emulation_scale = auto_emulation_scale(len(cluster.devices), os.cpu_count() or 1)
    native = measure_profile("tiny-gpt", "demo-hetero", emulate=False)
    return native, emulated_profile(native, emulation_factors(cluster, args.emulation_scale))


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
    native, base = profiles(args)
    with tempfile.TemporaryDirectory() as tmp:
        return _study(args, native, base, Path(tmp) / "native.json", t0)


def calibrated(args, native, base, native_path: Path):
    """(the run options of the study: `args.steps` steps at `args.emulation_scale`,
    emulated against the `native` profile, saved to `native_path`, unless
    `args.reference` is "measured"; the profile calibrated on the CALIBRATION runs from
    `base`), the calibration runs printed as they end."""
    native.save(native_path)
    opts = RunOptions(steps=args.steps, emulation_scale=args.emulation_scale,
                      reference_profile=None if getattr(args, "reference", "profile")
                      == "measured" else str(native_path))
    print(f"calibration runs ({len(CALIBRATION)}):", flush=True)
    traces = []
    for name, p in CALIBRATION.items():
        traces.append(run_plan(p, opts).trace)
        print(f"  {name}: {measured_iteration_s(traces[-1]) * 1e3:.1f} ms", flush=True)
    return opts, calibrate(traces, sources=list(CALIBRATION), base=base)


def _study(args, native, base, native_path: Path, t0: float) -> int:
    opts, profile = calibrated(args, native, base, native_path)

    # the plans' own link probes feed nothing here (only the calibration runs' do)
    plan_opts = replace(opts, probe_links=False)
    rows: list[Row] = []
    for group, plans in (("plans", PLANS), ("contention", CONTENTION)):
        for name, p in plans.items():
            cost = CostModel(p.load_model(), p.load_cluster(), profile_for(p, profile))
            predicted = simulate(p, cost).metrics.iteration_time_s
            measured = measured_iteration_s(run_plan(p, plan_opts).trace)
            rows.append(Row(name, group, predicted, measured, compute_only_s(p, cost),
                            bubble_null_s(p, cost)))
            print(f"  {name:<22} predicted {predicted * 1e3:7.1f} ms  measured "
                  f"{measured * 1e3:7.1f} ms  error {rows[-1].error:6.1%}", flush=True)

    print(f"\n{'plan':<23}{'predicted':>11}{'measured':>11}{'error':>8}{'null':>11}"
          f"{'null err':>9}{'bubble':>11}{'bub err':>9}{'resid err':>10}")
    for r in rows:
        print(f"{r.name:<23}{r.predicted_s * 1e3:>9.1f}ms{r.measured_s * 1e3:>9.1f}ms"
              f"{r.error:>8.1%}{r.null_s * 1e3:>9.1f}ms{r.null_error:>9.1%}"
              f"{r.bubble_s * 1e3:>9.1f}ms{r.bubble_error:>9.1%}"
              + (f"{r.residual:>10.1%}" if not math.isnan(r.residual) else f"{'n/a':>10}"))
    print(f"(emulation scale {args.emulation_scale}, reference {args.reference}, "
          f"{args.steps} steps per run, {time.perf_counter() - t0:.0f} s)")
    print(f"out of sample: {len(rows)} plans; calibrated on: {', '.join(CALIBRATION)}; "
          f"residual over the plans whose measured non-compute part is over "
          f"{RESIDUAL_MIN:.0%} of the iteration (else n/a)")
    for group in ("plans", "contention"):
        part = [r for r in rows if r.group == group]
        print(f"{group}: " + _figures(part) + f" n={len(part)}")
    tau = kendall_tau([r.predicted_s for r in rows], [r.measured_s for r in rows])
    resid = [r.residual for r in rows if not math.isnan(r.residual)]
    print(f"residual_mape={statistics.fmean(resid) if resid else math.nan:.4f} "
          f"kendall_tau={tau:.4f} max_ape={max(r.error for r in rows):.4f}")
    print(_figures(rows) + f" n_plans={len(rows)} "
          f"n_contention={sum(1 for r in rows if r.group == 'contention')}")
    return 0


@dataclass(frozen=True)
class Row:
    """One out-of-sample plan: predicted, measured and the two null models (seconds)."""

    name: str
    group: str              # "plans" or "contention"
    predicted_s: float
    measured_s: float
    null_s: float           # compute only
    bubble_s: float         # bubble_null_s

    @property
    def error(self) -> float:
        return relative_error(self.predicted_s, self.measured_s)

    @property
    def null_error(self) -> float:
        return relative_error(self.null_s, self.measured_s)

    @property
    def bubble_error(self) -> float:
        return relative_error(self.bubble_s, self.measured_s)

    @property
    def residual(self) -> float:
        """|predicted - measured| / the measured non-compute part (nan when that part is
        under RESIDUAL_MIN of the iteration: within noise)."""
        rest = self.measured_s - self.null_s
        return abs(self.predicted_s - self.measured_s) / rest \
            if rest > RESIDUAL_MIN * self.measured_s else math.nan


def _figures(rows: list[Row]) -> str:
    return (f"mape={statistics.fmean(r.error for r in rows):.4f} "
            f"mape_null={statistics.fmean(r.null_error for r in rows):.4f} "
            f"mape_null_bubble={statistics.fmean(r.bubble_error for r in rows):.4f}")


if __name__ == "__main__":
    sys.exit(main())
