"""CachedArrays against NumPy 2 where NumPy's own behaviour is easy to miss: shuffles that swap
rows through views, fill values that broadcast or cast, 0-d results, == on any dtypes, scalar
conversion and formatting, device=, order= and memory order, positional out."""

import copy
import warnings

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.array import _reduction


def _rows(a):
    return sorted(map(tuple, np.asarray(a).reshape(len(a), -1).tolist()))


# ---- a shuffle permutes or refuses, never duplicates ---------------------------------------

_SHUFFLES = {
    "Generator.shuffle": lambda x: np.random.default_rng(0).shuffle(x),
    "np.random.shuffle": lambda x: np.random.RandomState(0).shuffle(x),
}


@pytest.mark.parametrize("shuffle", list(_SHUFFLES.values()), ids=list(_SHUFFLES))
@pytest.mark.parametrize("a", [np.arange(12.0).reshape(6, 2), np.arange(24).reshape(6, 2, 2),
                               np.arange(6.0),
                               np.array([(i, 2.0 * i) for i in range(6)],
                                        dtype=[("a", "i4"), ("b", "f8")])],
                         ids=["2-d", "3-d", "1-d", "records"])
def test_a_shuffle_permutes_the_rows_or_refuses_and_never_duplicates_one(m, shuffle, a):
    x = ca.asarray(a, manager=m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # NumPy: "not a subclass of Sequence"
        try:
            shuffle(x)
        except ValueError as e:
            assert "swap through views" in str(e) and "ca.writable" in str(e)
            np.testing.assert_array_equal(np.asarray(x), a)       # left as it was
            with ca.writable(x) as v:                             # the way the error names
                shuffle(v)
            shuffle(a)
            np.testing.assert_array_equal(np.asarray(x), a)
    assert _rows(x) == _rows(a)
    g = np.random.default_rng(0)
    assert _rows(g.permutation(x)) == _rows(a)
    assert sorted(np.ravel(g.permuted(x)).tolist()) == sorted(np.ravel(a).tolist())
    with pytest.raises(TypeError):
        g.permuted(a, out=x)                 # NumPy: out must be a numpy array
    assert _rows(x) == _rows(a)


def test_a_swap_through_row_views_is_refused_and_other_row_sets_keep_numpy_semantics(m):
    a = np.arange(8.0).reshape(4, 2)
    x = ca.asarray(a, manager=m)
    with pytest.raises(ValueError, match="swap through views"):
        x[0], x[1] = x[1], x[0]
    np.testing.assert_array_equal(np.asarray(x), a)
    x[0] = x[1]
    x[2] = x[3]
    x[3] = x[0]
    x[1] = x[1]
    a[0] = a[1]
    a[2] = a[3]
    a[3] = a[0]
    np.testing.assert_array_equal(np.asarray(x), a)
    same = ca.asarray(np.ones((2, 2)), manager=m)
    same[0], same[1] = same[1], same[0]                 # equal rows: nothing is lost
    np.testing.assert_array_equal(np.asarray(same), np.ones((2, 2)))


@pytest.mark.parametrize("read", [lambda x: x[0], lambda x: x.flat[0],
                                  lambda x: x.reshape(())[()]], ids=["x[0]", "flat", "0-d"])
def test_a_record_read_by_index_is_a_copy_that_outlives_eviction(m, read):
    x = ca.asarray(np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]), manager=m)
    r = read(x)
    x[0] = (5, 6.0)
    ca.evict(x)
    assert r.tolist() == (1, 2.0)


# ---- full and full_like take every fill value NumPy takes -----------------------------------

_FILLS = [([1, 2, 3], None, float), (np.arange(3.0), None, float), (np.nan, None, np.int64),
          (1j, None, float), (2.5, None, np.int32), ([1, 2, 3], None, None),
          (0, None, "V4"), (b"ab", None, "V4")]


