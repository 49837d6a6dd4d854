"""Layer-level model specs and the torch modules built from the same spec: per layer its
FLOPs, parameters, activation and stash bytes (with sources), the published presets and
a tiny GPT for CPUs, and the loader of model files. Nothing here knows about devices or
schedules; the torch modules (`gpt`) are imported lazily, so that planning and
simulation do not import torch.
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
    MoEBlock,
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
    "ModelSpec", "PRESETS", "Preset", "SyntheticLayer", "TransformerBlock", "MoEBlock", "gpt_spec",
    "load_model", "model_ref", "StageModule", "build_layer", "build_model", "build_stage",
    "example_batch",
]
