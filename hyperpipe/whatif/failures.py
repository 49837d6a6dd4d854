"""Failures in what-if studies: goodput against the checkpoint interval, and the plan
to fall back to when a node is gone (`hyperpipe whatif --failures`).

Today's plan (the user's, or the best plan for the cluster) runs on some
nodes; each node with an `mtbf` fails as a Poisson process, and the job stops when any
of its nodes does (`hyperpipe.whatif.goodput`). The checkpoint write time is the
checkpoint's size (by default the model's parameters x
`CHECKPOINT_BYTES_PER_PARAM`) over the storage bandwidth. The study tabulates the
expected goodput (Daly 2006's model) and a Monte-Carlo run of failures against the
interval, with Young's and Daly's first-order optima and the model's exact one, and
re-plans on the cluster without the node most likely to fail (the lowest MTBF): the
search's best plan there, or today's plan less its pipelines on that node when that is
better (`surviving_replicas`: what a job does without re-planning, its schedule
synthesised again when today's was), so the re-plan is never worse than simply
dropping the lost replicas.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, replace
from typing import Any

from hyperpipe.cluster.cluster import (
    Cluster,
    cluster_from_dict,
    cluster_ref,
    links_among,
    node_copies,
)
from hyperpipe.core.errors import BadInput, InfeasiblePlan
from hyperpipe.core.units import format_quantity, format_seconds, three_digits
from hyperpipe.models import ModelSpec
from hyperpipe.plan.kinds import schedule_kind
from hyperpipe.plan.plan import Plan
from hyperpipe.search.backends import process_pool
from hyperpipe.search.evaluate import Candidate, improves, rank_key
from hyperpipe.search.report import describe_plan
from hyperpipe.search.search import SearchConstraints, SearchResult, search, split_batch
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate
from hyperpipe.synth.synthesise import fixed_kinds, synthesise
from hyperpipe.whatif.added_devices import simulate_on
from hyperpipe.whatif.goodput import (
    CHECKPOINT_BYTES_PER_PARAM,
    Checkpointing,
    best_interval_s,
    combined_mtbf_s,
    daly_interval_s,
    expected_goodput,
    monte_carlo_goodput,
    young_interval_s,
)
from hyperpipe.whatif.variants import Planning

MC_FAILURES = 50_000         # failures in the Monte-Carlo run behind each table row
TABLE_FACTORS = (0.25, 0.5, 2.0, 4.0)   # intervals tabulated around the optimum


@dataclass(frozen=True)
class IntervalRow:
    label: str                   # "Daly", "Young", "optimum", "0.5x", "given"
    interval_s: float
    goodput: float               # expected (Daly's model)
    goodput_mc: float            # Monte-Carlo run of failures


@dataclass(frozen=True)
class FailureStudy:
    model: str
    cluster: str
    plan: Candidate                       # today's plan on the whole cluster
    nodes: tuple[str, ...]                # the nodes it uses
    mtbf_s: float                         # of those nodes together
    checkpoint_bytes: float
    ckpt: Checkpointing
    rows: tuple[IntervalRow, ...]
    failed_node: str
    replan: Candidate | None              # the best plan without `failed_node`
    replan_error: str | None = None
    replan_from: str = "search"           # or "surviving replicas" (`surviving_replicas`)
    plan_text: str = ""                   # describe_plan of today's plan and the re-plan
    replan_text: str = ""
    failed_why: str = "the lowest MTBF of its nodes"   # why that node
    # the re-plan run on the whole cluster (`failed_node` idle), where it simulates
    # faster there than today's plan by a gain the study shows (SHOWN_GAIN): the plan
    # that losing the node is measured against
    replan_whole: Candidate | None = None
    plan_given: bool = False              # today's plan was given (else the search's)

    def row(self, label: str) -> IntervalRow:
        return next(r for r in self.rows if r.label == label)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model, "cluster": self.cluster, "plan": self.plan.to_dict(),
            "nodes": len(self.nodes), "mtbf_s": self.mtbf_s,
            "checkpoint_bytes": self.checkpoint_bytes,
            "checkpoint_write_s": self.ckpt.write_s, "restart_s": self.ckpt.restart_s,
            "optimum_interval_s": self.row("optimum").interval_s,
            "daly_interval_s": self.row("Daly").interval_s,
            "young_interval_s": self.row("Young").interval_s,
            "intervals": [{"label": r.label, "interval_s": r.interval_s,
                           "goodput": r.goodput, "goodput_monte_carlo": r.goodput_mc}
                          for r in self.rows],
            "failed_node": self.failed_node}
        if self.replan is not None:
            out["replan"] = self.replan.to_dict()
            out["replan_from"] = self.replan_from
        if self.replan_whole is not None:
            out["replan_on_whole_cluster"] = self.replan_whole.to_dict()
        if self.replan_error is not None:
            out["replan_error"] = self.replan_error
        return out


@dataclass(frozen=True)
class FailureOptions:
    """What the failure study needs beyond the model and cluster (seconds, bytes)."""

    planning: Planning
    restart_s: float                           # from a failure to training again
    storage_bandwidth_bytes_per_s: float | None = None
    checkpoint_bytes: float | None = None      # None: CHECKPOINT_BYTES_PER_PARAM x params
    write_s: float | None = None               # one checkpoint; overrides size / bandwidth
    mtbf_s: float | None = None                # of every node without an mtbf of its own
    intervals_s: tuple[float, ...] = ()        # tabulated besides the optima


def failure_whatif(model: ModelSpec, cluster: Cluster, options: FailureOptions, *,
                   profile: Any = None, backend: Any = None) -> FailureStudy:
    """The failure study of one plan (see the module doc): today's plan is
    `options.planning.plan`, or the best plan for `cluster` when that is None."""
    o, planning = options, options.planning
    base = cluster
    if o.mtbf_s is not None:
        base = replace(base, nodes=tuple(n if n.mtbf_s is not None else
                                         replace(n, mtbf_s=o.mtbf_s) for n in base.nodes))
    if all(n.mtbf_s is None for n in base.nodes):
        raise BadInput("failures", "an mtbf on the nodes (node field mtbf in the cluster "
                       "file, or `mtbf` for every node)", has_got=False)
    spec = model
    size = o.checkpoint_bytes if o.checkpoint_bytes is not None else \
        CHECKPOINT_BYTES_PER_PARAM * spec.params
    write_s = o.write_s
    if write_s is None:
        if o.storage_bandwidth_bytes_per_s is None:
            raise BadInput("storage_bandwidth", "the bandwidth checkpoints are written at "
                           "(e.g. '20 GB/s'), or `checkpoint_write_time`", has_got=False)
        write_s = size / o.storage_bandwidth_bytes_per_s
    # Before the search: even the most reliable node fails too often for any progress.
    _check_trains(write_s, o.restart_s, max(n.mtbf_s for n in base.nodes if n.mtbf_s))
    c = planning.constraints()
    with contextlib.ExitStack() as stack:
        workers = planning.workers if backend is None else 1
        if backend is None and workers > 1:
            # one pool for both searches: its workers carry their caches over to the
            # re-plan (`SearchContext.carry_from`)
            backend, workers = stack.enter_context(process_pool(workers)), 1
        return _study(spec, base, o, c, size, write_s, profile, workers, backend)


# The least gain the study shows (its changes print to 0.1%): a re-plan faster on the
# whole cluster than today's plan by less reads +0.0%, and is not named as faster.
SHOWN_GAIN = 0.0005


def _study(spec: ModelSpec, base: Cluster, o: FailureOptions, c: SearchConstraints,
           size: float, write_s: float, profile, workers: int, backend) -> FailureStudy:
    """`failure_whatif` once its inputs are checked: today's plan, its goodput table and
    the re-plan without the node most likely to fail, and that re-plan on the whole
    cluster (the node idle) where it simulates faster there than today's plan."""
    plan, first = o.planning.plan, None
    if plan is None:
        first = search(spec, base, c, profile=profile, top=1, workers=workers,
                       backend=backend, peers=False, keep_context=True)
        plan = first.best.plan
    cost = CostModel(spec, base, profile)
    today = Candidate(plan, simulate(plan, cost, SimOptions(trace=False)).metrics)
    step_s = today.metrics.iteration_time_s
    if any(t < step_s for t in o.intervals_s):
        raise BadInput("--checkpoint-interval", f"at least one iteration of today's plan "
                       f"({duration(step_s)}): a checkpoint is written between two",
                       duration(min(o.intervals_s)))
    nodes = tuple(dict.fromkeys(base.device(d).node for d in plan.devices))
    failing = [base.node(n) for n in nodes if base.node(n).mtbf_s is not None]
    if not failing:
        raise BadInput("failures", "an mtbf on a node the plan uses", has_got=False)
    mtbf = combined_mtbf_s([n.mtbf_s for n in failing])
    _check_trains(write_s, o.restart_s, mtbf, step_s)
    ckpt = Checkpointing(write_s, o.restart_s)
    rows = _interval_rows(ckpt, mtbf, o.intervals_s, step_s)
    failed = min(failing, key=lambda n: n.mtbf_s).name       # ties: the first in the plan
    alike = len(failing) > 1 and len({n.mtbf_s for n in failing}) == 1
    why = ("every node of the plan has the same MTBF: its first" if alike else
           "the plan's node most likely to fail" if len(failing) > 1 else
           "the plan's only node" if len(nodes) == 1 else "the plan's only node with an MTBF")
    replan, error, text, origin = _replan(spec, base, failed, c, profile, workers, backend,
                                          plan, first)
    whole = None
    if replan is not None:      # it runs on the whole cluster too, the node idle
        there = simulate_on(replan.plan, cost)
        if improves(c, there.metrics, today.metrics, SHOWN_GAIN):
            whole = there
    return FailureStudy(spec.name, base.name, today, nodes, mtbf, size, ckpt, rows, failed,
                        replan, error, origin, describe_plan(plan, base), text,
                        failed_why=why, replan_whole=whole,
                        plan_given=o.planning.plan is not None)


