"""Batch families: a program's trace at any batch from two recorded batches, and the largest
batch that trains in a fast memory budget (benchmarks/_capacity.py)."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.batching import BatchFamily, first_steps
from cachedarrays.trace import TraceError
from helpers import load_benchmark


# ---- a hand-made program: a weight, an activation, int8 labels and an odd-sized buffer ----------

def _odd(batch):
    return {2: 10, 4: 13}[batch]            # 1.5 bytes per sample: not a whole number


def hand_trace(batch, times, *, steps=2, rename=None, x_bytes=None):
    """Two steps of fwd (w, lbl -> x), grad (x -> odd), update (odd -> w) at this batch."""
    x = 24 * batch if x_bytes is None else x_bytes
    objects = {"w": 64, "x": x, "lbl": batch, "odd": _odd(batch)}
    events, kernels, ktimes, touched = [("alloc", "w", 64, "fast")], [], [], {}
    names = ["fwd", "grad", "update"]
    if rename:
        names = [rename.get(n, n) for n in names]
    ops = [(("w", "lbl"), ("x",)), (("x",), ("odd",)), (("odd",), ("w",))]
    for s in range(steps):
        events += [("alloc", "x", x, None), ("alloc", "lbl", batch, None),
                   ("alloc", "odd", _odd(batch), None)]
        for name, (r, w), t in zip(names, ops, times[s] if isinstance(times[0], list) else times):
            k = len(kernels)
            kernels.append((name, r, w))
            ktimes.append(t)
            events += [("kernel", k), ("end", k)]
            if name == "fwd":
                touched[k] = {"x": x // 2}
        events += [("free", "x"), ("free", "lbl"), ("free", "odd"), ("step",)]
    return ca.Trace(objects, events, kernels, ktimes, {"spec": {"batch": batch}},
                    devices=["fast", "slow"], touched=touched)


def hand_family():
    return BatchFamily(hand_trace(2, [1.0, 0.5, 0.2]), 2, hand_trace(4, [1.8, 0.3, 0.6]), 4)


def test_sizes_times_and_touches_are_linear_in_the_batch():
    t = hand_family().at(6)
    assert t.objects == {"w": 64, "x": 144, "lbl": 6, "odd": 16}
    assert [e[2] for e in t.events if e[0] == "alloc"] == [64] + [144, 6, 16] * 2
    assert t.touched == {0: {"x": 72}, 3: {"x": 72}}
    # fwd on its line; grad's line (falling: noise) is clamped at its smaller recorded time
    assert t.times == pytest.approx([2.6, 0.3, 1.0] * 2)
    assert t.kernels == hand_trace(2, [0, 0, 0]).kernels
    assert t.decisions == [] and t.meta["batch"] == 6 and t.meta["spec"] == {"batch": 6}
    t.validate()


def test_fractional_growth_rounds_to_the_nearest_element_and_small_batches_stay_positive():
    f = hand_family()
    assert f.at(3).objects["odd"] == 12             # 11.5 bytes, half up
    assert f.at(5).objects["odd"] == 15             # 14.5 bytes
    t = f.at(1)
    assert t.objects == {"w": 64, "x": 24, "lbl": 1, "odd": 9}
    # update's line reaches 0 at batch 1: half its time at batch 2 instead
    assert t.times[:3] == pytest.approx([0.6, 0.6, 0.1])
    assert all(x > 0 for x in t.times)


def test_the_recorded_batches_come_back_and_the_footprint_matches_the_trace():
    a, b = hand_trace(2, [1.0, 0.5, 0.2]), hand_trace(4, [1.8, 0.3, 0.6])
    f = BatchFamily(b, 4, a, 2)                     # either order
    assert f.batches == (2, 4)
    for batch, t in ((2, a), (4, b)):
        got = f.at(batch)
        assert (got.objects, got.events, got.times) == (t.objects, t.events, t.times)
    for batch in (1, 3, 7, 100):
        assert f.footprint(batch) == f.at(batch).footprint()
    assert f.footprint(100) == 64 + 2400 + 100 + 157
    assert f.operand_peak(100) == 64 + 100 + 2400


def test_noisy_times_of_several_steps_become_medians():
    a = hand_trace(2, [[9.0, 9.0, 9.0], [1.0, 0.5, 0.2], [3.0, 0.7, 0.2]], steps=3)
    b = hand_trace(4, [1.8, 0.3, 0.6], steps=3)
    t = BatchFamily(a, 2, b, 4).at(2)
    assert t.times == pytest.approx([2.0, 0.6, 0.2] * 3)   # the first step is left out
    raw = BatchFamily(a, 2, b, 4, median=False).at(2)
    assert raw.times[:3] == pytest.approx([9.0, 9.0, 9.0])


def test_first_steps_keeps_the_events_kernels_and_decisions_up_to_a_step_mark():
    t = hand_trace(2, [1.0, 0.5, 0.2], steps=3)
    t.decisions = [("kernel", 0, ()), ("step",), ("kernel", 3, ()), ("step",), ("step",)]
    t.pure = {0, 4}
    one = first_steps(t, 1)
    assert one.pure == {0}
    assert one.steps == 1 and len(one.kernels) == len(one.times) == 3
    assert one.events == t.events[:one.events.index(("step",)) + 1]
    assert one.decisions == [("kernel", 0, ()), ("step",)] and one.touched == {0: {"x": 24}}
    one.validate()
    assert first_steps(t, 3) is t and first_steps(t, 5) is t
    assert hand_family().at(6, steps=1).steps == 1
    with pytest.raises(ValueError, match="at least 1"):
        first_steps(t, 0)


@pytest.mark.parametrize("batch, error, match", [
    (0, ValueError, "at least 1"), (-3, ValueError, "at least 1"),
    (2.5, TypeError, "whole number"), ("8", TypeError, "whole number"),
    (True, TypeError, "whole number")])
def test_a_batch_is_a_positive_whole_number(batch, error, match):
    with pytest.raises(error, match=match):
        hand_family().at(batch)


@pytest.mark.parametrize("batch", [np.int64(6), np.uint16(6), np.float32(6.0), 6.0])
def test_numpy_integers_and_integral_floats_are_batches(batch):
    fam = hand_family()
    assert fam.at(batch).meta["batch"] == 6 and type(fam.at(batch).meta["batch"]) is int
    assert fam.sizes(batch) == fam.sizes(6)
    assert first_steps(hand_trace(2, [1.0, 0.5, 0.2]), np.int64(1)).steps == 1


def test_traces_of_different_programs_are_refused_naming_the_first_difference():
    a = hand_trace(2, [1.0, 0.5, 0.2])
    with pytest.raises(TraceError, match=r"kernel 1 is \('grad'.*\('backward'"):
        BatchFamily(a, 2, hand_trace(4, [1, 1, 1], rename={"grad": "backward"}), 4)
    with pytest.raises(TraceError, match=r"one has 27 events, the other 40 \(first extra: "
                                         r"event 27 \('alloc', 'x', 96"):
        BatchFamily(a, 2, hand_trace(4, [1, 1, 1], steps=3), 4)
    other = hand_trace(4, [1, 1, 1])
    other.kernels[0] = ("fwd", ("w",), ("x",))
    with pytest.raises(TraceError, match="kernel 0"):
        BatchFamily(a, 2, other, 4)
    pure = hand_trace(4, [1, 1, 1])
    pure.pure = {1}
    with pytest.raises(TraceError, match=r"kernel 1 is pure \(made by ca.compute\) in only one"):
        BatchFamily(a, 2, pure, 4)
    with pytest.raises(TraceError, match="object 'x': 48 bytes at batch 2 but 40 at batch 4"):
        BatchFamily(a, 2, hand_trace(4, [1, 1, 1], x_bytes=40), 4)
    with pytest.raises(ValueError, match="two different batch sizes"):
        BatchFamily(a, 2, a, 2)
    with pytest.raises(TypeError, match="two Traces"):
        BatchFamily(a, 2, "b.trace.gz", 4)


# ---- a recorded program ----------------------------------------------------------------------

def program(m, batch, steps=2):
    """Two weights, an activation of 1 KiB and one of 256 B per sample, four kernels a step."""
    w1 = ca.zeros(4096, manager=m)
    w2 = ca.zeros(4096, manager=m)
    for _ in range(steps):
        x = ca.zeros((batch, 128), manager=m)
        with ca.kernel("fwd1", (w1,), (x,)) as (w, out):
            out += w[:128]
        y = ca.zeros((batch, 32), manager=m)
        with ca.kernel("fwd2", (w2, x), (y,)) as (w, a, out):
            out += a[:, :32] + w[:32]
        with ca.kernel("upd1", (x,), (w1,)) as (a, out):
            out[:128] -= 1e-3 * a.sum(axis=0)
        with ca.kernel("upd2", (y,), (w2,)) as (a, out):
            out[:32] -= 1e-3 * a.sum(axis=0)
        del x, y
        ca.mark_step(m)


def recorded(batch):
    with ca.Manager(fast="4MiB", slow="1MiB", policy="fastonly") as m:
        with ca.trace(m) as t:
            program(m, batch)
    return t


@pytest.fixture(scope="module")
def family():
    return BatchFamily(recorded(2), 2, recorded(4), 4)


def test_a_recorded_program_at_a_third_batch_is_its_recording_at_that_batch(family):
    want, got = recorded(6), family.at(6)
    assert got.objects == want.objects and got.events == want.events
    assert got.kernels == want.kernels
    assert got.footprint() == want.footprint() == 2 * 32768 + 6 * (1024 + 256)
    ca.replay(got, "lru", fast="1MiB")      # it replays


# ---- the largest batch that trains ------------------------------------------------------------

@pytest.fixture(scope="module")
def capacity():
    return load_benchmark("_capacity")


def _fits(family, batch, policy, fast, options=None):
    try:
        ca.replay(family.at(batch, steps=2), policy, fast=fast, policy_options=options)
        return True
    except ca.OutOfMemoryError:
        return False


def test_max_batch_is_the_largest_batch_whose_replay_fits(capacity, family):
    fast = 96 << 10
    got, info = capacity.max_batch(family, "fastonly", fast)
    fits = [_fits(family, b, "fastonly", fast) for b in range(1, 40)]
    assert fits.index(False) == got > 0 and not any(fits[got:])
    assert info["batch"] == got and not info["capped"] and "does not fit" in info["error"]
    assert info["replays"] == len(info["tried"]) < 12
    assert info["footprint_batch"] == (fast - 2 * 32768) // 1280
    assert capacity.max_batch(family, "fastonly", fast, start=1)[0] == got   # deterministic


def test_kernels_in_fast_trains_larger_batches_than_fast_only(capacity, family):
    fast = 96 << 10
    only, _ = capacity.max_batch(family, "fastonly", fast)
    kif = {"kernels_in_fast": True}
    got, info = capacity.max_batch(family, "lru", fast, policy_options=kif)
    assert _fits(family, got, "lru", fast, kif) and not _fits(family, got + 1, "lru", fast, kif)
    # fwd2 holds w2, x and y at once: the largest operand set bounds it (heap blocks round
    # each operand up a little)
    assert got > only and family.operand_peak(got) <= fast < family.operand_peak(got + 2)
    assert "operands" in info["error"]
    assert capacity.step_ratio(family, got, "lru", fast, policy_options=kif) > 1.0
    assert capacity.step_ratio(family, 2, "lru", fast, policy_options=kif) == 1.0
    with pytest.raises(ca.OutOfMemoryError):
        capacity.step_ratio(family, got + 1, "lru", fast, policy_options=kif)


def test_a_policy_that_spills_stops_at_hi_and_factories_get_the_batch(capacity, family):
    got, info = capacity.max_batch(family, "lru", 96 << 10, hi=100)
    assert got == 100 and info["capped"] and info["error"] is None
    seen = []

    def factory(batch, trace):
        seen.append((batch, trace.meta["batch"], trace.steps))
        return ca.policies.FastOnly()
    assert capacity.max_batch(family, factory, 96 << 10)[0] == \
        capacity.max_batch(family, "fastonly", 96 << 10)[0]
    assert seen and all(b == tb and s == capacity.STEPS for b, tb, s in seen)


def test_max_batch_refuses_what_it_cannot_search(capacity, family):
    with pytest.raises(ValueError, match="fraction of the footprint"):
        capacity.max_batch(family, "lru", 0.5)
    with pytest.raises(TypeError, match="instance of its own"):
        capacity.max_batch(family, ca.policies.FastOnly(), 1 << 20)
    with pytest.raises(ValueError, match="unknown policy"):
        capacity.max_batch(family, "no-such-policy", 1 << 20)
    with pytest.raises(ValueError, match="pass them to it"):
        capacity.max_batch(family, lambda b, t: ca.policies.FastOnly(), 1 << 20,
                           policy_options={"preset": "CA:LM"})
    with pytest.raises(TypeError, match="BatchFamily"):
        capacity.max_batch(recorded(2), "lru", 1 << 20)
    assert capacity.max_batch(family, "fastonly", 32 << 10)[0] == 0    # the weights alone


@pytest.mark.parametrize("batch", [2**62 + 1, 10**400, 1e300])
def test_a_batch_no_memory_could_hold_is_refused_by_name(batch):
    f = hand_family()
    for call in (f.at, f.sizes, f.footprint, f.operand_peak):
        with pytest.raises(ValueError, match="more than 2\\*\\*62"):
            call(batch)
    with pytest.raises(ValueError, match="more than 2\\*\\*62"):
        first_steps(f.trace_b, batch)
