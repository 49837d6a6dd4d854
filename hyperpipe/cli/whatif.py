"""`hyperpipe whatif`: sweep a cluster or model parameter (`--vary`, `--pool`) and
tabulate or plot the best plan per variant, stragglers (today's plan kept against
re-planning) included; or, with `--failures`, goodput against the checkpoint interval
and the plan without the node most likely to fail. The work runs locally or on Ray; the
logic lives in `hyperpipe.whatif`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hyperpipe.cli import args as ca
from hyperpipe.cli.flags import (
    BackendOptions,
    ProfileOptions,
    Workload,
    add_backend,
    add_expert_parallel,
    add_json,
    add_profile,
    add_progress,
    add_stack,
    add_workload,
    as_flags,
    command,
    opened_backend,
)
from hyperpipe.cli.inputs import load_checked_profile
from hyperpipe.cli.output import EXIT_OK, print_json
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import check_outputs, figure_format

if TYPE_CHECKING:
    from hyperpipe.whatif.failures import FailureOptions
    from hyperpipe.whatif.variants import Planning


@dataclass(frozen=True)
class FailureFlags:
    """The `--failures` options as typed (quantities with units, parsed in `run`)."""

    failures: bool
    mtbf: str | None
    storage_bandwidth: str | None
    checkpoint_size: str | None
    checkpoint_write_time: str | None
    restart_time: str | None
    checkpoint_interval: tuple[str, ...]

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> FailureFlags:
        return cls(failures=ns.failures, mtbf=ns.mtbf, storage_bandwidth=ns.storage_bandwidth,
                   checkpoint_size=ns.checkpoint_size,
                   checkpoint_write_time=ns.checkpoint_write_time,
                   restart_time=ns.restart_time,
                   checkpoint_interval=tuple(ns.checkpoint_interval))


@dataclass(frozen=True)
class WhatIfOptions:
    workload: Workload
    vary: tuple[str, ...]
    pool: bool
    micro_batch: int | None
    schedule: str | None
    objective: str
    workers: int
    profile: ProfileOptions
    plot: str | None
    json: bool
    progress: bool
    backend: BackendOptions
    plan: str | None              # today's plan file
    failures: FailureFlags
    stack: str | None = None      # the stack every plan runs on (None: the plan's)
    ep: int | None = None         # expert-parallel degree fixed

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> WhatIfOptions:
        return cls(workload=Workload.from_namespace(ns), vary=tuple(ns.vary), pool=ns.pool,
                   micro_batch=ns.micro_batch, schedule=ns.schedule, objective=ns.objective,
                   workers=ns.workers, profile=ProfileOptions.from_namespace(ns),
                   plot=ns.plot, json=ns.json, progress=ns.progress,
                   backend=BackendOptions.from_namespace(ns), plan=ns.plan,
                   failures=FailureFlags.from_namespace(ns), stack=ns.stack, ep=ns.ep)


def add_parser(sub) -> None:
    p = command(sub, "whatif", "sweep a cluster or model parameter: the best plan per "
                "variant, as a table and a plot")
    add_workload(p)
    p.add_argument("--vary", action="append", default=[],
                   help="KEY=V1,V2,... e.g. 'inter_node.bandwidth=10 Gbit/s,100 Gbit/s', "
                   "'nodes.v100.count=0,4,8', 'nodes.v100.device=V100-32GB,A100-80GB', "
                   "'model=gpt3-1.3b,gpt3-2.7b', 'global_batch=32,64' (repeat for a grid)")
    p.add_argument("--pool", action="store_true", help="which subset of the cluster's "
                   "device types to use: every subset is a variant (with prices: cost too)")
    p.add_argument("--micro-batch", type=ca.BATCH, help="fix the micro-batch size")
    p.add_argument("--schedule", help="fix the schedule kind")
    add_expert_parallel(p, "fix")
    p.add_argument("--objective", choices=["throughput", "cost"], default="throughput")
    add_stack(p, "every plan (today's too)")
    p.add_argument("--workers", type=ca.WORKERS, default=1, help="worker processes")
    add_profile(p)
    p.add_argument("--plot", type=ca.path, help="write a plot of the sweep here (.png, .svg, "
                   ".pdf)")
    add_json(p)
    add_progress(p, "a progress bar over the variants on stderr")
    add_backend(p)
    p.add_argument("--plan", metavar="P", type=ca.path,
                   help="today's plan: kept on every variant against re-planning (default "
                   "with a slowdown sweep: the best plan for the cluster)")
    g = p.add_argument_group("failures (--failures)")
    g.add_argument("--failures", action="store_true", help="goodput against the checkpoint "
                   "interval, and the plan without the node most likely to fail")
    g.add_argument("--mtbf", metavar="TIME", help="MTBF of every node without its own mtbf "
                   "field, e.g. '5 days'")
    g.add_argument("--storage-bandwidth", metavar="BW",
                   help="bandwidth checkpoints are written at, e.g. '20 GB/s'")
    g.add_argument("--checkpoint-size", metavar="BYTES", help="bytes per checkpoint (default: "
                   "14 bytes per parameter: bf16 weights, fp32 master weights and moments)")
    g.add_argument("--checkpoint-write-time", metavar="TIME",
                   help="time to write one checkpoint (instead of size / storage bandwidth)")
    g.add_argument("--restart-time", metavar="TIME",
                   help="from a failure to training again (detect, restart, reload), e.g. "
                   "'10 min'")
    g.add_argument("--checkpoint-interval", action="append", default=[], metavar="TIME",
                   help="an interval to tabulate besides the optima (repeatable)")
    p.set_defaults(options=WhatIfOptions.from_namespace, run=run)


def run(opts: WhatIfOptions) -> int:
    from hyperpipe.plan.plan import load_plan
    from hyperpipe.whatif.variants import Planning
    ca.check_vary_size(list(opts.vary))
    _check_failure_flags(opts.failures)
    if opts.plot:
        figure_format(opts.plot)          # before the sweep, not after it
    check_outputs([("--cluster", opts.workload.cluster), ("--model", opts.workload.model),
                    ("--profile", opts.profile.path), ("--plan", opts.plan)],
                   [("--plot", opts.plot)])
    plan = load_plan(opts.plan) if opts.plan else None
    if plan is not None and opts.stack:
        plan = plan.on_stack(opts.stack)
    stack = opts.stack or (plan.stack if plan is not None else None)
    if opts.failures.failures:
        if opts.vary or opts.pool:
            raise BadInput("whatif --failures", "no --vary/--pool with it (one cluster)",
                           has_got=False)
    elif not opts.vary and not opts.pool:
        raise BadInput("whatif", "at least one --vary KEY=V1,V2,..., --pool or --failures",
                       has_got=False)
    planning = Planning(global_batch=opts.workload.global_batch, micro_batch=opts.micro_batch,
                        schedule=opts.schedule, objective=opts.objective,
                        workers=opts.workers, plan=plan, ep=opts.ep,
                        **({"stack": stack} if stack else {}))
    with opened_backend(opts.backend, opts.workers) as backend, as_flags():
        if opts.failures.failures:
            return _failures(opts, planning, backend)
        from hyperpipe.whatif.sweep import SweepOptions, whatif
        model, cluster, profile = _workload(opts, plan)
        result = whatif(model, cluster, SweepOptions(
            planning, vary=opts.vary, pool=opts.pool,
            progress=True if opts.progress else None), profile=profile, backend=backend,
            model_source=opts.workload.model, profile_source=f"--profile {opts.profile.path}",
            allow_profile_mismatch=opts.profile.allow_mismatch)
    return _report_sweep(result, opts)


def _workload(opts: WhatIfOptions, plan=None):
    """The cluster and model loaded, the profile checked against them, and today's plan
    (if any) checked as simulate checks it."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    cluster = load_cluster(opts.workload.cluster)
    model = load_model(opts.workload.model, where="--model")
    if plan is not None:
        plan.check(model, cluster)
        batch = opts.workload.global_batch
        if batch is not None and batch != plan.global_batch:
            raise BadInput("--global-batch", f"the --plan's global batch "
                           f"({plan.global_batch}): the kept plan trains that batch, and "
                           "its iterations are compared with the re-plans'", batch)
        for v in opts.vary:
            key = v.split("=", 1)[0].strip()
            if key == "global_batch" or key == "model" or key.startswith("model."):
                raise BadInput(f"--vary {key}", "no --plan beside it (the kept plan "
                               f"trains its own model and batch: {plan.global_batch} "
                               "samples)", has_got=False)
    return model, cluster, load_checked_profile(opts.profile, model, cluster)


