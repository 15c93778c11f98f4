"""ca.compute's and ca.kernel's (ca.access's) common calls and Manager.free_object's run in C
(native/records.c: compute_fast, kernel_enter, kernel_exit, free_fast). They must leave exactly
the state the Python paths leave: pins, versions, lineage (the recipes and what they recorded),
dirty bits, the policy's order, open scopes, heaps and telemetry, the data, and the same
errors."""


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays import manager as manager_module
from cachedarrays import scopes
from cachedarrays.errors import UseAfterFreeError
from helpers import close_while_calling, run_threads

SHAPE = (6, 4)


def _read(a):
    with ca.readable(a) as v:
        return np.array(v)


def _python_path(monkeypatch):
    monkeypatch.setattr(scopes, "_compute_fast", lambda *args: None)
    monkeypatch.setattr(scopes, "_kernel_enter", lambda *args: None)


def _recipe_state(r):
    return (r.name, r.args, r.partial, tuple(r.reads), tuple(r.versions), tuple(r.writes),
            r.rng, r.touched)


def _state(m, arrays):
    """Everything ca.compute may change, as plain values."""
    out = []
    for a in arrays:
        o = a.object
        chain = o.chain
        if isinstance(chain, list):
            chain = [_recipe_state(r) for r in chain]
        with ca.readable(a) as v:
            data = v.tobytes()
        p = o.primary
        out.append((o.id, o.version, chain, o._pins, p.device.name, p._dirty, data))
    policy = m.policy
    order = list(policy.recent) if hasattr(policy, "recent") else None
    return out, order, dict(m._scopes), m.telemetry.snapshot() if hasattr(
        m.telemetry, "snapshot") else None


def _views(base):
    """The operands a program may pass: whole arrays, a row slice (a partial write), the
    transpose (F order: a write through it covers the array), or nothing."""
    return [base[0], base[1], base[2], base[0][1:4], base[1].T, None]


def _kernel(k, fail):
    def fn(*views):
        total = float(k)
        for v in views:
            if v is not None and not v.flags.writeable:
                total += float(v.sum())
        for v in views:
            if v is not None and v.flags.writeable:
                v[...] = total
                total += 1.0
                if fail:
                    raise ValueError(f"kernel {k} failed")
        return total
    return fn


def _run(program, policy, fast_path, monkeypatch):
    if not fast_path:
        _python_path(monkeypatch)
    try:
        with ca.Manager(fast="64KiB", slow="1MiB", policy=policy) as m:
            base = [ca.full(SHAPE, float(i), manager=m) for i in range(3)]
            ops = _views(base)
            results = []
            for k, (reads, writes, fail, as_list, how) in enumerate(program):
                r = [ops[i] for i in reads]
                w = [ops[i] for i in writes]
                if not as_list:
                    r, w = tuple(r), tuple(w)
                try:
                    if how == "compute":
                        results.append(ca.compute(f"k{k % 3}", _kernel(k, fail), r, w))
                    else:
                        scope = ca.kernel(f"k{k % 3}", r, w) if how == "kernel" else \
                            ca.access(r, w)
                        with scope as views:
                            results.append(_kernel(k, fail)(*views))
                except ValueError as e:
                    results.append(str(e))
            m.check()
            return results, _state(m, base)
    finally:
        monkeypatch.undo()


