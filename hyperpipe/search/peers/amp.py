"""AMP (Li, Wang, Xing, Zhang: "AMP: Automatically Finding Model Parallel Strategies with
Heterogeneity Awareness", NeurIPS 2022), re-implemented from the paper.

Search space (sec. 3.1): every device in one rank-ordered mesh; (pp, tp, dp,
micro-batch) with pp x tp x dp = all devices, Megatron's rank order, a layer partition,
Megatron's 1F1B. Cost (sec. 3.2, eq. 1), seconds:

    (gas - 1) x max_i (t_i + e_i)  +  sum_i (t_i + e_i)  +  max_i dp_i

t_i stage i's compute on its slowest replica, e_i its activation send, gas the
micro-batches per pipeline, dp_i its gradient all-reduce (here with the optimizer step).
Partition (sec. 3.3): for a few bounds on the slowest stage (from the min-max cut up),
the cut of least sum obeying it (DP over cut positions); the one of least cost wins.

AMP uses every GPU of the cluster it is given; it is given every subset of the device
classes (`common.peer_subsets`: the cluster is its user's choice) and its own cost
picks. A (subset, pp, tp, micro-batch) point is skipped when a floor under eq. 1 (with
W the whole model's time on its fastest group, the stages sum to at least W and the
slowest is at least W / pp: (gas - 1) W / pp + W) is no better than the best found:
the exhaustive walk picks the same plan (`amp_plan(ctx, prune=False)`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from hyperpipe.search import space
from hyperpipe.search.peers.common import (
    PeerPick,
    build,
    cut_links,
    group_table,
    inflight_1f1b,
    keep_better,
    min_max_bound,
    min_sum_cuts,
    p2p_s,
    peer_subsets,
    stage_matrix,
    subset_devices,
    sync_s,
)

BOUND_STEPS = (1.0, 1.02, 1.05, 1.1, 1.2)   # slowest-stage bounds, x the min-max cut


def amp_cost_s(t: list[float], e: list[float], gas: int, sync: float) -> float:
    """AMP eq. 1: (gas - 1) max(t_i + e_i) + sum(t_i + e_i) + sync."""
    per = [ti + ei for ti, ei in zip(t, [*e, 0.0], strict=True)]
    return (gas - 1) * max(per) + sum(per) + sync


def _rows(ctx, names: list[str], pp: int, dp: int, tp: int
          ) -> list[list[tuple[str, ...]]] | None:
    """Megatron rank order over `names`: rank = (stage dp + replica) tp + i."""
    rows = [[tuple(names[(s * dp + r) * tp:(s * dp + r + 1) * tp]) for s in range(pp)]
            for r in range(dp)]
    for row in rows:
        for g in row:
            if len({ctx.cluster.device(d).node for d in g}) > 1:
                return None            # tp stays inside a node
    return rows


class AmpPoint(NamedTuple):
    """One (subset, tp, pp, micro-batch) of AMP's grid, with the floor under its cost."""

    floor_s: float
    serial: tuple[int, int, int, int]     # the exhaustive walk's order (ties)
    names: list[str]
    tp: int
    pp: int
    dp: int
    mb: int
    gas: int


def amp_plan(ctx, prune: bool = True) -> PeerPick | None:
    """AMP's pick and its own predicted iteration time, or None if nothing fits."""
    c, model = ctx.c, ctx.model
    n = model.num_layers
    points: list[AmpPoint] = []
    for si, subset in enumerate(peer_subsets(ctx)):
        names = subset_devices(ctx, subset)
        n_dev = len(names)
        for tp in space.tp_options(ctx.cluster, model, c):
            for pp in range(1, min(n, n_dev // tp) + 1):
                if n_dev % (tp * pp) or (c.pp is not None and pp != c.pp):
                    continue
                dp = n_dev // (tp * pp)
                if c.dp is not None and dp != c.dp:
                    continue
                whole = None
                for j, mb in enumerate(space.micro_batches(c)):
                    if c.global_batch % (dp * mb):
                        continue
                    gas = c.global_batch // (dp * mb)
                    floor = 0.0
                    if prune:
                        whole = _fastest_whole_s(ctx, subset, tp, mb)
                        floor = (gas - 1) * whole / pp + whole
                    points.append(AmpPoint(floor, (si, tp, pp, j), names, tp, pp, dp, mb,
                                           gas))
    points.sort(key=lambda pt: (pt.floor_s, pt.serial))
    best: PeerPick | None = None
    best_key: tuple | None = None
    for pt in points:
        if best_key is not None and pt.floor_s >= best_key[0]:
            break                        # floors only grow; a tie cannot win (serial)
        rows = _rows(ctx, pt.names, pt.pp, pt.dp, pt.tp)
        if rows is None:
            continue
        found = _partition(ctx, rows, pt.mb, pt.gas)
        if found is None:
            continue
        value, bounds = found
        best, best_key = keep_better(
            best, best_key, (value, pt.serial), value,
            lambda: build(ctx, rows, bounds, pt.mb, pt.gas))  # noqa: B023 (called at once)
    return best


def _fastest_whole_s(ctx, subset: tuple[str, ...], tp: int, mb: int) -> float:
    """At most the F + B of the whole model on any tp group of `subset`'s classes: per
    class, a unit's time scaled from its slowdown down to the class's least (compute
    scales with it, the tensor-parallel collectives do not grow)."""
    pools, cluster = ctx.pools(tp), ctx.cluster
    out = math.inf
    for t in subset:
        if t not in pools:
            continue
        unit = ctx.fastest_unit(pools[t])
        tab = group_table(ctx.cost, unit, mb, ctx.peers)
        scale = ctx.classes[t].least_slowdown / cluster.slowdown(unit)
        out = min(out, float(tab.time_s[-1]) * scale)
    return 0.0 if math.isinf(out) else out


def _partition(ctx, rows, mb: int, gas: int) -> tuple[float, list[int]] | None:
    cost, n = ctx.cost, ctx.model.num_layers
    pp = len(rows[0])
    tables = [[group_table(cost, row[k], mb, ctx.peers) for row in rows] for k in range(pp)]
    mats = stage_matrix(tables, inflight_1f1b(pp, gas), n)
    lo = min_max_bound(mats)
    if not math.isfinite(lo):
        return None
    best = None
    links = cut_links(cost, rows)
    for step in BOUND_STEPS:
        found = min_sum_cuts(mats, lo * step * (1 + 1e-12))
        if found is None:
            continue
        _, bounds = found
        t = [float(mats[k][a, b]) for k, (a, b) in enumerate(zip(bounds, bounds[1:],
                                                                   strict=False))]
        value = amp_cost_s(t, p2p_s(cost, links, bounds, mb), gas,
                           sync_s(cost, rows, bounds))
        if best is None or value < best[0]:
            best = (value, bounds)
    return best
