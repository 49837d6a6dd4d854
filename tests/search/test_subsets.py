"""Device subsets: classes of nodes the search may leave idle, the bounds that prune the
template walk, and the schedule bound that keeps hopeless plans out of synthesis."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from factories import FREE_LINK, device_type, synthetic_doc

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.plan.kinds import generate
from hyperpipe.search import bounds as B
from hyperpipe.search import space
from hyperpipe.search import templates as T
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.search.context import PhaseStats, SearchContext
from hyperpipe.search.search import SearchConstraints, idle_devices, search
from hyperpipe.search.synthesis import schedule_bound_s
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate
from hyperpipe.synth.synthesise import synthesise

SLOW = 20.0           # the straggler's compute time multiplier


def _straggler_cluster() -> dict:
    """Three one-device nodes of one type, free links, memory that never runs out; the
    third runs SLOW times slower."""
    return {"name": "straggler",
            "device_types": {"x": device_type("2 TFLOP/s", mem_bandwidth="1e15 B/s")},
            "nodes": [{"name": f"n{i}", "device": "x", "count": 1, "intra_link": FREE_LINK,
                       **({"slowdown": SLOW} if i == 2 else {})} for i in range(3)],
            "inter_node": FREE_LINK}


def _flops_model(flops: list[float], name: str):
    """A synthetic model of one layer per entry of `flops` (TFLOP per sample, forward),
    without activations or parameters."""
    return load_model(synthetic_doc([{"fwd_flops_per_sample": f * 1e12} for f in flops],
                                    name=name, activation_bytes_per_sample=0,
                                    params_per_layer=0))


def _one_f_one_b_s(stage_s: list[float], m: int) -> float:
    """1F1B makespan with stage s taking F = t_s and B = 2 t_s, free links: the per-rank
    orders of `generate` list-scheduled here (apart from the simulator)."""
    p = len(stage_s)
    order = generate("1f1b", p, m).actions
    end: dict[tuple[int, str, int], float] = {}
    clock, pos, left = [0.0] * p, [0] * p, sum(len(r) for r in order)
    while left:
        for d in range(p):
            if pos[d] == len(order[d]):
                continue
            a = order[d][pos[d]]
            deps = ([(d - 1, "F", a.microbatch)] if d else []) if a.op == "F" else \
                [(d, "F", a.microbatch)] + ([(d + 1, "B", a.microbatch)] if d < p - 1 else [])
            if any(k not in end for k in deps):
                continue
            start = max([clock[d]] + [end[k] for k in deps])
            clock[d] = start + stage_s[d] * (1 if a.op == "F" else 2)
            end[(d, a.op, a.microbatch)] = clock[d]
            pos[d] += 1
            left -= 1
    return max(clock)


def test_a_very_slow_node_is_left_idle_and_the_pick_matches_brute_force():
    flops = [1.0, 2.0, 1.0, 1.0, 3.0, 1.0]          # TFLOP per sample, forward, per layer
    mb, m = 1, 6
    doc = _straggler_cluster()
    cluster = load_cluster(doc)
    model = _flops_model(flops, "bf")
    # brute force: every non-empty subset of the devices, in every order, every cut
    speed = {f"n{i}/0": 2e12 / (SLOW if i == 2 else 1.0) for i in range(3)}
    best = (np.inf, None)
    for r in range(1, 4):
        for devices in itertools.permutations(speed, r):
            for cuts in itertools.combinations(range(1, len(flops)), r - 1):
                b = (0, *cuts, len(flops))
                stage = [sum(flops[b[s]:b[s + 1]]) * 1e12 * mb / speed[d]
                         for s, d in enumerate(devices)]
                best = min(best, (_one_f_one_b_s(stage, m), devices), key=lambda x: x[0])
    assert "n2/0" not in best[1]                  # the oracle leaves the straggler idle
    res = search(model, cluster, SearchConstraints(global_batch=mb * m, micro_batch=mb,
                                                   schedule="1f1b", dp=1, tp=1))
    assert idle_devices(cluster, res.best.plan) == ["n2/0"]
    assert res.best.metrics.iteration_time_s <= best[0] * (1 + 1e-9)
    # the simulator agrees with the oracle on the pick (so the comparison means something)
    pipe = res.best.plan.pipelines[0]
    stage = [sum(flops[a:b]) * 1e12 * mb / speed[st.devices[0]]
             for st in pipe.stages for a, b in [st.layers]]
    assert res.best.metrics.iteration_time_s == pytest.approx(_one_f_one_b_s(stage, m),
                                                              rel=1e-6)
    # the report says which device sits idle and what using it too would cost
    from hyperpipe.search.report import idle_lines
    lines = idle_lines(res, cluster, ("s", 1.0))
    assert "idle: 1 x x (x20 slow) on n2" in lines[1]


def test_a_straggler_inside_a_node_is_priced_on_its_own_replica():
    """One A100 of a two-A100 node runs 10x slow, beside two V100s over 10 Gbit/s. The
    replicas of a template share one cut, priced on one row of units: it was replica 0's,
    so two replicas of (A100, V100) were priced as if both had the healthy A100 (1.46 s
    against 7.7 s simulated), their values crowded the band and the search picked two
    V100 replicas at 3.946 s. Oracle: fixing a dimension only narrows the search, so the
    free pick is at least as fast as every pick with the replica count fixed (dp 1 finds
    one pipeline over all four devices, the straggler holding one layer, 1.852 s)."""
    cluster = load_cluster({"name": "straggler-in-node", "nodes": [
        {"name": "a100", "device": "A100-80GB", "count": 2, "slowdown": {"1": 10}},
        {"name": "v100", "device": "V100-32GB", "count": 2}],
        "inter_node": {"bandwidth": "10 Gbit/s", "latency": "10 us"}})
    model = load_model("gpt3-1.3b")
    free = search(model, cluster, SearchConstraints(global_batch=32), top=1, quiet=True)
    fixed = [search(model, cluster, SearchConstraints(global_batch=32, dp=dp), top=1,
                    quiet=True).best.metrics.iteration_time_s for dp in (1, 2)]
    assert free.best.metrics.iteration_time_s <= min(fixed) * (1 + 1e-9)
    assert "a100/0" in free.best.plan.devices
    # the row a two-replica template is priced on holds the straggler, not replica 0's A100
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=32))
    pools = ctx.pools(1)
    shape = T.Shape("1f1b", 1, 1, 1, 2, ("A100-80GB", "V100-32GB"), 16, 0.0,
                    {"A100-80GB": 1, "V100-32GB": 1}, pools, 0)
    order = ("A100-80GB", "V100-32GB")
    layout = space.layouts(2, shape.recipe)[0]
    first = T._assign(pools, shape.recipe, 2, order, layout, range(1))[0]
    priced = T._priced_row(ctx, shape, order, layout)
    assert cluster.slowdown(first[0]) == 1.0 and cluster.slowdown(priced[0]) == 10.0
    assert priced[1] == first[1]


def test_a_straggler_inside_a_node_is_left_idle_where_that_is_faster():
    """A node of four devices whose first runs SLOW times slower, data parallelism only
    (pp 1, tp 1, micro-batch 1, 12 samples). Brute force: every non-empty set of devices
    as replicas that split the batch evenly, each replica's time m (F + B) at its
    device's speed, the slowest replica's setting the iteration. The search takes a
    class's units least slowed first and may stop short of the slowed ones
    (`space.slowdown_levels`); before, a class was taken whole or not at all, and its
    first units in node order (the straggler among them)."""
    flops = [1.0, 2.0, 1.0]                          # TFLOP per sample, forward, per layer
    cluster = load_cluster({"name": "straggler-node",
                            "device_types": {"x": device_type("2 TFLOP/s",
                                                              mem_bandwidth="1e15 B/s")},
                            "nodes": [{"name": "n", "device": "x", "count": 4,
                                       "intra_link": FREE_LINK, "slowdown": {"0": SLOW}}],
                            "inter_node": FREE_LINK})
    model = _flops_model(flops, "dp")
    speed = {f"n/{i}": 2e12 / (SLOW if i == 0 else 1.0) for i in range(4)}
    best = (np.inf, None)
    for r in range(1, 5):
        if 12 % r:
            continue
        for devices in itertools.combinations(speed, r):
            t = max(_one_f_one_b_s([sum(flops) * 1e12 / speed[d]], 12 // r) for d in devices)
            best = min(best, (t, devices), key=lambda x: x[0])
    assert best[1] == ("n/1", "n/2", "n/3")
    res = search(model, cluster, SearchConstraints(global_batch=12, micro_batch=1, pp=1,
                                                   tp=1, schedule="1f1b"))
    assert idle_devices(cluster, res.best.plan) == ["n/0"]
    assert res.best.metrics.iteration_time_s == pytest.approx(best[0], rel=1e-6)
    pools = space.unit_pools(cluster, 1)
    assert [u for pool in pools.values() for u in pool.units][-1] == ("n/0",)
    assert space.slowdown_levels(cluster, next(iter(pools.values()))) == (3, 4)


def test_device_classes_split_a_type_by_what_the_cost_model_sees():
    cluster = load_cluster({"nodes": [
        {"name": "a", "device": "A100-80GB", "count": 4, "repeat": 3},
        {"name": "s", "device": "A100-80GB", "count": 4, "slowdown": 3.0},
        {"name": "t", "device": "A100-80GB", "count": 2},
        {"name": "v", "device": "V100-32GB", "count": 4}]})
    classes = space.device_classes(cluster)
    assert {k: (c.type_name, c.nodes, c.slowdown) for k, c in classes.items()} == {
        "A100-80GB": ("A100-80GB", ("a0", "a1", "a2"), 1.0),
        "A100-80GB@x3": ("A100-80GB", ("s",), 3.0),
        "A100-80GB#2": ("A100-80GB", ("t",), 1.0),
        "V100-32GB": ("V100-32GB", ("v",), 1.0)}
    pools = space.unit_pools(cluster, 2, classes)
    assert {k: len(p.units) for k, p in pools.items()} == {
        "A100-80GB": 6, "A100-80GB@x3": 2, "A100-80GB#2": 1, "V100-32GB": 2}


def test_cached_ring_costs_equal_the_cost_model_whatever_was_asked_before():
    # tp-4 groups n0/0-3, n0/4-7, n1/0-3, n1/4-7 and tp-8 groups n0/0-7, n1/0-7 list
    # the same devices in the same order; their rings differ (4 rings over 4 groups, 8
    # rings over 2), so a cache must not hand one's cost to the other
    from hyperpipe.sim.network import ring_spec
    cluster = load_cluster({"nodes": [{"name": "n", "device": "A100-80GB", "count": 8,
                                       "repeat": 4}],
                            "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}})
    model = load_model("gpt2-medium")
    tp4 = tuple(tuple(f"n{k}/{j}" for j in range(h, h + 4)) for k in range(2) for h in (0, 4))
    tp8 = tuple(tuple(f"n{k}/{j}" for j in range(8)) for k in range(2))
    tp8_far = tuple(tuple(f"n{k}/{j}" for j in range(8)) for k in (2, 3))
    for order in ((tp4, tp8, tp8_far), (tp8, tp4, tp8_far), (tp8_far, tp8, tp4)):
        ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=8))
        for groups in order:
            rings = [[g[i] for g in groups] for i in range(len(groups[0]))]
            want = ring_spec(ctx.cost, rings, 2e9).time_s
            assert T._ring_s(ctx, groups, 2e9) == pytest.approx(want, rel=1e-9)


CASES = [("gpt2-medium", "a100-v100", 64), ("tiny-gpt", "demo-hetero", 16),
         ("gpt2-xl", "h100-a100-l4", 128)]


@pytest.mark.parametrize("model_name,cluster_name,batch", CASES)
def test_key_bound_is_below_every_template_of_its_key(model_name, cluster_name, batch):
    """The exhaustive walk: every key of every group cut in every stage order and layout;
    no template may beat its key's bound (else pruning by it would lose templates)."""
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=batch))
    assert _walk_keys(ctx, batch, 7) > 50


