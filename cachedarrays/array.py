"""CachedArray: a NumPy-compatible array whose bytes live in a manager's fast or slow device.

A CachedArray is a view description (dtype, shape, strides, byte offset) over an Object. It
never keeps a pointer: each use pins the object, builds an ndarray over the primary region's
current bytes, runs, and unpins. So views stay correct across evict/prefetch, and nothing moves
an array while a kernel reads or writes it.
"""

import builtins
import inspect
import numbers
import operator
import os
import pickle
import sys
import threading
import weakref

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from .errors import UseAfterFreeError
from .heap import HEADER
from .sizes import format_size

HANDLED_FUNCTIONS = {}
_tls = threading.local()
# NumPy functions that write their first argument, always or when a flag has the given truth:
# nan_to_num(x, copy=False) replaces in x, and overwrite_input=True lets the median family
# reorder its input.
_INPLACE_FIRST = {np.copyto, np.put, np.place, np.putmask, np.fill_diagonal,
                  np.put_along_axis}
_INPLACE_WHEN = {np.nan_to_num: ("copy", False),
                 **dict.fromkeys((np.median, np.nanmedian, np.percentile, np.nanpercentile,
                                  np.quantile, np.nanquantile), ("overwrite_input", True))}
_SCALARS = (numbers.Number, np.generic, str, bytes, type(None))


def implements(*numpy_functions):
    """Register a dedicated implementation of NumPy functions for CachedArray."""
    def decorator(fn):
        for f in numpy_functions:
            HANDLED_FUNCTIONS[f] = fn
        return fn
    return decorator


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

def _place(policy, nbytes, placement):
    """Ask the policy for an object: its own choice, or fast/slow memory when a hint is given."""
    if placement is None:
        return policy.allocate(nbytes)
    if placement == "slow":
        return policy.alloc_slow(nbytes)
    if placement == "fast":
        obj = policy.alloc_fast(nbytes, force=True)
        return obj if obj is not None else policy.alloc_slow(nbytes)
    raise ValueError(f"placement must be None, 'fast' or 'slow', not {placement!r}")


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
    nbytes = n * dt.itemsize
    with manager._lock:
        obj = _place(manager.policy, nbytes, placement)
        obj.pins += 1
        # The caller writes the new array at once: its primary differs from any slow twin.
        manager.policy.write_use(obj)
    scopes = getattr(_tls, "scopes", None)
    if scopes:
        ref = weakref.ref(obj)
        for rec in scopes:
            rec.append(ref)
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
        obj = self._obj
        r = obj.primary
        if r is None:
            raise self._gone()
        if r.nbytes == 0:
            # Nothing to read or write; a read-only one sits on an immutable (empty) buffer.
            return np.ndarray(self._shape, self._dtype, b"" if readonly else None)
        if readonly:
            # Built on the device's read-only buffer: NumPy refuses `flags.writeable = True`
            # (writes there would bypass the dirty bit and be lost at eviction).
            dev = r.device
            buf = dev._ro
            if buf is None:
                buf = dev.readonly_buffer
            return np.ndarray(self._shape, self._dtype, buf, r.offset + HEADER + self._offset,
                              self._strides)
        return np.ndarray(self._shape, self._dtype, r.device._mm,
                          r.offset + HEADER + self._offset, self._strides)

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
        with readable(self) as v:
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
        with readable(self) as v:
            self._m.count("asarray", self.nbytes, id=self._obj.id)
            return np.array(v, dtype=dtype, copy=True)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _array_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        for t in types:
            if not (issubclass(t, CachedArray) or issubclass(t, np.ndarray)):
                return NotImplemented
        impl = HANDLED_FUNCTIONS.get(func)
        if impl is not None:
            return impl(*args, **kwargs)
        return _call_on_views(func, args, kwargs)

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
        with readable(self) as v:
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
        with readable(self) as v:
            return v.item(*args)

    def tolist(self):
        with readable(self) as v:
            return v.tolist()

    def tobytes(self, order="C"):
        with readable(self) as v:
            return v.tobytes(order)

    def __reduce__(self):
        with readable(self) as v:
            return (_unpickle, (np.array(v, copy=True),))

    def __repr__(self):
        if self._obj.freed:
            return f"CachedArray(<freed>, shape={self._shape}, dtype={self._dtype})"
        with readable(self) as v:
            body = np.array2string(v, separator=", ", prefix="CachedArray(")
            dev = self._obj.primary.device.name
        return f"CachedArray({body}, dtype={self._dtype}, device={dev!r})"

    def __str__(self):
        with readable(self) as v:
            return str(v)

    __hash__ = None

    # ---- views ---------------------------------------------------------------------------

    def _viewop(self, fn):
        """Apply an ndarray view operation; a view stays a view, a copy becomes a new array."""
        m, obj = self._m, self._obj
        m.acquire((obj,))
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
            with readable(self) as v:
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
        if self._obj.pins:
            raise ValueError(
                f"cannot resize this array of shape {self._shape}: object {self._obj.id} is in "
                "use (pinned by an access scope or a running kernel); resize it afterwards")
        out = new_pinned(self._m, shape, self._dtype)
        try:
            with readable(self) as v:
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
        with readable(self) as v:
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
            res = _fast_call(ufunc, (self, other))
            if res is not _SLOW:
                return res
        if getattr(type(other), "__array_ufunc__", False) is None:
            return NotImplemented
        return ufunc(self, other)

    def reflected(self, other):
        if type(other) in _PY_SCALARS:
            res = _fast_call(ufunc, (other, self))
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
            with readable(self.base) as v:
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
    from .defaults import default_manager

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


