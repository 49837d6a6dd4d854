"""Per-dtype peaks: the catalog's tables, the model dtype picking its entry, fallbacks,
and `peak_flops` as one quantity or a table in a cluster file."""

from __future__ import annotations

import pytest

from hyperpipe.cluster.catalog import DTYPE_FALLBACK, builtin_device_types
from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.models import load_model
from hyperpipe.sim.compute import gemm_time_s
from hyperpipe.sim.costmodel import CostModel

# Dense TFLOP/s from the datasheets / whitepapers the catalog cites (an independent copy).
SHEETS = {
    "RTX-3090": {"fp32": 35.6, "fp16": 71, "bf16": 71},
    "Titan-RTX": {"fp32": 16.3, "fp16": 130.5},
    "V100-32GB": {"fp32": 15.7, "fp16": 125},
    "T4": {"fp32": 8.1, "fp16": 65},
    "A100-80GB": {"fp32": 19.5, "tf32": 156, "bf16": 312},
    "H100-SXM": {"fp32": 67, "bf16": 989, "fp8": 1979},
    "P100-16GB": {"fp32": 9.3, "fp16": 18.7},
    "A30": {"fp32": 10.3, "tf32": 82, "bf16": 165},
    "A5000": {"fp32": 27.8, "tf32": 55.6, "bf16": 111.1},
    "A4000": {"fp32": 19.2, "tf32": 38.4, "bf16": 76.7},
    "RTX-3080": {"fp32": 29.8, "fp16": 59.5},
    "RTX-4080": {"fp32": 48.7, "fp16": 97.5},
    "A800-80GB": {"fp32": 19.5, "tf32": 156, "bf16": 312},
    "H800": {"fp32": 67, "bf16": 989, "fp8": 1979},
    "V100-PCIe-16GB": {"fp32": 14, "fp16": 112},
    "V100-PCIe-32GB": {"fp32": 14, "fp16": 112},
    "A100-PCIe-40GB": {"fp32": 19.5, "tf32": 156, "bf16": 312},
    "A100-PCIe-80GB": {"fp32": 19.5, "tf32": 156, "bf16": 312},
    "Quadro-RTX-6000": {"fp32": 16.3, "fp16": 130.5},
    "Quadro-RTX-8000": {"fp32": 16.3, "fp16": 130.5},
    "Titan-V": {"fp32": 13.8, "fp16": 110},
}


@pytest.mark.parametrize("name", sorted(SHEETS))
def test_catalog_peaks_match_the_sheets(name):
    dev = builtin_device_types()[name]
    for dtype, tflops in SHEETS[name].items():
        assert dev.peak_for(dtype) == pytest.approx(tflops * 1e12)


def test_every_catalog_device_has_fp32_and_a_half_precision_peak_with_a_source():
    for name, dev in builtin_device_types().items():
        peaks = dev.peaks
        assert "fp32" in peaks and "fp16" in peaks, name
        assert peaks["fp32"] < peaks["fp16"] == dev.peak_flops, name
        assert "fp32" in dev.source.lower() or "single" in dev.source.lower(), name


def test_fp32_model_on_an_rtx_3090_is_priced_at_the_fp32_peak_one_big_gemm():
    """Closed form: an fp32 GEMM runs on the CUDA cores, at the 35.6 TFLOP/s fp32 peak
    times the fraction measured there: 24.79 TFLOP/s for a 10240^3 torch.mm with TF32
    off (zzc0721/torch-performance-test-data), so 2 M N K / 24.79e12 seconds, not the
    fp16 tensor rate nor the tensor curve's fraction."""
    dev = builtin_device_types()["RTX-3090"]
    m = n = k = 10240
    fp32 = gemm_time_s(dev, m, n, k, 1, 4, "fp32")
    assert fp32 == pytest.approx(2 * m * n * k / 24.79e12)
    fp16 = gemm_time_s(dev, m, n, k, 1, 2, "fp16")
    assert fp16 == pytest.approx(2 * m * n * k / (71e12 * dev.gemm.efficiency(m, n, k)))


