"""CachedArray: a NumPy-compatible array whose bytes live in a manager's fast or slow device.

A CachedArray is a view description (dtype, shape, strides, byte offset) over an Object
(``pinning.ObjectView``). It never keeps a pointer: each use pins the object, asks the manager
for an ndarray over the primary region's current bytes, runs, and unpins. So views stay correct
across evict/prefetch, and nothing moves an array while a kernel reads or writes it.

This module is the type: creation of its instances, views, indexing, conversions and the ndarray
methods. Layout arithmetic is in ``cachedarrays.layout``, pinning in ``cachedarrays.pinning``,
``x.flat``/``x.flags`` in ``cachedarrays.viewattrs``. NumPy's protocols are forwarded to the
dispatch layer above (``cachedarrays.ufuncs``, ``cachedarrays.dispatch``) through handler slots
that layer fills when imported; the public access scopes are in ``cachedarrays.scopes``.
"""

import builtins
import functools
import operator
import os
import pickle
import sys
import threading
import weakref

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from ._records import bind_views as _bind_views
from ._records import getitem as _c_getitem
from ._records import operator as _c_operator
from ._records import run_ufunc as _c_run_ufunc
from .defaults import default_manager
from .errors import DeviceError
from .layout import (basic_index, c_strides, cast_dtype, check_dtype, contiguity,
                     contiguous_strides, creation_dtype, like_order, order_code,
                     shape_tuple, views_memory_of)
from .heap import HEADER
from .pinning import (OPEN_SCOPES, SHORT_BYTES, ObjectView, acquire_grouped, new_object,
                      objects_in, plain_key, pop_scope, push_scope, readable, record_new,
                      release_grouped, to_views)
from .sizes import format_size
from .viewattrs import FLAGS_FIXED, FlatIter, Flags


__all__ = ["CachedArray", "check_dtype", "new_pinned", "from_ndarray", "unpin", "push_scope",
           "pop_scope"]


def _caller_is_pandas():
    """True when the code converting a CachedArray (the caller of __array__) is in pandas.

    pandas' DataFrame and Series constructors look for a structured dtype's fields only on a
    numpy.ndarray; any other array is converted with np.asarray and its records land in a
    single column, silently.
    """
    frame = sys._getframe(2)
    name = frame.f_globals.get("__name__", "")
    return name == "pandas" or name.startswith("pandas.")


def _numba_compiles_nopython():
    """True when the code reading an attribute of a CachedArray is numba typing it (numba.typeof)
    for anything but an object-mode function (``jit(forceobj=True)``), which takes any Python
    object and keeps no pointer."""
    frame = sys._getframe(2)
    name = frame.f_globals.get("__name__", "")
    if name != "numba" and not name.startswith("numba."):
        return False
    for _ in range(8):                  # the dispatcher typing a call's argument, if it is one
        if frame is None:
            break
        if frame.f_code.co_name == "typeof_pyval":
            options = getattr(frame.f_locals.get("self"), "targetoptions", None) or {}
            return not options.get("forceobj")
        frame = frame.f_back
    return True


# ---- allocation ------------------------------------------------------------------------------

def new_layout(shape, dtype, order="C"):
    """(shape, dtype, strides, nbytes) of a new contiguous array, as NumPy lays it out: a
    sub-array dtype becomes trailing dimensions; any order but "F" is C order; a string dtype
    without a size holds one character, as in np.empty(3, "U")."""
    dt = creation_dtype(dtype)
    shape = shape_tuple(shape)
    if dt.subdtype is not None:          # (np.float64, (2,)): as NumPy, (*shape, 2) of float64
        dt, sub = dt.subdtype
        shape = shape + sub
    n = dt.itemsize
    for s in shape:
        n *= s
    strides = contiguous_strides(shape, dt.itemsize, "F") if order == "F" else \
        c_strides(shape, dt.itemsize)
    return shape, dt, strides, n


def new_pinned(manager, shape, dtype, order="C", placement=None):
    """Allocate an array through the manager's policy, returned pinned (release with unpin).

    placement: None lets the policy choose; "slow" or "fast" (fast if it fits after forced
    evictions, else slow) is a hint for arrays whose use the caller knows.
    """
    shape, dt, strides, n = new_layout(shape, dtype, order)
    if n and manager.fast.virtual:
        raise virtual_error(manager, shape, dt, n)
    obj = new_object(manager, n, placement)
    return CachedArray._make(obj, manager, shape, dt, strides, 0)


