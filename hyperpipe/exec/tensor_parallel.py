"""Tensor parallelism inside a stage, with torch's own API (torch.distributed.tensor.parallel).

A stage of tp > 1 runs on a DeviceMesh of its tp ranks (built from a process group that
every rank of the job created collectively). Megatron's layout (Shoeybi et al. 2019,
sec. 3): in each transformer block the QKV and MLP up (and gate) projections are
column-parallel, the attention and MLP output projections row-parallel, so a block needs
one all-reduce forward and one backward per sub-layer; each rank holds n_head / tp heads.
Embedding, head and norms stay whole on every rank (the same values and gradients on
each). A synthetic layer's Linear is column-parallel with its output gathered.

With `sequence_parallel` (Korthikanti et al. 2022, sec. 4.2.2) the norms run on a
1/tp slice of the sequence (SequenceParallel), the column-parallel projections all-gather
it and the row-parallel ones reduce-scatter back to it. The stage's blocks then take the
sequence slice of their input (`_ToSequenceShards`) and gather it back at the end
(`_FromSequenceShards`), so what crosses a stage boundary is always the whole (B, S, D)
activation, the same on every rank of the group: that is what lets a tp=2 stage feed a
tp=1 stage (placement.message_pairs picks who sends to whom).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hyperpipe.models.gpt import Block, Synthetic

_QKV = ("attn.c_attn.weight", "attn.c_attn.bias")


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own storage of a tensor: a DTensor's local shard (a view sharing its
    storage, so in-place updates reach the parameter), a plain tensor itself."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def mesh_of(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """A one-dimensional DeviceMesh over an existing process group (its ranks)."""
    return DeviceMesh.from_group(group, device.type)


class _ToSequenceShards(nn.Module):
    """(B, S, D) whole on every rank -> (B, S/tp, D), this rank's slice. Backward
    all-gathers the slices' gradients (the whole input's gradient on every rank)."""

    takes_targets = False

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return whole.redistribute(self.mesh, [Shard(1)]).to_local()


class _FromSequenceShards(nn.Module):
    """(B, S/tp, D) slices -> (B, S, D) whole on every rank (all-gather); backward keeps
    this rank's slice of the (whole, identical) output gradient."""

    takes_targets = False

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sliced = DTensor.from_local(x, self.mesh, [Shard(1)], run_check=False)
        return sliced.redistribute(self.mesh, [Replicate()]).to_local()


def _qkv_order(q_dim: int, kv_dim: int, tp: int) -> torch.Tensor:
    """Row order of the QKV weight (q_dim + 2 kv_dim rows, whole) that puts shard i's
    heads (Q, K and V) in row block i."""
    rows: list[int] = []
    for i in range(tp):
        for base, width in ((0, q_dim), (q_dim, kv_dim), (q_dim + kv_dim, kv_dim)):
            rows += range(base + i * width // tp, base + (i + 1) * width // tp)
    return torch.tensor(rows)


# The QKV projection is one Linear whose rows are [Q | K | V]. A plain row split would
# give rank 0 all of Q; `_shard_major_qkv` reorders the rows to [Q_0 K_0 V_0 | Q_1 K_1 V_1 |
# ...] first, so each column-parallel shard holds whole heads; `full_parameters` undoes it,
# so that gathered parameters and gradients compare name by name with a single process.
@torch.no_grad()
def _shard_major_qkv(attn: nn.Module, tp: int) -> None:
    order = _qkv_order(attn.n_head * attn.head_dim, attn.kv_dim, tp)
    attn.c_attn.weight.copy_(attn.c_attn.weight[order])
    if attn.c_attn.bias is not None:
        attn.c_attn.bias.copy_(attn.c_attn.bias[order])
    attn.n_head //= tp                  # local heads: what forward splits and reshapes
    attn.n_kv_head //= tp
    attn.kv_dim //= tp


def _block_plan(block: Block, sequence_parallel: bool) -> dict:
    out_layout = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan: dict = {"attn.c_attn": ColwiseParallel(),
                  "attn.c_proj": RowwiseParallel(**out_layout),
                  "mlp.c_fc": ColwiseParallel(),
                  "mlp.c_proj": RowwiseParallel(**out_layout)}
    if block.mlp.c_gate is not None:
        plan["mlp.c_gate"] = ColwiseParallel()
    if sequence_parallel:
        gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),),
                  "use_local_output": True}
        plan.update({"ln_1": SequenceParallel(), "attn": PrepareModuleInput(**gather),
                     "ln_2": SequenceParallel(), "mlp": PrepareModuleInput(**gather)})
    return plan


