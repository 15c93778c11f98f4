"""CachedArray: a NumPy-compatible array whose bytes live in a manager's fast or slow device.

A CachedArray is a view description (dtype, shape, strides, byte offset) over an Object. It
never keeps a pointer: each use pins the object, asks the manager for an ndarray over the
primary region's current bytes, runs, and unpins. So views stay correct across evict/prefetch,
and nothing moves an array while a kernel reads or writes it.

This module is the type: views, indexing, conversions and the ndarray methods, with the helpers
that create arrays and pin them. NumPy's protocols are forwarded to the dispatch layer above
(``cachedarrays.ufuncs``, ``cachedarrays.dispatch``) through handler slots that layer fills
when imported; the public access scopes are in ``cachedarrays.scopes``.
"""

import builtins
import operator
import os
import pickle
import sys
import threading
import weakref

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from .defaults import default_manager
from .errors import UseAfterFreeError
from .sizes import format_size

_tls = threading.local()

_OK_DTYPES = {}                # hashable dtype spelling ("f8", float, ...) -> checked np.dtype


def check_dtype(dtype):
    """Return np.dtype(dtype) if a CachedArray can hold it; refuse types holding references.

    Takes every spelling np.dtype takes (lists of fields, dicts, "i4,f8", types, subarray
    tuples); only hashable spellings are cached, and np.dtype instances are returned as given.
    """
    if isinstance(dtype, np.dtype):
        dt = dtype
    else:
        try:
            dt = _OK_DTYPES.get(dtype)
        except TypeError:      # unhashable spelling: a list of fields, a dict, ...
            return _checked(np.dtype(dtype))
        if dt is not None:
            return dt
        dt = np.dtype(dtype)
        _checked(dt)
        if len(_OK_DTYPES) < 256:
            _OK_DTYPES[dtype] = dt
        return dt
    return _checked(dt)


def _checked(dt):
    if dt.hasobject or dt.kind == "T":
        raise TypeError(f"CachedArray cannot hold dtype {dt}: its elements are Python objects "
                        "or references; use a fixed-size dtype (numbers, bool, fixed-width "
                        "strings, structured types of those)")
    return dt


def _caller_is_pandas():
    """True when the code converting a CachedArray (the caller of __array__) is in pandas.

    pandas' DataFrame and Series constructors look for a structured dtype's fields only on a
    numpy.ndarray; any other array is converted with np.asarray and its records land in a
    single column, silently.
    """
    frame = sys._getframe(2)
    name = frame.f_globals.get("__name__", "")
    return name == "pandas" or name.startswith("pandas.")


def _shape_tuple(shape):
    if type(shape) is tuple:
        for s in shape:
            if type(s) is not int or s < 0:
                break
        else:
            return shape
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        shape = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a tuple of ints, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    return shape


def _contiguous_strides(shape, itemsize, order="C"):
    strides = [0] * len(shape)
    step = itemsize
    dims = range(len(shape) - 1, -1, -1) if order == "C" else range(len(shape))
    for i in dims:
        strides[i] = step
        step *= max(shape[i], 1)
    return tuple(strides)


_STRIDES = {}


def _c_strides(shape, itemsize):
    """C-order strides, cached per (shape, itemsize)."""
    key = (shape, itemsize)
    st = _STRIDES.get(key)
    if st is None:
        st = _contiguous_strides(shape, itemsize)
        if len(_STRIDES) < 4096:
            _STRIDES[key] = st
    return st


# ---- noescape scopes (filled by the annotations layer) -------------------------------------

def _scopes():
    s = getattr(_tls, "scopes", None)
    if s is None:
        s = _tls.scopes = []
    return s


def push_scope():
    """Start recording objects allocated by this thread; returns the record list."""
    rec = []
    _scopes().append(rec)
    return rec


def pop_scope(rec):
    s = _scopes()
    s.remove(rec)


# ---- allocation ------------------------------------------------------------------------------

