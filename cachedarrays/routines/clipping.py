"""np.clip on CachedArrays through NumPy's own ufuncs (clip, minimum, maximum, positive), whose
results are placed by the policy and written in place, as every ufunc's are: NumPy's np.clip
on an ndarray runs the same ufuncs, but the general path would build its result in ordinary
memory and copy it in."""

import numpy as np

from .. import dispatch
from ..array import CachedArray
from ..dispatch import implements

#: NumPy's three-input clip ufunc (what ndarray.clip runs); None where NumPy has none.
_CLIP = getattr(getattr(getattr(np, "_core", None), "umath", None), "clip", None)


@implements(np.clip)
def clip(*args, **kwargs):
    """np.clip(a, a_min, a_max) of a CachedArray as ndarray.clip runs it (a Python int bound
    beyond an integer dtype's range is no bound, NEP 50); every other call as NumPy makes it."""
    if len(args) != 3 or kwargs or type(args[0]) is not CachedArray or \
            not isinstance(_CLIP, np.ufunc):
        return dispatch._call_on_views(np.clip, args, kwargs)
    a, lo, hi = args
    if a.dtype.kind in "iu":
        info = np.iinfo(a.dtype)
        if type(lo) is int and lo <= info.min:
            lo = None
        if type(hi) is int and hi >= info.max:
            hi = None
    if lo is None and hi is None:
        return np.positive(a)
    if lo is None:
        return np.minimum(a, hi)
    if hi is None:
        return np.maximum(a, lo)
    return _CLIP(a, lo, hi)
