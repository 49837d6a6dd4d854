"""The root of the `hyperpipe` command: the argparse root over the subcommands' modules,
signal handling, and library errors translated into one line and an exit status:
0 success, 2 bad input or an infeasible plan (one line on stderr naming the file, the
field and what was expected; no traceback), 1 anything else, 128 + signal when stopped
(130 on SIGINT, 143 on SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from hyperpipe.cli import (
    calibrate,
    demo,
    export,
    listing,
    run,
    schedule,
    search,
    simulate,
    whatif,
)
from hyperpipe.cli.output import EXIT_BAD_INPUT, EXIT_OK
from hyperpipe.core.errors import BadInput, InfeasiblePlan, Stopped

# In the order `hyperpipe --help` lists them.
COMMANDS = (schedule, simulate, demo, calibrate, run, search, whatif, listing, export)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        flag, sep, rest = message.partition(": expected ")
        if sep and flag.startswith("argument "):        # from a checked type (cli.args)
            raise BadInput(f"{self.prog} {flag[len('argument '):]}", rest, has_got=False)
        raise BadInput(f"{self.prog}", message.replace("\n", " "), has_got=False)


def build_parser() -> argparse.ArgumentParser:
    """The root parser; each subcommand's module adds its own (`add_parser`), which sets
    `options` (namespace -> the command's frozen options) and `run` (options -> exit)."""
    parser = _Parser(prog="hyperpipe", description="Plan, simulate and run pipeline-parallel "
                     "training on heterogeneous GPU clusters.")
    from hyperpipe import __version__
    parser.add_argument("--version", action="version", version=f"hyperpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


_STOP_SIGNALS = ("SIGTERM", "SIGHUP")


def _raise_stopped(signum: int, frame: object) -> None:
    for name in _STOP_SIGNALS:          # clean-up runs once, not interrupted by a repeat
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    raise Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    """The command line. SIGTERM and SIGHUP stop it as Ctrl-C does (exit 128 + signal)."""
    with sigterm_as_exit():
        return _main(argv)


@contextlib.contextmanager
def sigterm_as_exit():
    """While the block runs, SIGTERM and SIGHUP raise `errors.Stopped` (a
    KeyboardInterrupt), so that `finally` blocks (the safe writer's temp-file clean-up,
    stopping ranks) run on a kill too; a Stopped that leaves the block becomes
    SystemExit(128 + signal), 143 for SIGTERM. Only the main thread can set handlers;
    elsewhere this does nothing."""
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for name in _STOP_SIGNALS:
            if hasattr(signal, name):
                sig = getattr(signal, name)
                saved[sig] = signal.signal(sig, _raise_stopped)
    try:
        yield
    except Stopped as exc:
        raise SystemExit(128 + exc.signum) from None
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _main(argv: list[str] | None) -> int:
    try:
        ns = build_parser().parse_args(argv)
        return int(ns.run(ns.options(ns)) or 0)
    except BadInput as exc:
        print(f"hyperpipe: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except InfeasiblePlan as exc:
        print(f"hyperpipe: infeasible: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        print(f"hyperpipe: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        return EXIT_OK
