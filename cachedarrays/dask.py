"""CachedArray as a dask chunk type: ``import cachedarrays.dask`` registers it with dask.

After the import, a dask array whose chunks are CachedArrays (``da.from_array(x, chunks=...,
asarray=False)``, or ``d.map_blocks(ca.asarray)`` on any dask array) keeps them CachedArrays
through blockwise operations, reductions, ``@`` and ``dask.array.linalg``: its ``_meta`` is a
CachedArray, every chunk is computed by NumPy calls that dispatch to the chunk's manager, and
``.compute()`` returns a CachedArray. ``dask.sizeof`` gives a chunk's bytes without touching
its data, and ``dask.base.tokenize`` names a chunk by its manager, object, version and view
instead of hashing its contents (a write through any kernel bumps the version, so a changed
array never reuses an old token).

With ``distributed`` installed, ``ManagerPlugin(fast=..., slow=..., slow_path=..., policy=...)``
is a worker plugin: each worker builds its own Manager at start (its default manager, so the
chunks it creates or receives land there) and closes it at shutdown. A CachedArray chunk is
sent as one frame over its bytes in place, held by a pin that no thread owns until the frame
is let go (no copy on send), and received into the receiving process's default manager; both
directions are counted (``stats()["events"]["dask_sent"]`` / ``["dask_received"]``).

Needs the optional extra ``[dask]`` (``pip install cachedarrays[dask]``).
"""

from __future__ import annotations

import pickle
import uuid
import weakref

import numpy as np

try:
    import dask.array as da
    from dask.base import normalize_token
    from dask.sizeof import sizeof
except ImportError as e:              # pragma: no cover - the message is the point
    raise ImportError("cachedarrays.dask needs dask: install the optional extra, "
                      "pip install 'cachedarrays[dask]'") from e

from .array import CachedArray
from .creation import asarray
from .defaults import default_manager, set_default_manager
from .manager import Manager
from .scopes import readable

__all__ = ["CachedArray", "ManagerPlugin"]

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
            x._dtype.str, str(x._dtype), x._strides)     # str: a structured dtype's fields


# ---- dask.distributed: per-worker managers and chunk serialization ------------------------

try:
    from distributed import WorkerPlugin
    from distributed.protocol import dask_deserialize, dask_serialize
except ImportError:                   # the chunk type works without distributed
    WorkerPlugin = None


def _release(mref, obj):
    m = mref()
    if m is not None and not m.closed and obj._pins > 0:
        m.unpin(obj, detached=True)


def _frame(x):
    """x's bytes as one flat uint8 buffer in C order: in place (pinned until the buffer is let
    go) when x is contiguous, else a copy.  Bytes, not x's dtype: Python's buffers have no
    format for datetimes, and none for empty arrays' casts."""
    m, obj = x._m, x._obj
    if not x.flags.c_contiguous:
        with readable(x) as v:
            return _bytes(np.ascontiguousarray(v))
    m.pin(obj, detached=True)
    try:
        holder = _bytes(x._view(readonly=True))
        weakref.finalize(holder, _release, weakref.ref(m), obj)
    except BaseException:
        m.unpin(obj, detached=True)
        raise
    return holder


def _bytes(v):
    """A C-contiguous ndarray's bytes as a 1-d uint8 ndarray (a view)."""
    return v.reshape(-1).view(np.uint8)


def _dtype_header(dtype: np.dtype):
    """A header field that gives ``dtype`` back: its string for plain dtypes, a pickle of it
    for structured ones (their string, ``|V<n>``, loses the fields, offsets and titles)."""
    if dtype.fields is None and dtype.subdtype is None:
        return dtype.str
    return pickle.dumps(dtype)


def _header_dtype(field) -> np.dtype:
    return pickle.loads(field) if isinstance(field, bytes) else np.dtype(field)


if WorkerPlugin is not None:
    @dask_serialize.register(CachedArray)
    def _serialize(x):
        frame = _frame(x)
        x._m.count("dask_sent", x.nbytes)
        return {"dtype": _dtype_header(x._dtype), "shape": list(x._shape)}, [memoryview(frame)]

    @dask_deserialize.register(CachedArray)
    def _deserialize(header, frames):
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        dtype, shape = _header_dtype(header["dtype"]), tuple(header["shape"])
        want = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if memoryview(data).nbytes != want:
            raise ValueError(f"a CachedArray chunk of shape {shape} and dtype {dtype} arrived "
                             f"with {memoryview(data).nbytes} bytes, not {want}: the frame was "
                             f"cut or mixed up in transit")
        arr = np.frombuffer(data, dtype=np.uint8).view(dtype).reshape(shape)
        m = default_manager()
        out = asarray(arr, manager=m)
        m.count("dask_received", out.nbytes)
        return out

    class ManagerPlugin(WorkerPlugin):
        """A worker plugin: every worker keeps its chunks in its own Manager(**options),
        its default manager from start to shutdown."""

        name = "cachedarrays-manager"

        def __init__(self, fast="256MiB", slow="4GiB", slow_path=None, policy="lru", **options):
            self.options = dict(fast=fast, slow=slow, slow_path=slow_path, policy=policy,
                                **options)
            self.manager = None
            self._previous = None

        def setup(self, worker):
            self.manager = Manager(**self.options)
            self._previous = set_default_manager(self.manager)

        def teardown(self, worker):
            m, self.manager = self.manager, None
            if m is None:
                return
            if default_manager() is m:
                set_default_manager(self._previous)
            m.close()
else:
    class ManagerPlugin:
        def __init__(self, *args, **kwargs):
            raise ImportError("ManagerPlugin needs distributed: pip install 'cachedarrays[dask]'")