def _to_views_recording(x, views):
    """Replace CachedArrays in x by ndarray views (pinned by the caller), noting each pair.

    Views are writable: NumPy runs some kernels (argmax, ...) several times slower on read-only
    arrays. Functions that write an input are the known in-place ones and out= targets, which
    the caller reports as writes.
    """
    if isinstance(x, CachedArray):
        v = x._view()
        views.append((x, v))
        return v
    if isinstance(x, list):
        return [_to_views_recording(y, views) for y in x]
    if isinstance(x, tuple):
        return tuple(_to_views_recording(y, views) for y in x)
    return x


def _plain_key(key):
    """Index keys holding CachedArrays become ndarrays (copies of small index arrays)."""
    if isinstance(key, CachedArray):
        with readable(key) as v:
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


def _acquire_grouped(reads, writes):
    """Pin objects that may belong to several managers; returns the release list."""
    objs = reads + writes if isinstance(reads, list) and isinstance(writes, list) else \
        list(reads) + list(writes)
    if objs:
        m = objs[0]._manager()
        if all(o._manager() is m for o in objs):
            m.acquire(reads, writes)
            return [(m, objs)]
    groups = {}
    for o in reads:
        groups.setdefault(o._manager(), ([], []))[0].append(o)
    for o in writes:
        groups.setdefault(o._manager(), ([], []))[1].append(o)
    done = []
    try:
        for m, (r, w) in groups.items():
            m.acquire(r, w)
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


_WRITES = {}      # NumPy function -> where its written arguments sit in a call (_writes_of)


def _writes_of(func):
    """Where func's written arguments sit in a call: (out, target, flag, flag truth).

    out and target (what an in-place function writes) are (position, keyword) pairs read from
    the signature of func or of its implementation, either part None when the argument cannot
    be given that way; target is written when flag (a pair too) has the given truth, or
    always when flag is None. Cached per function, as the signature is slow to read.
    """
    params = None
    for f in (func, getattr(func, "_implementation", None), getattr(func, "__wrapped__", None)):
        if f is not None:
            try:
                params = list(inspect.signature(f).parameters.values())
                break
            except (TypeError, ValueError):
                pass

    def slot(name, index=None):
        for i, p in enumerate(params or ()):
            if p.name == name or i == index:
                positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                named = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                return (i if positional else None, p.name if named else None)
        if params is None or any(p.kind is p.VAR_KEYWORD for p in params):
            return (index, name)                   # unknown layout: as given
        return None

    out = slot("out")
    target = flag = truth = None
    if func in _INPLACE_FIRST or func in _INPLACE_WHEN:
        target = slot(None, 0)
    if func in _INPLACE_WHEN:
        name, truth = _INPLACE_WHEN[func]
        flag = slot(name)
    spec = (out, target, flag, truth)
    if len(_WRITES) < 4096:
        _WRITES[func] = spec
    return spec


def _given(args, kwargs, at, missing=None):
    """The argument at `at` (position, keyword) of a call, or `missing`."""
    pos, name = at
    if pos is not None and pos < len(args):
        return args[pos]
    return kwargs.get(name, missing) if name is not None else missing


