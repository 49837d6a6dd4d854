"""Context parallelism in the executor (exec.context_parallel): ring attention and the
causal load-balanced sequence split, alone and in real runs.

Oracles: full causal attention of the whole sequence in one process (the ring against
it, forward and gradients, with the context ranks as threads exchanging over queues);
and for real runs (gloo) a single process training the whole model on the whole batch
(`factories.single_process`): losses within 2e-4 over three steps, last-step
gradients within GRAD_TOL on every rank holding each layer.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import pytest
import torch
from factories import assert_trains_like_single_process, plan_doc

from hyperpipe.exec import RunOptions, run_plan
from hyperpipe.exec.context_parallel import Ring, attach, local_positions, local_sequence
from hyperpipe.models.gpt import CausalSelfAttention, Embedding
from hyperpipe.models.spec import GPTConfig
from hyperpipe.plan.plan import plan_from_dict

LOSS_TOL = 2e-4
GRAD_TOL = 1e-5
LR = 1e-3


# ---------------------------------------------------------------------------- layout
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout_is_two_chunks_per_rank_covering_the_sequence_once(cp):
    s = 24
    n = s // (2 * cp)
    seen = torch.cat([local_positions(s, cp, c) for c in range(cp)])
    assert sorted(seen.tolist()) == list(range(s))
    for c in range(cp):
        pos = local_positions(s, cp, c).tolist()
        # chunk c then chunk 2cp-1-c (brute force from the definition)
        assert pos == list(range(c * n, (c + 1) * n)) + \
            list(range((2 * cp - 1 - c) * n, (2 * cp - c) * n))
    # causal load balance: every rank's queries see as many keys (brute-force count)
    work = {sum(p + 1 for p in local_positions(s, cp, c).tolist()) for c in range(cp)}
    assert len(work) == 1


def test_layout_rejects_a_sequence_that_does_not_split():
    with pytest.raises(ValueError):
        local_positions(10, 3, 0)


# ---------------------------------------------------------------------------- the ring alone
@dataclass
class ThreadRing(Ring):
    """A Ring whose hops go through in-process queues (one per receiving context rank):
    the context ranks run as threads of one process."""

    boxes: list = field(default_factory=list)
    hops: list = field(default_factory=list)

    def exchange(self, block):
        self._seq += 1
        self.hops.append(block.numel() * block.element_size())
        self.boxes[(self.index + 1) % self.size].put((self._seq, block.detach().clone()))
        return self._seq

    def finish(self, hop):
        seq, block = self.boxes[self.index].get(timeout=30)
        assert seq == hop       # the ranks exchange in the same order
        return block


def rings(cp: int, seq_len: int, keep_scores: bool) -> list[ThreadRing]:
    boxes = [queue.Queue() for _ in range(cp)]
    return [ThreadRing(tuple(range(cp)), c, None, seq_len, keep_scores=keep_scores,
                       boxes=boxes) for c in range(cp)]


def in_threads(fn, cp: int) -> list:
    out, errors = [None] * cp, []

    def run(c):
        try:
            out[c] = fn(c)
        except BaseException as exc:     # surfaced in the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(c,)) for c in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def full_causal(q, k, v):
    """The oracle: softmax(q k^T / sqrt(hd)) v over the whole sequence, causal."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    att = att.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return att.softmax(-1) @ v


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("keep_scores", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ring_attention_equals_full_causal_attention(cp, keep_scores, kv_heads):
    gen = torch.Generator().manual_seed(cp * 10 + kv_heads)
    b, h, s, hd = 2, 4, 16, 8
    q = torch.randn(b, h, s, hd, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, s, hd, generator=gen, dtype=torch.float64,
                    requires_grad=True)
    v = torch.randn(b, kv_heads, s, hd, generator=gen, dtype=torch.float64,
                    requires_grad=True)
    dout = torch.randn(b, h, s, hd, generator=gen, dtype=torch.float64)
    ref = full_causal(q, k, v)
    ref.backward(dout)
    members = rings(cp, s, keep_scores)

    def rank(c):
        ring = members[c]
        pos = ring.positions
        mine = [local_sequence(t.detach().transpose(1, 2), pos).transpose(1, 2)
                .requires_grad_() for t in (q, k, v)]
        out = ring.attention(*mine)
        out.backward(local_sequence(dout.transpose(1, 2), pos).transpose(1, 2))
        return pos, out.detach(), [t.grad for t in mine]

    results = in_threads(rank, cp)
    for pos, out, grads in results:
        expect = local_sequence(ref.detach().transpose(1, 2), pos).transpose(1, 2)
        assert torch.allclose(out, expect, atol=1e-10)
        for got, whole in zip(grads, (q.grad, k.grad, v.grad), strict=True):
            expect = local_sequence(whole.transpose(1, 2), pos).transpose(1, 2)
            assert torch.allclose(got, expect, atol=1e-10)
    # hops per rank: forward cp-1 of K/V; backward cp-1 of K/V and cp of dK/dV
    kv_bytes = 2 * b * kv_heads * (s // cp) * hd * 8
    assert sorted(members[0].hops) == [kv_bytes] * (2 * (cp - 1) + cp)


@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_module_under_cp_uses_global_positions(position, cp):
    # embedding + attention of a GQA config: the cp ranks' outputs are the whole run's
    # rows at their positions, and the parameter gradients summed over the ranks are the
    # whole run's
    config = GPTConfig(vocab_size=50, n_layer=1, n_head=4, n_kv_head=2, d_model=32,
                       seq_len=16, position=position, attention="eager")
    torch.manual_seed(0)
    emb, attn = Embedding(config), CausalSelfAttention(config)
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    dout = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    ref = attn(emb(tokens))
    ref.backward(dout)
    whole = {n: p.grad.clone() for n, p in [*emb.named_parameters(prefix="emb"),
                                            *attn.named_parameters(prefix="attn")]}
    members = rings(cp, 16, keep_scores=False)
    copies = []
    for _ in range(cp):
        e, a = Embedding(config), CausalSelfAttention(config)
        e.load_state_dict(emb.state_dict())
        a.load_state_dict(attn.state_dict())
        copies.append((e, a))

    def rank(c):
        e, a = copies[c]
        attach([e, a], members[c])
        pos = members[c].positions
        out = a(e(local_sequence(tokens, pos)))
        out.backward(local_sequence(dout, pos))
        return pos, out.detach()

    for pos, out in in_threads(rank, cp):
        assert torch.allclose(out, local_sequence(ref.detach(), pos), atol=1e-5)
    for name, grad in whole.items():
        prefix, rest = name.split(".", 1)
        total = sum(dict(m.named_parameters())[rest].grad
                    for m in (e if prefix == "emb" else a for e, a in copies))
        assert torch.allclose(total, grad, atol=1e-5), name


# ---------------------------------------------------------------------------- real runs
# The cp ranks' losses are partial means summed in a different order than the single
# process's mean, and their gradients are sums over the ranks of partial sums: rounding
# differs by a few 1e-6 after three AdamW steps. A missing 1/cp, a missing reduction over
# the context ranks or a wrong position is off by 10 % or more.
RUN_GRAD_TOL = 3e-5


def stage(layers, devices, cp, **fields) -> dict:
    return {"layers": list(layers), "devices": [f"n/{d}" for d in devices],
            "tp": len(devices) // cp, "cp": cp, **fields}


def check(pipelines: list[dict], steps: int = 3, **top):
    """Run the plan (gloo, no emulation) against the single process
    (`factories.assert_trains_like_single_process`)."""
    plan = plan_from_dict(plan_doc(pipelines, **top))
    return assert_trains_like_single_process(plan, steps, loss_tol=LOSS_TOL,
                                             grad_tol=RUN_GRAD_TOL, lr=LR)


def test_cp2_run_trains_like_single_process():
    check([{"micro_batch": 2, "num_microbatches": 2,
            "stages": [stage((0, 8), (0, 1), cp=2)]}])


@pytest.mark.slow
def test_pp2_cp2_run_trains_like_single_process():
    # each context rank's slice of the pipeline passes its own tokens' activations on
    result = check([{"micro_batch": 1, "num_microbatches": 4, "stages": [
        stage((0, 4), (0, 1), cp=2), stage((4, 8), (2, 3), cp=2)]}])
    ring = [e for e in result.trace.events if e.step == 2 and e.op == "send"
            and {e.device, e.peer} in ({"n/0", "n/1"}, {"n/2", "n/3"})]
    # 4 ranks of 3 blocks each (tiny-gpt: embedding, 6 blocks, head), 4 micro-batches:
    # per block 1 K/V hop in F, 1 K/V + 2 dK/dV hops in B
    assert len(ring) == 4 * 3 * 4 * (1 + 3)


@pytest.mark.slow
def test_unequal_cp2_replicas_with_the_distributed_optimizer_train_like_single_process():
    # two replicas of one cp 2 stage, 3 and 1 micro-batches of 1 and 2 samples: each
    # context rank's loss scaled by its replica's share and 1/cp; the optimizer state
    # sharded over all four holders (dp x cp)
    check([{"micro_batch": 1, "num_microbatches": 3, "stages": [stage((0, 8), (0, 1), cp=2)]},
           {"micro_batch": 2, "num_microbatches": 1, "stages": [stage((0, 8), (2, 3), cp=2)]}],
          zero=1)


@pytest.mark.slow
def test_pp2_cp2_fsdp2_run_trains_like_single_process():
    # 8 ranks: two replicas of a two-stage pipeline, each stage cp 2, ZeRO-3 sharding
    # each layer over its 4 holders (dp 2 x cp 2)
    def pipe(first):
        return {"micro_batch": 1, "num_microbatches": 2, "stages": [
            stage((0, 4), (first, first + 1), cp=2),
            stage((4, 8), (first + 2, first + 3), cp=2)]}
    check([pipe(0), pipe(4)], zero=3)


@pytest.mark.slow
def test_emulated_ring_exchange_crosses_the_emulated_link():
    # one cp 2 stage over two nodes behind a 20 Mbit/s, 1 ms link: each hop of a block's
    # K/V (2 x 2 x 4 heads x 32 tokens x 32 x fp32 = 32 KiB) takes 13.1 ms on the wire,
    # hops of one edge one after another: F holds 6 blocks x 1 hop, B 6 x 3 hops
    slow = {"nodes": [{"name": "a", "device": "A100-80GB", "count": 1},
                      {"name": "b", "device": "A100-80GB", "count": 1}],
            "inter_node": {"bandwidth": "20 Mbit/s", "latency": "1 ms"}}
    plan = plan_from_dict(plan_doc([{"micro_batch": 2, "num_microbatches": 2, "stages": [
        {"layers": [0, 8], "devices": ["a/0", "b/0"], "tp": 1, "cp": 2}]}],
        cluster=slow, schedule="gpipe"))
    result = run_plan(plan, RunOptions(steps=2, probe_links=False))
    assert result.emulated
    wire_s = 2 * 2 * 4 * 32 * 32 * 4 / 2.5e6
    events = [e for e in result.trace.events if e.step == 1]
    for op, hops in (("F", 6), ("B", 18)):
        spans = [e.duration_s for e in events if e.op == op]
        assert len(spans) == 4
        assert min(spans) >= hops * wire_s, (op, spans)
    waits = [e for e in events if e.op == "recv" and e.peer]
    assert {(e.device, e.peer) for e in waits} == {("a/0", "b/0"), ("b/0", "a/0")}


# ---------------------------------------------------------------------------- placement
def test_placement_of_tp2_cp2_stages_follows_the_plans_device_order():
    # device c·tp + t of a stage is tensor rank t of context rank c (plan.StagePlan);
    # brute force from that definition for a two-stage pipeline of tp 2 x cp 2 each
    from hyperpipe.exec.placement import adjacent_pairs, cp_rings, dp_groups, placements
    doc = plan_doc([{"micro_batch": 1, "num_microbatches": 2, "stages": [
        {"layers": [0, 4], "devices": [f"n/{d}" for d in range(4)], "tp": 2, "cp": 2},
        {"layers": [4, 8], "devices": [f"n/{d}" for d in range(4, 8)], "tp": 2, "cp": 2}]}])
    where = placements(plan_from_dict(doc))
    for r in where:
        base = 4 * r.pipe_rank
        c, t = divmod(r.rank - base, 2)
        assert (r.cp_index, r.tp_index) == (c, t)
        assert r.tp_ranks == (base + 2 * c, base + 2 * c + 1)
        assert r.cp_ranks == (base + t, base + 2 + t)
        # the matching context rank's group of the other stage
        other = 4 - base
        assert r.ranks_of_stage(1 - r.pipe_rank) == (other + 2 * c, other + 2 * c + 1)
    plan = plan_from_dict(doc)
    assert cp_rings(plan) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    # gradients are summed over the context ranks of each tensor index (dp x cp)
    assert dp_groups(plan) == [((0, 2), (0, 1, 2, 3)), ((1, 3), (0, 1, 2, 3)),
                               ((4, 6), (4, 5, 6, 7)), ((5, 7), (4, 5, 6, 7))]
    # activations pass between matching context ranks only (tensor rank j to j)
    assert adjacent_pairs(plan) == [(0, 4), (1, 5), (2, 6), (3, 7)]


@pytest.mark.parametrize("change,field", [
    ({"stages": [{"layers": [0, 4], "devices": ["n/0", "n/1"], "tp": 1, "cp": 2},
                 {"layers": [4, 8], "devices": ["n/2"], "tp": 1}]}, "stages[1].cp"),
])
def test_cp_the_executor_cannot_run_is_bad_input(change, field):
    from hyperpipe.core.errors import BadInput
    from hyperpipe.exec.placement import check_runnable
    plan = plan_from_dict(plan_doc([{"micro_batch": 1, "num_microbatches": 2, **change}]))
    with pytest.raises(BadInput, match=field.replace("[", r"\[").replace("]", r"\]")):
        check_runnable(plan, plan.load_model())


def test_cp_with_attention_dropout_is_bad_input():
    from hyperpipe.core.errors import BadInput
    from hyperpipe.exec.placement import check_runnable
    plan = plan_from_dict(plan_doc([{"micro_batch": 1, "num_microbatches": 2, "stages": [
        {"layers": [0, 8], "devices": ["n/0", "n/1"], "tp": 1, "cp": 2}]}],
        model={"preset": "tiny-gpt", "dropout": 0.1}))
    with pytest.raises(BadInput, match="dropout"):
        check_runnable(plan, plan.load_model())


@pytest.mark.slow
def test_cp2_feeding_tp2_cp2_under_the_iw_split_trains_like_single_process():
    # stage 0: tp 1 x cp 2 with full recompute (the ring forward redone in the
    # backward); stage 1: tp 2 x cp 2 with sequence parallelism (each context rank's
    # S/cp tokens split over its tensor ranks) and selective recompute, each context
    # rank's activation sent to both its tensor ranks; zb-h1 splits I and W
    check([{"micro_batch": 2, "num_microbatches": 2, "stages": [
        stage((0, 4), (0, 1), cp=2, recompute="full"),
        stage((4, 8), (2, 3, 4, 5), cp=2, sequence_parallel=True, recompute="selective")]}],
        schedule="zb-h1")
