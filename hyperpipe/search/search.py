"""Heterogeneity-aware plan search: `search(model, cluster, constraints)`.

Five phases, each reported with the candidates it saw, pruned and found infeasible:

1. templates (`templates`): classes of identical pipelines, per type group.
2. assemble: one template per block of a grouping of the device types (pipelines may
   differ), the batch split in proportion to speed, checked by the analytic tier.
3. refine (`refine`): single layers moved across cuts, judged by the analytic tier.
4. simulate: the short list and the baselines ranked by the SimPy simulator, the best
   polished by the simulator, then schedules synthesised for the best few (`synthesis`).
   The tuned uniform and proportional baselines' best plans (synthesised alike) are
   points of the search's own space (equal or proportional cuts): they join the ranking
   as seeds, so the pick is never slower than either; the result says when the pick is
   a seed (`SearchResult.seeded_from`: a seed's plan, unless the search found the same
   plan itself) and what the search's own best was (`own_best`).
5. baselines (`baselines`, `peers`): tuned uniform/proportional plans and the Metis and
   AMP picks, judged by the same simulator; the report says when one beats the pick.

With a worker pool, the templates (phase 1, then those to combine at shared configs)
are cut over the pool while this process works out the baselines' plans (phase 5, which
needs nothing of the templates), so those phases' times overlap; the rest runs here,
the estimates and simulations over the pool.

Objectives: least iteration time, or least USD per million tokens; the result carries
the (time, cost) Pareto front of the simulated plans either way.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput, InfeasiblePlan
from hyperpipe.core.units import format_quantity
from hyperpipe.plan.kinds import schedule_kind
from hyperpipe.plan.plan import CP_RULE, PipelinePlan, Plan, cp_misfit, tp_misfit
from hyperpipe.search import space
from hyperpipe.search.backends import backend_or_workers, fan_out
from hyperpipe.search.baselines import constrained, tuned_baselines
from hyperpipe.search.caches import BookKey
from hyperpipe.search.evaluate import (
    Candidate,
    as_default_kind,
    count_actions,
    dedupe,
    dedupe_equivalent,
    estimate,
    pareto_front,
    rank_key,
    simulate_all,
)
from hyperpipe.search.refine import polish, refine
from hyperpipe.search.space import SearchConstraints
from hyperpipe.search.synthesis import SYNTHESISED_BASELINES, ruled_out, synthesise_top
from hyperpipe.search.templates import (
    KEEP_PER_GROUP,
    TOLERANCE,
    PhaseCounts,
    PhaseStats,
    SearchContext,
    Template,
    kept_at,
    objective_value,
    start_book,
    templates_at,
    type_subsets,
    worker_context,
)
from hyperpipe.sim.costmodel import CostModel

__all__ = ["SearchConstraints", "Candidate", "SearchResult", "search", "pareto_front"]

ASSEMBLE_LIMIT = 64       # combinations built as plans and estimated, besides ...
ASSEMBLE_PER_GROUPING = 4  # ... the best few of every grouping of the device types
SIMULATE_MIN = 6          # at least this many plans ranked by the simulator
SIMULATE_MAX = 64         # at most this many in the short list
SIM_ACTION_BUDGET = 100_000   # schedule actions simulated for the short list and polish
REFINE_BUDGET = 200       # analytic estimates spent on moving single layers across cuts


@dataclass(frozen=True)
class SearchResult:
    best: Candidate
    ranked: list[Candidate]
    baselines: dict[str, Candidate]
    candidates_evaluated: int
    search_time_s: float
    phases: list[dict]             # per phase: name, seen, pruned, infeasible, seconds
    pareto: list[Candidate] = field(default_factory=list)   # (iteration time, cost) front
    simulated: list[Candidate] = field(default_factory=list)  # every feasible plan, ranked
    # the seed baseline ("uniform" or "proportional") whose plan the pick is, unless the
    # search found that same plan itself, or "start" (`search --start`'s plan); None
    # when the pick is the search's own
    seeded_from: str | None = None
    # the best feasible plan of the search's own (what it picks without the seeds)
    own_best: Candidate | None = None
    # what the search was asked for (the report holds every plan it names to them)
    constraints: SearchConstraints | None = field(default=None, compare=False)
    # the search's context (its caches) when searched with `keep_context`, for a search
    # of this cluster less some nodes to start from (`search(carry=...)`); else None
    context: SearchContext | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The `search --json` object: best, ranked, baselines, candidates_evaluated,
        search_time_s (a fixed set of keys; the CLI prints it)."""
        return {"best": self.best.to_dict(),
                "ranked": [c.to_dict() for c in self.ranked],
                "baselines": {k: c.to_dict() for k, c in self.baselines.items()},
                "candidates_evaluated": self.candidates_evaluated,
                "search_time_s": self.search_time_s}


