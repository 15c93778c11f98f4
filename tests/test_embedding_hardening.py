"""Embedding tables and DLRM under hostile use: array subclasses, threads, shared tables,
aliased outputs, failed resizes and calls that fail part way."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import cachedarrays as ca
from cachedarrays.models.dlrm import embedding as E
from cachedarrays.models.dlrm import kernels as K


@pytest.fixture(scope="module")
def m():
    with ca.Manager(fast="64MiB", slow="256MiB") as manager:
        yield manager


def _init(n, fs, seed=0):
    return np.random.default_rng(seed).standard_normal((n, fs)).astype(np.float32)


def _sums(init, idx, off, nbags):
    ends = np.append(off[1:], len(idx))[:nbags]
    return np.stack([init[idx[s:e]].sum(0) for s, e in zip(off, ends)])


def _run(code):
    """Run ``code`` in a fresh interpreter (a write past an array's end must not take the
    test process down with it); returns (exit code, output)."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=600, env=env)
    return p.returncode, p.stdout + p.stderr


def test_array_subclasses_as_out_and_dout_are_used_through_their_data():
    code, output = _run("""
        import numpy as np, cachedarrays as ca
        from cachedarrays.models.dlrm import SimpleTable, CachedEmbeddingTable, lookup_tables
        from cachedarrays.models.dlrm import update_tables, kernels
        m = ca.Manager(fast="16MiB", slow="64MiB")
        N, F, B = 100, 8, 10
        init = np.random.default_rng(1).standard_normal((N, F)).astype(np.float32)
        idx = np.random.default_rng(0).integers(0, N, 4 * B); off = np.arange(0, 4 * B, 4)
        ref = init[idx].reshape(B, 4, F).sum(1)
        def outs():
            yield np.asmatrix(np.zeros((B, F), np.float32))
            yield np.ma.zeros((B, F), np.float32)
            yield np.asmatrix(np.zeros((B, 2 * F), np.float32))[:, F:]   # strided rows
        for kind in ("simple", "cached", "kernel"):
            for o in outs():
                if kind == "simple":
                    r = SimpleTable(N, F, manager=m, init=init).lookup(idx, off, out=o)
                elif kind == "cached":
                    r = CachedEmbeddingTable(N, F, manager=m, init=init).lookup(idx, off, out=o)
                else:
                    r = kernels.lookup_sum(init, idx, off, o)
                assert r is o and type(r) is type(o), (kind, type(r))
                assert np.allclose(np.asarray(o), ref, atol=1e-5), kind
        ts = [CachedEmbeddingTable(N, F // 2, manager=m, init=init[:, :4]),
              CachedEmbeddingTable(N, F // 2, manager=m, init=init[:, 4:])]
        o = np.asmatrix(np.zeros((B, F), np.float32))
        lookup_tables(ts, [idx, idx], [off, off], o)
        assert np.allclose(np.asarray(o), ref, atol=1e-5)
        d = np.random.default_rng(2).standard_normal((B, F)).astype(np.float32)
        want = init.astype(np.float64)
        np.subtract.at(want, idx, 0.5 * np.repeat(d, 4, axis=0))
        for make in (lambda: SimpleTable(N, F, manager=m, init=init),
                     lambda: CachedEmbeddingTable(N, F, manager=m, init=init, cachelower=1.0)):
            for g in (np.asmatrix(d), np.ma.masked_array(d)):
                t = make()
                t.lookup(idx, off)
                t.update(idx, off, g, 0.5)
                assert np.allclose(t.snapshot(), want, atol=1e-4), type(t).__name__
        t = SimpleTable(N, 4, manager=m, init=init[:, :4])
        update_tables([t], [idx], [off], np.asmatrix(d[:, :4]), 0.5)
        print("all ok")
    """)
    assert code == 0 and "all ok" in output, output


def test_masked_entries_in_out_or_dout_are_refused(m):
    t = E.SimpleTable(20, 4, manager=m, name="users")
    o = np.ma.masked_array(np.zeros((2, 4), np.float32), mask=[[1, 0, 0, 0], [0] * 4])
    with pytest.raises(ValueError, match="'users': out is a masked array with masked entries"):
        t.lookup(np.array([1, 2]), out=o)
    with pytest.raises(ValueError, match="'users': dout is a masked array"):
        t.update(np.array([1, 2]), None, o, 0.1)


