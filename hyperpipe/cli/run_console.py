"""What `hyperpipe run` shows and checks around the executor: the plan's predicted step,
the memory check before launch, and live step lines.

On a CPU the executor replays the plan's cluster slowed down (exec.emulation). The
*emulation scale* is the ranks' expected compute seconds per step here over the
simulator's (both summed over devices), known once the ranks have timed their actions,
before step 0; the step lines print the step predicted here beside the measured time:
the plan simulated with every device's compute stretched by the scale and the links as
they are (emulation stretches compute; the link emulator keeps the links' own times),
so the prediction is not fitted to the steps it is compared with.

Memory: each rank's predicted peak must fit before anything starts: with one GPU per
rank, in that GPU's free memory; on a CPU, all ranks together plus each process's torch
runtime (RANK_OVERHEAD_BYTES) in the host's MemAvailable, without the GPU runtime
reserve of the catalog. A plan that does not fit is bad input (exit 2) with the figures.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TextIO

from hyperpipe.core.errors import BadInput
from hyperpipe.core.progress import Progress
from hyperpipe.exec.monitor import StepReport
from hyperpipe.plan.plan import Plan

# Resident memory of one rank process besides its model state: the Python interpreter,
# torch, gloo and the executor's buffers. Measured here (torch 2.x, CPU build): 0.25-0.35
# GB RSS after `import torch` and init_process_group; 0.63-0.72 GB peak RSS per rank over
# a 5-step run of the README's tiny-gpt plan, whose tensors are a few MB (RSS counts the
# shared torch libraries in every rank, so this errs on the safe side).
RANK_OVERHEAD_BYTES = 0.7e9
GB = 1e9


@dataclass(frozen=True)
class Prediction:
    """The simulator's view of one step of the plan on its cluster (seconds, bytes)."""

    iteration_time_s: float
    tokens_per_step: float
    peak_memory_bytes: dict[str, float]     # device -> bytes
    busy_s: dict[str, float]                # device -> compute seconds in one step
    # device -> the GPU runtime reserve inside its peak (not held by a CPU rank)
    reserve_bytes: dict[str, float] = field(default_factory=dict)
    # seconds of one step with every device's compute stretched by a factor and the
    # links as they are (emulation stretches compute, not links); None: the iteration
    # time times the factor
    stretched_s: Callable[[float], float] | None = None


def predict(plan: Plan) -> Prediction:
    """Simulate one step of `plan` on its own model and cluster (analytic costs)."""
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate
    spec, cluster = plan.load_model(), plan.load_cluster()
    cost = CostModel(spec, cluster)
    result = simulate(plan, cost)
    m = result.metrics
    busy: dict[str, float] = {}
    for e in result.trace.events:
        if e.op in ("F", "B", "I", "W", "optimizer"):
            busy[e.device] = busy.get(e.device, 0.0) + e.duration_s
    reserve = {d: cost.runtime_reserve_bytes(cluster.device(d).type.name)
               for d in plan.devices}
    return Prediction(m.iteration_time_s, m.tokens_per_s * m.iteration_time_s,
                      dict(m.peak_memory_bytes), busy, reserve,
                      partial(stretched_step_s, plan, spec, cluster))


def stretched_step_s(plan: Plan, spec, cluster, factor: float) -> float:
    """The simulated step of `plan` with every device computing `factor` times slower
    (each node's `slowdown` times `factor`) and the links unchanged: what an emulated
    run at that scale should measure."""
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import SimOptions, simulate
    nodes = tuple(replace(n, slowdown=tuple(n.device_slowdown(i) * factor
                                            for i in range(n.count)))
                  for n in cluster.nodes)
    slower = replace(cluster, nodes=nodes)
    return simulate(plan, CostModel(spec, slower), SimOptions(trace=False)
                    ).metrics.iteration_time_s


