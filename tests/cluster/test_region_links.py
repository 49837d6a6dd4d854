"""Paths between regions (`links`, `nodes[].region`): a transfer between nodes of a
linked pair of regions crosses the sender's NIC, its own path and the receiver's NIC,
at the slowest of the three and the path's latency.

Oracles: the route's closed form (latency + bytes / min of the hop bandwidths); an
equivalent cluster without `links` whose NICs are the path (the simulator and the
analytic tier must give the same time, since nothing else differs); the ring
all-reduce's closed form over three single-device nodes with one slow pair.
"""

from __future__ import annotations

import pytest
from factories import chain_plan, device_type, synthetic_model

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.exec.fabric import topology
from hyperpipe.search.space import device_classes
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, simulate
from hyperpipe.whatif.failures import without_node

NIC = "10 Gbit/s"          # every node's NIC: 1.25e9 B/s, 1 ms
WAN_BW, WAN_LAT = 0.125e9, 0.040      # the eu-us path: 1 Gbit/s, 40 ms


def regions_doc(per_node: int = 1, links: list | None = None, **extra_node) -> dict:
    """Two nodes in eu (a0, a1) and two in us (b0, b1), `per_node` unit devices each
    (collective and NIC efficiency 1), NICs of `NIC` at 1 ms; the eu-us path `WAN_*`."""
    node = {"device": "unit", "count": per_node, "nic": {"bandwidth": NIC, "latency": "1 ms"},
            "intra_link": {"bandwidth": "100 GB/s", "latency": "1 us"}, **extra_node}
    wan = [{"between": ["us", "eu"], "bandwidth": WAN_BW, "latency": WAN_LAT}]
    return {"name": "two-regions",
            "device_types": {"unit": device_type(1e12)},
            "nodes": [{"name": "a", "region": "eu", "repeat": 2, **node},
                      {"name": "b", "region": "us", "repeat": 2, **node}],
            "links": wan if links is None else links}


def test_a_linked_pair_of_regions_routes_through_its_path():
    c = load_cluster(regions_doc())
    inside, across = c.path("a0/0", "a1/0"), c.path("a1/0", "b0/0")
    assert [h.name for h in inside.hops] == ["a0:nic-out", "a1:nic-in"]
    assert inside.time_s(1e6) == pytest.approx(1e-3 + 1e6 / 1.25e9)
    assert [h.name for h in across.hops] == ["a1:nic-out", "a1>b0:path", "b0:nic-in"]
    assert across.time_s(1e6) == pytest.approx(WAN_LAT + 1e6 / WAN_BW)
    # one path per ordered pair of nodes: the reverse direction is its own hop
    assert [h.name for h in c.path("b0/0", "a1/0").hops][1] == "b0>a1:path"
    # the emulated executor's links read the same routes
    topo = topology(c, ["a1/0", "b0/0"])
    assert topo.route(0, 1).hops == ("a1:nic-out", "a1>b0:path", "b0:nic-in")
    assert topo.route(0, 1).latency_s == pytest.approx(WAN_LAT)
    assert topo.bandwidth_bytes_per_s["a1>b0:path"] == pytest.approx(WAN_BW)


def test_a_path_without_latency_keeps_the_nics_and_nics_may_set_one():
    doc = regions_doc(links=[{"between": ["eu", "us"], "bandwidth": "2 Gbit/s"}])
    doc["nodes"][1]["nic"] = {"bandwidth": NIC, "latency": "3 ms"}
    c = load_cluster(doc)
    assert c.path("a0/0", "b1/0").link.latency_s == pytest.approx(3e-3)
    assert c.path("a0/0", "b1/0").link.bandwidth_bytes_per_s == pytest.approx(0.25e9)
    del doc["nodes"][1]["nic"]
    doc["nodes"][1]["nics"] = {"count": 1, "bandwidth": NIC, "latency": "7 ms"}
    assert load_cluster(doc).path("a0/0", "b1/0").link.latency_s == pytest.approx(7e-3)


def test_a_node_named_without_a_region_is_its_own_and_a_region_may_link_itself():
    doc = regions_doc(links=[{"between": ["a0", "us"], "bandwidth": WAN_BW}])
    del doc["nodes"][0]["region"]           # a0, a1: their own regions
    c = load_cluster(doc)
    assert c.path("a0/0", "b1/0").link.bandwidth_bytes_per_s == pytest.approx(WAN_BW)
    assert c.path("a1/0", "b0/0").link.bandwidth_bytes_per_s == pytest.approx(1.25e9)
    doc["links"].append({"between": ["eu", "eu"], "bandwidth": "5 Gbit/s"})
    with pytest.raises(BadInput, match=r"links\[1\]\.between.*regions"):
        load_cluster(doc)           # "eu" names no node's region now
    doc["nodes"][0]["region"] = "eu"
    doc["links"] = [{"between": ["eu", "eu"], "bandwidth": "5 Gbit/s"}]
    c = load_cluster(doc)
    assert c.path("a0/0", "a1/0").link.bandwidth_bytes_per_s == pytest.approx(0.625e9)
    assert c.path("a0/0", "b1/0").link.bandwidth_bytes_per_s == pytest.approx(1.25e9)


