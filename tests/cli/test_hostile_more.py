"""Hostile input (issue 33, case 7 and part of 18): what used to end in a traceback (exit 1)
ends in one line and exit 2. A digit string past Python's int-string limit in a synth
action, a Unicode digit where an integer is parsed, failure rates that overflow the
goodput model, a model of no work, slowdowns outside [1, 10^6], a negative profile
overhead, a trace event of a device or stage its plan lacks."""

from __future__ import annotations

import copy
import json

import pytest
from hostile import (
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
)

CLUSTER = {
    "device_types": {"fast": {"peak_flops": "1 TFLOP/s", "efficiency": 0.5, "memory": "80 GB",
                              "mem_bandwidth": 1e12}},
    "nodes": [{"name": "a", "device": "fast", "count": 2,
               "intra_link": {"bandwidth": "100 GB/s", "latency": 2e-6}}]}
MODEL = {"kind": "synthetic", "layers": 4, "fwd_flops_per_sample": 1e9,
         "activation_bytes_per_sample": 1e6, "params_per_layer": 1000, "seq_len": 16,
         "hidden": 8}
PLAN = {"format": "hyperpipe.plan/1", "model": MODEL, "cluster": CLUSTER, "global_batch": 4,
        "schedule": {"kind": "1f1b", "chunks": 1},
        "pipelines": [{"micro_batch": 1, "num_microbatches": 4,
                       "stages": [{"layers": [0, 2], "devices": ["a/0"], "tp": 1},
                                  {"layers": [2, 4], "devices": ["a/1"], "tp": 1}]}]}
SYNTH_ACTIONS = {"a/0": ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
                 "a/1": ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]}
FIT = {"a_s": 1e-5, "b_s_per_unit": 1e-15, "samples": 4, "rel_rmse": 0.01}
PROFILE = {"format": "hyperpipe.profile/1",
           "compute": {f"fast|synthetic|{op}": dict(FIT) for op in "FIWB"},
           "allreduce": {"*": dict(FIT)}, "overhead": {"fast|F": -1.0}}
SWEEP = ["--global-batch", "4", "--vary", "global_batch=4"]


def _write(tmp_path, name: str, doc) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def _synth_plan(tmp_path, action: str) -> str:
    plan = copy.deepcopy(PLAN)
    actions = copy.deepcopy(SYNTH_ACTIONS)
    actions["a/0"][0] = action
    plan["schedule"] = {"kind": "synth", "chunks": 1, "actions": actions}
    return _write(tmp_path, "plan.json", plan)


def _files(tmp_path, cluster=None, model=None) -> tuple[str, str]:
    return (_write(tmp_path, "cluster.json", cluster or CLUSTER),
            _write(tmp_path, "model.json", model or MODEL))


HUGE_ACTIONS = {"5000-digit-microbatch": "0F" + "1" * 5000,
                "5000-digit-stage": "9" * 5000 + "F0",
                "arabic-indic-digit": "0F\u0663"}
