"""Manager.close(): never releases memory in use, and every later use raises a clear error."""

import pickle
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.errors import PinnedError, UseAfterFreeError

CLOSED = "this manager is closed"


@pytest.fixture
def m():
    mgr = ca.Manager(fast="1MiB", slow="16MiB")
    yield mgr
    mgr.close()


def _run(script, timeout=120):
    """Run a Python script in a child process (a crash there must not take the tests down)."""
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=timeout)


# ---- close while something is in use ------------------------------------------------------

SCOPES = {
    "readable": lambda x: ca.readable(x),
    "writable": lambda x: ca.writable(x),
    "access": lambda x: ca.access((x,), ()),
}


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_close_inside_a_scope_raises_naming_the_object_and_the_scope_still_works(m, scope):
    x = ca.asarray(np.arange(1000.0).reshape(10, 100), manager=m)
    with SCOPES[scope](x) as v:
        a = v[0] if scope == "access" else v
        # the calling thread holds the pin: close() refuses at once instead of waiting for itself
        with pytest.raises(PinnedError, match="calling thread") as e:
            m.close(timeout=5)
        msg = str(e.value)
        assert f"object {x.object.id} " in msg and "7.8 KiB" in msg and "(10, 100)" in msg
        assert not m.closed
        assert a.sum() == 499500.0                # the view still reads the array's memory
    assert (x + 1).sum() == 500500.0              # the manager stays open and usable
    m.close()
    assert m.closed
    with pytest.raises(UseAfterFreeError, match=CLOSED):
        x.sum()


def test_close_inside_a_pin_raises_and_after_unpin_closes(m):
    x = ca.zeros(100, manager=m)
    m.pin(x.object)
    with pytest.raises(PinnedError, match=f"object {x.object.id} "):
        m.close(timeout=5)
    m.unpin(x.object)
    m.close()
    assert m.closed


def test_close_waits_for_a_scope_on_another_thread(m):
    x = ca.asarray(np.arange(1000.0), manager=m)
    entered, order, seen = threading.Event(), [], []

    def reader():
        with ca.readable(x) as a:
            entered.set()
            while not m._closing:                 # hold the scope until close() is waiting
                threading.Event().wait(0.001)
            seen.append(float(a.sum()))
            order.append("scope ended")

    t = threading.Thread(target=reader)
    t.start()
    entered.wait()
    m.close(timeout=None)
    order.append("closed")
    t.join()
    assert order == ["scope ended", "closed"]
    assert seen == [499500.0]


def test_close_that_times_out_names_the_objects_and_leaves_the_manager_open(m):
    x = ca.asarray(np.arange(1000.0).reshape(10, 100), manager=m)
    entered, leave = threading.Event(), threading.Event()

    def writer():
        with ca.writable(x) as a:
            entered.set()
            leave.wait()
            a[0, 0] = 7.0

    t = threading.Thread(target=writer)
    t.start()
    entered.wait()
    try:
        with pytest.raises(PinnedError, match="other threads") as e:
            m.close(timeout=0.05)
        assert f"object {x.object.id} " in str(e.value) and "(10, 100)" in str(e.value)
        assert not m.closed
    finally:
        leave.set()
        t.join()
    assert float(x[0, 0]) == 7.0                  # the scope's write landed and is kept
    m.close()
    assert m.closed


