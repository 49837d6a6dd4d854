"""Data-parallel gradient reduction and the optimizer step of one rank.

Gradients are summed over the ranks that hold the same shard of the same layers
(placement.dp_groups). Summing is the right weighting for heterogeneous replicas: each
micro-batch's loss is already scaled by micro_batch / global_batch (runtime), so the
sum over every micro-batch of every replica is the gradient of the full-batch mean,
whatever each replica's micro-batch count.

The optimizer is AdamW on the rank's local parameter tensors (a tensor-parallel shard's
local storage, so DTensors never reach the optimizer). With the distributed optimizer
(ZeRO stage 1/2 as in Megatron's distributed optimizer: Rajbhandari et al. 2020), each
data-parallel group's gradients are reduce-scattered instead of all-reduced: rank i of k
gets the sum of slice i of the group's flattened gradients, AdamW updates that slice of
the parameters alone (keeping only its slice of the moments), and an all-gather brings
every rank the updated whole. AdamW is elementwise, so this is the same update as the
replicated one, with 1/k of the optimizer state per rank.

Every rank of the job constructs its DataParallel at the same time, with the same
groups in the same order (process groups are created collectively).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from hyperpipe.exec.comm import wait
from hyperpipe.exec.tensor_parallel import local
from hyperpipe.plan.trace import TraceEvent


@dataclass
class _Group:
    """One data-parallel group this rank belongs to."""

    pg: dist.ProcessGroup
    size: int                           # ranks in the group
    index: int                          # this rank's place in it
    params: list[nn.Parameter]
    peers: str                          # the other devices, for messages and traces
    numel: int                          # elements of the local tensors, flattened
    shard: nn.Parameter | None = None   # distributed optimizer: this rank's slice

    @property
    def padded(self) -> int:
        return -(-self.numel // self.size) * self.size


class DataParallel:
    """Sums gradients over data-parallel groups and steps AdamW (optionally sharded).

    `groups`: (ranks, layers) of every group of the job (placement.dp_groups);
    `params_by_layer`: this rank's parameters by global layer index.
    """

    def __init__(self, groups: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], rank: int,
                 params_by_layer: dict[int, list[nn.Parameter]], devices: Sequence[str],
                 timeout_s: float, *, lr: float, distributed_optimizer: bool = False):
        self._timeout_s = timeout_s
        self.distributed = distributed_optimizer
        self.params = [p for layer in sorted(params_by_layer) for p in params_by_layer[layer]]
        self._groups: list[_Group] = []
        grouped: set[int] = set()
        for ranks, layers in groups:
            pg = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
            if rank not in ranks:
                continue
            params = [p for layer in layers for p in params_by_layer.get(layer, [])]
            grouped.update(id(p) for p in params)
            numel = sum(local(p).numel() for p in params)
            self._groups.append(_Group(pg, len(ranks), ranks.index(rank), params,
                                       ",".join(devices[r] for r in ranks if r != rank),
                                       numel))
        solo = [p for p in self.params if id(p) not in grouped]
        # (parameter, the tensor AdamW updates): the parameter itself, or the local shard
        # of a DTensor parameter (the same storage; this very object gets the gradient)
        self._updated = [(p, local(p)) for p in
                         (solo if self.distributed else self.params)]
        targets: list[torch.Tensor] = [t for _, t in self._updated]
        if self.distributed:
            for g in self._groups:
                flat = self._flat([local(p).detach() for p in g.params], g.padded)
                n = g.padded // g.size
                g.shard = nn.Parameter(flat[g.index * n:(g.index + 1) * n].clone())
                targets.append(g.shard)
        self.optimizer = torch.optim.AdamW(targets, lr=lr)

    @staticmethod
    def _flat(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
        flat = torch.zeros(length, dtype=torch.float32,
                           device=tensors[0].device if tensors else "cpu")
        offset = 0
        for t in tensors:
            flat[offset:offset + t.numel()] = t.reshape(-1)
            offset += t.numel()
        return flat

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Local gradients; a layer that saw no data (zero micro-batches) contributes 0."""
        out = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(local(p.grad))
        return out

    def reduce(self, device_name: str, step: int, clock: Callable[[], float]
               ) -> list[TraceEvent]:
        """Sum every group's gradients over the group (all-reduce, or reduce-scatter into
        the rank's shard with the distributed optimizer); one event per group."""
        events = []
        for g in self._groups:
            start = clock()
            grads = self._grads(g.params)
            flat = self._flat(grads, g.padded)
            what = f"gradient reduction with {g.peers}"
            if self.distributed:
                n = g.padded // g.size
                mine = torch.empty(n, dtype=flat.dtype, device=flat.device)
                wait(dist.reduce_scatter_single(mine, flat, group=g.pg, async_op=True),
                     self._timeout_s, what)
                g.shard.grad = mine
            else:
                wait(dist.all_reduce(flat, group=g.pg, async_op=True), self._timeout_s, what)
                offset = 0
                for t in grads:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
            events.append(TraceEvent(device_name, "allreduce", -1, -1, start, clock(),
                                     float(g.numel * flat.element_size()), g.peers, step))
        return events

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's parameters (or slices); with the distributed optimizer,
        then all-gather every group's updated slices into its parameters."""
        for p, t in self._updated:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if t is not p:
                t.grad = local(p.grad)
        self.optimizer.step()
        if not self.distributed:
            return
        for g in self._groups:
            whole = torch.empty(g.padded, dtype=g.shard.dtype, device=g.shard.device)
            wait(dist.all_gather_single(whole, g.shard.detach(), group=g.pg, async_op=True),
                 self._timeout_s, f"parameter all-gather with {g.peers}")
            offset = 0
            for p in g.params:
                t = local(p)
                t.copy_(whole[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    @torch.no_grad()
    def gather_grads(self) -> None:
        """With the distributed optimizer, put the reduced whole gradients back into
        ``.grad`` (each rank kept only its slice): for inspection (RankRuntime.captured),
        not for training. Collective over the data-parallel groups."""
        if not self.distributed:
            return
        for g in self._groups:
            if g.shard.grad is None:
                continue
            whole = torch.empty(g.padded, dtype=g.shard.dtype, device=g.shard.device)
            wait(dist.all_gather_single(whole, g.shard.grad, group=g.pg, async_op=True),
                 self._timeout_s, f"gradient all-gather with {g.peers}")
            offset = 0
            for t in self._grads(g.params):
                t.copy_(whole[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
        if self.distributed:        # the shards are the master copy: refresh from params
            for g in self._groups:
                flat = self._flat([local(p).detach() for p in g.params], g.padded)
                n = g.padded // g.size
                with torch.no_grad():
                    g.shard.copy_(flat[g.index * n:(g.index + 1) * n])
