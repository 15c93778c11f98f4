"""Annotations: tell the policy what the application knows (dissertation §4.5, Listings 4.6–4.8).

``prefetch``, ``evict``, ``softevict`` and ``unsafe_free`` accept arrays or anything holding
arrays (containers, dataclasses, objects, closures); ``preserve``/``cleanup`` free what a
backward pass no longer needs; ``noescape`` frees temporaries that do not escape a call; and
``annotate`` wraps a layer's call method with all of these.
"""

import dataclasses
import functools
import types

import numpy as np

from .array import CachedArray, pop_scope, push_scope

_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), np.ndarray, np.generic,
           type, types.ModuleType, range, slice)


def onobjects(fn, *xs):
    """Call fn(array) once per distinct object reachable from xs; returns how many were found.

    Walks tuples, lists, sets, dicts, dataclasses, objects' attributes (``__dict__`` and
    ``__slots__``), bound methods, functools.partial and closures' captured cells. Cycles are
    visited once. Globals of functions are never walked, nor classes that set
    ``__ca_leaf__ = True`` (managers, devices, policies: they hold no arrays of their own).
    """
    found = {}
    if all(type(x) is CachedArray for x in xs):          # the common case: just arrays
        for x in xs:
            if id(x._obj) not in found and not x._obj.freed:
                found[id(x._obj)] = x
        for arr in found.values():
            fn(arr)
        return len(found)
    seen = set()
    stack = list(reversed(xs))
    # An explicit stack rather than a recursive closure: a closure that refers to itself is a
    # reference cycle, which would keep the arrays it saw alive until the cyclic collector ran.
    while stack:
        x = stack.pop()
        if isinstance(x, CachedArray):
            oid = id(x._obj)
            if oid not in found and not x._obj.freed:
                found[oid] = x
            continue
        if isinstance(x, _LEAVES) or getattr(type(x), "__ca_leaf__", False):
            continue
        key = id(x)
        if key in seen:
            continue
        seen.add(key)
        if isinstance(x, (list, tuple)):
            stack.extend([y for y in reversed(x) if not isinstance(y, _LEAVES)])
        elif isinstance(x, (set, frozenset)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        elif isinstance(x, types.MethodType):
            stack.append(x.__func__)
            stack.append(x.__self__)
        elif isinstance(x, functools.partial):
            stack.extend((x.keywords, x.args, x.func))
        elif isinstance(x, types.FunctionType):
            if x.__defaults__:
                stack.append(x.__defaults__)
            for cell in reversed(x.__closure__ or ()):
                try:
                    stack.append(cell.cell_contents)
                except ValueError:      # empty cell
                    pass
        elif isinstance(x, (types.BuiltinFunctionType, types.GeneratorType)):
            continue
        else:
            if dataclasses.is_dataclass(x):
                stack.extend(getattr(x, f.name, None) for f in dataclasses.fields(x))
            d = getattr(x, "__dict__", None)
            if isinstance(d, dict):
                stack.append(d)
            for cls in type(x).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if name not in ("__dict__", "__weakref__"):
                        try:
                            stack.append(getattr(x, name))
                        except AttributeError:
                            pass
    for arr in found.values():
        fn(arr)
    return len(found)


def arrays_in(*xs):
    """One CachedArray per distinct object reachable from xs."""
    out = []
    onobjects(out.append, *xs)
    return out


def _policy_call(name, arr, *args):
    m = arr.manager
    with m._lock:
        if arr._obj.freed:
            return None
        return getattr(m.policy, name)(arr._obj, *args)


def _prefetch_one(arr, force):
    m = arr._m
    obj = arr._obj
    with m._lock:
        if obj.freed:
            return None
        r = obj.primary
        if r is not None and r.device is m.fast:       # already there: only a use
            m.policy.read_use(obj)
            return True
        return m.policy.prefetch(obj, force)


def prefetch(*xs, force=False):
    """Ask the policy to move every array in xs into fast memory (force: evict to make room)."""
    onobjects(lambda a: _prefetch_one(a, force), *xs)


def evict(*xs):
    """Ask the policy to move every array in xs to slow memory now."""
    onobjects(lambda a: _policy_call("evict", a), *xs)


def softevict(*xs):
    """Mark every array in xs as the first to evict when fast memory runs short."""
    onobjects(lambda a: _policy_call("softevict", a), *xs)


def in_fast(x):
    """True if x's newest data is in fast memory."""
    return x.manager.policy.in_fast(x._obj)


def unsafe_free(*xs):
    """Free every array in xs now; later use of them (or their views) raises."""
    onobjects(lambda a: _policy_call("unsafe_free", a), *xs)


def preserve(*xs):
    """The set of objects reachable from xs, to pass as ``keep`` to cleanup."""
    keep = set()
    onobjects(lambda a: keep.add(a._obj.id), *xs)
    return keep


def cleanup(x, keep=()):
    """Free every array reachable from x except those in keep (a preserve() set or arrays).

    Does nothing when the policy's cleanup switch is off. Pinned arrays are left alone.
    Returns the number of arrays freed.
    """
    keep_ids = keep if isinstance(keep, set) else preserve(keep)
    freed = [0]

    def maybe_free(a):
        obj = a._obj
        m = a.manager
        if obj.id in keep_ids or not getattr(m.policy, "allows_cleanup", True):
            return
        with m._lock:
            if not obj.freed and not obj.pins:
                m.policy.unsafe_free(obj)
                freed[0] += 1

    onobjects(maybe_free, x)
    return freed[0]


def noescape(fn):
    """Decorator: free arrays allocated during the call that neither result nor args reach.

    Only allocations made by the calling thread count, so other threads are never affected.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rec = push_scope()
        try:
            result = fn(*args, **kwargs)
        finally:
            pop_scope(rec)
        # Only a temporary still alive after the call needs the reachability walk.
        if any((o := ref()) is not None and not o.freed for ref in rec):
            keep = preserve(result, args, kwargs)
            for ref in rec:
                obj = ref()
                if obj is None or obj.freed or obj.id in keep or obj.pins:
                    continue
                m = obj._manager()
                if m is None or not getattr(m.policy, "allows_cleanup", True):
                    continue
                with m._lock:
                    if not obj.freed and not obj.pins:
                        m.policy.unsafe_free(obj)
        return result
    return wrapper


def annotate(prefetch=True, softevict=True, cleanup=False, noescape=False):
    """Decorator for a layer's call method (Listing 4.6).

    prefetch: force-prefetch the arrays in the arguments (``self`` included) before the call.
    softevict: soft-evict them after the call.
    noescape: free temporaries that do not escape the call.
    cleanup: for rrule-style functions returning ``(y, pullback)``, wrap the pullback so that it
    prefetches what it captured, and after it runs frees everything it captured except the
    call's arguments and the pullback's results.
    """
    do_prefetch, do_softevict, do_cleanup, do_noescape = prefetch, softevict, cleanup, noescape

    def decorator(fn):
        inner = globals()["noescape"](fn) if do_noescape else fn

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if do_prefetch:
                globals()["prefetch"](args, kwargs, force=True)
            result = inner(*args, **kwargs)
            if do_softevict:
                globals()["softevict"](args, kwargs)
            if do_cleanup and isinstance(result, tuple) and len(result) == 2 and \
                    callable(result[1]):
                y, pullback = result
                return y, _wrap_pullback(y, pullback, args, kwargs, do_prefetch, do_softevict)
            return result
        return wrapper
    return decorator


def _wrap_pullback(y, pullback, args, kwargs, do_prefetch, do_softevict):
    @functools.wraps(pullback)
    def pullback_wrapper(dy):
        if do_prefetch:
            prefetch(pullback, dy, force=True)
        grads = pullback(dy)
        cleanup((y, dy, pullback), keep=preserve(args, kwargs, grads))
        if do_softevict:
            softevict(args, kwargs)
        return grads
    return pullback_wrapper
