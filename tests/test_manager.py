"""The data manager (Table 4.4): regions, linking, copies, dirty bits, evictfrom, pinning."""

import gc
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize,
                                 invariant, precondition, rule)

import cachedarrays as ca
from cachedarrays.errors import (CachedArraysError, OutOfMemoryError, PinnedError,
                                 UseAfterFreeError)
from cachedarrays.telemetry import read_event_log
from helpers import run_threads


@pytest.fixture
def m():
    with ca.Manager(fast="64KiB", slow="1MiB", granularity=256) as mgr:
        yield mgr


def fill(m, region, value):
    a = m.ndarray(region, np.uint8, (region.nbytes,))
    a[:] = value


def content(m, region):
    return m.ndarray(region, np.uint8, (region.nbytes,)).copy()


def test_objects_get_unique_increasing_ids(m):
    ids = [m.new_object(10).id for _ in range(5)]
    assert ids == sorted(ids) and len(set(ids)) == 5


def test_allocate_copy_link_and_set_primary(m):
    obj = m.new_object(1000)
    x = m.allocate("fast", 1000, obj)
    m.set_primary(obj, x)
    fill(m, x, 7)
    y = m.allocate("slow", 1000, obj)
    m.copyto(y, x)
    m.link(x, y)
    assert m.getlinked(x, "slow") is y and m.getlinked(y, "fast") is x
    assert m.primary(obj) is x and m.parent(y) is obj
    assert m.on_device(x, "fast") and m.on_device(y, "slow") and m.sizeof(y) == 1000
    assert (content(m, y) == 7).all()
    m.set_primary(obj, y)
    m.unlink(x, y)
    m.free(x)
    assert m.primary(obj) is y and m.getlinked(y, "fast") is None
    s = m.stats()
    assert s["moved"]["fast->slow"] == {"bytes": 1000, "copies": 1}
    m.check()


def test_dirty_bits(m):
    obj = m.new_object(64)
    r = m.allocate("fast", 64, obj)
    assert not m.isdirty(r)
    m.markdirty(r)
    assert m.isdirty(r)
    m.markclean(r)
    assert not m.isdirty(r)


def test_zero_byte_regions_are_legal_and_take_no_heap(m):
    obj = m.new_object(0)
    before = m.fast.stats()["used"]
    r = m.allocate("fast", 0, obj)
    m.set_primary(obj, r)
    assert m.fast.stats()["used"] == before
    assert m.ndarray(r, np.float64, (0, 3)).shape == (0, 3)
    m.free(r)
    m.check()


def test_negative_sizes_are_refused(m):
    with pytest.raises(ValueError, match="negative"):
        m.new_object(-1)
    obj = m.new_object(1)
    with pytest.raises(ValueError, match="negative"):
        m.allocate("fast", -5, obj)


def test_request_larger_than_device_names_device_request_and_free_bytes(m):
    obj = m.new_object(1 << 20)
    with pytest.raises(OutOfMemoryError) as e:
        m.allocate("fast", 1 << 20, obj)
    msg = str(e.value)
    assert "fast" in msg and ("1048576" in msg.replace(",", "") or "1.0 MiB" in msg)
    m.check()


def test_exhaustion_keeps_heap_consistent(m):
    obj = m.new_object(1)
    regions = []
    while True:
        try:
            regions.append(m.allocate("fast", 4000, obj))
        except OutOfMemoryError as e:
            assert "free" in str(e)
            break
    m.check()
    for r in regions:
        m.free(r)
    m.check()
    assert m.fast.stats()["nallocated"] == 0


def test_double_free_and_freed_region_use_raise(m):
    obj = m.new_object(100)
    r = m.allocate("fast", 100, obj)
    m.free(r)
    with pytest.raises(UseAfterFreeError, match="double free"):
        m.free(r)
    other = m.allocate("slow", 100, obj)
    with pytest.raises(UseAfterFreeError):
        m.copyto(other, r)
    with pytest.raises(UseAfterFreeError):
        m.ndarray(r, np.uint8, (100,))
    m.check()


def test_unknown_device_lists_devices(m):
    obj = m.new_object(1)
    with pytest.raises(ValueError, match="fast, slow"):
        m.allocate("gpu", 1, obj)


def test_freed_object_use_raises(m):
    obj = m.new_object(10)
    m.set_primary(obj, m.allocate("fast", 10, obj))
    m.free_object(obj)
    with pytest.raises(UseAfterFreeError):
        m.primary(obj)
    with pytest.raises(UseAfterFreeError):
        m.free_object(obj)


