"""What-if sweeps: vary a cluster or model parameter, search the best plan per variant.

A variation is ``KEY=V1,V2,...`` (several give their grid): a dotted path into the
cluster document (``inter_node.bandwidth``, ``nodes.NAME.count`` with NAME as written or
a position, ``device_types.TYPE.peak_flops``, ...), ``model`` (a preset or file per
value), ``model.FIELD`` (an override, e.g. ``model.seq_len=1024,2048``) or
``global_batch``. A sweep that sets a ``slowdown``, or one given today's plan, also keeps
that plan on every variant against re-planning (`hyperpipe.whatif.stragglers`). `pool`
makes every non-empty subset of the cluster's device types a variant; with prices the
table has the cost per million tokens and the (time, cost) Pareto front.

>>> r = whatif(load_model("tiny-gpt"), load_cluster("demo-hetero"), SweepOptions(
...     Planning(global_batch=8), vary=("inter_node.bandwidth=1 Gbit/s,100 Gbit/s",)))
...                                                                 # doctest: +SKIP
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, replace
from typing import Any

from hyperpipe.cluster.catalog import DTYPES, builtin_device_types, catalog_name
from hyperpipe.cluster.cluster import (
    Cluster,
    cluster_from_dict,
    device_type_name,
    links_among,
    with_node_names,
)
from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput, InfeasiblePlan, printable
from hyperpipe.core.files import whole_number
from hyperpipe.core.progress import Progress
from hyperpipe.models import ModelSpec, load_model
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.profile import check_profile
from hyperpipe.search.evaluate import Candidate, pareto_front, rank_key
from hyperpipe.search.report import describe_plan
from hyperpipe.search.search import search
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.whatif.added_devices import keep_unused, needs_base, simulate_on
from hyperpipe.whatif.stragglers import is_straggler_key
from hyperpipe.whatif.variants import Planning, Row, VariantTask, WhatIfResult
from hyperpipe.whatif.vary_paths import TABLE_FIELDS, check_profile_fit, check_vary

__all__ = ["Planning", "Row", "SweepOptions", "VariantTask", "WhatIfResult",
           "evaluate_variant", "format_whatif", "parse_vary", "plot_whatif", "set_path",
           "whatif"]


@dataclass(frozen=True)
class SweepOptions:
    """What a sweep varies, and how each variant is planned."""

    planning: Planning
    vary: tuple[str, ...] = ()          # "KEY=V1,V2,..." each; several give their grid
    pool: bool = False                  # every subset of the device types a variant
    progress: bool | None = None        # a bar over the variants: always, terminal, never


def parse_vary(text: str) -> tuple[str, list[str]]:
    """'KEY=V1,V2' -> (KEY, [V1, V2]); BadInput naming the option `vary` otherwise."""
    key, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",")]
    if not sep or not key.strip() or not any(items):
        raise BadInput("vary", "KEY=V1,V2,... e.g. 'inter_node.bandwidth=10 Gbit/s,"
                       "100 Gbit/s'", text)
    if not all(items):
        raise BadInput(f"vary {key.strip()}", "a value between every two commas", text)
    return key.strip(), items


def _scalar(text: str) -> Any:
    """Numbers stay numbers (counts, efficiencies), `true` and `false` are booleans (as
    in the files); everything else is a string."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def set_path(doc: dict, key: str, value: str, *, cluster: Cluster | None = None) -> None:
    """Set a dotted `key` of a cluster document; list items by `name` or position. A
    field of `TABLE_FIELDS` set whole takes the one value (its table goes); one entry of
    its table set where the field holds one value turns that value into the table it
    stands for first (a node's slowdown per device; a type's peaks per dtype, from
    `cluster`'s device types or the catalog), so the other entries keep their values."""
    parts = key.split(".")
    node: Any = doc
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            match = [x for x in node if isinstance(x, dict) and x.get("name") == part]
            if not match and part.isascii() and part.isdigit() and len(part) < 10 \
                    and int(part) < len(node):
                match = [node[int(part)]]
            if not match:
                names = [x.get("name") for x in node if isinstance(x, dict)]
                raise BadInput(f"vary {key}", f"a name among {names} or a position",
                               part)
            if last:
                field = "bandwidth" if parts[0] == "links" else "count"
                raise BadInput(f"vary {key}", "a field of the item, e.g. "
                               f"{key}.{field}", has_got=False)
            node = match[0]
        elif isinstance(node, dict):
            if last:
                held = node.get(part)
                if isinstance(held, (dict, list)) and not (i == 2 and part in TABLE_FIELDS):
                    inner = (f"0.{'bandwidth' if part == 'links' else 'count'}"
                             if isinstance(held, list) else next(iter(held), "FIELD"))
                    raise BadInput(f"vary {key}", f"a path to one value ({part} holds a "
                                   f"{type(held).__name__}; e.g. {key}.{inner})",
                                   has_got=False)
                node[part] = _scalar(value)
            else:
                if i == 2 and part in TABLE_FIELDS and not isinstance(node.get(part), dict):
                    node[part] = _as_table(key, node, cluster)
                node = node.setdefault(part, {})
        else:
            raise BadInput(f"vary {key}", "a path into the cluster document", part)


