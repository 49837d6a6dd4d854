"""The T4's usable memory and streaming bandwidth, pinned to the public figures they come
from (hyperpipe.cluster.catalog): PyTorch's "14.75 GiB total capacity" on a T4 with ECC,
and 226, 234 and 242 GB/s measured for streaming kernels on Colab T4s."""

from __future__ import annotations

import pytest

from hyperpipe.cluster.catalog import builtin_device_types
from hyperpipe.models.ops import PassWork
from hyperpipe.sim.compute import pass_time_s


def test_t4_capacity_is_what_cuda_reports():
    t4 = builtin_device_types()["T4"]
    assert t4.memory_bytes == pytest.approx(14.75 * 1024**3)
    assert t4.memory_bytes < 16e9          # the board's 16 GB, less what ECC holds back


@pytest.mark.parametrize("nbytes", [1e6, 3.3e8])
def test_t4_memory_bound_work_runs_at_the_measured_streaming_rate(nbytes):
    t4 = builtin_device_types()["T4"]
    measured_bytes_per_s = (226e9 + 234e9 + 242e9) / 3
    assert pass_time_s(t4, PassWork((), nbytes), 2, "fp16") == \
        pytest.approx(nbytes / measured_bytes_per_s)


def test_other_parts_keep_the_hbm_streaming_fraction():
    types = builtin_device_types()
    assert types["T4"].mem_efficiency < types["A100-80GB"].mem_efficiency == 0.9
