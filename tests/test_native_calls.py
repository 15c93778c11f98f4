"""The commonest NumPy calls on CachedArrays, run in C (native/records.c: fast_ufunc, run_ufunc),
and the state records (Manager, Telemetry, Device, Heap) whose fields C reads directly.

The C path must keep every rule of Manager.run: pins, use reports, dirty marking, telemetry,
noescape scopes, the general path while something is under way, and errors that leave nothing
pinned or allocated."""

import gc
import sys
import threading
import warnings
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays import _records
from cachedarrays.errors import UseAfterFreeError
from cachedarrays.heap import HEADER
from cachedarrays.manager import Observer
from cachedarrays.pinning import pop_scope, push_scope
from cachedarrays.policies import LRU
from helpers import close_while_calling, run_threads


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


def _recording(calls, *hooks):
    """An LRU subclass appending (hook, object id) to calls on each of the named hooks, then
    running LRU's own."""
    def recorder(name):
        def hook(self, obj):
            calls.append((name, obj.id))
            getattr(LRU, name)(self, obj)
        return hook
    return type("Recording", (LRU,), {h: recorder(h) for h in hooks})


def test_operands_are_reported_used_and_the_result_new():
    calls = []
    Recording = _recording(calls, "read_use", "new_in_fast")
    with ca.Manager(fast="8MiB", slow="32MiB", policy=Recording()) as m:
        x, y = _arr(m, np.arange(10.0)), _arr(m, np.ones(10))
        calls.clear()
        z = x * y
        assert calls == [("read_use", x.object.id), ("read_use", y.object.id),
                         ("new_in_fast", z.object.id)]
        assert list(m.policy.recent)[-1] == z.object.id


def test_a_full_fast_memory_places_the_result_through_the_policy():
    with ca.Manager(fast="64KiB", slow="32MiB") as m:
        xs = [_arr(m, np.full(2000, float(i))) for i in range(6)]   # more than fast memory
        z = xs[0] + xs[5]
        np.testing.assert_array_equal(np.asarray(z), np.full(2000, 5.0))
        assert all(x.object._pins == 0 for x in xs) and z.object._pins == 0
        m.check()


# ---- LRU's hooks, run in C ----------------------------------------------------------------------

def _lru_workload(m):
    """Results made and dropped, operands reused, an array soft-evicted: every LRU hook runs."""
    x, y = _arr(m, np.arange(10.0)), _arr(m, np.ones(10))
    keep = [x + y, x * 2]
    ca.softevict(keep[0])
    for i in range(20):
        z = keep[i % 2] - y           # read_use of both operands (one from the soft tier)
        if i % 3 == 0:
            keep.append(z)
        del z                         # forget, at the next call's drain
    np.exp(keep[-1])
    m.drain()
    return keep


class _PythonLRU(LRU):
    """LRU whose hooks are other functions than LRU's (calling LRU's own code), so the C paths
    call them in Python."""

    def read_use(self, obj):
        LRU.read_use(self, obj)

    def new_in_fast(self, obj):
        LRU.new_in_fast(self, obj)

    def forget(self, obj_id):
        LRU.forget(self, obj_id)


def test_lru_hooks_in_c_leave_the_tiers_as_the_python_methods_do():
    tiers = []
    for policy in (LRU(), _PythonLRU()):
        with ca.Manager(fast="8MiB", slow="32MiB", policy=policy) as m:
            keep = _lru_workload(m)
            assert keep[0].object.id in m.policy.recent      # read back from the soft tier
            tiers.append(m.policy.tiers())
    assert tiers[0] == tiers[1]


def test_overridden_lru_hooks_are_called():
    calls = []

    class Forgetful(LRU):
        def forget(self, obj_id):
            calls.append(obj_id)
            super().forget(obj_id)

    with ca.Manager(fast="8MiB", slow="32MiB", policy=Forgetful()) as m:
        x = _arr(m, np.arange(10.0))
        z = x + 1
        zid = z.object.id
        del z
        m.drain()
        assert calls == [zid]
        # an instance attribute shadows the class's method, as in Python
        seen = []
        m.policy.read_use = lambda obj: seen.append(obj.id)
        (x + 1).sum()
        assert seen[:1] == [x.object.id]


def test_lru_tiers_that_are_not_ordered_dicts_take_the_python_methods():
    moved = []

    class Tier(OrderedDict):
        def move_to_end(self, key, last=True):
            moved.append(key)
            super().move_to_end(key, last)

    class OwnTiers(LRU):
        def __init__(self):
            super().__init__()
            self.recent, self.soft = Tier(), Tier()      # still LRURecord fields

    with ca.Manager(fast="8MiB", slow="32MiB", policy=OwnTiers()) as m:
        x = _arr(m, np.arange(10.0))
        z = x + 1
        assert moved == [x.object.id] and list(m.policy.recent)[-1] == z.object.id
        assert type(m.policy.recent) is Tier


