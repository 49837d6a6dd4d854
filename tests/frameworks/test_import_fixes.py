"""What the frameworks run, read as their code reads it: torchtitan's precision without
FSDP (distributed/utils.py ``maybe_enable_amp``) and its gradient accumulation under a
pipeline (train.py ``train_step``), srun's task and node flags, DeepSpeed's
BF16_Optimizer at ZeRO stage 0 without a pipeline (runtime/engine.py
``_do_optimizer_sanity_check``), Megatron-LM's virtual stages per rank and accounted
layers (training/arguments.py ``validate_args``), and settings the frameworks accept
that the import refused or took silently."""

from __future__ import annotations

import json
import re

import pytest
from factories import A100_NODE
from hostile import MEGATRON, assert_one_line, cli
from test_round_trip import plan_of, round_trip

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.frameworks.export import export_files
from hyperpipe.frameworks.importer import import_plan, read_job
from hyperpipe.frameworks.launch import read_launch
from hyperpipe.frameworks.megatron import read_megatron

TT_8B = """[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 8
seq_len = 8192
[parallelism]
data_parallel_replicate_degree = {replicate}
data_parallel_shard_degree = {shard}
tensor_parallel_degree = {tp}
pipeline_parallel_degree = 1
"""


def _toml(tmp_path, text: str):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


# ------------------------------------------------------------ 1. torchtitan precision
@pytest.mark.parametrize("replicate, shard, tp, dtype, state", [
    (1, 1, 8, "fp32", "mixed"),        # TP without FSDP: mixed precision off
    (8, 1, 1, "bf16", "autocast"),     # DDP: torch.autocast over fp32 weights
    (1, 8, 1, "bf16", "mixed"),        # FSDP: fully_shard's bf16 MixedPrecisionPolicy
    (1, 4, 2, "bf16", "mixed"),        # FSDP beside TP
    # the default -1: the ranks left over on the 8-GPU node, FSDP only over more than one
    (1, -1, 8, "fp32", "mixed"),       # 8 / tp 8 = 1 left: no FSDP, TP in fp32
    (1, -1, 2, "bf16", "mixed"),       # 4 left: FSDP
    (4, -1, 2, "fp32", "mixed"),       # 4 replicas leave 1 shard: no FSDP, TP in fp32
])
def test_torchtitan_imports_the_precision_it_trains_in(replicate, shard, tp, dtype, state,
                                                       tmp_path):
    """/tmp/hunt_io/tt1.toml (tp 8, data_parallel_shard_degree 1) imported bf16; torchtitan
    trains it fp32, and a DDP job under autocast."""
    path = _toml(tmp_path, TT_8B.format(replicate=replicate, shard=shard, tp=tp))
    plan, notes = import_plan("torchtitan", path, load_cluster(A100_NODE))
    model = plan.load_model()
    assert (model.dtype, model.optimizer_state) == (dtype, state)
    fsdp = dtype == "bf16" and state == "mixed"
    assert plan.zero == (3 if fsdp else 0)
    said = "maybe_enable_amp" in " ".join(notes.lines())
    assert said == (not fsdp)


def test_torchtitan_precision_stays_with_a_model_given_beside_it(tmp_path):
    """``--model`` replaces the shapes, not the precision the job trains in."""
    path = _toml(tmp_path, TT_8B.format(replicate=1, shard=1, tp=8))
    job = read_job("torchtitan", path, model={"preset": "llama3-8b", "dtype": "bf16"})
    assert job.model["dtype"] == "fp32" and job.model["n_layer"] == 32


@pytest.mark.parametrize("flag, dtype", [("--fp16", "fp16"), ("--bf16", "bf16"), ("", "fp32")])
def test_megatron_precision_stays_with_a_model_given_beside_it(tmp_path, flag, dtype):
    """A Megatron-LM job keeps the precision its flags say under ``--model`` too (tiny-gpt
    is an fp32 preset: it had replaced an fp16 job's precision)."""
    path = tmp_path / "job.sh"
    path.write_text("pretrain_gpt.py --num-layers 6 --hidden-size 64 --num-attention-heads 4 "
                    "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 "
                    f"--global-batch-size 8 --vocab-size 256 {flag}\n")
    assert read_job("megatron", path, model="tiny-gpt").model["dtype"] == dtype