def _as_table(key: str, entry: dict, cluster: Cluster | None) -> dict[str, Any]:
    """The table that the one value (or none) of `entry`'s table field (`key`'s third
    part) stands for: a node's `slowdown` per device index, a device type's `peak_flops`
    per dtype (SI numbers; from `cluster`'s type of that name, else the catalog's)."""
    parts = key.split(".")
    held = entry.get(parts[2])
    if parts[2] == "slowdown":
        count = entry.get("count")
        if held is None or not isinstance(count, int):
            return {}                        # unlisted devices run at 1.0
        return {str(j): held for j in range(count)}
    catalog = builtin_device_types()
    known = cluster.device_types.get(parts[1]) if cluster is not None else None
    if known is None and held is None:
        known = catalog.get(catalog_name(parts[1], catalog) or parts[1])
    if known is None:
        if held is None:
            return {}                        # a type from scratch: its table starts here
        raise BadInput(f"vary {key}", f"a device type the cluster uses ({parts[1]} holds "
                       f"one peak_flops: vary {'.'.join(parts[:3])})", has_got=False)
    if not known.peak_ratios:           # one rate in every dtype
        return {d: known.peak_flops for d in DTYPES}
    return {d: known.peak_flops * r for d, r in known.peak_ratios}


def _variants(model: ModelSpec, source: Any, cluster: Cluster, global_batch: int,
              vary: tuple[str, ...], pool: bool):
    """(settings, model, cluster, global batch) per variant; `source` is what `model`
    was loaded from (``model.FIELD`` settings load it again with the field overridden)."""
    axes = [parse_vary(v) for v in vary]
    for key, values in axes:
        if key not in ("model", "global_batch") and not key.startswith("model."):
            check_vary(key, values, cluster.source)
    _check_distinct([key for key, _ in axes], cluster.source)
    if pool:
        types = list(dict.fromkeys(n.device_type for n in cluster.nodes))
        size = 2 ** len(types) - 1             # counted before a subset is built
        for _, values in axes:
            size *= len(values)
        if size > limits.MAX_VARIANTS:
            raise BadInput("pool", f"a sweep of at most {limits.MAX_VARIANTS} variants "
                           f"(hyperpipe.core.limits); {len(types)} device types give "
                           f"2^{len(types)} - 1 subsets", f"{size} variants")
        subsets = [s for r in range(len(types), 0, -1)
                   for s in itertools.combinations(types, r)]
        axes.append(("use", ["+".join(s) for s in subsets]))
    if not axes:
        raise BadInput("whatif", "at least one variation (`vary` KEY=V1,V2,...) or `pool`",
                       has_got=False)
    for combo in itertools.product(*[[(k, v) for v in values] for k, values in axes]):
        # names written out first: nodes taken out below leave the others (and the
        # paths naming them) as they were
        doc = with_node_names(copy.deepcopy(cluster.source))
        doc.setdefault("name", cluster.name)
        ref, batch = source, global_batch
        overrides: dict[str, Any] = {}
        for key, value in combo:
            if key == "model":
                ref = value
            elif key.startswith("model."):
                overrides[key[len("model."):]] = _scalar(value)
            elif key == "global_batch":     # `1e2`, `100.0`: 100, as files read it
                batch = whole_number(_scalar(value))
            elif key == "use":         # by the type each node's `device` resolves to
                keep = set(value.split("+"))
                names = [*builtin_device_types(),
                         *(printable(k) for k in doc.get("device_types", {}))]
                doc["nodes"] = [n for n in doc["nodes"]
                                if device_type_name(str(n.get("device")), names) in keep]
            else:
                set_path(doc, key, value, cluster=cluster)
        # count 0 means "without this node" (a what-if, not a file error); the paths
        # of the regions that leave with it go too
        doc["nodes"] = [n for n in doc.get("nodes", []) if n.get("count") != 0]
        doc = links_among(doc)
        where = f"vary {', '.join(f'{k}={v}' for k, v in combo)}"
        try:
            variant_cluster = cluster_from_dict(doc, where="cluster", name=cluster.name) \
                if doc["nodes"] else None     # every node removed: a row, not an error
        except BadInput as exc:              # name the settings as typed, then the field
            raise BadInput(f"{where} ({exc.where})", exc.expected, exc.got,
                           has_got=exc.got is not None) from None
        if ref is source and not overrides:
            spec = model
        else:
            spec = load_model(ref, where="model" if ref is source and not overrides
                              else where, overrides=overrides or None)
        yield combo, spec, variant_cluster, batch


