"""The manager's per-array records (Region, Object): C types with the Python classes' fields,
constructors and finalizer."""

import gc
import weakref

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.manager import Object, Region


class _Dev:
    name = "dev"
    buffer = b"the mapping"


def test_region_fields_positional_and_keyword():
    dev = _Dev()
    r = Region(dev, 128, 64, 7)
    assert (r.device, r.offset, r.nbytes, r.owner) == (dev, 128, 64, 7)
    assert r.freed is False and r._dirty is False
    assert r._buffer is dev.buffer                 # the device's mapping by default
    own = bytearray(8)
    r2 = Region(device=dev, offset=0, nbytes=8, owner=1, buffer=own)
    assert r2._buffer is own
    empty = Region(dev, -1, 0, 3, own)
    assert empty._buffer is None                   # an empty region maps nothing
    r._dirty, r.freed, r._buffer = True, True, None
    assert (r._dirty, r.freed, r._buffer) == (True, True, None)
    assert weakref.ref(r)() is r


def test_object_fields_positional_and_keyword():
    ref = weakref.ref(_Dev())
    o = Object(ref, 5, 64)
    assert (o.id, o.nbytes, o.primary, o.regions) == (5, 64, None, {})
    assert (o._pins, o.freed, o.version, o.dropped, o.chain) == (0, False, 0, False, None)
    r = Region(_Dev(), 0, 64, 5)
    o2 = Object(manager_ref=ref, obj_id=6, nbytes=64, primary=r, device_name="dev")
    assert o2.primary is r and o2.regions == {"dev": r}
    o2._pins += 2
    o2.version += 1
    assert (o2._pins, o2.version) == (2, 1)
    assert weakref.ref(o2)() is o2


@pytest.mark.parametrize("make", [
    lambda: Region(_Dev(), 0, 8),                         # too few arguments
    lambda: Region(_Dev(), 0, 8, 1, None, "extra"),       # too many
    lambda: Object(None, 1),
    lambda: Object(None, 1, 8, nope=1),                   # unknown keyword
])
def test_records_refuse_bad_arguments(make):
    with pytest.raises(TypeError):
        make()


def test_records_have_no_other_attributes():
    r = Region(_Dev(), 0, 8, 1)
    o = Object(weakref.ref(_Dev()), 1, 8)      # a manager already gone
    for rec in (r, o):
        with pytest.raises(AttributeError):
            rec.not_a_field = 1
        with pytest.raises(AttributeError):
            rec.__dict__


def test_uninitialised_records_fail_cleanly():
    r = Region.__new__(Region)
    with pytest.raises(AttributeError):
        r.offset
    o = Object.__new__(Object)
    with pytest.raises(AttributeError):
        o.id
    del o                                          # the finalizer has nothing to queue
    gc.collect()


def test_finalizer_queues_a_dropped_object_and_the_manager_frees_it():
    with ca.Manager(fast=1 << 20, slow=1 << 20) as m:
        x = ca.zeros(1000, manager=m)
        obj_id, used = x._obj.id, m.fast.heap.stats().used
        assert m.object(obj_id) is not None
        del x
        assert m._deferred and m._deferred[-1][0] == obj_id
        m.drain()
        assert m.object(obj_id) is None and m.fast.heap.stats().used < used


def test_finalizer_of_an_object_in_a_cycle():
    with ca.Manager(fast=1 << 20, slow=1 << 20) as m:
        x = ca.zeros(1000, manager=m)
        obj = x._obj
        obj.chain = [obj]                          # a reference cycle through the record
        obj_id = obj.id
        del x, obj
        gc.collect()
        m.drain()
        assert m.object(obj_id) is None
        assert m.fast.heap.stats().used == 0


def test_finalizer_skips_freed_objects_and_closed_or_gone_managers():
    m = ca.Manager(fast=1 << 20, slow=1 << 20)
    x = ca.zeros(10, manager=m)
    ca.unsafe_free(x)
    n = len(m._deferred)
    del x
    assert len(m._deferred) == n                   # freed: nothing to queue
    y = ca.zeros(10, manager=m)
    m.close()
    del y                                          # closed: nothing to queue, no error
    assert not m._deferred
    o = Object(weakref.ref(m), 99, 8)
    del m
    gc.collect()
    del o                                          # the manager is gone: nothing to do


def test_finalizer_errors_are_reported_not_raised():
    class Broken:
        closed = False

        @property
        def _deferred(self):
            raise RuntimeError("no queue")
    keep = Broken()
    seen = []
    hook = pytest.MonkeyPatch()
    hook.setattr("sys.unraisablehook", lambda u: seen.append(u.exc_value))
    try:
        o = Object(weakref.ref(keep), 1, 8)
        del o
    finally:
        hook.undo()
    assert len(seen) == 1 and "no queue" in str(seen[0])