COMMANDS = {
    "simulate": lambda p, c, m: ["simulate", "--plan", p],
    "run": lambda p, c, m: ["run", "--plan", p, "--steps", "1"],
    "schedule": lambda p, c, m: ["schedule", "--kind", "synth", "--plan", p],
    "export": lambda p, c, m: ["export", "--plan", p, "--to", "megatron"],
    "whatif": lambda p, c, m: ["whatif", "--plan", p, "--cluster", c, "--model", m, *SWEEP],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("action", HUGE_ACTIONS.values(), ids=HUGE_ACTIONS)
def test_synth_action_digits_are_bounded(command, action, tmp_path, capsys):
    argv = COMMANDS[command](_synth_plan(tmp_path, action), *_files(tmp_path))
    assert_one_line(*cli(capsys, argv)[::2], 2, "schedule.actions")


def test_synth_plan_with_small_numbers_still_simulates(tmp_path, capsys):
    rc, out, err = cli(capsys, ["simulate", "--plan", _synth_plan(tmp_path, "0F0")])
    assert rc == 0, err


SLOWDOWNS = {"unicode-index": {"\u00b2": 2.0}, "superscript-index-9": {"\u2079": 2.0},
             "1e-300": 1e-300, "1e308": 1e308, "half": 0.5, "index-1e-300": {"1": 1e-300},
             "index-1e7": {"0": 1e7}}


@pytest.mark.parametrize("slowdown", SLOWDOWNS.values(), ids=SLOWDOWNS)
def test_slowdown_is_an_index_and_a_factor_in_range(slowdown, tmp_path, capsys):
    cluster = copy.deepcopy(CLUSTER)
    cluster["nodes"][0]["slowdown"] = slowdown
    c, m = _files(tmp_path, cluster)
    rc, _, err = cli(capsys, ["search", "--cluster", c, "--model", m, "--global-batch", "4"])
    assert_one_line(rc, err, 2, "nodes[0].slowdown")


def test_slowdown_in_range_still_searches(tmp_path, capsys):
    cluster = copy.deepcopy(CLUSTER)
    cluster["nodes"][0]["slowdown"] = {"1": 1e6}
    c, m = _files(tmp_path, cluster)
    rc, _, err = cli(capsys, ["search", "--cluster", c, "--model", m, "--global-batch", "4"])
    assert rc == 0, err


def test_vary_slowdown_out_of_range(tmp_path, capsys):
    c, m = _files(tmp_path)
    rc, _, err = cli(capsys, ["whatif", "--cluster", c, "--model", m, "--global-batch", "4",
                              "--vary", "nodes.a.slowdown=1e-300"])
    assert_one_line(rc, err, 2, "slowdown")


@pytest.mark.parametrize("path", ["nodes.\u00b2.count=1,2", "nodes.\u0661.count=1,2",
                                  "nodes." + "9" * 5000 + ".count=1,2"],
                         ids=["superscript", "arabic-indic", "5000-digits"])
def test_vary_node_position_is_ascii(path, tmp_path, capsys):
    c, m = _files(tmp_path)
    rc, _, err = cli(capsys, ["whatif", "--cluster", c, "--model", m, "--global-batch", "4",
                              "--vary", path])
    assert_one_line(rc, err, 2)


@pytest.mark.parametrize("fault", ["\u00b2:0", "0:\u00b2", "\u0661:0"])
def test_inject_fault_digits_are_ascii(fault, tmp_path, capsys):
    plan = _write(tmp_path, "plan.json", PLAN)
    rc, _, err = cli(capsys, ["run", "--plan", plan, "--steps", "1", "--inject-fault", fault])
    assert_one_line(rc, err, 2, "--inject-fault")


FAILURES = {
    "mtbf-1ns": ["--mtbf", "1 ns", "--restart-time", "10 min"],
    "mtbf-100ms": ["--mtbf", "100 ms", "--restart-time", "10 min"],
    "mtbf-1min-restart-1day": ["--mtbf", "1 min", "--restart-time", "1 day"],
    "huge-restart": ["--mtbf", "1 day", "--restart-time", "1e9 s"],
    "huge-write": ["--mtbf", "1 day", "--restart-time", "10 min",
                   "--checkpoint-write-time", "1e9 s"],
    # restart and write take no time, but one iteration lasts thousands of MTBFs
    "iteration-over-mtbf": ["--mtbf", "1 us", "--restart-time", "1 ns",
                            "--checkpoint-write-time", "1 ns"],
}


@pytest.mark.parametrize("flags", FAILURES.values(), ids=FAILURES)
def test_failures_that_overflow_goodput(flags, tmp_path, capsys):
    c, m = _files(tmp_path)
    # a write time given is the write time: no storage bandwidth beside it
    storage = [] if "--checkpoint-write-time" in flags else ["--storage-bandwidth", "20 GB/s"]
    rc, _, err = cli(capsys, ["whatif", "--cluster", c, "--model", m, "--global-batch", "4",
                              "--failures", *storage, *flags])
    assert_one_line(rc, err, 2, "never trains")


def test_cluster_mtbf_of_a_nanosecond(tmp_path, capsys):
    cluster = copy.deepcopy(CLUSTER)
    cluster["nodes"][0]["mtbf"] = "1 ns"
    c, m = _files(tmp_path, cluster)
    rc, _, err = cli(capsys, ["whatif", "--cluster", c, "--model", m, "--global-batch", "4",
                              "--failures", "--storage-bandwidth", "20 GB/s",
                              "--restart-time", "10 min"])
    assert_one_line(rc, err, 2, "never trains")


def test_goodput_far_past_the_mtbf_is_zero_not_an_overflow():
    from hyperpipe.whatif.goodput import Checkpointing, best_interval_s, expected_goodput
    ckpt = Checkpointing(write_s=10.0, restart_s=600.0)
    assert expected_goodput(1e9, ckpt, 86400.0) == 0.0
    assert expected_goodput(10.0, Checkpointing(10.0, 86400.0), 1e-9) == 0.0
    assert 0.0 < best_interval_s(ckpt, 1e-9) < 1.0
    # unchanged where the plain formula holds
    assert expected_goodput(1000.0, ckpt, 86400.0) == pytest.approx(0.97751134942769)


NO_WORK = {"zero-everything": {"fwd_flops_per_sample": 0, "activation_bytes_per_sample": 0,
                               "params_per_layer": 0},
           "zero-rows": {"fwd_flops_per_sample": 0, "activation_bytes_per_sample": 0,
                         "params_per_layer": 0, "layers": [{}, {}, {}]}}


@pytest.mark.parametrize("command", ["search", "whatif"])
@pytest.mark.parametrize("changes", NO_WORK.values(), ids=NO_WORK)
def test_model_of_no_work(command, changes, tmp_path, capsys):
    model = {k: v for k, v in MODEL.items() if k != "hidden"} | changes
    c, m = _files(tmp_path, model=model)
    argv = [command, "--cluster", c, "--model", m, "--global-batch", "4"]
    rc, _, err = cli(capsys, argv + (["--vary", "global_batch=4,8"] if command == "whatif"
                                     else []))
    assert_one_line(rc, err, 2, "layers")


def test_model_of_some_work_still_searches(tmp_path, capsys):
    model = {k: v for k, v in MODEL.items() if k != "hidden"} | {
        "fwd_flops_per_sample": 0, "activation_bytes_per_sample": 0}
    c, m = _files(tmp_path, model=model)
    rc, _, err = cli(capsys, ["search", "--cluster", c, "--model", m, "--global-batch", "4"])
    assert rc == 0, err


@pytest.mark.parametrize("overhead", [-1.0, -1e-9, True, "1 ms"])
def test_profile_overhead_is_a_non_negative_number(overhead, tmp_path, capsys):
    plan = _write(tmp_path, "plan.json", PLAN)
    prof = _write(tmp_path, "profile.json", PROFILE | {"overhead": {"fast|F": overhead}})
    rc, _, err = cli(capsys, ["simulate", "--plan", plan, "--profile", prof])
    assert_one_line(rc, err, 2, "overhead")


@pytest.fixture(scope="module")
def two_step_trace(tmp_path_factory) -> dict:
    """A simulated trace of PLAN, its step repeated as step 1 (calibration skips step 0),
    standing in for a measured one (calibration refuses a simulated `meta.source`)."""
    from hyperpipe.plan.plan import plan_from_dict
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate
    plan = plan_from_dict(copy.deepcopy(PLAN))
    path = tmp_path_factory.mktemp("trace") / "t0.json"
    simulate(plan, CostModel(plan.load_model(), plan.load_cluster())).trace.save(path)
    doc = json.loads(path.read_text())
    end = max(e[5] for e in doc["events"])
    doc["events"] += [[*e[:4], e[4] + end, e[5] + end, *e[6:8], 1] for e in doc["events"]]
    doc["meta"]["source"] = "measured"
    return doc


def _edit_event(doc: dict, op: str, column: int, value, step: int = 1) -> dict:
    out = copy.deepcopy(doc)
    row = next(e for e in out["events"] if e[1] == op and e[8] == step)
    row[column] = value
    if op == "send":
        row[8] = -1            # a probe: its link class is looked up
    return out


TRACE_EDITS = {"negative-stage": ("F", 2, -1), "stage-beyond": ("B", 2, 7),
               "other-rank-stage": ("F", 2, 1), "unknown-device": ("F", 0, "zz/9"),
               "unknown-device-optimizer": ("optimizer", 0, "zz/9"),
               "unknown-peer": ("send", 7, "zz/9")}


@pytest.mark.parametrize("edit", TRACE_EDITS.values(), ids=TRACE_EDITS)
def test_trace_event_outside_its_plan(edit, two_step_trace, tmp_path, capsys):
    trace = _write(tmp_path, "trace.json", _edit_event(two_step_trace, *edit))
    rc, _, err = cli(capsys, ["calibrate", "--trace", trace, "--out", tmp_path / "p.json"])
    assert_one_line(rc, err, 2, "events[")
    assert not (tmp_path / "p.json").exists()


def test_trace_of_its_plan_still_calibrates(two_step_trace, tmp_path, capsys):
    trace = _write(tmp_path, "trace.json", two_step_trace)
    rc, _, err = cli(capsys, ["calibrate", "--trace", trace, "--out", tmp_path / "p.json"])
    assert rc == 0, err
