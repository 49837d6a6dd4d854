"""The emulated cluster's links as a fluid model: hops shared max-min fairly by the flows
crossing them.

A hop is one direction of one physical port of the cluster (``n0/1:out``, ``n0:nic-in``:
`hyperpipe.cluster.cluster.Cluster.path`), with its nominal bandwidth from the cluster
file and nothing else: no efficiency, no calibration, no cost model. A flow is a message
that crosses the hops of its route: its bytes move at a rate that the hops share, then
it arrives the route's latency later (the latency occupies no hop). Rates are max-min
fair (progressive filling: Bertsekas and Gallager, *Data Networks*, 2nd ed., sec. 6.5.2):
every flow gets an equal share of its most loaded hop, and what a flow held back
elsewhere cannot use is shared among the others. Between two events (a flow starts, a
flow's bytes end) every rate is constant, so the model advances from event to event
exactly; no time step.

A flow may name a queue: flows of one queue cross one after another (a communicator's
stream), each starting when the one before it has moved its bytes.

Pure and deterministic: times are whatever the caller says (seconds on any one clock);
`exec.links` drives it in real time from the ranks' requests.

>>> f = Fabric({"h": 1e9})
>>> f.start("a", ("h",), 1e6, 0.0, at_s=0.0)
>>> f.start("b", ("h",), 1e6, 0.0, at_s=0.0)
>>> f.advance(1.0)
>>> [(d.key, round(d.arrival_s, 6)) for d in f.take_deliveries()]
[('a', 0.002), ('b', 0.002)]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

# a flow whose bytes left are below this share of its size has moved them (float noise)
DONE_FRACTION = 1e-9


@dataclass(frozen=True)
class Route:
    """What a message between two devices crosses: hop names and the one-way latency."""

    hops: tuple[str, ...]
    latency_s: float


@dataclass(frozen=True)
class Topology:
    """Every hop's nominal bandwidth (bytes/s) and the route between every pair of the
    run's devices (by rank), from the cluster file alone."""

    bandwidth_bytes_per_s: dict[str, float]
    routes: dict[tuple[int, int], Route]

    def route(self, src: int, dst: int) -> Route:
        return self.routes[(src, dst)]


def topology(cluster, devices: Sequence[str]) -> Topology:
    """The Topology of `devices` (rank order) on `cluster` (a `Cluster`): each route's hops
    and latency as `Cluster.path` gives them, each hop's own bandwidth."""
    bandwidth: dict[str, float] = {}
    routes: dict[tuple[int, int], Route] = {}
    for i, a in enumerate(devices):
        for j, b in enumerate(devices):
            if i == j:
                continue
            path = cluster.path(a, b)
            for hop in path.hops:
                bandwidth[hop.name] = hop.bandwidth_bytes_per_s
            routes[(i, j)] = Route(tuple(h.name for h in path.hops),
                                   path.link.latency_s if path.hops else 0.0)
    return Topology(bandwidth, routes)


@dataclass(frozen=True)
class Delivery:
    """A flow's bytes have crossed: it arrives at `arrival_s` (bytes end + latency)."""

    key: Hashable
    arrival_s: float


@dataclass
class _Flow:
    key: Hashable
    hops: tuple[str, ...]
    left_bytes: float
    size_bytes: float
    latency_s: float
    queue: Hashable | None
    rate: float = 0.0                   # bytes/s, constant until the next event


@dataclass
class _Queue:
    busy: bool = False                  # a flow of the queue is moving its bytes
    waiting: deque = field(default_factory=deque)


