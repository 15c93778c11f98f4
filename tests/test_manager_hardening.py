"""The manager and its devices under misuse: forked processes, unbalanced releases, shared or
closed devices, failed constructions, debug mode with background copies, interpreter exit."""

import errno
import gc
import logging
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import copyengine, devices
from cachedarrays.errors import CachedArraysError, DeviceError, UseAfterFreeError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_script(code, timeout=60):
    """Run code in a fresh interpreter (small default manager); (returncode, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CACHEDARRAYS_FAST": "1MiB",
           "CACHEDARRAYS_SLOW": "8MiB", "OMP_WAIT_POLICY": "PASSIVE"}
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=str(ROOT))
    return p.returncode, p.stdout, p.stderr


def in_child(fn, limit=30):
    """Run fn() in a forked child; its exit code (0: fn returned, 1: it raised, 2: it hung)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(limit)
            fn()
            code = 0
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 2


def refused_as_forked(fn):
    with pytest.raises(UseAfterFreeError, match="fork") as e:
        fn()
    assert "create a new Manager" in str(e.value) and "spawn" in str(e.value)


# ---- forked processes ------------------------------------------------------------------------

def test_a_forked_child_refuses_the_parents_manager_and_leaves_its_slow_memory_alone():
    m = ca.Manager(fast="1MiB", slow="16MiB")
    try:
        keep = [ca.asarray(np.full(10000, float(i)), manager=m, placement="slow")
                for i in range(4)]
        spare = ca.SlowDevice("1MiB")             # no manager's yet, but mapped shared

        def child():
            with pytest.raises(DeviceError, match="fork"):
                ca.Manager(fast="1MiB", slow=spare)
            refused_as_forked(lambda: ca.unsafe_free(keep[1]))
            refused_as_forked(lambda: keep[2].__setitem__(slice(None), -1.0))
            refused_as_forked(lambda: float(keep[3].sum()))
            refused_as_forked(lambda: ca.asarray(np.ones(10), manager=m, placement="slow"))
            refused_as_forked(lambda: ca.evict(keep[0]))
            refused_as_forked(m.check)
            m.close()                             # nothing to release in the child
            del keep[:]
            gc.collect()
            mine = ca.default_manager()           # a new one, made in the child
            assert mine is not m and float(ca.asarray(np.ones(5), manager=mine).sum()) == 5

        assert in_child(child) == 0
        assert m.check()
        for i, a in enumerate(keep):
            assert np.array_equal(np.asarray(a), np.full(10000, float(i)))
        ca.unsafe_free(keep[0])
        big = ca.asarray(np.full(19000, 7.0), manager=m, placement="slow")
        for i, a in enumerate(keep[1:], 1):       # the new block overlaps none of them
            assert np.array_equal(np.asarray(a), np.full(10000, float(i)))
        assert np.array_equal(np.asarray(big), np.full(19000, 7.0))
        assert m.check()
    finally:
        m.close()
        spare.close()


def test_a_forked_child_that_exits_normally_keeps_the_parents_files_and_log(tmp_path):
    code = f"""
        import gc, json, os, sys
        import numpy as np, cachedarrays as ca
        path, log = {str(tmp_path / "slow.heap")!r}, {str(tmp_path / "events.jsonl")!r}
        m = ca.Manager(fast="1MiB", slow="4MiB", slow_path=path, event_log=log)
        x = ca.asarray(np.arange(1000.0), manager=m, placement="slow")
        d = ca.zeros(100)                         # the default manager
        pid = os.fork()
        if pid == 0:                              # finalizers, __del__ and atexit run here
            m.close()
            del x, d, m
            gc.collect()
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert os.path.exists(path), "the child removed the parent's slow file"
        assert m.check() and np.array_equal(np.asarray(x), np.arange(1000.0))
        m.close()
        events = [json.loads(line) for line in open(log)]
        assert sum(e["event"] == "alloc" for e in events) == 1, events
        print("ok")
    """
    rc, out, err = run_script(code)
    assert rc == 0 and out.strip() == "ok", err


