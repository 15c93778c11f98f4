"""Copy engine: multi-threaded copies with non-temporal stores, cache-line flushes and mbind.

Addresses are Python ints (cffi pointers are accepted too). The default thread count is chosen
once, at the first large copy or an explicit calibrate(), by timing a 64 MiB copy at 1 and 2
threads; the environment variable CACHEDARRAYS_COPY_THREADS overrides it.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time

from cachedarrays._native import ffi, lib

log = logging.getLogger(__name__)

ENV_THREADS = "CACHEDARRAYS_COPY_THREADS"
MT_MIN = 1 << 20
"""Copies smaller than this always run on one thread (the native engine's threshold)."""
CALIBRATION_BYTES = 64 << 20

_engine_lock = threading.Lock()
_copy_u = lib.ca_copy_u
_chosen = False


def _ptr(addr, what):
    if isinstance(addr, ffi.CData):
        return ffi.cast("void *", addr)
    try:
        a = int(addr)
    except TypeError:
        raise TypeError(f"{what} must be an int address or a cffi pointer, got {type(addr).__name__}") from None
    if a < 0 or a >= 1 << 64:
        raise ValueError(f"{what} address {a} is outside the address space")
    return ffi.cast("void *", a)


def _size(n, what="nbytes"):
    n = int(n)
    if n < 0 or n >= 1 << 64:
        raise ValueError(f"{what} must be in [0, 2**64), got {n}")
    return n


def copy(dst_address, src_address, nbytes: int, threads: int | None = None,
         persist: bool = False) -> None:
    """Copy nbytes from src to dst (non-overlapping); threads None uses the default count.

    persist=True writes the destination's cache lines back (for DAX-mapped persistent memory).
    """
    if type(nbytes) is int and 0 < nbytes < MT_MIN and type(dst_address) is int \
            and type(src_address) is int and (threads is None or type(threads) is int and threads > 0):
        try:
            _copy_u(dst_address, src_address, nbytes, threads or 0,
                    lib.CA_COPY_PERSIST if persist else 0)     # fastest path: small, plain ints
        except OverflowError:
            raise ValueError(f"copy of {nbytes} bytes from {src_address} to {dst_address}: "
                             f"addresses must be in [0, 2**64)") from None
        return
    if threads is None:
        t = 0
    else:
        t = int(threads)
        if t < 1:
            raise ValueError(f"threads must be >= 1 (or None for the default), got {threads}")
    flags = lib.CA_COPY_PERSIST if persist else 0
    if type(dst_address) is int and type(src_address) is int and type(nbytes) is int and nbytes > 0:
        if t == 0 and not _chosen and nbytes >= MT_MIN:
            _choose_default()
        try:
            lib.ca_copy_u(dst_address, src_address, nbytes, t, flags)   # fast path: plain ints
        except OverflowError:
            raise ValueError(f"copy of {nbytes} bytes from {src_address} to {dst_address}: "
                             f"addresses and size must be in [0, 2**64)") from None
        return
    n = _size(nbytes)
    if n == 0:
        return
    d = _ptr(dst_address, "destination")
    s = _ptr(src_address, "source")
    if t == 0 and not _chosen and n >= MT_MIN:
        _choose_default()
    lib.ca_copy(d, s, n, t, flags)


def set_threads(n: int) -> None:
    """Set the default thread count for copies (>= 1); disables automatic calibration."""
    global _chosen
    n = int(n)
    if n < 1:
        raise ValueError(f"copy thread count must be >= 1, got {n}")
    with _engine_lock:
        lib.ca_copy_set_threads(n)
        _chosen = True


def get_threads() -> int:
    """The default thread count (calibrating first if it was not chosen yet)."""
    if not _chosen:
        _choose_default()
    return int(lib.ca_copy_get_threads())


def set_nt_threshold(nbytes: int) -> None:
    """Copies of at least nbytes use non-temporal stores; 0 disables them."""
    lib.ca_copy_set_nt_threshold(_size(nbytes))


def get_nt_threshold() -> int:
    """The non-temporal store threshold in bytes (0: disabled)."""
    return int(lib.ca_copy_get_nt_threshold())


def isa() -> str:
    """The streaming-store instruction set picked at run time: 'avx512', 'avx2' or 'sse2'."""
    return ffi.string(lib.ca_copy_isa()).decode()


def set_isa(name: str) -> None:
    """Force the streaming-store ISA ('avx512', 'avx2', 'sse2'); for tests and benchmarks."""
    if lib.ca_copy_set_isa(str(name).encode()) != lib.CA_OK:
        raise ValueError(f"streaming-store ISA {name!r} is unknown or not supported by this CPU; "
                         f"use one of 'avx512', 'avx2', 'sse2' that the CPU has")


def flush(addr, nbytes: int) -> None:
    """Write back the cache lines of [addr, addr+nbytes) and fence (DAX persistence)."""
    n = _size(nbytes)
    if n:
        lib.ca_flush(_ptr(addr, "flush"), n)


def mbind(addr, nbytes: int, node: int) -> None:
    """Bind the pages of [addr, addr+nbytes) to NUMA node `node`; raises OSError on failure."""
    n = _size(nbytes)
    rc = lib.ca_mbind(_ptr(addr, "mbind"), n, int(node))
    if rc:
        raise OSError(rc, f"mbind of {n} bytes at {int(ffi.cast('uintptr_t', _ptr(addr, 'mbind'))):#x} "
                          f"to NUMA node {node} failed: {os.strerror(rc)}; check the node exists "
                          f"(/sys/devices/system/node) and the range is mapped")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _choose_default() -> None:
    """Pick the default thread count once: from the environment, else by calibration."""
    global _chosen
    with _engine_lock:
        if _chosen:
            return
        env = os.environ.get(ENV_THREADS)
        if env:
            try:
                n = int(env)
                if n < 1:
                    raise ValueError
            except ValueError:
                log.warning("%s=%r is not a positive int; calibrating instead", ENV_THREADS, env)
            else:
                lib.ca_copy_set_threads(n)
                _chosen = True
                log.info("copy threads %d from %s", n, ENV_THREADS)
                return
        n = _calibrate_locked()
        lib.ca_copy_set_threads(n)
        _chosen = True


def calibrate(nbytes: int = CALIBRATION_BYTES, repeats: int = 3) -> int:
    """Time a copy of nbytes at 1 and 2 threads (min of repeats); set and return the faster."""
    global _chosen
    with _engine_lock:
        n = _calibrate_locked(nbytes, repeats)
        lib.ca_copy_set_threads(n)
        _chosen = True
        return n


def _calibrate_locked(nbytes: int = CALIBRATION_BYTES, repeats: int = 3) -> int:
    candidates = [t for t in (1, 2) if t <= _cpus()]
    if len(candidates) < 2:
        return 1
    t0 = time.perf_counter()
    src = mmap.mmap(-1, nbytes)
    dst = mmap.mmap(-1, nbytes)
    best = {}
    try:
        with ffi.from_buffer(src) as s, ffi.from_buffer(dst) as d:
            lib.ca_copy(d, s, nbytes, 2, 0)   # fault both buffers in before timing
            lib.ca_copy(s, d, nbytes, 2, 0)
            for _ in range(repeats):
                for t in candidates:
                    a = time.perf_counter()
                    lib.ca_copy(d, s, nbytes, t, 0)
                    el = time.perf_counter() - a
                    best[t] = min(best.get(t, el), el)
    finally:
        src.close()
        dst.close()
    # more threads must win by a few percent to be worth the wake-up cost on small copies
    chosen = min(candidates, key=lambda t: (best[t] * (1.0 + 0.03 * (t - 1)), t))
    log.info("copy calibration: %s -> %d threads (%.0f ms)",
             ", ".join(f"{t} thr {nbytes / best[t] / 1e9:.1f} GB/s" for t in candidates),
             chosen, (time.perf_counter() - t0) * 1e3)
    return chosen
