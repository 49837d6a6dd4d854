"""Data-parallel replicas that move alike, so that each class is computed once.

* `replica_classes` (the simulator's): replicas alike in everything that sets their
  timing (shapes, device types, slowdowns, links), refined until the replicas their
  point-to-point hops are shared with are alike too; every member of a class then moves
  exactly as its first member (its representative) does.
* `shape_classes` (the analytic tier's): replicas alike in micro-batches, cuts, tensor
  parallelism, memory modes and device types (with slowdowns); links are not compared,
  as the analytic tier leaves link sharing between replicas out.
* `stage_holding`: which stage of a pipeline holds a layer (replicas may cut
  differently; the data-parallel all-reduce pairs the stages that hold a layer range).

Classes are lists of pipeline indices, in order of first member; deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise, repeat
from operator import attrgetter, eq, itemgetter

from hyperpipe.core.errors import BadInput
from hyperpipe.plan.plan import PipelinePlan, Plan, StagePlan, schedule_for
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.network import count_hops, p2p_edges


def stage_holding(stages: Sequence[StagePlan], layer: int) -> int:
    """Index of the stage whose (half-open) layer range holds `layer`."""
    for k, s in enumerate(stages):
        if s.layers[0] <= layer < s.layers[1]:
            return k
    raise BadInput("plan stages", f"a stage holding layer {layer}", has_got=False)


def replica_classes(plan: Plan, cost: CostModel) -> list[list[int]]:
    """Pipelines grouped by everything that sets their timing (colour refinement).

    Two replicas are alike when their own shapes, device types, slowdowns and links are,
    and, refined until stable, when the replicas their point-to-point hops are shared
    with are alike too: the neighbours of a straggler's replica on a shared NIC see its
    traffic out of step with the rest, so they get a class of their own.
    """
    cluster = cost.cluster
    groups: dict[tuple, list[int]] = {}
    hops_of: list[tuple[str, ...]] = []
    for q, pipe in enumerate(plan.pipelines):
        st = pipe.stages
        edges = [(a, b) for x, y in pairwise(st) for a, b in p2p_edges(x.devices, y.devices)]
        # Kind synth: each pipeline replays its own lists, so they join the key.
        own = schedule_for(plan, q).actions if plan.actions else None
        key = (own, pipe.micro_batch, pipe.num_microbatches,
               tuple((s.layers, s.tp, s.cp, s.recompute, s.sequence_parallel,
                      cluster.device(s.devices[0]).type.name, cluster.slowdown(s.devices),
                      tuple(cost.route(a, b).link for a, b in pairwise(s.devices)))
                     for s in st),
               tuple((cost.route(a, b).link, len(cost.route(a, b).route.hops))
                     for a, b in edges))
        groups.setdefault(key, []).append(q)
        hops_of.append(tuple(count_hops(cost, edges)))
    classes = list(groups.values())
    if len(classes) == 1:
        return classes
    sharing: dict[str, list[int]] = {}
    for q, hops in enumerate(hops_of):
        for hop in hops:
            sharing.setdefault(hop, []).append(q)
    while True:
        colour = [0] * len(plan.pipelines)
        for c, members in enumerate(classes):
            for q in members:
                colour[q] = c
        refined: dict[tuple, list[int]] = {}
        for members in classes:
            for q in members:
                seen = tuple(sorted(colour[r] for hop in hops_of[q] for r in sharing[hop]
                                    if r != q))
                refined.setdefault((colour[q], seen), []).append(q)
        if len(refined) == len(classes):
            return classes
        classes = sorted(refined.values())


def shape_classes(plan: Plan, type_names: Mapping[str, str]) -> dict[tuple, list[int]]:
    """Pipelines grouped by micro-batches, cuts, tp, memory modes and device types
    (`type_names`: device -> its type's name, slowdown included; KeyError for a device
    not in it). C-level maps where it can: this sees every stage of a 1024-GPU plan."""
    pipes = plan.pipelines
    if _all_alike(pipes, type_names, len(pipes[0].stages) // plan.chunks):
        return {(): list(range(len(pipes)))}
    classes: dict[tuple, list[int]] = {}
    for q, pipe in enumerate(pipes):
        st = pipe.stages
        key = (pipe.micro_batch, pipe.num_microbatches, tuple(map(_LAYERS, st)),
               tuple(map(_TP, st)),
               tuple(map(type_names.__getitem__, map(_FIRST, map(_DEVICES, st)))),
               tuple(map(_MEMORY_MODE, st)))
        classes.setdefault(key, []).append(q)
    return classes


def _all_alike(pipes: Sequence[PipelinePlan], type_names: Mapping[str, str], p: int) -> bool:
    """Whether every pipeline has the same micro-batches, cuts, tp and device types per
    stage: one column at a time, with C-level maps (the common data-parallel case).
    Device types are checked on the first `p` stages: chunk c's stages sit on the same
    devices (looped placement, `Plan.check`)."""
    if len(set(map(_MB, pipes))) > 1 or len(set(map(_M, pipes))) > 1 or \
            len(set(map(len, map(_STAGES, pipes)))) > 1:
        return False
    for k, column in enumerate(zip(*[p.stages for p in pipes], strict=True)):
        head = column[0]
        if not all(map(eq, map(_LAYERS, column), repeat(head.layers))) or \
                not all(map(eq, map(_TP, column), repeat(head.tp))) or \
                not all(map(eq, map(_MEMORY_MODE, column), repeat(_MEMORY_MODE(head)))):
            return False
        if k < p and not all(map(eq, map(type_names.__getitem__,
                                         map(_FIRST, map(_DEVICES, column))),
                                 repeat(type_names[head.devices[0]]))):
            return False
    return True


_LAYERS, _TP, _DEVICES, _FIRST = (attrgetter("layers"), attrgetter("tp"),
                                  attrgetter("devices"), itemgetter(0))
_MEMORY_MODE = attrgetter("recompute", "sequence_parallel", "cp")
_MB, _M, _STAGES = (attrgetter("micro_batch"), attrgetter("num_microbatches"),
                    attrgetter("stages"))
