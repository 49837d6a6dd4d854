"""`hyperpipe export` and `hyperpipe list`.

Export is checked here against each framework's documented format, without the
frameworks (tests/frameworks/test_accepted.py runs their own code): torchtitan's job
config is TOML (`tomllib` parses it) whose model parts name each stage's modules;
Megatron-LM's flags parse with an argparse parser declaring them as Megatron documents
them (integers), and its uneven first/last layer counts leave the middle stages an even
share; DeepSpeed's JSON holds the batch and, when no partition method gives the stages,
their boundaries.
"""

from __future__ import annotations

import argparse
import json
import shlex

import numpy as np
import pytest
import tomllib
from factories import plan_doc

from hyperpipe.cli import main as cli_main
from hyperpipe.frameworks.export import export, export_files
from hyperpipe.plan.plan import plan_from_dict


def plan_of(pipelines, kind="1f1b", model="gpt2-small"):
    dev = iter(range(64))
    pipes = [{"micro_batch": 2, "num_microbatches": 4, "stages": [
        {"layers": list(r), "devices": [f"n/{next(dev)}"]} for r in ranges]}
        for ranges in pipelines]
    return plan_from_dict(plan_doc(pipes, schedule={"kind": kind, "chunks": 1}, model=model))


# gpt2-small: 14 cut units = embedding, 12 blocks, head; 4 stages as DeepSpeed's uniform
UNIFORM = [[(int(a[0]), int(a[-1]) + 1) for a in np.array_split(np.arange(14), 4)]] * 2


def body(text: str) -> list[str]:
    return [x for x in text.splitlines() if x and not x.startswith("#")]


def test_torchtitan_export_is_toml_with_the_module_names_of_each_stage():
    text = export(plan_of(UNIFORM), "torchtitan")
    par = tomllib.loads(text)["parallelism"]
    assert par["pipeline_parallel_degree"] == 4
    assert par["pipeline_parallel_schedule"] == "1F1B"
    assert par["data_parallel_replicate_degree"] == 2
    assert par["pipeline_parallel_schedule_csv"] == "job.schedule.csv"
    parts = par["module_fqns_per_model_part"]
    # stage s begins at our layer a (a >= 1): torchtitan block a - 1
    assert [p[0] for p in parts[1:]] == [f"layers.{a - 1}" for a, _ in UNIFORM[0][1:]]
    flat = [m for part in parts for m in part]
    assert flat == ["tok_embeddings", *[f"layers.{i}" for i in range(12)], "norm", "output"]
    assert "# ==> job.schedule.csv <==" in text      # the CSV, as comments on stdout
    assert "cannot express: model" in text           # gpt2-small is no llama3 flavour


def test_megatron_export_parses_with_megatron_flags_and_states_uneven_ends():
    plan = plan_of([[(0, 4), (4, 8), (8, 12), (12, 14)]])      # blocks 3, 4, 4, 1
    text = export(plan, "megatron")
    parser = argparse.ArgumentParser()
    for flag in ("pipeline-model-parallel-size", "tensor-model-parallel-size", "num-layers",
                 "micro-batch-size", "global-batch-size", "seq-length",
                 "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers"):
        parser.add_argument(f"--{flag}", type=int)
    words = shlex.split(" ".join(body(text)).replace("\\", " "))
    args, _ = parser.parse_known_args(words[words.index("pretrain_gpt.py") + 1:])
    assert (args.pipeline_model_parallel_size, args.num_layers) == (4, 12)
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    assert (first, last) == (3, 1) and (12 - first - last) % (4 - 2) == 0
    assert words[:5] == ["torchrun", "--nnodes", "1", "--nproc-per-node", "4"]


def test_deepspeed_export_is_deepspeeds_json_and_a_launch_line():
    """Boundaries index Megatron-DeepSpeed's GPTModelPipe (12 blocks, bf16: 19 entries):
    our layer a >= 1 starts at entry a + 2, the embedding at 0."""
    import json as js
    uneven = export_files(plan_of([[(0, 2), (2, 14)]]), "deepspeed", "ds.json")
    config = js.loads(uneven["ds.json"])
    assert config["pipeline"]["partition"] == [0, 2 + 2, 19]
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (8, 2, 4)
    assert config["bf16"] == {"enabled": True}
    launch = uneven["ds.args"]
    assert "--deepspeed_config ds.json" in launch and "_partition_layers" in launch
    assert "--pipeline-model-parallel-size 2" in launch


