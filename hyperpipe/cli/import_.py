"""`hyperpipe import`: a job as Megatron-LM, torchtitan or DeepSpeed states it, read into a
plan for `simulate`, `whatif` and `export` (`hyperpipe.frameworks.importer`). What the
import did not read, assumed or approximated goes to stderr, one line each, and into the
plan's ``notes``; a setting HyperPipe cannot model (context parallelism, experts) is bad
input (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from hyperpipe.cli import args as ca
from hyperpipe.cli.flags import as_flags, command
from hyperpipe.cli.output import EXIT_OK
from hyperpipe.core.files import check_outputs


@dataclass(frozen=True)
class ImportOptions:
    framework: str                # megatron, torchtitan or deepspeed
    file: str                     # its arguments, TOML or JSON
    args: str | None              # DeepSpeed: the launch arguments
    cluster: str
    model: str | None             # replaces the model the job describes
    out: str | None               # None: the plan JSON to stdout

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ImportOptions:
        return cls(framework=getattr(ns, "from"), file=ns.file, args=ns.args,
                   cluster=ns.cluster, model=ns.model, out=ns.out)


def add_parser(sub) -> None:
    p = command(sub, "import", "read a Megatron-LM, torchtitan or DeepSpeed job into a plan "
                "(for simulate, whatif, export)")
    p.add_argument("--from", required=True, choices=["megatron", "torchtitan", "deepspeed"])
    p.add_argument("file", type=ca.path, metavar="FILE", help="Megatron-LM launch line or "
                   "arguments file, torchtitan TOML, or DeepSpeed JSON")
    p.add_argument("--args", type=ca.path, help="with --from deepspeed: the launch line or "
                   "arguments (Megatron-DeepSpeed flags: model shape, tp, pp)")
    p.add_argument("--cluster", type=ca.path, required=True,
                   help="built-in cluster name or YAML/JSON file the job runs on")
    p.add_argument("--model", type=ca.path, help="preset name or YAML/JSON file in place of "
                   "the model the job describes (same block count; needed for a torchtitan "
                   "flavour HyperPipe does not know)")
    p.add_argument("--out", type=ca.path, help="write the plan here instead of stdout")
    p.set_defaults(options=ImportOptions.from_namespace, run=run)


def run(opts: ImportOptions) -> int:
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.frameworks.importer import import_plan
    check_outputs([("FILE", opts.file), ("--args", opts.args), ("--cluster", opts.cluster),
                   ("--model", opts.model)],
                   [("--out", opts.out)])
    cluster = load_cluster(opts.cluster)
    with as_flags():
        plan, notes = import_plan(opts.framework, opts.file, cluster, args=opts.args,
                                  model=opts.model)
    lines = notes.lines()
    for line in lines:
        print(f"hyperpipe import: {line}", file=sys.stderr)
    doc = plan.to_dict()
    if lines:
        doc["notes"] = lines
    text = json.dumps(doc, indent=1) + "\n"
    if opts.out:
        from hyperpipe.core.files import write_atomic
        write_atomic(opts.out, text)
        print(f"wrote {opts.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK
