"""The search space, declared as small generators of valid factors.

`schedule_options` (kind, chunks), `micro_batches` (divisors of the global batch),
`tp_options` (degrees that fit a node), `device_classes` (nodes the cost model cannot
tell apart: same device type, size, links, NICs, slowdowns and price), `unit_pools` (per
device class, its tp groups, node by node, least slowed first: only counts per class
matter), `slowdown_levels` (how many of a class's units a template may take: all, or
those up to a slowdown, leaving a straggler inside a node idle), `type_groups`
(every set partition of every non-empty subset of the device classes: a class left out
sits idle), `dp_recipes` (replicas per group and units of
each type per pipeline), `stage_orders` (which type takes which stage), `layouts`
(which units form which replica: a pipeline's together, or a stage's replicas together
as in Megatron's rank order), `cp_options` (context-parallel degrees, tried only where
the sequence needs them), `ep_options` (expert-parallel degrees of MoE models) and
`memory_modes` (recompute, sequence parallelism, the ZeRO
stage, in the order tried). The search combines them and prunes each as early as it
can; a dimension fixed in `SearchConstraints` keeps its one value.

A stage's unit is its tp x cp devices (`unit_pools`): tp and cp are the degrees inside a
stage; expert parallelism is carved out of a stage's replicas (`MemoryMode.ep`, fixed per
template key like cp), so it changes a template's tables, not its units.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from hyperpipe.core.errors import BadInput
from hyperpipe.plan.kinds import GENERATED_KINDS, KINDS, schedule_kind
from hyperpipe.plan.plan import RECOMPUTE_KINDS, ZERO_STAGES, tp_misfit
from hyperpipe.plan.stack import DEFAULT_STACK, NO_OVERRIDES, STACKS, RuntimeOverrides

MAX_MICRO_BATCH = 64          # why: beyond this, activations rarely fit and bubbles grow
MAX_ORDERS = 120              # distinct stage orders enumerated in full below this count
MAX_CHUNKS = 4                # interleaved chunks tried: 2 and 4 (Table 1 of Narayanan et al.
                              # uses 2-3, NeMo's GPT-3 175B config 12, 1.4% faster on H100
                              # by the simulator; more multiplies the templates)


@dataclass(frozen=True)
class SearchConstraints:
    """What the user fixed. None leaves that dimension to the search."""

    global_batch: int
    micro_batch: int | None = None
    schedule: str | None = None
    pp: int | None = None
    dp: int | None = None
    tp: int | None = None
    chunks: int | None = None
    objective: str = "throughput"      # or "cost" (USD per million tokens)
    recompute: str | None = None                 # "none", "selective" or "full"
    sequence_parallel: bool | None = None        # on every tensor-parallel stage
    distributed_optimizer: bool | None = None    # True: zero 1 and up; False: zero 0
    zero: int | None = None                      # ZeRO stage 0-3 (`plan.ZERO_STAGES`)
    cp: int | None = None                        # context-parallel degree of every stage
    ep: int | None = None                        # expert-parallel degree of every stage
    stack: str = DEFAULT_STACK                   # the stack every plan runs on
    runtime: RuntimeOverrides = NO_OVERRIDES     # its runtime overrides

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "pp", "dp", "tp", "chunks", "cp", "ep"):
            value = getattr(self, name)
            if value is None and name != "global_batch":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInput(name, "a positive integer", value)
        if self.zero is not None and (isinstance(self.zero, bool)
                                      or self.zero not in ZERO_STAGES):
            raise BadInput("zero", "0, 1, 2 or 3", self.zero)
        if self.zero is not None and self.distributed_optimizer is not None \
                and self.distributed_optimizer != (self.zero >= 1):
            raise BadInput("distributed_optimizer", f"{str(self.zero >= 1).lower()} with "
                           f"zero {self.zero} (zero 1 and up shard the optimizer state), or "
                           "left out", self.distributed_optimizer)
        if self.stack not in STACKS:
            raise BadInput("stack", f"one of {', '.join(STACKS)}", self.stack)
        if self.objective not in ("throughput", "cost"):
            raise BadInput("objective", "throughput or cost", self.objective)
        if self.recompute is not None and self.recompute not in RECOMPUTE_KINDS:
            raise BadInput("recompute", f"one of {', '.join(RECOMPUTE_KINDS)}",
                           self.recompute)
        if self.sequence_parallel and self.tp == 1:
            raise BadInput("sequence_parallel", "tensor parallelism (`tp` above 1): it "
                           "splits the tensor-parallel group's activations", "`tp` 1")
        if self.micro_batch is not None and self.global_batch % self.micro_batch:
            raise BadInput("micro_batch", f"a divisor of the global batch "
                           f"({self.global_batch})", self.micro_batch)
        if self.schedule is not None:
            if self.schedule not in KINDS:
                raise BadInput("schedule", f"one of {', '.join(KINDS)}", self.schedule)
            kind = KINDS[self.schedule]
            if self.chunks is not None and not kind.allows_chunks(self.chunks):
                raise BadInput("chunks", kind.chunks_rule(), self.chunks)
        if self.dp is not None and self.dp > self.global_batch // (self.micro_batch or 1):
            raise BadInput("dp", f"at most global batch / micro-batch = "
                           f"{self.global_batch // (self.micro_batch or 1)} pipelines", self.dp)

    def admits(self, plan) -> bool:
        """Whether `plan` (a `plan.Plan`) keeps every dimension fixed here."""
        stages = [st for pipe in plan.pipelines for st in pipe.stages]
        every = {"tp": {st.tp for st in stages}, "cp": {st.cp for st in stages},
                 "ep": {st.ep for st in stages},
                 "recompute": {st.recompute for st in stages},
                 "sequence_parallel": {st.sequence_parallel for st in stages if st.tp > 1},
                 "micro_batch": {pipe.micro_batch for pipe in plan.pipelines},
                 "pp": {len(pipe.stages) // plan.chunks for pipe in plan.pipelines},
                 "dp": {len(plan.pipelines)}, "schedule": {plan.schedule},
                 "chunks": {plan.chunks}, "zero": {plan.zero},
                 "distributed_optimizer": {plan.distributed_optimizer}}
        return all(getattr(self, name) is None or values <= {getattr(self, name)}
                   for name, values in every.items()) \
            and plan.stack == self.stack and plan.runtime == self.runtime


class MemoryMode(NamedTuple):
    """How a template saves memory: activation recompute and sequence parallelism on
    every stage, the ZeRO stage over its data-parallel group (replicas x context ranks),
    and the context-parallel degree its units were built with (`cp`: fixed per template
    key, carried here because the layer tables depend on it). `reshard`: ZeRO-3 gathers
    the weights again for every micro-batch (`sim.sharding.reshard_after_forward`).
    A named tuple: the search's cache keys hold it, and a tuple hashes without a call
    into Python."""

    recompute: str = "none"
    sequence_parallel: bool = False
    zero: int = 0
    cp: int = 1
    reshard: bool = True
    ep: int = 1                   # expert-parallel degree (`ep_options`), fixed per key

    @property
    def distributed_optimizer(self) -> bool:
        """Whether the optimizer state is sharded (ZeRO 1 and up)."""
        return self.zero >= 1


def zero_options(c: SearchConstraints, shards: int, reshard: bool) -> tuple[int, ...]:
    """The ZeRO stages a template tries beyond the plain one, in order: 1 (sharded
    optimizer state: the same bytes moved, a smaller step, so free here), then 2 (the
    gradients sharded too: a reduce-scatter per backward) and 3 (the weights too:
    gathers per forward and backward) only when 1 does not fit, 3 only where it
    reshards (without resharding it holds every stage's weights and gradient unsharded,
    as much as ZeRO-1 holds: torchtitan's default with pipelining). One shard (a single
    replica of one context rank): only 0. Fixed in `c`: that one."""
    if c.zero is not None:
        return (c.zero,)
    if c.distributed_optimizer is False or shards <= 1:
        return (0,)
    return (1, 2, 3) if reshard else (1, 2)


def memory_modes(c: SearchConstraints, tp: int, dp: int, selective_helps: bool,
                 cp: int = 1, reshard: bool = True, ep: int = 1, sp_splits: bool = True
                 ) -> tuple[MemoryMode, ...]:
    """The memory modes a template of `tp` x `cp` units and `dp` replicas tries, in the
    order the search tries them: the plain one first, then sequence parallelism (tp > 1)
    with each ZeRO stage of `zero_options` (sequence parallelism and ZeRO-1 cost no time
    in this cost model: the same bytes, a sharded optimizer step), then the same with
    selective recompute (only where it saves memory: eager attention), then full
    recompute. A template takes the first that fits, so a plan shards and recomputes
    where memory needs it, recomputing only when no ZeRO stage fits without it. A
    dimension fixed in `c` keeps its one value. `sp_splits`: whether tp divides each
    context rank's tokens (`plan.tp_misfit`); if not, no sequence parallelism (none at
    all when `c` fixes it on)."""
    if c.sequence_parallel and tp > 1 and not sp_splits:
        return ()
    sp = (c.sequence_parallel,) if c.sequence_parallel is not None else (False, True)
    sp = tuple(x and tp > 1 and sp_splits for x in sp)
    zeros = zero_options(c, dp * cp, reshard)
    if c.recompute is not None:
        recompute: tuple[str, ...] = (c.recompute,)
    else:
        recompute = ("none", "selective", "full") if selective_helps else ("none", "full")
    plain_zero = 0 if c.zero is None and c.distributed_optimizer is None else zeros[0]
    ladder = [MemoryMode(recompute[0], sp[0], plain_zero, cp, reshard, ep)]
    ladder += [MemoryMode(r, sp[-1], z, cp, reshard, ep) for r in recompute for z in zeros]
    return tuple(dict.fromkeys(ladder))


def ep_options(model, c: SearchConstraints, ranks: int) -> tuple[int, ...]:
    """Expert-parallel degrees a template of `ranks` data-parallel x context ranks per
    stage tries, in order: every divisor of both the model's routed experts and `ranks`
    (`StagePlan.ep`: an expert-parallel group is carved out of the ranks holding the
    stage, Megatron-Core's rule), 1 first. Models without MoE blocks: 1. Fixed in `c`:
    that one, where it divides both (else none: the template cannot take it)."""
    moe = model.config.moe if model.config is not None else None
    if moe is None:
        return (1,) if c.ep in (None, 1) else ()
    fits = [e for e in range(1, min(moe.experts, ranks) + 1)
            if moe.experts % e == 0 and ranks % e == 0]
    if c.ep is not None:
        return (c.ep,) if c.ep in fits else ()
    return tuple(fits)


def attention_share(model) -> float:
    """The share of the blocks' forward FLOPs in their attention cores (scores and their
    product with the values, over the whole s x s square as the model counts them), for
    one sample at the model's sequence length, over every transformer block, dense and
    MoE (an MoE block's attention is a dense block's; its FLOPs count the experts a
    token meets); 0 for models without attention shapes."""
    cfg = model.config
    if cfg is None:
        return 0.0
    blocks = [k for k, layer in enumerate(model.layers) if layer.kind in ("block", "moe")]
    if not blocks:
        return 0.0
    s, hd = model.seq_len, cfg.head_dim
    core = 4.0 * s * s * cfg.n_head * hd          # QK^T and AV, 2 s^2 hd FLOPs per head each
    total = sum(model.layer_cost(i, 1).fwd_flops for i in blocks)
    return len(blocks) * core / total if total else 0.0


MAX_CP = 32                   # context-parallel degrees tried: powers of two up to this
                              # (Llama 3 405B used 16 at sequence 131,072: arXiv 2407.21783,
                              # table 4)
ATTENTION_DOMINATES = 0.5     # why: beyond half of the block's FLOPs, the s-proportional
                              # attention and activations are what a longer sequence costs


def cp_options(model, c: SearchConstraints, long_sequence: bool | None = None
               ) -> tuple[int, ...]:
    """Context-parallel degrees to try, in order: 1, and the powers of two up to MAX_CP
    that split the sequence into 2 cp equal chunks (causal load balancing) only when the
    sequence is long: its attention core is at least ATTENTION_DOMINATES of a block's
    FLOPs (`attention_share`), or `long_sequence` says so (the caller found that no plan
    with cp 1 fits in memory). Fixed in `c`: that one. Synthetic models: 1."""
    if c.cp is not None:
        return (c.cp,)
    if model.config is None:
        return (1,)
    long = attention_share(model) >= ATTENTION_DOMINATES if long_sequence is None \
        else long_sequence
    if not long:
        return (1,)
    out, cp = [1], 2
    while cp <= MAX_CP:
        if model.seq_len % (2 * cp) == 0:
            out.append(cp)
        cp *= 2
    return tuple(out)


@dataclass(frozen=True)
class DeviceClass:
    """Nodes whose devices the cost model cannot tell apart: the same device type, device
    count, intra-node link, NICs, per-device slowdowns and price. The search chooses
    devices class by class (all of a class's nodes, some or none), so a slow node, a slow
    link or a memory-poor part is one class that the search may leave idle; inside a
    class, it may leave the most slowed units idle (`slowdown_levels`)."""

    name: str                     # the type's name; "TYPE@xS" (slowed) or "TYPE#k" else
    type_name: str
    nodes: tuple[str, ...]        # in cluster order
    slowdown: float               # its slowest device's compute multiplier (1.0: none)
    least_slowdown: float = 1.0   # its fastest device's


def device_classes(cluster) -> dict[str, DeviceClass]:
    """The device classes of `cluster`, in order of their first node. A type with one
    class keeps the type's name; with several, its largest class of healthy nodes keeps
    it, a slowed class is named "TYPE@xS" (its slowest device's multiplier) and any other
    "TYPE#k" (k = 2, 3, ... in cluster order)."""
    keys: dict[tuple, list[str]] = {}
    for node in cluster.nodes:
        keys.setdefault(class_key(cluster, node), []).append(node.name)
    names: dict[tuple, str] = {}
    for type_name in dict.fromkeys(k[0] for k in keys):
        mine = [k for k in keys if k[0] == type_name]
        healthy = [k for k in mine if max(k[5], default=1.0) == 1.0]
        plain = max(healthy, key=lambda k: k[1] * len(keys[k]), default=None) \
            if len(mine) > 1 else mine[0]
        taken = {type_name} if plain is not None else set()
        for k in mine:
            if k == plain:
                names[k] = type_name
                continue
            slow = max(k[5], default=1.0)
            base = f"{type_name}@x{slow:g}" if slow != 1.0 else type_name
            name, n = base, 2
            while name in taken:
                name, n = f"{base}#{n}", n + 1
            taken.add(name)
            names[k] = name
    return {names[k]: DeviceClass(names[k], k[0], tuple(nodes), max(k[5], default=1.0),
                                  min(k[5], default=1.0))
            for k, nodes in keys.items()}


def class_key(cluster, node) -> tuple:
    """What puts a node in its device class: its device type, device count, intra-node
    link, NICs, per-device slowdowns and price, and its region where a path of the
    cluster's `links` names it (`Cluster.linked_region`)."""
    return (node.device_type, node.count, node.intra_link, node.nic, node.nics,
            node.slowdown, cluster.price_per_hour(f"{node.name}/0"),
            cluster.linked_region(node.name))


@dataclass(frozen=True)
class UnitPool:
    """The units of one device class: its tp groups (same node), cp of them together
    with context parallelism, in cluster order."""

    type_name: str                # the class's name (a device type's, or TYPE@xS, ...)
    tp: int
    units: tuple[tuple[str, ...], ...]   # each tp x cp devices
    cp: int = 1


def first_node_units(cluster, pool: UnitPool) -> int:
    """How many of `pool`'s first units lie wholly on its first unit's node (0: a unit
    spans nodes)."""
    node = cluster.device(pool.units[0][0]).node
    k = 0
    for unit in pool.units:
        if any(cluster.device(d).node != node for d in unit):
            break
        k += 1
    return k


def schedule_options(c: SearchConstraints, num_layers: int) -> Iterator[tuple[str, int]]:
    # no kind, or one that carries actions (synth): every generated kind (then, for synth,
    # a schedule synthesised for the best: search phase 4)
    chosen = None if c.schedule is None else schedule_kind(c.schedule)
    names = GENERATED_KINDS if chosen is None or chosen.carries_actions else (chosen.name,)
    for kind in map(schedule_kind, names):
        if c.zero == 3 and kind.splits_backward and kind is not chosen:
            continue    # ZeRO-3 asked: the kinds `run` runs with it (no I/W split)
        if not kind.takes_chunks:
            v = kind.default_chunks
            if c.chunks in (None, v) and (v == 1 or 2 * v <= num_layers):
                yield kind.name, v
            continue
        for v in chunk_options(c):
            if 2 * v <= num_layers:      # at least two devices of v stages each
                yield kind.name, v


def chunk_options(c: SearchConstraints) -> list[int]:
    """The chunk counts per device the search tries for a kind that takes any: the one
    fixed, else 2 up to `MAX_CHUNKS` in steps of 2 (one chunk is 1F1B's layout)."""
    return [c.chunks] if c.chunks else list(range(2, MAX_CHUNKS + 1, 2))


def micro_batches(c: SearchConstraints) -> Iterator[int]:
    if c.micro_batch is not None:
        yield c.micro_batch
        return
    divisors = [d for d in range(1, min(c.global_batch, MAX_MICRO_BATCH) + 1)
                if c.global_batch % d == 0]
    powers = [d for d in divisors if d & (d - 1) == 0]
    yield from (powers if len(powers) > 1 else divisors[:6])


def tp_options(cluster, model, c: SearchConstraints) -> Iterator[int]:
    """Powers of two up to the largest node that split the model as tensor parallelism
    must (`plan.tp_misfit`); only 1 for synthetic models, whose layers have no
    tensor-parallel communication to cost (so tp would look free)."""
    if c.tp is not None:
        yield c.tp
        return
    if model.config is None:
        yield 1
        return
    largest = max(n.count for n in cluster.nodes)
    tp = 1
    while tp <= largest:
        if tp_misfit(model, tp) is None:
            yield tp
        tp *= 2


def unit_pools(cluster, tp: int, classes: dict[str, DeviceClass] | None = None,
               cp: int = 1) -> dict[str, UnitPool]:
    """Per device class (`device_classes`), its units: tp groups node by node (a node's
    leftover devices unused), and with cp > 1 each cp consecutive tp groups of the class
    one unit (context rank c's tp group at positions c tp .. c tp + tp - 1, tensor rank
    innermost as in Megatron's rank order; inside a node when tp cp fits one, else over
    consecutive nodes; leftover groups unused). A class whose units differ in slowdown
    (a straggler inside a node) lists them least slowed first, so that a template taking
    fewer units than the pool holds (`slowdown_levels`) leaves the slowest idle."""
    classes = device_classes(cluster) if classes is None else classes
    groups: dict[str, list[tuple[str, ...]]] = {}
    for cls in classes.values():
        units = groups.setdefault(cls.name, [])
        for name in cls.nodes:
            count = cluster.node(name).count
            names = [f"{name}/{i}" for i in range(count)]
            units.extend(tuple(names[k:k + tp]) for k in range(0, count - tp + 1, tp))
    if cp > 1:
        groups = {t: [tuple(d for g in u[k:k + cp] for d in g)
                      for k in range(0, len(u) - cp + 1, cp)] for t, u in groups.items()}
    return {t: UnitPool(t, tp, tuple(sorted(u, key=cluster.slowdown)), cp)
            for t, u in groups.items() if u}


def slowdown_levels(cluster, pool: UnitPool) -> tuple[int, ...]:
    """How many units of `pool` a template may take: the units up to each slowdown the
    pool's units have (least first; the last is all of them). One level where every
    unit has the same slowdown."""
    slow = [cluster.slowdown(unit) for unit in pool.units]
    return tuple(sum(1 for x in slow if x <= level) for level in sorted(set(slow)))


def set_partitions(items: list[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every partition of `items` into non-empty blocks (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [(first,), *part]
        for k in range(len(part)):
            yield [*part[:k], (first, *part[k]), *part[k + 1:]]


def type_groups(types: list[str]) -> Iterator[list[tuple[str, ...]]]:
    """Set partitions of every non-empty subset of the device types."""
    for r in range(len(types), 0, -1):
        for subset in itertools.combinations(types, r):
            yield from set_partitions(list(subset))


def dp_recipes(counts: dict[str, int], *, num_layers: int, chunks: int,
               pp: int | None, dp: int | None, max_dp: int | None = None,
               node_units: dict[str, int] | None = None
               ) -> Iterator[tuple[int, dict[str, int]]]:
    """(replicas, units of each type per pipeline) for one group of types with `counts`
    units each. Every type in the group gives each pipeline at least one unit; a pipeline
    has at most num_layers / chunks devices. Without a fixed pp each pipeline takes all
    it can (units // replicas); with one, every split of pp units over the types.

    `node_units`: the units one node of each type holds. Without a fixed pp, a group of
    one type on several nodes also gets the recipes of its first node alone (units of
    one node // replicas): the rest of the class idle, as a slow link between its nodes
    can make best. A fixed pp enumerates such recipes anyway.

    `max_dp`: the most replicas the batch allows (global batch / micro-batch). Without a
    fixed pp, when no count of replicas up to it can take all the units (more devices
    than its pipelines have stages: one node of 512 devices for an 8-layer model), each
    pipeline takes as many units as it has stages instead, the rest unused.

    With `max_dp` and no fixed dp, replica counts of one recipe that give each pipeline
    the same number of micro-batches (ceil(max_dp / d)) differ only in idle devices, the
    gradient sync and the price: of each such run only its fewest replicas (the least
    devices for that pipeline time) come out, and the recipe's most replicas (the most
    throughput beside other groups, the most ZeRO shards). See `replica_counts`."""
    pairs = _all_recipes(counts, num_layers=num_layers, chunks=chunks, pp=pp, dp=dp,
                         max_dp=max_dp)
    if pp is None and len(counts) == 1 and node_units:
        pairs = list(pairs)
        pairs += [pair for pair in _one_node_recipes(counts, node_units,
                                                     num_layers // chunks, dp)
                  if pair not in pairs]
    if dp is not None or max_dp is None:
        yield from pairs
        return
    pairs = [(d, r) for d, r in pairs if d <= max_dp]
    by_recipe: dict[tuple, list[int]] = {}
    for d, r in pairs:
        by_recipe.setdefault(tuple(r.values()), []).append(d)
    keep = {(key, d) for key, ds in by_recipe.items() for d in replica_counts(ds, max_dp)}
    yield from ((d, r) for d, r in pairs if (tuple(r.values()), d) in keep)


def replica_counts(ds: list[int], max_dp: int) -> list[int]:
    """Of the replica counts `ds` of one recipe, those worth a template: per number of
    micro-batches per pipeline (ceil(max_dp / d)), the fewest replicas that give it, and
    the most replicas of all."""
    least: dict[int, int] = {}
    for d in ds:
        m = -(-max_dp // d)
        least[m] = min(d, least.get(m, d))
    return sorted({*least.values(), max(ds)})


def _all_recipes(counts: dict[str, int], *, num_layers: int, chunks: int,
                 pp: int | None, dp: int | None, max_dp: int | None
                 ) -> Iterator[tuple[int, dict[str, int]]]:
    """Every (replicas, units per type) of `dp_recipes`, before its rule on runs."""
    most = min(counts.values())
    taken = False                       # some recipe within max_dp takes all units
    for d in range(1, most + 1):
        if dp is not None and d > dp:
            break
        if pp is None:
            recipe = {t: n // d for t, n in counts.items()}
            if sum(recipe.values()) * chunks <= num_layers:
                taken = taken or max_dp is None or d <= max_dp
                yield d, recipe
            continue
        if pp * chunks > num_layers:
            return
        caps = [counts[t] // d for t in counts]
        for ks in _compositions(pp, caps):
            yield d, dict(zip(counts, ks, strict=True))
    if pp is None and not taken:
        yield from _subset_recipes(counts, num_layers // chunks, min(
            most, dp or most, max_dp or most))


def _one_node_recipes(counts: dict[str, int], node_units: dict[str, int], stages: int,
                      dp: int | None) -> Iterator[tuple[int, dict[str, int]]]:
    """(replicas, {type: units}) of one type's first node alone, when the type has more
    units than one node holds: its units // replicas each, at most `stages`."""
    (t, n), = counts.items()
    u = node_units.get(t, 0)
    if not 1 <= u < n:
        return
    for d in range(1, u + 1):
        if dp is not None and d != dp:
            continue
        if u // d <= stages:
            yield d, {t: u // d}


def _subset_recipes(counts: dict[str, int], stages: int, replicas: int
                    ) -> Iterator[tuple[int, dict[str, int]]]:
    """(replicas, units per type) with `stages` units per pipeline at most: each type's
    share (units // replicas) cut, the largest first, until the pipeline fits."""
    for d in range(1, replicas + 1):
        recipe = {t: n // d for t, n in counts.items()}
        while sum(recipe.values()) > stages:
            t = max(recipe, key=recipe.__getitem__)
            if recipe[t] == 1:
                break
            recipe[t] -= min(sum(recipe.values()) - stages, recipe[t] - 1)
        if sum(recipe.values()) <= stages:
            yield d, recipe


def _compositions(total: int, caps: list[int]) -> Iterator[tuple[int, ...]]:
    """Tuples of positive ints, k_i <= caps[i], summing to total."""
    if len(caps) == 1:
        if 1 <= total <= caps[0]:
            yield (total,)
        return
    rest_min = len(caps) - 1
    for k in range(1, min(caps[0], total - rest_min) + 1):
        for tail in _compositions(total - k, caps[1:]):
            yield (k, *tail)


def stage_orders(recipe: dict[str, int]) -> Iterator[tuple[str, ...]]:
    """Which type takes each stage of a pipeline. Identical units are interchangeable, so
    the distinct orders of the type multiset are all there is; when there are more than
    MAX_ORDERS of them, each type's units stay contiguous (one block per type)."""
    types = [t for t in recipe if recipe[t] > 0]
    n = sum(recipe[t] for t in types)
    distinct = math.factorial(n)
    for t in types:
        distinct //= math.factorial(recipe[t])
    if distinct <= MAX_ORDERS:
        yield from _multiset_permutations(tuple(t for t in types for _ in range(recipe[t])))
        return
    for perm in itertools.permutations(types):
        yield tuple(t for t in perm for _ in range(recipe[t]))


def _multiset_permutations(items: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    if not items:
        yield ()
        return
    for head in dict.fromkeys(items):
        rest = list(items)
        rest.remove(head)
        for tail in _multiset_permutations(tuple(rest)):
            yield (head, *tail)


def unit_index(layout: str, replica: int, i: int, per_replica: int, dp: int) -> int:
    """Which unit of its class's pool is the i-th unit of that class in `replica` (of
    `dp`, `per_replica` units of the class each): unit r·k + i in the "pipeline" layout
    (a pipeline's units sit together, node by node, so stage-to-stage traffic stays
    inside nodes), i·dp + r in the "stage" layout (Megatron's rank order: the replicas
    of one stage sit together, so the gradient all-reduce stays inside nodes)."""
    return replica * per_replica + i if layout == "pipeline" else i * dp + replica


def layouts(dp: int, recipe: dict[str, int], ep: int = 1) -> tuple[str, ...]:
    """How replicas take units: "pipeline" (each replica's units together) and, with
    several replicas taking several units of some type, "stage" (the replicas of each
    stage together; with one unit per type per replica both give the same units). With
    expert parallelism (`ep` > 1) only "stage": Megatron's rank order (tp-cp-ep-dp-pp)
    puts an expert-parallel group's replicas side by side, so its all-to-all stays inside
    as few nodes as it can."""
    distinct = dp > 1 and any(k > 1 for k in recipe.values())
    if ep > 1:
        return ("stage",) if distinct else ("pipeline",)
    return ("pipeline", "stage") if distinct else ("pipeline",)
