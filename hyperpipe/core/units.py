"""Quantities with units, converted once at the file boundary into SI base units.

>>> parse_quantity("312 TFLOP/s", "flops", where="x")
312000000000000.0
>>> parse_quantity("100 Gbit/s", "bandwidth", where="x")
12500000000.0
>>> parse_quantity("80 GB", "bytes", where="x")
80000000000.0

Decimal prefixes (k, M, G, T, P) are powers of 1000, binary ones (Ki, Mi, Gi, Ti) powers
of 1024, as in vendor spec sheets. A bare number (an int or float, not a string) is
taken as already in SI base units; a string must carry its unit (``"100"`` is refused:
100 what?), except zero (``"0"``, the same in every unit) and a number in exponent form
(``"1e-6"``, `EXPONENT_FORM`), which is how YAML 1.1 reads an unquoted ``1e-6`` and so
is that number, as for every number field.
Bits are ``bit``, ``b`` or ``bps`` (``"100 Gb/s"`` is ``"100 Gbit/s"``), bytes ``B`` or
``Bps`` (``"10 GBps"`` is ``"10 GB/s"``); micro is ``u``, the micro sign ``µ`` (U+00B5) or
the Greek mu ``μ`` (U+03BC). Digits are ASCII only (`NUMBER`): ``"１００ Gbit/s"`` in
full-width digits is refused, not read as 100.
"""

from __future__ import annotations

import math
import re

from hyperpipe.core.errors import BadInput

_PREFIX = {
    "": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50,
}

# unit word -> (dimension, factor to SI). Bandwidth is bytes/s, so bits are divided by 8.
_UNITS: dict[str, tuple[str, float]] = {
    "FLOP/s": ("flops", 1.0), "FLOPS": ("flops", 1.0), "flop/s": ("flops", 1.0),
    "B": ("bytes", 1.0), "byte": ("bytes", 1.0), "bytes": ("bytes", 1.0),
    "B/s": ("bandwidth", 1.0), "Bps": ("bandwidth", 1.0),
    "bit/s": ("bandwidth", 1 / 8), "b/s": ("bandwidth", 1 / 8), "bps": ("bandwidth", 1 / 8),
    "s": ("time", 1.0), "ms": ("time", 1e-3), "us": ("time", 1e-6), "µs": ("time", 1e-6),
    "μs": ("time", 1e-6), "ns": ("time", 1e-9), "min": ("time", 60.0), "h": ("time", 3600.0),
    "day": ("time", 86400.0), "days": ("time", 86400.0),
    "FLOP": ("flop", 1.0), "flop": ("flop", 1.0),
    "$/h": ("price", 1.0), "USD/h": ("price", 1.0),
}
_TIME_WORDS = {"ms", "us", "µs", "μs", "ns", "min", "h", "s", "day", "days"}

# A plain number as files and flags write it: ASCII digits only (`\d` would take
# full-width and Arabic-Indic digits too), an optional sign, fraction and exponent.
# `core.files` reads numbers written as strings (YAML 1.1's ``5e-1``) by the same form.
MANTISSA = r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)"
EXPONENT = r"[eE][-+]?[0-9]+"
NUMBER = f"{MANTISSA}(?:{EXPONENT})?"

_QUANTITY = re.compile(rf"^\s*({NUMBER})\s*(\S*)\s*$")
# A number in exponent form (YAML 1.1 reads an unquoted ``1e6`` or ``5e-1`` as a string);
# `core.files` reads such a string as the number in every number field.
EXPONENT_FORM = re.compile(MANTISSA + EXPONENT)

DIMENSIONS = ("flops", "bytes", "bandwidth", "time", "flop", "price")


def _unit_factor(word: str) -> tuple[str, float] | None:
    if word in _UNITS and (word in _TIME_WORDS or word in ("B", "B/s", "FLOP/s", "FLOPS")):
        return _UNITS[word]
    for prefix in sorted(_PREFIX, key=len, reverse=True):
        if word.startswith(prefix) and word[len(prefix):] in _UNITS:
            rest = word[len(prefix):]
            if rest in _TIME_WORDS and prefix:
                continue  # "ms" is milliseconds, handled above; no "Gs"
            dim, factor = _UNITS[rest]
            return dim, factor * _PREFIX[prefix]
    return None