def _lookups_in_two_threads(table, init, rounds=40):
    rng = [np.random.default_rng(k) for k in range(2)]
    batches = [[r.integers(0, table.nvectors, 4000) for _ in range(rounds)] for r in rng]
    off = np.arange(0, 4000, 8)
    wrong = [0, 0]

    def worker(k):
        for idx in batches[k]:
            with ca.readable(table.lookup(idx, off)) as y:
                wrong[k] += not np.allclose(y, _sums(init, idx, off, 500), atol=1e-4)
            table.maintain()            # a full cache flushed: the next lookups cache again

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    return wrong


def test_lookups_from_two_threads_on_one_cached_table_keep_it_consistent(m):
    n, fs = 20000, 16
    init = _init(n, fs)
    for _ in range(5):
        t = E.CachedEmbeddingTable(n, fs, manager=m, init=init, cachelower=0.2,
                                   cacheslack=0.05, page_rows=256)
        assert _lookups_in_two_threads(t, init) == [0, 0]
        t.check()
        assert np.array_equal(t.snapshot(), init)


@pytest.mark.parametrize("flush_policy", ["oldest", "second-chance"])
def test_a_lookup_thread_and_an_update_thread_with_maintenance_lose_nothing(m, flush_policy):
    n, fs, nbags, rounds = 20000, 16, 500, 60
    init = _init(n, fs)
    rng = np.random.default_rng(11)
    work = [(rng.integers(0, n, 8 * nbags), rng.standard_normal((nbags, fs)).astype(np.float32))
            for _ in range(2 * rounds)]
    off = np.arange(0, 8 * nbags, 8)
    want = init.astype(np.float64)
    for idx, d in work[rounds:]:
        np.subtract.at(want, idx, 0.01 * np.repeat(d, 8, axis=0))
    t = E.CachedEmbeddingTable(n, fs, manager=m, init=init, cachelower=0.2, cacheslack=0.05,
                               page_rows=256, flush_policy=flush_policy)
    errors = []

    def worker(k):
        try:
            for idx, d in work[k * rounds:(k + 1) * rounds]:
                if k:
                    t.update(idx, off, d, 0.01)
                else:
                    t.lookup(idx, off)
                t.maintain()
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    assert errors == []
    t.check()
    assert np.allclose(t.snapshot(), want, atol=1e-4)


def test_two_threads_on_ensembles_sharing_tables_in_opposite_orders(m):
    """lookup_tables / update_tables of [a, b, s] in one thread and [s, b, a] in another hold
    the same locks in one order (no deadlock), and updates of disjoint rows all land."""
    n, fs, nbags, rounds = 4000, 16, 256, 30
    inits = [_init(n, fs, seed) for seed in range(3)]
    a, b = (E.CachedEmbeddingTable(n, fs, manager=m, init=inits[k], cachelower=0.2,
                                   cacheslack=0.05, page_rows=128, name=f"t{k}")
            for k in range(2))
    s = E.SimpleTable(n, fs, manager=m, init=inits[2], name="s")
    off = np.arange(0, 4 * nbags, 4)
    rng = np.random.default_rng(5)
    # thread 0 updates rows below n/2, thread 1 rows above: every update lands, in any order
    work = [[(rng.integers(k * n // 2, (k + 1) * n // 2, (3, 4 * nbags)),
              rng.standard_normal((nbags, 3 * fs)).astype(np.float32)) for _ in range(rounds)]
            for k in range(2)]
    orders = [[a, b, s], [s, b, a]]
    want = {id(t): init.astype(np.float64) for t, init in zip((a, b, s), inits)}
    for k in range(2):
        for idx, d in work[k]:
            for j, t in enumerate(orders[k]):
                np.subtract.at(want[id(t)], idx[j], 0.01 * np.repeat(d[:, j * fs:(j + 1) * fs],
                                                                     4, axis=0))
    errors = []

    def worker(k):
        try:
            out = np.empty((nbags, 3 * fs), np.float32)
            for idx, d in work[k]:
                E.lookup_tables(orders[k], list(idx), [off] * 3, out)
                E.update_tables(orders[k], list(idx), [off] * 3, d, 0.01)
                for t in orders[k]:
                    t.maintain()
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(2)]
    [th.start() for th in threads]
    [th.join(120) for th in threads]
    assert not any(th.is_alive() for th in threads), "the ensembles deadlocked"
    assert errors == []
    for t in (a, b):
        t.check()
    for t in (a, b, s):
        assert np.allclose(t.snapshot(), want[id(t)], atol=1e-4)


