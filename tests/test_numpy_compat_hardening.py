"""CachedArrays against NumPy 2 where a call's arguments are unusual: functions that write
what they are given, sizeless string and void dtypes, a CachedArray mask (where=), like=,
results that are None, concatenate's dtype= and ufunc outputs given as None."""

import io

import numpy as np
import numpy.lib.recfunctions as rf
import pytest
from numpy._core.overrides import array_function_dispatch

import cachedarrays as ca
from cachedarrays import dispatch


def _clean(x):
    """x clean in fast memory with a copy in slow memory: an eviction only drops it."""
    ca.evict(x)
    ca.prefetch(x)
    return x


def _after_eviction(x):
    ca.evict(x)
    ca.prefetch(x)
    return np.asarray(x)


# ---- a write by any function that is not known to be read-only survives eviction ---------

@array_function_dispatch(lambda a, b=None: (a, b))
def _scale_in_place(a, b=None):
    """A library's own dispatched function that writes its arguments."""
    a *= 2
    if b is not None:
        b[0] = -1
    return None


def _assign_fields(m):
    dt = [("a", "i4"), ("b", "f8")]
    x = _clean(ca.zeros(3, dtype=dt, manager=m))
    rf.assign_fields_by_name(x, np.ones(3, dtype=dt))
    return x, np.ones(3, dtype=dt)


def _fill_fields(m):
    dt = [("a", "i4"), ("b", "f8")]
    x = _clean(ca.zeros(2, dtype=dt, manager=m))
    src = np.array([(1, 2.0), (3, 4.0)], dtype=dt)
    rf.recursive_fill_fields(src, x)
    return x, src


def _apply_along_axis(m):
    x = _clean(ca.zeros((2, 2), manager=m))
    np.apply_along_axis(lambda r: r.__setitem__(0, 5.0) or r.sum(), 1, x)
    return x, np.array([[5.0, 0.0], [5.0, 0.0]])


def _own_function(m):
    x = _clean(ca.asarray(np.arange(3.0), manager=m))
    _scale_in_place(x)
    return x, np.arange(3.0) * 2


def _own_function_keyword(m):
    x = _clean(ca.asarray(np.arange(3.0), manager=m))
    y = _clean(ca.asarray(np.arange(3.0), manager=m))
    _scale_in_place(x, b=y)
    assert _after_eviction(y).tolist() == [-1.0, 1.0, 2.0]
    return x, np.arange(3.0) * 2


@pytest.mark.parametrize("write", [_assign_fields, _fill_fields, _apply_along_axis,
                                   _own_function, _own_function_keyword])
def test_a_write_by_a_function_not_known_to_be_read_only_survives_eviction(m, write):
    x, expected = write(m)
    np.testing.assert_array_equal(np.asarray(x), expected)
    np.testing.assert_array_equal(_after_eviction(x), expected)


@pytest.mark.parametrize("read", [np.sum, np.mean, np.sort, np.linalg.norm, np.fft.fft,
                                  lambda x: np.concatenate([x, x]), np.median,
                                  lambda x: np.copyto(np.empty(8), x),
                                  lambda x: np.put(np.zeros(8), [0], x[:1])])
def test_a_function_known_to_read_an_array_leaves_it_clean(m, read):
    x = _clean(ca.asarray(np.arange(8.0), manager=m))
    read(x)
    assert not m.isdirty(x.object.primary)


# ---- sizeless string and void dtypes take the size NumPy gives ------------------------------

SOURCES = [np.arange(3) * 1000, np.array([1.5, 2.25]), np.array(["abc", "de", ""]),
           np.array([b"hello", b"x"]), np.array(["2020-01-01"], "M8[D]"), np.array([True]),
           np.zeros(2, "V7"), np.zeros(2, "i4,f8")]
SIZELESS = ["U", "S", "V", str, bytes, np.void]


def _outcome(fn):
    try:
        r = fn()
    except Exception as e:                      # noqa: BLE001 - compared with NumPy's
        return type(e)
    r = np.asarray(r)
    return r.dtype, r.tolist()


