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
all-gathers"; Llama 3's FSDP, arXiv 2407.21783 sec. 3.3): a stage's weights are
gathered once a step and held, and the gradients are reduce-scattered once, in the
step's data-parallel segment. Where the gathers start (`first_forwards`): a rank
holding several stages issues them all at the step's start, in the order of their
first forwards (torch's multi-stage runtime unshards the next stages it will run ahead
of their actions, torch/distributed/pipelining/schedules.py `_add_unshard_reshard`), so
a stage's first forward waits only for what of its gather is not done; a rank of one
stage gathers in its first forward (FSDP2's pre-forward hooks under torch's
single-stage schedules), layer by layer with the next layer prefetched. Left out:
torch's runtime keeps at most 3 stages unsharded (evicting the others, re-gathered
ahead of their next use): memory counts every stage of a rank unsharded, and the
re-gathers are taken as hidden.
Under expert parallelism an MoE block's routed experts are a unit of their own, sharded
over the expert-data-parallel mesh (torchtitan `fully_shard(transformer_block.moe.
experts, mesh=dp_mod_ep_mesh)`, torchtitan/models/llama4/infra/parallelize.py
`apply_fsdp`; Megatron-Core's distributed optimizer shards expert parameters over
`get_expert_data_parallel_group()`, megatron/core/parallel_state.py): a rank gathers
and reduce-scatters only the experts it holds, 1/ep of them, over its dp·cp / ep ranks
(`experts.expert_dp_rings`), the rest of the block over the whole group.

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

