"""Export then import (issue 32): for the README's built-in plans and a plan of every
schedule kind, `hyperpipe export --to F` followed by `hyperpipe import --from F` gives
back the same partition, degrees, micro-batching and schedule, wherever the export wrote
no ``cannot express`` line about them; where it did, the import is the framework's nearest
runnable plan that the line names (Megatron-LM runs 1F1B or interleaved 1F1B, DeepSpeed
1F1B with one stage per rank). The oracle is the plan itself, built here in the
launchers' rank order (replicas inside stages, tensor-parallel ranks innermost), not by
the importer's placement code."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
from factories import A100_NODE

from hyperpipe.cli import main as cli_main
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.frameworks import deepspeed as ds
from hyperpipe.frameworks.export import export, export_files, layout_of
from hyperpipe.frameworks.importer import import_plan
from hyperpipe.frameworks.job import Notes
from hyperpipe.models import load_model
from hyperpipe.plan.kinds import KINDS, SYNTH, generate
from hyperpipe.plan.plan import Plan, load_plan, plan_from_dict
from hyperpipe.plan.schedule import stage_rank

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")
MAIN = {"megatron": "job.sh", "torchtitan": "job.toml", "deepspeed": "job.json"}
# gpt2-small: 14 cut units (embedding, 12 blocks, head); uneven splits on purpose
SPLITS = {1: [(0, 14)], 2: [(0, 5), (5, 14)], 4: [(0, 4), (4, 7), (7, 11), (11, 14)]}
# A synthesised order no generated kind gives: GPipe's on rank 0, 1F1B's on rank 1.
SYNTH_ROWS = (("0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"),
              ("1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"))


def plan_of(kind: str, *, p: int = 2, dp: int = 2, tp: int = 1, m: int = 4,
            recompute: str = "none", dist_opt: bool = False) -> Plan:
    """A gpt2-small plan on one 8-GPU node in the launchers' rank order."""
    record = KINDS[kind]
    v = record.default_chunks if not record.takes_chunks else (2 if kind != SYNTH else 1)
    placement = record.placement
    pipes, actions = [], {}
    for r in range(dp):
        groups = [[f"n/{(k * dp + r) * tp + t}" for t in range(tp)] for k in range(p)]
        stages = [{"layers": list(rng), "devices": groups[stage_rank(j, p, placement)],
                   "tp": tp, "recompute": recompute}
                  for j, rng in enumerate(SPLITS[p * v])]
        pipes.append({"micro_batch": 2, "num_microbatches": m, "stages": stages})
        if kind == SYNTH:
            actions.update({groups[d][0]: list(SYNTH_ROWS[d]) for d in range(p)})
    schedule = {"kind": kind, "chunks": v, **({"actions": actions} if actions else {})}
    return plan_from_dict({"format": "hyperpipe.plan/1", "model": "gpt2-small",
                           "cluster": A100_NODE, "global_batch": 2 * m * dp,
                           "schedule": schedule, "distributed_optimizer": dist_opt,
                           "pipelines": pipes})


def round_trip(plan: Plan, framework: str, tmp_path) -> tuple[Plan, str]:
    """Write the export's files, import the main one; (imported plan, export text)."""
    files = export_files(plan, framework, MAIN[framework])
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    main = tmp_path / MAIN[framework]
    args = tmp_path / "job.args" if framework == "deepspeed" else None
    model = plan.model if framework == "torchtitan" else None
    got, _ = import_plan(framework, main, plan.load_cluster(), args=args, model=model)
    return got, "\n".join(files.values())


def shape(plan: Plan, devices: bool = True) -> dict:
    """Partition, degrees and micro-batching of every replica (and its devices)."""
    return {"chunks": plan.chunks, "global_batch": plan.global_batch,
            "pipelines": [(p.micro_batch, p.num_microbatches,
                           [(s.layers, s.devices if devices else len(s.devices), s.tp)
                            for s in p.stages])
                          for p in plan.pipelines]}


def check(plan: Plan, framework: str, tmp_path) -> Plan:
    got, text = round_trip(plan, framework, tmp_path)
    lost_schedule = f"cannot express: schedule {plan.schedule}" in text
    runs = framework == "torchtitan" or framework in KINDS[plan.schedule].runs_in
    assert lost_schedule == (not runs)
    interleaved_lost = framework == "deepspeed" and plan.chunks > 1
    assert ("cannot express: interleaved stages" in text) == interleaved_lost
    if interleaved_lost:
        # DeepSpeed's default split of pp stages, one per rank
        p = plan.num_devices()
        parts = list(ds.method_parts(ds.DEFAULT_METHOD, 12, True, None, p))
        want = ds.stages_of(parts, 12, "", Notes())
        assert [s.layers for s in got.pipelines[0].stages] == list(want)
        assert got.chunks == 1 and got.schedule == "1f1b"
        return got
    # a V-placed kind run as Megatron's interleaving places its chunks looped
    assert shape(got, runs) == shape(plan, runs)
    if runs:
        assert (got.schedule, got.actions) == (plan.schedule, plan.actions)
    else:
        assert got.schedule == ("interleaved-1f1b" if plan.chunks > 1 else "1f1b")
    assert [s.recompute for s in got.pipelines[0].stages] == \
        [s.recompute for s in plan.pipelines[0].stages]
    return got


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_schedule_kind_round_trips(kind, framework, tmp_path):
    check(plan_of(kind), framework, tmp_path)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tensor_parallel_recompute_and_distributed_optimizer_round_trip(framework,
                                                                        tmp_path):
    plan = plan_of("1f1b", p=2, dp=2, tp=2, recompute="full", dist_opt=True)
    got = check(plan, framework, tmp_path)
    assert got.distributed_optimizer


