"""`hyperpipe schedule --kind synth --plan P`: the schedule synthesised for a plan.

Synthesises (`hyperpipe.synth.synthesise`) unless the plan already carries its own
action lists (kind synth), then prints them as IR text (first pipeline; a ``#`` header,
which `Schedule.from_text` skips, gives the simulated times), as torch's CSV, or draws a
PNG with the synthesised schedule under the best fixed kind's on one simulated time axis.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from hyperpipe.cli.output import write_text
from hyperpipe.core.errors import BadInput
from hyperpipe.plan.kinds import SYNTH, schedule_kind


def schedule_from_plan(kind: str, plan_path: str, fmt: str, out: str | None) -> int:
    """The schedule of kind synth for the plan at `plan_path`, in format `fmt` (text,
    torch-csv or png), written to `out` (stdout without one; png needs it)."""
    from hyperpipe.plan.plan import load_plan, schedule_for
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import SimOptions, simulate
    from hyperpipe.synth.synthesise import synthesise

    if not schedule_kind(kind).carries_actions:
        raise BadInput("--plan", "only with --kind synth (other kinds take --devices "
                       "and --microbatches)", kind)
    plan = load_plan(plan_path)
    cost = CostModel(plan.load_model(), plan.load_cluster())
    if schedule_kind(plan.schedule).carries_actions:
        plan.check(cost.model, cost.cluster)
        result = synthesise(replace(plan, schedule=SYNTH), cost)
        chosen = plan                               # what the plan holds, not rebuilt
        chosen_s = simulate(plan, cost, SimOptions(trace=False)).metrics.iteration_time_s
    else:
        result = synthesise(plan, cost)
        chosen, chosen_s = result.plan, result.metrics.iteration_time_s
    header = (f"# {chosen.schedule}: simulated {chosen_s * 1e3:.4g} ms; best fixed kind "
              f"{result.fixed_kind}: {result.fixed_time_s * 1e3:.4g} ms; synthesis "
              f"{result.elapsed_s * 1e3:.0f} ms for {result.candidates} schedules\n")
    sched = schedule_for(chosen, 0)
    if fmt == "png":
        if not out:
            raise BadInput("--out", "an output .png path with --format png", has_got=False)
        from hyperpipe.plan.schedule_plot import draw_timed_schedules
        fixed = replace(plan, schedule=result.fixed_kind, actions=None)
        pipe = plan.pipelines[0]
        names = [pipe.stages[d].devices[0] for d in range(sched.num_devices)]
        panels = []
        for title, p, t in ((f"best fixed kind: {result.fixed_kind}", fixed,
                             result.fixed_time_s),
                            (f"{chosen.schedule} (this plan)", chosen, chosen_s)):
            events = simulate(p, cost).trace.events
            panels.append((f"{title}, {t * 1e3:.4g} ms", names, events))
        draw_timed_schedules(panels, out)
        print(f"wrote {out}", file=sys.stderr)
        return 0
    text = header + sched.to_text() if fmt == "text" else sched.to_torch_csv()
    write_text(text, out)
    return 0
