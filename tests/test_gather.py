"""x[indices] and np.take(x, indices, axis=0) with an integer ndarray of indices: NumPy's
result or NumPy's error for every index (negative, out of range, empty, several axes, every
integer dtype), on arrays and views; indices in range gather into a policy-placed result in
one step (no NumPy result copied in)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from helpers import refuse_general_path


def _outcome(f):
    try:
        return f()
    except Exception as e:        # noqa: BLE001 - compared with NumPy's
        return type(e), str(e)


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
       dtype=st.sampled_from(["f8", "f4", "i2", "u1", "c8", "?", "S3",
                              np.dtype([("a", "i4"), ("b", "f8")])]),
       idx=st.lists(st.integers(-7, 7), min_size=0, max_size=6),
       idx_dtype=st.sampled_from(["i8", "i4", "i1", "u1", "u8", "i2"]),
       idx_shape=st.sampled_from(["flat", "column", "row"]), view=st.booleans(),
       call=st.sampled_from(["index", "take", "take axis 1", "take wrap", "take flat"]))
def test_gathers_give_numpys_result_or_error(shape, dtype, idx, idx_dtype, idx_shape, view, call):
    a = np.arange(int(np.prod(shape)) * 7 % 256).astype(dtype)[:int(np.prod(shape))]
    a = np.resize(a, shape) if a.size else np.zeros(shape, dtype)
    key = np.array([i for i in idx if idx_dtype[0] == "i" or i >= 0], dtype=idx_dtype)
    key = {"flat": key, "column": key[:, None], "row": key[None, :]}[idx_shape]
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        x = ca.asarray(a, manager=m)
        if view and shape[0] > 1:
            a, x = a[1:], x[1:]
        if call == "take wrap" and not a.shape[0]:
            return                     # NumPy's wrap over an empty axis never returns
        calls = {"index": lambda v: v[key], "take": lambda v: np.take(v, key, axis=0),
                 "take axis 1": lambda v: np.take(v, key, axis=1 if v.ndim > 1 else 0),
                 "take wrap": lambda v: np.take(v, key, axis=0, mode="wrap"),
                 "take flat": lambda v: np.take(v, key)}
        want, got = _outcome(lambda: calls[call](a)), _outcome(lambda: calls[call](x))
        if isinstance(want, tuple):
            assert got == want
        else:
            assert isinstance(got, ca.CachedArray)
            assert (got.shape, got.dtype) == (want.shape, want.dtype)
            assert np.asarray(got).tobytes() == want.tobytes()
        assert x.object._pins == 0
        m.check()


@pytest.mark.parametrize("call", [lambda x, k: x[k], lambda x, k: np.take(x, k, axis=0)])
def test_indices_in_range_gather_into_a_placed_result(call, monkeypatch):
    refuse = refuse_general_path(monkeypatch)
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        a = np.arange(60.0).reshape(12, 5)
        x = ca.asarray(a, manager=m)
        monkeypatch.setattr(m, "acquire", refuse)        # x[k]'s general path pins through it
        k = np.array([[0, -1], [11, -12], [3, 3]])
        got = call(x, k)
        monkeypatch.undo()
        assert got.device == "fast" and got.flags.c_contiguous
        np.testing.assert_array_equal(np.asarray(got), a[k])
        m.check()


def _long_strides(a):
    return [s for s, d in zip(a.strides, a.shape) if d > 1]


@settings(max_examples=200, deadline=None)
@given(rest=st.sampled_from([(), (1,), (1, 1), (3,), (2, 1)]),
       idx_shape=st.sampled_from([(2, 3), (3, 1, 2), (1, 4), (2, 2, 2)]),
       layout=st.sampled_from(["C", "F", "transposed", "strided", "reversed"]),
       call=st.sampled_from(["index", "take"]))
def test_gathers_lay_out_their_result_as_numpy_does(rest, idx_shape, layout, call):
    """x[key] follows the memory order of a key of several axes where x has no other axes of
    more than one element; np.take is always C-ordered: both as NumPy lays them out."""
    base = np.arange(int(np.prod(idx_shape)) * 2).reshape((-1,) + idx_shape[1:]) % 5
    key = {"C": base[:idx_shape[0]], "F": np.asfortranarray(base[:idx_shape[0]]),
           "transposed": base[:idx_shape[0]].T, "strided": base[::2],
           "reversed": base[::-1]}[layout]
    a = np.arange(5 * int(np.prod(rest)), dtype="f8").reshape((5,) + rest)
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        x = ca.asarray(a, manager=m)
        f = (lambda v: v[key]) if call == "index" else (lambda v: np.take(v, key, axis=0))
        want, got = f(a), f(x)
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
        assert _long_strides(got) == _long_strides(want)
        np.testing.assert_array_equal(np.asarray(got), want)
        assert x.object._pins == 0
        m.check()
