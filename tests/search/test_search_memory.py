"""The search's memory dimensions (issue 9): recompute, sequence parallelism and the
distributed optimizer are used where memory needs them, never otherwise, and the CLI
flags fix them; the chunks of one device share its memory."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from factories import FREE_LINK, cluster_doc, device_type, synthetic_doc

from hyperpipe.cli import main
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import InfeasiblePlan
from hyperpipe.models import load_model
from hyperpipe.plan.plan import StagePlan
from hyperpipe.search import partition as P
from hyperpipe.search.search import SearchConstraints, search
from hyperpipe.search.space import MemoryMode, memory_modes
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate

GB = 1e9


def _cluster(memory_gb: float, devices: int = 2) -> dict:
    return cluster_doc({"x": device_type("1 TFLOP/s", memory=memory_gb * GB,
                                         mem_bandwidth="1e15 B/s")},
                       [("n0", "x", devices)], intra_link=FREE_LINK, inter_node=FREE_LINK,
                       name="mem")


def _model(layers: int = 4, stash_gb: float = 1.0, params: int = 0) -> dict:
    """Synthetic layers that stash `stash_gb` per sample and pass on 10 MB (what full
    recompute keeps)."""
    return synthetic_doc(layers, fwd_flops_per_sample=1e9, activation_bytes_per_sample=1e7,
                         stash_bytes_per_sample=stash_gb * GB, params_per_layer=params)


def test_ladder_of_memory_modes():
    c = SearchConstraints(global_batch=8)
    assert memory_modes(c, 1, 1, False) == (MemoryMode(), MemoryMode("full"))
    # every ZeRO stage before each recompute kind: zero 2 and 3 only where 1 does not fit
    assert memory_modes(c, 2, 4, True) == (
        MemoryMode(), *(MemoryMode(r, True, z) for r in ("none", "selective", "full")
                        for z in (1, 2, 3)))
    # ZeRO-3 without resharding holds what ZeRO-1 holds: not tried
    assert [m.zero for m in memory_modes(c, 1, 4, False, reshard=False)] == [0, 1, 2, 1, 2]
    # context ranks shard with the replicas: one replica of cp 2 has two shards
    assert [m.zero for m in memory_modes(c, 1, 1, False, cp=2)] == [0, 1, 2, 3, 1, 2, 3]
    assert {m.cp for m in memory_modes(c, 1, 1, False, cp=2)} == {2}
    fixed = SearchConstraints(global_batch=8, recompute="selective", sequence_parallel=True)
    assert memory_modes(fixed, 2, 1, True) == (MemoryMode("selective", True, 0),)
    assert memory_modes(SearchConstraints(global_batch=8, distributed_optimizer=False),
                        1, 4, True)[-1] == MemoryMode("full", False, 0)
    assert memory_modes(SearchConstraints(global_batch=8, zero=3), 2, 4, False) == (
        MemoryMode("none", False, 3), MemoryMode("none", True, 3), MemoryMode("full", True, 3))
    assert all(m.distributed_optimizer == (m.zero >= 1) for m in memory_modes(c, 2, 4, True))


def test_search_recomputes_only_when_memory_needs_it():
    # 4 layers stashing 1 GB a sample: no split holds them in 2.5 GB without recompute
    tight = load_cluster(_cluster(2.5))
    model = load_model(_model())
    result = search(model, tight, SearchConstraints(global_batch=4))
    plan = result.best.plan
    assert {s.recompute for p in plan.pipelines for s in p.stages} == {"full"}
    assert not result.best.metrics.oom
    with pytest.raises(InfeasiblePlan):
        search(model, tight, SearchConstraints(global_batch=4, recompute="none"))
    roomy = search(model, load_cluster(_cluster(100)), SearchConstraints(global_batch=4))
    stages = [s for p in roomy.best.plan.pipelines for s in p.stages]
    assert {s.recompute for s in stages} == {"none"}
    assert not roomy.best.plan.distributed_optimizer
    # the recomputed forward costs time: the roomy plan is faster
    assert roomy.best.metrics.iteration_time_s < result.best.metrics.iteration_time_s


def test_search_shards_the_optimizer_when_state_needs_it():
    # 2 layers of 1e9 parameters: 36 GB of bf16 Adam state on one pipeline device, 24 GB
    # with the optimizer sharded over 2 replicas (6 + 12/2 bytes a parameter)
    model = load_model(_model(layers=2, stash_gb=0.001, params=10**9))
    cluster = load_cluster(_cluster(30))
    c = SearchConstraints(global_batch=4, pp=1, dp=2)
    plan = search(model, cluster, c).best.plan
    assert plan.distributed_optimizer
    peak = simulate(plan, CostModel(model, cluster)).metrics.peak_memory_bytes
    mb = plan.pipelines[0].micro_batch          # 1F1B on one stage: one micro-batch held
    assert max(peak.values()) == pytest.approx(2e9 * 12 + 2 * mb * 0.001 * GB, rel=1e-6)
    with pytest.raises(InfeasiblePlan):
        search(model, cluster, SearchConstraints(global_batch=4, pp=1, dp=2,
                                                 distributed_optimizer=False))


def test_cli_flags_fix_the_memory_options(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--cluster", "a100-1024", "--model", "gpt3-1.3b", "--global-batch", "16"]
    assert main(["search", *args, "--pp", "2", "--tp", "2", "--dp", "2", "--micro-batch", "1",
                 "--schedule", "1f1b", "--recompute", "selective", "--sequence-parallel",
                 "--distributed-optimizer", "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["distributed_optimizer"] is True
    stages = [s for p in doc["pipelines"] for s in p["stages"]]
    assert {s["recompute"] for s in stages} == {"selective"}
    assert all(s["sequence_parallel"] for s in stages)
    assert main(["simulate", *args, "--pp", "2", "--tp", "2", "--micro-batch", "1",
                 "--recompute", "full", "--sequence-parallel", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert main(["simulate", *args, "--pp", "2", "--tp", "2", "--micro-batch", "1",
                 "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert full["iteration_time_s"] > plain["iteration_time_s"]
    assert max(full["peak_memory_bytes"].values()) < max(plain["peak_memory_bytes"].values())
    for bad in (["simulate", *args, "--pp", "2", "--micro-batch", "1", "--sequence-parallel"],
                ["search", *args, "--tp", "1", "--sequence-parallel"],
                ["search", *args, "--recompute", "most"],
                ["simulate", "--plan", str(out), "--recompute", "full"]):
        assert main(bad) == 2
        err = capsys.readouterr().err.strip()
        assert err and "\n" not in err


def test_chunks_of_a_device_share_its_memory():
    """zb-v on 2 devices, one layer a chunk: device 0 holds stage 0 (4 micro-batches in
    flight at the peak) and stage 3 (1), 5 GB of 1 GB stashes together. In 6 GB they fit
    without recompute, but not if each chunk gets half the device (stage 0 alone needs
    4 GB of the 3): the search must not fall back to full recompute."""
    model, cluster = load_model(_model()), load_cluster(_cluster(6.0))
    fixed = {"global_batch": 8, "schedule": "zb-v", "chunks": 2, "pp": 2, "dp": 1,
             "micro_batch": 1}
    best = search(model, cluster, SearchConstraints(**fixed)).best
    assert {s.recompute for p in best.plan.pipelines for s in p.stages} == {"none"}
    assert not best.metrics.oom
    full = search(model, cluster, SearchConstraints(**fixed, recompute="full")).best
    assert best.metrics.iteration_time_s < full.metrics.iteration_time_s


def test_chunks_share_their_device_room():
    """A device's v chunks: `shared_slots` splits its room among them, so every cut the
    DP finds fits each device with all its chunks, and one is found whenever the even
    cut fits. Against brute force over every cut: it finds a cut in cases where a v-th
    of the room per chunk finds none (the embedding-heavy first chunk)."""
    rng = np.random.default_rng(5)
    outcomes = {"rescued": 0, "fits": 0, "none": 0}
    for trial in range(300):
        d, v = int(rng.integers(1, 4)), int(rng.integers(2, 4))
        stages = d * v
        n = int(rng.integers(stages, stages + 5))
        homes = [k % d if (k // d) % 2 == 0 else d - 1 - k % d for k in range(stages)]
        state = rng.uniform(1, 3, n)
        state[0] += rng.uniform(0, 6)                      # an embedding
        stash = rng.uniform(0, 1, n)
        inflight = rng.integers(1, 4, stages)
        room = rng.uniform(0.5, 1.5, d) * (state.sum() + 2 * stash.sum()) / d
        table = P.LayerTables(np.concatenate([[0], np.cumsum(rng.uniform(1, 2, n))]),
                              np.zeros(n + 1), np.concatenate([[0], np.cumsum(state)]),
                              np.concatenate([[0], np.cumsum(stash)]))
        tables = [table] * stages
        rooms = [P.Slot(("x",), int(inflight[k]), float(room[homes[k]]))
                 for k in range(stages)]

        def fits(b, rooms=rooms, homes=homes, inflight=inflight, state=state,
                 stash=stash, room=room):
            use = np.zeros(len(room))
            for k, (a, e) in enumerate(itertools.pairwise(b)):
                use[homes[k]] += state[a:e].sum() + inflight[k] * stash[a:e].sum()
            return bool(np.all(use <= room * (1 + 1e-12)))

        def cut(slots, tables=tables):
            times = P.time_matrix(tables[0], None)
            return P.partition([P.stage_matrix(t, s, times) for t, s in
                                zip(tables, slots, strict=True)])

        feasible = any(fits((0, *c, n))
                       for c in itertools.combinations(range(1, n), stages - 1))
        even = tuple(k * n // stages for k in range(stages + 1))
        got = cut(P.shared_slots(tables, rooms, homes))
        split = cut([P.Slot(s.devices, s.inflight, s.capacity_bytes / v) for s in rooms])
        if got is None:
            assert not fits(even), trial
            outcomes["none"] += 1
            continue
        assert feasible and fits(got), trial
        outcomes["fits"] += 1
        outcomes["rescued"] += split is None
    assert min(outcomes.values()) >= 10, outcomes


def test_gpipe_in_flight_counts_follow_m_whatever_was_asked_before():
    """GPipe stashes every micro-batch, so its counts never stop growing with m: a
    context asked for m = 7 first still gives m = 13's counts (the IR's, counted here)
    and cuts a pipeline of m = 301 as a fresh context does (recomputing: 301 stashes of
    2 GB per stage do not fit 20 GB, 7 do)."""
    from hyperpipe.plan.kinds import generate
    from hyperpipe.search import templates as T
    from hyperpipe.search.context import SearchContext

    def ir_counts(p: int, m: int) -> tuple[int, ...]:
        live, peak = [0] * p, [0] * p
        for row in generate("gpipe", p, m).actions:
            for a in row:
                live[a.stage] += 1 if a.op == "F" else -(a.op == "B")
                peak[a.stage] = max(peak[a.stage], live[a.stage])
        return tuple(peak)

    def context() -> SearchContext:
        return SearchContext(CostModel(load_model(_model()), load_cluster(_cluster(20))),
                             SearchConstraints(global_batch=301))

    warm, fresh = context(), context()
    assert warm.peak_inflight("gpipe", 2, 7, 1) == ir_counts(2, 7) == (7, 7)
    assert warm.peak_inflight("gpipe", 2, 13, 1) == ir_counts(2, 13) == (13, 13)
    types = tuple(warm.classes)
    recipe = {types[0]: 2}
    slots = T._assign(warm.pools(1), recipe, 1, T.canonical_order(warm, recipe), "pipeline")

    def cut(ctx: SearchContext, m: int):
        return T._template(ctx, "gpipe", 1, 1, 1, types, slots[0], 1, lambda: slots, m, 0.0)

    few = cut(warm, 7)
    assert few is not None and few.mode.recompute == "none"
    many, alone = cut(warm, 301), cut(fresh, 301)
    assert alone is not None and alone.mode.recompute != "none"
    assert (many.mode, many.part) == (alone.mode, alone.part)


@pytest.mark.parametrize("tp", [1, 2])
def test_stage_memory_counts_the_outputs_deepspeed_keeps(tp):
    """On a stack that keeps each in-flight stage output (megatron-deepspeed), the
    search's memory tables admit layers [i, j) exactly where the simulator's rules
    (`CostModel.device_static_bytes` and `stage_stash_bytes` with the kept output, the
    head's fp32 logits on the last stage) fit them, for every i and j; without the
    kept outputs they admit more."""
    model = load_model({"kind": "gpt", "name": "t", "vocab_size": 1000, "n_layer": 6,
                        "n_head": 4, "d_model": 64, "seq_len": 128, "dtype": "fp16",
                        "tie_embeddings": False})   # per-layer state: no shared matrix
    cluster = load_cluster(_cluster(1.0))
    cost, mb, inflight = CostModel(model, cluster), 2, 3
    n = model.num_layers
    zeros = np.zeros(n + 1)
    kept = P.layer_memory(cost, tp, mb, zeros, zeros, keeps_outputs=True)
    plain = P.layer_memory(cost, tp, mb, zeros, zeros)
    devices = tuple(d.name for d in cluster.devices)[:tp]

    def need(i, j):
        st = StagePlan((i, j), devices, tp)
        return (cost.device_static_bytes([st], mb) - cost.runtime_reserve_bytes("x")
                + inflight * cost.stage_stash_bytes(st, mb, True))

    sizes = sorted(need(i, j) for i in range(n) for j in range(i + 1, n + 1))
    admitted_more = 0
    for cap in sizes[::7]:
        slot = P.Slot(devices, inflight, cap * (1 + 1e-12))
        with_kept = P.stage_matrix(kept, slot, P.time_matrix(kept, None))
        without = P.stage_matrix(plain, slot, P.time_matrix(plain, None))
        for i in range(n):
            for j in range(i + 1, n + 1):
                assert (with_kept.at(i, j) < np.inf) == (need(i, j) <= slot.capacity_bytes)
                admitted_more += without.at(i, j) < np.inf <= with_kept.at(i, j)
    assert admitted_more > 0