def virtual_error(manager, shape, dtype, nbytes):
    """The error for making an array with data on a virtual manager (made to replay traces)."""
    return DeviceError(
        f"a {shape} {dtype} array ({format_size(nbytes)}) cannot be made on {manager!r}: it is "
        "virtual (Manager(..., virtual=True)), which holds no data: its devices only count "
        "placement and traffic when a trace is replayed; make arrays on a Manager without "
        "virtual=True")


def unpin(arr):
    """Release an array returned pinned by new_pinned."""
    arr._m.release((arr._obj,))


def from_ndarray(manager, a, placement=None):
    """A new CachedArray holding a copy of ndarray a."""
    dt = check_dtype(a.dtype)
    shape = a.shape
    flags = a.flags
    if flags.f_contiguous and not flags.c_contiguous or not flags.forc and \
            like_order(shape, a.strides, dt.itemsize) == "F":       # NumPy's order="K" copy
        strides = contiguous_strides(shape, dt.itemsize, "F")
    else:
        strides = c_strides(shape, dt.itemsize)
    n = a.nbytes
    if n and manager.fast.virtual:
        raise virtual_error(manager, shape, dt, n)
    if placement is None:           # in C (run_ufunc) unless the manager is busy
        res = _c_run_ufunc(manager, _copy_of, (a,), (), shape, dt, strides, n, n <= SHORT_BYTES)
        if res is not None:
            return res

    def fill(obj):
        record_new(obj)
        out = CachedArray._make(obj, manager, shape, dt, strides, 0)
        np.copyto(out._view(), a, casting="no")
        return out
    return manager.run(fill, (), (), n, "use", n <= SHORT_BYTES, placement)


def _copy_of(a, *, out):
    """from_ndarray's kernel: the new array's view gets a's values."""
    np.copyto(out, a, casting="no")


# ---- NumPy protocol handlers -----------------------------------------------------------------
#
# The type forwards NumPy's protocols to the dispatch layer above it: __array_ufunc__ and the
# arithmetic operators to cachedarrays.ufuncs, __array_function__ to cachedarrays.dispatch.
# Those modules fill these slots when imported (the package's __init__ imports both), so this
# module never imports them. Until they are filled, NumPy calls on a CachedArray raise TypeError.

_SLOW = object()                # the operators' shortcut declined the call: take NumPy's route
_PY_SCALARS = (int, float, complex, bool)


def _no_shortcut(ufunc, inputs, out=None):
    return _SLOW


_fast_ufunc = _no_shortcut       # (ufunc, inputs, out=None) -> result, or _SLOW (operators)


def set_ufunc_handlers(handler, shortcut):
    """Install the NEP 13 handler (``__array_ufunc__(self, ufunc, method, *inputs, **kwargs)``)
    and the arithmetic operators' shortcut (cachedarrays.ufuncs calls this when imported)."""
    global _fast_ufunc
    _fast_ufunc = shortcut
    CachedArray.__array_ufunc__ = handler


def set_function_handler(handler):
    """Install the NEP 18 handler (``__array_function__(self, func, types, args, kwargs)``;
    cachedarrays.dispatch calls this when imported)."""
    CachedArray.__array_function__ = handler


def _writeable(view):
    """view.flags.writeable, without the warning NumPy attaches to the results of
    np.broadcast_arrays (writable ones NumPy warns about when written)."""
    flags = view.flags
    try:
        return flags._writeable_no_warn
    except AttributeError:              # a NumPy without it: the public flag
        return flags.writeable


# ---- the array type --------------------------------------------------------------------------

def fill_layout(shape, dt, objs=()):
    """(C strides, bytes, short) of a new C-order array of shape and dt filled from objs:
    short when it and they hold at most SHORT_BYTES (the C step then keeps the manager's
    lock while it fills)."""
    nbytes = dt.itemsize
    for d in shape:
        nbytes *= d
    total = nbytes
    for o in objs:
        total += o.nbytes
    return c_strides(shape, dt.itemsize), nbytes, total <= SHORT_BYTES


