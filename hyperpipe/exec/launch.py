"""Starting the ranks of a real run, and stopping all of them when one fails.

`run_plan` checks the plan (bad input exits 2 before any rank computes), then either runs
one rank in this process when torchrun started it (RANK, WORLD_SIZE and MASTER_ADDR set:
how a run spans machines), or starts one local process per plan device from a fork
server that has imported torch once; local rendezvous goes through a file store in a
private temporary directory and gloo listens on 127.0.0.1 only. Both run `job.rank_main`.

A rank that raises writes its cause to the run directory and exits; the launcher waits a
moment for the first cause, kills the rest and raises RunFailed("rank R (device D)
failed: cause"). Every wait inside a rank has a timeout, so a hung peer fails too.
Ctrl-C, SIGTERM or SIGHUP stop and reap every rank before the exception leaves
`launch_local`; if the launcher dies without clean-up (SIGKILL), each rank exits at once
(`PR_SET_PDEATHSIG` through the fork server, and a thread polling the launcher's pid).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hyperpipe.core import stopping
from hyperpipe.core.errors import BadInput, HyperPipeError, Stopped
from hyperpipe.core.files import atomic_output, write_atomic
from hyperpipe.exec import checkpoint, watchdog
from hyperpipe.exec.comm import PeerFailure
from hyperpipe.exec.job import Prepared, prepare, rank_main
from hyperpipe.exec.links import LinkEmulatorFailure
from hyperpipe.exec.monitor import Collector, FileReporter, Monitor
from hyperpipe.exec.options import RunOptions, RunResult
from hyperpipe.plan.plan import Plan

FAILURE_GRACE_S = 1.0     # after the first failed exit, time for the root cause to land
KILL_GRACE_S = 3.0        # SIGTERM, then SIGKILL after this long
# a rank silent this long (and within --timeout) stopped answering; why 30: its
# heartbeat is a thread that wakes every 0.5 s, and on a machine loaded 10x over its
# cores (load average 20 on 2 cores) 15 s of silence was seen from a healthy rank
WATCHDOG_S = 30.0
PARENT_POLL_S = 0.5       # how often a rank checks that its launcher is still alive
PR_SET_PDEATHSIG = 1      # prctl option, linux/prctl.h
POLL_S = 0.2              # how often the launcher looks for the ranks' reports
RUN_DIR_ENV = "HYPERPIPE_RUN_DIR"
EVENTS = "events"


class RunFailed(HyperPipeError):
    """A rank raised or died. str() is ``rank R (device D) failed: cause``; `details` holds
    the failing rank's traceback; `exit_codes` every rank's exit status once stopped."""

    def __init__(self, rank: int, device: str, cause: str, details: str = "",
                 exit_codes: dict[int, int | None] | None = None):
        super().__init__(f"rank {rank} ({device}) failed: {cause}")
        self.rank, self.device, self.cause = rank, device, cause
        self.details = details
        self.exit_codes = exit_codes or {}


def run_plan(plan: Plan, options: RunOptions, monitor: Monitor | None = None, *,
             prepared: Prepared | None = None) -> RunResult:
    """Run `plan` for `options.steps` steps on real ranks and return the gathered result.

    Under torchrun this process is one rank (every rank gets the whole result); otherwise
    one local process per plan device is started and this process waits for them (a
    script calling this needs the ``if __name__ == "__main__":`` guard: the children
    start from a fork server, which imports the main script as multiprocessing's spawn
    does). `monitor` hears of phases, progress and each step as it ends (under torchrun,
    on rank 0, each step gathered from every rank: `_gathering_reporter`). A checkpoint
    directory is locked and stamped with this run for as long as it runs. Raises
    BadInput for a bad plan or options (before any rank starts), RunFailed when a rank
    fails. `prepared`: `prepare(plan, options)` where the caller made it already.
    """
    prep = prepared if prepared is not None else prepare(plan, options)
    if monitor is not None and options.resume:
        monitor.phase(f"resuming from the checkpoint in {options.checkpoint_dir}, which "
                      f"holds {checkpoint.steps_done(prep.resume_from)}: next is step "
                      f"{prep.resume_from}" if prep.resume_from is not None else
                      f"no complete checkpoint in {options.checkpoint_dir}: starting at "
                      "step 0", 0)
    env = torchrun_env()
    if env is not None:
        rank, world, local_rank, local_world = env
        if world != len(plan.devices):
            raise BadInput("WORLD_SIZE (from torchrun)", f"{len(plan.devices)}, one rank per "
                           "device of the plan", world)
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
        collector = Collector(".", world, monitor if rank == 0 else None)
        lock = _claim(prep, options) if rank == 0 else None
        try:
            return rank_main(prep, options, rank, local_rank, use_cuda=use_cuda,
                             report=_gathering_reporter(collector, rank, world))
        except BaseException as exc:
            if isinstance(exc, (BadInput, KeyboardInterrupt)):
                raise
            raise RunFailed(rank, plan.devices[rank], _cause(exc),
                            traceback.format_exc()) from exc
        finally:
            if lock is not None:
                lock.close()
    lock = _claim(prep, options)
    try:
        return _run_local(prep, options, monitor)
    finally:
        if lock is not None:
            lock.close()


# Reports every rank makes at the same point of its program, each of its own part (its
# device's expected compute, its view of a step): under torchrun they are gathered so that
# rank 0's console sees the whole step (the loss lives on the last stage), as a local
# run's launcher does from the ranks' files.
GATHERED_REPORTS = ("expected", "step")


def _gathering_reporter(collector: Collector, rank: int, world: int):
    """A torchrun rank's reporter: `GATHERED_REPORTS` are all-gathered (a collective,
    made by every rank at the same point) and handed to `collector` (rank 0's, with the
    monitor) as if every rank had reported; the others are rank 0's own."""
    def report(kind: str, **data: Any) -> None:
        if kind not in GATHERED_REPORTS:
            collector.handle({"kind": kind, "rank": rank, **data})
            return
        got: list[Any] = [None] * world
        dist.all_gather_object(got, data)
        for r, part in enumerate(got):
            collector.handle({"kind": kind, "rank": r, **part})
    return report


