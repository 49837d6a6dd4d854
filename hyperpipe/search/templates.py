"""Phase 1 of the search: pipeline templates, one class of identical pipelines each.

A template fixes a config (schedule kind, chunks, micro-batch), a tp degree, a group of
device types, the replica count, units per type, stage order and replica layout (the
generators of `space`), a memory mode, and a layer cut (the bottleneck DP of
`partition`). Per type group, every `TemplateKey` gets a lower bound on its objective
(load spread fractionally, no links); keys are visited best bound first and pruned once
the bound leaves the band of the best found (branch and bound). A key is cut in its
canonical order (most memory first), and in every other order only if that lands in
the band; a shape out of memory at one micro-batch is not tried at larger ones. A key
starts at the first memory mode whose bound passes and takes the first from there whose
cut fits; the chunks of one device share its memory (`partition.shared_slots`).

A template's closed form (`Template.time_s`, seconds) ranks templates and splits the
batch; the analytic tier and the simulator judge whole plans.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import NamedTuple

from hyperpipe.plan.kinds import schedule_kind
from hyperpipe.plan.plan import StagePlan
from hyperpipe.plan.schedule import rank_stages, stage_rank
from hyperpipe.search import partition as P
from hyperpipe.search import space
from hyperpipe.search.bounds import (
    key_bound,
    optimizer_floor_s,
    order_may_fit,
    work_bound,
)
from hyperpipe.search.caches import (
    BookKey,
    CutKey,
    LinkKey,
    Placement,
    PositionKey,
    RingCost,
    RowCut,
    RowKey,
    StageKey,
    StateStash,
    TableKey,
    TotalKey,
)
from hyperpipe.search.context import (  # noqa: F401  (re-exported for the other phases)
    PhaseCounts,
    PhaseStats,
    SearchContext,
    objective_time_s,
    objective_value,
    worker_context,
)
from hyperpipe.search.space import MemoryMode
from hyperpipe.sim.network import ring_spec
from hyperpipe.sim.sharding import (
    FsdpCost,
    fill_delay_s,
    stage_fsdp_cost,
    stage_waits,
)

KEEP_PER_GROUP = 3        # templates kept per (schedule, micro-batch, type group) ...
KEEP_MAX = 32             # ... or up to this many when within TOLERANCE of the best
TOLERANCE = 0.10          # why: the closed form ties plans the simulator tells apart


@dataclass(frozen=True)
class Template:
    """`dp` identical pipelines over one group of device types, with one layer cut."""

    kind: str
    chunks: int
    micro_batch: int
    tp: int
    types: tuple[str, ...]
    slots: tuple[tuple[tuple[str, ...], ...], ...]   # [replica][device slot] -> tp group
    part: P.Partition
    device_load_s: float          # busiest device's per-micro-batch time (all its chunks)
    fill_s: float                 # time a micro-batch takes through the empty pipeline
    sync_s: float                 # gradient all-reduce + optimizer step of the busiest stage
    price_per_hour: float         # all devices of all replicas, USD
    mode: MemoryMode = MemoryMode()   # recompute, sequence parallelism, ZeRO stage, cp

    @property
    def dp(self) -> int:
        return len(self.slots)

    @property
    def config(self) -> tuple[str, int, int]:
        """What all pipelines of one plan share: (schedule kind, chunks, micro-batch)."""
        return (self.kind, self.chunks, self.micro_batch)

    def time_s(self, m: float) -> float:
        """One pipeline's iteration time for m micro-batches: (m - 1) x load + fill, but
        at least one micro-batch's whole trip (F and B through every stage, a split
        backward's W's beside the I's: `Partition.trip_s`) and the busiest device's
        m x load; then the gradient sync."""
        return max((m - 1) * self.device_load_s + self.fill_s, self.part.trip_s,
                   m * self.device_load_s) + self.sync_s

    def stages(self, replica: int) -> tuple[StagePlan, ...]:
        row = self.slots[replica]
        p = len(row)
        place = schedule_kind(self.kind).placement
        return tuple(StagePlan((a, b), row[stage_rank(k, p, place)], self.tp,
                               self.mode.recompute, self.mode.sequence_parallel,
                               self.mode.cp, self.mode.ep)
                     for k, (a, b) in enumerate(self.part.layer_ranges))


def _template(ctx: SearchContext, kind: str, v: int, mb: int, tp: int, types: tuple[str, ...],
              row: list[tuple[str, ...]], dp: int, all_slots, m: int, price: float,
              start: int = 0, placement: tuple | None = None,
              cutoff: float = math.inf, cp: int = 1, ep: int = 1
              ) -> Template | Skipped | None:
    """Cut the layers for `dp` pipelines like `row` (one row stands for all,
    `_priced_row`; their slots, from `all_slots()`, are built only once the cut fits) in
    the first memory mode that fits (`SearchContext.modes`, from `start`); None if none
    fits.
    The cut depends on replica 0's row only through `SearchContext.row_signature`, so
    rows alike (other replica counts, layouts, units of the same classes) share one
    (`RowKey`); `placement` names `slots` for the gradient sync's cache (`_sync_s`).
    A template whose objective, with its optimizer steps but before its all-reduces
    are costed, is already above `cutoff` (the band of its race) is `Skipped`: it could
    not be kept, and its rings are the costly part at thousands of replicas."""
    p = len(row)
    modes = ctx.modes(tp, dp, cp, p > 1, ep)[start:]
    shards = dp * cp if any(mode.zero for mode in modes) else 1
    key = RowKey(kind, v, mb, ctx.peak_inflight(kind, p, m, v), tp, dp * cp > 1, start,
                 shards, ctx.row_signature(row), cp, modes[0].reshard, ep)
    if key not in ctx.row_cuts:
        ctx.row_cuts[key] = _row_cut(ctx, kind, v, mb, row, m, modes, dp * cp)
    got = ctx.row_cuts[key]
    if got is None:
        return None
    return _finish(ctx, kind, v, mb, tp, types, all_slots(), price, got.mode, got.part,
                   placement, (m, cutoff))


def _row_cut(ctx: SearchContext, kind: str, v: int, mb: int, row: list[tuple[str, ...]],
             m: int, modes: tuple[MemoryMode, ...], dp: int) -> RowCut | None:
    """The cut of replica 0's `row` in the first of `modes` that fits (None if none);
    `dp`: the ranks its ZeRO stage shards over (replicas x context ranks)."""
    p = len(row)
    stages = p * v
    inflight = ctx.peak_inflight(kind, p, m, v)
    place = schedule_kind(kind).placement
    homes = [stage_rank(k, p, place) for k in range(stages)]
    splits = schedule_kind(kind).splits_backward
    weight = v if place == "v" else v - 1   # `partition.balance_devices`' sum_per_load
    # the link after each stage (none after the last): the same in every memory mode
    lkeys, links = [], []
    for k in range(stages - 1):
        src, dst = row[homes[k]][-1], row[homes[k + 1]][0]
        lkeys.append(ctx.link_key(src, dst, mb))
        links.append(ctx.link_of(lkeys[-1], src, dst))
    lkeys.append(None)
    links.append(None)
    free_of = [ctx.cluster.device(group[0]).type.free_bytes for group in row]
    for mode in modes:
        tables, rooms, split, keys = [], [], [], []
        units = []                      # per device of the row: table key, table, room
        for group, free in zip(row, free_of, strict=True):
            tkey = ctx.table_key(group, mb, mode, dp)
            t = ctx.table_of(tkey, group)
            units.append((tkey, t, free - t.work_bytes))
        for k in range(stages):
            group = row[homes[k]]
            tkey, t, room = units[homes[k]]
            tables.append(t)
            keys.append((tkey, lkeys[k], t.splits(splits)))
            rooms.append(P.Slot(group, inflight[k], room))
            split.append(rooms[-1] if v == 1 else P.Slot(group, inflight[k], room / v))
        # A device's v chunks get a v-th of its room each; if no cut fits so, shares
        # in proportion to what they keep under the even cut (`partition.shared_slots`).
        bounds = _cut(ctx, keys, tables, split, links, homes, weight)
        if bounds is None and v > 1:
            bounds = _cut(ctx, keys, tables, P.shared_slots(tables, rooms, homes), links,
                          homes, weight)
        if bounds is not None:
            # one chunk per device: the W's of the later stages run beside the way back
            # (V placements keep them on it: a device's two chunks share its stream)
            return RowCut(mode, P.describe(bounds, tables, links, [k[2] for k in keys],
                                           splits and v == 1))
    return None


def _cut(ctx: SearchContext, keys: list[tuple[TableKey, LinkKey | None, bool]],
         tables: list[P.LayerTables], slots: list[P.Slot], links: list,
         homes: list[int], sum_per_load: float) -> tuple[int, ...] | None:
    """`partition.partition` of these stages (`keys`: each one's table and link keys,
    and whether its backward is split, `LayerTables.splits`), then, where a device
    holds several of them (`homes`: each stage's device), `partition.balance_devices`
    with `sum_per_load` (which the homes' placement and chunk count fix). The cut
    depends only on each stage's (table, in-flight stashes, room, link, split) and the
    homes: templates that differ elsewhere (replica count, price, m past the fill)
    share it."""
    stage_keys = tuple(StageKey(tkey, sl.inflight, sl.capacity_bytes, lkey, split)
                       for (tkey, lkey, split), sl in zip(keys, slots, strict=True))
    key = CutKey(stage_keys, tuple(homes))
    if key not in ctx.cuts:
        mats = [ctx.stage_cost(k, t, sl, ln)
                for k, t, sl, ln in zip(stage_keys, tables, slots, links, strict=True)]
        bounds = P.partition(mats)
        if bounds is not None and len(set(homes)) < len(homes):
            bounds = P.balance_devices(bounds, mats, homes, sum_per_load)
        ctx.cuts[key] = bounds
    return ctx.cuts[key]


class Skipped(NamedTuple):
    """A template left out before its all-reduces were costed: even without them its
    objective value is above its race's band."""

    value_lb: float


def _finish(ctx: SearchContext, kind: str, v: int, mb: int, tp: int, types: tuple[str, ...],
            slots, price: float, mode: MemoryMode, part: P.Partition,
            placement: tuple | None = None,
            cut_at: tuple[int, float] = (1, math.inf)) -> Template | Skipped:
    """The template of a cut: its busiest device's load, fill and sync. `cut_at` = (m,
    cutoff): `Skipped` when its value for m micro-batches, its sync counted as its
    optimizer steps alone, is above cutoff."""
    p = len(slots[0])
    place = schedule_kind(kind).placement
    homes = [stage_rank(k, p, place) for k in range(len(part.stage_s))]
    load = _device_loads_s(part, homes, p)
    fill = _fill_s(kind, v, part, max(load))
    m, cutoff = cut_at
    run_s = max((m - 1) * max(load) + fill, part.trip_s, m * max(load))
    if math.isfinite(cutoff):
        steps = _sync_s(ctx, slots, part, tp, mode, kind, placement, rings=False)
        lb = objective_value(ctx, run_s + steps, price)
        if lb > cutoff:
            return Skipped(lb)
    if mode.zero >= 2:
        # ZeRO-2/3's gathers and scatters of every micro-batch (the cut left them out:
        # they depend on where the replicas sit); without them zero 2/3 templates
        # would look as fast as zero 1 ones while moving the gradients m times
        part, once = _with_zero_collectives(ctx, kind, slots, part, tp, mode, mb,
                                            placement)
        load = _device_loads_s(part, homes, p)
        fill = _fill_s(kind, v, part, max(load)) + once
    return Template(kind, v, mb, tp, types, tuple(tuple(r) for r in slots), part,
                    max(load), fill, _sync_s(ctx, slots, part, tp, mode, kind, placement),
                    price, mode)


def _zero_cost(ctx: SearchContext, st: StagePlan, group: tuple[str, ...],
               pattern: tuple, mb: int, mode: MemoryMode, op: str, first: bool = False
               ) -> FsdpCost:
    """`sim.sharding.stage_fsdp_cost`, cached under what it depends on: stages alike
    to the cost model (unit kind, layers, where the group's devices sit: `pattern`, its
    `ring_pattern`) cost the same."""
    key = (ctx.table_key(st.devices, mb, mode).times, st.layers, pattern, mode.zero,
           mode.reshard, op, first)
    return ctx.zero_extras.memo(key, lambda: stage_fsdp_cost(
        ctx.cost, st, group, op, mb, mode.zero, mode.reshard, ctx.grad_bytes_per_param,
        first_forward=first))


def _device_loads_s(part: P.Partition, homes: list[int], p: int) -> list[float]:
    """Per device of the pipeline, the per-micro-batch time of the stages it holds."""
    load = [0.0] * p
    for k, t in enumerate(part.stage_s):
        load[homes[k]] += t
    return load


def _fill_s(kind: str, v: int, part: P.Partition, load_s: float) -> float:
    """What a uniform pipeline adds to m x load (equal stages of F = I = W = t: 1F1B
    3(m + p - 1)t, zero-bubble 3mt + (p - 1)t, interleaved 3mvt + 3(p - 1)t with t per
    chunk; the generators' docstrings), written with per-stage times; `load_s`: the
    busiest device's per-micro-batch load."""
    if schedule_kind(kind).placement == "v":   # zb-v / dualpipe-v: 6mt + (p - 1)t
        return load_s + part.forward_s / v
    if v > 1:
        return part.total_s / v + load_s * (v - 1) / v
    if schedule_kind(kind).splits_backward:
        return part.forward_s + part.last_backward_s
    return part.total_s


def _with_zero_collectives(ctx: SearchContext, kind: str, slots, part: P.Partition,
                           tp: int, mode: MemoryMode, mb: int, placement: tuple | None
                           ) -> tuple[P.Partition, float]:
    """`part` with each stage's per-micro-batch ZeRO-2/3 time added (its forward's and
    backward's exposed gathers and scatters, `sim.sharding.stage_fsdp_cost`, over
    the stage's data-parallel group: tensor rank 0 of each context rank of every
    replica), and the seconds by which ZeRO-3 without resharding's once-a-step gathers
    delay the first micro-batch's forward path (`sim.sharding.first_forwards` and
    `fill_delay_s`, links left out). `placement` names `slots` (as in
    `_sync_s`): the groups' ring patterns are cached under it."""
    p = len(slots[0])
    place = schedule_kind(kind).placement
    backward = ("I", "W") if schedule_kind(kind).splits_backward else ("B",)
    cp = mode.cp
    stage_s, extra_f, last_back = [], 0.0, 0.0
    forward, firsts = [], []
    once_a_step = mode.zero == 3 and not mode.reshard
    for k, (a, b) in enumerate(part.layer_ranges):
        d = stage_rank(k, p, place)
        unit = slots[0][d]
        group = tuple(row[d][c * tp] for row in slots for c in range(cp))
        st = StagePlan((a, b), unit, tp, mode.recompute, mode.sequence_parallel, cp,
                       mode.ep)
        pattern = ctx.ring_pattern((group,)) if placement is None else \
            ctx.group_patterns.memo(_position(placement, d),
                                    lambda g=group: ctx.ring_pattern((g,)))
        f = _zero_cost(ctx, st, group, pattern, mb, mode, "F").extra_s
        back = sum(_zero_cost(ctx, st, group, pattern, mb, mode, op).extra_s
                   for op in backward)
        if once_a_step:
            firsts.append(_zero_cost(ctx, st, group, pattern, mb, mode, "F", first=True))
            table = ctx.table(unit, mb, mode)
            forward.append(float(table.fwd_s[b] - table.fwd_s[a]))
        stage_s.append(part.stage_s[k] + f + back)
        extra_f += f
        last_back = back                # the last stage's, for the zero-bubble fill
    once = 0.0
    if once_a_step:
        homes = [rank_stages(d, p, len(firsts) // p, place) for d in range(p)]
        once = fill_delay_s(stage_waits(firsts, homes), forward)
    return (replace(part, stage_s=tuple(stage_s), bottleneck_s=max(stage_s),
                    total_s=sum(stage_s), forward_s=part.forward_s + extra_f,
                    last_backward_s=part.last_backward_s + last_back,
                    trip_s=part.trip_s + sum(stage_s) - part.total_s), once)


def _sync_s(ctx: SearchContext, slots, part: P.Partition, tp: int, mode: MemoryMode,
            slots_kind: str = "", placement: tuple | None = None, rings: bool = True
            ) -> float:
    """Per iteration: ring all-reduce of each device's gradients over the replicas
    (`CostModel.dp_sync_bytes_per_param` on the search's stack: fp32 main grads for
    bf16; reduce-scatter and all-gather with the distributed optimizer), the rings of a
    tp group's ranks at once (`network.ring_spec`: rings that cross one NIC share it),
    plus its optimizer step (sharded with it), plus on the first and the last stage's
    devices the tied embedding's all-reduce between them (`_tie_s`; the analytic tier
    and the simulator count it too); the busiest device counts. `placement`: a
    name for `slots` (what built them), under which each device's ring is cached.
    `rings` False: the optimizer steps alone (a lower bound, without the costly
    all-reduces). With context parallelism the reduction over dp x cp ranks is costed as
    the rings of each context rank's tp group over the replicas, all at once; ZeRO 2 and
    3 leave here only what they move once a step (`CostModel.dp_sync_bytes_per_param`)."""
    cost = ctx.cost
    p = len(slots[0])
    shards = len(slots) * mode.cp if mode.zero else 1
    per_param = ctx.sync_bytes.memo((mode.zero, mode.reshard),
                                    lambda: cost.dp_sync_bytes_per_param(
                                        runtime=ctx.runtime, zero=mode.zero,
                                        reshard_after_forward=mode.reshard))
    per_device = [0.0] * p
    place = schedule_kind(slots_kind).placement if slots_kind else "loop"
    placed = ctx.placed_rings.get(placement) if placement is not None else None
    if placed is None:
        placed = [None] * p
        if placement is not None and rings:
            ctx.placed_rings[placement] = placed
    for k, (a, b) in enumerate(part.layer_ranges):
        d = stage_rank(k, p, place)
        group = slots[0][d]
        per_device[d] += cost.optimizer_time_s(
            (a, b), ctx.cluster.device(group[0]).type.name, tp, shards, group)
        if not rings:
            continue
        if placed[d] is None:
            groups = tuple(r[d] for r in slots)
            placed[d] = _ring_cost(ctx, groups) if placement is None else \
                ctx.position_rings.memo(_position(placement, d),
                                        lambda g=groups: _ring_cost(ctx, g))
        # with expert parallelism a rank reduces its 1/ep of the routed experts (over
        # their expert-data-parallel group, priced here as the replicas' ring)
        params = cost.stage_params((a, b)) - (1 - 1 / mode.ep) * cost.expert_params((a, b))
        nbytes = params * per_param / tp
        per_device[d] += _affine_s(placed[d], nbytes)
    if rings:
        first, last = 0, stage_rank(len(part.stage_s) - 1, p, place)
        tie_s = _tie_s(ctx, slots, first, last, tp, placement)
        per_device[first] += tie_s
        per_device[last] += tie_s
    return max(per_device)


def _tie_s(ctx: SearchContext, slots, first: int, last: int, tp: int,
           placement: tuple | None) -> float:
    """The tied embedding's gradient all-reduce between the row positions of the first
    and the last stage: device i of one unit with device i of the other, in every
    replica (`network.tie_rings`), the slowest pair on idle links (as `network.
    ring_spec` times rings); 0 without tied embeddings or where both stages sit on one
    unit (a V placement, one stage). `placement` names `slots` (as in `_sync_s`): the
    time is cached under the two positions."""
    tied = ctx.cost.tied_params()
    if not tied or first == last:
        return 0.0
    nbytes = tied * ctx.tie_bytes_per_param / tp

    def slowest_pair_s() -> float:
        return max((ctx.cost.allreduce_time_s((a, b), nbytes) for r in slots
                    for a, b in zip(r[first], r[last], strict=True) if a != b),
                   default=0.0)

    if placement is None:
        return slowest_pair_s()
    return ctx.tie_times.memo((_position(placement, first), _position(placement, last)),
                              slowest_pair_s)


def _position(placement: Placement, d: int) -> PositionKey:
    """The units `placement`'s replicas hold at row position d (`_assign`)."""
    t = placement.order[d]
    return PositionKey(t, placement.tp, placement.cp, placement.dp, placement.layout,
                       placement.order[:d].count(t), dict(placement.recipe)[t])


def _ring_s(ctx: SearchContext, groups: tuple[tuple[str, ...], ...], nbytes: float) -> float:
    """All-reduce of `nbytes` per device over the same tp rank of every group, all tp
    ranks at once, on otherwise idle links (`_ring_cost`)."""
    return _affine_s(_ring_cost(ctx, groups), nbytes)


def _affine_s(ring: RingCost, nbytes: float) -> float:
    if nbytes <= 0:
        return 0.0
    return ring.at_1gb_s + ring.per_gb_s * (nbytes - 1e9) / 1e9


def _ring_cost(ctx: SearchContext, groups: tuple[tuple[str, ...], ...]) -> RingCost:
    """The all-reduce over `groups`, affine in the bytes (alpha-beta links, or a
    profile's fitted line): costed at 1 and 2 GB. Cached under `ring_pattern`: rings
    whose devices sit alike (the same classes, node by node, sharing NICs alike) cost
    the same, whatever their nodes and devices are called."""
    key = ctx.ring_pattern(groups)
    if key not in ctx.rings:
        rings = [[g[i] for g in groups] for i in range(len(groups[0]))]
        t1, t2 = (0.0 if spec is None else spec.time_s
                  for spec in (ring_spec(ctx.cost, rings, x) for x in (1e9, 2e9)))
        ctx.rings[key] = RingCost(t1, t2 - t1)
    return ctx.rings[key]


def _assign(pools: dict[str, space.UnitPool], recipe: dict[str, int], dp: int,
            order: tuple[str, ...], layout: str, replicas: range | None = None
            ) -> list[list[tuple[str, ...]]]:
    """slots[r][j]: the unit of replica r at position j of `order`, for r in `replicas`
    (None: all dp); the i-th unit of type t in a replica is its pool's
    `space.unit_index`, affine in r (so each position is a stride and an offset)."""
    seen = dict.fromkeys(recipe, 0)
    picks = []                          # (units, stride, offset) of each position
    for t in order:
        i = seen[t]
        seen[t] += 1
        offset = space.unit_index(layout, 0, i, recipe[t], dp)
        stride = space.unit_index(layout, 1, i, recipe[t], dp) - offset
        picks.append((pools[t].units, stride, offset))
    return [[units[r * stride + offset] for units, stride, offset in picks]
            for r in (range(dp) if replicas is None else replicas)]


class TemplateKey(NamedTuple):
    """A class of templates of one type group still to be cut: config, tp, replica
    count and units per type, with a lower bound on its objective."""

    bound: float                          # objective value of the bound
    config: tuple[str, int, int]          # (schedule kind, chunks, micro-batch)
    tp: int
    dp: int
    recipe: dict[str, int]                # units of each type in one pipeline
    pools: dict[str, space.UnitPool]
    price_per_hour: float                 # all devices of all replicas, USD
    start: int                            # the first memory mode to try (`ctx.modes`)
    cp: int = 1                           # context ranks per stage (units: tp x cp)
    ep: int = 1                           # expert-parallel degree (`space.ep_options`)


class Shape(NamedTuple):
    """What the cuts of one `TemplateKey` share, whatever the stage order and layout."""

    kind: str
    v: int
    mb: int
    tp: int
    dp: int
    types: tuple[str, ...]
    m: int                                # micro-batches per pipeline
    price_per_hour: float
    recipe: dict[str, int]
    pools: dict[str, space.UnitPool]
    start: int
    cp: int = 1
    ep: int = 1


def _keys(ctx: SearchContext, phase: PhaseStats, types: tuple[str, ...],
          configs: list[tuple[str, int, int]]) -> list[TemplateKey]:
    """Every (config, tp, replicas, units per type) for one type group that can hold the
    model's state, with a lower bound on its objective: the load spread perfectly over
    the pipeline's devices (fractional layers), the fill on the fastest type, and the
    optimizer step spread the same way; no link, no all-reduce. Both the memory check
    and the bound are those of the first memory mode (`SearchContext.modes`) whose
    memory bound passes, and the key starts its cuts at that mode. Context-parallel
    degrees are `space.cp_options`: cp 1 alone unless the sequence is long, or unless
    no key of cp 1 can hold the model (then the others)."""
    c, model = ctx.c, ctx.model
    keys: list[TemplateKey] = []
    cps = space.cp_options(model, c)
    for cp in cps:
        for tp in space.tp_options(ctx.cluster, model, c):
            keys += _keys_at(ctx, phase, types, configs, tp, cp)
    if not keys and cps == (1,) and c.cp is None:
        # no plan of one context rank holds the model: the sequence needs splitting
        for cp in space.cp_options(model, c, long_sequence=True)[1:]:
            for tp in space.tp_options(ctx.cluster, model, c):
                keys += _keys_at(ctx, phase, types, configs, tp, cp)
    keys.sort(key=lambda k: k.bound)
    return keys


def _keys_at(ctx: SearchContext, phase: PhaseStats, types: tuple[str, ...],
             configs: list[tuple[str, int, int]], tp: int, cp: int) -> list[TemplateKey]:
    """`_keys` of units of `tp` x `cp` devices, each replica count with every
    expert-parallel degree `space.ep_options` allows it (1 alone without MoE blocks)."""
    c, model = ctx.c, ctx.model
    keys: list[TemplateKey] = []
    width = tp * cp
    pools = ctx.pools(tp, cp)
    if any(t not in pools for t in types):
        return keys
    # each class's units up to each of its slowdowns (a straggler inside a node left
    # idle or not); one count per class on a cluster without stragglers
    variants = [dict(zip(types, ns, strict=True)) for ns in itertools.product(
        *(space.slowdown_levels(ctx.cluster, pools[t]) for t in types))]
    node_units = {t: space.first_node_units(ctx.cluster, pools[t]) for t in types}
    opt = _optimizer_s(ctx, types, pools, tp)
    price_of = {t: ctx.cluster.price_per_hour(pools[t].units[0][0]) for t in types}
    room = {t: ctx.type_of(t).free_bytes for t in types}
    made: set[tuple] = set()
    for (kind, v, mb), counts in itertools.product(configs, variants):
        big_m = c.global_batch // mb
        for dp, recipe in space.dp_recipes(counts, num_layers=model.num_layers,
                                           chunks=v, pp=c.pp, dp=c.dp, max_dp=big_m,
                                           node_units=node_units):
            if len(variants) > 1:      # recipes of two variants may take the same units
                if (mine := (kind, v, mb, dp, tuple(recipe.items()))) in made:
                    continue
                made.add(mine)
            phase.seen += 1
            p = sum(recipe.values())
            m = -(-big_m // dp)
            if p * v > model.num_layers or dp > big_m \
                    or (c.pp is not None and p != c.pp) or (v > 1 and p < 2):
                phase.infeasible += 1
                continue
            # memory, summed over the pipeline: all state, and every layer's stash
            # at least as often as the least-loaded stage keeps micro-batches
            mem = sum(k * width * room[t] for t, k in recipe.items())
            held = min(ctx.peak_inflight(kind, p, m, v))
            eps = space.ep_options(model, c, dp * cp)
            if not eps:
                phase.infeasible += 1
            for ep in eps:
                modes = ctx.modes(tp, dp, cp, p > 1, ep)
                start = next((i for i, mode in enumerate(modes)
                              if mem >= _total_bytes(ctx, mode, dp, mb, held)), None)
                if start is None:
                    phase.infeasible += 1
                    continue
                mode = modes[start]
                whole, fill_lb = work_bound(ctx, types, pools, kind, v, mb, mode)
                load_lb = 1.0 / sum(k / whole[t] for t, k in recipe.items())
                sync_lb = optimizer_floor_s(recipe, dp * cp if mode.zero else 1, opt)
                bound = (m - 1) * load_lb + fill_lb + sync_lb
                price = dp * width * sum(k * (price_of[t] if price_of[t] is not None
                                              else math.nan) for t, k in recipe.items())
                keys.append(TemplateKey(objective_value(ctx, bound, price), (kind, v, mb),
                                        tp, dp, recipe, pools, price, start, cp, ep))
    return keys


def _optimizer_s(ctx: SearchContext, types: tuple[str, ...], pools, tp: int
                 ) -> dict[str, float]:
    """Per class, its fastest unit's optimizer step for the whole model, unsharded."""
    model, cost = ctx.model, ctx.cost
    return {t: cost.optimizer_time_s((0, model.num_layers), ctx.type_of(t).name, tp,
                                     devices=ctx.fastest_unit(pools[t])) for t in types}


def _total_bytes(ctx: SearchContext, mode: MemoryMode, dp: int, mb: int, held: int) -> float:
    """A lower bound on a pipeline's memory in `mode`: the model's state on each of its
    `mode.cp` context ranks (sharded over the dp x cp ranks of its data-parallel group by
    the mode's ZeRO stage; ZeRO-3 without resharding holding its weights and gradient
    unsharded too) and `held` stashes of every layer, split perfectly over the tensor-
    parallel and context-parallel groups."""
    shards = dp * mode.cp if mode.zero else 1
    key = TotalKey(mode.recompute, shards, mb, mode.zero, mode.cp, mode.reshard, mode.ep)
    if key not in ctx.totals:
        whole = (0, ctx.model.num_layers)
        cost = ctx.cost
        state = cost.state_bytes(whole, 1, shards, mode.zero,
                                 **P.expert_state(mode.ep, mode.zero, shards))
        if mode.zero == 3 and not mode.reshard:
            state += cost.zero3_working_bytes(whole, 1, False,
                                               **P.expert_state(mode.ep, mode.zero, shards))
        ctx.totals[key] = StateStash(mode.cp * state,
                                     cost.stash_bytes(whole, mb, recompute=mode.recompute))
    state, stash = ctx.totals[key]
    return state + held * stash


class Entry(NamedTuple):
    """A template in a race: its objective value and the order it came in (ties)."""

    value: float
    serial: int
    template: Template


@dataclass
class _Race:
    """The templates competing for one group (and replica count): all of them, and the
    KEEP_PER_GROUP smallest objective values, kept sorted as they come, so that the band
    is O(1) to read however many templates the race has seen."""

    found: list[Entry] = field(default_factory=list)
    best: list[float] = field(default_factory=list)   # the smallest values, ascending
    kept: list[float] = field(default_factory=list)   # the KEEP_MAX smallest, ascending

    def add(self, value: float, serial: int, template: Template) -> None:
        self.found.append(Entry(value, serial, template))
        if len(self.best) < KEEP_PER_GROUP or value < self.best[-1]:
            bisect.insort(self.best, value)
            del self.best[KEEP_PER_GROUP:]
        if len(self.kept) < KEEP_MAX or value < self.kept[-1]:
            bisect.insort(self.kept, value)
            del self.kept[KEEP_MAX:]

    def cutoff(self) -> float:
        """The band, or the KEEP_MAX-th smallest value found when that is lower: only
        the first KEEP_MAX within the band are kept, so a template above either could
        not be (a key whose bound is above it need not be cut)."""
        full = self.kept[-1] if len(self.kept) >= KEEP_MAX else math.inf
        return min(self.band(), full)

    def band(self) -> float:
        """Templates whose closed-form value is within TOLERANCE of the best, or among
        the KEEP_PER_GROUP best, go on: the closed form does not see everything the
        analytic tier and the simulator do (which stage order fills the pipeline faster,
        ...)."""
        if not self.best:
            return math.inf
        return max(self.best[0] * (1 + TOLERANCE), self.best[-1])


def canonical_order(ctx: SearchContext, recipe: dict[str, int]) -> tuple[str, ...]:
    """The stage order tried first: most memory first (1F1B's early stages stash the
    most micro-batches), then the faster type, each type's units together."""
    types = sorted(recipe, key=lambda t: (-ctx.type_of(t).memory_bytes,
                                          -ctx.type_of(t).peak_flops / ctx.classes[t].slowdown))
    return tuple(t for t in types for _ in range(recipe[t]))


def group_templates(ctx: SearchContext, phase: PhaseStats, types: tuple[str, ...],
                    configs: list[tuple[str, int, int]]) -> list[Template]:
    """The best templates for one type group over `configs`, by branch and bound: keys
    best bound first; a key is cut with its canonical stage order, and with every other
    order only if that one lands in the band; the visit ends when no bound can."""
    # with a fixed number of pipelines every replica count is its own race: groups are
    # combined to exactly that many pipelines later
    races: dict[int | None, _Race] = {}
    too_big: dict[tuple, int] = {}      # (pipelines, in-flight counts) -> least mb out of memory
    serial = itertools.count()
    optimizer: dict[int, dict[str, float]] = {}
    # keys best (cheap) bound first; a key within the band gets `bounds.key_bound` and
    # goes back in line under it; a key that comes out again under it is cut
    heap = [(key.bound, i, False, key) for i, key in enumerate(_keys(ctx, phase, types,
                                                                        configs))]
    while heap:
        _, i, strong, key = heapq.heappop(heap)
        (kind, v, mb), tp, dp, recipe = key.config, key.tp, key.dp, key.recipe
        race = races.setdefault(dp if ctx.c.dp is not None else None, _Race())
        if key.bound > race.cutoff():
            phase.pruned += 1
            continue
        if not strong:
            if tp not in optimizer:
                optimizer[tp] = _optimizer_s(ctx, types, key.pools, tp)
            got = key_bound(ctx, types, key.config, tp, dp, recipe, key.pools, key.start,
                            optimizer[tp], ctx.layer_caps, key.cp, key.ep,
                            objective_time_s(ctx, race.cutoff(), key.price_per_hour))
            if got is None:
                phase.infeasible += 1
                continue
            bound = objective_value(ctx, got[0], key.price_per_hour)
            heapq.heappush(heap, (bound, i, True, key._replace(bound=bound, start=got[1])))
            continue
        m = -(-(ctx.c.global_batch // mb) // dp)
        p = sum(recipe.values())
        pipes = (kind, v, tp, key.cp, key.ep, dp, tuple(sorted(recipe.items())),
                 ctx.peak_inflight(kind, p, m, v))
        if m >= p * v and mb >= too_big.get(pipes, math.inf):
            # the same pipelines did not fit a smaller micro-batch, which stashes less
            # with the same in-flight counts (m >= p v: the warm-up is full; GPipe's
            # counts grow with m, so its pipelines differ by micro-batch)
            phase.infeasible += 1
            continue
        first = canonical_order(ctx, recipe)
        if not order_may_fit(ctx, kind, v, mb, tp, dp, first, key.pools, key.start, m,
                             optimizer[tp], objective_time_s(ctx, race.cutoff(),
                                                             key.price_per_hour),
                             key.cp, key.ep):
            phase.pruned += 1             # nor do the other orders: see below
            continue
        tries = [(first, lay) for lay in space.layouts(dp, recipe, key.ep)]
        shape = Shape(kind, v, mb, tp, dp, types, m, key.price_per_hour, recipe, key.pools,
                      key.start, key.cp, key.ep)
        values = _cut_all(ctx, phase, race, serial, tries, shape)
        if not values:                     # out of memory in the most memory-rich order
            if m >= p * v:
                too_big[pipes] = min(mb, too_big.get(pipes, mb))
            continue
        if min(values) > race.cutoff():
            # a heuristic, not a bound: the other orders move links and memory, and
            # also which device takes the uneven layers (embedding, head)
            continue
        more = [(o, lay) for o in space.stage_orders(recipe) if o != first
                for lay in space.layouts(dp, recipe, key.ep)]
        _cut_all(ctx, phase, race, serial, more, shape)
    kept: list[Template] = []
    for race in races.values():
        race.found.sort(key=lambda e: (e.value, e.serial))
        limit = race.band()
        kept += [e.template for e in race.found if e.value <= limit][:KEEP_MAX]
    return kept


def _priced_row(ctx: SearchContext, shape: Shape, order: tuple[str, ...], layout: str
                ) -> list[tuple[str, ...]]:
    """The row a template is cut and priced on: replica 0's where every class of the
    recipe has units of one slowdown; else (stragglers) at each position the slowest
    unit any replica puts there (the first on ties), so that the replicas' shared cut
    is priced for the slowest of them, not for the first."""
    row = _assign(shape.pools, shape.recipe, shape.dp, order, layout, range(1))[0]
    if shape.dp == 1 or all(ctx.classes[t].slowdown == ctx.classes[t].least_slowdown
                            for t in shape.recipe):
        return row
    rows = _assign(shape.pools, shape.recipe, shape.dp, order, layout)
    return [max(units, key=ctx.cluster.slowdown) for units in zip(*rows, strict=True)]


def _cut_all(ctx: SearchContext, phase: PhaseStats, race: _Race, serial, tries: list,
             shape: Shape) -> list[float]:
    """Cut the layers for each (order, layout) in `tries`; add the templates to `race`
    and return their objective values."""
    m = shape.m
    values = []
    recipe = tuple(sorted(shape.recipe.items()))
    for order, layout in tries:
        row = _priced_row(ctx, shape, order, layout)
        phase.seen += 1
        tpl = _template(ctx, shape.kind, shape.v, shape.mb, shape.tp, shape.types, row,
                        shape.dp, partial(_assign, shape.pools, shape.recipe, shape.dp,
                                          order, layout), m,
                        shape.price_per_hour, shape.start,
                        Placement(shape.tp, shape.dp, layout, order, recipe, shape.cp),
                        race.cutoff(), shape.cp, shape.ep)
        if tpl is None:
            phase.infeasible += 1
            continue
        if isinstance(tpl, Skipped):        # above the band without its all-reduces
            phase.pruned += 1
            values.append(tpl.value_lb)
            continue
        value = objective_value(ctx, tpl.time_s(m), tpl.price_per_hour)
        race.add(value, next(serial), tpl)
        values.append(value)
    return values


def templates_at(ctx: SearchContext, phase: PhaseStats, types: tuple[str, ...],
                 config: tuple[str, int, int] | None) -> list[Template]:
    """The kept templates of a type group over all configs (config None), or at one
    config (computed on demand, for combining groups that must share it)."""
    key = BookKey(types, config)
    if key not in ctx.book:
        if config is not None:
            ctx.book[key] = kept_at(ctx, phase, types, config) or \
                group_templates(ctx, phase, types, [config])
        else:
            ctx.book[key] = group_templates(ctx, phase, types, all_configs(ctx))
    return ctx.book[key]


def kept_at(ctx: SearchContext, phase: PhaseStats, types: tuple[str, ...],
            config: tuple[str, int, int]) -> list[Template]:
    """The templates a group kept over all configs that have `config` (none: its
    templates at `config` must be cut for it)."""
    return [t for t in templates_at(ctx, phase, types, None) if t.config == config]


def all_configs(ctx: SearchContext) -> list[tuple[str, int, int]]:
    return [(k, v, mb) for k, v in space.schedule_options(ctx.c, ctx.model.num_layers)
            for mb in space.micro_batches(ctx.c)]


def templates_phase(ctx: SearchContext, phase: PhaseStats, show, pool=None) -> list[str]:
    """Phase 1: the best templates of every group of device types (all configs), the
    groups spread over the worker `pool` when there is one (`start_book`)."""
    types = list(ctx.classes)
    start_book(ctx, [BookKey(s, None) for s in type_subsets(types)], pool)(
        phase, show, "search: templates")
    return types


def type_subsets(types: list[str]) -> list[tuple[str, ...]]:
    """Every non-empty subset of the device classes, the largest first."""
    return [s for r in range(len(types), 0, -1) for s in itertools.combinations(types, r)]


def start_book(ctx: SearchContext, keys: list[BookKey], pool=None):
    """Start `ctx.book[key]` for each of `keys` (a group over all configs, or at one
    config that none of its kept templates has) over the worker `pool` when there is
    one: a task per key, the most work first (`book_work`), so that the pool's workers
    finish together; a worker's caches (layer tables, stage matrices) serve all its
    tasks (`context.worker_context`). Returns a function of (phase, show, label, each) that
    waits for them (computing them here without a pool), with a progress bar, counts
    them in `phase` and calls `each(key)` (when given) once a key is in the book."""
    from hyperpipe.core.progress import Progress
    from hyperpipe.search.backends import fan_out
    todo = sorted((k for k in keys if k not in ctx.book), key=book_work, reverse=True)
    results = fan_out(pool, todo, lambda key: _group_work(ctx, key), _group_task,
                      lambda key: (ctx.inputs, key))

    def wait(phase: PhaseStats, show, label: str, each=None) -> None:
        if not todo:
            return
        with Progress(len(todo), label, enabled=show) as bar:
            for key, (templates, counts) in zip(todo, results(), strict=True):
                ctx.book[key] = templates
                phase.add(counts)
                bar.advance()
                if each is not None:
                    each(key)
    return wait


# A group's templates over all configs cost about this many times its templates at one
# config (scale-1024, gpt3-13b: 3.7 s a group against 0.19 s a group and config)
ALL_CONFIGS_WORK = 20


def book_work(key: BookKey) -> int:
    """A key's work relative to others: a group of k types costs about 2^k per config
    (its keys are as many, its cuts mix more tables)."""
    return 2 ** len(key.types) * (ALL_CONFIGS_WORK if key.config is None else 1)


def _group_work(ctx: SearchContext, key: BookKey) -> tuple[list[Template], PhaseCounts]:
    """A type group's templates over all configs, or at the one `key` names, with the
    phase counters it adds."""
    phase = PhaseStats("templates")
    found = templates_at(ctx, phase, key.types, None) if key.config is None \
        else group_templates(ctx, phase, key.types, [key.config])
    return found, phase.counts()


def _group_task(args) -> tuple[list[Template], PhaseCounts]:
    """`_group_work` in a worker process (`context.worker_context`)."""
    inputs, key = args
    return _group_work(worker_context(*inputs), key)