@pytest.mark.parametrize("src", SOURCES, ids=lambda a: str(a.dtype))
@pytest.mark.parametrize("dt", SIZELESS, ids=str)
def test_astype_to_a_sizeless_dtype_sizes_it_as_numpy(m, src, dt):
    x = ca.asarray(src, manager=m)
    assert _outcome(lambda: x.astype(dt)) == _outcome(lambda: src.astype(dt))
    assert _outcome(lambda: ca.asarray(x, dtype=dt)) == _outcome(lambda: np.asarray(src, dt))


CREATIONS = {
    "empty_like": lambda a, dt: np.empty_like(a, dtype=dt).dtype,
    "empty_like_pos": lambda a, dt: np.empty_like(a, dt).dtype,
    "zeros_like": lambda a, dt: np.zeros_like(a, dtype=dt),
    "ones_like": lambda a, dt: np.ones_like(a, dtype=dt),
    "full_like": lambda a, dt: np.full_like(a, "xyz", dtype=dt),
    "full_like_pos": lambda a, dt: np.full_like(a, "xyz", dt),
    "zeros": lambda a, dt: np.zeros(3, dt, like=a),
    "ones": lambda a, dt: np.ones(3, dtype=dt, like=a),
    "empty": lambda a, dt: np.empty(3, dtype=dt, like=a).dtype,
    "full": lambda a, dt: np.full(3, "xyz", dt, like=a),
    "concatenate": lambda a, dt: np.concatenate([a, a], dtype=dt),
}
FILLED = ("ones_like", "full_like", "full_like_pos", "ones", "full")   # with a number or str


@pytest.mark.parametrize("name, dt", [(name, dt) for name in CREATIONS for dt in SIZELESS
                                      if name not in FILLED or np.dtype(dt).kind != "V"],
                         ids=str)
def test_numpy_creation_with_a_sizeless_dtype_sizes_it_as_numpy(m, name, dt):
    make = CREATIONS[name]
    a = np.arange(3.0)
    x = ca.asarray(a, manager=m)
    assert _outcome(lambda: make(x, dt)) == _outcome(lambda: make(a, dt))


OWN_CREATIONS = {
    "zeros": (lambda dt, **k: ca.zeros(3, dt, **k), lambda dt: np.zeros(3, dt)),
    "ones": (lambda dt, **k: ca.ones(3, dt, **k), lambda dt: np.ones(3, dt)),
    "full": (lambda dt, **k: ca.full(3, "xyz", dt, **k), lambda dt: np.full(3, "xyz", dt)),
    "empty": (lambda dt, **k: ca.empty(3, dt, **k).dtype, lambda dt: np.empty(3, dt).dtype),
    "empty_fortran": (lambda dt, **k: ca.empty((2, 2), dt, "F", **k).dtype,
                      lambda dt: np.empty((2, 2), dt, "F").dtype),
}


@pytest.mark.parametrize("name", OWN_CREATIONS)
@pytest.mark.parametrize("dt", ["U", "S", str, bytes], ids=str)
def test_the_librarys_creation_with_a_sizeless_string_dtype_sizes_it_as_numpy(m, name, dt):
    ours, numpys = OWN_CREATIONS[name]
    assert _outcome(lambda: ours(dt, manager=m)) == _outcome(lambda: numpys(dt))


# ---- a CachedArray mask (where=) is read like the other inputs -------------------------------

WHERE_CALLS = [
    lambda x, w, o: np.add(x, 1, where=w, out=o),
    lambda x, w, o: np.add(x, 1, where=w, out=(o,)),
    lambda x, w, o: np.add(x, x, where=w, out=None)[w],
    lambda x, w, o: np.negative(x, where=w, out=o),
    lambda x, w, o: np.add.reduce(x, where=w),
    lambda x, w, o: np.maximum.reduce(x, where=w, initial=-1.0),
    lambda x, w, o: np.sum(x, where=w),
    lambda x, w, o: x.sum(where=w),
    lambda x, w, o: np.add(np.arange(6.0), 1, where=w, out=np.zeros(6)),
]


