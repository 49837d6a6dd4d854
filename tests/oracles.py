"""Independent oracles shared by several test files: a unit-time event recurrence for
schedules (written apart from `hyperpipe.plan.schedule.dependencies` and from the
simulator), torch's own schedule checks, unit pipeline costs, bf16 tolerances."""

from __future__ import annotations

import torch
from torch.distributed.pipelining.schedules import (
    _add_send_recv,
    _simulate_comms_compute,
    _validate_schedule,
)

from hyperpipe.plan.schedule import Action, Schedule
from hyperpipe.sim.replay import PipeCosts


def torch_checks(s: Schedule) -> None:
    """torch's own validator, comms lowering and dry-run simulator on our schedule."""
    actions = s.to_torch_actions()
    mapping = _validate_schedule(actions, s.num_devices, s.num_stages, s.num_microbatches)
    assert mapping == {k: s.device_of(k) for k in range(s.num_stages)}
    rank = s.device_of

    # _add_send_recv pops from the lists it is given, so hand it copies.
    with_comms = _add_send_recv({d: list(a) for d, a in actions.items()}, rank, s.num_stages)
    _simulate_comms_compute(with_comms, rank, s.num_stages)


UNIT = {"F": 1, "B": 2, "I": 1, "W": 1}


def oracle_times(s: Schedule) -> dict[Action, tuple[int, int]]:
    """Unit-time event recurrence written independently of `dependencies`.

    An action starts when its rank is free and what it needs is done: F(k,m) needs
    F(k-1,m); B/I(k,m) need F(k,m) and the backward (I or B) of (k+1,m); W(k,m) needs I(k,m).
    """
    have = {a for row in s.actions for a in row}

    def needs(a: Action) -> list[Action]:
        k, mb = a.stage, a.microbatch
        if a.op == "F":
            return [Action(k - 1, "F", mb)] if k else []
        if a.op == "W":
            return [Action(k, "I", mb)]
        out = [Action(k, "F", mb)]
        if k + 1 < s.num_stages:
            out += [x for x in (Action(k + 1, "I", mb), Action(k + 1, "B", mb)) if x in have]
        return out

    end: dict[Action, tuple[int, int]] = {}
    free = [0] * s.num_devices
    nxt = [0] * s.num_devices
    total = sum(len(r) for r in s.actions)
    while len(end) < total:
        progressed = False
        for d, row in enumerate(s.actions):
            if nxt[d] < len(row) and all(x in end for x in needs(row[nxt[d]])):
                a = row[nxt[d]]
                start = max([free[d]] + [end[x][1] for x in needs(a)])
                end[a] = (start, start + UNIT[a.op])
                free[d] = start + UNIT[a.op]
                nxt[d] += 1
                progressed = True
        if not progressed:
            raise AssertionError("oracle stuck")
    return end


def makespan(s: Schedule) -> int:
    return max(e for _, e in oracle_times(s).values())


def unit_costs(n_st: int, p: int) -> PipeCosts:
    one = (1.0,) * n_st
    return PipeCosts(one, one, one, one, (0.0,) * (n_st - 1), (0.0,) * (n_st - 1),
                     (1e9,) * p)


# bf16 autocast on the GPU against the fp32 CPU reference: bf16 keeps 8 bits of mantissa
# (relative rounding 2^-9), so a whole gradient tensor agrees within a few percent
BF16_LOSS_TOL = 2e-2
BF16_REL_TOL = 5e-2


def close_bf16(grad: torch.Tensor, ref: torch.Tensor) -> bool:
    """Relative (Frobenius) error of a bf16-autocast gradient against the fp32 one."""
    return (grad - ref).norm().item() <= BF16_REL_TOL * ref.norm().item() + 1e-6


