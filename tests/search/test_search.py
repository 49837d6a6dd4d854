"""The plan search: optimality against brute force, fixed dimensions, infeasible input."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from factories import FREE_LINK, chain_plan, cluster_doc, device_type, synthetic_doc

from hyperpipe.cli import main
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput, InfeasiblePlan
from hyperpipe.models import load_model
from hyperpipe.plan.kinds import generate
from hyperpipe.plan.plan import load_plan
from hyperpipe.search import partition as P
from hyperpipe.search import space, templates
from hyperpipe.search.baselines import layer_counts, proportional_plan, uniform_plan
from hyperpipe.search.caches import BookKey
from hyperpipe.search.context import PhaseStats, SearchContext
from hyperpipe.search.search import SearchConstraints, search, split_batch
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate


def _cluster(types: dict[str, float], counts: list[tuple[str, int]]) -> dict:
    """Free links, memory that never runs out, device speed in TFLOP/s (efficiency 1)."""
    return cluster_doc({t: device_type(f"{tf} TFLOP/s", mem_bandwidth="1e15 B/s")
                        for t, tf in types.items()},
                       [(f"n{i}", t, n) for i, (t, n) in enumerate(counts)],
                       intra_link=FREE_LINK, inter_node=FREE_LINK, name="small")


def _model(flops: list[float]) -> dict:
    """A synthetic model whose layer i does flops[i] x 1e12 forward FLOPs per sample and
    sends nothing (so links are free whatever their speed)."""
    return synthetic_doc([{"fwd_flops_per_sample": f * 1e12} for f in flops], name="bf",
                         activation_bytes_per_sample=0, params_per_layer=0)


# ------------------------------------------------------------------ brute-force oracle

def _one_f_one_b_time(stage_times: list[tuple[float, float]], m: int) -> float:
    """Makespan of 1F1B with stage s taking (F, B) seconds per micro-batch and free links,
    by list scheduling the per-device order of `generate` (F after the previous stage's
    F; B after this stage's F and the next stage's B). Written here, apart from the
    simulator and the cost model."""
    p = len(stage_times)
    order = generate("1f1b", p, m).actions
    end: dict[tuple[int, str, int], float] = {}
    clock = [0.0] * p
    pos = [0] * p
    left = sum(len(r) for r in order)
    while left:
        for d in range(p):
            if pos[d] == len(order[d]):
                continue
            a = order[d][pos[d]]
            if a.op == "F":
                deps = [(d - 1, "F", a.microbatch)] if d else []
            else:
                deps = [(d, "F", a.microbatch)] + ([(d + 1, "B", a.microbatch)]
                                                   if d < p - 1 else [])
            if any(k not in end for k in deps):
                continue
            start = max([clock[d]] + [end[k] for k in deps])
            clock[d] = start + stage_times[d][0 if a.op == "F" else 1]
            end[(d, a.op, a.microbatch)] = clock[d]
            pos[d] += 1
            left -= 1
    return max(clock)


def _brute_force(model_flops: list[float], cluster: dict, mb: int, m: int):
    """Least 1F1B makespan over every device order and every cut into len(devices) stages
    (B = I + W = 2 x forward FLOPs; time = FLOPs / device FLOP/s)."""
    speed = {t: float(v["peak_flops"].split()[0]) * 1e12
             for t, v in cluster["device_types"].items()}
    devices = [(f"{n['name']}/{i}", n["device"]) for n in cluster["nodes"]
               for i in range(n["count"])]
    n_layers, p = len(model_flops), len(devices)
    best = (float("inf"), None)
    seen_orders = set()
    for perm in itertools.permutations(devices):
        types = tuple(t for _, t in perm)
        if types in seen_orders:          # identical devices: same makespan
            continue
        seen_orders.add(types)
        for cuts in itertools.combinations(range(1, n_layers), p - 1):
            bounds = (0, *cuts, n_layers)
            times = []
            for s in range(p):
                f = sum(model_flops[bounds[s]:bounds[s + 1]]) * 1e12 * mb / speed[types[s]]
                times.append((f, 2 * f))
            t = _one_f_one_b_time(times, m)
            if t < best[0]:
                best = (t, [d for d, _ in perm], bounds)
    return best


CASES = [
    # (device types TFLOP/s, nodes, per-layer forward TFLOP per sample, micro-batches)
    ({"fast": 2.5, "slow": 1.0}, [("fast", 2), ("slow", 2)], [1.0] * 10, 8),
    ({"a": 3.0, "b": 1.5, "c": 1.0}, [("a", 1), ("b", 2), ("c", 2)],
     [1, 2, 1, 3, 1, 1, 2, 1, 2], 6),
    ({"fast": 3.0, "slow": 1.0}, [("slow", 3), ("fast", 3)],
     [1, 1, 2, 1, 1, 3, 1, 1, 2, 1, 1, 1], 6),
    ({"a": 2.0, "b": 1.0, "c": 0.5}, [("c", 2), ("a", 2), ("b", 2)],
     [2, 1, 1, 3, 1, 2, 1, 1], 4),
]


@pytest.mark.parametrize("types,nodes,flops,m", CASES)
def test_search_matches_brute_force(types, nodes, flops, m):
    cluster_doc = _cluster(types, nodes)
    model_doc = _model(flops)
    model, cluster = load_model(model_doc), load_cluster(cluster_doc)
    n_dev = sum(n for _, n in nodes)
    mb = 2
    bf_time, bf_devices, bf_bounds = _brute_force(flops, cluster_doc, mb, m)
    res = search(model, cluster, SearchConstraints(global_batch=mb * m, micro_batch=mb,
                                                   schedule="1f1b", pp=n_dev, dp=1, tp=1))
    cost = CostModel(model, cluster)
    best = res.best
    # the search's pick, timed by the independent oracle and by the simulator
    pipe = best.plan.pipelines[0]
    speed = {t: tf * 1e12 for t, tf in types.items()}
    oracle = _one_f_one_b_time(
        [(f, 2 * f) for f in (sum(flops[a:b]) * 1e12 * mb /
                              speed[cluster.device(st.devices[0]).type.name]
                              for st in pipe.stages for a, b in [st.layers])], m)
    assert oracle <= bf_time * 1.01
    bf_plan = chain_plan(model.to_dict(), cluster_doc, bf_bounds, bf_devices, mb, m)
    bf_sim = simulate(bf_plan, cost).metrics.iteration_time_s
    assert best.metrics.iteration_time_s <= bf_sim * 1.01
    # the simulator and the oracle agree on free links (so the comparison means something)
    assert bf_sim == pytest.approx(bf_time, rel=1e-6)
    # and the heterogeneity-aware plan beats the uniform split it is compared with
    assert best.metrics.iteration_time_s < res.baselines["uniform"].metrics.iteration_time_s


def test_fixed_dimensions_are_respected():
    model = load_model("gpt2-medium")
    cluster = load_cluster("h100-a100-l4")
    c = SearchConstraints(global_batch=64, micro_batch=4, schedule="interleaved-1f1b",
                          pp=3, tp=2, chunks=2)
    res = search(model, cluster, c, top=3)
    assert res.ranked
    for cand in res.ranked:
        plan = cand.plan
        assert plan.schedule == "interleaved-1f1b" and plan.chunks == 2
        for pipe in plan.pipelines:
            assert pipe.micro_batch == 4
            assert len(pipe.stages) == 3 * 2
            assert all(st.tp == 2 and len(st.devices) == 2 for st in pipe.stages)
        plan.check(model, cluster)
    res = search(model, cluster, SearchConstraints(global_batch=64, dp=3, schedule="zb-h1"))
    assert all(len(c.plan.pipelines) == 3 and c.plan.schedule == "zb-h1" for c in res.ranked)


def test_heterogeneous_dp_split_is_proportional_to_speed():
    # two identical-shape pipelines, one on devices 3x faster: the batch follows speed
    counts = split_batch([lambda m: m * 1.0, lambda m: m * 3.0], 16)
    assert counts == [12, 4]
    # and the optimum is what brute force over all splits gives
    times = [lambda m: 0.5 + m * 1.0, lambda m: 2.0 + m * 2.5, lambda m: m * 1.7]
    best = min((max(f(k) for f, k in zip(times, ks, strict=True)), ks)
               for ks in itertools.product(range(1, 20), repeat=3) if sum(ks) == 20)
    got = split_batch(times, 20)
    assert max(f(k) for f, k in zip(times, got, strict=True)) == pytest.approx(best[0])


def test_baselines_follow_megatron_rank_order():
    cluster = load_cluster("h100-a100-l4")
    model = load_model("gpt2-small")            # 14 layers
    plan = uniform_plan(model, cluster, pp=4, dp=2, tp=2, micro_batch=2, global_batch=32)
    names = [d.name for d in cluster.devices]
    for r, pipe in enumerate(plan.pipelines):
        assert pipe.num_microbatches == 8
        for s, st in enumerate(pipe.stages):
            first = (s * 2 + r) * 2
            assert st.devices == tuple(names[first:first + 2])
        assert [st.num_layers for st in pipe.stages] == [4, 4, 3, 3]
    # tp 8 (one type per stage) needs heads that split 8 ways
    wide = load_model({"preset": "gpt2-small", "n_head": 16})
    prop = proportional_plan(wide, cluster, pp=3, micro_batch=2, global_batch=8, tp=8)
    sizes = [st.num_layers for st in prop.pipelines[0].stages]
    assert sum(sizes) == 14 and sizes[0] > sizes[1] > sizes[2]      # H100 > A100 > L4
    assert layer_counts(10, [1.0, 1.0, 1.0]) == [4, 3, 3]
    # the plan names the built-ins, and round-trips through JSON
    assert plan.model == "gpt2-small" and plan.cluster == "h100-a100-l4"


def test_search_cli_out_plan_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
               "--global-batch", "16", "--out", str(out), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"best", "ranked", "baselines", "candidates_evaluated",
                        "search_time_s"}
    assert set(doc["baselines"]) == {"uniform", "proportional", "metis", "amp"}
    assert doc["best"]["metrics"]["iteration_time_s"] <= \
        doc["baselines"]["uniform"]["metrics"]["iteration_time_s"]
    plan = load_plan(out)
    assert plan.to_dict() == doc["best"]["plan"]
    assert main(["simulate", "--plan", str(out), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["iteration_time_s"] == pytest.approx(
        doc["best"]["metrics"]["iteration_time_s"], rel=1e-9)


def test_infeasible_request_exits_2_and_says_what_is_short(capsys, tmp_path):
    model = load_model("gpt3-175b")
    with pytest.raises(InfeasiblePlan, match="GB"):
        search(model, load_cluster("demo-hetero"), SearchConstraints(global_batch=8))
    rc = main(["search", "--cluster", "demo-hetero", "--model", "gpt3-175b",
               "--global-batch", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "GB" in err[0] and "needs" in err[0]
    rc = main(["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
               "--global-batch", "10", "--micro-batch", "3"])
    assert rc == 2 and "--micro-batch" in capsys.readouterr().err


def test_partition_dp_is_the_min_max_cut():
    # the DP against every cut of 9 layers into 4 stages of different speeds, with a
    # link after each stage and a memory limit that rules some cuts out
    rng = np.random.default_rng(7)
    n, speeds = 9, [1.0, 2.5, 1.5, 3.0]
    work = rng.uniform(1, 4, n)
    state = rng.uniform(1, 3, n)
    link = np.concatenate([[0.0], rng.uniform(0, 1, n)])
    cap = 8.0
    tables = [P.LayerTables(np.concatenate([[0], np.cumsum(work / s / 3)]),
                            np.concatenate([[0], np.cumsum(2 * work / s / 3)]),
                            np.concatenate([[0], np.cumsum(state)]), np.zeros(n + 1))
              for s in speeds]
    links = [link, link, link, None]
    mats = [P.stage_matrix(t, P.Slot(("x",), 1, cap), P.time_matrix(t, lk))
            for t, lk in zip(tables, links, strict=True)]
    bounds = P.partition(mats)
    best = None
    for cuts in itertools.combinations(range(1, n), 3):
        b = (0, *cuts, n)
        if any(state[b[s]:b[s + 1]].sum() > cap for s in range(4)):
            continue
        cost = [work[b[s]:b[s + 1]].sum() / speeds[s] + (link[b[s + 1]] if s < 3 else 0)
                for s in range(4)]
        key = (max(cost), sum(cost))
        best = key if best is None or key < best else best
    got = P.describe(bounds, tables, links)
    assert (got.bottleneck_s, got.total_s) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1),
                                    ("interleaved-1f1b", 2)])
def test_in_flight_counts_from_the_schedule_ir(kind, v):
    from hyperpipe.sim.memory import peak_in_flight
    p, m = 4, 8
    got = P.peak_inflight(kind, p, m, v)
    per_rank = [sum(got[k] for k in range(r, p * v, p)) for r in range(p)]
    if v == 1:
        assert list(got) == [peak_in_flight(kind, p, m, v, r) for r in range(p)]
    else:                       # per-stage peaks may not coincide: an upper bound
        assert all(a >= peak_in_flight(kind, p, m, v, r) for r, a in enumerate(per_rank))


@pytest.mark.parametrize("kind", ["zb-v", "dualpipe-v"])
def test_v_kinds_in_flight_closed_form_matches_the_ir(kind):
    from hyperpipe.search.context import v_peak_inflight
    for p in range(1, 9):
        for m in range(1, 4 * p + 3):
            assert v_peak_inflight(p, m) == P.peak_inflight(kind, p, m, 2), (p, m)


def test_space_generators():
    assert sum(1 for _ in space.set_partitions(list("abcd"))) == 15       # Bell(4)
    assert sum(1 for _ in space.type_groups(list("abc"))) == 3 + 3 * 2 + 5
    orders = list(space.stage_orders({"a": 2, "b": 2}))
    assert len(orders) == len(set(orders)) == 6                          # 4!/(2!2!)
    many = list(space.stage_orders({"a": 30, "b": 30, "c": 30}))
    assert len(many) == 6 and all(len(o) == 90 for o in many)            # blocks
    recipes = list(space.dp_recipes({"a": 4, "b": 2}, num_layers=10, chunks=1,
                                    pp=3, dp=None))
    assert all(sum(r.values()) == 3 and r["a"] * d <= 4 and r["b"] * d <= 2
               for d, r in recipes)
    assert (1, {"a": 2, "b": 1}) in recipes and (1, {"a": 1, "b": 2}) in recipes


def test_replica_counts_keep_the_ends_of_each_run():
    """8 units of each of two types, a batch of 8 micro-batches: d replicas take 8 // d
    units each and ceil(8 / d) micro-batches. Recipe (1, 1) has d = 5..8: 5, 6 and 7
    give 2 micro-batches (only 5 is kept: the fewest devices for that time) and 8 gives
    1; recipe (2, 2) has d = 3 (3 micro-batches) and 4 (2)."""
    got = list(space.dp_recipes({"a": 8, "b": 8}, num_layers=40, chunks=1, pp=None,
                                dp=None, max_dp=8))
    assert [d for d, _ in got] == [1, 2, 3, 4, 5, 8]
    assert dict(got)[5] == dict(got)[8] == {"a": 1, "b": 1}
    # against the rule written out: per recipe, the least d of each ceil(8 / d), and the
    # largest d
    every = [(d, {"a": 8 // d, "b": 8 // d}) for d in range(1, 9)]
    keep = set()
    for recipe in {tuple(r.values()) for _, r in every}:
        ds = [d for d, r in every if tuple(r.values()) == recipe]
        keep |= {min(d for d in ds if -(-8 // d) == m) for m in {-(-8 // d) for d in ds}}
        keep.add(max(ds))
    assert sorted(keep) == [d for d, _ in got]
    # a fixed dp, or no batch limit: every count, as before
    fixed = list(space.dp_recipes({"a": 8, "b": 8}, num_layers=40, chunks=1, pp=None,
                                  dp=8, max_dp=8))
    assert [d for d, _ in fixed] == list(range(1, 9))
    assert len(list(space.dp_recipes({"a": 8, "b": 8}, num_layers=40, chunks=1,
                                     pp=None, dp=None))) == 8


@pytest.mark.slow
def test_workers_give_the_same_result():
    # eager attention: a case where a synthesised schedule is among the simulated plans
    model = load_model({"preset": "gpt2-small", "attention": "eager"})
    cluster = load_cluster("h100-a100-l4")
    c = SearchConstraints(global_batch=32, micro_batch=1)
    one = search(model, cluster, c, top=3)
    two = search(model, cluster, c, top=3, workers=2)
    assert [x.plan for x in one.ranked] == [x.plan for x in two.ranked]
    assert [x.metrics.iteration_time_s for x in one.ranked] == \
        [x.metrics.iteration_time_s for x in two.ranked]
    # schedule synthesis runs over the workers too, with the same outcome
    synth = [[(x.plan, x.metrics.iteration_time_s) for x in r.simulated
              if x.plan.schedule == "synth"] for r in (one, two)]
    assert synth[0] and synth[0] == synth[1]
    # the same plans, more simulated at most: the policies' parts over the workers do
    # not prune by each other's orders (`synthesis.synthesise_all`)
    assert one.phases[3]["seen"] <= two.phases[3]["seen"]
    # baselines and peers, one task each over the workers: the same picks and counts
    assert {k: c.plan for k, c in one.baselines.items()} == \
        {k: c.plan for k, c in two.baselines.items()}
    assert set(one.baselines) == {"uniform", "proportional", "metis", "amp"}
    assert [one.phases[4][k] for k in ("seen", "pruned", "infeasible")] == \
        [two.phases[4][k] for k in ("seen", "pruned", "infeasible")]
    # templates: groups batched per worker, the same counts as one by one
    assert [one.phases[0][k] for k in ("seen", "pruned", "infeasible")] == \
        [two.phases[0][k] for k in ("seen", "pruned", "infeasible")]


def test_templates_over_a_pool_are_those_made_one_by_one():
    from hyperpipe.search.backends import LocalBackend
    from hyperpipe.search.templates import book_work, templates_phase
    model, cluster = load_model("gpt2-small"), load_cluster("h100-a100-l4")
    c = SearchConstraints(global_batch=32, micro_batch=2)
    books = []
    for width in (1, 3):
        ctx = SearchContext(CostModel(model, cluster), c)
        phase = PhaseStats("templates")
        with LocalBackend(width) as pool:
            templates_phase(ctx, phase, False, pool if width > 1 else None)
        books.append((ctx.book, (phase.seen, phase.pruned, phase.infeasible)))
    assert books[0][0] and books[0] == books[1]
    # the most work first: a group over all configs before one at a config, more types
    # before fewer
    assert book_work(BookKey(("a", "b"), None)) > book_work(BookKey(("a", "b", "c"),
                                                                     ("1f1b", 1, 2)))
    assert book_work(BookKey(("a", "b"), None)) > book_work(BookKey(("a",), None))


@pytest.mark.parametrize("flags,word", [(["--tp", "16"], "--tp"),
                                        (["--pp", "8", "--dp", "4"], "24 devices"),
                                        (["--objective", "cost"], "prices"),
                                        (["--schedule", "nope"], "--schedule")])
def test_contradicting_constraints_are_bad_input(flags, word, capsys):
    cluster = "h100-a100-l4" if word != "prices" else "demo-hetero"
    rc = main(["search", "--cluster", cluster, "--model", "tiny-gpt", "--global-batch", "16",
               *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and word in err[0]


def test_plans_over_the_action_limit_are_infeasible_not_a_crash(monkeypatch):
    """The analytic tier never builds a closed-form kind's schedule, so plans over the
    action limit reach the simulate phase; they are counted infeasible there (before,
    gpt3-175b on scale-1024 crashed on a baseline's zb-h1 plan of 96 x 1536)."""
    from hyperpipe.core import limits
    from hyperpipe.plan import kinds
    from hyperpipe.search.baselines import uniform_plan
    from hyperpipe.search.evaluate import Candidate, estimate
    from hyperpipe.search.search import _simulate_phase
    from hyperpipe.search.templates import PhaseStats, SearchContext
    from hyperpipe.sim.costmodel import CostModel
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=16))
    ok = uniform_plan(model, cluster, pp=2, micro_batch=2, global_batch=16)    # 48 actions
    over = uniform_plan(model, cluster, pp=4, micro_batch=1, global_batch=16)  # 192
    monkeypatch.setattr(limits, "MAX_SCHEDULE_ACTIONS", 96)
    kinds._generate.cache_clear()
    try:
        phase = PhaseStats("simulate")
        cands = [Candidate(p, estimate(p, ctx.cost)) for p in (over, ok)]
        ranked, baselines, _ = _simulate_phase(ctx, phase, cands, {"uniform": [over, ok]},
                                            None, False, 1)
    finally:
        kinds._generate.cache_clear()
    assert [c.plan.schedule for c in ranked] and all(c.plan != over for c in ranked)
    # the baseline's pick is `ok`, or `ok` with a synthesised schedule (same stages)
    assert ok in [c.plan for c in ranked] and \
        baselines["uniform"].plan.pipelines == ok.pipelines
    assert phase.infeasible >= 2


