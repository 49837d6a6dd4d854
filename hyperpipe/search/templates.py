"""Phase 1 of the search: pipeline templates, one class of identical pipelines each.

A template fixes a schedule (kind, chunks) and micro-batch size (its "config"), a tp
degree, a group of device types, how many replicas, how many units of each type one
pipeline takes, their stage order and replica layout (the generators of
`hyperpipe.search.space`), and cuts the layers with the bottleneck DP of
`hyperpipe.search.partition`.

Per type group, every (config, tp, replicas, units) key gets a lower bound on its
objective (the load spread fractionally over the pipeline's devices, no links); keys
are visited best bound first and skipped once their bound is outside the band of the
best found (branch and bound). A visited key is cut in its canonical order (most memory
first) and, only if that lands in the band, in every other order: orders change links
and memory, rarely the bottleneck. A shape out of memory at one micro-batch size is not
tried at larger ones.

A template's own time model is the 1F1B-style closed form (m - 1) x busiest device's
load per micro-batch + fill (at least one micro-batch's whole trip) + gradient sync,
with all numbers from `CostModel`; it ranks templates and splits the batch, while the
analytic tier and the simulator judge whole plans.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from hyperpipe.plan.plan import StagePlan
from hyperpipe.search import partition as P
from hyperpipe.search import space
from hyperpipe.search.space import SearchConstraints
from hyperpipe.sim.costmodel import CostModel

KEEP_PER_GROUP = 3        # templates kept per (schedule, micro-batch, type group) ...
KEEP_MAX = 32             # ... or up to this many when within TOLERANCE of the best
TOLERANCE = 0.10          # why: the closed form ties plans the simulator tells apart
CLOSED_FORM_KINDS = frozenset({"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"})


@dataclass(frozen=True)
class Template:
    """`dp` identical pipelines over one group of device types, with one layer cut."""

    kind: str
    chunks: int
    micro_batch: int
    tp: int
    types: tuple[str, ...]
    slots: tuple[tuple[tuple[str, ...], ...], ...]   # [replica][device slot] -> tp group
    part: P.Partition
    device_load_s: float          # busiest device's per-micro-batch time (all its chunks)
    fill_s: float                 # time a micro-batch takes through the empty pipeline
    sync_s: float                 # gradient all-reduce + optimizer step of the busiest stage
    price_per_hour: float         # all devices of all replicas, USD

    @property
    def dp(self) -> int:
        return len(self.slots)

    @property
    def config(self) -> tuple[str, int, int]:
        """What all pipelines of one plan share: (schedule kind, chunks, micro-batch)."""
        return (self.kind, self.chunks, self.micro_batch)

    def time_s(self, m: float) -> float:
        """One pipeline's iteration time for m micro-batches: (m - 1) x load + fill, but
        at least one micro-batch's whole trip (F and B through every stage) and the
        busiest device's m x load; then the gradient sync."""
        return max((m - 1) * self.device_load_s + self.fill_s, self.part.total_s,
                   m * self.device_load_s) + self.sync_s

    def stages(self, replica: int) -> tuple[StagePlan, ...]:
        row = self.slots[replica]
        p = len(row)
        return tuple(StagePlan((a, b), row[k % p], self.tp)
                     for k, (a, b) in enumerate(self.part.layer_ranges))


