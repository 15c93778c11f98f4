"""The embedding kernels' numba code: ``make_kernels(fs)`` builds every kernel for one feature
size, from the one source of every kernel body.

``make_kernels(FS)`` defines the kernels as closures over ``FS``.  numba freezes a closure
variable as a compile-time constant, so in a specialised set (``FS > 0``) the feature loops
have constant trip counts (unrolled, vectorised, no aliasing re-checks).  ``FS = 0`` gives
the generic set, which reads the feature size from the arrays at run time (rows wider than
``kernels.MAX_SPECIALISED_FS``, ensembles of mixed sizes, ``kernels.set_specialised(False)``).
The helpers below take the feature size ``fs`` as an argument; numba inlines those with a
feature loop into the kernels (``inline="always"``), where ``fs`` is that constant.

numba caches a closure over an int like any function (its cache key includes the closure's
values), so each set compiles once, not in every process.  That holds because the kernels
capture nothing but ints and bools and call only functions of this file: a closure over a
function gets a new cache key in every process, and numba checks a cached kernel against its
own file only.

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


from ._intrinsics import (ROW_VECTOR_BYTES, add_rows1, add_rows4, add_rows8, prefetch_far,
                          prefetch_read, prefetch_read_l2, prefetch_write)

PARALLEL = dict(parallel=True, cache=True, fastmath=False, nogil=True)
SERIAL = dict(cache=True, fastmath=False, nogil=True)
#: Helpers on the paths from the parallel loops to the feature loops: inlined by numba, so
#: the feature size is a constant in them (as calls, the SGD measured 5-30% slower and the
#: generic ensemble lookup/update ~40% slower).
INLINE = dict(inline="always", **SERIAL)
#: Bags handled by one parallel work item; big enough to amortise scheduling, small enough to balance.
BAGS_PER_ITEM = 64
#: Unique rows updated by one parallel work item.
ROWS_PER_ITEM = 256
#: Rows ahead that the update prefetches (with write intent): halves the random RMW time.
PREFETCH_AHEAD = 16
#: Indices ahead whose rows the lookups prefetch (``prefetch_far``: into L2 on a Xeon, where
#: 16 ahead into L1 left a uniform 1M x 64 lookup latency-bound, 8.4 ms against 6.3-7.2 ms).
ROW_PREFETCH = 64
#: Indices ahead whose marks (``refs``) the translation prefetches (``prefetch_far``).
MARK_PREFETCH = 96
#: Missed rows ahead whose ``where`` entries ``first_misses`` (and ``embedding._scan_misses``)
#: prefetch for writing: the entries are random and cold after the sums; 26,000 of them took
#: 0.56 ms unprefetched, 0.38 ms 32 ahead (0.41 ms 16 ahead, 0.38 ms 64 ahead).
SCAN_AHEAD = 32
#: Missed rows one parallel work item copies into the pool (``place_misses``, in a caching
#: lookup and in ``embedding._place_rows``), and how far ahead it prefetches them.
PPI = 256
PLACE_AHEAD = 8
#: Indices translated by one parallel work item.
INDICES_PER_ITEM = 4096
MAHEAD = MARK_PREFETCH
#: Rows ahead whose ``where`` entries the indirect SGD prefetches: the row prefetch AHEAD on
#: reads ``where`` to find the row, and a miss there stalled it (the SGD of a cached 1M x 64
#: table, 280,000 unique rows, took 4.4-5.3 instead of 7.6-8.8 ms; 32 ahead measured 5% faster
#: than 64 and 20% faster than 128).
UWAHEAD = 2 * PREFETCH_AHEAD
IPI = INDICES_PER_ITEM
BPI = BAGS_PER_ITEM
RPI = ROWS_PER_ITEM
AHEAD = PREFETCH_AHEAD
RAHEAD = ROW_PREFETCH
#: The bound of a lookup whose indices were checked before the kernel: no index is above it.
NO_BOUND = np.uint64(2**64 - 1)
#: A zero distance (a single table's own ``where`` and marks: see ``translate``).
ZERO = np.uint64(0)


# ---- helpers without a feature loop -------------------------------------------------------


@njit(**SERIAL)
def bag_bounds(offsets, b, nidx):
    """(start, end) of bag b of one table's own offsets and nidx indices."""
    return bag_range(offsets, 0, offsets.shape[0], 0, nidx, b)


@njit(**SERIAL)
def offsets_flagged(offsets, nbags, nidx, bad):
    """True (and ``bad[0] = 2``) unless the bag offsets start at 0 and, given ``nbags + 1``
    of them, end at ``nidx``; ``bag_sums`` checks each bag's own range as it sums it."""
    n = offsets.shape[0]
    if (n > 0 and offsets[0] != 0) or (n > nbags and offsets[nbags] != nidx) or \
            n < nbags or n > nbags + 1:
        bad[0] = 2
        return True
    return False


@njit(**SERIAL)
def mark_refs(where, indices, refs):
    """refs[r] = 1 for every cached row r among indices (see ``translate``)."""
    for j in range(indices.shape[0]):
        r = indices[j]
        if where[r] >= 0 and refs[r] == 0:
            refs[r] = 1


@njit(**SERIAL)
def reindex(indices, offsets, nbags, slot, rows, bounds, occ):
    """CSR re-indexing of one table's occurrences, grouped by unique row in first-seen order.

    Fills ``rows[:nu]`` (unique rows), ``occ`` (the bag of every occurrence, grouped by row,
    occurrence order inside a group) and ``bounds`` so that group u is
    ``occ[bounds[u + 1]:bounds[u + 2]]``.  ``slot`` (one int32 per table row) must be zero on
    entry and is zero again on exit, so one scratch buffer serves every call.  Returns nu.

    The histogram's slots come into L2 ROW_PREFETCH indices ahead and into L1, for writing,
    PREFETCH_AHEAD ahead (the two-step prefetch took 1M-row re-indexing of 327,680 indices
    from 6.3-7.6 to 5.0-6.9 ms).
    """
    nidx = indices.shape[0]
    nu = 0
    for j in range(nidx):  # histogram: slot[r] = 1 + unique id of r, bounds[u + 2] = count
        if j + RAHEAD < nidx:
            prefetch_read_l2(slot, indices[j + RAHEAD])
        if j + AHEAD < nidx:
            prefetch_write(slot, indices[j + AHEAD])
        r = indices[j]
        s = slot[r]
        if s == 0:
            rows[nu] = r
            nu += 1
            slot[r] = nu
            bounds[nu + 1] = 1
        else:
            bounds[s + 1] += 1
    bounds[0] = 0
    bounds[1] = 0
    for u in range(nu):  # prefix sum: bounds[u + 2] = end of group u
        bounds[u + 2] += bounds[u + 1]
    for u in range(nu):  # shift so that bounds[u + 1] = end of group u
        bounds[u + 1] = bounds[u + 2]
    bounds[nu + 1] = nidx
    for b in range(nbags - 1, -1, -1):  # scatter backwards: groups fill in occurrence order
        start, end = bag_bounds(offsets, b, nidx)
        for j in range(end - 1, start - 1, -1):
            if j >= AHEAD:
                prefetch_read(slot, indices[j - AHEAD])
            g = slot[indices[j]]
            bounds[g] -= 1
            occ[bounds[g]] = b
    for u in range(nu):
        if u + AHEAD < nu:
            prefetch_write(slot, rows[u + AHEAD])
        slot[rows[u]] = 0
    return nu


