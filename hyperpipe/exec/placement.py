"""Where each stage of a plan runs: the rank layout of a real run.

Rank r runs device ``plan.devices[r]``: pipelines in order, and inside a pipeline its
devices in stage order, so pipeline i owns ranks ``[offset_i, offset_i + p_i)``. Stage k
of a pipeline with p ranks lives on its rank ``k % p`` (looped placement, as in the
schedule IR). Pure functions of the plan: no torch, no processes.

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

from hyperpipe.errors import BadInput
from hyperpipe.plan.plan import Plan


@dataclass(frozen=True)
class RankPlacement:
    """What one rank holds: its pipeline, its position in it, its stages."""

    rank: int
    device: str
    pipeline: int                   # index into plan.pipelines
    pipe_rank: int                  # d: position among the pipeline's p ranks
    num_pipe_ranks: int             # p
    first_rank: int                 # global rank of the pipeline's pipe_rank 0
    stages: tuple[int, ...]         # the stage indices this rank runs (d, d + p, ...)
    sample_offset: int              # first sample of the global batch this pipeline takes

    def rank_of_stage(self, stage: int) -> int:
        """Global rank that runs `stage` of this rank's pipeline."""
        return self.first_rank + stage % self.num_pipe_ranks


def placements(plan: Plan) -> list[RankPlacement]:
    """One RankPlacement per rank, in rank order (= plan.devices order)."""
    out: list[RankPlacement] = []
    offset = 0
    for i, pipe in enumerate(plan.pipelines):
        p = len(pipe.stages) // plan.chunks
        first = len(out)
        for d in range(p):
            device = pipe.stages[d].devices[0]
            stages = tuple(range(d, len(pipe.stages), p))
            out.append(RankPlacement(first + d, device, i, d, p, first, stages, offset))
        offset += pipe.samples
    return out


def check_runnable(plan: Plan) -> None:
    """Raise BadInput for what the real executor cannot run (the plan itself is checked by
    `Plan.check`): tensor parallelism is simulated only."""
    for i, pipe in enumerate(plan.pipelines):
        for k, st in enumerate(pipe.stages):
            if st.tp != 1:
                raise BadInput(f"plan: pipelines[{i}].stages[{k}].tp", "1 for a real run "
                               "(tensor parallelism is simulated only)", st.tp)


def layer_holders(plan: Plan) -> dict[int, tuple[int, ...]]:
    """Layer index -> sorted ranks holding it (one per pipeline)."""
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
    that hold the same layers. Pipelines may cut the model differently (heterogeneous
    data parallelism), so layers are grouped by the exact set of ranks that hold them;
    each group all-reduces the gradients of its layers. Ordered by first layer, which is
    the order every rank runs them in (a global order, so the collectives cannot
    deadlock)."""
    by_ranks: dict[tuple[int, ...], list[int]] = {}
    for layer, ranks in layer_holders(plan).items():
        if len(ranks) > 1:
            by_ranks.setdefault(ranks, []).append(layer)
    groups = [(ranks, tuple(layers)) for ranks, layers in by_ranks.items()]
    return sorted(groups, key=lambda g: g[1][0])


def adjacent_pairs(plan: Plan) -> list[tuple[int, int]]:
    """Pairs of distinct ranks (lower rank first) that hold adjacent stages, each pair
    once, sorted: the links activations and gradients cross."""
    pairs: dict[tuple[int, int], None] = {}
    for r in placements(plan):
        n_stages = len(plan.pipelines[r.pipeline].stages)
        for s in r.stages:
            if s + 1 < n_stages:
                nxt = r.rank_of_stage(s + 1)
                if nxt != r.rank:
                    pairs.setdefault((min(r.rank, nxt), max(r.rank, nxt)), None)
    return sorted(pairs)