def test_fp32_model_through_the_cost_model():
    """A synthetic layer (flat roofline: FLOPs / (peak of the dtype x efficiency)) on
    a catalog RTX 3090: the fp32 model runs at 35.6 TFLOP/s x 0.5, the bf16 one at 71."""
    cluster = load_cluster({"nodes": [{"name": "n", "device": "RTX-3090", "count": 1}]})
    for dtype, tflops in (("fp32", 35.6), ("bf16", 71.0)):
        model = load_model({"kind": "synthetic", "layers": 2, "dtype": dtype,
                            "fwd_flops_per_sample": 1e12,
                            "activation_bytes_per_sample": 0, "params_per_layer": 0})
        t = CostModel(model, cluster).layer_time_s(0, "RTX-3090", 1, "F")
        assert t == pytest.approx(1e12 / (tflops * 1e12 * 0.5))


def test_gpt_block_in_fp32_is_slower_than_in_fp16_by_about_the_peak_ratio():
    """A large fp32 block is GEMM-bound at the fp32 rate: its forward takes more than
    (71 / 35.6) x 0.9 of the fp16 one's (the fp32 memory traffic only adds)."""
    cluster = load_cluster({"nodes": [{"name": "n", "device": "RTX-3090", "count": 1}]})
    times = {}
    for dtype in ("fp32", "fp16"):
        model = load_model({"kind": "gpt", "vocab_size": 1024, "n_layer": 1, "n_head": 32,
                            "d_model": 4096, "seq_len": 2048, "dtype": dtype})
        times[dtype] = CostModel(model, cluster).layer_time_s(1, "RTX-3090", 4, "F")
    assert times["fp32"] / times["fp16"] > 0.9 * 71 / 35.6


def test_a_dtype_the_part_lacks_falls_back():
    t4 = builtin_device_types()["T4"]
    assert DTYPE_FALLBACK["bf16"] == "fp16"
    assert t4.peak_for("bf16") == t4.peak_for("fp16") == 65e12
    assert t4.peak_for("fp8") == 65e12          # fp8 -> bf16 -> fp16
    assert t4.peak_for("tf32") == t4.peak_for("fp32") == pytest.approx(8.1e12)


def _cluster(entry):
    return load_cluster({"device_types": {"x": entry},
                         "nodes": [{"name": "n", "device": "x", "count": 1}]})


def test_file_peak_table_sets_each_dtype_and_the_headline():
    dev = _cluster({"peak_flops": {"fp32": "19.5 TFLOP/s", "tf32": "156 TFLOP/s",
                                   "bf16": "312 TFLOP/s", "fp16": "312 TFLOP/s"},
                    "memory": "80 GB"}).device_types["x"]
    assert dev.peak_flops == 312e12
    assert dev.peak_for("fp32") == pytest.approx(19.5e12)
    assert dev.peak_for("tf32") == pytest.approx(156e12)
    assert dev.peak_for("fp8") == pytest.approx(312e12)      # fp8 -> bf16


def test_file_one_number_is_every_dtype_for_a_new_type_and_scales_a_catalog_base():
    dev = _cluster({"peak_flops": "10 TFLOP/s", "memory": "8 GB"}).device_types["x"]
    assert dev.peak_for("fp32") == dev.peak_for("bf16") == 10e12
    base = _cluster({"base": "RTX-3090", "peak_flops": "142 TFLOP/s"}).device_types["x"]
    assert base.peak_for("bf16") == pytest.approx(142e12)
    assert base.peak_for("fp32") == pytest.approx(71.2e12)   # keeps 35.6 / 71


def test_file_table_without_the_models_dtype_is_a_clear_error():
    cluster = _cluster({"peak_flops": {"fp32": "1 TFLOP/s"}, "memory": "8 GB"})
    model = load_model({"kind": "synthetic", "layers": 1, "dtype": "bf16",
                        "fwd_flops_per_sample": 1e9})
    # named with the cluster (it had named the device type alone, no file); a cluster
    # given as data is named as its other errors name it
    with pytest.raises(BadInput, match=r"^cluster: device_types\.x\."
                                       r"peak_flops: expected an entry for the model's dtype "
                                       r"bf16 or one it falls back to \(fp16\), got 'fp32'$"):
        CostModel(model, cluster)


