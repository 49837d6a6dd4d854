"""Plan files: the JSON round trip and the check, rejection with the field named."""

from __future__ import annotations

import json

import pytest
from plan_docs import edited

from hyperpipe.core.errors import BadInput
from hyperpipe.plan.plan import load_plan, plan_from_dict

PLAN = {
    "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
    "global_batch": 32, "schedule": {"kind": "1f1b", "chunks": 1},
    "pipelines": [{"micro_batch": 2, "num_microbatches": 16,
                   "stages": [{"layers": [0, 5], "devices": ["a100/0"], "tp": 1},
                              {"layers": [5, 8], "devices": ["v100/0"], "tp": 1}]}],
}


def test_plan_round_trip_and_check(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN))
    plan = load_plan(path)
    plan.check(plan.load_model(), plan.load_cluster())
    assert plan.to_dict() == {**PLAN, "stack": "megatron-lm"}     # written: its stack too
    plan.save(tmp_path / "again.json")
    assert load_plan(tmp_path / "again.json") == plan
    assert plan.devices == ["a100/0", "v100/0"]


def _plan(**changes):
    return edited(PLAN, **changes)


@pytest.mark.parametrize("doc,field", [
    (_plan(format="hyperpipe.plan/9"), "format"),
    (_plan(global_batch=30), "global_batch"),
    (_plan(schedule={"kind": "zigzag"}), "schedule.kind"),
    (_plan(schedule={"kind": "1f1b", "chunks": 2}), "schedule.chunks"),
    (_plan(**{"pipelines/0/stages/1/layers": [4, 8]}), "stages[1].layers"),
    (_plan(**{"pipelines/0/stages/1/layers": [6, 8]}), "stages[1].layers"),
    (_plan(**{"pipelines/0/stages/1/layers": [5, 7]}), "pipelines[0].stages"),
    (_plan(**{"pipelines/0/stages/1/devices": ["v100/9"]}), "stages[1].devices"),
    (_plan(**{"pipelines/0/stages/1/devices": ["a100/0"]}), "stages[1].devices"),
    (_plan(**{"pipelines/0/micro_batch": 0}), "micro_batch"),
    (_plan(**{"pipelines/0/num_microbatches": "many"}), "num_microbatches"),
    (_plan(**{"pipelines/0/stages/0/tp": 2}), "stages[0].devices"),
    (_plan(pipelines=[]), "pipelines"),
    (_plan(extra=1), "extra"),
])
def test_plan_rejects(doc, field):
    with pytest.raises(BadInput) as err:
        plan = plan_from_dict(doc, where="p.json")
        plan.check(plan.load_model(), plan.load_cluster(), where="p.json")
    assert field in str(err.value)
    assert str(err.value).startswith("p.json")



@pytest.mark.parametrize("schedule", [None, {}, {"chunks": 1}])
def test_the_schedule_kind_defaults_to_1f1b(schedule):
    """formats.md gives `schedule.kind` the default 1f1b; it had been required."""
    doc = {k: v for k, v in PLAN.items() if k != "schedule"}
    if schedule is not None:
        doc["schedule"] = schedule
    assert plan_from_dict(doc, where="p.json") == plan_from_dict(PLAN, where="p.json")


def test_a_stage_of_two_types_is_named_as_a_stage_not_a_tensor_group():
    """tp 2 x cp 2 over two A100s and two V100s: each tensor group is of one type; the
    rule is one type per stage, and the message says so."""
    doc = edited(PLAN, **{"pipelines/0/stages": [
        {"layers": [0, 8], "devices": ["a100/0", "a100/1", "v100/0", "v100/1"], "tp": 2,
         "cp": 2}]})
    plan = plan_from_dict(doc, where="p.json")
    with pytest.raises(BadInput, match="one device type across the stage's devices "
                                       r"\(its tensor and context-parallel ranks\)"):
        plan.check(plan.load_model(), plan.load_cluster(), where="p.json")


def test_whole_numbers_of_a_plan_are_read_as_every_count():
    """Stage layers and `zero` are counts like `num_microbatches`: 5.0 and "5e0" are 5
    (layers had been refused; `zero: 1.0` had been kept a float)."""
    doc = _plan(**{"pipelines/0/stages/0/layers": [0.0, "5e0"],
                   "pipelines/0/stages/1/layers": [5.0, 8], "zero": 1.0,
                   "pipelines/0/num_microbatches": "16e0"})
    plan = plan_from_dict(doc, where="p.json")
    assert plan == plan_from_dict(_plan(zero=1), where="p.json")
    assert type(plan.zero) is int
    assert all(type(x) is int for st in plan.pipelines[0].stages for x in st.layers)
    with pytest.raises(BadInput, match=r"^p\.json: pipelines\[0\]\.stages\[0\]\.layers: "):
        plan_from_dict(_plan(**{"pipelines/0/stages/0/layers": [0, 4.5]}), where="p.json")


@pytest.mark.parametrize("kind,devices,match", [
    ("interleaved-1f1b", ["a100/0", "a100/0", "v100/0", "v100/0"],
     r"^p\.json: pipelines\[0\]\.stages\[1\]\.devices: expected a device of its own among "
     r"the first 2 stages \(looped placement of interleaved-1f1b with chunks 2: stage k on "
     r"the devices of stage k mod 2; also used by p\.json: pipelines\[0\]\.stages\[0\]\), "
     r"got 'a100/0'$"),
    ("interleaved-1f1b", ["a100/0", "v100/0", "v100/0", "a100/0"],
     r"^p\.json: pipelines\[0\]\.stages\[2\]\.devices: expected the devices of stage 0 "
     r"\(looped placement of interleaved-1f1b with chunks 2: stage k on the devices of "
     r"stage k mod 2\), got \['v100/0'\]$"),
    ("zb-v", ["a100/0", "v100/0", "a100/0", "v100/0"],
     r"^p\.json: pipelines\[0\]\.stages\[2\]\.devices: expected the devices of stage 1 "
     r"\(V placement of zb-v with chunks 2: .*\), got \['a100/0'\]$")])
def test_a_misplaced_chunk_is_refused_with_the_placement_rule(kind, devices, match):
    """Stages 0 and 1 of an interleaved plan on one device had been refused as "each device
    in one stage only", which an interleaved plan breaks on purpose (a100/0 holds stages
    0 and 2 of a looped plan): the message states the placement rule."""
    doc = edited(PLAN, schedule={"kind": kind, "chunks": 2}, **{"pipelines/0/stages": [
        {"layers": [2 * k, 2 * k + 2], "devices": [d]} for k, d in enumerate(devices)]})
    plan = plan_from_dict(doc, where="p.json")
    with pytest.raises(BadInput, match=match):
        plan.check(plan.load_model(), plan.load_cluster(), where="p.json")
    ok = ["a100/0", "v100/0", "a100/0", "v100/0"] if kind != "zb-v" else \
        ["a100/0", "v100/0", "v100/0", "a100/0"]
    doc = edited(doc, **{f"pipelines/0/stages/{k}/devices": [d] for k, d in enumerate(ok)})
    plan = plan_from_dict(doc, where="p.json")
    plan.check(plan.load_model(), plan.load_cluster(), where="p.json")
