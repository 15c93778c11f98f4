"""Planning policies' common ground: one kernel clock per manager, the step profile, and a
PlannedPolicy that profiles a step, plans, and runs the plan in real runs and replays alike."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.policies.planned import PlannedPolicy
from cachedarrays.replay import evaluate
from cachedarrays.stepprofile import StepProfile
from cachedarrays.trace import KernelClock, Trace, TraceError
from helpers import beside_fast_only, layered_program


def _hand_trace():
    """Two steps. w lives throughout; per step: a is made, used by k0 (layer 0) and k1
    (layer 1), freed; b is made in layer 1 and freed there (short-lived)."""
    objects = {"w": 400, "a": 100, "b": 50, "a@1": 100, "b@1": 50}
    ev = [("alloc", "w", 400, None)]
    kernels, times = [], []
    for s, (a, b) in enumerate((("a", "b"), ("a@1", "b@1"))):
        k = len(kernels)
        kernels += [("k0", ("w",), (a,)), ("k1", (a, "w"), ()), ("k2", (a,), (b,)),
                    ("k3", (b,), ("w",))]
        times += [1.0, 2.0, 3.0, 4.0]
        ev += [("alloc", a, 100, None), ("kernel", k), ("end", k), ("layer",),
               ("kernel", k + 1), ("end", k + 1), ("alloc", b, 50, None), ("kernel", k + 2),
               ("end", k + 2), ("free", a), ("kernel", k + 3), ("end", k + 3), ("free", b),
               ("step",)]
    return Trace(objects, ev, kernels, times, devices=["fast", "slow"])


def test_step_profile_indexes_one_step_by_hand():
    t = _hand_trace()
    t.validate()
    p = StepProfile.of(t, 1)
    assert len(p) == 4 and p.layers == 2 and p.layer_of == [0, 1, 1, 1]
    assert p.layer_start == [0, 1]
    assert p.resident == ["w"] and p.persistent == ["w"] and p.survivors == ["w"]
    assert p.alloc_at == {"a@1": 0, "b@1": 2} and p.free_at == {"a@1": 3, "b@1": 4}
    assert [s for s, _, _ in p.allocs] == ["a@1", "b@1"]
    assert p.uses["w"] == [(0, False), (1, False), (3, True)]
    assert p.times == [1.0, 2.0, 3.0, 4.0] and p.compute() == 10.0
    assert p.layer_times() == [1.0, 9.0]
    # a@1 lives in layers 0..1; b@1 is made and freed in layer 1: short-lived
    assert not p.short_lived("a@1") and p.short_lived("b@1") and not p.short_lived("w")
    assert p.span("a@1") == (0, 1)
    assert p.next_use("w", 2) == 3 and p.next_use("a@1", 3) is None
    assert p.live_bytes() == [500, 500, 550, 450]         # w+a, w+a, w+a+b, w+b
    assert p.peak() == 550 and p.access_count("w") == 3
    assert p.written("w", 0, 3) is False and p.written("w") is True
    assert StepProfile.of(t, -1).step == 1


def test_step_profile_refuses_a_step_the_trace_lacks():
    with pytest.raises(TraceError, match="step 5 is not in the trace"):
        StepProfile.of(_hand_trace(), 5)
    with pytest.raises(TypeError, match="takes a Trace"):
        StepProfile([], 0)


def test_a_kernel_clock_model_replaces_the_wall_clock_and_a_forced_time_wins(m):
    x, y = ca.zeros(1000, manager=m), ca.zeros(500, manager=m)
    clock = KernelClock.of(m)
    clock.model = lambda name, reads, writes: \
        (len(name) + sum(o.nbytes for o in (*reads, *writes))) * 1e-3
    try:
        with ca.trace(m) as t:
            with ca.kernel("ab", (x,), (y,)):
                with ca.kernel("inner", (y,), ()):     # nested: the model, not the gap
                    pass
            clock.force_next(0.125)
            with ca.kernel("k", (x,), ()):
                pass
    finally:
        clock.model = None
    assert t.times == pytest.approx([(2 + 12000) * 1e-3, (5 + 4000) * 1e-3, 0.125])


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf"), "soon", None])
def test_a_kernel_clock_model_must_give_finite_seconds_and_the_manager_survives(m, bad):
    x = ca.zeros(100, manager=m)
    clock = KernelClock.of(m)
    with pytest.raises(TypeError, match="must be None or a function"):
        clock.model = 0.5
    clock.model = lambda name, reads, writes: bad
    try:
        with pytest.raises(ValueError, match="gave .* seconds for kernel 'k'.*finite number"):
            with ca.kernel("k", (x,), ()):
                pass
    finally:
        clock.model = None
    m.check()
    y = x + 1                                     # nothing is left pinned or half-recorded
    assert np.asarray(y)[0] == 1.0 and x.object._pins == 0


def test_one_kernel_clock_per_manager_and_replays_force_the_traced_times(m):
    assert KernelClock.of(m) is KernelClock.of(m)
    x = ca.zeros(1000, manager=m)
    with ca.trace(m) as t:
        for _ in range(2):
            with ca.kernel("k", (x,), ()):
                pass
            ca.mark_step(m)
    assert all(s >= 0 for s in t.times)
    seen = []

    class Timer(PlannedPolicy):
        def make_plan(self, step):
            seen.append(list(step.times))

    t.times = [0.25, 0.5]
    ca.replay(t, Timer(profile_step=0), fast=1 << 20)
    assert seen == [[0.25]]            # the replay's clock gave the profile the trace's time


class _AllFastAhead(PlannedPolicy):
    """Every allocation fast; the operands of kernel k+1 brought in at kernel k."""

    name = "test-all-fast-ahead"

    def make_plan(self, step):
        self.made = len(step.allocs)
        for i in range(len(step.allocs)):
            self.alloc_plan[i] = "fast"
        for k in range(len(step) - 1):
            for s in step.operands(k + 1):
                self.schedule(("kernel", k), lambda m, s=s: self.bring(s, force=True))


def test_planned_policy_profiles_plans_and_keeps_real_runs_equal_to_replays():
    pol = _AllFastAhead()
    t, m = beside_fast_only(pol, layered_program, "512KiB")
    assert pol.planned and pol.made == 1
    real = evaluate(t)
    run = ca.replay(t, _AllFastAhead(), fast=m.fast.size, slow=m.slow.size)
    assert run.decisions == t.decisions
    assert run.last.bytes_moved == real.last.bytes_moved > 0


def test_profile_given_plans_at_bind_and_validates_its_options():
    t = _hand_trace()
    p = _AllFastAhead(profile=t, profile_step=1)
    with ca.Manager(fast="1MiB", slow="1MiB", policy=p):
        assert p.planned and p.step.step == 1
    with pytest.raises(ValueError, match="profile_step"):
        _AllFastAhead(profile_step="1")
    with pytest.raises(TypeError, match="profile must be"):
        _AllFastAhead(profile=3)


def test_belady_victims_are_the_objects_used_furthest_ahead():
    """Fast memory holds two of three arrays; a plan that puts every allocation in fast memory
    must evict: the victim is the array whose next use is furthest away."""
    objects = {"x": 4096, "y": 4096, "z": 4096}
    ev = [("alloc", "x", 4096, None), ("alloc", "y", 4096, None)]
    kernels = []
    for s in range(3):
        k = len(kernels)
        kernels += [("kx", ("x",), ()), ("ky", ("y",), ()), ("kx2", ("x",), ())]
        ev += [("kernel", k), ("end", k), ("kernel", k + 1), ("end", k + 1),
               ("kernel", k + 2), ("end", k + 2), ("step",)]
    t = Trace(objects, ev, kernels, [1.0] * len(kernels), devices=["fast", "slow"])

    class Evicting(PlannedPolicy):
        def make_plan(self, step):
            # before kx2 (kernel 2), y is next used at the next step; x at kernel 2: keep x
            self.schedule(("kernel", 1), lambda m: self.seen.append(
                [self.ids.sid[o.id] for o in self.select_victims(1)]))
            self.seen = []

    pol = Evicting(profile=t, profile_step=0)
    ca.replay(t, pol, fast=3 * 4096 + 512)
    assert pol.seen and all(v[0] == "y" for v in pol.seen)
