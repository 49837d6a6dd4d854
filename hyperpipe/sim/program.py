"""What the simulator runs, built from a plan before the first event: one program per
pipeline rank (a `Step` per action: duration, box to wait for, box to send, flow, stash
change), the message boxes and channel queues of each simulated pipeline, the gradient
all-reduce segments of each layer range, and with tied embeddings each pipeline's
embedding-gradient all-reduce between its first and last stage (times in seconds, sizes
in bytes).

Box k*m + j holds micro-batch j's message on channel k: channel k < n_st is the forward
out of stage k, channel n_st + k the backward out of stage k + 1 (n_st stages, m
micro-batches). A channel sends one message at a time, in issue order.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import simpy

from hyperpipe.plan.plan import Plan, StagePlan, ring_member
from hyperpipe.plan.schedule import Schedule, rank_stages
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.experts import (
    alltoall_spec,
    expert_dp_rings,
    expert_extra_s,
    expert_share,
    expert_stash_extra_bytes,
    overlaps_alltoall,
)
from hyperpipe.sim.network import (
    FlowSpec,
    bucket_count,
    count_hops,
    p2p_edges,
    p2p_spec,
    ring_spec,
    tie_spec,
    tp_spec,
)
from hyperpipe.sim.options import Execution, SimOptions, accumulate_extra_s
from hyperpipe.sim.replicas import stage_holding
from hyperpipe.sim.sharding import (
    first_forwards,
    first_gather,
    fsdp_extra_s,
    rank_static_bytes,
    ring_attention_extra_s,
)

NEVER = float("inf")       # a message's arrival time before it is known


class Step(NamedTuple):
    """One action of a rank's program, flattened for the event loop."""

    compute_s: float              # its compute (tensor-parallel collectives apart)
    wait_box: int                 # the message box it waits for, or -1
    send_box: int                 # the message box it sends when done, or -1
    channel: int                  # the send's channel (send_box // m)
    send: FlowSpec | None         # the send's flow; None: same device or free link
    stash_delta_bytes: float      # + at the start of F, - at the end of B or W
    report_stage: int             # the stage whose all-reduce its start reports, or -1
    tp: FlowSpec | None           # the tensor-parallel flow after its compute, or None
    a2a: FlowSpec | None = None   # expert parallelism's all-to-alls, or None
    a2a_overlap: bool = False     # they run beside the compute (DualPipe), not after it
    ready_s: float = 0.0          # it may not start before this, from the step's start

    def busy_s(self) -> float:
        """Its time on idle links: its compute, its tensor-parallel flow and its
        all-to-alls (after the compute, or beside it when overlapped)."""
        t = self.compute_s + (self.tp.time_s if self.tp is not None else 0.0)
        if self.a2a is None:
            return t
        a2a = self.a2a.time_s
        return max(t, a2a) if self.a2a_overlap else t + a2a


class OpShape(NamedTuple):
    """What one op of one stage costs for any micro-batch (boxes as base + micro-batch)."""

    compute_s: float
    wait_base: int                # first box it waits for, or -1
    send_base: int                # first box it sends, or -1
    send: FlowSpec | None
    stash_delta_bytes: float
    tp: FlowSpec | None
    a2a: FlowSpec | None = None


class Rank:
    """One simulated pipeline rank's program (flat lists, for a lean inner loop)."""

    __slots__ = ("pipe", "d", "devices", "ops", "stages", "mbs", "program", "grad_order",
                 "cursor", "end_s", "timeline", "starts", "opt_log", "busy_s", "compute_end_s")

    def __init__(self, pipe: Pipe, d: int, devices: tuple[str, ...]):
        self.pipe, self.d, self.devices = pipe, d, devices
        self.ops: list[str] = []
        self.stages: list[int] = []
        self.mbs: list[int] = []
        self.program: list[Step] = []
        self.grad_order: list[int] = []            # stages, in order of their last backward
        self.cursor, self.end_s, self.busy_s, self.compute_end_s = 0, 0.0, 0.0, 0.0
        self.timeline: list[tuple[float, float]] = []      # (time_s, bytes) at each change
        self.starts: list[float] = []              # start of each action, in order
        self.opt_log: list[tuple[int, float, float]] = []  # (stage, start_s, end_s)


