"""`hyperpipe search`: the best plans for a model on a cluster, every option given
fixing that dimension; prints the ranked plans with baselines and peers (text or JSON)
and can write the best plan for `simulate`/`run --plan`.

`--start PLAN` searches from a plan the user has (an imported framework job): its model,
cluster, global batch and stack (with its runtime overrides) are kept unless given as
options, the plan is simulated on the search's stack beside the search's own as the
baseline ``start``, and, within the options given, the pick is never slower than it:
when the start keeps every option given and no plan of the search beats it, the start
is the pick (named as such, and then no baseline of its own).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from hyperpipe.cli import args as ca
from hyperpipe.cli.flags import (
    BackendOptions,
    MemoryOptions,
    ProfileOptions,
    Workload,
    add_backend,
    add_json,
    add_memory,
    add_profile,
    add_progress,
    add_sharding,
    add_stack,
    add_workload,
    as_flags,
    command,
    opened_backend,
)
from hyperpipe.cli.inputs import load_checked_profile
from hyperpipe.cli.output import EXIT_OK, print_json
from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import check_outputs


@dataclass(frozen=True)
class SearchOptions:
    workload: Workload
    micro_batch: int | None
    schedule: str | None
    chunks: int | None
    pp: int | None
    dp: int | None
    tp: int | None
    memory: MemoryOptions
    objective: str
    top: int
    workers: int
    profile: ProfileOptions
    out: str | None               # write the best plan here
    progress: bool
    json: bool
    backend: BackendOptions
    stack: str | None = None      # the stack every plan runs on (None: megatron-lm)
    start: str | None = None      # a plan to search from (its model, cluster, batch, stack)
    zero: int | None = None       # ZeRO stage fixed
    cp: int | None = None         # context-parallel degree fixed
    ep: int | None = None         # expert-parallel degree fixed
    seq_len: int | None = None    # the model's sequence length overridden

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> SearchOptions:
        return cls(workload=Workload.from_namespace(ns), micro_batch=ns.micro_batch,
                   schedule=ns.schedule, chunks=ns.chunks, pp=ns.pp, dp=ns.dp, tp=ns.tp,
                   memory=MemoryOptions.from_namespace(ns), objective=ns.objective,
                   top=ns.top, workers=ns.workers, profile=ProfileOptions.from_namespace(ns),
                   out=ns.out, progress=ns.progress, json=ns.json,
                   backend=BackendOptions.from_namespace(ns), stack=ns.stack,
                   start=ns.start, zero=ns.zero, cp=ns.cp, ep=ns.ep, seq_len=ns.seq_len)


def add_parser(sub) -> None:
    p = command(sub, "search", "find the best plans for a model on a cluster; any option "
                "given fixes that dimension")
    add_workload(p, required=False)
    p.add_argument("--start", type=ca.path, metavar="PLAN",
                   help="search from this plan (e.g. from `hyperpipe import`): its model, "
                   "cluster, global batch and stack unless given; it is the baseline "
                   "'start', and within the options given the pick is never slower "
                   "than it")
    p.add_argument("--micro-batch", type=ca.BATCH, help="fix the micro-batch size")
    p.add_argument("--schedule", help="fix the schedule kind (e.g. 1f1b, zb-h1)")
    p.add_argument("--chunks", type=ca.CHUNKS, help="fix the chunks per device (interleaved)")
    p.add_argument("--pp", type=ca.PIPELINE_DEVICES, help="fix the devices per pipeline")
    p.add_argument("--dp", type=ca.REPLICAS, help="fix the number of pipelines (replicas)")
    p.add_argument("--tp", type=ca.TENSOR_PARALLEL,
                   help="fix the tensor-parallel degree of every stage")
    add_memory(p, "fix")
    add_sharding(p, "fix")
    p.add_argument("--seq-len", type=ca.count(1, limits.MAX_MODEL_DIM),
                   help="the model's sequence length (tokens per sample), overriding the "
                   "preset's or file's")
    add_stack(p, "every plan")
    p.add_argument("--objective", choices=["throughput", "cost"], default="throughput")
    p.add_argument("--top", type=ca.TOP, default=5, help="plans to list")
    p.add_argument("--workers", type=ca.WORKERS, default=1, help="worker processes")
    add_profile(p)
    p.add_argument("--out", type=ca.path, help="write the best plan here (for simulate/run --plan)")
    add_progress(p)
    add_json(p)
    add_backend(p)
    p.set_defaults(options=SearchOptions.from_namespace, run=run)


def run(opts: SearchOptions) -> int:

    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    from hyperpipe.plan.plan import load_plan
    from hyperpipe.search.backends import backend_or_workers
    from hyperpipe.search.report import format_search
    from hyperpipe.search.search import SearchConstraints, search
    from hyperpipe.sim.costmodel import CostModel
    w, m = opts.workload, opts.memory
    check_outputs([("--cluster", w.cluster), ("--model", w.model),
                    ("--profile", opts.profile.path), ("--start", opts.start)],
                  [("--out", opts.out)])
    start = load_plan(opts.start) if opts.start else None
    if start is None:
        for flag, value in (("--cluster", w.cluster), ("--model", w.model),
                            ("--global-batch", w.global_batch)):
            if value is None:
                raise BadInput(flag, "given (or --start PLAN, whose it then is)", None,
                               has_got=False)
    overrides = {"seq_len": opts.seq_len} if opts.seq_len else None
    model = load_model(w.model if w.model else start.load_model(), where="--model",
                       overrides=overrides)
    cluster = load_cluster(w.cluster) if w.cluster else start.load_cluster()
    global_batch = w.global_batch or start.global_batch
    if start is not None:
        _check_start(start, model, cluster, global_batch, opts.start)
    profile = load_checked_profile(opts.profile, model, cluster)
    stack = opts.stack or (start.stack if start is not None else None)
    with as_flags():
        c = SearchConstraints(global_batch=global_batch, micro_batch=opts.micro_batch,
                              schedule=opts.schedule, pp=opts.pp, dp=opts.dp, tp=opts.tp,
                              chunks=opts.chunks, objective=opts.objective,
                              recompute=m.recompute, sequence_parallel=m.sequence_parallel,
                              distributed_optimizer=m.distributed_optimizer,
                              zero=opts.zero, cp=opts.cp, ep=opts.ep,
                              **({"stack": stack} if stack else {}),
                              **({"runtime": start.runtime}
                                 if start is not None and stack == start.stack else {}))
    with opened_backend(opts.backend, opts.workers) as backend:
        with as_flags():
            result = search(model, cluster, c, profile=profile, top=opts.top,
                            workers=opts.workers, progress=opts.progress, backend=backend)
        cost = CostModel(model, cluster, profile)
        if start is not None:
            result = _with_start(result, start, cost, c)
        if opts.json:
            text = None
        else:
            # the report's simulations (where the gain comes from) over the same workers
            with backend_or_workers(backend, opts.workers) as pool:
                text = format_search(result, cost, pool=pool)
    if opts.out:             # after the report, so that a failure leaves nothing written
        result.best.plan.save(opts.out)
    if text is None:
        print_json(result.to_dict())
        return EXIT_OK
    sys.stdout.write(text)
    if opts.out:
        print(f"best plan written to {opts.out}")
    from hyperpipe.exec.runnable import why_not_runnable
    note = why_not_runnable(result.best.plan, model)
    if note:
        print(f"note: `hyperpipe run` cannot run the best plan as it stands ({note}); "
              "it stays the simulator's answer for this cluster")
    return EXIT_OK


def _check_start(start, model, cluster, global_batch: int, where: str) -> None:
    """A start that does not fit the search (another global batch, a device the cluster
    lacks) is bad input, found before the search runs: it names what differs."""
    if start.global_batch != global_batch:
        raise BadInput(f"{where}: global_batch", f"the search's {global_batch}",
                       start.global_batch)
    try:
        start.check(model, cluster)
    except BadInput as err:
        raise BadInput(where, f"a plan for the searched model and cluster ({err})",
                       None, has_got=False) from None


def _with_start(result, start, cost, c):
    """`result` with the start plan (checked by `_check_start`), on the search's stack
    and runtime, simulated as the baseline "start"; and as the pick where it keeps every
    dimension the user fixed (`c.admits`) and nothing the search found beats it (then
    `seeded_from` "start", the search's own best as `own_best`, and the baselines the
    other plans, without it)."""
    from dataclasses import replace

    from hyperpipe.search.evaluate import Candidate, rank_key
    from hyperpipe.sim.simulator import simulate
    start = replace(start, stack=c.stack, runtime=c.runtime)
    cand = Candidate(start, simulate(start, cost).metrics)
    baselines = {"start": cand, **result.baselines}
    if c.admits(start) and rank_key(c, cand.metrics) < rank_key(c, result.best.metrics):
        own = result.own_best if result.seeded_from is not None else result.best
        return replace(result, best=cand, ranked=[cand, *result.ranked][:len(result.ranked)],
                       seeded_from="start", own_best=own)
    return replace(result, baselines=baselines)
