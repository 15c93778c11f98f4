"""Access scopes: pinned ndarray views of CachedArrays for code that needs plain ndarrays.

``readable`` and ``writable`` pin one array; ``access`` pins several at once, one use report per
array. Nothing moves a pinned array, so the views stay valid inside the with-block; after it the
array may move and a kept view would show another array's bytes. Writable views become
read-only when their scope ends, so a kept one cannot overwrite those bytes.
"""

from .array import CachedArray
from .errors import CachedArraysError
from .layout import c_strides, contiguous_strides
from .pinning import PinnedView, acquire_grouped, release_grouped
from .lineage import Recipe, capture_rng
from ._records import compute_fast as _compute_fast
from ._records import kernel_enter as _kernel_enter
from ._records import kernel_exit as _kernel_exit
from ._records import seal_view as _seal_view


def _checked(x):
    if not isinstance(x, CachedArray):
        raise TypeError(f"expected a CachedArray, got {type(x).__name__}")
    return x


_SEQUENCES = (tuple, list)


def _sequence(who, xs):
    """reads or writes as a tuple or list: a CachedArray alone is refused (iterating it would
    pass its rows), another iterable (a generator) is read once into a tuple."""
    if type(xs) is tuple or type(xs) is list:
        return xs
    if isinstance(xs, CachedArray):
        raise TypeError(f"{who} takes CachedArrays (or None) as reads and writes, in a tuple or "
                        "list; got a CachedArray itself (iterating it would pass its rows): "
                        "write (x,) for one array")
    try:
        return tuple(xs)
    except TypeError:
        raise TypeError(f"{who} takes CachedArrays (or None) as reads and writes, in a tuple or "
                        f"list; got {type(xs).__name__}") from None


def readable(x):
    """``with readable(x) as a``: a read-only ndarray view of x; x is pinned meanwhile.

    The view is valid inside the with-block only: afterwards x may move and the view would
    show another array's bytes.
    """
    return PinnedView(_checked(x), False)


def writable(x):
    """``with writable(x) as a``: a writable ndarray view of x, pinned; marks x dirty.

    The view is valid inside the with-block only, and read-only after it. Views made from it
    inside the block stay writable: once x moves, writes through them land in memory that
    belongs to another array (``Manager(debug=True)`` reports them).
    """
    return PinnedView(_checked(x), True)


class access:
    """``with ca.access(reads, writes) as views``: pinned ndarray views of several arrays.

    One pin and one use report per array (reads as ``read_use``, writes as ``write_use``, which
    marks them dirty), taken together; ``views`` lists the read views then the write views,
    with None passed through for None entries. Read views are read-only. Arrays may belong to
    different managers; an array may appear in both lists. The views are valid inside the
    with-block only; the write views become read-only when it ends.
    """

    __slots__ = ("reads", "writes", "done", "name", "touched", "wviews")

    def __init__(self, reads=(), writes=()):
        if not (type(reads) in _SEQUENCES and type(writes) in _SEQUENCES):   # named only then:
            who = f"ca.{type(self).__name__}"           # formatting it cost 0.2 us per kernel
            reads, writes = _sequence(who, reads), _sequence(who, writes)
        for a in (*reads, *writes):
            if a is not None and not isinstance(a, CachedArray):
                raise TypeError(f"ca.{type(self).__name__} takes CachedArrays (or None) as reads "
                                f"and writes, got {type(a).__name__}")
        self.reads, self.writes = reads, writes
        self.done = None
        self.name = "access"
        self.touched = None
        self.wviews = None

    def __enter__(self):
        if self.done is not None:
            raise _reentered(self)
        # In C, the common case: one manager with nothing under way, so no observer either
        # (``touched`` is for observers: the Python path below hands it to them).
        got = _kernel_enter(self, self.name, self.reads, self.writes)
        if got is not None:
            self.done = got[1]                    # (manager, pinned objects)
            return got[0]
        r = [a._obj for a in self.reads if a is not None]
        w = [a._obj for a in self.writes if a is not None]
        done = self.done = acquire_grouped(r, w, self.name, self.touched)
        try:
            views = [None if a is None else a._view(readonly=True) for a in self.reads]
            wviews = self.wviews = [None if a is None else a._view() for a in self.writes]
            views += wviews
            arrays = [a for a in (*self.reads, *self.writes) if a is not None]
            for m, _ in self.done:
                m.scope_opened(self, tuple((a._obj, a._shape) for a in arrays if a._m is m))
            return views
        except BaseException:
            self.done = None
            for m, _ in done:
                m.scope_closed(self)
            release_grouped(done)
            raise

    def __exit__(self, *exc):
        done = self.done
        if done is None:
            raise _not_open(f"ca.{type(self).__name__} scope {self.name!r}")
        self.done = None
        if type(done) is tuple:
            _kernel_exit(self, *done)
            return
        try:                    # an exception (KeyboardInterrupt) anywhere here unpins all
            _close_views(self.wviews)
        finally:
            self.wviews = None
            try:
                for m, _ in done:
                    m.scope_closed(self)
            finally:
                release_grouped(done)


def _close_views(views):
    """Make a closing scope's writable views read-only for good (``seal_view``): a view kept
    past its scope then refuses writes (NumPy's ValueError) instead of writing into memory the
    array may have left, and cannot be made writable again (views made from it inside the
    scope stay as they are: NumPy cannot reach them)."""
    for v in views:
        if v is not None:
            _seal_view(v)