def test_partition_matches_brute_force_at_every_depth():
    """The windowed DP against every cut, p from 1 to n (deep pipelines included), with
    memory limits, each stage its own, that leave some cuts (or none) feasible: the
    memory-only reach check that skips the DP must never skip a feasible case."""
    rng = np.random.default_rng(11)
    outcomes = {"fits": 0, "none": 0}
    for trial in range(200):
        n = int(rng.integers(2, 9))
        p = int(rng.integers(1, n + 1))
        speeds = rng.uniform(1, 3, p)
        work, state = rng.uniform(1, 4, n), rng.uniform(1, 3, n)
        caps = rng.uniform(2, 3 * n / p + 3, p)
        tables = [P.LayerTables(np.concatenate([[0], np.cumsum(work / sp)]), np.zeros(n + 1),
                                np.concatenate([[0], np.cumsum(state)]), np.zeros(n + 1))
                  for sp in speeds]
        mats = [P.stage_matrix(t, P.Slot(("x",), 1, float(cap)), P.time_matrix(t, None))
                for t, cap in zip(tables, caps, strict=True)]
        best = None
        for cuts in itertools.combinations(range(1, n), p - 1):
            b = (0, *cuts, n)
            if any(state[b[s]:b[s + 1]].sum() > caps[s] for s in range(p)):
                continue
            cost = [work[b[s]:b[s + 1]].sum() / speeds[s] for s in range(p)]
            key = (max(cost), sum(cost))
            best = key if best is None or key < best else best
        bounds = P.partition(mats)
        if best is None:
            assert bounds is None, trial
            outcomes["none"] += 1
            continue
        outcomes["fits"] += 1
        got = P.describe(bounds, tables, [None] * p)
        assert (got.bottleneck_s, got.total_s) == pytest.approx(best, rel=1e-12), trial
    assert min(outcomes.values()) >= 20, outcomes       # both kinds of case were tried
    assert P.partition([mats[0]] * (n + 1)) is None     # more stages than layers


