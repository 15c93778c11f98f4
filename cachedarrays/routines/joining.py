"""Joining NumPy arrays: np.concatenate, np.stack, np.vstack and np.hstack on CachedArrays.

The result is allocated by the policy first and NumPy writes into it (``out=``), so the joined
array is never built in ordinary memory and copied in.
"""

import numpy as np

from ..array import CachedArray, new_pinned, unpin
from ..dispatch import _call_on_views, implements
from ..layout import c_strides
from ._placed import into_new


@implements(np.concatenate)
def concatenate(arrays, /, axis=0, out=None, *, dtype=None, casting="same_kind"):
    """np.concatenate writing straight into a policy-placed result (no extra copy)."""
    if type(arrays) is not list and type(arrays) is not tuple and \
            (not hasattr(type(arrays), "__getitem__") or isinstance(arrays, dict)):
        raise TypeError("The first input argument needs to be a sequence")   # as NumPy
    arrays = list(arrays)
    if out is None and dtype is None and arrays:
        res = _joined(arrays, axis, casting)
        if res is not None:
            return res
    first = next((a for a in arrays if isinstance(a, CachedArray)), None)
    if out is not None or first is None or axis is None or not arrays:
        return _call_on_views(np.concatenate, (arrays,), dict(axis=axis, out=out, dtype=dtype,
                                                               casting=casting))
    shapes = [a._shape if type(a) is CachedArray else np.shape(a) for a in arrays]
    nd = len(shapes[0])
    if nd == 0 or any(len(s) != nd for s in shapes):
        return _call_on_views(np.concatenate, (arrays,), dict(axis=axis, dtype=dtype,
                                                               casting=casting))
    ax = axis + nd if axis < 0 else axis
    if not 0 <= ax < nd:
        return _call_on_views(np.concatenate, (arrays,), dict(axis=axis, dtype=dtype,
                                                               casting=casting))
    shape = list(shapes[0])
    shape[ax] = sum(s[ax] for s in shapes)
    dt = np.dtype(dtype) if dtype is not None else np.result_type(
        *[a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype for a in arrays])
    if not dt.itemsize or dt.hasobject or not all(_c_ordered(a) for a in arrays):
        # 'U', 'S': NumPy sizes the result from the inputs; objects (StringDType too): no
        # CachedArray holds them, NumPy's ndarray is the result; inputs in other orders: NumPy
        # chooses the result's order from theirs (F order for F order)
        return _call_on_views(np.concatenate, (arrays,), dict(axis=axis, dtype=dtype,
                                                               casting=casting))
    m = first._m
    # NumPy takes out= or dtype=, not both: out (of dtype dt) carries the dtype
    if all(type(a) is CachedArray and a._m is m for a in arrays):
        # every input on one manager: one step pins them and places the result

        def fill(*views, out):
            return np.concatenate(views, axis=axis, out=out, casting=casting)
        return into_new(m, fill, tuple(arrays), tuple(a._obj for a in arrays), tuple(shape), dt,
                        "concatenate")
    res = new_pinned(first.manager, tuple(shape), dt)
    try:
        return _call_on_views(np.concatenate, (arrays,), dict(axis=axis, out=res,
                                                               casting=casting))
    finally:
        unpin(res)


def _c_ordered(a):
    """True when NumPy's np.concatenate lays its result out in C order as far as a goes: a has
    at most one axis or is C-contiguous (a list or a scalar becomes a C-ordered array)."""
    if isinstance(a, CachedArray):
        return len(a._shape) <= 1 or a._strides == c_strides(a._shape, a._dtype.itemsize)
    if isinstance(a, np.ndarray):
        return a.ndim <= 1 or a.flags.c_contiguous
    return True


def _joined(arrays, axis, casting):
    """The common np.concatenate: CachedArrays of one manager and one native built-in dtype,
    of one rank, joined along an int axis into a new array. Its checks in one loop
    (the general path took 4.8 us more than NumPy's call at 10 elements); None when the call
    is not of that kind."""
    first = arrays[0]
    if type(first) is not CachedArray or type(axis) is not int:
        return None
    m, dt, shape = first._m, first._dtype, first._shape
    nd = len(shape)
    ax = axis + nd if axis < 0 else axis
    if not 0 <= ax < nd or dt.isbuiltin != 1:    # NumPy's result dtype is dt itself
        return None
    total = 0
    for a in arrays:
        if type(a) is not CachedArray or a._m is not m or a._dtype != dt or len(a._shape) != nd:
            return None
        total += a._shape[ax]
    if nd > 1 and not all(_c_ordered(a) for a in arrays):
        return None                     # NumPy chooses the order from the inputs' orders
    objs = tuple([a._obj for a in arrays])

    def fill(*views, out):
        return np.concatenate(views, axis=ax, out=out, casting=casting)
    return into_new(m, fill, tuple(arrays), objs, shape[:ax] + (total,) + shape[ax + 1:], dt,
                    "concatenate")


