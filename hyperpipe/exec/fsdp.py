"""ZeRO-3 in a real run: a stage's parameters sharded over its data-parallel group with
torch's FSDP2 `fully_shard` (torch/distributed/fsdp/_fully_shard), one unit per layer.

**Units and groups.** Each layer of a stage (embedding, transformer block, head: the
unit `hyperpipe.sim.sharding` prices) is one `fully_shard` unit over the stage's
data-parallel process group (the ranks holding the same stage in every replica,
`placement.dp_groups`), as torchtitan's `apply_fsdp` wraps each transformer block
(torchtitan/models/llama3/infra/parallelize.py). Unlike torchtitan, which shards the
whole model last as the root of its blocks, each unit is its own root, initialised up
front: the runtime calls the layers one by one (`compute.forward`), and a first stage's
embedding runs its backward in an autograd call of its own, after which a shared root's
end-of-backward callback would already have reduce-scattered it. So the prefetches are
explicit: the next unit's gather when a unit's forward starts, the previous unit's when
its backward starts (what FSDP2 does by default inside one root).
Parameters become DTensors sharded on dim 0; AdamW steps their local shards
(`DataParallel` with no groups). Each micro-batch's loss is already scaled to its share
of the global batch, so gradients are summed, not averaged
(`set_gradient_divide_factor(1)` with sum reductions, gloo having no pre-multiplied sum).

**Resharding and pipelining** (`reshard_after_forward`, the plan's
`runtime.reshard_after_forward`, else torchtitan's policy: off when the plan pipelines,
on otherwise). On: FSDP2's own behaviour; every forward gathers each unit (the next
unit's gather prefetched when a unit starts, `set_modules_to_forward_prefetch`), every
backward gathers it again (FSDP2's backward prefetch of the previous unit) and
reduce-scatters its gradient after it. Off: what torch's pipelining stage does for an
FSDP module (torch/distributed/pipelining/stage.py, `backward_maybe_with_nosync` and
`perform_reduce_grad`, which torchtitan's pipeline_parallel.py relies on): no gradient
sync and no reshard on every backward but the stage's last, so a stage's units are
gathered once a step and their gradients, accumulated whole, reduce-scattered once by
its last backward. A rank of one stage gathers them in its first forward; a rank of
several issues every gather at the step's start (`ShardedStages.start_step`).

**Timing.** The data moves with gloo's collectives inside FSDP2 (its all-gather and
reduce-scatter replaced by `_Gather` and `_Scatter`, `set_custom_all_gather`). With
emulated links each one is also charged to the link emulator as the ring steps of the
same bytes over the same group (`collectives.ring_steps`), on one worker thread per
group that serves them in issue order (the communication stream the simulator models):
a gather is issued when FSDP2 issues it (prefetches included) and the unit's compute
waits for its emulated arrival (FSDP2's wait on the returned Work); a reduce-scatter is
issued when the unit's backward ends and only the step's end waits for it. Every
gather and reduce-scatter is a trace event (`allgather`, `reducescatter`) from its
issue to its end.

**Memory** (`exec.memory`): the sharded parameters, gradients and AdamW state are the
meter's; `working_bytes` adds what FSDP2 holds unsharded (gathered parameters, and
without resharding the whole accumulated gradients), sampled after each unit's gather
and at each reduce-scatter (with that unit's gradient, then held only as the
reduce-scatter's input); a gathered parameter saved for backward by its layer is a
parameter, not an activation (`holds`).

Not run: tensor parallelism with ZeRO-3, tied embeddings with ZeRO-3, and schedules that
split the backward into I and W (FSDP2's post-backward hook fires once per backward, at
the module's input; `placement.check_runnable` refuses them).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from hyperpipe.exec.collectives import ring_order, ring_steps
from hyperpipe.exec.comm import PeerFailure, wait
from hyperpipe.exec.links import Links
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.trace import TraceEvent


def reshard_after_forward(plan: Plan) -> bool:
    """The plan's `runtime.reshard_after_forward`, or torchtitan's default policy
    (`apply_fsdp`: off when pipelining "to avoid per-microbatch all-gathers", on
    otherwise); the same rule the simulator applies."""
    given = plan.runtime_settings().reshard_after_forward
    if given is not None:
        return given
    return not any(len(p.stages) // plan.chunks > 1 for p in plan.pipelines)


class _Stream:
    """One group's emulated communication stream: ring steps over the emulated links,
    served in issue order on a worker thread; each job's Future gives (start_s, end_s)
    on the rank's clock."""

    def __init__(self, ring: Sequence[int], rank: int, links: Links, name: Hashable,
                 clock: Callable[[], float]):
        self.ring, self.rank, self.links, self.name = tuple(ring), rank, links, name
        self.clock = clock
        self._seq = 0
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._work, name=f"fsdp {name}", daemon=True).start()

    def submit(self, phase: str, step_bytes: float) -> Future:
        """`len(ring) - 1` ring steps of `step_bytes` (an all-gather or reduce-scatter)."""
        self._seq += 1
        fut: Future = Future()
        self._jobs.put((phase, step_bytes, self._seq, fut))
        return fut

    def _work(self) -> None:
        while True:
            phase, step_bytes, seq, fut = self._jobs.get()
            try:
                start = self.clock()
                ring_steps(self.links, self.ring, self.rank, step_bytes, len(self.ring) - 1,
                           (self.name, seq, phase), self.name)
                fut.set_result((start, self.clock()))
            except BaseException as exc:      # handed to whoever waits for it
                fut.set_exception(exc)


