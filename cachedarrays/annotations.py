"""Annotations: tell the policy what the application knows (dissertation §4.5, Listings 4.6–4.8).

``prefetch``, ``evict``, ``softevict`` and ``unsafe_free`` accept arrays or anything holding
arrays (containers, dataclasses, objects, closures) and raise ``UseAfterFreeError`` for a freed
array among them; ``preserve``/``cleanup`` free what a backward pass no longer needs;
``noescape`` frees temporaries that do not escape a call; and ``annotate`` wraps a layer's call
method with all of these. ``cleanup`` and ``noescape`` never free an array that something
outside what they walk still refers to: CPython's reference counts tell.
"""

import functools
import gc
import numbers
import sys
import threading
import types

import numpy as np

from ._records import walk as _c_walk
from .array import CachedArray, pop_scope, push_scope
from .copyengine import check_switch
from .devices import Device
from .errors import UseAfterFreeError
from .manager import Manager, Object, Region
from .poison import Poison
from .policies.base import Policy
from .sizes import format_size
from .telemetry import Telemetry

# Types the walkers never look inside: values that cannot hold arrays, then the library's own
# machinery, which holds none of the program's arrays (register_leaf_type adds more).
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), np.ndarray, np.generic,
           type, types.ModuleType, range, slice,
           Manager, Object, Region, Device, Telemetry, Poison, Policy)
_LEAVES_LOCK = threading.Lock()


def register_leaf_type(cls):
    """Tell the walkers (onobjects, prefetch, cleanup, ...) never to look inside instances of cls
    or its subclasses: for objects met often (e.g. in every pullback closure) that hold no
    arrays of their own. Returns cls, so it also works as a class decorator."""
    global _LEAVES
    if not isinstance(cls, type):
        raise TypeError(f"register_leaf_type takes a class, not {type(cls).__name__}")
    if issubclass(cls, CachedArray) or issubclass(CachedArray, cls):
        raise TypeError(f"{cls.__name__} cannot be a leaf type: CachedArrays would count as "
                        "leaves and the walkers would miss them; register a class whose "
                        "instances hold no arrays")
    with _LEAVES_LOCK:
        if not issubclass(cls, _LEAVES):
            _LEAVES = _LEAVES + (cls,)
            _KINDS.clear()          # kinds were computed against the old leaf types
    return cls


# What the walkers do with an object, by its type (cached per type in _KINDS; see _kind).
_ARRAY, _LEAF, _SEQ, _DICT, _FUNC, _CELL, _SET, _METHOD, _PARTIAL, _SKIP, _OBJ = range(11)
_KINDS = {}


def _kind(t):
    """The walkers' kind of type t (cached; register_leaf_type clears the cache). The common
    containers are always walked; for any other type an array, then a leaf type, wins."""
    k = _KINDS.get(t)
    if k is not None:
        return k
    if t not in _PLAIN and issubclass(t, CachedArray):
        k = _ARRAY
    elif t not in _PLAIN and issubclass(t, _LEAVES):
        k = _LEAF
    elif t is types.FunctionType:
        k = _FUNC
    elif issubclass(t, (list, tuple)):
        k = _SEQ
    elif issubclass(t, dict):
        k = _DICT
    elif t is types.CellType:
        k = _CELL
    elif issubclass(t, (set, frozenset)):
        k = _SET
    elif issubclass(t, types.MethodType):
        k = _METHOD
    elif issubclass(t, functools.partial):
        k = _PARTIAL
    elif issubclass(t, (types.BuiltinFunctionType, types.GeneratorType)):
        k = _SKIP
    else:
        k = _OBJ
    _KINDS[t] = k
    return k


def _walk(xs, found, containers=None):
    """Walk everything reachable from xs (see onobjects), each container once.

    Without ``containers``: ``found[id(obj)]`` = the first CachedArray found on each object.
    With it (for cleanup): ``found[id(a)] = [a, n]`` for every CachedArray found, n the
    references to it the walk met: slots of xs and of the walked containers (list items, dict
    values, closure cells, attributes); ``containers`` gets the same for every container that
    holds anything to walk. Each reference is counted at most once (cells are containers of
    their own, as closures may share them), so n never exceeds the references that exist.

    The walk runs in C (``native/walk.c``), depth first from the first of xs, with an explicit
    stack: lists, tuples and dict values item by item; a function's keyword defaults, defaults
    and closure cells; cells, sets, bound methods (function, then instance), partials
    (keywords, args, func); any other object's ``__dict__``, then its slots. Leaves (see
    ``_kind``) are never pushed, and everything on the stack is kept alive until visited.
    """
    _c_walk(xs, found, containers, _KINDS, _kind, _slots)


