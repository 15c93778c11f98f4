"""CachedArray behaves like numpy.ndarray: same values and the corresponding types."""

import copy
import pickle

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.errors import UseAfterFreeError
from helpers import assert_eq, same


def pair(m, a):
    return ca.asarray(a, manager=m), a


RNG = np.random.default_rng(0)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.uint16, np.int32, np.int64,
                                   np.float16, np.float32, np.float64, np.complex64,
                                   np.complex128, "S5", "U3",
                                   np.dtype([("a", "i4"), ("b", "f8", (2,))])])
def test_any_fixed_size_dtype_round_trips(m, dtype):
    a = np.zeros(7, dtype=dtype)
    x = ca.asarray(a, manager=m)
    assert x.dtype == np.dtype(dtype)
    assert_eq(x, a, exact=True)


def test_object_dtype_is_refused_clearly(m):
    with pytest.raises(TypeError, match="fixed-size dtype"):
        ca.asarray(np.array([object()]), manager=m)
    with pytest.raises(TypeError, match="fixed-size dtype"):
        ca.empty(3, dtype=object, manager=m)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)])
@pytest.mark.parametrize("order", ["C", "F"])
def test_shapes_and_orders(m, shape, order):
    a = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape, order=order)
    x = ca.array(a, order=order, manager=m)
    assert_eq(x, a, exact=True)
    assert x.ndim == len(shape) and x.size == a.size and x.nbytes == a.nbytes


def test_creation_functions(m):
    same(ca.zeros((2, 3), manager=m), np.zeros((2, 3)))
    same(ca.ones(4, dtype=np.int32, manager=m), np.ones(4, dtype=np.int32))
    same(ca.full((2,), 7.5, manager=m), np.full((2,), 7.5))
    e = ca.empty((3, 2), dtype=np.float32, manager=m)
    assert e.shape == (3, 2) and e.dtype == np.float32
    base = ca.ones((2, 2), manager=m)
    same(ca.zeros_like(base), np.zeros((2, 2)))
    same(ca.full_like(base, 3), np.full((2, 2), 3.0))
    same(np.empty_like(base) * 0, np.zeros((2, 2)))
    same(np.zeros_like(base), np.zeros((2, 2)))
    same(np.ones_like(base, dtype=np.int8), np.ones((2, 2), np.int8))
    same(np.zeros(3, like=base), np.zeros(3))
    same(np.asarray([1, 2], like=base), np.array([1, 2]))
    assert ca.asarray(base) is base


def test_default_manager_from_environment(monkeypatch):
    monkeypatch.setenv("CACHEDARRAYS_FAST", "2MiB")
    monkeypatch.setenv("CACHEDARRAYS_SLOW", "8MiB")
    prev = ca.set_default_manager(None)
    try:
        x = ca.zeros(10)
        assert x.manager is ca.default_manager()
        assert x.manager.fast.size == 2 << 20 and x.manager.slow.size == 8 << 20
        x.manager.close()
    finally:
        ca.set_default_manager(prev)


UNARY = [np.negative, np.abs, np.sqrt, np.exp, np.sin, np.floor, np.isnan, np.square,
         np.logical_not, np.sign]
BINARY = [np.add, np.subtract, np.multiply, np.true_divide, np.power, np.maximum,
          np.minimum, np.greater, np.equal, np.arctan2, np.hypot, np.logical_and]


@pytest.mark.parametrize("uf", UNARY)
def test_unary_ufuncs(m, uf):
    a = RNG.random((4, 5)) + 0.1
    x = ca.asarray(a, manager=m)
    same(uf(x), uf(a))


@pytest.mark.parametrize("uf", BINARY)
def test_binary_ufuncs_with_broadcasting_and_mixed_operands(m, uf):
    a = RNG.random((4, 5)) + 0.5
    b = RNG.random(5) + 0.5
    x, y = ca.asarray(a, manager=m), ca.asarray(b, manager=m)
    same(uf(x, y), uf(a, b))
    same(uf(x, b), uf(a, b))
    same(uf(a, y), uf(a, b))
    same(uf(x, 2.0), uf(a, 2.0))
    same(uf(3, x), uf(3, a))


