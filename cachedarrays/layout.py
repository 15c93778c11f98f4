"""Array layout arithmetic: which dtypes a CachedArray may hold, shapes, strides, and the
view a basic index (ints and slices) selects, computed without touching any bytes.

Pure functions of (dtype, shape, strides, offset): nothing here knows about managers or objects.
"""

import operator

import numpy as np

# element_offsets(arrays): each ndarray's start in elements (of the first's itemsize) from the
# first's, modulo 2**64 (a uint64 array), or None when a gap is not a whole number of elements;
# for kernels that reach several arrays through the first one's flat buffer. In C: reading an
# address through ``__array_interface__`` builds a dict per array.
from ._records import element_offsets  # noqa: F401


def readonly_view(a):
    """a if it is read-only, else a read-only view of it. numba compiles one specialisation per
    argument type and read-only is part of an array's type, so kernels that take their inputs
    through this compile once whether the caller's arrays are writable or not."""
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v


_OK_DTYPES = {}                # hashable dtype spelling ("f8", float, ...) -> checked np.dtype


def check_dtype(dtype):
    """Return np.dtype(dtype) if a CachedArray can hold it; refuse types holding references.

    Takes every spelling np.dtype takes (lists of fields, dicts, "i4,f8", types, subarray
    tuples); only hashable spellings are cached, and np.dtype instances are returned as given.
    """
    if isinstance(dtype, np.dtype):
        dt = dtype
    else:
        try:
            dt = _OK_DTYPES.get(dtype)
        except TypeError:      # unhashable spelling: a list of fields, a dict, ...
            return _checked(np.dtype(dtype))
        if dt is not None:
            return dt
        dt = np.dtype(dtype)
        _checked(dt)
        if len(_OK_DTYPES) < 256:
            _OK_DTYPES[dtype] = dt
        return dt
    return _checked(dt)


def _checked(dt):
    if dt.hasobject or dt.kind == "T":
        raise TypeError(f"CachedArray cannot hold dtype {dt}: its elements are Python objects "
                        "or references; use a fixed-size dtype (numbers, bool, fixed-width "
                        "strings, structured types of those)")
    return dt


def _unsized(dt):
    """True for a string or void dtype given without a size ('U', 'S', str, bytes, 'V')."""
    return not dt.itemsize and dt.kind in "SUV" and dt.names is None and dt.subdtype is None


def cast_dtype(src, dtype):
    """The dtype ``a.astype(dtype)`` gives for an array a of dtype src: an unsized string or
    void dtype takes the size NumPy's cast gives (int64 to str is <U21, <U3 to 'S' is |S3)."""
    dt = check_dtype(dtype)
    if _unsized(dt):
        dt = np.empty(0, src).astype(dt).dtype
    return dt


def creation_dtype(dtype):
    """The dtype NumPy's creation functions give for dtype: 'U' and 'S' without a size hold
    one character (<U1, |S1), as in np.zeros(3, 'U')."""
    dt = check_dtype(dtype)
    if _unsized(dt):
        dt = np.empty(0, dt).dtype
    return dt


def shape_tuple(shape):
    """shape as a tuple of non-negative ints (an int is a 1-d shape)."""
    if type(shape) is tuple:
        for s in shape:
            if type(s) is not int or s < 0:
                break
        else:
            return shape
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        shape = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a tuple of ints, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    return shape


# NumPy 2 gives a new empty array zero strides (np.zeros((0, 4)).strides == (0, 0)); older
# versions gave it the strides of its shape with empty axes counted as 1.
_EMPTY_STRIDES_ZERO = np.empty((0, 2)).strides == (0, 0)


def contiguous_strides(shape, itemsize, order="C"):
    """The strides NumPy gives a new array of shape in memory order "C" or "F"."""
    strides = [0] * len(shape)
    if _EMPTY_STRIDES_ZERO and 0 in shape:
        return tuple(strides)
    step = itemsize
    dims = range(len(shape) - 1, -1, -1) if order == "C" else range(len(shape))
    for i in dims:
        strides[i] = step
        step *= max(shape[i], 1)
    return tuple(strides)


_STRIDES = {}