# ---------------------------------------------------------------------------- assembling

def _combined_time(tpls: tuple[Template, ...], big_m: int) -> float:
    """Iteration time when M micro-batches are spread over all pipelines so that they
    finish together: a continuous relaxation of the water-filling split, by bisection on
    the time T, pipeline i taking m_i(T) micro-batches (the inverse of its
    `Template.time_s`), and every pipeline at least one."""
    def share(t: Template, total: float) -> float:
        room = total - t.sync_s
        if room < t.part.trip_s:
            return 0.0
        return min((room - t.fill_s) / t.device_load_s + 1, room / t.device_load_s)

    lo = max(t.time_s(1) for t in tpls)          # every pipeline does one micro-batch
    hi = max(t.time_s(big_m) for t in tpls)
    if sum(t.dp * share(t, lo) for t in tpls) >= big_m:
        return lo
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(t.dp * share(t, mid) for t in tpls) >= big_m:
            hi = mid
        else:
            lo = mid
    return hi


def split_batch(times: list, big_m: int) -> list[int]:
    """Integer micro-batch counts (each >= 1, summing to big_m) minimising the slowest
    pipeline, `times[i](m)` being pipeline i's time for m micro-batches (greedy
    water-filling, optimal for non-decreasing times)."""
    n = len(times)
    if big_m < n:
        raise InfeasiblePlan(f"{big_m} micro-batches cannot feed {n} pipelines")
    counts = [1] * n
    heap = [(times[i](2), i) for i in range(n)]
    heapq.heapify(heap)
    for _ in range(big_m - n):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (times[i](counts[i] + 1), i))
    return counts


