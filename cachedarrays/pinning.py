"""Pinning what a call uses: the view of an object's current bytes, objects for new arrays,
reads and writes acquired together (across managers), and pinned views for with-blocks.

``ObjectView`` is the part of an array that resolves its bytes: a view description (dtype,
shape, strides, byte offset) over a manager's Object, never a pointer. ``CachedArray`` (in
``cachedarrays.array``) is the NumPy-compatible type built on it; the helpers here recognise
arrays as ObjectViews, so they sit below the type.
"""

import threading
import weakref

import numpy as np

from ._records import seal_view as _seal_view
from .errors import CachedArraysError, UseAfterFreeError
from .heap import HEADER
from .sizes import format_size

_tls = threading.local()

# A kernel on at most this many bytes is short: Manager.run may run it under the manager's lock.
SHORT_BYTES = 1 << 16


class ObjectView:
    """A view description over an Object of a manager; resolves the current bytes on use."""

    # _base: None for an array that owns its object (made new), else the owner it was viewed from
    __slots__ = ("_obj", "_m", "_shape", "_dtype", "_strides", "_offset", "_vc", "_base",
                 "__weakref__")

    @classmethod
    def _make(cls, obj, manager, shape, dtype, strides, offset):
        self = object.__new__(cls)
        self._obj = obj
        self._m = manager
        self._shape = shape
        self._dtype = dtype
        self._strides = strides
        self._offset = offset
        self._vc = None
        self._base = None
        return self

    def _view_of(self, view):
        """view (made over self's object) as a view of self's owner: its base, as NumPy's."""
        b = self._base
        view._base = self if b is None else b
        return view

    def _view(self, readonly=False):
        """An ndarray over the current bytes (valid while pinned; read-only ones stay so)."""
        r = self._obj.primary
        if r is None:
            raise self._gone()
        buf = r._buffer
        if buf is None or readonly:
            return self._m.ndarray(r, self._dtype, self._shape, self._strides, self._offset,
                                   readonly)
        return np.ndarray(self._shape, self._dtype, buf, r.offset + HEADER + self._offset,
                          self._strides)

    def _kview(self):
        """The writable view a kernel reads or writes through (valid while pinned).

        Kept between calls while the primary region stays where it is (the same region at the
        same offset), so a chain of small calls on one array builds its view once. Only the
        library's kernels get this view: they never change its shape or flags.
        """
        r = self._obj.primary
        c = self._vc
        if c is not None and c[0] is r and c[1] == r.offset:
            return c[2]
        v = self._view()
        self._vc = (r, r.offset, v)
        return v

    def _check_live(self):
        """UseAfterFreeError unless the array may still be used (not freed, manager open):
        for uses that read only its description and so never resolve its bytes."""
        if self._obj.freed or self._m.closed:
            raise self._gone()

    def _gone(self):
        """The error for using an array whose object has no memory (freed, or manager closed)."""
        obj = self._obj
        what = (f"CachedArray of shape {self._shape} (object {obj.id}, "
                f"{format_size(obj.nbytes)})")
        if self._m.closed:
            return UseAfterFreeError(f"{what} belongs to a closed manager: this manager is "
                                     "closed, so its arrays cannot be used any more; create a "
                                     "new Manager, and close it only after its arrays are done")
        return UseAfterFreeError(f"{what} was freed; it cannot be used any more")


# ---- noescape scopes (filled by the annotations layer) -------------------------------------

def _scopes():
    s = getattr(_tls, "scopes", None)
    if s is None:
        s = _tls.scopes = []
    return s


OPEN_SCOPES = [0]              # noescape scopes open in any thread (0: skip the lookup)


def push_scope():
    """Start recording objects allocated by this thread; returns the record list."""
    rec = []
    _scopes().append(rec)
    OPEN_SCOPES[0] += 1
    return rec


def pop_scope(rec):
    s = _scopes()
    s.remove(rec)
    OPEN_SCOPES[0] -= 1


def record_new(obj):
    """Record a new object in the calling thread's noescape scopes (if any are open)."""
    if not OPEN_SCOPES[0]:
        return
    scopes = getattr(_tls, "scopes", None)
    if scopes:
        ref = weakref.ref(obj)
        for rec in scopes:
            rec.append(ref)


def new_object(manager, nbytes, placement=None):
    """A new object for an array the caller fills at once: placed by the manager's policy,
    pinned and reported written (``Manager.new_pinned``), and recorded for the calling thread's
    noescape scopes. Every new CachedArray's memory comes from here or from ``Manager.run``
    followed by ``record_new``."""
    obj = manager.new_pinned(nbytes, placement)
    record_new(obj)
    return obj


