"""Schedules synthesised for one plan (kind ``synth``), priced by the simulator.

`synthesise(plan, cost)` keeps the plan's stages, devices and micro-batches, takes per
stage F, I, W seconds, link seconds, stash bytes and each rank's stash budget from the
cost model (or calibration profile), builds one order per `Policy` by list scheduling
(`listsched`), and simulates every candidate and every fixed kind that places chunks as
the plan does. The best synthesised order and the best fixed kind's are improved by
local moves (`improve`) and simulated again; the fastest that fits in memory wins.
A candidate order is not simulated where `order_bound_s` (its replay on idle links, a
lower bound on its simulated time) shows it cannot beat the best synthesised order
simulated so far, a fixed kind where it shows that kind cannot beat the best fixed kind
known or simulated so far, nor a fixed kind whose simulated metrics the caller passes
in (`known`): the result is the same as simulating them.

So the result is never slower than the best fixed kind (kept when no candidate beats
it) and never over a device's memory when any schedule fits. It is an ordinary plan:
kind ``synth`` with ``schedule.actions``, or the winning fixed kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from hyperpipe.plan.kinds import GENERATED_KINDS, SYNTH, schedule_kind
from hyperpipe.plan.plan import Plan, pipeline_placement, schedule_for
from hyperpipe.plan.schedule import rank_stages, validate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.metrics import IMPROVEMENT_REL, Metrics
from hyperpipe.sim.replay import PipeCosts, encode_rows, replay_rows, rows_score
from hyperpipe.sim.sharding import rank_static_bytes, reshard_after_forward
from hyperpipe.sim.simulator import SimOptions, simulate
from hyperpipe.synth.improve import improve
from hyperpipe.synth.listsched import Policy, list_schedule

# Candidate policies: warm-up depth (1F1B's, a little deeper, memory only), bounded W
# debt, lookahead in the drain, critical-path order. Small on purpose: each costs one
# list-scheduling pass and one simulation. (W right after its I, and oldest forward
# first, were dropped: they never won on experiments/schedule_synthesis.py's cases, so
# that experiment's figures are in-sample for this choice.)
POLICIES: tuple[Policy, ...] = (
    Policy(0, "fill", "deep"), Policy(1, "fill", "deep"), Policy(2, "fill", "deep"),
    Policy(None, "fill", "deep"), Policy(None, "fill", "deep", 0.0, 1),
    # drain: once a rank has no forward left, it waits for an I that lands before the W
    # it would start ends (the I's chain back to stage 0 is the tail; W's wait)
    Policy(0, "fill", "deep", 1.0, None, True), Policy(None, "fill", "deep", 1.0, 1, True),
    # critical path: the ready action with the longest chain behind it first
    Policy(1, "fill", "tail"), Policy(None, "fill", "tail"),
)


class Priced(NamedTuple):
    """A schedule for the plan's stages and its simulated price (inf: over memory)."""

    time_s: float
    plan: Plan | None
    metrics: Metrics | None
    policy: Policy | None            # the policy that built it (None: a fixed kind)
    kind: str = ""                   # the fixed kind (fixed kinds only)


IMPROVE_BUDGET = 150      # replays of the local improvement per distinct pipeline


@dataclass(frozen=True)
class SynthResult:
    """The winner and what it was compared with (times: simulated iteration seconds)."""

    plan: Plan                       # kind synth with actions, or the best fixed kind
    metrics: Metrics                 # the winner's simulated metrics
    fixed_kind: str                  # the best fixed kind for these stages
    fixed_time_s: float              # its time (inf when no fixed kind fits in memory)
    synth_time_s: float              # the best synthesised order's time (inf: none fits)
    policy: Policy | None            # the policy that built it
    candidates: int                  # schedules simulated here
    elapsed_s: float                 # wall time of the whole synthesis
    synth_plan: Plan | None = None   # the best synthesised plan, even when it lost

    @property
    def gain(self) -> float:
        """Best fixed kind's time over the winner's (>= 1)."""
        return self.fixed_time_s / self.metrics.iteration_time_s


def fixed_kinds(plan: Plan) -> list[str]:
    """The fixed (generated) kinds that place the plan's chunks as it does: for looped
    chunks > 1 those that take any chunk count, else those whose chunk count it is."""
    placement = pipeline_placement(plan, plan.pipelines[0])
    looped = plan.chunks > 1 and placement == "loop"
    kinds = map(schedule_kind, GENERATED_KINDS)
    return [k.name for k in kinds if k.placement == placement
            and (k.takes_chunks if looped else k.default_chunks == plan.chunks)]