def parse_quantity(value: object, dimension: str, *, where: str,
                   allow_zero: bool = True, need_unit: bool = False) -> float:
    """Return `value` in SI base units of `dimension` (one of DIMENSIONS).

    `value` is a number (already SI) or a string with its unit such as ``"600 GB/s"``.
    Raises BadInput naming `where` for a wrong unit, a negative or non-finite number, a
    non-number, or a string without a unit (``"100"``: a unit was meant but not written;
    ``"0"`` and a string in exponent form, `EXPONENT_FORM`, the number YAML 1.1 made a
    string, are numbers);
    with `need_unit` (command-line flags), also for any number without its unit.
    """
    if dimension not in DIMENSIONS:
        raise ValueError(f"unknown dimension {dimension!r}")
    if isinstance(value, bool):
        raise BadInput(where, f"a {dimension} quantity", value)
    if isinstance(value, (int, float)) and not need_unit:
        number = float(value)
    elif isinstance(value, str):
        match = _QUANTITY.match(value)
        if not match:
            raise BadInput(where, f"a {dimension} quantity such as {_EXAMPLE[dimension]!r}", value)
        number = float(match.group(1))
        word = match.group(2)
        if need_unit and not word:
            raise BadInput(where, f"a {dimension} quantity with its unit, such as "
                           f"{_EXAMPLE[dimension]!r}", value)
        # a unitless string names no unit: refused, but for zero (the same in every
        # unit) and a number in exponent form (YAML 1.1's string for `1e-6`)
        if not word and number != 0 and not EXPONENT_FORM.fullmatch(value.strip()):
            raise BadInput(where, f"a number (in {_SI_UNIT[dimension]}) or a string with a "
                           f"unit such as {_EXAMPLE[dimension]!r}", value)
        if word:
            unit = _unit_factor(word)
            if unit is None or unit[0] != dimension:
                raise BadInput(where, f"a {dimension} unit as in {_EXAMPLE[dimension]!r}", value)
            number *= unit[1]
    else:
        raise BadInput(where, f"a {dimension} quantity such as {_EXAMPLE[dimension]!r}", value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        what = "a positive" if not allow_zero else "a non-negative"
        raise BadInput(where, f"{what} finite {dimension} quantity", value)
    low, high = QUANTITY_RANGE[dimension]
    if number != 0 and not low <= number <= high:
        unit = _SI_UNIT[dimension]
        raise BadInput(where, f"a {dimension} quantity between {low:g} {unit} and {high:g} "
                       f"{unit} (hyperpipe.core.units.QUANTITY_RANGE)", value)
    return number


# The range of each dimension (SI units; zero is allowed where the field allows it).
# Far outside real hardware, and narrow enough that no time, rate or ratio computed from
# them overflows to inf or divides by a subnormal (a bandwidth of 5e-324 B/s).
QUANTITY_RANGE: dict[str, tuple[float, float]] = {
    "flops": (1.0, 1e30),          # FLOP/s (tests model "free" devices as 1e30)
    "bytes": (1e-6, 1e21),         # a zettabyte
    "bandwidth": (1.0, 1e30),      # bytes/s (1e30: a "free" link)
    "time": (1e-15, 1e9),          # seconds: a femtosecond to ~31 years (MTBFs)
    "flop": (1e-6, 1e24),
    "price": (1e-9, 1e6),          # USD per hour
}
_SI_UNIT = {"flops": "FLOP/s", "bytes": "B", "bandwidth": "B/s", "time": "s",
            "flop": "FLOP", "price": "$/h"}


_EXAMPLE = {
    "flops": "312 TFLOP/s", "bytes": "80 GB", "bandwidth": "100 Gbit/s", "time": "2 us",
    "flop": "1.5 GFLOP", "price": "2.5 $/h",
}


def format_quantity(value: float, unit: str, *, binary: bool = False) -> str:
    """Short human form: ``format_quantity(3.2e11, "B")`` -> ``'320 GB'``."""
    base = 1024.0 if binary else 1000.0
    prefixes = ["", "Ki", "Mi", "Gi", "Ti", "Pi"] if binary else ["", "k", "M", "G", "T", "P"]
    i = 0
    v = float(value)
    while abs(float(f"{v:.3g}")) >= base and i < len(prefixes) - 1:   # rounded first
        v /= base
        i += 1
    return f"{three_digits(v)} {prefixes[i]}{unit}"


def three_digits(value: float) -> str:
    """`value` to three significant digits without an exponent below a million:
    ``three_digits(999.7)`` -> ``'1000'`` (``'%.3g'`` gives ``'1e+03'``)."""
    return f"{float(f'{value:.3g}'):g}"


def format_seconds(value_s: float) -> str:
    """``format_seconds(0.0042)`` -> ``'4.2 ms'``; the unit is chosen after rounding to
    three digits (0.9997 s is '1 s', not '1e+03 ms')."""
    rounded = float(f"{value_s:.3g}")
    for unit, factor in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if abs(rounded) >= factor or unit == "ns":
            return f"{three_digits(value_s / factor)} {unit}"
    return f"{value_s} s"
