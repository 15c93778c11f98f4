"""Sizes: every bad size is a ValueError naming the parameter; exact sizes parse exactly."""

import fractions
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays.sizes import MAX_SIZE


@pytest.mark.parametrize("text,expected", [
    ("1.5G", 3 << 29), ("0.5KiB", 512), ("1e3", 1000), ("1.5e3B", 1500), ("2.5MB", 2500000),
    ("0e500", 0), (np.int64(4096), 4096), (4096.0, 4096), (MAX_SIZE, MAX_SIZE),
])
def test_exact_sizes_parse_exactly(text, expected):
    assert ca.parse_size(text) == expected


@pytest.mark.parametrize("bad,reason", [
    ("0.5B", "whole number of bytes"),
    ("1.5B", "whole number of bytes"),
    ("0.1G", "whole number of bytes"),
    ("1e-400", "whole number of bytes"),
    (0.5, "whole number of bytes"),
    ("1e400", "absurdly large"),
    ("1e19", "absurdly large"),
    ("9999999999TiB", "absurdly large"),
    (2**70, "absurdly large"),
    (MAX_SIZE + 1, "absurdly large"),
    (np.uint64(2**64 - 1), "absurdly large"),
    (1e300, "absurdly large"),
    (math.inf, "finite"),
    (-math.inf, "finite"),
    (math.nan, "finite"),
    ("inf", "not a size"),
    ("nan", "not a size"),
    (-1, "negative"),
])
def test_bad_sizes_are_value_errors_naming_the_parameter(bad, reason):
    with pytest.raises(ValueError, match=f"^budget .*{reason}"):
        ca.parse_size(bad, "budget")


@pytest.mark.parametrize("bad", [2**70, "1e400", "0.5B", math.inf, "1e19"])
@pytest.mark.parametrize("param", ["fast", "slow"])
def test_manager_names_the_parameter_with_the_bad_size(param, bad):
    sizes = {"fast": "1MiB", "slow": "4MiB", param: bad}
    with pytest.raises(ValueError, match=f"^{param} memory size"):
        ca.Manager(**sizes)


@pytest.mark.parametrize("text, want", [("1PiB", 1 << 50), ("1.5P", 3 << 49), ("2PB", 2 * 10**15),
                                        ("1EiB", 1 << 60), ("4EiB", 1 << 62)])
def test_peta_and_exa_sizes_parse(text, want):
    assert ca.parse_size(text) == want


@pytest.mark.parametrize("text", ["5EiB", "16EiB", "1ZB", "1YiB", "1e3Zi"])
def test_sizes_past_the_limit_are_too_large_not_unknown(text):
    with pytest.raises(ValueError, match="absurdly large"):
        ca.parse_size(text)


FLOATS = [np.float16, np.float32, np.float64, np.longdouble, float, fractions.Fraction]


@given(n=st.integers(min_value=0, max_value=31), kind=st.sampled_from(FLOATS))
@settings(max_examples=60, deadline=None)
def test_a_whole_size_of_any_float_type_is_its_int(n, kind):
    # a size computed with NumPy floats is as good as a Python float
    assert ca.parse_size(kind(n * 32), "fast") == n * 32
    with pytest.raises(ValueError, match="fast must be a whole number of bytes"):
        ca.parse_size(kind(n * 32) + kind(1) / kind(2), "fast")     # exact even in float16


@pytest.mark.parametrize("kind", FLOATS[:-1])
def test_a_float_size_that_is_no_number_is_refused_for_every_float_type(kind):
    for bad in (kind("nan"), kind("inf")):
        with pytest.raises(ValueError, match="slow must be a finite number of bytes"):
            ca.parse_size(bad, "slow")
    with pytest.raises(ValueError, match="fast must not be negative"):
        ca.parse_size(kind(-4096), "fast")


def test_a_fraction_beyond_any_float_is_too_large():
    with pytest.raises(ValueError, match="absurdly large"):
        ca.parse_size(fractions.Fraction(10**400), "slow")
