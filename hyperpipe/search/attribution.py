"""Where the best plan's gain over the best other plan comes from, and what its expert
parallelism buys (MoE models).

From the search's pick B and the fastest other plan O (a baseline or a peer's), each
factor of B is switched back to O's choice alone and simulated; the factor's share is
how much slower B gets without it: device choice (O's devices and pipelines, layers cut
by compute speed), layer partition (B's devices with O's cut, or O's rule), schedule
kind (and chunks), micro-batch size, recompute mode.

When B's schedule is synthesised (kind synth), every variant but the schedule kind's
gets a schedule synthesised for it, unless B and O agree on that factor: then the
variant is B itself and is not simulated. Factors interact, so their ratios need not
multiply to the total speed-up.

For a model with MoE blocks, `attribute_experts` simulates the pick with its expert
parallelism undone (ep 1 everywhere), with its experts placed evenly (when it places
them by speed), and re-laid under 1F1B and under DualPipe-V (the schedule that hides
the all-to-all): the report prints each against the pick.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hyperpipe.core.errors import BadInput, InfeasiblePlan
from hyperpipe.plan.kinds import DEFAULT_KIND, KINDS, schedule_kind
from hyperpipe.plan.plan import PipelinePlan, Plan, StagePlan, pipeline_placement
from hyperpipe.plan.schedule import stage_rank
from hyperpipe.search.baselines import layer_counts
from hyperpipe.sim.metrics import Metrics

FACTORS = ("device choice", "layer partition", "schedule kind", "micro-batching",
           "recompute")


@dataclass(frozen=True)
class FactorGain:
    factor: str
    same: bool                   # B and O already agree on it
    time_s: float | None         # B with this factor switched to O's choice (None: n/a)
    ratio: float | None          # time_s / B's time: > 1 means the factor helps B
    note: str = ""


def _recut(pipe: PipelinePlan, p: int, v: int, weights, place: str
           ) -> tuple[StagePlan, ...]:
    """The pipeline's first p device groups (its ranks 0 .. p-1 under every placement),
    v stages each, placed by `place` ("loop" or "v"), layers by `weights`."""
    homes = [pipe.stages[stage_rank(k, p, place)] for k in range(p * v)]
    n = pipe.stages[-1].layers[1]
    counts = layer_counts(n, [weights(st) for st in homes])
    out, start = [], 0
    for st, c in zip(homes, counts, strict=True):
        out.append(replace(st, layers=(start, start + c)))
        start += c
    return tuple(out)


def _place(plan: Plan) -> str:
    """Where `plan` puts its chunks ("loop" or "v"; read off the stages for synth)."""
    return pipeline_placement(plan, plan.pipelines[0])


def _devices_of(plan: Plan, pipe: PipelinePlan) -> int:
    return len(pipe.stages) // plan.chunks


def _speed(cost, mb: int):
    def weight(st: StagePlan) -> float:
        dtype = cost.cluster.device(st.devices[0]).type.name
        n = cost.model.num_layers
        return 1.0 / sum(cost.stage_compute_s((0, n), dtype, mb, op, st.tp)
                         for op in ("F", "B"))
    return weight


def _peak(cost):
    return lambda st: sum(cost.cluster.device(d).type.peak_flops for d in st.devices)


def _to_resynthesise(best: Plan, other: Plan, switched: dict[str, Plan | str]) -> list[str]:
    """The factors whose variant needs a schedule of its own: all but the schedule
    kind's, where B is synthesised and O chose otherwise; and the schedule kind's where
    O's is synthesised (O's choice, for B's stages and chunks, is a synthesis: O's
    action lists are for O's stages)."""
    again = []
    if schedule_kind(other.schedule).carries_actions and \
            isinstance(switched["schedule kind"], Plan) and \
            not _same(best, other, "schedule kind"):
        again.append("schedule kind")
    if schedule_kind(best.schedule).carries_actions:
        again += [f for f in ("device choice", "layer partition", "micro-batching",
                              "recompute")
                  if isinstance(switched[f], Plan) and not _same(best, other, f)]
    return again