def new_filled(m, fill, operands, objs, shape, dt):
    """A new C-order CachedArray of shape and dt placed by m's policy and filled by
    ``fill(*operands, out=its view)``, each CachedArray operand replaced by its view and objs
    (their objects, at most 8) pinned and reported read: one C step (``run_ufunc``), as a
    ufunc's result is made; None when the manager is busy. A short fill runs under the
    manager's lock, so fill must run no code of the caller's."""
    strides, nbytes, short = fill_layout(shape, dt, objs)
    return _c_run_ufunc(m, fill, operands, objs, shape, dt, strides, nbytes, short)


def _take_rows(idx, v, out):
    """x[idx]'s fill: the rows idx names (each in range, checked first) gathered into out."""
    np.take(v, idx, axis=0, out=out, mode="wrap")


#: The casting rules np.copyto takes (astype's fills use it).
_COPYTO_RULES = ("no", "equiv", "safe", "same_kind", "unsafe")


def _copy_unsafe(v, out):
    """astype's fill: v cast into out as NumPy casts by default."""
    np.copyto(out, v, casting="unsafe")


def _copy_casting(casting):
    """astype's fill for another casting rule (NumPy names a bad rule when it runs)."""
    def fill(v, out):
        np.copyto(out, v, casting=casting)
    return fill