_step = st.tuples(st.lists(st.integers(0, 5), max_size=3), st.lists(st.integers(0, 5), max_size=2),
                  st.booleans(), st.booleans(), st.sampled_from(["compute", "kernel", "access"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=st.lists(_step, min_size=1, max_size=12), policy=st.sampled_from(["lru", "fastonly"]))
def test_the_c_path_leaves_the_state_the_python_path_leaves(program, policy, monkeypatch):
    assert _run(program, policy, True, monkeypatch) == _run(program, policy, False, monkeypatch)


def _count_acquires(monkeypatch, m):
    """The kernel names Manager.acquire sees from now on (the Python path), in order."""
    calls = []
    real = type(m).acquire
    monkeypatch.setattr(type(m), "acquire", lambda self, *a, **k: (calls.append(a[2]),
                                                                   real(self, *a, **k))[1])
    return calls


def test_the_common_call_does_not_go_through_manager_acquire(monkeypatch):
    """The dispatch itself: a plain call takes the C path; a manager with an observer (a trace)
    takes Manager.acquire, which the observer needs."""
    with ca.Manager(fast="64KiB", slow="1MiB") as m:
        x, y = ca.ones(8, manager=m), ca.empty(8, manager=m)
        calls = _count_acquires(monkeypatch, m)
        ca.compute("double", lambda a, b: np.multiply(a, 2, out=b), (x,), (y,))
        assert calls == []
        with ca.trace(m):
            ca.compute("double", lambda a, b: np.multiply(a, 2, out=b), (x,), (y,))
        assert calls == ["double"]
        assert _read(y).tolist() == [2.0] * 8


def test_a_plain_kernel_scope_does_not_go_through_manager_acquire(monkeypatch):
    with ca.Manager(fast="64KiB", slow="1MiB") as m:
        x, y = ca.ones(8, manager=m), ca.empty(8, manager=m)
        calls = _count_acquires(monkeypatch, m)
        with ca.kernel("double", (x,), (y,)) as (a, b):
            assert x.object._pins == y.object._pins == 1 and len(m._scopes) == 1
            np.multiply(a, 2, out=b)
        assert x.object._pins == y.object._pins == 0 and m._scopes == {}
        assert calls == [] and y.object.chain == "double" and y.object.version == 1
        with ca.kernel("gather", (x,), (y,), touched=[(x, 8)]) as (a, b):  # for observers:
            b[...] = a                                                     # none here
        assert calls == []
        with ca.trace(m) as t:
            with ca.kernel("double", (x,), (y,)) as (a, b):
                np.multiply(a, 2, out=b)
            with ca.kernel("gather", (x,), (y,), touched=[(x, 8)]) as (a, b):
                b[...] = a
            with ca.kernel("double", (x,), (y,)) as (a, b):
                np.multiply(a, 2, out=b)
        assert calls == ["double", "gather", "double"]
        assert [list(v.values()) for v in t.touched.values()] == [[8]]   # x: 8 bytes
        with pytest.raises(RuntimeError, match="inside"):
            with ca.access((x,), (y,)) as (a, b):
                assert not a.flags.writeable and b.flags.writeable
                raise RuntimeError("inside")
        assert x.object._pins == y.object._pins == 0 and m._scopes == {}
        assert y.object.chain == "access" and y.object.version == 6


def test_read_views_cannot_be_made_writable_and_write_views_are_writable():
    with ca.Manager(fast="64KiB", slow="1MiB") as m:
        x, y = ca.ones(8, manager=m), ca.empty(8, manager=m)

        def fn(a, b):
            assert not a.flags.writeable and b.flags.writeable
            with pytest.raises(ValueError):
                a.flags.writeable = True
            b[...] = a + 1

        ca.compute("k", fn, (x,), (y,))
        assert _read(y).tolist() == [2.0] * 8


@pytest.fixture(params=["c", "python"])
def either_path(request, monkeypatch):
    """A manager with x (ones) and y (empty) of 8 float64, its calls on the C paths or, forced,
    on the Python ones."""
    if request.param == "python":
        _python_path(monkeypatch)
    with ca.Manager(fast="64KiB", slow="1MiB") as m:
        yield m, ca.ones(8, manager=m), ca.empty(8, manager=m)


def test_a_kernel_that_raises_leaves_nothing_pinned_and_marks_its_writes(either_path):
    m, x, y = either_path
    err = KeyError("boom")

    def fn(a, b):
        raise err

    with pytest.raises(KeyError) as info:
        ca.compute("bad", fn, (x,), (y,))
    assert info.value is err
    assert x.object._pins == y.object._pins == 0 and m._scopes == {}
    assert y.object.chain == ("kernel 'bad' raised an exception while writing it",)
    assert isinstance(x.object.chain, type(None))
    assert m.why_not_regenerable(y) is not None


def test_a_freed_operand_raises_the_same_error(either_path):
    m, x, y = either_path
    ca.unsafe_free(x)
    with pytest.raises(UseAfterFreeError, match=r"object \d+ \(64 B\) was freed"):
        ca.compute("k", lambda a, b: None, (x,), (y,))
    assert y.object._pins == 0 and m._scopes == {}


def test_a_kernel_may_change_the_lists_it_was_given_and_nest_another():
    with ca.Manager(fast="64KiB", slow="1MiB") as m:
        x, y, z = ca.ones(8, manager=m), ca.empty(8, manager=m), ca.empty(8, manager=m)
        reads, writes = [x], [y]

        def inner(a, c):
            c[...] = a * 3

        def outer(a, b):
            reads.clear()
            writes.append(None)
            b[...] = a + 1
            ca.compute("inner", inner, (y,), (z,))     # y is pinned twice meanwhile
            return "done"

        assert ca.compute("outer", outer, reads, writes) == "done"
        assert _read(z).tolist() == [6.0] * 8
        assert {o._pins for o in (x.object, y.object, z.object)} == {0}
        assert [r.name for r in z.object.chain] == ["inner"]


def test_threads_computing_on_shared_arrays_leave_every_pin_released():
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        src = ca.ones(1000, manager=m)
        outs = [ca.empty(1000, manager=m) for _ in range(4)]
        errors = []

        def work(k):
            try:
                for _ in range(300):
                    ca.compute("inc", lambda a, b: np.add(a, 1, out=b), (src,), (outs[k],))
            except BaseException as e:      # pragma: no cover - reported below
                errors.append(e)

        run_threads(work, len(outs))
        assert errors == []
        assert src.object._pins == 0 and all(o.object._pins == 0 for o in outs)
        assert all(o.object.version == 300 for o in outs) and m._scopes == {}
        m.check()


def test_a_closed_manager_and_mixed_managers_get_the_python_paths_errors():
    m, m2 = ca.Manager(fast="64KiB", slow="1MiB"), ca.Manager(fast="64KiB", slow="1MiB")
    x, y = ca.ones(4, manager=m), ca.ones(4, manager=m2)
    with pytest.raises(ValueError, match="different managers"):
        ca.compute("k", lambda a, b: None, (x,), (y,))
    m.close()
    with pytest.raises(ca.CachedArraysError, match="closed"):
        ca.compute("k", lambda a: None, (x,), ())
    m2.close()


# ---- frees -------------------------------------------------------------------------------------

def _free_state(m, arrays):
    stats = {name: {k: v for k, v in dev.stats().items()} for name, dev in m.devices.items()}
    order = list(m.policy.recent) if hasattr(m.policy, "recent") else None
    def region(r):
        return None if r is None else (r.device.name, r.offset, r.nbytes, r.freed, r._dirty)

    objs = [(a.object.id, a.object.freed, region(a.object.primary),
             {k: region(r) for k, r in a.object.regions.items()}, a.object.chain)
            for a in arrays]
    live = sorted(o.id for o in m.objects())
    counts = {k: v for k, v in m.stats().items() if not k.endswith("_seconds")}  # timings
    return stats, order, objs, live, counts


def _free_program(program, policy, fast_path, monkeypatch):
    if not fast_path:
        monkeypatch.setattr(manager_module, "_free_fast", lambda m, obj: False)
    try:
        with ca.Manager(fast="16KiB", slow="1MiB", policy=policy) as m:
            arrays, live = [], []
            for size, free in program:
                if free and live:
                    a = live.pop(size % len(live))
                    ca.unsafe_free(a)
                else:
                    a = ca.full(size, 1.5, manager=m)
                    arrays.append(a)
                    live.append(a)
                m.check()
            return _free_state(m, arrays)
    finally:
        monkeypatch.undo()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=st.lists(st.tuples(st.integers(0, 900), st.booleans()), min_size=1, max_size=30),
       policy=st.sampled_from(["lru", "fastonly", "firsttouch"]))
def test_frees_in_c_leave_the_heaps_and_records_the_python_path_leaves(program, policy,
                                                                        monkeypatch):
    if policy == "fastonly":
        program = [(min(size, 100), free) for size, free in program]   # fits in fast memory
    assert _free_program(program, policy, True, monkeypatch) == \
        _free_program(program, policy, False, monkeypatch)


def test_the_common_free_takes_the_c_path_and_the_rest_the_general_one(monkeypatch):
    released = []
    real = ca.Manager._release
    monkeypatch.setattr(ca.Manager, "_release",
                        lambda self, oid, *a: (released.append(oid), real(self, oid, *a))[1])
    with ca.Manager(fast="64KiB", slow="1MiB") as m:
        x, y, z = ca.ones(8, manager=m), ca.ones(8, manager=m), ca.ones(8, manager=m)
        ca.unsafe_free(x)
        assert released == [] and x.object.freed and x.object.regions == {}
        assert x.object.primary is None and m.policy.recent.get(x.object.id, 1)
        with pytest.raises(UseAfterFreeError):
            ca.unsafe_free(x)
        with ca.readable(y):
            with pytest.raises(ca.PinnedError):
                m.free_object(y.object)
        ca.evict(z)
        z.object.regions.clear()             # not one region on a heap: the general path
        z.object.regions["slow"] = z.object.primary
        with ca.trace(m):                    # an observer: the general path
            ca.unsafe_free(y)
        assert released == [y.object.id]
        m.check()


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.02])
def test_closing_the_manager_while_kernels_run_in_another_thread(delay):
    """Kernels, scopes and frees in C in one thread, a close in another: the close waits for
    the running kernel, nothing hangs or crashes, and the next call says the manager closed."""
    m = ca.Manager(fast="4MiB", slow="16MiB")
    x, y = ca.ones(1000, manager=m), ca.empty(1000, manager=m)

    def calls():
        ca.compute("add", lambda a, b: np.add(a, 1, out=b), (x,), (y,))
        with ca.kernel("copy", (y,), (x,)) as (a, b):
            b[...] = a
        ca.unsafe_free(ca.empty(100, manager=m))

    alive, errors = close_while_calling(m, calls, delay, ca.CachedArraysError)
    assert not alive
    assert len(errors) == 1 and "closed" in str(errors[0])
    assert x.object._pins == 0 and y.object._pins == 0


