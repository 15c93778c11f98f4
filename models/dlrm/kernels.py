"""Embedding-table kernels on plain NumPy arrays: gathers, bag sums and the fused sparse SGD.

Tables are C-ordered ``(nvectors, featuresize)`` arrays (one row per embedding vector).
Bags follow ``torch.nn.functional.embedding_bag(mode="sum")``: ``offsets`` holds the start
of every bag in ``indices`` (optionally followed by ``len(indices)``).  The numba kernels
never keep a reference to an argument after they return, so callers may pass arrays they
obtained from tiered memory inside a pinned scope.
"""

from __future__ import annotations

import logging
import math
import threading

import numba
import numpy as np
from numba.typed import List as TypedList

from cachedarrays import threads as _threads
from cachedarrays.layout import element_offsets
from cachedarrays.layout import readonly_view as _readonly
from cachedarrays.threads import serial_twin

from ._fs_kernels import BAGS_PER_ITEM as _BAGS_PER_ITEM
from ._fs_kernels import NO_BOUND, make_kernels, mark_refs, reindex

__all__ = [
    "lookup",
    "lookup_sum",
    "lookup_sum_indirect",
    "lookup_sum_indirect_hits",
    "lookup_many",
    "sgd_update",
    "sgd_update_indirect",
    "sgd_update_indirect_hits",
    "update_many",
    "accumulate_grad",
    "check_indices",
    "check_offsets",
    "check_lr",
    "release_buffers",
]

log = logging.getLogger(__name__)

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# ----------------------------------------------------------------------------------------
# Kernels per feature size.  ``_kernels_for(fs)`` builds, once per process and size, the
# kernels of ``_fs_kernels.make_kernels(fs)``: closures over the feature size, which numba
# compiles with constant trip counts (unrolled, vectorised loops without aliasing re-checks).
# ``fs = 0`` is the generic set (feature size read at run time) for rows wider than
# MAX_SPECIALISED_FS, ensembles of mixed sizes and ``set_specialised(False)``.  Both come from
# the same source and add in the same order, so results are bit-identical.
# ----------------------------------------------------------------------------------------

#: Feature sizes up to this get specialised kernels; wider rows use the generic ones.
MAX_SPECIALISED_FS = 512
_specialised_cache = {}
_specialised_lock = threading.RLock()
_USE_SPECIALISED = True


def _kernels_for(fs):
    """The kernels with feature size ``fs`` (0: generic), built once per process and size."""
    ks = _specialised_cache.get(fs)
    if ks is None:
        with _specialised_lock:
            ks = _specialised_cache.get(fs)
            if ks is None:
                ks = _specialised_cache[fs] = make_kernels(fs)
    return ks


#: Work a kernel does on the calling thread (its serial twin) instead of in a parallel region:
#: at most SERIAL_INDICES indices (or unique rows) in at most SERIAL_BAGS bags. Starting a
#: region wakes the pool's threads, which sleep between regions (``OMP_WAIT_POLICY=PASSIVE``):
#: 40-60 us on a 2-core VM, against 2-3 us spinning. A bag lookup in a 1M x 64 table took 40 us
#: in a region whatever its size up to 64 bags of 40, 1.5 us on the caller for one bag and
#: 15-18 us for 256 bags of one index or 64 bags of 40 (the region won from about 1,000 bags
#: of one index and 30,000 indices in bags of 40).
SERIAL_INDICES = 2048
SERIAL_BAGS = 256
_serial_cache = {}


def _small(nidx, nbags=0):
    """True when a kernel over nidx indices (or unique rows) in nbags bags runs serially: it is
    small, or no parallel region can run here (``threads.FORKED_AFTER_POOL``)."""
    return (nidx <= SERIAL_INDICES and nbags <= SERIAL_BAGS) or _threads.FORKED_AFTER_POOL


def _pick(name, fs, serial=False):
    """The kernel ``name`` for feature size ``fs`` (0: any size): specialised if it may be;
    its serial twin (``threads.serial_twin``, built on first use) if ``serial``."""
    fs = int(fs)
    if not _USE_SPECIALISED or fs < 1 or fs > MAX_SPECIALISED_FS:
        fs = 0
    kernel = _kernels_for(fs)[name]
    if not serial:
        return kernel
    twin = _serial_cache.get((fs, name))
    if twin is None:
        with _specialised_lock:
            twin = _serial_cache.get((fs, name))
            if twin is None:
                twin = _serial_cache[(fs, name)] = serial_twin(kernel, name + "_serial")
    return twin


def specialised_kernel(name, fs, serial=False):
    """The kernel ``name`` specialised for feature size ``fs`` (built once per process and
    size; its serial twin if ``serial``), or None where the generic one is used
    (``fs > MAX_SPECIALISED_FS``, or specialisation turned off).  Both variants take the same
    arguments."""
    fs = int(fs)
    if not _USE_SPECIALISED or fs < 1 or fs > MAX_SPECIALISED_FS:
        return None
    return _pick(name, fs, serial)


def set_specialised(enabled: bool) -> bool:
    """Turn feature-size specialisation on or off (for tests and comparisons); returns the old state."""
    global _USE_SPECIALISED
    old = _USE_SPECIALISED
    _USE_SPECIALISED = bool(enabled)
    return old


class _SlotPool:
    """Zeroed int32 scratch histograms, reused across calls (kernels leave them zeroed).

    Allocating and faulting in a fresh zeroed histogram costs more than the whole re-index for
    tables of ~10M rows; each buffer is 4 bytes per row of the largest table seen."""

    def __init__(self):
        self._pool_lock = threading.Lock()
        self._free = []

    def take(self, count, nrows):
        with self._pool_lock:
            for i, buf in enumerate(self._free):
                if buf.shape[0] >= count and buf.shape[1] >= nrows:
                    return self._free.pop(i)
        return np.zeros((count, nrows), dtype=np.int32)

    def give(self, buf):
        with self._pool_lock:
            self._free.append(buf)
            if len(self._free) > 4:  # keep the few largest
                self._free.sort(key=lambda b: b.size, reverse=True)
                del self._free[4:]

    def clear(self):
        with self._pool_lock:
            self._free.clear()

    @property
    def nbytes(self):
        with self._pool_lock:
            return sum(b.nbytes for b in self._free)


_slots = _SlotPool()


def release_buffers():
    """Free the scratch kept between calls: the update histograms (4 bytes per row of the
    largest table seen, up to four) and the calling thread's scratch arrays; returns the
    bytes let go. The next update of a large table allocates its histogram afresh."""
    freed = _slots.nbytes
    _slots.clear()
    kept = getattr(_scratch, "arrays", None) or {}
    freed += sum(b.nbytes for b in kept.values())
    kept.clear()
    return freed


# ----------------------------------------------------------------------------------------
# Argument checking (vectorised NumPy; runs before any kernel touches memory).
# ----------------------------------------------------------------------------------------


def _check_table(table, name, what="table"):
    if not isinstance(table, np.ndarray):
        raise TypeError(f"{what} {name!r}: expected a numpy.ndarray, got {type(table).__name__}")
    if table.ndim != 2:
        raise ValueError(f"{what} {name!r}: expected a 2-D (nvectors, featuresize) array, "
                         f"got shape {table.shape}")
    if table.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} {name!r}: dtype {table.dtype} is not supported; "
                        f"use float32 (or float64)")
    if not table.flags.c_contiguous:
        raise ValueError(f"{what} {name!r}: rows must be C-contiguous (strides {table.strides}); "
                         f"pass the table itself, not a column slice or a transpose")


_INT64_MAX = np.iinfo(np.int64).max


