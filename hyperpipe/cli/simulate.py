"""`hyperpipe simulate`: simulate one plan, given as a plan file or built from plan
options (uniform stages, devices in cluster order), and print its metrics (text or
JSON); optionally write the predicted trace, a Chrome trace and a timeline picture.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from hyperpipe.cli import args as ca
from hyperpipe.cli.flags import (
    MemoryOptions,
    ProfileOptions,
    add_json,
    add_memory,
    add_profile,
    add_sharding,
    add_stack,
    as_flags,
    command,
)
from hyperpipe.cli.inputs import load_checked_profile
from hyperpipe.cli.output import EXIT_OK, print_json
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import check_outputs


@dataclass(frozen=True)
class PlanShape:
    """The plan options of `simulate` (without --plan); None where not given."""

    pp: int | None = None
    dp: int | None = None
    tp: int | None = None
    micro_batch: int | None = None
    global_batch: int | None = None
    schedule: str | None = None
    chunks: int | None = None
    zero: int | None = None           # ZeRO stage
    cp: int | None = None             # context-parallel degree of every stage
    ep: int | None = None             # expert-parallel degree of every stage


@dataclass(frozen=True)
class SimulateOptions:
    plan: str | None
    cluster: str | None
    model: str | None
    shape: PlanShape
    memory: MemoryOptions
    profile: ProfileOptions
    no_overlap: bool              # all-reduce gradients after the backward
    stack: str | None             # the plan's stack overridden (None: the plan's)
    json: bool
    timeline: str | None          # picture file
    window: str | None            # START:END seconds, with timeline
    microbatches: int | None      # first K micro-batches, with timeline
    trace: str | None
    chrome: str | None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> SimulateOptions:
        shape = PlanShape(pp=ns.pp, dp=ns.dp, tp=ns.tp, micro_batch=ns.micro_batch,
                          global_batch=ns.global_batch, schedule=ns.schedule, chunks=ns.chunks,
                          zero=ns.zero, cp=ns.cp, ep=ns.ep)
        return cls(plan=ns.plan, cluster=ns.cluster, model=ns.model, shape=shape,
                   memory=MemoryOptions.from_namespace(ns),
                   profile=ProfileOptions.from_namespace(ns), no_overlap=ns.no_overlap,
                   stack=ns.stack,
                   json=ns.json, timeline=ns.timeline, window=ns.window,
                   microbatches=ns.microbatches, trace=ns.trace, chrome=ns.chrome)


def add_parser(sub) -> None:
    p = command(sub, "simulate", "simulate one plan: --plan P, or --cluster C --model M "
                "and plan options (uniform stages, devices in cluster order)")
    p.add_argument("--plan", type=ca.path, help="plan JSON; it names its model and cluster")
    p.add_argument("--cluster", type=ca.path,
                   help="built-in cluster or YAML/JSON file (overrides the plan's)")
    p.add_argument("--model", type=ca.path,
                   help="preset name or YAML/JSON file (overrides the plan's)")
    p.add_argument("--pp", type=ca.PIPELINE_DEVICES, help="devices per pipeline (plan options)")
    p.add_argument("--dp", type=ca.REPLICAS, help="pipelines (data-parallel replicas; default 1)")
    p.add_argument("--tp", type=ca.TENSOR_PARALLEL,
                   help="tensor-parallel degree per stage (default 1)")
    p.add_argument("--micro-batch", type=ca.BATCH, help="samples per micro-batch")
    p.add_argument("--global-batch", type=ca.BATCH, help="samples per iteration")
    p.add_argument("--schedule", help="schedule kind (plan options; default 1f1b)")
    p.add_argument("--chunks", type=ca.CHUNKS, help="stages per device (interleaved; default 1)")
    add_memory(p, "plan options:")
    add_sharding(p, "plan options:")
    add_profile(p)
    add_stack(p, "the plan")
    p.add_argument("--no-overlap", action="store_true",
                   help="all-reduce gradients after the backward, not during it (the "
                   "plan's runtime.overlap_grad_reduce: false)")
    add_json(p, "print the metrics as one JSON object")
    p.add_argument("--timeline", type=ca.path, help="write a timeline here (.png, .svg, .pdf)")
    p.add_argument("--window", metavar="START:END", help="with --timeline: draw only this "
                   "time window, in seconds from the iteration's start (e.g. 0:0.002)")
    p.add_argument("--microbatches", type=ca.BATCH, metavar="K", help="with --timeline: "
                   "draw only the first K micro-batches")
    p.add_argument("--trace", type=ca.path,
                   help="write the predicted trace (hyperpipe.trace/1 JSON)")
    p.add_argument("--chrome", type=ca.path, help="write the trace as Chrome trace JSON (Perfetto)")
    p.set_defaults(options=SimulateOptions.from_namespace, run=run)


def run(opts: SimulateOptions) -> int:
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import SimOptions, simulate
    from hyperpipe.sim.summary import describe
    check_outputs([("--plan", opts.plan), ("--cluster", opts.cluster),
                    ("--model", opts.model), ("--profile", opts.profile.path)],
                   [("--trace", opts.trace), ("--chrome", opts.chrome),
                    ("--timeline", opts.timeline)])
    plan, model, cluster = _plan_model_cluster(opts)
    plan = plan.on_stack(opts.stack, **({"overlap_grad_reduce": False} if opts.no_overlap
                                        else {}))
    window = _timeline_window(opts)
    cost = CostModel(model, cluster, load_checked_profile(opts.profile, model, cluster,
                                                          plan.devices))
    result = simulate(plan, cost, SimOptions())
    end_s = result.metrics.iteration_time_s
    if window is not None and window[0] >= end_s:     # before any file is written
        raise BadInput("--window", f"a start before the iteration's end ({end_s:.6g} s), "
                       "or the picture holds nothing", f"{window[0]:g}:{window[1]:g}")
    if opts.trace:
        result.trace.save(opts.trace)
    if opts.chrome:
        result.trace.save_chrome(opts.chrome)
    if opts.timeline:
        from hyperpipe.sim.timeline import plot_timelines, replicas_shown
        with as_flags():
            plot_timelines([result.trace], [
                f"simulated: {model.name} on {cluster.name}, {plan.schedule}; "
                f"{replicas_shown(plan, result.trace)}"],
                opts.timeline, window=window, microbatches=opts.microbatches)
    if opts.json:
        print_json(result.metrics.to_dict())
        return EXIT_OK
    sys.stdout.write(describe(result, plan, cost))
    zoom = ""
    if opts.timeline:
        from hyperpipe.sim.timeline import zoom_note
        zoom = zoom_note(plan, window, opts.microbatches)
    for what, path in (("trace", opts.trace), ("chrome trace", opts.chrome),
                       ("timeline", opts.timeline and f"{opts.timeline}{zoom}")):
        if path:
            print(f"{what}: {path}")
    return EXIT_OK


def _plan_model_cluster(opts: SimulateOptions):
    """The plan to simulate (from --plan, or built from the plan options), its model and
    its cluster (--model/--cluster override the plan's)."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    from hyperpipe.plan.plan import load_plan
    s, m = opts.shape, opts.memory
    shape = {"--pp": s.pp, "--micro-batch": s.micro_batch, "--global-batch": s.global_batch}
    optional = {"--dp": s.dp, "--tp": s.tp, "--schedule": s.schedule, "--chunks": s.chunks,
                "--recompute": m.recompute, "--sequence-parallel": m.sequence_parallel,
                "--distributed-optimizer": m.distributed_optimizer, "--zero": s.zero,
                "--cp": s.cp, "--ep": s.ep}
    if opts.plan:
        given = [k for k, v in {**shape, **optional}.items() if v is not None]
        if given:
            raise BadInput("simulate", f"either --plan or plan options, not both (got --plan "
                           f"and {' '.join(given)})", has_got=False)
        plan = load_plan(opts.plan)
        model = load_model(opts.model, where="--model") if opts.model else plan.load_model()
        cluster = load_cluster(opts.cluster) if opts.cluster else plan.load_cluster()
        return plan, model, cluster
    missing = [k for k, v in (("--cluster", opts.cluster), ("--model", opts.model))
               if v is None]
    missing += [k for k, v in shape.items() if v is None]
    if missing:
        raise BadInput("simulate", f"--plan P, or --cluster C --model M --pp N "
                       f"--micro-batch B --global-batch G (missing {' '.join(missing)})",
                       has_got=False)
    from hyperpipe.plan.kinds import DEFAULT_KIND, KINDS, default_chunks
    from hyperpipe.search.baselines import uniform_plan
    if s.schedule in KINDS and KINDS[s.schedule].carries_actions:
        raise BadInput("--schedule", "a fixed kind with plan options: a synthesised "
                       "schedule's action lists come from a search (hyperpipe search ... "
                       "--out PLAN, then simulate --plan PLAN)", s.schedule)
    kind = KINDS.get(s.schedule or DEFAULT_KIND)
    if kind is not None and s.chunks is not None and not kind.allows_chunks(s.chunks):
        raise BadInput("--chunks", kind.chunks_rule(), s.chunks)
    model, cluster = load_model(opts.model, where="--model"), load_cluster(opts.cluster)
    from hyperpipe.plan.plan import CP_RULE, cp_misfit, tp_misfit
    if cp_misfit(model, s.cp or 1):
        raise BadInput("--cp", CP_RULE.format(seq_len=model.seq_len), s.cp)
    misfit = tp_misfit(model, s.tp or 1, bool(m.sequence_parallel), s.cp or 1)
    if misfit is not None:
        raise BadInput("--tp", f"a divisor of the model's {misfit[0]} ({misfit[1]}): "
                       "tensor parallelism splits it", s.tp)
    if s.zero == 0 and m.distributed_optimizer:
        raise BadInput("--zero", "1 or more with --distributed-optimizer (it shards the "
                       "optimizer state: zero 1)", 0)
    tp, cp = s.tp or 1, s.cp or 1
    with as_flags():
        # tp x cp devices per stage, tensor rank innermost, then context rank
        # (`StagePlan.cp`)
        plan = uniform_plan(model, cluster, pp=s.pp, dp=s.dp or 1, tp=tp, cp=cp,
                            micro_batch=s.micro_batch, global_batch=s.global_batch,
                            schedule=s.schedule or DEFAULT_KIND,
                            chunks=s.chunks or default_chunks(s.schedule or DEFAULT_KIND))
    if s.ep is not None and s.ep > 1:
        from dataclasses import replace
        plan = plan.with_pipelines([
            replace(p, stages=tuple(replace(st, ep=s.ep) for st in p.stages))
            for p in plan.pipelines])
        with as_flags():
            plan.check(model, cluster, where="--ep")
    if m.sequence_parallel and tp == 1:
        raise BadInput("--sequence-parallel", "tensor parallelism (--tp above 1)", "--tp 1")
    plan = plan.with_memory(recompute=m.recompute, sequence_parallel=m.sequence_parallel,
                            distributed_optimizer=m.distributed_optimizer, zero=s.zero)
    return plan, model, cluster


def _timeline_window(opts: SimulateOptions):
    """The time window to draw (None: all), after checking the timeline's file type."""
    if opts.timeline:
        from hyperpipe.core.files import figure_format
        from hyperpipe.sim.timeline import parse_window
        figure_format(opts.timeline)
        with as_flags():
            return parse_window(opts.window) if opts.window else None
    if opts.window or opts.microbatches:
        raise BadInput("--window/--microbatches", "--timeline FILE to draw", has_got=False)
    return None

