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
    p.add_argument("--out", help="write the main file here instead of stdout, and the "
                   "others beside it (torchtitan's schedule CSV, DeepSpeed's launch args)")
    p.set_defaults(options=ExportOptions.from_namespace, run=run)


def run(opts: ExportOptions) -> int:
    from pathlib import Path

    from hyperpipe.frameworks.export import export, export_files
    from hyperpipe.plan.plan import load_plan
    check_outputs([("--plan", opts.plan)], [("--out", opts.out)])
    plan = load_plan(opts.plan)
    if not opts.out:
        with as_flags():
            sys.stdout.write(export(plan, opts.framework))
        return EXIT_OK
    from hyperpipe.core.files import write_atomic
    out = Path(opts.out)
    with as_flags():
        files = export_files(plan, opts.framework, out.name)
    paths = [out.parent / name for name in files]
    check_outputs([("--plan", opts.plan)], [("--out", str(p)) for p in paths])
    for path, text in zip(paths, files.values(), strict=True):
        write_atomic(path, text)
        print(f"wrote {path}", file=sys.stderr)
    return EXIT_OK
