"""Torch modules built from a ModelSpec, one nn.Module per spec layer (nanoGPT style).

Shapes: B micro-batch, S sequence, D d_model, V vocabulary.

* embedding: token ids (B, S) long -> (B, S, D)
* block:     (B, S, D) -> (B, S, D); in the blocks `MoEConfig.is_moe_block` names, the
             MLP is a mixture of experts (`MoE`: top-k router, routed and shared
             experts, capacity drop)
* head:      (x (B, S, D), targets (B, S) long) -> mean cross-entropy over B·S tokens
             (without targets: fp32 logits (B, S, V))
* synthetic: (B, S, hidden) -> (B, S, hidden); the model's last one, given targets of the
             same shape, returns the mean squared error instead

Weights are a pure function of (seed, layer index): each layer is built on the meta device
and then filled from its own torch.Generator, so a stage [start, end) built alone holds
exactly the weights of the same layers of the whole model, and the global RNG is not
touched. Modules are fp32 on the CPU; under ``with torch.device("meta")`` they stay on
the meta device without values (for counting parameters of big models).

Tied embeddings (`GPTConfig.tie_embeddings`): the head's ``lm_head.weight`` is the
embedding's ``wte.weight``. A stage holding both shares the one Parameter; a stage
holding the head alone starts its own copy from the embedding's initial values, and the
executor sums the two copies' gradients every step (`hyperpipe.exec.tied`), so that both
stay equal to the single matrix of the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyperpipe.core.errors import BadInput
from hyperpipe.models.spec import GPTConfig, ModelSpec, SyntheticLayer, is_moe_layer

INIT_STD = 0.02          # GPT-2's initialiser (Radford et al. 2019; nanoGPT)
NORM_EPS = 1e-5          # GPT-2's layer_norm_epsilon and Llama 2's rms_norm_eps
_SEED_STRIDE = 2**20     # (seed, index) -> seed·2²⁰ + index is unique for index < 2²⁰


def _norm(c: GPTConfig) -> nn.Module:
    if c.norm == "rmsnorm":
        return nn.RMSNorm(c.d_model, eps=NORM_EPS)
    return nn.LayerNorm(c.d_model, eps=NORM_EPS, bias=c.bias)


class Embedding(nn.Module):
    takes_targets = False

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.seq_len = c.seq_len
        self.tied = c.tie_embeddings        # the head reuses `wte.weight`
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.seq_len, c.d_model) if c.position == "learned" else None
        self.drop = nn.Dropout(c.dropout)
        # context parallelism: the global positions of this rank's tokens (exec.
        # context_parallel sets them); None: tokens 0 .. S-1
        self.positions: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        if s > self.seq_len:
            raise ValueError(f"sequence of {s} tokens, the model's limit is {self.seq_len}")
        x = self.wte(idx)                                            # (B, S, D)
        if self.wpe is not None:
            pos = torch.arange(s) if self.positions is None else self.positions
            x = x + self.wpe(pos.to(idx.device))                     # + (S, D)
        return self.drop(x)


def _rope(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None
          ) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), rotate-half form as in Llama's HF code.
    x: (B, H, S, hd); `positions`: each token's global position (default 0 .. S-1).
    Elementwise only: no matmul FLOPs to count."""
    hd, s = x.shape[-1], x.shape[-2]
    inv_freq = theta ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    pos = torch.arange(s) if positions is None else positions
    angles = pos.to(device=x.device, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)                    # (S, hd)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * angles.cos() + rotated * angles.sin()).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.kv_dim = c.kv_dim
        self.rope_theta = c.rope_theta if c.position == "rope" else None
        self.dropout = c.dropout
        self.c_attn = nn.Linear(c.d_model, c.q_dim + 2 * c.kv_dim, bias=c.bias)  # Q, K, V
        self.c_proj = nn.Linear(c.q_dim, c.d_model, bias=c.bias)
        self.attn_drop = nn.Dropout(c.dropout)
        self.resid_drop = nn.Dropout(c.dropout)
        self.recompute_core = False     # checkpoint `core` (selective activation recompute)
        # context parallelism (exec.context_parallel sets both): the global positions of
        # this rank's tokens, and the ring whose attention replaces `core`
        self.positions: torch.Tensor | None = None
        self.context = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        # widths from the head counts, not from x: under tensor parallelism this module
        # holds n_head / tp heads (exec.tensor_parallel sets the local counts)
        q_dim = self.n_head * self.head_dim
        q, k, v = self.c_attn(x).split([q_dim, self.kv_dim, self.kv_dim], dim=2)
        q = q.view(B, S, self.n_head, self.head_dim).transpose(1, 2)      # (B, nh, S, hd)
        k = k.view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)   # (B, nkv, S, hd)
        v = v.view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)   # (B, nkv, S, hd)
        if self.rope_theta is not None:
            q = _rope(q, self.rope_theta, self.positions)
            k = _rope(k, self.rope_theta, self.positions)
        if self.context is not None:    # ring attention over the context ranks (GQA inside)
            y = self.context.attention(q, k, v, keep_scores=None if not self.recompute_core
                                       else False)                        # (B, nh, S, hd)
            y = y.transpose(1, 2).contiguous().view(B, S, q_dim)
            return self.resid_drop(self.c_proj(y))
        if self.n_kv_head != self.n_head:       # GQA: each K/V head serves a group of Qs
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)  # (B, nh, S, hd)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        if self.recompute_core:     # selective recompute (Korthikanti et al. 2022, sec. 4.2)
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)                                        # (B, nh, S, hd)
        y = y.transpose(1, 2).contiguous().view(B, S, q_dim)
        return self.resid_drop(self.c_proj(y))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd)) v, causal: (B, nh, S, hd) each -> (B, nh, S, hd). The
        part selective recompute drops and recomputes (its s^2 scores are the big saved
        tensors)."""
        if q.is_cuda:   # fused kernel; the same FLOPs as below
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        # explicit, so that torch's FlopCounterMode sees the two matmuls
        S = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))    # (B,nh,S,S)
        causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        att = self.attn_drop(att.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        return att @ v


class MLP(nn.Module):
    """The feed-forward sub-layer, of width `hidden` (default: the model's ffn_hidden; an
    expert's is MoEConfig.expert_hidden)."""

    def __init__(self, c: GPTConfig, hidden: int | None = None):
        super().__init__()
        hidden = c.ffn_hidden if hidden is None else hidden
        self.swiglu = c.mlp == "swiglu"
        self.c_fc = nn.Linear(c.d_model, hidden, bias=c.bias)            # up
        # SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))
        self.c_gate = nn.Linear(c.d_model, hidden, bias=c.bias) if self.swiglu else None
        self.c_proj = nn.Linear(hidden, c.d_model, bias=c.bias)          # down
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_gate is not None:
            h = F.silu(self.c_gate(x)) * self.c_fc(x)                    # (B, S, F)
        else:
            h = F.gelu(self.c_fc(x))                                     # (B, S, F)
        return self.drop(self.c_proj(h))                                 # (B, S, D)


# ------------------------------------------------------------------ mixture of experts
# Routing, capacity and dispatch order are pure functions of the router's logits, so a
# test can check them against a per-token loop and expert parallelism (exec.experts) can
# reuse them on each rank's own tokens.

def route(logits: torch.Tensor, top_k: int, routing: str = "learned"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: logits (T, E) -> (gates (T, k) fp32, experts (T, k) long).

    "learned": softmax over all E experts, the k most probable kept and renormalised to
    sum to 1 per token, as Mixtral does (huggingface/transformers,
    src/transformers/models/mixtral/modeling_mixtral.py, MixtralSparseMoeBlock.forward).
    "contiguous" (`MoEConfig.routing`): token t to experts t·k, ..., t·k + k - 1 (mod
    E), each weighted by its renormalised probability, so the router still trains."""
    probs = logits.float().softmax(dim=-1)                               # (T, E)
    if routing == "contiguous":
        t, e = probs.shape
        experts = torch.arange(t * top_k, device=probs.device).view(t, top_k) % e
        gates = probs.gather(1, experts)
    else:
        gates, experts = probs.topk(top_k, dim=-1)                       # (T, k) each
    return gates / gates.sum(dim=-1, keepdim=True), experts


def expert_capacity(tokens: int, experts: int, top_k: int,
                    capacity_factor: float | None) -> int | None:
    """Tokens one expert takes from `tokens` routed tokens: ceil(capacity_factor · tokens ·
    top_k / experts) (GShard, Lepikhin et al. 2020, sec. 2.2); None: dropless."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / experts)


def kept(chosen: torch.Tensor, experts: int, capacity: int | None) -> torch.Tensor:
    """Which of the (T, k) assignments `chosen` their expert takes (bool, (T, k)).

    An expert takes its first `capacity` assignments in GShard's order (Lepikhin et al.
    2020, Algorithm 1: the second choices' positions start after all first choices'):
    every token's first choice before any token's second, tokens in order within a
    choice. The rest are dropped: their expert output is zero, the residual stays."""
    if capacity is None:
        return torch.ones_like(chosen, dtype=torch.bool)
    t, k = chosen.shape
    onehot = F.one_hot(chosen.t().reshape(-1), experts)                  # (k·T, E)
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1)               # 1-based, (k·T,)
    return (position <= capacity).view(k, t).t()


def dispatch_order(chosen: torch.Tensor, keep: torch.Tensor, experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept assignments grouped by expert: (order (N,) long, counts (E,) long).

    `order` indexes the flattened (T·k) assignments, expert 0's first, each expert's in
    (token, choice) order; `counts[e]` is how many expert e takes. Token of an entry:
    order // k."""
    flat = chosen.reshape(-1)
    index = keep.reshape(-1).nonzero().squeeze(1)                        # (N,)
    order = index[torch.argsort(flat[index], stable=True)]
    return order, torch.bincount(flat[order], minlength=experts)


def run_experts(experts: nn.ModuleDict, first: int, h: torch.Tensor,
                counts: Sequence[int]) -> torch.Tensor:
    """Experts `first`, `first` + 1, ... on their consecutive rows of `h` ((N, D), row
    counts `counts`) -> (N, D). Every expert runs, on zero rows if it got none, so that
    each holds a gradient after backward."""
    chunks = h.split(list(counts))
    return torch.cat([experts[str(first + e)](x) for e, x in enumerate(chunks)])


class MoE(nn.Module):
    """A mixture-of-experts MLP (MoEConfig): a router, `experts` routed experts of the
    model's MLP kind and width `expert_hidden`, `shared_experts` always-on ones.

    (B, S, D) -> (B, S, D): each token's output is the sum over its kept top-k experts of
    gate x expert(token), plus every shared expert's output. Capacity counts the tokens of
    one call (a micro-batch; on one rank under expert parallelism). Experts are held in a
    ModuleDict keyed by their global index, so a rank holding some of them (expert
    parallelism: `exec.experts` removes the others and sets `dispatcher`) names its
    parameters as the whole model does. `dispatcher(h, counts, experts)` runs the routed
    rows `h` (grouped by expert, `counts` per expert) on whichever rank holds each expert
    and returns their outputs in the same order; None: every expert is here."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        m = c.moe
        self.num_experts, self.top_k = m.experts, m.top_k
        self.capacity_factor = m.capacity_factor
        self.routing = m.routing
        self.router = nn.Linear(c.d_model, m.experts, bias=False)        # h -> E logits
        self.experts = nn.ModuleDict({str(e): MLP(c, m.expert_hidden)
                                      for e in range(m.experts)})
        self.shared = nn.ModuleList(MLP(c, m.expert_hidden) for _ in range(m.shared_experts))
        self.dispatcher = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        flat = x.reshape(B * S, D)                                       # (T, D)
        gates, chosen = route(self.router(flat), self.top_k, self.routing)  # (T, k)
        keep = kept(chosen, self.num_experts, expert_capacity(
            B * S, self.num_experts, self.top_k, self.capacity_factor))
        order, counts = dispatch_order(chosen, keep, self.num_experts)   # (N,), (E,)
        tokens = order // self.top_k
        h = flat[tokens]                                                 # (N, D)
        counts = counts.tolist()
        if self.dispatcher is None:
            y = run_experts(self.experts, 0, h, counts)                  # (N, D)
        else:
            y = self.dispatcher(h, counts, self.experts)
        weighted = y * gates.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        out = torch.zeros_like(flat).index_add(0, tokens, weighted)      # (T, D)
        for expert in self.shared:
            out = out + expert(flat)
        return out.view(B, S, D)


class Block(nn.Module):
    takes_targets = False

    def __init__(self, c: GPTConfig, moe: bool = False):
        super().__init__()
        self.ln_1 = _norm(c)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = _norm(c)
        self.mlp = MoE(c) if moe else MLP(c)       # moe: MoEConfig.is_moe_block says so

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    takes_targets = True

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_f = _norm(c)
        self.tied = c.tie_embeddings        # `lm_head.weight` is the embedding's
        # With tied embeddings `build_layer` gives it the embedding's initial values and
        # `build_stage` the embedding's very Parameter when both sit in one stage.
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x)).float()                      # (B, S, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class Synthetic(nn.Module):
    """Linear(hidden, hidden) + tanh; the model's last one returns an MSE loss."""

    def __init__(self, hidden: int, last: bool):
        super().__init__()
        self.takes_targets = last
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.fc(x))                                       # (B, S, hidden)
        if self.takes_targets and targets is not None:
            return F.mse_loss(y, targets)
        return y


class StageModule(nn.Module):
    """Layers [start, end) of a model. Parameter names carry the global layer index
    (``layers.5.attn.c_attn.weight``), so a stage's state dict is a slice of the model's."""

    def __init__(self, layers: dict[int, nn.Module], start: int, end: int):
        super().__init__()
        self.start, self.end = start, end
        self.layers = nn.ModuleDict({str(i): m for i, m in layers.items()})

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x, targets) if layer.takes_targets else layer(x)
        return x


