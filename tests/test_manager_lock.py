"""The manager's lock (ManagerLock) keeps threading.RLock's contract."""

import threading
import time

import pytest

import cachedarrays as ca
from cachedarrays._records import ManagerLock


def _in_thread(fn):
    """fn() run in another thread: its result, or its exception raised here."""
    box = []

    def run():
        try:
            box.append((True, fn()))
        except BaseException as e:      # noqa: BLE001 - raised in the caller's thread
            box.append((False, e))
    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not t.is_alive()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def test_it_is_reentrant_and_owned_by_one_thread():
    lock = ManagerLock()
    assert lock.acquire() and lock.acquire(blocking=False) and lock._is_owned()
    assert _in_thread(lambda: lock.acquire(blocking=False)) is False
    assert _in_thread(lambda: lock.acquire(timeout=0.05)) is False
    with pytest.raises(RuntimeError, match="un-acquired"):
        _in_thread(lock.release)
    lock.release()
    assert _in_thread(lambda: lock.acquire(blocking=False)) is False   # still held once
    lock.release()
    assert not lock._is_owned()
    with pytest.raises(RuntimeError, match="un-acquired"):
        lock.release()
    assert _in_thread(lambda: (lock.acquire(blocking=False), lock.release())[0]) is True


def test_arguments_are_checked_as_rlocks_are():
    lock = ManagerLock()
    with pytest.raises(ValueError, match="non-blocking"):
        lock.acquire(False, 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        lock.acquire(timeout=-2)
    with pytest.raises(TypeError):
        ManagerLock(1)


def test_a_waiter_gets_the_lock_when_it_is_released_and_a_condition_works_on_it():
    lock = ManagerLock()
    cond = threading.Condition(lock)
    got, ready = [], threading.Event()

    def waiter():
        with cond:
            ready.set()
            got.append(cond.wait_for(lambda: got or None, 10) is not None)
    t = threading.Thread(target=waiter)
    t.start()
    assert ready.wait(10)
    with lock:
        with lock:                       # re-entered: wait must release every level
            got.append("go")
            cond.notify_all()
    t.join(10)
    assert not t.is_alive() and got == ["go", True]
    start = time.monotonic()
    with cond:
        assert cond.wait(0.05) is False and lock._is_owned()
    assert time.monotonic() - start >= 0.04


def test_a_managers_lock_is_one():
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        assert type(m._lock) is ManagerLock
        x = ca.zeros(10, manager=m)
        assert _in_thread(lambda: float((x + 1).sum())) == 10.0
