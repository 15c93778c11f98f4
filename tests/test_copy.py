"""Copy engine: correctness at every alignment, streaming and threaded paths, persist, concurrency."""
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachedarrays import copyengine as ce
from cachedarrays._native import ffi
from helpers import run_threads

MiB = 1 << 20
GUARD = 0xEE


def addr(a):
    return a.ctypes.data


@pytest.fixture
def nt_threshold():
    """Restore the non-temporal threshold after a test changes it."""
    old = ce.get_nt_threshold()
    yield
    ce.set_nt_threshold(old)


def aligned(n, rng=None):
    """A 64-byte aligned uint8 array of n bytes (random if rng given)."""
    raw = np.empty(n + 64, dtype=np.uint8)
    a = raw[(-raw.ctypes.data) % 64:][:n]
    if rng is not None:
        a[:] = rng.integers(0, 256, n, dtype=np.uint8)
    return a


def sweep(sizes, offsets):
    rng = np.random.default_rng(7)
    src = aligned(512, rng)
    dst = aligned(512)
    for n in sizes:
        for so, do in offsets:
            dst[:] = GUARD
            ce.copy(addr(dst) + do, addr(src) + so, n)
            assert np.array_equal(dst[do:do + n], src[so:so + n]), (n, so, do)
            assert (dst[:do] == GUARD).all() and (dst[do + n:] == GUARD).all(), (n, so, do)


ALL_OFFSETS = [(s, d) for s in range(64) for d in range(64)]
SOME_OFFSETS = [(0, 0), (1, 0), (0, 1), (63, 1), (17, 45), (32, 32), (5, 63)]


def test_small_sizes_every_alignment_plain():
    sweep([0, 1, 7, 63, 64, 65, 255, 256, 257, 300], ALL_OFFSETS)
    sweep(range(0, 301), SOME_OFFSETS)


def supported_isas():
    out = []
    best = ce.isa()
    for name in ("avx512", "avx2", "sse2"):
        try:
            ce.set_isa(name)
        except ValueError:
            continue
        out.append(name)
    ce.set_isa(best)
    return out


@pytest.fixture(params=["avx512", "avx2", "sse2"])
def isa(request):
    """Run with each streaming-store ISA this CPU has, restoring the best one after."""
    best = ce.isa()
    if request.param not in supported_isas():
        pytest.skip(f"CPU lacks {request.param}")
    ce.set_isa(request.param)
    yield request.param
    ce.set_isa(best)


def test_small_sizes_every_alignment_streaming(nt_threshold, isa):
    ce.set_nt_threshold(1)                       # force the non-temporal path on tiny copies
    assert ce.get_nt_threshold() == 1 and ce.isa() == isa
    sweep([0, 1, 63, 64, 65, 255, 256, 257, 300, 383], ALL_OFFSETS)
    sweep(range(0, 301), SOME_OFFSETS)


def test_streaming_bodies_of_many_pages_every_isa(nt_threshold, isa):
    ce.set_nt_threshold(1)
    rng = np.random.default_rng(5)
    for n in (16384, 16384 * 3 + 4096 + 200, 1 << 20):
        src = aligned(n + 64, rng)
        dst = aligned(n + 64)
        for so, do in [(0, 0), (1, 63), (40, 24)]:
            dst[:] = GUARD
            ce.copy(addr(dst) + do, addr(src) + so, n, threads=1)
            assert np.array_equal(dst[do:do + n], src[so:so + n]), (n, so, do)
            assert (dst[:do] == GUARD).all() and (dst[do + n:] == GUARD).all()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("nt", [0, 4 * MiB, 1])
def test_large_copies_threads_and_streaming(threads, nt, nt_threshold):
    ce.set_nt_threshold(nt)
    rng = np.random.default_rng(threads)
    n = 9 * MiB + 13
    src = aligned(n + 128, rng)
    dst = aligned(n + 128)
    for so, do in [(0, 0), (3, 17), (63, 1)]:
        dst[:] = GUARD
        ce.copy(addr(dst) + do, addr(src) + so, n, threads=threads)
        assert np.array_equal(dst[do:do + n], src[so:so + n])
        assert (dst[:do] == GUARD).all() and (dst[do + n:] == GUARD).all()


def test_persist_flag_and_flush():
    rng = np.random.default_rng(3)
    for n in (1, 100, 5 * MiB + 3):
        src = aligned(n + 64, rng)
        dst = aligned(n + 64)
        ce.copy(addr(dst) + 5, addr(src) + 1, n, persist=True)
        assert np.array_equal(dst[5:5 + n], src[1:1 + n])
        ce.copy(addr(dst) + 5, addr(src) + 1, n, threads=2, persist=True)
        assert np.array_equal(dst[5:5 + n], src[1:1 + n])
    ce.flush(addr(dst) + 3, 1000)
    ce.flush(addr(dst), 0)