class _Emulated(dist.Work):
    """The Work FSDP2 waits on for a gather: done when gloo's collective is (the data)
    and, under emulation, its flows have arrived (the time)."""

    def __init__(self, work: dist.Work, fut: Future | None, timeout_s: float, what: str):
        super().__init__()
        self._work, self._fut, self._timeout_s, self._what = work, fut, timeout_s, what

    def wait(self, timeout: timedelta | None = None) -> bool:
        wait(self._work, self._timeout_s, self._what)
        if self._fut is not None:
            try:
                self._fut.result(timeout=self._timeout_s)
            except TimeoutError:
                raise PeerFailure(f"{self._what}: no answer within "
                                  f"{self._timeout_s:g} s") from None
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed() and (self._fut is None or self._fut.done())


class _Group:
    """What the units of one stage share: its process group and ranks, its emulated
    stream (None without emulated links), the devices it shards with."""

    def __init__(self, owner: ShardedStages, pg: dist.ProcessGroup, ranks: tuple[int, ...],
                 stream: _Stream | None, peers: str):
        self.owner, self.pg, self.ranks, self.stream, self.peers = owner, pg, ranks, stream, peers


class _Gather(AllGather):
    """FSDP2's all-gather over gloo, timed by the link emulator when there is one."""

    def __init__(self, group: _Group):
        self.group = group

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        owner, g = self.group.owner, self.group
        start = owner.clock()
        nbytes = float(output_tensor.numel() * output_tensor.element_size())
        fut = None
        if g.stream is not None and owner.emulating:   # the flows leave as gloo starts
            fut = g.stream.submit("all-gather", nbytes / len(g.ranks))
            owner.pending.append(("allgather", fut, nbytes, g.peers))
        work = _Emulated(dist.all_gather_single(output_tensor, input_tensor, group=group,
                                                async_op=True),
                         fut, owner.timeout_s, f"parameter all-gather with {g.peers}")
        if fut is None:             # not emulated: timed by the data's own collective
            work.wait()
            owner.record("allgather", start, owner.clock(), nbytes, g.peers)
            return None
        if not async_op:
            work.wait()
            return None
        return work


