"""What the peer planners share: per-layer time and memory tables of a device group (the
"profile" every planner starts from), 1F1B in-flight counts, the layer-cut DP and plan
assembly. Times in seconds, memory in bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hyperpipe.cluster.cluster import link_sig
from hyperpipe.core.errors import BadInput, InfeasiblePlan
from hyperpipe.plan.kinds import DEFAULT_KIND
from hyperpipe.plan.plan import PipelinePlan, Plan, StagePlan
from hyperpipe.search.caches import PeerTableKey

if TYPE_CHECKING:
    from hyperpipe.cluster.cluster import Link
    from hyperpipe.search.caches import PeerCaches


@dataclass(frozen=True)
class GroupTable:
    """Prefix sums over layers for one device group (tp devices of one type) at one
    micro-batch size: time_s[b] - time_s[a] is F + B of layers [a, b) with Megatron's
    tensor-parallel all-reduces; state/stash likewise, per device."""

    time_s: np.ndarray
    state_bytes: np.ndarray
    stash_bytes: np.ndarray
    memory_bytes: float
    key: PeerTableKey | None = None       # what it was built for (None: made by hand)

    @cached_property
    def state_list(self) -> list[float]:
        """`state_bytes` as a Python list (numpy scalars are slow one at a time)."""
        return self.state_bytes.tolist()

    @cached_property
    def stash_list(self) -> list[float]:
        return self.stash_bytes.tolist()


class PeerPick(NamedTuple):
    """A peer planner's pick and the iteration time its own cost model predicts."""

    plan: Plan
    predicted_s: float


def group_table(cost, group: tuple[str, ...], mb: int, caches: PeerCaches) -> GroupTable:
    """The table of `group` at micro-batch `mb`, shared by the groups of its
    `group_class`."""
    key = (*group_class(cost, group, caches), mb)     # a `PeerTableKey`'s fields
    memo = caches.type_tables
    if key not in memo:
        key = PeerTableKey(*key)
        dev = cost.cluster.device(group[0])
        n = cost.model.num_layers
        tp = len(group)
        t = [sum(cost.stage_time_s((i, i + 1), group, mb, op) for op in ("F", "B"))
             for i in range(n)]
        state = [cost.state_bytes((i, i + 1), tp) for i in range(n)]
        stash = [cost.stash_bytes((i, i + 1), mb, tp) for i in range(n)]
        memo[key] = GroupTable(np.concatenate([[0.0], np.cumsum(t)]),
                               np.concatenate([[0.0], np.cumsum(state)]),
                               np.concatenate([[0.0], np.cumsum(stash)]),
                               dev.type.memory_bytes, key)
    return memo[key]


def group_class(cost, group: tuple[str, ...], caches: PeerCaches) -> tuple:
    """What `group`'s table depends on besides the micro-batch (`PeerTableKey` less it):
    its device type, slowdown, size and intra-node link; found once per group."""
    got = caches.classes.get(group)
    if got is None:
        dev = cost.cluster.device(group[0])
        node = cost.cluster.node(dev.node)
        got = caches.classes[group] = (dev.type.name, cost.cluster.slowdown(group),
                                       len(group), link_sig(node.intra_link)
                                       if len(group) > 1 else None)
    return got


def inflight_1f1b(p: int, m: int) -> list[int]:
    """Micro-batches stage k of a 1F1B pipeline of p stages stashes at most: min(p - k, m)
    (Narayanan et al. 2021, PipeDream-Flush)."""
    return [min(p - k, m) for k in range(p)]


def stage_matrix(tables: list[GroupTable], inflight: list[int], n: int) -> list[np.ndarray]:
    """Per stage k, an (n+1) x (n+1) matrix of the time of layers [a, b) on the slowest
    of its groups (`tables[k]` a list of one table per replica), inf where a >= b or the
    layers do not fit in memory."""
    mats = []
    idx = np.arange(n + 1)
    upper = idx[:, None] < idx[None, :]
    for tabs, inf in zip(tables, inflight, strict=True):
        # replicas alike share one table (a peer's mesh may have thousands of them)
        tabs = list({tab.key if tab.key is not None else i: tab
                     for i, tab in enumerate(tabs)}.values())
        t = np.max([tab.time_s[None, :] - tab.time_s[:, None] for tab in tabs], axis=0)
        ok = upper.copy()
        for tab in tabs:
            need = (tab.state_bytes[None, :] - tab.state_bytes[:, None]) + inf * (
                tab.stash_bytes[None, :] - tab.stash_bytes[:, None])
            ok &= need <= tab.memory_bytes
        mats.append(np.where(ok, t, np.inf))
    return mats


def min_sum_cuts(mats: list[np.ndarray], bound_s: float) -> tuple[float, list[int]] | None:
    """Cut n layers into len(mats) non-empty stages, every stage at most `bound_s`,
    minimising the sum of stage times (dynamic programming over cut positions).
    Returns (sum, bounds [0, c1, ..., n]) or None if no cut obeys the bound."""
    n = mats[0].shape[0] - 1
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    back = []
    for mat in mats:
        cand = best[:, None] + np.where(mat <= bound_s, mat, np.inf)
        arg = np.argmin(cand, axis=0)
        best = cand[arg, np.arange(n + 1)]
        back.append(arg)
    if not np.isfinite(best[n]):
        return None
    cuts = [n]
    for arg in reversed(back):
        cuts.append(int(arg[cuts[-1]]))
    return float(best[n]), cuts[::-1]