def _claim(prep: Prepared, options: RunOptions):
    """Lock and stamp the checkpoint directory (None without one)."""
    if options.checkpoint_dir is None:
        return None
    return checkpoint.claim_directory(options.checkpoint_dir, prep.fingerprint, options.seed,
                                      len(prep.plan.devices), resume=options.resume,
                                      overwrite=options.overwrite, lr=options.lr)


def torchrun_env() -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, local world size) when torchrun started us."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise BadInput("RANK / WORLD_SIZE / LOCAL_RANK (environment)", "integers",
                       {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
                       ) from None
    # torchrun's own ranges: a rank of the world, a local rank of the local world
    for name, value, low, high in (("WORLD_SIZE", world, 1, None),
                                   ("RANK", rank, 0, world - 1),
                                   ("LOCAL_WORLD_SIZE", local_world, 1, world),
                                   ("LOCAL_RANK", local_rank, 0, local_world - 1)):
        if value < low or (high is not None and value > high):
            upto = "" if high is None else f" and at most {high}"
            raise BadInput(f"{name} (environment)", f"an integer of at least {low}{upto}",
                           os.environ.get(name, value))
    return rank, world, local_rank, local_world


# ---------------------------------------------------------------------- local launch
def _run_local(prep: Prepared, options: RunOptions, monitor: Monitor | None) -> RunResult:
    world = len(prep.plan.devices)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    # the watchdog fires before the peers' receive timeouts, so it names the silent rank
    try:
        results = launch_local(_plan_rank, (prep, options, use_cuda), prep.plan.devices,
                               watchdog_s=max(3.0, min(options.timeout_s, WATCHDOG_S)),
                               monitor=monitor)
    finally:                    # every rank is gone: what a killed one was writing goes
        if options.checkpoint_dir:
            checkpoint.remove_temporaries(options.checkpoint_dir)
    if results[0] is None:
        raise RunFailed(0, prep.plan.devices[0], "exited without a result")
    return results[0]


