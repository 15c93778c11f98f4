"""Policies and annotations against hostile use: every registered policy refuses a second
manager and a too-small manager with a clear error and stays usable; options that would be
ignored or misread are refused; the annotation decorators refuse what they cannot decorate and
leave their state as it was when the decorated function raises or runs in two threads."""

import threading

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.policies import G10, LRU, FastOnly
from cachedarrays.registry import resolve

POLICIES = ca.policy_names()


@pytest.mark.parametrize("name", POLICIES)
def test_a_policy_instance_serves_one_manager(name):
    p = resolve(name)()
    with ca.Manager(fast="256KiB", slow="1MiB", policy=p) as m:
        with pytest.raises(ValueError, match="already belongs to another manager"):
            ca.Manager(fast="256KiB", slow="1MiB", policy=p)
        a = ca.ones(1000, manager=m)
        assert float((a + 1).sum()) == 2000.0


@pytest.mark.parametrize("name", POLICIES)
def test_an_array_larger_than_the_manager_is_refused_and_the_manager_goes_on(name):
    with ca.Manager(fast="4KiB", slow="8KiB", policy=resolve(name)()) as m:
        with pytest.raises(ca.OutOfMemoryError, match="781.2 KiB"):
            ca.ones(100_000, manager=m)
        assert float(ca.ones(100, manager=m).sum()) == 100.0


def test_policy_options_for_a_policy_instance_are_refused_not_ignored():
    with pytest.raises(TypeError, match=r"policy_options \['preset'\] would be ignored"):
        ca.Manager(fast="64KiB", slow="1MiB", policy=LRU(), policy_options={"preset": "CA:LM"})
    with ca.Manager(fast="64KiB", slow="1MiB", policy=FastOnly(),
                    policy_options={"kernels_in_fast": True}) as m:
        assert m.policy.kernels_in_fast is True
    with ca.Manager(fast="64KiB", slow="1MiB", policy=LRU, policy_options={"preset": "CA:LM"}) as m:
        assert m.policy.writeback == 0.2


@pytest.mark.parametrize("make", [lambda v: LRU(local_alloc=v), lambda v: LRU(prefetch=v),
                                  lambda v: LRU(cleanup=v), lambda v: LRU(write_allocate=v),
                                  lambda v: G10(eager=v)])
def test_policy_switches_take_true_or_false_not_any_truthy_value(make):
    for bad in ("no", "False", None, 2, 0.5):
        with pytest.raises(ValueError, match="True or False"):
            make(bad)
    for good in (True, False, np.True_):
        make(good)


def test_annotate_without_parentheses_or_with_bad_switches_is_refused():
    with pytest.raises(TypeError, match=r"@ca.annotate\(\) or"):
        @ca.annotate
        def layer(x):
            return x
    with pytest.raises(TypeError, match="cleanup='yes' must be True or False"):
        ca.annotate(cleanup="yes")
    with pytest.raises(TypeError, match="decorates a function"):
        ca.noescape(3)
    with pytest.raises(TypeError, match="decorates a function"):
        ca.annotate()(None)


@pytest.mark.parametrize("op", [ca.prefetch, ca.evict, ca.softevict, ca.unsafe_free])
def test_a_number_passed_as_an_array_is_refused(m, op):
    x = ca.ones(10, manager=m)
    for bad in (1, 0.5, np.int64(1), True, np.True_):
        with pytest.raises(TypeError, match="positional arguments"):
            op(x, bad)
    assert not x.is_freed


def test_a_raising_decorated_function_leaves_the_scopes_as_they_were(m):
    @ca.noescape
    def inner(a):
        a * 2                                    # a temporary, then the failure
        raise RuntimeError("inner failed")

    @ca.noescape
    def outer(a):
        t = a + 1
        with pytest.raises(RuntimeError):
            inner(a)
        return t * 3

    a = ca.ones(100, manager=m)
    for _ in range(3):
        r = outer(a)
        assert float(r.sum()) == 600.0
    assert not a.is_freed
    live = {o.id for o in m.objects()}
    assert live == {a.object.id, r.object.id}


def test_annotated_layers_in_two_threads_keep_their_own_arrays(m):
    @ca.annotate(prefetch=True, softevict=True, cleanup=True, noescape=True)
    def layer(x, w):
        y = x * w

        def pullback(dy):
            return dy * w

        return y, pullback

    errors = []

    def work(k):
        try:
            w = ca.full(1000, float(k), manager=m)
            for _ in range(30):
                x = ca.ones(1000, manager=m)
                y, pb = layer(x, w)
                assert float(y.sum()) == 1000.0 * k
                assert float(pb(ca.ones(1000, manager=m)).sum()) == 1000.0 * k
        except Exception as e:            # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(k,)) for k in (2, 3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in ts)


def test_a_fraction_that_rounds_to_zero_bytes_is_refused_not_taken_for_none():
    m = ca.Manager(fast="1MiB", slow="8MiB", policy="fastonly")
    with ca.trace(m) as t:
        for _ in range(2):
            x = ca.ones(10_000, manager=m)
            with ca.kernel("k", (x,), (x,)) as (a, b):
                b += a
            del x
            ca.mark_step(m)
    m.close()
    for share in (1e-9, np.float32(1e-12)):
        with pytest.raises(ValueError, match="is 0 B, less than the smallest"):
            ca.replay(t, "lru", fast=share)
    assert ca.replay(t, "lru", fast=0.0).info["fast"] == 0
