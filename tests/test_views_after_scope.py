"""A writable view kept past its scope refuses writes: once the scope ends, the array may move
and the view's memory may belong to another array, so every scope that hands out writable views
(ca.writable, ca.access, ca.kernel, ca.compute, in C and in Python) makes them read-only when
it ends, for good: NumPy refuses to make such a view, or one made from it later, writable
again. A write through a kept view raises NumPy's ValueError and changes no array."""

import threading

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import scopes
from helpers import run_threads

N = 4096                                  # 32 KiB of float64: two fill the tiny fast memory


def _python_path(monkeypatch):
    monkeypatch.setattr(scopes, "_compute_fast", lambda *args: None)
    monkeypatch.setattr(scopes, "_kernel_enter", lambda *args: None)


def _kept_by_writable(x, y):
    with ca.writable(x) as w:
        w[0] = 1.0
    return w


def _kept_by_access(x, y):
    with ca.access((y,), (x,)) as (_, w):
        w[0] = 1.0
    return w


def _kept_by_kernel(x, y):
    with ca.kernel("k", [y], [None, x]) as (_, _none, w):
        w[0] = 1.0
    return w


def _kept_by_compute(x, y):
    kept = []

    def fn(r, w):
        w[...] = r
        w[0] = 1.0
        kept.append(w)
    ca.compute("c", fn, (y,), (x,))
    return kept[0]


def _kept_by_nested_writable(x, y):
    scope = ca.writable(x)
    with scope as outer:
        with scope as inner:
            inner[0] = 1.0
        with pytest.raises(ValueError, match="read-only"):
            inner[1] = 2.0
        outer[1] = 2.0                        # the outer block is still open
    return outer


KEPT = {"writable": _kept_by_writable, "access": _kept_by_access, "kernel": _kept_by_kernel,
        "compute": _kept_by_compute, "nested writable": _kept_by_nested_writable}


def _cannot_be_made_writable(w):
    """Neither w nor a view made from it afterwards can be set writable again: NumPy finds no
    writable buffer at the end of their bases."""
    for v in (w, w[1:], w.reshape(-1), w.view(np.uint8)):
        with pytest.raises(ValueError, match="WRITEABLE"):
            v.setflags(write=True)
        with pytest.raises(ValueError, match="WRITEABLE"):
            v.flags.writeable = True
        assert not v.flags.writeable


@pytest.mark.parametrize("path", ["C", "Python"])
@pytest.mark.parametrize("keep", list(KEPT.values()), ids=list(KEPT))
def test_a_view_kept_past_its_scope_refuses_writes_and_no_array_changes(tiny, monkeypatch,
                                                                         keep, path):
    if path == "Python":
        _python_path(monkeypatch)
    x = ca.zeros(N, manager=tiny, placement="fast")
    y = ca.zeros(N, manager=tiny)
    w = keep(x, y)
    assert not w.flags.writeable
    _cannot_be_made_writable(w)
    ca.evict(x)                               # x's fast memory is free...
    z = ca.full(N, 7.0, manager=tiny, placement="fast")     # ...and may be z's now
    before = np.asarray(x)
    with pytest.raises(ValueError, match="read-only"):
        w[:] = -1.0
    with pytest.raises(ValueError, match="read-only"):
        np.add(w, 1.0, out=w)
    assert (np.asarray(z) == 7.0).all()
    np.testing.assert_array_equal(np.asarray(x), before)
    assert before[0] == 1.0                   # the write inside the scope was kept


@pytest.mark.parametrize("path", ["C", "Python"])
def test_read_views_stay_read_only_and_views_inside_the_scope_stay_writable(m, monkeypatch,
                                                                            path):
    if path == "Python":
        _python_path(monkeypatch)
    x, y = ca.zeros(8, manager=m), ca.ones(8, manager=m)
    with ca.kernel("k", [y], [x]) as (r, w):
        assert not r.flags.writeable and w.flags.writeable
        w[:4] = r[:4]
        part = w[4:]
        part[:] = 2.0
        assert part.flags.writeable
    assert not r.flags.writeable and not w.flags.writeable
    np.testing.assert_array_equal(np.asarray(x), [1, 1, 1, 1, 2, 2, 2, 2])


def test_one_writable_scope_shared_by_threads_closes_each_threads_own_view(m):
    x = ca.zeros(4, manager=m)
    scope = ca.writable(x)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    views, errors = {}, []

    def work(k):
        try:
            if k:
                first_in.wait(10)
            with scope as v:
                views[k] = v
                if k == 0:
                    first_in.set()
                    second_in.wait(10)
                else:
                    second_in.set()
                    first_out.wait(10)
                    v[1] = 2.0               # the first thread's exit left this view open
            if k == 0:
                first_out.set()
        except BaseException as e:          # (reported by the assertion below)
            errors.append(e)
            first_in.set(), second_in.set(), first_out.set()
    run_threads(work, 2)
    assert errors == []
    assert not views[0].flags.writeable and not views[1].flags.writeable
    np.testing.assert_array_equal(np.asarray(x), [0.0, 2.0, 0.0, 0.0])
    assert x.object._pins == 0


SCOPE_OBJECTS = {"writable": lambda x: ca.writable(x), "access": lambda x: ca.access((), (x,)),
                 "kernel": lambda x: ca.kernel("k", (), (x,))}