def test_a_fork_while_threads_write_the_event_log_leaves_a_child_that_exits(tmp_path):
    """A fork waits for the event log's writers: a child never inherits the log's file in the
    middle of a write (closing it then waited forever), and writes none of the parent's events."""
    code = f"""
        import json, os, sys, threading, time
        import cachedarrays as ca
        log = {str(tmp_path / "events.jsonl")!r}
        m = ca.Manager(fast="1MiB", slow="4MiB", event_log=log)
        stop = []

        def write():
            while not stop:
                m.telemetry.count("spin", nbytes=1, pad="x" * 3000)
        threads = [threading.Thread(target=write) for _ in range(2)]
        for t in threads:
            t.start()
        hung = 0
        for _ in range(30):
            pid = os.fork()
            if pid == 0:
                sys.exit(0)                       # flushes what the child holds at exit
            start = time.monotonic()
            while not os.waitpid(pid, os.WNOHANG)[0]:
                if time.monotonic() - start > 20:
                    hung += 1
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
            if hung:
                break
        stop.append(1)
        for t in threads:
            t.join()
        spins = m.telemetry.events["spin"]
        m.close()
        lines = [json.loads(line) for line in open(log)]
        assert hung == 0, "a forked child hung"
        assert sum(e["event"] == "spin" for e in lines) == spins, (len(lines), spins)
        print("ok")
    """
    rc, out, err = run_script(code, timeout=300)
    assert rc == 0 and out.strip() == "ok", err


def _sum_of_inherited(i):
    return float(_INHERITED[i].sum())


def _sum_of_received(a):
    return float((a * 2.0).sum()), a.manager is ca.default_manager()


_INHERITED = []


def test_fork_pool_workers_cannot_use_inherited_arrays_but_can_use_received_ones(monkeypatch):
    monkeypatch.setenv("CACHEDARRAYS_FAST", "1MiB")
    monkeypatch.setenv("CACHEDARRAYS_SLOW", "8MiB")
    m = ca.Manager(fast="256KiB", slow="16MiB")
    try:
        arrs = [ca.asarray(np.full(20000, float(i)), manager=m) for i in range(8)]
        _INHERITED[:] = arrs
        before = [a.device for a in arrs]
        with multiprocessing.get_context("fork").Pool(2) as pool:
            with pytest.raises(UseAfterFreeError, match="fork"):
                pool.map(_sum_of_inherited, range(8))
            got = pool.map(_sum_of_received, arrs)
        assert got == [(40000.0 * i, True) for i in range(8)]
        assert [a.device for a in arrs] == before
        assert all(np.array_equal(np.asarray(a), np.full(20000, float(i)))
                   for i, a in enumerate(arrs))
        assert m.check()
    finally:
        _INHERITED.clear()
        m.close()


def test_background_copies_in_a_forked_child_run_on_its_own_workers():
    m = ca.Manager(fast="64MiB", slow="256MiB")
    try:
        x = ca.asarray(np.arange(1_000_000.0), manager=m)
        ca.evict(x, wait=False)
        m.wait_copies()                           # the parent's copy worker threads exist now

        def child():
            refused_as_forked(lambda: ca.evict(x, wait=False))
            with ca.Manager(fast="64MiB", slow="256MiB") as mine:
                y = ca.asarray(np.arange(1_000_000.0), manager=mine)
                ca.evict(y, wait=False)
                assert float(y.sum()) == float(np.arange(1_000_000.0).sum())
                assert mine.wait_copies(timeout=20)

        assert in_child(child) == 0
        assert np.array_equal(np.asarray(x), np.arange(1_000_000.0)) and m.check()
    finally:
        m.close()


def test_locks_held_by_other_threads_at_a_fork_do_not_hang_the_child():
    m = ca.Manager(fast="1MiB", slow="4MiB")
    holding, done = threading.Event(), threading.Event()

    def hold():                                   # each lock, held by a thread across the fork
        with m.atomic(), ca.defaults._default_lock, copyengine._engine_lock:
            holding.set()
            done.wait()

    t = threading.Thread(target=hold)
    t.start()
    holding.wait()
    try:
        def child():
            refused_as_forked(m.check)
            assert ca.default_manager() is not m
            copyengine.calibrate(1 << 20, 1)

        assert in_child(child, limit=10) == 0
    finally:
        done.set()
        t.join()
        m.close()


def test_copy_workers_made_before_a_fork_refuse_in_the_child():
    workers = copyengine.CopyWorkers()
    src, dst = np.arange(1000.0), np.zeros(1000)
    workers.submit("k", dst.ctypes.data, src.ctypes.data, src.nbytes).wait()

    def child():
        with pytest.raises(RuntimeError, match="fork"):
            workers.submit("k", dst.ctypes.data, src.ctypes.data, src.nbytes)

    try:
        assert in_child(child) == 0
    finally:
        workers.shutdown()


