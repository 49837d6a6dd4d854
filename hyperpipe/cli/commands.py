"""The `run`, `list` and `export` subcommands of the `hyperpipe` command (cli.py parses
the flags; see there for the exit statuses)."""

from __future__ import annotations

import argparse
import signal
import sys

from hyperpipe.core.errors import BadInput, Stopped

EXIT_OK, EXIT_ERROR = 0, 1


def cmd_run(args: argparse.Namespace) -> int:
    fault = None
    if args.inject_fault is not None:
        rank, sep, step = args.inject_fault.partition(":")
        step, _, kind = step.partition(":")
        if not (sep and rank.isdigit() and step.isdigit() and kind in ("", "raise", "stop")):
            raise BadInput("--inject-fault", "RANK:STEP or RANK:STEP:stop, e.g. 1:3",
                           args.inject_fault)
        fault = (int(rank), int(step)) if len(args.inject_fault) <= 40 else (0, 0)
        fault += (kind,) if kind else ()
        if len(args.inject_fault) > 40 or fault[1] >= args.steps:
            raise BadInput("--inject-fault", f"RANK:STEP with STEP below --steps "
                           f"({args.steps})", args.inject_fault)
    from hyperpipe.exec import RunFailed, RunOptions, run_plan
    from hyperpipe.exec.launch import torchrun_env
    from hyperpipe.plan.plan import load_plan
    options = RunOptions(
        steps=args.steps, seed=args.seed, trace_path=args.trace, chrome_path=args.chrome,
        checkpoint_dir=args.checkpoint, checkpoint_every=args.checkpoint_every,
        resume=args.resume, overwrite=args.overwrite, inject_fault=fault,
        emulate=not args.no_emulate, emulation_scale=args.emulation_scale,
        threads_per_rank=args.threads, timeout_s=args.timeout, lr=args.lr)
    env = torchrun_env()
    plan = load_plan(args.plan)
    monitor = None
    if env is None or env[0] == 0:
        from hyperpipe.cli import run_console as rc
        pred = rc.predict(plan)
        if not args.no_memory_check:
            print(rc.check_memory(plan, pred, args.plan, gpus=rc.local_gpus_free(len(
                plan.devices)), host_bytes=rc.host_available_bytes()))
        monitor = rc.ConsoleMonitor(pred, len(plan.devices),
                                    progress=True if args.progress else None)
    try:
        result = run_plan(plan, options, monitor)
    except RunFailed as exc:
        print(f"hyperpipe: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        print(f"hyperpipe: stopped by {signal.Signals(signum).name}: "
              f"{_stopped_note(len(plan.devices), args.checkpoint)}", file=sys.stderr)
        return 128 + signum
    if env is not None and env[0] != 0:
        return EXIT_OK                       # under torchrun, rank 0 reports
    speed = "emulated (compute stretched to each device's speed)" if result.emulated \
        else "native speed"
    print(f"ran {len(result.losses)} step(s) (steps {result.first_step} to "
          f"{result.first_step + len(result.losses) - 1}) on {len(plan.devices)} rank(s), "
          f"{speed}")
    for what, path in (("trace", args.trace), ("chrome trace", args.chrome)):
        if path:
            print(f"{what}: {path}")
    if not args.trace:
        print("(no trace written: add --trace T to keep the measured trace)")
    return EXIT_OK


def _stopped_note(world: int, checkpoint_dir: str | None) -> str:
    """What a stopped run leaves: every rank stopped, and the checkpoint to resume from
    (only complete checkpoints count; a half-written one is ignored by --resume)."""
    note = f"all {world} rank(s) stopped"
    if checkpoint_dir is None:
        return note + "; no checkpoint (add --checkpoint DIR to keep progress)"
    from hyperpipe.exec.checkpoint import complete_steps, steps_done
    steps = complete_steps(checkpoint_dir)
    if not steps:
        return note + f"; no complete checkpoint in {checkpoint_dir}"
    return note + (f"; last complete checkpoint in {checkpoint_dir} holds "
                   f"{steps_done(steps[-1])} (continue with --resume)")


def cmd_list(args: argparse.Namespace) -> int:
    from hyperpipe.cli.listing import listing
    sys.stdout.write(listing(args.what))
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from hyperpipe.frameworks.export import export
    from hyperpipe.plan.plan import load_plan
    text = export(load_plan(args.plan), args.to)
    if args.out:
        from hyperpipe.core.files import write_atomic
        write_atomic(args.out, text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK
