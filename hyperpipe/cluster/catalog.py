"""The built-in catalog of device types, from vendor spec sheets and public measurements.

Each entry gives peak *dense* tensor FLOP/s (no structured sparsity) for every dtype the
part computes in (`peaks`: fp32 without tensor cores, tf32, fp16, bf16, fp8), memory,
memory bandwidth and the typical intra-node link, with the document it comes from, and
how fast real work runs on it, each figure from a public source and never fitted to the
benchmarks that report this simulator's accuracy:

* `gemm`: a `GemmCurve`, the fraction of peak a GEMM of shape (M, N, K) reaches, through
  one published matmul measurement at the rate the part sustains (power-limited parts
  such as the 70 W T4 sustain far less than their boost-clock peak);
* `simt_gemm`: the same for fp32 GEMMs on an NVIDIA part's CUDA cores (TF32 off), which
  reach another fraction of their own peak than the tensor cores do of theirs;
* `mem_efficiency`: the fraction of memory bandwidth streaming kernels reach (the rate
  of memory-bound work: norms, softmax, dropout, activations, optimizer);
* `kernel_floor_s`: the least time one kernel takes however small its work (launch);
* `collective_efficiency` / `nic_efficiency`: NCCL all-reduce bus bandwidth over the
  nominal intra-node link / NIC bandwidth, from published nccl-tests runs.

`peak_flops` is the fp16/bf16 dense peak (the headline, used for MFU); a model's `dtype`
picks its own entry through `DeviceType.peak_for`. A dtype the part lacks falls back
along `DTYPE_FALLBACK` (bf16 -> fp16: a V100 or T4 trains a bf16 model in fp16 mixed
precision at the fp16 tensor rate; fp8 -> bf16; tf32 -> fp32), so the built-in clusters
that mix V100s with bf16 presets keep working; a file's table that has neither the dtype
nor its fallback is refused with a clear error.

Device types defined from scratch in a cluster file take their figures as achievable
(no curve, no floor, all fractions 1: the flat roofline with `efficiency`); a type based
on a catalog entry keeps its curve unless it sets `efficiency`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from hyperpipe.core.errors import BadInput

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
# concurrent"): 0.849. Training runs at the saturated clock, so burst-only figures below
# (MAMF, and the median-of-100 runs of mag-/gpu_benchmark) are scaled by it. This is ONE
# measurement on ONE part applied to others whose sustained rate nobody published (A100,
# H100, MI250X, L4, RTX 3090/4090, RTX A6000, L40S): a cross-device ASSUMPTION, not a
# measurement of those parts. docs/accuracy.md gives each published block with and
# without it. Parts whose sustained rate was measured (H200, T4, MI300X) do not use it.
SUSTAINED_OVER_BURST = 702.9 / 828.0

# Median sustained large-GEMM fraction of the measured data-centre parts (A100 0.73,
# H100 0.68, H200 0.71, MI250X 0.65, MI300X 0.60): the ceiling for parts without a
# public measurement.
UNMEASURED_GEMM_FRACTION = 0.68

# The least time one kernel takes, however little work it has: back-to-back launches of
# a short kernel on a V100 ran at 3.8 us per kernel, of which 2.9 us was the kernel
# itself, i.e. the launch rate bounds short kernels (NVIDIA Technical Blog, A. Gray,
# "Getting Started with CUDA Graphs", 2019). Framework work between kernels (Python,
# autograd, the engine's bookkeeping) is the stack's, not the device's, and is not here.
KERNEL_FLOOR_S = 3.8e-6

# Streaming kernels on a T4 (GDDR6, ECC on) reach about three quarters of its 320 GB/s,
# not the ~90% of HBM parts: three memory-bound kernels of GPT-2's embedding, timed on
# Colab T4s at launches that fill the GPU, moved 226, 234 and 242 GB/s (D. B. Song, "How
# many threads? Launch sizes for GPT-2's encoder kernels on a T4", 2026, table 12; the
# read-only gradient norm of the same series reached 87%). Their mean over 320 GB/s.
T4_MEM_EFFICIENCY = (226 + 234 + 242) / 3 / 320

# GPU memory sizes in datasheets are binary: a "16 GB" card holds 16 GiB (its chips come
# in powers of two; a V100 16GB reports 15.78 GiB to CUDA, the driver holding the rest).
# GDDR parts with ECC on, as data-centre parts are sold (T4, A10, L4, A40, L40S), store
# the ECC bits in that memory: "On GPUs with GDDR memory with ECC enabled the available
# DRAM is reduced by 6.25% to allow for the storage of ECC bits" (NVIDIA, CUDA C++ Best
# Practices Guide, "Device Memory Spaces"; a T4's 16 GiB show as 15 GiB in nvidia-smi).
# HBM carries its ECC bits beside the data.
ECC_GDDR_FRACTION = 1 / 16

# Intra-node transfers between GPUs that cannot reach each other directly (no PCIe
# peer-to-peer: GeForce parts on NVIDIA's stock driver, GPUs behind a CPU host bridge,
# where NCCL's path search refuses P2P by default) go through host shared memory (NCCL's
# SHM transport): each byte is copied into pinned host memory and out again, and the CPU
# and its memory carry both directions at once. nccl-tests over SHM on two GPUs on PCIe
# Gen3 x16 (16 GB/s per direction) moved 3.9 GB/s bus bandwidth in all-reduce (both
# directions at once) and 10.31 GB/s in broadcast (one direction) (NVIDIA/nccl issue
# #384, NCCL 2.4.8, NCCL_P2P_DISABLE=1); the maintainers' answer there: some CPUs do not
# handle bidirectional traffic well. Fractions of the nominal per-direction PCIe link,
# measured on Gen3 and applied to every generation (an assumption: the host's memory
# and CPU, not the link, set the rate, and no public SHM figure on Gen4 was found):
HOST_STAGED_COLLECTIVE_EFFICIENCY = 3.9 / 16      # collectives (ring steps, both ways)
HOST_STAGED_SEND_EFFICIENCY = 10.31 / 16          # a point-to-point send (one way)
# Latency of one host-staged step: an 8-byte all-reduce between two T4s over SHM took
# 20.36 us (NVIDIA/nccl issue #428, NCCL 2.8.3; the two across CPU sockets, where NCCL
# uses SHM by default), i.e. two ring steps of about 10 us.
HOST_STAGED_LATENCY_S = 20.36e-6 / 2

# Training dtypes a peak table may name, and what a part without one computes in.
DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8")
DTYPE_FALLBACK: Mapping[str, str] = MappingProxyType({"bf16": "fp16", "fp8": "bf16",
                                                      "tf32": "fp32"})
# The headline peak of a table: its first entry in this order (the fp16/bf16 peak).
HEADLINE_ORDER = ("bf16", "fp16", "fp8", "tf32", "fp32")


@dataclass(frozen=True)
class GemmCurve:
    """Fraction of peak reached by a GEMM C[M,N] = A[M,K] B[K,N], from its shape.

    Shape convention: (M, N, K) with K the reduction (inner) dimension, everywhere in
    HyperPipe. Sources print shapes their own way; `printed` keeps the source's string
    and `reduction_at` the position of the reduction dimension in it (0-based), so that
    `at` can be checked against the source (tests/cluster/test_gemm_points.py).

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
    fill · depth there. Where the measurement is the best of a search whose largest
    shape is known (`search_max`), no shape of the search ran faster, so the ceiling is
    the measurement over the curve's fill · depth at that largest shape instead (the
    curve then stays at or below the measurement over the whole search; a power-limited
    part's best shape is often a small one, and a curve through it alone would promise
    large GEMMs a rate the search never saw). Batched GEMMs (attention) count M·N·batch
    towards the waves.
    """

    measured: float                      # sustained fraction of peak at shape `at`
    at: tuple[int, int, int]             # (M, N, K) of that measurement, K the reduction
    sms: int                             # streaming multiprocessors / compute units
    tile_area: int = 256 * 128           # output elements per tile (cuBLAS, A100)
    k_fill: int = 128                    # K elements of pipeline fill/drain per tile
    source: str = ""
    printed: str = ""                    # the shape as the source printed it, "AxBxC"
    reduction_at: int = 2                # index of the reduction dimension in `printed`
    search_max: tuple[int, int, int] | None = None   # largest shape of a best-of search
    sustained_scale: float = 1.0         # factor applied to a burst measurement (<1)

    def _shape_factor(self, m: float, n: float, k: float, batch: float = 1) -> float:
        waves = m * n * batch / (self.tile_area * self.sms)
        return waves / (waves + 0.5) * k / (k + self.k_fill)

    @property
    def ceiling(self) -> float:
        """The large-GEMM asymptote (fraction of peak, at most 1)."""
        at = self._shape_factor(*self.at)
        if self.search_max is not None:
            at = max(at, self._shape_factor(*self.search_max))
        return min(1.0, self.measured / at)

    def efficiency(self, m: float, n: float, k: float, batch: float = 1) -> float:
        """Fraction of peak FLOP/s for an (M, N, K) GEMM, `batch` of them at once."""
        if min(m, n, k, batch) <= 0:
            return self.ceiling
        return self.ceiling * self._shape_factor(m, n, k, batch)


def shape_from_printed(printed: str, reduction_at: int) -> tuple[int, int, int]:
    """(M, N, K), K the reduction, of a shape printed as three numbers "AxBxC" whose
    reduction dimension is at index `reduction_at`; the other two keep their order (M
    then N)."""
    dims = [int(x) for x in printed.split("x")]
    if len(dims) != 3 or not 0 <= reduction_at <= 2:
        raise ValueError(f"a shape 'AxBxC' and a reduction index 0-2, got {printed!r}, "
                         f"{reduction_at}")
    k = dims.pop(reduction_at)
    return dims[0], dims[1], k


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator. All quantities in SI base units."""

    name: str
    peak_flops: float                 # dense FP16/BF16 tensor FLOP/s (the headline)
    memory_bytes: float
    mem_bandwidth_bytes_per_s: float
    efficiency: float = DEFAULT_EFFICIENCY
    link_bandwidth_bytes_per_s: float = 32e9   # typical intra-node link, per direction
    link_latency_s: float = 5e-6
    price_per_hour: float | None = None         # USD per device-hour, if known
    source: str = ""
    runtime_reserve_bytes: float = 0.0          # held by the runtime, not by tensors
    gemm: GemmCurve | None = None               # None: flat `efficiency` for all FLOPs
    # fp32 GEMMs without tensor cores (NVIDIA CUDA cores, TF32 off); None: `gemm` prices
    # them too (AMD runs fp32 on its matrix cores; a type without curves is flat)
    simt_gemm: GemmCurve | None = None
    mem_efficiency: float = DEFAULT_MEM_EFFICIENCY
    collective_efficiency: float = DEFAULT_COLLECTIVE_EFFICIENCY
    nic_efficiency: float = NIC_COLLECTIVE_EFFICIENCY   # collectives over the NICs
    # Peak of each dtype the part computes in, over `peak_flops` ((dtype, ratio) pairs;
    # ratios so that scaling `peak_flops`, as stragglers do, scales every dtype). Empty:
    # one peak for every dtype (a type defined in a file by one number).
    peak_ratios: tuple[tuple[str, float], ...] = ()
    kernel_floor_s: float = 0.0                 # least time of one kernel (catalog: launch)
    # Whether GPUs of this type reach each other directly (PCIe peer-to-peer or NVLink)
    # in the servers they usually come in; False: NCCL stages every intra-node transfer
    # through host shared memory (`HOST_STAGED_*`). A cluster file's node may say
    # otherwise (`peer_to_peer`).
    peer_to_peer: bool = True
    # Whether the NVSwitch of the servers this type comes in reduces in the switch
    # (NVLink SHARP, "available in third-generation NVSwitch systems (NVLink4) with Hopper
    # and later GPU architectures", NCCL's environment docs, NCCL_NVLS_ENABLE): NCCL then
    # all-reduces across such nodes hierarchically (NVLS tree, NCCL 2.18), else with
    # rings through every GPU (`hyperpipe.cluster.cluster.hierarchical_all_reduce`).
    nvlink_sharp: bool = False

    @staticmethod
    def reserve_for(memory_bytes: float) -> float:
        """The catalog's runtime reserve of a GPU with `memory_bytes` of memory."""
        return RUNTIME_FIXED_BYTES + FRAGMENTATION_FRACTION * memory_bytes

    @property
    def free_bytes(self) -> float:
        """Memory less the runtime reserve (bytes): what tensors may hold."""
        return self.memory_bytes - self.runtime_reserve_bytes

    @property
    def peaks(self) -> dict[str, float]:
        """Dense FLOP/s per dtype the part computes in (empty: one peak for all)."""
        return {d: self.peak_flops * r for d, r in self.peak_ratios}

    def computes_in(self, dtype: str) -> str | None:
        """The dtype of this part's table that GEMMs in `dtype` run at: `dtype`, else the
        first of its `DTYPE_FALLBACK` chain the table has (None: none has it); `dtype`
        itself for a type without a table (one peak for every dtype)."""
        ratios = dict(self.peak_ratios)
        d: str | None = dtype
        while ratios and d is not None and d not in ratios:
            d = DTYPE_FALLBACK.get(d)
        return d

    def peak_for(self, dtype: str) -> float:
        """Dense FLOP/s of GEMMs in `dtype` ("fp32", "tf32", "fp16", "bf16", "fp8"):
        the table's entry, else its `DTYPE_FALLBACK` chain's (`computes_in`);
        `peak_flops` for a type without a table. Raises BadInput if the chain ends
        without an entry."""
        if not self.peak_ratios:
            return self.peak_flops
        d = self.computes_in(dtype)
        if d is None:
            chain = _chain(dtype)[1:]
            falls = f" or one it falls back to ({' -> '.join(chain)})" if chain else \
                " (no other dtype stands in for it)"
            raise BadInput(f"device type {self.name}: peak_flops",
                           f"an entry for the model's dtype {dtype}{falls}",
                           ", ".join(d for d, _ in self.peak_ratios))
        return self.peak_flops * dict(self.peak_ratios)[d]

    def gemm_for(self, dtype: str | None) -> GemmCurve | None:
        """The curve of GEMMs in `dtype` (None: the headline dtype): `simt_gemm` where
        the part computes `dtype` in fp32 (fp32, or tf32 on a part without TF32:
        `computes_in`) and has one, else `gemm` (None: the flat `efficiency`). The
        tensor-core curve, measured in fp16/bf16, stands for tf32 and fp8 too."""
        if self.simt_gemm is not None and dtype is not None and \
                self.computes_in(dtype) == "fp32":
            return self.simt_gemm
        return self.gemm

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.efficiency

    def achievable_flops_for(self, dtype: str) -> float:
        """`peak_for(dtype)` at the flat `efficiency` (the roofline without a curve)."""
        return self.peak_for(dtype) * self.efficiency

    @property
    def achievable_mem_bandwidth_bytes_per_s(self) -> float:
        return self.mem_bandwidth_bytes_per_s * self.mem_efficiency


