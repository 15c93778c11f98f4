"""Empty arrays are laid out as NumPy lays them out, and their views stay views.

An array with an axis of length 0 holds no bytes, so NumPy is free to pick its strides: a new
one (np.zeros((0, 4)), a ufunc result, a copy) gets zero strides in NumPy 2, while a view keeps
the strides of what it views (np.zeros((3, 4))[:0]). Code that compares strides, or keys a cache
on them, sees the same tuples for a CachedArray as for NumPy. A view of an empty array (x.T,
x[None], np.swapaxes(x, 0, 1), x.real) is a view of the same object, as for a non-empty one: it
is freed with it.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays.errors import UseAfterFreeError


def _new(mod, shape, dtype, order, m):
    kw = {"manager": m} if mod is ca else {}
    return mod.zeros(shape, dtype, order=order, **kw)


# name -> f(x): results NumPy makes as new arrays
_NEW = {
    "zeros": lambda x: x,
    "copy": lambda x: x.copy(),
    "copy F": lambda x: x.copy(order="F"),
    "astype": lambda x: x.astype(np.complex64),
    "add": lambda x: x + 1,
    "negative": lambda x: -x,
    "sum": lambda x: x.sum(axis=0, keepdims=True),
    "cumsum": lambda x: np.cumsum(x, axis=-1),
    "sort": lambda x: np.sort(x, axis=-1),
    "where": lambda x: np.where(x > 0, x, 2),
    "concatenate": lambda x: np.concatenate([x, x]),
    "stack": lambda x: np.stack([x, x]),
    "zeros_like": lambda x: np.zeros_like(x),
    "empty_like": lambda x: np.empty_like(x),
    "full_like": lambda x: np.full_like(x, 3),
    "take": lambda x: np.take(x, [], axis=0),
    "fancy": lambda x: x[np.zeros(x.shape, bool)],
    "flatten": lambda x: x.flatten(),
}

# name -> f(x): results NumPy makes as views of x
_VIEWS = {
    "T": lambda x: x.T,
    "slice": lambda x: x[:0],
    "reversed": lambda x: x[::-1],
    "newaxis": lambda x: x[None],
    "ellipsis": lambda x: x[..., None],
    "reshape": lambda x: x.reshape(x.shape[::-1]),
    "ravel": lambda x: x.ravel(),
    "view": lambda x: x.view(),
    "real": lambda x: x.real,
    "swapaxes": lambda x: np.swapaxes(x, 0, -1),
    "moveaxis": lambda x: np.moveaxis(x, 0, -1),
    "expand_dims": lambda x: np.expand_dims(x, 0),
    "broadcast_to": lambda x: np.broadcast_to(x, (2,) + x.shape),
    "flip": lambda x: np.flip(x),
    "atleast_3d": lambda x: np.atleast_3d(x),
    "squeeze": lambda x: np.squeeze(x),
    "transpose": lambda x: np.transpose(x),
}

_shapes = st.lists(st.integers(0, 3), min_size=1, max_size=3).filter(lambda s: 0 in s) \
    .map(tuple)


def _layout(a):
    return a.shape, a.strides, a.flags.c_contiguous, a.flags.f_contiguous


@settings(max_examples=150, deadline=None)
@given(shape=_shapes, dtype=st.sampled_from(["f8", "i2", "c16", "u1"]),
       order=st.sampled_from("CF"), name=st.sampled_from(sorted(_NEW) + sorted(_VIEWS)))
def test_an_empty_array_and_its_results_have_numpys_strides_and_flags(shape, dtype, order,
                                                                       name):
    f = _NEW.get(name) or _VIEWS[name]
    with ca.Manager(fast="1MiB", slow="8MiB") as m:
        x, n = _new(ca, shape, dtype, order, m), _new(np, shape, dtype, order, m)
        assert _layout(x) == _layout(n)
        got, want = f(x), f(n)
        assert isinstance(got, ca.CachedArray)
        assert _layout(got) == _layout(want)
        assert np.shares_memory(got, x) is np.shares_memory(want, n) is False


@settings(max_examples=80, deadline=None)
@given(shape=_shapes, name=st.sampled_from(sorted(_VIEWS)), first=st.booleans())
def test_a_view_of_an_empty_array_is_a_view_of_its_object(shape, name, first):
    with ca.Manager(fast="1MiB", slow="8MiB") as m:
        base = ca.zeros((3,) + shape, manager=m) if first else ca.zeros(shape, manager=m)
        x = base[1] if first else base
        y = _VIEWS[name](x)
        assert y.object is base.object, name
        ca.unsafe_free(base)                      # a view is freed with its array
        with pytest.raises(UseAfterFreeError):
            np.asarray(y)



@pytest.mark.parametrize("layout", ["new", "transposed", "reshaped"])
def test_a_kernel_writing_a_whole_empty_array_can_have_it_dropped(layout):
    # a write through any view of an empty array replaces all of it (there is nothing else)
    with ca.Manager(fast="1MiB", slow="8MiB") as m:
        x = ca.zeros((0, 4, 2), manager=m)
        b = {"new": lambda: ca.empty_like(x),
             "transposed": lambda: ca.zeros((4, 0, 2), manager=m).transpose(1, 0, 2),
             "reshaped": lambda: ca.zeros((4, 2, 0), manager=m).reshape(0, 4, 2)}[layout]()
        ca.compute("negate", lambda a, o: np.negative(a, out=o), [x], [b])
        ca.drop(b)
        assert np.asarray(b).shape == (0, 4, 2)
        m.check()
