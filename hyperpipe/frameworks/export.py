"""Take a plan to the framework people train with: torchtitan, Megatron-LM, DeepSpeed.

Each exporter writes the files that framework reads to run the plan (`export_files`:
torchtitan's TOML job config and its schedule CSV, Megatron-LM's launch line, DeepSpeed's
JSON with Megatron-DeepSpeed's launch line) and lists, as ``# cannot express:`` lines,
what it cannot: the frameworks build one pipeline layout and repeat it over every
data-parallel replica, with one micro-batch size and one tensor-parallel degree, so a
heterogeneous plan (replicas with different layouts, micro-batches or devices per stage,
stages with different tp) exports its first replica's layout with those lines saying
what is lost. A ``# cost:`` line gives the simulated price of running the export instead
of the plan, whenever something is lost or the times differ anyway (the framework's
launcher places ranks in its own order; its defaults apply), or says "not simulated" and
why where the framework would refuse the export (a global batch that does not divide
evenly over the replicas, more ranks than the plan's cluster has). `hyperpipe import` reads
every file written here back into a plan with the same partition, degrees,
micro-batching and (where the framework runs it) schedule.

Layer numbering: our layers are the pipeline's cut units, half-open ranges
``[start, end)``. For a GPT-style model layer 0 is the embedding, layers 1..n the
transformer blocks (torchtitan ``layers.0`` .. ``layers.{n-1}``, Megatron's decoder
layers) and layer n+1 the final norm, output projection and loss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple

from hyperpipe.core.errors import BadInput, HyperPipeError
from hyperpipe.frameworks.job import stage_units
from hyperpipe.frameworks.megatron import ROTARY_BASE
from hyperpipe.models.spec import ModelSpec
from hyperpipe.plan.kinds import DEFAULT_KIND, KINDS, schedule_kind
from hyperpipe.plan.plan import Plan, pipeline_placement, schedule_for

FRAMEWORKS = ("torchtitan", "megatron", "deepspeed")
# The main file's suffix per framework; `export_files` names the others after its stem.
SUFFIX = {"torchtitan": ".toml", "megatron": ".sh", "deepspeed": ".json"}


def _runs_in(kind: str, framework: str) -> bool:
    """Whether `framework`'s own schedule is `kind` (`ScheduleKind.runs_in`)."""
    known = KINDS.get(kind)
    return known is not None and framework in known.runs_in


@dataclass(frozen=True)
class Layout:
    """What the frameworks can take from a plan: the first replica's stages (layer
    ranges in stage order), pp, tp, dp and micro-batch, the global batch, and what was
    lost. `num_microbatches` is what the frameworks give every replica: global batch /
    (micro-batch x dp), rounded up where that does not divide (the frameworks refuse
    such a batch; `layout_of` then lists it as lost)."""

    stages: tuple[tuple[int, int], ...]
    pp: int
    chunks: int
    tp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    global_batch: int
    schedule: str
    recompute: str = "none"
    sequence_parallel: bool = False
    lost: list[str] = field(default_factory=list)
    device_types: list[str] = field(default_factory=list)
    cp: int = 1                       # context-parallel degree (every stage's)


