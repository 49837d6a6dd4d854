"""Timeline plots of traces: one panel per trace (e.g. predicted above measured).

Each panel has one row per device (first `max_devices` in the trace's order), one
colour per op, the micro-batch number on every compute box wide enough to hold it, and
communication drawn in a thin lane under each row: sends (to the next or previous
stage), data-parallel all-reduce buckets; optimizer steps share the compute lane.
Panels share the time axis so two traces of one plan line up. Compute boxes of a
device's later stages (chunks of interleaved schedules) are paler. `window` (seconds)
or `microbatches` (the first K) zooms in where a whole iteration is a barcode. The
format follows the file's suffix (PNG, SVG, PDF). Uses matplotlib's Agg canvas
directly: no pyplot state, no display needed.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import save_figure
from hyperpipe.plan.trace import COMPUTE_OPS, OP_COLORS, Trace

# Collectives sit in the lower strip of a device's communication lane, point-to-point
# sends and waits in the upper one; compute fills the row above them.
_COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall")
_COMM_LANE = ("send", "recv", *_COLLECTIVES)
# What each op is, for the legend (torch.distributed.pipelining's names).
OP_LABELS = {"F": "F forward", "B": "B full backward", "I": "I backward: input grad",
             "W": "W backward: weight grad", "optimizer": "optimizer", "send": "send",
             "recv": "recv (waiting)", "allreduce": "all-reduce",
             "allgather": "all-gather (ZeRO-2/3)", "reducescatter": "reduce-scatter (ZeRO-2/3)",
             "alltoall": "all-to-all (experts)"}


def replicas_shown(plan, trace: Trace) -> str:
    """Which data-parallel replicas of `plan` have devices in `trace`, for a title
    (identical replicas are simulated once, so often only replica 0 is drawn)."""
    present = set(trace.devices())
    shown = [i for i, p in enumerate(plan.pipelines) if present & set(p.devices())]
    n = len(plan.pipelines)
    if len(shown) == n:
        return f"all {n} replica{'s' if n != 1 else ''}"
    names = ", ".join(str(i) for i in shown)
    return (f"replica{'s' if len(shown) != 1 else ''} {names} of {n} (the others are "
            "identical and not drawn)")


def parse_window(text: str) -> tuple[float, float]:
    """'START:END' in seconds (e.g. '0:0.25', '1.5:2') -> (start_s, end_s)."""
    a, sep, b = text.partition(":")
    try:
        start, end = float(a), float(b)
    except ValueError:
        start = end = -1.0
    if not sep or not 0 <= start < end < float("inf"):
        raise BadInput("window", "START:END in seconds with 0 <= START < END, e.g. 0:0.25",
                       text)
    return start, end


def _zoom(trace: Trace, t0: float, window: tuple[float, float] | None,
          microbatches: int | None) -> tuple[list, float, float]:
    """The events to draw and the time span (s, relative to t0) they cover."""
    events = list(trace.events)
    lo, hi = 0.0, max((e.end_s - t0 for e in events), default=0.0)
    if microbatches is not None:
        ends = [e.end_s - t0 for e in events if e.op in COMPUTE_OPS
                and e.microbatch < microbatches]
        hi = max(ends, default=hi)
        events = [e for e in events if (e.op in COMPUTE_OPS and e.microbatch < microbatches)
                  or (e.op not in COMPUTE_OPS and e.start_s - t0 < hi)]
    if window is not None:
        lo, hi = window
        events = [e for e in events if e.end_s - t0 > lo and e.start_s - t0 < hi]
    return events, lo, hi


def _time_unit(span_s: float) -> tuple[str, float]:
    for name, scale in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if span_s * scale >= 1.0:
            return name, scale
    return "us", 1e6


def plot_timelines(traces: Sequence[Trace], titles: Sequence[str], path: str | os.PathLike,
                   *, max_devices: int = 32, window: tuple[float, float] | None = None,
                   microbatches: int | None = None) -> None:
    """Draw `traces` stacked (one panel each, titled by `titles`) into `path` (.png,
    .svg or .pdf). `window` = (start_s, end_s) from each trace's start, or
    `microbatches` = K (the first K micro-batches and what happens meanwhile), zoom in."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from hyperpipe.core.files import plain_text_figures
    plain_text_figures()        # names and --vary values drawn as written
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from hyperpipe.core.files import figure_format
    figure_format(path)
    if not traces or len(traces) != len(titles):
        raise BadInput("plot_timelines", "one title per trace and at least one trace",
                       f"{len(traces)} traces, {len(titles)} titles")
    if microbatches is not None and microbatches < 1:
        raise BadInput("microbatches", "a positive number of micro-batches", microbatches)
    t0s = [min((e.start_s for e in t.events), default=0.0) for t in traces]
    zoomed = [_zoom(t, t0, window, microbatches) for t, t0 in zip(traces, t0s, strict=True)]
    lo = min(z_lo for _, z_lo, _ in zoomed)
    hi = max(z_hi for _, _, z_hi in zoomed)
    span = max(hi - lo, 1e-12)
    unit, scale = _time_unit(span)
    rows = [min(len(t.devices()), max_devices) for t in traces]
    height = sum(0.45 * max(r, 1) + 1.0 for r in rows) + 0.9
    fig = Figure(figsize=(13, height))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(traces), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [max(r, 1) for r in rows]})[:, 0]
    seen_ops: dict[str, None] = {}
    max_chunks = 1
    for ax, trace, title, t0, (events, _, _) in zip(axes, traces, titles, t0s, zoomed,
                                                    strict=True):
        devices = trace.devices()[:max_devices]
        row = {d: i for i, d in enumerate(devices)}
        stages: dict[str, list[int]] = {}
        for e in trace.events:
            if e.op in COMPUTE_OPS and e.stage not in stages.setdefault(e.device, []):
                stages[e.device].append(e.stage)
        chunk = {(d, st): sorted(ss).index(st) for d, ss in stages.items() for st in ss}
        nchunks = max((len(ss) for ss in stages.values()), default=1)
        max_chunks = max(max_chunks, nchunks)
        bars: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
        labels = []
        for e in events:
            if e.device not in row:
                continue
            x, w = (e.start_s - t0) * scale, max(e.duration_s * scale, 0.0)
            if e.op in _COMM_LANE:
                w = max(w, span * scale / 400)       # keep short transfers visible
            c = chunk.get((e.device, e.stage), 0) if e.op in COMPUTE_OPS else 0
            bars.setdefault((row[e.device], e.op, c), []).append((x, w))
            seen_ops.setdefault(e.op, None)
            if e.op in COMPUTE_OPS and w >= span * scale / 90:
                labels.append((x + w / 2, row[e.device], str(e.microbatch)))
        for (y, op, c), xs in bars.items():
            if op in _COMM_LANE:
                lane = (y + 0.22, 0.16) if op not in _COLLECTIVES else (y + 0.40, 0.10)
            else:
                lane = (y - 0.40, 0.58)
            ax.broken_barh(xs, lane, facecolors=OP_COLORS.get(op, "#999999"),
                           edgecolor="white" if op in COMPUTE_OPS or op == "send" else "none",
                           linewidth=0.3, alpha=_shade(c, nchunks))
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
    axes[-1].set_xlim(lo * scale, hi * scale)
    zoom = "" if window is None and microbatches is None else (
        f"; first {microbatches} micro-batches" if window is None
        else f"; window {window[0]:g}-{window[1]:g} s")
    axes[-1].set_xlabel(f"time ({unit}){zoom}; numbers on boxes: micro-batch")
    handles = [Patch(color=OP_COLORS.get(op, "#999999"), label=OP_LABELS.get(op, op))
               for op in [o for o in (*COMPUTE_OPS, "optimizer", *_COMM_LANE)
                          if o in seen_ops]]
    handles += [Patch(facecolor="#777777", alpha=_shade(c, max_chunks),
                      label=f"chunk {c} of a device")
                for c in range(max_chunks) if max_chunks > 1]
    top = 1.0
    if handles:            # above the panels, in as many rows as it needs, never on a title
        ncol = min(len(handles), 8)
        fig.legend(handles=handles, loc="upper right", ncol=ncol, fontsize=8, frameon=False)
        top = 1.0 - (0.3 * -(-len(handles) // ncol) + 0.1) / height
    with warnings.catch_warnings():
        # a window of nanoseconds gives tick labels wider than the figure: matplotlib then
        # keeps the default layout and warns, which a successful command must not print
        warnings.filterwarnings("ignore", "Tight layout not applied", UserWarning)
        fig.tight_layout(rect=(0, 0, 1, top))
    save_figure(fig, path)


def zoom_note(plan, window: tuple[float, float] | None, microbatches: int | None) -> str:
    """How to zoom a whole timeline of more than 16 micro-batches (a barcode at that
    width); empty when zoomed or short."""
    m = max(p.num_microbatches for p in plan.pipelines)
    if window is not None or microbatches or m <= 16:
        return ""
    return (f" ({m} micro-batches drawn: zoom in with --microbatches 8 or --window "
            "START:END in seconds)")


def _shade(chunk: int, chunks: int) -> float:
    """Opacity of a device's chunk `chunk` of `chunks`: later chunks paler."""
    return 1.0 - 0.5 * chunk / max(chunks - 1, 1)
