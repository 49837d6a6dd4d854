"""Clusters: nodes of devices, the links inside a node and between nodes.

Topology model (kept simple on purpose; docs/architecture.md, "Links"):

* Inside a node every device has its own port to a switch (NVSwitch or a PCIe switch),
  one per direction, of the node's `intra_link` bandwidth. A transfer from device a to
  device b on the same node crosses two hops: ``a:out`` then ``b:in``.
* Between nodes every node has one NIC per direction (`nic` bandwidth, by default the
  cluster's `inter_node` bandwidth) into a non-blocking fabric. A transfer from node x to
  node y crosses ``x:nic-out`` then ``y:nic-in``.
* A node may declare its NICs (`nics: {count, bandwidth}`, `Node.nics`; default one NIC
  at the `nic` bandwidth). With several, each is its own hop (``x:nic3-out``) and device
  i of the node uses NIC i·count // devices (rail-optimised, as on DGX nodes).
* Wide-area paths: every node lies in a region (`region`, by default its own name), and
  the cluster's `links` may give the path between two regions (or inside one) its own
  bandwidth and latency (`RegionLink`): a transfer from node x to node y of such a pair
  then crosses ``x:nic-out``, the path ``x>y:path`` (one per ordered pair of nodes, as a
  per-destination rate limit or a WAN flow gets it) and ``y:nic-in``, and pays the
  path's latency instead of the NICs'.

A path's latency is the latency of its link class, paid once; its bandwidth is that of
its slowest hop. The simulator treats every hop as a shared resource.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from hyperpipe.cluster.catalog import (
    DTYPES,
    HOST_STAGED_COLLECTIVE_EFFICIENCY,
    HOST_STAGED_LATENCY_S,
    HOST_STAGED_SEND_EFFICIENCY,
    DeviceType,
    builtin_device_types,
    catalog_name,
    peak_ratios,
)
from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput, printable
from hyperpipe.core.files import (
    Fields,
    load_document,
    path_exists,
    resolve_ref,
    whole_number,
)


@dataclass(frozen=True)
class Link:
    """A link class: bandwidth per direction (bytes/s) and one-way latency (s)."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def time_s(self, nbytes: float) -> float:
        """Alpha-beta time of one message of `nbytes` bytes on an idle link."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


def link_sig(link: Link | Nics | None) -> tuple[float, ...] | None:
    """A `Link` or `Nics` (or None) as the plain numbers it is made of, for cache keys:
    a key of numbers hashes at C speed, a dataclass's hash is a Python call (the search
    hashes its keys tens of millions of times). Its fields in order, as `astuple` gives
    them (both records are flat), without `astuple`'s deep copy."""
    return None if link is None else tuple(link.__dict__.values())


@dataclass(frozen=True)
class Hop:
    """One direction of one physical port: the unit of bandwidth sharing."""

    name: str
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class Route:
    """The route of a transfer: the hops it crosses, and its link class."""

    hops: tuple[Hop, ...]
    link: Link
    link_class: str          # "local", "intra:<node>" or "inter"

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return min(h.bandwidth_bytes_per_s for h in self.hops) if self.hops else float("inf")

    def time_s(self, nbytes: float) -> float:
        """Time on idle hops: latency + bytes / slowest hop. Zero for a device to itself."""
        if not self.hops:
            return 0.0
        return self.link.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Nics:
    """A node's network cards into the inter-node fabric: how many, and the bandwidth of
    each per direction (bytes/s). DGX-class nodes have one per GPU (a DGX A100: 8 x 200
    Gbit/s HDR InfiniBand for compute, NVIDIA DGX A100 user guide)."""

    count: int
    bandwidth_bytes_per_s: float

    @property
    def total_bandwidth_bytes_per_s(self) -> float:
        return self.count * self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class RegionLink:
    """The path between the nodes of two regions (or two nodes of one region): bandwidth
    per direction between one pair of nodes (bytes/s) and one-way latency (s; None: the
    larger of the two nodes' NIC latencies)."""

    bandwidth_bytes_per_s: float
    latency_s: float | None = None


