"""What the executor runs: the checks `hyperpipe run` makes of a checked plan before
any rank starts, written without torch so that `search` and `demo` can ask them of the
plans they rank at no import cost (`why_not_runnable`)."""

from __future__ import annotations

from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import path_exists, resolve_ref
from hyperpipe.exec.placement import check_runnable, expert_groups, placements
from hyperpipe.models.spec import ModelSpec, is_moe_layer
from hyperpipe.plan.plan import Plan, schedule_for


def check_plan_runnable(plan: Plan, spec: ModelSpec) -> None:
    """BadInput for a checked plan the executor cannot run: `placement.check_runnable`,
    `check_expert_parallel`, and a synthetic model's layers without a width."""
    check_runnable(plan, spec)
    check_expert_parallel(plan, spec)
    if spec.config is None:
        # the plan where it holds the model, else the model's file (beside the plan, as
        # plans name files) or name
        where = f"{plan.source}: model"
        if not isinstance(plan.model, dict):
            ref = resolve_ref(plan.model, plan.base_dir)
            where = str(ref if path_exists(ref, regular=True) else plan.model)
        for i, layer in enumerate(spec.layers):
            if layer.hidden is None:
                raise BadInput(f"{where}: layers[{i}].hidden", "a width (needed to run a "
                               f"synthetic model for real; model {spec.name})",
                               has_got=False)


def why_not_runnable(plan: Plan, spec: ModelSpec) -> str | None:
    """`check_plan_runnable`'s refusal as one line, or None where the executor runs
    `plan`."""
    try:
        check_plan_runnable(plan, spec)
    except BadInput as err:
        return str(err)
    return None


def check_expert_parallel(plan: Plan, spec: ModelSpec) -> None:
    """Raise BadInput for an MoE plan the executor cannot run: a tensor-parallel stage
    holding MoE blocks (experts are not sharded), a context-parallel stage with ep > 1,
    ZeRO 2/3 with expert parallelism, or an expert-parallel group whose ranks do not
    replay the same actions of their expert-parallel stages (their all-to-alls must pair
    up)."""
    groups = expert_groups(plan)
    if groups and plan.zero >= 2:
        raise BadInput(f"{plan.source}: zero", "0 or 1 with expert parallelism (the executor "
                       "reduces experts over their own groups, not sharded ones)", plan.zero)
    for i, pipe in enumerate(plan.pipelines):
        for k, st in enumerate(pipe.stages):
            if st.tp > 1 and any(is_moe_layer(spec, layer) for layer in range(*st.layers)):
                raise BadInput(f"{plan.source}: pipelines[{i}].stages[{k}].tp", "1 on a stage "
                               "holding MoE blocks (the executor does not shard experts)",
                               st.tp)
            if st.ep > 1 and st.cp > 1:
                raise BadInput(f"{plan.source}: pipelines[{i}].stages[{k}].ep", "1 on a "
                               "context-parallel stage (the executor does not run both "
                               "together)", st.ep)
    if not groups:
        return
    where = {r.rank: r for r in placements(plan)}
    for g in groups:
        seen = None
        for rank in g.ranks:
            r = where[rank]
            pipe = plan.pipelines[r.pipeline]
            row = schedule_for(plan, r.pipeline).actions[r.pipe_rank]
            mine = [(pipe.stages[a.stage].layers, a.op, a.microbatch) for a in row
                    if pipe.stages[a.stage].ep > 1]
            if seen is None:
                seen = (rank, mine)
            elif mine != seen[1]:
                raise BadInput(f"{plan.source}: pipelines[{r.pipeline}]", "the same actions "
                               f"on its expert-parallel stages as rank {seen[0]} "
                               f"({plan.devices[seen[0]]}), which shares its experts (same "
                               "micro-batch count and schedule position)", "other actions",
                               has_got=False)
