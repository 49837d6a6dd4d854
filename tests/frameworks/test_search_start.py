"""`search --start PLAN` (issue 32): a search from an imported framework job keeps the
job's model, cluster, global batch and stack, prices the job beside its own plans as the
baseline ``start`` (the oracle: `simulate` of the same plan) and, within the options
given, never picks a plan slower than it."""

from __future__ import annotations

import json

import pytest

from hyperpipe.cli import main as cli_main
from hyperpipe.plan.plan import load_plan
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate


@pytest.fixture
def imported(tmp_path):
    """tiny-gpt on demo-hetero: searched, exported to Megatron-LM, imported back."""
    tiny, sh, out = tmp_path / "tiny.json", tmp_path / "tiny.sh", tmp_path / "imported.json"
    assert cli_main(["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                     "--global-batch", "16", "--tp", "1", "--pp", "2", "--dp", "2",
                     "--out", str(tiny)]) == 0
    assert cli_main(["export", "--plan", str(tiny), "--to", "megatron", "--out", str(sh)]) == 0
    assert cli_main(["import", "--from", "megatron", str(sh), "--cluster", "demo-hetero",
                     "--out", str(out)]) == 0
    return out


def _iteration_s(path) -> float:
    plan = load_plan(path)
    return simulate(plan, CostModel(plan.load_model(), plan.load_cluster())
                    ).metrics.iteration_time_s


def test_start_is_priced_as_simulate_prices_it_and_the_pick_is_not_slower(
        imported, capsys):
    capsys.readouterr()
    assert cli_main(["search", "--start", str(imported), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    start = doc["baselines"]["start"]
    assert start["metrics"]["iteration_time_s"] == pytest.approx(_iteration_s(imported),
                                                                 rel=1e-9)
    assert start["plan"]["stack"] == load_plan(imported).stack
    assert doc["best"]["plan"]["global_batch"] == 16
    assert doc["best"]["metrics"]["iteration_time_s"] <= \
        start["metrics"]["iteration_time_s"] * (1 + 1e-12)


def test_a_start_that_nothing_found_beats_is_the_pick(tmp_path, capsys):
    """Three chunks per device (an odd count: outside the free search's space) on two
    stages, one micro-batch: nothing the search finds beats it, so it is the pick, named
    as the start plan (not as the seed the search's pick had been), and it is no
    baseline of its own (the report had compared the pick with itself)."""
    start, best = tmp_path / "c3.json", tmp_path / "best.json"
    assert cli_main(["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                     "--global-batch", "16", "--chunks", "3", "--micro-batch", "16",
                     "--workers", "1", "--out", str(start)]) == 0
    capsys.readouterr()
    assert cli_main(["search", "--start", str(start), "--workers", "1",
                     "--out", str(best)]) == 0
    text = capsys.readouterr().out
    assert "the pick is the start plan (--start)" in text
    assert not any(line.startswith("  start ") for line in text.splitlines())
    assert "speed-up over the best other plan (start)" not in text
    assert load_plan(best).to_dict() == load_plan(start).to_dict()


def test_the_options_given_hold_against_the_start(imported, tmp_path, capsys):
    """Fixed to GPipe on one pipeline of four stages and to torchtitan, the search keeps
    them though the start (two replicas of two stages, 1F1B, Megatron-LM) is faster: the
    start is priced beside the pick as the baseline ``start``, on the stack asked for
    (it had become the pick, and `--out` had written it on its own stack)."""
    best = tmp_path / "best.json"
    assert cli_main(["search", "--start", str(imported), "--schedule", "gpipe", "--pp", "4",
                     "--dp", "1", "--stack", "torchtitan", "--json", "--out", str(best)]) == 0
    doc = json.loads(capsys.readouterr().out)
    plan = load_plan(best)
    assert (plan.schedule, len(plan.pipelines), len(plan.pipelines[0].stages),
            plan.stack) == ("gpipe", 1, 4, "torchtitan")
    assert doc["baselines"]["start"]["plan"]["stack"] == "torchtitan"
    assert doc["baselines"]["start"]["plan"]["pipelines"] == \
        load_plan(imported).to_dict()["pipelines"]


def test_without_start_the_workload_is_required_and_a_foreign_start_is_bad_input(
        imported, capsys):
    assert cli_main(["search", "--cluster", "demo-hetero", "--global-batch", "16"]) == 2
    assert "--model: expected given (or --start PLAN" in capsys.readouterr().err
    assert cli_main(["search", "--start", str(imported), "--global-batch", "32"]) == 2
    assert "global_batch: expected the search's 32, got 16" in capsys.readouterr().err
    assert cli_main(["search", "--start", str(imported), "--cluster", "h100-a100-l4"]) == 2
    err = capsys.readouterr().err
    assert "a plan for the searched model and cluster" in err and len(err.splitlines()) == 1
