"""Model specs: costs against published numbers and torch's FLOP counter, stages that
build alone equal to the whole model, loading and its errors."""

from __future__ import annotations

import doctest
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import hyperpipe.models.spec as spec_module
from hyperpipe.core.errors import BadInput
from hyperpipe.models import (
    DTYPE_BYTES,
    PRESETS,
    GPTConfig,
    ModelSpec,
    SyntheticLayer,
    TransformerBlock,
    build_layer,
    build_model,
    build_stage,
    example_batch,
    load_model,
)

# Published parameter counts. GPT-3 (Brown et al. 2020, table 2.1) ties the LM head to
# the embedding, as the presets do (`tie_embeddings`: the matrix counted once). Llama
# checkpoints are untied: counts of the released weights as the Hugging Face hub reports
# them (meta-llama/Llama-2-*-hf, Meta-Llama-3-8B). The flag says which the preset is.
PUBLISHED = {
    "gpt3-1.3b": (1.3e9, True), "gpt3-2.7b": (2.7e9, True), "gpt3-6.7b": (6.7e9, True),
    "gpt3-13b": (13.0e9, True), "gpt3-175b": (175.0e9, True),
    "llama2-7b": (6.74e9, False), "llama2-13b": (13.0e9, False),
    "llama2-70b": (69.0e9, False), "llama3-8b": (8.03e9, False),
}


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------- params

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_spec_params_equal_built_model(name):
    spec = load_model(name)
    with torch.device("meta"):          # shapes only: 175B parameters cost nothing
        model = build_model(spec, seed=0)
    assert _numel(model) == spec.params
    for i in (0, 1, spec.num_layers - 1):
        with torch.device("meta"):
            assert _numel(build_layer(spec, i, seed=0)) == spec.layers[i].params


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_params_match_published_counts(name):
    published, tied = PUBLISHED[name]
    spec = load_model(name)
    assert spec.config.tie_embeddings == tied
    assert abs(spec.params - published) / published < 0.02, (spec.params, published)


def test_module_docstring_examples():
    assert doctest.testmod(spec_module).failed == 0


# --------------------------------------------------------------------------- FLOPs

def _counted_flops(spec: ModelSpec, micro_batch: int) -> tuple[int, int]:
    """(forward, backward) FLOPs that torch's FlopCounterMode sees for one micro-batch."""
    torch.manual_seed(0)
    model = build_model(spec, seed=0)
    x, y = example_batch(spec, micro_batch, seed=0)
    with FlopCounterMode(display=False) as counter:
        loss = model(x, y)
        fwd = counter.get_total_flops()
        loss.backward()
        total = counter.get_total_flops()
    return fwd, total - fwd


@pytest.mark.parametrize("name,seq_len,micro_batch", [
    ("tiny-gpt", 64, 2), ("gpt2-small", 128, 1),
    ("llama-like", 32, 2),   # SwiGLU, RMSNorm, RoPE, GQA
    ("qwen-like", 32, 2),    # and heads wider than d_model / n_head (Qwen3's head_dim)
])
def test_spec_flops_match_torch_flop_counter(name, seq_len, micro_batch):
    if name in ("llama-like", "qwen-like"):
        spec = load_model({"preset": "llama3-8b", "n_layer": 2, "d_model": 128, "n_head": 8,
                           "n_kv_head": 2, "ffn_hidden": 352, "vocab_size": 300,
                           "seq_len": seq_len,
                           **({"head_dim": 32} if name == "qwen-like" else {})})
        assert spec.config.q_dim == (256 if name == "qwen-like" else 128)
    else:
        spec = load_model(name, overrides={"seq_len": seq_len})
    costs = [spec.layer_cost(i, micro_batch) for i in range(spec.num_layers)]
    fwd, bwd = _counted_flops(spec, micro_batch)
    spec_fwd = sum(c.fwd_flops for c in costs)
    spec_bwd = sum(c.i_flops + c.w_flops for c in costs)
    assert spec_fwd == pytest.approx(fwd, rel=0.05)
    assert spec_bwd == pytest.approx(bwd, rel=0.05)


