"""Baseline plans that need no search: what Megatron-LM and DeepSpeed do by default.

* `uniform_plan`: equal layers per stage (the remainder to the first stages), devices
  taken in cluster order with Megatron's rank order (tensor parallel fastest, then data
  parallel, then pipeline: rank = (stage * dp + replica) * tp + tp_rank; Shoeybi et al.
  2019 / Narayanan et al. 2021, `megatron/core/parallel_state.py`).
* `proportional_plan`: the same devices, layers per stage proportional to the stage's
  peak FLOP/s (the "no search" heterogeneity-aware baseline).

Both split the batch evenly over the data-parallel replicas, as both frameworks do.
`model_ref` and `cluster_ref` give the plan's references that round-trip through JSON:
the built-in name when the object is the built-in, otherwise the inline document.
"""

from __future__ import annotations

from hyperpipe.errors import BadInput, InfeasiblePlan
from hyperpipe.sim.plan import PipelinePlan, Plan, StagePlan


def model_ref(model) -> str | dict:
    """The plan's `model` field: the preset name when `model` is that preset unchanged."""
    from hyperpipe.models import load_model
    from hyperpipe.models.presets import PRESETS
    if model.name in PRESETS and load_model(model.name) == model:
        return model.name
    return model.to_dict()


def cluster_ref(cluster) -> str | dict:
    """The plan's `cluster` field: the built-in name when `cluster` is that built-in."""
    from hyperpipe.sim.cluster import builtin_cluster_names, load_cluster
    if cluster.name in builtin_cluster_names() and load_cluster(cluster.name) == cluster:
        return cluster.name
    return {"name": cluster.name, **cluster.source}


def layer_counts(num_layers: int, weights: list[float]) -> list[int]:
    """Split `num_layers` into len(weights) positive counts proportional to `weights`
    (largest remainder; ties to the earlier stage). Equal weights give the uniform split
    with the remainder on the first stages."""
    n = len(weights)
    if num_layers < n:
        raise InfeasiblePlan(f"{num_layers} layers cannot fill {n} stages (one layer each "
                             "at least)")
    spare = num_layers - n                      # one layer per stage first
    total = float(sum(weights))
    shares = [spare * w / total for w in weights]
    counts = [1 + int(s) for s in shares]
    left = num_layers - sum(counts)
    order = sorted(range(n), key=lambda i: (-(shares[i] - int(shares[i])), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


def _check_dims(pp: int, dp: int, tp: int, micro_batch: int, global_batch: int,
                chunks: int) -> int:
    for name, value in (("pp", pp), ("dp", dp), ("tp", tp), ("micro_batch", micro_batch),
                        ("global_batch", global_batch), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadInput(f"--{name.replace('_', '-')}", "a positive integer", value)
    if global_batch % (dp * micro_batch):
        raise BadInput("--global-batch", f"a multiple of dp x micro_batch = {dp} x "
                       f"{micro_batch} = {dp * micro_batch}", global_batch)
    return global_batch // (dp * micro_batch)


def _device_grid(cluster, pp: int, dp: int, tp: int, devices: list[str] | None
                 ) -> list[list[tuple[str, ...]]]:
    """grid[replica][stage] = the tp devices of that stage, in Megatron rank order."""
    names = list(devices) if devices is not None else [d.name for d in cluster.devices]
    need = pp * dp * tp
    if len(names) < need:
        raise InfeasiblePlan(f"pp x dp x tp = {pp} x {dp} x {tp} = {need} devices needed, "
                             f"{len(names)} available")
    grid = []
    for r in range(dp):
        row = []
        for s in range(pp):
            first = (s * dp + r) * tp
            group = tuple(names[first:first + tp])
            if len({cluster.device(d).type.name for d in group}) > 1:
                raise InfeasiblePlan(f"tensor-parallel group {list(group)} mixes device "
                                     "types in cluster order")
            row.append(group)
        grid.append(row)
    return grid


def _build(model, cluster, grid, weights_of, *, global_batch: int, micro_batch: int,
           num_microbatches: int, schedule: str, chunks: int, refs) -> Plan:
    pipelines = []
    for row in grid:
        pp = len(row)
        homes = [row[k % pp] for k in range(pp * chunks)]
        counts = layer_counts(model.num_layers, [weights_of(g) for g in homes])
        stages, start = [], 0
        for group, n in zip(homes, counts, strict=True):
            stages.append(StagePlan((start, start + n), group, len(group)))
            start += n
        pipelines.append(PipelinePlan(micro_batch, num_microbatches, tuple(stages)))
    model_doc, cluster_doc = refs if refs is not None else (model_ref(model),
                                                            cluster_ref(cluster))
    plan = Plan(model=model_doc, cluster=cluster_doc,
                global_batch=global_batch, schedule=schedule, chunks=chunks,
                pipelines=tuple(pipelines))
    plan.check(model, cluster)
    return plan


def uniform_plan(model, cluster, *, pp: int, dp: int = 1, tp: int = 1, micro_batch: int,
                 global_batch: int, schedule: str = "1f1b", chunks: int = 1,
                 devices: list[str] | None = None, refs: tuple | None = None) -> Plan:
    """Megatron/DeepSpeed default: equal layers per stage, devices in cluster order.
    `refs` = (model_ref, cluster_ref) when the caller has them already."""
    m = _check_dims(pp, dp, tp, micro_batch, global_batch, chunks)
    grid = _device_grid(cluster, pp, dp, tp, devices)
    return _build(model, cluster, grid, lambda g: 1.0, global_batch=global_batch,
                  micro_batch=micro_batch, num_microbatches=m, schedule=schedule,
                  chunks=chunks, refs=refs)


def proportional_plan(model, cluster, *, pp: int, dp: int = 1, tp: int = 1, micro_batch: int,
                      global_batch: int, schedule: str = "1f1b", chunks: int = 1,
                      devices: list[str] | None = None, refs: tuple | None = None) -> Plan:
    """Layers per stage proportional to the stage's peak FLOP/s (tp x device peak)."""
    m = _check_dims(pp, dp, tp, micro_batch, global_batch, chunks)
    grid = _device_grid(cluster, pp, dp, tp, devices)

    def peak_flops(group: tuple[str, ...]) -> float:
        return sum(cluster.device(d).type.peak_flops for d in group)

    return _build(model, cluster, grid, peak_flops, global_batch=global_batch,
                  micro_batch=micro_batch, num_microbatches=m, schedule=schedule,
                  chunks=chunks, refs=refs)