def _device_loads(bounds, work, speed_of, homes):
    loads = [0.0] * (max(homes) + 1)
    for k, h in enumerate(homes):
        loads[h] += work[bounds[k]:bounds[k + 1]].sum() / speed_of[h]
    return loads


def test_balance_devices_evens_out_a_v_pipeline():
    """Six equal layers on a V of two devices (stages 0 and 3 on device 0, 1 and 2 on
    device 1): the cut (2, 1, 1, 2) has the least busiest stage but loads 4 and 2; the
    balanced cut loads both devices with 3 layers, the least any cut can (6 / 2)."""
    n, homes = 6, [0, 1, 1, 0]
    work = np.ones(n)
    table = P.LayerTables(np.concatenate([[0], np.cumsum(work / 3)]),
                          np.concatenate([[0], np.cumsum(2 * work / 3)]),
                          np.zeros(n + 1), np.zeros(n + 1))
    mats = [P.stage_matrix(table, P.Slot(("x",), 1, 1.0), P.time_matrix(table, None))] * 4
    got = P.balance_devices((0, 2, 3, 4, 6), mats, homes)
    assert max(_device_loads(got, work, [1.0, 1.0], homes)) == pytest.approx(3.0)


@pytest.mark.parametrize("equal_layers", [True, False])
def test_balance_devices_never_loses_and_keeps_memory(equal_layers):
    """Against every cut of small V and interleaved pipelines of unequal devices with
    memory limits: from the DP's cut, the busiest device's load never grows, the stages'
    sum grows by at most the weight times what that load fell, every stage keeps a
    layer and fits. Where
    the DP's cut is not the least busiest device, the local moves get there on most
    cases of equal layers (as a model's blocks are) and get closer on some of unequal
    ones (a local search: coarse, uneven layers can leave it stuck)."""
    rng = np.random.default_rng(5)
    tried = reached = closer = 0
    for trial in range(300):
        p = int(rng.integers(2, 4))
        v_shape = trial % 2 == 1             # a V, else two chunks round robin
        homes = [*range(p), *reversed(range(p))] if v_shape else [*range(p)] * 2
        weight = 2.0 if v_shape else 1.0     # as `templates._row_cut` weighs the sum
        n = int(rng.integers(2 * p, 11))
        speed_of = rng.uniform(1, 3, p)
        work = np.ones(n) if equal_layers else rng.uniform(1, 4, n)
        state = rng.uniform(1, 3, n)
        caps = rng.uniform(3, 3 * n / p + 3, 2 * p)
        tables = [P.LayerTables(np.concatenate([[0], np.cumsum(work / speed_of[h])]),
                                np.zeros(n + 1), np.concatenate([[0], np.cumsum(state)]),
                                np.zeros(n + 1)) for h in homes]
        mats = [P.stage_matrix(t, P.Slot(("x",), 1, float(c)), P.time_matrix(t, None))
                for t, c in zip(tables, caps, strict=True)]
        start = P.partition(mats)
        if start is None:
            continue
        got = P.balance_devices(start, mats, homes, weight)
        assert got[0] == 0 and got[-1] == n, trial
        for k in range(2 * p):
            assert got[k + 1] > got[k] and state[got[k]:got[k + 1]].sum() <= caps[k], trial
        before = _device_loads(start, work, speed_of, homes)
        after = _device_loads(got, work, speed_of, homes)
        assert max(after) <= max(before) * (1 + 1e-12), trial
        assert sum(after) - sum(before) <= weight * (max(before) - max(after)) + 1e-9, \
            trial
        best = min(max(_device_loads((0, *c, n), work, speed_of, homes))
                   for c in itertools.combinations(range(1, n), 2 * p - 1)
                   if all(state[a:b].sum() <= caps[k] for k, (a, b) in
                          enumerate(itertools.pairwise((0, *c, n)))))
        if max(before) > best * (1 + 1e-9):
            tried += 1
            reached += max(after) <= best * (1 + 1e-9)
            closer += max(after) < max(before) * (1 - 1e-9)
    if equal_layers:
        assert tried >= 30 and reached >= tried // 2, (tried, reached)
    else:
        assert tried >= 30 and closer >= tried // 4, (tried, closer)


