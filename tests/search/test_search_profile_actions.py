"""The templates price a stage as the simulator does under a calibration profile: the
profile's per-action overhead once per action (not once per layer), and a split
backward as the profile's I and W (not its B)."""

import itertools

import pytest

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.plan.profile import Fit, Profile
from hyperpipe.search import partition as P
from hyperpipe.search.space import SearchConstraints
from hyperpipe.search.templates import PhaseStats, SearchContext, templates_at
from hyperpipe.sim.costmodel import CostModel

OVERHEAD_S = {"F": 1.5e-3, "B": 1.5e-3, "I": 1.5e-3, "W": 1.5e-3}


def _profile(split_cost: float) -> Profile:
    """Block and head times on both device types of demo-hetero, I + W costing
    `split_cost` x B (a fused backward beats two passes on small layers), and a
    per-action overhead."""
    compute, overhead = {}, {}
    for dev, rate in (("A100-80GB", 2e-12), ("V100-32GB", 5e-12)):
        for kind in ("embedding", "block", "head"):
            compute[Profile.key(dev, kind, "F")] = Fit(1e-4, rate)
            compute[Profile.key(dev, kind, "B")] = Fit(2e-4, rate)
            compute[Profile.key(dev, kind, "I")] = Fit(1e-4 * split_cost, rate * split_cost / 2)
            compute[Profile.key(dev, kind, "W")] = Fit(1e-4 * split_cost, rate * split_cost / 2)
        for op, s in OVERHEAD_S.items():
            overhead[f"{dev}|{op}"] = s
    return Profile(compute=compute, overhead=overhead)


@pytest.fixture(scope="module")
def cost():
    return CostModel(load_model("tiny-gpt"), load_cluster("demo-hetero"), _profile(1.5))


@pytest.mark.parametrize("split", [False, True])
def test_cut_times_are_the_stage_times_the_simulator_prices(cost, split):
    # oracle: CostModel.stage_time_s of each whole stage, which counts a profile's
    # overhead once per action; a split backward is I then W, as the simulator runs it
    n = cost.model.num_layers
    devices = [("a100/0",), ("v100/0",), ("a100/1",)]
    tables = [P.layer_tables(cost, d, 2) for d in devices]
    assert all(t.splits(True) for t in tables)
    for cuts in itertools.combinations(range(1, n), len(devices) - 1):
        bounds = (0, *cuts, n)
        got = P.describe(bounds, tables, [None] * len(devices), [split] * len(devices))
        for k, (a, b) in enumerate(itertools.pairwise(bounds)):
            back = ("I", "W") if split else ("B",)
            want = sum(cost.stage_time_s((a, b), devices[k], 2, op) for op in ("F", *back))
            assert got.stage_s[k] == pytest.approx(want, rel=1e-12)
            mat = P.time_matrix(tables[k], None, split)
            assert mat[a, b] == pytest.approx(want, rel=1e-12)


def test_bound_tables_stay_below_every_schedule(cost):
    # what the key bounds read (`least_layer_s`) is at most any stage's time, split or not
    t = P.layer_tables(cost, ("v100/0",), 2)
    least = t.least_layer_s()
    for a, b in itertools.combinations(range(cost.model.num_layers + 1), 2):
        stage = min(sum(cost.stage_time_s((a, b), ("v100/0",), 2, op) for op in ops)
                    for ops in (("F", "B"), ("F", "I", "W")))
        assert least[a:b].sum() <= stage * (1 + 1e-12)


def test_a_costly_split_backward_keeps_the_unsplit_kinds():
    # I + W at twice B: a zero-bubble template of a layout costs more per micro-batch
    # than the 1F1B one, so 1F1B templates are kept, each no slower than the zb-h1
    # template of the same stages
    cost = CostModel(load_model("tiny-gpt"), load_cluster("demo-hetero"), _profile(2.0))
    ctx = SearchContext(cost, SearchConstraints(global_batch=16, micro_batch=2, tp=1))
    kept = templates_at(ctx, PhaseStats("templates"), tuple(ctx.classes), None)
    by_kind = {}
    for t in kept:
        by_kind.setdefault(t.kind, []).append(t)
    assert "1f1b" in by_kind
    for z in by_kind.get("zb-h1", []):
        same = [t for t in by_kind["1f1b"] if t.slots == z.slots and t.part.bounds == z.part.bounds]
        for t in same:
            assert t.device_load_s < z.device_load_s
