"""A deterministic synthetic training stream: the same batch for (seed, step) everywhere.

Every rank draws the whole global batch of a step from its own generator (a few KB of
token ids) and slices out its pipeline's micro-batches, so pipelines, resumed runs and
a single-process reference all see the same samples without any data loader or I/O.

GPT models get arithmetic token sequences, ``t_i = (a + k·i) mod V`` with a random start
a and stride k in [1, 8) per sample and 10 % of the tokens replaced by noise: learnable
(the loss falls below ln V within a few hundred steps) but not trivial. Synthetic models
get N(0, 1) inputs and tanh(N(0, 1)) targets, what their MSE head expects.
"""

from __future__ import annotations

import hashlib

import torch

from hyperpipe.models.spec import ModelSpec

_STEP_BITS = 24          # (seed, step) -> seed·2²⁴ + step, unique for step < 2²⁴
_MAX_STRIDE = 8
_NOISE = 0.1


def rank_seed(seed: int, rank: int) -> int:
    """The seed of the random stream of `rank` (dropout masks: torch's default generator;
    the executor passes its tensor-parallel group's first rank, whose ranks must draw
    the same masks) in a run of `seed`: the same in every run of the seed, and unrelated
    to the data stream's (seed, step) seeds (a hash, not an offset)."""
    digest = hashlib.sha256(f"hyperpipe-rank-stream:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1          # a non-negative int64


def step_batch(spec: ModelSpec, global_batch: int, step: int, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of all `global_batch` samples of `step`, on the CPU.

    GPT: token ids (N, S) and next tokens (N, S), int64. Synthetic: (N, S, hidden) fp32.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed << _STEP_BITS) + step)
    n, s = global_batch, spec.seq_len
    if spec.config is not None:
        vocab = spec.config.vocab_size
        start = torch.randint(0, vocab, (n, 1), generator=gen)
        stride = torch.randint(1, _MAX_STRIDE, (n, 1), generator=gen)
        tokens = (start + stride * torch.arange(s + 1)) % vocab           # (N, S + 1)
        noise = torch.randint(0, vocab, (n, s + 1), generator=gen)
        tokens = torch.where(torch.rand(n, s + 1, generator=gen) < _NOISE, noise, tokens)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    first, last = spec.layers[0], spec.layers[-1]
    return (torch.randn(n, s, first.hidden, generator=gen),
            torch.randn(n, s, last.hidden, generator=gen).tanh())


def micro_batch_of(batch: tuple[torch.Tensor, torch.Tensor], sample_offset: int,
                   micro_batch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `index` (of `micro_batch` samples) of the pipeline whose samples start
    at `sample_offset` in the global batch."""
    lo = sample_offset + index * micro_batch
    inputs, targets = batch
    return inputs[lo:lo + micro_batch], targets[lo:lo + micro_batch]
