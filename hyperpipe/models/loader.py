"""Reading a model: a preset name, a YAML/JSON file or a parsed dict, into a `ModelSpec`;
and `model_ref`, the plan's reference to a model that round-trips through JSON.

Kept apart from `spec` so that `presets` (which builds on `spec`) and loading (which
reads `presets`) import in one direction: spec <- presets <- loader.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput, key_name, printable
from hyperpipe.core.files import (
    Fields,
    exponent_number,
    load_document,
    path_exists,
    resolve_ref,
    whole_number,
)
from hyperpipe.models.presets import PRESETS
from hyperpipe.models.spec import (
    DTYPE_BYTES,
    OPTIMIZER_STATES,
    GPTConfig,
    ModelSpec,
    MoEConfig,
    SyntheticLayer,
    check_config,
    gpt_spec,
)

GPT_KEYS = tuple(f.name for f in fields(GPTConfig))
SYNTHETIC_LAYER_KEYS = ("fwd_flops_per_sample", "i_flops_per_sample", "w_flops_per_sample",
                        "activation_bytes_per_sample", "stash_bytes_per_sample",
                        "params_per_layer", "hidden")


class _Fields(Fields):
    """`Fields` with the file and the field path apart: ``m.yaml: layers[1].hidden``."""

    def __init__(self, data: Any, file: str, path: str = "", allowed=None):
        where = f"{file}: {path[:-1]}" if path else file
        super().__init__(data, where)          # checks it is a mapping
        self.file, self.path = file, path
        if allowed is not None:
            unknown = sorted(set(map(str, data)) - set(allowed))
            if unknown:
                raise BadInput(self.at(key_name(unknown[0])),
                               f"one of the known keys {sorted(allowed)}",
                               "an unknown key", has_got=False)

    def at(self, key: str) -> str:
        return f"{self.file}: {self.path}{key}"


# What a model reference must be: a missing file is named by the field that gave it
# (`where`: a plan's `model`, `--model`), as `load_cluster` names a missing cluster file.
_MODEL_REF = f"a preset name (one of {sorted(PRESETS)}) or an existing model file " \
    "(.yaml, .yml, .json)"


def load_model(ref: Any, *, where: str = "model", base_dir: str | os.PathLike | None = None,
               overrides: Mapping[str, Any] | None = None) -> ModelSpec:
    """A ModelSpec from a preset name, a YAML/JSON file path, or an already parsed dict.

    Dict forms: ``{preset: gpt2-medium, seq_len: 512, ...}`` (any GPTConfig field or
    dtype/name overrides the preset), an explicit ``{kind: gpt, vocab_size: ..., ...}``,
    or ``{kind: synthetic, layers: 8, fwd_flops_per_sample: 1.0e9, ...}``. `overrides`
    are merged over the top level of whichever form. A ModelSpec is accepted as is.
    Errors are BadInput naming the file (or `where`) and the field.
    """
    if isinstance(ref, ModelSpec):
        if not overrides:
            return ref
        ref = ref.to_dict()
    if isinstance(ref, (str, os.PathLike)):
        text = os.fspath(ref)
        if isinstance(ref, str) and text in PRESETS:
            data: Any = {"preset": text}
        elif Path(text).suffix.lower() in (".yaml", ".yml", ".json") \
                or (text and path_exists(resolve_ref(text, _dir(base_dir)), regular=True)):
            path = resolve_ref(text, _dir(base_dir))
            if not path_exists(path):    # named by the field that gave it, as a cluster is
                raise BadInput(where, _MODEL_REF, text)
            data = load_document(path)
            where = str(path)
            if isinstance(data, str) and data in PRESETS:
                data = {"preset": data}
        else:
            raise BadInput(where, _MODEL_REF, text)
    else:
        data = ref
    if not isinstance(data, dict):
        raise BadInput(where, "a model mapping, preset name or file", type(data).__name__)
    if overrides:
        if not isinstance(overrides, Mapping):
            raise BadInput(f"{where} (overrides)", "a mapping", type(overrides).__name__)
        data = {**data, **overrides}
    kind = data.get("kind")
    if kind is None or kind == "gpt":
        return _load_gpt(data, where, PRESETS)
    if kind == "synthetic":
        return _load_synthetic(data, where)
    raise BadInput(f"{where}: kind", "one of ['gpt', 'synthetic']", kind)


def _dir(base_dir: str | os.PathLike | None) -> Path | None:
    return None if base_dir is None else Path(base_dir)


def _load_gpt(data: dict, where: str, presets: Mapping) -> ModelSpec:
    f = _Fields(data, where, allowed=("kind", "name", "preset", "dtype", "optimizer_state",
                                      *GPT_KEYS))
    base: dict[str, Any] = {}
    name, dtype = "gpt", "bf16"
    if f.has("preset"):
        preset = f.raw("preset")
        if not isinstance(preset, str) or preset not in presets:
            raise BadInput(f.at("preset"), f"one of the presets {sorted(presets)}", preset)
        base = asdict(presets[preset].config)
        # Keep derived defaults derived: overriding d_model of gpt2-small should give a
        # 4·d_model MLP, and overriding n_head should not leave a stale n_kv_head.
        if base["ffn_hidden"] == 4 * base["d_model"]:
            del base["ffn_hidden"]
        if base["n_kv_head"] == base["n_head"]:
            del base["n_kv_head"]
        if base["head_dim"] == base["d_model"] // base["n_head"]:
            del base["head_dim"]
        name, dtype = preset, presets[preset].dtype
    values = dict(base)
    for key in GPT_KEYS:
        if f.has(key):
            values[key] = f.raw(key)
    values = _numbers_read(values, GPTConfig)
    if isinstance(values.get("moe"), Mapping):
        values["moe"] = _numbers_read(values["moe"], MoEConfig)
    defaults = {k.name: k.default for k in fields(GPTConfig) if k.default is not MISSING}
    for key in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
        if key not in values:
            f.raw(key)                          # raises "a value (the field is required)"
    values = {**{k: v for k, v in defaults.items() if k not in values}, **values}
    if values.get("ffn_hidden") is None and isinstance(values["d_model"], int):
        values["ffn_hidden"] = 4 * values["d_model"]
    if values.get("n_kv_head") is None:
        values["n_kv_head"] = values["n_head"]
    check_config(values, f.at)
    config = GPTConfig(**values)
    dtype = f.choice("dtype", list(DTYPE_BYTES), dtype)
    state = f.choice("optimizer_state", list(OPTIMIZER_STATES), "mixed")
    return gpt_spec(printable(f.string("name", name)), config, dtype, state)


def _numbers_read(values: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """`values` (fields of dataclass `cls`) with their numbers read as every file's
    numbers are (`core.files`): an int field's whole number written ``2.0`` or ``2e0``
    as the int (`whole_number`), a float field's ``1e4`` (a string under YAML 1.1) as
    the float (`exponent_number`). Anything else is left for `check_config` to refuse,
    naming the field, so that no float or string reaches the arithmetic."""
    hints = get_type_hints(cls)
    out = dict(values)
    for key, value in values.items():
        hint = hints.get(str(key))
        types = set(get_args(hint)) or {hint}
        if int in types:
            out[key] = whole_number(value)
        elif float in types:
            out[key] = exponent_number(value)
    return out


def _load_synthetic(data: dict, where: str) -> ModelSpec:
    f = _Fields(data, where, allowed=("kind", "name", "dtype", "optimizer_state", "seq_len",
                                      "layers", *SYNTHETIC_LAYER_KEYS))
    dtype = f.choice("dtype", list(DTYPE_BYTES), "bf16")
    state = f.choice("optimizer_state", list(OPTIMIZER_STATES), "mixed")
    # tokens per sample, for tokens/s metrics
    seq_len = f.positive_int("seq_len", 1, at_most=limits.MAX_MODEL_DIM)
    defaults = _synthetic_values(f)
    raw = whole_number(f.raw("layers"))      # 4.0 and 4e0 are 4, as for every count
    if isinstance(raw, list) and len(raw) > limits.MAX_LAYERS or \
            isinstance(raw, int) and not isinstance(raw, bool) and raw > limits.MAX_LAYERS:
        raise BadInput(f.at("layers"), f"at most {limits.MAX_LAYERS} layers"
                       " (hyperpipe.core.limits)",
                       len(raw) if isinstance(raw, list) else raw)
    if isinstance(raw, list) and raw:
        rows = [_Fields(item, where, f"layers[{i}].", SYNTHETIC_LAYER_KEYS)
                for i, item in enumerate(raw)]
    elif isinstance(raw, list) or isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise BadInput(f.at("layers"), "a positive integer or a non-empty list of layers",
                       raw)
    else:
        rows = [None] * raw
    layers = []
    for row in rows:
        values = defaults if row is None else {**defaults, **_synthetic_values(row)}
        layers.append(_synthetic_layer(values, row or f, seq_len, DTYPE_BYTES[dtype]))
    if not any(layer.fwd_flops_per_sample or layer.i_flops_per_sample
               or layer.w_flops_per_sample or layer.activation_bytes_per_sample
               or layer.params for layer in layers):
        # Nothing to time: every stage would take 0 s and every speed divide by it. Stash
        # bytes are memory held for the backward, not work: they take no time.
        raise BadInput(f.at("layers"), "at least one layer with FLOPs, activation bytes "
                       "or parameters above 0 (stash_bytes_per_sample is memory, not "
                       "work)", has_got=False)
    return ModelSpec(name=printable(f.string("name", "synthetic")), layers=tuple(layers),
                     seq_len=seq_len, dtype=dtype, config=None, optimizer_state=state)


def _synthetic_values(f: _Fields) -> dict[str, Any]:
    """The synthetic layer fields present in `f`, checked and in SI units."""
    out: dict[str, Any] = {}
    for key in SYNTHETIC_LAYER_KEYS:
        if not f.has(key):
            continue
        if key in ("params_per_layer", "hidden"):
            out[key] = f.positive_int(key, allow_zero=key == "params_per_layer",
                                      at_most=limits.MAX_MODEL_DIM if key == "hidden"
                                      else limits.MAX_PARAMS_PER_LAYER)
        else:
            out[key] = f.quantity(key, "flop" if "flops" in key else "bytes", positive=False)
    return out


def _synthetic_layer(v: dict[str, Any], f: _Fields, seq_len: int, dtype_bytes: int
                     ) -> SyntheticLayer:
    """Fill defaults: I and W = forward, stash = activation bytes (docs/formats.md); with a
    `hidden` width the defaults are those of the Linear(hidden, hidden) it builds."""
    h = v.get("hidden")
    fwd = v.get("fwd_flops_per_sample")
    if fwd is None:
        if h is None:
            raise BadInput(f.at("fwd_flops_per_sample"),
                           "a value (required unless hidden is given)", has_got=False)
        fwd = float(2 * seq_len * h * h)
    act = v.get("activation_bytes_per_sample", float(seq_len * h * dtype_bytes) if h else 0.0)
    return SyntheticLayer(
        fwd_flops_per_sample=fwd,
        i_flops_per_sample=v.get("i_flops_per_sample", fwd),
        w_flops_per_sample=v.get("w_flops_per_sample", fwd),
        activation_bytes_per_sample=act,
        stash_bytes_per_sample=v.get("stash_bytes_per_sample", act),
        params=v.get("params_per_layer", h * h + h if h else 0),
        hidden=h)


def model_ref(model: ModelSpec) -> str | dict:
    """The plan's `model` field: the preset name when `model` is that preset unchanged,
    otherwise the inline document."""
    if model.name in PRESETS and load_model(model.name) == model:
        return model.name
    return model.to_dict()


__all__ = ["GPT_KEYS", "SYNTHETIC_LAYER_KEYS", "load_model", "model_ref"]