def _new_object(manager, nbytes, placement=None):
    """A new object for an array the caller fills at once: placed by the manager's policy,
    pinned and reported written (``Manager.new_pinned``), and recorded for the calling thread's
    noescape scopes. Every new CachedArray's memory comes from here."""
    obj = manager.new_pinned(nbytes, placement)
    scopes = getattr(_tls, "scopes", None)
    if scopes:
        ref = weakref.ref(obj)
        for rec in scopes:
            rec.append(ref)
    return obj


def new_pinned(manager, shape, dtype, order="C", placement=None):
    """Allocate an array through the manager's policy, returned pinned (release with _unpin).

    placement: None lets the policy choose; "slow" or "fast" (fast if it fits after forced
    evictions, else slow) is a hint for arrays whose use the caller knows.
    """
    dt = check_dtype(dtype)
    shape = _shape_tuple(shape)
    if dt.subdtype is not None:          # (np.float64, (2,)): as NumPy, (*shape, 2) of float64
        dt, sub = dt.subdtype
        shape = shape + sub
    if order not in ("C", "F"):
        order = "C"
    n = 1
    for s in shape:
        n *= s
    obj = _new_object(manager, n * dt.itemsize, placement)
    strides = _c_strides(shape, dt.itemsize) if order == "C" else \
        _contiguous_strides(shape, dt.itemsize, order)
    return CachedArray._make(obj, manager, shape, dt, strides, 0)


def _unpin(arr):
    arr._m.release((arr._obj,))


def _from_ndarray(manager, a, placement=None):
    """A new CachedArray holding a copy of ndarray a."""
    order = "F" if (a.flags.f_contiguous and not a.flags.c_contiguous) else "C"
    out = new_pinned(manager, a.shape, a.dtype, order, placement)
    try:
        np.copyto(out._view(), a, casting="no")
    finally:
        _unpin(out)
    return out


# ---- NumPy protocol handlers -----------------------------------------------------------------
#
# The type forwards NumPy's protocols to the dispatch layer above it: __array_ufunc__ and the
# arithmetic operators to cachedarrays.ufuncs, __array_function__ to cachedarrays.dispatch.
# Those modules fill these slots when imported (the package's __init__ imports both), so this
# module never imports them. Until they are filled, NumPy calls on a CachedArray raise TypeError.

_SLOW = object()                # the operators' shortcut declined the call: take NumPy's route
_PY_SCALARS = (int, float, complex, bool)


def _unhandled(*args):
    return NotImplemented


def _no_shortcut(ufunc, inputs):
    return _SLOW


_ufunc_handler = _unhandled      # (ufunc, method, inputs, kwargs) -> result (NEP 13)
_fast_ufunc = _no_shortcut       # (ufunc, inputs) -> result, or _SLOW (operators' shortcut)
_function_handler = _unhandled   # (func, types, args, kwargs) -> result (NEP 18)


def set_ufunc_handlers(handler, shortcut):
    """Install the NEP 13 handler and the arithmetic operators' shortcut (cachedarrays.ufuncs
    calls this when imported)."""
    global _ufunc_handler, _fast_ufunc
    _ufunc_handler, _fast_ufunc = handler, shortcut


def set_function_handler(handler):
    """Install the NEP 18 handler (cachedarrays.dispatch calls this when imported)."""
    global _function_handler
    _function_handler = handler


# ---- the array type --------------------------------------------------------------------------

