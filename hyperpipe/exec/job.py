"""One rank's whole job: join the process group, replay every step, gather the result.

`prepare` makes every check that bad input can fail (exit 2) before any rank starts;
`rank_main` is what each rank runs, started locally by `launch` or by torchrun: join
the process group (and, when emulating, reach the link emulator that rank 0 starts:
exec.links), build the RankRuntime, resume from a checkpoint if asked, align clocks (a
barrier, then each rank's t0), probe the links, run the steps (checkpointing and
injecting faults as asked), and all-gather every rank's events into one Trace.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hyperpipe.cluster.cluster import Cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.exec import checkpoint, links, preflight, tensor_parallel
from hyperpipe.exec.comm import probe_links
from hyperpipe.exec.data import rank_seed
from hyperpipe.exec.emulation import device_factors
from hyperpipe.exec.fabric import topology
from hyperpipe.exec.monitor import Reporter, peak_memory_bytes
from hyperpipe.exec.options import RunOptions, RunResult
from hyperpipe.exec.placement import adjacent_pairs, placements
from hyperpipe.exec.runnable import check_plan_runnable
from hyperpipe.exec.runtime import RankRuntime, StepOutcome
from hyperpipe.models.spec import ModelSpec
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.trace import Trace, TraceEvent

TIMEOUT_STEPS = 5.0          # waits last at least this many expected steps
REFERENCE_BUDGET_S = 4.0     # per rank, for timing its actions before the run
REFERENCE_WAIT_S = 3600.0    # a rank waiting its turn to time its actions
# why: with emulated links a data-parallel group's ring steps run on a thread beside
# the main one; Python's default 5 ms switch interval could hold a step that long
SWITCH_INTERVAL_S = 2e-4
BUSY_OPS = ("F", "B", "I", "W", "optimizer")


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
    check_plan_runnable(plan, spec)
    world = len(plan.devices)
    preflight.check_open_files(world)
    if options.inject_fault is not None and options.inject_fault[0] >= world:
        raise BadInput("--inject-fault", f"a rank below {world} (the plan has {world} "
                       "devices)", options.inject_fault[0])
    fp = checkpoint.fingerprint(plan, spec, options.seed)
    resume_from = None
    if options.checkpoint_dir is not None:
        resume_from = checkpoint.check_directory(
            options.checkpoint_dir, fp, options.seed, world, steps=options.steps,
            resume=options.resume, overwrite=options.overwrite, lr=options.lr)
        if resume_from is not None:
            preflight.check_rank_files(options.checkpoint_dir, resume_from, world)
    return Prepared(plan, spec, cluster, fp, resume_from)


def rank_main(prep: Prepared, options: RunOptions, rank: int, local_rank: int, *,
              use_cuda: bool, store: dist.Store | None = None,
              world_size: int | None = None, report: Reporter | None = None) -> RunResult:
    """Run rank `rank` of the plan: join the job, replay every step, gather the result.

    `store` and `world_size` come from the local launcher; under torchrun both are None
    and the process group is set up from the environment. `report` (see exec.monitor)
    hears of the reference-timing phase and of each step as it ends.
    """
    report = report or (lambda kind, **data: None)
    plan = prep.plan
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
    emulated = options.emulate and not use_cuda
    emulator = None
    if emulated and rank == 0:
        emulator = links.start(topology(prep.cluster, plan.devices))
    try:
        client = _links_client(emulator, rank, options.timeout_s) if emulated else None
        try:
            return _run_rank(prep, options, rank, device, emulated, client, report)
        finally:
            if client is not None:
                client.close()
    finally:
        if emulator is not None:
            emulator.stop()


def _links_client(emulator: links.Emulator | None, rank: int, timeout_s: float
                  ) -> links.Links:
    """This rank's client of the link emulator that rank 0 started (collective)."""
    where = [None, None] if emulator is None else [emulator.address, emulator.authkey]
    dist.broadcast_object_list(where, src=0)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return links.Links(where[0], where[1], rank, timeout_s)


