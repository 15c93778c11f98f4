"""Exception types. Every message names the object, the sizes involved and what to do."""


class CachedArraysError(Exception):
    """Base class of every error raised by cachedarrays."""


class OutOfMemoryError(CachedArraysError, MemoryError):
    """A device has no free block large enough; the heap and every object stay intact."""


class DeviceError(CachedArraysError, OSError):
    """A device could not be created: bad path, no room, or a failed mapping."""


class UseAfterFreeError(CachedArraysError, RuntimeError):
    """An object, region or array was used after it was freed."""


class PinnedError(CachedArraysError, RuntimeError):
    """An operation needs to move an object that is pinned by a running kernel or an open scope."""


class HeapCorruptionError(CachedArraysError, RuntimeError):
    """A heap invariant does not hold (reported by Heap.check)."""


class RecomputeError(CachedArraysError, RuntimeError):
    """An array cannot be dropped or regenerated: its data cannot be recomputed from its lineage
    (an input was freed or changed, or a kernel that wrote it is not a ``ca.compute`` kernel)."""
