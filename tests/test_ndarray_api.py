"""Every public name of np.ndarray works on a CachedArray as on the ndarray, or says why not.

In-place methods mark the array written, so an eviction after them writes back instead of
dropping the change.
"""

import io
import pickle
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from helpers import assert_eq, same

PUBLIC = sorted(n for n in dir(np.ndarray) if not n.startswith("_"))

# Names that cannot be supported, and the reason each refusal gives.
REFUSED = {
    "ctypes": "stale",
    "data": "stale",
}

# Names whose meaning differs by design.
DIFFERENT = {
    "device": "where the newest copy lives: 'fast' or 'slow' (see the design's public API)",
}

GRID = np.arange(12.0).reshape(3, 4)
SHUFFLED = np.array([[5.0, 1.0, 4.0, 2.0], [9.0, 0.0, 3.0, 7.0], [8.0, 6.0, 11.0, 10.0]])
COMPLEX = np.array([1 + 2j, 3 - 4j, -5j])
RECORDS = np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i4"), ("b", "f8")])

# name -> calls f(array) whose results must match for the ndarray and the CachedArray.
CALLS = {
    "T": [lambda a: a.T],
    "mT": [lambda a: a.mT],
    "all": [lambda a: a.all(), lambda a: (a > 2).all(axis=0)],
    "any": [lambda a: a.any(axis=1, keepdims=True)],
    "argmax": [lambda a: a.argmax(), lambda a: a.argmax(axis=1)],
    "argmin": [lambda a: a.argmin(axis=0)],
    "argpartition": [lambda a: np.sort(a.argpartition(1, axis=None)[:2])],
    "argsort": [lambda a: a.argsort(axis=1), lambda a: a.argsort(axis=None, stable=True)],
    "astype": [lambda a: a.astype(np.int32), lambda a: a.astype("f4", order="F", copy=True),
               lambda a: a.astype(a.dtype, copy=False) is a, lambda a: a.astype(int, subok=True)],
    "base": [lambda a: a.base is None, lambda a: a[1:].base is None],
    "byteswap": [lambda a: a.byteswap(), lambda a: a.byteswap().byteswap()],
    "choose": [lambda a: (a[:2, :3] % 3).astype(int).choose([10, 20, 30]),
               lambda a: (a[:2, :3] % 3).astype(int).choose([a[0, :3], a[1, :3], a[2, :3]])],
    "clip": [lambda a: a.clip(2, 7)],
    "compress": [lambda a: a.compress([True, False, True], axis=0)],
    "conj": [lambda a: (a * 1j).conj()],
    "conjugate": [lambda a: (a + 1j).conjugate()],
    "copy": [lambda a: a.copy(), lambda a: a.copy(order="F").strides],
    "cumprod": [lambda a: (a + 1).cumprod(axis=1)],
    "cumsum": [lambda a: a.cumsum(), lambda a: a.cumsum(axis=0, dtype=np.int64)],
    "diagonal": [lambda a: a.diagonal(), lambda a: a.diagonal(1)],
    "dot": [lambda a: a.dot(a.T), lambda a: a[0].dot(a[1])],
    "dtype": [lambda a: a.dtype],
    "dump": [lambda a: _dump_and_load(a)],
    "dumps": [lambda a: pickle.loads(a.dumps())],
    "fill": [lambda a: _filled(a, 3.5)],
    "flags": [lambda a: (a.flags.c_contiguous, a.flags["F_CONTIGUOUS"], a.T.flags.fnc,
                         a[:, 1].flags.forc, a.flags.writeable, a.flags.aligned)],
    "flat": [lambda a: list(a.flat), lambda a: a.flat[5], lambda a: a.flat[2:7],
             lambda a: len(a.flat), lambda a: a.T.flat[[1, 2]]],
    "flatten": [lambda a: a.flatten(), lambda a: a.flatten("F")],
    "getfield": [lambda a: a.getfield(np.float32, 4)],
    "imag": [lambda a: (a * 1j).imag, lambda a: a.imag],
    "item": [lambda a: a.item(3), lambda a: a.item(1, 2)],
    "itemsize": [lambda a: a.itemsize],
    "max": [lambda a: a.max(), lambda a: a.max(axis=0, initial=100.0)],
    "mean": [lambda a: a.mean(), lambda a: a.mean(axis=1)],
    "min": [lambda a: a.min(axis=1, keepdims=True)],
    "nbytes": [lambda a: a.nbytes],
    "ndim": [lambda a: a.ndim],
    "nonzero": [lambda a: a.nonzero()],
    "partition": [lambda a: _inplace(a, lambda b: b.partition(1, axis=1))[:, :1]],
    "prod": [lambda a: (a + 1).prod(axis=0)],
    "put": [lambda a: _inplace(a, lambda b: b.put([0, 5], [-1.0, -2.0]))],
    "ravel": [lambda a: a.ravel(), lambda a: a.T.ravel("K")],
    "real": [lambda a: (a + 1j).real],
    "repeat": [lambda a: a.repeat(2, axis=0)],
    "reshape": [lambda a: a.reshape(4, 3), lambda a: a.reshape((2, -1), order="F"),
                lambda a: a.reshape(12, copy=True), lambda a: a[:, :2].reshape(6, copy=None)],
    "resize": [lambda a: _inplace(a, lambda b: b.resize((4, 4), refcheck=False)),
               lambda a: _inplace(a, lambda b: b.resize(5, refcheck=False))],
    "round": [lambda a: (a / 7).round(2)],
    "searchsorted": [lambda a: a.ravel().searchsorted([3.5, 0, 20])],
    "setfield": [lambda a: _inplace(a, lambda b: b.setfield(7.0, np.float64))],
    "setflags": [lambda a: a.setflags(write=True)],
    "shape": [lambda a: a.shape],
    "size": [lambda a: a.size],
    "sort": [lambda a: _inplace(a, lambda b: b.sort(axis=0))],
    "squeeze": [lambda a: a[:1].squeeze()],
    "std": [lambda a: a.std(ddof=1)],
    "strides": [lambda a: a.strides, lambda a: a[:, ::2].strides],
    "sum": [lambda a: a.sum(), lambda a: a.sum(axis=1, dtype=np.float32)],
    "swapaxes": [lambda a: a.swapaxes(0, 1)],
    "take": [lambda a: a.take([0, 5, 11]), lambda a: a.take([2, 0], axis=0)],
    "to_device": [lambda a: a.to_device("cpu") is a],
    "tobytes": [lambda a: a.tobytes(), lambda a: a.tobytes("F")],
    "tofile": [lambda a: _tofile(a), lambda a: _tofile(a.T, sep=",", format="%.1f")],
    "tolist": [lambda a: a.tolist()],
    "trace": [lambda a: a.trace()],
    "transpose": [lambda a: a.transpose(), lambda a: a.transpose(1, 0)],
    "var": [lambda a: a.var(axis=0)],
    "view": [lambda a: a.view(np.int64), lambda a: a.view(), lambda a: a.view("i4", type(a))],
}


