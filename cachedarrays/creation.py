"""Creating CachedArrays: asarray, array, empty, zeros, ones, full and their *_like forms.

NumPy's own creation functions (``np.zeros_like(x)``, ``np.empty(3, like=x)``) reach these
through ``cachedarrays.routines.creation``.
"""

import numpy as np

from ._records import new_array as _new_array
from ._records import run_ufunc as _run_filled
from .array import CachedArray, check_dtype, from_ndarray, new_layout, new_pinned, unpin
from .defaults import default_manager
from .layout import like_order, order_code, shape_tuple
from .manager import Manager
from .pinning import SHORT_BYTES
from .scopes import readable
from .sizes import MAX_SIZE

# (shape, dtype spelling) -> (new_layout(shape, dtype), dtype), for the spellings that hash
# safely. A dtype object is keyed by identity (and kept alive by its entry): dtypes that differ
# only in metadata (a field's too) compare equal, and each must get a layout of its own.
_LAYOUTS = {}
_KEY_DTYPES = (type, str)


def _c_layout(shape, dtype):
    """new_layout(shape, dtype) of a C-order array, cached per (shape, dtype) as given; None
    for spellings that are not cached (a list shape, an unusual dtype argument)."""
    ts = type(shape)
    if not (ts is int or (ts is tuple and all(type(d) is int for d in shape))):
        return None
    # isinstance: a dtype object's type is a subclass of np.dtype (np.dtypes.Float32DType...)
    if isinstance(dtype, np.dtype):
        key = (shape, id(dtype))
    elif isinstance(dtype, _KEY_DTYPES):
        key = (shape, dtype)
    else:
        return None
    entry = _LAYOUTS.get(key)
    if entry is None:
        entry = (new_layout(shape, dtype), dtype)
        if len(_LAYOUTS) < 1024:
            _LAYOUTS[key] = entry
    return entry[0]


def _manager(manager, like=None):
    if manager is not None:
        if not isinstance(manager, Manager):
            raise TypeError(f"manager must be a ca.Manager (or None for the default one), "
                            f"not {type(manager).__name__}")
        return manager
    if isinstance(like, CachedArray):
        like._check_live()          # a freed array is no model for a new one
        return like.manager
    return default_manager()


def asarray(a, dtype=None, order=None, *, manager=None, placement=None):
    """a as a CachedArray: returned as is when it already is one (same dtype and manager, and
    contiguous in the order asked for, if "C" or "F")."""
    code = None if order is None else order_code(order)
    if isinstance(a, CachedArray) and (dtype is None or np.dtype(dtype) == a.dtype) and \
            (manager is None or manager is a.manager) and \
            (code in (None, "K", "A") or a._in_order(code)):   # "A" asks no order, as NumPy
        return a
    return array(a, dtype=dtype, order=order, manager=manager, placement=placement)


def array(a, dtype=None, order=None, *, manager=None, placement=None):
    """A new CachedArray holding a copy of a (any array-like).

    placement: None lets the policy choose; "fast" or "slow" is a hint (see ``empty``).
    """
    m = _manager(manager, a)
    if order is not None:
        order = order_code(order)
    if isinstance(a, CachedArray):
        if m is a.manager and placement is None:
            return a.astype(dtype if dtype is not None else a.dtype,
                            order="K" if order is None else order)
        with readable(a) as v:
            return _copy_in(m, v, dtype, order, placement)
    return _copy_in(m, a, dtype, order, placement)


def _copy_in(m, a, dtype, order, placement=None):
    if order == "A" and isinstance(a, np.ndarray):      # NumPy's "A": F only for F order
        order = "F" if a.flags.fnc else "C"
    src = np.asarray(a, dtype=dtype, order=order if order in ("C", "F") else None)
    check_dtype(src.dtype)
    return from_ndarray(m, src, placement)


def _order(order):
    """order as NumPy's creation functions take it: "C" or "F" (either case), None for "C"."""
    if order is None or order in ("C", "c"):
        return "C"
    if order in ("F", "f"):
        return "F"
    if order in ("A", "a", "K", "k"):
        raise ValueError(f"only 'C' or 'F' order is permitted, not {order!r}")
    raise ValueError(f"order must be one of 'C', 'F', 'A', or 'K' (got {order!r})")


def _check_device(device):
    if device not in (None, "cpu"):
        raise ValueError(f"device must be None or 'cpu' (fast and slow memory are both host "
                         f"memory), not {device!r}")


def empty(shape, dtype=float, order="C", *, manager=None, placement=None):
    """An uninitialised CachedArray.

    placement: None lets the policy choose; "slow" puts it in slow memory (e.g. a large table
    that is read sparsely), "fast" in fast memory if it fits after forced evictions.
    """
    m = _manager(manager)
    if order != "C":
        order = _order(order)
    if placement is None and order == "C" and not m.fast.virtual:
        lay = _c_layout(shape, dtype)
        if lay is not None and lay[3] <= MAX_SIZE:   # else new_pinned says it is too large
            out = _new_array(m, *lay)           # in C unless the manager is busy
            if out is not None:
                return out
    out = new_pinned(m, shape, dtype, order, placement)
    unpin(out)
    return out