class Fabric:
    """Flows over shared hops, advanced event by event (times in seconds).

    `start` adds a flow at a time no earlier than the model's present (`now_s`);
    `advance` moves the model to a later time; deliveries collect in order of their
    bytes' end and are handed over by `take_deliveries`. Hop names not in
    `bandwidth_bytes_per_s` are refused (KeyError)."""

    def __init__(self, bandwidth_bytes_per_s: dict[str, float]):
        self._bandwidth = dict(bandwidth_bytes_per_s)
        self.now_s = float("-inf")
        self._active: list[_Flow] = []
        self._queues: dict[Hashable, _Queue] = {}
        self._out: list[Delivery] = []

    # ------------------------------------------------------------------ interface
    def start(self, key: Hashable, hops: Sequence[str], nbytes: float, latency_s: float, *,
              at_s: float, queue: Hashable | None = None) -> None:
        """A flow of `nbytes` over `hops` posted at `at_s` (>= now_s, or now_s is taken):
        it starts at once, or when the flows of its `queue` posted before it are through."""
        for hop in hops:
            if hop not in self._bandwidth:
                raise KeyError(f"unknown hop {hop!r}")
        self.advance(max(at_s, self.now_s))
        flow = _Flow(key, tuple(hops), max(float(nbytes), 0.0), max(float(nbytes), 0.0),
                     max(latency_s, 0.0), queue)
        if queue is not None:
            q = self._queues.setdefault(queue, _Queue())
            if q.busy:
                q.waiting.append(flow)
                return
            q.busy = True
        self._begin([flow])

    def next_event_s(self) -> float | None:
        """When the next flow's bytes end if nothing else starts (None: no flow moving)."""
        if not self._active:
            return None
        return self.now_s + min(_eta(f) for f in self._active)

    def advance(self, to_s: float) -> None:
        """Move the model to `to_s`, ending flows (and starting queued ones) on the way."""
        if self.now_s == float("-inf"):
            self.now_s = to_s
            return
        while self._active:
            dt = min(_eta(f) for f in self._active)
            if self.now_s + dt > to_s:
                break
            self._move(dt)
            done = [f for f in self._active if f.left_bytes <= DONE_FRACTION * f.size_bytes]
            self._active = [f for f in self._active if f not in done]
            followers: list[_Flow] = []
            for f in done:
                self._out.append(Delivery(f.key, self.now_s + f.latency_s))
                if f.queue is not None:
                    q = self._queues[f.queue]
                    if q.waiting:
                        followers.append(q.waiting.popleft())
                    else:
                        q.busy = False
            self._begin(followers)
        if to_s > self.now_s:
            self._move(to_s - self.now_s)

    def take_deliveries(self) -> list[Delivery]:
        """Flows whose bytes ended since the last call, in the order they ended."""
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------------ internals
    def _begin(self, flows: Iterable[_Flow]) -> None:
        for f in flows:
            if f.left_bytes <= 0.0 or not f.hops:     # nothing to move, or a device to itself
                self._out.append(Delivery(f.key, self.now_s + f.latency_s))
                if f.queue is not None:
                    q = self._queues[f.queue]
                    if q.waiting:
                        self._begin([q.waiting.popleft()])
                    else:
                        q.busy = False
                continue
            self._active.append(f)
        self._rates()

    def _move(self, dt: float) -> None:
        for f in self._active:
            f.left_bytes -= f.rate * dt
        self.now_s += dt

    def _rates(self) -> None:
        """Max-min fair rates by progressive filling: repeatedly the hop whose remaining
        bandwidth per unfixed flow is least fixes its flows at that share."""
        left = dict(self._bandwidth)
        unfixed = list(self._active)
        count: dict[str, int] = {}
        for f in unfixed:
            for h in f.hops:
                count[h] = count.get(h, 0) + 1
        while unfixed:
            hop = min((h for h, n in count.items() if n), key=lambda h: (left[h] / count[h], h))
            share = left[hop] / count[hop]
            fixed = [f for f in unfixed if hop in f.hops]
            for f in fixed:
                f.rate = share
                for h in f.hops:
                    left[h] -= share
                    count[h] -= 1
            unfixed = [f for f in unfixed if hop not in f.hops]


def _eta(f: _Flow) -> float:
    return max(f.left_bytes, 0.0) / f.rate
