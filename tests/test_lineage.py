"""Lineage and recomputation: ca.compute records how an array was made, ca.drop lets its data
go, and its next use (or ca.regenerate) rebuilds it bitwise; versions, the reasons an array
cannot be rebuilt, traces (pure kernels, reruns in the decision log) and replays."""

import gc
import weakref

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.models import cnn
from cachedarrays.replay import evaluate
from cachedarrays.trace import TraceError

N = 512


def _manager(fast="1MiB", slow="16MiB", **kw):
    return ca.Manager(fast=fast, slow=slow, **kw)


def _read(a):
    with ca.readable(a) as v:
        return np.array(v)


def _square(x, y):
    np.multiply(x, x, out=y)


def _clip_in_place(x_read, x):
    np.minimum(x, 0.75, out=x)


def _noise(x, y, rng):
    np.add(x, rng.standard_normal(x.shape), out=y)


def _weighted_sum(a, b, out):
    np.add(a, 0.5 * b, out=out)
    out /= out.sum()


def _chain(m, seed=7):
    """a -> b (square) -> b (clip, in place) -> c (b + noise from an rng) -> d (b, c): the
    arrays and their values."""
    a = ca.asarray(np.random.default_rng(1).random(N), manager=m)
    b, c, d = (ca.empty(N, manager=m) for _ in range(3))
    ca.compute("square", _square, (a,), (b,))
    ca.compute("clip", _clip_in_place, (b,), (b,))
    ca.compute("noise", _noise, (b,), (c,), rng=np.random.default_rng(seed))
    ca.compute("weighted_sum", _weighted_sum, (b, c), (d,))
    return (a, b, c, d), [_read(x) for x in (a, b, c, d)]


# ---- regeneration is bitwise ---------------------------------------------------------------

def test_dropped_arrays_are_rebuilt_bitwise_at_their_next_use():
    with _manager() as m:
        (a, b, c, d), want = _chain(m)
        ca.drop(c, d)
        assert c.object.dropped and d.object.dropped and not ca.in_fast(d)
        assert m.stats()["devices"]["fast"]["current_bytes"] == 2 * N * 8    # only a and b
        np.testing.assert_array_equal(np.asarray(d), want[3])     # np.asarray: a kernel
        assert not d.object.dropped and not c.object.dropped      # c: rebuilt on the way
        np.testing.assert_array_equal(_read(c), want[2])
        ca.drop(c)
        np.testing.assert_array_equal(_read(c), want[2])           # ca.readable: a kernel
        ev = m.stats()["events"]
        assert ev["drop"]["count"] == 3 and ev["regenerate"]["count"] == 2


def test_regeneration_rebuilds_dropped_inputs_first_and_reruns_in_place_kernels():
    with _manager() as m:
        (a, b, c, d), want = _chain(m)
        ca.drop(b, c, d)                          # b: square then clip, in place
        assert m.regenerable(d.object)
        ca.regenerate(d)
        np.testing.assert_array_equal(_read(d), want[3])
        # b and c found room in fast memory without evicting anything: they stay
        assert not b.object.dropped and not c.object.dropped
        np.testing.assert_array_equal(_read(b), want[1])
        np.testing.assert_array_equal(_read(c), want[2])
        assert [x.object.version for x in (a, b, c, d)] == [0, 2, 1, 1]


def test_inputs_rebuilt_on_the_way_are_dropped_again_when_they_had_to_take_room():
    size = N * 8
    m = _manager(fast=f"{3 * size + 1024}B")    # room for about three of the arrays
    with m:
        (a, b, c, d), want = _chain(m)
        ca.drop(b, c, d)
        filler = ca.zeros(2 * N, manager=m)       # fast memory is now nearly full
        ca.regenerate(d)
        assert d.device == "fast"                 # the array asked for comes first
        again = [x for x in (b, c) if x.object.dropped]
        assert again                              # an input that had to evict: dropped again
        assert m.stats()["events"]["drop"]["count"] == 3 + len(again)
        for x, w in ((d, want[3]), (c, want[2]), (b, want[1])):
            np.testing.assert_array_equal(_read(x), w)
        assert _read(filler).sum() == 0


