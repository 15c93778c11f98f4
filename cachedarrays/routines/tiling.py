"""np.roll, np.tile and np.outer of CachedArrays: the result is placed by the policy and filled in
place (slice and broadcast assignments; np.outer through the multiply ufunc's outer method),
instead of being built in ordinary memory and copied in. Other forms take NumPy's path.
(np.repeat keeps it: a broadcast assignment repeating each element a few times ran slower than
NumPy's own loop plus the copy.)"""

import functools
import operator

import numpy as np

from .. import dispatch
from ..array import CachedArray
from ..dispatch import implements
from ..layout import c_strides
from ._placed import into_new


def _plain(a):
    """True for a C-contiguous CachedArray of a native built-in dtype (NumPy's result then is
    a C-order array of that dtype)."""
    return type(a) is CachedArray and a._dtype.isbuiltin == 1 and \
        a._strides == c_strides(a._shape, a._dtype.itemsize)


def _count(v):
    """v as an int if it is a Python or NumPy integer (not a bool), else None."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        return None
    return operator.index(v)


def _rolled_into(shift, axis, v, out):
    if axis is None:
        v, out = v.reshape(-1), out.reshape(-1)
        axis = 0
    n = v.shape[axis]
    s = shift % n
    head = (slice(None),) * axis
    out[head + (slice(s, None),)] = v[head + (slice(None, n - s),)]
    out[head + (slice(None, s),)] = v[head + (slice(n - s, None),)]


@implements(np.roll)
def roll(a, shift, axis=None):
    """np.roll(a, int shift[, int axis]) of a C-ordered array into a placed result."""
    k = _count(shift)
    if k is not None and _plain(a) and a._shape and 0 not in a._shape and \
            (axis is None or _count(axis) is not None):
        ax = None if axis is None else _count(axis)
        nd = len(a._shape)
        if ax is None or -nd <= ax < nd:
            ax = None if ax is None else ax % nd
            return into_new(a._m, functools.partial(_rolled_into, k, ax), (a,), (a._obj,),
                            a._shape, a._dtype, "roll")
    return dispatch._call_on_views(np.roll, (a, shift), dict(axis=axis))


def _tiled_into(shape, reps, v, out):
    inter = tuple(d for t, s in zip(reps, shape) for d in (t, s))
    src = v.reshape(tuple(d for s in shape for d in (1, s)))
    out.reshape(inter)[...] = src


@implements(np.tile)
def tile(A, reps):
    """np.tile(A, reps) of a C-ordered array with whole reps >= 0 into a placed result."""
    tup = reps if type(reps) is tuple else (reps,) if _count(reps) is not None else None
    if tup is not None and _plain(A):
        counts = [_count(t) for t in tup]
        if all(c is not None and c >= 0 for c in counts):
            nd = max(len(counts), len(A._shape))
            shape = (1,) * (nd - len(A._shape)) + A._shape
            counts = [1] * (nd - len(counts)) + counts
            out_shape = tuple(s * t for s, t in zip(shape, counts))
            return into_new(A._m, functools.partial(_tiled_into, shape, counts), (A,),
                            (A._obj,), out_shape, A._dtype, "tile")
    return dispatch._call_on_views(np.tile, (A, reps), {})


@implements(np.outer)
def outer(a, b, out=None):
    """np.outer of two CachedArrays of one manager: the multiply ufunc's outer method on their
    raveled arrays, as NumPy computes it, whose result is placed as a ufunc's is."""
    if out is None and type(a) is CachedArray and type(b) is CachedArray and a._m is b._m:
        return np.multiply.outer(a if len(a._shape) == 1 else a.ravel(),
                                 b if len(b._shape) == 1 else b.ravel())
    return dispatch._call_on_views(np.outer, (a, b), dict(out=out))
