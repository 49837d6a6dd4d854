"""Link emulation on one CPU machine: messages and collectives take the cluster's time.

Local ranks talk over loopback, so a plan whose bottleneck is a slow link (demo-hetero's
10 Gbit/s between its nodes) would run as if the link were free. When emulating, each
point-to-point message carries the sender's (aligned) clock at send time, and the
receiver holds it until the cluster's route would have delivered it: the messages of
one direction between two ranks cross their route one after another (NCCL runs a peer
pair's sends on one stream, as the simulator models), each taking bytes / bandwidth,
then the route's latency (`CostModel.transfer_time_s`). A data-parallel bucket is held
until the cost model's ring all-reduce of its bytes over the group's devices would have
finished, the group's buckets one after another. Flows of different rank pairs that
share a hop do not slow each other here (the simulator time-shares such hops): a lower
bound on the link's cost. `--no-emulate` turns this off together with compute
emulation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

STAMP_ELEMENTS = 2          # a float64 send time, carried as two float32 elements


def stamped(tensor: torch.Tensor, now_s: float) -> torch.Tensor:
    """`tensor` flattened (fp32) with the send time appended, bit-exact."""
    stamp = torch.tensor([now_s], dtype=torch.float64).view(torch.float32)
    return torch.cat([tensor.reshape(-1), stamp.to(tensor.device)])


def unstamped(buf: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, float]:
    """(payload of `shape`, send time) of a buffer that `stamped` filled."""
    sent_s = buf[-STAMP_ELEMENTS:].cpu().view(torch.float64).item()
    return buf[:-STAMP_ELEMENTS].view(shape), sent_s


class LinkEmulation:
    """When messages and collectives of one rank would have arrived on the cluster.

    `cost`: a CostModel of the plan's cluster (its routes' latency and bandwidth);
    `devices`: device name per rank; `clock`: the rank's aligned clock (seconds)."""

    def __init__(self, cost, devices: Sequence[str], clock: Callable[[], float]):
        self._cost, self._devices, self._clock = cost, devices, clock
        self._free_s: dict[tuple[int, int], float] = {}     # (src, dst) -> route free at

    def arrival_s(self, src: int, dst: int, sent_s: float, nbytes: float) -> float:
        """Arrival of a message of `nbytes` that rank `src` sent rank `dst` at `sent_s`,
        after the earlier messages of the same direction (call in send order)."""
        a, b = self._devices[src], self._devices[dst]
        total_s = self._cost.transfer_time_s(a, b, nbytes)
        latency_s = self._cost.transfer_time_s(a, b, 0.0)
        start = max(sent_s, self._free_s.get((src, dst), 0.0))
        self._free_s[(src, dst)] = start + total_s - latency_s
        return start + total_s

    def transfer_s(self, src: int, dst: int, nbytes: float) -> float:
        """Latency + bytes / bandwidth of the route between two ranks' devices."""
        return self._cost.transfer_time_s(self._devices[src], self._devices[dst], nbytes)

    def allreduce_s(self, ranks: Sequence[int], nbytes: float) -> float:
        """The cost model's ring all-reduce time of `nbytes` over the ranks' devices."""
        return self._cost.allreduce_time_s([self._devices[r] for r in ranks], nbytes)

    def hold(self, until_s: float) -> float:
        """Sleep until the clock reads `until_s`; return the clock."""
        while (left_s := until_s - self._clock()) > 0:
            time.sleep(left_s)
        return self._clock()
