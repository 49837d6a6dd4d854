"""A training job as a framework states it, and the plan that runs it on a cluster.

The readers (`megatron`, `torchtitan`, `deepspeed`) each turn one framework's
configuration into a `Job`: the model document, the parallel degrees, micro-batching,
the schedule and the stages as our half-open layer ranges, with `Notes` that say what was
not read, what was assumed where the configuration is silent, and what the plan states
differently from the job. `plan_of` places a job on a cluster the way the three
frameworks number their ranks:

    global rank = ((pipeline rank x dp + replica) x cp + context rank) x tp
                  + tensor-parallel rank

pipeline outermost, then data parallelism and context parallelism, tensor parallelism
innermost: Megatron-LM's default order
``tp-cp-ep-dp-pp`` (NVIDIA/Megatron-LM megatron/core/parallel_state.py,
``initialize_model_parallel``), torchtitan's device mesh ``("pp", "dp_replicate",
"dp_shard", "cp", "tp")`` (pytorch/torchtitan torchtitan/distributed/parallel_dims.py)
and DeepSpeed's ``PipeModelDataParallelTopology`` axes ``['pipe', 'data', 'model']``
(deepspeed/runtime/pipe/topology.py). Global ranks follow the cluster's device order, as
torchrun and srun number them: node by node, the local rank being the GPU's index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hyperpipe.cluster.cluster import Cluster, cluster_ref
from hyperpipe.core.errors import BadInput, printable
from hyperpipe.models import load_model
from hyperpipe.plan.kinds import KINDS, schedule_kind
from hyperpipe.plan.plan import PLAN_FORMAT, Plan, plan_from_dict
from hyperpipe.plan.schedule import Action, stage_rank

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")


class Stated(NamedTuple):
    """A value a job states in one of its fields, kept to be checked later."""

    field: str                        # the field's name, for messages
    value: int


@dataclass
class Notes:
    """What an import says beside the plan, one line per kind (`lines`)."""

    unread: list[str] = field(default_factory=list)     # settings not read
    assumed: list[str] = field(default_factory=list)    # defaults where the job is silent
    approximated: list[str] = field(default_factory=list)   # the plan differs: how

    def lines(self) -> list[str]:
        """One line per kind of note, control characters escaped (`errors.printable`)."""
        out = []
        if self.unread:
            out.append("not read (no effect on an iteration's time or memory here, or "
                       "unknown): " + ", ".join(sorted(set(self.unread))))
        if self.assumed:
            out.append("assumed: " + "; ".join(self.assumed))
        if self.approximated:
            out.append("approximated: " + "; ".join(self.approximated))
        return [printable(line) for line in out]


@dataclass(frozen=True)
class Job:
    """One framework job, ready to be placed on a cluster (`plan_of`).

    `stages` are the p·v stages' half-open layer ranges in stage order (stage k on
    pipeline rank `stage_rank(k, pp, placement of schedule)`); `actions` per pipeline
    rank in the IR's text form when the job runs its own order (kind ``synth``).
    Batching: `global_batch` when the job states it, else `samples_per_replica`
    (torchtitan's local batch, DeepSpeed's micro-batch x accumulation steps), else one
    micro-batch per replica. `world_size` None: dp x tp x pp when the job states dp,
    else every device of the cluster."""

    framework: str
    source: str                       # the file, for messages
    model: dict[str, Any]             # a model document `load_model` reads
    tp: int
    pp: int
    chunks: int
    micro_batch: int
    schedule: str
    stages: tuple[tuple[int, int], ...]
    notes: Notes
    global_batch: int | None = None
    samples_per_replica: int | None = None
    # micro-batches per replica stated beside the global batch, which must then agree
    # with it (DeepSpeed's gradient_accumulation_steps)
    accumulation: Stated | None = None
    dp: int | None = None             # when the job states it (torchtitan)
    world_size: int | None = None     # from the launcher, when the job states it
    actions: tuple[tuple[str, ...], ...] | None = None
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    zero: int = 0                     # ZeRO stage beyond the distributed optimizer (2, 3)
    cp: int = 1                       # context-parallel degree of every stage
    stack: str = "megatron-lm"        # the plan's `stack` (hyperpipe.plan.stack.STACKS)
    runtime: dict[str, Any] = field(default_factory=dict)    # the plan's `runtime`
    # model fields the job's training decides whatever model it runs (``dtype``,
    # ``optimizer_state``): kept over a model given with ``--model`` (`importer.read_job`)
    precision: dict[str, str] = field(default_factory=dict)
    # samples per replica that one pipeline schedule step takes when the job runs several
    # steps per iteration (torchtitan: its local batch, one ``pp_schedule.step`` each);
    # None: the whole iteration is one schedule
    step_samples: int | None = None
    # the job with what follows from the data-parallel degree its ranks resolve to on a
    # cluster (`plan_of`), where the reader could not know it (torchtitan's shard
    # degree -1: FSDP only over more than one rank); None: nothing does
    settle: Callable[[Job, int], Job] | None = None


def plan_of(job: Job, cluster: Cluster) -> Plan:
    """The plan that runs `job` on `cluster`, devices assigned in the launchers' rank order
    (module docstring); BadInput when the cluster cannot hold it or the batch does not
    divide, naming the job's file and setting."""
    src = job.source
    devices = [d.name for d in cluster.devices]
    world = job.world_size
    if world is None:           # torchtitan states dp; the others run on every device
        world = job.dp * job.tp * job.pp * job.cp if job.dp is not None else len(devices)
    if world > len(devices):
        raise BadInput(f"{src}: world size", f"at most the {len(devices)} devices of cluster "
                       f"{cluster.name!r}", world)
    per_replica = job.tp * job.pp * job.cp
    if world % per_replica:
        raise BadInput(f"{src}: world size", f"a multiple of tp x cp x pp = {per_replica}",
                       world)
    dp = world // per_replica
    if job.dp is not None and job.dp != dp:
        raise BadInput(f"{src}: data-parallel degree", f"world size / (tp x cp x pp) = {dp} "
                       f"on the {world} ranks", job.dp)
    if world < len(devices):
        job.notes.assumed.append(f"the job's {world} ranks run on the first {world} of the "
                                 f"cluster's {len(devices)} devices")
    if job.settle is not None:
        job = job.settle(job, dp)
    m = _microbatches(job, dp)
    _schedule_steps(job, dp, m)
    kind = schedule_kind(job.schedule)
    placement = kind.placement if not kind.carries_actions else _actions_placement(job)
    pipelines, lists = [], {}
    for r in range(dp):
        width = job.tp * job.cp          # a stage's devices: cp tp groups, tp innermost
        groups = [devices[(k * dp + r) * width:(k * dp + r + 1) * width]
                  for k in range(job.pp)]
        stages = []
        for j, (a, b) in enumerate(job.stages):
            stages.append({"layers": [a, b], "devices": groups[stage_rank(j, job.pp,
                                                                          placement)],
                           "tp": job.tp, "cp": job.cp, "recompute": job.recompute,
                           "sequence_parallel": job.sequence_parallel and job.tp > 1})
        pipelines.append({"micro_batch": job.micro_batch, "num_microbatches": m,
                          "stages": stages})
        if job.actions is not None:
            lists.update({groups[d][0]: list(job.actions[d]) for d in range(job.pp)})
    schedule: dict[str, Any] = {"kind": job.schedule, "chunks": job.chunks}
    if job.actions is not None:
        schedule["actions"] = lists
    spec = load_model(job.model, where=f"{src}: model")
    doc = {"format": PLAN_FORMAT, "model": spec.to_dict(), "cluster": cluster_ref(cluster),
           "global_batch": dp * m * job.micro_batch, "schedule": schedule,
           "zero": max(job.zero, 1 if job.distributed_optimizer else 0), "stack": job.stack,
           "runtime": job.runtime, "pipelines": pipelines}
    plan = plan_from_dict(doc, where=src)
    plan.check(spec, cluster, where=src)
    return plan