def _cost(text: str) -> tuple[float, float]:
    """(export's, plan's) seconds per iteration of the export's ``# cost:`` line."""
    m = re.search(r"# cost: .*\(([0-9.]+) s vs ([0-9.]+) s per iteration", text)
    assert m, text
    return float(m.group(1)), float(m.group(2))


def test_torchtitan_export_of_bf16_tp_without_fsdp_says_it_runs_fp32(tmp_path):
    """A bf16 plan with tp 2 and no ZeRO: torchtitan trains it fp32, so the export says
    so, prices what it runs (slower), and imports back as fp32."""
    plan = plan_of("1f1b", p=2, dp=2, tp=2)
    assert plan.load_model().dtype == "bf16" and plan.zero == 0
    got, text = round_trip(plan, "torchtitan", tmp_path)
    assert "# cannot express: bf16 without FSDP" in text
    theirs, ours = _cost(text)
    assert theirs > ours
    assert got.load_model().dtype == "fp32"
    fsdp = plan_of("1f1b", p=2, dp=2, tp=2, dist_opt=True)      # zero 1: exported as FSDP
    got, text = round_trip(fsdp, "torchtitan", tmp_path)
    assert "bf16 without FSDP" not in text and got.load_model().dtype == "bf16"


def test_torchtitan_export_of_ddp_bf16_says_it_runs_under_autocast(tmp_path):
    plan = plan_of("1f1b", p=1, dp=2)
    got, text = round_trip(plan, "torchtitan", tmp_path)
    assert "torch.autocast" in text
    model = got.load_model()
    assert (model.dtype, model.optimizer_state) == ("bf16", "autocast")


# ------------------------------------------------------------ 2. srun
@pytest.mark.parametrize("line, world", [
    ("srun -N 2 -n 4 --ntasks-per-node 8 python x.py", 4),     # -n: tasks, not nodes
    ("srun -N2 --ntasks-per-node=8 python x.py", 16),          # attached short form
    ("srun -n12 python x.py", 12),
    ("srun --ntasks 6 --nodes 2 python x.py", 6),
    ("srun --nodes 2 --ntasks-per-node 4 python x.py", 8),
    ("torchrun --nnodes 2 --nproc_per_node 8 x.py", 16),
    # each srun task a torchrun of 8 processes: torchrun's count, not srun's tasks
    ("srun -n 2 torchrun --nnodes 2 --nproc-per-node 8 x.py", 16),
    ("srun --ntasks=2 --ntasks-per-node=1 python -m torch.distributed.run --nnodes 2 "
     "--nproc_per_node 8 x.py", 16),
])
def test_srun_world_size_is_its_tasks_else_nodes_times_tasks_per_node(line, world):
    launch = read_launch(line + " --num-layers 2", "job.sh")
    assert launch.world_size == world
    assert launch.launcher_unread == []
    assert launch.args.options == {"num-layers": ["2"]}


# ------------------------------------------------------------ 3. torchtitan accumulation
ACCUMULATING = """[model]
name = "llama3"
flavor = "debugmodel"
[training]
local_batch_size = 8
global_batch_size = {global_batch}
seq_len = 64
[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = 1
pipeline_parallel_degree = 4
pipeline_parallel_microbatch_size = 1
"""


def test_torchtitan_accumulation_under_a_pipeline_is_said_on_stderr(tmp_path, capsys):
    """global 64 = 4 x (local 8 x dp 2): torchtitan runs 4 schedules of 8 micro-batches
    per iteration; the plan holds one of 32, and the import says so."""
    path = _toml(tmp_path, ACCUMULATING.format(global_batch=64))
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(A100_NODE))
    out = tmp_path / "plan.json"
    rc, _, err = cli(capsys, ["import", "--from", "torchtitan", path, "--cluster", cluster,
                              "--out", out])
    assert rc == 0, err
    assert "4 pipeline schedules of 8 micro-batches" in err
    assert "one schedule of 32 micro-batches" in err and "optimistic" in err
    plan = json.loads(out.read_text())
    assert [p["num_microbatches"] for p in plan["pipelines"]] == [32, 32]
    one = _toml(tmp_path, ACCUMULATING.format(global_batch=16))     # one schedule: silent
    _, notes = import_plan("torchtitan", one, load_cluster(A100_NODE))
    assert "pipeline schedules" not in " ".join(notes.lines())


