"""Small-model physics of the catalog's parts: kernel floors, a power-limited part's
sustained rate, each against a closed form."""

from __future__ import annotations

import pytest

from hyperpipe.cluster.catalog import KERNEL_FLOOR_S, builtin_device_types
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models.ops import Gemm, PassWork
from hyperpipe.sim.compute import gemm_time_s, pass_time_s


def test_a_tiny_gemm_takes_one_kernel_floor():
    dev = builtin_device_types()["H100-SXM"]
    assert gemm_time_s(dev, 8, 8, 8, 1, 2, "bf16") == KERNEL_FLOOR_S


def test_a_pass_of_tiny_gemms_costs_a_floor_each_plus_its_memory_traffic():
    dev = builtin_device_types()["A100-80GB"]
    work = PassWork((Gemm(16, 16, 16),) * 5, mem_bytes=2e6)
    assert pass_time_s(dev, work, 2, "bf16") == pytest.approx(
        5 * KERNEL_FLOOR_S + 2e6 / (dev.mem_bandwidth_bytes_per_s * dev.mem_efficiency))


def test_large_gemms_are_not_held_by_the_floor():
    dev = builtin_device_types()["A100-80GB"]
    m = n = k = 8192
    assert gemm_time_s(dev, m, n, k, 1, 2, "bf16") == pytest.approx(
        2 * m * n * k / (312e12 * dev.gemm.efficiency(m, n, k)))


def test_t4_sustains_its_power_capped_rate_not_its_boost_peak():
    """The 70 W T4 ran cuBLAS FP16 4096^3 at about 24 of its 65 TFLOP/s: the catalog's
    curve passes through that point, so the closed form is 2 * 4096^3 / 24e12."""
    t4 = builtin_device_types()["T4"]
    assert gemm_time_s(t4, 4096, 4096, 4096, 1, 2, "fp16") == pytest.approx(
        2 * 4096**3 / 24e12)
    assert t4.gemm.ceiling < 0.4


def test_file_defined_types_have_no_floor():
    c = load_cluster({"device_types": {"u": {"peak_flops": "1 TFLOP/s", "memory": "8 GB"}},
                      "nodes": [{"name": "n", "device": "u", "count": 1}]})
    assert c.device_types["u"].kernel_floor_s == 0.0
