"""Embedding tables: SimpleTable and CachedEmbeddingTable against torch and against each other."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cachedarrays as ca
from cachedarrays.models.dlrm import embedding as E


@pytest.fixture(scope="module")
def m():
    with ca.Manager(fast="64MiB", slow="256MiB") as manager:
        yield manager


def _init(n, fs, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((n, fs)).astype(dtype)


def _bags(rng, n, nbags, maxlen):
    lengths = rng.integers(0, maxlen + 1, nbags)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return rng.integers(0, n, int(lengths.sum())), offsets


def _tables(m, n, fs, init):
    return {
        "fast": E.SimpleTable(n, fs, manager=m, init=init, placement="fast", name="fast"),
        "slow": E.SimpleTable(n, fs, manager=m, init=init, placement="slow", name="slow"),
        "dynamic": E.CachedEmbeddingTable(n, fs, manager=m, init=init, cachelower=0.3,
                                          cacheslack=0.05, page_rows=16, name="dynamic"),
        "static": E.make_table("static", n, fs, manager=m, init=init, cache=0.5, page_rows=16,
                               name="static"),
    }


def test_table_operations_are_named_kernels_in_traces(m):
    n, fs = 64, 8
    init = _init(n, fs)
    tables = _tables(m, n, fs, init)
    rng = np.random.default_rng(5)
    idx, off = _bags(rng, n, 16, 4)
    dout = rng.standard_normal((16, fs)).astype(np.float32)
    for name, table in tables.items():
        with ca.trace(m) as t:
            table.lookup(idx, off)
            table.update(idx, off, dout, 0.1)
            if name == "dynamic":
                table.flush_dirty(0)
        t.validate()
        names = [k[0] for k in t.kernels]
        if name == "dynamic":   # the lookup, then caching the rows it missed
            want = ["embedding_lookup", "embedding_cache_rows", "embedding_update",
                    "embedding_writeback"]
        else:
            want = ["embedding_lookup", "embedding_update"]
        assert names == want, name
        sids = {k[0]: k for k in t.kernels}
        lookup = sids["embedding_lookup"]
        assert len(lookup[2]) == 1, name   # it writes out only
        if name == "dynamic":
            assert len(sids["embedding_cache_rows"][2]) == 1   # the pool it fills
    with ca.trace(m) as t:
        E.make_table("static", n, fs, manager=m, init=init, cache=0.5, page_rows=16, name="s2")
    # the base filled, the pool touched (so no lookup waits for its pages), the rows cached
    assert [k[0] for k in t.kernels] == ["embedding_init", "embedding_cache_init",
                                         "embedding_cache_rows"]


@pytest.mark.parametrize("fs", [1, 16, 17])
def test_lookup_equals_torch_embedding_bag(m, fs):
    torch = pytest.importorskip("torch")
    n, rng = 300, np.random.default_rng(fs)
    init = _init(n, fs)
    weight = torch.from_numpy(init)
    for name, table in _tables(m, n, fs, init).items():
        for _ in range(3):
            idx, off = _bags(rng, n, 50, 6)
            got = table.lookup(idx, off)
            want = torch.nn.functional.embedding_bag(torch.from_numpy(idx), weight,
                                                     torch.from_numpy(off), mode="sum").numpy()
            assert isinstance(got, ca.CachedArray)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=name)
        one = rng.integers(0, n, 40)                 # non-reducing: one row per bag
        np.testing.assert_array_equal(np.asarray(table.lookup(one)), init[one], err_msg=name)


def test_update_equals_torch_sparse_sgd(m):
    torch = pytest.importorskip("torch")
    n, fs, lr, rng = 200, 24, 0.5, np.random.default_rng(3)
    init = _init(n, fs, seed=4)
    bag = torch.nn.EmbeddingBag(n, fs, mode="sum", sparse=True)
    with torch.no_grad():
        bag.weight.copy_(torch.from_numpy(init))
    opt = torch.optim.SGD(bag.parameters(), lr=lr)
    tables = _tables(m, n, fs, init)
    for step in range(4):
        idx, off = _bags(rng, n, 64, 8)
        dout = rng.standard_normal((64, fs)).astype(np.float32)
        opt.zero_grad()
        bag(torch.from_numpy(idx), torch.from_numpy(off)).backward(torch.from_numpy(dout))
        opt.step()
        want = bag.weight.detach().numpy()
        for name, table in tables.items():
            table.lookup(idx, off)
            rows = table.update(idx, off, dout, lr)
            assert sorted(rows.tolist()) == sorted(set(idx.tolist())), name
            np.testing.assert_allclose(table.snapshot(), want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} after step {step}")


def test_cached_table_layout_and_telemetry(m):
    n, fs = 1000, 16
    t = E.CachedEmbeddingTable(n, fs, manager=m, init=_init(n, fs), cachelower=0.1,
                               cacheslack=0.02, page_rows=20, name="tele")
    assert t.base.device == "slow" and t.cache.device == "fast"
    assert t.where.dtype == E.where_dtype(n) == np.int32 and (t.where == -1).all()
    assert t.npages * t.page_rows >= 120 and t.cachelower == 100 * t.rowbytes
    idx = np.arange(50)
    t.lookup(idx)                                   # 50 misses, all cached
    t.lookup(idx)                                   # 50 hits
    s = t.stats()
    assert (s["lookups"], s["hits"], s["misses"], s["rows_cached"]) == (100, 50, 50, 50)
    assert s["hit_rate"] == 0.5 and t.cached_rows == 50
    arr, pos = t.rowpointer(7)
    assert arr is t.cache and t.backedge[pos] == 7
    assert t.rowpointer(999) == (t.base, 999)
    np.testing.assert_array_equal(t[999], _init(n, fs)[999])
    t.check(clean=True)


def test_cache_smaller_than_batch_falls_back_and_counts(m):
    n, fs = 500, 8
    init = _init(n, fs)
    t = E.CachedEmbeddingTable(n, fs, manager=m, init=init, cachelower=10 * 32, cacheslack=0,
                               page_rows=4, name="small-cache")
    idx = np.arange(100)
    out = t.lookup(idx, np.arange(0, 100, 5))
    np.testing.assert_allclose(np.asarray(out), init[:100].reshape(20, 5, fs).sum(1), rtol=1e-6)
    s = t.stats()
    assert t.isfull and s["rows_cached"] == 12 and s["uncached"] == 88
    t.check(clean=True)
    t.maintain()                                    # dynamic + full: flush down to cachelower
    assert not t.isfull and t.cache_bytes <= t.cachelower


def test_flushes_write_back_dirty_rows_oldest_first(m):
    n, fs = 64, 4
    init = _init(n, fs)
    t = E.CachedEmbeddingTable(n, fs, manager=m, init=init, cachelower=8 * 16, cacheslack=8 * 16,
                               page_rows=4, name="flush")
    t.lookup(np.arange(16))                         # 4 pages: rows 0-3, 4-7, 8-11, 12-15
    t.update(np.arange(16), None, np.ones((16, fs), np.float32), 1.0)
    with pytest.raises(RuntimeError, match="'flush'.*flush_dirty"):
        t.flush_clean()
    t.check()
    assert t.flush_dirty() == 8                     # the two oldest pages go home
    assert (t.where[:8] == -1).all() and (t.where[8:16] >= 0).all()
    with ca.readable(t.base) as b:
        np.testing.assert_array_equal(b[:8], init[:8] - 1)
        np.testing.assert_array_equal(b[8:16], init[8:16])
    assert t.stats()["bytes_written_back"] == 8 * t.rowbytes
    assert t.writeback() == 8 and t.flush_clean(0) == 0
    t.check(clean=True)
    np.testing.assert_array_equal(t.snapshot(), init - np.where(np.arange(n) < 16, 1, 0).astype(np.float32)[:, None])


def test_traffic_counts_every_row_each_tier_reads_and_writes(m):
    n, fs = 64, 4
    t = E.CachedEmbeddingTable(n, fs, manager=m, init=_init(n, fs), cachelower=8 * 16,
                               cacheslack=8 * 16, page_rows=4, name="traffic")
    t.lookup(np.arange(16))          # 16 misses read from base, then cached: slow -> fast
    t.lookup(np.arange(4))           # 4 hits
    t.update(np.arange(20), None, np.ones((20, fs), np.float32), 1.0)  # 16 cached, 4 not
    assert t.flush_dirty() == 8      # two pages home: fast -> slow
    s, rows = t.stats(), lambda k: t.stats()[k] // t.rowbytes
    assert [rows(k) for k in ("fast_read_bytes", "slow_read_bytes", "fast_write_bytes",
                              "slow_write_bytes")] == [4 + 16 + 8, 16 + 16 + 4, 16 + 16, 4 + 8]
    assert E.traffic_time(s) > E.traffic_time(s, slow="dram")
    simple = E.SimpleTable(n, fs, manager=m, placement="slow", name="simple-traffic")
    simple.lookup(np.arange(10))
    simple.update(np.arange(5), None, np.ones((5, fs), np.float32), 1.0)
    s = simple.stats()
    assert (s["slow_read_bytes"], s["slow_write_bytes"], s["fast_read_bytes"],
            s["fast_write_bytes"]) == (15 * 16, 5 * 16, 0, 0)


def test_static_kind_freezes_after_prepopulate(m):
    n, fs = 400, 8
    t = E.make_table("static", n, fs, manager=m, cache=0.25, name="static")
    assert t.caching == "static" and t.frozen and t.cached_rows == 100
    before = t.where.copy()
    t.lookup(np.arange(n))
    np.testing.assert_array_equal(t.where, before)
    assert t.stats()["hits"] == 100 and t.stats()["misses"] == 300


def test_table_kind_placements(m):
    assert E.TABLE_KINDS == ("fast", "simple", "static", "dynamic")
    assert E.make_table("simple", 10, 4, manager=m).data.device == "slow"
    assert E.make_table("fast", 10, 4, manager=m).data.device == "fast"
    dynamic = E.make_table("dynamic", 10, 4, manager=m)
    assert isinstance(dynamic, E.CachedEmbeddingTable) and dynamic.caching == "dynamic"
    with pytest.raises(ValueError, match="unknown table kind 'lru'"):
        E.make_table("lru", 10, 4, manager=m)


def test_cached_table_caching_is_static_or_dynamic(m):
    with pytest.raises(ValueError, match="caching must be 'dynamic' or 'static', got 'lru'"):
        E.CachedEmbeddingTable(10, 4, manager=m, caching="lru", name="bad")
    with pytest.raises(TypeError):          # "mode" is not a table parameter
        E.CachedEmbeddingTable(10, 4, manager=m, mode="static", name="bad")


def test_ensemble_writes_column_blocks(m):
    rng = np.random.default_rng(7)
    inits = [_init(n, 4, seed=n) for n in (30, 50, 70)]
    tables = [E.make_table(p, len(i), 4, manager=m, init=i, name=p)
              for p, i in zip(("fast", "dynamic", "simple"), inits)]
    idx = [rng.integers(0, len(i), 20) for i in inits]
    off = [np.arange(0, 20, 2)] * 3
    out = ca.zeros((10, 16), dtype=np.float32, manager=m)
    E.lookup_tables(tables, idx, off, out, column_offsets=[4, 8, 12])
    got = np.asarray(out)
    assert (got[:, :4] == 0).all()
    for k, init in enumerate(inits):
        np.testing.assert_allclose(got[:, 4 + 4 * k:8 + 4 * k], init[idx[k]].reshape(10, 2, 4).sum(1),
                                   rtol=1e-6)
    dout = np.ones((10, 16), np.float32)
    E.update_tables(tables, idx, off, dout, 0.5, column_offsets=[4, 8, 12])
    for k, (t, init) in enumerate(zip(tables, inits)):
        want = init.copy()
        np.subtract.at(want, idx[k], 0.5)
        np.testing.assert_allclose(t.snapshot(), want, rtol=1e-6, err_msg=t.name)


# ---- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fast", "dynamic"])
def test_bad_indices_name_table_position_and_value(m, kind):
    t = E.make_table(kind, 10, 4, manager=m, name="users")
    with pytest.raises(IndexError, match=r"'users'.*index 10 at position 2"):
        t.lookup(np.array([1, 2, 10, 3]))
    with pytest.raises(IndexError, match=r"'users'.*index -1 at position 0"):
        t.lookup(np.array([-1, 2]), np.array([0, 1]))
    with pytest.raises(IndexError, match="'users'"):
        t.update(np.array([3, 11]), None, np.zeros((2, 4), np.float32), 0.1)
    with pytest.raises(TypeError, match="'users'.*integer"):
        t.lookup(np.array([1.0, 2.0]))
    with pytest.raises(IndexError, match="'users'.*row 10"):
        t.rowpointer(10)
    if kind == "dynamic":
        assert (t.where == -1).all() and t.stats()["lookups"] == 0   # nothing half-cached
        t.check()


@pytest.mark.parametrize("specialised, fs", [(True, 16), (True, 19), (False, 16)])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 19), min_size=1, max_size=6), data=st.data())
def test_bag_lookups_check_each_index_in_the_kernel(m, specialised, fs, lengths, data):
    """Bag lookups of int64 indices leave the range check to the kernel, which checks each
    group of 8, 4 or 1 rows as it reads them: a bad index at any position (negative, just
    past the end, huge) raises the IndexError that names the first one, for plain and
    cached tables and for the kernel called directly, specialised or generic; nothing is
    cached or counted, and with every index valid the sums are the reference's."""
    from cachedarrays.models.dlrm import kernels as K

    old = K.set_specialised(specialised)
    try:
        _check_bag_lookups(m, fs, lengths, data)
    finally:
        K.set_specialised(old)


