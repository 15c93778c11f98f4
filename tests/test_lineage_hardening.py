"""ca.compute, ca.kernel and ca.access given their reads and writes in the wrong shape: a
CachedArray itself (iterating it would pass its rows as operands) is refused with a TypeError
that says to write (x,); any other iterable (a generator) is read once, as a tuple would be."""

import numpy as np
import pytest

import cachedarrays as ca


def _inc(xv, hv):
    np.add(xv, 1, out=hv)


def _run(kind, reads, writes):
    if kind == "compute":
        return ca.compute("inc", lambda *vs: _inc(*vs), reads, writes)
    scope = ca.kernel("inc", reads, writes) if kind == "kernel" else ca.access(reads, writes)
    with scope as vs:
        _inc(*vs)


@pytest.mark.parametrize("kind", ["compute", "kernel", "access"])
@pytest.mark.parametrize("bare", ["reads", "writes"])
def test_bare_array_refused(m, kind, bare):
    x = ca.asarray(np.ones((2, 3)), manager=m)
    h = ca.zeros((2, 3), manager=m)
    reads, writes = (x if bare == "reads" else (x,)), (h if bare == "writes" else (h,))
    with pytest.raises(TypeError, match=r"takes CachedArrays.*a CachedArray itself.*\(x,\)"):
        _run(kind, reads, writes)
    assert x.object._pins == 0 and h.object._pins == 0
    assert np.asarray(h).sum() == 0                # nothing was written
    if kind == "compute":
        assert not m.regenerable(h.object)


@pytest.mark.parametrize("kind", ["compute", "kernel", "access"])
def test_generators_read_once(m, kind):
    x = ca.asarray(np.ones((2, 3)), manager=m)
    h = ca.zeros((2, 3), manager=m)
    _run(kind, (a for a in [x]), (a for a in [h]))
    assert np.array_equal(np.asarray(h), np.full((2, 3), 2.0))
    if kind == "compute":                          # the recipe names both operands
        ca.drop(h)
        assert np.array_equal(np.asarray(h), np.full((2, 3), 2.0))


@pytest.mark.parametrize("kind", ["compute", "kernel", "access"])
def test_not_iterable_refused(m, kind):
    h = ca.zeros(3, manager=m)
    with pytest.raises(TypeError, match="takes CachedArrays.*tuple or list; got int"):
        _run(kind, 3, (h,))
