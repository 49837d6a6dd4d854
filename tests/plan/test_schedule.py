"""Tests of the schedule IR, generators, validator and exports (hyperpipe.plan.schedule*)."""

from __future__ import annotations

import csv
import io
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import makespan, oracle_times, torch_checks
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    _Action,
    _PipelineScheduleRuntime,
)

from hyperpipe.core.errors import BadInput
from hyperpipe.plan.generators_loop import (
    gpipe,
    interleaved_1f1b,
    interleaved_1f1b_peak,
    one_f_one_b,
    zb_h1,
)
from hyperpipe.plan.kinds import GENERATED_KINDS, generate
from hyperpipe.plan.schedule import (
    OPS,
    Action,
    Schedule,
    ScheduleError,
    dependencies,
    rank_peaks,
    validate,
)
from hyperpipe.plan.schedule_plot import draw_schedule

KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
GRID = [
    (kind, p, m, v)
    for kind in KINDS
    for p in range(1, 9)
    for m in range(1, 33)
    for v in (range(1, 5) if kind == "interleaved-1f1b" else (1,))
]


def peak_in_flight(s: Schedule, freed_by: tuple[str, ...]) -> dict[int, int]:
    """Per stage, the most micro-batches between their F and the op in `freed_by`."""
    peak = {k: 0 for k in range(s.num_stages)}
    for row in s.actions:
        live = {k: 0 for k in range(s.num_stages)}
        for a in row:
            if a.op == "F":
                live[a.stage] += 1
            elif a.op in freed_by:
                live[a.stage] -= 1
            peak[a.stage] = max(peak[a.stage], live[a.stage])
    return peak


# ---- Action ---------------------------------------------------------------------------


