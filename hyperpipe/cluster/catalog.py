"""The built-in catalog of device types, from vendor spec sheets and public measurements.

Each entry gives peak *dense* FP16/BF16 tensor FLOP/s (no structured sparsity), memory,
memory bandwidth and the typical intra-node link, with the document it comes from, and
how fast real work runs on it, each figure from a public source and never fitted to the
benchmarks that report this simulator's accuracy:

* `gemm`: a `GemmCurve`, the fraction of peak a GEMM of shape (M, N, K) reaches;
* `mem_efficiency`: the fraction of memory bandwidth streaming kernels reach (the rate
  of memory-bound work: norms, softmax, dropout, activations, optimizer);
* `collective_efficiency` / `nic_efficiency`: NCCL all-reduce bus bandwidth over the
  nominal intra-node link / NIC bandwidth, from published nccl-tests runs.

Device types defined from scratch in a cluster file take their figures as achievable
(no curve, all fractions 1: the flat roofline with `efficiency`); a type based on a
catalog entry keeps its curve unless it sets `efficiency`.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_EFFICIENCY = 0.5  # why: Megatron-LM reports 40-52% of peak on A100 for GPT-3 sizes

# Device memory a training process holds besides its tensors, so that "fits" means fits
# on a real GPU. Fixed part: the CUDA context with cuBLAS/cuDNN handles, ~0.7-0.8 GB on
# recent GPUs (PyTorch forums, "What is the reason for pytorch's GPU memory floor?" and
# "High gpu memory overhead": ~700+ MB), plus NCCL buffers: NCCL_BUFFSIZE 4 MiB (NCCL
# environment variables docs) per channel and direction, up to 32 channels on NVLink
# systems, i.e. 256 MiB per communicator, and a rank joins about three (tensor, pipeline,
# data parallel): 0.8 GB. Proportional part: allocator fragmentation; the caching
# allocator's waste reaches tens of percent in the worst cases with recompute and
# interleaving (GMLake, Guo et al. ASPLOS 2024; STAlloc, arXiv 2507.16274); 5% is the low
# end that expandable segments leave (a modelling choice, not a fit).
RUNTIME_FIXED_BYTES = 0.8e9 + 0.8e9
FRAGMENTATION_FRACTION = 0.05

# Streaming kernels reach about 90% of the HBM bandwidth on NVIDIA data-centre parts
# (BabelStream triad on A100-40GB: ~1.4 of 1.555 TB/s; Deakin et al., "Evaluating the
# performance of HPC-style SYCL applications", and NVIDIA's bandwidthTest device-to-
# device copies report the same ~90%). Used for every device without its own figure.
DEFAULT_MEM_EFFICIENCY = 0.9

# nccl-tests all_reduce_perf on 8x A100-SXM4-80GB over NVSwitch: busbw ~200-208 GB/s for
# large messages against 300 GB/s per direction (NVIDIA/nccl-tests issues #149 and #178):
# 0.67. Used for every device without its own measurement.
DEFAULT_COLLECTIVE_EFFICIENCY = 0.67

# Inter-node: nccl-tests all_reduce_perf on 3 nodes of 8x A100 with 4x HDR 200 Gbit/s
# each reached 96 GB/s busbw at 128 MB against the 100 GB/s the NICs give (NVIDIA/
# nccl-tests issue #119): 0.96 of the NIC line rate for large messages.
NIC_COLLECTIVE_EFFICIENCY = 0.96

# Sustained over burst matmul rate: on H200 the power-saturated rate (MSMF) was 702.9
# TFLOP/s against a boost-clock burst (MAMF) of 828.0 on the same search (stas00/
# ml-engineering, compute/accelerator/benchmarks/README.md, "alone vs all-8
# concurrent"): 0.849. Training runs at the saturated clock, so burst-only (MAMF)
# figures below are scaled by it.
SUSTAINED_OVER_BURST = 702.9 / 828.0

# Median sustained large-GEMM fraction of the measured parts below (A100 0.73, H100
# 0.68, H200 0.71, MI250X 0.65, MI300X 0.60): the ceiling for parts without a public
# measurement.
UNMEASURED_GEMM_FRACTION = 0.68


@dataclass(frozen=True)
class GemmCurve:
    """Fraction of peak reached by a GEMM C[M,N] = A[M,K] B[K,N], from its shape.

    Model (NVIDIA, "Matrix Multiplication Background User's Guide", 2023, ch. 2-3):
    cuBLAS splits C into output tiles (typically 256x128 on A100) that run in waves of
    one tile per SM, and each tile loops over K after a fixed pipeline fill/drain.

    * wave fill: W = M·N / (tile_area · sms) waves; the last one is on average half
      empty (wave quantization averaged over sizes), so fill = W / (W + 1/2);
    * K depth: the fixed fill/drain of about `k_fill` elements of K per tile, so
      depth = K / (K + k_fill);
    * ceiling: efficiency = `ceiling` · fill · depth, monotone in every dimension and
      below `ceiling` <= 1.

    `ceiling` is set so that the curve passes through a published measurement:
    `measured` (fraction of peak) at the shape `at` (M, N, K), divided by the curve's
    fill · depth there. Batched GEMMs (attention) count M·N·batch towards the waves.
    """

    measured: float                      # sustained fraction of peak at shape `at`
    at: tuple[int, int, int]             # (M, N, K) of that measurement
    sms: int                             # streaming multiprocessors / compute units
    tile_area: int = 256 * 128           # output elements per tile (cuBLAS, A100)
    k_fill: int = 128                    # K elements of pipeline fill/drain per tile
    source: str = ""

    def _shape_factor(self, m: float, n: float, k: float, batch: float = 1) -> float:
        waves = m * n * batch / (self.tile_area * self.sms)
        return waves / (waves + 0.5) * k / (k + self.k_fill)

    @property
    def ceiling(self) -> float:
        """The large-GEMM asymptote (fraction of peak, at most 1)."""
        return min(1.0, self.measured / self._shape_factor(*self.at))

    def efficiency(self, m: float, n: float, k: float, batch: float = 1) -> float:
        """Fraction of peak FLOP/s for an (M, N, K) GEMM, `batch` of them at once."""
        if min(m, n, k, batch) <= 0:
            return self.ceiling
        return self.ceiling * self._shape_factor(m, n, k, batch)


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator. All quantities in SI base units."""

    name: str
    peak_flops: float                 # dense FP16/BF16 tensor FLOP/s
    memory_bytes: float
    mem_bandwidth_bytes_per_s: float
    efficiency: float = DEFAULT_EFFICIENCY
    link_bandwidth_bytes_per_s: float = 32e9   # typical intra-node link, per direction
    link_latency_s: float = 5e-6
    price_per_hour: float | None = None         # USD per device-hour, if known
    source: str = ""
    runtime_reserve_bytes: float = 0.0          # held by the runtime, not by tensors
    gemm: GemmCurve | None = None               # None: flat `efficiency` for all FLOPs
    mem_efficiency: float = DEFAULT_MEM_EFFICIENCY
    collective_efficiency: float = DEFAULT_COLLECTIVE_EFFICIENCY
    nic_efficiency: float = NIC_COLLECTIVE_EFFICIENCY   # collectives over the NICs

    @staticmethod
    def reserve_for(memory_bytes: float) -> float:
        """The catalog's runtime reserve of a GPU with `memory_bytes` of memory."""
        return RUNTIME_FIXED_BYTES + FRAGMENTATION_FRACTION * memory_bytes

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.efficiency

    @property
    def achievable_mem_bandwidth_bytes_per_s(self) -> float:
        return self.mem_bandwidth_bytes_per_s * self.mem_efficiency


