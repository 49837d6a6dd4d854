"""Metis (Um, Oh, Kang, Lee, Kim, Kim, Kim, Muzzammil, Jeon: "Metis: Fast Automatic
Distributed Training on Heterogeneous GPUs", USENIX ATC 2024), re-implemented from the
paper.

Search space (sec. 4), on every device of the cluster it is given (each subset of
the device classes: `common.peer_subsets`): an order of the device types along the
pipeline, per type a tp degree (a stage is dp replicas of a tp group), the
data-parallel degree, the micro-batch size and uneven layer partitions, 1F1B. (Metis
also lets dp differ per stage; our plans keep one dp, so that part of its space is
left out.) Load balancing (sec. 4.3): layers in proportion to each group's compute
power, then single layers moved off stages whose memory overflows. Cost (sec. 5),
seconds: (m - 1) x slowest stage + the sum of all stages (compute and activation send)
+ the slowest stage's gradient all-reduce and optimizer step.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hyperpipe.search import space
from hyperpipe.search.caches import PeerCaches
from hyperpipe.search.peers.common import (
    GroupTable,
    PeerPick,
    build,
    cut_links,
    group_class,
    group_table,
    inflight_1f1b,
    keep_better,
    p2p_s,
    peer_subsets,
    sync_s,
)


def metis_cost_s(stage_s: list[float], m: int, sync: float) -> float:
    """Metis's estimator: (m - 1) x slowest stage + sum of stages + sync."""
    return (m - 1) * max(stage_s) + sum(stage_s) + sync


def proportional_cuts(n: int, speed: list[float]) -> list[int]:
    """Layer counts in proportion to `speed` (largest remainder, each stage >= 1), as
    cut positions [0, ..., n]."""
    p = len(speed)
    total = sum(speed)
    share = [(n - p) * s / total for s in speed]
    counts = [1 + int(x) for x in share]
    order = sorted(range(p), key=lambda i: -(share[i] - int(share[i])))
    for i in order[:n - sum(counts)]:
        counts[i] += 1
    return [0, *itertools.accumulate(counts)]


def balance_memory(bounds: list[int], tables, inflight: list[int]) -> list[int] | None:
    """Move single layers off overflowing stages to the neighbour with more free memory,
    until all fit (None if they cannot; `bounds` as they are when all fit). The first
    overflowing stage moves first."""
    b = list(bounds)
    p = len(b) - 1
    state = [t.state_list for t in tables]
    stash = [t.stash_list for t in tables]
    memory = [t.memory_bytes for t in tables]

    def free(k: int) -> float:
        lo, hi = b[k], b[k + 1]
        return memory[k] - (state[k][hi] - state[k][lo]) - \
            inflight[k] * (stash[k][hi] - stash[k][lo])

    room = [free(k) for k in range(p)]          # kept up to date move by move
    over = [k for k in range(p) if room[k] < 0]  # a heap; stages that fit again are
    queued = [r < 0 for r in room]               # dropped when they reach its top
    seen = set()                                 # the walk is deterministic: a cut
    for _ in range(b[-1] * p):                   # seen before means it cycles, never fits
        cut = tuple(b)
        if cut in seen:
            return None
        seen.add(cut)
        while over and room[over[0]] >= 0:
            queued[heapq.heappop(over)] = False
        if not over:
            return b
        k = over[0]
        if b[k + 1] - b[k] <= 1:
            return None
        left = room[k - 1] if k > 0 else -np.inf
        right = room[k + 1] if k < p - 1 else -np.inf
        if max(left, right) <= 0:
            return None
        j = k - 1 if left >= right else k + 1
        if j < k:
            b[k] += 1              # first layer of k to stage k - 1
        else:
            b[k + 1] -= 1          # last layer of k to stage k + 1
        room[k], room[j] = free(k), free(j)
        if room[j] < 0 and not queued[j]:
            queued[j] = True
            heapq.heappush(over, j)
    return None


class GridPoint(NamedTuple):
    """One (subset, tp per type, dp, micro-batch) point of Metis's grid, with its floor."""

    floor_s: float
    serial: tuple[int, int, int, int]     # (subset, tp choice, dp, micro-batch choice)
    types: tuple[str, ...]                # the device classes it is given
    pools: dict
    dp: int
    per: dict[str, int]                   # stages of each type
    mb: int
    m: int                                # micro-batches per pipeline


