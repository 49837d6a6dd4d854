"""The built-in catalog of device types, from vendor spec sheets.

Each entry gives peak *dense* FP16/BF16 tensor FLOP/s (no structured sparsity), memory,
memory bandwidth and the typical intra-node link, with the document it comes from.
`efficiency` is the fraction of peak that large GEMM-bound training layers reach; it is
a modelling default (MFU-style studies report 0.4-0.6 on these parts) that calibration
replaces with measured numbers.
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

    @staticmethod
    def reserve_for(memory_bytes: float) -> float:
        """The catalog's runtime reserve of a GPU with `memory_bytes` of memory."""
        return RUNTIME_FIXED_BYTES + FRAGMENTATION_FRACTION * memory_bytes

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.efficiency


def _d(name, tflops, mem_gb, bw_gbs, link_gbs, source, latency_us=2.0):
    return DeviceType(name=name, peak_flops=tflops * 1e12, memory_bytes=mem_gb * 1e9,
                      mem_bandwidth_bytes_per_s=bw_gbs * 1e9,
                      link_bandwidth_bytes_per_s=link_gbs * 1e9,
                      link_latency_s=latency_us * 1e-6, source=source,
                      runtime_reserve_bytes=DeviceType.reserve_for(mem_gb * 1e9))


# NVLink figures are total bidirectional in NVIDIA's sheets; we store one direction (half).
# PCIe figures: Gen3 x16 ~16 GB/s, Gen4 x16 ~32 GB/s, Gen5 x16 ~64 GB/s per direction.
_CATALOG: tuple[DeviceType, ...] = (
    _d("V100-16GB", 125, 16, 900, 150,
       "NVIDIA Tesla V100 datasheet (SXM2): 125 TFLOPS tensor, 900 GB/s HBM2, NVLink 300 GB/s"),
    _d("V100-32GB", 125, 32, 900, 150,
       "NVIDIA Tesla V100 datasheet (SXM2 32GB): 125 TFLOPS tensor, 900 GB/s, NVLink 300 GB/s"),
    _d("A100-40GB", 312, 40, 1555, 300,
       "NVIDIA A100 datasheet (SXM4 40GB): 312 TFLOPS BF16 dense, 1,555 GB/s, NVLink 600 GB/s"),
    _d("A100-80GB", 312, 80, 2039, 300,
       "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS BF16 dense, 2,039 GB/s, NVLink 600 GB/s"),
    _d("H100-SXM", 989, 80, 3350, 450,
       "NVIDIA H100 datasheet (SXM5): 989 TFLOPS BF16 dense (1,979 sparse), 3.35 TB/s, "
       "NVLink 900 GB/s"),
    _d("H100-PCIe", 756, 80, 2000, 64,
       "NVIDIA H100 datasheet (PCIe): 756 TFLOPS BF16 dense (1,513 sparse), 2 TB/s, "
       "PCIe Gen5 128 GB/s", latency_us=5.0),
    _d("H200", 989, 141, 4800, 450,
       "NVIDIA H200 datasheet (SXM): 989 TFLOPS BF16 dense, 141 GB HBM3e, 4.8 TB/s, "
       "NVLink 900 GB/s"),
    _d("L4", 121, 24, 300, 32,
       "NVIDIA L4 datasheet: 121 TFLOPS BF16 dense (242 sparse), 24 GB GDDR6, 300 GB/s, "
       "PCIe Gen4 x16 64 GB/s", latency_us=5.0),
    _d("T4", 65, 16, 320, 16,
       "NVIDIA T4 datasheet: 65 TFLOPS FP16 mixed precision, 16 GB GDDR6, 320 GB/s, "
       "PCIe Gen3 x16 32 GB/s", latency_us=5.0),
    _d("A10", 125, 24, 600, 32,
       "NVIDIA A10 datasheet: 125 TFLOPS BF16 dense (250 sparse), 24 GB GDDR6, 600 GB/s, "
       "PCIe Gen4 64 GB/s", latency_us=5.0),
    _d("RTX-3090", 71, 24, 936, 32,
       "NVIDIA Ampere GA102 whitepaper: RTX 3090 71 TFLOPS FP16 tensor with FP32 accumulate, "
       "24 GB GDDR6X, 936 GB/s, PCIe Gen4", latency_us=5.0),
    _d("RTX-4090", 165.2, 24, 1008, 32,
       "NVIDIA Ada Lovelace whitepaper: RTX 4090 165.2 TFLOPS FP16 tensor with FP32 "
       "accumulate (dense), 24 GB GDDR6X, 1,008 GB/s, PCIe Gen4", latency_us=5.0),
    _d("MI250X", 383, 128, 3200, 50,
       "AMD Instinct MI250X datasheet: 383 TFLOPS FP16/BF16 dense, 128 GB HBM2e, 3.2 TB/s, "
       "Infinity Fabric links 50 GB/s each"),
    _d("MI300X", 1307.4, 192, 5300, 448,
       "AMD Instinct MI300X datasheet: 1,307.4 TFLOPS FP16/BF16 dense, 192 GB HBM3, 5.3 TB/s, "
       "Infinity Fabric 896 GB/s aggregate"),
)


def builtin_device_types() -> dict[str, DeviceType]:
    """A fresh name -> DeviceType mapping of the built-in catalog (callers may extend it)."""
    return {d.name: d for d in _CATALOG}
