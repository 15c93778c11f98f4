"""NumPy's creation functions on CachedArrays: the *_like forms and ``like=`` (NEP 35).

``np.zeros_like(x)`` and friends on a CachedArray, and ``np.empty(3, like=x)``, return
CachedArrays on x's manager, made by ``cachedarrays.creation`` (no copy through NumPy).
"""

import numpy as np

from ..creation import (_manager, array, empty, empty_like, full, full_like, ones, ones_like,
                        zeros, zeros_like)
from ..dispatch import implements

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
