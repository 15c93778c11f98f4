"""Access scopes used out of their with-blocks: a scope object exited twice, exited without
being entered, or entered again while open is refused with a CachedArraysError, and the pins
of the other scopes on the same arrays stay as they were."""

import numpy as np
import pytest

import cachedarrays as ca

SCOPES = [
    ("readable", lambda a, b: ca.readable(a)),
    ("writable", lambda a, b: ca.writable(a)),
    ("access", lambda a, b: ca.access([a], [b])),
    ("kernel", lambda a, b: ca.kernel("k", [a], [b])),
]


def _pair(m):
    return ca.asarray(np.arange(4.0), manager=m), ca.asarray(np.arange(4.0), manager=m)


@pytest.mark.parametrize("kind,make", SCOPES, ids=[k for k, _ in SCOPES])
def test_exit_twice_keeps_other_pins(m, kind, make):
    a, b = _pair(m)
    with ca.readable(a) as outer, ca.readable(b):
        s = make(a, b)
        s.__enter__()
        s.__exit__(None, None, None)
        with pytest.raises(ca.CachedArraysError, match="not open"):
            s.__exit__(None, None, None)
        assert a.object._pins == 1 and b.object._pins == 1     # the outer scopes' pins
        assert outer[1] == 1.0
    assert a.object._pins == 0 and b.object._pins == 0


@pytest.mark.parametrize("kind,make", SCOPES, ids=[k for k, _ in SCOPES])
def test_exit_without_enter(m, kind, make):
    a, b = _pair(m)
    with pytest.raises(ca.CachedArraysError, match="not open"):
        make(a, b).__exit__(None, None, None)
    assert a.object._pins == 0 and b.object._pins == 0


@pytest.mark.parametrize("kind,make", SCOPES[2:], ids=[k for k, _ in SCOPES[2:]])
def test_multi_array_scope_entered_again(m, kind, make):
    a, b = _pair(m)
    s = make(a, b)
    with s:
        with pytest.raises(ca.CachedArraysError, match="open already"):
            s.__enter__()
        assert a.object._pins == 1
    assert a.object._pins == 0 and b.object._pins == 0
    with s:                                   # entered again once closed: fine
        assert a.object._pins == 1
    assert a.object._pins == 0


@pytest.mark.parametrize("kind,make", SCOPES[:2], ids=[k for k, _ in SCOPES[:2]])
def test_one_array_scope_nested_in_itself(m, kind, make):
    a, b = _pair(m)
    s = make(a, b)
    with s, s:
        assert a.object._pins == 2
    assert a.object._pins == 0


def test_failed_enter_leaves_scope_closed(m):
    a, b = _pair(m)
    ca.unsafe_free(b)
    s = ca.access([a], [b])
    with pytest.raises(ca.UseAfterFreeError):
        s.__enter__()
    assert a.object._pins == 0
    with pytest.raises(ca.CachedArraysError, match="not open"):
        s.__exit__(None, None, None)