def _chain(dtype: str) -> list[str]:
    """`dtype` and the dtypes it falls back to, in order."""
    out = [dtype]
    while out[-1] in DTYPE_FALLBACK:
        out.append(DTYPE_FALLBACK[out[-1]])
    return out


def peak_ratios(peaks: Mapping[str, float]) -> tuple[float, tuple[tuple[str, float], ...]]:
    """(headline peak, ratios) of a dtype -> FLOP/s table: the headline is the first of
    `HEADLINE_ORDER` it has, the ratios are every entry over it."""
    head = next(peaks[d] for d in HEADLINE_ORDER if d in peaks)
    return head, tuple((d, peaks[d] / head) for d in DTYPES if d in peaks)


def _d(name, peaks, mem_gib, bw_gbs, link_gbs, source, latency_us=2.0, gemm=None,
       mem_efficiency=DEFAULT_MEM_EFFICIENCY, peer_to_peer=True, nvlink_sharp=False,
       simt: GemmCurve | None = None, ecc_gddr: bool = False):
    """A catalog entry; `peaks` in TFLOP/s per dtype, dense; `mem_gib`: the memory the
    datasheet gives in "GB", which for GPU memory is GiB (2^30 bytes: the chips come
    in powers of two; a "16 GB" V100 holds 16 GiB), less `ECC_GDDR_FRACTION` where
    `ecc_gddr` (GDDR parts sold with ECC on), or what CUDA reports where a public source
    prints it (the T4); `simt`: its fp32 CUDA-core curve (NVIDIA
    parts: `SIMT_MEASURED`'s, else the unmeasured median)."""
    head, ratios = peak_ratios({d: v * 1e12 for d, v in peaks.items()})
    mem_bytes = mem_gib * 2**30 * (1 - ECC_GDDR_FRACTION if ecc_gddr else 1)
    return DeviceType(name=name, peak_flops=head, memory_bytes=mem_bytes,
                      mem_bandwidth_bytes_per_s=bw_gbs * 1e9,
                      link_bandwidth_bytes_per_s=link_gbs * 1e9,
                      link_latency_s=latency_us * 1e-6, source=source, gemm=gemm,
                      simt_gemm=simt,
                      runtime_reserve_bytes=DeviceType.reserve_for(mem_bytes),
                      peak_ratios=ratios, kernel_floor_s=KERNEL_FLOOR_S,
                      mem_efficiency=mem_efficiency, peer_to_peer=peer_to_peer,
                      nvlink_sharp=nvlink_sharp)


