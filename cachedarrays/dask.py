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
chunks it creates or receives land there; ``slow_path`` and tier paths name directories) and
closes it at shutdown, or, while its arrays are still in use (chunks persisted before the
plugin was replaced, results that a worker in the client's process handed over), when the last
of them is gone; the default manager from before the workers is given back. Workers should run
with ``memory_limit=0``: the plugin warns when distributed also spills their memory. A
CachedArray chunk is sent as one frame over its bytes in place, held by a pin that no thread
owns until the frame is let go (no copy on send), and received into the receiving process's
default manager; both directions are counted (``stats()["events"]["dask_sent"]`` /
``["dask_received"]``).

Needs the optional extra ``[dask]`` (``pip install cachedarrays[dask]``).
"""

from __future__ import annotations

import atexit
import gc
import inspect
import logging
import math
import os
import pickle
import threading
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
from .errors import DeviceError
from .manager import Manager
from .scopes import readable
from .sizes import parse_size

__all__ = ["CachedArray", "ManagerPlugin"]

log = logging.getLogger(__name__)

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


def _header_shape(field) -> tuple:
    """The shape a header names: a list of lengths (ints >= 0), or ValueError."""
    if (not isinstance(field, (list, tuple))
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in field)):
        raise ValueError(f"a CachedArray chunk arrived with shape {field!r} in its header, not "
                         f"a list of lengths >= 0: the header was mixed up in transit")
    return tuple(field)


# ---- the workers' managers in this process ------------------------------------------------

_lock = threading.Lock()
_installed = []       # the managers of the workers running in this process, oldest first
_outside = []         # the default manager from before the first of them (or None)


def _install(m):
    """Make m this process's default manager, remembering the default from before."""
    with _lock:
        previous = set_default_manager(m)
        if not _installed:
            _outside[:] = [previous]
        _installed.append(m)


def _uninstall(m):
    """Stop making m the default: the newest other worker's manager of this process takes
    over, or, after the last one, the default from before the workers started.  A default
    set by anyone else meanwhile stays."""
    with _lock:
        if m not in _installed:
            return
        _installed.remove(m)
        after = _installed[-1] if _installed else _outside.pop()
        current = set_default_manager(after if after is None or not after.closed else None)
        if current is not m:
            set_default_manager(current)


def _forget_in_child():
    """A forked child's workers are its own: its parent's managers are refused there."""
    global _lock
    _lock = threading.Lock()
    _installed.clear()
    _outside.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _close_unless_used(m):
    """Close m now if none of its arrays is still in use; else let go of it: it closes when
    its last array is gone (a persisted chunk, a result that an in-process worker handed to
    the client) or when the process exits."""
    if m.objects():
        gc.collect()                       # arrays only kept by reference cycles
    if not m.objects():
        m.close()
        return
    atexit.register(_close_at_exit, weakref.ref(m))


def _close_at_exit(mref):
    m = mref()
    if m is not None:
        try:
            m.close(timeout=0)
        except Exception:                  # pinned by a thread that never ends: exit anyway
            pass


def _warn_spilling(worker):
    """Say so when distributed also manages this worker's memory: past a share of its
    memory_limit it pickles chunks out of the manager to its spill folder, and it pauses the
    worker on process memory, which counts the manager's mapped tiers."""
    limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
    if limit:
        log.warning("worker %s has memory_limit=%d bytes: distributed will spill CachedArray "
                    "chunks to its own folder and pause the worker on memory the manager's "
                    "tiers map; start the workers with memory_limit=0 and size them with "
                    "ManagerPlugin(fast=..., slow=...)", getattr(worker, "address", "?"), limit)
        return True
    return False


def _check_options(options):
    """Refuse on the client what every worker would refuse: a Manager among the options
    (each worker builds its own), an option it does not take, sizes that are not sizes, a
    shared slow_path."""
    try:
        inspect.signature(Manager).bind(**options)
    except TypeError as e:
        raise TypeError(f"ManagerPlugin: {e}; it takes Manager's options") from None
    for key, value in options.items():
        if isinstance(value, Manager):
            raise TypeError(f"ManagerPlugin: {key}= is a Manager; the plugin takes a Manager's "
                            f"options (fast=, slow=, slow_path=, policy=, ...) and every worker "
                            f"builds its own Manager from them")
    parse_size(options["fast"], "fast memory size")
    parse_size(options["slow"], "slow memory size")
    _check_paths(options)


def _check_paths(options, here=False):
    """Check slow_path and the path of every tier in tiers=[(name, size, path), ...]."""
    _check_slow_path(options["slow_path"], here=here)
    tiers = options.get("tiers")
    if isinstance(tiers, (list, tuple)):
        for spec in tiers:
            if isinstance(spec, (list, tuple)) and len(spec) > 2:
                _check_slow_path(spec[2], here=here, what=f"the path of tier {spec[0]!r}")
            elif not isinstance(spec, (list, tuple)):
                raise TypeError(f"ManagerPlugin: tiers= takes (name, size[, path]) tuples, "
                                f"not {type(spec).__name__}: every worker builds its own "
                                f"devices from them")


def _check_slow_path(path, here=False, what="slow_path"):
    """Refuse a path every worker would share: a file or a device, not a directory.
    On the client only a path that exists can be judged; on a worker (here) any path."""
    if path is None:
        return
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"ManagerPlugin: {what} must be a directory (str or os.PathLike) "
                        f"or None, not {type(path).__name__}")
    path = os.fsdecode(os.fspath(path))
    if os.path.isdir(path) or not (here or os.path.lexists(path)):
        return
    why = "does not exist" if not os.path.lexists(path) else "is not a directory"
    raise DeviceError(f"ManagerPlugin: {what} {path!r} {why}: every worker of the cluster "
                      f"would map that one file or device; pass a directory, where each worker "
                      f"makes its own private file, or None for a temporary file")


