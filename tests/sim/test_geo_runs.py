"""The inputs of experiments/published.py's `geo` block: Yuan et al.'s cases 3 to 5 as
cluster files, checked against their matrices as their scheduler/
generate_sim_com_matrices.py builds them (instance i's region by index, the delay and
rate between two instances; rewritten here by its index rules, not read off the block's
table), and the plans Megatron places on them."""

from __future__ import annotations

import pytest
from factories import experiment

NIC_BYTES_PER_S = 10e9 / 8           # a p3.2xlarge's "up to 10 Gigabit"


@pytest.fixture(scope="module")
def script():
    return experiment("published")


def matrix_entry(case: int, i: int, j: int) -> tuple[float, float]:
    """(delay ms, Gbit/s) from instance i to instance j of 64, by the repository's rules:
    case 3 (its simulate_2): 0-31 Ohio, 32-63 Virginia, 5 Gbit/s 1 ms inside, 1.12 Gbit/s
    11 ms across; case 4 (simulate_3): 16 each in Virginia, Oregon, California, Ohio, 2
    Gbit/s 10 ms inside; case 5 (simulate_4): 8 each of eight cities, 2 Gbit/s 10 ms
    inside. Between regions of cases 4 and 5: a few pairs of their table."""
    if case == 3:
        same = (i < 32) == (j < 32)
        return (1, 5.0) if same else (11, 1.12)
    if case == 4:
        names = ("Virginia", "Oregon", "California", "Ohio")
        a, b = names[i // 16], names[j // 16]
        across = {frozenset(("Virginia", "Oregon")): (67, 1.15),
                  frozenset(("Oregon", "California")): (12, 1.25),
                  frozenset(("California", "Ohio")): (52, 1.02)}
    else:
        names = ("Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt",
                 "Ireland")
        a, b = names[i // 8], names[j // 8]
        across = {frozenset(("Ohio", "Tokyo")): (130, 0.694),
                  frozenset(("Seoul", "London")): (238, 0.342),
                  frozenset(("Oregon", "Ireland")): (124, 0.482)}
    return (10, 2.0) if a == b else across[frozenset((a, b))]


PAIRS = {3: [(0, 1), (0, 31), (31, 32), (63, 5)],
         4: [(0, 15), (3, 20), (20, 40), (47, 48)],
         5: [(0, 7), (16, 24), (32, 40), (7, 56)]}


@pytest.mark.parametrize("case", [3, 4, 5])
def test_every_instance_pair_gets_its_matrix_entry(script, case):
    cluster = script.geo_cluster(case)
    devices = [d.name for d in cluster.devices]
    assert len(devices) == 64
    for i, j in PAIRS[case]:
        delay_ms, gbit = matrix_entry(case, i, j)
        link = cluster.path(devices[i], devices[j]).link
        assert link.latency_s == pytest.approx(delay_ms / 1e3), (i, j)
        assert link.bandwidth_bytes_per_s == pytest.approx(
            min(gbit * 1e9 / 8, NIC_BYTES_PER_S)), (i, j)


def test_megatron_puts_each_stage_in_one_region(script):
    """pp 8, dp 8: stage k of replica r on rank 8k + r, so on case 5 stage k runs in the
    k-th city and every exchange between stages crosses one link of the chain."""
    cluster = script.geo_cluster(5)
    _, _, plan = script.ds3lab_plan(24, 1024, 8, 1, cluster)
    devices = [d.name for d in cluster.devices]
    for r, pipe in enumerate(plan.pipelines):
        assert [s.devices for s in pipe.stages] == [(devices[8 * k + r],) for k in range(8)]
        regions = [cluster.node(cluster.device(s.devices[0]).node).region for s in pipe.stages]
        assert regions == ["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London",
                           "Frankfurt", "Ireland"]
