"""`hyperpipe demo`: the whole loop on built-in defaults, on this machine.

1. Profile each layer kind of the model here at native speed. Stretched by each device
   type's emulation factor it is the cost model's starting point; as it is, it is the
   runs' emulation reference (a shared machine's speed drifts from second to second;
   one profile holds both runs to the same native speed).
2. Run the uniform baseline (Megatron's default on every device: equal layers, 1F1B)
   for real with the executor (real compute and communication, device speeds emulated
   on the CPU), tracing every action.
3. Calibrate from that run only and search again: the best plan. Predict its iteration
   time now, before it has ever run: the out-of-sample prediction.
4. Run the best plan for real; its measured time is the median of the step periods
   after warm-up, their spread ((max - min) / 2 / median) says how much of any error
   is this machine's noise.
5. Calibrate the cost model from both measured traces and simulate both again: the
   in-sample figure (the model has seen the run it is judged on); "before calibration"
   is the layer profile alone.
6. Report out-of-sample first, then in-sample and before calibration, and the speed-up
   of best over uniform; write report.json, plans, traces (ours and Chrome's), timelines.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import write_atomic
from hyperpipe.exec.emulation import auto_emulation_scale
from hyperpipe.sim.accuracy import compare, relative_error, step_periods_s


@dataclass(frozen=True)
class DemoConfig:
    out_dir: Path = Path("hyperpipe-demo")
    cluster: str = "demo-hetero"
    model: str = "tiny-gpt"
    global_batch: int = 16
    micro_batch: int = 2
    steps: int = 6              # the first is warm-up: the figures use the rest
    emulation_scale: float | None = None    # None: `auto_emulation_scale`
    seed: int = 0
    workers: int = 1


def _log(msg: str) -> None:
    print(msg, flush=True)


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.exec import RunOptions, run_plan
    from hyperpipe.exec.emulation import emulation_factors
    from hyperpipe.exec.profiler import emulated_profile, measure_profile
    from hyperpipe.models import load_model
    from hyperpipe.search.search import SearchConstraints, search
    from hyperpipe.sim.calibrate import calibrate
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate
    from hyperpipe.sim.timeline import plot_timelines

    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise BadInput("--out", "a directory", str(out))
    out.mkdir(parents=True, exist_ok=True)
    model, cluster = load_model(cfg.model), load_cluster(cfg.cluster)
    if cfg.emulation_scale is None:
        cfg = replace(cfg, emulation_scale=auto_emulation_scale(len(cluster.devices),
                                                                os.cpu_count() or 1))

    _log(f"[1/5] profiling the layers of {cfg.model} on this CPU "
         f"(device speeds of {cfg.cluster} emulated, scale {cfg.emulation_scale})")
    native = measure_profile(cfg.model, cfg.cluster, emulate=False)
    native.save(out / "profile_native.json")   # emulation's compute reference for the runs
    layer_profile = emulated_profile(native, emulation_factors(cluster, cfg.emulation_scale))
    layer_profile.save(out / "profile_layers.json")

    # tp=1: the executor simulates tensor parallelism but does not run it
    constraints = SearchConstraints(global_batch=cfg.global_batch, micro_batch=cfg.micro_batch,
                                    tp=1)

    def run(name: str, plan) -> None:
        plan.save(out / f"plan_{name}.json")
        result = run_plan(plan, RunOptions(
            steps=cfg.steps, seed=cfg.seed, emulation_scale=cfg.emulation_scale,
            reference_profile=str(out / "profile_native.json"),
            trace_path=str(out / f"trace_{name}_measured.json"),
            chrome_path=str(out / f"chrome_{name}_measured.json")))
        measured[name] = result.trace

    _log(f"[2/5] the uniform baseline on all {len(cluster.devices)} devices of {cfg.cluster} "
         f"for {cfg.model}, global batch {cfg.global_batch} (layer profile only)")
    plans = {"uniform": _uniform_all_devices(model, cluster, cfg, layer_profile)}
    measured: dict = {}
    _log(f"[3/5] running the uniform plan for real ({cfg.steps} steps, "
         f"{len(plans['uniform'].devices)} ranks): {_describe(plans['uniform'])}")
    run("uniform", plans["uniform"])

    # Why search again: the layer profile knows compute but not what each action costs
    # around it on this machine (dispatch, messages, wake-ups); one real run tells.
    first_fit = calibrate([measured["uniform"]], sources=["trace_uniform_measured.json"],
                          base=layer_profile)
    result = search(model, cluster, constraints, profile=first_fit, workers=cfg.workers)
    # the tie margin is at least the uniform run's own step-to-step spread: plans closer
    # than what this machine's noise moves are not told apart by the measurement
    margin = max(TIE_MARGIN, _spread(step_periods_s(measured["uniform"])))
    plans["best"] = pick_stable(result.ranked, CostModel(model, cluster), margin)
    _log(f"      searched again with the run's costs: {result.candidates_evaluated} "
         f"candidates in {result.search_time_s:.1f} s")
    # out of sample: predicted from the uniform run alone, before the best plan runs
    oos_cost = CostModel(model, cluster, first_fit)
    predicted_oos = {k: simulate(p, oos_cost).metrics.iteration_time_s
                     for k, p in plans.items()}
    _log(f"      predicted before running it (calibrated on the uniform run only): "
         f"{predicted_oos['best'] * 1e3:.1f} ms per iteration")
    _log(f"      picked with a tie margin of {margin:.0%} (plans within it of the fastest "
         "prediction are ties; the uncalibrated cost model decides among them)")
    _log(f"[4/5] running the best plan for real: {_describe(plans['best'])}")
    run("best", plans["best"])

    before_cost = CostModel(model, cluster, layer_profile)
    predicted_before = {k: simulate(p, before_cost) for k, p in plans.items()}

    _log("[5/5] calibrating from both measured traces and simulating again")
    profile = calibrate([measured[k] for k in plans],
                        sources=[f"trace_{k}_measured.json" for k in plans],
                        base=layer_profile)
    profile.save(out / "profile_calibrated.json")
    after_cost = CostModel(model, cluster, profile)
    predicted_after = {k: simulate(p, after_cost) for k, p in plans.items()}

    rows = {}
    for name in plans:
        acc = compare(predicted_after[name].metrics.iteration_time_s,
                      predicted_after[name].trace, measured[name])
        before_s = predicted_before[name].metrics.iteration_time_s
        rows[name] = {"measured_s": acc.measured_iteration_s, "before_s": before_s,
                      "after_s": acc.predicted_iteration_s,
                      "error_before": relative_error(before_s, acc.measured_iteration_s),
                      "error_after": acc.error, "action_mape_after": acc.action_mape}
        predicted_after[name].trace.save(out / f"trace_{name}_predicted.json")
        predicted_after[name].trace.save_chrome(out / f"chrome_{name}_predicted.json")
        plot_timelines([predicted_after[name].trace, measured[name]],
                       [f"{name}: predicted (calibrated)", f"{name}: measured (emulated)"],
                       out / f"timeline_{name}.png")

    for name in plans:
        periods = step_periods_s(measured[name])
        rows[name]["step_periods_s"] = periods
        rows[name]["spread"] = _spread(periods)
    notes = calibration_notes(rows)
    for line in notes:
        _log(f"note: {line}")
    speedup_measured = rows["uniform"]["measured_s"] / rows["best"]["measured_s"]
    speedup_predicted = rows["uniform"]["after_s"] / rows["best"]["after_s"]
    speedup_oos = predicted_oos["uniform"] / predicted_oos["best"]
    measured_best = rows["best"]["measured_s"]
    report = {
        "error_out_of_sample": relative_error(predicted_oos["best"], measured_best),
        "predicted_iteration_time_out_of_sample_s": predicted_oos["best"],
        "measured_spread": rows["best"]["spread"],
        "measured_step_periods_s": rows["best"]["step_periods_s"],
        "plan": plans["best"].to_dict(),
        "baseline_plan": plans["uniform"].to_dict(),
        "measured_iteration_time_s": rows["best"]["measured_s"],
        "predicted_iteration_time_s": rows["best"]["after_s"],
        "predicted_iteration_time_before_calibration_s": rows["best"]["before_s"],
        "error_before_calibration": rows["best"]["error_before"],
        "error_after_calibration": rows["best"]["error_after"],
        "baseline": rows["uniform"],
        "speedup_vs_uniform_measured": speedup_measured,
        "speedup_vs_uniform_predicted": speedup_predicted,
        "speedup_prediction_error": relative_error(speedup_predicted, speedup_measured),
        "speedup_vs_uniform_predicted_out_of_sample": speedup_oos,
        "speedup_prediction_error_out_of_sample": relative_error(speedup_oos,
                                                                 speedup_measured),
        "emulated": any(t.emulated for t in measured.values()),
        "emulation_scale": cfg.emulation_scale,
        "search": {"candidates_evaluated": result.candidates_evaluated,
                   "search_time_s": result.search_time_s},
        "metrics_predicted": predicted_after["best"].metrics.to_dict(),
        "calibration_notes": notes,
        "tie_margin": margin,
        "wall_time_s": time.perf_counter() - t_start,
    }
    write_atomic(out / "report.json", json.dumps(report, indent=1) + "\n")
    _print_report(report, rows, out)
    return report


def _uniform_all_devices(model, cluster, cfg: DemoConfig, profile):
    """The Megatron/DeepSpeed default on every device of the cluster: equal layers per
    stage, 1F1B, homogeneous data parallelism, the (pp, dp) the simulator likes best with
    the layer profile. Why not the search's tuned `uniform` baseline (which may leave a
    device type out, or interleave): this run is the only one calibration sees before
    the prediction, so it must exercise every device type the best plan may use."""
    from hyperpipe.core.errors import InfeasiblePlan
    from hyperpipe.search.baselines import uniform_plan
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate
    n = len(cluster.devices)
    cost = CostModel(model, cluster, profile)
    best = None
    for pp in range(1, n + 1):
        if n % pp or pp > model.num_layers:
            continue
        try:
            plan = uniform_plan(model, cluster, pp=pp, dp=n // pp, micro_batch=cfg.micro_batch,
                                global_batch=cfg.global_batch)
        except (InfeasiblePlan, BadInput):
            continue
        t = simulate(plan, cost).metrics.iteration_time_s
        if best is None or t < best[0]:
            best = (t, plan)
    if best is None:
        raise InfeasiblePlan(f"no uniform plan over all {n} devices of {cluster.name}")
    return best[1]


# why: on an idle machine emulated step times spread by a few percent from run to run;
# plans closer than this are a tie that calibration noise could flip (a loaded machine's
# own measured spread widens the margin, see run_demo)
TIE_MARGIN = 0.05


def pick_stable(ranked: list, analytic_cost, margin: float = TIE_MARGIN):
    """The plan to run: among the ranked feasible plans within `margin` of the fastest
    prediction, the one the uncalibrated cost model (catalog figures only, no
    measurement, so no noise) predicts fastest; ties broken by the plan's text."""
    feasible = [c for c in ranked if c.metrics.feasible] or list(ranked)
    fastest = min(c.metrics.iteration_time_s for c in feasible)
    near = [c for c in feasible if c.metrics.iteration_time_s <= fastest * (1 + margin)]
    from hyperpipe.sim.simulator import simulate
    return min(near, key=lambda c: (simulate(c.plan, analytic_cost).metrics.iteration_time_s,
                                    json.dumps(c.plan.to_dict(), sort_keys=True))).plan