def _d(name, tflops, mem_gb, bw_gbs, link_gbs, source, latency_us=2.0, gemm=None):
    return DeviceType(name=name, peak_flops=tflops * 1e12, memory_bytes=mem_gb * 1e9,
                      mem_bandwidth_bytes_per_s=bw_gbs * 1e9,
                      link_bandwidth_bytes_per_s=link_gbs * 1e9,
                      link_latency_s=latency_us * 1e-6, source=source, gemm=gemm,
                      runtime_reserve_bytes=DeviceType.reserve_for(mem_gb * 1e9))


_MAMF = ("stas00/ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul "
         "FLOPS comparison table' (BF16 torch.matmul, best shape of a search)")


def _burst(fraction: float, at: tuple[int, int, int], sms: int, note: str) -> GemmCurve:
    """A curve through a burst (MAMF) measurement, scaled to the sustained clock."""
    return GemmCurve(fraction * SUSTAINED_OVER_BURST, at, sms,
                     source=f"{_MAMF}: {note}; x{SUSTAINED_OVER_BURST:.3f} sustained/burst")


def _unmeasured(sms: int) -> GemmCurve:
    """No public GEMM measurement: the median measured ceiling at a large shape."""
    return GemmCurve(UNMEASURED_GEMM_FRACTION, (8192, 8192, 8192), sms,
                     source="no public measurement: median of the measured parts")


# SM / CU counts: NVIDIA Volta, Ampere (GA100, GA102), Ada, Hopper whitepapers; AMD CDNA2
# and CDNA3 whitepapers (MI250X: 110 CUs per GCD, MAMF measured on one GCD).
# Cross-check, not a fit: whole training steps on A100-80GB with FlashAttention
# reach 71-79% of peak in hardware FLOPs (MosaicML llm-foundry, scripts/train/benchmarking/
# README.md: 13B-70B with activation checkpointing, HFU 71.1-79.3%), so the large-GEMM
# ceiling this curve gives (~0.79) is not above what real kernels sustain.
_A100 = _burst(0.859, (6912, 16384, 2048), 108, "A100 SXM 267.9 of 312 TFLOP/s")
# H200: the sustained (MSMF) rate itself, 702.9 of 989 TFLOP/s (same source, "alone" row);
# its shape is not printed there, so a large one is assumed.
_H200 = GemmCurve(702.9 / 989, (8192, 8192, 8192), 132,
                  source=f"{_MAMF}: H200 MSMF 702.9 of 989 TFLOP/s (sustained)")
