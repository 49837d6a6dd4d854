"""What the simulator runs, built from a plan before the first event: one program per
pipeline rank (flat per-action tuples: duration, box to wait for, box to send, flow,
stash change), the message boxes and channel queues of each simulated pipeline, and the
gradient all-reduce segments of each layer range. `replica_classes` groups identical
replicas so that each class is simulated once (see `hyperpipe.sim.simulator`).
"""

from __future__ import annotations

from collections import deque
from itertools import pairwise
from typing import TYPE_CHECKING

import simpy

from hyperpipe.core.errors import BadInput
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.plan_schedule import schedule_for
from hyperpipe.plan.schedule import Schedule, rank_stages
from hyperpipe.sim.analytic import bucket_count
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.network import count_hops, p2p_edges, p2p_spec, ring_spec, tp_spec

if TYPE_CHECKING:
    from hyperpipe.sim.simulator import SimOptions

NEVER = float("inf")       # a message's arrival time before it is known


class Rank:
    """One simulated pipeline rank's program (flat lists, for a lean inner loop)."""

    __slots__ = ("pipe", "d", "devices", "ops", "stages", "mbs", "program", "grad_order",
                 "cursor", "end_s", "timeline", "starts", "opt_log", "busy_s", "compute_end_s")

    def __init__(self, pipe: Pipe, d: int, devices: tuple[str, ...]):
        self.pipe, self.d, self.devices = pipe, d, devices
        self.cursor, self.end_s, self.busy_s, self.compute_end_s = 0, 0.0, 0.0, 0.0
        self.starts: list[float] = []              # start of each action, in order
        self.opt_log: list[tuple[int, float, float]] = []


class Pipe:
    """A simulated (representative) pipeline, its message boxes and collective state."""

    def __init__(self, index: int, members: list[int], schedule: Schedule):
        self.index, self.members, self.schedule = index, members, schedule
        self.ranks: list[Rank] = []
        self.segments: dict[int, list[Segment]] = {}    # stage -> its collectives
        self.pending: dict[int, int] = {}                # stage -> collectives not done
        self.reduce_wait: dict[int, simpy.Event] = {}


class Segment:
    """The gradient all-reduce of one layer range among every replica that holds it."""

    def __init__(self, layers, parts, full, last, k, nbytes):
        self.layers, self.parts = layers, parts          # parts: [(pipe, stage)]
        self.full, self.last, self.k, self.nbytes = full, last, k, nbytes
        self.reports: list[tuple[float, float]] = []
        self.log: list[tuple[int, float, float]] = []
        self.done_s = 0.0


