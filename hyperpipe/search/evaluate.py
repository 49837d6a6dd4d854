"""Judging candidate plans: the analytic tier and the simulator (here or over a process
pool), the ranking key of an objective, the (time, cost) Pareto front, duplicates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from hyperpipe.plan.kinds import DEFAULT_KIND, schedule_kind
from hyperpipe.plan.plan import Plan
from hyperpipe.search.space import SearchConstraints
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.metrics import IMPROVEMENT_REL, Metrics


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    metrics: Metrics

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "metrics": self.metrics.to_dict()}


def estimate(plan: Plan, cost: CostModel) -> Metrics:
    from hyperpipe.sim.analytic import estimate
    return estimate(plan, cost)


def simulate_one(plan: Plan, cost: CostModel) -> Metrics:
    from hyperpipe.sim.simulator import SimOptions, simulate
    return simulate(plan, cost, SimOptions(trace=False)).metrics


def simulate_task(args) -> Metrics:
    plan, model, cluster, profile = args
    return simulate_one(plan, CostModel(model, cluster, profile))


def simulate_all(plans: list[Plan], cost: CostModel, pool=None, bar=None) -> list[Metrics]:
    """Metrics of each plan by the simulator, over the worker `pool` (None: here)."""
    from hyperpipe.search.backends import fan_out
    results = fan_out(pool, plans, lambda p: simulate_one(p, cost), simulate_task,
                      lambda p: (p, cost.model, cost.cluster, cost.profile), at_least=2)
    out: list[Metrics] = []
    for metrics in results():
        out.append(metrics)
        if bar is not None:
            bar.advance()
    return out


def rank_key(c: SearchConstraints, m: Metrics) -> tuple:
    value = m.iteration_time_s
    if c.objective == "cost":
        value = m.cost_per_million_tokens if m.cost_per_million_tokens is not None \
            else math.inf
    return (not m.feasible, value, m.iteration_time_s)


def improves(c: SearchConstraints, new: Metrics, old: Metrics,
             rel: float = IMPROVEMENT_REL) -> bool:
    """Whether `new` ranks before `old` by more than `rel` of its objective (default:
    float noise, `IMPROVEMENT_REL`): feasible before infeasible, then a smaller
    objective by more than that fraction."""
    a, b = rank_key(c, new), rank_key(c, old)
    if a[0] != b[0]:
        return a[0] < b[0]
    if math.isinf(b[1]):            # (a cost objective without prices)
        return a[1] < b[1]
    return a[1] < b[1] - rel * abs(b[1])


def pareto_front(cands: list[Candidate]) -> list[Candidate]:
    """Feasible candidates not beaten on both speed (tokens per second: plans of what-if
    variants may train other batches or sequences per iteration) and cost per million
    tokens, fastest first (empty when the cluster has no prices)."""
    pts = [c for c in cands if c.metrics.feasible and c.metrics.cost_per_million_tokens
           is not None]
    pts.sort(key=lambda c: (-c.metrics.tokens_per_s, c.metrics.cost_per_million_tokens))
    front, best_cost = [], math.inf
    for cand in pts:
        if cand.metrics.cost_per_million_tokens < best_cost - 1e-12:
            front.append(cand)
            best_cost = cand.metrics.cost_per_million_tokens
    return front


def count_actions(plan: Plan) -> int:
    """Schedule actions the simulator runs for `plan` (identical replicas once)."""
    seen = {(p.num_microbatches, tuple(s.layers for s in p.stages)): len(p.stages) *
            p.num_microbatches for p in plan.pipelines}
    return 2 * sum(seen.values())


def as_default_kind(cands: list[Candidate], cost: CostModel) -> list[Candidate]:
    """`cands` with each plan whose pipelines are all one stage of one chunk, under a
    generated kind other than `DEFAULT_KIND`, written as `DEFAULT_KIND` where that
    simulates to the same time and peak memory (on one stage a kind only orders one
    device's actions): such a plan is listed under the kind a reader expects. A plan
    whose pricing tells the kinds apart (B unlike I + W under a profile) keeps its own."""
    out = []
    for cand in cands:
        p = cand.plan
        if p.schedule != DEFAULT_KIND and p.chunks == 1 and \
                not schedule_kind(p.schedule).carries_actions and \
                all(len(pipe.stages) == 1 for pipe in p.pipelines):
            plain = replace(p, schedule=DEFAULT_KIND)
            m = simulate_one(plain, cost)
            if m.peak_memory_bytes == cand.metrics.peak_memory_bytes and \
                    abs(m.iteration_time_s - cand.metrics.iteration_time_s) <= \
                    IMPROVEMENT_REL * cand.metrics.iteration_time_s:
                cand = Candidate(plain, m)
        out.append(cand)
    return out


def dedupe_equivalent(cands: list[Candidate], cluster) -> list[Candidate]:
    """Keep one of plans a reader cannot tell apart, at the first one's place: the same
    schedule, the same stages (layers, tp, recompute, device types) per replica in any
    replica order, the same micro-batching and the same simulated iteration time (to
    1e-9 relative); they differ only in which devices of one type they use. Where every
    pipeline is one stage of one chunk, the schedule kinds differ only in the order of
    one device's actions: plans that also agree in their peak memory per device are
    alike whatever their kind, and the one kept runs `DEFAULT_KIND` where one does."""
    kept: dict[tuple, int] = {}
    out: list[Candidate] = []
    for cand in cands:
        p = cand.plan
        one_stage = p.chunks == 1 and all(len(pipe.stages) == 1 for pipe in p.pipelines)
        kind = tuple(sorted(cand.metrics.peak_memory_bytes.values())) if one_stage \
            else p.schedule
        pipes = sorted(
            (pipe.micro_batch, pipe.num_microbatches,
             tuple((s.layers, s.tp, s.recompute, s.sequence_parallel,
                    tuple(cluster.device(d).type.name for d in s.devices))
                   for s in pipe.stages))
            for pipe in p.pipelines)
        key = (kind, p.chunks, p.distributed_optimizer, tuple(pipes),
               float(f"{cand.metrics.iteration_time_s:.9e}"))
        if key not in kept:
            kept[key] = len(out)
            out.append(cand)
        elif p.schedule == DEFAULT_KIND and out[kept[key]].plan.schedule != DEFAULT_KIND:
            out[kept[key]] = cand
    return out


def dedupe(cands: list[Candidate]) -> list[Candidate]:
    seen, out = set(), []
    for cand in cands:
        p = cand.plan
        key = (p.schedule, p.chunks, p.pipelines)
        if key not in seen:
            seen.add(key)
            out.append(cand)
    return out
