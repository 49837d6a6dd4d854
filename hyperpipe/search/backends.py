"""Where independent pieces of a search or a what-if sweep run: here (`local`, with an
optional pool of `--workers` processes) or on a Ray cluster (`ray`: `ray.init()` on this
machine, or `--ray-address ADDR` to join a running cluster).

A backend has one job, ``map(fn, items)``: `fn` (a module-level function) applied to
every item, results in the order of `items`, as `concurrent.futures.Executor.map`
gives them. Every task is a pure function of its item (the simulator and the search
are deterministic), so both backends return identical results. Ray is an optional
extra (``pip install -e '.[ray]'``) imported only when asked for. `fan_out` is the one
way the search spreads work: here, or over a backend or a process pool; the pool's
workers end with their parent (`die_with_parent`), even when it is killed.

>>> with make_backend("local") as backend:
...     backend.map(abs, [-1, 2, -3])
[1, 2, 3]
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

from hyperpipe.core import stopping
from hyperpipe.core.errors import BadInput

BACKENDS = ("local", "ray")
RAY_INSTALL = "pip install -e '.[ray]'"
PR_SET_PDEATHSIG = 1          # <linux/prctl.h>
POLL_S = 1.0                  # how often a worker checks that its parent lives

T = TypeVar("T")
R = TypeVar("R")


class LocalBackend:
    """Tasks in this process (`workers` 1) or over a process pool of `workers`."""

    name = "local"

    def __init__(self, workers: int = 1):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise BadInput("workers", "a positive integer", workers)
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> LocalBackend:
        if self.workers > 1:
            self._pool = process_pool(self.workers)
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    @property
    def width(self) -> int:
        """Tasks run at once."""
        return self.workers

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        return self.start(fn, items)()

    def start(self, fn: Callable[[Any], Any], items: Iterable[Any]
              ) -> Callable[[], list[Any]]:
        """`map`, started now; the returned function waits for the results."""
        if self._pool is None:
            items = list(items)
            return lambda: [fn(x) for x in items]
        return start_map(self._pool, fn, items)


REACH_TIMEOUT_S = 5.0      # a Ray head that does not answer a TCP connect in this long


def _check_reachable(address: str) -> None:
    """BadInput unless something listens at `address` ("HOST:PORT"; "auto" and URLs such
    as "ray://HOST:PORT" are left to Ray): `ray.init` retries an address where nothing
    listens for ever, deaf to Ctrl-C."""
    import socket
    text = address.removeprefix("ray://")
    host, sep, port = text.rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), REACH_TIMEOUT_S):
            pass
    except OSError as exc:
        raise BadInput("ray_address", f"a running Ray cluster's head (HOST:PORT), reachable "
                       f"within {REACH_TIMEOUT_S:g} s ({exc.strerror or exc})",
                       address) from None


class RayBackend:
    """Tasks as Ray remote functions: on a local Ray started here (`num_cpus`, None:
    every core) or on the cluster at `address`. A Ray already initialised in this
    process (a test's, a notebook's) is used as it is and left running."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None):
        self.address, self.num_cpus = address, num_cpus
        self._started = False
        self._ray: Any = None

    def __enter__(self) -> RayBackend:
        ray = import_ray()
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if self.address is not None:
                _check_reachable(self.address)
                kwargs["address"] = self.address
            elif self.num_cpus is not None:
                kwargs["num_cpus"] = self.num_cpus
            try:
                ray.init(**kwargs)
            except ConnectionError as exc:
                raise BadInput("ray_address", f"a running Ray cluster ({exc})",
                               self.address) from None
            self._started = True
        self._ray = ray
        return self

    def __exit__(self, *exc) -> None:
        if self._started:
            self._ray.shutdown()
            self._started = False

    @property
    def width(self) -> int:
        """Tasks run at once: the Ray cluster's CPUs."""
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        return self.start(fn, items)()

    def start(self, fn: Callable[[Any], Any], items: Iterable[Any]
              ) -> Callable[[], list[Any]]:
        """`map`, started now; the returned function waits for the results."""
        ray = self._ray
        remote = ray.remote(fn)
        refs = [remote.remote(x) for x in items]
        return lambda: ray.get(refs)