def _check_bag_lookups(m, fs, lengths, data):
    from cachedarrays.models.dlrm import kernels as K

    nrows = 50
    init = np.arange(nrows * fs, dtype=np.float32).reshape(nrows, fs) / 7
    nidx = sum(lengths)
    idx = np.array(data.draw(st.lists(st.integers(0, nrows - 1), min_size=nidx, max_size=nidx)),
                   dtype=np.int64)
    off = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    want = np.stack([init[idx[a:a + n]].sum(0) for a, n in zip(off, lengths)])
    bad = None
    if nidx and data.draw(st.booleans()):
        pos = data.draw(st.lists(st.integers(0, nidx - 1), min_size=1, max_size=3))
        for p in pos:
            idx[p] = data.draw(st.sampled_from([-1, nrows, nrows + 1, 2**62, -2**63]))
        bad = min(pos)
    tables = [E.SimpleTable(nrows, fs, manager=m, init=init, placement="fast", name="fast"),
              E.CachedEmbeddingTable(nrows, fs, manager=m, init=init, name="dyn")]

    def direct(indices, offsets):
        return K.lookup_sum(init, indices, offsets, np.empty((len(lengths), fs), np.float32),
                            name="direct", check=K.IN_KERNEL)
    for name, look in [(t.name, t.lookup) for t in tables] + [("direct", direct)]:
        if bad is None:
            np.testing.assert_allclose(np.asarray(look(idx, off)), want, rtol=1e-6)
        else:
            with pytest.raises(IndexError, match=rf"'{name}': index {idx[bad]} at position {bad} "):
                look(idx, off)
    if bad is not None:
        assert (tables[1].where == -1).all() and tables[1].stats()["lookups"] == 0
        tables[1].check()
    for t in tables:
        ca.unsafe_free(t.base if isinstance(t, E.CachedEmbeddingTable) else t.data)
        if isinstance(t, E.CachedEmbeddingTable):
            ca.unsafe_free(t.cache)


