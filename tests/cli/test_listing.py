"""`hyperpipe list devices` quotes the GEMM efficiency the cost model uses."""

from __future__ import annotations

import re

from hyperpipe.cli import main
from hyperpipe.cluster.catalog import builtin_device_types
from hyperpipe.sim.compute import gemm_time_s


def test_listed_gemm_efficiency_is_what_the_cost_model_reaches(capsys):
    """Every catalog row's GEMM column (a curve's fraction of peak, two decimals) is the
    fraction of peak that the cost model's GEMM time gives an 8192^3 GEMM on that device
    (2 x 8192^3 FLOP over peak x time), to the two decimals printed."""
    assert main(["list", "devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "GEMM 8192^3 (fraction of peak)" in lines[0]
    listed = {}
    for row in lines[1:]:
        cells = row.split()
        assert re.fullmatch(r"\d\.\d\d", cells[2]), row
        listed[cells[0]] = float(cells[2])
    types = builtin_device_types()
    assert set(listed) == set(types)
    n = 8192
    for name, eff in listed.items():
        dev = types[name]
        reached = 2 * n**3 / (dev.peak_flops * gemm_time_s(dev, n, n, n, 1, 2))
        assert abs(reached - eff) <= 0.005 + 1e-12, (name, reached, eff)


def test_listed_fp32_peak_is_the_catalogs(capsys):
    """The fp32 column is the rate an fp32 model's GEMMs are priced at
    (`DeviceType.peak_for("fp32")`), not the fp16/bf16 headline: a T4 reads 8.1, not 65."""
    assert main(["list", "devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "fp32 (TFLOP/s)" in lines[0] and "fp16/bf16" in lines[0]
    types = builtin_device_types()
    for row in lines[1:]:
        cells = row.split()
        dev = types[cells[0]]
        assert float(cells[3]) == float(f"{dev.peak_for('fp32') / 1e12:g}"), row
        assert float(cells[3]) < float(cells[1]), row


def test_listed_nics_are_each_nodes(capsys):
    """The NIC column gives every node's NICs (count x Gbit/s), distinct ones listed: the
    8,192-GPU cluster's A100 nodes have eight 200 Gbit/s NICs beside the H100 nodes'
    400 (the column had shown the cluster-wide inter-node default, 400, alone)."""
    from hyperpipe.cluster.cluster import load_cluster
    assert main(["list", "clusters"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("NICs per node (Gbit/s)")
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["h100-a100-8192"].endswith("8x 200, 8x 400")
    for name in ("demo-hetero", "a100-1024"):
        nics = {f"{n.nics.count}x {n.nics.bandwidth_bytes_per_s * 8 / 1e9:g}"
                for n in load_cluster(name).nodes}
        assert rows[name].rsplit("  ", 1)[1].strip() in nics