def test_pinned_object_is_skipped_by_evictfrom_and_defrag(m):
    objs, regions = [], []
    for i in range(8):
        o = m.new_object(4000)
        r = m.allocate("fast", 4000, o)
        m.set_primary(o, r)
        fill(m, r, i + 1)
        objs.append(o)
        regions.append(r)
    m.pin(objs[1])
    visited = []

    def evict(region):
        visited.append(region.owner)
        o = m.parent(region)
        s = m.allocate("slow", region.nbytes, o)
        m.copyto(s, region)
        m.set_primary(o, s)
        m.free(region)
        return True

    assert m.evictfrom("fast", regions[0], 10000, evict)
    assert objs[1].id not in visited
    assert m.primary(objs[1]) is regions[1] and not regions[1].freed
    for i, o in enumerate(objs):
        assert (content(m, m.primary(o)) == i + 1).all()
    # free a hole before the pinned block and defrag: the pinned block stays put
    offset = regions[1].offset
    moved = m.defrag("fast")
    assert regions[1].offset == offset
    assert moved == 3                         # the three blocks after the pinned one slid down
    for i, o in enumerate(objs):
        assert (content(m, m.primary(o)) == i + 1).all()
    m.unpin(objs[1])
    m.check()


def test_pin_is_reentrant_and_protects_free(m):
    o = m.new_object(10)
    m.set_primary(o, m.allocate("fast", 10, o))
    m.pin(o)
    m.pin(o)
    m.unpin(o)
    with pytest.raises(PinnedError):
        m.free_object(o)
    m.unpin(o)
    with pytest.raises(CachedArraysError, match="not pinned"):
        m.unpin(o)
    m.free_object(o)


def test_finalizers_only_queue_and_next_call_drains(m):
    o = m.new_object(5000)
    m.set_primary(o, m.allocate("fast", 5000, o))
    used = m.fast.stats()["used"]
    del o
    gc.collect()
    assert m.fast.stats()["used"] == used      # queued, not freed yet
    assert len(m._deferred) == 1
    m.new_object(1)                            # any manager call drains
    assert m.fast.stats()["used"] < used
    m.check()


def test_defrag_gathers_free_space_and_keeps_data(m):
    objs = []
    for i in range(10):
        o = m.new_object(3000)
        r = m.allocate("fast", 3000, o)
        m.set_primary(o, r)
        fill(m, r, i)
        objs.append(o)
    for o in objs[::2]:
        m.free_object(o)
    largest_before = m.fast.stats()["largest_free"]
    m.defrag("fast")
    assert m.fast.stats()["largest_free"] > largest_before
    for i, o in list(enumerate(objs))[1::2]:
        assert (content(m, m.primary(o)) == i).all()
    m.check()


def test_close_is_idempotent_and_closed_manager_refuses(tmp_path):
    mgr = ca.Manager(fast="64KiB", slow="64KiB")
    mgr.close()
    mgr.close()
    with pytest.raises(CachedArraysError, match="closed"):
        mgr.new_object(1)


def test_event_log_records_allocations_and_copies(tmp_path):
    log = tmp_path / "events.jsonl"
    with ca.Manager(fast="64KiB", slow="64KiB", event_log=str(log)) as mgr:
        o = mgr.new_object(100)
        x = mgr.allocate("fast", 100, o)
        mgr.set_primary(o, x)
        y = mgr.allocate("slow", 100, o)
        mgr.copyto(y, x)
    events = read_event_log(log)
    kinds = [e["event"] for e in events]
    assert kinds[:3] == ["alloc", "alloc", "copy"]
    assert all("t" in e for e in events)
    assert events[0]["device"] == "fast" and events[0]["used"] == 100
    json.dumps(events)


def test_stats_track_current_and_peak(m):
    o = m.new_object(1000)
    a = m.allocate("fast", 1000, o)
    b = m.allocate("fast", 2000, o)
    m.free(a)
    s = m.stats()["devices"]["fast"]
    assert s["current_bytes"] == 2000 and s["peak_bytes"] == 3000
    assert s["allocs"] == 2 and s["frees"] == 1
    m.free(b)


def test_threads_share_a_manager_safely(m):
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                o = m.new_object(int(rng.integers(1, 2000)))
                dev = "fast" if rng.random() < 0.5 else "slow"
                r = m.try_allocate(dev, o.nbytes, o)
                if r is None:
                    continue
                m.set_primary(o, r)
                fill(m, r, seed)
                assert (content(m, r) == seed).all()
                m.free_object(o)
        except Exception as e:     # pragma: no cover - reported below
            errors.append(e)

    run_threads(work)
    assert not errors
    m.check()


# ---- a state machine: the manager against a model ------------------------------------------