_MAMF = ("stas00/ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul "
         "FLOPS comparison table' (BF16 torch.matmul, best shape of a search)")
# The v1 table's shapes were printed "MxNxK" by the original mamf-finder.py, whose
# benchmark_mm made A = randn(m, n), B = randn(n, k): the MIDDLE number is the reduction
# (the Chinese copy of that README and code, BBuf/how-to-optim-algorithm-in-cuda, keeps
# it: "N is the reduce dimension so that (MxN)*(NxK)=(MxK)"). The script later renamed
# its arguments (A = randn(m, k), B = randn(n, k).t(): K last is the reduction), and the
# README re-printed the same v1 measurements as MxNxK with K last (A100 SXM 267.9 @
# 6912x2048x16384, H100 792.1 @ 6144x2816x17920, MI250X 147.0 @ 1024x19968x14080,
# MI300X 781.9 @ 4096x4864x10240).
_V1_REDUCTION_AT = 1
# mag-/gpu_benchmark (README "Stats", bf16 torch.mm, median of 100 iterations after 50
# warm-up, L2 flushed before each; its mamf-finder.py: A = randn(m, n), B = randn(n, k),
# so the middle printed number is the reduction too): the best of an Optuna search over
# its default ranges, 1024 to 20480 in every dimension.
_MAG = "mag-/gpu_benchmark README.md 'Stats' (bf16 torch.mm, median of 100, L2 flushed)"
_MAG_SEARCH_MAX = (20480, 20480, 20480)


def _cube_of(printed: str) -> tuple[int, int, int]:
    """The least search box a best shape `printed` implies: mamf-finder's usage examples
    search every dimension over the same range, which reached at least the shape's
    largest dimension."""
    d = max(int(x) for x in printed.split("x"))
    return d, d, d


