"""What a sweep's inputs mean: the profile checked per variant as `search` checks it,
`--vary` paths into fields that hold one value or a table, default node names, units,
booleans, `--pool` by the resolved device type, and a bad `--plot` refused up front.

Oracles: `check_profile` (what `search` refuses); the cluster loaded from the document
written out by hand; the model loaded with the field overridden; a sweep of one value
against a sweep of the same value written another way.
"""

from __future__ import annotations

import json

import pytest
from factories import FREE_LINK, cluster_doc, device_type

from hyperpipe.cli import main
from hyperpipe.cluster.cluster import cluster_from_dict, load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.plan.profile import model_fingerprint, profile_from_dict
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.whatif import sweep as sweep_module
from hyperpipe.whatif.sweep import Planning, SweepOptions, set_path, whatif

MODEL = {"kind": "synthetic", "name": "sweep", "layers": 8, "seq_len": 1,
         "fwd_flops_per_sample": 1.0e10, "activation_bytes_per_sample": 1.0e6,
         "params_per_layer": 0}
PLANNING = Planning(global_batch=8, micro_batch=1)


def _cluster() -> dict:
    return cluster_doc(
        {"fast": device_type("2 TFLOP/s", memory="100 GB", mem_bandwidth="1e15 B/s"),
         "slow": device_type("1 TFLOP/s", memory="100 GB", mem_bandwidth="1e15 B/s")},
        [("a", "fast", 2), ("b", "slow", 2)], intra_link=FREE_LINK,
        inter_node={"bandwidth": "1e15 B/s", "latency": 0}, name="two-nodes")


def _profile(spec):
    """A profile measured on `spec`, for the types fast and slow: 1 ms per forward."""
    fit = {"a_s": 1e-3, "b_s_per_unit": 0.0}
    return profile_from_dict({
        "format": "hyperpipe.profile/1",
        "provenance": {"model": spec.name, "model_fingerprint": model_fingerprint(spec)},
        "compute": {f"{t}|synthetic|{op}": fit for t in ("fast", "slow") for op in "FB"}},
        where="p.json")


# ------------------------------------------------------------------ profile per variant

@pytest.mark.parametrize("vary,needle", [
    ("model.layers=8,4", "(vary model.layers=4): expected a profile measured on model "
     "sweep"),
    ("nodes.b.device=slow,T4", "(vary nodes.b.device=T4): compute: expected entries for "
     "every device type used")])
def test_a_profile_is_refused_for_a_variant_it_was_not_measured_for(vary, needle):
    spec = load_model(MODEL)
    profile = _profile(spec)
    with pytest.raises(BadInput, match="^profile " + needle.replace("(", r"\(")
                       .replace(")", r"\)")):
        whatif(spec, load_cluster(_cluster()), SweepOptions(PLANNING, vary=(vary,)),
               profile=profile)
    # allowed: every variant priced as before, the profile's fits where they apply
    res = whatif(spec, load_cluster(_cluster()), SweepOptions(PLANNING, vary=(vary,)),
                 profile=profile, allow_profile_mismatch=True)
    first = res.rows[0].best
    assert len(res.rows) == 2 and all(r.best is not None for r in res.rows)
    # the first variant is the file as given: the profile's 1 ms per forward prices it
    cost = CostModel(spec, load_cluster(_cluster()), profile)
    stage = first.plan.pipelines[0].stages[0]
    assert cost.stage_time_s(stage.layers, stage.devices, 1, "F") == pytest.approx(
        1e-3 * (stage.layers[1] - stage.layers[0]), rel=1e-9)