def _synthetic_plan() -> dict:
    """A synthetic layer's tensor-parallel plan: its Linear column-parallel, output
    gathered."""
    return {"fc": ColwiseParallel(output_layouts=Replicate())}


def parallelize_stage(layers: list[nn.Module], mesh: DeviceMesh, *, sequence_parallel: bool
                      ) -> list[nn.Module]:
    """Shard the stage's layers over `mesh` in place; return the layer list to run (with
    sequence parallelism, the slicing and gathering modules around each run of blocks)."""
    tp = mesh.size()
    out: list[nn.Module] = []
    in_blocks = False
    for layer in layers:
        if isinstance(layer, Block):
            _shard_major_qkv(layer.attn, tp)
            parallelize_module(layer, mesh, _block_plan(layer, sequence_parallel))
            if sequence_parallel and not in_blocks:
                out.append(_ToSequenceShards(mesh))
            in_blocks = True
        else:
            if isinstance(layer, Synthetic):
                parallelize_module(layer, mesh, _synthetic_plan())
            if sequence_parallel and in_blocks:
                out.append(_FromSequenceShards(mesh))
            in_blocks = False
        out.append(layer)
    if sequence_parallel and in_blocks:
        out.append(_FromSequenceShards(mesh))
    return out


@dataclass(frozen=True)
class GradSlices:
    """A parameter's local gradient as `parts` equal slices along `dim` (None: a
    parameter every tensor-parallel rank holds whole, each slice then the whole), in the
    row order `order` (QKV rows: shard-major for `parts`) or as stored.

    A stage of degree t among data-parallel replicas of degree T = t x parts: slice q
    of tensor rank j is what tensor rank j·parts + q of a degree-T group holds, so ring
    q of those ranks reduces it (`placement.dp_slices`)."""

    parts: int
    dim: int | None
    order: torch.Tensor | None = None

    def take(self, grad: torch.Tensor, q: int) -> torch.Tensor:
        """Slice `q` of `grad` (a copy where it is not a view)."""
        if self.dim is None:
            return grad
        if self.order is not None:
            return grad.index_select(self.dim, self._rows(grad, q))
        n = grad.shape[self.dim] // self.parts
        return grad.narrow(self.dim, q * n, n)

    @torch.no_grad()
    def put(self, grad: torch.Tensor, q: int, values: torch.Tensor) -> None:
        """Write `values` (slice `q`'s shape, any layout) into `grad`."""
        if self.dim is None:
            grad.copy_(values.view_as(grad))
        elif self.order is not None:
            rows = self._rows(grad, q)
            shape = list(grad.shape)
            shape[self.dim] = len(rows)
            grad.index_copy_(self.dim, rows, values.reshape(shape))
        else:
            part = self.take(grad, q)
            part.copy_(values.view(part.shape))

    def numel(self, local_numel: int) -> int:
        return local_numel if self.dim is None else local_numel // self.parts

    def _rows(self, grad: torch.Tensor, q: int) -> torch.Tensor:
        n = grad.shape[self.dim] // self.parts
        return self.order[q * n:(q + 1) * n].to(grad.device)


def _shard_dims(layer: nn.Module) -> dict[str, int]:
    """Parameter name -> the dimension tensor parallelism shards it along (column-
    parallel weights and biases 0, row-parallel weights 1); a name left out stays whole
    on every rank. From the same plans `parallelize_stage` applies."""
    plan = (_block_plan(layer, False) if isinstance(layer, Block) else
            _synthetic_plan() if isinstance(layer, Synthetic) else {})
    dims = {}
    for path, style in plan.items():
        if isinstance(style, ColwiseParallel):
            dims.update({f"{path}.weight": 0, f"{path}.bias": 0})
        elif isinstance(style, RowwiseParallel):
            dims[f"{path}.weight"] = 1
    return dims


