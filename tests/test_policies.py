"""Policies: LRU order, the soft-evicted tier, exact clean/dirty traffic, modes, baselines."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.errors import OutOfMemoryError
from cachedarrays.policies import LRU, Policy

KB = 1024


def manager(policy="lru", fast=64 * KB, slow="4MiB", **options):
    return ca.Manager(fast=fast, slow=slow, policy=policy, granularity=256,
                      policy_options=options or None)


def arrays(m, n, nbytes=10 * KB):
    return [ca.full(nbytes // 8, float(i), manager=m) for i in range(n)]


def moved(m, key):
    return m.stats()["moved"].get(key, {"bytes": 0})["bytes"]


def test_unknown_policy_lists_known_ones():
    with pytest.raises(ValueError, match="firsttouch.*lru"):
        ca.Manager(fast="64KiB", slow="64KiB", policy="nope")


def test_policy_by_object_class_or_name():
    with ca.Manager(fast="64KiB", slow="1MiB", policy=LRU(local_alloc=False)) as m:
        assert isinstance(m.policy, LRU) and not m.policy.local_alloc
    with ca.Manager(fast="64KiB", slow="1MiB", policy=ca.policies.FirstTouch) as m:
        assert isinstance(m.policy, ca.policies.FirstTouch)


def test_lru_evicts_least_recently_used_first():
    with manager() as m:
        xs = arrays(m, 6)                  # 61.5 KiB of 64 KiB
        float(xs[0].sum())                 # use 0: now 1 is the least recent
        new = ca.zeros(KB, manager=m)      # 8 KiB: one 10 KiB victim is enough
        assert new.device == "fast"
        assert xs[1].device == "slow"
        assert all(x.device == "fast" for i, x in enumerate(xs) if i != 1)
        assert xs[1].sum() == 10 * KB // 8 * 1.0


def test_every_use_updates_order_not_insertion():
    with manager() as m:
        xs = arrays(m, 6)
        for x in (xs[0], xs[1], xs[2]):
            x += 0                        # writes count as uses
        keep = ca.zeros(KB, manager=m)
        assert xs[3].device == "slow"
        soft, recent = m.policy.tiers()
        assert recent == [xs[4].object.id, xs[5].object.id, xs[0].object.id,
                          xs[1].object.id, xs[2].object.id, keep.object.id]


def test_soft_evicted_tier_goes_first():
    with manager() as m:
        xs = arrays(m, 6)
        ca.softevict(xs[3])
        keep = ca.zeros(KB, manager=m)
        assert xs[3].device == "slow" and keep.device == "fast"
        assert xs[0].device == "fast"
        soft, recent = m.policy.tiers()
        assert soft == []


def test_use_brings_soft_evicted_back_to_regular():
    with manager() as m:
        xs = arrays(m, 5)
        ca.softevict(xs[3])
        float(xs[3][0])
        soft, recent = m.policy.tiers()
        assert soft == [] and recent[-1] == xs[3].object.id


def test_dirty_eviction_copies_and_clean_eviction_is_elided_exactly():
    with manager() as m:
        x = ca.full(1000, 1.0, manager=m)      # 8000 bytes, only in fast memory
        ca.evict(x)
        assert moved(m, "fast->slow") == 8000
        ca.prefetch(x)
        assert moved(m, "slow->fast") == 8000
        ca.evict(x)                            # clean: the slow copy is still valid
        assert moved(m, "fast->slow") == 8000
        ev = m.stats()["events"]["writebacks_elided"]
        assert ev == {"count": 1, "bytes": 8000}
        ca.prefetch(x)
        x[0] = 5.0                             # dirty again
        ca.evict(x)
        assert moved(m, "fast->slow") == 16000
        assert float(x[0]) == 5.0 and float(x[1]) == 1.0


def test_writable_scope_marks_dirty_so_writes_are_never_lost():
    with manager() as m:
        x = ca.zeros(100, manager=m)
        ca.evict(x)
        ca.prefetch(x)
        with ca.writable(x) as a:
            a[:] = 7
        ca.evict(x)
        np.testing.assert_array_equal(np.asarray(x), np.full(100, 7.0))


def test_prefetch_keeps_the_slow_copy_linked():
    with manager() as m:
        x = ca.ones(100, manager=m)
        ca.evict(x)
        slow_region = x.object.primary
        ca.prefetch(x)
        assert x.device == "fast"
        assert m.getlinked(x.object.primary, "slow") is slow_region


def test_forced_prefetch_makes_room_and_unforced_does_not():
    with manager() as m:
        xs = arrays(m, 6)                       # fills fast memory
        y = ca.ones(2 * KB, manager=m)
        ca.evict(y)
        ca.prefetch(y)                          # not forced: no room, stays slow
        if y.device == "slow":
            assert m.stats()["events"]["prefetch_refused"]["count"] >= 1
        ca.evict(y)
        ca.prefetch(y, force=True)
        assert y.device == "fast"
        assert sum(x.device == "slow" for x in xs) >= 1


def test_too_large_object_stays_slow_and_the_refusal_is_counted():
    with manager() as m:
        big = ca.zeros(128 * KB // 8, manager=m)   # larger than fast memory
        assert big.device == "slow"
        ca.prefetch(big, force=True)
        assert big.device == "slow"
        assert m.stats()["events"]["prefetch_refused"]["count"] == 1


def test_pinned_arrays_are_never_evicted_to_make_room():
    with manager() as m:
        xs = arrays(m, 6)
        with ca.readable(xs[0]), ca.readable(xs[1]):
            for _ in range(4):
                ca.zeros(2 * KB, manager=m)
            assert xs[0].device == "fast" and xs[1].device == "fast"


def test_oversubscribed_values_stay_correct():
    with manager() as m:
        rng = np.random.default_rng(1)
        ref = [rng.random(1000) for _ in range(40)]    # 40 x 8 KB = 5x fast memory
        xs = [ca.asarray(r, manager=m) for r in ref]
        for _ in range(200):
            i, j = rng.integers(0, 40, 2)
            xs[i] += xs[j]
            ref[i] += ref[j]
        for x, r in zip(xs, ref):
            np.testing.assert_allclose(np.asarray(x), r)
        m.check()
        assert moved(m, "fast->slow") > 0


@pytest.mark.parametrize("mode,local,cleanup,prefetch", [
    ("CA:0", False, False, False), ("L", True, False, False), ("LM", True, True, False),
    ("CA:LMP", True, True, True), ("CA:∅", False, False, False)])
def test_modes_are_configs(mode, local, cleanup, prefetch):
    p = LRU(mode=mode)
    assert (p.local_alloc, p.allows_cleanup, p.allows_prefetch) == (local, cleanup, prefetch)


def test_mode_without_local_allocation_keeps_a_slow_twin():
    with manager(mode="CA:0") as m:
        x = ca.ones(100, manager=m)
        assert x.device == "fast"
        assert m.getlinked(x.object.primary, "slow") is not None
        assert moved(m, "slow->fast") == 800


def test_prefetch_switch_off_does_not_move():
    with manager(prefetch=False) as m:
        x = ca.ones(100, manager=m)
        ca.evict(x)
        ca.prefetch(x, force=True)
        assert x.device == "slow"


def test_cleanup_switch_off_keeps_arrays():
    with manager(cleanup=False) as m:
        x = ca.ones(10, manager=m)
        assert ca.cleanup([x]) == 0
        assert not x.is_freed


def test_unknown_mode():
    with pytest.raises(ValueError, match="CA:LM"):
        LRU(mode="XYZ")


def test_firsttouch_never_moves():
    with manager("firsttouch") as m:
        xs = arrays(m, 8)
        devices = [x.device for x in xs]
        assert devices[:6] == ["fast"] * 6 and devices[-1] == "slow"
        ca.evict(xs[0])
        ca.prefetch(xs[-1], force=True)
        assert [x.device for x in xs] == devices
        assert m.stats()["moved"] == {}


def test_fastonly_raises_when_full_and_slowonly_never_uses_fast():
    with manager("fastonly") as m:
        keep = arrays(m, 6)
        with pytest.raises(OutOfMemoryError, match="FastOnly"):
            ca.zeros(4 * KB, manager=m)
        assert len(keep) == 6
    with manager("slowonly") as m:
        x = ca.ones(10, manager=m)
        ca.prefetch(x, force=True)
        assert x.device == "slow"


def test_slow_memory_exhaustion_is_an_exception_with_sizes():
    with ca.Manager(fast="16KiB", slow="64KiB", granularity=256) as m:
        keep = [ca.zeros(1000, manager=m) for _ in range(8)]
        with pytest.raises(OutOfMemoryError) as e:
            ca.zeros(1 << 16, manager=m)
        assert "slow" in str(e.value) and "fast memory" in str(e.value)
        m.check()
        assert len(keep) == 8


# ---- the README's custom policy ------------------------------------------------------------

class LargeToSlow(Policy):
    """Arrays of at least `threshold` bytes go straight to slow memory; others prefer fast."""

    name = "large-to-slow"

    def __init__(self, threshold=4096):
        super().__init__()
        self.threshold = threshold
        self.uses = {}

    def allocate(self, nbytes):
        if nbytes >= self.threshold:
            return self.alloc_slow(nbytes)
        return self.alloc_fast(nbytes, force=True) or self.alloc_slow(nbytes)

    def read_use(self, obj):
        self.uses[obj.id] = self.uses.get(obj.id, 0) + 1

    def write_use(self, obj):
        super().write_use(obj)
        self.read_use(obj)

    def select_victims(self, nbytes):
        # evict the least used fast objects first
        objs = [self.manager.parent(r) for r in self.manager.regions_on("fast")]
        return sorted((o for o in objs if o is not None), key=lambda o: self.uses.get(o.id, 0))


def test_custom_policy_subclass():
    ca.register_policy("large-to-slow", LargeToSlow)
    with ca.Manager(fast="32KiB", slow="1MiB", policy="large-to-slow") as m:
        small = ca.ones(100, manager=m)
        big = ca.ones(1000, manager=m)
        assert small.device == "fast" and big.device == "slow"
        y = small + big[:100]
        assert y.device == "fast"
        assert m.policy.uses[small.object.id] >= 1
        hot = [ca.ones(400, manager=m) for _ in range(3)]      # 3 x 3200 bytes
        for _ in range(5):
            for h in hot:
                h += 1
        ca.ones(450, manager=m)
        ca.ones(450, manager=m)
        assert all(h.device == "fast" for h in hot)
        ca.evict(small)
        assert small.device == "slow"
        np.testing.assert_array_equal(np.asarray(small), np.ones(100))


def test_placement_hints_bypass_the_policy_choice():
    with manager() as m:
        xs = arrays(m, 5)
        big = ca.zeros(3 * KB, manager=m, placement="slow")
        assert big.device == "slow"
        assert all(x.device == "fast" for x in xs)      # nothing was evicted for it
        y = ca.asarray(np.ones(10), manager=m, placement="slow")
        assert y.device == "slow"
        z = ca.empty(10, manager=m, placement="fast")
        assert z.device == "fast"
        with pytest.raises(ValueError, match="placement"):
            ca.empty(3, manager=m, placement="gpu")
    with manager("slowonly") as m:
        assert ca.ones(10, manager=m, placement="fast").device == "fast"