def _make(spec: ModelSpec, index: int) -> nn.Module:
    layer = spec.layers[index]
    if isinstance(layer, SyntheticLayer):
        if layer.hidden is None:
            raise BadInput(f"model {spec.name}: layers[{index}].hidden",
                           "a width (needed to build a synthetic model for real)",
                           has_got=False)
        return Synthetic(layer.hidden, last=index == spec.num_layers - 1)
    if layer.kind in ("embedding", "head"):
        return {"embedding": Embedding, "head": Head}[layer.kind](layer.config)
    return Block(layer.config, moe=is_moe_layer(spec, index))


@torch.no_grad()
def _init(module: nn.Module, gen: torch.Generator, n_layer: int) -> None:
    """GPT-2's scheme (nanoGPT): N(0, 0.02) weights, residual projections scaled by
    1/sqrt(2·n_layer) (Radford et al. 2019, sec. 2.3), zero biases, unit norm gains.
    Synthetic layers use N(0, 1/hidden) so tanh neither saturates nor vanishes."""
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            if isinstance(module, Synthetic):
                std = 1.0 / math.sqrt(m.in_features)
            elif name.endswith("c_proj"):
                std = INIT_STD / math.sqrt(2 * n_layer)
            else:
                std = INIT_STD
            m.weight.normal_(0.0, std, generator=gen)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(0.0, INIT_STD, generator=gen)
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            m.weight.fill_(1.0)
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()