def _call_on_views(func, args, kwargs):
    """Run a NumPy function on views of the current primary regions, then wrap the result.

    What the function writes (its out, or the array an in-place function changes), given by
    position or by keyword, is acquired as a write, which marks it dirty.
    """
    out_at, target_at, flag_at, truth = _WRITES.get(func) or _writes_of(func)
    out = _given(args, kwargs, out_at) if out_at is not None else None
    target = None
    if target_at is not None and (flag_at is None or
                                  bool(_given(args, kwargs, flag_at, not truth)) is truth):
        target = _given(args, kwargs, target_at)       # an absent flag never writes
    written = list(_objects_in(out)) if out is not None else []
    if target is not None:
        written += list(_objects_in(target))
    rest = args
    if out is not None and out_at[0] is not None and out_at[0] < len(args):
        rest = args[:out_at[0]] + args[out_at[0] + 1:]
    read = list(_objects_in(list(rest) + [v for k, v in kwargs.items() if k != "out"]))
    like = kwargs.pop("like", None)
    m = _first_manager(list(args) + list(kwargs.values())) or \
        (like._m if isinstance(like, CachedArray) else None)
    done = _acquire_grouped(read, written)
    try:
        views = []

        nargs = [_to_views_recording(a, views) for a in args]
        nkwargs = {k: _to_views_recording(v, views) for k, v in kwargs.items()}
        res = func(*nargs, **nkwargs)
        if out is not None:
            if isinstance(out, tuple) and len(out) == 1:
                return out[0]
            return out
        if target is not None:
            for arr, v in views:
                if res is v:
                    return arr                     # NumPy returned the written array itself
        if func in _INPLACE_FIRST:
            return res
        return _wrap(m, res, views) if m is not None else res
    finally:
        _release_grouped(done)


# ---- ufuncs ----------------------------------------------------------------------------------

_HANDLED_TYPES = (np.ndarray, CachedArray, numbers.Number, np.generic, list, tuple, bool)


def _dtype_of(x):
    if isinstance(x, (CachedArray, np.ndarray, np.generic)):
        return x.dtype
    if isinstance(x, (bool, int, float, complex)):
        return type(x)
    return np.asarray(x).dtype


_SLOW = object()
_PY_SCALARS = (int, float, complex, bool)
_STRIDES = {}


def _c_strides(shape, itemsize):
    key = (shape, itemsize)
    st = _STRIDES.get(key)
    if st is None:
        st = _contiguous_strides(shape, itemsize)
        if len(_STRIDES) < 4096:
            _STRIDES[key] = st
    return st


def _fast_call(ufunc, inputs):
    """The common case: one manager, equal shapes, scalars; result written in place via out=."""
    m = None
    shape = None
    objs = []
    key = [ufunc, "same_kind"]
    for x in inputs:
        tx = type(x)
        if tx is CachedArray:
            if m is None:
                m = x._m
                shape = x._shape
            elif x._m is not m or x._shape != shape:
                return _SLOW
            objs.append(x._obj)
            key.append(x._dtype)
        elif tx in _PY_SCALARS:
            key.append(tx)
        elif isinstance(x, np.generic):
            key.append(x.dtype)
        else:
            return _SLOW
    if not shape:
        return _SLOW
    key = tuple(key)
    dt = _RESOLVED.get(key)
    if dt is None:
        dt = _resolve(ufunc, inputs, "same_kind")
        if dt is None or dt.hasobject:
            return _SLOW
    n = dt.itemsize
    for d in shape:
        n *= d
    with m._lock:
        m.acquire(objs)
        pinned = objs
        try:
            out = m.policy.allocate(n)
        except BaseException:
            m.release(objs)
            raise
        out.pins += 1
        m.policy.write_use(out)
        pinned.append(out)
    try:
        scopes = getattr(_tls, "scopes", None)
        if scopes:
            ref = weakref.ref(out)
            for rec in scopes:
                rec.append(ref)
        res = CachedArray._make(out, m, shape, dt, _c_strides(shape, dt.itemsize), 0)
        ufunc(*[x._view() if type(x) is CachedArray else x for x in inputs],
              out=res._view())
        return res
    finally:
        m.release(pinned)


def _array_ufunc(ufunc, method, inputs, kwargs):
    if method == "__call__" and not kwargs and ufunc.nout == 1 and ufunc.signature is None:
        res = _fast_call(ufunc, inputs)
        if res is not _SLOW:
            return res
    out = kwargs.pop("out", None)
    for x in inputs + (out or ()):
        if x is not None and not isinstance(x, _HANDLED_TYPES) and \
                hasattr(type(x), "__array_ufunc__"):
            return NotImplemented                # a foreign array type NumPy should try next
    reads = [x._obj for x in inputs if isinstance(x, CachedArray)]
    writes = [o._obj for o in (out or ()) if isinstance(o, CachedArray)]
    if method == "at" and isinstance(inputs[0], CachedArray):
        reads.remove(inputs[0]._obj)
        writes.append(inputs[0]._obj)
    m = _first_manager(inputs) or _first_manager(out or ())
    done = _acquire_grouped(reads, writes)
    try:
        args = tuple(x._view() if isinstance(x, CachedArray) else x
                     for x in inputs)
        if out is not None:
            outs = tuple(o._view() if isinstance(o, CachedArray) else o for o in out)
            getattr(ufunc, method)(*args, out=outs, **kwargs)
            return out[0] if len(out) == 1 else out
        if method == "__call__" and ufunc.nout == 1 and ufunc.signature is None and \
                not (set(kwargs) - {"where", "casting", "order"}):
            shape = _broadcast_shape(args)
            if shape:
                dt = _resolve(ufunc, args, kwargs.get("casting", "same_kind"))
                if dt is not None and not dt.hasobject:
                    res = new_pinned(m, shape, dt)
                    done.append((m, [res._obj]))
                    if "where" in kwargs:
                        res._view().fill(0)
                    ufunc(*args, out=(res._view(),), **kwargs)
                    return res
        if ufunc is np.matmul and method == "__call__" and not kwargs:
            shape = _matmul_shape(args)
            dt = _resolve(ufunc, args, "same_kind") if shape else None
            if dt is not None and not dt.hasobject:
                res = new_pinned(m, shape, dt)
                done.append((m, [res._obj]))
                ufunc(*args, out=res._view())
                return res
        if method == "at":
            getattr(ufunc, method)(*args, **kwargs)
            return None
        res = getattr(ufunc, method)(*args, **kwargs)
        return _wrap(m, res, ())
    finally:
        _release_grouped(done)