# ---- pins ------------------------------------------------------------------------------------

def test_release_without_acquire_is_refused_and_changes_nothing():
    with ca.Manager(fast="1MiB", slow="8MiB") as m:
        x = ca.asarray(np.arange(1000.0), manager=m)
        y = ca.asarray(np.arange(1000.0), manager=m)
        m.acquire((y._obj,))
        with pytest.raises(CachedArraysError, match="not pinned"):
            m.release((x._obj,))
        with pytest.raises(CachedArraysError, match="not pinned"):
            m.release((y._obj, x._obj))
        assert m.pin_count(x._obj) == 0 and m.pin_count(y._obj) == 1
        m.release((y._obj,))
        with ca.writable(x) as w:                 # the scope's pin holds: nothing moves x
            ca.evict(x)
            assert x.device == "fast"
            w[:] = -1.0
        assert np.array_equal(np.asarray(x), np.full(1000, -1.0))


# ---- construction ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [True, False, 1, 0, 2.5, b"events.jsonl"])
def test_event_log_takes_only_a_path(bad):
    with pytest.raises(TypeError, match="event_log"):
        ca.Manager(fast="1MiB", slow="4MiB", event_log=bad)
    os.fstat(1)                                   # stdout is still open


def test_event_log_takes_a_pathlike(tmp_path):
    with ca.Manager(fast="1MiB", slow="4MiB", event_log=tmp_path / "ev.jsonl") as m:
        ca.asarray(np.ones(10), manager=m)
    assert (tmp_path / "ev.jsonl").read_text().count('"alloc"') >= 1


@pytest.mark.parametrize("why", ["event log in a missing directory", "slow size of 100 B"])
def test_a_failed_construction_releases_the_devices_at_once(tmp_path, why):
    path = tmp_path / "slow.heap"
    kw = (dict(slow="4MiB", event_log=str(tmp_path / "missing" / "ev.jsonl"))
          if why.startswith("event") else dict(slow=100))
    with pytest.raises((OSError, ValueError)) as e:
        ca.Manager(fast="1MiB", slow_path=str(path), **kw)
    assert e.value is not None                   # the exception (and its frames) still live
    assert not path.exists()
    ca.Manager(fast="1MiB", slow="4MiB", slow_path=str(path)).close()   # the corrected retry


@pytest.mark.parametrize("which", ["fast", "slow"])
def test_a_device_too_small_for_a_heap_is_named(which):
    sizes = {"fast": "1MiB", "slow": "1MiB", which: 100}
    with pytest.raises(ValueError, match=f"device '{which}' \\(100 B\\)"):
        ca.Manager(**sizes)


def test_a_device_serves_one_manager_and_a_closed_one_none():
    dev = ca.SlowDevice("4MiB")
    m1 = ca.Manager(fast="1MiB", slow=dev)
    try:
        with pytest.raises(DeviceError, match="belongs to another manager"):
            ca.Manager(fast="1MiB", slow=dev)
        with pytest.raises(DeviceError, match="belongs to another manager"):
            ca.Manager(tiers=[("dram", "1MiB"), dev])
        a = ca.asarray(np.ones(1000), manager=m1, placement="slow")   # m1 still has it
        assert m1.check() and float(a.sum()) == 1000.0
    finally:
        m1.close()
    with pytest.raises(DeviceError, match="closed"):
        ca.Manager(fast="1MiB", slow=dev)


# ---- debug mode ------------------------------------------------------------------------------

def test_debug_mode_poisons_a_background_evictions_source_only_after_the_copy(monkeypatch):
    go = threading.Event()
    plain = copyengine.copy

    def held_copy(*args, **kwargs):               # background copies wait for the test
        if threading.current_thread().name.startswith("cachedarrays-copy"):
            assert go.wait(20)
        return plain(*args, **kwargs)

    monkeypatch.setattr(copyengine, "copy", held_copy)
    with ca.Manager(fast="8MiB", slow="32MiB", debug=True) as m:
        x = ca.asarray(np.arange(200_000.0), manager=m)
        ca.evict(x, wait=False)                   # the fast region is freed, still being read
        go.set()
        m.wait_copies()
        assert x.device == "slow"
        assert np.array_equal(np.asarray(x), np.arange(200_000.0))
        y = ca.asarray(np.ones(200_000), manager=m)   # reuses the fast block: no stale writes
        assert float(y.sum()) == 200_000.0
        assert m.check() and m.stats()["events"]["debug_stale_writes"]["count"] == 0


