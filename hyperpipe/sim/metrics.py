"""Metrics of one training iteration, with DESIGN.md's JSON keys (SI units)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Metrics:
    iteration_time_s: float
    throughput_samples_per_s: float
    tokens_per_s: float
    bubble_fraction: float           # idle share of the devices' time inside the iteration
    mfu: float                       # model FLOPs / (iteration time x sum of device peaks)
    peak_memory_bytes: dict[str, float] = field(default_factory=dict)   # device -> bytes
    oom: list[str] = field(default_factory=list)                        # devices over memory
    cost_per_million_tokens: float | None = None   # USD, when the cluster has prices
    extra: dict[str, Any] = field(default_factory=dict)  # breakdowns (bottleneck, phases...)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["cost_per_million_tokens"] is None:
            del out["cost_per_million_tokens"]
        return out

    @property
    def feasible(self) -> bool:
        return not self.oom
