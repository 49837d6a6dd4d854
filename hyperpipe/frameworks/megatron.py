"""Megatron-LM's arguments read into a `Job` (``hyperpipe import --from megatron``).

Reads a launch line or an arguments file (`launch.read_launch`) with the flags of
Megatron-LM's ``megatron/training/arguments.py`` (NVIDIA/Megatron-LM), old spellings
included: the model shape, ``--tensor/pipeline-model-parallel-size``, interleaving
(``--num-layers-per-virtual-pipeline-stage``, ``--num-virtual-stages-per-pipeline-rank`` or
``--virtual-pipeline-model-parallel-size``),
uneven ends (``--decoder-first/last-pipeline-num-layers``,
``--account-for-embedding/loss-in-pipeline-split``) or ``--pipeline-model-parallel-layout``,
micro and global batch, recompute, ``--sequence-parallel``,
``--use-distributed-optimizer``, precision and attention. Megatron-DeepSpeed takes the
same model flags (`hyperpipe.frameworks.deepspeed` reads them through `read_args`).

Context parallelism (``--context-parallel-size``) imports as every stage's ``cp``, its
ranks placed inside the data-parallel ones (Megatron's order ``tp-cp-ep-dp-pp``);
Megatron-DeepSpeed has no such flag (its sequence parallelism is DeepSpeed-Ulysses, not
ring attention) and refuses it. Mixture-of-experts (``--num-experts``,
``--expert-model-parallel-size`` > 1) refuses the import (exit 2): no nearby plan prices
it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput
from hyperpipe.frameworks.job import (
    Job,
    Notes,
    framework_kind,
    ranges_of_units,
    split_blocks,
)
from hyperpipe.frameworks.launch import Args, read_launch
from hyperpipe.models.loader import GPT_KEYS

# GPT-2's byte-level BPE vocabulary (openai/gpt-2 encoder.json: 50,257 tokens), which
# Megatron-LM's GPT2BPETokenizer reads from --vocab-file/--merge-file.
GPT2_VOCAB = 50257

# Megatron-LM's defaults for flags a job may leave out (megatron/training/arguments.py):
# --make-vocab-size-divisible-by 128, --hidden-dropout 0.1, --attention-dropout 0.1,
# --rotary-base 10000.
VOCAB_DIVISIBLE_BY = 128
# The plan's `stack` for each framework's reader (`hyperpipe.plan.stack.STACKS`).
STACK_OF = {"megatron": "megatron-lm", "deepspeed": "megatron-deepspeed",
            "torchtitan": "torchtitan"}
DROPOUT = 0.1
ROTARY_BASE = 10000.0


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM pads the vocabulary up to a multiple of divisible_by x tp so that each
    tensor-parallel rank holds an equal slice (megatron/training/tokenizer/tokenizer.py,
    ``_vocab_size_with_padding``)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def read_megatron(text: str, source: str) -> Job:
    """The job of Megatron-LM launch line or arguments `text` (from file `source`)."""
    launch = read_launch(text, source)
    notes = Notes(unread=launch.launcher_unread)
    job = read_args(launch.args, source, notes, framework="megatron",
                    world_size=launch.world_size)
    notes.unread += launch.args.unread_flags()
    return job


def read_args(a: Args, source: str, notes: Notes, *, framework: str,
              world_size: int | None, pipeline_split: bool = True) -> Job:
    """A job from Megatron-style arguments `a` (Megatron-LM or Megatron-DeepSpeed);
    without `pipeline_split` (DeepSpeed partitions itself) its stages are left empty."""
    tp = a.integer("tensor-model-parallel-size", 1)
    pp = a.integer("pipeline-model-parallel-size", 1)
    cp = a.integer("context-parallel-size", 1)     # ring attention over cp ranks
    if cp != 1 and framework != "megatron":
        raise BadInput(f"{source}: --context-parallel-size", "1 with Megatron-DeepSpeed "
                       "(context parallelism is Megatron-LM's ring attention)", cp)
    ep = a.integer("expert-model-parallel-size", 1)
    experts = a.integer("num-experts", None)
    if ep != 1 or experts is not None:
        raise BadInput(f"{source}: --num-experts/--expert-model-parallel-size", "a dense "
                       "model: mixture-of-experts is not modelled by HyperPipe yet",
                       experts or ep)
    # bounded before the layout lists one unit per layer
    n = a.integer("num-layers", required=True, at_most=limits.MAX_LAYERS)
    model = model_document(a, source, notes, tp, n)
    chunks, stages = layout(a, source, n, pp) if pipeline_split else (1, ())
    micro = a.integer("micro-batch-size", required=True)
    if a.has("rampup-batch-size"):
        notes.approximated.append("--rampup-batch-size: imported at the full global batch")
    recompute = _recompute(a, notes)
    seq_par = a.flag("sequence-parallel")
    if seq_par and tp == 1:
        notes.assumed.append("--sequence-parallel with tp 1: off (Megatron-LM turns it off)")
    dist_opt = a.flag("use-distributed-optimizer")
    runtime = _runtime(a, notes, chunks) if framework == "megatron" else {}
    return Job(framework=framework, source=source, model=model, tp=tp, pp=pp, chunks=chunks,
               micro_batch=micro, global_batch=a.integer("global-batch-size"),
               schedule=framework_kind("megatron", chunks), stages=stages,
               notes=notes, world_size=world_size, recompute=recompute,
               sequence_parallel=seq_par and tp > 1, distributed_optimizer=dist_opt,
               stack=STACK_OF[framework], runtime=runtime, cp=cp,
               precision={"dtype": model["dtype"]})


def model_document(a: Args, source: str, notes: Notes, tp: int, n: int) -> dict[str, Any]:
    """The model that Megatron-style arguments describe, as a model document."""
    hidden = a.integer("hidden-size", required=True)
    heads = a.integer("num-attention-heads", required=True)
    seq = a.integer("seq-length", required=True)
    a.integer("max-position-embeddings")           # the learned table's rows; seq is used
    swiglu = a.flag("swiglu")
    ffn = a.integer("ffn-hidden-size")
    if ffn is None:
        # Megatron-LM's default: 4h, or for SwiGLU 2/3 of it rounded down to a multiple
        # of 64 (megatron/training/arguments.py, validate_args)
        ffn = int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden
    kv = heads
    if a.flag("group-query-attention"):
        kv = a.integer("num-query-groups", 1)
    kv = a.integer("num-key-value-heads", kv)       # Megatron-DeepSpeed's spelling
    norm = (a.text("normalization", "LayerNorm") or "").lower()
    if norm not in ("layernorm", "rmsnorm"):
        raise BadInput(f"{source}: --normalization", "LayerNorm or RMSNorm", norm)
    position = "rope" if a.flag("use-rotary-position-embeddings") else "learned"
    kind = a.text("position-embedding-type")
    if kind is not None:
        # Megatron-LM spells them learned_absolute/rope/none, Megatron-DeepSpeed
        # absolute/rotary/alibi (bigscience-workshop/Megatron-DeepSpeed megatron/arguments.py)
        if kind not in ("learned_absolute", "absolute", "rope", "rotary", "alibi", "none"):
            raise BadInput(f"{source}: --position-embedding-type", "learned_absolute, rope, "
                           "none, or Megatron-DeepSpeed's absolute, rotary, alibi", kind)
        position = "learned" if kind in ("learned_absolute", "absolute") else "rope"
        if kind in ("alibi", "none"):
            notes.approximated.append(f"--position-embedding-type {kind}: priced as RoPE "
                                      "(no position parameters, elementwise work only)")
    if a.flag("embed-layernorm"):
        notes.approximated.append("--embed-layernorm: the embedding's extra LayerNorm is not "
                                  "priced (one norm of the 'layers' count)")
    dtype = "bf16" if a.flag("bf16") else ("fp16" if a.flag("fp16") else "fp32")
    for flag in ("fp8-format", "fp8"):
        if a.has(flag):         # Transformer Engine's fp8 GEMMs in the blocks' linears
            if dtype != "bf16":
                notes.approximated.append(f"--{flag} over {dtype}: priced as fp8 over bf16 "
                                          "(its storage, 2 bytes)")
            dtype = "fp8"
    hidden_dropout = a.number("hidden-dropout", DROPOUT)
    attention_dropout = a.number("attention-dropout", DROPOUT)
    if hidden_dropout != attention_dropout:
        notes.approximated.append(f"dropout: one rate for the model, --hidden-dropout's "
                                  f"{hidden_dropout:g} (attention {attention_dropout:g})")
    doc: dict[str, Any] = {
        "kind": "gpt", "name": Path(source).stem or "megatron", "dtype": dtype,
        "vocab_size": _vocab(a, source, notes, tp), "n_layer": n, "n_head": heads,
        "d_model": hidden, "seq_len": seq, "ffn_hidden": ffn, "n_kv_head": kv,
        "mlp": "swiglu" if swiglu else "gelu", "norm": norm, "position": position,
        "dropout": hidden_dropout, "bias": not a.flag("disable-bias-linear"),
        "attention": _attention(a, notes), "fused_elementwise": _fused(a)}
    head_size = a.integer("kv-channels")            # the head size; default hidden / heads
    if head_size is not None and head_size * heads != hidden:
        doc["head_dim"] = head_size
    if position == "rope":
        doc["rope_theta"] = a.number("rotary-base", ROTARY_BASE)
    untie = a.flag("untie-embeddings-and-output-weights")
    if "tie_embeddings" in GPT_KEYS:         # the model field, where HyperPipe has it
        doc["tie_embeddings"] = not untie
    elif not untie:
        notes.approximated.append("tied input and output embeddings (Megatron-LM's default) "
                                  "priced as two matrices")
    return doc


def _vocab(a: Args, source: str, notes: Notes, tp: int) -> int:
    """The vocabulary Megatron-LM builds: --pad-vocab-size-to (Megatron-DeepSpeed) as is,
    else --vocab-size or GPT-2's BPE padded (`padded_vocab`)."""
    divisible = a.integer("make-vocab-size-divisible-by", VOCAB_DIVISIBLE_BY)
    pad_to = a.integer("pad-vocab-size-to")
    tokenizer = a.text("tokenizer-type")
    for flag in ("vocab-file", "merge-file", "tokenizer-model", "tokenizer-name-or-path"):
        a.has(flag)                     # read: the vocabulary is all they tell HyperPipe
    if pad_to is not None:
        return pad_to
    vocab = a.integer("vocab-size")
    if vocab is None:
        gpt2 = tokenizer in (None, "GPT2BPETokenizer") and a.has("vocab-file")
        if not gpt2:
            raise BadInput(f"{source}: --vocab-size", "the vocabulary size (its tokenizer "
                           f"{tokenizer or 'is not named'}: HyperPipe reads only GPT-2's BPE "
                           "from --vocab-file; add --vocab-size N)", has_got=False)
        vocab = GPT2_VOCAB
        notes.assumed.append(f"vocabulary: GPT-2's BPE, {GPT2_VOCAB} tokens")
    return padded_vocab(vocab, divisible, tp)


