"""Measured memory of one rank: its peak bytes in each step, for the trace.

* CUDA: ``torch.cuda.max_memory_allocated``, reset as each step starts.
* CPU: torch keeps no allocator statistics for the CPU, so the rank counts what the
  simulator's memory model counts (sim.memory): its parameters, their gradients, the
  optimizer's state, and the tensors autograd saves for backward. Saved tensors are
  counted through ``torch.autograd.graph.saved_tensors_hooks``: when autograd packs one
  (during forward) its storage is counted, and when autograd lets the packed handle go
  (after the backward that used it) it is uncounted; a storage saved twice counts once,
  and a parameter saved by its layer is not an activation. Torch's checkpoint
  (recompute) keeps a block's input alive outside autograd's saved tensors, so
  `recompute.Recomputed` saves it through autograd where this meter sees it. The peak
  is sampled whenever a tensor is packed and after every action. Under ZeRO-3
  (exec.fsdp) the parameters are this rank's shards, and what FSDP2 holds gathered
  (parameters, unsharded gradients) is added as `working.working_bytes()`; a gathered
  parameter that its layer saves for backward is a parameter (`working.holds`).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.distributed.tensor import DTensor

from hyperpipe.exec.tensor_parallel import local

CPU_WHAT = "params+grads+optimizer state+saved tensors (saved_tensors_hooks)"
CUDA_WHAT = "torch.cuda.max_memory_allocated"


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of the storage behind `t` (a DTensor's local shard's)."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class _Saved:
    """What autograd keeps for a saved tensor: the tensor and a release on collection."""

    __slots__ = ("tensor", "_meter", "_key")

    def __init__(self, tensor: torch.Tensor, meter: MemoryMeter, key: int):
        self.tensor, self._meter, self._key = tensor, meter, key

    def __del__(self) -> None:
        self._meter._release(self._key)


class MemoryMeter:
    """Peak bytes of one rank per step. `params`: the rank's parameters; `state`: a
    callable giving the optimizer's state tensors (and any master copies); `working`:
    ZeRO-3's sharded stages (exec.fsdp.ShardedStages), or None."""

    def __init__(self, device: torch.device, params: list[torch.nn.Parameter],
                 state: callable, working=None):
        self.device = device
        self._working = working
        self.params = params
        self._state = state
        self._param_keys = {_storage(p)[0] for p in params}
        self._param_bytes = sum(local(p).nbytes for p in params)
        self._saved: dict[int, list[int]] = {}     # storage key -> [references, bytes]
        self._saved_bytes = 0
        self._static_bytes = 0.0    # params + grads + state at the last `sample`
        self.peak_bytes = 0.0

    @property
    def what(self) -> str:
        return CUDA_WHAT if self.device.type == "cuda" else CPU_WHAT

    def start_step(self) -> None:
        self.peak_bytes = 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.sample()

    def saving(self) -> AbstractContextManager:
        """Context in which autograd's saved tensors are counted (a forward)."""
        if self.device.type == "cuda":
            return nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        key, nbytes = _storage(t)
        if key in self._param_keys or nbytes == 0 or (
                self._working is not None and self._working.holds(t)):
            return t
        entry = self._saved.setdefault(key, [0, nbytes])
        if entry[0] == 0:
            self._saved_bytes += nbytes
        entry[0] += 1
        # gradients and optimizer state do not change during a forward: the last
        # sample's static bytes stand (keeps packing O(1), off the step's critical path)
        self.peak_bytes = max(self.peak_bytes, self._static_bytes + self._saved_bytes)
        # detached: an output saved by its own node (softmax's) would otherwise hold
        # that node through its grad_fn, a cycle through C++ that Python's collector
        # cannot break; the graphs of an I/W split (run with retain_graph) then leaked
        # their saved tensors every step. Autograd restores the grad_fn on unpacking.
        return _Saved(t.detach(), self, key)

    @staticmethod
    def _unpack(handle):
        return handle.tensor if isinstance(handle, _Saved) else handle

    def _release(self, key: int) -> None:
        entry = self._saved.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self._saved_bytes -= entry[1]
            del self._saved[key]

    def _grad_bytes(self) -> int:
        return sum(local(p.grad).nbytes for p in self.params if p.grad is not None)

    def sample(self) -> None:
        """Note the current total (CPU); on CUDA the allocator keeps the peak itself."""
        if self.device.type == "cuda":
            return
        self._static_bytes = float(self._param_bytes + self._grad_bytes() +
                                   sum(t.nbytes for t in self._state()))
        if self._working is not None:
            self._static_bytes += self._working.working_bytes()
        self.peak_bytes = max(self.peak_bytes, self._static_bytes + self._saved_bytes)

    def step_peak(self) -> float:
        """The step's peak bytes (call after the optimizer step)."""
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        self.sample()
        return self.peak_bytes


def state_tensors(optimizer: torch.optim.Optimizer, extra: Iterable[torch.Tensor] = ()
                  ) -> list[torch.Tensor]:
    """The optimizer's state tensors (Adam's moments and step counts) and `extra` (the
    distributed optimizer's master slices, where it keeps them)."""
    out = [v for st in optimizer.state.values() for v in st.values()
           if isinstance(v, torch.Tensor)]
    return out + list(extra)
