"""Picking elements: np.where(condition, x, y) and np.take(x, indices, axis=0) on CachedArrays.

The result is allocated by the policy first and filled by a branch-free select in C
(``cachedarrays._records.select``, native/select.c), so it is never built in ordinary memory
and copied in, and its time does not depend on the pattern of the condition (NumPy's own loop
branches per element, which costs several times more on an unpredictable mask). The result's dtype and the value of a scalar
operand come from NumPy itself (np.where on two elements), with its promotion rules, errors and
warnings. Other forms (one argument, broadcasting, casts, non-contiguous operands, object dtypes)
take the general path.
"""

import numpy as np

from .._records import select
from ..array import CachedArray
from ..dispatch import _call_on_views, implements
from ..layout import c_strides
from ._placed import into_new

_PICK = np.array([True, False])     # the probe's condition: x's value first, then y's
_ONE = {}                           # dtype -> a one-element array of it (probe operands)
_RESULT = {}                        # (x dtype, y dtype) of two arrays -> the result's dtype
_BOOL = np.dtype(np.bool_)
_SCALARS = (int, float, complex, bool)


def _operand(v, shape):
    """(step, dtype) of an operand: an array of the result's shape in C order (step 1, its
    dtype), a scalar or 0-d array (step 0, None); None for the general path."""
    t = type(v)
    if t is CachedArray:
        if v._shape == shape and v._strides == c_strides(shape, v._dtype.itemsize):
            return 1, v._dtype
        return None
    if t is np.ndarray:
        if not v.ndim:
            return 0, None
        if v.shape == shape and v.flags.c_contiguous:
            return 1, v.dtype
        return None
    if t in _SCALARS or isinstance(v, np.generic):
        return 0, None
    return None


def _one(dt):
    one = _ONE.get(dt)
    if one is None:
        one = np.zeros(1, dt)
        if len(_ONE) < 256:
            _ONE[dt] = one
    return one


@implements(np.where)
def where(condition, *xy):
    """np.where(condition, x, y) into a policy-placed result with a branch-free select."""
    if len(xy) != 2:
        return _call_on_views(np.where, (condition, *xy), {})
    x, y = xy
    ox = oy = m = None
    t = type(condition)
    if t is CachedArray:
        shape = condition._shape
        if condition._dtype is _BOOL and shape and \
                condition._strides == c_strides(shape, 1):
            m = condition._m
    elif t is np.ndarray:
        shape = condition.shape
        if condition.dtype is _BOOL and shape and condition.flags.c_contiguous:
            m = False
    if m is not None:
        ox = _operand(x, shape)
        if ox is not None:
            oy = _operand(y, shape)
    reads = []
    if oy is not None:
        for a in (condition, x, y):
            if type(a) is CachedArray:
                if not m:
                    m = a._m
                elif a._m is not m:
                    m = None
                    break
                reads.append(a._obj)
    if oy is None or not m:
        return _call_on_views(np.where, (condition, *xy), {})
    (xs, xdt), (ys, ydt) = ox, oy
    if xs and ys:
        dt = _RESULT.get((xdt, ydt))
        if dt is None:
            dt = np.where(_PICK, _one(xdt), _one(ydt)).dtype
            if len(_RESULT) < 1024:
                _RESULT[(xdt, ydt)] = dt
    else:   # NumPy's promotion and its casts of the scalars (errors and warnings included)
        picked = np.where(_PICK, _one(xdt) if xs else x, _one(ydt) if ys else y)
        dt = picked.dtype
        if not xs:
            x = picked[:1]
        if not ys:
            y = picked[1:]
    if dt.hasobject or not dt.itemsize or (xs and xdt != dt) or (ys and ydt != dt):
        return _call_on_views(np.where, (condition, *xy), {})
    return into_new(m, select, (condition, x, y), tuple(reads), shape, dt, "where")


@implements(np.take)
def take(a, indices, axis=None, out=None, mode="raise"):
    """np.take(a, indices, axis=0) of a CachedArray with an integer ndarray of indices in
    range: the rows gathered into a policy-placed result (``CachedArray._gathered``, as
    ``a[indices]``); every other call as NumPy makes it."""
    if type(a) is CachedArray and type(indices) is np.ndarray and type(axis) is int and \
            axis == 0 and out is None and mode == "raise" and a._shape:
        res = a._gathered(indices)
        if res is not None:
            return res
    return _call_on_views(np.take, (a, indices), dict(axis=axis, out=out, mode=mode))
