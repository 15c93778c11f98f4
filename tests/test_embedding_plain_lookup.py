"""A SimpleTable lookup into a CachedArray with int64 indices and offsets goes to one kernel
that checks the offsets and indices itself (``kernels.lookup_sum_plain``); every other call
takes the general path.  Both must give the same sums and the same errors."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays.models.dlrm import embedding as E
from cachedarrays.models.dlrm import kernels as K

N, F = 50, 16


@pytest.fixture(scope="module")
def m():
    with ca.Manager(fast="32MiB", slow="64MiB") as manager:
        yield manager


@pytest.fixture(scope="module")
def table(m):
    init = np.random.default_rng(3).standard_normal((N, F)).astype(np.float32)
    return E.SimpleTable(N, F, manager=m, init=init, placement="fast", name="t")


def _plain_calls(monkeypatch):
    """Count the calls that reach lookup_sum_plain."""
    calls = []
    real = K.lookup_sum_plain

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(K, "lookup_sum_plain", counting)
    return calls


def _outcome(fn):
    try:
        return "ok", np.asarray(fn())
    except Exception as e:          # the type and the message are what must agree
        return type(e).__name__, str(e)


def _both(table, m, idx, off, nbags):
    """(outcome into a CachedArray: the kernel's own checks, outcome into an ndarray: the
    general path's)."""
    out = ca.zeros((nbags, F), dtype=np.float32, manager=m)
    fast = _outcome(lambda: table.lookup(idx, off, out))
    slow = _outcome(lambda: table.lookup(idx, off, np.zeros((nbags, F), np.float32)))
    return fast, slow


def _same(a, b):
    assert a[0] == b[0]
    if a[0] == "ok":
        np.testing.assert_array_equal(a[1], b[1])
    else:
        assert a[1] == b[1]


def test_the_common_call_takes_the_kernel_path_and_sums_like_the_general_one(table, m,
                                                                              monkeypatch):
    calls = _plain_calls(monkeypatch)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, N, 40)
    off = np.arange(0, 40, 4)
    fast, slow = _both(table, m, idx, off, 10)
    assert calls == [1]
    _same(fast, slow)
    with ca.readable(table.data) as t:
        want = t[idx].reshape(10, 4, F).sum(1)
    np.testing.assert_allclose(fast[1], want, rtol=1e-6, atol=1e-6)


