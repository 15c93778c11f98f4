"""NEP 13 dispatch: ufuncs on CachedArrays, and the arithmetic operators' shortcut.

A ufunc runs on pinned views of its inputs' current bytes and writes a policy-placed result in
place (``out=``), so no temporary ndarray is copied in. The common call (one manager, equal
shapes, scalars) takes a shortcut that the operators (``x + y``) call without NumPy's dispatch.
Importing this module installs both behind ``CachedArray.__array_ufunc__`` and the operators.
"""

import numbers

import numpy as np

from ._records import bind_plans as _bind_plans
from ._records import array_ufunc as _c_array_ufunc
from ._records import run_ufunc as _run_ufunc
from .array import _PY_SCALARS, _SLOW, CachedArray, new_filled, new_pinned, set_ufunc_handlers
from .heap import HEADER
from .layout import c_strides, like_order
from .pinning import (OPEN_SCOPES, SHORT_BYTES, acquire_grouped, first_manager, record_new,
                      release_grouped)
from .wrapping import wrap

_new = object.__new__
_HANDLED_TYPES = (np.ndarray, CachedArray, numbers.Number, np.generic, list, tuple, bool)


def _dtype_of(x):
    if isinstance(x, (CachedArray, np.ndarray, np.generic)):
        return x.dtype
    if isinstance(x, (bool, int, float, complex)):
        return type(x)
    return np.asarray(x).dtype


def _fast_call(ufunc, inputs, out=None):
    """The common case: one manager, equal shapes, scalars; the result (or out, a CachedArray
    of the same shape) written in place via out=."""
    if out is None and len(inputs) == 2:
        a, b = inputs
        ta, tb = type(a), type(b)
        if ta is CachedArray:
            if tb is CachedArray:
                m = a._m
                shape = a._shape
                da, db = a._dtype, b._dtype
                if b._m is not m or b._shape != shape or da.metadata is not None or \
                        db.metadata is not None:
                    return _SLOW
                plan = _PLANS.get((ufunc, da, db))
                objs = (a._obj, b._obj)
            elif tb in _PY_SCALARS:
                m = a._m
                shape = a._shape
                da = a._dtype
                if da.metadata is not None:
                    return _SLOW
                plan = _PLANS.get((ufunc, da, tb))
                objs = (a._obj,)
            else:
                return _fast_general(ufunc, inputs, out)
        elif tb is CachedArray and ta in _PY_SCALARS:
            m = b._m
            shape = b._shape
            db = b._dtype
            if db.metadata is not None:
                return _SLOW
            plan = _PLANS.get((ufunc, ta, db))
            objs = (b._obj,)
        else:
            return _fast_general(ufunc, inputs, out)
    elif out is None and len(inputs) == 1 and type(inputs[0]) is CachedArray:
        a = inputs[0]
        m = a._m
        shape = a._shape
        da = a._dtype
        if da.metadata is not None:
            return _SLOW
        plan = _PLANS.get((ufunc, da))
        objs = (a._obj,)
    else:
        return _fast_general(ufunc, inputs, out)
    if plan is None:
        plan = _plan(ufunc, inputs)
    if not plan or not shape:
        return _SLOW
    return _new_result(ufunc, inputs, m, shape, plan, objs)


