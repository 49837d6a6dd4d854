"""torchtitan's TOML job configuration read into a `Job` (``import --from torchtitan``).

Reads the sections of torchtitan's ``JobConfig`` (pytorch/torchtitan
torchtitan/config/job_config.py, the TOML releases up to 0.2): ``[model]`` name and
flavour (the Llama 3 flavours of torchtitan/models/llama3/__init__.py), ``[training]``
batch (``local_batch_size``, its older name ``batch_size``, ``global_batch_size``),
``seq_len`` and precision, ``[parallelism]`` degrees, schedule, its CSV
(``pipeline_parallel_schedule_csv``, resolved beside the TOML first), micro-batch, the
stages (``module_fqns_per_model_part``, the older ``pipeline_parallel_split_points``, or
torchtitan's own split of ``pipeline_parallel_layers_per_stage`` and the first/last-stage
weights), and ``[activation_checkpoint]``.

FSDP and HSDP (``data_parallel_shard_degree`` above 1, or torchtitan's default -1 where
the ranks it leaves over on the cluster are more than one: `Job.settle`) import as
ZeRO-3 (plan ``zero: 3``) over the data-parallel ranks;
HSDP's replicate groups are not told apart from its shard groups (said in the notes).
The model's precision is the one torchtitan trains in (`_precision`): without FSDP, TP
and PP jobs train fp32 and the others under torch.autocast. Gradient accumulation under
a pipeline runs one schedule per local batch (`Job.step_samples`); the plan holds one
schedule of them all, which the notes say.
Context and expert parallelism above 1, which the import does not read yet, refuse it
(exit 2).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput, key_name
from hyperpipe.core.files import read_text
from hyperpipe.frameworks.job import Job, Notes, ranges_of_units, split_blocks
from hyperpipe.models.loader import GPT_KEYS
from hyperpipe.plan.kinds import (
    DEFAULT_KIND,
    GENERATED_KINDS,
    KINDS,
    SYNTH,
    ScheduleKind,
    generate,
)
from hyperpipe.plan.schedule import Action, ScheduleError

# torchtitan's Llama 3 flavours (torchtitan/models/llama3/__init__.py, ``llama3_args``;
# TransformerModelArgs defaults in models/llama3/model/args.py: vocab 128256):
# (dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of, rope_theta, vocab)
LLAMA3_FLAVORS: dict[str, tuple[int, int, int, int | None, float | None, int, float, int]] = {
    "debugmodel": (256, 6, 16, None, None, 256, 500000.0, 2048),
    "8B": (4096, 32, 32, 8, 1.3, 1024, 500000.0, 128256),
    "70B": (8192, 80, 64, 8, 1.3, 4096, 500000.0, 128256),
    "405B": (16384, 126, 128, 8, 1.2, 4096, 500000.0, 128256),
}


# torch's LoopedBFS and InterleavedZeroBubble (looped stages, the latter with the
# backward split) have no kind: their orders import as a schedule CSV.


def _runs_class(kind: ScheduleKind, name: str) -> bool:
    """Whether torch's class `name` runs `kind`'s order (`ScheduleKind.torch_schedule`;
    torch's ``get_schedule_class`` reads names case-insensitively)."""
    own = kind.torch_schedule
    return own is not None and own.lower() == name.lower()


def ffn_hidden(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """torchtitan's SwiGLU width (models/llama3/model/model.py, FeedForward): 2/3 of 4·dim,
    times the multiplier, rounded up to a multiple of `multiple_of`."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * -(-hidden // multiple_of)


def split_stages(num_stages: int, num_layers: int, input_weight: int = 1,
                 output_weight: int = 1) -> list[int]:
    """Blocks per stage of torchtitan's default split (distributed/pipeline_parallel.py,
    ``generate_llm_fqn_per_model_part``): the embedding counts as `input_weight` blocks on
    the first stage and norm + output as `output_weight` on the last; the effective
    layers are shared evenly, the first stages taking one more each."""
    if num_stages == 1:
        return [num_layers]
    effective = num_layers + input_weight + output_weight
    base, extra = divmod(effective, num_stages)
    if base == 0 or input_weight > base or output_weight > base:
        raise ValueError(f"{num_stages} stages for {num_layers} layers with weights "
                         f"{input_weight}/{output_weight}")
    counts, left = [], num_layers
    for s in range(num_stages):
        units = base + (1 if s < extra else 0)
        units -= input_weight if s == 0 else (output_weight if s == num_stages - 1 else 0)
        take = min(max(units, 0), left)
        counts.append(take)
        left -= take
    return counts


def read_torchtitan(path: str | Path, *, n_layer: int | None = None) -> Job:
    """The job of torchtitan TOML `path`. `n_layer`: the blocks of a model given beside
    it (``import --model``), which lets a flavour HyperPipe does not know through."""
    try:
        import tomllib
    except ImportError:                  # Python 3.10
        raise BadInput("--from torchtitan", "Python 3.11 or newer (tomllib reads the TOML)",
                       has_got=False) from None
    p = Path(path)
    src = str(p)
    try:
        doc = tomllib.loads(read_text(p))
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(src, f"valid TOML ({exc})", has_got=False) from None
    except RecursionError:              # tomllib recurses once per nested array or table
        raise BadInput(src, f"TOML nested at most {limits.MAX_DOCUMENT_DEPTH} levels deep",
                       has_got=False) from None
    notes = Notes()
    known = ("model", "training", "parallelism", "activation_checkpoint")
    for name, value in doc.items():
        if name not in known:
            notes.unread.append(f"[{key_name(name)}]")
        elif not isinstance(value, dict):
            raise BadInput(f"{src}: {name}", "a table", value)
    sec = {name: dict(doc.get(name) or {}) for name in known}

    def take(section: str, key: str, default: Any = None) -> Any:
        return sec[section].pop(key, default)

    def integer(section: str, key: str, default: int, *, negative_ok: bool = False,
                zero_ok: bool = False) -> int:
        value = take(section, key, default)
        if isinstance(value, bool) or not isinstance(value, int) or \
                (value < 1 and not (negative_ok and value == -1)
                 and not (zero_ok and value == 0)):
            raise BadInput(f"{src}: {section}.{key}", ("a non-negative integer" if zero_ok
                                                       else "a positive integer")
                           + (" or -1" if negative_ok else ""), value)
        return value

    tp = integer("parallelism", "tensor_parallel_degree", 1)
    pp = integer("parallelism", "pipeline_parallel_degree", 1)
    # the sequence split over cp ranks; FSDP shards over dp_shard x cp (torchtitan/
    # distributed/parallel_dims.py, the "dp_shard_cp" mesh), as a plan's zero does
    cp = integer("parallelism", "context_parallel_degree", 1)
    degree = integer("parallelism", "expert_parallel_degree", 1)
    if degree != 1:
        raise BadInput(f"{src}: parallelism.expert_parallel_degree", "1: the import does "
                       "not read it yet", degree)
    replicate = integer("parallelism", "data_parallel_replicate_degree", 1)
    shard = integer("parallelism", "data_parallel_shard_degree", -1, negative_ok=True)
    sharded = shard != 1
    mixed = _mixed_precision(take, src)
    precision = _precision(mixed, notes, fsdp=sharded or cp > 1, tp=tp, pp=pp)
    model, n = _model(take, integer, src, n_layer, precision)

    def hsdp(shards: int) -> None:
        if shards > 1 and replicate > 1:
            notes.approximated.append(
                f"HSDP (data_parallel_replicate_degree {replicate}, "
                f"data_parallel_shard_degree {shard}) as ZeRO-3 over all {replicate} x "
                f"{shards} data-parallel ranks: the weights are priced as sharded over all "
                "of them")

    def settle(job: Job, dp: int) -> Job:
        """A shard degree of -1 is the data-parallel ranks left over: FSDP where they are
        more than one (or cp shards), else none (plain replicas)."""
        hsdp(dp // replicate)
        if dp // replicate > 1 or cp > 1:
            return job
        plain = _precision(mixed, notes, fsdp=False, tp=tp, pp=pp)
        return replace(job, model={**job.model, **plain}, precision=plain, zero=0,
                       distributed_optimizer=False)
    if shard > 0:
        hsdp(shard)
    local = take("training", "local_batch_size", None)
    if local is None and "batch_size" in sec["training"]:
        local = take("training", "batch_size")
        notes.assumed.append("training.batch_size read as local_batch_size (torchtitan's "
                             "older name)")
    if local is None:
        local = 8                        # JobConfig's Training.local_batch_size default
    if isinstance(local, bool) or not isinstance(local, int) or local < 1:
        raise BadInput(f"{src}: training.local_batch_size", "a positive integer", local)
    global_batch = integer("training", "global_batch_size", -1, negative_ok=True)
    micro = integer("parallelism", "pipeline_parallel_microbatch_size", 1) if pp > 1 \
        else local
    if pp == 1:
        take("parallelism", "pipeline_parallel_microbatch_size")
    schedule, chunks, actions, single = _schedule(take, src, p, pp, notes)
    stages = _stages(take, integer, src, n, pp, chunks or (1 if single else 2))
    if chunks is None and len(stages) % pp == 0:
        chunks = len(stages) // pp
    if chunks is None or len(stages) != pp * chunks or not KINDS[schedule].allows_chunks(chunks):
        raise BadInput(f"{src}: parallelism", f"stages that schedule {schedule} places on "
                       f"{pp} ranks", len(stages))
    recompute = _recompute(take, src, notes)
    for section, rest in sec.items():
        notes.unread += [f"{section}.{key_name(key)}" for key in rest]
    return Job(framework="torchtitan", source=src, model=model, tp=tp, pp=pp, chunks=chunks,
               micro_batch=micro, schedule=schedule, stages=stages, notes=notes,
               global_batch=global_batch if global_batch > 0 else None,
               samples_per_replica=local,
               dp=replicate * shard if shard > 0 else None, actions=actions,
               recompute=recompute, sequence_parallel=tp > 1,
               distributed_optimizer=sharded, zero=3 if sharded else 0, stack="torchtitan",
               cp=cp, precision=precision, step_samples=local,
               settle=settle if shard == -1 else None)


# torchtitan's mixed_precision_param values (torchtitan/config/job_config.py,
# ``Training.mixed_precision_param``: TORCH_DTYPE_MAP's names) as model dtypes
PRECISIONS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _mixed_precision(take, src: str) -> tuple[str, str]:
    """(model dtype, as written) of the TOML's ``mixed_precision_param`` (or its older
    ``dtype``); fp8 where ``model.converters`` names "float8" over bf16 (torchtitan's
    Float8 training: torchao's Float8Linear in the blocks, torchtitan/components/
    quantization/float8.py)."""
    param = take("training", "mixed_precision_param", "bfloat16")
    older = take("training", "dtype")
    if param not in PRECISIONS:
        raise BadInput(f"{src}: training.mixed_precision_param", "one of "
                       f"{', '.join(PRECISIONS)}", param)
    converters = take("model", "converters", [])
    if not isinstance(converters, list) or not all(isinstance(c, str) for c in converters):
        raise BadInput(f"{src}: model.converters", "a list of names", converters)
    dtype = "bf16" if param == "bfloat16" or older == "bfloat16" else PRECISIONS[param]
    return ("fp8" if "float8" in converters and dtype == "bf16" else dtype), param


def _precision(mixed: tuple[str, str], notes: Notes, *, fsdp: bool, tp: int, pp: int
               ) -> dict[str, str]:
    """The model fields (`Job.precision`) of the precision torchtitan trains in, from
    `_mixed_precision`'s. Its ``mixed_precision_param`` applies only through FSDP
    (data_parallel_shard_degree or context_parallel_degree above 1: ``fully_shard``'s
    MixedPrecisionPolicy, bf16 weights gathered from fp32 shards); without FSDP, with TP
    or PP it trains fp32, and with neither (DDP, one device) under ``torch.autocast``
    (torchtitan/distributed/utils.py ``maybe_enable_amp``, ``ParallelDims.fsdp_enabled``:
    dp_shard > 1 or cp > 1)."""
    dtype, param = mixed
    if dtype == "fp32" or fsdp:
        return {"dtype": dtype, "optimizer_state": "mixed"}
    if tp > 1 or pp > 1:
        notes.assumed.append(
            f"precision fp32, not mixed_precision_param {param}"
            f"{' and its float8 converter' if dtype == 'fp8' else ''}: without FSDP "
            "(data_parallel_shard_degree or context_parallel_degree above 1) torchtitan "
            "trains TP and PP jobs in fp32 (maybe_enable_amp)")
        return {"dtype": "fp32", "optimizer_state": "mixed"}
    notes.assumed.append(f"precision {dtype} under torch.autocast (fp32 weights, gradients "
                         "and optimizer state, cast at each use): torchtitan's mixed "
                         "precision without FSDP, TP or PP (maybe_enable_amp)")
    return {"dtype": dtype, "optimizer_state": "autocast"}


def _model(take, integer, src: str, n_layer: int | None, precision: dict[str, str]
           ) -> tuple[dict[str, Any], int]:
    """The model document of the TOML's flavour in `precision` (`_precision`), and its
    blocks; ``{}`` with `n_layer` where a model given beside it replaces it."""
    name = take("model", "name", "llama3")
    flavor = take("model", "flavor", "debugmodel")
    known = isinstance(flavor, str) and flavor in LLAMA3_FLAVORS
    if n_layer is not None and (name != "llama3" or not known):
        take("training", "seq_len")
        return {}, n_layer                # the importer puts the given model in
    if name != "llama3" or not isinstance(flavor, str) or flavor not in LLAMA3_FLAVORS:
        raise BadInput(f"{src}: model", f"name 'llama3' with a flavor of "
                       f"{sorted(LLAMA3_FLAVORS)} (the models HyperPipe knows; or give "
                       "--model)",
                       f"{name} {flavor}")
    dim, layers, heads, kv, mult, multiple_of, theta, vocab = LLAMA3_FLAVORS[flavor]
    seq = integer("training", "seq_len", 2048)
    doc: dict[str, Any] = {
        "kind": "gpt", "name": f"llama3-{flavor}", **precision, "vocab_size": vocab,
        "n_layer": layers, "n_head": heads, "d_model": dim, "seq_len": seq,
        "ffn_hidden": ffn_hidden(dim, mult, multiple_of), "n_kv_head": kv or heads,
        "mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "bias": False,
        "rope_theta": theta, "dropout": 0.0, "attention": "flash"}
    if "tie_embeddings" in GPT_KEYS:     # torchtitan's Llama keeps a separate output
        doc["tie_embeddings"] = False
    return doc, layers


def _schedule(take, src: str, toml: Path, pp: int, notes: Notes
              ) -> tuple[str, int | None, tuple[tuple[str, ...], ...] | None, bool]:
    """(kind, chunks (None: from the stages), action lists or None, whether the named
    class is single-stage)."""
    name = str(take("parallelism", "pipeline_parallel_schedule", "1F1B"))
    csv_path = take("parallelism", "pipeline_parallel_schedule_csv", "") or ""
    single = name.lower() == "pipelineschedulesingle" or any(
        _runs_class(k, name) and not k.takes_chunks
        and k.default_chunks == 1 for k in KINDS.values())
    if csv_path:
        rows = read_csv_schedule(_beside(toml, str(csv_path)), pp)
        return (*_kind_of(rows, pp), single)
    if pp == 1:
        return DEFAULT_KIND, 1, None, True
    for kind in KINDS.values():
        if _runs_class(kind, name):
            chunks = None if kind.takes_chunks else kind.default_chunks
            return kind.name, chunks, None, single
    accepted = [kind.torch_schedule for kind in KINDS.values() if kind.torch_schedule]
    raise BadInput(f"{src}: parallelism.pipeline_parallel_schedule", "a schedule HyperPipe "
                   f"runs ({', '.join(accepted)}), or any other order as a schedule CSV "
                   "(pipeline_parallel_schedule_csv)", name)


def _beside(toml: Path, csv_path: str) -> Path:
    """The CSV named in a TOML: beside the TOML when it is there, else as given (torchtitan
    opens it from its working directory)."""
    near = toml.resolve().parent / csv_path
    return near if near.is_file() else Path(csv_path)


def read_csv_schedule(path: Path, pp: int) -> tuple[tuple[Action, ...], ...]:
    """A compute-only schedule CSV (torch.distributed.pipelining's ``_load_csv`` format:
    one row of actions like ``0F0`` per rank)."""
    where = str(path)
    rows = []
    for lineno, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        row = []
        for cell in line.split(","):
            try:
                row.append(Action.from_str(cell.strip()))
            except ScheduleError:
                # the cell by `key_name` only: a file that is not a CSV schedule (a
                # private file's lines) is never quoted back
                raise BadInput(f"{where}: line {lineno}", "compute actions like 0F0 (stage, "
                               f"F/B/I/W, micro-batch), got {key_name(cell.strip())}",
                               has_got=False) from None
        rows.append(tuple(row))
    if len(rows) != pp:
        raise BadInput(where, f"one row per pipeline rank ({pp})", f"{len(rows)} rows")
    return tuple(rows)


def _kind_of(rows: tuple[tuple[Action, ...], ...], pp: int
             ) -> tuple[str, int, tuple[tuple[str, ...], ...] | None]:
    """The generated kind whose schedule is exactly `rows`, else ``synth`` with them."""
    every = [a for row in rows for a in row]
    num_stages = max(a.stage for a in every) + 1 if every else pp
    if num_stages % pp:
        num_stages += pp - num_stages % pp
    chunks = num_stages // pp
    m = max(a.microbatch for a in every) + 1 if every else 1
    for name in GENERATED_KINDS:
        kind = KINDS[name]
        if not kind.allows_chunks(chunks):
            continue
        try:
            if generate(name, pp, m, chunks).actions == rows:
                return name, chunks, None
        except Exception:    # noqa: BLE001 - a kind that cannot build this shape
            continue
    return SYNTH, chunks, tuple(tuple(str(a) for a in row) for row in rows)


def _stages(take, integer, src: str, n: int, pp: int, chunks: int
            ) -> tuple[tuple[int, int], ...]:
    """Our stage ranges: the model parts named, the split points, or torchtitan's own split
    of `pp` x `chunks` stages (or of pipeline_parallel_layers_per_stage)."""
    parts = take("parallelism", "module_fqns_per_model_part")
    splits = take("parallelism", "pipeline_parallel_split_points")
    per_stage = take("parallelism", "pipeline_parallel_layers_per_stage")
    # 0 is accepted: torchtitan's split then counts no layer for the embedding or head
    # (distributed/pipeline_parallel.py, ``generate_llm_fqn_per_model_part``)
    first_w = integer("parallelism", "pipeline_parallel_first_stage_less_layers", 1,
                      zero_ok=True)
    last_w = integer("parallelism", "pipeline_parallel_last_stage_less_layers", 1,
                     zero_ok=True)
    where = f"{src}: parallelism.module_fqns_per_model_part"
    if parts is not None:
        if not isinstance(parts, list) or not all(isinstance(x, list) for x in parts):
            raise BadInput(where, "a list of lists of module names", parts)
        units = []
        for part in parts:
            if not part or ("norm" in part) != ("output" in part):
                raise BadInput(where, "non-empty parts, norm with output (our head is the "
                               "final norm, the output and the loss)", part)
            units.append([u for u in (_unit(name, n, where) for name in part) if u])
        return ranges_of_units(units, n, where)
    if splits:
        where = f"{src}: parallelism.pipeline_parallel_split_points"
        if not isinstance(splits, list):
            raise BadInput(where, "a list of block names such as \"layers.4\"", splits)
        units = ["E"] + ["t"] * n + ["L"]
        cuts = [1 + _block(s, n, where) for s in splits]
        if cuts != sorted(set(cuts)):
            raise BadInput(where, "increasing block names", splits)
        bounds = [0, *cuts, len(units)]
        pieces = [units[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        return ranges_of_units(pieces, n, where)
    stages = pp * chunks
    if per_stage is not None and pp > 1:
        if isinstance(per_stage, bool) or not isinstance(per_stage, int) or per_stage < 1:
            raise BadInput(f"{src}: parallelism.pipeline_parallel_layers_per_stage",
                           "a positive integer", per_stage)
        stages = -(-(n + first_w + last_w) // per_stage)
    try:
        counts = split_stages(stages, n, first_w, last_w)
    except ValueError as exc:
        raise BadInput(f"{src}: parallelism", f"a pipeline split torchtitan can make ({exc})",
                       has_got=False) from None
    return split_blocks(n, counts)


def _unit(name: Any, n: int, where: str) -> str:
    if name == "tok_embeddings":
        return "E"
    if name == "output":
        return "L"
    if name == "norm":
        return ""                         # with output: our head is norm + output + loss
    _block(name, n, where)
    return "t"


def _block(name: Any, n: int, where: str) -> int:
    m = re.fullmatch(r"layers\.([0-9]{1,9})", str(name))    # bounded: int() of 5000 digits fails
    if m is None or int(m.group(1)) >= n:
        raise BadInput(where, f"tok_embeddings, layers.0 .. layers.{n - 1}, norm or output",
                       name)
    return int(m.group(1))


def _recompute(take, src: str, notes: Notes) -> str:
    mode = take("activation_checkpoint", "mode", "selective")
    option = take("activation_checkpoint", "selective_ac_option", "2")
    if mode not in ("none", "selective", "full", "memory_budget"):
        raise BadInput(f"{src}: activation_checkpoint.mode", "none, selective, full or "
                       "memory_budget", mode)
    if mode == "selective":
        notes.approximated.append(f"selective activation checkpointing ({option!r}) priced "
                                  "as recompute of the attention core (Korthikanti et al.)")
        return "selective"
    if mode == "memory_budget":
        notes.approximated.append("activation_checkpoint.mode memory_budget priced as full "
                                  "recompute")
        return "full"
    return mode
