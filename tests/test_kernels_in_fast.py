"""Kernels-in-fast mode: every kernel's operands are in fast memory when it runs (the GPU rule)."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import costmodel
from cachedarrays.manager import Observer
from cachedarrays.replay import evaluate

from helpers import layered_program

KIF = {"kernels_in_fast": True}


class OperandsInFast(Observer):
    """Records, for every kernel, whether all its operands were in fast memory as it began."""

    def __init__(self, m):
        self.m, self.seen = m, []

    def on_acquire(self, name, reads, writes, touched=None):
        self.seen.append(all(o.primary.device is self.m.fast for o in (*reads, *writes)))


def fast_only_result():
    with ca.Manager(fast="64MiB", slow="1MiB", policy="fastonly") as ref:
        return layered_program(ref)


@pytest.mark.parametrize("policy", ["lru", "sentinel"])
def test_every_kernel_runs_on_operands_in_fast_memory(policy):
    want = fast_only_result()
    with ca.Manager(fast="400KiB", slow="8MiB", policy=policy, policy_options=KIF) as m:
        seen = OperandsInFast(m)
        m.observe(seen)
        got = layered_program(m)
        m.check()
        faults = m.stats()["events"]["fault"]["count"]
    assert seen.seen and all(seen.seen)
    assert faults > 0                   # 4 arrays of 156 KiB + an accumulator in 400 KiB
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_without_the_mode_kernels_read_slow_memory_in_place():
    with ca.Manager(fast="400KiB", slow="8MiB", policy="firsttouch") as m:
        seen = OperandsInFast(m)
        m.observe(seen)
        layered_program(m)
        assert m.stats()["events"]["fault"]["count"] == 0
    assert not all(seen.seen)


def test_operands_that_cannot_fit_at_once_raise_out_of_memory_with_the_sizes():
    with ca.Manager(fast="200KiB", slow="8MiB", policy="lru", policy_options=KIF) as m:
        a = ca.zeros(20_000, manager=m)
        b = ca.zeros(20_000, manager=m)
        ca.evict(a)
        with pytest.raises(ca.OutOfMemoryError) as e:
            with ca.kernel("add_into", (a,), (b,)) as (x, y):
                y += x
        msg = str(e.value)
        assert "'add_into'" in msg and "156.2 KiB" in msg and "200.0 KiB" in msg
        assert "kernels_in_fast" in msg
        m.check()
        with ca.readable(b) as v:          # nothing was lost and the manager still works
            assert not v.any()


def test_a_policy_that_never_moves_data_cannot_make_room():
    with ca.Manager(fast="400KiB", slow="8MiB", policy="firsttouch", policy_options=KIF) as m:
        with pytest.raises(ca.OutOfMemoryError, match="FirstTouch policy could not make room"):
            layered_program(m)


def test_an_operand_pinned_in_slow_memory_by_an_open_scope_is_named():
    with ca.Manager(fast="1MiB", slow="8MiB", policy="lru", policy_options=KIF) as m:
        a = ca.zeros(1000, manager=m)
        b = ca.zeros(1000, manager=m)
        ca.evict(a)
        with ca.readable(a) as v:              # an access scope is a kernel too: staged
            assert ca.in_fast(a) and not v.any()
        ca.evict(a)
        m.pin(a._obj)                           # a pin that is not a kernel: not staged
        with pytest.raises(ca.PinnedError, match="close that scope"):
            with ca.kernel("k", (a,), (b,)):
                pass
        m.unpin(a._obj)
        with ca.kernel("k", (a,), (b,)) as (x, y):
            y[:] = x
        assert ca.in_fast(a)


@pytest.mark.parametrize("bad", ["yes", 1, None.__class__])
def test_the_option_takes_a_bool(bad):
    with pytest.raises(ValueError, match="kernels_in_fast"):
        ca.Manager(fast="1MiB", slow="1MiB", policy="lru", policy_options={"kernels_in_fast": bad})


def test_the_option_sets_the_switch_of_a_policy_instance_and_false_turns_it_off():
    from cachedarrays.policies import LRU
    p = LRU()
    with ca.Manager(fast="1MiB", slow="1MiB", policy=p, policy_options=KIF):
        assert p.kernels_in_fast
    with ca.Manager(fast="1MiB", slow="1MiB", policy="lru",
                    policy_options={"kernels_in_fast": False}) as m:
        assert not m.policy.kernels_in_fast


def test_faults_are_in_the_decision_log_and_a_replay_makes_the_same_decisions():
    with ca.Manager(fast="400KiB", slow="8MiB", policy="lru", policy_options=KIF) as m:
        with ca.trace(m) as t:
            layered_program(m)
        faults = m.stats()["events"]["fault"]["count"]
    logged = [d for d in t.decisions if d[0] == "fault"]
    assert len(logged) == faults > 0
    for i, d in enumerate(t.decisions):     # each fault: a synchronous fetch before the kernel
        if d[0] == "fault":
            nxt = next(j for j in range(i, len(t.decisions)) if t.decisions[j][0] == "kernel")
            assert any(c[0] == "copy" and c[1] == d[1] and c[4] == "fast" and c[7]
                       for c in t.decisions[i + 1:nxt])
    rep = ca.replay(t, "lru", fast="400KiB", slow="8MiB", policy_options=KIF)
    assert rep.decisions == t.decisions
    assert rep.result.total.faults == faults
    slow = ca.replay(t, "lru", fast="400KiB", slow="8MiB", policy_options=KIF,
                     fault_latency=45e-6)
    assert slow.result.total.time == pytest.approx(rep.result.total.time + faults * 45e-6,
                                                   rel=1e-12)
    assert evaluate(t, fault_latency=45e-6).result.total.time == \
        pytest.approx(slow.result.total.time, rel=1e-12)


def test_the_cost_model_charges_each_fault_its_latency_as_stall():
    d = [("alloc", "a", "fast", 0, 100), ("fault", "a"), ("kernel", 0, (("a", 100, "fast", False),)),
         ("step",), ("fault", "a"), ("fault", "a"), ("kernel", 0, ())]
    r = costmodel.evaluate([1.0], d, ["fast", "slow"], fault_latency=0.25)
    assert [s.faults for s in r.steps] == [1, 2]
    assert [s.stall for s in r.steps] == [0.25, 0.5]
    assert [s.time for s in r.steps] == [1.25, 1.5]
    assert costmodel.evaluate([1.0], d, ["fast", "slow"]).total.time == 2.0
    for bad in (-1.0, float("nan"), "45us", True):
        with pytest.raises(ValueError, match="fault_latency"):
            costmodel.evaluate([1.0], d, ["fast", "slow"], fault_latency=bad)
    with pytest.raises(ValueError, match="2 fields"):
        costmodel.evaluate([1.0], [("fault",)], ["fast", "slow"])


@pytest.mark.parametrize("policy", ["lru", "sentinel", "capuchin"])
def test_operands_that_split_fast_memory_move_aside_for_a_larger_one(policy):
    MiB = 1 << 20
    with ca.Manager(fast="8MiB", slow="64MiB", policy=policy, policy_options=KIF) as m:
        b = ca.full(5 * MiB // 8, 1.0, manager=m)
        ca.evict(b)
        p = ca.zeros(3 * MiB // 8, manager=m)
        a = ca.full(MiB // 8, 2.0, manager=m)         # in the middle of fast memory
        q = ca.zeros(7 * MiB // 16, manager=m)
        assert not ca.in_fast(b) and ca.in_fast(a)
        ca.unsafe_free(p, q)                          # free: 3 MiB below a, 4 MiB above
        assert m.fast.stats()["largest_free"] < 5 * MiB
        before = m.stats()["events"]
        with ca.kernel("add", (a,), (b,)) as (x, y):
            y[:x.size] += x
        after = m.stats()["events"]
        assert after["staging_aside"]["count"] - before["staging_aside"]["count"] == 1
        assert after["fault"]["count"] - before["fault"]["count"] == 2     # b, then a again
        assert ca.in_fast(a) and ca.in_fast(b)
        with ca.readable(b) as v:
            assert v[0] == 3.0 and v[-1] == 1.0
        m.check()


def test_no_registered_policy_replaces_the_private_helpers_of_staging():
    """Policy.stage calls these by name; a subclass defining a method of the same name (with
    another meaning) would silently break staging for that policy."""
    from cachedarrays.policies.base import Policy
    from cachedarrays.registry import policy_names, resolve
    helpers = ("_move_aside", "_stage_error", "_pinned_fast_bytes")
    for name in policy_names():
        cls = resolve(name)
        for h in helpers:
            assert getattr(cls, h) is getattr(Policy, h), (name, h)