def _microbatches(job: Job, dp: int) -> int:
    """Micro-batches per replica from the job's batch settings (`Job`)."""
    if job.global_batch is not None:
        per = dp * job.micro_batch
        if job.global_batch % per:
            raise BadInput(f"{job.source}: global batch", f"a multiple of micro-batch x "
                           f"data-parallel degree = {job.micro_batch} x {dp}", job.global_batch)
        m = job.global_batch // per
        if job.accumulation is not None and job.accumulation.value != m:
            raise BadInput(f"{job.source}: {job.accumulation.field}", f"global batch / "
                           f"(micro-batch x data-parallel degree) = {job.global_batch} / "
                           f"({job.micro_batch} x {dp}) = {m}", job.accumulation.value)
        return m
    if job.samples_per_replica is not None:
        if job.samples_per_replica % job.micro_batch:
            raise BadInput(f"{job.source}: batch per replica", f"a multiple of the "
                           f"micro-batch {job.micro_batch}", job.samples_per_replica)
        return job.samples_per_replica // job.micro_batch
    return 1


def _schedule_steps(job: Job, dp: int, m: int) -> None:
    """Check a job that runs its iteration as several schedule steps (`Job.step_samples`)
    and say, in the notes, what the plan's one schedule of all `m` micro-batches leaves
    out. torchtitan's trainer (torchtitan/train.py, ``Trainer.__init__`` and
    ``train_step``) runs global batch / (local batch x dp) accumulation steps, each one
    ``pp_schedule.step`` of local batch / micro-batch micro-batches with its own fill and
    drain; it refuses a global batch that is not a multiple of local batch x dp, and
    (distributed/pipeline_parallel.py, ``build_pipeline_schedule``) a local batch that is
    not a multiple of the micro-batch."""
    per = job.step_samples
    if per is None:
        return
    if per % job.micro_batch:
        raise BadInput(f"{job.source}: local batch", f"a multiple of the micro-batch "
                       f"{job.micro_batch}", per)
    samples = m * job.micro_batch                 # per replica and iteration
    if samples % per:
        raise BadInput(f"{job.source}: global batch", f"a multiple of local batch x "
                       f"data-parallel degree = {per} x {dp}", samples * dp)
    steps = samples // per
    if steps > 1 and job.pp > 1:
        job.notes.approximated.append(
            f"gradient accumulation: {job.framework} runs {steps} pipeline schedules of "
            f"{per // job.micro_batch} micro-batches per iteration, each with its own fill "
            f"and drain; the plan holds one schedule of {m} micro-batches, so its estimate "
            "is optimistic (fewer bubbles)")