def test_torchtitan_global_batch_not_a_multiple_of_local_times_dp_is_refused(tmp_path):
    """torchtitan's Trainer asserts global % (local x dp) == 0: 24 % 16."""
    path = _toml(tmp_path, ACCUMULATING.format(global_batch=24))
    with pytest.raises(BadInput, match="local batch x data-parallel degree = 8 x 2"):
        import_plan("torchtitan", path, load_cluster(A100_NODE))


# ------------------------------------------------------------ 4. DeepSpeed bf16, pp 1
PP1 = MEGATRON.replace("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 1")


def _deepspeed(tmp_path, doc: dict, args: str = PP1):
    (tmp_path / "d.json").write_text(json.dumps(doc))
    (tmp_path / "d.args").write_text(args)
    return import_plan("deepspeed", tmp_path / "d.json", load_cluster(A100_NODE),
                       args=tmp_path / "d.args")


@pytest.mark.parametrize("precision, sharded", [("bf16", True), ("fp16", False)])
def test_deepspeed_bf16_at_zero_0_shards_without_a_pipeline(precision, sharded, tmp_path):
    plan, _ = _deepspeed(tmp_path, {"train_micro_batch_size_per_gpu": 1,
                                    "train_batch_size": 8, "zero_optimization": {"stage": 0},
                                    precision: {"enabled": True}})
    assert len(plan.pipelines) == 8 and len(plan.pipelines[0].stages) == 1
    assert plan.distributed_optimizer is sharded and plan.zero == int(sharded)


def test_deepspeed_export_of_bf16_without_a_pipeline_matches_the_import(tmp_path):
    """bf16, pp 1, dp 2: zero 0 cannot stay whole (said); zero 1 is written as stage 0,
    BF16_Optimizer's sharding, and imports back as zero 1."""
    whole = export_files(plan_of("1f1b", p=1, dp=2), "deepspeed", "job.json")
    assert "# cannot express: a whole optimizer state per replica" in whole["job.args"]
    plan = plan_of("1f1b", p=1, dp=2, dist_opt=True)
    files = export_files(plan, "deepspeed", "job.json")
    assert json.loads(files["job.json"])["zero_optimization"]["stage"] == 0
    assert "cannot express" not in files["job.args"]
    got, _ = round_trip(plan, "deepspeed", tmp_path)
    assert got.zero == 1


# ------------------------------------------------------------ 5. Megatron virtual stages
BASE = ("--tensor-model-parallel-size 1 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 32 --vocab-size 256 --micro-batch-size 1 --global-batch-size 8 ")


def test_megatron_num_virtual_stages_per_pipeline_rank_interleaves():
    job = read_megatron(BASE + "--num-layers 12 --pipeline-model-parallel-size 2 "
                        "--num-virtual-stages-per-pipeline-rank 2", "m.sh")
    assert job.chunks == 2 and job.schedule == "interleaved-1f1b"
    assert job.stages == ((0, 4), (4, 7), (7, 10), (10, 14))
    assert "num-virtual-stages-per-pipeline-rank" not in " ".join(job.notes.unread)


def test_megatron_uneven_ends_with_virtual_stages_per_rank():
    """first 2, last 2 of 12 over pp 4 (middle ranks 4 each), 2 chunks a rank: stage k
    holds rank k mod 4's share halved (megatron-core get_num_layers_to_build)."""
    job = read_megatron(BASE + "--num-layers 12 --pipeline-model-parallel-size 4 "
                        "--decoder-first-pipeline-num-layers 2 "
                        "--decoder-last-pipeline-num-layers 2 "
                        "--num-virtual-stages-per-pipeline-rank 2", "m.sh")
    blocks = [b - a - (k == 0) - (k == 7) for k, (a, b) in enumerate(job.stages)]
    assert job.chunks == 2 and blocks == [1, 2, 2, 1, 1, 2, 2, 1]


def test_megatron_refuses_two_ways_of_giving_virtual_stages():
    with pytest.raises(BadInput, match="at most one of"):
        read_megatron(BASE + "--num-layers 12 --pipeline-model-parallel-size 2 "
                      "--num-virtual-stages-per-pipeline-rank 2 "
                      "--num-layers-per-virtual-pipeline-stage 3", "m.sh")