def test_whatif_cli_refuses_a_profile_for_another_variant_unless_allowed(tmp_path, capsys):
    spec = load_model(MODEL)
    (tmp_path / "c.json").write_text(json.dumps(_cluster()))
    (tmp_path / "m.json").write_text(json.dumps(MODEL))
    profile = tmp_path / "p.json"
    fit = {"a_s": 1e-3, "b_s_per_unit": 0.0}
    profile.write_text(json.dumps({
        "format": "hyperpipe.profile/1",
        "provenance": {"model": "sweep", "model_fingerprint": model_fingerprint(spec)},
        "compute": {f"{t}|synthetic|F": fit for t in ("fast", "slow")}}))
    base = ["whatif", "--cluster", str(tmp_path / "c.json"), "--model",
            str(tmp_path / "m.json"), "--global-batch", "8", "--micro-batch", "1",
            "--profile", str(profile), "--vary", "model.layers=8,4", "--json"]
    assert main(base) == 2
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert out == "" and len(err) == 1 and f"--profile {profile} (vary model.layers=4)" \
        in err[0] and "--allow-profile-mismatch" in err[0], err
    assert main([*base, "--allow-profile-mismatch"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["settings"] for r in rows] == [{"model.layers": "8"}, {"model.layers": "4"}]


# ------------------------------------------------ fields of one value or a table of them

def _one_row(doc: dict, vary: str):
    res = whatif(load_model(MODEL), load_cluster(doc), SweepOptions(PLANNING, vary=(vary,)))
    (row,) = res.rows
    return row


def test_slowdown_varied_whole_or_per_device():
    doc = _cluster()
    doc["nodes"][0]["slowdown"] = {1: 4.0}
    # whole: one number for every device of the node, the table gone
    d = json.loads(json.dumps(doc))
    set_path(d, "nodes.a.slowdown", "2.0")
    assert d["nodes"][0]["slowdown"] == 2.0
    # an entry: the others keep theirs
    d = json.loads(json.dumps(doc))
    set_path(d, "nodes.a.slowdown.0", "3")
    assert d["nodes"][0]["slowdown"] == {"0": 3, "1": 4.0}
    # an entry of one number: the number per device first
    d = json.loads(json.dumps(doc))
    d["nodes"][0]["slowdown"] = 1.5
    set_path(d, "nodes.a.slowdown.1", "3")
    assert d["nodes"][0]["slowdown"] == {"0": 1.5, "1": 3}
    # both forms run, and price the devices as the document written out by hand
    for vary, want in (("nodes.a.slowdown=2.0", [2.0, 2.0]),
                       ("nodes.a.slowdown.0=3", [3.0, 4.0])):
        row = _one_row(doc, vary)
        by_hand = cluster_from_dict({**doc, "nodes": [
            {**doc["nodes"][0], "slowdown": dict(enumerate(want))}, doc["nodes"][1]]},
            where="c", name="two-nodes")
        assert [by_hand.device(f"a/{i}").slowdown for i in range(2)] == want
        assert row.best.metrics.iteration_time_s == pytest.approx(
            sweep_module.simulate_on(row.best.plan, CostModel(
                load_model(MODEL), by_hand)).metrics.iteration_time_s, rel=1e-12)


def test_peak_flops_varied_whole_or_per_dtype():
    doc = {"nodes": [{"name": "a", "device": "A100-80GB", "count": 1}]}
    base = load_cluster(doc).device_types["A100-80GB"]
    d = json.loads(json.dumps(doc))
    set_path(d, "device_types.A100-80GB.peak_flops.fp32", "10 TFLOP/s",
             cluster=load_cluster(doc))
    c = cluster_from_dict(d, where="c", name="c")
    t = c.device_types["A100-80GB"]
    assert t.peak_for("fp32") == pytest.approx(10e12)
    for dtype in ("bf16", "fp16", "tf32"):          # the other dtypes keep the catalog's
        assert t.peak_for(dtype) == pytest.approx(base.peak_for(dtype), rel=1e-12)
    # a table varied whole: one quantity instead
    d = {"device_types": {"f": {"peak_flops": {"fp32": "1 TFLOP/s", "bf16": "4 TFLOP/s"},
                                "memory": "10 GB"}},
         "nodes": [{"name": "a", "device": "f", "count": 1}]}
    set_path(d, "device_types.f.peak_flops", "8 TFLOP/s")
    assert d["device_types"]["f"]["peak_flops"] == "8 TFLOP/s"
    # both paths pass the sweep's check and name their entry in errors
    rows = whatif(load_model(MODEL), load_cluster(d), SweepOptions(PLANNING, vary=(
        "device_types.f.peak_flops.bf16=2 TFLOP/s,4 TFLOP/s",))).rows
    t2, t4 = (r.best.metrics.iteration_time_s for r in rows)
    assert t2 == pytest.approx(2 * t4, rel=1e-6)         # compute only: half the peak
    with pytest.raises(BadInput, match="^vary device_types.f.peak_flops.fp64: expected a "
                       "path that ends at device_types.f.peak_flops .*table \\(a dtype: fp32"):
        whatif(load_model(MODEL), load_cluster(d), SweepOptions(PLANNING, vary=(
            "device_types.f.peak_flops.fp64=1 TFLOP/s",)))
    with pytest.raises(BadInput, match="a value with a unit, e.g. "
                       "'device_types.f.peak_flops.fp32=312 TFLOP/s'"):
        whatif(load_model(MODEL), load_cluster(d), SweepOptions(PLANNING, vary=(
            "device_types.f.peak_flops.fp32=10",)))


def test_a_field_and_an_entry_of_its_table_are_one_field(capsys):
    doc = _cluster()
    with pytest.raises(BadInput, match="--vary nodes.a.slowdown sets it already"):
        whatif(load_model(MODEL), load_cluster(doc), SweepOptions(PLANNING, vary=(
            "nodes.a.slowdown=2", "nodes.a.slowdown.1=3")))


# ------------------------------------------------------ names, units, booleans, pool, plot

def test_default_node_names_are_paths_of_a_sweep():
    doc = _cluster()
    for node in doc["nodes"]:
        del node["name"]
    res = whatif(load_model(MODEL), load_cluster(doc), SweepOptions(
        PLANNING, vary=("nodes.n1.count=0,2",)))
    assert [r.devices for r in res.rows] == [2, 4]
    assert {d.split("/")[0] for d in res.rows[0].best.plan.devices} == {"n0"}


@pytest.mark.parametrize("path,example", [
    ("device_types.fast.runtime_reserve", "2 GB"),
    ("device_types.fast.price_per_hour", "1.5 $/h"),
    ("nodes.a.price_per_hour", "1.5 $/h")])
def test_dimensioned_fields_need_their_unit(path, example):
    with pytest.raises(BadInput, match=f"^vary {path}: expected a value with a unit, e.g. "
                       f"'{path}={example.replace('$', '[$]')}', got '2'"):
        whatif(load_model(MODEL), load_cluster(_cluster()), SweepOptions(
            PLANNING, vary=(f"{path}=2,4",)))
    # with the unit the field takes it
    doc = json.loads(json.dumps(_cluster()))
    set_path(doc, path, example)
    c = cluster_from_dict(doc, where="c", name="c")
    if path.endswith("runtime_reserve"):
        assert c.device_types["fast"].runtime_reserve_bytes == 2e9
    else:
        assert c.price_per_hour("a/0") == 1.5


def test_boolean_fields_can_be_varied():
    res = whatif(load_model("tiny-gpt"), load_cluster("demo-hetero"), SweepOptions(
        Planning(global_batch=8, micro_batch=1), vary=("model.tie_embeddings=true,false",)))
    tied, untied = (r.best.plan for r in res.rows)
    assert load_model("tiny-gpt", overrides={"tie_embeddings": True}).params < \
        load_model("tiny-gpt", overrides={"tie_embeddings": False}).params
    assert [dict(r.settings) for r in res.rows] == [{"model.tie_embeddings": "true"},
                                                   {"model.tie_embeddings": "false"}]
    assert tied is not None and untied is not None
    doc = load_cluster("demo-hetero").source
    doc = json.loads(json.dumps(doc))
    set_path(doc, "nodes.0.peer_to_peer", "false")
    assert doc["nodes"][0]["peer_to_peer"] is False


def test_pool_takes_a_device_spelled_as_an_alias():
    doc = {"nodes": [{"name": "a100", "device": "a100 80gb", "count": 2},
                     {"name": "v100", "device": "Tesla V100-SXM2-32GB", "count": 2}],
           "inter_node": {"bandwidth": "10 Gbit/s", "latency": "10 us"}}
    res = whatif(load_model(MODEL), load_cluster(doc), SweepOptions(PLANNING, pool=True))
    assert [(dict(r.settings)["use"], r.devices) for r in res.rows] == [
        ("A100-80GB+V100-32GB", 4), ("A100-80GB", 2), ("V100-32GB", 2)]
    assert {d.split("/")[0] for d in res.rows[1].best.plan.devices} == {"a100"}


def test_a_bad_plot_format_is_refused_before_the_sweep(tmp_path, capsys, monkeypatch):
    def no_sweep(*args, **kwargs):
        raise AssertionError("the sweep ran")
    monkeypatch.setattr(sweep_module, "whatif", no_sweep)
    rc = main(["whatif", "--cluster", "demo-hetero", "--model", "tiny-gpt",
               "--global-batch", "8", "--vary", "inter_node.bandwidth=1 Gbit/s",
               "--plot", str(tmp_path / "out.jpg")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "out.jpg: expected a figure file ending in .png" \
        in err[0], err
    assert not (tmp_path / "out.jpg").exists()