def test_a_dtype_without_a_fallback_is_named_once_with_the_cluster_file(tmp_path):
    """fp32 falls back to nothing: the message had said "fp32 or its fallback (fp32)" and
    named "cluster dt2" rather than the file."""
    path = tmp_path / "c.yaml"
    path.write_text("device_types:\n  dt2: {peak_flops: {bf16: '4 TFLOP/s'}, memory: '8 GB'}\n"
                    "nodes:\n  - {name: n0, device: dt2, count: 2}\n")
    model = load_model({"kind": "synthetic", "layers": 1, "dtype": "fp32",
                        "fwd_flops_per_sample": 1e9})
    with pytest.raises(BadInput) as err:
        CostModel(model, load_cluster(str(path)))
    assert str(err.value) == (f"{path}: device_types.dt2.peak_flops: expected an entry for "
                              "the model's dtype fp32 (no other dtype stands in for it), "
                              "got 'bf16'")
    # a built-in cluster keeps its name, a plan's inline cluster the plan's field
    assert load_cluster("demo-hetero").where == "cluster demo-hetero"
    inline = {"device_types": {"dt2": {"peak_flops": {"bf16": "4 TFLOP/s"}, "memory": "8 GB"}},
              "nodes": [{"name": "n0", "device": "dt2", "count": 1}]}
    with pytest.raises(BadInput, match=r"^p\.json: cluster: device_types\.dt2\.peak_flops: "):
        CostModel(model, load_cluster(inline, where="p.json: cluster"))


@pytest.mark.parametrize("table, field", [
    ({"fp64": "1 TFLOP/s"}, "peak_flops.fp64"),
    ({}, "peak_flops"),
    ({"fp32": "fast"}, "peak_flops.fp32"),
])
def test_bad_peak_tables_name_the_field(table, field):
    with pytest.raises(BadInput, match=field.replace(".", r"\.")):
        _cluster({"peak_flops": table, "memory": "8 GB"})


def _gpt(dtype, **extra):
    return load_model({"kind": "gpt", "vocab_size": 1024, "n_layer": 1, "n_head": 32,
                       "d_model": 4096, "seq_len": 2048, "dtype": dtype, **extra})


def test_a_tf32_model_multiplies_at_the_tf32_peak_and_stores_fp32():
    """tf32: an fp32 model whose GEMMs run on TF32 tensor cores. On an A100 each GEMM of
    a block is priced as `gemm_time_s` in tf32 (156 TFLOP/s on the tensor-core curve,
    4-byte operands); the state is fp32's (16 bytes per parameter, 4-byte activations);
    on a V100, which has no TF32, it falls back to fp32 on the CUDA cores' curve."""
    from hyperpipe.models.ops import layer_work
    a100 = builtin_device_types()["A100-80GB"]
    cluster = load_cluster({"nodes": [{"name": "n", "device": "A100-80GB", "count": 1}]})
    tf32, fp32 = _gpt("tf32"), _gpt("fp32")
    assert tf32.dtype_bytes == fp32.dtype_bytes == 4 and tf32.storage_dtype == "fp32"
    work = layer_work(tf32.layers[1], "F", 4, tf32.seq_len, 4)
    gemms = sum(gemm_time_s(a100, g.m, g.n, g.k, g.batch, 4, "tf32") for g in work.gemms)
    expected = gemms + work.mem_bytes / a100.achievable_mem_bandwidth_bytes_per_s
    cost = CostModel(tf32, cluster)
    assert cost.layer_time_s(1, "A100-80GB", 4, "F") == pytest.approx(expected, rel=1e-9)
    big = 8192
    assert gemm_time_s(a100, big, big, big, 1, 4, "tf32") == pytest.approx(
        2 * big ** 3 / (156e12 * a100.gemm.efficiency(big, big, big)))
    assert cost.state_bytes((0, 3)) == CostModel(fp32, cluster).state_bytes((0, 3))
    assert cost.state_bytes_per_param == 16.0
    v100 = builtin_device_types()["V100-32GB"]
    assert v100.gemm_for("tf32") is v100.simt_gemm
    assert gemm_time_s(v100, big, big, big, 1, 4, "tf32") == \
        gemm_time_s(v100, big, big, big, 1, 4, "fp32")


