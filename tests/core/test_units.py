"""Quantities with units: parsing, prefixes, rejection with the field named."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hyperpipe.core.errors import BadInput
from hyperpipe.core.units import parse_quantity


@pytest.mark.parametrize("text,dim,value", [
    ("312 TFLOP/s", "flops", 312e12),
    ("1 TFLOP/s", "flops", 1e12),
    ("80 GB", "bytes", 80e9),
    ("80 GiB", "bytes", 80 * 2**30),
    ("600 GB/s", "bandwidth", 600e9),
    ("100 Gbit/s", "bandwidth", 100e9 / 8),
    ("400Gbps", "bandwidth", 400e9 / 8),
    ("2 us", "time", 2e-6),
    ("5 ms", "time", 5e-3),
    ("1.5e3 s", "time", 1500.0),
    (7, "bytes", 7.0),
    ("0", "time", 0.0),
    # spellings that had been refused: b for bit, Bps for bytes/s, the Greek mu (U+03BC)
    # beside the micro sign (U+00B5)
    ("100 Gb/s", "bandwidth", 100e9 / 8),
    ("10 Mb/s", "bandwidth", 10e6 / 8),
    ("10 GBps", "bandwidth", 10e9),
    ("10 MBps", "bandwidth", 10e6),
    ("5 \u03bcs", "time", 5e-6),
    ("5 \u00b5s", "time", 5e-6),
])
def test_parse_quantity(text, dim, value):
    assert parse_quantity(text, dim, where="x") == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("text,dim", [
    ("5 parsecs", "time"), ("80 GB", "time"), ("-3 GB", "bytes"), ("fast", "flops"),
    ("nan GB", "bytes"), (True, "bytes"), (None, "bytes"), ("1e999 B", "bytes"),
    ("100 Gs", "time"),
    # digits are ASCII: full-width and Arabic-Indic digits had been read as 100
    ("\uff11\uff10\uff10 Gbit/s", "bandwidth"), ("\u0661\u0660\u0660 GB", "bytes"),
    ("\uff11\uff10\uff10", "bytes"), ("1e\uff13 B", "bytes"),
])
def test_parse_quantity_rejects(text, dim):
    with pytest.raises(BadInput) as err:
        parse_quantity(text, dim, where="c.yaml: nodes[0].x")
    assert str(err.value).startswith("c.yaml: nodes[0].x: expected")
    assert "\n" not in str(err.value)


@given(st.just(0.0) | st.floats(min_value=1e-3, max_value=1e6),  # units.QUANTITY_RANGE
       st.sampled_from([("k", 1e3), ("M", 1e6), ("G", 1e9), ("Ki", 1024.0), ("Gi", 2.0**30)]))
def test_parse_quantity_prefixes(number, prefix):
    text = f"{number!r} {prefix[0]}B"
    assert parse_quantity(text, "bytes", where="x") == pytest.approx(number * prefix[1])



@pytest.mark.parametrize("value_s,text", [(0.9997, "1 s"), (0.0042, "4.2 ms"),
                                          (0.00099996, "1 ms"), (12.5, "12.5 s"),
                                          (999.7, "1000 s")])
def test_seconds_are_rounded_before_their_unit_is_chosen(value_s, text):
    """0.9997 s had printed as '1e+03 ms' (the unit chosen before rounding)."""
    from hyperpipe.core.units import format_seconds
    assert format_seconds(value_s) == text


def test_long_durations_print_without_an_exponent():
    from hyperpipe.whatif.failures import duration
    assert duration(1000 * 86400.0) == "1000 days"      # had been '1e+03 days'
    assert duration(0.9997) == "1 s"


def test_quantities_are_rounded_before_their_prefix_is_chosen():
    from hyperpipe.core.units import format_quantity
    assert format_quantity(999.7e6, "B") == "1 GB"          # had been '1e+03 MB'
    assert format_quantity(3.2e11, "B") == "320 GB"
    assert format_quantity(16e6, "B") == "16 MB"


@pytest.mark.parametrize("text,dim", [("100", "bandwidth"), ("5", "time"), (" 80 ", "bytes"),
                                      ("2.5", "flops"), ("1.5", "time")])
def test_a_string_without_a_unit_is_refused(text, dim):
    """`inter_node: {bandwidth: "100"}` had been read as 100 B/s and `latency: "5"` as
    5 s: a quoted number names no unit, so it is refused with what to write."""
    with pytest.raises(BadInput) as err:
        parse_quantity(text, dim, where="c.json: inter_node.x")
    assert str(err.value).startswith("c.json: inter_node.x: expected a number (in ")
    assert "or a string with a unit such as" in str(err.value)
    assert str(err.value).endswith(f"got {text!r}")


@pytest.mark.parametrize("value,dim,si", [(100, "bandwidth", 100.0), (1e9, "bandwidth", 1e9),
                                          ("1e2 Gbit/s", "bandwidth", 12.5e9),
                                          ("1e-6", "time", 1e-6), ("1.0e9", "flop", 1e9),
                                          ("0", "time", 0.0), ("0.0", "bytes", 0.0)])
def test_numbers_and_strings_with_units_are_still_read(value, dim, si):
    """Plain numbers are SI; a string in exponent form is the number (YAML 1.1 reads an
    unquoted `1e-6` as a string); zero is zero in any unit."""
    assert parse_quantity(value, dim, where="x") == pytest.approx(si)


def test_a_cluster_file_with_a_unitless_latency_is_refused(tmp_path):
    from hyperpipe.cluster.cluster import load_cluster
    path = tmp_path / "c.yaml"
    path.write_text("nodes:\n  - {name: n0, device: A100-80GB, count: 1}\n"
                    "  - {name: n1, device: A100-80GB, count: 1}\n"
                    "inter_node: {bandwidth: 100 Gbit/s, latency: '5'}\n")
    with pytest.raises(BadInput, match=r"inter_node\.latency: expected a number \(in s\) or "
                                       r"a string with a unit such as '2 us', got '5'$"):
        load_cluster(str(path))
    path.write_text(path.read_text().replace("'5'", "5e-6"))     # YAML 1.1: the string '5e-6'
    assert load_cluster(str(path)).path("n0/0", "n1/0").link.latency_s == pytest.approx(5e-6)
