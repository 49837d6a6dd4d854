"""Communication of one rank: point-to-point activations and gradients, and the link
probe (the data-parallel reduction is dataparallel.py's).

Every transfer is asynchronous (isend / irecv) and every wait has a timeout, so a dead
peer turns into an exception, never a hang. Shapes come from the model spec, so no
metadata crosses the wire: a receive is a preallocated buffer and a tag. With emulated
links (exec.links) a message carries its flow number too (`stamped`), so that the
receiver can hold it until its flow has crossed the emulated links.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from hyperpipe.plan.trace import TraceEvent

ACTIVATION, GRADIENT = 0, 1
STAMP_ELEMENTS = 2          # a float64 flow number, carried as two float32 elements
PROBE_SIZES_BYTES = (1 << 10, 1 << 14, 1 << 18, 1 << 22)   # 1 KiB .. 4 MiB
PROBE_REPEATS = 5
_PROBE_TAG = 1 << 30              # above every message tag of a step


def message_tag(kind: int, stage: int, microbatch: int, num_microbatches: int) -> int:
    """Tag of the activation (kind 0) or gradient (kind 1) that flows into `stage` for
    `microbatch`: unique within a step of one pipeline, so receives match sends exactly
    whatever order they are posted in."""
    return (stage * num_microbatches + microbatch) * 2 + kind


def stamped(tensor: torch.Tensor, number: int) -> torch.Tensor:
    """`tensor` flattened (fp32) with a flow number appended, bit-exact."""
    stamp = torch.tensor([float(number)], dtype=torch.float64).view(torch.float32)
    return torch.cat([tensor.reshape(-1), stamp.to(tensor.device)])


def unstamped(buf: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """(payload of `shape`, flow number) of a buffer that `stamped` filled."""
    number = buf[-STAMP_ELEMENTS:].cpu().view(torch.float64).item()
    return buf[:-STAMP_ELEMENTS].view(shape), int(number)


class PeerFailure(RuntimeError):
    """A transfer failed because of the other side (it died, closed, or never answered):
    the launcher blames the peer's own failure before this one."""


def wait(work: dist.Work, timeout_s: float, what: str) -> None:
    """Wait for `work`; raise PeerFailure naming `what` if it fails or `timeout_s` passes."""
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise PeerFailure(f"{what}: {str(exc).splitlines()[0]}") from exc
    if ok is False:
        raise PeerFailure(f"{what}: no answer within {timeout_s:g} s")


class PendingSends:
    """Sends in flight: kept alive until done, and recorded as `send` trace events."""

    def __init__(self, timeout_s: float, clock: Callable[[], float]):
        self._timeout_s = timeout_s
        self._clock = clock
        self._inflight: list[tuple[dist.Work, torch.Tensor, TraceEvent]] = []

    def send(self, tensor: torch.Tensor, dst: int, tag: int, group: dist.ProcessGroup,
             event: TraceEvent) -> None:
        """Post `tensor` to rank `dst`; `event` (op send, start set) is completed later."""
        self._inflight.append((dist.isend(tensor, dst, group=group, tag=tag), tensor, event))

    def reap(self, events: list[TraceEvent], *, block: bool = False) -> None:
        """Move finished sends into `events` (all of them, waiting, when `block`)."""
        keep = []
        for work, tensor, ev in self._inflight:
            if block:
                wait(work, self._timeout_s, f"send to {ev.peer}")
            elif not work.is_completed():
                keep.append((work, tensor, ev))
                continue
            events.append(_ended(ev, self._clock()))
        self._inflight = keep


def _ended(ev: TraceEvent, end_s: float) -> TraceEvent:
    return TraceEvent(ev.device, ev.op, ev.stage, ev.microbatch, ev.start_s, end_s,
                      ev.bytes, ev.peer, ev.step)


class Channels:
    """One process group per direction of every pair of ranks that exchange activations.

    NCCL runs the point-to-point operations of a group in order on one stream, so a
    receive posted early would hold back a send queued behind it on the same stream
    (the peer waiting for that send: deadlock). With a group per direction, a rank's
    sends to a peer and its receives from that peer never share a stream, and within
    one direction the receiver posts in the sender's order. gloo takes the same path
    (its tags would be enough), so the code NCCL runs is the code the CPU tests run.
    Every rank of the job must construct it, with the same pairs in the same order.
    """

    def __init__(self, pairs: Sequence[tuple[int, int]], timeout_s: float):
        self._groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        for a, b in pairs:
            for src, dst in ((a, b), (b, a)):
                self._groups[(src, dst)] = dist.new_group(
                    [a, b], timeout=timedelta(seconds=timeout_s))

    def group(self, src: int, dst: int) -> dist.ProcessGroup:
        return self._groups[(src, dst)]


def probe_links(pairs: Sequence[tuple[int, int]], rank: int, devices: Sequence[str],
                clock: Callable[[], float], timeout_s: float, device: torch.device,
                links=None) -> list[TraceEvent]:
    """Ping-pong between each pair of ranks (a, b) that hold adjacent stages: for each
    size in PROBE_SIZES_BYTES, one warm-up round and PROBE_REPEATS timed ones. Each timed
    round becomes a `send` event from a to b (step -1, `bytes` the message size) lasting
    half the round trip. Pairs go one after another in the given (global) order. With
    `links` (exec.links.Links, the link emulator's client) every message of the probe is
    a flow over the emulated links, and the pairs take turns with a barrier between them
    (every rank calls this), so that each pair probes idle links, as a calibration run
    on a real cluster would."""
    events: list[TraceEvent] = []
    for a, b in pairs:
        if rank in (a, b):
            events += _ping_pong(a, b, rank, devices, clock, timeout_s, device, links)
        if links is not None:
            dist.barrier()
    return events


def _ping_pong(a: int, b: int, rank: int, devices: Sequence[str], clock: Callable[[], float],
               timeout_s: float, device: torch.device, links) -> list[TraceEvent]:
    events: list[TraceEvent] = []
    peer = b if rank == a else a
    for size, n_bytes in enumerate(PROBE_SIZES_BYTES):
        buf = torch.zeros(n_bytes // 4, dtype=torch.float32, device=device)
        for rep in range(PROBE_REPEATS + 1):
            what = f"link probe with rank {peer}"
            there, back = ("probe", a, b, size, rep, 0), ("probe", a, b, size, rep, 1)
            if rank == a:
                start = clock()
                if links is not None:
                    links.post(there, a, b, n_bytes)
                send = dist.isend(buf, peer, tag=_PROBE_TAG)
                answer = dist.irecv(buf, peer, tag=_PROBE_TAG + 1)
                wait(send, timeout_s, what)
                wait(answer, timeout_s, what)
                if links is not None:
                    links.deliver(back)
                rtt = clock() - start
                if rep:
                    events.append(TraceEvent(devices[a], "send", -1, rep - 1, start,
                                             start + rtt / 2, float(n_bytes),
                                             devices[b], -1))
            else:
                wait(dist.irecv(buf, peer, tag=_PROBE_TAG), timeout_s, what)
                if links is not None:
                    links.deliver(there)
                    links.post(back, b, a, n_bytes)
                wait(dist.isend(buf, peer, tag=_PROBE_TAG + 1), timeout_s, what)
    return events
