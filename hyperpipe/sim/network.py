"""Links as shared resources: transfers are flows over hops that share them equally.

Every hop of the cluster (one direction of one port: ``n0/1:out``, ``n0:nic-in``, see
`hyperpipe.cluster.cluster`) is a resource. A flow is a set of hops, each with a weight
(how many identical streams of the flow cross it: the copies of a replica moving in
lock step, the streams of a ring), ``work_s`` (its bytes / the cost model's route
bandwidth: its seconds at full speed on idle hops) and ``latency_s`` (paid once, after
the bytes, occupying no hop). On idle hops a flow takes ``latency_s + work_s``, the
cost model's alpha-beta time.

Sharing: **equal time-sharing per hop**. A hop carrying streams of total weight W
gives each 1/W of its time; a flow moves at the speed of its most loaded hop,
``1 / max over its hops of W``; a rate change touches only the flows on the changed
hops. Events: a flow alone on its hops costs one SimPy event (its delivery), or none
when its caller takes the delivery time instead (``lazy``); a flow that shares a hop
gets one more when its bytes end; no per-byte events. Times in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import simpy


class _Flow:
    """One flow's state (mutable, internal: the network updates it on rate changes)."""

    __slots__ = ("hops", "names", "remaining_s", "speed", "mark_s", "end_s", "latency_s",
                 "done", "token", "event", "alone", "lazy")

    def __init__(self, hops, work_s, latency_s, done, token, now, speed):
        self.hops = hops
        self.names = [hop for hop, _ in hops]    # (read in C loops on rate changes)
        self.remaining_s = work_s        # work left, in seconds at full speed
        self.speed = speed               # fraction of full speed
        self.mark_s = now                # when remaining_s was last brought up to date
        self.end_s = now + work_s / speed    # projected end of the byte phase
        self.latency_s = latency_s
        self.done = done
        self.token = token
        self.event = None                # its pending SimPy event; older ones are stale
        self.alone = True
        self.lazy = False


