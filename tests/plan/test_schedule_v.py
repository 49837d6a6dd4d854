"""The V-shaped kinds (zb-v, dualpipe-v): torch's checks, torch's own orders, placement."""

from __future__ import annotations

import pytest
from oracles import makespan, oracle_times, torch_checks
from torch.distributed.pipelining import schedules as torch_schedules

from hyperpipe.core.errors import BadInput
from hyperpipe.plan.kinds import generate
from hyperpipe.plan.schedule import Action, Schedule, rank_stages, stage_rank, validate

V_GRID = [(kind, p, m) for kind in ("zb-v", "dualpipe-v") for p in (2, 4, 8)
          for m in (p, 2 * p, 4 * p)]
TORCH_CLASS = {"zb-v": torch_schedules.ScheduleZBVZeroBubble,
               "dualpipe-v": torch_schedules.ScheduleDualPipeV}


def torch_order(kind: str, p: int, m: int) -> Schedule:
    """torch's own per-rank order for (p, m), built without a process group.

    The schedule classes compute their order from the rank count and micro-batch count
    alone (`_calculate_single_rank_operations`). DualPipeV's overlapped forward+backward
    pairs are written as their two sub-actions in order. torch's DualPipeV refuses
    m < 2p; there we take its order for 2p and drop the micro-batches >= m."""
    cls = TORCH_CLASS[kind]
    obj = object.__new__(cls)
    n = max(m, 2 * p) if kind == "dualpipe-v" else m
    obj.pp_group_size, obj._n_microbatches = p, n
    obj.num_stages = obj._num_stages = 2 * p
    rows = []
    for d in range(p):
        row = []
        for a in obj._calculate_single_rank_operations(d):
            for x in (a.sub_actions or (a,)) if a is not None else ():
                if x.microbatch_index < m:
                    row.append(Action(x.stage_index, x.computation_type.value,
                                      x.microbatch_index))
        rows.append(tuple(row))
    return Schedule("torch-" + kind, p, 2 * p, m, tuple(rows), "v")


def test_v_placement():
    assert [rank_stages(d, 4, 2, "v") for d in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [stage_rank(k, 4, "v") for k in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_rank(k, 4) for k in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("kind, p, m", V_GRID)
def test_v_kinds_pass_torch_checks_and_match_torch_makespan(kind, p, m):
    s = generate(kind, p, m)
    assert (s.num_devices, s.num_stages, s.placement) == (p, 2 * p, "v")
    validate(s)
    torch_checks(s)
    theirs = torch_order(kind, p, m)
    validate(theirs)
    # F = I = W = t (B = 2t), free links: the independent oracle times both.
    assert makespan(s) == makespan(theirs)


def test_v_kinds_on_a_wider_grid_validate():
    for kind in ("zb-v", "dualpipe-v"):
        for p in range(1, 7):
            for m in range(1, 3 * p + 2):
                s = generate(kind, p, m)
                validate(s)
                torch_checks(s)


def test_zb_v_is_zero_bubble_in_steady_state():
    # Qi et al. 2024: with F = I = W = t, ZB-V's only bubble is the (p - 1) t ramp.
    for p in (2, 3, 4, 8):
        for m in (2 * p, 3 * p, 4 * p):
            assert makespan(generate("zb-v", p, m)) == 6 * m + p - 1


def test_zb_v_activation_memory_is_that_of_1f1b():
    # Each chunk holds half a stage's layers; 1F1B's first rank stashes p full stages,
    # i.e. 2p chunk stashes. ZB-V holds at most that on every rank.
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            s = generate("zb-v", p, m)
            for row in s.actions:
                live = peak = 0
                for a in row:
                    live += 1 if a.op == "F" else -1 if a.op in "BW" else 0
                    peak = max(peak, live)
                assert peak <= 2 * p


def test_v_kinds_take_two_chunks_only():
    assert generate("zb-v", 3, 6, 2) == generate("zb-v", 3, 6)
    with pytest.raises(BadInput, match="chunks"):
        generate("dualpipe-v", 3, 6, 1)


def test_oracle_times_v():
    s = generate("dualpipe-v", 3, 7)
    times = oracle_times(s)
    for d, row in enumerate(s.actions):
        ends = [times[a][1] for a in row]
        assert ends == sorted(ends)
        assert all(s.device_of(a.stage) == d for a in row)


@pytest.mark.parametrize("kind", ["zb-v", "dualpipe-v"])
def test_v_rank_peaks_stop_growing_at_two_rounds(kind):
    """The analytic tier reads a V kind's in-flight peaks off the schedule of
    min(m, 2p) micro-batches: past 2p they no longer change."""
    from hyperpipe.plan.schedule import rank_peaks
    for p in range(1, 9):
        ref = rank_peaks(generate(kind, p, 2 * p, 2))
        for m in range(2 * p + 1, 4 * p + 3):
            assert rank_peaks(generate(kind, p, m, 2)) == ref, (p, m)