def layout_of(plan: Plan) -> Layout:
    """The layout every framework here builds (one for all replicas), and the list of
    what the plan has that it cannot hold."""
    first = plan.pipelines[0]
    lost: list[str] = []
    ranges = tuple(s.layers for s in first.stages)
    dp = len(plan.pipelines)
    # the frameworks split the global batch evenly: micro-batches of replica 0's size,
    # the same count on every replica
    share = first.micro_batch * dp
    counts = -(-plan.global_batch // share)
    for i, p in enumerate(plan.pipelines[1:], start=1):
        other = tuple(s.layers for s in p.stages)
        if other != ranges:
            lost.append(f"replica {i} has its own stage layout {_ranges(other)} (replica 0: "
                        f"{_ranges(ranges)}); the framework repeats replica 0's on every "
                        "replica")
        if p.micro_batch != first.micro_batch or p.num_microbatches != first.num_microbatches:
            lost.append(f"replica {i} takes {p.num_microbatches} x {p.micro_batch} samples "
                        f"(replica 0: {first.num_microbatches} x {first.micro_batch}); "
                        "the framework gives every replica the same share of the batch "
                        f"({counts} x {first.micro_batch})")
    if plan.global_batch % share:
        lost.append(f"global batch {plan.global_batch}, not a multiple of micro-batch x "
                    f"data-parallel degree = {first.micro_batch} x {dp}: the framework "
                    "gives every replica the same number of micro-batches and refuses the "
                    "export as written")
    tps = {s.tp for p in plan.pipelines for s in p.stages}
    if len(tps) > 1:
        lost.append(f"stages use different tensor-parallel degrees {sorted(tps)}; the "
                    f"framework uses one ({first.stages[0].tp})")
    recompute = {s.recompute for p in plan.pipelines for s in p.stages}
    if len(recompute) > 1:
        lost.append(f"stages recompute differently {sorted(recompute)}; set recomputation "
                    "per model in the framework")
    cps = sorted({s.cp for p in plan.pipelines for s in p.stages})
    if len(cps) > 1:
        lost.append(f"stages use different context-parallel degrees {cps}; the framework "
                    f"uses one ({first.stages[0].cp})")
    pp = len(first.stages) // plan.chunks          # pipeline ranks (not devices: tp)
    return Layout(ranges, pp, plan.chunks, first.stages[0].tp, dp,
                  first.micro_batch, counts, plan.global_batch,
                  plan.schedule, first.stages[0].recompute,
                  any(s.sequence_parallel for s in first.stages), lost,
                  sorted(_device_types(plan)), first.stages[0].cp)


def _moe_lost(plan: Plan, spec: ModelSpec) -> list[str]:
    """The `# cannot express:` line of a mixture-of-experts model (empty for a dense
    one): no export here writes experts, their router or expert parallelism."""
    moe = spec.config.moe if spec.config is not None else None
    if moe is None:
        return []
    eps = sorted({s.ep for p in plan.pipelines for s in p.stages})
    return [f"the mixture of experts ({moe.experts} experts, top {moe.top_k}, every "
            f"{moe.every} block{'s' if moe.every != 1 else ''}) and expert parallelism "
            f"(ep {', '.join(map(str, eps))}): the settings below describe the model "
            "with dense blocks"]


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


def export_files(plan: Plan, framework: str, main: str | None = None) -> dict[str, str]:
    """The files `framework` reads to run `plan`, by name: the main one first, named
    `main` (default ``job`` + `SUFFIX`), the others after its stem (``job.schedule.csv``,
    ``job.args``); the main file (DeepSpeed: the launch file) starts with the header and
    the ``# cannot express:`` lines (module docstring). BadInput, before anything is
    written, for a DeepSpeed `main` named ``*.args`` (the launch arguments' name)."""
    if framework not in FRAMEWORKS:
        raise BadInput("to", f"one of {', '.join(FRAMEWORKS)}", framework)
    main = main or f"job{SUFFIX[framework]}"
    stem = main.rsplit(".", 1)[0] if "." in main else main
    if framework == "deepspeed" and main == f"{stem}.args":
        raise BadInput("--out", f"a name for DeepSpeed's JSON other than {main}, the name "
                       f"of the launch arguments written beside it (e.g. {stem}.json)",
                       has_got=False)
    spec = plan.load_model()
    # The same check simulate and run make: a plan they refuse is not exported either.
    plan.check(spec, plan.load_cluster())
    lay = layout_of(plan)
    files, lost = {"torchtitan": _torchtitan, "megatron": _megatron,
                   "deepspeed": _deepspeed}[framework](plan, lay, spec, stem, main)
    moe = _moe_lost(plan, spec)
    head = [f"# {framework} settings for plan {plan.source} ({spec.name}, "
            f"{replicas_x_stages(lay.dp, len(lay.stages))}, schedule {lay.schedule}; "
            "our layer ranges are half-open [start, end))"]
    if len(lay.device_types) > 1:
        head.append(f"# note: device types differ ({', '.join(lay.device_types)}): start "
                    "the ranks so that each gets the plan's device for its stage (the "
                    "launchers number ranks pipeline rank outermost, then replica, then "
                    "context rank, tensor rank innermost)")
    head += [f"# cannot express: {line}" for line in moe + lay.lost + lost]
    # what the framework runs may differ from the plan even where nothing is lost: its
    # launcher places ranks in its own order, and its defaults (blocking sends) apply
    if moe:
        head.append("# cost: not simulated: the export describes another model (dense "
                    "blocks) than the plan's")
    elif lay.lost or lost:
        head.append(f"# cost: {cost_of_export(plan, framework, files, main).line}")
    else:
        cost = cost_of_export(plan, framework, files, main)
        # nothing dropped: an export that cannot be priced stands without its price
        if cost.change is not None and abs(cost.change) >= EXPORT_COST_SHOWN:
            head.append(f"# cost: {cost.line}")
    if framework == "deepspeed":           # JSON has no comments: they go in the launch file
        args = next(name for name in files if name != main)
        files[args] = "\n".join(head) + "\n" + files[args]
    else:
        files[main] = "\n".join(head) + "\n" + files[main]
    return files


# An export whose simulated time differs from the plan's by this fraction or more says
# so in a `# cost:` line even when it drops nothing
EXPORT_COST_SHOWN = 0.001


class ExportCost(NamedTuple):
    """The export's simulated time against the plan's."""

    change: float | None   # theirs / ours - 1; None: not simulated (`line` says why)
    line: str              # the `# cost:` line's text


def cost_of_export(plan: Plan, framework: str, files: dict[str, str], main: str
                   ) -> ExportCost:
    """What running the export instead of the plan costs, simulated: the plan against the
    plan that `framework` runs from `files` (its export, read back by `hyperpipe import`
    onto the plan's cluster with the plan's model, as the framework's launcher would
    place it), with the line "the export runs 12.3% slower than the plan (1.2345 s vs
    1.0990 s per iteration, simulated, ranks in the launcher's order)"; where the
    framework would refuse the export (its import fails: a batch it does not divide,
    more ranks than the cluster has), "not simulated: " and why, naming the export's
    file."""
    import os
    import tempfile
    from pathlib import Path

    from hyperpipe.frameworks.importer import import_plan
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate

    spec, cluster = plan.load_model(), plan.load_cluster()
    with tempfile.TemporaryDirectory(prefix="hyperpipe-export-") as tmp:
        for name, text in files.items():
            Path(tmp, name).write_text(text)
        args = next((Path(tmp, n) for n in files if n != main), None) \
            if framework == "deepspeed" else None
        try:
            runnable, _ = import_plan(framework, Path(tmp, main), cluster, args=args,
                                      model=spec.to_dict())
        except HyperPipeError as exc:      # named as the export's file, not the copy's
            why = str(exc).replace(os.path.join(tmp, ""), "")
            return ExportCost(None, f"not simulated: the framework would refuse the export "
                              f"on the plan's cluster ({why})")
    try:
        ours = simulate(plan, CostModel(spec, cluster)).metrics.iteration_time_s
        # priced with the model as the framework trains it: the plan's shapes in the
        # job's precision (`Job.precision`: torchtitan without FSDP trains fp32 or under
        # autocast)
        theirs = simulate(runnable, CostModel(runnable.load_model(), cluster)
                          ).metrics.iteration_time_s
    except HyperPipeError as exc:
        return ExportCost(None, f"not simulated: {exc}")
    change = theirs / ours - 1.0
    word = "slower" if change >= 0 else "faster"
    return ExportCost(change, f"the export runs {abs(change):.1%} {word} than the plan "
                      f"({theirs:.4f} s vs {ours:.4f} s per iteration, simulated, ranks in "
                      "the launcher's order)")


def export(plan: Plan, framework: str) -> str:
    """The export as one text for stdout: the main file, then each other file headed by
    ``# ==> NAME <==`` (as comment lines after a TOML, so that it stays one TOML)."""
    files = export_files(plan, framework)
    names = list(files)
    out = files[names[0]].rstrip() + "\n"
    for name in names[1:]:
        body = files[name].rstrip()
        if framework == "torchtitan":
            body = "\n".join(f"# {line}" for line in body.splitlines())
        out += f"# ==> {name} <==\n{body}\n"
    return out


# ---------------------------------------------------------------- torchtitan
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


def _flavor(spec: ModelSpec) -> str | None:
    """The torchtitan Llama 3 flavour whose shapes `spec` has, if any."""
    from hyperpipe.frameworks.torchtitan import LLAMA3_FLAVORS, ffn_hidden
    c = spec.config
    for name, (dim, layers, heads, kv, mult, multiple_of, theta, vocab) in \
            LLAMA3_FLAVORS.items():
        if (c.d_model, c.n_layer, c.n_head, c.n_kv_head, c.head_dim, c.ffn_hidden,
                c.vocab_size, c.mlp, c.norm, c.position, c.rope_theta, c.bias) == \
                (dim, layers, heads, kv or heads, dim // heads,
                 ffn_hidden(dim, mult, multiple_of), vocab, "swiglu", "rmsnorm", "rope",
                 theta, False):
            return name
    return None


def torchtitan_schedule_class(plan: Plan) -> str:
    """The pipelining class named beside the CSV: the kind's own where torch has one
    (`ScheduleKind.torch_schedule`, the name the import reads back), else one whose stage
    placement matches (torchtitan places V stages only for ZBVZeroBubble and DualPipeV;
    distributed/pipeline_parallel.py, pipeline_module_split)."""
    own = schedule_kind(plan.schedule).torch_schedule
    if own is not None:
        return own
    from hyperpipe.plan.plan import pipeline_placement
    if pipeline_placement(plan, plan.pipelines[0]) == "v":
        return "ZBVZeroBubble"
    return "PipelineScheduleMulti" if plan.chunks > 1 else "PipelineScheduleSingle"


# Format: torchtitan's TOML job config (pytorch/torchtitan torchtitan/config/job_config.py,
#   the TOML releases up to 0.2.2): [model] name/flavor, [training] local_batch_size,
#   global_batch_size, seq_len, mixed_precision_param, [parallelism] the degrees,
#   pipeline_parallel_schedule (+ pipeline_parallel_schedule_csv, which torchtitan replays
#   with torch's _PipelineScheduleRuntime), pipeline_parallel_microbatch_size and
#   module_fqns_per_model_part, [activation_checkpoint] mode.
def _torchtitan(plan: Plan, lay: Layout, spec: ModelSpec, stem: str, main: str
                ) -> tuple[dict[str, str], list[str]]:
    n = _blocks(spec)
    lost = []
    flavor = _flavor(spec)
    if flavor is None:
        lost.append(f"model {spec.name}: torchtitan builds the llama3 flavours only; add "
                    "one with these shapes (torchtitan/models/llama3 llama3_args), or import "
                    "back with --model")
    c = spec.config
    dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(spec.storage_dtype)
    if dtype is None:
        lost.append(f"dtype {spec.dtype}: torchtitan trains in bfloat16 or float32")
        dtype = "bfloat16"
    if spec.dtype == "tf32":
        lost.append(TF32_LOST)
    if plan.distributed_optimizer and plan.zero < 3:
        lost.append(f"zero {plan.zero} as FSDP (data_parallel_shard_degree): torchtitan "
                    "shards parameters and gradients too")
    if lay.sequence_parallel != (lay.tp > 1):
        lost.append("sequence parallelism: torchtitan's tensor parallelism always splits "
                    "the norms' sequence")
    if lay.pp == 1 and lay.schedule != DEFAULT_KIND:
        lost.append(f"schedule {lay.schedule}: with one pipeline stage torchtitan runs no "
                    "pipeline schedule (forward, then backward, per micro-batch)")
    replicate, shard = (1, lay.dp) if plan.distributed_optimizer else (lay.dp, 1)
    # torchtitan applies mixed_precision_param only through FSDP (dp_shard or cp above
    # 1); without it TP and PP jobs train fp32, the others under torch.autocast
    # (torchtitan/distributed/utils.py, maybe_enable_amp): what the import reads back
    if spec.storage_dtype != "fp32" and shard == 1 and lay.cp == 1:
        if lay.tp > 1 or lay.pp > 1:
            lost.append(f"{spec.dtype} without FSDP: torchtitan trains tensor- and "
                        "pipeline-parallel jobs in fp32 unless FSDP shards the weights "
                        "(maybe_enable_amp), so this export runs fp32; a plan with zero 1 "
                        "or more over several replicas, or cp above 1, exports as FSDP and "
                        f"trains {spec.dtype}")
        elif spec.optimizer_state != "autocast":
            lost.append(f"{spec.dtype} with an optimizer state of '{spec.optimizer_state}':"
                        " without FSDP, tensor or pipeline parallelism torchtitan trains "
                        "under torch.autocast (fp32 weights, gradients and moments, cast "
                        "at each use; maybe_enable_amp)")
    mode = {"none": "none", "selective": "selective", "full": "full"}[lay.recompute]
    local = lay.micro_batch * (lay.num_microbatches if lay.pp > 1 else 1)
    # fp8: torchtitan's Float8 training swaps the blocks' nn.Linear for torchao's
    # Float8Linear (torchtitan/components/quantization/float8.py, `converters`)
    lines = ["[model]", 'name = "llama3"', f'flavor = "{flavor or spec.name}"',
             *(['converters = ["float8"]'] if spec.dtype == "fp8" else []), "",
             # without a pipeline torchtitan accumulates global / (local x dp) steps
             "[training]", f"local_batch_size = {local}",
             f"global_batch_size = {lay.global_batch}", f"seq_len = {c.seq_len}",
             f'mixed_precision_param = "{dtype}"', "",
             "[parallelism]", f"data_parallel_replicate_degree = {replicate}",
             f"data_parallel_shard_degree = {shard}",
             f"tensor_parallel_degree = {lay.tp}",
             f"pipeline_parallel_degree = {lay.pp}"]
    if lay.cp > 1:      # FSDP then shards over dp_shard x cp, as the plan's zero does
        lines.append(f"context_parallel_degree = {lay.cp}")
    files: dict[str, str] = {}
    csv_name = f"{stem}.schedule.csv"
    if lay.pp > 1:
        lines += [f'pipeline_parallel_schedule = "{torchtitan_schedule_class(plan)}"',
                  f'pipeline_parallel_schedule_csv = "{csv_name}"   # beside this file',
                  f"pipeline_parallel_microbatch_size = {lay.micro_batch}",
                  "module_fqns_per_model_part = ["]
        lines += ["  [" + ", ".join(f'"{x}"' for x in torchtitan_fqns(s, n)) + "],"
                  for s in lay.stages]
        lines.append("]")
    lines += ["", "[activation_checkpoint]", f'mode = "{mode}"']
    if mode == "selective":
        lines.append('selective_ac_option = "op"')
    files[main] = "\n".join(lines) + "\n"
    if lay.pp > 1:
        files[csv_name] = schedule_for(plan, 0).to_torch_csv()
    return files, lost


# ---------------------------------------------------------------- Megatron-LM
def megatron_layout(stages: tuple[tuple[int, int], ...], n_blocks: int) -> str:
    """Megatron-LM's --pipeline-model-parallel-layout for our stages."""
    return "|".join(stage_units(stages, n_blocks))


# tf32 has no switch in any of the three frameworks: PyTorch multiplies fp32 on TF32
# tensor cores where `torch.backends.cuda.matmul.allow_tf32` is set (NGC containers set
# it through NVIDIA_TF32_OVERRIDE / TORCH_ALLOW_TF32_CUBLAS_OVERRIDE)
TF32_LOST = ("dtype tf32: exported as fp32; for TF32 matmuls set "
             "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 (or torch.backends.cuda.matmul.allow_tf32)")


def megatron_model_args(spec: ModelSpec, tp: int, lost: list[str],
                        deepspeed: bool = False) -> list[str]:
    """Megatron-LM's flags for the model's shape, precision and attention; with
    `deepspeed`, as Megatron-DeepSpeed spells those it names otherwise
    (microsoft/Megatron-DeepSpeed megatron/arguments.py: --num-key-value-heads,
    --use-rotary-position-embeddings, --use-flash-attn-v2, --normalization rmsnorm; no
    --attention-backend, eager attention being its default)."""
    c = spec.config
    args = [f"--num-layers {c.n_layer}", f"--hidden-size {c.d_model}",
            f"--num-attention-heads {c.n_head}", f"--ffn-hidden-size {c.ffn_hidden}",
            f"--seq-length {c.seq_len}", f"--max-position-embeddings {c.seq_len}",
            f"--vocab-size {c.vocab_size}", "--make-vocab-size-divisible-by 1",
            f"--hidden-dropout {c.dropout:g}", f"--attention-dropout {c.dropout:g}"]
    if deepspeed:
        args += ["--use-flash-attn-v2"] if c.attention == "flash" else []
    else:
        args.append(f"--attention-backend {'flash' if c.attention == 'flash' else 'unfused'}")
    if c.vocab_size % tp:
        lost.append(f"vocabulary {c.vocab_size}: Megatron-LM pads it to a multiple of tp "
                    f"({-(-c.vocab_size // tp) * tp})")
    if c.n_kv_head != c.n_head:
        args += [f"--num-key-value-heads {c.n_kv_head}"] if deepspeed else \
            ["--group-query-attention", f"--num-query-groups {c.n_kv_head}"]
    if c.head_dim * c.n_head != c.d_model:
        args.append(f"--kv-channels {c.head_dim}")     # Megatron's name for the head size
    if c.mlp == "swiglu":
        args.append("--swiglu")
    if c.norm == "rmsnorm":
        args.append("--normalization rmsnorm" if deepspeed else "--normalization RMSNorm")
    if c.position == "rope" and deepspeed:
        args.append("--use-rotary-position-embeddings")
        if c.rope_theta != ROTARY_BASE:
            lost.append(f"rotary base {c.rope_theta:g}: Megatron-DeepSpeed's launch line "
                        f"sets none ({ROTARY_BASE:g} is its default; it does not change "
                        "the step's time)")
    elif c.position == "rope":
        args += ["--position-embedding-type rope", f"--rotary-base {c.rope_theta:g}"]
    if not c.bias:
        args.append("--disable-bias-linear")
    if not getattr(c, "tie_embeddings", True):
        args.append("--untie-embeddings-and-output-weights")
    if not getattr(c, "fused_elementwise", True):
        args += ["--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                 "--no-masked-softmax-fusion"]
    if spec.storage_dtype != "fp32":
        args.append(f"--{spec.storage_dtype}")
    if spec.dtype == "fp8":
        if deepspeed:
            lost.append("dtype fp8: Megatron-DeepSpeed has no fp8 training; exported as bf16")
        else:       # Transformer Engine's delayed scaling, e4m3 forward, e5m2 gradients
            args.append("--fp8-format hybrid")
    elif spec.dtype == "tf32":
        lost.append(TF32_LOST)
    return args


def _recompute_args(recompute: str) -> list[str]:
    return {"none": [], "selective": ["--recompute-granularity selective"],
            "full": ["--recompute-granularity full", "--recompute-method uniform",
                     "--recompute-num-layers 1"]}[recompute]


def megatron_split_args(lay: Layout, n: int, lost: list[str]) -> list[str]:
    """The fewest flags that give Megatron-LM our stages: none for its even split,
    --num-layers-per-virtual-pipeline-stage for an even interleaved split, uneven first
    and last stages, else --pipeline-model-parallel-layout (any split)."""
    blocks = [sum(1 for x in range(a, b) if 1 <= x <= n) for a, b in lay.stages]
    even = len(set(blocks)) == 1 and lay.stages[0][0] == 0 and \
        all(b - a == blocks[0] + (k == 0) + (k == len(blocks) - 1)
            for k, (a, b) in enumerate(lay.stages))
    if even and lay.chunks > 1:
        return [f"--num-layers-per-virtual-pipeline-stage {blocks[0]}"]
    if even:
        return []
    middle = blocks[1:-1]
    if lay.chunks == 1 and lay.pp > 2 and len(set(middle)) == 1 and blocks[0] >= 1 \
            and blocks[-1] >= 1:
        return [f"--decoder-first-pipeline-num-layers {blocks[0]}",
                f"--decoder-last-pipeline-num-layers {blocks[-1]}"]
    return [f'--pipeline-model-parallel-layout "{megatron_layout(lay.stages, n)}"']


# Format: Megatron-LM arguments (NVIDIA/Megatron-LM megatron/training/arguments.py) after
#   the torchrun launcher: the model's shape, --tensor/pipeline-model-parallel-size (the
#   data-parallel size is world / (pp x tp)), the split (`megatron_split_args`), batch,
#   recompute, sequence parallelism, the distributed optimizer and gradient overlap.
def _megatron(plan: Plan, lay: Layout, spec: ModelSpec, stem: str, main: str
              ) -> tuple[dict[str, str], list[str]]:
    n = _blocks(spec)
    lost: list[str] = []
    world = lay.dp * lay.pp * lay.tp * lay.cp
    args = [f"--tensor-model-parallel-size {lay.tp}",
            f"--pipeline-model-parallel-size {lay.pp}",
            *([f"--context-parallel-size {lay.cp}"] if lay.cp > 1 else []),
            *megatron_model_args(spec, lay.tp, lost),
            f"--micro-batch-size {lay.micro_batch}",
            f"--global-batch-size {lay.global_batch}",
            *megatron_split_args(lay, n, lost), *_recompute_args(lay.recompute)]
    if lay.sequence_parallel:
        args.append("--sequence-parallel")
    if plan.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if plan.zero >= 2:
        lost.append(f"zero {plan.zero}: Megatron-LM's distributed optimizer shards the "
                    "optimizer state (zero 1) beside a pipeline; gradients and weights stay "
                    "whole")
    runtime = plan.runtime_settings()
    if runtime.overlap_grad_reduce:
        args.append("--overlap-grad-reduce")
    if lay.chunks > 1 and runtime.p2p == "blocking":
        args.append("--no-overlap-p2p-communication")
    if not _runs_in(lay.schedule, "megatron"):
        lost.append(f"schedule {lay.schedule}: Megatron-LM runs 1F1B (interleaved with "
                    "virtual stages)")
    if lay.chunks > 1 and pipeline_placement(plan, plan.pipelines[0]) == "v":
        lost.append("V placement: Megatron-LM's virtual stages are looped (chunk c of "
                    "pipeline rank r is stage c x pp + r), so stages move to other ranks")
    launch = [f"torchrun --nnodes 1 --nproc-per-node {world} pretrain_gpt.py"] + args
    text = (f"# {world} ranks; across nodes: torchrun --nnodes N --nproc-per-node "
            f"{world}/N ...\n" + " \\\n    ".join(launch) + "\n")
    return {main: text}, lost


# ---------------------------------------------------------------- DeepSpeed
# Format: DeepSpeed's JSON (deepspeed/runtime/config.py: train_batch_size,
#   train_micro_batch_size_per_gpu, gradient_accumulation_steps, zero_optimization.stage,
#   bf16/fp16, and the `pipeline` section, where `partition` holds explicit boundaries when
#   none of DeepSpeed's partition methods gives them) and Megatron-DeepSpeed's launch line
#   (the Megatron flags above, --pp-partition-method, --checkpoint-activations,
#   --deepspeed --deepspeed_config). Boundaries index GPTModelPipe's layer list
#   (`hyperpipe.frameworks.deepspeed`). A ZeRO-2/3 plan without a pipeline runs on
#   DeepSpeed's engine (--no-pipeline-parallel: Megatron's GPTModel, no partition), its
#   gradients reduce-scattered beside the backward (zero_optimization.overlap_comm).
def _deepspeed(plan: Plan, lay: Layout, spec: ModelSpec, stem: str, main: str
               ) -> tuple[dict[str, str], list[str]]:
    from hyperpipe.frameworks import deepspeed as ds
    from hyperpipe.frameworks.job import Notes
    n = _blocks(spec)
    lost: list[str] = []
    # DeepSpeed's pipeline engine refuses ZeRO-2/3 (deepspeed/runtime/pipe/engine.py:
    # "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"), and Megatron-
    # DeepSpeed's pretrain_gpt.py builds the pipeline model unless --no-pipeline-parallel
    no_pipe = plan.zero >= 2 and lay.pp == 1
    if lay.chunks > 1:
        lost.append("interleaved stages: DeepSpeed's pipeline holds one stage per rank")
    if not _runs_in(lay.schedule, "deepspeed"):
        lost.append(f"schedule {lay.schedule}: " + (
            "without a pipeline DeepSpeed's engine runs each micro-batch's forward and "
            "backward in turn" if no_pipe else "DeepSpeed's TrainSchedule is 1F1B"))
    if lay.recompute == "selective":
        lost.append("selective recompute: Megatron-DeepSpeed checkpoints whole layers "
                    "(--checkpoint-activations)")
    if lay.sequence_parallel:
        lost.append("sequence parallelism: not in Megatron-DeepSpeed's pipeline engine")
    if lay.cp > 1:
        lost.append(f"context parallelism (cp {lay.cp}): Megatron-DeepSpeed has no ring "
                    "attention (its sequence parallelism is DeepSpeed-Ulysses); the export "
                    "runs one context rank per stage")
    half = spec.storage_dtype != "fp32"
    parts = ds.parts_of(lay.stages, n, half)
    method = None
    specs = len(ds.pipe_specs(n, half))
    if lay.chunks > 1:          # the nearest runnable: DeepSpeed's default split of pp stages
        # (uniform where the balanced split is past its bound, `ds.MAX_BALANCED_STEPS`)
        method = ds.DEFAULT_METHOD if ds.balanced_steps(specs, lay.pp) <= \
            ds.MAX_BALANCED_STEPS else "uniform"
        parts = list(ds.method_parts(method, n, half, None, lay.pp))
    for candidate in ("uniform", "type:transformer", "type:transformer|embedding",
                      "parameters") if method is None else ():
        if candidate != "uniform" and \
                ds.balanced_steps(specs, len(lay.stages)) > ds.MAX_BALANCED_STEPS:
            break               # the explicit partition below states the plan's stages
        weights = ds.spec_weights(spec.to_dict(), half) if candidate == "parameters" else None
        weights = None if weights is None else tuple(weights)
        got = list(ds.method_parts(candidate, n, half, weights, len(lay.stages)))
        try:
            same = ds.stages_of(got, n, "", Notes()) == lay.stages
        except BadInput:
            same = False
        if same:
            method = candidate
            break
    world = lay.dp * lay.pp * lay.tp
    # bf16 at ZeRO stage 0 runs BF16_Optimizer, pipeline or not, which shards the fp32
    # state as ZeRO-1 does (`ds.bf16_sharded`): the import reads it back as zero 1
    bf16 = ds.bf16_sharded(spec.storage_dtype, 0)
    if bf16 and not plan.distributed_optimizer and lay.dp > 1:
        lost.append("a whole optimizer state per replica: DeepSpeed's bf16 optimizer "
                    "(BF16_Optimizer, at ZeRO stage 0) shards it over the data-parallel "
                    "ranks")
    zero = 1 if plan.distributed_optimizer and not bf16 else 0
    if plan.zero >= 2 and lay.pp > 1:
        # deepspeed/runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with
        # pipeline parallelism"
        lost.append(f"zero {plan.zero}: DeepSpeed's pipeline engine runs ZeRO-1 at most")
    elif plan.zero >= 2:
        zero = plan.zero
    config: dict = {"train_batch_size": lay.global_batch,
                    "train_micro_batch_size_per_gpu": lay.micro_batch,
                    "gradient_accumulation_steps": lay.num_microbatches,
                    "zero_optimization": {"stage": zero}}
    if no_pipe:
        # the plan prices ZeRO-2/3's per-backward reduce-scatter as overlapped with the
        # backward (`hyperpipe.sim.sharding`); DeepSpeed's default is that only at stage 3
        config["zero_optimization"]["overlap_comm"] = True
    if half:
        config[spec.storage_dtype] = {"enabled": True}
    if method is None and not no_pipe:
        config["pipeline"] = {"partition": parts}
    model_args = megatron_model_args(spec, lay.tp, lost, deepspeed=True)
    args = [f"deepspeed --num_nodes 1 --num_gpus {world} pretrain_gpt.py",
            f"--tensor-model-parallel-size {lay.tp}",
            f"--pipeline-model-parallel-size {lay.pp}", *model_args,
            f"--micro-batch-size {lay.micro_batch}",
            f"--global-batch-size {lay.global_batch}"]
    if no_pipe:
        args.append("--no-pipeline-parallel")
    elif method is not None:
        args.append(f"--pp-partition-method '{method}'")
    if lay.recompute != "none":
        args.append("--checkpoint-activations")
    args += ["--deepspeed", f"--deepspeed_config {main}", f"--zero-stage {zero}"]
    notes = [f"# GPTModelPipe's {len(ds.pipe_specs(n, half))} layers split at {parts} "
             "(stage s holds layers[parts[s]:parts[s+1]])"]
    if no_pipe:
        notes = [f"# ZeRO-{zero} without a pipeline: --no-pipeline-parallel runs Megatron's "
                 "GPTModel on DeepSpeed's engine (its pipeline engine refuses ZeRO-2 and "
                 "ZeRO-3)"]
    elif method is None:
        notes += ["# no partition method gives these parts: they are the JSON's "
                  "pipeline.partition; build the model so that it uses them:",
                  "#   class PlannedPipe(GPTModelPipe):",
                  "#       def _partition_layers(self, method='uniform'):",
                  "#           self.parts = ds_config['pipeline']['partition']",
                  "#           stage = self._topo.get_coord(self.global_rank).pipe",
                  "#           self._set_bounds(start=self.parts[stage], "
                  "stop=self.parts[stage + 1])"]
    text = "\n".join(notes) + "\n" + " \\\n    ".join(args) + "\n"
    return {main: json.dumps(config, indent=1) + "\n", f"{stem}.args": text}, lost