def pipe_costs(plan: Plan, cost: CostModel, q: int) -> PipeCosts:
    """The list scheduler's inputs for pipeline q, from the cost model."""
    pipe = plan.pipelines[q]
    st, mb = pipe.stages, pipe.micro_batch
    p = len(st) // plan.chunks
    placement = pipeline_placement(plan, pipe)

    def times(op: str) -> tuple[float, ...]:
        return tuple(cost.stage_time_s(s.layers, s.devices, mb, op, s.recompute,
                                       s.sequence_parallel, s.cp) for s in st)

    links_f, links_b = [], []
    for a, b in zip(st, st[1:], strict=False):
        nbytes = cost.send_bytes(a.layers, mb)
        links_f.append(cost.transfer_time_s(a.devices[-1], b.devices[0], nbytes))
        links_b.append(cost.transfer_time_s(b.devices[0], a.devices[-1], nbytes))
    budget = []
    for d in range(p):
        mine = [st[s] for s in rank_stages(d, p, plan.chunks, placement)]
        static = rank_static_bytes(cost, plan, mine, mb,     # as the simulator counts it
                                   reshard_after_forward(plan))
        budget.append(cost.cluster.device(st[d].devices[0]).type.memory_bytes - static)
    return PipeCosts(times("F"), times("I"), times("W"),
                     tuple(cost.stage_stash_bytes(s, mb) for s in st),
                     tuple(links_f), tuple(links_b), tuple(budget), times("B"))


def synth_plan(plan: Plan, cost: CostModel, policy: Policy,
               costs: list[PipeCosts] | None = None) -> Plan | None:
    """`plan` with kind synth and the orders `policy` builds for each pipeline (None when
    it gets stuck). Pipelines with the same costs share one order. `costs`: each
    pipeline's `pipe_costs`, when the caller has them."""
    actions: dict[str, tuple] = {}
    built: dict[tuple, tuple | None] = {}
    for q, pipe in enumerate(plan.pipelines):
        c = costs[q] if costs is not None else pipe_costs(plan, cost, q)
        p = len(pipe.stages) // plan.chunks
        key = (c, pipe.num_microbatches)
        if key not in built:
            built[key] = list_schedule(c, p, pipe.num_microbatches,
                                       pipeline_placement(plan, pipe), policy)
        rows = built[key]
        if rows is None:
            return None
        for d in range(p):
            actions[pipe.stages[d].devices[0]] = rows[d]
    return replace(plan, schedule=SYNTH, actions=tuple(sorted(actions.items())))


def written_out(plan: Plan) -> Plan:
    """`plan` (a fixed kind) as kind synth whose action lists are that kind's orders:
    the same schedule, for a caller that asked for synth."""
    actions: dict[str, tuple] = {}
    for q, pipe in enumerate(plan.pipelines):
        for d, row in enumerate(schedule_for(plan, q).actions):
            actions[pipe.stages[d].devices[0]] = row
    return replace(plan, schedule=SYNTH, actions=tuple(sorted(actions.items())))


def improved_plan(plan: Plan, costs: list[PipeCosts], budget: int = IMPROVE_BUDGET
                  ) -> Plan | None:
    """`plan` (any kind) as kind synth with each pipeline's order improved by
    `hyperpipe.synth.improve` (pipelines with the same costs share one), or None when no
    swap helped."""
    actions: dict[str, tuple] = {}
    built: dict[tuple, tuple] = {}
    changed = False
    for q, pipe in enumerate(plan.pipelines):
        sched = schedule_for(plan, q)
        key = (costs[q], sched.actions)
        if key not in built:
            built[key], _ = improve(costs[q], sched.actions, sched.placement, budget)
            changed |= built[key] != sched.actions
        for d, row in enumerate(built[key]):
            actions[pipe.stages[d].devices[0]] = row
    if not changed:
        return None
    return replace(plan, schedule=SYNTH, actions=tuple(sorted(actions.items())))


def least_transfer_s(cost: CostModel, src: tuple[str, ...], dst: tuple[str, ...],
                     nbytes: float) -> float:
    """The least time (seconds) the simulator takes to send `nbytes` from stage group
    `src` to `dst`: it splits the tensor over `network.p2p_edges` (one stream per
    tensor-parallel rank, Megatron's scatter-gather), each no faster than its edge's
    idle `transfer_time_s`, so the slowest edge's idle time with its share of the bytes
    (0 when every edge stays on its device)."""
    from hyperpipe.sim.network import p2p_edges
    edges = p2p_edges(src, dst)
    return max((cost.transfer_time_s(a, b, nbytes / len(edges)) for a, b in edges
                if cost.route(a, b)[0].hops), default=0.0)