class _Scatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter over gloo (a sum), timed by the link emulator
    when there is one; the step's end waits for the emulated ones."""

    def __init__(self, group: _Group):
        self.group = group

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        owner, g = self.group.owner, self.group
        nbytes = float(input_tensor.numel() * input_tensor.element_size())
        # held now: the unit's whole gradient, copied into `input_tensor` (FSDP2 has
        # dropped the gradients themselves and resharded the unit's weights)
        owner.transient_bytes = nbytes
        owner.sample()
        owner.transient_bytes = 0.0
        start = owner.clock()
        if g.stream is not None and owner.emulating:   # the flows leave as gloo starts
            owner.pending.append(("reducescatter",
                                  g.stream.submit("reduce-scatter", nbytes / len(g.ranks)),
                                  nbytes, g.peers))
        wait(dist.reduce_scatter_single(output_tensor, input_tensor, op=dist.ReduceOp.SUM,
                                        group=group, async_op=True),
             owner.timeout_s, f"gradient reduce-scatter with {g.peers}")
        if g.stream is None or not owner.emulating:
            owner.record("reducescatter", start, owner.clock(), nbytes, g.peers)
        return None


class ShardedStages:
    """ZeRO-3 over this rank's stages (see the module doc).

    `groups`: (ranks, layers) of every data-parallel group of the job, in the order
    every rank creates them (`placement.dp_groups`); `stages`: stage index -> (the stage
    module, its layer modules in order) on this rank. Every rank constructs it at the
    same time. Per step: `start_step`, `arm(stage)` before a stage's last backward
    action, `finish(device, step)` after the rank's last action (its events)."""

    def __init__(self, groups: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], rank: int,
                 stages: dict[int, tuple[nn.Module, list[nn.Module]]], devices: Sequence[str],
                 *, reshard: bool, timeout_s: float, clock: Callable[[], float],
                 links: Links | None = None, nodes: Sequence[str] = ()):
        self.reshard, self.timeout_s, self.clock = reshard, timeout_s, clock
        self.pending: list[tuple[str, Future, float, str]] = []
        self.events: list[tuple[str, float, float, float, str]] = []
        self.transient_bytes = 0.0
        self.sample: Callable[[], None] = lambda: None    # the memory meter's, once built
        # emulated links time the collectives from the first step on (not while the
        # reference phase times compute, exec.reference)
        self.emulating = False
        self.ranks: tuple[int, ...] = ()    # every rank this one shards with, and itself
        self.roots: dict[int, nn.Module] = {}
        self._units: dict[int, list[FSDPModule]] = {}
        self._held: set[int] = set()
        by_first: dict[int, _Group] = {}
        for ranks, layers in groups:
            pg = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
            if rank not in ranks:
                continue
            peers = ",".join(devices[r] for r in ranks if r != rank)
            stream = None if links is None else _Stream(
                ring_order(ranks, nodes), rank, links, ("fsdp", tuple(ranks), layers[0]), clock)
            by_first[layers[0]] = _Group(self, pg, tuple(ranks), stream, peers)
            self.ranks = tuple(sorted({*self.ranks, *ranks}))
        for s, (module, layers) in sorted(stages.items()):
            group = by_first.get(module.start)
            if group is None:           # held by this rank alone: nothing to shard
                continue
            mesh = DeviceMesh.from_group(group.pg, next(module.parameters()).device.type)
            units = []
            for layer in layers:
                if not any(True for _ in layer.parameters()):
                    continue
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
                units.append(layer)
            for i, unit in enumerate(units):
                unit._get_fsdp_state()._lazy_init()     # each unit its own root
                unit.set_custom_all_gather(_Gather(group))
                unit.set_custom_reduce_scatter(_Scatter(group))
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
                for pg_ in unit._get_fsdp_state()._fsdp_param_groups:
                    pg_.unshard_async_op = True      # waited for where the unit needs it
                if i + 1 < len(units):
                    unit.set_modules_to_forward_prefetch([units[i + 1]])
                if i > 0:
                    unit.set_modules_to_backward_prefetch([units[i - 1]])
                unit.register_forward_pre_hook(self._after_gather)
            self.roots[s] = module
            self._units[s] = units

    # ------------------------------------------------------------------ per step
    def start_step(self) -> None:
        """Before a step's first action: without resharding, no unit syncs or reshards
        until its stage's last backward (`arm`), and a rank of several stages issues
        all their gathers now, in stage order (the order of their first forwards), as
        torch's multi-stage pipelining runtime unshards stages ahead of their actions
        (`sim.sharding.first_forwards`); each unit's forward waits for its own."""
        self.events.clear()
        self.emulating = True
        for units in self._units.values():
            for unit in units:
                unit.set_is_last_backward(self.reshard)
                unit.set_requires_gradient_sync(self.reshard, recurse=False)
                unit.set_reshard_after_backward(self.reshard, recurse=False)
        if not self.reshard and len(self.roots) > 1:
            for s in sorted(self._units):
                for unit in self._units[s]:
                    unit.unshard(async_op=True)

    def arm(self, stage: int) -> None:
        """The next backward action is `stage`'s last of the step: its units reduce-
        scatter their gradients and reshard after it."""
        for unit in self._units.get(stage, []):
            unit.set_is_last_backward(True)
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)

    def record(self, op: str, start: float, end: float, nbytes: float, peers: str) -> None:
        self.events.append((op, start, end, nbytes, peers))

    def finish(self, device: str, step: int) -> list[TraceEvent]:
        """Wait for every emulated collective of the step; its events."""
        for op, fut, nbytes, peers in self.pending:
            try:
                start, end = fut.result(timeout=self.timeout_s)
            except TimeoutError:
                raise PeerFailure(f"{op} with {peers}: no answer within "
                                  f"{self.timeout_s:g} s") from None
            self.events.append((op, start, end, nbytes, peers))
        self.pending.clear()
        return [TraceEvent(device, op, -1, -1, start, end, nbytes, peers, step)
                for op, start, end, nbytes, peers in sorted(self.events, key=lambda e: e[1])]

    # ------------------------------------------------------------------ memory
    def _fsdp_params(self):
        for units in self._units.values():
            for unit in units:
                for group in unit._get_fsdp_state()._fsdp_param_groups:
                    yield from group.fsdp_params

    def _after_gather(self, module: nn.Module, args) -> None:
        """A unit's forward begins (FSDP2 has gathered it and issued the next unit's
        gather): note the gathered storages, sample the meter."""
        for fp in self._fsdp_params():
            if hasattr(fp, "_unsharded_param"):
                self._held.add(fp._unsharded_param.untyped_storage()._cdata)
        self.sample()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` lives in a gathered parameter's storage (a weight its layer saves
        for backward: counted as a parameter, not as an activation)."""
        return t.untyped_storage()._cdata in self._held

    def working_bytes(self) -> float:
        """Bytes held unsharded now: gathered parameters (a prefetched unit's still in
        its all-gather buffer), unsharded gradients, and the transient bytes of a
        reduce-scatter in progress."""
        total = self.transient_bytes
        for units in self._units.values():
            for unit in units:
                for group in unit._get_fsdp_state()._fsdp_param_groups:
                    result = group._all_gather_result
                    if result is not None and result.all_gather_output is not None:
                        total += result.all_gather_output.untyped_storage().nbytes()
        for fp in self._fsdp_params():
            if not hasattr(fp, "_unsharded_param"):
                continue
            total += fp._unsharded_param.untyped_storage().nbytes()
            grad = fp.unsharded_accumulated_grad
            if grad is None:
                grad = fp._unsharded_param.grad
            if grad is not None:
                total += grad.untyped_storage().nbytes()
        return float(total)


__all__ = ["ShardedStages", "reshard_after_forward"]
