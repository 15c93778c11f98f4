"""Embedding kernels against plain NumPy (and PyTorch when it is installed); how they are
built (once per feature size, nothing written outside the package, no import cycles)."""

import ast
import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachedarrays.layout import readonly_view
from cachedarrays.models.dlrm import kernels as K
from helpers import run_threads


def make_bags(rng, nbags, nrows, lmax, allow_empty=True):
    lengths = rng.integers(0 if allow_empty else 1, lmax + 1, nbags)
    offsets = np.zeros(nbags, dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    indices = rng.integers(0, nrows, int(lengths.sum()))
    return indices, offsets


def bag_ids(offsets, nidx):
    ends = np.append(offsets[1:], nidx)
    return np.repeat(np.arange(len(offsets)), ends - offsets)


def ref_bag_sum(table, indices, offsets):
    out = np.zeros((len(offsets), table.shape[1]), dtype=table.dtype)
    np.add.at(out, bag_ids(offsets, len(indices)), table[indices])
    return out


def ref_dense_grad(nrows, indices, offsets, dout):
    grad = np.zeros((nrows, dout.shape[1]), dtype=np.float64)
    np.add.at(grad, indices, dout[bag_ids(offsets, len(indices))].astype(np.float64))
    return grad


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# --- lookups -------------------------------------------------------------------------------


@pytest.mark.parametrize("fs", [1, 3, 16, 17, 64])
def test_lookup_sum_matches_numpy_with_empty_bags_and_duplicates(rng, fs):
    table = rng.standard_normal((50, fs)).astype(np.float32)
    indices, offsets = make_bags(rng, 40, 50, 13)
    indices[:5] = 3  # duplicates inside one bag
    offsets[3] = offsets[4] = offsets[2]  # forced empty bags
    out = K.lookup_sum(table, indices, offsets)
    np.testing.assert_allclose(out, ref_bag_sum(table, indices, offsets), rtol=1e-6, atol=1e-6)
    assert not out[2:4].any()


def test_lookup_sum_is_exact_in_index_order(rng):
    table = rng.standard_normal((20, 24)).astype(np.float32)
    indices, offsets = make_bags(rng, 150, 20, 20)  # 150 bags: several work items
    out = K.lookup_sum(table, indices, offsets)
    ends = np.append(offsets[1:], len(indices))
    for b, (s, e) in enumerate(zip(offsets, ends)):
        acc = np.zeros(24, dtype=np.float32)
        for r in indices[s:e]:
            acc = acc + table[r]
        assert np.array_equal(out[b], acc)


def test_lookup_sum_writes_only_its_column_block(rng):
    table = rng.standard_normal((100, 16)).astype(np.float32)
    indices, offsets = make_bags(rng, 9, 100, 6)
    big = np.full((9, 40), 7.0, dtype=np.float32)
    res = K.lookup_sum(table, indices, offsets, big[:, 13:29])
    assert res.base is big or res.base is big.base
    np.testing.assert_allclose(big[:, 13:29], ref_bag_sum(table, indices, offsets), rtol=1e-6)
    assert np.all(big[:, :13] == 7.0) and np.all(big[:, 29:] == 7.0)


def test_lookup_sum_into_strided_columns_uses_scratch(rng):
    table = rng.standard_normal((30, 5)).astype(np.float32)
    indices, offsets = make_bags(rng, 4, 30, 5)
    big = np.zeros((4, 10), dtype=np.float32)
    K.lookup_sum(table, indices, offsets, big[:, ::2])
    np.testing.assert_allclose(big[:, ::2], ref_bag_sum(table, indices, offsets), rtol=1e-6)
    assert not big[:, 1::2].any()


def test_lookup_sum_accepts_trailing_offset(rng):
    table = rng.standard_normal((30, 8)).astype(np.float32)
    indices, offsets = make_bags(rng, 6, 30, 5)
    full = np.append(offsets, len(indices))
    out = np.empty((6, 8), dtype=np.float32)
    K.lookup_sum(table, indices, full, out)
    np.testing.assert_allclose(out, ref_bag_sum(table, indices, offsets), rtol=1e-6)


def test_lookup_sum_without_indices_gives_zeros():
    table = np.ones((4, 3), dtype=np.float32)
    out = K.lookup_sum(table, np.empty(0, np.int64), np.zeros(5, np.int64))
    assert out.shape == (5, 3) and not out.any()


def test_lookup_sum_float64_and_int32_indices(rng):
    table = rng.standard_normal((40, 12))
    indices, offsets = make_bags(rng, 10, 40, 8)
    out = K.lookup_sum(table, indices.astype(np.int32), offsets.astype(np.int32))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, ref_bag_sum(table, indices, offsets), rtol=1e-12)


def test_lookup_gathers_rows(rng):
    table = rng.standard_normal((25, 9)).astype(np.float32)
    indices = rng.integers(0, 25, 60)
    assert np.array_equal(K.lookup(table, indices), table[indices])
    big = np.zeros((60, 20), dtype=np.float32)
    K.lookup(table, indices, big[:, 4:13])
    assert np.array_equal(big[:, 4:13], table[indices]) and not big[:, 13:].any()


def test_indirect_lookup_reads_cache_copies(rng):
    base = rng.standard_normal((64, 16)).astype(np.float32)
    indices, offsets = make_bags(rng, 20, 64, 9)
    cache = np.zeros((10, 16), dtype=np.float32)
    where = np.full(64, -1, dtype=np.int64)
    cached_rows = rng.choice(64, 10, replace=False)
    where[cached_rows] = np.arange(10)
    cache[:] = base[cached_rows] * 2  # distinguishable copies
    expect = base.copy()
    expect[cached_rows] *= 2
    out = K.lookup_sum_indirect(base, cache, where, indices, offsets)
    np.testing.assert_allclose(out, ref_bag_sum(expect, indices, offsets), rtol=1e-6)


@pytest.mark.parametrize("wdtype", [np.int64, np.int32])
def test_two_pass_cached_lookup_is_bit_identical_to_the_one_pass_kernel(rng, monkeypatch,
                                                                        wdtype):
    """Indirect lookups translate every index first, then sum: the same sums in the same
    order, the same hit count and the same missed rows as summing through ``where``, whether
    ``where`` is int64 or a table's int32."""
    n, fs = 5000, 24
    base = rng.standard_normal((n, fs)).astype(np.float32)
    cache = rng.standard_normal((1500, fs)).astype(np.float32)
    where = np.full(n, -1, dtype=wdtype)
    where[rng.choice(n, 1500, replace=False)] = rng.permutation(1500)
    indices, offsets = make_bags(rng, 700, n, 40)       # > one translation item, empty bags
    got = {}
    for kernel in ("bag_sum", "bag_sum_cached"):
        monkeypatch.setattr(K, "_INDIRECT_LOOKUP", kernel)
        out = np.zeros((700, fs), np.float32)
        missed = np.full(indices.shape[0], -7, np.int64)
        _, hits = K.lookup_sum_indirect_hits(base, cache, where, indices, offsets, out, missed)
        got[kernel] = out, hits, missed[:indices.shape[0] - hits]
    (a, ha, ma), (b, hb, mb) = got["bag_sum"], got["bag_sum_cached"]
    np.testing.assert_array_equal(a, b)
    assert ha == hb == int(np.count_nonzero(where[indices] >= 0)) and ha > 0
    np.testing.assert_array_equal(ma, mb)
    np.testing.assert_array_equal(mb, indices[where[indices] < 0])