def _index_input(a, name, what):
    """``a`` as a 1-D integer ndarray in its own dtype (not yet cast, so nothing has wrapped);
    an empty list or tuple (NumPy makes it float64) is an empty int64 array."""
    if isinstance(a, (list, tuple)) and len(a) == 0:
        return np.zeros(0, dtype=np.int64)
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError(f"table {name!r}: {what} must be 1-D, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"table {name!r}: {what} must be an integer array, got dtype {a.dtype}")
    return a


def _as_index_array(a, name, what):
    if _plain_index_array(a):      # the usual input, as it is
        return a
    a = _index_input(a, name, what)
    if a.dtype == np.uint64 and a.size and a.max() > _INT64_MAX:
        # casting would wrap 2**64-1 to -1: refuse, naming the value as given
        bad = int(np.flatnonzero(a > _INT64_MAX)[0])
        error = IndexError if what == "indices" else ValueError
        raise error(f"table {name!r}: {what} value {int(a[bad])} at position {bad} is out of "
                    f"range (more than the largest int64)")
    return np.ascontiguousarray(a, dtype=np.int64)


@numba.njit(cache=True, nogil=True)
def _index_bounds(idx):
    """(min, max) of a non-empty 1-D integer array in one pass: NumPy's ``min()`` and ``max()``
    make two, and the check of a lookup's indices waits on memory (for 327,680 int64 fresh
    indices, 141 instead of 275 us)."""
    lo = idx[0]
    hi = idx[0]
    for j in range(1, idx.shape[0]):
        v = idx[j]
        lo = min(lo, v)
        hi = max(hi, v)
    return lo, hi


#: Index arrays from this many elements are checked in one pass (``_index_bounds``); shorter
#: ones by NumPy, whose two calls cost less than a numba dispatch there (and so are arrays in
#: a non-native byte order, which numba does not take).
_ONE_PASS_MIN = 1024


def check_indices(indices, nrows: int, name: str = "table") -> np.ndarray:
    """Return ``indices`` as contiguous int64; raise IndexError if any is outside [0, nrows).

    The bounds are checked on the values as given (before the cast to int64), so an unsigned
    index such as 2**64-1 is reported as itself, not as -1.
    """
    raw = _index_input(indices, name, "indices")
    if raw.size:
        if raw.shape[0] >= _ONE_PASS_MIN and raw.dtype.itemsize >= 4 and raw.dtype.isnative:
            lo, hi = _index_bounds(raw)
        else:
            lo, hi = raw.min(), raw.max()
        if lo < 0 or hi >= nrows:
            bad = int(np.flatnonzero((raw < 0) | (raw >= nrows))[0])
            raise IndexError(f"table {name!r}: index {int(raw[bad])} at position {bad} is out "
                             f"of range; valid rows are 0..{nrows - 1} (table has {nrows} rows)")
    return np.ascontiguousarray(raw, dtype=np.int64)


def bag_inputs(indices, offsets, nrows: int, nbags: int, name: str = "table"):
    """``(indices, offsets, check)`` for a bag lookup (``lookup_sum`` and its indirect kin):
    the offsets checked here; the indices checked here too, unless they are an int64 1-D
    contiguous array, which the kernel checks as it reads them (``check`` is then
    ``IN_KERNEL``, else False)."""
    if _plain_index_array(indices):
        idx, check = indices, IN_KERNEL
    else:
        idx, check = check_indices(indices, nrows, name), False
    return idx, check_offsets(offsets, idx.shape[0], nbags, name), check


def check_lr(lr, name: str = "table", dtype=None) -> float:
    """Return the learning rate as a float; ValueError unless it is finite and not negative
    (and, given the table's ``dtype``, representable in it)."""
    if isinstance(lr, (bool, np.bool_)) or not isinstance(lr, (int, float, np.integer,
                                                               np.floating)):
        raise TypeError(f"table {name!r}: learning rate must be a real number, got "
                        f"{type(lr).__name__}")
    try:
        value = float(lr)
    except OverflowError:           # an int beyond any float: 10**400
        raise ValueError(f"table {name!r}: learning rate must be a finite number >= 0, got an "
                         f"integer of {len(str(abs(lr)))} digits") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"table {name!r}: learning rate must be a finite number >= 0, "
                         f"got {lr!r}")
    if dtype is not None:
        with np.errstate(over="ignore"):
            if not np.isfinite(np.dtype(dtype).type(value)):
                raise ValueError(f"table {name!r}: learning rate {lr!r} does not fit in the "
                                 f"table's {np.dtype(dtype)}")
    return value


def check_offsets(offsets, nidx: int, nbags: int, name: str = "table") -> np.ndarray:
    """Return bag ``offsets`` (nbags or nbags+1 starts) as int64; ValueError if they are invalid.

    Int64 1-D contiguous offsets are checked in one compiled pass (8,192 of them: 7 instead
    of about 100 us); anything else, and anything that pass refuses, by the NumPy code below,
    which converts it or names the problem."""
    if _plain_index_array(offsets) and _offsets_ok(offsets, nidx, nbags)[0]:
        return offsets
    off = _as_index_array(offsets, name, "offsets")
    n = off.shape[0]
    if n not in (nbags, nbags + 1):
        raise ValueError(f"table {name!r}: {n} offsets for {nbags} bags; pass nbags start "
                         f"positions, optionally followed by len(indices) = {nidx}")
    if n == 0:
        if nidx != 0:
            raise ValueError(f"table {name!r}: no bags but {nidx} indices")
        return off
    if off[0] != 0:
        raise ValueError(f"table {name!r}: offsets[0] must be 0, got {int(off[0])}")
    if n > 1:
        steps = np.diff(off)
        if steps.min() < 0:
            bad = int(np.flatnonzero(steps < 0)[0]) + 1
            raise ValueError(f"table {name!r}: offsets must be non-decreasing; offsets[{bad}] = "
                             f"{int(off[bad])} < offsets[{bad - 1}] = {int(off[bad - 1])}")
    if off[-1] > nidx:
        raise ValueError(f"table {name!r}: last offset {int(off[-1])} exceeds len(indices) = {nidx}")
    if n == nbags + 1 and off[-1] != nidx:
        raise ValueError(f"table {name!r}: with nbags+1 offsets the last must equal "
                         f"len(indices) = {nidx}, got {int(off[-1])}")
    return off


def _plain(arr, name, what):
    """``arr`` as a plain ndarray: a subclass (np.matrix, a masked array) as a base-class view
    of its data, since the kernels index it as a flat buffer (a matrix stays 2-D when
    reshaped to -1, and the kernels would write past its end)."""
    if type(arr) is np.ndarray:
        return arr
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"table {name!r}: {what} must be a numpy.ndarray, got "
                        f"{type(arr).__name__}; pass np.asarray({what})")
    if isinstance(arr, np.ma.MaskedArray) and np.ma.getmask(arr) is not np.ma.nomask \
            and np.ma.getmask(arr).any():
        raise ValueError(f"table {name!r}: {what} is a masked array with masked entries; "
                         f"pass a plain numpy.ndarray")
    return arr.view(np.ndarray)


def _flat_rows(arr, nrows, ncols, dtype, name, what):
    """View a (nrows, ncols) block with unit column stride as (flat buffer, row stride)."""
    arr = _plain(arr, name, what)
    if arr.ndim != 2 or arr.shape[0] != nrows or arr.shape[1] != ncols:
        raise ValueError(f"table {name!r}: {what} has shape {arr.shape}, expected ({nrows}, {ncols})")
    if arr.dtype != dtype:
        raise TypeError(f"table {name!r}: {what} dtype {arr.dtype} differs from the table's {dtype}")
    isz = arr.itemsize
    if nrows == 0 or ncols == 0:
        return np.empty(0, dtype=dtype), 0
    if arr.strides[1] != isz or arr.strides[0] % isz != 0 or arr.strides[0] < ncols * isz:
        return None, 0
    stride = arr.strides[0] // isz
    if stride == ncols:
        # contiguous rows: a plain flat view (as_strided measured 40-50 us after a lookup had
        # streamed its rows through the caches, this under 5)
        return arr.reshape(-1), stride
    flat = np.lib.stride_tricks.as_strided(arr, shape=((nrows - 1) * stride + ncols,),
                                           strides=(isz,))
    return flat, stride