_PLAIN = frozenset((list, tuple, dict, types.FunctionType, types.CellType))


@functools.lru_cache(maxsize=512)
def _slots(cls):
    """The slot descriptors of cls and its bases, cached per class (a subclass may hide a base's
    slot of the same name: each is a slot of its own)."""
    out = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{c.__name__.lstrip('_')}{name}"      # name mangling
            descr = c.__dict__.get(name)
            if type(descr) is types.MemberDescriptorType:
                out.append(descr)
    return tuple(out)


def _freed_error(op, a):
    obj = a._obj
    fix = ("cannot be freed twice" if op == "unsafe_free" else
           "has no data left to move or locate")
    return UseAfterFreeError(
        f"ca.{op}: CachedArray of shape {a._shape} and dtype {a._dtype} (object {obj.id}, "
        f"{format_size(obj.nbytes)}) was already freed and {fix}; drop references to an "
        "array (and its views) once it is freed")


def _live_arrays(xs, op=None):
    """One CachedArray per distinct object reachable from xs, in the order found.

    Freed arrays are skipped, or raise UseAfterFreeError naming the annotation ``op`` if given.
    """
    found = {}
    if all(type(x) is CachedArray for x in xs):          # the common case: just arrays
        for x in xs:
            if id(x._obj) not in found:
                found[id(x._obj)] = x
    else:
        _walk(xs, found)
    out = []
    for x in found.values():
        if x._obj.freed:
            if op is not None:
                raise _freed_error(op, x)
            continue
        out.append(x)
    return out


def onobjects(fn, *xs):
    """Call fn(array) once per distinct live object reachable from xs; returns how many were found.

    Walks tuples, lists, sets, dicts, objects' attributes (``__dict__`` and ``__slots__``, so
    dataclasses too), bound methods, functools.partial and closures' captured cells. Cycles are
    visited once; freed arrays are skipped. Globals of functions are never walked, nor managers,
    devices, policies and the types given to ``register_leaf_type`` (they hold no arrays of
    their own).
    """
    arrays = _live_arrays(xs)
    for arr in arrays:
        fn(arr)
    return len(arrays)


def arrays_in(*xs):
    """One CachedArray per distinct live object reachable from xs."""
    return _live_arrays(xs)


def _policy_call(op, arr, strict, *args):
    m = arr._m
    obj = arr._obj
    with m.atomic():
        if obj.freed:                    # freed by another thread since the walk
            if strict:
                raise _freed_error(op, arr)
            return None
        if op == "unsafe_free":
            return m.policy.unsafe_free(obj)
        return getattr(m, op)(obj, *args)    # the manager's door: traces see the request


def _each(op, xs, strict, *args):
    """Call the policy's ``op`` on every live object reachable from xs. strict: a freed array
    raises UseAfterFreeError (the user calls); else freed arrays are skipped (annotate's own)."""
    for x in xs:
        if isinstance(x, (str, bytes, numbers.Number, np.generic)):
            opts = {"prefetch": "force= and wait=", "evict": "to= and wait="}.get(op)
            raise TypeError(f"ca.{op} takes arrays (or things holding arrays) as positional "
                            f"arguments, got {x!r}"
                            + (f"; pass {opts} by keyword, e.g. ca.{op}(x, "
                               f"{'to=' + repr(x) if op == 'evict' and isinstance(x, str) else 'wait=False'})"
                               if opts else ""))
    for a in _live_arrays(xs, op if strict else None):
        _policy_call(op, a, strict, *args)


def prefetch(*xs, force=False, wait=True):
    """Ask the policy to move every array in xs into fast memory (force: evict to make room).

    wait=False returns at once while the copies run in the background; a kernel that uses an
    array whose copy is still running waits for it (counted as stall). A freed array in xs,
    passed directly or found inside a container, raises UseAfterFreeError; so do evict,
    softevict and unsafe_free.
    """
    _each("prefetch", xs, True, _switch("prefetch", "force", force),
          _switch("prefetch", "wait", wait))


def evict(*xs, to=None, wait=True):
    """Ask the policy to move every array in xs out of fast memory now.

    to: the device to move them to (a tier name; default the slow device). wait=False returns
    at once while the copies run in the background.
    """
    _each("evict", xs, True, to, _switch("evict", "wait", wait))


def _switch(op, name, v):
    """v if it is True or False; TypeError otherwise (the text "no" or None is no answer)."""
    return check_switch(v, f"ca.{op}: {name}")


def softevict(*xs):
    """Mark every array in xs as the first to evict when fast memory runs short."""
    _each("softevict", xs, True)


