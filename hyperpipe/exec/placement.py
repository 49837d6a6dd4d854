"""Where each stage of a plan runs: the rank layout of a real run.

Rank r runs device ``plan.devices[r]``: pipelines in order, and inside a pipeline its
devices in stage order. A pipeline has p positions (stages / chunks); position d is the
tensor-parallel group of stage d's devices (one rank for tp = 1), and stage k lives on
position ``stage_rank(k, p, placement)``: ``k % p`` (looped), or in a V for zb-v /
dualpipe-v (position d holds stages d and 2p - 1 - d), as in the schedule IR. Pure
functions of the plan: no torch, no processes.

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
from hyperpipe.plan.plan import Plan, pipeline_placement
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
            for t, device in enumerate(pipe.stages[d].devices):
                out.append(RankPlacement(groups[d][t], device, i, d, p, first, stages, offset,
                                         tuple(groups), t, placement))
        offset += pipe.samples
    return out


def check_runnable(plan: Plan, spec: ModelSpec) -> None:
    """Raise BadInput for what the real executor cannot run (the plan itself is checked by
    `Plan.check`): a tensor-parallel degree that does not divide the model's heads,
    feed-forward width or (with sequence parallelism) sequence; a layer whose
    data-parallel replicas differ in tensor-parallel degree; ZeRO 2/3 and context
    parallelism, which it does not run yet."""
    if plan.zero >= 2:
        raise BadInput(f"{plan.source}: zero", "0 or 1: the executor does not run zero 2/3 "
                       "or cp yet", plan.zero)
    degree: dict[int, tuple[int, str]] = {}
    for i, pipe in enumerate(plan.pipelines):
        for k, st in enumerate(pipe.stages):
            where = f"{plan.source}: pipelines[{i}].stages[{k}]"
            if st.cp > 1:
                raise BadInput(f"{where}.cp", "1: the executor does not run zero 2/3 or cp "
                               "yet", st.cp)
            for layer in range(*st.layers):
                seen = degree.setdefault(layer, (st.tp, where))
                if seen[0] != st.tp:
                    raise BadInput(f"{where}.tp", f"tp={seen[0]} as in {seen[1]} (data-"
                                   f"parallel replicas of layer {layer} must shard it alike "
                                   "for a real run)", st.tp)
            if st.tp == 1:
                continue
            c = spec.config
            sizes = [("n_head", c.n_head), ("n_kv_head", c.n_kv_head),
                     ("ffn_hidden", c.ffn_hidden)] if c is not None else \
                [("hidden", spec.layers[layer].hidden) for layer in range(*st.layers)]
            if st.sequence_parallel:
                sizes.append(("seq_len", spec.seq_len))
            for name, size in sizes:
                if size is not None and size % st.tp:
                    raise BadInput(f"{where}.tp", f"a divisor of the model's {name} ({size}) "
                                   "for a real run", st.tp)


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
    that hold the same shard of the same layers (same layers, same tensor-parallel index).
    Pipelines may cut the model differently (heterogeneous data parallelism), so layers
    are grouped by the exact set of ranks that hold them; each group reduces the
    gradients of its layers. Ordered by (first layer, ranks), the order every rank runs
    them in (a global order, so the collectives cannot deadlock)."""
    holders: dict[tuple[int, int], list[int]] = {}
    for r in placements(plan):
        pipe = plan.pipelines[r.pipeline]
        for s in r.stages:
            for layer in range(*pipe.stages[s].layers):
                holders.setdefault((layer, r.tp_index), []).append(r.rank)
    by_ranks: dict[tuple[int, ...], list[int]] = {}
    for (layer, _), ranks in sorted(holders.items()):
        if len(ranks) > 1:
            by_ranks.setdefault(tuple(sorted(ranks)), []).append(layer)
    groups = [(ranks, tuple(layers)) for ranks, layers in by_ranks.items()]
    return sorted(groups, key=lambda g: (g[1][0], g[0]))


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
