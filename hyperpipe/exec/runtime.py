"""Replaying one rank's share of a plan: its stages, its actions in IR order, its optimizer.

The rank runs ``schedule_for(plan, pipeline).actions[d]`` exactly in order and never
decides the order itself, one small primitive per action kind (`hyperpipe.exec.compute`):
``F`` (forward; the last stage's loss scaled by micro_batch / global_batch, so that the
sum over micro-batches and pipelines is the full-batch mean's gradient), ``B`` (full
backward), ``I`` (input gradient only, torch's ``stage_backward_input``) and ``W``
(weight gradients from what I kept). Outputs and input gradients go to the ranks of the
neighbouring stages.

Receives follow `dependencies(schedule)` and are posted ahead, a window per sender, in
the order that sender sends, so ordering cannot deadlock and NCCL, which matches by
order, pairs them correctly; sends are asynchronous, reaped between actions, on a
process group per direction (comm.Channels). After the last action: the data-parallel
reduction, then AdamW. Every action becomes a TraceEvent on the rank's aligned clock.

With emulated links (exec.links) every message is a flow of the link emulator: posted
when sent, held at the receiver until it has crossed the emulated links; the
data-parallel collectives run as their ring steps over them (exec.collectives); a
tensor-parallel stage's collectives, which run for real inside its compute, add their
ring steps' link time after each action's compute (`_tp_links`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hyperpipe.exec import comm, compute, context_parallel, tensor_parallel
from hyperpipe.exec.collectives import ring_order, timing_ring
from hyperpipe.exec.data import micro_batch_of, step_batch
from hyperpipe.exec.dataparallel import DataParallel, stage_dp_groups
from hyperpipe.exec.emulation import cpu_clock, stretch
from hyperpipe.exec.experts import ExpertComm, ExpertParallel, expert_reduction
from hyperpipe.exec.fsdp import ShardedStages, reshard_after_forward
from hyperpipe.exec.links import Links
from hyperpipe.exec.memory import MemoryMeter, state_tensors
from hyperpipe.exec.placement import (
    RankPlacement,
    adjacent_pairs,
    cp_rings,
    dp_groups,
    dp_slices,
    tp_groups,
)
from hyperpipe.exec.recompute import apply_recompute
from hyperpipe.exec.reference import measure_reference, reference_from
from hyperpipe.exec.tied import TiedEmbedding
from hyperpipe.models import build_stage
from hyperpipe.models.spec import ModelSpec
from hyperpipe.plan.plan import Plan, schedule_for
from hyperpipe.plan.schedule import Action, dependencies
from hyperpipe.plan.stack import DDP_BUCKET_BYTES
from hyperpipe.plan.trace import TraceEvent


@dataclass(frozen=True)
class StepOutcome:
    """One step on one rank: its events, the summed scaled loss of its last stage (0 if
    it has none), and when the step began and ended (rank clock, seconds)."""

    step: int
    events: list[TraceEvent]
    loss: float
    start_s: float
    end_s: float
    peak_memory_bytes: float = 0.0      # the rank's peak in this step (exec.memory)


@dataclass
class _Stage:
    index: int
    module: torch.nn.Module     # the StageModule: parameters, names, state
    layers: list[torch.nn.Module]   # what forward runs (tensor-parallel, recompute wrappers)
    is_first: bool          # takes the model's inputs (no input gradient)
    is_last: bool           # ends with the loss
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


@dataclass(frozen=True)
class _Recv:
    """One message a rank receives in a step."""

    kind: int               # comm.ACTIVATION or comm.GRADIENT
    stage: int              # the stage the data flows into
    microbatch: int
    src: int                # global rank
    shape: tuple[int, ...]


def boundary_shape(spec: ModelSpec, layer: int, micro_batch: int, cp: int = 1
                   ) -> tuple[int, ...]:
    """Shape of the activation that layer `layer` outputs (and of its gradient): (B, S, D)
    for a GPT, (B, S, hidden) for a synthetic layer; S / cp tokens under context
    parallelism."""
    width = spec.config.d_model if spec.config is not None else spec.layers[layer].hidden
    return (micro_batch, spec.seq_len // cp, width)


class RankRuntime:
    """The stages, optimizer and communication of one rank; `run_step` replays a step.

    Every rank of the job constructs its RankRuntime at the same time (the data-parallel
    process groups are created collectively). `clock` returns seconds on the rank's
    aligned clock; `emulation_factor` stretches compute (1 = native speed); `links` (the
    link emulator's client, exec.links; None: loopback speed) with `nodes[r]`, the node
    of global rank r, and `switch_nodes`, the nodes whose switch reduces
    (`Cluster.switch_reduces`), emulates the cluster's links.
    """

    def __init__(self, plan: Plan, spec: ModelSpec, where: RankPlacement, *, seed: int,
                 lr: float, device: torch.device, timeout_s: float,
                 clock: Callable[[], float], emulation_factor: float = 1.0,
                 bucket_bytes: float = DDP_BUCKET_BYTES, overlap_dp_allreduce: bool = True,
                 links: Links | None = None, nodes: Sequence[str] = (),
                 switch_nodes: frozenset[str] = frozenset()):
        self.plan, self.spec, self.where = plan, spec, where
        self.seed, self.device, self.timeout_s = seed, device, timeout_s
        self.clock, self.factor = clock, emulation_factor
        self.links = links
        # the plan's stack: a blocking sender waits for its message's delivery; without
        # overlap, gradients are reduced after the rank's last action
        stack = plan.runtime_settings()
        self.blocking_p2p = stack.p2p == "blocking"
        overlap_dp_allreduce = overlap_dp_allreduce and stack.overlap_grad_reduce
        self.tp_ring = ring_order(where.tp_ranks, nodes) if links else where.tp_ranks
        self.reference: dict = {}       # (stage, op) or "optimizer" -> seconds (emulation)
        self.devices = plan.devices
        self.name = where.device
        pipe = plan.pipelines[where.pipeline]
        self.micro_batch, self.num_mb = pipe.micro_batch, pipe.num_microbatches
        # context parallelism: each context rank's loss is the mean over its S/cp tokens,
        # so 1/cp of it sums over the ranks to the mean over the sample's tokens
        self.cp = len(where.cp_ranks) or 1
        self.loss_scale = pipe.micro_batch / plan.global_batch / self.cp
        self.schedule = schedule_for(plan, where.pipeline)
        self.actions: tuple[Action, ...] = self.schedule.actions[where.pipe_rank]
        last = len(pipe.stages) - 1
        # process groups: created collectively, the same order on every rank
        mesh = None
        for ranks in tp_groups(plan):
            pg = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
            if ranks == where.tp_ranks:
                mesh = tensor_parallel.mesh_of(pg, device)
        self.tp = len(where.tp_ranks)
        self.ring: context_parallel.Ring | None = None
        for ranks in cp_rings(plan):
            pg = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
            if ranks == where.cp_ranks:
                config = spec.config
                self.ring = context_parallel.Ring(
                    ranks, where.cp_index, pg, spec.seq_len, timeout_s, plan.devices, clock,
                    links, keep_scores=config is not None and config.attention == "eager")
        self.stages: dict[int, _Stage] = {}
        for s in where.stages:
            sp = pipe.stages[s]
            a, b = sp.layers
            module = build_stage(spec, a, b, seed).to(device)
            layers = list(module.layers.values())
            if mesh is not None:
                layers = tensor_parallel.parallelize_stage(
                    layers, mesh, sequence_parallel=sp.sequence_parallel)
            layers = apply_recompute(layers, sp.recompute)
            if self.ring is not None:
                context_parallel.attach(layers, self.ring)
            self.stages[s] = _Stage(s, module, layers, s == 0, s == last,
                                    boundary_shape(spec, max(a - 1, 0), self.micro_batch,
                                                   self.cp),
                                    boundary_shape(spec, b - 1, self.micro_batch, self.cp))
        # expert parallelism: each MoE block keeps this rank's experts, the others are
        # reached by all-to-all (exec.experts); process groups made collectively
        self.experts = ExpertParallel.build(
            plan, spec, where.rank, {s: st.module for s, st in self.stages.items()},
            ExpertComm(where.rank, where.device, timeout_s, lambda: self.clock(),
                       emulated=links is not None), timeout_s)
        # ZeRO-3: the stages' layers sharded with FSDP2 over their data-parallel groups
        # (exec.fsdp), before anything holds their parameters
        self.sharded = ShardedStages(
            stage_dp_groups(plan), where.rank,
            {s: (st.module, list(st.module.layers.values())) for s, st in self.stages.items()},
            self.devices, reshard=reshard_after_forward(plan), timeout_s=timeout_s,
            clock=lambda: self.clock(), links=links, nodes=nodes) if plan.zero == 3 else None
        self.params = [p for s in sorted(self.stages) for p in self.stages[s].module.parameters()]
        self.inbox = self._inbox()
        # Receives posted ahead per sender: enough to keep 1F1B's steady state fed,
        # bounded so that buffers for every micro-batch are not allocated up front.
        self.window = 2 * len(pipe.stages) + 2
        self.channels = comm.Channels(adjacent_pairs(plan), timeout_s)
        self.tied = TiedEmbedding(plan, spec, where, [st.module for st in self.stages.values()],
                                  timeout_s, links=self.links, nodes=nodes,
                                  switch_nodes=switch_nodes)
        # ZeRO-3's groups are FSDP2's: AdamW alone steps the local shards here
        groups = [] if plan.zero == 3 else \
            stage_dp_groups(plan) if plan.zero == 2 else dp_groups(plan)
        by_layer = self._params_by_layer()
        # with expert parallelism: experts reduced over their expert-data-parallel groups
        groups, by_layer = expert_reduction(plan, spec, groups, by_layer,
                                            [st.module for st in self.stages.values()])
        # replicas of a larger tp degree: this rank's gradients of those layers in slices
        cuts = dp_slices(plan, where.rank)
        parts = {layer: n for (_, layers), (n, _) in cuts.items() for layer in layers}
        slices = {k: v for st in self.stages.values() for key, layer in
                  st.module.layers.items() if int(key) in parts
                  for k, v in tensor_parallel.grad_slices(layer, parts[int(key)]).items()}
        self.dp = DataParallel(groups, where.rank, by_layer,
                               self.devices, timeout_s, lr=lr,
                               distributed_optimizer=plan.zero in (1, 2),
                               bucket_bytes=bucket_bytes, overlap=overlap_dp_allreduce,
                               links=self.links, nodes=nodes, switch_nodes=switch_nodes,
                               apart=self.tied.params,
                               zero=plan.zero if plan.zero < 3 else 0, slices=slices,
                               slice_index={g: q for g, (_, q) in cuts.items()})
        self.memory = MemoryMeter(device, self.params, lambda: state_tensors(
            self.dp.optimizer, self.dp.master_tensors()), working=self.sharded)
        if self.sharded is not None:
            self.sharded.sample = self.memory.sample
        # the index of each stage's last backward action (B, or W after I): its
        # gradients are final once that action has run (data-parallel buckets start)
        self.final_backward = {a.stage: i for i, a in enumerate(self.actions)
                               if a.op in ("B", "W")}

    # ------------------------------------------------------------------ set-up
    def _inbox(self) -> dict[int, list[_Recv]]:
        """Sender rank -> the messages it sends this rank in one step, in its send order.

        What is received comes from `dependencies` (an action of this rank that waits
        for an action of another rank); the order from the sender's action list (it
        sends after each F to the next stage and after each B or I to the previous)."""
        deps = dependencies(self.schedule)
        d, last = self.where.pipe_rank, self.schedule.num_stages - 1
        needed: dict[tuple[int, int, int], int] = {}
        for a in self.actions:
            for x in deps[a]:
                if self.schedule.device_of(x.stage) != d:
                    kind = comm.ACTIVATION if a.op == "F" else comm.GRADIENT
                    needed[(kind, a.stage, a.microbatch)] = self.where.rank_of_stage(x.stage)
        inbox: dict[int, list[_Recv]] = {}
        for e, row in enumerate(self.schedule.actions):
            if e == d:
                continue
            for a in row:
                if a.op == "F" and a.stage < last:
                    key = (comm.ACTIVATION, a.stage + 1, a.microbatch)
                elif a.op in ("B", "I") and a.stage > 0:
                    key = (comm.GRADIENT, a.stage - 1, a.microbatch)
                else:
                    continue
                if self.schedule.device_of(key[1]) != d:
                    continue
                src = self.where.rank_of_stage(a.stage)
                if needed.pop(key, None) != src:
                    raise RuntimeError(f"rank {self.where.rank}: rank {src} sends {key}, "
                                       "which no action here waits for")
                st = self.stages[key[1]]
                shape = st.in_shape if key[0] == comm.ACTIVATION else st.out_shape
                inbox.setdefault(src, []).append(_Recv(*key, src, shape))
        if needed:
            raise RuntimeError(f"rank {self.where.rank}: nothing sends {sorted(needed)}")
        return inbox

    def _params_by_layer(self) -> dict[int, list[torch.nn.Parameter]]:
        # StageModule names parameters by global layer index: "layers.5.attn.c_attn.weight"
        out: dict[int, list[torch.nn.Parameter]] = {}
        for st in self.stages.values():
            for name, p in st.module.named_parameters():
                out.setdefault(int(name.split(".")[1]), []).append(p)
        return out

    # ------------------------------------------------------------------ one step
    def run_step(self, step: int) -> StepOutcome:
        """Replay this rank's actions for training step `step`, all-reduce, AdamW."""
        start_s = self.clock()
        self.events: list[TraceEvent] = []
        self.step = step
        self.dp.zero_grad(self.clock)
        self.experts.comm.begin_step(step)
        if self.sharded is not None:
            self.sharded.start_step()
        self.memory.start_step()
        self.local: dict[tuple[int, int, int], torch.Tensor] = {}
        self.stash: dict[tuple[int, int], list] = {}
        self.posted: dict[tuple[int, int, int], tuple[dist.Work, torch.Tensor, int]] = {}
        self.cursor = {src: 0 for src in self.inbox}
        self.outstanding = {src: 0 for src in self.inbox}
        self.sends = comm.PendingSends(self.timeout_s, self.clock)
        self._tp_actions = 0            # names this step's tensor-parallel ring flows
        self.loss_sum = torch.zeros((), device=self.device)
        ends = [s for s in self.stages.values() if s.is_first or s.is_last]
        self.batch = step_batch(self.spec, self.plan.global_batch, step, self.seed) \
            if ends else None
        for src in self.inbox:
            self._post(src)
        primitive = {"F": self._forward, "B": self._backward, "I": self._backward_input,
                     "W": self._backward_weight}
        for i, a in enumerate(self.actions):
            if self.ring is not None:       # stamps the ring's exchange events
                self.ring.step, self.ring.action = step, (a.stage, a.microbatch)
            self.experts.comm.begin(a.stage, a.microbatch)
            if self.final_backward.get(a.stage) == i or (self.dp.per_microbatch
                                                         and a.op in ("B", "W")):
                self._final_backward(a, primitive[a.op])
            else:
                primitive[a.op](a)
            if self.ring is not None:
                self.events += self.ring.take_events()
            self.events += self.experts.comm.take_events()
            self.memory.sample()
            self.sends.reap(self.events)
        self.sends.reap(self.events, block=True)
        unread = {src: len(q) - self.cursor[src] for src, q in self.inbox.items()
                  if self.cursor[src] < len(q)}
        if self.stash or self.local or self.posted or unread:
            raise RuntimeError(f"rank {self.where.rank}: step {step} left work behind "
                               f"(stash {sorted(self.stash)}, local {sorted(self.local)}, "
                               f"receives {sorted(self.posted)}, unread {unread})")
        if self.tp > 1:
            tensor_parallel.finish_grads(self.params)
        self.events += self.dp.reduce(self.name, step, self.clock)
        if self.sharded is not None:
            self.events += self.sharded.finish(self.name, step)
        self.tied.reduce()
        t, cpu = self.clock(), cpu_clock()
        gathers = self.dp.step(self.name, step, self.clock)
        # emulated like compute: the optimizer step's speed is the device's too
        self.events.append(self._event("optimizer", -1, -1, t, self._done(t, cpu,
                                                                          "optimizer")))
        self.events += gathers
        return StepOutcome(step, self.events, float(self.loss_sum.item()), start_s,
                           self.clock(), self.memory.step_peak())

    # ------------------------------------------------------------------ primitives
    def _forward(self, a: Action) -> None:
        st = self.stages[a.stage]
        if st.is_first:
            x = self._micro(a.microbatch)[0].to(self.device)
        else:
            x = self._take(comm.ACTIVATION, a.stage, a.microbatch).requires_grad_()
        targets = self._micro(a.microbatch)[1].to(self.device) if st.is_last else None
        start, cpu = self.clock(), cpu_clock()
        entry = self.compute_forward(st, x, targets)
        self.events.append(self._event("F", a.stage, a.microbatch, start,
                                       self._done(start, cpu, (a.stage, "F"))))
        out = entry[1]
        if st.is_last and self.where.tp_index == 0:    # one loss per tensor-parallel group
            self.loss_sum += out.detach()
        self.stash[(a.stage, a.microbatch)] = entry
        if not st.is_last:
            self._give(comm.ACTIVATION, a.stage + 1, a.microbatch, out.detach(), a.stage)

    def _backward(self, a: Action) -> None:
        st = self.stages[a.stage]
        entry = self.stash.pop((a.stage, a.microbatch))
        grad = None if st.is_last else self._take(comm.GRADIENT, a.stage, a.microbatch)
        start, cpu = self.clock(), cpu_clock()
        dx = compute.backward(entry, grad)
        self.events.append(self._event("B", a.stage, a.microbatch, start,
                                       self._done(start, cpu, (a.stage, "B"))))
        if not st.is_first:
            self._give(comm.GRADIENT, a.stage - 1, a.microbatch, dx, a.stage)

    def _backward_input(self, a: Action) -> None:
        st = self.stages[a.stage]
        entry = self.stash[(a.stage, a.microbatch)]
        grad = None if st.is_last else self._take(comm.GRADIENT, a.stage, a.microbatch)
        start, cpu = self.clock(), cpu_clock()
        dx = compute.input_grad(st.module.parameters(), entry, grad)
        self.events.append(self._event("I", a.stage, a.microbatch, start,
                                       self._done(start, cpu, (a.stage, "I"))))
        if not st.is_first:
            self._give(comm.GRADIENT, a.stage - 1, a.microbatch, dx, a.stage)

    def _backward_weight(self, a: Action) -> None:
        st = self.stages[a.stage]
        entry = self.stash.pop((a.stage, a.microbatch))
        start, cpu = self.clock(), cpu_clock()
        compute.weight_grad(st.module.parameters(), entry)
        self.events.append(self._event("W", a.stage, a.microbatch, start,
                                       self._done(start, cpu, (a.stage, "W"))))

    def _final_backward(self, a: Action, primitive: Callable[[Action], None]) -> None:
        """The stage's last backward action (with ZeRO-2 every one that produces weight
        gradients, its buckets then set aside: `DataParallel.retire`; with ZeRO-3 FSDP2
        reduce-scatters after the last: `ShardedStages.arm`): gradient buckets start as
        it produces them (hooks), or when it ends for a sequence-parallel stage, whose
        norms' partial
        gradients are first summed over the tensor-parallel group. Under emulation too
        they start when it ends: the real compute produces every gradient in the first
        1/factor of the action's emulated time, while the device it stands for produces
        the last ones at its end (with one bucket, as the simulator starts it)."""
        params = list(self.stages[a.stage].module.parameters())
        sp = self.plan.pipelines[self.where.pipeline].stages[a.stage].sequence_parallel
        self.dp.arm(params, hooks=not sp and self.factor <= 1.0)
        if self.sharded is not None:
            self.sharded.arm(a.stage)
        primitive(a)
        if sp:
            tensor_parallel.finish_grads(params)
        self.dp.produced(params)
        self.dp.retire(params)

    # ------------------------------------------------------------------ compute
    def compute_forward(self, st: _Stage, x: torch.Tensor, targets: torch.Tensor | None
                        ) -> list:
        """F of stage `st` on `x` (compute.forward over the stage's layers), under bf16
        autocast on CUDA (the cost model prices bf16 GEMMs; weights, gradients, optimizer
        and what crosses stage boundaries stay fp32) and in fp32 on the CPU."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"), self.memory.saving():
            return compute.forward(st.layers, x, targets,
                                   cut_after_first=st.is_first and self.spec.config is not None,
                                   loss_scale=self.loss_scale)

    def measure_reference(self, *, repeats: int = 5, warmup: int = 2) -> dict:
        """Uncontended time of each (stage, op) and of the optimizer (reference.py); a
        context-parallel stage's ranks time together, their ring exchanges at loopback
        speed (the emulated links' time comes on top in the run)."""
        links = None
        if self.ring is not None:
            links, self.ring.links, self.ring.recording = self.ring.links, None, False
        self.experts.comm.solo = True       # expert parallelism: compute alone, no peers
        try:
            self.reference = measure_reference(self, repeats=repeats, warmup=warmup)
        finally:
            self.experts.comm.solo = False
            if self.ring is not None:
                self.ring.links, self.ring.recording = links, True
        return self.reference

    def reference_from(self, cost) -> dict:
        """Compute references from a native-speed profile (reference.py)."""
        self.reference = {**self.reference, **reference_from(self, cost)}
        return self.reference

    # ------------------------------------------------------------------ data movement
    def _micro(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = micro_batch_of(self.batch, self.where.sample_offset, self.micro_batch, index)
        return self.local_sequence(x), self.local_sequence(y)

    def local_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a (B, S, ...) tensor: all of them, or under context
        parallelism its context rank's two chunks (exec.context_parallel)."""
        if self.ring is None:
            return x
        return context_parallel.local_sequence(x, self.ring.positions)

    def _post(self, src: int, until: tuple[int, int, int] | None = None) -> None:
        """Post receives from `src` in its send order: up to `until` (a message key), or
        else while fewer than `window` are outstanding."""
        queue, cursor = self.inbox[src], self.cursor
        while cursor[src] < len(queue):
            r = queue[cursor[src]]
            key = (r.kind, r.stage, r.microbatch)
            if until is None and self.outstanding[src] >= self.window:
                return
            # with link emulation the message carries its flow number (comm.stamped)
            shape = (math.prod(r.shape) + comm.STAMP_ELEMENTS,) if self.links else r.shape
            buf = torch.empty(shape, dtype=torch.float32, device=self.device)
            tag = comm.message_tag(r.kind, r.stage, r.microbatch, self.num_mb)
            group = self.channels.group(src, self.where.rank)
            self.posted[key] = (dist.irecv(buf, src, group=group, tag=tag), buf, src)
            cursor[src] += 1
            self.outstanding[src] += 1
            if key == until:
                return

    def _take(self, kind: int, stage: int, mb: int) -> torch.Tensor:
        """The activation or gradient flowing into (stage, mb): handed over locally, or
        waited for (a `recv` event)."""
        key = (kind, stage, mb)
        if key in self.local:
            return self.local.pop(key)
        src = self.where.rank_of_stage(stage - 1 if kind == comm.ACTIVATION else stage + 1)
        if key not in self.posted:
            self._post(src, until=key)
        work, buf, src = self.posted.pop(key)
        self.outstanding[src] -= 1
        start = self.clock()
        what = "activation" if kind == comm.ACTIVATION else "gradient"
        comm.wait(work, self.timeout_s, f"waiting for the {what} of stage {stage} "
                  f"micro-batch {mb} from rank {src} ({self.devices[src]})")
        self._sync()
        if self.links:      # held until its flow has crossed the emulated links
            st = self.stages[stage]
            buf, number = comm.unstamped(buf, st.in_shape if kind == comm.ACTIVATION
                                         else st.out_shape)
            self.links.deliver(("p2p", src, number))
        self.events.append(self._event("recv", stage, mb, start, self.clock(),
                                       float(buf.numel() * buf.element_size()),
                                       self.devices[src]))
        self._post(src)
        return buf

    def _give(self, kind: int, stage: int, mb: int, tensor: torch.Tensor, src_stage: int
              ) -> None:
        """Hand the activation or gradient flowing into (stage, mb) to the ranks of that
        stage that take it from this one (placement.message_pairs; none, one, or several
        when a stage of lower tp feeds one of higher tp)."""
        tensor = tensor.float().contiguous()     # receive buffers are fp32
        for dst in self.where.send_ranks(stage):
            if dst == self.where.rank:
                self.local[(kind, stage, mb)] = tensor
                continue
            nbytes = float(tensor.numel() * tensor.element_size())
            ev = self._event("send", src_stage, mb, self.clock(), 0.0, nbytes,
                             self.devices[dst])
            wire, flow = tensor, None
            if self.links:      # a flow of the link emulator, one after another per peer
                number = self.links.number()
                me = self.where.rank
                flow = ("p2p", me, number)
                self.links.post(flow, me, dst, nbytes, queue=("p2p", me, dst),
                                awaited=self.blocking_p2p)
                wire = comm.stamped(tensor, number)
            self.sends.send(wire, dst, comm.message_tag(kind, stage, mb, self.num_mb),
                            self.channels.group(self.where.rank, dst), ev)
            if self.blocking_p2p:       # held until delivered (the flow has arrived)
                if flow is not None:
                    self.links.sent_s(flow)
                self.sends.reap(self.events, block=True)

    # ------------------------------------------------------------------ helpers
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _done(self, start: float, start_cpu: float, key: tuple | str) -> float:
        """End of a compute action that began at `start` (clock) and `start_cpu`
        (cpu_clock): synchronised, then stretched to `factor` times its reference time
        (measure_reference) or, without one, its CPU time."""
        self._sync()
        end = stretch(start, start_cpu, self.factor, self.clock,
                      reference_s=self.reference.get(key))
        if self.links and self.tp > 1 and isinstance(key, tuple):
            end = self._tp_links(*key)
        if self.links and self.experts.comm.records:
            # the action's expert all-to-alls (gloo moved their data inside the compute):
            # their link time after it, one after another (exec.experts)
            self.events += self.experts.comm.emulate(self.links, self.devices)
            end = self.clock()
        return end

    def _tp_links(self, stage: int, op: str) -> float:
        """The link time of a tensor-parallel action's collectives (run for real inside
        its compute, over loopback): their ring steps over the emulated links, as one
        ring of their summed bytes (tensor_parallel.comm_bytes) after the compute; every
        rank of the group runs the same action, so they meet in the ring. Returns the
        clock after it."""
        sp = self.plan.pipelines[self.where.pipeline].stages[stage]
        nbytes = tensor_parallel.comm_bytes(self.spec, sp.layers, self.micro_batch, op,
                                            sp.recompute) / self.cp     # its S/cp tokens
        self._tp_actions += 1
        timing_ring(self.links, self.tp_ring, self.where.rank, nbytes,
                    ("tp", self.tp_ring[0], self.step, self._tp_actions),
                    ("tp", self.tp_ring[0]))
        return self.clock()

    def _event(self, op: str, stage: int, mb: int, start: float, end: float,
               nbytes: float = 0.0, peer: str = "") -> TraceEvent:
        return TraceEvent(self.name, op, stage, mb, start, end, nbytes, peer, self.step)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Model and optimizer state of this rank (for checkpoints); tensor-parallel
        parameters as this rank's local shards."""
        return {"stages": {str(s): {k: tensor_parallel.local(v).detach().clone()
                                    for k, v in st.module.state_dict().items()}
                           for s, st in self.stages.items()},
                "optimizer": self.dp.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for s, st in self.stages.items():
            saved = state["stages"][str(s)]
            for k, v in st.module.state_dict().items():
                tensor_parallel.local(v).copy_(saved[k])
        self.dp.load_state_dict(state["optimizer"])

    def captured(self) -> dict[str, dict[str, torch.Tensor | None]]:
        """Parameter name -> {"param", "grad"}, whole (tensor-parallel shards gathered, a
        collective over the group) and on the CPU (tests compare these)."""
        self.dp.gather_grads()
        out = {}
        for st in self.stages.values():
            for name, value, grad in tensor_parallel.full_parameters(st.module, self.tp):
                out[name] = {"param": value, "grad": grad}
        return out