def metis_plan(ctx, prune: bool = True) -> PeerPick | None:
    """Metis's pick and its own predicted iteration time, or None if nothing fits.

    Metis is given every subset of the device classes as its hostfile
    (`common.peer_subsets`) and uses all of that subset's devices. The grid is walked by
    branch and bound (`prune`; the exhaustive walk picks the same plan, ties to the
    earlier point of the grid): a (subset, tp per type, dp, micro-batch) point is
    skipped when `_metis_floor_s` shows none of its stage orders can beat the best."""
    points: list[GridPoint] = []
    for si, subset in enumerate(peer_subsets(ctx)):
        points += _grid(ctx, si, subset, prune)
    points.sort(key=lambda x: (x.floor_s, x.serial))
    best_key: tuple | None = None            # (time, serial) of the best so far
    best: PeerPick | None = None
    placed: dict[tuple, _Placed] = {}       # (si, i, dp, order) -> its rows
    for pt in points:
        if best_key is not None and pt.floor_s > best_key[0]:
            break                            # the floors only grow from here
        si, i, dp, j = pt.serial
        for o, order in enumerate(itertools.permutations(pt.types)):
            # the points of one (subset, tp per type, dp) differ in micro-batch only
            if (si, i, dp, o) not in placed:
                placed[si, i, dp, o] = _placed(ctx, pt, order)
            rows = placed[si, i, dp, o].rows
            found = _balanced(ctx, placed[si, i, dp, o], pt.mb, pt.m)
            if found is None:
                continue
            value, bounds = found
            # the exhaustive walk's order breaks ties
            best, best_key = keep_better(
                best, best_key, (value, (si, i, dp, o, j)), value,
                lambda: build(ctx, rows, bounds, pt.mb, pt.m))  # noqa: B023 (called at once)
    return best


@dataclass
class _Placed:
    """The replicas' rows of tp groups for one stage order of a grid point, with their
    `cut_links` and the first row's table classes once asked."""

    rows: list[list[tuple[str, ...]]]
    cost: Any
    caches: PeerCaches

    @functools.cached_property
    def links(self) -> list:
        return cut_links(self.cost, self.rows)

    @functools.cached_property
    def classes(self) -> tuple[list[tuple[str, ...]], list[int]]:
        """The first row's stages by `group_class`: one group of each class, and each
        stage's class (an index into them). Stages of one class share their tables."""
        reps: list[tuple[str, ...]] = []
        seen: dict[tuple, int] = {}
        of = []
        for group in self.rows[0]:
            key = group_class(self.cost, group, self.caches)
            if key not in seen:
                seen[key] = len(reps)
                reps.append(group)
            of.append(seen[key])
        return reps, of


def _placed(ctx, pt: GridPoint, order: tuple[str, ...]) -> _Placed:
    """Replica r's groups of type t: its units r, r + dp, ... (pt.per[t] of them)."""
    strided = {t: [pt.pools[t].units[r::pt.dp] for r in range(pt.dp)] for t in pt.types}
    return _Placed([list(itertools.chain.from_iterable(strided[t][r] for t in order))
                    for r in range(pt.dp)], ctx.cost, ctx.peers)