def variants(best: Plan, other: Plan, other_name: str, cost) -> dict[str, Plan | str]:
    """Per factor, B with that factor switched to O's choice, or a string saying why not.
    A synthesised pick's action lists stay on its variants: `attribute` gives each the
    schedule of its own it needs (`_to_resynthesise`, `_synthesis_of`)."""
    out: dict[str, Plan | str] = {}
    # device choice: O's pipelines, B's other choices, layers by speed
    try:
        pipes = tuple(PipelinePlan(pipe.micro_batch, pipe.num_microbatches,
                                   _recut(pipe, _devices_of(other, pipe), best.chunks,
                                          _speed(cost, pipe.micro_batch), _place(best)))
                      for pipe in other.pipelines)
        out["device choice"] = _with_mb(replace(best, pipelines=pipes),
                                        best.pipelines[0].micro_batch, _recompute_of(best))
    except InfeasiblePlan as exc:      # O's stage count x B's chunks exceeds the layers
        out["device choice"] = str(exc)
    # layer partition
    same_shape = _types(best, cost) == _types(other, cost)
    mb = best.pipelines[0].micro_batch
    rule = {"uniform": lambda st: 1.0, "proportional": _peak(cost)}.get(other_name,
                                                                        _speed(cost, mb))
    pipes = []
    for pipe in best.pipelines:
        if same_shape:
            st = tuple(replace(s, layers=o.layers) for s, o in
                       zip(pipe.stages, other.pipelines[0].stages, strict=True))
        else:
            st = _recut(pipe, _devices_of(best, pipe), best.chunks, rule, _place(best))
        pipes.append(PipelinePlan(pipe.micro_batch, pipe.num_microbatches, st))
    out["layer partition"] = best.with_pipelines(pipes)
    # schedule kind (and chunks)
    if other.chunks == best.chunks:
        out["schedule kind"] = replace(best, schedule=other.schedule)
    else:
        pipes = []
        try:
            for pipe in best.pipelines:
                share = {}
                for s in pipe.stages:
                    share[s.devices] = share.get(s.devices, 0) + s.num_layers
                st = _recut(pipe, _devices_of(best, pipe), other.chunks,
                            lambda s, share=share: share[s.devices], _place(other))
                pipes.append(PipelinePlan(pipe.micro_batch, pipe.num_microbatches, st))
            out["schedule kind"] = replace(best, schedule=other.schedule,
                                           chunks=other.chunks, pipelines=tuple(pipes))
        except InfeasiblePlan as exc:  # B's devices x O's chunks exceed the layers
            out["schedule kind"] = str(exc)
    out["micro-batching"] = _with_mb(best, other.pipelines[0].micro_batch, None)
    out["recompute"] = _with_mb(best, best.pipelines[0].micro_batch, _recompute_of(other))
    if isinstance(out["schedule kind"], Plan):          # O's kind: no action lists
        out["schedule kind"] = replace(out["schedule kind"], actions=None)
    return out


def _synthesis_of(plan: Plan, cost, pool=None):
    """A synthesis of variant `plan` (its stages, devices and micro-batches kept; the
    best of the synthesised orders and the fixed kinds of its placement), started over
    the worker `pool` (None: run when asked) as the search runs its own
    (`synthesis.start_synthesis`): the function that waits for its `SynthResult`s and
    raises what it raised."""
    from hyperpipe.search.context import SearchContext
    from hyperpipe.search.space import SearchConstraints
    from hyperpipe.search.synthesis import start_synthesis
    from hyperpipe.synth.synthesise import fixed_kinds
    bare = replace(plan, actions=None)
    try:
        bare = replace(bare, schedule=fixed_kinds(bare)[0])
    except (InfeasiblePlan, BadInput) as exc:
        def failed(exc=exc):
            raise exc
        return failed
    ctx = SearchContext(cost, SearchConstraints(global_batch=plan.global_batch))
    return start_synthesis(ctx, [(bare, None)], pool)


