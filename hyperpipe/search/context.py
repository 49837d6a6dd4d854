"""What every search phase shares: the search context (cost model, constraints and one
typed cache per kind of entry, from `caches`), the phase counters and the objective.
Times in seconds, memory in bytes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from hyperpipe.cluster.cluster import link_sig
from hyperpipe.plan.kinds import schedule_kind
from hyperpipe.plan.plan import tp_misfit
from hyperpipe.plan.stack import resolve_runtime
from hyperpipe.search import partition as P
from hyperpipe.search import space
from hyperpipe.search.caches import (
    BookKey,
    Cache,
    CapsKey,
    CutKey,
    InflightKey,
    LayersOn,
    LinkKey,
    LoadKey,
    MatrixKey,
    ModeLoad,
    PeerCaches,
    Placement,
    PositionKey,
    ReplicaKey,
    RingCost,
    RowCut,
    RowKey,
    SketchKey,
    StageKey,
    StageShape,
    StateStash,
    TableKey,
    TimesKey,
    TotalKey,
    UnitKey,
)
from hyperpipe.search.space import MemoryMode, SearchConstraints
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.sharding import FsdpCost


def v_peak_inflight(p: int, m: int) -> tuple[int, ...]:
    """Per stage of a V kind (zb-v, dualpipe-v: 2p stages, stage k on rank k for k < p
    and on rank 2p - 1 - k after), the most stashes it holds: min(2p - k, m). Stage k
    starts 2p - k forwards before its first backward; checked against the generators'
    IR for p <= 8 and every m <= 4p + 2 (tests/search/test_search.py). A closed form
    because reading it off the IR costs O(p^2) actions per (p, m)."""
    return tuple(min(2 * p - k, m) for k in range(2 * p))


def _portable():
    """A cache `SearchContext.carry_from` may carry to a search of another cluster: its
    keys name, by cost-relevant numbers or by devices and classes that cluster has
    alike, everything its entries depend on (not the unit pools, which shrink with it)."""
    return field(default_factory=Cache, metadata={"portable": True})


@dataclass(frozen=True)
class SearchContext:
    """Everything a phase needs, with its caches (passed explicitly; no module state).
    The caches made by `_portable` carry over to a search of a cluster with some of
    this one's nodes (`carry_from`)."""

    cost: CostModel
    c: SearchConstraints
    times_s: Cache[TimesKey, tuple[np.ndarray, np.ndarray]] = _portable()
    actions_s: Cache[TimesKey, tuple[np.ndarray | None, np.ndarray, P.ActionTimes]] = \
        _portable()
    tables: Cache[TableKey, P.LayerTables] = _portable()
    links: Cache[LinkKey, np.ndarray] = _portable()
    link_keys: Cache[tuple[str, str, int], LinkKey] = _portable()
    # (ZeRO stage, reshard) -> `CostModel.dp_sync_bytes_per_param` on the search's stack
    sync_bytes: Cache[tuple[int, bool], float] = _portable()
    inflight: Cache[InflightKey, tuple[int, ...]] = _portable()
    book: Cache[BookKey, list] = field(default_factory=Cache)     # of `templates.Template`
    matrices: Cache[MatrixKey, np.ndarray] = _portable()
    stage_costs: Cache[StageKey, P.StageCost] = _portable()
    cuts: Cache[CutKey, tuple[int, ...] | None] = _portable()
    rings: Cache[tuple, RingCost] = _portable()      # by `ring_pattern`
    row_cuts: Cache[RowKey, RowCut | None] = _portable()
    placed_rings: Cache[Placement, list] = field(default_factory=Cache)  # per device slot
    # the gradient ring of one row position across the replicas (`templates._sync_s`)
    position_rings: Cache[PositionKey, RingCost] = field(default_factory=Cache)
    # seconds of the tied embedding's all-reduce between two row positions
    # (`templates._tie_s`)
    tie_times: Cache[tuple[PositionKey, PositionKey], float] = field(default_factory=Cache)
    unit_signs: Cache[tuple[str, ...], tuple] = _portable()
    layer_caps: Cache[CapsKey, Any] = _portable()    # `bounds.LayerCaps`
    mode_loads: Cache[LoadKey, ModeLoad] = _portable()   # `bounds.key_bound`
    probe_rows: Cache[tuple, Any] = _portable()   # `bounds.order_may_fit`
    totals: Cache[TotalKey, StateStash] = field(default_factory=Cache)
    device_bounds_s: Cache[StageShape, float] = field(default_factory=Cache)
    stage_ops: Cache[StageShape, dict[str, float]] = field(default_factory=Cache)
    baseline_replicas: Cache[ReplicaKey, dict | None] = field(default_factory=Cache)
    baseline_stage_s: Cache[LayersOn, float] = field(default_factory=Cache)
    sketches: Cache[SketchKey, tuple | None] = field(default_factory=Cache)
    # (kind, pp, micro-batches, chunks) -> `analytic.held_micro_batches`
    baseline_held: Cache[tuple, list[int]] = field(default_factory=Cache)
    peers: PeerCaches = field(default_factory=PeerCaches)
    unit_pools: Cache[tuple[int, int], dict] = field(default_factory=Cache)  # (tp, cp)
    fast_units: Cache[UnitKey, tuple[str, ...]] = field(default_factory=Cache)
    group_patterns: Cache[PositionKey, tuple] = field(default_factory=Cache)
    table_keys: Cache[tuple, TableKey] = field(default_factory=Cache)   # `table_key`
    memories: Cache[tuple, P.LayerTables] = _portable()  # `table_of`
    # (stage times key, layers, ring pattern, op, first forward) -> what ZeRO-2/3 adds
    zero_extras: Cache[tuple, FsdpCost] = _portable()
    # (class, units per pipeline, replicas, tp, cp) -> `bounds.zero_ring_line`
    zero_rings: Cache[tuple, tuple[float, float]] = field(default_factory=Cache)
    # `ring_pattern` of one all-gather group -> its (latency s, s per byte)
    gather_lines: Cache[tuple, tuple[float, float]] = _portable()
    # (unit, cp, ep) -> `ep_exchange`
    exchanges: Cache[tuple, tuple[tuple, tuple]] = field(default_factory=Cache)
    # (tp, more than one ZeRO rank, cp, pipelined, ep) -> `modes`
    mode_ladders: Cache[tuple, tuple[MemoryMode, ...]] = _portable()

    def carry_from(self, other: SearchContext) -> bool:
        """Take `other`'s portable caches (`_portable`) when they hold here: the same
        model, profile and constraints, a model without MoE blocks (an expert group
        depends on its class's units, not named in the keys), the same device types and
        inter-node link, every node here one of `other`'s alike (its MTBF aside), and
        every device class here, by name, of the same kind there. With them, the kept
        templates (`book`) of every type group whose classes have the same nodes here:
        a group's templates depend on its classes' units alone. Whether it took them;
        the results are those of a search without them."""
        mine, theirs = self.cost, other.cost
        if (mine.model, mine.profile, self.c) != (theirs.model, theirs.profile, other.c) \
                or any(layer.kind == "moe" for layer in mine.model.layers):
            return False
        new, old = self.cluster, other.cluster
        if (new.device_types, new.inter_node, new.links) != \
                (old.device_types, old.inter_node, old.links):
            return False
        if any(not old.has_node(n.name) or replace(old.node(n.name), mtbf_s=None) !=
               replace(n, mtbf_s=None) for n in new.nodes):
            return False
        if any(name not in other.classes or
               space.class_key(old, old.node(other.classes[name].nodes[0])) !=
               space.class_key(new, new.node(cls.nodes[0]))
               for name, cls in self.classes.items()):
            return False
        for f in fields(self):
            if f.metadata.get("portable"):
                getattr(self, f.name).update(getattr(other, f.name))
        same = {name for name, cls in self.classes.items() if other.classes.get(name) == cls}
        self.book.update((key, list(kept)) for key, kept in other.book.items()
                         if same.issuperset(key.types))
        return True

    @cached_property
    def classes(self) -> dict[str, space.DeviceClass]:
        """The cluster's device classes (`space.device_classes`), by name, sorted by
        name: the search walks them in this order, whatever the cluster's node order."""
        return dict(sorted(space.device_classes(self.cluster).items()))

    def pools(self, tp: int, cp: int = 1) -> dict[str, space.UnitPool]:
        """Per device class, its units of `tp` x `cp` devices (`space.unit_pools`)."""
        return self.unit_pools.memo((tp, cp), lambda: space.unit_pools(
            self.cluster, tp, self.classes, cp))

    def type_of(self, class_name: str):
        """The `DeviceType` of a device class."""
        return self.cluster.device_types[self.classes[class_name].type_name]

    def fastest_unit(self, pool: space.UnitPool) -> tuple[str, ...]:
        """The unit of `pool` with the least slowdown (the first on ties): bounds use it."""
        return self.fast_units.memo(UnitKey(pool.type_name, pool.tp, pool.cp), lambda: min(
            pool.units, key=self.cluster.slowdown))

    @cached_property
    def class_of_node(self) -> dict[str, str]:
        """Node name -> the name of its device class."""
        return {nd: cls.name for cls in self.classes.values() for nd in cls.nodes}

    def _unit_sign(self, unit: tuple[str, ...]) -> tuple:
        """(class, slowdown, node) of a unit (a tp group inside one node); the node's name
        is part of what it costs only under a profile (per-node intra-node links)."""
        if unit not in self.unit_signs:
            node = self.cluster.device(unit[0]).node
            self.unit_signs[unit] = (self.class_of_node[node], self.cluster.slowdown(unit),
                                     node)
        return self.unit_signs[unit]

    def row_signature(self, row) -> tuple:
        """What a pipeline's cut depends on in its row of units: each unit's class and
        slowdown, and which neighbours (the last to the first included, for looped and
        V placements) share a node. Units of one class on nodes of one class are alike
        to the cost model (`space.device_classes`), so rows of equal signatures cut
        alike; under a calibration profile the nodes themselves count."""
        signs = [self._unit_sign(u) for u in row]
        nodes = [sg[2] for sg in signs]
        same = tuple(a == b for a, b in zip(nodes, nodes[1:] + nodes[:1], strict=True))
        units = tuple((sg[0], sg[1]) for sg in signs)
        if self.cost.profile is not None:
            return (units, same, tuple(nodes))
        return (units, same)

    @property
    def inputs(self) -> tuple:
        """(model, cluster, profile, constraints): what a worker process needs to make
        this context again (`worker_context`)."""
        return (self.cost.model, self.cost.cluster, self.cost.profile, self.c)

    def ring_pattern(self, groups: tuple[tuple[str, ...], ...]) -> tuple:
        """A key for an all-reduce over `groups` under which rings that cost the same
        meet: group by group (the tp group's size sets the rings), each device as
        `CostModel.ring_pattern` of all their devices at once places it (its node's
        kind, its node numbered in order of first appearance, its NIC numbered in
        order of first appearance on the node); under a
        calibration profile (links fitted per node) the groups themselves."""
        if self.cost.profile is not None:
            return groups
        flat = self.cost.ring_pattern(tuple(d for g in groups for d in g))
        starts = list(itertools.accumulate((len(g) for g in groups), initial=0))
        return tuple(flat[a:b] for a, b in itertools.pairwise(starts))

    def inflight_key(self, kind: str, p: int, m: int, v: int) -> InflightKey:
        """The key of `peak_inflight`: m itself for the kinds with a closed form (GPipe's
        counts grow with m without end), m's class for those read off the IR
        (`partition.peak_inflight` caps m where their counts stop growing)."""
        kind_of = schedule_kind(kind)
        exact = kind_of.closed_form or kind_of.placement == "v" or m <= 3 * p
        return InflightKey(kind, p, m if exact else 2 * p + m % p, v)

    @cached_property
    def runtime(self):
        """The `plan.stack.Runtime` the plans of this search run with (stack and
        overrides of the constraints)."""
        return resolve_runtime(self.c.stack, self.c.runtime)

    @cached_property
    def grad_bytes_per_param(self) -> float:
        """Bytes per gradient element its data-parallel collectives move."""
        return self.runtime.grad_bytes_per_param(self.cost.grad_bytes_per_param)

    @cached_property
    def tie_bytes_per_param(self) -> float:
        """Bytes per element of the tied embedding's first-last gradient all-reduce."""
        return self.runtime.tied_grad_bytes_per_param(self.cost.grad_bytes_per_param)

    @cached_property
    def weighted_params(self) -> tuple[int, ...]:
        """Parameters of each layer of the model that has any, in layer order."""
        return tuple(n for layer in self.model.layers if (n := layer.params) > 0)

    @cached_property
    def refs(self) -> tuple:
        """(model, cluster) as plans name them (built-in name or inline document)."""
        from hyperpipe.cluster.cluster import cluster_ref
        from hyperpipe.models import model_ref
        return (model_ref(self.model), cluster_ref(self.cluster))

    @property
    def model(self):
        return self.cost.model

    @property
    def cluster(self):
        return self.cost.cluster

    def table_key(self, group: tuple[str, ...], mb: int, mode: MemoryMode | None = None,
                  shards: int = 1) -> TableKey:
        """The key of `table` (`group`: tp x `mode.cp` devices): times do not depend on
        the ZeRO stage nor its shards (nor memory on them at all with ZeRO 0), memory
        not on the device type."""
        mode = mode or MemoryMode()
        return self.table_keys.memo((group, mb, mode, shards),
                                    lambda: self._table_key(group, mb, mode, shards))

    def _table_key(self, group: tuple[str, ...], mb: int, mode: MemoryMode,
                   shards: int) -> TableKey:
        dev = self.cluster.device(group[0])
        node = self.cluster.node(dev.node)
        tp = len(group) // mode.cp
        nodes = list(dict.fromkeys(self.cluster.device(d).node for d in group)) \
            if mode.cp > 1 else [dev.node]
        # a ring over several nodes: its exchanges cross their NICs and region paths
        span_links = tuple((link_sig(n.nic), link_sig(n.nics),
                            self.cluster.linked_region(n.name))
                           for n in map(self.cluster.node, nodes)) if len(nodes) > 1 else ()
        ep_nodes = self.ep_exchange(group, mode.cp, mode.ep)[0] if mode.ep > 1 else ()
        times = TimesKey(dev.type.name, self.cluster.slowdown(group),
                         link_sig(node.intra_link) if len(group) > 1 else None,
                         tp, mb, mode.recompute, mode.sequence_parallel, mode.cp, len(nodes),
                         span_links, mode.ep, ep_nodes)
        if not mode.zero:
            return TableKey(times, 1)
        return TableKey(times, shards, mode.zero, mode.reshard if mode.zero == 3 else True)

    def table_of(self, key: TableKey, group: tuple[str, ...]) -> P.LayerTables:
        """The layer tables under `key` (`group`: any tp group it stands for)."""
        if key not in self.tables:
            t = key.times
            edges = self.ep_exchange(group, t.cp, t.ep)[1] if t.ep > 1 else ()
            times = self.times_s.memo(t, lambda: P.layer_times(
                self.cost, group, t.micro_batch, t.recompute, t.sequence_parallel, t.cp,
                t.ep, edges, self.runtime.moe_dispatcher))
            # memory does not depend on the device type nor its speed: one per kind of
            # stage and sharding, whatever the times
            mem = self.memories.memo(
                (t.tp, t.micro_batch, t.recompute, t.sequence_parallel, t.cp, t.ep,
                 key.shards, key.zero, key.reshard),
                lambda: P.layer_memory(self.cost, t.tp, t.micro_batch, *times, t.recompute,
                                       t.sequence_parallel, key.shards, zero=key.zero,
                                       cp=t.cp, reshard=key.reshard, ep=t.ep,
                                       keeps_outputs=self.runtime.keeps_stage_outputs))
            split, wgt, actions = self.actions_s.memo(t, lambda: P.action_times(
                self.cost, group, t.micro_batch, t.recompute, t.sequence_parallel, t.cp))
            self.tables[key] = replace(mem, fwd_s=times[0], bwd_s=times[1], split_s=split,
                                       actions=actions, wgt_s=wgt)
        return self.tables[key]

    def ep_exchange(self, unit: tuple[str, ...], cp: int, ep: int
                    ) -> tuple[tuple, tuple[tuple[str, str], ...]]:
        """(signature, edges) of the all-to-all of a stage whose replica-0 unit is
        `unit` (tp x `cp` devices) with expert-parallel degree `ep`, as the templates
        place it (`space.layouts`: the replicas of a stage on consecutive units of the
        unit's class): its group is the ep first members (replica outer, context rank
        inner, `sim.experts.ep_groups`) from `unit` on, and every group on the nodes that
        group touches exchanges at the same time, sharing their NICs. `edges`: every
        (sender, receiver) of those groups, every tensor rank; `signature`: what the
        exchange's time depends on besides the tables' key (the class, the nodes the
        group spans, the groups sharing them)."""
        key = (unit, cp, ep)
        if key not in self.exchanges:
            cls = self.class_of_node[self.cluster.device(unit[0]).node]
            tp = len(unit) // cp
            units = self.pools(tp, cp)[cls].units
            start = units.index(unit) if unit in units else 0
            per_group = max(1, ep // cp)
            first = units[start:start + per_group]
            nodes = {self.cluster.device(d).node for u in first for d in u}
            near = [u for u in units[start:]
                    if all(self.cluster.device(d).node in nodes for d in u)]
            near = near[:max(per_group, len(near) // per_group * per_group)]
            members = [u[c * tp:(c + 1) * tp] for u in near for c in range(cp)]
            groups = [members[g:g + ep] for g in range(0, len(members) - ep + 1, ep)]
            edges = tuple((a[t], b[t]) for grp in groups for t in range(tp)
                          for a in grp for b in grp if a != b)
            self.exchanges[key] = ((cls, len(nodes), len(groups)), edges)
        return self.exchanges[key]

    def table(self, group: tuple[str, ...], mb: int, mode: MemoryMode | None = None,
              shards: int = 1) -> P.LayerTables:
        return self.table_of(self.table_key(group, mb, mode, shards), group)

    def modes(self, tp: int, dp: int, cp: int = 1, pipelined: bool = True, ep: int = 1
              ) -> tuple[MemoryMode, ...]:
        """`space.memory_modes` for this model (selective recompute only helps eager
        attention: a flash kernel keeps no scores); ZeRO-3 reshards as the plan will
        (`reshard`: the runtime's `reshard_after_forward`, else torchtitan's policy: only
        without pipelining, `sim.sharding.reshard_after_forward`)."""
        # the replicas count only through whether ZeRO has more than one rank to shard
        # over (`space.zero_options`)
        key = (tp, dp * cp > 1, cp, pipelined, ep)
        ladder = self.mode_ladders.get(key)
        if ladder is None:
            cfg = self.model.config
            helps = cfg is not None and cfg.attention == "eager"
            given = self.runtime.reshard_after_forward
            reshard = (not pipelined) if given is None else given
            splits = tp_misfit(self.model, tp, True, cp) is None
            ladder = self.mode_ladders[key] = space.memory_modes(self.c, tp, dp, helps, cp,
                                                                 reshard, ep, splits)
        return ladder

    def link_key(self, src: str, dst: str, mb: int) -> LinkKey:
        """Routes cost only by their link class; a calibration profile measures
        intra-node links per node, so then per node."""
        return self.link_keys.memo((src, dst, mb), lambda: self._link_key(src, dst, mb))

    def _link_key(self, src: str, dst: str, mb: int) -> LinkKey:
        if src == dst:          # two chunks on one device (V kinds): no transfer at all
            return LinkKey(None, mb)
        a, b = self.cluster.device(src), self.cluster.device(dst)
        na, nb = self.cluster.node(a.node), self.cluster.node(b.node)
        same = a.node == b.node
        # a NIC's bandwidth is its node's `nics` figure; which card a device uses does
        # not change a transfer's idle-link time (every card of a node is alike); a
        # wide-area path between the two nodes' regions is part of the route
        inter = (*map(link_sig, (na.nic, na.nics, nb.nic, nb.nics)),
                 link_sig(self.cluster.region_link(a.node, b.node)))
        if self.cost.profile is not None:
            return LinkKey((a.node,) if same else ("inter", *inter), mb)
        return LinkKey((link_sig(na.intra_link),) if same else inter, mb)

    def link_of(self, key: LinkKey, src: str, dst: str) -> np.ndarray:
        """Per layer cut, the link cost under `key` (`src`, `dst`: a route it stands for)."""
        links = self.links
        if key not in links:
            links[key] = P.link_costs(self.cost, src, dst, key.micro_batch)
        return links[key]

    def link(self, src: str, dst: str, mb: int) -> np.ndarray:
        return self.link_of(self.link_key(src, dst, mb), src, dst)

    def stage_cost(self, key: StageKey, table: P.LayerTables, slot: P.Slot,
                   link: np.ndarray | None) -> P.StageCost:
        """`partition.stage_matrix` of one stage (`table`, `link`: those under `key`'s);
        the same stage recurs across replica counts and stage orders."""
        if key not in self.stage_costs:
            times = self.matrices.memo(MatrixKey(key.table.times, key.link, key.split),
                                       lambda: P.time_matrix(table, link, key.split))
            self.stage_costs[key] = P.stage_matrix(table, slot, times)
        return self.stage_costs[key]

    def peak_inflight(self, kind: str, p: int, m: int, v: int) -> tuple[int, ...]:
        """Per stage, the micro-batches it stashes at the peak: the kind's closed form
        (`ScheduleKind.peak_in_flight`, per rank, as the simulator's memory model uses it,
        spread over the rank's v chunks) where it has one, `v_peak_inflight` for the V
        kinds, else read off the schedule IR."""
        key = self.inflight_key(kind, p, m, v)
        if key not in self.inflight:
            kind_of = schedule_kind(kind)
            if kind_of.placement == "v":
                self.inflight[key] = v_peak_inflight(p, m)
            elif kind_of.closed_form:
                per_rank = [kind_of.peak_in_flight(p, m, v, r) for r in range(p)]
                self.inflight[key] = tuple(-(-per_rank[k % p] // v) for k in range(p * v))
            else:
                self.inflight[key] = P.peak_inflight(kind, p, m, v)
        return self.inflight[key]


class PhaseCounts(NamedTuple):
    """Candidates a piece of a phase saw, pruned and found infeasible."""

    seen: int
    pruned: int
    infeasible: int


@dataclass
class PhaseStats:
    name: str
    seen: int = 0
    pruned: int = 0
    infeasible: int = 0
    seconds: float = 0.0

    def counts(self) -> PhaseCounts:
        return PhaseCounts(self.seen, self.pruned, self.infeasible)

    def add(self, counts: PhaseCounts) -> None:
        """Count what a piece of this phase (done elsewhere: a worker) counted."""
        self.seen += counts.seen
        self.pruned += counts.pruned
        self.infeasible += counts.infeasible

    def as_dict(self) -> dict:
        return {"name": self.name, "seen": self.seen, "pruned": self.pruned,
                "infeasible": self.infeasible, "seconds": round(self.seconds, 4)}


def objective_value(ctx: SearchContext, time_s: float, price_per_hour: float) -> float:
    if ctx.c.objective == "cost":
        return price_per_hour * time_s if not math.isnan(price_per_hour) else math.inf
    return time_s


def objective_time_s(ctx: SearchContext, value: float, price_per_hour: float) -> float:
    """The iteration time whose `objective_value` is `value` at `price_per_hour` (inf
    where the price cannot tell)."""
    if ctx.c.objective == "cost":
        ok = price_per_hour > 0 and math.isfinite(price_per_hour)
        return value / price_per_hour if ok else math.inf
    return value


# A worker process's context of its last task: the tasks of one search (its templates,
# the templates to combine, the estimates) find its tables warm. Caches only: no result
# depends on whether a task found it.
_last_context: list[SearchContext] = []


def worker_context(model, cluster, profile, constraints) -> SearchContext:
    """A search context for these inputs (`SearchContext.inputs`) in a worker process:
    its last task's when the inputs are equal, else a new one (which replaces it) with
    the last one's portable caches where they hold (`SearchContext.carry_from`: a pool
    kept for a search of the cluster less some nodes, as `whatif --failures` keeps it)."""
    if _last_context and _last_context[0].inputs == (model, cluster, profile, constraints):
        return _last_context[0]
    ctx = SearchContext(CostModel(model, cluster, profile), constraints)
    if _last_context:
        ctx.carry_from(_last_context[0])
    _last_context[:] = [ctx]
    return ctx
