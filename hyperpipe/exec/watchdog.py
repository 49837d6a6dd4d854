"""The rank watchdog: which rank stopped answering.

Every local rank runs a heartbeat thread that touches ``beat-RANK`` in the run directory
every `BEAT_S` seconds. A rank that is stopped (SIGSTOP, a debugger, a frozen container)
or wedged in a call that holds the interpreter stops beating, while its peers merely
wait on it. The launcher asks `silent_ranks` which living ranks have not beaten for a
while: such a rank is the one to blame, ahead of the peers whose receives timed out
because of it. Linux's process state (``T`` stopped) is added to the cause when known.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

BEAT_S = 0.5                 # heartbeat period of every rank
STARTUP_GRACE_S = 60.0       # a rank that has not beaten yet may still be starting
BLAME_SILENCE_S = 2.5        # once a run failed: silent this long = not answering


def beat_file(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / f"beat-{rank}"


def start_heartbeat(run_dir: str | os.PathLike, rank: int) -> None:
    """Touch this rank's beat file now and every BEAT_S seconds (a daemon thread)."""
    path = beat_file(run_dir, rank)
    path.touch()

    def beat() -> None:
        while True:
            time.sleep(BEAT_S)
            try:
                os.utime(path)
            except OSError:          # the run directory is gone: the run is over
                return
    threading.Thread(target=beat, name="hyperpipe-heartbeat", daemon=True).start()


def silent_ranks(run_dir: str | os.PathLike, procs: list, started_at: float,
                 silence_s: float) -> dict[int, float]:
    """{rank: seconds since its last beat} of the ranks still running that have not
    beaten for `silence_s` seconds (or never, `STARTUP_GRACE_S` after `started_at`,
    a time.time())."""
    now = time.time()
    out = {}
    for rank, p in enumerate(procs):
        if p.exitcode is not None:
            continue
        try:
            last = os.stat(beat_file(run_dir, rank)).st_mtime
        except OSError:
            last = started_at + STARTUP_GRACE_S - silence_s
        if now - last >= silence_s:
            out[rank] = max(0.0, now - last)
    return out


def process_state(pid: int | None) -> str:
    """' (process stopped)' and the like from /proc, or '' where that is unknown."""
    if pid is None:
        return ""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    state = stat.rsplit(")", 1)[-1].split()[:1]
    names = {"T": "stopped", "t": "stopped by a debugger", "D": "in uninterruptible I/O",
             "Z": "a zombie"}
    return f"; process {names[state[0]]}" if state and state[0] in names else ""


def describe(rank_silence_s: float, pid: int | None) -> str:
    return (f"stopped answering (no heartbeat for {rank_silence_s:.1f} s"
            f"{process_state(pid)}); its peers were waiting on it")
