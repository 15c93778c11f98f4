"""Copy engine: multi-threaded copies with non-temporal stores, cache-line flushes and mbind.

Addresses are Python ints (cffi pointers are accepted too). The default thread count is chosen
once, at the first large copy or an explicit calibrate(), by timing a 64 MiB copy at 1 and 2
threads; the environment variable CACHEDARRAYS_COPY_THREADS overrides it.

Asynchronous copies (CopyWorkers, CopyJob)
------------------------------------------
``CopyWorkers.submit(key, dst, src, nbytes)`` queues a copy and returns a CopyJob at once. There
is one daemon worker thread per direction ``key`` (e.g. ``"fast->slow"``), started at the first
submit for that key, so copies in different directions overlap while each direction runs its
jobs one at a time in FIFO order. A job is copied in chunks of ``CopyWorkers.chunk`` bytes
(default 8 MiB) with ``copy()``, which releases the GIL (cffi API-mode calls run without it),
so cancellation is prompt and Python threads keep running during copies.

Cancellation: ``job.cancel()`` on a queued job marks it cancelled; it never starts. On a
running job it asks the worker to stop at the next chunk boundary and waits for the chunk in
flight, so when cancel() returns the job no longer touches memory (the destination holds a
copied prefix of ``job.copied`` bytes). It returns True when the copy did not complete, False
when it had already finished (even with an exception). Done callbacks always run once, on the
worker thread (cancelled queued jobs too, when the worker reaches them), or at once in the
caller's thread when added to a finished job; an exception a callback raises is logged
either way, never raised. A callback never waits for its own worker: ``drain()``, or
``wait()`` on a job queued behind it, raises RuntimeError there instead of hanging, and
``shutdown()`` there waits for the copies in flight but joins no thread. ``shutdown()``
elsewhere joins the threads; a CopyWorkers
that is garbage collected without shutdown lets its workers finish the queued jobs, after which
they exit (no submit is possible any more), so threads never leak.
"""
from __future__ import annotations

import logging
import math
import mmap
import numbers
import operator
import os
import collections
import concurrent.futures
import threading
import time
import weakref

from numpy import bool_ as np_bool

from cachedarrays._native import ffi, lib

log = logging.getLogger(__name__)

ENV_THREADS = "CACHEDARRAYS_COPY_THREADS"
MT_MIN = 1 << 20
"""Copies smaller than this always run on one thread (the native engine's threshold)."""
CALIBRATION_BYTES = 64 << 20

_engine_lock = threading.Lock()
_copy_u = lib.ca_copy_u
_chosen = False


def _after_fork_in_child():
    global _engine_lock
    _engine_lock = threading.Lock()     # a thread of the parent may have held it (calibrating)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _whole(n, what, low=0, high=1 << 64):
    """n as an int in [low, high): TypeError for a bool, float or str (never rounded or parsed),
    ValueError outside the range."""
    if isinstance(n, bool):
        raise TypeError(f"{what} must be an int, not a bool")
    try:
        v = operator.index(n)
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(n).__name__} {n!r} (it is never "
                        "rounded or parsed); pass a whole number") from None
    if not low <= v < high:
        bound = f">= {low}" if low and high == 1 << 64 and v < low else \
            f"in [{low}, {_BOUNDS.get(high, high)})"
        raise ValueError(f"{what} must be {bound}, got {v}")
    return v


_BOUNDS = {1 << 64: "2**64", 1 << 31: "2**31"}


def check_timeout(timeout, what="timeout"):
    """timeout as a float number of seconds, or None (no limit, also for +inf); a negative one
    is 0. TypeError for a bool, str or other non-number, ValueError for NaN."""
    if timeout is None:
        return None
    if isinstance(timeout, (bool, str, bytes)) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds or None (no limit), not "
                        f"{type(timeout).__name__} {timeout!r}")
    t = float(timeout)
    if math.isnan(t):
        raise ValueError(f"{what} is NaN; pass a number of seconds or None (no limit)")
    return None if t == math.inf else max(0.0, t)


def check_switch(v, what):
    """v as a bool if it is True or False (NumPy's bools too); TypeError otherwise, naming
    `what`, the value's type and the fix (the text "no", None, 2 or an array is no answer)."""
    if not isinstance(v, (bool, np_bool)):
        name = what.rpartition(" ")[2]
        raise TypeError(f"{what}={v!r} must be True or False, not {type(v).__name__}; write "
                        f"{name}=True or {name}=False")
    return bool(v)


