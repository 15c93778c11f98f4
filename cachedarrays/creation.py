"""Creating CachedArrays: asarray, array, empty, zeros, ones, full and their *_like forms."""

import numpy as np

from .array import (CachedArray, _from_ndarray, _unpin, check_dtype, implements, new_pinned,
                    readable)
from .defaults import default_manager


def _manager(manager, like=None):
    if manager is not None:
        return manager
    if isinstance(like, CachedArray):
        return like.manager
    return default_manager()


def asarray(a, dtype=None, order=None, *, manager=None, placement=None):
    """a as a CachedArray: returned as is when it already is one (same dtype and manager)."""
    if isinstance(a, CachedArray) and (dtype is None or np.dtype(dtype) == a.dtype) and \
            (manager is None or manager is a.manager):
        return a
    return array(a, dtype=dtype, order=order, manager=manager, placement=placement)


def array(a, dtype=None, order=None, *, manager=None, placement=None):
    """A new CachedArray holding a copy of a (any array-like).

    placement: None lets the policy choose; "fast" or "slow" is a hint (see ``empty``).
    """
    m = _manager(manager, a)
    if isinstance(a, CachedArray):
        if m is a.manager and placement is None:
            return a.astype(dtype if dtype is not None else a.dtype,
                            order="K" if order is None else order)
        with readable(a) as v:
            return _copy_in(m, v, dtype, order, placement)
    return _copy_in(m, a, dtype, order, placement)


def _copy_in(m, a, dtype, order, placement=None):
    src = np.asarray(a, dtype=dtype, order=order if order in ("C", "F") else None)
    check_dtype(src.dtype)
    return _from_ndarray(m, src, placement)


def empty(shape, dtype=float, order="C", *, manager=None, placement=None):
    """An uninitialised CachedArray.

    placement: None lets the policy choose; "slow" puts it in slow memory (e.g. a large table
    that is read sparsely), "fast" in fast memory if it fits after forced evictions.
    """
    out = new_pinned(_manager(manager), shape, dtype, order, placement)
    _unpin(out)
    return out


def full(shape, fill_value, dtype=None, order="C", *, manager=None, placement=None):
    """A CachedArray filled with fill_value."""
    if dtype is None:
        dtype = np.asarray(fill_value).dtype
    out = new_pinned(_manager(manager), shape, dtype, order, placement)
    try:
        out._view().fill(fill_value)
    finally:
        _unpin(out)
    return out


def zeros(shape, dtype=float, order="C", *, manager=None, placement=None):
    """A CachedArray of zeros (zero bytes, as np.zeros: '' for strings, 0 in every field)."""
    out = new_pinned(_manager(manager), shape, dtype, order, placement)
    try:
        # All bytes zero, padding of aligned structs included; the new array is contiguous,
        # so its K-order ravel is a view.
        out._view().ravel(order="K").view(np.uint8).fill(0)
    finally:
        _unpin(out)
    return out


def ones(shape, dtype=float, order="C", *, manager=None, placement=None):
    """A CachedArray of ones (dtype None means float64, as in np.ones)."""
    return full(shape, 1, float if dtype is None else dtype, order, manager=manager,
                placement=placement)


def _like_args(a, dtype, order, shape):
    dtype = a.dtype if dtype is None else dtype
    shape = np.shape(a) if shape is None else shape
    if order in ("K", "A", None):
        flags = a.flags if isinstance(a, np.ndarray) else None
        order = "F" if flags is not None and flags.f_contiguous and not flags.c_contiguous \
            else "C"
    return dtype, order, shape


def empty_like(a, dtype=None, order="K", subok=True, shape=None, *, manager=None):
    dtype, order, shape = _like_args(a, dtype, order, shape)
    return empty(shape, dtype, order, manager=_manager(manager, a))


def zeros_like(a, dtype=None, order="K", subok=True, shape=None, *, manager=None):
    dtype, order, shape = _like_args(a, dtype, order, shape)
    return zeros(shape, dtype, order, manager=_manager(manager, a))


def ones_like(a, dtype=None, order="K", subok=True, shape=None, *, manager=None):
    dtype, order, shape = _like_args(a, dtype, order, shape)
    return ones(shape, dtype, order, manager=_manager(manager, a))


def full_like(a, fill_value, dtype=None, order="K", subok=True, shape=None, *, manager=None):
    dtype, order, shape = _like_args(a, dtype, order, shape)
    return full(shape, fill_value, dtype, order, manager=_manager(manager, a))


# np.empty_like(x) and friends on a CachedArray return CachedArrays with no copy.
implements(np.empty_like)(empty_like)
implements(np.zeros_like)(zeros_like)
implements(np.ones_like)(ones_like)
implements(np.full_like)(full_like)


def _like_creation(fn):
    def impl(*args, like=None, device=None, **kwargs):
        if device not in (None, "cpu"):        # NumPy passes device= from np.ones and np.full
            raise ValueError(f"device must be None or 'cpu', not {device!r}")
        return fn(*args, manager=_manager(None, like), **kwargs)
    return impl


# like= dispatch (NEP 35): np.empty(3, like=x) -> a CachedArray on x's manager.
implements(np.empty)(_like_creation(empty))
implements(np.zeros)(_like_creation(zeros))
implements(np.ones)(_like_creation(ones))
implements(np.full)(_like_creation(full))
implements(np.asarray)(_like_creation(array))
implements(np.array)(_like_creation(array))


@implements(np.concatenate)
def concatenate(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    """np.concatenate writing straight into a policy-placed result (no extra copy)."""
    from .array import _call_on_views, _unpin

    arrays = list(arrays)
    first = next((a for a in arrays if isinstance(a, CachedArray)), None)
    if out is not None or first is None or axis is None or not arrays:
        return _call_on_views(np.concatenate, (arrays,), dict(axis=axis, out=out, dtype=dtype,
                                                               casting=casting))
    shapes = [np.shape(a) for a in arrays]
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
    res = new_pinned(first.manager, tuple(shape), dt)
    try:
        return _call_on_views(np.concatenate, (arrays,), dict(axis=axis, out=res,
                                                               dtype=dtype, casting=casting))
    finally:
        _unpin(res)
