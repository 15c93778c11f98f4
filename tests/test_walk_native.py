"""The C object walk of the annotations (native/walk.c) against its definition in Python.

``reference_walk`` below is the walk as it was written in Python: the C walk must find the same
arrays, in the same order, with the same reference counts, and count the same containers, on
every structure the walkers meet (lists, tuples, dicts and their subclasses, closures and their
shared cells, defaults, bound methods, partials, sets, objects with a __dict__ or slots,
dataclasses, cycles, leaves, freed arrays).
"""

import dataclasses
import functools
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays import annotations


def reference_walk(xs, found, containers=None):
    """``annotations._walk`` as it was defined in Python: same arguments, same results."""
    seen = set()
    bare = []                   # containers holding nothing to walk: their counts do not matter
    stack = list(reversed(xs))
    kinds = annotations._KINDS
    # An explicit stack rather than a recursive closure: a closure that refers to itself is a
    # reference cycle, which would keep the arrays it saw alive until the cyclic collector ran.
    while stack:
        x = stack.pop()
        t = type(x)
        k = kinds.get(t)
        if k is None:
            k = annotations._kind(t)
        if k == annotations._ARRAY:
            if containers is None:
                if id(x._obj) not in found:
                    found[id(x._obj)] = x
            else:
                e = found.get(id(x))
                if e is None:
                    found[id(x)] = [x, 1]
                else:
                    e[1] += 1
            continue
        if k == annotations._LEAF:
            continue
        key = id(x)
        if containers is not None:
            e = containers.get(key)
            if e is None:
                containers[key] = [x, 1]
            else:
                e[1] += 1
        if key in seen:
            continue
        seen.add(key)
        if k == annotations._FUNC:
            if x.__kwdefaults__:
                stack.append(x.__kwdefaults__)
            if x.__defaults__:
                stack.append(x.__defaults__)
            for cell in reversed(x.__closure__ or ()):
                # A cell is a container of its own (closures may share one): count it, and
                # follow it once, here as when met on the stack.
                key = id(cell)
                if containers is not None:
                    e = containers.get(key)
                    if e is None:
                        containers[key] = [cell, 1]
                    else:
                        e[1] += 1
                if key in seen:
                    continue
                seen.add(key)
                try:
                    y = cell.cell_contents
                except ValueError:      # empty cell
                    continue
                ky = kinds.get(type(y))
                if ky is None:
                    ky = annotations._kind(type(y))
                if ky != annotations._LEAF:         # a captured session, module or flag: nothing to walk
                    stack.append(y)
        elif k == annotations._SEQ or k == annotations._DICT:
            n = len(stack)
            for y in reversed(x.values() if k == annotations._DICT else x):
                ky = kinds.get(type(y))
                if ky is None:
                    ky = annotations._kind(type(y))
                if ky != annotations._LEAF:
                    stack.append(y)
            if containers is not None and len(stack) == n:
                bare.append(key)
        elif k == annotations._CELL:
            try:
                stack.append(x.cell_contents)
            except ValueError:      # empty cell
                pass
        elif k == annotations._SET:
            stack.extend(x)
        elif k == annotations._METHOD:
            stack.append(x.__func__)
            stack.append(x.__self__)
        elif k == annotations._PARTIAL:
            stack.extend((x.keywords, x.args, x.func))
        elif k == annotations._SKIP:
            continue
        else:
            # Instance attributes live in __dict__ or in slots (dataclasses included); a slot
            # is read through its own descriptor, so a property of the same name is not
            # mistaken for it.
            if t.__dictoffset__:
                d = getattr(x, "__dict__", None)
                if type(d) is dict:
                    stack.append(d)
            for descr in annotations._slots(t):
                try:
                    y = descr.__get__(x, t)
                except AttributeError:      # an unset slot
                    continue
                ky = kinds.get(type(y))
                if ky is None:
                    ky = annotations._kind(type(y))
                if ky != annotations._LEAF:             # a name, a number, None: nothing to walk
                    stack.append(y)
    for key in bare:
        del containers[key]




# --- structures ------------------------------------------------------------------------------

class Plain:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    def method(self):
        return self


class Slotted:
    __slots__ = ("a", "b", "__private")

    def __init__(self, a, b=None, private=None):
        self.a = a
        if b is not None:
            self.b = b                  # else: an unset slot
        self.__private = private


class SlotChild(Slotted):
    __slots__ = ("c",)

    def __init__(self, a, c):
        Slotted.__dict__["a"].__set__(self, a)      # the base's slot, under the property
        self.c = c

    @property
    def a(self):                        # a property hiding the base's slot of the same name
        return "not walked"


@dataclasses.dataclass(slots=True)
class Frozen:
    x: object
    y: object = None


Pair = namedtuple("Pair", "left right")


class ListChild(list):
    pass


def closure_over(*values):
    """A function whose closure captures values (one cell each) and has defaults."""
    a = values[0] if values else None
    b = values[1:] if len(values) > 1 else ()

    def f(k=a, *, kw=b):
        return a, b
    return f


def shared_cells(value):
    """Two closures sharing one cell."""
    def outer():
        v = value

        def g():
            return v

        def h():
            return v
        return g, h
    return outer()


def same_walk(*roots):
    """Both walks, in both modes, agree on what they find, its order and its counts; returns
    what the walk without containers found."""
    first = None
    for with_containers in (False, True):
        got_f, want_f = {}, {}
        got_c, want_c = ({}, {}) if with_containers else (None, None)
        annotations._walk(roots, got_f, got_c)
        reference_walk(roots, want_f, want_c)
        assert list(got_f) == list(want_f)
        for k in want_f:
            if with_containers:
                assert got_f[k][0] is want_f[k][0] and got_f[k][1] == want_f[k][1], k
            else:
                assert got_f[k] is want_f[k]
        if with_containers:
            assert list(got_c) == list(want_c)
            for k in want_c:
                assert got_c[k][0] is want_c[k][0] and got_c[k][1] == want_c[k][1], k
        first = got_f if first is None else first
    return first


