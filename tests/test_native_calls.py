"""The commonest NumPy calls on CachedArrays, run in C (native/records.c: fast_ufunc, run_ufunc),
and the state records (Manager, Telemetry, Device, Heap) whose fields C reads directly.

The C path must keep every rule of Manager.run: pins, use reports, dirty marking, telemetry,
noescape scopes, the general path while something is under way, and errors that leave nothing
pinned or allocated."""

import gc
import threading
import time
import warnings

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import _records
from cachedarrays.errors import UseAfterFreeError
from cachedarrays.manager import Observer
from cachedarrays.pinning import pop_scope, push_scope
from cachedarrays.policies import LRU
from helpers import run_threads


@pytest.fixture
def m():
    with ca.Manager(fast="8MiB", slow="32MiB") as mgr:
        yield mgr


def _arr(m, values):
    return ca.asarray(np.asarray(values), manager=m)


def _heap_blocks(m):
    gc.collect()
    m.drain()
    return m.fast.heap.stats().used, m.slow.heap.stats().used


# ---- results ------------------------------------------------------------------------------------

OPERATORS = [
    lambda x, y: x + y, lambda x, y: x - y, lambda x, y: x * y, lambda x, y: x / y,
    lambda x, y: x ** 2, lambda x, y: 3 - x, lambda x, y: 2.5 * y, lambda x, y: -x,
    lambda x, y: abs(x), lambda x, y: x < y, lambda x, y: x == 1, lambda x, y: np.maximum(x, y),
    lambda x, y: np.exp(x), lambda x, y: np.add(x, 1j), lambda x, y: x + True,
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64, np.int16, np.complex128])
@pytest.mark.parametrize("shape", [(10,), (3, 4), (70_000,)])   # the last: over SHORT_BYTES
def test_results_match_numpy(m, dtype, shape):
    rng = np.random.default_rng(0)
    a = (rng.random(shape) * 10 + 1).astype(dtype)
    b = (rng.random(shape) * 10 + 1).astype(dtype)
    x, y = _arr(m, a), _arr(m, b)
    for op in OPERATORS:
        with warnings.catch_warnings():
            warnings.simplefilter("error")           # no deprecated ufunc call form either
            want = op(a, b)
            got = op(x, y)
        assert type(got) is ca.CachedArray
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
    assert x.object._pins == 0 and y.object._pins == 0


def test_a_result_is_dirty_placed_and_counted(m):
    x, y = _arr(m, np.arange(10.0)), _arr(m, np.ones(10))
    allocs = m.telemetry.allocs["fast"]
    z = x + y
    assert m.telemetry.allocs["fast"] == allocs + 1
    r = z.object.primary
    assert r.device is m.fast and r._dirty is True
    assert z.object._pins == 0
    assert m.object(z.object.id) is z.object


def test_operands_are_reported_used_and_the_result_new():
    calls = []

    class Recording(LRU):
        def read_use(self, obj):
            calls.append(("read", obj.id))
            super().read_use(obj)

        def new_in_fast(self, obj):
            calls.append(("new", obj.id))
            super().new_in_fast(obj)

    with ca.Manager(fast="8MiB", slow="32MiB", policy=Recording()) as m:
        x, y = _arr(m, np.arange(10.0)), _arr(m, np.ones(10))
        calls.clear()
        z = x * y
        assert calls == [("read", x.object.id), ("read", y.object.id), ("new", z.object.id)]
        assert list(m.policy.recent)[-1] == z.object.id


def test_a_full_fast_memory_places_the_result_through_the_policy():
    with ca.Manager(fast="64KiB", slow="32MiB") as m:
        xs = [_arr(m, np.full(2000, float(i))) for i in range(6)]   # more than fast memory
        z = xs[0] + xs[5]
        np.testing.assert_array_equal(np.asarray(z), np.full(2000, 5.0))
        assert all(x.object._pins == 0 for x in xs) and z.object._pins == 0
        m.check()


# ---- the general path while something is under way ---------------------------------------------

def test_an_observer_sees_every_call(m):
    seen = []

    class Watch(Observer):
        def on_acquire(self, name, reads, writes, touched=None):
            seen.append(name)

    x, y = _arr(m, np.arange(10.0)), _arr(m, np.ones(10))
    m.observe(Watch())                        # rebinds Manager._observers: C must see it
    z = x + y
    np.testing.assert_array_equal(np.asarray(z), np.arange(10.0) + 1)
    assert seen[0] == "add"


