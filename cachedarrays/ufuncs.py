"""NEP 13 dispatch: ufuncs on CachedArrays, and the arithmetic operators' shortcut.

A ufunc runs on pinned views of its inputs' current bytes and writes a policy-placed result in
place (``out=``), so no temporary ndarray is copied in. The common call (one manager, equal
shapes, scalars) takes a shortcut that the operators (``x + y``) call without NumPy's dispatch.
Importing this module installs both behind ``CachedArray.__array_ufunc__`` and the operators.
"""

import numbers

import numpy as np

from .array import (CachedArray, _PY_SCALARS, _SLOW, _acquire_grouped, _c_strides,
                    _first_manager, _new_object, _release_grouped, _wrap, new_pinned,
                    set_ufunc_handlers)

_HANDLED_TYPES = (np.ndarray, CachedArray, numbers.Number, np.generic, list, tuple, bool)


def _dtype_of(x):
    if isinstance(x, (CachedArray, np.ndarray, np.generic)):
        return x.dtype
    if isinstance(x, (bool, int, float, complex)):
        return type(x)
    return np.asarray(x).dtype


def _fast_call(ufunc, inputs):
    """The common case: one manager, equal shapes, scalars; result written in place via out=."""
    m = None
    shape = None
    objs = []
    key = [ufunc, "same_kind"]
    for x in inputs:
        tx = type(x)
        if tx is CachedArray:
            if m is None:
                m = x._m
                shape = x._shape
            elif x._m is not m or x._shape != shape:
                return _SLOW
            objs.append(x._obj)
            key.append(x._dtype)
        elif tx in _PY_SCALARS:
            key.append(tx)
        elif isinstance(x, np.generic):
            key.append(x.dtype)
        else:
            return _SLOW
    if not shape:
        return _SLOW
    key = tuple(key)
    dt = _RESOLVED.get(key)
    if dt is None:
        dt = _resolve(ufunc, inputs, "same_kind")
        if dt is None or dt.hasobject:
            return _SLOW
    n = dt.itemsize
    for d in shape:
        n *= d
    m.acquire(objs, (), ufunc.__name__)
    try:
        out = _new_object(m, n)
    except BaseException:
        m.release(objs)
        raise
    objs.append(out)
    try:
        res = CachedArray._make(out, m, shape, dt, _c_strides(shape, dt.itemsize), 0)
        ufunc(*[x._view() if type(x) is CachedArray else x for x in inputs],
              out=res._view())
        return res
    finally:
        m.release(objs)


def _array_ufunc(ufunc, method, inputs, kwargs):
    if method == "__call__" and not kwargs and ufunc.nout == 1 and ufunc.signature is None:
        res = _fast_call(ufunc, inputs)
        if res is not _SLOW:
            return res
    out = kwargs.pop("out", None)
    for x in inputs + (out or ()):
        if x is not None and not isinstance(x, _HANDLED_TYPES) and \
                hasattr(type(x), "__array_ufunc__"):
            return NotImplemented                # a foreign array type NumPy should try next
    reads = [x._obj for x in inputs if isinstance(x, CachedArray)]
    writes = [o._obj for o in (out or ()) if isinstance(o, CachedArray)]
    if method == "at" and isinstance(inputs[0], CachedArray):
        reads.remove(inputs[0]._obj)
        writes.append(inputs[0]._obj)
    m = _first_manager(inputs) or _first_manager(out or ())
    done = _acquire_grouped(reads, writes, getattr(ufunc, "__name__", "ufunc"))
    try:
        args = tuple(x._view() if isinstance(x, CachedArray) else x
                     for x in inputs)
        if out is not None:
            outs = tuple(o._view() if isinstance(o, CachedArray) else o for o in out)
            getattr(ufunc, method)(*args, out=outs, **kwargs)
            return out[0] if len(out) == 1 else out
        if method == "__call__" and ufunc.nout == 1 and ufunc.signature is None and \
                not (set(kwargs) - {"where", "casting", "order"}):
            shape = _broadcast_shape(args)
            if shape:
                dt = _resolve(ufunc, args, kwargs.get("casting", "same_kind"))
                if dt is not None and not dt.hasobject:
                    res = new_pinned(m, shape, dt)
                    done.append((m, [res._obj]))
                    if "where" in kwargs:
                        res._view().fill(0)
                    ufunc(*args, out=(res._view(),), **kwargs)
                    return res
        if ufunc is np.matmul and method == "__call__" and not kwargs:
            shape = _matmul_shape(args)
            dt = _resolve(ufunc, args, "same_kind") if shape else None
            if dt is not None and not dt.hasobject:
                res = new_pinned(m, shape, dt)
                done.append((m, [res._obj]))
                ufunc(*args, out=res._view())
                return res
        if method == "at":
            getattr(ufunc, method)(*args, **kwargs)
            return None
        res = getattr(ufunc, method)(*args, **kwargs)
        return _wrap(m, res, ())
    finally:
        _release_grouped(done)


def _matmul_shape(args):
    """Result shape of np.matmul on two arrays (None when it is a scalar or not computable)."""
    if len(args) != 2 or not all(isinstance(a, np.ndarray) and a.ndim for a in args):
        return None
    a, b = args
    if a.shape[-1] != (b.shape[0] if b.ndim == 1 else b.shape[-2]):
        return None                      # let NumPy raise its own error
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    shape = batch + (a.shape[-2:-1] if a.ndim > 1 else ()) + (b.shape[-1:] if b.ndim > 1 else ())
    return shape or None


def _broadcast_shape(args):
    shapes = [a.shape for a in args if isinstance(a, np.ndarray)]
    first = shapes[0]
    for s in shapes[1:]:
        if s != first:
            return np.broadcast_shapes(*shapes, *(np.shape(a) for a in args
                                                  if not isinstance(a, np.ndarray)))
    for a in args:
        if not isinstance(a, (np.ndarray, numbers.Number, np.generic)):
            return np.broadcast_shapes(first, np.shape(a))
    return first


_RESOLVED = {}


def _resolve(ufunc, args, casting):
    key = (ufunc, casting) + tuple(_dtype_of(a) for a in args)
    dt = _RESOLVED.get(key)
    if dt is None:
        try:
            dts = ufunc.resolve_dtypes(key[2:] + (None,), casting=casting)
            dt = dts[-1]
        except Exception:
            return None
        if len(_RESOLVED) < 4096:
            _RESOLVED[key] = dt
    return dt


set_ufunc_handlers(_array_ufunc, _fast_call)