def bound_costs(plan: Plan, cost: CostModel, costs: list[PipeCosts]) -> list[PipeCosts]:
    """Each pipeline's `costs` for `order_bound_s`: no memory cap, and each boundary's
    link time `least_transfer_s`."""
    out = []
    for q, pipe in enumerate(plan.pipelines):
        st, mb = pipe.stages, pipe.micro_batch
        fwd, bwd = [], []
        for a, b in zip(st, st[1:], strict=False):
            nbytes = cost.send_bytes(a.layers, mb)
            fwd.append(least_transfer_s(cost, a.devices, b.devices, nbytes))
            bwd.append(least_transfer_s(cost, b.devices, a.devices, nbytes))
        out.append(replace(costs[q], fwd_link_s=tuple(fwd), bwd_link_s=tuple(bwd),
                           budget_bytes=(float("inf"),) * len(costs[q].budget_bytes)))
    return out


def order_bound_s(plan: Plan, lower: list[PipeCosts]) -> float:
    """A lower bound (seconds) on the simulated iteration time of `plan` with its own
    per-rank orders (any kind): the latest end of `hyperpipe.sim.replay`'s replay of
    each pipeline's orders with `lower` (`bound_costs`: each action's time on idle
    links as the simulator prices it, each link's least time, no memory cap). The
    simulator runs each rank's actions in the same order, each no shorter and no earlier
    than its input allows, so no rank ends sooner there (all-reduces and the optimizer
    come on top). 0.0 where an order deadlocks on replay (no bound)."""
    worst = 0.0
    seen: set = set()
    for q in range(len(plan.pipelines)):
        sched = schedule_for(plan, q)
        key = (lower[q], sched.actions)
        if key in seen:
            continue
        seen.add(key)
        times = replay_rows(lower[q], encode_rows(sched.actions), sched.placement)
        if times is None:
            return 0.0
        worst = max(worst, rows_score(times).makespan_s)
    return worst


class Inputs(NamedTuple):
    """What every step of a synthesis reads (`prepare`): the plan without actions, the
    simulator's options, each pipeline's list-scheduling costs and their idle-link lower
    bounds (`bound_costs`)."""

    base: Plan
    opts: SimOptions
    costs: list[PipeCosts]
    lower: list[PipeCosts]


class Improved(NamedTuple):
    """`improve_start`'s result: the improved plan (None: no move helped), its
    `order_bound_s`, and its simulated metrics (None: not simulated, its bound being at
    or above the time it had to beat)."""

    plan: Plan | None
    bound_s: float
    metrics: Metrics | None


def prepare(plan: Plan, cost: CostModel, options: SimOptions | None = None) -> Inputs:
    """Check `plan` and read what the steps of `synthesise` need."""
    options = SimOptions(trace=False) if options is None else options
    plan.check(cost.model, cost.cluster)
    base = replace(plan, actions=None) if schedule_kind(plan.schedule).carries_actions \
        else plan
    costs = [pipe_costs(base, cost, q) for q in range(len(base.pipelines))]
    return Inputs(base, replace(options, check_plan=False), costs,
                  bound_costs(base, cost, costs))


def price_fixed(inputs: Inputs, cost: CostModel, known: Mapping[str, Metrics]
                ) -> tuple[dict[str, Priced], int]:
    """The fixed kinds of `fixed_kinds` by kind, and the schedules simulated: a kind in
    `known` is not simulated, nor one whose order bound is above the best time known or
    simulated so far (it could not win; left out)."""
    priced: dict[str, Priced] = {}
    n = 0
    for kind in sorted(fixed_kinds(inputs.base), key=lambda k: k not in known):
        candidate = replace(inputs.base, schedule=kind, actions=None)
        metrics = known.get(kind)
        if metrics is None:
            best_s = min((x.time_s for x in priced.values()), default=float("inf"))
            if order_bound_s(candidate, inputs.lower) > best_s:
                continue
            metrics = simulate(candidate, cost, inputs.opts).metrics
            n += 1
        t = metrics.iteration_time_s if metrics.feasible else float("inf")
        priced[kind] = Priced(t, candidate, metrics, None, kind)
    return priced, n


def best_fixed(fixed: dict[str, Priced]) -> Priced:
    """The fastest fixed kind, the first of `fixed_kinds` on ties."""
    kinds = fixed_kinds(next(iter(fixed.values())).plan)
    return min(fixed.values(), key=lambda x: (x.time_s, kinds.index(x.kind)))


def price_policies(inputs: Inputs, cost: CostModel, policies: tuple[Policy, ...]
                   ) -> tuple[Priced | None, int]:
    """The fastest order `policies` build (the earliest on ties; None: none built), and
    the schedules simulated: an order is not simulated when it repeats an earlier one
    or its order bound shows it cannot beat the fastest so far."""
    best: Priced | None = None
    n = 0
    seen: set = set()
    for policy in policies:
        candidate = synth_plan(inputs.base, cost, policy, inputs.costs)
        if candidate is None or candidate.actions in seen:
            continue
        seen.add(candidate.actions)
        if best is not None and order_bound_s(candidate, inputs.lower) >= best.time_s:
            continue                      # it cannot become the best synthesised order
        metrics = simulate(candidate, cost, inputs.opts).metrics
        n += 1
        t = metrics.iteration_time_s if metrics.feasible else float("inf")
        if best is None or t < best.time_s:
            best = Priced(t, candidate, metrics, policy)
    return best, n


