"""Simulated Intel memory mode (2LM): DRAM as a direct-mapped, write-back cache over slow memory.

The baseline CachedArrays is compared to (dissertation ch. 2, §4.6); per-line traffic follows Table 2.2.
The dirty data optimisation (elided tag checks, §2.4.3) is not modelled.

``MemoryModeCache`` is the cache simulator; ``MemoryMode`` is the placement policy of the 2LM baseline
(registered as "memorymode" and "2lm"): every array in slow memory, the manager's fast memory standing
for the hardware cache, whose traffic per kernel goes to the cost model (``kernel_traffic``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from .. import costmodel
from ..copyengine import check_switch
from ..registry import register_policy
from ._memorymode_slots import (_CLEAN, _DIRTY, _DRAM_READ, _DRAM_WRITE, _FLUSHED, _HITS,
                                _NCOUNTERS, _READ_BYTES, _READ_LINES, _SLOW_READ, _SLOW_WRITE,
                                _WRITE_BYTES, _WRITE_LINES)
from .simple import SlowOnly

__all__ = [
    "DeviceProfile",
    "MemoryMode",
    "MemoryModeCache",
    "MemoryModeStats",
    "PROFILES",
    "get_profile",
    "load_profiles",
    "modelled_time",
]

_GB = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    """Read and write bandwidths (GB/s, 1e9 bytes per second) of the fast and the slow device."""

    name: str = "optane"
    dram_read_gbps: float = 110.0
    dram_write_gbps: float = 60.0
    slow_read_gbps: float = 30.0
    slow_write_gbps: float = 11.0

    def __post_init__(self):
        for f in fields(self):
            if f.name.endswith("_gbps"):
                value = getattr(self, f.name)
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                    raise ValueError(
                        f"DeviceProfile {self.name!r}: {f.name}={value!r} must be a positive number of GB/s"
                    )


def _from_tiers():
    """The cache's view of the cost model's tier profiles (one table of figures: costmodel)."""
    dram = costmodel.PROFILES["dram"]
    return {name: DeviceProfile(name, dram.read_gbps, dram.write_gbps, p.read_gbps, p.write_gbps)
            for name, p in costmodel.PROFILES.items() if p.latency == 0}


# Named profiles: DRAM in front of each latency-free slow tier of ``costmodel.PROFILES`` (optane,
# optane-2lm, cxl, and dram itself, which isolates the cost of the cache's extra DRAM traffic).
# Override with load_profiles(path).
PROFILES: dict[str, DeviceProfile] = _from_tiers()


def get_profile(profile: str | DeviceProfile | None = None) -> DeviceProfile:
    """Return a DeviceProfile given one, a name in PROFILES, or None for "optane"."""
    if profile is None:
        return PROFILES["optane"]
    if isinstance(profile, DeviceProfile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise KeyError(
            f"unknown device profile {profile!r}; known: {sorted(PROFILES)} (add one with load_profiles)"
        ) from None


def load_profiles(path: str | os.PathLike, base: dict[str, DeviceProfile] | None = None) -> dict[str, DeviceProfile]:
    """Return a copy of ``base`` (default PROFILES) with a JSON file's ``{"name": {"field": value}}`` applied.

    Fields not given keep their value; a new name starts from the DeviceProfile defaults.
    """
    with open(path) as fh:
        data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError(f"{os.fspath(path)}: expected a JSON object of profile name -> fields, got {type(data).__name__}")
    valid = {f.name for f in fields(DeviceProfile)} - {"name"}
    profiles = dict(PROFILES if base is None else base)
    for name, overrides in data.items():
        if not isinstance(overrides, dict):
            raise ValueError(f"{os.fspath(path)}: profile {name!r} must be a JSON object, got {type(overrides).__name__}")
        unknown = set(overrides) - valid
        if unknown:
            raise ValueError(
                f"{os.fspath(path)}: profile {name!r} has unknown fields {sorted(unknown)}; valid: {sorted(valid)}"
            )
        start = profiles.get(name, DeviceProfile(name=name))
        profiles[name] = replace(start, name=name, **overrides)
    return profiles


@dataclass(frozen=True)
class MemoryModeStats:
    """Counters of a MemoryModeCache: requested bytes, tag events (in lines) and device traffic (bytes)."""

    line_size: int
    read_bytes: int = 0
    write_bytes: int = 0
    read_lines: int = 0
    write_lines: int = 0
    hits: int = 0
    clean_misses: int = 0
    dirty_misses: int = 0
    flushed_lines: int = 0
    slow_read_bytes: int = 0
    slow_write_bytes: int = 0
    dram_read_bytes: int = 0
    dram_write_bytes: int = 0

    @property
    def requested_bytes(self) -> int:
        """Bytes the program asked to read or write."""
        return self.read_bytes + self.write_bytes

    @property
    def misses(self) -> int:
        """Clean plus dirty misses, in lines."""
        return self.clean_misses + self.dirty_misses

    @property
    def lines(self) -> int:
        """Line accesses (demand accesses at line granularity)."""
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """Hits per line access (0 when nothing was accessed)."""
        return self.hits / self.lines if self.lines else 0.0

    @property
    def slow_bytes(self) -> int:
        """Bytes read from plus written to slow memory."""
        return self.slow_read_bytes + self.slow_write_bytes

    @property
    def dram_bytes(self) -> int:
        """Bytes read from plus written to DRAM, tag checks included."""
        return self.dram_read_bytes + self.dram_write_bytes

    @property
    def amplification(self) -> float:
        """Slow-memory bytes per requested byte (0 when nothing was requested)."""
        return self.slow_bytes / self.requested_bytes if self.requested_bytes else 0.0

    @property
    def access_amplification(self) -> float:
        """Memory (DRAM + slow) line transfers per line access, the measure of Table 2.2."""
        return (self.dram_bytes + self.slow_bytes) / (self.lines * self.line_size) if self.lines else 0.0

    def as_dict(self) -> dict:
        """Counters and derived ratios as a plain dict (for telemetry and JSON)."""
        d = asdict(self)
        for key in ("requested_bytes", "misses", "lines", "hit_rate", "slow_bytes", "dram_bytes",
                    "amplification", "access_amplification"):
            d[key] = getattr(self, key)
        return d


def modelled_time(stats: MemoryModeStats, profile: str | DeviceProfile | None = None) -> float:
    """Seconds to move the counted traffic: bytes / bandwidth per class, summed (no overlap assumed)."""
    p = get_profile(profile)
    return (
        stats.dram_read_bytes / (p.dram_read_gbps * _GB)
        + stats.dram_write_bytes / (p.dram_write_gbps * _GB)
        + stats.slow_read_bytes / (p.slow_read_gbps * _GB)
        + stats.slow_write_bytes / (p.slow_write_gbps * _GB)
    )


class MemoryModeCache:
    """Direct-mapped write-back cache of ``capacity`` bytes (whole lines) over one flat slow address space.

    A ``line_size`` coarser than 64 B (e.g. 4096) runs faster but approximates: it counts per coarse line.
    """

    def __init__(self, capacity: int, line_size: int = 64, profile: str | DeviceProfile | None = None,
                 *, write_nofill: bool = False):
        capacity = int(capacity)
        line_size = int(line_size)
        if line_size <= 0:
            raise ValueError(f"MemoryModeCache: line_size={line_size} must be a positive number of bytes")
        if capacity < line_size:
            raise ValueError(
                f"MemoryModeCache: capacity {capacity} B holds no {line_size} B line; use capacity >= line_size"
            )
        self.line_size = line_size
        self.sets = capacity // line_size
        self.capacity = self.sets * line_size
        self.write_nofill = check_switch(write_nofill, "MemoryModeCache: write_nofill")
        self.profile = get_profile(profile)
        self.tags = np.full(self.sets, -1, dtype=np.int64)
        self.dirty_lines = np.zeros(self.sets, dtype=np.uint8)
        self._counters = np.zeros(_NCOUNTERS, dtype=np.int64)

    def __repr__(self) -> str:
        return (f"MemoryModeCache(capacity={self.capacity}, line_size={self.line_size}, "
                f"profile={self.profile.name!r}, write_nofill={self.write_nofill})")

    def access(self, start: int, nbytes: int, write: bool = False) -> None:
        """Read or write the bytes ``[start, start + nbytes)``, touching each overlapping line in order."""
        self.access_many(np.array([start], dtype=np.int64), np.array([nbytes], dtype=np.int64),
                         np.array([bool(write)]))

    def access_many(self, starts, lengths, writes) -> None:
        """Apply ranges in order (``writes``: a bool per range, or one for all). Misses fill from slow memory
        even for writes, as real 2LM does (its write amplification); ``write_nofill=True`` skips that fill."""
        starts = np.ascontiguousarray(starts, dtype=np.int64).reshape(-1)
        lengths = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
        if starts.shape != lengths.shape:
            raise ValueError(
                f"MemoryModeCache.access_many: {starts.size} starts but {lengths.size} lengths; pass one length per start"
            )
        w = np.asarray(writes)
        if w.ndim == 0:
            w = np.full(starts.size, bool(w), dtype=np.uint8)
        else:
            w = np.ascontiguousarray(w.reshape(-1) != 0, dtype=np.uint8)
            if w.size != starts.size:
                raise ValueError(
                    f"MemoryModeCache.access_many: {starts.size} ranges but {w.size} write flags; "
                    "pass one flag per range or a single bool"
                )
        if starts.size == 0:
            return
        if starts.min() < 0 or lengths.min() < 0:
            raise ValueError("MemoryModeCache.access_many: starts and lengths must be non-negative byte counts")
        from ._memorymode_kernels import _run    # numba loads on first use
        _run(self.tags, self.dirty_lines, starts, lengths, w, self.line_size, self.write_nofill, self._counters)

    def flush(self) -> int:
        """Write back every dirty line (counted as traffic); lines stay resident and clean. Returns lines written."""
        n = int(np.count_nonzero(self.dirty_lines))
        self.dirty_lines[:] = 0
        self._counters[_FLUSHED] += n
        self._counters[_DRAM_READ] += n
        self._counters[_SLOW_WRITE] += n
        return n

    def reset(self, *, keep_contents: bool = False) -> None:
        """Zero the counters; also empty the cache unless ``keep_contents`` (to measure a warm cache)."""
        self._counters[:] = 0
        if not keep_contents:
            self.tags[:] = -1
            self.dirty_lines[:] = 0

    def contains(self, addr: int) -> bool:
        """Whether the line holding byte ``addr`` is resident."""
        line = int(addr) // self.line_size
        return bool(self.tags[line % self.sets] == line)

    def isdirty(self, addr: int) -> bool:
        """Whether the line holding byte ``addr`` is resident and dirty."""
        line = int(addr) // self.line_size
        return bool(self.tags[line % self.sets] == line and self.dirty_lines[line % self.sets])

    def stats(self) -> MemoryModeStats:
        """A snapshot of the counters, with line counts turned into bytes."""
        c = [int(x) for x in self._counters]
        ls = self.line_size
        return MemoryModeStats(
            line_size=ls,
            read_bytes=c[_READ_BYTES],
            write_bytes=c[_WRITE_BYTES],
            read_lines=c[_READ_LINES],
            write_lines=c[_WRITE_LINES],
            hits=c[_HITS],
            clean_misses=c[_CLEAN],
            dirty_misses=c[_DIRTY],
            flushed_lines=c[_FLUSHED],
            slow_read_bytes=c[_SLOW_READ] * ls,
            slow_write_bytes=c[_SLOW_WRITE] * ls,
            dram_read_bytes=c[_DRAM_READ] * ls,
            dram_write_bytes=c[_DRAM_WRITE] * ls,
        )

    def modelled_time(self, profile: str | DeviceProfile | None = None) -> float:
        """Modelled seconds for the traffic so far, with this cache's profile unless one is given."""
        return modelled_time(self.stats(), self.profile if profile is None else profile)


