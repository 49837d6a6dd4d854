"""Layer-level model specs (costs per layer, with sources) and the torch modules built
from the same spec. Nothing here knows about devices or schedules.

* `spec`: the layer kinds with their cost formulas, and `ModelSpec`.
* `presets`: published GPT-2, GPT-3 and Llama shapes, and `tiny-gpt` for CPUs.
* `loader`: `load_model` (preset, file or dict) and `model_ref` (a plan's reference).
* `gpt`: nanoGPT-style modules, one per spec layer; stages built alone match the model.
  Imported lazily, so that planning and simulation do not need to import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hyperpipe.models.loader import load_model, model_ref
from hyperpipe.models.presets import PRESETS, Preset
from hyperpipe.models.spec import (
    DTYPE_BYTES,
    EmbeddingLayer,
    GPTConfig,
    HeadLayer,
    Layer,
    LayerCost,
    ModelSpec,
    SyntheticLayer,
    TransformerBlock,
    gpt_spec,
)

if TYPE_CHECKING:
    from hyperpipe.models.gpt import (
        StageModule,
        build_layer,
        build_model,
        build_stage,
        example_batch,
    )

_TORCH_NAMES = ("StageModule", "build_layer", "build_model", "build_stage", "example_batch")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from hyperpipe.models import gpt
        return getattr(gpt, name)
    raise AttributeError(f"module 'hyperpipe.models' has no attribute {name!r}")


__all__ = [
    "DTYPE_BYTES", "EmbeddingLayer", "GPTConfig", "HeadLayer", "Layer", "LayerCost",
    "ModelSpec", "PRESETS", "Preset", "SyntheticLayer", "TransformerBlock", "gpt_spec",
    "load_model", "model_ref", "StageModule", "build_layer", "build_model", "build_stage",
    "example_batch",
]
