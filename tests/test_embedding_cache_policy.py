"""The dynamic cache keeps its hot rows under Zipf indices; hit counting and miss marking of
the indirect lookup; ensembles of one feature size run the specialised kernels."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays.models.dlrm import embedding as E
from cachedarrays.models.dlrm import kernels as K
from cachedarrays.models.dlrm.data import SyntheticDataset


@pytest.fixture(scope="module")
def m():
    with ca.Manager(fast="64MiB", slow="256MiB") as manager:
        yield manager


def test_a_flush_of_a_small_table_keeps_most_of_its_cache(m):
    n = 40
    t = E.CachedEmbeddingTable(n, 4, manager=m, cachelower=0.25, cacheslack=0.05,
                               name="small")
    assert t.page_rows <= 2                      # a page is no larger than the slack
    t.lookup(np.arange(n), np.arange(n))         # fills the pool
    assert t.isfull
    t.maintain()
    assert 0.25 * n - t.page_rows <= t.cached_rows <= 0.25 * n
    t.check()


def _hit_rate(m, kind, distribution):
    sizes = [16, 300, 2000]
    data = SyntheticDataset(1, sizes, 512, pooling=1, distribution=distribution, seed=3,
                            num_batches=12)
    tables = [E.make_table(kind, n, 4, manager=m, cache=0.25, name=f"{kind}{k}")
              for k, n in enumerate(sizes)]
    out = np.empty((512, 4 * len(sizes)), dtype=np.float32)
    dout = np.full_like(out, 1e-3)
    for i in range(12):
        b = data.batch(i)
        E.lookup_tables(tables, b.indices, b.offsets, out)
        E.update_tables(tables, b.indices, b.offsets, dout, 0.1)
        for t in tables:
            t.maintain()
    for t in tables:
        t.check()
    hits = sum(t.stats()["hits"] for t in tables)
    return hits / sum(t.stats()["lookups"] for t in tables)


def test_dynamic_caching_beats_static_under_zipf(m):
    dynamic, static = _hit_rate(m, "dynamic", "zipf"), _hit_rate(m, "static", "zipf")
    assert dynamic > 1.5 * static, (dynamic, static)


def test_indirect_lookup_counts_hits_and_lists_the_missed_rows():
    rng = np.random.default_rng(0)
    n, fs = 50, 8
    base = rng.standard_normal((n, fs)).astype(np.float32)
    where = np.full(n, -1, dtype=np.int64)
    cached = rng.choice(n, 20, replace=False)
    where[cached] = np.arange(20)
    cache = base[cached].copy()
    idx = rng.integers(0, n, 300)
    off = np.arange(0, 300, 3)
    missed = np.full(300, -7, dtype=np.int64)
    out, hits = K.lookup_sum_indirect_hits(base, cache, where, idx, off, None, missed)
    assert hits == int(np.count_nonzero(where[idx] >= 0))
    np.testing.assert_array_equal(missed[:300 - hits], idx[where[idx] < 0])   # in index order
    np.testing.assert_allclose(out, base[idx].reshape(100, 3, fs).sum(1), rtol=1e-6)


def test_ensembles_of_one_feature_size_use_the_specialised_kernels(specialised):
    rng = np.random.default_rng(1)
    tables = [rng.standard_normal((n, 16)).astype(np.float32) for n in (7, 300, 40)]
    idx = [rng.integers(0, t.shape[0], 64) for t in tables]
    off = [np.arange(64) for _ in tables]
    special = K.lookup_many(tables, idx, off)
    assert K.specialised_kernel("bag_sum_many", 16) is not None
    assert K._pick("bag_sum_many", K._common_fs(tables)) is K.specialised_kernel(
        "bag_sum_many", 16)
    old = K.set_specialised(False)
    try:
        generic = K.lookup_many(tables, idx, off)
    finally:
        K.set_specialised(old)
    np.testing.assert_array_equal(special, generic)
    np.testing.assert_array_equal(special, np.concatenate([t[i] for t, i in zip(tables, idx)],
                                                          axis=1))


# ---- second-chance flushes ----------------------------------------------------------------


def _filled(m, policy, n=64, page_rows=4):
    """A dynamic table whose pool (lower 16 rows + slack 8) is full: rows 0..23 cached in
    order, in pages of 4; rows 0..15 before the last flush (a no-op), 16..23 after it."""
    init = np.random.default_rng(5).standard_normal((n, 3)).astype(np.float32)
    t = E.CachedEmbeddingTable(n, 3, manager=m, init=init, cachelower=16 * 12, cacheslack=8 * 12,
                               page_rows=page_rows, flush_policy=policy, name=policy)
    t.lookup(np.arange(16), np.arange(16))
    assert t.flush_clean() == 0 and t.cached_rows == 16
    t.lookup(np.arange(16, 24), np.arange(8))
    assert t.cached_rows == 24
    return t, init


@pytest.mark.parametrize("flush", ["flush_clean", "flush_dirty", "maintain"])
def test_second_chance_keeps_the_rows_looked_up_since_they_were_cached(m, flush):
    t, init = _filled(m, "second-chance")
    used = np.array([1, 5, 6, 9])                # in the three oldest pages (rows 0..11)
    t.lookup(used, np.arange(4))
    t._full = True                                # maintain flushes a full cache only
    getattr(t, flush)()
    # 6 pages down to 4: three popped, their 4 used rows fill one new page
    assert t.cached_rows == 16 and t.cache_bytes == t.cachelower
    assert (t.where[used] >= 0).all()             # moved, not dropped
    dropped = np.setdiff1d(np.arange(12), used)
    assert (t.where[dropped] == -1).all() and (t.where[12:24] >= 0).all()
    assert t.stats()["rows_retained"] == 4 and t.stats()["rows_flushed"] == 8
    assert not t.refs.any()                       # the moved rows start over
    np.testing.assert_array_equal(t.snapshot(), init)
    t.check(clean=True)
    out = np.asarray(t.lookup(np.arange(24), np.arange(24)))
    np.testing.assert_array_equal(out, init[:24])


def test_oldest_first_drops_the_oldest_pages_whatever_was_looked_up(m):
    t, _ = _filled(m, "oldest")
    t.lookup(np.array([1, 5]), np.arange(2))
    t.flush_clean()
    assert (t.where[:8] == -1).all() and (t.where[8:24] >= 0).all()
    assert t.stats()["rows_retained"] == 0 and not t.refs.any()   # never marked


@pytest.mark.parametrize("serial_rows", [0, E.SERIAL_ROWS])   # parallel / serial copies
def test_moved_rows_keep_their_updates_and_dirty_marks(m, monkeypatch, serial_rows):
    monkeypatch.setattr(E, "SERIAL_ROWS", serial_rows)
    t, init = _filled(m, "second-chance")
    rows = np.array([0, 2, 7])
    t.lookup(rows, np.arange(3))
    dout = np.ones((3, 3), dtype=np.float32)
    t.update(rows, np.arange(3), dout, 0.5)
    want = init.copy()
    want[rows] -= 0.5
    t.flush_clean()                               # drops no dirty row: they all move
    assert (t.where[rows] >= 0).all()
    assert t.dirty_slots[t.where[rows]].all()
    np.testing.assert_array_equal(t.snapshot(), want)
    t.check()
    t.flush_dirty(0)                              # an explicit target drops everything
    assert t.cached_rows == 0 and t.stats()["rows_written_back"] == 3
    with ca.readable(t.base) as b:
        np.testing.assert_array_equal(b, want)


def test_flush_clean_refuses_to_drop_an_unreferenced_dirty_row_and_changes_nothing(m):
    t, init = _filled(m, "second-chance")
    t.lookup(np.array([1]), np.arange(1))
    t.update(np.array([3]), None, np.ones((1, 3), np.float32), 1.0)    # dirty, not looked up
    before = t.where.copy(), t.refs.copy(), t.cache_bytes
    with pytest.raises(RuntimeError, match="flush_dirty"):
        t.flush_clean()
    np.testing.assert_array_equal(t.where, before[0])
    np.testing.assert_array_equal(t.refs, before[1])
    assert t.cache_bytes == before[2]
    t.check()


def test_second_chance_is_oldest_first_when_every_row_was_used(m):
    """Marks on every row tell nothing: the flush drops the oldest pages and moves nothing."""
    t, init = _filled(m, "second-chance")
    t.lookup(np.arange(24), np.arange(24))        # every cached row looked up again
    t.flush_clean()
    assert t.cache_bytes == t.cachelower and t.stats()["rows_retained"] == 0
    assert (t.where[:8] == -1).all() and (t.where[8:24] >= 0).all()
    assert not t.refs.any() or (t.where[t.refs > 0] >= 0).all()
    np.testing.assert_array_equal(np.asarray(t.lookup(np.arange(24), np.arange(24))), init[:24])
    t.check(clean=True)


def test_rows_cached_since_the_last_flush_get_a_lookup_before_they_can_be_dropped(m):
    """The pages opened since the previous flush are not offered to the second chance: their
    rows have not been looked up yet, and dropping them first would freeze the cache."""
    t, init = _filled(m, "second-chance")
    t.lookup(np.arange(16), np.arange(16))         # every old row used, the new ones not yet
    t.flush_clean()
    assert (t.where[16:24] >= 0).all()             # the new rows stay
    assert t.stats()["rows_retained"] == 0


def test_second_chance_raises_the_hit_rate_under_zipf(m):
    n, fs = 20000, 4
    data = SyntheticDataset(1, [n], 256, pooling=20, distribution="zipf", seed=7,
                            num_batches=24)
    rates = {}
    for policy in E.FLUSH_POLICIES:
        t = E.CachedEmbeddingTable(n, fs, manager=m, cachelower=0.25, cacheslack=0.05,
                                   page_rows=64, flush_policy=policy, name=policy)
        for k in range(24):
            if k == 8:
                s0 = t.stats()
            b = data.batch(k)
            t.lookup(b.indices[0], b.offsets[0])
            t.flush_clean()
        s1 = t.stats()
        rates[policy] = (s1["hits"] - s0["hits"]) / (s1["lookups"] - s0["lookups"])
        t.check(clean=True)
        assert (s1["fast_read_bytes"] - s1["bytes_retained"]
                == (s1["hits"] + s1["update_hits"]) * t.rowbytes + s1["bytes_written_back"])
    assert rates["second-chance"] > rates["oldest"] + 0.05, rates


def test_flush_policy_must_be_known_and_is_fixed(m):
    with pytest.raises(ValueError, match="flush_policy must be one of"):
        E.CachedEmbeddingTable(10, 2, manager=m, flush_policy="lru")
    t = E.CachedEmbeddingTable(10, 2, manager=m, flush_policy="second-chance")
    with pytest.raises(AttributeError):
        t.flush_policy = "oldest"      # an "oldest" table never clears marks it never makes
    assert t.flush_policy == "second-chance"


@pytest.mark.parametrize("kernel", ["bag_sum", "bag_sum_cached"])
def test_indirect_lookup_marks_the_cache_rows_it_reads(monkeypatch, kernel):
    monkeypatch.setattr(K, "_INDIRECT_LOOKUP", kernel)
    rng = np.random.default_rng(2)
    n, fs = 300, 8
    base = rng.standard_normal((n, fs)).astype(np.float32)
    cache = rng.standard_normal((100, fs)).astype(np.float32)
    where = np.full(n, -1, dtype=np.int64)
    where[rng.choice(n, 100, replace=False)] = rng.permutation(100)
    idx = rng.integers(0, n, 500)
    refs = np.zeros(n, dtype=np.uint8)
    K.lookup_sum_indirect_hits(base, cache, where, idx, np.arange(0, 500, 5), None, refs=refs)
    want = np.zeros(n, dtype=np.uint8)
    want[idx[where[idx] >= 0]] = 1
    np.testing.assert_array_equal(refs, want)
    refs[:] = 0                                   # no feature columns: the marks all the same
    K.lookup_sum_indirect_hits(base[:, :0], cache[:, :0], where, idx, np.arange(0, 500, 5),
                               None, refs=refs)
    np.testing.assert_array_equal(refs, want)
    for bad in (np.zeros(100, np.uint8), np.zeros(n, np.int64), np.zeros(2 * n, np.uint8)[::2]):
        with pytest.raises(ValueError, match="refs must be"):
            K.lookup_sum_indirect_hits(base, cache, where, idx, np.arange(0, 500, 5), None,
                                       refs=bad)


def test_a_flush_that_cannot_reach_the_pool_changes_nothing():
    """A second-chance flush on a closed manager raises before it pops a page or moves a row."""
    m = ca.Manager(fast="8MiB", slow="32MiB")
    t, _ = _filled(m, "second-chance")
    t.lookup(np.array([1, 5]), np.arange(2))      # rows to move
    state = (list(t._pages), t.where.copy(), t.refs.copy(), t.backedge.copy(), t._insert)
    m.close()
    with pytest.raises(ca.UseAfterFreeError, match="closed"):
        t.flush_dirty()
    assert list(t._pages) == state[0] and t._insert == state[4]
    for before, now in zip(state[1:4], (t.where, t.refs, t.backedge)):
        np.testing.assert_array_equal(before, now)


@settings(max_examples=300, deadline=None)
@given(npages=st.integers(0, 12), rows=st.integers(1, 6), data=st.data())
def test_the_flush_plan_reaches_its_target_and_keeps_only_looked_up_rows(npages, rows, data):
    """Random pools: the plan pops the oldest pages (only the old ones give a second chance),
    leaves at most ``target`` rows of pages, keeps only marked rows of old popped pages, and
    without a second chance (or with no marks) is exactly oldest-first."""
    total = 16
    pages = np.array(data.draw(st.permutations(range(total)))[:npages], dtype=np.int64)
    nslots = total * rows
    backedge = np.array(data.draw(st.lists(st.integers(-1, 99), min_size=nslots,
                                           max_size=nslots)), dtype=np.int64)
    refs = np.array(data.draw(st.lists(st.integers(0, 1), min_size=100, max_size=100)),
                    dtype=np.uint8)
    fresh = data.draw(st.integers(0, npages))
    insert = data.draw(st.integers(0 if npages else rows, rows))
    target = data.draw(st.integers(0, (npages + 1) * rows))
    second = data.draw(st.booleans())
    keep = np.empty(max(1, npages * rows), dtype=np.int64)
    npop, nkeep = E._plan_flush(pages, fresh, backedge, refs, rows, insert, target, second, keep)
    oldest = 0
    while oldest < npages and (npages - oldest) * rows > target:
        oldest += 1
    assert E._pages_after(npages, npop, nkeep, rows, insert) * rows <= target
    kept = keep[:nkeep]
    if not second or nkeep == 0:
        assert npop == oldest
    else:
        old = pages[:min(npop, npages - fresh)]
        old_slots = (old[:, None] * rows + np.arange(rows)).reshape(-1)
        assert np.isin(kept, old_slots).all() and np.unique(kept).size == nkeep
        assert (backedge[kept] >= 0).all() and (refs[backedge[kept]] == 1).all()
        assert npop <= npages - fresh or nkeep == 0   # fresh pages go only when nothing moves