def test_link_cache_keeps_a_device_to_itself_apart_from_its_node():
    # a V kind puts two adjacent chunks on one device (no transfer); that zero must not
    # be cached as the cost of the node's links (it made templates depend on the order
    # the type groups were cut in)
    model, cluster = load_model("gpt2-small"), load_cluster("h100-a100-l4")
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=32))
    assert not ctx.link("a100/0", "a100/0", 2).any()
    link = ctx.link("a100/0", "a100/1", 2)
    assert link[5] == pytest.approx(
        2 * CostModel(model, cluster).transfer_time_s("a100/0", "a100/1",
                                                      model.layer_cost(4, 2).send_bytes))
    assert link[5] > 0


def test_template_sync_shares_the_nic_among_tp_ranks():
    """A template's gradient sync of a tp 2 stage replicated on two nodes of one NIC
    each: the two tp ranks' rings both cross both NICs, so they share them:
    2 x (bytes / BW) + 2 latencies (n = 2), twice one ring's bytes time; tp 1: once."""
    bw, lat = 1e9, 1e-4
    link = {"bandwidth": bw, "latency": lat}
    cluster = load_cluster({
        "name": "two", "device_types": {"x": {"peak_flops": 1e12, "memory": "80 GB",
                                              "mem_bandwidth": 1e12}},
        "nodes": [{"name": n, "device": "x", "count": 2, "intra_link": link}
                  for n in ("a", "b")], "inter_node": link})
    ctx = SearchContext(CostModel(load_model("gpt2-small"), cluster),
                        SearchConstraints(global_batch=4))
    for nbytes in (5e7, 3e8):
        assert templates._ring_s(ctx, (("a/0", "a/1"), ("b/0", "b/1")), nbytes) == \
            pytest.approx(2 * nbytes / bw + 2 * lat, rel=1e-9)
        assert templates._ring_s(ctx, (("a/0",), ("b/0",)), nbytes) == \
            pytest.approx(nbytes / bw + 2 * lat, rel=1e-9)
    assert templates._ring_s(ctx, (("a/0",), ("b/0",)), 0.0) == 0.0


