"""Embedding tables on CachedArrays: the table API of the dissertation's Table 5.2 and
CachedEmbeddings (§5.4, Fig. 5.7), a per-row software cache in fast memory.

Every table has ``name``, ``nvectors``, ``featuresize``, ``dtype``, a row-address accessor
``rowpointer(i, context)`` and ``lookup`` / ``update`` built on the kernels of
:mod:`cachedarrays.models.dlrm.kernels`.  Kernels run on ndarray views handed out by pinned
``ca.kernel`` scopes (named kernels in ``ca.trace`` traces: ``embedding_lookup``,
``embedding_update``, ``embedding_cache_rows``, ``embedding_writeback``, ``embedding_init``);
no view outlives its scope.

* :class:`SimpleTable` keeps all rows contiguous in one CachedArray, placed by the manager's
  policy or explicitly in fast or slow memory.
* :class:`CachedEmbeddingTable` keeps the *base* rows in slow memory and caches single rows in a
  pool of fixed-size pages in fast memory.  ``where[row]`` (int32, or int64 for tables of
  over 2**30 rows; see :func:`where_dtype`) is the row's slot in the pool or -1;
  ``backedge[slot]`` is the row held by a slot or -1.  numba has no CPU compare-and-swap, so
  rows are cached batch-synchronously: the lookup finds where every row lives and lists the
  rows it found uncached; those rows are taken once each, given bump-allocated slots,
  copied in and the pointers swapped; then the bags are summed, the new rows read from the
  pool.  The result is the state the dissertation's lock-bit protocol reaches,
  deterministically.

Table kinds (the dissertation's §5.6.1 "policies"; see :func:`make_table`): ``fast`` and
``simple`` (a SimpleTable in fast or slow memory), ``static`` (fill the cache once with random
rows, then freeze it) and ``dynamic`` (cache every row a lookup touches; ``maintain()`` flushes
the oldest pages, writing dirty rows back, when the cache is full).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections import deque

import numpy as np
from numba import njit, prange

import cachedarrays as ca
from cachedarrays import costmodel
from cachedarrays.copyengine import check_switch
from cachedarrays.layout import readonly_view
from cachedarrays.threads import serial_twin

from . import kernels
from ._fs_kernels import PPI as _PLACE_PER_ITEM
from ._fs_kernels import SCAN_AHEAD as _SCAN_AHEAD
from ._fs_kernels import at, place_misses, span
from ._intrinsics import prefetch_write

__all__ = [
    "FORWARD", "UPDATE", "EmbeddingTable", "SimpleTable", "CachedEmbeddingTable",
    "make_table", "lookup_tables", "update_tables", "TABLE_KINDS", "FLUSH_POLICIES",
    "traffic_time",
]

log = logging.getLogger(__name__)

#: Access contexts of ``rowpointer``: a lookup (may cache the row) and a gradient write.
FORWARD = "forward"
UPDATE = "update"
_CONTEXTS = (None, FORWARD, UPDATE)
#: Kinds of table ``make_table`` builds (§5.6.1).
TABLE_KINDS = ("fast", "simple", "static", "dynamic")
#: What a cached table's flush down to ``cachelower`` keeps (see ``CachedEmbeddingTable``).
FLUSH_POLICIES = ("oldest", "second-chance")
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
#: Rows per cache page unless the table says otherwise (a page is the unit of flushing).
DEFAULT_PAGE_ROWS = 1024


# ---- numba helpers for the cache (kernels.py owns lookup and SGD) -------------------------


@njit(cache=True, nogil=True)
def _scan_misses(indices, where, miss_rows):
    """Count cached occurrences; list each uncached row once (first-seen order).

    Marks a listed row with ``where[r] = -2 - k``; ``_place_rows`` restores every mark."""
    hits = 0
    nmiss = 0
    n = indices.shape[0]
    for j in range(n):
        if j + _SCAN_AHEAD < n:
            prefetch_write(where, indices[j + _SCAN_AHEAD])
        r = indices[j]
        w = where[r]
        if w >= 0:
            hits += 1
        elif w == -1:
            where[r] = -2 - nmiss
            miss_rows[nmiss] = r
            nmiss += 1
    return hits, nmiss


@njit(parallel=True, cache=True, nogil=True)
def _place_rows(base, cache, where, backedge, rows, slots):
    """Copy rows[k] into slot slots[k] for k < len(slots); unmark the rest (stay in base);
    see ``place_misses``."""
    fs = base.shape[1]
    bflat = base.reshape(-1)
    cflat = cache.reshape(-1)
    n = rows.shape[0]
    for it in prange((n + _PLACE_PER_ITEM - 1) // _PLACE_PER_ITEM):
        lo, hi = span(it, _PLACE_PER_ITEM, n)
        place_misses(bflat, cflat, where, backedge, rows, lo, hi, slots, fs)


#: The same copy on one thread: for a few rows, starting the thread pool costs more than the copy.
_place_rows_serial = serial_twin(_place_rows, "_place_rows_serial")
#: Rows below which the cache's copies run on one thread.
SERIAL_ROWS = 4096


def _serial_rows(n):
    """True when a kernel over n rows runs its serial twin: fewer than SERIAL_ROWS, or no
    parallel region can run here (``threads.FORKED_AFTER_POOL``)."""
    return n < SERIAL_ROWS or ca.threads.FORKED_AFTER_POOL


#: The slots of a caching lookup that caches nothing.
_NO_SLOTS = np.empty(0, dtype=np.int64)


@njit(parallel=True, cache=True, nogil=True)
def _drop_slots(base, cache, where, backedge, dirty, slots):
    """Send the rows of ``slots`` home, copying the dirty ones back; returns the copies."""
    fs = base.shape[1]
    copied = 0
    for k in prange(slots.shape[0]):
        s = slots[k]
        r = backedge[s]
        if r >= 0:
            if dirty[s]:
                for f in range(fs):
                    base[r, f] = cache[s, f]
                copied += 1
            where[r] = -1
            backedge[s] = -1
        dirty[s] = 0
    return copied


_drop_slots_serial = serial_twin(_drop_slots, "_drop_slots_serial")


@njit(parallel=True, cache=True, nogil=True)
def _copy_home(base, cache, backedge, slots):
    """base[backedge[s]] = cache[s] for each slot (write back without dropping)."""
    fs = base.shape[1]
    for k in prange(slots.shape[0]):
        s = slots[k]
        r = backedge[s]
        for f in range(fs):
            base[r, f] = cache[s, f]


@njit(cache=True, nogil=True)
def _pages_after(npages, npop, nkeep, rows, insert):
    """Pages in use after popping the oldest ``npop`` of ``npages`` and placing ``nkeep`` rows
    (the newest page's free slots first, if it stays)."""
    remaining = npages - npop
    room = rows - insert if remaining > 0 else 0
    need = nkeep - room if nkeep > room else 0
    return remaining + (need + rows - 1) // rows


@njit(cache=True, nogil=True)
def _plan_flush(pages, fresh, backedge, refs, rows, insert, target, second_chance, keep):
    """Pages to pop, oldest first, so that at most ``target`` rows of pages remain; with
    ``second_chance``, also the slots whose rows are kept (moved to new pages), listed in
    ``keep``.  Returns (pages popped, rows kept).

    A second chance goes to the rows looked up since they were cached or last moved, in the
    pages that were in use at the previous flush; the ``fresh`` newest pages, opened since,
    are not looked at (their rows have not been offered a lookup yet).  When the rows to keep
    would leave too little room (nearly all were looked up, so the marks tell nothing), and
    without ``second_chance``, the flush is oldest-first."""
    n = pages.shape[0]
    old = n - fresh if second_chance else 0
    most = max(0, target) // rows                   # pages that may remain
    npop = 0
    nkeep = 0
    while npop < old and _pages_after(n, npop, nkeep, rows, insert) > most:
        p = pages[npop]
        npop += 1
        for s in range(p * rows, (p + 1) * rows):
            r = backedge[s]
            if r >= 0 and refs[r] != 0:
                keep[nkeep] = s
                nkeep += 1
    if nkeep and _pages_after(n, npop, nkeep, rows, insert) > most:
        npop = 0        # nearly every old row was looked up: the marks tell nothing, so
        nkeep = 0       # this flush is oldest-first (no row moves)
    while npop < n and _pages_after(n, npop, nkeep, rows, insert) > most:
        npop += 1
    return npop, nkeep


@njit(parallel=True, cache=True, nogil=True)
def _copy_slots(src, src_slots, dst, dst_slots):
    """dst[dst_slots[k]] = src[src_slots[k]] for every k (flat unsigned offsets: a loop LLVM
    vectorises); a flush stages its kept rows out of the pool and back with it."""
    fs = src.shape[1]
    sflat = src.reshape(-1)
    dflat = dst.reshape(-1)
    n = src_slots.shape[0]
    for it in prange((n + _PLACE_PER_ITEM - 1) // _PLACE_PER_ITEM):
        lo, hi = span(it, _PLACE_PER_ITEM, n)
        for k in range(lo, hi):
            a = at(src_slots[k], fs)
            b = at(dst_slots[k], fs)
            for f in range(fs):
                uf = np.uint64(f)
                dflat[b + uf] = sflat[a + uf]


_copy_slots_serial = serial_twin(_copy_slots, "_copy_slots_serial")


@njit(cache=True, nogil=True)
def _release_slots(where, backedge, dirty, refs, slots, keep, kept_rows, kept_dirty, clear_refs,
                   forget):
    """The bookkeeping of a flush before its pages are freed: the kept slots' rows and dirty
    marks go to kept_rows / kept_dirty and the slots are emptied; the marks of every row in
    ``slots`` are cleared (``clear_refs``); with ``forget`` (no write-back to do) every row
    left in ``slots`` goes home (``where`` -1) and its slot is emptied. Returns the rows left
    to drop."""
    for k in range(keep.shape[0]):
        s = keep[k]
        kept_rows[k] = backedge[s]
        kept_dirty[k] = dirty[s]
        backedge[s] = -1
        dirty[s] = 0
        if clear_refs:
            refs[kept_rows[k]] = 0
    dropped = 0
    for k in range(slots.shape[0]):
        s = slots[k]
        r = backedge[s]
        if r >= 0:
            dropped += 1
            if clear_refs:
                refs[r] = 0
            if forget:
                where[r] = -1
                backedge[s] = -1
    return dropped


@njit(cache=True, nogil=True)
def _place_kept(where, backedge, dirty, dst, rows, marks):
    """Point kept rows at their new slots (their data already copied there)."""
    for k in range(dst.shape[0]):
        where[rows[k]] = dst[k]
        backedge[dst[k]] = rows[k]
        dirty[dst[k]] = marks[k]


# ---- small utilities ---------------------------------------------------------------------

def where_dtype(nvectors):
    """The dtype of a cached table's ``where``: int32 while every row and slot number fits (a
    lookup reads one random entry per index, and 4 MiB for a million rows stay in a core's L2
    more often than 8 MiB: fresh uniform lookups took 14% less time), else int64."""
    return np.dtype(np.int32) if 2 * nvectors < 2**31 else np.dtype(np.int64)


def finite_values(values, shape, dtype, what):
    """``values`` as a ``shape`` array of finite ``dtype`` numbers (a table's rows or a model's
    weights being loaded), else TypeError or ValueError naming ``what``."""
    v = np.asarray(values)
    if v.dtype.kind != "f":
        raise TypeError(f"{what} must be a float array, got dtype {v.dtype}")
    if v.shape != shape:
        raise ValueError(f"{what}: shape {v.shape}, expected {shape}")
    with np.errstate(over="ignore"):
        v = v.astype(dtype, copy=False)
    if not np.isfinite(v).all():
        raise ValueError(f"{what}: NaN or infinity (or numbers too large for {np.dtype(dtype)}); "
                         "pass finite numbers")
    return v


def _kernel(name, reads=(), writes=(), touched=None):
    """``ca.kernel(name, reads, writes)`` over the CachedArrays among reads and writes; other
    entries (ndarrays, None) pass through as themselves. Yields the list of views (reads first).
    touched: [(table data, bytes of the rows the kernel gathers or updates)].

    All CachedArrays (the usual call) is ``ca.kernel`` itself: a lookup's Python runs with
    its caches cold after the last one streamed its rows through them, so every layer costs
    several times what it does in a loop (the wrapper measured 10-15 us of 30-35)."""
    for a in reads:
        if type(a) is not ca.CachedArray:
            return _mixed_kernel(name, reads, writes, touched)
    for a in writes:
        if type(a) is not ca.CachedArray:
            return _mixed_kernel(name, reads, writes, touched)
    return ca.kernel(name, reads, writes, touched=touched)


@contextlib.contextmanager
def _mixed_kernel(name, reads, writes, touched):
    """``_kernel`` with ndarrays or None among the operands."""
    args = (*reads, *writes)
    cached = [isinstance(a, ca.CachedArray) for a in args]
    nr = len(reads)
    with ca.kernel(name, [a if c else None for a, c in zip(reads, cached[:nr])],
                   [a if c else None for a, c in zip(writes, cached[nr:])],
                   touched=touched) as views:
        yield [v if c else a for v, a, c in zip(views, args, cached)]


def _check_dtype(dtype, name):
    dt = np.dtype(dtype)
    if dt not in _DTYPES:
        raise TypeError(f"table {name!r}: dtype {dt} is not supported; use float32 (or float64)")
    return dt


def _is_whole(v):
    """True for an integer (or an integral float), False for bools, strings and fractions."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                              np.floating)):
        return False
    return isinstance(v, (int, np.integer)) or (math.isfinite(v) and float(v).is_integer())


def _check_shape(nvectors, featuresize, name):
    """(rows, features) as ints >= 1; a fraction, bool or string is refused, not truncated."""
    if not (_is_whole(nvectors) and _is_whole(featuresize)):
        raise TypeError(f"table {name!r}: rows and features must be integers, got "
                        f"{nvectors!r}x{featuresize!r}")
    if nvectors < 1 or featuresize < 1:
        raise ValueError(f"table {name!r}: need at least one row and one feature, got "
                         f"{nvectors}x{featuresize}")
    return int(nvectors), int(featuresize)


def _check_context(context, name):
    if context is not FORWARD and context not in _CONTEXTS:
        raise ValueError(f"table {name!r}: unknown context {context!r}; use "
                         f"None, {FORWARD!r} or {UPDATE!r}")


def _fill(arr, nvectors, featuresize, dtype, init, seed, name):
    """Write the initial rows: a copy of ``init`` or U(-1/sqrt(n), 1/sqrt(n)) from ``seed``."""
    with ca.kernel("embedding_init", (), (arr,)) as (a,):
        if init is not None:
            src = np.asarray(init)
            if src.shape != (nvectors, featuresize):
                raise ValueError(f"table {name!r}: init has shape {src.shape}, expected "
                                 f"({nvectors}, {featuresize})")
            np.copyto(a, src, casting="same_kind")
            return
        rng = np.random.default_rng(seed)
        bound = 1.0 / np.sqrt(max(nvectors, 1))
        chunk = max(1, (1 << 22) // max(featuresize, 1))
        for lo in range(0, nvectors, chunk):
            hi = min(nvectors, lo + chunk)
            a[lo:hi] = rng.uniform(-bound, bound, size=(hi - lo, featuresize)).astype(dtype)


def _batch_size(offsets, out, indices, name, width):
    """Bags of a lookup: out's rows, else one per offset (per index without offsets)."""
    if out is not None:
        return _check_block(out, name, "out", width)
    if offsets is None:
        return _count(indices, name, "indices")
    return _count(offsets, name, "offsets")


def _count(a, name, what):
    """len(a) of a 1-D index or offset array; a clear error for anything else."""
    if np.ndim(a) != 1:
        raise ValueError(f"table {name!r}: {what} must be a 1-D integer array, got "
                         f"{type(a).__name__} of shape {np.shape(a)}")
    return np.shape(a)[0]


def _check_block(a, name, what, width):
    """Rows of an ``out`` or ``dout`` block: a 2-D ndarray or CachedArray (nbags, width)."""
    if not isinstance(a, (np.ndarray, ca.CachedArray)):
        raise TypeError(f"table {name!r}: {what} must be a numpy.ndarray or CachedArray of "
                        f"shape (nbags, {width}), got {type(a).__name__}")
    if a.ndim != 2:
        raise ValueError(f"table {name!r}: {what} has shape {a.shape}, expected "
                         f"(nbags, {width})")
    return a.shape[0]


def _check_apart(a, table_views, name, what):
    """Refuse an ``out`` / ``dout`` view that shares memory with the table's own arrays: the
    kernels read the table while they write ``out`` (or write it while reading ``dout``)."""
    for v in table_views:
        if np.may_share_memory(a, v):
            _refuse_alias(name, what)


def _refuse_alias(name, what):
    raise ValueError(f"table {name!r}: {what} shares memory with the table's rows; pass a "
                     f"separate array")


def _locked(method):
    """``method`` run holding the table's lock: calls on one table run one at a time."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class EmbeddingTable:
    """The table API (Table 5.2): featuresize, nvectors, dtype, rowpointer, lookup, update."""

    name: str
    nvectors: int
    featuresize: int
    dtype: np.dtype
    manager: ca.Manager
    #: Held by every call that reads or writes the rows; tables set their own (this one
    #: serves a subclass that does not).
    _lock = threading.RLock()

    @property
    def shape(self):
        return (self.nvectors, self.featuresize)

    @property
    def rowbytes(self):
        return self.featuresize * self.dtype.itemsize

    def example(self):
        """An array whose manager and dtype outputs should use (Table 5.2's ``example``)."""
        raise NotImplementedError

    def rowpointer(self, i, context=None):
        """(CachedArray, row) where vector i lives now; a FORWARD access may cache it first."""
        raise NotImplementedError

    def __getitem__(self, i):
        with self._lock:
            arr, pos = self.rowpointer(self._row_index(i))
            with ca.readable(arr) as a:
                return a[pos].copy()

    def _row_index(self, i):
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"table {self.name!r}: row index must be an integer, got {type(i).__name__}")
        if not 0 <= i < self.nvectors:
            raise IndexError(f"table {self.name!r}: row {i} is out of range; valid rows are "
                             f"0..{self.nvectors - 1}")
        return int(i)

    def _new_output(self, nbags):
        return ca.empty((nbags, self.featuresize), dtype=self.dtype, manager=self.manager)

    def _prepare(self, indices, offsets, nbags):
        idx = kernels.check_indices(indices, self.nvectors, self.name)
        if offsets is None:
            if nbags != idx.shape[0]:
                raise ValueError(f"table {self.name!r}: without offsets every index is its own bag, "
                                 f"but {idx.shape[0]} indices were given for {nbags} bags")
            off = np.arange(idx.shape[0], dtype=np.int64)
        else:
            off = kernels.check_offsets(offsets, idx.shape[0], nbags, self.name)
        return idx, off

    def lookup(self, indices, offsets=None, out=None, context=FORWARD):
        """Sum-pooled bags (one row per bag if ``offsets`` is None) into ``out`` (new if None)."""
        raise NotImplementedError

    def update(self, indices, offsets, dout, lr):
        """Fused pullback + SGD of a lookup's gradient ``dout``; returns the unique rows updated."""
        raise NotImplementedError

    def maintain(self):
        """Work between iterations (flushing a full dynamic cache); a no-op by default."""

    def snapshot(self):
        """An ndarray copy of every row's current value."""
        raise NotImplementedError

    def load(self, values):
        """Set every row to ``values`` (nvectors, featuresize), the inverse of ``snapshot``."""
        raise NotImplementedError

    def _check_values(self, values):
        """``values`` as a (nvectors, featuresize) array of finite floats, else a clear error."""
        return finite_values(values, self.shape, self.dtype, f"table {self.name!r}: values")

    def stats(self):
        """Telemetry: accesses served from fast/slow memory, rows updated, and the bytes each
        tier read and wrote (``fast_read_bytes`` ... ``slow_write_bytes``: lookups, updates
        as read-modify-write, cache fills and write-backs)."""
        raise NotImplementedError

    def __repr__(self):
        return (f"<{type(self).__name__} {self.name!r} {self.nvectors}x{self.featuresize} "
                f"{self.dtype}>")


class SimpleTable(EmbeddingTable):
    """All rows contiguous in one CachedArray; ``placement`` "policy", "fast" or "slow"."""

    def __init__(self, nvectors, featuresize, dtype=np.float32, *, manager=None,
                 placement="policy", init=None, seed=0, name="table"):
        self.name = str(name)
        self._lock = threading.RLock()
        self.dtype = _check_dtype(dtype, self.name)
        self.nvectors, self.featuresize = _check_shape(nvectors, featuresize, self.name)
        if placement not in ("policy", "fast", "slow"):
            raise ValueError(f"table {self.name!r}: placement must be 'policy', 'fast' or 'slow', "
                             f"got {placement!r}")
        self.manager = manager if manager is not None else ca.default_manager()
        self.placement = placement
        # "slow" goes straight to slow memory (the policy's alloc_slow): filling it there
        # evicts nothing else from fast memory on the way.
        hint = {"slow": "slow"}.get(placement)
        self.data = ca.empty(self.shape, dtype=self.dtype, manager=self.manager, placement=hint)
        _fill(self.data, self.nvectors, self.featuresize, self.dtype, init, seed, self.name)
        if placement == "slow" and ca.in_fast(self.data):
            ca.evict(self.data)
        elif placement == "fast":
            ca.prefetch(self.data, force=True)
        self._stats = dict(lookups=0, hits=0, misses=0, updates=0, rows_updated=0,
                           fast_write_bytes=0, slow_write_bytes=0, fast_update_read_bytes=0,
                           slow_update_read_bytes=0)
        self._rowbytes = self.rowbytes
        self._row_strides = (self._rowbytes, self.dtype.itemsize)   # an out with contiguous rows

    @property
    def device(self):
        return self.data.device

    def example(self):
        return self.data

    def rowpointer(self, i, context=None):
        _check_context(context, self.name)
        return self.data, self._row_index(i)

    def _account_lookup(self, n):
        self._stats["lookups"] += n
        self._stats["hits" if self.data.device == "fast" else "misses"] += n

    def _account_update(self, nrows):
        self._stats["updates"] += 1
        self._stats["rows_updated"] += nrows
        tier = "fast" if self.data.device == "fast" else "slow"
        self._stats[f"{tier}_write_bytes"] += nrows * self.rowbytes
        self._stats[f"{tier}_update_read_bytes"] += nrows * self.rowbytes  # read-modify-write

    def lookup(self, indices, offsets=None, out=None, context=FORWARD):
        with self._lock:
            if out is None and context is FORWARD and type(offsets) is np.ndarray and \
                    offsets.ndim == 1 and offsets.shape[0]:
                out = self._new_output(offsets.shape[0])     # one bag per offset, as below
            if (context is FORWARD and type(out) is ca.CachedArray and out.dtype == self.dtype
                    and out.strides == self._row_strides and out.shape[1] == self.featuresize
                    and kernels.plain_bags(indices, offsets, out.shape[0])):
                # the common call, checked by the kernel itself (see lookup_sum_plain)
                with ca.kernel("embedding_lookup", (self.data,), (out,),
                               [(self.data, indices.shape[0] * self._rowbytes)]) as (t, o):
                    _check_apart(o, (t,), self.name, "out")
                    kernels.lookup_sum_plain(t, indices, offsets, o, self.name)
                self._account_lookup(indices.shape[0])
                return out
            return self._lookup(indices, offsets, out, context)

    def _lookup(self, indices, offsets, out, context):
        _check_context(context, self.name)
        nbags = _batch_size(offsets, out, indices, self.name, self.featuresize)
        if out is self.data:
            _refuse_alias(self.name, "out")
        if offsets is None:
            idx, off = kernels.check_indices(indices, self.nvectors, self.name), None
        else:  # the offsets checked here, the indices here or by the kernel (see bag_inputs)
            idx, off, check = kernels.bag_inputs(indices, offsets, self.nvectors, nbags,
                                                 self.name)
        if out is None:
            out = self._new_output(nbags)
        with _kernel("embedding_lookup", (self.data,), (out,),
                     [(self.data, idx.shape[0] * self.rowbytes)]) as (t, o):
            _check_apart(o, (t,), self.name, "out")
            if off is None:
                kernels.lookup(t, idx, o, name=self.name, check=False)
            else:
                kernels.lookup_sum(t, idx, off, o, name=self.name, check=check)
        self._account_lookup(idx.shape[0])
        return out

    @_locked
    def update(self, indices, offsets, dout, lr):
        kernels.check_lr(lr, self.name, self.dtype)
        _check_block(dout, self.name, "dout", self.featuresize)
        nidx = _count(indices, self.name, "indices")
        if dout is self.data:
            _refuse_alias(self.name, "dout")
        with _kernel("embedding_update", (dout,), (self.data,),
                     [(self.data, nidx * self.rowbytes)]) as (g, t):
            _check_apart(g, (t,), self.name, "dout")
            rows = kernels.sgd_update(t, indices, offsets, g, lr, name=self.name)
        self._account_update(rows.shape[0])
        return rows

    @_locked
    def snapshot(self):
        with ca.readable(self.data) as t:
            return t.copy()

    @_locked
    def load(self, values):
        v = self._check_values(values)
        with ca.kernel("embedding_load", (), (self.data,)) as (t,):
            np.copyto(t, v)

    def stats(self):
        s = dict(self._stats)
        s["device"] = self.data.device
        s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        s["fast_read_bytes"] = s["hits"] * self.rowbytes + s.pop("fast_update_read_bytes")
        s["slow_read_bytes"] = s["misses"] * self.rowbytes + s.pop("slow_update_read_bytes")
        return s


def _size_to_rows(value, total_rows, rowbytes, what, name):
    """A cache size as rows: a float is a fraction of the table, an int or string is bytes.
    A size above the whole table is refused, not cut down, so a mistyped size is not lost."""
    if isinstance(value, (float, np.floating)):
        if not 0.0 <= value or not math.isfinite(value):
            raise ValueError(f"table {name!r}: {what} fraction must be a finite number >= 0 "
                             f"(1.0 is the whole table), got {value}")
        if value > 1.0:
            raise ValueError(f"table {name!r}: {what} fraction {value} is more than the whole "
                             f"table; the largest is 1.0 (a byte size is an int or '64MiB')")
        return min(total_rows, int(np.ceil(float(value) * total_rows)))
    try:
        nbytes = ca.parse_size(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"table {name!r}: {what} must be a fraction of the table (float) or a "
                         f"size in bytes (int or '64MiB'), got {value!r}") from e
    if nbytes > total_rows * rowbytes:
        raise ValueError(f"table {name!r}: {what} of {nbytes:,} bytes is more than the whole "
                         f"table ({total_rows:,} rows x {rowbytes} bytes = "
                         f"{total_rows * rowbytes:,} bytes); the largest is "
                         f"{total_rows * rowbytes:,} (or 1.0)")
    return -(-nbytes // rowbytes)


class CachedEmbeddingTable(EmbeddingTable):
    """Base rows in slow memory, a per-row cache of fixed-size pages in fast memory (§5.4).

    ``cachelower`` / ``cacheslack`` are fractions of the table (float, at most 1.0) or bytes
    (int or "64MiB", at most the table's bytes); a larger size is refused. The page pool is one
    fast CachedArray of ``ceil(min(lower + slack, table) / page)`` pages, reserved up front;
    flushing frees whole pages, oldest first, until at most ``cachelower`` bytes of pages
    remain. ``caching`` is "dynamic" (cache on every FORWARD access) or "static"
    (``prepopulate`` once, then never cache more). The base is created and filled directly
    in slow memory (a ``placement="slow"`` allocation), so building a table evicts nothing.

    ``flush_policy`` says which rows the flush down to ``cachelower`` keeps: "oldest" drops
    whole pages, oldest first (§5.4); "second-chance" moves the rows of those pages that were
    looked up since they were cached (or last moved) into the newest pages, and drops only
    the others, so rows in steady use stay cached (a CLOCK at row grain: fewer misses under
    skewed indices, for a fast-to-fast copy of the rows kept). Pages opened since the last
    flush are left to the next one, so new rows get a lookup before they are judged; when
    nearly every row was looked up the flush is oldest-first (see ``_plan_flush``).
    """

    def __init__(self, nvectors, featuresize, dtype=np.float32, *, manager=None,
                 cachelower=0.25, cacheslack=0.05, page_rows=DEFAULT_PAGE_ROWS, caching="dynamic",
                 init=None, seed=0, name="table", flush_policy="oldest"):
        self.name = str(name)
        self._lock = threading.RLock()
        self.dtype = _check_dtype(dtype, self.name)
        self.nvectors, self.featuresize = _check_shape(nvectors, featuresize, self.name)
        if caching not in ("dynamic", "static"):
            raise ValueError(f"table {self.name!r}: caching must be 'dynamic' or 'static', "
                             f"got {caching!r}")
        if not _is_whole(page_rows):
            raise TypeError(f"table {self.name!r}: page_rows must be an integer >= 1, got "
                            f"{page_rows!r}")
        if page_rows < 1:
            raise ValueError(f"table {self.name!r}: page_rows must be >= 1, got {page_rows}")
        if flush_policy not in FLUSH_POLICIES:
            raise ValueError(f"table {self.name!r}: flush_policy must be one of {FLUSH_POLICIES}, "
                             f"got {flush_policy!r}")
        self._flush_policy = flush_policy
        self.manager = manager if manager is not None else ca.default_manager()
        self.caching = caching
        self.frozen = False
        self._page_rows_wanted = int(page_rows)
        self.base = ca.empty(self.shape, dtype=self.dtype, manager=self.manager, placement="slow")
        _fill(self.base, self.nvectors, self.featuresize, self.dtype, init, seed, self.name)
        if ca.in_fast(self.base):  # a policy that cached it on the write
            ca.evict(self.base)
        self.where = np.full(self.nvectors, -1, dtype=where_dtype(self.nvectors))
        self.cache = None
        self._stats = dict(lookups=0, hits=0, misses=0, rows_cached=0, uncached=0, updates=0,
                           rows_updated=0, update_hits=0, flushes=0, pages_flushed=0,
                           rows_flushed=0, rows_written_back=0, rows_retained=0)
        self._lower_rows = _size_to_rows(cachelower, self.nvectors, self.rowbytes, "cachelower",
                                         self.name)
        self._slack_rows = _size_to_rows(cacheslack, self.nvectors, self.rowbytes, "cacheslack",
                                         self.name)
        self._build_pool()

    # ---- sizing ------------------------------------------------------------------------

    def _resize(self, lower, slack):
        """Set the cache sizes (rows) and rebuild the pool; if the new pool does not fit, the
        old sizes get an empty pool again and the error is raised (the rows are safe in base)."""
        old = self._lower_rows, self._slack_rows
        self._lower_rows, self._slack_rows = lower, slack
        try:
            self._build_pool()
        except BaseException:
            self._lower_rows, self._slack_rows = old
            if self.cache is None:
                self._build_pool()
            raise
        finally:
            if self.cache is not None and not self.cached_rows:
                self.frozen = False   # an empty frozen pool would never cache a row again

    def _build_pool(self):
        """(Re)allocate an empty page pool for lower + slack rows (all rows sent home first)."""
        if self.cache is not None:
            self.flush_dirty(0)
            ca.unsafe_free(self.cache)
            self.cache = None
        want = min(self.nvectors, self._lower_rows + self._slack_rows)
        # A flush drops whole pages, oldest first, down to cachelower: a page no larger than
        # the slack keeps a flush to about the slack (one page holding a small table's whole
        # cache would empty the cache on every flush, and every lookup would start cold).
        page = self._slack_rows if self._slack_rows > 0 else want
        self.page_rows = max(1, min(self._page_rows_wanted, want, page))
        self.npages = -(-want // self.page_rows)
        slots = self.npages * self.page_rows
        cache = ca.empty((slots, self.featuresize), dtype=self.dtype, manager=self.manager)
        try:
            ca.prefetch(cache, force=True)
            if ca.in_fast(cache):
                # touch the whole pool now: the OS maps memory on first write, and a lookup
                # that first fills a slot would otherwise wait for its page (2 MiB zeroed per
                # huge page)
                with ca.kernel("embedding_cache_init", (), (cache,)) as (c,):
                    c.fill(0)
        except BaseException:
            ca.unsafe_free(cache)
            raise
        self.cache = cache
        self.backedge = np.full(slots, -1, dtype=np.int64)
        self.dirty_slots = np.zeros(slots, dtype=np.uint8)
        self.refs = np.zeros(self.nvectors, dtype=np.uint8)  # per row: looked up since cached
        self._pages = deque()                      # pages in use, oldest first
        self._free_pages = list(range(self.npages - 1, -1, -1))
        self._insert = self.page_rows              # bump pointer into the newest page
        self._fresh_pages = 0                      # pages opened since the last flush
        self._full = False

    @property
    def cachelower(self):
        """Bytes the cache is flushed down to."""
        return self._lower_rows * self.rowbytes

    @property
    def cacheslack(self):
        """Bytes the cache may grow beyond ``cachelower`` before it is full."""
        return self._slack_rows * self.rowbytes

    @_locked
    def set_cachelower(self, value):
        """Set ``cachelower`` (fraction or bytes); the pool is rebuilt empty (dirty rows go home)
        and a frozen table is unfrozen (``prepopulate`` it again). A pool that does not fit
        raises OutOfMemoryError and leaves the old sizes."""
        lower = _size_to_rows(value, self.nvectors, self.rowbytes, "cachelower", self.name)
        self._resize(lower, self._slack_rows)

    @_locked
    def set_cacheslack(self, value):
        """Set ``cacheslack`` (fraction or bytes), as ``set_cachelower``."""
        slack = _size_to_rows(value, self.nvectors, self.rowbytes, "cacheslack", self.name)
        self._resize(self._lower_rows, slack)

    @property
    def isfull(self):
        """True once an access found no free slot; cleared by a flush."""
        return self._full

    @property
    def cached_rows(self):
        return int(np.count_nonzero(self.backedge >= 0))

    @property
    def cache_bytes(self):
        """Bytes of pages in use (the cache size that ``cachelower`` bounds)."""
        return len(self._pages) * self.page_rows * self.rowbytes

    def example(self):
        return self.cache

    # ---- caching -----------------------------------------------------------------------

    def _allocate(self, n):
        """Bump-allocate up to n slots, opening pages from the free list; sets ``isfull``.
        The slots are the thread's scratch, valid until its next allocation.

        Whole pages at a time into a reused array: 25 pages took 28 us in a loop as a piece
        per page in a new array, 13 us so (after a lookup, 80-110 against 65-90 us)."""
        rows = self.page_rows
        head = min(n, rows - self._insert)      # the newest page's free slots (none if no page)
        need = n - head
        free = self._free_pages
        m = min(-(-need // rows), len(free))
        if need > m * rows:
            self._full = True
            need = m * rows
        slots = kernels.scratch("slots", head + m * rows, np.int64)
        ramp = np.arange(rows, dtype=np.int64)
        if head:
            np.add(ramp[self._insert:self._insert + head], self._pages[-1] * rows,
                   out=slots[:head])
        self._insert += head
        if m:
            opened = free[len(free) - m:][::-1]  # in the order the list pops them
            del free[len(free) - m:]
            self._pages.extend(opened)
            self._fresh_pages += m
            np.add(np.asarray(opened, dtype=np.int64)[:, None] * rows, ramp,
                   out=slots[head:].reshape(m, rows))
            self._insert = need - (m - 1) * rows
        return slots[:head + need]

    def _account_lookup(self, nidx, hits):
        self._stats["lookups"] += nidx
        self._stats["hits"] += hits
        self._stats["misses"] += nidx - hits

    def _account_update(self, nrows, hits):
        self._stats["updates"] += 1
        self._stats["rows_updated"] += nrows
        self._stats["update_hits"] += hits

    def _pool_ready(self, cache):
        """Bring the pool to fast memory before a lookup; whether the lookup may cache the
        rows it misses (``cache``, and room left in the pool)."""
        if not ca.in_fast(self.cache):
            ca.prefetch(self.cache)
        return cache and (self._insert < self.page_rows or bool(self._free_pages))

    def _scan(self, idx):
        """Plan caching the batch's uncached rows (batch-synchronous): (hits, miss rows, slots).

        The miss rows stay marked in ``where`` (see ``_scan_misses``) until ``_place`` runs;
        on an error before that, ``_unmark`` restores them."""
        miss_rows = kernels.scratch("miss_rows", idx.shape[0], np.int64)
        hits, nmiss = _scan_misses(idx, self.where, miss_rows)
        misses = miss_rows[:nmiss]
        try:
            slots = self._allocate(nmiss)
        except BaseException:
            self._unmark(misses)
            raise
        return hits, misses, slots

    def _unmark(self, misses):
        self.where[misses[self.where[misses] < -1]] = -1

    def _cache_operands(self, fill):
        """(reads, writes) of a kernel that reads the base and fills the pool (fill) or only
        reads it: the pool's view comes second either way."""
        if fill:
            return (self.base,), (self.cache,)
        return (self.base, self.cache), ()

    def _place(self, base_view, cache_view, misses, slots):
        """Copy the planned rows into their slots (inside a kernel that writes the pool)."""
        if slots.size:
            place = _place_rows_serial if _serial_rows(misses.shape[0]) else _place_rows
            place(base_view, cache_view, self.where, self.backedge, misses, slots)
        else:
            self.where[misses] = -1
        self._stats["rows_cached"] += slots.size
        self._stats["uncached"] += misses.shape[0] - slots.size

    def _cache_rows(self, idx):
        """Cache idx's uncached rows in one ``embedding_cache_rows`` kernel; returns the hits."""
        hits, misses, slots = self._scan(idx)
        reads, writes = self._cache_operands(slots.size > 0)
        try:
            with ca.kernel("embedding_cache_rows", reads, writes) as views:
                self._place(views[0], views[1], misses, slots)
        except BaseException:
            self._unmark(misses)
            raise
        return hits

    @_locked
    def rowpointer(self, i, context=None):
        """(CachedArray, row) where vector i lives now; a FORWARD access may cache it first, an
        UPDATE access marks a cached row dirty (the caller writes it there)."""
        _check_context(context, self.name)
        i = self._row_index(i)
        if context == FORWARD and self.caching == "dynamic" and not self.frozen and self.where[i] < 0:
            hits = self._cache_rows(np.array([i], dtype=np.int64))
            self._account_lookup(1, hits)
        w = int(self.where[i])
        if w >= 0 and self._second_chance:
            self.refs[i] = 1
        if w >= 0 and context == UPDATE:
            self.dirty_slots[w] = 1
        return (self.cache, w) if w >= 0 else (self.base, i)

    @property
    def flush_policy(self):
        """What the flush down to ``cachelower`` keeps (fixed when the table is built)."""
        return self._flush_policy

    @property
    def _second_chance(self):
        return self._flush_policy == "second-chance"

    @_locked
    def access_and_cache(self, indices, offsets=None, out=None):
        """Lookup that first caches the batch's uncached rows while there is room (FORWARD)."""
        return self._lookup(indices, offsets, out, cache=True)

    @_locked
    def access(self, indices, offsets=None, out=None):
        """Lookup through the pointers without caching anything."""
        return self._lookup(indices, offsets, out, cache=False)

    @_locked
    def lookup(self, indices, offsets=None, out=None, context=FORWARD):
        _check_context(context, self.name)
        cache = context == FORWARD and self.caching == "dynamic" and not self.frozen
        return self._lookup(indices, offsets, out, cache=cache)

    def _lookup(self, indices, offsets, out, cache):
        nbags = _batch_size(offsets, out, indices, self.name, self.featuresize)
        if out is self.cache or out is self.base:
            _refuse_alias(self.name, "out")
        if offsets is None:
            (idx, off), check = self._prepare(indices, offsets, nbags), False
        else:  # the offsets checked here, the indices here or by the kernel (see bag_inputs)
            idx, off, check = kernels.bag_inputs(indices, offsets, self.nvectors, nbags,
                                                 self.name)
        if out is None:
            out = self._new_output(nbags)
        # Translate every index through the pointers, listing the rows of the indices that
        # missed; cache those rows while there is room, then sum the bags (rows not cached
        # are read from the base, which holds their value).  Where that two-pass kernel does
        # not serve, the bags are summed first and the missed rows cached after: the same
        # sums, since a cached row is a copy of its base row.
        room = self._pool_ready(cache)
        refs = self.refs if self._second_chance else None
        look = None
        with _kernel("embedding_lookup", (self.base, self.cache), (out,)) as (b, c, o):
            _check_apart(o, (b, c), self.name, "out")
            if room:
                look = kernels.lookup_caching_begin(b, c, self.where, idx, off, o, refs,
                                                    name=self.name, check=check)
            if look is not None:
                hits = look.hits
                self._cache_then_sum(look)
            else:
                missed = kernels.scratch("missed", idx.shape[0], np.int64) if room else None
                _, hits = kernels.lookup_sum_indirect_hits(
                    b, c, self.where, idx, off, o, missed, name=self.name, check=check,
                    refs=refs)
        if look is None and room and hits < idx.shape[0]:
            self._cache_rows(missed[:idx.shape[0] - hits])
        self._account_lookup(idx.shape[0], hits)
        return out

    def _cache_then_sum(self, look):
        """The second pass of a caching lookup (``kernels.lookup_caching_begin``): the rows
        it missed cached (in an ``embedding_cache_rows`` kernel nested in the lookup's),
        then the bags summed, reading those rows from the pool too.

        The sums then read every cached row from the pool: the base (slow memory) is mapped
        in small pages and the pool in huge ones, and reading 10% of a fresh uniform lookup's
        rows from the base cost as much as reading all of them there (4.7 against 3.8 ms of
        CPU for none); caching first took a zipf lookup with 5% misses from 4.4-4.9 to 3.9-4.2
        ms of CPU."""
        if not look.nrows:
            kernels.lookup_caching_end(look, None, self.backedge, _NO_SLOTS)
            return
        try:
            slots = self._allocate(look.nrows)
            reads, writes = self._cache_operands(slots.size > 0)
            with ca.kernel("embedding_cache_rows", reads, writes) as views:
                kernels.lookup_caching_end(look, views[1] if slots.size else None,
                                           self.backedge, slots)
        except BaseException:
            self._unmark(look.missed_rows())
            raise
        self._stats["rows_cached"] += slots.size
        self._stats["uncached"] += look.nrows - slots.size

    @_locked
    def update(self, indices, offsets, dout, lr):
        kernels.check_lr(lr, self.name, self.dtype)
        nbags = _check_block(dout, self.name, "dout", self.featuresize)
        if dout is self.cache or dout is self.base:
            _refuse_alias(self.name, "dout")
        idx, off = self._prepare(indices, offsets, nbags)
        with _kernel("embedding_update", (dout,), (self.base, self.cache)) as (g, b, c):
            _check_apart(g, (b, c), self.name, "dout")
            # where is the table's own, always valid: only indices and offsets needed checking
            # (the kernel marks the slots it writes dirty)
            rows, hits = kernels.sgd_update_indirect_hits(b, c, self.where, idx, off, g, lr,
                                                          self.dirty_slots, name=self.name,
                                                          check=False)
        self._account_update(rows.shape[0], hits)
        return rows

    # ---- static and dynamic caching, flushing ---------------------------------------------

    @_locked
    def prepopulate(self, rows=None, seed=0, freeze=True):
        """Static caching: cache ``rows`` (default: random rows up to ``cachelower``), then freeze."""
        freeze = check_switch(freeze, "prepopulate: freeze")
        if rows is None:
            k = min(self.nvectors, max(self._lower_rows, 0), self.npages * self.page_rows)
            rows = np.random.default_rng(seed).choice(self.nvectors, size=k, replace=False)
        self._cache_rows(kernels.check_indices(rows, self.nvectors, self.name))
        self.frozen = freeze

    @_locked
    def maintain(self):
        """Between iterations: a full dynamic cache is flushed (dirty) down to ``cachelower``."""
        if self.caching == "dynamic" and not self.frozen and self._full:
            self.flush_dirty()

    @_locked
    def _flush(self, target_rows, writeback):
        target = self._lower_rows if target_rows is None else self._target(target_rows)
        rows = self.page_rows
        if len(self._pages) * rows <= target:          # nothing to pop
            self._full = False
            self._fresh_pages = 0
            return 0
        pages = np.fromiter(self._pages, dtype=np.int64, count=len(self._pages))
        keep = kernels.scratch("flush_keep", pages.shape[0] * rows, np.int64)
        # a second chance only on the flush down to cachelower: an explicit target is a bound
        npop, nkeep = _plan_flush(pages, min(self._fresh_pages, pages.shape[0]), self.backedge,
                                  self.refs, rows, self._insert, target,
                                  self._second_chance and target_rows is None, keep)
        # (npop >= 1: more than target rows of pages are in use)
        popped, keep = pages[:npop].tolist(), keep[:nkeep]
        slots = (pages[:npop, None] * rows + np.arange(rows, dtype=np.int64)).reshape(-1)
        dirty = None if writeback else self.dirty_slots[slots]
        if dirty is not None and dirty.any():
            n = int(np.count_nonzero(dirty)) - int(np.count_nonzero(self.dirty_slots[keep]))
            if n:
                raise RuntimeError(f"table {self.name!r}: flush_clean would drop {n} updated "
                                   f"rows that base memory does not have; use flush_dirty()")
        moves = nkeep > 0
        # the pool is written when rows move, read when only written back; base when written back
        reads = (self.cache,) if writeback and not moves else ()
        writes = ((self.cache,) if moves else ()) + ((self.base,) if writeback else ())
        scope = (ca.kernel("embedding_flush" if moves else "embedding_writeback", reads, writes)
                 if reads or writes else contextlib.nullcontext(()))
        with scope as views:
            for _ in popped:
                self._pages.popleft()
            c = views[0] if views else None
            kept_rows = np.empty(nkeep, dtype=np.int64)
            kept_dirty = np.empty(nkeep, dtype=np.uint8)
            if moves:    # staged: the new slots may lie in the pages popped
                staged = kernels.scratch("flush_rows", nkeep * self.featuresize, self.dtype)
                staged = staged.reshape(nkeep, self.featuresize)
                order = np.arange(nkeep, dtype=np.int64)
                copy = _copy_slots_serial if _serial_rows(nkeep) else _copy_slots
                copy(c, keep, staged, order)
            # (an oldest-first table never marks a row: no marks to clear)
            nrows = _release_slots(self.where, self.backedge, self.dirty_slots, self.refs, slots,
                                   keep, kept_rows, kept_dirty, self._second_chance, not writeback)
            if writeback:
                drop = _drop_slots_serial if _serial_rows(slots.shape[0]) else _drop_slots
                copied = drop(views[-1], c if c is None else readonly_view(c), self.where,
                              self.backedge, self.dirty_slots, slots)    # one numba type
            else:
                copied = 0
            self._free_pages.extend(reversed(popped))
            if not self._pages:
                self._insert = self.page_rows
            if moves:
                dst = self._allocate(nkeep)             # fits: the popped pages are free again
                copy(staged, order, c, dst)
                _place_kept(self.where, self.backedge, self.dirty_slots, dst, kept_rows, kept_dirty)
        self._full = False
        self._fresh_pages = 0
        self._stats["flushes"] += 1
        self._stats["pages_flushed"] += len(popped)
        self._stats["rows_flushed"] += nrows
        self._stats["rows_written_back"] += int(copied)
        self._stats["rows_retained"] += nkeep
        log.debug("table %r: flushed %d pages (%d rows dropped, %d written back, %d kept)",
                  self.name, len(popped), nrows, copied, nkeep)
        return int(copied)

    def _target(self, rows):
        """A flush's ``target_rows``: an integer >= 0 (rows of pages to keep)."""
        if isinstance(rows, (bool, np.bool_)) or not isinstance(rows, (int, np.integer)):
            raise TypeError(f"table {self.name!r}: target_rows must be an integer number of "
                            f"rows >= 0 (or None for cachelower), got {rows!r}")
        if rows < 0:
            raise ValueError(f"table {self.name!r}: target_rows must be >= 0 (0 empties the "
                             f"cache), got {rows}")
        return int(rows)

    def flush_clean(self, target_rows=None):
        """Drop the oldest pages until at most ``cachelower`` remains; refuses dirty rows."""
        return self._flush(target_rows, writeback=False)

    def flush_dirty(self, target_rows=None):
        """Drop the oldest pages until at most ``cachelower`` remains, writing dirty rows home."""
        return self._flush(target_rows, writeback=True)

    @_locked
    def writeback(self):
        """Copy every dirty cached row home and mark it clean; rows stay cached."""
        slots = np.flatnonzero(self.dirty_slots).astype(np.int64)
        if slots.size:
            with ca.kernel("embedding_writeback", (self.cache,), (self.base,)) as (c, b):
                _copy_home(b, c, self.backedge, slots)
            self.dirty_slots[slots] = 0
            self._stats["rows_written_back"] += int(slots.size)
        return int(slots.size)

    # ---- inspection --------------------------------------------------------------------

    @_locked
    def snapshot(self):
        with ca.readable(self.base) as b, ca.readable(self.cache) as c:
            out = b.copy()
            slots = np.flatnonzero(self.backedge >= 0)
            out[self.backedge[slots]] = c[slots]
        return out

    @_locked
    def load(self, values):
        """Set every row; cached rows take their new values too and are clean (what stays
        cached stays cached, so a frozen static table keeps its cache)."""
        v = self._check_values(values)
        slots = np.flatnonzero(self.backedge >= 0)
        with ca.kernel("embedding_load", (), (self.base, self.cache)) as (b, c):
            np.copyto(b, v)
            c[slots] = b[self.backedge[slots]]
        self.dirty_slots[:] = 0

    @_locked
    def check(self, clean=False):
        """Verify the pointer invariants, that cached rows not marked dirty equal their base
        rows (and, with ``clean``, that every cached row does)."""
        clean = check_switch(clean, "check: clean")
        cached = np.flatnonzero(self.where >= 0)
        slots = self.where[cached]
        errors = []
        if np.any(self.where < -1):
            errors.append("where holds values below -1")
        if slots.size and (slots.max() >= self.backedge.shape[0]):
            errors.append("where points past the page pool")
        elif not np.array_equal(self.backedge[slots], cached):
            errors.append("a cached row's back-pointer names another row")
        used = np.flatnonzero(self.backedge >= 0)
        if used.size != cached.size:
            errors.append(f"{used.size} slots hold rows but {cached.size} rows are cached")
        if np.unique(self.backedge[used]).size != used.size:
            errors.append("two slots claim the same row")
        live = set()
        for p in self._pages:
            live.update(range(p * self.page_rows, (p + 1) * self.page_rows))
        if not set(used.tolist()) <= live:
            errors.append("a row sits in a page that is not in use")
        if np.any(self.dirty_slots[self.backedge < 0]):
            errors.append("an empty slot is marked dirty")
        if np.any(self.refs[self.where < 0]):
            errors.append("a row not cached is marked as looked up")
        if slots.size and not errors:
            with ca.readable(self.base) as b, ca.readable(self.cache) as c:
                if clean and not np.array_equal(b[cached], c[slots], equal_nan=True):
                    errors.append("a cached row differs from base")
                calm = self.dirty_slots[slots] == 0
                if not np.array_equal(b[cached[calm]], c[slots[calm]], equal_nan=True):
                    errors.append("a cached row not marked dirty differs from base")
        if errors:
            raise AssertionError(f"table {self.name!r}: " + "; ".join(errors))

    def stats(self):
        s = dict(self._stats)
        rb = self.rowbytes
        s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        s["cache_rows"] = self.cached_rows
        s["capacity_rows"] = self.npages * self.page_rows
        s["cache_bytes"] = self.cache_bytes
        s["bytes_cached"] = s["rows_cached"] * rb
        s["bytes_written_back"] = s["rows_written_back"] * rb
        slow_updates = s["rows_updated"] - s["update_hits"]
        # lookups, updates (read-modify-write), cache fills (slow -> fast), write-backs (fast -> slow)
        s["bytes_retained"] = s["rows_retained"] * rb          # moved page to page on a flush
        s["fast_read_bytes"] = ((s["hits"] + s["update_hits"]) * rb + s["bytes_written_back"]
                                + s["bytes_retained"])
        s["slow_read_bytes"] = (s["misses"] + slow_updates) * rb + s["bytes_cached"]
        s["fast_write_bytes"] = s["update_hits"] * rb + s["bytes_cached"] + s["bytes_retained"]
        s["slow_write_bytes"] = slow_updates * rb + s["bytes_written_back"]
        s["dirty_bytes"] = int(np.count_nonzero(self.dirty_slots)) * rb   # write-backs owed
        return s


#: The byte counts of ``stats()`` that ``traffic_time`` needs (``dirty_bytes`` is optional).
TRAFFIC_KEYS = ("fast_read_bytes", "fast_write_bytes", "slow_read_bytes", "slow_write_bytes")


def traffic_time(stats, slow="optane", fast="dram"):
    """Modelled seconds of the memory traffic in ``stats`` (a table's ``stats()``, or their sum,
    or the difference of two) at the bandwidths of the cost model's device profiles: a policy
    figure for comparing table kinds that does not move with the machine's load or depend on
    its having slow memory.  Updated rows still cached (``dirty_bytes``) count as the
    write-backs they owe (read fast, write slow), so a cache that defers its write-backs past
    the end of a run is charged for them."""
    f, s = costmodel.get_profile(fast), costmodel.get_profile(slow)
    missing = [k for k in TRAFFIC_KEYS if k not in stats]
    if missing:
        raise ValueError(f"traffic_time needs a table's stats() (or their sum); {missing} "
                         f"missing from the {sorted(stats)} given")
    owed = stats.get("dirty_bytes", 0)
    return ((stats["fast_read_bytes"] + owed) / f.read_gbps
            + stats["fast_write_bytes"] / f.write_gbps + stats["slow_read_bytes"] / s.read_gbps
            + (stats["slow_write_bytes"] + owed) / s.write_gbps) / 1e9


# ---- table kinds and ensembles -----------------------------------------------------------

def make_table(kind, nvectors, featuresize, dtype=np.float32, *, manager=None, cache=0.25,
               slack=0.05, page_rows=DEFAULT_PAGE_ROWS, init=None, seed=0, name="table",
               flush_policy="oldest"):
    """A table of a §5.6.1 kind: "simple" (slow, uncached), "static", "dynamic", or "fast";
    ``flush_policy`` is a cached kind's (see ``CachedEmbeddingTable``)."""
    if kind == "fast":
        return SimpleTable(nvectors, featuresize, dtype, manager=manager, placement="fast",
                           init=init, seed=seed, name=name)
    if kind == "simple":
        return SimpleTable(nvectors, featuresize, dtype, manager=manager, placement="slow",
                           init=init, seed=seed, name=name)
    if kind not in ("static", "dynamic"):
        raise ValueError(f"table {name!r}: unknown table kind {kind!r}; use one of {TABLE_KINDS}")
    t = CachedEmbeddingTable(nvectors, featuresize, dtype, manager=manager, cachelower=cache,
                             cacheslack=0.0 if kind == "static" else slack, page_rows=page_rows,
                             caching=kind, init=init, seed=seed, name=name,
                             flush_policy=flush_policy)
    if kind == "static":
        t.prepopulate(seed=seed + 1)
    return t


def _columns(tables, column_offsets, width, what):
    """Each table's first column in ``out`` / ``dout`` (default: packed in order), checked
    before any table is touched: whole numbers, every block inside the width and, in
    ``out``, no two blocks overlapping (one table's sums would overwrite another's)."""
    fss = [t.featuresize for t in tables]
    if column_offsets is None:
        return np.concatenate([[0], np.cumsum(fss)[:-1]]).astype(np.int64)
    raw = np.asarray(column_offsets)
    if raw.shape != (len(tables),):
        raise ValueError(f"column_offsets must have one entry per table ({len(tables)}), got "
                         f"shape {raw.shape}")
    whole = np.issubdtype(raw.dtype, np.integer) or (
        np.issubdtype(raw.dtype, np.floating) and bool(np.all(np.isfinite(raw)))
        and bool(np.all(raw == np.floor(raw))))
    if not whole:
        raise TypeError(f"column_offsets must be whole numbers (each table's first column in "
                        f"{what}), got {raw.tolist()!r}")
    cols = raw.astype(np.int64)
    starts = cols.tolist()        # Python ints: NumPy scalars cost ~1 us per table here
    for t, c, fs in zip(tables, starts, fss):
        if c < 0 or c + fs > width:
            raise ValueError(f"table {t.name!r}: columns {c}..{c + fs} do not fit in an "
                             f"output of width {width}")
    if what == "out":
        order = sorted(range(len(starts)), key=starts.__getitem__)     # stable
        for a, b in zip(order[:-1], order[1:]):
            if starts[a] + fss[a] > starts[b]:
                raise ValueError(
                    f"tables {tables[a].name!r} (columns {starts[a]}..{starts[a] + fss[a]}) "
                    f"and {tables[b].name!r} (columns {starts[b]}..{starts[b] + fss[b]}) "
                    f"overlap in out; give each table columns of its own (column_offsets=None "
                    f"packs them)")
    return cols


def _bag_offsets(tables, indices_list, offsets_list):
    """None offsets mean one index per bag."""
    return [np.arange(_count(i, t.name, "indices"), dtype=np.int64) if o is None else o
            for t, i, o in zip(tables, indices_list, offsets_list)]


def _ensemble_args(tables, indices_list, offsets_list, block, what):
    """The checks an ensemble call starts with: one index and offset array per table and a
    2-D ``out`` / ``dout`` block."""
    if len(indices_list) != len(tables) or len(offsets_list) != len(tables):
        raise ValueError(f"{len(tables)} tables but {len(indices_list)} index arrays and "
                         f"{len(offsets_list)} offset arrays")
    if not isinstance(block, (np.ndarray, ca.CachedArray)) or block.ndim != 2:
        raise ValueError(f"{what} must be a 2-D numpy.ndarray or CachedArray (batch, sum of "
                         f"the tables' featuresizes), got {type(block).__name__} of shape "
                         f"{np.shape(block)}")
    for t in tables:    # one dtype, checked before any table runs: no half-done update
        if t.dtype != tables[0].dtype:
            raise TypeError(f"table {t.name!r}: dtype {t.dtype} differs from "
                            f"{tables[0].name!r}'s {tables[0].dtype}; an ensemble needs one dtype")
    if tables and block.dtype != tables[0].dtype:
        raise TypeError(f"table {tables[0].name!r}: {what} dtype {block.dtype} differs from "
                        f"the table's {tables[0].dtype}")


def _checked_inputs(tables, indices_list, offsets_list, nbags):
    """Every table's indices and offsets checked (as int64) before any table is touched, for
    an ensemble whose work runs in several kernels: a bad index then changes nothing."""
    il = [kernels.check_indices(i, t.nvectors, t.name) for t, i in zip(tables, indices_list)]
    ol = [kernels.check_offsets(o, i.shape[0], nbags, t.name)
          for t, i, o in zip(tables, il, offsets_list)]
    return il, ol


class _Holding:
    """Hold the locks of an ensemble's tables, each once, in one order (two ensembles that
    share tables cannot deadlock); ``shared``: some lock serves several of them."""

    def __init__(self, tables):
        self.locks = sorted({t._lock for t in tables}, key=id)
        self.shared = len(self.locks) != len(tables)

    def __enter__(self):
        for lock in self.locks:
            lock.acquire()
        return self

    def __exit__(self, *exc):
        for lock in self.locks:
            lock.release()


#: Whether ``lookup_tables`` and ``update_tables`` take several cached tables in one kernel
#: (False: one at a time, each its own lookup and update; for comparisons).
CACHED_TOGETHER = True


def _together(tables, rest):
    """Whether the tables at positions ``rest`` (the ensemble's others than SimpleTables) may
    share a kernel: several, all CachedEmbeddingTables themselves (a subclass keeps its own
    lookup and update), and ``CACHED_TOGETHER``."""
    return CACHED_TOGETHER and len(rest) > 1 and \
        all(type(tables[k]) is CachedEmbeddingTable for k in rest)


def _lookup_cached_together(tables, indices_list, offsets_list, out, cols):
    """The FORWARD lookups of several cached tables into column blocks of ``out`` in one
    kernel (``kernels.lookup_cached_many``), each table then caching its missed rows and
    counting as its own ``lookup`` would; False, having done nothing, when that kernel does
    not take the ensemble.

    One parallel region for all of them, instead of two per table and the Python around
    each: DLRM's 26 cached tables of batch 8192 spent 7-9 ms a step looking up one by one,
    against 2.3 ms for as many SimpleTables in one kernel."""
    rooms = [t._pool_ready(t.caching == "dynamic" and not t.frozen) for t in tables]
    misseds = [kernels.scratch(f"missed{k}", np.shape(i)[0], np.int64) if room else None
               for k, (i, room) in enumerate(zip(indices_list, rooms))]
    n = len(tables)
    with ca.kernel("embedding_lookup", [t.base for t in tables] + [t.cache for t in tables],
                   ()) as views:
        got = kernels.lookup_cached_many(
            views[:n], views[n:], [t.where for t in tables], indices_list, offsets_list, out,
            cols, misseds, [t.refs if t._second_chance else None for t in tables],
            names=[t.name for t in tables])
    if got is None:
        return False
    hits, nmissed = got
    for t, i, missed, h, nm in zip(tables, indices_list, misseds, hits, nmissed):
        nidx = np.shape(i)[0]
        if missed is not None and h < nidx:
            t._cache_rows(missed[:nm])
        t._account_lookup(nidx, int(h))
    return True


def _update_cached_together(tables, indices_list, offsets_list, dout, lr, cols):
    """The SGD of several cached tables from column blocks of ``dout`` in one kernel
    (``kernels.update_cached_many``), each table counting it as its own ``update`` would;
    False, having done nothing, when that kernel does not take the ensemble."""
    n = len(tables)
    with ca.kernel("embedding_update", (), [t.base for t in tables] + [t.cache for t in tables]
                   ) as views:
        got = kernels.update_cached_many(
            views[:n], views[n:], [t.where for t in tables], indices_list, offsets_list, dout,
            lr, cols, [t.dirty_slots for t in tables], names=[t.name for t in tables])
    if got is None:
        return False
    for t, rows, h in zip(tables, *got):
        t._account_update(rows.shape[0], int(h))
    return True


def _plan(tables, indices_list, offsets_list, nbags, shared):
    """(simple, rest, together, indices, offsets) of an ensemble call: the SimpleTables that
    share a kernel, the other tables, whether those share one, and the inputs, checked up
    front when the work is split over several kernels (not with ``CACHED_TOGETHER`` off: the
    tables are then each their own call, for comparisons). When a table is given more than
    once (``shared``), all go one at a time, so the results are those of the calls in turn."""
    simple = [] if shared else [k for k, t in enumerate(tables) if isinstance(t, SimpleTable)]
    rest = [k for k, t in enumerate(tables) if shared or not isinstance(t, SimpleTable)]
    together = not shared and _together(tables, rest)
    if CACHED_TOGETHER and ((simple and rest) or (len(rest) > 1 and not together)):
        indices_list, offsets_list = _checked_inputs(tables, indices_list, offsets_list, nbags)
    return simple, rest, together, indices_list, offsets_list


def lookup_tables(tables, indices_list, offsets_list, out, column_offsets=None):
    """Lookups of an ensemble into column blocks of ``out`` (batch, width); returns ``out``.

    SimpleTables run together in one parallel kernel, and so do the cached tables (see
    ``_lookup_cached_together``) when there are several.
    """
    _ensemble_args(tables, indices_list, offsets_list, out, "out")
    cols = _columns(tables, column_offsets, out.shape[1], "out")
    offsets_list = _bag_offsets(tables, indices_list, offsets_list)
    with _Holding(tables) as held:
        simple, rest, together, indices_list, offsets_list = _plan(
            tables, indices_list, offsets_list, out.shape[0], held.shared)
        # One kernel: the SimpleTables' lookups into out (each cached table's lookup is a
        # kernel of its own, nested in it: it writes a column block of the same out).
        rows = [(tables[k].data, np.shape(indices_list[k])[0] * tables[k].rowbytes)
                for k in simple]
        with _kernel("embedding_lookup", [tables[k].data for k in simple], (out,), rows) as views:
            o = views[-1]
            if simple:
                kernels.lookup_many(views[:-1], [indices_list[k] for k in simple],
                                    [offsets_list[k] for k in simple], o, cols[simple],
                                    names=[tables[k].name for k in simple])
                for k in simple:
                    tables[k]._account_lookup(np.shape(indices_list[k])[0])
            if together:
                if _lookup_cached_together(
                        [tables[k] for k in rest], [indices_list[k] for k in rest],
                        [offsets_list[k] for k in rest], o, cols[rest]):
                    return out
                if not simple:      # the kernel declined: one at a time, checked first
                    indices_list, offsets_list = _checked_inputs(tables, indices_list,
                                                                 offsets_list, out.shape[0])
            for k in rest:
                t = tables[k]
                c = int(cols[k])
                t.lookup(indices_list[k], offsets_list[k], o[:, c:c + t.featuresize])
    return out


def update_tables(tables, indices_list, offsets_list, dout, lr, column_offsets=None):
    """SGD of an ensemble from the gradient of ``lookup_tables``' output (column blocks of dout)."""
    _ensemble_args(tables, indices_list, offsets_list, dout, "dout")
    checked = set()
    for t in tables:                    # once per dtype: the first table of each is named
        if t.dtype not in checked:
            kernels.check_lr(lr, t.name, t.dtype)
            checked.add(t.dtype)
    cols = _columns(tables, column_offsets, dout.shape[1], "dout")
    offsets_list = _bag_offsets(tables, indices_list, offsets_list)
    with _Holding(tables) as held:
        simple, rest, together, indices_list, offsets_list = _plan(
            tables, indices_list, offsets_list, dout.shape[0], held.shared)
        # One kernel: the SimpleTables' updates from dout (each cached table's update is a
        # kernel of its own, nested in it: it reads a column block of the same dout).
        rows = [(tables[k].data, np.shape(indices_list[k])[0] * tables[k].rowbytes)
                for k in simple]
        with _kernel("embedding_update", (dout,), [tables[k].data for k in simple], rows) as views:
            g = views[0]
            if simple:
                rows = kernels.update_many(views[1:], [indices_list[k] for k in simple],
                                           [offsets_list[k] for k in simple], g, lr,
                                           cols[simple], names=[tables[k].name for k in simple])
                for k, r in zip(simple, rows):
                    tables[k]._account_update(r.shape[0])
            if together:
                if _update_cached_together(
                        [tables[k] for k in rest], [indices_list[k] for k in rest],
                        [offsets_list[k] for k in rest], g, lr, cols[rest]):
                    return
                if not simple:      # the kernel declined: one at a time, checked first
                    indices_list, offsets_list = _checked_inputs(tables, indices_list,
                                                                 offsets_list, dout.shape[0])
            for k in rest:
                t = tables[k]
                c = int(cols[k])
                t.update(indices_list[k], offsets_list[k], g[:, c:c + t.featuresize], lr)
