"""The search's ZeRO and context-parallel dimensions: cp only where the sequence needs
it, the memory model of the simulator's ZeRO-2/3 and cp rules, `--zero`/`--cp` fixing
them, and the analytic tier within 5% of the simulator on the short lists."""

from __future__ import annotations

import time

import pytest
from factories import cluster_doc

from hyperpipe.cli import main
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.plan.plan import StagePlan
from hyperpipe.search import partition as P
from hyperpipe.search import space
from hyperpipe.search.search import SearchConstraints, search
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.sharding import ring_attention_extra_s

LINK = {"bandwidth": "450 GB/s", "latency": "2 us"}


def _h100(nodes: int) -> object:
    doc = cluster_doc(None, [(f"n{i}", "H100-SXM", 8) for i in range(nodes)],
                      intra_link=LINK, name=f"h100x{nodes}")
    doc["inter_node"] = {"bandwidth": "400 Gbit/s", "latency": "5 us"}
    return load_cluster(doc)


def _llama(seq: int, layers: int = 6):
    return load_model({"preset": "llama3-8b", "n_layer": layers, "seq_len": seq})


def test_cp_is_tried_only_for_long_sequences():
    c = SearchConstraints(global_batch=8)
    short, long = _llama(8192), _llama(131072)
    assert space.cp_options(short, c) == (1,)
    assert space.cp_options(long, c) == (1, 2, 4, 8, 16, 32)
    # attention's share by the closed form 4 s^2 h / (block FLOPs), grows with s
    assert space.attention_share(long) > 0.5 > space.attention_share(short)
    # a fixed cp is the only one; a long sequence found out of memory adds the rest
    assert space.cp_options(short, SearchConstraints(global_batch=8, cp=4)) == (4,)
    assert space.cp_options(short, c, long_sequence=True)[:3] == (1, 2, 4)
    assert space.cp_options(load_model({"preset": "llama3-8b", "seq_len": 12}), c,
                            long_sequence=True) == (1, 2)    # 12 splits into 2 x 2 only


def test_units_of_cp_groups_are_tensor_rank_innermost():
    cluster = _h100(2)
    pool = space.unit_pools(cluster, 4, cp=4)["H100-SXM"]
    assert pool.cp == 4 and len(pool.units) == 1            # 16 devices, one unit
    unit = pool.units[0]
    assert unit[:4] == ("n0/0", "n0/1", "n0/2", "n0/3") and unit[12:] == (
        "n1/4", "n1/5", "n1/6", "n1/7")
    assert len(space.unit_pools(cluster, 2, cp=2)["H100-SXM"].units) == 4


def test_layer_tables_follow_the_simulators_rules():
    """The search's per-layer memory and time of a cp 2, ZeRO-2/3 stage kind equal the
    cost model's for the same stage (the rules the simulator prices by)."""
    model = _llama(32768, layers=4)
    cost = CostModel(model, _h100(2))
    devs = tuple(f"n0/{i}" for i in range(4))          # tp 2 x cp 2
    fwd, bwd = P.layer_times(cost, devs, 1, "full", True, cp=2)
    n = model.num_layers
    st = StagePlan((0, n), devs, 2, "full", True, 2)
    want_f = sum(cost.stage_time_s((i, i + 1), devs, 1, "F", sequence_parallel=True, cp=2)
                 for i in range(n)) + ring_attention_extra_s(cost, st, 1, "F")
    assert fwd[-1] == pytest.approx(want_f, rel=1e-9)
    assert bwd[-1] > fwd[-1]
    st = StagePlan((0, n), devs, 2, "none", True, 2)      # memory: no recompute
    for zero, reshard in ((2, True), (3, True), (3, False)):
        t = P.layer_memory(cost, 2, 1, fwd, bwd, "none", True, 8, zero=zero, cp=2,
                           reshard=reshard)
        static = cost.device_static_bytes((st,), 1, 8, zero=zero,
                                          reshard_after_forward=reshard)
        reserve = cost.runtime_reserve_bytes("H100-SXM")
        assert t.state_bytes[-1] + t.work_bytes + reserve == pytest.approx(static, rel=1e-9)
        assert t.stash_bytes[-1] == pytest.approx(cost.stage_stash_bytes(st, 1), rel=1e-9)


def _short_list_gap(result, cost) -> float:
    """The largest |analytic / simulator - 1| of iteration time over the ranked plans."""
    return max(abs(estimate(c.plan, cost).iteration_time_s / c.metrics.iteration_time_s - 1)
               for c in result.ranked)


