"""Plans fire their actions at kernels, layers, uses and step marks of every step; the CA:LMP
lookahead built on them prefetches ahead of use and keeps real runs and replays identical."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.policies import LRU
from cachedarrays.triggers import Plan


def _program(m, steps=3, fired=None):
    """Two small kernels and a layer mark per step; arrays made before the first step."""
    a = ca.zeros(1000, manager=m)
    b = ca.ones(1000, manager=m)
    for _ in range(steps):
        h = ca.empty(1000, manager=m)
        with ca.kernel("first", (a,), (h,)) as (x, y):
            y[:] = x + 1
        ca.mark_layer(m)
        with ca.kernel("second", (h, b), (a,)) as (x, z, y):
            y[:] = x + z
        del h
        ca.mark_step(m)
    return a, b


def test_kernel_layer_step_points_fire_every_step(m):
    plan = Plan(m)
    seen = []
    plan.at(("kernel", 0), lambda mm: seen.append("k0"))
    plan.at(("kernel_end", 1), lambda mm: seen.append("end1"))
    plan.at(("layer", 0), lambda mm: seen.append("l0"))
    plan.at(("step",), lambda mm: seen.append("step"))
    _program(m, steps=2)
    assert seen == ["k0", "l0", "end1", "step"] * 2
    assert plan.fired == 8


def test_use_point_counts_uses_of_one_object_within_the_step(m):
    from cachedarrays.trace import StableIds

    plan = Plan(m)
    ids = StableIds.of(m)
    a = ca.zeros(10, manager=m)
    sid = ids.get(a._obj.id)
    hits = []
    plan.at(("use", sid, 2), lambda mm: hits.append(a.device))
    for _ in range(2):
        for _ in range(3):
            with ca.kernel("k", (a,), ()):
                pass
        ca.mark_step(m)
    assert len(hits) == 2                 # the second use of each step, once per step
    assert plan.live(sid) is a._obj


def test_an_action_can_prefetch_in_the_background_before_the_kernel(m):
    x = ca.asarray(np.arange(50_000.0), manager=m)
    ca.evict(x)
    policy = m.policy
    policy.schedule(("kernel", 1), lambda mm: policy.prefetch(x._obj, wait=False))
    y = ca.zeros(10, manager=m)
    for _ in range(2):
        with ca.kernel("other", (y,), ()):
            pass
        with ca.kernel("uses x", (x,), ()) as (v,):
            assert v[-1] == 49_999.0
        assert x.device == "fast"
        ca.evict(x)
        ca.mark_step(m)
    assert m.stats()["events"]["copy_async"]["count"] == 2


def test_bad_points_and_actions_are_refused(m):
    plan = Plan(m)
    for bad in [("kernel",), ("layer", 1, 2), ("use", "sid"), "step", ("later", 1)]:
        with pytest.raises(ValueError, match="plan point"):
            plan.at(bad, print)
    with pytest.raises(TypeError, match="callable"):
        plan.at(("step",), 3)
    with pytest.raises(ValueError, match="belong to a manager"):
        LRU().schedule(("step",), print)


def test_detached_plan_fires_nothing(m):
    plan = Plan(m)
    seen = []
    plan.at(("step",), lambda mm: seen.append(1))
    plan.detach()
    ca.mark_step(m)
    assert seen == []


def _lmp_trace(fast, lookahead):
    """A ResNet-like chain: forward makes activations, backward reads them in reverse."""
    m = ca.Manager(fast=fast, slow="64MiB", policy=LRU(lookahead=lookahead))
    with ca.trace(m) as t:
        w = [ca.ones(20_000, manager=m) for _ in range(6)]
        for _ in range(3):
            acts = []
            x = ca.ones(20_000, manager=m)
            for layer in w:
                ca.prefetch(x, layer, force=True)
                y = ca.empty(20_000, manager=m)
                with ca.kernel("fwd", (x, layer), (y,)) as (a, b, out):
                    np.multiply(a, b, out=out)
                acts.append(x)
                x = y
            for layer, a in zip(reversed(w), reversed(acts)):
                ca.prefetch(a, layer, force=True)
                with ca.kernel("bwd", (a, x), (layer,)) as (u, v, g):
                    g += 1e-9 * (u * v)
            del acts, x, y, a
            ca.mark_step(m)
    total = sum(float(v.sum()) for v in w)
    m.wait_copies()
    m.close()
    return t, total


def test_lookahead_real_run_and_replay_make_the_same_decisions():
    t, _ = _lmp_trace("400KiB", 2)
    run = ca.replay(t, LRU(lookahead=2), fast="400KiB", slow="64MiB")
    assert run.decisions == t.decisions
    assert any(d[0] == "copy" and d[-1] is False for d in t.decisions)  # background prefetches


def test_lookahead_keeps_results_exact():
    _, with_ahead = _lmp_trace("400KiB", 2)
    _, without = _lmp_trace("400KiB", 0)
    assert with_ahead == without


def test_lookahead_must_be_a_count():
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="lookahead"):
            LRU(lookahead=bad)
    assert LRU(preset="CA:LMP").lookahead == 4
    assert LRU(preset="CA:LM").lookahead == 0


@pytest.mark.parametrize("point, error", [
    (("kernel", -1), ValueError), (("kernel_end", -2), ValueError), (("layer", -1), ValueError),
    (("use", "w", 0), ValueError), (("kernel", 1.5), TypeError), (("kernel", True), TypeError),
    (("kernel", "0"), TypeError), (("layer", None), TypeError), (("use", "w", 1.0), TypeError)])
def test_a_plan_point_that_could_never_fire_is_refused(m, point, error):
    plan = Plan(m)
    with pytest.raises(error, match="plan point"):
        plan.at(point, lambda mm: None)
    assert not plan.actions

