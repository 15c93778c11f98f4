"""G10: vitality analysis, Alg. 1 (best benefit/cost first, SSD by default, the middle tier when
the SSD link is busy), eager prefetch, wrapped weight periods, faults for what the plan misses,
staging that its own operands cannot block, and real three-tier runs equal to fast-only runs and
to their replays."""

import weakref

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.policies import G10, BaseUVM, FlashNeuron
from cachedarrays.policies.base import Policy
from cachedarrays.registry import policy_names
from cachedarrays.policies.g10 import Destination, G10Planner, Link, vitality
from cachedarrays.stepprofile import StepProfile
from cachedarrays.trace import KernelClock
from helpers import built_trace, layered_program

MB = 1_000_000
SSD = Destination("ssd", 1e9, 1e9, 0.0)           # 1 ms per MB each way
MID = Destination("pmem", 10e9, 10e9, 0.0, capacity=10 * MB)


def build(objects, resident, items, steps=2):
    return built_trace(objects, resident, items, steps, devices=("fast", "slow", "ssd"))


def test_vitality_periods_inner_tail_and_wrapped():
    objs = {"W": 4 * MB, "A": 2 * MB}
    items = [("a", "A"), ("k", ["W"], ["A"], 0.01), ("k", [], [], 0.02),
             ("k", ["A"], [], 0.01), ("k", [], [], 0.01), ("k", [], [], 0.01), ("f", "A"),
             ("k", ["W"], [], 0.01), ("k", [], [], 0.01)]
    step = StepProfile.of(build(objs, ["W"], items), 1)
    got = {(p.sid, p.last, p.next, p.wraps, tuple(p.kernels)) for p in vitality(step)}
    assert got == {("W", 0, 5, False, (1, 2, 3, 4)),          # between its two uses
                   ("W", 5, 0, True, (6,)),                    # wraps into the next step
                   ("A", 0, 2, False, (1,)),
                   ("A", 2, None, False, (3, 4))}              # used last, freed later


def _pressure_trace():
    """B (3 MB) idle from k1 to k4, C (3 MB) idle over k1..k2; the live bytes peak at k2
    (10 MB). Kernels start at 0, 1, 7, 9, 11, 15 ms."""
    objs = {"B": 3 * MB, "C": 3 * MB, "D": 4 * MB}
    items = [("a", "B"), ("a", "C"), ("k", ["B", "C"], [], 0.001),
             ("k", [], [], 0.006), ("a", "D"), ("k", [], ["D"], 0.002), ("f", "D"),
             ("k", ["C"], [], 0.002), ("k", [], [], 0.004), ("k", ["B"], [], 0.001),
             ("f", "B"), ("f", "C")]
    return StepProfile.of(build(objs, [], items), 1)


def test_the_period_with_the_best_benefit_per_cost_is_evicted_first():
    step = _pressure_trace()
    assert step.live_bytes() == [6 * MB, 6 * MB, 10 * MB, 6 * MB, 6 * MB, 6 * MB]
    pl = G10Planner(step, 7 * MB, SSD, eager=False).run()
    # Over capacity by 3 MB at k2 only. C's prefetch must be issued by k2 (its use is k3), so
    # evicting C cannot help; B is written out by 4 ms (before k2) and read back from 12 ms,
    # issued before k4: out over k2 and k3.
    assert [(p.sid, p.tier) for p in pl.plan] == [("B", "ssd")]
    assert pl.info["predicted_peak"] <= 7 * MB
    assert pl.plan[0].evicted_kernels().tolist() == [2, 3]


def test_benefit_over_cost_prefers_the_cheaper_of_equal_areas():
    step = _pressure_trace()
    pl = G10Planner(step, 7 * MB, SSD, eager=False)
    (b,) = [p for p in vitality(step) if p.sid == "B"]
    big = [p for p in vitality(step) if p.sid == "B"][0]
    big.size = 6 * MB                # the same area above capacity (3 MB at k2), 2x the traffic
    k2 = np.array([2])
    assert pl.benefit(b, k2) == pytest.approx(pl.benefit(big, k2)) == pytest.approx(3 * MB * 0.002)
    assert pl.benefit(big) / pl.cost(big) < pl.benefit(b) / pl.cost(b)