class Pipe:
    """A simulated (representative) pipeline, its message boxes and collective state."""

    def __init__(self, index: int, members: list[int], schedule: Schedule):
        self.index, self.members, self.schedule = index, members, schedule
        self.ranks: list[Rank] = []
        self.segments: dict[int, list[Segment]] = {}    # stage -> its collectives
        self.pending: dict[int, int] = {}                # stage -> collectives not done
        self.reduce_wait: dict[int, simpy.Event] = {}
        self.m = 0                                       # micro-batches
        self.fwd: list[FlowSpec | None] = []             # boundary k's forward flow
        self.bwd: list[FlowSpec | None] = []             # ... and backward flow
        self.channel_spec: list[FlowSpec | None] = []    # channel -> its flow
        # Per box: arrival time (NEVER until known), the reader's event, the blocked
        # reader's action time (-1: none), the timeout it sleeps on, when it was sent,
        # and the event of a blocking sender waiting for it to land.
        self.eta: list[float] = []
        self.waiters: list[simpy.Event | None] = []
        self.senders: list[simpy.Event | None] = []
        self.fuse: list[float] = []
        self.wake: list[simpy.Event | None] = []
        self.sent_at: list[float | None] = []
        # Per channel: when its current message lands (NEVER: not known), its queue.
        self.busy_until: list[float] = []
        self.queue: list[deque[int]] = []
        self.tie: Tie | None = None                      # tied embeddings' all-reduce


class Tie:
    """The all-reduce of a pipeline's two copies of a tied embedding's gradient, between
    its first and last stage's devices (every member of its replica class at once), once
    both ranks have their gradients reduced over data parallelism (Megatron's
    `finalize_model_grads`: the data-parallel sync, then `_allreduce_embedding_grads`),
    or, on a stack that reduces the tie first (`Execution.tied_reduce_first`), once both
    have run their last action, their data-parallel syncs after it; the optimizer steps
    of those two stages wait for it."""

    def __init__(self, stages: tuple[int, int], spec: FlowSpec, peers: tuple[str, str]):
        self.stages, self.spec, self.peers = stages, spec, peers
        self.arrived = 0                    # ranks that reached it
        self.event: simpy.Event | None = None   # fires when it is done
        self.start_s = self.done_s = 0.0


class Segment:
    """The gradient all-reduce of one layer range among every replica that holds it."""

    def __init__(self, layers: tuple[int, int], parts: list[tuple[Pipe, int]],
                 full: FlowSpec | None, last: FlowSpec | None, k: int, nbytes: float):
        self.layers, self.parts = layers, parts          # parts: [(pipe, stage)]
        self.full, self.last, self.k, self.nbytes = full, last, k, nbytes  # k buckets
        self.reports: list[tuple[float, float]] = []     # (start_s, dur_s) per part
        self.log: list[tuple[int, float, float]] = []    # (bucket, start_s, end_s)
        self.done_s = 0.0


def prepare_pipe(plan: Plan, cost: CostModel, ex: Execution, pipe: Pipe) -> Pipe:
    """Fill `pipe` with its ranks' programs, message boxes, channel queues and tie."""
    pp = plan.pipelines[pipe.index]
    stages, n_st, m, mb = pp.stages, len(pp.stages), pp.num_microbatches, pp.micro_batch
    sched = pipe.schedule
    stash = [cost.stage_stash_bytes(s, mb, ex.keeps_stage_outputs) for s in stages]
    stash = [x + expert_stash_extra_bytes(cost, plan, pipe.index, k)
             for k, x in enumerate(stash)]
    fwd = [boundary_flow(plan, cost, pipe, k, k + 1) for k in range(n_st - 1)]
    bwd = [boundary_flow(plan, cost, pipe, k + 1, k) for k in range(n_st - 1)]
    shapes: dict[tuple[int, str], OpShape] = {}
    for d, row in enumerate(sched.actions):
        rank = Rank(pipe, d, stages[d].devices)
        rank.ops = [a.op for a in row]
        rank.stages = [a.stage for a in row]
        rank.mbs = [a.microbatch for a in row]
        program = rank.program
        for i, (s, op, j) in enumerate(zip(rank.stages, rank.ops, rank.mbs, strict=True)):
            sh = shapes.get((s, op))
            if sh is None:
                sh = op_shape(cost, stages, s, op, mb, m, stash[s], fwd, bwd)
                extra = action_extra_s(cost, plan, ex, pipe.index, s, op)
                sh = shapes[(s, op)] = sh._replace(compute_s=sh.compute_s + extra,
                                                   a2a=alltoall_spec(cost, plan, pipe.index,
                                                                     s, op, pipe.members))
            dur, wait, send, spec, delta, tp, a2a = sh
            program.append(Step(dur, wait + j if wait >= 0 else -1,
                                send + j if send >= 0 else -1, send // m, spec, delta, -1, tp,
                                a2a, a2a is not None and overlaps_alltoall(plan, rank.ops, i)))
        _first_forward_gathers(plan, cost, ex, pipe.index, rank)
        rank.grad_order = _grad_order(rank, ex.overlap_dp_allreduce)
        static = rank_static_bytes(
            cost, plan, [stages[s] for s in rank_stages(d, sched.num_devices, sched.chunks,
                                                        sched.placement)],
            mb, ex.reshard_after_forward)
        rank.timeline = [(0.0, static)]
        pipe.ranks.append(rank)
    _prepare_boxes(pipe, n_st, m, fwd, bwd)
    pipe.tie = prepare_tie(plan, cost, ex, pipe)
    return pipe