def test_result_views_are_built_on_the_mapping_and_hold_it(m):
    x = _arr(m, np.arange(12.0).reshape(3, 4))
    z = x * 2
    v = z._kview()
    buf = m.fast.buffer
    assert v.base is buf and v.flags.writeable and v.flags.aligned and v.flags.c_contiguous
    assert v.ctypes.data == m.fast.address + z.object.primary.offset + HEADER
    gc.collect()
    m.drain()
    refs = sys.getrefcount(buf)
    for _ in range(100):
        (x * 2)._kview()
    gc.collect()
    m.drain()                                                 # the last result's regions
    assert sys.getrefcount(buf) == refs                        # no reference leaked
    np.testing.assert_array_equal(v, np.arange(12.0).reshape(3, 4) * 2)


# ---- reductions in C ---------------------------------------------------------------------------

REDUCTIONS = [
    lambda a: a.sum(), lambda a: a.sum(axis=0), lambda a: a.sum(1), lambda a: a.mean(),
    lambda a: a.mean(axis=1, keepdims=True), lambda a: a.max(), lambda a: a.min(axis=0),
    lambda a: a.argmax(), lambda a: a.argmin(axis=1), lambda a: a.std(ddof=1),
    lambda a: a.var(axis=0), lambda a: a.prod(dtype=np.float64), lambda a: a.all(),
    lambda a: a.any(axis=0), lambda a: a.max(initial=50.0), lambda a: a.sum(axis=(0, 1)),
    lambda a: a.sum(where=np.arange(12).reshape(3, 4) % 2 == 0),
]


@pytest.mark.parametrize("n", [4, 40_000])                      # the last: over SHORT_BYTES
def test_reductions_match_numpy(m, n):
    a = np.random.default_rng(1).random((3, n)) * 10
    x = _arr(m, a)
    for red in REDUCTIONS if n == 4 else REDUCTIONS[:-1]:
        with np.errstate(over="ignore"):                        # prod of 40,000 values
            want, got = red(a), red(x)
        if isinstance(want, np.ndarray):
            assert type(got) is ca.CachedArray and got.shape == want.shape
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12)
        else:
            assert type(got) is type(want)
            np.testing.assert_allclose(got, want, rtol=1e-12)
    assert x.object._pins == 0
    m.check()


def test_reductions_report_the_read_and_keep_the_general_path_for_the_rest(m):
    calls = []
    with ca.Manager(fast="8MiB", slow="32MiB", policy=_recording(calls, "read_use")()) as m2:
        x = _arr(m2, np.arange(12.0).reshape(3, 4))
        calls.clear()
        assert x.sum() == 66.0 and calls == [("read_use", x.object.id)]
        out = _arr(m2, np.zeros(4))
        assert x.sum(axis=0, out=out) is out                # out=: the general path
        np.testing.assert_array_equal(np.asarray(out), [12.0, 15.0, 18.0, 21.0])
        assert ca.CachedArray.max(x) == 11.0                 # unbound, as a function
        with pytest.raises(np.exceptions.AxisError):
            x.sum(axis=5)
        assert x.object._pins == 0 and out.object._pins == 0
        seen = []

        class Watch(Observer):
            def on_acquire(self, name, reads, writes, touched=None):
                seen.append(name)

        m2.observe(Watch())                                # busy: the Python method
        assert x.argmax() == 11 and seen == ["argmax"]
    with pytest.raises(UseAfterFreeError):
        x.sum()


# ---- ufuncs into an existing array in C (out=, x op= y) -----------------------------------------

