"""Lower bounds on the templates of one template key (config, tp, replicas, units per
device class), for the branch and bound of `templates`: a key whose bound leaves the
band of the best templates found is never cut.

`templates._keys` gives every key a cheap bound (the load spread fractionally over the
pipeline's devices, no memory limit per device). Keys that survive it get `key_bound`
before they are cut, which sees what the cheap bound does not:

* **Memory per device.** A unit at a pipeline position that stashes i micro-batches
  holds at most `LayerCaps.memory_at` layers: its cheapest layers by state plus i
  stashes that fit its room (`partition`'s memory rule, summed the cheapest way). Each
  class's units are given the positions of fewest stashes (a relaxation of the
  assignment: every class at once), so when even that holds fewer than the model's
  layers, no stage order and cut fits in that memory mode, and the key starts at a
  later one (which recomputes, and so costs more time).
  The walk cuts a key's canonical stage order first and its other orders only where
  that one lands in the band, so right before the cut that order is bounded apart:
  `order_may_fit`, a greedy cut of whole layers into its stages, each within its
  device's room and the load the band leaves.
* **Whole layers.** In time B per micro-batch a unit holds at most its fastest layers
  that fit in B (`LayerCaps.in_time`), and no more than its memory allows; the least B
  for which the units hold the model's layers bounds the busiest device's load from
  below (the fractional spread does not see that 98 layers on 64 stages put 2 on some).
  And every device holds a layer per chunk, so its load is at least its class's v
  fastest layers (`_chunks_floor_s`: a slow class must take some, however slow).

* **ZeRO-2/3's collectives.** Under ZeRO-2/3 every micro-batch gathers weights and
  reduce-scatters gradients layer by layer over the stage's replicas, on one
  communication stream beside the compute (`sim.sharding.overlapped_pass_s`), so a
  device's load is at least its layers' collectives, and the busiest device's at
  least the pipeline's collectives over its devices, each layer's at the cheapest
  ring any stage of the key's units may get (`zero_ring_line`).

All three only relax the cut the DP of `partition` makes (per-layer times on the class's
fastest unit, links and collectives left out), so the bound stays below the template's
closed-form value (`Template.time_s` plus its sync), and a pruned key could not have
entered the band: the templates kept are those an exhaustive cut of every key keeps.
Times in seconds, memory in bytes.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hyperpipe.plan.kinds import schedule_kind
from hyperpipe.plan.schedule import stage_rank
from hyperpipe.search import space
from hyperpipe.search.caches import Cache, CapsKey, LoadKey, ModeLoad
from hyperpipe.search.space import MemoryMode
from hyperpipe.sim.sharding import zero_collectives

RELATIVE_SLACK = 1e-9     # relative difference of bytes read as equal (`layer_caps`)


@dataclass
class LayerCaps:
    """How many of a set of layers one unit of a class holds: in time B (its fastest
    first) and in memory while stashing i micro-batches (its cheapest first). The set is
    every layer, or every layer but a few cheap ones (`layer_caps`): those can sit on
    one device only, and counting them on every device would say far too much fits."""

    time_prefix_s: np.ndarray          # the set's least times sorted and summed
    forward_s: float                   # F of the whole model
    state_bytes: np.ndarray            # per layer of the set, per device
    stash_bytes: np.ndarray            # per layer of the set, per device, one micro-batch
    room_bytes: float                  # the device's memory less reserve and work space
    left_out: int                      # layers of the model not in the set
    by_held: dict[tuple[tuple[int, int], ...], np.ndarray] = field(default_factory=dict)
    _prefix: list[float] | None = None

    def memory_at(self, held: tuple[tuple[int, int], ...]) -> np.ndarray:
        """Per (inflight, extra) of `held`, in its order: the layers of the set that fit
        while `inflight` micro-batches' stashes are held, and `extra` more stashes of its
        smallest layer (a device's other chunks), the cheapest layers first."""
        if held not in self.by_held:
            # every position at once: row i sorts and sums the layers' state plus
            # inflight_i stashes and counts the prefix sums within the room
            ins = np.array([h for h, _ in held], dtype=np.float64)
            extra = np.array([x for _, x in held], dtype=np.float64)
            need = np.cumsum(np.sort(self.state_bytes[None, :] +
                                     ins[:, None] * self.stash_bytes[None, :], axis=1),
                             axis=1)
            room = self.room_bytes - extra * float(self.stash_bytes.min(initial=0.0))
            self.by_held[held] = (need <= room[:, None]).sum(axis=1).astype(np.int64)
        return self.by_held[held]

    def prefix_list(self) -> list[float]:
        """`time_prefix_s` as Python floats (bisected on the bound's hot path)."""
        if self._prefix is None:
            self._prefix = [float(x) for x in self.time_prefix_s]
        return self._prefix

    def in_time(self, budget_s: float) -> int:
        """Layers of the set whose least times (`LayerTables.least_layer_s`: F + B,
        or F + I + W where that is less) fit in `budget_s`, the fastest first."""
        return int(np.searchsorted(self.time_prefix_s, budget_s * (1 + 1e-12),
                                   side="right"))


def layer_caps(ctx, unit: tuple[str, ...], mb: int, mode: MemoryMode, shards: int,
               cache: Cache[CapsKey, LayerCaps], reduced: bool = False) -> LayerCaps | None:
    """The `LayerCaps` of `unit` (a class's fastest) at micro-batch `mb` in `mode`, over
    every layer, or (`reduced`) over every layer but those whose state and one stash, or
    whose stash, is below the median layer's (the embedding and the head of a GPT); None
    when reduced leaves none out."""
    key = CapsKey(unit, mb, mode, shards, reduced)
    if key not in cache:
        t = ctx.table(unit, mb, mode, shards)
        dev = ctx.cluster.device(unit[0]).type
        times = t.least_layer_s()
        state, stash = np.diff(t.state_bytes), np.diff(t.stash_bytes)
        keep = np.ones(len(times), dtype=bool)
        if reduced:
            # below by more than rounding: alike layers' bytes come out of prefix
            # sums, so their differences scatter in the last digits about the median
            need = state + stash
            keep = (need >= np.median(need) * (1 - RELATIVE_SLACK)) & \
                (stash >= np.median(stash) * (1 - RELATIVE_SLACK))
        if reduced and keep.all():
            cache[key] = None
        else:
            cache[key] = LayerCaps(np.cumsum(np.sort(times[keep])), float(t.fwd_s[-1]),
                                   state[keep], stash[keep], dev.free_bytes - t.work_bytes,
                                   int((~keep).sum()))
    return cache[key]


def device_inflight(ctx, kind: str, p: int, m: int, v: int) -> list[tuple[int, int]]:
    """Per pipeline device, (the fewest stashes any of its chunks holds at the peak, the
    stashes its other chunks hold beyond that): every chunk holds at least one layer, so
    a device keeps at least that many of each of its layers' stashes and the extra of
    one layer per other chunk."""
    per_stage = ctx.peak_inflight(kind, p, m, v)
    place = schedule_kind(kind).placement
    mine: list[list[int]] = [[] for _ in range(p)]
    for k, held in enumerate(per_stage):
        mine[stage_rank(k, p, place)].append(int(held))
    return [(min(h), sum(h) - len(h) * min(h)) for h in mine]


def key_bound(ctx, types: tuple[str, ...], config: tuple[str, int, int], tp: int, dp: int,
              recipe: dict[str, int], pools, start: int, optimizer_s: dict[str, float],
              cache: Cache[CapsKey, LayerCaps | None], cp: int = 1, ep: int = 1,
              cutoff_s: float = math.inf) -> tuple[float, int] | None:
    """(a lower bound on the time of every template of the key, the first memory mode
    from `start` in which its units can hold the model), or None when none can. The
    bound is the least over the modes from there that pass the memory checks.
    `optimizer_s`: per class, a unit's optimizer step for the whole model unsharded.
    Fill and sync are bounded as `templates._keys` does, and one micro-batch's whole
    trip by each layer's least time on any used class. ZeRO-2/3's collectives
    (costly to price on thousands of replicas) are added only to a mode whose bound
    without them is at most `cutoff_s`: above it, the key is pruned either way."""
    kind, v, mb = config
    p = sum(recipe.values())
    m = -(-(ctx.c.global_batch // mb) // dp)
    held = tuple(device_inflight(ctx, kind, p, m, v))
    modes = ctx.modes(tp, dp, cp, p > 1, ep)
    used = [t for t in types if recipe.get(t)]
    first: int | None = None
    bound = math.inf
    stage_held = sorted(ctx.peak_inflight(kind, p, m, v), reverse=True)
    total_room = sum(recipe[t] * tp * cp * ctx.type_of(t).free_bytes for t in used)
    fast = {t: ctx.fastest_unit(pools[t]) for t in used}
    units, counts = tuple(fast[t] for t in used), tuple(recipe[t] for t in used)
    for i in range(start, len(modes)):
        mode = modes[i]
        shards = dp * cp if mode.zero else 1
        sync = optimizer_floor_s({t: recipe[t] for t in used}, shards, optimizer_s)
        if first is not None and _spread_value_s(ctx, used, fast, mb, mode, shards, cache,
                                                 recipe, kind, v, m) + sync >= bound:
            continue      # a later mode that cannot lower the bound: its memory is moot
        key = LoadKey(units, counts, mb, mode, shards, held, tuple(stage_held), tp * cp)
        got = ctx.mode_loads.get(key)
        if got is None:
            got = ctx.mode_loads[key] = _mode_load(ctx, used, fast, mb, mode, shards,
                                                   cache, held, stage_held, total_room,
                                                   recipe, tp * cp)
        if math.isinf(got.load_s):
            continue
        whole = dict(zip(used, got.whole_s, strict=True))
        load = max(got.load_s, 1.0 / sum(recipe[t] / whole[t] for t in used),
                   _chunks_floor_s(ctx, used, fast, mb, mode, shards, cache, recipe, v))
        fill = fill_bound_s(kind, v, whole, dict(zip(used, got.forward_s, strict=True)))
        trip = got.split_trip_s if schedule_kind(kind).splits_backward and v == 1 \
            else got.trip_s
        value = max((m - 1) * load + fill, trip, m * load) + sync
        if value <= cutoff_s:
            load = max(load, zero_collectives_s(ctx, kind, used, recipe, pools, tp, dp,
                                                mode) / p)
            value = max((m - 1) * load + fill, trip, m * load) + sync
        # the cut takes the first mode that fits, maybe a later one than this: where a
        # later mode holds more per device (sharded state, smaller stashes) its bound
        # may be lower, so the key's bound is the least over the modes that may fit
        first = i if first is None else first
        bound = min(bound, value)
    return None if first is None else (bound, first)


def _mode_load(ctx, used: list[str], fast: dict[str, tuple[str, ...]], mb: int,
               mode: MemoryMode, shards: int, cache, held, stage_held: list[int],
               total_room: float, recipe: dict[str, int], width: int) -> ModeLoad:
    """`key_bound`'s reading of one memory mode (`caches.ModeLoad`): `_mode_load_s`,
    the used classes' whole-model times and the least trip."""
    whole_caps = {t: layer_caps(ctx, fast[t], mb, mode, shards, cache) for t in used}
    return ModeLoad(_mode_load_s(ctx, whole_caps, fast, mb, mode, shards, cache, held,
                                 stage_held, total_room, recipe, width),
                    tuple(float(c.time_prefix_s[-1]) for c in whole_caps.values()),
                    tuple(c.forward_s for c in whole_caps.values()),
                    *(_trip_floor_s([ctx.table(fast[t], mb, mode, shards) for t in used],
                                    split) for split in (False, True)))


def _mode_load_s(ctx, whole_caps: dict[str, LayerCaps], fast: dict[str, tuple[str, ...]],
                 mb: int, mode: MemoryMode, shards: int, cache, held, stage_held: list[int],
                 total_room: float, recipe: dict[str, int], width: int) -> float:
    """`key_bound`'s bound on the busiest device's load in one memory mode (whole
    layers, memory per device); inf when the pipeline cannot hold the model in it."""
    used = list(whole_caps)
    if not _fits_in_all(ctx, whole_caps[used[0]], stage_held, total_room, width):
        return math.inf
    n = ctx.model.num_layers
    load = 0.0
    for reduced in (False, True):
        caps = whole_caps if not reduced else \
            {t: layer_caps(ctx, fast[t], mb, mode, shards, cache, True) for t in used}
        if any(c is None for c in caps.values()):
            continue
        need = n - next(iter(caps.values())).left_out
        # memory per device: each class on the positions where it holds the most
        # (every class at once), and each position holding its roomiest class's most
        room = {}
        for t, c in caps.items():
            at = np.sort(c.memory_at(held))
            room[t] = at[len(at) - recipe[t]:]
        best_each = int(np.max([c.memory_at(held) for c in caps.values()], axis=0).sum())
        if min(sum(int(r.sum()) for r in room.values()), best_each) < need:
            return math.inf
        load = max(load, _least_load_s(caps, room, need))
    return load


def _spread_value_s(ctx, used: list[str], fast: dict[str, tuple[str, ...]], mb: int,
                    mode: MemoryMode, shards: int, cache, recipe: dict[str, int], kind: str,
                    v: int, m: int) -> float:
    """`key_bound`'s value in one mode before its memory checks and whole-layer load
    (what they add only raises it): the load spread fractionally, the chunks' floor,
    the fill; no sync."""
    caps = {t: layer_caps(ctx, fast[t], mb, mode, shards, cache) for t in used}
    whole = {t: float(c.time_prefix_s[-1]) for t, c in caps.items()}
    load = max(1.0 / sum(recipe[t] / whole[t] for t in used),
               _chunks_floor_s(ctx, used, fast, mb, mode, shards, cache, recipe, v))
    fill = fill_bound_s(kind, v, whole, {t: c.forward_s for t, c in caps.items()})
    return max((m - 1) * load + fill, m * load)


def _chunks_floor_s(ctx, used: list[str], fast: dict[str, tuple[str, ...]], mb: int,
                    mode: MemoryMode, shards: int, cache, recipe: dict[str, int], v: int
                    ) -> float:
    """A floor under the busiest device's load from whole layers per device: each of a
    pipeline's devices holds v chunks of at least one layer each, so at least v layers
    (its v fastest, at best). At most `LayerCaps.left_out` devices hold one of the
    cheap layers `layer_caps(reduced=True)` leaves out, so a class with more units than
    that has a unit holding v layers of the reduced set."""
    floor = 0.0
    for t in used:
        caps = layer_caps(ctx, fast[t], mb, mode, shards, cache, True)
        if caps is None or recipe[t] <= caps.left_out:
            caps = layer_caps(ctx, fast[t], mb, mode, shards, cache)
        prefix = caps.prefix_list()
        if len(prefix) >= v:
            floor = max(floor, prefix[v - 1])
    return floor


def _fits_in_all(ctx, caps: LayerCaps, stage_held: list[int], total_room: float,
                 tp: int) -> bool:
    """Whether the pipeline's devices together (`total_room` bytes) can hold the whole
    model's state and the least stashes any cut keeps: every stage holds at least one
    layer, the one of most stashes (`stage_held`, descending) the layer of least stash,
    and so on, all other layers at the fewest stashes (rearrangement). Per-device state
    and stash times tp bound the group's from below (a tp split never shrinks them)."""
    state = float(caps.state_bytes.sum()) * tp
    stash = np.sort(caps.stash_bytes) * tp
    least = stage_held[-1]
    k = min(len(stage_held), len(stash))
    extra = float(np.dot(np.array(stage_held[:k]) - least, stash[:k]))
    return state + extra + least * float(stash.sum()) <= total_room


def fill_bound_s(kind: str, v: int, whole: dict[str, float],
                 forward: dict[str, float]) -> float:
    """A lower bound on a template's fill (`templates._finish`): the whole model's work
    on the fastest class, a v-th of it with looped chunks (their stages sum to it), its
    forward alone when the kind splits the backward, a v-th of the forward for the V
    kinds (whose fill is the busiest load, bounded apart, plus that)."""
    if schedule_kind(kind).placement == "v":
        return min(forward.values()) / v
    if v > 1:
        return min(whole.values()) / v
    if schedule_kind(kind).splits_backward:
        return min(forward.values())
    return min(whole.values())


def _least_load_s(caps: dict[str, LayerCaps], room: dict[str, np.ndarray], n: int) -> float:
    """The least B at which the units hold `n` layers, each at most its layers that fit
    in B and in its memory: the least of the B where some unit's count steps (the units
    of a class, with rooms r_j, hold sum_j min(a, r_j) for a layers in time), found per
    class by bisection (what the units hold never falls as B grows); the largest step
    when none holds them."""
    classes = []
    for t, c in caps.items():
        r = sorted(int(x) for x in room[t])
        classes.append((c.prefix_list(), r, list(itertools.accumulate(r, initial=0))))

    def holds(b: float) -> bool:
        got, scaled = 0, b * (1 + 1e-12)
        for prefix, r, cum in classes:
            a = bisect.bisect_right(prefix, scaled)
            below = bisect.bisect_left(r, a)          # rooms smaller than a
            got += cum[below] + a * (len(r) - below)
        return got >= n

    best = math.inf
    for prefix, _, _ in classes:
        lo, hi = 0, len(prefix)                       # the first step of this class held
        while lo < hi:
            mid = (lo + hi) // 2
            if holds(prefix[mid]):
                hi = mid
            else:
                lo = mid + 1
        if lo < len(prefix):
            best = min(best, prefix[lo])
    return best if math.isfinite(best) else max(p[-1] for p, _, _ in classes)


# Rings of more ranks are left out of `zero_collectives_s` (a weaker bound, still a
# bound): pricing a ring costs about n^2 (`CostModel.allreduce_time_s` over n devices),
# and on the 8,192-GPU cluster, with replicas up to 512, pricing them cost more time than
# the cuts they spared (templates 336 s without the bound, 430 s with it, uncapped).
MAX_PRICED_RANKS = 64


def zero_collectives_s(ctx, kind: str, types: list[str], recipe: dict[str, int], pools,
                       tp: int, dp: int, mode: MemoryMode) -> float:
    """A lower bound on the seconds of ZeRO-2/3 collectives one micro-batch's passes
    issue over a whole pipeline of the key (every layer's gathers and scatters of
    `sim.sharding.zero_collectives` in F and the backward, each at least the cheapest
    ring line of `zero_ring_line` over the key's classes); 0 below ZeRO-2, with
    expert parallelism (whose experts move over rings of their own), without replicas
    and over more than MAX_PRICED_RANKS."""
    ranks = dp * mode.cp
    if mode.zero < 2 or mode.ep > 1 or not 1 < ranks <= MAX_PRICED_RANKS:
        return 0.0
    layers = ctx.weighted_params
    backward = ("I", "W") if schedule_kind(kind).splits_backward else ("B",)
    lines = [zero_ring_line(ctx, t, recipe[t], pools[t], tp, dp, mode.cp) for t in types]
    latency_s = max(0.0, min(a for a, _ in lines))
    per_byte_s = max(0.0, min(b for _, b in lines))
    weight, grad = ctx.cost.param_state.weight, ctx.grad_bytes_per_param
    total = 0.0
    for op in ("F", *backward):
        gather, scatter = zero_collectives(mode.zero, mode.reshard, op)
        if not (gather or scatter):
            continue
        per_param = gather * weight + scatter * grad
        total += (gather + scatter) * len(layers) * latency_s + \
            per_byte_s * per_param * sum(layers) / tp
    return total


def zero_ring_line(ctx, cls: str, units: int, pool, tp: int, dp: int, cp: int
                   ) -> tuple[float, float]:
    """(latency in seconds, seconds per byte) at most those of the all-gather
    (`CostModel.allgather_time_s`, affine in the bytes) of every ring a stage of
    class `cls` may get in a pipeline of `units` of its units with `dp` replicas: tensor
    rank 0 of each context rank of the stage's unit in every replica, in either layout
    (`space.unit_index`, whatever the stage order), cached by what they depend on."""
    def ring_line(group: tuple[str, ...]) -> tuple[float, float]:
        one = ctx.cost.allgather_time_s(group, 1e9)
        two = ctx.cost.allgather_time_s(group, 2e9)
        return 2 * one - two, (two - one) / 1e9

    def line() -> tuple[float, float]:
        # units sit node by node, as many on every node of the class: shifting i by a
        # node's units shifts every ring member by whole nodes, the same ring pattern
        node = ctx.cluster.device(pool.units[0][0]).node
        per_node = sum(1 for u in pool.units if ctx.cluster.device(u[0]).node == node)
        found = []
        for layout in ("pipeline", "stage"):
            for i in range(min(units, per_node)):
                picks = [pool.units[space.unit_index(layout, r, i, units, dp)]
                         for r in range(dp)]
                group = tuple(u[c * tp] for u in picks for c in range(cp))
                found.append(ctx.gather_lines.memo(ctx.ring_pattern((group,)),
                                                   lambda g=group: ring_line(g)))
        return min(a for a, _ in found), min(b for _, b in found)
    return ctx.zero_rings.memo((cls, units, dp, tp, cp), line)


class ProbeRow(NamedTuple):
    """One stage's reading for `order_may_fit` (prefix sums as Python lists, bisected on
    its hot path): per-micro-batch layer time and memory kept, its per-action time, and
    its room."""

    time_prefix_s: list[float]
    use_prefix_bytes: list[float]
    actions_s: float
    room_bytes: float


def order_may_fit(ctx, kind: str, v: int, mb: int, tp: int, dp: int, order: tuple[str, ...],
                  pools, start: int, m: int, optimizer_s: dict[str, float],
                  cutoff_s: float, cp: int = 1, ep: int = 1) -> bool:
    """Whether the cut of a pipeline whose devices are of the classes `order` (one per
    device, in pipeline order) may come in at or under `cutoff_s` (a template's time) in
    some memory mode from `start` on. False only where, in every such mode, no cut of
    whole layers into its stages, each within its device's room with its stashes (as
    `partition` counts memory), keeps every stage's time within the load that
    `cutoff_s` leaves after the fill, trip and optimizer step bounds of `key_bound`.
    A relaxation of `partition`'s cut (links and all-reduces left out, each class's
    fastest unit, a device's whole room for each of its chunks, stages that may be
    empty: `_reaches`), so a pipeline it rules out could not have entered the band."""
    p = len(order)
    stages = p * v
    n = ctx.model.num_layers
    if stages > n:
        return False
    inflight = ctx.peak_inflight(kind, p, m, v)
    place = schedule_kind(kind).placement
    classes = [order[stage_rank(k, p, place)] for k in range(stages)]
    used = list(dict.fromkeys(order))
    units = {t: order.count(t) for t in used}
    fast = {t: ctx.fastest_unit(pools[t]) for t in used}
    splits = schedule_kind(kind).splits_backward
    for mode in ctx.modes(tp, dp, cp, p > 1, ep)[start:]:
        shards = dp * cp
        tables = {t: ctx.table(fast[t], mb, mode, shards) for t in used}
        sync = optimizer_floor_s(units, shards if mode.zero else 1, optimizer_s)
        fill = work_bound(ctx, used, pools, kind, v, mb, mode)[1]
        left_s = cutoff_s - sync
        if max(fill, _trip_floor_s(list(tables.values()), splits and v == 1)) > left_s:
            continue
        budget = left_s if m == 1 else min((left_s - fill) / (m - 1), left_s / m)
        rows = [ctx.probe_rows.memo((fast[t], mb, mode, shards, inflight[k], splits),
                                    lambda t=t, k=k, tb=tables[t]: _probe_row(
                                        ctx, tb, fast[t], inflight[k], splits))
                for k, t in enumerate(classes)]
        if _reaches(rows, n, budget):
            return True
    return False


def _trip_floor_s(tables: list, split: bool) -> float:
    """A lower bound on one micro-batch's whole trip (its F and backward through every
    stage; with a `split` backward its F and I, `Partition.trip_s`) over stages whose
    `partition.LayerTables` are among `tables`: each layer at its least
    (`LayerTables.trip_layer_s`) on the table where that is least."""
    return float(np.min([t.trip_layer_s(split) for t in tables], axis=0).sum())


def work_bound(ctx, types, pools, kind: str, v: int, mb: int, mode: MemoryMode
               ) -> tuple[dict[str, float], float]:
    """Per class of `types`, its fastest unit's least time of the whole model in `mode`
    (forward and backward, `LayerTables.least_whole_s`), and the fill's lower bound
    (`fill_bound_s`)."""
    work = {t: ctx.table(ctx.fastest_unit(pools[t]), mb, mode) for t in types}
    # (times only: the table's memory is not read here)
    whole = {t: w.least_whole_s() for t, w in work.items()}
    forward = {t: float(w.fwd_s[-1]) for t, w in work.items()}
    return whole, fill_bound_s(kind, v, whole, forward)


def optimizer_floor_s(units: dict[str, int], shards: int, optimizer_s: dict[str, float]
                      ) -> float:
    """The least optimizer step of a pipeline of `units` per class (its state sharded
    `shards` ways; 0 where a class's step is unknown): the whole model's step spread
    over its units at their rates."""
    if not all(optimizer_s[t] for t in units):
        return 0.0
    return 1.0 / sum(k * shards / optimizer_s[t] for t, k in units.items())


def _probe_row(ctx, table, unit: tuple[str, ...], inflight: int, splits: bool) -> ProbeRow:
    """A stage of `unit`'s `table` holding `inflight` stashes, as `_row_cut` prices it
    (`splits`: whether the kind splits the backward)."""
    split = table.splits(splits)
    return ProbeRow(table.stage_prefix_s(split).tolist(),
                    (table.state_bytes + inflight * table.stash_bytes).tolist(),
                    table.actions.per_microbatch_s(split),
                    ctx.cluster.device(unit[0]).type.free_bytes - table.work_bytes)


def _reaches(rows: list[ProbeRow], n: int, budget_s: float) -> bool:
    """Whether stages `rows`, in order, each of at most `budget_s` of time and within its
    room, can hold all `n` layers when a stage may also hold none (a relaxation of the
    cut, whose stages hold one layer at least). Exact for that relaxation: each stage
    takes all it may (greedily), since the last layer a stage may reach never falls as
    its first one moves on, so reaching further never hurts the stages after it."""
    at = 0
    slack = budget_s * 1e-9 + 1e-15
    for row in rows:
        prefix, use = row.time_prefix_s, row.use_prefix_bytes
        if budget_s - row.actions_s + slack < 0:
            continue                                  # it can hold nothing
        at = max(at, min(bisect.bisect_right(prefix, prefix[at] + budget_s - row.actions_s
                                             + slack),
                         bisect.bisect_right(use, use[at] + row.room_bytes)) - 1)
        if at >= n:
            return True
    return at >= n