@dataclass(frozen=True)
class Node:
    name: str
    device_type: str
    count: int
    intra_link: Link
    nic: Link
    price_per_hour: float | None = None   # USD per device-hour
    nics: Nics | None = None              # None: one NIC of `nic`'s bandwidth
    # Straggler: compute time multiplier of each device (1.0 = catalog speed), index order.
    slowdown: tuple[float, ...] = ()      # empty: every device 1.0
    mtbf_s: float | None = None           # mean time between failures of the node, s
    # False: the node's GPUs cannot reach each other directly; NCCL stages intra-node
    # transfers through host shared memory (`hyperpipe.cluster.catalog.HOST_STAGED_*`).
    peer_to_peer: bool = True
    region: str = ""                      # empty: the node's own name (`Cluster.links`)

    def __post_init__(self) -> None:
        if not self.region:
            object.__setattr__(self, "region", self.name)
        if self.nics is None:
            object.__setattr__(self, "nics", Nics(1, self.nic.bandwidth_bytes_per_s))

    def device_slowdown(self, index: int) -> float:
        return self.slowdown[index] if self.slowdown else 1.0

    @property
    def device_link(self) -> Link:
        """What a transfer between two of the node's devices gets: the `intra_link`, or
        without peer-to-peer the host-staged path through it (a fraction of its
        bandwidth, at least the staging latency)."""
        if self.peer_to_peer:
            return self.intra_link
        return Link(self.intra_link.bandwidth_bytes_per_s * HOST_STAGED_SEND_EFFICIENCY,
                    max(self.intra_link.latency_s, HOST_STAGED_LATENCY_S))


@dataclass(frozen=True)
class Device:
    name: str                # "NODE/INDEX"
    node: str
    index: int
    type: DeviceType
    slowdown: float = 1.0    # compute time multiplier (a straggler > 1)