def test_search_caches_are_keyed_by_records_that_resolve():
    """Every cut is cached under its stages' keys (table, stashes, room, link) and their
    devices, and each key names an entry of the table and link caches: nothing keyed by
    object identity."""
    from hyperpipe.search.caches import CutKey, StageKey
    from hyperpipe.search.templates import templates_at
    model, cluster = load_model("gpt2-small"), load_cluster("h100-a100-l4")
    ctx = SearchContext(CostModel(model, cluster),
                        SearchConstraints(global_batch=32, micro_batch=2))
    types = tuple(dict.fromkeys(n.device_type for n in cluster.nodes))[:2]
    assert templates_at(ctx, PhaseStats("templates"), types, None)
    assert all(isinstance(key, CutKey) and len(key.homes) == len(key.stages)
               for key in ctx.cuts)
    stages = [k for key in ctx.cuts for k in key.stages]
    assert stages and all(isinstance(k, StageKey) for k in stages)
    assert all(k.table in ctx.tables and k in ctx.stage_costs for k in stages)
    assert all(k.link is None or k.link in ctx.links for k in stages)
    assert all(k.table.times in ctx.times_s for k in stages)


def test_assemble_picks_every_close_kind_of_every_grouping():
    """The closed form may rank one schedule kind above another; the analytic tier
    still sees the best combination of every kind in every grouping that is within the
    templates' TOLERANCE of the grouping's best, besides the best few per grouping and
    overall, best closed form first. Oracle: the sets built here by sorting."""
    import random

    from hyperpipe.search.search import (
        ASSEMBLE_LIMIT,
        ASSEMBLE_PER_GROUPING,
        TOLERANCE,
        assemble_picks,
    )
    rng = random.Random(7)
    groupings = [("A",), ("B",), ("A", "B")]
    # zb-h1 in [100, 101), zb-v in [101 + TOLERANCE * 50, ...): close enough; 1f1b far
    offsets = {"zb-h1": 100.0, "zb-v": 101.0 + 50 * TOLERANCE, "1f1b": 200.0}
    keys, values = [], []
    for g in groupings:
        for kind, offset in offsets.items():
            for _ in range(30):         # every zb-v value above every zb-h1 value
                keys.append((g, kind))
                values.append(offset + rng.random())
    picks = assemble_picks(keys, values)
    assert picks == sorted(picks, key=values.__getitem__) and len(set(picks)) == len(picks)
    by_value = sorted(range(len(keys)), key=values.__getitem__)
    want = set(by_value[:ASSEMBLE_LIMIT])
    for g in groupings:
        want |= set([i for i in by_value if keys[i][0] == g][:ASSEMBLE_PER_GROUPING])
        want.add(next(i for i in by_value if keys[i] == (g, "zb-v")))
    assert set(picks) == want
    kinds = {keys[i] for i in picks}
    assert all((g, "zb-v") in kinds and (g, "1f1b") not in kinds for g in groupings)


@pytest.mark.parametrize("layout", ["pipeline", "stage"])
def test_assign_rows_follow_the_layout_formula(layout):
    """Replica r's i-th unit of type t is pool unit r·k_t + i ("pipeline") or i·dp + r
    ("stage"); any subset of the replicas gives the same rows as all of them."""
    from hyperpipe.search import space
    from hyperpipe.search.templates import _assign
    pools = {t: space.UnitPool(t, 1, tuple((f"{t}/{j}",) for j in range(12)))
             for t in ("a", "b")}
    recipe, dp, order = {"a": 2, "b": 1}, 4, ("a", "b", "a")
    rows = _assign(pools, recipe, dp, order, layout)
    for r, row in enumerate(rows):
        seen = {"a": 0, "b": 0}
        for t, unit in zip(order, row, strict=True):
            i = seen[t]
            seen[t] += 1
            j = r * recipe[t] + i if layout == "pipeline" else i * dp + r
            assert unit == (f"{t}/{j}",)
    assert _assign(pools, recipe, dp, order, layout, range(2, 4)) == rows[2:]