def test_heterogeneous_plan_says_what_the_framework_cannot_express(tmp_path, capsys):
    plan = plan_of([[(0, 7), (7, 14)], [(0, 5), (5, 14)]])
    for fw in ("torchtitan", "megatron", "deepspeed"):
        assert "cannot express: replica 1 has its own stage layout [0, 5) [5, 14)" in \
            export(plan, fw)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(plan.to_dict()))
    assert cli_main(["export", "--plan", str(path), "--to", "megatron"]) == 0
    assert "--pipeline-model-parallel-size 2" in capsys.readouterr().out
    assert cli_main(["export", "--plan", str(path), "--to", "jax"]) == 2


@pytest.mark.parametrize("what,needle", [("clusters", "demo-hetero"), ("models", "gpt3-6.7b"),
                                         ("devices", "H100-SXM"), ("schedules", "zb-h1")])
def test_list_prints_builtins_with_units_in_headers(what, needle, capsys):
    assert cli_main(["list", what]) == 0
    out = capsys.readouterr().out
    assert needle in out
    if what != "schedules":                          # every figure has a unit in its header
        assert "(" in out.splitlines()[0]
    if what == "devices":
        row = next(x.split() for x in out.splitlines() if x.startswith("A100-80GB"))
        # TFLOP/s (fp16/bf16, then fp32) and GiB from the catalog
        assert row[1] == "312" and row[3] == "19.5" and row[4] == "80"


def test_readme_links_stay_in_the_repo_and_the_format_examples_load():
    import re
    from pathlib import Path

    from hyperpipe.models import load_model
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    assert "../" not in readme and "DESIGN.md" not in readme
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if "://" not in target:
            assert (root / target).is_file(), target
    doc = (root / "docs" / "formats.md").read_text()
    for word in ("recompute", "sequence_parallel", "distributed_optimizer", "attention",
                 "nics", "slowdown", "mtbf", "schedule.actions", "half-open"):
        assert word in doc, word
    plan_json = re.search(r"## Plan.*?```json\n(.*?)```", doc, re.S).group(1)
    plan = plan_from_dict(json.loads(plan_json))
    plan.check(plan.load_model(), plan.load_cluster())
    assert plan.pipelines[0].stages[0].layers == (0, 5)
    assert load_model({"preset": "gpt2-medium", "seq_len": 1024, "attention": "eager"})


def test_a_lost_feature_comes_with_its_simulated_cost(tmp_path):
    """The ``# cost:`` line compares the plan with the plan the framework runs from the
    export, read back by `hyperpipe import` onto the same cluster; the oracle simulates the
    two itself, and a plan that loses nothing gets no line."""
    import re

    from hyperpipe.frameworks.importer import import_plan
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate
    plan = plan_of([[(0, 7), (7, 14)], [(0, 3), (3, 14)]])
    cost = CostModel(plan.load_model(), plan.load_cluster())
    ours = simulate(plan, cost).metrics.iteration_time_s
    files = export_files(plan, "megatron", "job.sh")
    (tmp_path / "job.sh").write_text(files["job.sh"])
    runnable, _ = import_plan("megatron", tmp_path / "job.sh", plan.load_cluster(),
                              model=plan.load_model().to_dict())
    # replica 1's own layout is dropped: both replicas run replica 0's
    assert {p.stages[0].layers for p in runnable.pipelines} == {(0, 7)}
    theirs = simulate(runnable, cost).metrics.iteration_time_s
    line = next(x for x in files["job.sh"].splitlines() if x.startswith("# cost: "))
    got = re.search(r"runs ([\d.]+)% (slower|faster) than the plan \(([\d.]+) s vs "
                    r"([\d.]+) s", line)
    assert got, line
    assert float(got[3]) == pytest.approx(theirs, abs=1e-4)
    assert float(got[4]) == pytest.approx(ours, abs=1e-4)
    sign = 1 if got[2] == "slower" else -1
    assert sign * float(got[1]) == pytest.approx(100 * (theirs / ours - 1), abs=0.05)
    even = plan_of([[(0, 7), (7, 14)], [(0, 7), (7, 14)]])
    assert "# cost:" not in export(even, "megatron")


