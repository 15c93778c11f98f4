"""The embedding kernels' feature loops: the one source of every kernel body (a template).

``kernels.generated_module`` imports a copy of this file per feature size with ``FS`` replaced,
so the feature loops have constant trip counts (unrolled, vectorised, no aliasing re-checks)
and numba caches the copy's kernels on disk like any module's.  The copy with ``FS = 0`` is
the generic variant: it reads the feature size from the arrays at run time (rows wider than
``kernels.MAX_SPECIALISED_FS``, ensembles of mixed sizes, ``kernels.set_specialised(False)``).

Outputs and gradients are flat 1-D buffers with a row stride, so that a column block of a
wider array (``big[:, 64:128]``) is written in place and the inner loop over features is a
unit-stride loop LLVM can vectorise.  Flat buffers are indexed with uint64 so numba emits no
negative-index wraparound in the inner loops (the wraparound branch keeps LLVM from
vectorising them; ~4x slower).  Every sum is added in index (or occurrence) order whatever
the grouping, so all variants give bit-identical results.

``where`` arguments: ``None`` for a plain table, else the cache map of an indirect table
(row r lives at ``cache[where[r]]`` if ``where[r] >= 0``, else at ``base[r]``); a plain table
is passed as its own cache, so one kernel serves both.
"""

import numpy as np
from numba import njit, prange

from cachedarrays.models.dlrm.kernels import (
    _BAGS_PER_ITEM, _PARALLEL, _PREFETCH_AHEAD, _ROW_PREFETCH, _ROWS_PER_ITEM, _SERIAL,
    _bag_bounds, _prefetch_read, _prefetch_write, _reindex)

FS = 0  # @const: the feature size; 0 = read it from the arrays at run time (generic)
BPI = _BAGS_PER_ITEM
RPI = _ROWS_PER_ITEM
AHEAD = _PREFETCH_AHEAD
RAHEAD = _ROW_PREFETCH
#: Specialised copies prefetch bag rows RAHEAD indices ahead and take indirect bags 8 rows at
#: a time; the generic copy (ensembles of one-row bags, rows wider than 512) measured faster
#: without either.  The order of additions is the same.
SPECIALISED = FS > 0

# Helpers take the run-time feature size ``fs`` and use ``FS or fs``: a constant in a
# specialised copy whether or not LLVM inlines the call.  The helpers on the paths from the
# parallel loops to the feature loops are inlined by numba itself (``inline="always"``): as
# calls, the SGD measured 5-30% slower and the generic ensemble lookup/update ~40% slower.


@njit(**_SERIAL)
def span(it, per, n):
    """Bounds of parallel work item ``it`` of ``per`` consecutive items out of ``n``."""
    lo = it * per
    return lo, min(n, lo + per)


@njit(inline="always", **_SERIAL)
def at(r, fs):
    """Flat start of row r."""
    return np.uint64(r) * np.uint64(FS or fs)


@njit(inline="always", **_SERIAL)
def addr(where, r, fs):
    """(0 = base / 1 = cache, flat start) of logical row r."""
    w = where[r]
    if w >= 0:
        return 1, at(w, fs)
    return 0, at(r, fs)


@njit(inline="always", **_SERIAL)
def locate(bflat, cflat, where, r, fs):
    """(flat buffer, start) of logical row r: base or cache; the base for a plain table."""
    if where is None:
        return bflat, at(r, fs)
    c, p = addr(where, r, fs)
    return (cflat if c else bflat), p