def test_an_fp8_model_multiplies_its_linears_in_fp8_and_the_rest_in_bf16():
    """fp8: bf16 storage, the blocks' linear layers at the fp8 peak (1979 TFLOP/s on an
    H100, 1-byte operands), the attention core's batched GEMMs and the logits at bf16's
    989; the same state and activations as bf16."""
    from hyperpipe.models.ops import layer_work
    h100 = builtin_device_types()["H100-SXM"]
    cluster = load_cluster({"nodes": [{"name": "n", "device": "H100-SXM", "count": 1}]})
    fp8, bf16 = _gpt("fp8"), _gpt("bf16")
    assert fp8.dtype_bytes == 2 and fp8.storage_dtype == "bf16"
    for layer, op in ((1, "F"), (1, "W"), (2, "F")):
        work = layer_work(fp8.layers[layer], op, 4, fp8.seq_len, 2)
        linear = [g for g in work.gemms if g.linear]
        other = [g for g in work.gemms if not g.linear]
        assert (len(linear) > 0) == (layer == 1) and (layer == 2 or other or op == "W")
        expected = sum(gemm_time_s(h100, g.m, g.n, g.k, g.batch, 1, "fp8") for g in linear) \
            + sum(gemm_time_s(h100, g.m, g.n, g.k, g.batch, 2, "bf16") for g in other) \
            + work.mem_bytes / h100.achievable_mem_bandwidth_bytes_per_s
        got = CostModel(fp8, cluster).layer_time_s(layer, "H100-SXM", 4, op)
        assert got == pytest.approx(expected, rel=1e-9)
        if layer == 2:          # the head: no linear of a block, bf16's time
            assert got == pytest.approx(
                CostModel(bf16, cluster).layer_time_s(layer, "H100-SXM", 4, op))
    big = 8192
    assert gemm_time_s(h100, big, big, big, 1, 1, "fp8") == pytest.approx(
        2 * big ** 3 / (1979e12 * h100.gemm.efficiency(big, big, big)))
    block_fp8 = CostModel(fp8, cluster).layer_time_s(1, "H100-SXM", 4, "F")
    block_bf16 = CostModel(bf16, cluster).layer_time_s(1, "H100-SXM", 4, "F")
    assert block_bf16 / 2.2 < block_fp8 < block_bf16
    assert CostModel(fp8, cluster).state_bytes((0, 3)) == \
        CostModel(bf16, cluster).state_bytes((0, 3))


def test_fp8_on_a_part_without_fp8_multiplies_at_its_fallback_with_its_bytes():
    """An A100 has no fp8: an fp8 model's linears run at the bf16 entry they fall back
    to, with 2-byte operands (1 byte only where the part computes fp8), so its block
    takes a bf16 model's time (8 tokens: GEMMs bound by their operand bytes)."""
    cluster = load_cluster({"nodes": [{"name": "n", "device": "A100-80GB", "count": 1}]})
    fp8, bf16 = (CostModel(load_model({"kind": "gpt", "vocab_size": 1024, "n_layer": 1,
                                       "n_head": 32, "d_model": 4096, "seq_len": 8,
                                       "dtype": d}), cluster) for d in ("fp8", "bf16"))
    for op in "FIW":
        assert fp8.layer_time_s(1, "A100-80GB", 1, op) == pytest.approx(
            bf16.layer_time_s(1, "A100-80GB", 1, op), rel=1e-12)


def test_an_fp8_model_needs_the_bf16_entry_too_and_the_error_names_the_file():
    """A table with fp8 but no bf16 (nor fp16): the fp8 model's attention core and logits
    run in bf16, so the cluster is refused when the cost model is made, naming its file,
    not later while a layer is priced."""
    cluster = load_cluster({"device_types": {"x": {"base": "H100-SXM", "peak_flops": {
        "fp8": "1979 TFLOP/s", "fp32": "67 TFLOP/s"}}},
        "nodes": [{"name": "n", "device": "x", "count": 1}]})
    with pytest.raises(BadInput, match="device_types.x.peak_flops") as err:
        CostModel(_gpt("fp8"), cluster)
    assert "bf16" in str(err.value)