def mark_layer(*managers):
    """Mark a layer boundary of the running program (traces record it; plans fire on it).

    With no argument every open manager is marked; pass managers to mark only those.
    """
    _mark("layer", managers)


def mark_step(*managers):
    """Mark the end of one step (one repeating iteration) of the running program."""
    _mark("step", managers)


def _mark(kind, managers):
    for m in managers or Manager.open_managers():
        if not isinstance(m, Manager):
            raise TypeError(f"mark_{kind} takes Managers, got {type(m).__name__}")
        m.mark(kind)


def in_fast(x):
    """True if x's newest data is in fast memory (UseAfterFreeError if x was freed; False if
    it was dropped)."""
    if x._obj.freed:
        raise _freed_error("in_fast", x)
    if x._obj.dropped:
        return False
    return x.manager.policy.in_fast(x._obj)


def drop(*xs):
    """Let the data of every array in xs go (no write-back): each is rebuilt bitwise from the
    ``ca.compute`` kernels that made it at its next use. RecomputeError names the reason when
    an array cannot be rebuilt (see ``Manager.why_not_regenerable``)."""
    _each("drop", xs, True, True)


def regenerate(*xs):
    """Rebuild every dropped array in xs now (its next use would do it anyway)."""
    _each("regenerate", xs, True, True)


def unsafe_free(*xs):
    """Free every array in xs now; later use of them (or their views) raises, and so does
    freeing one again."""
    if len(xs) == 1 and type(xs[0]) is CachedArray:     # the common call: no walk
        _policy_call("unsafe_free", xs[0], True)
        return
    _each("unsafe_free", xs, True)


def preserve(*xs):
    """The set of objects reachable from xs, to pass as ``keep`` to cleanup."""
    return {a._obj.id for a in _live_arrays(xs)}


# References to ``e[0]`` that ``sys.getrefcount(e[0]) - e[1]`` counts beyond the e[1] known
# ones when only the list e holds it (the list's slot and the call's argument); measured once,
# so that the accounting holds whatever the interpreter's calling convention.
_probe = [object(), 0]
_OWN_REFS = sys.getrefcount(_probe[0]) - _probe[1]
del _probe


def cleanup(x, keep=()):
    """Free every array reachable from x, except those in keep (a preserve() set or arrays), that
    nothing outside x refers to.

    x is what the caller is done with, e.g. ``(y, dy, pullback)`` once the pullback has run: x
    and, when x is a tuple, list or dict, its items may be held elsewhere. An array stays when
    anything else refers to it or to its memory: a variable, a global, a live object, a view,
    or a container deeper inside x (a closure's cell, a captured list, an object) that something
    outside x also holds (an array passed as x itself is the caller's, so it stays: free that
    with unsafe_free). Already freed and pinned arrays are left alone; nothing is freed when
    the policy's cleanup switch is off. Returns the number of arrays freed.
    """
    keep_ids = keep if isinstance(keep, set) else preserve(keep)
    return _free_unreferenced(x, keep_ids)


def _count_bases(arrays):
    """Count in arrays (id -> [array, references met]) the reference each view holds to the
    array it was taken from (its ``base``), adding that array if the walk did not meet it."""
    for e in list(arrays.values()):
        owner = e[0]._base
        if owner is not None:
            o = arrays.get(id(owner))
            if o is None:
                arrays[id(owner)] = [owner, 1]
            else:
                o[1] += 1


def _free_unreferenced(x, keep_ids):
    roots = (x,)                        # alive until the counts are checked, as they include it
    arrays, containers = {}, {}
    _walk(roots, arrays, containers)
    _count_bases(arrays)
    base = _OWN_REFS
    # An object may go only if every CachedArray on it (views included) was found, and no
    # reference to any of them, or to the object itself, comes from outside the walk.
    blocked = set(keep_ids)
    objects = {}
    for e in arrays.values():
        oid = e[0]._obj.id
        if sys.getrefcount(e[0]) - e[1] != base:
            blocked.add(oid)
        o = objects.get(oid)
        if o is None:
            objects[oid] = [e[0]._obj, 1]
        else:
            o[1] += 1
    arrays.clear()
    candidates = [o for oid, o in objects.items()
                  if oid not in blocked and sys.getrefcount(o[0]) - o[1] == base]
    objects.clear()
    reached = set()
    if candidates:
        # A container deeper inside x that something else also refers to exposes all it
        # reaches; x and, for a tuple, list or dict, its items are what the caller is done with.
        named = {id(x)}
        if isinstance(x, (tuple, list)):
            named.update(id(i) for i in x)
        elif isinstance(x, dict):
            named.update(id(i) for i in x.values())
        exposed = [e[0] for k, e in containers.items()
                   if k not in named and sys.getrefcount(e[0]) - e[1] != base]
        containers.clear()
        if exposed:
            reached = preserve(*exposed)
        del exposed
    freed = 0
    for o in candidates:
        obj = o[0]
        if obj.id in reached:
            continue
        m = obj.manager
        if m is None or not getattr(m.policy, "allows_cleanup", True):
            continue
        with m.atomic():
            if not obj.freed and not m.pinned(obj):
                m.policy.unsafe_free(obj)
                freed += 1
    return freed