def _plan_rank(rank: int, world: int, store: dist.Store, prep: Prepared,
               options: RunOptions, use_cuda: bool) -> RunResult | None:
    report = FileReporter(Path(os.environ[RUN_DIR_ENV]) / EVENTS, rank)
    result = rank_main(prep, options, rank, rank, use_cuda=use_cuda, store=store,
                       world_size=world, report=report)
    return result if rank == 0 else None       # every rank holds it; one copy is enough


def launch_local(target: Callable[..., Any], args: tuple, devices: list[str], *,
                 watchdog_s: float = WATCHDOG_S, monitor: Monitor | None = None) -> list[Any]:
    """Run ``target(rank, world, store, *args)`` in one local process per device and
    return what each rank returned (rank order). `store` is the rendezvous store for
    ``dist.init_process_group``. `target` must be importable (a module-level function),
    and a script that calls this needs the ``if __name__ == "__main__":`` guard, as with
    any multiprocessing start method but fork. Raises RunFailed when a rank fails, or
    when one stops answering (no heartbeat for `watchdog_s` seconds, see `watchdog`). A
    rank finds the private run directory in the environment (RUN_DIR_ENV); what it
    reports under ``EVENTS`` there reaches `monitor` while the ranks run."""
    world = len(devices)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["hyperpipe.exec.launch"])
    # a stop must not land between the folder's making and its clean-up's registration
    # (a raise inside TemporaryDirectory() would leave the folder): it waits for both
    with stopping.held():
        folder = tempfile.TemporaryDirectory(prefix="hyperpipe-run-")
    with folder as tmp:
        run_dir = Path(tmp)
        procs = [ctx.Process(target=_child, name=f"hyperpipe-rank{r}", daemon=True,
                             args=(target, args, r, world, str(run_dir), os.getpid()))
                 for r in range(world)]
        started_at = time.time()
        collector = Collector(run_dir / EVENTS, world, monitor)
        try:
            with stopping.held(), _safe_path():   # a stop waits until every rank has a
                for p in procs:                   # pid to stop
                    p.start()
            _watch(procs, devices, run_dir, watchdog_s, started_at, collector.poll)
        finally:
            _stop(procs)
            # what the ranks reported before they ended, a stop's or a failure's too
            # (the step lines of the last steps were lost on Ctrl-C)
            collector.poll()
        results = []
        for r in range(world):
            path = run_dir / f"result-{r}.pkl"
            # Our own file, written by our own child a moment ago: plain pickle is fine.
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results


@contextlib.contextmanager
def _safe_path():
    """Start processes (the forkserver, on its first use) without the working directory
    on their import path: the forkserver starts as ``python -c ...``, whose sys.path
    begins with the directory it was started in until the parent's path is applied, so
    a stray ``grp.py`` there would run in it (PYTHONSAFEPATH, Python 3.11+). The
    parent's environment is as it was afterwards; the ranks inherit the setting (their
    path is the parent's). A script that calls this still has its own directory on its
    path, as any Python script does."""
    before = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONSAFEPATH"]
        else:
            os.environ["PYTHONSAFEPATH"] = before


def _child(target: Callable[..., Any], args: tuple, rank: int, world: int, run_dir: str,
           launcher_pid: int) -> None:
    """Body of one local child process: rendezvous on a file, loopback sockets only."""
    die_with_parent(launcher_pid)
    # Ctrl-C reaches the whole process group: the launcher stops us (SIGTERM), which
    # raises Stopped at a safe point here so that `finally` blocks (a checkpoint's
    # temporary file) run; the report it leaves is never printed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopping.install(("SIGTERM", "SIGHUP"))
    os.environ[RUN_DIR_ENV] = run_dir
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    try:
        with stopping.armed():
            watchdog.start_heartbeat(run_dir, rank)
            store = dist.FileStore(os.path.join(run_dir, "store"), world)
            result = target(rank, world, store, *args)
            with atomic_output(Path(run_dir) / f"result-{rank}.pkl") as f:
                pickle.dump(result, f)
    except BaseException as exc:  # every failure must reach the launcher
        write_atomic(Path(run_dir) / f"failure-{rank}.json",
                     json.dumps(_report(exc, rank, time.time())))
        os._exit(1)     # no clean-up that could block on dead peers


