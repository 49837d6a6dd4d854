"""The search's long-sequence test (`space.attention_share`) counts MoE blocks'
attention: a model of MoE blocks only is long-sequence like its dense twin."""

from __future__ import annotations

import pytest

from hyperpipe.models import load_model
from hyperpipe.search import space
from hyperpipe.search.space import SearchConstraints


def _gpt(seq: int, **moe):
    doc = {"kind": "gpt", "name": "share", "vocab_size": 512, "n_layer": 4, "n_head": 8,
           "d_model": 512, "seq_len": seq, "ffn_hidden": 2048, "mlp": "swiglu"}
    if moe:
        doc["moe"] = moe
    return load_model(doc)


@pytest.mark.parametrize("seq", [1024, 65536])
def test_all_moe_model_counts_its_blocks_attention(seq):
    dense = _gpt(seq)
    # one expert of the dense width, top 1, no drops: an MoE block costs a dense one
    twin = _gpt(seq, experts=1, top_k=1, expert_hidden=2048, capacity_factor=None)
    assert all(layer.kind != "block" for layer in twin.layers)
    assert any(layer.kind == "moe" for layer in twin.layers)
    # closed form: 4 s^2 h of attention core over the block's forward FLOPs
    c = dense.config
    core = 4.0 * seq * seq * c.n_head * c.head_dim
    block = next(i for i, layer in enumerate(dense.layers) if layer.kind == "block")
    want = core / dense.layer_cost(block, 1).fwd_flops
    assert space.attention_share(dense) == pytest.approx(want, rel=1e-12)
    assert space.attention_share(twin) == pytest.approx(want, rel=1e-12)


def test_long_moe_sequence_offers_context_parallelism():
    c = SearchConstraints(global_batch=8)
    long = _gpt(262144, experts=8, top_k=2, expert_hidden=1024)
    assert space.attention_share(long) > space.ATTENTION_DOMINATES
    assert space.cp_options(long, c)[:2] == (1, 2)
    assert space.cp_options(_gpt(1024, experts=8, top_k=2, expert_hidden=1024), c) == (1,)