def test_a_kernel_with_two_outputs_rebuilds_one_without_touching_the_other():
    with _manager() as m:
        x = ca.asarray(np.arange(N, dtype=np.float64), manager=m)
        y, s = ca.empty(N, manager=m), ca.empty(N, manager=m)

        def split(xv, yv, sv):
            np.multiply(xv, 2.0, out=yv)
            np.subtract(xv, 1.0, out=sv)

        ca.compute("split", split, (x,), (y, s))
        want_s = _read(s)
        with ca.writable(y) as v:                 # y changes after the kernel (not a recipe)
            v[:] = -3.0
        ca.drop(s)
        np.testing.assert_array_equal(_read(s), want_s)
        np.testing.assert_array_equal(_read(y), np.full(N, -3.0))   # not overwritten


def test_both_outputs_dropped_are_rebuilt_by_one_rerun():
    with _manager() as m, ca.trace(m) as t:
        x = ca.asarray(np.arange(N, dtype=np.float64), manager=m)
        y, s = ca.empty(N, manager=m), ca.empty(N, manager=m)
        ca.compute("split", lambda xv, yv, sv: (np.multiply(xv, 2.0, out=yv),
                                               np.subtract(xv, 1.0, out=sv)), (x,), (y, s))
        want = _read(y), _read(s)
        ca.drop(y, s)
        ca.regenerate(y)
        assert not s.object.dropped               # rebuilt along (collective recomputation)
        np.testing.assert_array_equal(_read(y), want[0])
        np.testing.assert_array_equal(_read(s), want[1])
        k = t.kernels.index(next(k for k in t.kernels if k[0] == "split"))
        assert sum(1 for d in t.decisions if d[:2] == ("kernel", k)) == 2


def test_ufuncs_prefetch_and_pins_regenerate_a_dropped_array():
    with _manager() as m:
        (a, b, c, d), want = _chain(m)
        ca.drop(d)
        np.testing.assert_array_equal(_read(d + 1.0), want[3] + 1.0)
        ca.drop(d)
        ca.prefetch(d)
        assert ca.in_fast(d)
        ca.drop(d)
        m.pin(d.object)
        m.unpin(d.object)
        assert not d.object.dropped
        ca.drop(d)
        ca.evict(d)                               # nothing to move; it stays dropped
        assert d.object.dropped


# ---- versions and the reasons an array cannot be rebuilt -------------------------------------

def test_every_write_adds_one_to_the_version():
    with _manager() as m:
        x = ca.zeros(N, manager=m)
        assert x.object.version == 0
        ca.compute("fill", lambda o: o.fill(1.0), (), (x,))
        np.add(x, 1.0, out=x)
        x[3] = 7.0
        with ca.writable(x):
            pass
        _ = x + 1.0                               # a read
        assert x.object.version == 4


def test_an_input_changed_since_makes_its_dependants_not_regenerable():
    with _manager() as m:
        (a, b, c, d), _ = _chain(m)
        a[0] = 5.0
        why = m.why_not_regenerable(b.object)
        assert f"input object {a.object.id}" in why and "'square'" in why and "written" in why
        with pytest.raises(ca.RecomputeError, match=f"input object {a.object.id}"):
            ca.drop(b)
        assert m.regenerable(c.object)            # c's input b is unchanged


def test_a_freed_input_makes_its_dependants_not_regenerable():
    with _manager() as m:
        x = ca.asarray(np.ones(N), manager=m)
        y = ca.empty(N, manager=m)
        ca.compute("double", lambda xv, yv: np.multiply(xv, 2.0, out=yv), (x,), (y,))
        ca.unsafe_free(x)
        assert "was freed" in m.why_not_regenerable(y.object)
        with pytest.raises(ca.RecomputeError, match="freed"):
            ca.drop(y)


