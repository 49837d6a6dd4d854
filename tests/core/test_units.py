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
