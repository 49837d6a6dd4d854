"""Activation recompute per stage (Chen et al. 2016; Korthikanti et al. 2022, sec. 4).

* ``full``: every transformer block (or synthetic layer) keeps only its input for
  backward and runs its forward again during backward (torch.utils.checkpoint,
  non-reentrant, which also works with the I/W split's autograd.grad).
* ``selective``: only the attention core (softmax(QK^T)V, whose s^2 scores dominate a
  block's saved bytes) is dropped and recomputed (`CausalSelfAttention.recompute_core`);
  a synthetic layer has no attention, so nothing is recomputed.

The embedding and the head (with the loss) are never recomputed, as the cost model
assumes (it prices recompute for blocks only).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyperpipe.models.gpt import Block, Synthetic
from hyperpipe.plan.plan import RECOMPUTE_KINDS


class _KeepInput(torch.autograd.Function):
    """Identity that saves its input through autograd: the input a checkpointed block
    keeps for its recompute (torch's checkpoint holds it outside autograd's saved
    tensors, where exec.memory could not count it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Recomputed(nn.Module):
    """Runs `layer` under torch.utils.checkpoint: saves its input only."""

    takes_targets = False

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.layer, _KeepInput.apply(x), use_reentrant=False)


def apply_recompute(layers: list[nn.Module], mode: str) -> list[nn.Module]:
    """The stage's layer list to run with recompute `mode` (modules are shared, not
    copied: parameters and their names stay those of the stage module)."""
    if mode not in RECOMPUTE_KINDS:
        raise ValueError(f"recompute {mode!r}, expected one of {RECOMPUTE_KINDS}")
    out = []
    for layer in layers:
        if isinstance(layer, Block) and mode == "selective":
            layer.attn.recompute_core = True
        if mode == "full" and (isinstance(layer, Block) or (
                isinstance(layer, Synthetic) and not layer.takes_targets)):
            layer = Recomputed(layer)
        out.append(layer)
    return out
