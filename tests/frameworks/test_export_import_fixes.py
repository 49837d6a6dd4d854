"""Exports of plans the frameworks cannot hold as they are, and launch lines that are more
than one command: a search's plan whose global batch does not divide over
its replicas, replicas of unequal micro-batch counts or sizes, mixed tensor-parallel
degrees whose export needs more devices than the cluster has, a DeepSpeed JSON named
like its launch arguments; a Megatron-LM line that runs a preparation script before
torchrun, and virtual pipeline stages without a pipeline."""

from __future__ import annotations

import json

import pytest
from hostile import assert_one_line, cli

MODEL = ("--num-layers 6 --hidden-size 128 --num-attention-heads 4 --seq-length 64 "
         "--vocab-size 256 --micro-batch-size 2 --global-batch-size 16")


def _pipe(mb: int, m: int, stages: list[tuple[int, int, list[str]]]) -> dict:
    return {"micro_batch": mb, "num_microbatches": m,
            "stages": [{"layers": [a, b], "devices": d, "tp": len(d)} for a, b, d in stages]}


def _plan(pipes: list[dict], *, global_batch: int, cluster="a100-v100",
          kind: str = "1f1b") -> dict:
    return {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": cluster,
            "global_batch": global_batch, "schedule": {"kind": kind, "chunks": 1},
            "pipelines": pipes}


# `hyperpipe search --cluster a100-v100 --model tiny-gpt --global-batch 14`'s pick: four
# replicas of micro-batches of 2, three with 2 and one with 1 (14 is not 2 x 4 x m)
SEARCHED = _plan([_pipe(2, 2 if r < 3 else 1,
                        [(0, 2, [f"a100/{2 * r}"]), (2, 4, [f"a100/{2 * r + 1}"]),
                         (4, 6, [f"v100/{2 * r}"]), (6, 8, [f"v100/{2 * r + 1}"])])
                  for r in range(4)], global_batch=14, kind="zb-h1")
# replicas of 10 and 6 micro-batches, their own layouts, tp 2 and 1
UNEQUAL = _plan([_pipe(2, 10, [(0, 5, ["a100/0", "a100/1"]), (5, 8, ["v100/0"])]),
                 _pipe(2, 6, [(0, 3, ["v100/1"]), (3, 6, ["v100/2"]), (6, 8, ["v100/3"])])],
                global_batch=32)
# replicas of micro-batches of 4 and 2 (24 = 2 x 4 x 3 as the frameworks split it)
SIZES = _plan([_pipe(4, 4, [(0, 8, ["a100/0"])]), _pipe(2, 4, [(0, 8, ["v100/0"])])],
              global_batch=24, cluster="demo-hetero")
# tp 2 then tp 1 on three devices: the export's one tp (2) needs four
THREE = {"nodes": [{"name": "a100", "device": "A100-80GB", "count": 1},
                   {"name": "v100", "device": "V100-32GB", "count": 2}],
         "inter_node": {"bandwidth": "10 Gbit/s", "latency": "10 us"}}
MIXED_TP = _plan([_pipe(2, 8, [(0, 4, ["v100/0", "v100/1"]), (4, 8, ["a100/0"])])],
                 global_batch=16, cluster=THREE)

FRAMEWORKS = {"megatron": "x.sh", "deepspeed": "x.json", "torchtitan": "x.toml"}


