"""Search phase 4b: synthesised schedules (kind synth) for the best simulated plans.

For each of the top `SYNTH_TOP` plans of the simulated short list (their stages,
devices and micro-batches kept), `hyperpipe.sim.synth.synthesise` builds per-device
action orders and prices them and every fixed kind with the simulator. A synthesised
plan (its `schedule.actions` recorded, so that `run` and `simulate` replay exactly what
was searched) joins the ranking when it beats the plan it came from. Skipped when the
user fixed a schedule kind other than synth.
"""

from __future__ import annotations

from hyperpipe.search.evaluate import Candidate, rank_key
from hyperpipe.search.templates import PhaseStats, SearchContext

SYNTH_TOP = 3         # plans of the short list a schedule is synthesised for


def synthesise_top(ctx: SearchContext, phase: PhaseStats, ranked: list[Candidate],
                   top: int = SYNTH_TOP) -> list[Candidate]:
    """`ranked` with the synthesised plans that beat their source, re-ranked."""
    if ctx.c.schedule not in (None, "synth"):
        return ranked
    from hyperpipe.sim.synth import synthesise
    added = []
    for cand in [c for c in ranked if c.metrics.feasible][:top]:
        result = synthesise(cand.plan, ctx.cost)
        phase.seen += result.candidates
        if result.plan.schedule == "synth" and \
                rank_key(ctx.c, result.metrics) < rank_key(ctx.c, cand.metrics):
            added.append(Candidate(result.plan, result.metrics))
    return sorted(ranked + added, key=lambda cand: rank_key(ctx.c, cand.metrics))
