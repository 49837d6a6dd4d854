"""Where each stage of a plan runs: the rank layout of a real run.

Rank r runs device ``plan.devices[r]``: pipelines in order, and inside a pipeline its
devices in stage order. A pipeline has p positions (stages / chunks); position d is the
tensor-parallel group of stage d's devices (one rank for tp = 1), and stage k lives on
position ``stage_rank(k, p, placement)``: ``k % p`` (looped), or in a V for zb-v /
dualpipe-v (position d holds stages d and 2p - 1 - d), as in the schedule IR. With
context parallelism (stage cp > 1, alike in every stage of a pipeline) a position's
devices are cp tensor-parallel groups, tensor rank innermost (device c·tp + t is tensor
rank t of context rank c), and each context rank's slice of the pipeline runs like a
pipeline of its own, joined to the others by its ring (`cp_ranks`) and by the
data-parallel groups, which sum over the context ranks too (dp x cp). Pure functions of
the plan: no torch, no processes.

>>> from hyperpipe.plan.plan import plan_from_dict
>>> plan = plan_from_dict({"format": "hyperpipe.plan/1", "model": "tiny-gpt",
...     "cluster": "demo-hetero", "global_batch": 4, "schedule": "1f1b",
...     "pipelines": [{"micro_batch": 1, "num_microbatches": 4, "stages": [
...         {"layers": [0, 5], "devices": ["a100/0"]},
...         {"layers": [5, 8], "devices": ["v100/0"]}]}]})
>>> [(r.rank, r.device, r.stages) for r in placements(plan)]
[(0, 'a100/0', (0,)), (1, 'v100/0', (1,))]
>>> dp_groups(plan)
[]
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperpipe.core.errors import BadInput
from hyperpipe.models.spec import ModelSpec
from hyperpipe.plan.plan import Plan, pipeline_placement, ring_member
from hyperpipe.plan.schedule import rank_stages, stage_rank


@dataclass(frozen=True)
class RankPlacement:
    """What one rank holds: its pipeline, its position in it, its stages, its place in
    the stage's tensor-parallel group."""

    rank: int
    device: str
    pipeline: int                   # index into plan.pipelines
    pipe_rank: int                  # d: position among the pipeline's p positions
    num_pipe_ranks: int             # p
    first_rank: int                 # global rank of the pipeline's first device
    stages: tuple[int, ...]         # the stage indices this rank runs (d, d + p, ...)
    sample_offset: int              # first sample of the global batch this pipeline takes
    # global ranks of each position's tensor-parallel group (one rank each when tp = 1)
    position_ranks: tuple[tuple[int, ...], ...] = ()
    tp_index: int = 0               # this rank's place in its tensor-parallel group
    placement: str = "loop"         # how the pipeline's chunks sit: "loop" or "v"
    # context parallelism: this rank's context rank, and its ring (the ranks of its
    # tensor index in every context rank of its stages, in context order). With cp > 1
    # `position_ranks` holds, for every position, the tensor-parallel group of this
    # rank's context rank: each context rank's slice of the pipeline exchanges its own
    # tokens' activations with the matching slice of the neighbouring stages.
    cp_index: int = 0
    cp_ranks: tuple[int, ...] = ()
    stage_ranks: tuple[int, ...] = ()   # every rank of this position (tp x cp)

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        """The tensor-parallel group of this rank's stages (this rank alone for tp = 1)."""
        return self.position_ranks[self.pipe_rank]

    def ranks_of_stage(self, stage: int) -> tuple[int, ...]:
        """Global ranks (the tensor-parallel group) that run `stage` of this pipeline."""
        return self.position_ranks[stage_rank(stage, self.num_pipe_ranks, self.placement)]

    def rank_of_stage(self, stage: int) -> int:
        """The rank of `stage` that exchanges messages with this rank: the one whose
        tensor-parallel index is this rank's modulo the stage's degree (see
        `message_pairs`)."""
        ranks = self.ranks_of_stage(stage)
        return ranks[self.tp_index % len(ranks)]

    def send_ranks(self, stage: int) -> tuple[int, ...]:
        """Ranks of `stage` to which this rank (of an adjacent stage) sends."""
        mine = self.tp_ranks
        return tuple(dst for src, dst in message_pairs(mine, self.ranks_of_stage(stage))
                     if src == self.rank)


def message_pairs(senders: tuple[int, ...], receivers: tuple[int, ...]
                  ) -> list[tuple[int, int]]:
    """(src, dst) of every message between two adjacent stages' tensor-parallel groups.

    Each stage's boundary tensor (activation or gradient) is whole on every rank of its
    group, so re-sharding across tp degrees is a choice of sender: receiver j takes it
    from sender ``j mod len(senders)``. A tp=2 stage feeding a tp=1 stage sends once
    (from its first rank); a tp=1 stage feeding a tp=2 stage sends to both.

    >>> message_pairs((0, 1), (2,)), message_pairs((2,), (0, 1))
    ([(0, 2)], [(2, 0), (2, 1)])
    """
    return [(senders[j % len(senders)], dst) for j, dst in enumerate(receivers)]


