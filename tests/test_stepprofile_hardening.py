"""StepProfile's step: an integer (or an integral float) indexes the trace's steps; anything
else (a fraction, a bool, a string, None) is a TypeError naming it, never an empty profile."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.stepprofile import StepProfile


@pytest.fixture
def trace(m):
    with ca.trace(m) as t:
        x = ca.asarray(np.ones(64), manager=m)
        for _ in range(3):
            y = x + 1
            ca.mark_layer(m)
            z = y * 2
            del y, z
            ca.mark_step(m)
    return t


@pytest.mark.parametrize("step,want", [(1, 1), (-1, 2), (np.int64(1), 1), (1.0, 1)])
def test_whole_steps(trace, step, want):
    p = StepProfile.of(trace, step)
    assert p.step == want and len(p) == 2


@pytest.mark.parametrize("step", [0.5, -1.5, True, "1", None])
def test_other_steps_refused(trace, step):
    with pytest.raises(TypeError, match="whole number"):
        StepProfile.of(trace, step)