def c_strides(shape, itemsize):
    """C-order strides, cached per (shape, itemsize)."""
    key = (shape, itemsize)
    st = _STRIDES.get(key)
    if st is None:
        st = contiguous_strides(shape, itemsize)
        if len(_STRIDES) < 4096:
            _STRIDES[key] = st
    return st


def basic_index(shape, strides, key):
    """(shape, strides, byte offset) of the view ``a[key]`` selects, for a key of ints and slices
    (one per leading dimension) that leaves at least one dimension; None for any other key
    (NumPy's own indexing handles those, and raises its own errors).

    The same arithmetic as NumPy's basic indexing, so the view is the one NumPy would give.
    """
    if type(key) is not tuple:
        key = (key,)
    nd = len(shape)
    nk = len(key)
    if nk > nd:
        return None
    off = 0
    new_shape = []
    new_strides = []
    for i in range(nk):
        k = key[i]
        tk = type(k)
        if tk is slice:
            start, stop, step = k.indices(shape[i])
            n = len(range(start, stop, step))
            if n == 0:                       # NumPy's rule for an empty slice
                start, step = 0, 1
            off += start * strides[i]
            new_shape.append(n)
            new_strides.append(strides[i] * step)
        elif tk is int:
            n = shape[i]
            if k < 0:
                k += n
            if not 0 <= k < n:
                return None
            off += k * strides[i]
        else:
            return None
    if nk == nd and not new_shape:
        return None                          # a scalar: not a view
    return (tuple(new_shape) + shape[nk:], tuple(new_strides) + strides[nk:], off)


def views_memory_of(r, v):
    """True if ndarray r may view v's memory: np.may_share_memory, which says False for any
    empty array, or, for an empty r, both views of one array (np.zeros((0, 4))[None] is a view
    of its array, as np.zeros((2, 4))[None] is)."""
    if np.may_share_memory(r, v):
        return True
    return not r.size and _root(r) is _root(v)


def _root(a):
    """The array at the end of a's chain of ndarray bases (a itself if it has none)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def contiguity(shape, strides, itemsize):
    """(C-contiguous, F-contiguous) as NumPy's flags tell them: an axis of length 1 may have
    any stride, and an empty array is both."""
    if 0 in shape:
        return True, True
    flags = []
    for dims in (range(len(shape) - 1, -1, -1), range(len(shape))):
        step, ok = itemsize, True
        for i in dims:
            if shape[i] != 1:
                if strides[i] != step:
                    ok = False
                    break
                step *= shape[i]
        flags.append(ok)
    return flags[0], flags[1]


def like_order(shape, strides, itemsize, order="K", new_shape=None):
    """The memory order, "C" or "F", NumPy gives a new array made like one of this layout
    (np.empty_like and the other *_like functions, x.copy(order)) for order "K" (or None),
    "A", "C" or "F"; new_shape is the shape= of the *_like functions.

    "A" is F when the array is F- and not C-contiguous. "K" keeps the order of the axes by
    falling |stride| (ties in axis order); a shape= of another rank gives C. An order of the
    axes that is neither C nor F gives C, the nearer layout a CachedArray can have.
    """
    if order in ("C", "c", "F", "f"):
        return order.upper()
    c, f = contiguity(shape, strides, itemsize)
    if order in ("A", "a"):
        return "F" if f and not c and len(shape) > 1 else "C"
    dims = shape if new_shape is None else new_shape
    if len(dims) != len(shape) or len(shape) <= 1 or c:
        return "C"
    if f:
        return "F"
    perm = sorted(range(len(shape)), key=lambda i: (-abs(strides[i]), i))
    new = [0] * len(dims)
    step = itemsize
    for i in reversed(perm):
        new[i] = step
        step *= dims[i]
    c, f = contiguity(dims, new, itemsize)
    return "F" if f and not c else "C"


def order_code(order, none="K"):
    """An order argument as NumPy reads it: "K", "A", "C" or "F" (either case, str or bytes;
    None is `none`); ValueError for other strings and TypeError for other types, as NumPy."""
    if order is None:
        return none
    if isinstance(order, bytes):
        order = order.decode("latin-1")
    if not isinstance(order, str):
        raise TypeError(f"order must be str, not {type(order).__name__}")
    code = order.upper()
    if code not in ("K", "A", "C", "F"):
        raise ValueError(f"order must be one of 'C', 'F', 'A', or 'K' (got {order!r})")
    return code
