"""Pins and access scopes belong to the thread that took them, never to a later thread.

CPython reuses thread idents: a thread started after another ended often gets its ident. Pins
(Manager.pin) and open access scopes are keyed by a key no other thread gets
(cachedarrays.threadkeys), so a new thread starts clean: it cannot unpin what a thread that
ended pinned, and close() on it is not refused as if it held their scopes. A pin() of a thread
that ended, which nobody else may unpin, is released at the manager's next pin, unpin, scope or
close, and whenever the manager asks whether an object is pinned (a policy making room, an
evict, a free, a defragmentation); a scope it left open stays until its __exit__ (which any
thread may call), and close() says so.
"""

import gc
import threading

import numpy as np
import pytest

import cachedarrays as ca
import cachedarrays.manager as manager_module
from cachedarrays import threadkeys
from cachedarrays.errors import CachedArraysError, PinnedError


class _OneIdent:
    """The threading module as the manager sees it when every thread gets the same ident (as
    when CPython gives a new thread the ident of one that ended)."""

    def __getattr__(self, name):
        return getattr(threading, name)

    @staticmethod
    def get_ident():
        return 12345


def _in_thread(fn):
    out = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:          # handed to the test's thread
            out.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


@pytest.fixture
def same_ident(monkeypatch):
    monkeypatch.setattr(manager_module, "threading", _OneIdent())


def test_threads_get_keys_no_other_thread_gets():
    keys = [_in_thread(threadkeys.current) for _ in range(20)]
    assert len(set(keys)) == 20 and threadkeys.current() not in keys


def test_a_new_thread_cannot_unpin_the_pin_of_a_thread_that_ended(m, same_ident):
    x = ca.asarray(np.arange(8.0), manager=m)
    assert _in_thread(lambda: m.pin(x.object)) is None
    err = _in_thread(lambda: m.unpin(x.object))
    assert isinstance(err, CachedArraysError)       # not this thread's pin
    assert x.object._pins == 0                       # the ended thread's pin went with it
    m.check()


def test_a_live_threads_pin_holds_and_is_released_when_the_thread_ends():
    m = ca.Manager(fast="1MiB", slow="8MiB")
    x = ca.asarray(np.arange(8.0), manager=m)
    pinned, done = threading.Event(), threading.Event()

    def hold():                                  # pins, and ends without unpinning
        m.pin(x.object)
        pinned.set()
        done.wait(30)
    t = threading.Thread(target=hold)
    t.start()
    pinned.wait(30)
    try:
        with pytest.raises(PinnedError, match="other threads"):
            m.close(timeout=0.1)                 # the thread lives: its pin holds
        assert x.object._pins == 1 and not m.closed
    finally:
        done.set()
        t.join()
    m.close(timeout=5.0)                         # nobody can unpin it now: it went with the thread
    assert m.closed


def test_close_on_a_new_thread_is_not_refused_for_a_scope_a_thread_that_ended_left_open(
        m, same_ident):
    x = ca.asarray(np.arange(8.0), manager=m)
    scope = ca.writable(x)
    _in_thread(scope.__enter__)                      # ends without leaving the scope
    err = _in_thread(lambda: m.close(timeout=0.1))
    assert isinstance(err, PinnedError)
    assert "calling thread" not in str(err)          # it holds nothing
    assert "threads that have ended" in str(err) and "__exit__" in str(err)
    assert not m.closed
    scope.__exit__(None, None, None)                 # any thread may end the scope
    assert x.object._pins == 0
    np.testing.assert_array_equal(np.asarray(x), np.arange(8.0))


@pytest.mark.parametrize("scope", ["access", "kernel", "readable"])
def test_a_thread_reusing_an_ident_does_not_inherit_a_scope_left_open(m, scope):
    x = ca.asarray(np.arange(8.0), manager=m)
    s = {"access": lambda: ca.access((x,), ()), "kernel": lambda: ca.kernel("k", (x,), ()),
         "readable": lambda: ca.readable(x)}[scope]()
    ended = _in_thread(lambda: (s.__enter__(), threading.get_ident())[1])
    for _ in range(50):                              # a thread that gets the same ident
        got = _in_thread(lambda: (threading.get_ident(),
                                  m.close(timeout=0.05) if threading.get_ident() == ended
                                  else None))
        if isinstance(got, BaseException) or got[0] == ended:
            break
    if not isinstance(got, BaseException) and got[0] != ended:
        s.__exit__(None, None, None)
        pytest.skip("no new thread got the ident of the thread that ended")
    assert isinstance(got, PinnedError), got
    assert "calling thread" not in str(got)          # that thread holds nothing
    assert "threads that have ended" in str(got)     # the scope's own thread is named gone
    s.__exit__(None, None, None)
    assert x.object._pins == 0