# ---- interpreter exit ------------------------------------------------------------------------

def test_exit_does_not_wait_for_a_daemon_threads_scope():
    code = """
        import threading, time
        import cachedarrays as ca
        x = ca.zeros(100)
        held = threading.Event()
        def hold():
            with ca.readable(x):
                held.set()
                time.sleep(100)
        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        print("done")
    """
    t0 = time.monotonic()
    rc, out, err = run_script(code)
    assert rc == 0 and out.strip() == "done"
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert time.monotonic() - t0 < 8


# ---- slow device files -----------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="no O_TMPFILE on this system")
def test_a_private_slow_file_never_has_a_name(tmp_path, monkeypatch):
    try:
        os.close(os.open(tmp_path, os.O_TMPFILE | os.O_RDWR, 0o600))
    except OSError as e:
        pytest.skip(f"the file system of {tmp_path} has no O_TMPFILE ({e.strerror})")
    named = []
    plain = tempfile.mkstemp
    monkeypatch.setattr(tempfile, "mkstemp", lambda *a, **k: named.append(1) or plain(*a, **k))
    with ca.Manager(fast="1MiB", slow="4MiB", slow_path=str(tmp_path)) as m:
        ca.asarray(np.ones(100), manager=m, placement="slow")
        assert list(tmp_path.iterdir()) == []
    assert named == []                            # never a name a kill could leave behind


def test_a_private_slow_file_falls_back_to_a_removed_name(tmp_path, monkeypatch):
    plain = os.open

    def no_tmpfile(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_TMPFILE", 0) == getattr(os, "O_TMPFILE", -1):
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return plain(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_tmpfile)
    dev = devices.SlowDevice("1MiB", path=str(tmp_path))
    try:
        assert list(tmp_path.iterdir()) == []
        assert os.path.dirname(dev.path) == str(tmp_path)
    finally:
        dev.close()


def test_not_dax_is_reported_once_per_directory(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="cachedarrays.devices")
    size = len(devices._reported_not_dax)
    for _ in range(4):
        ca.Manager(fast="1MiB", slow="1MiB", slow_path=str(tmp_path)).close()
    said = [r for r in caplog.records if "not DAX" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path) in said[0].getMessage()
    assert len(devices._reported_not_dax) <= size + 1


# ---- messages --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, says", [
    (dict(slow_path=""), DeviceError, "slow_path is empty"),
    (dict(slow_path=3), TypeError, "slow_path must be a path"),
    (dict(numa_node="0"), TypeError, "numa_node must be an int"),
    (dict(granularity="256"), TypeError, "granularity must be an int"),
    (dict(policy_options="x"), TypeError, "policy_options must be a dict"),
])
def test_bad_arguments_are_named(kwargs, error, says):
    with pytest.raises(error, match=says):
        ca.Manager(fast="1MiB", slow="1MiB", **kwargs)


def test_a_bytes_slow_path_is_a_path(tmp_path):
    path = tmp_path / "slow.heap"
    with ca.Manager(fast="1MiB", slow="1MiB", slow_path=os.fsencode(path)) as m:
        assert m.slow.path == str(path) and path.exists()
    assert not path.exists()


@pytest.mark.parametrize("make", [lambda m: ca.empty(2**62, manager=m),
                                  lambda m: ca.zeros((10**10, 10**10), manager=m),
                                  lambda m: ca.full(2**61, 1.0, manager=m)])
def test_an_array_larger_than_any_device_is_refused_with_its_size(make):
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        with pytest.raises(ca.OutOfMemoryError, match="more than any device can hold"):
            make(m)
        assert m.objects() == []


def test_manager_argument_must_be_a_manager():
    with pytest.raises(TypeError, match="manager must be a ca.Manager"):
        ca.zeros(3, manager="m")


def test_close_without_a_time_limit_takes_inf():
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        x = ca.asarray(np.ones(10), manager=m)
        held = threading.Event()

        def hold():
            with ca.readable(x):
                held.set()
                time.sleep(0.3)

        t = threading.Thread(target=hold)
        t.start()
        held.wait()
        m.close(timeout=float("inf"))
        t.join()
        assert m.closed
