"""The options and command of `hyperpipe whatif` beyond a plain sweep: the backend the
work runs on (shared with `hyperpipe search`), stragglers (today's plan kept against
re-planning) and failures (`--failures`: goodput against the checkpoint interval).
The logic lives in `hyperpipe.search` (`whatif`, `stragglers`, `failures`, `backends`).
"""

from __future__ import annotations

import argparse
import sys

from hyperpipe.cli import args as ca
from hyperpipe.core.errors import BadInput


def add_backend_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="where the work runs: local processes (--workers) or Ray "
                   "(pip install -e '.[ray]')")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="with --backend ray: join this Ray cluster (default: start one here)")


def add_whatif_options(p: argparse.ArgumentParser) -> None:
    """Every option of `hyperpipe whatif` but the workload (cluster, model, batch)."""
    p.add_argument("--vary", action="append", default=[],
                   help="KEY=V1,V2,... e.g. 'inter_node.bandwidth=10 Gbit/s,100 Gbit/s', "
                   "'nodes.v100.count=0,4,8', 'nodes.v100.device=V100-32GB,A100-80GB', "
                   "'model=gpt3-1.3b,gpt3-2.7b', 'global_batch=32,64' (repeat for a grid)")
    p.add_argument("--pool", action="store_true", help="which subset of the cluster's "
                   "device types to use: every subset is a variant (with prices: cost too)")
    p.add_argument("--micro-batch", type=ca.BATCH, help="fix the micro-batch size")
    p.add_argument("--schedule", help="fix the schedule kind")
    p.add_argument("--objective", choices=["throughput", "cost"], default="throughput")
    p.add_argument("--workers", type=ca.WORKERS, default=1, help="worker processes")
    p.add_argument("--profile", type=ca.path, help="calibration profile JSON")
    p.add_argument("--allow-profile-mismatch", action="store_true", help="use --profile even "
                   "if it was measured on another model or lacks a device type")
    p.add_argument("--plot", type=ca.path, help="write a plot of the sweep here (.png, .svg, "
                   ".pdf)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--progress", action="store_true", help="a progress bar over the "
                   "variants on stderr even when it is not a terminal")
    add_backend_options(p)
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


def open_backend(args: argparse.Namespace):
    """The backend `--backend`/`--ray-address`/`--workers` ask for (a context manager)."""
    from hyperpipe.search.backends import make_backend
    return make_backend(args.backend, workers=args.workers, address=args.ray_address)


def run_backend(args: argparse.Namespace):
    """The entered backend to hand to the library: None for local (its `workers`
    processes are the search's own pool), the Ray backend otherwise."""
    return None if args.backend == "local" else args._backend


def cmd_whatif(args: argparse.Namespace) -> int:
    from hyperpipe.cli.main import print_json
    from hyperpipe.plan.plan import load_plan
    ca.check_vary_size(args.vary)
    plan = load_plan(args.plan) if args.plan else None
    if args.failures:
        if args.vary or args.pool:
            raise BadInput("whatif --failures", "no --vary/--pool with it (one cluster)",
                           has_got=False)
    elif not args.vary and not args.pool:
        raise BadInput("whatif", "at least one --vary KEY=V1,V2,..., --pool or --failures",
                       has_got=False)
    with open_backend(args) as backend:
        args._backend = backend
        common = dict(global_batch=args.global_batch, micro_batch=args.micro_batch,
                      schedule=args.schedule, objective=args.objective,
                      profile=_whatif_profile(args), workers=args.workers,
                      backend=run_backend(args), plan=plan)
        if args.failures:
            return _failures(args, common, print_json)
        from hyperpipe.whatif.stragglers import format_stragglers, plot_stragglers
        from hyperpipe.whatif.sweep import format_whatif, plot_whatif, whatif
        result = whatif(args.model, args.cluster, vary=args.vary, pool=args.pool,
                        progress=True if args.progress else None, **common)
    straggler = result.kind == "stragglers"
    if args.plot:
        (plot_stragglers if straggler else plot_whatif)(result, args.plot)
    if args.json:
        print_json(result.to_dict())
    else:
        sys.stdout.write((format_stragglers if straggler else format_whatif)(result))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _failures(args: argparse.Namespace, common: dict, print_json) -> int:
    from hyperpipe.core.units import parse_quantity
    from hyperpipe.whatif.failures import failure_whatif, format_failures, plot_failures

    def quantity(flag: str, dimension: str):
        value = getattr(args, flag[2:].replace("-", "_"))
        return None if value is None else parse_quantity(value, dimension, where=flag,
                                                         allow_zero=False)
    restart = quantity("--restart-time", "time")
    if restart is None:
        raise BadInput("--restart-time", "the time from a failure to training again with "
                       "--failures (e.g. '10 min')", has_got=False)
    intervals = tuple(parse_quantity(v, "time", where="--checkpoint-interval",
                                     allow_zero=False) for v in args.checkpoint_interval)
    study = failure_whatif(args.model, args.cluster, restart_s=restart,
                           storage_bandwidth_bytes_per_s=quantity("--storage-bandwidth",
                                                                  "bandwidth"),
                           checkpoint_bytes=quantity("--checkpoint-size", "bytes"),
                           write_s=quantity("--checkpoint-write-time", "time"),
                           mtbf_s=quantity("--mtbf", "time"), intervals_s=intervals, **common)
    if args.plot:
        plot_failures(study, args.plot)
    if args.json:
        print_json(study.to_dict())
    else:
        sys.stdout.write(format_failures(study))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _whatif_profile(args: argparse.Namespace):
    """--profile, checked against --model and --cluster (cli._load_profile)."""
    if args.profile is None:
        return None
    from hyperpipe.cli.main import _load_profile
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    return _load_profile(args, load_model(args.model, where="--model"),
                         load_cluster(args.cluster))