def test_translation_counts_lists_and_marks_in_range_rows_only(rng):
    """The translation pass (gathers of ``where`` with no branch) gives an index out of range
    row 0's position, sets the flag and neither counts nor marks it, whether row 0 is cached
    or not; every other index is counted, marked and (with no index out of range) listed as a
    scalar loop would (a table's int32 ``where``; int64 runs the same code). (With the flag
    set the caller raises: the list is not read.)"""
    n, fs = 6000, 8
    base = rng.standard_normal((n, fs)).astype(np.float32)
    cache = rng.standard_normal((2000, fs)).astype(np.float32)
    delta = K._distance(base, cache)
    base = readonly_view(base)         # as the lookups pass it: their compiled kernels serve
    bound = np.uint64(n)
    for row0 in (-1, 17):
        where = np.full(n, -1, dtype=np.int32)
        where[rng.choice(np.arange(1, n), 1999, replace=False)] = np.arange(1, 2000)
        where[0] = row0
        idx = rng.integers(0, n, 9000)                  # three translation items
        wild = rng.choice(9000, 40, replace=False)
        idx[wild] = rng.choice([-1, -n, n, n + 3, 2**40], 40)
        inside = (idx >= 0) & (idx < n)
        hit = inside & (where[np.where(inside, idx, 0)] >= 0)
        off = np.arange(0, 9000, 30)
        out = np.zeros(off.shape[0] * fs, np.float32)
        pos = np.zeros(9000, np.uint64)
        missed = np.full(9000, -7, np.int64)
        refs = np.zeros(n, np.uint8)
        bad = np.zeros(1, np.uint8)
        hits, nmissed = K._pick("bag_sum_cached", fs)(base, where, idx, off, off.shape[0], out,
                                                      fs, 0, missed, delta, pos, refs, bound,
                                                      bad)
        assert bad[0] == 1 and hits == np.count_nonzero(hit)
        want = np.zeros(n, np.uint8)
        want[idx[hit]] = 1
        np.testing.assert_array_equal(refs, want)
        home = np.where(inside, idx, 0).astype(np.uint64) * np.uint64(fs)
        slot = (where[np.where(inside, idx, 0)].astype(np.int64) * fs).astype(np.uint64) + delta
        np.testing.assert_array_equal(pos, np.where(hit, slot, np.where(inside, home, 0)))
        bad[0] = 0
        clean = np.where(inside, idx, 0)
        hits, nmissed = K._pick("bag_sum_cached", fs)(base, where, clean, off, off.shape[0],
                                                      out, fs, 0, missed, delta, pos,
                                                      K._NO_MARKS, bound, bad)
        assert bad[0] == 0 and hits == np.count_nonzero(where[clean] >= 0)
        np.testing.assert_array_equal(missed[:nmissed], clean[where[clean] < 0])
        np.testing.assert_allclose(out.reshape(-1, fs), ref_bag_sum(
            np.where(where[:, None] >= 0, cache[np.maximum(where, 0)], base), clean, off),
            rtol=1e-5)
        # the caching pass stops at the flag: no row numbered, nothing marked in where
        before = where.copy()
        rows, kof = np.zeros(9000, np.int64), np.zeros(9000, np.int64)
        bad[0] = 0
        got = K._pick("translate_cached", fs)(base, where, idx, missed, delta, pos, K._NO_MARKS,
                                              bound, bad, rows, kof)
        assert bad[0] == 1 and got == (np.count_nonzero(hit), 0, 0)
        np.testing.assert_array_equal(where, before)
    # a table of no rows: every index is out of range, and where (empty) is never read
    bad[0] = 0
    empty = np.zeros((0, fs), np.float32)
    got = K._pick("translate_cached", fs)(empty, np.zeros(0, np.int32), np.array([0, 5]),
                                          missed, np.uint64(0), pos, K._NO_MARKS,
                                          np.uint64(0), bad, rows, kof)
    assert bad[0] == 1 and got == (0, 0, 0) and not pos[:2].any()


def test_scratch_is_reused_per_thread_grows_and_keeps_nothing_huge(monkeypatch):
    """A thread's scratch comes back for the next call (no new pages per lookup), grows
    when asked for more, is its own in every thread, and is not kept above SCRATCH_KEEP."""
    a = K.scratch("test", 100, np.int64)
    assert a.shape == (100,) and a.dtype == np.int64
    b = K.scratch("test", 50, np.int64)
    assert np.shares_memory(a, b) and b.shape == (50,)
    assert not np.shares_memory(a, K.scratch("test", 100, np.uint64))   # per dtype
    assert not np.shares_memory(a, K.scratch("other", 100, np.int64))   # per key
    big = K.scratch("test", 5000, np.int64)
    assert big.shape == (5000,) and big is not None
    assert np.shares_memory(big, K.scratch("test", 4000, np.int64))
    other = []
    t = threading.Thread(target=lambda: other.append(K.scratch("test", 100, np.int64)))
    t.start()
    t.join()
    assert not np.shares_memory(other[0], K.scratch("test", 100, np.int64))
    monkeypatch.setattr(K, "SCRATCH_KEEP", 1 << 16)
    huge = K.scratch("huge", 1 << 14, np.int64)                       # 128 KiB: not kept
    assert huge.shape == (1 << 14,)
    assert not np.shares_memory(huge, K.scratch("huge", 1 << 14, np.int64))


def test_cached_lookups_of_tables_of_other_sizes_and_threads_share_no_positions(rng):
    """The two-pass lookup's positions live in a per-thread scratch: lookups of different
    sizes in turn, and lookups from several threads at once, each get their own sums."""
    cases = []
    for n, fs, nbags in ((3000, 16, 900), (200, 16, 31), (5000, 16, 1500)):
        base = rng.standard_normal((n, fs)).astype(np.float32)
        ncache = n // 3
        cache = rng.standard_normal((ncache, fs)).astype(np.float32)
        where = np.full(n, -1, dtype=np.int64)
        where[rng.choice(n, ncache, replace=False)] = rng.permutation(ncache)
        logical = base.copy()
        logical[where >= 0] = cache[where[where >= 0]]
        indices, offsets = make_bags(rng, nbags, n, 30)
        cases.append((base, cache, where, indices, offsets, ref_bag_sum(logical, indices, offsets)))

    def run(case):
        base, cache, where, indices, offsets, want = case
        got = K.lookup_sum_indirect(base, cache, where, indices, offsets)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    for case in cases + cases[::-1]:
        run(case)
    errors = []

    def worker(k):
        try:
            for _ in range(20):
                run(cases[k % len(cases)])
        except BaseException as e:      # reported below: a thread's assert does not fail the test
            errors.append(e)

    run_threads(worker, 6)
    assert not errors, errors[0]


def test_lookup_many_matches_per_table_and_keeps_prepended_columns(rng):
    sizes, fss, batch = [50, 7, 300], [16, 8, 33], 37
    tables = [rng.standard_normal((n, f)).astype(np.float32) for n, f in zip(sizes, fss)]
    bags = [make_bags(rng, batch, n, 10) for n in sizes]
    out = np.full((batch, 5 + sum(fss)), -1.0, dtype=np.float32)
    cols = [5, 5 + 16, 5 + 24]
    K.lookup_many(tables, [b[0] for b in bags], [b[1] for b in bags], out, cols)
    assert np.all(out[:, :5] == -1.0)
    for t, (tab, (idx, off)) in enumerate(zip(tables, bags)):
        np.testing.assert_allclose(out[:, cols[t]:cols[t] + fss[t]], ref_bag_sum(tab, idx, off),
                                   rtol=1e-6, atol=1e-6)
    packed = K.lookup_many(tables, [b[0] for b in bags], [b[1] for b in bags])
    np.testing.assert_array_equal(packed, out[:, 5:])


@pytest.mark.parametrize("fss,nbags", [((16, 16, 16), 900), ((16, 8, 33), 37)])
def test_ensemble_bag_sums_equal_one_table_at_a_time_in_place_or_through_typed_lists(
        rng, fss, nbags):
    """lookup_many of bags of several indices reads every table through the first one's
    buffer and takes the indices and offsets as one array each: the same bits as one
    ``lookup_sum`` per table, in parallel for one feature size (specialised) and serially for
    several (generic), and as the typed-list kernel that serves tables not a whole number of
    elements apart (one table moved two bytes off the first one's grid)."""
    sizes = [int(n) for n in rng.integers(30, 400, len(fss))]
    tables = [rng.standard_normal((n, f)).astype(np.float32) for n, f in zip(sizes, fss)]
    bags = [make_bags(rng, nbags, n, 9) for n in sizes]
    bags[1] = (bags[1][0], np.append(bags[1][1], bags[1][0].shape[0]))   # a closing offset
    want = np.concatenate([K.lookup_sum(t, i, o, np.zeros((nbags, t.shape[1]), np.float32))
                           for t, (i, o) in zip(tables, bags)], axis=1)
    got = K.lookup_many(tables, [b[0] for b in bags], [b[1] for b in bags])
    np.testing.assert_array_equal(got, want)
    if nbags > 100:
        return                  # the typed-list kernel once, serially (its compile is long)
    raw = np.zeros(tables[2].nbytes + 8, np.uint8)
    odd = np.frombuffer(raw.data, np.float32, count=tables[2].size, offset=2)
    odd = odd.reshape(tables[2].shape)
    odd[...] = tables[2]
    assert K._deltas([tables[0], odd]) is None           # the typed-list kernel serves these
    listed = K.lookup_many(tables[:2] + [odd], [b[0] for b in bags], [b[1] for b in bags])
    np.testing.assert_array_equal(listed, want)


# --- gradients and the fused update ---------------------------------------------------------


def test_reindex_golden_vector_first_seen_order():
    # EmbeddingTables.jl test/misc.jl: keys in first-seen order, occurrences grouped per key.
    a = np.array([10, 4, 10, 100, 4, 4, 4, 1, 9, 10, 5]) - 1
    rows, bounds, occ, nu = K._reindexed(100, a, np.arange(11, dtype=np.int64), 11)
    assert list(rows[:nu] + 1) == [10, 4, 100, 1, 9, 5]
    assert list(occ + 1) == [1, 3, 10, 2, 5, 6, 7, 4, 8, 9, 11]
    assert list(bounds[1:nu + 2]) == [0, 3, 7, 8, 9, 10, 11]


