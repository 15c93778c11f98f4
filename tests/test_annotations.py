"""Annotations: onobjects walks, prefetch/evict/softevict on containers, cleanup, noescape."""

import dataclasses
import functools
import threading

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import annotations
from helpers import assert_eq


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
            self.items = [xs[5], xs[6]]

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


def gone(m, oid):
    """True once the object with this id was freed (or collected)."""
    return m.object(oid) is None


def test_preserve_and_cleanup(m):
    keep = ca.ones(10, manager=m)
    held = ca.ones(10, manager=m)
    state = {"keep": keep, "tmp": [ca.ones(10, manager=m), ca.ones(10, manager=m)], "held": held}
    tmp_ids = [a.object.id for a in state["tmp"]]
    freed = ca.cleanup(state, keep=ca.preserve(keep))
    assert freed == 2                                  # what only the state held
    assert all(gone(m, i) for i in tmp_ids)
    assert not keep.is_freed and not held.is_freed     # kept; still referenced by this frame
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
    assert_eq(r, np.full(1000, 2.0), exact=True)
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


def test_noescape_respects_the_cleanup_switch(make_manager):
    m = make_manager(policy_options={"cleanup": False})
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
            self.hidden_id = hidden.object.id

            def pullback(dy):
                return dy @ self.w.T + 0 * hidden

            return y, pullback

    layer = Dense(w)
    x = ca.ones((2, 8), manager=m)
    y, pb = layer(x)
    y_id = y.object.id
    del y                                              # the caller lets go of y
    soft, _ = m.policy.tiers()
    assert w.object.id in soft and x.object.id in soft
    dx = pb(ca.ones((2, 8), manager=m))
    assert_eq(dx, np.full((2, 8), 8.0), exact=True)
    assert gone(m, y_id) and gone(m, layer.hidden_id)  # cleaned after the backward pass
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
    assert_eq(r, np.full(5, 4.0), exact=True)


def test_managers_devices_and_policies_are_not_walked(m, monkeypatch):
    x = ca.ones(3, manager=m)

    class Holder:
        def __init__(self):
            self.manager = m
            self.policy = m.policy
            self.device = m.fast
            self.telemetry = m.telemetry
            self.regions = [x.object, x.object.primary]
            self.x = x

    looked_inside = []
    real_slots = annotations._slots

    def slots(cls):
        looked_inside.append(cls)
        return real_slots(cls)

    monkeypatch.setattr(annotations, "_slots", slots)
    found = ca.arrays_in(Holder())
    assert [a.object for a in found] == [x.object]
    assert looked_inside == [Holder]


def test_a_registered_leaf_type_is_not_walked(m):
    x = ca.ones(3, manager=m)

    class Session:
        def __init__(self):
            self.scratch = x

    class Other:
        def __init__(self):
            self.scratch = x

    assert [a.object for a in ca.arrays_in(Session())] == [x.object]
    assert ca.register_leaf_type(Session) is Session
    assert ca.arrays_in(Session(), [Session()]) == []
    assert [a.object for a in ca.arrays_in(Other())] == [x.object]
    with pytest.raises(TypeError, match="CachedArrays would count as leaves"):
        ca.register_leaf_type(object)
    with pytest.raises(TypeError, match="takes a class"):
        ca.register_leaf_type(Session())


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


# ---- cleanup and noescape free only what nothing else refers to ---------------------------------

class Scale:
    """The README's custom CNN layer: y = 2 x."""

    def __init__(self, name, shape):
        self.name, self.in_shape, self.out_shape = name, shape, shape

    def forward(self, s, x):
        y = s.empty(self.out_shape)
        s.kernel("scale", lambda xv, yv: np.multiply(xv, 2, out=yv), (x,), (y,))

        def pullback(dy):
            dx = s.empty(self.in_shape)
            s.kernel("scale_bwd", lambda d, o: np.multiply(d, 2, out=o), (dy,), (dx,))
            return dx
        return y, pullback


def test_readme_custom_layer_keeps_the_callers_y_and_dy():
    from cachedarrays.models import cnn

    m, s = cnn.make_session("LM", fast="1MiB", slow="16MiB", backend="numpy")
    with m:
        xa = ca.asarray(np.ones((2, 3), dtype=np.float32), manager=m)
        y, pullback = s.rrule(Scale("scale", (2, 3)), xa)
        dx = pullback(ca.ones((2, 3), dtype=np.float32, manager=m))
        assert float(y.sum()) == 12.0                  # raised UseAfterFreeError before
        assert_eq(dx, np.full((2, 3), 2.0, np.float32), exact=True)

        y, pullback = s.rrule(Scale("scale", (2, 3)), xa)
        dy = ca.ones((2, 3), dtype=np.float32, manager=m)
        pullback(dy)
        assert float(y.sum()) == 12.0 and float(dy.sum()) == 6.0


