"""Movement under hostile input: the copy engine, heaps, devices and timeouts refuse what they
cannot honour with an error naming the problem and the fix, and never round, parse or act on
another manager's memory."""

import mmap
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import copyengine as ce
from cachedarrays.errors import PinnedError
from cachedarrays.heap import Heap

T = 10.0
NOT_INTS = [1.5, 10.0, "10", True, None, [1]]


@pytest.fixture
def buffers():
    a = np.arange(64, dtype=np.uint8)
    b = np.zeros(64, np.uint8)
    return a, b


@pytest.fixture
def engine_settings():
    """Restore the copy engine's thread count (without calibrating) and non-temporal threshold."""
    chosen, threads, nt = ce._chosen, ce.lib.ca_copy_get_threads(), ce.get_nt_threshold()
    yield
    ce.lib.ca_copy_set_threads(threads)
    ce._chosen = chosen
    ce.set_nt_threshold(nt)


@pytest.mark.parametrize("bad", NOT_INTS)
def test_copy_sizes_and_counts_must_be_ints(buffers, bad, engine_settings):
    a, b = buffers
    src, dst = a.ctypes.data, b.ctypes.data
    calls = [lambda: ce.copy(dst, src, bad), lambda: ce.copy(dst, src, 8, threads=bad),
             lambda: ce.copy(bad, src, 8), lambda: ce.set_threads(bad),
             lambda: ce.set_nt_threshold(bad), lambda: ce.flush(dst, bad),
             lambda: ce.mbind(dst, 8, bad), lambda: ce.calibrate(bad)]
    for call in calls:
        if bad is None and call in (calls[1],):
            continue                               # threads=None: the default count
        with pytest.raises(TypeError, match="must be an int"):
            call()
    assert not b.any()                             # nothing was copied on the way


def test_copy_ranges_name_the_bound(buffers, engine_settings):
    a, b = buffers
    with pytest.raises(ValueError, match=r"threads .* must be >= 1, got 0"):
        ce.copy(b.ctypes.data, a.ctypes.data, 8, threads=0)
    with pytest.raises(ValueError, match=r"NUMA node must be in \[0, 2\*\*31\)"):
        ce.mbind(b.ctypes.data, 8, 1 << 40)
    with pytest.raises(ValueError, match="calibration repeats must be >= 1"):
        ce.calibrate(1 << 20, 0)
    ce.copy(b.ctypes.data, a.ctypes.data, 64, threads=1 << 40)   # clamped to the engine's 64
    assert (a == b).all()
    ce.set_threads(1 << 40)
    assert ce.get_threads() == 64


@pytest.mark.parametrize("bad", [0.5, 3.9, "8", True])
def test_copy_workers_refuse_fractional_sizes(buffers, bad):
    a, b = buffers
    w = ce.CopyWorkers()
    try:
        with pytest.raises(TypeError, match="nbytes must be an int"):
            w.submit("k", b.ctypes.data, a.ctypes.data, 10.5)
        w.chunk = bad
        with pytest.raises(TypeError, match="CopyWorkers.chunk"):
            w.submit("k", b.ctypes.data, a.ctypes.data, 10)
        w.chunk = 16
        job = w.submit("k", b.ctypes.data, a.ctypes.data, 64)
        for timeout in ("1", float("nan"), True):
            with pytest.raises((TypeError, ValueError), match="timeout"):
                job.wait(timeout)
        job.result(T)
        assert (a == b).all()
    finally:
        w.shutdown()


@pytest.mark.parametrize("kw", [dict(size=4096.0), dict(size="4096"), dict(size=True),
                                dict(granularity=256.0), dict(granularity="256")])
def test_heap_sizes_must_be_ints(kw):
    buf = mmap.mmap(-1, 1 << 16)
    args = {"size": 4096, "granularity": 0, **kw}
    with pytest.raises(TypeError, match="heap 'h': .* must be an int number of bytes"):
        Heap(buf, args["size"], args["granularity"], name="h")
    h = Heap(buf, 4096)
    with pytest.raises(ValueError, match="nbytes must be an int"):
        h.alloc(True, 1)
    h.close()


