"""Our executor vs torch.distributed.pipelining, same work, alternating in one run.

Two local ranks (gloo, one intra-op thread each), tiny-gpt cut [0, 4) + [4, 8), the same
micro-batch size and count, the same data and initial weights. For GPipe and 1F1B each
rank builds both runtimes: our RankRuntime replaying the schedule IR, and torch's
ScheduleGPipe / Schedule1F1B over PipelineStage. Steps alternate (ours, torch's, ...,
with the first runner swapped every round) so that machine noise hits both alike; every
step is forward + backward over all micro-batches + AdamW, timed on rank 0 between two
barriers. The gradients of the first step (same weights, same batch) are compared.

Prints one line per schedule, then as its last line
``step_ratio_vs_torch=R grad_max_abs_diff=D``: R is our median step time over torch's
(the worse of the two schedules) and D the largest gradient difference.

    python experiments/bench_exec.py [--rounds 20] [--micro-batch 4] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from hyperpipe.exec.data import step_batch
from hyperpipe.exec.launch import launch_local
from hyperpipe.exec.placement import placements
from hyperpipe.exec.runtime import RankRuntime
from hyperpipe.exec.torch_pipelining import torch_schedule, torch_stages
from hyperpipe.plan.plan import Plan, plan_from_dict

KINDS = ("gpipe", "1f1b")
WARMUP_ROUNDS = 3
LR = 1e-3


def make_plan(kind: str, micro_batch: int, num_microbatches: int) -> Plan:
    return plan_from_dict({
        "format": "hyperpipe.plan/1", "model": "tiny-gpt",
        "cluster": {"nodes": [{"name": "n", "device": "A100-80GB", "count": 2}]},
        "global_batch": micro_batch * num_microbatches, "schedule": kind,
        "pipelines": [{"micro_batch": micro_batch, "num_microbatches": num_microbatches,
                       "stages": [{"layers": [0, 4], "devices": ["n/0"]},
                                  {"layers": [4, 8], "devices": ["n/1"]}]}]})


def bench_rank(rank: int, world: int, store, plans: list[Plan], rounds: int) -> dict:
    """One rank: per schedule kind, (our step times, torch's step times, grad diff)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    out = {plan.schedule: bench_plan(plan, rank, rounds) for plan in plans}
    dist.destroy_process_group()
    return out


def bench_plan(plan: Plan, rank: int, rounds: int) -> tuple[list[float], list[float], float]:
    cpu = torch.device("cpu")
    spec = plan.load_model()
    where = placements(plan)[rank]
    t0 = time.perf_counter()
    ours = RankRuntime(plan, spec, where, seed=0, lr=LR, device=cpu, timeout_s=60.0,
                       clock=lambda: time.perf_counter() - t0)
    stages = torch_stages(plan, spec, where, 0, cpu)
    sched = torch_schedule(plan.schedule, stages, plan.pipelines[0].num_microbatches, spec)
    optim = torch.optim.AdamW([p for s in stages for p in s.submod.parameters()], lr=LR)

    def torch_step(step: int) -> None:
        x, y = step_batch(spec, plan.global_batch, step, 0)
        optim.zero_grad(set_to_none=True)
        if stages[0].is_first:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        optim.step()

    runners = {"ours": ours.run_step, "torch": torch_step}
    # first step: same weights, same batch; compare the gradients (AdamW moved the
    # weights, but the gradients of this step stay in .grad until the next one)
    for run in runners.values():
        run(0)
    ours_params = dict(ours.stages[where.stages[0]].module.named_parameters())
    diff = torch.zeros(())
    for name, p in stages[0].submod.named_parameters():
        diff = torch.maximum(diff, (p.grad - ours_params[name].grad).abs().max())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for r in range(WARMUP_ROUNDS + rounds):
        order = ("ours", "torch") if r % 2 == 0 else ("torch", "ours")
        for name in order:
            dist.barrier()
            t = time.perf_counter()
            runners[name](r + 1)
            dist.barrier()
            if r >= WARMUP_ROUNDS:
                times[name].append(time.perf_counter() - t)
    return times["ours"], times["torch"], diff.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed steps per runtime")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    plans = [make_plan(k, args.micro_batch, args.microbatches) for k in KINDS]
    results = launch_local(bench_rank, (plans, args.rounds), plans[0].devices)[0]
    ratios, diffs = [], []
    for kind, (ours, theirs, diff) in results.items():
        mo, mt = statistics.median(ours), statistics.median(theirs)
        ratios.append(mo / mt)
        diffs.append(diff)
        print(f"{kind:6s} tiny-gpt 2 ranks mb={args.micro_batch} m={args.microbatches}: "
              f"ours median {mo * 1e3:.1f} ms (min {min(ours) * 1e3:.1f}), torch median "
              f"{mt * 1e3:.1f} ms (min {min(theirs) * 1e3:.1f}), ratio {mo / mt:.3f}, "
              f"grad max abs diff {diff:.2e}")
    print(f"step_ratio_vs_torch={max(ratios):.3f} grad_max_abs_diff={max(diffs):.2e}")


if __name__ == "__main__":
    main()