@dataclass(frozen=True)
class Cluster:
    name: str
    device_types: dict[str, DeviceType]
    nodes: tuple[Node, ...]
    inter_node: Link
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # the paths between regions that the file gives (`region_link`); key: the two region
    # names, sorted
    links: dict[tuple[str, str], RegionLink] = field(default_factory=dict)
    # where the cluster was read, as errors name it: its file, a plan's `cluster` field or
    # "cluster NAME" for a built-in (`cluster_from_dict`'s `where`); "" for one built in
    # code. `where` gives it with that fallback.
    origin: str = field(default="", compare=False, repr=False)

    @property
    def where(self) -> str:
        """How an error about one of this cluster's fields names it (`origin`, else
        "cluster NAME"): ``c.yaml: device_types.x.peak_flops: expected ...``."""
        return self.origin or f"cluster {self.name}"

    def __post_init__(self) -> None:
        devices = tuple(
            Device(f"{n.name}/{i}", n.name, i, self.device_types[n.device_type],
                   n.device_slowdown(i))
            for n in self.nodes for i in range(n.count))
        object.__setattr__(self, "_devices", devices)
        object.__setattr__(self, "_by_name", {d.name: d for d in devices})
        object.__setattr__(self, "_node_by_name", {n.name: n for n in self.nodes})
        object.__setattr__(self, "_stragglers", any(n.slowdown for n in self.nodes))
        object.__setattr__(self, "_linked", {r for pair in self.links for r in pair})

    @property
    def devices(self) -> tuple[Device, ...]:
        return self._devices  # type: ignore[attr-defined]

    def device(self, name: str) -> Device:
        try:
            return self._by_name[name]  # type: ignore[attr-defined]
        except KeyError:
            raise BadInput(f"cluster {self.name}", f"a device named NODE/INDEX of this cluster "
                           f"(e.g. {self.devices[0].name})", name) from None

    def slowdown(self, devices: tuple[str, ...] | list[str]) -> float:
        """Compute time multiplier of a group of devices working in lock step (a
        tensor-parallel group): its slowest member's `slowdown`, 1.0 on a healthy cluster."""
        if not self._stragglers:  # type: ignore[attr-defined]
            return 1.0
        return max(self.device(d).slowdown for d in devices)

    def has_device(self, name: str) -> bool:
        return name in self._by_name  # type: ignore[attr-defined]

    def node(self, name: str) -> Node:
        return self._node_by_name[name]  # type: ignore[attr-defined]

    def has_node(self, name: str) -> bool:
        return name in self._node_by_name  # type: ignore[attr-defined]

    def group_class(self, devices) -> str:
        """The link class a group of `devices` spans, as `Route.link_class` names a
        route's: "intra:NODE" when all are on node NODE, else "inter"."""
        nodes = {self.device(d).node for d in devices}
        return f"intra:{next(iter(nodes))}" if len(nodes) == 1 else "inter"

    def path(self, src: str, dst: str) -> Route:
        """The hops a transfer from device `src` to device `dst` crosses."""
        a, b = self.device(src), self.device(dst)
        if a.name == b.name:
            return Route((), Link(float("inf"), 0.0), "local")
        if a.node == b.node:
            link = self.node(a.node).device_link
            return Route((Hop(f"{a.name}:out", link.bandwidth_bytes_per_s),
                          Hop(f"{b.name}:in", link.bandwidth_bytes_per_s)),
                         link, f"intra:{a.node}")
        na, nb = self.node(a.node), self.node(b.node)
        out_name, out_bw = _rail(na, a.index, "out")
        in_name, in_bw = _rail(nb, b.index, "in")
        latency = max(na.nic.latency_s, nb.nic.latency_s)
        wide = self.region_link(na.name, nb.name)
        if wide is None:
            return Route((Hop(out_name, out_bw), Hop(in_name, in_bw)),
                         Link(min(out_bw, in_bw), latency), "inter")
        bw = wide.bandwidth_bytes_per_s
        return Route((Hop(out_name, out_bw), Hop(f"{na.name}>{nb.name}:path", bw),
                      Hop(in_name, in_bw)),
                     Link(min(out_bw, bw, in_bw),
                          latency if wide.latency_s is None else wide.latency_s), "inter")

    def linked_region(self, node: str) -> str | None:
        """Node `node`'s region when some path of `links` names it (None otherwise: the
        NICs alone set its routes, as they do for every node alike)."""
        if not self.links:
            return None
        region = self.node(node).region
        return region if region in self._linked else None  # type: ignore[attr-defined]

    def region_link(self, x: str, y: str) -> RegionLink | None:
        """The path the file gives between the regions of nodes `x` and `y` (None: the
        NICs alone set the route)."""
        if not self.links:
            return None
        rx, ry = self.node(x).region, self.node(y).region
        return self.links.get((rx, ry) if rx <= ry else (ry, rx))

    def bus_efficiency(self, src: str, link_class: str) -> float:
        """Achievable collective bus bandwidth over a route's link bandwidth, for a
        collective stream that device `src` sends on a route of `link_class`: its type's
        `nic_efficiency` across nodes, `collective_efficiency` inside a node, and inside a
        node without peer-to-peer the host-staged collective rate over the host-staged
        send rate (`Node.device_link`: a ring's steps move both ways through the host)."""
        d = self.device(src)
        if link_class == "inter":
            return d.type.nic_efficiency
        if not self.node(d.node).peer_to_peer:
            return HOST_STAGED_COLLECTIVE_EFFICIENCY / HOST_STAGED_SEND_EFFICIENCY
        return d.type.collective_efficiency

    def price_per_hour(self, device: str) -> float | None:
        d = self.device(device)
        node_price = self.node(d.node).price_per_hour
        return node_price if node_price is not None else d.type.price_per_hour

    def switch_reduces(self, node: str) -> bool:
        """Whether node `node`'s switch reduces in the network (its device type's
        `nvlink_sharp`)."""
        return self.device_types[self.node(node).device_type].nvlink_sharp


