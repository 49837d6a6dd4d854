"""The cost model: how long a layer's op takes on a device, and a transfer on a path.

Analytic by default (roofline: the larger of FLOPs / achievable FLOP/s and bytes /
memory bandwidth; transfers by latency + bytes / bandwidth of the slowest hop). A
calibration `Profile` measured on real hardware replaces any of these numbers: every
caller goes through this one interface, so nothing else needs to know which was used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyperpipe.cluster.cluster import Cluster, Link, Route
from hyperpipe.models import ModelSpec
from hyperpipe.plan.profile import Profile

# Mixed-precision Adam keeps 16 bytes per parameter: 2 (bf16 weight) + 2 (bf16 grad)
# + 4 (fp32 master weight) + 4 + 4 (fp32 moments). Rajbhandari et al. 2020 (ZeRO), sec. 3.1.
ADAM_MIXED_BYTES_PER_PARAM = 16
# An Adam step reads and writes the fp32 state and reads the gradient: about 2·12 + 2 + 2.
ADAM_STEP_BYTES_PER_PARAM = 28

BACKWARD_OPS = {"I": ("i_flops",), "W": ("w_flops",), "B": ("i_flops", "w_flops")}


def op_flops(model: ModelSpec, layer: int, micro_batch: int, op: str) -> float:
    """FLOPs of `op` (F, B, I, W) of one layer for one micro-batch."""
    c = model.layer_cost(layer, micro_batch)
    if op == "F":
        return c.fwd_flops
    return sum(getattr(c, name) for name in BACKWARD_OPS[op])


@dataclass(frozen=True)
class CostModel:
    """Times in seconds, sizes in bytes, for one model on one cluster."""

    model: ModelSpec
    cluster: Cluster
    profile: Profile | None = None
    state_bytes_per_param: float = ADAM_MIXED_BYTES_PER_PARAM
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    # ---------------------------------------------------------------- compute
    def op_flops(self, layer: int, micro_batch: int, op: str) -> float:
        return op_flops(self.model, layer, micro_batch, op)

    def layer_time_s(self, layer: int, device_type: str, micro_batch: int, op: str,
                     tp: int = 1) -> float:
        """Compute time of `op` of one layer on one device of a tensor-parallel group of tp."""
        kind = self.model.layers[layer].kind
        flops = self.op_flops(layer, micro_batch, op) / tp
        if self.profile is not None:
            fit = self.profile.compute.get(Profile.key(device_type, kind, op))
            if fit is not None:
                return fit(flops)
            if op == "B":
                i = self.profile.compute.get(Profile.key(device_type, kind, "I"))
                w = self.profile.compute.get(Profile.key(device_type, kind, "W"))
                if i is not None and w is not None:
                    return i(self.op_flops(layer, micro_batch, "I") / tp) + \
                        w(self.op_flops(layer, micro_batch, "W") / tp)
        dev = self.cluster.device_types[device_type]
        mem = self.model.layer_cost(layer, micro_batch).mem_bytes / tp
        mem *= {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}[op]
        return max(flops / dev.achievable_flops, mem / dev.mem_bandwidth_bytes_per_s)

    def stage_compute_s(self, layers: tuple[int, int], device_type: str, micro_batch: int,
                        op: str, tp: int = 1) -> float:
        """Compute time of `op` over layers [start, end) (no tensor-parallel communication),
        with the profile's per-action overhead, if any, counted once."""
        key = ("stage", layers, device_type, micro_batch, op, tp)
        if key not in self._cache:
            overhead = 0.0 if self.profile is None else \
                self.profile.action_overhead_s(device_type, op)
            self._cache[key] = overhead + sum(
                self.layer_time_s(i, device_type, micro_batch, op, tp) for i in range(*layers))
        return self._cache[key]

    def stage_time_s(self, layers: tuple[int, int], devices: tuple[str, ...],
                     micro_batch: int, op: str) -> float:
        """Compute plus Megatron-style tensor-parallel all-reduces of a stage's op."""
        dtype = self.cluster.device(devices[0]).type.name
        t = self.stage_compute_s(layers, dtype, micro_batch, op, len(devices))
        return t + self.tp_comm_s(layers, devices, micro_batch, op)

    def tp_comm_s(self, layers: tuple[int, int], devices: tuple[str, ...], micro_batch: int,
                  op: str) -> float:
        """Megatron tensor parallelism all-reduces the block output twice in forward and
        the input gradient twice in backward (Shoeybi et al. 2019, fig. 3); W needs none."""
        if len(devices) == 1 or op == "W":
            return 0.0
        blocks = sum(1 for i in range(*layers) if self.model.layers[i].kind == "block")
        nbytes = self.model.layer_cost(layers[0], micro_batch).send_bytes or \
            self.model.layer_cost(max(layers[0], 1), micro_batch).send_bytes
        return 2 * blocks * self.allreduce_time_s(devices, nbytes)

    # ---------------------------------------------------------------- communication
    def route(self, src: str, dst: str) -> tuple[Route, Link]:
        """The route between two devices and the link (latency, bandwidth) to cost it by."""
        key = ("route", src, dst)
        if key not in self._cache:
            route = self.cluster.path(src, dst)
            link = Link(route.bandwidth_bytes_per_s, route.link.latency_s)
            if self.profile is not None and route.hops:
                measured = self.profile.link(route.link_class)
                if measured is not None:
                    link = measured
            self._cache[key] = (route, link)
        return self._cache[key]

    def transfer_time_s(self, src: str, dst: str, nbytes: float) -> float:
        """Point-to-point time on idle links: latency + bytes / bandwidth (0 on one device)."""
        route, link = self.route(src, dst)
        return 0.0 if not route.hops else link.time_s(nbytes)

    def allreduce_time_s(self, devices: tuple[str, ...] | list[str], nbytes: float) -> float:
        """Ring all-reduce of `nbytes` per device: 2(n-1)/n · bytes over the slowest ring
        hop plus 2(n-1) latencies (Patarasuk and Yuan 2009)."""
        n = len(devices)
        if n <= 1 or nbytes <= 0:
            return 0.0
        links = [self.route(devices[i], devices[(i + 1) % n])[1] for i in range(n)]
        bw = min(link.bandwidth_bytes_per_s for link in links)
        lat = max(link.latency_s for link in links)
        if self.profile is not None and "*" in self.profile.allreduce:
            return self.profile.allreduce["*"](2 * (n - 1) / n * nbytes)
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat

    # ---------------------------------------------------------------- memory and optimizer
    def stage_params(self, layers: tuple[int, int]) -> int:
        return sum(self.model.layers[i].params for i in range(*layers))

    def state_bytes(self, layers: tuple[int, int], tp: int = 1) -> float:
        """Weights, gradients and optimizer state of a stage, per device of its TP group."""
        return self.stage_params(layers) * self.state_bytes_per_param / tp

    def stash_bytes(self, layers: tuple[int, int], micro_batch: int, tp: int = 1) -> float:
        """Activations one micro-batch keeps from its forward until its backward."""
        return sum(self.model.layer_cost(i, micro_batch).stash_bytes
                   for i in range(*layers)) / tp

    def send_bytes(self, layers: tuple[int, int], micro_batch: int) -> float:
        """Bytes a stage sends forward (its last layer's output); the same go back as grads."""
        return self.model.layer_cost(layers[1] - 1, micro_batch).send_bytes

    def optimizer_time_s(self, layers: tuple[int, int], device_type: str, tp: int = 1) -> float:
        params = self.stage_params(layers) / tp
        if self.profile is not None and device_type in self.profile.optimizer:
            return self.profile.optimizer[device_type](params)
        dev = self.cluster.device_types[device_type]
        return params * ADAM_STEP_BYTES_PER_PARAM / dev.mem_bandwidth_bytes_per_s
