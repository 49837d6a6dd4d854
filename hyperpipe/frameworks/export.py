"""Take a plan to the framework people train with: torchtitan, Megatron-LM, DeepSpeed.

Each exporter writes what that framework needs to run the plan's partition and lists,
as ``# cannot express:`` lines, what it cannot: the frameworks build one pipeline layout
and repeat it over every data-parallel replica, with one micro-batch size and one
tensor-parallel degree, so a heterogeneous plan (replicas with different layouts,
micro-batches or devices per stage, stages with different tp) exports its first
replica's layout with those lines saying what is lost.

Layer numbering: our layers are the pipeline's cut units, half-open ranges
``[start, end)``. For a GPT-style model layer 0 is the embedding, layers 1..n the
transformer blocks (torchtitan ``layers.0`` .. ``layers.{n-1}``, Megatron's decoder
layers) and layer n+1 the final norm, output projection and loss.

Each exporter writes the format its project documents (stated above each exporter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyperpipe.core.errors import BadInput
from hyperpipe.models.spec import ModelSpec
from hyperpipe.plan.kinds import KINDS
from hyperpipe.plan.plan import Plan

FRAMEWORKS = ("torchtitan", "megatron", "deepspeed")


def _runs_in(kind: str, framework: str) -> bool:
    """Whether `framework`'s own schedule is `kind` (`ScheduleKind.runs_in`)."""
    known = KINDS.get(kind)
    return known is not None and framework in known.runs_in


@dataclass(frozen=True)
class Layout:
    """What the frameworks can take from a plan: the first replica's stages (layer
    ranges in stage order), pp, tp, dp, micro-batch and counts, and what was lost."""

    stages: tuple[tuple[int, int], ...]
    pp: int
    chunks: int
    tp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    global_batch: int
    schedule: str
    lost: list[str] = field(default_factory=list)
    device_types: list[str] = field(default_factory=list)


def layout_of(plan: Plan) -> Layout:
    """The layout every framework here builds (one for all replicas), and the list of
    what the plan has that it cannot hold."""
    first = plan.pipelines[0]
    lost: list[str] = []
    ranges = tuple(s.layers for s in first.stages)
    for i, p in enumerate(plan.pipelines[1:], start=1):
        other = tuple(s.layers for s in p.stages)
        if other != ranges:
            lost.append(f"replica {i} has its own stage layout {_ranges(other)} (replica 0: "
                        f"{_ranges(ranges)}); the framework repeats replica 0's on every "
                        "replica")
        if p.micro_batch != first.micro_batch or p.num_microbatches != first.num_microbatches:
            lost.append(f"replica {i} takes {p.num_microbatches} x {p.micro_batch} samples "
                        f"(replica 0: {first.num_microbatches} x {first.micro_batch}); "
                        "the framework gives every replica the same share of the batch")
    tps = {s.tp for p in plan.pipelines for s in p.stages}
    if len(tps) > 1:
        lost.append(f"stages use different tensor-parallel degrees {sorted(tps)}; the "
                    f"framework uses one ({first.stages[0].tp})")
    recompute = {s.recompute for p in plan.pipelines for s in p.stages}
    if len(recompute) > 1:
        lost.append(f"stages recompute differently {sorted(recompute)}; set recomputation "
                    "per model in the framework")
    pp = len(first.devices())
    return Layout(ranges, pp, plan.chunks, first.stages[0].tp, len(plan.pipelines),
                  first.micro_batch, first.num_microbatches, plan.global_batch,
                  plan.schedule, lost, sorted(_device_types(plan)))


def replicas_x_stages(replicas: int, stages: int) -> str:
    """The one way HyperPipe writes a plan's shape: ``2 replicas x 4 stages``."""
    return (f"{replicas} replica{'s' if replicas != 1 else ''} x "
            f"{stages} stage{'s' if stages != 1 else ''}")


def _device_types(plan: Plan) -> set[str]:
    try:
        cluster = plan.load_cluster()
    except BadInput:
        return set()
    return {cluster.device(d).type.name for d in plan.devices}


def _ranges(ranges: tuple[tuple[int, int], ...]) -> str:
    return " ".join(f"[{a}, {b})" for a, b in ranges)


def _blocks(spec: ModelSpec) -> int:
    """Transformer blocks of a GPT-style model (layers minus embedding and head)."""
    if spec.config is None:
        raise BadInput(f"model {spec.name}", "a GPT-style model (embedding, blocks, head) to "
                       "export; synthetic models have no framework equivalent", has_got=False)
    return len(spec.layers) - 2