def test_block_flops_and_stash_match_papers():
    b, s, h, a = 4, 2048, 1024, 16
    c = GPTConfig(vocab_size=1000, n_layer=2, n_head=a, d_model=h, seq_len=s, dropout=0.1,
                  attention="eager")
    cost = TransformerBlock(c).cost(b, s, DTYPE_BYTES["bf16"])
    # Narayanan et al. 2021: 24bsh² + 4bs²h per layer forward
    assert cost.fwd_flops == 24 * b * s * h**2 + 4 * b * s**2 * h
    assert cost.i_flops + cost.w_flops == 2 * cost.fwd_flops
    assert cost.i_flops - cost.w_flops == 8 * b * s**2 * h    # the s² part is all I
    # Korthikanti et al. 2022: sbh(34 + 5as/h) bytes at 16 bits with dropout
    assert cost.stash_bytes == s * b * h * (34 + 5 * a * s / h)
    assert cost.send_bytes == b * s * h * 2
    # without dropout: no 1-byte masks (2·sbh + as²b) nor dropped-out probs (2·as²b)
    no_drop = TransformerBlock(GPTConfig(vocab_size=1000, n_layer=2, n_head=a, d_model=h,
                                         seq_len=s, attention="eager")).cost(b, s, 2)
    assert no_drop.stash_bytes == cost.stash_bytes - 2 * s * b * h - 3 * a * s * s * b


def test_layer_costs_scale_and_head_sends_nothing():
    spec = load_model("gpt2-medium")
    one, four = spec.layer_cost(5, 1), spec.layer_cost(5, 4)
    assert four.fwd_flops == 4 * one.fwd_flops and four.stash_bytes == 4 * one.stash_bytes
    head = spec.layer_cost(spec.num_layers - 1, 2)
    assert head.send_bytes == 0 and head.i_flops == head.w_flops == head.fwd_flops
    emb = spec.layer_cost(0, 2)
    assert emb.fwd_flops == 0 and emb.i_flops == 0 and emb.w_flops > 0 and emb.mem_bytes > 0
    assert [layer.kind for layer in spec.layers] == ["embedding"] + ["block"] * 24 + ["head"]
    with pytest.raises(IndexError):
        spec.layer_cost(spec.num_layers, 1)


# --------------------------------------------------------------------------- stages

def test_every_stage_has_the_weights_of_the_full_model():
    spec = load_model("tiny-gpt")
    full = build_model(spec, seed=3).state_dict()
    n = spec.num_layers
    for start in range(n):
        for end in range(start + 1, n + 1):
            part = build_stage(spec, start, end, seed=3).state_dict()
            assert part, (start, end)
            for key, value in part.items():
                assert torch.equal(value, full[key]), (start, end, key)
    other = build_model(spec, seed=4).state_dict()
    assert not torch.equal(other["layers.1.attn.c_attn.weight"],
                           full["layers.1.attn.c_attn.weight"])


