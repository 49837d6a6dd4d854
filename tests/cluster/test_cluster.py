"""The device catalog and clusters: sources, built-in clusters, files, routes, rejection."""

from __future__ import annotations

import pytest

from hyperpipe.cluster.catalog import builtin_device_types
from hyperpipe.cluster.cluster import (
    builtin_cluster_names,
    cluster_from_dict,
    links_among,
    load_cluster,
    with_node_names,
)
from hyperpipe.core.errors import BadInput


def test_catalog_entries_have_sources_and_sane_values():
    catalog = builtin_device_types()
    for name in ("V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe",
                 "H200", "L4", "T4", "A10", "RTX-3090", "RTX-4090", "MI250X", "MI300X"):
        d = catalog[name]
        assert d.source and "datasheet" in d.source or "whitepaper" in d.source
        assert 10e12 < d.peak_flops < 2e15
        assert 8e9 <= d.memory_bytes <= 192 * 2**30
        assert 0 < d.efficiency <= 1
    assert catalog["A100-80GB"].peak_flops / catalog["V100-32GB"].peak_flops == \
        pytest.approx(312 / 125)


def test_node_prices_take_units():
    c = cluster_from_dict({"nodes": [{"name": "n", "device": "T4", "count": 1,
                                      "price_per_hour": "0.35 $/h"}]}, where="x", name="x")
    assert c.price_per_hour("n/0") == pytest.approx(0.35)


def test_builtin_clusters_load():
    names = builtin_cluster_names()
    assert {"demo-hetero", "a100-v100", "h100-a100-l4", "scale-1024"} <= set(names)
    sizes = {n: len(load_cluster(n).devices) for n in names}
    assert sizes["scale-1024"] == 1024
    assert len({d.type.name for d in load_cluster("scale-1024").devices}) == 4
    assert len({d.type.name for d in load_cluster("h100-a100-l4").devices}) == 3


def test_cluster_file_and_paths(tmp_path):
    doc = tmp_path / "c.yaml"
    doc.write_text("""
device_types:
  fast: {peak_flops: "1 TFLOP/s", efficiency: 1.0, memory: "80 GB"}
nodes:
  - {name: n0, device: A100-80GB, count: 8, intra_link: {bandwidth: "600 GB/s", latency: "2 us"}}
  - {name: n1, device: fast, count: 2}
inter_node: {bandwidth: "100 Gbit/s", latency: "5 us"}
""")
    c = load_cluster(str(doc))
    assert [d.name for d in c.devices][:2] == ["n0/0", "n0/1"]
    assert c.device("n1/1").type.peak_flops == 1e12
    assert c.device("n1/1").type.achievable_flops == 1e12
    intra = c.path("n0/0", "n0/3")
    assert [h.name for h in intra.hops] == ["n0/0:out", "n0/3:in"]
    assert intra.time_s(600e9) == pytest.approx(1 + 2e-6)
    inter = c.path("n0/0", "n1/0")
    assert [h.name for h in inter.hops] == ["n0:nic-out", "n1:nic-in"]
    assert inter.time_s(12.5e9) == pytest.approx(1 + 5e-6)
    assert c.path("n0/1", "n0/1").time_s(1e9) == 0.0


def _cluster(**over):
    doc = {"nodes": [{"name": "n0", "device": "A100-80GB", "count": 2}]}
    doc.update(over)
    return doc


