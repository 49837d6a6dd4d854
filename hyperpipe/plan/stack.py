"""The training stack a plan runs on, and the defaults the simulator and executor share.

A plan names its stack (``"stack": "megatron-lm" | "megatron-deepspeed" | "torchtitan"``;
absent: megatron-lm) and may override four of its runtime choices (``"runtime": {"p2p":
"async" | "blocking", "overlap_grad_reduce": true | false, "grad_reduce_dtype": "fp32" |
"bf16", "reshard_after_forward": true | false}``, the last for ZeRO-3 plans). `STACKS`
holds each stack's defaults, read from the framework's own code (cited per entry);
`resolve_runtime` turns (stack, overrides) into the one `Runtime` that the simulator,
the analytic tier and the search price a plan by. Both the simulated and the real
data-parallel gradient reduction read their bucket size from here, so that a simulated
plan and its real run bucket the gradients alike.

Per-micro-batch engine work is modelled where the framework's code says what it moves
(`Runtime.accumulates_fp32_grads`: DeepSpeed's bf16 optimizer adds every micro-batch's
gradients into fp32 buffers). The Python time of DeepSpeed's pipeline engine, which
interprets one instruction list per micro-batch step, is not: no public measurement of
its size was found, and it is never fitted to a published run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

# Bytes of gradient per data-parallel all-reduce bucket: PyTorch DDP's default
# (`DistributedDataParallel(bucket_cap_mb=25)`, torch/nn/parallel/distributed.py),
# which Megatron-LM's and torchtitan's DDP wrappers keep unless told otherwise.
DDP_BUCKET_BYTES = 25e6

P2P_KINDS = ("async", "blocking")
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
# Bytes per gradient element that data parallelism moves, per `grad_reduce_dtype`.
GRAD_REDUCE_BYTES: Mapping[str, float] = MappingProxyType({"fp32": 4.0, "bf16": 2.0})
# Bytes of memory traffic per parameter when an engine adds a micro-batch's 2-byte
# gradient into a 4-byte fp32 buffer as DeepSpeed's BF16_Optimizer.update_hp_grads does,
# `hp_grad.add_(lp.grad.to(torch.float32))`: the cast reads 2 and writes a 4-byte copy
# (2 + 4), the add reads both fp32 tensors and writes one (4 + 4 + 4).
FP32_ACCUMULATE_BYTES_PER_PARAM = 18.0
RUNTIME_KEYS = ("p2p", "overlap_grad_reduce", "grad_reduce_dtype", "reshard_after_forward",
                "expert_placement", "shard", "moe_dispatcher")
# How a data-parallel group of unequal devices splits what ZeRO shards: "even" (1/n each,
# as every framework does), or in proportion to each device's "memory" or "speed" (peak
# FLOP/s): the uneven sharding of heterogeneous FSDP planners (Cephalo, HexiScale).
SHARD_KINDS = ("even", "memory", "speed")
# How an expert-parallel group's experts are spread over its ranks: "even" (experts /
# ep each: a router cannot know device speeds, so tokens spread evenly over experts and
# the slowest rank sets the time) or "speed" (more experts on faster devices, in
# proportion to their speed: `hyperpipe.sim.experts`).
EXPERT_PLACEMENTS = ("even", "speed")
# How an MoE block's tokens travel to their experts' ranks and back: "alltoall" (one copy
# per routed token-expert pair, `all_to_all_single` of the permuted tokens: Megatron-Core's
# `MoEAlltoAllTokenDispatcher`, torchtitan's MoE) or "deepep" (one copy per token and
# destination rank inside a node, one per token and destination node across nodes,
# forwarded inside the node over NVLink: deepseek-ai/DeepEP's normal kernels, which
# DeepSeek-V3 trains with, arXiv 2412.19437 sec. 3.2.2).
MOE_DISPATCHERS = ("alltoall", "deepep")


@dataclass(frozen=True)
class Runtime:
    """How a stack executes a plan, as far as its cost depends on it."""

    p2p: str = "async"
    """"async": a send runs beside the sender's next actions (one at a time per stage
    pair and direction); "blocking": the sender's stream waits until its send is
    delivered before its next action."""

    overlap_grad_reduce: bool = True
    """True: data-parallel gradient buckets are reduced during each stage's last
    backward; False: after the rank's last action (the pipeline flush)."""

    grad_reduce_dtype: str | None = None
    """"fp32" (4 bytes per gradient) or "bf16" (2 bytes); None: the model dtype's rule
    (`hyperpipe.sim.costmodel.GRAD_BYTES_PER_PARAM`: fp32 main grads for bf16, fp16
    grads for fp16)."""

    allreduce_sharded_grads: tuple[str, ...] = ()
    """Model dtypes for which the distributed optimizer (ZeRO-1) reduces gradients with a
    full all-reduce before each rank updates its shard (then all-gathers the weights),
    instead of a reduce-scatter. Not overridable from a plan."""

    accumulates_fp32_grads: tuple[str, ...] = ()
    """Model dtypes for which the engine adds each micro-batch's weight gradients into
    fp32 buffers right after that micro-batch's backward, on the compute stream
    (`FP32_ACCUMULATE_BYTES_PER_PARAM` per parameter of the rank, memory-bound), instead
    of letting autograd accumulate them across micro-batches. Not overridable from a
    plan."""

    flattens_param_groups: tuple[str, ...] = ()
    """Model dtypes for which each stage's optimizer flattens Megatron's two parameter
    groups (weights with weight decay; biases and norms without) one by one, and fails
    on an empty one: a stage must hold a bias or a norm (`Plan.stack_refusal`). Not
    overridable from a plan."""

    tied_reduce_own_grads: bool = False
    """True: the first and last stage all-reduce the tied embedding's gradient as the
    parameter holds it (the model dtype's rule: fp16 for fp16, the fp32 master gradient
    for bf16), whatever `grad_reduce_dtype` makes of the data-parallel sync; False: in
    the data-parallel sync's dtype (Megatron-LM's `_allreduce_word_embedding_grads`
    reduces the `main_grad` of the data-parallel gradient buffer). Not overridable from
    a plan."""

    tied_reduce_first: bool = False
    """True: a rank holding a tied stage all-reduces the tied embedding's gradient right
    after its last action and only then starts its data-parallel sync (with the sync
    after the flush, it waits for the other end's flush too); False: the data-parallel
    sync first, then the tie (Megatron-LM's `finalize_model_grads`). Not overridable
    from a plan."""

    keeps_stage_outputs: bool = False
    """True: the engine holds each in-flight micro-batch's stage output from its forward
    until its backward, beside what autograd saves (DeepSpeed's `PipelineEngine.
    _exec_forward_pass` stores it in `pipe_buffers['outputs']`; with tensor parallelism
    only this rank's 1/tp part, `PartitionedTensor`): on the last stage the fp32 logits
    (`CostModel.stage_output_bytes`). Not overridable from a plan."""

    reshard_after_forward: bool | None = None
    """ZeRO-3/FSDP: True frees each unit's gathered parameters after its forward and
    gathers them again for its backward, every micro-batch (FSDP's FULL_SHARD, DeepSpeed
    ZeRO-3); False keeps them from a stage's first forward to its last backward (one
    gather and one gradient reduce-scatter per step). None: torchtitan's "default"
    policy (`apply_fsdp` in torchtitan/models/llama3/infra/parallelize.py): False when
    the plan pipelines (more than one stage: "to avoid per-microbatch all-gathers"),
    True otherwise."""

    expert_placement: str = "even"
    """One of `EXPERT_PLACEMENTS`: how a stage's experts are spread over its
    expert-parallel ranks."""

    shard: str = "even"
    """One of `SHARD_KINDS`: each data-parallel rank's share of what ZeRO shards
    (`hyperpipe.sim.sharding.shard_fractions`)."""

    moe_dispatcher: str = "alltoall"
    """One of `MOE_DISPATCHERS`: what an expert-parallel all-to-all sends
    (`hyperpipe.sim.experts.alltoall_edge_bytes`)."""

    def grad_bytes_per_param(self, model_dtype_grad_bytes: float) -> float:
        """Bytes per gradient element reduced: the `grad_reduce_dtype`'s, or
        `model_dtype_grad_bytes` (the model dtype's rule) when it is None."""
        if self.grad_reduce_dtype is None:
            return model_dtype_grad_bytes
        return GRAD_REDUCE_BYTES[self.grad_reduce_dtype]

    def tied_grad_bytes_per_param(self, model_dtype_grad_bytes: float) -> float:
        """Bytes per element of the tied embedding's gradient all-reduce between the
        first and last stage (`tied_reduce_own_grads`)."""
        if self.tied_reduce_own_grads:
            return model_dtype_grad_bytes
        return self.grad_bytes_per_param(model_dtype_grad_bytes)