def _export(tmp_path, capsys, doc: dict, framework: str) -> tuple[str, dict[str, str]]:
    """Export `doc` with --out; (the header's `# c...` lines, the files written)."""
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps(doc))
    out = tmp_path / "out"
    out.mkdir()
    rc, _, err = cli(capsys, ["export", "--plan", plan, "--to", framework,
                              "--out", out / FRAMEWORKS[framework]])
    assert rc == 0, err
    assert "Traceback" not in err and "error" not in err, err
    files = {p.name: p.read_text() for p in out.iterdir()}
    head = "\n".join(x for text in files.values() for x in text.splitlines()
                     if x.startswith(("# cannot express:", "# cost:")))
    return head, files


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_a_searched_plan_whose_batch_does_not_divide_exports_and_says_so(
        framework, tmp_path, capsys):
    """It exited 2 naming a temp file (the cost of a lossy export was not caught): now
    the export is written, says the batch is lost, and does not price what the framework
    refuses."""
    head, _ = _export(tmp_path, capsys, SEARCHED, framework)
    assert "# cannot express: replica 3 takes 1 x 2 samples" in head
    assert "# cannot express: global batch 14, not a multiple of micro-batch x " \
        "data-parallel degree = 2 x 4" in head
    cost = [x for x in head.splitlines() if x.startswith("# cost:")]
    assert len(cost) == 1 and cost[0].startswith(
        "# cost: not simulated: the framework would refuse the export on the plan's "
        f"cluster ({FRAMEWORKS[framework]}: global batch: expected a multiple"), cost
    assert "hyperpipe-export-" not in head


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
@pytest.mark.parametrize("doc, share", [(UNEQUAL, "(8 x 2)"), (SIZES, "(3 x 4)")])
def test_unequal_replicas_export_the_frameworks_even_share(doc, share, framework,
                                                           tmp_path, capsys):
    """Replica 0's micro-batch count was written as every replica's (DeepSpeed's
    gradient_accumulation_steps, torchtitan's local batch), which the frameworks refuse
    beside the global batch: the export now writes the even share they run, and prices
    it."""
    head, files = _export(tmp_path, capsys, doc, framework)
    assert "the framework gives every replica the same share of the batch " + share in head
    cost = [x for x in head.splitlines() if x.startswith("# cost:")]
    assert len(cost) == 1 and cost[0].startswith("# cost: the export runs "), cost
    count, micro = (int(x) for x in share.strip("()").split(" x "))
    if framework == "deepspeed":
        config = json.loads(files["x.json"])
        assert (config["gradient_accumulation_steps"],
                config["train_micro_batch_size_per_gpu"]) == (count, micro)
    if framework == "torchtitan" and "pipeline_parallel_degree = 1" not in files["x.toml"]:
        assert f"local_batch_size = {count * micro}" in files["x.toml"]


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_mixed_tensor_parallel_degrees_beyond_the_cluster_export_unpriced(
        framework, tmp_path, capsys):
    head, _ = _export(tmp_path, capsys, MIXED_TP, framework)
    assert "# cannot express: stages use different tensor-parallel degrees [1, 2]" in head
    assert f"# cost: not simulated: the framework would refuse the export on the plan's " \
        f"cluster ({FRAMEWORKS[framework]}: world size: expected at most the 3 devices" in head


def test_a_deepspeed_json_named_like_its_launch_arguments_is_refused(tmp_path, capsys):
    """``--out y.args`` named the JSON and the launch arguments alike: a StopIteration
    traceback (exit 1). Now one line, exit 2, nothing written."""
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps(SIZES))
    out = tmp_path / "out"
    out.mkdir()
    rc, _, err = cli(capsys, ["export", "--plan", plan, "--to", "deepspeed",
                              "--out", out / "y.args"])
    assert_one_line(rc, err, 2, "--out", "y.args", "y.json")
    assert list(out.iterdir()) == []


def _import(tmp_path, capsys, line: str) -> tuple[int, str, str]:
    (tmp_path / "job.sh").write_text(line + "\n")
    return cli(capsys, ["import", "--from", "megatron", tmp_path / "job.sh",
                        "--cluster", "a100-v100"])


def test_the_training_command_of_a_two_command_line_is_read(tmp_path, capsys):
    """``python prep.py ... && torchrun --nproc_per_node 2 pretrain_gpt.py ...``: the
    import took prep.py as the script and ran the job on all 16 devices; it runs on
    torchrun's 2."""
    rc, out, err = _import(tmp_path, capsys, "python prep.py --x 1 && torchrun "
                           f"--nproc_per_node 2 pretrain_gpt.py {MODEL}")
    assert rc == 0, err
    plan = json.loads(out)
    assert [p["stages"][0]["devices"] for p in plan["pipelines"]] == \
        [["a100/0"], ["a100/1"]]
    assert "--x" not in err and "prep.py" not in err
    # a step before the job, its log piped to tee: the same job
    rc, again, err = _import(tmp_path, capsys, "cd /data && torchrun --nproc_per_node 2 "
                             f"pretrain_gpt.py {MODEL} | tee log")
    assert rc == 0, err
    assert json.loads(again)["pipelines"] == plan["pipelines"]


def test_two_training_commands_are_refused_in_one_line(tmp_path, capsys):
    rc, out, err = _import(tmp_path, capsys, f"torchrun --nproc_per_node 2 pretrain_gpt.py "
                           f"{MODEL} ; torchrun --nproc_per_node 4 pretrain_gpt.py {MODEL}")
    assert_one_line(rc, err, 2, "job.sh", "launch line", "one training command")
    assert out == ""


@pytest.mark.parametrize("flag", ["--num-layers-per-virtual-pipeline-stage 2",
                                  "--num-virtual-stages-per-pipeline-rank 3",
                                  "--virtual-pipeline-model-parallel-size 3",
                                  '--pipeline-model-parallel-layout "Ett|tt|ttL"'])
def test_virtual_stages_without_a_pipeline_are_refused(flag, tmp_path, capsys):
    """Megatron-LM's initialize_model_parallel refuses a virtual pipeline size with
    pipeline-model-parallel size 1; the import made an interleaved plan on one device."""
    rc, out, err = _import(tmp_path, capsys,
                           f"torchrun --nproc_per_node=2 pretrain_gpt.py {MODEL} {flag}")
    assert_one_line(rc, err, 2, "job.sh", flag.split()[0],
                    "--pipeline-model-parallel-size 1")
    assert out == ""