def _fused(a: Args) -> bool:
    """Megatron-LM fuses bias+GeLU, bias+dropout+add and scale-mask-softmax unless told
    not to (`--no-bias-gelu-fusion`, `--no-bias-dropout-fusion`,
    `--no-masked-softmax-fusion`; megatron/training/arguments.py); any of them prices the
    block's elementwise work unfused (`GPTConfig.fused_elementwise`)."""
    return not any([a.flag(f"no-{k}-fusion") for k in ("bias-gelu", "bias-swiglu",
                                                        "bias-dropout", "masked-softmax")])


def _attention(a: Args, notes: Notes) -> str:
    backend = a.text("attention-backend")
    # Megatron-DeepSpeed: --use-flash-attn-v1, -v2 or -triton (megatron/arguments.py)
    deepspeed_flash = [a.flag(f"use-flash-attn-{v}") for v in ("v1", "v2", "triton")]
    if a.flag("use-flash-attn") or any(deepspeed_flash) or \
            backend in ("flash", "fused", "auto"):
        return "flash"
    if backend is not None:
        return "eager"
    notes.assumed.append("attention: eager, Megatron-LM's before --use-flash-attn and "
                         "--attention-backend (give either to say otherwise)")
    return "eager"


def _recompute(a: Args, notes: Notes) -> str:
    """Activation recompute: "full" for --recompute-granularity full, the old
    --checkpoint-activations and --activations-checkpoint-method (2021); "selective" for
    --recompute-granularity selective or --recompute-activations; else "none"."""
    granularity = a.text("recompute-granularity")
    if granularity not in (None, "full", "selective"):
        raise BadInput(f"{a.where}: --recompute-granularity", "full or selective",
                       granularity)
    method = a.text("recompute-method")
    layers = a.integer("recompute-num-layers")
    if a.flag("checkpoint-activations") or a.text("activations-checkpoint-method"):
        granularity = "full"
    a.has("deepspeed-activation-checkpointing")     # the same full recompute
    a.integer("checkpoint-num-layers")               # layers per checkpoint: all recomputed
    if a.flag("recompute-activations"):
        granularity = granularity or "selective"
    if granularity is None and method is not None:
        notes.assumed.append(f"--recompute-method {method} without --recompute-granularity: "
                             "no recompute (Megatron-LM ignores the method alone)")
    if granularity == "full" and method == "block" and layers is not None:
        notes.approximated.append(f"--recompute-method block --recompute-num-layers {layers}:"
                                  " priced as full recompute of every layer")
    return granularity or "none"