@pytest.mark.parametrize("links, match", [
    ([{"between": ["eu", "mars"], "bandwidth": "1 Gbit/s"}], r"links\[0\]\.between"),
    ([{"between": ["eu"], "bandwidth": "1 Gbit/s"}], r"two region or node names"),
    ([{"between": ["eu", "us"]}], r"links\[0\]\.bandwidth"),
    ([{"between": ["eu", "us"], "bandwidth": "1 Gbit/s"},
      {"between": ["us", "eu"], "bandwidth": "2 Gbit/s"}], r"each pair of regions once"),
    ([{"between": ["eu", "us"], "bandwidth": "1 Gbit/s", "speed": 1}],
     r"links\[0\]\.speed: expected one of the known keys"),
    ({"between": ["eu", "us"]}, r"links: expected a list"),
])
def test_bad_links_are_refused_naming_the_field(links, match):
    with pytest.raises(BadInput, match=match):
        load_cluster(regions_doc(links=links))


def _two_stage(cluster):
    """Two stages of a synthetic model, a0/0 then b0/0: every send crosses eu-us."""
    model = synthetic_model(4, fwd_flops_per_sample=1e9, activation_bytes_per_sample=8e6)
    return model, chain_plan(model, cluster, [0, 2, 4], ["a0/0", "b0/0"], 2, 8)


def test_simulator_and_analytic_tier_price_the_path_as_an_equivalent_nic():
    """Oracle: the same plan on a cluster without `links` whose NICs are the eu-us path
    (1 Gbit/s at 40 ms) takes the same time: the route's idle time is all that moved."""
    linked = load_cluster(regions_doc())
    doc = regions_doc(links=[])
    for node in doc["nodes"]:
        node["nic"] = {"bandwidth": WAN_BW, "latency": WAN_LAT}
    plain = load_cluster(doc)
    times = {}
    for name, cluster in (("linked", linked), ("plain", plain)):
        model, plan = _two_stage(cluster)
        cost = CostModel(model, cluster)
        times[name] = (simulate(plan, cost, SimOptions(trace=False)).metrics.iteration_time_s,
                       estimate(plan, cost).iteration_time_s)
    assert times["linked"] == pytest.approx(times["plain"], rel=1e-9)
    # and the path matters: without it the stages talk over 10 Gbit/s at 1 ms
    model, plan = _two_stage(load_cluster(regions_doc(links=[])))
    fast = simulate(plan, CostModel(model, plan.cluster), SimOptions(trace=False))
    assert fast.metrics.iteration_time_s < 0.5 * times["linked"][0]


def test_ring_all_reduce_over_a_slow_pair_takes_its_closed_form():
    """Three single-device nodes a0, a1 (eu) and b0 (us): the ring a0 -> a1 -> b0 -> a0
    crosses eu-us twice; every step waits for its slowest edge, so B bytes take
    2(n-1)/n · B / WAN_BW + 2(n-1) · WAN_LAT (n = 3)."""
    c = load_cluster(regions_doc())
    model = synthetic_model(2, fwd_flops_per_sample=1e9)
    nbytes = 3e8
    got = CostModel(model, c).allreduce_time_s(("a0/0", "a1/0", "b0/0"), nbytes)
    assert got == pytest.approx(2 * 2 / 3 * nbytes / WAN_BW + 2 * 2 * WAN_LAT, rel=1e-9)
    # inside eu alone: the NICs
    inside = CostModel(model, c).allreduce_time_s(("a0/0", "a1/0"), nbytes)
    assert inside == pytest.approx(2 * 1 / 2 * nbytes / 1.25e9 + 2 * 1 * 1e-3, rel=1e-9)


def test_the_search_tells_the_regions_apart_and_failures_drop_their_paths():
    c = load_cluster(regions_doc())
    classes = device_classes(c)
    assert sorted(cls.nodes for cls in classes.values()) == [("a0", "a1"), ("b0", "b1")]
    # without `links`, regions change nothing: one class
    assert len(device_classes(load_cluster(regions_doc(links=[])))) == 1
    # a node's own region goes with it, and the paths that named it
    doc = regions_doc(links=[{"between": ["eu", "z"], "bandwidth": WAN_BW}])
    doc["nodes"].append({"name": "z", "device": "unit", "count": 1})
    smaller = without_node(load_cluster(doc), "z")
    assert smaller.links == {} and [n.name for n in smaller.nodes] == ["a0", "a1", "b0", "b1"]
    kept = without_node(load_cluster(regions_doc()), "b0")
    assert kept.path("a0/0", "b1/0").link.latency_s == pytest.approx(WAN_LAT)