def _run_rank(prep: Prepared, options: RunOptions, rank: int, device: torch.device,
              emulated: bool, client: links.Links | None, report: Reporter) -> RunResult:
    """The rank's part after joining the job (see the module doc); `client`: its link
    emulator client when emulating."""
    plan, spec = prep.plan, prep.spec
    backend = dist.get_backend()
    where = placements(plan)[rank]
    factors = device_factors(plan.devices, prep.cluster, options.emulation_scale) \
        if emulated else {d: 1.0 for d in plan.devices}

    def clock() -> float:
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    # dropout: same seed, same masks; one stream per tensor-parallel group, whose ranks
    # hold the same activations outside the split layers (embedding, residual dropout)
    torch.manual_seed(rank_seed(options.seed, min(where.tp_ranks, default=rank)))
    runtime = RankRuntime(plan, spec, where, seed=options.seed, lr=options.lr, device=device,
                          timeout_s=options.timeout_s, clock=clock,
                          emulation_factor=factors[where.device],
                          bucket_bytes=options.bucket_bytes,
                          overlap_dp_allreduce=options.overlap_dp_allreduce,
                          links=client,
                          nodes=[prep.cluster.device(d).node for d in plan.devices],
                          switch_nodes=frozenset(n.name for n in prep.cluster.nodes
                                                 if prep.cluster.switch_reduces(n.name)))
    first_step, rng = 0, None
    if prep.resume_from is not None:
        state = checkpoint.load_rank(options.checkpoint_dir, prep.resume_from, rank)
        _check_rank_state(state, runtime, str(checkpoint.rank_file(
            options.checkpoint_dir, prep.resume_from, rank)), rank, prep.resume_from)
        runtime.load_state_dict(state)
        rng, first_step = state["rng"], int(state["step"])
    if emulated:
        # the reference passes draw dropout masks too: on a stream of their own, so that
        # the run's masks do not depend on whether it emulates
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _reference_phase(runtime, options, prep, rank, report)
        busy = _expected_busy_s(runtime, factors[where.device])
        report("expected", device=where.device, busy_s=busy)
        # Every wait may last a whole step of the slowest rank: give waits at least a few
        # expected steps (the sum of all ranks' busy time bounds one step from above).
        total = torch.tensor([busy], dtype=torch.float64)
        dist.all_reduce(total)
        runtime.timeout_s = max(options.timeout_s, TIMEOUT_STEPS * float(total.item()))
        if client is not None:
            client.timeout_s = runtime.timeout_s
    if rng is not None:
        checkpoint.set_rng_state(rng)
    dist.barrier()
    t0 = time.perf_counter()        # aligned: every rank leaves the barrier together
    if client is not None:
        # emulated links need every rank on one machine, so one clock serves all: rank
        # 0's origin, exact where the barrier's exits differ by scheduling
        origin = torch.tensor([t0], dtype=torch.float64)
        dist.broadcast(origin, src=0)
        t0 = float(origin.item())
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
        outcome = runtime.run_step(step)
        outcomes.append(outcome)
        preflight.check_loss(outcome.loss, step)        # before it can be checkpointed
        done = step + 1
        if options.checkpoint_dir and (done == options.steps or (
                options.checkpoint_every and done % options.checkpoint_every == 0)):
            _save_checkpoint(prep, options, runtime, rank, done)
        report("step", step=step, start_s=outcome.start_s, end_s=outcome.end_s,
               loss=outcome.loss, device=where.device,
               peak_memory_bytes=peak_memory_bytes(device),
               busy_s=sum(e.end_s - e.start_s for e in outcome.events if e.op in BUSY_OPS))
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


