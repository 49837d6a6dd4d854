"""Expert parallelism in the executor (exec.experts): groups, dispatch and combine, and
real runs of tiny-moe with ep 2 over gloo, alone and in a pp 2 pipeline.

Oracles: for the groups, the simulator's own reading of the plan's rule
(`sim.experts.ep_groups`, written apart) and a brute-force listing of who holds what;
for dispatch and combine, the whole MoE layer in one process (ep ranks as threads
exchanging over queues: each rank's output equals the whole layer's on that rank's
tokens, each expert's gradient the sum over the ranks' tokens); for real runs, a single
process training the whole model on the whole batch (`factories.single_process`): losses
within 2e-4 over three steps, last-step gradients within GRAD_TOL and weights within
lr / 2 (as tests/exec/test_exec_parallel.py argues) on every rank holding each
parameter. Dropless routing is per token, so micro-batching does not change it.
"""

from __future__ import annotations

import copy
import queue
from dataclasses import dataclass, field
from threading import Thread

import pytest
import torch
from factories import assert_trains_like_single_process, plan_doc

from hyperpipe.core.errors import BadInput
from hyperpipe.exec.experts import (
    DENSE,
    Dispatcher,
    ExpertComm,
    _expert_major,
    local_experts,
    reduction_groups,
)
from hyperpipe.exec.placement import ExpertGroup, check_runnable, expert_groups, placements
from hyperpipe.exec.runnable import check_expert_parallel
from hyperpipe.models.gpt import MoE
from hyperpipe.models.spec import GPTConfig, MoEConfig
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.plan.trace import load_trace

LOSS_TOL = 2e-4
GRAD_TOL = 1e-5
LR = 1e-3
TWO_NODES = {"nodes": [{"name": "x", "device": "A100-80GB", "count": 2},
                       {"name": "y", "device": "A100-80GB", "count": 2}],
             "inter_node": {"bandwidth": "1 Gbit/s", "latency": "100 us"}}


def moe_plan(pipes: list[list[str]], bounds: list[int], *, m: int = 2, ep: int = 2,
             cluster=None, counts: list[int] | None = None, **top):
    """tiny-moe (blocks 0 and 2 MoE: layers 1 and 3) over one pipeline per entry of
    `pipes` (its stages' devices), stage s holding [bounds[s], bounds[s + 1])."""
    docs = [{"micro_batch": 2, "num_microbatches": (counts or [m] * len(pipes))[q],
             "stages": [{"layers": [bounds[s], bounds[s + 1]], "devices": [d], "ep": ep}
                        for s, d in enumerate(devs)]} for q, devs in enumerate(pipes)]
    extra = {} if cluster is None else {"cluster": cluster}
    return plan_from_dict(plan_doc(docs, model="tiny-moe", **extra, **top))


# ---------------------------------------------------------------------------- groups
def test_groups_follow_the_plan_rule_as_the_simulator_reads_it():
    from hyperpipe.sim.experts import ep_groups
    plan = moe_plan([[f"n/{2 * q}", f"n/{2 * q + 1}"] for q in range(4)], [0, 3, 6])
    devices = plan.devices
    got = {(g.layers, tuple(devices[r] for r in g.ranks)) for g in expert_groups(plan)}
    want = {(plan.pipelines[0].stages[k].layers, g) for k in range(2)
            for g in ep_groups(plan, 0, k)}
    assert got == want and len(got) == 4        # 2 stages x (4 replicas / ep 2)


def test_reduction_groups_reduce_each_expert_over_its_holders_only():
    plan = moe_plan([[f"n/{q}"] for q in range(4)], [0, 6])
    spec = plan.load_model()
    # brute force: who holds (layer, part), from each rank's group position
    holds: dict[tuple[int, int], set[int]] = {}
    for g in expert_groups(plan):
        for i, r in enumerate(g.ranks):
            for layer in range(6):
                holds.setdefault((layer, DENSE), set()).add(r)
                if layer in (1, 3):
                    for e in local_experts(4, 2, i):
                        holds.setdefault((layer, e), set()).add(r)
    got = {key: set(ranks) for ranks, keys in reduction_groups(plan, spec) for key in keys}
    assert got == holds
    assert got[(1, 0)] == {0, 2} and got[(3, 3)] == {1, 3}      # ep groups (0,1), (2,3)


