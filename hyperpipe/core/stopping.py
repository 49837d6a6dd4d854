"""Stop signals (SIGINT, SIGTERM, SIGHUP) turned into `errors.Stopped`, safely at any
moment.

A Python signal handler runs between two bytecodes of the main thread, and an exception
it raises lands in whatever Python code runs there. That is safe in our own code and the
standard library, but not in a module being imported (torch's C import calls back into
Python: a raise there aborts the process or leaves a half-imported module), in a
``__del__`` (the exception is printed and dropped) or in third-party code called back
from C. So the handler records the signal and raises only when the interrupted thread is
at a safe point and the command is `armed` (inside the block that turns a Stopped into
an exit status); otherwise it re-delivers the signal to itself a moment later (an
interval timer, SIGALRM), until it can raise. A signal that comes while a stop is being
cleaned up is recorded, not raised again, so the clean-up runs to its end. A raise that
Python drops all the same (it lands in a callback C makes, such as logging's at-fork
hook, and goes to `sys.unraisablehook`) is taken back and raised again a moment later.

`install` goes first, before any heavy import: `python -m hyperpipe` and the
`hyperpipe` script call it before they import the command's modules.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import sysconfig
import threading
from collections.abc import Iterator
from types import FrameType

from hyperpipe.core.errors import Stopped

SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
RETRY_S = 0.02            # how soon a deferred signal is delivered again
PATIENCE = 25             # retries (0.5 s) before third-party code stops counting as unsafe

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # hyperpipe/
_STDLIB = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep
                 for k in ("stdlib", "platstdlib")})


# Standard-library steps that a raise leaves half done (a thread started but never marked
# started, a pool with a process it does not know): (file, function). Short, so a stop
# waits for them; the long waits of a pool (`Future.result`) stay interruptible.
_FRAGILE = frozenset({
    ("threading.py", "start"), ("multiprocessing/process.py", "start"),
    ("multiprocessing/popen_fork.py", "_launch"),
    ("concurrent/futures/process.py", "submit"),
    ("concurrent/futures/process.py", "_start_executor_manager_thread"),
    ("concurrent/futures/process.py", "_adjust_process_count"),
    ("concurrent/futures/process.py", "_launch_processes"),
    ("concurrent/futures/process.py", "_spawn_process")})

_SHIELDED: set = set()     # code objects a stop must not interrupt (see `shield`)


def shield(fn):
    """Decorator: a stop signal never raises inside `fn` itself (it waits until `fn` has
    returned), for a function whose result must reach its caller, such as the name of a
    temporary file it just created, which the caller then removes on a stop."""
    _SHIELDED.add(fn.__code__)
    return fn


class _State:
    installed: dict[int, object] = {}      # signal -> the handler it replaced
    pending: int | None = None               # a signal that came and is not raised yet
    raised: bool = False                     # a Stopped was raised: clean-up under way
    armed: int = 0
    held: int = 0
    tries: int = 0
    hook: object = None                      # sys.unraisablehook before `install`


_S = _State()


def install(names: tuple[str, ...] = SIGNALS) -> bool:
    """Take over the stop signals `names` (idempotent). Only the main thread can; False
    elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for name in (*names, "SIGALRM"):
        sig = getattr(signal, name, None)
        if sig is not None and sig not in _S.installed:
            _S.installed[sig] = signal.signal(sig, _handler)
    if _S.hook is None:
        _S.hook, sys.unraisablehook = sys.unraisablehook, _unraisable
    return True


def uninstall() -> None:
    """Give the signals back their former handlers and forget any state."""
    with contextlib.suppress(AttributeError, ValueError):
        signal.setitimer(signal.ITIMER_REAL, 0)
    for sig, old in _S.installed.items():
        with contextlib.suppress(TypeError, ValueError):
            signal.signal(sig, old)        # type: ignore[arg-type]
    _S.installed.clear()
    if _S.hook is not None:
        sys.unraisablehook, _S.hook = _S.hook, None     # type: ignore[assignment]
    _S.pending, _S.raised, _S.armed, _S.held, _S.tries = None, False, 0, 0, 0


@contextlib.contextmanager
def armed() -> Iterator[None]:
    """While the block runs a stop signal raises Stopped (at a safe point); one that
    came before (while imports ran) is raised on entry."""
    _S.armed += 1
    try:
        if _S.pending is not None and not _S.raised:
            _S.raised = True
            raise Stopped(_S.pending)
        yield
    finally:
        _S.armed -= 1


@contextlib.contextmanager
def held() -> Iterator[None]:
    """While the block runs a stop signal waits (it is raised a moment after the block),
    for steps that must not be cut in two, such as starting a child process whose handle
    the caller needs to stop it again."""
    _S.held += 1
    try:
        yield
    finally:
        _S.held -= 1


def pending() -> int | None:
    """A stop signal that came and was never raised (it came too late), or None."""
    return None if _S.raised else _S.pending


def _handler(signum: int, frame: FrameType | None) -> None:
    if signum == getattr(signal, "SIGALRM", None):
        if _S.pending is None or _S.raised:
            return
        signum = _S.pending
    elif _S.pending is None:
        _S.pending = signum
    if _S.raised:
        return                              # clean-up under way: let it finish
    if not _S.armed or _S.held or _unsafe(frame):
        _S.tries += 1
        with contextlib.suppress(AttributeError, ValueError):
            signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    _S.raised = True
    raise Stopped(signum)


def _unraisable(info) -> None:
    """sys.unraisablehook: a Stopped that Python dropped (raised in a callback from C) is
    not printed; the stop is raised again at the next safe point. Anything else goes to
    the hook this one replaced."""
    if isinstance(info.exc_value, Stopped) and _S.raised:
        _S.raised = False
        _S.tries += 1
        with contextlib.suppress(AttributeError, ValueError):
            signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    (_S.hook or sys.__unraisablehook__)(info)        # type: ignore[operator]


def _unsafe(frame: FrameType | None) -> bool:
    """True when raising in `frame` could land in an import, a finaliser or third-party
    code that C called (the last only for the first PATIENCE retries)."""
    innermost = True
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") or code.co_name == "__del__" \
                or code in _SHIELDED or _fragile(code.co_filename, code.co_name):
            return True
        if innermost and _S.tries < PATIENCE and not _owned(code.co_filename) \
                and frame.f_globals.get("__name__") != "__main__":
            return True
        innermost = False
        frame = frame.f_back
    return False


def _fragile(filename: str, name: str) -> bool:
    return any(name == fn and filename.endswith(os.sep + tail.replace("/", os.sep))
               for tail, fn in _FRAGILE)


def _owned(filename: str) -> bool:
    if filename.startswith(_OURS + os.sep) or filename.startswith("<frozen "):
        return True
    path = os.path.realpath(filename)
    return path.startswith(_STDLIB) and "-packages" + os.sep not in path


def exit_status(exc: BaseException) -> int:
    """128 + the signal that `exc` (a KeyboardInterrupt) stands for."""
    return 128 + (exc.signum if isinstance(exc, Stopped) else int(signal.SIGINT))


def quiet_child() -> None:
    """For a worker process: Ctrl-C (sent to the whole process group) ends it at once
    and silently; its parent stops the rest and reports."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda *_: os._exit(128 + signal.SIGINT))


__all__ = ["SIGNALS", "armed", "exit_status", "held", "install", "pending", "quiet_child",
           "shield", "uninstall"]


def signal_name(signum: int) -> str:
    """SIGTERM for 15; "signal 40" for a number that names no signal (real-time ones)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