def test_finalizer_keeps_a_pending_exception():
    with ca.Manager(fast=1 << 20, slow=1 << 20) as m:
        def drop_during_exception():
            x = ca.zeros(10, manager=m)
            try:
                raise KeyError("pending")
            except KeyError:
                del x                              # the finalizer runs with an exception set
                raise
        with pytest.raises(KeyError, match="pending"):
            drop_during_exception()
        m.drain()
        assert m.fast.heap.stats().used == 0


def test_records_in_use_by_arrays_end_to_end():
    with ca.Manager(fast=1 << 20, slow=1 << 20) as m:
        a = ca.asarray(np.arange(100.0), manager=m)
        b = a * 2 + 1
        assert isinstance(b._obj, Object) and isinstance(b._obj.primary, Region)
        assert b._obj.primary.owner == b._obj.id
        np.testing.assert_array_equal(np.asarray(b), np.arange(100.0) * 2 + 1)
        assert "Object" in repr(b._obj) and "Region" in repr(b._obj.primary)


def test_hot_path_constructors_match_the_classes():
    from cachedarrays import _records
    dev, ref = _Dev(), weakref.ref(_Dev())
    a, b = _records.region(Region, dev, 64, 8, 3, None), Region(dev, 64, 8, 3)
    assert type(a) is Region
    assert [getattr(a, f) for f in ("device", "offset", "nbytes", "owner", "_dirty", "freed",
                                    "_buffer")] == \
        [getattr(b, f) for f in ("device", "offset", "nbytes", "owner", "_dirty", "freed",
                                 "_buffer")]
    o = _records.object(Object, ref, 4, 8, a, "dev")
    assert type(o) is Object and o.regions == {"dev": a} and o.primary is a
    assert _records.object(Object, ref, 5, 8, None, None).regions == {}
    with pytest.raises(TypeError, match="subclass"):
        _records.region(dict, dev, 0, 8, 1, None)
    with pytest.raises(TypeError, match="subclass"):
        _records.object(Region, ref, 1, 8, None, None)
    with pytest.raises(TypeError, match="6 arguments"):
        _records.region(Region, dev, 0, 8)


# ---- the manager's commonest steps in C: create_fast and drain ------------------------------

def _snapshot(m):
    tel = m.telemetry
    return dict(allocs=dict(tel.allocs), frees=dict(tel.frees), current=dict(tel.current),
                peak=dict(tel.peak), objects=len(m._objects),
                blocks={k: len(v) for k, v in m._by_offset.items()},
                used=m.fast.heap.stats().used)


def test_a_ufunc_result_is_made_and_freed_with_every_record_kept():
    with ca.Manager(fast=1 << 20, slow=1 << 20) as m:
        x = ca.asarray(np.arange(10.0), manager=m)
        before = _snapshot(m)
        y = x + 1                                  # made by create_fast
        obj = y._obj
        assert obj.primary._dirty is True and obj.primary.device is m.fast
        assert m._by_offset["fast"][obj.primary.offset] is obj.primary
        assert m.object(obj.id) is obj and m.last_id() == obj.id
        mid = _snapshot(m)
        assert mid["allocs"]["fast"] == before["allocs"]["fast"] + 1
        assert mid["current"]["fast"] == before["current"]["fast"] + obj.nbytes
        assert mid["peak"]["fast"] >= mid["current"]["fast"]
        region = obj.primary
        del y, obj
        m.drain()                                  # freed by drain's common path
        after = _snapshot(m)
        assert region.freed is True and region._buffer is None
        assert after["frees"]["fast"] == before["frees"]["fast"] + 1
        assert after["current"] == before["current"] and after["objects"] == before["objects"]
        assert after["blocks"] == before["blocks"] and after["used"] == before["used"]
        m.check()


def test_create_fast_and_drain_write_the_event_log(tmp_path):
    log = tmp_path / "events.jsonl"
    with ca.Manager(fast=1 << 20, slow=1 << 20, event_log=str(log)) as m:
        x = ca.asarray(np.arange(10.0), manager=m)
        y = x * 2
        oid = y._obj.id
        del y
        m.drain()
    import json
    events = [json.loads(line) for line in log.read_text().splitlines()]
    mine = [e["event"] for e in events if e.get("id") == oid]
    assert mine == ["alloc", "free"]


def _workload(m):
    x = ca.asarray(np.arange(1000.0), manager=m)
    for k in range(20):
        y = x * k + 1                              # C paths: create_fast, drain
        z = ca.empty((k + 1, 7), manager=m)
        del y, z
    w = ca.zeros(50, manager=m, placement="slow")  # the Python paths
    ca.evict(x)
    del w
    m.drain()
    return _snapshot(m)


def test_allocation_counters_are_the_same_from_c_and_from_python(tmp_path):
    """With an event log open every count goes through Telemetry.on_alloc / on_free in
    Python; without one the C paths count on the record's integers: the same figures."""
    with ca.Manager(fast=1 << 20, slow=1 << 20) as m:
        c_side = _workload(m)
    with ca.Manager(fast=1 << 20, slow=1 << 20, event_log=str(tmp_path / "log")) as m:
        py_side = _workload(m)
    for key in ("allocs", "frees", "current", "peak"):
        assert c_side[key] == py_side[key], key
    assert c_side["allocs"]["fast"] >= 40 and c_side["peak"]["fast"] > 0