class Network:
    """The hops of one simulation and the flows crossing them.

    ``start(hops, work_s, latency_s, done, token)`` begins a flow now and calls
    ``done(token)`` (inside a SimPy callback) at its delivery. Hop names are free-form
    strings (`cluster.path(...).hops[i].name`), weights positive integers.

    With ``lazy=True`` a flow that finds its hops idle gets no event at all: `start`
    returns its delivery time, which holds unless another flow joins one of its hops
    before its bytes end; then ``on_delay(token)`` is called and ``done(token)`` follows
    at the real delivery. (Point-to-point sends mostly run alone, so this saves an
    event per transfer.) Otherwise `start` returns None.
    """

    def __init__(self, env: simpy.Environment,
                 on_delay: Callable[[Any], None] | None = None):
        self.env = env
        self.on_delay = on_delay
        self._load: dict[str, int] = {}             # hop -> total weight of tracked flows
        self._on: dict[str, list[_Flow]] = {}       # hop -> tracked flows in their bytes
        self._lazy: dict[str, tuple] = {}           # hop -> the lazy flow last on it

    def start(self, hops: tuple[tuple[str, int], ...], work_s: float, latency_s: float,
              done: Callable[[Any], None], token: Any = None, lazy: bool = False,
              speed: float | None = None) -> float | None:
        """`speed`, if given, is 1 / the largest weight of `hops` (precomputed)."""
        env = self.env
        now = env.now
        if work_s <= 0.0 or not hops:
            if lazy:
                return now + latency_s
            env.timeout(latency_s).callbacks.append(lambda _e: done(token))
            return None
        on, lazies = self._on, self._lazy
        busy = False
        for hop, _ in hops:
            entry = lazies.get(hop)
            if entry is not None and entry[0] > now:
                busy = True
            flows = on.get(hop)
            if flows:
                # A tracked flow alone on its hops keeps them until its delivery event;
                # once its bytes are through (latency left) it no longer loads them.
                for f in [f for f in flows if f.end_s <= now]:
                    self._detach(f)
                busy = busy or bool(flows)
        if not busy:                                 # idle hops: the common case
            speed = speed or 1.0 / max(w for _, w in hops)
            if lazy:
                # No event and no flow object: a plain record per hop, which a flow
                # that joins before its end turns into a tracked flow.
                end_s = now + work_s / speed
                entry = (end_s, hops, work_s, latency_s, done, token, now, speed)
                for hop, _ in hops:
                    lazies[hop] = entry
                return end_s + latency_s
            flow = _Flow(hops, work_s, latency_s, done, token, now, speed)
            self._attach(flow)
            self._schedule(flow, now)
            return None
        touched: dict[_Flow, None] = {}              # in order of first touch
        for hop, _ in hops:                          # lazy flows still moving become tracked
            entry = lazies.get(hop)
            if entry is not None and entry[0] > now:
                _, f_hops, work, lat, f_done, f_token, start, f_speed = entry
                for h, _ in f_hops:
                    if lazies.get(h) is entry:
                        del lazies[h]
                f = _Flow(f_hops, work, lat, f_done, f_token, start, f_speed)
                f.lazy = True                        # `_reschedule` calls on_delay
                self._attach(f)
                touched[f] = None
        flow = _Flow(hops, work_s, latency_s, done, token, now, 1.0)
        for hop, _ in hops:
            touched.update(dict.fromkeys(on.get(hop, ())))
        self._attach(flow)
        touched[flow] = None
        self._reschedule(list(touched), now)
        return None

    def start_lazy(self, spec: FlowSpec, now: float, done: Callable[[Any], None],
                   token: Any) -> float | None:
        """`start(..., lazy=True)` of a `FlowSpec` at `now` (the current time), with a
        short path for idle hops: the simulator's hot path."""
        work_s = spec.work_s
        if work_s <= 0.0:
            return now + spec.latency_s
        lazies, on = self._lazy, self._on
        for hop in spec.names:
            entry = lazies.get(hop)
            if (entry is not None and entry[0] > now) or on.get(hop):
                return self.start(spec.hops, work_s, spec.latency_s, done, token, True,
                                  spec.speed)
        end_s = now + work_s / spec.speed
        entry = (end_s, spec.hops, work_s, spec.latency_s, done, token, now, spec.speed)
        for hop in spec.names:
            lazies[hop] = entry
        return end_s + spec.latency_s

    # ------------------------------------------------------------------ internals
    def _attach(self, flow: _Flow) -> None:
        on, load = self._on, self._load
        for hop, weight in flow.hops:
            on.setdefault(hop, []).append(flow)
            load[hop] = load.get(hop, 0) + weight

    def _detach(self, flow: _Flow) -> None:
        for hop, weight in flow.hops:
            flows = self._on[hop]
            if flow in flows:
                flows.remove(flow)
                self._load[hop] -= weight

    def _schedule(self, f: _Flow, now: float) -> None:
        # Alone on every hop: nothing else speeds up when its bytes end, so one event at
        # delivery does; otherwise an event at the end of the bytes.
        on = self._on
        f.alone = max(map(len, map(on.__getitem__, f.names))) == 1
        delay = f.end_s - now + (f.latency_s if f.alone else 0.0)
        f.event = ev = self.env.timeout(delay, f)
        ev.callbacks.append(self._fire)

    def _reschedule(self, flows: list[_Flow], now: float) -> None:
        """Bring `flows` up to date at `now`, give them their new speed and new events."""
        load = self._load
        for f in flows:
            f.remaining_s = max(0.0, f.remaining_s - (now - f.mark_s) * f.speed)
            f.mark_s = now
            f.speed = 1.0 / max(map(load.__getitem__, f.names))
            f.end_s = now + f.remaining_s / f.speed
            if f.lazy:                       # its caller's delivery time no longer holds
                f.lazy = False
                if self.on_delay is not None:
                    self.on_delay(f.token)
            self._schedule(f, now)

    def _fire(self, event: simpy.Event) -> None:
        flow = event.value
        if event is not flow.event:
            return                                   # superseded by a rate change
        flow.event = None
        self._detach(flow)
        if flow.alone:
            flow.done(flow.token)
            return
        touched: dict[_Flow, None] = {}              # in order of first touch
        for hop in flow.names:
            touched.update(dict.fromkeys(self._on[hop]))
        if touched:
            self._reschedule(list(touched), self.env.now)
        if flow.latency_s > 0.0:
            done, token = flow.done, flow.token
            self.env.timeout(flow.latency_s).callbacks.append(lambda _e: done(token))
        else:
            flow.done(flow.token)


