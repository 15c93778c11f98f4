"""Joining NumPy arrays: np.concatenate on CachedArrays.

The result is allocated by the policy first and NumPy writes into it (``out=``), so the joined
array is never built in ordinary memory and copied in.
"""

import numpy as np

from .._records import run_ufunc
from ..array import CachedArray, new_pinned, unpin
from ..dispatch import _call_on_views, implements
from ..layout import c_strides
from ..pinning import SHORT_BYTES, record_new


@implements(np.concatenate)
def concatenate(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    """np.concatenate writing straight into a policy-placed result (no extra copy)."""
    arrays = list(arrays)
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
    m = first._m
    if all(type(a) is CachedArray and a._m is m for a in arrays):
        # every input on one manager: one Manager.run pins them and places the result
        shape = tuple(shape)
        strides = c_strides(shape, dt.itemsize)
        n = dt.itemsize
        for d in shape:
            n *= d
        objs = tuple(a._obj for a in arrays)
        nbytes = n
        for o in objs:
            nbytes += o.nbytes
        short = nbytes <= SHORT_BYTES
        if len(arrays) <= 8:         # in C (run_ufunc) unless the manager is busy

            def fill(*views, out):
                return np.concatenate(views, axis=axis, out=out, dtype=dtype, casting=casting)
            res = run_ufunc(m, fill, tuple(arrays), objs, shape, dt, strides, n, short)
            if res is not None:
                return res

        def kernel(obj):
            record_new(obj)
            res = CachedArray._make(obj, m, shape, dt, strides, 0)
            np.concatenate([a._kview() for a in arrays], axis=axis, out=res._kview(),
                           dtype=dtype, casting=casting)
            return res
        return m.run(kernel, objs, (), n, "concatenate", short)
    res = new_pinned(first.manager, tuple(shape), dt)
    try:
        return _call_on_views(np.concatenate, (arrays,), dict(axis=axis, out=res,
                                                               dtype=dtype, casting=casting))
    finally:
        unpin(res)