def _ptr(addr, what):
    if isinstance(addr, ffi.CData):
        return ffi.cast("void *", addr)
    if isinstance(addr, bool) or not hasattr(type(addr), "__index__"):
        raise TypeError(f"{what} must be an int address or a cffi pointer, got "
                        f"{type(addr).__name__}")
    a = operator.index(addr)
    if a < 0 or a >= 1 << 64:
        raise ValueError(f"{what} address {a} is outside the address space")
    return ffi.cast("void *", a)


def _size(n, what="nbytes"):
    return _whole(n, what)


def _threads(n, what="threads"):
    """A thread count: an int >= 1 (counts above the engine's 64 are clamped to 64)."""
    return min(_whole(n, what, 1, 1 << 64), 64)


def _check_apart(dst, src, n):
    """ValueError if [dst, dst+n) and [src, src+n) overlap but differ (the copy would read
    bytes it already overwrote; the same range is a no-op)."""
    if dst != src and dst < src + n and src < dst + n:
        raise ValueError(f"copy of {n} bytes from {src:#x} to {dst:#x}: the ranges overlap "
                         f"by {n - abs(dst - src)} bytes; copy through a separate buffer (or "
                         "np.copyto on views, which handles overlap)")


def copy(dst_address, src_address, nbytes: int, threads: int | None = None,
         persist: bool = False) -> None:
    """Copy nbytes from src to dst (non-overlapping); threads None uses the default count.

    persist=True writes the destination's cache lines back (for DAX-mapped persistent memory).
    """
    if persist is not False and persist is not True:
        persist = check_switch(persist, "copy: persist")
    if type(nbytes) is int and 0 < nbytes < MT_MIN and type(dst_address) is int \
            and type(src_address) is int and (threads is None or type(threads) is int and
                                              0 < threads <= 64) \
            and (dst_address >= src_address + nbytes or src_address >= dst_address + nbytes):
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
        t = _threads(threads, "threads (or None for the default)")
    flags = lib.CA_COPY_PERSIST if persist else 0
    if type(dst_address) is int and type(src_address) is int and type(nbytes) is int and nbytes > 0:
        _check_apart(dst_address, src_address, nbytes)
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
    _check_apart(int(ffi.cast("uintptr_t", d)), int(ffi.cast("uintptr_t", s)), n)
    if t == 0 and not _chosen and n >= MT_MIN:
        _choose_default()
    lib.ca_copy(d, s, n, t, flags)


def set_threads(n: int) -> None:
    """Set the default thread count for copies (>= 1); disables automatic calibration."""
    global _chosen
    n = _threads(n, "copy thread count")
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
    node = _whole(node, "NUMA node", 0, 1 << 31)
    rc = lib.ca_mbind(_ptr(addr, "mbind"), n, node)
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
    nbytes = _whole(nbytes, "calibration bytes", 1)
    repeats = _whole(repeats, "calibration repeats", 1)
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


# ---- asynchronous copies ----

_QUEUED, _RUNNING, _DONE, _CANCELLED = range(4)
DEFAULT_CHUNK = 8 << 20


def _check_key(key, what):
    """key, if it can key a worker (hashable); TypeError naming it and the fix otherwise."""
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"{what}: key {key!r} is a {type(key).__name__}, which cannot name a "
                        "worker (it is unhashable); pass a str, an int or a tuple of them, e.g. "
                        "('fast', 'slow')") from None
    return key


def _addr_int(a, what):
    return int(ffi.cast("uintptr_t", _ptr(a, what)))