INPLACE = [
    lambda x, y: x.__iadd__(y), lambda x, y: x.__isub__(2), lambda x, y: x.__imul__(y),
    lambda x, y: x.__itruediv__(3.0), lambda x, y: np.add(x, y, out=x),
    lambda x, y: np.maximum(x, y, out=(x,)), lambda x, y: np.exp(y, out=x),
    lambda x, y: np.multiply(y, np.float32(2), out=x), lambda x, y: x.__ipow__(2),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
@pytest.mark.parametrize("shape", [(10,), (3, 4), (70_000,)])   # the last: over SHORT_BYTES
def test_in_place_ufuncs_match_numpy(m, dtype, shape):
    rng = np.random.default_rng(2)
    a = (rng.random(shape) + 1).astype(dtype)
    b = (rng.random(shape) + 1).astype(dtype)
    x, y = _arr(m, a), _arr(m, b)
    for op in INPLACE:
        want = op(a, b)
        got = op(x, y)
        assert got is x and want is a
        np.testing.assert_allclose(np.asarray(x), a, rtol=1e-6)
    assert x.object._pins == 0 and y.object._pins == 0
    m.check()


def test_in_place_ufuncs_report_the_write_and_break_the_lineage():
    calls = []
    Recording = _recording(calls, "read_use", "write_use")
    with ca.Manager(fast="8MiB", slow="32MiB", policy=Recording()) as m:
        x, y = _arr(m, np.arange(10.0)), _arr(m, np.ones(10))
        m.markclean(x.object.primary)
        version = x.object.version
        calls.clear()
        x += y
        # (LRU's write_use reports the read itself)
        assert calls == [("read_use", x.object.id), ("read_use", y.object.id),
                         ("write_use", x.object.id), ("read_use", x.object.id)]
        assert x.object.primary._dirty is True
        assert x.object.version == version + 1 and x.object.chain == "add"
        m.recomputing = True                          # a replay: the lineage is kept
        np.multiply(x, 2, out=x)
        assert x.object.version == version + 1
        m.recomputing = False


def test_in_place_calls_the_c_path_does_not_take_keep_numpy_behaviour(m):
    x = _arr(m, np.zeros((3, 4)))
    row = _arr(m, np.arange(4.0))
    x += row                                          # broadcasting: the general path
    np.testing.assert_array_equal(np.asarray(x), np.tile(np.arange(4.0), (3, 1)))
    i = _arr(m, np.arange(4))
    with pytest.raises(TypeError):
        i += 1.5                                      # NumPy's casting error, from C
    with pytest.raises(ValueError):
        np.divmod(i, 2, out=(i,))                     # two outputs: NumPy's own error
    with ca.Manager(fast="1MiB", slow="4MiB") as other:
        z = _arr(other, np.ones(4))
        z += row                                      # another manager: the general path
        np.testing.assert_array_equal(np.asarray(z), np.arange(4.0) + 1)
        del z
    assert x.object._pins == 0 and i.object._pins == 0 and row.object._pins == 0
    np.testing.assert_array_equal(np.asarray(i), np.arange(4))
    assert _records.fast_into(np.add, (1, 2), x) is None          # no array input
    assert _records.fast_into(np.add, (x, 1), np.zeros((3, 4))) is None
    with pytest.raises(TypeError):
        _records.fast_into(np.add, [x], x)
    y = _arr(m, np.ones(3))
    ca.unsafe_free(y)
    with pytest.raises(UseAfterFreeError):
        y += 1


# ---- x[key] = scalar in C ----------------------------------------------------------------------

SETITEM_KEYS = [0, -1, slice(1, 5), slice(None, None, 2), (1, 2), (slice(0, 2), 3), Ellipsis,
                (Ellipsis, 1), (None, 0)]


@pytest.mark.parametrize("shape", [(4, 6), (3, 20_000)])          # the last: over SHORT_BYTES
def test_setitem_of_scalars_matches_numpy(m, shape):
    a = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    x = _arr(m, a)
    for i, key in enumerate(SETITEM_KEYS):
        for value in (7, -2.5, np.float32(3.5), True):
            a[key] = value
            x[key] = value
            np.testing.assert_array_equal(np.asarray(x), a)
    assert x.object._pins == 0
    m.check()


def test_setitem_reports_the_write_and_keeps_numpy_errors():
    calls = []
    with ca.Manager(fast="8MiB", slow="32MiB", policy=_recording(calls, "write_use")()) as m:
        x = _arr(m, np.zeros(5))
        m.markclean(x.object.primary)
        version = x.object.version
        calls.clear()
        x[2] = 1.0
        assert calls == [("write_use", x.object.id)] and x.object.primary._dirty is True
        assert x.object.version == version + 1 and x.object.chain == "use"
        with pytest.raises(IndexError):
            x[9] = 1.0                                     # NumPy's own error
        with pytest.raises(ValueError):
            x[1] = "not a number"
        x[[0, 1]] = 5.0                                    # a list key: the Python method
        x[1:3] = np.array([8.0, 9.0])                      # an array value: the Python method
        np.testing.assert_array_equal(np.asarray(x), [5.0, 8.0, 9.0, 0.0, 0.0])
        assert x.object._pins == 0
        ca.unsafe_free(x)
        with pytest.raises(UseAfterFreeError):
            x[0] = 1.0


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


# ---- ca.empty in C ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, dtype", [(5, float), ((3, 4), np.float32), ((2, 0, 3), "i2"),
                                          ((), np.complex128), ((7,), np.dtype(">u4")),
                                          ((4, 70_000), np.float64),
                                          ((16, 8, 4, 4), np.dtype(np.float32))])