def test_close_while_threads_loop_numpy_calls_never_crashes():
    # Several rounds, each closing the manager while four threads run NumPy on its arrays.
    # Before close() waited for pins, a round unmapped memory under a running kernel (SIGSEGV).
    r = _run("""
        import threading
        import numpy as np
        import cachedarrays as ca

        def loop(x, y, started, errors):
            try:
                n = 0
                while True:
                    np.sort(x)
                    x + 1.0
                    y.sum()
                    x[1:5] = 0
                    with ca.readable(y) as a:
                        a.max()
                    n += 1
                    if n == 3:
                        started.release()
            except ca.CachedArraysError as e:
                errors.append(str(e))

        for round in range(25):
            m = ca.Manager(fast="2MiB", slow="16MiB")
            pairs = [(ca.asarray(np.random.rand(20000), manager=m),
                      ca.asarray(np.random.rand(20000), manager=m, placement="slow"))
                     for _ in range(4)]
            started, errors = threading.Semaphore(0), []
            threads = [threading.Thread(target=loop, args=(x, y, started, errors))
                       for x, y in pairs]
            for t in threads:
                t.start()
            for _ in threads:
                started.acquire()
            m.close()
            for t in threads:
                t.join()
            assert len(errors) == 4 and all("this manager is closed" in e for e in errors), errors
        print("ok")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ok"


def test_views_used_after_close_do_not_crash():
    # An ndarray from a scope that is still open, or that escaped its scope, keeps the mapping
    # alive: using it after close() reads stale memory instead of faulting.
    r = _run("""
        import numpy as np
        import cachedarrays as ca

        m = ca.Manager(fast="1MiB", slow="16MiB")
        x = ca.asarray(np.arange(1000.0), manager=m)
        s = ca.asarray(np.arange(1000.0), manager=m, placement="slow")
        with ca.readable(x) as a:
            pass
        with ca.writable(s) as w:
            w = w[:]                    # made inside the scope: it stays writable
        m.close()
        assert a.sum() == 499500.0 and w.sum() == 499500.0
        w[:] = 1.0
        assert w.sum() == 1000.0
        print("ok")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ok"


# ---- every use after close raises ----------------------------------------------------------

USES = {
    "ufunc": lambda x, m: x + 1,
    "ufunc with out=": lambda x, m: np.add(x, 1, out=x),
    "ufunc method": lambda x, m: np.add.reduce(x),
    "NumPy function": lambda x, m: np.sort(x),
    "array method": lambda x, m: x.sum(),
    "indexing": lambda x, m: x[3],
    "slicing": lambda x, m: x[1:3],
    "setitem": lambda x, m: x.__setitem__(0, 1.0),
    "readable": lambda x, m: ca.readable(x).__enter__(),
    "writable": lambda x, m: ca.writable(x).__enter__(),
    "access": lambda x, m: ca.access((x,), ()).__enter__(),
    "prefetch": lambda x, m: ca.prefetch(x, force=True),
    "evict": lambda x, m: ca.evict(x),
    "unsafe_free": lambda x, m: ca.unsafe_free(x),
    "in_fast": lambda x, m: ca.in_fast(x),
    "device": lambda x, m: x.device,
    "str": lambda x, m: str(x),
    "np.asarray": lambda x, m: np.asarray(x),
    "float": lambda x, m: float(x[0]),
    "reshape": lambda x, m: x.reshape(2, 5),
    "copy": lambda x, m: x.copy(),
    "pickle": lambda x, m: pickle.dumps(x),
    "new array": lambda x, m: ca.zeros(3, manager=m),
}


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("where", ["fast", "slow", "view"])
def test_every_use_after_close_raises_a_clear_error(use, where):
    m = ca.Manager(fast="1MiB", slow="16MiB")
    base = ca.asarray(np.arange(20.0), manager=m, placement="slow" if where == "slow" else None)
    x = base[5:15] if where == "view" else base[:10]
    m.close()
    with pytest.raises(UseAfterFreeError, match=CLOSED):
        USES[use](x, m)
    assert base.shape == (20,)                    # metadata stays readable


@pytest.mark.parametrize("where", ["fast", "slow", "view"])
def test_repr_after_close_describes_the_array_as_after_unsafe_free(where):
    # a repr that raises breaks debuggers, logging and error messages that show the array
    m = ca.Manager(fast="1MiB", slow="16MiB")
    base = ca.asarray(np.arange(20.0), manager=m, placement="slow" if where == "slow" else None)
    x = base[5:15] if where == "view" else base[:10]
    m.close()
    assert repr(x) == "CachedArray(<freed: its manager is closed>, shape=(10,), dtype=float64)"
    with pytest.raises(UseAfterFreeError, match="closed|fork"):
        str(x)