@pytest.mark.parametrize("doc,field", [
    ({"nodes": []}, "nodes"),
    ({"nodes": [{"device": "B200X", "count": 2}]}, "nodes[0].device"),
    ({"nodes": [{"device": "A100-80GB", "count": -2}]}, "nodes[0].count"),
    ({"nodes": [{"device": "A100-80GB", "count": "two"}]}, "nodes[0].count"),
    ({"nodes": [{"device": "A100-80GB", "count": 2, "colour": "red"}]}, "nodes[0].colour"),
    (_cluster(inter_node={"bandwidth": "fast"}), "inter_node.bandwidth"),
    (_cluster(inter_node={"bandwidth": "10 GB"}), "inter_node.bandwidth"),
    (_cluster(device_types={"x": {"memory": "8 GB"}}), "device_types.x.peak_flops"),
    (_cluster(device_types={"x": {"peak_flops": "1 TFLOP/s", "memory": "8 GB",
                                  "efficiency": 1.5}}), "device_types.x.efficiency"),
    ({"nodes": [{"name": "a", "device": "T4", "count": 1},
                {"name": "a", "device": "T4", "count": 1}]}, "nodes[1].name"),
    ([1, 2], "c.yaml"),
])
def test_cluster_rejects(doc, field):
    with pytest.raises(BadInput) as err:
        cluster_from_dict(doc, where="c.yaml", name="c")
    assert field in str(err.value)



def test_catalog_memory_is_the_datasheet_size_in_gib_less_ecc_on_gddr():
    """A "16 GB" part holds 16 GiB; GDDR parts sold with ECC on give a 16th of it to the
    ECC bits (NVIDIA's CUDA C++ Best Practices Guide: "reduced by 6.25%"); the T4
    carries what CUDA reports on it (14.75 GiB)."""
    catalog = builtin_device_types()
    gib = 2**30
    for name, size in (("V100-16GB", 16), ("A100-40GB", 40), ("A100-80GB", 80),
                       ("H100-SXM", 80), ("RTX-3090", 24), ("RTX-3080", 10),
                       ("A6000", 48), ("MI300X", 192), ("V100-PCIe-32GB", 32),
                       ("A100-PCIe-80GB", 80), ("Quadro-RTX-8000", 48), ("Titan-V", 12)):
        assert catalog[name].memory_bytes == size * gib, name
    for name, size in (("A10", 24), ("L4", 24), ("A40", 48), ("L40S", 48)):
        assert catalog[name].memory_bytes == size * gib * 15 / 16, name
    assert catalog["T4"].memory_bytes == 14.75 * gib
    assert catalog["V100-16GB"].memory_bytes > 16e9 * 1.07       # not decimal GB


@pytest.mark.parametrize("repeat", [2.0, "2e0"])
def test_repeat_written_as_a_whole_float_is_the_integer_everywhere(repeat):
    # `repeat` is read as `count` is (2.0 and YAML's 2e0 are 2); the document the
    # cluster keeps says 2 too, so what reads it again names the copies as the loader
    # did and keeps the paths between them
    doc = {"nodes": [{"device": "A100-80GB", "count": 1, "repeat": repeat},
                     {"device": "V100-32GB", "count": 2.0}],
           "links": [{"between": ["n00", "n01"], "bandwidth": "1 Gbit/s",
                      "latency": "10 ms"}]}
    c = cluster_from_dict(doc, where="c.yaml", name="c")
    assert [n.name for n in c.nodes] == ["n00", "n01", "n2"]
    assert c.source["nodes"][0]["repeat"] == 2 and c.source["nodes"][1]["count"] == 2
    assert [n["name"] for n in with_node_names(doc)["nodes"]] == ["n0", "n2"]
    assert links_among(doc)["links"] == doc["links"]
    again = cluster_from_dict(links_among(with_node_names(c.source)), where="c", name="c")
    assert again == c


@pytest.mark.parametrize("name", [[1], {"a": 1}, 5, ""])
def test_cluster_name_must_be_a_string(name):
    doc = {"name": name, "nodes": [{"device": "T4", "count": 1}]}
    with pytest.raises(BadInput, match="^c.yaml.name: expected a non-empty string"):
        cluster_from_dict(doc, where="c.yaml", name="c")
    assert cluster_from_dict({**doc, "name": "mine"}, where="c.yaml", name="c").name == "mine"


def test_a_device_type_named_by_a_number_is_refused_as_such():
    doc = {"device_types": {5: {"peak_flops": "1 TFLOP/s", "memory": "8 GB"}},
           "nodes": [{"device": "5", "count": 1}]}
    with pytest.raises(BadInput, match="^c.yaml.device_types.5: expected a device type "
                       "name \\(a string: quote it, '5'\\), got 5$"):
        cluster_from_dict(doc, where="c.yaml", name="c")
    doc["device_types"] = {"5": doc["device_types"][5]}
    assert cluster_from_dict(doc, where="c.yaml", name="c").device("n0/0").type.name == "5"