def test_the_middle_tier_takes_an_eviction_when_the_ssd_link_is_busy():
    step = _pressure_trace()
    pl = G10Planner(step, 7 * MB, SSD, MID, eager=False)
    pl.links["ssd"][0].book(0.0005, 0.0025)        # the SSD write link is busy at k0's end
    pl.run()
    assert [(p.sid, p.tier) for p in pl.plan] == [("B", "pmem")]
    assert pl.info["tiers"] == {"pmem": {"periods": 1, "bytes": 3 * MB}}
    full = G10Planner(step, 7 * MB, SSD, Destination("pmem", 10e9, 10e9, 0.0, 2 * MB),
                      eager=False)
    full.links["ssd"][0].book(0.0005, 0.0025)      # busy, and no room in the middle tier:
    full.run()                                     # the SSD, later (written 3..6 ms)
    assert [p.tier for p in full.plan] == ["ssd"]


def test_eager_prefetch_moves_a_prefetch_to_the_earliest_kernel_it_fits():
    objs = {"X": 2 * MB, "Y": 5 * MB}
    items = [("a", "X"), ("k", ["X"], [], 0.001)] + [("k", [], [], 0.001)] * 6 + \
        [("a", "Y"), ("k", [], ["Y"], 0.001), ("f", "Y")] + [("k", [], [], 0.001)] * 8 + \
        [("k", ["X"], [], 0.001), ("f", "X")]
    step = StepProfile.of(build(objs, [], items), 1)
    fast = Destination("ssd", 10e9, 10e9, 0.0)     # 0.2 ms each way
    late = G10Planner(step, 6 * MB, fast, eager=False).run().plan[0]
    eager = G10Planner(step, 6 * MB, fast).run().plan[0]
    # Latest safe: issued before k15 (X's use at 16 ms, 0.2 ms to read); eager: as soon as Y
    # (k7) is freed, before k8.
    assert late.prefetch_kernel() == 15 and eager.prefetch_kernel() == 8
    assert eager.evicted_kernels().tolist() == [2, 3, 4, 5, 6, 7]      # written out by k2
    assert late.evicted_kernels().tolist() == list(range(2, 15))


def test_a_weight_period_wraps_and_its_prefetch_is_at_the_end_of_the_step():
    objs = {"W": 4 * MB, "A": 4 * MB}
    items = [("k", ["W"], [], 0.001), ("a", "A")] + [("k", [], ["A"], 0.001)] * 6 + \
        [("f", "A"), ("k", [], [], 0.010), ("k", [], [], 0.001)]
    step = StepProfile.of(build(objs, ["W"], items), 1)
    pl = G10Planner(step, 6 * MB, SSD, eager=False).run()
    (w,) = pl.plan
    # W is used at k0 only: out after k0, back before k0 of the next step: 4 ms on the link,
    # so it is issued before the step's last kernel (k8), which ends 1 ms before k0.
    assert w.wraps and w.prefetch_kernel() == 7
    with ca.Manager(tiers=[("dram", 6 * MB), ("ssd", "64MiB")], virtual=True,
                    policy=G10(profile=step, headroom=0.0)) as m:
        p = m.policy
        assert ("kernel", 7) in p.plan.actions and ("kernel_end", 0) in p.plan.actions


def test_faults_count_the_uses_a_plan_missed():
    t = build({"a": 600_000, "b": 600_000, "c": 600_000}, ["a", "b", "c"],
              [("k", ["a"], [], 1e-3), ("k", ["b"], [], 1e-3), ("k", ["c"], [], 1e-3)], steps=3)
    tiers = [("dram", "1300KiB"), ("ssd", "8MiB", None, "nvme-ssd")]
    uvm = ca.replay(t, "uvm", tiers=tiers, fault_latency=45e-6)
    assert uvm.last.faults == 3                    # LRU over a cycle of three: all miss
    assert uvm.last.stall >= 3 * 45e-6
    g = ca.replay(t, "g10", tiers=tiers, fault_latency=45e-6,
                  policy_options={"headroom": 0.0})
    assert g.last.faults < uvm.last.faults and g.last.time < uvm.last.time


def test_link_timeline_wraps_and_finds_gaps():
    link = Link(10.0)
    link.book(9.0, 2.0)                            # 9..10 and 0..1
    assert link.busy_in(0.0, 10.0) == pytest.approx(2.0)
    assert link.earliest(9.5, 1.0) == pytest.approx(11.0)
    assert link.latest(12.0, 1.0, 0.0) == pytest.approx(11.0)
    assert link.latest(11.0, 1.0, 5.0) == pytest.approx(8.0)


def _three_tiers(tmp_path, fast):
    return [("dram", fast), ("pmem", "2MiB", str(tmp_path)), ("ssd", "8MiB", str(tmp_path))]