class _Shared:
    """State shared by a CopyWorkers, its threads and its jobs (never the CopyWorkers itself,
    so it can be garbage collected while workers run)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.queues = {}      # key -> deque of CopyJob (cancelled ones stay until popped)
        self.running = {}     # key -> CopyJob being copied or finishing (callbacks)
        self.threads = {}     # key -> Thread
        self.closed = False
        self.pid = os.getpid()    # a forked child has none of these threads


def _close(shared, cancel):
    """Stop accepting jobs; cancel the queued ones if asked. Workers exit when their queue empties."""
    with shared.cond:
        shared.closed = True
        if cancel:
            for q in shared.queues.values():
                for job in q:
                    job._cancel_queued()
        shared.cond.notify_all()


class CopyJob:
    """One asynchronous copy of nbytes from src_addr to dst_addr; see the module docstring."""

    def __init__(self, shared, key, dst, src, nbytes, persist, keepalive, chunk):
        self.key, self.nbytes = key, nbytes
        self.exception = None
        self.seconds = 0.0          # time the copy itself took
        self.waited = 0.0           # total seconds callers spent blocked in wait()
        self.copied = 0             # bytes copied (a prefix, when cancelled while running)
        self._s, self._dst, self._src, self._persist = shared, dst, src, persist
        self._keepalive, self._chunk = keepalive, chunk
        self._state, self._stop, self._callbacks = _QUEUED, False, []

    def __repr__(self):
        st = ("queued", "running", "done", "cancelled")[self._state]
        return f"<CopyJob {self.key!r} {self.nbytes} bytes {st}>"

    def done(self) -> bool:
        """True when the job finished: copied, failed or cancelled."""
        return self._state >= _DONE

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finished or was cancelled; False if timeout (seconds) ran out."""
        timeout = check_timeout(timeout)
        if self._state >= _DONE:
            return True
        if getattr(_worker_here, "shared", None) is self._s and _worker_here.key == self.key:
            raise RuntimeError(f"{self!r} waits for its worker, which is running the done "
                               "callback that called wait() and so never reaches this job; "
                               "add a done callback to the job instead of waiting for it")
        t0 = time.perf_counter()
        with self._s.cond:
            ok = self._s.cond.wait_for(self.done, timeout)
            self.waited += time.perf_counter() - t0
        return ok

    def result(self, timeout: float | None = None) -> None:
        """Wait, then re-raise the copy's exception; CancelledError if cancelled, TimeoutError."""
        if not self.wait(timeout):
            raise TimeoutError(f"{self!r} did not finish within {timeout} s")
        if self._state == _CANCELLED:
            raise concurrent.futures.CancelledError(f"{self!r} was cancelled")
        if self.exception is not None:
            raise self.exception

    def _cancel_queued(self):     # with the lock held
        if self._state == _QUEUED:
            self._state = _CANCELLED
            self._s.cond.notify_all()

    def cancel(self) -> bool:
        """Cancel; True if the copy did not complete. Waits for a running chunk to finish."""
        with self._s.cond:
            self._cancel_queued()
            if self._state == _RUNNING:
                if self._s.threads[self.key] is threading.current_thread():
                    raise RuntimeError("a copy job cannot cancel itself from its worker thread")
                self._stop = True
                self._s.cond.wait_for(self.done)
            return self._state == _CANCELLED

    def add_done_callback(self, fn) -> None:
        """Call fn(job) once when the job finishes (on the worker thread), or now if the
        job's callbacks have all run. Callbacks run in the order they were added, also when
        one is added while the worker runs the others. Either way an exception fn raises is
        logged, not raised (as concurrent.futures does): whether the job had finished is a
        race the caller cannot see."""
        if not callable(fn):
            raise TypeError(f"CopyJob.add_done_callback: {fn!r} ({type(fn).__name__}) is not "
                            "callable; pass a function taking the job, e.g. lambda job: ...")
        with self._s.cond:
            if self._callbacks is not None:     # the worker has yet to run (all of) them
                self._callbacks.append(fn)
                return
        try:
            fn(self)
        except Exception:
            log.exception("copy job done callback %r failed", fn)

    def _run(self):
        """Copy chunk by chunk (on the worker thread, without the lock)."""
        off, n, err = 0, self.nbytes, None
        t0 = time.perf_counter()
        try:
            while off < n and not self._stop:
                c = min(self._chunk, n - off)
                copy(self._dst + off, self._src + off, c, persist=self._persist)
                off += c
        except BaseException as e:      # noqa: BLE001 -- goes to the job, never kills the worker
            err = e
        self.seconds = time.perf_counter() - t0
        with self._s.cond:
            self.copied, self.exception = off, err
            self._state = _DONE if off == n or err is not None else _CANCELLED
            self._s.cond.notify_all()


def _run_callbacks(job, cond):
    """Run job's done callbacks in order, with those added meanwhile, until none is left;
    then later ones run in the thread that adds them (a callback added while earlier ones
    were running came after them, so it must not run first)."""
    while True:
        with cond:
            callbacks = job._callbacks
            job._callbacks = [] if callbacks else None
        if not callbacks:
            return
        for fn in callbacks:
            try:
                fn(job)
            except Exception:
                log.exception("copy job done callback %r failed", fn)