# ------------------------------------------------------------ 6. valid configs refused
@pytest.mark.parametrize("first, last, stages", [
    (0, 1, ((0, 5), (5, 8))),        # 6 + 0 + 1 = 7 effective: 4 blocks, then 3 - 1
    (1, 0, ((0, 4), (4, 8))),        # 7 effective: 4 - 1 blocks, then 3
])
def test_torchtitan_takes_zero_weights_for_the_end_stages(first, last, stages, tmp_path):
    text = ACCUMULATING.format(global_batch=16).replace(
        "pipeline_parallel_degree = 4", "pipeline_parallel_degree = 2\n"
        f"pipeline_parallel_first_stage_less_layers = {first}\n"
        f"pipeline_parallel_last_stage_less_layers = {last}").replace(
        "data_parallel_replicate_degree = 2", "data_parallel_replicate_degree = 4")
    job = read_job("torchtitan", _toml(tmp_path, text))
    assert job.stages == stages


def test_megatron_accounted_layers_count_in_the_virtual_split():
    """14 blocks + embedding + loss = 16 over pp 2, 4 a virtual stage: 2 chunks a rank
    (validate_args adds the accounted layers before dividing)."""
    job = read_megatron(BASE + "--num-layers 14 --pipeline-model-parallel-size 2 "
                        "--num-layers-per-virtual-pipeline-stage 4 "
                        "--account-for-embedding-in-pipeline-split "
                        "--account-for-loss-in-pipeline-split", "m.sh")
    assert job.chunks == 2
    assert job.stages == ((0, 4), (4, 8), (8, 12), (12, 16))