def calibration_notes(rows: dict) -> list[str]:
    """A line for every plan whose prediction calibration made worse, saying why: within
    the measured steps' own spread (the machine's speed drifted), or beyond it (the
    costs fitted on the runs do not carry over to that plan)."""
    notes = []
    for name, r in rows.items():
        if r["error_after"] <= r["error_before"]:
            continue
        worse = r["error_after"] - r["error_before"]
        why = (f"within the measured steps' spread (+-{r['spread']:.1%}): this machine's "
               "speed drifted during the run" if worse <= r["spread"] else
               f"beyond the measured steps' spread (+-{r['spread']:.1%}): the per-action "
               "costs fitted on the runs do not carry over to this plan")
        notes.append(f"calibration made the {name} plan's prediction worse "
                     f"({r['error_before']:.1%} -> {r['error_after']:.1%}), {why}")
    return notes


def _describe(plan) -> str:
    parts = []
    for i, pipe in enumerate(plan.pipelines):
        stages = ", ".join(f"[{s.layers[0]}, {s.layers[1]})@{'+'.join(s.devices)}"
                           for s in pipe.stages)
        parts.append(f"pipeline {i}: mb {pipe.micro_batch} x {pipe.num_microbatches} [{stages}]")
    return f"{plan.schedule} (chunks {plan.chunks}); " + "; ".join(parts)