def action_extra_s(cost: CostModel, plan: Plan, ex: Execution, q: int, k: int, op: str
                   ) -> float:
    """Seconds an `op` of stage k of pipeline q takes beyond `op_shape`'s: ZeRO-2/3's
    exposed gathers and reduce-scatters (`fsdp_extra_s`), expert parallelism's wait for
    its group's slowest rank (`expert_extra_s`) and the engine's fp32 gradient
    accumulation (`accumulate_extra_s`); not ZeRO-3's once-a-step first gather."""
    return fsdp_extra_s(cost, plan, q, k, op, reshard=ex.reshard_after_forward,
                        grad_bytes_per_param=ex.grad_bytes_per_param) + \
        expert_extra_s(cost, plan, q, k, op) + accumulate_extra_s(cost, plan, ex, q, k, op)


def _first_forward_gathers(plan: Plan, cost: CostModel, ex: Execution, q: int,
                           rank: Rank) -> None:
    """ZeRO-3 without resharding: each stage's weights are gathered once a step, and its
    first forward waits for them (`sharding.first_forwards`): not before its
    `Step.ready_s`, and its exposed part added to its compute."""
    if plan.zero < 3 or ex.reshard_after_forward:
        return
    firsts: dict[int, int] = {}               # stage -> index of its first forward
    for i, (s, op) in enumerate(zip(rank.stages, rank.ops, strict=True)):
        if op == "F" and s not in firsts:
            firsts[s] = i
    waits = first_forwards([first_gather(cost, plan, q, s, ex.grad_bytes_per_param)
                            for s in firsts])
    for i, w in zip(firsts.values(), waits, strict=True):
        step = rank.program[i]
        rank.program[i] = step._replace(compute_s=step.compute_s + w.extra_s,
                                        ready_s=w.ready_s)


def prepare_tie(plan: Plan, cost: CostModel, ex: Execution, pipe: Pipe) -> Tie | None:
    """The tied-embedding all-reduce of `pipe`'s class (`network.tie_spec`; None without
    tied embeddings, or when first and last stage share their devices)."""
    spec = tie_spec(cost, plan, pipe.members, ex.tie_bytes_per_param)
    if spec is None:
        return None
    stages = plan.pipelines[pipe.index].stages
    return Tie((0, len(stages) - 1), spec, (stages[0].devices[0], stages[-1].devices[0]))


def op_shape(cost: CostModel, stages: tuple[StagePlan, ...], s: int, op: str, mb: int,
             m: int, stash_bytes: float, fwd: list[FlowSpec | None],
             bwd: list[FlowSpec | None]) -> OpShape:
    """The cost of `op` of stage s (micro-batch size mb, m micro-batches) and the first
    boxes it reads and writes (see the module doc)."""
    n_st, st = len(stages), stages[s]
    dur = cost.stage_time_s(st.layers, st.devices, mb, op, st.recompute,
                            st.sequence_parallel, st.cp)
    # Tensor-parallel collectives run as a flow over the group's links after the
    # compute (`tp`; context rank 0's group stands for every context rank's); the
    # action's own duration is the compute alone, plus context parallelism's exposed
    # ring exchange (`sharding.ring_attention_extra_s`).
    comm_s = cost.stage_tp_comm_s(st.layers, st.devices, mb, op, st.recompute, st.cp)
    tp = tp_spec(cost, st.tp_group, *comm_s)
    if tp is not None:
        dur = max(dur - comm_s[0], 0.0)
    dur += ring_attention_extra_s(cost, st, mb, op)
    if op == "F":
        return OpShape(dur, (s - 1) * m if s > 0 else -1,
                       s * m if s < n_st - 1 else -1, fwd[s] if s < n_st - 1 else None,
                       stash_bytes, tp)
    if op == "W":
        return OpShape(dur, -1, -1, None, -stash_bytes, tp)
    return OpShape(dur, n_st * m + s * m if s < n_st - 1 else -1,          # B or I
                   n_st * m + (s - 1) * m if s > 0 else -1, bwd[s - 1] if s > 0 else None,
                   -stash_bytes if op == "B" else 0.0, tp)


def _grad_order(rank: Rank, overlap: bool) -> list[int]:
    """The rank's stages in order of their last gradient-producing action (B or W); with
    `overlap`, that action reports its start to the stage's all-reduce."""
    order: list[int] = []
    program = rank.program
    for i in range(len(program) - 1, -1, -1):
        if rank.ops[i] in "BW" and rank.stages[i] not in order:
            order.insert(0, rank.stages[i])
            if overlap:
                program[i] = program[i]._replace(report_stage=rank.stages[i])
    return order