def test_expert_major_reorders_a_source_major_buffer():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])       # 2 sources x 3 experts
    labels = [(j, e) for j in range(2) for e in range(3) for _ in range(int(counts[j, e]))]
    order = _expert_major(counts).tolist()
    assert sorted(order) == list(range(len(labels)))
    assert [labels[i] for i in order] == sorted(labels, key=lambda x: (x[1], x[0]))


def test_plans_the_executor_cannot_pair_are_refused():
    # unequal micro-batch counts: the two replicas' all-to-alls would not pair up
    plan = moe_plan([["n/0"], ["n/1"]], [0, 6], counts=[2, 3])
    with pytest.raises(BadInput, match="same actions"):
        check_expert_parallel(plan, plan.load_model())
    tp = plan_from_dict(plan_doc([{"micro_batch": 1, "num_microbatches": 2, "stages": [
        {"layers": [0, 6], "devices": ["n/0", "n/1"], "tp": 2}]}], model="tiny-moe"))
    with pytest.raises(BadInput, match="tp"):
        check_expert_parallel(tp, tp.load_model())
    # DeepEP's deduplicated dispatch is priced, not run: the executor says so
    deepep = moe_plan([["n/0"], ["n/1"]], [0, 6], runtime={"moe_dispatcher": "deepep"})
    with pytest.raises(BadInput, match="runtime.moe_dispatcher.*'alltoall' for a real run"):
        check_runnable(deepep, deepep.load_model())
    check_runnable(moe_plan([["n/0", "n/1"]], [0, 3, 6], ep=1,
                            runtime={"moe_dispatcher": "deepep"}), deepep.load_model())


# ---------------------------------------------------------------------------- dispatch
@dataclass
class ThreadComm(ExpertComm):
    """ExpertComm whose all-to-alls go through in-process queues, one per (src, dst):
    the ranks of a group run as threads of one process."""

    boxes: dict = field(default_factory=dict)

    def _swap(self, d, parts):
        for j, r in enumerate(d.group.ranks):
            self.boxes[(self.rank, r)].put(parts[j].detach().clone())
        return [self.boxes[(r, self.rank)].get(timeout=30) for r in d.group.ranks]

    def exchange(self, d, x, send, recv):
        got = self._swap(d, x.split(send))
        assert [len(g) for g in got] == recv
        return torch.cat(got)

    def counts(self, d, mine):
        return torch.stack(self._swap(d, list(mine)))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # the ranks are threads: no intra-op pools fighting
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("ep,factor", [(2, None), (4, 0.75)])
def test_dispatch_and_combine_equal_the_whole_layer(ep, factor, one_thread):
    torch.manual_seed(0)
    c = GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16, seq_len=8,
                  moe=MoEConfig(experts=4, top_k=2, expert_hidden=24,
                                capacity_factor=factor, shared_experts=1))
    whole = MoE(c)
    group = ExpertGroup((0, 3), 0, tuple(range(ep)))
    boxes = {(a, b): queue.Queue() for a in range(ep) for b in range(ep)}
    xs = [torch.randn(2, 8, 16, requires_grad=True) for _ in range(ep)]
    ws = [torch.randn(2, 8, 16) for _ in range(ep)]
    mods, outs, errors = [], [None] * ep, []
    for r in range(ep):
        m = copy.deepcopy(whole)
        comm = ThreadComm(r, f"n/{r}", 30.0, lambda: 0.0, boxes=boxes)
        m.dispatcher = Dispatcher(group, None, r, 4, comm, [f"n/{i}" for i in range(ep)])
        for e in range(4):
            if e not in local_experts(4, ep, r):
                del m.experts[str(e)]
        mods.append(m)

    def rank(r):
        try:
            outs[r] = mods[r](xs[r])
            (outs[r] * ws[r]).sum().backward()
        except BaseException as exc:     # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [Thread(target=rank, args=(r,)) for r in range(ep)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    want_grads: dict[str, torch.Tensor] = {}
    for r in range(ep):
        x = xs[r].detach().clone().requires_grad_()
        whole.zero_grad()
        y = whole(x)
        assert torch.allclose(outs[r], y, atol=1e-6)
        (y * ws[r]).sum().backward()
        assert torch.allclose(xs[r].grad, x.grad, atol=1e-6)
        for n, p in whole.named_parameters():
            if n.startswith("experts."):
                want_grads[n] = want_grads.get(n, 0) + p.grad
            else:           # replicated: each rank's own tokens' gradient
                assert torch.allclose(dict(mods[r].named_parameters())[n].grad, p.grad,
                                      atol=1e-6), n
    for r in range(ep):
        for n, p in mods[r].named_parameters():
            if n.startswith("experts."):
                assert torch.allclose(p.grad, want_grads[n], atol=1e-6), n


