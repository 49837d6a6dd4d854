"""Timeline plots of traces: one panel per trace (e.g. predicted above measured).

Each panel has one row per device (first `max_devices` in the trace's order), one
colour per op, the micro-batch number on every compute box wide enough to hold it, and
communication drawn in a thin lane under each row: sends (to the next or previous
stage), data-parallel all-reduce buckets; optimizer steps share the compute lane.
Panels share the time axis so two traces of one plan line up. Uses matplotlib's Agg
canvas directly: no pyplot state, no display needed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hyperpipe.errors import BadInput
from hyperpipe.files import save_figure
from hyperpipe.plan.trace import COMPUTE_OPS, OP_COLORS, Trace

_COMM_LANE = ("send", "recv", "allreduce")


def _time_unit(span_s: float) -> tuple[str, float]:
    for name, scale in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if span_s * scale >= 1.0:
            return name, scale
    return "us", 1e6


def plot_timelines(traces: Sequence[Trace], titles: Sequence[str], path: str | os.PathLike,
                   *, max_devices: int = 32) -> None:
    """Draw `traces` stacked (one panel each, titled by `titles`) into a PNG at `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not traces or len(traces) != len(titles):
        raise BadInput("plot_timelines", "one title per trace and at least one trace",
                       f"{len(traces)} traces, {len(titles)} titles")
    t0s = [min((e.start_s for e in t.events), default=0.0) for t in traces]
    span = max((max((e.end_s for e in t.events), default=0.0) - t0)
               for t, t0 in zip(traces, t0s, strict=True))
    unit, scale = _time_unit(span)
    rows = [min(len(t.devices()), max_devices) for t in traces]
    height = sum(0.45 * max(r, 1) + 1.0 for r in rows) + 0.6
    fig = Figure(figsize=(13, height))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(traces), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [max(r, 1) for r in rows]})[:, 0]
    seen_ops: dict[str, None] = {}
    for ax, trace, title, t0 in zip(axes, traces, titles, t0s, strict=True):
        devices = trace.devices()[:max_devices]
        row = {d: i for i, d in enumerate(devices)}
        bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
        labels = []
        for e in trace.events:
            if e.device not in row:
                continue
            x, w = (e.start_s - t0) * scale, max(e.duration_s * scale, 0.0)
            if e.op in _COMM_LANE:
                w = max(w, span * scale / 400)       # keep short transfers visible
            bars.setdefault((row[e.device], e.op), []).append((x, w))
            seen_ops.setdefault(e.op, None)
            if e.op in COMPUTE_OPS and w >= span * scale / 90:
                labels.append((x + w / 2, row[e.device], str(e.microbatch)))
        for (y, op), xs in bars.items():
            if op in _COMM_LANE:
                lane = (y + 0.22, 0.16) if op != "allreduce" else (y + 0.40, 0.10)
            else:
                lane = (y - 0.40, 0.58)
            ax.broken_barh(xs, lane, facecolors=OP_COLORS.get(op, "#999999"),
                           edgecolor="white" if op in COMPUTE_OPS or op == "send" else "none",
                           linewidth=0.3)
        if len(labels) <= 1500:
            for x, y, text in labels:
                ax.text(x, y - 0.11, text, ha="center", va="center", fontsize=6,
                        color="white")
        ax.set_yticks(range(len(devices)), devices, fontsize=7)
        ax.set_ylim(len(devices) - 0.45, -0.55)
        extra = "" if len(trace.devices()) <= max_devices else \
            f" (first {max_devices} of {len(trace.devices())} devices)"
        ax.set_title(f"{title}{extra}", fontsize=9, loc="left")
        ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    axes[-1].set_xlabel(f"time ({unit})")
    handles = [Patch(color=OP_COLORS.get(op, "#999999"), label=op) for op in
               [o for o in (*COMPUTE_OPS, "optimizer", "send", "recv", "allreduce")
                if o in seen_ops]]
    if handles:
        fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8,
                   frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    save_figure(fig, path)