def test_a_write_without_a_recipe_breaks_the_lineage():
    with _manager() as m:
        x = ca.asarray(np.ones(N), manager=m)
        y = ca.empty(N, manager=m)
        ca.compute("double", lambda xv, yv: np.multiply(xv, 2.0, out=yv), (x,), (y,))
        with ca.kernel("scale", (), (y,)) as (v,):
            v *= 3.0
        assert "kernel 'scale'" in m.why_not_regenerable(y.object)
        with pytest.raises(ca.RecomputeError, match="'scale'.*not a ca.compute kernel"):
            ca.drop(y)
        assert "not made by a ca.compute kernel" in m.why_not_regenerable(x.object)
        z = ca.zeros(N, manager=m)                # an in-place update of created contents
        ca.compute("acc", lambda r, w: np.add(w, 1.0, out=w), (z,), (z,))
        assert "earlier contents" in m.why_not_regenerable(z.object)


def test_a_pinned_array_cannot_be_dropped_and_dropping_twice_is_harmless():
    with _manager() as m:
        (a, b, c, d), want = _chain(m)
        with ca.readable(d):
            with pytest.raises(ca.PinnedError, match="cannot drop"):
                ca.drop(d)
        assert m.drop(d.object) is True and m.drop(d.object) is False
        assert m.regenerate(d.object) is True and m.regenerate(d.object) is False
        np.testing.assert_array_equal(_read(d), want[3])


def test_a_dropped_array_can_be_freed_and_lineage_keeps_nothing_alive():
    with _manager() as m:
        (a, b, c, d), _ = _chain(m)
        ca.drop(d)
        ca.unsafe_free(d)
        assert d.is_freed
        x = ca.asarray(np.ones(N), manager=m)
        y = ca.empty(N, manager=m)
        ca.compute("double", lambda xv, yv: np.multiply(xv, 2.0, out=yv), (x,), (y,))
        ref = weakref.ref(x.object)
        del x
        gc.collect()
        assert ref() is None                      # the recipe holds ids, not arrays
        assert "was freed" in m.why_not_regenerable(y.object)
        m.check()


def test_inputs_of_a_dropped_array_outlive_their_arrays_and_a_change_rebuilds_it_first():
    with _manager() as m:
        x = ca.asarray(np.arange(N, dtype=np.float64), manager=m)
        y = ca.empty(N, manager=m)
        ca.compute("double", lambda xv, yv: np.multiply(xv, 2.0, out=yv), (x,), (y,))
        ca.drop(y)
        x[:] = 0.0                                # y's input changes: y is rebuilt first
        assert not y.object.dropped
        np.testing.assert_array_equal(_read(y), 2.0 * np.arange(N))
        ca.compute("double", lambda xv, yv: np.multiply(xv, 2.0, out=yv), (x,), (y,))
        ca.drop(y)
        del x
        gc.collect()                              # y still needs x: it stays alive
        np.testing.assert_array_equal(_read(y), np.zeros(N))


def test_compute_checks_its_arguments():
    with _manager() as m, _manager() as m2:
        x, y = ca.ones(4, manager=m), ca.ones(4, manager=m2)
        with pytest.raises(TypeError, match="callable"):
            ca.compute("k", None, (x,), ())
        with pytest.raises(ValueError, match="different managers"):
            ca.compute("k", lambda a, b: None, (x,), (y,))
        with pytest.raises(TypeError, match="Generator"):
            ca.compute("k", lambda a, rng: None, (x,), (), rng=np.random.RandomState(0))
        assert ca.compute("k", lambda a: float(a.sum()), (x,), ()) == 4.0
        with pytest.raises(TypeError, match=r"ca.compute: the first argument is the kernel's name"):
            ca.compute(lambda a: None, "k", (x,), ())       # fn and name swapped
        with pytest.raises(TypeError, match="takes CachedArrays"):
            ca.compute("k", lambda a: None, x, ())           # reads not a sequence of arrays


# ---- traces and replays ----------------------------------------------------------------------

class DropAtLayer(ca.policies.LRU):
    """LRU that, at every layer mark, drops each regenerable array of at least 4 KiB."""

    def on_layer(self):
        m = self.manager
        for r in m.regions_on("fast"):
            o = m.parent(r)
            if o is not None and o.nbytes >= 4096 and not m.pinned(o) and m.regenerable(o):
                m.drop(o)


