"""`hyperpipe export`: what torchtitan, Megatron-LM or DeepSpeed needs to run a plan's
partition, and what it cannot express (`hyperpipe.frameworks.export`), to stdout or a
file.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from hyperpipe.cli.flags import as_flags, command
from hyperpipe.cli.output import EXIT_OK
from hyperpipe.core.files import check_outputs


@dataclass(frozen=True)
class ExportOptions:
    plan: str
    framework: str                # torchtitan, megatron or deepspeed
    out: str | None               # None: stdout

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ExportOptions:
        return cls(plan=ns.plan, framework=ns.to, out=ns.out)


def add_parser(sub) -> None:
    p = command(sub, "export", "write what torchtitan, Megatron-LM or DeepSpeed needs to run "
                "a plan's partition, and what it cannot express")
    p.add_argument("--plan", required=True, metavar="P", help="plan JSON")
    p.add_argument("--to", required=True, choices=["torchtitan", "megatron", "deepspeed"])
    p.add_argument("--out", help="write here instead of stdout")
    p.set_defaults(options=ExportOptions.from_namespace, run=run)


def run(opts: ExportOptions) -> int:
    from hyperpipe.frameworks.export import export
    from hyperpipe.plan.plan import load_plan
    check_outputs([("--plan", opts.plan)], [("--out", opts.out)])
    plan = load_plan(opts.plan)
    with as_flags():
        text = export(plan, opts.framework)
    if opts.out:
        from hyperpipe.core.files import write_atomic
        write_atomic(opts.out, text)
        print(f"wrote {opts.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK
