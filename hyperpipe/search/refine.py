"""Local moves after the search has its candidates: single layers moved across cuts,
judged by the analytic tier (`refine`) or, for the best simulated plans, by the
simulator (`polish`), each within a budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from hyperpipe.plan.plan import PipelinePlan, Plan
from hyperpipe.search.evaluate import (
    Candidate,
    count_actions,
    dedupe,
    estimate,
    improves,
    rank_key,
    simulate_all,
)
from hyperpipe.search.templates import PhaseStats, SearchContext

POLISH_TOP = 2            # best simulated plans polished by single-layer moves


def neighbours(plan: Plan) -> Iterable[Plan]:
    """Plans with one layer moved across one cut, in every class of pipelines that share
    a layer cut (the replicas of one template move together)."""
    classes: dict[tuple, list[int]] = {}
    for i, pipe in enumerate(plan.pipelines):
        classes.setdefault(tuple(s.layers for s in pipe.stages), []).append(i)
    for cut, members in classes.items():
        for k in range(len(cut) - 1):
            for step in (-1, 1):
                edge = cut[k][1] + step
                if not cut[k][0] < edge < cut[k + 1][1]:
                    continue
                pipes = list(plan.pipelines)
                for i in members:
                    st = list(pipes[i].stages)
                    st[k] = replace(st[k], layers=(st[k].layers[0], edge))
                    st[k + 1] = replace(st[k + 1], layers=(edge, st[k + 1].layers[1]))
                    pipes[i] = PipelinePlan(pipes[i].micro_batch, pipes[i].num_microbatches,
                                            tuple(st))
                yield plan.with_pipelines(pipes)


def refine(ctx: SearchContext, phase: PhaseStats, cands: list[Candidate], budget: int
            ) -> list[Candidate]:
    """Steepest-descent over single-layer moves, judged by the analytic tier: the DP
    balances the bottleneck, this also sees where in the pipeline the load sits (which
    changes fill and drain) and the exact schedule. Candidates best first, until
    `budget` estimates are spent."""
    out = []
    for cand in cands:
        if budget <= 0:
            break
        current = cand
        while budget > 0:
            best = None
            for plan in neighbours(current.plan):
                if budget <= 0:
                    break
                budget -= 1
                phase.seen += 1
                metrics = estimate(plan, ctx.cost)
                if not metrics.feasible:
                    phase.infeasible += 1
                    continue
                if improves(ctx.c, metrics, (best or current).metrics):
                    best = Candidate(plan, metrics)
            if best is None:
                break
            current = best
        out.append(current)
    return out


def polish(ctx: SearchContext, phase: PhaseStats, ranked: list[Candidate], budget: int,
            pool) -> tuple[list[Candidate], int]:
    """Steepest descent over single-layer moves of the best simulated plans, judged by
    the simulator, while `budget` actions are left; with the actions left after it."""
    out = list(ranked)
    for i, cand in enumerate(ranked[:POLISH_TOP]):
        current = cand
        while current.metrics.feasible:
            moves = list(neighbours(current.plan))
            cost = sum(count_actions(p) for p in moves)
            if not moves or cost > budget:
                break
            budget -= cost
            phase.seen += len(moves)
            best = current              # the first move that beats the rest (`improves`)
            for plan, metrics in zip(moves, simulate_all(moves, ctx.cost, pool), strict=True):
                if improves(ctx.c, metrics, best.metrics):
                    best = Candidate(plan, metrics)
            if best is current:
                break
            current = best
        out[i] = current
    return dedupe(sorted(out, key=lambda cand: rank_key(ctx.c, cand.metrics))), budget