def _program(m, steps=2):
    x = ca.asarray(np.random.default_rng(0).random(N), manager=m)
    for _ in range(steps):
        b = ca.empty(N, manager=m)
        ca.compute("square", _square, (x,), (b,))
        ca.mark_layer(m)                          # the policy drops b
        c = ca.empty(N, manager=m)
        ca.compute("noise", _noise, (b,), (c,), rng=np.random.default_rng(1))   # b rebuilt
        ca.mark_layer(m)                          # drops b and c
        d = ca.empty(N, manager=m)
        ca.compute("weighted_sum", _weighted_sum, (b, c), (d,))
        out = _read(d)
        ca.unsafe_free(b, c, d)
        ca.mark_step(m)
    return out


def test_a_traced_run_that_drops_and_regenerates_replays_with_the_same_decisions(tmp_path):
    fast, slow = 1 << 20, 16 << 20
    with ca.Manager(fast=fast, slow=slow, policy=DropAtLayer) as m:
        with ca.trace(m) as t:
            out = _program(m)
        assert m.stats()["events"]["drop"]["count"] >= 6
    with ca.Manager(fast=fast, slow=slow) as m:
        np.testing.assert_array_equal(_program(m), out)   # the same values without drops
    t = ca.Trace.load(t.save(tmp_path / "drops.trace.gz"))
    assert t.pure == set(range(len(t.kernels))) - {k for k, (n, _, _) in enumerate(t.kernels)
                                                   if n == "readable"}
    t.validate()
    events = [e for e in t.events if e[0] == "kernel"]
    assert len(events) == len(t.kernels)          # reruns add no kernel and no event
    decided = [d[1] for d in t.decisions if d[0] == "kernel"]
    reruns = [k for k in set(decided) if decided.count(k) > 1]
    assert reruns and all(t.kernels[k][0] in ("square", "noise") for k in reruns)
    rep = ca.replay(t, DropAtLayer, fast=fast, slow=slow)
    assert rep.decisions == t.decisions
    real = evaluate(t)
    assert real.result.total == rep.result.total
    # all in fast memory: each step's modelled time is its kernels' times, reruns included
    marks = [i for i, d in enumerate(t.decisions) if d == ("step",)]
    last = t.decisions[marks[-2] + 1:marks[-1]]
    charged = sum(t.times[d[1]] for d in last if d[0] == "kernel")
    assert real.last.time == pytest.approx(charged, rel=1e-9)
    assert charged > sum(t.times[k] for k in t.step_kernels()[-1])


def test_a_program_drop_is_an_event_a_replay_repeats():
    with _manager() as m, ca.trace(m) as t:
        (a, b, c, d), _ = _chain(m)
        ca.drop(d)
        ca.regenerate(d)
    t.validate()
    assert [e[0] for e in t.events if e[0] in ("drop", "regenerate")] == ["drop", "regenerate"]
    rep = ca.replay(t, "lru", fast=1 << 20, slow=16 << 20)
    assert rep.stats["events"]["drop"]["count"] == 1
    assert [d for d in rep.decisions if d[0] == "kernel"] == \
        [d for d in t.decisions if d[0] == "kernel"]


def test_a_replay_recipe_cannot_be_rerun_with_real_data():
    from cachedarrays.lineage import Recipe
    with _manager() as m:
        x, y = ca.ones(N, manager=m), ca.empty(N, manager=m)
        m.acquire([x.object], [y.object], "k", None, Recipe("k", None))
        m.release([x.object, y.object])
        assert "without its function" in m.why_not_regenerable(y.object)


# ---- the CNN models ----------------------------------------------------------------------------

class Dropper(ca.Observer):
    """Drops every regenerable operand of each kernel as soon as the kernel ends."""

    def __init__(self, m):
        self.m = m
        self.dropped = 0

    def on_release(self, objs):
        m = self.m
        for o in objs:
            if not o.freed and not o.dropped and not m.pinned(o) and m.regenerable(o):
                m.drop(o)
                self.dropped += 1