def _output(out, nrows, ncols, dtype, name):
    """Allocate or validate an output block; returns (out, flat, stride, scratch)."""
    if out is None:
        out = np.empty((nrows, ncols), dtype=dtype)
    elif not out.flags.writeable:
        raise ValueError(f"table {name!r}: out is read-only; pass a writable array (or None "
                         f"for a new one)")
    flat, stride = _flat_rows(out, nrows, ncols, dtype, name, "out")
    if flat is None:  # exotic strides: compute into scratch, copy at the end
        log.debug("table %r: out strides %s are not unit-stride rows; using a scratch copy",
                  name, out.strides)
        scratch = np.empty((nrows, ncols), dtype=dtype)
        return out, scratch.reshape(-1), ncols, scratch
    return out, flat, stride, None


def _gradient(dout, nbags, ncols, dtype, name):
    flat, stride = _flat_rows(dout, nbags, ncols, dtype, name, "dout")
    if flat is None:
        flat, stride = np.ascontiguousarray(_plain(dout, name, "dout")).reshape(-1), ncols
    return _readonly(flat), stride      # read-only: one numba type whatever dout's flags


def _nbags_of(out, offsets):
    if out is not None:
        if not isinstance(out, np.ndarray) or out.ndim != 2:
            raise ValueError("out must be a 2-D numpy.ndarray (nbags, featuresize)")
        return out.shape[0]
    return np.asarray(offsets).shape[0]


def _indices(indices, nrows, name, check):
    """Indices as int64; validated only when ``check`` (tables pass False for indices they
    validated already)."""
    if check:
        return check_indices(indices, nrows, name)
    return _as_index_array(indices, name, "indices")


def _offsets(offsets, nidx, nbags, name, check):
    if check:
        return check_offsets(offsets, nidx, nbags, name)
    return _as_index_array(offsets, name, "offsets")


def _where_array(where, name):
    """``where`` as the kernels take it: int32 (a table's own while its row and slot numbers
    fit; see ``embedding.where_dtype``) or int64, contiguous; other integer dtypes become
    int64."""
    if (isinstance(where, np.ndarray) and where.dtype == np.int32 and where.ndim == 1
            and where.flags.c_contiguous):
        return where
    return _as_index_array(where, name, "where")


def _check_where(where, base, cache, idx, name, check=True):
    where = _where_array(where, name)
    if not check:
        return where
    if where.shape[0] != base.shape[0]:
        raise ValueError(f"table {name!r}: where has {where.shape[0]} entries for "
                         f"{base.shape[0]} base rows")
    if cache.shape[1] != base.shape[1] or cache.dtype != base.dtype:
        raise ValueError(f"table {name!r}: cache {cache.shape} {cache.dtype} does not match "
                         f"base {base.shape} {base.dtype}")
    if idx.size:
        used = where[idx]
        if used.min() < -1 or used.max() >= cache.shape[0]:
            bad = np.flatnonzero((used < -1) | (used >= cache.shape[0]))[0]
            raise IndexError(f"table {name!r}: row {int(idx[bad])} maps to cache slot "
                             f"{int(used[bad])}; valid slots are -1 (base) and "
                             f"0..{cache.shape[0] - 1}")
    return where


# ----------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------


def lookup(table, indices, out=None, *, name="table", check=True):
    """Non-reducing gather ``out[i, :] = table[indices[i], :]``; returns ``out``.

    ``check=False`` skips the index range check (for callers that validated the indices)."""
    _check_table(table, name)
    idx = _indices(indices, table.shape[0], name, check)
    out, flat, stride, scratch = _output(out, idx.shape[0], table.shape[1], table.dtype, name)
    if idx.size and table.shape[1]:
        gather = _pick("gather", table.shape[1], _small(idx.shape[0]))
        gather(_readonly(table), idx, flat, stride, 0)
    if scratch is not None:
        out[...] = scratch
    return out


def lookup_sum(table, indices, offsets, out=None, *, name="table", check=True):
    """Sum-pooled bag lookup (``embedding_bag(mode="sum")``); ``out`` may be a column block.

    Without ``out`` there are ``len(offsets)`` bags, so pass ``out`` when ``offsets`` ends with
    ``len(indices)``.  ``check``: True checks indices and offsets first, False trusts them,
    ``IN_KERNEL`` trusts the offsets and checks the indices in the kernel."""
    _check_table(table, name)
    return _lookup_bags(table, table, None, indices, offsets, out, name, check)[0]


def lookup_sum_indirect(base, cache, where, indices, offsets, out=None, *, name="table",
                        check=True):
    """Bag-sum lookup where row r lives at ``cache[where[r]]`` if ``where[r] >= 0`` else ``base[r]``.

    ``check=False`` trusts indices, offsets and ``where`` (a table that keeps them valid);
    ``IN_KERNEL`` trusts offsets and ``where`` and checks the indices in the kernel."""
    _check_table(base, name, "base")
    _check_table(cache, name, "cache")
    return _lookup_bags(base, cache, where, indices, offsets, out, name, check)[0]


def _check_missed(missed, nidx, name):
    """A lookup's ``missed`` is None or a writable int64 array with one entry per index."""
    if missed is not None and (not isinstance(missed, np.ndarray) or missed.dtype != np.int64
                               or missed.shape != (nidx,) or not missed.flags.writeable):
        raise ValueError(f"table {name!r}: missed must be a writable int64 array with one entry "
                         "per index")


def _check_refs(refs, nrows, name):
    """A lookup's ``refs`` is None or a writable, contiguous uint8 array, one entry per row."""
    if refs is not None and (not isinstance(refs, np.ndarray) or refs.dtype != np.uint8
                             or refs.shape != (nrows,) or not refs.flags.writeable
                             or not refs.flags.c_contiguous):
        raise ValueError(f"table {name!r}: refs must be a writable, contiguous uint8 array with "
                         "one entry per base row")


def _check_dirty(dirty, nslots, name):
    """An update's ``dirty`` is None or a writable uint8 array, one entry per cache row."""
    if dirty is not None and (not isinstance(dirty, np.ndarray) or dirty.dtype != np.uint8
                              or dirty.shape != (nslots,) or not dirty.flags.writeable):
        raise ValueError(f"table {name!r}: dirty must be a writable uint8 array with one entry "
                         "per cache row")


def lookup_sum_indirect_hits(base, cache, where, indices, offsets, out, missed=None, *,
                             refs=None, name="table", check=True):
    """``lookup_sum_indirect`` that also returns how many indices were served from the cache:
    ``(out, hits)``. Given ``missed`` (int64, one entry per index), its first
    ``len(indices) - hits`` entries get the rows of the other indices, in index order.
    Given ``refs`` (uint8, one entry per base row), ``refs[r]`` becomes 1 for every cached
    row r read (a table's record of which cached rows were used since it last looked)."""
    _check_table(base, name, "base")
    _check_table(cache, name, "cache")
    _check_missed(missed, np.shape(indices)[0], name)
    _check_refs(refs, base.shape[0], name)
    return _lookup_bags(base, cache, where, indices, offsets, out, name, check, missed, refs)


