"""`hyperpipe calibrate`: fit the cost model to measured traces (`--trace`, optionally
scaling a `--base` layer profile), or profile each layer kind of a model on this machine
(`--measure`); writes a profile JSON and one summary line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hyperpipe.cli import args as ca
from hyperpipe.cli.flags import add_progress, as_flags, command
from hyperpipe.cli.inputs import int_list
from hyperpipe.cli.output import EXIT_OK
from hyperpipe.core.errors import BadInput


@dataclass(frozen=True)
class CalibrateOptions:
    traces: tuple[str, ...]       # measured trace files
    base: str | None              # a layer profile to scale to the traces
    measure: bool                 # profile the layer kinds here instead
    model: str | None
    cluster: str | None
    emulation_scale: float
    no_emulate: bool
    micro_batches: str | None     # with measure: "1,2,4" as typed (None: not given)
    progress: bool
    out: str
    allow_mismatch: bool = False  # with base: use it for another model or device types

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> CalibrateOptions:
        return cls(traces=tuple(ns.trace), base=ns.base, measure=ns.measure, model=ns.model,
                   cluster=ns.cluster, emulation_scale=ns.emulation_scale,
                   no_emulate=ns.no_emulate, micro_batches=ns.micro_batches,
                   progress=ns.progress, out=ns.out,
                   allow_mismatch=ns.allow_profile_mismatch)


def add_parser(sub) -> None:
    p = command(sub, "calibrate", "fit the cost model to measured traces, or profile each "
                "layer kind here (--measure)")
    p.add_argument("--trace", type=ca.path, nargs="+", default=[],
                   help="measured trace files (hyperpipe run)")
    p.add_argument("--base", type=ca.path,
                   help="with --trace: a profile from --measure to scale to the "
                   "traces (keeps its per-layer shape)")
    p.add_argument("--allow-profile-mismatch", action="store_true",
                   help="with --base: use it even when it was measured on another model "
                   "or lacks a device type of the traces")
    p.add_argument("--measure", action="store_true",
                   help="profile F/I/W/B of each layer kind of --model on this machine")
    p.add_argument("--model", type=ca.path, help="model to profile with --measure")
    p.add_argument("--cluster", type=ca.path,
                   help="with --measure: the device types to write entries for "
                   "(compute stretched as the executor emulates them)")
    p.add_argument("--emulation-scale", type=ca.EMULATION_SCALE, default=1.0,
                   help="with --measure: the executor's --emulation-scale")
    p.add_argument("--no-emulate", action="store_true",
                   help="with --measure: every device type at this machine's native speed")
    p.add_argument("--micro-batches",
                   help="with --measure: sizes to time, default 1,2,4 (sizes spanning 2x "
                   "or more fit a per-call time too; one size, or a narrower span, is "
                   "taken as time in proportion to FLOPs)")
    add_progress(p)
    p.add_argument("--out", type=ca.path, required=True, help="profile JSON to write")
    p.set_defaults(options=CalibrateOptions.from_namespace, run=run)


def run(opts: CalibrateOptions) -> int:
    if opts.measure == bool(opts.traces):
        raise BadInput("calibrate", "either --trace FILE... or --measure --model M", has_got=False)
    # options of the other mode would be ignored: refused instead
    given = {"--base": opts.base, "--allow-profile-mismatch": opts.allow_mismatch} \
        if opts.measure else \
        {"--model": opts.model, "--cluster": opts.cluster,
         "--micro-batches": opts.micro_batches, "--no-emulate": opts.no_emulate,
         "--emulation-scale": opts.emulation_scale != 1.0}
    for flag, value in given.items():
        if value:
            raise BadInput(flag, "only with --trace" if opts.measure else
                           "only with --measure (a trace carries its plan's model and "
                           "cluster)", value)
    from hyperpipe.core.files import check_outputs
    check_outputs([*(("--trace", t) for t in opts.traces), ("--base", opts.base),
                   ("--model", opts.model), ("--cluster", opts.cluster)],
                  [("--out", opts.out)])        # before the fit or the measurement
    profile = _fit(opts) if opts.traces else _measure(opts)
    profile.save(opts.out)
    fits = profile.compute
    worst = max((f.rel_rmse for f in fits.values()), default=0.0)
    print(f"wrote {opts.out}: {len(fits)} compute fits (worst relative RMS residual "
          f"{worst:.1%}), {len(profile.links)} link classes, "
          f"emulated={profile.emulated}")
    return EXIT_OK


def _fit(opts: CalibrateOptions):
    """The profile fitted to the measured traces."""
    from hyperpipe.plan.profile import load_profile
    from hyperpipe.plan.trace import load_trace
    from hyperpipe.sim.calibrate import calibrate
    base = load_profile(opts.base) if opts.base else None
    traces = [load_trace(t) for t in opts.traces]
    with as_flags():
        return calibrate(traces, sources=list(opts.traces), base=base,
                         base_source=f"--base {opts.base}",
                         allow_base_mismatch=opts.allow_mismatch)


def _measure(opts: CalibrateOptions):
    """The profile of the model's layer kinds measured on this machine."""
    if not opts.model:
        raise BadInput("--model", "a model to profile with --measure", has_got=False)
    sizes = int_list(opts.micro_batches or "1,2,4", "--micro-batches")
    from hyperpipe.cli.run_console import host_available_bytes
    from hyperpipe.exec.profiler import measure_profile
    return measure_profile(opts.model, opts.cluster, micro_batches=sizes,
                           emulate=not opts.no_emulate, emulation_scale=opts.emulation_scale,
                           progress=True if opts.progress else None,
                           log=lambda line: print(line, flush=True),
                           host_bytes=host_available_bytes())
