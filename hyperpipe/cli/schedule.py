"""`hyperpipe schedule`: print or draw the schedule of one kind for p devices and m
micro-batches (IR text, torch's CSV or a picture); with `--kind synth --plan P`, the
schedule synthesised for that plan (`hyperpipe.cli.schedule_plan`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from hyperpipe.cli import args as ca
from hyperpipe.cli.flags import command
from hyperpipe.cli.output import EXIT_OK, write_text
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import check_outputs


@dataclass(frozen=True)
class ScheduleOptions:
    kind: str
    devices: int | None           # pipeline ranks p
    microbatches: int | None      # micro-batches m
    plan: str | None              # with kind synth: the plan to synthesise for
    chunks: int | None            # stages per device v (None: the kind's default)
    format: str                   # text, torch-csv or png
    out: str | None               # None: stdout (png needs a file)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ScheduleOptions:
        return cls(kind=ns.kind, devices=ns.devices, microbatches=ns.microbatches,
                   plan=ns.plan, chunks=ns.chunks, format=ns.format, out=ns.out)


def add_parser(sub) -> None:
    p = command(sub, "schedule", "print or draw a pipeline schedule")
    p.add_argument("--kind", required=True, help="schedule kind, e.g. 1f1b")
    p.add_argument("--devices", type=ca.PIPELINE_DEVICES, help="pipeline ranks p")
    p.add_argument("--microbatches", type=ca.MICROBATCHES, help="micro-batches m")
    p.add_argument("--plan", type=ca.path,
                   help="with --kind synth: the plan to synthesise a schedule for")
    p.add_argument("--chunks", type=ca.CHUNKS, help="stages per device v (interleaved; the "
                   "V kinds zb-v and dualpipe-v take 2, the default for them)")
    p.add_argument("--format", choices=["text", "torch-csv", "png"], default="text")
    p.add_argument("--out", type=ca.path, help="output file (required for png; stdout otherwise)")
    p.set_defaults(options=ScheduleOptions.from_namespace, run=run)


def run(opts: ScheduleOptions) -> int:
    from hyperpipe.plan.kinds import KINDS, generate
    from hyperpipe.plan.schedule import validate
    check_outputs([("--plan", opts.plan)], [("--out", opts.out)])
    if opts.plan or (opts.kind in KINDS and KINDS[opts.kind].carries_actions):
        if not opts.plan:
            raise BadInput("--kind synth", "--plan P (synth builds a schedule for a plan)",
                           has_got=False)
        for flag, value in (("--devices", opts.devices), ("--microbatches",
                                                            opts.microbatches),
                            ("--chunks", opts.chunks)):
            if value is not None:        # the plan's own shape decides
                raise BadInput(flag, "none with --plan (the plan's stages and micro-batches "
                               "give the schedule's shape)", value)
        from hyperpipe.cli.schedule_plan import schedule_from_plan
        return schedule_from_plan(opts.kind, opts.plan, opts.format, opts.out)
    missing = [f for f in ("devices", "microbatches") if getattr(opts, f) is None]
    if missing:
        raise BadInput("schedule", f"--{missing[0]} (or --kind synth --plan P)", has_got=False)
    sched = generate(opts.kind, opts.devices, opts.microbatches, opts.chunks)
    validate(sched)
    if opts.format == "png":
        if not opts.out:
            raise BadInput("--out", "an output .png, .svg or .pdf path with --format png",
                           has_got=False)
        from hyperpipe.plan.schedule_plot import draw_schedule
        draw_schedule(sched, opts.out)
        print(f"wrote {opts.out}", file=sys.stderr)
        return EXIT_OK
    text = sched.to_text() if opts.format == "text" else sched.to_torch_csv()
    write_text(text if opts.out or text.endswith("\n") else text + "\n", opts.out)
    return EXIT_OK
