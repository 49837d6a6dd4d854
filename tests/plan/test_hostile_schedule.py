"""Issue 33, case 5: synth actions validated in O(actions), the action limit applied to
synth plans, and a schedule drawing bounded before it is drawn."""

from __future__ import annotations

import pytest
from factories import plan_doc

from hyperpipe.cli import main
from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput
from hyperpipe.plan.kinds import generate
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.plan.schedule import Action, Schedule, dependencies, progress_order
from hyperpipe.plan.schedule_plot import draw_schedule


class _Counted(dict):
    looked = 0

    def __getitem__(self, key):
        self.looked += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_progress_is_linear_in_the_actions(kind):
    """Before: one pass over every rank per step of progress, O(m p^2) (a 4,096 x 24
    synth plan took 434 s to validate)."""
    schedule = generate(kind, 256, 4)
    deps = _Counted(dependencies(schedule))
    order, cursor = progress_order(schedule, deps)
    actions = sum(len(row) for row in schedule.actions)
    assert len(order) == actions and cursor == [len(r) for r in schedule.actions]
    assert deps.looked <= 3 * actions


def test_progress_still_stops_where_a_rank_waits():
    rows = [[Action.from_str(t) for t in r] for r in (["0F0", "0B0"], ["1B0", "1F0"])]
    order, cursor = progress_order(Schedule("synth", 2, 2, 1, rows))
    assert [str(a) for a in order] == ["0F0"] and cursor == [1, 0]


def test_synth_plan_over_the_action_limit_is_refused(monkeypatch):
    monkeypatch.setattr(limits, "MAX_SCHEDULE_ACTIONS", 7)
    rows = {"n/0": ["0F0", "0F1", "0B0", "0B1"], "n/1": ["1F0", "1F1", "1B0", "1B1"]}
    doc = plan_doc([{"micro_batch": 1, "num_microbatches": 2, "stages": [
        {"layers": [0, 4], "devices": ["n/0"]}, {"layers": [4, 8], "devices": ["n/1"]}]}],
        schedule={"kind": "synth", "actions": rows})
    with pytest.raises(BadInput, match=r"schedule.actions: expected at most 7 actions per "
                       r"pipeline .*got '8 in pipeline 0'"):
        _check(doc)
    monkeypatch.setattr(limits, "MAX_SCHEDULE_ACTIONS", 8)
    _check(doc)


def test_replicas_alike_are_validated_once_and_others_each(monkeypatch):
    """Two replicas with the same action lists are one schedule: validated once. A
    replica whose lists differ is validated on its own, and its deadlock is reported
    for it (pipeline 1, its device), not hidden behind the first's."""
    import hyperpipe.plan.plan as plan_mod
    calls = []
    real = plan_mod.validate
    monkeypatch.setattr(plan_mod, "validate", lambda s: calls.append(s) or real(s))
    ok = ["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]

    def doc(second):
        pipes = [{"micro_batch": 1, "num_microbatches": 2, "stages": [
            {"layers": [0, 4], "devices": [f"n/{2 * q}"]},
            {"layers": [4, 8], "devices": [f"n/{2 * q + 1}"]}]} for q in range(2)]
        rows = {"n/0": ok[0], "n/1": ok[1], "n/2": ok[0], "n/3": second}
        return plan_doc(pipes, schedule={"kind": "synth", "actions": rows})

    _check(doc(ok[1]))
    assert len(calls) == 1
    calls.clear()
    _check(doc(["1F0", "1F1", "1B0", "1B1"]))      # valid, another order: checked too
    assert len(calls) == 2
    with pytest.raises(BadInput, match=r"pipeline 1: .*device n/3"):
        _check(doc(["1B0", "1F0", "1F1", "1B1"]))


def _check(doc):
    plan = plan_from_dict(doc)
    plan.check(plan.load_model(), plan.load_cluster())


def test_drawing_over_its_bounds_is_refused_before_drawing(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "MAX_DRAWN_ACTIONS", 7, raising=False)
    out = tmp_path / "s.png"
    with pytest.raises(BadInput, match=r"^schedule drawing: expected at most \d+ ranks and 7 "
                       r"actions .*got '2 ranks, 8 actions'"):
        draw_schedule(generate("1f1b", 2, 2), out)
    assert not out.exists()


def test_schedule_png_of_too_many_ranks_is_one_line(tmp_path, capsys):
    """`schedule --kind gpipe --devices 4096 --microbatches 16 --format png` ran past
    900 s; 300 ranks are over the bound as well (and draw in seconds before the fix)."""
    out = tmp_path / "s.png"
    rc = main(["schedule", "--kind", "gpipe", "--devices", "300", "--microbatches", "1",
               "--format", "png", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "300 ranks" in err
    assert not out.exists()