class CachedArray(ObjectView, NDArrayOperatorsMixin):
    """An n-dimensional array in tiered memory; behaves like numpy.ndarray."""

    __slots__ = ()
    __array_priority__ = 20

    def __init__(self, *args, **kwargs):
        raise TypeError("create CachedArrays with ca.asarray, ca.array, ca.empty, ca.zeros, "
                        "ca.ones, ca.full or their *_like forms")

    @classmethod
    def _copy_in(cls, manager, a, placement=None):
        """A new CachedArray holding a copy of ndarray a."""
        return from_ndarray(manager, a, placement)

    # ---- resolution (call only while pinned) ---------------------------------------------

    def _derive(self, base, view):
        """A CachedArray view for ndarray `view`, which shares memory with `base` (self's view);
        read-only when NumPy made `view` so (np.broadcast_to, x.diagonal(), ...)."""
        start = base.__array_interface__["data"][0] - self._offset
        off = view.__array_interface__["data"][0] - start
        # (read without the FutureWarning NumPy gives when np.broadcast_arrays' results are
        # asked whether they are writeable: that is the caller's question, not ours)
        cls = CachedArray if _writeable(view) else ReadOnlyCachedArray
        return self._view_of(cls._make(self._obj, self._m, view.shape, view.dtype, view.strides,
                                       off))

    # ---- properties ----------------------------------------------------------------------

    def _become(self, view):
        """Describe `view` (a view of the same object) from now on: in-place shape/dtype."""
        self._shape, self._dtype = view._shape, view._dtype
        self._strides, self._offset = view._strides, view._offset
        self._vc = None

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

    _writeable = True           # False for the views NumPy makes read-only

    @property
    def flags(self):
        """A snapshot of the layout flags (they cannot be set; see setflags)."""
        with readable(self) as v:
            return Flags(v.flags, self._base is None, self._writeable)

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

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """DLPack export of a copy, counted as np.asarray's (torch.as_tensor, torch.tensor,
        torch.from_dlpack, np.from_dlpack): DLPack allows a copy unless copy=False, and the
        array's own bytes can move. Without it torch reads a CachedArray as a sequence, one
        element at a time (and a 0-d one not at all)."""
        if self._dtype.kind not in "biufc":
            raise BufferError(
                f"DLPack carries booleans and numbers only; this CachedArray (shape "
                f"{self._shape}) has dtype {self._dtype}: convert it first, e.g. "
                "x.astype(np.float64), or pass np.asarray(x) for NumPy's own conversion")
        if copy is False:
            raise BufferError(
                f"a CachedArray (shape {self._shape}, dtype {self._dtype}) cannot be exported "
                "through DLPack without a copy: its data can move between devices; export a "
                "copy (copy=None or True, as torch.as_tensor(x) does), or pass `a` of "
                "`with ca.readable(x) as a:` and use the result inside the scope only")
        return self.__array__().__dlpack__(stream=stream, max_version=max_version,
                                           dl_device=dl_device, copy=copy)

    def __dlpack_device__(self):
        """The CPU (DLPack's kDLCPU, device 0): where __dlpack__'s copy lives."""
        return (1, 0)

    # Until the dispatch layer installs its handlers (set_ufunc_handlers,
    # set_function_handler), NumPy calls on a CachedArray raise TypeError.
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return NotImplemented

    def __array_function__(self, func, types, args, kwargs):
        return NotImplemented

    # ---- indexing ------------------------------------------------------------------------

    def _getitem(self, key):
        """x[key] for keys the C method (``__getitem__``, installed below) does not take: NumPy's
        indexing on the pinned bytes, a view when NumPy gives one."""
        if type(key) is slice or type(key) is tuple or type(key) is int:
            # A view by basic indexing: its layout is arithmetic, no byte is touched, so
            # nothing is pinned or used (the view resolves its bytes at its own use).
            sel = basic_index(self._shape, self._strides, key)
            if sel is not None and self._obj.primary is not None:
                return self._view_of(type(self)._make(self._obj, self._m, sel[0], self._dtype,
                                                      sel[1], self._offset + sel[2]))
        if type(key) is np.ndarray and self._shape and (key.ndim < 2 or key.flags.c_contiguous):
            # (NumPy lays x[key] out in the order of a key of other layouts: its general path)
            res = self._gathered(key)
            if res is not None:
                return res
        key = plain_key(key)
        m, obj = self._m, self._obj
        m.acquire((obj,))
        try:
            v = self._view()
            r = v[key]
            if isinstance(r, np.ndarray):
                if not r.flags.owndata and views_memory_of(r, v):
                    return self._derive(v, r)
                return from_ndarray(m, r)
            if type(r) is np.void:           # a record views the bytes, which can move
                return r.copy()
            return r
        finally:
            m.release((obj,))

    def _gathered(self, idx):
        """self[idx] for an integer ndarray idx whose entries are all in range (negative ones
        counting from the end), as NumPy gives it: a new C-order array of idx.shape +
        self.shape[1:], placed by the policy and filled in C by ``np.take`` (no copy in);
        None for any other index, an index out of range (NumPy then raises its error) or a
        busy manager."""
        if idx.dtype.kind not in "iu" or idx.dtype.itemsize > 8 or not idx.ndim:
            return None
        n = self._shape[0]
        if idx.size and (int(idx.min()) < -n or int(idx.max()) >= n):
            return None
        return new_filled(self._m, functools.partial(_take_rows, idx), (self,), (self._obj,),
                          idx.shape + self._shape[1:], self._dtype)

    def __setitem__(self, key, value):
        key = plain_key(key)
        m, obj = self._m, self._obj
        if type(value) in _PY_SCALARS or isinstance(value, np.generic):
            def put(_):
                self._kview()[key] = value
            m.run(put, (), (obj,), None, "use", obj.nbytes <= SHORT_BYTES)
            return
        if type(key) is int and isinstance(value, CachedArray) and value._obj is obj and \
                self._shape:
            return self._set_row(key, value)
        reads = list(objects_in(value))
        if all(o.manager is m for o in reads):
            m.acquire(reads, (obj,))
            try:
                self._view()[key] = to_views(value)
            finally:
                m.release(tuple(reads) + (obj,))
            return
        done = acquire_grouped(reads, [obj])   # a value of another manager: each pins its own
        try:
            self._view()[key] = to_views(value)
        finally:
            release_grouped(done)

    def _set_row(self, i, row):
        """x[i] = row, where row views x's own bytes (x[i] = x[j]).

        A swap through views, ``x[i], x[j] = x[j], x[i]`` (what np.random.shuffle and
        Generator.shuffle do with an array that is not a numpy.ndarray), would copy row j over
        row i and then row i's new bytes back: a duplicated row. Its second half is refused,
        with row i restored, so the array is left as it was.
        """
        m, obj = self._m, self._obj
        n = self._shape[0]
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of bounds for axis 0 with size {n}")
        if i < 0:
            i += n
        dst_off = self._offset + i * self._strides[0]
        layout = (obj.id, row._shape, row._strides, row._dtype)
        last = getattr(_last_row, "copy", None)
        m.acquire((obj,), (obj,))
        try:
            v = self._view()
            dst, src = v[i], ObjectView._view(row)      # src writable: it may be restored
            if last is not None and last[:2] == (layout, (row._offset, dst_off)) and \
                    last[3]() is obj and dst.shape == src.shape and \
                    dst.tobytes() == src.tobytes() != last[2].tobytes():
                _last_row.copy = None
                np.copyto(src, last[2])
                st = self._strides[0]
                k = (row._offset - self._offset) // st if st else i
                raise ValueError(
                    f"cannot set row {i} of this CachedArray of shape {self._shape} (object "
                    f"{obj.id}) from a view of row {k}, just set from row {i}: a swap through "
                    "views (x[i], x[j] = x[j], x[i], as np.random.shuffle does with arrays that "
                    "are not numpy.ndarray) would duplicate a row, so the array is left as it "
                    "was; shuffle rows with x[...] = x[rng.permutation(len(x))], or call "
                    "rng.shuffle(a) inside `with ca.writable(x) as a:`")
            _last_row.copy = (layout, (dst_off, row._offset), dst.copy(), weakref.ref(obj)) \
                if dst_off != row._offset else None
            dst[...] = src
        finally:
            m.release((obj, obj))

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
        if self._shape and kind is not bool:
            raise TypeError(f"only 0-dimensional arrays can be converted to Python scalars; "
                            f"this one has shape {self._shape}; use x.item() or x[0]")
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

    def __bytes__(self):
        """bytes(x) as NumPy gives it (the elements' bytes in C order): without this, bytes()
        would iterate x and keep each element's value as one byte."""
        with readable(self) as v:
            return bytes(v)

    def __reduce__(self):
        with readable(self) as v:
            return (_unpickle, (np.array(v, copy=True),))

    def __repr__(self):
        """The values, or a description that never raises (debuggers and logs call repr)."""
        obj = self._obj
        gone = "freed" if obj.freed else None
        if gone is None:
            m = obj._manager()
            if m is None or m.closed:
                gone = "freed: its manager is closed"
            elif obj.nbytes and obj.primary is not None and obj.primary.device.virtual:
                gone = f"no data: on virtual device {obj.primary.device.name!r}"
        if gone is not None:
            return f"CachedArray(<{gone}>, shape={self._shape}, dtype={self._dtype})"
        with readable(self) as v:
            body = np.array2string(v, separator=", ", prefix="CachedArray(")
            dev = self._obj.primary.device.name
        return f"CachedArray({body}, dtype={self._dtype}, device={dev!r})"

    def __str__(self):
        with readable(self) as v:
            return str(v)

    def __format__(self, spec):
        """As ndarray's: a 0-d array formats as its element, another only with an empty spec."""
        with readable(self) as v:
            return format(v, spec)

    __hash__ = None

    # ---- views ---------------------------------------------------------------------------

    def _viewop(self, fn):
        """Apply an ndarray view operation; a view stays a view, a copy becomes a new array."""
        m, obj = self._m, self._obj
        m.acquire((obj,), (), "view")
        try:
            v = self._view()
            r = fn(v)
            if r is v:
                return self                      # NumPy gave the array itself (x.real of reals)
            if isinstance(r, np.ndarray) and not r.flags.owndata and views_memory_of(r, v):
                return self._derive(v, r)
            if isinstance(r, np.ndarray):
                out = from_ndarray(m, r)
                if r.flags.writeable:
                    return out
                return ReadOnlyCachedArray._make(out._obj, m, out._shape, out._dtype,
                                                 out._strides, 0)
            return r
        finally:
            m.release((obj,))

    def reshape(self, *shape, order="C", copy=None):
        if not shape:
            raise TypeError("reshape() takes exactly 1 argument (0 given): the new shape")
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
        if dtype is None:               # a read-only view stays read-only
            self._check_live()
            cls = builtins.type(self) if type is None or not self._writeable else type
            return self._view_of(cls._make(self._obj, self._m, self._shape, self._dtype,
                                           self._strides, self._offset))
        check_dtype(dtype)
        return self._viewop(lambda v: v.view(dtype))

    def diagonal(self, offset=0, axis1=0, axis2=1):
        return self._viewop(lambda v: v.diagonal(offset, axis1, axis2))

    # ---- copies and in-place methods -----------------------------------------------------

    def copy(self, order="C"):
        return self.astype(self._dtype, order=order_code(order, "C"))

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        order = order_code(order)
        try:
            dt = check_dtype(dtype)
        except TypeError:
            if not np.dtype(dtype).hasobject:
                raise
            # no CachedArray holds objects: NumPy's ndarray, as NumPy functions give them
            with readable(self) as v:
                return v.astype(dtype, order, casting, subok)
        if not dt.itemsize:                  # 'U', 'S', 'V': sized as NumPy's cast sizes them
            dt = cast_dtype(self._dtype, dt)
        if not copy and dt == self._dtype and (order == "K" or self._in_order(order)):
            return self
        if order in ("K", "A"):
            order = like_order(self._shape, self._strides, self.itemsize, order)
        m = self._m
        if casting not in _COPYTO_RULES:
            # 'same_value', which np.copyto lacks, or a rule NumPy refuses: NumPy's own cast
            with readable(self) as v:
                cast = v.astype(dt, order, casting)
            out = new_pinned(m, self._shape, dt, order)
            try:
                np.copyto(out._view(), cast)
            finally:
                unpin(out)
            return out
        if order == "C" and not dt.shape and not m.fast.virtual:
            # the common copy: placed and filled in C, as a ufunc's result is
            fill = _copy_unsafe if casting == "unsafe" else _copy_casting(casting)
            res = new_filled(m, fill, (self,), (self._obj,), self._shape, dt)
            if res is not None:                  # None: the manager is busy
                return res
        out = new_pinned(m, self._shape, dt, order)
        try:
            with readable(self) as v:
                if out.ndim > v.ndim:        # a subarray dtype: each element fills a block
                    v = v[(...,) + (None,) * (out.ndim - v.ndim)]
                np.copyto(out._view(), v, casting=casting)
        finally:
            unpin(out)
        return out

    def _in_order(self, order):
        """True when the array is contiguous in order "C", "F" or "A" (either), as NumPy's
        flags tell it (an axis of length 1 may have any stride); always for "K"."""
        if order == "K" or order != "F" and self._strides == c_strides(self._shape,
                                                                       self.itemsize):
            return True
        c, f = contiguity(self._shape, self._strides, self.itemsize)
        return c if order == "C" else f if order == "F" else c or f

    def _write(self, fn, *args):
        """fn(view, *args) with self pinned as written (marked dirty, so no eviction drops the
        change) and CachedArrays among args pinned as read; returns fn's result."""
        done = acquire_grouped(list(objects_in(args)), [self._obj])
        try:
            return fn(self._view(), *to_views(args, readonly=True))
        finally:
            release_grouped(done)

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
        shape = shape_tuple(new_shape)
        if self._base is not None or self._strides != c_strides(self._shape, self.itemsize):
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
            with readable(self) as v:
                old = v.reshape(-1)
                new = out._view().reshape(-1)
                k = min(old.size, new.size)
                new[:k] = old[:k]
                new[k:].view(np.uint8).fill(0)
        finally:
            unpin(out)
        self._obj, self._shape, self._strides, self._offset = \
            out._obj, out._shape, out._strides, 0
        self._vc = None

    def setflags(self, write=None, align=None, uic=None):
        """Accepted when it changes nothing; a CachedArray's flags cannot be set."""
        if uic:
            raise ValueError("cannot set WRITEBACKIFCOPY flag to True")     # as NumPy
        if write in (None, True) and align in (None, True):
            return
        raise TypeError(FLAGS_FIXED)

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
        """None for an array that owns its object (a new array, a result, a copy); for a view
        (indexing, x.T, reshape, view, ...), the array that owns the object it was taken from,
        as NumPy's (a view of a view names that owner too), or the object itself when that
        array has moved to another (``resize``)."""
        b = self._base
        if b is None or b._obj is self._obj:
            return b
        return self._obj

    @property
    def flat(self):
        """A flat iterator over the array in C order; indexing it reads, assigning writes."""
        self._check_live()
        return FlatIter(self)

    @flat.setter
    def flat(self, value):
        """x.flat = value: every element, from value repeated in C order (as NumPy)."""
        FlatIter(self)[:] = value

    @property
    def ctypes(self):
        raise TypeError(_RAW_POINTER.format(name="ctypes"))

    @property
    def data(self):
        raise TypeError(_RAW_POINTER.format(name="data"))

    @property
    def _numba_type_(self):
        """numba's typing hook (numba.typeof): refused with the fix, where numba would raise
        a TypingError on a "pyobject". Compiled code keeps a raw pointer for the whole call,
        which must be a pinned view; other code (object mode too) sees no such attribute."""
        if not _numba_compiles_nopython():
            raise AttributeError(f"{type(self).__name__!r} object has no attribute "
                                 "'_numba_type_'")
        raise TypeError(
            f"numba cannot take a CachedArray (shape {self._shape}, dtype {self._dtype}, object "
            f"{self._obj.id}): compiled code would keep a raw pointer to bytes that an evict or "
            "prefetch can move; pass it a pinned view: `with ca.readable(x) as a: f(a)`, or "
            "`with ca.kernel(name, (x,), (y,)) as (a, b): f(a, b)` when f writes y")

    def __copy__(self):
        return self.copy(order="K")

    def __deepcopy__(self, memo):
        return self.copy(order="K")