def _inplace(a, op):
    """The array after running an in-place method on a copy of it."""
    b = a.copy()
    assert op(b) is None
    return b


def _filled(a, value):
    return _inplace(a, lambda b: b.fill(value))


def _dump_and_load(a):
    f = io.BytesIO()
    a.dump(f)
    return pickle.loads(f.getvalue())


def _tofile(a, **kw):
    with tempfile.TemporaryFile() as f:
        a.tofile(f, **kw)
        f.seek(0)
        return f.read()


def test_every_public_ndarray_name_is_on_cached_array():
    missing = [n for n in PUBLIC if not hasattr(ca.CachedArray, n)]
    assert not missing


def test_every_public_ndarray_name_is_checked_here():
    unchecked = set(PUBLIC) - set(CALLS) - set(REFUSED) - set(DIFFERENT)
    assert not unchecked


@pytest.mark.parametrize("name", sorted(CALLS))
def test_method_gives_numpys_result(m, name):
    for call in CALLS[name]:
        a = SHUFFLED if name in ("sort", "partition", "argsort", "argpartition") else GRID
        same(call(ca.asarray(a, manager=m)), call(a.copy()))


def test_complex_parts_and_fields_give_numpys_results(m):
    z = ca.asarray(COMPLEX, manager=m)
    same(z.real, COMPLEX.real)
    same(z.imag, COMPLEX.imag)
    same(z.conj(), COMPLEX.conj())
    r = ca.asarray(RECORDS, manager=m)
    same(r.getfield(np.float64, 4), RECORDS.getfield(np.float64, 4))
    same(r.byteswap(), RECORDS.byteswap())


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_raw_pointer_attributes_are_refused_with_the_reason(m, name):
    x = ca.zeros(3, manager=m)
    with pytest.raises(TypeError, match=rf"{REFUSED[name]}.*ca\.readable"):
        getattr(x, name)
    with ca.readable(x) as a:                   # the supported way: inside a pinned scope
        assert getattr(a, name) is not None


def test_views_as_ndarray_are_refused_with_the_reason(m):
    x = ca.zeros(3, manager=m)
    for view in (lambda: x.view(np.ndarray), lambda: x.view(np.float32, np.ndarray)):
        with pytest.raises(TypeError, match="stale.*ca.readable"):
            view()