def test_accumulate_grad_matches_dense_reference(rng):
    indices, offsets = make_bags(rng, 50, 30, 12)
    dout = rng.standard_normal((50, 10)).astype(np.float32)
    rows, grads = K.accumulate_grad(indices, offsets, dout, 30)
    assert sorted(rows) == sorted(set(indices.tolist()))
    dense = ref_dense_grad(30, indices, offsets, dout)
    np.testing.assert_allclose(grads, dense[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, nrows, nbags", [
    (np.float32, 40, 64),  # many repeats of every row
    (np.float64, 40, 64),
    (np.float32, 3000, 301),  # several parallel work items, partial last item
])
def test_sgd_update_matches_reference_with_duplicates(rng, dtype, nrows, nbags):
    table = rng.standard_normal((nrows, 20)).astype(dtype)
    indices, offsets = make_bags(rng, nbags, nrows, 15)
    dout = rng.standard_normal((nbags, 20)).astype(dtype)
    expect = table - 0.25 * ref_dense_grad(nrows, indices, offsets, dout)
    updated = table.copy()
    rows = K.sgd_update(updated, indices, offsets, dout, 0.25)
    np.testing.assert_allclose(updated, expect, rtol=1e-5, atol=1e-5)
    assert sorted(rows) == sorted(set(indices.tolist()))
    untouched = np.setdiff1d(np.arange(nrows), rows)
    assert np.array_equal(updated[untouched], table[untouched])


def test_sgd_update_is_deterministic(rng):
    table = rng.standard_normal((1000, 32)).astype(np.float32)
    indices, offsets = make_bags(rng, 700, 1000, 40)
    dout = rng.standard_normal((700, 32)).astype(np.float32)
    a, b = table.copy(), table.copy()
    K.sgd_update(a, indices, offsets, dout, 0.1)
    K.sgd_update(b, indices, offsets, dout, 0.1)
    assert np.array_equal(a, b)


def test_reindex_scratch_is_left_zeroed_for_the_next_call(rng):
    big = rng.standard_normal((5000, 4)).astype(np.float32)
    indices, offsets = make_bags(rng, 300, 5000, 9)
    K.sgd_update(big, indices, offsets, rng.standard_normal((300, 4)).astype(np.float32), 0.1)
    assert all(not buf.any() for buf in K._slots._free)
    small_idx, small_off = make_bags(rng, 40, 30, 5)
    dout = rng.standard_normal((40, 4)).astype(np.float32)
    rows, grads = K.accumulate_grad(small_idx, small_off, dout, 30)
    np.testing.assert_allclose(grads, ref_dense_grad(30, small_idx, small_off, dout)[rows],
                               rtol=1e-5, atol=1e-5)


def test_sgd_update_reads_gradient_column_block(rng):
    table = rng.standard_normal((30, 8)).astype(np.float32)
    indices, offsets = make_bags(rng, 12, 30, 6)
    dwide = rng.standard_normal((12, 30)).astype(np.float32)
    a, b = table.copy(), table.copy()
    K.sgd_update(a, indices, offsets, dwide[:, 10:18], 0.5)
    K.sgd_update(b, indices, offsets, np.ascontiguousarray(dwide[:, 10:18]), 0.5)
    assert np.array_equal(a, b)


def test_sgd_update_without_offsets_is_one_index_per_bag(rng):
    table = rng.standard_normal((10, 4)).astype(np.float32)
    indices = np.array([3, 3, 7, 0])
    dout = rng.standard_normal((4, 4)).astype(np.float32)
    expect = table.copy()
    np.add.at(expect, indices, -0.5 * dout)
    K.sgd_update(table, indices, None, dout, 0.5)
    np.testing.assert_allclose(table, expect, rtol=1e-6)


@pytest.mark.parametrize("wdtype", [np.int64, np.int32, np.int16])
def test_indirect_update_writes_rows_where_they_live(rng, wdtype):
    base = rng.standard_normal((50, 8)).astype(np.float32)
    cache = np.zeros((5, 8), dtype=np.float32)
    where = np.full(50, -1, dtype=wdtype)
    where[[2, 11, 17]] = [4, 0, 2]
    cache[[4, 0, 2]] = base[[2, 11, 17]]
    indices, offsets = make_bags(rng, 30, 50, 6)
    dout = rng.standard_normal((30, 8)).astype(np.float32)
    expect = base - 0.1 * ref_dense_grad(50, indices, offsets, dout)
    b2, c2 = base.copy(), cache.copy()
    K.sgd_update_indirect(b2, c2, where, indices, offsets, dout, 0.1)
    logical = b2.copy()
    logical[[2, 11, 17]] = c2[[4, 0, 2]]
    np.testing.assert_allclose(logical, expect, rtol=1e-5, atol=1e-6)
    assert np.array_equal(b2[[2, 11, 17]], base[[2, 11, 17]])  # base copies stay stale


@pytest.mark.parametrize("layout", ["apart", "misaligned table"])
def test_update_many_equals_per_table_updates(rng, layout):
    """Equal to one update per table, whether the tables are written through the first's
    buffer (their distances whole elements) or apart (one 2 bytes off)."""
    sizes, fss, batch = [40, 300, 9], [8, 16, 4], 25
    tables = [rng.standard_normal((n, f)).astype(np.float32) for n, f in zip(sizes, fss)]
    bags = [make_bags(rng, batch, n, 12) for n in sizes]
    dout = rng.standard_normal((batch, 3 + sum(fss))).astype(np.float32)
    cols = [3, 11, 27]
    many = [t.copy() for t in tables]
    if layout == "misaligned table":
        raw = np.zeros(tables[1].nbytes + 4, dtype=np.uint8)
        many[1] = np.frombuffer(raw.data, np.float32, count=tables[1].size,
                                offset=2).reshape(tables[1].shape)
        many[1][...] = tables[1]
    assert (K._deltas(many) is None) == (layout == "misaligned table")
    K.update_many(many, [b[0] for b in bags], [b[1] for b in bags], dout, 0.2, cols)
    for t in range(3):
        single = tables[t].copy()
        K.sgd_update(single, *bags[t], dout[:, cols[t]:cols[t] + fss[t]], 0.2)
        assert np.array_equal(many[t], single)


def _every_signature():
    """The signatures compiled so far of every embedding kernel (generic and specialised sets,
    and the serial twins built)."""
    kernels = [k for ks in list(K._specialised_cache.values()) for k in ks.values()]
    kernels += list(K._serial_cache.values())
    return {id(k): tuple(k.signatures) for k in kernels if hasattr(k, "signatures")}


@pytest.mark.parametrize("batch", [3, 700])          # serial and parallel kernels
def test_updates_compile_once_for_a_read_only_or_writable_gradient(rng, batch):
    """A read-only dout (a view from a read scope) and a writable one reach the update kernels
    as one numba type: the second call compiles nothing."""
    sizes, fss = [40, 300], [8, 8]
    bags = [make_bags(rng, batch, n, 6) for n in sizes]
    dout = rng.standard_normal((batch, sum(fss))).astype(np.float32)
    results = []
    for frozen in (False, True):
        if frozen:
            seen = _every_signature()
            dout = dout.copy()
            dout.flags.writeable = False
        buf = np.zeros(sum(n * f for n, f in zip(sizes, fss)), np.float32)
        many = [buf[:320].reshape(40, 8), buf[320:].reshape(300, 8)]
        K.update_many(many, [b[0] for b in bags], [b[1] for b in bags], dout, 0.5, [0, 8])
        single = np.zeros((40, 8), np.float32)
        K.sgd_update(single, *bags[0], dout[:, :8], 0.5)
        results.append((buf, single))
    assert _every_signature() == seen
    for a, b in zip(*results):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("kernels", ["generic", "specialised"])
