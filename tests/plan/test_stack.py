"""The training stack as a plan input: `stack` and `runtime` parsed, defaulted, written,
refused with the field named (exit 2 on the command line), and the stacks' table."""

from __future__ import annotations

import json

import pytest
from plan_docs import edited

from hyperpipe.cli import main
from hyperpipe.core.errors import BadInput
from hyperpipe.plan.plan import load_plan, plan_from_dict
from hyperpipe.plan.stack import (
    DEFAULT_STACK,
    GRAD_REDUCE_DTYPES,
    P2P_KINDS,
    STACKS,
    Runtime,
    RuntimeOverrides,
    resolve_runtime,
)

PLAN = {
    "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
    "global_batch": 8, "schedule": {"kind": "1f1b", "chunks": 1},
    "pipelines": [{"micro_batch": 2, "num_microbatches": 4,
                   "stages": [{"layers": [0, 5], "devices": ["a100/0"], "tp": 1},
                              {"layers": [5, 8], "devices": ["v100/0"], "tp": 1}]}],
}


def test_absent_stack_is_megatron_lm_with_todays_runtime():
    plan = plan_from_dict(PLAN)
    assert plan.stack == DEFAULT_STACK == "megatron-lm"
    # today's behaviour: sends beside compute, buckets during the backward, the model
    # dtype's gradient rule
    assert plan.runtime_settings() == Runtime("async", True, None, ())


def test_the_stacks_say_what_their_frameworks_do():
    assert set(STACKS) == {"megatron-lm", "megatron-deepspeed", "torchtitan"}
    ds = STACKS["megatron-deepspeed"].runtime
    assert (ds.p2p, ds.overlap_grad_reduce) == ("blocking", False)
    assert ds.allreduce_sharded_grads == ("bf16",)
    tt = STACKS["torchtitan"].runtime
    assert (tt.p2p, tt.overlap_grad_reduce, tt.grad_reduce_dtype) == ("async", True, "fp32")
    for stack in STACKS.values():
        assert stack.runtime.p2p in P2P_KINDS and stack.source
        assert stack.runtime.grad_reduce_dtype in (None, *GRAD_REDUCE_DTYPES)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_stack_and_runtime_round_trip(stack, tmp_path):
    doc = {**PLAN, "stack": stack, "runtime": {"p2p": "async", "grad_reduce_dtype": "bf16"}}
    plan = plan_from_dict(doc)
    assert plan.to_dict() == doc
    plan.save(tmp_path / "p.json")
    again = load_plan(tmp_path / "p.json")
    assert again == plan
    rt = again.runtime_settings()
    assert (rt.p2p, rt.grad_reduce_dtype) == ("async", "bf16")
    # what the runtime does not give stays the stack's
    assert rt.overlap_grad_reduce == STACKS[stack].runtime.overlap_grad_reduce


def test_written_plans_carry_their_stack():
    assert plan_from_dict(PLAN).to_dict()["stack"] == "megatron-lm"
    assert "runtime" not in plan_from_dict(PLAN).to_dict()      # no overrides: none written
    moved = plan_from_dict(PLAN).on_stack("torchtitan", overlap_grad_reduce=False)
    assert moved.to_dict()["stack"] == "torchtitan"
    assert moved.to_dict()["runtime"] == {"overlap_grad_reduce": False}
    assert resolve_runtime("torchtitan", RuntimeOverrides(overlap_grad_reduce=False)) == \
        moved.runtime_settings()


@pytest.mark.parametrize("change,field", [
    ({"stack": "deepspeed"}, "stack"),
    ({"stack": 3}, "stack"),
    ({"runtime": {"p2p": "sync"}}, "runtime.p2p"),
    ({"runtime": {"overlap_grad_reduce": "yes"}}, "runtime.overlap_grad_reduce"),
    ({"runtime": {"grad_reduce_dtype": "fp16"}}, "runtime.grad_reduce_dtype"),
    ({"runtime": {"bucket": 1}}, "runtime.bucket"),
    ({"runtime": ["async"]}, "runtime"),
])
def test_bad_values_name_the_field(change, field):
    with pytest.raises(BadInput) as err:
        plan_from_dict(edited(PLAN, **change))
    assert str(err.value).startswith(f"plan.{field}: expected")


def test_bad_stack_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**PLAN, "runtime": {"p2p": "eventually"}}))
    assert main(["simulate", "--plan", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "runtime.p2p" in err and "eventually" in err
    assert main(["simulate", "--plan", str(path), "--stack", "jax"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--stack" in err


def test_search_writes_the_stack_it_planned_for(tmp_path, capsys):
    out = tmp_path / "best.json"
    assert main(["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                 "--global-batch", "8", "--stack", "megatron-deepspeed", "--top", "1",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    plan = load_plan(out)
    assert plan.stack == "megatron-deepspeed"
    assert plan.runtime_settings().p2p == "blocking"