@pytest.mark.parametrize("kind", ["fast", "dynamic"])
def test_bad_offsets_and_dtypes_are_refused(m, kind):
    t = E.make_table(kind, 10, 4, manager=m, name="items")
    idx = np.array([1, 2, 3, 4])
    with pytest.raises(ValueError, match="'items'.*non-decreasing"):
        t.lookup(idx, np.array([0, 3, 1]))
    with pytest.raises(ValueError, match="'items'.*offsets\\[0\\] must be 0"):
        t.lookup(idx, np.array([1, 2]))
    with pytest.raises(ValueError, match="'items'.*exceeds"):
        t.lookup(idx, np.array([0, 9]))
    with pytest.raises(TypeError, match="'items'.*float64"):
        t.update(idx, np.array([0, 2]), np.zeros((2, 4), np.float64), 0.1)
    with pytest.raises(ValueError, match="'items'"):
        t.update(idx, np.array([0, 2]), np.zeros((2, 5), np.float32), 0.1)
    with pytest.raises(TypeError, match="'ints'.*int32"):
        E.SimpleTable(4, 4, np.int32, manager=m, name="ints")
    with pytest.raises(ValueError, match="'shape'.*init has shape"):
        E.CachedEmbeddingTable(4, 4, manager=m, init=np.zeros((3, 4)), name="shape")
    with pytest.raises(ValueError, match="'ctx'.*context"):
        E.SimpleTable(4, 4, manager=m, name="ctx").lookup(idx[:2], context="backward")