def test_accepts_cffi_pointers_and_mmaps():
    src = mmap.mmap(-1, 2 * MiB)
    dst = mmap.mmap(-1, 2 * MiB)
    src[:] = os.urandom(2 * MiB)
    with ffi.from_buffer(src) as s, ffi.from_buffer(dst) as d:
        ce.copy(d, s, 2 * MiB, threads=2)
    assert dst[:] == src[:]


def test_concurrent_copies_from_four_python_threads():
    rng = np.random.default_rng(11)
    n = 6 * MiB + 7
    pairs = [(aligned(n, rng), aligned(n)) for _ in range(4)]
    errors = []

    def work(k):
        src, dst = pairs[k]
        try:
            for i in range(12):
                dst[:1024] = 0
                ce.copy(addr(dst), addr(src), n, threads=1 + (i + k) % 3)
                if not np.array_equal(dst, src):
                    errors.append((k, i))
        except Exception as e:  # surfaced below
            errors.append(e)

    run_threads(work)
    assert errors == []


def test_thread_and_threshold_settings():
    old = ce.get_threads()
    try:
        ce.set_threads(3)
        assert ce.get_threads() == 3
        with pytest.raises(ValueError):
            ce.set_threads(0)
    finally:
        ce.set_threads(old)
    assert ce.isa() in ("avx512", "avx2", "sse2")
    with pytest.raises(ValueError, match="not supported"):
        ce.set_isa("neon")
    with pytest.raises(ValueError):
        ce.copy(0, 0, -1)
    with pytest.raises(ValueError):
        ce.copy(1, 1, 10, threads=0)
    with pytest.raises(ValueError):
        ce.set_nt_threshold(-5)
    ce.copy(0, 0, 0)                              # zero bytes never touch memory


@given(big=st.integers(min_value=1 << 64, max_value=1 << 200))
@settings(max_examples=25, deadline=None)
def test_a_count_too_large_is_refused_naming_the_upper_bound(big):
    # "must be >= 1, got 2**64" would contradict itself: the message names the range
    buf = np.zeros(64, np.uint8)
    workers = ce.CopyWorkers(chunk=big)
    calls = [lambda: ce.set_threads(big), lambda: ce.copy(addr(buf), addr(buf) + 32, 8, big),
             lambda: ce.calibrate(big), lambda: ce.calibrate(1 << 20, big),
             lambda: workers.submit("a", addr(buf), addr(buf) + 32, 8)]
    try:
        for call in calls:
            with pytest.raises(ValueError, match=r"in \[1, 2\*\*64\), got " + str(big)):
                call()
    finally:
        workers.shutdown()


def test_calibration_sets_the_thread_count_that_later_copies_keep(monkeypatch):
    old = ce.get_threads()
    try:
        n = ce.calibrate(nbytes=4 * MiB, repeats=1)
        assert n in (1, 2) and ce.get_threads() == n
        rng = np.random.default_rng(13)
        src, dst = aligned(3 * MiB, rng), aligned(3 * MiB)
        ce.copy(addr(dst), addr(src), 3 * MiB)     # a default copy: n threads, no recalibration
        assert np.array_equal(dst, src) and ce.get_threads() == n
        ce.set_threads(3)                          # an explicit count wins over calibration
        dst[:] = 0
        ce.copy(addr(dst), addr(src), 3 * MiB)
        assert np.array_equal(dst, src) and ce.get_threads() == 3
        monkeypatch.setattr(ce, "_cpus", lambda: 1)
        assert ce.calibrate() == 1 and ce.get_threads() == 1   # one CPU: always one thread
    finally:
        ce.set_threads(old)


def test_environment_overrides_the_thread_count():
    code = "from cachedarrays import copyengine as ce; print(ce.get_threads())"
    env = dict(os.environ, CACHEDARRAYS_COPY_THREADS="5")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "5"


def test_default_copy_calibrates_once_in_a_fresh_process():
    code = ("import numpy as np; from cachedarrays import copyengine as ce; "
            "a = np.ones(2 << 20, np.uint8); b = np.zeros_like(a); "
            "ce.copy(b.ctypes.data, a.ctypes.data, a.nbytes); assert (a == b).all(); "
            "print(ce.get_threads())")
    env = {k: v for k, v in os.environ.items() if k != "CACHEDARRAYS_COPY_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert int(out.stdout.strip()) in (1, 2)


def test_mbind():
    m = mmap.mmap(-1, 4 * MiB)
    with ffi.from_buffer(m) as p:
        a = int(ffi.cast("uintptr_t", p))
        with pytest.raises(OSError, match="NUMA node 5000"):
            ce.mbind(a, 4 * MiB, 5000)
        try:
            ce.mbind(a + 100, 1 * MiB, 0)
        except OSError as e:                      # some sandboxes forbid mbind
            if e.errno not in (1, 38):            # EPERM, ENOSYS
                raise
    m[:10] = b"0123456789"
    assert m[:10] == b"0123456789"
