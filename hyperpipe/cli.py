"""The `hyperpipe` command (also `python -m hyperpipe`).

Each subcommand parses its flags and calls one library function; the logic lives in the
library. Exit status: 0 success, 2 bad input (one line on stderr naming the file, the
field and what was expected; no traceback), 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hyperpipe.errors import BadInput, InfeasiblePlan

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise BadInput(f"{self.prog}", message.replace("\n", " "), has_got=False)


def _command(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, description=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hyperpipe", description="Plan, simulate and run pipeline-parallel "
                     "training on heterogeneous GPU clusters.")
    from hyperpipe import __version__
    parser.add_argument("--version", action="version", version=f"hyperpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = _command(sub, "schedule", "print or draw a pipeline schedule")
    p.add_argument("--kind", required=True, help="schedule kind, e.g. 1f1b")
    p.add_argument("--devices", type=int, required=True, help="pipeline ranks p")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches m")
    p.add_argument("--chunks", type=int, default=1, help="stages per device v (interleaved)")
    p.add_argument("--format", choices=["text", "torch-csv", "png"], default="text")
    p.add_argument("--out", help="output file (required for png; stdout otherwise)")
    p.set_defaults(func=cmd_schedule)

    return parser


def cmd_schedule(args: argparse.Namespace) -> int:
    from hyperpipe.sim.generators import generate
    from hyperpipe.sim.schedule import validate
    sched = generate(args.kind, args.devices, args.microbatches, args.chunks)
    validate(sched)
    if args.format == "png":
        if not args.out:
            raise BadInput("--out", "an output .png path with --format png", has_got=False)
        from hyperpipe.sim.schedule_plot import draw_schedule
        draw_schedule(sched, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
        return EXIT_OK
    text = sched.to_text() if args.format == "text" else sched.to_torch_csv()
    if args.out:
        from hyperpipe.files import write_atomic
        write_atomic(args.out, text)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return EXIT_OK


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=1, default=_json_default)
    sys.stdout.write("\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except BadInput as exc:
        print(f"hyperpipe: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except InfeasiblePlan as exc:
        print(f"hyperpipe: infeasible: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("hyperpipe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