def test_constraints_admit_only_plans_that_keep_what_they_fix():
    """`SearchConstraints.admits` (which tuned baselines may join the ranking as seeds):
    every fixed dimension must match the plan's, a free one anything."""
    from dataclasses import replace

    from hyperpipe.search.baselines import uniform_plan
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    plan = uniform_plan(model, cluster, pp=2, micro_batch=2, global_batch=16)
    c = SearchConstraints(global_batch=16)
    assert c.admits(plan)
    for fixed, ok in [({"pp": 2}, True), ({"pp": 4}, False), ({"micro_batch": 2}, True),
                      ({"micro_batch": 1}, False), ({"dp": len(plan.pipelines)}, True),
                      ({"dp": len(plan.pipelines) + 1}, False), ({"tp": 1}, True),
                      ({"tp": 2}, False), ({"zero": plan.zero}, True),
                      ({"zero": 3}, False), ({"recompute": "full"}, False),
                      ({"schedule": plan.schedule}, True),
                      ({"schedule": "gpipe" if plan.schedule != "gpipe" else "1f1b"}, False),
                      ({"stack": "megatron-deepspeed"}, False)]:
        assert replace(c, **fixed).admits(plan) is ok, fixed


def test_leaving_the_peers_out_keeps_the_pick():
    """The peer planners are comparators, never seeds: without them the pick and the
    ranking are the same, and the baselines are the tuned ones alone."""
    model, cluster = load_model("gpt2-small"), load_cluster("h100-a100-l4")
    c = SearchConstraints(global_batch=32, micro_batch=2)
    full = search(model, cluster, c, top=3)
    lean = search(model, cluster, c, top=3, peers=False)
    assert {"metis", "amp"} <= set(full.baselines)
    assert set(lean.baselines) == set(full.baselines) - {"metis", "amp"}
    assert [x.plan for x in lean.ranked] == [x.plan for x in full.ranked]
    assert lean.phases[4]["seen"] < full.phases[4]["seen"]


def test_a_class_split_by_a_slow_link_may_run_on_one_of_its_nodes():
    """Two identical nodes of 4 A100s over 1 Gbit/s: every plan over both nodes pays the
    link (a pipeline's activations or the gradient sync), so the best runs on one node
    and leaves the other idle. Oracle: a dimension fixed can only narrow the search, so
    the unconstrained pick is at least as fast as the best pick of every fixed pp (here
    pp 1, on one node; the search that took a class whole or not at all picked a plan
    over both nodes)."""
    cluster = load_cluster({"name": "two-slow", "nodes": [
        {"name": "a", "device": "A100-80GB", "count": 4, "repeat": 2}],
        "inter_node": {"bandwidth": "1 Gbit/s", "latency": "1 ms"}})
    model = load_model("gpt2-medium")
    free = search(model, cluster, SearchConstraints(global_batch=32), top=1, quiet=True)
    fixed = [search(model, cluster, SearchConstraints(global_batch=32, pp=pp), top=1,
                    quiet=True).best.metrics.iteration_time_s for pp in (1, 2, 4, 8)]
    assert free.best.metrics.iteration_time_s <= min(fixed) * (1 + 1e-9)
    nodes = {d.split("/")[0] for d in free.best.plan.devices}
    assert len(nodes) == 1, nodes


def test_tensor_parallelism_must_split_heads_query_groups_and_mlp():
    """Megatron splits attention heads, query groups and MLP columns evenly over tp: a
    plan whose tp does not divide n_kv_head is refused by `Plan.check` (as `run` refused
    it, after `search` had proposed it and `simulate` priced it), `search --tp` names
    the field, and the search's own tp degrees skip it (one query group: tp 1 only)."""
    from hyperpipe.plan.plan import plan_from_dict
    gqa = {"kind": "gpt", "name": "gqa", "n_layer": 4, "n_head": 8, "n_kv_head": 2,
           "d_model": 512, "seq_len": 128, "vocab_size": 1024}
    cluster = load_cluster("h100-a100-l4")
    doc = {"format": "hyperpipe.plan/1", "model": gqa, "cluster": "h100-a100-l4",
           "global_batch": 4, "schedule": {"kind": "1f1b"},
           "pipelines": [{"micro_batch": 1, "num_microbatches": 4, "stages": [
               {"layers": [0, 6], "devices": [f"h100/{i}" for i in range(4)], "tp": 4}]}]}
    with pytest.raises(BadInput, match=r"stages\[0\]\.tp: expected a divisor of the "
                                       r"model's n_kv_head \(2\)"):
        plan_from_dict(doc).check(load_model(gqa), cluster)
    with pytest.raises(BadInput, match=r"^tp: expected a divisor of the model.s n_kv_head"):
        search(load_model(gqa), cluster, SearchConstraints(global_batch=4, tp=4))
    mqa = load_model({**gqa, "name": "mqa", "n_kv_head": 1})
    found = search(mqa, cluster, SearchConstraints(global_batch=8), top=3, quiet=True)
    assert {st.tp for cand in found.ranked for p in cand.plan.pipelines
            for st in p.stages} == {1}


def test_sequence_parallelism_only_where_tp_splits_the_tokens():
    """Sequence parallelism splits each context rank's tokens over tp: at 1,026 tokens
    tp 4 cannot, so a search with it fixed on keeps to degrees that can (it failed with
    'plan: ...tp: expected a divisor of seq_len / cp' on a plan the user never wrote),
    and free, no plan of the search has it where tp does not divide the tokens."""
    from hyperpipe.plan.plan import tp_misfit
    model = load_model({"preset": "gpt2-small", "seq_len": 1026})
    cluster = load_cluster("h100-a100-l4")
    for sp in (True, None):
        found = search(model, cluster, SearchConstraints(global_batch=8, sequence_parallel=sp),
                       top=3, quiet=True)
        stages = [st for cand in found.ranked for p in cand.plan.pipelines for st in p.stages]
        assert stages and all(tp_misfit(model, st.tp, st.sequence_parallel, st.cp) is None
                              for st in stages)