def test_telemetry_counters_reset_keep_current_and_refuse_too_many_devices():
    from cachedarrays.telemetry import MAX_DEVICES, Telemetry
    with ca.Manager(fast=1 << 20, slow=1 << 20) as m:
        x = ca.ones(100, manager=m)
        tel = m.telemetry
        used = tel.current["fast"]
        tel.reset()
        assert tel.allocs == {"fast": 0, "slow": 0} and tel.frees == {"fast": 0, "slow": 0}
        assert tel.current["fast"] == used == tel.peak["fast"] > 0
        view = memoryview(tel)                      # the counters, holding the record alive
        del x
    del tel, m
    assert view.nbytes == 4 * MAX_DEVICES * 8 and not view.readonly
    with pytest.raises(ValueError, match="at most"):
        Telemetry([f"d{i}" for i in range(MAX_DEVICES + 1)])
    with pytest.raises(ValueError, match="distinct"):
        Telemetry(["fast", "fast"])


def test_drain_sends_entries_off_the_common_path_to_release():
    with ca.Manager(fast=1 << 20, slow=1 << 20) as m:
        x = ca.asarray(np.arange(1000.0), manager=m)
        ca.evict(x, wait=True)                     # a linked copy: two regions
        ca.prefetch(x, wait=True)
        y = x + 1
        assert len(x._obj.regions) >= 1
        calls = []
        real = m._release
        m._release = lambda *a: (calls.append(a[0]), real(*a))[1]
        try:
            ids = [x._obj.id, y._obj.id]
            del x, y
            m.drain()
        finally:
            del m._release
        assert all(m.object(i) is None for i in ids)
        m.check()
        assert m.fast.heap.stats().used == 0


def test_drain_refuses_a_malformed_entry_and_keeps_the_rest():
    with ca.Manager(fast=1 << 20, slow=1 << 20) as m:
        x = ca.asarray(np.arange(10.0), manager=m)
        m._deferred.append("not an entry")
        with pytest.raises(TypeError, match="queued free"):
            m.drain()
        y = x + 1
        oid = y._obj.id
        del y
        m.drain()
        assert m.object(oid) is None


def test_drain_reports_a_block_the_heap_refuses():
    with ca.Manager(fast=1 << 20, slow=1 << 20) as m:
        x = ca.asarray(np.arange(10.0), manager=m)
        y = x + 1
        obj = y._obj
        # a stale entry for a block owned by another object: the heap refuses, and says why
        m._deferred.append((obj.id + 1000, {"fast": obj.primary}, obj.primary))
        with pytest.raises(ca.CachedArraysError):
            m.drain()
        assert obj.primary.freed is False          # the real owner's block is untouched
        np.testing.assert_array_equal(np.asarray(y), np.arange(10.0) + 1)


def test_bind_and_create_fast_refuse_bad_arguments():
    from cachedarrays import _records
    with pytest.raises(TypeError):
        _records.bind(0, 0, dict, dict)
    with pytest.raises(TypeError):
        _records.create_fast()
    with pytest.raises(TypeError):
        _records.drain()


@pytest.mark.parametrize("nbytes", [1, 100, np.int64(100), 0])
def test_create_in_fast_memory_leaves_the_region_clean(nbytes):
    with ca.Manager(fast=1 << 20, slow=1 << 20) as m:
        before = _snapshot(m)
        obj = m.create(m.fast, nbytes)             # ints > 0 take the C steps, others Python's
        r = obj.primary
        assert r._dirty is False and r.freed is False and r.device is m.fast
        assert obj.regions == {"fast": r} and m.object(obj.id) is obj
        assert m.telemetry.allocs["fast"] == before["allocs"]["fast"] + 1
        assert m.telemetry.current["fast"] == before["current"]["fast"] + int(nbytes)
        if nbytes:
            assert m._by_offset["fast"][r.offset] is r
        m.free_object(obj)
        assert _snapshot(m)["current"] == before["current"]
        m.check()


def test_create_returns_none_when_fast_memory_is_full():
    with ca.Manager(fast=1 << 16, slow=1 << 20) as m:
        assert m.create(m.fast, 1 << 20) is None
        obj = m.create(m.fast, 1 << 10)
        assert obj is not None and obj.primary.device is m.fast


def test_records_in_reference_cycles_are_collected():
    r = Region(_Dev(), 0, 8, 1)
    r.owner = r                                    # a cycle through the last field but one
    o = Object(weakref.ref(_Dev()), 1, 8)
    o.chain = [o, r]                               # and through the Object's last field
    refs = (weakref.ref(r), weakref.ref(o))
    del r, o
    gc.collect()
    assert all(ref() is None for ref in refs)
