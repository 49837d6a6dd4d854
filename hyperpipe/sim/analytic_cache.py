"""Look-ups the analytic tier derives from one cost model, kept between plans.

An `AnalyticCache` serves one cost model at a time: `AnalyticCache.of(cost)` is the cost
model's own (it lives as long as the cost model does); a caller that keeps its own
passes it to `estimate`, which empties it first when it was filled for another cost
model (`bind`). Each table holds the results of one pure look-up, keyed by the values
that result depends on (never by object identity). Times in seconds, sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import NamedTuple

import numpy as np

from hyperpipe.cluster.catalog import DeviceType
from hyperpipe.sim.costmodel import CostModel

Layers = tuple[int, int]                       # a half-open layer range
Devices = tuple[str, ...]
# What a stage's memory depends on besides the micro-batch: (layers, tp, recompute,
# sequence parallelism).
StageShape = tuple[Layers, int, str, bool]


class StageBytes(NamedTuple):
    """A stage's bytes per device for one micro-batch."""

    stash_bytes: float             # kept for backward, per in-flight micro-batch
    send_bytes: float              # sent on to the next stage


class LinkCost(NamedTuple):
    """The activations x -> y and the gradients y -> x between two stages."""

    fwd_s: float                   # idle-link time of the activations
    bwd_s: float                   # idle-link time of the gradients
    fwd_busy: tuple[tuple[str, float], ...]   # (hop, seconds busy) the activations cross
    bwd_busy: tuple[tuple[str, float], ...]   # ... and the gradients

    @property
    def busy(self) -> tuple[tuple[str, float], ...]:
        """(hop, seconds busy) of every hop they cross, both ways."""
        return self.fwd_busy + self.bwd_busy


class RingCost(NamedTuple):
    """A bucket's all-reduce on a set of rings at once (`network.ring_spec`)."""

    time_s: float                  # on otherwise idle hops
    latency_s: float               # paid after the bytes
    hops: np.ndarray               # the hops it crosses (`AnalyticCache.hop_numbers`)
    busy_s: np.ndarray             # seconds each of them is busy with it


@dataclass(eq=False)
class AnalyticCache:
    cost: CostModel | None = None                  # the cost model the tables are for
    device_types: dict[str, DeviceType] = field(default_factory=dict)
    # device -> its type's name, with "@x<slowdown>" for a straggler (a class of its own)
    class_names: dict[str, str] = field(default_factory=dict)
    # micro-batch -> F + I + W FLOPs of the whole model
    model_flops: dict[int, float] = field(default_factory=dict)
    # a rank's devices -> their summed price (USD per hour)
    prices_per_hour: dict[Devices, float] = field(default_factory=dict)
    stage_bytes: dict[tuple[StageShape, int], StageBytes] = field(default_factory=dict)
    # (stage shapes of a rank, device type name, micro-batch, optimizer shards) -> bytes
    static_bytes: dict[tuple[tuple[StageShape, ...], str, int, int], float] = \
        field(default_factory=dict)
    # (sender's devices, receiver's devices, bytes) -> both ways
    links: dict[tuple[Devices, Devices, float], LinkCost] = field(default_factory=dict)
    # (layers, device type name, tp, optimizer shards) -> seconds, before slowdown
    optimizer_s: dict[tuple[Layers, str, int, int], float] = field(default_factory=dict)
    params: dict[Layers, float] = field(default_factory=dict)
    # Rings of groups of one tp: (every group's devices in a row, tp, bucket bytes)
    even_rings: dict[tuple[Devices, int, float], RingCost] = field(default_factory=dict)
    # Rings of groups of mixed tp: (the groups, bucket bytes)
    mixed_rings: dict[tuple[tuple[Devices, ...], float], RingCost] = \
        field(default_factory=dict)
    hop_numbers: dict[str, int] = field(default_factory=dict)   # hop -> its number
    # hop number -> its rank among the numbered hops' names (`hop_rank`)
    hop_ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @staticmethod
    def of(cost: CostModel) -> AnalyticCache:
        """The cost model's own cache."""
        cache = cost.memo("analytic", AnalyticCache)
        cache.bind(cost)
        return cache

    def bind(self, cost: CostModel) -> None:
        """Serve `cost` from now on: every table emptied unless it already does."""
        if self.cost is cost:
            return
        for f in fields(self):
            if f.name not in ("cost", "hop_ranks"):
                getattr(self, f.name).clear()
        self.hop_ranks = np.zeros(0, dtype=np.int64)
        self.cost = cost

    def hop_rank(self, numbers: np.ndarray) -> np.ndarray:
        """Hop numbers (`hop_numbers`, given at first sight) as their hops' ranks in the
        order of their names: one fixed order of any set of hops, whatever plans were
        priced first."""
        if len(self.hop_ranks) != len(self.hop_numbers):
            names = sorted(self.hop_numbers, key=str)
            ranks = np.empty(len(names), dtype=np.int64)
            for rank, name in enumerate(names):
                ranks[self.hop_numbers[name]] = rank
            self.hop_ranks = ranks
        return self.hop_ranks[numbers]

    def entries(self) -> int:
        """How many look-ups the tables hold."""
        return sum(len(getattr(self, f.name)) for f in fields(self)
                   if f.name not in ("cost", "hop_ranks"))


def cache_for(cost: CostModel, cache: AnalyticCache | None) -> AnalyticCache:
    """`cache` bound to `cost` (emptied if it served another); None: the cost model's own."""
    if cache is None:
        return AnalyticCache.of(cost)
    cache.bind(cost)
    return cache