def _bounded_indices(indices, nrows, name, check):
    """(indices, bound) for a lookup kernel: int64 indices as they are with the bound ``nrows``
    the kernel holds them to when ``check`` is ``IN_KERNEL``, else the indices checked here
    (``check`` True) or trusted, with ``NO_BOUND``."""
    if check == IN_KERNEL and _plain_index_array(indices):
        return indices, np.uint64(nrows)
    return _indices(indices, nrows, name, bool(check)), NO_BOUND


def _lookup_bags(base, cache, where, indices, offsets, out, name, check, missed=None, refs=None):
    """The bag sums of ``lookup_sum`` (``where=None``, ``cache=base``) and ``lookup_sum_indirect``.

    ``missed`` (int64, one per index) gets the rows of the indices not served from the
    cache at its front, in index order; ``refs`` (uint8, one per base row) marks the cached
    rows read.  Returns ``(out, hits)``: hits counts indices served from the cache.

    ``check``: True checks everything first, False trusts everything, ``IN_KERNEL`` trusts
    the offsets (and ``where``) and has the kernel check the indices as it reads them."""
    nbags = _nbags_of(out, offsets)
    fs = base.shape[1]
    idx, bound = _bounded_indices(indices, base.shape[0], name,
                                  check if nbags and fs else bool(check))
    check = check is True
    off = _offsets(offsets, idx.shape[0], nbags, name, check)
    if where is not None:
        where = _check_where(where, base, cache, idx, name, check)
    out, flat, stride, scratch = _output(out, nbags, fs, base.dtype, name)
    hits = 0
    if nbags and fs:
        # read-only views and empty arrays for "none": one compiled signature per dtype and
        # table kind, whether the caller's arrays are writable or not
        b = _readonly(base)
        bad = np.zeros(1, dtype=np.uint8)
        if where is None:
            bag_sum = _pick("bag_sum", fs, _small(idx.shape[0], nbags))
            hits = bag_sum(b, b, None, idx, off, nbags, flat, stride, 0, _NO_MARKS, bound, bad)
        else:
            hits = _indirect_bags(b, _readonly(cache), where, idx, off, nbags, flat, stride,
                                  missed, refs, bound, bad, name)
        if bad[0]:
            _raise_flagged(idx, off, base.shape[0], nbags, name)
    elif where is not None:
        served = where[idx] >= 0
        hits = int(np.count_nonzero(served))
        if missed is not None:
            listed = idx[~served]
            missed[:listed.shape[0]] = listed
        if refs is not None:
            mark_refs(where, idx, refs)
    if scratch is not None:
        out[...] = scratch
    return out, int(hits)


def _raise_flagged(indices, offsets, nrows, nbags, name):
    """Raise the error a bag kernel flagged: the offsets' (as ``check_offsets`` names it),
    else the first index out of range."""
    check_offsets(offsets, indices.shape[0], nbags, name)
    check_indices(indices, nrows, name)
    raise AssertionError("the lookup kernel flagged indices and offsets that are valid")


def plain_bags(indices, offsets, nbags):
    """True when a lookup of ``nbags >= 1`` bags may go to ``lookup_sum_plain``: int64 1-D
    contiguous ``indices`` and ``offsets``, ``nbags`` or ``nbags + 1`` of the latter."""
    return (type(indices) is np.ndarray and type(offsets) is np.ndarray and nbags > 0
            and indices.dtype is _INT64 and offsets.dtype is _INT64
            and indices.ndim == 1 and offsets.ndim == 1
            and nbags <= offsets.shape[0] <= nbags + 1
            and indices.flags.c_contiguous and offsets.flags.c_contiguous)


def lookup_sum_plain(table, indices, offsets, out, name="table"):
    """``lookup_sum`` in one kernel call, for inputs ``plain_bags`` accepts, a read-only
    ``table`` (a ``ca.kernel`` read view) and an ``out`` of its dtype with contiguous rows:
    the kernel checks the offsets and the indices as it reads them (nothing before it), and
    a bad one raises the error the checks would have, after it (``out`` partly written).

    A lookup's Python runs with cold caches, the last lookup having streamed its rows
    through them: each layer of the general path costs several microseconds there."""
    nbags = out.shape[0]
    bad = np.zeros(1, dtype=np.uint8)
    bag_sum = _pick("bag_sum", table.shape[1], _small(indices.shape[0], nbags))
    table = _readonly(table)        # a writable table too, without a second compile
    bag_sum(table, table, None, indices, offsets, nbags, out.reshape(-1), table.shape[1], 0,
            _NO_MARKS, np.uint64(table.shape[0]), bad)
    if bad[0]:
        _raise_flagged(indices, offsets, table.shape[0], nbags, name)
    return out


def _indirect_bags(b, c, where, idx, off, nbags, flat, stride, missed, refs, bound, bad, name):
    """The bag sums of an indirect table (read-only views b and c); returns the hits.
    ``bound``: see ``_lookup_bags``; only the two-pass kernel checks indices against it, so
    the one-pass kernel gets them checked first."""
    fs = b.shape[1]
    delta = _distance(b, c) if _INDIRECT_LOOKUP == "bag_sum_cached" else None
    if delta is not None:
        bag_sum_cached = _pick("bag_sum_cached", fs, _small(idx.shape[0], nbags))
        hits, _ = bag_sum_cached(b, where, idx, off, nbags, flat, stride, 0,
                                 _NO_ROWS if missed is None else missed, delta,
                                 scratch("positions", idx.shape[0], np.uint64),
                                 _NO_MARKS if refs is None else refs, bound, bad)
        return hits
    if bound != NO_BOUND:
        check_indices(idx, b.shape[0], name)
    if refs is not None:    # the one-pass kernel does not mark: a pass of its own
        mark_refs(where, idx, refs)
    marks = _NO_MARKS if missed is None else np.zeros(idx.shape[0], dtype=np.uint8)
    bag_sum = _pick("bag_sum", fs, _small(idx.shape[0], nbags))
    hits = bag_sum(b, c, where, idx, off, nbags, flat, stride, 0, marks, bound, bad)
    if missed is not None:
        listed = idx[np.flatnonzero(marks.view(np.bool_))]
        missed[:listed.shape[0]] = listed
    return hits


class CachingLookup:
    """A lookup between ``lookup_caching_begin`` and ``lookup_caching_end``: its indices
    translated (``pos``), ``hits`` of them cached; the positions of the other ``nmissed``
    at the front of ``missed``, their ``nrows`` rows in ``rows`` (first seen first) and
    marked in ``where``, ``kof[q]`` the number of missed[q]'s row."""

    __slots__ = ("base", "where", "off", "nbags", "out", "flat", "stride", "scratch", "pos",
                 "delta", "missed", "kof", "rows", "hits", "nmissed", "nrows")

    def missed_rows(self):
        """The rows marked in ``where``, k-th first."""
        return self.rows[:self.nrows]