def _report_sweep(result, opts: WhatIfOptions) -> int:
    from hyperpipe.whatif.stragglers import format_stragglers, plot_stragglers
    from hyperpipe.whatif.sweep import format_whatif, plot_whatif
    straggler = result.kind == "stragglers"
    if opts.plot:
        (plot_stragglers if straggler else plot_whatif)(result, opts.plot)
    if opts.json:
        print_json(result.to_dict())
    else:
        sys.stdout.write((format_stragglers if straggler else format_whatif)(result))
        if opts.plot:
            print(f"plot written to {opts.plot}")
    return EXIT_OK


def _failures(opts: WhatIfOptions, planning: Planning, backend: Any) -> int:
    """The failure study of today's plan (or the best plan) on the cluster, reported."""
    from hyperpipe.whatif.failures import failure_whatif, format_failures, plot_failures
    options = _failure_options(opts.failures, planning)
    model, cluster, profile = _workload(opts, planning.plan)
    study = failure_whatif(model, cluster, options, profile=profile, backend=backend)
    if opts.plot:
        plot_failures(study, opts.plot)
    if opts.json:
        print_json(study.to_dict())
    else:
        sys.stdout.write(format_failures(study))
        if opts.plot:
            print(f"plot written to {opts.plot}")
    return EXIT_OK


