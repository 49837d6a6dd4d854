"""Checking a what-if variation path and its values before they touch the cluster document.

A path is dotted keys into the cluster document (``inter_node.bandwidth``,
``nodes.v100.count``, ``device_types.A100-80GB.memory``). A key that the cluster format
does not have is refused with the path as typed and the valid keys at that point,
closest first; a dimensioned field given a bare number is refused with an example unit
(a bare number would silently be read in SI base units: 10 "bandwidth" = 10 bytes/s).
"""

from __future__ import annotations

import difflib

from hyperpipe.cluster import cluster as cluster_format
from hyperpipe.cluster.catalog import DTYPES
from hyperpipe.core.errors import BadInput

# A leaf that carries a unit, and an example of one (units.py parses these).
UNIT_EXAMPLES = {
    "bandwidth": "100 Gbit/s", "latency": "5 us", "memory": "80 GB",
    "peak_flops": "312 TFLOP/s", "mem_bandwidth": "2 TB/s", "link_bandwidth": "600 GB/s",
    "link_latency": "2 us", "mtbf": "120 h", "runtime_reserve": "2 GB",
    "price_per_hour": "1.5 $/h",
}
TOP_KEYS = ("name", "device_types", "nodes", "inter_node", "links")
# Fields that hold one value or a table of values (docs/formats.md): the path may end at
# the field (one value for all) or name an entry of its table (`nodes.v100.slowdown.3`,
# `device_types.A100-80GB.peak_flops.fp32`); what names an entry.
TABLE_FIELDS = {"slowdown": "a device index of the node", "peak_flops": "a dtype: "
                + ", ".join(DTYPES)}


def _keys(level: str) -> tuple[str, ...]:
    return {"top": TOP_KEYS, "node": tuple(cluster_format._NODE_KEYS),
            "device": tuple(cluster_format._DEVICE_KEYS),
            "link": tuple(cluster_format._LINK_KEYS),
            "nics": ("count", "bandwidth", "latency"),
            "path": ("bandwidth", "latency")}[level]


def _nearest(word: str, options: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=len(options), cutoff=0.0)
    return ", ".join(close[:6])


def check_vary(key: str, values: list[str], doc: dict) -> None:
    """Raise BadInput naming `key` as typed when it is no path of the cluster format,
    or when a dimensioned field gets a bare non-zero number. `doc` is the cluster
    document (its node names, as the loader gives them, and device-type names are valid
    path items too); a field of `TABLE_FIELDS` takes one value or names an entry."""
    doc = cluster_format.with_node_names(doc)
    parts = key.split(".")
    level, field = "top", parts[-1]
    for i, part in enumerate(parts):
        typed = ".".join(parts[:i]) or "the cluster"
        if level in TABLE_FIELDS:             # an entry of a field's table
            table = level
            if not (part in DTYPES if table == "peak_flops" else
                    part.isascii() and part.isdigit() and len(part) < 10):
                raise BadInput(f"vary {key}", f"a path that ends at {typed} (one value "
                               f"for all) or at an entry of its table "
                               f"({TABLE_FIELDS[table]})", part)
            level, field = "leaf", table
            continue
        if level == "leaf":
            raise BadInput(f"vary {key}", f"a path that ends at {typed} (it holds one "
                           "value)", part)
        if level == "links":                 # a path of `links`, by its position
            count = len(doc.get("links", []) or [])
            if not count:
                raise BadInput(f"vary {key}", "a cluster with paths to vary (this one has "
                               "no `links`)", part)
            if not (part.isascii() and part.isdigit() and int(part) < count):
                raise BadInput(f"vary {key}", f"a position among the {count} paths of "
                               f"{typed} (0 .. {count - 1})", part)
            level = "path"
            continue
        if level in ("nodes", "device_types"):
            items = doc.get("nodes", []) if level == "nodes" else doc.get("device_types", {})
            names = [str(n.get("name")) for n in items if isinstance(n, dict)] \
                if level == "nodes" else list(items)
            if part not in names and not (level == "nodes" and part.isascii()
                                          and part.isdigit()):
                if level == "device_types":
                    level = "device"     # a new device type: allowed, fields follow
                    continue
                raise BadInput(f"vary {key}", f"a node of {typed} ({_nearest(part, names)} "
                               "or a position)", part)
            level = "node" if level == "nodes" else "device"
            continue
        options = _keys(level)
        if part not in options:
            raise BadInput(f"vary {key}", f"a key of {typed}: one of "
                           f"{_nearest(part, options)}", part)
        level = {"nodes": "nodes", "device_types": "device_types", "inter_node": "link",
                 "intra_link": "link", "nic": "link", "nics": "nics",
                 "links": "links"}.get(part, part if part in TABLE_FIELDS else "leaf")
    if field in UNIT_EXAMPLES:
        for v in values:
            try:
                bare = float(v) != 0.0
            except ValueError:
                continue
            if bare:
                raise BadInput(f"vary {key}", f"a value with a unit, e.g. "
                               f"'{key}={UNIT_EXAMPLES[field]}'", v)