def lookup_caching_begin(base, cache, where, indices, offsets, out, refs=None, *,
                         name="table", check=False):
    """The first pass of a table's bag lookup that caches the rows it misses: every index
    translated to where its row lives (see ``bag_sum_cached``), the missed rows listed once
    each and marked in ``where`` (-2 - k for the k-th); then ``lookup_caching_end`` copies
    them into the slots given and sums the bags. For a table's own arrays: ``where``
    valid, the pool apart from the base, the offsets checked (``check`` False, or
    ``IN_KERNEL`` to check the indices in the kernel). Returns a ``CachingLookup``, or
    None (nothing done) where the two-pass kernel does not serve."""
    nbags = _nbags_of(out, offsets)
    fs = base.shape[1]
    if check is True or not nbags or not fs or _INDIRECT_LOOKUP != "bag_sum_cached":
        return None
    delta = _distance(base, cache)
    if delta is None:
        return None
    idx, bound = _bounded_indices(indices, base.shape[0], name, check)
    nidx = idx.shape[0]
    look = CachingLookup()
    look.base, look.nbags, look.delta = _readonly(base), nbags, delta
    look.off = _offsets(offsets, nidx, nbags, name, False)
    look.where = _where_array(where, name)
    look.out, look.flat, look.stride, look.scratch = _output(out, nbags, fs, base.dtype, name)
    look.pos = scratch("positions", nidx, np.uint64)
    look.missed = scratch("missed", nidx, np.int64)
    look.kof = scratch("missed_rank", nidx, np.int64)
    look.rows = scratch("miss_rows", nidx, np.int64)
    bad = np.zeros(1, dtype=np.uint8)
    hits, nmissed, nrows = _pick("translate_cached", fs, _small(nidx))(
        look.base, look.where, idx, look.missed, delta, look.pos,
        _NO_MARKS if refs is None else refs, bound, bad, look.rows, look.kof)
    if bad[0]:
        check_indices(idx, base.shape[0], name)     # raises, naming the first bad index
        raise AssertionError("the lookup kernel flagged an index that is in range")
    look.hits, look.nmissed, look.nrows = int(hits), int(nmissed), int(nrows)
    return look


def lookup_caching_end(look, cache, backedge, slots):
    """The first ``len(slots)`` missed rows of ``look`` copied into those slots of ``cache``
    (a writable view of the pool; None with no slots) and pointed at them, the others
    unmarked; then the bag sums into ``look``'s ``out``, every cached row read from the
    pool."""
    fs = look.base.shape[1]
    if cache is None:
        cache = np.empty((0, fs), dtype=look.base.dtype)
    bag_sum_placed = _pick("bag_sum_placed", fs, _small(look.pos.shape[0], look.nbags))
    bag_sum_placed(look.base, cache, look.where, backedge, look.off, look.nbags, look.flat,
                   look.stride, 0, look.pos, look.delta, look.missed, look.kof, look.nmissed,
                   look.rows, look.nrows, slots)
    if look.scratch is not None:
        look.out[...] = look.scratch
    return look.out


def _prepare_update(nrows, indices, offsets, dout, dtype, fs, name, check=True):
    idx = _indices(indices, nrows, name, check)
    if offsets is None:  # one index per bag (the pullback of a non-reducing lookup)
        offsets = np.arange(idx.shape[0], dtype=np.int64)
    if not isinstance(dout, np.ndarray) or dout.ndim != 2:
        raise ValueError(f"table {name!r}: dout must be a 2-D numpy.ndarray (nbags, featuresize)")
    nbags = dout.shape[0]
    off = _offsets(offsets, idx.shape[0], nbags, name, check)
    gflat, gstride = _gradient(dout, nbags, fs, dtype, name)
    return idx, off, nbags, gflat, gstride


def _reindexed(nrows, idx, off, nbags):
    """``reindex`` of one table's indices: (rows, bounds, occ, nu). ``rows[:nu]`` is a new
    array (callers return it); ``bounds`` and ``occ`` are the thread's scratch, valid until its
    next update (fresh, their page faults cost ~1 ms per 327,680 indices)."""
    n = idx.shape[0]
    rows = np.empty(n, dtype=np.int64)
    bounds = scratch("reindex_bounds", n + 2, np.int64)
    occ = scratch("reindex_occ", n, np.int64)
    nu = 0
    if n:
        slot = _slots.take(1, nrows)
        nu = reindex(idx, off, nbags, slot[0], rows, bounds, occ)
        _slots.give(slot)  # not on error: a half-used histogram is not zero
    return rows, bounds, occ, nu


def sgd_update(table, indices, offsets, dout, lr, *, name="table", check=True):
    """Fused pullback + SGD: ``table[r] -= lr * sum(dout[bag] for each occurrence of r)``.

    Every unique row is updated once by one thread, summing its occurrences in order, so the
    result is deterministic.  ``offsets=None`` means one index per bag.  Returns the unique rows.
    """
    _check_table(table, name)
    _check_writable(table, name)
    lr = check_lr(lr, name, table.dtype)
    idx, off, nbags, gflat, gstride = _prepare_update(table.shape[0], indices, offsets, dout,
                                                      table.dtype, table.shape[1], name, check)
    rows, bounds, occ, nu = _reindexed(table.shape[0], idx, off, nbags)
    if nu and table.shape[1]:
        apply_sgd = _pick("apply_sgd", table.shape[1], _small(nu))
        apply_sgd(table, table, None, rows, bounds, occ, nu, gflat, gstride, 0,
                  table.dtype.type(lr))
    return rows[:nu]


def sgd_update_indirect(base, cache, where, indices, offsets, dout, lr, *, name="table",
                        check=True):
    """Fused SGD that writes each row where it lives (``cache[where[r]]`` or ``base[r]``).
    Returns the unique rows."""
    return sgd_update_indirect_hits(base, cache, where, indices, offsets, dout, lr, name=name,
                                    check=check)[0]


def sgd_update_indirect_hits(base, cache, where, indices, offsets, dout, lr, dirty=None, *,
                             name="table", check=True):
    """``sgd_update_indirect`` that also returns how many of the unique rows were cached:
    ``(rows, hits)``. Given ``dirty`` (uint8, one per cache row), sets ``dirty[where[r]] = 1``
    for every cached row it writes."""
    _check_table(base, name, "base")
    _check_table(cache, name, "cache")
    _check_writable(base, name, "base")
    _check_writable(cache, name, "cache")
    _check_dirty(dirty, cache.shape[0], name)
    lr = check_lr(lr, name, base.dtype)
    idx, off, nbags, gflat, gstride = _prepare_update(base.shape[0], indices, offsets, dout,
                                                      base.dtype, base.shape[1], name, check)
    where = _check_where(where, base, cache, idx, name, check)
    rows, bounds, occ, nu = _reindexed(base.shape[0], idx, off, nbags)
    fs = base.shape[1]
    delta = _distance(base, cache) if nu and fs else None
    if delta is not None:
        apply_sgd_cached = _pick("apply_sgd_cached", fs, _small(nu))
        hits = apply_sgd_cached(base, where, rows, bounds, occ, nu, gflat, gstride, 0,
                                base.dtype.type(lr), delta,
                                _NO_MARKS if dirty is None else dirty)
        return rows[:nu], int(hits)
    if nu and fs:
        apply_sgd = _pick("apply_sgd", fs, _small(nu))
        apply_sgd(base, cache, where, rows, bounds, occ, nu, gflat, gstride, 0,
                  base.dtype.type(lr))
    slots = where[rows[:nu]]
    slots = slots[slots >= 0]
    if dirty is not None:
        dirty[slots] = 1
    return rows[:nu], int(slots.shape[0])


def accumulate_grad(indices, offsets, dout, nrows, *, name="table"):
    """Sparse gradient of a bag-sum lookup: ``(unique_rows, grads)`` with rows in first-seen order."""
    dout = np.asarray(dout)
    if dout.ndim != 2 or dout.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"table {name!r}: dout must be a 2-D float32/float64 array, "
                        f"got {dout.dtype} with shape {dout.shape}")
    idx, off, nbags, gflat, gstride = _prepare_update(int(nrows), indices, offsets, dout,
                                                      dout.dtype, dout.shape[1], name)
    rows, bounds, occ, nu = _reindexed(int(nrows), idx, off, nbags)
    grads = np.empty((nu, dout.shape[1]), dtype=dout.dtype)
    if nu and dout.shape[1]:
        _pick("grad", dout.shape[1], _small(nu))(rows, bounds, occ, nu, gflat, gstride, 0, grads)
    return rows[:nu].copy(), grads


#: Largest scratch array (bytes) a thread keeps between calls; larger ones last one call.
SCRATCH_KEEP = 64 << 20
_scratch = threading.local()