def test_a_telemetry_reset_is_seen(m):
    x = _arr(m, np.arange(10.0))
    m.telemetry.reset()                       # rebinds the counter dicts
    _ = x + 1
    assert m.telemetry.allocs["fast"] == 1


def test_a_subclass_property_shadowing_a_field_is_honoured():
    reads = []

    class Audited(ca.Manager):
        @property
        def policy(self):
            reads.append(1)
            return self._audited

        @policy.setter
        def policy(self, value):
            self._audited = value

    with Audited(fast="8MiB", slow="32MiB") as m:
        x = _arr(m, np.arange(10.0))
        reads.clear()
        z = x + 1
        assert reads                          # read through the property, not the slot
        np.testing.assert_array_equal(np.asarray(z), np.arange(10.0) + 1)


def test_closed_managers_and_freed_operands_raise(m):
    x, y = _arr(m, np.arange(10.0)), _arr(m, np.ones(10))
    ca.unsafe_free(y)
    with pytest.raises(UseAfterFreeError):
        _ = x + y
    assert x.object._pins == 0
    with ca.Manager(fast="1MiB", slow="4MiB") as other:
        a = _arr(other, np.ones(4))
    with pytest.raises(UseAfterFreeError, match="closed"):
        _ = a + 1


# ---- errors leave nothing pinned, allocated or locked -------------------------------------------

@pytest.mark.parametrize("n", [10, 70_000])
def test_a_failing_ufunc_leaves_nothing_behind(m, n):
    x, y = _arr(m, np.ones(n)), _arr(m, np.zeros(n))
    before = _heap_blocks(m)
    with np.errstate(divide="raise"):
        for _ in range(3):
            with pytest.raises(FloatingPointError):
                _ = x / y
    assert x.object._pins == 0 and y.object._pins == 0
    assert _heap_blocks(m) == before
    done = []
    t = threading.Thread(target=lambda: done.append(m._lock.acquire(timeout=5) and
                                                    m._lock.release() is None))
    t.start()
    t.join()
    assert done == [True]                     # the lock was let go


def test_a_policy_returning_a_non_object_is_refused():
    class Broken(LRU):
        broken = False

        def allocate(self, nbytes):
            return "not an object" if self.broken else super().allocate(nbytes)

    with ca.Manager(fast="8MiB", slow="32MiB", policy=Broken()) as m:
        x = _arr(m, np.ones(10))
        m.policy.broken = True
        m.policy.fast_first = False           # every result goes through allocate
        before = _heap_blocks(m)
        with pytest.raises(TypeError, match="not an Object"):
            _ = x + 1
        assert x.object._pins == 0 and _heap_blocks(m) == before
        m.policy.broken = False
        np.testing.assert_array_equal(np.asarray(x + 1), np.full(10, 2.0))


def test_results_are_recorded_in_open_noescape_scopes(m):
    x = _arr(m, np.arange(1000.0))
    rec = push_scope()                        # what ca.noescape opens around a call
    try:
        t = x * 2
        u = -x
    finally:
        pop_scope(rec)
    assert [r() for r in rec] == [t.object, u.object]
    v = x + 1                                 # no scope open: nothing recorded
    assert len(rec) == 2 and v.object is not None


# ---- the entry points -------------------------------------------------------------------------

def test_fast_ufunc_declines_what_it_does_not_handle(m):
    x = _arr(m, np.arange(4.0))
    with ca.Manager(fast="1MiB", slow="4MiB") as other:
        y = _arr(other, np.arange(4.0))
        assert _records.fast_ufunc(np.add, (x, y)) is None        # two managers
    assert _records.fast_ufunc(np.add, (x, _arr(m, np.arange(3.0)))) is None   # shapes
    assert _records.fast_ufunc(np.add, (x, np.arange(4.0))) is None   # an ndarray operand
    assert _records.fast_ufunc(np.add, (1, 2)) is None
    assert _records.fast_ufunc(np.add, (x, x, x)) is None
    assert _records.fast_ufunc(np.add, ()) is None
    bare = object.__new__(ca.CachedArray)     # an array made without its fields
    assert _records.fast_ufunc(np.add, (bare, 1)) is None
    assert _records.fast_ufunc(np.add, (x, bare)) is None
    assert _records.fast_ufunc(np.negative, (bare,)) is None
    with pytest.raises(TypeError):
        _records.fast_ufunc(np.add, [x, x])
    with pytest.raises(TypeError):
        _records.fast_ufunc(np.add)
    with pytest.raises(TypeError):
        _records.run_ufunc(m, np.add, (x,), (x.object,))
    with pytest.raises(TypeError):
        _records.bind_views(ca.CachedArray)