@pytest.mark.parametrize("kind", ["simple", "dynamic"])
def test_updates_from_two_threads_on_one_table_are_all_applied(m, kind):
    n, fs, nbags, rounds = 4000, 16, 1000, 60
    init = _init(n, fs)
    rng = np.random.default_rng(5)
    work = [[(rng.integers(0, n, 8 * nbags),
              rng.standard_normal((nbags, fs)).astype(np.float32)) for _ in range(rounds)]
            for _ in range(2)]
    off = np.arange(0, 8 * nbags, 8)
    want = init.astype(np.float64)
    for part in work:
        for idx, d in part:
            np.subtract.at(want, idx, 0.01 * np.repeat(d, 8, axis=0))
    for _ in range(3):
        t = E.make_table(kind, n, fs, manager=m, cache=1.0, init=init)
        if kind == "dynamic":
            t.lookup(np.arange(n))

        def worker(k):
            for idx, d in work[k]:
                t.update(idx, off, d, 0.01)
                t.maintain()

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
        [th.start() for th in threads]
        [th.join() for th in threads]
        lost = int((~np.isclose(t.snapshot(), want, atol=1e-4).all(1)).sum())
        assert lost == 0
        if kind == "dynamic":
            t.check()


@pytest.mark.parametrize("kind", ["fast", "simple", "dynamic", "static"])
def test_a_table_given_twice_to_an_ensemble_gets_both_updates(m, kind):
    n, fs, b = 2000, 64, 4000
    rng = np.random.default_rng(0)
    init = rng.standard_normal((n, fs)).astype(np.float32)
    idx = [rng.integers(0, n, b), rng.integers(0, n, b)]
    off = np.arange(b)
    dout = rng.standard_normal((b, 2 * fs)).astype(np.float32)
    one = E.make_table(kind, n, fs, manager=m, cache=1.0, init=init)
    if kind == "dynamic":
        one.lookup(np.arange(n))
    for k in range(2):                  # the calls in turn
        one.update(idx[k], off, dout[:, k * fs:(k + 1) * fs], 0.01)
    for _ in range(3):
        t = E.make_table(kind, n, fs, manager=m, cache=1.0, init=init)
        if kind == "dynamic":
            t.lookup(np.arange(n))
        out = np.zeros((b, 2 * fs), np.float32)
        E.lookup_tables([t, t], idx, [off, off], out)
        assert np.array_equal(out, np.concatenate([init[i] for i in idx], axis=1))
        E.update_tables([t, t], idx, [off, off], dout, 0.01)
        assert np.array_equal(t.snapshot(), one.snapshot())


def test_writes_through_an_update_rowpointer_survive_a_flush(m):
    t = E.CachedEmbeddingTable(1000, 8, manager=m, cachelower=0.0, cacheslack=0.1, name="rp")
    t.lookup(np.array([7]))
    before = t[7]
    arr, pos = t.rowpointer(7, E.UPDATE)
    assert arr is t.cache
    with ca.writable(arr) as a:
        a[pos] -= 1.0
    t.check()
    t.flush_dirty(0)
    assert np.allclose(t[7], before - 1.0)
    t.check()


def test_a_pool_that_does_not_fit_leaves_the_table_as_it_was():
    with ca.Manager(fast="1MiB", slow="8MiB") as m:
        t = E.CachedEmbeddingTable(20000, 64, manager=m, cachelower=0.05, cacheslack=0.01,
                                   name="t")
        idx = np.random.default_rng(0).integers(0, 20000, 2000)
        off = np.arange(0, 2000, 10)
        t.lookup(idx, off)
        t.update(idx, off, np.ones((200, 64), np.float32), 0.5)
        before = t.snapshot()
        sizes = (t.cachelower, t.cacheslack, t.npages, t.page_rows)
        for resize in (t.set_cachelower, t.set_cacheslack):
            with pytest.raises(ca.OutOfMemoryError):
                resize(1.0)
            assert (t.cachelower, t.cacheslack, t.npages, t.page_rows) == sizes
            assert np.array_equal(t.snapshot(), before)
            t.check()
            y = t.lookup(idx, off)
            with ca.readable(y) as v:
                assert np.allclose(v, _sums(before, idx, off, 200), atol=1e-4)
            t.check()
        del t


def _mixed(m, n=100):
    return [E.SimpleTable(n, 8, manager=m, name="s0"),
            E.CachedEmbeddingTable(n, 8, manager=m, name="c1", cachelower=1.0),
            E.CachedEmbeddingTable(n, 8, manager=m, name="c2", cachelower=1.0)]


