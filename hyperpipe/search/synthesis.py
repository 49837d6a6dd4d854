"""Search phase 4b: synthesised schedules (kind synth) for the best simulated plans;
and the cheap bound that keeps the V kinds' candidates (zb-v, dualpipe-v) out of the
simulator when it rules them out.

For each of the top `SYNTH_TOP` plans of the simulated short list (their stages,
devices and micro-batches kept), `hyperpipe.synth.synthesise.synthesise` builds per-device
action orders and prices them and every fixed kind with the simulator. A synthesised
plan (its `schedule.actions` recorded, so that `run` and `simulate` replay exactly what
was searched) joins the ranking when it beats the plan it came from. Skipped when the
user fixed a schedule kind other than synth.
"""

from __future__ import annotations

from hyperpipe.plan.kinds import schedule_kind
from hyperpipe.plan.plan import Plan
from hyperpipe.search.caches import StageShape
from hyperpipe.search.evaluate import Candidate, rank_key
from hyperpipe.search.templates import PhaseStats, SearchContext, objective_value

SYNTH_TOP = 3         # plans of the short list a schedule is synthesised for


def synthesise_top(ctx: SearchContext, phase: PhaseStats, ranked: list[Candidate],
                   top: int = SYNTH_TOP, pool=None) -> list[Candidate]:
    """`ranked` with the synthesised plans that beat their source, re-ranked; the plans
    synthesised over the worker `pool` when there is one (the same results)."""
    if ctx.c.schedule is not None and not schedule_kind(ctx.c.schedule).carries_actions:
        return ranked
    from hyperpipe.search.backends import fan_out
    from hyperpipe.synth.synthesise import synthesise
    cands = [c for c in ranked if c.metrics.feasible][:top]
    cost = ctx.cost
    results = fan_out(pool, cands, lambda cand: synthesise(cand.plan, cost), synthesise_task,
                      lambda cand: (cand.plan, cost.model, cost.cluster, cost.profile),
                      at_least=2)()
    added = []
    for cand, result in zip(cands, results, strict=True):
        phase.seen += result.candidates
        if schedule_kind(result.plan.schedule).carries_actions and \
                rank_key(ctx.c, result.metrics) < rank_key(ctx.c, cand.metrics):
            added.append(Candidate(result.plan, result.metrics))
    return sorted(ranked + added, key=lambda cand: rank_key(ctx.c, cand.metrics))


def synthesise_task(args):
    """`synthesise` in a worker process (its own cost model)."""
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.synth.synthesise import synthesise
    plan, model, cluster, profile = args
    return synthesise(plan, CostModel(model, cluster, profile))


def busiest_device_bound_s(ctx: SearchContext, plan: Plan) -> float:
    """A lower bound on `plan`'s simulated iteration time (seconds): per device, the F
    and backward (the lesser of B and I + W) times of its stages on idle links, as the
    simulator prices each action, times its pipeline's micro-batches; the busiest device
    counts (no bubble, no link transfer, no all-reduce, no optimizer)."""
    cost, cache = ctx.cost, ctx.device_bounds_s
    worst = 0.0
    for pipe in plan.pipelines:
        load: dict[str, float] = {}
        for st in pipe.stages:
            key = StageShape(st.layers, st.devices, pipe.micro_batch, st.recompute,
                             st.sequence_parallel)
            if key not in cache:
                t = {op: cost.stage_time_s(st.layers, st.devices, pipe.micro_batch, op,
                                           st.recompute, st.sequence_parallel)
                     for op in "FBIW"}
                cache[key] = t["F"] + min(t["B"], t["I"] + t["W"])
            load[st.devices[0]] = load.get(st.devices[0], 0.0) + cache[key]
        worst = max(worst, pipe.num_microbatches * max(load.values()))
    return worst


def v_ruled_out(ctx: SearchContext, cand: Candidate, best_value: float) -> bool:
    """Whether `cand` is of a V kind and its `busiest_device_bound_s` already puts its
    objective above `best_value` (the best simulated plan of the search's own so far):
    then simulating it cannot change the ranking's top."""
    plan = cand.plan
    if schedule_kind(plan.schedule).placement != "v":
        return False
    bound = busiest_device_bound_s(ctx, plan)
    price = cand.metrics.cost_per_million_tokens
    if ctx.c.objective == "cost":     # cost per token scales with time at a fixed price
        if price is None or cand.metrics.iteration_time_s <= 0:
            return False
        return price * bound / cand.metrics.iteration_time_s > best_value
    return objective_value(ctx, bound, 0.0) > best_value