def die_with_parent(launcher_pid: int) -> None:
    """Make this process exit as soon as the launcher `launcher_pid` is gone, even if it
    was SIGKILLed and could not stop us. Two guards: Linux's PR_SET_PDEATHSIG (SIGKILL
    when our parent, the fork server, exits; it exits when the launcher does), and a
    daemon thread that polls the launcher's pid (any POSIX system; a zombie counts as
    gone)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass                            # the watcher thread still guards us
        if os.getppid() != parent:          # the parent died before prctl took effect
            os._exit(1)

    def watch() -> None:
        while _alive(launcher_pid):
            time.sleep(PARENT_POLL_S)
        os._exit(1)                         # nobody is left to stop us or read results

    threading.Thread(target=watch, name="hyperpipe-parent-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True                         # no /proc: os.kill's answer stands
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


# What gloo and NCCL say when the other side went away (collectives outside comm.wait).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Timed out waiting", "NCCL communicator was aborted")


# How the link emulator's connection breaks when it went away (its process ended with
# rank 0's): not a rank's own resource errors (EMFILE, EACCES), which are causes
_EMULATOR_GONE = (EOFError, ConnectionResetError, BrokenPipeError, ConnectionRefusedError,
                  FileNotFoundError)


def _lost_peer(exc: BaseException) -> bool:
    """True if `exc` is the echo of another rank's failure, not a cause of its own: a
    transfer the peer broke (`PeerFailure`, or gloo's and NCCL's words for it), or the
    connection to the link emulator broken (`LinkEmulatorFailure` raised from the
    socket's end, `_EMULATOR_GONE`): the emulator is rank 0's child and goes when rank 0
    fails, so its loss is never chosen over a rank's own failure or silence; an emulator
    that died by itself is still named when nothing else failed (`_blame`'s last
    resort). An emulator that answered nothing within the timeout is a cause."""
    gone = isinstance(exc, LinkEmulatorFailure) and isinstance(exc.__cause__, _EMULATOR_GONE)
    return gone or isinstance(exc, PeerFailure) or any(s in str(exc) for s in _PEER_LOST)


def _report(exc: BaseException, rank: int, when: float) -> dict[str, Any]:
    """What a failed rank leaves for the launcher (`_blame` reads it): when (epoch
    seconds), its rank, its one-line cause, whether it only echoes another's failure
    (`_lost_peer`) and its traceback."""
    return {"time": when, "rank": rank, "cause": _cause(exc), "secondary": _lost_peer(exc),
            "traceback": "".join(traceback.format_exception(exc))}


def _cause(exc: BaseException) -> str:
    """One line: the exception's type and the first line of its message, with the
    next line where the first only announces it (ends with a colon); a rank stopped by a
    signal (`Stopped`) names the signal (``stopped by SIGTERM``)."""
    if isinstance(exc, Stopped):
        return f"stopped by {stopping.signal_name(exc.signum)}"
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not text:
        return type(exc).__name__
    first = text[0] if not (text[0].endswith(":") and len(text) > 1) else \
        f"{text[0]} {text[1]}"
    return f"{type(exc).__name__}: {first}"


def _watch(procs: list, devices: list[str], run_dir: Path, watchdog_s: float = WATCHDOG_S,
           started_at: float = 0.0, poll: Callable[[], None] = lambda: None) -> None:
    """Return when every child exited 0; raise RunFailed as soon as one fails. `poll`
    runs a few times a second meanwhile (live reports).

    The cause is picked by `_blame` from the ranks' reports, those still running that
    stopped answering (no heartbeat: `watchdog`) and those seen dead. A report written
    after the launcher began stopping the ranks answers that stop and is not a cause."""
    died_at: dict[int, float] = {}
    quiet: dict[int, float] = {}
    while True:
        now = time.time()
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0):
                died_at.setdefault(r, now)
        quiet = watchdog.silent_ranks(run_dir, procs, started_at, watchdog_s)
        if died_at or quiet:
            break
        if all(p.exitcode == 0 for p in procs):
            return
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None],
                                        timeout=POLL_S)
        poll()
    # The first exit seen may be a peer that lost its connection: give every rank a
    # moment to fail and report, then pick the root cause.
    deadline = time.monotonic() + FAILURE_GRACE_S
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None],
                                        timeout=0.05)
        now = time.time()
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0):
                died_at.setdefault(r, now)
    # still running but not beating: stopped or wedged, the likely root cause
    unresponsive = watchdog.silent_ranks(run_dir, procs, started_at, watchdog.BLAME_SILENCE_S)
    pids = {r: p.pid for r, p in enumerate(procs)}
    states = {r: (s, watchdog.describe(s, pids[r])) for r, s in unresponsive.items()}
    watched = {r: (s, watchdog.describe(s, pids[r])) for r, s in quiet.items()}
    stopped_at = time.time()
    _stop(procs)
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    reports = {}
    for path in run_dir.glob("failure-*.json"):
        try:
            rep = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if rep["time"] < stopped_at:        # later ones answer our own stop signal
            reports[rep["rank"]] = rep
    raise _blame(reports, states, died_at, watched, codes, devices)


def _blame(reports: dict[int, dict[str, Any]], unresponsive: dict[int, tuple[float, str]],
           died_at: dict[int, float], quiet: dict[int, tuple[float, str]],
           codes: dict[int, int | None], devices: list[str]) -> RunFailed:
    """The root cause of a failed run, as `_watch` saw it: `reports` the failure
    reports of the ranks (rank -> the `_child` report: time, rank, cause, secondary,
    traceback), `unresponsive` the ranks silent since the failure and `quiet` those the
    watchdog found silent (rank -> (seconds silent, `watchdog.describe`)), `died_at`
    when each rank was first seen dead, `codes` every rank's exit status.

    In this order: the earliest failure a rank reported of its own (not an echo,
    `_lost_peer`); else the rank unresponsive the longest; else, with no report and no
    rank dead, the rank the watchdog found silent the longest; else the first rank seen
    dead without a report (killed by a signal, out of memory); else the earliest echo
    (a link emulator that died by itself, every rank echoing it)."""
    own = [rep for rep in reports.values() if not rep["secondary"]]
    if not own and unresponsive:
        rank = max(unresponsive, key=lambda r: unresponsive[r][0])      # silent the longest
        return RunFailed(rank, devices[rank], unresponsive[rank][1], "", codes)
    silent = sorted((t, r) for r, t in died_at.items() if r not in reports)
    if not reports and not silent:          # the watchdog fired, and nothing else
        rank = max(quiet, key=lambda r: quiet[r][0])
        return RunFailed(rank, devices[rank], quiet[rank][1], "", codes)
    if own or not silent:
        first = min(own or reports.values(), key=lambda rep: rep["time"])
        rank = first["rank"]
        return RunFailed(rank, devices[rank], first["cause"], first["traceback"], codes)
    rank = silent[0][1]
    code = codes[rank]
    if code is not None and code < 0:
        name = stopping.signal_name(-code)      # SIGKILL, or "signal 40" for one unnamed
        cause = f"killed by {name}" if name.startswith("signal") else \
            f"killed by signal {name}"
    else:
        cause = f"exited with status {code} without a report"
    return RunFailed(rank, devices[rank], cause, "", codes)


def _stop(procs: list) -> None:
    """Terminate every child still running, then kill what ignores that; reap them all."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.terminate()
            with contextlib.suppress(OSError):  # a stopped rank acts on SIGTERM only then
                os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + KILL_GRACE_S
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()