def test_only_regions_a_path_names_split_classes():
    """One link between one of sixteen identical nodes and a seventeenth: the fifteen
    others stay one device class (a node without a `region` is its own region, and keying
    every such node by it made seventeen classes: the search ran out of memory)."""
    doc = {"name": "many", "nodes": [
        {"name": "g", "device": "A100-80GB", "count": 8, "repeat": 16},
        {"name": "far", "device": "A100-80GB", "count": 8}],
        "links": [{"between": ["g0", "far"], "bandwidth": "1 Gbit/s", "latency": "30 ms"}]}
    classes = device_classes(load_cluster(doc))
    assert sorted(len(cls.nodes) for cls in classes.values()) == [1, 1, 15]


def test_sweeps_that_take_nodes_out_take_their_paths_with_them(tmp_path, capsys):
    """`whatif --vary nodes.b.count=0` and `--pool` leave out node b; the path naming b
    goes with it (it was refused: 'links[0].between: expected names of regions')."""
    import json

    from hyperpipe.cli import main
    doc = {"name": "two", "nodes": [{"name": "a", "device": "A100-80GB", "count": 1},
                                    {"name": "b", "device": "V100-32GB", "count": 1}],
           "links": [{"between": ["a", "b"], "bandwidth": "1 Gbit/s", "latency": "20 ms"}]}
    path = tmp_path / "two.json"
    path.write_text(json.dumps(doc))
    base = ["whatif", "--cluster", str(path), "--model", "tiny-gpt", "--global-batch", "8",
            "--workers", "1", "--json"]
    for extra in (["--vary", "nodes.b.count=0,1"], ["--pool"]):
        assert main(base + extra) == 0, capsys.readouterr().err
        rows = json.loads(capsys.readouterr().out)
        assert rows


def test_what_if_sweeps_reach_the_paths_and_nic_latency():
    """`--vary links.I.bandwidth` / `.latency` and `nodes.N.nics.latency` are paths of
    the cluster format (they were refused as unknown keys); a position past the paths is
    refused naming how many there are; the value lands in the document."""
    from hyperpipe.whatif.sweep import set_path
    from hyperpipe.whatif.vary_paths import check_vary
    doc = regions_doc()
    check_vary("links.0.bandwidth", ["1 Gbit/s", "10 Gbit/s"], doc)
    check_vary("links.0.latency", ["10 ms"], doc)
    check_vary("nodes.a.nics.latency", ["1 ms"], doc)
    with pytest.raises(BadInput, match=r"vary links.1.bandwidth: expected a position among "
                                       r"the 1 paths"):
        check_vary("links.1.bandwidth", ["1 Gbit/s"], doc)
    with pytest.raises(BadInput, match=r"vary links.0.between"):
        check_vary("links.0.between", ["x"], doc)
    set_path(doc, "links.0.bandwidth", "10 Gbit/s")
    assert load_cluster(doc).path("a0/0", "b0/0").link.bandwidth_bytes_per_s == \
        pytest.approx(1.25e9)


def test_a_sweep_keeps_each_path_on_its_nodes_when_nodes_have_no_names():
    """Three unnamed nodes (n0 A100, n1 V100, n2 T4), a fast n0-n1 path and a slow n1-n2
    one. Taking n0 out (count 0) or sweeping device subsets renamed the others (the V100
    became n0) and the paths landed on the wrong pairs: V100-T4 read 100 Gbit/s. Names
    are written out before any node leaves."""
    from hyperpipe.whatif.sweep import _variants
    doc = {"name": "three", "nodes": [{"device": "A100-80GB", "count": 1},
                                      {"device": "V100-32GB", "count": 1},
                                      {"device": "T4", "count": 1}],
           "links": [{"between": ["n0", "n1"], "bandwidth": "100 Gbit/s", "latency": "1 us"},
                     {"between": ["n1", "n2"], "bandwidth": "1 Mbit/s",
                      "latency": "500 ms"}]}
    cluster = load_cluster(doc)
    model = synthetic_model(2, fwd_flops_per_sample=1e9)
    seen = 0
    for vary, pool in ((("nodes.0.count=0,1",), False), ((), True)):
        for _, _, variant, _ in _variants(model, "m", cluster, 8, vary, pool):
            if variant is None:
                continue
            names = {n.device_type: n.name for n in variant.nodes}
            if {"V100-32GB", "T4"} <= set(names):
                route = variant.path(f"{names['V100-32GB']}/0", f"{names['T4']}/0")
                assert route.link.bandwidth_bytes_per_s == pytest.approx(1e6 / 8)
                assert route.link.latency_s == pytest.approx(0.5)
                seen += 1
            if "V100-32GB" not in names:
                assert variant.links == {}
    assert seen >= 3