def _runtime(a: Args, notes: Notes, chunks: int) -> dict[str, Any]:
    """The plan's runtime overrides of the megatron-lm stack (`hyperpipe.plan.stack`):
    gradient reduction overlapped with the backward for --DDP-impl torch or
    --overlap-grad-reduce, else after the last micro-batch (--DDP-impl local, and
    Megatron-core's DDP default); point-to-point blocking except interleaved schedules of
    releases that overlap it (--overlap-p2p-communication, the default since the
    releases without --DDP-impl; --no-overlap-p2p-communication turns it off)."""
    ddp = a.text("ddp-impl")
    overlap_grads = ddp == "torch" if ddp is not None else a.flag("overlap-grad-reduce")
    a.flag("overlap-param-gather")
    modern = ddp is None and not a.flag("no-overlap-p2p-communication")
    async_p2p = chunks > 1 and (a.flag("overlap-p2p-communication") or modern)
    how = f"--DDP-impl {ddp}" if ddp else \
        ("--overlap-grad-reduce" if overlap_grads else "no --overlap-grad-reduce")
    when = "during the backward" if overlap_grads else "after the last micro-batch"
    p2p = "overlapped (interleaved, --overlap-p2p-communication)" if async_p2p else \
        "blocking (Megatron-LM's 1F1B waits on its sends)"
    notes.assumed.append(f"gradients reduced {when} ({how}); point-to-point {p2p}")
    return {"p2p": "async" if async_p2p else "blocking", "overlap_grad_reduce": overlap_grads}


