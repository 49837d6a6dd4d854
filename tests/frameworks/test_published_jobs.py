"""Importing the published launch settings of real jobs (issue 32) reproduces the plan
`experiments/published.py` builds for the same run and simulates to the same time.

Jobs (files under tests/data/frameworks, sources in its SOURCE.md): the ten Megatron-LM
runs of Narayanan et al. SC'21 Table 1 (examples/sc21/run_table_1.sh with CONFIG.sh's
arguments and SRUN.sh's 8 tasks per node), BLOOM-176B on Megatron-DeepSpeed (its
tr11-176B-ml.slurm: DeepSpeed JSON and launch line), and torchtitan's Llama 3 8B and 70B
TOMLs. published.py has no torchtitan run: those are checked against the ``llama3-8b``
preset (Meta's config.json) and the TOML's stated degrees.

Where the import and published.py differ, the difference is asserted to be exactly the
one the launch line explains (see each test), never tolerated silently.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from factories import experiment

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.frameworks.importer import import_plan
from hyperpipe.frameworks.megatron import GPT2_VOCAB
from hyperpipe.models import load_model
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import simulate

DATA = Path(__file__).resolve().parents[1] / "data" / "frameworks"


@pytest.fixture(scope="module")
def published():
    return experiment("published")


def sc21_rows() -> dict[str, dict[str, str]]:
    """run_table_1.sh's variables per MODEL_SIZE case."""
    text = (DATA / "sc21_run_table_1.sh").read_text()
    rows = {}
    for m in re.finditer(r'MODEL_SIZE\} == "([^"]+)" \]; then(.*?)(?=\nelif|\nelse)', text,
                         re.S):
        rows[m.group(1)] = {k: v.strip('"') for k, v in
                            re.findall(r'(\w+)=("[^"]*"|\S+)', m.group(2))}
    return rows


def sc21_line(row: dict[str, str]) -> str:
    """The command SBATCH.sh/SRUN.sh start for one row: CONFIG.sh's MEGATRON_PARAMS with
    the row's variables (and CONFIG.sh's placeholders) expanded, after srun with its 8
    tasks per node (SRUN.sh: #SBATCH --ntasks-per-node=8)."""
    cfg = (DATA / "sc21_CONFIG.sh").read_text()
    params = re.search(r'export MEGATRON_PARAMS="(.*?)"', cfg, re.S).group(1)
    env = {**dict(re.findall(r"^(\w+)=(<[^>]*>)", cfg, re.M)), **row}
    params = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], params)
    return (f"srun --nodes {row['NNODES']} --ntasks-per-node 8 python -u pretrain_gpt.py "
            f"{params}")


def comparable(plan) -> dict:
    doc = plan.to_dict()
    doc["model"] = {k: v for k, v in doc["model"].items() if k != "name"}
    return doc


def test_the_ten_rows_are_read_from_the_script(published):
    rows = sc21_rows()
    assert list(rows) == ["1.7B", "3.6B", "7.5B", "18B", "39B", "76B", "145B", "310B",
                          "530B", "1T"]
    for (name, row), run in zip(rows.items(), published.RUNS, strict=True):
        assert (int(row["TP"]), int(row["PP"]), int(row["NNODES"]) * 8, int(row["GBS"]),
                int(row["MBS"])) == (run.tp, run.pp, run.gpus, run.global_batch,
                                     run.micro_batch), name


