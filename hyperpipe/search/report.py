"""The text report of a search: ranked plans, why the best wins, speed-ups, phases."""

from __future__ import annotations

from hyperpipe.core.units import format_seconds
from hyperpipe.plan.plan import Plan
from hyperpipe.search.evaluate import rank_key
from hyperpipe.sim.costmodel import CostModel

RUN = 3                   # longer runs of one stage kind print as one item
LIST_GROUPS = 6           # memory headroom lines (devices grouped by type and headroom)


def describe_plan(plan: Plan, cluster) -> str:
    """One part per class of identical replicas: 'N replica(s) x S stages [TYPE [0, 5) |
    ...] mb b x m', the schedule first with the ZeRO stage when not 0. Layer ranges are
    half-open. Runs of more than RUN stages of one type and tp, cp and ep degrees print
    as one item 'TYPE tpN cpC x K stages [0, 40)'."""
    classes: dict[tuple, int] = {}
    for pipe in plan.pipelines:
        runs: list[list] = []
        for s in pipe.stages:
            name = cluster.device(s.devices[0]).type.name + ("" if s.tp == 1 else f" tp{s.tp}") \
                + ("" if s.cp == 1 else f" cp{s.cp}") + ("" if s.ep == 1 else f" ep{s.ep}")
            if runs and runs[-1][0] == name:
                runs[-1][1].append(s.layers)
            else:
                runs.append([name, [s.layers]])
        items = []
        for name, ranges in runs:
            if len(ranges) > RUN:
                items.append(f"{name} x {len(ranges)} stages [{ranges[0][0]}, {ranges[-1][1]})")
            else:
                items += [f"{name} [{a}, {b})" for a, b in ranges]
        key = (" | ".join(items), len(pipe.stages), pipe.micro_batch, pipe.num_microbatches)
        classes[key] = classes.get(key, 0) + 1
    sched = plan.schedule + (f" v={plan.chunks}" if plan.chunks > 1 else "") + \
        (f" zero {plan.zero}" if plan.zero else "")
    parts = [f"{replicas_x_stages(n, k)} [{st}] mb {mb} x {m}"
             for (st, k, mb, m), n in classes.items()]
    return f"{sched}: " + "; ".join(parts)


def replicas_x_stages(replicas: int, stages: int) -> str:
    """The one way HyperPipe writes a plan's shape: '2 replicas x 4 stages'."""
    return (f"{replicas} replica{'s' if replicas != 1 else ''} x "
            f"{stages} stage{'s' if stages != 1 else ''}")


def table_unit(times_s: list[float]) -> tuple[str, float]:
    """One time unit for a whole table (that of its smallest entry): (name, seconds)."""
    smallest = min((t for t in times_s if t > 0), default=1.0)
    for name, factor in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if smallest >= factor:
            return name, factor
    return "ns", 1e-9


def _metrics_row(m, unit: tuple[str, float]) -> str:
    cost = f"  ${m.cost_per_million_tokens:.4g}/Mtok" \
        if m.cost_per_million_tokens is not None else ""
    return (f"{m.iteration_time_s / unit[1]:>15.4g}  {m.throughput_samples_per_s:9.2f}  "
            f"{m.bubble_fraction:6.1%}  {m.mfu:5.1%}{cost}")


def _cheaper(other, best) -> str:
    """How much cheaper per token the pick's `best` metrics are than `other`'s, or
    dearer where they are not (a free pick, on devices priced at 0, has no ratio)."""
    mine, theirs = best.cost_per_million_tokens, other.cost_per_million_tokens
    if mine > theirs:
        return f"best is {mine / theirs:.2f}x dearer per token" if theirs > 0 else \
            "best costs more per token than a free plan"
    if mine > 0:
        return f"best is {theirs / mine:.2f}x cheaper per token"
    return "best costs nothing per token" if other.cost_per_million_tokens > 0 else \
        "both cost nothing per token"


def _header(unit: tuple[str, float]) -> str:
    return (f"{'iteration (' + unit[0] + ')':>15}  {'samples/s':>9}  {'bubble':>6}  "
            f"{'MFU':>5}")


def competitor_freedoms() -> dict[str, str]:
    """Per baseline and peer planner, what it may choose (one line each)."""
    from hyperpipe.search.baselines import FREEDOMS as BASE
    from hyperpipe.search.peers import FREEDOMS as PEER
    return {**BASE, **PEER}


