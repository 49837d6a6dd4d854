"""Calibration profiles: measured numbers that replace the analytic cost model's.

A profile is plain data with a JSON round trip. Compute entries are keyed by
``"DEVICE_TYPE|LAYER_KIND|OP"`` and give time = a_s + b_s_per_unit · FLOPs of that op
for one micro-batch; link entries are keyed by link class (``"inter"``,
``"intra:NODE"`` or ``"*"`` for every class) and give an alpha-beta link;
optimizer entries are keyed by device type, with x = parameters held. Overhead entries,
keyed ``"DEVICE_TYPE|OP"``, are seconds each compute action costs on top of its layers
(dispatch, Python, the executor's bookkeeping), fitted from pipeline runs.

Every fitted time is non-negative: ``a_s``, ``b_s_per_unit`` and overheads are >= 0.

A profile records what it was measured on (``provenance.model``,
``provenance.model_fingerprint``, and the device types of its entries); `check_profile`
refuses it for another model, for a cluster with device types it has no entry for, or
when its provenance does not say which model it was measured on, unless the user asks
for it explicitly. A profile without provenance (written by hand) is not checked
against the model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperpipe.cluster.cluster import Link
from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import Fields, load_document, write_atomic
from hyperpipe.plan.trace import COMPUTE_OPS

PROFILE_FORMAT = "hyperpipe.profile/1"


@dataclass(frozen=True)
class Fit:
    """time_s = a_s + b_s_per_unit * x, from a least-squares fit."""

    a_s: float
    b_s_per_unit: float
    samples: int = 0
    rel_rmse: float = 0.0          # root-mean-square residual / mean time, of the fit

    def __call__(self, x: float) -> float:
        return max(0.0, self.a_s + self.b_s_per_unit * x)


@dataclass(frozen=True)
class Profile:
    compute: dict[str, Fit] = field(default_factory=dict)
    links: dict[str, Link] = field(default_factory=dict)
    optimizer: dict[str, Fit] = field(default_factory=dict)
    # group class ("inter": across nodes, "intra:NODE": inside one) or "*"; x = bytes
    allreduce: dict[str, Fit] = field(default_factory=dict)
    overhead: dict[str, float] = field(default_factory=dict)  # "DEVICE_TYPE|OP" -> s/action
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def emulated(self) -> bool:
        return bool(self.provenance.get("emulated", False))

    @staticmethod
    def key(device_type: str, layer_kind: str, op: str) -> str:
        return f"{device_type}|{layer_kind}|{op}"

    def action_overhead_s(self, device_type: str, op: str) -> float:
        return self.overhead.get(f"{device_type}|{op}", 0.0)

    def link(self, link_class: str) -> Link | None:
        return self.links.get(link_class) or self.links.get("*")

    def allreduce_fit(self, group_class: str) -> Fit | None:
        """The measured all-reduce of groups of `group_class` ("inter": spanning nodes,
        "intra:NODE": inside node NODE), or of every group ("*"); None: not measured."""
        return self.allreduce.get(group_class) or self.allreduce.get("*")

    def to_dict(self) -> dict[str, Any]:
        fit = lambda f: {"a_s": f.a_s, "b_s_per_unit": f.b_s_per_unit,  # noqa: E731
                         "samples": f.samples, "rel_rmse": f.rel_rmse}
        return {
            "format": PROFILE_FORMAT,
            "provenance": self.provenance,
            "compute": {k: fit(v) for k, v in sorted(self.compute.items())},
            "links": {k: {"bandwidth_bytes_per_s": v.bandwidth_bytes_per_s,
                          "latency_s": v.latency_s} for k, v in sorted(self.links.items())},
            "optimizer": {k: fit(v) for k, v in sorted(self.optimizer.items())},
            "allreduce": {k: fit(v) for k, v in sorted(self.allreduce.items())},
            "overhead": dict(sorted(self.overhead.items())),
        }

    def save(self, path: str | Path) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")


MAX_FIT_S = 1e9      # seconds: the largest intercept or slope a profile may hold


def _fit(data: Any, where: str) -> Fit:
    """A fit of a profile file: a_s and b_s_per_unit finite, >= 0 and <= MAX_FIT_S (the
    calibration's least squares is non-negative; a negative time per call or per unit
    is a corrupted or hand-edited file, as a negative overhead is)."""
    f = Fields(data, where, ("a_s", "b_s_per_unit", "samples", "rel_rmse"))
    a = f.number("a_s", at_most=MAX_FIT_S)
    b = f.number("b_s_per_unit", at_most=MAX_FIT_S)
    return Fit(a, b, int(f.number("samples", 0, at_most=limits.MAX_INT)),
               f.number("rel_rmse", 0.0, at_most=1e6))


def profile_from_dict(data: Any, *, where: str) -> Profile:
    top = Fields(data, where, ("format", "provenance", "compute", "links", "optimizer",
                               "allreduce", "overhead"))
    if top.raw("format", None) != PROFILE_FORMAT:
        raise BadInput(top.at("format"), repr(PROFILE_FORMAT), top.raw("format", None))
    compute = {str(k): _fit(v, f"{where}: compute.{k}")
               for k, v in Fields(top.raw("compute", {}), top.at("compute")).data.items()}
    ops = ", ".join(COMPUTE_OPS)
    for k in compute:
        if k.count("|") != 2 or k.rsplit("|", 1)[1] not in COMPUTE_OPS:
            raise BadInput(f"{where}: compute.{k}", f"a key DEVICE_TYPE|LAYER_KIND|OP, OP one "
                           f"of {ops}", k)
    links = {}
    for k in Fields(top.raw("links", {}), top.at("links")).data:
        if not _is_link_class(str(k)):
            raise BadInput(f"{where}: links.{k}", "a link class key: inter, intra:NODE or "
                           "* (every class)", k)
    for k in Fields(top.raw("allreduce", {}), top.at("allreduce")).data:
        if not _is_link_class(str(k)):
            raise BadInput(f"{where}: allreduce.{k}", "a group class key: inter (groups "
                           "across nodes), intra:NODE (groups inside node NODE) or * "
                           "(every group)", k)
    for k, v in Fields(top.raw("links", {}), top.at("links")).data.items():
        lf = Fields(v, f"{where}: links.{k}", ("bandwidth_bytes_per_s", "latency_s"))
        links[str(k)] = Link(lf.quantity("bandwidth_bytes_per_s", "bandwidth"),
                             lf.quantity("latency_s", "time", positive=False))
    opt = {str(k): _fit(v, f"{where}: optimizer.{k}")
           for k, v in Fields(top.raw("optimizer", {}), top.at("optimizer")).data.items()}
    ar = {str(k): _fit(v, f"{where}: allreduce.{k}")
          for k, v in Fields(top.raw("allreduce", {}), top.at("allreduce")).data.items()}
    of = Fields(top.raw("overhead", {}), top.at("overhead"))
    overhead = {str(k): of.number(str(k), at_most=MAX_FIT_S) for k in of.data}
    for k in overhead:
        if k.count("|") != 1 or k.rsplit("|", 1)[1] not in COMPUTE_OPS:
            raise BadInput(f"{where}: overhead.{k}", f"a key DEVICE_TYPE|OP, OP one of {ops}",
                           k)
    prov = top.raw("provenance", {})
    if not isinstance(prov, dict):
        raise BadInput(top.at("provenance"), "a mapping", prov)
    return Profile(compute, links, opt, ar, overhead, prov)


def _is_link_class(key: str) -> bool:
    """Whether `key` names a link class a route between two devices prices by
    (`Route.link_class`: a device to itself crosses none) or all of them."""
    return key in ("*", "inter") or (key.startswith("intra:") and len(key) > 6)


def model_fingerprint(spec: Any) -> str:
    """sha256 (first 16 hex digits) of a ModelSpec's document: equal for equal shapes."""
    doc = json.dumps(spec.to_dict(), sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def check_profile(profile: Profile, spec: Any, cluster: Any, *, where: str,
                  allow_mismatch: bool = False, devices: Any = None) -> None:
    """Refuse (BadInput) a profile measured on another model, one whose provenance names
    no model (`provenance` non-empty without `model_fingerprint` or `model`), or one
    without `compute` entries for a device type in use (`devices`, by default every
    device of `cluster`: its costs would silently mix with analytic ones; an empty
    `compute` covers none), or one with entries nothing reads (a layer kind the model
    lacks, `block` read for `moe` too; optimizer or overhead entries for a device type
    its compute entries lack: a misspelt key), unless `allow_mismatch`. Profiles older
    than the fingerprint are checked by model name; a profile without provenance
    (written by hand) is not checked against the model's fingerprint or name."""
    if allow_mismatch:
        return
    hint = "pass `allow_profile_mismatch` to use it anyway"
    prov = profile.provenance
    got_fp, got_name = prov.get("model_fingerprint"), prov.get("model")
    if prov and not got_fp and not got_name:
        raise BadInput(f"{where}: provenance.model_fingerprint", "the model the profile was "
                       f"measured on, to check against model {spec.name} "
                       f"({model_fingerprint(spec)}); its provenance names none: {hint}",
                       has_got=False)
    if (got_fp and got_fp != model_fingerprint(spec)) or \
            (not got_fp and got_name and got_name != spec.name):
        fp = got_fp or "no fingerprint"
        other = f"another {got_name} (other shapes, {fp})" if got_name == spec.name \
            else f"{got_name} ({fp})"
        raise BadInput(where, f"a profile measured on model {spec.name} "
                       f"({model_fingerprint(spec)}); it was measured on {other}: {hint}",
                       has_got=False)
    kinds = {layer.kind for layer in spec.layers}
    if "moe" in kinds:        # an MoE layer without moe fits is priced by block's
        kinds.add("block")
    stray = sorted({k.split("|")[1] for k in profile.compute} - kinds)
    if stray:
        raise BadInput(f"{where}: compute", f"entries for layer kinds of model {spec.name} "
                       f"({', '.join(sorted(kinds))}); it has entries for "
                       f"{', '.join(stray)}: {hint}", has_got=False)
    covered = {k.split("|")[0] for k in profile.compute}
    used = cluster.devices if devices is None else [cluster.device(d) for d in devices]
    missing = sorted({d.type.name for d in used} - covered)
    if missing:
        raise BadInput(f"{where}: compute", f"entries for every device type used on "
                       f"cluster {cluster.name}; it has none for {', '.join(missing)} (it "
                       f"covers {', '.join(sorted(covered)) or 'none'}): {hint}",
                       has_got=False)
    for section, types in (("optimizer", set(profile.optimizer)),
                           ("overhead", {k.split("|")[0] for k in profile.overhead})):
        if covered and (extra := sorted(types - covered)):
            raise BadInput(f"{where}: {section}", "entries for the device types of its "
                           f"compute entries ({', '.join(sorted(covered))}); it has "
                           f"entries for {', '.join(extra)}: {hint}", has_got=False)


def load_profile(path: str | Path) -> Profile:
    return profile_from_dict(load_document(path), where=str(path))