# Restart plus checkpoint write over the MTBF above which the job never trains: the
# goodput is about e^-50 or less whatever the interval: a table of zeros, not an answer.
MAX_DOWNTIME_OVER_MTBF = 50.0


def _check_trains(write_s: float, restart_s: float, mtbf_s: float, step_s: float = 0.0
                  ) -> None:
    """BadInput when failures come so often that the job makes no progress: restart,
    checkpoint write and (once the plan is known) one iteration, `step_s`, between two
    checkpoints take more than MAX_DOWNTIME_OVER_MTBF times the MTBF."""
    if not (math.isfinite(write_s) and write_s + restart_s + step_s
            <= MAX_DOWNTIME_OVER_MTBF * mtbf_s):
        step = f" + one iteration ({duration(step_s)})" if step_s else ""
        raise BadInput("failures", f"an MTBF of the plan's nodes ({duration(mtbf_s)}) of "
                       f"at least 1/{MAX_DOWNTIME_OVER_MTBF:g} of restart time "
                       f"({duration(restart_s)}) + checkpoint write time "
                       f"({duration(write_s)}){step}; else the job never trains",
                       has_got=False)


def _interval_rows(ckpt: Checkpointing, mtbf_s: float, given: tuple[float, ...],
                   step_s: float) -> tuple[IntervalRow, ...]:
    """The goodput table: the optimum, Daly's and Young's intervals and multiples of the
    optimum, each a whole number of iterations of `step_s` (at least one: a checkpoint
    is written between two), and the intervals the user gave (checked to be so)."""
    def whole(t: float) -> float:
        return max(1, round(t / step_s)) * step_s

    free = best_interval_s(ckpt, mtbf_s)
    below = max(1, math.floor(free / step_s)) * step_s
    best = max((below, below + step_s), key=lambda t: expected_goodput(t, ckpt, mtbf_s))
    named = [("optimum", best), ("Daly", whole(daly_interval_s(ckpt.write_s, mtbf_s))),
             ("Young", whole(young_interval_s(ckpt.write_s, mtbf_s)))]
    named += [(f"{f:g}x optimum", whole(f * best)) for f in TABLE_FACTORS]
    named += [("given", t) for t in given]
    named.sort(key=lambda item: item[1])
    mc = monte_carlo_goodput([t for _, t in named], ckpt, mtbf_s, failures=MC_FAILURES)
    return tuple(IntervalRow(label, t, expected_goodput(t, ckpt, mtbf_s), g)
                 for (label, t), g in zip(named, mc, strict=True))