def _check_distinct(keys: list[str], doc: dict[str, Any]) -> None:
    """BadInput when two --vary keys set one field (the later would win while the label
    showed both): the same key, one node named by name and by position, or a field
    and an entry of its table (`nodes.v100.slowdown`, `nodes.v100.slowdown.3`)."""
    names = [n.get("name") for n in with_node_names(doc).get("nodes", [])
             if isinstance(n, dict)]
    seen: dict[tuple[str, ...], str] = {}
    for key in keys:
        parts = key.split(".")
        if len(parts) > 1 and parts[0] == "nodes" and parts[1] in names:
            parts[1] = str(names.index(parts[1]))
        path = tuple(parts)
        other = seen.get(path) if path[0] == "model" else next(   # model, model.FIELD
            (seen[p] for p in seen if p[:len(path)] == path or path[:len(p)] == p), None)
        if other is not None:
            raise BadInput("vary", f"each field varied once (--vary {other} sets it "
                           "already; list its values in one --vary)", key)
        seen[path] = key


def whatif(model: ModelSpec, cluster: Cluster, options: SweepOptions, *, profile: Any = None,
           backend: Any = None, model_source: Any = None, profile_source: str = "profile",
           allow_profile_mismatch: bool = False) -> WhatIfResult:
    """Search every variant; a variant where nothing fits gets a row with its error.

    With `backend` (`hyperpipe.search.backends`, entered) the variants run as its tasks,
    each search in one process; otherwise one after another, each search over
    `options.planning.workers` processes. A sweep over slowdowns (or any sweep given
    today's plan) also reports, per variant, that plan kept on the variant against
    re-planning (`hyperpipe.whatif.stragglers`). A variant that adds devices to another
    (or to the cluster as given) keeps the smaller one's plan when that is faster
    (`hyperpipe.whatif.added_devices`). `model_source`: the preset name, file or mapping
    `model` was loaded from, which ``model.FIELD`` variations load again with the field
    overridden (None: `model` itself). Under a progress bar the searches' own are silent.
    `profile` is checked against each variant's model and device types as `search`
    checks it (`check_profile`; errors name `profile_source` and the variant), before any
    search runs, unless `allow_profile_mismatch`; a cluster field whose value its fits
    replace (a fitted link, a device type's compute fits: `check_profile_fit`) is
    refused beside it, whatever `allow_profile_mismatch` says.
    """
    planning = options.planning
    c = planning.constraints()
    one = planning.workers if backend is None else 1          # processes per search
    plan = planning.plan
    stragglers = plan is not None or any(is_straggler_key(parse_vary(v)[0])
                                         for v in options.vary)
    source = model if model_source is None else model_source
    tasks = []
    for combo, spec, variant, batch in _variants(model, source, cluster, planning.global_batch,
                                                 options.vary, options.pool):
        if not isinstance(batch, int) or isinstance(batch, bool) \
                or not 1 <= batch <= limits.MAX_GLOBAL_BATCH:
            raise BadInput("vary global_batch", "positive integers of at most "
                           f"{limits.MAX_GLOBAL_BATCH} (hyperpipe.core.limits)", batch)
        shown = tuple((printable(k), printable(v)) for k, v in combo)    # as printed
        if profile is not None and variant is not None:
            check_profile(profile, spec, variant, allow_mismatch=allow_profile_mismatch,
                          where=f"{profile_source} (vary "
                          f"{', '.join(f'{k}={v}' for k, v in combo)})")
        if profile is not None:       # what its fits price, a sweep cannot vary
            kinds = {layer.kind for layer in spec.layers}
            for key, _ in combo:
                if key not in ("global_batch", "use") and key.split(".")[0] != "model":
                    check_profile_fit(key, profile, cluster.source, kinds,
                                      source=profile_source)
        tasks.append(VariantTask(shown, spec, variant,
                                 replace(c, global_batch=batch), profile, one, plan))
    given = VariantTask((), model, cluster, c, profile, one, None)
    base_needed = needs_base(tasks, given)
    steps = len(tasks) + (stragglers and plan is None) + base_needed
    with Progress(steps, "what-if: variants", enabled=options.progress) as bar:
        quiet = bar.enabled          # one bar: the searches inside stay silent under it
        if stragglers and plan is None:     # today's plan: the best on the cluster as given
            plan = search(model, cluster, c, profile=profile, top=1,
                          workers=one, backend=backend, quiet=quiet,
                          peers=False).best.plan
            tasks = [replace(t, keep=plan) for t in tasks]
            bar.advance(note="the cluster as given")
        tasks = [replace(t, quiet=quiet) for t in tasks]
        if backend is not None:
            rows = backend.map(evaluate_variant, tasks)
            bar.advance(len(tasks))
        else:
            rows = []
            for t in tasks:
                rows.append(evaluate_variant(t))
                bar.advance(note=rows[-1].label)
        extra = []
        if base_needed:       # the devices as given, with those a variant adds unused
            extra.append(("the cluster as given", given,
                          evaluate_variant(replace(given, quiet=quiet))))
            bar.advance(note="the cluster as given")
    rows = keep_unused(rows, tasks, extra)
    return WhatIfResult(model.name, cluster.name, rows, _pareto_rows(rows),
                        "stragglers" if stragglers else "sweep")


