"""A CachedArray handed to code written for ndarrays gets NumPy's answer or one clear error:
bytes(x) gives the elements' bytes as for the ndarray; torch and DLPack consumers get a counted
copy (as np.asarray gives), with the ndarray's values, dtype and shape; numba refuses a
CachedArray argument with a TypeError naming the pinned views to pass instead (compiled code
would keep a raw pointer while the array may move)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import cachedarrays as ca

DTYPES = ["u1", "i2", "i8", "f2", "f4", "f8", "c16", "?"]
ANY_DTYPES = st.sampled_from(DTYPES + ["S3", [("a", "i4"), ("b", "f8")]])
VIEWS = st.sampled_from(["whole", "reversed", "every other", "transposed"])
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _view_of(x, a, pick):
    """The same view of CachedArray x and ndarray a: whole, reversed, strided, transposed."""
    if pick == "reversed" and a.ndim:
        return x[::-1], a[::-1]
    if pick == "every other" and a.ndim:
        return x[::2], a[::2]
    if pick == "transposed":
        return x.T, a.T
    return x, a


def _draw(m, data, dtypes, pick):
    a = data.draw(hnp.arrays(np.dtype(data.draw(dtypes)), SHAPES))
    x = ca.asarray(a, manager=m)
    return (x, *_view_of(x, a, pick))


def conversions(m):
    return m.stats()["events"]["asarray"]["count"]


@SETTINGS
@given(data=st.data(), pick=VIEWS)
def test_bytes_of_an_array_are_the_ndarrays(m, data, pick):
    x, xv, av = _draw(m, data, ANY_DTYPES, pick)
    assume(av.ndim or av.dtype.kind not in "iu")    # NumPy: bytes(int(a)), zeros (see below)
    assert bytes(xv) == bytes(av)
    ca.evict(x)
    assert bytes(xv) == bytes(av)


def test_bytes_of_small_integers_are_not_their_values(m):
    a = np.array([1, 2, 3])
    assert bytes(ca.asarray(a, manager=m)) == a.tobytes()          # 24 bytes, not b"\x01\x02\x03"
    assert bytes(ca.asarray(np.array(3), manager=m)) == bytes(np.array(3))   # NumPy: 3 zeros


CONVERSIONS = ["torch.as_tensor", "torch.tensor", "torch.from_dlpack", "np.from_dlpack"]


def _convert(name):
    if name == "np.from_dlpack":
        return np.from_dlpack
    torch = pytest.importorskip("torch")
    return getattr(torch, name.split(".")[1])


@pytest.mark.parametrize("name", CONVERSIONS)
@SETTINGS
@given(data=st.data(), pick=VIEWS)
def test_torch_and_dlpack_get_a_counted_copy_with_the_ndarrays_values(m, name, data, pick):
    convert = _convert(name)
    x, xv, av = _draw(m, data, st.sampled_from(DTYPES), pick)
    before = conversions(m)
    got, want = convert(xv), convert(np.array(av))   # (torch refuses negative strides)
    assert conversions(m) == before + 1              # one counted copy, as np.asarray(x)
    assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    kept = np.array(np.asarray(got))
    xv[...] = 0
    ca.evict(x)
    np.testing.assert_array_equal(np.asarray(got), kept)      # a copy: x's changes stay in x


def test_a_dlpack_export_without_a_copy_or_of_records_is_refused_with_the_fix(m):
    x = ca.asarray(np.arange(3.0), manager=m)
    with pytest.raises(BufferError, match=r"without a copy.*copy=None.*ca\.readable"):
        x.__dlpack__(copy=False)
    records = ca.asarray(np.zeros(3, dtype=[("a", "i4")]), manager=m)
    before = conversions(m)
    with pytest.raises(BufferError, match=r"booleans and numbers only.*dtype \[\('a'"):
        np.from_dlpack(records)
    assert conversions(m) == before                  # refused before any copy
    assert x.__dlpack_device__() == np.arange(1.0).__dlpack_device__()


def _numba():
    numba = pytest.importorskip("numba")

    @numba.njit
    def total(a):
        return a.sum()

    @numba.njit
    def first_of_pair(t):
        return t[0].sum()

    return numba, total, first_of_pair


CALLS = {
    "argument": lambda nb, x: nb[1](x),
    "in a tuple": lambda nb, x: nb[2]((x, x)),
    "a view": lambda nb, x: nb[1](x[::2]),
    "read-only view": lambda nb, x: nb[1](np.broadcast_to(x, (2, x.size))),
    "numba.typeof": lambda nb, x: nb[0].typeof(x),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_numba_refuses_a_cached_array_naming_the_pinned_views(m, call):
    nb = _numba()
    x = ca.asarray(np.arange(6.0), manager=m)
    with pytest.raises(TypeError, match=r"numba cannot take a CachedArray \(shape .*ca\.readable"
                                        r".*ca\.kernel") as info:
        call(nb, x)
    assert "float64" in str(info.value)
    assert not hasattr(x, "_numba_type_")         # outside numba, the hook is not there
    np.testing.assert_array_equal(np.asarray(x), np.arange(6.0))
    with ca.readable(x) as a:
        assert nb[1](a) == 15.0                   # what the message says to pass
    in_object_mode = nb[0].jit(forceobj=True)(lambda a: a.sum() + 1.0)
    assert in_object_mode(x) == 16.0              # any Python object there: no pointer is kept