def test_state_records_keep_python_attribute_behaviour(m):
    assert isinstance(m, _records.ManagerRecord)
    assert isinstance(m.telemetry, _records.TelemetryRecord)
    assert isinstance(m.fast, _records.DeviceRecord)
    assert isinstance(m.fast.heap, _records.HeapRecord)
    m.extra = 1                               # instances keep a __dict__ for everything else
    assert m.extra == 1
    fresh = _records.ManagerRecord()
    with pytest.raises(AttributeError):
        fresh.policy                          # unset fields raise as attributes do
    fresh.policy = "p"
    assert fresh.policy == "p"
    del fresh.policy
    assert getattr(fresh, "policy", None) is None


def test_calls_from_many_threads_keep_data_and_pins():
    with ca.Manager(fast="256KiB", slow="32MiB") as m:
        arrays = [_arr(m, np.full(3000, float(i))) for i in range(8)]   # evictions happen
        errors = []

        def work(k):
            try:
                for j in range(200):
                    a, b = arrays[(k + j) % 8], arrays[(k + 2 * j) % 8]
                    want = float(a[0]) + float(b[0])
                    got = np.asarray(a + b)
                    assert got[0] == want and got[-1] == want
            except BaseException as e:       # noqa: BLE001 - reported below
                errors.append(e)

        run_threads(work)
        assert not errors
        assert all(a.object._pins == 0 for a in arrays)


# ---- basic indexing in C ------------------------------------------------------------------------

KEYS = [slice(1, 3), slice(None, None, -1), slice(5, 1), slice(-100, 100, 3), slice(None, None, 7),
        0, -1, (1,), (slice(None), 2), (2, slice(1, None, 2)), (-1, -1), (slice(1, 2), 0),
        (1, 2, 3), (Ellipsis, 1), (None, 1), [0, 2], np.int64(1), True, (slice(0, 0),),
        (slice(None, None, -2), slice(3, 0, -1))]


@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_indexing_matches_numpy(m, key):
    a = np.arange(4 * 6 * 5, dtype=np.float64).reshape(4, 6, 5)
    x = _arr(m, a)
    try:
        want = a[key]
    except IndexError:
        with pytest.raises(IndexError):
            x[key]
        return
    got = x[key]
    if np.isscalar(want):
        assert got == want
        return
    assert type(got) is ca.CachedArray and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), want)
    if isinstance(key, (slice, int, tuple)) and not isinstance(key, bool) and \
            np.shares_memory(want, a):
        assert got.object is x.object and got.strides == want.strides   # a view, no copy


def test_views_of_views_keep_their_offsets(m):
    a = np.arange(100.0)
    x = _arr(m, a)
    v = x[10:90][5:][::-3][2:7]
    np.testing.assert_array_equal(np.asarray(v), a[10:90][5:][::-3][2:7])
    v[:] = -1                                 # writes land in x's bytes
    a[10:90][5:][::-3][2:7] = -1
    np.testing.assert_array_equal(np.asarray(x), a)


def test_indexing_errors_match_numpy(m):
    x = _arr(m, np.arange(10.0))
    with pytest.raises(ValueError, match="step cannot be zero"):
        x[::0]
    with pytest.raises(IndexError):
        x[10]
    with pytest.raises(IndexError):
        x[-11]
    with pytest.raises(IndexError):
        x[1, 2]
    with pytest.raises(TypeError):
        ca.CachedArray.__getitem__(np.arange(3), 1)     # only CachedArrays
    ca.unsafe_free(x)
    with pytest.raises(UseAfterFreeError):
        x[1:3]


# ---- operators in C -----------------------------------------------------------------------------

