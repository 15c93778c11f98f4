"""np.shape, np.ndim and np.size of a CachedArray: read from its description, as x.shape,
x.ndim and x.size are, so the function and the attribute always agree (a freed array keeps its
description; any use of its data raises UseAfterFreeError)."""

import numpy as np

from ..dispatch import implements


def _stand_in(a):
    """An ndarray of a's shape that holds no memory (NumPy's own rules then answer)."""
    return np.broadcast_to(np.empty((), np.bool_), a._shape)


@implements(np.shape)
def shape(a):
    """np.shape(x): x.shape."""
    return a._shape


@implements(np.ndim)
def ndim(a):
    """np.ndim(x): x.ndim."""
    return len(a._shape)


@implements(np.size)
def size(a, axis=None):
    """np.size(x, axis): x.size, or the length along axis (NumPy's errors for a bad axis)."""
    return np.size(_stand_in(a), axis)