@njit(**SERIAL)
def span(it, per, n):
    """Bounds of parallel work item ``it`` of ``per`` consecutive items out of ``n``."""
    lo = it * per
    return lo, min(n, lo + per)


# ---- helpers with a feature loop: ``fs`` is the kernel's (constant) feature size ----------


@njit(**INLINE)
def at(r, fs):
    """Flat start of row r."""
    return np.uint64(r) * np.uint64(fs)


@njit(**INLINE)
def addr(where, r, fs):
    """(0 = base / 1 = cache, flat start) of logical row r."""
    w = where[r]
    if w >= 0:
        return 1, at(w, fs)
    return 0, at(r, fs)


@njit(**INLINE)
def locate(bflat, cflat, where, r, fs):
    """(flat buffer, start) of logical row r: base or cache; the base for a plain table."""
    if where is None:
        return bflat, at(r, fs)
    c, p = addr(where, r, fs)
    return (cflat if c else bflat), p


@njit(**INLINE)
def prefetch_row(flat, p, fs):
    step = max(1, 64 // flat.itemsize)
    for f in range(0, fs, step):
        prefetch_far(flat, p + np.uint64(f))


@njit(**INLINE)
def prefetch_row_write(flat, p, fs):
    step = max(1, 64 // flat.itemsize)
    for f in range(0, fs, step):
        prefetch_write(flat, p + np.uint64(f))


@njit(**INLINE)
def vector_part(t, fs):
    """The leading features of a row that ``add_rows*`` sums (whole vectors)."""
    lanes = ROW_VECTOR_BYTES // t.itemsize
    return np.uint64(fs - fs % lanes)


@njit(**INLINE)
def add8(acc, t, p0, p1, p2, p3, p4, p5, p6, p7, fs):
    """acc += rows at p0..p7, added in that order: whole vectors by ``add_rows8``, the rest
    element by element (the same sums, bit for bit)."""
    v = vector_part(t, fs)
    add_rows8(acc, t, p0, p1, p2, p3, p4, p5, p6, p7, v)
    for f in range(v, fs):
        uf = np.uint64(f)
        acc[uf] = (acc[uf] + t[p0 + uf] + t[p1 + uf] + t[p2 + uf] + t[p3 + uf]
                   + t[p4 + uf] + t[p5 + uf] + t[p6 + uf] + t[p7 + uf])


@njit(**INLINE)
def add8x(acc, t0, t1, t2, t3, t4, t5, t6, t7, p0, p1, p2, p3, p4, p5, p6, p7, fs):
    """add8 with each row from its own flat buffer (base or cache)."""
    for f in range(fs):
        uf = np.uint64(f)
        acc[uf] = (acc[uf] + t0[p0 + uf] + t1[p1 + uf] + t2[p2 + uf] + t3[p3 + uf]
                   + t4[p4 + uf] + t5[p5 + uf] + t6[p6 + uf] + t7[p7 + uf])


@njit(**INLINE)
def add4(acc, t, p0, p1, p2, p3, fs):
    v = vector_part(t, fs)
    add_rows4(acc, t, p0, p1, p2, p3, v)
    for f in range(v, fs):
        uf = np.uint64(f)
        acc[uf] = acc[uf] + t[p0 + uf] + t[p1 + uf] + t[p2 + uf] + t[p3 + uf]


@njit(**INLINE)
def add1(acc, t, p0, fs):
    v = vector_part(t, fs)
    add_rows1(acc, t, p0, v)
    for f in range(v, fs):
        uf = np.uint64(f)
        acc[uf] += t[p0 + uf]


@njit(**INLINE)
def zero(acc, fs):
    for f in range(fs):
        acc[np.uint64(f)] = 0


@njit(**INLINE)
def store(acc, out, o, fs):
    for f in range(fs):
        uf = np.uint64(f)
        out[o + uf] = acc[uf]


@njit(**INLINE)
def sum_bag(t, indices, start, end, acc, fs, specialised, nrows, bad, delta, limit):
    """acc = rows indices[start:end] summed in index order, row r read at ``at(r) + delta``
    (0, or a table's distance from the flat buffer ``t``: see ``gather_many``); rows are
    prefetched up to index position ``limit``.

    Rows are taken 8 (then 4, then 1) at a time: the element-wise order of additions is
    unchanged, but acc is loaded and stored once per group and 8 rows are in flight.
    With ``specialised`` the rows RAHEAD indices ahead are prefetched; the generic set
    (ensembles of one-row bags, rows wider than 512) measured faster without.

    Each group's largest index (as unsigned, so a negative one is huge) is held to ``nrows``
    before its rows are read: a group with an index out of range is skipped and ``bad[0]``
    set.  The kernel checks the indices as it reads them, instead of a pass of their own
    before it (``NO_BOUND``: checked already)."""
    zero(acc, fs)
    j = start
    while j < end:
        n = 8 if j + 8 <= end else (4 if j + 4 <= end else 1)
        if specialised:
            for q in range(j + RAHEAD, min(j + RAHEAD + n, limit)):
                prefetch_row(t, at(indices[q], fs) + delta, fs)
        if n == 8:
            i0, i1, i2, i3 = indices[j], indices[j + 1], indices[j + 2], indices[j + 3]
            i4, i5, i6, i7 = indices[j + 4], indices[j + 5], indices[j + 6], indices[j + 7]
            top = max(max(max(np.uint64(i0), np.uint64(i1)), max(np.uint64(i2), np.uint64(i3))),
                      max(max(np.uint64(i4), np.uint64(i5)), max(np.uint64(i6), np.uint64(i7))))
            if top < nrows:
                add8(acc, t, at(i0, fs) + delta, at(i1, fs) + delta, at(i2, fs) + delta,
                     at(i3, fs) + delta, at(i4, fs) + delta, at(i5, fs) + delta,
                     at(i6, fs) + delta, at(i7, fs) + delta, fs)
            else:
                bad[0] = 1
        elif n == 4:
            i0, i1, i2, i3 = indices[j], indices[j + 1], indices[j + 2], indices[j + 3]
            top = max(max(np.uint64(i0), np.uint64(i1)), max(np.uint64(i2), np.uint64(i3)))
            if top < nrows:
                add4(acc, t, at(i0, fs) + delta, at(i1, fs) + delta, at(i2, fs) + delta,
                     at(i3, fs) + delta, fs)
            else:
                bad[0] = 1
        elif np.uint64(indices[j]) < nrows:
            add1(acc, t, at(indices[j], fs) + delta, fs)
        else:
            bad[0] = 1
        j += n


@njit(**SERIAL)
def sum_bag_indirect(bflat, cflat, where, indices, start, end, acc, missed, fs, specialised):
    """Like sum_bag, row r read from cache[where[r]] when where[r] >= 0; specialised sets
    take 8 rows at a time and prefetch, the generic set one row at a time (measured faster
    there).  The order of additions is the same.  Returns how many of the rows were cached;
    ``missed[j] = 1`` marks each index j whose row is not (an empty ``missed``: none marked).

    A call, not inlined by numba: LLVM inlines it and folds the constants, and inlined by
    numba it doubled the compile time of the bag sums for no measured gain."""
    nidx = indices.shape[0]
    zero(acc, fs)
    hits = 0
    j = start
    while j < end:
        n = min(8, end - j) if specialised else 1
        if specialised:
            for q in range(j + 2 * RAHEAD, min(j + 2 * RAHEAD + n, nidx)):
                prefetch_far(where, np.uint64(indices[q]))
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
            hits += ncached
            if ncached == 8:
                add8(acc, cflat, p0, p1, p2, p3, p4, p5, p6, p7, fs)
            elif ncached == 0:
                add8(acc, bflat, p0, p1, p2, p3, p4, p5, p6, p7, fs)
            else:  # a mix: one 8-row add, each row from where it lives
                add8x(acc, cflat if c0 else bflat, cflat if c1 else bflat,
                      cflat if c2 else bflat, cflat if c3 else bflat, cflat if c4 else bflat,
                      cflat if c5 else bflat, cflat if c6 else bflat, cflat if c7 else bflat,
                      p0, p1, p2, p3, p4, p5, p6, p7, fs)
            if missed.shape[0] and ncached < 8:
                for q in range(j, j + 8):
                    if where[indices[q]] < 0:
                        missed[q] = 1
            j += 8
            continue
        for q in range(j, j + n):
            c, p = addr(where, indices[q], fs)
            if c:  # two calls rather than one on a selected array: that measured slower
                add1(acc, cflat, p, fs)
                hits += 1
            else:
                add1(acc, bflat, p, fs)
                if missed.shape[0]:
                    missed[q] = 1
        j += n
    return hits


@njit(**INLINE)
def translate(where, wd, indices, lo, hi, pos, missed, fs, delta, refs, rd, mark, nrows, bad):
    """pos[j] = flat start, counted from the base, of row indices[j] where it lives, for j in
    lo..hi; returns how many are cached. The positions j of the others go to missed[lo],
    missed[lo + 1], ... in index order (an empty ``missed``: none listed); an index out of
    range (as unsigned, against ``nrows``) sets ``bad[0]``, gets row 0's position and is neither
    counted nor listed. With ``mark``, ``refs`` (one byte per base row) gets 1 for every cached
    row read; a row already marked is not written again, so its cache line stays shared
    between the cores. Row r's ``where`` entry is ``where[wd + r]`` and its mark
    ``refs[rd + r]`` (uint64 sums, modulo 2**64: an ensemble reaches every table's arrays
    through the first table's, as the rows).

    A cache row's start is its start in the pool plus ``delta``, the pool's distance from
    the base in elements (modulo 2**64): the sums then read every row from one flat buffer,
    with no per-row choice between two. The first of the lookup's two passes: a loop without
    a branch, a prefetch or a negative index, which LLVM turns into vector gathers of
    ``where``; whether each index hit goes to a byte of ``kept`` (1 also for an index out of
    range), and the misses are listed from those bytes after it. On a Sapphire Rapids VM that
    took the translation of 327,680 indices from 0.66-1.18 to 0.36-0.66 ms (the prefetched
    scalar loop it replaces) and the listing adds 0.2 ms; a prefetch in the loop made it
    scalar again."""
    n = hi - lo
    if n <= 0:
        return 0
    if nrows == 0:                  # no row: every index is out of range, row 0 included
        bad[0] = 1
        for j in range(lo, hi):
            pos[j] = 0
        return 0
    kept = np.empty(n, dtype=np.uint8)
    hits = 0
    out = np.uint64(0)
    ulo = np.uint64(lo)
    ufs = np.uint64(fs)
    for j in range(ulo, np.uint64(hi)):
        ur = np.uint64(indices[j])
        ok = ur < nrows
        out |= np.uint64(not ok)
        ur = ur if ok else np.uint64(0)
        w = where[wd + ur]
        c = np.int64(ok) & np.int64(w >= 0)
        home = ur * ufs
        pos[j] = home + np.uint64(c) * (np.uint64(w) * ufs + delta - home)
        kept[j - ulo] = np.uint8(c + 1 - np.int64(ok))
        hits += c
    if out:
        bad[0] = 1
    if missed.shape[0] > 0 and hits < n:
        listed = lo
        for k in range(n):          # written always, kept only for a miss: no branch
            missed[listed] = lo + k
            listed += 1 - np.int64(kept[k])
    if mark:
        for j in range(lo, hi):
            if j + MAHEAD < hi:
                prefetch_far(refs, rd + np.uint64(indices[j + MAHEAD]))
            ur = np.uint64(indices[j])
            if ur < nrows and where[wd + ur] >= 0 and refs[rd + ur] == 0:
                refs[rd + ur] = 1
    return hits


@njit(**SERIAL)
def pack_missed(missed, indices, nidx, per_item, hits):
    """Move the items' lists of missed positions (item k's at missed[k * per_item], hits[k]
    of its indices cached) together at the front of ``missed`` as the rows at those
    positions; returns how many there are."""
    n = 0
    for k in range(hits.shape[0]):
        lo = k * per_item
        count = min(per_item, nidx - lo) - hits[k]
        for q in range(count):
            missed[n + q] = indices[missed[lo + q]]
        n += count
    return n


@njit(**SERIAL)
def pack_positions(missed, nidx, per_item, hits):
    """``pack_missed`` that keeps the positions."""
    n = 0
    for k in range(hits.shape[0]):
        lo = k * per_item
        count = min(per_item, nidx - lo) - hits[k]
        if lo != n:
            for q in range(count):
                missed[n + q] = missed[lo + q]
        n += count
    return n


@njit(**SERIAL)
def first_misses(where, indices, missed, n, rows, kof):
    """Number the rows of ``missed`` (n positions of uncached rows, in index order) in
    first-seen order: the k-th row goes to rows[k] and is marked with ``where[r] = -2 - k``
    (``place_misses`` restores every mark); kof[q] = the number of missed[q]'s row. Returns
    how many rows. The entries are prefetched for writing SCAN_AHEAD positions ahead."""
    nu = 0
    for q in range(n):
        if q + SCAN_AHEAD < n:
            prefetch_write(where, np.uint64(indices[missed[q + SCAN_AHEAD]]))
        r = indices[missed[q]]
        w = where[r]
        if w == -1:
            where[r] = -2 - nu
            rows[nu] = r
            kof[q] = nu
            nu += 1
        else:
            kof[q] = -2 - w
    return nu


@njit(**INLINE)
def place_misses(bflat, cflat, where, backedge, rows, lo, hi, slots, fs):
    """Copy rows[k] into slot slots[k] and point the row at it, for k in lo..hi below
    len(slots); the rows beyond stay in the base (``where`` -1).  Flat unsigned offsets (a
    loop LLVM vectorises) and the source rows prefetched PLACE_AHEAD ahead: the rows are
    random reads of the base, 3-4x faster than 2-D indexing."""
    nslots = slots.shape[0]
    for k in range(lo, hi):
        r = rows[k]
        if k < nslots:
            if k + PLACE_AHEAD < min(hi, nslots):
                prefetch_row(bflat, at(rows[k + PLACE_AHEAD], fs), fs)
            s = slots[k]
            src = at(r, fs)
            dst = at(s, fs)
            for f in range(fs):
                uf = np.uint64(f)
                cflat[dst + uf] = bflat[src + uf]
            backedge[s] = r
            where[r] = s
        else:
            where[r] = -1


@njit(**INLINE)
def point_misses(pos, missed, kof, lo, hi, slots, delta, fs):
    """pos[missed[q]] = the position of its row's new slot (see ``translate``), for q in
    lo..hi whose row got one."""
    nslots = slots.shape[0]
    for q in range(lo, hi):
        k = kof[q]
        if k < nslots:
            pos[missed[q]] = at(slots[k], fs) + delta


@njit(**INLINE)
def sum_bag_flat(t, pos, start, end, limit, acc, fs, specialised):
    """sum_bag over translated positions (see ``translate``), 8 rows at a time; the same
    order of additions. The rows are prefetched up to position ``limit``."""
    zero(acc, fs)
    j = start
    while j < end:
        n = 8 if j + 8 <= end else 1
        if specialised:
            for q in range(j + RAHEAD, min(j + RAHEAD + n, limit)):
                prefetch_row(t, pos[q], fs)
        if n == 8:
            add8(acc, t, pos[j], pos[j + 1], pos[j + 2], pos[j + 3], pos[j + 4], pos[j + 5],
                 pos[j + 6], pos[j + 7], fs)
        else:
            add1(acc, t, pos[j], fs)
        j += n


@njit(**INLINE)
def bag_range(offsets, obase, oend, ibase, iend, b):
    """(start, end) of bag b of a table whose offsets are ``offsets[obase:oend]`` and
    indices positions ``ibase:iend`` of a concatenation (the whole arrays: 0, len, 0, len)."""
    start = ibase + offsets[obase + b]
    end = ibase + offsets[obase + b + 1] if obase + b + 1 < oend else iend
    return start, end


@njit(**INLINE)
def bag_sums_flat(t, pos, offsets, obase, oend, ibase, iend, lo, hi, out, ostride, ocol, acc,
                  fs, specialised):
    """bag_sums over translated positions, of a table whose offsets and positions lie in
    concatenations (see ``bag_range``): a kernel that slices its arrays inside a parallel
    loop loses numba's no-alias promise for that loop, and with it LLVM's vector gathers in
    ``translate``."""
    for b in range(lo, hi):
        start, end = bag_range(offsets, obase, oend, ibase, iend, b)
        sum_bag_flat(t, pos, start, end, iend, acc, fs, specialised)
        store(acc, out, np.uint64(b * ostride + ocol), fs)


@njit(**INLINE)
def chunk_indices(offsets, obase, oend, ibase, iend, lo, hi, unit):
    """Index positions (first, end) of bags lo..hi (see ``bag_range``); with ``unit`` bag b
    is index ``ibase + b``."""
    if unit:
        return ibase + lo, ibase + hi
    return (bag_range(offsets, obase, oend, ibase, iend, lo)[0],
            bag_range(offsets, obase, oend, ibase, iend, hi - 1)[1])


@njit(**INLINE)
def gather_rows(t, pos, lo, hi, out, o, ostride, fs, specialised):
    """out rows from flat start ``o`` on, one every ``ostride`` elements = the rows at
    pos[lo:hi] (bags of one index: a copy, the same value as their sum)."""
    for j in range(lo, hi):
        if specialised and j + RAHEAD < hi:
            prefetch_row(t, pos[j + RAHEAD], fs)
        p = pos[j]
        for f in range(fs):
            uf = np.uint64(f)
            out[o + uf] = t[p + uf]
        o += np.uint64(ostride)


@njit(**INLINE)
def bag_sums(bflat, cflat, where, indices, offsets, lo, hi, out, ostride, ocol, acc, missed, fs,
             specialised, nrows, bad):
    """out rows lo..hi (at column ocol of a row-strided flat buffer) = those bags' sums.
    Returns how many indices were served from the cache (0 for a plain table).  A plain
    table's indices are held to ``nrows`` (see ``sum_bag``); an indirect table's must be
    valid.  A bag whose offsets are out of order or past the indices is left empty and
    ``bad[0]`` set to 2, so offsets nobody checked never lead a read astray."""
    nidx = indices.shape[0]
    hits = 0
    for b in range(lo, hi):
        start, end = bag_bounds(offsets, b, nidx)
        if start < 0 or start > end or end > nidx:
            bad[0] = 2
            zero(acc, fs)
        elif where is None:
            sum_bag(bflat, indices, start, end, acc, fs, specialised, nrows, bad, ZERO, nidx)
        else:
            hits += sum_bag_indirect(bflat, cflat, where, indices, start, end, acc, missed, fs,
                                     specialised)
        store(acc, out, np.uint64(b * ostride + ocol), fs)
    return hits


@njit(**INLINE)
def sum_grad(dout, gstride, gcol, occ, lo, hi, acc, fs):
    """acc = sum of gradient rows occ[lo:hi] (a row-strided flat buffer), in order."""
    zero(acc, fs)
    for k in range(lo, hi):
        add1(acc, dout, np.uint64(occ[k] * gstride + gcol), fs)


@njit(**INLINE)
def sgd_row(flat, p, lr, dout, gstride, gcol, occ, lo, hi, acc, fs):
    """flat[p:p+fs] -= lr * (sum of gradient rows occ[lo:hi]): one read-modify-write of a row.

    A row used once (the common case for large tables) skips the accumulator; the result is
    identical because 0 + g == g."""
    if hi - lo == 1:
        g = np.uint64(occ[lo] * gstride + gcol)
        for f in range(fs):
            uf = np.uint64(f)
            flat[p + uf] -= lr * dout[g + uf]
    else:
        sum_grad(dout, gstride, gcol, occ, lo, hi, acc, fs)
        for f in range(fs):
            uf = np.uint64(f)
            flat[p + uf] -= lr * acc[uf]


@njit(**INLINE)
def sgd_rows(bflat, cflat, where, rows, bounds, occ, lo, hi, dout, gstride, gcol, lr, acc, fs):
    """SGD of unique rows lo..hi (group u's occurrences are occ[bounds[u+1]:bounds[u+2]]),
    prefetching (with write intent) the row AHEAD positions on."""
    for u in range(lo, hi):
        if where is not None and u + UWAHEAD < hi:
            prefetch_far(where, np.uint64(rows[u + UWAHEAD]))
        if u + AHEAD < hi:
            flat, q = locate(bflat, cflat, where, rows[u + AHEAD], fs)
            prefetch_row_write(flat, q, fs)
        flat, p = locate(bflat, cflat, where, rows[u], fs)
        sgd_row(flat, p, lr, dout, gstride, gcol, occ, bounds[u + 1], bounds[u + 2], acc, fs)


@njit(**INLINE)
def sgd_rows_flat(t, where, rows, bounds, occ, lo, hi, dout, gstride, gcol, lr, acc, fs, delta,
                  dirty, origin, wd, dd):
    """sgd_rows through one flat buffer ``t``. With ``where``, an indirect table whose base
    starts ``origin`` elements from t: a cached row's start is its start in the pool plus
    ``delta`` (see ``translate``), each written pool slot is marked in ``dirty`` (an empty
    ``dirty``: none; its byte is prefetched for writing with the row), and the result is how
    many of the rows were cached; row r's ``where`` entry is ``where[wd + r]`` and slot s's
    mark ``dirty[dd + s]`` (uint64 sums, modulo 2**64: an ensemble reaches every table's
    through the first one's). With ``where=None``, a plain table ``delta`` elements from t
    (see ``gather_many``); the result is 0."""
    hits = 0
    mark = dirty.shape[0] > 0
    for u in range(lo, hi):
        if where is not None and u + UWAHEAD < hi:
            prefetch_far(where, wd + np.uint64(rows[u + UWAHEAD]))
        if u + AHEAD < hi:
            r = rows[u + AHEAD]
            if where is None:
                q = at(r, fs) + delta
            else:
                w = where[wd + np.uint64(r)]
                q = origin + (at(w, fs) + delta if w >= 0 else at(r, fs))
                if mark and w >= 0:
                    prefetch_write(dirty, dd + np.uint64(w))
            prefetch_row_write(t, q, fs)
        r = rows[u]
        if where is None:
            p = at(r, fs) + delta
        else:
            w = where[wd + np.uint64(r)]
            if w >= 0:
                p = origin + at(w, fs) + delta
                if mark:
                    dirty[dd + np.uint64(w)] = 1
                hits += 1
            else:
                p = origin + at(r, fs)
        sgd_row(t, p, lr, dout, gstride, gcol, occ, bounds[u + 1], bounds[u + 2], acc, fs)
    return hits


@njit(**INLINE)
def accumulate_dense(tabs, indices, offsets, obase, idx_base, nbags, dout, gstride, cols, fss,
                     dslot, sbase, gacc, gbase, rows, nus):
    """Re-index and sum the gradients of the small tables ``tabs`` in one pass over the bags.

    For every table t of ``tabs``: ``rows`` (from ``idx_base[t]``) gets its unique rows in
    first-seen order, ``nus[t]`` their count, and ``gacc`` (from ``gbase[t]``, ``fss[t]`` values
    per unique row) the sum of each row's gradients in occurrence order, from zero: the order
    ``sum_grad`` adds them in. Bags go in order, each bag's rows of every table together, so
    the gradient is read row after row, not one strided column block per table. ``dslot``
    (from ``sbase[t]``, one int32 per table row) maps a row to 1 + its unique id; it must be
    zero on entry and is zero again on exit."""
    for b in range(nbags):
        for k in range(tabs.shape[0]):
            t = tabs[k]
            lo = idx_base[t]
            nidx = idx_base[t + 1] - lo
            start, end = bag_bounds(offsets[obase[t]:obase[t + 1]], b, nidx)
            fs = fss[t]
            g = np.uint64(b * gstride + cols[t])
            for j in range(lo + start, lo + end):
                r = indices[j]
                q = sbase[t] + r
                u = dslot[q]
                if u == 0:
                    u = nus[t] + 1
                    nus[t] = u
                    dslot[q] = u
                    rows[lo + u - 1] = r
                add1(gacc[gbase[t] + (u - 1) * fs:], dout, g, fs)
    for k in range(tabs.shape[0]):
        t = tabs[k]
        lo = idx_base[t]
        for u in range(nus[t]):
            dslot[sbase[t] + rows[lo + u]] = 0


@njit(**INLINE)
def reindex_tables(indices, offsets, obase, nbags, slots, nworkers, idx_base, dense, dout,
                   gstride, cols, fss):
    """Re-index every table of an ensemble (worker w takes tables w, w + nworkers, ...; one
    scratch row of ``slots`` each). The tables' indices and offsets are concatenated: table
    t's from ``idx_base[t]`` and ``obase[t]``. Tables with ``dense[t]`` set (small ones) are
    re-indexed by ``accumulate_dense`` instead, which also sums their gradients into the
    returned ``gacc`` (from ``gbase[t]``); ``dense[t]`` is then the table's row count, else 0.
    Returns (rows, bounds, occ, unique-row counts, the most work items of one table, gacc,
    gbase)."""
    ntables = idx_base.shape[0] - 1
    total = idx_base[ntables]
    rows = np.empty(total, dtype=np.int64)
    occ = np.empty(total, dtype=np.int64)
    bounds = np.empty(total + 2 * ntables, dtype=np.int64)
    nus = np.zeros(ntables, dtype=np.int64)
    sbase = np.zeros(ntables + 1, dtype=np.int64)
    gbase = np.zeros(ntables + 1, dtype=np.int64)
    for t in range(ntables):
        nu_max = min(dense[t], idx_base[t + 1] - idx_base[t])     # unique rows, at most
        sbase[t + 1] = sbase[t] + dense[t]
        gbase[t + 1] = gbase[t] + nu_max * fss[t]
    dslot = np.zeros(sbase[ntables], dtype=np.int32)
    gacc = np.zeros(gbase[ntables], dtype=dout.dtype)
    for w in prange(nworkers):
        ndense = 0
        for t in range(w, ntables, nworkers):
            if dense[t]:
                ndense += 1
        tabs = np.empty(ndense, dtype=np.int64)
        ndense = 0
        for t in range(w, ntables, nworkers):
            if dense[t]:
                tabs[ndense] = t
                ndense += 1
            else:
                lo = idx_base[t]
                hi = idx_base[t + 1]
                nus[t] = reindex(indices[lo:hi], offsets[obase[t]:obase[t + 1]], nbags,
                                 slots[w], rows[lo:hi], bounds[lo + 2 * t:hi + 2 * t + 2],
                                 occ[lo:hi])
        if ndense:
            accumulate_dense(tabs, indices, offsets, obase, idx_base, nbags, dout, gstride, cols,
                             fss, dslot, sbase, gacc, gbase, rows, nus)
    maxitems = 0
    for t in range(ntables):
        maxitems = max(maxitems, (nus[t] + RPI - 1) // RPI)
    return rows, bounds, occ, nus, maxitems, gacc, gbase


@njit(**INLINE)
def sgd_dense(flat, rows, lo, hi, gacc, g0, lr, fs, delta):
    """flat[row start + delta:...] -= lr * gacc[g0 + u * fs:...] for the unique rows lo..hi of a
    table ``accumulate_dense`` summed: the update ``sgd_row`` makes from the same sums."""
    for u in range(lo, hi):
        p = at(rows[u], fs) + delta
        a = np.uint64(g0 + u * fs)
        for f in range(fs):
            uf = np.uint64(f)
            flat[p + uf] -= lr * gacc[a + uf]


# ---- the kernels ----------------------------------------------------------------------------


def make_kernels(FS):
    """Every parallel kernel for feature size ``FS`` (0: generic), by name.

    Each kernel compiles (or loads from numba's cache) on its first call with a new signature,
    so only the kernels in use are built."""
    FS = int(FS)
    if FS < 0:
        raise ValueError(f"feature size must be >= 0 (0: generic), got {FS}")
    SPECIALISED = FS > 0

    @njit(**PARALLEL)
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
                for f in range(fs):
                    uf = np.uint64(f)
                    out[o + uf] = tflat[p + uf]

    @njit(**PARALLEL)
    def gather_many(base, deltas, widths, indices, nbags, out, ostride, cols, chunk):
        """Bags of one index in every table: out row b, table t's columns = table t's row
        ``indices[t * nbags + b]``. Table t starts ``deltas[t]`` elements from ``base``
        (modulo 2**64), read through base's flat buffer; work items are (table, bag chunk)
        pairs with a table's chunks in a row, so each item streams through one table."""
        ntables = deltas.shape[0]
        bflat = base.reshape(-1)
        nchunks = (nbags + chunk - 1) // chunk
        for it in prange(nchunks * ntables):
            t = it // nchunks
            lo, hi = span(it - t * nchunks, chunk, nbags)
            fs = FS or widths[t]
            d = deltas[t]
            first = t * nbags
            col = cols[t]
            for b in range(lo, hi):
                if SPECIALISED and b + RAHEAD < hi:
                    prefetch_row(bflat, d + at(indices[first + b + RAHEAD], fs), fs)
                p = d + at(indices[first + b], fs)
                o = np.uint64(b * ostride + col)
                for f in range(fs):
                    uf = np.uint64(f)
                    out[o + uf] = bflat[p + uf]

    @njit(**PARALLEL)
    def bag_sum(base, cache, where, indices, offsets, nbags, out, ostride, ocol, missed, nrows,
                bad):
        """Bag sums into a row-strided flat ``out``; ``(table, table, None)`` for a plain table.
        Returns how many indices were served from the cache; ``missed`` (empty, or one uint8
        per index) gets 1 for every index whose row is not cached.  A plain table's indices
        are held to ``nrows`` as they are read (``bad[0] = 1`` if one is out of range), and
        the offsets to their rules (``bad[0] = 2``: see ``offsets_flagged``)."""
        fs = FS or base.shape[1]
        bflat = base.reshape(-1)
        cflat = cache.reshape(-1)
        served = 0
        if offsets_flagged(offsets, nbags, indices.shape[0], bad):
            return 0
        for it in prange((nbags + BPI - 1) // BPI):
            acc = np.empty(fs, dtype=base.dtype)
            lo, hi = span(it, BPI, nbags)
            served += bag_sums(bflat, cflat, where, indices, offsets, lo, hi, out, ostride, ocol,
                               acc, missed, fs, SPECIALISED, nrows, bad)
        return served

    @njit(**PARALLEL)
    def bag_sum_cached(base, where, indices, offsets, nbags, out, ostride, ocol, missed, delta,
                       pos, refs, nrows, bad):
        """``bag_sum`` of an indirect table in two passes: translate every index to where its
        row lives (independent iterations, so many ``where`` misses are in flight at once),
        then sum over the translated positions, reading the pool ``delta`` elements from the
        base through the base's flat buffer.  Same sums, same order of additions.  ``pos``
        (uint64, one per index) is the caller's scratch for the positions; ``refs`` (see
        ``translate``) marks the cached rows read; indices out of range (against ``nrows``)
        set ``bad[0]``.  Returns (cached indices, missed rows listed at the front of
        ``missed``)."""
        fs = FS or base.shape[1]
        bflat = base.reshape(-1)
        nidx = indices.shape[0]
        nitems = (nidx + IPI - 1) // IPI
        cached = np.empty(nitems, dtype=np.int64)  # per item: no parfor reduction
        for it in prange(nitems):
            lo, hi = span(it, IPI, nidx)
            cached[it] = translate(where, ZERO, indices, lo, hi, pos, missed, fs, delta, refs,
                                   ZERO, refs.shape[0] > 0, nrows, bad)
        for it in prange((nbags + BPI - 1) // BPI):
            acc = np.empty(fs, dtype=base.dtype)
            lo, hi = span(it, BPI, nbags)
            bag_sums_flat(bflat, pos, offsets, 0, offsets.shape[0], 0, pos.shape[0], lo, hi, out,
                          ostride, ocol, acc, fs, SPECIALISED)
        nmissed = pack_missed(missed, indices, nidx, IPI, cached) if missed.shape[0] else 0
        return cached.sum(), nmissed

    @njit(**PARALLEL)
    def translate_cached(base, where, indices, missed, delta, pos, refs, nrows, bad, rows,
                         kof):
        """The first pass of a lookup that caches the rows it misses: ``bag_sum_cached``'s
        translation, then (no index out of range) the positions of the missed indices at the
        front of ``missed`` and their rows numbered (``first_misses``). Returns (cached
        indices, missed indices, missed rows)."""
        fs = FS or base.shape[1]
        nidx = indices.shape[0]
        nitems = (nidx + IPI - 1) // IPI
        cached = np.empty(nitems, dtype=np.int64)
        for it in prange(nitems):
            lo, hi = span(it, IPI, nidx)
            cached[it] = translate(where, ZERO, indices, lo, hi, pos, missed, fs, delta, refs,
                                   ZERO, refs.shape[0] > 0, nrows, bad)
        if bad[0]:
            return cached.sum(), 0, 0
        n = pack_positions(missed, nidx, IPI, cached)
        return cached.sum(), n, first_misses(where, indices, missed, n, rows, kof)

    @njit(**PARALLEL)
    def bag_sum_placed(base, cache, where, backedge, offsets, nbags, out, ostride, ocol, pos,
                       delta, missed, kof, nmissed, rows, nrows, slots):
        """The second pass of that lookup: the missed rows copied into their slots
        (``place_misses``) and the positions of their indices pointed there
        (``point_misses``), then ``bag_sum_cached``'s sums over ``pos``: same sums, same
        order of additions, every cached row read from the pool."""
        fs = FS or base.shape[1]
        bflat = base.reshape(-1)
        cflat = cache.reshape(-1)
        nitems = max(1, (nrows + PPI - 1) // PPI)
        for it in prange(nitems):       # item it: its share of the rows and of the indices
            place_misses(bflat, cflat, where, backedge, rows, it * nrows // nitems,
                         (it + 1) * nrows // nitems, slots, fs)
            point_misses(pos, missed, kof, it * nmissed // nitems,
                         (it + 1) * nmissed // nitems, slots, delta, fs)
        for it in prange((nbags + BPI - 1) // BPI):
            acc = np.empty(fs, dtype=base.dtype)
            lo, hi = span(it, BPI, nbags)
            bag_sums_flat(bflat, pos, offsets, 0, offsets.shape[0], 0, pos.shape[0], lo, hi, out,
                          ostride, ocol, acc, fs, SPECIALISED)

    @njit(**PARALLEL)
    def bag_sum_cached_many(ref, where, wds, nrows, icat, ib, ocat, ob, nbags, out, ostride,
                            cols, origins, deltas, mcat, listed, poss, refs, rds, marks, bad,
                            chunk, nmissed, unit):
        """``bag_sum_cached`` of an ensemble of indirect tables of one feature size, every
        row read through ``ref``'s flat buffer: table t's base starts ``origins[t]``
        elements from ref's start, its pool ``deltas[t]`` elements from its base (modulo
        2**64). Table t's indices are ``icat[ib[t]:ib[t + 1]]`` and its offsets
        ``ocat[ob[t]:ob[t + 1]]`` (one array each for every table: typed lists of them cost
        more to build than a small lookup). Work items are (bag chunk, table) pairs: each
        translates the indices of its bags into ``poss`` (laid out as ``icat``), then sums
        those bags, so one parallel region serves every table. Same sums, same order of
        additions as ``bag_sum_cached``. Returns each table's cached indices; for a table with
        ``listed[t]``, ``nmissed[t]`` gets how many of its missed rows are listed, in index
        order, at the front of ``mcat[ib[t]:ib[t + 1]]``. Table t's ``where`` (``nrows[t]``
        entries) lies ``wds[t]`` elements from ``where``'s start and, where ``marks[t]``, its
        marks of the cached rows read (see ``translate``) ``rds[t]`` from ``refs``'s; an index
        out of its table's range sets ``bad[0]``. With ``unit`` every bag holds one index
        (bag b of table t is index ``ib[t] + b``; ``ocat`` is not read): its row is copied,
        not summed (DLRM's lookups: 30-40% less time on 26 tables of 8192 such bags)."""
        fs = FS or ref.shape[1]
        rflat = ref.reshape(-1)
        ntables = nrows.shape[0]
        nchunks = (nbags + chunk - 1) // chunk
        cached = np.empty(nchunks * ntables, dtype=np.int64)   # per item: no reduction
        for it in prange(nchunks * ntables):
            c = it // ntables
            t = it - c * ntables      # tables vary fastest: each thread gets a mix of them
            lo, hi = span(c, chunk, nbags)
            i0, i1, o0, o1 = ib[t], ib[t + 1], ob[t], ob[t + 1]
            ilo, ihi = chunk_indices(ocat, o0, o1, i0, i1, lo, hi, unit)
            # whole arrays and positions in them, no slices (see bag_sums_flat); every table
            # lists its misses when one is listed (the others' lists are not read)
            cached[it] = translate(where, wds[t], icat, ilo, ihi, poss, mcat, fs, deltas[t],
                                   refs, rds[t], marks[t] != 0, np.uint64(nrows[t]), bad)
            origin = origins[t]
            for j in range(ilo, ihi):
                poss[j] += origin
            if unit:
                gather_rows(rflat, poss, ilo, ihi, out, np.uint64(lo * ostride + cols[t]),
                            ostride, fs, SPECIALISED)
            else:
                acc = np.empty(fs, dtype=ref.dtype)
                bag_sums_flat(rflat, poss, ocat, o0, o1, i0, i1, lo, hi, out, ostride, cols[t],
                              acc, fs, SPECIALISED)
        hits = np.zeros(ntables, dtype=np.int64)
        for t in range(ntables):
            i0, i1, o0, o1 = ib[t], ib[t + 1], ob[t], ob[t + 1]
            n = 0
            for c in range(nchunks):
                lo, hi = span(c, chunk, nbags)
                ilo, ihi = chunk_indices(ocat, o0, o1, i0, i1, lo, hi, unit)
                got = cached[c * ntables + t]
                hits[t] += got
                if listed[t]:
                    count = ihi - ilo - got
                    for q in range(count):
                        mcat[i0 + n + q] = icat[mcat[ilo + q]]
                    n += count
            nmissed[t] = n
        return hits

    @njit(**PARALLEL)
    def bag_sum_many(tables, indices, offsets, nbags, out, ostride, cols, chunk):
        """All tables into one concatenated output; work items are (bag chunk, table) pairs."""
        ntables = len(tables)
        nchunks = (nbags + chunk - 1) // chunk
        unused = np.zeros(1, dtype=np.uint8)  # the indices were checked: nothing sets it
        for it in prange(nchunks * ntables):
            c = it // ntables
            t = it - c * ntables  # tables vary fastest so each thread gets a mix of tables
            fs = FS or tables[t].shape[1]
            tflat = tables[t].reshape(-1)
            acc = np.empty(fs, dtype=tflat.dtype)
            lo, hi = span(c, chunk, nbags)
            bag_sums(tflat, tflat, None, indices[t], offsets[t], lo, hi, out, ostride, cols[t],
                     acc, None, fs, SPECIALISED, NO_BOUND, unused)

    @njit(**PARALLEL)
    def bag_sum_many_flat(base, deltas, widths, icat, ib, ocat, ob, nbags, out, ostride, cols,
                          chunk):
        """``bag_sum_many`` with table t read ``deltas[t]`` elements from ``base`` through
        base's flat buffer (see ``gather_many``) and its indices and offsets at
        ``icat[ib[t]:ib[t + 1]]`` and ``ocat[ob[t]:ob[t + 1]]``, indexed in place (see
        ``bag_sums_flat``): no typed lists, whose helpers numba compiled again in every
        process (1.4-1.8 s before the first lookup) and which took 0.6 ms to build for 8
        small tables. Checked indices and offsets; the same sums in the same order."""
        ntables = deltas.shape[0]
        bflat = base.reshape(-1)
        nchunks = (nbags + chunk - 1) // chunk
        unused = np.zeros(1, dtype=np.uint8)  # the indices were checked: nothing sets it
        for it in prange(nchunks * ntables):
            c = it // ntables
            t = it - c * ntables  # tables vary fastest so each thread gets a mix of tables
            fs = FS or widths[t]
            acc = np.empty(fs, dtype=bflat.dtype)
            lo, hi = span(c, chunk, nbags)
            i0, i1, o0, o1 = ib[t], ib[t + 1], ob[t], ob[t + 1]
            d = deltas[t]
            col = cols[t]
            for b in range(lo, hi):
                start, end = bag_range(ocat, o0, o1, i0, i1, b)
                sum_bag(bflat, icat, start, end, acc, fs, SPECIALISED, NO_BOUND, unused, d, i1)
                store(acc, out, np.uint64(b * ostride + col), fs)

    @njit(**PARALLEL)
    def apply_sgd(base, cache, where, rows, bounds, occ, nu, dout, gstride, gcol, lr):
        """SGD of the re-indexed unique rows; ``(table, table, None)`` for a plain table."""
        fs = FS or base.shape[1]
        bflat = base.reshape(-1)
        cflat = cache.reshape(-1)
        for it in prange((nu + RPI - 1) // RPI):
            acc = np.empty(fs, dtype=base.dtype)
            lo, hi = span(it, RPI, nu)
            sgd_rows(bflat, cflat, where, rows, bounds, occ, lo, hi, dout, gstride, gcol, lr,
                     acc, fs)

    @njit(**PARALLEL)
    def apply_sgd_cached(base, where, rows, bounds, occ, nu, dout, gstride, gcol, lr, delta,
                         dirty):
        """apply_sgd of an indirect table, the pool read and written ``delta`` elements from
        the base through the base's flat buffer; marks the written slots in ``dirty`` and
        returns how many of the rows were cached."""
        fs = FS or base.shape[1]
        bflat = base.reshape(-1)
        nitems = (nu + RPI - 1) // RPI
        hits = np.empty(nitems, dtype=np.int64)  # per item: no parfor reduction
        for it in prange(nitems):
            acc = np.empty(fs, dtype=base.dtype)
            lo, hi = span(it, RPI, nu)
            hits[it] = sgd_rows_flat(bflat, where, rows, bounds, occ, lo, hi, dout, gstride,
                                     gcol, lr, acc, fs, delta, dirty, ZERO, ZERO, ZERO)
        return hits.sum()

    @njit(**PARALLEL)
    def grad(rows, bounds, occ, nu, dout, gstride, gcol, grads):
        """grads[u] = the summed gradient of unique row u."""
        fs = FS or grads.shape[1]
        for it in prange((nu + RPI - 1) // RPI):
            lo, hi = span(it, RPI, nu)
            for u in range(lo, hi):
                sum_grad(dout, gstride, gcol, occ, bounds[u + 1], bounds[u + 2], grads[u], fs)

    @njit(**PARALLEL)
    def update_many(tables, indices, offsets, obase, nbags, dout, gstride, cols, lr, slots,
                    nworkers, idx_base, dense, fss):
        """Re-index every table (``reindex_tables``), then apply SGD over flattened (row chunk,
        table) items. Returns the unique-row counts and the concatenated unique rows."""
        ntables = len(tables)
        rows, bounds, occ, nus, maxitems, gacc, gbase = reindex_tables(
            indices, offsets, obase, nbags, slots, nworkers, idx_base, dense, dout, gstride, cols,
            fss)
        for it in prange(maxitems * ntables):
            c = it // ntables
            t = it - c * ntables
            nu = nus[t]
            if c * RPI < nu:
                fs = FS or tables[t].shape[1]
                tflat = tables[t].reshape(-1)
                lo, hi = span(c, RPI, nu)
                base = idx_base[t]
                end = idx_base[t + 1]
                if dense[t]:
                    sgd_dense(tflat, rows[base:base + nu], lo, hi, gacc, gbase[t], lr, fs,
                              np.uint64(0))
                else:
                    acc = np.empty(fs, dtype=tflat.dtype)
                    sgd_rows(tflat, tflat, None, rows[base:base + nu],
                             bounds[base + 2 * t:end + 2 * t + 2], occ[base:end], lo, hi, dout,
                             gstride, cols[t], lr, acc, fs)
        return nus, rows

    @njit(**PARALLEL)
    def apply_sgd_cached_many(ref, origins, where, wds, indices, offsets, obase, idx_base,
                              nbags, dout, gstride, cols, lr, deltas, dirty, dds, marks, slots,
                              nworkers, rows, nus, hits):
        """``apply_sgd_cached`` of an ensemble of indirect tables of one feature size, each
        re-indexed first (``reindex``): worker w takes tables w, w + nworkers, ... with its
        row of ``slots``, so one parallel region serves every table. Table t's indices and
        offsets are concatenated from ``idx_base[t]`` and ``obase[t]``, its unique rows land
        in ``rows`` from ``idx_base[t]`` (``nus[t]`` of them), its base lies ``origins[t]``
        elements from ``ref``'s start and its pool ``deltas[t]`` from its base, its ``where``
        ``wds[t]`` from ``where``'s, and (where ``marks[t]``) its dirty marks ``dds[t]`` from
        ``dirty``'s; ``hits[t]`` gets how many of its unique rows were cached. Every array is
        reached through the first table's, as typed lists of them cost more to build than a
        small update. Same sums as one table at a time."""
        ntables = origins.shape[0]
        fs = FS or ref.shape[1]
        rflat = ref.reshape(-1)
        total = idx_base[ntables]
        occ = np.empty(total, dtype=np.int64)
        bounds = np.empty(total + 2 * ntables, dtype=np.int64)
        for w in prange(nworkers):
            for t in range(w, ntables, nworkers):
                acc = np.empty(fs, dtype=ref.dtype)
                lo = idx_base[t]
                hi = idx_base[t + 1]
                b = bounds[lo + 2 * t:hi + 2 * t + 2]
                nu = reindex(indices[lo:hi], offsets[obase[t]:obase[t + 1]], nbags, slots[w],
                             rows[lo:hi], b, occ[lo:hi])
                nus[t] = nu
                d = dirty if marks[t] else dirty[:0]
                hits[t] = sgd_rows_flat(rflat, where, rows[lo:hi], b, occ[lo:hi], 0, nu, dout,
                                        gstride, cols[t], lr, acc, fs, deltas[t], d,
                                        origins[t], wds[t], dds[t])

    @njit(**PARALLEL)
    def update_many_flat(base, deltas, widths, indices, offsets, obase, nbags, dout, gstride,
                         cols, lr, slots, nworkers, idx_base, dirty, dense):
        """``update_many`` with table t read and written ``deltas[t]`` elements from ``base``
        through base's flat buffer (see ``gather_many``); ``dirty`` is an empty array."""
        ntables = deltas.shape[0]
        rows, bounds, occ, nus, maxitems, gacc, gbase = reindex_tables(
            indices, offsets, obase, nbags, slots, nworkers, idx_base, dense, dout, gstride, cols,
            widths)
        bflat = base.reshape(-1)
        for it in prange(maxitems * ntables):
            c = it // ntables
            t = it - c * ntables
            nu = nus[t]
            if c * RPI < nu:
                fs = FS or widths[t]
                lo, hi = span(c, RPI, nu)
                first = idx_base[t]
                end = idx_base[t + 1]
                if dense[t]:
                    sgd_dense(bflat, rows[first:first + nu], lo, hi, gacc, gbase[t], lr, fs,
                              np.uint64(deltas[t]))
                else:
                    acc = np.empty(fs, dtype=bflat.dtype)
                    sgd_rows_flat(bflat, None, rows[first:first + nu],
                                  bounds[first + 2 * t:end + 2 * t + 2], occ[first:end], lo, hi,
                                  dout, gstride, cols[t], lr, acc, fs, deltas[t], dirty, ZERO,
                                  ZERO, ZERO)
        return nus, rows

    return dict(gather=gather, gather_many=gather_many, bag_sum=bag_sum,
                bag_sum_cached=bag_sum_cached, bag_sum_cached_many=bag_sum_cached_many,
                translate_cached=translate_cached, bag_sum_placed=bag_sum_placed,
                apply_sgd_cached_many=apply_sgd_cached_many,
                bag_sum_many=bag_sum_many, bag_sum_many_flat=bag_sum_many_flat,
                apply_sgd=apply_sgd,
                apply_sgd_cached=apply_sgd_cached, grad=grad, update_many=update_many,
                update_many_flat=update_many_flat)
