"""Hostile input (issue 33, cases 15 and parts of 18 and 7): torchrun's environment out
of range, a seed past what torch can take, command-line quantities without a unit, a
device type priced like a node, the chunks zb-v and dualpipe-v place on each device."""

from __future__ import annotations

import json

import pytest
from hostile import (
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
)

import hyperpipe.exec.launch as launch
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core import limits

CLUSTER = {"nodes": [{"name": "n", "device": "A100-80GB", "count": 2, "mtbf": "30 day"}]}
PLAN = {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": CLUSTER,
        "global_batch": 2, "schedule": "gpipe",
        "pipelines": [{"micro_batch": 1, "num_microbatches": 2,
                       "stages": [{"layers": [0, 4], "devices": ["n/0"]},
                                  {"layers": [4, 8], "devices": ["n/1"]}]}]}


def _write(tmp_path, name: str, doc) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


TORCHRUN = {
    "rank-minus-one": ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK"),
    "rank-past-the-world": ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK"),
    "world-of-zero": ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
    "local-rank-past-local-world": ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2",
                                     "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK"),
    "local-world-past-world": ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"},
                               "LOCAL_WORLD_SIZE"),
}


@pytest.mark.parametrize("case", sorted(TORCHRUN))
def test_torchrun_environment_out_of_range(case, tmp_path, capsys, monkeypatch):
    env, name = TORCHRUN[case]
    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**env, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch, "rank_main", lambda *a, **k: pytest.fail("a rank started"))
    rc, _, err = cli(capsys, ["run", "--plan", _write(tmp_path, "p.json", PLAN), "--steps",
                              "1", "--no-emulate"])
    assert_one_line(rc, err, 2, f"{name} (environment)")


def test_torchrun_environment_in_range_is_read(monkeypatch):
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    assert launch.torchrun_env() == (1, 2, 0, 1)


def test_largest_seed_seeds_the_last_step():
    from hyperpipe.exec.data import step_batch
    from hyperpipe.models import load_model
    step_batch(load_model("tiny-gpt"), 1, limits.MAX_STEPS, limits.MAX_SEED)
    assert limits.MAX_SEED == 2**39 - 1


FAILURE_FLAGS = {"--mtbf": "432000", "--restart-time": "600",
                 "--checkpoint-write-time": "30", "--checkpoint-interval": "3600"}


@pytest.mark.parametrize("flag", sorted(FAILURE_FLAGS))
def test_failure_quantities_need_their_unit(flag, tmp_path, capsys):
    flags = {"--mtbf": "5 day", "--restart-time": "10 min", "--checkpoint-write-time": "30 s",
             flag: FAILURE_FLAGS[flag]}
    argv = ["whatif", "--failures", "--cluster", _write(tmp_path, "c.json", CLUSTER),
            "--model", "tiny-gpt", "--global-batch", "2"]
    for k, v in flags.items():
        argv += [k, v]
    rc, out, err = cli(capsys, argv)
    assert_one_line(rc, err, 2, flag, "unit")
    assert out == ""


def test_failure_quantities_with_units_still_study(tmp_path, capsys):
    rc, out, err = cli(capsys, [
        "whatif", "--failures", "--cluster", _write(tmp_path, "c.json", CLUSTER), "--model",
        "tiny-gpt", "--global-batch", "2", "--mtbf", "5 day", "--restart-time", "10 min",
        "--checkpoint-write-time", "30 s", "--checkpoint-interval", "1 h"])
    assert rc == 0, err


@pytest.mark.parametrize("price", ["1.5 $/h", 1.5])
def test_device_type_price_reads_like_a_node_price(price):
    doc = {"device_types": {"t": {"base": "A100-80GB", "price_per_hour": price}},
           "nodes": [{"name": "a", "device": "t", "count": 1},
                     {"name": "b", "device": "A100-80GB", "count": 1,
                      "price_per_hour": price}]}
    cluster = load_cluster(doc)
    assert cluster.price_per_hour("a/0") == cluster.price_per_hour("b/0") == 1.5


def test_list_schedules_shows_two_chunks_for_the_v_schedules(capsys):
    rc, out, err = cli(capsys, ["list", "schedules"])
    assert rc == 0, err
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:] if line.strip()}
    assert rows["zb-v"] == rows["dualpipe-v"] == "2"
    assert rows["1f1b"] == "1"
    assert rows["synth"] == "v"           # listed too ("v >= 1"): search picks it
