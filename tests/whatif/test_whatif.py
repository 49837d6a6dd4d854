"""What-if sweeps: variants built right, results that follow from the variation."""

from __future__ import annotations

import itertools
import json

import pytest
from factories import FREE_LINK, cluster_doc, device_type

from hyperpipe.cli import main
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.whatif.sweep import (
    Planning,
    SweepOptions,
    format_whatif,
    parse_vary,
    set_path,
    whatif,
)


def _cluster(inter: str = "1e15 B/s") -> dict:
    return cluster_doc(
        {"fast": device_type("2 TFLOP/s", memory="100 GB", mem_bandwidth="1e15 B/s",
                             price_per_hour=4.0),
         "slow": device_type("1 TFLOP/s", memory="100 GB", mem_bandwidth="1e15 B/s",
                             price_per_hour=1.0)},
        [("a", "fast", 2), ("b", "slow", 2)], intra_link=FREE_LINK,
        inter_node={"bandwidth": inter, "latency": 0}, name="two-nodes")


MODEL = {"kind": "synthetic", "name": "sweep", "layers": 8, "seq_len": 1,
         "fwd_flops_per_sample": 1.0e10, "activation_bytes_per_sample": 1.0e6,
         "params_per_layer": 0}


def test_parse_vary_and_set_path():
    assert parse_vary("inter_node.bandwidth=10 Gbit/s, 100 Gbit/s") == \
        ("inter_node.bandwidth", ["10 Gbit/s", "100 Gbit/s"])
    with pytest.raises(BadInput, match="^vary: expected KEY=V1"):   # the CLI: --vary
        parse_vary("inter_node.bandwidth")
    # an empty value between two commas is refused, not dropped
    with pytest.raises(BadInput, match="^vary inter_node.bandwidth: expected a value "):
        parse_vary("inter_node.bandwidth=10 Gbit/s,,100 Gbit/s")
    doc = _cluster()
    set_path(doc, "nodes.b.count", "4")
    set_path(doc, "nodes.0.device", "slow")
    assert doc["nodes"][1]["count"] == 4 and doc["nodes"][0]["device"] == "slow"
    with pytest.raises(BadInput, match="'a', 'b'"):
        set_path(doc, "nodes.c.count", "1")


def test_slow_link_keeps_each_pipeline_inside_a_node():
    # 1 MB per sample over 1 Mbit/s is 8 s a crossing, the whole compute well under a
    # second: no pipeline of the best plan may cross nodes (replicas on different nodes
    # are fine: no parameters, so no gradient traffic).
    res = whatif(load_model(MODEL), load_cluster(_cluster()), SweepOptions(
        Planning(global_batch=8, micro_batch=1),
        vary=("inter_node.bandwidth=1 Mbit/s,1e15 B/s",)))
    slow, fast = res.rows
    assert [r.settings for r in res.rows] == [(("inter_node.bandwidth", "1 Mbit/s"),),
                                              (("inter_node.bandwidth", "1e15 B/s"),)]
    for pipe in slow.best.plan.pipelines:
        assert len({d.split("/")[0] for d in pipe.devices()}) == 1
    assert slow.best.metrics.iteration_time_s < 8.0
    # what the slow link allows, the free one allows too
    assert fast.best.metrics.throughput_samples_per_s >= \
        slow.best.metrics.throughput_samples_per_s * (1 - 1e-9)
    assert "1 Mbit/s" in format_whatif(res)


def test_pool_of_device_types_with_prices():
    res = whatif(load_model(MODEL), load_cluster(_cluster()), SweepOptions(
        Planning(global_batch=8, micro_batch=1), pool=True))
    used = [dict(r.settings)["use"] for r in res.rows]
    assert used == ["fast+slow", "fast", "slow"]
    for row in res.rows:
        types = set(dict(row.settings)["use"].split("+"))
        plan_types = {"fast" if d.startswith("a/") else "slow" for d in row.best.plan.devices}
        assert plan_types <= types
        # cost per million tokens: USD/s of the devices used x seconds per token
        m = row.best.metrics
        price = sum(4.0 if d.startswith("a/") else 1.0 for d in row.best.plan.devices)
        tokens = row.best.plan.global_batch * 1
        assert m.cost_per_million_tokens == pytest.approx(
            price / 3600 * m.iteration_time_s / tokens * 1e6, rel=1e-9)
    # the front is sorted by time and strictly cheaper along it
    front = [res.rows[i].best.metrics for i in res.pareto]
    assert front and all(a.iteration_time_s <= b.iteration_time_s and
                         a.cost_per_million_tokens > b.cost_per_million_tokens
                         for a, b in itertools.pairwise(front))


