"""The records every what-if study shares: how each cluster is planned (`Planning`), one
variant to search (`VariantTask`, a backend task: plain, picklable data), its outcome
(`Row`) and a sweep's result (`WhatIfResult`, with its JSON form). Times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hyperpipe.cluster.cluster import Cluster
from hyperpipe.models import ModelSpec
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.stack import DEFAULT_STACK
from hyperpipe.search.evaluate import Candidate
from hyperpipe.search.search import SearchConstraints


@dataclass(frozen=True)
class Planning:
    """How each cluster of a what-if is planned: the batch, what the search may not
    choose, its objective and processes, and today's plan when the user has one."""

    global_batch: int
    micro_batch: int | None = None          # None: the search picks
    schedule: str | None = None             # None: the search picks
    objective: str = "throughput"           # or "cost"
    workers: int = 1                        # processes per search (local backend)
    plan: Plan | None = None                # today's plan, kept against re-planning
    stack: str = DEFAULT_STACK              # the stack every plan runs on
    ep: int | None = None                   # expert-parallel degree (None: the search's)

    def constraints(self) -> SearchConstraints:
        return SearchConstraints(global_batch=self.global_batch, micro_batch=self.micro_batch,
                                 schedule=self.schedule, objective=self.objective,
                                 stack=self.stack, ep=self.ep)


@dataclass(frozen=True)
class VariantTask:
    """One variant to search (a backend task: plain, picklable data)."""

    settings: tuple[tuple[str, str], ...]
    model: ModelSpec
    cluster: Cluster | None             # None: every node removed
    constraints: SearchConstraints
    profile: Any
    workers: int
    keep: Plan | None                   # today's plan, to simulate on the variant too
    quiet: bool = False                 # no progress bars of the search's own


@dataclass(frozen=True)
class Row:
    """The outcome of one variant."""

    settings: tuple[tuple[str, str], ...]     # (key, value) per varied parameter
    devices: int
    best: Candidate | None
    uniform: Candidate | None
    error: str | None = None                  # what is short, when nothing fits
    description: str = ""
    kept: Candidate | None = None             # today's plan simulated on this variant
    kept_is_answer: bool = False              # the search's pick was slower: best = kept
    unused_from: str | None = None            # best is this other variant's plan, whose
                                              # devices it holds (added_devices)

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.settings)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"settings": dict(self.settings), "devices": self.devices}
        if self.best is not None:
            out["best"] = self.best.to_dict()
        if self.uniform is not None:
            out["uniform"] = self.uniform.to_dict()
        if self.error is not None:
            out["error"] = self.error
        if self.unused_from is not None:
            out["unused_from"] = self.unused_from
        if self.kept is not None:
            out["kept"] = self.kept.to_dict()
            out["kept_is_answer"] = self.kept_is_answer
            if self.best is not None and self.kept.metrics.feasible:
                out["replan_gain"] = self.kept.metrics.iteration_time_s / \
                    self.best.metrics.iteration_time_s - 1
        return out


@dataclass(frozen=True)
class WhatIfResult:
    model: str
    cluster: str
    rows: list[Row]
    pareto: list[int] = field(default_factory=list)    # rows on the (tokens/s, cost) front
    kind: str = "sweep"          # "stragglers": rows carry today's plan kept as well

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "cluster": self.cluster, "kind": self.kind,
                "rows": [r.to_dict() for r in self.rows], "pareto_rows": self.pareto}
