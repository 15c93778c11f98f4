"""Kernel tracing: each kernel's read and write sets, slow-memory traffic and the modelled time.

One hook (``KernelTracer.record``, called by ``Session.kernel`` while the arrays are pinned)
serves both baselines: in the CachedArrays setups it counts the bytes kernels read from and write
to arrays whose primary is in slow memory; in the memory-mode (2LM) baseline every array lives
in slow memory and each range (slow-heap offset of the view) goes through a ``MemoryModeCache``.

Modelled time of one iteration on a slow-device profile (R = read, W = write bandwidth):

  CA setups: T = T_wall' + B(s->f)*(1/R_slow - 1/R_dram) + B(f->s)*(1/W_slow - 1/W_dram)
                         + sum over kernels k of P_k
             P_k = r_k*(1/R_slow - 1/R_dram)                              no output in slow memory
             P_k = max(r_k*(1/R_slow - 1/R_dram) + w_k*(1/W_slow - 1/W_dram), (F - 1)*t_k)
                                                                           an output in slow memory
  2LM:       T = T_wall' + T_cache(traffic of the simulated DRAM cache, memorymode.modelled_time)
                         - (K_read/R_dram + K_write/W_dram)

T_wall' is the measured wall time minus the tracer's own bookkeeping (the 2LM cache simulation
runs inside the step but is not part of the workload). B(...) are bytes the manager moved between
tiers (m.stats()); r_k, w_k the bytes kernel k read/wrote in arrays whose primary is in slow
memory, t_k its measured time and F the Fig. 3.4 slowdown of kernels with an output in slow
memory (default 2). A kernel with a slow output pays the larger of its bandwidth penalty and the
empirical factor, not their sum (both model the same slow writes). K_read/K_write are the bytes
kernels moved through the simulated cache, which T_cache prices at DRAM speed on hits.
On this machine both tiers are DRAM, so the measured wall time already pays every byte at DRAM
speed; the model adds the difference. Array bytes are counted once per kernel (a streaming
model: re-reads that hit in the CPU caches are free), and copies cost only their bandwidth.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict

from cachedarrays.policies.memorymode import MemoryModeCache, get_profile
from cachedarrays.policies.memorymode import modelled_time as cache_time

__all__ = ["KernelTracer", "modelled_time", "FORMULA", "SLOW_OUTPUT_FACTOR"]

SLOW_OUTPUT_FACTOR = 2.0
FORMULA = __doc__[__doc__.index("Modelled time"):__doc__.index("T_wall' is")].rstrip()
_GB = 1e9
_perf = time.perf_counter


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
        self.slow_output = []        # (slow bytes read, slow bytes written, seconds) per kernel
        self.overhead_seconds = 0.0  # time spent in record() itself (excluded from T_wall')
        self.by_kernel = defaultdict(lambda: [0, 0.0])
        if self.cache is not None:
            self.cache.reset(keep_contents=True)

    def record(self, name, reads, writes, read_views, write_views, seconds):
        """Called once per kernel with its arrays and their pinned ndarray views."""
        t0 = _perf()
        k_read, k_write = self.slow_read_bytes, self.slow_write_bytes
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
            self.slow_output.append((self.slow_read_bytes - k_read,
                                     self.slow_write_bytes - k_write, seconds))
        if ranges:
            starts, lengths, flags = zip(*ranges)
            self.cache.access_many(starts, lengths, flags)
        self.overhead_seconds += _perf() - t0

    def summary(self):
        """Counters as a dict (with the 2LM cache statistics when simulating)."""
        out = {k: getattr(self, k) for k in ("kernels", "kernel_seconds", "read_bytes", "write_bytes",
                                             "slow_read_bytes", "slow_write_bytes",
                                             "slow_output_kernels", "slow_output_seconds",
                                             "overhead_seconds")}
        if self.cache is not None:
            out["memory_mode"] = self.cache.stats().as_dict()
        return out


def modelled_time(wall, stats, tracer, profile=None, slow_output_factor=SLOW_OUTPUT_FACTOR,
                  combine="max"):
    """Modelled seconds of one iteration (see the module docstring): wall time plus the penalty.

    stats: the manager's ``m.stats()`` for the iteration; tracer: its KernelTracer. combine="sum"
    adds the bandwidth penalty and the slow-output factor of a kernel instead of taking the
    larger (the previous, more pessimistic formula; for comparison).
    """
    if combine not in ("max", "sum"):
        raise ValueError(f"modelled_time: combine must be 'max' or 'sum', got {combine!r}")
    p = get_profile(profile)
    dr, dw = 1 / (p.dram_read_gbps * _GB), 1 / (p.dram_write_gbps * _GB)
    sr, sw = 1 / (p.slow_read_gbps * _GB), 1 / (p.slow_write_gbps * _GB)
    wall = max(0.0, wall - tracer.overhead_seconds)
    if tracer.cache is not None:
        mm = tracer.cache.stats()
        return wall + cache_time(mm, p) - (mm.read_bytes * dr + mm.write_bytes * dw)
    moved = stats["moved"]
    up = moved.get("slow->fast", {}).get("bytes", 0)
    down = moved.get("fast->slow", {}).get("bytes", 0)
    t = wall + up * (sr - dr) + down * (sw - dw)
    # Kernels without a slow output pay their slow reads; the others per the formula.
    out_r = sum(r for r, _, _ in tracer.slow_output)
    t += (tracer.slow_read_bytes - out_r) * (sr - dr)
    f = slow_output_factor - 1
    for r, w, sec in tracer.slow_output:
        bw = r * (sr - dr) + w * (sw - dw)
        t += max(bw, f * sec) if combine == "max" else bw + f * sec
    return t