class ReadOnlyCachedArray(CachedArray):
    """A view NumPy makes read-only (np.broadcast_to, sliding_window_view, x.diagonal(), the
    imaginary part of a real array): as NumPy's own, it refuses writes."""

    __slots__ = ()
    _writeable = False

    def _view(self, readonly=False):
        """A read-only ndarray over the current bytes: NumPy refuses writes through it."""
        return ObjectView._view(self, True)

    _kview = _view

    def __setitem__(self, key, value):
        raise ValueError("assignment destination is read-only")

    def setflags(self, write=None, align=None, uic=None):
        """Accepted when it changes nothing; a CachedArray's flags cannot be set."""
        if uic:
            raise ValueError("cannot set WRITEBACKIFCOPY flag to True")     # as NumPy
        if write in (None, False) and align in (None, True):
            return
        raise TypeError(FLAGS_FIXED)


_last_row = threading.local()   # .copy: the last x[i] = x[j]: layout, offsets, old row i, object


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


def _inplace(ufunc, name):
    """x op= y: the shortcut writing into x, else NumPy's ``ufunc(x, y, out=(x,))``."""
    def inplace(self, other):
        if type(other) is CachedArray or type(other) in _PY_SCALARS:
            if _fast_ufunc(ufunc, (self, other), self) is not _SLOW:
                return self
        return ufunc(self, other, out=(self,))
    inplace.__name__ = f"__i{name}__"
    return inplace


