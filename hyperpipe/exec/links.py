"""Link emulation on one CPU machine: every message of the run crosses the emulated
cluster's links, shared by all the flows on them at that moment.

Local ranks talk over loopback, so a plan whose bottleneck is a slow link would run as
if the link were free. When emulating, rank 0 starts a small coordinator process (the
link emulator) that holds one `fabric.Fabric` for the whole run: every NIC and
intra-node port of the cluster, at its nominal bandwidth and latency from the cluster
file (`fabric.topology`), nothing from the simulator. Each rank talks to it over a Unix
socket (`Links`, one connection per thread):

* the sender of a message posts its flow when it sends (``post``: key, source and
  destination rank, bytes, the send time), and sends the payload over gloo as usual;
* the receiver, once the payload is in, asks when the flow arrives (``arrival_s``) and
  holds it until then (`hold`);
* a sender that blocks on its sends (a plan's ``runtime.p2p: blocking``) posts the flow
  as awaited (``post(..., awaited=True)``) and asks the same (``sent_s``): the emulator
  keeps the arrival for it until it asks.

The emulator runs the fabric in real time: a flow's bytes move at the max-min fair
share of the hops it crosses, with every other flow that crosses them, so contention
between pipelines, several GPUs behind one NIC, the ring steps of a collective and
their overlap with compute come from the run itself. It answers a receiver when the
flow's bytes have crossed (the arrival is then that moment plus the route's latency);
a flow posted late (the request reached the emulator after a flow it would have slowed
had already been answered for) starts when the emulator hears of it; `Stats` counts
those. Times are `time.perf_counter()` seconds, one clock for every process of the
machine (CLOCK_MONOTONIC), so the ranks and the emulator need no alignment; the ranks
must all run on the machine that runs rank 0.

Point-to-point messages carry an 8-byte stamp (the sender's flow number, `comm.stamped`)
so that the receiver can name the flow; collectives name their step flows by their
place in the collective. This module imports no torch: the emulator process starts in a
fraction of a second.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait

from hyperpipe.core import stopping
from hyperpipe.exec.fabric import Fabric, Topology

# why: `wait` on sockets has millisecond resolution (epoll); the last stretch before an
# event is slept with time.sleep in steps this short, checking for requests between them
FINE_S = 2e-3
FINE_STEP_S = 2e-4
START_TIMEOUT_S = 30.0      # the emulator process must say where it listens by then
PR_SET_PDEATHSIG = 1        # prctl option, linux/prctl.h
EMULATOR_NICE = -5          # scheduling priority change of the emulator process
SOCKET_NAME = "links.sock"  # in the emulator's private folder


class LinkEmulatorFailure(RuntimeError):
    """The link emulator did not answer (it died, or a flow it waits for was never
    posted within the timeout)."""


@dataclass(frozen=True)
class Stats:
    """What the emulator saw: flows, the requests that reached it after the model had
    moved past their send time, and the largest such lag (seconds)."""

    flows: int
    late_posts: int
    max_late_s: float


# ---------------------------------------------------------------------------- the client
class Links:
    """One rank's handle on the link emulator. Thread-safe: each thread gets its own
    connection. `timeout_s` bounds every wait for an answer."""

    def __init__(self, address: str, authkey: bytes, rank: int, timeout_s: float):
        self._address, self._authkey = address, authkey
        self.rank, self.timeout_s = rank, timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._next = 0
        self._conns: list[Connection] = []

    def _conn(self) -> Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = Client(self._address, family="AF_UNIX", authkey=self._authkey)
            except OSError as exc:
                raise LinkEmulatorFailure(
                    f"rank {self.rank}: cannot reach the link emulator at {self._address} "
                    f"({exc}); emulated links need every rank on rank 0's machine "
                    "(run with --no-emulate across machines)") from exc
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def number(self) -> int:
        """A fresh flow number of this rank (for `stamped`)."""
        with self._lock:
            self._next += 1
            return self._next

    def post(self, key: Hashable, src: int, dst: int, nbytes: float, *,
             queue: Hashable | None = None, at_s: float | None = None,
             awaited: bool = False) -> None:
        """Flow `key` of `nbytes` from rank `src` to rank `dst` leaves now (or at `at_s`,
        perf_counter seconds), after the earlier flows of `queue` if one is named;
        `awaited`: its sender will ask when it arrives too (`sent_s`)."""
        self._send(("post", key, src, dst, float(nbytes), queue,
                    time.perf_counter() if at_s is None else at_s, awaited))

    def arrival_s(self, key: Hashable, *, request: str = "wait") -> float:
        """When flow `key` arrives (perf_counter seconds): blocks until its bytes have
        crossed the emulated links. `request` "sent": the sender's question about a flow
        it posted as awaited."""
        conn = self._conn()
        self._send((request, key))
        try:
            if not conn.poll(self.timeout_s):
                raise LinkEmulatorFailure(f"rank {self.rank}: the link emulator said nothing "
                                          f"of flow {key} within {self.timeout_s:g} s")
            reply = conn.recv()
        except (EOFError, OSError) as exc:
            raise LinkEmulatorFailure(f"rank {self.rank}: the link emulator is gone "
                                      f"({type(exc).__name__})") from exc
        return float(reply[1])

    def deliver(self, key: Hashable) -> float:
        """Hold until flow `key` has arrived; return perf_counter seconds then."""
        return hold(self.arrival_s(key))

    def sent_s(self, key: Hashable) -> float:
        """Hold the sender of flow `key` (posted `awaited`) until it has arrived; return
        perf_counter seconds then."""
        return hold(self.arrival_s(key, request="sent"))

    def stats(self) -> Stats:
        """The emulator's counts so far."""
        conn = self._conn()
        self._send(("stats",))
        if not conn.poll(self.timeout_s):
            raise LinkEmulatorFailure(f"rank {self.rank}: no stats within {self.timeout_s:g} s")
        return conn.recv()[1]

    def _send(self, msg: tuple) -> None:
        try:
            self._conn().send(msg)
        except OSError as exc:
            raise LinkEmulatorFailure(f"rank {self.rank}: the link emulator is gone "
                                      f"({exc})") from exc

    def close(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.close()


def hold(until_s: float) -> float:
    """Sleep until perf_counter reads `until_s`; return perf_counter then."""
    while (left_s := until_s - time.perf_counter()) > 0:
        time.sleep(left_s)
    return time.perf_counter()


# ---------------------------------------------------------------------------- starting
@dataclass
class Emulator:
    """A running link emulator process (started by `start`): where it listens."""

    process: subprocess.Popen
    address: str
    authkey: bytes
    folder: str

    def stop(self) -> None:
        """Close its input (it exits), reap it, remove its socket's folder."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def start(topo: Topology) -> Emulator:
    """Start the link emulator process for `topo`; it lives until `Emulator.stop` or
    until this process exits (its input closes; on Linux it also gets SIGTERM then,
    PR_SET_PDEATHSIG). It makes its socket's folder itself and removes it on any of
    these, so a stopped run leaves nothing behind."""
    authkey = secrets.token_bytes(16)
    # held: a stop signal must not land in the fork's callbacks (logging's at-fork lock
    # release runs in this process, where a raise is printed and dropped), nor between
    # the fork and the handle that stops the process again
    with stopping.held():
        proc = subprocess.Popen(
            [sys.executable, "-c", "from hyperpipe.exec.links import _main; _main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    try:
        pickle.dump({"topology": topo, "authkey": authkey}, proc.stdin)
        proc.stdin.flush()
        ready: list[bytes] = []
        reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        # the folder may hold spaces
        words = ready[0].rstrip(b"\n").split(b" ", 1) if ready else []
        if len(words) != 2 or words[0] != b"ready":
            raise LinkEmulatorFailure(f"the link emulator did not start within "
                                      f"{START_TIMEOUT_S:g} s")
    except BaseException:       # a stop, or it failed: leave no process and no folder
        proc.terminate()        # SIGTERM: it removes its folder
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    folder = os.fsdecode(words[1])
    return Emulator(proc, os.path.join(folder, SOCKET_NAME), authkey, folder)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# ---------------------------------------------------------------------------- the emulator
def _main() -> None:
    """Body of the emulator process: read its configuration (a pickle on stdin, from
    `start`, our own parent), make a private folder, listen on a socket in it, say
    "ready FOLDER", serve until stdin closes or SIGTERM comes; then remove the folder."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the ranks stop on Ctrl-C, then us
    # the emulated network should not wait for a core behind the ranks' compute: ahead
    # of them where the system allows it (it uses little CPU), as it is otherwise
    with contextlib.suppress(OSError):
        os.nice(EMULATOR_NICE)
    config = pickle.load(sys.stdin.buffer)
    folder = tempfile.mkdtemp(prefix="hyperpipe-links-")

    def leave(*_args) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, leave)
    listener = Listener(os.path.join(folder, SOCKET_NAME), family="AF_UNIX",
                        authkey=config["authkey"])
    server = _Server(config["topology"])

    def accept() -> None:
        while True:
            try:
                server.add(listener.accept())
            except Exception:           # a client that failed authentication
                time.sleep(0.01)        # (and never a busy loop on a broken socket)

    def watch_stdin() -> None:
        sys.stdin.buffer.read()         # returns at EOF: our parent is done or gone
        leave()

    threading.Thread(target=accept, daemon=True).start()
    threading.Thread(target=watch_stdin, daemon=True).start()
    sys.stdout.buffer.write(b"ready " + os.fsencode(folder) + b"\n")
    sys.stdout.flush()
    server.run()


