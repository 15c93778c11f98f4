"""New results of small kernels: created where the policy's allocate would put them, reported
to it, counted, freed when dropped (their blocks reused), and sort and the running totals
written straight into a policy-placed result."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.policies.base import Policy
from cachedarrays.policies.lru import LRU


def _pair(m, n=12):
    rng = np.random.default_rng(5)
    a, b = rng.random(n), rng.random(n)
    return a, b, ca.asarray(a, manager=m), ca.asarray(b, manager=m)


def test_dropped_results_free_their_blocks_and_the_heap_stays_sound(m):
    a, b, x, y = _pair(m)
    before = m.fast.stats()
    allocs, frees = m.telemetry.allocs["fast"], m.telemetry.frees["fast"]
    offsets = set()
    for i in range(300):
        r = (x + y) * 2.0 - i
        offsets.add(r.object.primary.offset)
        np.testing.assert_array_equal(np.asarray(r), (a + b) * 2.0 - i)
        del r
    m.drain()
    assert len(offsets) <= 3                    # freed blocks are handed out again
    after = m.fast.stats()
    assert after["used"] == before["used"]
    assert m.telemetry.allocs["fast"] - allocs == 900       # three results per round
    assert m.telemetry.frees["fast"] - frees == 900
    m.fast.heap.check()
    np.testing.assert_array_equal(np.asarray(x), a)       # inputs untouched


def test_results_never_alias_live_arrays(m):
    a, b, x, y = _pair(m)
    keep = [x + y for _ in range(20)] + [np.sqrt(x) for _ in range(20)]
    objs = {id(k.object) for k in keep}
    offs = {k.object.primary.offset for k in keep}
    assert len(objs) == len(offs) == 40
    assert x.object.primary.offset not in offs and y.object.primary.offset not in offs
    for k in keep[:20]:
        np.testing.assert_array_equal(np.asarray(k), a + b)


def test_a_new_result_is_the_most_recent_dirty_and_unpinned(m):
    a, b, x, y = _pair(m)
    r = x * y
    obj = r.object
    assert list(m.policy.recent)[-1] == obj.id
    assert m.isdirty(obj.primary) and obj.primary.device is m.fast
    assert not m.pinned(obj) and not m.pinned(x.object)


class _Counting(Policy):
    """The base policy, counting its notifications."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_fast(self, obj):
        self.seen.append(("fast", obj.id))

    def write_use(self, obj):
        super().write_use(obj)
        self.seen.append(("write", obj.id))


class _Elsewhere(Policy):
    """Puts every new array in slow memory."""

    def allocate(self, nbytes):
        return self.alloc_slow(nbytes)


def test_policies_that_override_hooks_get_them_called(make_manager):
    assert _Counting.fast_first and _Counting.new_in_fast is Policy.new_in_fast
    assert not _Elsewhere.fast_first
    m = make_manager(policy=_Counting())
    _, _, x, y = _pair(m)
    r = x + y
    assert ("fast", r.object.id) in m.policy.seen and ("write", r.object.id) in m.policy.seen
    m2 = make_manager(policy=_Elsewhere())
    _, _, x2, y2 = _pair(m2)
    assert (x2 + y2).device == "slow"


def test_lru_without_local_alloc_keeps_its_placement(make_manager):
    m = make_manager(policy=LRU(local_alloc=False))
    assert not m.policy.fast_first
    a, b, x, y = _pair(m)
    r = x + y
    assert set(r.object.regions) == {"fast", "slow"}      # cached with a linked slow copy
    m.policy.local_alloc = True
    assert m.policy.fast_first
    assert set((x + y).object.regions) == {"fast"}