@pytest.mark.parametrize("tables", ["mixed", "cached+subclass", "two feature sizes"])
def test_an_ensemble_call_with_a_bad_index_changes_no_table(m, tables):
    if tables == "mixed":
        ts = _mixed(m)
    elif tables == "cached+subclass":
        class Sub(E.CachedEmbeddingTable):
            pass
        ts = [E.CachedEmbeddingTable(100, 8, manager=m, name="c0", cachelower=1.0),
              Sub(100, 8, manager=m, name="sub", cachelower=1.0)]
    else:
        ts = [E.CachedEmbeddingTable(100, 8, manager=m, name="c0", cachelower=1.0),
              E.CachedEmbeddingTable(100, 4, manager=m, name="c1", cachelower=1.0),
              E.CachedEmbeddingTable(100, 4, manager=m, name="c2", cachelower=1.0)]
    b = 16
    width = sum(t.featuresize for t in ts)
    idx = [np.arange(b)] * (len(ts) - 1) + [np.r_[np.arange(b - 1), 100]]
    off = [np.arange(b)] * len(ts)
    before = [(t.snapshot(), t.stats()) for t in ts]
    with pytest.raises(IndexError, match="index 100 at position 15"):
        E.update_tables(ts, idx, off, np.ones((b, width), np.float32), 0.5)
    with pytest.raises(IndexError, match="index 100 at position 15"):
        E.lookup_tables(ts, idx, off, np.zeros((b, width), np.float32))
    for t, (snap, stats) in zip(ts, before):
        assert np.array_equal(t.snapshot(), snap), t.name
        assert t.stats() == stats, t.name


def _dlrm(m):
    from cachedarrays.models.dlrm import DLRM, configs, synthetic_dataset
    cfg = configs.tiny(batch_size=16)
    batch = next(iter(synthetic_dataset(cfg, "zipf", num_batches=1, seed=1)))
    return DLRM(cfg, manager=m, table_kind="dynamic", backend="numpy"), batch


@pytest.mark.parametrize("labels, error", [
    (None, "train_step needs labels, 16 numbers"),
    (["click"] * 16, "labels must be 16 numbers"),
    (np.array([1.0]), r"labels have shape \(1,\) for a batch of 16"),
    (np.ones(15), r"labels have shape \(15,\) for a batch of 16"),
    (np.ones((16, 2)), r"labels have shape \(16, 2\)"),
    (np.r_[np.ones(15), np.nan], "labels must be finite numbers"),
])
def test_train_step_refuses_bad_labels_before_changing_the_model(m, labels, error):
    from cachedarrays.models.dlrm import Batch
    model, b = _dlrm(m)
    before = model.state_dict()
    with pytest.raises((ValueError, TypeError), match=error):
        model.train_step(Batch(b.dense, b.indices, b.offsets, labels))
    after = model.state_dict()
    assert all(np.array_equal(after[k], v) for k, v in before.items())


def test_empty_batches_and_missing_indices_name_the_problem(m):
    from cachedarrays.models.dlrm import Batch
    model, b = _dlrm(m)
    empty = Batch(b.dense[:0], [i[:0] for i in b.indices], None, b.labels[:0])
    with pytest.raises(ValueError, match="the batch is empty"):
        model.train_step(empty)
    with pytest.raises(ValueError, match="the batch is empty"):
        model.predict(empty)
    with pytest.raises(ValueError, match=r"emb.0.*shape \(0,\).*pass offsets"):
        model.train_step(Batch(b.dense, [i[:0] for i in b.indices], None, b.labels))


def test_a_batch_is_a_batch_a_tuple_or_a_dict_and_anything_else_is_named(m):
    model, b = _dlrm(m)
    fields = dict(dense=b.dense, indices=b.indices, offsets=b.offsets, labels=b.labels)
    ref = model.predict(b)
    assert np.array_equal(model.predict(fields), ref)
    assert np.array_equal(model.predict(tuple(fields.values())), ref)
    assert np.isfinite(model.train_step(fields))
    for bad in ({"dense": b.dense, "idx": b.indices}, b.dense, 3, "batch"):
        with pytest.raises(TypeError, match="a batch is a data.Batch"):
            model.train_step(bad)


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -1.0])
def test_zipf_refuses_an_exponent_that_is_not_a_finite_number(alpha):
    from cachedarrays.models.dlrm import SyntheticDataset, ZipfSampler
    with pytest.raises(ValueError, match="finite number >= 0"):
        ZipfSampler(10, alpha)
    with pytest.raises(ValueError, match="finite number >= 0"):
        SyntheticDataset(3, [10, 1000], 8, pooling=2, distribution="zipf", alpha=alpha)