def test_rrule_still_frees_the_output_and_dy_once_only_the_pullback_holds_them():
    from cachedarrays.models import cnn

    m, s = cnn.make_session("LM", fast="1MiB", slow="16MiB", backend="numpy")
    with m:
        xa = ca.asarray(np.ones((2, 3), dtype=np.float32), manager=m)
        y, pullback = s.rrule(Scale("scale", (2, 3)), xa)
        y_id = y.object.id
        del y
        box = [ca.ones((2, 3), dtype=np.float32, manager=m)]
        dy_id = box[0].object.id
        dx = pullback(box.pop())                       # the pullback gets the only reference
        assert gone(m, y_id) and gone(m, dy_id)
        assert not xa.is_freed and not dx.is_freed


class MLP:
    """A user's two-layer perceptron with hand-written backward pass."""

    def __init__(self, m):
        rng = np.random.default_rng(0)
        self.w1 = ca.asarray(rng.standard_normal((4, 8)), manager=m)
        self.w2 = ca.asarray(rng.standard_normal((8, 3)), manager=m)
        self.temporaries = {}

    @ca.annotate(cleanup=True)
    def __call__(self, x):
        h = x @ self.w1
        a = np.maximum(h, 0)
        y = a @ self.w2
        self.temporaries = {"h": h.object.id, "a": a.object.id}

        def pullback(dy):
            self.gw2 = a.T @ dy
            dh = (dy @ self.w2.T) * (h > 0)
            self.gw1 = x.T @ dh
            return dh @ self.w1.T
        return y, pullback


def test_annotated_mlp_keeps_y_and_dy_and_frees_its_captured_temporaries(m):
    mlp = MLP(m)
    xn = np.random.default_rng(1).standard_normal((2, 4))
    x = ca.asarray(xn, manager=m)
    y, pullback = mlp(x)
    dy = ca.ones_like(y)
    dx = pullback(dy)
    assert all(gone(m, i) for i in mlp.temporaries.values())      # h and a, captured only
    for kept in (x, y, dy, dx, mlp.w1, mlp.w2, mlp.gw1, mlp.gw2):
        assert not kept.is_freed
    h = xn @ np.asarray(mlp.w1)
    yn = np.maximum(h, 0) @ np.asarray(mlp.w2)
    assert_eq(y + dy, yn + 1)                                        # both still usable
    dh = (np.ones_like(yn) @ np.asarray(mlp.w2).T) * (h > 0)
    assert_eq(dx, dh @ np.asarray(mlp.w1).T)


def test_cleanup_keeps_an_object_whose_view_the_caller_holds(m):
    @ca.annotate(prefetch=False, softevict=False, cleanup=True)
    def double(x):
        y = x * 2
        return y, lambda dy: dy * 2

    y, pullback = double(ca.ones(6, manager=m))
    head = y[:3]                                       # a view of y's object
    del y
    pullback(ca.ones(6, manager=m))
    assert not head.is_freed and float(head.sum()) == 6.0

    big = ca.ones(6, manager=m)
    state = [big, big[1:]]
    tail = big[2:]
    del big
    assert ca.cleanup(state) == 0 and float(tail.sum()) == 4.0
    del tail
    assert ca.cleanup(state) == 1                      # views only state holds go with it


def test_cleanup_counts_the_array_a_view_was_taken_from_as_reached_through_it(m):
    state = [ca.ones(6, manager=m)[1:]]          # its array is held only by the view (its base)
    assert state[0].base is not None
    assert ca.cleanup(state) == 1 and state[0].is_freed
    big = ca.ones(6, manager=m)
    state = [big[1:]]
    assert ca.cleanup(state) == 0                # big is the caller's
    del big
    assert ca.cleanup(state) == 1


def test_cleanup_frees_a_temporary_only_the_pullback_refers_to(m):
    def forward(x):
        t = x + 1
        return x * 2, lambda dy: dy * t

    y, pullback = forward(ca.ones(4, manager=m))
    t_id = pullback.__closure__[0].cell_contents.object.id
    pullback(ca.ones(4, manager=m))
    assert ca.cleanup((y, pullback)) == 1 and gone(m, t_id)
    assert not y.is_freed


