"""Where ZeRO-3's once-a-step gathers start, against emulated runs.

Without resharding after forward, ZeRO-3 gathers each stage's weights once a step. A
rank of several stages issues all their gathers at the step's start (torch's
multi-stage pipelining runtime; `hyperpipe.sim.sharding.first_forwards`); a rank of one
stage gathers in its first forward. This script runs two tiny-gpt plans whose
data-parallel groups cross the one inter-node link of a two-node cluster (the demo's
devices, the link slowed to LINKS), ZeRO-3 over dp 2: an interleaved pipeline of two
stages a rank and a 1F1B pipeline of one stage a rank. Each is predicted by the
simulator (compute calibrated as `accuracy.py` does, on its two dense calibration
plans; links from the cluster file, not from the calibration, which saw other links)
and measured in an emulated run; beside the prediction, the same simulator with every
rank gathering in its first forward (the model before `first_forwards`, for
comparison). Out of sample: nothing here was fitted to these runs.

Prints per link speed and plan ``link=L plan=P measured_ms=M predicted_ms=X error=E
first_forward_model_error=F``.

    python experiments/accuracy_gathers.py [--steps 5] [--emulation-scale 12]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from accuracy import A0, A1, V0, V1, calibrated, profiles

import hyperpipe.sim.program as program
from hyperpipe.exec import run_plan
from hyperpipe.plan.plan import Plan, plan_from_dict
from hyperpipe.sim.accuracy import measured_iteration_s
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.sharding import FirstForward, first_forwards
from hyperpipe.sim.simulator import simulate

LINKS = ("100 Mbit/s", "10 Mbit/s")


def cluster(link: str) -> dict:
    """demo-hetero's devices with its inter-node link at `link`."""
    return {"nodes": [{"name": "a100", "device": "A100-80GB", "count": 2},
                      {"name": "v100", "device": "V100-32GB", "count": 2}],
            "inter_node": {"bandwidth": link, "latency": "10 us"}}


def sharded(link: str, kind: str, chunks: int, cuts: list[tuple[int, int]]) -> Plan:
    """Two pipelines, one on each node, stage k on the node's device k mod 2: each
    stage's data-parallel group is one A100 and one V100, across the link."""
    pipes = [{"micro_batch": 2, "num_microbatches": 4,
              "stages": [{"layers": list(c), "devices": [devs[k % 2]], "tp": 1}
                         for k, c in enumerate(cuts)]}
             for devs in ((A0, A1), (V0, V1))]
    return plan_from_dict({"format": "hyperpipe.plan/1", "model": "tiny-gpt",
                           "cluster": cluster(link), "global_batch": 16,
                           "schedule": {"kind": kind, "chunks": chunks}, "zero": 3,
                           "pipelines": pipes})


@contextlib.contextmanager
def gathers_in_first_forward():
    """The simulator with every rank gathering in its first forward (the model a rank
    of one stage keeps), for comparison only."""
    def lazy(gathers):
        return [FirstForward(0.0, g.extra_s) for g in gathers]
    program.first_forwards = lazy
    try:
        yield
    finally:
        program.first_forwards = first_forwards


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--emulation-scale", type=float, default=12.0,
                    help="as accuracy_sharded.py: large enough to outrun the "
                    "per-collective costs of gloo and the link emulator")
    args = ap.parse_args()
    native, base = profiles(args)
    with tempfile.TemporaryDirectory() as tmp:
        opts, profile = calibrated(args, native, base, Path(tmp) / "native.json")
        # compute from the calibration; links from each plan's own cluster file
        profile = replace(profile, links={}, allreduce={})
        for link in LINKS:
            plans = {"interleaved-pp2x2": sharded(link, "interleaved-1f1b", 2,
                                                  [(0, 3), (3, 5), (5, 7), (7, 8)]),
                     "1f1b-pp2": sharded(link, "1f1b", 1, [(0, 5), (5, 8)])}
            for name, plan in plans.items():
                def predict(plan=plan):
                    cost = CostModel(plan.load_model(), plan.load_cluster(), profile)
                    return simulate(plan, cost).metrics.iteration_time_s
                predicted = predict()
                with gathers_in_first_forward():
                    lazy = predict()
                measured = measured_iteration_s(
                    run_plan(plan, replace(opts, probe_links=False)).trace)
                print(f"link={link.replace(' ', '')} plan={name} "
                      f"measured_ms={measured * 1e3:.1f} predicted_ms={predicted * 1e3:.1f} "
                      f"error={predicted / measured - 1:+.4f} "
                      f"first_forward_model_error={lazy / measured - 1:+.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