@pytest.mark.parametrize("kind", ["fast", "dynamic"])
@pytest.mark.parametrize("big", [2**64 - 1, 2**63, 2**63 - 1, 10])
def test_unsigned_indices_are_reported_as_given(m, kind, big):
    t = E.make_table(kind, 10, 4, manager=m, name="clicks")
    idx = np.array([1, big, 2], dtype=np.uint64)
    with pytest.raises(IndexError, match=rf"'clicks'.*index {big} at position 1"):
        t.lookup(idx)
    with pytest.raises(IndexError, match=rf"'clicks'.*index {big} at position 1"):
        t.update(idx, None, np.zeros((3, 4), np.float32), 0.1)
    with pytest.raises(IndexError, match=rf"'clicks'.*index {big} at position 1"):
        E.lookup_tables([t], [idx], [np.array([0])], ca.zeros((1, 4), np.float32, manager=m))
    if kind == "dynamic":
        assert (t.where == -1).all()


def test_unsigned_indices_in_range_work(m):
    init = _init(10, 4)
    t = E.SimpleTable(10, 4, manager=m, init=init, name="u")
    idx = np.array([9, 0, 3], dtype=np.uint64)
    np.testing.assert_array_equal(np.asarray(t.lookup(idx)), init[[9, 0, 3]])