def test_a_device_of_another_manager_is_refused(make_manager):
    a, b = make_manager(fast="1MiB", slow="4MiB"), make_manager(fast="1MiB", slow="4MiB")
    xa = [ca.full(1000, float(i), manager=a) for i in range(4)]
    xb = [ca.full(1000, 10.0 + i, manager=b) for i in range(4)]
    ca.unsafe_free(xa[0])
    ca.unsafe_free(xb[0])
    calls = [lambda: a.defrag(b.fast), lambda: ca.evict(xa[1], to=b.slow),
             lambda: a.evictfrom(b.fast, None, 64, lambda r: False),
             lambda: a.allocate(b.slow, 64, xa[1]._obj)]
    for call in calls:
        with pytest.raises(ValueError, match="not one of this manager's devices"):
            call()
    assert [float(x[0]) for x in xa[1:]] == [1.0, 2.0, 3.0]
    assert [float(x[0]) for x in xb[1:]] == [11.0, 12.0, 13.0]
    ca.evict(xa[1], to=a.slow)                     # its own device object is fine
    assert xa[1].device == "slow"


def test_close_and_wait_copies_check_their_timeout(make_manager):
    m = make_manager(fast="4MiB", slow="16MiB")
    x = ca.full(100_000, 1.0, manager=m)
    ca.evict(x, wait=False)
    held, go = threading.Event(), threading.Event()

    def hold():
        with ca.writable(x) as v:
            held.set()
            go.wait(T)
            v[:] = 5.0

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(T)
        for bad in ("x", [1], True):
            with pytest.raises(TypeError, match="close timeout must be a number of seconds"):
                m.close(timeout=bad)
            with pytest.raises(TypeError, match="wait_copies timeout must be a number"):
                m.wait_copies(bad)
        with pytest.raises(ValueError, match="close timeout is NaN"):
            m.close(timeout=float("nan"))
        with pytest.raises(PinnedError):
            m.close(timeout=-1)                    # a negative timeout: no wait
        assert not m.closed
    finally:
        go.set()
        t.join(T)
    assert float(x[0]) == 5.0 and m.wait_copies(np.float64(T))