def _burst(tflops: float, peak_tflops: float, printed: str, sms: int, source: str,
           note: str, reduction_at: int = _V1_REDUCTION_AT,
           search_max: tuple[int, int, int] | None = None) -> GemmCurve:
    """A curve through a burst best-of-search measurement (`tflops` at the shape
    `printed`, no shape up to `search_max` faster; default: the cube of its largest
    dimension), scaled to the sustained clock by `SUSTAINED_OVER_BURST` (a cross-device
    assumption)."""
    return GemmCurve(tflops / peak_tflops * SUSTAINED_OVER_BURST,
                     shape_from_printed(printed, reduction_at), sms,
                     source=f"{source}: {note} {tflops} of {peak_tflops} TFLOP/s @ {printed}; "
                            f"x{SUSTAINED_OVER_BURST:.3f} sustained/burst (assumed)",
                     printed=printed, reduction_at=reduction_at,
                     search_max=search_max or _cube_of(printed),
                     sustained_scale=SUSTAINED_OVER_BURST)


def _mag(tflops: float, peak_tflops: float, printed: str, sms: int, note: str
         ) -> GemmCurve:
    """A curve through a mag-/gpu_benchmark best-of-search point (burst)."""
    return _burst(tflops, peak_tflops, printed, sms, _MAG, note, search_max=_MAG_SEARCH_MAX)


def _unmeasured(sms: int) -> GemmCurve:
    """No public GEMM measurement: the median measured ceiling at a large shape."""
    return GemmCurve(UNMEASURED_GEMM_FRACTION, (8192, 8192, 8192), sms,
                     source="no public measurement: median of the measured parts")


# SM / CU counts: NVIDIA Volta, Turing (TU102, TU104), Ampere (GA100, GA102), Ada,
# Hopper whitepapers; AMD CDNA2 and CDNA3 whitepapers (MI250X: 110 CUs per GCD, MAMF
# measured on one GCD).
# Cross-check, not a fit: whole training steps on A100-80GB with FlashAttention
# reach 71-79% of peak in hardware FLOPs (MosaicML llm-foundry, scripts/train/benchmarking/
# README.md: 13B-70B with activation checkpointing, HFU 71.1-79.3%), so the large-GEMM
# ceiling this curve gives is not far above what real kernels sustain.
_A100 = _burst(267.9, 312, "6912x16384x2048", 108, _MAMF, "A100 SXM")
_H100 = _burst(792.1, 989, "6144x17920x2816", 132, _MAMF, "H100 SXM")
# H200: the sustained (MSMF) rate itself, 702.9 of 989 TFLOP/s (same source, "alone" row);
# its shape is not printed there, so a large one is assumed.
_H200 = GemmCurve(702.9 / 989, (8192, 8192, 8192), 132,
                  source=f"{_MAMF}: H200 MSMF 702.9 of 989 TFLOP/s (sustained)")
# MI250X: 383 TFLOP/s are two GCDs; one matmul runs on one (191.5).
_MI250X = _burst(147.0, 191.5, "1024x14080x19968", 110, _MAMF, "MI250X (1 GCD)")
# MI300X reaches its power cap within one kernel (no boost burst, same source), so its
# MAMF is already the sustained rate.
_MI300X = GemmCurve(781.9 / 1300, shape_from_printed("4096x10240x4864", _V1_REDUCTION_AT),
                    304, printed="4096x10240x4864", reduction_at=_V1_REDUCTION_AT,
                    search_max=_cube_of("4096x10240x4864"),
                    source=f"{_MAMF}: MI300X 781.9 of 1300 TFLOP/s @ 4096x10240x4864 "
                           "(power-capped: sustained)")
# T4: a 70 W part whose clock the power cap pulls far below its 1590 MHz boost under
# continuous matmuls: cuBLAS FP16 4096^3 ran at about 24 TFLOP/s of its 65 (NVIDIA
# Developer Forums, "About GPU peak performance", 2023, answer by R. Crovella: "power
# capping ... expected behavior for approximately continuous matrix multiply
# operations on a T4"). Already sustained: no burst scaling. Turing tiles 128x128.
_T4 = GemmCurve(24 / 65, (4096, 4096, 4096), 40, tile_area=128 * 128,
                source="NVIDIA Developer Forums 'About GPU peak performance' (2023): "
                       "T4 cuBLAS FP16 4096^3 ~24 of 65 TFLOP/s at its 70 W power cap "
                       "(sustained)", printed="4096x4096x4096")


# fp32 GEMMs on NVIDIA CUDA cores (TF32 off), a unit of its own: cuBLAS SGEMM reaches
# 90%+ of the fp32 peak on V100 and A100, but about two thirds on the parts whose fp32
# peak counts a second datapath shared with INT32 (GA102, AD102, Hopper), and half on
# the 70 W T4, whatever their tensor cores reach. One source and method for every part:
# zzc0721/torch-performance-test-data, test.py (square torch.mm of 1024, 2048, 4096,
# 8192 and 10240, 6 warm-up and 30 timed back to back, so seconds at the power-limited
# clock: sustained, no burst scaling; the best size reported), its database.md
# (commit 0785868; PyTorch's default allow_tf32=False for matmul since 1.12) and its
# issues (whose script sets allow_tf32=False explicitly). Where a part has several runs,
# their median. TFLOP/s, and the best size where the run printed it.
_ZZC = "zzc0721/torch-performance-test-data (fp32 torch.mm, TF32 off, best of 1024-10240^2)"
_SIMT_SEARCH_MAX = (10240, 10240, 10240)
SIMT_TILE_AREA = 128 * 128      # cuBLAS/CUTLASS SIMT SGEMM tiles (e.g. sgemm 128x128_8x2)
SIMT_MEASURED: dict[str, tuple[float, int | None, str]] = {
    # name: (TFLOP/s, best square size or None where only the best rate was printed, where)
    # both V100 entries (SXM2: the same clocks and peak)
    "V100": (14.51, 10240, "issue #140, Tesla V100-SXM2-16GB, torch 2.7.0"),
    "T4": ((4.17 + 4.43) / 2, None, "database.md, Tesla T4 on Colab 4.17 and Kaggle 4.43"),
    "RTX-2080Ti": ((13.04 + 11.52) / 2, 8192,
                   "issues #115 (13.04 @ 8192^2) and #181 (11.52 @ 8192^2)"),
    "Titan-RTX": (11.91, 4096, "issue #127, NVIDIA TITAN RTX (an uneven run)"),
    "RTX-3090": (24.79, None, "database.md, RTX 3090 rows 24.46, 24.84, 24.79"),
    "RTX-4090": (54.72, None, "database.md, RTX 4090 24GB rows 55.01, 54.77, 46.48, 54.67"),
    "A100-40GB": (18.11, None, "database.md, NVIDIA A100 40GB"),
    "A100-80GB": (19.18, None, "database.md, NVIDIA A100 SXM4 80GB"),
    # the other H100 row's 403.74 is above the 67 TFLOP/s fp32 peak: TF32, left out
    "H100-SXM": (52.11, None, "database.md, NVIDIA H100 80GB HBM3 (52.11 row)"),
    "H200": (51.34, None, "database.md, NVIDIA H200"),
    "L40S": (46.88, None, "database.md, NVIDIA L40S"),
    "A6000": (23.92, None, "database.md, NVIDIA RTX A6000"),
    "A40": (23.73, 8192, "issue #185, NVIDIA A40"),
}