def test_out_or_dout_sharing_the_tables_memory_is_refused(m):
    n, fs = 64, 8
    rng = np.random.default_rng(0)
    idx, off = rng.integers(0, n, 3 * n), np.arange(0, 3 * n, 3)
    s = E.SimpleTable(n, fs, manager=m, name="s")
    c = E.CachedEmbeddingTable(n, fs, manager=m, cachelower=1.0, cacheslack=0.0, page_rows=n,
                               name="c")
    c.lookup(np.arange(n))
    before = s.snapshot(), c.snapshot()
    alias = "shares memory with the table's rows"
    with pytest.raises(ValueError, match=f"'s': out {alias}"):
        s.lookup(idx, off, out=s.data)
    with pytest.raises(ValueError, match=f"'s': out {alias}"):
        s.lookup(idx[:30], off[:10], out=s.data[10:20])
    with pytest.raises(ValueError, match=f"'s': dout {alias}"):
        s.update(rng.permutation(n), np.arange(n), s.data, 0.5)
    for arr in (c.cache, c.base):
        with pytest.raises(ValueError, match=f"'c': out {alias}"):
            c.lookup(idx, off, out=arr, context="update")
        with pytest.raises(ValueError, match=f"'c': dout {alias}"):
            c.update(idx, off, arr, 0.5)
    with ca.writable(c.cache) as pool:      # a view of the pool's memory
        with pytest.raises(ValueError, match=f"'c': out {alias}"):
            c.lookup(idx, off, out=pool[:n], context="update")
    assert np.array_equal(s.snapshot(), before[0]) and np.array_equal(c.snapshot(), before[1])
    c.check()


def test_a_read_only_out_is_refused_by_name(m):
    n, fs = 100, 8
    idx, off = np.arange(40) % n, np.arange(0, 40, 4)
    ro = np.zeros((10, fs), np.float32)
    ro.flags.writeable = False
    ro2 = np.zeros((10, 2 * fs), np.float32)
    ro2.flags.writeable = False
    s = E.SimpleTable(n, fs, manager=m, name="s")
    c = E.CachedEmbeddingTable(n, fs, manager=m, name="c")
    c2 = E.CachedEmbeddingTable(n, fs, manager=m, name="c2")
    for call in (lambda: s.lookup(idx, off, out=ro), lambda: c.lookup(idx, off, out=ro),
                 lambda: E.lookup_tables([c, c2], [idx, idx], [off, off], ro2),
                 lambda: E.lookup_tables([s, c2], [idx, idx], [off, off], ro2),
                 lambda: K.lookup_sum(np.ones((n, fs), np.float32), idx, off, ro),
                 lambda: K.lookup(np.ones((n, fs), np.float32), idx[:10], ro)):
        with pytest.raises(ValueError, match="out is read-only"):
            call()


