"""Results of NumPy calls as CachedArrays: a view of an input stays a view of its object,
any other array is copied into a new, policy-placed CachedArray; scalars pass through."""

import numpy as np

from .array import from_ndarray


def wrap(m, res, views):
    """Turn a NumPy result into CachedArrays. views: (array, its ndarray view) pairs of the
    call's inputs, so a result sharing memory with one becomes a view of that array."""
    if isinstance(res, np.ndarray):
        if res.dtype.hasobject:
            return res
        if not res.flags.owndata:
            for arr, v in views:
                if np.may_share_memory(res, v):
                    return arr._derive(v, res)
        return from_ndarray(m, res)       # a 0-d result stays a 0-d array, as in NumPy
    if isinstance(res, list):
        return [wrap(m, r, views) for r in res]
    if isinstance(res, tuple):
        items = [wrap(m, r, views) for r in res]
        return type(res)(*items) if hasattr(res, "_fields") else tuple(items)
    return res