def improve_start(inputs: Inputs, cost: CostModel, start: Plan, beat_s: float
                  ) -> Improved:
    """`improved_plan` of `start` (a best synthesised order, or the best fixed kind's:
    the local improvement's starts), simulated where its order bound is below `beat_s`
    (the best synthesised time it must beat; inf: none yet)."""
    better = improved_plan(start, inputs.costs)
    if better is None:
        return Improved(None, float("inf"), None)
    bound = order_bound_s(better, inputs.lower)
    if bound >= beat_s:
        return Improved(better, bound, None)
    return Improved(better, bound, simulate(better, cost, inputs.opts).metrics)


def take_improvements(synth_best: Priced | None, n: int, first: Improved | None,
                      second: Callable[[float], Improved]) -> tuple[Priced | None, int]:
    """`synth_best` after the two local improvements, in this order, and `n` plus the
    simulations they ran: `first`, of the best synthesised order (None without one),
    credited to its policy; then `second(beat_s)`, of the best fixed kind's order, asked
    with the time it must beat then (a caller that ran it beforehand, with a larger
    `beat_s`, gets the same verdict: `_take_improved`)."""
    if first is not None:
        n += first.metrics is not None
        synth_best = _take_improved(synth_best, first, synth_best.policy if synth_best
                                    else None)
    got = second(synth_best.time_s if synth_best else float("inf"))
    return _take_improved(synth_best, got, None), n + (got.metrics is not None)


def _take_improved(synth_best: Priced | None, improved: Improved, policy: Policy | None
                   ) -> Priced | None:
    """`synth_best` after one `improve_start` (`policy`: the one credited for it): the
    improved order where its bound is below `synth_best`'s time and it is faster. The
    verdict is the same whatever `beat_s` the improvement was given, as long as it was
    at least `synth_best`'s time."""
    if improved.plan is None:
        return synth_best
    if synth_best is not None and improved.bound_s >= synth_best.time_s:
        return synth_best
    m = improved.metrics
    t = m.iteration_time_s if m.feasible else float("inf")
    if synth_best is None or t < synth_best.time_s:
        return Priced(t, improved.plan, m, policy)
    return synth_best


def synth_result(fixed: dict[str, Priced], synth_best: Priced | None, candidates: int,
                 t0: float) -> SynthResult:
    """The winner (the best synthesised order where it beats the best fixed kind by
    more than float noise, `IMPROVEMENT_REL`: a tie keeps the fixed kind, whose plan
    carries no action lists) as a `SynthResult`, its schedules validated; `t0`: when
    the synthesis started."""
    fixed_best = best_fixed(fixed)
    fixed_t, kind = fixed_best.time_s, fixed_best.kind
    synth_t = synth_best.time_s if synth_best else float("inf")
    if synth_best is not None and synth_t < fixed_t * (1 - IMPROVEMENT_REL):
        winner, metrics, policy = synth_best.plan, synth_best.metrics, synth_best.policy
        # the winner is ordinary, valid IR (replicas alike share a schedule: once each)
        for sched in dict.fromkeys(schedule_for(winner, q)
                                   for q in range(len(winner.pipelines))):
            validate(sched)
    else:
        winner, metrics, policy = fixed_best.plan, fixed_best.metrics, None
    return SynthResult(winner, metrics, kind, fixed_t, synth_t, policy, candidates,
                       time.perf_counter() - t0, synth_best.plan if synth_best else None)


def synthesise(plan: Plan, cost: CostModel, options: SimOptions | None = None,
               policies: tuple[Policy, ...] = POLICIES,
               known: Mapping[str, Metrics] | None = None) -> SynthResult:
    """Build, simulate and pick (see the module doc). `plan` may be of any kind; its
    stages, devices and micro-batches are kept. `options`: the simulator's (default: no
    trace). `known`: fixed kind -> the simulated metrics of the plan's stages under that
    kind (as `simulate` with these options gives them), used instead of simulating.
    The steps one after another (`search.synthesis` runs the two local improvements
    apart over a worker pool, with the same result)."""
    t0 = time.perf_counter()
    inputs = prepare(plan, cost, options)
    fixed, n = price_fixed(inputs, cost, known or {})
    synth_best, found = price_policies(inputs, cost, policies)
    n += found
    first = None if synth_best is None else \
        improve_start(inputs, cost, synth_best.plan, synth_best.time_s)
    synth_best, n = take_improvements(
        synth_best, n, first,
        lambda beat_s: improve_start(inputs, cost, best_fixed(fixed).plan, beat_s))
    return synth_result(fixed, synth_best, n, t0)
