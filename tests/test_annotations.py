"""Annotations: onobjects walks, prefetch/evict/softevict on containers, cleanup, noescape."""

import dataclasses
import functools
import threading

import numpy as np
import pytest

import cachedarrays as ca


@pytest.fixture
def m():
    with ca.Manager(fast="1MiB", slow="16MiB") as mgr:
        yield mgr


@dataclasses.dataclass
class Layer:
    weight: object
    bias: object


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b


def test_onobjects_walks_containers_objects_and_closures(m):
    xs = [ca.zeros(4, manager=m) for _ in range(9)]
    layer = Layer(xs[0], {"b": xs[1]})
    slotted = Slotted(xs[2], (xs[3],))

    def make_closure():
        captured = xs[4]
        return lambda: captured + 1

    class Holder:
        def __init__(self):
            self.items = [xs[5], {xs[6]: 1} if False else xs[6]]

        def method(self):
            return self

    part = functools.partial(np.add, xs[7])
    found = ca.arrays_in(layer, slotted, make_closure(), Holder().method, part, xs[8], xs[8][1:])
    assert {id(a.object) for a in found} == {id(x.object) for x in xs}
    assert len(found) == 9


def test_onobjects_survives_cycles_and_skips_freed(m):
    a = ca.zeros(3, manager=m)
    cyc = [a]
    cyc.append(cyc)
    d = {"self": None, "a": a}
    d["self"] = d
    assert len(ca.arrays_in(cyc, d)) == 1
    ca.unsafe_free(a)
    assert ca.arrays_in(cyc) == []


def test_onobjects_does_not_walk_function_globals(m):
    global _GLOBAL_ARRAY
    _GLOBAL_ARRAY = ca.zeros(2, manager=m)

    def uses_global():
        return _GLOBAL_ARRAY
    assert ca.arrays_in(uses_global) == []


def test_movement_annotations_on_containers(m):
    layer = Layer(ca.ones(100, manager=m), ca.ones(10, manager=m))
    ca.evict(layer)
    assert layer.weight.device == "slow" and layer.bias.device == "slow"
    ca.prefetch({"l": layer}, force=True)
    assert layer.weight.device == "fast" and ca.in_fast(layer.bias)
    ca.softevict([layer])
    soft, _ = m.policy.tiers()
    assert set(soft) == {layer.weight.object.id, layer.bias.object.id}


def test_preserve_and_cleanup(m):
    keep = ca.ones(10, manager=m)
    tmp1 = ca.ones(10, manager=m)
    tmp2 = ca.ones(10, manager=m)
    state = {"keep": keep, "tmp": [tmp1, tmp2]}
    freed = ca.cleanup(state, keep=ca.preserve(keep))
    assert freed == 2
    assert tmp1.is_freed and tmp2.is_freed and not keep.is_freed
    assert ca.cleanup([keep], keep=[keep]) == 0


def test_cleanup_leaves_pinned_arrays(m):
    x = ca.ones(10, manager=m)
    with ca.readable(x):
        assert ca.cleanup([x]) == 0
    assert not x.is_freed


def test_noescape_frees_temporaries_only(m):
    @ca.noescape
    def f(a, out):
        t1 = a * 2
        t2 = t1 + 1
        out["kept"] = t2 * 0
        return t2 - 1

    a = ca.ones(1000, manager=m)
    out = {}
    before = m.stats()["objects"]
    r = f(a, out)
    np.testing.assert_array_equal(np.asarray(r), np.full(1000, 2.0))
    assert not out["kept"].is_freed and not a.is_freed
    assert m.stats()["objects"] == before + 2        # the result and the escaped array


def test_noescape_does_not_touch_other_threads(m):
    other = []
    go = threading.Event()
    done = threading.Event()

    def worker():
        go.wait()
        other.append(ca.ones(10, manager=m))
        done.set()

    t = threading.Thread(target=worker)
    t.start()

    @ca.noescape
    def f():
        go.set()
        done.wait()
        return None

    f()
    t.join()
    assert not other[0].is_freed


def test_noescape_respects_the_cleanup_switch():
    with ca.Manager(fast="1MiB", slow="4MiB", policy_options={"cleanup": False}) as m:
        leaked = []

        @ca.noescape
        def f():
            leaked.append(ca.ones(3, manager=m).object)
            return None
        f()
        assert not leaked[0].freed


def test_annotate_prefetches_softevicts_and_cleans_pullbacks(m):
    w = ca.ones((8, 8), manager=m)
    ca.evict(w)

    class Dense:
        def __init__(self, w):
            self.w = w

        @ca.annotate(prefetch=True, softevict=True, cleanup=True)
        def __call__(self, x):
            assert self.w.device == "fast"           # prefetched before the kernel
            y = x @ self.w
            hidden = y * 1.0                         # captured by the pullback

            def pullback(dy):
                return dy @ self.w.T + 0 * hidden

            return y, pullback

    layer = Dense(w)
    x = ca.ones((2, 8), manager=m)
    y, pb = layer(x)
    soft, _ = m.policy.tiers()
    assert w.object.id in soft and x.object.id in soft
    dy = ca.ones((2, 8), manager=m)
    dx = pb(dy)
    np.testing.assert_array_equal(np.asarray(dx), np.full((2, 8), 8.0))
    assert y.is_freed and dy.is_freed                  # cleaned after the backward pass
    assert not w.is_freed and not x.is_freed and not dx.is_freed


def test_annotate_noescape_option(m):
    @ca.annotate(prefetch=False, softevict=False, noescape=True)
    def f(x):
        t = x + 1
        return t * 2

    x = ca.ones(5, manager=m)
    before = m.stats()["objects"]
    r = f(x)                                   # t was freed; only the result remains
    assert m.stats()["objects"] == before + 1
    np.testing.assert_array_equal(np.asarray(r), np.full(5, 4.0))


def test_managers_devices_and_policies_are_not_walked(m):
    x = ca.ones(3, manager=m)

    class Holder:
        def __init__(self):
            self.manager = m
            self.policy = m.policy
            self.device = m.fast
            self.x = x

    calls = []
    orig = type(m).__dict__.get("__ca_leaf__")
    assert orig is True
    found = ca.arrays_in(Holder())
    assert [a.object for a in found] == [x.object]
    assert calls == []


def test_walks_and_fallbacks_leave_no_reference_cycles(m):
    import gc

    gc.collect()
    gc.disable()
    try:
        x = ca.ones(1000, manager=m)
        before = m.stats()["objects"]
        for _ in range(3):
            ca.prefetch([x, {"a": x}], force=True)
            ca.preserve(x, [x])
            np.where(x > 0.5, x, x)            # a NumPy function without a dedicated path
            np.concatenate([x, x])
        assert m.stats()["objects"] == before  # every temporary went at once
    finally:
        gc.enable()
