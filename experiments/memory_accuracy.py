"""How close is the simulator's memory model to what real runs hold?

Runs plans of tiny-gpt on the demo cluster for real on this CPU (gloo, fp32, no
emulation: memory does not depend on speed) that differ in activation recompute (none,
selective, full), tensor parallelism (tp 1 and 2, with and without sequence
parallelism), data parallelism and the distributed optimizer, and compares every
rank's measured peak bytes of its second step (the first one with the optimizer's
state: exec.memory counts parameters, gradients, optimizer state and the tensors
autograd saves for backward) with the simulator's predicted peak of that device. The
model is fitted to nothing here, so every figure is out of sample. A null model, the
static state alone (weights, gradients and optimizer state, no activations), says how
much the activation model adds.

Prints one line per device of each plan, the null model's error, and last
``memory_mape=X n_runs=N`` (X: mean absolute percentage error over every rank of every
plan; N: plans run).

    python experiments/memory_accuracy.py [--steps 2]
"""

from __future__ import annotations

import argparse
import statistics

from hyperpipe.exec import RunOptions, run_plan
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate

A0, A1, V0, V1 = "a100/0", "a100/1", "v100/0", "v100/1"
# demo-hetero as this CPU runs it: no CUDA runtime holds memory here, so the catalog's
# per-GPU runtime reserve (CUDA context, allocator slack) is 0
CPU_CLUSTER = {
    "description": "demo-hetero without the GPUs' runtime reserve (run on a CPU)",
    "device_types": {"A100-80GB": {"runtime_reserve": 0}, "V100-32GB": {"runtime_reserve": 0}},
    "nodes": [{"name": "a100", "device": "A100-80GB", "count": 2},
              {"name": "v100", "device": "V100-32GB", "count": 2}],
    "inter_node": {"bandwidth": "10 Gbit/s", "latency": "10 us"}}


def stage(layers, devices, **fields) -> dict:
    return {"layers": list(layers), "devices": list(devices), "tp": len(devices), **fields}


def plan(pipelines: list[tuple[int, int, list[dict]]], *, kind: str = "1f1b",
         distributed_optimizer: bool = False, zero: int = 0, reshard: bool | None = None,
         model: str = "tiny-gpt"):
    return plan_from_dict({
        "format": "hyperpipe.plan/1", "model": model, "cluster": CPU_CLUSTER,
        "global_batch": sum(mb * m for mb, m, _ in pipelines), "schedule": kind,
        "distributed_optimizer": distributed_optimizer or zero >= 1, "zero": max(zero, int(
            distributed_optimizer)),
        **({} if reshard is None else {"runtime": {"reshard_after_forward": reshard}}),
        "pipelines": [{"micro_batch": mb, "num_microbatches": m, "stages": st}
                      for mb, m, st in pipelines]})


def two_stage(recompute: str = "none") -> list[dict]:
    return [stage((0, 4), (A0,), recompute=recompute), stage((4, 8), (V0,),
                                                             recompute=recompute)]