def test_cost_objective_reports_a_pick_on_free_devices(tmp_path, capsys):
    """Devices priced at 0 make the pick free: the report says so (it divided by the
    pick's cost) and the plan is written."""
    import yaml
    path = tmp_path / "free.yaml"
    path.write_text(yaml.safe_dump({"name": "free", "nodes": [
        {"name": "a", "device": "A100-80GB", "count": 2, "price_per_hour": "0 $/h"},
        {"name": "v", "device": "V100-32GB", "count": 2, "price_per_hour": "1 $/h"}]}))
    out = tmp_path / "best.json"
    rc = main(["search", "--cluster", str(path), "--model", "tiny-gpt", "--global-batch",
               "32", "--workers", "1", "--objective", "cost", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and out.exists()
    assert "$0/Mtok" in text and "cost nothing per token" in text


@pytest.mark.parametrize("flags,line", [
    (["--schedule", "zb-v", "--pp", "1"], "leave pp 1 on 4 devices"),
    (["--schedule", "interleaved-1f1b", "--dp", "4"], "leave pp 1 on 4 devices"),
    (["--cp", "2", "--tp", "2"], "tp x cp = 4 devices of one type per stage"),
    (["--model", "tiny-moe", "--ep", "4", "--tp", "2"], "ep x tp x pp = 8 devices")])
def test_fixed_degrees_with_no_plan_between_them_are_named(flags, line, tmp_path, capsys):
    """Each option fits the cluster alone, together they leave no plan: the line names
    them (it had said that nothing fits in memory)."""
    import yaml
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"name": "c", "nodes": [
        {"name": "a", "device": "A100-80GB", "count": 2},
        {"name": "v", "device": "V100-32GB", "count": 2}]}))
    model = [] if "--model" in flags else ["--model", "tiny-gpt"]
    rc = main(["search", "--cluster", str(path), *model, "--global-batch", "32",
               "--workers", "1", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and line in err[0]


def test_schedule_synth_is_honoured_and_no_slower_than_the_free_pick():
    """--schedule synth had returned zb-h1 plans, slower than the free pick; now every
    ranked plan is synth (a fixed kind that won written out as its orders)."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    from hyperpipe.search.search import SearchConstraints, search
    cluster = load_cluster({"name": "c1", "nodes": [
        {"name": "a", "device": "A100-80GB", "count": 2,
         "intra_link": {"bandwidth": "600 GB/s", "latency": "2 us"}},
        {"name": "v", "device": "V100-32GB", "count": 2}],
        "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}})
    model = load_model("tiny-gpt")
    free = search(model, cluster, SearchConstraints(global_batch=32), peers=False)
    synth = search(model, cluster, SearchConstraints(global_batch=32, schedule="synth"),
                   peers=False)
    assert {c.plan.schedule for c in synth.ranked} == {"synth"}
    assert synth.best.metrics.iteration_time_s <= \
        free.best.metrics.iteration_time_s * (1 + 1e-9)


@pytest.mark.parametrize("fixed,check", [
    ({"recompute": "full"}, lambda plan: {st.recompute for p in plan.pipelines
                                          for st in p.stages} == {"full"}),
    ({"zero": 2}, lambda plan: plan.zero == 2),
    ({"cp": 2}, lambda plan: {st.cp for p in plan.pipelines for st in p.stages} == {2})])
def test_baselines_and_peers_keep_what_the_user_fixed(fixed, check):
    """The tuned baselines and the peers' picks had ignored --recompute, --zero and
    --cp, so the report set the pick against plans outside the constraints ("pick is
    1.32x SLOWER"); each competitor that cannot take them is left out."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    from hyperpipe.search.search import SearchConstraints, search
    cluster = load_cluster({"name": "c1", "nodes": [
        {"name": "a", "device": "A100-80GB", "count": 2},
        {"name": "v", "device": "V100-32GB", "count": 2}]})
    res = search(load_model("tiny-gpt"), cluster,
                 SearchConstraints(global_batch=32, **fixed))
    assert res.baselines and all(check(c.plan) for c in res.baselines.values())
    assert check(res.best.plan)
    assert all(res.best.metrics.iteration_time_s <= c.metrics.iteration_time_s * (1 + 1e-9)
               for name, c in res.baselines.items() if name in ("uniform", "proportional"))


def test_baselines_build_tp_by_cp_groups_with_the_tensor_degree_of_tp():
    """--tp 2 --cp 2 on a model of 6 heads: the baselines' groups of 4 had been checked
    as tp 4 (6 % 4) and all dropped; peers, which have no context parallelism, had been
    cut into tp 1 x cp 2 plans outside the constraints. Now the baselines hold tp 2 x
    cp 2 stages, and the peers sit out."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    from hyperpipe.search.search import SearchConstraints, search
    model = load_model({"preset": "tiny-gpt", "n_head": 6, "n_kv_head": 6, "d_model": 192})
    cluster = load_cluster({"name": "a4", "nodes": [
        {"name": "a", "device": "A100-80GB", "count": 4}]})
    res = search(model, cluster, SearchConstraints(global_batch=8, tp=2, cp=2))
    assert set(res.baselines) == {"uniform", "proportional"}
    assert all((st.tp, st.cp) == (2, 2) for c in res.baselines.values()
               for p in c.plan.pipelines for st in p.stages)


def test_a_fixed_kind_written_out_as_synth_carries_its_own_simulation():
    """dualpipe-v's all-to-all overlap belongs to its kind: its order replayed as synth
    prices apart (review of 3ec0eeb), so the written-out plan is simulated again."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.models import load_model
    from hyperpipe.search.baselines import uniform_plan
    from hyperpipe.search.context import SearchContext
    from hyperpipe.search.evaluate import Candidate
    from hyperpipe.search.search import SearchConstraints
    from hyperpipe.search.synthesis import _as_synth
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate
    model = load_model({"preset": "tiny-moe", "moe": {"experts": 4, "top_k": 2,
                                                      "expert_hidden": 256, "every": 1}})
    cluster = load_cluster("demo-hetero")
    cost = CostModel(model, cluster)
    plan = uniform_plan(model, cluster, pp=2, dp=2, ep=2, micro_batch=1, global_batch=8,
                        schedule="dualpipe-v")
    kind = Candidate(plan, simulate(plan, cost).metrics)
    (synth,) = _as_synth(SearchContext(cost, SearchConstraints(global_batch=8,
                                                               schedule="synth")), [kind])
    assert synth.plan.schedule == "synth"
    assert synth.metrics.iteration_time_s == simulate(synth.plan, cost).metrics.iteration_time_s
    assert synth.metrics.iteration_time_s > kind.metrics.iteration_time_s     # it differs


def test_a_shortfall_of_megabytes_is_said_in_megabytes():
    """A tiny model on 1 MB devices read 'needs 0.0 GB ... has 0.0 GB in all'."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.core.errors import InfeasiblePlan
    from hyperpipe.models import load_model
    from hyperpipe.search.search import SearchConstraints, search
    cluster = load_cluster({"name": "small", "device_types": {
        "A100-80GB": {"base": "A100-80GB", "memory": "1 MB"}},
        "nodes": [{"name": "a", "device": "A100-80GB", "count": 4}]})
    with pytest.raises(InfeasiblePlan, match=r"needs 20\.2 MB for weights, gradients and "
                                             r"optimizer state; cluster small has 4 MB"):
        search(load_model("tiny-gpt"), cluster, SearchConstraints(global_batch=16))


def test_one_stage_plans_alike_under_every_kind_are_listed_once():
    """On one-stage pipelines the schedule kinds only reorder one device's actions: the
    ranked list holds such a plan once, under the default kind. Oracle: the pick's
    pipelines simulated under each one-chunk kind take the same time and memory."""
    from dataclasses import replace

    from hyperpipe.plan.kinds import DEFAULT_KIND
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    result = search(model, cluster, SearchConstraints(global_batch=32), top=8)
    best = next(c.plan for c in result.ranked       # the best of the one-stage plans
                if c.plan.chunks == 1 and {len(p.stages) for p in c.plan.pipelines} == {1})
    assert best.schedule == DEFAULT_KIND
    cost = CostModel(model, cluster)
    alike = [simulate(replace(best, schedule=k), cost).metrics
             for k in ("gpipe", "1f1b", "zb-h1")]
    assert len({tuple(sorted(m.peak_memory_bytes.items())) for m in alike}) == 1
    assert [m.iteration_time_s for m in alike] == \
        pytest.approx([alike[0].iteration_time_s] * 3, rel=1e-12)
    same = [c for c in result.ranked
            if c.plan.pipelines == best.pipelines and c.plan.chunks == 1]
    assert len(same) == 1


@pytest.mark.parametrize("kind,chunks,needs", [("zb-v", None, 4),
                                               ("interleaved-1f1b", None, 4)])
def test_a_fixed_chunked_kind_on_too_few_layers_says_so(kind, chunks, needs):
    # tiny-gpt cut to one block (3 layers): no chunked kind over two devices fits; the
    # refusal names the layers, not memory
    model = load_model({"preset": "tiny-gpt", "n_layer": 1})
    with pytest.raises(InfeasiblePlan, match=f"at least {needs} layers; the model has 3 layers"):
        search(model, load_cluster("demo-hetero"),
               SearchConstraints(global_batch=16, schedule=kind, chunks=chunks))


def test_fixing_a_dimension_never_finds_a_faster_plan_of_a_fixed_kind():
    """Brute force over what a user may fix: the unconstrained search's best is at
    least as fast as the best plan of a generated kind of every search with the
    micro-batch and the pipeline depth fixed (tiny-gpt, demo-hetero, gb 16). It had
    missed a zb-h1 plan of one micro-batch of 8 per replica over a V100 and an A100
    (4.069 ms against 4.234): the templates priced one micro-batch's trip with every
    stage's W on the way back. (Synthesised schedules are left out of the oracle: the
    search synthesises its few best plans only, so a fixed micro-batch of 16 finds a
    synthesised V-shaped plan, 3.883 ms, whose zb-v source it does not rank that high.)"""
    from hyperpipe.plan.kinds import schedule_kind
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    free = search(model, cluster, SearchConstraints(global_batch=16)).best.metrics
    fixed = [cand.metrics.iteration_time_s
             for mb in (4, 8, 16) for pp in (1, 2)
             for cand in search(model, cluster, SearchConstraints(
                 global_batch=16, micro_batch=mb, pp=pp)).ranked
             if not schedule_kind(cand.plan.schedule).carries_actions]
    assert free.iteration_time_s <= min(fixed) * (1 + 1e-9)


def test_a_split_backwards_trip_leaves_the_ws_beside_the_way_back():
    """`Partition.trip_s` of a two-stage cut: F + B through both stages without a split;
    with one (zb-h1), F0 + F1 + I1 + I0 + W0, stage 1's W running beside I0."""
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    cost = CostModel(model, cluster)
    groups = [("v100/0",), ("a100/0",)]
    tables = [P.layer_tables(cost, g, 8) for g in groups]
    bounds = (0, 3, model.num_layers)
    whole = P.describe(bounds, tables, [None, None])
    split = P.describe(bounds, tables, [None, None], [t.splits(True) for t in tables],
                       kind_splits=True)
    t = {(k, op): cost.stage_time_s(r, g, 8, op)
         for k, (r, g) in enumerate(zip(((0, 3), (3, model.num_layers)), groups, strict=True))
         for op in "FBIW"}
    assert whole.trip_s == whole.total_s == pytest.approx(
        sum(t[k, "F"] + t[k, "B"] for k in range(2)), rel=1e-9)
    assert split.trip_s == pytest.approx(
        t[0, "F"] + t[1, "F"] + t[1, "I"] + t[0, "I"] + t[0, "W"], rel=1e-9)


def test_synthesis_takes_the_first_distinct_shapes(monkeypatch):
    """Plans that differ only in their schedule kind share one synthesis; the three best
    simulated plans being one cut under zb-h1, gpipe and 1f1b, the next shape (an
    eight-stage V whose schedule bound is below the best) is synthesised too (it had
    not been: a search on two A100 nodes, one 2x slow, picked 144.5 ms where --dp 1 found
    a synthesised 134.1 ms)."""
    from dataclasses import replace

    from hyperpipe.plan.plan import plan_from_dict
    from hyperpipe.search import synthesis as Y
    from hyperpipe.search.baselines import uniform_plan
    from hyperpipe.search.context import PhaseStats, SearchContext
    from hyperpipe.search.evaluate import Candidate
    from hyperpipe.sim.simulator import SimOptions, simulate
    from hyperpipe.synth.synthesise import SynthResult
    doc = {"name": "two-nodes", "nodes": [
        {"name": "n0", "device": "A100-80GB", "count": 2},
        {"name": "n1", "device": "A100-80GB", "count": 2, "slowdown": 2.0}],
        "inter_node": {"bandwidth": "10 Gbit/s", "latency": "10 us"}}
    model, cluster = load_model("gpt2-medium"), load_cluster(doc)
    cost = CostModel(model, cluster)
    ctx = SearchContext(cost, SearchConstraints(global_batch=16))
    one = uniform_plan(model, cluster, pp=1, dp=2, micro_batch=8, global_batch=16)
    homes = ["n0/0", "n0/1", "n1/0", "n1/1", "n1/1", "n1/0", "n0/1", "n0/0"]
    cuts = [0, 6, 9, 11, 12, 16, 17, 24, 26]
    v = plan_from_dict({
        "format": "hyperpipe.plan/1", "model": "gpt2-medium", "cluster": doc,
        "global_batch": 16, "schedule": {"kind": "dualpipe-v", "chunks": 2},
        "pipelines": [{"micro_batch": 2, "num_microbatches": 8, "stages": [
            {"layers": [a, b], "devices": [d]}
            for a, b, d in zip(cuts[:-1], cuts[1:], homes, strict=True)]}]})

    def cand(plan):
        return Candidate(plan, simulate(plan, cost, SimOptions(trace=False)).metrics)

    ranked = [cand(replace(one, schedule=k)) for k in ("zb-h1", "gpipe", "1f1b")] + [cand(v)]
    assert Y.bound_value(ctx, ranked[-1]) < ranked[0].metrics.iteration_time_s
    asked = []

    def record(ctx, items, pool=None):
        asked.extend(plan for plan, _ in items)
        return [SynthResult(plan, simulate(plan, cost, SimOptions(trace=False)).metrics,
                              plan.schedule, 0.0, 0.0, None, 0, 0.0) for plan, _ in items]

    monkeypatch.setattr(Y, "synthesise_all", record)
    Y.synthesise_top(ctx, PhaseStats("synthesis"), ranked)
    assert {p.schedule for p in asked} == {"zb-h1", "dualpipe-v"}