def test_operators(m):
    a = RNG.random((3, 3))
    x = ca.asarray(a, manager=m)
    same(x + 1, a + 1)
    same(2 * x - x / 3, 2 * a - a / 3)
    same(x @ x, a @ a)
    same(-x, -a)
    same(x ** 2, a ** 2)
    same(x > 0.5, a > 0.5)
    same((x > 0.5) & (x < 0.9), (a > 0.5) & (a < 0.9))
    i = ca.asarray(np.arange(6), manager=m)
    same(i // 4, np.arange(6) // 4)
    same(i % 4, np.arange(6) % 4)


def test_float32_weak_scalars_follow_numpy2(m):
    a = np.ones(3, np.float32)
    x = ca.asarray(a, manager=m)
    same(x * 2.5, a * 2.5)
    same(x + np.float64(1), a + np.float64(1))


def test_in_place_operators_write_into_the_same_object(m):
    a = RNG.random(6)
    x = ca.asarray(a, manager=m)
    obj = x.object
    x += 1
    a += 1
    assert x.object is obj
    same(x, a)
    x *= x
    a *= a
    same(x, a)


def test_ndarray_plus_equals_cachedarray(m):
    a = np.ones(3)
    x = ca.asarray(np.arange(3.0), manager=m)
    a += x
    assert isinstance(a, np.ndarray)
    np.testing.assert_array_equal(a, [1, 2, 3])


def test_out_parameter_with_cachedarray_and_ndarray(m):
    a = RNG.random(5)
    x = ca.asarray(a, manager=m)
    out = ca.empty(5, manager=m)
    r = np.add(x, 1, out=out)
    assert r is out
    same(out, a + 1)
    nd = np.empty(5)
    r = np.multiply(x, 2, out=nd)
    assert r is nd
    np.testing.assert_array_equal(nd, a * 2)
    r = np.add(x, 1, out=(out,))
    assert r is out


def test_where_argument(m):
    a = RNG.random(6)
    x = ca.asarray(a, manager=m)
    out = ca.zeros(6, manager=m)
    np.add(x, 10, out=out, where=a > 0.5)
    want = np.zeros(6)
    np.add(a, 10, out=want, where=a > 0.5)
    same(out, want)


def test_two_output_ufuncs(m):
    a = RNG.random(5) * 10
    x = ca.asarray(a, manager=m)
    same(np.divmod(x, 3), np.divmod(a, 3))
    same(np.modf(x), np.modf(a))


def test_ufunc_methods(m):
    a = RNG.random((4, 3))
    x = ca.asarray(a, manager=m)
    same(np.add.reduce(x), np.add.reduce(a))
    same(np.add.reduce(x, axis=None), np.add.reduce(a, axis=None))
    same(np.add.accumulate(x, axis=1), np.add.accumulate(a, axis=1))
    same(np.multiply.outer(x[0], x[1]), np.multiply.outer(a[0], a[1]))
    same(np.maximum.reduce(x, axis=0, keepdims=True), np.maximum.reduce(a, axis=0,
                                                                         keepdims=True))
    idx = np.array([0, 0, 2])
    b = a.copy()
    y = ca.asarray(b, manager=m)
    np.add.at(y, (idx, 0), 1.0)
    np.add.at(b, (idx, 0), 1.0)
    same(y, b)
    red_out = ca.zeros(3, manager=m)
    np.add.reduce(x, axis=0, out=red_out)
    same(red_out, a.sum(axis=0))


def test_reductions_and_methods(m):
    a = RNG.random((4, 6))
    x = ca.asarray(a, manager=m)
    same(x.sum(), a.sum())
    same(x.sum(axis=0), a.sum(axis=0))
    same(x.mean(axis=1), a.mean(axis=1))
    same(x.std(), a.std())
    same(x.max(axis=0), a.max(axis=0))
    same(x.argmax(), a.argmax())
    same(x.cumsum(axis=1), a.cumsum(axis=1))
    same(np.any(x > 0.99), np.any(a > 0.99))
    same(x.clip(0.2, 0.8), a.clip(0.2, 0.8))
    same(x.round(2), a.round(2))
    same(np.median(x, axis=0), np.median(a, axis=0))
    same(np.percentile(x, 30), np.percentile(a, 30))


def test_linalg(m):
    a = RNG.random((4, 4)) + 4 * np.eye(4)
    x = ca.asarray(a, manager=m)
    same(np.linalg.inv(x), np.linalg.inv(a))
    same(np.linalg.det(x), np.linalg.det(a))
    same(np.linalg.norm(x), np.linalg.norm(a))
    same(np.dot(x, x), np.dot(a, a))
    same(np.linalg.solve(x, x[:, 0]), np.linalg.solve(a, a[:, 0]))
    q, r = np.linalg.qr(x)
    q0, r0 = np.linalg.qr(a)
    same(q, q0)
    same(r, r0)
    same(np.einsum("ij,jk->ik", x, x), np.einsum("ij,jk->ik", a, a))
    same(np.tensordot(x, x, axes=1), np.tensordot(a, a, axes=1))


def test_concatenate_stack_sort_where(m):
    a = RNG.random((3, 4))
    b = RNG.random((3, 4))
    x, y = ca.asarray(a, manager=m), ca.asarray(b, manager=m)
    same(np.concatenate([x, y]), np.concatenate([a, b]))
    same(np.concatenate([x, b], axis=1), np.concatenate([a, b], axis=1))
    same(np.stack([x, y]), np.stack([a, b]))
    same(np.vstack((x, y)), np.vstack((a, b)))
    same(np.sort(x, axis=1), np.sort(a, axis=1))
    same(np.argsort(x, axis=0), np.argsort(a, axis=0))
    same(np.where(x > 0.5, x, y), np.where(a > 0.5, a, b))
    same(np.unique(np.round(x, 1)), np.unique(np.round(a, 1)))
    same(np.split(x, 2, axis=1), np.split(a, 2, axis=1))
    out = ca.empty((6, 4), manager=m)
    r = np.concatenate([x, y], out=out)
    assert r is out
    same(out, np.concatenate([a, b]))
    z = x.copy()
    z.sort(axis=0)
    same(z, np.sort(a, axis=0))


def test_copyto_marks_destination_written(m):
    x = ca.zeros(4, manager=m)
    np.copyto(x, np.arange(4.0))
    same(x, np.arange(4.0))
    assert m.isdirty(x.object.primary)


def test_basic_indexing_gives_views_that_share_the_object(m):
    a = np.arange(24.0).reshape(4, 6)
    x = ca.asarray(a.copy(), manager=m)
    v = x[1:3, ::2]
    assert v.object is x.object
    same(v, a[1:3, ::2])
    v[...] = -1
    a[1:3, ::2] = -1
    same(x, a)
    same(x[2], a[2])
    same(x[..., 1], a[..., 1])
    same(x[None, 1], a[None, 1])
    same(x[1, 2], a[1, 2])
    assert x.T.object is x.object
    same(x.T, a.T)
    same(x.reshape(6, 4), a.reshape(6, 4))
    assert x.reshape(6, 4).object is x.object
    assert x.ravel().object is x.object
    same(x.view(np.int64), a.view(np.int64))
    same(x.swapaxes(0, 1), a.swapaxes(0, 1))
    same(np.transpose(x), np.transpose(a))
    assert np.transpose(x).object is x.object


def test_advanced_indexing_copies(m):
    a = np.arange(20.0).reshape(4, 5)
    x = ca.asarray(a, manager=m)
    same(x[[0, 2]], a[[0, 2]])
    same(x[x > 10], a[a > 10])
    same(x[ca.asarray(np.array([3, 1]), manager=m)], a[[3, 1]])
    assert x[[0, 2]].object is not x.object
    y = x.copy()
    y[[0, 1], [1, 2]] = 99
    b = a.copy()
    b[[0, 1], [1, 2]] = 99
    same(y, b)
    y[y > 50] = 0
    b[b > 50] = 0
    same(y, b)


def test_views_survive_eviction_and_prefetch(m):
    a = np.arange(100.0).reshape(10, 10)
    x = ca.asarray(a.copy(), manager=m)
    v = x[2:5, 3:]
    ca.evict(x)
    assert x.device == "slow" and v.device == "slow"
    same(v, a[2:5, 3:])
    v += 1
    a[2:5, 3:] += 1
    ca.prefetch(x)
    assert v.device == "fast"
    same(x, a)
    ca.evict(v)
    same(x, a)


def test_out_of_bounds_indexing_raises(m):
    x = ca.zeros((3, 3), manager=m)
    with pytest.raises(IndexError):
        x[3, 0]
    with pytest.raises(IndexError):
        x[[0, 5]]
    with pytest.raises(IndexError):
        x[5] = 1


def test_conversions_and_len(m):
    x = ca.asarray(np.array([3.5]), manager=m)
    assert float(x[0]) == 3.5 and int(x[0]) == 3 and bool(x)
    for kind in (float, int):  # NumPy 2 refuses these for shape (1,) too
        with pytest.raises(TypeError, match="0-dimensional"):
            kind(x)
    assert len(ca.zeros((4, 2), manager=m)) == 4
    assert [float(r) for r in ca.asarray(np.array([1.0, 2.0]), manager=m)] == [1.0, 2.0]
    assert ca.asarray(np.array(5), manager=m).item() == 5
    assert ca.asarray(np.arange(3), manager=m).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="ambiguous"):
        bool(ca.zeros(3, manager=m))
    assert 2 in ca.asarray(np.arange(3), manager=m)
    assert [0, 1, 2][ca.asarray(np.array(1), manager=m)] == 1