@given(st.integers(0, 10_000), st.sampled_from(OPS), st.integers(0, 10_000))
def test_action_text_round_trip_matches_torch(stage, op, mb):
    a = Action(stage, op, mb)
    assert Action.from_str(str(a)) == a
    assert str(a) == repr(_Action.from_str(str(a)))


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "-1F0", "2F0x", "1UNSHARD", "2 F 0"])
def test_action_from_str_rejects(text):
    with pytest.raises(ScheduleError) as err:
        Action.from_str(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args", [(-1, "F", 0), (0, "X", 0), (0, "F", -2), (0.5, "F", 0)])
def test_action_rejects_bad_fields(args):
    with pytest.raises(ScheduleError):
        Action(*args)


def test_action_orders_by_stage_op_microbatch():
    assert sorted([Action(1, "F", 0), Action(0, "F", 1), Action(0, "B", 3)]) == [
        Action(0, "B", 3),
        Action(0, "F", 1),
        Action(1, "F", 0),
    ]


# ---- Schedule text forms ---------------------------------------------------------------


def schedules():
    return st.sampled_from(KINDS).flatmap(
        lambda kind: st.builds(
            generate,
            st.just(kind),
            st.integers(1, 8),
            st.integers(1, 32),
            st.integers(1, 4) if kind == "interleaved-1f1b" else st.just(1),
        )
    )


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_text_round_trip(s):
    text = s.to_text()
    assert text.splitlines()[0].startswith("0: ")
    again = Schedule.from_text(text, kind=s.kind, num_microbatches=s.num_microbatches)
    assert again == s
    assert Schedule.from_text(text, kind=s.kind) == s  # counts inferred


def test_text_form_example():
    s = one_f_one_b(2, 2)
    assert s.to_text() == "0: 0F0 0F1 0B0 0B1\n1: 1F0 1B0 1F1 1B1\n"
    assert s.to_torch_csv() == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


@pytest.mark.parametrize("text", ["", "1: 0F0", "0: 0F0\n0: 1F0", "0 0F0", "0: 0Q0"])
def test_from_text_rejects(text):
    with pytest.raises(ScheduleError) as err:
        Schedule.from_text(text)
    assert "\n" not in str(err.value)


def test_schedule_is_immutable_and_freezes_lists():
    s = Schedule("custom", 1, 1, 1, [[Action(0, "F", 0), Action(0, "B", 0)]])
    assert isinstance(s.actions, tuple) and isinstance(s.actions[0], tuple)
    with pytest.raises(AttributeError):
        s.kind = "x"
    with pytest.raises(ScheduleError):
        Schedule("custom", 2, 3, 1, [[], []])  # 3 stages cannot loop over 2 ranks


# ---- generators: validity on the whole grid, ours and torch's ---------------------------


def test_every_kind_validates_on_full_grid():
    for kind, p, m, v in GRID:
        s = generate(kind, p, m, v)
        assert (s.num_devices, s.num_stages, s.num_microbatches) == (p, p * v, m)
        validate(s)


def test_torch_accepts_every_kind_on_full_grid():
    for kind, p, m, v in GRID:
        torch_checks(generate(kind, p, m, v))


@settings(max_examples=40, deadline=None)
@given(schedules())
def test_generated_schedules_pass_both_validators(s):
    validate(s)
    torch_checks(s)


def test_interleaved_with_one_chunk_is_1f1b():
    for p in range(1, 9):
        for m in range(1, 20):
            assert interleaved_1f1b(p, m, 1).actions == one_f_one_b(p, m).actions


def test_registry_and_direct_functions_agree():
    assert set(GENERATED_KINDS) == set(KINDS) | {"zb-v", "dualpipe-v"}
    assert generate("gpipe", 3, 5) == gpipe(3, 5)
    assert generate("zb-h1", 3, 5) == zb_h1(3, 5)
    assert generate("interleaved-1f1b", 3, 5, 2) == interleaved_1f1b(3, 5, 2)


@pytest.mark.parametrize(
    "args, word",
    [
        (("pipedream", 2, 4), "gpipe, 1f1b"),
        (("1f1b", 2, 4, 2), "chunks"),
        (("zb-h1", 2, 4, 3), "chunks"),
        (("1f1b", 0, 4), "devices"),
        (("1f1b", 2, -1), "microbatches"),
        (("interleaved-1f1b", 2, 4, 0), "chunks"),
    ],
)
def test_generate_rejects(args, word):
    with pytest.raises(BadInput) as err:
        generate(*args)
    assert word in str(err.value) and "\n" not in str(err.value)


# ---- timing and memory against the closed forms ---------------------------------------


@pytest.mark.parametrize("p", range(1, 9))
def test_makespans_match_closed_forms(p):
    for m in range(1, 25):
        assert makespan(gpipe(p, m)) == 3 * (m + p - 1)
        assert makespan(one_f_one_b(p, m)) == 3 * (m + p - 1)
        zb = makespan(zb_h1(p, m))
        assert zb <= 3 * (m + p - 1)
        if m >= p:
            assert zb == 3 * m + p - 1
    for m in range(p, 25, p):
        for v in range(1, 5):
            assert makespan(interleaved_1f1b(p, m, v)) == 3 * m * v + 3 * (p - 1)


def test_oracle_agrees_with_dependencies_on_a_sample():
    # The oracle re-derives the edges; `dependencies` must give the same times.
    for s in (zb_h1(4, 6), interleaved_1f1b(3, 7, 2), gpipe(2, 3)):
        deps = dependencies(s)
        times = oracle_times(s)
        for a, (start, _) in times.items():
            assert all(times[x][1] <= start for x in deps[a])


@pytest.mark.parametrize("p", range(1, 9))
def test_peak_in_flight(p):
    for m in range(1, 20):
        assert peak_in_flight(gpipe(p, m), ("B",)) == {k: m for k in range(p)}
        ofob = peak_in_flight(one_f_one_b(p, m), ("B",))
        assert ofob == {k: min(p - k, m) for k in range(p)}
        zb = zb_h1(p, m)
        # Between F and I (the input-gradient stash) ZB-H1 keeps exactly 1F1B's count ...
        assert peak_in_flight(zb, ("I",)) == ofob
        # ... and counting until W it never exceeds 1F1B's peak over all stages.
        assert max(peak_in_flight(zb, ("W",)).values()) <= max(ofob.values())


# ---- validator negative cases ---------------------------------------------------------


def edited(s: Schedule, d: int, row: list[Action]) -> Schedule:
    rows = list(s.actions)
    rows[d] = tuple(row)
    return Schedule(s.kind, s.num_devices, s.num_stages, s.num_microbatches, tuple(rows))


def check_error(s: Schedule, *words: str) -> ScheduleError:
    with pytest.raises(ScheduleError) as err:
        validate(s)
    msg = str(err.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg, msg
    assert ">>" in err.value.details and "rank 0" in err.value.details
    assert len(err.value.details.splitlines()) > 2
    return err.value


def test_validator_missing_action():
    s = one_f_one_b(2, 3)
    row = [a for a in s.actions[1] if a != Action(1, "B", 2)]
    check_error(edited(s, 1, row), "stage 1 micro-batch 2", "F+B or F+I+W", "got F")


def test_validator_duplicate_action():
    s = one_f_one_b(2, 3)
    check_error(edited(s, 0, [*s.actions[0], Action(0, "B", 0)]), "duplicate", "0B0")


def test_validator_w_before_i():
    s = zb_h1(2, 2)
    row = list(s.actions[1])
    i, w = row.index(Action(1, "I", 0)), row.index(Action(1, "W", 0))
    row[i], row[w] = row[w], row[i]
    check_error(edited(s, 1, row), "1W0", "1I0 earlier")


def test_validator_b_before_f():
    s = gpipe(2, 2)
    row = list(s.actions[0])
    row.remove(Action(0, "B", 1))
    row.insert(0, Action(0, "B", 1))
    check_error(edited(s, 0, row), "0B1", "0F1 earlier")


def test_validator_wrong_device():
    s = interleaved_1f1b(2, 2, 2)  # 4 stages; stage 2 belongs to rank 0
    moved = [a for a in s.actions[0] if a.stage == 2]
    s2 = Schedule(
        s.kind, 2, 4, 2, (tuple(a for a in s.actions[0] if a.stage != 2), (*s.actions[1], *moved))
    )
    check_error(s2, "rank 1", "stage 2 on rank 0")


def test_validator_out_of_range():
    s = one_f_one_b(2, 2)
    check_error(edited(s, 0, [*s.actions[0], Action(2, "F", 0)]), "stage in [0, 2)")
    check_error(edited(s, 0, [*s.actions[0], Action(0, "F", 5)]), "micro-batch in [0, 2)")


def test_validator_unknown_op():
    s = one_f_one_b(1, 1)
    bad = Action(0, "F", 0)
    object.__setattr__(bad, "op", "X")  # smuggled past the constructor
    check_error(edited(s, 0, [bad, *s.actions[0][1:]]), "op in")


def test_validator_reports_deadlock_with_stuck_actions():
    # Rank 0 wants 0B0 (needs 1B0) before 0F1; rank 1 wants 1F1 (needs 0F1) before 1B0.
    s = Schedule.from_text("0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1")
    err = check_error(
        s, "deadlock", "rank 0 step 1 0B0 waits for 1B0", "rank 1 step 1 1F1 waits for 0F1"
    )
    assert ">>0B0<<" in err.details and ">>1F1<<" in err.details


def test_dependencies_rules():
    deps = dependencies(zb_h1(2, 1))
    assert deps[Action(0, "F", 0)] == ()
    assert deps[Action(1, "F", 0)] == (Action(0, "F", 0),)
    assert deps[Action(1, "I", 0)] == (Action(1, "F", 0),)
    assert deps[Action(0, "I", 0)] == (Action(0, "F", 0), Action(1, "I", 0))
    assert deps[Action(0, "W", 0)] == (Action(0, "I", 0),)
    assert dependencies(gpipe(2, 1))[Action(0, "B", 0)] == (Action(0, "F", 0), Action(1, "B", 0))


# ---- exports --------------------------------------------------------------------------


@pytest.mark.parametrize("kind, p, m, v", [("interleaved-1f1b", 4, 6, 2), ("zb-h1", 3, 5, 1)])
def test_torch_csv_loads_in_torch_runtime(tmp_path, kind, p, m, v):
    s = generate(kind, p, m, v)
    path = tmp_path / "schedule.csv"
    path.write_text(s.to_torch_csv())
    # A stand-in stage: _load_csv only needs the stage count and the group size.
    stage = types.SimpleNamespace(num_stages=s.num_stages, group_size=p, group_rank=0)
    runtime = _PipelineScheduleRuntime(stages=[stage], n_microbatches=m)
    runtime._load_csv(str(path), "compute_only")
    assert runtime.pipeline_order == s.to_torch_actions()
    assert runtime.stage_index_to_group_rank == {k: k % p for k in range(p * v)}
    rows = list(csv.reader(io.StringIO(s.to_torch_csv())))
    assert [[Action.from_str(c) for c in r] for r in rows] == [list(r) for r in s.actions]


def test_draw_schedule_writes_png(tmp_path):
    path = tmp_path / "s.png"
    draw_schedule(interleaved_1f1b(3, 5, 2), path, title="demo")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


@pytest.mark.parametrize("p,m,v", [(p, m, v) for p in (2, 3, 4, 8) for m in range(1, 19)
                                   for v in (2, 3) if m % max(1, m // p) == 0])
def test_interleaved_order_is_torchs_wherever_torch_builds_one(p, m, v):
    """Oracle: torch's own ScheduleInterleaved1F1B (its flexible rounds, p not dividing
    m included), built on stand-in stages; its per-rank compute order is ours."""
    import torch

    def stage(i: int):
        return types.SimpleNamespace(stage_index=i, num_stages=p * v, group_size=p,
                                     group_rank=0, submod=torch.nn.Linear(1, 1),
                                     stage_index_to_group_rank={})
    ours = interleaved_1f1b(p, m, v)
    theirs = ScheduleInterleaved1F1B([stage(c * p) for c in range(v)], m)
    for r in range(p):
        got = [(a.stage_index, a.computation_type.value, a.microbatch_index)
               for a in theirs.pipeline_order[r] if a is not None]
        assert got == [(a.stage, a.op, a.microbatch) for a in ours.actions[r]]
    assert [interleaved_1f1b_peak(p, m, v, r) for r in range(p)] == list(rank_peaks(ours))