def host_available_bytes() -> float | None:
    """MemAvailable of /proc/meminfo (bytes), None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def local_gpus_free(world: int) -> list[float] | None:
    """Free bytes of each local GPU when the run gets one GPU per rank, else None."""
    import torch
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        return None
    return [float(torch.cuda.mem_get_info(i)[0]) for i in range(world)]


def check_memory(plan: Plan, pred: Prediction, plan_path: str, *, gpus: list[float] | None,
                 host_bytes: float | None) -> str:
    """Raise BadInput when the plan's ranks cannot fit here; else return a one-line
    summary. `gpus`: free bytes of each local GPU (one rank per GPU), or None on CPU."""
    devices = plan.devices
    need = [pred.peak_memory_bytes.get(d, 0.0) for d in devices]
    if gpus is not None:
        for rank, (d, b) in enumerate(zip(devices, need, strict=True)):
            if b > gpus[rank]:
                raise BadInput(f"{plan_path}: rank {rank} ({d})", f"a plan whose ranks fit "
                               f"their GPUs: it needs {b / GB:.2f} GB (predicted peak) and "
                               f"GPU {rank} has {gpus[rank] / GB:.2f} GB free", has_got=False)
        return f"memory: each rank fits its GPU (largest need {max(need) / GB:.2f} GB)"
    need = [max(0.0, b - pred.reserve_bytes.get(d, 0.0)) for d, b in zip(devices, need,
                                                                       strict=True)]
    total = sum(need) + RANK_OVERHEAD_BYTES * len(devices)
    if host_bytes is None:
        return f"memory: {total / GB:.2f} GB predicted for all ranks (host size unknown)"
    worst = max(range(len(devices)), key=lambda r: need[r])
    if total > host_bytes:
        raise BadInput(plan_path, f"a plan that fits this host: its {len(devices)} ranks need "
                       f"{total / GB:.1f} GB (predicted peaks {sum(need) / GB:.1f} GB, largest "
                       f"rank {worst} on {devices[worst]} {need[worst] / GB:.1f} GB, plus "
                       f"{RANK_OVERHEAD_BYTES / GB:.1f} GB per process; no GPU runtime "
                       f"reserve on a CPU) and this host has "
                       f"{host_bytes / GB:.1f} GB available (add --no-memory-check to try "
                       "anyway)", has_got=False)
    return (f"memory: {len(devices)} ranks need {total / GB:.2f} GB of this host's "
            f"{host_bytes / GB:.1f} GB available")


class ConsoleMonitor:
    """Prints a line before each silent phase (with a progress bar on a terminal), the
    emulation scale once it is known, and a line per step as it ends."""

    def __init__(self, pred: Prediction | None, world: int, stream: TextIO | None = None,
                 progress: bool | None = None):
        self.pred = pred
        self.world = world
        self.stream = stream if stream is not None else sys.stdout
        self.progress = progress
        self.bar: Progress | None = None
        self.scale: float | None = None
        self.here_s: float | None = None       # the step predicted here, seconds

    def say(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def phase(self, text: str, total: int) -> None:
        self.say(text + " ...")
        if total:
            self.bar = Progress(total, "  timing", enabled=self.progress)
            self.bar.__enter__()

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.advance()
            if self.bar.done >= self.bar.total:
                self.bar.__exit__()
                self.bar = None

    def expected(self, busy_s: dict[str, float]) -> None:
        if self.pred is None or not self.pred.busy_s:
            return
        sim = sum(self.pred.busy_s.values())
        if sim <= 0:
            return
        self.scale = sum(busy_s.values()) / sim
        p = self.pred.iteration_time_s
        self.here_s = self.pred.stretched_s(self.scale) if self.pred.stretched_s \
            else p * self.scale
        self.say(f"predicted step: {fmt_s(p)} on the cluster; emulation scale here "
                 f"{self.scale:,.0f}x (the ranks' compute per step here / the simulator's),"
                 f" so {fmt_s(self.here_s)} here (compute stretched, links as they are)")

    def step(self, r: StepReport) -> None:
        pred = f"{self.here_s * 1e3:.1f} ms predicted here" \
            if self.here_s is not None else "no prediction here"
        tokens = self.pred.tokens_per_step / r.time_s if self.pred is not None else 0.0
        self.say(f"step {r.step}: {r.time_s * 1e3:.1f} ms measured, {pred} | loss "
                 f"{r.loss:.4f} | {tokens:.0f} tokens/s | peak memory "
                 f"{r.peak_memory_bytes / GB:.2f} GB/rank")


def fmt_s(t: float) -> str:
    """A duration with a unit that keeps 3-4 significant digits."""
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"
