"""The dynamic cache keeps its hot rows under Zipf indices; hit counting and miss marking of
the indirect lookup; ensembles of one feature size run the specialised kernels."""

import numpy as np
import pytest

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
