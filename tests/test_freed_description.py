"""A freed array (ca.unsafe_free, or its manager closed) keeps its description and nothing else.

Its shape, dtype and sizes stay readable, by attribute (x.shape, len(x)) and by NumPy's
functions of them (np.shape, np.ndim, np.size), which always agree; every other use, making a
new array like it (np.zeros_like(x), ca.empty_like(x), np.zeros(3, like=x)) or a view of it
included, raises UseAfterFreeError.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays.errors import UseAfterFreeError

# uses that make a new array from x (its description, its manager) or a view of it
_MAKERS = {
    "np.empty_like": lambda x: np.empty_like(x), "np.zeros_like": lambda x: np.zeros_like(x),
    "np.ones_like": lambda x: np.ones_like(x), "np.full_like": lambda x: np.full_like(x, 2),
    "np.zeros_like dtype": lambda x: np.zeros_like(x, dtype="i4"),
    "np.empty_like prototype=": lambda x: np.empty_like(prototype=x),
    "np.zeros_like object": lambda x: np.zeros_like(x, dtype=object),
    "np.zeros_like shape": lambda x: np.zeros_like(x, shape=(2,)),
    "ca.empty_like": lambda x: ca.empty_like(x), "ca.zeros_like": lambda x: ca.zeros_like(x),
    "ca.ones_like": lambda x: ca.ones_like(x), "ca.full_like": lambda x: ca.full_like(x, 1),
    "np.zeros like=": lambda x: np.zeros(3, like=x), "np.empty like=": lambda x: np.empty(3, like=x),
    "np.ones like=": lambda x: np.ones(3, like=x), "np.full like=": lambda x: np.full(3, 1, like=x),
    "np.full like= object": lambda x: np.full(3, None, like=x),
    "np.arange like=": lambda x: np.arange(3, like=x), "np.eye like=": lambda x: np.eye(2, like=x),
    "np.array like=": lambda x: np.array([1, 2], like=x),
    "np.asarray like=": lambda x: np.asarray([1, 2], like=x),
    "x.view()": lambda x: x.view(), "x.flat": lambda x: x.flat, "x.T": lambda x: x.T,
    "x[...]": lambda x: x[...], "np.shares_memory": lambda x: np.shares_memory(x, x),
}
# the description: (name, f(x)) read from the attributes and NumPy's functions of them
_DESCRIPTION = {
    "shape": lambda x: x.shape, "dtype": lambda x: x.dtype, "ndim": lambda x: x.ndim,
    "size": lambda x: x.size, "nbytes": lambda x: x.nbytes, "itemsize": lambda x: x.itemsize,
    "strides": lambda x: x.strides, "np.shape": lambda x: np.shape(x),
    "np.ndim": lambda x: np.ndim(x), "np.size": lambda x: np.size(x),
    "np.size axis": lambda x: np.size(x, 0) if x.ndim else np.size(x),
    "np.size last axis": lambda x: np.size(x, -1) if x.ndim else np.size(x),
    "len": lambda x: len(x) if x.ndim else None,
}


def _free(how, m, x):
    if how == "unsafe_free":
        ca.unsafe_free(x)
    else:
        m.close()


@settings(max_examples=60, deadline=None)
@given(how=st.sampled_from(["unsafe_free", "close"]), use=st.sampled_from(sorted(_MAKERS)),
       shape=st.sampled_from([(), (3,), (2, 3), (0, 4)]), fortran=st.booleans())
def test_making_an_array_like_a_freed_array_raises_use_after_free(how, use, shape, fortran):
    m = ca.Manager(fast="1MiB", slow="8MiB")
    try:
        x = ca.asarray(np.zeros(shape, order="F" if fortran else "C"), manager=m)
        _MAKERS[use](x)                          # works while x lives
        _free(how, m, x)
        with pytest.raises(UseAfterFreeError, match="freed|closed"):
            _MAKERS[use](x)
    finally:
        m.close()


@settings(max_examples=40, deadline=None)
@given(how=st.sampled_from(["unsafe_free", "close"]),
       shape=st.sampled_from([(), (3,), (2, 3), (0, 4), (1, 2, 5)]),
       dtype=st.sampled_from(["f8", "i2", "c16", "U3", "i4,f8"]))
def test_a_freed_array_keeps_its_description_and_numpy_functions_agree(how, shape, dtype):
    m = ca.Manager(fast="1MiB", slow="8MiB")
    try:
        x = ca.zeros(shape, dtype, manager=m)
        plain = np.zeros(shape, dtype)
        before = {k: f(x) for k, f in _DESCRIPTION.items()}
        assert before == {k: f(plain) for k, f in _DESCRIPTION.items()}
        _free(how, m, x)
        assert {k: f(x) for k, f in _DESCRIPTION.items()} == before
        state = "freed" if how == "unsafe_free" else "freed: its manager is closed"
        assert repr(x) == f"CachedArray(<{state}>, shape={x.shape}, dtype={x.dtype})"
        with pytest.raises(UseAfterFreeError):
            np.asarray(x)
    finally:
        m.close()


def test_np_size_of_a_freed_array_gives_numpys_axis_error(m):
    x = ca.zeros((2, 3), manager=m)
    ca.unsafe_free(x)
    with pytest.raises(np.exceptions.AxisError):
        np.size(x, 2)