def test_asarray_follows_numpy2_and_is_counted(m):
    x = ca.asarray(np.arange(4.0), manager=m)
    a = np.asarray(x)
    assert isinstance(a, np.ndarray) and not np.shares_memory(a, a + 0)
    b = np.asarray(x, dtype=np.float32)
    assert b.dtype == np.float32
    with pytest.raises(ValueError, match="readable"):
        np.array(x, copy=False)
    c = np.array(x, copy=True)
    c[0] = 100
    assert float(x[0]) == 0
    ev = m.stats()["events"]["asarray"]
    assert ev["count"] == 3 and ev["bytes"] == 3 * 32


def test_repr_shows_device(m):
    x = ca.asarray(np.arange(3), manager=m)
    assert "device='fast'" in repr(x)
    ca.evict(x)
    assert "device='slow'" in repr(x)
    assert str(x) == str(np.arange(3))


def test_pickle_and_copy_round_trip(m):
    a = RNG.random((3, 2))
    x = ca.asarray(a, manager=m)
    y = pickle.loads(pickle.dumps(x))
    assert y.object is not x.object
    assert_eq(y, a, exact=True)
    assert y.manager is ca.default_manager()         # unpickled arrays join the default manager
    assert b"Region" not in pickle.dumps(x)
    z = copy.deepcopy(x)
    assert z.object is not x.object
    assert_eq(z, a, exact=True)


