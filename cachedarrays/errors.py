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


_LIBRARY = __name__.rpartition(".")[0] + "."
_NOTE = "raised by the policy hook"


def note_policy_error(exc, policy, hook=None):
    """Add a note to exc naming the method of a program's own policy it came from (class and
    hook), once; nothing when no frame of that method is in exc's traceback (the library's
    own errors keep their messages). Returns exc."""
    if any(str(n).startswith(_NOTE) for n in getattr(exc, "__notes__", ())):
        return exc
    methods = _method_codes(type(policy))
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in methods:
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    own = [f for f in frames if not str(f.f_globals.get("__name__", "")).startswith(_LIBRARY)]
    if not own:
        return exc
    cls = type(policy).__name__
    hook = hook or frames[0].f_code.co_name
    where = own[-1].f_code.co_name
    inner = f" (in {cls}.{where})" if where != hook else ""
    try:
        exc.add_note(f"{_NOTE} {cls}.{hook}{inner}: the manager stays consistent "
                     f"(m.check() holds); fix {cls}.{hook} or catch the error inside it")
    except (AttributeError, TypeError):      # __notes__ replaced by something else
        pass
    return exc


def _method_codes(cls):
    """The code objects of the methods cls has or inherits (functions, static and class
    methods), to find its frames in a traceback without reading their locals."""
    codes = set()
    for klass in cls.__mro__:
        for v in vars(klass).values():
            code = getattr(getattr(v, "__func__", v), "__code__", None)
            if code is not None:
                codes.add(code)
    return codes