def placements(plan: Plan) -> list[RankPlacement]:
    """One RankPlacement per rank, in rank order (= plan.devices order)."""
    out: list[RankPlacement] = []
    offset = 0
    for i, pipe in enumerate(plan.pipelines):
        p = len(pipe.stages) // plan.chunks
        placement = pipeline_placement(plan, pipe)
        first = len(out)
        groups, r = [], first
        for d in range(p):
            groups.append(tuple(range(r, r + len(pipe.stages[d].devices))))
            r += len(pipe.stages[d].devices)
        for d in range(p):
            stages = rank_stages(d, p, plan.chunks, placement)
            cp = pipe.stages[d].cp          # alike in every stage (check_runnable)
            for t, device in enumerate(pipe.stages[d].devices):
                c, ti = divmod(t, len(groups[d]) // cp)       # tensor rank innermost
                mine = tuple(_context_slice(g, cp, c) for g in groups)
                ring = tuple(groups[d][j * (len(groups[d]) // cp) + ti] for j in range(cp))
                out.append(RankPlacement(groups[d][t], device, i, d, p, first, stages, offset,
                                         mine, ti, placement, c, ring, groups[d]))
        offset += pipe.samples
    return out


def _context_slice(group: tuple[int, ...], cp: int, c: int) -> tuple[int, ...]:
    """Context rank c's tensor-parallel group among a stage's tp x cp ranks."""
    tp = len(group) // cp
    return group[c * tp:(c + 1) * tp]


def cp_rings(plan: Plan) -> list[tuple[int, ...]]:
    """Every context-parallel ring of two or more ranks (exec.context_parallel), each in
    context order, sorted: the order in which every rank creates their process groups."""
    return sorted({r.cp_ranks for r in placements(plan) if len(r.cp_ranks) > 1})


def check_runnable(plan: Plan, spec: ModelSpec) -> None:
    """Raise BadInput for what the real executor cannot run (the plan itself is checked by
    `Plan.check`): a tensor-parallel degree that does not divide the model's heads,
    feed-forward width or (with sequence parallelism) sequence; a layer whose
    data-parallel replicas differ in tensor-parallel degree where a degree does not
    divide the largest, or with zero, context parallelism on the layer or expert
    parallelism in the plan (`_check_mixed_tp`); a ZeRO-2/3 plan it cannot shard
    (`check_sharding`); stages of one pipeline that differ in cp, and cp with
    attention dropout (the ring attention has none); uneven sharding; expert parallelism
    with a dispatcher other than "alltoall"."""
    dispatcher = plan.runtime_settings().moe_dispatcher
    if dispatcher != "alltoall" and any(st.ep > 1 for pipe in plan.pipelines
                                        for st in pipe.stages):
        raise BadInput(f"{plan.source}: runtime.moe_dispatcher", "'alltoall' for a real "
                       "run (the executor sends one copy per routed token-expert pair with "
                       "all_to_all_single)", dispatcher)
    shard = plan.runtime_settings().shard
    if shard != "even" and plan.zero >= 1:
        raise BadInput(f"{plan.source}: runtime.shard", "'even' for a real run (the "
                       "executor shards every data-parallel group evenly)", shard)
    if plan.zero >= 2:
        check_sharding(plan, spec)
    degrees: dict[int, list[tuple[int, str]]] = {}     # layer -> its holders' (tp, where)
    for i, pipe in enumerate(plan.pipelines):
        for k, st in enumerate(pipe.stages):
            where = f"{plan.source}: pipelines[{i}].stages[{k}]"
            if st.cp != pipe.stages[0].cp:
                raise BadInput(f"{where}.cp", f"cp={pipe.stages[0].cp} as in stage 0 (a real "
                               "run passes each context rank's tokens to the matching "
                               "context rank of the next stage)", st.cp)
            if st.cp > 1 and spec.config is not None and spec.config.dropout > 0:
                raise BadInput(f"{where}.cp", "1 with attention dropout (the executor's ring "
                               "attention has none)", st.cp)
            for layer in range(*st.layers):
                degrees.setdefault(layer, []).append((st.tp, where))
            if st.tp == 1 or spec.config is not None:    # GPT models: `Plan.check`
                continue
            sizes = [("hidden", spec.layers[layer].hidden) for layer in range(*st.layers)]
            if st.sequence_parallel:      # each context rank's tokens, split over tp
                sizes.append(("seq_len / cp", spec.seq_len // st.cp))
            for name, size in sizes:
                if size is not None and size % st.tp:
                    raise BadInput(f"{where}.tp", f"a divisor of the model's {name} ({size}) "
                                   "for a real run", st.tp)
    for layer, held in degrees.items():
        _check_mixed_tp(plan, layer, held)


def _check_mixed_tp(plan: Plan, layer: int, held: list[tuple[int, str]]) -> None:
    """BadInput unless the executor can reduce `layer`'s gradients over its holders,
    (tp, where) of each stage holding it: one degree, or degrees that divide the largest
    (the rings of `dp_slices`) with zero 0, no context parallelism on the layer and no
    expert parallelism in the plan."""
    largest, there = max(held)
    if all(tp == largest for tp, _ in held):
        return
    for tp, where in held:
        if tp == largest:
            continue
        why = None
        if largest % tp:
            why = f"a divisor of tp={largest} as in {there}"
        elif plan.zero:
            why = f"tp={largest} as in {there} with zero {plan.zero}"
        elif any(st.cp > 1 for pipe in plan.pipelines for st in pipe.stages
                 if st.layers[0] <= layer < st.layers[1]):
            why = f"tp={largest} as in {there} with context parallelism"
        elif any(st.ep > 1 for pipe in plan.pipelines for st in pipe.stages):
            # expert parallelism anywhere regroups every layer's reduction by
            # tensor index (`experts.reduction_groups`), which has no rings of slices
            why = f"tp={largest} as in {there} in a plan with expert parallelism"
        if why is not None:
            raise BadInput(f"{where}.tp", f"{why}, or one degree: the data-parallel "
                           f"replicas of layer {layer} differ in tensor-parallel degree, "
                           "which a real run reduces in rings of the largest only with "
                           "zero 0 and no context or expert parallelism", tp)


def check_sharding(plan: Plan, spec: ModelSpec) -> None:
    """BadInput for a ZeRO-2/3 plan the executor cannot run: replicas cut or
    micro-batched differently (a stage's group gathers and reduce-scatters once per
    micro-batch, alike on every replica); and with ZeRO-3 (torch FSDP2, exec.fsdp)
    tensor parallelism, tied embeddings, or a schedule that splits the backward into I
    and W (FSDP2 reduce-scatters a unit when its whole backward has run)."""
    from hyperpipe.plan.plan import schedule_for
    first = plan.pipelines[0]
    for i, pipe in enumerate(plan.pipelines):
        where = f"{plan.source}: pipelines[{i}]"
        if [st.layers for st in pipe.stages] != [st.layers for st in first.stages]:
            raise BadInput(f"{where}.stages", f"the layer ranges of pipelines[0] with zero "
                           f"{plan.zero} (a real run shards each stage over its replicas)",
                           [list(st.layers) for st in pipe.stages])
        if pipe.num_microbatches != first.num_microbatches:
            raise BadInput(f"{where}.num_microbatches", f"{first.num_microbatches} as in "
                           f"pipelines[0] with zero {plan.zero} (every replica reduce-"
                           "scatters once per micro-batch)", pipe.num_microbatches)
        if plan.zero < 3:
            continue
        for k, st in enumerate(pipe.stages):
            if st.tp > 1:
                raise BadInput(f"{where}.stages[{k}].tp", "1 with zero 3 (the executor does "
                               "not run FSDP with tensor parallelism yet)", st.tp)
        if any(a.op == "I" for row in schedule_for(plan, i).actions for a in row):
            raise BadInput(f"{plan.source}: schedule", "a kind without an I/W split with "
                           "zero 3 (FSDP2 reduce-scatters after a unit's whole backward)",
                           plan.schedule)
    if plan.zero == 3 and spec.tied_params:
        raise BadInput(f"{plan.source}: model", "untied embeddings with zero 3 (the "
                       "executor does not run FSDP with tied embeddings yet)", spec.name)


def layer_holders(plan: Plan) -> dict[int, tuple[int, ...]]:
    """Layer index -> sorted ranks holding it (every rank of its tensor-parallel groups)."""
    holders: dict[int, list[int]] = {}
    for r in placements(plan):
        pipe = plan.pipelines[r.pipeline]
        for s in r.stages:
            a, b = pipe.stages[s].layers
            for layer in range(a, b):
                holders.setdefault(layer, []).append(r.rank)
    return {layer: tuple(sorted(ranks)) for layer, ranks in sorted(holders.items())}


def dp_groups(plan: Plan) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Data-parallel reduction groups: (ranks, layers) for every set of two or more ranks
    that reduce the same slice of the same layers' gradients (`_dp_rings`). Pipelines
    may cut the model differently (heterogeneous data parallelism), so layers are grouped
    by the exact set of ranks that hold them; each group reduces the gradients of its
    layers. Ordered by (first layer, ranks), the order every rank runs them in (a global
    order, so the collectives cannot deadlock)."""
    return sorted(((ranks, tuple(layers)) for (ranks, _, _), layers in _dp_rings(plan).items()),
                  key=lambda g: (g[1][0], g[0]))


def dp_slices(plan: Plan, rank: int) -> dict[tuple[tuple[int, ...], tuple[int, ...]],
                                             tuple[int, int]]:
    """(parts, index) of each of `rank`'s data-parallel groups (keyed as `dp_groups`
    lists them) whose layers' replicas differ in tensor-parallel degree and where this
    rank's degree t is below the largest, T: its local gradients split into parts = T / t
    equal slices (tensor-parallel layout of degree T within its own shard), and the group
    reduces slice `index`. Groups left out reduce the whole local gradients."""
    degree = {layer: st.tp for r in placements(plan) if r.rank == rank
              for s in r.stages for st in [plan.pipelines[r.pipeline].stages[s]]
              for layer in range(*st.layers)}
    out = {}
    for (ranks, largest, ring), layers in _dp_rings(plan).items():
        if rank in ranks and degree[layers[0]] < largest:
            parts = largest // degree[layers[0]]
            out[ranks, tuple(layers)] = (parts, ring % parts)
    return out


def _dp_rings(plan: Plan) -> dict[tuple[tuple[int, ...], int, int], list[int]]:
    """(ranks, T, i) -> layers. For each layer, T is the largest tensor-parallel degree
    among the stages holding it, and ring i < T joins every holding rank whose tensor
    index is `ring_member(i, t, T)` (t: its stage's degree; `check_runnable` has t
    divide T): the rank that holds slice i of the layer as a degree-T group shards it.
    With one degree ring i is tensor index i of every replica and context rank (dp x cp),
    as in Megatron-LM. Rings of one rank are left out."""
    holders: dict[int, list[tuple[int, int, int]]] = {}    # layer -> (rank, t, index)
    for r in placements(plan):
        pipe = plan.pipelines[r.pipeline]
        for s in r.stages:
            st = pipe.stages[s]
            for layer in range(*st.layers):
                holders.setdefault(layer, []).append((r.rank, st.tp, r.tp_index))
    rings: dict[tuple[tuple[int, ...], int, int], list[int]] = {}
    for layer in sorted(holders):
        largest = max(t for _, t, _ in holders[layer])
        for i in range(largest):
            ranks = tuple(sorted(rank for rank, t, j in holders[layer]
                                 if j == ring_member(i, t, largest)))
            if len(ranks) > 1:
                rings.setdefault((ranks, largest, i), []).append(layer)
    return rings


def adjacent_pairs(plan: Plan) -> list[tuple[int, int]]:
    """Pairs of distinct ranks (lower rank first) that exchange activations and gradients
    (`message_pairs` between adjacent stages), each pair once, sorted."""
    pairs: dict[tuple[int, int], None] = {}
    for r in placements(plan):
        if r.tp_index:
            continue
        n_stages = len(plan.pipelines[r.pipeline].stages)
        for s in r.stages:
            if s + 1 < n_stages:
                here, there = r.ranks_of_stage(s), r.ranks_of_stage(s + 1)
                for a, b in message_pairs(here, there) + message_pairs(there, here):
                    if a != b:
                        pairs.setdefault((min(a, b), max(a, b)), None)
    return sorted(pairs)


def tp_groups(plan: Plan) -> list[tuple[int, ...]]:
    """Every tensor-parallel group of two or more ranks, in rank order."""
    seen = {r.tp_ranks for r in placements(plan) if len(r.tp_ranks) > 1}
    return sorted(seen)


@dataclass(frozen=True)
class ExpertGroup:
    """One expert-parallel group: the ranks of a stage's layer range (tensor index
    `tp_index`) that share its MoE blocks' experts; ranks[i] holds experts
    [i·E/ep, (i+1)·E/ep)."""

    layers: tuple[int, int]
    tp_index: int
    ranks: tuple[int, ...]


def expert_groups(plan: Plan) -> list[ExpertGroup]:
    """Every expert-parallel group of the plan (stages with ep > 1), sorted: the order in
    which every rank creates their process groups."""
    members: dict[tuple[tuple[int, int], int], list[tuple[int, int]]] = {}
    degree: dict[tuple[int, int], int] = {}
    for r in placements(plan):
        pipe = plan.pipelines[r.pipeline]
        for s in r.stages:
            st = pipe.stages[s]
            if st.ep > 1:
                members.setdefault((st.layers, r.tp_index), []).append((r.pipeline, r.rank))
                degree[st.layers] = st.ep
    out = []
    for (layers, t), found in sorted(members.items()):
        ranks = [rank for _, rank in sorted(found)]
        ep = degree[layers]
        out += [ExpertGroup(layers, t, tuple(ranks[i:i + ep]))
                for i in range(0, len(ranks), ep)]
    return out
