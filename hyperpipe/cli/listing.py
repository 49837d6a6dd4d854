"""`hyperpipe list clusters|models|devices|schedules`: the built-in names with their key
figures, one table each, one unit per column (in its header)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass

from hyperpipe.cli.flags import command
from hyperpipe.cli.output import EXIT_OK
from hyperpipe.core.errors import BadInput

KINDS = ("clusters", "models", "devices", "schedules")

@dataclass(frozen=True)
class ListOptions:
    what: str                     # one of KINDS

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ListOptions:
        return cls(what=ns.what)


def add_parser(sub) -> None:
    p = command(sub, "list", "the built-in clusters, models, device types or schedule "
                "kinds with their key figures")
    p.add_argument("what", choices=list(KINDS))
    p.set_defaults(options=ListOptions.from_namespace, run=run)


def run(opts: ListOptions) -> int:
    sys.stdout.write(listing(opts.what))
    return EXIT_OK


def listing(kind: str) -> str:
    """The table for `kind` (one of KINDS)."""
    if kind not in KINDS:
        raise BadInput("list", f"one of {', '.join(KINDS)}", kind)
    return {"clusters": _clusters, "models": _models, "devices": _devices,
            "schedules": _schedules}[kind]()


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in [header, *rows]]
    return "\n".join(lines) + "\n"


def _clusters() -> str:
    from hyperpipe.cluster.cluster import builtin_cluster_names, load_cluster
    rows = []
    for name in builtin_cluster_names():
        c = load_cluster(name)
        types = Counter(d.type.name for d in c.devices)
        peak = sum(d.type.peak_flops for d in c.devices)
        # what leaves a node: its NICs (the inter-node default only bounds them)
        nics = sorted({(n.nics.count, n.nics.bandwidth_bytes_per_s) for n in c.nodes},
                      key=lambda x: (x[0] * x[1], x))
        rows.append([name, str(len(c.devices)),
                     ", ".join(f"{n}x {t}" for t, n in sorted(types.items())),
                     f"{peak / 1e15:.1f}",
                     ", ".join(f"{k}x {bw * 8 / 1e9:g}" for k, bw in nics)])
    return _table(["cluster", "devices", "device types", "peak (PFLOP/s)",
                   "NICs per node (Gbit/s)"], rows)


def _models() -> str:
    from hyperpipe.models import load_model
    from hyperpipe.models.presets import PRESETS
    rows = []
    for name in PRESETS:
        m = load_model(name)
        c = m.config
        rows.append([name, str(len(m.layers)), str(c.n_layer), f"{m.params / 1e9:.3f}",
                     str(c.d_model), str(c.seq_len), PRESETS[name].dtype])
    return _table(["model", "layers (cut units)", "blocks", "params (billions)", "d_model",
                   "seq_len (tokens)", "dtype"], rows)


def _devices() -> str:
    from hyperpipe.cluster.catalog import builtin_device_types
    rows = [[d.name, f"{d.peak_flops / 1e12:g}", _gemm_efficiency(d),
             f"{d.peak_for('fp32') / 1e12:g}", f"{d.memory_bytes / 2**30:g}",
             f"{d.mem_bandwidth_bytes_per_s / 1e9:g}",
             f"{d.link_bandwidth_bytes_per_s / 1e9:g}"]
            for d in builtin_device_types().values()]
    return _table(["device", "peak dense fp16/bf16 (TFLOP/s)",
                   f"GEMM {LISTED_GEMM}^3 (fraction of peak)", "fp32 (TFLOP/s)",
                   "memory (GiB)",
                   "memory bandwidth (GB/s)", "intra-node link (GB/s)"], rows)


LISTED_GEMM = 8192               # M = N = K of the GEMM `list devices` quotes a curve at


def _gemm_efficiency(d) -> str:
    """What the cost model takes for a large square GEMM on the device: its GEMM curve's
    fraction of peak there ('0.71'; other shapes by the curve), or the flat fraction of
    a device without a curve ('0.5(flat)', every shape)."""
    if d.gemm is None:
        return f"{d.efficiency:g}(flat)"
    return f"{d.gemm.efficiency(LISTED_GEMM, LISTED_GEMM, LISTED_GEMM):.2f}"


def _schedules() -> str:
    from hyperpipe.plan.kinds import KINDS
    kinds = list(KINDS.values())           # synth too: search picks it, plans carry it
    rows = [[k.name, "v >= 1" if k.takes_chunks else str(k.default_chunks), k.description]
            for k in kinds]
    return _table(["schedule", "chunks per device", "what it does"], rows)