def test_deepspeed_pipeline_section_not_an_object_is_refused(tmp_path, capsys):
    (tmp_path / "d.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                                 "train_batch_size": 8, "pipeline": "x"}))
    (tmp_path / "d.args").write_text(PP1)
    (tmp_path / "c.json").write_text(json.dumps(A100_NODE))
    rc, out, err = cli(capsys, ["import", "--from", "deepspeed", tmp_path / "d.json",
                                "--args", tmp_path / "d.args", "--cluster",
                                tmp_path / "c.json"])
    line = assert_one_line(rc, err, 2, "d.json", "pipeline")
    assert "mapping" in line and out == ""


def test_deepspeed_partition_that_is_not_boundaries_is_noted_as_not_read(tmp_path):
    plan, notes = _deepspeed(tmp_path, {"train_micro_batch_size_per_gpu": 1,
                                        "train_batch_size": 8,
                                        "pipeline": {"partition": "uniform"}}, MEGATRON)
    unread = notes.lines()[0]
    assert unread.startswith("not read") and "pipeline.partition uniform" in unread
    assert len(plan.pipelines[0].stages) == 2


# ------------------------------------------------------------ fp8 and tf32 models


def _in_dtype(plan, dtype: str):
    doc = plan.to_dict()
    doc["model"] = {"preset": "gpt2-small", "dtype": dtype}
    from hyperpipe.plan.plan import plan_from_dict
    return plan_from_dict(doc)


@pytest.mark.parametrize("framework, back, said", [
    ("megatron", "fp8", "--fp8-format hybrid"),
    ("torchtitan", "fp8", 'converters = ["float8"]'),
    ("deepspeed", "bf16", "cannot express: dtype fp8")])
def test_an_fp8_model_exports_as_each_framework_trains_fp8(tmp_path, framework, back, said):
    """fp8 (bf16 storage, fp8 GEMMs in the blocks' linears): Megatron-LM's
    ``--bf16 --fp8-format hybrid``, torchtitan's float8 converter over bf16 FSDP; both
    import back as fp8. Megatron-DeepSpeed has no fp8 training: bf16, said so."""
    plan = _in_dtype(plan_of("1f1b", p=2, dp=2, dist_opt=framework == "torchtitan"), "fp8")
    got, text = round_trip(plan, framework, tmp_path)
    assert said in text
    assert ("cannot express: dtype fp8" in text) == (back != "fp8")
    assert got.load_model().dtype == back
    if framework == "deepspeed":        # bf16 storage: BF16_Optimizer shards, as for bf16
        assert "BF16_Optimizer" in text


@pytest.mark.parametrize("framework", ["megatron", "torchtitan", "deepspeed"])
def test_a_tf32_model_exports_as_fp32_with_the_switch_named(tmp_path, framework):
    """tf32 has no flag in any of them: fp32, and the line says how to turn TF32 on."""
    plan = _in_dtype(plan_of("1f1b", p=2, dp=2, dist_opt=framework == "torchtitan"), "tf32")
    got, text = round_trip(plan, framework, tmp_path)
    assert "cannot express: dtype tf32" in text and "allow_tf32" in text
    assert got.load_model().dtype == "fp32"


# ------------------------------------------------------------ DeepSpeed ZeRO-2/3, pp 1
NO_PIPE = PP1 + " --no-pipeline-parallel"


def _zero_plan(zero: int, p: int):
    from dataclasses import replace
    return replace(plan_of("1f1b", p=p, dp=2, dist_opt=True), zero=zero)


@pytest.mark.parametrize("zero", [2, 3])
def test_deepspeed_zero_2_3_of_one_stage_exports_without_the_pipeline_engine(zero, tmp_path):
    """Megatron-DeepSpeed builds GPTModelPipe for DeepSpeed's pipeline engine, which
    refuses ZeRO-2/3, unless --no-pipeline-parallel: a zero 2/3 plan of one stage per
    replica exports with that flag, no partition (method, boundaries or GPTModelPipe's
    split) and overlap_comm on, and reads back as itself; with a pipeline, zero is
    named lost and no flag is written."""
    plan = _zero_plan(zero, 1)
    files = export_files(plan, "deepspeed", "job.json")
    args = read_launch(files["job.args"], "job.args").args.options
    assert "no-pipeline-parallel" in args and "pp-partition-method" not in args
    assert "GPTModelPipe" not in files["job.args"]
    assert "cannot express" not in files["job.args"]
    doc = json.loads(files["job.json"])
    assert doc["zero_optimization"] == {"stage": zero, "overlap_comm": True}
    assert "pipeline" not in doc
    got, _ = round_trip(plan, "deepspeed", tmp_path)
    assert got.zero == zero and [len(p.stages) for p in got.pipelines] == [1, 1]
    piped = "\n".join(export_files(_zero_plan(zero, 2), "deepspeed", "job.json").values())
    assert f"cannot express: zero {zero}" in piped
    assert "--no-pipeline-parallel" not in piped


@pytest.mark.parametrize("zero", [2, 3])
def test_deepspeed_zero_2_3_without_no_pipeline_parallel_is_refused(zero, tmp_path, capsys):
    """pp 1 without --no-pipeline-parallel is still DeepSpeed's pipeline engine, which
    fails at start with ZeRO-2/3: refused in one line naming the arguments' file and
    flag and the JSON's stage; with the flag the job imports."""
    doc = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 8,
           "zero_optimization": {"stage": zero}}
    (tmp_path / "d.json").write_text(json.dumps(doc))
    (tmp_path / "d.args").write_text(PP1)
    (tmp_path / "c.json").write_text(json.dumps(A100_NODE))
    argv = ["import", "--from", "deepspeed", tmp_path / "d.json", "--args",
            tmp_path / "d.args", "--cluster", tmp_path / "c.json"]
    rc, out, err = cli(capsys, argv)
    assert_one_line(rc, err, 2, "d.args: --no-pipeline-parallel",
                    f"zero_optimization.stage {zero}", "d.json")
    assert out == ""
    (tmp_path / "d.args").write_text(NO_PIPE)
    rc, out, err = cli(capsys, argv)
    assert rc == 0 and json.loads(out)["zero"] == zero


@pytest.mark.parametrize("zero, given, approximated", [
    (2, None, True), (2, True, False), (3, None, False), (3, False, True)])
def test_deepspeed_overlap_comm_without_a_pipeline_is_read(zero, given, approximated,
                                                           tmp_path):
    """ZeRO-2/3 on DeepSpeed's engine reduce-scatters the gradients from the backward
    hooks, on a stream of its own with overlap_comm (its default at stage 3 only), as
    the plan prices it; without it on the compute stream, said to be approximated. The
    plan's overlap_grad_reduce stays false: ZeRO-2's all-gather of the updated weights
    follows the optimizer step (zero/stage_1_and_2.py ``step``)."""
    section = {"stage": zero, **({} if given is None else {"overlap_comm": given})}
    plan, notes = _deepspeed(tmp_path, {"train_micro_batch_size_per_gpu": 1,
                                        "train_batch_size": 8,
                                        "zero_optimization": section}, NO_PIPE)
    assert plan.zero == zero
    assert not any("overlap_comm" in x for x in notes.unread)
    assert any("overlap_comm false: DeepSpeed reduces" in x
               for x in notes.approximated) == approximated
    assert any("overlap_comm" in x for x in notes.assumed) == (given is None)
    assert plan.runtime_settings().overlap_grad_reduce is False
    section["overlap_comm"] = "yes"
    with pytest.raises(BadInput, match="zero_optimization.overlap_comm: expected true or "
                                       "false"):
        _deepspeed(tmp_path, {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 8,
                              "zero_optimization": section}, NO_PIPE)