def _matmul_shape(args):
    """Result shape of np.matmul on two arrays (None when it is a scalar or not computable)."""
    if len(args) != 2 or not all(isinstance(a, np.ndarray) and a.ndim for a in args):
        return None
    a, b = args
    if a.shape[-1] != (b.shape[0] if b.ndim == 1 else b.shape[-2]):
        return None                      # let NumPy raise its own error
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    shape = batch + (a.shape[-2:-1] if a.ndim > 1 else ()) + (b.shape[-1:] if b.ndim > 1 else ())
    return shape or None


def _broadcast_shape(args):
    shapes = [a.shape for a in args if isinstance(a, np.ndarray)]
    first = shapes[0]
    for s in shapes[1:]:
        if s != first:
            return np.broadcast_shapes(*shapes, *(np.shape(a) for a in args
                                                  if not isinstance(a, np.ndarray)))
    for a in args:
        if not isinstance(a, (np.ndarray, numbers.Number, np.generic)):
            return np.broadcast_shapes(first, np.shape(a))
    return first


_RESOLVED = {}


def _resolve(ufunc, args, casting):
    key = (ufunc, casting) + tuple(_dtype_of(a) for a in args)
    dt = _RESOLVED.get(key)
    if dt is None:
        try:
            dts = ufunc.resolve_dtypes(key[2:] + (None,), casting=casting)
            dt = dts[-1]
        except Exception:
            return None
        if len(_RESOLVED) < 4096:
            _RESOLVED[key] = dt
    return dt


# ---- access scopes ---------------------------------------------------------------------------

class _Scope:
    """Pinned ndarray access to one CachedArray; see readable() and writable()."""

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
            m.acquire((), (a._obj,))
        else:
            m.acquire((a._obj,))
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


def readable(x):
    """``with readable(x) as a``: a read-only ndarray view of x; x is pinned meanwhile.

    The view is valid inside the with-block only: afterwards x may move and the view would
    show another array's bytes.
    """
    return _Scope(x, False)


def writable(x):
    """``with writable(x) as a``: a writable ndarray view of x, pinned; marks x dirty.

    The view is valid inside the with-block only: once x moves, writes through it would land
    in memory that belongs to another array (``Manager(debug=True)`` reports them).
    """
    return _Scope(x, True)


class access:
    """``with ca.access(reads, writes) as views``: pinned ndarray views of several arrays.

    One pin and one use report per array (reads as ``read_use``, writes as ``write_use``, which
    marks them dirty), taken together; ``views`` lists the read views then the write views,
    with None passed through for None entries. Read views are read-only. Arrays may belong to
    different managers; an array may appear in both lists. The views are valid inside the
    with-block only.
    """

    __slots__ = ("reads", "writes", "done")

    def __init__(self, reads=(), writes=()):
        for a in (*reads, *writes):
            if a is not None and not isinstance(a, CachedArray):
                raise TypeError(f"ca.access takes CachedArrays (or None), got {type(a).__name__}")
        self.reads, self.writes = reads, writes
        self.done = None

    def __enter__(self):
        r = [a._obj for a in self.reads if a is not None]
        w = [a._obj for a in self.writes if a is not None]
        self.done = _acquire_grouped(r, w)
        try:
            views = [None if a is None else a._view(readonly=True) for a in self.reads] + \
                [None if a is None else a._view() for a in self.writes]
            arrays = [a for a in (*self.reads, *self.writes) if a is not None]
            for m, _ in self.done:
                m.scope_opened(self, tuple((a._obj, a._shape) for a in arrays if a._m is m))
            return views
        except BaseException:
            for m, _ in self.done:
                m.scope_closed(self)
            _release_grouped(self.done)
            raise

    def __exit__(self, *exc):
        for m, _ in self.done:
            m.scope_closed(self)
        _release_grouped(self.done)
