"""np.clip and x.clip on CachedArrays give NumPy's results and errors for every form of call,
and the common one (three positional arguments) writes a policy-placed result through NumPy's
clip ufuncs instead of building it in ordinary memory and copying it in."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from helpers import numpy_outcome, refuse_general_path

_BOUNDS = st.one_of(st.none(), st.integers(-300, 300), st.floats(-5, 5),
                    st.sampled_from([np.nan, np.inf, -np.inf, 2**70, np.int8(3), "arr", "ca"]))


def _bound(v, m, n):
    if isinstance(v, str):
        arr = np.linspace(-2, 2, n)
        return (arr, ca.asarray(arr, manager=m) if v == "ca" else arr)
    return (v, v)


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(["f8", "f4", "i1", "u1", "i8", "?"]), lo=_BOUNDS, hi=_BOUNDS,
       form=st.sampled_from(["positional", "method", "keywords", "new keywords", "out"]))
def test_clip_gives_numpys_result_or_error(dtype, lo, hi, form):
    n = 7
    a = (np.linspace(-6, 6, n) * 10).astype(dtype)
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        x = ca.asarray(a, manager=m)
        (lo_np, lo_ca), (hi_np, hi_ca) = _bound(lo, m, n), _bound(hi, m, n)
        calls = {"positional": lambda arr, l, h: np.clip(arr, l, h),
                 "method": lambda arr, l, h: arr.clip(l, h),
                 "keywords": lambda arr, l, h: np.clip(arr, a_min=l, a_max=h),
                 "new keywords": lambda arr, l, h: np.clip(arr, min=l, max=h),
                 "out": lambda arr, l, h: np.clip(arr, l, h, out=arr)}
        want = numpy_outcome(lambda: calls[form](a.copy(), lo_np, hi_np))
        got = numpy_outcome(lambda: calls[form](x, lo_ca, hi_ca))
        if isinstance(want, type):
            assert got is want
        else:
            assert isinstance(got, ca.CachedArray) and got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got), want)
        assert x.object._pins == 0
        m.check()


def test_the_common_call_runs_the_ufuncs(monkeypatch):
    refuse_general_path(monkeypatch, what="np.clip took the general path")
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        x = ca.asarray(np.arange(-5, 6, dtype=np.int16), manager=m)
        for lo, hi, want in ((0, 3, np.clip(np.arange(-5, 6), 0, 3)),
                             (None, 2, np.minimum(np.arange(-5, 6), 2)),
                             (-2, None, np.maximum(np.arange(-5, 6), -2)),
                             (-10**6, 10**6, np.arange(-5, 6))):
            got = np.clip(x, lo, hi)
            assert got.dtype == np.int16 and got.device == "fast"
            np.testing.assert_array_equal(np.asarray(got), want)
        m.check()
