"""np.stack, np.vstack and np.hstack on CachedArrays: the result is placed by the policy and
filled by NumPy in place (no array built in ordinary memory and copied in), and every call,
the common one or not, gives NumPy's result or NumPy's error."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays.routines import joining
from helpers import numpy_outcome, refuse_general_path

FUNCS = {"stack": np.stack, "vstack": np.vstack, "hstack": np.hstack,
         "concatenate": np.concatenate}


def _check(name, arrays, kwargs, m):
    ours = [ca.asarray(a, manager=m) if isinstance(a, np.ndarray) else a for a in arrays]
    want = numpy_outcome(lambda: FUNCS[name](arrays, **kwargs))
    got = numpy_outcome(lambda: FUNCS[name](ours, **kwargs))
    if isinstance(want, type):
        assert got is want, (name, kwargs, [np.shape(a) for a in arrays])
        return
    assert isinstance(got, ca.CachedArray)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    if want.size:                 # the layout, but for axes of length 1 (any stride serves)
        assert [t for t, d in zip(got.strides, got.shape) if d > 1] == \
            [t for t, d in zip(want.strides, want.shape) if d > 1]
    np.testing.assert_array_equal(np.asarray(got), want)
    assert all(a.object._pins == 0 for a in ours if isinstance(a, ca.CachedArray))


_SHAPE = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(FUNCS)), shape=_SHAPE, n=st.integers(1, 4),
       other=st.none() | _SHAPE, dtypes=st.sampled_from([("f8",), ("f4",), ("i2",), ("f8", "f4"),
                                                         ("i4", "f8"), ("?",), ("U3",)]),
       axis=st.integers(-4, 4), fortran=st.booleans(), plain=st.booleans())
def test_joins_give_numpys_result_or_error(name, shape, n, other, dtypes, axis, fortran, plain):
    rng = np.random.default_rng(0)
    arrays = []
    for k in range(n):
        s = other if (other is not None and k == n - 1) else shape
        a = np.asarray(rng.random(s) * 10).astype(dtypes[k % len(dtypes)])
        arrays.append(np.asfortranarray(a) if fortran and k == 0 else a)
    if plain and n > 1:
        arrays[-1] = arrays[-1].tolist() if arrays[-1].ndim else arrays[-1]
    kwargs = {} if name in ("vstack", "hstack") else {"axis": axis}
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        _check(name, arrays, kwargs, m)
        m.check()


@pytest.mark.parametrize("name, kwargs, shapes", [
    ("stack", {"axis": 0}, [(3, 4), (3, 4)]), ("stack", {"axis": -1}, [(2, 5)] * 3),
    ("stack", {"axis": -1}, [()] * 2), ("vstack", {}, [(4,), (4,)]),
    ("vstack", {}, [(2, 3), (5, 3)]), ("vstack", {}, [(), ()]), ("hstack", {}, [(3,), (5,)]),
    ("hstack", {}, [(2, 3), (2, 1)]), ("hstack", {}, [(), ()])])
def test_the_common_join_fills_a_placed_result_in_one_step(name, kwargs, shapes, monkeypatch):
    refuse_general_path(monkeypatch, joining, "the common join took the general path")
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        arrays = [np.asarray(np.arange(np.prod(s, dtype=int), dtype=np.float32).reshape(s) + k)
                  for k, s in enumerate(shapes)]
        got = FUNCS[name]([ca.asarray(a, manager=m) for a in arrays], **kwargs)
        want = FUNCS[name](arrays, **kwargs)
        assert got.device == "fast" and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), want)
        m.check()


def test_the_keywords_and_the_rest_take_numpys_path(m):
    x, y = ca.ones((2, 3), manager=m), ca.zeros((2, 3), manager=m)
    np.testing.assert_array_equal(np.asarray(np.stack([x, y], dtype=np.float32)),
                                  np.stack([np.ones((2, 3)), np.zeros((2, 3))]))
    out = ca.empty((2, 2, 3), manager=m)
    assert np.stack((x, y), out=out) is out
    np.testing.assert_array_equal(np.asarray(out)[0], np.ones((2, 3)))
    with pytest.raises(ValueError):
        np.stack([x, y], casting="bogus")
    with pytest.raises(ValueError):
        np.vstack([x, y], casting="bogus")
    with pytest.raises(ValueError, match="need at least one array"):
        np.stack([])
    with pytest.raises(np.exceptions.AxisError):
        np.stack([x, y], axis=3)
    assert np.hstack((x, y), dtype=np.int8, casting="unsafe").dtype == np.int8
    other = ca.Manager(fast="1MiB", slow="4MiB")
    try:
        z = ca.ones((2, 3), manager=other)
        np.testing.assert_array_equal(np.asarray(np.vstack([x, z])),
                                      np.vstack([np.ones((2, 3)), np.ones((2, 3))]))
    finally:
        other.close()