@pytest.mark.parametrize("fill, _, dtype", _FILLS)
def test_full_like_and_full_take_numpy_fill_values(m, fill, _, dtype):
    like = np.zeros((2, 3), dtype=dtype if dtype is not None else float)
    x = ca.asarray(like, manager=m)
    for got, want in [(lambda: np.full_like(x, fill), lambda: np.full_like(like, fill)),
                      (lambda: np.full((2, 3), fill, dtype=dtype, like=x),
                       lambda: np.full((2, 3), fill, dtype=dtype)),
                      (lambda: ca.full((2, 3), fill, dtype=dtype, manager=m),
                       lambda: np.full((2, 3), fill, dtype=dtype))]:
        with warnings.catch_warnings(record=True) as w_np:
            warnings.simplefilter("always")
            expected = want()
        with warnings.catch_warnings(record=True) as w_ca:
            warnings.simplefilter("always")
            res = got()
        assert type(res) is ca.CachedArray and res.manager is m
        assert res.dtype == expected.dtype
        assert np.asarray(res).tobytes() == expected.tobytes()
        assert [w.category for w in w_ca] == [w.category for w in w_np]


def test_full_takes_a_cached_array_fill_value(m):
    row = ca.asarray(np.arange(3.0), manager=m)
    np.testing.assert_array_equal(np.asarray(ca.full((2, 3), row)), np.full((2, 3), np.arange(3.)))


# ---- 0-d results stay 0-d arrays where NumPy's do -------------------------------------------

_ZERO_D = {"copy": lambda x: np.copy(x), "where": lambda x: np.where(np.array(True), x, 0),
           "round": lambda x: np.round(x, 0), "clip": lambda x: np.clip(x, 0, 1),
           "real_if_close": lambda x: np.real_if_close(x), "flip": lambda x: np.flip(x),
           "sum": lambda x: np.sum(x), "squeeze": lambda x: np.squeeze(x),
           "nan_to_num": lambda x: np.nan_to_num(x), "atleast_1d": lambda x: np.atleast_1d(x)}


@pytest.mark.parametrize("fn", list(_ZERO_D.values()), ids=list(_ZERO_D))
def test_a_0d_result_is_an_array_exactly_where_numpy_gives_one(m, fn):
    a = np.array(0.5)
    expected = fn(a)
    res = fn(ca.asarray(a, manager=m))
    if isinstance(expected, np.ndarray):
        assert type(res) is ca.CachedArray and res.shape == expected.shape
        res[...] = 7.0
        assert res.item() == 7.0
    else:
        assert type(res) is type(expected) and res == expected


# ---- == and != compare whatever NumPy compares ---------------------------------------------

_RECORDS = np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i4"), ("b", "f8")])
_EQ_CASES = [(_RECORDS, lambda x: x == x), (_RECORDS, lambda x: x != x[0]),
             (_RECORDS, lambda x: x == x[1]), (np.arange(3.0), lambda x: x == "a"),
             (np.arange(3.0), lambda x: x != "a"), (np.arange(3.0), lambda x: x == b"a"),
             (np.array(["a", "b"]), lambda x: x == 1), (np.arange(3.0), lambda x: x == 1.0),
             (np.arange(3.0), lambda x: x != None)]     # noqa: E711


@pytest.mark.parametrize("a, fn", _EQ_CASES)
def test_equality_gives_numpy_result_for_any_dtypes(m, a, fn):
    expected = fn(a)
    res = fn(ca.asarray(a, manager=m))
    assert type(res) is ca.CachedArray
    np.testing.assert_array_equal(np.asarray(res), expected)


def test_in_works_for_any_dtypes_and_mismatched_shapes_raise_as_numpy(m):
    x = ca.asarray(np.arange(3.0), manager=m)
    assert ("a" in x) is False and (2.0 in x) is True
    assert (_RECORDS[1] in ca.asarray(_RECORDS, manager=m)) is True
    with pytest.raises(ValueError):
        np.arange(2.0) == np.arange(3.0)         # noqa: B015
    with pytest.raises(ValueError):
        x == ca.asarray(np.arange(2.0), manager=m)      # noqa: B015


# ---- scalar conversion, formatting and reshape() -------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (1, 1)])
@pytest.mark.parametrize("convert", [int, float, complex])
def test_only_0d_arrays_convert_to_python_scalars(m, shape, convert):
    x = ca.asarray(np.full(shape, 7.0), manager=m)
    with pytest.raises(TypeError, match="only 0-dimensional arrays"):
        convert(np.full(shape, 7.0))
    with pytest.raises(TypeError, match="only 0-dimensional arrays"):
        convert(x)
    assert convert(x.reshape(())) == convert(7.0) and bool(x)


@pytest.mark.parametrize("a, spec", [(np.array(1.5), ".2f"), (np.array(3), ">8"),
                                     (np.array(1.5), ""), (np.arange(3.0), ""),
                                     (np.arange(3.0), ".2f")])
