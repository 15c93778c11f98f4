"""A state machine mixing array ops, movement, views, frees and threads against a NumPy model."""

import threading

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import cachedarrays as ca

SIZES = st.sampled_from([0, 1, 7, 100, 700, 1500])


class ArrayMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "lru-nolocal", "firsttouch"]))
    def setup(self, policy):
        options = None
        if policy == "lru-nolocal":
            policy, options = "lru", {"local_alloc": False}
        self.m = ca.Manager(fast="32KiB", slow="2MiB", granularity=256, policy=policy,
                            policy_options=options)
        self.arrays = []          # (CachedArray, ndarray model)

    def teardown(self):
        self.arrays.clear()
        self.m.close()

    def pick(self, i):
        return self.arrays[i % len(self.arrays)] if self.arrays else None

    @rule(n=SIZES, seed=st.integers(0, 100))
    def create(self, n, seed):
        a = np.random.default_rng(seed).random(n)
        self.arrays.append((ca.asarray(a, manager=self.m), a.copy()))

    @rule(i=st.integers(0, 50), j=st.integers(0, 50), op=st.sampled_from(["+", "*", "-"]))
    def binary(self, i, j, op):
        x, y = self.pick(i), self.pick(j)
        if x is None or x[0].shape != y[0].shape:
            return
        f = {"+": np.add, "*": np.multiply, "-": np.subtract}[op]
        self.arrays.append((f(x[0], y[0]), f(x[1], y[1])))

    @rule(i=st.integers(0, 50), v=st.floats(-5, 5))
    def inplace(self, i, v):
        x = self.pick(i)
        if x is not None:
            x[0][...] += v
            x[1][...] += v

    @rule(i=st.integers(0, 50), start=st.integers(0, 10), step=st.integers(1, 3),
          v=st.floats(-5, 5))
    def write_through_view(self, i, start, step, v):
        x = self.pick(i)
        if x is None or x[0].size == 0:
            return
        view = x[0][start::step]
        view *= 0
        view += v
        x[1][start::step] = v

    @rule(i=st.integers(0, 50), what=st.sampled_from(["evict", "prefetch", "force",
                                                      "softevict"]))
    def move(self, i, what):
        x = self.pick(i)
        if x is None:
            return
        if what == "evict":
            ca.evict(x[0])
        elif what == "prefetch":
            ca.prefetch(x[0])
        elif what == "force":
            ca.prefetch(x[0], force=True)
        else:
            ca.softevict(x[0])

    @rule(i=st.integers(0, 50))
    def free(self, i):
        if self.arrays:
            x = self.arrays.pop(i % len(self.arrays))
            ca.unsafe_free(x[0])

    @rule(i=st.integers(0, 50))
    def drop(self, i):
        if self.arrays:
            self.arrays.pop(i % len(self.arrays))     # the garbage collector frees it

    @rule(i=st.integers(0, 50))
    def threaded_updates(self, i):
        x = self.pick(i)
        if x is None:
            return
        others = [a for a, _ in self.arrays[:4]]

        def evictor():
            for o in others:
                ca.evict(o)
                ca.prefetch(o, force=True)

        t = threading.Thread(target=evictor)
        t.start()
        for _ in range(3):
            x[0][...] += 1
        t.join()
        x[1][...] += 3

    @rule()
    def defrag(self):
        self.m.defrag("fast")

    @invariant()
    def values_and_heaps(self):
        if not hasattr(self, "m"):
            return
        for arr, model in self.arrays:
            np.testing.assert_allclose(np.asarray(arr), model, rtol=1e-12, atol=1e-12)
            assert arr.device in ("fast", "slow")
        self.m.check()
        for arr, _ in self.arrays:
            o = arr.object
            if "fast" in o.regions:      # the policy invariant
                assert o.primary is o.regions["fast"]


TestArrayMachine = ArrayMachine.TestCase
TestArrayMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