def scratch(key, n, dtype):
    """An uninitialised 1-D array of ``n`` elements of ``dtype``, the calling thread's ``key``
    scratch: reused from call to call (up to ``SCRATCH_KEEP`` bytes), since a fresh array of
    a few MiB costs its page faults on every call (1.3 ms for a lookup's 327,680 positions
    here, a quarter of the lookup).  Valid until the thread asks for ``key`` again."""
    dtype = np.dtype(dtype)
    kept = getattr(_scratch, "arrays", None)
    if kept is None:
        kept = _scratch.arrays = {}
    buf = kept.get((key, dtype))
    if buf is None or buf.shape[0] < n:
        grown = 0 if buf is None else buf.shape[0] + buf.shape[0] // 4
        buf = np.empty(max(n, grown, 1024), dtype=dtype)
        if buf.nbytes <= SCRATCH_KEEP:
            kept[(key, dtype)] = buf
    return buf[:n]


_NO_MARKS = np.empty(0, dtype=np.uint8)
_INT64 = np.dtype(np.int64)
_NO_ROWS = np.empty(0, dtype=np.int64)
#: The kernel of indirect (cached-table) lookups: "bag_sum_cached" (two passes, the pool read
#: through the base's buffer) or "bag_sum" (one pass; also used when the pool's distance from
#: the base is not a whole number of elements). A one-pass kernel that translates each index
#: 48-64 indices before adding its row (the positions kept in a 128-entry ring in the first-level
#: cache, not written out and read back) measured 4-6% faster than the two passes under uniform
#: indices and 5-12% slower under Zipf (1M x 64 rows, 327,680 indices, paired repetitions), so
#: the two passes stay.
_INDIRECT_LOOKUP = "bag_sum_cached"
#: ``check`` of the bag lookups for callers that checked the offsets (and keep ``where``
#: valid): the kernel checks each index as it reads it, which saves a pass over the indices
#: (0.3-0.4 ms of a 327,680-index lookup).  Int64 1-D contiguous indices only; others are
#: checked (and converted) first.  A bad index raises the same IndexError after the kernel
#: ran, so a caller's ``out`` may be left partly written.
IN_KERNEL = "in-kernel"


def _check_writable(table, name, what="table"):
    if not table.flags.writeable:
        raise ValueError(f"{what} {name!r} is read-only; an update needs a writable array "
                         f"(e.g. from a writable access scope)")


@numba.njit(cache=True, nogil=True)
def _inputs_ok(idx, off, nrows, nbags):
    """One pass over a table's int64 indices and offsets: (valid, every bag has exactly one
    index). Valid means what ``check_indices`` and ``check_offsets`` accept; when it is
    False those checks run and name the problem."""
    nidx = idx.shape[0]
    if nidx:
        lo, hi = _index_bounds(idx)
        if lo < 0 or hi >= nrows:
            return False, False
    return _offsets_ok(off, nidx, nbags)


@numba.njit(cache=True, nogil=True)
def _offsets_ok(off, nidx, nbags):
    """One pass over int64 offsets: (valid, every bag has exactly one index); valid means
    what ``check_offsets`` accepts.  The loop has no early exit, so LLVM vectorises it (8,192
    offsets: about 1 instead of 8 us)."""
    n = off.shape[0]
    if n != nbags and n != nbags + 1:
        return False, False
    if n == 0:
        return nidx == 0, nidx == 0
    if off[0] != 0:
        return False, False
    falls = 0               # steps below 0
    others = 0              # steps other than 1 among the bags' starts
    for b in range(1, n):
        step = off[b] - off[b - 1]
        falls += step < 0
        others += (step != 1) & (b < nbags)
    if falls:
        return False, False
    one = nidx == nbags and others == 0
    last = off[n - 1]
    if last > nidx or (n == nbags + 1 and last != nidx):
        return False, False
    return True, one


def _plain_index_array(a):
    return type(a) is np.ndarray and a.dtype == np.int64 and a.ndim == 1 and \
        a.flags.c_contiguous


def _ensemble(tables, indices_list, offsets_list, nbags, names, update=False):
    """Validated (tables, indices, offsets, one) of an ensemble as Python lists, with the
    dtype and the tables' names; ``one[t]``: every bag of table t has exactly one index.

    Indices and offsets that are already int64 1-D arrays are checked in one compiled pass
    per table (``_inputs_ok``); anything else, and anything that pass refuses, goes through
    ``check_indices`` and ``check_offsets``, which convert it or name the problem. Tables
    are the caller's arrays (writable ones checked for an update)."""
    ntables = len(tables)
    if ntables == 0:
        raise ValueError("need at least one table")
    if len(indices_list) != ntables or len(offsets_list) != ntables:
        raise ValueError(f"{ntables} tables but {len(indices_list)} index arrays and "
                         f"{len(offsets_list)} offset arrays")
    if names is None:
        names = [f"table{t}" for t in range(ntables)]
    il, ol, ones = [], [], []
    dtype = None
    for t in range(ntables):
        table = tables[t]
        _check_table(table, names[t])
        if dtype is None:
            dtype = table.dtype
        elif table.dtype != dtype:
            raise TypeError(f"table {names[t]!r}: dtype {table.dtype} differs from "
                            f"{names[0]!r}'s {dtype}; an ensemble needs one dtype")
        if update:
            _check_writable(table, names[t])
        idx, off = indices_list[t], offsets_list[t]
        ok = False
        if _plain_index_array(idx) and _plain_index_array(off):
            ok, one = _inputs_ok(idx, off, table.shape[0], nbags)
        if not ok:
            idx = check_indices(idx, table.shape[0], names[t])
            off = check_offsets(off, idx.shape[0], nbags, names[t])
            one = _one_per_bag(off, idx.shape[0], nbags)
        il.append(idx)
        ol.append(off)
        ones.append(bool(one))
    return list(tables), il, ol, ones, dtype, names


def _common_fs(tables):
    """The ensemble's feature size if every table has the same one, else 0 (generic kernels)."""
    fss = {int(t.shape[1]) for t in tables}
    return fss.pop() if len(fss) == 1 else 0


def _columns(tables, column_offsets, width, names):
    fss = [t.shape[1] for t in tables]
    if column_offsets is None:
        column_offsets = np.concatenate([[0], np.cumsum(fss)[:-1]])
    cols = np.asarray(column_offsets, dtype=np.int64)
    if cols.shape != (len(tables),):
        raise ValueError(f"column_offsets must have one entry per table ({len(tables)}), "
                         f"got shape {cols.shape}")
    for t, (c, fs) in enumerate(zip(cols.tolist(), fss)):     # Python ints: cheaper
        if c < 0 or (width is not None and c + fs > width):
            raise ValueError(f"table {names[t]!r}: columns {c}..{c + fs} do not fit in an "
                             f"output of width {width}")
    return cols


