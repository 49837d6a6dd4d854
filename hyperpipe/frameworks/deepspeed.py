"""A DeepSpeed JSON with its launch arguments read into a `Job` (``import --from
deepspeed``), and DeepSpeed's pipeline partition of a GPT.

The JSON gives the batch (``train_batch_size``, ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps``), ``zero_optimization.stage``, ``fp16``/``bf16`` and, from
`hyperpipe export`, the explicit stage boundaries ``pipeline.partition`` (a key of
DeepSpeed's ``pipeline`` section, deepspeed/runtime/config.py ``get_pipeline_config``);
the launch arguments are Megatron-DeepSpeed's (the model shape, tp, pp, recompute, read
by `megatron.read_args`) with ``--pp-partition-method`` and the launcher's world size.

Layer indices are those of Megatron-DeepSpeed's ``GPTModelPipe`` (bigscience-workshop/
Megatron-DeepSpeed megatron/model/gpt_model.py), the pipeline GPT DeepSpeed users run:
``[to_float16, EmbeddingPipe, transpose, ParallelTransformerLayerPipe x n, transpose,
LayerNorm, EmbeddingPipe (tied head), float16_to_fp32]`` (the last only with fp16/bf16).
Our layer 0 is the first three, block i index i + 2, our head the rest; a stage boundary
is mapped through each of our layers' weighted entry (its embedding, block or head).

ZeRO: stage 1, and bf16 without ZeRO, with or without a pipeline, are the distributed
optimizer: without ZeRO DeepSpeed accumulates bf16 gradients in fp32
(deepspeed/runtime/engine.py ``get_data_types``), which ``_do_optimizer_sanity_check``
gives to BF16_Optimizer, and that partitions the fp32 state over the data-parallel ranks
(deepspeed/runtime/bf16_optimizer.py); stages 2 and 3 import as plan ``zero`` 2 and 3 without a
pipeline (``--no-pipeline-parallel``: DeepSpeed's engine runs Megatron's GPTModel), and
are refused beside a pipeline as DeepSpeed refuses them (deepspeed/runtime/pipe/engine.py:
"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"): with pp > 1, and with
pp 1 without ``--no-pipeline-parallel``, where Megatron-DeepSpeed's pretrain_gpt.py still
builds GPTModelPipe for the pipeline engine.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from hyperpipe.core.errors import BadInput, key_name
from hyperpipe.core.files import Fields, load_document, read_text
from hyperpipe.frameworks.job import Job, Notes, Stated, framework_kind
from hyperpipe.frameworks.launch import read_launch
from hyperpipe.frameworks.megatron import read_args

# Megatron-DeepSpeed's default partition method (bigscience-workshop/Megatron-DeepSpeed
# megatron/model/gpt_model.py: GPTModelPipe passes partition_method='type:transformer').
DEFAULT_METHOD = "type:transformer"

# Steps of `partition_balanced` (items^2 x parts, ~1 us each in CPython) a command may
# spend: about 10 s. GPT-3 175B's 104 specs in 104 parts take 1.1M.
MAX_BALANCED_STEPS = 10**7

_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
         "gradient_accumulation_steps", "zero_optimization", "fp16", "bf16", "pipeline")
# the keys read inside those sections; any other (an offload, a loss scale) is listed
# as not read
_SECTION_KEYS = {"zero_optimization": ("stage",), "fp16": ("enabled",),
                 "bf16": ("enabled",), "pipeline": ("partition",)}


def pipe_specs(n_blocks: int, half: bool) -> list[str]:
    """The type names of GPTModelPipe's layer list (module docstring): what DeepSpeed's
    ``type:`` partition matches and what ``parts`` index."""
    return (["_to_float16", "EmbeddingPipe", "<lambda>"]
            + ["ParallelTransformerLayerPipe"] * n_blocks
            + ["<lambda>", "LayerNorm", "EmbeddingPipe"]
            + (["float16_to_fp32"] if half else []))


def spec_start(layer: int) -> int:
    """GPTModelPipe's index where our layer `layer` starts (0 for the embedding)."""
    return 0 if layer == 0 else layer + 2


def _anchor(layer: int, n_blocks: int) -> int:
    """GPTModelPipe's index of our layer's weighted entry."""
    return 1 if layer == 0 else (layer + 2 if layer <= n_blocks else n_blocks + 5)


def parts_of(stages: tuple[tuple[int, int], ...], n_blocks: int, half: bool) -> list[int]:
    """DeepSpeed's ``parts`` (stage s holds specs[parts[s]:parts[s+1]]) for our stages."""
    return [spec_start(a) for a, _ in stages] + [len(pipe_specs(n_blocks, half))]