@pytest.mark.parametrize("policy", ["g10", "uvm", "flashneuron"])
def test_real_three_tier_runs_equal_fast_only_and_their_replays(tmp_path, policy):
    def program(m):
        return layered_program(m, n=30_000, arrays=4)

    with ca.Manager(fast="64MiB", slow="1MiB", policy="fastonly") as ref:
        want = program(ref)
    with ca.Manager(tiers=_three_tiers(tmp_path, "700KiB"), policy=policy) as m:
        # kernel times from the bytes each touches: the plan does not move with the load
        KernelClock.of(m).model = lambda name, reads, writes: \
            2e-6 + sum(o.nbytes for o in (*reads, *writes)) / 10e9
        with ca.trace(m) as t:
            got = program(m)
        m.wait_copies()
        m.check()
        sizes = [(d.name, d.size) for d in m.tiers]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert sum(v["bytes"] for v in m.stats()["moved"].values()) > 0
    run = ca.replay(t, policy, tiers=[(n, s, None, p) for (n, s), p in
                                      zip(sizes, ("dram", "optane", "nvme-ssd"))])
    assert any(d[0] == "alloc" and d[2] == "pmem" for d in t.decisions)    # the middle tier
    assert run.decisions == t.decisions                                    # is used


@pytest.mark.parametrize("policy", policy_names())
def test_no_policy_keeps_an_array_the_program_dropped_alive(tmp_path, policy):
    """A policy that held its objects (an LRU order of objects, not ids) would keep dropped
    arrays in memory until it evicts them, and free them inside a later allocation, where the
    replay of the trace cannot (its real run and replay would differ)."""
    with ca.Manager(tiers=_three_tiers(tmp_path, "2MiB"), policy=policy) as m:
        ws = [ca.asarray(np.full(30_000, float(i)), manager=m) for i in range(3)]
        for w in ws:
            with ca.kernel("use", (w,), (ws[0],)) as (a, out):
                out += a
        refs = [weakref.ref(w.object) for w in ws]
        del ws, w, a, out
        assert [r() for r in refs] == [None] * 3


@pytest.mark.parametrize("policy", ["g10", "uvm", "flashneuron"])
def test_staging_moves_the_kernels_own_operands_out_of_the_way(policy):
    """Fast memory (10 MiB) has 8 MiB free, but operand a sits in the middle and a prefetch
    of another object is in flight after it: the 6 MiB operand b finds no block until a moves
    aside and comes back (a fault)."""
    MiB = 1 << 20
    with ca.Manager(tiers=[("dram", "10MiB"), ("pmem", "4MiB"), ("ssd", "64MiB")],
                    virtual=True, policy=policy) as m:
        def new(n):
            o = m.new_pinned(n)
            m.release((o,))
            return o

        b, c = new(6 * MiB), new(MiB)
        m.evict(b, "ssd")
        m.evict(c, "pmem")
        f1, a, f2 = new(4 * MiB), new(MiB), new(2 * MiB)
        assert Policy.prefetch(m.policy, c, wait=False)        # in flight, after f2
        m.free_object(f1)
        m.free_object(f2)
        assert [m.parent(r) for r in m.regions_on("dram")] == [a, c]
        assert not m.can_allocate(m.fast, 6 * MiB)
        m.acquire([a, b], [], "k")
        try:
            assert a.primary.device is b.primary.device is m.fast
        finally:
            m.release([a, b])
        ev = m.stats()["events"]
        assert ev["staging_aside"]["bytes"] == MiB and ev["fault"]["count"] == 2
        with pytest.raises(ca.OutOfMemoryError, match="do not fit at once"):
            m.acquire([a, b, new(4 * MiB)], [], "too_big")


def test_flashneuron_offloads_intermediates_across_the_turn_only():
    step = _pressure_trace()
    fn = FlashNeuron(profile=step)
    with ca.Manager(tiers=[("dram", "16MiB"), ("ssd", "64MiB")], virtual=True, policy=fn):
        assert fn.turn(step) == 2
        assert sorted(s for s, _, _ in fn.offloads(step)) == ["B", "C"]
        assert fn.info["offloaded"] == 2


def test_options_and_tiers_are_checked():
    with pytest.raises(ValueError, match="headroom"):
        G10(headroom=1.5)
    assert isinstance(ca.Manager(tiers=[("dram", "1MiB"), ("ssd", "1MiB")], virtual=True,
                                 policy="uvm").policy, BaseUVM)
