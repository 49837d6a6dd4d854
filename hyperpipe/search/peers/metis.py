"""Metis (Um, Oh, Kang, Lee, Kim, Kim, Kim, Muzzammil, Jeon: "Metis: Fast Automatic
Distributed Training on Heterogeneous GPUs", USENIX ATC 2024), re-implemented from the
paper.

Search space (Metis sec. 4): every device of the cluster, grouped by type into device
groups; a plan is an order of the device types along the pipeline, per type a tp
degree (each stage of that type a group of dp x tp devices: dp replicas of a tp group;
Metis prefers data to tensor parallelism inside a stage), the data-parallel degree and
the micro-batch size, and uneven layer partitions. (Metis also lets dp differ per stage,
re-sharding activations between stages; our plans keep one dp for all stages, so that
part of its space is left out.) Schedule: 1F1B.

Load balancing (Metis sec. 4.3): layers to stages in proportion to each device group's
compute power (per-layer profiled time at that tp), then layers moved off stages whose
memory overflows to a neighbour with room.

Cost estimator (Metis sec. 5): a pipeline's time is (m - 1) x slowest stage + the sum of
all stages (compute with tp all-reduces, plus the activation send), plus the slowest
stage's data-parallel gradient all-reduce and optimizer step.
"""

from __future__ import annotations

import itertools

import numpy as np

from hyperpipe.errors import BadInput, InfeasiblePlan
from hyperpipe.plan.plan import Plan
from hyperpipe.search import space
from hyperpipe.search.peers.common import (
    build,
    fits,
    group_table,
    inflight_1f1b,
    p2p_s,
    sync_s,
)


def metis_cost_s(stage_s: list[float], m: int, sync: float) -> float:
    """Metis's estimator: (m - 1) x slowest stage + sum of stages + sync."""
    return (m - 1) * max(stage_s) + sum(stage_s) + sync


def proportional_cuts(n: int, speed: list[float]) -> list[int]:
    """Layer counts in proportion to `speed` (largest remainder, each stage >= 1), as
    cut positions [0, ..., n]."""
    p = len(speed)
    share = [(n - p) * s / sum(speed) for s in speed]
    counts = [1 + int(x) for x in share]
    order = sorted(range(p), key=lambda i: -(share[i] - int(share[i])))
    for i in order[:n - sum(counts)]:
        counts[i] += 1
    return [0, *itertools.accumulate(counts)]


def balance_memory(bounds: list[int], tables, inflight: list[int]) -> list[int] | None:
    """Move single layers off overflowing stages to the neighbour with more free memory,
    until all fit (None if they cannot)."""
    b = list(bounds)
    p = len(b) - 1

    def free(k: int) -> float:
        t = tables[k]
        return t.memory_bytes - (t.state_bytes[b[k + 1]] - t.state_bytes[b[k]]) - \
            inflight[k] * (t.stash_bytes[b[k + 1]] - t.stash_bytes[b[k]])

    for _ in range(b[-1] * p):
        over = [k for k in range(p) if free(k) < 0]
        if not over:
            return b
        k = over[0]
        if b[k + 1] - b[k] <= 1:
            return None
        left = free(k - 1) if k > 0 else -np.inf
        right = free(k + 1) if k < p - 1 else -np.inf
        if max(left, right) <= 0:
            return None
        if left >= right:
            b[k] += 1              # first layer of k to stage k - 1
        else:
            b[k + 1] -= 1          # last layer of k to stage k + 1
    return None


def metis_plan(ctx) -> tuple[Plan, float] | None:
    """Metis's pick and its own predicted iteration time, or None if nothing fits."""
    c, model, cluster = ctx.c, ctx.model, ctx.cluster
    n = model.num_layers
    types = list(dict.fromkeys(nd.device_type for nd in cluster.nodes))
    tps = list(space.tp_options(cluster, model, c))
    best: tuple[float, Plan] | None = None
    for tp_of in itertools.product(tps, repeat=len(types)):
        pools = {t: space.unit_pools(cluster, tp).get(t) for t, tp in zip(types, tp_of,
                                                                        strict=True)}
        if any(p is None or any(nd.count % tp for nd in cluster.nodes
                                if nd.device_type == t)
               for (t, p), tp in zip(pools.items(), tp_of, strict=True)):
            continue                         # every device used, tp inside a node
        units = {t: len(p.units) for t, p in pools.items()}
        for dp in range(1, min(units.values()) + 1):
            if any(u % dp for u in units.values()) or (c.dp is not None and dp != c.dp):
                continue
            per = {t: u // dp for t, u in units.items()}       # stages of each type
            pp = sum(per.values())
            if pp > n or (c.pp is not None and pp != c.pp):
                continue
            for order in itertools.permutations(types):
                rows = [[pools[t].units[j * dp + r] for t in order for j in range(per[t])]
                        for r in range(dp)]
                for mb in space.micro_batches(c):
                    if c.global_batch % (dp * mb):
                        continue
                    m = c.global_batch // (dp * mb)
                    found = _balanced(ctx, rows, mb, m)
                    if found is None or (best is not None and found[0] >= best[0]):
                        continue
                    try:
                        best = (found[0], build(ctx, rows, found[1], mb, m))
                    except (InfeasiblePlan, BadInput):
                        continue
    return None if best is None else (best[1], best[0])


def _balanced(ctx, rows, mb: int, m: int) -> tuple[float, list[int]] | None:
    cost, n = ctx.cost, ctx.model.num_layers
    pp = len(rows[0])
    tables = [group_table(cost, rows[0][k], mb, ctx.memo) for k in range(pp)]
    speed = [n / tab.time_s[-1] for tab in tables]      # layers per second, whole model
    inflight = inflight_1f1b(pp, m)
    bounds = proportional_cuts(n, speed)
    if not all(fits(t, a, b, f) for t, a, b, f in zip(tables, bounds, bounds[1:], inflight,
                                                      strict=False)):
        bounds = balance_memory(bounds, tables, inflight)
        if bounds is None:
            return None
    e = p2p_s(cost, rows, bounds, mb) + [0.0]
    stage = [float(tab.time_s[b] - tab.time_s[a]) + ek
             for tab, a, b, ek in zip(tables, bounds, bounds[1:], e, strict=False)]
    return metis_cost_s(stage, m, sync_s(cost, rows, bounds)), bounds
