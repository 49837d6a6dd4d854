"""The inputs of experiments/published_gpus.py: Lambda's single-GPU BERT-Large runs and
the model the script makes of them, checked against what the sources print."""

from __future__ import annotations

import pytest
from factories import experiment

from hyperpipe.sim.costmodel import CostModel

# BERT-Large uncased for SQuAD as DeepLearningExamples builds it, whose log prints
# `model_weights_num : 335150082`: embeddings (30,528 padded word ids, 512 positions,
# 2 token types, a LayerNorm), 24 blocks, the pooler (1024 x 1024 + bias) and the QA
# head (1024 x 2 + bias).
BERT_PARAMS = 335_150_082
EMBEDDINGS = (30_528 + 512 + 2) * 1024 + 2 * 1024
POOLER = 1024 * 1024 + 1024
QA_HEAD = 1024 * 2 + 2


@pytest.fixture(scope="module")
def script():
    return experiment("published_gpus")


def test_the_model_holds_bert_larges_blocks(script):
    """The spec's 24 blocks hold exactly what the printed parameter count leaves after
    the embeddings, the pooler and the QA head."""
    model = script.bert_large()
    cost = CostModel(model, script.one_gpu("A100-80GB"))
    blocks = [i for i, spec in enumerate(model.layers) if spec.kind == "block"]
    assert len(blocks) == 24
    assert cost.stage_params((blocks[0], blocks[-1] + 1)) == \
        BERT_PARAMS - EMBEDDINGS - POOLER - QA_HEAD


def test_every_row_is_one_catalog_gpu_of_a_known_table(script):
    rows = script.load_rows()
    assert {r.table for r in rows} == {t for _, t, _ in script.BLOCKS if t is not None}
    assert {r.precision for r in rows} == {p for *_, p in script.BLOCKS}
    assert len(rows) == 27
    for row in rows:
        cluster = script.one_gpu(row.device)
        assert cluster.devices[0].type.name == row.device
        assert row.batch > 0 and row.seq_per_s > 0


def test_leave_one_out_null_excludes_the_row_itself(script):
    """Each row's null is its scale times the mean of the others' ratios (written out
    for three rows)."""
    Row = script.Row
    rows = [Row("a", "x", 1, 10.0, "t", "fp16"), Row("b", "y", 1, 30.0, "t", "fp16"),
            Row("c", "z", 1, 20.0, "t", "fp16")]
    scale = {"x": 1.0, "y": 2.0, "z": 4.0}.__getitem__
    got = script.leave_one_out(rows, lambda r: scale(r.device))
    assert got == pytest.approx([1.0 * (15 + 5) / 2, 2.0 * (10 + 5) / 2,
                                 4.0 * (10 + 15) / 2])