@pytest.mark.parametrize("scope", ["access", "kernel", "writable", "compute"])
def test_close_names_a_scope_left_open_by_a_thread_that_ended(m, scope):
    # the C path of ca.kernel / ca.access records its scopes as the Python scopes do
    x = ca.asarray(np.arange(8.0), manager=m)
    s = {"access": lambda: ca.access((x,), ()), "kernel": lambda: ca.kernel("k", (x,), ()),
         "writable": lambda: ca.writable(x),
         "compute": lambda: ca.kernel("k", (), (x,))}[scope]()
    _in_thread(s.__enter__)
    with pytest.raises(PinnedError, match="threads that have ended"):
        m.close(timeout=0.05)
    s.__exit__(None, None, None)
    assert x.object._pins == 0


def test_a_thread_forgets_the_queues_of_managers_that_are_gone():
    gc.collect()
    before = len(threadkeys._life().queues)       # managers other tests left alive
    for _ in range(40):
        with ca.Manager(fast="64KiB", slow="256KiB") as mm:
            with ca.readable(ca.zeros(4, manager=mm)):
                pass
        del mm
    gc.collect()
    assert len(threadkeys._life().queues) <= before + 1   # not one per manager used here
    with pytest.raises(TypeError, match="threadkeys.Queue"):
        threadkeys.watch([])


def test_an_array_of_another_manager_is_assigned_into_a_slice(m):
    other = ca.Manager(fast="1MiB", slow="8MiB")
    try:
        x = ca.asarray(np.arange(6.0), manager=m)
        y = ca.asarray(np.arange(6.0) + 10, manager=other)
        x[:] = y
        x[1:3] = y[4:]
        np.testing.assert_array_equal(np.asarray(x), [10, 14, 15, 13, 14, 15])
        assert x.object._pins == 0 and y.object._pins == 0
        m.check()
        other.check()
    finally:
        other.close()


def _fast_and_pinned_by(m, hold):
    """An array filling most of m's fast memory, pinned by hold(m, obj) on another thread."""
    x = ca.asarray(np.arange(100_000.0), manager=m)         # 800 KB of the 1 MiB
    assert x.device == "fast"
    assert _in_thread(lambda: hold(m, x.object)) is None
    return x


# what needs an array unpinned -> f(m, x): True when it moved or freed x
_NEEDS_UNPINNED = {
    "a new array makes room": lambda m, x: ca.zeros(100_000, manager=m).device == "fast"
    and x.device == "slow",
    "ca.evict": lambda m, x: (ca.evict(x), x.device == "slow")[1],
    "ca.unsafe_free": lambda m, x: (ca.unsafe_free(x), x.object.freed)[1],
    "m.pinned": lambda m, x: not m.pinned(x.object),
    "m.pin_count": lambda m, x: m.pin_count(x.object) == 0,
    "m.evictfrom": lambda m, x: m.evictfrom(
        "fast", None, 900_000, lambda r: m.policy.evict(m.parent(r))) and x.device == "slow",
}


@pytest.mark.parametrize("needs", sorted(_NEEDS_UNPINNED))
def test_what_a_thread_that_ended_left_pinned_is_released_when_the_manager_needs_it(m, needs):
    x = _fast_and_pinned_by(m, lambda m, obj: m.pin(obj))   # ends without unpinning
    assert _NEEDS_UNPINNED[needs](m, x)
    assert x.object._pins == 0
    if not x.object.freed:
        np.testing.assert_array_equal(np.asarray(x), np.arange(100_000.0))
    m.check()


def test_a_defragmentation_moves_what_a_thread_that_ended_left_pinned(m):
    gap = ca.zeros(1000, manager=m)
    x = _fast_and_pinned_by(m, lambda m, obj: m.pin(obj))
    at = x.object.primary.offset
    ca.unsafe_free(gap)
    assert m.defrag("fast") >= 1 and x.object.primary.offset < at
    np.testing.assert_array_equal(np.asarray(x), np.arange(100_000.0))
    m.check()


@pytest.mark.parametrize("needs", sorted(set(_NEEDS_UNPINNED) - {"ca.unsafe_free"}))
def test_the_pin_of_a_live_thread_still_holds_when_the_manager_needs_room(m, needs):
    x = ca.asarray(np.arange(100_000.0), manager=m)
    pinned, done = threading.Event(), threading.Event()

    def hold():
        m.pin(x.object)
        pinned.set()
        done.wait(30)
        m.unpin(x.object)
    t = threading.Thread(target=hold)
    t.start()
    pinned.wait(30)
    try:
        assert not _NEEDS_UNPINNED[needs](m, x)
        assert x.device == "fast" and x.object._pins == 1
    finally:
        done.set()
        t.join()
    assert x.object._pins == 0