_RAY_ADDRESS = re.compile(r"(?:ray://)?(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\])"
                          r":([0-9]{1,5})")


def check_ray_address(address: str) -> None:
    """BadInput unless `address` reads as Ray's ``auto``, ``HOST:PORT`` or
    ``ray://HOST:PORT`` (Ray itself answers a malformed one with a traceback)."""
    if address in ("auto", "local"):
        return
    match = _RAY_ADDRESS.fullmatch(address)
    if match is None or not 1 <= int(match[1]) <= 65535:
        raise BadInput("ray_address", "'auto', HOST:PORT or ray://HOST:PORT (a port of "
                       "1 to 65535)", address)


def import_ray():
    """The `ray` module, or BadInput saying how to install it (exit 2)."""
    try:
        import ray
    except ImportError:
        raise BadInput("backend ray", f"Ray installed (install it with: {RAY_INSTALL})",
                       has_got=False) from None
    return ray


def make_backend(name: str, *, workers: int = 1, address: str | None = None,
                 num_cpus: int | None = None) -> LocalBackend | RayBackend:
    """The backend called `name` ("local" or "ray"), to use as a context manager."""
    if name == "local":
        if address is not None:
            raise BadInput("ray_address", "`backend` ray with it", has_got=False)
        return LocalBackend(workers)
    if name == "ray":
        if address is not None:
            check_ray_address(address)
        import_ray()
        return RayBackend(address, num_cpus)
    raise BadInput("backend", f"one of {list(BACKENDS)}", name)


def backend_or_workers(backend: Any, workers: int):
    """The executor a search spreads its work over: the given backend, a process pool
    of `workers`, or none (None: everything here)."""
    if backend is not None:
        return contextlib.nullcontext(backend)
    return process_pool(workers) if workers > 1 else contextlib.nullcontext()


def start_map(pool: Any, fn: Callable[[Any], Any], items: Iterable[Any]
              ) -> Callable[[], list[Any]]:
    """`fn` over `items` started now on `pool` (a backend or a process pool), so that
    the caller can do other work meanwhile; the returned function waits for the
    results, in the order of `items`."""
    if isinstance(pool, LocalBackend | RayBackend):
        return pool.start(fn, items)
    futures = [pool.submit(fn, x) for x in items]
    return lambda: [f.result() for f in futures]


def fan_out(pool: Any, items: Sequence[T], here: Callable[[T], R], task: Callable[[Any], R],
            ship: Callable[[T], Any], *, at_least: int = 1) -> Callable[[], Iterator[R]]:
    """Every item's result, in the order of `items`: `here(item)` in this process when
    `pool` is None or there are fewer than `at_least` items (computed as the results are
    read), else `task(ship(item))` started now over `pool` (a backend or a process pool;
    `task` a module-level function, `ship` packs what a worker needs). Returns a
    function that yields the results; over an executor each as it is ready."""
    if pool is None or len(items) < at_least:
        return lambda: (here(x) for x in items)
    if isinstance(pool, LocalBackend | RayBackend):
        wait = pool.start(task, [ship(x) for x in items])
        return lambda: iter(wait())
    futures = [pool.submit(task, ship(x)) for x in items]
    return lambda: (f.result() for f in futures)


def process_pool(workers: int) -> ProcessPoolExecutor:
    """A pool whose workers end with us, even when we are killed (`die_with_parent`)."""
    return ProcessPoolExecutor(workers, initializer=die_with_parent, initargs=(os.getpid(),))


def die_with_parent(parent_pid: int) -> None:
    """Make this (worker) process end when `parent_pid` ends: run first thing in every
    worker (the pool's initializer), with the parent's pid taken in the parent. A killed
    parent (SIGKILL, the OOM killer) tells its workers nothing, and they would block on
    their task queue for ever: on Linux the kernel sends SIGKILL when the parent goes
    (PR_SET_PDEATHSIG), and everywhere a daemon thread checks every POLL_S seconds."""
    stopping.quiet_child()                 # Ctrl-C: the parent reports, not each worker
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:         # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="hyperpipe-parent-watch", daemon=True).start()