def test_use_after_free_raises_and_bytes_return_at_once(m):
    x = ca.zeros(1000, manager=m)
    v = x[10:20]
    used = m.fast.stats()["used"]
    ca.unsafe_free(x)
    assert m.fast.stats()["used"] < used
    for op in (lambda: x + 1, lambda: v[0], lambda: np.asarray(x), lambda: x.sum(),
               lambda: ca.readable(x).__enter__(), lambda: x.device):
        with pytest.raises(UseAfterFreeError):
            op()
    assert "freed" in repr(x)


def test_readable_and_writable_scopes(m):
    x = ca.zeros(5, manager=m)
    with ca.readable(x) as a:
        assert isinstance(a, np.ndarray) and not a.flags.writeable
        assert m.pin_count(x.object) == 1
    assert m.pin_count(x.object) == 0
    m.markclean(x.object.primary)
    with ca.writable(x) as a:
        a[:] = 4
    assert m.isdirty(x.object.primary)
    same(x, np.full(5, 4.0))
    with pytest.raises(TypeError):
        ca.readable(np.zeros(3))


def test_foreign_types_get_notimplemented(m):
    class Other:
        __array_ufunc__ = None

        def __radd__(self, other):
            return "other handled it"

    x = ca.zeros(3, manager=m)
    assert x + Other() == "other handled it"