def test_zero_and_cp_reach_the_frameworks_that_hold_them_and_are_named_elsewhere(tmp_path):
    """torchtitan's FSDP is zero 3: exported and imported back as zero 3; Megatron-LM and
    DeepSpeed's pipeline engine shard the optimizer state at most beside a pipeline, so
    their exports name zero 3 as lost; context parallelism reaches Megatron-LM and
    torchtitan and is named lost for Megatron-DeepSpeed (no ring attention)."""
    from dataclasses import replace

    from hyperpipe.frameworks.importer import import_plan
    plan = replace(plan_of(UNIFORM), zero=3)
    plan.check(plan.load_model(), plan.load_cluster())
    files = export_files(plan, "torchtitan", "job.toml")
    assert "cannot express: zero" not in files["job.toml"]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    back, _ = import_plan("torchtitan", tmp_path / "job.toml", plan.load_cluster(),
                          model=plan.model)
    assert back.zero == 3
    for fw in ("megatron", "deepspeed"):
        assert "cannot express: zero 3" in export(plan, fw)
    assert "cannot express: context" not in export(plan, "megatron")
    cp = plan_from_dict(plan_doc([{"micro_batch": 2, "num_microbatches": 4, "stages": [
        {"layers": [0, 7], "devices": ["n/0", "n/1"], "cp": 2},
        {"layers": [7, 14], "devices": ["n/2", "n/3"], "cp": 2}]}], model="gpt2-small"))
    assert "cannot express: context parallelism (cp 2)" in export(cp, "deepspeed")
    assert "--context-parallel-size 2" in export(cp, "megatron")
    assert "context_parallel_degree = 2" in export(cp, "torchtitan")
    for fw in ("megatron", "torchtitan"):
        assert "cannot express: context" not in export(cp, fw)


def test_an_export_says_what_it_costs_even_when_it_drops_nothing():
    """Two ZeRO-3 replicas of tiny-gpt, one on an A100 and one on a V100: DeepSpeed's JSON
    can say all of it, but its launcher puts rank 1 on the cluster's second device (the
    other A100), so the export runs faster than the plan, and a `# cost:` line says so
    with both simulated times. The same plan on the two A100s reads back as itself: no
    line."""
    from hyperpipe.sim.costmodel import CostModel
    from hyperpipe.sim.simulator import simulate
    doc = {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
           "global_batch": 8, "schedule": {"kind": "1f1b"}, "zero": 3,
           "pipelines": [{"micro_batch": 2, "num_microbatches": 2,
                          "stages": [{"layers": [0, 8], "devices": [d]}]}
                         for d in ("a100/0", "v100/0")]}
    plan = plan_from_dict(doc)
    files = export_files(plan, "deepspeed")
    head = next(text for name, text in files.items() if name.endswith(".args"))
    assert "# cannot express" not in head
    cost = [x for x in head.splitlines() if x.startswith("# cost:")]
    ours = simulate(plan, CostModel(plan.load_model(), plan.load_cluster()))
    assert len(cost) == 1 and "faster than the plan" in cost[0]
    assert f"{ours.metrics.iteration_time_s:.4f} s per iteration" in cost[0]
    same = plan_from_dict({**doc, "pipelines": [
        {**p, "stages": [{"layers": [0, 8], "devices": [d]}]}
        for p, d in zip(doc["pipelines"], ("a100/0", "a100/1"), strict=True)]})
    assert not any("# cost:" in text for text in export_files(same, "deepspeed").values())


