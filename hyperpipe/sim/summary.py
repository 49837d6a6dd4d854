"""The human summary of one simulation: the text `hyperpipe simulate` prints."""

from __future__ import annotations

from hyperpipe.core.units import format_quantity, format_seconds
from hyperpipe.plan.plan import Plan
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimResult


def describe(result: SimResult, plan: Plan, cost: CostModel) -> str:
    """A short human summary of a simulation (the `hyperpipe simulate` text output)."""
    m, cluster = result.metrics, cost.cluster
    lines = [
        f"model {cost.model.name} on cluster {cluster.name}: {len(plan.devices)} devices, "
        f"{_shape(plan)}",
        f"iteration   {format_seconds(m.iteration_time_s)}   "
        f"{_rate(m.throughput_samples_per_s)} samples/s   {_rate(m.tokens_per_s)} tokens/s",
        f"bubble      {m.bubble_fraction:.1%} of device time idle   MFU {m.mfu:.1%}",
    ]
    top = m.extra["bottleneck"]
    lines.append(f"bottleneck  pipeline {top['pipeline']} rank {top['rank']} ({top['device']}, "
                 f"{top['device_type']}), stages {top['stages']}, busy "
                 f"{format_seconds(top['busy_s'])}")
    ph = m.extra["phases"]
    reduce = f"data-parallel all-reduce ends {format_seconds(ph['dp_allreduce_end_s'])}" \
        if ph["dp_allreduce_end_s"] > 0 else "no data-parallel all-reduce"
    if ph.get("tied_allreduce_end_s", 0.0) > 0:
        reduce += (f", tied embedding's all-reduce ends "
                   f"{format_seconds(ph['tied_allreduce_end_s'])}")
    lines.append(f"phases      pipeline {format_seconds(ph['pipeline_s'])}, {reduce}, "
                 f"optimizer {format_seconds(ph['optimizer_s'])}")
    dev = max(m.peak_memory_bytes, key=m.peak_memory_bytes.get)
    cap = cluster.device(dev).type.memory_bytes
    peak_b, cap_b = _apart(m.peak_memory_bytes[dev], cap)
    lines.append(f"memory      peak {peak_b} on {dev} (of {cap_b})")
    if m.oom:
        worst = max(m.extra["oom_detail"], key=lambda d: d["bytes_over"])
        lines.append(f"OUT OF MEMORY on {len(m.oom)} device(s): worst {worst['device']} "
                     f"(stages {worst['stages']}) by {format_quantity(worst['bytes_over'], 'B')}")
    if m.refused is not None:
        lines.append(f"REFUSED by its stack: {m.refused}")
    if m.cost_per_million_tokens is not None:
        lines.append(f"cost        ${m.cost_per_million_tokens:.4g} per million tokens")
    return "\n".join(lines) + "\n"


def _shape(plan: Plan) -> str:
    """'N pipeline(s) x S stage device(s)[ x V chunks], SCHEDULE, global batch G
    (micro-batch b x m)'; replicas of different shapes (stage count, micro-batching) are
    listed one group each, in plan order: '2 pipeline(s): 1 x 2 stage device(s) (micro-
    batch 2 x 16), 1 x 4 stage device(s) (micro-batch 2 x 8), 1f1b, global batch 48'."""
    groups: dict[tuple[int, int, int], int] = {}
    for pipe in plan.pipelines:
        key = (len(pipe.stages) // plan.chunks, pipe.micro_batch, pipe.num_microbatches)
        groups[key] = groups.get(key, 0) + 1
    chunks = f" x {plan.chunks} chunks" if plan.chunks > 1 else ""
    tail = f"{plan.schedule}, global batch {plan.global_batch}"
    if len(groups) == 1:
        (stages, mb, m), n = next(iter(groups.items()))
        return (f"{n} pipeline(s) x {stages} stage device(s){chunks}, {tail} "
                f"(micro-batch {mb} x {m})")
    parts = ", ".join(f"{n} x {stages} stage device(s){chunks} (micro-batch {mb} x {m})"
                      for (stages, mb, m), n in groups.items())
    return f"{len(plan.pipelines)} pipeline(s): {parts}, {tail}"


def _rate(per_s: float) -> str:
    """A rate without an exponent: whole numbers with separators from 1,000 up."""
    return f"{per_s:,.0f}" if per_s >= 1000 else f"{per_s:.4g}"


def _apart(a_bytes: float, b_bytes: float) -> tuple[str, str]:
    """Two byte counts in short form, or in bytes where the short forms of two different
    counts read alike (a peak just over its device's memory)."""
    a, b = format_quantity(a_bytes, "B"), format_quantity(b_bytes, "B")
    if a == b and a_bytes != b_bytes:
        return f"{a_bytes:,.0f} B", f"{b_bytes:,.0f} B"
    return a, b
