"""`hyperpipe run`: run a plan for real, one local process per device or one rank under
torchrun. Before launch rank 0 predicts the step and checks that memory fits
(`hyperpipe.cli.run_console`); a failed rank exits 1 naming it, a stop signal exits
128 + signal naming the checkpoint to resume from.
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass

from hyperpipe.cli import args as ca
from hyperpipe.cli.flags import add_progress, command
from hyperpipe.cli.output import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_OK
from hyperpipe.core import stopping
from hyperpipe.core.errors import BadInput, Stopped
from hyperpipe.core.files import check_outputs


@dataclass(frozen=True)
class RunCommandOptions:
    plan: str
    steps: int
    trace: str | None
    chrome: str | None
    checkpoint: str | None
    checkpoint_every: int
    resume: bool
    overwrite: bool
    no_memory_check: bool
    progress: bool
    inject_fault: str | None      # RANK:STEP[:stop] as typed
    no_emulate: bool
    emulation_scale: float
    threads: int
    seed: int
    lr: float
    timeout_s: float

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> RunCommandOptions:
        return cls(plan=ns.plan, steps=ns.steps, trace=ns.trace, chrome=ns.chrome,
                   checkpoint=ns.checkpoint, checkpoint_every=ns.checkpoint_every,
                   resume=ns.resume, overwrite=ns.overwrite,
                   no_memory_check=ns.no_memory_check, progress=ns.progress,
                   inject_fault=ns.inject_fault, no_emulate=ns.no_emulate,
                   emulation_scale=ns.emulation_scale, threads=ns.threads, seed=ns.seed,
                   lr=ns.lr, timeout_s=ns.timeout)


def add_parser(sub) -> None:
    p = command(sub, "run", "run a plan for real: one local process per device, or one "
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
    add_progress(p, "progress bars on stderr")
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
    p.set_defaults(options=RunCommandOptions.from_namespace, run=run)


def parse_fault(text: str | None, steps: int, first_step: int = 0,
                resumed_from: str = "") -> tuple | None:
    """--inject-fault RANK:STEP[:stop] -> (rank, step[, kind]); None without it. STEP
    must be one the run will run: from `first_step` (a resumed run's first, after the
    checkpoint `resumed_from` names) to below `steps`; BadInput otherwise."""
    if text is None:
        return None
    rank, sep, step = text.partition(":")
    step, _, kind = step.partition(":")
    if not (sep and rank.isascii() and rank.isdigit() and step.isascii() and step.isdigit()
            and kind in ("", "raise", "stop")):
        raise BadInput("--inject-fault", "RANK:STEP or RANK:STEP:stop, e.g. 1:3", text)
    fault = (int(rank), int(step)) if len(text) <= 40 else (0, 0)
    fault += (kind,) if kind else ()
    if len(text) > 40 or fault[1] >= steps:
        raise BadInput("--inject-fault", f"RANK:STEP with STEP below --steps ({steps})", text)
    if fault[1] < first_step:
        raise BadInput("--inject-fault", f"RANK:STEP with STEP from {first_step}, the first "
                       f"step this run will run ({resumed_from} holds steps before it)", text)
    return fault


def _resumed_from(opts: RunCommandOptions) -> tuple[int, str]:
    """(first step a --resume run will run, what holds the steps before it): the last
    complete checkpoint's step in --checkpoint (which `checkpoint.check_directory` then
    checks belongs to this run), else (0, "")."""
    if not (opts.resume and opts.checkpoint and opts.inject_fault is not None):
        return 0, ""
    from hyperpipe.exec import checkpoint
    done = checkpoint.complete_steps(opts.checkpoint)
    if not done or done[-1] >= opts.steps:     # nothing to run: the resume check says so
        return 0, ""
    return done[-1], f"the checkpoint in {opts.checkpoint}"


_BAD_INPUT = "BadInput: "        # how a rank's report names a BadInput (exec.launch)


def run(opts: RunCommandOptions) -> int:
    fault = parse_fault(opts.inject_fault, opts.steps, *_resumed_from(opts))
    check_outputs([("--plan", opts.plan)], [("--trace", opts.trace),
                   ("--chrome", opts.chrome)], [("--checkpoint", opts.checkpoint)])
    from hyperpipe.exec import RunFailed, RunOptions, run_plan
    from hyperpipe.exec.job import prepare
    from hyperpipe.exec.launch import torchrun_env
    from hyperpipe.plan.plan import load_plan
    options = RunOptions(
        steps=opts.steps, seed=opts.seed, trace_path=opts.trace, chrome_path=opts.chrome,
        checkpoint_dir=opts.checkpoint, checkpoint_every=opts.checkpoint_every,
        resume=opts.resume, overwrite=opts.overwrite, inject_fault=fault,
        emulate=not opts.no_emulate, emulation_scale=opts.emulation_scale,
        threads_per_rank=opts.threads, timeout_s=opts.timeout_s, lr=opts.lr)
    env = torchrun_env()
    plan = load_plan(opts.plan)
    # every check of bad input (the outputs, the checkpoint folder and whose it is, the
    # plan) before anything is printed: a refusal comes alone, not after the memory line
    # (run_plan takes them from here)
    prepared = prepare(plan, options)
    monitor = None
    if env is None or env[0] == 0:
        monitor = _console(plan, opts)
    try:
        result = run_plan(plan, options, monitor, prepared=prepared)
    except RunFailed as exc:
        if exc.cause.startswith(_BAD_INPUT):     # a rank read a bad file (a rank file)
            print(f"hyperpipe: error: {exc.cause[len(_BAD_INPUT):]} (read by rank "
                  f"{exc.rank} on {exc.device})", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"hyperpipe: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        print(f"hyperpipe: stopped by {stopping.signal_name(signum)}: "
              f"{_stopped_note(len(plan.devices), opts.checkpoint)}", file=sys.stderr)
        return 128 + signum
    if env is not None and env[0] != 0:
        return EXIT_OK                       # under torchrun, rank 0 reports
    speed = "emulated (compute stretched to each device's speed)" if result.emulated \
        else "native speed"
    print(f"ran {len(result.losses)} step(s) (steps {result.first_step} to "
          f"{result.first_step + len(result.losses) - 1}) on {len(plan.devices)} rank(s), "
          f"{speed}")
    for what, path in (("trace", opts.trace), ("chrome trace", opts.chrome)):
        if path:
            print(f"{what}: {path}")
    if not opts.trace:
        print("(no trace written: add --trace T to keep the measured trace)")
    return EXIT_OK


def _console(plan, opts: RunCommandOptions):
    """Rank 0's console: the prediction, the memory check (unless turned off) and the
    monitor that prints live step lines."""
    from hyperpipe.cli import run_console as rc
    pred = rc.predict(plan)
    if not opts.no_memory_check:
        print(rc.check_memory(plan, pred, opts.plan, gpus=rc.local_gpus_free(len(
            plan.devices)), host_bytes=rc.host_available_bytes()))
    return rc.ConsoleMonitor(pred, len(plan.devices), progress=True if opts.progress else None)


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
