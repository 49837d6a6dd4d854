"""The torchtitan export writes the plan's own schedule as torchtitan's CSV
(``pipeline_parallel_schedule_csv``) for every schedule kind, and torch accepts it: its
runtime's ``_load_csv`` reads it (validating counts and order, inferring which rank holds
which stage) and lowers it with sends and receives, and torch's dry run of that lowered
schedule (``_add_send_recv``, ``_simulate_comms_compute``) finishes without a deadlock.
torch is a core dependency: this runs without the frameworks extra."""

from __future__ import annotations

import types

import pytest
from test_round_trip import plan_of
from torch.distributed.pipelining.schedules import (
    _add_send_recv,
    _PipelineScheduleRuntime,
    _simulate_comms_compute,
)

from hyperpipe.frameworks.export import export_files, torchtitan_schedule_class
from hyperpipe.plan.kinds import KINDS
from hyperpipe.plan.plan import pipeline_placement, schedule_for
from hyperpipe.plan.schedule import stage_rank


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kinds_csv_loads_and_dry_runs_in_torch(kind, tmp_path):
    plan = plan_of(kind, p=2, dp=1)
    files = export_files(plan, "torchtitan", "job.toml")
    assert 'pipeline_parallel_schedule_csv = "job.schedule.csv"' in files["job.toml"]
    path = tmp_path / "job.schedule.csv"
    path.write_text(files["job.schedule.csv"])
    ours = schedule_for(plan, 0)
    p, stages = ours.num_devices, ours.num_stages
    # a stand-in stage: the runtime's CSV path needs only the stage count and group size
    stage = types.SimpleNamespace(num_stages=stages, group_size=p, group_rank=0)
    runtime = _PipelineScheduleRuntime(stages=[stage], n_microbatches=ours.num_microbatches)
    runtime._load_csv(str(path), "compute_only")
    assert runtime.pipeline_order == ours.to_torch_actions()
    placement = pipeline_placement(plan, plan.pipelines[0])
    assert runtime.stage_index_to_group_rank == {k: stage_rank(k, p, placement)
                                                 for k in range(stages)}
    # torch's dry run of the compute actions with the sends and receives its lowering adds
    # (its FSDP unshard/reshard steps left out: the dry run knows no such action)
    to_rank = runtime.stage_index_to_group_rank.__getitem__
    lowered = _add_send_recv({r: list(row) for r, row in runtime.pipeline_order.items()},
                             stage_to_rank=to_rank, num_stages=stages)
    _simulate_comms_compute(lowered, to_rank, stages)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_named_class_places_stages_as_the_plan_does(kind):
    """torchtitan places V stages only under ZBVZeroBubble and DualPipeV
    (distributed/pipeline_parallel.py, pipeline_module_split); the class named beside the
    CSV must agree with the plan's placement."""
    plan = plan_of(kind, p=2, dp=1)
    name = torchtitan_schedule_class(plan)
    v_style = name in ("ZBVZeroBubble", "DualPipeV")
    assert v_style == (pipeline_placement(plan, plan.pipelines[0]) == "v")


def test_the_dry_run_catches_a_deadlocking_order():
    """The oracle can fail: rank 0 wants 0B0 (needs 1B0) before 0F1, rank 1 wants 1F1
    (needs 0F1) before 1B0."""
    from hyperpipe.plan.schedule import Schedule
    s = Schedule.from_text("0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1")
    with pytest.raises(AssertionError, match="can't schedule sends/recvs"):
        lowered = _add_send_recv({r: list(row) for r, row in s.to_torch_actions().items()},
                                 stage_to_rank=lambda k: k, num_stages=2)
        _simulate_comms_compute(lowered, lambda k: k, 2)
