"""Hostile numbers (issue 16), a generated corpus: every numeric field of a plan (with its
inline model and cluster), a profile and a trace is replaced in turn by a 400-digit
integer, NaN, +-Infinity, 1e308, 5e-324, -1, 0 and 10^12. Each case must end with exit 0
or 2, one line, no traceback; when it exits 0, every number it prints is finite (no NaN
metrics from extreme but finite values)."""

from __future__ import annotations

import copy
import json
import math

import pytest
from hostile import (
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
    temp_files,
)

CLUSTER = {
    "device_types": {"fast": {"peak_flops": "1 TFLOP/s", "efficiency": 0.5, "memory": "80 GB",
                              "mem_bandwidth": 1e12}},
    "nodes": [{"name": "a", "device": "fast", "count": 2,
               "intra_link": {"bandwidth": "100 GB/s", "latency": 2e-6}, "price_per_hour": 2.0},
              {"name": "b", "device": "A100-80GB", "count": 1, "repeat": 2}],
    "inter_node": {"bandwidth": 1.25e10, "latency": 5e-6}}
MODEL = {"kind": "synthetic", "layers": 4, "fwd_flops_per_sample": 1e9,
         "activation_bytes_per_sample": 1e6, "params_per_layer": 1000, "seq_len": 16}
PLAN = {"format": "hyperpipe.plan/1", "model": MODEL, "cluster": CLUSTER, "global_batch": 4,
        "schedule": {"kind": "1f1b", "chunks": 1},
        "pipelines": [{"micro_batch": 1, "num_microbatches": 4,
                       "stages": [{"layers": [0, 2], "devices": ["a/0"], "tp": 1},
                                  {"layers": [2, 4], "devices": ["a/1"], "tp": 1}]}]}
FIT = {"a_s": 1e-5, "b_s_per_unit": 1e-3, "samples": 4, "rel_rmse": 0.01}
PROFILE = {"format": "hyperpipe.profile/1",
           "compute": {f"fast|synthetic|{op}": dict(FIT) for op in "FIWB"},
           "links": {"intra:a": {"bandwidth_bytes_per_s": 1e11, "latency_s": 2e-6}},
           "allreduce": {"*": dict(FIT)}, "overhead": {"fast|F": 1e-5}}

BAD = {"400-digits": 10**400, "nan": math.nan, "inf": math.inf, "-inf": -math.inf,
       "1e308": 1e308, "5e-324": 5e-324, "-1": -1, "0": 0, "1e12": 10**12}
BAD_QUANTITY = {"q-400-digits": "1" + "0" * 400 + " GB", "q-nan": "nan GB",
                "q-1e308": "1e308 TB/s", "q-5e-324": "5e-324 GB"}


def numeric_leaves(doc, path=()):
    """Paths of every number (not bool) and every quantity string in `doc`."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from numeric_leaves(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from numeric_leaves(v, (*path, i))
    elif isinstance(doc, (int, float)) and not isinstance(doc, bool):
        yield path, "number"
    elif isinstance(doc, str) and doc[:1].isdigit():
        yield path, "quantity"


def mutated(doc, path, value):
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def cases(doc):
    for path, kind in numeric_leaves(doc):
        name = ".".join(map(str, path))
        for label, value in (BAD if kind == "number" else {**BAD, **BAD_QUANTITY}).items():
            yield pytest.param(path, value, id=f"{name}={label}")


def all_finite(obj) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(all_finite(v) for v in obj.values())
    if isinstance(obj, list):
        return all(all_finite(v) for v in obj)
    return True


def check(rc, out, err):
    if rc == 0:
        assert err.strip() == "" or "Traceback" not in err
        assert all_finite(json.loads(out)), out[:400]
    else:
        assert_one_line(rc, err, 2)


@pytest.mark.parametrize("path,value", list(cases(PLAN)))
def test_plan_numbers(path, value, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(mutated(PLAN, path, value)))
    check(*cli(capsys, ["simulate", "--plan", plan, "--json"]))


@pytest.mark.parametrize("path,value", list(cases(PROFILE)))
def test_profile_numbers(path, value, tmp_path, capsys):
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(mutated(PROFILE, path, value)))
    check(*cli(capsys, ["simulate", "--plan", tmp_path / "plan.json", "--profile", prof,
                        "--json"]))


@pytest.fixture(scope="module")
def two_step_trace(tmp_path_factory) -> dict:
    """A simulated trace of PLAN, its step repeated as step 1 (calibration skips step 0),
    passed off as measured (calibrate refuses a simulated one, whatever its numbers)."""
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


TRACE_FIELDS = {"stage": 2, "microbatch": 3, "start": 4, "end": 5, "bytes": 6, "step": 8}


@pytest.mark.parametrize("label", list(BAD))
@pytest.mark.parametrize("field", list(TRACE_FIELDS))
def test_trace_numbers(field, label, two_step_trace, tmp_path, capsys):
    doc = copy.deepcopy(two_step_trace)
    last = len(doc["events"]) - 1                    # a compute event of step 1
    doc["events"][last][TRACE_FIELDS[field]] = BAD[label]
    (tmp_path / "t.json").write_text(json.dumps(doc))
    rc, out, err = cli(capsys, ["calibrate", "--trace", tmp_path / "t.json",
                                "--out", tmp_path / "p.json"])
    if rc == 0:
        profile = json.loads((tmp_path / "p.json").read_text(),
                             parse_constant=lambda c: pytest.fail(f"{c} in the profile"))
        assert all_finite(profile)
    else:
        assert_one_line(rc, err, 2, "t.json")
    assert temp_files(tmp_path) == []


def test_the_unmutated_documents_are_valid(two_step_trace, tmp_path, capsys):
    """The corpus mutates working documents: each passes as written."""
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    rc, out, err = cli(capsys, ["simulate", "--plan", tmp_path / "plan.json", "--profile",
                                tmp_path / "profile.json", "--json"])
    assert rc == 0, err
    assert json.loads(out)["iteration_time_s"] > 0
    (tmp_path / "t.json").write_text(json.dumps(two_step_trace))
    rc, _, err = cli(capsys, ["calibrate", "--trace", tmp_path / "t.json", "--out",
                              tmp_path / "p.json"])
    assert rc == 0, err


@pytest.mark.parametrize("vary", [
    "inter_node.bandwidth=5e-324", "inter_node.latency=1e308", "nodes.0.count=1000000000",
    "nodes.0.count=0", "global_batch=0", "global_batch=1000000000000",
    "model.seq_len=" + "9" * 400, "device_types.x.peak_flops=nan",
    "inter_node.bandwidth=-1 Gbit/s"])
def test_whatif_vary_numbers(vary, capsys):
    rc, out, err = cli(capsys, ["whatif", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                                "--global-batch", "4", "--vary", vary, "--json"])
    check(rc, out, err)