@pytest.mark.parametrize("layout", ["flat", "apart"])
def test_dense_update_is_bit_identical_to_the_reindexed_one(rng, monkeypatch, kernels, layout,
                                                            request):
    """Small tables summed in one pass over the bags (``DENSE_UPDATE_BYTES``) update every row
    and return every unique row, in first-seen order, exactly as the re-indexed path does:
    duplicates, empty bags, bags of several rows, rows never used, and one large table."""
    if kernels == "specialised":
        request.getfixturevalue("specialised")
    sizes, fss, batch = [3, 50, 7, 5000], [16, 16, 16, 16], 40
    tables = [rng.standard_normal((n, f)).astype(np.float32) for n, f in zip(sizes, fss)]

    def copies():
        out = [t.copy() for t in tables]
        if layout == "apart":   # one table 2 bytes off: the kernels take the tables apart
            raw = np.zeros(out[1].nbytes + 4, dtype=np.uint8)
            moved = np.frombuffer(raw.data, np.float32, count=out[1].size, offset=2)
            moved = moved.reshape(out[1].shape)
            moved[...] = out[1]
            out[1] = moved
        return out

    bags = [make_bags(rng, batch, n, 9) for n in sizes]
    dout = rng.standard_normal((batch, 5 + sum(fss))).astype(np.float32)
    cols = [5, 21, 37, 53]
    assert (K._deltas(copies()) is None) == (layout == "apart")
    dense = K._dense_tables(tables, [b[0] for b in bags])
    assert list(dense > 0) == [True, True, True, False]
    results = {}
    for limit in (0, K.DENSE_UPDATE_BYTES):
        monkeypatch.setattr(K, "DENSE_UPDATE_BYTES", limit)
        many = copies()
        rows = K.update_many(many, [b[0] for b in bags], [b[1] for b in bags], dout, 0.3, cols)
        results[limit] = many, rows
    (a, ra), (b, rb) = results.values()
    for t in range(len(sizes)):
        assert np.array_equal(a[t], b[t]) and np.array_equal(ra[t], rb[t])
        first_seen = list(dict.fromkeys(bags[t][0].tolist()))
        assert rb[t].tolist() == first_seen
        np.testing.assert_allclose(
            b[t], tables[t] - 0.3 * ref_dense_grad(sizes[t], *bags[t],
                                                   dout[:, cols[t]:cols[t] + fss[t]]),
            rtol=1e-5, atol=1e-6)


# --- argument errors ------------------------------------------------------------------------


def test_out_of_range_index_names_table_position_value_and_range():
    table = np.zeros((10, 4), dtype=np.float32)
    with pytest.raises(IndexError) as err:
        K.lookup_sum(table, np.array([1, 2, 10, 3]), np.array([0, 2]), name="users")
    msg = str(err.value)
    assert "'users'" in msg and "position 2" in msg and "10" in msg and "0..9" in msg


def test_negative_index_raises():
    table = np.zeros((10, 4), dtype=np.float32)
    with pytest.raises(IndexError, match=r"index -1 at position 0"):
        K.lookup(table, np.array([-1, 2]))
    with pytest.raises(IndexError, match="position 1"):
        K.sgd_update(table, np.array([0, -3]), np.array([0]), np.zeros((1, 4), np.float32), 0.1)


def test_lookup_many_error_names_the_failing_table():
    tables = [np.zeros((10, 4), np.float32), np.zeros((3, 4), np.float32)]
    with pytest.raises(IndexError, match="'items'"):
        K.lookup_many(tables, [np.array([1]), np.array([5])], [np.array([0]), np.array([0])],
                      names=["users", "items"])


#: Offsets for 3 bags over 5 indices that check_offsets refuses, and what its message says.
BAD_OFFSETS = [
    (np.array([0, 3, 2]), "non-decreasing"),
    (np.array([1, 2, 3]), r"offsets\[0\] must be 0"),
    (np.array([0, 2, 9]), "exceeds len"),
    (np.array([0, 2]), "2 offsets for 3 bags"),
    (np.array([0, 1, 2, 4]), "must equal len"),
]


@pytest.mark.parametrize("offsets, pattern", BAD_OFFSETS)
def test_invalid_offsets_raise_value_error(offsets, pattern):
    table = np.zeros((10, 4), dtype=np.float32)
    out = np.empty((3, 4), dtype=np.float32)
    with pytest.raises(ValueError, match=pattern):
        K.lookup_sum(table, np.arange(5), offsets, out)


def test_wrong_dtypes_raise_type_error():
    table = np.zeros((10, 4), dtype=np.float32)
    with pytest.raises(TypeError, match="integer"):
        K.lookup_sum(table, np.array([1.0, 2.0]), np.array([0]))
    with pytest.raises(TypeError, match="float32"):
        K.lookup(np.zeros((10, 4), dtype=np.int32), np.array([1]))
    with pytest.raises(TypeError, match="float16"):
        K.lookup(np.zeros((10, 4), dtype=np.float16), np.array([1]))
    with pytest.raises(TypeError, match="dtype float64 differs"):
        K.lookup_sum(table, np.array([1]), np.array([0]), np.zeros((1, 4)))
    with pytest.raises(ValueError, match="C-contiguous"):
        K.lookup(np.zeros((4, 10), dtype=np.float32).T, np.array([1]))


def test_read_only_inputs_work_for_lookups_and_are_refused_for_updates(rng):
    tables = [rng.standard_normal((20, 4)).astype(np.float32) for _ in range(2)]
    tables[0].flags.writeable = False  # mixed writeability must not break the typed lists
    idx = [np.array([1, 2, 3]), np.array([0, 5, 19])]
    idx[1].flags.writeable = False
    off = [np.array([0, 2]), np.array([0, 1])]
    out = K.lookup_many(tables, idx, off)
    np.testing.assert_allclose(out[:, :4], ref_bag_sum(tables[0], idx[0], off[0]), rtol=1e-6)
    with pytest.raises(ValueError, match="'table0' is read-only"):
        K.update_many(tables, idx, off, np.zeros((2, 8), np.float32), 0.1)
    with pytest.raises(ValueError, match="read-only"):
        K.sgd_update(tables[0], idx[0], off[0], np.zeros((2, 4), np.float32), 0.1)


def test_indirect_slot_out_of_range_raises():
    base = np.zeros((10, 4), dtype=np.float32)
    cache = np.zeros((2, 4), dtype=np.float32)
    where = np.full(10, -1, dtype=np.int64)
    where[3] = 2
    with pytest.raises(IndexError, match="cache slot 2"):
        K.lookup_sum_indirect(base, cache, where, np.array([3]), np.array([0]))


# --- PyTorch as the reference implementation -----------------------------------------------


def test_lookup_sum_matches_torch_embedding_bag(rng):
    torch = pytest.importorskip("torch")
    table = rng.standard_normal((500, 32)).astype(np.float32)
    indices, offsets = make_bags(rng, 64, 500, 20)
    expect = torch.nn.functional.embedding_bag(
        torch.from_numpy(indices), torch.from_numpy(table), torch.from_numpy(offsets), mode="sum")
    np.testing.assert_allclose(K.lookup_sum(table, indices, offsets), expect.numpy(),
                               rtol=1e-5, atol=1e-5)


def test_sgd_update_matches_torch_sparse_sgd(rng):
    torch = pytest.importorskip("torch")
    table = rng.standard_normal((200, 16)).astype(np.float32)
    indices, offsets = make_bags(rng, 48, 200, 10)
    dout = rng.standard_normal((48, 16)).astype(np.float32)
    emb = torch.nn.EmbeddingBag(200, 16, mode="sum", sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(table))
    opt = torch.optim.SGD(emb.parameters(), lr=0.3)
    emb(torch.from_numpy(indices), torch.from_numpy(offsets)).backward(torch.from_numpy(dout))
    opt.step()
    ours = table.copy()
    K.sgd_update(ours, indices, offsets, dout, 0.3)
    np.testing.assert_allclose(ours, emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)


# ---- feature-size specialised kernels ----------------------------------------------------

@pytest.fixture
def generic_kernels():
    """Run the body with the generic (runtime feature size) kernels; restore afterwards."""
    old = K.set_specialised(False)
    yield
    K.set_specialised(old)


def _both(fn):
    """fn() with specialised kernels, then with the generic ones."""
    old = K.set_specialised(True)
    try:
        a = fn()
        K.set_specialised(False)
        b = fn()
    finally:
        K.set_specialised(old)
    return a, b


@pytest.mark.parametrize("fs", [17])     # 8-row groups, 1-3-row tails and a column tail; one
def test_specialised_kernels_are_bit_identical_to_generic(fs, specialised):  # size: compile time
    rng = np.random.default_rng(fs)
    n, nbags = 300, 40
    table = rng.standard_normal((n, fs)).astype(np.float32)
    lens = rng.integers(0, 23, nbags)  # empty bags, 1..3-row tails and 8-row groups
    indices = rng.integers(0, n, int(lens.sum()))
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
    assert K.specialised_kernel("bag_sum", fs) is not None
    a, b = _both(lambda: K.lookup_sum(table, indices, offsets))
    assert np.array_equal(a, b)
    a, b = _both(lambda: K.lookup(table, indices))
    assert np.array_equal(a, b)
    # indirect: a mix of cached and base rows, column block of a wider output
    cache = rng.standard_normal((64, fs)).astype(np.float32)
    where = np.full(n, -1, dtype=np.int64)
    cached = rng.choice(n, 64, replace=False)
    where[cached] = np.arange(64)

    def indirect():
        out = np.zeros((nbags, fs + 5), dtype=np.float32)
        K.lookup_sum_indirect(table, cache, where, indices, offsets, out[:, 2:2 + fs])
        return out
    a, b = _both(indirect)
    assert np.array_equal(a, b)
    dout = rng.standard_normal((nbags, fs)).astype(np.float32)

    def update():
        t, c = table.copy(), cache.copy()
        K.sgd_update(t, indices, offsets, dout, 0.1)
        K.sgd_update_indirect(t, c, where, indices, offsets, dout, 0.1)
        return np.concatenate([t, c])
    a, b = _both(update)
    assert np.array_equal(a, b)