def hierarchical_all_reduce(groups: Sequence[Sequence[Any]], switch_reduces: bool) -> bool:
    """Whether NCCL all-reduces over `groups` (each node's members, node by node)
    hierarchically: several nodes with as many members (two or more) on each, whose
    switches reduce (`switch_reduces`: NVLink SHARP, NCCL's NVLS tree): a reduce-scatter
    inside each node, an all-reduce of each member's shard over its rail (its place on
    every node), an all-gather inside each node, pipelined in chunks. Otherwise rings
    (`ring_channels`): nccl-tests over two and three nodes of 8 A100 with four 200 Gbit/s
    NICs measured 86 and 85-96 GB/s bus bandwidth (NVIDIA/nccl issue #1048, nccl-tests
    issue #119), what rings through all GPUs give (the node's NICs, 100 GB/s) and half of
    what the hierarchical scheme would."""
    sizes = {len(g) for g in groups}
    return switch_reduces and len(groups) > 1 and len(sizes) == 1 and min(sizes) >= 2


def ring_channels(groups: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """The rings of a ring all-reduce over `groups` (each node's members, node by node),
    each carrying an equal share of the bytes: one ring on one node; across nodes one per
    member of the smallest group, the c-th visiting every node's members from its c-th
    on, so that each ring leaves a node from another member, through that member's NIC
    (NCCL runs several ring channels and spreads them over a node's GPUs and NICs)."""
    if len(groups) == 1:
        return [tuple(groups[0])]
    return [tuple(x for g in groups for x in (*g[c:], *g[:c]))
            for c in range(min(len(g) for g in groups))]


def _rail(node: Node, index: int, direction: str) -> tuple[str, float]:
    """The NIC hop (name, bytes/s) device `index` of `node` uses: with one NIC the node's
    ``nic-out``/``nic-in``; with several, device i uses NIC i·count // devices (a DGX
    A100: GPU i on HCA i, the rail-optimised layout NCCL uses, one rail per GPU)."""
    if node.nics.count == 1:
        return f"{node.name}:nic-{direction}", node.nics.bandwidth_bytes_per_s
    j = index * node.nics.count // node.count
    return f"{node.name}:nic{j}-{direction}", node.nics.bandwidth_bytes_per_s


# ---------------------------------------------------------------------------- loading

_DEVICE_KEYS = ("peak_flops", "efficiency", "memory", "mem_bandwidth", "link_bandwidth",
                "link_latency", "price_per_hour", "base", "source", "runtime_reserve",
                "nvlink_sharp")
_NODE_KEYS = ("name", "device", "count", "intra_link", "nic", "nics", "price_per_hour",
              "peer_to_peer", "repeat", "slowdown", "mtbf", "region")
_LINK_KEYS = ("bandwidth", "latency")


def builtin_cluster_names() -> list[str]:
    folder = resources.files("hyperpipe") / "data" / "clusters"
    return sorted(p.name.rsplit(".", 1)[0] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_cluster(ref: str | dict | Path, *, base_dir: Path | None = None,
                 where: str | None = None) -> Cluster:
    """A cluster from a built-in name, a YAML/JSON file path, or already-parsed data.
    Errors name the file, or else `where` (default: "--cluster" for a name or path,
    "cluster" for data)."""
    if isinstance(ref, dict):
        return cluster_from_dict(ref, where=where or "cluster",
                                 name=str(ref.get("name", "inline")))
    text = str(ref)
    if text in builtin_cluster_names():
        path = resources.files("hyperpipe") / "data" / "clusters" / f"{text}.yaml"
        with resources.as_file(path) as p:
            return cluster_from_dict(load_document(p), where=f"cluster {text}", name=text)
    p = resolve_ref(text, base_dir)
    if not path_exists(p):
        raise BadInput(where or "--cluster", f"a built-in cluster "
                       f"({', '.join(builtin_cluster_names())}) "
                       "or a YAML/JSON file", text)
    return cluster_from_dict(load_document(p), where=str(p), name=p.stem)


def cluster_ref(cluster: Cluster) -> str | dict:
    """The plan's `cluster` field: the built-in name when `cluster` is that built-in
    unchanged, otherwise the inline document."""
    if cluster.name in builtin_cluster_names() and load_cluster(cluster.name) == cluster:
        return cluster.name
    return {"name": cluster.name, **cluster.source}


def _link(f: Fields, key: str, default: Link | None) -> Link:
    if not f.has(key):
        if default is None:
            raise BadInput(f.at(key), "a link {bandwidth, latency}", has_got=False)
        return default
    lf = f.sub(key, _LINK_KEYS)
    if default is None:
        return Link(lf.quantity("bandwidth", "bandwidth"),
                    lf.quantity("latency", "time", 0.0, positive=False))
    bw = lf.quantity("bandwidth", "bandwidth", default.bandwidth_bytes_per_s)
    lat = lf.quantity("latency", "time", default.latency_s, positive=False)
    return Link(bw, lat)


def _device_type(name: str, f: Fields, catalog: dict[str, DeviceType]) -> DeviceType:
    base_name = catalog_name(f.string("base"), catalog) or f.string("base") \
        if f.has("base") else (name if name in catalog else None)
    if base_name is not None and base_name not in catalog:
        raise BadInput(f.at("base"), f"a known device type ({', '.join(sorted(catalog))})",
                       base_name)
    base = catalog.get(base_name) if base_name else None
    if base is None:
        peak, ratios = _peaks(f, None)
        mem = f.quantity("memory", "bytes")
        # A type defined from scratch takes its figures as achievable: no GEMM curve,
        # full memory and link bandwidth (the closed forms of the tests rely on it).
        base = DeviceType(name=name, peak_flops=peak, memory_bytes=mem,
                          mem_bandwidth_bytes_per_s=1e12, source="user-defined",
                          mem_efficiency=1.0, collective_efficiency=1.0,
                          nic_efficiency=1.0, peak_ratios=ratios)
    # An explicit `efficiency` replaces the base's GEMM curves by that flat fraction.
    flat = f.has("efficiency")
    gemm, simt = (None, None) if flat else (base.gemm, base.simt_gemm)
    sharp = f.raw("nvlink_sharp", base.nvlink_sharp)
    if not isinstance(sharp, bool):
        raise BadInput(f.at("nvlink_sharp"), "true or false (whether the node's switch "
                       "reduces in the network, NVLink SHARP)", sharp)
    peak, ratios = _peaks(f, base)
    return replace(
        base, name=name, gemm=gemm, simt_gemm=simt, peak_flops=peak, peak_ratios=ratios,
        memory_bytes=f.quantity("memory", "bytes", base.memory_bytes),
        mem_bandwidth_bytes_per_s=f.quantity("mem_bandwidth", "bandwidth",
                                             base.mem_bandwidth_bytes_per_s),
        efficiency=f.number("efficiency", base.efficiency, positive=True, at_most=1.0,
                            at_least=1e-6),
        link_bandwidth_bytes_per_s=f.quantity("link_bandwidth", "bandwidth",
                                              base.link_bandwidth_bytes_per_s),
        link_latency_s=f.quantity("link_latency", "time", base.link_latency_s, positive=False),
        price_per_hour=f.quantity("price_per_hour", "price", positive=False)
        if f.has("price_per_hour") else base.price_per_hour,
        source=f.string("source", base.source or "user-defined"),
        # A catalog type given another memory size keeps the catalog's reserve rule;
        # a user-defined type holds none unless it says so.
        runtime_reserve_bytes=f.quantity("runtime_reserve", "bytes", _reserve(base, f),
                                         positive=False),
        nvlink_sharp=sharp,
    )


def _peaks(f: Fields, base: DeviceType | None
           ) -> tuple[float, tuple[tuple[str, float], ...]]:
    """(`peak_flops`, `peak_ratios`) of a device type entry. `peak_flops` is one quantity
    (the fp16/bf16 dense peak: on a catalog base the other dtypes keep their ratio to it;
    on a type defined from scratch it is the peak of every dtype) or a table per dtype
    (`{fp32: "19.5 TFLOP/s", tf32: ..., fp16: ..., bf16: ..., fp8: ...}`, which replaces
    the base's; a model's dtype missing from it falls back as `DTYPE_FALLBACK` says)."""
    if not f.has("peak_flops"):
        if base is None:
            raise BadInput(f.at("peak_flops"), "a FLOP/s quantity or a table per dtype",
                           has_got=False)
        return base.peak_flops, base.peak_ratios
    if not isinstance(f.raw("peak_flops"), dict):
        peak = f.quantity("peak_flops", "flops")
        return peak, (base.peak_ratios if base is not None else ())
    table = f.sub("peak_flops", DTYPES)
    peaks = {d: table.quantity(d, "flops") for d in DTYPES if table.has(d)}
    if not peaks:
        raise BadInput(f.at("peak_flops"), f"a table with at least one of {', '.join(DTYPES)}",
                       f.raw("peak_flops"))
    return peak_ratios(peaks)


def _reserve(base: DeviceType, f: Fields) -> float:
    if base.runtime_reserve_bytes and f.has("memory"):
        return DeviceType.reserve_for(f.quantity("memory", "bytes"))
    return base.runtime_reserve_bytes


# A straggler's compute-time multiplier: >= 1.0 (docs/formats.md), and at most a million
# (a device that slow is a dead one; 1e-300 or 1e308 would divide or multiply to 0 or inf).
MAX_SLOWDOWN = 1_000_000


def _slowdown(nf: Fields, count: int) -> tuple[float, ...]:
    """A node's `slowdown`: one number for all its devices, or a mapping of device index
    to number (unlisted devices 1.0). Every multiplier is a number in [1.0, MAX_SLOWDOWN]."""
    if not nf.has("slowdown"):
        return ()
    raw = nf.raw("slowdown")
    if not isinstance(raw, dict):
        value = nf.number("slowdown", positive=True, at_least=1.0, at_most=MAX_SLOWDOWN)
        return () if value == 1.0 else (value,) * count
    sub = nf.sub("slowdown")
    out = [1.0] * count
    for key in raw:
        text = str(key)
        # ASCII digits only: "²".isdigit() is true but int("²") raises.
        index = int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else -1
        if not 0 <= index < count:
            raise BadInput(sub.at(text), f"a device index 0..{count - 1} of the node", key)
        out[index] = sub.number(key, positive=True, at_least=1.0, at_most=MAX_SLOWDOWN)
    return () if all(v == 1.0 for v in out) else tuple(out)


def cluster_from_dict(data: Any, *, where: str, name: str) -> Cluster:
    """Check and convert a parsed cluster document (units converted here, once)."""
    top = Fields(data, where, ("name", "device_types", "nodes", "inter_node", "links",
                               "description"))
    catalog = builtin_device_types()
    catalog_names = tuple(catalog)
    name = printable(top.string("name", name))          # shown everywhere
    if top.has("description"):
        top.string("description")
    spelled: dict[str, str] = {}    # catalog part -> the device_types key spelling it apart
    if top.has("device_types"):
        types = top.sub("device_types")
        for type_name in types.data:        # names escaped as kept: shown everywhere
            if not isinstance(type_name, str):     # YAML reads `5:` as a number
                raise BadInput(types.at(str(type_name)), "a device type name (a string: "
                               f"quote it, '{type_name}')", type_name)
            # A key overrides a catalog part by its exact name; one that spells a part
            # apart ("a100-80gb", "t4") is a type of its own, used by the nodes that name
            # it so; a node naming the part itself is refused below (it had silently run
            # the unmodified part)
            kept = printable(type_name)
            part = device_type_name(kept, catalog_names)
            if part != kept and part in catalog_names:
                spelled[part] = kept
            catalog[kept] = _device_type(kept, types.sub(str(type_name), _DEVICE_KEYS),
                                         catalog)
    inter = _link(top, "inter_node", Link(12.5e9, 5e-6))  # default 100 Gbit/s, 5 us
    nodes: list[Node] = []
    names: set[str] = set()
    total_devices = 0
    raw_nodes = top.items("nodes")
    if not raw_nodes:
        raise BadInput(top.at("nodes"), "a non-empty list of nodes", raw_nodes)
    source = json.loads(json.dumps(data))
    for i, raw in enumerate(raw_nodes):
        nf = Fields(raw, f"{where}: nodes[{i}]", _NODE_KEYS)
        dev_name = device_type_name(nf.string("device"), catalog)
        if dev_name in spelled:
            raise BadInput(nf.at("device"), f"one reading of {dev_name}: device_types."
                           f"{spelled[dev_name]} spells the catalog part apart (key it "
                           f"{dev_name} to override the part, or name the device "
                           f"{spelled[dev_name]} to use that type)", dev_name)
        if dev_name not in catalog:
            raise BadInput(nf.at("device"), f"a known device type ({', '.join(sorted(catalog))}) "
                           "or one defined under device_types", dev_name)
        dtype = catalog[dev_name]
        count = nf.positive_int("count", at_most=limits.MAX_NODE_DEVICES)
        intra = _link(nf, "intra_link", Link(dtype.link_bandwidth_bytes_per_s,
                                             dtype.link_latency_s))
        nic = _link(nf, "nic", inter)
        nics = Nics(1, nic.bandwidth_bytes_per_s)
        if nf.has("nics"):
            cf = nf.sub("nics", ("count", "bandwidth", "latency"))
            nics = Nics(cf.positive_int("count", 1, at_most=limits.MAX_NODE_DEVICES),
                        cf.quantity("bandwidth", "bandwidth", nic.bandwidth_bytes_per_s))
            nic = Link(nic.bandwidth_bytes_per_s,
                       cf.quantity("latency", "time", nic.latency_s, positive=False))
        price = nf.quantity("price_per_hour", "price", positive=False) \
            if nf.has("price_per_hour") else None
        repeat = nf.positive_int("repeat", 1, at_most=limits.MAX_NODE_REPEAT)
        # the document keeps its integers as read (`2.0`, `2e0`: 2), for what reads it
        # again (`with_node_names`, `links_among`, a what-if's variants)
        entry = source["nodes"][i]
        entry.update({k: v for k, v in (("count", count), ("repeat", repeat)) if k in entry})
        if isinstance(entry.get("nics"), dict) and "count" in entry["nics"]:
            entry["nics"]["count"] = nics.count
        total_devices += count * repeat
        if total_devices > limits.MAX_CLUSTER_DEVICES:
            raise BadInput(nf.at("count"), f"at most {limits.MAX_CLUSTER_DEVICES} devices in "
                           "the whole cluster (hyperpipe.core.limits)", f"{total_devices} so far")
        slowdown = _slowdown(nf, count)
        p2p = nf.raw("peer_to_peer", dtype.peer_to_peer)
        if not isinstance(p2p, bool):
            raise BadInput(nf.at("peer_to_peer"), "true or false (whether the node's GPUs "
                           "reach each other by PCIe peer-to-peer or NVLink)", p2p)
        mtbf = nf.quantity("mtbf", "time") if nf.has("mtbf") else None
        base_name = printable(nf.string("name", f"n{len(nodes)}"))   # shown everywhere
        region = printable(nf.string("region")) if nf.has("region") else ""
        for r in range(repeat):
            node_name = base_name if repeat == 1 else f"{base_name}{r}"
            if "/" in node_name or node_name in names:
                raise BadInput(nf.at("name"), "a unique node name without '/'", node_name)
            names.add(node_name)
            nodes.append(Node(node_name, dev_name, count, intra, nic, price, nics, slowdown,
                              mtbf, p2p, region))
    used = {n.device_type for n in nodes}
    return Cluster(name=name, device_types={k: v for k, v in catalog.items() if k in used},
                   nodes=tuple(nodes), inter_node=inter, source=source,
                   links=_region_links(top, {n.region for n in nodes}), origin=where)


def device_type_name(spelled: str, type_names: Iterable[str]) -> str:
    """The device type a node's `device` field names, as the loader reads it: the one of
    `type_names` (the catalog's and the file's `device_types`) it spells
    (`catalog_name`), else the name as written (escaped: `printable`)."""
    name = printable(spelled)
    return catalog_name(name, type_names) or name


def with_node_names(doc: dict[str, Any]) -> dict[str, Any]:
    """Cluster document `doc` with each node entry's name written out as the loader
    gives it (`n` and its position, copies counted): taking entries out of the document
    then leaves the others, and the `links` naming them, as they were."""
    nodes, made = [], 0
    for node in doc.get("nodes", []):
        if isinstance(node, dict):
            if "name" not in node:
                node = {**node, "name": f"n{made}"}
            made += node_copies(node)
        nodes.append(node)
    return {**doc, "nodes": nodes} if "nodes" in doc else doc


def node_copies(entry: dict[str, Any]) -> int:
    """How many nodes a node entry of a cluster document makes: its `repeat` read as the
    loader reads it (`2.0` and `2e0` are 2), 1 without one (or with one the loader
    refuses)."""
    repeat = whole_number(entry.get("repeat", 1))
    return repeat if isinstance(repeat, int) and not isinstance(repeat, bool) \
        and repeat > 1 else 1


def links_among(doc: dict[str, Any]) -> dict[str, Any]:
    """Cluster document `doc` with only the `links` whose ends are regions of its nodes
    (a node's `region`, or its name: `with_node_names`): what is left of a file's paths
    when nodes are taken out of it (a failure, a sweep's count 0 or device subset)."""
    if "links" not in doc:
        return doc
    regions = set()
    for node in with_node_names(doc).get("nodes", []):
        if not isinstance(node, dict):
            continue
        copies = node_copies(node)
        regions.update([str(node["region"])] if node.get("region") else
                       [f"{node['name']}{r}" for r in range(copies)] if copies > 1
                       else [str(node["name"])])
    kept = [link for link in doc["links"] if isinstance(link, dict)
            and all(str(end) in regions for end in link.get("between", ()) or ())]
    return {**doc, "links": kept}


def _region_links(top: Fields, regions: set[str]) -> dict[tuple[str, str], RegionLink]:
    """The file's `links`: each `{between: [REGION, REGION], bandwidth, latency}`, a
    region being a node's `region` or, without one, its name; one entry per pair."""
    out: dict[tuple[str, str], RegionLink] = {}
    for i, raw in enumerate(top.items("links", [])):
        lf = Fields(raw, f"{top.at('links')}[{i}]", ("between", "bandwidth", "latency"))
        ends = lf.raw("between", None)
        if not (isinstance(ends, list) and len(ends) == 2
                and all(isinstance(e, str) for e in ends)):
            raise BadInput(lf.at("between"), "two region or node names, e.g. [eu, us]", ends)
        for end in ends:
            if printable(end) not in regions:
                raise BadInput(lf.at("between"), "names of regions (a node's `region`, or "
                               f"its name without one): {', '.join(sorted(regions))}", end)
        x, y = sorted(map(printable, ends))
        if (x, y) in out:
            raise BadInput(lf.at("between"), "each pair of regions once", [x, y])
        out[(x, y)] = RegionLink(lf.quantity("bandwidth", "bandwidth"),
                                 lf.quantity("latency", "time", positive=False)
                                 if lf.has("latency") else None)
    return out