def _spread(periods: list[float]) -> float:
    """Run-to-run spread of a run's step periods: (max - min) / 2 / median (0 with
    fewer than two periods)."""
    if len(periods) < 2:
        return 0.0
    return (max(periods) - min(periods)) / 2 / statistics.median(periods)


def _print_report(report: dict, rows: dict, out: Path) -> None:
    emu = " (device speeds emulated on this CPU)" if report["emulated"] else ""
    _log("")
    _log(f"out of sample (calibrated on the uniform run only, predicted before the best "
         f"plan ran): predicted {report['predicted_iteration_time_out_of_sample_s'] * 1e3:.1f}"
         f" ms, measured {report['measured_iteration_time_s'] * 1e3:.1f} ms (median of "
         f"{len(report['measured_step_periods_s'])} steps, spread "
         f"+-{report['measured_spread']:.1%}): error {report['error_out_of_sample']:.1%}")
    _log(f"speed-up of best over uniform predicted out of sample: "
         f"{report['speedup_vs_uniform_predicted_out_of_sample']:.2f}x "
         f"({report['speedup_prediction_error_out_of_sample']:.1%} from measured)")
    _log("")
    _log(f"iteration time{emu}; 'after' is in-sample (calibrated on these very runs):")
    _log(f"{'plan':<10}{'predicted before':>18}{'predicted after':>17}{'measured':>11}"
         f"{'error before':>14}{'error after':>13}{'spread':>9}")
    for name, r in rows.items():
        _log(f"{name:<10}{r['before_s'] * 1e3:>16.1f}ms{r['after_s'] * 1e3:>15.1f}ms"
             f"{r['measured_s'] * 1e3:>9.1f}ms{r['error_before']:>14.1%}{r['error_after']:>13.1%}"
             f"{r['spread']:>9.1%}")
    _log(f"speed-up of best over uniform: measured {report['speedup_vs_uniform_measured']:.2f}x,"
         f" predicted {report['speedup_vs_uniform_predicted']:.2f}x "
         f"({report['speedup_prediction_error']:.1%} apart)")
    _log(f"wrote {out}/report.json, plans, traces (trace_*.json; chrome_*.json open in "
         f"Perfetto) and timelines (timeline_*.png) in {report['wall_time_s']:.0f} s")