def test_inputs_of_the_wrong_kind_name_the_argument_and_the_fix(m):
    n, fs = 100, 8
    s = E.SimpleTable(n, fs, manager=m, name="s")
    c = E.CachedEmbeddingTable(n, fs, manager=m, name="c")
    c2 = E.CachedEmbeddingTable(n, fs, manager=m, name="c2")
    idx, off, d = np.arange(40) % n, np.arange(0, 40, 4), np.ones((10, fs), np.float32)
    out16 = np.zeros((10, 16), np.float32)
    cases = [
        (lambda: s.lookup(idx, 0), ValueError, "'s': offsets must be a 1-D integer array"),
        (lambda: c.lookup(idx, 0), ValueError, "'c': offsets must be a 1-D integer array"),
        (lambda: c.lookup(idx, np.int64(3)), ValueError, "'c': offsets must be a 1-D"),
        (lambda: s.update(3, None, d[:1], 0.1), ValueError, "'s': indices must be a 1-D"),
        (lambda: s.update(None, off, d, 0.1), ValueError, "'s': indices must be a 1-D"),
        (lambda: c.update(idx, off, None, 0.1), TypeError,
         r"'c': dout must be a numpy.ndarray or CachedArray of shape \(nbags, 8\)"),
        (lambda: s.lookup(idx, off, out=np.zeros(80, np.float32)), ValueError,
         r"'s': out has shape \(80,\), expected \(nbags, 8\)"),
        (lambda: c.update(idx, off, np.ones(80, np.float32), 0.1), ValueError,
         r"'c': dout has shape \(80,\), expected \(nbags, 8\)"),
        (lambda: s.lookup(idx, off, out=[[0.0] * fs] * 10), TypeError,
         "'s': out must be a numpy.ndarray or CachedArray"),
        (lambda: E.lookup_tables([c, c2], [idx, idx], [off, off], out16, [0]), ValueError,
         r"column_offsets must have one entry per table \(2\)"),
        (lambda: E.update_tables([c, c2], [idx, idx], [off, off], out16, 0.1, [0]), ValueError,
         r"column_offsets must have one entry per table \(2\)"),
        (lambda: E.lookup_tables([c, c2], [idx, idx], [off, off], None), ValueError,
         "out must be a 2-D numpy.ndarray or CachedArray"),
        (lambda: E.update_tables([c, c2], [idx, idx], [off, off], None, 0.1), ValueError,
         "dout must be a 2-D numpy.ndarray or CachedArray"),
        (lambda: E.lookup_tables([s], [3], [None], np.zeros((1, fs), np.float32)), ValueError,
         "'s': indices must be a 1-D integer array"),
        (lambda: E.CachedEmbeddingTable(n, fs, manager=m, cachelower=float("inf")), ValueError,
         "cachelower fraction must be a finite number"),
        (lambda: E.CachedEmbeddingTable(n, fs, manager=m, cacheslack=float("inf")), ValueError,
         "cacheslack fraction must be a finite number"),
        (lambda: c.set_cachelower(float("nan")), ValueError, "cachelower fraction"),
        (lambda: s.update(idx, off, d, 10**400), ValueError,
         "'s': learning rate must be a finite number >= 0, got an integer of 401 digits"),
        (lambda: E.update_tables([s], [idx], [off], d, 10**400), ValueError,
         "learning rate must be a finite number"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_numpy_float_fractions_size_a_cache_like_python_floats(m):
    for value in (np.float32(0.25), np.float64(0.25), 0.25):
        t = E.CachedEmbeddingTable(100, 8, manager=m, cachelower=value, cacheslack=value)
        assert t.cachelower == 25 * t.rowbytes and t.cacheslack == 25 * t.rowbytes


def test_update_histograms_of_a_large_table_can_be_released(m):
    t = E.SimpleTable(1_000_000, 1, manager=m, placement="slow")
    t.update(np.arange(8), None, np.ones((8, 1), np.float32), 0.1)
    assert K._slots.nbytes >= 4_000_000
    assert K.release_buffers() >= 4_000_000
    assert K._slots.nbytes == 0 and K.release_buffers() == 0
    t.update(np.arange(8), None, np.ones((8, 1), np.float32), 0.1)     # allocated afresh
    assert np.allclose(t[3], t.snapshot()[3])
    K.release_buffers()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 200), fs=st.integers(1, 8), over=st.integers(1, 10**6),
       frac=st.floats(1.0, 1e6, exclude_min=True), which=st.sampled_from(["cachelower", "cacheslack"]))
def test_a_cache_size_above_the_whole_table_is_refused_naming_the_largest(m, n, fs, over, frac,
                                                                          which):
    t = E.CachedEmbeddingTable(n, fs, manager=m, cachelower=1.0, cacheslack=1.0, name="big")
    whole = n * t.rowbytes
    assert t.cachelower == whole and t.cacheslack == whole          # the largest is accepted
    setter = getattr(t, f"set_{which}")
    for value, largest in ((frac, "the largest is 1.0"), (whole + over, f"the largest is {whole:,}"),
                           (f"{whole + over}B", f"the largest is {whole:,}")):
        with pytest.raises(ValueError, match=f"'big': {which} .*more than the whole table.*{largest}"):
            E.CachedEmbeddingTable(n, fs, manager=m, name="big", **{which: value})
        with pytest.raises(ValueError, match=f"'big': {which} .*{largest}"):
            setter(value)
        assert t.cachelower == whole and t.cacheslack == whole      # the sizes are kept


def _pair(m, kinds, dtypes, fs=(4, 4)):
    return [E.make_table(k, 50, f, d, manager=m, cache=1.0, init=_init(50, f).astype(d),
                         name=f"{k}{i}")
            for i, (k, d, f) in enumerate(zip(kinds, dtypes, fs))]


@pytest.mark.parametrize("kinds", [("simple", "dynamic"), ("static", "dynamic"),
                                   ("dynamic", "dynamic"), ("fast", "static")])