def build_layer(spec: ModelSpec, index: int, seed: int) -> nn.Module:
    """The module of layer `index`, its weights a function of (seed, index) only."""
    if not 0 <= index < spec.num_layers:
        raise IndexError(f"layer {index} of a {spec.num_layers}-layer model")
    on_meta = torch.get_default_device().type == "meta"
    with torch.device("meta"):           # no wasted default init, no global RNG use
        module = _make(spec, index).to(torch.float32)
    if on_meta:
        return module
    module = module.to_empty(device="cpu")
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed * _SEED_STRIDE + index) % 2**63)
    n_layer = spec.config.n_layer if spec.config is not None else spec.num_layers
    _init(module, gen, n_layer)
    if isinstance(module, Head) and spec.tied_params:
        with torch.no_grad():           # the embedding's initial V x D matrix
            module.lm_head.weight.copy_(build_layer(spec, 0, seed).wte.weight)
    return module


def build_stage(spec: ModelSpec, start: int, end: int, seed: int) -> StageModule:
    """Layers [start, end) of `spec` as one module; with tied embeddings and both ends
    in it, the head's weight is the embedding's Parameter itself."""
    if not 0 <= start < end <= spec.num_layers:
        raise ValueError(f"layer range [{start}, {end}) of a {spec.num_layers}-layer model")
    layers = {i: build_layer(spec, i, seed) for i in range(start, end)}
    last = spec.num_layers - 1
    if spec.tied_params and start == 0 and end == spec.num_layers:
        layers[last].lm_head.weight = layers[0].wte.weight
    return StageModule(layers, start, end)


