"""Peer planners: their DPs against brute force, Metis's estimator against the simulator
where its closed form is exact, and plans that check."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from factories import FREE_LINK as FREE

from hyperpipe.cluster.cluster import cluster_from_dict, load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.peers import PEERS
from hyperpipe.search.peers.common import GroupTable, min_max_bound, min_sum_cuts
from hyperpipe.search.peers.metis import balance_memory, metis_plan, proportional_cuts
from hyperpipe.search.search import SearchConstraints
from hyperpipe.search.templates import SearchContext
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate


def _mats(rng, n: int, p: int) -> list[np.ndarray]:
    out = []
    for _ in range(p):
        pre = np.concatenate([[0.0], np.cumsum(rng.uniform(0.5, 2.0, n))])
        m = pre[None, :] - pre[:, None]
        idx = np.arange(n + 1)
        out.append(np.where(idx[:, None] < idx[None, :], m, np.inf))
    return out


def test_cut_dps_match_brute_force():
    rng = np.random.default_rng(0)
    for n, p in ((6, 2), (7, 3), (8, 4)):
        mats = _mats(rng, n, p)
        cuts = [[0, *c, n] for c in itertools.combinations(range(1, n), p - 1)]
        times = [[mats[k][b[k], b[k + 1]] for k in range(p)] for b in cuts]
        assert min_max_bound(mats) == pytest.approx(min(max(t) for t in times))
        bound = sorted(max(t) for t in times)[len(times) // 2]
        got = min_sum_cuts(mats, bound)
        want = min(sum(t) for t in times if max(t) <= bound)
        assert got[0] == pytest.approx(want)
        assert max(mats[k][got[1][k], got[1][k + 1]] for k in range(p)) <= bound


def test_proportional_cuts_and_memory_balance():
    assert proportional_cuts(10, [3.0, 1.0]) == [0, 7, 10]
    # stage 0 holds 1 byte per layer of room for 3 layers; balancing moves the rest on
    tab = [GroupTable(np.arange(9.0), np.arange(9.0), np.zeros(9), mem)
           for mem in (3.0, 100.0)]
    assert balance_memory([0, 6, 8], tab, [1, 1]) == [0, 3, 8]
    assert balance_memory([0, 6, 8], [tab[0], tab[0]], [1, 1]) is None


def test_metis_estimate_is_the_simulated_1f1b_time_on_equal_stages():
    # homogeneous devices, free links, no parameters: 1F1B takes (m + p - 1) (F + B),
    # Metis's (m - 1) max + sum exactly
    cluster = cluster_from_dict({
        "device_types": {"x": {"peak_flops": "10 TFLOP/s", "efficiency": 1.0,
                               "memory": "1000 GB", "mem_bandwidth": "1e15 B/s"}},
        "nodes": [{"name": "n", "device": "x", "count": 4, "intra_link": FREE}],
        "inter_node": FREE}, where="test", name="even")
    model = load_model({"kind": "synthetic", "layers": 8, "fwd_flops_per_sample": 1e12,
                        "activation_bytes_per_sample": 0, "params_per_layer": 0,
                        "name": "syn"})
    cost = CostModel(model, cluster)
    ctx = SearchContext(cost, SearchConstraints(global_batch=8, micro_batch=1, dp=1))
    plan, own_s = metis_plan(ctx)
    assert [st.num_layers for st in plan.pipelines[0].stages] == [2, 2, 2, 2]
    assert simulate(plan, cost).metrics.iteration_time_s == pytest.approx(own_s, rel=1e-6)


@pytest.mark.parametrize("name", sorted(PEERS))
def test_peers_pick_plans_that_check(name):
    model, cluster = load_model("gpt2-medium"), load_cluster("a100-v100")
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=64))
    plan, own_s = PEERS[name](ctx)
    plan.check(model, cluster)
    # each is given every subset of the device classes (its hostfile) and uses all of
    # the subset it picks: whole classes, nothing else
    used = {cluster.device(d).node for d in plan.devices}
    picked = {name for name, cls in ctx.classes.items() if used & set(cls.nodes)}
    assert own_s > 0 and sorted(plan.devices) == sorted(
        d.name for d in cluster.devices if any(d.node in ctx.classes[t].nodes for t in picked))
    assert plan.schedule == "1f1b"


def test_peers_keep_the_schedule_the_user_fixed():
    """A fixed generated kind reaches every baseline and peer (their 1F1B picks run it);
    a fixed chunk count they cannot split their stages into leaves the peers out, as a
    fixed context or expert parallelism does."""
    from hyperpipe.search.search import search
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    got = search(model, cluster, SearchConstraints(global_batch=16, schedule="zb-h1"))
    assert set(PEERS) <= set(got.baselines)
    assert {c.plan.schedule for c in got.baselines.values()} == {"zb-h1"}
    for cand in got.baselines.values():     # each one simulated as the kind it now has
        assert cand.metrics.iteration_time_s == pytest.approx(
            simulate(cand.plan, CostModel(model, cluster)).metrics.iteration_time_s)
    got = search(model, cluster, SearchConstraints(global_batch=16,
                                                   schedule="interleaved-1f1b", chunks=2))
    assert not set(PEERS) & set(got.baselines)
    assert all(c.plan.chunks == 2 for c in got.baselines.values())
    from hyperpipe.search.report import format_search
    text = format_search(got, CostModel(model, cluster))
    for name in PEERS:                    # the report says so, rather than leave it out
        assert f"  {name:<13}no plan: none of its picks fits" in text


def test_a_fixed_interleaved_kind_keeps_one_chunk_peers_out_unless_asked():
    """--schedule interleaved-1f1b alone: the search interleaves (2 or 4 chunks), so the
    peers' one-chunk picks, 1F1B's layout under another name, do not compete (they had
    beaten the pick by 1.13x as plain 1F1B); with --chunks 1 they do."""
    from hyperpipe.search.search import search
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    got = search(model, cluster, SearchConstraints(global_batch=16,
                                                   schedule="interleaved-1f1b"))
    assert not set(PEERS) & set(got.baselines)
    assert all(c.plan.chunks in (2, 4) for c in got.baselines.values())
    assert got.best.plan.chunks in (2, 4)
    got = search(model, cluster, SearchConstraints(global_batch=16,
                                                   schedule="interleaved-1f1b", chunks=1))
    assert set(PEERS) <= set(got.baselines)
    assert {c.plan.chunks for c in got.baselines.values()} == {1}


@pytest.mark.parametrize("model_name,cluster_name,batch", [
    ("gpt2-medium", "a100-v100", 64), ("tiny-gpt", "demo-hetero", 16),
    ("gpt2-xl", "h100-a100-l4", 128)])
def test_metis_branch_and_bound_picks_what_the_exhaustive_walk_picks(
        model_name, cluster_name, batch):
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=batch))
    fast, slow = metis_plan(ctx), metis_plan(ctx, prune=False)
    assert fast[0] == slow[0] and fast[1] == slow[1]


@pytest.mark.parametrize("model_name,cluster_name,batch", [
    ("gpt2-medium", "a100-v100", 64), ("tiny-gpt", "demo-hetero", 16),
    ("gpt2-xl", "h100-a100-l4", 128)])
def test_amp_branch_and_bound_picks_what_the_exhaustive_walk_picks(
        model_name, cluster_name, batch):
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=batch))
    fast = PEERS["amp"](ctx)
    slow = PEERS["amp"](SearchContext(CostModel(model, cluster),
                                      SearchConstraints(global_batch=batch)), prune=False)
    assert fast[0] == slow[0] and fast[1] == slow[1]


def _balance_reference(bounds, tables, inflight):
    """Metis's memory balancing written plainly: recompute every stage's room each move."""
    b, p = list(bounds), len(bounds) - 1

    def free(k):
        t = tables[k]
        return t.memory_bytes - (t.state_bytes[b[k + 1]] - t.state_bytes[b[k]]) - \
            inflight[k] * (t.stash_bytes[b[k + 1]] - t.stash_bytes[b[k]])

    for _ in range(b[-1] * p):
        over = [k for k in range(p) if free(k) < 0]
        if not over:
            return b
        k = over[0]
        if b[k + 1] - b[k] <= 1:
            return None
        left = free(k - 1) if k > 0 else -np.inf
        right = free(k + 1) if k < p - 1 else -np.inf
        if max(left, right) <= 0:
            return None
        if left >= right:
            b[k] += 1
        else:
            b[k + 1] -= 1
    return None


def test_memory_balance_matches_the_plain_walk():
    rng = np.random.default_rng(3)
    outcomes = set()
    for _ in range(400):
        p = int(rng.integers(2, 7))
        n = int(rng.integers(2 * p, 30))
        tabs = [GroupTable(np.zeros(n + 1),
                           np.concatenate([[0.0], np.cumsum(rng.uniform(0.5, 2, n))]),
                           np.concatenate([[0.0], np.cumsum(rng.uniform(0, 1, n))]),
                           float(rng.uniform(0.6, 2.0) * 2.5 * n / p))
                for _ in range(p)]
        bounds = proportional_cuts(n, list(rng.uniform(1, 4, p)))
        inflight = [min(p - k, 4) for k in range(p)]
        got = balance_memory(bounds, tabs, inflight)
        assert got == _balance_reference(bounds, tabs, inflight)
        outcomes.add(got is None)
    assert outcomes == {True, False}
