"""NumPy's functions with dedicated implementations (cachedarrays.routines), the copies and
ufuncs beside them, x.flat and x.flags give NumPy's result on CachedArrays of any layout and
dtype: the same values, dtype, shape and memory order, the same exception type where NumPy
raises, NumPy's reading of every argument spelling, and never a CachedArray of a dtype holding
objects (NumPy's ndarray instead)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:          # noqa: BLE001
        return e


def _assert_as_numpy(got, want, values=True):
    """got (from CachedArrays) is want (from ndarrays): the same exception type, or the same
    dtype, shape, bytes and memory order (C when NumPy's is neither C nor F: a CachedArray
    is laid out in one of those two)."""
    if isinstance(want, Exception):
        assert isinstance(got, type(want)), (got, want)
        return
    assert not isinstance(got, Exception), got
    if isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            _assert_as_numpy(g, w, values)
        return
    assert isinstance(got, ca.CachedArray), type(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    if values:
        assert np.asarray(got).tobytes() == want.tobytes()
    flags = want.flags
    order = (flags.c_contiguous, flags.f_contiguous) if flags.forc else (True, False)
    assert (got.flags.c_contiguous, got.flags.f_contiguous) == order


# ---- memory order of new arrays made from arrays of any layout ------------------------------

def _layout(shape, perm, steps):
    """base -> its view base.reshape(shape)[steps].transpose(perm): any order of axes, strided,
    reversed (the same view of an ndarray and of a CachedArray)."""
    def view(base):
        return base.reshape(shape)[tuple(slice(None, None, s) for s in steps)].transpose(perm)
    return view


LAYOUTS = {
    "C": _layout((4, 6), (0, 1), (1, 1)),
    "F": _layout((4, 6), (1, 0), (1, 1)),
    "F strided": _layout((4, 6), (1, 0), (2, 1)),
    "F reversed": _layout((4, 6), (1, 0), (-1, 1)),
    "C strided": _layout((4, 6), (0, 1), (1, 2)),
    "one column": _layout((4, 6), (1, 0), (4, 1)),
    "3-d F": _layout((2, 3, 4), (2, 1, 0), (1, 1, 1)),
    "3-d mixed": _layout((2, 3, 4), (1, 0, 2), (1, 1, 1)),
    "3-d F strided": _layout((2, 3, 4), (2, 1, 0), (1, 2, 1)),
}

# (a, b): a is the array under test (a CachedArray or its ndarray twin), b an ndarray of
# a's layout and values in both runs
CALLS = {
    "zeros_like": lambda a, b: np.zeros_like(a),
    "ones_like A": lambda a, b: np.ones_like(a, order="A"),
    "full_like K": lambda a, b: np.full_like(a, 7, order="K"),
    "full_like None": lambda a, b: np.full_like(a, 7, None, None),
    "zeros_like shape of its rank": lambda a, b: np.zeros_like(a, shape=a.shape[::-1]),
    "zeros_like shape of another rank": lambda a, b: np.zeros_like(a, shape=(1,) + a.shape),
    "ones_like A shape": lambda a, b: np.ones_like(a, order="A", shape=a.shape[::-1]),
    "copy K": lambda a, b: a.copy(order="K"),
    "copy A": lambda a, b: a.copy(order="A"),
    "astype": lambda a, b: a.astype(np.float32),
    "astype A": lambda a, b: a.astype(np.int16, order="A"),
    "np.copy": lambda a, b: np.copy(a),
    "cumsum axis 0": lambda a, b: np.cumsum(a, axis=0),
    "cumprod axis -1": lambda a, b: np.cumprod(a, axis=-1),
    "cumsum": lambda a, b: np.cumsum(a),
    "cumsum dtype": lambda a, b: np.cumsum(a, 1, np.float32),
    "concatenate": lambda a, b: np.concatenate([a, a]),
    "concatenate axis -1": lambda a, b: np.concatenate((a, a, a), axis=-1),
    "concatenate dtype": lambda a, b: np.concatenate([a, a], dtype=np.float32),
    "concatenate with an ndarray": lambda a, b: np.concatenate([a, b], axis=1),
    "concatenate with a list": lambda a, b: np.concatenate([a, b.tolist()]),
    "concatenate promoted": lambda a, b: np.concatenate([a, b.astype(np.int8)]),
    "sort axis 0": lambda a, b: np.sort(a, axis=0),
    "sort": lambda a, b: np.sort(a),
    "where": lambda a, b: np.where(b > 5, a, 0.5),
}


@pytest.mark.parametrize("call", list(CALLS.values()), ids=list(CALLS))
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_results_made_from_any_layout_are_numpys(m, layout, call):
    base = np.arange(1.0, 25.0)
    a = layout(base)
    want = _outcome(call, a, a.copy(order="K"))
    got = _outcome(call, layout(ca.asarray(base, manager=m)), a.copy(order="K"))
    _assert_as_numpy(got, want)


@pytest.mark.parametrize("order", ["K", "A", "C", "F", None, "k", "a"])
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_empty_like_has_numpys_memory_order(m, layout, order):
    base = np.arange(24.0)
    a = layout(base)
    for shape in (None, a.shape[::-1], (a.size,)):
        want = _outcome(np.empty_like, a, None, order, True, shape)
        got = _outcome(np.empty_like, layout(ca.asarray(base, manager=m)), None, order, True,
                       shape)
        _assert_as_numpy(got, want, values=False)


@pytest.mark.parametrize("order", ["C", "F", "A", "K"])
@pytest.mark.parametrize("layout", list(LAYOUTS.values()) + [
    _layout((4, 1, 6), (1, 0, 2), (1, 1, 1)), _layout((4, 6), (1, 0), (1, 6))],
    ids=list(LAYOUTS) + ["3-d, an axis of 1 moved", "a row of F"])
def test_astype_without_copy_returns_the_array_itself_where_numpy_does(m, layout, order):
    base = np.arange(24.0)
    a = layout(base)
    x = layout(ca.asarray(base, manager=m))
    got = x.astype(x.dtype, order=order, copy=False)
    want = a.astype(a.dtype, order=order, copy=False)
    assert (got is x) == (want is a)
    if want is not a:
        _assert_as_numpy(got, want)


@pytest.mark.parametrize("call", list(CALLS.values()), ids=list(CALLS))
def test_results_of_evicted_arrays_keep_writes_through_their_views(tiny, call):
    """Inputs in slow memory give NumPy's result; a write through a view of the result after
    the result was evicted is kept (the view resolves its bytes where they are now)."""
    base = np.arange(1.0, 25.0)
    a = LAYOUTS["F strided"](base)
    x = LAYOUTS["F strided"](ca.asarray(base, manager=tiny))
    ca.evict(x)
    assert x.device == "slow"
    want = call(a, a.copy(order="K"))
    got = call(x, a.copy(order="K"))
    _assert_as_numpy(got, want)
    key = (slice(1, None),) + (slice(None, None, -1),) * (got.ndim - 1)
    view = got[key]
    assert view.base is got
    ca.evict(got)
    view[...] = -1
    want[key] = -1
    ca.prefetch(got)
    assert np.asarray(got).tobytes() == want.tobytes()
    tiny.check()


@settings(max_examples=80, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       perm_seed=st.permutations(range(3)),
       steps=st.lists(st.sampled_from([1, 2, -1, -2]), min_size=3, max_size=3),
       call=st.sampled_from(sorted(CALLS)), dtype=st.sampled_from(["f8", ">i4", "f4"]))
def test_any_view_gives_numpys_result(shape, perm_seed, steps, call, dtype):
    nd = len(shape)
    perm = tuple(p for p in perm_seed if p < nd)
    layout = _layout(tuple(shape), perm, tuple(steps[:nd]))
    base = np.arange(1, int(np.prod(shape)) + 1).astype(dtype)
    a = layout(base)
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        want = _outcome(CALLS[call], a, a.copy(order="K"))
        got = _outcome(CALLS[call], layout(ca.asarray(base, manager=m)), a.copy(order="K"))
        _assert_as_numpy(got, want)
        del got
        m.check()


# ---- np.concatenate takes sequences only, as NumPy -------------------------------------------

@pytest.mark.parametrize("arrays", [lambda x: iter([x, x]), lambda x: (y for y in (x, x)),
                                    lambda x: {0: x}.values(), lambda x: {0: x}])
def test_concatenate_of_what_is_not_a_sequence_raises_typeerror(m, arrays):
    a = np.arange(3.0)
    with pytest.raises(TypeError):
        np.concatenate(arrays(a))
    with pytest.raises(TypeError, match="sequence"):
        np.concatenate(arrays(ca.asarray(a, manager=m)))


def test_concatenate_of_a_cached_array_joins_its_rows(m):
    a = np.arange(6.0).reshape(2, 3)
    got = np.concatenate(ca.asarray(a, manager=m))
    _assert_as_numpy(got, np.concatenate(a))


# ---- dtypes holding objects: NumPy's ndarray, never a CachedArray holding references ---------

_OBJECTS = [object, "O,f8", np.dtypes.StringDType()]


def _assert_plain(got, want):
    assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
    assert (got.flags.c_contiguous, got.flags.f_contiguous) == \
        (want.flags.c_contiguous, want.flags.f_contiguous)
    if want.dtype.names is None:
        assert got.tolist() == want.tolist()


@pytest.mark.parametrize("dtype", _OBJECTS, ids=str)
@pytest.mark.parametrize("call", [
    lambda a, dt: np.concatenate([a, a], dtype=dt),
    lambda a, dt: np.concatenate([a, a], axis=1, dtype=dt, casting="unsafe"),
    lambda a, dt: np.concatenate([a, np.zeros((1, 3), dt)]),
    lambda a, dt: np.concatenate([a, np.ones((2, 3), dt), a]),
    lambda a, dt: np.zeros_like(a, dt),
    lambda a, dt: np.ones_like(a, dtype=dt, order="F"),
    lambda a, dt: np.full_like(a, 3, dt, "K", True, (3, 2)),
    lambda a, dt: np.zeros(3, dt, like=a),
    lambda a, dt: np.full((2, 2), 1, dtype=dt, order="F", like=a),
    lambda a, dt: np.array([1, 2], dtype=dt, like=a),
    lambda a, dt: np.asarray([[1, 2]], dt, like=a),
    lambda a, dt: a.astype(dt),
    lambda a, dt: a.T[::2].astype(dt, order="K"),
], ids=["concatenate dtype", "concatenate unsafe", "concatenate with an ndarray",
        "concatenate promoted", "zeros_like", "ones_like F", "full_like shape", "zeros like=",
        "full like=", "array like=", "asarray like=", "astype", "astype K of a view"])
def test_a_dtype_holding_objects_gives_numpys_ndarray(m, call, dtype):
    a = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    want = _outcome(call, a, dtype)
    got = _outcome(call, ca.asarray(a, manager=m), dtype)
    if isinstance(want, Exception):
        assert isinstance(got, type(want))
    else:
        _assert_plain(got, want)


@pytest.mark.parametrize("call", [lambda a: np.full(2, None, like=a),
                                  lambda a: np.full((3, 2), np.array([None, 1]), like=a),
                                  lambda a: np.full(shape=2, fill_value=None, like=a),
                                  lambda a: np.full(2, None, float, like=a),
                                  lambda a: np.full(2, "ab", like=a),
                                  lambda a: np.full_like(a, None)])
def test_full_with_a_fill_value_of_objects_gives_numpys_result(m, call):
    a = np.arange(3.0)
    want = call(a)
    got = call(ca.asarray(a, manager=m))
    if want.dtype.hasobject:
        _assert_plain(got, want)
    else:
        _assert_as_numpy(got, want)


@pytest.mark.parametrize("values", [[1, "a", None], [None], [[1], [2, 3]], [1.5, 2]])
def test_values_numpy_holds_as_objects_give_numpys_ndarray(m, values):
    x = ca.asarray(np.arange(3.0), manager=m)
    want = _outcome(np.array, values)
    got = _outcome(lambda v: np.array(v, like=x), values)
    if isinstance(want, Exception) or not want.dtype.hasobject:
        _assert_as_numpy(got, want)
    else:
        _assert_plain(got, want)


@pytest.mark.parametrize("kwargs", [dict(ndmax=1), dict(ndmax=2), dict(ndmax=0),
                                    dict(ndmin=3, ndmax=2), dict(dtype="f4", ndmax=2),
                                    dict(foo=1), dict(ndmax=1, foo=1)], ids=str)
def test_array_like_takes_numpys_keywords(m, kwargs):
    if "ndmax" not in str(__import__("inspect").signature(np.array)) and "foo" not in kwargs:
        pytest.skip("this NumPy has no ndmax")
    x = ca.asarray(np.arange(3.0), manager=m)
    values = [[1, 2], [3, 4]]
    want = _outcome(lambda: np.array(values, **kwargs))
    got = _outcome(lambda: np.array(values, like=x, **kwargs))
    _assert_as_numpy(got, want)


# ---- running totals: NumPy's errors for any dtype argument ---------------------------------

@pytest.mark.parametrize("func", [np.cumsum, np.cumprod])
@pytest.mark.parametrize("dtype", [[("a", "f8")], {"names": ["a"], "formats": ["f8"]}, "f8,f8",
                                   "U3", "M8[s]", "bogus", "f4", ("f8", (2,))], ids=str)
@pytest.mark.parametrize("axis", [None, 0, -1, 2])
def test_running_totals_take_any_dtype_argument_as_numpy(m, func, dtype, axis):
    a = np.arange(1.0, 7.0).reshape(2, 3)
    want = _outcome(func, a, axis, dtype)
    got = _outcome(func, ca.asarray(a, manager=m), axis, dtype)
    if isinstance(want, Exception):
        assert isinstance(got, type(want)) and "unhashable" not in str(got)
    elif want.dtype.hasobject:
        _assert_plain(got, want)
    else:
        _assert_as_numpy(got, want)


# ---- NumPy's signatures: what is positional only, what a keyword may name --------------------

@pytest.mark.parametrize("call", [
    lambda a: np.concatenate(arrays=[a, a]),
    lambda a: np.concatenate([a, a], 0, None),
    lambda a: np.concatenate([a, a], 0, None, None),
    lambda a: np.concatenate([a], foo=1),
    lambda a: np.empty_like(prototype=a).shape,
    lambda a: np.empty_like(prototype=a, dtype=object, shape=3).shape,
    lambda a: np.empty_like(a=a),
    lambda a: np.zeros_like(a=a, dtype="i2"),
    lambda a: np.zeros_like(prototype=a),
    lambda a: np.full_like(a=a, fill_value=2),
    lambda a: np.full_like(a, 2, foo=1),
    lambda a: np.sort(a=a, kind="stable"),
    lambda a: np.sort(a, -1, None, None, True),
    lambda a: np.sort(a, foo=1),
    lambda a: np.cumsum(a=a, dtype="f4"),
    lambda a: np.cumsum(a, 0, None, None, 1),
    lambda a: np.cumprod(a, bar=1),
    lambda a: np.where(condition=a),
    lambda a: np.where(a, x=1, y=2),
    lambda a: np.where(a, 1, 2, 3),
    lambda a: np.where(a, 1),
])
def test_routines_take_arguments_as_numpy_does(m, call):
    a = np.array([3.0, 0.0, 2.0])
    want = _outcome(call, a)
    got = _outcome(call, ca.asarray(a, manager=m))
    if isinstance(want, np.ndarray):
        _assert_as_numpy(got, want)
    elif isinstance(want, Exception):
        assert isinstance(got, type(want)), got
    else:
        assert got == want


# ---- x.flat: NumPy's flatiter --------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 3), (3,), (), (2, 0), (2, 1, 2)])
def test_flat_is_an_iterator_as_numpys(m, shape):
    a = np.arange(float(np.prod(shape))).reshape(shape)
    x = ca.asarray(a, manager=m)
    for arr in (a, x):
        f = arr.flat
        assert iter(f) is f
    steps = []
    for arr in (a, x):
        f = arr.flat
        if arr is x:
            f._chunk = 2                    # steps across reads of several chunks
        seq = [(f.index, f.coords)]
        for v in f:
            seq.append((f.index, f.coords, v.item()))
        seq.append(list(f))                 # spent, as NumPy's
        steps.append(seq)
    assert steps[0] == steps[1]
    assert m.pin_count(x.object) == 0


@pytest.mark.parametrize("value", [3, [7, 8], np.arange(4.0), [1, 2, 3, 4, 5, 6, 7]])
def test_assigning_flat_sets_every_element_as_numpy(m, value):
    a = np.arange(6.0).reshape(2, 3)
    x = ca.asarray(a, manager=m)
    a.flat = value
    x.flat = ca.asarray(np.asarray(value), manager=m) if isinstance(value, np.ndarray) else value
    assert np.array_equal(np.asarray(x), a)


# ---- order arguments: every spelling NumPy takes, NumPy's errors for the others ------------

_ORDER_CALLS = {
    "astype": lambda a, o, like: a.astype("f4", order=o),
    "copy": lambda a, o, like: a.copy(order=o),
    "np.copy": lambda a, o, like: np.copy(a, order=o),
    "np.array like=": lambda a, o, like: np.array(a, order=o, like=like),
    "np.asarray like=": lambda a, o, like: np.asarray(a, order=o, like=like),
    "np.array of an ndarray like=": lambda a, o, like: np.array(np.array(a), order=o, like=like),
}


@pytest.mark.parametrize("order", ["K", "A", "C", "F", "k", "a", "c", "f", None, b"F", "X", "",
                                   "CF", 1], ids=repr)
@pytest.mark.parametrize("call", list(_ORDER_CALLS.values()), ids=list(_ORDER_CALLS))
@pytest.mark.parametrize("layout", ["C", "F", "F strided", "3-d F strided", "one column"])
def test_order_arguments_are_read_as_numpy_reads_them(m, layout, call, order):
    base = np.arange(24.0)
    a = LAYOUTS[layout](base)
    x = LAYOUTS[layout](ca.asarray(base, manager=m))
    like = ca.asarray(np.zeros(1), manager=m)
    want = _outcome(call, a, order, a)
    got = _outcome(call, x, order, like)
    if call is _ORDER_CALLS["np.asarray like="] and not isinstance(want, Exception) and \
            want is a:
        assert got is x                     # no copy where NumPy makes none
    else:
        _assert_as_numpy(got, want)


@pytest.mark.parametrize("order", ["C", "F", "A", "K", None])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_library_asarray_copies_only_into_another_order(m, layout, order):
    base = np.arange(24.0)
    a = LAYOUTS[layout](base)
    x = LAYOUTS[layout](ca.asarray(base, manager=m))
    want = np.asarray(a, order=order)
    got = ca.asarray(x, order=order)
    assert (got is x) == (want is a)
    if want is not a:
        _assert_as_numpy(got, want)


# ---- ufuncs: NumPy's memory order for any layout -------------------------------------------

UFUNC_CALLS = {
    "a + 1": lambda a, b: a + 1,
    "1.5 * a": lambda a, b: 1.5 * a,
    "a + a": lambda a, b: a + a,
    "a + b": lambda a, b: a + b,
    "-a": lambda a, b: -a,
    "abs(a)": lambda a, b: abs(a),
    "a > 2": lambda a, b: a > 2,
    "np.sqrt(a)": lambda a, b: np.sqrt(a),
    "np.add(a, a, order='K')": lambda a, b: np.add(a, a, order="K"),
    "np.add(a, 1, order='A')": lambda a, b: np.add(a, 1, order="A"),
    "np.multiply(a, 2.0, casting='unsafe')": lambda a, b: np.multiply(a, 2.0, casting="unsafe"),
    "np.maximum(a, a[...])": lambda a, b: np.maximum(a, a[...]),
}


@pytest.mark.parametrize("call", list(UFUNC_CALLS.values()), ids=list(UFUNC_CALLS))
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_ufunc_results_of_any_layout_have_numpys_memory_order(m, layout, call):
    base = np.arange(1.0, 25.0)
    a = layout(base)
    b = np.ascontiguousarray(a)
    want = call(a, b)
    got = call(layout(ca.asarray(base, manager=m)), ca.asarray(b, manager=m))
    _assert_as_numpy(got, want)


# ---- x.flags: NumPy's keys, and NumPy's errors for what cannot be set ----------------------

@pytest.mark.parametrize("change", [
    lambda f: setattr(f, "c_contiguous", True),
    lambda f: setattr(f, "owndata", False),
    lambda f: setattr(f, "fnc", False),
    lambda f: setattr(f, "bogus", True),
    lambda f: setattr(f, "writebackifcopy", True),
    lambda f: setattr(f, "writebackifcopy", False),
    lambda f: setattr(f, "aligned", True),
    lambda f: f.__setitem__("C", True),
    lambda f: f.__setitem__("writeable", True),
    lambda f: f.__setitem__("W", True),
    lambda f: f.__setitem__("X", True),
    lambda f: f["c_contiguous"],
    lambda f: f["fnc"],
    lambda f: f[0],
    lambda f: (f["C"], f["FNC"], f["FORC"], f["CA"], f["FA"], f["B"], f["O"], f["X"]),
])
def test_flags_take_numpys_keys_and_refuse_as_numpy(m, change):
    a = np.arange(6.0).reshape(2, 3).copy()
    want = _outcome(change, a.flags)
    got = _outcome(change, ca.asarray(a, manager=m).flags)
    if isinstance(want, Exception):
        assert isinstance(got, type(want)), got
    else:
        assert got == want


@pytest.mark.parametrize("make", [lambda x: x, lambda x: np.broadcast_to(x, (2, 2, 3))])
def test_setflags_refuses_writebackifcopy_as_numpy(m, make):
    a = np.arange(6.0).reshape(2, 3)
    with pytest.raises(ValueError, match="WRITEBACKIFCOPY"):
        make(a).setflags(uic=True)
    with pytest.raises(ValueError, match="WRITEBACKIFCOPY"):
        make(ca.asarray(a, manager=m)).setflags(uic=True)