def _unary(ufunc, name):
    """-x, +x, abs(x), ~x: the shortcut, else NumPy's ``ufunc(x)``."""
    def op(self):
        res = _fast_ufunc(ufunc, (self,))
        return ufunc(self) if res is _SLOW else res
    op.__name__ = f"__{name}__"
    return op


for _uf, _name in ((np.add, "add"), (np.subtract, "sub"), (np.multiply, "mul"),
                   (np.true_divide, "truediv"), (np.floor_divide, "floordiv"),
                   (np.power, "pow"), (np.remainder, "mod"), (np.bitwise_and, "and"),
                   (np.bitwise_or, "or"), (np.bitwise_xor, "xor"), (np.left_shift, "lshift"),
                   (np.right_shift, "rshift")):
    _f, _r = _binary(_uf, _name)
    setattr(CachedArray, _f.__name__, _c_operator(_uf, _f, 0))
    setattr(CachedArray, _r.__name__, _c_operator(_uf, _r, 1))
    _i = _inplace(_uf, _name)
    setattr(CachedArray, _i.__name__, _c_operator(_uf, _i, 4))      # x op= y: in C first


def _equality(ufunc, name, op):
    """x == y, x != y as _binary's operator, and where the ufunc has no loop for the dtypes,
    ndarray's operator on the pinned views (it compares records field by field and unlike
    types as unequal)."""
    forward = _binary(ufunc, name)[0]

    def compare(self, other):
        try:
            return forward(self, other)
        except TypeError:
            done = acquire_grouped(list(objects_in((self, other))), [], name)
            try:
                res = op(self._view(), to_views(other))
                return from_ndarray(self._m, res) if isinstance(res, np.ndarray) else res
            finally:
                release_grouped(done)
    compare.__name__ = f"__{name}__"
    return compare