@pytest.mark.parametrize("index", range(10))
def test_sc21_table_1_imports_to_published_plan_and_time(index, published, tmp_path):
    run = published.RUNS[index]
    row = list(sc21_rows().values())[index]
    path = tmp_path / "job.sh"
    path.write_text(sc21_line(row))
    cluster = published.dgx_cluster(run.gpus // 8)
    plan, notes = import_plan("megatron", path, cluster)
    model = published.model_of(run)
    ref = published.plan_of(run, model, cluster, runtime={
        "p2p": "blocking", "overlap_grad_reduce": run.ddp == "torch"})
    got, want = comparable(plan), comparable(ref)
    # Megatron-LM pads GPT-2's 50,257 tokens to a multiple of 128 x tp: 51,200 at tp 8,
    # the vocabulary published.py gives every row (eq. (3)'s V); less below tp 8.
    padded = -(-GPT2_VOCAB // (128 * run.tp)) * (128 * run.tp)
    assert got["model"]["vocab_size"] == padded
    if run.tp < 8:
        assert padded < want["model"]["vocab_size"] == 51200
        want["model"]["vocab_size"] = padded
        model = load_model({**model.to_dict(), "vocab_size": padded})
        ref = published.plan_of(run, model, cluster, runtime={
            "p2p": "blocking", "overlap_grad_reduce": run.ddp == "torch"})
    assert got == want
    options = published.OPTIONS
    t_import = simulate(plan, CostModel(plan.load_model(), cluster), options).metrics
    t_ref = simulate(ref, CostModel(model, cluster), options).metrics
    assert t_import.iteration_time_s == t_ref.iteration_time_s
    assert any("vocabulary: GPT-2's BPE" in line for line in notes.lines())


def bloom_cluster(published):
    return published.as_measured(load_cluster({
        "name": "jean-zay-48",
        "nodes": [{"name": "jz", "device": "A100-80GB", "count": 8, "repeat": 48,
                   "nics": {"count": 4, "bandwidth": "100 Gbit/s"}}],
        "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}}))


def test_bloom_imports_to_published_plan_but_for_what_its_launch_line_says(published):
    """tr11-176B-ml.slurm: tp 4, pp 12, 48 nodes of 8 (dp 8), micro-batch 2, global 2048,
    bf16 with ZeRO stage 0 (DeepSpeed's BF16_Optimizer shards like the distributed
    optimizer), --checkpoint-activations, --pp-partition-method type:transformer|embedding.
    published.py's plan agrees on all of it. It differs where the launch line says
    otherwise: DeepSpeed's partition balances the 70 blocks and 2 embeddings 6 per stage
    (blocks 5, 6 x 10, 5; published.py: 6 x 10, 5, 5), ALiBi (no position table;
    published.py: a learned table) and Megatron-DeepSpeed's default dropout 0.1
    (published.py: none)."""
    cluster = bloom_cluster(published)
    plan, notes = import_plan("deepspeed", DATA / "bloom_176b_ds_config.json", cluster,
                              args=DATA / "bloom_176b_launch.sh")
    b = published.BLOOM
    blocks = [sum(1 for x in range(a, z) if 1 <= x <= b["layers"])
              for a, z in (s.layers for s in plan.pipelines[0].stages)]
    # the oracle: 72 weighted layers (70 blocks + 2 embeddings) in 12 equal parts
    assert blocks == [6 - 1] + [6] * 10 + [6 - 1]
    got = comparable(plan)
    _, _, m_ref = published.bloom_run()
    ref_model = {"vocab_size": b["vocab"], "n_layer": b["layers"], "d_model": b["hidden"],
                 "n_head": b["heads"], "seq_len": published.SEQ, "dtype": "bf16",
                 "attention": "eager"}
    assert {k: got["model"][k] for k in ref_model} == ref_model
    assert (got["model"]["position"], got["model"]["dropout"]) == ("rope", 0.1)
    assert got["stack"] == "megatron-deepspeed" and got["distributed_optimizer"] is True
    assert got["global_batch"] == b["global_batch"] and len(got["pipelines"]) == b["dp"]
    stage = got["pipelines"][0]["stages"][0]
    assert (stage["tp"], stage.get("recompute"), got["pipelines"][0]["micro_batch"]) == \
        (b["tp"], "full", b["micro_batch"])
    assert len(got["pipelines"][0]["stages"]) == b["pp"]
    # devices as published.py places them: pipeline outer, data, tensor inner
    devices = [d.name for d in cluster.devices]
    for r, pipe in enumerate(got["pipelines"]):
        for k, st in enumerate(pipe["stages"]):
            assert st["devices"] == devices[(k * b["dp"] + r) * 4:(k * b["dp"] + r + 1) * 4]
    lines = "\n".join(notes.lines())
    assert "alibi" in lines and "--embed-layernorm" in lines and "--rampup" in lines
    m = simulate(plan, CostModel(plan.load_model(), cluster), published.OPTIONS).metrics
    assert m.iteration_time_s > 0 and m_ref.iteration_time_s > 0


@pytest.mark.parametrize("flavor, toml, tp, recompute, local",
                         [("8B", "llama3_8b.toml", 1, "selective", 1),
                          ("70B", "llama3_70b.toml", 8, "full", 8)])
def test_torchtitan_llama3_tomls_import_as_stated(flavor, toml, tp, recompute, local):
    """The TOMLs' note: 64 A100 GPUs. FSDP over every rank left after tp (shard -1)."""
    cluster = load_cluster({"name": "a100x64", "nodes": [
        {"name": "dgx", "device": "A100-80GB", "count": 8, "repeat": 8}]})
    plan, notes = import_plan("torchtitan", DATA / toml, cluster)
    dp = 64 // tp
    assert (len(plan.pipelines), plan.pipelines[0].stages[0].tp) == (dp, tp)
    assert [p.micro_batch for p in plan.pipelines] == [local] * dp
    assert plan.global_batch == local * dp and plan.zero == 3
    assert plan.pipelines[0].stages[0].recompute == recompute
    assert plan.pipelines[0].stages[0].sequence_parallel == (tp > 1)
    lines = "\n".join(notes.lines())
    assert "training.batch_size read as local_batch_size" in lines
    spec = plan.load_model()
    if flavor == "8B":          # torchtitan's flavour against Meta's config.json (preset)
        preset = load_model("llama3-8b").config
        for key in ("vocab_size", "n_layer", "n_head", "d_model", "ffn_hidden", "n_kv_head",
                    "mlp", "norm", "position", "rope_theta", "bias", "seq_len"):
            assert getattr(spec.config, key) == getattr(preset, key), key
    else:                       # Llama 3 70B: 80 layers, 8192 wide, 64 heads, GQA 8, 28672
        c = spec.config
        assert (c.n_layer, c.d_model, c.n_head, c.n_kv_head, c.ffn_hidden) == \
            (80, 8192, 64, 8, 28672)
    m = simulate(plan, CostModel(spec, cluster)).metrics
    assert m.iteration_time_s > 0


def ds3lab_line(layers: int, batch: int, pp: int, tp: int) -> str:
    """Yuan et al.'s launch line for one row, with `--vocab-size` added: the BERT cased
    vocabulary's 28,996 tokens, which the importer cannot read off a WordPiece file."""
    env = {"num_layers": layers, "global_batch_size": batch, "MICRO_BATCH_SIZE": 1,
           "TENSOR_PARALLEL_SIZE": tp, "PIPELINE_PARALLEL_SIZE": pp, "NODE_RANK": 0,
           "MASTER_ADDR": "10.0.0.1"}
    line = (DATA / "ds3lab_megatron_gpt3_xl.sh").read_text().strip()
    return re.sub(r"\$(\w+)", lambda m: str(env[m.group(1)]), line) + " --vocab-size 28996"


@pytest.mark.parametrize("pp,tp", [(8, 1), (1, 8), (4, 2), (2, 4)])
def test_ds3lab_runs_import_to_published_plan_but_the_head(pp, tp, published, tmp_path):
    """published.py's plans of Yuan et al.'s runs (its `ds3lab` block) are what the
    importer reads off their launch line, but for what the line cannot say: the script
    it runs trains Megatron's Classification model, so the block's head has 2 outputs
    and no tie where the import has the padded vocabulary's logits, tied. With the
    import's head the block's plan is the import's, and simulates to its time."""
    assert (24, 1024, pp, tp) in {row[:4] for row in published.DS3LAB_CASE1}
    path = tmp_path / "job.sh"
    path.write_text(ds3lab_line(24, 1024, pp, tp))
    cluster = published.p3_cluster()
    plan, notes = import_plan("megatron", path, cluster)
    _, model, ref = published.ds3lab_plan(24, 1024, pp, tp, cluster)
    got, want = comparable(plan), comparable(ref)
    head = {"vocab_size", "tie_embeddings"}
    assert {k: got["model"].pop(k) for k in head} == \
        {"vocab_size": {1: 29056, 2: 29184, 4: 29184, 8: 29696}[tp], "tie_embeddings": True}
    assert {k: want["model"].pop(k) for k in head} == \
        {"vocab_size": published.DS3LAB_CLASSES, "tie_embeddings": False}
    assert got == want
    options = published.OPTIONS
    lm = load_model({**model.to_dict(), "vocab_size": plan.load_model().config.vocab_size,
                     "tie_embeddings": True})
    as_imported = simulate(plan, CostModel(plan.load_model(), cluster), options).metrics
    with_lm_head = simulate(replace(ref, model=lm.to_dict()), CostModel(lm, cluster),
                            options).metrics
    assert with_lm_head.iteration_time_s == as_imported.iteration_time_s
    assert any("--DDP-impl local" in line for line in notes.lines())