@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
@pytest.mark.parametrize("zero", [1, 3])
def test_context_parallelism_and_zero_round_trip(framework, zero, tmp_path):
    """pp 2 x dp 2 x tp 1 x cp 2 on the 8 GPUs, ranks tensor, context, data, pipeline
    from the inside out (Megatron's and torchtitan's order): the stages' devices, cp and
    (torchtitan: FSDP as zero 3; Megatron: the distributed optimizer) zero come back."""
    pipes = []
    for r in range(2):
        stages = [{"layers": list(rng), "devices": [f"n/{(k * 2 + r) * 2 + c}"
                                                    for c in range(2)], "tp": 1, "cp": 2}
                  for k, rng in enumerate(SPLITS[2])]
        pipes.append({"micro_batch": 2, "num_microbatches": 4, "stages": stages})
    plan = plan_from_dict({"format": "hyperpipe.plan/1", "model": "gpt2-small",
                           "cluster": A100_NODE, "global_batch": 16,
                           "schedule": {"kind": "1f1b", "chunks": 1}, "zero": zero,
                           "pipelines": pipes})
    plan.check(plan.load_model(), plan.load_cluster())
    got, text = round_trip(plan, framework, tmp_path)
    assert "cannot express: context" not in text
    assert shape(got) == shape(plan)
    assert {s.cp for p in got.pipelines for s in p.stages} == {2}
    lost_zero = framework == "megatron" and zero == 3
    assert ("cannot express: zero 3" in text) == lost_zero
    want = {"torchtitan": 3, "megatron": 1}[framework]
    assert got.zero == want


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_uneven_four_stage_split_round_trips(framework, tmp_path):
    check(plan_of("1f1b", p=4, dp=2), framework, tmp_path)


def test_megatron_states_any_split_with_the_fewest_flags(tmp_path):
    """Even split: no split flag; uneven ends: first/last counts; otherwise the layout."""
    even = plan_from_dict({**plan_of("1f1b", p=2).to_dict(), "pipelines": [
        {"micro_batch": 2, "num_microbatches": 4, "stages": [
            {"layers": [0, 7], "devices": ["n/0"]}, {"layers": [7, 14], "devices": ["n/1"]}]}],
        "global_batch": 8})
    text = export(even, "megatron")
    assert "layout" not in text.replace("# ", "") and "first-pipeline" not in text
    four = export(plan_of("1f1b", p=4, dp=1), "megatron")    # blocks 3, 3, 4, 2
    assert '--pipeline-model-parallel-layout "Ettt|ttt|tttt|ttL"' in four
    ends = plan_from_dict({**plan_of("1f1b", p=4, dp=1).to_dict(), "pipelines": [
        {"micro_batch": 2, "num_microbatches": 4, "stages": [
            {"layers": list(r), "devices": [f"n/{k}"]} for k, r in
            enumerate([(0, 3), (3, 7), (7, 11), (11, 14)])]}]})      # blocks 2, 4, 4, 2
    text = export(ends, "megatron")
    assert "--decoder-first-pipeline-num-layers 2" in text
    assert "--decoder-last-pipeline-num-layers 2" in text