def test_reshape_without_copy_refuses_as_numpy_does(m):
    with pytest.raises(ValueError, match="copy"):
        GRID.T.reshape(12, copy=False)
    with pytest.raises(ValueError, match="copy"):
        ca.asarray(GRID, manager=m).T.reshape(12, copy=False)


def test_device_names_the_tier(m):
    x = ca.zeros(3, manager=m)
    assert x.device in ("fast", "slow")
    assert np.zeros(3).device == "cpu"


def test_flags_cannot_be_changed(m):
    x = ca.zeros(3, manager=m)
    x.setflags(write=True)
    x.flags.writeable = True
    with pytest.raises(TypeError, match="ca.readable"):
        x.setflags(write=False)
    with pytest.raises(TypeError, match="flags cannot be set"):
        x.flags.writeable = False
    with pytest.raises(TypeError, match="flags cannot be set"):
        x.flags["A"] = False


def test_settable_attributes_behave_as_numpys(m):
    for a in (GRID.copy(), ca.asarray(GRID, manager=m)):
        a.shape = (4, 3)
        assert a.shape == (4, 3)
        a.dtype = np.int64
        assert (a.dtype, a.shape) == (np.dtype(np.int64), (4, 3))
        a.dtype = np.float64
        a.real = 2.0
        assert np.asarray(a).tolist() == [[2.0] * 3] * 4
        with pytest.raises(TypeError, match="imaginary"):
            a.imag = 1.0
        with pytest.raises(AttributeError):
            a.T.shape = 12
    for z in (COMPLEX.copy(), ca.asarray(COMPLEX, manager=m)):
        z.imag = 7.0
        assert np.asarray(z).tolist() == [1 + 7j, 3 + 7j, 7j]


def test_view_of_a_slice_has_a_base_and_cannot_be_resized(m):
    x = ca.asarray(GRID, manager=m)
    assert x.base is None and x[1:].base is x
    with pytest.raises(ValueError, match="view"):
        x[1:].resize(3)


def test_an_array_in_use_cannot_be_resized(m):
    x = ca.asarray(GRID, manager=m)
    with ca.readable(x):
        with pytest.raises(ValueError, match="in use"):
            x.resize(20)
    x.resize(20)
    assert x.shape == (20,) and m.pin_count(x.object) == 0


def test_to_device_accepts_only_the_cpu(m):
    x = ca.zeros(3, manager=m)
    with pytest.raises(ValueError, match="cpu"):
        x.to_device("gpu")


def test_tofile_writes_what_numpy_writes(m, tmp_path):
    x = ca.asarray(GRID, manager=m)
    x.tofile(tmp_path / "c.bin")
    GRID.tofile(tmp_path / "n.bin")
    assert (tmp_path / "c.bin").read_bytes() == (tmp_path / "n.bin").read_bytes()
    x.tofile(str(tmp_path / "c.txt"), sep=",", format="%.1f")
    GRID.tofile(str(tmp_path / "n.txt"), sep=",", format="%.1f")
    assert (tmp_path / "c.txt").read_text() == (tmp_path / "n.txt").read_text()


def test_dump_to_a_path_loads_back(m, tmp_path):
    x = ca.asarray(GRID, manager=m)
    x.dump(tmp_path / "x.pkl")
    same(pickle.loads((tmp_path / "x.pkl").read_bytes()), GRID)


def test_flat_iterates_in_c_order_across_chunks(m):
    data = np.arange(40000, dtype=np.int32).reshape(200, 200).T
    x = ca.asarray(data, manager=m)
    assert list(x.flat) == list(data.flat)
    assert m.pin_count(x.object) == 0


# ---- in-place methods across an evict / prefetch round trip ----------------------------------

INPLACE = {
    "fill": lambda a: a.fill(-1.0),
    "sort": lambda a: a.sort(axis=1),
    "partition": lambda a: a.partition(2, axis=None) if a.ndim == 1 else a.partition(2),
    "put": lambda a: a.put([0, 7], [100.0, 200.0]),
    "put from a CachedArray": lambda a: a.put([1, 2], a.ravel()[[10, 11]]),
    "resize": lambda a: a.resize((4, 5), refcheck=False),
    "setfield": lambda a: a.setfield(-3.0, np.float64),
    "byteswap(inplace=True)": lambda a: a.byteswap(inplace=True),
    "setitem": lambda a: a.__setitem__((1, 1), 55.0),
    "flat setitem": lambda a: a.flat.__setitem__(slice(3, 6), 9.0),
    "sort a view": lambda a: a[1].sort(),
    "fill a view": lambda a: a[:, 2].fill(8.0),
    "set real": lambda a: setattr(a, "real", 4.0),
    "set shape, then sort": lambda a: (setattr(a, "shape", (4, 3)), a.sort(axis=0)),
}


def written(m):
    return m.stats()["events"]["writebacks_elided"]["count"]


