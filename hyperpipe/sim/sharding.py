"""ZeRO-2/3 (FSDP) and context parallelism: the time they add to a stage's actions, and
who shards with whom. Both tiers (the simulator's programs and the analytic tier) price
them here, through the cost model, so they agree. Times in seconds, sizes in bytes.

**Sharding group.** A stage's parameters, gradients and optimizer state are sharded over
its data-parallel group: tensor rank 0 (every tensor rank alike, on its own ports) of
every context rank of every replica holding the stage's first layer. Context ranks shard
with the replicas, as Megatron-LM's distributed optimizer shards over its
data-parallel-with-context-parallel group (megatron/core/parallel_state.py
`get_data_parallel_group(with_context_parallel=True)`) and torchtitan's FSDP over its
``dp_shard_cp`` mesh (torchtitan/models/llama3/infra/parallelize.py, `apply_fsdp`).

**ZeRO-2** (DeepSpeed, deepspeed/runtime/zero/stage_1_and_2.py: gradients reduced in
buckets from backward hooks on every micro-step, each rank keeping its partition; the
updated weights all-gathered after the step): each backward (B, or W when split)
reduce-scatters every layer's gradient as it is produced, overlapped with the next
layer's backward; the weights' all-gather after the step is the data-parallel segment
(`CostModel.dp_sync_bytes_per_param`).

**ZeRO-3 / FSDP2** (torch `fully_shard` on each transformer block, torchtitan's
`apply_fsdp`; DeepSpeed deepspeed/runtime/zero/stage3.py with its prefetch
coordinator): a unit is one layer. With `reshard_after_forward` every forward gathers
each unit's weights, the next unit's gather prefetched while the current one computes
(FSDP2's implicit forward prefetch, explicit backward prefetch of one unit); every
backward gathers them again (B or I) and reduce-scatters each unit's gradient after it
(B or W) on the same stream, overlapped with the next unit (`overlapped_pass_s`).
Without it (torchtitan's default with pipelining, "to avoid per-microbatch
all-gathers"): each stage's first forward of the step gathers its units, and the
gradients are reduce-scattered once, in the step's data-parallel segment.

**Context parallelism** (ring attention: Megatron-LM megatron/core/transformer/
dot_product_attention with TransformerEngine's `AttnFuncWithCPAndKVP2P`,
transformer_engine/pytorch/attention.py; torchtitan's `context_parallel` over torch's
ring attention, torch/distributed/tensor/experimental/_attention.py): each context rank
holds 2 chunks of s/(2 cp) tokens (causal load balancing); each of its cp ring steps
computes its queries against one rank's keys while it sends the keys and values it holds
to the next rank and receives the previous rank's, so cp - 1 exchanges each overlap one
step's attention: a block's F is exposed (cp - 1) max(0, kv - step) beyond its compute
(`ring_exposed_s`); its backward moves keys, values and their gradients (twice the
bytes). Compute itself is 1/cp of the layer's (`CostModel.layer_time_s`).

Left out: these gathers, scatters and exchanges run on idle links (their times come from
the cost model's collectives), not as flows sharing hops with point-to-point sends and
the data-parallel segments.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperpipe.models.ops import attention_gemms
from hyperpipe.plan.plan import Plan, StagePlan
from hyperpipe.sim.compute import gemm_time_s
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.replicas import stage_holding


def pipelined(plan: Plan) -> bool:
    """Whether some pipeline of `plan` has more than one rank (torchtitan's
    `pp_enabled`)."""
    return any(len(p.stages) // plan.chunks > 1 for p in plan.pipelines)


def reshard_after_forward(plan: Plan) -> bool:
    """The plan's `runtime.reshard_after_forward`, or torchtitan's default policy: off
    when the plan pipelines, on otherwise (`Runtime.reshard_after_forward`)."""
    given = plan.runtime_settings().reshard_after_forward
    return (not pipelined(plan)) if given is None else given


def dp_shards(plan: Plan, stage: StagePlan) -> int:
    """Ranks a stage's optimizer state is split over: the replicas times its context
    ranks with ZeRO 1 and up; 1 without."""
    return len(plan.pipelines) * stage.cp if plan.zero >= 1 else 1


def shard_group(plan: Plan, q: int, k: int) -> tuple[str, ...]:
    """Tensor rank 0 of every context rank of every replica holding the first layer of
    stage k of pipeline q: the devices its ZeRO-2/3 collectives run among."""
    first = plan.pipelines[q].stages[k].layers[0]
    out: list[str] = []
    for pipe in plan.pipelines:
        st = pipe.stages[stage_holding(pipe.stages, first)]
        out += [st.devices[c * st.tp] for c in range(st.cp)]
    return tuple(out)


def overlapped_pass_s(compute_s: Sequence[float], gather_s: Sequence[float],
                      scatter_s: Sequence[float]) -> float:
    """Makespan of one pass over units in order, unit i computing `compute_s[i]` after
    its weights' gather (`gather_s[i]`) and reduce-scattering its gradient
    (`scatter_s[i]`) after it. Two streams: compute, and one communication stream that
    serves in issue order: gather 0 at the start, gather i + 1 when unit i starts
    (prefetch of one unit), scatter i when unit i ends. The pass ends when both streams
    are done. Uniform units with g + r <= t take g + n t + r; communication-bound ones
    n (g + r) + about t."""
    n = len(compute_s)
    if n == 0:
        return 0.0
    comm = ready = float(gather_s[0])
    now = 0.0
    for i in range(n):
        start = max(now, ready)
        if i + 1 < n:
            comm = max(comm, start) + gather_s[i + 1]
            ready = comm
        now = start + compute_s[i]
        comm = max(comm, now) + scatter_s[i]
    return max(now, comm)


def fsdp_extra_s(cost: CostModel, plan: Plan, q: int, k: int, op: str, *,
                 first_forward: bool = False, reshard: bool | None = None,
                 grad_bytes_per_param: float | None = None) -> float:
    """Seconds ZeRO-2/3 adds to one `op` of stage k of pipeline q (see the module doc);
    `first_forward`: the stage's first forward of the step (where ZeRO-3 without
    resharding gathers). 0 for ZeRO 0/1 and for a group of one."""
    zero = plan.zero
    if zero < 2:
        return 0.0
    reshard = reshard_after_forward(plan) if reshard is None else reshard
    gather = zero == 3 and ((op == "F" and (reshard or first_forward))
                            or (op in ("B", "I") and reshard))
    scatter = op in ("B", "W") and (zero == 2 or reshard)
    if not (gather or scatter):
        return 0.0
    group = shard_group(plan, q, k)
    if len(group) <= 1:
        return 0.0
    if grad_bytes_per_param is None:
        grad_bytes_per_param = plan.runtime_settings().grad_bytes_per_param(
            cost.grad_bytes_per_param)
    st = plan.pipelines[q].stages[k]
    key = ("fsdp", st, group, op, plan.pipelines[q].micro_batch, gather, scatter,
           grad_bytes_per_param)
    table = cost.memo("sharding", dict)
    if key not in table:
        table[key] = _fsdp_extra_s(cost, st, group, op, plan.pipelines[q].micro_batch,
                                   gather, scatter, grad_bytes_per_param)
    return table[key]


def _fsdp_extra_s(cost: CostModel, st: StagePlan, group: tuple[str, ...], op: str,
                  mb: int, gather: bool, scatter: bool, grad_bytes: float) -> float:
    units = list(range(*st.layers))
    if op != "F":
        units.reverse()                      # the backward meets the layers last first
    weight = cost.model.dtype_bytes
    compute, gathers, scatters = [], [], []
    for i in units:
        compute.append(cost.stage_time_s((i, i + 1), st.devices, mb, op, st.recompute,
                                         st.sequence_parallel, st.cp))
        params = cost.model.layers[i].params / st.tp
        gathers.append(cost.allgather_time_s(group, params * weight) if gather else 0.0)
        scatters.append(cost.allgather_time_s(group, params * grad_bytes) if scatter
                        else 0.0)
    return overlapped_pass_s(compute, gathers, scatters) - sum(compute)


def ring_exposed_s(steps: int, exchange_s: float, step_s: float) -> float:
    """Seconds a ring of `steps` + 1 attention steps adds beyond its compute when each
    of its `steps` exchanges (`exchange_s` each) overlaps one step's attention
    (`step_s`): steps x max(0, exchange - step)."""
    return steps * max(0.0, exchange_s - step_s)


def ring_attention_extra_s(cost: CostModel, stage: StagePlan, micro_batch: int,
                           op: str) -> float:
    """Seconds context parallelism's ring exchange adds to `op` of a stage (0 with
    cp 1, for W, and for layers without attention shapes). F sends each block's keys and
    values, b (s/cp) 2 h_kv / tp elements per device and step; B and I send them and
    their gradients (twice the bytes), and with full recompute also redo F's ring."""
    cp = stage.cp
    if cp == 1 or op == "W":
        return 0.0
    key = ("ring", stage, micro_batch, op)
    table = cost.memo("sharding", dict)
    if key not in table:
        passes = ["I"] if op in ("B", "I") else ["F"]
        if op in ("B", "I") and stage.recompute == "full":
            passes.append("F")
        total = 0.0
        for i in range(*stage.layers):
            layer = cost.model.layers[i]
            config = getattr(layer, "config", None)
            if layer.kind != "block" or config is None:
                continue
            for p in passes:
                total += ring_exposed_s(cp - 1, _exchange_s(cost, stage, micro_batch, p),
                                        _step_s(cost, stage, micro_batch, p))
        table[key] = total
    return table[key]


