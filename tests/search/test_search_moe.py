"""Expert parallelism in the search: the `ep` dimension, its memory in the search's
tables, `--ep` (search and whatif), and the Mixtral 8x7B search on 8 H100 + 16 A100
(issue 30)."""

from __future__ import annotations

import json
import re
import time

import pytest

from hyperpipe.cli import main
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.plan.plan import StagePlan
from hyperpipe.plan.stack import RuntimeOverrides
from hyperpipe.search import space
from hyperpipe.search.attribution import attribute_experts
from hyperpipe.search.context import SearchContext
from hyperpipe.search.report import format_search
from hyperpipe.search.search import SearchConstraints, search
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.experts import alltoall_edge_bytes, alltoall_time_s

# Megatron's bytes of state per parameter for bf16 with fp32 main grads and Adam
# (Korthikanti et al. 2022; docs/architecture.md, "Memory"): 2 + 4 + 4 + 4 + 4.
BF16_STATE_BYTES = 18


def _eps(plan) -> set[int]:
    return {s.ep for p in plan.pipelines for s in p.stages}


@pytest.mark.parametrize(("model", "fixed", "ranks", "want"), [
    ("tiny-gpt", None, 4, (1,)),            # no MoE blocks: ep 1 only
    ("tiny-gpt", 2, 4, ()),                 # ... and a fixed ep 2 fits no template
    ("mixtral-8x7b", None, 6, (1, 2)),      # divisors of 8 experts and of 6 ranks
    ("mixtral-8x7b", None, 24, (1, 2, 4, 8)),
    ("mixtral-8x7b", 4, 24, (4,)),
    ("mixtral-8x7b", 4, 6, ()),             # 4 does not divide 6 ranks
])
def test_ep_options_divide_experts_and_ranks(model, fixed, ranks, want):
    c = SearchConstraints(global_batch=64, ep=fixed)
    assert space.ep_options(load_model(model), c, ranks) == want


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_search_tables_hold_one_ep_th_of_the_experts(ep):
    """A MoE block's state in the search's layer tables, against the closed form
    18 bytes x (attention, norms and router + routed experts / ep) / tp (ZeRO 0)."""
    model, cluster = load_model("mixtral-8x7b"), load_cluster("h100-a100-moe")
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=64))
    unit = ("a100-0/0", "a100-0/1")
    mode = space.MemoryMode(ep=ep)
    table = ctx.table(unit, 1, mode)
    block = model.layers[1]
    dense = block.params - block.expert_params
    want = BF16_STATE_BYTES * (dense + block.expert_params / ep) / len(unit)
    assert table.state_bytes[2] - table.state_bytes[1] == pytest.approx(want, rel=1e-9)


def test_expert_parallel_time_adds_the_all_to_all():
    """With ep > 1 a MoE layer's forward takes longer in the tables than at ep 1 (its
    dispatch and combine, the busiest rank's extra experts), a dense layer's does not."""
    model, cluster = load_model("mixtral-8x7b"), load_cluster("h100-a100-moe")
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=64))
    unit = ("a100-0/0", "a100-0/1")
    one, four = (ctx.table(unit, 1, space.MemoryMode(ep=e)) for e in (1, 4))
    fwd = [t.fwd_s[2] - t.fwd_s[1] for t in (one, four)]
    assert fwd[1] > fwd[0]
    head = model.num_layers - 1
    assert four.fwd_s[head + 1] - four.fwd_s[head] == \
        pytest.approx(one.fwd_s[head + 1] - one.fwd_s[head])


def test_tables_price_the_dispatcher_the_search_runs_with():
    """Under `moe_dispatcher: deepep` a MoE layer's forward in the tables differs from
    "alltoall"'s by its all-to-alls alone: 2 exchanges (dispatch, combine) over the same
    edges, each carrying `alltoall_edge_bytes` of its dispatcher."""
    model, cluster = load_model("mixtral-8x7b"), load_cluster("h100-a100-moe")
    cost = CostModel(model, cluster)
    unit, mode = ("a100-0/0", "a100-0/1"), space.MemoryMode(ep=4)
    runs = {}
    for name in ("alltoall", "deepep"):
        ctx = SearchContext(cost, SearchConstraints(
            global_batch=64, runtime=RuntimeOverrides(moe_dispatcher=name)))
        table = ctx.table(unit, 1, mode)
        edges = ctx.ep_exchange(unit, 1, 4)[1]
        st = StagePlan((1, 2), unit, 2, ep=4)
        a2a = alltoall_time_s(cost, list(edges),
                              alltoall_edge_bytes(cost, st, 1, edges, name))[0]
        runs[name] = (table.fwd_s[2] - table.fwd_s[1], a2a)
    (flat_f, flat_a2a), (dedup_f, dedup_a2a) = runs["alltoall"], runs["deepep"]
    assert dedup_a2a < flat_a2a
    assert flat_f - dedup_f == pytest.approx(2 * (flat_a2a - dedup_a2a), rel=1e-9)


