"""The mixture-of-experts torch modules (models.gpt.MoE): routing, capacity drop and
the routed sum against a brute-force loop over tokens, one process, a few milliseconds.

Oracle: for each token, the softmax of its router logits sorted by hand, its top-k
renormalised; capacity assigned by walking the choices in GShard's order (all first
choices in token order, then all second choices) with a counter per expert; the output
summed expert by expert for that token alone.
"""

from __future__ import annotations

import math

import pytest
import torch

from hyperpipe.models import build_model, example_batch, load_model
from hyperpipe.models.gpt import MoE, expert_capacity, kept, route
from hyperpipe.models.spec import GPTConfig, MoEConfig


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(*, experts=4, top_k=2, capacity_factor=None, shared=0, mlp="gelu"):
    extra = {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "bias": False} \
        if mlp == "swiglu" else {}
    return GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, seq_len=8,
                     tie_embeddings=False, **extra,
                     moe=MoEConfig(experts=experts, top_k=top_k, expert_hidden=24,
                                   capacity_factor=capacity_factor, shared_experts=shared))


def moe_module(c: GPTConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    m = MoE(c)
    with torch.no_grad():       # default init is fine; make the router decisive
        m.router.weight.mul_(4.0)
    return m


def brute_route(logits: torch.Tensor, k: int):
    gates, experts = [], []
    for row in logits.tolist():
        z = [math.exp(v - max(row)) for v in row]
        probs = [v / sum(z) for v in z]
        top = sorted(range(len(row)), key=lambda e: -probs[e])[:k]
        total = sum(probs[e] for e in top)
        gates.append([probs[e] / total for e in top])
        experts.append(top)
    return gates, experts


def brute_kept(experts: list[list[int]], num_experts: int, capacity: int | None):
    taken = [0] * num_experts
    keep = [[False] * len(experts[0]) for _ in experts]
    for j in range(len(experts[0])):           # first choices of every token first
        for t, row in enumerate(experts):
            e = row[j]
            taken[e] += 1
            keep[t][j] = capacity is None or taken[e] <= capacity
    return keep


def brute_forward(m: MoE, x: torch.Tensor, capacity: int | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    logits = m.router(flat)
    _, experts = brute_route(logits.detach(), m.top_k)
    keep = brute_kept(experts, m.num_experts, capacity)
    rows = []
    for t in range(flat.shape[0]):
        probs = logits[t].softmax(dim=0)        # differentiable gates, token by token
        total = sum(probs[e] for e in experts[t])
        y = torch.zeros(flat.shape[1])
        for j, e in enumerate(experts[t]):
            if keep[t][j]:
                y = y + probs[e] / total * m.experts[str(e)](flat[t:t + 1])[0]
        for s in m.shared:
            y = y + s(flat[t:t + 1])[0]
        rows.append(y)
    return torch.stack(rows).view_as(x)


def test_route_is_softmax_top_k_renormalised():
    logits = torch.randn(50, 6, generator=torch.Generator().manual_seed(1))
    gates, experts = route(logits, 3)
    want_g, want_e = brute_route(logits, 3)
    assert experts.tolist() == want_e
    assert torch.allclose(gates, torch.tensor(want_g), atol=1e-6)
    assert gates.sum(dim=-1).tolist() == pytest.approx([1.0] * 50)


def test_contiguous_route_is_the_benchmark_gate_with_renormalised_probabilities():
    """Token t to experts t·k .. t·k+k-1 (mod E), NeMo Automodel's FakeBalancedGate,
    each weighted by its softmax probability over those k, counted token by token."""
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(2))
    gates, experts = route(logits, 4, "contiguous")
    probs = logits.softmax(dim=-1)
    for t in range(9):
        want = [(t * 4 + j) % 6 for j in range(4)]
        assert experts[t].tolist() == want
        p = probs[t, want]
        assert torch.allclose(gates[t], p / p.sum(), atol=1e-6)


@pytest.mark.parametrize("experts,top_k,factor", [(4, 2, 0.5), (4, 2, 1.0), (8, 1, 1.25),
                                                  (3, 3, 0.7), (4, 2, None)])
def test_capacity_drop_follows_gshard_order(experts, top_k, factor):
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    # skewed logits: expert 0 is popular, so capacity bites
    logits = torch.randn(40, experts, generator=gen) + torch.linspace(2, 0, experts)
    _, chosen = route(logits, top_k)
    cap = expert_capacity(40, experts, top_k, factor)
    assert cap == (None if factor is None else math.ceil(factor * 40 * top_k / experts))
    keep = kept(chosen, experts, cap)
    assert keep.tolist() == brute_kept(chosen.tolist(), experts, cap)
    per_expert = torch.bincount(chosen[keep], minlength=experts)
    if cap is not None:
        assert int(per_expert.max()) <= cap
        assert not bool(keep.all())     # the skew makes some expert overflow
    else:
        assert bool(keep.all())


@pytest.mark.parametrize("mlp,factor,shared", [("gelu", None, 0), ("gelu", 0.5, 0),
                                               ("swiglu", 0.75, 1), ("swiglu", None, 2)])
def test_moe_forward_and_gradients_equal_a_per_token_loop(mlp, factor, shared):
    c = config(capacity_factor=factor, shared=shared, mlp=mlp)
    m = moe_module(c)
    x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    cap = expert_capacity(24, 4, 2, factor)
    got = m(x)
    want = brute_forward(m, x, cap)
    assert torch.allclose(got, want, atol=1e-5)
    w = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((got * w).sum(), [x, *m.parameters()], allow_unused=True)
    wants = torch.autograd.grad((want * w).sum(), [x, *m.parameters()], allow_unused=True)
    for name, g, h in zip(["x"] + [n for n, _ in m.named_parameters()], grads, wants,
                          strict=True):
        assert torch.allclose(g, h, atol=1e-5), name


def test_a_token_whose_choices_all_drop_keeps_only_its_residual():
    c = config(capacity_factor=0.25)            # capacity 1 per expert for 8 tokens, k=2
    m = moe_module(c)
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(4))
    _, chosen = route(m.router(x.reshape(8, 16)), 2)
    keep = kept(chosen, 4, expert_capacity(8, 4, 2, 0.25))
    dropped = [t for t in range(8) if not keep[t].any()]
    assert dropped          # at most 4 assignments kept of 16: some token loses both
    y = m(x)
    for t in dropped:
        assert torch.equal(y[0, t], torch.zeros(16))


def test_moe_blocks_sit_where_the_config_says_and_weights_follow_the_seed():
    spec = load_model("tiny-moe")
    a, b = build_model(spec, 7), build_model(spec, 7)
    moe_layers = sorted({int(n.split(".")[1]) for n, _ in a.named_parameters()
                         if ".mlp.router." in n})
    assert moe_layers == [i + 1 for i in range(spec.config.n_layer)
                          if spec.config.moe.is_moe_block(i)] == [1, 3]
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    x, y = example_batch(spec, 2, 0)
    assert a(x, y).item() == b(x, y).item()
    c = build_model(spec, 8)
    assert not torch.equal(a.layers["1"].mlp.experts["0"].c_fc.weight,
                           c.layers["1"].mlp.experts["0"].c_fc.weight)


def test_tiny_moe_trains_in_one_process():
    spec = load_model("tiny-moe")
    model = build_model(spec, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = example_batch(spec, 4, 0)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # ln(256) = 5.55 at the start; memorising one batch drives it well down
    assert losses[0] == pytest.approx(math.log(256), abs=0.2)
    assert losses[-1] < 0.6 * losses[0]
    router = model.layers["1"].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
