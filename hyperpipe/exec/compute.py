"""The compute of one stage's actions, shared by the executor's replay and by per-layer
profiling, so that a profile times exactly what a run does.

A stash entry of a micro-batch is ``[x, out, backward_state, embedded]``: the input the
gradients are taken w.r.t., the output (the scaled loss on the last stage), what I left
for W, and the embedding's output on a first stage (whose graph is cut after the
embedding, so that I has an input to differentiate: token ids have no gradient).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

try:    # torch's own I/W split (the graph walk of its zero-bubble schedules)
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )
except ImportError:     # pragma: no cover - older or newer torch without the private API
    stage_backward_input = stage_backward_weight = None


def forward(layers: Sequence[torch.nn.Module], x: torch.Tensor, targets: torch.Tensor | None,
            *, cut_after_first: bool, loss_scale: float = 1.0) -> list:
    """F: run `layers` on `x`; the last layer gets `targets` if it takes them.

    With `cut_after_first` (a first stage that starts with the embedding) the graph is
    cut after the first layer: I = the rest's input gradients, as the cost model counts
    it; W = the weight gradients, the embedding's included."""
    embedded = None
    if cut_after_first:
        embedded = layers[0](x)
        x = embedded.detach().requires_grad_()
        layers = layers[1:]
    out = x
    for layer in layers:
        out = layer(out, targets) if getattr(layer, "takes_targets", False) else layer(out)
    if targets is not None and loss_scale != 1.0:
        out = out * loss_scale
    if out._base is not None:
        # a view (sequence parallelism's all-gather ends a stage so): torch's I detaches
        # the output in place, which a view refuses
        out = out.clone()
    return [x, out, None, embedded]


def backward(entry: list, grad: torch.Tensor | None) -> torch.Tensor | None:
    """B: input and weight gradients at once; returns the input gradient."""
    x, out, _, embedded = entry
    torch.autograd.backward(out, grad)
    if embedded is not None:
        torch.autograd.backward(embedded, x.grad)
    return x.grad


def input_grad(params: Iterable[torch.nn.Parameter], entry: list,
               grad: torch.Tensor | None) -> torch.Tensor | None:
    """I: the input gradient only, keeping what W needs; returns the input gradient."""
    x, out, _, embedded = entry
    dx = None
    if not x.requires_grad:             # a first stage without an embedding to cut at
        entry[2] = ("full", grad)       # W runs the whole backward
    elif out is x:                      # a stage of the embedding alone: nothing to do
        entry[2] = ("done", None)
    elif stage_backward_input is not None:
        dxs, groups = stage_backward_input([out], None if grad is None else [grad], [x],
                                           params)
        entry[1:3] = [None, ("groups", groups)]
        dx = dxs[0]
    else:                               # pragma: no cover - fallback without torch's split
        dx = torch.autograd.grad(out, x, grad, retain_graph=True)[0]
        entry[2] = ("full", grad)
    if embedded is not None and entry[2][0] != "full":
        entry[3] = (embedded, grad if out is x else dx)   # for W
    return dx


def weight_grad(params: Iterable[torch.nn.Parameter], entry: list) -> None:
    """W: the weight gradients from what I kept, accumulated into ``.grad``."""
    _, out, (kind, payload), embedded = entry
    if kind == "groups":
        stage_backward_weight(params, payload)
    elif kind == "full":
        torch.autograd.backward(out, payload)
    if isinstance(embedded, tuple):     # the embedding's weight gradient
        torch.autograd.backward(*embedded)
