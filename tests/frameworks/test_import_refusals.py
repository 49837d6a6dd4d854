"""What `hyperpipe import` refuses (exit 2, one line naming the file and the setting) and
what it imports with a stated approximation (docs/formats.md, "Importing a framework
job"): nothing is dropped silently."""

from __future__ import annotations

import json

import pytest
from factories import A100_NODE
from hostile import DS_JSON, MEGATRON, TOML, assert_one_line, cli


def _files(tmp_path, framework: str, change: str) -> list[str]:
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(A100_NODE))
    if framework == "megatron":
        (tmp_path / "m.sh").write_text(MEGATRON + " " + change)
        return ["import", "--from", "megatron", str(tmp_path / "m.sh"), "--cluster",
                str(cluster)]
    if framework == "torchtitan":
        (tmp_path / "t.toml").write_text(TOML + change)
        return ["import", "--from", "torchtitan", str(tmp_path / "t.toml"), "--cluster",
                str(cluster)]
    doc = json.loads(json.dumps(DS_JSON))
    if change:
        doc["zero_optimization"]["stage"] = int(change)
    (tmp_path / "d.json").write_text(json.dumps(doc))
    (tmp_path / "d.args").write_text(MEGATRON)
    return ["import", "--from", "deepspeed", str(tmp_path / "d.json"), "--args",
            str(tmp_path / "d.args"), "--cluster", str(cluster)]


@pytest.mark.parametrize("framework, change, needle", [
    ("megatron", "--num-experts 8", "mixture-of-experts"),
    ("megatron", "--expert-model-parallel-size 2", "mixture-of-experts"),
    ("megatron", "--num-layers $NLS", "--num-layers"),
    ("megatron", "--pipeline-model-parallel-layout Etx|ttL", "E, t and L"),
    ("megatron", "--pipeline-model-parallel-layout Ett|tL", "4 blocks"),
    ("megatron", "--decoder-first-pipeline-num-layers 3 --pipeline-model-parallel-size 3",
     "first/last"),
    ("torchtitan", "expert_parallel_degree = 2\n", "expert_parallel_degree"),
    ("torchtitan", 'module_fqns_per_model_part = [["tok_embeddings", "layers.0"], '
     '["layers.2", "layers.3", "layers.4", "layers.5", "norm", "output"]]\n',
     "module_fqns_per_model_part"),
    ("deepspeed", "2", "zero_optimization.stage"),
    ("deepspeed", "3", "ZeRO-3"),
    ("deepspeed", "5", "zero_optimization.stage: expected 0, 1, 2 or 3"),
])
def test_what_cannot_be_modelled_is_refused_in_one_line(framework, change, needle,
                                                        tmp_path, capsys):
    rc, out, err = cli(capsys, _files(tmp_path, framework, change))
    assert_one_line(rc, err, 2, needle)
    assert out == ""


def test_fsdp_imports_as_zero_3_and_hsdp_names_its_approximation(tmp_path, capsys):
    toml = TOML.replace("data_parallel_shard_degree = 1", "data_parallel_shard_degree = -1")
    fsdp = toml.replace("data_parallel_replicate_degree = 4", "")
    cluster = _write(tmp_path, "c.json", json.dumps(A100_NODE))
    rc, out, err = cli(capsys, ["import", "--from", "torchtitan",
                                str(_write(tmp_path, "f.toml", fsdp)), "--cluster",
                                str(cluster)])
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["zero"] == 3 and len(plan["pipelines"]) == 4
    assert not any("FSDP" in note for note in plan.get("notes", []))
    hsdp = toml.replace("data_parallel_replicate_degree = 4",
                        "data_parallel_replicate_degree = 2")
    rc, out, err = cli(capsys, ["import", "--from", "torchtitan",
                                str(_write(tmp_path, "h.toml", hsdp)), "--cluster",
                                str(cluster)])
    assert rc == 0, err
    line = next(x for x in err.splitlines() if "approximated:" in x)
    assert "HSDP (data_parallel_replicate_degree 2" in line and "ZeRO-3" in line
    assert json.loads(out)["zero"] == 3


def test_unknown_flags_are_named_not_dropped(tmp_path, capsys):
    rc, out, err = cli(capsys, _files(tmp_path, "megatron", "--lr 1e-4 --made-up-flag 3"))
    assert rc == 0, err
    line = next(x for x in err.splitlines() if "not read" in x)
    assert "--lr" in line and "--made-up-flag" in line
    assert line in [f"hyperpipe import: {n}" for n in json.loads(out)["notes"]]


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_megatron_deepspeed_refuses_context_parallelism(tmp_path, capsys):
    """Megatron-DeepSpeed has no ring attention (its sequence parallelism is Ulysses):
    a --context-parallel-size there is refused in one line naming the flag."""
    args = _files(tmp_path, "deepspeed", "")
    (tmp_path / "d.args").write_text(MEGATRON.rstrip() + " --context-parallel-size 2\n")
    rc, out, err = cli(capsys, args)
    assert_one_line(rc, err, 2, "--context-parallel-size")
    assert out == ""


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_deepspeed_accumulation_steps_must_make_the_batch(steps, tmp_path, capsys):
    """DeepSpeed requires train_batch_size = micro-batch x gradient_accumulation_steps x
    data-parallel ranks: 8 = 1 x 2 x 4 on the 8 GPUs at pp 2, so only 2 steps import;
    1 and 3 are refused in one line naming the field."""
    args = _files(tmp_path, "deepspeed", "")
    doc = json.loads((tmp_path / "d.json").read_text())
    (tmp_path / "d.json").write_text(json.dumps({**doc, "gradient_accumulation_steps": steps}))
    rc, out, err = cli(capsys, args + ["--out", str(tmp_path / "p.json")])
    if steps == 2:
        assert rc == 0
        plan = json.loads((tmp_path / "p.json").read_text())
        assert {p["num_microbatches"] for p in plan["pipelines"]} == {2}
    else:
        assert_one_line(rc, err, 2, "gradient_accumulation_steps")
        assert not (tmp_path / "p.json").exists()


def test_deepspeed_keys_inside_the_read_sections_are_named_not_dropped(tmp_path, capsys):
    """An offload or a loss scale inside `zero_optimization` or `fp16` changes the job
    but is not modelled: it is listed as not read, as an unknown top-level key is."""
    args = _files(tmp_path, "deepspeed", "")
    doc = json.loads((tmp_path / "d.json").read_text())
    doc["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    doc.setdefault("fp16", {"enabled": False})["loss_scale_window"] = 500
    (tmp_path / "d.json").write_text(json.dumps(doc))
    rc, out, err = cli(capsys, args)
    assert rc == 0, err
    line = next(x for x in err.splitlines() if "not read" in x)
    assert "zero_optimization.offload_optimizer" in line
    assert "fp16.loss_scale_window" in line
    assert "zero_optimization.stage" not in line and "fp16.enabled" not in line