def evaluate_variant(task: VariantTask) -> Row:
    """The best plan of one variant (and today's plan kept on it, when given)."""
    variant, settings = task.cluster, task.settings
    if variant is None:
        return Row(settings, 0, None, None, error="no devices left")
    n = len(variant.devices)
    cost = CostModel(task.model, variant, task.profile)
    kept = _kept(task.keep, cost) if task.keep is not None else None
    try:
        res = search(task.model, variant, task.constraints, profile=task.profile,
                     top=1, workers=task.workers, quiet=task.quiet, peers=False)
    except InfeasiblePlan as exc:
        if kept is not None and kept.metrics.feasible:
            return Row(settings, n, kept, None, kept=kept, kept_is_answer=True,
                       description=describe_plan(kept.plan, variant))
        return Row(settings, n, None, None, error=str(exc), kept=kept)
    best = res.best
    if task.keep is not None:
        if kept is not None and kept.metrics.feasible and (
                not best.metrics.feasible or rank_key(task.constraints, kept.metrics)
                < rank_key(task.constraints, best.metrics)):
            return Row(settings, n, kept, res.baselines.get("uniform"), kept=kept,
                       kept_is_answer=True, description=describe_plan(kept.plan, variant))
    return Row(settings, n, best, res.baselines.get("uniform"), kept=kept,
               description=describe_plan(best.plan, variant))


def _kept(plan: Plan, cost: CostModel) -> Candidate | None:
    """Today's plan on a variant; None when the variant lacks its devices."""
    try:
        return simulate_on(plan, cost)
    except (BadInput, InfeasiblePlan):
        return None


def _pareto_rows(rows: list[Row]) -> list[int]:
    """Indices of the rows whose best plan is on the (time, cost) front."""
    bests = [r.best for r in rows if r.best is not None]
    on_front = {id(c) for c in pareto_front(bests)}
    return [i for i, r in enumerate(rows) if r.best is not None and id(r.best) in on_front]


