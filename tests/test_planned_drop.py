"""Arrays made by ca.compute can be dropped under the planning policies: in a real run, and in
the replays of a trace, including the traces the policies build to try their own plans (the
profiled step repeated keeps its kernels recomputable and frees its own objects)."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.policies.planned import repeat_step

N = 4096                                    # 32 KiB of float64
PLANNING = ("sentinel", "autotm", "deeptm", "capuchin", "g10")


def double(xv, hv):
    np.multiply(xv, 2.0, out=hv)


def relu(hr, hw):
    np.maximum(hr, 0.5, out=hw)


def first(a):
    with ca.readable(a) as v:
        return float(v[0])


def drops_each_step(m, steps=4, free_at_mark=True):
    """Each step computes h from x with ca.compute kernels, drops it and reads it back; h is
    freed before the step mark, or (free_at_mark=False) in the next step."""
    x = ca.asarray(np.ones(N), manager=m)
    for _ in range(steps):
        h = ca.empty(N, manager=m)
        ca.compute("double", double, (x,), (h,))
        ca.compute("relu", relu, (h,), (h,))
        ca.drop(h)
        assert first(h) == 2.0                  # regenerated from its kernels
        if free_at_mark:
            del h
        ca.mark_step(m)
        if not free_at_mark:
            del h


@pytest.mark.parametrize("policy", PLANNING)
def test_a_dropped_compute_result_is_regenerated_under_a_planning_policy(make_manager, policy):
    m = make_manager(policy=policy)
    drops_each_step(m)
    assert m.stats()["events"]["drop"]["count"] >= 4


@pytest.mark.parametrize("policy", ["sentinel", "autotm"])
def test_a_step_may_free_the_array_the_step_before_dropped(make_manager, policy):
    m = make_manager(policy=policy)
    drops_each_step(m, free_at_mark=False)


def recorded(program, **options):
    m = ca.Manager(fast="1MiB", slow="16MiB", policy="lru")
    with m, ca.trace(m) as t:
        program(m, **options)
    return t


@pytest.mark.parametrize("policy", PLANNING)
@pytest.mark.parametrize("free_at_mark", [True, False])
def test_a_trace_that_drops_compute_results_replays_under_a_planning_policy(policy,
                                                                            free_at_mark):
    t = recorded(drops_each_step, steps=3, free_at_mark=free_at_mark)
    assert t.pure and any(e[0] == "drop" for e in t.events)
    run = ca.replay(t, policy, fast=256 << 10)
    assert run.stats["events"]["drop"]["count"] >= 3
    assert run.stats["events"]["regenerate"]["count"] >= 3


def test_the_repeated_step_keeps_its_kernels_recomputable():
    t = recorded(drops_each_step, steps=3)
    r = repeat_step(t, 1, times=2)
    r.validate()
    assert r.steps == 4
    profiled = t.step_kernels()[1]
    for again in (r.step_kernels()[2], r.step_kernels()[3]):
        assert [r.kernels[k][0] for k in again if k in r.pure] == ["double", "relu"]
        assert [k in r.pure for k in again] == [k in t.pure for k in profiled]
    assert r.pure >= t.pure


def writes_part_each_step(m, steps=3):
    """Each step computes both rows of y, then its top row again, and drops y."""
    x = ca.asarray(np.arange(N, dtype=np.float64), manager=m)
    for _ in range(steps):
        y = ca.empty((2, N), manager=m)
        ca.compute("both", lambda xv, o: np.multiply(xv, 3.0, out=o), (x,), (y,))
        ca.compute("top", lambda xv, o: np.multiply(xv, 2.0, out=o), (x,), (y[0],))
        ca.drop(y)
        del y
        ca.mark_step(m)


def test_the_repeated_step_keeps_its_writes_to_part_of_an_array():
    t = recorded(writes_part_each_step)
    (top,) = [k for k in t.step_kernels()[1] if t.kernels[k][0] == "top"]
    r = repeat_step(t, 1, times=2)
    for step in (2, 3):
        (again,) = [k for k in r.step_kernels()[step] if r.kernels[k][0] == "top"]
        assert again != top and r.partial[again] == t.partial[top]


def test_the_repeated_step_frees_its_own_arrays_not_those_of_the_first_step():
    t = recorded(drops_each_step, steps=3, free_at_mark=False)
    step1 = [e for e in t.events[t.events.index(("step",)) + 1:] if e[0] == "free"][0]
    assert step1[1].startswith("init:")         # the first step's h, freed in step 1
    r = repeat_step(t, 1, times=2)
    r.validate()
    h = [e[1] for e in r.events if e[0] == "alloc"][2]       # step 1's own h
    assert [e[1] for e in r.events if e[0] == "free"] == [step1[1], h, h]


def test_the_repeated_step_names_its_arrays_as_a_recording_would():
    def new_before_free(m, steps=4):
        x = ca.asarray(np.ones(N), manager=m)
        h = None
        for _ in range(steps):
            new = ca.empty(N, manager=m)
            ca.compute("double", double, (x,), (new,))
            h = new                              # the previous h is freed after the new one
            del new
            ca.mark_step(m)
        del h

    t = recorded(new_before_free)
    r = repeat_step(t, 2, times=2)
    r.validate()
    allocs = [e[1] for e in r.events if e[0] == "alloc"]  # x, then h of steps 0, 1, 2, ...
    assert allocs[2] != allocs[3]               # step 2's h is made while step 1's is live
    assert allocs[4:] == allocs[2:4]            # so the repeats alternate the two names