class _Server:
    """The fabric driven in real time by the ranks' requests (see the module doc)."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self.fabric = Fabric(topo.bandwidth_bytes_per_s)
        self._lock = threading.Lock()
        self._new: list[Connection] = []
        self._wake_r, self._wake_w = os.pipe()
        self.conns: list[Connection] = []
        self.arrived: dict[Hashable, float] = {}
        self.waiting: dict[Hashable, Connection] = {}
        # flows whose sender awaits them too: its connection once it asked, else the
        # arrival kept for it (None: not arrived, not asked)
        self.senders: dict[Hashable, Connection | float | None] = {}
        self.flows = self.late = 0
        self.max_late_s = 0.0

    def add(self, conn: Connection) -> None:
        with self._lock:
            self._new.append(conn)
        os.write(self._wake_w, b"x")

    def run(self) -> None:
        while True:
            with self._lock:
                self.conns += self._new
                self._new.clear()
            nxt = self.fabric.next_event_s()
            left = None if nxt is None else nxt - time.perf_counter()
            if left is not None and left <= FINE_S:
                ready = wait(self.conns, 0)
                if not ready and left > 0:
                    time.sleep(min(left, FINE_STEP_S))
                    continue
            else:
                ready = wait([*self.conns, self._wake_r],
                             None if left is None else left - FINE_S)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            self._serve([c for c in ready if c != self._wake_r])

    def _serve(self, ready: list[Connection]) -> None:
        posts, waits, sent = [], [], []
        for conn in ready:
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "post":
                        posts.append(msg)
                    elif msg[0] == "wait":
                        waits.append((msg[1], conn))
                    elif msg[0] == "sent":
                        sent.append((msg[1], conn))
                    elif msg[0] == "stats":
                        conn.send(("stats", Stats(self.flows, self.late, self.max_late_s)))
            except (EOFError, OSError):
                self.conns.remove(conn)
        now = time.perf_counter()
        for _, key, src, dst, nbytes, queue, at_s, awaited in sorted(posts,
                                                                     key=lambda m: m[6]):
            if awaited:
                self.senders[key] = None
            at_s = min(at_s, now)
            if at_s < self.fabric.now_s:
                self.late += 1
                self.max_late_s = max(self.max_late_s, self.fabric.now_s - at_s)
            route = self.topo.route(src, dst)
            self.fabric.start(key, route.hops, nbytes, route.latency_s, at_s=at_s,
                              queue=queue)
            self.flows += 1
        self.fabric.advance(now)
        for d in self.fabric.take_deliveries():
            if d.key in self.senders:
                asked = self.senders[d.key]
                if asked is None:
                    self.senders[d.key] = d.arrival_s
                else:
                    del self.senders[d.key]
                    self._answer(asked, d.key, d.arrival_s)
            conn = self.waiting.pop(d.key, None)
            if conn is None:
                self.arrived[d.key] = d.arrival_s
            else:
                self._answer(conn, d.key, d.arrival_s)
        for key, conn in waits:
            if key in self.arrived:
                self._answer(conn, key, self.arrived.pop(key))
            else:
                self.waiting[key] = conn
        for key, conn in sent:
            got = self.senders.get(key)
            if isinstance(got, float):
                del self.senders[key]
                self._answer(conn, key, got)
            else:
                self.senders[key] = conn

    def _answer(self, conn: Connection, key: Hashable, arrival_s: float) -> None:
        try:
            conn.send(("at", arrival_s))
        except OSError:
            if conn in self.conns:
                self.conns.remove(conn)