def test_unchecked_paths_skip_validation_but_give_the_same_sums():
    rng = np.random.default_rng(5)
    table = rng.standard_normal((50, 8)).astype(np.float32)
    idx = rng.integers(0, 50, 30)
    off = np.arange(0, 30, 3)
    assert np.array_equal(K.lookup_sum(table, idx, off, check=False), K.lookup_sum(table, idx, off))
    with pytest.raises(IndexError):
        K.lookup_sum(table, np.array([50]), np.array([0]))


def test_rows_wider_than_the_specialisation_limit_use_the_generic_kernels(rng):
    fs = K.MAX_SPECIALISED_FS + 3
    assert K.specialised_kernel("bag_sum", fs) is None
    table = rng.standard_normal((30, fs)).astype(np.float32)
    indices, offsets = make_bags(rng, 12, 30, 11)
    np.testing.assert_allclose(K.lookup_sum(table, indices, offsets),
                               ref_bag_sum(table, indices, offsets), rtol=1e-5, atol=1e-5)
    dout = rng.standard_normal((12, fs)).astype(np.float32)
    expect = table - 0.1 * ref_dense_grad(30, indices, offsets, dout)
    K.sgd_update(table, indices, offsets, dout, 0.1)
    np.testing.assert_allclose(table, expect, rtol=1e-5, atol=1e-5)


def test_each_feature_size_gets_one_set_of_kernels_even_from_racing_threads(specialised):
    fs = 29  # built by no other test, so the threads race to build it
    barrier = threading.Barrier(8)
    got = []

    def build():
        barrier.wait()
        got.append(K.specialised_kernel("gather", fs))

    threads = [threading.Thread(target=build) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(k is got[0] for k in got)
    assert K.specialised_kernel("gather", fs + 1) is not got[0]


# ---- nothing written outside the package; no import cycles --------------------------------

_LOOKUP_AND_UPDATE = """
import numpy as np
import cachedarrays.models.dlrm
from cachedarrays.models.dlrm import kernels as K
fs = 17
assert K.specialised_kernel("bag_sum", fs) is not None
rng = np.random.default_rng(fs)
table = rng.standard_normal((300, fs)).astype(np.float32)
cache = rng.standard_normal((64, fs)).astype(np.float32)
where = np.full(300, -1, dtype=np.int64)
where[:64] = np.arange(64)
indices = rng.integers(0, 300, 200)
offsets = np.arange(0, 200, 5)
dout = rng.standard_normal((40, fs)).astype(np.float32)
K.lookup_sum(table, indices, offsets)
K.lookup_sum_indirect(table, cache, where, indices, offsets)
K.sgd_update(table, indices, offsets, dout, 0.1)
K.sgd_update_indirect(table, cache, where, indices, offsets, dout, 0.1)
"""


def test_specialised_lookup_and_update_write_nothing_under_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
    run = subprocess.run([sys.executable, "-c", _LOOKUP_AND_UPDATE], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert sorted(p.relative_to(home).as_posix() for p in home.rglob("*")) == []


_LOOKUP_FS5 = """
import numpy as np
from cachedarrays.models.dlrm import kernels as K
n = K.SERIAL_INDICES + 1       # a parallel gather, then a small one (the serial twin)
K.lookup(np.ones((10, 5), np.float32), np.arange(n) % 10)
K.lookup(np.ones((10, 5), np.float32), np.arange(10))
for serial in (False, True):
    stats = K.specialised_kernel("gather", 5, serial).stats
    print(sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
"""


def test_kernels_compile_once_then_load_from_numbas_cache_in_later_processes(tmp_path):
    cache = tmp_path / "numba"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    seen = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", _LOOKUP_FS5], env=env, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        seen.append((run.stdout.split(), sorted(p.name for p in cache.rglob("*"))))
    first, files1 = seen[0]
    second, files2 = seen[1]
    assert first == ["0", "1"] * 2  # each kernel (parallel, serial twin) compiled and saved
    assert second == ["1", "0"] * 2  # loaded: the cache key is the same in every process
    assert files2 == files1  # and nothing was added


def _package_modules():
    """{module name: source file} of every module of the package (its three source trees)."""
    modules = {}
    for package in ("cachedarrays", "cachedarrays.policies", "cachedarrays.models"):
        root = Path(importlib.util.find_spec(package).origin).parent
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package,) + parts)] = path
    return modules


