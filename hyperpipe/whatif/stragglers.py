"""Stragglers in what-if studies: keep today's plan, or search again?

A straggler is a node or device whose compute runs `slowdown` times slower than its
catalog speed (`Node.slowdown`, applied by the cost model). For each variant of a sweep
over slowdowns the what-if reports **keep** (today's plan, the best plan for the cluster
as given or the user's, simulated on the degraded cluster), **re-plan** (a fresh search
on it; never slower than keep: a slower pick leaves the kept plan as the answer) and
the **gap** between them.

Each variant is searched as `hyperpipe search` searches it: the search tells slowed
nodes and devices apart itself (`hyperpipe.search.space.device_classes`), so a variant
identical to the cluster file gets the plan `search` picks for that file.
"""

from __future__ import annotations

import math

from hyperpipe.whatif.variants import WhatIfResult


def is_straggler_key(key: str) -> bool:
    """A --vary key that sets a slowdown (``nodes.NAME.slowdown``, ``...slowdown.3``)."""
    return "slowdown" in key.split(".")


def format_stragglers(result: WhatIfResult) -> str:
    """The keep-versus-re-plan table of a straggler sweep."""
    rows = result.rows
    width = max(len(r.label) for r in rows)
    out = [f"straggler what-if: model {result.model} on variants of cluster "
           f"{result.cluster}",
           "keep = today's plan simulated on the degraded cluster; re-plan = a new search "
           "on it (never slower than keep)", "",
           f"{'variant':<{width}}  {'keep (ms)':>12} {'samples/s':>9}  "
           f"{'re-plan (ms)':>12} {'samples/s':>9}  {'gap':>7}  re-planned plan"]
    for r in rows:
        keep = r.kept.metrics if r.kept is not None and r.kept.metrics.feasible else None
        best = r.best.metrics if r.best is not None else None
        k_txt = f"{_ms(keep.iteration_time_s)} {keep.throughput_samples_per_s:9.2f}" \
            if keep else f"{'does not fit':>22}"
        b_txt = f"{_ms(best.iteration_time_s)} {best.throughput_samples_per_s:9.2f}" \
            if best else f"{'nothing fits':>22}"
        gap = f"{keep.iteration_time_s / best.iteration_time_s - 1:+7.1%}" \
            if keep and best else f"{'--':>7}"
        note = "(kept: the search's pick was slower)" if r.kept_is_answer else r.description
        if r.best is None and r.error:
            note = r.error
        out.append(f"{r.label:<{width}}  {k_txt}  {b_txt}  {gap}  {note}")
    out += ["", "gap: how much longer an iteration takes when the plan is kept "
            "(0%: re-planning does not pay)"]
    return "\n".join(out) + "\n"


def _ms(seconds: float) -> str:
    """An iteration in milliseconds, 12 wide, to at least 5 significant digits (3
    decimals at least, as the sweep table shows them): enough that two iterations as
    shown give the gap shown next to them (to 0.1%), however short the plan's."""
    ms = seconds * 1e3
    digits = 3 if not 0 < ms < 10 else min(12, 4 - math.floor(math.log10(ms)))
    return f"{ms:12.{digits}f}"


def plot_stragglers(result: WhatIfResult, path: str) -> None:
    """Throughput of keep and re-plan per variant, the gap written above each pair."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hyperpipe.core.files import plain_text_figures
    plain_text_figures()        # names and --vary values drawn as written

    from hyperpipe.core.files import save_figure

    rows = result.rows
    keys = list(dict.fromkeys(k for r in rows for k, _ in r.settings))
    labels = [r.settings[0][1] if len(keys) == 1 else r.label.replace(", ", "\n")
              for r in rows]
    keep = [r.kept.metrics.throughput_samples_per_s
            if r.kept is not None and r.kept.metrics.feasible else 0.0 for r in rows]
    best = [r.best.metrics.throughput_samples_per_s if r.best is not None else 0.0
            for r in rows]
    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(rows) + 3), 4.5))
    ax.bar([i - 0.2 for i in x], keep, width=0.4, color="#bbbbbb",
           label="keep today's plan")
    ax.bar([i + 0.2 for i in x], best, width=0.4, color="#2b7bba", label="re-plan (search again)")
    top = max(keep + best + [1e-12])
    for i, (k, b) in enumerate(zip(keep, best, strict=True)):
        text = f"+{b / k - 1:.0%}" if k > 0 and b > 0 else "n/a"
        ax.text(i, max(k, b) + 0.02 * top, text, ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlabel(f"{keys[0]} (compute time multiplier)" if len(keys) == 1 else "variant")
    ax.set_ylabel("throughput (samples/s, simulated)")
    ax.set_ylim(0, 1.3 * top)
    ax.set_title(f"straggler: keep the plan or re-plan? {result.model} on {result.cluster}\n"
                 "(label: throughput gained by re-planning)", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