def _fill_with(value, out):
    np.copyto(out, value, casting="unsafe")


def _zero_bytes(out):
    # All bytes zero, padding of aligned structs included; a new array is contiguous, so its
    # K-order ravel is a view.
    out.ravel(order="K").view(np.uint8).fill(0)


# fill values whose conversion runs no code of the caller's (no __array__, __float__...)
_PLAIN_FILLS = frozenset((int, float, complex, bool, str, bytes))


def _plain_fill(value):
    """True if filling with value runs no Python code of the caller's: the C step holds the
    manager's lock while it fills, so such code would stall every other thread's call."""
    if type(value) in _PLAIN_FILLS or isinstance(value, np.generic):
        return True
    return type(value) is np.ndarray and not value.dtype.hasobject


def _filled(m, shape, dtype, order, placement, fill, inputs, plain=True):
    """A new array of m written by fill(*inputs, out=its view) while it is pinned: in C (as a
    ufunc's result is made) for the common call and a plain fill, else through new_pinned."""
    if plain and placement is None and order == "C" and not m.fast.virtual:
        lay = _c_layout(shape, dtype)
        if lay is not None and lay[3] <= MAX_SIZE:   # else new_pinned says it is too large
            out = _run_filled(m, fill, inputs, (), *lay, lay[3] <= SHORT_BYTES)
            if out is not None:                 # None: the manager is busy
                return out
    out = new_pinned(m, shape, dtype, order if order == "C" else _order(order), placement)
    try:
        fill(*inputs, out=out._view())
    finally:
        unpin(out)
    return out


def full(shape, fill_value, dtype=None, order="C", *, manager=None, placement=None):
    """A CachedArray filled with fill_value, which broadcasts to shape and is cast unsafely
    (as np.full: np.nan in an int array is INT_MIN, 1j in a float array is 0.0, warned)."""
    if isinstance(fill_value, CachedArray):
        with readable(fill_value) as v:
            return full(shape, v, dtype, order, manager=_manager(manager, fill_value),
                        placement=placement)
    if dtype is None:
        dtype = np.asarray(fill_value).dtype
    return _filled(_manager(manager), shape, dtype, order, placement, _fill_with, (fill_value,),
                   _plain_fill(fill_value))


def zeros(shape, dtype=float, order="C", *, manager=None, placement=None):
    """A CachedArray of zeros (zero bytes, as np.zeros: '' for strings, 0 in every field)."""
    return _filled(_manager(manager), shape, dtype, order, placement, _zero_bytes, ())


def ones(shape, dtype=float, order="C", *, manager=None, placement=None):
    """A CachedArray of ones (dtype None means float64, as in np.ones)."""
    return full(shape, 1, float if dtype is None else dtype, order, manager=manager,
                placement=placement)


def _like_args(a, dtype, order, shape):
    """(dtype, order, shape) of a new array made like a, as NumPy's *_like functions make it."""
    dtype = a.dtype if dtype is None else dtype
    if isinstance(a, CachedArray):   # its own layout: np.shape would dispatch once more
        a._check_live()
        ashape, strides, itemsize = a._shape, a._strides, a.itemsize
    elif isinstance(a, np.ndarray):
        ashape, strides, itemsize = a.shape, a.strides, a.itemsize
    else:
        ashape, strides, itemsize = np.shape(a), None, 1
    if order is None or order in ("K", "A", "k", "a"):
        order = "C" if strides is None else \
            like_order(ashape, strides, itemsize, order or "K",
                       None if shape is None else shape_tuple(shape))
    return dtype, order, ashape if shape is None else shape


def empty_like(a, dtype=None, order="K", subok=True, shape=None, *, device=None,
               manager=None):
    _check_device(device)
    dtype, order, shape = _like_args(a, dtype, order, shape)
    return empty(shape, dtype, order, manager=_manager(manager, a))


def zeros_like(a, dtype=None, order="K", subok=True, shape=None, *, device=None,
               manager=None):
    _check_device(device)
    dtype, order, shape = _like_args(a, dtype, order, shape)
    return zeros(shape, dtype, order, manager=_manager(manager, a))


def ones_like(a, dtype=None, order="K", subok=True, shape=None, *, device=None,
              manager=None):
    _check_device(device)
    dtype, order, shape = _like_args(a, dtype, order, shape)
    return ones(shape, dtype, order, manager=_manager(manager, a))


def full_like(a, fill_value, dtype=None, order="K", subok=True, shape=None, *, device=None,
              manager=None):
    _check_device(device)
    dtype, order, shape = _like_args(a, dtype, order, shape)
    return full(shape, fill_value, dtype, order, manager=_manager(manager, a))
