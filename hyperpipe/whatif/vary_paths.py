"""Checking a what-if variation path and its values before they touch the cluster document.

A path is dotted keys into the cluster document (``inter_node.bandwidth``,
``nodes.v100.count``, ``device_types.A100-80GB.memory``). A key that the cluster format
does not have is refused with the path as typed and the valid keys at that point,
closest first; a dimensioned field given a bare number is refused with an example unit
(a bare number would silently be read in SI base units: 10 "bandwidth" = 10 bytes/s).
A path into what a calibration profile's fits price instead (`check_profile_fit`) is
refused beside that profile: every variant would be priced alike.
"""

from __future__ import annotations

import difflib

from hyperpipe.cluster import cluster as cluster_format
from hyperpipe.cluster.catalog import DTYPES, builtin_device_types
from hyperpipe.core.errors import BadInput, printable
from hyperpipe.plan.profile import Profile

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


# What a device type's layers are priced by without a profile; the profile's compute
# fits for the type price them instead (`CostModel.layer_time_s`). mem_bandwidth also
# prices the optimizer step (unless fitted too) and DeepSpeed's fp32 gradient
# accumulation: a small share beside the layers' memory-bound work, refused with them.
COMPUTE_FIELDS = ("peak_flops", "efficiency", "mem_bandwidth")
ROUTE_FIELDS = ("bandwidth", "latency")


def check_profile_fit(key: str, profile: Profile, doc: dict, kinds: set[str], *,
                      source: str) -> None:
    """Raise BadInput naming `key` and `source` (the profile as the user named it) when
    `profile` prices what the cluster path `key` sets, so that every variant of the
    sweep would be priced alike (`hyperpipe.sim.costmodel`): a link class the profile
    has a fitted link for (its class, or ``*``) replaces the bandwidth and latency of
    every route of that class (`CostModel.route`; across nodes: ``inter_node``, a node's
    ``nic`` and ``nics`` bandwidth and latency, ``links`` between regions; inside node
    NODE: its ``intra_link``, and its device type's ``link_bandwidth``/``link_latency``
    where the node's ``intra_link`` does not set them); compute fits of a device type for
    a layer kind of `kinds` (the model's; an MoE block priced by ``block`` fits too)
    replace its `COMPUTE_FIELDS`. What the profile leaves to the cluster is allowed: node
    counts and devices, slowdowns, memory, a NIC count (how routes share NICs)."""
    fixed = _fitted_by(key.split("."), profile, cluster_format.with_node_names(doc),
                       kinds | ({"block"} if "moe" in kinds else set()))
    if fixed is not None:
        flag = source.split(" ", 1)[0]
        raise BadInput(f"vary {key}", f"a field that {source} does not fit: its {fixed}, "
                       f"whatever the sweep sets; drop {flag} or vary something it does "
                       "not fit", has_got=False)


def _fitted_by(parts: list[str], profile: Profile, doc: dict, kinds: set[str]
               ) -> str | None:
    """What of `profile` prices the field at path `parts` (as `check_profile_fit`
    words it), None when the field still counts."""
    head, field = parts[0], parts[-1]
    classes: list[str] = []
    if head in ("inter_node", "links") and field in ROUTE_FIELDS:
        classes = ["inter"]
    elif head == "nodes" and len(parts) == 4 and (
            parts[2] == "nic" or parts[2] == "nics" and field in ROUTE_FIELDS):
        classes = ["inter"]
    elif head == "nodes" and len(parts) == 4 and parts[2] == "intra_link":
        classes = [f"intra:{n}" for e in _entries(doc, parts[1]) for n in _node_names(e)]
    elif head == "device_types" and len(parts) >= 3:
        type_name = printable(parts[1])
        if parts[2] in COMPUTE_FIELDS and any(k.split("|")[0] == type_name and
                                              k.split("|")[1] in kinds for k in profile.compute):
            return (f"compute fits of device type {type_name} (compute.{type_name}|...) "
                    f"price that type's layers in place of its {parts[2]}")
        if parts[2] in ("link_bandwidth", "link_latency"):
            sub = parts[2].split("_")[1]          # the intra_link field it defaults
            classes = [f"intra:{n}" for e in _entries_of_type(doc, type_name)
                       if not (isinstance(e.get("intra_link"), dict) and sub in e["intra_link"])
                       for n in _node_names(e)]
    for c in classes:
        if profile.link(c) is not None:
            held = c if c in profile.links else "*"
            routes = "between nodes" if c == "inter" else f"inside node {c[6:]}"
            return (f"fitted link for the routes {routes} (links.{held}) prices them in "
                    "place of the cluster's links")
    return None


def _entries(doc: dict, part: str) -> list[dict]:
    """The node entry a path item names: by name, else by position (`set_path`)."""
    nodes = doc.get("nodes", [])
    match = [n for n in nodes if isinstance(n, dict) and n.get("name") == part]
    if not match and part.isascii() and part.isdigit() and len(part) < 10 \
            and int(part) < len(nodes):
        match = [nodes[int(part)]]
    return [n for n in match if isinstance(n, dict)]


def _entries_of_type(doc: dict, type_name: str) -> list[dict]:
    """The node entries whose `device` names device type `type_name` (as the loader reads
    it: `cluster.device_type_name`)."""
    names = [*builtin_device_types(), *(printable(k) for k in doc.get("device_types", {}))]
    return [n for n in doc.get("nodes", []) if isinstance(n, dict)
            and cluster_format.device_type_name(str(n.get("device")), names) == type_name]


def _node_names(entry: dict) -> list[str]:
    """The nodes a node entry makes (its name, numbered when repeated), as the loader
    names them."""
    base, copies = printable(str(entry.get("name"))), cluster_format.node_copies(entry)
    return [base] if copies == 1 else [f"{base}{r}" for r in range(copies)]