def test_constructor_is_not_public():
    with pytest.raises(TypeError, match="ca.asarray"):
        ca.CachedArray()


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((4,), (4, 2)), ((3, 4), (4,)),
                                   ((2, 3, 4), (4, 5)), ((4,), (4,)), ((1, 3, 4), (2, 4, 1))])
def test_matmul_shapes_write_into_a_new_array(m, sa, sb):
    a, b = RNG.random(sa), RNG.random(sb)
    x, y = ca.asarray(a, manager=m), ca.asarray(b, manager=m)
    same(x @ y, a @ b)
    same(np.matmul(x, b), np.matmul(a, b))
    with pytest.raises(ValueError):
        x @ ca.asarray(RNG.random((7, 2)), manager=m)


def test_access_pins_several_arrays_and_reports_uses(m, make_manager):
    x = ca.ones(4, manager=m)
    y = ca.zeros(4, manager=m)
    other = make_manager(slow="4MiB")
    z = ca.ones(4, manager=other)
    m.markclean(y.object.primary)
    with ca.access((x, None, z), (y,)) as (xv, none, zv, yv):
        assert none is None and not xv.flags.writeable and yv.flags.writeable
        assert m.pin_count(x.object) == m.pin_count(y.object) == other.pin_count(z.object) == 1
        yv[:] = xv + zv
    assert m.pin_count(x.object) == m.pin_count(y.object) == other.pin_count(z.object) == 0
    assert m.isdirty(y.object.primary)
    same(y, np.full(4, 2.0))
    with pytest.raises(TypeError, match="CachedArrays"):
        ca.access((np.ones(3),), ())


@pytest.mark.parametrize("var,value,match", [
    ("CACHEDARRAYS_FAST", "abc", "CACHEDARRAYS_FAST 'abc' is not a size"),
    ("CACHEDARRAYS_FAST", "", "CACHEDARRAYS_FAST '' is not a size"),
    ("CACHEDARRAYS_SLOW", "-1", "CACHEDARRAYS_SLOW '-1' is not a size"),
    ("CACHEDARRAYS_SLOW", "1e40", "CACHEDARRAYS_SLOW '1e40' is absurdly large"),
    ("CACHEDARRAYS_FAST", "0.5B", "CACHEDARRAYS_FAST '0.5B' is not a whole number"),
])
def test_a_bad_size_in_the_environment_names_the_variable(monkeypatch, var, value, match):
    # the program never passed this size: the error must say where it came from
    monkeypatch.setenv(var, value)
    prev = ca.set_default_manager(None)
    try:
        with pytest.raises(ValueError, match=match):
            ca.zeros(10)
    finally:
        ca.set_default_manager(prev)


@pytest.mark.parametrize("var,value", [("CACHEDARRAYS_POLICY", "no-such-policy"),
                                       ("CACHEDARRAYS_SLOW_PATH", "/no/such/dir/slow.heap")])
def test_a_bad_default_manager_setting_is_traced_to_its_variable(monkeypatch, var, value):
    monkeypatch.setenv("CACHEDARRAYS_FAST", "2MiB")
    monkeypatch.setenv("CACHEDARRAYS_SLOW", "8MiB")
    monkeypatch.setenv(var, value)
    prev = ca.set_default_manager(None)
    try:
        with pytest.raises((ValueError, OSError)) as e:
            ca.zeros(10)
        notes = " ".join(getattr(e.value, "__notes__", []))
        assert f"{var}={value!r}" in notes and "unset the variable" in notes
    finally:
        ca.set_default_manager(prev)