@dataclass(frozen=True)
class SearchContext:
    """Everything a phase needs, with caches (passed explicitly; no module state)."""

    cost: CostModel
    c: SearchConstraints
    tables: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)
    inflight: dict = field(default_factory=dict)
    splits: dict = field(default_factory=dict)
    book: dict = field(default_factory=dict)      # (types, config or None) -> templates
    matrices: dict = field(default_factory=dict)
    memo: dict = field(default_factory=dict)

    @property
    def refs(self) -> tuple:
        """(model, cluster) as plans name them (built-in name or inline document)."""
        if "refs" not in self.memo:
            from hyperpipe.cluster.cluster import cluster_ref
            from hyperpipe.models import model_ref
            self.memo["refs"] = (model_ref(self.model), cluster_ref(self.cluster))
        return self.memo["refs"]

    @property
    def model(self):
        return self.cost.model

    @property
    def cluster(self):
        return self.cost.cluster

    def table(self, group: tuple[str, ...], mb: int) -> P.LayerTables:
        dev = self.cluster.device(group[0])
        node = self.cluster.node(dev.node)
        # identical devices are interchangeable: one table per (type, intra link, tp)
        key = (dev.type.name, node.intra_link if len(group) > 1 else None, len(group), mb)
        if key not in self.tables:
            self.tables[key] = P.layer_tables(self.cost, group, mb)
        return self.tables[key]

    def link(self, src: str, dst: str, mb: int) -> np.ndarray:
        a, b = self.cluster.device(src), self.cluster.device(dst)
        na, nb = self.cluster.node(a.node), self.cluster.node(b.node)
        # routes cost only by their link class: one entry per (intra link) or (two NICs);
        # a calibration profile measures intra-node links per node, so then per node
        same = a.node == b.node
        if self.cost.profile is not None:
            key = ((a.node,) if same else ("inter", na.nic, nb.nic), mb)
        else:
            key = ((na.intra_link,) if same else (na.nic, nb.nic), mb)
        if key not in self.links:
            self.links[key] = P.link_costs(self.cost, src, dst, mb)
        return self.links[key]

    def times(self, table: P.LayerTables, link: np.ndarray | None) -> np.ndarray:
        """The stage-time matrix of a (table, link) pair; both are cached objects."""
        key = (id(table), None if link is None else id(link))
        if key not in self.matrices:
            self.matrices[key] = P.time_matrix(table, link)
        return self.matrices[key]

    def peak_inflight(self, kind: str, p: int, m: int, v: int) -> tuple[int, ...]:
        """Per stage, the micro-batches it stashes at the peak: the closed forms the
        simulator's memory model uses (`memory.peak_in_flight`, per rank, spread over
        the rank's v chunks) for the kinds it knows, else read off the schedule IR."""
        from hyperpipe.sim.memory import peak_in_flight
        key = (kind, p, m if m <= 3 * p else 2 * p + m % p, v)
        if key not in self.inflight:
            if kind in CLOSED_FORM_KINDS:
                per_rank = [peak_in_flight(kind, p, m, v, r) for r in range(p)]
                self.inflight[key] = tuple(-(-per_rank[k % p] // v) for k in range(p * v))
            else:
                self.inflight[key] = P.peak_inflight(kind, p, m, v)
        return self.inflight[key]

    def splits_backward(self, kind: str) -> bool:
        """Kinds that run I and W apart (zero bubble) fill the pipeline with forwards only."""
        if kind not in self.splits:
            from hyperpipe.plan.generators import generate
            v = 2 if space.takes_chunks(kind) else 1
            sched = generate(kind, 2, 2, v)
            self.splits[kind] = any(a.op == "W" for row in sched.actions for a in row)
        return self.splits[kind]


def _template(ctx: SearchContext, kind: str, v: int, mb: int, tp: int, types: tuple[str, ...],
              slots: list[list[tuple[str, ...]]], m: int, price: float) -> Template | None:
    """Cut the layers for the pipelines `slots` (replica 0 stands for all); None if no
    cut fits in memory."""
    row = slots[0]
    p = len(row)
    stages = p * v
    inflight = ctx.peak_inflight(kind, p, m, v)
    tables, links, mats = [], [], []
    for k in range(stages):
        group = row[k % p]
        dev = ctx.cluster.device(group[0]).type
        slot = P.Slot(group, inflight[k], (dev.memory_bytes - dev.runtime_reserve_bytes) / v)
        t = ctx.table(group, mb)
        link = None if k == stages - 1 else ctx.link(group[-1], row[(k + 1) % p][0], mb)
        tables.append(t)
        links.append(link)
        mats.append(P.stage_matrix(t, slot, ctx.times(t, link)))
    bounds = P.partition(mats)
    if bounds is None:
        return None
    part = P.describe(bounds, tables, links)
    load = [0.0] * p
    for k, t in enumerate(part.stage_s):
        load[k % p] += t
    # fill: what a uniform pipeline adds to m x load (equal stages of F = I = W = t:
    # 1F1B 3(m + p - 1)t, zero-bubble 3mt + (p - 1)t, interleaved 3mvt + 3(p - 1)t with
    # t per chunk; the generators' docstrings), written with per-stage times
    if v > 1:
        fill = part.total_s / v + max(load) * (v - 1) / v
    elif ctx.splits_backward(kind):
        fill = part.forward_s + part.last_backward_s
    else:
        fill = part.total_s
    return Template(kind, v, mb, tp, types, tuple(tuple(r) for r in slots), part,
                    max(load), fill, _sync_s(ctx, slots, part, tp),
                    price)


def _sync_s(ctx: SearchContext, slots, part: P.Partition, tp: int) -> float:
    """Per iteration: ring all-reduce of each device's gradients over the replicas
    (`CostModel.grad_bytes_per_param`: fp32 main grads for bf16) plus its optimizer
    step; the busiest device counts."""
    cost = ctx.cost
    p = len(slots[0])
    per_device = [0.0] * p
    for k, (a, b) in enumerate(part.layer_ranges):
        d = k % p
        group = slots[0][d]
        nbytes = cost.stage_params((a, b)) * cost.grad_bytes_per_param / tp
        ring = [r[d][0] for r in slots]
        per_device[d] += cost.allreduce_time_s(ring, nbytes) + cost.optimizer_time_s(
            (a, b), ctx.cluster.device(group[0]).type.name, tp)
    return max(per_device)


def _assign(pools: dict[str, space.UnitPool], recipe: dict[str, int], dp: int,
            order: tuple[str, ...], layout: str) -> list[list[tuple[str, ...]]]:
    """slots[r][j]: the unit of replica r at position j of `order`. The i-th unit of
    type t in a replica is unit r k_t + i of its pool ("pipeline" layout: a pipeline's
    units sit together, node by node, so stage-to-stage traffic stays inside nodes) or
    unit i dp + r ("stage" layout, Megatron's rank order: the replicas of one stage sit
    together, so the gradient all-reduce stays inside nodes)."""
    slots = []
    for r in range(dp):
        seen = dict.fromkeys(recipe, 0)
        row = []
        for t in order:
            i = seen[t]
            seen[t] += 1
            row.append(pools[t].units[r * recipe[t] + i if layout == "pipeline"
                                      else i * dp + r])
        slots.append(row)
    return slots


@dataclass
class PhaseStats:
    name: str
    seen: int = 0
    pruned: int = 0
    infeasible: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"name": self.name, "seen": self.seen, "pruned": self.pruned,
                "infeasible": self.infeasible, "seconds": round(self.seconds, 4)}


def objective_value(ctx: SearchContext, time_s: float, price_per_hour: float) -> float:
    if ctx.c.objective == "cost":
        return price_per_hour * time_s if not math.isnan(price_per_hour) else math.inf
    return time_s


def _keys(ctx: SearchContext, phase: PhaseStats, types: tuple[str, ...],
          configs: list[tuple[str, int, int]]) -> list[tuple]:
    """Every (config, tp, replicas, units per type) for one type group that can hold the
    model's state, with a lower bound on its objective: the load spread perfectly over
    the pipeline's devices (fractional layers), the fill on the fastest type, and the
    optimizer step spread the same way; no link, no all-reduce."""
    c, model, cost = ctx.c, ctx.model, ctx.cost
    total_state = cost.state_bytes((0, model.num_layers))
    keys = []
    for tp in space.tp_options(ctx.cluster, model, c):
        pools = space.unit_pools(ctx.cluster, tp)
        if any(t not in pools for t in types):
            continue
        counts = {t: len(pools[t].units) for t in types}
        opt = {t: cost.optimizer_time_s((0, model.num_layers), t, tp) for t in types}
        price_of = {t: ctx.cluster.price_per_hour(pools[t].units[0][0]) for t in types}
        for kind, v, mb in configs:
            big_m = c.global_batch // mb
            work = {t: ctx.table(pools[t].units[0], mb) for t in types}
            whole = {t: float(w.fwd_s[-1] + w.bwd_s[-1]) for t, w in work.items()}
            fwd = {t: float(w.fwd_s[-1]) for t, w in work.items()}
            if v > 1:
                fill_lb = min(whole.values()) / v
            elif ctx.splits_backward(kind):
                fill_lb = min(fwd.values())
            else:
                fill_lb = min(whole.values())
            total_stash = cost.stash_bytes((0, model.num_layers), mb)
            for dp, recipe in space.dp_recipes(counts, num_layers=model.num_layers,
                                               chunks=v, pp=c.pp, dp=c.dp):
                phase.seen += 1
                mem = sum(k * tp * (ctx.cluster.device_types[t].memory_bytes
                                    - ctx.cluster.device_types[t].runtime_reserve_bytes)
                          for t, k in recipe.items())
                p = sum(recipe.values())
                m = -(-big_m // dp)
                if p * v > model.num_layers or dp > big_m \
                        or (c.pp is not None and p != c.pp) or (v > 1 and p < 2):
                    phase.infeasible += 1
                    continue
                # memory, summed over the pipeline: all state, and every layer's stash
                # at least as often as the least-loaded stage keeps micro-batches
                if mem < total_state + min(ctx.peak_inflight(kind, p, m, v)) * total_stash:
                    phase.infeasible += 1
                    continue
                load_lb = 1.0 / sum(k / whole[t] for t, k in recipe.items())
                sync_lb = 1.0 / sum(k / opt[t] for t, k in recipe.items()) \
                    if all(opt.values()) else 0.0
                bound = (m - 1) * load_lb + fill_lb + sync_lb
                price = dp * tp * sum(k * (price_of[t] if price_of[t] is not None
                                           else math.nan) for t, k in recipe.items())
                keys.append((objective_value(ctx, bound, price), (kind, v, mb), tp, dp,
                             recipe, pools, price))
    keys.sort(key=lambda k: k[0])
    return keys


def canonical_order(ctx: SearchContext, recipe: dict[str, int]) -> tuple[str, ...]:
    """The stage order tried first: most memory first (1F1B's early stages stash the
    most micro-batches), then the faster type, each type's units together."""
    types = sorted(recipe, key=lambda t: (-ctx.cluster.device_types[t].memory_bytes,
                                          -ctx.cluster.device_types[t].peak_flops))
    return tuple(t for t in types for _ in range(recipe[t]))


def group_templates(ctx: SearchContext, phase: PhaseStats, types: tuple[str, ...],
                    configs: list[tuple[str, int, int]]) -> list[Template]:
    """The best templates for one type group over `configs`, by branch and bound: keys
    best bound first; a key is cut with its canonical stage order, and with every other
    order only if that one lands in the band; the visit ends when no bound can."""
    # with a fixed number of pipelines every replica count is its own race: groups are
    # combined to exactly that many pipelines later
    races: dict[int | None, list[tuple[float, int, Template]]] = {}
    too_big: dict[tuple, int] = {}      # pipeline shape -> least micro-batch out of memory
    serial = itertools.count()
    for bound, (kind, v, mb), tp, dp, recipe, pools, price in _keys(ctx, phase, types,
                                                                     configs):
        found = races.setdefault(dp if ctx.c.dp is not None else None, [])
        if found and bound > _band(found):
            phase.pruned += 1
            continue
        m = -(-(ctx.c.global_batch // mb) // dp)
        shape = (kind, v, tp, dp, tuple(sorted(recipe.items())))
        p = sum(recipe.values())
        if m >= p * v and mb >= too_big.get(shape, math.inf):
            # the same pipelines did not fit a smaller micro-batch, which stashes less
            # with the same in-flight counts (m >= p v: the warm-up is full)
            phase.infeasible += 1
            continue
        first = canonical_order(ctx, recipe)
        tries = [(first, lay) for lay in space.layouts(dp)]
        key = (kind, v, mb, tp, dp, types, m, price, recipe, pools)
        values = _cut_all(ctx, phase, found, serial, tries, key)
        if not values:                     # out of memory in the most memory-rich order
            if m >= p * v:
                too_big[shape] = min(mb, too_big.get(shape, mb))
            continue
        if min(values) > _band(found):
            continue                       # the other orders only move links and memory
        more = [(o, lay) for o in space.stage_orders(recipe) if o != first
                for lay in space.layouts(dp)]
        _cut_all(ctx, phase, found, serial, more, key)
    kept: list[Template] = []
    for found in races.values():
        found.sort(key=lambda x: x[:2])
        limit = _band(found)
        kept += [t for value, _, t in found if value <= limit][:KEEP_MAX]
    return kept


def _cut_all(ctx: SearchContext, phase: PhaseStats, found: list, serial, tries: list,
             key: tuple) -> list[float]:
    """Cut the layers for each (order, layout) in `tries`; add the templates to `found`
    and return their objective values."""
    kind, v, mb, tp, dp, types, m, price, recipe, pools = key
    values = []
    done = set()
    for order, layout in tries:
        slots = _assign(pools, recipe, dp, order, layout)
        if (order, str(slots)) in done:        # both layouts agree (one unit per type)
            continue
        done.add((order, str(slots)))
        phase.seen += 1
        tpl = _template(ctx, kind, v, mb, tp, types, slots, m, price)
        if tpl is None:
            phase.infeasible += 1
            continue
        value = objective_value(ctx, tpl.time_s(m), tpl.price_per_hour)
        found.append((value, next(serial), tpl))
        values.append(value)
    return values


def templates_at(ctx: SearchContext, phase: PhaseStats, types: tuple[str, ...],
                 config: tuple[str, int, int] | None) -> list[Template]:
    """The kept templates of a type group over all configs (config None), or at one
    config (computed on demand, for combining groups that must share it)."""
    key = (types, config)
    if key not in ctx.book:
        if config is not None:
            have = [t for t in templates_at(ctx, phase, types, None) if t.config == config]
            ctx.book[key] = have or group_templates(ctx, phase, types, [config])
        else:
            ctx.book[key] = group_templates(ctx, phase, types, all_configs(ctx))
    return ctx.book[key]


def all_configs(ctx: SearchContext) -> list[tuple[str, int, int]]:
    return [(k, v, mb) for k, v in space.schedule_options(ctx.c, ctx.model.num_layers)
            for mb in space.micro_batches(ctx.c)]


def _band(found: list) -> float:
    """Templates whose closed-form value is within TOLERANCE of the best, or among the
    KEEP_PER_GROUP best, go on: the closed form does not see everything the analytic
    tier and the simulator do (which stage order fills the pipeline faster, ...)."""
    values = sorted(v for v, _, _ in found)
    if not values:
        return math.inf
    return max(values[0] * (1 + TOLERANCE), values[min(KEEP_PER_GROUP, len(values)) - 1])


def templates_phase(ctx: SearchContext, phase: PhaseStats, show, pool=None
                    ) -> list[str]:
    """Phase 1: the best templates of every group of device types (all configs), the
    groups spread over the worker `pool` when there is one (largest groups first)."""
    from hyperpipe.progress import Progress
    types = list(dict.fromkeys(n.device_type for n in ctx.cluster.nodes))
    subsets = [s for r in range(len(types), 0, -1)
               for s in itertools.combinations(types, r)]
    with Progress(len(subsets), "search: templates", enabled=show) as bar:
        if pool is None:
            for subset in subsets:
                templates_at(ctx, phase, subset, None)
                bar.advance()
            return types
        cost = ctx.cost
        tasks = [(cost.model, cost.cluster, cost.profile, ctx.c, subset) for subset in subsets]
        for subset, (found, counts) in zip(subsets, pool.map(_group_task, tasks),
                                           strict=True):
            ctx.book[(subset, None)] = found
            phase.seen += counts[0]
            phase.pruned += counts[1]
            phase.infeasible += counts[2]
            bar.advance()
    return types


def _group_task(args) -> tuple[list[Template], tuple[int, int, int]]:
    """One type group's templates in a worker process (its own caches)."""
    model, cluster, profile, constraints, subset = args
    ctx = SearchContext(CostModel(model, cluster, profile), constraints)
    phase = PhaseStats("templates")
    found = templates_at(ctx, phase, subset, None)
    return found, (phase.seen, phase.pruned, phase.infeasible)