def test_plain_numbers_in_exponent_form_are_read_from_yaml(tmp_path):
    """YAML 1.1 reads `slowdown: 2e0` and `efficiency: 5e-1` as strings; they are the
    numbers, as `count: 2e0` is the integer (both had been refused: "expected a positive
    number ..., got '2e0'")."""
    path = tmp_path / "c.yaml"
    path.write_text("device_types:\n"
                    "  fast: {peak_flops: '1 TFLOP/s', efficiency: 5e-1, memory: '8 GB'}\n"
                    "nodes:\n"
                    "  - {name: n0, device: fast, count: 2e0, slowdown: 2e0}\n"
                    "  - {name: n1, device: fast, count: 2, slowdown: {1: 15e-1}}\n")
    c = load_cluster(str(path))
    assert c.device("n0/0").type.efficiency == 0.5
    assert [d.slowdown for d in c.devices] == [2.0, 2.0, 1.0, 1.5]
    path.write_text("nodes:\n  - {name: n0, device: T4, count: 2, slowdown: 5e-1}\n")
    with pytest.raises(BadInput, match=r"c\.yaml: nodes\[0\]\.slowdown: expected a positive "
                                       r"number of at least 1.*, got '5e-1'$"):
        load_cluster(str(path))


@pytest.mark.parametrize("key", ["a100-80gb", "a100 80gb", "NVIDIA A100-SXM4-80GB"])
def test_a_node_naming_a_part_a_device_type_key_spells_apart_is_refused(key):
    """A `device_types` key that spells a catalog part apart is a type of its own; a
    node naming the part itself is refused, naming both: the node had silently run the
    unmodified part. The exact name overrides the part."""
    doc = {"device_types": {key: {"peak_flops": "1 TFLOP/s", "memory": "8 GB"}},
           "nodes": [{"name": "n0", "device": "A100-80GB", "count": 2}]}
    with pytest.raises(BadInput, match=r"^c\.yaml: nodes\[0\]\.device: expected one "
                                       rf"reading of A100-80GB: device_types\.{key} spells"):
        cluster_from_dict(doc, where="c.yaml", name="c")
    doc["nodes"][0]["device"] = key                    # the node names the type itself
    dev = cluster_from_dict(doc, where="c.yaml", name="c").device("n0/0").type
    assert (dev.name, dev.peak_flops, dev.gemm) == (key, 1e12, None)
    doc["device_types"] = {"A100-80GB": {"peak_flops": "1 TFLOP/s", "memory": "8 GB"}}
    doc["nodes"][0]["device"] = "A100-80GB"
    dev = cluster_from_dict(doc, where="c.yaml", name="c").device("n0/0").type
    assert (dev.name, dev.peak_flops, dev.memory_bytes) == ("A100-80GB", 1e12, 8e9)


def test_a_new_type_named_apart_from_the_catalog_keeps_its_own_figures():
    doc = {"device_types": {"t4-like": {"peak_flops": "10 TFLOP/s", "memory": "16 GB"}},
           "nodes": [{"name": "n0", "device": "t4-like", "count": 1}]}
    dev = cluster_from_dict(doc, where="c.yaml", name="c").device("n0/0").type
    assert (dev.name, dev.peak_flops) == ("t4-like", 1e13)
    assert dev.gemm is None


def test_device_type_names_of_a_file_are_kept_as_written():
    # names of the file's own types are kept as written: two that differ in case are two
    doc = {"device_types": {t: {"peak_flops": "1 TFLOP/s", "memory": "8 GB"}
                            for t in ("fast", "FAST")},
           "nodes": [{"name": "n0", "device": "FAST", "count": 1}]}
    assert cluster_from_dict(doc, where="c.yaml", name="c").device("n0/0").type.name == "FAST"