def test_fast_only_puts_new_arrays_in_fast_memory_in_c_and_still_refuses_what_does_not_fit(
        monkeypatch):
    """FastOnly's allocate is alloc_fast or an error, so new arrays take the C path; the
    policy's own error still names the problem when fast memory is full."""
    from cachedarrays.policies import FastOnly

    assert FastOnly.fast_first
    calls = []
    real = ca.Manager.create
    monkeypatch.setattr(ca.Manager, "create", lambda self, *a: (calls.append(a), real(self, *a))[1])
    with ca.Manager(fast="64KiB", slow="1MiB", policy="fastonly") as m:
        x = ca.empty((16, 16), manager=m)
        y = x + 1
        assert calls == [] and x.device == y.device == "fast"
        assert m.isdirty(y.object.primary)
        with pytest.raises(ca.OutOfMemoryError, match="FastOnly policy: .* does not fit"):
            ca.empty(1 << 20, manager=m)
        m.check()

    class Counting(FastOnly):                # overrides a hook: new arrays report to it again
        def __init__(self):
            super().__init__()
            self.writes = []

        def write_use(self, obj):
            super().write_use(obj)
            self.writes.append(obj.id)

    assert FastOnly.new_in_fast is not Policy.new_in_fast
    assert Counting.new_in_fast is Policy.new_in_fast
    with ca.Manager(fast="64KiB", slow="1MiB", policy=Counting()) as m:
        x = ca.empty(8, manager=m)
        y = x + 1
        assert m.policy.writes == [x.object.id, y.object.id]


def test_quick_heap_calls_refuse_a_double_free(m):
    heap = m.fast.heap
    off = heap.quick_alloc(100, 10 ** 9)
    heap.quick_free(off, 10 ** 9)
    with pytest.raises(ca.UseAfterFreeError):
        heap.quick_free(off, 10 ** 9)
    heap.check()


@pytest.mark.parametrize("call", [
    lambda np_, x: np_.sort(x), lambda np_, x: np_.sort(x, axis=0),
    lambda np_, x: np_.sort(x, axis=None), lambda np_, x: np_.sort(x[:, ::2]),
    lambda np_, x: np_.cumsum(x), lambda np_, x: np_.cumsum(x, axis=1),
    lambda np_, x: np_.cumsum(x, axis=0, dtype=np.float32),
    lambda np_, x: np_.cumprod(x.astype(np.int8), axis=-1)])
def test_sort_and_running_totals_match_numpy(m, call):
    a = np.random.default_rng(1).random((5, 6)) * 4
    x = ca.asarray(a, manager=m)
    want = call(np, a)
    got = call(np, x)
    assert isinstance(got, ca.CachedArray)
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(x), a)
    with pytest.raises(np.exceptions.AxisError):
        np.cumsum(x, axis=2)


@pytest.mark.parametrize("name, call", [
    ("sort", lambda np_, x, y: np_.sort(x, axis=0)),
    ("cumsum", lambda np_, x, y: np_.cumsum(x, axis=1)),
    ("cumprod", lambda np_, x, y: np_.cumprod(x)),
    ("concatenate", lambda np_, x, y: np_.concatenate([x, y], axis=1)),
    ("where", lambda np_, x, y: np_.where(x > y, x, y))])
def test_routines_give_the_same_result_quick_or_traced(m, name, call):
    rng = np.random.default_rng(2)
    a, b = rng.random((4, 5)), rng.random((4, 5))
    x, y = ca.asarray(a, manager=m), ca.asarray(b, manager=m)
    want = call(np, a, b)
    quick = call(np, x, y)                       # the C step
    with ca.trace(m) as t:                       # an observer: Manager.run's general path
        traced = call(np, x, y)
    for got in (quick, traced):
        assert isinstance(got, ca.CachedArray)
        np.testing.assert_array_equal(np.asarray(got), want)
    assert name in [k[0] for k in t.kernels]


def test_concatenate_of_more_arrays_than_the_c_step_takes(m):
    parts = [np.arange(5.0) + i for i in range(10)]
    got = np.concatenate([ca.asarray(p, manager=m) for p in parts])
    assert isinstance(got, ca.CachedArray)
    np.testing.assert_array_equal(np.asarray(got), np.concatenate(parts))