def grad_slices(layer: nn.Module, parts: int) -> dict[int, GradSlices]:
    """By parameter id, how each of `layer`'s local gradients splits into `parts`
    (`GradSlices`), for a data-parallel reduction with replicas of `parts` times this
    rank's tensor-parallel degree. RuntimeError where a sharded parameter is not sharded
    as `_shard_dims` says (a layout this function does not know)."""
    dims = _shard_dims(layer)
    out = {}
    for name, p in layer.named_parameters():
        dim = dims.get(name)
        if isinstance(p, DTensor):
            shard = [pl.dim for pl in p.placements if isinstance(pl, Shard)]
            if shard != ([] if dim is None else [dim]):
                raise RuntimeError(f"{name} is sharded as {p.placements}, not along {dim}")
        order = None
        if name.endswith(_QKV) and dim is not None:
            attn = layer.get_submodule(name.rsplit(".", 2)[0])      # local head counts
            order = _qkv_order(attn.n_head * attn.head_dim, attn.kv_dim, parts)
        out[id(p)] = GradSlices(parts, dim, order)
    return out


FP32_BYTES = 4       # the executor's tensor-parallel collectives move fp32 on the CPU


def comm_bytes(spec, layers: tuple[int, int], micro_batch: int, op: str, recompute: str
               ) -> float:
    """Bytes per rank of the all-reduces one action of a tensor-parallel stage runs over
    its group, in all-reduce terms (the link time that emulation adds after the action's
    compute, exec.collectives.timing_ring). Megatron's layout (Shoeybi et al. 2019,
    fig. 3): a block all-reduces its (B, S, D) output twice in F and its input gradient
    twice in B or I (with sequence parallelism an all-gather and a reduce-scatter
    instead of each, the same bytes in ring terms); a synthetic layer all-gathers its
    output in F (half an all-reduce) and all-reduces its input gradient in B or I.
    Under full recompute a backward redoes the forward's collectives. W runs none."""
    if op not in ("F", "B", "I"):
        return 0.0
    total = 0.0
    for i in range(*layers):
        layer = spec.layers[i]
        width = spec.config.d_model if spec.config is not None else layer.hidden
        tensor = micro_batch * spec.seq_len * width * FP32_BYTES
        if layer.kind == "block":
            forward, backward = 2 * tensor, 2 * tensor
        elif layer.kind == "synthetic":
            forward, backward = tensor / 2, tensor
        else:
            continue
        total += forward if op == "F" else backward + (forward if recompute == "full" else 0)
    return total


@torch.no_grad()
def finish_grads(params: list[nn.Parameter]) -> None:
    """Sum the partial gradients that sequence parallelism leaves on replicated parameters
    (the norms': each rank saw a slice of the sequence) over the tp group, so that every
    rank holds the whole gradient before data-parallel reduction and the optimizer."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, [Replicate()] * g.device_mesh.ndim)


def full_parameters(module: nn.Module, tp: int) -> Iterator[tuple[str, torch.Tensor,
                                                                  torch.Tensor | None]]:
    """(name, whole parameter, whole gradient or None) on the CPU, in the single-process
    layout (QKV rows back in [Q | K | V] order). Collective over the tp group."""
    for name, p in module.named_parameters():
        value, grad = p.detach(), p.grad
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        if tp > 1 and name.endswith(_QKV):
            attn = module.get_submodule(name.rsplit(".", 2)[0])    # local head counts
            inverse = torch.argsort(_qkv_order(attn.n_head * attn.head_dim * tp,
                                               attn.kv_dim * tp, tp))
            value = value[inverse]
            grad = None if grad is None else grad[inverse]
        yield name, value.cpu().clone(), None if grad is None else grad.detach().cpu().clone()