class ManagerMachine(RuleBasedStateMachine):
    """Random allocate/write/copy/link/set_primary/dirty/evictfrom/pin/free sequences."""

    objects = Bundle("objects")

    @initialize()
    def setup(self):
        self.m = ca.Manager(fast="32KiB", slow="256KiB", granularity=256)
        self.model = {}       # obj id -> expected bytes of the primary
        self.objs = {}
        self.counter = 0

    def teardown(self):
        for o in self.objs.values():          # close() refuses while this thread pins objects
            while self.m.pinned(o):
                self.m.unpin(o)
        self.m.close()

    @rule(target=objects, size=st.integers(0, 6000), fast=st.booleans())
    def allocate(self, size, fast):
        m = self.m
        o = m.new_object(size)
        r = m.try_allocate("fast" if fast else "slow", size, o)
        if r is None:
            r = m.try_allocate("slow", size, o)
        if r is None:
            return None
        m.set_primary(o, r)
        self.counter += 1
        data = np.full(size, self.counter % 251, np.uint8)
        if size:
            m.ndarray(r, np.uint8, (size,))[:] = data
        self.model[o.id] = data
        self.objs[o.id] = o
        return o.id

    def _obj(self, oid):
        return self.objs.get(oid) if oid is not None else None

    @rule(oid=objects, value=st.integers(0, 255))
    def write(self, oid, value):
        o = self._obj(oid)
        if o is None or o.nbytes == 0:
            return
        r = self.m.primary(o)
        self.m.ndarray(r, np.uint8, (o.nbytes,))[:] = value
        self.m.markdirty(r)
        self.model[oid][:] = value

    @rule(oid=objects)
    def move(self, oid):
        """Copy to the other device, link, make it primary, drop the old copy."""
        o = self._obj(oid)
        if o is None:
            return
        m = self.m
        x = m.primary(o)
        other = "slow" if x.device.name == "fast" else "fast"
        y = m.getlinked(x, other)
        if y is None:
            y = m.try_allocate(other, o.nbytes, o)
            if y is None:
                return
            m.copyto(y, x)
            m.link(x, y)
        elif m.isdirty(x):
            m.copyto(y, x)
        m.set_primary(o, y)
        m.markclean(y)

    @rule(oid=objects)
    def drop_linked(self, oid):
        o = self._obj(oid)
        if o is None:
            return
        x = self.m.primary(o)
        for dev in ("fast", "slow"):
            y = self.m.getlinked(x, dev)
            if y is not None:
                self.m.unlink(x, y)
                self.m.free(y)

    @rule(oid=objects)
    def pin(self, oid):
        o = self._obj(oid)
        if o is not None and self.m.pin_count(o) < 2:
            self.m.pin(o)

    @rule(oid=objects)
    def unpin(self, oid):
        o = self._obj(oid)
        if o is not None and self.m.pinned(o):
            self.m.unpin(o)

    @rule(oid=consumes(objects))
    def free(self, oid):
        o = self._obj(oid)
        if o is None or self.m.pinned(o):
            return
        self.m.free_object(o)
        del self.objs[oid]
        del self.model[oid]

    @rule(nbytes=st.integers(1, 20000), start=st.integers(0, 50))
    def evictfrom(self, nbytes, start):
        m = self.m
        regions = m.regions_on("fast")
        region = regions[start % len(regions)] if regions else None

        def cb(region):
            o = m.parent(region)
            assert m.pin_count(o) == 0
            if m.primary(o) is not region:
                m.unlink(m.primary(o), region)
                m.free(region)
                return True
            y = m.getlinked(region, "slow")
            if y is None:
                y = m.try_allocate("slow", region.nbytes, o)
                if y is None:
                    return False
                m.copyto(y, region)
                m.link(region, y)
            elif m.isdirty(region):
                m.copyto(y, region)
            m.set_primary(o, y)
            m.unlink(region, y)
            m.free(region)
            return True

        m.evictfrom("fast", region, nbytes, cb)

    @precondition(lambda self: True)
    @rule()
    def defrag(self):
        self.m.defrag("fast")

    @invariant()
    def data_and_heaps_agree(self):
        if not hasattr(self, "m"):
            return
        self.m.check()
        for oid, data in self.model.items():
            o = self.objs[oid]
            r = self.m.primary(o)
            got = self.m.ndarray(r, np.uint8, (o.nbytes,)) if o.nbytes else np.zeros(0, np.uint8)
            assert np.array_equal(got, data), f"object {oid} changed without a write"
            for dev, reg in o.regions.items():
                assert reg.device.name == dev and not reg.freed


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
