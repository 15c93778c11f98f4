"""CachedArray as a dask chunk type: ``import cachedarrays.dask`` registers it with dask.

After the import, a dask array whose chunks are CachedArrays (``da.from_array(x, chunks=...,
asarray=False)``, or ``d.map_blocks(ca.asarray)`` on any dask array) keeps them CachedArrays
through blockwise operations, reductions, ``@`` and ``dask.array.linalg``: its ``_meta`` is a
CachedArray, every chunk is computed by NumPy calls that dispatch to the chunk's manager, and
``.compute()`` returns a CachedArray. ``dask.sizeof`` gives a chunk's bytes without touching
its data, and ``dask.base.tokenize`` names a chunk by its manager, object, version and view
instead of hashing its contents (a write through any kernel bumps the version, so a changed
array never reuses an old token).

Needs the optional extra ``[dask]`` (``pip install cachedarrays[dask]``).
"""

from __future__ import annotations

import uuid
import weakref

try:
    import dask.array as da
    from dask.base import normalize_token
    from dask.sizeof import sizeof
except ImportError as e:              # pragma: no cover - the message is the point
    raise ImportError("cachedarrays.dask needs dask: install the optional extra, "
                      "pip install 'cachedarrays[dask]'") from e

from .array import CachedArray

__all__ = ["CachedArray"]

da.register_chunk_type(CachedArray)


@sizeof.register(CachedArray)
def _sizeof(x):
    return int(x.nbytes)


_managers = weakref.WeakKeyDictionary()      # manager -> a name no other manager gets


@normalize_token.register(CachedArray)
def _token(x):
    m, obj = x._m, x._obj
    name = _managers.get(m)
    if name is None:
        name = _managers.setdefault(m, uuid.uuid4().hex)
    return ("cachedarrays.CachedArray", name, obj.id, obj.version, x._offset, x._shape,
            x._dtype.str, x._strides)
