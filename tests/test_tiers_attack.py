"""Three-tier managers used carelessly: every policy spills below a full slow tier, bad tier
specs and profiles are refused at construction, replays name tiers a trace needs, and random
moves between any tiers keep every array's data."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import cachedarrays as ca
from cachedarrays.errors import OutOfMemoryError

# A slow tier too small for the program: the rest must go to the ssd tier.
SMALL_SLOW = [("dram", "256KiB"), ("pmem", "256KiB"), ("ssd", "8MiB")]
# Policies that keep every array in fast memory by design.
FAST_ONLY = {"fastonly", "fast-only", "checkpoint"}


def values(x):
    with ca.readable(x) as v:
        return v.copy()


def spill_program(m, n=12):
    """Arrays of 100 kB each, more than fast and slow memory hold together, used in turn."""
    xs = [ca.asarray(np.full(12500, i, np.float64), manager=m) for i in range(n)]
    for step in range(2):
        ca.mark_step()
        for x in xs:
            ca.mark_layer()
            y = x + 1
            del y
    return xs


@pytest.mark.parametrize("policy", sorted(set(ca.policy_names()) - FAST_ONLY))
def test_every_policy_spills_below_a_full_slow_tier(policy):
    """A two-tier policy on three tiers uses the slower tiers once slow memory is full."""
    with ca.Manager(tiers=SMALL_SLOW, policy=policy, granularity=256) as m:
        xs = spill_program(m)
        for i, x in enumerate(xs):
            assert (values(x) == i).all(), (policy, i, x.device)
        assert "ssd" in {x.device for x in xs}
        m.check()


@pytest.mark.parametrize("wait", [True, False])
def test_evict_without_a_target_goes_below_a_full_slow_tier(wait):
    with ca.Manager(tiers=SMALL_SLOW, granularity=256) as m:
        xs = [ca.asarray(np.full(12500, i, np.float64), manager=m) for i in range(4)]
        for x in xs:
            assert ca.in_fast(x) or x.device != "dram"
            ca.evict(x, wait=wait)
        assert [x.device for x in xs][:2] == ["pmem", "pmem"] and xs[-1].device == "ssd"
        for i, x in enumerate(xs):
            assert (values(x) == i).all()
        m.check()


def test_a_dropped_array_is_rebuilt_below_a_full_slow_tier():
    """Too large for fast memory, and slow memory is full: the rebuild goes to the ssd tier."""
    with ca.Manager(tiers=[("dram", "128KiB"), ("pmem", "256KiB"), ("ssd", "4MiB")],
                    granularity=256) as m:
        want = np.arange(20000.0)
        a = ca.asarray(want, manager=m)
        b = ca.empty_like(a)
        ca.compute("double", lambda x, o: np.multiply(x, 2, out=o), [a], [b])
        ca.drop(b)
        ca.evict(a, to="ssd")
        fill = ca.asarray(np.zeros(20000), manager=m, placement="slow")
        assert fill.device == "pmem" and not m.can_allocate("pmem", a.nbytes)
        ca.regenerate(b)
        assert b.device == "ssd"
        np.testing.assert_array_equal(values(b), want * 2)
        m.check()


def test_when_every_tier_is_full_the_error_names_each_and_the_fix():
    with ca.Manager(tiers=[("dram", "128KiB"), ("pmem", "128KiB"), ("ssd", "128KiB")],
                    granularity=256) as m:
        keep = [ca.asarray(np.ones(12500), manager=m) for _ in range(3)]
        with pytest.raises(OutOfMemoryError, match=r"'dram' has .*'pmem' has .*'ssd' has .*tiers="):
            ca.asarray(np.ones(12500), manager=m)
        for x in keep:
            assert (values(x) == 1).all()
        m.check()


@pytest.mark.parametrize("profile", ["warp-drive", 3, 1.5, b"dram", ("dram",)])
@pytest.mark.parametrize("how", ["spec", "device"])
def test_a_bad_profile_is_refused_before_anything_is_left_open(tmp_path, profile, how):
    before = ca.Manager.open_managers()
    if how == "spec":
        tiers = [("dram", "1MiB"), ("pmem", "1MiB", str(tmp_path), profile)]
    else:
        dev = ca.SlowDevice("1MiB", path=str(tmp_path / "pmem.heap"), name="pmem")
        dev.profile = profile
        tiers = [("dram", "1MiB"), dev]
    with pytest.raises(ValueError, match=r"tier 1 \('pmem'\): unknown profile .*nvme-ssd"):
        ca.Manager(tiers=tiers)
    assert ca.Manager.open_managers() == before
    if how == "device":                  # the caller's device stays open for a retry
        dev.profile = "optane"
        ca.Manager(tiers=tiers).close()
    assert os.listdir(tmp_path) == []


def test_a_profile_object_is_taken():
    fast = ca.costmodel.Profile("hbm", 800.0, 800.0)
    with ca.Manager(tiers=[("hbm", "1MiB", None, fast), ("dram", "1MiB", None, "dram")]) as m:
        assert m.tiers[0].profile is fast


@pytest.mark.parametrize("tiers", [
    {"dram": "1MiB", "pmem": "1MiB"},
    (t for t in [("dram", "1MiB"), ("pmem", "1MiB")]),
    {("dram", "1MiB"), ("pmem", "1MiB")},
    "dram,pmem",
])
def test_tiers_that_are_not_a_list_are_refused_by_what_they_are(tiers):
    with pytest.raises(ValueError, match=f"list of at least two tiers.*not {type(tiers).__name__}"):
        ca.Manager(tiers=tiers)


@pytest.mark.parametrize("how", ["spec", "device", "slow="])
def test_a_tier_name_that_would_split_a_link_name_is_refused(how):
    before = ca.Manager.open_managers()
    tier = ("p->m", "1MiB") if how == "spec" else ca.SlowDevice("1MiB", name="p->m")
    with pytest.raises(ValueError, match="'p->m' holds '->'"):
        if how == "slow=":
            ca.Manager(fast="1MiB", slow=tier)
        else:
            ca.Manager(tiers=[("dram", "1MiB"), tier])
    assert ca.Manager.open_managers() == before
    if how != "spec":
        tier.close()


def test_one_device_listed_twice_is_named_as_such():
    dev = ca.SlowDevice("1MiB", name="pmem")
    with pytest.raises(ValueError, match="listed twice"):
        ca.Manager(tiers=[("dram", "1MiB"), dev, dev])
    ca.Manager(tiers=[("dram", "1MiB"), dev]).close()


@pytest.fixture
def three_tier_trace():
    with ca.Manager(tiers=SMALL_SLOW) as m, ca.trace(m) as t:
        x = ca.asarray(np.ones(1000), manager=m)
        ca.evict(x, to="ssd")
        y = x + 1
        ca.evict(y, to="pmem")
        del x, y
    return t


@pytest.mark.parametrize("kw, missing", [
    (dict(fast=0.5, slow=2.0), "'pmem', 'ssd'"),
    (dict(tiers=[("dram", 0.5), ("pmem", 2.0)]), "'ssd'"),
    (dict(tiers=[("a", 0.5), ("b", 1.0), ("c", 2.0)]), "'pmem', 'ssd'"),
])
def test_a_replay_without_the_tiers_a_trace_moves_to_names_them(three_tier_trace, kw, missing):
    before = ca.Manager.open_managers()
    with pytest.raises(ValueError, match=f"to tier {missing} .*recorded on dram, pmem, ssd"):
        ca.replay(three_tier_trace, "lru", **kw)
    assert ca.Manager.open_managers() == before


def test_a_replay_with_the_tiers_named_or_more_runs(three_tier_trace):
    for tiers in (SMALL_SLOW, [*SMALL_SLOW, ("tape", "1GiB")]):
        run = ca.replay(three_tier_trace, "lru", tiers=tiers)
        assert run.info["footprint"] == three_tier_trace.footprint()


TIERS = ["dram", "pmem", "ssd", "fast", "slow"]


class TierMachine(RuleBasedStateMachine):
    """Random creation, writes, views and moves between any two tiers (waited for or not),
    checked against a NumPy model and the manager's invariants after every step."""

    @initialize(policy=st.sampled_from(["lru", "g10", "firsttouch"]))
    def setup(self, policy):
        self.m = ca.Manager(tiers=[("dram", "64KiB"), ("pmem", "64KiB"), ("ssd", "1MiB")],
                            policy=policy, granularity=256)
        self.arrays = []          # (CachedArray, ndarray model)

    def teardown(self):
        self.arrays.clear()
        self.m.close()

    def pick(self, i):
        return self.arrays[i % len(self.arrays)] if self.arrays else None

    def evict(self, x, to, wait=True):
        """ca.evict to a named tier; refused only when that tier has no room, and then x
        stays where it was."""
        where = x.device
        try:
            ca.evict(x, to=to, wait=wait)
        except OutOfMemoryError:
            assert not self.m.can_allocate(to, x.nbytes) and x.device == where

    @rule(n=st.sampled_from([0, 1, 100, 1500, 3000]), seed=st.integers(0, 50))
    def create(self, n, seed):
        a = np.random.default_rng(seed).random(n)
        self.arrays.append((ca.asarray(a, manager=self.m), a.copy()))

    @rule(i=st.integers(0, 50), to=st.sampled_from(TIERS), wait=st.booleans())
    def move(self, i, to, wait):
        x = self.pick(i)
        if x is None:
            return
        if to in ("dram", "fast"):
            ca.prefetch(x[0], wait=wait)
        else:
            self.evict(x[0], to, wait)

    @rule(i=st.integers(0, 50), v=st.floats(-5, 5), lo=st.integers(0, 40))
    def write_view(self, i, v, lo):
        x = self.pick(i)
        if x is not None:
            x[0][lo:lo + 20] += v
            x[1][lo:lo + 20] += v

    @rule(i=st.integers(0, 50), to=st.sampled_from(["pmem", "ssd"]))
    def move_with_scope_open(self, i, to):
        x = self.pick(i)
        if x is None:
            return
        with ca.writable(x[0]) as w:
            self.evict(x[0], to)        # pinned: stays where it is
            w[:1] = 9.0
            x[1][:1] = 9.0

    @rule(i=st.integers(0, 50), j=st.integers(0, 50))
    def add(self, i, j):
        x, y = self.pick(i), self.pick(j)
        if x is not None and x[0].shape == y[0].shape:
            self.arrays.append((x[0] + y[0], x[1] + y[1]))

    @rule(i=st.integers(0, 50), to=st.sampled_from(["pmem", "ssd"]))
    def drop_and_move_the_input(self, i, to):
        """A computed array is dropped and its input moved: its next read rebuilds it."""
        x = self.pick(i)
        if x is None:
            return
        b = ca.empty_like(x[0])
        ca.compute("negate", lambda a, o: np.negative(a, out=o), [x[0]], [b])
        ca.drop(b)
        self.evict(x[0], to)
        self.arrays.append((b, -x[1]))

    @rule(i=st.integers(0, 50))
    def free(self, i):
        if self.arrays:
            x, _ = self.arrays.pop(i % len(self.arrays))
            ca.unsafe_free(x)

    @invariant()
    def data_and_heaps(self):
        if not hasattr(self, "m"):
            return
        for x, model in self.arrays:
            np.testing.assert_array_equal(values(x), model)
        self.m.check()


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