def format_whatif(result: WhatIfResult) -> str:
    varied = {k for r in result.rows for k, _ in r.settings}
    model = "models as varied" if "model" in varied else f"model {result.model}"
    out = [f"what-if: {model} on variants of cluster {result.cluster}", ""]
    width = max(len(r.label) for r in result.rows)
    out.append(f"{'variant':<{width}}  devices  iter (ms)  samples/s  vs uniform  "
               f"$/Mtok   plan (layer ranges half-open)")
    for i, r in enumerate(result.rows):
        if r.best is None:
            out.append(f"{r.label:<{width}}  {r.devices:>7}  infeasible: {r.error}")
            continue
        m = r.best.metrics
        speed = f"{r.uniform.metrics.iteration_time_s / m.iteration_time_s:9.2f}x" \
            if r.uniform is not None and r.uniform.metrics.feasible else "        --"
        cost = f"{m.cost_per_million_tokens:7.3f}" \
            if m.cost_per_million_tokens is not None else "      --"
        star = " *" if i in result.pareto and len(result.pareto) > 1 else ""
        out.append(f"{r.label:<{width}}  {r.devices:>7}  {m.iteration_time_s * 1e3:9.3f}"
                   f"  {m.throughput_samples_per_s:9.2f}  {speed}  {cost}  "
                   f"{r.description}{star}")
    if len(result.pareto) > 1:
        out += ["", "* on the Pareto front of tokens/s and cost per million tokens"]
    ok = [r for r in result.rows if r.best is not None]
    if ok:
        # by the work done per second: variants may train other batches or sequences
        # in an iteration, so the least iteration time is not the most training
        fastest = max(ok, key=lambda r: r.best.metrics.tokens_per_s)
        m = fastest.best.metrics
        tokens = f"{m.tokens_per_s:,.0f}" if m.tokens_per_s >= 1000 else \
            f"{m.tokens_per_s:.4g}"               # no exponent, as `simulate` shows it
        out += ["", f"fastest: {fastest.label} ({tokens} tokens/s, "
                f"{m.throughput_samples_per_s:.2f} samples/s)"]
        priced = [r for r in ok if r.best.metrics.cost_per_million_tokens is not None]
        if priced:
            cheapest = min(priced, key=lambda r: r.best.metrics.cost_per_million_tokens)
            out.append(f"cheapest: {cheapest.label} "
                       f"(${cheapest.best.metrics.cost_per_million_tokens:.3f} per million "
                       "tokens)")
    return "\n".join(out) + "\n"


def plot_whatif(result: WhatIfResult, path: str) -> None:
    """Throughput of the best plan and of the uniform baseline per variant (bars), and
    the cost per million tokens (line, right axis) when the cluster has prices."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hyperpipe.core.files import plain_text_figures
    plain_text_figures()        # names and --vary values drawn as written

    keys = list(dict.fromkeys(k for r in result.rows for k, _ in r.settings))
    if len(keys) == 1:                 # one parameter: its values on the axis, it below
        labels = [r.settings[0][1] for r in result.rows]
    else:                              # the last two parts of each key keep labels short
        labels = ["\n".join(f"{'.'.join(k.split('.')[-2:])}={v}" for k, v in r.settings)
                  for r in result.rows]
    best = [r.best.metrics.throughput_samples_per_s if r.best else 0.0 for r in result.rows]
    uni = [r.uniform.metrics.throughput_samples_per_s
           if r.uniform is not None and r.uniform.metrics.feasible else 0.0
           for r in result.rows]
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(labels) + 2), 4.5))
    ax.bar([i - 0.2 for i in x], best, width=0.4, label="best plan (search)",
           color="#2b7bba")
    ax.bar([i + 0.2 for i in x], uni, width=0.4, label="uniform baseline", color="#bbbbbb")
    for i, r in enumerate(result.rows):
        if r.best is None:
            ax.text(i, 0, "does not fit", ha="center", va="bottom", rotation=90, fontsize=8)
    ax.set_xticks(list(x))
    wide = max(len(line) for label in labels for line in label.split("\n")) > 14
    ax.set_xticklabels(labels, fontsize=8, rotation=25 if wide else 0,
                       ha="right" if wide else "center")
    if len(keys) == 1:
        ax.set_xlabel(keys[0] if keys[0] != "use" else "device types used")
    ax.set_ylim(0, 1.3 * max(best + uni + [1e-12]))     # room for the legend on top
    ax.set_ylabel("throughput (samples/s, simulated)")
    varied = "models as varied" if "model" in keys else result.model
    ax.set_title(f"what-if: {varied} on {result.cluster}")
    costs = [r.best.metrics.cost_per_million_tokens if r.best else None for r in result.rows]
    handles, names = ax.get_legend_handles_labels()
    if any(c is not None for c in costs):
        ax2 = ax.twinx()
        pts = [(i, c) for i, c in enumerate(costs) if c is not None]
        (line,) = ax2.plot([i for i, _ in pts], [c for _, c in pts], "o-", color="#d95f02",
                           label="USD per million tokens (best)")
        ax2.set_ylabel("USD per million tokens")
        ax2.set_ylim(0, 1.3 * max(c for _, c in pts))     # below the legend too
        handles.append(line)
        names.append(line.get_label())
    ax.legend(handles, names, loc="upper center", ncol=len(names), fontsize=8)
    fig.tight_layout()
    from hyperpipe.core.files import save_figure
    try:
        save_figure(fig, path, dpi=120)     # the one safe writer: never half-written
    finally:
        plt.close(fig)