def ring_edges(stage: StagePlan) -> list[tuple[str, str]]:
    """Each device's send of one ring step: tensor rank t of context rank c to tensor
    rank t of context rank c + 1 (mod cp), all at once."""
    tp, cp = stage.tp, stage.cp
    return [(stage.devices[c * tp + t], stage.devices[(c + 1) % cp * tp + t])
            for c in range(cp) for t in range(tp)]


def ring_step_bytes(cost: CostModel, stage: StagePlan, micro_batch: int, op: str) -> float:
    """Bytes one device sends in one ring step of a block's `op` ("F", or "I" for the
    backward): the keys and values of its s/cp tokens and of its tensor rank's K/V
    heads; twice that in the backward (their gradients too)."""
    config = _block_config(cost)
    kv = micro_batch * cost.model.seq_len / stage.cp * 2 * config.kv_dim / stage.tp * \
        cost.model.dtype_bytes
    return kv if op == "F" else 2 * kv


def _block_config(cost: CostModel):
    """The GPT config of the model's blocks (only shaped blocks get here)."""
    return next(layer.config for layer in cost.model.layers
                if layer.kind == "block" and getattr(layer, "config", None) is not None)


def _exchange_s(cost: CostModel, stage: StagePlan, micro_batch: int, op: str) -> float:
    return cost.exchange_time_s(ring_edges(stage),
                                ring_step_bytes(cost, stage, micro_batch, op))


def _step_s(cost: CostModel, stage: StagePlan, micro_batch: int, op: str) -> float:
    """One ring step's attention on one device: the attention core's GEMMs
    (`models.ops.attention_gemms`) for one of the cp steps, at the device's GEMM curve,
    or its FLOPs at the flat roofline; stretched by the group's slowdown."""
    config = _block_config(cost)
    dev = cost.cluster.device(stage.devices[0]).type
    gemms = attention_gemms(config, op, micro_batch, cost.model.seq_len, stage.tp, stage.cp)
    model = cost.model
    if dev.gemm is not None:
        t = sum(gemm_time_s(dev, g.m, g.n, g.k, g.batch / stage.cp, model.dtype_bytes,
                            model.dtype) for g in gemms)
    else:
        t = sum(g.flops for g in gemms) / stage.cp / dev.achievable_flops_for(model.dtype)
    return t * cost.cluster.slowdown(stage.devices)


__all__ = ["dp_shards", "fsdp_extra_s", "overlapped_pass_s", "pipelined",
           "reshard_after_forward", "ring_attention_extra_s", "ring_edges",
           "ring_exposed_s", "ring_step_bytes", "shard_group"]