def _imports(name, path, modules):
    """The modules of ``modules`` that ``name`` imports anywhere in its source (functions
    included: a deferred import still makes a cycle)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{up}.{base}" if base else up
            for a in node.names:
                if f"{base}.{a.name}" in modules:  # a submodule
                    found.add(f"{base}.{a.name}")
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def _import_cycles(modules):
    """Every set of two or more modules that import each other, directly or through others
    (the strongly connected components of the import graph), as sorted lists."""
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return sorted(cycles)


def test_no_module_of_the_package_imports_one_that_imports_it_back():
    modules = _package_modules()
    assert "cachedarrays.models.dlrm._fs_kernels" in modules
    assert "cachedarrays.policies.lru" in modules
    assert _import_cycles(modules) == []


def test_import_cycle_check_finds_a_private_name_imported_back(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import kernels\n")
    (pkg / "sub" / "kernels.py").write_text("_BAGS = 64\n\ndef build():\n"
                                             "    from ._template import make\n")
    (pkg / "sub" / "_template.py").write_text("from pkg.sub.kernels import _BAGS\n")
    (pkg / "leaf.py").write_text("import pkg.sub\nfrom .sub import kernels\n")
    modules = {"pkg": pkg / "__init__.py", "pkg.sub": pkg / "sub" / "__init__.py",
               "pkg.sub.kernels": pkg / "sub" / "kernels.py",
               "pkg.sub._template": pkg / "sub" / "_template.py", "pkg.leaf": pkg / "leaf.py"}
    assert _import_cycles(modules) == [["pkg.sub._template", "pkg.sub.kernels"]]


@pytest.mark.parametrize("layout", ["pool after base", "pool before base", "pool misaligned",
                                    "float64"])
def test_cached_lookup_reads_the_pool_wherever_it_lies(rng, layout):
    """The two-pass lookup reads pool rows through the base's buffer, at the pool's distance
    from it: right whether the pool lies above or below the base; a distance that is not a
    whole number of elements takes the one-pass kernel. Same sums and missed rows."""
    n, m, fs = 3000, 800, 16
    dtype = np.float64 if layout == "float64" else np.float32
    buf = np.empty((n + m) * fs + 1, dtype=dtype)
    if layout == "pool misaligned":     # the pool starts 2 bytes into an element
        raw = np.empty(m * fs * 4 + 4, dtype=np.uint8)
        cache = np.frombuffer(raw.data, dtype=np.float32, count=m * fs, offset=2).reshape(m, fs)
        base = buf[:n * fs].reshape(n, fs)
    elif layout == "pool before base":
        cache, base = buf[:m * fs].reshape(m, fs), buf[m * fs:(n + m) * fs].reshape(n, fs)
    else:
        base, cache = buf[:n * fs].reshape(n, fs), buf[n * fs:(n + m) * fs].reshape(m, fs)
    base[...] = rng.standard_normal(base.shape)
    where = np.full(n, -1, dtype=np.int64)
    rows = rng.choice(n, m, replace=False)
    where[rows] = rng.permutation(m)
    cache[where[rows]] = base[rows] + 1.0              # cached copies differ: the sums tell
    expect = base.copy()
    expect[rows] = cache[where[rows]]
    indices, offsets = make_bags(rng, 300, n, 30)
    out = np.empty((300, fs), dtype=dtype)
    missed = np.full(indices.shape[0], -7, np.int64)
    _, hits = K.lookup_sum_indirect_hits(base, cache, where, indices, offsets, out, missed)
    np.testing.assert_allclose(out, ref_bag_sum(expect, indices, offsets), rtol=1e-5)
    assert hits == int(np.count_nonzero(where[indices] >= 0))
    np.testing.assert_array_equal(missed[:indices.shape[0] - hits], indices[where[indices] < 0])


def test_indirect_lookup_of_zero_width_rows_still_lists_the_missed_rows():
    base, cache = np.empty((10, 0), np.float32), np.empty((4, 0), np.float32)
    where = np.full(10, -1, dtype=np.int64)
    where[[2, 5]] = [0, 1]
    idx, off = np.array([1, 2, 5, 7, 2]), np.array([0, 2])
    missed = np.empty(5, np.int64)
    out, hits = K.lookup_sum_indirect_hits(base, cache, where, idx, off, None, missed)
    assert out.shape == (2, 0) and hits == 3
    assert list(missed[:2]) == [1, 7]


def test_the_missed_rows_buffer_must_be_int64_with_one_entry_per_index():
    base = np.zeros((4, 2), np.float32)
    where = np.full(4, -1, np.int64)
    readonly = np.zeros(3, np.int64)
    readonly.flags.writeable = False
    for bad in (np.zeros(3, np.uint8), np.zeros(2, np.int64), readonly):
        with pytest.raises(ValueError, match="missed must be a writable int64 array"):
            K.lookup_sum_indirect_hits(base, base, where, [0, 1, 2], [0], None, bad)


@pytest.mark.parametrize("layout", ["pool after base", "pool before base", "pool misaligned"])
def test_cached_update_writes_the_pool_wherever_it_lies_and_marks_dirty_slots(rng, layout):
    """The indirect SGD writes pool rows through the base's buffer at the pool's distance from
    it (or, misaligned, through two buffers): rows land where they live, the base copies of
    cached rows stay stale, written slots (and only they) are marked dirty."""
    n, m, fs = 400, 60, 8
    buf = np.zeros((n + m) * fs, dtype=np.float32)
    if layout == "pool misaligned":
        raw = np.zeros(m * fs * 4 + 4, dtype=np.uint8)
        cache = np.frombuffer(raw.data, dtype=np.float32, count=m * fs, offset=2).reshape(m, fs)
        base = buf[:n * fs].reshape(n, fs)
    elif layout == "pool before base":
        cache, base = buf[:m * fs].reshape(m, fs), buf[m * fs:].reshape(n, fs)
    else:
        base, cache = buf[:n * fs].reshape(n, fs), buf[n * fs:].reshape(m, fs)
    base[...] = rng.standard_normal(base.shape)
    where = np.full(n, -1, dtype=np.int64)
    rows = rng.choice(n, m - 10, replace=False)          # 10 slots stay empty
    where[rows] = rng.permutation(m)[:m - 10]
    cache[where[rows]] = base[rows]
    indices, offsets = make_bags(rng, 50, n, 8)
    dout = rng.standard_normal((50, fs)).astype(np.float32)
    expect = base - 0.1 * ref_dense_grad(n, indices, offsets, dout)
    before = base.copy()
    dirty = np.zeros(m, np.uint8)
    got, hits = K.sgd_update_indirect_hits(base, cache, where, indices, offsets, dout, 0.1, dirty)
    assert sorted(got) == sorted(set(indices.tolist()))
    written = np.unique(indices)
    cached = written[where[written] >= 0]
    assert hits == cached.shape[0] > 0
    np.testing.assert_array_equal(np.flatnonzero(dirty), np.sort(where[cached]))
    logical = base.copy()
    logical[rows] = cache[where[rows]]
    np.testing.assert_allclose(logical, expect, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(base[cached], before[cached])      # base copies stay stale
    with pytest.raises(ValueError, match="dirty must be a writable uint8 array"):
        K.sgd_update_indirect_hits(base, cache, where, indices, offsets, dout, 0.1,
                                   np.zeros(m + 1, np.uint8))


@pytest.mark.parametrize("fss", [(16, 16, 16), (8, 16, 5)], ids=["one size", "mixed sizes"])
@pytest.mark.parametrize("form", ["starts", "starts+end", "misaligned table", "not one each"])
def test_lookup_many_of_one_index_bags_gathers_every_table(rng, fss, form):
    """Bags of one index take the gather path (tables read through the first's buffer at
    their distances from it): the same result as the bag sums, whatever the tables' layout;
    offsets that only look like one index per bag take the bag sums."""
    sizes, batch = [300, 7, 1000], 64
    tables = [rng.standard_normal((n, f)).astype(np.float32) for n, f in zip(sizes, fss)]
    if form == "misaligned table":      # its distance from the first is not whole elements
        raw = np.zeros(7 * fss[1] * 4 + 4, dtype=np.uint8)
        t1 = np.frombuffer(raw.data, np.float32, count=7 * fss[1], offset=2).reshape(7, fss[1])
        t1[...] = tables[1]
        tables[1] = t1
    indices = [rng.integers(0, n, batch) for n in sizes]
    if form == "not one each":          # as many indices as bags, but bags of 0 and 2
        offsets = [np.array([0, 0] + list(range(2, batch)))] * 3
    elif form == "starts+end":
        offsets = [np.arange(batch + 1)] * 3
    else:
        offsets = [np.arange(batch)] * 3
    assert K._one_per_bag(offsets[0], batch, batch) == (form != "not one each")
    out = np.full((batch, 3 + sum(fss)), -1.0, dtype=np.float32)
    cols = [3, 3 + fss[0], 3 + fss[0] + fss[1]]
    K.lookup_many(tables, indices, offsets, out, cols)
    assert np.all(out[:, :3] == -1.0)
    for t in range(3):
        np.testing.assert_allclose(out[:, cols[t]:cols[t] + fss[t]],
                                   ref_bag_sum(tables[t], indices[t], offsets[t][:batch]),
                                   rtol=1e-6)


def test_with_numba_checking_bounds_no_kernel_reads_one_array_through_another(rng, monkeypatch):
    """Reading the pool (or another table) through the base's buffer is an index out of the
    base's bounds: under NUMBA_BOUNDSCHECK=1 the kernels take the arrays apart instead."""
    base = rng.standard_normal((50, 4)).astype(np.float32)
    cache = rng.standard_normal((10, 4)).astype(np.float32)
    assert K._distance(base, cache) is not None
    monkeypatch.setattr(K.numba.config, "BOUNDSCHECK", 1)
    assert K._distance(base, cache) is None and K._deltas([base, cache]) is None
    where = np.full(50, -1, dtype=np.int64)
    where[[3, 7]] = [0, 9]
    missed = np.empty(6, np.int64)
    idx = np.array([3, 1, 7, 7, 2, 3])
    out, hits = K.lookup_sum_indirect_hits(base, cache, where, idx, [0, 3], None, missed)
    expect = base.copy()
    expect[[3, 7]] = cache[[0, 9]]
    np.testing.assert_allclose(out, [expect[[3, 1, 7]].sum(0), expect[[7, 2, 3]].sum(0)],
                               rtol=1e-6)
    assert hits == 4 and list(missed[:2]) == [1, 2]


def _reference_inputs_ok(idx, off, nrows, nbags):
    try:
        i = K.check_indices(idx, nrows)
        o = K.check_offsets(off, i.shape[0], nbags)
    except (IndexError, ValueError):
        return False, None
    return True, K._one_per_bag(o, i.shape[0], nbags)


@settings(max_examples=300, deadline=None)
@given(nrows=st.integers(1, 6), nbags=st.integers(0, 5), data=st.data())
def test_the_compiled_ensemble_check_agrees_with_the_numpy_checks(nrows, nbags, data):
    """_inputs_ok (one pass per table, for int64 arrays) accepts exactly what check_indices
    and check_offsets accept, and finds bags of one index exactly as _one_per_bag does."""
    idx = np.array(data.draw(st.lists(st.integers(-1, nrows), max_size=6)), dtype=np.int64)
    n_off = data.draw(st.sampled_from([nbags, nbags + 1, max(0, nbags - 1), nbags + 2]))
    off = np.array(data.draw(st.lists(st.integers(-1, len(idx) + 1), min_size=n_off,
                                      max_size=n_off)), dtype=np.int64)
    if data.draw(st.booleans()):        # often valid: sorted starts from 0
        off = np.sort(np.clip(off, 0, len(idx)))
        if off.size:
            off[0] = 0
    ok, one = K._inputs_ok(idx, off, nrows, nbags)
    want_ok, want_one = _reference_inputs_ok(idx, off, nrows, nbags)
    assert ok == want_ok
    if ok:
        assert one == want_one


@pytest.mark.parametrize("offsets, pattern", BAD_OFFSETS)
@pytest.mark.parametrize("op", ["lookup_many", "update_many"])
def test_ensemble_errors_name_the_table_and_the_problem(offsets, pattern, op):
    tables = [np.zeros((10, 4), np.float32), np.zeros((10, 4), np.float32)]
    good = np.arange(3, dtype=np.int64)

    def call(indices, offs):
        if op == "lookup_many":
            K.lookup_many(tables, indices, offs, np.empty((3, 8), np.float32),
                          names=["users", "items"])
        else:
            K.update_many(tables, indices, offs, np.zeros((3, 8), np.float32), 0.1,
                          names=["users", "items"])
    with pytest.raises(ValueError, match=f"'items'.*{pattern}"):
        call([good, np.arange(5, dtype=np.int64)], [good, offsets.astype(np.int64)])
    for bad in (-1, 10):
        with pytest.raises(IndexError, match=f"'items': index {bad} at position 1"):
            call([good, np.array([0, bad, 2], dtype=np.int64)], [good, good])
    before = [t.copy() for t in tables]
    with pytest.raises(IndexError):
        call([good, np.array([0, 10, 2], dtype=np.int64)], [good, good])
    for t, b in zip(tables, before):
        np.testing.assert_array_equal(t, b)         # nothing written before the check


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([np.int64, np.int32, np.uint64, np.uint32, np.int16, ">i8", ">u4"]),
       n=st.integers(K._ONE_PASS_MIN - 2, K._ONE_PASS_MIN + 70), step=st.sampled_from([1, 2]),
       bad=st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.sampled_from(
           ["low", "high", "max"]))))
