"""The text `hyperpipe simulate` prints (`sim.summary`): figures a reader can compare."""

from __future__ import annotations

from hyperpipe.sim.summary import _apart, _rate


def test_rates_print_without_an_exponent():
    assert _rate(43761.4) == "43,761"
    assert _rate(42.7443) == "42.74"
    assert "e+" not in _rate(1.5e9)


def test_a_peak_just_over_its_memory_reads_apart_from_it():
    # 14.40 GB against 14.39 GB: both read "14.4 GB" in three digits
    peak, cap = _apart(14.40e9, 14.39e9)
    assert peak != cap and peak == "14,400,000,000 B" and cap == "14,390,000,000 B"
    assert _apart(12e9, 14.39e9) == ("12 GB", "14.4 GB")
    assert _apart(14.39e9, 14.39e9) == ("14.4 GB", "14.4 GB")