# ---- arguments: the arrays in a call -------------------------------------------------------

def objects_in(x):
    """Objects of every array in x (recursing into lists and tuples)."""
    if isinstance(x, ObjectView):
        yield x._obj
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from objects_in(y)


def to_views(x, readonly=False):
    """Replace arrays in x by ndarray views (the objects must be pinned)."""
    if isinstance(x, ObjectView):
        return x._view(readonly)
    if isinstance(x, list):
        return [to_views(y, readonly) for y in x]
    if isinstance(x, tuple):
        return tuple(to_views(y, readonly) for y in x)
    return x


def first_manager(seq):
    """The manager of the first array in seq (searching nested lists and tuples), or None."""
    for x in seq:
        if isinstance(x, ObjectView):
            return x._m
        if isinstance(x, (list, tuple)):
            m = first_manager(x)
            if m is not None:
                return m
    return None


# ---- acquiring reads and writes ------------------------------------------------------------

def acquire_grouped(reads, writes, name="use", touched=None):
    """Pin objects that may belong to several managers; returns the release list.

    name: the kernel's name, as traces record it; touched: object id -> bytes touched."""
    objs = reads + writes if isinstance(reads, list) and isinstance(writes, list) else \
        list(reads) + list(writes)
    if objs:
        m = objs[0].manager
        if all(o.manager is m for o in objs):
            m.acquire(reads, writes, name, touched)
            return [(m, objs)]
    groups = {}
    for o in reads:
        groups.setdefault(o.manager, ([], []))[0].append(o)
    for o in writes:
        groups.setdefault(o.manager, ([], []))[1].append(o)
    done = []
    try:
        for m, (r, w) in groups.items():
            m.acquire(r, w, name, touched)
            done.append((m, r + w))
    except BaseException:
        for m, objs in done:
            m.release(objs)
        raise
    return done


def release_grouped(done):
    for m, objs in done:
        m.release(objs)


# ---- pinned views for with-blocks ----------------------------------------------------------

class PinnedView:
    """Pinned ndarray access to one array: what ``ca.readable`` and ``ca.writable`` return
    (see cachedarrays.scopes), and what the type's own conversions read through."""

    __slots__ = ("arr", "write", "opened", "views")

    def __init__(self, arr, write):
        self.arr = arr
        self.write = write
        self.opened = 0                 # with-blocks entered and not yet exited
        self.views = {} if write else None  # thread id -> writable views of its open blocks

    def __enter__(self):
        a = self.arr
        m = a._m
        if self.write:
            m.acquire((), (a._obj,), "writable")
        else:
            m.acquire((a._obj,), (), "readable")
        try:
            v = a._view(readonly=not self.write)
            m.scope_opened(self, ((a._obj, a._shape),))
        except BaseException:
            m.release((a._obj,))
            raise
        self.opened += 1
        if self.write:
            self.views.setdefault(threading.get_ident(), []).append(v)
        return v

    def __exit__(self, *exc):
        if not self.opened:
            kind = "ca.writable" if self.write else "ca.readable"
            raise CachedArraysError(
                f"{kind} scope exited but it is not open (never entered, or exited already): "
                "its pin is released once, by the __exit__ of its with-block; releasing it "
                "again would unpin an array other scopes still use")
        self.opened -= 1
        m = self.arr._m
        try:                            # an exception (KeyboardInterrupt) here still unpins
            if self.write:              # a kept view writes no more (this thread's newest)
                me = threading.get_ident()
                stack = self.views.get(me)
                if not stack and self.views:
                    # a with-block another thread entered (that thread may have ended) is the
                    # one ending: its pin goes, so its view writes no more either
                    me = next(reversed(self.views))
                    stack = self.views[me]
                if stack:
                    _seal_view(stack.pop())
                    if not stack:
                        del self.views[me]
        finally:
            try:
                m.scope_closed(self)
            finally:
                m.release((self.arr._obj,))


def readable(x):
    """A read-only pinned view of x for a with-block (ca.readable without its checks)."""
    return PinnedView(x, False)


def plain_key(key):
    """Index keys holding arrays become ndarrays (copies of small index arrays)."""
    if isinstance(key, ObjectView):
        with readable(key) as v:
            return np.array(v)
    if isinstance(key, tuple) and any(isinstance(k, ObjectView) for k in key):
        return tuple(plain_key(k) for k in key)
    return key
