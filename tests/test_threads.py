"""Concurrent use during eviction never tears an array (the prototype's Listing 6.1 failure)."""

import sys
import threading

import numpy as np
import pytest

import cachedarrays as ca
from helpers import assert_eq


@pytest.fixture(autouse=True)
def frequent_thread_switches():
    """Switch threads as often as possible so races show up within a short test."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def run_with_evictor(m, arrays, body):
    stop = threading.Event()
    errors = []

    def evictor():
        rng = np.random.default_rng(7)
        try:
            while not stop.is_set():
                x = arrays[int(rng.integers(len(arrays)))]
                if rng.random() < 0.5:
                    ca.evict(x)
                else:
                    ca.prefetch(x, force=True)
                if rng.random() < 0.2:
                    ca.zeros(6000, manager=m)          # memory pressure: forced evictions
                if rng.random() < 0.05:
                    m.defrag("fast")
        except Exception as e:   # pragma: no cover - reported by the assertion below
            errors.append(e)

    t = threading.Thread(target=evictor)
    t.start()
    try:
        body()
    finally:
        stop.set()
        t.join()
    assert not errors, errors


def test_writes_through_a_scope_are_never_torn_by_eviction():
    with ca.Manager(fast="128KiB", slow="4MiB", granularity=256) as m:
        x = ca.zeros(4000, manager=m)
        stop = threading.Event()
        errors = []

        def evictor():
            fillers = []
            try:
                while not stop.is_set():
                    ca.evict(x)
                    # occupy the space x left, so a stale pointer would write elsewhere
                    fillers.append(ca.full(4000, -1.0, manager=m))
                    del fillers[:-3]
            except Exception as e:   # pragma: no cover - reported below
                errors.append(e)

        t = threading.Thread(target=evictor)
        t.start()
        try:
            for k in range(1, 300):
                ca.prefetch(x, force=True)
                with ca.writable(x) as a:
                    for chunk in range(0, 4000, 100):   # a slow, piecewise write
                        a[chunk:chunk + 100] = k
                with ca.readable(x) as a:
                    assert (a == k).all(), f"torn array at step {k}: {np.unique(a)}"
        finally:
            stop.set()
            t.join()
        assert not errors, errors
        m.check()


def test_in_place_updates_are_not_lost_during_eviction():
    with ca.Manager(fast="128KiB", slow="4MiB", granularity=256) as m:
        xs = [ca.zeros(1500, manager=m) for _ in range(6)]

        def body():
            for _ in range(200):
                for x in xs:
                    x += 1

        run_with_evictor(m, xs, body)
        for x in xs:
            assert_eq(x, np.full(1500, 200.0), exact=True)     # and checks the heaps


def test_concurrent_kernels_from_several_threads():
    with ca.Manager(fast="256KiB", slow="8MiB", granularity=256) as m:
        results = {}

        def worker(i):
            a = ca.full(3000, float(i), manager=m)
            for _ in range(50):
                a = a + 1
                ca.evict(a)
            results[i] = float(a.sum())

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert results == {i: 3000.0 * (i + 50) for i in range(4)}
        m.check()


# ---- background copies (prefetch/evict with wait=False) ------------------------------------------

def run_with_background_mover(m, arrays, body, threads=2):
    """body() runs while `threads` threads issue background prefetches, evictions and cancels
    of the arrays (and allocate under pressure)."""
    stop = threading.Event()
    errors = []

    def mover(seed):
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                x = arrays[int(rng.integers(len(arrays)))]
                r = rng.random()
                if r < 0.4:
                    ca.evict(x, wait=False)
                elif r < 0.8:
                    ca.prefetch(x, force=bool(rng.random() < 0.5), wait=False)
                elif r < 0.9:
                    m.cancel(x.object)
                else:
                    ca.zeros(6000, manager=m)          # memory pressure: forced evictions
                if rng.random() < 0.02:
                    m.defrag("fast")
        except Exception as e:   # pragma: no cover - reported by the assertion below
            errors.append(e)

    ts = [threading.Thread(target=mover, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    try:
        body()
    finally:
        stop.set()
        for t in ts:
            t.join()
    assert not errors, errors
    assert m.wait_copies(10)


def test_background_moves_never_tear_a_piecewise_write():
    with ca.Manager(fast="128KiB", slow="4MiB", granularity=256) as m:
        x = ca.zeros(4000, manager=m)

        def body():
            for k in range(1, 150):
                with ca.writable(x) as a:
                    for chunk in range(0, 4000, 100):   # a slow, piecewise write
                        a[chunk:chunk + 100] = k
                with ca.readable(x) as a:
                    assert (a == k).all(), f"torn array at step {k}: {np.unique(a)}"

        run_with_background_mover(m, [x], body)
        m.check()


def test_kernels_on_many_threads_with_background_moves():
    with ca.Manager(fast="192KiB", slow="8MiB", granularity=256) as m:
        xs = [ca.full(2000, float(i), manager=m) for i in range(8)]
        results, errors = {}, []

        def worker(i):
            try:
                x = xs[i]
                for _ in range(60):
                    x += 1                                  # in place: read and write
                    with ca.readable(x) as a:
                        if not (a == a[0]).all():           # every element moved together
                            raise AssertionError(f"torn array {i}: {np.unique(a)}")
                results[i] = float(x[0])
            except Exception as e:   # pragma: no cover - reported below
                errors.append(e)

        def body():
            ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        run_with_background_mover(m, xs, body)
        assert not errors, errors
        assert results == {i: i + 60.0 for i in range(len(xs))}
        for i, x in enumerate(xs):
            assert_eq(x, np.full(2000, i + 60.0), exact=True)
        stats = m.stats()
        assert stats["events"]["copy_async"]["count"] > 0


def test_routines_and_functions_read_whole_arrays_during_eviction():
    """np.where, concatenate, sort, cumsum and a general function (np.dot) pin their inputs
    in C: an evictor moving and defragmenting the arrays meanwhile never shows them torn."""
    with ca.Manager(fast="256KiB", slow="8MiB", granularity=256) as m:
        base = np.arange(3000.0)
        x, y = ca.asarray(base, manager=m), ca.asarray(-base, manager=m)
        c = ca.asarray(base % 3 == 0, manager=m)

        def body():
            for _ in range(40):
                np.testing.assert_array_equal(np.asarray(np.where(c, x, y)),
                                              np.where(base % 3 == 0, base, -base))
                np.testing.assert_array_equal(np.asarray(np.concatenate([x, y])),
                                              np.concatenate([base, -base]))
                np.testing.assert_array_equal(np.asarray(np.sort(y)), np.sort(-base))
                assert float(np.asarray(np.cumsum(x))[-1]) == base.sum()
                assert float(np.dot(x, y)) == -float(base @ base)
        run_with_evictor(m, [x, y, c], body)
        m.check()