def test_whatif_cli_plot_json_and_bad_input(tmp_path, capsys):
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(_cluster()))
    model = tmp_path / "m.json"
    model.write_text(json.dumps(MODEL))
    png = tmp_path / "sweep.png"
    rc = main(["whatif", "--cluster", str(cluster), "--model", str(model),
               "--global-batch", "8", "--micro-batch", "1",
               "--vary", "global_batch=4,8", "--plot", str(png), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["settings"] for r in doc["rows"]] == [{"global_batch": "4"},
                                                   {"global_batch": "8"}]
    assert [r["best"]["plan"]["global_batch"] for r in doc["rows"]] == [4, 8]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc = main(["whatif", "--cluster", str(cluster), "--model", str(model),
               "--global-batch", "8", "--vary", "nodes.zzz.count=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "zzz" in err[0]


def test_a_kept_plan_fixes_the_global_batch(tmp_path, capsys):
    """`--plan` keeps today's plan, which trains its own global batch: another
    --global-batch (or a --vary over it) would compare iterations of different batches
    (a plan of 16 against re-plans of 32 read '+12.2%' where per sample the kept plan was
    2.24x slower): refused in one line naming the option."""
    from hyperpipe.cli import main
    plan = tmp_path / "p.json"
    assert main(["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                 "--global-batch", "16", "--workers", "1", "--out", str(plan)]) == 0
    capsys.readouterr()
    base = ["whatif", "--plan", str(plan), "--cluster", "demo-hetero", "--model",
            "tiny-gpt", "--workers", "1"]
    for extra, needle in (
            (["--global-batch", "32", "--vary", "inter_node.bandwidth=1 Gbit/s"],
             "--global-batch: expected the --plan's global batch (16)"),
            (["--global-batch", "16", "--vary", "global_batch=16,32"],
             "--vary global_batch: expected no --plan beside it"),
            (["--global-batch", "16", "--vary", "model.n_layer=4,8"],
             "--vary model.n_layer: expected no --plan beside it")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert main(base + ["--global-batch", "16", "--vary", "inter_node.bandwidth=1 Gbit/s"]) == 0


@pytest.mark.parametrize("vary,line", [
    (["inter_node.bandwidth=1 Gbit/s", "inter_node.bandwidth=100 Gbit/s"],
     "--vary inter_node.bandwidth sets it already"),
    (["nodes.v100.count=0,2", "nodes.1.count=2,0"], "--vary nodes.v100.count sets it"),
    (["model.seq_len=0"], "--vary model.seq_len=0: seq_len: expected a positive")])
def test_a_field_varied_twice_or_a_bad_model_field_is_named(vary, line, capsys):
    """The later of two --vary of one field won while the label showed both; a bad
    model.FIELD blamed --model."""
    rc = main(["whatif", "--cluster", "demo-hetero", "--model", "tiny-gpt",
               "--global-batch", "16", "--workers", "1",
               *[a for v in vary for a in ("--vary", v)]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and line in err[0], err


@pytest.mark.parametrize("vary,first_faster", [("global_batch=2,32", True),
                                               ("model.seq_len=1,4", False)])
def test_fastest_is_the_most_work_per_second_not_the_shortest_iteration(vary, first_faster):
    """Variants that train other batches or sequences in an iteration: the fastest is
    the one with the most tokens per second (samples/s x seq_len), shown in the line;
    the shortest iteration (batch 2) or a tie (the same samples of 1 and 4 tokens) named
    the variant that trains least."""
    res = whatif(load_model(MODEL), load_cluster(_cluster()), SweepOptions(
        Planning(global_batch=8, micro_batch=1), vary=(vary,)))
    first, second = (r.best.metrics for r in res.rows)
    # the oracle: the iteration times, and the work each variant does per iteration
    assert (first.iteration_time_s < second.iteration_time_s) is first_faster or \
        first.iteration_time_s == second.iteration_time_s
    assert second.tokens_per_s > first.tokens_per_s
    work = 32 if vary.startswith("global_batch") else 8 * 4       # tokens per iteration
    assert second.tokens_per_s == pytest.approx(work / second.iteration_time_s)
    (line,) = [x for x in format_whatif(res).splitlines() if x.startswith("fastest:")]
    assert line == (f"fastest: {res.rows[1].label} ({second.tokens_per_s:.4g} tokens/s, "
                    f"{second.throughput_samples_per_s:.2f} samples/s)"), line


def test_the_pareto_front_ranks_variants_by_tokens_per_second():
    """A global_batch sweep on a priced cluster: a smaller batch's shorter iteration
    trains less; the front keeps what no variant beats on both tokens/s and cost per
    million tokens (by hand over the rows), fastest first. Ranked by iteration time,
    the batch of 2 had joined it beside the batch of 32 that beats it on both."""
    res = whatif(load_model(MODEL), load_cluster(_cluster()), SweepOptions(
        Planning(global_batch=8, micro_batch=1), vary=("global_batch=2,32",)))
    ms = [r.best.metrics for r in res.rows]
    beaten = [any(o.tokens_per_s >= m.tokens_per_s and o.cost_per_million_tokens <=
                  m.cost_per_million_tokens and o is not m and
                  (o.tokens_per_s, o.cost_per_million_tokens) !=
                  (m.tokens_per_s, m.cost_per_million_tokens) for o in ms) for m in ms]
    assert sorted(res.pareto) == [i for i, b in enumerate(beaten) if not b]
    front = [ms[i] for i in res.pareto]
    assert all(a.tokens_per_s >= b.tokens_per_s for a, b in itertools.pairwise(front))
