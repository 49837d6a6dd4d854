"""Baseline plans that need no search: what Megatron-LM and DeepSpeed do by default.

* `uniform_plan`: equal layers per stage (the remainder to the first stages), devices
  taken in cluster order with Megatron's rank order (tensor parallel fastest, then data
  parallel, then pipeline: rank = (stage * dp + replica) * tp + tp_rank; Shoeybi et al.
  2019 / Narayanan et al. 2021, `megatron/core/parallel_state.py`).
* `proportional_plan`: the same devices, layers per stage proportional to the stage's
  peak FLOP/s (the "no search" heterogeneity-aware baseline).
* `tuned_baselines`: each of them tuned as a user tuning Megatron-LM would: over pp,
  dp, tp, micro-batch, every schedule kind and chunk count, and every subset of the
  cluster's device types (a user may simply leave the slow GPUs out). The grid is
  visited in order of a compute-only lower bound and pruned with the analytic tier;
  the few best by the analytic tier go on to the simulator, which picks (the same judge
  as the search's own plans; `hyperpipe.search.search` does that).

Both split the batch evenly over the data-parallel replicas, as both frameworks do.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from hyperpipe.cluster.cluster import cluster_ref, link_sig
from hyperpipe.core.errors import BadInput, InfeasiblePlan
from hyperpipe.models import model_ref
from hyperpipe.plan.kinds import DEFAULT_KIND, schedule_kind
from hyperpipe.plan.plan import PipelinePlan, Plan, StagePlan
from hyperpipe.plan.schedule import stage_rank
from hyperpipe.search import space
from hyperpipe.search.caches import LayersOn, ReplicaKey, SketchKey
from hyperpipe.search.evaluate import estimate, rank_key
from hyperpipe.search.partition import expert_state
from hyperpipe.sim.analytic import held_micro_batches, out_of_memory

if TYPE_CHECKING:
    from hyperpipe.search.templates import PhaseStats, SearchContext


def layer_counts(num_layers: int, weights: list[float]) -> list[int]:
    """Split `num_layers` into len(weights) positive counts proportional to `weights`
    (largest remainder; ties to the earlier stage). Equal weights give the uniform split
    with the remainder on the first stages."""
    n = len(weights)
    if num_layers < n:
        raise InfeasiblePlan(f"{num_layers} layers cannot fill {n} stages (one layer each "
                             "at least)")
    spare = num_layers - n                      # one layer per stage first
    total = float(sum(weights))
    shares = [spare * w / total for w in weights]
    counts = [1 + int(s) for s in shares]
    left = num_layers - sum(counts)
    order = sorted(range(n), key=lambda i: (-(shares[i] - int(shares[i])), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


def _check_dims(pp: int, dp: int, tp: int, micro_batch: int, global_batch: int,
                chunks: int) -> int:
    for name, value in (("pp", pp), ("dp", dp), ("tp", tp), ("micro_batch", micro_batch),
                        ("global_batch", global_batch), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadInput(name, "a positive integer", value)
    if global_batch % (dp * micro_batch):
        raise BadInput("global_batch", f"a multiple of dp x micro_batch = {dp} x "
                       f"{micro_batch} = {dp * micro_batch}", global_batch)
    return global_batch // (dp * micro_batch)


def _device_grid(cluster, pp: int, dp: int, tp: int, devices: list[str] | None, cp: int = 1
                 ) -> list[list[tuple[str, ...]]]:
    """grid[replica][stage] = the tp x cp devices of that stage, in Megatron rank order."""
    names = list(devices) if devices is not None else [d.name for d in cluster.devices]
    group = tp * cp
    need = pp * dp * group
    if len(names) < need:
        dims = ("pp x dp x tp x cp", f"{pp} x {dp} x {tp} x {cp}") if cp > 1 else \
            ("pp x dp x tp", f"{pp} x {dp} x {tp}")
        raise InfeasiblePlan(f"{dims[0]} = {dims[1]} = {need} devices needed, "
                             f"{len(names)} available")
    grid = []
    for r in range(dp):
        row = []
        for s in range(pp):
            first = (s * dp + r) * group
            devs = tuple(names[first:first + group])
            if len({cluster.device(d).type.name for d in devs}) > 1:
                what = "tensor- and context-parallel" if cp > 1 else "tensor-parallel"
                raise InfeasiblePlan(f"{what} group {list(devs)} mixes device types in "
                                     "cluster order")
            row.append(devs)
        grid.append(row)
    return grid


def _build(model, cluster, grid, weights_of, *, global_batch: int, micro_batch: int,
           num_microbatches: int, schedule: str, chunks: int, refs, ep: int = 1,
           cp: int = 1) -> Plan:
    pipelines = []
    for row in grid:
        pp = len(row)
        place = schedule_kind(schedule).placement
        homes = [row[stage_rank(k, pp, place)] for k in range(pp * chunks)]
        counts = layer_counts(model.num_layers, [weights_of(g) for g in homes])
        stages, start = [], 0
        for group, n in zip(homes, counts, strict=True):
            stages.append(StagePlan((start, start + n), group, len(group) // cp, cp=cp,
                                    ep=ep))
            start += n
        pipelines.append(PipelinePlan(micro_batch, num_microbatches, tuple(stages)))
    model_doc, cluster_doc = refs if refs is not None else (model_ref(model),
                                                            cluster_ref(cluster))
    plan = Plan(model=model_doc, cluster=cluster_doc,
                global_batch=global_batch, schedule=schedule, chunks=chunks,
                pipelines=tuple(pipelines))
    plan.check(model, cluster)
    return plan


def uniform_plan(model, cluster, *, pp: int, dp: int = 1, tp: int = 1, micro_batch: int,
                 global_batch: int, schedule: str = DEFAULT_KIND, chunks: int | None = None,
                 devices: list[str] | None = None, refs: tuple | None = None,
                 ep: int = 1, cp: int = 1) -> Plan:
    """Megatron/DeepSpeed default: equal layers per stage, devices in cluster order.
    `refs` = (model_ref, cluster_ref) when the caller has them already; chunks None: the
    kind's default (2 for the V kinds, else 1); `ep`: every stage's expert-parallel
    degree (Megatron's rank order puts a stage's replicas side by side, so an
    expert-parallel group is ep consecutive replicas); `cp`: every stage's context
    ranks, each a tensor group of tp (a stage holds tp x cp devices, tensor rank
    innermost)."""
    chunks = schedule_kind(schedule).default_chunks if chunks is None else chunks
    m = _check_dims(pp, dp, tp * cp, micro_batch, global_batch, chunks)
    grid = _device_grid(cluster, pp, dp, tp, devices, cp)
    return _build(model, cluster, grid, lambda g: 1.0, global_batch=global_batch,
                  micro_batch=micro_batch, num_microbatches=m, schedule=schedule,
                  chunks=chunks, refs=refs, ep=ep, cp=cp)


def proportional_plan(model, cluster, *, pp: int, dp: int = 1, tp: int = 1, micro_batch: int,
                      global_batch: int, schedule: str = DEFAULT_KIND, chunks: int | None = None,
                      devices: list[str] | None = None, refs: tuple | None = None,
                      ep: int = 1, cp: int = 1) -> Plan:
    """Layers per stage proportional to the stage's peak FLOP/s (tp x cp x device peak);
    the rest as `uniform_plan`."""
    chunks = schedule_kind(schedule).default_chunks if chunks is None else chunks
    m = _check_dims(pp, dp, tp * cp, micro_batch, global_batch, chunks)
    grid = _device_grid(cluster, pp, dp, tp, devices, cp)

    def peak_flops(group: tuple[str, ...]) -> float:
        return sum(cluster.device(d).type.peak_flops for d in group)

    return _build(model, cluster, grid, peak_flops, global_batch=global_batch,
                  micro_batch=micro_batch, num_microbatches=m, schedule=schedule,
                  chunks=chunks, refs=refs, ep=ep, cp=cp)


# ---------------------------------------------------------------------------- tuning

BASELINE_SHORT_LIST = 3     # per baseline, plans the simulator ranks (best analytic first)


def type_subsets(cluster) -> list[tuple[str, ...]]:
    """Every non-empty subset of the cluster's device classes (`space.device_classes`:
    device types, a slowed or otherwise different node apart), largest first."""
    types = list(space.device_classes(cluster))
    return [s for r in range(len(types), 0, -1) for s in itertools.combinations(types, r)]


def baseline_grid(ctx: SearchContext) -> Iterator[tuple[tuple[str, ...], dict]]:
    """Choices of a Megatron-style run: a subset of the device types (their devices in
    cluster order), tp (inside a node), pp, as many replicas as the devices allow
    (dp = devices // (pp x tp), all devices used unless pp or dp is fixed), every
    schedule kind and chunk count, every micro-batch size, and for an MoE model every
    expert-parallel degree of `space.ep_options` (Megatron-Core's `--expert-model-
    parallel-size`). Fixed dimensions as given (a fixed cp: groups of tp x cp devices).
    Yields (the subset, the keyword arguments of `uniform_plan`/`proportional_plan`)."""
    c, cluster, model = ctx.c, ctx.cluster, ctx.model
    cp = c.cp or 1
    class_of = {nd: cls.name for cls in ctx.classes.values() for nd in cls.nodes}
    for subset in type_subsets(cluster):
        nodes = [nd for nd in cluster.nodes if class_of[nd.name] in subset]
        devices = tuple(d.name for d in cluster.devices if class_of[d.node] in subset)
        n = len(devices)
        for tp in space.tp_options(cluster, model, c):
            width = tp * cp
            if any(nd.count % width for nd in nodes):
                continue                  # a stage's group would straddle two nodes
            for pp in ([c.pp] if c.pp else range(1, n // width + 1)):
                dp = c.dp or n // (width * pp)
                if dp < 1 or pp * dp * width > n or (c.dp is None and c.pp is None
                                                     and n % (width * pp)):
                    continue
                for kind, chunks in space.schedule_options(c, model.num_layers):
                    if pp * chunks > model.num_layers or (chunks > 1 and pp < 2):
                        continue
                    for mb in space.micro_batches(c):
                        if c.global_batch % (dp * mb):
                            continue
                        for ep in space.ep_options(model, c, dp):
                            yield subset, dict(pp=pp, dp=dp, tp=tp, micro_batch=mb,
                                               global_batch=c.global_batch, schedule=kind,
                                               chunks=chunks, devices=list(devices), ep=ep,
                                               cp=cp)


def _replicas(ctx: SearchContext, subset: tuple[str, ...], devices: tuple[str, ...],
              pp: int, dp: int, tp: int) -> dict[tuple, tuple] | None:
    """The distinct replicas of `_device_grid`'s layout: per stage, (device type,
    slowdown, tensor-parallel link) of its group, mapped to one replica's groups of that
    kind (cost and memory see no other difference). None: a group mixes device types."""
    cache = ctx.baseline_replicas
    key = ReplicaKey(subset, pp, dp, tp)
    if key not in cache:
        cluster, out = ctx.cluster, {}
        profiled = ctx.cost.profile is not None    # its intra-node links are per node
        for r in range(dp):
            groups = [devices[(s * dp + r) * tp:(s * dp + r + 1) * tp] for s in range(pp)]
            kinds = []
            for g in groups:
                first = cluster.device(g[0])
                if any(cluster.device(d).type.name != first.type.name for d in g[1:]):
                    out = None
                    break
                link = None if tp == 1 else (first.node if profiled else
                                             link_sig(cluster.node(first.node).intra_link))
                kinds.append((first.type.name, cluster.slowdown(g), link))
            if out is None:
                break
            out.setdefault(tuple(kinds), tuple(groups))
        cache[key] = out
    return cache[key]


class Sketch(NamedTuple):
    """What `sketch` reads off a grid point without building its plan."""

    fits: bool                # every device's weights, gradients and optimizer state fit
    bound_s: float            # a lower bound on its iteration time
    # per rank of each distinct replica: (its state plus its device's runtime reserve,
    # the mean of its stages' stashes per micro-batch, its device's memory), bytes
    ranks: tuple[tuple[float, float, float], ...]


def sketch(ctx: SearchContext, name: str, subset: tuple[str, ...], dims: dict
           ) -> Sketch | None:
    """For the plan `name` ("uniform" or "proportional") would build from `dims`:
    whether every device's weights, gradients and optimizer state fit it, a lower
    bound on its iteration time (the busiest device's forward and backward compute over
    all its micro-batches: no bubble, link or all-reduce), and each rank's memory as
    `stashes_fit` reads it. Without building the plan: per distinct replica only (at
    1024 devices the grid holds thousands of plans of up to 1024 pipelines). None where
    building would fail (InfeasiblePlan)."""
    pp, dp, tp, mb = dims["pp"], dims["dp"], dims["tp"], dims["micro_batch"]
    kind, chunks = dims["schedule"], dims["chunks"]
    # kinds that place their chunks alike build the same stages: one sketch for them
    key = SketchKey(name, subset, pp, dp, tp, mb, schedule_kind(kind).placement, chunks,
                    dims.get("ep", 1))
    if key not in ctx.sketches:
        ctx.sketches[key] = _sketch(ctx, name, subset, dims)
    return ctx.sketches[key]


def _sketch(ctx: SearchContext, name: str, subset: tuple[str, ...], dims: dict
            ) -> Sketch | None:
    pp, dp, tp, mb = dims["pp"], dims["dp"], dims["tp"], dims["micro_batch"]
    kind, chunks = dims["schedule"], dims["chunks"]
    replicas = _replicas(ctx, subset, tuple(dims["devices"]), pp, dp, tp)
    if replicas is None or ctx.model.num_layers < pp * chunks:
        return None
    cost, cluster = ctx.cost, ctx.cluster
    times = ctx.baseline_stage_s
    fits, worst, ranks = True, 0.0, []
    m = dims["global_batch"] // (dp * mb)
    homes = [stage_rank(k, pp, schedule_kind(kind).placement) for k in range(pp * chunks)]
    for kinds, row in replicas.items():
        weights = [1.0 if name == "uniform" else
                   sum(cluster.device(d).type.peak_flops for d in row[h]) for h in homes]
        held, load, stash, start = [0.0] * pp, [0.0] * pp, [0.0] * pp, 0
        for h, n in zip(homes, layer_counts(ctx.model.num_layers, weights), strict=True):
            layers, group = (start, start + n), row[h]
            start += n
            held[h] += cost.state_bytes(layers, tp, **expert_state(dims.get("ep", 1), 0, 1))
            stash[h] += cost.stash_bytes(layers, mb, tp)
            key = LayersOn(layers, (tp, kinds[h]), mb)    # like groups: one time
            if key not in times:
                times[key] = sum(cost.stage_time_s(layers, group, mb, op) for op in "FB")
            load[h] += times[key]
        worst = max(worst, m * max(load))
        types = [cluster.device(g[0]).type for g in row]
        fits = fits and all(b + t.runtime_reserve_bytes <= t.memory_bytes
                            for b, t in zip(held, types, strict=True))
        ranks += [(b + t.runtime_reserve_bytes, z / chunks, t.memory_bytes)
                  for b, z, t in zip(held, stash, types, strict=True)]
    return Sketch(fits, worst, tuple(ranks))


def stashes_fit(ctx: SearchContext, got: Sketch, dims: dict) -> bool:
    """False only where the analytic tier puts the plan out of memory: each rank's peak
    there (`analytic.out_of_memory`) is at least its state and reserve plus its mean
    stash times the micro-batches its schedule holds (`analytic.held_micro_batches`);
    the backward's working set, a stack's kept stage outputs and the routed experts'
    extra stashes only add to it."""
    pp, chunks = dims["pp"], dims["chunks"]
    m = dims["global_batch"] // (dims["dp"] * dims["micro_batch"])
    held = ctx.baseline_held.memo((dims["schedule"], pp, m, chunks),
                                  lambda: held_micro_batches(dims["schedule"], pp, m, chunks))
    return all(state + stash * held[r % pp] <= memory
               for r, (state, stash, memory) in enumerate(got.ranks))


BASELINES = {"uniform": uniform_plan, "proportional": proportional_plan}
_TUNED = ("tuned over pp, dp, tp, micro-batch, every schedule kind and chunk count, "
          "expert parallelism (MoE models) and every subset of the device classes; its "
          "best plan gets the pick's schedule synthesis")
# What each baseline may choose (the search's report and search_quality print it).
FREEDOMS = {
    "uniform": "Megatron-LM/DeepSpeed layout: equal layers per stage, devices in rank "
               "order; " + _TUNED,
    "proportional": "the same layout with layers in proportion to peak FLOP/s; " + _TUNED,
}


def tuned_baselines(ctx: SearchContext, phase: PhaseStats,
                    names: tuple[str, ...] = tuple(BASELINES)) -> dict[str, list[Plan]]:
    """Per baseline, its short list: the BASELINE_SHORT_LIST plans of the grid that the
    analytic tier likes best (memory-feasible first), for the simulator to rank.
    Branch and bound: the grid's points are estimated in order of their `sketch`'s
    bound, until the bound exceeds the short list's worst estimate; only those are
    built as plans. A plan the analytic tier puts out of memory (`stashes_fit` from the
    sketch, else `analytic.out_of_memory` on the plan, no time priced) is estimated
    only if the short list ends with fewer than BASELINE_SHORT_LIST plans that fit: it
    ranks below every plan that does."""
    out: dict[str, list[Plan]] = {}
    for name in names:
        built = []
        for subset, dims in baseline_grid(ctx):
            phase.seen += 1
            # the sketch takes a stage's tp x cp devices as one tensor group of that width
            wide = {**dims, "tp": dims["tp"] * dims["cp"]}
            got = sketch(ctx, name, subset, wide)
            if got is None or not got.fits:
                phase.infeasible += 1    # no such plan, or weights alone overflow a device
                continue
            built.append((got.bound_s, len(built), dims, stashes_fit(ctx, got, wide)))
        built.sort(key=lambda x: x[:2])
        short = _short_list(ctx, phase, BASELINES[name], built)
        if short:
            out[name] = short
    return out


def constrained(ctx: SearchContext, plan: Plan) -> Plan:
    """A baseline's `plan` with what the user fixed beyond its grid (`ctx.c`): the stack
    and runtime, a generated schedule kind (a peer's pick is 1F1B), recompute, sequence
    parallelism and the optimizer's sharding; checked where any of those changed it.
    BadInput/InfeasiblePlan when the layout cannot take them, or lacks a fixed chunk
    count, context or expert parallelism (a peer's pick, which never has them), or
    under a fixed kind that takes chunks, one of the search's chunk counts
    (`space.chunk_options`: interleaving is what fixing interleaved-1f1b asks for)."""
    c = ctx.c
    plan = plan.on_stack(c.stack, **c.runtime.given())
    for name, fixed, has in (("chunks", c.chunks, {plan.chunks}),
                             ("context parallelism", c.cp,
                              {st.cp for p in plan.pipelines for st in p.stages}),
                             ("expert parallelism", c.ep,
                              {st.ep for p in plan.pipelines for st in p.stages})):
        if fixed is not None and has != {fixed}:
            raise InfeasiblePlan(f"a plan without {name} {fixed}")
    kind = None if c.schedule is None else schedule_kind(c.schedule)
    if kind is not None and not kind.carries_actions and plan.schedule != kind.name:
        if not kind.allows_chunks(plan.chunks):
            raise InfeasiblePlan(f"a plan of {plan.chunks} chunks per device, not "
                                 f"schedule {kind.name}'s")
        if kind.takes_chunks and plan.chunks not in space.chunk_options(c):
            # interleaving fixed: the search's own chunk counts (--chunks 1 allows one)
            raise InfeasiblePlan(f"a plan of {plan.chunks} chunks per device, not one of "
                                 f"{space.chunk_options(c)} that the search takes")
        plan = replace(plan, schedule=kind.name)
        plan.check(ctx.model, ctx.cluster)
    if c.recompute is None and c.sequence_parallel is None \
            and c.distributed_optimizer is None and c.zero is None:
        return plan
    plan = plan.with_memory(recompute=c.recompute, sequence_parallel=c.sequence_parallel,
                            distributed_optimizer=c.distributed_optimizer, zero=c.zero)
    plan.check(ctx.model, ctx.cluster)
    return plan


def _short_list(ctx: SearchContext, phase: PhaseStats, make, built: list[tuple]
                ) -> list[Plan]:
    """`tuned_baselines`' walk for one baseline (`make`) over `built`: (bound, serial,
    dims, whether `stashes_fit`), best bound first."""
    c = ctx.c
    short: list[tuple[tuple, int, Plan]] = []
    too_big: list[tuple[int, dict]] = []        # out of memory: estimated only if needed

    def add(serial: int, dims: dict, deferred: bool = False) -> None:
        try:
            plan = constrained(ctx, make(ctx.model, ctx.cluster, **dims, refs=ctx.refs))
            if not deferred and out_of_memory(plan, ctx.cost):
                too_big.append((serial, dims))
                return
            short.append((rank_key(c, estimate(plan, ctx.cost)), serial, plan))
        except (InfeasiblePlan, BadInput):   # e.g. a schedule over the action limit
            phase.infeasible += not deferred  # (a deferred one is counted with too_big)
            return
        short.sort(key=lambda x: x[:2])
        del short[BASELINE_SHORT_LIST:]

    for bound, serial, dims, stashes in built:
        # the sketch prices a tp x cp group as tensor parallel: a bound only with cp 1
        if len(short) >= BASELINE_SHORT_LIST and not short[-1][0][0] \
                and c.objective == "throughput" and (c.cp or 1) == 1 \
                and bound > short[-1][0][1]:
            phase.pruned += 1
        elif not stashes:                    # out of memory, read off the sketch
            too_big.append((serial, dims))
        else:
            add(serial, dims)
    phase.infeasible += len(too_big)
    if len(short) < BASELINE_SHORT_LIST or short[-1][0][0]:
        for serial, dims in sorted(too_big, key=lambda x: x[0]):
            add(serial, dims, deferred=True)
    return [plan for _, _, plan in short]