# ---- the policy ----------------------------------------------------------------------------


class MemoryMode(SlowOnly):
    """Memory mode (2LM) as a policy: every array lives in slow memory, as with SlowOnly, and the
    manager's fast memory acts as a hardware direct-mapped write-back cache over the slow device.

    The cache (``self.cache``, a ``MemoryModeCache`` of ``capacity`` bytes, by default the fast
    device's size) is indexed by offsets on the slow device. ``kernel_traffic(k, reads, writes)``,
    which a trace ``Recorder`` calls at each kernel, feeds it every operand's whole region (reads
    first, then writes, in order) and returns the cost-model record ``("cache", k, req_read,
    req_write, dram_read, dram_write, slow_read, slow_write)``: the change of its counters. The
    slow heap's offsets are the same in a real run and in a replay on virtual devices, so the
    records are too (the policy is replay-safe and deterministic).

    Nothing is ever placed in or moved to fast memory (placement hints, prefetch and evict are
    ignored). ``cleanup=False`` turns off eager frees (2LM:0, as SlowOnly). A cache smaller
    than one line (a zero fast budget) is no cache: every requested byte goes to slow memory.
    """

    name = "memorymode"
    honours_prefetch = False
    honours_softevict = False
    tracks_reads = False

    def __init__(self, line_size=64, capacity=None, write_nofill=False, cleanup=True):
        super().__init__()
        if isinstance(line_size, bool) or not isinstance(line_size, int) or line_size <= 0:
            raise ValueError(f"MemoryMode: line_size={line_size!r} must be a positive number of bytes")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or capacity < 0):
            raise ValueError(f"MemoryMode: capacity={capacity!r} must be a number of bytes >= 0 "
                             "(None: the fast device's size)")
        self.line_size = line_size
        self.capacity = capacity
        self.write_nofill = check_switch(write_nofill, "MemoryMode: write_nofill")
        self.allows_cleanup = check_switch(cleanup, "MemoryMode: cleanup")
        self.cache = None
        self._last = None             # (k, operand ids, record) of the kernel being acquired

    def bind(self, manager):
        super().bind(manager)
        if self.cache is None:
            cap = manager.fast.size if self.capacity is None else self.capacity
            if cap >= self.line_size:
                self.cache = MemoryModeCache(cap, self.line_size, write_nofill=self.write_nofill)

    def place(self, nbytes, placement=None):
        return self.alloc_slow(nbytes)

    # The manager reports the uses of a kernel's operands after every observer has seen the
    # kernel: the next kernel_traffic call belongs to another kernel.
    def read_use(self, obj):
        self._last = None

    def write_use(self, obj):
        self._last = None
        super().write_use(obj)

    def stats(self):
        """The cache's counters so far (None without a cache)."""
        return self.cache.stats() if self.cache is not None else None

    def kernel_traffic(self, k, reads, writes):
        """The cost-model record of kernel k: the simulated cache's traffic for its operands."""
        ops = [(o, False) for o in reads] + [(o, True) for o in writes]
        key = tuple((o.id, w) for o, w in ops)
        if self._last is not None and self._last[0] == k and self._last[1] == key:
            return self._last[2]          # a second recorder of the same kernel: counted once
        m = self.manager
        slow, fast = m.slow, m.fast
        starts, lengths, flags = [], [], []
        direct = [0, 0, 0, 0, 0, 0]      # requested r/w, dram r/w, slow r/w outside the cache
        for o, w in ops:
            x = o.primary
            n = x.nbytes if x is not None else 0
            if n <= 0:
                continue
            if x.device is slow and self.cache is not None:
                starts.append(x.data_offset)
                lengths.append(n)
                flags.append(w)
                continue
            direct[1 if w else 0] += n
            if x.device is fast:          # not placed by this policy; a DRAM access
                direct[3 if w else 2] += n
            else:                         # no cache, or a slower tier: straight to it
                direct[5 if w else 4] += n
        if starts:
            c = self.cache._counters
            before = c.copy()
            self.cache.access_many(np.asarray(starts, dtype=np.int64),
                                   np.asarray(lengths, dtype=np.int64), np.asarray(flags))
            d = [int(v) for v in c - before]
            ls = self.cache.line_size
            cached = (d[_READ_BYTES], d[_WRITE_BYTES], d[_DRAM_READ] * ls, d[_DRAM_WRITE] * ls,
                      d[_SLOW_READ] * ls, d[_SLOW_WRITE] * ls)
        else:
            cached = (0,) * 6
        rec = ("cache", k) + tuple(a + b for a, b in zip(cached, direct))
        self._last = (k, key, rec)
        return rec


register_policy(MemoryMode.name, MemoryMode)
register_policy("2lm", MemoryMode)
