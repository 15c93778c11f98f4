"""Pins and close() at the edges: a pin belongs to the thread that took it (another thread's
unpin is refused, so nothing moves under that thread's view), and close() from inside one of the
manager's own operations (a movement callback, a policy, an ``m.atomic()`` block) is refused at
once, leaving the manager working; closing afterwards works."""

import threading

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.errors import CachedArraysError
from cachedarrays.policies import LRU

INSIDE = r"cannot close the manager from within one of its operations.*close\(\) after"


def _in_thread(fn):
    """fn() on another thread; its exception (or None)."""
    got = []

    def run():
        try:
            fn()
            got.append(None)
        except BaseException as e:          # noqa: BLE001 - handed back to the test
            got.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    return got[0]


# ---- unpin releases only the caller's own pin ----------------------------------------------------

def test_unpin_of_another_threads_pin_is_refused_and_the_array_stays_put(m):
    x = ca.full(1000, 3.0, manager=m)
    o = x.object
    m.pin(o)
    err = _in_thread(lambda: m.unpin(o))
    assert isinstance(err, CachedArraysError)
    assert f"object {o.id} holds no pin of this thread" in str(err)
    assert "by pin() on other threads" in str(err) and "unpin from the thread" in str(err)
    assert m.pin_count(o) == 1
    ca.evict(x)                                 # still pinned: nothing moves it
    assert x.device == "fast" and m.pinned(o)
    m.unpin(o)                                  # the owner releases it
    assert m.pin_count(o) == 0
    m.close()


def test_unpin_cannot_release_an_open_scopes_pin(m):
    x = ca.full(1000, 3.0, manager=m)
    with ca.readable(x) as v:
        with pytest.raises(CachedArraysError, match="running kernels or open access scopes"):
            m.unpin(x.object)
        assert m.pinned(x.object) and float(v.sum()) == 3000.0
    assert not m.pinned(x.object)


def test_a_detached_unpin_needs_a_detached_pin(m):
    x = ca.ones(10, manager=m)
    o = x.object
    m.pin(o)
    with pytest.raises(CachedArraysError, match="holds no detached pin"):
        m.unpin(o, detached=True)
    assert m.pin_count(o) == 1
    m.pin(o, detached=True)                     # a detached pin goes from any thread
    assert _in_thread(lambda: m.unpin(o, detached=True)) is None
    with pytest.raises(CachedArraysError, match="holds no detached pin"):
        m.unpin(o, detached=True)
    m.unpin(o)
    assert m.pin_count(o) == 0


# ---- close() from inside the manager's own operations ---------------------------------------------

def _check_still_working(m, xs):
    assert not m.closed
    for i, x in enumerate(xs):
        assert float(np.asarray(x).sum()) == i * x.size
    y = ca.full(100, 2.0, manager=m)
    assert float((y + 1).sum()) == 300.0
    m.check()
    m.close()
    assert m.closed


def test_close_inside_an_evictfrom_callback_is_refused():
    m = ca.Manager(fast="1MiB", slow="4MiB")
    xs = [ca.full(10_000, float(i), manager=m) for i in range(5)]
    seen = []

    def callback(region):
        with pytest.raises(RuntimeError, match=INSIDE):
            m.close()
        seen.append(region)
        return False

    m.evictfrom("fast", None, 600_000, callback)
    assert seen
    _check_still_working(m, xs)


class _ClosingLRU(LRU):
    """An LRU whose make_room tries to close the manager first."""

    def make_room(self, nbytes, wait=True):
        try:
            self.manager.close()
        except RuntimeError as e:
            self.refusals.append(str(e))
        return super().make_room(nbytes, wait)


def test_close_inside_a_policy_callback_is_refused():
    policy = _ClosingLRU()
    policy.refusals = []
    m = ca.Manager(fast="1MiB", slow="16MiB", policy=policy)
    xs = [ca.full(60_000, float(i), manager=m) for i in range(5)]   # the later ones make room
    assert policy.refusals and all("from within one of its operations" in r
                                   for r in policy.refusals)
    _check_still_working(m, xs)


def test_close_inside_an_atomic_block_is_refused():
    m = ca.Manager(fast="1MiB", slow="4MiB")
    xs = [ca.full(1000, float(i), manager=m) for i in range(3)]
    with m.atomic():
        with pytest.raises(RuntimeError, match=INSIDE):
            m.close()
        ca.evict(xs[1])
    assert xs[1].device == "slow"
    _check_still_working(m, xs)