# ---------------------------------------------------------------------------- flow specs
# The simulator and the analytic tier turn a transfer into (hops, work, latency) here,
# always through the cost model, so a calibration profile's links apply to both.

class FlowSpec:
    """A transfer ready to `Network.start`: weighted hops, work and latency (seconds)."""

    __slots__ = ("hops", "names", "work_s", "latency_s", "nbytes", "speed")

    def __init__(self, hops: tuple[tuple[str, int], ...], work_s: float, latency_s: float,
                 nbytes: float):
        self.hops = hops
        self.names = tuple(name for name, _ in hops)
        self.speed = 1.0 / max((w for _, w in hops), default=1)   # on otherwise idle hops
        self.work_s = work_s
        self.latency_s = latency_s
        self.nbytes = nbytes          # bytes per stream

    @property
    def time_s(self) -> float:
        """Time on otherwise idle hops (its own streams that cross one hop share it)."""
        return self.work_s / self.speed + self.latency_s if self.hops and self.work_s > 0 \
            else self.latency_s

    def busy_s(self) -> tuple[tuple[str, float], ...]:
        """(hop, seconds it is busy with this flow): its streams' work there. A hop that
        several flows cross serves them, at best, one after another."""
        return tuple((hop, w * self.work_s) for hop, w in self.hops)


def count_hops(cost, edges, keep=None) -> dict[str, int]:
    """Hop name -> how many of `edges` ((src, dst) device pairs) cross it; `keep(edge)`
    may drop edges."""
    counts: dict[str, int] = {}
    for src, dst in edges:
        if keep is not None and not keep(src, dst):
            continue
        for hop in cost.route(src, dst).route.hops:
            counts[hop.name] = counts.get(hop.name, 0) + 1
    return counts


def p2p_edges(src_group: tuple[str, ...], dst_group: tuple[str, ...]
              ) -> list[tuple[str, str]]:
    """Device pairs that carry a stage's output to the next stage's tensor-parallel group.

    Megatron's scatter-gather (Narayanan et al. 2021, sec. 4.1): each of the
    max(tp_src, tp_dst) streams carries 1/that of the tensor; rank i talks to rank i of
    the other group (modulo its size). The all-gather after it runs on the fast
    intra-group links and is not modelled.
    """
    n = max(len(src_group), len(dst_group))
    return [(src_group[i % len(src_group)], dst_group[i % len(dst_group)]) for i in range(n)]


def p2p_spec(cost, edges: list[tuple[str, str]], nbytes: float,
             hops: dict[str, int] | None = None) -> FlowSpec | None:
    """A stage-to-stage transfer of `nbytes` split over `edges`; None when it is free
    (all edges local, or nothing to send). `hops` overrides the hop weights (copies of
    a replica sharing a hop)."""
    per_edge = nbytes / len(edges)
    work = lat = 0.0
    crossing = False
    for src, dst in edges:
        route, link = cost.route(src, dst)
        if not route.hops:
            continue
        crossing = True
        lat = max(lat, link.latency_s)
        work = max(work, cost.transfer_time_s(src, dst, per_edge) - link.latency_s)
    if not crossing or (work <= 0.0 and lat <= 0.0):
        return None
    weights = hops if hops is not None else count_hops(cost, edges)
    return FlowSpec(tuple(weights.items()), max(work, 0.0), lat, per_edge)


def bucket_count(nbytes: float, bucket_bytes: float) -> int:
    """Buckets a gradient of `nbytes` fills at `bucket_bytes` each (DDP); 1 if unbounded."""
    if not 0 < bucket_bytes < float("inf"):
        return 1
    return max(1, math.ceil(nbytes / bucket_bytes))


