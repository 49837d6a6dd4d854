"""MoE blocks in the model spec: FLOPs, parameters, stash and per-expert loads against
closed forms written out here, and the dense-equivalent MoE against the dense block."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hyperpipe.core.errors import BadInput
from hyperpipe.models.ops import layer_work, routed_expert_work
from hyperpipe.models.spec import GPTConfig, MoEBlock, MoEConfig, TransformerBlock, gpt_spec


def _config(mlp="gelu", bias=True, attention="flash", **moe) -> GPTConfig:
    return GPTConfig(vocab_size=128, n_layer=4, n_head=4, d_model=64, seq_len=32, mlp=mlp,
                     bias=bias, attention=attention, ffn_hidden=256,
                     moe=MoEConfig(**moe) if moe else None)


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_dense_equivalent_moe_costs_exactly_a_dense_block(mlp, attention):
    c = _config(mlp, attention=attention, experts=1, top_k=1, expert_hidden=256,
                capacity_factor=None)
    moe, dense = MoEBlock(c), TransformerBlock(replace(c, moe=None))
    assert moe.params == dense.params == moe.active_params
    for b in (1, 3):
        assert moe.cost(b, 32, 2) == dense.cost(b, 32, 2)
        for tp, sp, rc in ((1, False, "none"), (2, True, "selective"), (4, False, "full")):
            assert moe.stash_bytes(b, 32, 2, tp=tp, sequence_parallel=sp, recompute=rc) == \
                dense.stash_bytes(b, 32, 2, tp=tp, sequence_parallel=sp, recompute=rc)
        for op in "FIW":
            for tp in (1, 2):
                got, want = layer_work(moe, op, b, 32, 2, tp), layer_work(dense, op, b, 32, 2, tp)
                assert got.flops == pytest.approx(want.flops, rel=1e-12)
                assert got.mem_bytes == pytest.approx(want.mem_bytes, rel=1e-12)


def _loads_oracle(tokens, experts, top_k, imbalance, cf):
    """Per-expert pairs written out one expert at a time: the busiest at imbalance x
    mean, the others sharing the rest, each capped at capacity."""
    mean = tokens * top_k / experts
    loads = [imbalance * mean] + [(tokens * top_k - imbalance * mean) / (experts - 1)] * \
        (experts - 1)
    cap = float("inf") if cf is None else cf * mean
    return [min(x, cap) for x in loads]


@pytest.mark.parametrize("experts,top_k,imbalance,cf", [
    (8, 2, 1.25, None), (8, 2, 1.25, 1.0), (4, 1, 2.0, 1.0), (16, 4, 1.5, 1.25),
    (4, 2, 1.0, 0.5)])
def test_routed_pairs_and_rank_pairs_match_the_per_expert_loads(experts, top_k, imbalance,
                                                                cf):
    m = MoEConfig(experts=experts, top_k=top_k, expert_hidden=8, capacity_factor=cf,
                  imbalance=imbalance)
    loads = _loads_oracle(1000, experts, top_k, imbalance, cf)
    assert m.routed_pairs(1000) == pytest.approx(sum(loads))
    for here in (1, 2, experts):
        assert m.rank_pairs(1000, here) == pytest.approx(sum(loads[:here]))
    if cf is None:
        assert m.routed_pairs(1000) == pytest.approx(1000 * top_k)


def test_contiguous_routing_loads_every_expert_evenly():
    """The benchmark gate's assignments (token t to experts t·k .. t·k+k-1 mod E),
    counted per expert, are even whatever `imbalance` says."""
    m = MoEConfig(experts=16, top_k=4, expert_hidden=8, capacity_factor=None,
                  imbalance=1.5, routing="contiguous")
    tokens = 64
    counts = [0] * 16
    for t in range(tokens):
        for j in range(4):
            counts[(t * 4 + j) % 16] += 1
    busiest, other = m.expert_loads(tokens)
    assert busiest == pytest.approx(max(counts)) and other == pytest.approx(min(counts))
    assert m.rank_pairs(tokens, 4) == pytest.approx(sum(counts[:4]))


def test_flops_and_params_closed_forms():
    h, fe, e, k, sh, b, s = 64, 96, 8, 2, 1, 2, 32
    for mlp, n_mats in (("gelu", 2), ("swiglu", 3)):
        c = _config(mlp, bias=False, experts=e, top_k=k, expert_hidden=fe,
                    capacity_factor=None, shared_experts=sh)
        blk = MoEBlock(c)
        t = b * s
        attention = 2 * t * h * 3 * h + 4 * b * s * s * h + 2 * t * h * h
        router = 2 * t * h * e
        experts = (t * k + t * sh) * 2 * h * fe * n_mats
        cost = blk.cost(b, s, 2)
        assert cost.fwd_flops == attention + router + experts
        assert cost.w_flops == cost.fwd_flops - 4 * b * s * s * h
        assert cost.i_flops + cost.w_flops == 2 * cost.fwd_flops
        attn_params = 4 * h * h + 2 * h                  # QKV, out; two norm weights
        assert c.norm == "layernorm" and not c.bias      # layernorm without bias: weight only
        per_expert = n_mats * h * fe
        assert blk.params == attn_params + h * e + (e + sh) * per_expert
        assert blk.active_params == attn_params + h * e + (k + sh) * per_expert
        assert blk.expert_params == e * per_expert
        # the routed experts' GEMMs are the layer's expert FLOPs
        assert routed_expert_work(blk, "F", b, s, 2).flops == t * k * 2 * h * fe * n_mats


def test_capacity_drops_cost_nothing_and_stash_counts_dispatched_tokens():
    c = _config(experts=4, top_k=1, expert_hidden=64, capacity_factor=1.0, imbalance=2.0)
    dropless = MoEBlock(replace(c, moe=replace(c.moe, capacity_factor=None)))
    capped = MoEBlock(c)
    b, s, d, h = 2, 32, 2, 64
    t = b * s
    pairs = sum(_loads_oracle(t, 4, 1, 2.0, 1.0))          # 3/4 of the tokens
    assert pairs == pytest.approx(0.75 * t)
    per_pair = 2 * h * 64 * 2
    assert dropless.cost(b, s, d).fwd_flops - capped.cost(b, s, d).fwd_flops == \
        pytest.approx((t - pairs) * per_pair)
    # stash: dense attention part + expert intermediates (GELU: 2 per pair) + dispatched
    # tokens + fp32 router probabilities
    dense = TransformerBlock(replace(c, moe=None))
    o, i, core = dense.stash_parts(b, s, d)
    want = o + i + core - 2 * t * 256 * d + 2 * pairs * 64 * d + pairs * h * d + t * 4 * 4
    assert capped.stash_bytes(b, s, d) == pytest.approx(want)


def test_gpt_spec_places_moe_blocks_and_counts_active_params():
    c = _config(experts=4, top_k=2, expert_hidden=128, every=2, first_dense=1)
    spec = gpt_spec("m", c)
    kinds = [layer.kind for layer in spec.layers]
    assert kinds == ["embedding", "block", "moe", "block", "moe", "head"]
    moe, dense = spec.layers[2], spec.layers[1]
    assert spec.params == sum(x.params for x in spec.layers) - spec.tied_params
    assert spec.params - spec.active_params == 2 * (moe.params - moe.active_params)
    assert moe.params - moe.active_params == 2 * (2 * 64 * 128 + 128 + 64)
    assert dense.kind == "block" and not isinstance(dense, MoEBlock)


def test_imbalance_is_validated():
    with pytest.raises(BadInput, match="imbalance"):
        MoEConfig(experts=4, top_k=1, expert_hidden=8, imbalance=0.5)
    # above experts / top_k it is priced at experts / top_k: the busiest takes every token
    m = MoEConfig(experts=4, top_k=2, expert_hidden=8, capacity_factor=None, imbalance=9.0)
    assert m.expert_loads(100)[0] == pytest.approx(100)
