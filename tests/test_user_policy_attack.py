"""What a careless program's own policy does to the manager: whatever a hook returns or raises,
the manager keeps its invariants (``m.check()``), holds no stray pin, loses no write, and the
error names the policy class and the hook."""

import gc

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.policies import LRU, Policy

TINY = dict(fast="64KiB", slow="4MiB", granularity=256)


class Boom(Exception):
    """What an armed hook raises."""


def _armed(base, hook):
    """A subclass of base whose method hook raises Boom while ``armed`` is set (recording the
    object it was given), and otherwise does what base does."""
    def method(self, *args, **kwargs):
        if self.armed:
            self.given.extend(a for a in args if isinstance(a, ca.Object))
            raise Boom(hook)
        return getattr(base, hook)(self, *args, **kwargs)

    method.__code__ = method.__code__.replace(co_name=hook)      # as if written as def <hook>
    method.__name__ = hook
    return type(f"Armed{base.__name__}", (base,), {hook: method, "armed": False, "given": []})


def _compute(m, a):
    out = ca.empty(a.shape, manager=m)
    ca.compute("add1", lambda x, y: np.add(x, 1, out=y), (a,), (out,))


def _kernel(m, a):
    with ca.kernel("double", (a,), (a,)) as (x, y):
        y[...] = 2 * x


def _readable(m, a):
    with ca.readable(a):
        pass


def _new_pinned(m, a):
    obj = m.new_pinned(64)
    m.release((obj,))


def _collected(m, a):
    ca.ones(10, manager=m)                # dropped at once: its free is queued
    gc.collect()
    ca.ones(10, manager=m)                # the next call frees it


def _pressure(m, a):
    return [ca.ones(2048, manager=m) for _ in range(6)]


# each op uses the manager the way a program does; a is an array made before the hook is armed
OPS = {
    "ufunc": lambda m, a: a + 1,
    "in-place ufunc": lambda m, a: a.__iadd__(1),
    "setitem": lambda m, a: a.__setitem__(slice(0, 3), 7.0),
    "reduction": lambda m, a: np.sum(a),
    "creation": lambda m, a: ca.zeros(300, manager=m),
    "new_pinned": _new_pinned,
    "run": lambda m, a: m.run(lambda new: None, reads=(a._obj,), nbytes=64),
    "compute": _compute,
    "kernel": _kernel,
    "readable": _readable,
    "prefetch": lambda m, a: (ca.evict(a), ca.prefetch(a)),
    "evict": lambda m, a: ca.evict(a),
    "softevict": lambda m, a: ca.softevict(a),
    "unsafe_free": lambda m, a: ca.unsafe_free(ca.ones(10, manager=m)),
    "collected": _collected,
    "pressure": _pressure,
    "marks": lambda m, a: (ca.mark_layer(m), ca.mark_step(m)),
}

HOOKS = ("allocate", "on_fast", "read_use", "write_use", "new_in_fast", "forget", "prefetch",
         "evict", "softevict", "on_layer", "on_step")


class BusyLRU(LRU):
    """LRU with its observers on: write-back on release, lookahead prefetch, write-allocate."""

    def __init__(self):
        super().__init__(writeback=0.5, lookahead=2, write_allocate=True)


def _warm_up(m):
    """A few marked steps, so that the lookahead has learnt one."""
    for _ in range(3):
        for _ in range(6):
            ca.ones(1024, manager=m) + 1
        ca.mark_step(m)


def _values(a):
    return np.array(a, copy=True)


@pytest.mark.parametrize("base, hook", [
    *((base, hook) for base in (Policy, LRU) for hook in HOOKS),
    *((BusyLRU, hook) for hook in HOOKS if hook != "new_in_fast"),    # observers: no C path
    (BusyLRU, "write_back"), (BusyLRU, "select_victims")],
    ids=lambda v: v.__name__ if isinstance(v, type) else v)