def layout(a: Args, source: str, n: int, pp: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """Chunks per pipeline rank and our stage ranges of Megatron's pipeline split, read as
    megatron/training/arguments.py ``validate_args`` does: at most one of the layout,
    --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank;
    the virtual stages per rank being the latter as given, or the former's share of
    (num-layers + the embedding and loss the split accounts for) / pp; virtual stages
    with pp 1 are refused, as Megatron-LM refuses them."""
    text = a.text("pipeline-model-parallel-layout")
    per_virtual = a.integer("num-layers-per-virtual-pipeline-stage")
    per_rank = a.integer("num-virtual-stages-per-pipeline-rank")
    vpp = a.integer("virtual-pipeline-model-parallel-size")
    first = a.integer("decoder-first-pipeline-num-layers", allow_zero=True)
    last = a.integer("decoder-last-pipeline-num-layers", allow_zero=True)
    with_e = a.flag("account-for-embedding-in-pipeline-split")
    with_l = a.flag("account-for-loss-in-pipeline-split")
    where = f"{source}: --pipeline-model-parallel-layout"
    given = [f"--{name}" for name, value in (
        ("pipeline-model-parallel-layout", text),
        ("num-layers-per-virtual-pipeline-stage", per_virtual),
        ("num-virtual-stages-per-pipeline-rank", per_rank)) if value is not None]
    if len(given) > 1:
        raise BadInput(f"{source}: {given[0]}", "at most one of --pipeline-model-parallel-"
                       "layout, --num-layers-per-virtual-pipeline-stage and --num-virtual-"
                       "stages-per-pipeline-rank (Megatron-LM refuses more)", " and ".join(given))
    units = parse_layout(text, where) if text is not None else None
    # virtual stages need a pipeline: megatron/core/parallel_state.py
    # (initialize_model_parallel) refuses any virtual pipeline size with pp 1
    virtual = [flag for flag, value in (
        ("--pipeline-model-parallel-layout", units is not None and len(units) > 1),
        ("--num-layers-per-virtual-pipeline-stage", per_virtual is not None),
        ("--num-virtual-stages-per-pipeline-rank", per_rank is not None),
        ("--virtual-pipeline-model-parallel-size", vpp is not None)) if value]
    if pp == 1 and virtual:
        raise BadInput(f"{source}: {virtual[0]}", "none with --pipeline-model-parallel-size "
                       "1 (Megatron-LM refuses virtual pipeline stages without pipeline "
                       "parallelism)", has_got=False)
    if units is not None:
        if len(units) % pp:
            raise BadInput(where, f"a multiple of pp={pp} stages", len(units))
        return len(units) // pp, ranges_of_units(units, n, where)
    chunks = 1
    if per_virtual is not None:
        # the layers the split counts: the blocks, and the embedding and the loss when
        # accounted for (validate_args adds one for each before dividing)
        counted = n + int(with_e) + int(with_l)
        if counted % (pp * per_virtual):
            raise BadInput(f"{source}: --num-layers-per-virtual-pipeline-stage", f"a divisor "
                           f"of the layers per pipeline rank = {counted}/{pp}"
                           + (" (num-layers with the embedding/loss accounted for)"
                              if with_e or with_l else ""), per_virtual)
        chunks = counted // (pp * per_virtual)
    elif per_rank is not None:
        chunks = per_rank
    elif vpp is not None:
        chunks = vpp
    stages = pp * chunks
    if first is not None or last is not None:
        if per_virtual is not None:
            raise BadInput(f"{source}: --num-layers-per-virtual-pipeline-stage", "none beside "
                           "--decoder-first/last-pipeline-num-layers (Megatron-LM takes "
                           "--num-virtual-stages-per-pipeline-rank there)", per_virtual)
        fixed = {0: first, pp - 1: last}
        rest = [k for k in range(pp) if fixed.get(k) is None]
        left = n - sum(v for v in fixed.values() if v is not None)
        if left < 0 or (rest and left % len(rest)) or (not rest and left):
            raise BadInput(f"{source}: --decoder-first/last-pipeline-num-layers", f"counts "
                           f"that leave the other stages an equal share of {n} layers",
                           [first, last])
        counts = [fixed[k] if fixed.get(k) is not None else left // len(rest)
                  for k in range(pp)]
        # each rank's layers shared evenly by its virtual stages; stage k is chunk
        # k // pp of rank k mod pp (megatron/core/transformer/transformer_block.py,
        # ``get_num_layers_to_build``)
        if any(c % chunks for c in counts):
            raise BadInput(f"{source}: --decoder-first/last-pipeline-num-layers", f"layers "
                           f"per pipeline rank that divide into its {chunks} virtual stages",
                           counts)
        return chunks, _ranges([counts[k % pp] // chunks for k in range(stages)], n, source)
    units = (["E"] if with_e else []) + ["t"] * n + (["L"] if with_l else [])
    if len(units) % stages:
        raise BadInput(f"{source}: --num-layers", f"a multiple of the {stages} pipeline "
                       f"stages{' (counting the embedding/loss)' if with_e or with_l else ''}",
                       n)
    size = len(units) // stages
    per = [units[k * size:(k + 1) * size] for k in range(stages)]
    if not with_e:
        per[0] = ["E"] + per[0]
    if not with_l:
        per[-1] = per[-1] + ["L"]
    return chunks, ranges_of_units(per, n, f"{source}: pipeline split")


def _ranges(counts: list[int], n: int, source: str) -> tuple[tuple[int, int], ...]:
    try:
        return split_blocks(n, counts)
    except ValueError as exc:
        raise BadInput(f"{source}: pipeline split", str(exc), counts) from None


def parse_layout(text: str, where: str) -> list[list[str]]:
    """Megatron-LM's layout string as units per stage: ``E`` embedding, ``t`` a decoder
    layer, ``L`` loss, ``|`` between stages (in stage order), ``x*n`` and ``(...)*n``
    repeat, commas are cosmetic (megatron/core/transformer/
    pipeline_parallel_layer_layout.py, ``parse_str_to_list``)."""
    import re

    flat = text.replace(",", "").replace(" ", "")
    for _ in range(8):                       # nested repeats unroll inside out
        if len(flat) > 100_000 or any(len(x) > 6 or int(x) > 100_000
                                      for x in re.findall(r"\*(\d+)", flat)):
            raise BadInput(where, "a layout of at most 100000 units", text[:40])
        new = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), flat)
        if new == flat:
            break
        flat = new
    flat = re.sub(r"([EtLm])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), flat)
    if len(flat) > 100_000 or not re.fullmatch(r"[EtL|]*", flat):
        raise BadInput(where, "stages of E, t and L separated by | (HyperPipe has no "
                       "multi-token prediction 'm')", text[:40])
    return [list(stage) for stage in flat.split("|")]
