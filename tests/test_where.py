"""np.where(condition, x, y) on CachedArrays: the branch-free select into a policy-placed
result matches NumPy for every dtype, scalar and ISA; the forms it does not take go the general
path; the C select refuses operands it cannot read."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cachedarrays as ca
from cachedarrays import _records
from cachedarrays.routines import selection
from helpers import refuse_general_path

def _available_isas():
    old = _records.select_isa()
    out = []
    for isa in ("avx512", "avx2", "sse2"):
        try:
            _records.set_select_isa(isa)
            out.append(isa)
        except ValueError:
            pass
    _records.set_select_isa(old)
    return out


ISAS = _available_isas()
DTYPES = [np.bool_, np.int8, np.uint16, np.float16, np.int32, np.float32, np.float64, np.int64,
          np.complex64, np.complex128, np.longdouble, "S3", "U2", "M8[s]",
          [("a", "i4"), ("b", "u1")]]
SCALARS = [0, 1.5, True, 2 + 1j, np.float32(2.5), np.int16(-3), 1000, np.array(3, np.int16),
           np.array(7.0)]


@pytest.fixture(params=ISAS)
def isa(request):
    old = _records.select_isa()
    _records.set_select_isa(request.param)
    yield request.param
    _records.set_select_isa(old)


@pytest.fixture
def fast_only(monkeypatch):
    """Fail any call that would leave the select for the general path."""
    refuse_general_path(monkeypatch, selection, "np.where took the general path")


def _outcome(f):
    try:
        return f()
    except Exception as e:          # NumPy's error, to compare by type
        return e


def _same(want, got):
    if isinstance(want, Exception):
        assert type(got) is type(want), (want, got)
        return
    assert isinstance(got, ca.CachedArray), type(got)
    g = np.asarray(got)
    assert g.dtype == want.dtype and g.shape == want.shape
    np.testing.assert_array_equal(g, want)


def _data(dt, shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.random(shape) * 100).astype(dt)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 33, 1000])
def test_arrays_of_every_dtype_match_numpy(m, isa, fast_only, dt, n):
    c = np.random.default_rng(n).random(n) > .5
    x, y = _data(dt, n, 1), _data(dt, n, 2)
    cx, cy, cc = (ca.asarray(a, manager=m) for a in (x, y, c))
    _same(np.where(c, x, y), np.where(cc, cx, cy))
    _same(np.where(c, x, y), np.where(c, cx, y))          # ndarrays mixed in
    _same(np.where(c, x, y), np.where(cc, x, cy))
    np.testing.assert_array_equal(np.asarray(cx), x)       # inputs untouched


@pytest.mark.parametrize("dt", [np.int8, np.uint16, np.float32, np.float64, np.complex64, "S3"],
                         ids=str)
@pytest.mark.parametrize("s", SCALARS, ids=repr)
def test_scalars_promote_and_cast_as_numpy_does(m, isa, dt, s):
    c = np.random.default_rng(3).random(40) > .5
    x = _data(dt, 40, 4)
    cx, cc = ca.asarray(x, manager=m), ca.asarray(c, manager=m)
    _same(_outcome(lambda: np.where(c, x, s)), _outcome(lambda: np.where(cc, cx, s)))
    _same(_outcome(lambda: np.where(c, s, x)), _outcome(lambda: np.where(cc, s, cx)))
    _same(_outcome(lambda: np.where(c, s, s)), _outcome(lambda: np.where(cc, s, s)))


def test_an_out_of_range_scalar_becomes_what_numpy_makes_of_it(m, fast_only):
    c, x = np.zeros(4, bool), np.arange(4, dtype=np.int8)
    cc, cx = ca.asarray(c, manager=m), ca.asarray(x, manager=m)
    _same(np.where(c, x, 1000), np.where(cc, cx, 1000))


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 5), (0,), (4, 0)])
def test_shapes_in_c_order_take_the_select(m, fast_only, shape):
    c = np.random.default_rng(0).random(shape) > .3
    x, y = _data(np.float64, shape, 5), _data(np.float64, shape, 6)
    cx, cy, cc = (ca.asarray(a, manager=m) for a in (x, y, c))
    r = np.where(cc, cx, cy)
    _same(np.where(c, x, y), r)
    assert r.flags.c_contiguous and r.manager is m


def test_views_with_an_offset_read_their_own_elements(m, fast_only):
    a = np.arange(20.0)
    c = a % 3 == 0
    x, cc = ca.asarray(a, manager=m), ca.asarray(c, manager=m)
    _same(np.where(c[5:15], a[2:12], -a[5:15]), np.where(cc[5:15], x[2:12], -x[5:15]))


@pytest.mark.parametrize("call", [
    lambda np_, c, x, y: np_.where(c),                                  # one argument
    lambda np_, c, x, y: np_.where(c[:, :1], x, y),                      # broadcasting
    lambda np_, c, x, y: np_.where(c, x[:, ::-1], y),                    # not C order
    lambda np_, c, x, y: np_.where(c, x.astype(np.float32), y),          # a cast
    lambda np_, c, x, y: np_.where(c.astype(np.int8), x, y),             # not bool
    lambda np_, c, x, y: np_.where(c, x, None),                          # object result
    lambda np_, c, x, y: np_.where(c[0, 0], x, y),                       # 0-d condition
    lambda np_, c, x, y: np_.where(c, [1.0] * 4, y),                     # a list
])
def test_other_forms_take_the_general_path(m, call):
    rng = np.random.default_rng(9)
    c, x, y = rng.random((3, 4)) > .5, rng.random((3, 4)), rng.random((3, 4))
    cc, cx, cy = (ca.asarray(a, manager=m) for a in (c, x, y))
    want = call(np, c, x, y)
    got = call(np, cc, cx, cy)
    if isinstance(want, tuple):
        assert len(got) == len(want)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(g), w)
    elif isinstance(got, ca.CachedArray):
        _same(want, got)
    else:
        np.testing.assert_array_equal(got, want)


def test_arrays_of_two_managers_take_the_general_path(m, make_manager):
    other = make_manager()
    c = np.arange(6) % 2 == 0
    cc, cx = ca.asarray(c, manager=m), ca.asarray(np.arange(6.0), manager=other)
    np.testing.assert_array_equal(np.asarray(np.where(cc, cx, -1.0)),
                                  np.where(c, np.arange(6.0), -1.0))


def test_a_busy_manager_runs_the_same_select_and_traces_it(m):
    c = np.arange(10) % 3 == 0
    x, y = np.arange(10.0), -np.arange(10.0)
    cc, cx, cy = (ca.asarray(a, manager=m) for a in (c, x, y))
    with ca.trace(m) as t:
        r = np.where(cc, cx, cy)
    _same(np.where(c, x, y), r)
    assert [k[0] for k in t.kernels] == ["where"]


def test_a_freed_operand_is_refused(m):
    cc = ca.asarray(np.ones(4, bool), manager=m)
    cx = ca.asarray(np.arange(4.0), manager=m)
    ca.unsafe_free(cx)
    with pytest.raises(ca.UseAfterFreeError):
        np.where(cc, cx, 0.0)


def test_results_are_placed_and_freed_like_any_result(m):
    c = np.arange(100) % 2 == 0
    cc, cx = ca.asarray(c, manager=m), ca.asarray(np.arange(100.0), manager=m)
    used = m.fast.stats()["used"]
    for _ in range(50):
        r = np.where(cc, cx, 0.0)
        assert set(r.object.regions) == {"fast"}
        del r
    m.drain()
    assert m.fast.stats()["used"] == used
    m.fast.heap.check()


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 300), dt=st.sampled_from(["i1", "u2", "f4", "f8", "c16", "S5", "V3"]),
       seed=st.integers(0, 2 ** 16), scalar=st.sampled_from([None, "x", "y"]),
       isa=st.sampled_from(ISAS))
def test_select_matches_numpy_on_random_masks(n, dt, seed, scalar, isa):
    rng = np.random.default_rng(seed)
    c = rng.random(n) > rng.random()
    x = rng.integers(0, 255, n * np.dtype(dt).itemsize, dtype=np.uint8).view(dt)
    y = rng.integers(0, 255, n * np.dtype(dt).itemsize, dtype=np.uint8).view(dt)
    xs = x[:1] if scalar == "x" and n else x
    ys = y[:1] if scalar == "y" and n else y
    out = np.empty(n, dt)
    old = _records.select_isa()
    _records.set_select_isa(isa)
    try:
        _records.select(c, xs, ys, out=out)
    finally:
        _records.set_select_isa(old)
    assert out.tobytes() == np.where(c, xs, ys).tobytes()


def test_select_refuses_what_it_cannot_read():
    c, x, y, out = np.ones(4, bool), np.zeros(4), np.ones(4), np.empty(4)
    sel = _records.select
    for args, kw, err in [
            ((c, x, y), {}, TypeError),
            ((c, x), {"out": out}, TypeError),
            ((c, x, y), {"dest": out}, TypeError),
            ((c.astype(np.int8), x, y), {"out": out}, TypeError),
            ((c[:3], x, y), {"out": out}, TypeError),
            ((c, x.astype(np.float32), y), {"out": out}, TypeError),
            ((c, np.zeros(8)[::2], y), {"out": out}, TypeError),
            ((c, np.zeros(3), y), {"out": out}, ValueError),
            ((c, [0.0] * 4, y), {"out": out}, TypeError),
            ((c, x, y), {"out": np.empty(8)[::2]}, TypeError),
            ((c, x, y), {"out": np.empty(4, object)}, TypeError),
            ((c[:3], out[1:], y[1:]), {"out": out[:3]}, ValueError),  # overlapping
            ((c, out[:1], y), {"out": out}, ValueError),              # a scalar inside out
            ((c, x, out[3:]), {"out": out}, ValueError),
    ]:
        with pytest.raises(err):
            sel(*args, **kw)
    ro = np.empty(4)
    ro.flags.writeable = False
    with pytest.raises(TypeError):
        sel(c, x, y, out=ro)
    assert sel(c, out, y, out=out) is out               # out may be x itself
    with pytest.raises(ValueError):
        _records.set_select_isa("avx9000")