def using_all(result, cluster):
    """The best feasible simulated plan other than the pick, the search's own or a
    baseline's, that keeps what the search was asked for (`result.constraints`) and uses
    every device of `cluster`, by the search's objective; None when none does."""
    c = result.constraints
    every = {d.name for d in cluster.devices}
    pool = [cand for cand in (*result.simulated, *result.baselines.values())
            if cand.metrics.feasible and cand is not result.best and c.admits(cand.plan)
            and every <= set(cand.plan.devices)]
    return min(pool, default=None, key=lambda cand: rank_key(c, cand.metrics))


def idle_lines(result, cluster, unit: tuple[str, float]) -> list[str]:
    """Which devices the pick leaves idle (by node and type), and the best simulated plan
    that uses every device (`using_all`), against the pick."""
    used = set(result.best.plan.devices)
    idle = [d for d in cluster.devices if d.name not in used]
    if not idle:
        return ["", f"devices: the pick uses all {len(cluster.devices)}"]
    groups: dict[str, list[str]] = {}
    for d in idle:
        groups.setdefault(d.type.name + (f" (x{d.slowdown:g} slow)" if d.slowdown != 1
                                         else ""), []).append(d.node)
    parts = []
    for name, nodes in groups.items():
        where = list(dict.fromkeys(nodes))
        parts.append(f"{len(nodes)} x {name} on {_names(where)}")
    out = ["", f"devices: the pick uses {len(used)} of {len(cluster.devices)}; idle: "
           + "; ".join(parts)]
    alt = using_all(result, cluster)
    if alt is None:
        out.append("  using them as well: no simulated plan uses every device")
    else:
        ratio = alt.metrics.iteration_time_s / result.best.metrics.iteration_time_s
        line = (f"  using them as well: the best simulated plan on every device takes "
                f"{alt.metrics.iteration_time_s / unit[1]:.4g} {unit[0]} per iteration, "
                f"{ratio:.3f}x the pick's time")
        if result.constraints.objective == "cost" and \
                alt.metrics.cost_per_million_tokens is not None:
            line += f"; {_cheaper(alt.metrics, result.best.metrics)}"
        out.append(line)
        out.append(f"     {describe_plan(alt.plan, cluster)}")
    return out


def why_best(plan: Plan, metrics, cost: CostModel) -> list[str]:
    """The bottleneck stage, the bubble and the memory headroom of a plan."""
    cluster = cost.cluster
    lines = []
    worst = None
    for q, pipe in enumerate(plan.pipelines):
        for k, st in enumerate(pipe.stages):
            t = sum(cost.stage_time_s(st.layers, st.devices, pipe.micro_batch, op,
                                      st.recompute) for op in ("F", "B"))
            if worst is None or t > worst[0]:
                worst = (t, q, k, st)
    t, q, k, st = worst
    lines.append(f"bottleneck: replica {q} stage {k} on {_names(list(st.devices))} "
                 f"({cluster.device(st.devices[0]).type.name}, layers [{st.layers[0]}, "
                 f"{st.layers[1]})): {format_seconds(t)} of forward+backward per "
                 f"micro-batch of {plan.pipelines[q].micro_batch}")
    lines.append(f"bubble fraction: {metrics.bubble_fraction:.1%} of device time idle")
    groups: dict[tuple[str, float, float], list[str]] = {}
    for d, b in metrics.peak_memory_bytes.items():
        cap = _cap(cluster, d)
        key = (cluster.device(d).type.name, round((cap - b) / 1e8) / 10, cap)
        groups.setdefault(key, []).append(d)
    items = sorted(groups.items(), key=lambda kv: kv[0][1])
    shown = [f"{len(devs)} x {t} {free:.1f} GB free of {cap / 1e9:.0f} "
             f"({_names(devs)})" for (t, free, cap), devs in items[:LIST_GROUPS]]
    if len(items) > LIST_GROUPS:
        shown.append(f"... {len(items) - LIST_GROUPS} more groups")
    lines.append("memory headroom, least first: " + "; ".join(shown))
    return lines


def _names(devs: list[str]) -> str:
    return ", ".join(devs) if len(devs) <= 3 else f"{devs[0]} ... {devs[-1]}"


def _cap(cluster, device: str) -> float:
    return cluster.device(device).type.memory_bytes


