"""Tied embeddings in a real run (`GPTConfig.tie_embeddings`): the copies of the one
embedding matrix that the ranks hold, and the sum of their gradients every step.

The first stage's ``wte.weight`` and the last stage's ``lm_head.weight`` start equal
(`hyperpipe.models.gpt.build_layer`), and a stage holding both has one Parameter. Each
step, after the backward and before the optimizer, one all-reduce over every rank that
holds a copy sums their gradients, so that every copy gets the gradient of the single
matrix of the whole model and AdamW keeps them equal. Megatron-LM does this in two
steps (the data-parallel reduction, then `_allreduce_word_embedding_grads` over its
embedding group of first and last pipeline rank, megatron/core/distributed/
finalize_model_grads.py; DeepSpeed's `ReduceTiedGrads` likewise); summing over all the
copies at once gives the same sum, so `DataParallel` leaves these parameters out of its
buckets. Embedding and head stay whole on every rank of a tensor-parallel group
(`hyperpipe.exec.tensor_parallel`), each holding the whole gradient, so each rank adds
1/tp of it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from hyperpipe.exec.collectives import RingCollectives
from hyperpipe.exec.comm import wait
from hyperpipe.exec.placement import RankPlacement, placements
from hyperpipe.models.gpt import tied_parameters
from hyperpipe.models.spec import ModelSpec
from hyperpipe.plan.plan import Plan


def tied_ranks(plan: Plan, spec: ModelSpec) -> tuple[int, ...]:
    """Global ranks holding a copy of a tied embedding matrix (the embedding, layer 0, or
    the head, the last layer), sorted; empty when the model's embeddings are untied."""
    if not spec.tied_params:
        return ()
    last = spec.num_layers
    out = []
    for r in placements(plan):
        stages = plan.pipelines[r.pipeline].stages
        if any(stages[s].layers[0] == 0 or stages[s].layers[1] == last for s in r.stages):
            out.append(r.rank)
    return tuple(sorted(out))


class TiedEmbedding:
    """This rank's copies of a tied embedding matrix and their gradients' sum.

    Every rank of the job constructs it at the same time, after its stages and before
    `DataParallel` (its process group is created collectively)."""

    def __init__(self, plan: Plan, spec: ModelSpec, where: RankPlacement,
                 modules: list[nn.Module], timeout_s: float, links=None,
                 nodes: list[str] | tuple[str, ...] = (),
                 switch_nodes: frozenset[str] = frozenset()):
        self._timeout_s = timeout_s
        ranks = tied_ranks(plan, spec)
        self._group = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s)) \
            if len(ranks) > 1 else None
        self._member = where.rank in ranks and self._group is not None
        # emulated links (exec.links): the sum runs as its ring steps over them
        self._ring = RingCollectives(ranks, self._group, where.rank, nodes, links,
                                     timeout_s, ("tied",), switch_nodes) \
            if links is not None and self._member else None
        seen: set[int] = set()
        self.params = [p for m in modules for p in tied_parameters(m)
                       if not (id(p) in seen or seen.add(id(p)))]
        self._share = 1.0 / len(where.tp_ranks)     # each tp rank holds the whole gradient

    @torch.no_grad()
    def reduce(self) -> None:
        """Give every copy this rank holds the sum of all copies' gradients (over both
        ends of every pipeline and every data-parallel replica)."""
        if not self.params or (self._group is None and len(self.params) == 1):
            return
        total = torch.zeros_like(self.params[0])
        for p in self.params:
            if p.grad is not None:
                total += p.grad
        total *= self._share
        if self._ring is not None:
            self._ring.all_reduce(total).result(timeout=self._timeout_s)
        elif self._member:
            wait(dist.all_reduce(total, group=self._group, async_op=True), self._timeout_s,
                 "tied-embedding gradient sum")
        for p in self.params:
            p.grad = total.clone()