def _simt(name: str, fp32_peak_tflops: float, sms: int) -> GemmCurve:
    """The fp32 CUDA-core curve of catalog part `name` through `SIMT_MEASURED`."""
    tflops, size, where = SIMT_MEASURED[name]
    at = _SIMT_SEARCH_MAX if size is None else (size, size, size)
    return GemmCurve(tflops / fp32_peak_tflops, at, sms, tile_area=SIMT_TILE_AREA,
                     source=f"{_ZZC}: {where}: {tflops:.2f} of {fp32_peak_tflops} TFLOP/s",
                     printed="" if size is None else "x".join(map(str, at)),
                     search_max=_SIMT_SEARCH_MAX)


# Parts without a run: the median measured fraction (A10, L4, H100 PCIe).
UNMEASURED_SIMT_FRACTION = 0.731      # sorted fractions: see test_simt_points


def _simt_unmeasured(sms: int) -> GemmCurve:
    return GemmCurve(UNMEASURED_SIMT_FRACTION, _SIMT_SEARCH_MAX, sms,
                     tile_area=SIMT_TILE_AREA,
                     source="no public fp32 SGEMM run: median of the measured parts")


_A100_80GB = _d("A100-80GB", {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312}, 80,
                2039, 300,
                "NVIDIA A100 datasheet (SXM4 80GB): 19.5 FP32, 156 TF32, 312 TFLOPS "
                "BF16/FP16 dense, 2,039 GB/s, NVLink 600 GB/s",
                gemm=_A100, simt=_simt("A100-80GB", 19.5, 108))
_H100_SXM = _d("H100-SXM", {"fp32": 67, "tf32": 494.5, "fp16": 989, "bf16": 989,
                            "fp8": 1979}, 80, 3350, 450,
               "NVIDIA H100 datasheet (SXM5): 67 FP32, 494.5 TF32, 989 BF16/FP16, 1,979 "
               "FP8 TFLOPS dense (half the sparse figures), 3.35 TB/s, NVLink 900 GB/s",
               gemm=_H100, simt=_simt("H100-SXM", 67, 132), nvlink_sharp=True)
# The export parts' NVLink: 400 GB/s in both directions together, 200 per direction.
EXPORT_NVLINK_BYTES_PER_S = 200e9


def _nvlink_cut(base: DeviceType, name: str, source: str) -> DeviceType:
    """An export part: `base`'s silicon, memory and clocks (so its peaks and GEMM
    curves) with NVLink cut to `EXPORT_NVLINK_BYTES_PER_S` per direction."""
    return replace(base, name=name, link_bandwidth_bytes_per_s=EXPORT_NVLINK_BYTES_PER_S,
                   source=f"{source}: the {base.name} ({base.source}) with NVLink "
                          "400 GB/s")


def _more_memory(base: DeviceType, name: str, mem_gib: float, source: str) -> DeviceType:
    """`base`'s board with larger memory chips: its silicon, clocks, bandwidth and links
    (so its peaks and curves), `mem_gib` GiB of memory (`_d`'s rule, no ECC share)."""
    mem_bytes = mem_gib * 2**30
    return replace(base, name=name, memory_bytes=mem_bytes,
                   runtime_reserve_bytes=DeviceType.reserve_for(mem_bytes),
                   source=f"{source}: the {base.name} ({base.source}) with {mem_gib} GB")


# The V100 PCIe card: lower clocks (250 W) and no NVLink, PCIe Gen3 x16 between GPUs.
_V100_PCIE_16GB = _d("V100-PCIe-16GB", {"fp32": 14, "fp16": 112}, 16, 900, 16,
                     "NVIDIA Tesla V100 datasheet (PCIe): 14 TFLOPS single, 112 TFLOPS "
                     "tensor, 16 GB HBM2, 900 GB/s, PCIe Gen3 32 GB/s (both directions), "
                     "250 W; no bf16/tf32",
                     latency_us=5.0, gemm=_unmeasured(80), simt=_simt_unmeasured(80))
# The Turing workstation card: the Titan RTX's TU102 at its clocks (full-rate FP32
# accumulate), GDDR6 (ECC is optional on it: counted off here).
_QUADRO_RTX_6000 = _d("Quadro-RTX-6000", {"fp32": 16.3, "fp16": 130.5}, 24, 672, 16,
                      "NVIDIA Quadro RTX 6000 datasheet: 16.3 TFLOPS single precision, "
                      "130.5 TFLOPS tensor, 24 GB GDDR6, 672 GB/s, 260 W board (295 W "
                      "total), PCIe Gen3 x16; no bf16/tf32",
                      latency_us=5.0, gemm=_unmeasured(72), simt=_simt_unmeasured(72))


