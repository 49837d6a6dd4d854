"""Analytic compute time of one layer's pass on one device, op by op.

Owns the shape-dependent part of the cost model: each GEMM of the pass
(`hyperpipe.models.ops`) takes the larger of its FLOPs over the peak of the model's
dtype (`DeviceType.peak_for`: an fp32 model runs at the fp32 rate, not the fp16 tensor
rate) times the device's `GemmCurve` efficiency at its (M, N, K), and its operand bytes
over the achievable memory bandwidth (thin GEMMs are memory-bound), and at least the
device's `kernel_floor_s` (a kernel's launch); the memory-bound kernels' bytes over the
achievable memory bandwidth are ADDED (they run between the GEMMs, not under them).

Devices without a GEMM curve, and layers without shapes (synthetic), keep the flat
roofline: max(FLOPs / (peak · efficiency), bytes / bandwidth), every FLOP at the
model dtype's peak (an fp8 model's attention core too: the flat path has no GEMMs to
tell apart). A calibration profile,
when present, overrides all of this in `CostModel`. Every function here is pure.
"""

from __future__ import annotations

from hyperpipe.cluster.catalog import DeviceType
from hyperpipe.models.ops import PassWork
from hyperpipe.models.spec import STORAGE_DTYPES


def gemm_time_s(dev: DeviceType, m: float, n: float, k: float, batch: float,
                dtype_bytes: int, dtype: str | None = None) -> float:
    """Seconds of one (batched) GEMM on `dev` in `dtype` (None: the fp16/bf16 headline
    peak): compute at the dtype's curve's efficiency (`DeviceType.gemm_for`: fp32 on
    CUDA cores has its own), or its operand traffic at the achievable bandwidth,
    whichever is longer, and never less than one kernel's floor."""
    flops = 2.0 * m * n * k * batch
    curve = dev.gemm_for(dtype)
    eff = curve.efficiency(m, n, k, batch) if curve is not None else dev.efficiency
    peak = dev.peak_flops if dtype is None else dev.peak_for(dtype)
    io = (m * k + k * n + m * n) * batch * dtype_bytes
    return max(flops / (peak * eff), io / dev.achievable_mem_bandwidth_bytes_per_s,
               dev.kernel_floor_s)


def gemm_dtype(dtype: str | None, linear: bool) -> str | None:
    """The dtype a GEMM of a model in `dtype` multiplies in: an fp8 model's linear
    layers in fp8 and its other GEMMs (`models.ops.Gemm.linear`) in its storage dtype
    (bf16); any other model's all in its dtype."""
    return STORAGE_DTYPES["fp8"] if dtype == "fp8" and not linear else dtype


def pass_time_s(dev: DeviceType, work: PassWork, dtype_bytes: int,
                dtype: str | None = None) -> float:
    """Seconds of one pass: its GEMMs one after another (each in its `gemm_dtype`, an
    fp8 GEMM's operands 1 byte each where the part computes in fp8), plus its
    memory-bound bytes."""
    t = 0.0
    for g in work.gemms:
        in_dtype = gemm_dtype(dtype, g.linear)
        fp8 = in_dtype is not None and dev.computes_in(in_dtype) == "fp8"
        t += gemm_time_s(dev, g.m, g.n, g.k, g.batch, 1 if fp8 else dtype_bytes, in_dtype)
    return t + work.mem_bytes / dev.achievable_mem_bandwidth_bytes_per_s


__all__ = ["gemm_dtype", "gemm_time_s", "pass_time_s"]