def _train(name, depth, drop, steps=2):
    model = cnn.build(name, depth, batch=2, image=8, classes=5, width=8)
    m, s = cnn.make_session("LM", fast="4MiB", slow="64MiB", backend="numpy")
    with m:
        model.init(s, seed=3)
        dropper = Dropper(m)
        if drop:
            m.observe(dropper)
        for i in range(steps):
            x, y = cnn.synthetic_batch(model, seed=i)
            cnn.train_step(s, model, x, y, cnn.SGD(0.05))
        return model.weights(), dropper.dropped, m.stats()["events"]


@pytest.mark.parametrize("name,depth", [("vgg", 11), ("resnet", 18), ("densenet", 121)])
def test_cnn_training_with_every_activation_dropped_gives_bitwise_the_same_weights(name, depth):
    # batch norm, in-place ReLU and residual adds, concatenations: every kernel but SGD's
    # update is a ca.compute one; weights (asarray, then SGD) are never regenerable
    want, _, _ = _train(name, depth, False)
    got, dropped, events = _train(name, depth, True)
    assert dropped > 50 and events["regenerate"]["count"] > 20
    for k in want:
        assert np.array_equal(want[k], got[k]), k


def test_a_trace_file_without_pure_kernels_loads_with_none(tmp_path):
    import gzip
    import json
    with _manager() as m, ca.trace(m) as t:
        _chain(m)
    assert len(t.pure) == 4
    t.save(tmp_path / "t.gz")
    doc = json.loads(gzip.decompress((tmp_path / "t.gz").read_bytes()))
    assert doc["pure"] == sorted(t.pure)
    del doc["pure"]                               # a file written before pure kernels existed
    (tmp_path / "old.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    old = ca.Trace.load(tmp_path / "old.gz")
    assert old.pure == set() and old.kernels == t.kernels
    t.pure.add(len(t.kernels))
    with pytest.raises(TraceError, match="pure"):
        t.validate()


def test_a_virtual_rerun_takes_the_recorded_kernel_time():
    from cachedarrays.lineage import Recipe
    from cachedarrays.trace import KernelClock
    with ca.Manager(fast="1MiB", slow="4MiB", virtual=True) as m:
        clock = KernelClock.of(m)
        x, y = m.new_pinned(4096), m.new_pinned(4096)
        m.release([x, y])
        clock.force_next(0.25)
        m.acquire([x], [y], "k", None, Recipe("k", None, seconds=0.25))
        m.release([x, y])
        m.drop(y)
        clock.force_next(0.5)                     # the next kernel's time, not the rerun's
        m.acquire([y], [], "next")
        assert clock.last() == 0.25               # the rerun (inside the acquire) ended last
        m.release([y])
        assert clock.last() == 0.5 and not y.dropped


def test_a_write_to_part_of_an_array_continues_its_lineage():
    with _manager() as m, ca.trace(m) as t:
        x = ca.asarray(np.arange(N, dtype=np.float64), manager=m)
        y = ca.empty((2, N), manager=m)
        ca.compute("top", lambda xv, o: np.multiply(xv, 2.0, out=o), (x,), (y[0],))
        assert m.regenerable(y.object) is False   # the bottom row was never written
        ca.compute("both", lambda xv, o: np.multiply(xv, 3.0, out=o), (x,), (y,))
        ca.compute("top", lambda xv, o: np.multiply(xv, 2.0, out=o), (x,), (y[0],))
        want = _read(y)
        assert m.regenerable(y.object)
        ca.drop(y)
        np.testing.assert_array_equal(_read(y), want)
        np.testing.assert_array_equal(want[1], 3.0 * np.arange(N))
    assert [t.kernels[k][0] for k in sorted(t.partial)] == ["top", "top"]
    rep = ca.replay(t, "lru", fast=1 << 20, slow=16 << 20)
    assert rep.decisions == t.decisions           # the replay rebuilt y the same way


def test_threads_reading_dropped_arrays_at_once_each_get_them_rebuilt_bitwise():
    import threading
    with _manager(fast="256KiB", slow="4MiB") as m:
        x = ca.asarray(np.arange(4000.0), manager=m)
        hs = [ca.empty(4000, manager=m) for _ in range(8)]
        for h in hs:
            ca.compute("square", _square, (x,), (h,))
            ca.drop(h)
        want, errors = np.arange(4000.0) ** 2, []

        def read(h):
            try:
                np.testing.assert_array_equal(_read(h), want)
            except BaseException as e:          # reported below, in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=read, args=(h,)) for h in hs for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert m.stats()["events"]["regenerate"]["count"] == 8
        m.check()


# ---- a state machine (also run by tests/stress.py) ----------------------------------------------

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant,  # noqa: E402
                                 precondition, rule)


