"""np.round, np.around, x.round and np.diff on CachedArrays give NumPy's results and errors for
every form of call; the common forms write a policy-placed result in place (no copy in)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from helpers import numpy_outcome, refuse_general_path, same_outcome


_DTYPES = st.sampled_from(["f8", "f4", "f2", "i1", "u2", "i8", "c16", "?"])
_SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@settings(max_examples=300, deadline=None)
@given(dtype=_DTYPES, shape=_SHAPES, decimals=st.sampled_from([0, 1, 2, -1, -2, 1.5, "x"]),
       form=st.sampled_from(["round", "around", "method", "keyword", "out", "view"]))
def test_round_gives_numpys_result_or_error(dtype, shape, decimals, form):
    a = np.asarray(np.arange(int(np.prod(shape)), dtype=float).reshape(shape) * 13.37 - 20)
    a = a.astype(dtype)
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        x = ca.asarray(a, manager=m)
        calls = {"round": lambda v: np.round(v, decimals),
                 "around": lambda v: np.around(v, decimals),
                 "method": lambda v: v.round(decimals),
                 "keyword": lambda v: np.round(v, decimals=decimals),
                 "out": lambda v: np.round(v, decimals, out=v),
                 "view": lambda v: np.round(v.T, decimals)}
        same_outcome(numpy_outcome(lambda: calls[form](x)),
                     numpy_outcome(lambda: calls[form](a.copy())))
        assert x.object._pins == 0
        m.check()


@settings(max_examples=300, deadline=None)
@given(dtype=_DTYPES, shape=_SHAPES, n=st.sampled_from([0, 1, 2, -1]),
       axis=st.integers(-4, 3), extra=st.sampled_from([None, "prepend", "append"]))
def test_diff_gives_numpys_result_or_error(dtype, shape, n, axis, extra):
    a = np.asarray(np.arange(int(np.prod(shape)), dtype=float).reshape(shape) ** 1.5).astype(dtype)
    kwargs = {extra: 0} if extra else {}
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        x = ca.asarray(a, manager=m)
        same_outcome(numpy_outcome(lambda: np.diff(x, n, axis, **kwargs)),
                     numpy_outcome(lambda: np.diff(a, n, axis, **kwargs)))
        same_outcome(numpy_outcome(lambda: np.diff(x, n=n, axis=axis)),
                     numpy_outcome(lambda: np.diff(a, n=n, axis=axis)))
        assert x.object._pins == 0
        m.check()


@pytest.mark.parametrize("call", [lambda x: np.round(x, 2), lambda x: np.around(x),
                                  lambda x: x.round(1), lambda x: np.diff(x),
                                  lambda x: np.diff(x, 1, 0)])
def test_the_common_forms_fill_a_placed_result(call, monkeypatch):
    refuse_general_path(monkeypatch)
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        a = np.linspace(-3, 3, 20).reshape(4, 5)
        got = call(ca.asarray(a, manager=m))
        assert got.device == "fast"
        np.testing.assert_array_equal(np.asarray(got), call(a))
        m.check()