# ---------------------------------------------------------------------------- real runs
def check(plan, steps: int = 3, **options):
    """`factories.assert_trains_like_single_process` at this file's tolerances."""
    return assert_trains_like_single_process(plan, steps, loss_tol=LOSS_TOL,
                                             grad_tol=GRAD_TOL, lr=LR, **options)


def _experts_held(state: dict) -> set[tuple[int, int]]:
    return {(int(n.split(".")[1]), int(n.split(".")[4])) for n in state
            if ".mlp.experts." in n}


@pytest.mark.slow
def test_ep2_alone_trains_like_single_process():
    # four replicas of the whole model, ep 2: experts reduced over pairs (0, 2), (1, 3),
    # with the distributed optimizer
    plan = moe_plan([[f"n/{q}"] for q in range(4)], [0, 6], m=1, distributed_optimizer=True)
    result = check(plan)
    for r, state in enumerate(result.state):
        mine = local_experts(4, 2, r % 2)
        assert _experts_held(state) == {(layer, e) for layer in (1, 3) for e in mine}
    a2a = [e for e in result.trace.events if e.op == "alltoall"]
    # per step and rank: 1 micro-batch x 2 MoE blocks x (dispatch, combine) x (F, B)
    assert len(a2a) == 3 * 4 * 1 * 2 * 2 * 2
    assert sum(e.bytes for e in a2a) > 0


@pytest.mark.slow
def test_ep2_in_a_pp2_pipeline_trains_like_single_process():
    # two replicas of a 2-stage pipeline (MoE layers 1 and 3 on either side), ep 2 on
    # both stages: all-to-alls between n/0 and n/2, and between n/1 and n/3; zb-h1, so
    # the backward's all-to-alls run in I and W runs none (the alone test runs B)
    result = check(moe_plan([["n/0", "n/1"], ["n/2", "n/3"]], [0, 3, 6], schedule="zb-h1"))
    events = result.trace.events
    a2a = [e for e in events if e.op == "alltoall"]
    assert a2a
    for e in a2a:           # each inside the F or I of its micro-batch, none in a W
        (inside,) = [c.op for c in events if c.op in ("F", "I", "W") and
                     (c.device, c.step, c.stage, c.microbatch) ==
                     (e.device, e.step, e.stage, e.microbatch) and
                     c.start_s <= e.start_s and e.end_s <= c.end_s]
        assert inside in ("F", "I")


@pytest.mark.slow
def test_emulated_alltoall_crosses_the_emulated_links(tmp_path):
    # x/0 and y/0 on two nodes over one 1 Gbit/s NIC each: each all-to-all ends no
    # sooner than its peer's flow could have crossed (closed form: bytes / bandwidth +
    # latency after the peer posted it)
    plan = moe_plan([["x/0"], ["y/0"]], [0, 6], cluster=TWO_NODES)
    result = check(plan, steps=2, emulate=True)
    assert result.emulated
    per_device = {d: sorted((e for e in result.trace.events
                             if e.op == "alltoall" and e.device == d),
                            key=lambda e: e.start_s) for d in ("x/0", "y/0")}
    mine, theirs = per_device["x/0"], per_device["y/0"]
    assert len(mine) == len(theirs) == 2 * 2 * 2 * 2 * 2
    bandwidth_bytes_per_s, latency_s = 1e9 / 8, 100e-6
    for a, b in ((mine, theirs), (theirs, mine)):
        for me, peer in zip(a, b, strict=True):
            assert peer.bytes > 0
            arrival_s = peer.start_s + peer.bytes / bandwidth_bytes_per_s + latency_s
            assert me.end_s >= arrival_s - 1e-4, (me, peer)
    assert all(placements(plan)[r].device in ("x/0", "y/0") for r in range(2))
    result.trace.save(tmp_path / "trace.json")          # the op round-trips a file
    assert load_trace(tmp_path / "trace.json").events == result.trace.events
