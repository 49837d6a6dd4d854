"""Our stages under torch.distributed.pipelining: the reference runtime we compare with.

The interop test runs `hyperpipe schedule --format torch-csv` output under torch's
``_PipelineScheduleRuntime._load_csv(..., "compute_only")``, and the benchmark runs
torch's ScheduleGPipe / Schedule1F1B, both on the same stage modules (same weights) and
the same data as our executor. torch's runtime wants the last stage to return an output
and a separate loss function: our head without targets returns its fp32 logits, and
`loss_fn` applies the cross-entropy the head would (MSE for a synthetic model).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from hyperpipe.exec.placement import RankPlacement
from hyperpipe.models import build_stage
from hyperpipe.models.spec import ModelSpec
from hyperpipe.plan.kinds import schedule_kind
from hyperpipe.plan.plan import Plan


def loss_fn(spec: ModelSpec) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss our head computes, as a function of the last stage's output."""
    if spec.config is None:
        return F.mse_loss

    def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    return cross_entropy


def torch_stages(plan: Plan, spec: ModelSpec, where: RankPlacement, seed: int,
                 device: torch.device) -> list[PipelineStage]:
    """torch PipelineStages for this rank's stages (one pipeline plans only)."""
    pipe = plan.pipelines[where.pipeline]
    out = []
    for s in where.stages:
        a, b = pipe.stages[s].layers
        module = build_stage(spec, a, b, seed).to(device)
        out.append(PipelineStage(module, s, len(pipe.stages), device))
    return out


def torch_schedule(kind: str, stages: list[PipelineStage], num_microbatches: int,
                   spec: ModelSpec, csv_path: str | None = None):
    """torch's own GPipe or 1F1B for one stage per rank; otherwise its runtime replaying
    our schedule from the compute-only CSV at `csv_path`. Gradients are scaled by
    1/num_microbatches (scale_grads), the same full-batch mean our executor uses."""
    if csv_path is None:
        single_stage = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}     # torch's names
        cls = single_stage[schedule_kind(kind).torch_schedule]
        return cls(stages[0], num_microbatches, loss_fn=loss_fn(spec), scale_grads=True)
    sched = _PipelineScheduleRuntime(stages, num_microbatches, loss_fn=loss_fn(spec),
                                     scale_grads=True)
    sched._load_csv(csv_path, format="compute_only")
    return sched