def prepare_pipe(plan: Plan, cost: CostModel, opt: SimOptions, pipe: Pipe) -> Pipe:
    """Fill `pipe` with its ranks' programs, message boxes and channel queues."""
    pp = plan.pipelines[pipe.index]
    stages, n_st, m, mb = pp.stages, len(pp.stages), pp.num_microbatches, pp.micro_batch
    sched = pipe.schedule
    stash = [cost.stage_stash_bytes(s, mb) for s in stages]
    fwd = [boundary_flow(plan, cost, pipe, k, k + 1) for k in range(n_st - 1)]
    bwd = [boundary_flow(plan, cost, pipe, k + 1, k) for k in range(n_st - 1)]
    # Per (stage, op): duration, first box it waits for (-1: none), first box it
    # sends (-1: none), the flow, the stash change. Box k*m + j is micro-batch j's
    # message on channel k: channel k < n_st is forward out of stage k, channel
    # n_st + k backward out of stage k + 1.
    shapes: dict[tuple[int, str], tuple] = {}

    def shape(s: int, op: str) -> tuple:
        st = stages[s]
        dur = cost.stage_time_s(st.layers, st.devices, mb, op, st.recompute,
                                st.sequence_parallel)
        # Tensor-parallel collectives run as a flow over the group's links after the
        # compute (`tp`); the action's own duration is the compute alone.
        comm_s = cost.stage_tp_comm_s(st.layers, st.devices, mb, op, st.recompute)
        tp = tp_spec(cost, st.devices, *comm_s)
        if tp is not None:
            dur = max(dur - comm_s[0], 0.0)
        if op == "F":
            return (dur, (s - 1) * m if s > 0 else -1,
                    s * m if s < n_st - 1 else -1, fwd[s] if s < n_st - 1 else None,
                    stash[s], tp)
        if op == "W":
            return (dur, -1, -1, None, -stash[s], tp)
        return (dur, n_st * m + s * m if s < n_st - 1 else -1,        # B or I
                n_st * m + (s - 1) * m if s > 0 else -1, bwd[s - 1] if s > 0 else None,
                -stash[s] if op == "B" else 0.0, tp)

    for d, row in enumerate(sched.actions):
        rank = Rank(pipe, d, stages[d].devices)
        rank.ops = [a.op for a in row]
        rank.stages = [a.stage for a in row]
        rank.mbs = [a.microbatch for a in row]
        # One tuple per action for the inner loop: (compute duration, box to wait for
        # or -1, box to send or -1, its channel, its flow (None: free), stash change,
        # stage to report or -1, tensor-parallel flow or None).
        program = []
        for s, op, j in zip(rank.stages, rank.ops, rank.mbs, strict=True):
            sh = shapes.get((s, op))
            if sh is None:
                sh = shapes[(s, op)] = shape(s, op)
            dur, wait, send, spec, delta, tp = sh
            program.append((dur, wait + j if wait >= 0 else -1,
                            send + j if send >= 0 else -1, send // m, spec, delta, -1, tp))
        # The last gradient-producing action of each stage starts its all-reduce.
        rank.grad_order = []
        for i in range(len(row) - 1, -1, -1):
            if rank.ops[i] in "BW" and rank.stages[i] not in rank.grad_order:
                rank.grad_order.insert(0, rank.stages[i])
                if opt.overlap_dp_allreduce:
                    program[i] = (*program[i][:6], rank.stages[i], program[i][7])
        rank.program = program
        static = cost.device_static_bytes(
            [stages[s] for s in rank_stages(d, sched.num_devices, sched.chunks,
                                            sched.placement)], mb,
            len(plan.pipelines) if plan.distributed_optimizer else 1)
        rank.timeline = [(0.0, static)]
        pipe.ranks.append(rank)
    pipe.eta = [NEVER] * (2 * n_st * m)
    pipe.waiters = [None] * (2 * n_st * m)
    pipe.fuse = [-1.0] * (2 * n_st * m)       # the blocked reader's action time
    pipe.wake = [None] * (2 * n_st * m)       # the timeout a reader sleeps on
    pipe.sent_at = [None] * (2 * n_st * m)
    pipe.fwd, pipe.bwd, pipe.m = fwd, bwd, m
    pipe.channel_spec = [*fwd, None, *bwd, None]
    pipe.busy_until = [0.0] * (2 * n_st)
    pipe.queue = [deque() for _ in range(2 * n_st)]
    return pipe

def boundary_flow(plan: Plan, cost: CostModel, pipe: Pipe, a: int, b: int):
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

def prepare_collectives(plan: Plan, cost: CostModel, opt: SimOptions, pipes: list[Pipe]
                        ) -> list[Segment]:
    """The gradient all-reduce segments of every layer range, registered on the pipes."""
    segments: list[Segment] = []
    grad_bytes = opt.grad_bytes_per_param or \
        cost.dp_sync_bytes_per_param(plan.distributed_optimizer)
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
        groups = [plan.pipelines[q].stages[k].devices for q, k in enumerate(holders)]
        tp = max(len(g) for g in groups)
        # Ring i syncs the i-th of tp slices of the gradients and joins the device of
        # every replica that holds it: tensor-parallel rank i modulo the group's size (a
        # device of a smaller group is in tp / its size rings, one slice each).
        nbytes = cost.stage_params(layers) * grad_bytes / tp
        if len(groups) <= 1 or nbytes <= 0:
            continue
        rings = [[g[i % len(g)] for g in groups] for i in range(tp)]
        k = bucket_count(nbytes, opt.bucket_bytes)
        bucket = nbytes / k if k == 1 else opt.bucket_bytes
        last = nbytes - bucket * (k - 1)
        full = ring_spec(cost, rings, bucket, keep)
        tail = full if last == bucket else ring_spec(cost, rings, last, keep)
        parts = [(p, stage_holding(plan.pipelines[p.index].stages, layers[0]))
                 for p in pipes]
        seg = Segment(layers, parts, full, tail, k, nbytes)
        segments.append(seg)
        for p, s in parts:
            p.segments.setdefault(s, []).append(seg)
            p.pending[s] = p.pending.get(s, 0) + 1
    return segments


def stage_holding(stages, layer: int) -> int:
    for k, s in enumerate(stages):
        if s.layers[0] <= layer < s.layers[1]:
            return k
    raise BadInput("plan stages", f"a stage holding layer {layer}", has_got=False)


def replica_classes(plan: Plan, cost: CostModel) -> list[list[int]]:
    """Pipelines grouped by everything that sets their timing (see the module doc).

    Two replicas are alike when their own shapes, device types, slowdowns and links are,
    and, refined until stable (colour refinement), when the replicas their point-to-point
    hops are shared with are alike too: the neighbours of a straggler's replica on a
    shared NIC see its traffic out of step with the rest, so they get a class of their
    own, and every member of a class then moves exactly as its representative does.
    """
    cluster = cost.cluster
    groups: dict[tuple, list[int]] = {}
    hops_of: list[tuple[str, ...]] = []
    for q, pipe in enumerate(plan.pipelines):
        st = pipe.stages
        edges = [(a, b) for x, y in pairwise(st) for a, b in p2p_edges(x.devices, y.devices)]
        # Kind synth: each pipeline replays its own lists, so they join the key.
        own = schedule_for(plan, q).actions if plan.actions else None
        key = (own, pipe.micro_batch, pipe.num_microbatches,
               tuple((s.layers, s.tp, s.recompute, s.sequence_parallel,
                      cluster.device(s.devices[0]).type.name, cluster.slowdown(s.devices),
                      tuple(cost.route(a, b)[1] for a, b in pairwise(s.devices)))
                     for s in st),
               tuple((cost.route(a, b)[1], len(cost.route(a, b)[0].hops)) for a, b in edges))
        groups.setdefault(key, []).append(q)
        hops_of.append(tuple(count_hops(cost, edges)))
    classes = list(groups.values())
    if len(classes) == 1:
        return classes
    sharing: dict[str, list[int]] = {}
    for q, hops in enumerate(hops_of):
        for hop in hops:
            sharing.setdefault(hop, []).append(q)
    while True:
        colour = [0] * len(plan.pipelines)
        for c, members in enumerate(classes):
            for q in members:
                colour[q] = c
        refined: dict[tuple, list[int]] = {}
        for members in classes:
            for q in members:
                seen = tuple(sorted(colour[r] for hop in hops_of[q] for r in sharing[hop]
                                    if r != q))
                refined.setdefault((colour[q], seen), []).append(q)
        if len(refined) == len(classes):
            return classes
        classes = sorted(refined.values())