def _alike(arrays):
    """(manager, dtype, shapes) when arrays is a non-empty list or tuple of CachedArrays of one
    manager and one native built-in dtype (NumPy's result dtype is then that dtype), C-ordered
    where they have more than one axis; else None."""
    if (type(arrays) is not list and type(arrays) is not tuple) or not arrays:
        return None
    first = arrays[0]
    if type(first) is not CachedArray:
        return None
    m, dt = first._m, first._dtype
    if dt.isbuiltin != 1:
        return None
    for a in arrays:
        if type(a) is not CachedArray or a._m is not m or a._dtype != dt or not _c_ordered(a):
            return None
    return m, dt, [a._shape for a in arrays]


def _joined_along(arrays, shapes, ax, m, dt, name, expand):
    """The new array of ``np.concatenate([expand(a) for a in arrays], axis=ax)`` given the
    expanded shapes (equal but along ax), filled in one step; None when they do not fit (NumPy
    then raises its own error)."""
    nd = len(shapes[0])
    if not 0 <= ax < nd or any(len(s) != nd for s in shapes):
        return None
    rest = shapes[0][:ax] + shapes[0][ax + 1:]
    if any(s[:ax] + s[ax + 1:] != rest for s in shapes):
        return None
    shape = shapes[0][:ax] + (sum(s[ax] for s in shapes),) + shapes[0][ax + 1:]

    def fill(*views, out):
        return np.concatenate([expand(v) for v in views], axis=ax, out=out)
    return into_new(m, fill, tuple(arrays), tuple(a._obj for a in arrays), shape, dt, name)


@implements(np.stack)
def stack(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    """np.stack writing straight into a policy-placed result (no extra copy)."""
    common = _alike(arrays) if out is None and dtype is None and type(axis) is int and \
        casting == "same_kind" else None
    if common is not None:
        m, dt, shapes = common
        nd = len(shapes[0])
        ax = axis + nd + 1 if axis < 0 else axis
        if 0 <= ax <= nd and all(s == shapes[0] for s in shapes):
            key = (slice(None),) * ax + (None,)
            res = _joined_along(arrays, [s[:ax] + (1,) + s[ax:] for s in shapes], ax, m, dt,
                                "stack", lambda v: v[key])
            if res is not None:
                return res
    return _call_on_views(np.stack, (arrays,), dict(axis=axis, out=out, dtype=dtype,
                                                     casting=casting))


def _at_least(shape, n):
    """The shape np.atleast_1d (n = 1) or np.atleast_2d (n = 2) gives an array of shape."""
    if len(shape) >= n:
        return shape
    return (1,) * (n - len(shape)) + shape if n == 1 or len(shape) == 0 else (1,) + shape


@implements(np.vstack)
def vstack(tup, *, dtype=None, casting="same_kind"):
    """np.vstack writing straight into a policy-placed result (no extra copy)."""
    common = _alike(tup) if dtype is None and casting == "same_kind" else None
    if common is not None:
        m, dt, shapes = common
        res = _joined_along(tup, [_at_least(s, 2) for s in shapes], 0, m, dt, "vstack",
                            np.atleast_2d)
        if res is not None:
            return res
    return _call_on_views(np.vstack, (tup,), dict(dtype=dtype, casting=casting))


@implements(np.hstack)
def hstack(tup, *, dtype=None, casting="same_kind"):
    """np.hstack writing straight into a policy-placed result (no extra copy)."""
    common = _alike(tup) if dtype is None and casting == "same_kind" else None
    if common is not None:
        m, dt, shapes = common
        shapes = [_at_least(s, 1) for s in shapes]
        res = _joined_along(tup, shapes, 0 if len(shapes[0]) == 1 else 1, m, dt, "hstack",
                            np.atleast_1d)
        if res is not None:
            return res
    return _call_on_views(np.hstack, (tup,), dict(dtype=dtype, casting=casting))
