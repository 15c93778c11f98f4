"""The seed systems' policies drive real training runs: the weights are bitwise those of a
fast-only run, and a real run's decisions (so its bytes moved) are those of its replay."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.models import cnn
from cachedarrays.replay import evaluate
from cachedarrays.registry import resolve
from helpers import beside_fast_only, layered_program, traced_training

TINY = dict(batch=2, image=16, channels=3, classes=10, width=8)
STEPS = 4           # the planning policies profile step 1 and run their plan in steps 2 and 3


def _train(setup, fast, name="resnet", depth=18, steps=STEPS):
    """(weights, trace of the whole run, manager sizes) of a run of setup."""
    _, t, m, weights = traced_training(setup, fast, steps, name, depth, TINY)
    return weights, t, (m.fast.size, m.slow.size)


@pytest.fixture(scope="module")
def reference():
    w, t, _ = _train("fast-only", "64MiB")
    return w, t.footprint()


@pytest.mark.parametrize("setup", cnn.PLANNED)
def test_a_seed_policy_trains_bitwise_like_fast_only_and_replays_its_own_run(setup, reference):
    ref, foot = reference
    w, t, (fast, slow) = _train(setup, int(foot * 0.25))
    for k in ref:
        assert np.array_equal(ref[k], w[k]), (setup, k)
    real = evaluate(t)
    assert real.last.bytes_moved > 0                       # the plan moved data
    run = ca.replay(t, setup, fast=fast, slow=slow)
    assert run.decisions == t.decisions, setup
    assert run.last.bytes_moved == real.last.bytes_moved
    assert run.result.total.bytes_moved == real.result.total.bytes_moved


def _foreign_trace():
    """Two steps of another program, with arrays larger than the run's whole slow memory."""
    big = 12 << 20
    objects = {"w": big, "a": big, "a@1": big}
    ev, kernels = [("alloc", "w", big, None)], []
    for a in ("a", "a@1"):
        k = len(kernels)
        kernels += [("make", ("w",), (a,)), ("use", (a,), ("w",))]
        ev += [("alloc", a, big, None), ("kernel", k), ("end", k), ("layer",), ("kernel", k + 1),
               ("end", k + 1), ("free", a), ("step",)]
    return ca.Trace(objects, ev, kernels, [1e-3] * len(kernels), devices=["fast", "slow"])


@pytest.mark.parametrize("setup", cnn.PLANNED)
def test_a_profile_of_another_program_plans_without_breaking_the_run(setup):
    """Nothing in the profile matches: the plan's actions find no live object, its allocation
    places are taken as given, and the data stays right."""
    policy = resolve(setup)(profile=_foreign_trace(), profile_step=1)
    t, m = beside_fast_only(policy, layered_program, "512KiB", slow="8MiB")
    assert policy.planned and t.steps == 4