def test_empty_in_c_makes_the_same_arrays(m, shape, dtype, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ca.empty took Manager.new_pinned, not the C step")

    monkeypatch.setattr(m, "new_pinned", refuse)     # dtype objects too (np.dtypes.*DType)
    x = ca.empty(shape, dtype, manager=m)
    want = np.empty(shape, dtype)
    assert type(x) is ca.CachedArray
    assert (x.shape, x.dtype) == (want.shape, want.dtype)
    assert x.strides == want.strides or want.size == 0     # (NumPy: zero strides when empty)
    assert x.object._pins == 0 and x.device == "fast"
    assert x.object.primary._dirty is True and x.object.id in m.policy.recent
    x[...] = 3
    np.testing.assert_array_equal(np.asarray(x), np.full(shape, 3, dtype))
    m.check()


def test_empty_keeps_the_general_path_and_its_errors(m):
    calls = []

    class Watch(Observer):
        def on_new(self, obj, placement):
            calls.append(obj.id)

    with pytest.raises(ValueError):
        ca.empty(-1, manager=m)                  # the shape's own error
    with pytest.raises(TypeError):
        ca.empty(3, object, manager=m)           # object dtypes are refused as before
    f = ca.empty((3, 4), order="F", manager=m)   # F order: the general path
    assert f.strides == np.empty((3, 4), order="F").strides
    s = ca.empty([2, 3], (np.float32, (2,)), manager=m)      # a list shape, a sub-array dtype
    assert s.shape == (2, 3, 2) and s.dtype == np.float32
    slow = ca.empty(4, manager=m, placement="slow")
    assert slow.device == "slow"
    rec = push_scope()
    try:
        e = ca.empty(8, manager=m)
    finally:
        pop_scope(rec)
    assert [r() for r in rec] == [e.object]
    m.observe(Watch())                           # busy: Manager.new_pinned, which reports it
    g = ca.empty(8, manager=m)
    assert calls == [g.object.id]
    assert all(a.object._pins == 0 for a in (f, s, slow, e, g))
    with pytest.raises(TypeError):
        _records.new_array(m, [3], np.dtype(float), (8,), 24)


# ---- ca.zeros, ca.ones and ca.full in C ---------------------------------------------------------

FILLED = {"zeros": (lambda s, d, m: ca.zeros(s, d, manager=m), lambda s, d: np.zeros(s, d)),
          "ones": (lambda s, d, m: ca.ones(s, d, manager=m), lambda s, d: np.ones(s, d)),
          "full": (lambda s, d, m: ca.full(s, 7, d, manager=m), lambda s, d: np.full(s, 7, d))}


@pytest.mark.parametrize("how", list(FILLED))
@pytest.mark.parametrize("shape, dtype", [(5, float), ((3, 4), np.float32), ((2, 0, 3), "i2"),
                                          ((), np.complex128), ((4, 70_000), np.float64),
                                          ((3,), np.dtype([("a", "u1"), ("b", "<f8")],
                                                          align=True))])
def test_filled_arrays_in_c_match_numpy_and_keep_the_rules(m, shape, dtype, how, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the new array took Manager.new_pinned, not the C step")

    monkeypatch.setattr(m, "new_pinned", refuse)
    ours, theirs = FILLED[how]
    junk = ca.full(shape, 99, dtype, manager=m)      # leaves bytes behind for the next one
    ca.unsafe_free(junk)
    x, want = ours(shape, dtype, m), theirs(shape, dtype)
    assert (x.shape, x.dtype, x.strides) == (want.shape, want.dtype, want.strides) or \
        want.size == 0
    np.testing.assert_array_equal(np.asarray(x), want)
    if how == "zeros":
        with ca.readable(x) as v:                     # every byte, padding too
            assert not v.reshape(-1).view(np.uint8).any()
    assert x.object._pins == 0 and x.object.primary._dirty is True
    assert x.object.id in m.policy.recent
    m.check()


def test_filled_arrays_keep_the_general_path_numpys_casts_and_errors(m):
    calls = []

    class Watch(Observer):
        def on_new(self, obj, placement):
            calls.append(obj.id)

    before = _heap_blocks(m)
    with pytest.raises(ValueError):                   # does not broadcast
        ca.full((2, 3), [1, 2], manager=m)
    assert _heap_blocks(m) == before                  # the new array went with the error
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fill, dtype in ((np.nan, np.int32), (1j, np.float64), (255.9, np.uint8)):
            np.testing.assert_array_equal(np.asarray(ca.full(4, fill, dtype, manager=m)),
                                          np.full(4, fill, dtype))
    with pytest.raises(OverflowError):                # as np.full(4, 300, np.uint8)
        ca.full(4, 300, np.uint8, manager=m)
    assert _heap_blocks(m) == before
    src = ca.asarray(np.arange(3.0), manager=m)
    np.testing.assert_array_equal(np.asarray(ca.full((2, 3), src, manager=m)),
                                  np.full((2, 3), np.arange(3.0)))
    assert src.object._pins == 0
    f = ca.zeros((3, 4), order="F", manager=m)        # F order: the general path
    assert f.strides == np.zeros((3, 4), order="F").strides and not np.asarray(f).any()
    assert ca.ones(2, manager=m, placement="slow").device == "slow"
    rec = push_scope()
    try:
        z = ca.zeros(8, manager=m)
    finally:
        pop_scope(rec)
    assert [r() for r in rec] == [z.object]
    m.observe(Watch())                                # busy: Manager.new_pinned
    g = ca.full(8, 2.5, manager=m)
    assert calls == [g.object.id] and np.asarray(g).tolist() == [2.5] * 8
    m.check()


# ---- astype and copy in C -------------------------------------------------------------------------

@pytest.mark.parametrize("src, dtype", [(np.float64, np.float32), (np.float32, np.float64),
                                        (np.float64, np.int16), (np.int64, np.uint8),
                                        (np.complex128, np.float64), (np.float64, "U8"),
                                        (np.int32, np.dtype(">i4")), (np.float16, np.bool_)])
@pytest.mark.parametrize("view", [False, True])
def test_astype_and_copy_in_c_match_numpy(m, src, dtype, view, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("astype took Manager.new_pinned, not the C step")

    a = (np.arange(60) * 7.3 - 100).astype(src).reshape(6, 10)
    x = ca.asarray(a, manager=m)
    if view:
        a, x = a[::2, 1::3], x[::2, 1::3]
    monkeypatch.setattr(m, "new_pinned", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for got, want in ((x.astype(dtype), a.astype(dtype)), (x.copy(), a.copy())):
            assert type(got) is ca.CachedArray and got.object is not x.object
            assert (got.shape, got.dtype, got.strides) == (want.shape, want.dtype, want.strides)
            np.testing.assert_array_equal(np.asarray(got), want)
            assert got.object._pins == 0 and x.object._pins == 0
    m.check()


def test_astype_keeps_numpys_casting_errors_and_leaves_nothing_behind(m):
    x = ca.asarray(np.linspace(0, 1, 100), manager=m)
    before = _heap_blocks(m)
    with pytest.raises(TypeError, match="'safe'"):
        x.astype(np.int32, casting="safe")
    with pytest.raises(ValueError, match="casting"):
        x.astype(np.float32, casting="bogus")
    assert _heap_blocks(m) == before and x.object._pins == 0
    assert x.astype(np.float64, copy=False) is x
    f = x.reshape(10, 10).T.astype(np.float32)          # order K of an F view: F, Python path
    assert f.strides == np.linspace(0, 1, 100).reshape(10, 10).T.astype(np.float32).strides
    m.check()


def _cast_outcome(f):
    try:
        r = f()
    except Exception as e:        # noqa: BLE001 - compared with NumPy's
        return type(e), str(e)
    return r.dtype, r.shape, r.strides, np.asarray(r).tobytes()


@pytest.mark.parametrize("casting", ["no", "equiv", "safe", "same_kind", "unsafe",
                                     "same_value", "bogus", None])
@pytest.mark.parametrize("values, dtype", [(np.array([1.0, -2.0, 3.0]), np.int8),
                                           (np.array([1.5, 300.0]), np.int16),
                                           (np.array([1.0, 2.0]), np.float32),
                                           (np.arange(6.0).reshape(2, 3).T, np.int64),
                                           (np.array([7, -1]), np.uint8)])
def test_astype_takes_every_casting_rule_numpy_takes(m, casting, values, dtype):
    """Each rule NumPy's astype knows gives NumPy's result or its error (and its message)."""
    x = ca.asarray(values, manager=m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _cast_outcome(lambda: values.astype(dtype, casting=casting))
        got = _cast_outcome(lambda: x.astype(dtype, casting=casting))
    assert got == want
    assert x.object._pins == 0
    m.check()


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
                    got = a + b
                    assert got.max() == want and got.argmin() == 0
                    got += 1.0                          # in place, while others evict
                    got[0] = want
                    got = np.asarray(got)
                    assert got[0] == want and got[-1] == want + 1
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
        _records.operator(np.add, print, 6)


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

        def calls():
            z = x + y
            _ = (-z)[1:3], np.exp(x), z < 1, z.sum(), x.max(axis=0)
            z += y
            np.multiply(z, 2, out=z)
            z[1:3] = 0.0
            ca.empty(n, manager=m)

        alive, errors = close_while_calling(m, calls, delay, UseAfterFreeError)
        assert not alive                      # the close neither hangs nor crashes the worker
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


# ---- random calls against NumPy (hypothesis) ------------------------------------------------------

_SHAPES = st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple)
_INDEX = st.one_of(st.integers(-7, 7), st.builds(slice, st.none() | st.integers(-7, 7),
                                                 st.none() | st.integers(-7, 7),
                                                 st.none() | st.sampled_from([-2, -1, 1, 2, 3])),
                   st.just(Ellipsis), st.none())
_KEYS = st.one_of(_INDEX, st.lists(_INDEX, min_size=1, max_size=4).map(tuple))
_SCALARS = st.one_of(st.integers(-5, 5), st.floats(-5, 5), st.booleans(),
                     st.sampled_from([np.float32(1.5), np.int8(-3)]))


def _outcome(f):
    """f()'s result, or its exception's type (NumPy's and ours must match)."""
    try:
        return f()
    except Exception as e:        # noqa: BLE001 - compared below
        return type(e)


@settings(max_examples=300, deadline=None)
@given(shape=_SHAPES, key=_KEYS, value=_SCALARS, dtype=st.sampled_from(["f8", "f4", "i4"]))
def test_random_scalar_assignments_match_numpy(shape, key, value, dtype):
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        a = np.arange(np.prod(shape), dtype=dtype).reshape(shape)
        x = _arr(m, a.copy())
        want = _outcome(lambda: a.__setitem__(key, value))
        got = _outcome(lambda: x.__setitem__(key, value))
        assert got == want
        np.testing.assert_array_equal(np.asarray(x), a)
        assert x.object._pins == 0


_OPS = ["iadd", "imul", "isub", "out_max", "sum", "max0", "argmin", "mean1", "any"]


@settings(max_examples=200, deadline=None)
@given(shape=_SHAPES, op=st.sampled_from(_OPS), value=_SCALARS,
       dtype=st.sampled_from(["f8", "f4", "i4", "c16"]))
def test_random_in_place_calls_and_reductions_match_numpy(shape, op, value, dtype):
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        a = (np.arange(np.prod(shape)) % 7 - 3).astype(dtype).reshape(shape)
        b = np.ones(shape, dtype)
        x, y = _arr(m, a.copy()), _arr(m, b)
        calls = {
            "iadd": lambda p, q: p.__iadd__(value), "imul": lambda p, q: p.__imul__(q),
            "isub": lambda p, q: np.subtract(p, value, out=p),
            "out_max": lambda p, q: np.maximum(p, q, out=(p,)),
            "sum": lambda p, q: p.sum(), "max0": lambda p, q: p.max(axis=0),
            "argmin": lambda p, q: p.argmin(), "mean1": lambda p, q: p.mean(axis=-1),
            "any": lambda p, q: p.any(),
        }
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)        # the mean of nothing
            want = _outcome(lambda: calls[op](a, b))
            got = _outcome(lambda: calls[op](x, y))
        if want is a:
            assert got is x                                # in place: the array itself
        elif isinstance(want, type):
            assert got == want                             # the same error
        elif isinstance(want, np.ndarray):
            np.testing.assert_array_equal(np.asarray(got), want)
        else:
            assert type(got) is type(want) and (got == want or (got != got and want != want))
        np.testing.assert_array_equal(np.asarray(x), a)   # in place: the same values
        assert x.object._pins == 0 and y.object._pins == 0


# ---- other NumPy functions: run_read --------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda np_, x, y: np_.inner(x, y), lambda np_, x, y: np_.median(x),
    lambda np_, x, y: np_.transpose(x), lambda np_, x, y: np_.clip(x, 2.0, y),
    lambda np_, x, y: np_.atleast_2d(x), lambda np_, x, y: np_.unique(x, return_counts=True)])
def test_other_functions_run_in_c_and_match_numpy(m, monkeypatch, call):
    a, b = np.arange(10.0)[::-1].reshape(2, 5).copy(), np.full((2, 5), 6.0)
    x, y = _arr(m, a), _arr(m, b)
    want = call(np, a, b)
    run = type(m).run

    def refuse(self, fn, reads=(), writes=(), nbytes=None, *args, **kwargs):
        if nbytes is None:             # a kernel that makes no array: the call itself
            raise AssertionError("Manager.run ran the call: run_read was not taken")
        return run(self, fn, reads, writes, nbytes, *args, **kwargs)
    monkeypatch.setattr(type(m), "run", refuse)
    got = call(np, x, y)
    monkeypatch.undo()
    for w, g in zip(want, got) if isinstance(want, tuple) else [(want, got)]:
        if isinstance(w, np.ndarray) and w.ndim:
            assert isinstance(g, ca.CachedArray)
            g = np.asarray(g)
        np.testing.assert_array_equal(g, w)
    assert x.object._pins == 0 and y.object._pins == 0
    m.check()


def test_a_view_result_follows_its_array_when_it_moves(m):
    x = _arr(m, np.arange(12.0).reshape(3, 4))
    t = np.transpose(x)
    m.evict(x.object)
    m.prefetch(x.object)
    x[0, 0] = 100.0
    np.testing.assert_array_equal(np.asarray(t)[0], [100.0, 4.0, 8.0])


def test_a_function_that_reshapes_its_argument_leaves_the_array_whole(m):
    from cachedarrays import dispatch
    x = _arr(m, np.arange(10.0))

    def reshaping(a):                  # some NumPy code sets the shape of what it is given
        a.shape = (2, 5)
        a.flags.writeable = False
        return float(a.sum())
    assert dispatch._read_only_call(reshaping, (x,), {}) == 45.0
    np.testing.assert_array_equal(np.asarray(x + 1), np.arange(10.0) + 1)
    x[3] = -1.0
    assert x.shape == (10,) and float(x[3]) == -1.0


def test_an_error_in_the_function_leaves_nothing_pinned(m):
    x, z = _arr(m, np.arange(10.0)), _arr(m, np.arange(3.0))
    with pytest.raises(ValueError):
        np.dot(x, z)
    assert x.object._pins == 0 and z.object._pins == 0
    m.evict(x.object)                          # nothing holds it
    m.check()


def test_a_traced_function_is_one_kernel_with_its_name(m):
    x, y = _arr(m, np.arange(10.0)), _arr(m, np.ones(10))
    with ca.trace(m) as t:
        d = np.dot(x, y)
    assert d == 45.0
    assert [k[0] for k in t.kernels] == ["dot"]


@pytest.mark.parametrize("keywords", [{}, {"optimize": False}])
def test_calls_with_more_arguments_than_run_read_takes_match_numpy(m, keywords):
    a = [np.arange(3.0) + k for k in range(8)]
    xs = [_arr(m, v) for v in a]
    spec = ",".join("i" * 8) + "->"
    assert np.einsum(spec, *xs, **keywords) == np.einsum(spec, *a, **keywords)
    ones = np.ones(3)
    got = np.broadcast_arrays(*xs, ones)
    assert len(got) == 9 and all(isinstance(g, ca.CachedArray) for g in got[:8])
    assert type(got[8]) is np.ndarray and np.shares_memory(got[8], ones)   # as NumPy gives it
    for g, w in zip(got, np.broadcast_arrays(*a, np.ones(3))):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert all(x.object._pins == 0 for x in xs)
    m.check()


# NumPy functions called with positional arguments only (the shortest path) or with keywords;
# f(np_, x, y): x and y are arrays of one shape, each a CachedArray or an ndarray.
_FUNCTIONS = {
    "sum": lambda np_, x, y: np_.sum(x), "sum0": lambda np_, x, y: np_.sum(x, 0),
    "mean_kw": lambda np_, x, y: np_.mean(x, axis=-1), "ravel": lambda np_, x, y: np_.ravel(x),
    "transpose": lambda np_, x, y: np_.transpose(x), "flip": lambda np_, x, y: np_.flip(x),
    "squeeze": lambda np_, x, y: np_.squeeze(x), "atleast_3d": lambda np_, x, y: np_.atleast_3d(x),
    "diagonal": lambda np_, x, y: np_.diagonal(x),
    "moveaxis": lambda np_, x, y: np_.moveaxis(x, 0, -1),
    "real": lambda np_, x, y: np_.real(x), "imag": lambda np_, x, y: np_.imag(x),
    "split": lambda np_, x, y: np_.split(x, 1),
    "array_split": lambda np_, x, y: np_.array_split(x, 2),
    "broadcast_arrays": lambda np_, x, y: np_.broadcast_arrays(x, y),
    "where": lambda np_, x, y: np_.where(x, x, y), "nonzero": lambda np_, x, y: np_.nonzero(x),
    "dot": lambda np_, x, y: np_.dot(x, y), "inner": lambda np_, x, y: np_.inner(x, y),
    "clip": lambda np_, x, y: np_.clip(x, 1, y), "cumsum": lambda np_, x, y: np_.cumsum(x),
    "diff": lambda np_, x, y: np_.diff(x), "sort": lambda np_, x, y: np_.sort(x),
    "argmax": lambda np_, x, y: np_.argmax(x), "unique": lambda np_, x, y: np_.unique(x),
    "unique_counts": lambda np_, x, y: np_.unique_counts(x),
    "allclose": lambda np_, x, y: np_.allclose(x, y),
    "isclose": lambda np_, x, y: np_.isclose(x, y),
    "array_equal": lambda np_, x, y: np_.array_equal(x, y),
    "take": lambda np_, x, y: np_.take(x, 0),
    "reshape": lambda np_, x, y: np_.reshape(x, -1), "tile": lambda np_, x, y: np_.tile(x, 2),
    "concatenate": lambda np_, x, y: np_.concatenate([x, y]),
    "concatenate_axis": lambda np_, x, y: np_.concatenate((x, y), np_.int64(-1)),
    "concatenate_one": lambda np_, x, y: np_.concatenate([x]),
    "stack": lambda np_, x, y: np_.stack([x, y]), "outer": lambda np_, x, y: np_.outer(x, y),
    "count_nonzero": lambda np_, x, y: np_.count_nonzero(x), "ndim": lambda np_, x, y: np_.ndim(x),
    "copy": lambda np_, x, y: np_.copy(x), "around": lambda np_, x, y: np_.around(x, 1),
    "histogram": lambda np_, x, y: np_.histogram(x, 3), "median": lambda np_, x, y: np_.median(x),
    "linalg_norm": lambda np_, x, y: np_.linalg.norm(x), "trace": lambda np_, x, y: np_.trace(x),
    # calls that write x: the writes must reach it
    "nan_to_num_in_place": lambda np_, x, y: np_.nan_to_num(x, False),
    "median_overwrite": lambda np_, x, y: np_.median(x, None, None, True),
    "put": lambda np_, x, y: np_.put(x, 0, 9), "copyto": lambda np_, x, y: np_.copyto(x, y),
    "fill_diagonal": lambda np_, x, y: np_.fill_diagonal(x, 5),
}
# the functions that take y too
_BOTH = {"broadcast_arrays", "where", "dot", "inner", "clip", "allclose", "isclose", "array_equal",
         "concatenate", "concatenate_axis", "stack", "outer", "copyto"}
_DTYPES = ["f8", "f4", "i4", "?", "c16", ">f8", "<i2", "u1"]
_SHAPES = [(), (0,), (5,), (3, 4), (2, 1, 3), (1, 1)]


def _leaves(r):
    return list(r) if isinstance(r, (tuple, list)) else [r]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(_FUNCTIONS)), dtype=st.sampled_from(_DTYPES),
       shape=st.sampled_from(_SHAPES), kinds=st.sampled_from(["cc", "cn", "nc", "c2"]),
       seed=st.integers(0, 2**16))