def test_a_file_size_limit_names_the_limit(tmp_path):
    code = textwrap.dedent(f"""
        import resource, cachedarrays as ca
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            ca.Manager(fast="1MiB", slow="4MiB", slow_path={str(tmp_path)!r})
        except ca.DeviceError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ulimit -f" in out.stdout and "smaller slow size" in out.stdout, out
    assert not list(tmp_path.iterdir())


def test_a_full_disk_stops_the_event_log_without_breaking_the_manager(caplog):
    m = ca.Manager(fast="1MiB", slow="4MiB", event_log="/dev/full")
    try:
        xs = []
        for i in range(600):                       # far more than the log's 64 KiB buffer
            x = ca.full(1000, float(i), manager=m)
            ca.evict(x)
            ca.prefetch(x)
            if i % 3:
                ca.unsafe_free(x)
            else:
                xs.append((x, float(i)))
        assert m.check()
        assert all(float(x[0]) == v for x, v in xs)
        assert m.telemetry.log_error is not None
        assert "event log '/dev/full' could not be written" in caplog.text
        m.count("mine", 8, thing=object())         # not JSON: written as its repr, never raised
    finally:
        m.close()
    assert m.closed and m.fast.closed and m.slow.closed


def test_an_event_log_that_cannot_be_opened_names_the_fix(tmp_path):
    with pytest.raises(IsADirectoryError, match="cannot open event_log .*or None for no log"):
        ca.Manager(fast="1MiB", slow="4MiB", event_log=str(tmp_path))


@pytest.mark.parametrize("why", ["policy", "policy_options", "name"])
def test_a_failed_construction_leaves_the_callers_devices_open(why):
    fast, slow = ca.DRAM("1MiB"), ca.SlowDevice("1MiB")
    kw = {"policy": dict(fast=fast, slow="4MiB", policy="bogus"),
          "policy_options": dict(fast=fast, slow="4MiB", policy_options={"nope": 1}),
          "name": dict(fast=slow, slow="4MiB")}[why]
    with pytest.raises((ValueError, TypeError)) as e:
        ca.Manager(**kw)
    if why == "name":
        assert "SlowDevice(size, name=" in str(e.value)
    assert not fast.closed and not slow.closed
    with ca.Manager(fast=fast, slow=slow) as m:    # the corrected retry
        assert float(ca.full(10, 2.0, manager=m).sum()) == 20.0
    assert fast.closed and slow.closed


def test_more_tiers_than_the_manager_counts_are_refused_before_any_is_made(tmp_path):
    tiers = [("dram", "1MiB")] + [(f"t{i}", "1MiB", str(tmp_path)) for i in range(4)]
    with pytest.raises(ValueError, match="tiers lists 5 tiers, but a manager has at most 4"):
        ca.Manager(tiers=tiers)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("call", [lambda x, v: ca.prefetch(x, wait=v),
                                  lambda x, v: ca.prefetch(x, force=v),
                                  lambda x, v: ca.evict(x, wait=v)])
@pytest.mark.parametrize("bad", ["no", "false", None, 0, [True]])
def test_movement_switches_take_only_true_or_false(m, call, bad):
    x = ca.full(1000, 1.0, manager=m)
    where = x.device
    with pytest.raises(TypeError, match=r"must be True or False"):
        call(x, bad)
    assert x.device == where
    call(x, np.bool_(False))                       # NumPy's booleans are booleans


@pytest.mark.parametrize("name,nbytes,error", [(5, 0, TypeError), ("", 0, TypeError),
                                               ("mine", "10", TypeError),
                                               ("mine", 1.5, TypeError), ("mine", True, TypeError),
                                               ("mine", -5, ValueError)])
def test_a_bad_event_is_refused_and_stats_stay_readable(m, name, nbytes, error):
    with pytest.raises(error, match="event"):
        m.count(name, nbytes)
    m.count("mine", np.int64(7))
    events = m.stats()["events"]
    assert events["mine"] == {"count": 1, "bytes": 7} and 5 not in events


@pytest.mark.parametrize("shift,n", [(1, 10), (-1, 10), (9, 10), (1, 2 << 20)])
def test_overlapping_copies_are_refused(shift, n):
    a = np.random.default_rng(0).integers(0, 256, n + 64, dtype=np.uint8)
    before = a.copy()
    base = a.ctypes.data + 8
    with pytest.raises(ValueError, match="the ranges overlap"):
        ce.copy(base + shift, base, n)
    w = ce.CopyWorkers(chunk=4)
    try:
        with pytest.raises(ValueError, match="the ranges overlap"):
            w.submit("k", base + shift, base, n)
    finally:
        w.shutdown()
    assert (a == before).all()
    ce.copy(base, base, n, threads=1)              # the same range: nothing to do


def test_a_failed_slow_device_leaves_the_callers_fast_device_open(tmp_path):
    fast = ca.DRAM("1MiB")
    with pytest.raises(ca.DeviceError):
        ca.Manager(fast=fast, slow="1MiB", slow_path=str(tmp_path / "missing" / "x"))
    with pytest.raises(ValueError, match="two tiers are named"):
        ca.Manager(tiers=[fast, ("pmem", "1MiB"), ("pmem", "1MiB")])
    assert not fast.closed
    with ca.Manager(fast=fast, slow="1MiB") as m:
        assert ca.full(4, 1.0, manager=m).device == "fast"
