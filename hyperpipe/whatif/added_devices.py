"""What-ifs that add devices: a bigger cluster can always leave the added devices unused.

A variant whose devices include every device of another variant (same name, type and
speed), and more, can run that variant's best plan unchanged, the added devices idle.
The search ranks by models that are not the simulator and may pick, on the bigger
cluster, a plan that uses the added devices and simulates slower. Here each such variant
is also given the smaller variants' best plans (and the best plan of the cluster as
given, when that is smaller), each simulated on the bigger variant's own cluster; the
best of them by the search's objective is the variant's answer, and the row says whose
plan it is. So adding devices never reports a slower best plan than leaving them unused.
Variants with the same devices (they vary links, say) likewise run each other's best
plans: a faster link never reports a slower best plan than the slower link's.

>>> contains(big_cluster, small_cluster)    # doctest: +SKIP
True
"""

from __future__ import annotations

from dataclasses import replace

from hyperpipe.cluster.cluster import Cluster, cluster_ref
from hyperpipe.core.errors import BadInput, InfeasiblePlan
from hyperpipe.plan.plan import Plan
from hyperpipe.search.evaluate import Candidate, rank_key
from hyperpipe.search.report import describe_plan
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate
from hyperpipe.whatif.variants import Row, VariantTask


def simulate_on(plan: Plan, cost: CostModel) -> Candidate:
    """`plan` simulated on `cost`'s cluster (and naming that cluster)."""
    plan = replace(plan, cluster=cluster_ref(cost.cluster))
    return Candidate(plan, simulate(plan, cost, SimOptions(trace=False)).metrics)


def contains(big: Cluster | None, small: Cluster | None) -> bool:
    """True when `big` has every device of `small` (same name, type and slowdown) and
    more: `small`'s plans run on `big` with the extra devices unused."""
    if big is None or small is None or len(big.devices) <= len(small.devices):
        return False
    return runs_on(big, small)


def runs_on(big: Cluster | None, small: Cluster | None) -> bool:
    """True when `big` has every device of `small` (same name, type and slowdown):
    `small`'s plans run on `big` unchanged (its other devices, if any, unused)."""
    if big is None or small is None:
        return False
    return all(big.has_device(d.name) and big.device(d.name) == d for d in small.devices)


def comparable(a: VariantTask, b: VariantTask) -> bool:
    """Same model and constraints (batch, micro-batch, schedule, objective, profile):
    their plans answer the same question."""
    return a.model == b.model and a.constraints == b.constraints and \
        a.profile == b.profile


def needs_base(tasks: list[VariantTask], base: VariantTask) -> bool:
    """True when some variant adds devices to the cluster as given and no variant has
    exactly its devices (that variant's own best plan would stand in for it)."""
    same = [t for t in tasks if comparable(t, base)]
    return any(contains(t.cluster, base.cluster) for t in same) and not any(
        t.cluster is not None and t.cluster.devices == base.cluster.devices for t in same)


def keep_unused(rows: list[Row], tasks: list[VariantTask],
                extra: list[tuple[str, VariantTask, Row]] = ()) -> list[Row]:
    """`rows` (one per task, in order) where each variant that holds every device of
    another (a variant, or one of `extra`: (label, task, row)) keeps that one's best
    plan when it simulates better on the variant than the variant's own pick."""
    smaller = [(r.label, t, r) for t, r in zip(tasks, rows, strict=True)] + list(extra)
    out = []
    for task, row in zip(tasks, rows, strict=True):
        best, source, whose = row.best, None, None
        cost = None
        for label, other, other_row in smaller:
            if other is task or other_row.best is None or not comparable(task, other) or \
                    not runs_on(task.cluster, other.cluster):
                continue
            if cost is None:
                cost = CostModel(task.model, task.cluster, task.profile)
            try:
                cand = simulate_on(other_row.best.plan, cost)
            except (BadInput, InfeasiblePlan):
                continue
            if cand.metrics.feasible and (best is None or rank_key(
                    task.constraints, cand.metrics) < rank_key(task.constraints,
                                                               best.metrics)):
                best, source, whose = cand, label, other
        if source is None:
            out.append(row)
            continue
        why = "added devices unused" if contains(task.cluster, whose.cluster) else \
            "it simulates faster here than this variant's own pick"
        out.append(replace(row, best=best, kept_is_answer=False, error=None,
                           unused_from=source,
                           description=describe_plan(best.plan, task.cluster)
                           + f" (the plan of {source}: {why})"))
    return out