def without_node(cluster: Cluster, name: str) -> Cluster:
    """`cluster` less node `name` (a node of a `repeat` group is taken out of it)."""
    doc = copy.deepcopy(cluster.source)
    doc.setdefault("name", cluster.name)
    entries, i = [], 0
    for entry in doc["nodes"]:
        made = cluster.nodes[i:i + node_copies(entry)]
        i += len(made)
        if all(n.name != name for n in made) and "name" in entry:
            entries.append(entry)
            continue
        # one entry per node, each named as it was (default names count positions)
        entries += [{**{k: v for k, v in entry.items() if k != "repeat"}, "name": node.name}
                    for node in made if node.name != name]
    if not entries:
        raise InfeasiblePlan(f"cluster {cluster.name} has no node left without {name}")
    doc["nodes"] = entries
    # paths given to the node's own region (its name, without a `region`) go with it
    doc = links_among(doc)
    out = cluster_from_dict(doc, where=f"cluster {cluster.name} without {name}",
                            name=cluster.name)
    # nodes keep their MTBFs (their own or the study's `mtbf_s`)
    mtbf = {n.name: n.mtbf_s for n in cluster.nodes}
    return replace(out, nodes=tuple(replace(n, mtbf_s=mtbf[n.name]) for n in out.nodes))