def tied_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The copies of a tied embedding matrix `module` (a stage) holds: its embedding's
    ``wte.weight`` and its head's ``lm_head.weight``, each once (one Parameter when the
    stage holds both). Empty for an untied model."""
    out: list[nn.Parameter] = []
    for m in module.modules():
        if isinstance(m, Embedding) and getattr(m, "tied", False):
            out.append(m.wte.weight)
        if isinstance(m, Head) and getattr(m, "tied", False):
            out.append(m.lm_head.weight)
    seen: set[int] = set()
    return [p for p in out if not (id(p) in seen or seen.add(id(p)))]


def build_model(spec: ModelSpec, seed: int) -> StageModule:
    """The whole model: build_stage(spec, 0, spec.num_layers, seed)."""
    return build_stage(spec, 0, spec.num_layers, seed)


def example_batch(spec: ModelSpec, micro_batch: int, seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic random (inputs, targets) pair that the model's first and last
    layers accept: token ids (B, S) and next tokens (B, S) for a GPT; (B, S, hidden)
    floats for a synthetic model."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed % 2**63)
    b, s = micro_batch, spec.seq_len
    if spec.config is not None:
        tokens = torch.randint(0, spec.config.vocab_size, (b, s + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]
    first, last = spec.layers[0], spec.layers[-1]
    for i, layer in ((0, first), (spec.num_layers - 1, last)):
        if layer.hidden is None:
            raise BadInput(f"model {spec.name}: layers[{i}].hidden",
                           "a width (needed to build a synthetic model for real)",
                           has_got=False)
    return (torch.randn(b, s, first.hidden, generator=gen),
            torch.randn(b, s, last.hidden, generator=gen).tanh())