def export(plan: Plan, framework: str) -> str:
    """The text that `framework` needs for `plan` (see the module docstring)."""
    if framework not in FRAMEWORKS:
        raise BadInput("to", f"one of {', '.join(FRAMEWORKS)}", framework)
    spec = plan.load_model()
    # The same check simulate and run make: a plan they refuse is not exported either.
    plan.check(spec, plan.load_cluster())
    lay = layout_of(plan)
    text = {"torchtitan": _torchtitan, "megatron": _megatron,
            "deepspeed": _deepspeed}[framework](lay, spec)
    head = [f"# {framework} settings for plan {plan.source} ({spec.name}, "
            f"{replicas_x_stages(lay.dp, len(lay.stages))}, schedule {lay.schedule}; "
            "our layer ranges are half-open [start, end))"]
    if len(lay.device_types) > 1:
        head.append(f"# note: device types differ ({', '.join(lay.device_types)}): start "
                    "the ranks so that each gets the plan's device for its stage (rank "
                    "order = stage order within a replica, replicas one after another)")
    head += [f"# cannot express: {line}" for line in lay.lost + text[1]]
    return "\n".join(head + [text[0]]).rstrip() + "\n"


def torchtitan_fqns(stage: tuple[int, int], n_blocks: int) -> list[str]:
    """torchtitan module names of our half-open layer range `stage`."""
    names = []
    for layer in range(*stage):
        if layer == 0:
            names.append("tok_embeddings")
        elif layer <= n_blocks:
            names.append(f"layers.{layer - 1}")
        else:
            names += ["norm", "output"]
    return names


# Format: torchtitan, ``[parallelism]`` of its TOML job config: ``pipeline_parallel_degree``,
#   ``pipeline_parallel_schedule`` (a torch.distributed.pipelining schedule class name),
#   ``pipeline_parallel_microbatch_size``, ``tensor_parallel_degree``,
#   ``data_parallel_replicate_degree``, the split points ``pipeline_parallel_split_points``
#   (the module that *begins* each stage after the first; older releases) and
#   ``module_fqns_per_model_part`` (every stage's module names; newer releases). Schedules
#   without a built-in class go through ``pipeline_parallel_schedule_csv``, which
#   `hyperpipe schedule --format torch-csv` writes.
def _torchtitan(lay: Layout, spec: ModelSpec) -> tuple[str, list[str]]:
    n = _blocks(spec)
    lost = []
    parts = [torchtitan_fqns(s, n) for s in lay.stages]
    splits = []
    for s in lay.stages[1:]:
        first = torchtitan_fqns(s, n)[0]
        if not first.startswith("layers."):
            lost.append(f"pipeline_parallel_split_points: a stage starting at {first} (only "
                        "a transformer block can begin a stage there); use "
                        "module_fqns_per_model_part")
        splits.append(first)
    lines = ["[parallelism]", f"pipeline_parallel_degree = {lay.pp}"]
    known = KINDS.get(lay.schedule)    # torch.distributed.pipelining's name for the kind
    sched = None if known is None else known.torch_schedule
    if sched is not None:
        lines.append(f'pipeline_parallel_schedule = "{sched}"')
    else:
        lines += ['pipeline_parallel_schedule = "PipelineScheduleMulti"' if lay.chunks > 1
                  else 'pipeline_parallel_schedule = "PipelineScheduleSingle"',
                  'pipeline_parallel_schedule_csv = "schedule.csv"',
                  f"# write schedule.csv with: hyperpipe schedule --kind {lay.schedule} "
                  f"--devices {lay.pp} --microbatches {lay.num_microbatches} "
                  f"--chunks {lay.chunks} --format torch-csv --out schedule.csv"]
    lines += [f"pipeline_parallel_microbatch_size = {lay.micro_batch}",
              f"tensor_parallel_degree = {lay.tp}",
              f"data_parallel_replicate_degree = {lay.dp}",
              "# older torchtitan releases:",
              "pipeline_parallel_split_points = [" + ", ".join(f'"{s}"' for s in splits) + "]",
              "# newer releases (split points are deprecated there):",
              "module_fqns_per_model_part = ["]
    lines += ["  [" + ", ".join(f'"{x}"' for x in p) + "]," for p in parts]
    lines += ["]", "", "[training]", f"global_batch_size = {lay.global_batch}",
              f"seq_len = {spec.config.seq_len}"]
    return "\n".join(lines), lost


def megatron_layout(stages: tuple[tuple[int, int], ...], n_blocks: int) -> str:
    """Megatron-LM's --pipeline-model-parallel-layout for our stages."""
    out = []
    for a, b in stages:
        tok = ""
        for layer in range(a, b):
            tok += "E" if layer == 0 else ("t" if layer <= n_blocks else "L")
        out.append(tok)
    return "|".join(out)