def _reference_phase(runtime: RankRuntime, options: RunOptions, prep: Prepared, rank: int,
                     report: Reporter) -> None:
    """Time this rank's actions for emulation, one rank at a time (uncontended), with a
    progress tick per rank. The ranks wait their turn on a group of their own with a
    long timeout (a rank may wait for all the others' timing, which on a large model
    outlasts the run's own timeout); a rank alone in its tensor-parallel group holds its
    timing to a budget (one trial round sets how many rounds fit), a group's ranks time
    together with the default rounds so that their collectives match."""
    world = dist.get_world_size()
    report("phase", text=f"timing each rank's actions for emulation, one rank at a time "
           f"({world} ranks)", total=world)
    turns = dist.new_group(backend="gloo", timeout=timedelta(seconds=REFERENCE_WAIT_S))
    # a stage's tensor- and context-parallel ranks together (their compute exchanges)
    group = runtime.where.stage_ranks or runtime.where.tp_ranks
    if runtime.sharded is not None:     # ZeRO-3: FSDP2 gathers over the stage's replicas
        group = tuple(sorted({*group, *runtime.sharded.ranks}))
    for r in range(world):
        dist.barrier(group=turns)
        if r == group[0]:
            if options.reference_profile is None and len(group) == 1:
                t = time.perf_counter()
                runtime.measure_reference(repeats=1, warmup=0)
                round_s = time.perf_counter() - t
                repeats = int(min(5, REFERENCE_BUDGET_S / max(round_s, 1e-9)))
                if repeats >= 2:
                    runtime.measure_reference(repeats=repeats, warmup=1)
            else:   # a tp group times together (same rounds on each); with a profile,
                runtime.measure_reference()     # compute is replaced below
            report("tick")
    dist.barrier(group=turns)
    if options.reference_profile:
        from hyperpipe.plan.profile import load_profile
        from hyperpipe.sim.costmodel import CostModel
        runtime.reference_from(CostModel(prep.spec, prep.cluster,
                                         load_profile(options.reference_profile)))


def _expected_busy_s(runtime: RankRuntime, factor: float) -> float:
    """Compute seconds one step of this rank should take here: its actions' reference
    times stretched by its emulation factor, plus its optimizer step."""
    ref = runtime.reference
    total = sum(ref.get((a.stage, a.op), 0.0) for a in runtime.actions)
    return factor * (total + ref.get("optimizer", 0.0))


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


def _check_rank_state(state, runtime, where: str, rank: int, step: int) -> None:
    """BadInput (naming the file `where`) when a rank file that loads is not this rank's
    state after `step` steps (the checkpoint's): other stages or tensor shapes (another
    rank's file, another plan), no step or RNG state, or another step (a file of
    another checkpoint of the run)."""
    want = {str(s): st.module.state_dict() for s, st in runtime.stages.items()}
    expected = f"the state of rank {rank}'s stages {sorted(runtime.stages)}"
    stages = state.get("stages") if isinstance(state, dict) else None
    if not isinstance(stages, dict) or set(stages) != set(want) or \
            not {"optimizer", "rng", "step"} <= set(state):
        got = sorted(stages) if isinstance(stages, dict) else type(state).__name__
        raise BadInput(where, expected, f"stages {got}")
    if state["step"] != step:
        raise BadInput(where, f"the state after step {step} (the checkpoint's)",
                       f"the state after step {state['step']}")
    for s, tensors in want.items():
        saved = stages[s]
        for name, value in tensors.items():
            local = tensor_parallel.local(value)
            other = saved.get(name) if isinstance(saved, dict) else None
            if not isinstance(other, torch.Tensor) or other.shape != local.shape:
                raise BadInput(where, expected, f"stage {s}'s {name} of shape "
                               f"{None if other is None else tuple(other.shape)}")


def portable_plan(prep: Prepared) -> dict:
    """The plan as a dict that loads anywhere: a model or cluster given as a file path
    (relative to the plan file) is inlined, built-in names stay names."""
    from hyperpipe.cluster.cluster import cluster_ref
    from hyperpipe.models import model_ref
    return {**prep.plan.to_dict(), "model": model_ref(prep.spec),
            "cluster": cluster_ref(prep.cluster)}
