"""fp32 GEMMs on CUDA cores: each catalog part's curve through its measured SGEMM rate.

Oracle: the TFLOP/s printed by zzc0721/torch-performance-test-data (square torch.mm,
TF32 off, best of 1024..10240), copied here by hand from its database.md and issues;
at the search's largest size the catalog must price an fp32 GEMM at exactly that rate
(the A100 80GB's 98.4% of peak a hair under: a curve's ceiling is at most 1), and at
no size of the search above it.
"""

from __future__ import annotations

import statistics

import pytest

from hyperpipe.cluster.catalog import UNMEASURED_SIMT_FRACTION, builtin_device_types
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.sim.compute import gemm_time_s

# part -> (measured TFLOP/s, square size of the best run, fp32 peak of the datasheet)
MEASURED = {
    "V100-32GB": (14.51, 10240, 15.7),
    "T4": (4.30, 10240, 8.1),                 # median of 4.17 and 4.43
    "RTX-2080Ti": (12.28, 8192, 13.4),        # median of 13.04 and 11.52, both @ 8192
    "Titan-RTX": (11.91, 4096, 16.3),
    "RTX-3090": (24.79, 10240, 35.6),
    "RTX-4090": (54.72, 10240, 82.6),
    "A100-40GB": (18.11, 10240, 19.5),
    "A100-80GB": (19.18, 10240, 19.5),
    "H100-SXM": (52.11, 10240, 67),
    "H200": (51.34, 10240, 67),
    "L40S": (46.88, 10240, 91.6),
    "A6000": (23.92, 10240, 38.7),
    "A40": (23.73, 8192, 37.4),
}


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_fp32_gemm_at_the_largest_size_of_the_search_runs_at_the_best_rate(name):
    """No size of the search ran faster than its best, so the curve reaches the best
    rate at the search's largest size (10240^3) and stays under it below."""
    tflops, _, _ = MEASURED[name]
    dev = builtin_device_types()[name]
    t = gemm_time_s(dev, 10240, 10240, 10240, 1, 4, "fp32")
    assert 2 * 10240**3 / t / 1e12 == pytest.approx(tflops, rel=5e-3)


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_no_size_of_the_search_runs_faster_than_its_best(name):
    tflops, _, _ = MEASURED[name]
    dev = builtin_device_types()[name]
    for size in (1024, 2048, 4096, 8192, 10240):
        t = gemm_time_s(dev, size, size, size, 1, 4, "fp32")
        assert 2 * size**3 / t / 1e12 <= tflops * (1 + 2e-3)


def test_unmeasured_parts_take_the_median_measured_fraction():
    fractions = [t / peak for t, _, peak in MEASURED.values()]
    assert UNMEASURED_SIMT_FRACTION == pytest.approx(statistics.median(fractions), abs=1e-3)
    for name in ("A10", "L4", "H100-PCIe"):
        assert builtin_device_types()[name].simt_gemm.measured == UNMEASURED_SIMT_FRACTION


def test_tensor_dtypes_keep_the_tensor_curve_and_amd_fp32_runs_on_matrix_cores():
    types = builtin_device_types()
    v100 = types["V100-32GB"]
    assert v100.gemm_for("fp16") is v100.gemm is v100.gemm_for(None)
    assert v100.gemm_for("fp32") is v100.simt_gemm
    a100 = types["A100-80GB"]
    assert a100.gemm_for("tf32") is a100.gemm       # TF32 is a tensor-core dtype
    for name in ("MI250X", "MI300X"):
        assert types[name].simt_gemm is None
        assert types[name].gemm_for("fp32") is types[name].gemm


def test_fp32_on_a_v100_is_faster_than_the_tensor_curve_made_it_and_3090_slower():
    """The old pricing (the tensor curve's fraction on the fp32 peak) was 25% slow on a
    V100 (0.70 of 15.7 against a measured 14.51) and 35% fast on an RTX 3090 (its
    tensor curve sits near 0.94; the CUDA cores reach 0.70)."""
    types = builtin_device_types()
    n = 8192
    for name, faster in (("V100-32GB", True), ("RTX-3090", False)):
        dev = types[name]
        old = 2 * n**3 / (dev.peak_for("fp32") * dev.gemm.efficiency(n, n, n))
        new = gemm_time_s(dev, n, n, n, 1, 4, "fp32")
        assert (new < 0.85 * old) if faster else (new > 1.2 * old)


def test_a_file_type_with_a_flat_efficiency_drops_both_curves():
    cluster = load_cluster({"device_types": {"slow": {"base": "V100-32GB",
                                                       "efficiency": 0.5}},
                            "nodes": [{"name": "n", "device": "slow", "count": 1}]})
    dev = cluster.device_types["slow"]
    assert dev.gemm is None and dev.simt_gemm is None
    t = gemm_time_s(dev, 8192, 8192, 8192, 1, 4, "fp32")
    assert t == pytest.approx(2 * 8192**3 / (15.7e12 * 0.5))
