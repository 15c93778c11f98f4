"""The quick paths of NumPy calls keep every rule of the slow ones: one __array_function__ entry
per NumPy function, basic slices computed without pinning, and Manager.run's pins, use reports,
lineage and telemetry."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import dispatch
from cachedarrays.layout import basic_index
from helpers import assert_eq


def _pair(m, n=12):
    rng = np.random.default_rng(3)
    a, b = rng.random(n), rng.random(n)
    return a, b, ca.asarray(a, manager=m), ca.asarray(b, manager=m)


# ---- one dispatch per NumPy function ------------------------------------------------------

CALLS = {
    "concatenate": lambda np_, x, y: np_.concatenate([x, y]),
    "where": lambda np_, x, y: np_.where(x > .5, x, y),
    "stack": lambda np_, x, y: np_.stack([x, y]),
    "vstack": lambda np_, x, y: np_.vstack([x, y]),
    "hstack": lambda np_, x, y: np_.hstack([x, y]),
    "sort": lambda np_, x, y: np_.sort(x),
    "cumsum": lambda np_, x, y: np_.cumsum(x),
    "append": lambda np_, x, y: np_.append(x, y),
    "zeros_like": lambda np_, x, y: np_.zeros_like(x),
    "full_like": lambda np_, x, y: np_.full_like(x, 2.0),
    "median": lambda np_, x, y: np_.median(x),
    "clip": lambda np_, x, y: np_.clip(x, .2, .8),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_numpy_function_enters_array_function_once(m, name):
    a, b, x, y = _pair(m)
    call = CALLS[name]
    before = dispatch.entries()
    got = call(np, x, y)
    assert dispatch.entries() - before == 1
    want = call(np, a, b)
    if isinstance(want, np.ndarray):
        assert_eq(got, want, check_manager=False)
    else:
        assert got == want


# ---- basic slices ---------------------------------------------------------------------------

KEYS = [slice(1, 5), slice(None, None, -1), slice(7, 2, -2), slice(5, 2), slice(None), 3, -1,
        (slice(1, 3), 2), (1,), (slice(None), slice(None, None, 3)), (slice(-2, None), -4),
        (0, slice(1, 4))]


@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_basic_index_gives_numpys_view(key):
    a = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)[:, ::-1]
    sel = basic_index(a.shape, a.strides, key)
    want = a[key]
    assert sel is not None
    shape, strides, off = sel
    assert (shape, strides) == (want.shape, want.strides)
    if want.size:
        start = a.__array_interface__["data"][0]
        assert off == want.__array_interface__["data"][0] - start


def test_basic_index_leaves_other_keys_to_numpy():
    shape, strides = (4, 5), (40, 8)
    for key in ((1, 2), 9, -9, (0, 0, 0), Ellipsis, [1, 2], (None, 1), np.int64(1), True):
        assert basic_index(shape, strides, key) is None


def test_a_slice_is_a_view_that_pins_nothing_and_follows_its_array(m):
    a, b, x, y = _pair(m)
    uses = []

    class Watch(ca.Observer):
        def on_acquire(self, name, reads, writes, touched=None):
            uses.append(name)
    watch = Watch()
    m.observe(watch)
    s = x[2:9:3]
    m.unobserve(watch)
    assert uses == [] and s.object is x.object and not m.pinned(x.object)
    assert_eq(s, a[2:9:3])
    ca.evict(x)
    assert x.device == "slow"
    s[...] = -1.0                     # writes through the slice land in x, wherever it is
    a[2:9:3] = -1.0
    assert_eq(x, a)
    ca.prefetch(x, force=True)
    assert_eq(x[::-1][1:4], a[::-1][1:4])


def test_slicing_a_freed_array_raises(m):
    _, _, x, _ = _pair(m)
    ca.unsafe_free(x)
    with pytest.raises(ca.UseAfterFreeError):
        x[1:3]


# ---- Manager.run: the quick path of kernels ---------------------------------------------------

@pytest.mark.parametrize("short", [True, False])
def test_run_pins_reports_and_places_a_new_object(m, short):
    _, _, x, y = _pair(m)
    seen = {}

    def fn(new):
        seen["pins"] = (m.pin_count(x.object), m.pin_count(y.object), m.pin_count(new))
        seen["new"] = new
        return "done"
    allocs = m.stats()["devices"]["fast"]["allocs"]
    version = y.object.version
    assert m.run(fn, (x.object,), (y.object,), 96, "k", short) == "done"
    new = seen["new"]
    assert seen["pins"] == (1, 1, 1)
    assert (m.pin_count(x.object), m.pin_count(y.object), m.pin_count(new)) == (0, 0, 0)
    assert new.nbytes == 96 and new.device == "fast" and m.isdirty(new.primary)
    assert y.object.version == version + 1 and y.object.chain == "k"     # a write, no recipe
    assert m.isdirty(y.object.primary)
    assert m.stats()["devices"]["fast"]["allocs"] == allocs + 1
    assert m.policy.tiers()[1][-1] == new.id                             # LRU was told


@pytest.mark.parametrize("short", [True, False])
def test_run_unpins_when_the_kernel_raises(m, short):
    _, _, x, _ = _pair(m)

    def fn(new):
        raise RuntimeError("kernel failed")
    with pytest.raises(RuntimeError):
        m.run(fn, (x.object,), (), 64, "k", short)
    assert m.pin_count(x.object) == 0


def test_run_reports_to_observers_as_acquire_does(m):
    _, _, x, _ = _pair(m)
    events = []

    class Watch(ca.Observer):
        def on_acquire(self, name, reads, writes, touched=None):
            events.append(("acquire", name))

        def on_new(self, obj, placement):
            events.append(("new", obj.nbytes))

        def on_release(self, objs):
            events.append(("release", len(objs)))
    m.observe(Watch())
    m.run(lambda new: None, (x.object,), (), 32, "k", True)
    assert events == [("acquire", "k"), ("new", 32), ("release", 1), ("release", 1)]


def test_run_refuses_freed_objects(m):
    _, _, x, _ = _pair(m)
    obj = x.object
    ca.unsafe_free(x)
    with pytest.raises(ca.UseAfterFreeError):
        m.run(lambda new: None, (obj,), (), None, "k", True)


def test_ufunc_results_on_the_quick_path_are_managed_arrays(m):
    a, b, x, y = _pair(m)
    before = m.stats()["devices"]["fast"]["allocs"]
    z = x * y + 1.0
    assert_eq(z, a * b + 1.0)
    assert m.stats()["devices"]["fast"]["allocs"] == before + 2
    assert m.isdirty(z.object.primary) and not m.pinned(z.object)
    ca.evict(x)                        # the kernel's cached view of x is not reused
    m.defrag("fast")
    assert_eq(x + y, a + b)
    np.add(x, 1.0, out=x)              # out= takes the quick path too: a write
    assert m.isdirty(x.object.primary)
    assert_eq(x, a + 1.0)


def test_a_dropped_input_takes_the_general_path(m):
    a = np.arange(8.0)
    x = ca.asarray(a, manager=m)
    y = ca.empty(8, manager=m)
    ca.compute("double", lambda v, out: np.multiply(v, 2, out=out), [x], [y])
    m.drop(y)
    assert_eq(y + 1.0, a * 2 + 1.0)    # rebuilt before use


def test_the_benchmark_times_where_on_a_random_mask_side_by_side(m):
    import argparse
    from helpers import load_benchmark
    bench = load_benchmark("overhead")
    row = bench.where_on_a_random_mask(m, 1000, argparse.Namespace(budget=0.001, repeats=3),
                                       bench.clock_of("cpu"))
    assert row["n"] == 1000
    assert len(row["numpy"].samples) == len(row["ours"].samples) == 3
    assert row["speedup"].median > 0


# ---- a read-only call without keywords takes the flat path, and keeps every rule ----------------

@pytest.mark.parametrize("name, call", [
    ("dot", lambda x, y: np.dot(x, y)), ("mean", lambda x, y: np.mean(x)),
    ("diff", lambda x, y: np.diff(x)), ("outer", lambda x, y: np.outer(x, y)),
    ("clip", lambda x, y: np.clip(x, .2, .8)), ("isclose", lambda x, y: np.isclose(x, y))])
def test_a_read_only_call_without_keywords_takes_the_flat_path(m, name, call, monkeypatch):
    a, b, x, y = _pair(m)
    general = []
    real = dispatch._call_on_views
    monkeypatch.setattr(dispatch, "_call_on_views",
                        lambda *args: general.append(1) or real(*args))
    got, want = call(x, y), call(a, b)
    assert general == []
    if isinstance(want, np.ndarray):
        assert_eq(got, want)
        assert got.manager is m                    # a new array is managed, not a plain copy
    else:                                          # a scalar passes through as NumPy's
        assert type(got) is type(want) and got == want
    m.check()


@pytest.mark.parametrize("name, call, shape", [
    ("dot by position", lambda x, y, o: np.dot(x, y, o), ()),
    ("dot by keyword", lambda x, y, o: np.dot(x, y, out=o), ()),
    ("clip by position", lambda x, y, o: np.clip(x, .2, .8, o), (12,))])
def test_a_call_that_writes_takes_the_general_path(m, name, call, shape, monkeypatch):
    a, b, x, y = _pair(m)
    general = []
    real = dispatch._call_on_views
    monkeypatch.setattr(dispatch, "_call_on_views",
                        lambda *args: general.append(1) or real(*args))
    want, o = np.empty(shape), ca.zeros(shape, manager=m)
    call(a, b, want)
    call(x, y, o)
    assert general == [1]
    assert_eq(o, want)


@pytest.mark.parametrize("a", [np.arange(12.0).reshape(3, 4), np.asfortranarray(
    np.arange(12.0).reshape(3, 4)), np.array(7, dtype=np.int16), np.zeros((0, 3)),
    np.arange(6, dtype=">i4")])
def test_from_ndarray_copies_in_c_and_keeps_the_layout(m, a, monkeypatch):
    from cachedarrays.array import from_ndarray
    monkeypatch.setattr(type(m), "run", lambda *args, **kw: pytest.fail("took Manager.run"))
    x = from_ndarray(m, a)
    assert x.shape == a.shape and x.dtype == a.dtype and x.manager is m
    f_order = a.flags.f_contiguous and not a.flags.c_contiguous
    assert (x.flags.f_contiguous if f_order else x.flags.c_contiguous)
    assert np.array_equal(np.asarray(x), a)
    m.check()