def test_long_sequence_search_chooses_cp_and_short_one_does_not():
    """Llama 3 8B (32 blocks) on two nodes, one stage of tp 8 per replica: at 131,072
    tokens a replica of one context rank holds its activations only with full
    recompute, two context ranks hold them without (and shard the optimizer state):
    the search takes cp 2; at 8,192 it never tries cp."""
    cluster = _h100(2)
    for seq, wants_cp in ((131072, True), (8192, False)):
        model = load_model({"preset": "llama3-8b", "seq_len": seq})
        t0 = time.perf_counter()
        result = search(model, cluster, SearchConstraints(global_batch=4, tp=8, pp=1,
                                                          micro_batch=1), top=3, quiet=True)
        assert time.perf_counter() - t0 < 60
        best = result.best
        assert not best.metrics.oom
        cps = {st.cp for p in best.plan.pipelines for st in p.stages}
        assert (max(cps) > 1) == wants_cp, (seq, cps)
        assert _short_list_gap(result, CostModel(model, cluster)) <= 0.05


def test_zero_and_cp_fixed_and_priced_alike_by_both_tiers():
    cluster = _h100(2)
    model = _llama(16384, layers=4)
    result = search(model, cluster, SearchConstraints(global_batch=4, tp=4, cp=2, zero=3,
                                                      micro_batch=1), top=3, quiet=True)
    for cand in result.ranked:
        assert cand.plan.zero == 3
        assert {st.cp for p in cand.plan.pipelines for st in p.stages} == {2}
    assert _short_list_gap(result, CostModel(model, cluster)) <= 0.05