def _new_result(ufunc, inputs, m, shape, plan, objs):
    """Run ufunc(*inputs) into a new, policy-placed CachedArray (Manager.run): in C
    (``run_ufunc``) unless the manager is busy, else through Manager.run with the same kernel."""
    if len(shape) > 1 and _f_ordered(inputs):
        return _SLOW                               # NumPy lays the result out in F order
    dt, itemsize, name, layouts = plan
    lay = layouts.get(shape)
    if lay is None:
        lay = _layout(layouts, shape, itemsize)
    strides, n = lay
    short = n <= SHORT_BYTES
    res = _run_ufunc(m, ufunc, inputs, objs, shape, dt, strides, n, short)   # in C
    if res is not None:
        return res

    def kernel(obj):                               # the same, while the manager is busy
        if OPEN_SCOPES[0]:
            record_new(obj)
        res = _new(CachedArray)                    # CachedArray._make, inlined
        res._obj, res._m, res._shape, res._dtype = obj, m, shape, dt
        res._strides, res._offset, res._base = strides, 0, None
        r = obj.primary
        buf = r._buffer
        if buf is not None:                        # ObjectView._kview, inlined
            view = np.ndarray(shape, dt, buf, r.offset + HEADER, strides)
            res._vc = (r, r.offset, view)
        else:
            res._vc = None
            view = res._kview()
        if len(inputs) == 2:
            a, b = inputs
            if type(a) is CachedArray:             # a._kview(), inlined
                r = a._obj.primary
                c = a._vc
                a = c[2] if c is not None and c[0] is r and c[1] == r.offset else a._kview()
            if type(b) is CachedArray:
                r = b._obj.primary
                c = b._vc
                b = c[2] if c is not None and c[0] is r and c[1] == r.offset else b._kview()
            ufunc(a, b, out=view)
        else:
            ufunc(*[x._kview() if type(x) is CachedArray else x for x in inputs], out=view)
        return res
    return m.run(kernel, objs, (), n, name, short)


def _f_ordered(inputs):
    """True when NumPy's order="K" layout of every CachedArray among inputs is F order only
    (see _result_order)."""
    return all(x._strides != c_strides(x._shape, x._dtype.itemsize) and
               like_order(x._shape, x._strides, x._dtype.itemsize) == "F"
               for x in inputs if type(x) is CachedArray)


# (ufunc, operand dtypes or scalar types) -> (result dtype, itemsize, name, {shape: (strides,
# nbytes)}), or False when the shortcut does not apply. A dtype with metadata equals the same
# dtype without it, so such operands never look up or add a plan (the general path serves them).
_PLANS = {}


def _plan(ufunc, inputs):
    """The result dtype of ufunc on inputs' kinds, cached (False: not for the shortcut)."""
    key = (ufunc,) + tuple(x._dtype if type(x) is CachedArray else type(x) for x in inputs)
    dt = _resolve(ufunc, inputs, "same_kind")
    plan = False if dt is None or dt.hasobject else (dt, dt.itemsize, ufunc.__name__, {})
    if len(_PLANS) < 4096:
        _PLANS[key] = plan
    return plan


def _layout(layouts, shape, itemsize):
    """(C strides, nbytes) of a result of shape, cached in a plan."""
    n = itemsize
    for d in shape:
        n *= d
    lay = (c_strides(shape, itemsize), n)
    if len(layouts) < 64:
        layouts[shape] = lay
    return lay


def _fast_general(ufunc, inputs, out=None):
    """_fast_call for any number of inputs, numpy scalars and out."""
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
            if x._dtype.metadata is not None:
                return _SLOW
            objs.append(x._obj)
            key.append(x._dtype)
        elif tx in _PY_SCALARS:
            key.append(tx)
        elif isinstance(x, np.generic):
            if x.dtype.metadata is not None:
                return _SLOW
            key.append(x.dtype)
        else:
            return _SLOW
    if not shape:
        return _SLOW
    if out is not None:
        if type(out) is not CachedArray or out._m is not m or out._shape != shape:
            return _SLOW
        n = out._dtype.itemsize
        for d in shape:
            n *= d

        def into(_):
            ufunc(*[x._kview() if type(x) is CachedArray else x for x in inputs],
                  out=out._kview())
            return out
        return m.run(into, objs, (out._obj,), None, ufunc.__name__, n <= SHORT_BYTES)
    key = tuple(key)
    dt = _RESOLVED.get(key)
    if dt is None:
        dt = _resolve(ufunc, inputs, "same_kind")
        if dt is None or dt.hasobject:
            return _SLOW
    plan = (dt, dt.itemsize, ufunc.__name__, {})
    return _new_result(ufunc, inputs, m, shape, plan, tuple(objs))