@pytest.fixture(scope="module")
def readme_plans(tmp_path_factory):
    """The plans the README's usage block writes (plan.json, tiny.json), by its own
    search lines."""
    from test_readme import README, hyperpipe_commands, usage_block
    folder = tmp_path_factory.mktemp("readme")
    wanted = {}
    for words in hyperpipe_commands(usage_block(README.read_text(encoding="utf-8"))):
        if words[0] == "search" and "--out" in words:
            out = words[words.index("--out") + 1]
            done = subprocess.run([sys.executable, "-m", "hyperpipe", *words], cwd=folder,
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"hyperpipe {shlex.join(words)}: {done.stderr}"
            wanted[out] = load_plan(folder / out)
    assert set(wanted) >= {"plan.json", "tiny.json"}
    return wanted


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", ["plan.json", "tiny.json"])
def test_readme_plans_round_trip(readme_plans, name, framework, tmp_path):
    """The README's plans: the frameworks hold one layout for every replica, so the
    oracle is that layout (`layout_of`): its layer ranges unless the export says it
    cannot hold several chunks per rank (DeepSpeed), and the stages' devices unless it
    says it lost the replicas' layouts or the chunks' placement, or that the launcher
    numbers ranks in its own order, which it then prices in a `# cost:` line."""
    plan = readme_plans[name]
    got, text = round_trip(plan, framework, tmp_path)
    lay, back = layout_of(plan), layout_of(got)
    assert (back.pp, back.tp, back.dp, back.micro_batch, back.num_microbatches,
            back.global_batch) == (lay.pp, lay.tp, lay.dp, lay.micro_batch,
                                   lay.num_microbatches, lay.global_batch)
    if "cannot express: interleaved stages" not in text:
        assert back.stages == lay.stages
    if not any(f"cannot express: {what}" in text for what in
               ("replica", "interleaved stages", "V placement")):
        placed = shape(got) == shape(plan)
        assert placed or ("# note: device types differ" in text and "# cost:" in text)
        assert shape(got, devices=False) == shape(plan, devices=False)
    runs = (framework == "torchtitan" and plan.num_devices() > 1) or \
        framework in KINDS[plan.schedule].runs_in or plan.schedule == "1f1b"
    assert (f"cannot express: schedule {plan.schedule}" in text) == (not runs)
    # what the framework runs instead: Megatron-LM interleaves virtual stages
    fallback = "interleaved-1f1b" if framework == "megatron" and plan.chunks > 1 else "1f1b"
    assert got.schedule == (plan.schedule if runs else fallback)


def test_import_cli_writes_a_plan_that_simulates_and_names_what_it_did_not_read(
        tmp_path, capsys):
    plan = plan_of("interleaved-1f1b")
    (tmp_path / "p.json").write_text(json.dumps(plan.to_dict()))
    assert cli_main(["export", "--plan", str(tmp_path / "p.json"), "--to", "torchtitan",
                     "--out", str(tmp_path / "t.toml")]) == 0
    assert (tmp_path / "t.schedule.csv").read_text() == generate(
        "interleaved-1f1b", 2, 4, 2).to_torch_csv()
    (tmp_path / "c.json").write_text(json.dumps(A100_NODE))
    capsys.readouterr()
    assert cli_main(["import", "--from", "torchtitan", str(tmp_path / "t.toml"),
                     "--cluster", str(tmp_path / "c.json"), "--model", "gpt2-small",
                     "--out", str(tmp_path / "back.json")]) == 0
    err = capsys.readouterr().err
    assert "hyperpipe import: assumed: model gpt2-small" not in err   # no flavour to replace
    back = load_plan(tmp_path / "back.json")
    assert shape(back) == shape(plan) and back.stack == "torchtitan"
    assert cli_main(["simulate", "--plan", str(tmp_path / "back.json"), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["iteration_time_s"] > 0


def test_cluster_too_small_is_one_line_and_exit_2(tmp_path, capsys):
    plan = plan_of("1f1b", p=4, dp=2)                  # 8 ranks
    files = export_files(plan, "megatron", "m.sh")
    (tmp_path / "m.sh").write_text(files["m.sh"])
    small = {"nodes": [{"name": "n", "device": "A100-80GB", "count": 4}]}
    (tmp_path / "c.json").write_text(json.dumps(small))
    rc = cli_main(["import", "--from", "megatron", str(tmp_path / "m.sh"), "--cluster",
                   str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "world size" in err and "at most the 4 devices" in err


def test_world_size_from_the_cluster_when_the_line_names_no_launcher(tmp_path):
    args = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 12 "
            "--hidden-size 768 --num-attention-heads 12 --seq-length 1024 --vocab-size 50304 "
            "--micro-batch-size 1 --global-batch-size 8")
    (tmp_path / "a.txt").write_text(args)
    plan, notes = import_plan("megatron", tmp_path / "a.txt", load_cluster(A100_NODE))
    assert len(plan.pipelines) == 8 // 4 and plan.pipelines[0].num_microbatches == 4
    # dp outer to tp: replica 1's first stage starts at rank tp = 2
    assert plan.pipelines[1].stages[0].devices == ("n/2", "n/3")
    assert plan.pipelines[0].stages[1].devices == ("n/4", "n/5")
    assert any("not read" in line for line in notes.lines()) is False


@pytest.mark.parametrize("framework", ["megatron", "deepspeed"])
def test_heads_wider_than_hidden_over_heads_round_trip(framework, tmp_path):
    """A model whose heads are not hidden / heads wide (Qwen3's head_dim) leaves as
    Megatron's --kv-channels and comes back with the same head_dim."""
    plan = plan_of("1f1b")
    doc = plan.to_dict()
    doc["model"] = {**load_model("gpt2-small").to_dict(), "head_dim": 96}
    plan = plan_from_dict(doc)
    got, text = round_trip(plan, framework, tmp_path)
    assert "--kv-channels 96" in text
    assert got.load_model().config.head_dim == 96
    assert got.load_model().config.q_dim == 12 * 96