def test_cleanup_keeps_what_a_container_held_elsewhere_reaches(m):
    def make():
        private = [ca.ones(4, manager=m)]
        shared = {"t": ca.ones(4, manager=m)}
        t = ca.ones(4, manager=m)

        def pullback(dy):
            return private[0] * dy + shared["t"] + t

        def sibling():                                 # shares the cell holding t
            return t
        return pullback, shared, sibling

    pullback, shared, sibling = make()
    assert ca.cleanup((pullback,)) == 1                # only the private list's array
    assert not shared["t"].is_freed and not sibling().is_freed
    del sibling
    assert ca.cleanup((pullback,)) == 1                # now t's cell is the pullback's alone

    def outer():
        h = ca.ones(4, manager=m)

        def pullback(dy):
            return h * dy
        assert ca.cleanup((pullback,)) == 0            # this frame still holds h's cell
        return float(h.sum())
    assert outer() == 4.0


def test_cleanup_counts_references_of_slots_and_shared_cells_once(m):
    class Base:
        __slots__ = ("a",)

    class Sub(Base):
        __slots__ = ("a", "__private")                # "a" again: a second, hidden slot

        def __init__(self, a, b):
            Base.a.__set__(self, a)
            self.a = a
            self.__private = b

    a_id = []

    def make():
        obj = Sub(ca.ones(4, manager=m), ca.ones(4, manager=m))
        a_id.append(obj.a.object.id)
        t = ca.ones(4, manager=m)
        return [lambda: (obj, t), lambda: t]           # two closures share t's cell

    assert ca.cleanup(make()) == 3
    assert gone(m, a_id[0])


def test_noescape_keeps_temporaries_stored_in_a_global_a_list_argument_or_self(m):
    global _ESCAPED
    _ESCAPED = None

    class Layer:
        @ca.noescape
        def __call__(self, x, out):
            global _ESCAPED
            _ESCAPED = x + 1
            out.append(x + 2)
            self.saved = x + 3
            tmp = x + 4
            return float(tmp.sum())

    layer, out = Layer(), []
    x = ca.ones(5, manager=m)
    assert layer(x, out) == 25.0
    assert float(_ESCAPED.sum()) == 10.0 and float(out[0].sum()) == 15.0
    assert float(layer.saved.sum()) == 20.0
    _ESCAPED = None


def test_noescape_frees_a_temporary_only_a_reference_cycle_keeps(m):
    import gc

    ids = []

    @ca.noescape
    def f(x):
        t = x + 1
        ids.append(t.object.id)
        loop = [t]
        loop.append(loop)                              # garbage once f returns, but a cycle
        return x * 2

    gc.collect()
    gc.disable()
    try:
        r = f(ca.ones(5, manager=m))
        assert gone(m, ids[0]) and float(r.sum()) == 10.0
    finally:
        gc.enable()


# ---- freed arrays: explicit calls raise, implicit walks skip -----------------------------------

@pytest.mark.parametrize("call", [ca.prefetch, ca.evict, ca.softevict, ca.unsafe_free, ca.in_fast])
def test_annotations_of_a_freed_array_raise_naming_it(m, call):
    x = ca.ones((4, 3), manager=m)
    oid = x.object.id
    ca.unsafe_free(x)
    with pytest.raises(ca.UseAfterFreeError, match=rf"ca\.{call.__name__}: .*shape \(4, 3\).*"
                                                   rf"object {oid}, 96 B"):
        call(x)
    if call is not ca.in_fast:                          # inside what they walk, too
        with pytest.raises(ca.UseAfterFreeError, match=f"object {oid}"):
            call([ca.ones(2, manager=m), {"x": x}])


def test_double_free_raises_and_frees_nothing_else(m):
    x = ca.ones(4, manager=m)
    ca.unsafe_free(x)
    with pytest.raises(ca.UseAfterFreeError, match="already freed and cannot be freed twice"):
        ca.unsafe_free(x)
    y = ca.ones(4, manager=m)
    with pytest.raises(ca.UseAfterFreeError):
        ca.unsafe_free(y, x)                            # checked before anything is freed
    assert not y.is_freed


def test_implicit_walks_skip_freed_arrays(m):
    live, dead = ca.ones(4, manager=m), ca.ones(4, manager=m)
    ca.unsafe_free(dead)
    state = {"live": live, "dead": dead}
    assert ca.arrays_in(state) == [live] and ca.preserve(state) == {live.object.id}
    assert ca.cleanup(state) == 0

    class Layer:
        def __init__(self):
            self.w, self.stale = ca.ones(4, manager=m), dead

        @ca.annotate(prefetch=True, softevict=True, cleanup=True, noescape=True)
        def __call__(self, x):
            y = x * self.w
            return y, lambda dy: dy * self.w

    layer = Layer()
    y, pullback = layer(live)
    assert float(pullback(ca.ones(4, manager=m)).sum()) == 4.0 and float(y.sum()) == 4.0