def _outer_new(ufunc, inputs):
    """ufunc.outer(a, b) of two CachedArrays of one manager written into a new, policy-placed
    C-order result in C, as a ufunc's result is (NumPy's result is C-ordered too); None for any
    other call or a busy manager (the general path then runs it)."""
    m, objs = None, []
    for x in inputs:             # (NumPy's outer makes arrays of Python scalars: strong types;
        #                           its result follows the inputs' layout: C inputs only)
        if type(x) is not CachedArray or (m is not None and x._m is not m) or \
                x._strides != c_strides(x._shape, x._dtype.itemsize):
            return None
        m = x._m
        objs.append(x._obj)
    shape = inputs[0]._shape + inputs[1]._shape
    dt = _resolve(ufunc, inputs, "same_kind")
    if not shape or dt is None or dt.hasobject:
        return None
    return new_filled(m, ufunc.outer, inputs, tuple(objs), shape, dt)


def _array_ufunc(self, ufunc, method, *inputs, **kwargs):
    """CachedArray.__array_ufunc__ (NEP 13)."""
    if method == "__call__" and ufunc.nout == 1 and ufunc.signature is None:
        if not kwargs:
            res = _fast_call(ufunc, inputs)
            if res is not _SLOW:
                return res
        elif len(kwargs) == 1 and "out" in kwargs and len(kwargs["out"]) == 1:
            res = _fast_call(ufunc, inputs, kwargs["out"][0])
            if res is not _SLOW:
                return kwargs["out"][0]
    if method == "outer" and not kwargs and len(inputs) == 2 and ufunc.nout == 1 and \
            ufunc.signature is None:
        res = _outer_new(ufunc, inputs)
        if res is not None:
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
    where = kwargs.get("where")
    if isinstance(where, CachedArray):             # a mask is read like the inputs
        reads.append(where._obj)
    else:
        where = None
    m = first_manager(inputs) or first_manager(out or ()) or \
        (where._m if where is not None else None)
    done = acquire_grouped(reads, writes, getattr(ufunc, "__name__", "ufunc"))
    try:
        args = tuple(x._view() if isinstance(x, CachedArray) else x
                     for x in inputs)
        if where is not None:
            kwargs["where"] = where._view()
        if out is not None:
            outs = tuple(o._view() if isinstance(o, CachedArray) else o for o in out)
            res = getattr(ufunc, method)(*args, out=outs, **kwargs)
            if len(out) == 1:
                return out[0]
            # out=(o, None): NumPy makes the outputs given as None
            return tuple(wrap(m, r, ()) if o is None else o for o, r in zip(out, res))
        if method == "__call__" and ufunc.nout == 1 and ufunc.signature is None and \
                not (set(kwargs) - {"where", "casting", "order"}):
            shape = _broadcast_shape(args)
            if shape:
                dt = _resolve(ufunc, args, kwargs.get("casting", "same_kind"))
                if dt is not None and not dt.hasobject:
                    res = new_pinned(m, shape, dt, _result_order(kwargs.get("order", "K"),
                                                                 args))
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
        return wrap(m, res, ())
    finally:
        release_grouped(done)


def _result_order(order, args):
    """The memory order of a ufunc's result given order=: "F" for "F"; for "A" when every input
    of two or more dimensions is F- and not C-contiguous, for "K" when the order="K" layout of
    every one is F order only (a strided F-ordered view too), as NumPy lays it out."""
    order = order.upper() if isinstance(order, str) else order
    if order in ("A", "K"):
        arrays = [a for a in args if isinstance(a, np.ndarray) and a.ndim > 1]
        return "F" if arrays and all(like_order(a.shape, a.strides, a.itemsize, order) == "F"
                                     for a in arrays) else "C"
    return order


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
    """The result dtype of ufunc on args (None when NumPy cannot resolve it), cached per
    operand kinds: not for dtypes with metadata, which compare equal to those without it and
    which NumPy's result keeps."""
    kinds = tuple(_dtype_of(a) for a in args)
    plain = all(type(k) is type or k.metadata is None for k in kinds)
    key = (ufunc, casting) + kinds
    dt = _RESOLVED.get(key) if plain else None
    if dt is None:
        try:
            dts = ufunc.resolve_dtypes(kinds + (None,), casting=casting)
            dt = dts[-1]
        except Exception:
            return None
        if plain and len(_RESOLVED) < 4096:
            _RESOLVED[key] = dt
    return dt


set_ufunc_handlers(_c_array_ufunc(_array_ufunc), _fast_call)   # plain calls in C first
_bind_plans(_PLANS, SHORT_BYTES)
