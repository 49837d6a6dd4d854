"""Draw a schedule (PNG, SVG or PDF by the file's suffix): one row per rank, one box per
action, in unit time.

Times here are illustrative, not simulated: a device's whole share of the model takes
one unit for F, I or W and two for B (a full backward is I + W); with v chunks per
device each chunk holds 1/v of that share, so its actions take 1/v of those units.
Each action starts once its rank is free and its dependencies (from `dependencies`) are
done, with free links. The SimPy simulator gives real times.
Uses matplotlib's Agg canvas directly, so no pyplot state or display is touched.
"""

from __future__ import annotations

import os

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import save_figure
from hyperpipe.plan.schedule import (
    Action,
    Schedule,
    ScheduleError,
    dependencies,
    progress_order,
)
from hyperpipe.plan.trace import OP_COLORS

_UNITS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
# torch.distributed.pipelining's op names (the zero-bubble papers call I "B")
OP_NAMES = {"F": "F: forward", "B": "B: full backward (I + W)",
            "I": "I: backward, input gradient", "W": "W: backward, weight gradient"}


def unit_times(schedule: Schedule) -> dict[Action, tuple[float, float]]:
    """(start, end) of each action in units (a device's whole share: F = I = W = 1,
    B = 2; one of v chunks: 1/v of that), free links.

    Raises ScheduleError if the ranks cannot all finish (call `validate` for the reason).
    """
    deps = dependencies(schedule)
    order, _ = progress_order(schedule, deps)
    times: dict[Action, tuple[float, float]] = {}
    free = [0.0] * schedule.num_devices
    for a in order:                     # each action comes after its dependencies
        d = schedule.device_of(a.stage)
        start = max([free[d], *(times[x][1] for x in deps[a])])
        free[d] = start + _UNITS[a.op] / schedule.chunks
        times[a] = (start, free[d])
    if len(times) != sum(len(row) for row in schedule.actions):
        raise ScheduleError(
            f"{schedule.kind} schedule", "a schedule that can finish", None, has_got=False
        )
    return times


def draw_schedule(schedule: Schedule, path: str | os.PathLike, *, title: str | None = None) -> None:
    """Draw `schedule` to `path` (rank 0 on top, time in units); the format follows the
    suffix (.png, .svg, .pdf). BadInput, before any drawing, over the drawing bounds
    (`limits.MAX_DRAWN_RANKS`, `limits.MAX_DRAWN_ACTIONS`)."""
    actions = sum(len(row) for row in schedule.actions)
    if actions > limits.MAX_DRAWN_ACTIONS or schedule.num_devices > limits.MAX_DRAWN_RANKS:
        raise BadInput("schedule drawing", f"at most {limits.MAX_DRAWN_RANKS} ranks and "
                       f"{limits.MAX_DRAWN_ACTIONS} actions (hyperpipe.core.limits; the text "
                       "formats have no such bound)",
                       f"{schedule.num_devices} ranks, {actions} actions")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from hyperpipe.core.files import plain_text_figures
    plain_text_figures()        # names and --vary values drawn as written
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    times = unit_times(schedule)
    makespan = max((end for _, end in times.values()), default=1.0)
    p = schedule.num_devices
    fig = Figure(figsize=(min(4 + makespan * 0.12, 40), 1 + 0.5 * p), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    label = makespan <= 200  # micro-batch numbers stay legible only on small schedules
    for a, (start, end) in times.items():
        d = schedule.device_of(a.stage)
        # Later chunks of an interleaved schedule are drawn paler.
        alpha = 1.0 - 0.5 * (a.stage // p) / max(schedule.chunks - 1, 1)
        ax.broken_barh(
            [(start, end - start)],
            (d - 0.4, 0.8),
            facecolors=OP_COLORS[a.op],
            edgecolor="black",
            linewidth=0.3,
            alpha=alpha,
        )
        if label:
            ax.text(
                (start + end) / 2,
                d,
                str(a.microbatch),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, makespan)
    ax.set_yticks(range(p), [f"rank {d}" for d in range(p)])
    v = schedule.chunks
    ax.set_xlabel("time (units: F = I = W = 1, B = 2 for a device's share"
                  + (f"; a chunk: 1/{v})" if v > 1 else ")"), fontsize=8)
    ax.set_title(
        title
        or f"{schedule.kind}: p={p}, v={schedule.chunks}, "
        f"m={schedule.num_microbatches}, makespan {makespan:g} units"
    )
    ops = sorted({a.op for a in times}, key="FBIW".index)
    handles = [Patch(color=OP_COLORS[op], label=OP_NAMES[op]) for op in ops]
    if v > 1:
        handles += [Patch(facecolor="#777777", alpha=1.0 - 0.5 * c / (v - 1),
                          label=f"chunk {c}" + (" (stages 0..p-1)" if c == 0 else ""))
                    for c in range(v)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              title="box = action; number = micro-batch", title_fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def draw_timed_schedules(panels: list[tuple[str, list[str], list]], path: str | os.PathLike
                         ) -> None:
    """Write a PNG of several timed schedules, one panel each, on one time axis.

    `panels`: (title, rank device names top to bottom, trace events with `device`, `op`,
    `stage`, `microbatch`, `start_s`, `end_s`); compute ops are drawn, in milliseconds.
    Used to put a synthesised schedule under the best fixed kind's.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from hyperpipe.core.files import plain_text_figures
    plain_text_figures()        # names and --vary values drawn as written
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = sum(len(names) for _, names, _ in panels)
    fig = Figure(figsize=(14, 1.2 + 0.45 * rows + 0.6 * len(panels)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    end = max((e.end_s for _, _, evs in panels for e in evs), default=1.0) * 1e3
    ops_seen: set[str] = set()
    for ax, (title, names, events) in zip(axes, panels, strict=True):
        index = {n: i for i, n in enumerate(names)}
        for e in events:
            if e.op not in _UNITS or e.device not in index:
                continue
            ops_seen.add(e.op)
            ax.broken_barh([(e.start_s * 1e3, (e.end_s - e.start_s) * 1e3)],
                           (index[e.device] - 0.4, 0.8), facecolors=OP_COLORS[e.op],
                           edgecolor="black", linewidth=0.2)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_yticks(range(len(names)), names)
        ax.set_title(title, fontsize=9)
    axes[-1].set_xlim(0, end)
    axes[-1].set_xlabel("simulated time (ms)")
    axes[0].legend(handles=[Patch(color=OP_COLORS[op], label=op)
                            for op in sorted(ops_seen, key="FBIW".index)],
                   loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