if WorkerPlugin is not None:
    @dask_serialize.register(CachedArray)
    def _serialize(x):
        frame = _frame(x)
        x._m.count("dask_sent", x.nbytes)
        return {"dtype": _dtype_header(x._dtype), "shape": list(x._shape)}, [memoryview(frame)]

    @dask_deserialize.register(CachedArray)
    def _deserialize(header, frames):
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        dtype, shape = _header_dtype(header["dtype"]), _header_shape(header["shape"])
        want = dtype.itemsize * math.prod(shape)          # Python ints: no overflow
        if memoryview(data).nbytes != want:
            raise ValueError(f"a CachedArray chunk of shape {shape} and dtype {dtype} arrived "
                             f"with {memoryview(data).nbytes} bytes, not {want}: the frame was "
                             f"cut or mixed up in transit")
        # np.ndarray over the bytes, not a cast of them: dtypes of no bytes (np.dtype([]))
        arr = np.ndarray(shape, dtype=dtype, buffer=np.frombuffer(data, dtype=np.uint8))
        m = default_manager()
        out = asarray(arr, manager=m)
        m.count("dask_received", out.nbytes)
        return out

    class ManagerPlugin(WorkerPlugin):
        """A worker plugin: every worker keeps its chunks in its own Manager(**options),
        its default manager from start to shutdown.  ``slow_path`` names a directory (each
        worker makes its own private file there) or None for a temporary file."""

        name = "cachedarrays-manager"

        def __init__(self, fast="256MiB", slow="4GiB", slow_path=None, policy="lru", **options):
            self.options = dict(fast=fast, slow=slow, slow_path=slow_path, policy=policy,
                                **options)
            _check_options(self.options)
            self.manager = None

        def setup(self, worker):
            _check_paths(self.options, here=True)
            self.manager = Manager(**self.options)
            _install(self.manager)
            _warn_spilling(worker)

        def teardown(self, worker):
            m, self.manager = self.manager, None
            if m is not None:
                _uninstall(m)
                _close_unless_used(m)
else:
    class ManagerPlugin:
        def __init__(self, *args, **kwargs):
            raise ImportError("ManagerPlugin needs distributed: pip install 'cachedarrays[dask]'")