def test_numpy_functions_on_cached_arrays_match_numpy_and_views_stay_views(name, dtype, shape,
                                                                          kinds, seed):
    assume(kinds[0] == "c" or name in _BOTH)           # a CachedArray among the arguments
    call = _FUNCTIONS[name]
    rng = np.random.default_rng(seed)
    a = np.asarray(rng.integers(0, 4, shape) + (1j if dtype == "c16" else 0)).astype(dtype)
    b = np.asarray(rng.integers(0, 4, shape)).astype(dtype)
    with ca.Manager(fast="1MiB", slow="8MiB") as m, ca.Manager(fast="1MiB", slow="8MiB") as m2:
        x = ca.asarray(a, manager=m) if kinds[0] == "c" else a.copy()
        y = b.copy() if kinds[1] == "n" else ca.asarray(b, manager=m2 if kinds[1] == "2" else m)
        try:
            want = call(np, a, b)
        except Exception as e:                     # the same error as NumPy's
            with pytest.raises(type(e)):
                call(np, x, y)
            return
        got = call(np, x, y)
        if want is a and a.size:                   # NumPy returned the input itself
            assert got.object is x.object
        assert type(got) is type(want) or isinstance(want, np.ndarray) or np.isscalar(want)
        plain = [(p, q) for p, q in ((x, a), (y, b)) if isinstance(p, np.ndarray)]
        for g, w in zip(_leaves(got), _leaves(want)):
            mine = [p for p, q in plain if isinstance(w, np.ndarray) and
                    (w is q or (not w.flags.owndata and np.shares_memory(w, q)))]
            if mine:                               # an ndarray argument (or a view of one)
                assert type(g) is np.ndarray, (name, type(g))    # comes back as NumPy gives it
                itself = any(w is q for _, q in plain)             # NumPy returned the argument
                assert g is mine[0] if itself else np.shares_memory(g, mine[0])
                np.testing.assert_array_equal(g, w)
            elif isinstance(w, np.ndarray):        # an array (0-d too): a CachedArray
                assert isinstance(g, ca.CachedArray), (name, type(g))
                assert g.shape == w.shape and g.dtype == w.dtype
                np.testing.assert_array_equal(np.asarray(g), w)
            else:                                  # a scalar stays one
                assert type(g) is type(w) and (g == w or (g != g and w != w))
        # a result that is a view of an input stays one: a write through it reaches the input,
        # which keeps it across a move
        for g, w in zip(_leaves(got), _leaves(want)):
            if isinstance(w, np.ndarray) and w.size and w.flags.writeable and \
                    np.shares_memory(w, a):
                w[(0,) * w.ndim] = 7
                g[(0,) * g.ndim] = 7
                break
        for arr, want_arr in ((x, a), (y, b)):
            if isinstance(arr, ca.CachedArray):
                assert arr.object._pins == 0
                ca.evict(arr)
                np.testing.assert_array_equal(np.asarray(arr), want_arr)
        m.check()
        m2.check()