def test_format_is_numpy_format(m, a, spec):
    try:
        expected = format(a, spec)
    except TypeError:
        with pytest.raises(TypeError):
            format(ca.asarray(a, manager=m), spec)
    else:
        assert format(ca.asarray(a, manager=m), spec) == expected


def test_reshape_needs_a_shape(m):
    with pytest.raises(TypeError):
        np.array(5.0).reshape()
    with pytest.raises(TypeError, match="1 argument"):
        ca.asarray(np.array(5.0), manager=m).reshape()


# ---- device= and order= --------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda x, **k: np.zeros_like(x, **k),
                                  lambda x, **k: np.empty_like(x, **k),
                                  lambda x, **k: np.ones_like(x, **k),
                                  lambda x, **k: np.full_like(x, 2, **k),
                                  lambda x, **k: ca.zeros_like(x, **k)])
def test_like_functions_take_device_cpu_only(m, make):
    x = ca.asarray(np.zeros(3), manager=m)
    assert make(np.zeros(3), device="cpu").shape == (3,)
    res = make(x, device="cpu")
    assert type(res) is ca.CachedArray and res.manager is m
    with pytest.raises(ValueError):
        make(np.zeros(3), device="gpu")
    with pytest.raises(ValueError, match="device"):
        make(x, device="gpu")


@pytest.mark.parametrize("order", ["K", "A", "X", "k", ""])
@pytest.mark.parametrize("make", ["empty", "zeros", "ones", "full"])
def test_creation_refuses_orders_numpy_refuses(m, make, order):
    args = ((2, 2), 1.0) if make == "full" else ((2, 2),)
    with pytest.raises(ValueError):
        getattr(np, make)(*args, order=order)
    with pytest.raises(ValueError, match="order"):
        getattr(ca, make)(*args, order=order, manager=m)


@pytest.mark.parametrize("order", ["C", "F", "c", "f", None])
@pytest.mark.parametrize("make", ["empty", "zeros", "ones", "full"])
def test_creation_takes_orders_numpy_takes(m, make, order):
    args = ((2, 3), 1.0) if make == "full" else ((2, 3),)
    expected = getattr(np, make)(*args, order=order)
    res = getattr(ca, make)(*args, order=order, manager=m)
    assert res.flags.f_contiguous == expected.flags.f_contiguous
    assert res.flags.c_contiguous == expected.flags.c_contiguous


# ---- memory order of copies ----------------------------------------------------------------

_ORDERED = {
    "astype C copy=False": lambda a: a.astype(a.dtype, order="C", copy=False),
    "astype F copy=False": lambda a: a.astype(a.dtype, order="F", copy=False),
    "astype A copy=False": lambda a: a.astype(a.dtype, order="A", copy=False),
    "astype K copy=False": lambda a: a.astype(a.dtype, order="K", copy=False),
    "astype A": lambda a: a.astype("f4", order="A"),
    "copy A": lambda a: a.copy(order="A"),
    "copy K": lambda a: a.copy(order="K"),
    "copy": lambda a: a.copy(),
    "copy.copy": copy.copy,
    "copy.deepcopy": copy.deepcopy,
    "empty_like": np.empty_like,
    "zeros_like": np.zeros_like,
}


@pytest.mark.parametrize("fn", list(_ORDERED.values()), ids=list(_ORDERED))
@pytest.mark.parametrize("layout", ["C", "F", "strided"])
def test_copies_have_numpy_memory_order(m, fn, layout):
    base = np.arange(24.0).reshape(4, 6)
    a = {"C": base, "F": np.asfortranarray(base), "strided": base[:, ::2]}[layout]
    x = ca.asarray(np.asfortranarray(base), manager=m) if layout == "F" else \
        ca.asarray(base, manager=m)
    if layout == "strided":
        x = x[:, ::2]
    expected = fn(a)
    res = fn(x)
    assert res.flags.c_contiguous == expected.flags.c_contiguous
    assert res.flags.f_contiguous == expected.flags.f_contiguous
    assert (res is x) == (expected is a)
    np.testing.assert_array_equal(np.asarray(res)[...] if fn not in (np.empty_like,)
                                  else np.asarray(expected), expected)


@pytest.mark.parametrize("call", [lambda a, o: np.add(a, a, order=o),
                                  lambda a, o: np.sqrt(a, order=o),
                                  lambda a, o: np.multiply(a, 2.0, order=o, casting="unsafe")])