@pytest.mark.parametrize("model_name,cluster_name,batch", CASES)
def test_canonical_order_bounds_are_below_its_templates(model_name, cluster_name, batch):
    """The bound the walk takes for a key's canonical stage order (its other orders
    are cut only where that one lands in the band): `order_may_fit` lets through a
    cutoff at each canonical template's value before its all-reduces (and so at its
    time), and it does rule out cutoffs below the best of them on many keys (else it
    would prune nothing)."""
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=batch))
    classes = tuple(ctx.classes)
    checked = ruled_out = 0
    for r in range(1, len(classes) + 1):
        for types in itertools.combinations(classes, r):
            for key in T._keys(ctx, PhaseStats("t"), types, T.all_configs(ctx))[::5]:
                opt = T._optimizer_s(ctx, types, key.pools, key.tp)
                order = T.canonical_order(ctx, key.recipe)
                kind, v, mb = key.config
                m = -(-(batch // mb) // key.dp)
                lbs = []
                for lay in space.layouts(key.dp, key.recipe):
                    slots = T._assign(key.pools, key.recipe, key.dp, order, lay)
                    tpl = T._template(ctx, kind, v, mb, key.tp, types, slots[0], key.dp,
                                      lambda s=slots: s, m, 0.0, key.start)
                    if tpl is None:
                        continue
                    skipped = T._template(ctx, kind, v, mb, key.tp, types, slots[0],
                                          key.dp, lambda s=slots: s, m, 0.0, key.start,
                                          cutoff=-1.0)
                    lbs.append(skipped.value_lb)
                    assert B.order_may_fit(ctx, kind, v, mb, key.tp, key.dp, order,
                                           key.pools, key.start, m, opt,
                                           skipped.value_lb), (types, key.config)
                    checked += 1
                if lbs and not B.order_may_fit(ctx, kind, v, mb, key.tp, key.dp, order,
                                               key.pools, key.start, m, opt,
                                               0.8 * min(lbs)):
                    ruled_out += 1
    assert checked > 30 and ruled_out > checked // 10


# two classes of A100-40GB behind a slow network (one straggling node), where ZeRO-2/3's
# per-micro-batch collectives dominate
SLOW_ZERO = {"nodes": [{"name": "a", "device": "A100-40GB", "count": 4, "repeat": 3},
                       {"name": "s", "device": "A100-40GB", "count": 4, "slowdown": 1.5}],
             "inter_node": {"bandwidth": "25 Gbit/s", "latency": "5 us"}}


@pytest.mark.parametrize("zero,reshard", [(2, None), (3, True), (3, False)])
def test_key_bound_counts_zero_collectives_and_stays_below_every_template(zero, reshard):
    """Under ZeRO-2/3 the key bound adds the per-micro-batch collectives
    (`bounds.zero_collectives_s`): still below every template of its key, and nonzero on
    most keys with replicas (it must tighten something), except where ZeRO-3 keeps its
    gathered weights (no collective per micro-batch)."""
    from hyperpipe.plan.stack import RuntimeOverrides
    model, cluster = load_model("gpt2-medium"), load_cluster(SLOW_ZERO)
    runtime = RuntimeOverrides() if reshard is None else \
        RuntimeOverrides(reshard_after_forward=reshard)
    c = SearchConstraints(global_batch=32, zero=zero, runtime=runtime)
    ctx = SearchContext(CostModel(model, cluster), c)
    assert _walk_keys(ctx, 32, 3) > 20
    grew = total = 0
    for key in T._keys(ctx, PhaseStats("t"), tuple(ctx.classes), T.all_configs(ctx)):
        mode = ctx.modes(key.tp, key.dp, key.cp, sum(key.recipe.values()) > 1)[key.start]
        comm = B.zero_collectives_s(ctx, key.config[0], list(key.recipe), key.recipe,
                                    key.pools, key.tp, key.dp, mode)
        total += key.dp > 1
        grew += comm > 0
    # with a cutoff under its bound a key skips pricing its collectives: a lower bound
    # still, no higher than the full one
    for key in T._keys(ctx, PhaseStats("t"), tuple(ctx.classes), T.all_configs(ctx))[::5]:
        args = (ctx, tuple(ctx.classes), key.config, key.tp, key.dp, key.recipe, key.pools,
                key.start, T._optimizer_s(ctx, tuple(ctx.classes), key.pools, key.tp),
                ctx.layer_caps)
        full, cheap = B.key_bound(*args), B.key_bound(*args, cutoff_s=0.0)
        assert (full is None) == (cheap is None)
        assert full is None or cheap[0] <= full[0] * (1 + 1e-12)
    if reshard is False:
        # ZeRO-3 that keeps its weights gathers once a step: nothing per micro-batch
        assert total and grew == 0
    else:
        assert total and grew >= total // 2


def _walk_keys(ctx, batch: int, every: int) -> int:
    """Every `every`-th key of every group, cut in every stage order and layout: asserts
    each template is at or above its key's bound; returns the templates checked."""
    classes = tuple(ctx.classes)
    checked = 0
    for r in range(1, len(classes) + 1):
        for types in itertools.combinations(classes, r):
            for key in T._keys(ctx, PhaseStats("t"), types, T.all_configs(ctx))[::every]:
                opt = T._optimizer_s(ctx, types, key.pools, key.tp)
                got = B.key_bound(ctx, types, key.config, key.tp, key.dp, key.recipe,
                                  key.pools, key.start, opt, ctx.layer_caps)
                kind, v, mb = key.config
                m = -(-(batch // mb) // key.dp)
                for order in space.stage_orders(key.recipe):
                    for lay in space.layouts(key.dp, key.recipe):
                        slots = T._assign(key.pools, key.recipe, key.dp, order, lay)
                        tpl = T._template(ctx, kind, v, mb, key.tp, types, slots[0],
                                          key.dp, lambda s=slots: s, m, 0.0, key.start)
                        if tpl is None:
                            continue
                        assert got is not None, (types, key.config, key.dp, key.recipe)
                        assert tpl.time_s(m) >= got[0] * (1 - 1e-9), (types, key.config)
                        assert ctx.modes(key.tp, key.dp, key.cp, sum(key.recipe.values())
                                         > 1).index(tpl.mode) >= got[1]
                        checked += 1
    return checked


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "gpipe"])
def test_schedule_bound_is_below_every_schedule_of_the_plan(kind):
    """Below the simulated time of the plan's kind and of its synthesised schedule, on
    uneven stages of two device types over a real link."""
    model, cluster = load_model("gpt2-medium"), load_cluster("a100-v100")
    cost = CostModel(model, cluster)
    ctx = SearchContext(cost, SearchConstraints(global_batch=32))
    devs = [d.name for d in cluster.devices][::4][:4]
    chunks = 2 if kind in ("interleaved-1f1b", "zb-v") else None
    plan = uniform_plan(model, cluster, pp=4, micro_batch=2, global_batch=32,
                        schedule=kind, chunks=chunks, devices=devs)
    bound = schedule_bound_s(ctx, plan)
    sim = simulate(plan, cost).metrics.iteration_time_s
    syn = synthesise(plan, cost).metrics.iteration_time_s
    assert 0.5 * sim < bound <= min(sim, syn) * (1 + 1e-9)


@pytest.mark.parametrize("model_name,cluster_name,batch", CASES)
def test_pruned_walk_keeps_the_best_template_of_the_exhaustive_walk(model_name,
                                                                      cluster_name, batch):
    """Per group of classes, the branch and bound (cheap bound, then `key_bound`) keeps a
    template at least as good as the best of cutting every key, each in its canonical
    stage order and every layout (other orders are tried only where the canonical one
    lands in the band, a rule of the walk apart from its bounds)."""
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=batch))
    configs = T.all_configs(ctx)
    classes = tuple(ctx.classes)
    pruned = 0
    for r in range(1, len(classes) + 1):
        for types in itertools.combinations(classes, r):
            phase = PhaseStats("t")
            kept = T.group_templates(ctx, phase, types, configs)
            pruned += phase.pruned
            best = np.inf
            for key in T._keys(ctx, PhaseStats("t"), types, configs):
                kind, v, mb = key.config
                m = -(-(batch // mb) // key.dp)
                for lay in space.layouts(key.dp, key.recipe):
                    slots = T._assign(key.pools, key.recipe, key.dp,
                                      T.canonical_order(ctx, key.recipe), lay)
                    tpl = T._template(ctx, kind, v, mb, key.tp, types, slots[0], key.dp,
                                      lambda s=slots: s, m, 0.0, key.start)
                    if tpl is not None:
                        best = min(best, tpl.time_s(m))
            got = min((t.time_s(-(-(batch // t.micro_batch) // t.dp)) for t in kept),
                      default=np.inf)
            assert got <= best * (1 + 1e-12), types
    assert pruned > 0


def test_pick_is_never_slower_than_a_tuned_baseline_and_says_when_it_is_one():
    """On a case where the search's own best loses to the tuned proportional baseline
    (synthesised alike), that plan joins the ranking as a seed and is picked: the result
    names it, keeps the search's own best beside it, and the report says so."""
    from hyperpipe.search.report import format_search
    model, cluster = load_model("gpt2-xl"), load_cluster("h100-a100-l4")
    res = search(model, cluster, SearchConstraints(global_batch=128), workers=1)
    tuned = [res.baselines[k] for k in ("uniform", "proportional") if k in res.baselines
             and res.baselines[k].metrics.feasible]
    assert tuned
    assert res.best.metrics.iteration_time_s <= \
        min(b.metrics.iteration_time_s for b in tuned)
    assert res.own_best is not None
    # (if the search's own best comes to win here, this test needs another such case)
    assert res.seeded_from is not None, "the search's own best no longer loses here"
    seed = res.baselines[res.seeded_from]
    assert res.best.plan == seed.plan
    assert res.best.metrics.iteration_time_s == seed.metrics.iteration_time_s
    assert res.own_best.metrics.iteration_time_s > res.best.metrics.iteration_time_s
    assert res.own_best.plan != seed.plan
    text = format_search(res, CostModel(model, cluster))
    assert f"the pick is the tuned {res.seeded_from} baseline's plan" in text
    assert "the search's own best" in text


@pytest.mark.parametrize("dtype,nbytes", [("fp32", 4.0), ("bf16", 2.0)])
def test_template_sync_reduces_in_the_search_stacks_gradient_dtype(dtype, nbytes):
    """A template's gradient sync (`templates._sync_s`) all-reduces each device's
    parameters at the bytes per gradient of the search's runtime (`grad_reduce_dtype`),
    beside its optimizer step: two replicas of one whole-model stage."""
    from hyperpipe.plan.stack import RuntimeOverrides
    from hyperpipe.search import partition as P
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(
        global_batch=16, runtime=RuntimeOverrides(grad_reduce_dtype=dtype)))
    n = model.num_layers
    slots = [[("a100/0",)], [("a100/1",)]]
    part = P.Partition((0, n), (1.0,), 1.0, 1.0, 0.5, 0.5, 1.0)
    mode = space.MemoryMode()
    got = T._sync_s(ctx, slots, part, 1, mode)
    step = ctx.cost.optimizer_time_s((0, n), "A100-80GB", 1, 1, ("a100/0",))
    ring = T._ring_s(ctx, (("a100/0",), ("a100/1",)), ctx.cost.stage_params((0, n)) * nbytes)
    assert got == pytest.approx(step + ring, rel=1e-12)
    assert ring > 0


def test_every_device_holds_a_layer_per_chunk():
    """`bounds._chunks_floor_s`: a device of a pipeline with v chunks holds at least v
    layers. With more L4 units than cheap layers (GPT-2's embedding and head), one L4
    unit holds v transformer blocks: v x a block's least time (F + B, or F + I + W)
    on an L4, from the cost model."""
    model, cluster = load_model("gpt2-small"), load_cluster("h100-a100-l4")
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=32))
    pools = ctx.pools(1, 1)
    l4 = next(t for t in ctx.classes if ctx.type_of(t).name == "L4")
    unit = ctx.fastest_unit(pools[l4])
    mode = ctx.modes(1, 1, 1, True, 1)[0]
    cost, mb, block = ctx.cost, 2, 1
    fb = sum(cost.layer_time_s(block, "L4", mb, op) for op in ("F", "B"))
    fiw = sum(cost.layer_time_s(block, "L4", mb, op) for op in ("F", "I", "W"))
    for v in (1, 2, 4):
        floor = B._chunks_floor_s(ctx, [l4], {l4: unit}, mb, mode, 1, ctx.layer_caps,
                                  {l4: 3}, v)
        assert floor == pytest.approx(v * min(fb, fiw), rel=1e-9)
    # two L4 units may both hold a cheap layer: the floor counts them in
    assert B._chunks_floor_s(ctx, [l4], {l4: unit}, mb, mode, 1, ctx.layer_caps,
                             {l4: 2}, 2) < 2 * min(fb, fiw)


def test_alike_layers_stay_in_the_reduced_set_under_sharded_state():
    """`bounds.layer_caps(reduced=True)` leaves out the layers cheaper than the median
    (a GPT's embedding and head), not transformer blocks whose bytes differ from the
    median's in the last digits only (ZeRO's sharded state, read off prefix sums): with
    blocks left out, `_chunks_floor_s` fell back to the cheap layers and bounded a
    V100's two chunks by the embedding's time. Oracle: the model's non-block layers, and
    v x a block's least time on the V100 (its layer table, unsharded)."""
    model, cluster = load_model("gpt3-175b"), load_cluster("scale-1024")
    ctx = SearchContext(CostModel(model, cluster), SearchConstraints(global_batch=1536))
    v100 = next(t for t in ctx.classes if ctx.type_of(t).name == "V100-32GB")
    unit = ctx.fastest_unit(ctx.pools(2, 1)[v100])
    mode = space.MemoryMode("full", True, 1)
    cheap = sum(1 for spec in model.layers if spec.kind != "block")
    mb = 2
    block = next(i for i, spec in enumerate(model.layers) if spec.kind == "block")
    least = float(ctx.table(unit, mb, mode).least_layer_s()[block])
    for shards in (1, 10, 64):
        caps = B.layer_caps(ctx, unit, mb, mode, shards, ctx.layer_caps, reduced=True)
        assert caps.left_out == cheap
        floor = B._chunks_floor_s(ctx, [v100], {v100: unit}, mb, mode, shards,
                                  ctx.layer_caps, {v100: 12}, 2)
        assert floor == pytest.approx(2 * least, rel=1e-6)


def test_best_other_follows_the_objective():
    """The report's comparison names the best other plan by the search's objective: the
    fastest under throughput, the cheapest per token under cost (a review found a cost
    search's report comparing its pick with a plan 4.8x dearer, because it was faster)."""
    from types import SimpleNamespace as NS

    from hyperpipe.search.report import best_other

    def cand(time_s, cost, feasible=True):
        return NS(metrics=NS(feasible=feasible, iteration_time_s=time_s,
                             cost_per_million_tokens=cost))
    fast, cheap, broken = cand(1.0, 9.0), cand(3.0, 2.0), cand(0.5, 1.0, feasible=False)
    res = NS(baselines={"amp": fast, "uniform": cheap, "metis": broken},
             constraints=NS(objective="throughput"))
    assert best_other(res) == ("amp", fast)
    res.constraints = NS(objective="cost")
    assert best_other(res) == ("uniform", cheap)
    res.constraints = None                   # a result without them: by time
    assert best_other(res) == ("amp", fast)


def test_using_all_is_the_best_plan_on_every_device_searched_or_baseline():
    """The idle line's alternative uses every device (not only those the pick leaves
    idle), may be a baseline's, keeps the search's constraints and is ranked by its
    objective."""
    from types import SimpleNamespace as NS

    from hyperpipe.search.report import idle_lines, using_all
    cluster = load_cluster(_straggler_cluster())
    every = [d.name for d in cluster.devices]

    def cand(devices, time_s, cost=None, feasible=True):
        return NS(plan=NS(devices=devices, global_batch=6),
                  metrics=NS(feasible=feasible, iteration_time_s=time_s,
                             cost_per_million_tokens=cost))
    pick = cand(every[:2], 1.0, 1.0)
    only_idle = cand(every[2:], 1.5, 0.5)          # uses the idle device alone
    slow_all = cand(every, 4.0, 2.0)
    cheap_all = cand(every, 5.0, 1.5)
    fast_all = cand(every, 3.0, 3.0, feasible=False)
    res = NS(best=pick, simulated=[pick, only_idle, slow_all, fast_all],
             baselines={"uniform": cheap_all}, constraints=NS(
                 admits=lambda plan: True, objective="throughput", global_batch=6))
    assert using_all(res, cluster) is slow_all
    res.constraints.admits = lambda plan: plan is not slow_all.plan    # outside them
    assert using_all(res, cluster) is cheap_all
    res.constraints = NS(admits=lambda plan: True, objective="cost", global_batch=6)
    assert using_all(res, cluster) is cheap_all
    res.simulated = [pick, only_idle]
    res.baselines = {}
    assert using_all(res, cluster) is None
    assert idle_lines(res, cluster, ("s", 1.0))[-1].endswith("no simulated plan uses "
                                                             "every device")
