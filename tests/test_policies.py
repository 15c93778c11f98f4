"""Policies: LRU order, the soft-evicted tier, exact clean/dirty traffic, presets, baselines."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.errors import OutOfMemoryError
from cachedarrays.policies import LRU, Policy
from helpers import assert_eq

KB = 1024


def arrays(m, n, nbytes=10 * KB):
    return [ca.full(nbytes // 8, float(i), manager=m) for i in range(n)]


def moved(m, key):
    return m.stats()["moved"].get(key, {"bytes": 0})["bytes"]


def test_unknown_policy_lists_known_ones():
    with pytest.raises(ValueError, match="firsttouch.*lru"):
        ca.Manager(fast="64KiB", slow="64KiB", policy="nope")


def test_policy_by_object_class_or_name(tiny_manager):
    m = tiny_manager(policy=LRU(local_alloc=False))
    assert isinstance(m.policy, LRU) and not m.policy.local_alloc
    m = tiny_manager(policy=ca.policies.FirstTouch)
    assert isinstance(m.policy, ca.policies.FirstTouch)


def test_lru_evicts_least_recently_used_first(tiny):
    xs = arrays(tiny, 6)               # 61.5 KiB of 64 KiB
    float(xs[0].sum())                 # use 0: now 1 is the least recent
    new = ca.zeros(KB, manager=tiny)   # 8 KiB: one 10 KiB victim is enough
    assert new.device == "fast"
    assert xs[1].device == "slow"
    assert all(x.device == "fast" for i, x in enumerate(xs) if i != 1)
    assert xs[1].sum() == 10 * KB // 8 * 1.0


def test_every_use_updates_order_not_insertion(tiny):
    xs = arrays(tiny, 6)
    for x in (xs[0], xs[1], xs[2]):
        x += 0                        # writes count as uses
    keep = ca.zeros(KB, manager=tiny)
    assert xs[3].device == "slow"
    soft, recent = tiny.policy.tiers()
    assert recent == [xs[4].object.id, xs[5].object.id, xs[0].object.id,
                      xs[1].object.id, xs[2].object.id, keep.object.id]


def test_soft_evicted_tier_goes_first(tiny):
    xs = arrays(tiny, 6)
    ca.softevict(xs[3])
    keep = ca.zeros(KB, manager=tiny)
    assert xs[3].device == "slow" and keep.device == "fast"
    assert xs[0].device == "fast"
    soft, recent = tiny.policy.tiers()
    assert soft == []


def test_use_brings_soft_evicted_back_to_regular(tiny):
    xs = arrays(tiny, 5)
    ca.softevict(xs[3])
    float(xs[3][0])
    soft, recent = tiny.policy.tiers()
    assert soft == [] and recent[-1] == xs[3].object.id


def test_dirty_eviction_copies_and_clean_eviction_is_elided_exactly(tiny):
    x = ca.full(1000, 1.0, manager=tiny)   # 8000 bytes, only in fast memory
    ca.evict(x)
    assert moved(tiny, "fast->slow") == 8000
    ca.prefetch(x)
    assert moved(tiny, "slow->fast") == 8000
    ca.evict(x)                            # clean: the slow copy is still valid
    assert moved(tiny, "fast->slow") == 8000
    ev = tiny.stats()["events"]["writebacks_elided"]
    assert ev == {"count": 1, "bytes": 8000}
    ca.prefetch(x)
    x[0] = 5.0                             # dirty again
    ca.evict(x)
    assert moved(tiny, "fast->slow") == 16000
    assert float(x[0]) == 5.0 and float(x[1]) == 1.0


def test_writable_scope_marks_dirty_so_writes_are_never_lost(tiny):
    x = ca.zeros(100, manager=tiny)
    ca.evict(x)
    ca.prefetch(x)
    with ca.writable(x) as a:
        a[:] = 7
    ca.evict(x)
    assert_eq(x, np.full(100, 7.0), exact=True)


def test_prefetch_keeps_the_slow_copy_linked(tiny):
    x = ca.ones(100, manager=tiny)
    ca.evict(x)
    slow_region = x.object.primary
    ca.prefetch(x)
    assert x.device == "fast"
    assert tiny.getlinked(x.object.primary, "slow") is slow_region


def test_forced_prefetch_makes_room_and_unforced_does_not(tiny):
    xs = arrays(tiny, 6)                    # fills fast memory
    y = ca.ones(2 * KB, manager=tiny)
    ca.evict(y)
    filler = ca.ones(2 * KB, manager=tiny)  # takes the room y left
    ca.prefetch(y)                          # not forced: no room, stays slow
    assert y.device == "slow"
    assert tiny.stats()["events"]["prefetch_refused"]["count"] == 1
    was_fast = [x for x in xs + [filler] if x.device == "fast"]
    ca.prefetch(y, force=True)              # forced: evicts to make room
    assert y.device == "fast"
    assert any(x.device == "slow" for x in was_fast)


def test_too_large_object_stays_slow_and_the_refusal_is_counted(tiny):
    big = ca.zeros(128 * KB // 8, manager=tiny)   # larger than fast memory
    assert big.device == "slow"
    ca.prefetch(big, force=True)
    assert big.device == "slow"
    assert tiny.stats()["events"]["prefetch_refused"]["count"] == 1


def test_pinned_arrays_are_never_evicted_to_make_room(tiny):
    xs = arrays(tiny, 6)
    with ca.readable(xs[0]), ca.readable(xs[1]):
        for _ in range(4):
            ca.zeros(2 * KB, manager=tiny)
        assert xs[0].device == "fast" and xs[1].device == "fast"


def test_oversubscribed_values_stay_correct(tiny):
    rng = np.random.default_rng(1)
    ref = [rng.random(1000) for _ in range(40)]    # 40 x 8 KB = 5x fast memory
    xs = [ca.asarray(r, manager=tiny) for r in ref]
    for _ in range(200):
        i, j = rng.integers(0, 40, 2)
        xs[i] += xs[j]
        ref[i] += ref[j]
    for x, r in zip(xs, ref):
        assert_eq(x, r)                     # also checks the heaps and records
    assert moved(tiny, "fast->slow") > 0


@pytest.mark.parametrize("preset,local,cleanup,prefetch", [
    ("CA:0", False, False, False), ("L", True, False, False), ("LM", True, True, False),
    ("CA:LMP", True, True, True), ("CA:∅", False, False, False)])
def test_presets_set_the_switches(preset, local, cleanup, prefetch):
    p = LRU(preset=preset)
    assert (p.local_alloc, p.allows_cleanup, p.allows_prefetch) == (local, cleanup, prefetch)


def test_presets_are_the_dissertation_names_and_mode_is_not_a_parameter():
    assert list(ca.policies.PRESETS) == ["CA:0", "CA:L", "CA:LM", "CA:LMP"]
    with pytest.raises(TypeError):
        LRU(mode="CA:LM")


def test_preset_without_local_allocation_keeps_a_slow_twin(tiny_manager):
    m = tiny_manager(policy_options={"preset": "CA:0"})
    x = ca.ones(100, manager=m)
    assert x.device == "fast"
    assert m.getlinked(x.object.primary, "slow") is not None
    assert moved(m, "slow->fast") == 800


def test_prefetch_switch_off_does_not_move(tiny_manager):
    m = tiny_manager(policy_options={"prefetch": False})
    x = ca.ones(100, manager=m)
    ca.evict(x)
    ca.prefetch(x, force=True)
    assert x.device == "slow"


def test_cleanup_switch_off_keeps_arrays(tiny_manager):
    m = tiny_manager(policy_options={"cleanup": False})
    x = ca.ones(10, manager=m)
    assert ca.cleanup([x]) == 0
    assert not x.is_freed


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="unknown LRU preset 'XYZ'; presets are CA:0, .*CA:LM"):
        LRU(preset="XYZ")


def test_firsttouch_never_moves(tiny_manager):
    m = tiny_manager(policy="firsttouch")
    xs = arrays(m, 8)
    devices = [x.device for x in xs]
    assert devices[:6] == ["fast"] * 6 and devices[-1] == "slow"
    ca.evict(xs[0])
    ca.prefetch(xs[-1], force=True)
    assert [x.device for x in xs] == devices
    assert m.stats()["moved"] == {}


def test_fastonly_raises_when_full_and_slowonly_never_uses_fast(tiny_manager):
    m = tiny_manager(policy="fastonly")
    keep = arrays(m, 6)
    with pytest.raises(OutOfMemoryError, match="FastOnly"):
        ca.zeros(4 * KB, manager=m)
    assert len(keep) == 6
    m = tiny_manager(policy="slowonly")
    x = ca.ones(10, manager=m)
    ca.prefetch(x, force=True)
    assert x.device == "slow"


def test_slow_memory_exhaustion_is_an_exception_with_sizes(tiny_manager):
    m = tiny_manager(fast="16KiB", slow="64KiB")
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


def test_custom_policy_subclass(make_manager):
    ca.register_policy("large-to-slow-tests", LargeToSlow)     # the README's takes its name
    m = make_manager(fast="32KiB", slow="1MiB", policy="large-to-slow-tests")
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
    assert_eq(small, np.ones(100), exact=True)


def test_placement_hints_bypass_the_policy_choice(tiny, tiny_manager):
    xs = arrays(tiny, 5)
    big = ca.zeros(3 * KB, manager=tiny, placement="slow")
    assert big.device == "slow"
    assert all(x.device == "fast" for x in xs)      # nothing was evicted for it
    y = ca.asarray(np.ones(10), manager=tiny, placement="slow")
    assert y.device == "slow"
    z = ca.empty(10, manager=tiny, placement="fast")
    assert z.device == "fast"
    with pytest.raises(ValueError, match="placement"):
        ca.empty(3, manager=tiny, placement="gpu")
    slow_only = tiny_manager(policy="slowonly")
    assert ca.ones(10, manager=slow_only, placement="fast").device == "fast"


# ---- what a policy declares it does with the annotations ------------------------------------

@pytest.mark.parametrize("cls, prefetch, softevict, reads", [
    (Policy, True, False, False), (LRU, True, True, True),
    (ca.policies.FirstTouch, False, False, False), (ca.policies.FastOnly, False, False, False),
    (ca.policies.SlowOnly, False, False, False)])
def test_built_in_policies_declare_their_capabilities(cls, prefetch, softevict, reads):
    assert (cls.honours_prefetch, cls.honours_softevict, cls.tracks_reads) == \
        (prefetch, softevict, reads)
    assert cls.allows_prefetch and cls.allows_cleanup      # switches: on unless set off


def test_a_policy_that_overrides_a_hook_without_declaring_it_gets_the_capability():
    class MovesAfterAll(ca.policies.FastOnly):
        def prefetch(self, obj, force=False):
            return Policy.prefetch(self, obj, force)

    class Quiet(ca.policies.FastOnly):                  # inherits FastOnly's prefetch
        pass

    class Counts(Policy):
        def read_use(self, obj):
            pass

        def softevict(self, obj):
            pass

    class Declared(Policy):
        honours_prefetch = False

        def prefetch(self, obj, force=False):
            return self.in_fast(obj)

    class Mixin:
        def softevict(self, obj):
            pass

    class MixedFast(Mixin, ca.policies.FastOnly):       # the mixin's softevict comes first
        pass

    assert MovesAfterAll.honours_prefetch and not Quiet.honours_prefetch
    assert Counts.tracks_reads and Counts.honours_softevict and Counts.honours_prefetch
    assert not Declared.honours_prefetch
    assert MixedFast.honours_softevict and not MixedFast.honours_prefetch


def test_policies_register_by_name_from_their_own_modules():
    from cachedarrays import registry
    from cachedarrays.policies import lru, simple

    assert ca.register_policy is registry.register_policy
    assert ca.policy_names is registry.policy_names
    assert registry.resolve("LRU") is lru.LRU
    assert registry.resolve("fast-only") is registry.resolve("fastonly") is simple.FastOnly
    with pytest.raises(ValueError, match="unknown policy 'nope'; known policies: .*lru"):
        registry.resolve("nope")


def test_every_registered_policy_copies_and_pickles_with_its_state():
    """An unbound policy (a configuration) can be copied and pickled. LRU's tiers live in a C
    record (LRURecord), which object's default reduction would refuse."""
    import copy
    import pickle

    from cachedarrays.registry import policy_names, resolve

    for name in policy_names():
        if not resolve(name).__module__.startswith("cachedarrays."):
            continue                # a program's own (the README's, defined in __main__)
        p = resolve(name)()
        for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
            assert type(q) is type(p)
            assert {k: v for k, v in vars(q).items() if not callable(v)}.keys() == \
                {k: v for k, v in vars(p).items() if not callable(v)}.keys()
    lru = ca.policies.LRU(preset="CA:LMP")
    lru.recent[3] = None
    lru.soft[4] = None
    for q in (copy.deepcopy(lru), pickle.loads(pickle.dumps(lru))):
        assert list(q.recent) == [3] and list(q.soft) == [4] and q.recent is not lru.recent
        assert (q.lookahead, q.writeback, q.local_alloc) == (4, 0.2, True)


@pytest.mark.parametrize("local_alloc", [True, False])
def test_making_room_walks_past_empty_arrays(local_alloc):
    """Empty arrays hold no heap block: making room for a large array, when fast memory is
    full and fragmented, must not start an eviction walk from one (it raised
    ``evictfrom needs a live region``) and must keep every value."""
    with ca.Manager(fast="32KiB", slow="2MiB", granularity=256, policy="lru",
                    policy_options={"local_alloc": local_alloc}) as m:
        kept = []

        def read_all():                 # every array used, newest last, as a reader would
            for x, a in kept:
                assert_eq(x, a)
            m.check()

        def create(n):
            a = np.random.default_rng(0).random(n)
            kept.append((ca.asarray(a, manager=m), a))
            read_all()

        def double():
            x, a = kept[0]
            kept.append((x + x, a + a))
            read_all()

        for step in (700, 0, 0, 700, 0, 0, "+", 0, 0, 0, 0, 0, "+", 0, 0, "+", 0, "+", 0, 0, 0,
                     1500):
            double() if step == "+" else create(step)
