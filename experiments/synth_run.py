"""A synthesised schedule run for real: measured step time against simulated.

On `demo-hetero` with `tiny-gpt` (device speeds emulated on this CPU, as `hyperpipe
demo` does): profile the layers here once, take a 2-stage A100 + V100 plan, run it
with its best fixed kind for real and calibrate the cost model from that run alone.
Then synthesise a schedule for the same stages from the calibrated costs, run it for
real and compare its measured step time with its simulated one. The synthesised run
is out of sample: no figure of its own run went into the costs that predict it.
Compute follows the layer profile; the A100-V100 link is emulated from the cluster file
by the link emulator (exec.links), independently of the simulator.
Losses of the two runs are printed side by side (same seed and data: they must agree;
tests/test_exec_dist.py checks the synthesised run against a single-process run).

Last line: ``synth_measured_s=A synth_simulated_s=B error=C fixed_measured_s=D
fixed_simulated_s=E loss_diff=F``.

    python experiments/synth_run.py [--steps 6] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.exec import RunOptions, run_plan
from hyperpipe.exec.emulation import auto_emulation_scale, emulation_factors
from hyperpipe.exec.profiler import emulated_profile, measure_profile
from hyperpipe.models import load_model
from hyperpipe.search.baselines import proportional_plan
from hyperpipe.sim.accuracy import compare, relative_error
from hyperpipe.sim.calibrate import calibrate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate
from hyperpipe.synth.synthesise import synthesise

# emulation scale for its two ranks, as the demo chooses (2 on 2 cores)
SCALE = auto_emulation_scale(2, os.cpu_count() or 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per run (first: warm-up)")
    ap.add_argument("--out", help="directory for plans and traces (default: a temp dir)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="synth-run-"))
    out.mkdir(parents=True, exist_ok=True)
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    native = measure_profile("tiny-gpt", "demo-hetero", emulate=False)
    native.save(out / "profile_native.json")
    layers = emulated_profile(native, emulation_factors(cluster, SCALE))
    # a heterogeneous pipeline: the A100 first, the V100 second, layers cut in
    # proportion to their peak FLOP/s (what the search gives here may use one type only)
    base = proportional_plan(model, cluster, pp=2, micro_batch=2, global_batch=16,
                             schedule="zb-h1", devices=["a100/0", "v100/0"])

    def run(name: str, plan):
        plan.save(out / f"plan_{name}.json")
        return run_plan(plan, RunOptions(
            steps=args.steps, emulation_scale=SCALE,
            reference_profile=str(out / "profile_native.json"),
            trace_path=str(out / f"trace_{name}.json")))

    first = synthesise(base, CostModel(model, cluster, layers))
    fixed_plan = replace(base, schedule=first.fixed_kind, actions=None)
    fixed_run = run("fixed", fixed_plan)
    profile = calibrate([fixed_run.trace], sources=["trace_fixed.json"], base=layers)
    cost = CostModel(model, cluster, profile)
    result = synthesise(fixed_plan, cost)
    synth = result.synth_plan
    print(f"plan: {[(s.layers, s.devices[0]) for s in base.pipelines[0].stages]}, "
          f"m={base.pipelines[0].num_microbatches}; best fixed kind {result.fixed_kind}; "
          f"synthesis {result.elapsed_s * 1e3:.0f} ms, "
          f"{'synth wins' if result.plan.schedule == 'synth' else 'fixed kind kept'}")
    synth_run = run("synth", synth)
    rows = {}
    for name, plan, measured in (("fixed", fixed_plan, fixed_run), ("synth", synth,
                                                                    synth_run)):
        sim = simulate(plan, cost)
        acc = compare(sim.metrics.iteration_time_s, sim.trace, measured.trace)
        rows[name] = (acc.measured_iteration_s, acc.predicted_iteration_s)
        print(f"{name:<6} measured {acc.measured_iteration_s * 1e3:8.1f} ms  simulated "
              f"{acc.predicted_iteration_s * 1e3:8.1f} ms  error {acc.error:+.1%}  "
              f"({'in' if name == 'fixed' else 'out of'} sample)")
    loss_diff = max(abs(a - b) for a, b in zip(fixed_run.losses, synth_run.losses,
                                               strict=True))
    print(f"losses fixed {[round(x, 6) for x in fixed_run.losses]}")
    print(f"losses synth {[round(x, 6) for x in synth_run.losses]}")
    (sm, ss), (fm, fs) = rows["synth"], rows["fixed"]
    print(f"synth_measured_s={sm:.4f} synth_simulated_s={ss:.4f} "
          f"error={relative_error(ss, sm):.3f} fixed_measured_s={fm:.4f} "
          f"fixed_simulated_s={fs:.4f} loss_diff={loss_diff:.2e}")


if __name__ == "__main__":
    main()