def _types(plan: Plan, cost) -> list[tuple[str, int]]:
    """The (device type, tp) of each stage of the first pipeline."""
    return [(cost.cluster.device(s.devices[0]).type.name, s.tp)
            for s in plan.pipelines[0].stages]


def _recompute_of(plan: Plan) -> str:
    return plan.pipelines[0].stages[0].recompute


def _with_mb(plan: Plan, mb: int, recompute: str | None) -> Plan | str:
    pipes = []
    for pipe in plan.pipelines:
        if pipe.samples % mb:
            return f"{pipe.samples} samples per pipeline do not split into micro-batches of {mb}"
        st = pipe.stages if recompute is None else \
            tuple(replace(s, recompute=recompute) for s in pipe.stages)
        pipes.append(PipelinePlan(mb, pipe.samples // mb, st))
    return plan.with_pipelines(pipes)


def _same(best: Plan, other: Plan, factor: str) -> bool:
    if factor == "device choice":
        def rows(plan: Plan) -> list:
            return sorted(tuple(s.devices for s in p.stages[:_devices_of(plan, p)])
                          for p in plan.pipelines)
        return rows(best) == rows(other)
    if factor == "layer partition":
        return [s.layers for s in best.pipelines[0].stages] == \
            [s.layers for s in other.pipelines[0].stages]
    if factor == "schedule kind":
        return (best.schedule, best.chunks) == (other.schedule, other.chunks)
    if factor == "micro-batching":
        return best.pipelines[0].micro_batch == other.pipelines[0].micro_batch
    return {s.recompute for p in best.pipelines for s in p.stages} == \
        {s.recompute for p in other.pipelines for s in p.stages}


def attribute(best, other, other_name: str, cost, pool=None) -> list[FactorGain]:
    """One FactorGain per FACTORS entry; `best`/`other` are Candidates (plan, metrics).
    The variants that need a schedule of their own are synthesised as the search
    synthesises (`_synthesis_of`, its simulated winner priced), the others simulated,
    all at once over the worker `pool` (a backend or a process pool; None: here), with
    the same results."""
    from hyperpipe.search.backends import fan_out
    base_s = best.metrics.iteration_time_s
    switched = variants(best.plan, other.plan, other_name, cost)
    again = _to_resynthesise(best.plan, other.plan, switched)
    # the syntheses first: the longest work
    started = {f: _synthesis_of(switched[f], cost, pool) for f in again}
    plain = [f for f, plan in switched.items() if isinstance(plan, Plan)
             and f not in again and not _same(best.plan, other.plan, f)]
    judged: dict[str, Metrics | str] = dict(zip(plain, fan_out(
        pool, plain, lambda f: _judge(switched[f], cost), _judge_task,
        lambda f: (switched[f], cost.model, cost.cluster, cost.profile), at_least=2)(),
        strict=True))
    for factor, wait in started.items():
        try:
            judged[factor] = wait()[0].metrics
        except (InfeasiblePlan, BadInput) as exc:
            judged[factor] = f"no schedule for it: {exc}"
    out = []
    for factor, plan in switched.items():
        if _same(best.plan, other.plan, factor):
            out.append(FactorGain(factor, True, base_s, 1.0, "same in both"))
        elif factor not in judged:
            out.append(FactorGain(factor, False, None, None, str(plan)))
        elif isinstance(judged[factor], str):
            out.append(FactorGain(factor, False, None, None, judged[factor]))
        else:
            m = judged[factor]
            note = "out of memory" if m.oom else (m.refused or "")
            out.append(FactorGain(factor, False, m.iteration_time_s,
                                  m.iteration_time_s / base_s, note))
    return out


def _judge(plan: Plan, cost) -> Metrics | str:
    """A variant's simulated metrics, or why it has none."""
    from hyperpipe.search.evaluate import simulate_one
    try:
        plan.check(cost.model, cost.cluster)
        return simulate_one(plan, cost)
    except (InfeasiblePlan, BadInput, ValueError) as exc:
        return f"not a valid plan: {exc}"


def _judge_task(args) -> Metrics | str:
    """`_judge` in a worker process."""
    from hyperpipe.sim.costmodel import CostModel
    plan, model, cluster, profile = args
    return _judge(plan, CostModel(model, cluster, profile))


@dataclass(frozen=True)
class ExpertGain:
    """One line of the pick's expert-parallel account: a variant of the pick, its
    simulated time (None: no valid plan) and that time over the pick's (> 1: the pick's
    choice helps)."""

    what: str
    time_s: float | None
    ratio: float | None
    note: str = ""


def uses_experts(plan: Plan, cost) -> bool:
    """Whether `plan`'s model has MoE blocks (the account below applies)."""
    cfg = cost.model.config
    return cfg is not None and cfg.moe is not None


def alltoall_kinds() -> tuple[str, str]:
    """(the default kind, the kind that hides the expert all-to-all: `overlaps_alltoall`):
    the two the pick is re-laid under."""
    hides = next(k.name for k in KINDS.values() if k.overlaps_alltoall)
    return DEFAULT_KIND, hides


def expert_variants(best: Plan, cost) -> dict[str, Plan | str]:
    """The pick with its expert parallelism undone (every stage's ep 1, all else kept),
    with the experts placed evenly when the pick places them by speed
    (`runtime.expert_placement`), and re-laid under each of `alltoall_kinds` (1F1B, and
    DualPipe-V, which overlaps one micro-batch's all-to-all with another's compute,
    `sim.experts`), its devices and their shares of the layers kept (`_recut`; the pick
    itself where it runs that kind)."""
    out: dict[str, Plan | str] = {}
    eps = {s.ep for p in best.pipelines for s in p.stages}
    if eps != {1}:
        out["ep 1 (no expert parallelism)"] = best.with_pipelines([
            replace(p, stages=tuple(replace(s, ep=1) for s in p.stages))
            for p in best.pipelines])
    if best.runtime_settings().expert_placement != "even":
        out["experts placed evenly"] = replace(
            best, runtime=replace(best.runtime, expert_placement="even"))
    for kind in alltoall_kinds():
        v, place = schedule_kind(kind).default_chunks, schedule_kind(kind).placement
        if (best.schedule, best.chunks) == (kind, v):
            out[kind] = best                   # the pick runs it already
            continue
        pipes = []
        try:
            for pipe in best.pipelines:
                share: dict[tuple[str, ...], int] = {}
                for s in pipe.stages:
                    share[s.devices] = share.get(s.devices, 0) + s.num_layers
                st = _recut(pipe, _devices_of(best, pipe), v,
                            lambda s, share=share: share[s.devices], place)
                pipes.append(PipelinePlan(pipe.micro_batch, pipe.num_microbatches, st))
            out[kind] = replace(best, schedule=kind, chunks=v, pipelines=tuple(pipes),
                                actions=None)
        except InfeasiblePlan as exc:
            out[kind] = str(exc)
    return out


def attribute_experts(best, cost) -> list[ExpertGain]:
    """`expert_variants` of the pick (a Candidate), each simulated."""
    from hyperpipe.search.evaluate import simulate_one
    base_s = best.metrics.iteration_time_s
    out = []
    for what, plan in expert_variants(best.plan, cost).items():
        if isinstance(plan, str):
            out.append(ExpertGain(what, None, None, plan))
            continue
        if plan is best.plan:
            out.append(ExpertGain(what, base_s, 1.0, "the pick"))
            continue
        try:
            plan.check(cost.model, cost.cluster)
            m = simulate_one(plan, cost)
        except (InfeasiblePlan, BadInput, ValueError) as exc:
            out.append(ExpertGain(what, None, None, f"not a valid plan: {exc}"))
            continue
        out.append(ExpertGain(what, m.iteration_time_s, m.iteration_time_s / base_s,
                              "out of memory" if m.oom else (m.refused or "")))
    return out