# NVLink figures are total bidirectional in NVIDIA's sheets; we store one direction (half).
# PCIe figures: Gen3 x16 ~16 GB/s, Gen4 x16 ~32 GB/s, Gen5 x16 ~64 GB/s per direction.
# Peaks are dense (without sparsity) in TFLOP/s; fp32 is the non-tensor (CUDA core) rate
# that an fp32 GEMM runs at when TF32 is off (PyTorch's default for matmul since 1.12,
# torch.backends.cuda.matmul.allow_tf32 = False, "TensorFloat-32 (TF32) on Ampere (and
# later) devices" in PyTorch's CUDA semantics notes). GeForce parts: the tensor rate with
# FP32 accumulate (what cuBLAS uses for fp16/bf16 GEMMs), half their FP16-accumulate one.
_CATALOG: tuple[DeviceType, ...] = (
    _d("V100-16GB", {"fp32": 15.7, "fp16": 125}, 16, 900, 150,
       "NVIDIA Tesla V100 datasheet (SXM2): 15.7 TFLOPS single, 125 TFLOPS tensor, "
       "900 GB/s HBM2, NVLink 300 GB/s; no bf16/tf32",
       gemm=_unmeasured(80), simt=_simt("V100", 15.7, 80)),
    _d("V100-32GB", {"fp32": 15.7, "fp16": 125}, 32, 900, 150,
       "NVIDIA Tesla V100 datasheet (SXM2 32GB): 15.7 TFLOPS single, 125 TFLOPS tensor, "
       "900 GB/s, NVLink 300 GB/s; no bf16/tf32",
       gemm=_unmeasured(80), simt=_simt("V100", 15.7, 80)),
    _V100_PCIE_16GB,
    _more_memory(_V100_PCIE_16GB, "V100-PCIe-32GB", 32,
                 "NVIDIA Tesla V100 datasheet (PCIe 32GB)"),
    # Pascal has no tensor cores: its fp16 GEMMs run on the CUDA cores (two fp16 FMAs
    # per fp32 lane), so the fp16 curve has the SIMT shape and fraction too.
    _d("P100-16GB", {"fp32": 9.3, "fp16": 18.7}, 16, 732, 16,
       "NVIDIA Tesla P100 datasheet (PCIe 16GB): 9.3 TFLOPS single, 18.7 TFLOPS half "
       "precision, 16 GB CoWoS HBM2 at 732 GB/s, 250 W, PCIe Gen3 x16 32 GB/s; no "
       "tensor cores, no bf16/tf32", latency_us=5.0,
       gemm=_simt_unmeasured(56), simt=_simt_unmeasured(56)),
    _d("A30", {"fp32": 10.3, "tf32": 82, "fp16": 165, "bf16": 165}, 24, 933, 32,
       "NVIDIA A30 datasheet: 10.3 FP32, 82 TF32, 165 BF16/FP16 TFLOPS dense (half the "
       "sparse figures), 24 GB HBM2, 933 GB/s, 165 W, PCIe Gen4 64 GB/s (NVLink bridge "
       "200 GB/s between two cards only)", latency_us=5.0,
       gemm=_unmeasured(56), simt=_simt_unmeasured(56)),
    _d("A100-40GB", {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312}, 40, 1555, 300,
       "NVIDIA A100 datasheet (SXM4 40GB): 19.5 FP32, 156 TF32, 312 TFLOPS BF16/FP16 "
       "dense, 1,555 GB/s, NVLink 600 GB/s",
       gemm=_A100, simt=_simt("A100-40GB", 19.5, 108)),
    _A100_80GB,
    # The PCIe cards: the SXM4 part's peaks at 250-300 W (no measured GEMM of their own:
    # the unmeasured median, not the SXM4 curve), PCIe Gen4 x16 between GPUs (an NVLink
    # bridge joins two cards only).
    _d("A100-PCIe-40GB", {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312}, 40, 1555,
       32, "NVIDIA A100 datasheet (PCIe 40GB) and product brief PB-10137-001: 19.5 FP32, "
       "156 TF32, 312 BF16/FP16 TFLOPS dense, 40 GB HBM2, 1,555 GB/s, 250 W, PCIe Gen4 "
       "64 GB/s (both directions)", latency_us=5.0,
       gemm=_unmeasured(108), simt=_simt_unmeasured(108)),
    _d("A100-PCIe-80GB", {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312}, 80, 1935,
       32, "NVIDIA A100 datasheet (PCIe 80GB) and product brief PB-10577-001: 19.5 FP32, "
       "156 TF32, 312 BF16/FP16 TFLOPS dense, 80 GB HBM2e, 1,935 GB/s, 300 W, PCIe Gen4 "
       "64 GB/s (both directions)", latency_us=5.0,
       gemm=_unmeasured(108), simt=_simt_unmeasured(108)),
    _H100_SXM,
    _nvlink_cut(_A100_80GB, "A800-80GB", "NVIDIA A800 datasheet (SXM4 80GB)"),
    _nvlink_cut(_H100_SXM, "H800", "DeepSeek-AI, arXiv 2505.09343, sec. 2 (H800 SXM5)"),
    _d("H100-PCIe", {"fp32": 51, "tf32": 378, "fp16": 756, "bf16": 756, "fp8": 1513},
       80, 2000, 64,
       "NVIDIA H100 datasheet (PCIe): 51 FP32, 378 TF32, 756 BF16/FP16, 1,513 FP8 TFLOPS "
       "dense, 2 TB/s, PCIe Gen5 128 GB/s", latency_us=5.0,
       gemm=_unmeasured(114), simt=_simt_unmeasured(114)),
    _d("H200", {"fp32": 67, "tf32": 494.5, "fp16": 989, "bf16": 989, "fp8": 1979},
       141, 4800, 450,
       "NVIDIA H200 datasheet (SXM): 67 FP32, 494.5 TF32, 989 BF16/FP16, 1,979 FP8 "
       "TFLOPS dense, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s",
       gemm=_H200, simt=_simt("H200", 67, 132), nvlink_sharp=True),
    _d("L4", {"fp32": 30.3, "tf32": 60, "fp16": 121, "bf16": 121, "fp8": 242.5},
       24, 300, 32,
       "NVIDIA L4 datasheet: 30.3 FP32, 120/242/485 TF32/BF16/FP8 TFLOPS with sparsity "
       "(half dense), 24 GB GDDR6, 300 GB/s, 72 W, PCIe Gen4 x16 64 GB/s", latency_us=5.0,
       gemm=_mag(91.4, 121, "1024x6016x1792", 58, "NVIDIA L4"),
       simt=_simt_unmeasured(58), ecc_gddr=True,
       # No peer-to-peer as L4s are deployed: "AWS g6 series does not have NVLink/
       # NVSwitch or PCIe P2P" (llm-d-incubation/llm-d-infra issue #181); NCCL over 4 L4s
       # runs its SHM transport (NVIDIA/nccl issue #1838, transport/shm.cc).
       peer_to_peer=False),
    # Memory: what CUDA gives a process, not the 16 GiB on the board: ECC (on by default
    # on data-centre T4s, e.g. AWS g4dn, Google Colab) holds back a 16th of the GDDR6
    # (`ECC_GDDR_FRACTION`), the driver a little more, and
    # PyTorch's out-of-memory message on a T4 reads "14.75 GiB total capacity"
    # (torch.cuda.get_device_properties().total_memory; e.g. TransformerLens's model
    # notes, "T4: CUDA out of memory ... 14.75 GiB total capacity").
    _d("T4", {"fp32": 8.1, "fp16": 65}, 14.75, 320, 16,
       "NVIDIA T4 datasheet: 8.1 TFLOPS single, 65 TFLOPS FP16 mixed precision, "
       "16 GB GDDR6 (14.75 GiB usable with ECC), 320 GB/s, 70 W, PCIe Gen3 x16 32 GB/s; "
       "no bf16/tf32", latency_us=5.0,
       gemm=_T4, simt=_simt("T4", 8.1, 40), mem_efficiency=T4_MEM_EFFICIENCY,
       # No peer-to-peer as T4s are deployed: the cloud's 4-T4 servers (AWS g4dn.12xlarge)
       # join their GPUs through the CPU's host bridge (PHB), where NCCL does not use P2P
       # by default; NCCL over 4 T4s there allocates SHM segments (pytorch/ci-infra issue
       # #490, NVIDIA/nccl issue #525) and peer access fails "unsupported on T4"
       # (ray-project/ray PR #64109).
       peer_to_peer=False),
    _d("A10", {"fp32": 31.2, "tf32": 62.5, "fp16": 125, "bf16": 125}, 24, 600, 32,
       "NVIDIA A10 datasheet: 31.2 FP32, 62.5 TF32, 125 BF16/FP16 TFLOPS dense (half "
       "the sparse figures), 24 GB GDDR6, 600 GB/s, 150 W, PCIe Gen4 64 GB/s",
       latency_us=5.0, gemm=_unmeasured(72), simt=_simt_unmeasured(72), ecc_gddr=True),
    _d("RTX-3090", {"fp32": 35.6, "tf32": 35.6, "fp16": 71, "bf16": 71}, 24, 936, 32,
       "NVIDIA Ampere GA102 whitepaper (appendix): RTX 3090 35.6 FP32, 35.6 TF32, 71 "
       "FP16/BF16 tensor TFLOPS with FP32 accumulate (dense), 24 GB GDDR6X, 936 GB/s, "
       "PCIe Gen4", latency_us=5.0,
       gemm=_mag(78.0, 71, "5248x15040x1024", 82, "GeForce RTX 3090"),
       simt=_simt("RTX-3090", 35.6, 82),
       # GeForce: no PCIe peer-to-peer on the stock driver ("CANNOT Access Peer" between
       # all 8 RTX 3090s of a server, NVIDIA/nccl issue #1127; a patched open kernel module
       # exists to add it, aikitoria/open-gpu-kernel-modules).
       peer_to_peer=False),
    _d("RTX-3080", {"fp32": 29.8, "tf32": 29.8, "fp16": 59.5, "bf16": 59.5}, 10, 760, 32,
       "NVIDIA Ampere GA102 whitepaper (appendix): RTX 3080 29.8 FP32, 29.8 TF32, 59.5 "
       "FP16/BF16 tensor TFLOPS with FP32 accumulate (dense), 10 GB GDDR6X, 760 GB/s, "
       "320 W, PCIe Gen4", latency_us=5.0,
       gemm=_unmeasured(68), simt=_simt_unmeasured(68),
       peer_to_peer=False),          # GeForce: as the RTX 3090 above
    _d("RTX-4090", {"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2,
                    "fp8": 330.3}, 24, 1008, 32,
       "NVIDIA Ada Lovelace whitepaper (appendix): RTX 4090 82.6 FP32, 82.6 TF32, 165.2 "
       "FP16/BF16, 330.3 FP8 tensor TFLOPS with FP32 accumulate (dense), 24 GB GDDR6X, "
       "1,008 GB/s, PCIe Gen4", latency_us=5.0,
       gemm=_mag(178.8, 165.2, "14336x4096x4096", 128, "GeForce RTX 4090"),
       simt=_simt("RTX-4090", 82.6, 128),
       # No peer-to-peer on the stock driver: NCCL on 8 RTX 4090s connects "via SHM"
       # (NVIDIA/nccl-tests issue #307); tinygrad/open-gpu-kernel-modules patches it in.
       peer_to_peer=False),
    _d("RTX-4080", {"fp32": 48.7, "tf32": 48.7, "fp16": 97.5, "bf16": 97.5}, 16, 716.8, 32,
       "NVIDIA Ada Lovelace whitepaper (appendix): RTX 4080 48.7 FP32, 48.7 TF32, 97.5 "
       "FP16/BF16 tensor TFLOPS with FP32 accumulate (dense), 16 GB GDDR6X, 716.8 GB/s, "
       "320 W, PCIe Gen4", latency_us=5.0,
       gemm=_unmeasured(76), simt=_simt_unmeasured(76),
       peer_to_peer=False),          # GeForce: as the RTX 4090 above
    _d("Titan-RTX", {"fp32": 16.3, "fp16": 130.5}, 24, 672, 16,
       "NVIDIA Turing whitepaper (appendix) and Titan RTX page: 16.3 FP32, 130.5 FP16 "
       "tensor TFLOPS with FP32 accumulate (full rate on Titan), 24 GB GDDR6, 672 GB/s, "
       "280 W, PCIe Gen3; no bf16/tf32", latency_us=5.0,
       gemm=_unmeasured(72), simt=_simt("Titan-RTX", 16.3, 72)),
    _QUADRO_RTX_6000,
    _more_memory(_QUADRO_RTX_6000, "Quadro-RTX-8000", 48,
                 "NVIDIA Quadro RTX 8000 datasheet (16.3 TFLOPS single precision, 130.5 "
                 "TFLOPS tensor, 48 GB GDDR6, 672 GB/s)"),
    # Volta's GV100 as a PCIe card, 12 GB of it (three HBM2 stacks).
    _d("Titan-V", {"fp32": 13.8, "fp16": 110}, 12, 652.8, 16,
       "NVIDIA TITAN V: 110 TFLOPS tensor (deep learning), 5,120 CUDA cores in 80 SMs, "
       "12 GB HBM2 on 3,072 bits at 1.7 Gbps (652.8 GB/s), 250 W, PCIe Gen3; 13.8 TFLOPS "
       "single precision at the same clocks (AnandTech, 'The NVIDIA Titan V Deep Learning "
       "Deep Dive', 2018, specification table); no bf16/tf32", latency_us=5.0,
       gemm=_unmeasured(80), simt=_simt_unmeasured(80)),
    _d("RTX-2080Ti", {"fp32": 13.4, "fp16": 53.8}, 11, 616, 16,
       "NVIDIA Turing whitepaper (appendix): RTX 2080 Ti (reference clocks) 13.4 FP32, "
       "53.8 FP16 tensor TFLOPS with FP32 accumulate (107.6 with FP16 accumulate), 11 GB "
       "GDDR6, 616 GB/s, 250 W, PCIe Gen3; no bf16/tf32", latency_us=5.0,
       gemm=_unmeasured(68), simt=_simt("RTX-2080Ti", 13.4, 68),
       # "the 2080ti has never supported p2p": p2pBandwidthLatencyTest reports "CANNOT
       # Access Peer" between every pair of 8 (NVIDIA/nccl-tests issue #117).
       peer_to_peer=False),
    _d("A6000", {"fp32": 38.7, "tf32": 77.4, "fp16": 154.8, "bf16": 154.8}, 48, 768, 32,
       "NVIDIA RTX A6000 datasheet: 38.7 FP32, 77.4 TF32, 154.8 BF16/FP16 tensor TFLOPS "
       "dense (half the sparse figures), 48 GB GDDR6, 768 GB/s, 300 W, PCIe Gen4",
       latency_us=5.0,
       gemm=_mag(131.2, 154.8, "9856x12480x13248", 84, "NVIDIA RTX A6000"),
       simt=_simt("A6000", 38.7, 84)),
    _d("A5000", {"fp32": 27.8, "tf32": 55.6, "fp16": 111.1, "bf16": 111.1}, 24, 768, 32,
       "NVIDIA RTX A5000 datasheet: 27.8 FP32, 222.2 tensor TFLOPS with sparsity (111.1 "
       "dense BF16/FP16, 55.6 dense TF32), 24 GB GDDR6, 768 GB/s, 230 W, PCIe Gen4",
       latency_us=5.0, gemm=_unmeasured(64), simt=_simt_unmeasured(64)),
    _d("A4000", {"fp32": 19.2, "tf32": 38.4, "fp16": 76.7, "bf16": 76.7}, 16, 448, 32,
       "NVIDIA RTX A4000 datasheet: 19.2 FP32, 153.4 tensor TFLOPS with sparsity (76.7 "
       "dense BF16/FP16, 38.4 dense TF32), 16 GB GDDR6, 448 GB/s, 140 W, PCIe Gen4",
       latency_us=5.0, gemm=_unmeasured(48), simt=_simt_unmeasured(48)),
    _d("A40", {"fp32": 37.4, "tf32": 74.8, "fp16": 149.7, "bf16": 149.7}, 48, 696, 32,
       "NVIDIA A40 datasheet: 37.4 FP32, 74.8 TF32, 149.7 BF16/FP16 tensor TFLOPS dense "
       "(half the sparse figures), 48 GB GDDR6, 696 GB/s, 300 W, PCIe Gen4",
       latency_us=5.0, gemm=_unmeasured(84), simt=_simt("A40", 37.4, 84), ecc_gddr=True),
    _d("L40S", {"fp32": 91.6, "tf32": 183, "fp16": 362.05, "bf16": 362.05, "fp8": 733},
       48, 864, 32,
       "NVIDIA L40S datasheet: 91.6 FP32, 183 TF32, 362.05 BF16/FP16, 733 FP8 tensor "
       "TFLOPS dense (half the sparse figures), 48 GB GDDR6, 864 GB/s, 350 W, PCIe Gen4",
       latency_us=5.0,
       gemm=_mag(252.0, 362.05, "4416x3776x3072", 142, "NVIDIA L40S"),
       simt=_simt("L40S", 91.6, 142), ecc_gddr=True),
    # AMD: an fp32 GEMM runs on the matrix cores (MFMA FP32), so fp32 is the matrix rate.
    _d("MI250X", {"fp32": 95.7, "fp16": 383, "bf16": 383}, 128, 3200, 50,
       "AMD Instinct MI250X datasheet: 95.7 FP32 matrix, 383 TFLOPS FP16/BF16 dense, "
       "128 GB HBM2e, 3.2 TB/s, Infinity Fabric links 50 GB/s each",
       gemm=_MI250X),
    _d("MI300X", {"fp32": 163.4, "tf32": 653.7, "fp16": 1307.4, "bf16": 1307.4,
                  "fp8": 2614.9}, 192, 5300, 448,
       "AMD Instinct MI300X datasheet: 163.4 FP32 matrix, 653.7 TF32, 1,307.4 FP16/BF16, "
       "2,614.9 FP8 TFLOPS dense, 192 GB HBM3, 5.3 TB/s, Infinity Fabric 896 GB/s aggregate",
       gemm=_MI300X),
)