def _prepare_boxes(pipe: Pipe, n_st: int, m: int, fwd: list[FlowSpec | None],
                   bwd: list[FlowSpec | None]) -> None:
    """Empty message boxes and idle channels for the pipe's 2 n_st m messages."""
    boxes = 2 * n_st * m
    pipe.eta = [NEVER] * boxes
    pipe.waiters = [None] * boxes
    pipe.senders = [None] * boxes
    pipe.fuse = [-1.0] * boxes
    pipe.wake = [None] * boxes
    pipe.sent_at = [None] * boxes
    pipe.fwd, pipe.bwd, pipe.m = fwd, bwd, m
    pipe.channel_spec = [*fwd, None, *bwd, None]
    pipe.busy_until = [0.0] * (2 * n_st)
    pipe.queue = [deque() for _ in range(2 * n_st)]


def boundary_flow(plan: Plan, cost: CostModel, pipe: Pipe, a: int, b: int
                  ) -> FlowSpec | None:
    """The flow carrying stage a's output to stage b, weighted by the class's copies."""
    stages = plan.pipelines[pipe.index].stages
    edges = p2p_edges(stages[a].devices, stages[b].devices)
    nbytes = cost.send_bytes(stages[min(a, b)].layers, plan.pipelines[pipe.index]
                             .micro_batch)
    counts: dict[str, int] = {}
    for q in pipe.members:
        st = plan.pipelines[q].stages
        for hop, n in count_hops(cost, p2p_edges(st[a].devices, st[b].devices)).items():
            counts[hop] = counts.get(hop, 0) + n
    own = count_hops(cost, edges)
    return p2p_spec(cost, edges, nbytes, {h: counts[h] for h in own})


def prepare_collectives(plan: Plan, cost: CostModel, opt: SimOptions, ex: Execution,
                        pipes: list[Pipe]) -> list[Segment]:
    """The gradient all-reduce segments of every layer range, registered on the pipes."""
    segments: list[Segment] = []
    grad_bytes = ex.dp_sync_bytes_per_param
    cuts = sorted({s.layers[1] for p in pipes
                   for s in plan.pipelines[p.index].stages})
    simulated_nodes = {cost.cluster.device(dev).node for p in pipes
                       for s in plan.pipelines[p.index].stages for dev in s.devices}

    def keep(src: str, dst: str) -> bool:
        c = cost.cluster
        return c.device(src).node in simulated_nodes or c.device(dst).node in \
            simulated_nodes

    start = 0
    for end in cuts:
        layers = (start, end)
        start = end
        holders = [stage_holding(plan.pipelines[q].stages, layers[0])
                   for q in range(len(plan.pipelines))]
        held = [plan.pipelines[q].stages[k] for q, k in enumerate(holders)]
        tp = max(st.tp for st in held)
        # Ring i syncs the i-th of tp slices of the gradients and joins the devices of
        # every replica that holds it: the tensor-parallel rank holding slice i
        # (`ring_member`: a device of a smaller group is in tp / t rings, one slice each,
        # as `exec.placement.dp_slices` reduces them), in every
        # context rank (context ranks hold the same weights: Megatron-LM reduces over
        # the data-parallel-with-context-parallel group). Under expert parallelism the
        # routed experts' gradients go over their own expert-data-parallel rings
        # (`experts.expert_dp_rings`), the rest over these.
        experts = cost.expert_params(layers) if held[0].ep > 1 else 0
        jobs = [((cost.stage_params(layers) - experts) * grad_bytes / tp,
                 [[st.devices[c * st.tp + ring_member(i, st.tp, tp)] for st in held
                   for c in range(st.cp)]
                  for i in range(tp)])]
        if experts:
            jobs.append((experts * expert_share(cost, plan, 0, holders[0]) * grad_bytes / tp,
                         expert_dp_rings(plan, 0, holders[0])))
        parts = [(p, stage_holding(plan.pipelines[p.index].stages, layers[0]))
                 for p in pipes]
        for nbytes, rings in jobs:
            if len(rings[0]) <= 1 or nbytes <= 0:
                continue
            k = bucket_count(nbytes, opt.bucket_bytes)
            bucket = nbytes / k if k == 1 else opt.bucket_bytes
            last = nbytes - bucket * (k - 1)
            full = ring_spec(cost, rings, bucket, keep)
            tail = full if last == bucket else ring_spec(cost, rings, last, keep)
            seg = Segment(layers, parts, full, tail, k, nbytes)
            segments.append(seg)
            for p, s in parts:
                p.segments.setdefault(s, []).append(seg)
                p.pending[s] = p.pending.get(s, 0) + 1
    return segments