def test_the_one_pass_index_check_finds_what_min_and_max_find(dtype, n, step, bad):
    """check_indices (one compiled pass from _ONE_PASS_MIN indices, NumPy's min and max below)
    accepts exactly the arrays whose values are in [0, nrows), across dtypes (big-endian ones
    too), strided views and the sizes either side of the switch, and names the first bad
    position and its value."""
    nrows = 1000
    raw = np.random.default_rng(n).integers(0, nrows, n * step).astype(dtype)
    if bad is not None:
        pos, kind = bad
        pos = (pos % n) * step
        info = np.iinfo(np.dtype(dtype))
        value = {"low": -1 if info.min < 0 else None, "high": nrows,
                 "max": info.max}[kind]
        if value is not None:
            raw[pos] = value
    idx = raw[::step]
    if idx.dtype.isnative:
        assert K._index_bounds(idx) == (idx.min(), idx.max())
    outside = np.flatnonzero((idx.astype(np.float64) < 0) | (idx.astype(np.float64) >= nrows))
    if outside.size:
        first = int(outside[0])
        with pytest.raises(IndexError, match=rf"index {int(idx[first])} at position {first} "):
            K.check_indices(idx, nrows)
    else:
        got = K.check_indices(idx, nrows)
        assert got.dtype == np.int64 and np.array_equal(got, idx.astype(np.int64))


def test_updates_of_shrinking_and_growing_batches_reuse_scratch_correctly(rng):
    """The re-index keeps its group bounds and occurrences in per-thread scratch: updates of a
    large batch, a small one, then a mid-sized one (the scratch reused, then grown) each give
    the reference's rows and table, and the unique rows a call returned are not overwritten
    by later calls."""
    nrows, fs = 300, 8
    table = rng.standard_normal((nrows, fs)).astype(np.float32)
    kept = []
    for nbags in (700, 20, 400, 1200):
        lengths = rng.integers(1, 6, nbags)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        indices = rng.integers(0, nrows, int(lengths.sum()))
        dout = rng.standard_normal((nbags, fs)).astype(np.float32)
        expect = table.astype(np.float64) - 0.25 * ref_dense_grad(nrows, indices, offsets, dout)
        rows = K.sgd_update(table, indices, offsets, dout, 0.25)
        _, first = np.unique(indices, return_index=True)
        assert np.array_equal(rows, indices[np.sort(first)])       # first-seen order
        np.testing.assert_allclose(table, expect, rtol=1e-5, atol=1e-5)
        kept.append((rows, rows.copy()))
    assert all(np.array_equal(a, b) for a, b in kept)


# --- small calls on the calling thread --------------------------------------------------------


def _kernels_run(monkeypatch, mode, work):
    """work() with every kernel in a parallel region ("parallel") or on the calling thread
    ("serial", the kernels' serial twins)."""
    with monkeypatch.context() as mp:
        if mode == "parallel":
            mp.setattr(K, "SERIAL_INDICES", -1)
        else:
            mp.setattr(K, "SERIAL_INDICES", 1 << 62)
            mp.setattr(K, "SERIAL_BAGS", 1 << 62)
        return work()


def _indirect_tables(rng, nrows, fs, ncached, wdtype=np.int64):
    base = rng.standard_normal((nrows, fs)).astype(np.float32)
    cache = np.zeros((ncached + 3, fs), dtype=np.float32)
    where = np.full(nrows, -1, dtype=wdtype)
    rows = rng.choice(nrows, ncached, replace=False)
    where[rows] = np.arange(ncached) + 3
    cache[3:] = base[rows] + 0.5      # a cached row differs from its base row
    return base, cache, where


def _every_kernel(seed):
    """Results of every public kernel entry on one random batch, as a list of arrays."""
    rng = np.random.default_rng(seed)
    fs, nrows = 9, 120
    table = rng.standard_normal((nrows, fs)).astype(np.float32)
    idx, off = make_bags(rng, 40, nrows, 7)
    dout = rng.standard_normal((40, fs)).astype(np.float32)
    got = [K.lookup(table, idx), K.lookup_sum(table, idx, off)]
    out = np.zeros((40, fs), np.float32)
    got.append(K.lookup_sum_plain(table, idx, off, out).copy())
    updated = table.copy()
    got += [K.sgd_update(updated, idx, off, dout, 0.1), updated]
    got += list(K.accumulate_grad(idx, off, dout, nrows))
    for wdtype in (np.int64, np.int32):
        base, cache, where = _indirect_tables(rng, nrows, fs, 50, wdtype)
        missed = np.zeros(idx.shape[0], np.int64)
        refs = np.zeros(nrows, np.uint8)
        out, hits = K.lookup_sum_indirect_hits(base, cache, where, idx, off, None, missed,
                                               refs=refs)
        got += [out, np.array(hits), missed[:idx.shape[0] - hits], refs]
        look = K.lookup_caching_begin(base, cache, where, idx, off, np.zeros((40, fs), np.float32),
                                      check=K.IN_KERNEL)
        if look is not None:
            slots = np.arange(min(3, look.nrows), dtype=np.int64)
            backedge = np.full(cache.shape[0], -1, np.int64)
            got += [K.lookup_caching_end(look, cache, backedge, slots), where.copy(),
                    cache.copy(), backedge]
        dirty = np.zeros(cache.shape[0], np.uint8)
        rows, hits = K.sgd_update_indirect_hits(base, cache, where, idx, off, dout, 0.1, dirty)
        got += [rows, np.array(hits), base, cache, dirty]
    sizes, fss = [30, 70], [9, 9]
    tables = [rng.standard_normal((n, f)).astype(np.float32) for n, f in zip(sizes, fss)]
    bags = [make_bags(rng, 25, n, 5) for n in sizes]
    ones = [(rng.integers(0, n, 25), np.arange(25)) for n in sizes]
    wide = rng.standard_normal((25, sum(fss))).astype(np.float32)
    for b in (bags, ones):
        got.append(K.lookup_many(tables, [x[0] for x in b], [x[1] for x in b]))
        copies = [t.copy() for t in tables]
        got += K.update_many(copies, [x[0] for x in b], [x[1] for x in b], wide, 0.1)
        got += copies
    ens = [_indirect_tables(rng, n, 9, 10, np.int32) for n in sizes]
    bases, caches, wheres = ([e[k] for e in ens] for k in range(3))
    out = np.zeros((25, sum(fss)), np.float32)
    res = K.lookup_cached_many(bases, caches, wheres, [x[0] for x in bags],
                               [x[1] for x in bags], out)
    assert res is not None
    got += [out, *map(np.asarray, res)]
    res = K.update_cached_many(bases, caches, wheres, [x[0] for x in bags],
                               [x[1] for x in bags], wide, 0.1)
    assert res is not None
    got += [*res[0], np.asarray(res[1]), *bases, *caches]
    return got


