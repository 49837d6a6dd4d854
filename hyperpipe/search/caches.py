"""The search's typed caches: `Cache`, a memo of one kind of entry, and the named key
records its entries are found under (layer tables, links, stage costs, cuts, in-flight
counts, templates, rings, the baselines' and the peer planners' tables).

A key names everything its entry depends on, so an entry is a pure function of its key
and filling a cache in any order gives the same results; nothing is keyed by object
identity. Times in seconds, memory in bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Cache(dict[K, V], Generic[K, V]):
    """One kind of memoised entry, keyed by one record type: a dict (lookups at dict
    speed on the search's hot path) with `memo(key, make)`, the entry under `key`, made
    by `make()` the first time."""

    __slots__ = ()

    def memo(self, key: K, make: Callable[[], V]) -> V:
        if key not in self:
            self[key] = make()
        return self[key]


class TimesKey(NamedTuple):
    """What a stage's per-layer times depend on: identical devices are interchangeable,
    so one table per (device type, slowdown, intra link, tp, micro-batch, memory mode)."""

    device_type: str
    slowdown: float            # the tp group's slowest member's (`Cluster.slowdown`)
    intra_link: Any            # `link_sig` of the node's intra link when tp > 1, else None
    tp: int
    micro_batch: int
    recompute: str
    sequence_parallel: bool
    cp: int = 1                # context ranks (the group is tp x cp devices)
    span_nodes: int = 1        # nodes the group spans (its ring exchange's links)
    span_links: tuple = ()     # with span_nodes > 1, per node in ring order its NIC's and
                               # NICs' `link_sig` and its `Cluster.linked_region`
    ep: int = 1                # expert-parallel degree
    ep_nodes: tuple = ()       # (class, devices per node) of the all-to-all's ranks


class TableKey(NamedTuple):
    """A `LayerTables`: its times, and what its memory depends on besides: the ZeRO
    stage, its shards (the data-parallel group) and whether ZeRO-3 reshards."""

    times: TimesKey
    shards: int
    zero: int = 0
    reshard: bool = True


class LinkKey(NamedTuple):
    """A link's cost depends only on its class: None (two chunks on one device), (intra
    link,) or (NIC, NICs, NIC, NICs) (each end's link and its cards); per node, or
    ("inter", ...) with the same, under a profile."""

    route: tuple | None
    micro_batch: int


class MatrixKey(NamedTuple):
    times: TimesKey
    link: LinkKey | None
    split: bool = False          # the backward as I and W (`LayerTables.splits`)


class StageKey(NamedTuple):
    """All a stage's cut cost depends on: its table, stashes, room and the link after."""

    table: TableKey
    inflight: int
    capacity_bytes: float
    link: LinkKey | None
    split: bool = False          # the backward as I and W (`LayerTables.splits`)


class CutKey(NamedTuple):
    """All a cut depends on: its stages' keys and each stage's device in the pipeline
    (`partition.balance_devices` evens out devices that hold several stages)."""

    stages: tuple[StageKey, ...]
    homes: tuple[int, ...]


class InflightKey(NamedTuple):
    kind: str
    p: int
    m_class: int              # m, or a smaller m with the same in-flight counts
    v: int


class BookKey(NamedTuple):
    """The kept templates of a type group: over all configs (None) or at one."""

    types: tuple[str, ...]
    config: tuple[str, int, int] | None


class TotalKey(NamedTuple):
    recompute: str
    shards: int
    micro_batch: int
    zero: int = 0
    cp: int = 1
    reshard: bool = True
    ep: int = 1


class StateStash(NamedTuple):
    """The whole model's state and one micro-batch's stash of every layer."""

    state_bytes: float
    stash_bytes: float


class RingCost(NamedTuple):
    """An all-reduce over a set of groups, affine in the bytes: time at 1 GB, per GB."""

    at_1gb_s: float
    per_gb_s: float


class StageShape(NamedTuple):
    """A stage as the cost model prices it (`synthesis.busiest_device_bound_s`)."""

    layers: tuple[int, int]
    devices: tuple[str, ...]
    micro_batch: int
    recompute: str
    sequence_parallel: bool
    cp: int = 1


class CapsKey(NamedTuple):
    """A unit's layer capacities (`bounds.LayerCaps`): what its table is looked up by
    (`SearchContext.table_key`'s arguments), and whether a few cheap layers are left
    out. The bounds ask for a class's fastest unit only, so keying by the unit itself
    shares nearly as much as keying by its table, and costs no table-key lookup."""

    unit: tuple[str, ...]
    micro_batch: int
    mode: Any                      # `space.MemoryMode`
    shards: int
    reduced: bool


class LoadKey(NamedTuple):
    """What `bounds.key_bound` reads of one memory mode: the busiest device's load bound
    and the classes' whole-model times depend on each used class's fastest unit and its
    units per pipeline, the micro-batch, the mode and its shards, and the stashes the
    pipeline's devices and stages hold (`bounds.device_inflight`, stage counts)."""

    units: tuple[tuple[str, ...], ...]     # each used class's fastest unit
    recipe: tuple[int, ...]                # its units per pipeline, in the same order
    micro_batch: int
    mode: Any                              # `space.MemoryMode`
    shards: int
    held: tuple[tuple[int, int], ...]      # per device: (least in flight, extra)
    stage_held: tuple[int, ...]            # per stage in flight, descending
    width: int                             # devices per unit (tp x cp)


class ModeLoad(NamedTuple):
    """`LoadKey`'s entry: the load bound (inf: the model does not fit in the mode), per
    used class a unit's least time (`LayerTables.least_layer_s`) and forward time of
    the whole model, and the least time of one micro-batch's whole trip (each layer on
    the class where its least time is least), under a whole and a split backward."""

    load_s: float
    whole_s: tuple[float, ...]
    forward_s: tuple[float, ...]
    trip_s: float
    split_trip_s: float


class RowKey(NamedTuple):
    """All one pipeline's cut depends on (`templates._row_cut`): its config, its stages'
    in-flight counts (`SearchContext.peak_inflight`: the cut reads m only through
    them), tp, whether it has replicas, the first memory mode, the optimizer's shards
    (with the distributed optimizer) and its row's `SearchContext.row_signature`."""

    kind: str
    v: int
    micro_batch: int
    inflight: tuple[int, ...]
    tp: int
    replicated: bool
    start: int
    shards: int
    row: tuple
    cp: int = 1
    reshard: bool = True
    ep: int = 1


class RowCut(NamedTuple):
    """A row's cut: the memory mode it fits in and the partition."""

    mode: Any                 # space.MemoryMode
    part: Any                 # partition.Partition


class Placement(NamedTuple):
    """What fixes which units a template's replicas take (`templates._assign`)."""

    tp: int
    dp: int
    layout: str
    order: tuple[str, ...]
    recipe: tuple[tuple[str, int], ...]
    cp: int = 1


class PositionKey(NamedTuple):
    """Which units the replicas of a template hold at one row position: `_assign` takes
    the `index`-th unit of `device_class` (of `per_replica` in each replica) from the
    class's pool of `tp` x `cp` units by `layout` over `dp` replicas, so the units, and
    the rings and groups across the replicas there, depend on nothing else."""

    device_class: str
    tp: int
    cp: int
    dp: int
    layout: str
    index: int
    per_replica: int


class UnitKey(NamedTuple):
    """The units of `tp` x `cp` devices of one device class (`space.unit_pools`)."""

    device_class: str
    tp: int
    cp: int = 1


class ReplicaKey(NamedTuple):
    subset: tuple[str, ...]
    pp: int
    dp: int
    tp: int


class SketchKey(NamedTuple):
    """A tuned baseline's grid point as its sketch sees it (`baselines.sketch`): kinds
    that place their chunks alike build the same stages."""

    name: str
    subset: tuple[str, ...]
    pp: int
    dp: int
    tp: int
    micro_batch: int
    placement: str
    chunks: int
    ep: int = 1


class LayersOn(NamedTuple):
    """Layers [a, b) on one kind of tp group at one micro-batch: the group's size and
    its (device type, slowdown, tensor-parallel link), all that its stage time depends
    on (`baselines._replicas`)."""

    layers: tuple[int, int]
    group_kind: tuple
    micro_batch: int


class PeerTableKey(NamedTuple):
    """A peer planner's table: shared by groups of one device type, slowdown, size and
    link."""

    device_type: str
    slowdown: float
    tp: int
    intra_link: Any
    micro_batch: int


@dataclass(frozen=True)
class PeerCaches:
    """The peer planners' (Metis, AMP) tables (`peers.common.GroupTable`, which builds
    on this module) per table class and micro-batch, each group's class, and Metis's
    per-stage layer capacities."""

    type_tables: Cache[PeerTableKey, Any] = field(default_factory=Cache)
    classes: Cache[tuple[str, ...], tuple] = field(default_factory=Cache)  # `group_class`
    # per table, the layers it holds by in-flight count (`metis._capacities`)
    capacity: Cache[PeerTableKey, Any] = field(default_factory=Cache)