BAD = {
    "first offset not 0": ([1, 2, 3, 4], [1, 2]),
    "offsets going down": ([1, 2, 3, 4], [0, 3, 2]),
    "negative offset": ([1, 2, 3, 4], [0, -1]),
    "offset past the indices": ([1, 2, 3, 4], [0, 2, 9]),
    "last of nbags+1 short": ([1, 2, 3, 4], [0, 1, 3]),
    "last of nbags+1 long": ([1, 2, 3, 4], [0, 1, 5]),
    "negative index": ([1, -2, 3, 4], [0, 2]),
    "index = rows": ([1, 2, N, 4], [0, 2]),
    "huge index": ([1, 2, 2**62, 4], [0, 2]),
    "bad offsets and bad indices": ([-1, N, 3, 4], [0, 3, 2]),
    "index in a bag past a bad offset": ([1, 2, 3, N], [0, 9]),
    "every bag empty": ([], [0, 0]),
    "an empty bag among others": ([1, 2, 3], [0, 0, 3]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_hostile_inputs_fail_or_pass_alike_on_both_paths(table, m, case):
    idx, off = BAD[case]
    idx, off = np.array(idx, dtype=np.int64), np.array(off, dtype=np.int64)
    nbags = 2 if case.startswith("last of") else len(off)
    fast, slow = _both(table, m, idx, off, nbags)
    _same(fast, slow)
    if case.startswith(("every", "an empty")):
        assert fast[0] == "ok"
    else:
        assert fast[0] in ("IndexError", "ValueError")


@pytest.mark.parametrize("kind", ["int32 indices", "strided indices", "column block out",
                                  "float64 out", "too few offsets", "context None"])
def test_other_calls_take_the_general_path_with_the_same_result(table, m, monkeypatch, kind):
    calls = _plain_calls(monkeypatch)
    rng = np.random.default_rng(1)
    idx = rng.integers(0, N, 24)
    off = np.arange(0, 24, 3)
    nbags, context = 8, E.FORWARD
    out = ca.zeros((nbags, F), dtype=np.float32, manager=m)
    if kind == "int32 indices":
        idx = idx.astype(np.int32)
    elif kind == "strided indices":
        idx = np.repeat(idx, 2)[::2]
    elif kind == "column block out":
        out = ca.zeros((nbags, 2 * F), dtype=np.float32, manager=m)[:, :F]
    elif kind == "float64 out":
        out = ca.zeros((nbags, F), dtype=np.float64, manager=m)
    elif kind == "too few offsets":
        off = off[:-2]
    elif kind == "context None":
        context = None
    got = _outcome(lambda: table.lookup(idx, off, out, context=context))
    want = _outcome(lambda: table.lookup(idx, off, np.zeros((nbags, F), np.float32),
                                         context=context))
    assert calls == []
    if kind == "float64 out":
        assert got[0] == "TypeError" and "float64" in got[1]
    else:
        _same(got, want)


def test_an_out_sharing_the_tables_memory_is_refused_on_the_kernel_path(table, m):
    view = table.data[:4]
    with pytest.raises(ValueError, match="shares memory with the table"):
        table.lookup(np.arange(8, dtype=np.int64), np.arange(0, 8, 2, dtype=np.int64), view)


def test_a_lookup_in_slow_memory_takes_the_kernel_path_and_counts_misses(m, monkeypatch):
    calls = _plain_calls(monkeypatch)
    init = np.arange(N * F, dtype=np.float32).reshape(N, F)
    t = E.SimpleTable(N, F, manager=m, init=init, placement="slow", name="slow")
    out = ca.zeros((2, F), dtype=np.float32, manager=m)
    t.lookup(np.array([0, 1, 2], dtype=np.int64), np.array([0, 1], dtype=np.int64), out)
    assert calls == [1]
    with ca.readable(out) as o:
        np.testing.assert_array_equal(o, [init[0], init[1] + init[2]])
    s = t.stats()
    assert s["lookups"] == 3 and s["hits"] + s["misses"] == 3


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_offsets_and_indices_agree_on_both_paths(table, m, data):
    nbags = data.draw(st.integers(1, 6), label="nbags")
    nidx = data.draw(st.integers(0, 12), label="nidx")
    idx = data.draw(st.lists(st.integers(-3, N + 2), min_size=nidx, max_size=nidx), label="idx")
    extra = data.draw(st.booleans(), label="nbags+1 offsets")
    off = data.draw(st.lists(st.integers(-2, nidx + 2), min_size=nbags + extra,
                             max_size=nbags + extra), label="offsets")
    if data.draw(st.booleans(), label="make them valid"):
        off = sorted(min(max(o, 0), nidx) for o in off)
        off[0] = 0
        if extra:
            off[-1] = nidx
        idx = [i % N for i in idx]
    fast, slow = _both(table, m, np.array(idx, dtype=np.int64), np.array(off, dtype=np.int64),
                       nbags)
    _same(fast, slow)


@pytest.mark.parametrize("nbags_plus_one", [False, True])
def test_a_lookup_without_out_takes_the_kernel_path_with_one_bag_per_offset(table, m,
                                                                             monkeypatch,
                                                                             nbags_plus_one):
    calls = _plain_calls(monkeypatch)
    idx = np.random.default_rng(4).integers(0, N, 12)
    off = np.arange(0, 13 if nbags_plus_one else 12, 3)
    got = table.lookup(idx, off)
    assert calls == [1] and isinstance(got, ca.CachedArray) and got.shape == (len(off), F)
    want = table.lookup(idx, off, np.zeros((len(off), F), np.float32))
    with ca.readable(got) as g:
        np.testing.assert_array_equal(g, want)
    with ca.readable(table.lookup(idx, off.astype(np.int32))) as g:   # the general path
        np.testing.assert_array_equal(g, want)
    assert calls == [1]