def test_a_mixture_of_experts_is_named_lost_and_not_priced_as_the_plan():
    """No export writes experts, their router or expert parallelism: each says so in a
    `# cannot express:` line and prices nothing, since the file describes the model with
    dense blocks (a cost line would compare another model with the plan)."""
    doc = {"format": "hyperpipe.plan/1", "model": "tiny-moe", "cluster": "demo-hetero",
           "global_batch": 8, "schedule": {"kind": "1f1b"},
           "pipelines": [{"micro_batch": 2, "num_microbatches": 2, "stages": [
               {"layers": [0, 3], "devices": [a], "ep": 2},
               {"layers": [3, 6], "devices": [v], "ep": 2}]}
               for a, v in (("a100/0", "v100/0"), ("a100/1", "v100/1"))]}
    plan = plan_from_dict(doc)
    moe = plan.load_model().config.moe
    for fw in ("torchtitan", "megatron", "deepspeed"):
        text = export(plan, fw)
        assert (f"# cannot express: the mixture of experts ({moe.experts} experts, top "
                f"{moe.top_k}") in text and "expert parallelism (ep 2)" in text, fw
        cost = [x for x in text.splitlines() if x.startswith("# cost:")]
        assert cost == ["# cost: not simulated: the export describes another model (dense "
                        "blocks) than the plan's"], fw
    dense = plan_of(UNIFORM)
    assert "mixture of experts" not in export(dense, "megatron")


def test_the_rank_order_note_is_the_launchers_order():
    """The note on a plan of mixed devices says how the launchers number ranks, the order
    `frameworks.job` places a job's devices in: pipeline rank outermost, tensor rank
    innermost (it said replicas one after another, stage by stage, which puts devices
    on the wrong ranks)."""
    doc = {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
           "global_batch": 8, "schedule": {"kind": "1f1b"},
           "pipelines": [{"micro_batch": 2, "num_microbatches": 2, "stages": [
               {"layers": [0, 4], "devices": [a]}, {"layers": [4, 8], "devices": [v]}]}
               for a, v in (("a100/0", "v100/0"), ("a100/1", "v100/1"))]}
    text = export(plan_from_dict(doc), "megatron")
    note = next(x for x in text.splitlines() if x.startswith("# note: device types"))
    assert "pipeline rank outermost, then replica, then context rank, tensor rank " \
        "innermost" in note
    assert "replicas one after another" not in note


def test_deepspeed_export_speaks_megatron_deepspeeds_flags_and_reads_back(tmp_path):
    """A Llama-shaped model (grouped-query attention, RoPE, RMSNorm, flash attention)
    exported to DeepSpeed: the launch line uses Megatron-DeepSpeed's spellings
    (megatron/arguments.py there: --num-key-value-heads, --use-rotary-position-embeddings,
    --normalization rmsnorm, --use-flash-attn-v2), none of Megatron-LM's it lacks, and
    `import` reads the same model back."""
    from hyperpipe.frameworks.importer import import_plan
    model = {"kind": "gpt", "name": "llama-ish", "n_layer": 4, "n_head": 8, "n_kv_head": 2,
             "d_model": 512, "seq_len": 256, "vocab_size": 1024, "mlp": "swiglu",
             "norm": "rmsnorm", "position": "rope", "attention": "flash", "bias": False,
             "tie_embeddings": False, "dtype": "bf16"}
    plan = plan_from_dict(plan_doc([{"micro_batch": 2, "num_microbatches": 4, "stages": [
        {"layers": [0, 3], "devices": ["n/0"]}, {"layers": [3, 6], "devices": ["n/1"]}]}],
        model=model))
    files = export_files(plan, "deepspeed", "ds.json")
    launch = " ".join(body(files["ds.args"]))
    for flag in ("--num-key-value-heads 2", "--use-rotary-position-embeddings",
                 "--normalization rmsnorm", "--use-flash-attn-v2", "--swiglu"):
        assert flag in launch, flag
    for flag in ("--group-query-attention", "--position-embedding-type",
                 "--attention-backend", "RMSNorm"):
        assert flag not in launch, flag
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    back, _ = import_plan("deepspeed", tmp_path / "ds.json", plan.load_cluster(),
                          args=tmp_path / "ds.args")
    got, want = back.load_model().config, plan.load_model().config
    for field in ("n_kv_head", "position", "norm", "attention", "mlp", "n_layer"):
        assert getattr(got, field) == getattr(want, field), field