def test_a_raising_hook_names_itself_and_leaves_the_manager_whole(base, hook):
    cls = _armed(base, hook)
    raised = []
    for name, op in OPS.items():
        m = ca.Manager(**TINY, policy=cls())
        try:
            a = ca.asarray(np.arange(100.0), manager=m)
            _warm_up(m)
            before = _values(a)
            m.policy.given = []
            m.policy.armed = True
            try:
                op(m, a)
            except Boom as e:
                raised.append(name)
                assert any(f"{cls.__name__}.{hook}" in n for n in getattr(e, "__notes__", ())), \
                    (name, getattr(e, "__notes__", None))
                del e
            m.policy.armed = False
            m.check()
            stray = [o for o in (*m.objects(), *m.policy.given) if not o.freed and o._pins]
            assert not stray, (name, stray)
            after = _values(a)
            assert np.array_equal(after, before) or name in (
                "in-place ufunc", "setitem", "kernel"), name   # a write that ran is kept
            assert np.array_equal(_values(a * 2), 2 * after), name     # still usable
        finally:
            m.close()
    assert raised, f"{hook} never ran: the test exercises nothing"


class _Returns(Policy):
    """allocate returns what returned(policy, nbytes) gives."""

    def __init__(self, returned):
        super().__init__()
        self.returned = returned

    def allocate(self, nbytes):
        return self.returned(self, nbytes)


def _earlier(policy, nbytes):
    """The first object it ever made, again: two arrays would share one block."""
    if not hasattr(policy, "first"):
        policy.first = Policy.allocate(policy, nbytes)
    return policy.first


def _freed(policy, nbytes):
    obj = Policy.allocate(policy, nbytes)
    policy.manager.free_object(obj)
    return obj


def _pinned(policy, nbytes):
    obj = Policy.allocate(policy, nbytes)
    policy.manager.pin(obj, detached=True)
    policy.pinned = obj
    return obj


_OTHER = {}


def _foreign(policy, nbytes):
    return _OTHER["m"].policy.allocate(nbytes)


BAD = {
    "None": (lambda p, n: None, "NoneType"),
    "a number": (lambda p, n: 5, "int"),
    "too small": (lambda p, n: Policy.allocate(p, max(n - 8, 0)), "bytes for a request"),
    "too large": (lambda p, n: Policy.allocate(p, n + 8), "bytes for a request"),
    "made earlier": (_earlier, "made before this call"),
    "freed": (_freed, "was freed"),
    "pinned": (_pinned, "pinned"),
    "without a region": (lambda p, n: p.manager.new_object(n), "no region"),
    "of another manager": (_foreign, "another manager"),
}

