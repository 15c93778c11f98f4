"""A manager refuses objects and regions of another manager at every entry point.

Object ids, heap offsets and pins mean nothing outside their own manager: acquiring, pinning,
releasing, freeing, copying or linking another manager's object or region would report it to
the wrong policy, unpin the wrong array or free a block of the other heap. Each such call raises
CachedArraysError naming the object (or region) and the fix, and changes nothing in either
manager.
"""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.errors import CachedArraysError


def _region(obj):
    return obj.primary


# name -> f(m2, o, r, own): o, r: an object and its primary region of the first manager; own:
# an object of m2 (with the same id as o, so an id lookup would find it)
_OBJECT_CALLS = {
    "acquire reads": lambda m2, o, r, own: m2.acquire((o,), ()),
    "acquire writes": lambda m2, o, r, own: m2.acquire((), (o,)),
    "acquire mixed": lambda m2, o, r, own: m2.acquire((own,), (o,)),
    "release": lambda m2, o, r, own: m2.release((o,)),
    "run": lambda m2, o, r, own: m2.run(lambda new: None, (o,), ()),
    "run writes": lambda m2, o, r, own: m2.run(lambda new: None, (), (o,), 8),
    "unpin": lambda m2, o, r, own: m2.unpin(o),
    "unpin detached": lambda m2, o, r, own: m2.unpin(o, detached=True),
    "fault": lambda m2, o, r, own: m2.fault(o),
    "why_not_regenerable": lambda m2, o, r, own: m2.why_not_regenerable(o),
    "free region": lambda m2, o, r, own: m2.free(r),
    "copyto into": lambda m2, o, r, own: m2.copyto(r, own.primary),
    "copyto from": lambda m2, o, r, own: m2.copyto(own.primary, r),
    "parent": lambda m2, o, r, own: m2.parent(r),
    "getlinked": lambda m2, o, r, own: m2.getlinked(r, "slow"),
    "set_primary": lambda m2, o, r, own: m2.set_primary(own, r),
    "link": lambda m2, o, r, own: m2.link(own.primary, r),
    "unlink": lambda m2, o, r, own: m2.unlink(r, own.primary),
    "markdirty": lambda m2, o, r, own: m2.markdirty(r),
    "markclean": lambda m2, o, r, own: m2.markclean(r),
    "isdirty": lambda m2, o, r, own: m2.isdirty(r),
    "sizeof": lambda m2, o, r, own: m2.sizeof(r),
    "on_device": lambda m2, o, r, own: m2.on_device(r, "fast"),
    "ndarray": lambda m2, o, r, own: m2.ndarray(r, np.float64, (8,)),
    "ndarray readonly": lambda m2, o, r, own: m2.ndarray(r, np.float64, (8,), readonly=True),
}


@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "in-a-scope"])
@pytest.mark.parametrize("call", sorted(_OBJECT_CALLS))
def test_another_managers_object_or_region_is_refused_and_both_stay_intact(call, pinned):
    with ca.Manager(fast="1MiB", slow="8MiB") as m1, ca.Manager(fast="1MiB", slow="8MiB") as m2:
        a = ca.asarray(np.arange(8.0), manager=m1)
        b = ca.asarray(np.arange(8.0) * 2, manager=m2)
        o, own = a.object, b.object
        assert o.id == own.id                    # ids are per manager: a lookup would find b
        scope = ca.readable(a) if pinned else None
        if scope is not None:
            scope.__enter__()
        pins, pins2 = o._pins, own._pins
        with pytest.raises(CachedArraysError, match="another manager"):
            _OBJECT_CALLS[call](m2, o, _region(o), own)
        assert (o._pins, own._pins) == (pins, pins2)
        if scope is not None:
            scope.__exit__(None, None, None)
        m1.check()
        m2.check()
        np.testing.assert_array_equal(np.asarray(a), np.arange(8.0))
        np.testing.assert_array_equal(np.asarray(b), np.arange(8.0) * 2)


@pytest.mark.parametrize("call", ["markdirty", "markclean", "isdirty", "sizeof", "on_device",
                                  "ndarray"])
def test_region_calls_refuse_another_managers_region_and_keep_both_dirty_bits(call):
    with ca.Manager(fast="1MiB", slow="8MiB") as m1, ca.Manager(fast="1MiB", slow="8MiB") as m2:
        a = ca.asarray(np.arange(8.0), manager=m1)
        b = ca.asarray(np.arange(8.0), manager=m2)
        r, own = a.object.primary, b.object.primary
        m1.markdirty(r)
        m2.markclean(own)
        with pytest.raises(CachedArraysError, match="another manager"):
            _OBJECT_CALLS[call](m2, a.object, r, b.object)
        assert (m1.isdirty(r), m2.isdirty(own)) == (True, False)


class _CleaningPolicy(ca.policies.LRU):
    """Marks a region of another manager clean at every write."""

    other = None

    def write_use(self, obj):
        if self.other is not None:
            self.manager.markclean(self.other)
        super().write_use(obj)


def test_a_policy_marking_another_managers_region_clean_gets_a_clear_error():
    with ca.Manager(fast="1MiB", slow="8MiB") as m1, \
            ca.Manager(fast="1MiB", slow="8MiB", policy=_CleaningPolicy) as m2:
        a = ca.asarray(np.arange(8.0), manager=m1)
        m1.markdirty(a.object.primary)
        b = ca.zeros(8, manager=m2)
        m2.policy.other = a.object.primary
        with pytest.raises(CachedArraysError, match="another manager"):
            b[:] = 1.0
        assert m1.isdirty(a.object.primary)
        m1.check()
        m2.check()


@pytest.mark.parametrize("region", [None, 0, "fast", np.zeros(2)], ids=repr)
@pytest.mark.parametrize("call", ["markdirty", "markclean", "isdirty", "sizeof", "on_device",
                                  "ndarray"])
def test_region_calls_name_a_non_region_argument(call, region):
    with ca.Manager(fast="1MiB", slow="8MiB") as m:
        with pytest.raises(TypeError, match="expected a Region"):
            _OBJECT_CALLS[call](m, None, region, None)