_LAYOUTS = {
    "F": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    "strided": np.arange(24.0).reshape(4, 6)[::2, 1::2], "reversed": np.arange(5)[::-1],
    "0-d": np.array(2.5), "empty": np.empty((0, 3)), "big-endian": np.arange(6, dtype=">i4"),
    "structured": np.array([(1, 2.0), (3, 4.0)], dtype="i4,f8"),
    "readonly": np.broadcast_to(np.arange(3.0), (2, 3)), "strings": np.array(["ab", "c"]),
    "unaligned": np.frombuffer(bytes(17), dtype="f8", count=2, offset=1),
}


@pytest.mark.parametrize("placement", [None, "slow"])
@pytest.mark.parametrize("a", list(_LAYOUTS.values()), ids=list(_LAYOUTS))
def test_asarray_copies_any_layout_into_a_writable_array(m, a, placement):
    x = ca.asarray(a, manager=m, placement=placement)
    assert x.shape == a.shape and x.dtype == a.dtype and x.flags.writeable
    np.testing.assert_array_equal(np.asarray(x), a)
    if x.size:
        x[(0,) * x.ndim] = a[(-1,) * a.ndim]
        ca.evict(x)
        assert np.asarray(x)[(0,) * x.ndim] == a[(-1,) * a.ndim]
    assert x.object._pins == 0
    m.check()


@pytest.mark.parametrize("kind", ["__array__", "__float__", "list of them"])
def test_a_fill_value_running_python_code_does_not_stall_other_threads(m, kind):
    """Code a fill value runs (its __array__, __float__) runs outside the manager's lock:
    another thread's call completes meanwhile."""
    y = ca.zeros(8, manager=m)
    done = threading.Event()

    def other():
        ca.evict(y)
        ca.full(4, 1.0, manager=m)
        done.set()

    class FloatFill:
        def __float__(self):
            threading.Thread(target=other).start()
            done.wait(10)
            return 2.0

    class ArrayFill(FloatFill):
        def __array__(self, dtype=None, copy=None):
            return np.full(8, float(self), dtype)

    fill = {"__array__": ArrayFill(), "__float__": FloatFill(),
            "list of them": [FloatFill()] * 8}[kind]
    x = ca.full(8, fill, float, manager=m)
    assert done.is_set()                                # the other thread was not held up
    assert np.asarray(x).tolist() == [2.0] * 8
    assert x.object._pins == 0
    m.check()
