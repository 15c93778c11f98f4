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
