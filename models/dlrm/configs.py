"""DLRM configurations: the small and large models of Table 5.5 and the Table 5.6 model.

Each factory takes ``scale`` (multiplies table rows; small tables keep at least 16 rows) and
``width_scale`` (multiplies hidden MLP widths) so the same shapes fit a smaller machine.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

__all__ = ["DLRMConfig", "KAGGLE_TABLE_SIZES", "small", "large", "table56", "tiny", "CONFIGS",
           "get_config"]

#: Rows of the 26 categorical features of the Criteo Kaggle Display Advertising Challenge
#: (the counts DLRM.jl and Facebook's DLRM use; max 10,131,227, sum about 33.8 million).
KAGGLE_TABLE_SIZES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
                      8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15,
                      286181, 105, 142572)


@dataclass(frozen=True)
class DLRMConfig:
    """Shapes of one DLRM: tables, MLP widths (bottom ends in featuresize, top ends in 1)."""

    name: str
    table_sizes: tuple
    featuresize: int
    bottom: tuple
    top: tuple
    batch_size: int
    dense_features: int = 13
    bag_size: int = 1
    interaction: str = "dot"
    lr: float = 0.1

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"config name must be a string, got {self.name!r}")
        for field in ("featuresize", "batch_size", "dense_features", "bag_size"):
            object.__setattr__(self, field, self._count(field, getattr(self, field)))
        for field in ("table_sizes", "bottom", "top"):
            object.__setattr__(self, field, self._counts(field, getattr(self, field)))
        lr = self.lr
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
            raise TypeError(f"config {self.name!r}: lr must be a number, got {lr!r}")
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"config {self.name!r}: lr must be a finite number >= 0, got {lr!r}")
        if self.interaction not in ("dot", "cat"):
            raise ValueError(f"config {self.name!r}: interaction must be 'dot' or 'cat', "
                             f"got {self.interaction!r}")
        if self.bottom[-1] != self.featuresize:
            raise ValueError(f"config {self.name!r}: the bottom MLP must end in featuresize "
                             f"{self.featuresize}, got {self.bottom}")
        if self.top[-1] != 1:
            raise ValueError(f"config {self.name!r}: the top MLP must end in 1 output, got {self.top}")

    def _count(self, field, v, within=""):
        """v as an int >= 1 (a size, width or count; an integral float is accepted)."""
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or \
                (not isinstance(v, numbers.Integral) and not float(v).is_integer()):
            raise TypeError(f"config {self.name!r}: {field} must be an integer >= 1, got "
                            f"{v!r}{within}")
        if v < 1:
            raise ValueError(f"config {self.name!r}: {field} must be an integer >= 1, got "
                             f"{v!r}{within}")
        return int(v)

    def _counts(self, field, v):
        """v as a non-empty tuple of ints >= 1 (a list is accepted)."""
        if not isinstance(v, (tuple, list)):
            raise TypeError(f"config {self.name!r}: {field} must be a tuple of integers >= 1, "
                            f"got {type(v).__name__}")
        if not v:
            what = "tables of at least one row" if field == "table_sizes" else "one layer"
            raise ValueError(f"config {self.name!r}: {field} is empty; need {what}")
        return tuple(self._count(field, x, f" in {tuple(v)}") for x in v)

    @property
    def ntables(self):
        return len(self.table_sizes)

    @property
    def interaction_width(self):
        """Width of the top MLP's input."""
        f = self.ntables + 1
        if self.interaction == "dot":
            return self.featuresize + f * (f - 1) // 2
        return f * self.featuresize

    @property
    def table_bytes(self):
        return sum(self.table_sizes) * self.featuresize * 4

    def with_(self, **changes):
        """A copy with some fields changed (e.g. ``batch_size``, ``interaction``, ``lr``)."""
        return replace(self, **changes)


def _check_scale(value, what):
    """A scale factor: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"DLRM config: {what} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"DLRM config: {what} must be a finite number > 0 (1.0 keeps the "
                         f"paper's sizes), got {value!r}")
    return float(value)


def _rows(sizes, scale):
    scale = _check_scale(scale, "scale")
    return tuple(max(min(n, 16), int(round(n * scale))) for n in sizes)


def _widths(widths, width_scale):
    """Scale hidden widths; the last width (featuresize or 1) is kept."""
    width_scale = _check_scale(width_scale, "width_scale")
    hidden = tuple(max(8, int(round(w * width_scale))) for w in widths[:-1])
    return hidden + (widths[-1],)


def small(scale=1.0, width_scale=1.0, batch_size=8192, **kw):
    """Table 5.5 small model: fs 16, bottom 512-256-64-16, top 512-256-1, B 8192."""
    return DLRMConfig("small", _rows(KAGGLE_TABLE_SIZES, scale), 16,
                      _widths((512, 256, 64, 16), width_scale), _widths((512, 256, 1), width_scale),
                      batch_size, **kw)


def large(scale=1.0, width_scale=1.0, batch_size=32768, **kw):
    """Table 5.5 large model: fs 128, bottom 512-256-128, top 1024-1024-512-256-1, B 32768."""
    return DLRMConfig("large", _rows(KAGGLE_TABLE_SIZES, scale), 128,
                      _widths((512, 256, 128), width_scale),
                      _widths((1024, 1024, 512, 256, 1), width_scale), batch_size, **kw)


def table56(scale=1.0, width_scale=1.0, batch_size=512, **kw):
    """Table 5.6: 64 tables x 6M rows, fs 256, 100 lookups per output, bottom 8 x 2048,
    top 16 x 4096, B 512 (the bottom's last layer outputs featuresize, the top's 1)."""
    return DLRMConfig("table56", _rows((6_000_000,) * 64, scale), 256,
                      _widths((2048,) * 7 + (256,), width_scale),
                      _widths((4096,) * 15 + (1,), width_scale), batch_size, bag_size=100, **kw)


def tiny(scale=1.0, width_scale=1.0, batch_size=64, **kw):
    """A few small tables and narrow MLPs, for tests and the demo."""
    return DLRMConfig("tiny", _rows((1000, 300, 5000, 20), scale), 8,
                      _widths((32, 16, 8), width_scale), _widths((32, 16, 1), width_scale),
                      batch_size, bag_size=2, **kw)


CONFIGS = {"small": small, "large": large, "table56": table56, "tiny": tiny}


def get_config(name, **kw):
    """The config factory ``name`` ("small", "large", "table56", "tiny") called with ``kw``."""
    try:
        return CONFIGS[name](**kw)
    except KeyError:
        raise ValueError(f"unknown DLRM config {name!r}; choose from {', '.join(CONFIGS)}") from None
