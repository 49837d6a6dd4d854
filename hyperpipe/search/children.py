"""Worker processes that do not outlive their parent.

A search or what-if with `--workers N` forks N worker processes. If the parent is
killed (SIGKILL, the OOM killer), nothing tells the workers: they block on their task
queue for ever. `die_with_parent` runs first in every worker (as the pool's
initializer): on Linux it asks the kernel for SIGKILL when the parent goes
(PR_SET_PDEATHSIG), and everywhere a daemon thread checks once a second that the
parent is still ours and exits otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1          # <linux/prctl.h>
POLL_S = 1.0


def die_with_parent(parent_pid: int) -> None:
    """Make this (worker) process end when `parent_pid` ends. Call it first thing in the
    worker, with the parent's pid taken in the parent (``os.getpid()`` there)."""
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
