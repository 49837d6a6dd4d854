"""`hyperpipe demo`: the whole loop on built-in defaults, on this machine.

1. Profile each layer kind here at native speed (the runs' emulation reference; stretched
   by each device type's emulation factor, the cost model's starting point).
2. Run the uniform baseline (equal layers, 1F1B, every device) for real, device speeds
   emulated on the CPU, tracing every action.
3. Calibrate from that run only and search again; predict the best plan's iteration time
   before it has ever run (out of sample).
4. Run the best plan for real: its time is the median step period after warm-up, their
   spread ((max - min) / 2 / median) this machine's noise. Run the tuned baseline for
   real too (the best plan of the uniform family, Megatron-LM's and DeepSpeed's default
   partition, over pp, dp, tp, micro-batch, schedule kind and device subset, picked by
   the same calibrated simulator; `hyperpipe.search.baselines`), unless it is one of the
   two plans already run: the speed-up that counts is over it, printed beside the one
   over the uniform plan forced onto every device.
5. Calibrate from the uniform and best runs and simulate the plans again (in sample for
   those two); "before calibration" is the layer profile alone.
6. Report, and write report.json, plans, traces (ours and Chrome's) and timelines.

Runs emulate the cluster on this CPU (docs/emulation.md): compute follows the layer
profile, links the cluster file's nominal figures through the link emulator, which is
independent of the simulator.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hyperpipe.cli import args as ca
from hyperpipe.cli.flags import command
from hyperpipe.cli.output import EXIT_OK
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
    micro_batch: int = 2        # of the uniform run calibration starts from
    steps: int = 6              # the first is warm-up: the figures use the rest
    emulation_scale: float | None = None    # None: `auto_emulation_scale`
    seed: int = 0
    workers: int = 1

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> DemoConfig:
        return cls(out_dir=Path(ns.out), steps=ns.steps, emulation_scale=ns.emulation_scale,
                   workers=ns.workers)


def add_parser(sub) -> None:
    p = command(sub, "demo", "the main job: search, simulate, run for real, calibrate, "
                "report (built-in defaults)")
    p.add_argument("--out", type=ca.path, default="hyperpipe-demo", help="output directory")
    p.add_argument("--steps", type=ca.STEPS, default=6, help="training steps per real run")
    p.add_argument("--emulation-scale", type=ca.EMULATION_SCALE, default=None,
                   help="stretch every emulated device by this factor (>= 1; default: "
                   "enough that ranks sharing this machine's cores do not slow each "
                   "other, 3 for 4 ranks on 2 cores)")
    p.add_argument("--workers", type=ca.WORKERS, default=1, help="search worker processes")
    p.set_defaults(options=DemoConfig.from_namespace, run=run)


def run(cfg: DemoConfig) -> int:
    """`hyperpipe demo`: the output folder checked before minutes of work, then the demo."""
    if cfg.steps < 2:
        raise BadInput("--steps", "at least 2 (the first step is warm-up)", cfg.steps)
    from hyperpipe.core.files import probe_folder
    if os.path.lexists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
        raise BadInput(f"--out {cfg.out_dir}", "a folder (or a new path)", has_got=False)
    try:
        probe_folder(cfg.out_dir)      # before minutes of work, not after
    except BadInput as exc:
        raise BadInput(f"--out {exc.where}", exc.expected, has_got=False) from None
    for name in output_names():
        path = Path(cfg.out_dir) / name
        if os.path.lexists(path) and not os.path.isfile(path):
            raise BadInput(f"--out {path}", "a file the demo may replace (it is a folder "
                           "or another kind of file)", has_got=False)
    run_demo(cfg)
    return EXIT_OK


PLAN_NAMES = ("uniform", "best", "tuned")    # the plans the demo runs, in that order


# The files the demo writes in its folder; {} is a plan's name (`PLAN_NAMES`)
REPORT_FILE = "report.json"
NATIVE_PROFILE_FILE = "profile_native.json"         # this CPU's layer times, unstretched
LAYER_PROFILE_FILE = "profile_layers.json"          # stretched per device type
CALIBRATED_PROFILE_FILE = "profile_calibrated.json"
PLAN_FILE = "plan_{}.json"
MEASURED_TRACE_FILE = "trace_{}_measured.json"
MEASURED_CHROME_FILE = "chrome_{}_measured.json"
PREDICTED_TRACE_FILE = "trace_{}_predicted.json"
PREDICTED_CHROME_FILE = "chrome_{}_predicted.json"
TIMELINE_FILE = "timeline_{}.png"


def output_names() -> list[str]:
    """The files the demo writes in its folder (the tuned baseline's only when it runs)."""
    per_plan = (PLAN_FILE, MEASURED_TRACE_FILE, MEASURED_CHROME_FILE, PREDICTED_TRACE_FILE,
                PREDICTED_CHROME_FILE, TIMELINE_FILE)
    return [REPORT_FILE, NATIVE_PROFILE_FILE, LAYER_PROFILE_FILE, CALIBRATED_PROFILE_FILE
            ] + [f.format(n) for n in PLAN_NAMES for f in per_plan]


def _log(msg: str) -> None:
    print(msg, flush=True)


@dataclass(frozen=True)
class Setup:
    """The demo's inputs, loaded: the emulation scale resolved, the output folder made."""

    cfg: DemoConfig
    out: Path
    model: Any                  # ModelSpec
    cluster: Any                # Cluster


@dataclass(frozen=True)
class LayerProfiles:
    """Step 1: the layer kinds timed here at native speed (the runs' emulation
    reference) and stretched by each device type's factor (the cost model's start)."""

    native: Any                 # Profile
    emulated: Any               # Profile


@dataclass(frozen=True)
class Searched:
    """Step 3: the search calibrated on the uniform run alone, the plan picked from it
    with its tie margin, and both plans' iteration times predicted before the pick ran."""

    first_fit: Any              # Profile calibrated on the uniform run
    result: Any                 # SearchResult
    margin: float
    best: Any                   # Plan
    predicted_oos_s: dict[str, float]     # "uniform", "best" -> seconds per iteration


@dataclass(frozen=True)
class Tuned:
    """The tuned baseline (step 4): its plan, which run measured it ("tuned", or "best"
    or "uniform" when it is that plan), and its time predicted before it ran."""

    plan: Any                   # Plan
    run: str
    predicted_oos_s: float


@dataclass(frozen=True)
class Resimulated:
    """Step 5: both plans simulated with the layer profile alone and with the profile
    calibrated on both runs."""

    profile: Any                # Profile calibrated on both runs
    before: dict[str, Any]      # plan name -> SimResult
    after: dict[str, Any]


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """The six steps of the module doc; returns report.json's object."""
    t_start = time.perf_counter()
    setup = _setup(cfg)
    layers = _profile_layers(setup)
    uniform = _uniform_baseline(setup, layers)
    _log(f"[3/5] running the uniform plan for real ({setup.cfg.steps} steps, "
         f"{len(uniform.devices)} ranks): {_describe(uniform)}")
    measured_uniform = _run_for_real(setup, "uniform", uniform)
    searched = _search_again(setup, layers, uniform, measured_uniform)
    _log(f"[4/5] running the best plan for real: {_describe(searched.best)}")
    plans = {"uniform": uniform, "best": searched.best}
    measured = {"uniform": measured_uniform,
                "best": _run_for_real(setup, "best", searched.best)}
    tuned = _tuned_baseline(setup, searched, plans)
    if tuned.run == "tuned":
        _log(f"      running the tuned baseline for real: {_describe(tuned.plan)}")
        plans["tuned"] = tuned.plan
        measured["tuned"] = _run_for_real(setup, "tuned", tuned.plan)
    else:
        _log(f"      the tuned baseline is the {tuned.run} plan, already run")
    sims = _resimulate(setup, layers, plans, measured)
    rows = _accuracy_rows(setup, plans, sims, measured)
    notes = calibration_notes(rows)
    for line in notes:
        _log(f"note: {line}")
    report = _report(setup, plans, measured, searched, tuned, sims, rows, notes,
                     wall_time_s=time.perf_counter() - t_start)
    write_atomic(setup.out / REPORT_FILE, json.dumps(report, indent=1) + "\n")
    _print_report(report, rows, setup.out)
    return report


def _setup(cfg: DemoConfig) -> Setup:
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise BadInput("--out", "a directory", str(out))
    out.mkdir(parents=True, exist_ok=True)
    model, cluster = load_model(cfg.model), load_cluster(cfg.cluster)
    if cfg.emulation_scale is None:
        cfg = replace(cfg, emulation_scale=auto_emulation_scale(len(cluster.devices),
                                                                os.cpu_count() or 1))
    return Setup(cfg, out, model, cluster)


def _profile_layers(setup: Setup) -> LayerProfiles:
    from hyperpipe.exec.emulation import emulation_factors
    from hyperpipe.exec.profiler import emulated_profile, measure_profile
    cfg, out = setup.cfg, setup.out
    _log(f"[1/5] profiling the layers of {cfg.model} on this CPU "
         f"(device speeds of {cfg.cluster} emulated, scale {cfg.emulation_scale})")
    native = measure_profile(cfg.model, cfg.cluster, emulate=False)
    native.save(out / NATIVE_PROFILE_FILE)   # emulation's compute reference for the runs
    layer_profile = emulated_profile(native, emulation_factors(setup.cluster,
                                                               cfg.emulation_scale))
    layer_profile.save(out / LAYER_PROFILE_FILE)
    return LayerProfiles(native, layer_profile)


def _uniform_baseline(setup: Setup, layers: LayerProfiles):
    cfg, cluster = setup.cfg, setup.cluster
    _log(f"[2/5] the uniform baseline on all {len(cluster.devices)} devices of {cfg.cluster} "
         f"for {cfg.model}, global batch {cfg.global_batch} (layer profile only)")
    return _uniform_all_devices(setup.model, cluster, cfg, layers.emulated)


def _run_for_real(setup: Setup, name: str, plan) -> Any:
    """`plan` run by the executor, its plan and traces written; the measured Trace."""
    from hyperpipe.exec import RunOptions, run_plan
    cfg, out = setup.cfg, setup.out
    plan.save(out / PLAN_FILE.format(name))
    result = run_plan(plan, RunOptions(
        steps=cfg.steps, seed=cfg.seed, emulation_scale=cfg.emulation_scale,
        reference_profile=str(out / NATIVE_PROFILE_FILE),
        trace_path=str(out / MEASURED_TRACE_FILE.format(name)),
        chrome_path=str(out / MEASURED_CHROME_FILE.format(name))))
    return result.trace


def _search_again(setup: Setup, layers: LayerProfiles, uniform, measured_uniform
                  ) -> Searched:
    """Calibrate on the uniform run, search with it, pick the plan to run and predict
    both plans' times before the pick has run (the out-of-sample prediction)."""
    from hyperpipe.search.search import SearchConstraints, search
    from hyperpipe.sim.calibrate import calibrate
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate
    cfg, model, cluster = setup.cfg, setup.model, setup.cluster
    # nothing fixed but the global batch: the pick comes from the space the tuned
    # baseline is tuned over (pp, dp, tp, micro-batch, kind), so the two compare fairly
    constraints = SearchConstraints(global_batch=cfg.global_batch)
    # Why search again: the layer profile knows compute but not what each action costs
    # around it on this machine (dispatch, messages, wake-ups); one real run tells.
    first_fit = calibrate([measured_uniform], sources=[MEASURED_TRACE_FILE.format("uniform")],
                          base=layers.emulated)
    result = search(model, cluster, constraints, profile=first_fit, workers=cfg.workers)
    # the tie margin is at least the uniform run's own step-to-step spread: plans closer
    # than what this machine's noise moves are not told apart by the measurement
    margin = max(TIE_MARGIN, _spread(step_periods_s(measured_uniform)))
    _log(f"      searched again with the run's costs: {result.candidates_evaluated} "
         f"candidates in {result.search_time_s:.1f} s")
    runs, why_not = runnable(result.simulated, model)
    if why_not:
        _log(f"      passed over {len(why_not)} faster plan(s) the executor cannot run; the "
             f"fastest: {why_not[0]}")
    best = pick_stable(runs or [result.baselines["uniform"]], CostModel(model, cluster),
                       margin)
    # out of sample: predicted from the uniform run alone, before the best plan runs
    oos_cost = CostModel(model, cluster, first_fit)
    predicted = {k: simulate(p, oos_cost).metrics.iteration_time_s
                 for k, p in (("uniform", uniform), ("best", best))}
    _log(f"      predicted before running it (calibrated on the uniform run only): "
         f"{predicted['best'] * 1e3:.1f} ms per iteration")
    _log(f"      picked with a tie margin of {margin:.0%} (plans within it of the fastest "
         "prediction are ties; the uncalibrated cost model decides among them)")
    return Searched(first_fit, result, margin, best, predicted)


def _tuned_baseline(setup: Setup, searched: Searched, plans: dict) -> Tuned:
    """The best plan of the uniform family with nothing fixed but the global batch (pp,
    dp, tp, micro-batch, schedule kind and device subset all tuned), as the calibrated
    simulator ranks it in the search that picked the best plan: what a user tuning
    Megatron-LM by hand would run."""
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate
    model, cluster = setup.model, setup.cluster
    plan = searched.result.baselines["uniform"].plan
    run = next((name for name, p in plans.items() if p == plan), "tuned")
    predicted = simulate(plan, CostModel(model, cluster, searched.first_fit)
                         ).metrics.iteration_time_s
    return Tuned(plan, run, predicted)


def _resimulate(setup: Setup, layers: LayerProfiles, plans: dict, measured: dict
                ) -> Resimulated:
    from hyperpipe.sim.calibrate import calibrate
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate
    model, cluster = setup.model, setup.cluster
    before_cost = CostModel(model, cluster, layers.emulated)
    before = {k: simulate(p, before_cost) for k, p in plans.items()}
    _log("[5/5] calibrating from the uniform and best runs and simulating again")
    fitted = ("uniform", "best")        # the tuned baseline's run stays out of sample
    profile = calibrate([measured[k] for k in fitted],
                        sources=[MEASURED_TRACE_FILE.format(k) for k in fitted],
                        base=layers.emulated)
    profile.save(setup.out / CALIBRATED_PROFILE_FILE)
    after_cost = CostModel(model, cluster, profile)
    after = {k: simulate(p, after_cost) for k, p in plans.items()}
    return Resimulated(profile, before, after)


def _accuracy_rows(setup: Setup, plans: dict, sims: Resimulated, measured: dict
                   ) -> dict[str, dict]:
    """Per plan, predicted against measured (report.json's `baseline` object's form);
    writes the predicted traces and the timelines."""
    from hyperpipe.sim.timeline import plot_timelines
    out, rows = setup.out, {}
    for name in plans:
        after = sims.after[name]
        acc = compare(after.metrics.iteration_time_s, after.trace, measured[name])
        before_s = sims.before[name].metrics.iteration_time_s
        periods = step_periods_s(measured[name])
        rows[name] = {"measured_s": acc.measured_iteration_s, "before_s": before_s,
                      "after_s": acc.predicted_iteration_s,
                      "error_before": relative_error(before_s, acc.measured_iteration_s),
                      "error_after": acc.error, "action_mape_after": acc.action_mape,
                      "step_periods_s": periods, "spread": _spread(periods)}
        after.trace.save(out / PREDICTED_TRACE_FILE.format(name))
        after.trace.save_chrome(out / PREDICTED_CHROME_FILE.format(name))
        plot_timelines([after.trace, measured[name]],
                       [f"{name}: predicted (calibrated)", f"{name}: measured (emulated)"],
                       out / TIMELINE_FILE.format(name))
    return rows


def _report(setup: Setup, plans: dict, measured: dict, searched: Searched, tuned: Tuned,
            sims: Resimulated, rows: dict, notes: list[str], *, wall_time_s: float
            ) -> dict[str, Any]:
    """report.json's object."""
    best, uniform = rows["best"], rows["uniform"]
    speedup_measured = uniform["measured_s"] / best["measured_s"]
    speedup_predicted = uniform["after_s"] / best["after_s"]
    oos = searched.predicted_oos_s
    speedup_oos = oos["uniform"] / oos["best"]
    tuned_row = rows[tuned.run]
    speedup_tuned = tuned_row["measured_s"] / best["measured_s"]
    speedup_tuned_oos = tuned.predicted_oos_s / oos["best"]
    return {
        "error_out_of_sample": relative_error(oos["best"], best["measured_s"]),
        "predicted_iteration_time_out_of_sample_s": oos["best"],
        "measured_spread": best["spread"],
        "measured_step_periods_s": best["step_periods_s"],
        "plan": plans["best"].to_dict(),
        "baseline_plan": plans["uniform"].to_dict(),
        "measured_iteration_time_s": best["measured_s"],
        "predicted_iteration_time_s": best["after_s"],
        "predicted_iteration_time_before_calibration_s": best["before_s"],
        "error_before_calibration": best["error_before"],
        "error_after_calibration": best["error_after"],
        "baseline": uniform,
        "speedup_vs_uniform_measured": speedup_measured,
        "speedup_vs_uniform_predicted": speedup_predicted,
        "speedup_prediction_error": relative_error(speedup_predicted, speedup_measured),
        "speedup_vs_uniform_predicted_out_of_sample": speedup_oos,
        "speedup_prediction_error_out_of_sample": relative_error(speedup_oos,
                                                                 speedup_measured),
        # the speed-up over the tuned baseline (best of the uniform family), the one
        # that counts; "tuned_baseline_run" says which run measured it
        "tuned_baseline_plan": tuned.plan.to_dict(),
        "tuned_baseline_run": tuned.run,
        "tuned_baseline": tuned_row,
        "speedup_vs_tuned_measured": speedup_tuned,
        "speedup_vs_tuned_predicted_out_of_sample": speedup_tuned_oos,
        "speedup_vs_tuned_prediction_error_out_of_sample": relative_error(
            speedup_tuned_oos, speedup_tuned),
        "emulated": any(t.emulated for t in measured.values()),
        "emulation_scale": setup.cfg.emulation_scale,
        "search": {"candidates_evaluated": searched.result.candidates_evaluated,
                   "search_time_s": searched.result.search_time_s},
        "metrics_predicted": sims.after["best"].metrics.to_dict(),
        "calibration_notes": notes,
        "tie_margin": searched.margin,
        "wall_time_s": wall_time_s,
    }


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


def runnable(ranked: list, spec) -> tuple[list, list[str]]:
    """The candidates of `ranked` whose plans the real executor runs
    (`exec.runnable.why_not_runnable`), in order, and why each one ranked above the
    first of them cannot run (the search's space is wider than the executor's: it may
    shard one layer's data-parallel replicas to different tensor-parallel degrees)."""
    from hyperpipe.exec.runnable import why_not_runnable
    runs: list = []
    why_not: list[str] = []
    for cand in ranked:
        why = why_not_runnable(cand.plan, spec)
        if why is None:
            runs.append(cand)
        elif not runs:
            why_not.append(why)
    return runs, why_not


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
    _log(f"speed-up of best over the tuned baseline predicted out of sample: "
         f"{report['speedup_vs_tuned_predicted_out_of_sample']:.2f}x "
         f"({report['speedup_vs_tuned_prediction_error_out_of_sample']:.1%} from measured)")
    _log("")
    _log(f"iteration time{emu}; 'after' is in-sample for uniform and best (calibrated on "
         "these very runs), out of sample for tuned:")
    _log(f"{'plan':<10}{'predicted before':>18}{'predicted after':>17}{'measured':>11}"
         f"{'error before':>14}{'error after':>13}{'spread':>9}")
    for name, r in rows.items():
        _log(f"{name:<10}{r['before_s'] * 1e3:>16.1f}ms{r['after_s'] * 1e3:>15.1f}ms"
             f"{r['measured_s'] * 1e3:>9.1f}ms{r['error_before']:>14.1%}{r['error_after']:>13.1%}"
             f"{r['spread']:>9.1%}")
    _log(f"speed-up of best over uniform: measured {report['speedup_vs_uniform_measured']:.2f}x,"
         f" predicted {report['speedup_vs_uniform_predicted']:.2f}x "
         f"({report['speedup_prediction_error']:.1%} apart)")
    same = "" if report["tuned_baseline_run"] == "tuned" else \
        f" (the tuned baseline is the {report['tuned_baseline_run']} plan)"
    _log(f"speed-up of best over the tuned baseline (best of the uniform family over pp, "
         f"dp, tp, micro-batch and kind): measured {report['speedup_vs_tuned_measured']:.2f}x"
         f"{same}; over the uniform plan forced onto every device: measured "
         f"{report['speedup_vs_uniform_measured']:.2f}x")
    _log(f"wrote {out}/{REPORT_FILE}, plans, traces (trace_*.json; chrome_*.json open in "
         f"Perfetto) and timelines (timeline_*.png) in {report['wall_time_s']:.0f} s")
