"""The frameworks' own code accepts each export (issue 32), and agrees with the
importer's reading of their conventions. Marked `frameworks`: they need
``pip install -e '.[frameworks]'`` (CI installs it; see conftest.py).

- torchtitan: its ConfigManager loads every exported TOML; its own default split
  (``generate_llm_fqn_per_model_part``) equals the importer's `split_stages`.
- megatron-core: ``TransformerConfig`` accepts the exported parallel and layout settings
  (it validates the layout string) and its layout parser reads our stages back.
- DeepSpeed: ``DeepSpeedConfig`` loads the exported JSON, and a ``PipelineModule`` built
  from GPTModelPipe's layer list with the exported partition (method or explicit
  ``pipeline.partition``) gives each rank the plan's layers, on real gloo ranks; its
  ``partition_uniform`` and ``partition_balanced`` equal the importer's.
"""

from __future__ import annotations

import random
import warnings

import pytest
from test_round_trip import plan_of

from hyperpipe.frameworks import deepspeed as ds
from hyperpipe.frameworks.export import export_files
from hyperpipe.frameworks.job import Notes, stage_units
from hyperpipe.frameworks.launch import read_launch
from hyperpipe.frameworks.torchtitan import split_stages
from hyperpipe.plan.kinds import KINDS
from hyperpipe.plan.plan import pipeline_placement

pytestmark = pytest.mark.frameworks


def _args(text: str) -> dict[str, list[str]]:
    """The launch file's script arguments (flag -> values)."""
    return read_launch(text, "export").args.options


# ------------------------------------------------------------------ torchtitan
@pytest.mark.parametrize("kind", list(KINDS))
def test_torchtitan_config_manager_loads_every_export(kind, tmp_path, monkeypatch):
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.pipeline_parallel import get_schedule_class

    plan = plan_of(kind, p=2, dp=2, recompute="full")
    files = export_files(plan, "torchtitan", "job.toml")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)                # torchtitan opens the CSV from its cwd
    cfg = ConfigManager().parse_args(["--job.config_file", "job.toml"])
    par = cfg.parallelism
    assert (par.pipeline_parallel_degree, par.data_parallel_replicate_degree,
            par.tensor_parallel_degree) == (2, 2, 1)
    assert par.pipeline_parallel_microbatch_size == 2
    assert cfg.training.local_batch_size == 2 * 4 and cfg.training.global_batch_size == 16
    assert cfg.activation_checkpoint.mode == "full"
    assert (tmp_path / par.pipeline_parallel_schedule_csv).is_file()
    parts = par.module_fqns_per_model_part
    assert len(parts) == len(plan.pipelines[0].stages)
    assert [m for part in parts for m in part] == \
        ["tok_embeddings", *[f"layers.{i}" for i in range(12)], "norm", "output"]
    cls = get_schedule_class(par.pipeline_parallel_schedule)
    v = cls.__name__ in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    assert v == (pipeline_placement(plan, plan.pipelines[0]) == "v")


@pytest.mark.parametrize("stages, layers, w_in, w_out",
                         [(2, 12, 1, 1), (4, 12, 1, 1), (8, 32, 1, 1), (3, 7, 2, 1),
                          (6, 80, 1, 2), (1, 5, 1, 1)])
def test_torchtitan_default_split_equals_ours(stages, layers, w_in, w_out):
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
    theirs = generate_llm_fqn_per_model_part(stages, layers, w_in, w_out)
    assert [sum(m.startswith("layers.") for m in part) for part in theirs] == \
        split_stages(stages, layers, w_in, w_out)


# ------------------------------------------------------------------ megatron-core
@pytest.mark.parametrize("kind, p, dp, tp", [("1f1b", 4, 1, 1), ("1f1b", 2, 2, 2),
                                             ("interleaved-1f1b", 2, 2, 1),
                                             ("gpipe", 4, 2, 1)])
