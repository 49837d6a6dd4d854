"""What a sweep's inputs mean: the profile checked per variant as `search` checks it,
`--vary` paths into fields that hold one value or a table, default node names, units,
booleans, `--pool` by the resolved device type, and a bad `--plot` refused up front.

Oracles: `check_profile` (what `search` refuses); the cluster loaded from the document
written out by hand; the model loaded with the field overridden; a sweep of one value
against a sweep of the same value written another way.
"""

from __future__ import annotations

import json
import re

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


# ------------------------------------------------- what a profile's fits price instead

def _linked_profile(spec, links: dict[str, float]):
    """`_profile(spec)` with fitted links: class -> bandwidth (bytes/s), 10 us each."""
    profile = _profile(spec)
    doc = profile.to_dict()
    doc["links"] = {k: {"bandwidth_bytes_per_s": bw, "latency_s": 1e-5}
                    for k, bw in links.items()}
    return profile_from_dict(doc, where="p.json")


def _doc_with_paths() -> dict:
    """`_cluster()` with region paths, NICs, and node b's intra link left to its type."""
    doc = _cluster()
    doc["links"] = [{"between": ["a", "b"], "bandwidth": "10 Gbit/s"}]
    doc["nodes"][0]["nics"] = {"count": 2, "bandwidth": "100 Gbit/s"}
    del doc["nodes"][1]["intra_link"]
    return doc


@pytest.mark.parametrize("links,vary,fit", [
    ({"inter": 1e9}, "inter_node.bandwidth=1 Gbit/s,100 Gbit/s", "inter"),
    ({"*": 1e9}, "inter_node.latency=1 us,1 ms", "*"),
    ({"inter": 1e9}, "nodes.a.nic.bandwidth=1 Gbit/s,100 Gbit/s", "inter"),
    ({"inter": 1e9}, "nodes.a.nics.bandwidth=1 Gbit/s,100 Gbit/s", "inter"),
    ({"inter": 1e9}, "nodes.a.nics.latency=1 us,1 ms", "inter"),
    ({"inter": 1e9}, "links.0.bandwidth=1 Gbit/s,100 Gbit/s", "inter"),
    ({"intra:a": 1e9}, "nodes.a.intra_link.bandwidth=1 GB/s,100 GB/s", "intra:a"),
    ({"*": 1e9}, "nodes.1.intra_link.latency=1 us,1 ms", "*"),
    # node b's intra link is its type's
    ({"intra:b": 1e9}, "device_types.slow.link_bandwidth=1 GB/s,100 GB/s", "intra:b")])
def test_a_sweep_of_what_a_fitted_link_prices_is_refused(links, vary, fit):
    """A fitted link replaces the bandwidth and latency of every route of its class
    (`CostModel.route`): a sweep of them beside it printed identical rows (and named the
    slowest value fastest). Refused before any search, naming the path and the fit."""
    spec = load_model(MODEL)
    key = vary.split("=", 1)[0]
    routes = "between nodes" if key.split(".")[0] in ("inter_node", "links") or \
        ".nic" in key else f"inside node {'a' if '.a.' in key else 'b'}"
    with pytest.raises(BadInput, match=f"^vary {re.escape(key)}: expected a field that "
                       f"profile does not fit: its fitted link for the routes {routes} "
                       f"{re.escape(f'(links.{fit}) prices them')}"):
        whatif(spec, load_cluster(_doc_with_paths()), SweepOptions(PLANNING, vary=(vary,)),
               profile=_linked_profile(spec, links))


@pytest.mark.parametrize("vary", [
    "device_types.slow.peak_flops=1 TFLOP/s,4 TFLOP/s",
    "device_types.slow.peak_flops.fp32=1 TFLOP/s,4 TFLOP/s",
    "device_types.fast.efficiency=0.5,1.0",
    "device_types.fast.mem_bandwidth=1 TB/s,2 TB/s"])
def test_a_sweep_of_what_compute_fits_price_is_refused(vary):
    """A device type's compute fits price its layers in place of its peak, efficiency
    and memory bandwidth (`CostModel.layer_time_s`): refused beside them, whatever
    `allow_profile_mismatch` says (it is about what the profile was measured on)."""
    spec = load_model(MODEL)
    key = vary.split("=", 1)[0]
    dtype = key.split(".")[1]
    for allow in (False, True):
        with pytest.raises(BadInput, match=f"^vary {key}: expected a field that profile "
                           f"does not fit: its compute fits of device type {dtype} "):
            whatif(spec, load_cluster(_cluster()), SweepOptions(PLANNING, vary=(vary,)),
                   profile=_profile(spec), allow_profile_mismatch=allow)


@pytest.mark.parametrize("vary", [
    "nodes.b.slowdown=1,4",                        # stretches the fitted times
    "nodes.b.count=1,2",
    "nodes.a.nics.count=1,2",                      # how routes share the NICs
    "nodes.a.intra_link.bandwidth=1 MB/s,1e15 B/s",   # fitted: inter only
    "device_types.fast.memory=20 GB,100 GB"])