def _reentered(scope):
    return CachedArraysError(
        f"ca.{type(scope).__name__} scope {scope.name!r} is open already: one scope object "
        "pins its arrays once; create another for a nested with-block")


def _not_open(what):
    return CachedArraysError(
        f"{what} exited but it is not open (never entered, or exited already): its pins are "
        "released once, by the __exit__ of its with-block; releasing them again would unpin "
        "arrays other scopes still use")


class kernel(access):
    """``with ca.kernel(name, reads, writes) as views``: one kernel of the program.

    The same pinned views as ``ca.access`` (read views first, read-only), and a kernel named
    ``name`` in traces (``ca.trace``): its read and write sets and its time. Plans of policies
    can fire at it. ``touched=[(array, nbytes), ...]`` says a kernel touches only part of an
    array (a gather of table rows), so that the cost model charges those bytes, not the array.
    """

    __slots__ = ()

    def __init__(self, name, reads=(), writes=(), touched=None):
        if not isinstance(name, str):
            raise TypeError(f"ca.kernel: the first argument is the kernel's name (a str), got "
                            f"{type(name).__name__}; write ca.kernel(name, reads, writes)")
        super().__init__(reads, writes)
        self.name = name
        if touched:
            out = {}
            for a, n in touched:
                if not isinstance(a, CachedArray):
                    raise TypeError(f"ca.kernel {name!r}: touched maps CachedArrays to byte "
                                    f"counts, got a key of type {type(a).__name__}")
                n = int(n)
                if n < 0:
                    raise ValueError(f"ca.kernel {name!r}: touched bytes must be >= 0, got {n}")
                out[a._obj.id] = min(n, a._obj.nbytes)
            self.touched = out


def compute(name, fn, reads=(), writes=(), *, rng=None, touched=None):
    """Run a pure kernel: ``fn(*read_views, *write_views)``, and remember how, so that its
    outputs can be dropped and rebuilt bitwise later (``ca.drop``, ``Manager.regenerate``).

    The same pinned views and trace record as ``ca.kernel(name, reads, writes)`` (None entries
    pass through; read views are read-only); returns fn's result. fn must compute its writes
    from its reads alone, overwriting every element of a write it does not also read: list an
    operand in both reads and writes when fn updates it in place. Pass arrays through reads
    and writes, not through fn's closure. rng: a np.random.Generator passed to fn as ``rng=``
    (its state is captured, so a rerun draws the same numbers).
    """
    if type(name) is not str:
        raise TypeError(f"ca.compute: the first argument is the kernel's name (a str), got "
                        f"{type(name).__name__}; write ca.compute(name, fn, reads, writes)")
    if rng is None and touched is None:
        done = _compute_fast(name, fn, reads, writes, Recipe)     # in C, the common call
        if done is not None:
            return done[0]
    who = f"ca.compute {name!r}"
    reads, writes = _sequence(who, reads), _sequence(who, writes)
    if touched:
        touched = kernel(name, reads, writes, touched).touched    # checks touched
    if not callable(fn):
        raise TypeError(f"ca.compute {name!r}: fn must be callable (it gets the read views, then "
                        f"the write views), got {type(fn).__name__}")
    state = capture_rng(rng) if rng is not None else None
    m = None
    args, r, w = [], [], []
    partial = ()                                  # writes through a view of part of an array
    for arrays, objs, write in ((reads, r, False), (writes, w, True)):
        for a in arrays:
            if a is None:
                args.append(None)
                continue
            if type(a) is not CachedArray and not isinstance(a, CachedArray):
                raise TypeError(f"ca.compute {name!r} takes CachedArrays (or None) as reads "
                                f"and writes, got {type(a).__name__}")
            if m is None:
                m = a._m
            elif a._m is not m:
                raise ValueError(f"ca.compute {name!r}: its arrays belong to different managers;"
                                 " a recomputable kernel works within one manager: copy the "
                                 "arrays into one (ca.asarray(x, manager=m)) or use ca.kernel")
            o = a._obj
            objs.append(o)
            args.append((o.id, write, a._dtype, a._shape, a._strides, a._offset))
            if write and not _covers(a):
                partial = (*partial, o.id)
    if m is None:
        return fn(rng=rng) if rng is not None else fn()
    recipe = Recipe(name, fn, args, state, touched, partial=partial)
    m.acquire(r, w, name, touched, recipe)
    try:
        views = [None if a is None else a._view(readonly=True) for a in reads]
        wviews = [None if a is None else a._view() for a in writes]
        views += wviews
        key = recipe                              # one per call: the scope's key
        m.scope_opened(key, tuple((a._obj, a._shape) for a in (*reads, *writes)
                                  if a is not None))
        try:
            return fn(*views, rng=rng) if rng is not None else fn(*views)
        except BaseException:
            for o in w:                           # half written: no recipe describes it
                o.chain = (f"kernel {name!r} raised an exception while writing it",)
            raise
        finally:
            try:
                _close_views(wviews)
            finally:
                m.scope_closed(key)
    finally:
        m.release(r + w)


def _covers(a):
    """True if the view a covers every byte of its array (a write through it replaces all)."""
    shape, itemsize = a._shape, a._dtype.itemsize
    n = itemsize
    for d in shape:
        n *= d
    return a._offset == 0 and n == a._obj.nbytes and (
        n == 0 or a._strides == c_strides(shape, itemsize) or
        a._strides == contiguous_strides(shape, itemsize, "F"))