def _chained_loss_and_grads(spec, cuts, seed=0):
    x, y = example_batch(spec, 2, seed=seed)
    stages = [build_stage(spec, a, b, seed=seed) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    for stage in stages[:-1]:
        x = stage(x)
    loss = stages[-1](x, y)
    loss.backward()
    grads = {k: p.grad for s in stages for k, p in s.named_parameters()}
    return loss, grads


@pytest.mark.parametrize("name", ["tiny-gpt", "synthetic"])
def test_chained_stages_give_the_same_loss_and_grads(name):
    spec = load_model("tiny-gpt") if name == "tiny-gpt" else load_model(
        {"kind": "synthetic", "layers": 5, "hidden": 16, "seq_len": 4})
    n = spec.num_layers
    whole, whole_grads = _chained_loss_and_grads(spec, [0, n])
    parts, part_grads = _chained_loss_and_grads(spec, [0, 1, 3, n - 1, n])
    assert whole.ndim == 0 and torch.isfinite(whole)
    assert torch.equal(whole, parts)
    assert whole_grads.keys() == part_grads.keys()
    for key, grad in whole_grads.items():
        torch.testing.assert_close(part_grads[key], grad, rtol=0, atol=0)


def test_tiny_gpt_shapes_and_initial_loss():
    spec = load_model("tiny-gpt")
    assert spec.dtype == "fp32" and spec.num_layers == 8
    x, y = example_batch(spec, 2, seed=0)
    emb = build_layer(spec, 0, seed=0)
    h = emb(x)
    assert h.shape == (2, 64, 128) and h.dtype == torch.float32
    assert build_layer(spec, 1, seed=0)(h).shape == h.shape
    loss = build_model(spec, seed=0)(x, y)
    # freshly initialised: close to uniform over 256 bytes
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_building_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(load_model("tiny-gpt"), seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_synthetic_without_hidden_cannot_be_built():
    spec = load_model({"kind": "synthetic", "layers": 2, "fwd_flops_per_sample": 1e9})
    with pytest.raises(BadInput, match="hidden"):
        build_layer(spec, 0, seed=0)


# --------------------------------------------------------------------------- loading

def test_synthetic_model_loading_and_cost():
    spec = load_model({"kind": "synthetic", "layers": 8, "fwd_flops_per_sample": 1.0e9,
                       "activation_bytes_per_sample": 0, "params_per_layer": 0})
    assert spec.num_layers == 8 and spec.config is None and spec.params == 0
    c = spec.layer_cost(3, 4)
    assert (c.fwd_flops, c.i_flops, c.w_flops) == (4e9, 4e9, 4e9)
    assert c.send_bytes == 0 and c.stash_bytes == 0
    spec = load_model({"kind": "synthetic", "layers": 2, "fwd_flops_per_sample": "2 GFLOP",
                       "w_flops_per_sample": 1e9, "activation_bytes_per_sample": "1 MB",
                       "params_per_layer": 10, "dtype": "fp32"})
    c = spec.layer_cost(1, 2)
    assert (c.fwd_flops, c.i_flops, c.w_flops) == (4e9, 4e9, 2e9)
    assert c.send_bytes == c.stash_bytes == 2e6 and spec.params == 20
    # with `hidden`, defaults are those of the Linear it builds, so the counts agree
    spec = load_model({"kind": "synthetic", "layers": 3, "hidden": 32, "seq_len": 4})
    assert spec.params == _numel(build_model(spec, seed=0)) == 3 * (32 * 32 + 32)
    assert spec.layer_cost(0, 1).fwd_flops == 2 * 4 * 32 * 32
    # heterogeneous layers, top-level values as defaults
    spec = load_model({"kind": "synthetic", "fwd_flops_per_sample": 1e9,
                       "layers": [{}, {"fwd_flops_per_sample": 3e9}]})
    assert [spec.layer_cost(i, 1).fwd_flops for i in (0, 1)] == [1e9, 3e9]


def test_overrides_and_preset_forms(tmp_path):
    base = load_model("gpt2-medium")
    assert base.seq_len == 1024 and base.dtype == "bf16" and base.name == "gpt2-medium"
    short = load_model("gpt2-medium", overrides={"seq_len": 256, "dtype": "fp16"})
    assert short.seq_len == 256 and short.dtype == "fp16" and short.config.n_layer == 24
    same = load_model({"preset": "gpt2-medium", "seq_len": 256, "dtype": "fp16"})
    assert same == short
    # derived defaults follow the overridden fields
    wide = load_model({"preset": "gpt2-small", "d_model": 1024, "n_head": 16})
    assert wide.config.ffn_hidden == 4096 and wide.config.n_kv_head == 16
    # a file, relative to base_dir, naming a preset
    (tmp_path / "m.yaml").write_text("preset: llama2-7b\nn_layer: 4\n")
    spec = load_model("m.yaml", base_dir=tmp_path)
    assert spec.num_layers == 6 and spec.config.mlp == "swiglu" and spec.seq_len == 4096
    # overrides on a file and on a spec
    assert load_model(tmp_path / "m.yaml", overrides={"n_layer": 2}).num_layers == 4
    assert load_model(spec, overrides={"n_layer": 1}).num_layers == 3
    assert load_model(spec) is spec


@pytest.mark.parametrize("ref", [
    "tiny-gpt", "llama2-70b",
    {"kind": "gpt", "vocab_size": 100, "n_layer": 2, "n_head": 2, "d_model": 8,
     "seq_len": 16, "mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "bias": False,
     "dropout": 0.1, "n_kv_head": 1, "name": "mine"},
    {"kind": "gpt", "vocab_size": 100, "n_layer": 2, "n_head": 4, "d_model": 8,
     "seq_len": 16, "position": "rope", "n_kv_head": 2, "head_dim": 6},
    {"kind": "synthetic", "layers": 3, "fwd_flops_per_sample": 1e9, "hidden": 8},
    {"kind": "synthetic", "layers": [{"fwd_flops_per_sample": 1e9},
                                     {"fwd_flops_per_sample": 2e9, "params_per_layer": 7}]},
])
def test_round_trip_through_to_dict(ref, tmp_path):
    spec = load_model(ref)
    data = spec.to_dict()
    assert load_model(data) == spec
    path = tmp_path / "model.json"
    path.write_text(json.dumps(data))
    assert load_model(str(path)) == spec


@pytest.mark.parametrize("ref,field", [
    ({"preset": "gpt5"}, "preset"),
    ({"preset": "gpt2-small", "n_layer": -3}, "n_layer"),
    ({"preset": "gpt2-small", "colour": "red"}, "colour"),
    ({"kind": "gpt", "n_layer": 2, "n_head": 2, "d_model": 8, "seq_len": 8}, "vocab_size"),
    ({"preset": "tiny-gpt", "n_head": 5}, "n_head"),
    ({"preset": "tiny-gpt", "n_kv_head": 3}, "n_kv_head"),
    ({"preset": "tiny-gpt", "mlp": "relu"}, "mlp"),
    ({"preset": "tiny-gpt", "dropout": 1.5}, "dropout"),
    ({"preset": "tiny-gpt", "bias": "yes"}, "bias"),
    ({"preset": "tiny-gpt", "dtype": "fp4"}, "dtype"),
    ({"preset": "tiny-gpt", "seq_len": "long"}, "seq_len"),
    ({"preset": "tiny-gpt", "d_model": 12.5}, "d_model"),
    ({"preset": "llama2-7b", "d_model": 96, "n_head": 32}, "d_model"),  # odd head size, RoPE
    ({"preset": "llama2-7b", "head_dim": 33}, "head_dim"),             # odd head size, RoPE
    ({"preset": "tiny-gpt", "head_dim": 0}, "head_dim"),
    ({"preset": "tiny-gpt", "n_head": 5, "head_dim": 5.5}, "head_dim"),
    ({"kind": "rnn"}, "kind"),
    ({"kind": "synthetic", "layers": 0, "fwd_flops_per_sample": 1}, "layers"),
    ({"kind": "synthetic", "layers": 2, "fwd_flops_per_sample": -1}, "fwd_flops_per_sample"),
    ({"kind": "synthetic", "layers": 2, "fwd_flops_per_sample": "lots"},
     "fwd_flops_per_sample"),
    ({"kind": "synthetic", "layers": 2}, "fwd_flops_per_sample"),
    ({"kind": "synthetic", "layers": 2, "fwd_flops_per_sample": 1, "hidden": 0}, "hidden"),
    ({"kind": "synthetic", "layers": [{}, {"fwd_flops_per_sample": 1, "oops": 1}]},
     "layers[1].oops"),
    ({"kind": "synthetic", "layers": 2, "fwd_flops_per_sample": "1 GB"},
     "fwd_flops_per_sample"),
    ("gpt9", "gpt9"),
    (["tiny-gpt"], "model"),
])
def test_malformed_models_raise_bad_input_naming_the_field(ref, field):
    with pytest.raises(BadInput) as info:
        load_model(ref)
    message = str(info.value)
    assert field in message and message.startswith("model") and "\n" not in message


def test_error_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("preset: gpt2-small\nn_layer: -3\n")
    with pytest.raises(BadInput) as info:
        load_model(str(path))
    assert str(info.value) == f"{path}: n_layer: expected a positive integer, got -3"
    with pytest.raises(BadInput, match="n_layer"):
        load_model("tiny-gpt", overrides={"n_layer": 0})
    with pytest.raises(BadInput):
        load_model(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(BadInput, match="list.json"):
        load_model(str(tmp_path / "list.json"))


def test_configs_and_layers_are_frozen_data():
    c = GPTConfig(vocab_size=10, n_layer=1, n_head=2, d_model=4, seq_len=4)
    assert c.ffn_hidden == 16 and c.n_kv_head == 2
    with pytest.raises(BadInput, match="n_head"):
        GPTConfig(vocab_size=10, n_layer=1, n_head=3, d_model=4, seq_len=4)
    with pytest.raises(AttributeError):
        c.n_layer = 2  # type: ignore[misc]
    layer = SyntheticLayer(1.0, 1.0, 1.0, 0.0, 0.0)
    assert layer.kind == "synthetic" and layer.params == 0


@pytest.mark.parametrize("text, ext", [("params_per_layer: 1e6", "yaml"),
                                       ("params_per_layer: 1.0e+6", "yaml"),
                                       ('"params_per_layer": 1e6', "json")])
def test_whole_numbers_in_exponent_form_are_integers(text, ext, tmp_path):
    """A count written as 1e6 (a string under YAML 1.1, a float in JSON) is the integer."""
    body = "kind: synthetic\nlayers: 2\nfwd_flops_per_sample: 1.0e9\n" + text + "\n" \
        if ext == "yaml" else '{"kind": "synthetic", "layers": 2, ' \
        '"fwd_flops_per_sample": 1e9, ' + text + "}"
    path = tmp_path / f"m.{ext}"
    path.write_text(body)
    spec = load_model(str(path))
    assert [layer.params for layer in spec.layers] == [10**6, 10**6]


@pytest.mark.parametrize("value", ["2.5e0", "1e-3", 2.5])
def test_a_fractional_count_is_refused(value, tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"kind": "synthetic", "layers": 2,
                                "fwd_flops_per_sample": 1e9, "params_per_layer": value}))
    with pytest.raises(BadInput, match="params_per_layer.*non-negative integer"):
        load_model(str(path))


@pytest.mark.parametrize("field, read", [({"n_head": 4e0}, 4), ({"n_layer": "2e0"}, 2),
                                         ({"vocab_size": 1e3}, 1000),
                                         ({"moe": {"experts": 4.0, "top_k": "2e0",
                                                   "expert_hidden": 64}}, 4)])
def test_a_gpt_dimension_in_exponent_form_is_the_integer(field, read):
    """Every count is read by one rule (`whole_number`): a GPT dimension written 4.0 or
    2e0 is that integer, as a synthetic model's `layers` and a cluster's `count` are; an
    int, never a float or string left for the arithmetic (a TypeError, exit 1)."""
    spec = load_model({"preset": "tiny-gpt", **field})
    key = next(iter(field))
    value = getattr(spec.config, key)
    value = value.experts if key == "moe" else value
    assert value == read and type(value) is int


@pytest.mark.parametrize("field", [{"n_head": 2.5}, {"n_layer": "25e-1"}, {"n_head": "4"},
                                   {"moe": {"experts": 4.5, "top_k": 2, "expert_hidden": 64}}])
def test_a_gpt_dimension_must_be_a_whole_number(field):
    with pytest.raises(BadInput, match=next(iter(field))):
        load_model({"preset": "tiny-gpt", **field})


def test_gpt_figures_in_exponent_form_are_numbers(tmp_path):
    """`rope_theta: 5e5` is a string under YAML 1.1; it is the number, as `efficiency`."""
    path = tmp_path / "m.yaml"
    path.write_text("preset: tiny-gpt\nposition: rope\nrope_theta: 5e5\ndropout: 1e-1\n")
    config = load_model(str(path)).config
    assert (config.rope_theta, config.dropout) == (5e5, 0.1)


@pytest.mark.parametrize("layers", [4.0, "4e0"])
def test_synthetic_layers_is_read_as_every_count(layers, tmp_path):
    """`layers: 4.0` (or YAML's 4e0) is 4 layers, as `count: 4.0` is 4 devices; it had
    been refused ("a positive integer or a non-empty list of layers")."""
    spec = load_model({"kind": "synthetic", "layers": layers, "fwd_flops_per_sample": 1e9})
    assert len(spec.layers) == 4
    with pytest.raises(BadInput, match=r"^m: layers: expected a positive integer"):
        load_model({"kind": "synthetic", "layers": 4.5, "fwd_flops_per_sample": 1e9},
                   where="m")


def test_a_synthetic_model_of_stash_bytes_alone_is_refused(tmp_path, capsys):
    """Stash bytes are memory, not work: such a model had simulated to an iteration time
    and a throughput of 0.0 with exit 0."""
    from hyperpipe.cli.main import main
    path = tmp_path / "m.yaml"
    path.write_text("kind: synthetic\nlayers: 4\nfwd_flops_per_sample: 0\n"
                    "stash_bytes_per_sample: 1000\n")
    with pytest.raises(BadInput) as err:
        load_model(str(path))
    assert str(err.value) == (f"{path}: layers: expected at least one layer with FLOPs, "
                              "activation bytes or parameters above 0 (stash_bytes_per_sample"
                              " is memory, not work)")
    rc = main(["simulate", "--cluster", "demo-hetero", "--model", str(path), "--pp", "2",
               "--micro-batch", "1", "--global-batch", "2", "--json"])
    out, stderr = capsys.readouterr()
    assert rc == 2 and out == "" and stderr.splitlines() == [f"hyperpipe: error: {err.value}"]


def test_a_missing_model_file_is_named_by_the_field_that_gave_it(tmp_path):
    """As a missing cluster file is ("p.json: cluster: expected ..."); it had been named
    by its resolved path alone."""
    with pytest.raises(BadInput, match=r"^p\.json: model: expected a preset name .* or an "
                                       r"existing model file \(\.yaml, \.yml, \.json\), "
                                       r"got 'nosuch\.yaml'$"):
        load_model("nosuch.yaml", where="p.json: model", base_dir=tmp_path)
