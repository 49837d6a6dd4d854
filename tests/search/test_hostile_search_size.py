"""Issue 33, cases 3 and 11: a search bounded before it works, a plan it writes that
loads back, and a node of more devices than the model's pipelines can use."""

from __future__ import annotations

import pytest
from factories import plan_doc

from hyperpipe.cli import main
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.search import search as search_module
from hyperpipe.search.search import SearchConstraints, search

BIG_NODE = {"name": "big", "nodes": [{"name": "n", "device": "A100-80GB", "count": 512}],
            "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}}


def test_search_too_big_is_refused_before_any_work(monkeypatch):
    # tiny-gpt: 8 layers; on 8 devices 8^2 x 8 = 512 > the limit set here
    monkeypatch.setattr(limits, "MAX_SEARCH_SIZE", 511, raising=False)

    def work(*args, **kwargs):
        raise AssertionError("the search started its work")

    monkeypatch.setattr(search_module, "SearchContext", work)
    cluster = load_cluster({"nodes": [{"name": "n", "device": "A100-80GB", "count": 8}]})
    with pytest.raises(BadInput, match=r"^search: expected a model of at most 7 layers on 8 "
                       r"devices .*MAX_SEARCH_SIZE.*got '8 layers'"):
        search(load_model("tiny-gpt"), cluster, SearchConstraints(global_batch=8))


def test_search_too_big_is_one_line_and_exit_2(tmp_path, capsys):
    """The real limit: 3,000 layers on 4 devices (before: minutes and GBs)."""
    model = tmp_path / "m.yaml"
    model.write_text("kind: synthetic\nname: deep\nlayers: 3000\nseq_len: 1\n"
                     "fwd_flops_per_sample: 1.0e10\nactivation_bytes_per_sample: 1.0e6\n"
                     "params_per_layer: 1000\n")
    out = tmp_path / "plan.json"
    assert limits.MAX_SEARCH_SIZE < 3000 * 3000 * 4     # before the fix: no bound at all
    rc = main(["search", "--cluster", "demo-hetero", "--model", str(model),
               "--global-batch", "8", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "3000 layers" in err
    assert not out.exists()


def test_a_plan_of_a_10000_block_model_loads_back():
    """The search wrote `layers [18, 10002]` (embedding and head around 10,000 blocks);
    the plan reader refused it."""
    model = {"preset": "tiny-gpt", "n_layer": limits.MAX_LAYERS}
    doc = plan_doc([{"micro_batch": 1, "num_microbatches": 2, "stages": [
        {"layers": [0, 18], "devices": ["n/0"]},
        {"layers": [18, limits.MAX_LAYERS + 2], "devices": ["n/1"]}]}], model=model)
    plan = plan_from_dict(doc)
    assert plan.pipelines[0].stages[-1].layers == (18, limits.MAX_LAYERS + 2)
    plan.check(plan.load_model(), plan.load_cluster())
    doc["pipelines"][0]["stages"][-1]["layers"] = [18, limits.MAX_LAYERS + 3]
    with pytest.raises(BadInput, match="layers"):
        plan_from_dict(doc)


@pytest.mark.parametrize("global_batch", [1, 8])
def test_a_node_of_512_devices_gets_a_plan_on_a_subset(global_batch):
    """More devices than tiny-gpt's pipelines can take (8 stages x global-batch replicas x
    tp 4): the search answered "needs 0.0 GB ... has 40960.0 GB"; it plans on a subset."""
    res = search(load_model("tiny-gpt"), load_cluster(BIG_NODE),
                 SearchConstraints(global_batch=global_batch), top=1)
    used = {d for p in res.best.plan.pipelines for s in p.stages for d in s.devices}
    assert 0 < len(used) < 512
    assert res.best.metrics.feasible