def test_huge_unsigned_offsets_are_reported_as_given(m):
    t = E.SimpleTable(10, 4, manager=m, name="bags")
    with pytest.raises(ValueError, match=rf"'bags'.*offsets value {2**64 - 1}"):
        t.lookup(np.array([1, 2]), np.array([0, 2**64 - 1], dtype=np.uint64))


@pytest.mark.parametrize("kind", ["fast", "dynamic"])
@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -float("inf"), -0.1, np.float32("nan"),
                                1e300])
def test_bad_learning_rates_are_refused_before_any_write(m, kind, lr):
    init = _init(10, 4)
    t = E.make_table(kind, 10, 4, manager=m, init=init, name="lr")
    idx, dout = np.array([1, 2]), np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match="'lr'.*learning rate"):
        t.update(idx, None, dout, lr)
    with pytest.raises(ValueError, match="'lr'.*learning rate"):
        E.update_tables([t], [idx], [None], dout, lr)
    np.testing.assert_array_equal(t.snapshot(), init)


def test_learning_rate_must_be_a_number(m):
    t = E.SimpleTable(10, 4, manager=m, name="lrtype")
    with pytest.raises(TypeError, match="'lrtype'.*learning rate"):
        t.update(np.array([1]), None, np.ones((1, 4), np.float32), "0.1")


def test_zero_and_numpy_learning_rates_are_accepted(m):
    init = _init(10, 4)
    t = E.SimpleTable(10, 4, manager=m, init=init, name="ok")
    t.update(np.array([1]), None, np.ones((1, 4), np.float32), 0)
    np.testing.assert_array_equal(t.snapshot(), init)
    t.update(np.array([1]), None, np.ones((1, 4), np.float32), np.float32(0.5))
    np.testing.assert_allclose(t.snapshot()[1], init[1] - 0.5)


# ---- CachedEmbeddingTable == SimpleTable under any sequence of operations ------------------

NROWS, FS = 40, 3