def stages_of(parts: list[int], n_blocks: int, where: str, notes: Notes
              ) -> tuple[tuple[int, int], ...]:
    """Our stages for DeepSpeed's ``parts``: each of our layers on the stage of its
    weighted entry; BadInput when a stage would hold none of our layers."""
    anchors = [_anchor(x, n_blocks) for x in range(n_blocks + 2)]
    bounds = [sum(1 for a in anchors if a < p) for p in parts[:-1]] + [n_blocks + 2]
    bounds[0] = 0
    stages = []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        if b <= a:
            raise BadInput(where, "stages that each hold a block, the embedding or the head",
                           f"stage {s} holds none ({parts})")
        stages.append((a, b))
    norm = n_blocks + 4                        # the final LayerNorm's index
    owner = next(s for s in range(len(parts) - 1) if parts[s] <= norm < parts[s + 1])
    if owner != len(parts) - 2:
        notes.approximated.append(f"the final norm sits on stage {owner}, priced with the "
                                  "head on the last")
    return tuple(stages)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_uniform`` (deepspeed/runtime/utils.py): equal parts, the
    first ``num_items mod num_parts`` one larger; with fewer items than parts, one each."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def balanced_steps(num_items: int, num_parts: int) -> int:
    """The steps `partition_balanced` takes for `num_items` in `num_parts`."""
    return 0 if num_items <= num_parts else num_items * num_items * num_parts


