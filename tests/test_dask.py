"""CachedArray as a dask chunk type: graphs over CachedArray chunks stay CachedArrays, compared
with NumPy, with no conversion to ndarray on the way."""

import numpy as np
import pytest

import cachedarrays as ca

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
import cachedarrays.dask  # noqa: E402,F401  (registers the chunk type)


@pytest.fixture
def m():
    with ca.Manager(fast="2MiB", slow="64MiB") as manager:   # chunks outgrow fast memory
        yield manager


def _conversions(m):
    return m.stats()["events"].get("asarray", {}).get("count", 0)


def _dask(m, a, chunks):
    return da.from_array(ca.asarray(a, manager=m), chunks=chunks, asarray=False)


OPS = [
    ("blockwise", lambda x, y: np.exp(x) * 2 - x, lambda a, b: np.exp(a) * 2 - a),
    ("matmul", lambda x, y: x @ y, lambda a, b: a @ b),
    ("sum axis 0", lambda x, y: (x + 1).sum(axis=0), lambda a, b: (a + 1).sum(axis=0)),
    ("std axis 1", lambda x, y: x.std(axis=1), lambda a, b: a.std(axis=1)),
    ("max", lambda x, y: x.max(axis=1), lambda a, b: a.max(axis=1)),
    ("argmin", lambda x, y: x.argmin(axis=0), lambda a, b: a.argmin(axis=0)),
    ("cumsum", lambda x, y: x.cumsum(axis=0), lambda a, b: a.cumsum(axis=0)),
    ("where", lambda x, y: da.where(x > 0.5, x, -x), lambda a, b: np.where(a > .5, a, -a)),
    ("transpose", lambda x, y: (x.T @ x)[:, :7], lambda a, b: (a.T @ a)[:, :7]),
    ("concatenate", lambda x, y: da.concatenate([x, x * 2]), lambda a, b: np.concatenate([a, a * 2])),
]


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
@pytest.mark.parametrize("name, op, ref", OPS, ids=[o[0] for o in OPS])
def test_graphs_over_cached_chunks_compute_cached_results_without_conversions(
        m, scheduler, name, op, ref):
    rng = np.random.default_rng(3)
    a, b = rng.random((300, 240)), rng.random((240, 90))
    x, y = _dask(m, a, (100, 80)), _dask(m, b, (80, 45))
    e = op(x, y)
    # dask builds an arg reduction's metadata from NumPy alone; its chunks are still ours
    assert isinstance(e._meta, np.ndarray if name == "argmin" else ca.CachedArray), name
    before = _conversions(m)
    got = e.compute(scheduler=scheduler)
    assert isinstance(got, ca.CachedArray) and got.manager is m
    assert _conversions(m) == before                  # no chunk went through np.asarray
    with ca.readable(got) as g:
        np.testing.assert_allclose(g, ref(a, b), rtol=1e-12, atol=1e-12)
    m.check()


def test_linalg_and_map_blocks_keep_cached_chunks(m):
    rng = np.random.default_rng(4)
    a = rng.random((400, 30))
    x = _dask(m, a, (100, 30))
    q, r = da.linalg.qr(x)
    qq, rr = dask.compute(q, r)
    assert isinstance(qq, ca.CachedArray) and isinstance(rr, ca.CachedArray)
    with ca.readable(qq) as qv, ca.readable(rr) as rv:
        np.testing.assert_allclose(qv @ rv, a, atol=1e-10)
        np.testing.assert_allclose(qv.T @ qv, np.eye(30), atol=1e-10)
    plain = da.from_array(a, chunks=(100, 30))           # numpy chunks made cached per block
    cached = plain.map_blocks(lambda c: ca.asarray(c, manager=m), meta=ca.empty((0, 0), manager=m))
    got = (cached * 3).sum(axis=0).compute()
    assert isinstance(got, ca.CachedArray)
    with ca.readable(got) as g:
        np.testing.assert_allclose(g, 3 * a.sum(axis=0))
    total = (cached * 3).sum().compute()             # a full reduction: a NumPy scalar, as
    assert np.isclose(total, 3 * a.sum()) and np.ndim(total) == 0    # CachedArray.sum() gives


def test_sizeof_and_tokens_name_a_chunk_without_reading_it(m):
    from dask.base import tokenize
    from dask.sizeof import sizeof
    x = ca.asarray(np.zeros((50, 40)), manager=m)
    assert sizeof(x) == x.nbytes == 16000 and sizeof(x[:10]) == 3200
    t = tokenize(x)
    assert tokenize(x) == t and tokenize(x[1:]) != t and tokenize(x.T) != t
    same_values = ca.asarray(np.zeros((50, 40)), manager=m)
    assert tokenize(same_values) != t                  # another object, another token
    x += 1                                             # a write: a new version
    assert tokenize(x) != t
    with ca.Manager(fast="1MiB", slow="4MiB") as other:
        y = ca.asarray(np.zeros((50, 40)), manager=other)
        assert tokenize(y) != tokenize(same_values)    # object ids repeat across managers


def test_np_array_like_a_cached_array_takes_numpys_arguments(m):
    x = ca.asarray(np.arange(6.0), manager=m)
    y = np.array([1, 2, 3], like=x, ndmin=3)
    assert isinstance(y, ca.CachedArray) and y.shape == (1, 1, 3)
    z = np.asarray([1, 2], like=x, dtype=np.float32)
    assert isinstance(z, ca.CachedArray) and z.dtype == np.float32
    with pytest.raises(ValueError, match="copy=False.*copy=None"):
        np.array([1.0], like=x, copy=False)
