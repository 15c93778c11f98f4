"""A state machine for views against a NumPy model: views of views, results and copies, views
kept past the scope that handed them out, and pins left by threads that ended.

After every step each array holds its model's data, reports NumPy's ``flags.owndata`` and the
same ``.base`` (the array that owns the memory, as the model's chain names its owner), every
kept scope view is read-only, and the heaps pass ``m.check()``.
"""

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import cachedarrays as ca
from cachedarrays import scopes
from cachedarrays.errors import UseAfterFreeError

INDEX = st.integers(0, 50)

# (name, the same view or copy on a CachedArray and on its model)
CHAINS = {
    "slice": lambda a: a[1::2],
    "row": lambda a: a[-1:],
    "T": lambda a: a.T,
    "reshape": lambda a: a.reshape(-1),       # a copy of non-contiguous data, as NumPy's
    "view": lambda a: a.view(),
    "newaxis": lambda a: a[None],
    "ellipsis": lambda a: a[...],
    "swapaxes": lambda a: a.swapaxes(0, -1),
    "copy": lambda a: a.copy(),
    "np.copy": lambda a: np.copy(a),
    "flatten": lambda a: a.flatten(),
    "result": lambda a: a + 1.0,
    "fancy": lambda a: a[[0]] if a.shape[0] else a[:0],
}

# the scopes that hand out writable views (see _kept_view)
SCOPES = ("writable", "access", "kernel", "compute")


def _kept_view(kind, a, v):
    """Write v through the writable view a scope of this kind hands out; return the view,
    kept past the scope's end."""
    if kind == "writable":
        with ca.writable(a) as w:
            w[...] = v
        return w
    if kind == "access":
        with ca.access((), (a,)) as views:
            views[0][...] = v
        return views[0]
    if kind == "kernel":
        with ca.kernel("fill", (), (a,)) as views:
            views[0][...] = v
        return views[0]
    kept = []

    def fill(out):
        out[...] = v
        kept.append(out)
    ca.compute("fill", fill, (), (a,))
    return kept[0]


class ViewsMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "firsttouch"]),
                path=st.sampled_from(["C", "Python"]))
    def setup(self, policy, path):
        """path "Python": ca.access, ca.kernel and ca.compute take their Python paths."""
        self.policy = policy
        self.restore = (scopes._compute_fast, scopes._kernel_enter)
        if path == "Python":
            scopes._compute_fast = scopes._kernel_enter = lambda *args: None
        self.m = ca.Manager(fast="32KiB", slow="2MiB", granularity=256, policy=policy)
        self.other = ca.Manager(fast="32KiB", slow="1MiB", granularity=256)
        self.arrays = []          # (CachedArray, model ndarray), owners and views alike
        self.owner_of = {}        # id(model owner) -> (its model, the CachedArray owning it)
        self.kept = []            # writable views the scopes that handed them out closed
        self.unpinned = []        # arrays a thread pinned before it ended

    def teardown(self):
        scopes._compute_fast, scopes._kernel_enter = self.restore
        self.arrays.clear()
        self.owner_of.clear()
        self.kept.clear()
        self.unpinned.clear()
        self.m.close()
        self.other.close()

    def pick(self, i, writable=False):
        arrays = [e for e in self.arrays if not writable or e[1].flags.writeable]
        return arrays[i % len(arrays)] if arrays else None

    def add(self, arr, model):
        """Track arr; a CachedArray that owns its object owns its model's memory."""
        if arr.base is None:
            owner = model if model.base is None else model.base
            self.owner_of[id(owner)] = (owner, arr)
        self.arrays.append((arr, model))

    @rule(rows=st.sampled_from([0, 1, 3, 8]), cols=st.sampled_from([1, 4, 30]),
          seed=st.integers(0, 100))
    def create(self, rows, cols, seed):
        a = np.random.default_rng(seed).random((rows, cols))
        self.add(ca.asarray(a, manager=self.m), a.copy())

    @rule(i=INDEX, how=st.sampled_from(sorted(CHAINS)))
    def derive(self, i, how):
        """A view of an array or of a view, or a new array made from one."""
        x = self.pick(i)
        if x is None:
            return
        f = CHAINS[how]
        got = f(x[0])
        assert isinstance(got, ca.CachedArray)
        self.add(got, f(x[1]))

    @rule(i=INDEX, v=st.floats(-5, 5))
    def write(self, i, v):
        """A write through an array or a view lands in every array sharing the memory."""
        x = self.pick(i, writable=True)
        if x is not None:
            x[0][...] += v
            x[1][...] += v

    @rule(i=INDEX, kind=st.sampled_from(SCOPES), v=st.floats(-5, 5))
    def keep_scope_view(self, i, kind, v):
        """A scope's writable view, written inside the scope and kept after it."""
        x = self.pick(i, writable=True)
        if x is None:
            return
        w = _kept_view(kind, x[0], v)
        x[1][...] = v
        assert not w.flags.writeable
        self.kept.append(w)

    @rule(i=INDEX, kind=st.sampled_from(["writable", "access", "kernel"]), v=st.floats(-5, 5))
    def keep_view_of_a_scope_another_thread_entered(self, i, kind, v):
        """A with-block entered on a thread that ended, written and exited here: its view
        becomes read-only all the same."""
        x = self.pick(i, writable=True)
        if x is None:
            return
        scope = {"writable": lambda a: ca.writable(a), "access": lambda a: ca.access((), (a,)),
                 "kernel": lambda a: ca.kernel("fill", (), (a,))}[kind](x[0])
        entered = []
        t = threading.Thread(target=lambda: entered.append(scope.__enter__()))
        t.start()
        t.join()
        w = entered[0] if kind == "writable" else entered[0][0]
        w[...] = v
        scope.__exit__(None, None, None)
        x[1][...] = v
        self.kept.append(w)

    @rule(k=INDEX, v=st.floats(-5, 5),
          how=st.sampled_from(["setitem", "iadd", "out", "setflags", "flags", "view"]))
    def write_through_kept_view(self, k, v, how):
        """A write through a view its scope no longer covers raises, and changes nothing; so
        does making it, or a view made from it now, writable again."""
        if not self.kept:
            return
        w = self.kept[k % len(self.kept)]
        if how in ("setflags", "flags", "view"):
            target = w[::-1] if how == "view" else w
            with pytest.raises(ValueError, match="WRITEABLE"):
                if how == "flags":
                    target.flags.writeable = True
                else:
                    target.setflags(write=True)
            return
        with pytest.raises(ValueError, match="read-only"):
            if how == "setitem":
                w[...] = v
            elif how == "iadd":
                w += v
            else:
                np.add(w, v, out=w)

    @rule(i=INDEX, what=st.sampled_from(["evict", "prefetch", "force", "softevict"]))
    def move(self, i, what):
        x = self.pick(i)
        if x is None:
            return
        {"evict": ca.evict, "prefetch": ca.prefetch, "softevict": ca.softevict,
         "force": lambda a: ca.prefetch(a, force=True)}[what](x[0])

    @rule(n=st.sampled_from([1500, 3500]))
    def fill_fast_memory(self, n):
        """A new array as big as most of fast memory: others leave it or it goes to slow."""
        a = np.full((n, 1), 0.25)
        self.add(ca.asarray(a, manager=self.m), a.copy())

    @rule(i=INDEX)
    def free(self, i):
        """unsafe_free an array that owns its object: it and every view of that object raise
        from then on."""
        x = self.pick(i)
        if x is None or x[0].base is not None:
            return
        obj = x[0].object
        gone = [e for e in self.arrays if e[0].object is obj]
        self.arrays = [e for e in self.arrays if e[0].object is not obj]
        ca.unsafe_free(x[0])
        for arr, _ in gone:
            with pytest.raises(UseAfterFreeError):
                arr + 1

    @rule(i=INDEX)
    def drop(self, i):
        if self.arrays:
            self.arrays.pop(i % len(self.arrays))

    @rule(i=INDEX)
    def pin_in_a_thread_that_ends(self, i):
        """A thread pins an array and ends without unpinning: the pin goes with it."""
        x = self.pick(i)
        if x is None:
            return
        obj = x[0].object
        t = threading.Thread(target=self.m.pin, args=(obj,))
        t.start()
        t.join()
        self.unpinned.append(x[0])

    @rule()
    def evict_what_ended_threads_pinned(self):
        """Arrays pinned by threads that ended move like any other."""
        for arr in self.unpinned:
            if arr.object.freed:
                continue
            ca.evict(arr)
            if self.policy == "lru":
                assert arr.device == "slow", f"object {arr.object.id} stayed pinned"
        self.unpinned.clear()

    @rule(i=INDEX, j=INDEX)
    def assign_from_another_manager(self, i, j):
        """x[...] = y with y on another manager copies y's values into x."""
        x, y = self.pick(i, writable=True), self.pick(j)
        if x is None or y is None:
            return
        try:
            np.broadcast_shapes(x[1].shape, y[1].shape)
            np.broadcast_to(y[1], x[1].shape)
        except ValueError:
            return
        src = ca.asarray(y[1], manager=self.other)
        x[0][...] = src
        x[1][...] = y[1]
        ca.unsafe_free(src)

    @rule(i=INDEX)
    def to_bytes(self, i):
        """bytes(x) and x.tobytes() are NumPy's (C order, for views too)."""
        x = self.pick(i)
        if x is not None:
            assert bytes(x[0]) == bytes(x[1])
            assert x[0].tobytes() == x[1].tobytes()

    @invariant()
    def data_ownership_and_heaps(self):
        if not hasattr(self, "m"):
            return
        for arr, model in self.arrays:
            np.testing.assert_array_equal(np.asarray(arr), model)
            owner = None if model.base is None else self.owner_of[id(model.base)][1]
            if owner is arr:           # NumPy's copy hides behind a view of it; ours is new
                owner = None
            assert arr.flags.owndata == (owner is None), (arr.shape, model.base is None)
            assert arr.base is owner
        for w in self.kept:
            assert not w.flags.writeable
        self.m.check()
        self.other.check()


TestViewsMachine = ViewsMachine.TestCase
TestViewsMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