for _uf, _name in ((np.less, "lt"), (np.less_equal, "le"), (np.greater, "gt"),
                   (np.greater_equal, "ge")):
    # Python reflects comparisons itself (x < y is y > x)
    setattr(CachedArray, f"__{_name}__", _c_operator(_uf, _binary(_uf, _name)[0], 0))
for _uf, _name, _op in ((np.equal, "eq", operator.eq), (np.not_equal, "ne", operator.ne)):
    setattr(CachedArray, f"__{_name}__", _c_operator(_uf, _equality(_uf, _name, _op), 0))
for _uf, _name in ((np.negative, "neg"), (np.positive, "pos"), (np.absolute, "abs"),
                   (np.invert, "invert")):
    setattr(CachedArray, f"__{_name}__", _c_operator(_uf, _unary(_uf, _name), 2))


def _method(name):
    fn = getattr(np, name)

    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    method.__name__ = name
    method.__doc__ = f"Same as numpy.{name}(self, ...)."
    return method


def _reduction(name):
    """A reduction method: runs ndarray's own method on the pinned view when no argument is
    an array (no out=, where= or initial= array), else NumPy's function."""
    fn = getattr(np, name)
    on_view = getattr(np.ndarray, name)

    def method(self, *args, **kwargs):
        if kwargs and (kwargs.get("out") is not None or
                       any(isinstance(v, CachedArray) for v in kwargs.values())) or \
                args and any(isinstance(v, (CachedArray, np.ndarray, list, tuple))
                             for v in args):
            return fn(self, *args, **kwargs)
        m = self._m

        def kernel(_):
            r = on_view(self._kview(), *args, **kwargs)
            if type(r) is np.ndarray:
                return r[()] if r.ndim == 0 else from_ndarray(m, r)
            return r
        return m.run(kernel, (self._obj,), (), None, name, self._obj.nbytes <= SHORT_BYTES)
    method.__name__ = name
    method.__doc__ = f"Same as numpy.{name}(self, ...)."
    return method


