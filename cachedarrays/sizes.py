"""Byte sizes: parse "256MiB", "4GiB", "1.5G" or ints, and format them for messages."""

import math
import re

_UNITS = {
    "": 1, "B": 1,
    "K": 1 << 10, "KI": 1 << 10, "KIB": 1 << 10, "KB": 10**3,
    "M": 1 << 20, "MI": 1 << 20, "MIB": 1 << 20, "MB": 10**6,
    "G": 1 << 30, "GI": 1 << 30, "GIB": 1 << 30, "GB": 10**9,
    "T": 1 << 40, "TI": 1 << 40, "TIB": 1 << 40, "TB": 10**12,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value, what="size"):
    """Return a byte count from an int or a string such as "256MiB", "4GiB", "1.5G" or "100MB".

    K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024; KB/MB/GB/TB are powers of 1000.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a string like '256MiB', not a bool")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{what} must be a whole number of bytes, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        m = _PATTERN.match(value)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{what} {value!r} is not a size: use an int or a number with a unit, "
                "e.g. '256MiB', '4GiB', '1.5G', '100MB'"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        try:
            import operator
            n = operator.index(value)
        except TypeError:
            raise TypeError(
                f"{what} must be an int or a string like '256MiB', not {type(value).__name__}"
            ) from None
    if n < 0:
        raise ValueError(f"{what} must not be negative, got {value!r}")
    return n


def format_size(n):
    """Format a byte count for humans, e.g. 268435456 -> '256.0 MiB'."""
    n = int(n)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