@dataclass(frozen=True)
class Stack:
    """A training framework's defaults: its name, runtime and what they come from."""

    name: str
    runtime: Runtime
    source: str


STACKS: Mapping[str, Stack] = MappingProxyType({
    # Megatron-LM (NVIDIA/Megatron-LM, megatron/core): gradients in DDP buckets
    # (megatron/core/distributed/param_and_grad_buffer.py) reduced during the backward
    # with `--overlap-grad-reduce` (DistributedDataParallelConfig.overlap_grad_reduce,
    # which NVIDIA's recipes set); sends overlapped with compute under
    # `--overlap-p2p-communication` (on by default for the interleaved schedule:
    # `_communicate(wait_on_reqs=False)` in megatron/core/pipeline_parallel/
    # p2p_communication.py; the non-interleaved 1F1B of megatron/core/pipeline_parallel/
    # schedules.py waits on its requests, so plans replaying Megatron's 1F1B of the time,
    # such as Table 1 of Narayanan et al. 2021, set `runtime.p2p: blocking`); bf16
    # training reduces fp32 main grads (`accumulate_allreduce_grads_in_fp32`, forced for
    # bf16 in megatron/training/arguments.py), fp16 training fp16 grads; the distributed
    # optimizer reduce-scatters (megatron/core/optimizer/distrib_optimizer.py).
    "megatron-lm": Stack("megatron-lm", Runtime("async", True, None, ()),
                         "NVIDIA/Megatron-LM megatron/core"),
    # Megatron-DeepSpeed on DeepSpeed's pipeline engine (microsoft/DeepSpeed
    # deepspeed/runtime/pipe/schedule.py `TrainSchedule`, engine.py `PipelineEngine`):
    # SendActivation/RecvGrad "The communication is blocking"; `ReduceTiedGrads`,
    # `ReduceGrads`, `OptimizerStep` run after the last micro-batch's step (no overlap
    # with the backward); with bf16 `_exec_reduce_grads` calls `_bf16_reduce_grads`,
    # which all-reduces the BF16_Optimizer's fp32 gradients in full even with ZeRO
    # stage 1 (`buffered_allreduce_fallback`), each rank then steps its partition and
    # all-gathers the weights; with fp16 the gradients travel in the engine's
    # `communication_data_type`, fp16 (the model dtype's rule in both cases). Each
    # forward's outputs stay in `pipe_buffers['outputs']` until the backward
    # (`_exec_forward_pass`; freed in `_exec_backward_pass`): `keeps_stage_outputs`.
    # With bf16, `_exec_backward_pass` calls the BF16_Optimizer's `clear_lp_grads()`
    # before each micro-batch's backward and `update_hp_grads()` after it on every
    # stage but the last, whose backward goes through `BF16_Optimizer.backward`, which
    # does the same ("We copy/accumulate to the high-precision grads now to prevent
    # accumulating in the bf16 grads after successive backward() calls",
    # deepspeed/runtime/bf16_optimizer.py): `accumulates_fp32_grads`. With fp16 each
    # stage's optimizer is DeepSpeed's FP16_Optimizer (runtime/fp16/fused_optimizer.py),
    # whose constructor flattens every parameter group (`_flatten_dense_tensors`, a
    # torch.cat that refuses an empty list) of the two Megatron-LM builds
    # (megatron/model/utils.py `get_params_for_weight_decay_optimization`: LayerNorm
    # parameters and biases without decay, the rest with): `flattens_param_groups`.
    # `ReduceTiedGrads` all-reduces the tied weight's own gradient (`_exec_reduce_tied_grads`:
    # `weight._hp_grad` under bf16, else `weight.grad`; pipe/module.py
    # `allreduce_tied_weight_gradients`: `dist.all_reduce(weight.grad, ...)`), while the
    # engine's `fp32_allreduce` casts only the data-parallel buckets (engine.py
    # `allreduce_bucket`): `tied_reduce_own_grads`. It comes first in the last step
    # (`TrainSchedule.steps`: `ReduceTiedGrads`, then `ReduceGrads`): `tied_reduce_first`.
    "megatron-deepspeed": Stack("megatron-deepspeed",
                                Runtime("blocking", False, None, ("bf16",),
                                        accumulates_fp32_grads=("bf16",),
                                        flattens_param_groups=("fp16",),
                                        keeps_stage_outputs=True,
                                        tied_reduce_own_grads=True,
                                        tied_reduce_first=True),
                                "microsoft/DeepSpeed deepspeed/runtime/pipe"),
    # torchtitan (pytorch/torchtitan) on torch.distributed.pipelining: Schedule1F1B and
    # the others send with `batch_isend_irecv` and wait for a send only before the next
    # one (torch/distributed/pipelining/schedules.py, "Clear previous chunk's forward
    # sends"); the data-parallel gradient sync runs inside the last micro-batch's
    # backward (`backward_maybe_with_nosync(last_backward=...)`, pipelining/stage.py);
    # reductions in fp32 (torchtitan/config/job_config.py `mixed_precision_reduce =
    # "float32"`). FSDP's sharding (plan `zero` 2/3) is priced by hyperpipe.sim.sharding.
    "torchtitan": Stack("torchtitan", Runtime("async", True, "fp32", ()),
                        "pytorch/torchtitan, torch/distributed/pipelining"),
})
DEFAULT_STACK = "megatron-lm"


