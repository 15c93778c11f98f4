"""np.round, np.around and np.diff of CachedArrays, whose results NumPy can write through out=:
the result is placed by the policy and filled in place, instead of being built in ordinary
memory and copied in. Other forms of these calls take NumPy's path."""

import functools

import numpy as np

from .. import dispatch
from ..array import CachedArray
from ..dispatch import implements
from ..layout import c_strides
from ._placed import into_new

#: Kinds whose round keeps the dtype and whose diff is a subtraction of that dtype.
_NUMERIC = frozenset("fciu")


def _plain_c(a):
    """True for a C-contiguous CachedArray of a native built-in numeric dtype with axes: NumPy
    lays an element-wise result of it out in C order, in its dtype."""
    return type(a) is CachedArray and a._shape != () and a._dtype.isbuiltin == 1 and \
        a._dtype.kind in _NUMERIC and a._strides == c_strides(a._shape, a._dtype.itemsize)


def _rounded_into(decimals, v, out):
    np.round(v, decimals, out=out)


def _rounding(func):
    def rounded(a, decimals=0, out=None):
        # (an integer array rounded to tens or more: NumPy computes in floating point and
        # cannot write that through out= of the array's dtype, so it takes NumPy's path)
        if out is None and type(decimals) is int and _plain_c(a) and \
                (decimals >= 0 or a._dtype.kind in "fc"):
            return into_new(a._m, functools.partial(_rounded_into, decimals), (a,), (a._obj,),
                            a._shape, a._dtype, "round")
        return dispatch._call_on_views(func, (a,), dict(decimals=decimals, out=out))
    rounded.__name__ = func.__name__
    rounded.__doc__ = f"np.{func.__name__} into a policy-placed result (no extra copy)."
    return rounded


implements(np.round)(_rounding(np.round))
implements(np.around)(_rounding(np.around))


def _differenced_into(axis, n, v, out):
    lo = [slice(None)] * v.ndim
    hi = [slice(None)] * v.ndim
    lo[axis], hi[axis] = slice(None, n - 1), slice(1, None)
    np.subtract(v[tuple(hi)], v[tuple(lo)], out=out)


@implements(np.diff)
def diff(a, n=1, axis=-1, *args, **kwargs):
    """np.diff(a) and np.diff(a, 1, axis) of a C-ordered numeric array: one subtraction into a
    policy-placed result; every other call (n > 1, prepend=, append=, bool) as NumPy makes it."""
    if not args and not kwargs and type(n) is int and n == 1 and type(axis) is int and \
            _plain_c(a):
        nd = len(a._shape)
        ax = axis + nd if axis < 0 else axis
        if 0 <= ax < nd and a._shape[ax] > 0:
            shape = a._shape[:ax] + (a._shape[ax] - 1,) + a._shape[ax + 1:]
            return into_new(a._m, functools.partial(_differenced_into, ax, a._shape[ax]), (a,),
                            (a._obj,), shape, a._dtype, "diff")
    return dispatch._call_on_views(np.diff, (a, n, axis, *args), kwargs)