def test_search_flags_fix_zero_cp_and_sequence(tmp_path):
    out = tmp_path / "best.json"
    rc = main(["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
               "--global-batch", "8", "--zero", "2", "--cp", "2", "--seq-len", "128",
               "--out", str(out)])
    assert rc == 0
    import json
    plan = json.loads(out.read_text())
    assert plan["zero"] == 2
    assert {st.get("cp", 1) for p in plan["pipelines"] for st in p["stages"]} == {2}
    assert plan["model"]["seq_len"] == 128
    assert main(["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                 "--global-batch", "8", "--cp", "3"]) == 2        # 64 tokens: 2 x 3 chunks no


def test_uneven_sharding_closed_form():
    """Two replicas of one stage, an A100-80GB and an A100-40GB, ZeRO-3 sharded by
    memory: the 80 GB rank holds 2/3 of the sharded state, the 40 GB one 1/3; each
    gather and scatter takes n x max share = 4/3 of the even one; the executor refuses it."""
    from hyperpipe.core.errors import BadInput
    from hyperpipe.exec.placement import check_runnable
    from hyperpipe.plan.plan import plan_from_dict
    from hyperpipe.sim.sharding import (
        dp_shards,
        fsdp_extra_s,
        overlapped_pass_s,
        shard_fractions,
        uneven_factor,
    )
    doc = cluster_doc(None, [("a", "A100-80GB", 1), ("b", "A100-40GB", 1)], intra_link=LINK,
                      name="mixed")
    doc["inter_node"] = {"bandwidth": "100 Gbit/s", "latency": "5 us"}
    cluster = load_cluster(doc)
    model = load_model({"preset": "gpt2-small", "n_layer": 2})
    pipes = [{"micro_batch": 1, "num_microbatches": 2, "stages": [
        {"layers": [0, model.num_layers], "devices": [d]}]} for d in ("a/0", "b/0")]

    def plan(shard):
        return plan_from_dict({"format": "hyperpipe.plan/1", "model": model.to_dict(),
                               "cluster": doc, "global_batch": 4, "zero": 3,
                               "schedule": "1f1b", "runtime": {"shard": shard},
                               "pipelines": pipes})
    even, uneven = plan("even"), plan("memory")
    big, small = (uneven.pipelines[q].stages[0] for q in (0, 1))
    assert dp_shards(even, big, cluster) == 2
    assert dp_shards(uneven, big, cluster) == pytest.approx(1.5)      # 1 / (2/3)
    assert dp_shards(uneven, small, cluster) == pytest.approx(3.0)    # 1 / (1/3)
    assert shard_fractions([80e9, 40e9]) == pytest.approx([2 / 3, 1 / 3])
    assert uneven_factor([0.5, 0.5]) == 1.0
    cost = CostModel(model, cluster)
    group = ("a/0", "b/0")
    for op in ("F", "B"):
        units = list(range(model.num_layers))[::1 if op == "F" else -1]
        compute = [cost.stage_time_s((i, i + 1), ("a/0",), 1, op) for i in units]
        nbytes = [model.layers[i].params * (2 if op == "F" else 4) for i in units]
        comm = [cost.allgather_time_s(group, b) for b in nbytes]
        none = [0.0] * len(units)
        for plan_, scale in ((even, 1.0), (uneven, 4 / 3)):
            gathers, scatters = ([scale * c for c in comm], none) if op == "F" else \
                (none, [scale * c for c in comm])
            want = overlapped_pass_s(compute, gathers, scatters) - sum(compute)
            if op == "B":     # B regathers too (reshard): gathers and scatters both
                gathers = [scale * cost.allgather_time_s(group, model.layers[i].params * 2)
                           for i in units]
                want = overlapped_pass_s(compute, gathers, scatters) - sum(compute)
            got = fsdp_extra_s(cost, plan_, 0, 0, op, reshard=True)
            assert got == pytest.approx(want, rel=1e-9)
        assert fsdp_extra_s(cost, uneven, 0, 0, op, reshard=True) > \
            fsdp_extra_s(cost, even, 0, 0, op, reshard=True)
    # memory: the 80 GB rank's sharded state is twice the 40 GB rank's
    s80 = cost.state_bytes(big.layers, 1, dp_shards(uneven, big, cluster), 3)
    s40 = cost.state_bytes(small.layers, 1, dp_shards(uneven, small, cluster), 3)
    assert s80 == pytest.approx(2 * s40)
    with pytest.raises(BadInput, match="runtime.shard"):
        check_runnable(uneven, model)


@pytest.mark.parametrize("zero,reshard", [(2, None), (3, True), (3, False)])
def test_zero_templates_count_their_per_micro_batch_collectives(zero, reshard):
    """A template's closed form (what ranks and prunes templates) against the analytic
    tier on its own plan, for ZeRO-2/3 over a slow inter-node link with 16 micro-batches
    per pipeline: the per-micro-batch gathers and scatters are most of the time, and a
    closed form that left them out (as it once did: 3.6x under on GPT-3 175B at 1,024
    GPUs, so the search picked zero 2 plans 2.5x slower than a tuned baseline) would be
    far under; within 20% here (ZeRO-1 plans sit 16% under, the closed form's
    approximate gradient sync)."""
    from hyperpipe.search.search import _build_plan
    from hyperpipe.search.templates import (
        PhaseStats,
        SearchContext,
        all_configs,
        group_templates,
    )
    doc = cluster_doc(None, [(f"n{i}", "A100-40GB", 4) for i in range(8)],
                      intra_link=LINK, name="a100x8-slow")
    doc["inter_node"] = {"bandwidth": "25 Gbit/s", "latency": "10 us"}
    cluster = load_cluster(doc)
    model = load_model({"preset": "gpt3-1.3b", "n_layer": 8})
    from hyperpipe.plan.stack import RuntimeOverrides
    c = SearchConstraints(global_batch=64, zero=zero, tp=4, micro_batch=1, dp=4, pp=2,
                          runtime=RuntimeOverrides(reshard_after_forward=reshard))
    ctx = SearchContext(CostModel(model, cluster), c)
    tpls = group_templates(ctx, PhaseStats("templates"), tuple(ctx.classes),
                           all_configs(ctx))
    # the group's templates of 4 replicas (it keeps fewer replicas too, for combining
    # with other groups into the 4 pipelines asked for; their order is not a contract)
    tpls = [tpl for tpl in tpls if tpl.dp == 4]
    assert tpls
    for tpl in tpls[:6]:
        assert tpl.mode.zero == zero
        m = -(-(64 // tpl.micro_batch) // tpl.dp)
        plan = _build_plan(ctx, (tpl,))
        analytic = estimate(plan, ctx.cost).iteration_time_s
        assert tpl.time_s(m) == pytest.approx(analytic, rel=0.20), (tpl.kind, tpl.dp)


def test_a_zero3_search_picks_plans_run_runs():
    """`run` does ZeRO-3 without the I/W split (FSDP2 reduce-scatters after a unit's
    whole backward), so a search with --zero 3 keeps to those kinds, no synthesised
    orders: its pick and every plan it ranks pass `run`'s checks (it had picked zb-h1,
    which `run` refused). Asked for by name, a split kind is still searched."""
    from hyperpipe.exec import RunOptions
    from hyperpipe.exec.job import prepare
    from hyperpipe.plan.kinds import schedule_kind
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    result = search(model, cluster, SearchConstraints(global_batch=16, pp=2, dp=2, zero=3),
                    top=5, peers=False)
    for cand in [*result.ranked, *result.baselines.values()]:
        assert not schedule_kind(cand.plan.schedule).splits_backward, cand.plan.schedule
    prepare(result.best.plan, RunOptions())        # raises BadInput where run refuses
    asked = search(model, cluster, SearchConstraints(global_batch=16, pp=2, dp=2, zero=3,
                                                     schedule="zb-h1"), peers=False)
    assert asked.best.plan.schedule == "zb-h1"