def _grid(ctx, si: int, types: tuple[str, ...], prune: bool) -> list[GridPoint]:
    """Metis's grid on the classes `types` (every device of them used), with floors."""
    c, model, cluster = ctx.c, ctx.model, ctx.cluster
    n = model.num_layers
    tps = list(space.tp_options(cluster, model, c))
    points: list[GridPoint] = []
    for i, tp_of in enumerate(itertools.product(tps, repeat=len(types))):
        pools = {t: ctx.pools(tp).get(t) for t, tp in zip(types, tp_of, strict=True)}
        if any(p is None or any(cluster.node(nd).count % tp for nd in ctx.classes[t].nodes)
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
            for j, mb in enumerate(space.micro_batches(c)):
                if c.global_batch % (dp * mb):
                    continue
                m = c.global_batch // (dp * mb)
                floor = _metis_floor_s(ctx, pools, dp, per, mb, m) if prune else 0.0
                if floor == np.inf:
                    continue                 # no stage order fits in memory
                points.append(GridPoint(floor, (si, i, dp, j), types, pools, dp, per, mb, m))
    return points


def _metis_floor_s(ctx, pools, dp: int, per: dict, mb: int, m: int) -> float:
    """A floor under Metis's estimate for every stage order of one grid point: with S
    the sum over layers of the layer's least time on any of the stages' groups, the
    stages sum to at least S and the slowest is at least S / pp and at least what whole
    layers force (`_least_slowest_s`), so (m - 1) x slowest + sum >= (m - 1) max(S / pp,
    that) + S (sends and sync only add).

    Infinite when no order can fit in memory: the stage at position k stashes
    min(pp - k, m) micro-batches (1F1B), so it holds at most `_capacities` layers of its
    group's type; if even the roomiest type at every position holds fewer than the
    model's layers in all, every order overflows."""
    groups = [pools[t].units[q * dp] for t in per for q in range(per[t])]
    pp = len(groups)
    mine = [group_table(ctx.cost, g, mb, ctx.peers) for g in groups]
    tables = list({tab.key: tab for tab in mine}.values())
    held = np.minimum(pp - np.arange(pp), m)
    room = int(np.max([_capacities(ctx.peers, tab, pp)[held] for tab in tables],
                      axis=0).sum())
    if room < ctx.model.num_layers:
        return np.inf
    least = np.min([np.diff(tab.time_s) for tab in tables], axis=0).sum()
    return float((m - 1) * max(least / pp, _least_slowest_s(mine)) + least)


def _least_slowest_s(tables: list[GroupTable]) -> float:
    """A floor under the slowest stage of any cut of whole layers onto stages with these
    tables: the least B at which the stages, each holding at most its fastest layers
    that fit in B, hold every layer."""
    count: dict = {}
    for tab in tables:
        count[tab.key] = count.get(tab.key, 0) + 1
    alike = {tab.key: tab for tab in tables}
    prefix = [(np.cumsum(np.sort(np.diff(alike[k].time_s))), c) for k, c in count.items()]
    n = len(prefix[0][0])
    steps = np.unique(np.concatenate([pre for pre, _ in prefix]))

    def held(budget: float) -> int:
        return sum(c * int(np.searchsorted(pre, budget * (1 + 1e-12), side="right"))
                   for pre, c in prefix)

    lo, hi = 0, len(steps) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if held(steps[mid]) >= n:
            hi = mid
        else:
            lo = mid + 1
    return float(steps[lo])


def _capacities(caches: PeerCaches, table: GroupTable, most: int) -> np.ndarray:
    """Per in-flight count i (0 to at least `most`), the most layers a stage with
    `table`'s memory holds while stashing i micro-batches: its cheapest layers (state +
    i x stash each) first, as many as fit."""
    got = caches.capacity.get(table.key)
    if got is None or len(got) <= most:
        held = np.arange(max(most + 1, 2 * len(got) if got is not None else 0))
        need = np.diff(table.state_bytes)[None, :] + \
            held[:, None] * np.diff(table.stash_bytes)[None, :]
        got = (np.cumsum(np.sort(need, axis=1), axis=1) <= table.memory_bytes).sum(axis=1)
        caches.capacity[table.key] = got
    return got


def _balanced(ctx, placed: _Placed, mb: int, m: int) -> tuple[float, list[int]] | None:
    cost, n = ctx.cost, ctx.model.num_layers
    rows = placed.rows
    pp = len(rows[0])
    reps, of = placed.classes
    mine = [group_table(cost, g, mb, ctx.peers) for g in reps]
    whole = [n / float(tab.time_s[-1]) for tab in mine]     # layers/s, whole model
    tables = [mine[i] for i in of]
    speed = [whole[i] for i in of]
    inflight = inflight_1f1b(pp, m)
    bounds = balance_memory(proportional_cuts(n, speed), tables, inflight)
    if bounds is None:
        return None
    e = p2p_s(cost, placed.links, bounds, mb) + [0.0]
    stage = [float(tab.time_s[b] - tab.time_s[a]) + ek
             for tab, a, b, ek in zip(tables, bounds, bounds[1:], e, strict=False)]
    return metis_cost_s(stage, m, sync_s(cost, rows, bounds)), bounds