def test_operators_behave_as_methods(m):
    x, y = _arr(m, np.arange(4.0)), _arr(m, np.ones(4))
    op = ca.CachedArray.__add__
    assert op.__name__ == "__add__" and op.ufunc is np.add
    np.testing.assert_array_equal(np.asarray(op(x, y)), np.arange(4.0) + 1)
    np.testing.assert_array_equal(np.asarray(x.__radd__(2)), np.arange(4.0) + 2)
    np.testing.assert_array_equal(np.asarray(x.__sub__(y)), np.arange(4.0) - 1)
    np.testing.assert_array_equal(np.asarray(x.__neg__()), -np.arange(4.0))
    with pytest.raises(TypeError):
        x.__add__()                               # the Python operator's own error
    with pytest.raises(TypeError):
        x.__add__(y, y)
    with pytest.raises(TypeError):
        _records.operator(np.add, None, 0)
    with pytest.raises(ValueError):
        _records.operator(np.add, print, 3)


def test_operators_defer_to_types_that_opt_out(m):
    class NoUfuncs:
        __array_ufunc__ = None

        def __radd__(self, other):
            return "handled"

    x = _arr(m, np.arange(4.0))
    assert x + NoUfuncs() == "handled"
    np.testing.assert_array_equal(np.asarray(x + np.ones(4)), np.arange(4.0) + 1)
    np.testing.assert_array_equal(np.asarray(np.ones(4) + x), np.arange(4.0) + 1)


def test_array_ufunc_takes_plain_calls_in_c_and_the_rest_by_the_general_handler(m):
    a = np.arange(1.0, 7.0)
    x = _arr(m, a)
    np.testing.assert_array_equal(np.asarray(np.exp(x)), np.exp(a))
    assert float(np.add.reduce(x)) == a.sum()                     # a method other than __call__
    q, r = np.divmod(x, 4)                                        # two outputs
    np.testing.assert_array_equal(np.asarray(q), a // 4)
    np.testing.assert_array_equal(np.asarray(r), a % 4)
    out = _arr(m, np.zeros(6))
    assert np.multiply(x, 2, out=out) is out                      # keywords
    np.testing.assert_array_equal(np.asarray(out), a * 2)
    np.testing.assert_array_equal(np.asarray(np.add(x, 1, dtype=np.float32)), a + 1)
    handler = ca.CachedArray.__array_ufunc__
    np.testing.assert_array_equal(np.asarray(handler(x, np.negative, "__call__", x)), -a)
    with pytest.raises(TypeError):
        handler(np.arange(3), np.negative, "__call__", x)        # only CachedArrays
    with pytest.raises(TypeError):
        _records.array_ufunc(None)


@pytest.mark.parametrize("n", [10, 70_000])
def test_closing_the_manager_while_calls_run_in_another_thread(n):
    for delay in (0.0, 0.005, 0.02):
        m = ca.Manager(fast="16MiB", slow="64MiB")
        x, y = _arr(m, np.ones(n)), _arr(m, np.ones(n))
        errors, started = [], threading.Event()

        def work():
            started.set()
            try:
                for _ in range(100_000):
                    z = x + y
                    _ = (-z)[1:3], np.exp(x), z < 1
            except UseAfterFreeError as e:
                errors.append(e)

        t = threading.Thread(target=work)
        t.start()
        started.wait()
        time.sleep(delay)
        m.close()
        t.join(30)
        assert not t.is_alive()               # the close neither hangs nor crashes the worker
        assert len(errors) == 1                # the next call after the close says so


def test_python_code_rebinding_an_array_mid_call_does_not_break_the_c_paths(m):
    x = _arr(m, np.arange(10.0))

    class Rebinding:
        def __index__(self):                  # runs while C holds x's fields
            x._shape, x._strides = (10,), (8,)
            gc.collect()
            return 2

    v = x[Rebinding():6]
    np.testing.assert_array_equal(np.asarray(v), np.arange(2.0, 6.0))

    class Meddling(LRU):
        def read_use(self, obj):
            y._shape, y._m = (10,), y._m      # new tuples for the fields C is using
            gc.collect()
            super().read_use(obj)

    with ca.Manager(fast="8MiB", slow="32MiB", policy=Meddling()) as other:
        y = _arr(other, np.arange(10.0))
        z = y + 1
        np.testing.assert_array_equal(np.asarray(z), np.arange(10.0) + 1)
        assert z.shape == (10,)