def test_a_clean_round_trip_elides_the_writeback(m):
    x = ca.asarray(SHUFFLED, manager=m)
    ca.evict(x)
    ca.prefetch(x, force=True)
    before = written(m)
    ca.evict(x)
    assert written(m) == before + 1          # the check below can see a skipped writeback


@pytest.mark.parametrize("name", sorted(INPLACE))
def test_inplace_method_is_written_back_at_eviction(m, name):
    op = INPLACE[name]
    expected = SHUFFLED.copy()
    op(expected)
    x = ca.asarray(SHUFFLED, manager=m)
    ca.evict(x)
    ca.prefetch(x, force=True)
    assert x.device == "fast"               # fast copy with a clean slow twin
    op(x)
    before = written(m)
    ca.evict(x)
    assert x.device == "slow"
    assert written(m) == before             # the change was copied back, not dropped
    assert_eq(x, expected, exact=True)
    ca.prefetch(x, force=True)
    assert_eq(x, expected, exact=True)


# name -> f(a): NumPy calls giving views of a, or new arrays (their base and owndata differ)
_BASE_OPS = {
    "slice": lambda a: a[1:], "whole slice": lambda a: a[:], "reversed": lambda a: a[::-1],
    "row": lambda a: a[0], "newaxis": lambda a: a[None], "ellipsis": lambda a: a[..., None],
    "T": lambda a: a.T, "reshape": lambda a: a.reshape(-1), "ravel": lambda a: a.ravel(),
    "view": lambda a: a.view(), "view dtype": lambda a: a.view(np.int64),
    "transpose": lambda a: np.transpose(a), "np.reshape": lambda a: np.reshape(a, (-1,)),
    "swapaxes": lambda a: a.swapaxes(0, -1), "squeeze": lambda a: np.squeeze(a),
    "expand_dims": lambda a: np.expand_dims(a, 0), "flip": lambda a: np.flip(a),
    "broadcast_to": lambda a: np.broadcast_to(a, (2,) + a.shape), "real": lambda a: a.real,
    "diagonal": lambda a: a.diagonal() if a.ndim > 1 else a[:],
    "atleast_2d": lambda a: np.atleast_2d(a), "copy": lambda a: a.copy(),
    "astype same": lambda a: a.astype(a.dtype, copy=False), "fancy": lambda a: a[[0]],
    "add": lambda a: a + 1, "flatten": lambda a: a.flatten(),
    "astype": lambda a: a.astype(np.float32),
}


@settings(max_examples=200, deadline=None)
@given(names=st.lists(st.sampled_from(sorted(_BASE_OPS)), min_size=1, max_size=3))
def test_base_and_owndata_of_views_and_copies_are_numpys(names):
    # code avoiding copies asks whether an array owns its data (a.flags.owndata, a.base is
    # None) or is a view of another (a.base is b): a view sharing the memory of its array,
    # x[:] and x.T too, must never claim to own it
    with ca.Manager(fast="1MiB", slow="8MiB") as m:
        want = [GRID.copy()]
        got = [ca.asarray(GRID, manager=m)]
        for name in names:
            try:
                w = _BASE_OPS[name](want[-1])
            except (IndexError, ValueError):     # a shape the call does not take
                break
            g = _BASE_OPS[name](got[-1])
            if not isinstance(w, np.ndarray):    # a scalar: the chain ends
                break
            assert (w is want[-1]) is (g is got[-1]), names     # the input itself
            want.append(w)
            got.append(g)
        # NumPy names the array owning a view's memory (its base), or a temporary of its own
        # (np.reshape of x.T copies into one): the first array of the chain with that owner is
        # the owner, and every later one a view of it
        owners = [w if w.base is None else w.base for w in want]
        for i in range(1, len(want)):
            w, g = want[i], got[i]
            if any(w is a for a in want[:i]):
                continue                             # the array itself (checked above)
            first = next(k for k in range(i + 1) if owners[k] is owners[i])
            if first == i:                           # new
                assert g.flags.owndata is True and g.base is None, names
            else:                                    # a view: base is the owner, as NumPy's
                assert g.flags.owndata is False and g.base is got[first], names
                assert w.flags.owndata is False
                if g.size:
                    assert np.shares_memory(g, g.base)


def test_a_view_cannot_be_resized_and_a_resized_arrays_views_name_its_old_object(m):
    x = ca.asarray(GRID, manager=m)
    for v in (x[:], x.T, x.reshape(12), x.view()):       # views of all of x, as NumPy refuses
        with pytest.raises(ValueError, match="view"):
            v.resize(20)
    y = x[1:]
    old = x.object
    x.resize(20)                                          # x moves to a new object
    assert x.base is None and y.base is old and not np.shares_memory(x, y)