@dataclass(frozen=True)
class RuntimeOverrides:
    """The plan's ``runtime`` field: each choice given overrides the stack's; None keeps
    the stack's default."""

    p2p: str | None = None
    overlap_grad_reduce: bool | None = None
    grad_reduce_dtype: str | None = None
    reshard_after_forward: bool | None = None
    expert_placement: str | None = None
    shard: str | None = None
    moe_dispatcher: str | None = None

    def __post_init__(self) -> None:
        for key, value, options in (("p2p", self.p2p, P2P_KINDS),
                                    ("moe_dispatcher", self.moe_dispatcher,
                                     MOE_DISPATCHERS),
                                    ("shard", self.shard, SHARD_KINDS),
                                    ("expert_placement", self.expert_placement,
                                     EXPERT_PLACEMENTS),
                                    ("grad_reduce_dtype", self.grad_reduce_dtype,
                                     GRAD_REDUCE_DTYPES),
                                    ("overlap_grad_reduce", self.overlap_grad_reduce,
                                     (True, False)),
                                    ("reshard_after_forward", self.reshard_after_forward,
                                     (True, False))):
            if value is not None and value not in options:
                raise ValueError(f"runtime {key} must be one of {options}, got {value!r}")

    def given(self) -> dict[str, Any]:
        """The overrides that are set, as the plan's JSON writes them."""
        return {k: getattr(self, k) for k in RUNTIME_KEYS if getattr(self, k) is not None}


NO_OVERRIDES = RuntimeOverrides()


# Layer kinds whose parameters are all weights with decay (no bias, no norm): the
# embedding's word and position tables (`hyperpipe.models.spec.EmbeddingLayer`).
DECAY_ONLY_KINDS = ("embedding",)


def resolve_runtime(stack: str, overrides: RuntimeOverrides = NO_OVERRIDES) -> Runtime:
    """The runtime a plan on `stack` runs with: the stack's defaults, then `overrides`."""
    base = STACKS[stack].runtime
    return replace(base, **overrides.given())