for _name in ("cumsum", "cumprod", "clip", "round", "trace", "nonzero", "dot", "searchsorted",
              "repeat", "take", "conj", "conjugate", "argsort", "argpartition", "choose",
              "ptp" if hasattr(np, "ptp") else "cumsum"):
    setattr(CachedArray, _name, _method(_name))
# The reductions take their commonest calls (no out=, no array or sequence argument, the manager
# not busy) in C, which runs the same steps as the Python method (native/records.c: run_method).
for _name in ("sum", "mean", "std", "var", "min", "max", "argmin", "argmax", "prod", "all",
              "any"):
    setattr(CachedArray, _name, _c_operator(getattr(np.ndarray, _name), _reduction(_name), 3))

# The C side of the type (native/records.c): results of the commonest ufunc calls, and
# __getitem__, which makes basic-indexing views (ints and slices) in C and sends every other key
# to _getitem.
_bind_views(CachedArray, np.ndarray, HEADER, OPEN_SCOPES, record_new, from_ndarray)
CachedArray.__getitem__ = _c_getitem(CachedArray._getitem)
# x[key] = scalar with a basic key (ints, slices): in C first, else the method above
CachedArray.__setitem__ = _c_operator(operator.setitem, CachedArray.__setitem__, 5)

_RAW_POINTER = (
    "CachedArray.{name} is not available: it would hand out a raw pointer to wherever the data "
    "lives now, and an evict or prefetch can move the data and leave the pointer stale; use "
    "`with ca.readable(x) as a:` (or ca.writable) and a.{name} inside the scope, where x is "
    "pinned")


def _unpickle(a):
    return from_ndarray(default_manager(), a)
