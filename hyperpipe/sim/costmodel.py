"""The cost model: how long a layer's op takes on a device, and a transfer on a path.

Analytic by default: layers with shapes on devices with a GEMM curve op by op
(`hyperpipe.sim.compute`: each GEMM at its shape's efficiency, memory-bound kernels
added at the achievable memory bandwidth); otherwise the flat roofline (the larger of
FLOPs / achievable FLOP/s and bytes / memory bandwidth); transfers by latency + bytes /
bandwidth of the slowest hop. A
calibration `Profile` measured on real hardware replaces any of these numbers: every
caller goes through this one interface, so nothing else needs to know which was used.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple, TypeVar

from hyperpipe.cluster.cluster import (
    Cluster,
    Link,
    Route,
    hierarchical_all_reduce,
    link_sig,
    ring_channels,
)
from hyperpipe.core.errors import BadInput
from hyperpipe.models import ModelSpec
from hyperpipe.models.ops import LOGIT_BYTES, block_launches, layer_work, pass_launches
from hyperpipe.models.spec import DTYPE_BYTES, STORAGE_DTYPES
from hyperpipe.plan.profile import Fit, Profile
from hyperpipe.plan.stack import DEFAULT_STACK, Runtime, resolve_runtime
from hyperpipe.sim.compute import gemm_dtype, pass_time_s

# Bytes per parameter as Megatron-LM keeps them, per training dtype: (kept on every
# data-parallel replica, shardable by the distributed optimizer). Megatron Core user
# guide, "Distributed Optimizer": 20 / 18 / 16 bytes without it and 4 + 16/d, 6 + 12/d,
# 8 + 8/d with it over d data-parallel ranks, for fp16 params and grads / bf16 params with
# fp32 main grads / fp32; the split is ZeRO's (Rajbhandari et al. 2020, sec. 3.1: 2 + 2
# bytes of fp16 weight and gradient, K = 12 of fp32 master weight and Adam moments).
# bf16: 2 (bf16 weight) + 4 (fp32 main grad) kept; 4 (fp32 master) + 4 + 4 (Adam m, v).
STATE_BYTES_PER_PARAM: Mapping[str, tuple[float, float]] = MappingProxyType(
    {"fp16": (4.0, 16.0), "bf16": (6.0, 12.0), "fp32": (8.0, 8.0)})
# Gradient bytes per parameter that data parallelism reduces: Megatron reduces bf16
# training's fp32 main grads (accumulate_allreduce_grads_in_fp32) and fp16 training's fp16
# grads; torch AMP keeps fp32 grads of fp32 weights.
GRAD_BYTES_PER_PARAM: Mapping[str, float] = MappingProxyType(
    {"fp16": 2.0, "bf16": 4.0, "fp32": 4.0})
# Bytes per parameter of ZeRO-3's sharded state, all of it split over the data-parallel
# ranks: Rajbhandari et al. 2020 (ZeRO), fig. 1 and sec. 5.3, (2 + 2 + K) with K = 12 for
# mixed-precision Adam (half-precision weight and gradient, fp32 master weight and two
# moments); fp32 training 4 + 4 + 8. No half-precision copy of the weights persists:
# torch FSDP2 keeps the sharded fp32 parameter as the one the optimizer steps and casts
# it to `MixedPrecisionPolicy.param_dtype` only in the gathered, transient buffer
# (torch/distributed/fsdp/_fully_shard/_fsdp_param.py); DeepSpeed ZeRO-3 keeps a
# half-precision shard, a half-precision gradient shard and the fp32 master shard.
ZERO3_STATE_BYTES_PER_PARAM: Mapping[str, float] = MappingProxyType(
    {"fp16": 16.0, "bf16": 16.0, "fp32": 16.0})
# An Adam step reads and writes the fp32 state and reads the gradient: about 2·12 + 2 + 2.
ADAM_STEP_BYTES_PER_PARAM = 28


class StateBytes(NamedTuple):
    """Bytes per parameter of a training dtype and optimizer state
    (`ModelSpec.optimizer_state`)."""

    kept: float         # on every data-parallel replica: the weight and its gradient
    shardable: float    # what the distributed optimizer (ZeRO-1) splits
    zero3: float        # ZeRO-3's sharded state, all of it split
    grad: float         # the gradient data parallelism reduces
    weight: float       # the stored weight the forward starts from, what ZeRO gathers
    step: float         # what an Adam step reads and writes
    cast: bool          # the forward's weights are a cast of stored ones (a master copy)
    use_cast: float = 0.0   # moved by a cast of the weight at each use, and again by its
    #                         gradient's cast back in the backward (autocast; 0: none)

    @property
    def total(self) -> float:
        return self.kept + self.shardable


def param_bytes(dtype: str, optimizer_state: str = "mixed") -> StateBytes:
    """`StateBytes` of `dtype` under `optimizer_state`: "mixed" (the tables above: fp32
    master weights and Adam moments); "bf16-moments", the moments at 2 bytes each
    (DeepSeek-V3, arXiv 2412.19437 sec. 3.3.3: 4 bytes less per parameter, master
    weights and gradients in fp32; fp32 training keeps fp32 moments, as "mixed");
    "model-dtype", no master copy: weight, gradient and
    moments in the model dtype, stepped in place (torch.optim.Adam on a model cast to
    bf16, as NVIDIA NeMo Automodel's MoE models are by `initialize_weights`;
    fp32 training is the same as "mixed"); "autocast", torch's automatic mixed precision:
    weight, gradient and both moments in fp32 and no model-dtype copy kept (4 + 4 kept,
    8 sharded), each weight cast to the model dtype every time an op uses it (reads 4
    bytes, writes the dtype's) and its gradient cast back to fp32 in the backward
    (`torch.autocast`'s `cached_cast`; torch FSDP's `MixedPrecision(param_dtype=None)`,
    which gathers the fp32 weights: Composer's FSDP `mixed_precision: DEFAULT` of 2023,
    composer/trainer/mosaic_fsdp.py `get_mixed_precision`)."""
    dtype = STORAGE_DTYPES[dtype]          # tf32 keeps fp32's state, fp8 bf16's
    kept, shardable = STATE_BYTES_PER_PARAM[dtype]
    weight = float(DTYPE_BYTES[dtype])
    zero3, grad, step = ZERO3_STATE_BYTES_PER_PARAM[dtype], GRAD_BYTES_PER_PARAM[dtype], \
        float(ADAM_STEP_BYTES_PER_PARAM)
    cast = dtype != "fp32"
    if optimizer_state == "bf16-moments" and cast:
        return StateBytes(kept, shardable - 4.0, zero3 - 4.0, grad, weight, step - 8.0,
                          cast)
    if optimizer_state == "autocast" and cast:
        # an fp32 weight and gradient kept, two fp32 moments sharded; a step reads the
        # gradient and reads and writes the weight and both moments
        return StateBytes(8.0, 8.0, 16.0, 4.0, 4.0, 28.0, True, 4.0 + weight)
    if optimizer_state == "model-dtype" and cast:
        # weight and gradient kept, two moments sharded; a step reads the gradient and
        # reads and writes the weight and both moments
        return StateBytes(2 * weight, 2 * weight, 4 * weight, weight, weight, 7 * weight,
                          False)
    return StateBytes(kept, shardable, zero3, grad, weight, step, cast)


_T = TypeVar("_T")

BACKWARD_OPS = {"I": ("i_flops",), "W": ("w_flops",), "B": ("i_flops", "w_flops")}
# Transformer blocks, dense and MoE (`hyperpipe.models.spec.MoEBlock`): both all-reduce
# twice per pass under tensor parallelism (attention and MLP or experts).
BLOCK_KINDS = ("block", "moe")


def shared_bandwidths_bytes_per_s(routes: Sequence[Route]) -> list[float]:
    """Each route's bandwidth (bytes/s) while every one of `routes` carries one stream at
    the same time: a hop (one direction of a port or of a NIC) is shared equally among the
    streams crossing it, so a route gets the least, over its hops, of the hop's bandwidth
    / the streams on it (inf for a route without hops). Alone on its hops a route keeps
    its own bandwidth; k GPUs of a node sending across nodes through one NIC get the
    NIC's bandwidth / k each, through k NICs (one each, rail-optimised) all of it."""
    load = Counter(hop.name for route in routes for hop in route.hops)
    return [min((hop.bandwidth_bytes_per_s / load[hop.name] for hop in route.hops),
                default=float("inf")) for route in routes]


def op_flops(model: ModelSpec, layer: int, micro_batch: int, op: str) -> float:
    """FLOPs of `op` (F, B, I, W) of one layer for one micro-batch."""
    c = model.layer_cost(layer, micro_batch)
    if op == "F":
        return c.fwd_flops
    return sum(getattr(c, name) for name in BACKWARD_OPS[op])


class CostedRoute(NamedTuple):
    """A route between two devices and the link (latency, bandwidth) it is costed by."""

    route: Route
    link: Link


_Layers = tuple[int, int]
_Devices = tuple[str, ...]


@dataclass(eq=False)
class _Tables:
    """The cost model's look-ups: one table per pure function of its model, cluster and
    profile, keyed by that function's arguments."""

    # (layer, device type, micro-batch, op, tp, sequence parallel, cp) -> seconds
    layer_s: dict[tuple[int, str, int, str, int, bool, int], float] = \
        field(default_factory=dict)
    # (layer spec, device type, micro-batch, op, tp, sequence parallel, cp) -> seconds
    # or None
    op_s: dict[tuple[object, str, int, str, int, bool, int], float | None] = \
        field(default_factory=dict)
    # (layers, device type, micro-batch, op, tp, sequence parallel, cp) -> seconds
    stage_s: dict[tuple[_Layers, str, int, str, int, bool, int], float] = \
        field(default_factory=dict)
    tp_comm_s: dict[tuple[_Layers, _Devices, int, int], float] = field(default_factory=dict)
    routes: dict[tuple[str, str], CostedRoute] = field(default_factory=dict)
    allreduce_s: dict[_Devices, tuple[float, float]] = field(default_factory=dict)
    # `CostModel.ring_pattern` -> the all-reduce line of every device tuple of it
    allreduce_patterns: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    node_kinds: dict[str, tuple] = field(default_factory=dict)     # node -> (kind, NICs, devices)
    # (layers, micro-batch, tp, recompute, sequence parallel, cp) -> bytes
    stash_bytes: dict[tuple[_Layers, int, int, str, bool, int], float] = \
        field(default_factory=dict)
    send_bytes: dict[tuple[int, int], float] = field(default_factory=dict)  # (layer, mb)
    # (layers, tp, dp shards, zero, expert share, expert shards) -> bytes
    state_bytes: dict[tuple, float] = field(default_factory=dict)
    param_prefix: list[int] | None = None          # parameters of layers [0, i)
    memos: dict[str, object] = field(default_factory=dict)   # see `CostModel.memo`


@dataclass(frozen=True)
class CostModel:
    """Times in seconds, sizes in bytes, for one model on one cluster."""

    model: ModelSpec
    cluster: Cluster
    profile: Profile | None = None
    _tables: _Tables = field(default_factory=_Tables, compare=False, repr=False)

    def __post_init__(self) -> None:
        """BadInput naming the cluster's file (`Cluster.where`) when a device type has no
        peak for a dtype the model's GEMMs run in (a file's `peak_flops` table without it
        or its fallback: an fp8 model's other GEMMs run in bf16, `compute.gemm_dtype`)."""
        for dev in self.cluster.device_types.values():
            try:
                for linear in (True, False):
                    dev.peak_for(gemm_dtype(self.model.dtype, linear))
            except BadInput as exc:
                raise BadInput(f"{self.cluster.where}: device_types.{dev.name}."
                               "peak_flops", exc.expected, exc.got) from None

    def memo(self, name: str, make: Callable[[], _T]) -> _T:
        """The cache named `name` that lives as long as this cost model (made by `make()`
        on first use), for look-ups other modules derive from it (the analytic tier keeps
        its own here)."""
        memos = self._tables.memos
        if name not in memos:
            memos[name] = make()
        return memos[name]

    # ---------------------------------------------------------------- compute
    def op_flops(self, layer: int, micro_batch: int, op: str) -> float:
        return op_flops(self.model, layer, micro_batch, op)

    def layer_time_s(self, layer: int, device_type: str, micro_batch: int, op: str,
                     tp: int = 1, sequence_parallel: bool = False, cp: int = 1) -> float:
        """Compute time of `op` of one layer on one device of a tensor-parallel group of tp
        in a context-parallel group of cp (seconds; no communication). With cp > 1 the
        device holds s/cp tokens and its ring attention meets every key: 1/cp of the
        layer's work (with causal load balancing, two chunks per rank, as Megatron-LM's
        `get_batch_on_this_cp_rank` splits the sequence, every rank gets an equal share)."""
        table = self._tables.layer_s
        key = (layer, device_type, micro_batch, op, tp, sequence_parallel, cp)
        if key not in table:
            table[key] = self._layer_time_s(layer, device_type, micro_batch, op, tp,
                                            sequence_parallel, cp)
        return table[key]

    def _layer_time_s(self, layer: int, device_type: str, micro_batch: int, op: str,
                      tp: int, sequence_parallel: bool, cp: int = 1) -> float:
        kind = self.model.layers[layer].kind
        flops = self.op_flops(layer, micro_batch, op) / (tp * cp)
        if self.profile is not None and kind == "moe" and not any(
                Profile.key(device_type, "moe", o) in self.profile.compute for o in "FBIW"):
            t = self._moe_at_dense_rate_s(layer, device_type, micro_batch, op, tp, cp)
            if t is not None:
                return t
            kind = "block"
        if self.profile is not None:
            fit = self.profile.compute.get(Profile.key(device_type, kind, op))
            if fit is not None:
                return fit(flops)
            if op == "B":
                i = self.profile.compute.get(Profile.key(device_type, kind, "I"))
                w = self.profile.compute.get(Profile.key(device_type, kind, "W"))
                if i is not None and w is not None:
                    return i(self.op_flops(layer, micro_batch, "I") / (tp * cp)) + \
                        w(self.op_flops(layer, micro_batch, "W") / (tp * cp))
            b = self.profile.compute.get(Profile.key(device_type, kind, "B"))
            if op in ("I", "W") and b is not None and not any(
                    Profile.key(device_type, kind, o) in self.profile.compute for o in "IW"):
                # a profile of runs whose backward was whole (1F1B): its time split
                # between I and W in proportion to their FLOPs
                whole = self.op_flops(layer, micro_batch, "B")
                if whole <= 0.0:                # no FLOPs to split by: I holds it all
                    return b(0.0) if op == "I" else 0.0
                return b(whole / (tp * cp)) * self.op_flops(layer, micro_batch, op) / whole
        dev = self.cluster.device_types[device_type]
        cast = self._cast_s(layer, dev, op, tp)
        if dev.gemm is not None:
            t = self._op_time_s(layer, dev, micro_batch, op, tp, sequence_parallel, cp)
            if t is not None:
                return t + cast
        mem = self.model.layer_cost(layer, micro_batch).mem_bytes / (tp * cp)
        mem *= {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}[op]
        return max(flops / dev.achievable_flops_for(self.model.dtype),
                   mem / dev.mem_bandwidth_bytes_per_s) + cast

    def _cast_s(self, layer: int, dev, op: str, tp: int) -> float:
        """Seconds `op` of one layer spends casting weights under autocast
        (`StateBytes.use_cast`): F casts each weight it uses, W (and B, which holds it)
        casts each weight gradient back; I reuses the forward's casts, which autograd
        saved. An embedding's lookup is not autocast and casts nothing. A tensor rank
        casts its 1/tp of the weights, a context rank all of them. 0 without autocast.
        Under expert parallelism every routed expert is counted (an overestimate by the
        experts the rank does not hold)."""
        spec = self.model.layers[layer]
        per_param = self.param_state.use_cast
        if per_param == 0.0 or op == "I" or spec.kind == "embedding":
            return 0.0
        return spec.params / tp * per_param / dev.achievable_mem_bandwidth_bytes_per_s

    def _moe_at_dense_rate_s(self, layer: int, device_type: str, micro_batch: int, op: str,
                             tp: int, cp: int, local_experts: int | None = None
                             ) -> float | None:
        """An MoE block's `op` under a profile that fitted dense blocks only: the dense
        block's fit at the MoE block's FLOPs, plus the kernels the MoE block launches
        beyond a dense one (`models.ops.pass_launches`: router, permute, unpermute, one
        MLP per local expert, `local_experts` of them, None: all) at the dense fit's
        cost per launch, its intercept over the dense block's launches (what a pass
        costs however little its work, spread over the kernels it launches). B: I + W
        when the profile has no B fit; None without the dense fits. Nothing here is
        fitted to MoE runs."""
        spec = self.model.layers[layer]
        total = 0.0
        fit = self.profile.compute.get(Profile.key(device_type, "block", op))
        passes = (op,) if fit is not None or op != "B" else ("I", "W")
        for p in passes:
            f = self.profile.compute.get(Profile.key(device_type, "block", p))
            if f is None:
                return None
            ops = ("I", "W") if p == "B" else (p,)
            dense = sum(block_launches(spec.config, o) for o in ops)
            extra = sum(pass_launches(spec, o, local_experts) for o in ops) - dense
            total += f(self.op_flops(layer, micro_batch, p) / (tp * cp)) + \
                extra * max(0.0, f.a_s) / dense
        return total

    def expert_launch_delta_s(self, layer: int, device_type: str, micro_batch: int,
                              op: str, tp: int = 1, cp: int = 1, local_experts: int = 1
                              ) -> float:
        """Seconds `layer_time_s` of an MoE block changes by when the rank runs
        `local_experts` routed experts instead of all (expert parallelism), through the
        launches of their MLPs (`_moe_at_dense_rate_s`): 0 unless an MoE block is priced
        at a profile's dense-block fit."""
        if self.profile is None or self.model.layers[layer].kind != "moe" or any(
                Profile.key(device_type, "moe", o) in self.profile.compute for o in "FBIW"):
            return 0.0
        mine = self._moe_at_dense_rate_s(layer, device_type, micro_batch, op, tp, cp,
                                         local_experts)
        every = self._moe_at_dense_rate_s(layer, device_type, micro_batch, op, tp, cp)
        return 0.0 if mine is None or every is None else mine - every

    def _op_time_s(self, layer: int, dev, micro_batch: int, op: str, tp: int,
                   sequence_parallel: bool, cp: int = 1) -> float | None:
        """Op-by-op time of a shaped layer (`hyperpipe.sim.compute`); None if unshaped.
        B is I + W, each counted op by op."""
        spec = self.model.layers[layer]
        table = self._tables.op_s
        key = (spec, dev.name, micro_batch, op, tp, sequence_parallel, cp)
        if key not in table:
            passes = ("I", "W") if op == "B" else (op,)
            total = 0.0
            for p in passes:
                work = layer_work(spec, p, micro_batch, self.model.seq_len,
                                  self.model.dtype_bytes, tp, sequence_parallel, cp)
                if work is None:
                    table[key] = None
                    break
                total += pass_time_s(dev, work, self.model.dtype_bytes, self.model.dtype)
            else:
                table[key] = total
        return table[key]

    def stage_compute_s(self, layers: tuple[int, int], device_type: str, micro_batch: int,
                        op: str, tp: int = 1, sequence_parallel: bool = False, cp: int = 1
                        ) -> float:
        """Compute time of `op` over layers [start, end) (no tensor-parallel communication),
        with the profile's per-action overhead, if any, counted once."""
        table = self._tables.stage_s
        key = (layers, device_type, micro_batch, op, tp, sequence_parallel, cp)
        if key not in table:
            overhead = 0.0 if self.profile is None else \
                self.profile.action_overhead_s(device_type, op)
            table[key] = overhead + sum(
                self.layer_time_s(i, device_type, micro_batch, op, tp, sequence_parallel, cp)
                for i in range(*layers))
        return table[key]

    def action_overhead_s(self, devices: tuple[str, ...], op: str) -> float:
        """The profile's per-action overhead of `op` on a stage of `devices`, as
        `stage_time_s` counts it: once per action, stretched by the group's slowdown
        (0 without a profile)."""
        if self.profile is None:
            return 0.0
        dtype = self.cluster.device(devices[0]).type.name
        return self.profile.action_overhead_s(dtype, op) * self.cluster.slowdown(devices)

    def stage_time_s(self, layers: tuple[int, int], devices: tuple[str, ...],
                     micro_batch: int, op: str, recompute: str = "none",
                     sequence_parallel: bool = False, cp: int = 1) -> float:
        """Compute plus Megatron-style tensor-parallel collectives of a stage's op; the
        backward op that needs the activations (B, or I when the backward is split) first
        runs the recomputed forward: all of F with its collectives for "full", the
        attention core for "selective" (`recompute_s`). With sequence parallelism each
        all-reduce becomes a reduce-scatter and an all-gather of the same bytes (the same
        ring time), and the norm/dropout work is split over the group. The compute is
        stretched by the group's `Cluster.slowdown` (a straggler). With cp > 1 `devices`
        holds cp tensor-parallel groups of len(devices)/cp (tensor rank innermost), each
        on s/cp tokens; the ring-attention exchange is priced apart
        (`hyperpipe.sim.sharding`)."""
        dtype = self.cluster.device(devices[0]).type.name
        tp = len(devices) // cp
        t = self.stage_compute_s(layers, dtype, micro_batch, op, tp, sequence_parallel, cp)
        t *= self.cluster.slowdown(devices)
        if op in ("B", "I") and recompute != "none":
            t += self.recompute_s(layers, devices, micro_batch, recompute, sequence_parallel,
                                  cp)
        return t + self.tp_comm_s(layers, devices, micro_batch, op, cp)

    def recompute_s(self, layers: tuple[int, int], devices: tuple[str, ...],
                    micro_batch: int, recompute: str, sequence_parallel: bool = False,
                    cp: int = 1) -> float:
        """Time of the forward work a backward redoes: with "full" the stage's whole
        forward, tensor-parallel collectives included (Korthikanti et al. 2022, sec. 5:
        the recomputed forward repeats its all-reduces); with "selective" each layer's
        `recompute_fraction` of its forward time (the attention core, no collectives)."""
        if recompute == "none":
            return 0.0
        if recompute == "full" and all(self.model.recompute_fraction(i, micro_batch, "full")
                                       == 1.0 for i in range(*layers)):
            return self.stage_time_s(layers, devices, micro_batch, "F",
                                     sequence_parallel=sequence_parallel, cp=cp)
        dtype = self.cluster.device(devices[0]).type.name
        tp = len(devices) // cp
        t = self.cluster.slowdown(devices) * sum(
            self.model.recompute_fraction(i, micro_batch, recompute)
            * self.layer_time_s(i, dtype, micro_batch, "F", tp, sequence_parallel, cp)
            for i in range(*layers))
        if recompute == "full":
            blocks = [i for i in range(*layers)
                      if self.model.recompute_fraction(i, micro_batch, "full") == 1.0]
            if blocks:
                t += self.tp_comm_s((blocks[0], blocks[-1] + 1), devices, micro_batch, "F",
                                    cp)
        return t

    def stage_tp_comm_s(self, layers: tuple[int, int], devices: tuple[str, ...],
                        micro_batch: int, op: str, recompute: str = "none", cp: int = 1
                        ) -> tuple[float, float]:
        """The tensor-parallel collectives inside `stage_time_s`: (seconds on idle links,
        of which latency). Those of the op itself and, with full recompute, those of the
        recomputed forward. The simulator runs them as flows over the group's links."""
        if len(devices) == cp or op == "W":
            return 0.0, 0.0
        t = self.tp_comm_s(layers, devices, micro_batch, op, cp)
        if op in ("B", "I") and recompute == "full":
            t += self.tp_comm_s(layers, devices, micro_batch, "F", cp)
        if t <= 0.0:
            return 0.0, 0.0
        blocks = sum(1 for i in range(*layers) if self.model.layers[i].kind in BLOCK_KINDS)
        count = 2 * blocks * (2 if op in ("B", "I") and recompute == "full" else 1)
        # latency of one collective: its time for a vanishing message
        group = devices[:len(devices) // cp]
        lat = 0.0 if self.allreduce_fit(group) is not None else \
            self.allreduce_time_s(group, 1e-30)
        return t, min(t, count * lat)

    def tp_comm_s(self, layers: tuple[int, int], devices: tuple[str, ...], micro_batch: int,
                  op: str, cp: int = 1) -> float:
        """Megatron tensor parallelism all-reduces the block output twice in forward and
        the input gradient twice in backward (Shoeybi et al. 2019, fig. 3); W needs none.
        With cp > 1 each context rank's group (the first len(devices)/cp devices stand
        for all: they move alike on their own ports) reduces its s/cp tokens."""
        if len(devices) == cp or op == "W":
            return 0.0
        table = self._tables.tp_comm_s
        key = (layers, devices, micro_batch, cp)
        if key not in table:
            blocks = sum(1 for i in range(*layers)
                         if self.model.layers[i].kind in BLOCK_KINDS)
            nbytes = self.model.layer_cost(layers[0], micro_batch).send_bytes or \
                self.model.layer_cost(max(layers[0], 1), micro_batch).send_bytes
            table[key] = 2 * blocks * self.allreduce_time_s(devices[:len(devices) // cp],
                                                            nbytes / cp)
        return table[key]

    # ---------------------------------------------------------------- communication
    def route(self, src: str, dst: str) -> CostedRoute:
        """The route between two devices and the link (latency, bandwidth) to cost it by."""
        table = self._tables.routes
        key = (src, dst)
        if key not in table:
            route = self.cluster.path(src, dst)
            link = Link(route.bandwidth_bytes_per_s, route.link.latency_s)
            if self.profile is not None and route.hops:
                measured = self.profile.link(route.link_class)
                if measured is not None:
                    link = measured
            table[key] = CostedRoute(route, link)
        return table[key]

    def transfer_time_s(self, src: str, dst: str, nbytes: float) -> float:
        """Point-to-point time on idle links: latency + bytes / bandwidth (0 on one device)."""
        route, link = self.route(src, dst)
        return 0.0 if not route.hops else link.time_s(nbytes)

    def exchange_time_s(self, edges: list[tuple[str, str]], nbytes: float) -> float:
        """Each of `edges` (src, dst) sending `nbytes` at the same time (a ring step of
        point-to-point sends): the slowest edge's latency + bytes over its achievable
        bandwidth, hops shared among the edges crossing them (`_bus`); 0 when every edge
        stays on one device."""
        if not edges or nbytes <= 0:
            return 0.0
        bw, lat = self._bus(edges)
        return 0.0 if bw == float("inf") else lat + nbytes / bw

    def allgather_time_s(self, devices: tuple[str, ...] | list[str], nbytes: float) -> float:
        """All-gather (or reduce-scatter) of a tensor of `nbytes` in all among `devices`
        (each holding nbytes/n before, or after): half a ring all-reduce of the same
        size, (n-1)/n of the bytes over the slowest ring hop (Patarasuk and Yuan 2009;
        NCCL's ring all-reduce is a reduce-scatter then an all-gather), on idle links."""
        return self.allreduce_time_s(devices, nbytes) / 2

    def allreduce_time_s(self, devices: tuple[str, ...] | list[str], nbytes: float) -> float:
        """All-reduce of `nbytes` per device, as NCCL runs it (seconds on idle links).

        * Rings (`hyperpipe.cluster.cluster.ring_channels`): 2(n-1)/n · bytes over the
          slowest ring hop at its achievable bus bandwidth, plus 2(n-1) latencies
          (Patarasuk and Yuan 2009). Across nodes one ring (channel) per device of a
          node, each with its share of the bytes and leaving the node from another
          device, through that device's NIC: the rings' hops share each port and NIC
          (`shared_bandwidths_bytes_per_s`), so on nodes of k devices and c NICs a
          device's port carries (k-1)/k of the bytes and the node's NICs all of them,
          2(n-1)/n · bytes / min(bus / ((k-1)/k), c NICs' bus).
        * Several nodes of k devices each (k >= 2) whose switches reduce (NVLink SHARP,
          `DeviceType.nvlink_sharp`; `hierarchical_all_reduce`): hierarchical, NCCL's NVLS
          tree. Intra-node reduce-scatter ((k-1)/k · bytes), an inter-node ring of each
          device's 1/k shard on its rail (2(N-1)/N · bytes/k over N nodes), intra-node
          all-gather ((k-1)/k · bytes). The k rails run at once and share the NICs of
          their node: each rail gets a NIC's bandwidth / (k/c), so one NIC moves all k
          shards, 2(N-1)/N · bytes over its bandwidth. NCCL moves a collective in chunks
          through all its hops at once, so the phases overlap: the bytes take the slower
          of the node links (both intra phases) and the rails, and each phase's
          latencies add (NCCL's tuning model prices a ring at the bus bandwidth of its
          slowest hop, src/graph/tuning.cc). nccl-tests on two nodes of 8 H100 with 8
          NICs of 200 Gbit/s measured 47.5 ms for 8 GiB, against 50 ms for the slower
          phase alone, 95 ms for the phases one after another and 84 ms for rings
          (tests/sim/test_nic_sharing.py).

        Achievable bus bandwidth = link bandwidth x the device type's
        `collective_efficiency` (NVLink/PCIe) or `nic_efficiency` (network), from
        published nccl-tests runs (`hyperpipe.cluster.catalog`); inside a node without
        peer-to-peer, the host-staged rate (`Cluster.bus_efficiency`). A profile's
        all-reduce fit for the group's class replaces all of this (`allreduce_fit`).
        """
        n = len(devices)
        if n <= 1 or nbytes <= 0:
            return 0.0
        fit = self.allreduce_fit(devices)
        if fit is not None:
            return fit(2 * (n - 1) / n * nbytes)
        table = self._tables.allreduce_s
        key = tuple(devices)
        if key not in table:
            if self.profile is not None:       # measured links: each tuple its own
                table[key] = self._allreduce_line(key)
            else:
                lines = self._tables.allreduce_patterns
                pattern = self.ring_pattern(key)
                if pattern not in lines:
                    lines[pattern] = self._allreduce_line(key)
                table[key] = lines[pattern]
        fixed_s, s_per_byte = table[key]
        return fixed_s + s_per_byte * nbytes

    def allreduce_fit(self, devices: tuple[str, ...] | list[str]) -> Fit | None:
        """The profile's measured all-reduce for a group of `devices` (`Profile.
        allreduce_fit` of its `Cluster.group_class`); None without one: the group is
        priced from its links."""
        if self.profile is None or not self.profile.allreduce:
            return None
        return self.profile.allreduce_fit(self.cluster.group_class(devices))

    def ring_pattern(self, devices: tuple[str, ...]) -> tuple:
        """What an all-reduce's line depends on under the cluster's topology model
        (`hyperpipe.cluster.cluster`: a port per device inside its node, NICs into a
        non-blocking fabric, device i of a node of n leaving through NIC i·count // n):
        per device its node's kind (device type, devices, intra link, NIC, NICs,
        peer-to-peer, and its region where a path of the cluster's `links` names it),
        its node numbered in order of first appearance, and its NIC
        numbered in order of first appearance on that node. Tuples of one pattern cross
        hops shared alike, so they cost the same (rings of the same devices' positions
        over the same kinds of links)."""
        kinds = self._tables.node_kinds
        seen: dict[str, int] = {}
        rails: dict[str, dict[int, int]] = {}
        out = []
        for name in devices:
            dev = self.cluster.device(name)
            got = kinds.get(dev.node)
            if got is None:            # (links as numbers: the pattern is hashed a lot)
                n = self.cluster.node(dev.node)
                got = kinds[dev.node] = ((n.device_type, n.count, link_sig(n.intra_link),
                                          link_sig(n.nic), link_sig(n.nics),
                                          n.peer_to_peer,
                                          self.cluster.linked_region(n.name)),
                                         n.nics.count, n.count)
            kind, nic_count, per_node = got
            mine = rails.setdefault(dev.node, {})
            nic = mine.setdefault(dev.index * nic_count // per_node, len(mine))
            out.append((kind, seen.setdefault(dev.node, len(seen)), nic))
        return tuple(out)

    def _allreduce_line(self, devices: tuple[str, ...]) -> tuple[float, float]:
        """`allreduce_time_s` over `devices` as (seconds of latency, seconds per byte):
        both of NCCL's algorithms above are affine in the bytes."""
        n = len(devices)
        cluster = self.cluster
        per_node: dict[str, list[str]] = {}
        for d in devices:
            per_node.setdefault(cluster.device(d).node, []).append(d)
        groups = list(per_node.values())
        if not hierarchical_all_reduce(groups, all(map(cluster.switch_reduces, per_node))):
            # rings (one per channel), each 1/len(rings) of the bytes, all at once
            rings = ring_channels(groups)
            bw, lat = self._bus([(r[i], r[(i + 1) % n]) for r in rings for i in range(n)])
            return 2 * (n - 1) * lat, 2 * (n - 1) / n / len(rings) / bw
        k, nodes = len(groups[0]), len(groups)          # k devices on each node
        bw_in, lat_in = self._bus([(g[i], g[(i + 1) % k]) for g in groups for i in range(k)])
        # rail r: the r-th device of every node, in node order
        rails = [[g[r] for g in groups] for r in range(k)]
        bw_out, lat_out = self._bus([(rail[i], rail[(i + 1) % nodes])
                                     for rail in rails for i in range(nodes)])
        # intra-node reduce-scatter and all-gather ((k-1)/k of the bytes each) and each
        # rail's shard of 1/k around the nodes, pipelined: the slower sets the bytes' time
        fixed_s = 2 * (k - 1) * lat_in + 2 * (nodes - 1) * lat_out
        per_byte = max(2 * (k - 1) / k / bw_in, 2 * (nodes - 1) / nodes / k / bw_out)
        return fixed_s, per_byte

    def _bus(self, edges: list[tuple[str, str]]) -> tuple[float, float]:
        """(achievable bus bandwidth, latency) of the slowest of `edges`, which all carry
        a stream at once: each route's bandwidth, shared on every hop among the edges
        crossing it (`shared_bandwidths_bytes_per_s`: the rails of a node sharing its
        NICs), x `Cluster.bus_efficiency` (the sender's collective or NIC efficiency,
        host-staged inside a node without peer-to-peer)."""
        costed = [self.route(a, b) for a, b in edges]
        shared = shared_bandwidths_bytes_per_s([c.route for c in costed])
        bw, lat = float("inf"), 0.0
        for (a, _), (route, link), own_bw in zip(edges, costed, shared, strict=True):
            if not route.hops:
                continue
            eff = self.cluster.bus_efficiency(a, route.link_class)
            share = own_bw / route.bandwidth_bytes_per_s      # 1 when nothing shares
            bw = min(bw, link.bandwidth_bytes_per_s * share * eff)
            lat = max(lat, link.latency_s)
        return bw, lat

    # ---------------------------------------------------------------- memory and optimizer
    def stage_params(self, layers: tuple[int, int]) -> int:
        """Parameters of layers [a, b), from prefix sums over the model's layers. With
        tied embeddings a range holding both the embedding and the head counts their
        shared matrix once; a stage holding one of them holds its own copy (Megatron's
        last pipeline stage keeps `shared_embedding_or_output_weight`)."""
        prefix = self._tables.param_prefix
        if prefix is None:
            prefix = self._tables.param_prefix = [0, *itertools.accumulate(
                layer.params for layer in self.model.layers)]
        both = layers[0] == 0 and layers[1] == self.model.num_layers
        return prefix[layers[1]] - prefix[layers[0]] - (self.tied_params() if both else 0)

    def expert_params(self, layers: tuple[int, int]) -> int:
        """Parameters of the routed experts among layers [a, b) (`MoEBlock.expert_params`):
        what expert parallelism splits over its ranks."""
        return sum(getattr(self.model.layers[i], "expert_params", 0) for i in range(*layers))

    def tied_params(self) -> int:
        """Parameters of the embedding matrix the head reuses (`ModelSpec.tied_params`;
        0 when untied): what the first and last stage all-reduce the gradient of."""
        return self.model.tied_params

    @property
    def param_state(self) -> StateBytes:
        """Bytes per parameter of the model's dtype and optimizer state
        (`param_bytes`)."""
        return self.memo("param_state",
                         lambda: param_bytes(self.model.dtype, self.model.optimizer_state))

    @property
    def state_bytes_per_param(self) -> float:
        """Weights, gradients and optimizer state per parameter without the distributed
        optimizer (18 for bf16 with fp32 master weights: `STATE_BYTES_PER_PARAM`)."""
        return self.param_state.total

    @property
    def grad_bytes_per_param(self) -> float:
        """Bytes per parameter of the gradients data parallelism reduces."""
        return self.param_state.grad

    def dp_sync_bytes_per_param(self, distributed_optimizer: bool = False,
                                runtime: Runtime | None = None, zero: int | None = None,
                                reshard_after_forward: bool = True) -> float:
        """Bytes per parameter that the data-parallel gradient sync moves, in all-reduce
        terms, on the stack `runtime` describes (None: megatron-lm's defaults): the
        gradients' all-reduce (`Runtime.grad_bytes_per_param`, the model dtype's rule
        unless the runtime names a dtype); with the distributed optimizer a
        reduce-scatter of the gradients and an all-gather of the updated weights
        (Megatron's distributed optimizer, ZeRO-1), each carrying (n-1)/n of its tensor,
        half of a ring all-reduce of the same size: (grad + weight bytes) / 2, the weight
        the stored one (`StateBytes.weight`: fp32 under autocast); on a stack
        that all-reduces the gradients in full before the sharded step
        (`Runtime.allreduce_sharded_grads`: DeepSpeed's pipeline engine with bf16),
        grad + weight bytes / 2.

        `zero` (None: 1 with the distributed optimizer, else 0) 2: the gradients are
        reduce-scattered during every micro-batch's backward (priced there, `hyperpipe.
        sim.sharding`), leaving the all-gather of the updated weights: weight bytes / 2.
        3: the weights are gathered before use (priced in the actions); with
        `reshard_after_forward` the gradients are reduce-scattered every micro-batch too
        (nothing left: 0), without it once per step here: grad bytes / 2."""
        rt = runtime if runtime is not None else resolve_runtime(DEFAULT_STACK)
        grad = rt.grad_bytes_per_param(self.grad_bytes_per_param)
        zero = (1 if distributed_optimizer else 0) if zero is None else zero
        weight = self.param_state.weight
        if zero == 2:
            return weight / 2
        if zero == 3:
            return 0.0 if reshard_after_forward else grad / 2
        if zero == 0:
            return grad
        if self.model.storage_dtype in rt.allreduce_sharded_grads:
            return grad + weight / 2
        return (grad + weight) / 2

    def state_bytes(self, layers: tuple[int, int], tp: int = 1, dp_shards: int = 1,
                    zero: int | None = None, *, expert_share: float = 1.0,
                    expert_shards: int | None = None) -> float:
        """Weights, gradients and optimizer state of a stage, per device of its TP group;
        with the distributed optimizer the fp32 master weights and Adam moments are split
        over the `dp_shards` data-parallel ranks that hold the same layers (ZeRO-1).
        `zero` (None: ZeRO-1's split over `dp_shards`) 2 splits the gradients too, 3 all
        of it (`ZERO3_STATE_BYTES_PER_PARAM`); what ZeRO-3 gathers while it computes is
        `zero3_working_bytes`. With expert parallelism a device holds `expert_share` of
        the routed experts (`expert_params`), sharded over `expert_shards` ranks (their
        expert-data-parallel group; None: `dp_shards`)."""
        table = self._tables.state_bytes
        key = (layers, tp, dp_shards, zero, expert_share, expert_shards)
        if key in table:
            return table[key]
        bytes_ = self.param_state
        kept, shardable, weight = bytes_.kept, bytes_.shardable, bytes_.weight
        grad = kept - weight

        def per_param(n: int) -> float:
            return {None: kept + shardable / n, 0: kept + shardable,
                    1: kept + shardable / n, 2: weight + (grad + shardable) / n,
                    3: bytes_.zero3 / n}[zero]
        experts = self.expert_params(layers) if expert_share != 1.0 or \
            expert_shards not in (None, dp_shards) else 0
        dense = self.stage_params(layers) - experts
        table[key] = (dense * per_param(dp_shards) + experts * expert_share * per_param(
            dp_shards if expert_shards is None else expert_shards)) / tp
        return table[key]

    def zero3_working_bytes(self, layers: tuple[int, int], tp: int = 1,
                            reshard_after_forward: bool = True, *,
                            expert_share: float = 1.0, expert_shards: int | None = None
                            ) -> float:
        """Bytes ZeRO-3/FSDP holds unsharded on top of its shards, per device of a TP
        group. Resharding after forward (FSDP's FULL_SHARD; torchtitan wraps each block in
        `fully_shard`): the weights of two units (the one computing and the one
        prefetched) and one unit's unsharded gradient before its reduce-scatter, a unit
        being one layer (the largest counts). Without it (torchtitan with pipelining):
        the stage's whole weights, from its first forward to its last backward, and its
        whole gradient, accumulated unsharded until the last backward
        (`set_requires_gradient_sync(False)` on the other micro-batches, torch/
        distributed/pipelining/stage.py `backward_maybe_with_nosync`). Under expert
        parallelism a rank gathers only the routed experts it holds, `expert_share` of
        them (torchtitan shards them with `fully_shard` over the expert-data-parallel
        mesh `dp_mod_ep`, torchtitan/models/llama4/infra/parallelize.py `apply_fsdp`): a
        unit counts its other parameters and that share of its `expert_params`, none of
        them when their shard group is one rank (`expert_shards` 1) and the weights are
        stored in the dtype the forward uses (`StateBytes.cast` false: fp32, or
        `optimizer_state` "model-dtype"), so that nothing is gathered nor cast (NeMo
        Automodel leaves them out of FSDP then: `ignored_params`, nemo_automodel/
        components/moe/parallelizer.py `apply_fsdp`)."""
        bytes_ = self.param_state
        kept, weight = bytes_.kept, bytes_.weight
        grad = kept - weight
        share = 0.0 if expert_shards == 1 and not bytes_.cast else expert_share

        def held(i: int) -> float:
            layer = self.model.layers[i]
            return layer.params - getattr(layer, "expert_params", 0) * (1.0 - share)
        if not reshard_after_forward:
            return sum(held(i) for i in range(*layers)) * kept / tp
        unit = max(held(i) for i in range(*layers))
        return unit * (2 * weight + grad) / tp

    def stash_bytes(self, layers: tuple[int, int], micro_batch: int, tp: int = 1, *,
                    recompute: str = "none", sequence_parallel: bool = False, cp: int = 1
                    ) -> float:
        """Activations one micro-batch keeps from its forward until its backward, per
        device of the stage's tensor-parallel group (Korthikanti et al. 2022; see
        `TransformerBlock.stash_bytes`); with context parallelism a rank keeps its s/cp
        tokens' share, 1/cp of it (every term is linear in the rank's tokens, eager
        attention's scores too: its s/cp queries against s keys)."""
        table = self._tables.stash_bytes
        key = (layers, micro_batch, tp, recompute, sequence_parallel, cp)
        if key not in table:
            table[key] = sum(
                self.model.stash_bytes(i, micro_batch, tp=tp, recompute=recompute,
                                       sequence_parallel=sequence_parallel)
                for i in range(*layers)) / cp
        return table[key]

    def recompute_work_bytes(self, layers: tuple[int, int], micro_batch: int, tp: int = 1, *,
                             recompute: str = "none", sequence_parallel: bool = False,
                             cp: int = 1) -> float:
        """Bytes a recomputing backward holds on top of the stash, one layer at a time:
        what the recomputed forward of one layer rebuilds before its backward runs (the
        largest over the stage's layers; 0 without recompute)."""
        if recompute == "none":
            return 0.0
        return max(self.model.stash_bytes(i, micro_batch, tp=tp,
                                          sequence_parallel=sequence_parallel)
                   - self.model.stash_bytes(i, micro_batch, tp=tp, recompute=recompute,
                                            sequence_parallel=sequence_parallel)
                   for i in range(*layers)) / cp

    def runtime_reserve_bytes(self, device_type: str) -> float:
        """Device memory the runtime holds besides tensors (CUDA context, NCCL buffers,
        allocator fragmentation): the catalog's `runtime_reserve_bytes`."""
        return self.cluster.device_types[device_type].runtime_reserve_bytes

    def stage_stash_bytes(self, stage, micro_batch: int, keeps_outputs: bool = False
                          ) -> float:
        """`stash_bytes` of a plan stage (`StagePlan`), with its recompute, sequence
        parallelism and context parallelism; with `keeps_outputs` (a stack whose engine
        holds each stage output until the backward: `Runtime.keeps_stage_outputs`) plus
        `stage_output_bytes`."""
        cp = getattr(stage, "cp", 1)
        stash = self.stash_bytes(stage.layers, micro_batch, stage.tp, recompute=stage.recompute,
                                 sequence_parallel=stage.sequence_parallel, cp=cp)
        if keeps_outputs:
            stash += self.stage_output_bytes(stage.layers, micro_batch, stage.tp) / cp
        return stash

    def _head_logits(self, layers: tuple[int, int], micro_batch: int) -> float:
        """Logit elements of one micro-batch when the range ends with a GPT head, else 0."""
        last = self.model.layers[layers[1] - 1]
        vocab = getattr(getattr(last, "config", None), "vocab_size", None)
        if last.kind != "head" or vocab is None:
            return 0.0
        return float(micro_batch * self.model.seq_len * vocab)

    def stage_output_bytes(self, layers: tuple[int, int], micro_batch: int, tp: int = 1
                           ) -> float:
        """Bytes of a stage's forward output per device of its tensor-parallel group: the
        activations it sends (`send_bytes`), or on a stage ending with the head its fp32
        logits (vocab-parallel: 1/tp each); with tp > 1 DeepSpeed keeps only this rank's
        1/tp part of the activations (`PartitionedTensor`, deepspeed/runtime/pipe/
        engine.py `_exec_forward_pass`). Megatron-DeepSpeed's `GPTModelPipe` ends with a
        `float16_to_fp32` layer, so the output its engine keeps is the fp32 copy of the
        logits, a buffer apart from the cross-entropy's saved softmax (the stash):
        BigScience's `vocab_parallel_cross_entropy` clones its input, Microsoft's
        subtracts the maximum out of place. (Megatron-LM v1.1.5 worked in place on it,
        one buffer for both: docs/accuracy.md.)"""
        logits = self._head_logits(layers, micro_batch)
        if logits > 0:
            return logits * LOGIT_BYTES / tp
        return self.send_bytes(layers, micro_batch) / tp

    def head_backward_work_bytes(self, layers: tuple[int, int], micro_batch: int,
                                 tp: int = 1, cp: int = 1) -> float:
        """Bytes the head's backward holds on top of the stash, per device (0 for a range
        without the head): Megatron computes the cross-entropy on an fp32 copy of the
        logits (`vocab_parallel_cross_entropy(output.float(), labels)`, megatron/model/
        gpt2_model.py and Megatron-DeepSpeed's `CrossEntropy`), whose backward writes the
        fp32 gradient in place of the saved softmax (megatron/mpu/cross_entropy.py
        `_VocabParallelCrossEntropy.backward`) and then casts it to the model dtype, a
        new tensor while the fp32 one still lives: one micro-batch's logits in the model
        dtype, split over tp (and cp)."""
        return self._head_logits(layers, micro_batch) * self.model.dtype_bytes / (tp * cp)

    def device_static_bytes(self, stages, micro_batch: int, dp_shards: int = 1, *,
                            zero: int | None = None, reshard_after_forward: bool = True,
                            shards_of=None, experts_of=None) -> float:
        """Bytes a device holds all iteration long for the plan stages (`StagePlan`s) it
        runs: their state (`state_bytes` with `zero`, over `dp_shards` ranks, or
        `shards_of(stage)` when given), the largest backward working set among them
        (recompute's, or the head's `head_backward_work_bytes`, which runs before any
        block of its stage is recomputed: one at a time), with ZeRO-3 what it holds unsharded
        (`zero3_working_bytes`: every stage's whole weights and gradient without
        resharding, else the largest stage's units), and the runtime reserve of its
        device type. `experts_of(stage)`: (expert share, expert shards) of a stage under
        expert parallelism (`state_bytes`); None: every expert, sharded as the rest."""
        dtype = self.cluster.device(stages[0].devices[0]).type.name
        shards = [dp_shards if shards_of is None else shards_of(st) for st in stages]
        experts = [(1.0, None) if experts_of is None else experts_of(st) for st in stages]
        state = sum(self.state_bytes(st.layers, st.tp, n, zero, expert_share=e[0],
                                     expert_shards=e[1])
                    for st, n, e in zip(stages, shards, experts, strict=True))
        work = max(max(self.recompute_work_bytes(st.layers, micro_batch, st.tp,
                                                 recompute=st.recompute,
                                                 sequence_parallel=st.sequence_parallel,
                                                 cp=getattr(st, "cp", 1)),
                       self.head_backward_work_bytes(st.layers, micro_batch, st.tp,
                                                     getattr(st, "cp", 1)))
                   for st in stages)
        if zero == 3:
            gathered = [self.zero3_working_bytes(st.layers, st.tp, reshard_after_forward,
                                                 expert_share=e[0], expert_shards=e[1])
                        for st, e in zip(stages, experts, strict=True)]
            work += sum(gathered) if not reshard_after_forward else max(gathered)
        return state + work + self.runtime_reserve_bytes(dtype)

    def send_bytes(self, layers: tuple[int, int], micro_batch: int) -> float:
        """Bytes a stage sends forward (its last layer's output); the same go back as grads."""
        table = self._tables.send_bytes
        key = (layers[1] - 1, micro_batch)
        if key not in table:
            table[key] = self.model.layer_cost(layers[1] - 1, micro_batch).send_bytes
        return table[key]

    def rank_params(self, layers: tuple[int, int], tp: int = 1, shards: int = 1, *,
                    expert_share: float = 1.0, expert_shards: int | None = None) -> float:
        """Parameters of layers [a, b) one device of a tensor-parallel group of `tp`
        holds a share of: 1/tp of them, the dense ones split over `shards` ranks, of the
        routed experts `expert_share` split over `expert_shards` (None: `shards`)."""
        experts = self.expert_params(layers) if expert_share != 1.0 or \
            expert_shards not in (None, shards) else 0
        return ((self.stage_params(layers) - experts) / shards + experts * expert_share
                / (shards if expert_shards is None else expert_shards)) / tp

    def grad_accumulate_s(self, layers: tuple[int, int], devices: tuple[str, ...], tp: int,
                          bytes_per_param: float, *, expert_share: float = 1.0) -> float:
        """One micro-batch's weight gradients of a stage added into full fp32 buffers on
        one device of its tensor-parallel group `devices` (`bytes_per_param` of memory
        traffic per parameter it holds, `rank_params` unsharded, at the device's
        achievable memory bandwidth, stretched by the group's `Cluster.slowdown`)."""
        dev = self.cluster.device(devices[0]).type
        params = self.rank_params(layers, tp, expert_share=expert_share, expert_shards=1)
        return self.cluster.slowdown(devices) * params * bytes_per_param / \
            dev.achievable_mem_bandwidth_bytes_per_s

    def optimizer_time_s(self, layers: tuple[int, int], device_type: str, tp: int = 1,
                         dp_shards: int = 1, devices: tuple[str, ...] = (), *,
                         expert_share: float = 1.0, expert_shards: int | None = None
                         ) -> float:
        """The optimizer step of a stage's parameters on one device; with the distributed
        optimizer each of the `dp_shards` replicas updates its shard only; with `devices`
        (the tensor-parallel group) stretched by its `Cluster.slowdown`. Under expert
        parallelism the device updates `expert_share` of the routed experts, split over
        `expert_shards` (None: `dp_shards`)."""
        slow = self.cluster.slowdown(devices) if devices else 1.0
        params = self.rank_params(layers, tp, dp_shards, expert_share=expert_share,
                                  expert_shards=expert_shards)
        if self.profile is not None and device_type in self.profile.optimizer:
            return slow * self.profile.optimizer[device_type](params)
        dev = self.cluster.device_types[device_type]
        return slow * params * self.param_state.step / \
            dev.achievable_mem_bandwidth_bytes_per_s
