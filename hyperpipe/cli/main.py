"""The root of the `hyperpipe` command: the argparse root over the subcommands' modules,
signal handling, and library errors translated into one line and an exit status:
0 success, 2 bad input or an infeasible plan (one line on stderr naming the file, the
field and what was expected; no traceback), 1 anything else, 128 + signal when stopped
(130 on SIGINT, 143 on SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys

from hyperpipe.cli import (
    calibrate,
    demo,
    export,
    import_,
    listing,
    run,
    schedule,
    search,
    simulate,
    whatif,
)
from hyperpipe.cli.output import (
    EXIT_BAD_INPUT,
    EXIT_ERROR,
    EXIT_OK,
    StdoutFailed,
    guarded_stdout,
)
from hyperpipe.core import stopping
from hyperpipe.core.errors import BadInput, HyperPipeError, InfeasiblePlan, Stopped

# In the order `hyperpipe --help` lists them.
COMMANDS = (schedule, simulate, demo, calibrate, run, search, whatif, listing, export,
            import_)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        flag, sep, rest = message.partition(": expected ")
        if sep and flag.startswith("argument "):        # from a checked type (cli.args)
            raise BadInput(f"{self.prog} {flag[len('argument '):]}", rest, has_got=False)
        # argparse's own phrasings, turned into what was expected (unknown options are
        # refused by `_main`, which reads the known ones: parse_known_args)
        required = "the following arguments are required: "
        if message.startswith(required):
            raise BadInput(self.prog, f"{message[len(required):]} (required)",
                           has_got=False)
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


def main(argv: list[str] | None = None) -> int:
    """The command line. SIGINT, SIGTERM and SIGHUP stop it at any moment (exit 128 +
    signal: 130, 143, 129), one line on stderr, no traceback (`core.stopping`)."""
    with sigterm_as_exit():
        return _main(argv)


@contextlib.contextmanager
def sigterm_as_exit():
    """While the block runs, SIGINT, SIGTERM and SIGHUP raise `errors.Stopped` (a
    KeyboardInterrupt) at a safe point (`core.stopping`), so that `finally` blocks (the
    safe writer's temp-file clean-up, stopping ranks) run on a kill too; a Stopped that
    leaves the block becomes SystemExit(128 + signal), 143 for SIGTERM, and so does a
    signal that came too late to be raised. Only the main thread can set handlers;
    elsewhere this does nothing."""
    ours = stopping.install()
    try:
        with stopping.armed():
            yield
    except KeyboardInterrupt as exc:
        code = stopping.exit_status(exc)
        print(f"hyperpipe: stopped by {stopping.signal_name(code - 128)}", file=sys.stderr)
        raise SystemExit(code) from None
    finally:
        late = stopping.pending() if ours else None
        if ours:
            stopping.uninstall()
    if late is not None:
        print(f"hyperpipe: stopped by {stopping.signal_name(late)}", file=sys.stderr)
        raise SystemExit(128 + late)


def _main(argv: list[str] | None) -> int:
    try:
        with guarded_stdout():
            parser = build_parser()
            ns, extra = parser.parse_known_args(argv)
            if extra:                  # named after the command they were given to
                words = list(sys.argv[1:] if argv is None else argv)
                at = words.index(ns.command) if ns.command in words else 0
                if any(word in words[:at] for word in extra):
                    raise BadInput("hyperpipe", f"a command's options after its name "
                                   f"(hyperpipe {ns.command} ...)", " ".join(extra))
                raise BadInput(f"hyperpipe {ns.command}", f"only the options `hyperpipe "
                               f"{ns.command} --help` lists", " ".join(extra))
            code = int(ns.run(ns.options(ns)) or 0)
            sys.stdout.flush()           # a full stdout fails here, not at exit
            return code
    except StdoutFailed as exc:
        print(f"hyperpipe: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BadInput as exc:
        print(f"hyperpipe: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except InfeasiblePlan as exc:
        print(f"hyperpipe: infeasible: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except HyperPipeError as exc:       # a failure the library explains in words
        print(f"hyperpipe: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        print(f"hyperpipe: stopped by {stopping.signal_name(signum)}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        return EXIT_OK
    except OSError as exc:
        if exc.errno not in _HOST_LIMITS:
            raise
        print(f"hyperpipe: error: {os.strerror(exc.errno)} (a limit of this host)",
              file=sys.stderr)
        return EXIT_ERROR


# Errors that say the host ran out of something, not that the program is wrong.
_HOST_LIMITS = (errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EFBIG, errno.ENOMEM)