def test_freeing_an_operand_inside_its_kernel_is_refused_and_changes_nothing():
    with ca.Manager(fast="64KiB", slow="1MiB") as m:
        x, y = ca.ones(8, manager=m), ca.empty(8, manager=m)

        def fn(a, b):
            with pytest.raises(ca.PinnedError):
                ca.unsafe_free(x)
            b[...] = a

        ca.compute("k", fn, (x,), (y,))
        with ca.kernel("k2", (x,), (y,)) as (a, b):
            with pytest.raises(ca.PinnedError):
                ca.unsafe_free(y)
        assert not x.object.freed and not y.object.freed
        assert _read(y).tolist() == [1.0] * 8
        m.check()


def test_the_c_paths_keep_no_reference_on_success_or_error():
    """Reference counts of everything the C paths touch are unchanged after thousands of calls,
    failed ones (a raising kernel, a freed operand) included."""
    import gc
    import sys

    with ca.Manager(fast="4MiB", slow="4MiB") as m:
        x, y = ca.ones(100, manager=m), ca.empty(100, manager=m)
        dead = ca.ones(10, manager=m)
        ca.unsafe_free(dead)
        name, reads, writes = "counted kernel", (x,), (y,)

        def fn(a, b):
            np.add(a, 1, out=b)

        def bad(a, b):
            raise ValueError("bad")

        def work(k):
            for _ in range(k):
                ca.compute(name, fn, reads, writes)
                with ca.kernel(name, reads, writes):
                    pass
                with ca.access(list(reads), [y, None]):
                    pass
                with pytest.raises(ValueError):
                    ca.compute(name, bad, reads, writes)
                with pytest.raises(UseAfterFreeError):
                    ca.compute(name, fn, (dead,), writes)
                with pytest.raises(UseAfterFreeError):
                    with ca.kernel(name, (dead,), writes):
                        pass
                ca.unsafe_free(ca.empty(50, manager=m))

        def refs():
            gc.collect()
            return [sys.getrefcount(o) for o in (name, fn, bad, x, y, x.object, y.object, reads,
                                                 writes, m, dead, dead.object)]
        work(100)
        before = refs()
        work(2000)
        assert refs() == before
        assert x.object._pins == y.object._pins == 0 and m._scopes == {}
        m.check()
