"""What a simulation models beyond the plan: `SimOptions`, shared by the simulator and
the programs it prepares (`hyperpipe.sim.program`). Sizes in bytes."""

from __future__ import annotations

from dataclasses import dataclass

from hyperpipe.plan.stack import DDP_BUCKET_BYTES


@dataclass(frozen=True)
class SimOptions:
    overlap_dp_allreduce: bool = True     # buckets start during the last backward
    bucket_bytes: float = DDP_BUCKET_BYTES   # gradient bytes per all-reduce bucket
    include_optimizer: bool = True
    grad_bytes_per_param: float | None = None   # None: the cost model's (bf16: fp32, 4)
    trace: bool = True                    # False: skip building the Trace (search)
    check_plan: bool = True               # Plan.check against model and cluster first
    validate_schedule: bool = True        # validate a user-given schedule first
    collapse_replicas: bool = True        # simulate replicas that move alike once
    blocking_p2p: bool = False            # sender waits for its send (Megatron-LM's p2p)