@pytest.mark.parametrize("case, call, error, message", [
    ("two dtypes", "both", TypeError, "'t1': dtype float64 differs from 't0''s float32; an "
                                      "ensemble needs one dtype"),
    ("block dtype", "both", TypeError, "'t0': (out|dout) dtype float64 differs from the table's float32"),
    ("overlap", "lookup", ValueError, r"tables 't0' \(columns 0..4\) and 't1' \(columns 2..6\) "
                                      "overlap in out"),
    ("fraction", "both", TypeError, r"column_offsets must be whole numbers .*got \[0.0, 4.5\]"),
    ("past the end", "both", ValueError, r"'t1': columns 5..9 do not fit in an output of width 8"),
])
def test_an_ensemble_refused_for_its_dtypes_or_columns_changes_no_table(m, kinds, case, call,
                                                                        error, message):
    dtypes = (np.float32, np.float64) if case == "two dtypes" else (np.float32, np.float32)
    ts = _pair(m, kinds, dtypes)
    for k, t in enumerate(ts):
        t.name = f"t{k}"
    cols = {"overlap": [0, 2], "fraction": [0.0, 4.5], "past the end": [0, 5]}.get(case)
    block = np.full((3, 8), 0.5, np.float64 if case == "block dtype" else np.float32)
    idx, off = [np.arange(3), np.arange(3)], [None, None]
    before = [(t.snapshot(), t.stats()) for t in ts]
    if call == "both":
        with pytest.raises(error, match=message):
            E.update_tables(ts, idx, off, block, 0.5, cols)
    with pytest.raises(error, match=message):
        E.lookup_tables(ts, idx, off, block, cols)
    assert (block == 0.5).all()                                 # out untouched
    for t, (snap, stats) in zip(ts, before):
        assert np.array_equal(t.snapshot(), snap), t.name
        assert t.stats() == stats, t.name
    if case != "two dtypes":                                    # a good call runs
        E.update_tables(ts, idx, off, np.ones((3, 8), np.float32), 0.5, [4, 0])
        assert not np.array_equal(ts[0].snapshot(), before[0][0])


_INDEX_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                 np.uint64, ">i8"]


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_ensembles_of_any_tables_indices_and_column_layout_match_numpy(m, data):
    nt = data.draw(st.integers(1, 4), "tables")
    pool = _pair(m, ["fast", "simple", "static", "dynamic"], [np.float32] * 4,
                 fs=data.draw(st.lists(st.integers(1, 5), min_size=4, max_size=4), "fs"))
    pick = data.draw(st.lists(st.integers(0, 3), min_size=nt, max_size=nt), "picks")
    tables = [pool[k] for k in pick]                        # a table may come twice
    want = {id(t): t.snapshot().astype(np.float64) for t in tables}
    nbags = data.draw(st.integers(0, 6), "bags")
    order = data.draw(st.permutations(range(nt)), "order")
    gaps = data.draw(st.lists(st.integers(0, 2), min_size=nt, max_size=nt), "gaps")
    cols, c = [0] * nt, 0
    for k, g in zip(order, gaps):                           # any order, with gaps
        cols[k], c = c + g, c + g + tables[k].featuresize
    width = c + data.draw(st.integers(0, 2), "extra")
    idx_list, off_list, ref_idx, ref_off = [], [], [], []
    for t in tables:
        sizes = data.draw(st.lists(st.integers(0, 3), min_size=nbags, max_size=nbags))
        off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        idx = np.array(data.draw(st.lists(st.integers(0, t.nvectors - 1), min_size=sum(sizes),
                                          max_size=sum(sizes))), dtype=np.int64)
        dt = data.draw(st.sampled_from(_INDEX_DTYPES))
        form = data.draw(st.sampled_from(["plain", "strided", "read-only", "list"]))
        i = idx.astype(dt)
        if form == "strided":
            i = np.repeat(i, 2)[::2]
        elif form == "read-only":
            i.flags.writeable = False
        elif form == "list":
            i = i.tolist()
        one = all(s == 1 for s in sizes)
        idx_list.append(i)
        off_list.append(None if one and data.draw(st.booleans()) else off)
        ref_idx.append(idx)
        ref_off.append(off)
    out = np.full((nbags, width), 7.0, np.float32)
    E.lookup_tables(tables, idx_list, off_list, out, cols)
    expect = np.full((nbags, width), 7.0)
    for t, c, idx, off in zip(tables, cols, ref_idx, ref_off):
        ends = np.append(off[1:], len(idx))[:nbags] if nbags else off
        for b in range(nbags):
            expect[b, c:c + t.featuresize] = want[id(t)][idx[off[b]:ends[b]]].sum(0)
    assert np.allclose(out, expect, atol=1e-4)
    dout = np.asarray(data.draw(st.lists(st.floats(-2, 2, width=32), min_size=nbags * width,
                                         max_size=nbags * width)), np.float32)
    dout = dout.reshape(nbags, width)
    E.update_tables(tables, idx_list, off_list, dout, 0.5, cols)
    for t, c, idx, off in zip(tables, cols, ref_idx, ref_off):  # in turn, as documented
        ends = np.append(off[1:], len(idx))[:nbags] if nbags else off
        for b in range(nbags):
            for r in idx[off[b]:ends[b]]:
                want[id(t)][r] -= 0.5 * dout[b, c:c + t.featuresize]
    for t in tables:
        assert np.allclose(t.snapshot(), want[id(t)], atol=1e-3), t.name