# Vendor and product-line words that tell no part apart ("NVIDIA Tesla T4", "GeForce
# RTX 3090", "AMD Instinct MI250X"): a device name is matched without them.
_BRAND_WORDS = ("nvidia", "tesla", "geforce", "quadro", "amd", "instinct")


def _spelling(name: str) -> str:
    """`name` lower-cased, without `_BRAND_WORDS` and anything but letters and digits;
    the professional Ampere cards' "RTX A6000" is "a6000"."""
    s = name.lower()
    for word in _BRAND_WORDS:
        s = s.replace(word, "")
    s = "".join(ch for ch in s if ch.isascii() and ch.isalnum())
    return s[3:] if s.startswith("rtxa") else s


# The names the driver gives catalog parts (`nvidia-smi`, torch.cuda.get_device_name())
# where they carry more than the catalog's name (form factor, memory kind), as spelled
# by `_spelling`: "Tesla V100-SXM2-16GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB
# PCIe", "NVIDIA H100 80GB HBM3" (the SXM5 part), "Tesla P100-PCIE-16GB". ("Tesla
# V100-PCIE-16GB" and "NVIDIA A100-PCIE-40GB" spell catalog names themselves.)
DRIVER_NAMES: Mapping[str, str] = MappingProxyType({
    "v100sxm216gb": "V100-16GB", "v100sxm232gb": "V100-32GB",
    "a100sxm440gb": "A100-40GB", "a100sxm480gb": "A100-80GB", "a10080gbpcie": "A100-PCIe-80GB",
    "a800sxm480gb": "A800-80GB", "h10080gbhbm3": "H100-SXM",
    "p100pcie16gb": "P100-16GB",
})


def catalog_name(name: str, names: Iterable[str]) -> str | None:
    """The one of `names` that `name` is or spells (case, spaces, hyphens and vendor
    words aside: "Tesla T4" is T4, "RTX A6000" A6000, "a100 80gb" A100-80GB), or the
    catalog part the driver calls so (`DRIVER_NAMES`: "NVIDIA A100-SXM4-80GB"), or None:
    no match, or several (a name that does not tell the parts apart, such as "V100",
    matches none)."""
    names = list(names)
    if name in names:
        return name
    spelled = _spelling(name)
    found = [n for n in names if _spelling(n) == spelled] or \
        [n for n in names if n == DRIVER_NAMES.get(spelled)]
    return found[0] if len(found) == 1 else None


def builtin_device_types() -> dict[str, DeviceType]:
    """A fresh name -> DeviceType mapping of the built-in catalog (callers may extend it)."""
    return {d.name: d for d in _CATALOG}