@pytest.mark.parametrize("call", WHERE_CALLS)
def test_a_cachedarray_mask_in_a_ufunc_gives_numpy_result(m, call):
    a, w = np.arange(6.0), np.arange(6) % 2 == 0
    expected = np.asarray(call(a, w, np.zeros(6)))
    x, cw = ca.asarray(a, manager=m), ca.asarray(w, manager=m)
    got = call(x, cw, ca.zeros(6, manager=m))
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert x.object._pins == 0 and cw.object._pins == 0


# ---- like= puts the result on the like= array's manager --------------------------------------

LIKE_CALLS = [
    lambda x: np.zeros(3, like=x), lambda x: np.ones((2, 2), like=x),
    lambda x: np.empty(3, like=x), lambda x: np.full(3, 7.0, like=x),
    lambda x: np.array([1, 2], like=x), lambda x: np.asarray([1.0], like=x),
    lambda x: np.asarray(x, like=x), lambda x: np.array(x, like=x),
    lambda x: np.arange(4, like=x), lambda x: np.identity(2, like=x),
    lambda x: np.eye(2, like=x), lambda x: np.tri(2, like=x),
    lambda x: np.fromfunction(lambda i: i, (3,), like=x),
]


@pytest.mark.parametrize("call", LIKE_CALLS)
def test_like_puts_the_result_on_the_like_arrays_manager(make_manager, call):
    m = make_manager()
    x = ca.asarray(np.arange(4.0), manager=m)
    res = call(x)
    assert isinstance(res, ca.CachedArray) and res.manager is m
    a = np.arange(4.0)
    np.testing.assert_array_equal(np.asarray(res), call(a))


def test_asarray_like_itself_is_the_array(m):
    x = ca.asarray(np.arange(4.0), manager=m)
    assert np.asarray(x, like=x) is x
    assert np.asarray(x, dtype=np.float32, like=x).manager is m


# ---- a function returning None runs once -----------------------------------------------------

def test_save_and_savetxt_write_once(m):
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    x = ca.asarray(a, manager=m)
    ours, theirs = io.BytesIO(), io.BytesIO()
    np.save(ours, x)
    np.save(theirs, a)
    assert ours.getvalue() == theirs.getvalue()
    ours, theirs = io.StringIO(), io.StringIO()
    np.savetxt(ours, x, fmt="%g")
    np.savetxt(theirs, a, fmt="%g")
    assert ours.getvalue() == theirs.getvalue()


@array_function_dispatch(lambda a, *args, **kwargs: (a,))
def _counted(a, *args, **kwargs):
    _counted.calls += 1
    return None


@pytest.mark.parametrize("call", [lambda x: _counted(x), lambda x: _counted(x, x),
                                  lambda x: _counted(x, other=x), lambda x: _counted([x, x])])
@pytest.mark.parametrize("read_only", [True, False])
def test_a_function_returning_none_runs_once(m, monkeypatch, call, read_only):
    if read_only:
        monkeypatch.setattr(dispatch, "_WRITES_KNOWN", dispatch._WRITES_KNOWN | {_counted})
    x = ca.asarray(np.arange(4.0), manager=m)
    _counted.calls = 0
    assert call(x) is None
    assert _counted.calls == 1


# ---- np.concatenate with dtype= --------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [dict(dtype=np.float32), dict(dtype=np.int32,
                                                                 casting="unsafe"),
                                    dict(dtype=np.int32), dict(dtype=complex, axis=None),
                                    dict(dtype="U"), dict(dtype=np.float16, casting="unsafe")])
@pytest.mark.parametrize("place", ["one manager", "with an ndarray", "two managers"])
def test_concatenate_with_dtype_matches_numpy(make_manager, kwargs, place):
    a, b = np.array([1.5, 2.5]), np.array([3, 4])
    m = make_manager()
    x = ca.asarray(a, manager=m)
    y = {"one manager": lambda: ca.asarray(b, manager=m), "with an ndarray": lambda: b,
         "two managers": lambda: ca.asarray(b, manager=make_manager())}[place]()
    assert _outcome(lambda: np.concatenate([x, y], **kwargs)) == \
        _outcome(lambda: np.concatenate([a, b], **kwargs))


