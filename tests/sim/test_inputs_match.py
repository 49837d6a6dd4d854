"""Inputs that must match: a profile is for the model and device types it was measured
on; --vary paths and units are checked before any search runs."""

from __future__ import annotations

import pytest

from hyperpipe.cli import main as cli_main
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.plan.profile import Fit, Profile, check_profile, model_fingerprint
from hyperpipe.sim.calibrate import _measured_on


def tiny_profile(types=("A100-80GB", "V100-32GB")) -> Profile:
    tiny = load_model("tiny-gpt")
    return Profile(compute={Profile.key(t, "block", "F"): Fit(1e-3, 1e-9) for t in types},
                   provenance={"model": "tiny-gpt", "model_fingerprint": model_fingerprint(tiny)})


def test_profile_of_another_model_or_device_type_is_refused_unless_allowed(tmp_path, capsys):
    big, tiny = load_model("gpt3-6.7b"), load_model("tiny-gpt")
    hetero = load_cluster("demo-hetero")
    assert model_fingerprint(tiny) == model_fingerprint(load_model("tiny-gpt"))
    assert model_fingerprint(tiny) != model_fingerprint(load_model({"preset": "tiny-gpt",
                                                                   "seq_len": 32}))
    check_profile(tiny_profile(), tiny, hetero, where="p")              # matches: fine
    with pytest.raises(BadInput, match="measured on tiny-gpt"):
        check_profile(tiny_profile(), big, hetero, where="p")
    with pytest.raises(BadInput, match="none for V100-32GB"):
        check_profile(tiny_profile(("A100-80GB",)), tiny, hetero, where="p")
    check_profile(tiny_profile(), big, hetero, where="p", allow_mismatch=True)
    # the command line: exit 2 with one line, then allowed explicitly
    path = tmp_path / "tiny.json"
    tiny_profile().save(path)
    argv = ["simulate", "--cluster", "demo-hetero", "--model", "gpt3-6.7b", "--pp", "4",
            "--micro-batch", "1", "--global-batch", "8", "--profile", str(path)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "measured on tiny-gpt" in err and "--allow-profile-mismatch" in err
    assert cli_main([*argv, "--allow-profile-mismatch"]) == 0


def test_calibrated_profile_records_its_model_only_when_traces_agree():
    tiny = load_model("tiny-gpt")
    assert _measured_on([tiny, tiny]) == {"model": "tiny-gpt",
                                          "model_fingerprint": model_fingerprint(tiny)}
    assert _measured_on([tiny, load_model("gpt2-small")]) == {}


@pytest.mark.parametrize("vary,needle", [
    ("inter_node.bandwidth=10,100", "a value with a unit, e.g. 'inter_node.bandwidth=100 "
                                    "Gbit/s', got '10'"),
    ("inter_node.bandwith=10 Gbit/s", "--vary inter_node.bandwith: expected a key of "
                                      "inter_node: one of bandwidth, latency, got 'bandwith'"),
    ("nodes.v10.count=0,2", "--vary nodes.v10.count: expected a node of nodes (v100, a100"),
    ("nodes.v100.cont=1", "--vary nodes.v100.cont: expected a key of nodes.v100: one of count"),
    ("inter_node.bandwidth=0 Gbit/s", "--vary inter_node.bandwidth=0 Gbit/s "
                                      "(cluster.inter_node.bandwidth): expected a positive"),
])
def test_vary_errors_name_the_path_typed_and_valid_keys_near_it(vary, needle, capsys):
    assert cli_main(["whatif", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                     "--global-batch", "8", "--vary", vary]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1