def noescape(fn):
    """Decorator: free what the call allocated that neither its result nor its arguments reach.

    CPython frees such a temporary as soon as nothing refers to it. One that outlives the call
    stays if something still refers to it (a global, a cache, an object the caller holds); one
    that only a reference cycle keeps alive goes in a collection of the young generations
    (``gc.collect(1)``), run only when such a survivor exists. Only allocations made by the
    calling thread count, so other threads are never affected.
    """
    _check_callable("noescape", fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rec = push_scope()
        try:
            result = fn(*args, **kwargs)
        finally:
            pop_scope(rec)
        if rec and _unexplained_survivor(rec, result, args, kwargs):
            gc.collect(1)
        return result
    return wrapper


def _unexplained_survivor(rec, *xs):
    """True if an object recorded in rec is alive, under a policy that allows cleanup, and not
    reachable from xs."""
    alive = set()
    for ref in rec:
        obj = ref()
        if obj is not None and not obj.freed:
            m = obj.manager
            if m is not None and getattr(m.policy, "allows_cleanup", True):
                alive.add(obj.id)
    return bool(alive) and not alive <= preserve(*xs)


def annotate(prefetch=True, softevict=True, cleanup=False, noescape=False):
    """Decorator for a layer's call method (Listing 4.6).

    prefetch: force-prefetch the arrays in the arguments (``self`` included) before the call.
    softevict: soft-evict them after the call.
    noescape: free temporaries that do not escape the call.
    cleanup: for rrule-style functions returning ``(y, pullback)``, wrap the pullback so that it
    prefetches what it captured, and after it runs frees what it captured, ``y`` and the
    incoming gradient, except the call's arguments, the pullback's results and whatever anything
    else still refers to (so the caller's own ``y`` and ``dy`` stay usable).
    These implicit prefetches and soft evictions skip freed arrays.
    """
    _check_switches(prefetch=prefetch, softevict=softevict, cleanup=cleanup, noescape=noescape)
    do_prefetch, do_softevict, do_cleanup, do_noescape = prefetch, softevict, cleanup, noescape

    def decorator(fn):
        _check_callable("annotate(...)", fn)
        inner = globals()["noescape"](fn) if do_noescape else fn

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if do_prefetch:
                _each("prefetch", (args, kwargs), False, True)
            result = inner(*args, **kwargs)
            if do_softevict:
                _each("softevict", (args, kwargs), False)
            if do_cleanup and isinstance(result, tuple) and len(result) == 2 and \
                    callable(result[1]):
                return result[0], _wrap_pullback(list(result), args, kwargs, do_prefetch,
                                                 do_softevict)
            return result
        return wrapper
    return decorator


def _check_callable(what, fn):
    """Raise TypeError unless fn can be decorated."""
    if not callable(fn):
        raise TypeError(f"ca.{what} decorates a function, got {type(fn).__name__}; write "
                        f"@ca.{what} above a def")


def _check_switches(**switches):
    """Raise TypeError unless every annotate switch is True or False (a function among them
    means ``@ca.annotate`` was written without its parentheses)."""
    for name, v in switches.items():
        if callable(v):
            raise TypeError("ca.annotate takes switches, not the function: write "
                            "@ca.annotate() or @ca.annotate(cleanup=True, ...) above the def, "
                            "with the parentheses")
        check_switch(v, f"ca.annotate: {name}")


def _wrap_pullback(captured, args, kwargs, do_prefetch, do_softevict):
    """Wrap captured = [y, pullback]; the list is the wrapper's only reference to either, and dy
    joins it for the cleanup, so cleanup sees exactly who else refers to them."""
    def pullback_wrapper(dy):
        if do_prefetch:
            _each("prefetch", (captured[1], dy), False, True)
        grads = captured[1](dy)
        captured.append(dy)
        del dy
        try:
            cleanup(captured, keep=preserve(args, kwargs, grads))
        finally:
            del captured[2:]
        if do_softevict:
            _each("softevict", (args, kwargs), False)
        return grads

    functools.update_wrapper(pullback_wrapper, captured[1])
    del pullback_wrapper.__wrapped__    # a second reference to the pullback would pin its captures
    return pullback_wrapper