def test_fixed_ep_is_kept(capsys):
    """`--ep` fixes the degree of every stage of the pick."""
    for ep in (1, 2):
        assert main(["search", "--model", "tiny-moe", "--cluster", "demo-hetero",
                     "--global-batch", "16", "--ep", str(ep), "--json"]) == 0
        best = json.loads(capsys.readouterr().out)["best"]
        assert {s.get("ep", 1) for p in best["plan"]["pipelines"]
                for s in p["stages"]} == {ep}


def test_whatif_fixes_ep(capsys):
    """`whatif --ep` fixes the degree of every variant's pick (the flag is shared)."""
    assert main(["whatif", "--model", "tiny-moe", "--cluster", "demo-hetero",
                 "--global-batch", "16", "--vary", "inter_node.bandwidth=10 Gbit/s,"
                 "100 Gbit/s", "--ep", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 2
    for row in rows:
        assert {s.get("ep", 1) for p in row["best"]["plan"]["pipelines"]
                for s in p["stages"]} == {2}


@pytest.mark.parametrize(("model", "ep", "needle"), [
    ("mixtral-8x7b", 3, "divisor of the model's routed experts (8)"),
    ("tiny-gpt", 2, "has no MoE blocks"),
])
def test_bad_ep_is_one_line(capsys, model, ep, needle):
    code = main(["search", "--model", model, "--cluster", "demo-hetero",
                 "--global-batch", "16", "--ep", str(ep)])
    err = capsys.readouterr().err
    assert code == 2 and "--ep" in err and needle in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def mixtral_search():
    """Mixtral 8x7B on 8 H100 + 16 A100 over 200 Gbit/s at NeMo's pretraining recipe
    (NVIDIA/NeMo nemo/collections/llm/recipes/mixtral_8x7b.py: sequence 8192, global
    batch 512); tp 2, micro-batch 2 and pp 3 fixed to keep the test short, ep and the
    rest searched."""
    model = load_model({"preset": "mixtral-8x7b", "seq_len": 8192})
    cluster = load_cluster("h100-a100-moe")
    cost = CostModel(model, cluster)
    t0 = time.perf_counter()
    result = search(model, cluster, SearchConstraints(global_batch=512, tp=2,
                                                      micro_batch=2, pp=3), quiet=True)
    took = time.perf_counter() - t0
    print(f"mixtral search: {took:.1f} s")
    return result, cost


@pytest.mark.slow
def test_mixtral_search_picks_expert_parallelism_that_fits(mixtral_search):
    result, cost = mixtral_search
    best = result.best
    assert max(_eps(best.plan)) > 1
    assert not best.metrics.oom
    report = format_search(result, cost)
    assert re.search(r"ep\d", report)          # the plan line names its ep
    assert "ep 1 (no expert parallelism)" in report


@pytest.mark.slow
def test_dualpipe_v_beats_1f1b_on_the_pick(mixtral_search):
    """DualPipe-V hides one micro-batch's all-to-all under another's compute: on the
    pick's devices it is faster than 1F1B, by the margin the report prints."""
    result, cost = mixtral_search
    gains = {g.what: g for g in attribute_experts(result.best, cost)}
    one, dual = gains["1f1b"], gains["dualpipe-v"]
    assert dual.time_s < one.time_s
    report = format_search(result, cost)
    line = next(x for x in report.splitlines() if "dualpipe-v (all-to-all" in x)
    margin = float(re.search(r"margin ([\d.]+)x", line).group(1))
    print(line)
    assert "beats" in line and margin == pytest.approx(one.time_s / dual.time_s, abs=1e-3)


def test_the_seeds_answer_where_no_template_of_the_search_combines():
    """tp 2, ep 2 over two replicas of one stage on demo-hetero (one A100 pair, one V100
    pair): an expert group across the two device classes is no combination of the
    search's per-class templates, but the uniform layout is one, and fits; the search
    had refused with a memory shortfall (18 MB of state against 241 GB). The pick is
    priced as `simulate` prices the same plan."""
    from hyperpipe.search.baselines import uniform_plan
    from hyperpipe.sim.simulator import simulate
    model, cluster = load_model("tiny-moe"), load_cluster("demo-hetero")
    c = SearchConstraints(global_batch=32, ep=2, tp=2, dp=2, pp=1, micro_batch=16)
    res = search(model, cluster, c, top=1, workers=1, peers=False)
    assert res.seeded_from in ("uniform", "proportional")
    assert _eps(res.best.plan) == {2}
    assert c.admits(res.best.plan)
    same = uniform_plan(model, cluster, pp=1, dp=2, tp=2, ep=2, micro_batch=16,
                        global_batch=32, schedule=res.best.plan.schedule)
    assert res.best.metrics.iteration_time_s == pytest.approx(
        simulate(same, CostModel(model, cluster)).metrics.iteration_time_s, rel=1e-9)
