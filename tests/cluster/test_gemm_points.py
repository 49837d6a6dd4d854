"""The catalog's GEMM measurements, pinned to the shapes their sources printed.

Convention: a `GemmCurve.at` is (M, N, K) with K the reduction dimension, C[M,N] =
A[M,K] B[K,N]. The sources print three numbers their own way:

* stas00/ml-engineering's original mamf-finder.py (the v1 "Maximum Achievable Matmul
  FLOPS comparison table" in compute/accelerator/README.md) printed "MxNxK" with
  A = randn(m, n), B = randn(n, k): the MIDDLE number is the reduction. The README later
  re-printed the same measurements with the reduction last (A100 SXM 267.9 @
  6912x2048x16384 where v1 read 6912x16384x2048), which this test uses as the oracle.
* mag-/gpu_benchmark's mamf-finder.py (README "Stats") keeps A = randn(m, n),
  B = randn(n, k): the middle number is the reduction.
* The T4's point is a square 4096^3 cuBLAS run (NVIDIA Developer Forums).
"""

from __future__ import annotations

import pytest

from hyperpipe.cluster.catalog import builtin_device_types, shape_from_printed

# device -> (TFLOP/s, peak TFLOP/s the fraction is of, shape as the source printed it,
# index of the reduction in that string, the same shape written (M, N, K) by hand from
# the source's code, independently of `shape_from_printed`)
SOURCES = {
    "A100-80GB": (267.9, 312, "6912x16384x2048", 1, (6912, 2048, 16384)),
    "A100-40GB": (267.9, 312, "6912x16384x2048", 1, (6912, 2048, 16384)),
    "H100-SXM": (792.1, 989, "6144x17920x2816", 1, (6144, 2816, 17920)),
    "MI250X": (147.0, 191.5, "1024x14080x19968", 1, (1024, 19968, 14080)),
    "MI300X": (781.9, 1300, "4096x10240x4864", 1, (4096, 4864, 10240)),
    "L4": (91.4, 121, "1024x6016x1792", 1, (1024, 1792, 6016)),
    "RTX-3090": (78.0, 71, "5248x15040x1024", 1, (5248, 1024, 15040)),
    "RTX-4090": (178.8, 165.2, "14336x4096x4096", 1, (14336, 4096, 4096)),
    "A6000": (131.2, 154.8, "9856x12480x13248", 1, (9856, 13248, 12480)),
    "L40S": (252.0, 362.05, "4416x3776x3072", 1, (4416, 3072, 3776)),
    "T4": (24, 65, "4096x4096x4096", 2, (4096, 4096, 4096)),
}
# the export parts are their base silicon, measured once
SOURCES["A800-80GB"], SOURCES["H800"] = SOURCES["A100-80GB"], SOURCES["H100-SXM"]
# The later README's re-print of the v1 table, reduction LAST (K of MxNxK).
REPRINTED_K_LAST = {"A100-80GB": "6912x2048x16384", "H100-SXM": "6144x2816x17920",
                    "MI250X": "1024x19968x14080", "MI300X": "4096x4864x10240"}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_catalog_point_is_the_source_shape_with_k_the_reduction(name):
    tflops, peak, printed, reduction_at, mnk = SOURCES[name]
    curve = builtin_device_types()[name].gemm
    assert curve.printed == printed
    assert curve.reduction_at == reduction_at
    assert curve.at == mnk
    # the measured fraction is the printed rate over the peak, times the stated
    # sustained/burst factor (1 where the source measured the sustained rate)
    assert curve.measured == pytest.approx(tflops / peak * curve.sustained_scale)


@pytest.mark.parametrize("name", sorted(REPRINTED_K_LAST))
def test_v1_points_agree_with_the_reprint_that_puts_k_last(name):
    curve = builtin_device_types()[name].gemm
    assert shape_from_printed(REPRINTED_K_LAST[name], 2) == curve.at


def test_every_measured_point_is_pinned_here():
    measured = {n for n, d in builtin_device_types().items()
                if d.gemm is not None and d.gemm.printed}
    assert measured == set(SOURCES)


def test_shape_from_printed_moves_only_the_reduction():
    assert shape_from_printed("1x2x3", 0) == (2, 3, 1)
    assert shape_from_printed("1x2x3", 1) == (1, 3, 2)
    assert shape_from_printed("1x2x3", 2) == (1, 2, 3)
    with pytest.raises(ValueError):
        shape_from_printed("1x2", 1)


def test_a_best_of_search_point_bounds_the_whole_search():
    """No shape of the search box runs faster than the best the search printed: the
    curve stays at or below the measurement up to `search_max` (for every catalog curve
    built from a best-of-search point)."""
    for name, d in builtin_device_types().items():
        curve = d.gemm
        if curve is None or curve.search_max is None:
            continue
        top = curve.search_max
        for shape in (top, curve.at, (top[0], top[1], curve.at[2])):
            assert curve.efficiency(*shape) <= curve.measured * (1 + 1e-12), name
