"""Every dtype spelling NumPy accepts works in every creation function, with NumPy's result."""

import numpy as np
import pytest

import cachedarrays as ca
from helpers import assert_eq

SPELLINGS = [
    [("a", "i4"), ("b", "f8")],
    [("a", "i4", (2,)), ("b", "S3")],
    {"names": ["a", "b"], "formats": ["i4", "f8"]},
    {"a": ("i4", 0), "b": ("f4", 4)},
    "i4,f8",
    np.dtype([("x", "u1"), ("y", "i8")], align=True),
    np.dtype("f8"),
    np.dtypes.Float32DType(),
    float, int, bool, complex, np.float32, np.uint16,
    "<f8", ">i4", "f2", "c16", "?", "b",
    (np.float64, (2,)),
    ("f8", (2, 3)),
    "U5", "S4", "M8[s]", "m8[ms]",
    None,
]
IDS = [repr(s) for s in SPELLINGS]


def same(cached, expected, exact_bytes=False):
    """Same dtype, layout and values (and bytes, padding included, when exact_bytes)."""
    assert_eq(cached, expected, exact=True)
    assert cached.strides == expected.strides
    if exact_bytes:
        with ca.readable(cached) as v:
            assert v.tobytes(order="A") == expected.tobytes(order="A")


CREATORS = {
    "zeros": (lambda d, m: ca.zeros((2, 3), d, manager=m), lambda d: np.zeros((2, 3), d)),
    "zeros_F": (lambda d, m: ca.zeros((2, 3), d, order="F", manager=m),
                lambda d: np.zeros((2, 3), d, order="F")),
    "ones": (lambda d, m: ca.ones(3, d, manager=m), lambda d: np.ones(3, d)),
    "full": (lambda d, m: ca.full(3, 1, d, manager=m), lambda d: np.full(3, 1, d)),
    "array": (lambda d, m: ca.array(np.ones(3, d), manager=m), lambda d: np.ones(3, d)),
    "array_dtype": (lambda d, m: ca.array(np.ones(3, d), dtype=d, manager=m),
                    lambda d: np.array(np.ones(3, d), dtype=d)),
    "asarray_dtype": (lambda d, m: ca.asarray(np.ones(3, d), dtype=d, manager=m),
                      lambda d: np.asarray(np.ones(3, d), dtype=d)),
    "zeros_like": (lambda d, m: ca.zeros_like(ca.ones(3, manager=m), dtype=d),
                   lambda d: np.zeros_like(np.ones(3), dtype=d)),
    "ones_like": (lambda d, m: ca.ones_like(ca.zeros(3, manager=m), dtype=d),
                  lambda d: np.ones_like(np.zeros(3), dtype=d)),
    "full_like": (lambda d, m: ca.full_like(ca.zeros(3, manager=m), 1, dtype=d),
                  lambda d: np.full_like(np.zeros(3), 1, dtype=d)),
    "np.zeros_like": (lambda d, m: np.zeros_like(ca.ones(3, manager=m), dtype=d),
                      lambda d: np.zeros_like(np.ones(3), dtype=d)),
    "np.ones_like": (lambda d, m: np.ones_like(ca.zeros(3, manager=m), dtype=d),
                     lambda d: np.ones_like(np.zeros(3), dtype=d)),
    "np.zeros(like=)": (lambda d, m: np.zeros(3, d, like=ca.zeros(1, manager=m)),
                       lambda d: np.zeros(3, d)),
    "np.ones(like=)": (lambda d, m: np.ones(3, d, like=ca.zeros(1, manager=m)),
                      lambda d: np.ones(3, d)),
    "np.full(like=)": (lambda d, m: np.full(3, 1, d, like=ca.zeros(1, manager=m)),
                      lambda d: np.full(3, 1, d)),
    "astype": (lambda d, m: ca.ones(3, manager=m).astype(d), lambda d: np.ones(3).astype(d)),
}
ZEROS = [CREATORS[name] for name in ("zeros", "zeros_F", "np.zeros(like=)")]


@pytest.fixture(scope="module")
def m():
    """One manager for the module's ~470 cases (one per case would take four times as long);
    assert_eq checks it after every case, and it is checked once more before it closes."""
    with ca.Manager(fast="4MiB", slow="16MiB") as m:
        yield m
        m.check()


@pytest.mark.parametrize("make", CREATORS.values(), ids=CREATORS.keys())
@pytest.mark.parametrize("dtype", SPELLINGS, ids=IDS)
def test_every_creation_function_takes_every_dtype_spelling(m, dtype, make):
    cached, expected = make
    same(cached(dtype, m), expected(dtype), exact_bytes=make in ZEROS)


@pytest.mark.parametrize("dtype", SPELLINGS, ids=IDS)
def test_empty_has_numpys_shape_and_strides(m, dtype):
    for order in "CF":
        x = ca.empty((2, 3), dtype, order=order, manager=m)
        e = np.empty((2, 3), dtype, order=order)
        assert (x.dtype, x.shape, x.strides) == (e.dtype, e.shape, e.strides)


def test_structured_zeros_from_the_issue(m):
    x = ca.zeros(3, dtype=[("a", "i4"), ("b", "f8")], manager=m)
    assert x.dtype.names == ("a", "b")
    assert np.asarray(x["b"]).tolist() == [0.0, 0.0, 0.0]


def test_zeros_of_strings_are_empty_strings_as_in_numpy(m):
    assert np.asarray(ca.zeros(2, "U3", manager=m)).tolist() == ["", ""]


@pytest.mark.parametrize("dtype", [object, "O", [("a", "i4"), ("b", "O")],
                                   {"names": ["p"], "formats": ["O"]}, np.dtypes.StringDType()])
def test_dtypes_holding_references_are_refused_in_every_spelling(m, dtype):
    with pytest.raises(TypeError, match="cannot hold dtype"):
        ca.zeros(3, dtype, manager=m)
