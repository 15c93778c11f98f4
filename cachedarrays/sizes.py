"""Byte sizes: parse "256MiB", "4GiB", "1.5G" or ints, and format them for messages."""

import decimal
import fractions
import math
import numbers
import operator
import re
import sys

_UNITS = {
    "": 1, "B": 1,
    "K": 1 << 10, "KI": 1 << 10, "KIB": 1 << 10, "KB": 10**3,
    "M": 1 << 20, "MI": 1 << 20, "MIB": 1 << 20, "MB": 10**6,
    "G": 1 << 30, "GI": 1 << 30, "GIB": 1 << 30, "GB": 10**9,
    "T": 1 << 40, "TI": 1 << 40, "TIB": 1 << 40, "TB": 10**12,
    # beyond any machine today, but sizes all the same: "too large", not "not a size"
    "P": 1 << 50, "PI": 1 << 50, "PIB": 1 << 50, "PB": 10**15,
    "E": 1 << 60, "EI": 1 << 60, "EIB": 1 << 60, "EB": 10**18,
    "Z": 1 << 70, "ZI": 1 << 70, "ZIB": 1 << 70, "ZB": 10**21,
    "Y": 1 << 80, "YI": 1 << 80, "YIB": 1 << 80, "YB": 10**24,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

# No device or heap can be larger than this (4 EiB, or the address space on 32-bit machines);
# bigger sizes are typos, not requests.
MAX_SIZE = min(1 << 62, sys.maxsize)
_MAX_TEXT = "2**62 bytes" if MAX_SIZE == 1 << 62 else f"{MAX_SIZE} bytes"


def parse_size(value, what="size"):
    """Return a byte count from an int or a string such as "256MiB", "4GiB", "1.5G" or "100MB".

    K/M/G/T/P/E (and KiB...EiB) are powers of 1024; KB/MB/GB/TB/PB/EB are powers of 1000 (Z
    and Y too, though they are always too large). The result
    is a whole number of bytes between 0 and MAX_SIZE; anything else is a ValueError naming
    `what`.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a string like '256MiB', not a bool")
    if isinstance(value, int):
        n = value
    elif isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        # float, NumPy's float16...float128, Fraction: accepted when whole, like a float
        try:
            finite = math.isfinite(value)
        except OverflowError:                       # a Fraction beyond any float: too large
            finite = True
        if not finite:
            raise ValueError(f"{what} must be a finite number of bytes, got {value!r}")
        if value != int(value):
            raise ValueError(f"{what} must be a whole number of bytes, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        n = _parse_text(value, what)
    else:
        try:
            n = operator.index(value)
        except TypeError:
            raise TypeError(
                f"{what} must be an int or a string like '256MiB', not {type(value).__name__}"
            ) from None
    if n < 0:
        raise ValueError(f"{what} must not be negative, got {value!r}")
    if n > MAX_SIZE:
        shown = f"{n} bytes, " if isinstance(value, str) else ""
        raise ValueError(f"{what} {value!r} is absurdly large ({shown}more than "
                         f"{_MAX_TEXT}); give a size the machine can hold")
    return n


def _parse_text(value, what):
    """The exact byte count of a size string; fractional or absurd counts are refused."""
    m = _PATTERN.match(value)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{what} {value!r} is not a size: use an int or a number with a unit, "
            "e.g. '256MiB', '4GiB', '1.5G', '100MB'"
        )
    number = decimal.Decimal(m.group(1))          # exact: no float rounding, no overflow
    if number and number.adjusted() > 30:          # >= 1e31 bytes: far beyond MAX_SIZE
        raise ValueError(f"{what} {value!r} is absurdly large (more than {_MAX_TEXT}); "
                         "give a size the machine can hold")
    if number and number.adjusted() < -30:         # < 1e-30 of a unit: never whole bytes
        exact = None
    else:
        exact = fractions.Fraction(number) * _UNITS[unit]
    if exact is None or exact.denominator != 1:
        shown = f" ({float(exact)!r} bytes)" if exact is not None else ""
        raise ValueError(f"{what} {value!r} is not a whole number of bytes{shown}; "
                         "give whole bytes, e.g. '1536MiB' rather than '1.5001GiB'")
    return int(exact)


def format_size(n):
    """Format a byte count for humans, e.g. 268435456 -> '256.0 MiB'."""
    n = int(n)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