def test_overlap_comm_of_zero_1_and_beside_a_pipeline_stays_not_read(tmp_path):
    """Only ZeRO-2/3 reads overlap_comm (DeepSpeed's pipeline engine turns it off)."""
    _, notes = _deepspeed(tmp_path, {"train_micro_batch_size_per_gpu": 1,
                                     "train_batch_size": 8, "zero_optimization": {
                                         "stage": 1, "overlap_comm": True}}, MEGATRON)
    assert "zero_optimization.overlap_comm" in notes.unread


# ------------------------------------------------------------ fp8 import, as documented
def test_fp8_imports_as_the_fp8_dtype_as_the_docs_say(tmp_path):
    """``--fp8-format`` imports as dtype fp8 (the blocks' linears at the fp8 peak, bf16
    storage); over --fp16 it is said to be approximated as fp8 over bf16. The docs' list
    of import approximations says that, not the bf16/fp16 peak of before."""
    from pathlib import Path
    line = PP1 + " --fp8-format hybrid"
    for flag, said in (("--bf16", False), ("--fp16", True)):
        job = read_megatron(f"{line} {flag}", "m.sh")
        assert job.model["dtype"] == "fp8"
        assert any("priced as fp8 over bf16" in x for x in job.notes.approximated) == said
    doc = (Path(__file__).resolve().parents[2] / "docs" / "formats.md").read_text()
    section = doc.split("## Importing a framework job")[1].split("\n## ")[0]
    assert "fp8 at the bf16/fp16 peak" not in section
    assert "`--fp8-format` (or `--fp8`) over `--fp16` or fp32 as dtype `fp8`" in section


# ------------------------------------------------------------ torchtitan schedule classes
def test_torchtitan_dualpipev_imports_as_dualpipe_v_and_exports_by_its_name(tmp_path):
    """torch's ScheduleDualPipeV runs dualpipe-v's order: the TOML naming it imports as
    dualpipe-v (two V-placed stages per rank), and a dualpipe-v plan's export names
    DualPipeV beside its CSV, which reads back as dualpipe-v without the CSV too."""
    from hostile import TOML

    from hyperpipe.frameworks.torchtitan import read_torchtitan
    from hyperpipe.plan.plan import pipeline_placement
    got, _ = import_plan("torchtitan", _toml(tmp_path, TOML + 'pipeline_parallel_schedule = '
                                                   '"DualPipeV"\n'), load_cluster(A100_NODE))
    assert (got.schedule, got.chunks) == ("dualpipe-v", 2)
    assert pipeline_placement(got, got.pipelines[0]) == "v"
    text = export_files(plan_of("dualpipe-v", p=2, dp=2), "torchtitan", "job.toml")["job.toml"]
    assert 'pipeline_parallel_schedule = "DualPipeV"' in text
    bare = re.sub(r"pipeline_parallel_schedule_csv = .*\n", "", text)
    assert read_torchtitan(_toml(tmp_path, bare), n_layer=12).schedule == "dualpipe-v"


@pytest.mark.parametrize("name", ["LoopedBFS", "InterleavedZeroBubble", ""])
def test_torchtitan_schedules_without_a_kind_are_refused_naming_what_is_taken(
        name, tmp_path, capsys):
    from hostile import TOML
    (tmp_path / "c.json").write_text(json.dumps(A100_NODE))
    path = _toml(tmp_path, TOML + f'pipeline_parallel_schedule = "{name}"\n')
    rc, out, err = cli(capsys, ["import", "--from", "torchtitan", path, "--cluster",
                                tmp_path / "c.json"])
    assert_one_line(rc, err, 2, "job.toml: parallelism.pipeline_parallel_schedule",
                    "GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV",
                    "pipeline_parallel_schedule_csv", repr(name))
    assert out == ""