**Uneven sharding** (plan `runtime.shard` "memory" or "speed": Cephalo's and
HexiScale's heterogeneous FSDP): each rank of a data-parallel group holds a share of what
ZeRO shards in proportion to its device's memory or peak FLOP/s (`shard_fractions`):
its state and optimizer step divide by 1 / share instead of n (`dp_shards`), and a
gather or scatter takes n x the largest share times the even one (`uneven_factor`).

Left out: these gathers, scatters and exchanges run on idle links (their times come from
the cost model's collectives), not as flows sharing hops with point-to-point sends and
the data-parallel segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hyperpipe.models.ops import CAUSAL_FRACTION, attention_gemms
from hyperpipe.plan.plan import Plan, StagePlan
from hyperpipe.sim.compute import gemm_dtype, gemm_time_s
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.experts import expert_dp_rings, expert_share, expert_state, moe_layers
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


def rank_static_bytes(cost: CostModel, plan: Plan, stages: Sequence[StagePlan],
                      micro_batch: int, reshard: bool) -> float:
    """Bytes one rank holds all iteration for its plan `stages`
    (`CostModel.device_static_bytes`) under the plan's ZeRO stage, each stage's
    data-parallel shards (`dp_shards`) and its expert-parallel share of the experts
    (`experts.expert_state`): what the simulator, the analytic tier and schedule
    synthesis all count."""
    return cost.device_static_bytes(
        list(stages), micro_batch, zero=plan.zero, reshard_after_forward=reshard,
        shards_of=lambda st: dp_shards(plan, st, cost.cluster),
        experts_of=lambda st: expert_state(cost, plan, st))


def dp_shards(plan: Plan, stage: StagePlan, cluster=None) -> float:
    """Ranks a stage's optimizer state is split over: the replicas times its context
    ranks with ZeRO 1 and up; 1 without. With uneven sharding (`runtime.shard` "memory"
    or "speed", `cluster` needed) the effective count 1 / f, f this stage's device's
    share (`shard_fractions`), so that what ZeRO shards divides by it as by n."""
    if plan.zero < 1:
        return 1
    kind = plan.runtime_settings().shard
    if kind == "even":
        return len(plan.pipelines) * stage.cp
    if cluster is None:
        raise ValueError(f"dp_shards: runtime shard {kind!r} needs the cluster")
    return 1.0 / _fraction(plan, stage, cluster, kind)


def shard_weights(plan: Plan, stage: StagePlan, cluster, kind: str) -> list[float]:
    """Per rank of `stage`'s data-parallel group (every replica's stage holding its first
    layer, each context rank), its weight under `kind`: 1 ("even"), its device type's
    memory ("memory") or peak FLOP/s for the model's dtype ("speed")."""
    first = stage.layers[0]
    out: list[float] = []
    for pipe in plan.pipelines:
        st = pipe.stages[stage_holding(pipe.stages, first)]
        dev = cluster.device(st.devices[0]).type
        w = {"even": 1.0, "memory": float(dev.memory_bytes),
             "speed": float(dev.peak_flops)}[kind]
        out += [w] * st.cp
    return out


def shard_fractions(weights: Sequence[float]) -> list[float]:
    """Each rank's share of a sharded tensor: its weight over the group's (even weights:
    1/n each). Sums to 1."""
    total = float(sum(weights))
    return [w / total for w in weights]


def uneven_factor(fractions: Sequence[float]) -> float:
    """How much longer a ring all-gather or reduce-scatter of uneven shards takes than of
    even ones: every ring step moves each rank's chunk at once, so the largest sets the
    step (NCCL's ring over padded chunks, torch's `all_gather_into_tensor` needs equal
    ones): n x max fraction (1 when even)."""
    return len(fractions) * max(fractions) if fractions else 1.0


def _fraction(plan: Plan, stage: StagePlan, cluster, kind: str) -> float:
    """`stage`'s rank's share under `kind` (its device type's weight over the group's)."""
    weights = shard_weights(plan, stage, cluster, kind)
    dev = cluster.device(stage.devices[0]).type
    mine = {"even": 1.0, "memory": float(dev.memory_bytes),
            "speed": float(dev.peak_flops)}[kind]
    return mine / float(sum(weights))


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


class FsdpCost(NamedTuple):
    """What ZeRO-2/3 adds to one action of a stage."""

    extra_s: float         # beyond its compute: gathers and scatters overlapped with it,
    #                        the first gather starting with it (layer-by-layer prefetch)
    gather_s: float        # its gathers alone, back to back on the communication stream


def fsdp_extra_s(cost: CostModel, plan: Plan, q: int, k: int, op: str, *,
                 reshard: bool | None = None,
                 grad_bytes_per_param: float | None = None) -> float:
    """Seconds ZeRO-2/3 adds to every `op` of stage k of pipeline q (see the module doc;
    the once-a-step gather of ZeRO-3 without resharding is `first_gather`'s). 0 for ZeRO
    0/1 and for a group of one."""
    return _fsdp_pass(cost, plan, q, k, op, False, reshard, grad_bytes_per_param).extra_s


def first_gather(cost: CostModel, plan: Plan, q: int, k: int,
                 grad_bytes_per_param: float | None = None) -> FsdpCost:
    """The once-a-step gather of stage k of pipeline q under ZeRO-3 without resharding,
    at its first forward (zeros for a group of one)."""
    return _fsdp_pass(cost, plan, q, k, "F", True, False, grad_bytes_per_param)


class FirstForward(NamedTuple):
    """What a stage's first forward of the step waits for under ZeRO-3 without
    resharding (`first_forwards`)."""

    ready_s: float         # it may not start before this, from the step's start
    extra_s: float         # it takes this much beyond its compute


def first_forwards(gathers: Sequence[FsdpCost]) -> list[FirstForward]:
    """One rank's stages, in the order of their first forwards, given each one's
    once-a-step gather (`first_gather`). A rank of several stages (torch's multi-stage
    runtime) issues all their gathers back to back at the step's start: a first forward
    may start once the gathers before it are done plus its own exposed part, which
    ends it as if its gather had started with it; a gather done before the forward
    starts costs it nothing. A rank of one stage (torch's single-stage schedules:
    FSDP2's pre-forward hook) gathers when its first forward starts: that forward takes
    the exposed part longer."""
    if len(gathers) == 1:
        return [FirstForward(0.0, gathers[0].extra_s)]
    out, before = [], 0.0
    for g in gathers:
        out.append(FirstForward(before + g.extra_s, 0.0))
        before += g.gather_s
    return out


def stage_waits(gathers: Sequence[FsdpCost], homes: Sequence[Sequence[int]]
                ) -> list[FirstForward]:
    """Per stage of a pipeline, what its first forward waits for (`first_forwards`),
    given each stage's once-a-step gather (`first_gather`) and the stages each rank
    holds in stage order (the order their first forwards come in)."""
    waits = [FirstForward(0.0, 0.0)] * len(gathers)
    for mine in homes:
        for k, w in zip(mine, first_forwards([gathers[k] for k in mine]), strict=True):
            waits[k] = w
    return waits


def fill_delay_s(waits: Sequence[FirstForward], forward_s: Sequence[float]) -> float:
    """How much later the first micro-batch's forward path ends when stage k's forward
    (`forward_s[k]`, its send included) starts once stage k - 1's is done but not before
    `waits[k].ready_s`, and takes `waits[k].extra_s` longer."""
    t = 0.0
    for w, f in zip(waits, forward_s, strict=True):
        t = max(t, w.ready_s) + w.extra_s + f
    return max(0.0, t - sum(forward_s))


def _fsdp_pass(cost: CostModel, plan: Plan, q: int, k: int, op: str, first_forward: bool,
               reshard: bool | None, grad_bytes_per_param: float | None) -> FsdpCost:
    reshard = reshard_after_forward(plan) if reshard is None else reshard
    gather, scatter = zero_collectives(plan.zero, reshard, op, first_forward)
    if not (gather or scatter):
        return FsdpCost(0.0, 0.0)
    group = shard_group(plan, q, k)
    if len(group) <= 1:
        return FsdpCost(0.0, 0.0)
    if grad_bytes_per_param is None:
        grad_bytes_per_param = plan.runtime_settings().grad_bytes_per_param(
            cost.grad_bytes_per_param)
    st = plan.pipelines[q].stages[k]
    kind = plan.runtime_settings().shard
    factor = 1.0 if kind == "even" else uneven_factor(shard_fractions(
        shard_weights(plan, st, cost.cluster, kind)))
    expert_group, share = _expert_group(cost, plan, q, k)
    return _memo_fsdp_pass(cost, st, group, op, plan.pipelines[q].micro_batch, gather,
                           scatter, grad_bytes_per_param, factor, expert_group, share)


def zero_collectives(zero: int, reshard: bool, op: str, first_forward: bool = False
                     ) -> tuple[bool, bool]:
    """(whether it gathers weights, whether it reduce-scatters gradients): one `op` of a
    stage under ZeRO stage `zero` (see the module doc); none below ZeRO-2."""
    gather = zero == 3 and ((op == "F" and (reshard or first_forward))
                            or (op in ("B", "I") and reshard))
    scatter = zero >= 2 and op in ("B", "W") and (zero == 2 or reshard)
    return gather, scatter


def stage_fsdp_cost(cost: CostModel, st: StagePlan, group: tuple[str, ...], op: str,
                    micro_batch: int, zero: int, reshard: bool, grad_bytes: float, *,
                    first_forward: bool = False) -> FsdpCost:
    """What ZeRO-2/3 adds to `op` of a stage `st` whose data-parallel group is `group`
    (tensor rank 0 of each of its ranks, `shard_group`), sharded evenly and without
    expert parallelism's own groups: what the search's templates add per action before
    a plan exists."""
    gather, scatter = zero_collectives(zero, reshard, op, first_forward)
    if not (gather or scatter) or len(group) <= 1:
        return FsdpCost(0.0, 0.0)
    return _memo_fsdp_pass(cost, st, group, op, micro_batch, gather, scatter, grad_bytes)


def _memo_fsdp_pass(cost: CostModel, *args) -> FsdpCost:
    """`_stage_pass(cost, *args)`, kept for the cost model's life."""
    table = cost.memo("sharding", dict)
    key = ("fsdp", *args)
    if key not in table:
        table[key] = _stage_pass(cost, *args)
    return table[key]


def _expert_group(cost: CostModel, plan: Plan, q: int, k: int
                  ) -> tuple[tuple[str, ...], float]:
    """(the expert-data-parallel ring of stage k of pipeline q's first device, the share
    of the routed experts its rank holds) under expert parallelism; ((), 1.0) without."""
    st = plan.pipelines[q].stages[k]
    if st.ep == 1:
        return (), 1.0
    if not moe_layers(cost, st.layers):
        return (), 1.0
    ring = next(r for r in expert_dp_rings(plan, q, k) if st.devices[0] in r)
    return tuple(ring), expert_share(cost, plan, q, k)


def _stage_pass(cost: CostModel, st: StagePlan, group: tuple[str, ...], op: str,
                 mb: int, gather: bool, scatter: bool, grad_bytes: float,
                 factor: float = 1.0, expert_group: tuple[str, ...] = (),
                 share: float = 1.0) -> FsdpCost:
    units = list(range(*st.layers))
    if op != "F":
        units.reverse()                      # the backward meets the layers last first
    weight = cost.param_state.weight          # the stored weights: fp32 under autocast
    compute, gathers, scatters = [], [], []
    for i in units:
        compute.append(cost.stage_time_s((i, i + 1), st.devices, mb, op, st.recompute,
                                         st.sequence_parallel, st.cp))
        # Under ep an MoE block's routed experts are their own unit, sharded over the
        # expert-data-parallel ring (`experts.expert_dp_rings`), of which this rank
        # holds `share`; the rest over the whole group. One stream serves both.
        experts = getattr(cost.model.layers[i], "expert_params", 0) if expert_group else 0
        parts = [(group, factor, (cost.model.layers[i].params - experts) / st.tp),
                 (expert_group, 1.0, experts * share / st.tp)]
        gathers.append(sum(f * cost.allgather_time_s(g, p * weight) for g, f, p in parts
                           if len(g) > 1 and p > 0) if gather else 0.0)
        scatters.append(sum(f * cost.allgather_time_s(g, p * grad_bytes)
                            for g, f, p in parts if len(g) > 1 and p > 0)
                        if scatter else 0.0)
    return FsdpCost(overlapped_pass_s(compute, gathers, scatters) - sum(compute), sum(gathers))


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
            if layer.kind not in ("block", "moe") or config is None:
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
                if layer.kind in ("block", "moe") and getattr(layer, "config", None) is not None)


def _exchange_s(cost: CostModel, stage: StagePlan, micro_batch: int, op: str) -> float:
    return cost.exchange_time_s(ring_edges(stage),
                                ring_step_bytes(cost, stage, micro_batch, op))


def _step_s(cost: CostModel, stage: StagePlan, micro_batch: int, op: str) -> float:
    """One ring step's attention on one device: the attention core's GEMMs
    (`models.ops.attention_gemms`, a causal flash kernel's share of them) for one of the
    cp steps, at the device's GEMM curve; or, on a flat-roofline device (which prices a
    layer by the model's FLOP count, the whole s x s square), the step's FLOPs counted
    the same way; stretched by the group's slowdown."""
    config = _block_config(cost)
    dev = cost.cluster.device(stage.devices[0]).type
    gemms = attention_gemms(config, op, micro_batch, cost.model.seq_len, stage.tp, stage.cp)
    model = cost.model
    if dev.gemm is not None:
        t = sum(gemm_time_s(dev, g.m, g.n, g.k, g.batch / stage.cp, model.dtype_bytes,
                            gemm_dtype(model.dtype, g.linear)) for g in gemms)
    else:
        causal = CAUSAL_FRACTION if getattr(config, "attention", "flash") == "flash" else 1.0
        t = sum(g.flops for g in gemms) / causal / stage.cp / \
            dev.achievable_flops_for(gemm_dtype(model.dtype, False))
    return t * cost.cluster.slowdown(stage.devices)


__all__ = ["FirstForward", "FsdpCost", "dp_shards", "fill_delay_s", "first_forwards",
           "first_gather", "fsdp_extra_s", "overlapped_pass_s", "pipelined",
           "reshard_after_forward", "ring_attention_extra_s", "ring_edges",
           "ring_exposed_s", "ring_step_bytes", "shard_fractions", "shard_group",
           "shard_weights", "stage_fsdp_cost", "stage_waits", "uneven_factor"]