def partition_balanced(weights: list[int | float], num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced`` (deepspeed/runtime/utils.py, releases 0.17 on):
    contiguous parts minimising (heaviest part - lightest part), each split point chosen
    over the prefixes in order, a later split point winning a tie. ValueError past
    `MAX_BALANCED_STEPS` (`balanced_steps`)."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    if balanced_steps(n, num_parts) > MAX_BALANCED_STEPS:
        raise ValueError(f"{n} layers in {num_parts} stages: over {MAX_BALANCED_STEPS} steps")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i]: (cost, heaviest, lightest, split) of the first i items in j parts
    best = [[(inf, inf, inf, 0)] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0.0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            cur = best[j][i]
            for k in range(i):
                _, hi, lo, _ = best[j - 1][k]
                part = prefix[i] - prefix[k]
                top, bottom = max(hi, part), min(lo, part)
                if top - bottom <= cur[0]:
                    cur = (top - bottom, top, bottom, k)
            best[j][i] = cur
    parts = [n]
    i = n
    for j in range(num_parts, 0, -1):
        i = best[j][i][3]
        parts.append(i)
    return parts[::-1]


@lru_cache(maxsize=64)
def method_parts(method: str, n_blocks: int, half: bool, weights: tuple[float, ...] | None,
                 num_stages: int) -> tuple[int, ...]:
    """``parts`` of DeepSpeed's partition `method` (``uniform``, ``parameters`` with the
    specs' parameter counts `weights`, ``type:REGEX``) over GPTModelPipe's specs."""
    specs = pipe_specs(n_blocks, half)
    method = method.lower()
    if method == "uniform":
        return tuple(partition_uniform(len(specs), num_stages))
    if method == "parameters":
        return tuple(partition_balanced(list(weights or ()), num_stages))
    if method.startswith("type:"):
        try:
            regex = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        except re.error as exc:
            raise ValueError(f"type:REGEX with a valid regular expression ({exc})") from None
        return tuple(partition_balanced([1 if regex.search(s) else 0 for s in specs],
                                        num_stages))
    raise ValueError("an unknown method")


def spec_weights(model: dict[str, Any], half: bool) -> tuple[float, ...]:
    """Parameters of each GPTModelPipe spec, from our model (``parameters`` method)."""
    from hyperpipe.models import load_model

    spec = load_model(model)
    layers = spec.layers
    n = len(layers) - 2
    embed = layers[0].params
    norm = layers[-1].params - spec.config.vocab_size * spec.config.d_model
    out = [0.0, embed, 0.0] + [layers[i].params for i in range(1, n + 1)] + [0.0, norm, embed]
    return tuple(out + ([0.0] if half else []))


def read_deepspeed(path: str | Path, args_path: str | Path | None) -> Job:
    """The job of DeepSpeed JSON `path` with the launch arguments in `args_path`."""
    src = str(path)
    doc = load_document(Path(path))
    top = Fields(doc, src)
    if args_path is None:
        raise BadInput("--args", "the DeepSpeed job's launch arguments (Megatron-DeepSpeed "
                       "flags: model shape, tp, pp): a DeepSpeed JSON holds no model",
                       has_got=False)
    launch = read_launch(read_text(args_path), str(args_path))
    notes = Notes(unread=launch.launcher_unread)
    a = launch.args
    zero = top.sub("zero_optimization").positive_int("stage", 0, allow_zero=True) \
        if top.has("zero_optimization") else 0
    if zero > 3:
        raise BadInput(f"{src}: zero_optimization.stage", "0, 1, 2 or 3 (DeepSpeed's ZeRO "
                       "stages)", zero)
    half = _enabled(top, "bf16") or _enabled(top, "fp16")
    job = read_args(a, str(args_path), notes, framework="deepspeed",
                    world_size=launch.world_size, pipeline_split=False)
    dtype = "bf16" if _enabled(top, "bf16") else ("fp16" if _enabled(top, "fp16") else "fp32")
    if job.model["dtype"] != dtype:
        notes.assumed.append(f"precision {dtype} from the JSON (the arguments say "
                             f"{job.model['dtype']})")
    model = {**job.model, "dtype": dtype}
    n = model["n_layer"]
    method = a.text("pp-partition-method", DEFAULT_METHOD) or DEFAULT_METHOD
    a.flag("deepspeed")
    a.text("deepspeed-config")                       # the JSON, given as FILE
    a.integer("zero-stage", allow_zero=True)         # the JSON's stage is the one used
    no_pipe = a.flag("no-pipeline-parallel")
    if no_pipe and job.pp > 1:
        raise BadInput(f"{args_path}: --no-pipeline-parallel", "no pipeline size beside it",
                       job.pp)
    # DeepSpeed merges the section with .items() (deepspeed/runtime/config.py,
    # ``get_pipeline_config``): anything but an object fails there, and is refused here
    section = top.sub("pipeline") if top.has("pipeline") else None
    raw_parts = section.raw("partition", None) if section is not None else None
    where = f"{src}: pipeline.partition"
    if raw_parts is not None and not isinstance(raw_parts, list):
        # DeepSpeed keeps the key ("best" by default) but never reads it: the stages come
        # from the model's partition method; only `hyperpipe export`'s boundaries are read
        notes.unread.append(f"pipeline.partition {key_name(str(raw_parts))} (not a list "
                            "of stage boundaries: the split is --pp-partition-method's)")
        raw_parts = None
    if isinstance(raw_parts, list):
        total = len(pipe_specs(n, half))
        if len(raw_parts) != job.pp + 1 or raw_parts[0] != 0 or raw_parts[-1] != total or \
                any(not isinstance(x, int) or isinstance(x, bool) for x in raw_parts) or \
                raw_parts != sorted(raw_parts):
            raise BadInput(where, f"{job.pp + 1} increasing boundaries from 0 to {total} "
                           "(GPTModelPipe's layers)", raw_parts)
        parts = list(raw_parts)
    else:
        try:
            parts = list(method_parts(method, n, half, spec_weights(model, half)
                                      if method.lower() == "parameters" else None, job.pp))
        except ValueError as exc:
            raise BadInput(f"{args_path}: --pp-partition-method", "uniform, parameters or "
                           f"type:REGEX (DeepSpeed's partition methods; {exc}), or the "
                           "JSON's pipeline.partition", method) from None
    stages = stages_of(parts, n, where if isinstance(raw_parts, list) else
                       f"{args_path}: --pp-partition-method", notes)
    if job.pp > 1 and zero >= 2:
        raise BadInput(f"{src}: zero_optimization.stage", "0 or 1 with pipeline parallelism "
                       "(DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3)", zero)
    if zero >= 2 and not no_pipe:
        # Megatron-DeepSpeed's pretrain_gpt.py builds GPTModelPipe, run by the pipeline
        # engine, whenever ``args.deepspeed and not args.no_pipeline_parallel``, pp 1 too
        raise BadInput(f"{args_path}: --no-pipeline-parallel", f"the flag beside {src}'s "
                       f"zero_optimization.stage {zero} (without it Megatron-DeepSpeed runs "
                       "GPTModelPipe on DeepSpeed's pipeline engine, which refuses ZeRO-2 "
                       "and ZeRO-3)", has_got=False)
    read = dict(_SECTION_KEYS)
    if zero >= 2:
        read["zero_optimization"] += ("overlap_comm",)
        _overlap_comm(top, zero, notes)
    dist_opt = zero >= 1 or bf16_sharded(dtype, zero) or job.distributed_optimizer
    batch = _batch(top, job, src)
    for key in doc:
        if key not in _KEYS:
            notes.unread.append(key_name(key))
        elif isinstance(doc[key], dict):
            notes.unread += [f"{key}.{key_name(sub)}" for sub in doc[key]
                             if sub not in read[key]]
    notes.unread += a.unread_flags()
    return replace(job, source=src, model=model, stages=stages, chunks=1,
                   schedule=framework_kind("deepspeed", 1),
                   micro_batch=batch.micro, global_batch=batch.global_batch,
                   samples_per_replica=batch.per_replica, distributed_optimizer=dist_opt,
                   accumulation=None if batch.steps is None else
                   Stated("gradient_accumulation_steps", batch.steps),
                   zero=zero if zero >= 2 else 0, precision={"dtype": dtype})


def _overlap_comm(top: Fields, zero: int, notes: Notes) -> None:
    """Check a ZeRO-2/3 job's ``zero_optimization.overlap_comm`` (DeepSpeed's default:
    true at stage 3 only, deepspeed/runtime/zero/config.py ``overlap_comm_valid``) and say
    how the plan prices it. With it DeepSpeed reduce-scatters each gradient bucket from
    the backward hooks on a stream of its own (zero/stage_1_and_2.py ``average_tensor``,
    zero/stage3.py ``reduce_and_partition_stream``), as `hyperpipe.sim.sharding` prices
    every ZeRO-2/3 backward; without it on the compute stream, which the plan does not
    price. The plan's ``runtime.overlap_grad_reduce`` stays the stack's false: what
    ZeRO-2 leaves to the step's end, the all-gather of the updated weights, runs after
    the optimizer step (stage_1_and_2.py ``step``), not beside the backward."""
    value = top.sub("zero_optimization").raw("overlap_comm", None)
    if value is None:
        value = zero == 3
        notes.assumed.append(f"zero_optimization.overlap_comm {str(value).lower()}, "
                             f"DeepSpeed's default at stage {zero}")
    elif not isinstance(value, bool):
        raise BadInput(f"{top.where}: zero_optimization.overlap_comm", "true or false",
                       value)
    if not value:
        notes.approximated.append("zero_optimization.overlap_comm false: DeepSpeed "
                                  "reduces each gradient bucket on the compute stream "
                                  "during the backward; priced as overlapped with it")


def bf16_sharded(dtype: str, zero: int) -> bool:
    """Whether DeepSpeed shards the optimizer state of a `dtype` job at ZeRO stage `zero`
    through BF16_Optimizer: bf16 without ZeRO, pipeline or not. deepspeed/runtime/
    engine.py: ``get_data_types`` accumulates bf16 gradients in fp32 when ZeRO is off,
    and ``_do_optimizer_sanity_check`` returns BFLOAT16 for a bf16 model with fp32
    accumulation (the pipeline engine's bf16 accumulation takes the same wrapper)."""
    return dtype == "bf16" and zero == 0


def _enabled(top: Fields, key: str) -> bool:
    if not top.has(key):
        return False
    value = top.sub(key).raw("enabled", False)
    if value == "auto":
        raise BadInput(top.at(f"{key}.enabled"), "true or false (the launcher fills 'auto' "
                       "in; give the value)", value)
    if not isinstance(value, bool):
        raise BadInput(top.at(f"{key}.enabled"), "true or false", value)
    return value


class Batch(NamedTuple):
    """A DeepSpeed JSON's batch settings (samples)."""

    micro: int                     # train_micro_batch_size_per_gpu
    global_batch: int | None       # train_batch_size
    per_replica: int | None        # micro x steps, where no global batch is given
    steps: int | None              # accumulation steps given beside the global batch


def _batch(top: Fields, job: Job, src: str) -> Batch:
    """DeepSpeed's train_batch_size = micro x accumulation steps x data-parallel ranks,
    which it checks when all three are given (deepspeed/runtime/config.py
    `_batch_assertion`), as `job.plan_of` does with `Batch.steps`."""
    micro = top.positive_int("train_micro_batch_size_per_gpu", job.micro_batch)
    if micro != job.micro_batch:
        raise BadInput(top.at("train_micro_batch_size_per_gpu"), f"the arguments' "
                       f"--micro-batch-size {job.micro_batch}", micro)
    total = top.positive_int("train_batch_size", job.global_batch) \
        if top.has("train_batch_size") or job.global_batch is not None else None
    if job.global_batch is not None and total != job.global_batch:
        raise BadInput(top.at("train_batch_size"), f"the arguments' --global-batch-size "
                       f"{job.global_batch}", total)
    steps = top.positive_int("gradient_accumulation_steps") \
        if top.has("gradient_accumulation_steps") else None
    if total is None and steps is None:
        steps = 1                     # DeepSpeed's default accumulation
    return Batch(micro, total, micro * steps if total is None and steps is not None else None,
                 steps if total is not None else None)
