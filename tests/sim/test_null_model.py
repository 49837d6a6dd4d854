"""The accuracy study's null model: compute only, against closed forms."""

from __future__ import annotations

import pytest
from factories import FREE_LINK as FREE

from hyperpipe.cluster.cluster import cluster_from_dict
from hyperpipe.models import load_model
from hyperpipe.plan.plan import PipelinePlan, StagePlan
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.sim.accuracy import compute_only_s
from hyperpipe.sim.costmodel import CostModel


def test_compute_only_is_the_busiest_devices_work():
    cluster = cluster_from_dict({
        "device_types": {"x": {"peak_flops": "1 TFLOP/s", "efficiency": 1.0,
                               "memory": "1000 GB", "mem_bandwidth": "1e15 B/s"}},
        "nodes": [{"name": "n", "device": "x", "count": 2, "intra_link": FREE}],
        "inter_node": FREE}, where="test", name="even")
    model = load_model({"kind": "synthetic", "layers": 6, "fwd_flops_per_sample": 1e12,
                        "activation_bytes_per_sample": 1e9, "params_per_layer": 1000,
                        "name": "syn"})
    cost = CostModel(model, cluster)
    # 4 micro-batches of 1 sample, layers 0-3 and 3-6 (F 1 s per layer, B = I + W = 2 s):
    # each device 4 x 3 layers x 3 s = 36 s, whatever the links, bubble or optimizer
    plan = uniform_plan(model, cluster, pp=2, micro_batch=1, global_batch=4)
    assert compute_only_s(plan, cost) == pytest.approx(36.0)
    # uneven: the busier device counts
    two = plan.with_pipelines([PipelinePlan(1, 4, (StagePlan((0, 4), ("n/0",)),
                                                   StagePlan((4, 6), ("n/1",))))])
    assert compute_only_s(two, cost) == pytest.approx(48.0)


def test_kendall_tau_against_pairs_counted_by_hand():
    """tau-a: concordant minus discordant pairs over all pairs, ties in either ranking
    counting as neither."""
    from hyperpipe.sim.accuracy import kendall_tau
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    # (0,1) (0,2) (0,3) (1,3) concordant, (1,2) discordant, (2,3) tied in x: (4 - 1) / 6
    assert kendall_tau([1, 2, 3, 3], [1, 3, 2, 4]) == pytest.approx((4 - 1) / 6)


def test_mape_is_the_mean_relative_error():
    from hyperpipe.sim.accuracy import mape
    assert mape([110.0, 80.0], [100.0, 100.0]) == pytest.approx((0.10 + 0.20) / 2)
    with pytest.raises(ValueError):
        mape([1.0], [1.0, 2.0])