def ring_spec(cost, rings: list[list[str]], nbytes: float, keep=None) -> FlowSpec | None:
    """A ring all-reduce of `nbytes` per device, run on every ring of `rings` at once
    (the tensor-parallel ranks of data-parallel replicas), as one flow.

    Its time on idle links is the cost model's `allreduce_time_s` (2(n-1)/n of the bytes
    over the slowest ring link, plus 2(n-1) latencies: Patarasuk and Yuan 2009); the
    latency part is kept apart so that sharing slows only the bytes. All edges of a ring
    move in lock step, so one flow with every edge's hops (weighted by how many edges
    cross each) stands for the whole ring. `keep(src, dst)` may leave out edges whose
    hops no simulated flow can touch (a speed-up for big plans).
    """
    n = len(rings[0]) if rings else 0
    if n <= 1 or nbytes <= 0:
        return None
    time_s = max(cost.allreduce_time_s(ring, nbytes) for ring in rings)
    if keep is None:        # the rings' hops and latency do not depend on the bytes
        key = tuple(map(tuple, rings))
        table = cost.memo("ring_hops", dict)
        if key not in table:
            table[key] = _ring_hops(cost, rings, None)
        hops, lat = table[key]
    else:
        hops, lat = _ring_hops(cost, rings, keep)
    if not hops:                        # every edge local or left out: a pure delay
        return FlowSpec((), 0.0, time_s, nbytes)
    return FlowSpec(tuple(hops.items()), max(time_s - lat, 0.0), lat, nbytes)


def _ring_hops(cost, rings: list[list[str]], keep) -> tuple[dict[str, int], float]:
    """(`count_hops` of every ring edge, the rings' latency: 2(n - 1) x the slowest
    edge's, 0 under a measured all-reduce fit) for `ring_spec`."""
    n = len(rings[0])
    edges = [(ring[i], ring[(i + 1) % n]) for ring in rings for i in range(n)]
    if cost.allreduce_fit(rings[0]) is not None:
        lat = 0.0                       # a measured fit: no separate latency term
    else:
        lat = 2 * (n - 1) * max(cost.route(a, b).link.latency_s for a, b in edges)
    return count_hops(cost, edges, keep), lat


def tp_spec(cost, devices: tuple[str, ...], time_s: float, latency_s: float
            ) -> FlowSpec | None:
    """The tensor-parallel collectives of one action as one flow over the ring of the
    group's devices: `time_s` on idle links, `latency_s` of it latency (the cost
    model's `stage_tp_comm_s`). Every ring edge moves in lock step, so each device's
    out and in port carries weight 1; a flow that shares a port (a point-to-point send,
    a data-parallel ring edge) slows it, and it slows them. None when there is none."""
    if time_s <= 0.0 or len(devices) <= 1:
        return None
    n = len(devices)
    hops = count_hops(cost, [(devices[i], devices[(i + 1) % n]) for i in range(n)])
    if not hops:
        return FlowSpec((), 0.0, time_s, 0.0)
    return FlowSpec(tuple(hops.items()), max(time_s - latency_s, 0.0), latency_s, 0.0)


def tie_rings(plan, members: list[int]) -> list[list[str]]:
    """The device pairs that all-reduce a tied embedding's gradient for the pipelines
    `members` of `plan`: tensor-parallel rank i of the first stage with rank i of the
    last (modulo each group's size), per pipeline, as Megatron's embedding group pairs
    them (megatron/core/parallel_state.py `_EMBEDDING_GROUP`: the first and last
    pipeline rank); pairs on one device left out (nothing moves)."""
    rings = []
    for q in members:
        stages = plan.pipelines[q].stages
        first, last = stages[0].devices, stages[-1].devices
        for i in range(max(len(first), len(last))):
            pair = [first[i % len(first)], last[i % len(last)]]
            if pair[0] != pair[1]:
                rings.append(pair)
    return rings


def tie_spec(cost, plan, members: list[int], grad_bytes_per_param: float
             ) -> FlowSpec | None:
    """The tied-embedding gradient all-reduce of the pipelines `members` as one flow
    (`ring_spec` over `tie_rings`): each pair moves the embedding's slice of its
    tensor-parallel rank, `cost.tied_params()` / tp elements of `grad_bytes_per_param`
    bytes (Megatron's `_allreduce_word_embedding_grads` all-reduces the main grad of
    `shared_embedding_or_output_weight`, megatron/core/distributed/
    finalize_model_grads.py). None without tied embeddings, with one stage, or when
    every pair shares a device."""
    tied = cost.tied_params()
    stages = plan.pipelines[members[0]].stages
    if not tied or len(stages) < 2:
        return None
    rings = tie_rings(plan, members)
    if not rings:
        return None
    tp = max(len(stages[0].devices), len(stages[-1].devices))
    return ring_spec(cost, rings, tied * grad_bytes_per_param / tp)
