"""Long ca.compute chains: thousands of arrays, each made from the one before, dropped and
regenerated bitwise; the checks walk each dropped array once, a rebuild pins only a few arrays
at a time, and a changed input is still refused."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import lineage

ELEMS = 128                                       # 1 KiB arrays: a 256 KiB fast memory holds ~200


def _inc(x, y):
    np.add(x, 1.0, out=y)


def _chain(m, n, fn=_inc, elems=ELEMS):
    """a[0] (created with contents) and a[i+1] = fn(a[i]) for i < n."""
    a = [ca.asarray(np.arange(elems, dtype=np.float64), manager=m)]
    for _ in range(n):
        b = ca.empty(elems, manager=m)
        ca.compute("inc", fn, (a[-1],), (b,))
        a.append(b)
    return a


def _read(x):
    with ca.readable(x) as v:
        return np.array(v)


def _pinned(m, arrays):
    return sum(1 for x in arrays if m.pinned(x.object))


@pytest.mark.parametrize("n", [2000, 5000])
def test_a_long_chain_dropped_oldest_first_is_regenerated_bitwise(n):
    with ca.Manager(fast="256KiB", slow="64MiB") as m:
        a = _chain(m, n)
        base = _read(a[0])
        for x in a[1:]:
            ca.drop(x)
        assert all(x.object.dropped for x in a[1:])
        assert m.regenerable(a[-1].object)
        ca.regenerate(a[-1])
        np.testing.assert_array_equal(_read(a[-1]), base + n)
        np.testing.assert_array_equal(_read(a[n // 2]), base + n // 2)   # dropped again or kept
        assert _pinned(m, a) == 0
        m.check()


def test_drops_down_a_chain_walk_each_dropped_array_once(monkeypatch):
    n = 600
    with ca.Manager(fast="256KiB", slow="64MiB") as m:
        a = _chain(m, n)
        looked_up = []
        lookup = ca.Manager.object
        monkeypatch.setattr(ca.Manager, "object",
                            lambda self, oid: looked_up.append(oid) or lookup(self, oid))
        for x in a[1:]:
            ca.drop(x)
        assert len(looked_up) <= 4 * n            # not the whole dropped chain at each drop
        monkeypatch.undo()
        ca.regenerate(a[-1])
        np.testing.assert_array_equal(_read(a[-1]), np.arange(ELEMS) + n)


def test_a_deep_rebuild_pins_only_a_few_arrays_at_a_time():
    n = 500
    seen = []
    arrays = []

    def inc_watching(x, y):
        np.add(x, 1.0, out=y)
        if arrays and len(seen) < 10_000:
            seen.append(_pinned(m, arrays))

    with ca.Manager(fast="1MiB", slow="64MiB") as m:
        arrays.extend(_chain(m, n, inc_watching))
        for x in reversed(arrays[1:]):            # newest first
            ca.drop(x)
        seen.clear()
        ca.regenerate(arrays[-1])
        assert len(seen) == n                     # every kernel of the chain ran again
        assert max(seen) <= 3                     # the array asked for, one input, one output
        np.testing.assert_array_equal(_read(arrays[-1]), np.arange(ELEMS) + n)
        assert _pinned(m, arrays) == 0


def test_a_long_chain_of_two_input_kernels_is_regenerated_bitwise():
    n = 2000
    with ca.Manager(fast="256KiB", slow="64MiB") as m:
        a = [ca.asarray(np.arange(ELEMS, dtype=np.int64), manager=m),
             ca.asarray(np.arange(ELEMS, dtype=np.int64) * 3, manager=m)]
        want = [_read(a[0]), _read(a[1])]
        for _ in range(n):
            c = ca.empty(ELEMS, dtype=np.int64, manager=m)
            ca.compute("mix", lambda x, y, out: np.remainder(x + 2 * y, 1_000_003, out=out),
                       (a[-2], a[-1]), (c,))
            a.append(c)
            want.append((want[-2] + 2 * want[-1]) % 1_000_003)
        for x in a[2:]:                           # each is an input of the next two
            ca.drop(x)
        ca.regenerate(a[-1])
        np.testing.assert_array_equal(_read(a[-1]), want[-1])
        for i in (2, 3, n // 2, n // 2 + 1, n):
            np.testing.assert_array_equal(_read(a[i]), want[i])
        assert _pinned(m, a) == 0


def test_a_long_chain_of_two_output_kernels_rebuilds_the_other_outputs_on_the_way():
    n = 1500

    def split(x, lo, hi):
        np.add(x, 1.0, out=hi)
        np.subtract(x, 1.0, out=lo)

    with ca.Manager(fast="256KiB", slow="64MiB") as m:
        his, los = [ca.asarray(np.arange(ELEMS, dtype=np.float64), manager=m)], []
        for _ in range(n):
            lo, hi = ca.empty(ELEMS, manager=m), ca.empty(ELEMS, manager=m)
            ca.compute("split", split, (his[-1],), (lo, hi))
            his.append(hi)
            los.append(lo)
        for lo, hi in zip(los, his[1:]):
            ca.drop(lo, hi)
        ca.regenerate(los[-1])
        np.testing.assert_array_equal(_read(los[-1]), np.arange(ELEMS) + n - 2)
        np.testing.assert_array_equal(_read(his[-1]), np.arange(ELEMS) + n)
        np.testing.assert_array_equal(_read(los[n // 2]), np.arange(ELEMS) + n // 2 - 1)
        assert _pinned(m, his + los) == 0


def test_a_reason_deep_down_a_dropped_chain_keeps_its_wording():
    n = 2000
    with ca.Manager(fast="256KiB", slow="64MiB") as m:
        a = _chain(m, n)
        for x in a[1:]:
            ca.drop(x)
        why = lineage.why_not(m, a[-1].object, writing={a[0].object.id})
        assert why.startswith(f"input object {a[-2].object.id} of kernel 'inc' was dropped "
                              "and cannot be regenerated: ")
        assert why.count("was dropped and cannot be regenerated") == n - 1
        assert why.endswith(f"input object {a[0].object.id} of kernel 'inc' is about to be "
                            "written by the kernel starting now")
        assert m.why_not_regenerable(a[-1].object) is None


def test_a_written_input_in_the_middle_of_a_dropped_chain_is_refused_not_rebuilt_stale():
    n, k = 3000, 2000
    with ca.Manager(fast="256KiB", slow="64MiB") as m:
        a = _chain(m, n)
        for x in a[1:k]:
            ca.drop(x)
        with ca.writable(a[k + 100]) as v:        # a live array in the middle changes
            v[:] = -1.0
        why = m.why_not_regenerable(a[k + 101].object)
        assert why == (f"input object {a[k + 100].object.id} of kernel 'inc' was written since "
                       "(version 2; the kernel read version 1)")
        with pytest.raises(ca.RecomputeError, match="was written since"):
            ca.drop(a[k + 101])
        for x in a[k:k + 100]:                    # below it: still regenerable
            ca.drop(x)
        with ca.writable(a[500]) as v:            # a dropped one: rebuilt, then written
            v[:] = 0.0
        assert not a[501].object.dropped          # rebuilt before its input changed
        with pytest.raises(ca.RecomputeError, match="was written since"):
            ca.drop(a[501])
        assert m.regenerable(a[k + 99].object)    # its chain stops at a[501], unchanged
        np.testing.assert_array_equal(_read(a[k + 99]), np.arange(ELEMS) + k + 99)
        np.testing.assert_array_equal(_read(a[k + 100]), np.full(ELEMS, -1.0))
        np.testing.assert_array_equal(_read(a[k + 101]), np.arange(ELEMS) + k + 101)
        np.testing.assert_array_equal(_read(a[300]), np.arange(ELEMS) + 300)


def test_a_write_whose_rescue_ran_out_of_memory_rescues_again_next_time():
    elems = 2048                                  # 16 KiB arrays; no fast memory holds one
    with ca.Manager(fast="16KiB", slow="256KiB") as m:
        x = ca.asarray(np.arange(elems, dtype=np.float64), manager=m)
        y = ca.empty(elems, manager=m)
        ca.compute("inc", _inc, (x,), (y,))
        ca.drop(y)
        filler = []
        while True:
            try:
                filler.append(ca.zeros(elems, manager=m))
            except ca.OutOfMemoryError:
                break
        with pytest.raises(ca.OutOfMemoryError):
            with ca.writable(x) as v:             # y must be rebuilt first: no room for it
                v[:] = 0.0
        assert y.object.dropped and not m.pinned(x.object)
        np.testing.assert_array_equal(_read(x), np.arange(elems))   # the write never ran
        del filler[:2]
        with ca.writable(x) as v:                 # room now: y is rebuilt, then x written
            v[:] = 0.0
        assert not y.object.dropped
        np.testing.assert_array_equal(_read(y), np.arange(elems) + 1.0)


def test_a_rebuild_that_finds_no_room_says_so_and_leaves_the_chain_dropped():
    elems = 2048
    with ca.Manager(fast="16KiB", slow="256KiB") as m:
        a = _chain(m, 12, elems=elems)
        for x in a[1:]:
            ca.drop(x)
        filler = [ca.zeros(elems, manager=m) for _ in range(12)]
        with pytest.raises(ca.OutOfMemoryError,
                           match=f"cannot regenerate object {a[-1].object.id} .*found no room"):
            ca.regenerate(a[-1])
        assert all(x.object.dropped for x in a[1:]) and _pinned(m, a) == 0
        del filler[:4]
        ca.regenerate(a[-1])
        np.testing.assert_array_equal(_read(a[-1]), np.arange(elems) + 12)


def test_in_kernels_in_fast_mode_a_rebuild_needs_no_more_room_than_one_kernel():
    elems = 2048                                  # 16 KiB arrays: fast memory holds two
    with ca.Manager(fast="40KiB", slow="64MiB",
                    policy_options={"kernels_in_fast": True}) as m:
        a = _chain(m, 300, elems=elems)
        for x in a[1:]:
            ca.drop(x)
        ca.regenerate(a[-1])
        np.testing.assert_array_equal(_read(a[-1]), np.arange(elems) + 300)
        assert _pinned(m, a) == 0


def test_a_write_that_first_rebuilds_a_deep_chain_checks_each_array_once(monkeypatch):
    n = 2000
    with ca.Manager(fast="1KiB", slow="64MiB") as m:     # every array in slow memory: each
        a = _chain(m, n)                                 # input rebuilt is dropped again
        x = ca.asarray(np.ones(ELEMS), manager=m)
        top = ca.empty(ELEMS, manager=m)
        ca.compute("add", lambda u, v, out: np.add(u, v, out=out), (a[-1], x), (top,))
        for y in [*a[1:], top]:
            ca.drop(y)
        looked_up = []
        lookup = ca.Manager.object
        monkeypatch.setattr(ca.Manager, "object",
                            lambda self, oid: looked_up.append(oid) or lookup(self, oid))
        with ca.writable(x) as v:                 # top is made from x: it is rebuilt first
            v[:] = 0.0
        assert len(looked_up) <= 10 * n           # each array of the chain checked once
        monkeypatch.undo()
        assert not top.object.dropped
        np.testing.assert_array_equal(_read(top), np.arange(ELEMS) + n + 1.0)
        assert _pinned(m, a) == 0