def _build_plan(ctx: SearchContext, tpls: tuple[Template, ...]) -> Plan:
    mb = tpls[0].micro_batch
    rows = [(t, r) for t in tpls for r in range(t.dp)]
    counts = split_batch([t.time_s for t, _ in rows], ctx.c.global_batch // mb)
    pipes = [PipelinePlan(mb, m, t.stages(r)) for (t, r), m in zip(rows, counts, strict=True)]
    plan = Plan(model=ctx.refs[0], cluster=ctx.refs[1],
                global_batch=ctx.c.global_batch, schedule=tpls[0].kind,
                chunks=tpls[0].chunks, pipelines=tuple(pipes),
                zero=max(t.mode.zero for t in tpls),
                stack=ctx.c.stack, runtime=ctx.c.runtime)
    plan.check(ctx.model, ctx.cluster)
    return plan


class Combo(NamedTuple):
    """Templates combined into one plan (one per block of a grouping of the device
    types), with the objective value of their closed forms."""

    value: float
    templates: tuple[Template, ...]


def _combinations(ctx: SearchContext, phase: PhaseStats, types: list[str]
                  ) -> Iterator[Combo]:
    """Yield the combinations over set partitions of subsets of the types. One
    block: its kept templates. Several: they must share (schedule, micro-batch), so each
    block's templates are taken at the configs where some block does best."""
    c = ctx.c
    for blocks in space.type_groups(types):
        if len(blocks) == 1:
            choices = [(t,) for t in templates_at(ctx, phase, tuple(blocks[0]), None)]
        else:
            configs = _shared_configs(ctx, phase, blocks)
            choices = []
            for cfg in configs:
                options = [templates_at(ctx, phase, tuple(b), cfg)[:KEEP_PER_GROUP]
                           for b in blocks]
                choices += list(itertools.product(*options))
        for tpls in choices:
            phase.seen += 1
            if len(tpls) > 1 and any(t.mode.ep > 1 for t in tpls):
                # an expert-parallel group spans the replicas holding the same layers
                # with the same cut (`StagePlan.ep`): templates cut apart cannot share it
                phase.infeasible += 1
                continue
            big_m = c.global_batch // tpls[0].micro_batch
            n_pipes = sum(t.dp for t in tpls)
            if (c.dp is not None and n_pipes != c.dp) or n_pipes > big_m:
                phase.infeasible += 1
                continue
            total = _combined_time(tpls, big_m)
            price = sum(t.price_per_hour for t in tpls)
            yield Combo(objective_value(ctx, total, price), tpls)


def _shared_configs(ctx: SearchContext, phase: PhaseStats, blocks: list
                    ) -> list[tuple[str, int, int]]:
    """The configs at which the blocks of one grouping are combined: each block's
    favourite (the config of its best template), and smaller micro-batches of it (alone
    a block takes the whole batch, shared it gets fewer micro-batches); none when a
    block has no template."""
    firsts = [templates_at(ctx, phase, tuple(b), None) for b in blocks]
    if not all(firsts):
        return []
    return list(dict.fromkeys(
        (kind, v, b) for kind, v, mb in (f[0].config for f in firsts)
        for b in [mb, *(x for x in space.micro_batches(ctx.c) if x < mb)]))


def _templates(ctx: SearchContext, phases: list[PhaseStats], show, pool, peers: bool
               ) -> tuple[list[str], dict[str, list[Plan]]]:
    """Phase 1, the templates each block of a grouping needs at the configs it is
    combined at (`_shared_configs`, where none of its kept templates has one: part of
    phase 2), and phase 5, overlapped: with a pool, the groups are cut over it while
    this process works out the baselines (which need nothing of the templates), and a
    grouping's templates to combine are started as soon as its blocks are in the book
    (every group but the whole set of classes is a block of some grouping). Phase 1's
    seconds run from its start, over phase 5's. The device classes, and the baselines'
    plans."""
    types = list(ctx.classes)
    groupings = [blocks for blocks in space.type_groups(types) if len(blocks) > 1]
    combine: list = []               # waiters of the templates to combine
    started: set[BookKey] = set()

    def ready(_: BookKey) -> None:
        for blocks in [g for g in groupings
                       if all(BookKey(tuple(b), None) in ctx.book for b in g)]:
            groupings.remove(blocks)
            keys = [k for cfg in _shared_configs(ctx, phases[1], blocks) for b in blocks
                    if (k := BookKey(tuple(b), cfg)) not in started
                    and not kept_at(ctx, phases[1], k.types, cfg)]
            started.update(keys)
            combine.append(start_book(ctx, keys, pool))

    t0 = time.perf_counter()
    whole = [BookKey(tuple(types), None)]         # a block of no grouping: waited last
    wait_whole = start_book(ctx, whole, pool)
    wait_parts = start_book(ctx, [BookKey(s, None) for s in type_subsets(types)
                                  if len(s) < len(types)], pool)
    base_plans = _timed(phases[4], _baselines_phase, ctx, peers)
    wait_parts(phases[0], show, "search: templates", ready)
    wait_whole(phases[0], show, "search: templates")
    t1 = time.perf_counter()
    for wait in combine:
        wait(phases[1], show, "search: templates to combine")
    phases[0].seconds += t1 - t0
    phases[1].seconds += time.perf_counter() - t1
    return types, base_plans


# ---------------------------------------------------------------------------- search

def _shortfall(ctx: SearchContext) -> str:
    """One line saying what is short when no plan fits."""
    model, cluster = ctx.model, ctx.cluster
    need = ctx.cost.state_bytes((0, model.num_layers))
    have = sum(d.type.memory_bytes for d in cluster.devices)
    biggest = max(model.layers[i].params for i in range(model.num_layers)) * \
        ctx.cost.state_bytes_per_param
    largest_dev = max(d.type.memory_bytes for d in cluster.devices)
    need_b, have_b, biggest_b, largest_b = (format_quantity(x, "B") for x in
                                            (need, have, biggest, largest_dev))
    if need > have:
        return (f"model {model.name} needs {need_b} for weights, gradients and "
                f"optimizer state; cluster {cluster.name} has {have_b} in all")
    if biggest > largest_dev * max(ctx.c.tp or 1, 1):
        return (f"the largest layer of {model.name} needs {biggest_b} of state; "
                f"the largest device has {largest_b}")
    return (f"no plan within the constraints fits in memory and runs on stack "
            f"{ctx.c.stack}: model {model.name} needs "
            f"{need_b} of state plus activations (micro-batch "
            f"{ctx.c.micro_batch or 'any'}), cluster {cluster.name} has "
            f"{have_b}")


def search(model, cluster, constraints: SearchConstraints, *, profile=None, top: int = 5,
           workers: int = 1, progress: bool = False, backend=None,
           quiet: bool = False, peers: bool = True,
           carry: SearchResult | None = None, keep_context: bool = False) -> SearchResult:
    """Find the best plans for `model` on `cluster` under `constraints`. Independent
    work is spread over `backend` (`hyperpipe.search.backends`, already entered) when
    given, else over `workers` local processes. Progress bars on stderr: on a terminal,
    always with `progress`, never with `quiet`.

    `peers` False leaves the peer planners (Metis, AMP) out: `baselines` then holds the
    tuned ones alone (the seeds), for callers that read the pick alone.

    `carry`: an earlier search of a cluster with this one's nodes (and maybe more), whose
    caches and type groups' templates this one starts from where they hold
    (`SearchContext.carry_from`); the result is that of a search without it. Only a
    result searched with `keep_context` holds them (`SearchResult.context`): they are
    most of the search's memory, and without it they go with the search.

    Raises InfeasiblePlan (one line saying what is short) when nothing fits, BadInput
    when the constraints contradict the cluster.
    """
    start = time.perf_counter()
    c = constraints
    if top < 1 or workers < 1:
        raise BadInput("top/workers", "positive integers", (top, workers))
    _check_constraints(model, cluster, c)
    ctx = SearchContext(CostModel(model, cluster, profile), c)
    if carry is not None and carry.context is not None:
        ctx.carry_from(carry.context)
    # None: the bar shows itself on a terminal only; `quiet`: a caller's bar is shown
    show = False if quiet else (progress or None)
    phases = [PhaseStats("templates"), PhaseStats("assemble"), PhaseStats("refine"),
              PhaseStats("simulate"), PhaseStats("baselines")]

    with backend_or_workers(backend, workers) as pool:
        types, base_plans = _templates(ctx, phases, show, pool, peers)
        # none estimated (a space the templates do not cover): the seeds may still fit
        estimated = _timed(phases[1], _assemble_phase, ctx, types, pool)
        if not estimated and not base_plans:
            raise InfeasiblePlan(_shortfall(ctx))
        estimated.sort(key=lambda cand: rank_key(c, cand.metrics))
        refined = _timed(phases[2], refine, ctx, dedupe(estimated), _refine_budget(ctx))
        short = sorted(dedupe(refined + estimated),
                       key=lambda cand: rank_key(c, cand.metrics))
        ranked, baselines, seeds = _timed(phases[3], _simulate_phase, ctx, short,
                                          base_plans, pool, show, max(top, SIMULATE_MIN))
    feasible = [cand for cand in ranked if cand.metrics.feasible]
    if not feasible:
        raise InfeasiblePlan(_shortfall(ctx))
    if c.schedule is None:          # one-stage plans under the kind a reader expects
        renamed = as_default_kind(feasible[:top], ctx.cost)
        seeds = {name: next((new for old, new in zip(feasible, renamed, strict=False)
                             if old is seed), seed) for name, seed in seeds.items()}
        feasible = renamed + feasible[top:]
    feasible = dedupe_equivalent(feasible, cluster)     # no look-alikes in the list
    origin = [seed_of(cand, seeds) for cand in feasible]
    return SearchResult(best=feasible[0], ranked=feasible[:top], baselines=baselines,
                        candidates_evaluated=sum(p.seen for p in phases),
                        search_time_s=time.perf_counter() - start,
                        phases=[p.as_dict() for p in phases],
                        pareto=pareto_front(feasible + list(baselines.values())),
                        simulated=feasible, constraints=c,
                        seeded_from=origin[0],
                        own_best=next((cand for cand, seed in zip(feasible, origin,
                                                                  strict=True)
                                       if seed is None), None),
                        context=ctx if keep_context else None)


def seed_of(cand: Candidate, seeds: dict[str, Candidate]) -> str | None:
    """The seed (`SearchResult.seeded_from`) `cand` is, or None when it is a plan of the
    search's own; `seeds`: name -> the candidate each seed joined the ranking as. By
    identity: a seed on devices, stages and micro-batching the search also found keeps
    its own cut, which follows the cluster's rank order, not the search's walk."""
    return next((name for name, seed in seeds.items() if seed is cand), None)


def idle_devices(cluster, plan: Plan) -> list[str]:
    """The devices of `cluster` that `plan` leaves idle, in cluster order."""
    used = set(plan.devices)
    return [d.name for d in cluster.devices if d.name not in used]


def search_size(layers: int, devices: int) -> int:
    """What bounds a search's time and memory: its tables hold a cost per range of layers
    (layers^2 per kind of stage) and a pipeline has at most `layers` stages, so
    layers^2 x min(devices, layers); devices beyond that only add replicas, which the
    search counts, not tabulates."""
    return layers * layers * min(devices, layers)


def _check_constraints(model, cluster, c: SearchConstraints) -> None:
    """Fixed dimensions the cluster or model cannot have, and a search too big to run
    (`limits.MAX_SEARCH_SIZE`, checked before any work): bad input, not infeasible."""
    layers, devices = model.num_layers, len(cluster.devices)
    if search_size(layers, devices) > limits.MAX_SEARCH_SIZE:
        most = max(n for n in range(1, layers + 1)
                   if search_size(n, devices) <= limits.MAX_SEARCH_SIZE)
        raise BadInput("search", f"a model of at most {most} layers on {devices} devices "
                       f"(layers^2 x min(devices, layers) at most {limits.MAX_SEARCH_SIZE}: "
                       "hyperpipe.core.limits.MAX_SEARCH_SIZE)", f"{layers} layers")
    largest = max(n.count for n in cluster.nodes)
    if c.tp is not None and c.tp > largest:
        raise BadInput("tp", f"at most the largest node's {largest} devices (tensor "
                       "parallelism stays inside a node)", c.tp)
    need = (c.pp or 1) * (c.dp or 1) * (c.tp or 1) * (c.cp or 1)
    if need > len(cluster.devices):
        raise BadInput("pp x dp x tp x cp", f"at most the cluster's "
                       f"{len(cluster.devices)} devices", need)
    if c.cp is not None and c.cp > 1 and (model.config is None or cp_misfit(model, c.cp)):
        raise BadInput("cp", CP_RULE.format(seq_len=model.seq_len) + ", on a model with "
                       "attention", c.cp)
    stages = (c.pp or 1) * (c.chunks or 1)
    if stages > model.num_layers:
        raise BadInput("pp x chunks", f"at most the model's {model.num_layers} layers "
                       "(one layer per stage at least)", stages)
    if c.objective == "cost":
        unpriced = [n.name for n in cluster.nodes
                    if cluster.price_per_hour(f"{n.name}/0") is None]
        if unpriced:
            raise BadInput("objective cost", "a cluster with prices (price_per_hour on "
                           "every node or device type)", f"none on nodes {unpriced[:4]}")
    moe = model.config.moe if model.config is not None else None
    if c.ep is not None and c.ep > 1 and (moe is None or moe.experts % c.ep):
        raise BadInput("ep", "a divisor of the model's routed experts" + (
            f" ({moe.experts})" if moe is not None else f" (model {model.name} has no MoE "
            "blocks: 1)"), c.ep)
    _check_room(model, cluster, c)
    if c.tp is not None:
        misfit = tp_misfit(model, c.tp, bool(c.sequence_parallel), c.cp or 1)
        if misfit is not None:
            raise BadInput("tp", f"a divisor of the model's {misfit[0]} ({misfit[1]}): "
                           "tensor parallelism splits it", c.tp)
    elif c.sequence_parallel and model.config is not None:
        tps = [t for t in space.tp_options(cluster, model, c) if t > 1]
        if not any(tp_misfit(model, t, True, cp) is None
                   for t in tps for cp in space.cp_options(model, c)):
            raise BadInput("sequence_parallel", "a tensor-parallel degree above 1 that "
                           f"splits the model's {model.seq_len} tokens (per context rank) "
                           f"evenly; the degrees the cluster and model allow: "
                           f"{', '.join(map(str, tps)) or 'none'}", True)


def _check_room(model, cluster, c: SearchConstraints) -> None:
    """Fixed degrees that leave the search no plan although each fits the cluster alone
    (InfeasiblePlan, naming them): a chunked schedule with room for one pipeline device,
    a stage's tp x cp devices (of one type) more than any type has, expert ranks beyond
    the data-parallel x context ranks there is room for."""
    n = len(cluster.devices)
    tp, cp = c.tp or 1, c.cp or 1
    if c.schedule is not None and not schedule_kind(c.schedule).carries_actions:
        # the fewest chunks the search tries for the fixed kind (`space.schedule_options`)
        tried = [v for _, v in space.schedule_options(c, model.num_layers)]
        if not tried:
            kind = schedule_kind(c.schedule)
            v = c.chunks or (2 if kind.takes_chunks else kind.default_chunks)
            raise InfeasiblePlan(f"schedule {c.schedule} ({v} chunks per device) runs over "
                                 f"pp >= 2 in the search, so over at least {2 * v} layers; "
                                 f"the model has {model.num_layers} layers")
        chunks = min(tried)
        room = c.pp or n // ((c.dp or 1) * tp * cp)
        if chunks > 1 and room < 2:
            raise InfeasiblePlan(f"schedule {c.schedule} ({chunks} chunks per device) runs "
                                 f"over pp >= 2 in the search; the fixed degrees leave pp "
                                 f"{room} on {n} devices")
    most, count = Counter(d.type.name for d in cluster.devices).most_common(1)[0]
    if tp * cp > count:
        raise InfeasiblePlan(f"tp x cp = {tp * cp} devices of one type per stage (the "
                             "search gives a stage's tensor and context ranks one type); "
                             f"the most of one type here: {count} {most}")
    if c.ep is not None and c.ep * tp * (c.pp or 1) > n:
        raise InfeasiblePlan(f"ep x tp x pp = {c.ep * tp * (c.pp or 1)} devices (expert "
                             "ranks are carved out of a stage's data-parallel x context "
                             f"ranks); the cluster has {n}")


def _baselines_phase(ctx: SearchContext, phase: PhaseStats, peers: bool = True
                     ) -> dict[str, list[Plan]]:
    """Phase 5: the tuned baselines' short lists and (`peers`) each peer planner's own
    pick, worked out here (`search` runs this while its pool cuts the templates):
    name -> plans."""
    from hyperpipe.search.baselines import BASELINES
    from hyperpipe.search.peers import PEERS
    out: dict[str, list[Plan]] = {}
    for names in [tuple(BASELINES), *((name,) for name in PEERS if peers)]:
        found, counts = _baseline_work(ctx, names)
        phase.add(counts)
        out.update(found)
    return out


def _baseline_work(ctx: SearchContext, names: tuple[str, ...]
                   ) -> tuple[dict[str, list[Plan]], PhaseCounts]:
    """The short lists of tuned baselines (tuned over the grid) or one peer's pick, by
    name (none when infeasible), with the phase counters it adds."""
    from hyperpipe.search.peers import PEERS
    phase = PhaseStats("baselines")
    if names[0] not in PEERS:
        found = tuned_baselines(ctx, phase, names)
    else:
        phase.seen += 1
        pick = PEERS[names[0]](ctx)
        plan = None
        if pick is not None:
            try:    # what the user fixed that the peer's search does not choose
                plan = constrained(ctx, pick.plan)
            except (BadInput, InfeasiblePlan):
                plan = None
        phase.infeasible += plan is None
        found = {} if plan is None else {names[0]: [plan]}
    return found, phase.counts()


def _refine_budget(ctx: SearchContext) -> int:
    """Analytic estimates for refining: REFINE_BUDGET on small clusters, fewer on large
    ones, where each estimate walks more pipelines (about the same time either way)."""
    return max(REFINE_BUDGET // 10, REFINE_BUDGET * 64 // max(64, len(ctx.cluster.devices)))


def _timed(phase: PhaseStats, fn, *args):
    t0 = time.perf_counter()
    try:
        return fn(*args[:1], phase, *args[1:])
    finally:
        phase.seconds += time.perf_counter() - t0     # a phase may be timed in parts


def _assemble_phase(ctx: SearchContext, phase: PhaseStats, types: list[str], pool=None
                    ) -> list[Candidate]:
    """Phase 2: combine type groups, split the batch, build plans, check them with the
    analytic tier (out of memory: infeasible), over the worker `pool`."""
    combos = list(_combinations(ctx, phase, types))
    best = assemble_picks([(tuple(t.types for t in combo.templates),
                            combo.templates[0].kind) for combo in combos],
                          [combo.value for combo in combos])
    phase.pruned += len(combos) - len(best)
    plans: list[Plan] = []
    for tpls in (combos[i].templates for i in best):
        try:
            plans.append(_build_plan(ctx, tpls))
        except InfeasiblePlan:
            phase.infeasible += 1
    out: list[Candidate] = []
    for plan, metrics in zip(plans, estimate_all(ctx, plans, pool), strict=True):
        if not metrics.feasible:
            phase.infeasible += 1
            continue
        out.append(Candidate(plan, metrics))
    return out


ESTIMATES_PER_TASK = 16     # plans a worker estimates in one task (its caches shared)


def estimate_all(ctx: SearchContext, plans: list[Plan], pool=None) -> list:
    """The analytic tier's metrics of each plan, over the worker `pool` (None: here), in
    tasks of ESTIMATES_PER_TASK plans."""
    chunks = [plans[i:i + ESTIMATES_PER_TASK]
              for i in range(0, len(plans), ESTIMATES_PER_TASK)]
    cost = ctx.cost
    results = fan_out(pool, chunks, lambda chunk: [estimate(p, cost) for p in chunk],
                      _estimate_task,
                      lambda chunk: (ctx.inputs, chunk),
                      at_least=2)
    return [m for got in results() for m in got]


def _estimate_task(args) -> list:
    """`estimate` of a chunk of plans in a worker process (`worker_context`'s cost
    model, whose caches the worker's other tasks share)."""
    inputs, chunk = args
    cost = worker_context(*inputs).cost
    return [estimate(p, cost) for p in chunk]


def assemble_picks(keys: list[tuple[tuple, str]], values: list[float]) -> list[int]:
    """Which combinations to build as plans and estimate, best closed form first: each
    is (grouping of the device types, schedule kind) with its closed-form value. The
    best ASSEMBLE_PER_GROUPING of every grouping, the best of every kind in every
    grouping within the templates' TOLERANCE of that grouping's best, and the best
    ASSEMBLE_LIMIT overall: the closed form misjudges some groupings (shared links,
    all-reduces across unlike pipelines) and ranks close kinds by its own bubble model
    (zb-h1 over zb-v where the analytic tier and the simulator say otherwise), so no
    grouping, nor a kind close to its best, may crowd the others out."""
    by_groups: dict[tuple, list[int]] = {}
    by_kinds: dict[tuple, list[int]] = {}
    for i, (grouping, kind) in enumerate(keys):
        by_groups.setdefault(grouping, []).append(i)
        by_kinds.setdefault((grouping, kind), []).append(i)
    picked = dict.fromkeys(i for group in by_groups.values()
                           for i in heapq.nsmallest(ASSEMBLE_PER_GROUPING, group,
                                                    key=values.__getitem__))
    best = {g: min(values[i] for i in group) for g, group in by_groups.items()}
    picked.update(dict.fromkeys(i for (grouping, _), group in by_kinds.items()
                                if values[i := min(group, key=values.__getitem__)]
                                <= best[grouping] * (1 + TOLERANCE)))
    picked.update(dict.fromkeys(heapq.nsmallest(ASSEMBLE_LIMIT, range(len(keys)),
                                                key=values.__getitem__)))
    return sorted(picked, key=values.__getitem__)


def _simulate_phase(ctx: SearchContext, phase: PhaseStats, cands: list[Candidate],
                    base_plans: dict[str, Plan], pool, show, n_min: int):
    """Phase 3: the short list and the baselines, ranked by the SimPy simulator. The
    short list is the best `n_min` by the analytic tier, longer while the simulation
    budget (in schedule actions) allows: the analytic tier ties plans that differ only
    in which stage sits where, the simulator does not. Then single-layer moves on the
    best simulated plans, judged by the simulator, while budget is left, schedules
    synthesised for the best, and the seeds join (see the module doc). Returns the
    ranking, the baselines and the seeds that joined it as themselves (name -> the
    candidate; a seed equal to a plan of the search's own stays the search's)."""
    from hyperpipe.core.progress import Progress
    from hyperpipe.plan.plan import plan_over_action_limit
    # plans whose schedule could not be built (the analytic tier's closed forms do not
    # build it) are infeasible: the simulator and the executor would refuse them
    runnable = [cand for cand in cands if not plan_over_action_limit(cand.plan)]
    n_base = sum(map(len, base_plans.values()))
    base_plans = {k: kept for k, plans in base_plans.items()
                  if (kept := [p for p in plans if not plan_over_action_limit(p)])}
    phase.infeasible += len(cands) - len(runnable) + n_base - sum(map(len, base_plans.values()))
    budget = SIM_ACTION_BUDGET
    short = []
    for cand in runnable:
        size = count_actions(cand.plan)
        if len(short) >= n_min and (size > budget or len(short) >= SIMULATE_MAX):
            break
        budget -= size
        short.append(cand)
    # the best plan (by the analytic tier) of those using the most devices, so that the
    # report can say what the devices the pick leaves idle would bring
    if runnable:
        widest = max(len(cand.plan.devices) for cand in runnable)
        if all(len(cand.plan.devices) < widest for cand in short):
            short.append(next(c for c in runnable if len(c.plan.devices) == widest))
    names = [(k, i) for k, plans in base_plans.items() for i in range(len(plans))]
    # the best few of the other kinds first; then the rest (the V kinds' candidates, whose
    # IR is the largest, among them), each only where a lower bound on any schedule of
    # its stages (`synthesis.schedule_bound_s`) is below the best simulated so far
    first = [cand for cand in short if schedule_kind(cand.plan.schedule).placement != "v"]
    first, later = first[:n_min], first[n_min:] + \
        [cand for cand in short if schedule_kind(cand.plan.schedule).placement == "v"]
    todo = [cand.plan for cand in first] + [base_plans[k][i] for k, i in names]
    with Progress(len(todo) + len(later), "search: simulate", enabled=show) as bar:
        metrics = simulate_all(todo, ctx.cost, pool, bar)
        n = len(first)
        ranked = [Candidate(cand.plan, m) for cand, m in zip(first, metrics[:n], strict=True)]
        best = min((rank_key(ctx.c, c.metrics)[1] for c in ranked if c.metrics.feasible),
                   default=math.inf)
        keep = [cand for cand in later if not ruled_out(ctx, cand, best)]
        phase.pruned += len(later) - len(keep)
        bar.advance(len(later) - len(keep))
        ranked += [Candidate(cand.plan, m) for cand, m in
                   zip(keep, simulate_all([c.plan for c in keep], ctx.cost, pool, bar),
                       strict=True)]
    phase.seen = len(todo) + len(later)
    phase.infeasible += sum(1 for cand in ranked if not cand.metrics.feasible)
    # each baseline's pick among its short list, by the simulator (the search's judge)
    baselines: dict[str, Candidate] = {}
    for (k, i), m in zip(names, metrics[n:], strict=True):
        cand = Candidate(base_plans[k][i], m)
        if k not in baselines or rank_key(ctx.c, m) < rank_key(ctx.c, baselines[k].metrics):
            baselines[k] = cand
    ranked.sort(key=lambda cand: rank_key(ctx.c, cand.metrics))
    ranked, budget = polish(ctx, phase, ranked, budget, pool)
    ranked, baselines = synthesise_top(ctx, phase, ranked, pool=pool, baselines=baselines,
                                       budget=budget)
    if ctx.c.schedule is not None and schedule_kind(ctx.c.schedule).carries_actions:
        ranked = [cand for cand in ranked if ctx.c.admits(cand.plan)]     # synth asked
    # the seeds: the tuned baselines of the search's own space (`SYNTHESISED_BASELINES`,
    # synthesised as the search's best are) that keep what the user fixed join the
    # ranking under their names; one equal to a plan of the search's own is dropped
    # as a duplicate of it (`dedupe` keeps the first)
    joined = {k: baselines[k] for k in SYNTHESISED_BASELINES if k in baselines
              and baselines[k].metrics.feasible and ctx.c.admits(baselines[k].plan)}
    ranked = sorted(dedupe(ranked + list(joined.values())),
                    key=lambda cand: rank_key(ctx.c, cand.metrics))
    return ranked, baselines, {k: cand for k, cand in joined.items()
                               if any(cand is kept for kept in ranked)}
