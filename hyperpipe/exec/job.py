"""One rank's whole job: join the process group, replay every step, gather the result.

`prepare` makes every check that bad input can fail (exit 2) before any rank starts;
`rank_main` is what each rank runs, started locally by `launch` or by torchrun: build
the RankRuntime, resume from a checkpoint if asked, align clocks (a barrier, then each
rank's t0), probe the links, run the steps (checkpointing and injecting faults as
asked), and all-gather every rank's events into one Trace.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hyperpipe.cluster.cluster import Cluster
from hyperpipe.errors import BadInput
from hyperpipe.exec import checkpoint, preflight
from hyperpipe.exec.comm import probe_links
from hyperpipe.exec.emulation import device_factors
from hyperpipe.exec.options import RunOptions, RunResult
from hyperpipe.exec.placement import adjacent_pairs, check_runnable, placements
from hyperpipe.exec.runtime import RankRuntime, StepOutcome
from hyperpipe.models.spec import ModelSpec
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.trace import Trace, TraceEvent


class InjectedFault(RuntimeError):
    """The failure `--inject-fault RANK:STEP` asks for."""


@dataclass(frozen=True)
class Prepared:
    """A plan checked for a real run, with its model and cluster resolved."""

    plan: Plan
    spec: ModelSpec
    cluster: Cluster
    fingerprint: str
    resume_from: int | None      # step of the checkpoint to resume from, if any


def prepare(plan: Plan, options: RunOptions) -> Prepared:
    """Every check that can fail on bad input, before any rank starts (BadInput: exit 2)."""
    preflight.check_outputs(options)
    spec = plan.load_model()
    cluster = plan.load_cluster()
    plan.check(spec, cluster)
    check_runnable(plan, spec)
    if spec.config is None:
        for i, layer in enumerate(spec.layers):
            if layer.hidden is None:
                raise BadInput(f"model {spec.name}: layers[{i}].hidden", "a width (needed to "
                               "run a synthetic model for real)", has_got=False)
    world = len(plan.devices)
    if options.inject_fault is not None and options.inject_fault[0] >= world:
        raise BadInput("--inject-fault", f"a rank below {world} (the plan has {world} "
                       "devices)", options.inject_fault[0])
    fp = checkpoint.fingerprint(plan, spec, options.seed)
    resume_from = None
    if options.checkpoint_dir is not None:
        root = Path(options.checkpoint_dir)
        if root.exists() and not root.is_dir():
            raise BadInput("--checkpoint", "a directory", str(root))
        if options.resume:
            resume_from = checkpoint.resume_step(root, fp, world)
            if resume_from is not None:
                preflight.check_rank_files(root, resume_from, world)
    return Prepared(plan, spec, cluster, fp, resume_from)


def rank_main(prep: Prepared, options: RunOptions, rank: int, local_rank: int, *,
              use_cuda: bool, store: dist.Store | None = None,
              world_size: int | None = None) -> RunResult:
    """Run rank `rank` of the plan: join the job, replay every step, gather the result.

    `store` and `world_size` come from the local launcher; under torchrun both are None
    and the process group is set up from the environment.
    """
    plan, spec = prep.plan, prep.spec
    torch.set_num_threads(options.threads_per_rank)
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=options.timeout_s)
    kwargs = {"store": store, "world_size": world_size} if store is not None else \
        {"init_method": "env://", "world_size": len(plan.devices)}
    if use_cuda:
        kwargs["device_id"] = device        # NCCL: bind the communicator to our GPU
    dist.init_process_group(backend, rank=rank, timeout=timeout, **kwargs)
    where = placements(plan)[rank]
    emulated = options.emulate and not use_cuda
    factors = device_factors(plan.devices, prep.cluster, options.emulation_scale) \
        if emulated else {d: 1.0 for d in plan.devices}

    def clock() -> float:
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    link_cost = None
    if emulated:        # messages and collectives take the cluster's link times (links.py)
        from hyperpipe.sim.costmodel import CostModel
        link_cost = CostModel(spec, prep.cluster)
    runtime = RankRuntime(plan, spec, where, seed=options.seed, lr=options.lr, device=device,
                          timeout_s=options.timeout_s, clock=clock,
                          emulation_factor=factors[where.device],
                          bucket_bytes=options.bucket_bytes,
                          overlap_dp_allreduce=options.overlap_dp_allreduce,
                          link_cost=link_cost)
    first_step = 0
    if prep.resume_from is not None:
        state = checkpoint.load_rank(options.checkpoint_dir, prep.resume_from, rank)
        runtime.load_state_dict(state)
        checkpoint.set_rng_state(state["rng"])
        first_step = int(state["step"])
    if emulated:                    # reference times, one rank at a time (uncontended),
        for r in range(dist.get_world_size()):  # a tensor-parallel group's ranks together
            dist.barrier()
            if r == where.tp_ranks[0]:
                runtime.measure_reference()
        if options.reference_profile:
            from hyperpipe.plan.profile import load_profile
            from hyperpipe.sim.costmodel import CostModel
            runtime.reference_from(CostModel(spec, prep.cluster,
                                             load_profile(options.reference_profile)))
    dist.barrier()
    t0 = time.perf_counter()        # aligned: every rank leaves the barrier together
    events: list[TraceEvent] = []
    if options.probe_links:
        events += probe_links(adjacent_pairs(plan), rank, plan.devices, clock,
                              options.timeout_s, device, runtime.links)
    outcomes: list[StepOutcome] = []
    for step in range(first_step, options.steps):
        if options.inject_fault is not None and options.inject_fault[:2] == (rank, step):
            if options.inject_fault[2:] == ("stop",):
                os.kill(os.getpid(), signal.SIGSTOP)     # a watchdog drill
            raise InjectedFault(f"injected fault at step {step}")
        outcomes.append(runtime.run_step(step))
        preflight.check_loss(outcomes[-1].loss, step)   # before it can be checkpointed
        done = step + 1
        if options.checkpoint_dir and (done == options.steps or (
                options.checkpoint_every and done % options.checkpoint_every == 0)):
            _save_checkpoint(prep, options, runtime, rank, done)
    mine = {"events": events + [e for o in outcomes for e in o.events],
            "steps": [(o.step, o.start_s, o.end_s, o.loss) for o in outcomes],
            "peak_memory_bytes": [o.peak_memory_bytes for o in outcomes],
            "memory_measure": runtime.memory.what,
            "reference": {f"{k[0]}{k[1]}" if isinstance(k, tuple) else k: v
                          for k, v in runtime.reference.items()},
            "state": runtime.captured() if options.capture_state else None}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    result = _assemble(prep, options, gathered, emulated, factors, backend, first_step)
    if rank == 0:
        if options.trace_path:
            result.trace.save(options.trace_path)
        if options.chrome_path:
            result.trace.save_chrome(options.chrome_path)
    return result


def _save_checkpoint(prep: Prepared, options: RunOptions, runtime: RankRuntime, rank: int,
                     done: int) -> None:
    state = {"step": done, "rng": checkpoint.rng_state(), **runtime.state_dict()}
    checkpoint.save_rank(options.checkpoint_dir, done, rank, state)
    dist.barrier()                  # every rank's file is in place ...
    if rank == 0:                   # ... before the manifest marks the checkpoint complete
        checkpoint.write_manifest(options.checkpoint_dir, done, prep.fingerprint,
                                  prep.plan.devices)


def _assemble(prep: Prepared, options: RunOptions, gathered: list, emulated: bool,
              factors: dict[str, float], backend: str, first_step: int) -> RunResult:
    plan = prep.plan
    events = sorted((e for g in gathered for e in g["events"]),
                    key=lambda e: (e.start_s, e.device))
    spans: dict[int, list[float]] = {}
    losses: dict[int, float] = {}
    for g in gathered:
        for step, start, end, loss in g["steps"]:
            span = spans.setdefault(step, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
            losses[step] = losses.get(step, 0.0) + loss
    meta = {
        "source": "measured", "emulated": emulated,
        "emulation_factors": factors if emulated else {},
        # per device, the uncontended seconds of each action ("2F" = stage 2's F) that
        # emulation stretched by the device's factor
        "reference_s": {plan.devices[r]: g["reference"] for r, g in enumerate(gathered)}
        if emulated else {},
        "emulation_scale": options.emulation_scale if emulated else 1.0,
        "device_types": {d: prep.cluster.device(d).type.name for d in plan.devices},
        "plan": portable_plan(prep), "model": prep.spec.name, "torch": torch.__version__,
        "host": socket.gethostname(), "threads": options.threads_per_rank,
        "backend": backend, "seed": options.seed, "first_step": first_step,
        # compute precision: bf16 autocast on CUDA, fp32 on the CPU (runtime.compute_forward)
        "precision": "bf16-autocast" if backend == "nccl" else "fp32",
        # per device, its peak bytes in each step run (exec.memory says what is counted)
        "peak_memory_bytes": {plan.devices[r]: g["peak_memory_bytes"]
                              for r, g in enumerate(gathered)},
        "memory_measure": gathered[0]["memory_measure"],
    }
    return RunResult(
        trace=Trace(tuple(events), meta),
        step_times_s=[spans[s][1] - spans[s][0] for s in sorted(spans)],
        losses=[losses[s] for s in sorted(losses)],
        emulated=emulated, first_step=first_step,
        state=[g["state"] for g in gathered] if options.capture_state else None)


def portable_plan(prep: Prepared) -> dict:
    """The plan as a dict that loads anywhere: a model or cluster given as a file path
    (relative to the plan file) is inlined, built-in names stay names."""
    from hyperpipe.cluster.cluster import cluster_ref
    from hyperpipe.models import model_ref
    return {**prep.plan.to_dict(), "model": model_ref(prep.spec),
            "cluster": cluster_ref(prep.cluster)}