def _writable_view(entered):
    return entered if isinstance(entered, np.ndarray) else entered[-1]


@pytest.mark.parametrize("path", ["C", "Python"])
@pytest.mark.parametrize("make", list(SCOPE_OBJECTS.values()), ids=list(SCOPE_OBJECTS))
def test_a_scope_entered_by_a_thread_that_ended_and_exited_here_closes_its_view(
        tiny, monkeypatch, path, make):
    """A with-block opened on a thread that ended, and exited from another (its pin may be):
    the view it handed out refuses writes, and the array that reuses the memory keeps its
    data."""
    if path == "Python":
        _python_path(monkeypatch)
    x = ca.zeros(N, manager=tiny)
    scope, entered = make(x), []
    t = threading.Thread(target=lambda: entered.append(scope.__enter__()))
    t.start()
    t.join()
    w = _writable_view(entered[0])
    w[0] = 1.0
    scope.__exit__(None, None, None)
    assert not w.flags.writeable
    _cannot_be_made_writable(w)
    ca.unsafe_free(x)
    y = ca.full(N, 2.0, manager=tiny)
    with pytest.raises(ValueError, match="read-only"):
        w[...] = 7.0
    np.testing.assert_array_equal(np.asarray(y), np.full(N, 2.0))
    tiny.check()


@pytest.mark.parametrize("path", ["C", "Python"])
def test_a_kernel_that_raises_seals_its_views_and_its_error_comes_through(m, monkeypatch, path):
    if path == "Python":
        _python_path(monkeypatch)
    x, y = ca.zeros(8, manager=m), ca.ones(8, manager=m)
    kept = []

    def fn(r, w):
        kept.append(w)
        w[0] = 5.0
        raise KeyError("from the kernel")

    with pytest.raises(KeyError, match="from the kernel"):
        ca.compute("c", fn, (y,), (x,))
    with pytest.raises(KeyError, match="from the kernel"):
        with ca.kernel("k", (y,), (x,)) as (r, w):
            fn(r, w)
    for w in kept:
        _cannot_be_made_writable(w)
    m.check()


def test_a_sealed_view_keeps_the_mapping_alive_after_the_manager_closes():
    m = ca.Manager(fast="64KiB", slow="1MiB")
    x = ca.full(8, 3.0, manager=m)
    with ca.writable(x) as w:
        w[0] = 4.0
    m.close()
    del x
    import gc
    gc.collect()
    assert w.tolist() == [4.0] + [3.0] * 7    # read through the mapping the view keeps
    _cannot_be_made_writable(w)


EMPTY_KEPT = {"writable": lambda x, y: _in_scope(ca.writable(x)),
              "access": lambda x, y: _in_scope(ca.access((y,), (x,)))[1],
              "kernel": lambda x, y: _in_scope(ca.kernel("k", [y], [None, x]))[2],
              "compute": lambda x, y: _kept_by_empty_compute(x, y)}


def _in_scope(scope):
    with scope as views:
        pass
    return views


def _kept_by_empty_compute(x, y):
    kept = []
    ca.compute("c", lambda r, w: kept.append(w), (y,), (x,))
    return kept[0]


@pytest.mark.parametrize("path", ["C", "Python"])
@pytest.mark.parametrize("keep", list(EMPTY_KEPT.values()), ids=list(EMPTY_KEPT))
@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0)])
def test_an_empty_view_kept_past_its_scope_cannot_be_made_writable_either(
        tiny, monkeypatch, path, keep, shape):
    """An empty view owns the (unused) bytes NumPy gave it, which NumPy would let be made
    writable; sealed, it owns nothing and holds them through its base."""
    if path == "Python":
        _python_path(monkeypatch)
    x, y = ca.zeros(shape, manager=tiny), ca.zeros(shape, manager=tiny)
    w = keep(x, y)
    assert w.shape == shape and not w.flags.owndata
    _cannot_be_made_writable(w)
    del x, y
    import gc
    gc.collect()
    assert w.tolist() == np.zeros(shape).tolist()
    tiny.check()


@pytest.mark.parametrize("keep", list(KEPT.values()), ids=list(KEPT))
def test_an_interrupt_while_a_scope_seals_its_views_still_unpins_the_arrays(
        tiny, monkeypatch, keep):
    """A KeyboardInterrupt that lands while a Python scope seals its writable views (between
    the seals and the release) propagates, and the scope still ends: nothing stays pinned, so
    the arrays can leave fast memory and the manager closes clean."""
    from cachedarrays import pinning
    _python_path(monkeypatch)

    def interrupted(view):
        raise KeyboardInterrupt

    monkeypatch.setattr(scopes, "_seal_view", interrupted)
    monkeypatch.setattr(pinning, "_seal_view", interrupted)
    x = ca.asarray(np.zeros(N), manager=tiny)
    y = ca.asarray(np.ones(N), manager=tiny)
    with pytest.raises(KeyboardInterrupt):
        keep(x, y)
    for a in (x, y):
        assert not tiny.pinned(a._obj)
    assert not tiny._scopes                  # close() would name a scope still open
    monkeypatch.undo()
    for a in (x, y):
        ca.evict(a)
        assert not ca.in_fast(a)
    tiny.check()