@pytest.mark.parametrize("kind", ["fast", "simple", "static", "dynamic"])
@pytest.mark.parametrize("empty", [[], ()])
def test_an_empty_list_of_indices_or_offsets_is_an_empty_batch(m, kind, empty):
    t = E.make_table(kind, 50, 2, manager=m, cache=1.0)
    before = t.snapshot()
    assert np.array_equal(t.lookup(empty, None, np.zeros((0, 2), np.float32)), np.zeros((0, 2)))
    assert np.array_equal(t.lookup(empty, [0, 0], np.ones((2, 2), np.float32)), np.zeros((2, 2)))
    assert t.update(empty, empty, np.zeros((0, 2), np.float32), 0.1).size == 0
    out = np.ones((1, 4), np.float32)
    E.lookup_tables([t, t], [empty, empty], [[0], [0]], out)
    assert np.array_equal(out, np.zeros((1, 4)))
    E.update_tables([t, t], [empty, empty], [[0], [0]], np.ones((1, 4), np.float32), 0.1)
    assert np.array_equal(t.snapshot(), before)


@pytest.mark.parametrize("tables", ["simple", "cached", "mixed", "cached+subclass"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_gradient_is_applied_as_numpy_applies_it_to_every_table(m, tables, bad):
    # w -= lr * g, as NumPy (and torch's SGD) do: the rows the bad value reaches take it, the
    # others are updated as usual, and every table of an ensemble is updated (none half)
    class Sub(E.CachedEmbeddingTable):
        pass
    make = {"simple": lambda i: E.SimpleTable(40, 4, manager=m, name=f"s{i}", init=_init(40, 4, i)),
            "cached": lambda i: E.CachedEmbeddingTable(40, 4, manager=m, name=f"c{i}",
                                                       cachelower=0.5, init=_init(40, 4, i)),
            "cached+subclass": lambda i: Sub(40, 4, manager=m, name=f"u{i}", cachelower=0.5,
                                             init=_init(40, 4, i))}
    kinds = ["simple", "cached", "cached"] if tables == "mixed" else [tables] * 3
    ts = [make[k](i) for i, k in enumerate(kinds)]
    for t in ts:
        t.lookup(np.arange(20), None)                       # half the rows cached
    b = 12
    idx = [np.random.default_rng(i).integers(0, 40, 2 * b) for i in range(3)]
    off = [np.arange(0, 2 * b, 2)] * 3
    g = np.random.default_rng(9).standard_normal((b, 12)).astype(np.float32)
    g[5, 9] = bad                                           # the third table's block, bag 5
    want = []
    for k, t in enumerate(ts):
        w = t.snapshot()
        for bag in range(b):
            for r in idx[k][2 * bag:2 * bag + 2]:
                w[r] -= np.float32(0.5) * g[bag, 4 * k:4 * k + 4]
        want.append(w)
    singly = [make[k](i) for i, k in enumerate(kinds)]
    for t in singly:
        t.lookup(np.arange(20), None)
    E.update_tables(ts, idx, off, g, 0.5)
    for k, t in enumerate(singly):
        t.update(idx[k], off[k], g[:, 4 * k:4 * k + 4].copy(), 0.5)
    for k in range(3):
        for got in (ts[k].snapshot(), singly[k].snapshot()):
            np.testing.assert_allclose(got, want[k], rtol=1e-5, atol=1e-5)
    assert not np.isfinite(want[2]).all() and np.isfinite(want[0]).all()