# ---- ufunc outputs given as None are made, as NumPy makes them -------------------------------

@pytest.mark.parametrize("call", [
    lambda x, e: np.divmod(x, 2.0, out=(e(), None)),
    lambda x, e: np.divmod(x, 2.0, out=(None, e())),
    lambda x, e: np.divmod(x, 2.0, out=(None, None)),
    lambda x, e: np.modf(x, out=(None, e())),
    lambda x, e: np.frexp(x, out=(e(), None)),
])
def test_ufunc_outputs_given_as_none_are_made(m, call):
    a = np.array([7.0, -7.5, 3.25])
    expected = call(a, lambda: np.empty(3))
    got = call(ca.asarray(a, manager=m), lambda: ca.empty(3, manager=m))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert isinstance(g, ca.CachedArray)
        np.testing.assert_array_equal(np.asarray(g), e)
        assert np.asarray(g).dtype == e.dtype


# ---- views NumPy makes read-only refuse writes -----------------------------------------------

READ_ONLY_VIEWS = {
    "broadcast_to": lambda a: np.broadcast_to(a, (2, 4, 4)),
    "broadcast_to row": lambda a: np.broadcast_to(a, (2, 4, 4))[1],
    "broadcast_to transposed": lambda a: np.broadcast_to(a, (2, 4, 4)).T,
    "sliding_window_view": lambda a: np.lib.stride_tricks.sliding_window_view(a, (2, 2)),
    "diagonal method": lambda a: a.diagonal(),
    "np.diagonal": lambda a: np.diagonal(a),
    "diagonal sliced": lambda a: a.diagonal()[1:],
    "imag of a real array": lambda a: a.imag,
    "view of a diagonal": lambda a: a.diagonal().view(),
}
WRITES = {
    "x[i] = scalar": lambda v: v.__setitem__((0,) * v.ndim, 99.0),
    "x[...] = array": lambda v: v.__setitem__(Ellipsis, np.ones(v.shape)),
    "fill": lambda v: v.fill(7.0),
    "+=": lambda v: v.__iadd__(1.0),
    "ufunc out=": lambda v: np.add(v, 1.0, out=v),
    "copyto": lambda v: np.copyto(v, 5.0),
    "flat": lambda v: v.flat.__setitem__(0, 3.0),
    "sort": lambda v: v.sort(),
    "put": lambda v: v.put(0, 1.0),
}


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("make", READ_ONLY_VIEWS)
def test_a_view_numpy_makes_read_only_refuses_writes(m, make, write):
    a = np.arange(16.0).reshape(4, 4)
    x = ca.asarray(a, manager=m)
    view, expected = READ_ONLY_VIEWS[make](x), READ_ONLY_VIEWS[make](a)
    assert not expected.flags.writeable and not view.flags.writeable
    with pytest.raises(ValueError) as theirs:
        WRITES[write](expected)
    with pytest.raises(ValueError) as ours:
        WRITES[write](view)
    assert str(ours.value) == str(theirs.value)
    np.testing.assert_array_equal(np.asarray(x), np.arange(16.0).reshape(4, 4))
    np.testing.assert_array_equal(np.asarray(view), expected)
    assert x.object._pins == 0


def test_a_read_only_view_reads_and_copies_as_any_array(m):
    a = np.arange(16.0).reshape(4, 4)
    x = ca.asarray(a, manager=m)
    d, b = x.diagonal(), np.broadcast_to(x[0], (3, 4))
    np.testing.assert_array_equal(np.asarray(d + 1), a.diagonal() + 1)
    assert float(d.sum()) == a.diagonal().sum() and float(np.sum(b)) == 3 * a[0].sum()
    c = d.copy()
    c[0] = -1.0
    assert c.flags.writeable and float(c[0]) == -1.0 and float(x[0, 0]) == 0.0
    x[1, 1] = 50.0                                 # a write to the base shows in its views
    assert float(d[1]) == 50.0 and x.flags.writeable and x[1:].flags.writeable