@njit(**_SERIAL)
def prefetch_row(flat, p, fs):
    step = max(1, 64 // flat.itemsize)
    for f in range(0, FS or fs, step):
        _prefetch_read(flat, p + np.uint64(f))


@njit(**_SERIAL)
def prefetch_row_write(flat, p, fs):
    step = max(1, 64 // flat.itemsize)
    for f in range(0, FS or fs, step):
        _prefetch_write(flat, p + np.uint64(f))


@njit(**_SERIAL)
def add8(acc, t, p0, p1, p2, p3, p4, p5, p6, p7, fs):
    for f in range(FS or fs):
        uf = np.uint64(f)
        acc[uf] = (acc[uf] + t[p0 + uf] + t[p1 + uf] + t[p2 + uf] + t[p3 + uf]
                   + t[p4 + uf] + t[p5 + uf] + t[p6 + uf] + t[p7 + uf])


@njit(**_SERIAL)
def add4(acc, t, p0, p1, p2, p3, fs):
    for f in range(FS or fs):
        uf = np.uint64(f)
        acc[uf] = acc[uf] + t[p0 + uf] + t[p1 + uf] + t[p2 + uf] + t[p3 + uf]


@njit(**_SERIAL)
def add1(acc, t, p0, fs):
    for f in range(FS or fs):
        uf = np.uint64(f)
        acc[uf] += t[p0 + uf]


@njit(**_SERIAL)
def zero(acc, fs):
    for f in range(FS or fs):
        acc[np.uint64(f)] = 0


@njit(**_SERIAL)
def store(acc, out, o, fs):
    for f in range(FS or fs):
        uf = np.uint64(f)
        out[o + uf] = acc[uf]


@njit(inline="always", **_SERIAL)
def sum_bag(t, indices, start, end, acc, fs):
    """acc = rows indices[start:end] summed in index order.

    Rows are taken 8 (then 4, then 1) at a time: the element-wise order of additions is
    unchanged, but acc is loaded and stored once per group and 8 rows are in flight."""
    nidx = indices.shape[0]
    zero(acc, fs)
    j = start
    while j < end:
        n = 8 if j + 8 <= end else (4 if j + 4 <= end else 1)
        if SPECIALISED:
            for q in range(j + RAHEAD, min(j + RAHEAD + n, nidx)):
                prefetch_row(t, at(indices[q], fs), fs)
        if n == 8:
            add8(acc, t, at(indices[j], fs), at(indices[j + 1], fs), at(indices[j + 2], fs),
                 at(indices[j + 3], fs), at(indices[j + 4], fs), at(indices[j + 5], fs),
                 at(indices[j + 6], fs), at(indices[j + 7], fs), fs)
        elif n == 4:
            add4(acc, t, at(indices[j], fs), at(indices[j + 1], fs), at(indices[j + 2], fs),
                 at(indices[j + 3], fs), fs)
        else:
            add1(acc, t, at(indices[j], fs), fs)
        j += n


@njit(**_SERIAL)
def sum_bag_indirect(bflat, cflat, where, indices, start, end, acc, fs):
    """Like sum_bag, row r read from cache[where[r]] when where[r] >= 0, 8 rows at a time."""
    nidx = indices.shape[0]
    zero(acc, fs)
    j = start
    while j < end:
        n = min(8, end - j) if SPECIALISED else 1
        if SPECIALISED:
            for q in range(j + 2 * RAHEAD, min(j + 2 * RAHEAD + n, nidx)):
                _prefetch_read(where, np.uint64(indices[q]))
            for q in range(j + RAHEAD, min(j + RAHEAD + n, nidx)):
                flat, p = locate(bflat, cflat, where, indices[q], fs)
                prefetch_row(flat, p, fs)
        if n == 8:
            c0, p0 = addr(where, indices[j], fs)
            c1, p1 = addr(where, indices[j + 1], fs)
            c2, p2 = addr(where, indices[j + 2], fs)
            c3, p3 = addr(where, indices[j + 3], fs)
            c4, p4 = addr(where, indices[j + 4], fs)
            c5, p5 = addr(where, indices[j + 5], fs)
            c6, p6 = addr(where, indices[j + 6], fs)
            c7, p7 = addr(where, indices[j + 7], fs)
            ncached = c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7
            if ncached == 8 or ncached == 0:
                add8(acc, cflat if ncached else bflat, p0, p1, p2, p3, p4, p5, p6, p7, fs)
                j += 8
                continue
        for q in range(j, j + n):
            c, p = addr(where, indices[q], fs)
            if c:  # two calls rather than one on a selected array: that measured slower
                add1(acc, cflat, p, fs)
            else:
                add1(acc, bflat, p, fs)
        j += n


@njit(inline="always", **_SERIAL)
def bag_sums(bflat, cflat, where, indices, offsets, lo, hi, out, ostride, ocol, acc, fs):
    """out rows lo..hi (at column ocol of a row-strided flat buffer) = those bags' sums."""
    nidx = indices.shape[0]
    for b in range(lo, hi):
        start, end = _bag_bounds(offsets, b, nidx)
        if where is None:
            sum_bag(bflat, indices, start, end, acc, fs)
        else:
            sum_bag_indirect(bflat, cflat, where, indices, start, end, acc, fs)
        store(acc, out, np.uint64(b * ostride + ocol), fs)


@njit(**_SERIAL)
def sum_grad(dout, gstride, gcol, occ, lo, hi, acc, fs):
    """acc = sum of gradient rows occ[lo:hi] (a row-strided flat buffer), in order."""
    zero(acc, fs)
    for k in range(lo, hi):
        add1(acc, dout, np.uint64(occ[k] * gstride + gcol), fs)


@njit(inline="always", **_SERIAL)
def sgd_row(flat, p, lr, dout, gstride, gcol, occ, lo, hi, acc, fs):
    """flat[p:p+fs] -= lr * (sum of gradient rows occ[lo:hi]): one read-modify-write of a row.

    A row used once (the common case for large tables) skips the accumulator; the result is
    identical because 0 + g == g."""
    if hi - lo == 1:
        g = np.uint64(occ[lo] * gstride + gcol)
        for f in range(FS or fs):
            uf = np.uint64(f)
            flat[p + uf] -= lr * dout[g + uf]
    else:  # sum_grad written out: one call level less measured faster
        zero(acc, fs)
        for k in range(lo, hi):
            add1(acc, dout, np.uint64(occ[k] * gstride + gcol), fs)
        for f in range(FS or fs):
            uf = np.uint64(f)
            flat[p + uf] -= lr * acc[uf]


@njit(inline="always", **_SERIAL)
def sgd_rows(bflat, cflat, where, rows, bounds, occ, lo, hi, dout, gstride, gcol, lr, acc, fs):
    """SGD of unique rows lo..hi (group u's occurrences are occ[bounds[u+1]:bounds[u+2]]),
    prefetching (with write intent) the row AHEAD positions on."""
    for u in range(lo, hi):
        if u + AHEAD < hi:
            flat, q = locate(bflat, cflat, where, rows[u + AHEAD], fs)
            prefetch_row_write(flat, q, fs)
        flat, p = locate(bflat, cflat, where, rows[u], fs)
        sgd_row(flat, p, lr, dout, gstride, gcol, occ, bounds[u + 1], bounds[u + 2], acc, fs)


# ---- parallel kernels --------------------------------------------------------------------


@njit(**_PARALLEL)
def gather(table, indices, out, ostride, ocol):
    n = indices.shape[0]
    fs = FS or table.shape[1]
    tflat = table.reshape(-1)
    for it in prange((n + BPI - 1) // BPI):
        lo, hi = span(it, BPI, n)
        for i in range(lo, hi):
            if SPECIALISED and i + RAHEAD < n:
                prefetch_row(tflat, at(indices[i + RAHEAD], fs), fs)
            p = at(indices[i], fs)
            o = np.uint64(i * ostride + ocol)
            for f in range(FS or fs):
                uf = np.uint64(f)
                out[o + uf] = tflat[p + uf]


@njit(**_PARALLEL)
def bag_sum(base, cache, where, indices, offsets, nbags, out, ostride, ocol):
    """Bag sums into a row-strided flat ``out``; pass ``(table, table, None)`` for a plain table."""
    fs = FS or base.shape[1]
    bflat = base.reshape(-1)
    cflat = cache.reshape(-1)
    for it in prange((nbags + BPI - 1) // BPI):
        acc = np.empty(fs, dtype=base.dtype)
        lo, hi = span(it, BPI, nbags)
        bag_sums(bflat, cflat, where, indices, offsets, lo, hi, out, ostride, ocol, acc, fs)


@njit(**_PARALLEL)
def bag_sum_many(tables, indices, offsets, nbags, out, ostride, cols, chunk):
    """All tables into one concatenated output; work items are (bag chunk, table) pairs."""
    ntables = len(tables)
    nchunks = (nbags + chunk - 1) // chunk
    for it in prange(nchunks * ntables):
        c = it // ntables
        t = it - c * ntables  # tables vary fastest so each thread gets a mix of tables
        fs = FS or tables[t].shape[1]
        tflat = tables[t].reshape(-1)
        acc = np.empty(fs, dtype=tflat.dtype)
        lo, hi = span(c, chunk, nbags)
        bag_sums(tflat, tflat, None, indices[t], offsets[t], lo, hi, out, ostride, cols[t],
                 acc, fs)


@njit(**_PARALLEL)
def apply_sgd(base, cache, where, rows, bounds, occ, nu, dout, gstride, gcol, lr):
    """SGD of the re-indexed unique rows; pass ``(table, table, None)`` for a plain table."""
    fs = FS or base.shape[1]
    bflat = base.reshape(-1)
    cflat = cache.reshape(-1)
    for it in prange((nu + RPI - 1) // RPI):
        acc = np.empty(fs, dtype=base.dtype)
        lo, hi = span(it, RPI, nu)
        sgd_rows(bflat, cflat, where, rows, bounds, occ, lo, hi, dout, gstride, gcol, lr, acc,
                 fs)


@njit(**_PARALLEL)
def grad(rows, bounds, occ, nu, dout, gstride, gcol, grads):
    """grads[u] = the summed gradient of unique row u."""
    fs = FS or grads.shape[1]
    for it in prange((nu + RPI - 1) // RPI):
        lo, hi = span(it, RPI, nu)
        for u in range(lo, hi):
            sum_grad(dout, gstride, gcol, occ, bounds[u + 1], bounds[u + 2], grads[u], fs)


@njit(**_PARALLEL)
def update_many(tables, indices, offsets, nbags, dout, gstride, cols, lr, slots,
                nworkers, idx_base):
    """Re-index every table (worker w takes tables w, w + nworkers, ...; one scratch row of
    ``slots`` each), then apply SGD over flattened (row chunk, table) items.
    Returns the unique-row counts and the concatenated unique rows."""
    ntables = len(tables)
    total = idx_base[ntables]
    rows = np.empty(total, dtype=np.int64)
    occ = np.empty(total, dtype=np.int64)
    bounds = np.empty(total + 2 * ntables, dtype=np.int64)
    nus = np.zeros(ntables, dtype=np.int64)
    for w in prange(nworkers):
        for t in range(w, ntables, nworkers):
            lo = idx_base[t]
            hi = idx_base[t + 1]
            nus[t] = _reindex(indices[t], offsets[t], nbags, slots[w], rows[lo:hi],
                              bounds[lo + 2 * t:hi + 2 * t + 2], occ[lo:hi])
    maxitems = 0
    for t in range(ntables):
        maxitems = max(maxitems, (nus[t] + RPI - 1) // RPI)
    for it in prange(maxitems * ntables):
        c = it // ntables
        t = it - c * ntables
        nu = nus[t]
        if c * RPI < nu:
            fs = FS or tables[t].shape[1]
            tflat = tables[t].reshape(-1)
            acc = np.empty(fs, dtype=tflat.dtype)
            lo, hi = span(c, RPI, nu)
            base = idx_base[t]
            end = idx_base[t + 1]
            sgd_rows(tflat, tflat, None, rows[base:base + nu], bounds[base + 2 * t:end + 2 * t + 2],
                     occ[base:end], lo, hi, dout, gstride, cols[t], lr, acc, fs)
    return nus, rows


KERNELS = dict(gather=gather, bag_sum=bag_sum, bag_sum_many=bag_sum_many, apply_sgd=apply_sgd,
               grad=grad, update_many=update_many)
