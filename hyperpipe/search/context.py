"""What every search phase shares: the search context (cost model, constraints and the
caches of layer tables, link costs, in-flight counts and stage matrices), the phase
counters and the objective.

Kept apart from `templates` (phase 1), which builds on it, as do the later phases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hyperpipe.plan.generators import placement_of
from hyperpipe.search import partition as P
from hyperpipe.search import space
from hyperpipe.search.space import MemoryMode, SearchConstraints
from hyperpipe.sim.costmodel import CostModel

CLOSED_FORM_KINDS = frozenset({"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"})


def v_peak_inflight(p: int, m: int) -> tuple[int, ...]:
    """Per stage of a V kind (zb-v, dualpipe-v: 2p stages, stage k on rank k for k < p
    and on rank 2p - 1 - k after), the most stashes it holds: min(2p - k, m). Stage k
    starts 2p - k forwards before its first backward; counted off the generators' IR
    for p <= 8 and every m <= 4p + 2 (tests/test_search.py). A closed form because
    reading it off the IR costs O(p^2) actions per (p, m): most of the search's time
    at 1024 devices."""
    return tuple(min(2 * p - k, m) for k in range(2 * p))


@dataclass(frozen=True)
class SearchContext:
    """Everything a phase needs, with caches (passed explicitly; no module state)."""

    cost: CostModel
    c: SearchConstraints
    tables: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)
    inflight: dict = field(default_factory=dict)
    splits: dict = field(default_factory=dict)
    book: dict = field(default_factory=dict)      # (types, config or None) -> templates
    matrices: dict = field(default_factory=dict)
    memo: dict = field(default_factory=dict)

    @property
    def refs(self) -> tuple:
        """(model, cluster) as plans name them (built-in name or inline document)."""
        if "refs" not in self.memo:
            from hyperpipe.cluster.cluster import cluster_ref
            from hyperpipe.models import model_ref
            self.memo["refs"] = (model_ref(self.model), cluster_ref(self.cluster))
        return self.memo["refs"]

    @property
    def model(self):
        return self.cost.model

    @property
    def cluster(self):
        return self.cost.cluster

    def table(self, group: tuple[str, ...], mb: int, mode: MemoryMode | None = None,
              shards: int = 1) -> P.LayerTables:
        mode = mode or MemoryMode()
        dev = self.cluster.device(group[0])
        node = self.cluster.node(dev.node)
        # identical devices are interchangeable: one table per (type, intra link, tp);
        # times do not depend on the optimizer's shards, memory not on the device type
        shards = shards if mode.distributed_optimizer else 1
        tkey = (dev.type.name, node.intra_link if len(group) > 1 else None, len(group), mb,
                mode.recompute, mode.sequence_parallel)
        key = (*tkey, shards)
        if key not in self.tables:
            if tkey not in self.tables:
                self.tables[tkey] = P.layer_times(self.cost, group, mb, mode.recompute,
                                                  mode.sequence_parallel)
            self.tables[key] = P.layer_memory(self.cost, len(group), mb, *self.tables[tkey],
                                              mode.recompute, mode.sequence_parallel, shards)
        return self.tables[key]

    def modes(self, tp: int, dp: int) -> tuple[MemoryMode, ...]:
        """`space.memory_modes` for this model (selective recompute only helps eager
        attention: a flash kernel keeps no scores)."""
        cfg = self.model.config
        helps = cfg is not None and cfg.attention == "eager"
        return space.memory_modes(self.c, tp, dp, helps)

    def link(self, src: str, dst: str, mb: int) -> np.ndarray:
        a, b = self.cluster.device(src), self.cluster.device(dst)
        na, nb = self.cluster.node(a.node), self.cluster.node(b.node)
        # routes cost only by their link class: one entry per (intra link) or (two NICs);
        # a calibration profile measures intra-node links per node, so then per node
        same = a.node == b.node
        if src == dst:          # two chunks on one device (V kinds): no transfer at all
            key = (None, mb)
        elif self.cost.profile is not None:
            key = ((a.node,) if same else ("inter", na.nic, nb.nic), mb)
        else:
            key = ((na.intra_link,) if same else (na.nic, nb.nic), mb)
        if key not in self.links:
            self.links[key] = P.link_costs(self.cost, src, dst, mb)
        return self.links[key]

    def times(self, table: P.LayerTables, link: np.ndarray | None) -> np.ndarray:
        """The stage-time matrix of a (table, link) pair; both are cached objects."""
        key = (id(table.fwd_s), id(table.bwd_s), None if link is None else id(link))
        if key not in self.matrices:
            self.matrices[key] = P.time_matrix(table, link)
        return self.matrices[key]

    def stage_cost(self, key: tuple, table: P.LayerTables, slot: P.Slot,
                   link: np.ndarray | None) -> P.StageCost:
        """`partition.stage_matrix` of one stage, cached under `key` (its table, stashes,
        room and link): the same stage recurs across replica counts and stage orders."""
        memo = self.memo.setdefault("stage_cost", {})
        if key not in memo:
            memo[key] = P.stage_matrix(table, slot, self.times(table, link))
        return memo[key]

    def peak_inflight(self, kind: str, p: int, m: int, v: int) -> tuple[int, ...]:
        """Per stage, the micro-batches it stashes at the peak: the closed forms the
        simulator's memory model uses (`memory.peak_in_flight`, per rank, spread over
        the rank's v chunks) for the kinds it knows, `v_peak_inflight` for the V kinds,
        else read off the schedule IR."""
        from hyperpipe.sim.memory import peak_in_flight
        key = (kind, p, m if m <= 3 * p else 2 * p + m % p, v)
        if key not in self.inflight:
            if placement_of(kind) == "v":
                self.inflight[key] = v_peak_inflight(p, m)
            elif kind in CLOSED_FORM_KINDS:
                per_rank = [peak_in_flight(kind, p, m, v, r) for r in range(p)]
                self.inflight[key] = tuple(-(-per_rank[k % p] // v) for k in range(p * v))
            else:
                self.inflight[key] = P.peak_inflight(kind, p, m, v)
        return self.inflight[key]

    def splits_backward(self, kind: str) -> bool:
        """Kinds that run I and W apart (zero bubble) fill the pipeline with forwards only."""
        if kind not in self.splits:
            from hyperpipe.plan.generators import generate
            v = 2 if space.takes_chunks(kind) else 1
            sched = generate(kind, 2, 2, v)
            self.splits[kind] = any(a.op == "W" for row in sched.actions for a in row)
        return self.splits[kind]


@dataclass
class PhaseStats:
    name: str
    seen: int = 0
    pruned: int = 0
    infeasible: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"name": self.name, "seen": self.seen, "pruned": self.pruned,
                "infeasible": self.infeasible, "seconds": round(self.seconds, 4)}


def objective_value(ctx: SearchContext, time_s: float, price_per_hour: float) -> float:
    if ctx.c.objective == "cost":
        return price_per_hour * time_s if not math.isnan(price_per_hour) else math.inf
    return time_s
