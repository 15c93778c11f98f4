"""Results of NumPy calls as CachedArrays: a view of an input stays a view of its object,
an ndarray argument (or a view of one, empty or not) comes back as NumPy gives it, any other
array is copied into a new, policy-placed CachedArray; scalars pass through."""

import numpy as np

from .array import from_ndarray
from .layout import views_memory_of


def wrap(m, res, views, plain=()):
    """Turn a NumPy result into CachedArrays. views: (array, its ndarray view) pairs of the
    call's inputs, so a result sharing memory with one becomes a view of that array. plain: the
    call's ndarray arguments; a result that is one of them, or a view of one, is returned as it
    is (np.atleast_1d(x, cached) gives x itself, as NumPy does, so writes through it reach x)."""
    if isinstance(res, np.ndarray):
        if res.dtype.hasobject:
            return res
        for p in plain:
            if res is p:
                return res
        if not res.flags.owndata:
            for arr, v in views:
                if res is v:
                    return arr              # NumPy returned its input: the input itself
                if views_memory_of(res, v):
                    return arr._derive(v, res)
            for p in plain:
                if views_memory_of(res, p):
                    return res              # empty too: a view of p, whatever its size
        return from_ndarray(m, res)       # a 0-d result stays a 0-d array, as in NumPy
    if isinstance(res, list):
        return [wrap(m, r, views, plain) for r in res]
    if isinstance(res, tuple):
        items = [wrap(m, r, views, plain) for r in res]
        return type(res)(*items) if hasattr(res, "_fields") else tuple(items)
    return res


#: Sequences longer than this are not searched for ndarrays (a list of 100,000 numbers took
#: 10 ms to walk): NumPy returns views only of the arrays a call is given one by one.
SEARCHED_ITEMS = 64


def plain_arrays(x, found):
    """Append the ndarrays in x to found: x itself, or the items of x (a list or tuple of
    arguments, and the items of those at most ``SEARCHED_ITEMS`` long) that are ndarrays."""
    if isinstance(x, np.ndarray):
        found.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, np.ndarray):
                found.append(y)
            elif isinstance(y, (list, tuple)) and len(y) <= SEARCHED_ITEMS:
                found.extend(z for z in y if isinstance(z, np.ndarray))
    return found
