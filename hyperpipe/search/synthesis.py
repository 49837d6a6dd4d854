"""Search phase 4b: synthesised schedules (kind synth) for the best simulated plans;
and the cheap bound that keeps the V kinds' candidates (zb-v, dualpipe-v) out of the
simulator when it rules them out.

For each of the top `SYNTH_TOP` plans of the simulated short list (their stages,
devices and micro-batches kept), `hyperpipe.synth.synthesise.synthesise` builds per-device
action orders and prices them and every fixed kind with the simulator. A synthesised
plan (its `schedule.actions` recorded, so that `run` and `simulate` replay exactly what
was searched) joins the ranking when it beats the plan it came from; when the user asked
for synth, every synthesis joins as synth (a fixed kind that won written out as its
action lists and simulated again), and the search ranks those alone: the syntheses of at
most `SYNTH_TOP` plans of the short list and of the seeds, so fewer than `top` may be
ranked. Skipped when the user fixed a schedule kind other than synth, or ZeRO-3 without
a kind (synthesised orders split the backward, which `run` does not do under ZeRO-3:
`space.schedule_options` keeps to the kinds it runs).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from hyperpipe.plan.kinds import schedule_kind
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.schedule import stage_rank
from hyperpipe.search.caches import StageShape
from hyperpipe.search.evaluate import Candidate, count_actions, dedupe, rank_key, simulate_all
from hyperpipe.search.templates import PhaseStats, SearchContext, worker_context
from hyperpipe.sim.metrics import Metrics
from hyperpipe.sim.sharding import dp_shards

if TYPE_CHECKING:
    from hyperpipe.synth.synthesise import SynthResult

SYNTH_TOP = 3         # plans of the short list a schedule is synthesised for
POLICY_PARTS = 2      # tasks a synthesis's policies are cut into over a worker pool
# Competitors whose best plan gets the same synthesis as the pick's (Megatron-style
# layouts a user could run with any schedule; the peer planners' papers fix 1F1B), and
# which, being points of the search's own space, join its ranking as seeds (`search`).
SYNTHESISED_BASELINES = ("uniform", "proportional")


def synthesise_top(ctx: SearchContext, phase: PhaseStats, ranked: list[Candidate],
                   top: int = SYNTH_TOP, pool=None,
                   baselines: dict[str, Candidate] | None = None,
                   budget: float = math.inf
                   ) -> tuple[list[Candidate], dict[str, Candidate]]:
    """`ranked` with the synthesised plans that beat their source, re-ranked, and
    `baselines` with each of `SYNTHESISED_BASELINES`' pick replaced by its synthesised
    plan where that is faster; each round's syntheses spread over the worker `pool` when
    there is one (`synthesise_all`: the same results). Plans that differ only in their
    schedule kind share one synthesis (it keeps stages, devices and micro-batches and
    tries every fixed kind).
    A plan is left unsynthesised where `schedule_bound_s` shows no schedule of its
    stages can beat the best of its side (the search's own, or the other plans). The
    fixed kinds `ranked` and `baselines` hold simulated already are not simulated
    again (`synthesise`'s `known`)."""
    baselines = dict(baselines or {})
    if ctx.c.schedule is not None and not schedule_kind(ctx.c.schedule).carries_actions:
        return ranked, baselines
    if ctx.c.zero == 3 and ctx.c.schedule is None:
        return ranked, baselines    # its orders split the backward: not with ZeRO-3
    got: dict[str, object] = {}
    # the fixed kinds already simulated for each shape: synthesis does not redo them
    known: dict[str, dict[str, Metrics]] = {}
    for cand in list(ranked) + list(baselines.values()):
        if not schedule_kind(cand.plan.schedule).carries_actions:
            known.setdefault(_shape(cand.plan), {})[cand.plan.schedule] = cand.metrics

    def run(plans: list[Plan]) -> None:
        todo = {k: p for p in plans if (k := _shape(p)) not in got}
        results = synthesise_all(ctx, [(p, known.get(k)) for k, p in todo.items()], pool)
        for k, result in zip(todo, results, strict=True):
            got[k] = result
            phase.seen += result.candidates

    def value(cand: Candidate) -> float:
        """Its objective, synthesised where it was."""
        result = got.get(_shape(cand.plan))
        best = rank_key(ctx.c, cand.metrics)[1]
        return best if result is None else min(best, rank_key(ctx.c, result.metrics)[1])

    # the fewest plans that can win, in two rounds: first the best simulated plan and
    # the best other plan; then each other plan of the short list (the first `top`,
    # while their schedule actions fit in `budget`: what the simulator's short list and
    # polish left of theirs) and each other baseline whose schedule bound is still below
    # the best of its side
    # the first `top` distinct shapes: plans that differ only in their kind share one
    # synthesis, so the same stages listed under three kinds take one place, not three
    shapes: dict[str, Candidate] = {}
    for c in ranked:
        if c.metrics.feasible and len(shapes) < top:
            shapes.setdefault(_shape(c.plan), c)
    cands = list(shapes.values())
    named = [(k, baselines[k]) for k in SYNTHESISED_BASELINES
             if k in baselines and baselines[k].metrics.feasible]
    others = sorted((c for c in baselines.values() if c.metrics.feasible),
                    key=lambda c: rank_key(ctx.c, c.metrics))
    synthesisable = [c for _, c in named]
    lead = cands[:1] + [c for c in others[:1] if any(c is x for x in synthesisable)]
    run([c.plan for c in lead])
    mine = min((value(c) for c in cands), default=math.inf)
    theirs = min((value(c) for c in others), default=math.inf)
    more = []
    for c in cands[1:]:
        if bound_value(ctx, c) < mine and count_actions(c.plan) <= budget:
            budget -= count_actions(c.plan)
            more.append(c.plan)
    run(more + [c.plan for _, c in named if bound_value(ctx, c) < theirs])
    asked = ctx.c.schedule is not None          # synth asked for: every result, as synth
    added: list[Candidate] = []
    for cand in cands:
        result = got.get(_shape(cand.plan))
        if result is not None and (asked or (
                schedule_kind(result.plan.schedule).carries_actions
                and rank_key(ctx.c, result.metrics) < rank_key(ctx.c, cand.metrics))):
            added.append(Candidate(result.plan, result.metrics))
    for k, cand in named:
        result = got.get(_shape(cand.plan))
        if result is not None and (asked or rank_key(ctx.c, result.metrics) <
                                   rank_key(ctx.c, cand.metrics)):
            baselines[k] = Candidate(result.plan, result.metrics)
    if asked:                  # a fixed kind that won: its order written out as synth
        added = _as_synth(ctx, added, pool)
        names = [k for k, _ in named if k in baselines]
        baselines.update(zip(names, _as_synth(ctx, [baselines[k] for k in names], pool),
                             strict=True))
    ranked = sorted(dedupe(ranked + added), key=lambda cand: rank_key(ctx.c, cand.metrics))
    return ranked, baselines


def _as_synth(ctx: SearchContext, cands: list[Candidate], pool=None) -> list[Candidate]:
    """`cands` with each plan of a fixed kind written out as kind synth
    (`synth.synthesise.written_out`), simulated again (the same order may price apart
    from its kind: dualpipe-v's all-to-all overlap is the kind's), over the `pool`."""
    from hyperpipe.synth.synthesise import written_out
    fixed = [i for i, c in enumerate(cands) if not schedule_kind(c.plan.schedule)
             .carries_actions]
    plans = [written_out(cands[i].plan) for i in fixed]
    out = list(cands)
    for i, plan, metrics in zip(fixed, plans, simulate_all(plans, ctx.cost, pool),
                                strict=True):
        out[i] = Candidate(plan, metrics)
    return out


def _shape(plan: Plan) -> str:
    """What a synthesis keeps of a plan (all but its schedule kind and action lists): the
    plan with the first fixed kind of its placement and no actions, as its JSON text (a
    plan that inlines its model or cluster holds dicts, which do not hash)."""
    import json

    from hyperpipe.synth.synthesise import fixed_kinds
    bare = replace(plan, actions=None)
    return json.dumps(replace(bare, schedule=fixed_kinds(bare)[0]).to_dict(), sort_keys=True)


def synthesise_all(ctx: SearchContext, items: list[tuple[Plan, dict | None]], pool=None
                   ) -> list[SynthResult]:
    """`synthesise` of each (plan, known fixed kinds), with the same results. Over a
    worker `pool` each plan is `POLICY_PARTS` + 1 tasks, all started at once: its
    policies, cut into parts (`_policies_task`; the best order of all is the best of
    the parts' bests, the earliest policy's on ties, as one pass finds it); and its
    fixed kinds with the improvement of the best of them (`_fixed_task`), simulated
    whatever its bound (it runs beside what it would be judged against). Once its
    parts are in, the local improvement of its best synthesised order is one more task
    (`_improve_task`). The verdicts are then taken as `synthesise` takes them
    (`take_improvements`). A part does not prune by the other parts' orders, so a
    spread synthesis may simulate more (`SynthResult.candidates`)."""
    return start_synthesis(ctx, items, pool)()


def policy_parts() -> list[tuple]:
    """`POLICIES` cut into `POLICY_PARTS` runs of consecutive policies, in order."""
    from hyperpipe.synth.synthesise import POLICIES
    k = -(-len(POLICIES) // POLICY_PARTS)
    return [POLICIES[i:i + k] for i in range(0, len(POLICIES), k)]


def start_synthesis(ctx: SearchContext, items: list[tuple[Plan, dict | None]], pool=None
                    ) -> Callable[[], list[SynthResult]]:
    """`synthesise_all`, its tasks started now over `pool` but the local improvements,
    each started by the returned function once its plan's policy parts are in (so a
    caller waiting on several calls in turn runs their improvements one after another:
    pass the plans in one call); that function waits for the results (without a pool
    it works them out when called), raising what a synthesis raised (a plan that does
    not check out: BadInput, InfeasiblePlan)."""
    from hyperpipe.search.backends import fan_out
    from hyperpipe.synth.synthesise import synth_result, synthesise, take_improvements
    if pool is None:
        return lambda: [synthesise(plan, ctx.cost, known=known) for plan, known in items]
    t0 = time.perf_counter()
    parts = policy_parts()
    tasks = [(_policies_task, part) for part in parts] + [(_fixed_task, None)]
    waits = [fan_out(pool, tasks, None, _synthesis_task,
                     lambda t, q=q: (*t, ctx.inputs, *items[q])) for q in range(len(items))]

    def results() -> list[SynthResult]:
        started = []
        for q, wait in enumerate(waits):
            got = wait()
            synth_best, n = None, 0
            for _ in parts:          # the first part's best wins ties: one pass's rule
                best, found = next(got)
                n += found
                if best is not None and (synth_best is None or
                                         best.time_s < synth_best.time_s):
                    synth_best = best
            first = None if synth_best is None else fan_out(
                pool, [synth_best], None, _synthesis_task,
                lambda b, q=q: (_improve_task, b, ctx.inputs, *items[q]))
            started.append((synth_best, n, got, first))
        out = []
        for synth_best, n, got, first in started:
            fixed, n_fixed, second = next(got)
            synth_best, n = take_improvements(synth_best, n + n_fixed,
                                              None if first is None else next(first()),
                                              lambda _beat_s, got=second: got)
            out.append(synth_result(fixed, synth_best, n, t0))
        return out
    return results


def _synthesis_task(args):
    """One of `synthesise_all`'s tasks in a worker process (its cached cost model):
    `task(inputs, cost, known, arg)`."""
    task, arg, ctx_inputs, plan, known = args
    from hyperpipe.synth.synthesise import prepare
    cost = worker_context(*ctx_inputs).cost
    return task(prepare(plan, cost), cost, known or {}, arg)


def _policies_task(inputs, cost, known, policies):
    """The best order `policies` build and the schedules simulated (`price_policies`).
    `known` is not read."""
    from hyperpipe.synth.synthesise import price_policies
    return price_policies(inputs, cost, policies)


def _improve_task(inputs, cost, known, start):
    """The local improvement of `start`, the best synthesised order (a `Priced`):
    `improve_start` with its time to beat. `known` is not read."""
    from hyperpipe.synth.synthesise import improve_start
    return improve_start(inputs, cost, start.plan, start.time_s)


def _fixed_task(inputs, cost, known, _):
    """The fixed kinds and the improvement of the best one's order, simulated whatever
    its bound: (fixed, simulated, `Improved`)."""
    from hyperpipe.synth.synthesise import best_fixed, improve_start, price_fixed
    fixed, n = price_fixed(inputs, cost, known)
    return fixed, n, improve_start(inputs, cost, best_fixed(fixed).plan, math.inf)


def bound_value(ctx: SearchContext, cand: Candidate) -> float:
    """`schedule_bound_s` of a simulated candidate as an objective value (cost per token
    scales with time at a fixed price)."""
    bound = schedule_bound_s(ctx, cand.plan)
    if ctx.c.objective == "cost":
        price = cand.metrics.cost_per_million_tokens
        if price is None or cand.metrics.iteration_time_s <= 0:
            return -math.inf
        return price * bound / cand.metrics.iteration_time_s
    return bound


def _stage_ops(ctx: SearchContext, st, mb: int) -> dict[str, float]:
    """F, B, I and W of a stage on idle links, as the simulator prices each action."""
    key = StageShape(st.layers, st.devices, mb, st.recompute, st.sequence_parallel, st.cp)
    if key not in ctx.stage_ops:
        ctx.stage_ops[key] = {op: ctx.cost.stage_time_s(st.layers, st.devices, mb, op,
                                                        st.recompute, st.sequence_parallel,
                                                        st.cp)
                              for op in "FBIW"}
    return ctx.stage_ops[key]


def schedule_bound_s(ctx: SearchContext, plan: Plan) -> float:
    """A lower bound (seconds) on the simulated iteration time of `plan`'s stages,
    devices and micro-batches under any schedule (every fixed kind, every synthesised
    order). Per rank: the first micro-batch's forward through every stage before the
    rank's first (with the sends between, on idle links), then the rank's own work
    (each micro-batch's F and backward, the lesser of B and I + W) and its optimizer
    step; with one stage per rank also: after that wait, its F and input-gradient work
    (the lesser of I and B) of every micro-batch, then the input gradients of the last
    of them through every stage before it. Actions take at least their idle-link time
    and wait for their inputs, so no schedule is faster; the busiest rank of the
    slowest pipeline counts (all-reduces left out); sends take at least
    `synthesise.least_transfer_s` (split over tensor-parallel ranks)."""
    from hyperpipe.synth.synthesise import least_transfer_s
    cost = ctx.cost
    place = schedule_kind(plan.schedule).placement
    worst = 0.0
    seen = set()
    for pipe in plan.pipelines:
        stages, m, mb = pipe.stages, pipe.num_microbatches, pipe.micro_batch
        if (m, stages) in seen:
            continue
        seen.add((m, stages))
        ops = [_stage_ops(ctx, st, mb) for st in stages]
        arrive = [0.0]                  # the first micro-batch's F can start no earlier
        back = [0.0]                    # input gradients from stage k down to stage 0
        for k, (a, b) in enumerate(zip(stages, stages[1:], strict=False)):
            nbytes = cost.send_bytes(a.layers, mb)
            arrive.append(arrive[-1] + ops[k]["F"] +
                          least_transfer_s(cost, a.devices, b.devices, nbytes))
            back.append(back[-1] + min(ops[k]["I"], ops[k]["B"]) +
                        least_transfer_s(cost, b.devices, a.devices, nbytes))
        p = len(stages) // plan.chunks
        for r in range(p):
            mine = [k for k in range(len(stages)) if stage_rank(k, p, place) == r]
            work = m * sum(ops[k]["F"] + min(ops[k]["B"], ops[k]["I"] + ops[k]["W"])
                           for k in mine)
            step = sum(cost.optimizer_time_s(
                stages[k].layers, cost.cluster.device(stages[k].devices[0]).type.name,
                stages[k].tp, dp_shards(plan, stages[k], cost.cluster), stages[k].devices)
                for k in mine)
            start = arrive[min(mine)]
            worst = max(worst, start + work + step)
            if len(mine) == 1:
                k = mine[0]
                forward_input = m * (ops[k]["F"] + min(ops[k]["I"], ops[k]["B"]))
                worst = max(worst, start + forward_input + back[k])
    return worst


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


def ruled_out(ctx: SearchContext, cand: Candidate, best_value: float) -> bool:
    """Whether `cand`'s `schedule_bound_s` already puts its objective at or above
    `best_value` (the best simulated plan of the search's own so far): then simulating
    it cannot change the ranking's top."""
    return bound_value(ctx, cand) >= best_value