def test_a_sweep_of_what_the_profile_leaves_to_the_cluster_still_runs(vary):
    """What the profile does not price stays a what-if beside it: each value is what
    the cluster so set gives under the profile (the sweep's row against a search of
    that cluster with the same profile)."""
    spec = load_model(MODEL)
    profile = _linked_profile(spec, {"inter": 1e9})
    res = whatif(spec, load_cluster(_doc_with_paths()), SweepOptions(PLANNING, vary=(vary,)),
                 profile=profile)
    key, values = vary.split("=", 1)
    from hyperpipe.search.search import search
    for row, value in zip(res.rows, values.split(","), strict=True):
        doc = _doc_with_paths()
        set_path(doc, key, value)
        alone = search(spec, cluster_from_dict(doc, where="c", name="two-nodes"),
                       PLANNING.constraints(), profile=profile, top=1, peers=False).best
        assert row.best.metrics.iteration_time_s == pytest.approx(
            alone.metrics.iteration_time_s, rel=1e-9), (vary, value)
    times = [r.best.metrics.iteration_time_s for r in res.rows]
    if key == "nodes.b.slowdown":
        assert times[0] != pytest.approx(times[1], rel=1e-6), times    # it still counts


def test_compute_fits_of_layer_kinds_the_model_lacks_leave_the_peak_to_the_cluster():
    """Fits for another model's layer kinds (used with `allow_profile_mismatch`) price
    nothing of this one: its peak still counts, so the sweep runs."""
    spec = load_model(MODEL)
    doc = _profile(spec).to_dict()
    doc["compute"] = {k.replace("synthetic", "block"): v for k, v in doc["compute"].items()}
    profile = profile_from_dict(doc, where="p.json")
    res = whatif(spec, load_cluster(_cluster()), SweepOptions(
        PLANNING, vary=("device_types.slow.peak_flops=1 TFLOP/s,4 TFLOP/s",)),
        profile=profile, allow_profile_mismatch=True)
    assert len(res.rows) == 2 and all(r.best is not None for r in res.rows)


def test_whatif_cli_refuses_a_sweep_the_profile_prices(tmp_path, capsys):
    spec = load_model(MODEL)
    (tmp_path / "c.json").write_text(json.dumps(_cluster()))
    (tmp_path / "m.json").write_text(json.dumps(MODEL))
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(_linked_profile(spec, {"inter": 1e9}).to_dict()))
    png = tmp_path / "sweep.png"
    base = ["whatif", "--cluster", str(tmp_path / "c.json"), "--model",
            str(tmp_path / "m.json"), "--global-batch", "8", "--micro-batch", "1",
            "--profile", str(profile), "--plot", str(png)]
    for vary, fit in (("inter_node.bandwidth=1 Gbit/s,100 Gbit/s", "fitted link"),
                      ("device_types.slow.peak_flops=1 TFLOP/s,4 TFLOP/s",
                       "compute fits of device type slow")):
        assert main([*base, "--vary", vary]) == 2
        out, err = capsys.readouterr()
        err = err.strip().splitlines()
        assert out == "" and len(err) == 1 and err[0].startswith(
            f"hyperpipe: error: --vary {vary.split('=')[0]}: expected a field that "
            f"--profile {profile} does not fit: its {fit}") and \
            err[0].endswith("drop --profile or vary something it does not fit"), err
        assert not png.exists()
    assert main([*base, "--vary", "nodes.b.slowdown=1,2"]) == 0
    assert png.exists()


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


def test_integer_vary_values_read_as_files_read_them():
    """`1e2` and `100.0` are 100 for a global batch as for a node count (the loader's
    `whole_number`); 2.5 and `true` are refused for both."""
    res = whatif(load_model(MODEL), load_cluster(_cluster()), SweepOptions(
        PLANNING, vary=("global_batch=1e1,16.0", "nodes.b.count=1e0,2.0")))
    assert [r.best.plan.global_batch for r in res.rows] == [10, 10, 16, 16]
    assert [r.devices for r in res.rows] == [3, 4, 3, 4]
    assert [r.label for r in res.rows][0] == "global_batch=1e1, nodes.b.count=1e0"
    for vary in ("global_batch=2.5", "global_batch=true"):
        with pytest.raises(BadInput, match="^vary global_batch: expected positive integers"):
            whatif(load_model(MODEL), load_cluster(_cluster()), SweepOptions(
                PLANNING, vary=(vary,)))
    with pytest.raises(BadInput, match=r"count\): expected a positive integer, got 2.5"):
        whatif(load_model(MODEL), load_cluster(_cluster()), SweepOptions(
            PLANNING, vary=("nodes.b.count=2.5",)))


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
