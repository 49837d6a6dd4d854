"""How close are the simulator's iteration times for sharded plans (ZeRO-2, ZeRO-3 /
FSDP) to real runs?

The sibling of `accuracy.py`, with its calibration: per-layer profiling here, scaled to
the two short dense runs of `accuracy.CALIBRATION` (no sharded plan among them). Then
predicts and measures PLANS (tiny-gpt on the demo cluster, device speeds emulated on
this CPU, links emulated by exec.links from the cluster file's nominal figures,
independently of the simulator), each of them out of sample: ZeRO-3 run with torch
FSDP2 (exec.fsdp) with and without resharding after forward, alone, inside a two-stage
pipeline and inside an interleaved one of two stages a rank; ZeRO-2
(exec.dataparallel); and context parallelism (cp 2 per stage of a two-stage pipeline,
ring attention: exec.context_parallel). Replicas are alike (each data-parallel group on
one node's two devices of one type): the simulator times the gathers and
reduce-scatters of a stage on idle links per replica, not in lock-step with the other
replicas' compute.

Null models as in `accuracy.py`: compute only, and the bubble null (which knows
nothing of sharding: its all-reduce stands for the gradient sync). Prints a row per
plan and last ``mape=X mape_null=Y mape_null_bubble=W n_plans=N`` (out of sample;
in-sample: the calibration plans, whose errors are not figures).

    python experiments/accuracy_sharded.py [--steps 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from accuracy import (
    A0,
    A1,
    CALIBRATION,
    V0,
    V1,
    Row,
    _figures,
    bubble_null_s,
    calibrated,
    profiles,
)

from hyperpipe.exec import run_plan
from hyperpipe.plan.plan import PipelinePlan, Plan, StagePlan
from hyperpipe.plan.stack import RuntimeOverrides
from hyperpipe.sim.accuracy import compute_only_s, measured_iteration_s
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate


def sharded(zero: int, pipes: list[tuple[int, int, list[tuple[tuple[int, int], str]]]], *,
            kind: str = "1f1b", chunks: int = 1, reshard: bool | None = None) -> Plan:
    """A plan of tiny-gpt on demo-hetero with ZeRO stage `zero`: each pipe (micro-batch,
    count, [(layers, device)])."""
    pipelines = tuple(PipelinePlan(mb, m, tuple(StagePlan(layers, (dev,))
                                                for layers, dev in stages))
                      for mb, m, stages in pipes)
    return Plan("tiny-gpt", "demo-hetero", sum(p.samples for p in pipelines), kind, chunks,
                pipelines, zero=zero,
                runtime=RuntimeOverrides(reshard_after_forward=reshard))


def _two_stage(a: str, v: str) -> list[tuple[tuple[int, int], str]]:
    return [((0, 5), a), ((5, 8), v)]


def _four_stage(a: str, v: str) -> list[tuple[tuple[int, int], str]]:
    return [((0, 3), a), ((3, 5), v), ((5, 7), a), ((7, 8), v)]


PLANS = {
    # ZeRO-3 within one node's A100s, one stage: FSDP's default (reshard after forward)
    "fsdp-dp2-a100": sharded(3, [(2, 4, [((0, 8), A0)]), (2, 4, [((0, 8), A1)])]),
    # torchtitan's PP x FSDP: one gather and one reduce-scatter per stage and step
    "fsdp-pp2-dp2": sharded(3, [(2, 4, _two_stage(A0, V0)), (2, 4, _two_stage(A1, V1))]),
    # the same, gathered and reduce-scattered every micro-batch
    "fsdp-pp2-dp2-reshard": sharded(3, [(2, 4, _two_stage(A0, V0)),
                                        (2, 4, _two_stage(A1, V1))], reshard=True),
    # two stages a rank (interleaved): each rank gathers both at the step's start
    "fsdp-pp2x2-dp2": sharded(3, [(2, 4, _four_stage(A0, V0)), (2, 4, _four_stage(A1, V1))],
                              kind="interleaved-1f1b", chunks=2),
    "zero2-pp2-dp2": sharded(2, [(2, 4, _two_stage(A0, V0)), (2, 4, _two_stage(A1, V1))]),
    # context parallelism (exec.context_parallel): each stage's sequence over one node's
    # two devices, ring attention's K/V hops over the intra-node links, the gradients
    # summed over the context ranks
    "cp2-pp2": Plan("tiny-gpt", "demo-hetero", 16, "1f1b", 1, (PipelinePlan(2, 8, (
        StagePlan((0, 4), (A0, A1), 1, cp=2), StagePlan((4, 8), (V0, V1), 1, cp=2))),)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--emulation-scale", type=float, default=None,
                        help="default: exec.emulation.auto_emulation_scale for 4 ranks")
    args = parser.parse_args()
    t0 = time.perf_counter()
    print("profiling each layer kind here (the base of calibration and of emulation)",
          flush=True)
    native, base = profiles(args)
    with tempfile.TemporaryDirectory() as tmp:
        opts, profile = calibrated(args, native, base, Path(tmp) / "native.json")
        rows = []
        for name, p in PLANS.items():
            cost = CostModel(p.load_model(), p.load_cluster(), profile)
            predicted = simulate(p, cost).metrics.iteration_time_s
            measured = measured_iteration_s(run_plan(p, replace(opts, probe_links=False))
                                            .trace)
            rows.append(Row(name, "sharded", predicted, measured, compute_only_s(p, cost),
                            bubble_null_s(p, cost)))
            r = rows[-1]
            print(f"  {name:<22} predicted {predicted * 1e3:7.1f} ms  measured "
                  f"{measured * 1e3:7.1f} ms  error {r.error:.4f}  null {r.null_error:.4f}"
                  f"  bubble null {r.bubble_error:.4f}", flush=True)
    print(f"(emulation scale {args.emulation_scale}, {args.steps} steps per run, "
          f"{time.perf_counter() - t0:.0f} s; out of sample: {len(rows)} plans; "
          f"calibrated on the dense {', '.join(CALIBRATION)})")
    print(_figures(rows) + f" max_ape={max(r.error for r in rows):.4f} n_plans={len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
