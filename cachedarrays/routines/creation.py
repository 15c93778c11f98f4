"""NumPy's creation functions on CachedArrays: the *_like forms and ``like=`` (NEP 35).

``np.zeros_like(x)`` and friends on a CachedArray, and ``np.empty(3, like=x)``, return
CachedArrays on x's manager, made by ``cachedarrays.creation`` (no copy through NumPy).
"""

import numpy as np

from ..array import CachedArray
from ..creation import (_manager, array, empty, empty_like, full, full_like, ones, ones_like,
                        zeros, zeros_like)
from ..dispatch import implements
from ..layout import creation_dtype


def _sized(fn, at):
    """fn with its dtype argument (position `at`, or keyword) sized as NumPy's creation
    functions size it: 'U' and 'S' without a size hold one character."""
    def impl(*args, **kwargs):
        if len(args) > at and args[at] is not None:
            args = args[:at] + (creation_dtype(args[at]),) + args[at + 1:]
        elif kwargs.get("dtype") is not None:
            kwargs["dtype"] = creation_dtype(kwargs["dtype"])
        return fn(*args, **kwargs)
    return impl


# np.empty_like(x) and friends on a CachedArray return CachedArrays with no copy.
implements(np.empty_like)(_sized(empty_like, 1))
implements(np.zeros_like)(_sized(zeros_like, 1))
implements(np.ones_like)(_sized(ones_like, 1))
implements(np.full_like)(_sized(full_like, 2))


def _like_creation(fn, at):
    fn = _sized(fn, at)

    def impl(*args, like=None, device=None, **kwargs):
        if device not in (None, "cpu"):        # NumPy passes device= from np.ones and np.full
            raise ValueError(f"device must be None or 'cpu', not {device!r}")
        return fn(*args, manager=_manager(None, like), **kwargs)
    return impl


# like= dispatch (NEP 35): np.empty(3, like=x) -> a CachedArray on x's manager.
implements(np.empty)(_like_creation(empty, 1))
implements(np.zeros)(_like_creation(zeros, 1))
implements(np.ones)(_like_creation(ones, 1))
implements(np.full)(_like_creation(full, 2))


def _array_like(a, dtype=None, *, copy=True, order="K", subok=False, ndmin=0, like=None,
                device=None):
    """np.array / np.asarray with ``like=`` a CachedArray: a CachedArray on like's manager
    (``copy`` None or False returns a CachedArray of that manager as it is; ``ndmin``
    prepends axes of length 1, as NumPy does)."""
    if device not in (None, "cpu"):
        raise ValueError(f"device must be None or 'cpu', not {device!r}")
    m = _manager(None, like)
    same = isinstance(a, CachedArray) and a.manager is m and \
        (dtype is None or np.dtype(dtype) == a.dtype)
    if same and copy is not True:
        out = a
    elif copy is False:
        raise ValueError("copy=False: the data must be copied into a CachedArray of like's "
                         "manager; pass copy=None to allow the copy")
    else:
        out = array(a, dtype, order if order in ("C", "F") else None, manager=m)
    if ndmin > out.ndim:
        out = out.reshape((1,) * (ndmin - out.ndim) + out.shape)
    return out


def _asarray_like(a, dtype=None, order=None, *, device=None, copy=None, like=None):
    return _array_like(a, dtype, copy=copy, order=order, like=like, device=device)


implements(np.asarray)(_asarray_like)
implements(np.array)(_array_like)