# Format: Megatron-LM arguments: ``--pipeline-model-parallel-size``,
#   ``--tensor-model-parallel-size`` (the data-parallel size is world / (pp x tp)),
#   ``--num-layers``,
#   ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` (the
#   middle stages share the rest evenly), ``--num-layers-per-virtual-pipeline-stage`` for
#   interleaving, and ``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` a
#   decoder layer, ``L`` the loss, ``|`` between stages), which states any layout exactly.
def _megatron(lay: Layout, spec: ModelSpec) -> tuple[str, list[str]]:
    n = _blocks(spec)
    lost = []
    blocks = [sum(1 for x in range(a, b) if 1 <= x <= n) for a, b in lay.stages]
    args = [f"--pipeline-model-parallel-size {lay.pp}",
            f"--tensor-model-parallel-size {lay.tp}",
            f"--num-layers {n}",
            f"--micro-batch-size {lay.micro_batch}",
            f"--global-batch-size {lay.global_batch}",
            f"--seq-length {spec.config.seq_len}"]
    if lay.chunks > 1:
        if len(set(blocks)) > 1:
            lost.append("--num-layers-per-virtual-pipeline-stage: interleaved stages with "
                        f"different block counts {blocks}; use the layout below")
        args.append(f"--num-layers-per-virtual-pipeline-stage {blocks[0]}")
    elif lay.pp > 1:
        first, last, middle = blocks[0], blocks[-1], blocks[1:-1]
        if len(set(middle)) > 1:
            lost.append(f"--decoder-first/last-pipeline-num-layers: middle stages hold "
                        f"different block counts {middle}; use the layout below")
        elif len(set(blocks)) > 1:
            args += [f"--decoder-first-pipeline-num-layers {first}",
                     f"--decoder-last-pipeline-num-layers {last}"]
    if not _runs_in(lay.schedule, "megatron"):
        lost.append(f"schedule {lay.schedule}: Megatron-LM runs 1F1B (interleaved with "
                    "virtual stages)")
    notes = [f"# data-parallel size = world size / (pp x tp): start {lay.dp * lay.pp * lay.tp} "
             "ranks", "# releases with custom layouts state the layout exactly instead: "
             f'--pipeline-model-parallel-layout "{megatron_layout(lay.stages, n)}"']
    return "\n".join(notes) + "\n" + " \\\n".join(args), lost


def deepspeed_parts(stages: tuple[tuple[int, int], ...]) -> list[int]:
    """DeepSpeed's stage boundaries: stage s holds layers[parts[s]:parts[s+1]]."""
    return [stages[0][0]] + [b for _, b in stages]


def uniform_parts(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's partition_method="uniform" boundaries (ds_utils.partition_uniform, as
    documented: the remainder goes one each to the first stages)."""
    parts = [0] * (num_parts + 1)
    chunk, rest = divmod(num_items, num_parts)
    for p in range(num_parts):
        parts[p + 1] = parts[p] + chunk + (1 if p < rest else 0)
    return parts


# Format: DeepSpeed ``PipelineModule(layers=..., num_stages=p, partition_method=...)``:
#   ``"uniform"`` when the plan is what DeepSpeed's own uniform split gives, else the
#   explicit boundaries ``parts`` (stage s holds ``layers[parts[s]:parts[s+1]]``, DeepSpeed's
#   own representation), with the few lines of a subclass that uses them.
def _deepspeed(lay: Layout, spec: ModelSpec) -> tuple[str, list[str]]:
    lost = []
    if lay.chunks > 1:
        lost.append("interleaved stages: DeepSpeed's pipeline holds one stage per rank")
    if not _runs_in(lay.schedule, "deepspeed"):
        lost.append(f"schedule {lay.schedule}: DeepSpeed's TrainSchedule is 1F1B")
    if lay.tp > 1:
        lost.append("tensor parallelism: give DeepSpeed a Megatron mpu for tp > 1")
    parts = deepspeed_parts(lay.stages)
    uniform = parts == uniform_parts(len(spec.layers), len(lay.stages))
    lines = ["# layers: one LayerSpec per HyperPipe layer, in order (embedding, blocks, head)",
             f"num_stages = {len(lay.stages)}",
             f"parts = {parts}   # stage s holds layers[parts[s]:parts[s+1]]"]
    if uniform:
        lines += ['partition_method = "uniform"   # gives exactly these parts',
                  "model = PipelineModule(layers=layers, num_stages=num_stages, "
                  "partition_method=partition_method)"]
    else:
        lines += ["# DeepSpeed's partition_method has no explicit-boundaries mode: set them",
                  "class PlannedPipeline(PipelineModule):",
                  "    def _partition_layers(self, method='uniform'):",
                  "        super()._partition_layers(method='uniform')",
                  "        self.parts = parts",
                  "        self._set_bounds(start=self.parts[self.stage_id],"
                  " stop=self.parts[self.stage_id + 1])",
                  "model = PlannedPipeline(layers=layers, num_stages=num_stages)"]
    lines.append(f'ds_config = {{"train_batch_size": {lay.global_batch}, '
                 f'"train_micro_batch_size_per_gpu": {lay.micro_batch}, '
                 f'"gradient_accumulation_steps": {lay.num_microbatches}}}')
    return "\n".join(lines), lost
