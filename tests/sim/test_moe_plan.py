"""The stage field `ep`: JSON round trip, and validation against the model and the
replicas."""

from __future__ import annotations

import pytest

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.plan.plan import plan_from_dict

CLUSTER = {"nodes": [{"name": "n0", "device": "A100-80GB", "count": 8}],
           "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}}


def _doc(ep=2, replicas=2, model="tiny-moe", second=None):
    layers = load_model(model).num_layers
    pipes = [{"micro_batch": 2, "num_microbatches": 2,
              "stages": [{"layers": [0, layers], "devices": [f"n0/{q}"], "ep": ep}]}
             for q in range(replicas)]
    if second is not None:
        pipes[1]["stages"][0].update(second)
    return {"format": "hyperpipe.plan/1", "model": model, "cluster": CLUSTER,
            "global_batch": 4 * replicas, "schedule": "1f1b", "pipelines": pipes}


def test_ep_round_trips_and_defaults_to_one():
    plan = plan_from_dict(_doc())
    assert plan.pipelines[0].stages[0].ep == 2
    again = plan_from_dict(plan.to_dict())
    assert again == plan
    one = plan_from_dict(_doc(ep=1))
    assert "ep" not in one.to_dict()["pipelines"][0]["stages"][0]
    plan.check(load_model("tiny-moe"), load_cluster(CLUSTER))


@pytest.mark.parametrize("doc,needle", [
    (_doc(ep=3, replicas=3), "divisor of the model's experts"),
    (_doc(ep=4, replicas=2), "data-parallel x context ranks"),
    (_doc(ep=2, model="tiny-gpt"), "has no MoE blocks"),
    (_doc(ep=2, second={"ep": 1}), "every replica holding them"),
])
def test_bad_ep_is_one_line_naming_the_field(doc, needle):
    plan = plan_from_dict(doc)
    with pytest.raises(BadInput, match=needle) as err:
        plan.check(load_model(doc["model"]), load_cluster(CLUSTER))
    assert "stages[0].ep" in str(err.value) and "\n" not in str(err.value)


def test_ep_zero_is_refused_when_read():
    with pytest.raises(BadInput, match="ep"):
        plan_from_dict(_doc(ep=0))