@pytest.fixture
def m():
    with ca.Manager(fast="4MiB", slow="16MiB") as m:
        yield m


def test_every_kind_of_holder(m):
    a, b, c, d = (ca.asarray(np.full(3, i, np.float32), manager=m) for i in range(4))
    view = a[1:]
    freed = ca.asarray(np.ones(2, np.float32), manager=m)
    ca.unsafe_free(freed)
    od = OrderedDict(x=a, y=b, z=[c])
    od.move_to_end("x")                 # the walk follows the OrderedDict's own order
    g, h = shared_cells([d, a])
    obj = Plain(p=a, q=[b, view], r="text", s=3)
    roots = [
        [a, b, (c, d), {"k": view, "n": None}],
        od, Pair(a, [b, b]), ListChild([c, freed]),
        closure_over(a, b, c), g, h, obj.method, functools.partial(closure_over, d, x=[a]),
        {Plain(x=a), Plain(y=b)}, frozenset([Plain(z=c)]), Slotted(a), Slotted(a, b, private=[c]), SlotChild([d], c),
        Frozen(a, (b,)), obj, np.zeros(3), "s", 1.5, None, range(3), m,
    ]
    found = same_walk(*roots)
    assert len(found) == 5              # a (with its view), b, c, d and the freed one's object
    same_walk(roots)


def test_cycles_and_repeated_containers(m):
    a = ca.asarray(np.ones(4, np.float32), manager=m)
    loop = [a]
    loop.append(loop)
    d = {"self": None, "a": a}
    d["self"] = d
    p = Plain(a=a)
    p.me = p
    shared = [a]
    same_walk(loop, d, p, [shared, shared, (shared,)], shared)


def test_empty_cells_and_unset_slots(m):
    def make():
        def f():
            return later                # noqa: F821 - a cell that is still empty
        return f
    # a cell that is empty when walked
    def outer():
        def inner():
            return value
        cells = inner
        value = None
        del value
        return cells
    same_walk(outer(), Slotted(None), Frozen(None))


def test_errors_propagate_and_leave_nothing_behind(m):
    class Angry:
        __slots__ = ("x",)

    class Boom(Exception):
        pass

    class BadDescr:
        def __get__(self, obj, owner):
            raise Boom("no")

    a = ca.asarray(np.ones(2, np.float32), manager=m)
    angry = Angry()
    angry.x = a

    def kind_of(t):
        raise Boom("kind")

    with pytest.raises(Boom, match="kind"):
        ca._records.walk((object(),), {}, None, {}, kind_of, annotations._slots)
    slots = lambda t: (BadDescr(),)     # noqa: E731
    with pytest.raises(Boom, match="no"):
        ca._records.walk((angry,), {}, None, {}, annotations._kind, slots)
    with pytest.raises(TypeError, match="takes 6 arguments"):
        ca._records.walk((a,), {})
    with pytest.raises(TypeError, match="dicts"):
        ca._records.walk((a,), [], None, {}, annotations._kind, annotations._slots)
    found = {}
    annotations._walk((angry,), found)
    assert list(found.values()) == [a]


# --- random structures -------------------------------------------------------------------------

def _build(spec, arrays, pool):
    """Materialise a random holder spec over arrays (shared holders come from pool)."""
    kind, rest = spec[0], spec[1:]
    if kind == "array":
        return arrays[rest[0] % len(arrays)]
    if kind == "leaf":
        return [None, 3, "x", 2.5, np.zeros(2), range(2)][rest[0] % 6]
    if kind == "shared":
        return pool[rest[0] % len(pool)] if pool else None
    items = [_build(s, arrays, pool) for s in rest[0]]
    if kind == "list":
        out = list(items)
    elif kind == "tuple":
        out = tuple(items)
    elif kind == "dict":
        out = {i: v for i, v in enumerate(items)}
    elif kind == "closure":
        out = closure_over(*items)
    elif kind == "object":
        out = Plain(**{f"f{i}": v for i, v in enumerate(items)})
    elif kind == "slots":
        out = Slotted(items[0] if items else None, items[1] if len(items) > 1 else None,
                      items[2:] or None)
    elif kind == "partial":
        out = functools.partial(closure_over, *items, kw=items[:1])
    else:                               # a bound method of an object holding the items
        out = Plain(items=items).method
    pool.append(out)
    return out


_leafs = st.tuples(st.sampled_from(["array", "leaf", "shared"]), st.integers(0, 50))
_specs = st.recursive(
    _leafs,
    lambda inner: st.tuples(st.sampled_from(["list", "tuple", "dict", "closure", "object",
                                             "slots", "partial", "method"]),
                            st.lists(inner, max_size=4)),
    max_leaves=25)


@settings(max_examples=120, deadline=None)
@given(specs=st.lists(_specs, min_size=1, max_size=4), nfree=st.integers(0, 2))
def test_random_structures_walk_as_the_reference_does(specs, nfree):
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        arrays = [ca.asarray(np.full(2, i, np.float32), manager=m) for i in range(5)]
        arrays.append(arrays[0][1:])            # a view: the same object as arrays[0]
        for a in arrays[:nfree]:
            ca.unsafe_free(a) if not a.is_freed else None
        pool = []
        roots = [_build(s, arrays, pool) for s in specs]
        if pool:                                # and one cycle through a shared holder
            holder = pool[-1]
            if isinstance(holder, list):
                holder.append(roots)
        same_walk(*roots)