# The CopyWorkers state and key of the worker running on this thread (its done callbacks run
# here): a wait for the worker itself from one of them would never end.
_worker_here = threading.local()


def _worker(shared, key):
    _worker_here.shared, _worker_here.key = shared, key
    q, cond = shared.queues[key], shared.cond
    while True:
        with cond:
            while not q and not shared.closed:
                cond.wait()
            if not q:
                return
            job = q.popleft()
            shared.running[key] = job
            run = job._state == _QUEUED
            if run:
                job._state = _RUNNING
        if run:
            job._run()
        _run_callbacks(job, cond)
        job._keepalive = None       # released outside the lock: its finalizers may take locks
        job = None                  # hold nothing while idle
        with cond:
            del shared.running[key]
            cond.notify_all()


class CopyWorkers:
    """One daemon worker thread per direction key copying submitted jobs in FIFO order.

    Threads start lazily at the first submit for a key. shutdown() stops and joins them; if the
    CopyWorkers is garbage collected instead, the workers finish the queued jobs and exit.
    """

    def __init__(self, chunk: int = DEFAULT_CHUNK):
        self.chunk = chunk
        self._s = _Shared()
        self._finalizer = weakref.finalize(self, _close, self._s, False)
        self._finalizer.atexit = False

    def submit(self, key, dst_addr, src_addr, nbytes: int, persist: bool = False,
               keepalive=None) -> CopyJob:
        """Queue a copy of nbytes from src_addr to dst_addr on key's worker; returns its CopyJob.

        keepalive stays referenced until the job ends (e.g. the buffers, so they stay mapped).
        """
        _check_key(key, "CopyWorkers.submit")
        persist = check_switch(persist, "CopyWorkers.submit: persist")
        chunk = _whole(self.chunk, "CopyWorkers.chunk (bytes per piece of a copy)", 1)
        dst, src, nbytes = _addr_int(dst_addr, "destination"), _addr_int(src_addr, "source"), \
            _size(nbytes)
        _check_apart(dst, src, nbytes)
        job = CopyJob(self._s, key, dst, src, nbytes, persist, keepalive, chunk)
        s = self._s
        if s.pid != os.getpid():
            raise RuntimeError(f"this CopyWorkers was made in process {s.pid}, and its worker "
                               "threads do not exist in this forked process; create a new "
                               "CopyWorkers here")
        with s.cond:
            if s.closed:
                raise RuntimeError("CopyWorkers.submit after shutdown(); create a new CopyWorkers "
                                   "to submit more copies")
            if key not in s.threads:
                s.queues[key] = collections.deque()
                t = threading.Thread(target=_worker, args=(s, key), daemon=True,
                                     name=f"cachedarrays-copy {key}")
                t.start()
                s.threads[key] = t
            s.queues[key].append(job)
            s.cond.notify_all()
        return job

    def pending(self, key=None) -> int:
        """Number of queued and running jobs (for key, or all keys)."""
        s = self._s
        if key is not None:
            _check_key(key, "CopyWorkers.pending")
        with s.cond:
            keys = s.queues if key is None else [key] if key in s.queues else []
            return sum(sum(j._state < _DONE for j in s.queues[k]) +
                       (k in s.running and s.running[k]._state < _DONE) for k in keys)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job finished and its callbacks ran; False if timeout ran out."""
        s, timeout = self._s, check_timeout(timeout)
        if getattr(_worker_here, "shared", None) is s:
            raise RuntimeError("CopyWorkers.drain() from one of its own done callbacks would "
                               "wait for that callback to return; drain after it returns, or "
                               "wait for the jobs you need with a done callback")
        with s.cond:
            return s.cond.wait_for(lambda: not s.running and not any(s.queues.values()), timeout)

    def shutdown(self, cancel: bool = True) -> None:
        """Stop the workers: cancel queued jobs (or run them if cancel is False), wait for the
        running ones and join the threads. Idempotent.

        From a done callback (on any CopyWorkers' worker) it waits only for the copies in
        flight, not for the threads: another worker may be in a callback waiting for this one.
        """
        cancel = check_switch(cancel, "CopyWorkers.shutdown: cancel")
        self._finalizer.detach()
        s = self._s
        _close(s, cancel)
        if getattr(_worker_here, "shared", None) is not None:
            with s.cond:
                s.cond.wait_for(lambda: all(j._state != _RUNNING for j in s.running.values()))
            return
        for t in list(s.threads.values()):
            t.join()

    @property
    def closed(self) -> bool:
        return self._s.closed
