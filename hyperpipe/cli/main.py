"""The `hyperpipe` command (also `python -m hyperpipe`).

Each subcommand parses its flags and calls one library function; the logic lives in the
library. Exit status: 0 success, 2 bad input (one line on stderr naming the file, the
field and what was expected; no traceback), 1 anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from hyperpipe.cli import args as ca
from hyperpipe.cli.commands import cmd_export, cmd_list, cmd_run
from hyperpipe.cli.whatif import (
    add_backend_options,
    add_whatif_options,
    cmd_whatif,
    open_backend,
    run_backend,
)
from hyperpipe.core.errors import BadInput, InfeasiblePlan, Stopped

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        flag, sep, rest = message.partition(": expected ")
        if sep and flag.startswith("argument "):        # from a checked type (cli_args)
            raise BadInput(f"{self.prog} {flag[len('argument '):]}", rest, has_got=False)
        raise BadInput(f"{self.prog}", message.replace("\n", " "), has_got=False)


def _command(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, description=help_text)


def _workload_args(p: argparse.ArgumentParser) -> None:
    """The cluster, model and batch that search and whatif plan for."""
    p.add_argument("--cluster", type=ca.path, required=True,
                   help="built-in cluster name or YAML/JSON file")
    p.add_argument("--model", type=ca.path, required=True, help="preset name or YAML/JSON file")
    p.add_argument("--global-batch", type=ca.BATCH, required=True, help="samples per iteration")


def _memory_args(p: argparse.ArgumentParser, verb: str) -> None:
    """Activation recompute, sequence parallelism and the distributed optimizer."""
    p.add_argument("--recompute", choices=["none", "selective", "full"],
                   help=f"{verb} activation recompute on every stage")
    p.add_argument("--sequence-parallel", action="store_const", const=True,
                   help=f"{verb} sequence parallelism on tensor-parallel stages")
    p.add_argument("--distributed-optimizer", action="store_const", const=True,
                   help=f"{verb} the optimizer state sharded over data-parallel replicas")


def _memory_options(args: argparse.Namespace) -> dict:
    return {"recompute": args.recompute, "sequence_parallel": args.sequence_parallel,
            "distributed_optimizer": args.distributed_optimizer}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hyperpipe", description="Plan, simulate and run pipeline-parallel "
                     "training on heterogeneous GPU clusters.")
    from hyperpipe import __version__
    parser.add_argument("--version", action="version", version=f"hyperpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = _command(sub, "schedule", "print or draw a pipeline schedule")
    p.add_argument("--kind", required=True, help="schedule kind, e.g. 1f1b")
    p.add_argument("--devices", type=ca.PIPELINE_DEVICES, help="pipeline ranks p")
    p.add_argument("--microbatches", type=ca.MICROBATCHES, help="micro-batches m")
    p.add_argument("--plan", type=ca.path,
                   help="with --kind synth: the plan to synthesise a schedule for")
    p.add_argument("--chunks", type=ca.CHUNKS, help="stages per device v (interleaved; the "
                   "V kinds zb-v and dualpipe-v take 2, the default for them)")
    p.add_argument("--format", choices=["text", "torch-csv", "png"], default="text")
    p.add_argument("--out", type=ca.path, help="output file (required for png; stdout otherwise)")
    p.set_defaults(func=cmd_schedule)

    p = _command(sub, "simulate", "simulate one plan: --plan P, or --cluster C --model M "
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
    _memory_args(p, "plan options:")
    p.add_argument("--profile", type=ca.path, help="calibration profile JSON")
    p.add_argument("--allow-profile-mismatch", action="store_true", help="use --profile even "
                   "if it was measured on another model or lacks a device type")
    p.add_argument("--no-overlap", action="store_true",
                   help="all-reduce gradients after the backward, not during it")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.add_argument("--timeline", type=ca.path, help="write a timeline here (.png, .svg, .pdf)")
    p.add_argument("--window", metavar="START:END", help="with --timeline: draw only this "
                   "time window, in seconds from the iteration's start (e.g. 0:0.002)")
    p.add_argument("--microbatches", type=ca.BATCH, metavar="K", help="with --timeline: "
                   "draw only the first K micro-batches")
    p.add_argument("--trace", type=ca.path,
                   help="write the predicted trace (hyperpipe.trace/1 JSON)")
    p.add_argument("--chrome", type=ca.path, help="write the trace as Chrome trace JSON (Perfetto)")
    p.set_defaults(func=cmd_simulate)

    p = _command(sub, "demo", "the main job: search, simulate, run for real, calibrate, "
                 "report (built-in defaults)")
    p.add_argument("--out", type=ca.path, default="hyperpipe-demo", help="output directory")
    p.add_argument("--steps", type=ca.STEPS, default=6, help="training steps per real run")
    p.add_argument("--emulation-scale", type=ca.EMULATION_SCALE, default=None,
                   help="stretch every emulated device by this factor (>= 1; default: "
                   "enough that ranks sharing this machine's cores do not slow each "
                   "other, 3 for 4 ranks on 2 cores)")
    p.add_argument("--workers", type=ca.WORKERS, default=1, help="search worker processes")
    p.set_defaults(func=cmd_demo)

    p = _command(sub, "calibrate", "fit the cost model to measured traces, or profile each "
                 "layer kind here (--measure)")
    p.add_argument("--trace", type=ca.path, nargs="+", default=[],
                   help="measured trace files (hyperpipe run)")
    p.add_argument("--base", type=ca.path,
                   help="with --trace: a profile from --measure to scale to the "
                   "traces (keeps its per-layer shape)")
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
    p.add_argument("--micro-batches", default="1,2,4", help="with --measure: sizes to time")
    p.add_argument("--progress", action="store_true", help="progress bar on stderr even "
                   "when it is not a terminal")
    p.add_argument("--out", type=ca.path, required=True, help="profile JSON to write")
    p.set_defaults(func=cmd_calibrate)

    p = _command(sub, "run", "run a plan for real: one local process per device, or one "
                 "rank under torchrun")
    p.add_argument("--plan", type=ca.path, required=True, metavar="P",
                   help="plan JSON (e.g. from search --out)")
    p.add_argument("--steps", type=ca.STEPS, default=3, metavar="N", help="training steps in all")
    p.add_argument("--trace", type=ca.path, metavar="T",
                   help="write the measured trace (hyperpipe.trace/1 JSON)")
    p.add_argument("--chrome", type=ca.path, metavar="T",
                   help="write the trace as Chrome trace JSON (Perfetto)")
    p.add_argument("--checkpoint", type=ca.path, metavar="DIR", help="checkpoint directory")
    p.add_argument("--checkpoint-every", type=ca.EVERY, default=0, metavar="N",
                   help="checkpoint every N steps (and after the last)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoints of "
                   "another run in --checkpoint DIR (refused without it)")
    p.add_argument("--no-memory-check", action="store_true", help="launch even when the "
                   "predicted memory does not fit this host or GPU")
    p.add_argument("--progress", action="store_true", help="progress bars on stderr even "
                   "when it is not a terminal")
    p.add_argument("--inject-fault", metavar="RANK:STEP",
                   help="make that rank fail at the start of that step (RANK:STEP:stop: "
                   "SIGSTOP it instead, a drill of the watchdog)")
    p.add_argument("--no-emulate", action="store_true",
                   help="run every device at this machine's native speed")
    p.add_argument("--emulation-scale", type=ca.EMULATION_SCALE, default=1.0, metavar="S",
                   help="stretch every device's compute by this factor too")
    p.add_argument("--threads", type=ca.THREADS, default=1, metavar="N",
                   help="CPU threads per rank")
    p.add_argument("--seed", type=ca.SEED, default=0, metavar="S", help="weights and data seed")
    p.add_argument("--lr", type=ca.LEARNING_RATE, default=1e-3, help="AdamW learning rate")
    p.add_argument("--timeout", type=ca.TIMEOUT_S, default=30.0,
                   help="seconds any wait may block before the run fails")
    p.set_defaults(func=cmd_run)

    p = _command(sub, "search", "find the best plans for a model on a cluster; any option "
                 "given fixes that dimension")
    _workload_args(p)
    p.add_argument("--micro-batch", type=ca.BATCH, help="fix the micro-batch size")
    p.add_argument("--schedule", help="fix the schedule kind (e.g. 1f1b, zb-h1)")
    p.add_argument("--chunks", type=ca.CHUNKS, help="fix the chunks per device (interleaved)")
    p.add_argument("--pp", type=ca.PIPELINE_DEVICES, help="fix the devices per pipeline")
    p.add_argument("--dp", type=ca.REPLICAS, help="fix the number of pipelines (replicas)")
    p.add_argument("--tp", type=ca.TENSOR_PARALLEL,
                   help="fix the tensor-parallel degree of every stage")
    _memory_args(p, "fix")
    p.add_argument("--objective", choices=["throughput", "cost"], default="throughput")
    p.add_argument("--top", type=ca.TOP, default=5, help="plans to list")
    p.add_argument("--workers", type=ca.WORKERS, default=1, help="worker processes")
    p.add_argument("--profile", type=ca.path, help="calibration profile JSON")
    p.add_argument("--allow-profile-mismatch", action="store_true", help="use --profile even "
                   "if it was measured on another model or lacks a device type")
    p.add_argument("--out", type=ca.path, help="write the best plan here (for simulate/run --plan)")
    p.add_argument("--progress", action="store_true", help="progress bar on stderr even "
                   "when it is not a terminal")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_backend_options(p)
    p.set_defaults(func=cmd_search)

    p = _command(sub, "whatif", "sweep a cluster or model parameter: the best plan per "
                 "variant, as a table and a plot")
    _workload_args(p)
    add_whatif_options(p)
    p.set_defaults(func=cmd_whatif)

    p = _command(sub, "list", "the built-in clusters, models, device types or schedule "
                 "kinds with their key figures")
    p.add_argument("what", choices=["clusters", "models", "devices", "schedules"])
    p.set_defaults(func=cmd_list)

    p = _command(sub, "export", "write what torchtitan, Megatron-LM or DeepSpeed needs to run "
                 "a plan's partition, and what it cannot express")
    p.add_argument("--plan", required=True, metavar="P", help="plan JSON")
    p.add_argument("--to", required=True, choices=["torchtitan", "megatron", "deepspeed"])
    p.add_argument("--out", help="write here instead of stdout")
    p.set_defaults(func=cmd_export)

    return parser


def cmd_schedule(args: argparse.Namespace) -> int:
    from hyperpipe.plan.generators import generate
    from hyperpipe.plan.schedule import validate
    if args.plan or args.kind == "synth":
        if not args.plan:
            raise BadInput("--kind synth", "--plan P (synth builds a schedule for a plan)",
                           has_got=False)
        from hyperpipe.cli.schedule_plan import schedule_from_plan
        return schedule_from_plan(args)
    missing = [f for f in ("devices", "microbatches") if getattr(args, f) is None]
    if missing:
        raise BadInput("schedule", f"--{missing[0]} (or --kind synth --plan P)", has_got=False)
    sched = generate(args.kind, args.devices, args.microbatches, args.chunks)
    validate(sched)
    if args.format == "png":
        if not args.out:
            raise BadInput("--out", "an output .png, .svg or .pdf path with --format png",
                           has_got=False)
        from hyperpipe.plan.schedule_plot import draw_schedule
        draw_schedule(sched, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
        return EXIT_OK
    text = sched.to_text() if args.format == "text" else sched.to_torch_csv()
    if args.out:
        from hyperpipe.core.files import write_atomic
        write_atomic(args.out, text)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    from hyperpipe.plan.plan import load_plan
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import SimOptions, simulate
    from hyperpipe.sim.summary import describe
    shape = {"--pp": args.pp, "--micro-batch": args.micro_batch,
             "--global-batch": args.global_batch}
    optional = {"--dp": args.dp, "--tp": args.tp, "--schedule": args.schedule,
                "--chunks": args.chunks, "--recompute": args.recompute,
                "--sequence-parallel": args.sequence_parallel,
                "--distributed-optimizer": args.distributed_optimizer}
    if args.plan:
        given = [k for k, v in {**shape, **optional}.items() if v is not None]
        if given:
            raise BadInput("simulate", f"either --plan or plan options, not both (got --plan "
                           f"and {' '.join(given)})", has_got=False)
        plan = load_plan(args.plan)
        model = load_model(args.model, where="--model") if args.model else plan.load_model()
        cluster = load_cluster(args.cluster) if args.cluster else plan.load_cluster()
    else:
        missing = [k for k in ("--cluster", "--model") if getattr(args, k[2:]) is None]
        missing += [k for k, v in shape.items() if v is None]
        if missing:
            raise BadInput("simulate", f"--plan P, or --cluster C --model M --pp N "
                           f"--micro-batch B --global-batch G (missing {' '.join(missing)})",
                           has_got=False)
        from hyperpipe.plan.generators import default_chunks
        from hyperpipe.search.baselines import uniform_plan
        model, cluster = load_model(args.model, where="--model"), load_cluster(args.cluster)
        plan = uniform_plan(model, cluster, pp=args.pp, dp=args.dp or 1, tp=args.tp or 1,
                            micro_batch=args.micro_batch, global_batch=args.global_batch,
                            schedule=args.schedule or "1f1b",
                            chunks=args.chunks or default_chunks(args.schedule or "1f1b"))
        if args.sequence_parallel and (args.tp or 1) == 1:
            raise BadInput("--sequence-parallel", "tensor parallelism (--tp above 1)",
                           "--tp 1")
        plan = plan.with_memory(**_memory_options(args))
    window = None
    if args.timeline:
        from hyperpipe.core.files import figure_format
        from hyperpipe.sim.timeline import parse_window
        figure_format(args.timeline)
        window = parse_window(args.window) if args.window else None
    elif args.window or args.microbatches:
        raise BadInput("--window/--microbatches", "--timeline FILE to draw", has_got=False)
    cost = CostModel(model, cluster, _load_profile(args, model, cluster, plan.devices))
    result = simulate(plan, cost, SimOptions(overlap_dp_allreduce=not args.no_overlap))
    if args.trace:
        result.trace.save(args.trace)
    if args.chrome:
        result.trace.save_chrome(args.chrome)
    if args.timeline:
        from hyperpipe.sim.timeline import plot_timelines, replicas_shown, zoom_note
        plot_timelines([result.trace], [f"simulated: {model.name} on {cluster.name}, "
                                        f"{plan.schedule}; {replicas_shown(plan, result.trace)}"],
                       args.timeline, window=window, microbatches=args.microbatches)
    if args.json:
        print_json(result.metrics.to_dict())
    else:
        sys.stdout.write(describe(result, plan, cost))
        zoom = zoom_note(plan, window, args.microbatches) if args.timeline else ""
        for what, path in (("trace", args.trace), ("chrome trace", args.chrome),
                           ("timeline", args.timeline and f"{args.timeline}{zoom}")):
            if path:
                print(f"{what}: {path}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from hyperpipe.cli.demo import DemoConfig, run_demo
    if args.steps < 2:
        raise BadInput("--steps", "at least 2 (the first step is warm-up)", args.steps)
    from hyperpipe.core.files import probe_folder
    if os.path.lexists(args.out) and not os.path.isdir(args.out):
        raise BadInput(f"--out {args.out}", "a folder (or a new path)", has_got=False)
    try:
        probe_folder(Path(args.out))      # before minutes of work, not after
    except BadInput as exc:
        raise BadInput(f"--out {exc.where}", exc.expected, has_got=False) from None
    run_demo(DemoConfig(out_dir=Path(args.out), steps=args.steps,
                        emulation_scale=args.emulation_scale, workers=args.workers))
    return EXIT_OK


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.measure == bool(args.trace):
        raise BadInput("calibrate", "either --trace FILE... or --measure --model M", has_got=False)
    from hyperpipe.core.files import check_writable
    check_writable(args.out)              # before the fit or the measurement
    if args.trace:
        from hyperpipe.plan.profile import load_profile
        from hyperpipe.plan.trace import load_trace
        from hyperpipe.sim.calibrate import calibrate
        base = load_profile(args.base) if args.base else None
        profile = calibrate([load_trace(t) for t in args.trace], sources=args.trace, base=base)
    else:
        if not args.model:
            raise BadInput("--model", "a model to profile with --measure", has_got=False)
        sizes = _int_list(args.micro_batches, "--micro-batches")
        from hyperpipe.exec.profiler import measure_profile
        profile = measure_profile(args.model, args.cluster, micro_batches=sizes,
                                  emulate=not args.no_emulate,
                                  emulation_scale=args.emulation_scale,
                                  progress=True if args.progress else None,
                                  log=lambda line: print(line, flush=True))
    profile.save(args.out)
    fits = profile.compute
    worst = max((f.rel_rmse for f in fits.values()), default=0.0)
    print(f"wrote {args.out}: {len(fits)} compute fits (worst relative RMS residual "
          f"{worst:.1%}), {len(profile.links)} link classes, "
          f"emulated={profile.emulated}")
    return EXIT_OK


def cmd_search(args: argparse.Namespace) -> int:
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    from hyperpipe.search.report import format_search
    from hyperpipe.search.search import SearchConstraints, search
    from hyperpipe.sim.costmodel import CostModel
    model, cluster = load_model(args.model, where="--model"), load_cluster(args.cluster)
    profile = _load_profile(args, model, cluster)
    c = SearchConstraints(global_batch=args.global_batch, micro_batch=args.micro_batch,
                          schedule=args.schedule, pp=args.pp, dp=args.dp, tp=args.tp,
                          chunks=args.chunks, objective=args.objective,
                          **_memory_options(args))
    with open_backend(args) as backend:
        args._backend = backend
        result = search(model, cluster, c, profile=profile, top=args.top,
                        workers=args.workers, progress=args.progress,
                        backend=run_backend(args))
    if args.out:
        result.best.plan.save(args.out)
    if args.json:
        print_json(result.to_dict())
    else:
        sys.stdout.write(format_search(result, CostModel(model, cluster, profile),
                                       objective=args.objective))
        if args.out:
            print(f"best plan written to {args.out}")
    return EXIT_OK


def _load_profile(args: argparse.Namespace, model, cluster, devices=None):
    """--profile, checked to belong to this model and cover the device types in use (of
    `devices`, or of the whole cluster)."""
    if args.profile is None:
        return None
    from hyperpipe.plan.profile import check_profile, load_profile
    profile = load_profile(args.profile)
    check_profile(profile, model, cluster, where=f"--profile {args.profile}",
                  allow_mismatch=args.allow_profile_mismatch, devices=devices)
    return profile


def _int_list(text: str, where: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",")) if len(text) <= 400 else ()
    except ValueError:
        values = ()
    if not values or min(values) < 1 or max(values) > ca.limits.MAX_GLOBAL_BATCH \
            or len(values) > 64:
        raise BadInput(where, "a comma-separated list of at most 64 integers from 1 to "
                       f"{ca.limits.MAX_GLOBAL_BATCH}", text)
    return values


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=1, default=_json_default)
    sys.stdout.write("\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


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
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
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
