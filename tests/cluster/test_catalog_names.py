"""Catalog names as users spell them, and the parts added after the first catalog
(P100, A30, RTX A5000/A4000, RTX 3080/4080, A800, H800; the PCIe V100s and A100s, Quadro
RTX 6000/8000, Titan V)."""

from __future__ import annotations

import pytest

from hyperpipe.cluster.catalog import (
    DRIVER_NAMES,
    SIMT_TILE_AREA,
    UNMEASURED_SIMT_FRACTION,
    builtin_device_types,
    catalog_name,
)
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput

NAMES = sorted(builtin_device_types())


@pytest.mark.parametrize("spelled, name", [
    ("T4", "T4"), ("Tesla T4", "T4"), ("NVIDIA Tesla T4", "T4"), ("t4", "T4"),
    ("a100 80gb", "A100-80GB"), ("NVIDIA A100-80GB", "A100-80GB"),
    ("RTX A6000", "A6000"), ("NVIDIA RTX A5000", "A5000"),
    ("GeForce RTX 3090", "RTX-3090"), ("rtx 2080 ti", "RTX-2080Ti"),
    ("TITAN RTX", "Titan-RTX"), ("Tesla V100-32GB", "V100-32GB"),
    ("AMD Instinct MI250X", "MI250X"), ("h800", "H800"),
    # as the driver names them (nvidia-smi, torch.cuda.get_device_name())
    ("Tesla V100-SXM2-16GB", "V100-16GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA H100 80GB HBM3", "H100-SXM"),
    ("NVIDIA H100 PCIe", "H100-PCIe"), ("Tesla P100-PCIE-16GB", "P100-16GB"),
    ("NVIDIA A800-SXM4-80GB", "A800-80GB"), ("Tesla V100-PCIE-16GB", "V100-PCIe-16GB"),
    ("Tesla V100-PCIE-32GB", "V100-PCIe-32GB"), ("NVIDIA A100-PCIE-40GB", "A100-PCIe-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-PCIe-80GB"), ("Quadro RTX 6000", "Quadro-RTX-6000"),
    ("Quadro RTX 8000", "Quadro-RTX-8000"), ("NVIDIA TITAN V", "Titan-V"),
])
def test_spellings_find_the_one_part(spelled, name):
    assert catalog_name(spelled, NAMES) == name


@pytest.mark.parametrize("spelled", ["V100", "H100", "A100", "RTX", "", "T4x"])
def test_names_that_do_not_tell_parts_apart_find_none(spelled):
    assert catalog_name(spelled, NAMES) is None


def test_every_driver_name_is_a_catalog_part():
    assert set(DRIVER_NAMES.values()) <= set(NAMES)
    # each resolves to its part, and none is how a catalog name itself is spelled
    assert all(catalog_name(k, NAMES) == part for k, part in DRIVER_NAMES.items())
    assert not set(DRIVER_NAMES) & {n.lower().replace("-", "") for n in NAMES}


def test_an_exact_name_wins_over_a_spelling():
    # a user type that spells like a catalog part but is named exactly is itself
    assert catalog_name("t4", ["T4", "t4"]) == "t4"
    assert catalog_name("T 4", ["T4", "t4"]) is None        # two spell alike: neither


def test_a_cluster_file_may_spell_its_devices(tmp_path):
    doc = {"device_types": {"slow": {"base": "tesla v100-32gb", "efficiency": 0.3}},
           "nodes": [{"name": "a", "device": "NVIDIA Tesla T4", "count": 2},
                     {"name": "b", "device": "RTX A5000", "count": 2},
                     {"name": "c", "device": "slow", "count": 1}],
           "inter_node": {"bandwidth": "10 Gbit/s"}}
    cluster = load_cluster(doc)
    types = [d.type for d in cluster.devices]
    assert [t.name for t in types] == ["T4", "T4", "A5000", "A5000", "slow"]
    catalog = builtin_device_types()
    assert types[0] == catalog["T4"]
    assert types[4].memory_bytes == catalog["V100-32GB"].memory_bytes
    assert types[4].efficiency == 0.3


def test_an_ambiguous_device_is_refused_with_the_names():
    doc = {"nodes": [{"name": "a", "device": "V100", "count": 2}]}
    with pytest.raises(BadInput) as err:
        load_cluster(doc)
    assert "nodes[0].device" in str(err.value) and "V100-16GB" in str(err.value)


def test_export_parts_are_their_base_silicon_with_less_nvlink():
    types = builtin_device_types()
    for part, base in (("A800-80GB", "A100-80GB"), ("H800", "H100-SXM")):
        p, b = types[part], types[base]
        assert p.gemm is b.gemm and p.simt_gemm.measured == b.simt_gemm.measured
        assert p.peaks == b.peaks and p.memory_bytes == b.memory_bytes
        assert p.mem_bandwidth_bytes_per_s == b.mem_bandwidth_bytes_per_s
        assert p.link_bandwidth_bytes_per_s == 200e9 < b.link_bandwidth_bytes_per_s


def test_the_h800_cluster_file_agrees_with_the_catalog_h800():
    h800 = load_cluster("h800-2048").devices[0].type
    part = builtin_device_types()["H800"]
    assert h800.link_bandwidth_bytes_per_s == part.link_bandwidth_bytes_per_s
    assert h800.gemm is part.gemm and h800.peaks == part.peaks
    assert h800.nvlink_sharp == part.nvlink_sharp


def test_the_p100_has_no_tensor_cores_so_fp16_runs_on_the_cuda_core_curve():
    p100 = builtin_device_types()["P100-16GB"]
    fp16 = p100.gemm_for("fp16")
    assert fp16.tile_area == SIMT_TILE_AREA and fp16.measured == UNMEASURED_SIMT_FRACTION
    assert p100.peak_for("fp16") == pytest.approx(2 * p100.peak_for("fp32"), rel=0.01)
    assert p100.peer_to_peer
