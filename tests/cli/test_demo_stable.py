"""The demo's pick cannot be flipped by noise inside the tie margin, and a calibration
that makes a prediction worse says why."""

from __future__ import annotations

from hyperpipe.cli.demo import TIE_MARGIN, calibration_notes, pick_stable, runnable
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.exec.emulation import auto_emulation_scale
from hyperpipe.models import load_model
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.search.evaluate import Candidate
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.metrics import Metrics
from hyperpipe.sim.simulator import simulate


def test_pick_is_the_same_whichever_way_noise_orders_near_ties():
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    plans = [uniform_plan(model, cluster, pp=pp, dp=dp, tp=1, micro_batch=2, global_batch=16,
                          schedule="1f1b", chunks=1) for pp, dp in ((2, 2), (4, 1), (2, 1))]
    analytic = CostModel(model, cluster)
    oracle = min(plans[:2], key=lambda p: simulate(p, analytic).metrics.iteration_time_s)

    def cands(times):
        return [Candidate(p, Metrics(t, 1.0, 1.0, 0.0, 0.0)) for p, t in zip(plans, times,
                                                                             strict=True)]
    near = 1 + TIE_MARGIN / 2
    for times in ((1.0, near, 2.0), (near, 1.0, 2.0)):
        assert pick_stable(cands(times), analytic) == oracle
    # outside the margin the faster prediction wins, whatever the analytic model says
    other = plans[1] if oracle == plans[0] else plans[0]
    t = [2.0, 2.0, 5.0]
    t[plans.index(other)] = 1.0
    assert pick_stable(cands(tuple(t)), analytic) == other


def test_calibration_that_makes_a_prediction_worse_says_why():
    rows = {"uniform": {"error_before": 0.05, "error_after": 0.03, "spread": 0.02},
            "best": {"error_before": 0.044, "error_after": 0.134, "spread": 0.02},
            "other": {"error_before": 0.04, "error_after": 0.05, "spread": 0.02}}
    notes = calibration_notes(rows)
    assert len(notes) == 2
    assert "best plan's prediction worse (4.4% -> 13.4%)" in notes[0]
    assert "beyond the measured steps' spread" in notes[0]
    assert "within the measured steps' spread" in notes[1]


def test_emulation_scale_outruns_the_contention_of_ranks_sharing_cores():
    # a rank can be slowed up to ranks/cores by its neighbours; the stretch must exceed it
    for ranks, cores in [(4, 2), (4, 1), (8, 2), (4, 16), (2, 2)]:
        scale = auto_emulation_scale(ranks, cores)
        assert scale >= 2.0 and scale > ranks / cores
    assert auto_emulation_scale(4, 2) == 3.0


def test_demo_passes_over_plans_the_executor_cannot_run():
    # the search's space is wider than the executor's: here one layer's replicas at tp 1
    # and 2 with the distributed optimizer (CI's calibrated search once ranked first the
    # same replicas without it, which the executor did not run then); the demo runs the
    # fastest plan the executor takes, and says why it passed the others over
    model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    mixed = plan_from_dict({
        "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
        "global_batch": 16, "schedule": "gpipe", "pipelines": [
            {"micro_batch": 2, "num_microbatches": 3, "stages": [
                {"layers": [0, 8], "devices": ["a100/0"]}]},
            {"micro_batch": 2, "num_microbatches": 3, "stages": [
                {"layers": [0, 8], "devices": ["a100/1"]}]},
            {"micro_batch": 2, "num_microbatches": 2, "stages": [
                {"layers": [0, 8], "devices": ["v100/0", "v100/1"], "tp": 2}]}],
        "distributed_optimizer": True})
    alike = [uniform_plan(model, cluster, pp=pp, dp=dp, tp=1, micro_batch=2, global_batch=16,
                          schedule="1f1b", chunks=1) for pp, dp in ((2, 2), (4, 1))]
    ranked = [Candidate(p, Metrics(t, 1.0, 1.0, 0.0, 0.0))
              for p, t in zip([mixed, *alike], (1.0, 1.5, 2.0), strict=True)]
    runs, why_not = runnable(ranked, model)
    assert [c.plan for c in runs] == alike
    assert len(why_not) == 1 and "differ in tensor-parallel degree" in why_not[0]
    # the pick: the faster runnable plan, never the mixed one however near it ranks
    assert pick_stable(runs, CostModel(model, cluster)) == alike[0]
    assert runnable(ranked[1:], model) == (ranked[1:], [])


def test_a_plan_the_run_refuses_for_its_experts_is_not_runnable():
    # tensor parallelism on a stage of MoE blocks: `run` refuses it after the placement
    # checks (exec.experts); the demo's filter and search's note see the same refusal
    from factories import plan_doc

    from hyperpipe.exec.runnable import why_not_runnable
    plan = plan_from_dict(plan_doc([{"micro_batch": 2, "num_microbatches": 2, "stages": [
        {"layers": [0, 6], "devices": ["n/0", "n/1"], "tp": 2}]}], model="tiny-moe"))
    assert "MoE" in why_not_runnable(plan, plan.load_model())


def test_search_says_when_run_cannot_take_its_best_plan(capsys):
    # tiny-moe with tp fixed at 2: every plan shards a stage of MoE blocks, which the
    # simulator prices and `run` refuses; the search's text says so
    from hyperpipe.cli import main
    argv = ["search", "--cluster", "demo-hetero", "--model", "tiny-moe",
            "--global-batch", "16", "--tp", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "note: `hyperpipe run` cannot run the best plan as it stands" in out
    assert "MoE blocks" in out
    assert main(["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                 "--global-batch", "16"]) == 0
    assert "cannot run the best plan" not in capsys.readouterr().out


def test_search_and_its_runnable_note_do_not_import_torch():
    """`search` asks the executor's checks of its best plan without importing torch
    (exec.runnable): the import had kept the command alive 3 s after its output."""
    import subprocess
    import sys
    code = ("import sys; from hyperpipe.cli import main; "
            "rc = main(['search', '--cluster', 'demo-hetero', '--model', 'tiny-moe', "
            "'--global-batch', '16', '--tp', '2', '--workers', '1']); "
            "assert rc == 0; print('torch' in sys.modules)")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr
    assert "cannot run the best plan" in got.stdout
    assert got.stdout.strip().splitlines()[-1] == "False"
