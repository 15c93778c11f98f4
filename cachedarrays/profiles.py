"""Device profiles: a tier's read and write bandwidth and latency, by preset name.

The cost model times copies and kernels with them; a manager checks the profile each tier names.
"""

import math
import numbers
from dataclasses import dataclass

__all__ = ["Profile", "PROFILES", "get_profile"]


def _number(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass(frozen=True)
class Profile:
    """A device's read and write bandwidth (GB/s, 1e9 B/s) and latency (seconds, once per copy)."""

    name: str
    read_gbps: float
    write_gbps: float
    latency: float = 0.0

    def __post_init__(self):
        for f, fix in (("read_gbps", "a positive, finite number of GB/s (1e9 B/s), e.g. 30.0"),
                       ("write_gbps", "a positive, finite number of GB/s (1e9 B/s), e.g. 11.0"),
                       ("latency", "a finite number of seconds >= 0, e.g. 20e-6 (0.0 for none)")):
            v = getattr(self, f)
            if not (_number(v) and math.isfinite(v) and (v >= 0 if f == "latency" else v > 0)):
                raise ValueError(f"Profile {self.name!r}: {f}={v!r} is out of range; give {fix}")
            object.__setattr__(self, f, float(v))


PROFILES: dict[str, Profile] = {
    # Dissertation Fig. 3.3 (quoted in §5.3.3): DRAM reads 110 GB/s; no write figure given, 60 assumed.
    "dram": Profile("dram", 110.0, 60.0),
    # Dissertation §2.3.3: six interleaved Optane DIMMs reach just over 30 GB/s read and 11 GB/s write.
    "optane": Profile("optane", 30.0, 11.0),
    # Dissertation §2.4.4: the most PM bandwidth seen in memory mode (2LM): 23 GB/s read, 8 GB/s write.
    "optane-2lm": Profile("optane-2lm", 23.0, 8.0),
    # Not measured: an illustrative CXL Type-3 expander on PCIe 5.0 x8 (~32 GB/s raw per direction).
    "cxl": Profile("cxl", 25.0, 20.0),
    # G10 paper's SSD: 3.2 GB/s read, 3.0 GB/s write, 20 us read / 16 us write latency (20 us used).
    "nvme-ssd": Profile("nvme-ssd", 3.2, 3.0, 20e-6),
}


def get_profile(p) -> Profile:
    """Return ``p`` if it is a Profile, else the preset named ``p``."""
    if isinstance(p, Profile):
        return p
    if isinstance(p, str) and p in PROFILES:
        return PROFILES[p]
    raise ValueError(f"unknown device profile {p!r}; give a Profile or one of {sorted(PROFILES)}")
