"""np.roll and np.tile of CachedArrays give NumPy's results (values, dtype, shape, layout) and
errors for every form of call; the common forms fill a policy-placed result in place."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from helpers import numpy_outcome, refuse_general_path, same_outcome


_SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
_DTYPES = st.sampled_from(["f8", "i2", "u1", "?", "c8", "S2", ">i4"])


def _array(shape, dtype, layout):
    a = np.asarray(np.arange(int(np.prod(shape))).reshape(shape) % 7).astype(dtype)
    return {"C": a, "F": np.asfortranarray(a), "view": a[..., ::2] if a.ndim else a}[layout]


@settings(max_examples=300, deadline=None)
@given(shape=_SHAPES, dtype=_DTYPES, layout=st.sampled_from(["C", "F", "view"]),
       shift=st.one_of(st.integers(-9, 9), st.sampled_from([np.int8(3), 2.0, (1, 2), True])),
       axis=st.one_of(st.none(), st.integers(-4, 3), st.sampled_from([(0, 1), np.int64(0)])))
def test_roll_gives_numpys_result_or_error(shape, dtype, layout, shift, axis):
    a = _array(shape, dtype, layout)
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        x = ca.asarray(a, manager=m) if layout != "view" else \
            ca.asarray(np.ascontiguousarray(_array(shape, dtype, "C")), manager=m)[..., ::2] \
            if len(shape) else ca.asarray(a, manager=m)
        same_outcome(numpy_outcome(lambda: np.roll(x, shift, axis)),
                     numpy_outcome(lambda: np.roll(a, shift, axis)), exact=True)
        assert x.object._pins == 0
        m.check()


@settings(max_examples=300, deadline=None)
@given(shape=_SHAPES, dtype=_DTYPES, layout=st.sampled_from(["C", "F"]),
       reps=st.one_of(st.integers(-1, 3), st.lists(st.integers(0, 3), max_size=4).map(tuple),
                      st.sampled_from([np.int64(2), [2, 1], 1.5, (2, -1), ()])))
def test_tile_gives_numpys_result_or_error(shape, dtype, layout, reps):
    a = _array(shape, dtype, layout)
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        x = ca.asarray(a, manager=m)
        same_outcome(numpy_outcome(lambda: np.tile(x, reps)),
                     numpy_outcome(lambda: np.tile(a, reps)), exact=True)
        assert x.object._pins == 0
        m.check()


@pytest.mark.parametrize("call", [lambda x: np.roll(x, 3), lambda x: np.roll(x, -1, 1),
                                  lambda x: np.tile(x, 2), lambda x: np.tile(x, (2, 1, 3))])
def test_the_common_forms_fill_a_placed_result(call, monkeypatch):
    refuse_general_path(monkeypatch)
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        a = np.arange(20.0).reshape(4, 5)
        got = call(ca.asarray(a, manager=m))
        assert got.device == "fast"
        np.testing.assert_array_equal(np.asarray(got), call(a))
        m.check()


@settings(max_examples=300, deadline=None)
@given(sa=_SHAPES, sb=_SHAPES, da=_DTYPES, db=_DTYPES,
       ufunc=st.sampled_from([np.multiply, np.add, np.subtract, np.maximum, np.less,
                              np.logical_and, np.power]),
       form=st.sampled_from(["np.outer", "ufunc.outer", "scalar", "ndarray", "view"]),
       layout=st.sampled_from(["C", "F"]))
def test_outer_gives_numpys_result_or_error(sa, sb, da, db, ufunc, form, layout):
    a, b = _array(sa, da, layout), _array(sb, db, "C")
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        x, y = ca.asarray(a, manager=m), ca.asarray(b, manager=m)
        if form == "view" and a.ndim:
            a, x = a[..., ::-1], x[..., ::-1]
        calls = {"np.outer": lambda p, q: np.outer(p, q),
                 "ufunc.outer": lambda p, q: ufunc.outer(p, q),
                 "scalar": lambda p, q: ufunc.outer(p, 3),
                 "ndarray": lambda p, q: ufunc.outer(p, b),
                 "view": lambda p, q: np.outer(p, q)}
        with np.errstate(all="ignore"):
            same_outcome(numpy_outcome(lambda: calls[form](x, y)),
                         numpy_outcome(lambda: calls[form](a, b)), exact=True)
        assert x.object._pins == 0 and y.object._pins == 0
        m.check()


def test_outer_of_arrays_of_one_manager_is_placed_in_one_step(monkeypatch):
    refuse = refuse_general_path(monkeypatch)
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        a, b = np.arange(5.0), np.arange(7.0) - 3
        x, y = ca.asarray(a, manager=m), ca.asarray(b, manager=m)
        monkeypatch.setattr(m, "acquire", refuse)       # the general ufunc path pins through it
        got, got_u = np.outer(x, y), np.subtract.outer(x, y)
        monkeypatch.undo()
        np.testing.assert_array_equal(np.asarray(got), np.outer(a, b))
        np.testing.assert_array_equal(np.asarray(got_u), np.subtract.outer(a, b))
        assert got.device == "fast" and got.flags.c_contiguous
        m.check()