@pytest.mark.parametrize("seed", range(3))
def test_kernels_on_the_calling_thread_give_the_parallel_kernels_results_bit_for_bit(
        monkeypatch, seed):
    parallel = _kernels_run(monkeypatch, "parallel", lambda: _every_kernel(seed))
    serial = _kernels_run(monkeypatch, "serial", lambda: _every_kernel(seed))
    assert len(parallel) == len(serial)
    for k, (a, b) in enumerate(zip(parallel, serial)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"result {k} differs"


def test_small_calls_run_on_the_calling_thread_and_large_ones_in_parallel(monkeypatch):
    picked = []
    pick = K._pick

    def spy(name, fs, serial=False):
        picked.append((name, serial))
        return pick(name, fs, serial)

    monkeypatch.setattr(K, "_pick", spy)
    table = np.ones((K.SERIAL_INDICES + 10, 6), np.float32)
    small, large = np.arange(K.SERIAL_INDICES), np.arange(K.SERIAL_INDICES + 1)
    many_bags = np.arange(K.SERIAL_BAGS + 1)
    K.lookup_sum(table, small, np.array([0]))
    K.lookup_sum(table, large, np.array([0]))
    K.lookup_sum(table, many_bags, many_bags)   # few indices, too many bags
    K.lookup(table, small)                      # a gather: the index count decides
    K.lookup(table, large)
    dout = np.ones((1, 6), np.float32)
    K.sgd_update(table, small, np.array([0]), dout, 0.1)     # unique rows decide
    K.sgd_update(table, large, np.array([0]), dout, 0.1)
    K.sgd_update(table, large % 7, np.array([0]), dout, 0.1)
    assert picked == [("bag_sum", True), ("bag_sum", False), ("bag_sum", False),
                      ("gather", True), ("gather", False),
                      ("apply_sgd", True), ("apply_sgd", False), ("apply_sgd", True)]


_FORKED_CHILD = """
import os
import numpy as np
from cachedarrays.models.dlrm import kernels as K
K.set_specialised(False)                       # the kernels the suite compiles (numba's cache)
table = np.random.default_rng(0).standard_normal((5000, 16)).astype(np.float32)
idx = np.random.default_rng(1).integers(0, 5000, 4 * K.SERIAL_INDICES)
off = np.arange(0, idx.shape[0], 8)
want = K.lookup_sum(table, idx[:40], np.array([0, 8, 16]))
K.lookup_sum(table, idx, off)                  # a parallel region: the OpenMP pool exists
pid = os.fork()
if pid == 0:                                   # small calls run on the child's own thread
    got = K.lookup_sum(table, idx[:40], np.array([0, 8, 16]))
    t = table.copy()
    K.sgd_update(t, idx[:40], np.array([0, 8, 16]), np.ones((3, 16), np.float32), 0.1)
    os._exit(0 if np.array_equal(got, want) else 3)
print(os.waitpid(pid, 0)[1])
"""


def test_small_kernels_work_in_a_child_forked_after_parallel_ones():
    """GNU OpenMP is not fork-safe (numba terminates a child that starts a parallel region
    after its parent ran one), but small calls run no region: they work in such a child."""
    run = subprocess.run([sys.executable, "-c", _FORKED_CHILD], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "0", (run.stdout, run.stderr)


def _offsets_by_interface(arrays):
    """element_offsets computed from each array's __array_interface__ address."""
    first, item = arrays[0].__array_interface__["data"][0], arrays[0].itemsize
    out = []
    for a in arrays:
        gap = a.__array_interface__["data"][0] - first
        if gap % item:
            return None
        out.append((gap // item) % (1 << 64))
    return out


@settings(max_examples=200, deadline=None)
@given(starts=st.lists(st.integers(0, 799), min_size=1, max_size=8),
       itemsize=st.sampled_from([1, 2, 4, 8]), shift=st.integers(0, 7))
def test_element_offsets_are_the_address_gaps_in_elements(starts, itemsize, shift):
    """Views of one buffer at byte starts (before and after the first, misaligned too): the
    distances in the first's elements modulo 2**64, or None when one is not whole."""
    from cachedarrays.layout import element_offsets
    buf = np.zeros(1024, dtype=np.uint8)
    views = [buf[shift + s:shift + s + 8 * itemsize].view(f"u{itemsize}") if k == 0 else
             buf[s:s + 8 * itemsize].view(f"u{itemsize}") for k, s in enumerate(starts)]
    got = element_offsets(views)
    want = _offsets_by_interface(views)
    if want is None:
        assert got is None
    else:
        assert got.dtype == np.uint64 and got.tolist() == want
        assert K._deltas(views).tolist() == want
        assert K._distance(views[0], views[-1]) == want[-1]


def test_element_offsets_refuses_what_is_not_arrays():
    from cachedarrays.layout import element_offsets
    a = np.zeros(4, np.float32)
    assert element_offsets([]).tolist() == [] and element_offsets((a,)).tolist() == [0]
    with pytest.raises(TypeError, match="item 1 is a list, not a numpy.ndarray"):
        element_offsets([a, [1.0]])
    with pytest.raises(TypeError, match="sequence of numpy.ndarray"):
        element_offsets(3)


@pytest.mark.parametrize("seed,nbags,unit", [(0, 30, False), (1, 30, False), (2, 30, False),
                                             (3, 30, False), (4, 700, False), (5, 700, False),
                                             (6, 30, True), (7, 700, True)])
def test_cached_ensemble_lookup_equals_one_table_at_a_time(seed, nbags, unit):
    """lookup_cached_many reaches every table's ``where`` and marks through the first's (at
    higher or lower addresses), lists the missed rows only of the tables given a list and
    marks only those given marks: the same sums, hits, lists and marks as one call per table,
    serially (30 bags) and in parallel over several bag chunks per table (700), with the
    first table's offsets given their closing entry; bags of one index each (``unit``: rows
    copied, not summed) too."""
    rng = np.random.default_rng(seed)
    n, fs = 4, 8
    sizes = rng.integers(20, 200, n)
    tables = [_indirect_tables(rng, int(r), fs, int(r) // 2, np.int32) for r in sizes]
    order = rng.permutation(n)          # the wheres copied in a random order: random addresses
    wheres = [None] * n
    for t in order:
        wheres[t] = tables[t][2].copy()
    bases = [t[0] for t in tables]
    caches = [t[1] for t in tables]
    if unit:
        bags = [(rng.integers(0, int(r), nbags), np.arange(nbags)) for r in sizes]
    else:
        bags = [make_bags(rng, nbags, int(r), 6) for r in sizes]
    bags[0] = (bags[0][0], np.append(bags[0][1], bags[0][0].shape[0]))
    listed = [k % 2 == seed % 2 for k in range(n)]
    marked = [k != seed % n for k in range(n)]
    misseds = [np.full(b[0].shape[0], -7, np.int64) if want else None
               for b, want in zip(bags, listed)]
    refss = [np.zeros(int(r), np.uint8) if want else None for r, want in zip(sizes, marked)]
    out = np.full((nbags, n * fs), np.nan, np.float32)
    hits, nmissed = K.lookup_cached_many(bases, caches, wheres, [b[0] for b in bags],
                                         [b[1] for b in bags], out, None, misseds, refss)
    for t in range(n):
        missed = np.zeros(bags[t][0].shape[0], np.int64)
        refs = np.zeros(int(sizes[t]), np.uint8)
        one, h = K.lookup_sum_indirect_hits(bases[t], caches[t], wheres[t], *bags[t],
                                            np.zeros((nbags, fs), np.float32), missed,
                                            refs=refs)
        assert np.array_equal(out[:, t * fs:(t + 1) * fs], one)
        assert hits[t] == h
        if listed[t]:
            assert nmissed[t] == bags[t][0].shape[0] - h
            assert np.array_equal(misseds[t][:nmissed[t]], missed[:nmissed[t]])
        if marked[t]:
            assert np.array_equal(refss[t], refs)


def test_a_cached_ensemble_whose_wheres_are_not_whole_elements_apart_is_left_to_the_caller():
    """A ``where`` two bytes off the int32 grid of the first cannot be reached through it: the
    ensemble call returns None and writes nothing (the tables then go one at a time)."""
    rng = np.random.default_rng(3)
    tables = [_indirect_tables(rng, 40, 8, 20, np.int32) for _ in range(2)]
    raw = np.zeros(40 * 4 + 4, np.uint8)
    odd = np.frombuffer(raw.data, np.int32, count=40, offset=2)
    odd[...] = tables[1][2]
    bags = [make_bags(rng, 5, 40, 4) for _ in range(2)]
    out = np.full((5, 16), 3.0, np.float32)
    assert K.lookup_cached_many([t[0] for t in tables], [t[1] for t in tables],
                                [tables[0][2], odd], [b[0] for b in bags],
                                [b[1] for b in bags], out) is None
    assert (out == 3.0).all()


@pytest.mark.parametrize("seed", range(4))
def test_cached_ensemble_update_equals_one_table_at_a_time(seed):
    """update_cached_many reaches every table, map and set of dirty marks through the first
    table's (at higher or lower addresses) and marks only the tables given marks: the same
    rows, hits, values and marks as one update per table."""
    rng = np.random.default_rng(seed)
    n, fs, nbags = 4, 8, 30
    sizes = rng.integers(20, 200, n)
    made = [_indirect_tables(rng, int(r), fs, int(r) // 2, np.int32) for r in sizes]
    order = rng.permutation(n)          # copied in a random order: random addresses
    bases, caches, wheres = [None] * n, [None] * n, [None] * n
    for t in order:
        bases[t], caches[t], wheres[t] = (a.copy() for a in made[t])
    bags = [make_bags(rng, nbags, int(r), 6) for r in sizes]
    dout = rng.standard_normal((nbags, n * fs)).astype(np.float32)
    marked = [k != seed % n for k in range(n)]
    dirties = [np.zeros(c.shape[0], np.uint8) if want else None
               for c, want in zip(caches, marked)]
    rows, hits = K.update_cached_many(bases, caches, wheres, [b[0] for b in bags],
                                      [b[1] for b in bags], dout, 0.25, None, dirties)
    for t in range(n):
        base, cache, where = (a.copy() for a in made[t])
        dirty = np.zeros(cache.shape[0], np.uint8)
        one, h = K.sgd_update_indirect_hits(base, cache, where, *bags[t],
                                            dout[:, t * fs:(t + 1) * fs], 0.25, dirty)
        assert np.array_equal(rows[t], one) and hits[t] == h
        assert np.array_equal(bases[t], base) and np.array_equal(caches[t], cache)
        if marked[t]:
            assert np.array_equal(dirties[t], dirty)
