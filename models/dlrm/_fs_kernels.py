"""Embedding kernels specialised for one feature size (a template; see ``kernels._specialised``).

``kernels`` writes a copy of this file per feature size with ``FS`` replaced, imports it and
so gets kernels whose feature loops have constant trip counts (unrolled, vectorised, no
aliasing re-checks) and that numba caches on disk like any module's functions.  Additions
happen in the order of the generic kernels in ``kernels``, so results are bit-identical.
"""

import numpy as np
from numba import njit, prange

from cachedarrays.models.dlrm.kernels import (
    _BAGS_PER_ITEM, _PARALLEL, _PREFETCH_AHEAD, _ROW_PREFETCH, _ROWS_PER_ITEM, _SERIAL,
    _bag_bounds, _prefetch_read, _prefetch_write, _reindex)

FS = 16  # @const: replaced per feature size
FSU = np.uint64(FS)
BPI = _BAGS_PER_ITEM
RPI = _ROWS_PER_ITEM
AHEAD = _PREFETCH_AHEAD
RAHEAD = _ROW_PREFETCH

@njit(**_SERIAL)
def prefetch_row(flat, p):
    step = max(1, 64 // flat.itemsize)
    for f in range(0, FS, step):
        _prefetch_read(flat, p + np.uint64(f))

@njit(**_SERIAL)
def prefetch_row_write(flat, p):
    step = max(1, 64 // flat.itemsize)
    for f in range(0, FS, step):
        _prefetch_write(flat, p + np.uint64(f))

@njit(**_SERIAL)
def add8(acc, t, p0, p1, p2, p3, p4, p5, p6, p7):
    for f in range(FS):
        uf = np.uint64(f)
        acc[uf] = (acc[uf] + t[p0 + uf] + t[p1 + uf] + t[p2 + uf] + t[p3 + uf]
                   + t[p4 + uf] + t[p5 + uf] + t[p6 + uf] + t[p7 + uf])

@njit(**_SERIAL)
def add4(acc, t, p0, p1, p2, p3):
    for f in range(FS):
        uf = np.uint64(f)
        acc[uf] = acc[uf] + t[p0 + uf] + t[p1 + uf] + t[p2 + uf] + t[p3 + uf]

@njit(**_SERIAL)
def add1(acc, t, p0):
    for f in range(FS):
        uf = np.uint64(f)
        acc[uf] += t[p0 + uf]

@njit(**_SERIAL)
def zero(acc):
    for f in range(FS):
        acc[np.uint64(f)] = 0

@njit(**_SERIAL)
def store(acc, out, o):
    for f in range(FS):
        uf = np.uint64(f)
        out[o + uf] = acc[uf]

@njit(**_SERIAL)
def sum_bag(t, indices, start, end, acc):
    """acc = rows indices[start:end] summed in index order (8, then 4, then 1 at a time)."""
    nidx = indices.shape[0]
    zero(acc)
    j = start
    while j + 8 <= end:
        for q in range(j + RAHEAD, min(j + RAHEAD + 8, nidx)):
            prefetch_row(t, np.uint64(indices[q]) * FSU)
        add8(acc, t, np.uint64(indices[j]) * FSU, np.uint64(indices[j + 1]) * FSU,
             np.uint64(indices[j + 2]) * FSU, np.uint64(indices[j + 3]) * FSU,
             np.uint64(indices[j + 4]) * FSU, np.uint64(indices[j + 5]) * FSU,
             np.uint64(indices[j + 6]) * FSU, np.uint64(indices[j + 7]) * FSU)
        j += 8
    while j + 4 <= end:
        for q in range(j + RAHEAD, min(j + RAHEAD + 4, nidx)):
            prefetch_row(t, np.uint64(indices[q]) * FSU)
        add4(acc, t, np.uint64(indices[j]) * FSU, np.uint64(indices[j + 1]) * FSU,
             np.uint64(indices[j + 2]) * FSU, np.uint64(indices[j + 3]) * FSU)
        j += 4
    while j < end:
        if j + RAHEAD < nidx:
            prefetch_row(t, np.uint64(indices[j + RAHEAD]) * FSU)
        add1(acc, t, np.uint64(indices[j]) * FSU)
        j += 1

@njit(**_SERIAL)
def addr(where, r):
    """(0 = base / 1 = cache, flat start) of logical row r."""
    w = where[r]
    if w >= 0:
        return 1, np.uint64(w) * FSU
    return 0, np.uint64(r) * FSU

@njit(**_SERIAL)
def sum_bag_indirect(bflat, cflat, where, indices, start, end, acc):
    """Like sum_bag, row r read from cache[where[r]] when where[r] >= 0, 8 rows at a time."""
    nidx = indices.shape[0]
    zero(acc)
    j = start
    while j < end:
        n = min(8, end - j)
        for q in range(j + 2 * RAHEAD, min(j + 2 * RAHEAD + n, nidx)):
            _prefetch_read(where, np.uint64(indices[q]))
        for q in range(j + RAHEAD, min(j + RAHEAD + n, nidx)):
            c, p = addr(where, indices[q])
            prefetch_row(cflat if c else bflat, p)
        if n == 8:
            c0, p0 = addr(where, indices[j])
            c1, p1 = addr(where, indices[j + 1])
            c2, p2 = addr(where, indices[j + 2])
            c3, p3 = addr(where, indices[j + 3])
            c4, p4 = addr(where, indices[j + 4])
            c5, p5 = addr(where, indices[j + 5])
            c6, p6 = addr(where, indices[j + 6])
            c7, p7 = addr(where, indices[j + 7])
            if c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 == 8:
                add8(acc, cflat, p0, p1, p2, p3, p4, p5, p6, p7)
            elif c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 == 0:
                add8(acc, bflat, p0, p1, p2, p3, p4, p5, p6, p7)
            else:
                for q in range(j, j + 8):
                    c, p = addr(where, indices[q])
                    add1(acc, cflat if c else bflat, p)
        else:
            for q in range(j, j + n):
                c, p = addr(where, indices[q])
                add1(acc, cflat if c else bflat, p)
        j += n

@njit(**_PARALLEL)
def gather(table, indices, out, ostride, ocol):
    n = indices.shape[0]
    tflat = table.reshape(-1)
    nitems = (n + BPI - 1) // BPI
    for it in prange(nitems):
        lo = it * BPI
        hi = min(n, lo + BPI)
        for i in range(lo, hi):
            if i + RAHEAD < n:
                prefetch_row(tflat, np.uint64(indices[i + RAHEAD]) * FSU)
            p = np.uint64(indices[i]) * FSU
            o = np.uint64(i * ostride + ocol)
            for f in range(FS):
                uf = np.uint64(f)
                out[o + uf] = tflat[p + uf]

@njit(**_PARALLEL)
def bag_sum(table, indices, offsets, nbags, out, ostride, ocol):
    nidx = indices.shape[0]
    tflat = table.reshape(-1)
    nitems = (nbags + BPI - 1) // BPI
    for it in prange(nitems):
        acc = np.empty(FS, dtype=table.dtype)
        lo = it * BPI
        hi = min(nbags, lo + BPI)
        for b in range(lo, hi):
            start, end = _bag_bounds(offsets, b, nidx)
            sum_bag(tflat, indices, start, end, acc)
            store(acc, out, np.uint64(b * ostride + ocol))

@njit(**_PARALLEL)
def bag_sum_indirect(base, cache, where, indices, offsets, nbags, out, ostride, ocol):
    nidx = indices.shape[0]
    bflat = base.reshape(-1)
    cflat = cache.reshape(-1)
    nitems = (nbags + BPI - 1) // BPI
    for it in prange(nitems):
        acc = np.empty(FS, dtype=base.dtype)
        lo = it * BPI
        hi = min(nbags, lo + BPI)
        for b in range(lo, hi):
            start, end = _bag_bounds(offsets, b, nidx)
            sum_bag_indirect(bflat, cflat, where, indices, start, end, acc)
            store(acc, out, np.uint64(b * ostride + ocol))

@njit(**_PARALLEL)
def bag_sum_many(tables, indices, offsets, nbags, out, ostride, cols, chunk):
    ntables = len(tables)
    nchunks = (nbags + chunk - 1) // chunk
    for it in prange(nchunks * ntables):
        c = it // ntables
        t = it - c * ntables
        tflat = tables[t].reshape(-1)
        acc = np.empty(FS, dtype=tflat.dtype)
        idx = indices[t]
        off = offsets[t]
        nidx = idx.shape[0]
        lo = c * chunk
        hi = min(nbags, lo + chunk)
        for b in range(lo, hi):
            start, end = _bag_bounds(off, b, nidx)
            sum_bag(tflat, idx, start, end, acc)
            store(acc, out, np.uint64(b * ostride + cols[t]))

@njit(**_SERIAL)
def sgd_row(flat, p, lr, dout, gstride, gcol, occ, lo, hi, acc):
    if hi - lo == 1:
        g = np.uint64(occ[lo] * gstride + gcol)
        for f in range(FS):
            uf = np.uint64(f)
            flat[p + uf] -= lr * dout[g + uf]
    else:
        zero(acc)
        for k in range(lo, hi):
            add1(acc, dout, np.uint64(occ[k] * gstride + gcol))
        for f in range(FS):
            uf = np.uint64(f)
            flat[p + uf] -= lr * acc[uf]

@njit(**_PARALLEL)
def apply_sgd(table, rows, bounds, occ, nu, dout, gstride, gcol, lr):
    tflat = table.reshape(-1)
    nitems = (nu + RPI - 1) // RPI
    for it in prange(nitems):
        acc = np.empty(FS, dtype=table.dtype)
        lo = it * RPI
        hi = min(nu, lo + RPI)
        for u in range(lo, hi):
            if u + AHEAD < hi:
                prefetch_row_write(tflat, np.uint64(rows[u + AHEAD]) * FSU)
            sgd_row(tflat, np.uint64(rows[u]) * FSU, lr, dout, gstride, gcol, occ,
                    bounds[u + 1], bounds[u + 2], acc)

@njit(**_PARALLEL)
def apply_sgd_indirect(base, cache, where, rows, bounds, occ, nu, dout, gstride, gcol, lr):
    bflat = base.reshape(-1)
    cflat = cache.reshape(-1)
    nitems = (nu + RPI - 1) // RPI
    for it in prange(nitems):
        acc = np.empty(FS, dtype=base.dtype)
        lo = it * RPI
        hi = min(nu, lo + RPI)
        for u in range(lo, hi):
            if u + AHEAD < hi:
                c, q = addr(where, rows[u + AHEAD])
                prefetch_row_write(cflat if c else bflat, q)
            c, p = addr(where, rows[u])
            sgd_row(cflat if c else bflat, p, lr, dout, gstride, gcol, occ,
                    bounds[u + 1], bounds[u + 2], acc)

@njit(**_PARALLEL)
def update_many(tables, indices, offsets, nbags, dout, gstride, cols, lr, slots,
                nworkers, idx_base):
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
        lo = c * RPI
        if lo < nu:
            hi = min(nu, lo + RPI)
            tflat = tables[t].reshape(-1)
            acc = np.empty(FS, dtype=tflat.dtype)
            base = idx_base[t]
            trows = rows[base:base + nu]
            tocc = occ[base:idx_base[t + 1]]
            tb = bounds[base + 2 * t:idx_base[t + 1] + 2 * t + 2]
            for u in range(lo, hi):
                if u + AHEAD < hi:
                    prefetch_row_write(tflat, np.uint64(trows[u + AHEAD]) * FSU)
                sgd_row(tflat, np.uint64(trows[u]) * FSU, lr, dout, gstride, cols[t], tocc,
                        tb[u + 1], tb[u + 2], acc)
    return nus, rows

KERNELS = dict(gather=gather, bag_sum=bag_sum, bag_sum_indirect=bag_sum_indirect,
               bag_sum_many=bag_sum_many, apply_sgd=apply_sgd,
               apply_sgd_indirect=apply_sgd_indirect, update_many=update_many)