def _scale(c):
    return lambda x, y: np.multiply(x, c, out=y)


def _bump(x_read, x):
    np.add(x, 1.0, out=x)


class LineageMachine(RuleBasedStateMachine):
    """Random arrays made by ca.compute from others, updated in place, written by plain NumPy
    calls (which break the lineage), dropped, rebuilt, moved and freed, in fast memory too small
    for all of them, with or without kernels-in-fast mode; after every step the heaps are sound
    and every array that holds data holds its expected values (dropped ones are checked when
    they are read, which rebuilds them)."""

    @initialize(in_fast=st.booleans())
    def setup(self, in_fast):
        self.m = ca.Manager(fast="24KiB", slow="1MiB", granularity=256,
                            policy_options={"kernels_in_fast": in_fast})
        self.model = {}           # name -> [CachedArray, expected ndarray]
        self.n = 0

    def teardown(self):
        for x, want in self.model.values():
            np.testing.assert_array_equal(_read(x), want)      # rebuilds the dropped ones
        self.m.check()
        self.m.close()

    def _pick(self, i):
        names = sorted(self.model)
        return self.model[names[i % len(names)]] if names else None

    def _add(self, x, want):
        self.n += 1
        self.model[f"a{self.n}"] = [x, want]

    @rule(size=st.integers(1, 600), value=st.integers(-4, 4))
    def new(self, size, value):
        if len(self.model) < 10:
            self._add(ca.full(size, float(value), manager=self.m), np.full(size, float(value)))

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99), c=st.sampled_from([0.5, 2.0, -1.0]))
    def derive(self, i, c):
        if len(self.model) >= 10:
            return
        x, want = self._pick(i)
        y = ca.empty(want.size, manager=self.m)
        ca.compute("scale", _scale(c), (x,), (y,))
        self._add(y, want * c)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99))
    def bump_in_place(self, i):
        entry = self._pick(i)
        ca.compute("bump", _bump, (entry[0],), (entry[0],))
        entry[1] = entry[1] + 1.0

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99))
    def numpy_write(self, i):
        entry = self._pick(i)
        entry[0] += 2.0
        entry[1] = entry[1] + 2.0

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99))
    def drop(self, i):
        x, _ = self._pick(i)
        if self.m.regenerable(x.object):
            ca.drop(x)
            assert x.object.dropped and not ca.in_fast(x)
        else:
            with pytest.raises(ca.RecomputeError):
                ca.drop(x)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99))
    def regenerate(self, i):
        x, _ = self._pick(i)
        if x.object.dropped:
            ca.regenerate(x)
            assert not x.object.dropped

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99), to_slow=st.booleans())
    def move(self, i, to_slow):
        x, _ = self._pick(i)
        (ca.evict if to_slow else ca.prefetch)(x)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99))
    def read(self, i):
        x, want = self._pick(i)
        np.testing.assert_array_equal(_read(x), want)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99), collect=st.booleans())
    def free(self, i, collect):
        names = sorted(self.model)
        x, _ = self.model.pop(names[i % len(names)])
        if collect:
            del x
            gc.collect()
        else:
            ca.unsafe_free(x)

    @invariant()
    def data_and_heaps(self):
        if not hasattr(self, "m"):
            return
        for x, want in self.model.values():
            if not x.object.dropped:
                np.testing.assert_array_equal(_read(x), want)
        self.m.check()


LineageMachine.TestCase.settings = settings(     # make stress runs it at length
    max_examples=12, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestLineageMachine = LineageMachine.TestCase