def _check_failure_flags(flags: FailureFlags) -> None:
    """BadInput for a failures flag given without `--failures` (nothing would read it),
    and for `--storage-bandwidth` beside `--checkpoint-write-time` (the write time is
    taken as given: the bandwidth would go unread)."""
    if not flags.failures:
        for field in ("mtbf", "storage_bandwidth", "checkpoint_size",
                      "checkpoint_write_time", "restart_time", "checkpoint_interval"):
            if getattr(flags, field) not in (None, ()):
                raise BadInput("--" + field.replace("_", "-"), "--failures beside it (only "
                               "the failure study reads it; a sweep does not)",
                               has_got=False)
    if flags.storage_bandwidth is not None and flags.checkpoint_write_time is not None:
        raise BadInput("--storage-bandwidth", "no --checkpoint-write-time beside it (which "
                       "gives the write time itself; the bandwidth only turns the "
                       "checkpoint size into one)", has_got=False)


def _failure_options(flags: FailureFlags, planning: Planning) -> FailureOptions:
    """The failure study's options, its quantities parsed from the flags' text."""
    from hyperpipe.core.units import parse_quantity
    from hyperpipe.whatif.failures import FailureOptions

    def quantity(flag: str, dimension: str):
        value = getattr(flags, flag[2:].replace("-", "_"))
        return None if value is None else parse_quantity(value, dimension, where=flag,
                                                         allow_zero=False, need_unit=True)
    restart = quantity("--restart-time", "time")
    if restart is None:
        raise BadInput("--restart-time", "the time from a failure to training again with "
                       "--failures (e.g. '10 min')", has_got=False)
    intervals = tuple(parse_quantity(v, "time", where="--checkpoint-interval",
                                     allow_zero=False, need_unit=True)
                      for v in flags.checkpoint_interval)
    return FailureOptions(
        planning, restart_s=restart,
        storage_bandwidth_bytes_per_s=quantity("--storage-bandwidth", "bandwidth"),
        checkpoint_bytes=quantity("--checkpoint-size", "bytes"),
        write_s=quantity("--checkpoint-write-time", "time"),
        mtbf_s=quantity("--mtbf", "time"), intervals_s=intervals)
