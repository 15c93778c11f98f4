"""ndarray arguments of NumPy calls that also take CachedArrays come back as NumPy gives them.

Functions NumPy documents as returning their input or a view of it (np.atleast_1d,
np.broadcast_arrays, np.meshgrid(copy=False), np.ix_, np.split with CachedArray indices, ...)
return an ndarray argument itself, or a view of it, so a write through the result reaches the
argument; only the results made from CachedArrays (or new arrays) are CachedArrays.
"""

import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca

# name -> f(np_, p, q): p and q are arrays of one shape (1-d, int); a call takes both
_CALLS = {
    "atleast_1d": lambda np_, p, q: np_.atleast_1d(p, q),
    "atleast_2d": lambda np_, p, q: np_.atleast_2d(p, q),
    "atleast_3d": lambda np_, p, q: np_.atleast_3d(p, q),
    "broadcast_arrays": lambda np_, p, q: np_.broadcast_arrays(p, q),
    "broadcast_arrays_2d": lambda np_, p, q: np_.broadcast_arrays(p[:, None], q),
    "meshgrid_view": lambda np_, p, q: np_.meshgrid(p, q, copy=False),
    "meshgrid_sparse": lambda np_, p, q: np_.meshgrid(p, q, copy=False, sparse=True),
    "ix_": lambda np_, p, q: np_.ix_(p, q),
    "split": lambda np_, p, q: np_.split(p, q[:1] % (len(p) + 1)),
    "array_split": lambda np_, p, q: np_.array_split(p, q[:2] % (len(p) + 1)),
    "hsplit": lambda np_, p, q: np_.hsplit(p, q[:1] % (len(p) + 1)),
    "atleast_1d_list": lambda np_, p, q: np_.atleast_1d(*[p, q, p]),
    "stack": lambda np_, p, q: np_.stack([p, q]),           # a new array: a CachedArray
    "atleast_2d_of_new": lambda np_, p, q: np_.atleast_2d(p + 0, q)[1],
}


def _leaves(r):
    return list(r) if isinstance(r, (tuple, list)) else [r]


def _views_of(w, orig):
    """True when NumPy's result w is orig or a view of it, whatever their sizes (a chain of
    bases: np.shares_memory says False for any empty array)."""
    while w is not orig and isinstance(w, np.ndarray) and isinstance(w.base, np.ndarray):
        w = w.base
    return w is orig


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(_CALLS)), n=st.integers(1, 5),
       cached=st.sampled_from(["q", "p", "both"]), order=st.booleans())
def test_a_result_numpy_makes_from_an_ndarray_argument_is_that_ndarray_or_its_view(
        name, n, cached, order):
    call = _CALLS[name]
    p0, q0 = np.arange(n) + 1, np.arange(n)[::-1].copy()
    if order:                                   # the ndarray argument second, the array first
        call = (lambda c: lambda np_, p, q: c(np_, q, p))(call)
    with ca.Manager(fast="1MiB", slow="8MiB") as m:
        p = ca.asarray(p0, manager=m) if cached in ("p", "both") else p0.copy()
        q = ca.asarray(q0, manager=m) if cached in ("q", "both") else q0.copy()
        want = call(np, p0, q0)
        got = call(np, p, q)
        assert len(_leaves(got)) == len(_leaves(want))
        for g, w in zip(_leaves(got), _leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), w)
        for g, w in zip(_leaves(got), _leaves(want)):
            plain = [arg for arg, orig in ((p, p0), (q, q0))
                     if isinstance(arg, np.ndarray) and _views_of(w, orig)]
            if plain:                           # NumPy's result is (a view of) that argument
                assert type(g) is np.ndarray, (name, type(g))
                assert _views_of(g, plain[0])
                if any(w is orig for orig in (p0, q0)):
                    assert g is plain[0]        # the argument itself, as NumPy returns it
                if g.size and g.flags._writeable_no_warn:
                    with warnings.catch_warnings():     # NumPy's for broadcast_arrays
                        warnings.simplefilter("ignore")
                        g[(0,) * g.ndim] = 99
                    assert 99 in plain[0]       # the write reached the argument
            else:
                assert isinstance(g, ca.CachedArray), (name, type(g))
        m.check()


def test_np_atleast_1d_returns_its_arguments_themselves_and_like_still_copies(m):
    x, a = np.arange(3.0), ca.asarray(np.arange(2.0), manager=m)
    x_out, a_out = np.atleast_1d(x, a)
    assert x_out is x and a_out is a             # as NumPy: its inputs, not copies
    for f in (np.asanyarray, np.ascontiguousarray, np.asarray, np.array):
        r = f(x, like=a)                         # like=: a new array on a's manager
        assert isinstance(r, ca.CachedArray) and r.manager is m
        np.testing.assert_array_equal(np.asarray(r), x)


def test_np_broadcast_arrays_of_cached_arrays_gives_no_numpy_warning(m):
    a = ca.asarray(np.arange(3.0), manager=m)
    b = ca.asarray(np.arange(2.0).reshape(2, 1), manager=m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = np.broadcast_arrays(a, b)
    assert [type(g) for g in got] == [ca.CachedArray, ca.CachedArray]
    np.testing.assert_array_equal(np.asarray(got[0]), np.broadcast_to(np.arange(3.0), (2, 3)))


def test_long_sequences_are_not_searched_for_arrays_and_results_match_numpy():
    from cachedarrays.wrapping import SEARCHED_ITEMS, plain_arrays
    x, y = np.arange(3.0), np.arange(2.0)
    assert [id(a) for a in plain_arrays([x, [y, 1], (2, y)], [])] == [id(x), id(y), id(y)]
    assert plain_arrays([list(range(SEARCHED_ITEMS)) + [x]], []) == []
    m = ca.Manager(fast="1MiB", slow="8MiB")
    try:
        a = ca.asarray(np.arange(10), manager=m)
        many = list(range(0, 100_000, 3))
        np.testing.assert_array_equal(np.isin(a, many), np.isin(np.arange(10), many))
    finally:
        m.close()


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(_CALLS)), n=st.integers(0, 4), empty=st.booleans(),
       cached=st.sampled_from(["q", "p", "both"]), order=st.booleans())
def test_an_empty_ndarray_argument_comes_back_as_a_non_empty_one_does(name, n, empty, cached,
                                                                      order):
    call = _CALLS[name]
    p0, q0 = np.arange(n) + 1, np.arange(n)[::-1].copy()
    if empty:                                   # an empty argument beside a non-empty one
        p0 = p0[:0].copy()
    if order:
        call = (lambda c: lambda np_, p, q: c(np_, q, p))(call)
    try:
        want = call(np, p0, q0)
    except ValueError:                          # shapes NumPy itself refuses
        return
    with ca.Manager(fast="1MiB", slow="8MiB") as m:
        p = ca.asarray(p0, manager=m) if cached in ("p", "both") else p0.copy()
        q = ca.asarray(q0, manager=m) if cached in ("q", "both") else q0.copy()
        got = call(np, p, q)
        for g, w in zip(_leaves(got), _leaves(want)):
            plain = [arg for arg, orig in ((p, p0), (q, q0))
                     if isinstance(arg, np.ndarray) and _views_of(w, orig)]
            if plain:                           # NumPy's result is that argument or its view
                assert type(g) is np.ndarray, (name, g.shape, type(g))
                assert _views_of(g, plain[0])
            else:
                assert isinstance(g, ca.CachedArray), (name, g.shape, type(g))
            np.testing.assert_array_equal(np.asarray(g), w)
        m.check()
