"""Reference times of a rank's actions for emulation (see emulation.stretch).

`measure_reference` times each (stage, op) a rank runs, and its optimizer step, on
stand-in data; the launcher runs it one tensor-parallel group at a time (a group's
ranks together, since their compute includes the group's collectives), so that the
times are uncontended. `reference_from` takes them from a native-speed profile instead.
"""

from __future__ import annotations

import torch

from hyperpipe.exec import compute
from hyperpipe.exec.emulation import compute_clock, compute_s
from hyperpipe.exec.tensor_parallel import local
from hyperpipe.models import example_batch


def measure_reference(rt, *, repeats: int = 5, warmup: int = 2) -> dict:
    """(stage, op) or "optimizer" -> seconds for RankRuntime `rt`: the fastest of
    `repeats` (on a shared machine every slower one had company) after `warmup` rounds.
    Gradients it leaves behind are cleared."""
    ops: dict[int, set[str]] = {}
    for a in rt.actions:
        ops.setdefault(a.stage, set()).add(a.op)
    tokens, targets = example_batch(rt.spec, rt.micro_batch, rt.seed)
    tokens, targets = rt.local_sequence(tokens), rt.local_sequence(targets)   # cp: its own
    samples: dict = {}
    record = [False]                  # the first `warmup` rounds are not recorded

    def timed(key, fn):
        t0 = compute_clock()
        result = fn()
        if record[0]:
            samples.setdefault(key, []).append(compute_s(t0, compute_clock()))
        return result

    for rep in range(warmup + repeats):
        record[0] = rep >= warmup
        for s, st in rt.stages.items():
            # the same stand-in data on every rank of a tensor-parallel group
            gen = torch.Generator().manual_seed(rt.seed + s)
            x = tokens.to(rt.device) if st.is_first else \
                torch.randn(st.in_shape, generator=gen).to(rt.device).requires_grad_()
            tg = targets.to(rt.device) if st.is_last else None
            grad = None if st.is_last else torch.randn(st.out_shape, generator=gen).to(rt.device)
            for op in sorted(ops[s]):
                entry = timed((s, "F"), lambda st=st, x=x, tg=tg: rt.compute_forward(st, x, tg))
                if op == "B":
                    timed((s, "B"), lambda e=entry, g=grad: compute.backward(e, g))
                elif op == "I":
                    params = list(st.module.parameters())
                    timed((s, "I"), lambda p=params, e=entry, g=grad:
                          compute.input_grad(p, e, g))
                    timed((s, "W"), lambda p=params, e=entry: compute.weight_grad(p, e))
    clone = [torch.nn.Parameter(local(p).detach().clone()) for p in rt.params]
    for p in clone:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(clone)
    for rep in range(warmup + repeats):
        record[0] = rep >= warmup
        timed("optimizer", opt.step)
    for p in rt.params:
        p.grad = None
    return {k: min(v) for k, v in samples.items()}


def reference_from(rt, cost) -> dict:
    """Compute references for RankRuntime `rt`'s stages from a native-speed profile
    (`cost`: a CostModel over such a profile, e.g. from `hyperpipe calibrate --measure
    --no-emulate`). Why: a shared machine's own speed drifts by tens of percent from one
    second to the next; a profile taken once holds every run of a study to the same
    native speed, so that emulated device speeds stay put. The optimizer's reference is
    the profile's too, summed over the stages as the simulator counts it. A backward
    that recomputes includes the forward work it redoes (CostModel.recompute_s, without
    its collectives, which the run does for real)."""
    pipe = rt.plan.pipelines[rt.where.pipeline]
    dtype = cost.cluster.device(rt.name).type.name
    out: dict = {}
    for a in rt.actions:
        st = pipe.stages[a.stage]
        out[(a.stage, a.op)] = cost.stage_compute_s(st.layers, dtype, rt.micro_batch, a.op,
                                                    st.tp, st.sequence_parallel, st.cp)
        if a.op in ("B", "I") and st.recompute != "none":
            # the backward that needs the activations first redoes their forward
            out[(a.stage, a.op)] += sum(
                cost.model.recompute_fraction(i, rt.micro_batch, st.recompute)
                * cost.layer_time_s(i, dtype, rt.micro_batch, "F", st.tp, st.sequence_parallel,
                                    st.cp)
                for i in range(*st.layers))
    if cost.profile is not None and dtype in cost.profile.optimizer:
        out["optimizer"] = sum(cost.optimizer_time_s(pipe.stages[s].layers, dtype,
                                                     pipe.stages[s].tp, _shards(rt.plan, s, pipe))
                               for s in rt.stages)
    return out


def _shards(plan, s: int, pipe) -> int:
    """Replicas over which the distributed optimizer splits stage `s`'s state (the
    pipelines holding the same layer range; 1 without it)."""
    if not plan.distributed_optimizer:
        return 1
    layers = pipe.stages[s].layers
    return sum(1 for p in plan.pipelines for st in p.stages if st.layers == layers)