def test_megatron_core_accepts_the_parallel_and_layout_settings(kind, p, dp, tp):
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )
        from megatron.core.transformer.transformer_config import TransformerConfig
    plan = plan_of(kind, p=p, dp=dp, tp=tp, recompute="full", dist_opt=True)
    text = export_files(plan, "megatron", "job.sh")["job.sh"]
    a = _args(text)

    def one(flag: str):
        return int(a[flag][0]) if flag in a else None

    layout = a.get("pipeline-model-parallel-layout", [None])[0]
    per_virtual = one("num-layers-per-virtual-pipeline-stage")
    kwargs = dict(
        num_layers=one("num-layers"), hidden_size=one("hidden-size"),
        num_attention_heads=one("num-attention-heads"),
        ffn_hidden_size=one("ffn-hidden-size"),
        tensor_model_parallel_size=one("tensor-model-parallel-size"),
        pipeline_model_parallel_size=one("pipeline-model-parallel-size"),
        num_layers_in_first_pipeline_stage=one("decoder-first-pipeline-num-layers"),
        num_layers_in_last_pipeline_stage=one("decoder-last-pipeline-num-layers"),
        pipeline_model_parallel_layout=layout,
        sequence_parallel="sequence-parallel" in a,
        recompute_granularity=a.get("recompute-granularity", [None])[0],
        recompute_method=a.get("recompute-method", [None])[0],
        recompute_num_layers=one("recompute-num-layers"),
        bf16="bf16" in a, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    if per_virtual is not None:
        kwargs["virtual_pipeline_model_parallel_size"] = \
            kwargs["num_layers"] // (p * per_virtual)
    cfg = TransformerConfig(**kwargs)
    assert cfg.pipeline_model_parallel_size == p and cfg.tensor_model_parallel_size == tp
    stages = tuple(s.layers for s in plan.pipelines[0].stages)
    if layout is not None:     # megatron-core's own parser gives back our stages' units
        units = PipelineParallelLayerLayout.parse_str_to_list(layout)
        assert ["".join(str(u.value) for u in stage) for stage in units] and \
            ["".join({"embedding": "E", "decoder": "t", "loss": "L"}[u.name] for u in stage)
             for stage in units] == stage_units(stages, 12)
        assert (cfg.virtual_pipeline_model_parallel_size or 1) == plan.chunks


def test_megatron_core_refuses_a_layout_that_loses_the_head():
    """The acceptance above can fail: a layout without the loss is refused."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    with pytest.raises(AssertionError, match="last layer must be loss"):
        TransformerConfig(num_layers=12, hidden_size=64, num_attention_heads=4,
                          pipeline_model_parallel_size=2,
                          pipeline_model_parallel_layout="Etttttt|tttttt",
                          pipeline_dtype=torch.float32)


# ------------------------------------------------------------------ DeepSpeed
def test_deepspeed_partition_functions_equal_ours():
    from deepspeed.runtime import utils as ds_utils
    rng = random.Random(32)
    for _ in range(200):
        n, parts = rng.randint(1, 40), rng.randint(1, 12)
        weights = [rng.choice([0, 0, 1, 2, 5, rng.randint(0, 100)]) for _ in range(n)]
        assert ds.partition_balanced(weights, parts) == \
            [int(x) for x in ds_utils.partition_balanced(weights, parts)], (weights, parts)
        assert ds.partition_uniform(n, parts) == \
            [int(x) for x in ds_utils.partition_uniform(n, parts)]


def _pipeline_rank(rank, world, store, cases):
    """One gloo rank: DeepSpeed's config and PipelineModule for each exported case."""
    import json
    import os

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)      # PipelineModule reads it (one node here)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.config import DeepSpeedConfig
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)

    class EmbeddingPipe(torch.nn.Linear):
        pass

    class ParallelTransformerLayerPipe(torch.nn.Linear):
        pass

    class LayerNorm(torch.nn.LayerNorm):
        pass

    def _to_float16(x):
        return x

    def float16_to_fp32(x):
        return x

    class PlannedPipe(PipelineModule):
        """The exported launch file's subclass: the JSON's explicit boundaries."""

        def __init__(self, parts, **kw):
            self.planned = parts
            super().__init__(**kw)

        def _partition_layers(self, method="uniform"):
            self.parts = self.planned
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    out = []
    for config, method, n, pp, dp in cases:
        specs = [_to_float16, TiedLayerSpec("embed", EmbeddingPipe, 4, 4), lambda x: x]
        specs += [LayerSpec(ParallelTransformerLayerPipe, 4, 4) for _ in range(n)]
        specs += [lambda x: x, LayerSpec(LayerNorm, 4),
                  TiedLayerSpec("embed", EmbeddingPipe, 4, 4), float16_to_fp32]
        mpu = type("Mpu", (), {"get_data_parallel_world_size":
                               staticmethod(lambda dp=dp: dp)})
        cfg = DeepSpeedConfig(json.loads(config), mpu=mpu)
        explicit = cfg.pipeline.get("partition")
        if isinstance(explicit, list):
            module = PlannedPipe(explicit, layers=specs, num_stages=pp,
                                 loss_fn=lambda a, b: a)
        else:
            module = PipelineModule(layers=specs, num_stages=pp, partition_method=method,
                                    loss_fn=lambda a, b: a)
        out.append((cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                    cfg.gradient_accumulation_steps, [int(x) for x in module.parts],
                    int(module._local_start), int(module._local_stop)))
    dist.destroy_process_group()
    return out


