"""Factories for the clusters, models and plans the tests build (importable by name;
tests/conftest.py hands the same functions out as fixtures).

Documents (`*_doc`) are the plain dicts a YAML/JSON file would hold; the other factories
load them. Every optional field is left out of a document unless given (None), so a
factory builds exactly the document a test wrote by hand. Quantities are SI numbers or
strings with units, as in the files.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from hyperpipe.cluster.cluster import Cluster, load_cluster
from hyperpipe.models import load_model
from hyperpipe.models.spec import ModelSpec
from hyperpipe.plan.plan import PipelinePlan, Plan, StagePlan

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def experiment(name: str) -> ModuleType:
    """The script experiments/NAME.py as a module (its functions, not its main)."""
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXPERIMENTS))


# Links so fast that transfers cost nothing measurable.
FREE_LINK = {"bandwidth": "1e15 B/s", "latency": 0}
# One DGX-like node of eight built-in A100-80GB devices named n/0 ... n/7.
A100_NODE = {"nodes": [{"name": "n", "device": "A100-80GB", "count": 8}]}


def device_type(peak_flops: float | str, *, memory: float | str = "1000 GB",
                mem_bandwidth: float | str = 1e30, efficiency: float = 1.0,
                **extra: Any) -> dict:
    """A device type entry: `peak_flops` at `efficiency`, `memory`, `mem_bandwidth`
    (plus any other field, e.g. price_per_hour)."""
    return {"peak_flops": peak_flops, "efficiency": efficiency, "memory": memory,
            "mem_bandwidth": mem_bandwidth, **extra}


def cluster_doc(device_types: dict[str, dict] | None,
                nodes: Iterable[tuple[str, str, int]], *,
                intra_link: dict | None = None, inter_node: dict | None = None,
                name: str | None = None) -> dict:
    """A cluster document: `nodes` as (node name, device type, count), each node with
    `intra_link` when given; `device_types` add to the built-in catalog."""
    doc: dict[str, Any] = {} if name is None else {"name": name}
    if device_types is not None:
        doc["device_types"] = device_types
    doc["nodes"] = [{"name": n, "device": d, "count": c,
                     **({} if intra_link is None else {"intra_link": intra_link})}
                    for n, d, c in nodes]
    if inter_node is not None:
        doc["inter_node"] = inter_node
    return doc


def make_cluster(*args: Any, **kwargs: Any) -> Cluster:
    """`cluster_doc(...)` loaded."""
    return load_cluster(cluster_doc(*args, **kwargs))


def synthetic_doc(layers: int | list[dict], *, fwd_flops_per_sample: float | None = None,
                  activation_bytes_per_sample: float | None = None,
                  stash_bytes_per_sample: float | None = None,
                  params_per_layer: int | None = None, name: str | None = None,
                  **extra: Any) -> dict:
    """A synthetic model document: `layers` a count or per-layer entries; a field left
    None is left out (the loader's default: I and W = forward, stash = activation)."""
    fields = {"name": name, "layers": layers, "fwd_flops_per_sample": fwd_flops_per_sample,
              "activation_bytes_per_sample": activation_bytes_per_sample,
              "stash_bytes_per_sample": stash_bytes_per_sample,
              "params_per_layer": params_per_layer, **extra}
    return {"kind": "synthetic", **{k: v for k, v in fields.items() if v is not None}}


def synthetic_model(*args: Any, **kwargs: Any) -> ModelSpec:
    """`synthetic_doc(...)` loaded."""
    return load_model(synthetic_doc(*args, **kwargs))


def chain_plan(model: Any, cluster: Any, bounds: Sequence[int], devices: Sequence[str],
               micro_batch: int, num_microbatches: int, *, schedule: str = "1f1b",
               chunks: int = 1) -> Plan:
    """One pipeline, stage s holding layers [bounds[s], bounds[s + 1]) on devices[s]
    alone (tp 1); the global batch is micro_batch x num_microbatches."""
    stages = tuple(StagePlan((bounds[s], bounds[s + 1]), (devices[s],), 1)
                   for s in range(len(devices)))
    return Plan(model=model, cluster=cluster, global_batch=micro_batch * num_microbatches,
                schedule=schedule, chunks=chunks,
                pipelines=(PipelinePlan(micro_batch, num_microbatches, stages),))


def bounds_of(counts: Iterable[int], start: int = 0) -> list[int]:
    """Stage boundaries from layers per stage: [3, 2] -> [0, 3, 5]."""
    out = [start]
    for n in counts:
        out.append(out[-1] + n)
    return out


def plan_doc(pipelines: list[dict], *, schedule: str | dict = "1f1b",
             model: Any = "tiny-gpt", cluster: Any = A100_NODE, **top: Any) -> dict:
    """A plan document over `pipelines` (pipeline documents); the global batch is the
    sum of micro_batch x num_microbatches."""
    return {"format": "hyperpipe.plan/1", "model": model, "cluster": cluster,
            "global_batch": sum(p["micro_batch"] * p["num_microbatches"] for p in pipelines),
            "schedule": schedule, "pipelines": pipelines, **top}


def single_process(plan: Plan, steps: int, seed: int = 0, lr: float = 1e-3):
    """The oracle of the executor's parity tests: `plan`'s model trained in one process
    with AdamW(lr) on the batches the executor draws (`exec.data.step_batch`). Returns
    the losses of every step, the gradients of the last (by parameter name) and the
    weights after the last."""
    import torch

    from hyperpipe.exec.data import step_batch
    from hyperpipe.models import build_model
    spec = plan.load_model()
    model = build_model(spec, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        x, y = step_batch(spec, plan.global_batch, step, seed)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_trains_like_single_process(plan: Plan, steps: int, *, loss_tol: float,
                                      grad_tol: float, lr: float = 1e-3, **options: Any):
    """Run `plan` (gloo, no emulation unless `options` say) for `steps` with AdamW(lr)
    and compare it with `single_process`: every step's loss within `loss_tol`, the last
    step's gradients within `grad_tol` and the final weights within lr / 2 (AdamW moves
    a weight by about lr whatever its gradient: tests/exec/test_exec_parallel.py) on
    every rank holding each parameter; every parameter held somewhere. Returns the
    run's result."""
    import pytest

    from hyperpipe.exec import RunOptions, run_plan
    result = run_plan(plan, RunOptions(**{"steps": steps, "emulate": False,
                                          "capture_state": True, "probe_links": False,
                                          "lr": lr, **options}))
    losses, grads, weights = single_process(plan, steps, lr=lr)
    assert result.losses == pytest.approx(losses, abs=loss_tol)
    seen = set()
    for rank_state in result.state:
        for name, st in rank_state.items():
            diff = (st["grad"] - grads[name]).abs().max().item()
            assert diff <= grad_tol, (name, "grad", diff)
            diff = (st["param"] - weights[name]).abs().max().item()
            assert diff <= lr / 2, (name, "weight", diff)
            seen.add(name)
    assert seen == set(grads)
    return result


def assert_analytic_matches_simulator(plan: Plan, cost, rel: float = 0.05) -> None:
    """The analytic tier prices `plan` like the simulator: iteration time and every
    device's peak memory within `rel`."""
    import pytest

    from hyperpipe.sim.analytic import estimate
    from hyperpipe.sim.simulator import SimOptions, simulate
    sim = simulate(plan, cost, SimOptions(trace=False)).metrics
    est = estimate(plan, cost)
    assert est.iteration_time_s == pytest.approx(sim.iteration_time_s, rel=rel)
    for dev, peak in sim.peak_memory_bytes.items():
        assert est.peak_memory_bytes[dev] == pytest.approx(peak, rel=rel)
