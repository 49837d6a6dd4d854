"""Metrics of one training iteration, with the command line's JSON keys (SI units), and
`summarize`, which both tiers (simulated and analytic) use to make them from an
iteration time and what each pipeline rank used."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from operator import attrgetter
from typing import Any

from hyperpipe.cluster.catalog import DeviceType
from hyperpipe.cluster.cluster import Cluster
from hyperpipe.plan.plan import Plan
from hyperpipe.sim.analytic_cache import AnalyticCache, cache_for
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.memory import oom_detail

# A figure improves on another only by more than this fraction of it: the analytic
# tier and the simulator sum the same terms in an order that follows the cluster file's
# node order, so one plan's figure can differ in its last bits between two listings of
# one cluster (or between a schedule kind and its own order written out), and a strict
# comparison would let that noise pick a winner.
IMPROVEMENT_REL = 1e-9


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
    refused: str | None = None     # why its stack cannot run it (`Plan.stack_refusal`)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("cost_per_million_tokens", "refused"):
            if out[key] is None:
                del out[key]
        return out

    @property
    def feasible(self) -> bool:
        """It fits in memory and its stack can run it."""
        return not self.oom and self.refused is None


@dataclass(frozen=True)
class RankUse:
    """What one pipeline rank used in an iteration, for every device it stands for
    (its tensor-parallel group, in every replica with the same timing)."""

    devices: tuple[str, ...]
    device_type: DeviceType
    stages: tuple[int, ...]
    peak_bytes: float
    busy_s: float                  # compute time per device (F, B, I, W)


def summarize(plan: Plan, cost: CostModel, iteration_s: float, ranks: list[RankUse],
              extra: dict, cache: AnalyticCache | None = None) -> Metrics:
    """The metrics from an iteration time and per-rank usage (`cache`: see `cache_for`)."""
    cache = cache_for(cost, cache)
    t = iteration_s
    throughput = plan.global_batch / t if t > 0 else 0.0
    model_flops = _plan_flops(plan, cost, cache)
    n_dev = busy = peak_flops = 0.0
    peaks: dict[str, float] = {}
    oom: list[str] = []
    detail: list[dict] = []
    for r in ranks:
        n = len(r.devices)
        n_dev += n
        busy += r.busy_s * n
        peak_flops += r.device_type.peak_flops * n
        peaks.update(dict.fromkeys(r.devices, r.peak_bytes))
        if r.peak_bytes > r.device_type.memory_bytes:
            oom += r.devices
            detail.append(oom_detail(r.devices, r.stages, r.peak_bytes,
                                     r.device_type.memory_bytes))
    if detail:
        extra = {**extra, "oom_detail": detail}
    price = _price_per_s(cost.cluster, ranks, cache)
    tokens_per_s = throughput * cost.model.seq_len
    return Metrics(
        iteration_time_s=t,
        throughput_samples_per_s=throughput,
        tokens_per_s=tokens_per_s,
        bubble_fraction=1.0 - busy / (t * n_dev) if t > 0 and n_dev else 0.0,
        mfu=model_flops / (t * peak_flops) if t > 0 and peak_flops else 0.0,
        peak_memory_bytes=peaks, oom=oom,
        cost_per_million_tokens=price / tokens_per_s * 1e6
        if price is not None and tokens_per_s > 0 else None,
        extra=extra, refused=plan.stack_refusal(cost.model))


_MB, _M = attrgetter("micro_batch"), attrgetter("num_microbatches")


def _plan_flops(plan: Plan, cost: CostModel, cache: AnalyticCache) -> float:
    """F + I + W FLOPs of every micro-batch of the plan (what MFU counts)."""
    sizes = set(map(_MB, plan.pipelines))
    if len(sizes) == 1:                  # one micro-batch size: no loop over pipelines
        return sum(map(_M, plan.pipelines)) * _model_flops(cost, sizes.pop(), cache)
    return sum(p.num_microbatches * _model_flops(cost, p.micro_batch, cache)
               for p in plan.pipelines)


def _model_flops(cost: CostModel, micro_batch: int, cache: AnalyticCache) -> float:
    """F + I + W FLOPs of the whole model for one micro-batch."""
    flops = cache.model_flops.get(micro_batch)
    if flops is None:
        flops = cache.model_flops[micro_batch] = sum(
            cost.op_flops(i, micro_batch, op)
            for i in range(cost.model.num_layers) for op in "FIW")
    return flops


def _price_per_s(cluster: Cluster, ranks: list[RankUse], cache: AnalyticCache
                 ) -> float | None:
    """USD per second of every used device, or None if one has no price."""
    prices = cache.prices_per_hour
    total = 0.0
    for r in ranks:
        price = prices.get(r.devices)
        if price is None:
            each = [cluster.price_per_hour(dev) for dev in r.devices]
            if None in each:
                return None
            price = prices[r.devices] = sum(each)
        total += price
    return total / 3600.0
