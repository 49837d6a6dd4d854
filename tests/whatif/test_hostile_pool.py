"""Issue 33, case 6: `whatif --pool` counts its variants before it builds one."""

from __future__ import annotations

import pytest
from factories import FREE_LINK, cluster_doc, device_type

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.whatif import sweep
from hyperpipe.whatif.sweep import Planning, SweepOptions, whatif

MODEL = {"kind": "synthetic", "name": "sweep", "layers": 4, "seq_len": 1,
         "fwd_flops_per_sample": 1.0e10, "activation_bytes_per_sample": 1.0e6,
         "params_per_layer": 0}


def test_pool_of_14_device_types_is_refused_before_any_variant(monkeypatch):
    types = {f"t{i}": device_type(f"{i + 1} TFLOP/s") for i in range(14)}
    cluster = load_cluster(cluster_doc(types, [(f"n{i}", f"t{i}", 1) for i in range(14)],
                                       intra_link=FREE_LINK,
                                       inter_node={"bandwidth": "1e15 B/s", "latency": 0},
                                       name="fourteen"))

    def built(*args, **kwargs):
        raise AssertionError("a variant was built past the limit")

    monkeypatch.setattr(sweep, "cluster_from_dict", built)
    with pytest.raises(BadInput, match=r"^pool: expected a sweep of at most 4096 variants"
                       r".*got '16383 variants'"):
        whatif(load_model(MODEL), cluster, SweepOptions(Planning(global_batch=8), pool=True))