class CachedArray(NDArrayOperatorsMixin):
    """An n-dimensional array in tiered memory; behaves like numpy.ndarray."""

    __slots__ = ("_obj", "_m", "_shape", "_dtype", "_strides", "_offset", "__weakref__")
    __array_priority__ = 20

    @classmethod
    def _make(cls, obj, manager, shape, dtype, strides, offset):
        self = object.__new__(cls)
        self._obj = obj
        self._m = manager
        self._shape = shape
        self._dtype = dtype
        self._strides = strides
        self._offset = offset
        return self

    def __init__(self, *args, **kwargs):
        raise TypeError("create CachedArrays with ca.asarray, ca.array, ca.empty, ca.zeros, "
                        "ca.ones, ca.full or their *_like forms")

    # ---- resolution (call only while pinned) ---------------------------------------------

    def _view(self, readonly=False):
        """An ndarray over the current bytes (valid while pinned; read-only ones stay so)."""
        r = self._obj.primary
        if r is None:
            raise self._gone()
        return self._m.ndarray(r, self._dtype, self._shape, self._strides, self._offset,
                               readonly)

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

    def _derive(self, base, view):
        """A CachedArray view for ndarray `view`, which shares memory with `base` (self's view)."""
        start = base.__array_interface__["data"][0] - self._offset
        off = view.__array_interface__["data"][0] - start
        return CachedArray._make(self._obj, self._m, view.shape, view.dtype, view.strides, off)

    # ---- properties ----------------------------------------------------------------------

    def _become(self, view):
        """Describe `view` (a view of the same object) from now on: in-place shape/dtype."""
        self._shape, self._dtype = view._shape, view._dtype
        self._strides, self._offset = view._strides, view._offset

    def _set_shape(self, shape):
        try:
            self._become(self.reshape(shape, copy=False))
        except ValueError:
            raise AttributeError(f"cannot give shape {shape} to this array of shape "
                                 f"{self._shape} without a copy; use x.reshape(...)") from None

    shape = property(lambda self: self._shape, _set_shape,
                     doc="The dimensions; setting it reshapes in place (never copies).")
    dtype = property(lambda self: self._dtype, lambda self, dt: self._become(self.view(dt)),
                     doc="The element type; setting it views the same bytes as another type.")
    strides = property(lambda self: self._strides)
    ndim = property(lambda self: len(self._shape))
    itemsize = property(lambda self: self._dtype.itemsize)

    @property
    def size(self):
        n = 1
        for s in self._shape:
            n *= s
        return n

    @property
    def nbytes(self):
        return self.size * self._dtype.itemsize

    @property
    def manager(self):
        return self._m

    @property
    def object(self):
        """The manager's Object behind this array (shared by all its views)."""
        return self._obj

    @property
    def device(self):
        """'fast' or 'slow': where the newest copy of the data lives now."""
        return self._obj.device

    @property
    def is_freed(self):
        return self._obj.freed

    @property
    def T(self):
        return self.transpose()

    @property
    def mT(self):
        if self.ndim < 2:
            raise ValueError("matrix transpose needs at least 2 dimensions")
        return self.swapaxes(-1, -2)

    @property
    def real(self):
        return self._viewop(lambda v: v.real)

    @real.setter
    def real(self, value):
        self.real[...] = value

    @property
    def imag(self):
        return self._viewop(lambda v: v.imag)

    @imag.setter
    def imag(self, value):
        if self._dtype.kind != "c":
            raise TypeError("array does not have imaginary part to set")
        self.imag[...] = value

    @property
    def flags(self):
        """A snapshot of the layout flags (they cannot be set; see setflags)."""
        with _readable(self) as v:
            return _Flags(v.flags, self.base is None)

    # ---- NumPy protocols -----------------------------------------------------------------

    def __array__(self, dtype=None, copy=None):
        if copy is False:
            raise ValueError(
                "a CachedArray cannot be viewed without a copy: its data can move between "
                "devices; use `with ca.readable(x) as a:` for a zero-copy view inside a scope")
        if self._dtype.names is not None and _caller_is_pandas():
            raise TypeError(
                f"pandas cannot read the fields of a structured CachedArray (dtype "
                f"{self._dtype}, shape {self._shape}): it looks for fields only on a "
                "numpy.ndarray and would build one column of records; pass it a copy, e.g. "
                "pd.DataFrame(np.asarray(x))")
        with _readable(self) as v:
            self._m.count("asarray", self.nbytes, id=self._obj.id)
            return np.array(v, dtype=dtype, copy=True)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _ufunc_handler(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return _function_handler(func, types, args, kwargs)

    # ---- indexing ------------------------------------------------------------------------

    def __getitem__(self, key):
        key = _plain_key(key)
        m, obj = self._m, self._obj
        m.acquire((obj,))
        try:
            v = self._view()
            r = v[key]
            if isinstance(r, np.ndarray):
                if not r.flags.owndata and np.may_share_memory(r, v):
                    return self._derive(v, r)
                return _from_ndarray(m, r)
            return r
        finally:
            m.release((obj,))

    def __setitem__(self, key, value):
        key = _plain_key(key)
        reads = tuple(_objects_in(value))
        m, obj = self._m, self._obj
        m.acquire(reads, (obj,))
        try:
            self._view()[key] = _to_views(value)
        finally:
            m.release(reads + (obj,))

    def __len__(self):
        if not self._shape:
            raise TypeError("len() of unsized object")
        return self._shape[0]

    def __iter__(self):
        if not self._shape:
            raise TypeError("iteration over a 0-d array")
        for i in range(self._shape[0]):
            yield self[i]

    def __contains__(self, value):
        return bool((self == value).any())

    # ---- conversions ---------------------------------------------------------------------

    def _scalar(self, kind):
        if self.size != 1:
            raise TypeError(f"only arrays of size 1 can be converted to Python scalars; this "
                            f"one has shape {self._shape}")
        with _readable(self) as v:
            return kind(v.reshape(()))

    def __bool__(self):
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous. Use a.any() or a.all()")
        return self._scalar(bool)

    def __float__(self):
        return self._scalar(float)

    def __int__(self):
        return self._scalar(int)

    def __complex__(self):
        return self._scalar(complex)

    def __index__(self):
        if self._dtype.kind not in "iub" or self.ndim:
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return self._scalar(operator.index)

    def item(self, *args):
        with _readable(self) as v:
            return v.item(*args)

    def tolist(self):
        with _readable(self) as v:
            return v.tolist()

    def tobytes(self, order="C"):
        with _readable(self) as v:
            return v.tobytes(order)

    def __reduce__(self):
        with _readable(self) as v:
            return (_unpickle, (np.array(v, copy=True),))

    def __repr__(self):
        if self._obj.freed:
            return f"CachedArray(<freed>, shape={self._shape}, dtype={self._dtype})"
        with _readable(self) as v:
            body = np.array2string(v, separator=", ", prefix="CachedArray(")
            dev = self._obj.primary.device.name
        return f"CachedArray({body}, dtype={self._dtype}, device={dev!r})"

    def __str__(self):
        with _readable(self) as v:
            return str(v)

    __hash__ = None

    # ---- views ---------------------------------------------------------------------------

    def _viewop(self, fn):
        """Apply an ndarray view operation; a view stays a view, a copy becomes a new array."""
        m, obj = self._m, self._obj
        m.acquire((obj,), (), "view")
        try:
            v = self._view()
            r = fn(v)
            if isinstance(r, np.ndarray) and not r.flags.owndata and np.may_share_memory(r, v):
                return self._derive(v, r)
            if isinstance(r, np.ndarray):
                return _from_ndarray(m, r)
            return r
        finally:
            m.release((obj,))

    def reshape(self, *shape, order="C", copy=None):
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = shape[0]
        return self._viewop(lambda v: v.reshape(shape, order=order, copy=copy))

    def ravel(self, order="C"):
        return self._viewop(lambda v: v.ravel(order))

    def flatten(self, order="C"):
        return self._viewop(lambda v: v.flatten(order))

    def transpose(self, *axes):
        if len(axes) == 1 and (axes[0] is None or not isinstance(axes[0], (int, np.integer))):
            axes = axes[0]
        return self._viewop(lambda v: v.transpose(axes) if axes else v.transpose())

    def swapaxes(self, a, b):
        return self._viewop(lambda v: v.swapaxes(a, b))

    def squeeze(self, axis=None):
        return self._viewop(lambda v: v.squeeze(axis))

    def view(self, dtype=None, type=None):
        """A view with another dtype; the type stays CachedArray (an ndarray view would keep a
        raw pointer that a migration can leave stale: use ca.readable for one)."""
        if isinstance(dtype, builtins.type) and issubclass(dtype, (np.ndarray, CachedArray)):
            dtype, type = None, dtype
        if type is not None and not issubclass(type, CachedArray):
            raise TypeError(
                f"a CachedArray cannot be viewed as {type.__name__}: that view would keep a raw "
                "pointer that an evict or prefetch can leave stale; use `with ca.readable(x) as "
                "a:` for an ndarray view inside a pinned scope, or np.asarray(x) for a copy")
        if dtype is None:
            return CachedArray._make(self._obj, self._m, self._shape, self._dtype,
                                     self._strides, self._offset)
        check_dtype(dtype)
        return self._viewop(lambda v: v.view(dtype))

    def diagonal(self, offset=0, axis1=0, axis2=1):
        return self._viewop(lambda v: v.diagonal(offset, axis1, axis2))

    # ---- copies and in-place methods -----------------------------------------------------

    def copy(self, order="C"):
        return self.astype(self._dtype, order=order)

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        dt = check_dtype(dtype)
        if not copy and dt == self._dtype:
            return self
        if order == "K":
            order = "F" if self.ndim > 1 and _is_f(self._shape, self._strides,
                                                    self.itemsize) else "C"
        out = new_pinned(self._m, self._shape, dt, order)
        try:
            with _readable(self) as v:
                if out.ndim > v.ndim:        # a subarray dtype: each element fills a block
                    v = v[(...,) + (None,) * (out.ndim - v.ndim)]
                np.copyto(out._view(), v, casting=casting)
        finally:
            _unpin(out)
        return out

    def _write(self, fn, *args):
        """fn(view, *args) with self pinned as written (marked dirty, so no eviction drops the
        change) and CachedArrays among args pinned as read; returns fn's result."""
        done = _acquire_grouped(list(_objects_in(args)), [self._obj])
        try:
            return fn(self._view(), *_to_views(args, readonly=True))
        finally:
            _release_grouped(done)

    def fill(self, value):
        self._write(np.ndarray.fill, value)

    def sort(self, axis=-1, kind=None, order=None, *, stable=None):
        self._write(lambda v: v.sort(axis=axis, kind=kind, order=order, stable=stable))

    def partition(self, kth, axis=-1, kind="introselect", order=None):
        self._write(lambda v, k: v.partition(k, axis=axis, kind=kind, order=order), kth)

    def put(self, indices, values, mode="raise"):
        self._write(lambda v, i, x: v.put(i, x, mode=mode), indices, values)

    def setfield(self, val, dtype, offset=0):
        check_dtype(dtype)
        self._write(lambda v, x: v.setfield(x, dtype, offset), val)

    def byteswap(self, inplace=False):
        if inplace:
            self._write(lambda v: v.byteswap(True))
            return self
        return self._viewop(lambda v: v.byteswap(False))

    def compress(self, condition, axis=None, out=None):
        """Same as numpy.compress(condition, self, ...) (the array is its second argument)."""
        return np.compress(condition, self, axis=axis, out=out)

    def getfield(self, dtype, offset=0):
        check_dtype(dtype)
        return self._viewop(lambda v: v.getfield(dtype, offset))

    def resize(self, *new_shape, refcheck=True):
        """Change the shape and size in place, as ndarray.resize (new elements are zero).

        The array moves to a new object; other CachedArrays viewing the old one keep the old
        data (there is no reference check: no view is ever left pointing at freed memory).
        """
        if len(new_shape) == 1 and not isinstance(new_shape[0], (int, np.integer)):
            new_shape = new_shape[0]
        shape = _shape_tuple(new_shape)
        if self.base is not None or self._strides != _c_strides(self._shape, self.itemsize):
            raise ValueError(
                f"cannot resize this array of shape {self._shape}: it is a view of object "
                f"{self._obj.id} or not C-contiguous; resize the array it was taken from, or "
                "use np.resize(x, shape) for a new array")
        if self._m.pinned(self._obj):
            raise ValueError(
                f"cannot resize this array of shape {self._shape}: object {self._obj.id} is in "
                "use (pinned by an access scope or a running kernel); resize it afterwards")
        out = new_pinned(self._m, shape, self._dtype)
        try:
            with _readable(self) as v:
                old = v.reshape(-1)
                new = out._view().reshape(-1)
                k = min(old.size, new.size)
                new[:k] = old[:k]
                new[k:].view(np.uint8).fill(0)
        finally:
            _unpin(out)
        self._obj, self._shape, self._strides, self._offset = \
            out._obj, out._shape, out._strides, 0

    def setflags(self, write=None, align=None, uic=None):
        """Accepted when it changes nothing; a CachedArray's flags cannot be set."""
        if write in (None, True) and align in (None, True) and not uic:
            return
        raise TypeError(
            "a CachedArray's flags cannot be set: each use builds a fresh view of wherever the "
            "data lives now; for read-only access use `with ca.readable(x) as a:`")

    def tofile(self, fid, sep="", format="%s"):
        with _readable(self) as v:
            v.tofile(fid, sep=sep, format=format)

    def dumps(self):
        """The pickle of the array (pickle.loads gives a CachedArray on the default manager)."""
        return pickle.dumps(self, protocol=2)

    def dump(self, file):
        if isinstance(file, (str, bytes, os.PathLike)):
            with open(file, "wb") as f:
                pickle.dump(self, f, protocol=2)
        else:
            pickle.dump(self, file, protocol=2)

    def to_device(self, device, /, *, stream=None):
        """The array itself for device "cpu" (fast and slow memory are both host memory)."""
        if stream is not None:
            raise ValueError("the stream argument of to_device must be None")
        if device != "cpu":
            raise ValueError(f"device {device!r} not understood: only 'cpu' is allowed; move "
                             "data between fast and slow memory with ca.prefetch / ca.evict")
        return self

    @property
    def base(self):
        """None when this array spans its whole object, else the Object it views."""
        if self._offset == 0 and self.nbytes == self._obj.nbytes and \
                self._strides in (_c_strides(self._shape, self.itemsize),
                                  _contiguous_strides(self._shape, self.itemsize, "F")):
            return None
        return self._obj

    @property
    def flat(self):
        """A flat iterator over the array in C order; indexing it reads, assigning writes."""
        return _FlatIter(self)

    @property
    def ctypes(self):
        raise TypeError(_RAW_POINTER.format(name="ctypes"))

    @property
    def data(self):
        raise TypeError(_RAW_POINTER.format(name="data"))

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()


def _is_f(shape, strides, itemsize):
    return tuple(strides) == _contiguous_strides(shape, itemsize, "F") and \
        tuple(strides) != _contiguous_strides(shape, itemsize, "C")


def _binary(ufunc, name):
    """A Python operator that skips NumPy's dispatch in the common case (same cost otherwise)."""
    def forward(self, other):
        if type(other) is CachedArray or type(other) in _PY_SCALARS:
            res = _fast_ufunc(ufunc, (self, other))
            if res is not _SLOW:
                return res
        if getattr(type(other), "__array_ufunc__", False) is None:
            return NotImplemented
        return ufunc(self, other)

    def reflected(self, other):
        if type(other) in _PY_SCALARS:
            res = _fast_ufunc(ufunc, (other, self))
            if res is not _SLOW:
                return res
        if getattr(type(other), "__array_ufunc__", False) is None:
            return NotImplemented
        return ufunc(other, self)

    forward.__name__, reflected.__name__ = f"__{name}__", f"__r{name}__"
    return forward, reflected


for _uf, _name in ((np.add, "add"), (np.subtract, "sub"), (np.multiply, "mul"),
                   (np.true_divide, "truediv"), (np.floor_divide, "floordiv"),
                   (np.power, "pow"), (np.remainder, "mod")):
    _f, _r = _binary(_uf, _name)
    setattr(CachedArray, _f.__name__, _f)
    setattr(CachedArray, _r.__name__, _r)


def _method(name):
    fn = getattr(np, name)

    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    method.__name__ = name
    method.__doc__ = f"Same as numpy.{name}(self, ...)."
    return method


for _name in ("sum", "mean", "std", "var", "min", "max", "argmin", "argmax", "prod",
              "cumsum", "cumprod", "all", "any", "clip", "round", "trace", "nonzero", "dot",
              "searchsorted", "repeat", "take", "conj", "conjugate", "argsort",
              "argpartition", "choose", "ptp" if hasattr(np, "ptp") else "sum"):
    setattr(CachedArray, _name, _method(_name))

_RAW_POINTER = (
    "CachedArray.{name} is not available: it would hand out a raw pointer to wherever the data "
    "lives now, and an evict or prefetch can move the data and leave the pointer stale; use "
    "`with ca.readable(x) as a:` (or ca.writable) and a.{name} inside the scope, where x is "
    "pinned")


class _FlatIter:
    """x.flat for a CachedArray: reads and writes go through x, so they survive migration."""

    __slots__ = ("base", "_chunk")

    def __init__(self, base):
        self.base = base
        self._chunk = 1 << 14

    def __len__(self):
        return self.base.size

    def __getitem__(self, key):
        key = _plain_key(key)
        m, obj = self.base._m, self.base._obj
        m.acquire((obj,))
        try:
            r = self.base._view().flat[key]
            return _from_ndarray(m, r) if isinstance(r, np.ndarray) else r
        finally:
            m.release((obj,))

    def __setitem__(self, key, value):
        key = _plain_key(key)

        def put(v, x):
            v.flat[key] = x
        self.base._write(put, value)

    def __iter__(self):
        n = self.base.size
        for start in range(0, n, self._chunk):
            with _readable(self.base) as v:
                chunk = v.flat[start:start + self._chunk]      # a copy: nothing stays pinned
            yield from chunk

    def __array__(self, dtype=None, copy=None):
        return self.base.ravel().__array__(dtype, copy)

    def copy(self):
        return self.base.flatten()

    def __repr__(self):
        return f"<flat iterator of {self.base!r}>"


class _Flags:
    """x.flags for a CachedArray: ndarray's layout flags, read once; none can be set."""

    __slots__ = ("c_contiguous", "f_contiguous", "owndata", "writeable", "aligned",
                 "writebackifcopy")
    _KEYS = {"C": "c_contiguous", "C_CONTIGUOUS": "c_contiguous", "CONTIGUOUS": "c_contiguous",
             "F": "f_contiguous", "F_CONTIGUOUS": "f_contiguous", "FORTRAN": "f_contiguous",
             "O": "owndata", "OWNDATA": "owndata", "W": "writeable", "WRITEABLE": "writeable",
             "A": "aligned", "ALIGNED": "aligned", "X": "writebackifcopy",
             "WRITEBACKIFCOPY": "writebackifcopy", "FNC": "fnc", "FORC": "forc",
             "B": "behaved", "BEHAVED": "behaved", "CA": "carray", "CARRAY": "carray",
             "FA": "farray", "FARRAY": "farray"}

    def __init__(self, flags, owndata):
        set_ = object.__setattr__
        set_(self, "c_contiguous", flags.c_contiguous)
        set_(self, "f_contiguous", flags.f_contiguous)
        set_(self, "owndata", owndata)
        set_(self, "writeable", True)          # every CachedArray can be written
        set_(self, "aligned", flags.aligned)
        set_(self, "writebackifcopy", False)

    fnc = property(lambda self: self.f_contiguous and not self.c_contiguous)
    forc = property(lambda self: self.f_contiguous or self.c_contiguous)
    behaved = property(lambda self: self.aligned and self.writeable)
    carray = property(lambda self: self.behaved and self.c_contiguous)
    farray = property(lambda self: self.behaved and self.fnc)

    def __getitem__(self, key):
        name = self._KEYS.get(key.upper() if isinstance(key, str) else key)
        if name is None:
            raise KeyError(f"unknown flag {key!r}")
        return getattr(self, name)

    def __setattr__(self, name, value):
        if getattr(self, name) != value:
            CachedArray.setflags(None, write=False)         # raises, saying why

    def __setitem__(self, key, value):
        if self[key] != value:
            CachedArray.setflags(None, write=False)

    def __eq__(self, other):
        names = ("c_contiguous", "f_contiguous", "owndata", "writeable", "aligned",
                 "writebackifcopy")
        return all(getattr(self, n) == getattr(other, n) for n in names)

    __hash__ = None

    def __repr__(self):
        return "\n".join(f"  {key} : {self[key]}" for key in
                         ("C_CONTIGUOUS", "F_CONTIGUOUS", "OWNDATA", "WRITEABLE", "ALIGNED",
                          "WRITEBACKIFCOPY"))


def _unpickle(a):
    return _from_ndarray(default_manager(), a)


# ---- argument handling -----------------------------------------------------------------------

def _objects_in(x):
    """Objects of every CachedArray in x (recursing into lists and tuples)."""
    if isinstance(x, CachedArray):
        yield x._obj
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _objects_in(y)


def _to_views(x, readonly=False):
    """Replace CachedArrays in x by ndarray views (the objects must be pinned)."""
    if isinstance(x, CachedArray):
        return x._view(readonly)
    if isinstance(x, list):
        return [_to_views(y, readonly) for y in x]
    if isinstance(x, tuple):
        return tuple(_to_views(y, readonly) for y in x)
    return x


def _plain_key(key):
    """Index keys holding CachedArrays become ndarrays (copies of small index arrays)."""
    if isinstance(key, CachedArray):
        with _readable(key) as v:
            return np.array(v)
    if isinstance(key, tuple) and any(isinstance(k, CachedArray) for k in key):
        return tuple(_plain_key(k) for k in key)
    return key


def _first_manager(seq):
    for x in seq:
        if isinstance(x, CachedArray):
            return x._m
        if isinstance(x, (list, tuple)):
            m = _first_manager(x)
            if m is not None:
                return m
    return None


def _acquire_grouped(reads, writes, name="use", touched=None):
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


def _release_grouped(done):
    for m, objs in done:
        m.release(objs)


def _wrap(m, res, views):
    """Turn a NumPy result into CachedArrays: views of inputs stay views, others are copied."""
    if isinstance(res, np.ndarray):
        if res.dtype.hasobject:
            return res
        if not res.flags.owndata:
            for arr, v in views:
                if np.may_share_memory(res, v):
                    return arr._derive(v, res)
        if res.ndim == 0:
            return res[()]
        return _from_ndarray(m, res)
    if isinstance(res, list):
        return [_wrap(m, r, views) for r in res]
    if isinstance(res, tuple):
        items = [_wrap(m, r, views) for r in res]
        return type(res)(*items) if hasattr(res, "_fields") else tuple(items)
    return res


# ---- pinned views ----------------------------------------------------------------------------

class _Scope:
    """Pinned ndarray access to one CachedArray: what ``ca.readable`` and ``ca.writable`` return
    (see cachedarrays.scopes), and what the type's own conversions read through."""

    __slots__ = ("arr", "write")

    def __init__(self, arr, write):
        if not isinstance(arr, CachedArray):
            raise TypeError(f"expected a CachedArray, got {type(arr).__name__}")
        self.arr = arr
        self.write = write

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
            return v
        except BaseException:
            m.release((a._obj,))
            raise

    def __exit__(self, *exc):
        m = self.arr._m
        m.scope_closed(self)
        m.release((self.arr._obj,))


def _readable(x):
    """A read-only pinned view of x for a with-block (ca.readable without the public name)."""
    return _Scope(x, False)
