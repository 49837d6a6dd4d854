"""Collectives timed as their steps over the emulated links (exec.links).

When links are emulated, a data-parallel group's all-reduce, reduce-scatter and
all-gather take the time of their ring steps over the emulated links: each rank runs
the steps itself, each step a flow of the link emulator from this rank to the next one
of the ring, and a step starts when this rank's flow of the step before it has arrived
from the previous rank (Patarasuk and Yuan 2009: 2(n-1) steps of bytes/n for an
all-reduce, n-1 for a reduce-scatter or an all-gather; one latency per step; the steps
of one ring edge cross one after another, as on a communicator's connection). So the
collective's time and its contention with everything else on the same ports and NICs
come from the run. The data itself moves with gloo's own collective, started at the
same moment on the group's process group: the collective is done when both are, the
data and the last step's flow. Why not carry the data in the step messages: every step
would then also wait for this machine's copies and additions of its chunk (tens of
milliseconds on a loaded CPU for what an emulated link moves in a few), time that the
device it stands for would not spend.

As NCCL does:

* the ring visits the group's devices node by node (`ring_order`), so that it crosses
  each node boundary once (NCCL orders its rings by topology; Jeaugey, "Massively
  scale your deep learning training with NCCL 2.4", NVIDIA blog, 2019);
* an all-reduce across nodes runs one ring per device of the smallest node at once
  (channels), each with its share of the bytes and leaving every node from another
  device (`hyperpipe.cluster.cluster.ring_channels`, the rings the simulator's cost
  model prices);
* over several nodes with as many devices on each (two or more) whose switches reduce
  (`hyperpipe.cluster.cluster.hierarchical_all_reduce`: NVLink SHARP) it is
  hierarchical instead: a reduce-scatter inside each node, an all-reduce of each
  device's shard over the ring of the devices with its place on the other nodes (its
  rail), an all-gather inside each node, pipelined in chunks of `PIPELINE_CHUNK_BYTES`
  (at most `MAX_PIPELINE_CHUNKS`): the three phases of one chunk run in order, those
  of different chunks at once, so the slower of the node links and the rails sets the
  time (NCCL moves every collective in chunks through all its hops at once);
* a reduce-scatter or an all-gather runs on the same rings as an all-reduce.

`timing_ring` runs an all-reduce's steps alone: a tensor-parallel stage's collectives
move their data inside its compute (DTensor over gloo), and their link time is emulated
after it this way.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Collection, Hashable, Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist

from hyperpipe.cluster.cluster import hierarchical_all_reduce, ring_channels
from hyperpipe.exec.comm import wait
from hyperpipe.exec.links import Links

# A pipelined all-reduce's chunk: NCCL's per-channel buffer (NCCL_BUFFSIZE, 4 MiB by
# default, NCCL's environment variable docs); NCCL cuts it finer still (8 steps of a
# buffer), the emulator stops at MAX_PIPELINE_CHUNKS chunks to keep its flows few, so its
# pipeline fills and drains over at most 1/16 of the bottleneck phase more.
PIPELINE_CHUNK_BYTES = 4 * 2**20
MAX_PIPELINE_CHUNKS = 16


def ring_order(ranks: Sequence[int], nodes: Sequence[str]) -> tuple[int, ...]:
    """`ranks` in the order a ring visits them: node by node (nodes in order of their
    first rank), ranks in order inside a node. `nodes[r]`: the node of rank r."""
    first: dict[str, int] = {}
    for r in sorted(ranks):
        first.setdefault(nodes[r], r)
    return tuple(sorted(ranks, key=lambda r: (first[nodes[r]], r)))


def node_groups(order: Sequence[int], nodes: Sequence[str]) -> list[tuple[int, ...]]:
    """The ranks of `order` cut into runs of one node each, in ring order."""
    out: list[list[int]] = []
    for r in order:
        if out and nodes[out[-1][-1]] == nodes[r]:
            out[-1].append(r)
        else:
            out.append([r])
    return [tuple(g) for g in out]


def ring_steps(links: Links, ring: Sequence[int], rank: int, step_bytes: float, steps: int,
               key: Hashable, channel: Hashable) -> None:
    """`steps` ring steps over `ring` (global ranks) as flows of the link emulator: at
    each, this rank's flow of `step_bytes` to the next rank leaves, then this rank waits
    for the previous rank's to arrive. Every rank of `ring` calls it with the same `key`;
    flows of one ring edge of one `channel` (communicator) queue behind each other."""
    n = len(ring)
    if n < 2 or steps < 1:
        return
    i = ring.index(rank)
    nxt, prv = ring[(i + 1) % n], ring[(i - 1) % n]
    for s in range(steps):
        links.post((key, s, rank), rank, nxt, step_bytes, queue=(channel, rank, nxt))
        links.deliver((key, s, prv))


def _concurrently(calls: Sequence[Callable[[], None]]) -> None:
    """Run `calls` at once, the first on this thread, the others on threads of their
    own; return when all have, raising the first exception any of them raised."""
    failed: list[BaseException] = []

    def guarded(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as exc:  # re-raised on the caller's thread
            failed.append(exc)

    helpers = [threading.Thread(target=guarded, args=(call,), daemon=True)
               for call in calls[1:]]
    for t in helpers:
        t.start()
    guarded(calls[0])
    for t in helpers:
        t.join()
    if failed:
        raise failed[0]


def timing_ring(links: Links, ring: Sequence[int], rank: int, nbytes: float,
                key: Hashable, channel: Hashable) -> None:
    """The 2(n - 1) steps of a ring all-reduce of `nbytes` per rank over `ring`, as
    flows only (`ring_steps` of nbytes / n each)."""
    n = len(ring)
    if n >= 2 and nbytes > 0:
        ring_steps(links, ring, rank, nbytes / n, 2 * (n - 1), key, channel)


class RingCollectives:
    """The collectives of one process group with their time from the emulated links.

    `ranks`: the group's global ranks (the process group's order, sorted); `nodes[r]`:
    the node of every global rank; `switch_nodes`: the nodes whose switch reduces
    (`Cluster.switch_reduces`); `links`: this rank's link emulator client. Calls run on
    one worker thread per group, in the order they are made (as a communicator's stream
    runs them), and return a Future."""

    def __init__(self, ranks: Sequence[int], pg: dist.ProcessGroup, rank: int,
                 nodes: Sequence[str], links: Links, timeout_s: float, name: Hashable,
                 switch_nodes: Collection[str] = ()):
        self.ranks, self.pg, self.rank = tuple(ranks), pg, rank
        self.links, self.timeout_s, self.name = links, timeout_s, name
        self.order = ring_order(ranks, nodes)
        self.nodes = node_groups(self.order, nodes)
        self.hierarchical = hierarchical_all_reduce(
            self.nodes, all(nodes[g[0]] in switch_nodes for g in self.nodes))
        self.channels = ring_channels(self.nodes)
        self._seq = 0
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._work, name=f"collectives {name}", daemon=True).start()

    # ------------------------------------------------------------------ interface
    def all_reduce(self, flat: torch.Tensor) -> Future:
        """Sum `flat` over the group, in place."""
        return self._submit(self._all_reduce, flat)

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor) -> Future:
        """`out` = this rank's slice (by its place in `ranks`) of the sum of `flat`."""
        return self._submit(self._reduce_scatter, flat, out)

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor) -> Future:
        """`out` = every rank's `mine`, in the order of `ranks`."""
        return self._submit(self._all_gather, out, mine)

    # ------------------------------------------------------------------ the worker
    def _submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        self._jobs.put((fn, args, fut))
        return fut

    def _work(self) -> None:
        while True:
            fn, args, fut = self._jobs.get()
            try:
                self._seq += 1
                fn(*args)
                fut.set_result(None)
            except BaseException as exc:  # handed to whoever waits for the result
                fut.set_exception(exc)

    # ------------------------------------------------------------------ algorithms
    def _all_reduce(self, flat: torch.Tensor) -> None:
        work = dist.all_reduce(flat, group=self.pg, async_op=True)
        nbytes = flat.numel() * flat.element_size()
        if self.hierarchical:
            self._hierarchical(nbytes)
        else:
            self._rings(nbytes / len(self.order), 2, "all-reduce")
        wait(work, self.timeout_s, f"all-reduce of ranks {self.ranks}")

    def _hierarchical(self, nbytes: float) -> None:
        """The hierarchical all-reduce's steps, pipelined in chunks (module doc): one
        thread per phase, each taking the chunks in order, a chunk's phase after its
        phase before."""
        mine = next(g for g in self.nodes if self.rank in g)
        k, m = len(mine), len(self.nodes)
        rail = tuple(g[mine.index(self.rank)] for g in self.nodes)
        chunks = max(1, min(MAX_PIPELINE_CHUNKS, -int(-nbytes // PIPELINE_CHUNK_BYTES)))
        part = nbytes / chunks
        phases = ((mine, part / k, k - 1, "node reduce-scatter"),
                  (rail, part / (k * m), 2 * (m - 1), "rail all-reduce"),
                  (mine, part / k, k - 1, "node all-gather"))
        done = [[threading.Event() for _ in range(chunks)] for _ in phases]
        stop = threading.Event()

        def run(p: int) -> None:
            ring, step_bytes, steps, phase = phases[p]
            try:
                for c in range(chunks):
                    if p > 0:
                        done[p - 1][c].wait()
                        if stop.is_set():
                            return
                    ring_steps(self.links, ring, self.rank, step_bytes, steps,
                               (self.name, self._seq, phase, ring[0], c), (self.name, phase))
                    done[p][c].set()
            except BaseException:
                stop.set()              # the phases after this one stop waiting
                for events in done:
                    for event in events:
                        event.set()
                raise

        _concurrently([lambda p=p: run(p) for p in range(len(phases))])

    def _reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        work = dist.reduce_scatter_single(out, flat, group=self.pg, async_op=True)
        self._rings(flat.numel() * flat.element_size() / len(self.order), 1, "reduce-scatter")
        wait(work, self.timeout_s, f"reduce-scatter of ranks {self.ranks}")

    def _all_gather(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        work = dist.all_gather_single(out, mine, group=self.pg, async_op=True)
        self._rings(mine.numel() * mine.element_size(), 1, "all-gather")
        wait(work, self.timeout_s, f"all-gather of ranks {self.ranks}")

    def _rings(self, step_bytes: float, rounds: int, phase: str) -> None:
        """`rounds` x (n - 1) ring steps of `step_bytes` in all over the group's
        channels (`ring_channels`), each ring its share, all at once."""
        n, c = len(self.order), len(self.channels)
        _concurrently([lambda ring=ring, i=i: ring_steps(
            self.links, ring, self.rank, step_bytes / c, rounds * (n - 1),
            (self.name, self._seq, phase, i), (self.name, i))
            for i, ring in enumerate(self.channels)])
