"""The plan fields `zero` (0-3; `distributed_optimizer: true` loads as zero 1) and stage
`cp` (tp x cp devices, tensor rank innermost), and `runtime.reshard_after_forward`:
parsed, checked (bad values are one BadInput line, exit 2), round-tripped, written as
before when at their defaults; the executor refuses what it cannot run."""

from __future__ import annotations

import json

import pytest
from plan_docs import edited

from hyperpipe.cli import main
from hyperpipe.core.errors import BadInput
from hyperpipe.plan.plan import plan_from_dict

PLAN = {
    "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
    "global_batch": 8, "schedule": {"kind": "1f1b", "chunks": 1},
    "pipelines": [{"micro_batch": 2, "num_microbatches": 4,
                   "stages": [{"layers": [0, 5], "devices": ["a100/0", "a100/1"], "tp": 1,
                               "cp": 2},
                              {"layers": [5, 8], "devices": ["v100/0", "v100/1"], "tp": 2}]}],
}


def test_zero_and_cp_round_trip():
    plan = plan_from_dict(edited(PLAN, zero=3, runtime={"reshard_after_forward": False}))
    assert plan.zero == 3 and plan.distributed_optimizer
    s0, s1 = plan.pipelines[0].stages
    assert (s0.tp, s0.cp, s0.context_rank(1)) == (1, 2, ("a100/1",))
    assert (s1.tp, s1.cp, s1.tp_group) == (2, 1, ("v100/0", "v100/1"))
    assert plan.runtime_settings().reshard_after_forward is False
    doc = plan.to_dict()
    assert doc["zero"] == 3 and doc["pipelines"][0]["stages"][0]["cp"] == 2
    assert "cp" not in doc["pipelines"][0]["stages"][1]       # default left out
    again = plan_from_dict(json.loads(json.dumps(doc)))
    assert again == plan and again.to_dict() == doc
    plan.check(plan.load_model(), plan.load_cluster())


@pytest.mark.parametrize("given,zero", [({}, 0), ({"distributed_optimizer": True}, 1),
                                        ({"zero": 1}, 1),
                                        ({"zero": 2, "distributed_optimizer": True}, 2)])
def test_distributed_optimizer_is_zero_one(given, zero):
    plan = plan_from_dict(edited(PLAN, **given))
    assert plan.zero == zero and plan.distributed_optimizer == (zero >= 1)
    doc = plan.to_dict()
    # zero 1 is written as before `zero` existed; plans without either are unchanged
    assert doc.get("distributed_optimizer", False) == (zero == 1)
    assert doc.get("zero", 0) == (zero if zero >= 2 else 0)
    # callers that set the old flag keep working
    assert plan.with_memory(distributed_optimizer=True).zero == max(zero, 1)
    assert plan.with_memory(distributed_optimizer=False).zero == 0


@pytest.mark.parametrize("changes,field", [
    ({"zero": 4}, "zero"),
    ({"zero": True}, "zero"),
    ({"zero": "3"}, "zero"),
    ({"zero": 0, "distributed_optimizer": True}, "distributed_optimizer"),
    ({"zero": 2, "distributed_optimizer": False}, "distributed_optimizer"),
    ({"pipelines/0/stages/0/cp": 0}, "stages[0].cp"),
    ({"pipelines/0/stages/0/cp": 3}, "stages[0].devices"),
    ({"pipelines/0/stages/1/cp": 2}, "stages[1].devices"),
    ({"runtime": {"reshard_after_forward": "no"}}, "runtime.reshard_after_forward"),
])
def test_bad_fields_are_one_line_exit_2(changes, field, tmp_path, capsys):
    doc = edited(PLAN, **changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    assert main(["simulate", "--plan", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and "\n" not in err


def test_cp_must_split_the_sequence_in_two_chunks_per_rank(tmp_path, capsys):
    # tiny-gpt: sequence 64; cp 2 needs 4 chunks (fine), so a 30-token model fails
    doc = edited(PLAN, model={"preset": "tiny-gpt", "seq_len": 30})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    assert main(["simulate", "--plan", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "stages[0].cp" in err and "2 x cp" in err and "\n" not in err
    with pytest.raises(BadInput):
        plan = plan_from_dict(doc)
        plan.check(plan.load_model(), plan.load_cluster())


@pytest.mark.parametrize("changes,field,reason", [
    ({}, "stages[1].cp", "cp=2 as in stage 0"),
    ({"zero": 3}, "stages[1].tp", "1 with zero 3"),
    ({"zero": 1, "runtime": {"shard": "memory"}}, "runtime.shard", "'even' for a real run")])
def test_executor_refuses_what_it_cannot_run(changes, field, reason, tmp_path, capsys):
    doc = edited(PLAN, **changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    assert main(["run", "--plan", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and reason in err and "\n" not in err


def test_simulate_builds_zero_and_cp_plans_from_flags(capsys):
    args = ["simulate", "--cluster", "demo-hetero", "--model", "tiny-gpt", "--pp", "2",
            "--micro-batch", "2", "--global-batch", "8", "--json"]
    assert main([*args, "--cp", "2", "--zero", "1"]) == 0
    cp_metrics = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert set(cp_metrics["peak_memory_bytes"]) == {"a100/0", "a100/1", "v100/0", "v100/1"}
    assert set(plain["peak_memory_bytes"]) == {"a100/0", "a100/1"}
    assert main([*args, "--cp", "3"]) != 0
    capsys.readouterr()
    assert main([*args, "--zero", "4"]) == 2
    assert "--zero" in capsys.readouterr().err
