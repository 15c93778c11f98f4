"""Kernel tracing: each kernel's read and write sets, slow-memory traffic and the modelled time.

One hook (``KernelTracer.record``, called by ``Session.kernel`` while the arrays are pinned)
serves both baselines: in the CachedArrays modes it counts the bytes kernels read from and write
to arrays whose primary is in slow memory; in the memory-mode (2LM) baseline every array lives
in slow memory and each range (slow-heap offset of the view) goes through a ``MemoryModeCache``.

Modelled time of one iteration on a slow-device profile (R = read, W = write bandwidth):

  CA modes:  T = T_wall + B(s->f)*(1/R_slow - 1/R_dram) + B(f->s)*(1/W_slow - 1/W_dram)
                        + K_read_slow*(1/R_slow - 1/R_dram) + K_write_slow*(1/W_slow - 1/W_dram)
                        + (F - 1) * T_out_slow
  2LM:       T = T_wall + T_cache(traffic of the simulated DRAM cache, memorymode.modelled_time)
                        - (K_read/R_dram + K_write/W_dram)

B(...) are bytes the manager moved between tiers (m.stats()), K_* bytes kernels read/wrote in
slow memory, T_out_slow the measured time of kernels with an output in slow memory and F the
Fig. 3.4 slowdown of such kernels (default 2). On this machine both tiers are DRAM, so the
measured wall time already pays every byte at DRAM speed; the model adds the difference.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

from cachedarrays.policies.memorymode import MemoryModeCache, get_profile
from cachedarrays.policies.memorymode import modelled_time as cache_time

__all__ = ["KernelTracer", "modelled_time", "FORMULA", "SLOW_OUTPUT_FACTOR"]

SLOW_OUTPUT_FACTOR = 2.0
FORMULA = __doc__[__doc__.index("Modelled time"):__doc__.index("B(...)")].rstrip()
_GB = 1e9


class KernelTracer:
    """Counts per-kernel traffic; with ``cache`` (a MemoryModeCache) also simulates 2LM."""

    def __init__(self, manager, cache: MemoryModeCache | None = None):
        self._mref = weakref.ref(manager)
        self.cache = cache
        self.reset()

    def reset(self):
        """Zero the counters (the simulated cache keeps its contents: a warm cache)."""
        self.kernels = 0
        self.kernel_seconds = 0.0
        self.read_bytes = self.write_bytes = 0
        self.slow_read_bytes = self.slow_write_bytes = 0
        self.slow_output_kernels = 0
        self.slow_output_seconds = 0.0
        self.by_kernel = defaultdict(lambda: [0, 0.0])
        if self.cache is not None:
            self.cache.reset(keep_contents=True)

    def record(self, name, reads, writes, read_views, write_views, seconds):
        """Called once per kernel with its arrays and their pinned ndarray views."""
        slow = self._mref().slow
        base = slow.address
        ranges = [] if self.cache is not None else None
        self.kernels += 1
        self.kernel_seconds += seconds
        k = self.by_kernel[name]
        k[0] += 1
        k[1] += seconds
        for a, v in zip(reads, read_views):
            if a is None:
                continue
            n = v.nbytes
            self.read_bytes += n
            if a.object.primary.device is slow:
                self.slow_read_bytes += n
                if ranges is not None:
                    ranges.append((v.__array_interface__["data"][0] - base, n, False))
        out_slow = False
        for a, v in zip(writes, write_views):
            if a is None:
                continue
            n = v.nbytes
            self.write_bytes += n
            if a.object.primary.device is slow:
                self.slow_write_bytes += n
                out_slow = True
                if ranges is not None:
                    ranges.append((v.__array_interface__["data"][0] - base, n, True))
        if out_slow:
            self.slow_output_kernels += 1
            self.slow_output_seconds += seconds
        if ranges:
            starts, lengths, flags = zip(*ranges)
            self.cache.access_many(starts, lengths, flags)

    def summary(self):
        """Counters as a dict (with the 2LM cache statistics when simulating)."""
        out = {k: getattr(self, k) for k in ("kernels", "kernel_seconds", "read_bytes", "write_bytes",
                                             "slow_read_bytes", "slow_write_bytes",
                                             "slow_output_kernels", "slow_output_seconds")}
        if self.cache is not None:
            out["memory_mode"] = self.cache.stats().as_dict()
        return out


def modelled_time(wall, stats, tracer, profile=None, slow_output_factor=SLOW_OUTPUT_FACTOR):
    """Modelled seconds of one iteration (see the module docstring): wall time plus the penalty.

    stats: the manager's ``m.stats()`` for the iteration; tracer: its KernelTracer.
    """
    p = get_profile(profile)
    dr, dw = 1 / (p.dram_read_gbps * _GB), 1 / (p.dram_write_gbps * _GB)
    sr, sw = 1 / (p.slow_read_gbps * _GB), 1 / (p.slow_write_gbps * _GB)
    if tracer.cache is not None:
        mm = tracer.cache.stats()
        return wall + cache_time(mm, p) - (mm.read_bytes * dr + mm.write_bytes * dw)
    moved = stats["moved"]
    up = moved.get("slow->fast", {}).get("bytes", 0)
    down = moved.get("fast->slow", {}).get("bytes", 0)
    return (wall + up * (sr - dr) + down * (sw - dw)
            + tracer.slow_read_bytes * (sr - dr) + tracer.slow_write_bytes * (sw - dw)
            + (slow_output_factor - 1) * tracer.slow_output_seconds)
