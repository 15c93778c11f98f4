"""NumPy's creation functions on CachedArrays: the *_like forms and ``like=`` (NEP 35).

``np.zeros_like(x)`` and friends on a CachedArray, and ``np.empty(3, like=x)``, return
CachedArrays on x's manager, made by ``cachedarrays.creation`` (no copy through NumPy).
"""

import inspect

import numpy as np

from ..array import CachedArray
from ..creation import (_check_device, _like_args, _manager, array, empty, empty_like, full,
                        full_like, ones, ones_like, zeros, zeros_like)
from ..dispatch import implements
from ..layout import creation_dtype, order_code


def _sized(fn, at, plain=None):
    """fn with its dtype argument (position `at`, or keyword) sized as NumPy's creation
    functions size it: 'U' and 'S' without a size hold one character. A dtype holding Python
    objects, which no CachedArray holds, makes an ndarray by plain(*args, **kwargs) (as NumPy
    functions giving object results return them)."""
    def impl(*args, **kwargs):
        if len(args) > at and args[at] is not None:
            dt = args[at]
        else:
            dt = kwargs.get("dtype")
        if dt is not None:
            if plain is not None and _holds_objects(dt):
                return plain(*args, **kwargs)
            dt = creation_dtype(dt)
            if len(args) > at:
                args = args[:at] + (dt,) + args[at + 1:]
            else:
                kwargs["dtype"] = dt
        return fn(*args, **kwargs)
    return impl


def _holds_objects(dtype):
    try:
        return np.dtype(dtype).hasobject
    except TypeError:
        return False                    # not a dtype: creation_dtype raises NumPy's error


def _plain_like(func, make):
    """func (np.zeros_like and friends) for a dtype holding objects: make (np.zeros, ...) of
    the shape and order func gives, an ndarray; arguments bound as func binds them."""
    sig = inspect.signature(func)

    def impl(*args, **kwargs):
        p = sig.bind(*args, **kwargs).arguments
        _check_device(p.get("device"))
        a = p["prototype" if "prototype" in p else "a"]
        dtype, order, shape = _like_args(a, p["dtype"], p.get("order", "K"), p.get("shape"))
        fill = (p["fill_value"],) if "fill_value" in p else ()
        return make(shape, *fill, dtype=dtype, order=order)
    return impl


def _prototype(fn):
    """fn taking NumPy's keyword for np.empty_like's array, prototype=, as its first argument."""
    def impl(*args, **kwargs):
        if not args and "prototype" in kwargs:
            args = (kwargs.pop("prototype"),)
        return fn(*args, **kwargs)
    return impl


# np.empty_like(x) and friends on a CachedArray return CachedArrays with no copy.
implements(np.empty_like)(_prototype(_sized(empty_like, 1,
                                            _plain_like(np.empty_like, np.empty))))
implements(np.zeros_like)(_sized(zeros_like, 1, _plain_like(np.zeros_like, np.zeros)))
implements(np.ones_like)(_sized(ones_like, 1, _plain_like(np.ones_like, np.ones)))
implements(np.full_like)(_sized(full_like, 2, _plain_like(np.full_like, np.full)))


def _like_creation(fn, at, func):
    """fn (ca.zeros and friends) for func (np.zeros, ...) called with like=; a dtype holding
    objects gives func's own ndarray."""
    fn = _sized(fn, at, lambda *args, manager, **kwargs: func(*args, **kwargs))

    def impl(*args, like=None, device=None, **kwargs):
        if device not in (None, "cpu"):        # NumPy passes device= from np.ones and np.full
            raise ValueError(f"device must be None or 'cpu', not {device!r}")
        if at == 2 and _fill_holds_objects(args, kwargs):
            return func(*args, **kwargs)
        return fn(*args, manager=_manager(None, like), **kwargs)
    return impl


def _fill_holds_objects(args, kwargs):
    """True when np.full(shape, fill_value, dtype=None) takes a dtype holding objects from
    its fill value (np.full(3, None))."""
    if (args[2] if len(args) > 2 else kwargs.get("dtype")) is not None:
        return False
    fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
    return not isinstance(fill, CachedArray) and np.asarray(fill).dtype.hasobject


# like= dispatch (NEP 35): np.empty(3, like=x) -> a CachedArray on x's manager.
implements(np.empty)(_like_creation(empty, 1, np.empty))
implements(np.zeros)(_like_creation(zeros, 1, np.zeros))
implements(np.ones)(_like_creation(ones, 1, np.ones))
implements(np.full)(_like_creation(full, 2, np.full))


_MUST_COPY = ("copy=False: the data must be copied into a CachedArray of like's manager; pass "
              "copy=None to allow the copy")


def _array_like(a, dtype=None, *, copy=True, order="K", subok=False, ndmin=0, like=None,
                device=None, **extra):
    """np.array / np.asarray with ``like=`` a CachedArray: a CachedArray on like's manager
    (``copy`` None or False returns a CachedArray of that manager as it is; ``ndmin``
    prepends axes of length 1, as NumPy does). Values of a dtype holding objects, which no
    CachedArray holds, give NumPy's own ndarray. extra: ndmax (NumPy 2.4 on), when given."""
    if device not in (None, "cpu"):
        raise ValueError(f"device must be None or 'cpu', not {device!r}")
    unknown = set(extra) - {"ndmax"}
    if unknown:
        raise TypeError(f"array() got an unexpected keyword argument {min(unknown)!r}")
    if not isinstance(a, CachedArray):
        if copy is False:
            raise ValueError(_MUST_COPY)
        src = np.array(a, dtype, copy=None, order=order, ndmin=ndmin, **extra)
        if src.dtype.hasobject:
            return src
        a, dtype = src, None            # (copied once more into like's manager)
    m = _manager(None, like)
    order = order_code(order)
    same = isinstance(a, CachedArray) and a.manager is m and \
        (dtype is None or np.dtype(dtype) == a.dtype) and \
        (order in ("K", "A") or a._in_order(order))        # as NumPy: "A" asks no order
    if same and copy is not True:
        out = a
    elif copy is False:
        raise ValueError(_MUST_COPY)
    else:
        out = array(a, dtype, order, manager=m)
    if ndmin > out.ndim:
        out = out.reshape((1,) * (ndmin - out.ndim) + out.shape)
    return out


def _asarray_like(a, dtype=None, order=None, *, device=None, copy=None, like=None):
    return _array_like(a, dtype, copy=copy, order=order, like=like, device=device)


implements(np.asarray)(_asarray_like)
implements(np.array)(_array_like)