_MI250X = _burst(0.767, (1024, 14080, 19968), 110, "MI250X 147.0 of 191.5 TFLOP/s per GCD")
# MI300X reaches its power cap within one kernel (no boost burst, same source), so its
# MAMF is already the sustained rate.
_MI300X = GemmCurve(0.601, (4096, 10240, 4864), 304,
                    source=f"{_MAMF}: MI300X 781.9 of 1300 TFLOP/s (power-capped: sustained)")


# NVLink figures are total bidirectional in NVIDIA's sheets; we store one direction (half).
# PCIe figures: Gen3 x16 ~16 GB/s, Gen4 x16 ~32 GB/s, Gen5 x16 ~64 GB/s per direction.
_CATALOG: tuple[DeviceType, ...] = (
    _d("V100-16GB", 125, 16, 900, 150,
       "NVIDIA Tesla V100 datasheet (SXM2): 125 TFLOPS tensor, 900 GB/s HBM2, NVLink 300 GB/s",
       gemm=_unmeasured(80)),
    _d("V100-32GB", 125, 32, 900, 150,
       "NVIDIA Tesla V100 datasheet (SXM2 32GB): 125 TFLOPS tensor, 900 GB/s, NVLink 300 GB/s",
       gemm=_unmeasured(80)),
    _d("A100-40GB", 312, 40, 1555, 300,
       "NVIDIA A100 datasheet (SXM4 40GB): 312 TFLOPS BF16 dense, 1,555 GB/s, NVLink 600 GB/s",
       gemm=_A100),
    _d("A100-80GB", 312, 80, 2039, 300,
       "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS BF16 dense, 2,039 GB/s, NVLink 600 GB/s",
       gemm=_A100),
    _d("H100-SXM", 989, 80, 3350, 450,
       "NVIDIA H100 datasheet (SXM5): 989 TFLOPS BF16 dense (1,979 sparse), 3.35 TB/s, "
       "NVLink 900 GB/s",
       gemm=_burst(0.801, (6144, 17920, 2816), 132, "H100 SXM 792.1 of 989 TFLOP/s")),
    _d("H100-PCIe", 756, 80, 2000, 64,
       "NVIDIA H100 datasheet (PCIe): 756 TFLOPS BF16 dense (1,513 sparse), 2 TB/s, "
       "PCIe Gen5 128 GB/s", latency_us=5.0,
       gemm=_unmeasured(114)),
    _d("H200", 989, 141, 4800, 450,
       "NVIDIA H200 datasheet (SXM): 989 TFLOPS BF16 dense, 141 GB HBM3e, 4.8 TB/s, "
       "NVLink 900 GB/s",
       gemm=_H200),
    _d("L4", 121, 24, 300, 32,
       "NVIDIA L4 datasheet: 121 TFLOPS BF16 dense (242 sparse), 24 GB GDDR6, 300 GB/s, "
       "PCIe Gen4 x16 64 GB/s", latency_us=5.0,
       gemm=_unmeasured(58)),
    _d("T4", 65, 16, 320, 16,
       "NVIDIA T4 datasheet: 65 TFLOPS FP16 mixed precision, 16 GB GDDR6, 320 GB/s, "
       "PCIe Gen3 x16 32 GB/s", latency_us=5.0,
       gemm=_unmeasured(40)),
    _d("A10", 125, 24, 600, 32,
       "NVIDIA A10 datasheet: 125 TFLOPS BF16 dense (250 sparse), 24 GB GDDR6, 600 GB/s, "
       "PCIe Gen4 64 GB/s", latency_us=5.0,
       gemm=_unmeasured(72)),
    _d("RTX-3090", 71, 24, 936, 32,
       "NVIDIA Ampere GA102 whitepaper: RTX 3090 71 TFLOPS FP16 tensor with FP32 accumulate, "
       "24 GB GDDR6X, 936 GB/s, PCIe Gen4", latency_us=5.0,
       gemm=_unmeasured(82)),
    _d("RTX-4090", 165.2, 24, 1008, 32,
       "NVIDIA Ada Lovelace whitepaper: RTX 4090 165.2 TFLOPS FP16 tensor with FP32 "
       "accumulate (dense), 24 GB GDDR6X, 1,008 GB/s, PCIe Gen4", latency_us=5.0,
       gemm=_unmeasured(128)),
    _d("MI250X", 383, 128, 3200, 50,
       "AMD Instinct MI250X datasheet: 383 TFLOPS FP16/BF16 dense, 128 GB HBM2e, 3.2 TB/s, "
       "Infinity Fabric links 50 GB/s each",
       gemm=_MI250X),
    _d("MI300X", 1307.4, 192, 5300, 448,
       "AMD Instinct MI300X datasheet: 1,307.4 TFLOPS FP16/BF16 dense, 192 GB HBM3, 5.3 TB/s, "
       "Infinity Fabric 896 GB/s aggregate",
       gemm=_MI300X),
)


def builtin_device_types() -> dict[str, DeviceType]:
    """A fresh name -> DeviceType mapping of the built-in catalog (callers may extend it)."""
    return {d.name: d for d in _CATALOG}
