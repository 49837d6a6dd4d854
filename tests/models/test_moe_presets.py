"""The MoE presets against their published parameter counts.

Oracles: the totals and active counts their authors publish (sources in
hyperpipe/models/presets.py), adjusted only by the approximations the presets state
(DeepSeek-V3's MLA as multi-head attention, Qwen3's query width). Active parameters are
the spec's (`MoEBlock.active_params`), checked against its total less, in every MoE
block, the routed experts a token does not visit ((experts - top_k) of them, each a
SwiGLU MLP of 3 d f weights).
"""

from __future__ import annotations

import pytest

from hyperpipe.models import load_model


def expert_params(d_model: int, expert_hidden: int) -> int:
    """One SwiGLU expert: gate, up (d x f each) and down (f x d), no biases."""
    return 3 * d_model * expert_hidden


def active_params(spec) -> int:
    """Parameters one token passes through, counted independently of the spec's
    `active_params`: its total less the unvisited routed experts of every MoE block."""
    cfg = spec.config
    moe = cfg.moe
    n_moe = sum(moe.is_moe_block(i) for i in range(cfg.n_layer))
    return spec.params - n_moe * (moe.experts - moe.top_k) * expert_params(
        cfg.d_model, moe.expert_hidden)


def spec_active_params(spec) -> int:
    """The spec's own count: each MoE block's `active_params`, every other layer whole."""
    return sum(getattr(layer, "active_params", layer.params) for layer in spec.layers) \
        - spec.tied_params


# Stated approximations, as parameter differences (spec minus the real model):
# DeepSeek-V3's MLA (187.1M a block) modelled as 4 h^2 = 205.5M, in each of 61 blocks.
MLA_PARAMS = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
DSV3_DELTA = 61 * (4 * 7168 ** 2 - MLA_PARAMS)
# Qwen3-30B-A3B's QK-norm (two RMSNorms of head_dim 128 a block) left out.
QWEN3_DELTA = -48 * 2 * 128

# (preset, published total, published active, spec-minus-real delta, tolerance, source)
PUBLISHED = (
    # Mistral AI, "Mixtral of experts" announcement: 46.7B total, 12.9B per token.
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0, 0.01),
    # DeepSeek-V3 technical report, abstract: 671B total, 37B activated for each token.
    # 37B is rounded (the README_WEIGHTS of deepseek-ai/DeepSeek-V3 says 36.6B without
    # the input embedding), hence 3% on the active count.
    ("deepseek-v3", 671e9, 37e9, DSV3_DELTA, 0.03),
    # Qwen/Qwen3-30B-A3B model card: 30.5B total, 3.3B activated.
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, QWEN3_DELTA, 0.03),
)


@pytest.mark.parametrize(("name", "total", "active", "delta", "tol"), PUBLISHED)
def test_params_match_published(name, total, active, delta, tol):
    spec = load_model(name)
    got_total, got_active = spec.params, spec_active_params(spec)
    assert got_active == active_params(spec)
    print(f"{name}: total {got_total / 1e9:.2f}B (published {total / 1e9:.1f}B), "
          f"active {got_active / 1e9:.2f}B (published {active / 1e9:.1f}B), "
          f"stated approximation {delta / 1e9:+.2f}B")
    assert got_total == pytest.approx(total + delta, rel=tol)
    assert got_active == pytest.approx(active + delta, rel=tol)


def test_qwen3_counts_its_checkpoint_by_hand():
    """Qwen/Qwen3-30B-A3B config.json counted by hand: embedding and untied head V x h,
    per block Q (h x 32·128), K and V (h x 4·128 each), O (32·128 x h), QK-norm (2 x
    128), two norms, router (h x 128) and 128 SwiGLU experts of 768, and the final norm:
    30,532,122,624; the spec leaves out QK-norm only."""
    h, v, q, kv = 2048, 151936, 32 * 128, 4 * 128
    block = h * q + 2 * h * kv + q * h + 2 * 128 + 2 * h + h * 128 + 128 * 3 * h * 768
    real = 2 * v * h + 48 * block + h
    assert real == 30_532_122_624
    assert load_model("qwen3-30b-a3b").params == real - 48 * 2 * 128


def test_moe_presets_have_the_published_layout():
    """Which blocks are MoE: DeepSeek-V3's first three are dense (first_k_dense_replace
    3), every block of Mixtral and Qwen3-30B-A3B is MoE."""
    for name, dense in (("mixtral-8x7b", 0), ("deepseek-v3", 3), ("qwen3-30b-a3b", 0)):
        cfg = load_model(name).config
        flags = [cfg.moe.is_moe_block(i) for i in range(cfg.n_layer)]
        assert flags == [False] * dense + [True] * (cfg.n_layer - dense)


def test_deepseek_v3_dense_blocks_are_cheaper_than_moe_blocks():
    """A dense block (SwiGLU of 18432) holds fewer weights than an MoE block (257
    experts of 2048 and a router): the spec must price them apart."""
    spec = load_model("deepseek-v3")
    dense, moe = spec.layers[1], spec.layers[4]     # block 0 and block 3 (embedding first)
    h = 7168
    attention = 4 * h * h
    assert dense.params == pytest.approx(attention + 3 * h * 18432, rel=0.01)
    assert moe.params == pytest.approx(attention + 257 * expert_params(h, 2048) + h * 256,
                                       rel=0.01)