PATHS = {
    "new_pinned": lambda m: m.release((m.new_pinned(800),)),
    "run": lambda m: m.run(lambda new: None, nbytes=800),
    "creation": lambda m: ca.ones(100, manager=m),
    "ufunc": lambda m: m.keep + 1,
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", BAD)
def test_allocate_must_return_a_new_object_of_this_manager(bad, path):
    returned, why = BAD[bad]
    other = _OTHER["m"] = ca.Manager(**TINY)
    m = ca.Manager(**TINY, policy=_Returns(lambda p, n: Policy.allocate(p, n)))
    try:
        m.keep = ca.ones(100, manager=m)
        written = ca.full(100, 3.0, manager=m)
        m.policy.returned = returned
        if bad == "made earlier":
            m.policy.first = written._obj
        with pytest.raises(TypeError, match=f"_Returns.allocate.*{why}"):
            PATHS[path](m)
        m.policy.returned = lambda p, n: Policy.allocate(p, n)
        if bad == "pinned":
            m.unpin(m.policy.pinned, detached=True)
        m.check()
        assert not [o for o in m.objects() if o._pins]
        assert np.array_equal(np.asarray(written), np.full(100, 3.0))     # nobody wrote over it
        assert np.array_equal(np.asarray(m.keep + 1), np.full(100, 2.0))
    finally:
        m.close()
        other.close()


def test_place_is_held_to_the_same_contract():
    class Place(Policy):
        def place(self, nbytes, placement=None):
            return None

    m = ca.Manager(**TINY, policy=Place())
    try:
        with pytest.raises(TypeError, match=r"Place\.place\(80\) returned NoneType"):
            m.new_pinned(80, "fast")
        m.check()
    finally:
        m.close()


@pytest.mark.parametrize("debug", [False, True], ids=["C path", "Python path"])
def test_a_free_whose_forget_raises_still_frees_the_whole_object(debug):
    cls = _armed(Policy, "forget")
    m = ca.Manager(**TINY, policy=cls(), debug=debug)
    try:
        a = ca.ones(10, manager=m)
        obj = a._obj
        m.policy.armed = True
        with pytest.raises(Boom) as info:
            ca.unsafe_free(a)
        assert "ArmedPolicy.forget" in info.value.__notes__[0]
        m.policy.armed = False
        assert obj.freed and obj.primary is None and not obj.regions
        with pytest.raises(ca.UseAfterFreeError, match="was freed"):
            np.asarray(a)
        m.check()
        assert np.array_equal(np.asarray(ca.ones(10, manager=m) + 1), np.full(10, 2.0))
    finally:
        m.close()


def test_a_new_array_whose_write_use_raises_keeps_no_pin_and_traces_balance():
    cls = _armed(Policy, "write_use")
    m = ca.Manager(**TINY, policy=cls())
    try:
        with ca.trace(m):
            m.policy.given = []
            m.policy.armed = True
            with pytest.raises(Boom):
                m.new_pinned(64)
            m.policy.armed = False
            (obj,) = m.policy.given
            assert obj._pins == 0 and not m._fresh
            x = ca.ones(10, manager=m) + 1
        m.check()
        assert np.array_equal(np.asarray(x), np.full(10, 2.0))
    finally:
        m.close()


def test_a_hook_that_recurses_into_the_manager_fails_cleanly():
    class Recursive(LRU):
        armed = False

        def write_use(self, obj):
            super().write_use(obj)
            if self.armed:
                self.manager.run(lambda new: None, writes=(obj,))

    m = ca.Manager(**TINY, policy=Recursive())
    try:
        a = ca.ones(10, manager=m)
        m.policy.armed = True
        for op in (lambda: a.__iadd__(1), lambda: a.__setitem__(0, 5.0),
                   lambda: ca.ones(10, manager=m)):
            with pytest.raises(RecursionError):
                op()
        m.policy.armed = False
        m.check()
        assert not [o for o in m.objects() if o._pins]
        assert np.array_equal(np.asarray(a + 1), np.full(10, 2.0))
    finally:
        m.close()


def test_a_policy_that_skips_super_init_still_works():
    class NoSuper(Policy):
        def __init__(self, threshold=1):
            self.threshold = threshold

    m = ca.Manager(**TINY, policy=NoSuper())
    try:
        assert np.array_equal(np.asarray(ca.ones(10, manager=m) + 1), np.full(10, 2.0))
    finally:
        m.close()


def test_register_policy_refuses_a_taken_name_unless_replacing():
    class LRU2(LRU):
        pass

    with pytest.raises(ValueError, match="'LRU' is taken by .*lru.LRU; choose another name"):
        ca.register_policy("LRU", LRU2)
    m = ca.Manager(**TINY)
    try:
        assert type(m.policy) is LRU
    finally:
        m.close()
    ca.register_policy("lru", LRU)                       # the same factory again: fine
    ca.register_policy("lru-subclass", LRU2)
    ca.register_policy("lru-subclass", LRU, replace=True)
    for name, factory in ((3, LRU), ("", LRU), ("x", "LRU")):
        with pytest.raises(TypeError):
            ca.register_policy(name, factory)


class _Victims(Policy):
    """Makes room for every new array (as the README's LargeToSlow) in the order victims()
    gives."""

    def __init__(self, victims):
        super().__init__()
        self.victims = victims

    def allocate(self, nbytes):
        return self.alloc_fast(nbytes, force=True) or self.alloc_slow(nbytes)

    def select_victims(self, nbytes):
        return self.victims(self, nbytes)


@pytest.mark.parametrize("victims, why", [
    (lambda p, n: [1, "x"], "returned int"),
    (lambda p, n: [_OTHER["m"].policy.allocate(64)], "another manager"),
], ids=["not objects", "of another manager"])
def test_select_victims_must_name_objects_of_this_manager(victims, why):
    other = _OTHER["m"] = ca.Manager(**TINY)
    m = ca.Manager(**TINY, policy=_Victims(Policy.select_victims))
    try:
        kept = [ca.full(2048, float(i), manager=m) for i in range(3)]
        m.policy.victims = victims
        with pytest.raises(TypeError, match=f"_Victims.select_victims.*{why}"):
            for _ in range(8):
                kept.append(ca.ones(2048, manager=m))
        m.policy.victims = Policy.select_victims
        m.check()
        assert not [o for o in m.objects() if o._pins]
        for i, x in enumerate(kept[:3]):
            assert np.array_equal(np.asarray(x), np.full(2048, float(i)))
    finally:
        m.close()
        other.close()


FOREIGN = {
    "free_object": lambda m, obj: m.free_object(obj),
    "policy unsafe_free": lambda m, obj: m.policy.unsafe_free(obj),
    "evict": lambda m, obj: m.evict(obj),
    "policy evict": lambda m, obj: m.policy.evict(obj),
    "prefetch": lambda m, obj: m.prefetch(obj, force=True),
    "policy prefetch": lambda m, obj: m.policy.prefetch(obj, force=True),
    "softevict": lambda m, obj: m.softevict(obj),
    "pin": lambda m, obj: m.pin(obj),
}


@pytest.mark.parametrize("debug", [False, True], ids=["C path", "Python path"])
@pytest.mark.parametrize("op", FOREIGN)
def test_an_object_of_another_manager_is_refused_before_it_corrupts_either(op, debug):
    """Both managers number objects from 1 and place them at the same offsets: an object of
    one acted on by the other would free or move the other's array."""
    mine = ca.Manager(**TINY, debug=debug)
    theirs = ca.Manager(**TINY, debug=debug)
    try:
        x = ca.full(10, 3.0, manager=mine)
        y = ca.ones(10, manager=theirs)
        assert x._obj.id == y._obj.id
        with pytest.raises(ca.CachedArraysError, match="belongs to another manager"):
            FOREIGN[op](mine, y._obj)
        for m in (mine, theirs):
            m.check()
        assert not y._obj.freed and y._obj._pins == 0
        z = ca.full(10, 5.0, manager=mine)           # would take x's block had it been freed
        assert np.array_equal(np.asarray(x), np.full(10, 3.0))
        assert np.array_equal(np.asarray(y), np.ones(10))
        assert np.array_equal(np.asarray(z), np.full(10, 5.0))
    finally:
        mine.close()
        theirs.close()


class Liar(LRU):
    """Claims to have made room and evicted, and did neither."""

    def make_room(self, nbytes, wait=True):
        return True

    def evict(self, obj, to=None, wait=True):
        return True


def test_a_policy_that_claims_room_it_did_not_make_spills_to_slow_memory():
    m = ca.Manager(**TINY, policy=Liar())
    try:
        xs = [ca.full(2048, float(i), manager=m) for i in range(12)]
        ys = [x + 1 for x in xs]
        assert {x.device for x in xs} == {"fast", "slow"}
        for i, y in enumerate(ys):
            assert np.array_equal(np.asarray(y), np.full(2048, i + 1.0))
        m.check()
    finally:
        m.close()


def test_a_policy_that_claims_room_in_kernels_in_fast_mode_gets_a_bounded_error():
    policy = Liar()
    policy.kernels_in_fast = True
    m = ca.Manager(**TINY, policy=policy)
    try:
        xs = [ca.full(2048, float(i), manager=m) for i in range(12)]
        with pytest.raises(ca.OutOfMemoryError, match="the Liar policy could not make room"):
            for x in xs:
                x + 1
        m.check()
        assert not [o for o in m.objects() if o._pins]
        policy.kernels_in_fast = False               # reading them back is a kernel too
        for i, x in enumerate(xs):
            assert np.array_equal(np.asarray(x), np.full(2048, float(i)))
    finally:
        m.close()


@pytest.mark.parametrize("policy", ["fastonly", "lru"])
def test_the_library_s_own_policy_errors_carry_no_hook_note(policy):
    m = ca.Manager(fast="64KiB", slow="256KiB", granularity=256, policy=policy)
    try:
        with pytest.raises(ca.OutOfMemoryError) as info:
            [ca.ones(8192, manager=m) for _ in range(8)]
        assert not getattr(info.value, "__notes__", None)
        m.check()
    finally:
        m.close()
