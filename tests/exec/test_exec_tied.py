"""Tied embeddings in real runs (gloo, tiny-gpt with `tie_embeddings: true`, fp32).

Oracle: a single process training the whole tied model on the whole batch
(`build_model`, where the head's weight is the embedding's Parameter itself, and torch's
own AdamW). Every rank's copy of the matrix, the first stage's ``layers.0.wte.weight``
and the last stage's ``layers.7.lm_head.weight``, must carry the single matrix's
gradient (the sum of both uses) within 1e-5, every loss must match, and after two steps
both copies must still equal the single process's weights (within lr / 2, as in
test_exec_parallel: a missing or doubled sum moves a weight by lr or more). Without the
sum the head's copy would get only its own use's gradient, off by the embedding's.
"""

from __future__ import annotations

import pytest
from factories import plan_doc, single_process

from hyperpipe.exec import RunOptions, run_plan
from hyperpipe.models import build_model
from hyperpipe.plan.plan import plan_from_dict

pytestmark = pytest.mark.slow

TOL = 1e-5
LR = 1e-3
WEIGHT_TOL = LR / 2
TIED = {"preset": "tiny-gpt", "tie_embeddings": True}
SHARED = "layers.0.wte.weight"
HEAD = "layers.7.lm_head.weight"


def stage(layers, devices, **fields) -> dict:
    return {"layers": list(layers), "devices": [f"n/{d}" for d in devices],
            "tp": len(devices), **fields}


def check(pipelines, kind: str = "1f1b", steps: int = 2, **top):
    plan = plan_from_dict(plan_doc(pipelines, schedule=kind, model=TIED, **top))
    oracle = build_model(plan.load_model(), 0)        # the head's weight is the embedding's
    assert oracle.layers["7"].lm_head.weight is oracle.layers["0"].wte.weight
    result = run_plan(plan, RunOptions(steps=steps, emulate=False, capture_state=True,
                                       probe_links=False, lr=LR))
    losses, grads, weights = single_process(plan, steps, lr=LR)
    assert result.losses == pytest.approx(losses, abs=1e-5)
    seen = set()
    for rank_state in result.state:
        for name, st in rank_state.items():
            ref = SHARED if name == HEAD else name
            diff = (st["grad"] - grads[ref]).abs().max().item()
            assert diff <= TOL, (name, "grad", diff)
            diff = (st["param"] - weights[ref]).abs().max().item()
            assert diff <= WEIGHT_TOL, (name, "weight", diff)
            seen.add(name)
    assert seen == set(grads) | {HEAD}       # the head's copy was checked too


def test_two_stages_sum_the_copies_gradients_like_one_matrix():
    check([{"micro_batch": 2, "num_microbatches": 2,
            "stages": [stage((0, 4), (0,)), stage((4, 8), (1,))]}])


def test_unequal_replicas_with_the_distributed_optimizer():
    # two replicas cut differently, 2 and 3 micro-batches; tied copies on four ranks,
    # their gradients summed over both ends and both replicas in one all-reduce
    check([{"micro_batch": 2, "num_microbatches": 2,
            "stages": [stage((0, 3), (0,)), stage((3, 8), (1,))]},
           {"micro_batch": 1, "num_microbatches": 3,
            "stages": [stage((0, 5), (2,)), stage((5, 8), (3,))]}],
          distributed_optimizer=True)


def test_tensor_parallel_first_stage_feeding_a_plain_last_stage():
    # the embedding whole on both ranks of a tp=2 group (each adds half), the head alone
    check([{"micro_batch": 2, "num_microbatches": 2,
            "stages": [stage((0, 4), (0, 1)), stage((4, 8), (2,))]}], steps=1)


def test_replicas_of_different_tp_sum_their_copies_once_each():
    # the embedding whole on a tp=1 rank and on both ranks of a tp=2 replica (each adds
    # half): one matrix's gradient however the replicas shard the blocks
    check([{"micro_batch": 2, "num_microbatches": 2,
            "stages": [stage((0, 4), (0,)), stage((4, 8), (1,))]},
           {"micro_batch": 1, "num_microbatches": 2,
            "stages": [stage((0, 4), (2, 3)), stage((4, 8), (4,))]}])


def test_v_placement_holds_both_copies_on_one_rank():
    # zb-v: rank 0 holds stage 0 (the embedding) and stage 3 (the head) as two modules
    check([{"micro_batch": 1, "num_microbatches": 4,
            "stages": [stage((0, 2), (0,)), stage((2, 4), (1,)), stage((4, 6), (1,)),
                       stage((6, 8), (0,))]}], kind={"kind": "zb-v", "chunks": 2})