PLANS = {
    "recompute none, tp 1": plan([(4, 4, two_stage())]),
    "recompute selective, tp 1": plan([(4, 4, two_stage("selective"))]),
    "recompute full, tp 1": plan([(4, 4, two_stage("full"))]),
    "tp 2 + tp 1": plan([(4, 4, [stage((0, 4), (A0, A1)), stage((4, 8), (V0,))])]),
    "tp 2 sequence-parallel full + tp 2 selective": plan([(4, 4, [
        stage((0, 4), (A0, A1), sequence_parallel=True, recompute="full"),
        stage((4, 8), (V0, V1), recompute="selective")])]),
    "dp 2, distributed optimizer off": plan([
        (4, 2, [stage((0, 4), (A0,)), stage((4, 8), (V0,))]),
        (4, 2, [stage((0, 4), (A1,)), stage((4, 8), (V1,))])]),
    "dp 2, distributed optimizer on": plan([
        (4, 2, [stage((0, 4), (A0,)), stage((4, 8), (V0,))]),
        (4, 2, [stage((0, 4), (A1,)), stage((4, 8), (V1,))])], distributed_optimizer=True),
    "gpipe, recompute full": plan([(4, 4, two_stage("full"))], kind="gpipe"),
    # ZeRO-2 (gradients sharded too) and ZeRO-3 (FSDP2, exec.fsdp) over two replicas
    "dp 2, zero 2": plan([
        (4, 2, [stage((0, 4), (A0,)), stage((4, 8), (V0,))]),
        (4, 2, [stage((0, 4), (A1,)), stage((4, 8), (V1,))])], zero=2),
    "dp 2, zero 3 (pipelined: no reshard after forward)": plan([
        (4, 2, [stage((0, 4), (A0,)), stage((4, 8), (V0,))]),
        (4, 2, [stage((0, 4), (A1,)), stage((4, 8), (V1,))])], zero=3),
    "dp 2, zero 3 reshard after forward": plan([
        (4, 2, [stage((0, 4), (A0,)), stage((4, 8), (V0,))]),
        (4, 2, [stage((0, 4), (A1,)), stage((4, 8), (V1,))])], zero=3, reshard=True),
    # context parallelism (ring attention, exec.context_parallel): each stage's sequence
    # split over two devices of one type (tensor rank innermost, so tp 1 here)
    "cp 2 + cp 2": plan([(4, 4, [stage((0, 4), (A0, A1), tp=1, cp=2),
                                 stage((4, 8), (V0, V1), tp=1, cp=2)])]),
    "cp 2 selective + cp 2 full": plan([(4, 4, [
        stage((0, 4), (A0, A1), tp=1, cp=2, recompute="selective"),
        stage((4, 8), (V0, V1), tp=1, cp=2, recompute="full")])]),
    "cp 2, dp 2 distributed optimizer (state over dp x cp)": plan([
        (4, 2, [stage((0, 8), (A0, A1), tp=1, cp=2)]),
        (4, 2, [stage((0, 8), (V0, V1), tp=1, cp=2)])], distributed_optimizer=True),
    # mixture of experts (tiny-moe: layers 1 and 3 are MoE blocks of 4 experts, top 2):
    # all experts on each rank (ep 1), and expert parallelism over two replicas (ep 2:
    # half the experts per rank, the dispatched tokens saved for backward)
    "tiny-moe, ep 1, pp 2": plan([(4, 4, [stage((0, 3), (A0,)), stage((3, 6), (V0,))])],
                                 model="tiny-moe"),
    "tiny-moe, ep 2, dp 2": plan([(4, 2, [stage((0, 6), (A0,), ep=2)]),
                                  (4, 2, [stage((0, 6), (A1,), ep=2)])], model="tiny-moe"),
    "tiny-moe, ep 2, pp 2, dp 2, distributed optimizer": plan([
        (4, 2, [stage((0, 3), (A0,), ep=2), stage((3, 6), (V0,), ep=2)]),
        (4, 2, [stage((0, 3), (A1,), ep=2), stage((3, 6), (V1,), ep=2)])],
        model="tiny-moe", distributed_optimizer=True),
}


def static_bytes(plan, cost: CostModel) -> dict[str, float]:
    """Null model: each device's weights, gradients and optimizer state only."""
    out: dict[str, float] = {}
    holders: dict[tuple[int, int], int] = {}
    for pipe in plan.pipelines:
        for st in pipe.stages:
            holders[st.layers] = holders.get(st.layers, 0) + 1
    for pipe in plan.pipelines:
        for st in pipe.stages:
            # the distributed optimizer shards over the replicas' context ranks too
            shards = holders[st.layers] * st.cp if plan.distributed_optimizer else 1
            for d in st.devices:
                out[d] = out.get(d, 0.0) + cost.state_bytes(
                    st.layers, st.tp, shards, plan.zero if plan.zero >= 2 else None,
                    # expert parallelism: 1/ep of the experts, sharded over their copies
                    expert_share=1 / st.ep, expert_shards=max(1, shards // st.ep))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    errors, null_errors = [], []
    for name, p in PLANS.items():
        spec, cluster = p.load_model(), p.load_cluster()
        cost = CostModel(spec, cluster)
        predicted = simulate(p, cost).metrics.peak_memory_bytes
        null = static_bytes(p, cost)
        result = run_plan(p, RunOptions(steps=args.steps, emulate=False, probe_links=False))
        measured = result.trace.meta["peak_memory_bytes"]
        print(f"{name}:")
        for device, peaks in measured.items():
            real = max(peaks[1:] or peaks)      # from the step with optimizer state on
            err = abs(predicted[device] - real) / real
            errors.append(err)
            null_errors.append(abs(null[device] - real) / real)
            print(f"  {device:8s} predicted {predicted[device] / 1e6:8.2f} MB   measured "
                  f"{real / 1e6:8.2f} MB   error {100 * err:5.1f} %")
    print(f"null model (static state only, no activations): "
          f"mape={statistics.mean(null_errors):.4f}")
    print(f"memory_mape={statistics.mean(errors):.4f} n_runs={len(PLANS)}")


if __name__ == "__main__":
    main()