class CachedMatchesSimple(RuleBasedStateMachine):
    """Random lookups, updates, flushes and resizes leave both tables with equal values."""

    flush_policy = "oldest"

    def __init__(self):
        super().__init__()
        self.m = ca.Manager(fast="8MiB", slow="32MiB")
        init = _init(NROWS, FS, seed=11)
        self.simple = E.SimpleTable(NROWS, FS, manager=self.m, init=init, name="simple")
        self.cached = E.CachedEmbeddingTable(NROWS, FS, manager=self.m, init=init,
                                             cachelower=0.2, cacheslack=0.1, page_rows=3,
                                             name="cached", flush_policy=self.flush_policy)

    def teardown(self):
        self.m.close()

    @rule(rows=st.lists(st.integers(0, NROWS - 1), min_size=0, max_size=24),
          bag=st.integers(1, 4), cache=st.booleans())
    def lookup(self, rows, bag, cache):
        idx = np.array(rows, dtype=np.int64)
        off = np.arange(0, len(rows), bag, dtype=np.int64)
        a = np.asarray(self.simple.lookup(idx, off))
        fn = self.cached.access_and_cache if cache else self.cached.access
        b = np.asarray(fn(idx, off))
        np.testing.assert_array_equal(a, b)

    @rule(rows=st.lists(st.integers(0, NROWS - 1), min_size=1, max_size=24),
          lr=st.sampled_from([0.5, 1.0, 2.0]), seed=st.integers(0, 2 ** 16))
    def update(self, rows, lr, seed):
        idx = np.array(rows, dtype=np.int64)
        dout = np.random.default_rng(seed).standard_normal((len(rows), FS)).astype(np.float32)
        self.simple.update(idx, None, dout, lr)
        self.cached.update(idx, None, dout, lr)

    @rule(rows=st.sampled_from([None, 0, 3, 7]))
    def flush_dirty(self, rows):
        self.cached.flush_dirty(rows)

    @precondition(lambda self: not self.cached.dirty_slots.any())
    @rule()
    def flush_clean(self):
        self.cached.flush_clean()

    @rule()
    def flush_clean_or_refuse(self):
        """flush_clean with dirty rows either drops none of them or refuses, changing nothing."""
        before = (self.cached.snapshot(), self.cached.where.copy(), self.cached.cache_bytes)
        try:
            self.cached.flush_clean()
        except RuntimeError as e:
            assert "flush_dirty" in str(e)
            np.testing.assert_array_equal(before[0], self.cached.snapshot())
            np.testing.assert_array_equal(before[1], self.cached.where)
            assert before[2] == self.cached.cache_bytes

    @rule()
    def writeback(self):
        self.cached.writeback()

    @rule()
    def maintain(self):
        self.cached.maintain()

    @rule(lower=st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    def resize(self, lower):
        self.cached.set_cachelower(lower)

    @invariant()
    def same_values(self):
        self.cached.check()
        np.testing.assert_array_equal(self.simple.snapshot(), self.cached.snapshot())


TestCachedMatchesSimple = CachedMatchesSimple.TestCase
TestCachedMatchesSimple.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


class SecondChanceMatchesSimple(CachedMatchesSimple):
    """The same with flushes that move the rows looked up since they were cached."""

    flush_policy = "second-chance"

    @invariant()
    def only_held_slots_are_marked(self):
        assert not self.cached.refs[self.cached.where < 0].any()


TestSecondChanceMatchesSimple = SecondChanceMatchesSimple.TestCase
TestSecondChanceMatchesSimple.settings = settings(TestCachedMatchesSimple.settings, max_examples=80)


class WideWhereMatchesSimple(CachedMatchesSimple):
    """The same with the int64 ``where`` of tables over 2**30 rows (every kernel that reads or
    writes ``where`` has its int64 form run)."""

    def __init__(self):
        super().__init__()
        assert self.cached.where.dtype == np.int32
        self.cached.where = self.cached.where.astype(np.int64)


TestWideWhereMatchesSimple = WideWhereMatchesSimple.TestCase
TestWideWhereMatchesSimple.settings = TestCachedMatchesSimple.settings


def test_where_dtype_is_int32_while_rows_and_slots_fit():
    assert E.where_dtype(1) == E.where_dtype(2**30 - 1) == np.int32
    assert E.where_dtype(2**30) == E.where_dtype(2**40) == np.int64


# ---- cached tables looked up together --------------------------------------------------------

from cachedarrays.models.dlrm.kernels import lookup_cached_many as _LOOKUP_CACHED_MANY  # noqa: E402
from cachedarrays.models.dlrm.kernels import update_cached_many as _UPDATE_CACHED_MANY  # noqa: E402

def _ensemble_run(together, kinds, sizes, fss, distribution, flush, monkeypatch, steps=8,
                  bad=None):
    """Train an ensemble for a few steps with the cached tables looked up together or one at a
    time: (outputs, every table's stats, where and values, kernel calls that took them)."""
    from cachedarrays.models.dlrm import kernels as K
    from cachedarrays.models.dlrm.data import SyntheticDataset

    monkeypatch.setattr(E, "CACHED_TOGETHER", together)
    taken = []

    def spy(real, what):
        def call(*a, **k):
            got = real(*a, **k)
            taken.append((what, got is not None))
            return got
        return call
    monkeypatch.setattr(K, "lookup_cached_many", spy(_LOOKUP_CACHED_MANY, "lookup"))
    monkeypatch.setattr(K, "update_cached_many", spy(_UPDATE_CACHED_MANY, "update"))
    data = SyntheticDataset(len(sizes), sizes, 256, pooling=3, distribution=distribution,
                            seed=5, num_batches=steps)
    width = sum(fss)
    outs = []
    with ca.Manager(fast="64MiB", slow="64MiB") as m:
        tables = [E.make_table(kind, n, fs, manager=m, cache=0.25, seed=k, name=f"t{k}",
                               flush_policy=flush)
                  for k, (kind, n, fs) in enumerate(zip(kinds, sizes, fss))]
        out = ca.empty((256, width), dtype=np.float32, manager=m)
        for r in range(steps):
            b = data.batch(r)
            indices = list(b.indices)
            if bad is not None and r == steps - 1:
                indices[bad] = indices[bad].copy()
                indices[bad][7] = sizes[bad]             # one past the table's last row
                before = [t.stats() for t in tables]
                with pytest.raises(IndexError, match=f"table 't{bad}': index {sizes[bad]} at "
                                                     "position 7"):
                    E.lookup_tables(tables, indices, b.offsets, out)
                assert [t.stats() for t in tables] == before     # nothing cached or counted
                values = [t.snapshot() for t in tables]
                with pytest.raises(IndexError, match=f"table 't{bad}': index {sizes[bad]}"):
                    E.update_tables(tables, indices, b.offsets, np.ones((256, width),
                                                                       np.float32), 0.01)
                assert [t.stats() for t in tables] == before     # nothing updated either
                for t, v in zip(tables, values):
                    np.testing.assert_array_equal(t.snapshot(), v)
                break
            E.lookup_tables(tables, indices, b.offsets, out)
            with ca.readable(out) as o:
                outs.append(o.copy())
            dout = np.random.default_rng(r).standard_normal((256, width)).astype(np.float32)
            E.update_tables(tables, indices, b.offsets, dout, 0.01)
            for t in tables:
                t.maintain()
        for t in tables:
            if isinstance(t, E.CachedEmbeddingTable):
                t.check()
        state = [(t.stats(), np.concatenate([getattr(t, "where", np.empty(0)),
                                             getattr(t, "dirty_slots", np.empty(0))]),
                  t.snapshot()) for t in tables]
    return outs, state, taken


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("distribution", ["uniform", "zipf"])
@pytest.mark.parametrize("flush", ["oldest", "second-chance"])
def test_cached_tables_looked_up_together_match_one_at_a_time(kind, distribution, flush,
                                                              monkeypatch):
    """Several cached tables (beside SimpleTables) take one kernel for their lookups and one
    for their updates, and every output, hit count, cached row, dirty mark, table value and
    statistic is what taking them one at a time gives, bit for bit, step after step (with
    flushes between)."""
    kinds = [kind, "fast", kind, "simple", kind]
    sizes, fss = [5000, 300, 12000, 77, 40], [8] * 5
    one = _ensemble_run(False, kinds, sizes, fss, distribution, flush, monkeypatch)
    together = _ensemble_run(True, kinds, sizes, fss, distribution, flush, monkeypatch)
    assert one[2] == [] and together[2] == [("lookup", True), ("update", True)] * 8
    for a, b in zip(one[0], together[0]):
        np.testing.assert_array_equal(a, b)
    for (sa, wa, va), (sb, wb, vb) in zip(one[1], together[1]):
        assert sa == sb
        np.testing.assert_array_equal(wa, wb)
        np.testing.assert_array_equal(va, vb)
    assert sum(s["hits"] for s, _, _ in together[1]) > 0


def test_cached_tables_of_different_widths_are_looked_up_one_at_a_time(monkeypatch):
    """The kernels take one feature size: given several, they decline (having done nothing)
    and the tables go one at a time, with the same results."""
    kinds, sizes, fss = ["dynamic", "dynamic", "static"], [900, 400, 600], [8, 4, 8]
    one = _ensemble_run(False, kinds, sizes, fss, "zipf", "oldest", monkeypatch, steps=4)
    together = _ensemble_run(True, kinds, sizes, fss, "zipf", "oldest", monkeypatch, steps=4)
    assert together[2] == [("lookup", False), ("update", False)] * 4
    for a, b in zip(one[0], together[0]):
        np.testing.assert_array_equal(a, b)
    assert [s for s, _, _ in one[1]] == [s for s, _, _ in together[1]]


@pytest.mark.parametrize("together", [False, True])
def test_a_bad_index_in_a_cached_ensemble_caches_and_counts_nothing(together, monkeypatch):
    """An index out of range in the third of three cached tables raises IndexError naming
    that table, position and value; taken together, no table has cached, counted or updated
    anything (one at a time, the tables before it have, as their own lookups would)."""
    kinds, sizes, fss = ["dynamic"] * 3, [900, 400, 600], [4] * 3
    if together:
        _ensemble_run(True, kinds, sizes, fss, "uniform", "oldest", monkeypatch, steps=3,
                      bad=2)
    else:
        with pytest.raises(AssertionError):      # the first two tables counted their lookups
            _ensemble_run(False, kinds, sizes, fss, "uniform", "oldest", monkeypatch,
                          steps=3, bad=2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_cached_ensembles_match_one_at_a_time(data):
    """Random ensembles of cached tables (2-4 of them, 1-300 rows, static or dynamic, beside
    a SimpleTable or not) on random bags (empty ones, empty tables, batches of 1-20) give the
    same outputs, values and statistics taken together as one at a time, step after step."""
    rng_seed = data.draw(st.integers(0, 2**16), label="seed")
    ntables = data.draw(st.integers(2, 4), label="cached tables")
    sizes = data.draw(st.lists(st.integers(1, 300), min_size=ntables, max_size=ntables),
                      label="rows")
    kinds = data.draw(st.lists(st.sampled_from(["static", "dynamic"]), min_size=ntables,
                               max_size=ntables), label="kinds")
    simple = data.draw(st.booleans(), label="with a SimpleTable")
    nbags = data.draw(st.integers(1, 20), label="bags")
    maxlen = data.draw(st.integers(0, 3), label="longest bag")
    if simple:
        kinds, sizes = kinds + ["fast"], sizes + [50]
    rng = np.random.default_rng(rng_seed)
    steps = [[_bags(rng, n, nbags, maxlen) for n in sizes] for _ in range(3)]
    douts = [rng.standard_normal((nbags, 4 * len(sizes))).astype(np.float32) for _ in steps]

    from cachedarrays.models.dlrm import kernels as K

    taken = []

    def counted(*a, **k):
        got = _LOOKUP_CACHED_MANY(*a, **k)
        taken.append(got is not None)
        return got

    def run(together):
        E.CACHED_TOGETHER = together
        K.lookup_cached_many = counted
        try:
            with ca.Manager(fast="8MiB", slow="8MiB") as m:
                tables = [E.make_table(kind, n, 4, manager=m, cache=0.3, seed=k, page_rows=8,
                                       name=f"t{k}") for k, (kind, n) in enumerate(zip(kinds, sizes))]
                out = ca.empty((nbags, 4 * len(sizes)), dtype=np.float32, manager=m)
                got = []
                for bags, dout in zip(steps, douts):
                    idx, off = [b[0] for b in bags], [b[1] for b in bags]
                    E.lookup_tables(tables, idx, off, out)
                    got.append(np.asarray(out))
                    E.update_tables(tables, idx, off, dout, 0.05)
                    for t in tables:
                        t.maintain()
                for t in tables:
                    if isinstance(t, E.CachedEmbeddingTable):
                        t.check()
                return got, [(t.stats(), t.snapshot()) for t in tables]
        finally:
            E.CACHED_TOGETHER = True
            K.lookup_cached_many = _LOOKUP_CACHED_MANY

    one, together = run(False), run(True)
    assert taken == [True] * 3                     # the shared kernel took every step
    for a, b in zip(one[0], together[0]):
        np.testing.assert_array_equal(a, b)
    for (sa, va), (sb, vb) in zip(one[1], together[1]):
        assert sa == sb
        np.testing.assert_array_equal(va, vb)