def lookup_many(tables, indices_list, offsets_list, out=None, column_offsets=None, *,
                names=None, batch_size=None):
    """Bag-sum lookups of an ensemble into one ``(batch, sum of featuresizes)`` output.

    Table t lands in columns ``column_offsets[t]:column_offsets[t] + featuresize`` (default:
    packed in order).  Work is split into (bag chunk, table) items in one parallel loop.
    """
    if out is not None:
        nbags = out.shape[0]
    elif batch_size is not None:
        nbags = int(batch_size)
    else:
        nbags = np.asarray(offsets_list[0]).shape[0]
    if names is None:
        names = [f"table{t}" for t in range(len(tables))]
    tl, il, ol, ones, dtype, names = _ensemble(tables, indices_list, offsets_list, nbags,
                                               names)
    if out is None:
        cols = _columns(tables, column_offsets, None, names)
        width = int(max(int(c) + t.shape[1] for c, t in zip(cols, tables)))
        out = np.empty((nbags, width), dtype=dtype)
    if not isinstance(out, np.ndarray) or out.ndim != 2:
        raise ValueError("out must be a 2-D numpy.ndarray (batch, width)")
    cols = _columns(tables, column_offsets, out.shape[1], names)
    out, flat, stride, scratch = _output(out, nbags, out.shape[1], dtype, names[0])
    if nbags:
        nthreads = numba.get_num_threads()
        fs = _common_fs(tables)     # one feature size: the kernels specialised for it
        deltas = _deltas(tl)        # every table through the first one's buffer
        widths = np.array([t.shape[1] for t in tl], dtype=np.int64)
        if deltas is not None and all(ones):
            # bags of one index (DLRM's): a gather, each work item streaming through a table
            chunk = max(1, min(nbags, max(1024, -(-nbags * len(tl) // (4 * nthreads)))))
            gather_many = _pick("gather_many", fs, _small(nbags * len(tl)))
            gather_many(_readonly(tl[0]), deltas, widths, np.concatenate(il), nbags, flat,
                        stride, cols, chunk)
        elif deltas is not None:
            # the indices and offsets of every table in one array each (see bag_sum_many_flat)
            chunk = max(1, min(_BAGS_PER_ITEM, -(-nbags * len(tables) // (8 * nthreads))))
            ib, ob = _starts(il), _starts(ol)
            bag_sum_many_flat = _pick("bag_sum_many_flat", fs,
                                      _small(int(ib[-1]), nbags * len(tl)))
            bag_sum_many_flat(_readonly(tl[0]), deltas, widths, _readonly(np.concatenate(il)), ib,
                              _readonly(np.concatenate(ol)), ob, nbags, flat, stride, cols, chunk)
        else:
            # read-only views: every array in a typed list then has one numba type
            chunk = max(1, min(_BAGS_PER_ITEM, -(-nbags * len(tables) // (8 * nthreads))))
            bag_sum_many = _pick("bag_sum_many", fs,
                                 _small(sum(i.shape[0] for i in il), nbags * len(tl)))
            bag_sum_many(TypedList([_readonly(t) for t in tl]),
                         TypedList([_readonly(i) for i in il]),
                         TypedList([_readonly(o) for o in ol]), nbags, flat, stride, cols,
                         chunk)
    if scratch is not None:
        out[...] = scratch
    return out


def _one_per_bag(off, nidx, nbags):
    """True if validated ``offsets`` give every one of nbags bags exactly one index."""
    if nidx != nbags:
        return False
    if nbags <= 1:
        return True
    steps = np.diff(off[:nbags])
    return int(off[nbags - 1]) == nbags - 1 and int(steps.max()) == 1   # all steps 1


def _indirect_ensemble(bases, caches, wheres, nbags):
    """(feature size, each pool's distance from its base) of an ensemble of indirect tables
    that the ``*_cached_many`` kernels take, or None: some bags and tables, one feature size
    and dtype, int32 ``where`` arrays of one entry per base row, and pools a whole number of
    elements from their bases."""
    n = len(bases)
    if not n or not nbags or len(caches) != n or len(wheres) != n:
        return None
    fs = _common_fs(bases)
    if not fs or any(c.ndim != 2 or c.shape[1] != fs or c.dtype != bases[0].dtype
                     for c in caches):
        return None
    for b, w in zip(bases, wheres):
        if not (isinstance(w, np.ndarray) and w.dtype == np.int32 and w.ndim == 1
                and w.flags.c_contiguous and w.shape[0] == b.shape[0]):
            return None
    deltas = [_distance(b, c) for b, c in zip(bases, caches)]
    if any(d is None for d in deltas):
        return None
    return fs, deltas


def _cached_ensemble(bases, caches, wheres, nbags, names, write):
    """The checks both ``*_cached_many`` kernels start with: ``(fs, deltas, names)`` (see
    ``_indirect_ensemble``; names default to table0, table1, ...) with every pool checked
    (and writable when ``write``), or None when the ensemble does not suit the kernels."""
    if names is None:
        names = [f"table{t}" for t in range(len(bases))]
    suits = _indirect_ensemble(bases, caches, wheres, nbags)
    if suits is None:
        return None
    for c in caches:
        _check_table(c, names[0], "cache")
        if write:
            _check_writable(c, names[0], "cache")
    return suits + (names,)


def lookup_cached_many(bases, caches, wheres, indices_list, offsets_list, out,
                       column_offsets=None, misseds=None, refss=None, *, names=None):
    """Bag-sum lookups of an ensemble of indirect tables (row r of table t at
    ``caches[t][wheres[t][r]]`` where that is >= 0, else ``bases[t][r]``) into column blocks
    of ``out``, in one parallel kernel; returns ``(hits, nmissed)``, one entry per table.

    ``misseds[t]`` (None, or int64 with one entry per index of table t) gets the rows of
    table t's indices not served from its cache at its front, in index order (``nmissed[t]``
    of them); ``refss[t]`` (None, or uint8 with one entry per base row) marks the cached rows
    read. Returns None, having done nothing, when the ensemble does not suit the kernel (no
    bags, feature sizes or dtypes that differ, a ``where`` not int32, arrays whose distances
    are not whole elements): then look the tables up one at a time."""
    n = len(bases)
    nbags = out.shape[0] if isinstance(out, np.ndarray) and out.ndim == 2 else 0
    suits = _cached_ensemble(bases, caches, wheres, nbags, names, write=False)
    if suits is None:
        return None
    fs, deltas, names = suits
    tl, il, ol, ones, dtype, names = _ensemble(bases, indices_list, offsets_list, nbags,
                                               names)
    origins = _deltas(tl)
    if origins is None:
        return None
    cols = _columns(tl, column_offsets, out.shape[1], names)
    out, flat, stride, scratch_out = _output(out, nbags, out.shape[1], dtype, names[0])
    misseds = [None] * n if misseds is None else misseds
    refss = [None] * n if refss is None else refss
    for t in range(n):
        _check_missed(misseds[t], il[t].shape[0], names[t])
        _check_refs(refss[t], tl[t].shape[0], names[t])
    nthreads = numba.get_num_threads()
    chunk = max(64, min(nbags, -(-nbags * n // (4 * nthreads))))
    bad = np.zeros(1, dtype=np.uint8)
    nmissed = np.zeros(n, dtype=np.int64)
    small = _small(sum(i.shape[0] for i in il), nbags * n)
    ib = _starts(il)
    unit = all(ones)            # bags of one index: the offsets are not read (nor joined)
    ob = np.zeros(n + 1, dtype=np.int64) if unit else _starts(ol)
    listed = np.array([m is not None and m.shape[0] > 0 for m in misseds], dtype=np.uint8)
    mcat = scratch("missed_all", int(ib[-1]) if listed.any() else 0, np.int64)
    # every table's where and marks through the first one's; its indices, offsets, missed rows
    # and positions in one array each: a typed list of 26 arrays costs about 130 us to build
    wds, marked = _deltas(wheres), _through_first(refss)
    if wds is None or marked is None:
        return None
    hits = _pick("bag_sum_cached_many", fs, small)(
        _readonly(tl[0]), _readonly(wheres[0]), wds,
        np.array([w.shape[0] for w in wheres], np.int64), _readonly(np.concatenate(il)), ib,
        _readonly(_NO_ROWS if unit else np.concatenate(ol)), ob, nbags, flat, stride, cols,
        origins, np.array(deltas, dtype=np.uint64), mcat, listed,
        scratch("positions", int(ib[-1]), np.uint64), *marked, bad, chunk, nmissed, unit)
    if bad[0]:
        for t in range(n):
            check_indices(il[t], tl[t].shape[0], names[t])     # raises, naming the index
        raise AssertionError("the lookup kernel flagged an index that is in range")
    for t in np.flatnonzero(listed).tolist():
        k = int(nmissed[t])
        misseds[t][:k] = mcat[ib[t]:ib[t] + k]
    if scratch_out is not None:
        out[...] = scratch_out
    return hits, nmissed


def update_cached_many(bases, caches, wheres, indices_list, offsets_list, dout, lr,
                       column_offsets=None, dirties=None, *, names=None):
    """Fused SGD of an ensemble of indirect tables (see ``lookup_cached_many``) from the
    gradient of their concatenated lookup output, each table re-indexed and updated by one
    worker in one parallel kernel; returns ``(rows, hits)``: each table's unique rows and how
    many of them were cached. ``dirties[t]`` (None, or uint8 with one entry per pool row)
    gets 1 for every slot written. Returns None, having done nothing, when the ensemble does
    not suit the kernel (as ``lookup_cached_many``): then update the tables one at a time."""
    n = len(bases)
    if not isinstance(dout, np.ndarray) or dout.ndim != 2:
        raise ValueError("dout must be a 2-D numpy.ndarray (batch, width)")
    nbags = dout.shape[0]
    suits = _cached_ensemble(bases, caches, wheres, nbags, names, write=True)
    if suits is None:
        return None
    fs, deltas, names = suits
    tl, il, ol, _, dtype, names = _ensemble(bases, indices_list, offsets_list, nbags, names,
                                            update=True)
    lr = check_lr(lr, names[0], dtype)
    cols = _columns(tl, column_offsets, dout.shape[1], names)
    gflat, gstride = _gradient(dout, nbags, dout.shape[1], dtype, names[0])
    dirties = [None] * n if dirties is None else dirties
    for t, (c, d) in enumerate(zip(caches, dirties)):
        _check_dirty(d, c.shape[0], names[t])
    # every table, map and set of dirty marks through the first one's (as the lookups)
    origins, wds, marked = _deltas(tl), _deltas(wheres), _through_first(dirties)
    if origins is None or wds is None or marked is None:
        return None
    idx_base, obase = _starts(il), _starts(ol)
    rows = np.empty(idx_base[-1], dtype=np.int64)
    nus = np.zeros(n, dtype=np.int64)
    hits = np.zeros(n, dtype=np.int64)
    if idx_base[-1]:
        nworkers = max(1, min(numba.get_num_threads(), n))
        slots = _slots.take(nworkers, max(t.shape[0] for t in tl))
        _pick("apply_sgd_cached_many", fs, _small(int(idx_base[-1])))(
            tl[0], origins, _readonly(wheres[0]), wds, np.concatenate(il), np.concatenate(ol),
            obase, idx_base, nbags, gflat, gstride, cols, dtype.type(lr),
            np.array(deltas, dtype=np.uint64), *marked, slots, nworkers, rows, nus, hits)
        _slots.give(slots)  # not on error: a half-used histogram is not zero
    return [rows[idx_base[t]:idx_base[t] + nus[t]] for t in range(n)], hits


def _deltas(tables):
    """Each table's start, in elements from the first's (``_distance``), or None."""
    if numba.config.BOUNDSCHECK:
        return None
    return element_offsets(tables)


def _starts(arrays):
    """Where each array starts in their concatenation, and (last) its length: int64."""
    starts = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.shape[0] for a in arrays], out=starts[1:])
    return starts


def _through_first(marks):
    """(first, distances, flags) of per-table uint8 marks, None where a table has none: the
    first array given (or an empty one), each one's distance from it in elements (0 for
    None) and 1 where one is given; for kernels that reach every table's marks through the
    first's buffer. None when a distance is not whole."""
    flags = np.array([m is not None for m in marks], dtype=np.uint8)
    given = [m for m in marks if m is not None]
    dists = np.zeros(len(marks), dtype=np.uint64)
    if not given:
        return _NO_MARKS, dists, flags
    got = _deltas(given)
    if got is None:
        return None
    dists[flags.view(bool)] = got
    return given[0], dists, flags


def _distance(base, other):
    """other's start in elements from base's, modulo 2**64, for kernels that read (and write)
    other through base's flat buffer: one buffer instead of a choice between two per row.

    None (the kernels then take the arrays apart) when the distance is not a whole number of
    elements, or when numba checks bounds (``NUMBA_BOUNDSCHECK=1``), which such an index
    would fail."""
    d = _deltas((base, other))
    return None if d is None else d[1]


#: Tables whose gradient sums (one row of values per table row) fit in this many bytes are
#: updated by one pass over the bags (``accumulate_dense``) instead of a re-index that reads
#: one strided column block of the gradient per table (1 MiB: a core's L2 here). For DLRM's
#: small tables, whose every row is used many times per batch, the update took 10 ms instead
#: of 15 (26 tables, batch 8192, 2 threads), with bit-identical results.
DENSE_UPDATE_BYTES = 1024 * 1024


def _dense_tables(tables, indices_list):
    """Per table, its row count if ``update_many`` sums its gradients densely, else 0: small
    tables used at least once per row on average."""
    out = np.zeros(len(tables), dtype=np.int64)
    for t, (table, idx) in enumerate(zip(tables, indices_list)):
        n = table.shape[0]
        if 0 < n * table.shape[1] * table.itemsize <= DENSE_UPDATE_BYTES and idx.shape[0] >= n:
            out[t] = n
    return out


def update_many(tables, indices_list, offsets_list, dout, lr, column_offsets=None, *, names=None):
    """Fused SGD for an ensemble from the gradient of the concatenated ``lookup_many`` output.

    Re-indexing runs one table per thread; row updates are flattened (row chunk, table) items.
    Returns the unique rows of every table.
    """
    if not isinstance(dout, np.ndarray) or dout.ndim != 2:
        raise ValueError("dout must be a 2-D numpy.ndarray (batch, width)")
    nbags = dout.shape[0]
    if names is None:
        names = [f"table{t}" for t in range(len(tables))]
    tl, il, ol, _, dtype, names = _ensemble(tables, indices_list, offsets_list, nbags, names,
                                            update=True)
    lr = check_lr(lr, names[0], dtype)
    cols = _columns(tables, column_offsets, dout.shape[1], names)
    gflat, gstride = _gradient(dout, nbags, dout.shape[1], dtype, names[0])
    idx_base = _starts(il)
    if nbags == 0 or idx_base[-1] == 0:
        return [np.empty(0, dtype=np.int64) for _ in tables]
    maxrows = max(t.shape[0] for t in tables)
    nworkers = max(1, min(numba.get_num_threads(), len(tables)))
    slots = _slots.take(nworkers, maxrows)
    fs = _common_fs(tables)
    deltas = _deltas(tl)
    obase = _starts(ol)
    icat, ocat = np.concatenate(il), np.concatenate(ol)
    widths = np.array([t.shape[1] for t in tl], dtype=np.int64)
    dense = _dense_tables(tl, il)
    if deltas is not None:      # the tables through the first's buffer: no typed list
        nus, rows = _pick("update_many_flat", fs, _small(int(idx_base[-1])))(
            tl[0], deltas, widths, icat, ocat, obase, nbags, gflat, gstride, cols,
            dtype.type(lr), slots, nworkers, idx_base, _NO_MARKS, dense)
    else:
        update_many = _pick("update_many", fs, _small(int(idx_base[-1])))
        nus, rows = update_many(TypedList(tl), icat, ocat, obase, nbags, gflat, gstride, cols,
                                dtype.type(lr), slots, nworkers, idx_base, dense, widths)
    _slots.give(slots)
    return [rows[idx_base[t]:idx_base[t] + nus[t]] for t in range(len(tables))]