@pytest.mark.parametrize("order", ["C", "F", "K", "A", "f"])
@pytest.mark.parametrize("layout", ["C", "F"])
def test_a_ufunc_result_has_the_memory_order_given(m, call, order, layout):
    a = np.arange(24.0).reshape(4, 6)
    a = np.asfortranarray(a) if layout == "F" else a
    expected = call(a, order)
    res = call(ca.asarray(a, manager=m), order)
    assert res.flags.f_contiguous == expected.flags.f_contiguous
    assert res.flags.c_contiguous == expected.flags.c_contiguous
    np.testing.assert_array_equal(np.asarray(res), expected)


# ---- reductions with out given by position ---------------------------------------------------

def test_a_reduction_given_an_ndarray_out_by_position_returns_it_in_the_python_method(m):
    x = ca.asarray(np.arange(6.0).reshape(2, 3), manager=m)
    o = np.zeros(3)
    assert _reduction("sum")(x, 0, None, o) is o
    np.testing.assert_array_equal(o, [3.0, 5.0, 7.0])
    o = np.zeros(3)
    assert _reduction("max")(x, 0, o) is o
    np.testing.assert_array_equal(o, [3.0, 4.0, 5.0])


def test_a_reduction_given_an_ndarray_out_by_position_returns_it(m):
    x = ca.asarray(np.arange(6.0).reshape(2, 3), manager=m)
    o = np.zeros(3)
    assert x.sum(0, None, o) is o
    assert x.max(0, o) is o


@pytest.mark.parametrize("shape", [(2, 3), (3, 1), (1, 3), (2, 3, 4), (0, 3)])
@pytest.mark.parametrize("op", ["a+1", "a+a", "a+b", "b+a", "np.exp(a)", "-a", "np.add(a, a)",
                                "np.multiply(a, 2.0)", "a > b", "np.add(a, b, order='F')",
                                "a.T + 1"])
def test_a_ufuncs_result_has_numpys_memory_order(m, shape, op):
    """An F-ordered input gives an F-ordered result, as NumPy's default order='K' does, on
    every path (operators, ufunc calls, scalars), and mixed orders give C."""
    f = np.asfortranarray(np.arange(np.prod(shape), dtype=np.float64).reshape(shape))
    c = np.ascontiguousarray(f) + 1
    want = eval(op, {"np": np}, {"a": f, "b": c})
    got = eval(op, {"np": np}, {"a": ca.asarray(f, manager=m), "b": ca.asarray(c, manager=m)})
    assert (got.flags.c_contiguous, got.flags.f_contiguous) == \
        (want.flags.c_contiguous, want.flags.f_contiguous)
    np.testing.assert_array_equal(np.asarray(got), want)


# ---- np.concatenate's common call gives NumPy's result or NumPy's error ----------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(nd=st.integers(0, 3), axis=st.integers(-4, 3), n=st.integers(1, 4),
       sizes=st.lists(st.integers(0, 3), min_size=12, max_size=12),
       mismatch=st.booleans(), dtype=st.sampled_from(["f8", "i4", ">f8", "?"]),
       casting=st.sampled_from(["same_kind", "no", "unsafe"]))
def test_concatenate_of_cached_arrays_matches_numpy(nd, axis, n, sizes, mismatch, dtype,
                                                     casting):
    rng = np.random.default_rng(nd * 100 + n)
    shape = tuple(sizes[:nd])
    arrays = []
    for i in range(n):
        s = list(shape)
        if nd:
            s[(axis if -nd <= axis < nd else 0) % nd] = sizes[nd + i]
            if mismatch and i and nd > 1:
                s[(axis + 1) % nd] += 1        # another dimension differs: NumPy refuses
        arrays.append((rng.standard_normal(s) * 5).astype(dtype))
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        cached = [ca.asarray(a, manager=m) for a in arrays]
        try:
            want = np.concatenate(arrays, axis=axis, casting=casting)
        except Exception as e:                 # noqa: BLE001
            with pytest.raises(type(e)):
                np.concatenate(cached, axis=axis, casting=casting)
        else:
            got = np.concatenate(cached, axis=axis, casting=casting)
            assert isinstance(got, ca.CachedArray)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.array_equal(np.asarray(got), want)
        m.check()
        assert len(m._objects) == n + ("got" in locals())