def _split(plan, ranges):
    """`plan` with its pipelines' stages cut at `ranges` instead."""
    from hyperpipe.plan.plan import plan_from_dict
    doc = plan.to_dict()
    for pipe in doc["pipelines"]:
        for stage, rng in zip(pipe["stages"], ranges, strict=True):
            stage["layers"] = list(rng)
    return plan_from_dict(doc)


@pytest.mark.slow
def test_deepspeed_builds_the_plans_stages_on_real_ranks(tmp_path):
    """On 4 gloo ranks: an uneven 4-stage plan (explicit pipeline.partition through the
    exported subclass) and a 2-stage plan that DeepSpeed's own type:transformer method
    cuts (the export names the method; DeepSpeed's partitioner runs)."""
    from hyperpipe.exec.launch import RunFailed, launch_local
    plans = [plan_of("1f1b", p=4, dp=1), _split(plan_of("1f1b", p=2, dp=2),
                                                [(0, 7), (7, 14)])]
    cases = []
    for plan in plans:
        files = export_files(plan, "deepspeed", "job.json")
        a = _args(files["job.args"])
        method = a.get("pp-partition-method", [None])[0]
        assert (method is None) == ('"partition"' in files["job.json"])
        p = plan.num_devices()
        cases.append((files["job.json"], method, 12, p, 4 // p))
    assert [c[1] for c in cases] == [None, "type:transformer"]
    try:
        results = launch_local(_pipeline_rank, (cases,), [f"n/{r}" for r in range(4)])
    except RunFailed as exc:          # the rank's traceback, not only its last line
        raise AssertionError(exc.details) from None
    for c, plan in enumerate(plans):
        dp = len(plan.pipelines)
        mb, m = plan.pipelines[0].micro_batch, plan.pipelines[0].num_microbatches
        stages = [s.layers for s in plan.pipelines[0].stages]
        for rank, rows in enumerate(results):
            total, micro, steps, parts, start, stop = rows[c]
            assert (total, micro, steps) == (plan.global_batch, mb, m)
            stage = rank // dp                         # pipe outermost, then data
            assert (start, stop) == (parts[stage], parts[stage + 1])
            assert list(ds.stages_of(parts, 12, "", Notes())) == stages
            assert parts == ds.parts_of(tuple(stages), 12, True)


@pytest.mark.parametrize("ranges, method", [([(0, 7), (7, 14)], "type:transformer"),
                                            ([(0, 8), (8, 14)], "uniform"),
                                            ([(0, 5), (5, 14)], None)])
def test_deepspeed_export_names_the_method_that_gives_the_stages(ranges, method):
    """GPTModelPipe of 12 blocks in bf16 has 19 entries: uniform cuts them 10 + 9
    (layers (0, 8) and (8, 14)); type:transformer cuts the blocks 6 + 6 ((0, 7), (7, 14));
    (0, 5) is neither, so the JSON carries the boundaries."""
    from deepspeed.runtime import utils as ds_utils
    plan = _split(plan_of("1f1b", p=2, dp=2), ranges)
    files = export_files(plan, "deepspeed", "job.json")
    named = _args(files["job.args"]).get("pp-partition-method", [None])[0]
    assert named == method
    assert ('"partition"' in files["job.json"]) == (method is None)
    if method == "uniform":
        assert [int(x) for x in ds_utils.partition_uniform(19, 2)] == \
            ds.parts_of(tuple(ranges), 12, True)


def test_deepspeed_reads_the_zero_export_and_the_overlap_default_the_import_assumes():
    """DeepSpeed's ZeRO config: overlap_comm defaults to true at stage 3 only (what the
    import assumes where the JSON is silent), and the export of a zero 2 plan without a
    pipeline turns it on."""
    import json
    from dataclasses import replace

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    assert [DeepSpeedZeroConfig(stage=z).overlap_comm for z in (1, 2, 3)] == \
        [False, False, True]
    plan = replace(plan_of("1f1b", p=1, dp=2, dist_opt=True), zero=2)
    doc = json.loads(export_files(plan, "deepspeed", "job.json")["job.json"])
    cfg = DeepSpeedZeroConfig(**doc["zero_optimization"])
    assert (cfg.stage, cfg.overlap_comm) == (2, True)