def best_other(result):
    """(name, candidate) of the best feasible baseline or peer plan by the search's
    objective (the fastest, or the cheapest per token; ties to the faster, then the
    name), or None."""
    c = result.constraints
    feasible = [((rank_key(c, cand.metrics) if c is not None else
                  (False, cand.metrics.iteration_time_s)), k, cand)
                for k, cand in result.baselines.items() if cand.metrics.feasible]
    if not feasible:
        return None
    _, name, cand = min(feasible, key=lambda x: x[:2])
    return name, cand


def gain_lines(result, cost: CostModel, pool=None) -> list[str]:
    """The speed-up over the best other plan and where it comes from (each factor of the
    pick switched back to the other's choice, one at a time, and simulated, over the
    worker `pool` when there is one)."""
    from hyperpipe.search.attribution import attribute
    found = best_other(result)
    if found is None:
        return []
    name, other = found
    best = result.best
    total = other.metrics.iteration_time_s / best.metrics.iteration_time_s
    head = f"speed-up over the best other plan ({name}): {total:.2f}x"
    if result.constraints is not None and result.constraints.objective == "cost":
        head = (f"against the cheapest other plan ({name}): "
                f"{_cheaper(other.metrics, best.metrics)}, {total:.2f}x the speed")
    out = ["", f"{head}; where it comes from (the pick with one factor switched to the "
           "other's choice, simulated):"]
    for g in attribute(best, other, name, cost, pool):
        out.append(f"  {g.factor:<16} same in both" if g.same
                   else _gain_line(g.factor, 16, g.time_s, g.ratio, g.note))
    out.append("  (factors interact: their ratios need not multiply to the total)")
    return out


def _gain_line(label: str, width: int, time_s: float | None, ratio: float | None,
               note: str) -> str:
    """One attribution row: the variant's simulated time and its ratio to the pick's, or
    n/a with the reason when it could not be simulated."""
    if ratio is None:
        return f"  {label:<{width}} n/a ({note})"
    tail = f"  {note}" if note else ""
    return f"  {label:<{width}} {format_seconds(time_s):>10}  {ratio:.2f}x the pick's " \
        f"time{tail}"


def expert_lines(result, cost: CostModel) -> list[str]:
    """For a model with MoE blocks: the pick's expert parallelism and what it buys (the
    pick with ep 1, the best simulated plan of the search without expert parallelism,
    even expert placement where the pick places by speed), and the pick under DualPipe-V
    against 1F1B (`attribution.attribute_experts`)."""
    from hyperpipe.search.attribution import alltoall_kinds, attribute_experts, uses_experts
    best = result.best
    if not uses_experts(best.plan, cost):
        return []
    eps = sorted({s.ep for p in best.plan.pipelines for s in p.stages})
    out = ["", f"expert parallelism (MoE): the pick runs ep {'/'.join(map(str, eps))}; "
           "against it (simulated):"]
    plain = next((c for c in result.simulated
                  if all(s.ep == 1 for p in c.plan.pipelines for s in p.stages)), None)
    if eps != [1]:
        if plain is None:
            out.append("  best plan of the search without expert parallelism: none fits")
        else:
            t = plain.metrics.iteration_time_s
            out.append(f"  {'best plan with ep 1':<30} {format_seconds(t):>10}  "
                       f"{t / best.metrics.iteration_time_s:.2f}x the pick's time")
            out.append(f"     {describe_plan(plain.plan, cost.cluster)}")
    gains = {g.what: g for g in attribute_experts(best, cost)}
    for g in gains.values():
        out.append(_gain_line(g.what, 30, g.time_s, g.ratio, g.note))
    plain, hides = alltoall_kinds()
    one, dual = gains.get(plain), gains.get(hides)
    if one is not None and dual is not None and one.time_s and dual.time_s:
        verdict = "beats" if dual.time_s < one.time_s else "does not beat"
        out.append(f"  {hides} (all-to-all overlapped) {verdict} {plain} on the pick's "
                   f"devices: {format_seconds(dual.time_s)} against "
                   f"{format_seconds(one.time_s)}, margin {one.time_s / dual.time_s:.3f}x")
    return out


