"""What a simulation models beyond the plan (`SimOptions`), and what it takes from the
plan's training stack (`Execution`, mapped from the plan's ``stack`` and ``runtime`` in
`execution_of`, the one place: the simulator, the programs it prepares
(`hyperpipe.sim.program`) and the analytic tier all read it). Sizes in bytes."""

from __future__ import annotations

from dataclasses import dataclass

from hyperpipe.plan.plan import Plan
from hyperpipe.plan.stack import DDP_BUCKET_BYTES, FP32_ACCUMULATE_BYTES_PER_PARAM
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.experts import expert_state
from hyperpipe.sim.sharding import reshard_after_forward


@dataclass(frozen=True)
class SimOptions:
    bucket_bytes: float = DDP_BUCKET_BYTES   # gradient bytes per all-reduce bucket
    include_optimizer: bool = True
    trace: bool = True                    # False: skip building the Trace (search)
    check_plan: bool = True               # Plan.check against model and cluster first
    validate_schedule: bool = True        # validate a user-given schedule first
    collapse_replicas: bool = True        # simulate replicas that move alike once


@dataclass(frozen=True)
class Execution:
    """How the plan's stack runs it, in the simulator's terms."""

    blocking_p2p: bool               # a sender's stream waits out its send
    overlap_dp_allreduce: bool       # buckets start during the last backward
    dp_sync_bytes_per_param: float   # bytes per parameter of the data-parallel sync
    grad_bytes_per_param: float      # bytes per gradient element reduced (ZeRO-2/3's)
    tie_bytes_per_param: float       # ... in the tied embedding's first-last all-reduce
    tied_reduce_first: bool          # the tie before the data-parallel sync (`Runtime`)
    zero: int = 0                    # the plan's ZeRO stage
    reshard_after_forward: bool = True   # ZeRO-3: gather again for every backward
    keeps_stage_outputs: bool = False    # the engine holds each stage output till backward
    accumulate_bytes_per_param: float = 0.0  # per micro-batch's fp32 gradient add (0: none)


def execution_of(plan: Plan, cost: CostModel) -> Execution:
    """The plan's stack and runtime overrides (`Plan.runtime_settings`) as the simulator
    and the analytic tier price them (ZeRO-3's resharding: `sharding.
    reshard_after_forward`)."""
    rt = plan.runtime_settings()
    reshard = reshard_after_forward(plan)
    return Execution(rt.p2p == "blocking", rt.overlap_grad_reduce,
                     cost.dp_sync_bytes_per_param(plan.distributed_optimizer, rt, plan.zero,
                                                  reshard),
                     rt.grad_bytes_per_param(cost.grad_bytes_per_param),
                     rt.tied_grad_bytes_per_param(cost.grad_bytes_per_param),
                     rt.tied_reduce_first, plan.zero, reshard,
                     rt.keeps_stage_outputs,
                     FP32_ACCUMULATE_BYTES_PER_PARAM
                     if cost.model.storage_dtype in rt.accumulates_fp32_grads else 0.0)


def accumulate_extra_s(cost: CostModel, plan: Plan, ex: Execution, q: int, k: int,
                       op: str) -> float:
    """Seconds the engine adds to each `op` of stage k of pipeline q by adding that
    micro-batch's weight gradients into fp32 buffers (`Execution.
    accumulate_bytes_per_param`; `CostModel.grad_accumulate_s`), on the op that finishes
    them: B, or W where the schedule splits the backward. 0 on other stacks and dtypes."""
    if ex.accumulate_bytes_per_param == 0 or op not in ("B", "W"):
        return 0.0
    stage = plan.pipelines[q].stages[k]
    share, _ = expert_state(cost, plan, stage)
    return cost.grad_accumulate_s(stage.layers, stage.devices, stage.tp,
                                  ex.accumulate_bytes_per_param, expert_share=share)