def _actions_placement(job: Job) -> str:
    """``v`` when every action of the job's lists sits on its V rank and some is off its
    looped rank (stage k of p ranks: k mod p looped), else ``loop``."""
    rows = [[Action.from_str(a) for a in row] for row in job.actions or ()]

    def fits(placement: str) -> bool:
        return all(stage_rank(a.stage, job.pp, placement) == d
                   for d, row in enumerate(rows) for a in row)

    return "v" if not fits("loop") and fits("v") else "loop"


# ------------------------------------------------------------------ shared by readers
def framework_kind(framework: str, chunks: int) -> str:
    """The kind `framework`'s own schedule is for `chunks` stages per rank: the first in
    the registry that runs in it (`ScheduleKind.runs_in`) and takes that many chunks."""
    for kind in KINDS.values():
        if framework in kind.runs_in and kind.allows_chunks(chunks):
            return kind.name
    raise ValueError(f"{framework} runs no schedule of {chunks} chunks")


def split_blocks(n_blocks: int, per_stage: list[int]) -> tuple[tuple[int, int], ...]:
    """Our half-open layer ranges for stages holding `per_stage` transformer blocks each
    (summing to `n_blocks`), the embedding (layer 0) on the first stage and the head
    (layer n_blocks + 1) on the last. A stage of zero blocks is allowed only as the first
    (embedding alone) or the last (head alone)."""
    if sum(per_stage) != n_blocks:
        raise ValueError(f"stages hold {sum(per_stage)} blocks, the model {n_blocks}")
    out, start = [], 0
    for j, count in enumerate(per_stage):
        end = start + count + (1 if j == 0 else 0) + (1 if j == len(per_stage) - 1 else 0)
        out.append((start, end))
        start = end
    return tuple(out)


def ranges_of_units(units: list[list[str]], n_blocks: int, where: str
                    ) -> tuple[tuple[int, int], ...]:
    """Our layer ranges for stages given as lists of units, ``E`` (embedding), ``t`` (a
    block) and ``L`` (final norm, output and loss), in model order; BadInput when a stage
    is empty or the units are not the model's in order."""
    flat = [u for stage in units for u in stage]
    want = ["E"] + ["t"] * n_blocks + ["L"]
    if flat != want:
        raise BadInput(where, f"the embedding, {n_blocks} blocks and the head in order, each "
                       "once", "".join(flat)[:40])
    out, start = [], 0
    for k, stage in enumerate(units):
        if not stage:
            raise BadInput(where, "no empty stage (HyperPipe's stages hold at least one "
                           "layer)", f"stage {k} empty")
        out.append((start, start + len(stage)))
        start += len(stage)
    return tuple(out)


def stage_units(stages: tuple[tuple[int, int], ...], n_blocks: int) -> list[str]:
    """The inverse of `ranges_of_units`: each stage as ``E``/``t``/``L`` units."""
    return ["".join("E" if x == 0 else ("t" if x <= n_blocks else "L") for x in range(a, b))
            for a, b in stages]