def seed_lines(result, cluster, unit) -> list[str]:
    """When the pick is a seed (a tuned baseline's plan, `SearchResult.seeded_from`) or
    the start plan: which, and the best plan of the search's own."""
    if result.seeded_from is None:
        return []
    objective = result.constraints.objective
    what = "the start plan (--start)" if result.seeded_from == "start" else \
        f"the tuned {result.seeded_from} baseline's plan (a seed)"
    out = ["", f"the pick is {what}: no plan of the search's own was as "
           f"{'cheap' if objective == 'cost' else 'fast'}"]
    own = result.own_best
    if own is not None:
        if objective == "cost":
            out[-1] += f" ({_cheaper(own.metrics, result.best.metrics)})"
        else:
            ratio = own.metrics.iteration_time_s / result.best.metrics.iteration_time_s
            out[-1] += f" (its best takes {ratio:.4f}x the pick's time)"
        out.append(f"  the search's own best: {_metrics_row(own.metrics, unit)}")
        out.append(f"     {describe_plan(own.plan, cluster)}")
    return out


def format_search(result, cost: CostModel, *, pool=None) -> str:
    """The search report, by the objective it was searched for; what it simulates
    (`gain_lines`) runs over the worker `pool` (a backend or a process pool) when there
    is one."""
    cluster, model = cost.cluster, cost.model
    best, objective = result.best, result.constraints.objective
    out = [f"search: model {model.name} on cluster {cluster.name} "
           f"({len(cluster.devices)} devices), global batch {best.plan.global_batch}, "
           f"objective {objective}; layer ranges half-open [start, end)"]
    unit = table_unit([c.metrics.iteration_time_s for c in
                       [*result.ranked, *result.baselines.values(), *result.pareto]])
    out += ["", "ranked plans (simulated):", f"     {_header(unit)}"]
    for i, cand in enumerate(result.ranked, 1):
        out.append(f"{i:>3}. {_metrics_row(cand.metrics, unit)}")
        out.append(f"     {describe_plan(cand.plan, cluster)}")
    out += idle_lines(result, cluster, unit)
    out += seed_lines(result, cluster, unit)
    out += ["", "baselines and peer planners (each picks its own plan; all judged by the "
            "same simulator):", f"  {'':<13}{_header(unit)}"]
    for name, cand in result.baselines.items():
        speedup = cand.metrics.iteration_time_s / best.metrics.iteration_time_s
        versus = f"pick is {speedup:.2f}x faster" if speedup >= 1 else \
            f"pick is {1 / speedup:.2f}x SLOWER"
        if objective == "cost" and cand.metrics.cost_per_million_tokens is not None:
            versus = f"{_cheaper(cand.metrics, best.metrics)} ({speedup:.2f}x the speed)"
        oom = f"  OUT OF MEMORY on {len(cand.metrics.oom)} device(s)" \
            if cand.metrics.oom else ""
        if cand.metrics.refused is not None:
            oom += f"  REFUSED by its stack: {cand.metrics.refused}"
        out.append(f"  {name:<13}{_metrics_row(cand.metrics, unit)}  -> {versus}{oom}")
        out.append(f"     {describe_plan(cand.plan, cluster)}")
    out += ["", "what each competitor may choose:"]
    from hyperpipe.search.peers import PEERS
    out += [f"  {name:<13}{text}" if name in result.baselines else
            f"  {name:<13}no plan: none of its picks fits and keeps what the search was "
            "asked for" + (" (its picks have one chunk per device and no context or "
                           "expert parallelism)" if name in PEERS else "")
            for name, text in competitor_freedoms().items()]
    out += gain_lines(result, cost, pool)
    out += expert_lines(result, cost)
    out += ["", "why the best wins:"] + [f"  {line}" for line in
                                           why_best(best.plan, best.metrics, cost)]
    if result.pareto and len(result.pareto) > 1:
        out += ["", "Pareto front (iteration time vs USD per million tokens):",
                f"  {_header(unit)}"]
        for cand in result.pareto:
            out.append(f"  {_metrics_row(cand.metrics, unit)}  "
                       f"{len(cand.plan.devices)} devices")
    out += ["", "phases:"]
    for ph in result.phases:
        out.append(f"  {ph['name']:<10} {ph['seen']:>7} seen  {ph['pruned']:>6} pruned  "
                   f"{ph['infeasible']:>6} infeasible  {ph['seconds']:7.2f} s")
    out.append(f"candidates evaluated: {result.candidates_evaluated} in "
               f"{result.search_time_s:.2f} s")
    return "\n".join(out) + "\n"