def surviving_replicas(plan: Plan, spec: ModelSpec, smaller: Cluster) -> list[Plan]:
    """`plan` less its pipelines that use a device `smaller` lacks, the global batch
    split again over the others in proportion to the micro-batches each had (the
    search splits them by each pipeline's speed), on `smaller`. A schedule synthesised
    for the old micro-batch counts (one that carries actions) gives way to each fixed
    kind that places the stages as it does (`fixed_kinds`), one plan each. Empty when
    no pipeline is lost or none is left, when they differ in micro-batch size, or when
    the result is not a valid plan there (e.g. too few micro-batches for the
    pipelines)."""
    keep = [p for p in plan.pipelines if all(map(smaller.has_device, p.devices()))]
    if not keep or len(keep) == len(plan.pipelines) or \
            len({p.micro_batch for p in keep}) > 1 or plan.global_batch % keep[0].micro_batch:
        return []
    try:
        counts = split_batch([lambda m, had=p.num_microbatches: m / had for p in keep],
                             plan.global_batch // keep[0].micro_batch)
    except InfeasiblePlan:
        return []
    out = replace(plan, cluster=cluster_ref(smaller), pipelines=tuple(
        replace(p, num_microbatches=m) for p, m in zip(keep, counts, strict=True)))
    plans = [replace(out, schedule=kind, actions=None) for kind in fixed_kinds(out)] \
        if schedule_kind(plan.schedule).carries_actions else [out]
    valid = []
    for candidate in plans:
        try:
            candidate.check(spec, smaller)
        except (BadInput, InfeasiblePlan):
            continue
        valid.append(candidate)
    return valid


def _replan(spec, cluster: Cluster, failed: str, c: SearchConstraints, profile,
            workers: int, backend, today: Plan, first: SearchResult | None = None
            ) -> tuple[Candidate | None, str | None, str, str]:
    """(the re-plan, why there is none, its description, where it comes from); the
    search starts from `first`'s caches (the search that found `today`), if any."""
    try:
        smaller = without_node(cluster, failed)
    except InfeasiblePlan as exc:
        return None, str(exc), "", "search"
    cost = CostModel(spec, smaller, profile)
    found: list[tuple[Candidate, str]] = []
    error = None
    try:
        res = search(spec, smaller, c, profile=profile, top=1, workers=workers,
                     backend=backend, peers=False, carry=first)
        found.append((Candidate(res.best.plan, simulate(res.best.plan, cost, SimOptions(
            trace=False)).metrics), "search"))
    except InfeasiblePlan as exc:
        error = str(exc)
    # survivors that keep every dimension the user fixed (a fixed dp, say, they do not)
    kept = [p for p in surviving_replicas(today, spec, smaller) if c.admits(p)]
    if kept and schedule_kind(today.schedule).carries_actions:
        # today's order was synthesised: so is the survivors' (the best of the fixed
        # kinds and the synthesised orders for their new micro-batch counts)
        done = synthesise(kept[0], cost)
        if done.metrics.feasible:
            found.append((Candidate(done.plan, done.metrics), "surviving replicas"))
    else:
        for plan in kept:
            m = simulate(plan, cost, SimOptions(trace=False)).metrics
            if m.feasible:
                found.append((Candidate(plan, m), "surviving replicas"))
    if not found:
        return None, error, "", "search"
    best, origin = min(found, key=lambda f: rank_key(c, f[0].metrics))
    return best, None, describe_plan(best.plan, smaller), origin


def duration(value_s: float) -> str:
    """A duration for people: '4.2 ms', '12.5 s', '56.3 min', '2.1 h', '5 days'."""
    for unit, factor in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if value_s >= 2 * factor:
            return f"{three_digits(value_s / factor)} {unit}"
    return format_seconds(value_s)


def format_failures(study: FailureStudy) -> str:
    m = study.plan.metrics
    out = [f"failures: model {study.model} on cluster {study.cluster}",
           f"today's plan: {study.plan_text}",
           f"  {m.throughput_samples_per_s:.2f} samples/s, iteration "
           f"{duration(m.iteration_time_s)}, on {len(study.nodes)} "
           f"node{'s' if len(study.nodes) != 1 else ''}",
           f"MTBF of those nodes together {duration(study.mtbf_s)}; checkpoint "
           f"{format_quantity(study.checkpoint_bytes, 'B')} written in "
           f"{duration(study.ckpt.write_s)}; restart {duration(study.ckpt.restart_s)}",
           "", f"{'checkpoint every':>18}  {'iterations':>10}  {'goodput':>8}  "
           f"{'Monte-Carlo':>11}  {'samples/s':>9}"]
    for r in study.rows:
        out.append(f"{duration(r.interval_s):>18}  "
                   f"{r.interval_s / m.iteration_time_s:10.0f}  {r.goodput:8.1%}  "
                   f"{r.goodput_mc:11.1%}  {r.goodput * m.throughput_samples_per_s:9.2f}  "
                   f"{r.label}")
    best = study.row("optimum")
    out += ["", f"optimum: checkpoint every {duration(best.interval_s)} "
            f"({best.interval_s / m.iteration_time_s:.0f} iteration(s)), goodput "
            f"{best.goodput:.1%}; Daly's first-order sqrt(2 delta M) - delta = "
            f"{duration(study.row('Daly').interval_s)} (Daly 2006), Young's "
            f"sqrt(2 delta M) = {duration(study.row('Young').interval_s)} (Young 1974)",
            "goodput: expected useful time / wall time (Daly 2006's model); Monte-Carlo: "
            f"one simulated run of {MC_FAILURES} failures", ""]
    if study.replan is None:
        out.append(f"without node {study.failed_node}: nothing fits ({study.replan_error})")
    else:
        r = study.replan.metrics
        how = "re-planned" if study.replan_from == "search" else \
            "today's plan less its pipelines there (beats the search's re-plan)"
        out.append(f"without node {study.failed_node} ({study.failed_why}): {how} "
                   f"{r.throughput_samples_per_s:.2f} samples/s "
                   f"({r.throughput_samples_per_s / m.throughput_samples_per_s - 1:+.1%}): "
                   f"{study.replan_text}")
        if study.replan_whole is not None:
            w = study.replan_whole.metrics.throughput_samples_per_s
            whose = "given" if study.plan_given else "the search missed it"
            out.append(f"  that plan runs on the whole cluster too, node {study.failed_node} "
                       f"idle: {w:.2f} samples/s, {w / m.throughput_samples_per_s - 1:+.1%} "
                       f"over today's plan ({whose}); against it, losing the node changes "
                       f"{r.throughput_samples_per_s / w - 1:+.1%}")
    return "\n".join(out) + "\n"


def plot_failures(study: FailureStudy, path: str) -> None:
    """Goodput against the checkpoint interval: the model's curve, the Monte-Carlo
    points and the optima marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hyperpipe.core.files import plain_text_figures
    plain_text_figures()        # names and --vary values drawn as written
    import numpy as np

    from hyperpipe.core.files import save_figure

    best = study.row("optimum").interval_s
    grid = np.geomspace(best / 8, best * 8, 200)
    curve = [expected_goodput(t, study.ckpt, study.mtbf_s) for t in grid]
    unit, scale = ("h", 3600.0) if best > 3600 else ("min", 60.0)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(grid / scale, [100 * g for g in curve], color="#2b7bba",
            label="expected goodput (Daly 2006 model)")
    ax.plot([r.interval_s / scale for r in study.rows],
            [100 * r.goodput_mc for r in study.rows], "o", color="#d95f02",
            label=f"Monte-Carlo run ({MC_FAILURES} failures)")
    for label, style in (("optimum", "-"), ("Daly", "--"), ("Young", ":")):
        r = study.row(label)
        ax.axvline(r.interval_s / scale, color="#555555", linestyle=style, linewidth=1,
                   label=f"{label}: {duration(r.interval_s)}")
    ax.set_xscale("log")
    ax.set_xlabel(f"checkpoint interval ({unit} of training between checkpoints)")
    ax.set_ylabel("goodput (% of wall time training)")
    ax.set_title(f"failures: {study.model} on {study.cluster}, MTBF "
                 f"{duration(study.mtbf_s)}, checkpoint "
                 f"{duration(study.ckpt.write_s)}, restart "
                 f"{duration(study.ckpt.restart_s)}", fontsize=9)
    ax.legend(fontsize=8, loc="lower center")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