def min_max_bound(mats: list[np.ndarray]) -> float:
    """The least achievable slowest stage (min-max DP); inf if nothing fits."""
    n = mats[0].shape[0] - 1
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    for mat in mats:
        best = np.min(np.maximum(best[:, None], mat), axis=0)
    return float(best[n])


def peer_subsets(ctx) -> list[tuple[str, ...]]:
    """The clusters a peer planner is given: every non-empty subset of the device classes
    (`space.device_classes`), largest first. Both peers use every device of the cluster
    they are given (Metis: its device groups sum to the hostfile's GPU count,
    SamsungLabs/Metis `search_space/device_group.py` `gen_dgroups_recursive` and
    `cost_het_cluster.py`; AMP: pp x tp x dp = all M x N GPUs, Li et al. 2022 sec. 3.1,
    DachengLi1/AMP `het_cluster.py`); which GPUs that cluster holds is their user's
    choice (the hostfile), so each is run on every subset and its own cost model picks,
    as a user trusting it would. The tuned baselines have the same freedom."""
    import itertools
    names = list(ctx.classes)
    return [s for r in range(len(names), 0, -1) for s in itertools.combinations(names, r)]


def subset_devices(ctx, subset: tuple[str, ...]) -> list[str]:
    """The devices of the classes in `subset`, in cluster order."""
    nodes = {nd for name in subset for nd in ctx.classes[name].nodes}
    return [d.name for d in ctx.cluster.devices if d.node in nodes]


def keep_better(best: PeerPick | None, best_key: tuple | None, key: tuple, value: float,
                make: Callable[[], Plan]) -> tuple[PeerPick | None, tuple | None]:
    """A peer's walk keeping its best pick: the plan `make` builds, with its predicted
    `value`, replaces `best` when `key` (value first, the walk's order breaking ties) is
    below `best_key` and the plan checks; otherwise `best` stays."""
    if best_key is not None and key >= best_key:
        return best, best_key
    try:
        return PeerPick(make(), value), key
    except (InfeasiblePlan, BadInput):
        return best, best_key


def build(ctx, rows: list[list[tuple[str, ...]]], bounds: list[int], mb: int, m: int,
          schedule: str = DEFAULT_KIND) -> Plan:
    """A plan of len(rows) identical-cut pipelines, row r's stage k on rows[r][k]."""
    ranges = list(zip(bounds, bounds[1:], strict=False))
    pipes = tuple(PipelinePlan(mb, m, tuple(StagePlan(rng, g, len(g))
                                            for rng, g in zip(ranges, row, strict=True)))
                  for row in rows)
    plan = Plan(model=ctx.refs[0], cluster=ctx.refs[1], global_batch=ctx.c.global_batch,
                schedule=schedule, chunks=1, pipelines=pipes, stack=ctx.c.stack,
                runtime=ctx.c.runtime)
    plan.check(ctx.model, ctx.cluster)
    return plan


def sync_s(cost, rows: list[list[tuple[str, ...]]], bounds: list[int]) -> float:
    """The slowest stage's gradient all-reduce over its replicas (ring, dtype bytes per
    parameter, per tp shard) plus its optimizer step."""
    worst = 0.0
    for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        group = rows[0][k]
        tp = len(group)
        nbytes = cost.stage_params((a, b)) * cost.model.dtype_bytes / tp
        ring = [row[k][0] for row in rows]
        t = (cost.allreduce_time_s(ring, nbytes) if len(ring) > 1 else 0.0) + \
            cost.optimizer_time_s((a, b), cost.cluster.device(group[0]).type.name, tp)
        worst = max(worst, t)
    return worst


def cut_links(cost, rows: list[list[tuple[str, ...]]]) -> list[tuple[Link, ...]]:
    """Per cut k (stage k to k+1): the distinct links its replicas' sends take (none
    where every replica's stages share a device). They depend on the rows only, not on
    the micro-batch or the cut: a caller walking several keeps them."""
    out = []
    for k in range(len(rows[0]) - 1):
        links: dict[Link, None] = {}
        for row in rows:
            route, link = cost.route(row[k][-1], row[k + 1][0])
            if route.hops:
                links[link] = None
        out.append(tuple(links))
    return out


def p2p_s(cost, links: list[tuple[Link, ...]], bounds: list[int], mb: int) -> list[float]:
    """Per cut k (stage k to k+1): activation send time, slowest replica (`links`: the
    rows' `cut_links`)."""
    out = []
    for k in range(len(bounds) - 2):
        nbytes = cost.send_bytes((bounds[k], bounds[k + 1]), mb)
        out.append(max((link.time_s(nbytes) for link in links[k]), default=0.0))
    return out
