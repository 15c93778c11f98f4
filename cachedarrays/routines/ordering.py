"""Sorting and running totals on CachedArrays: np.sort, np.cumsum and np.cumprod.

The result is allocated by the policy first and NumPy writes into it (np.sort copies and sorts
in place, as NumPy's own np.sort does; the running totals take ``out=``), so the result is
never built in ordinary memory and copied in.
"""

import functools

import numpy as np

from ..array import CachedArray
from ..dispatch import _call_on_views, implements
from ..layout import c_strides
from ._placed import into_new


def _sorted_into(axis, kind, order, stable, src, out):
    """np.sort(src) written into out: a copy, sorted in place."""
    np.copyto(out, src, casting="no")
    out.sort(axis=axis, kind=kind, order=order, stable=stable)


@implements(np.sort)
def sort(a, axis=-1, kind=None, order=None, *, stable=None):
    """np.sort into a policy-placed copy of a C-contiguous array (other layouts: the general
    path, which keeps NumPy's layout of the copy)."""
    if type(a) is not CachedArray or axis is None or not a._shape or \
            a._strides != c_strides(a._shape, a._dtype.itemsize):
        return _call_on_views(np.sort, (a,), dict(axis=axis, kind=kind, order=order,
                                                   stable=stable))
    return into_new(a._m, functools.partial(_sorted_into, axis, kind, order, stable), (a,),
                    (a._obj,), a._shape, a._dtype, "sort")


_ACC_DTYPES = {}       # (ufunc, input dtype, dtype argument) -> the running total's dtype


def _plain(dtype):
    """False for a dtype object with metadata (it compares equal to the one without)."""
    return not isinstance(dtype, np.dtype) or dtype.metadata is None


def _accumulated(func, ufunc, a, axis, dtype, out):
    if type(a) is not CachedArray or out is not None or not a._shape or a._dtype.hasobject:
        return _call_on_views(func, (a,), dict(axis=axis, dtype=dtype, out=out))
    # (no entry for a dtype with metadata: it equals the one without, and NumPy's total keeps it)
    key = (ufunc, a._dtype, dtype) if _plain(a._dtype) and _plain(dtype) else None
    try:
        dt = _ACC_DTYPES.get(key) if key is not None else None
    except TypeError:                   # an unhashable spelling of a dtype (a list of fields)
        key = dt = None
    if dt is None:
        try:
            dt = func(np.zeros(1, a._dtype), dtype=dtype).dtype
        except (TypeError, ValueError):
            return _call_on_views(func, (a,), dict(axis=axis, dtype=dtype, out=out))
        if key is not None and len(_ACC_DTYPES) < 1024:
            _ACC_DTYPES[key] = dt
    if dt.hasobject:
        return _call_on_views(func, (a,), dict(axis=axis, dtype=dtype, out=out))
    if axis is None:
        n = 1
        for d in a._shape:
            n *= d
        shape = (n,)
    else:
        shape = a._shape
        try:
            _check_axis(axis, len(shape))
        except ValueError:
            return _call_on_views(func, (a,), dict(axis=axis, dtype=dtype, out=out))
        if len(shape) > 1 and a._strides != c_strides(shape, a._dtype.itemsize):
            # NumPy lays the result out as the input (F order for F order): its own call
            return _call_on_views(func, (a,), dict(axis=axis, dtype=dtype, out=out))
    # the ndarray method np.cumsum itself ends in, without its Python frames
    method = np.ndarray.cumsum if func is np.cumsum else np.ndarray.cumprod
    return into_new(a._m, functools.partial(method, axis=axis, dtype=dtype), (a,), (a._obj,),
                    shape, dt, func.__name__)


def _check_axis(axis, ndim):
    axis = int(axis) if isinstance(axis, (int, np.integer)) and not isinstance(axis, bool) \
        else None
    if axis is None or not -ndim <= axis < ndim:
        raise ValueError("axis out of range")


@implements(np.cumsum)
def cumsum(a, axis=None, dtype=None, out=None):
    """np.cumsum writing straight into a policy-placed result (out=)."""
    return _accumulated(np.cumsum, np.add, a, axis, dtype, out)


@implements(np.cumprod)
def cumprod(a, axis=None, dtype=None, out=None):
    """np.cumprod writing straight into a policy-placed result (out=)."""
    return _accumulated(np.cumprod, np.multiply, a, axis, dtype, out)
