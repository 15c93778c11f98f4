"""Dtypes that differ only in metadata: results keep NumPy's metadata whichever came first.

``np.dtype("f8", metadata={...}) == np.dtype("f8")``, and both hash alike, so a cache keyed on
dtypes (result layouts, ufunc plans, resolved result dtypes, running totals' dtypes) would give
one the other's entry: a plain array's result would carry the metadata, or an annotated array's
would lose it. Each order runs in a fresh interpreter, whose caches start empty.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cachedarrays as ca

SCRIPT = r'''
import sys
import numpy as np
import cachedarrays as ca

m = ca.Manager(fast=1 << 20, slow=1 << 20)
meta = np.dtype("f8", metadata={"unit": "m"})
n = np.arange(1.0, 4.0).astype(meta)
p = np.arange(1.0, 4.0)
x = ca.asarray(n, manager=m)
y = ca.asarray(p, manager=m)


def made(dt, fill):
    return lambda a, b: (fill(dt(a)) if isinstance(a, np.ndarray)
                         else fill(dt(a), manager=m))


CALLS = {
    "a + a": lambda a, b: a + a,
    "a + b": lambda a, b: a + b,
    "a * 2.0": lambda a, b: a * 2.0,
    "2.0 * a": lambda a, b: 2.0 * a,
    "-a": lambda a, b: -a,
    "a + np.float64(1)": lambda a, b: a + np.float64(1),
    "np.add(a, a)": lambda a, b: np.add(a, a),
    "np.add(a, b, where=True)": lambda a, b: np.add(a, b, where=True),
    "np.sqrt(a)": lambda a, b: np.sqrt(a),
    "np.multiply.outer(a, a)": lambda a, b: np.multiply.outer(a, a),
    "np.where(a > 1, a, a)": lambda a, b: np.where(a > 1, a, a),
    "np.cumsum(a)": lambda a, b: np.cumsum(a),
    "np.cumprod(a)": lambda a, b: np.cumprod(a),
    "np.clip(a, 0, 1)": lambda a, b: np.clip(a, 0, 1),
    "np.round(a, 1)": lambda a, b: np.round(a, 1),
    "np.diff(a)": lambda a, b: np.diff(a),
    "np.sort(a)": lambda a, b: np.sort(a),
    "a.copy()": lambda a, b: a.copy(),
    "np.zeros_like(a)": lambda a, b: np.zeros_like(a),
    "a[[0, 2]]": lambda a, b: a[np.array([0, 2])],
    "np.roll(a, 1)": lambda a, b: np.roll(a, 1),
    "a.sum(keepdims=True)": lambda a, b: a.sum(keepdims=True),
    "empty(3, a.dtype)": lambda a, b: (np.empty(3, a.dtype) if isinstance(a, np.ndarray)
                                       else ca.empty(3, dtype=a.dtype, manager=m)),
    "zeros(3, a.dtype)": lambda a, b: (np.zeros(3, a.dtype) if isinstance(a, np.ndarray)
                                       else ca.zeros(3, dtype=a.dtype, manager=m)),
    "full(3, 1.0, a.dtype)": lambda a, b: (np.full(3, 1.0, a.dtype) if isinstance(a, np.ndarray)
                                           else ca.full(3, 1.0, dtype=a.dtype, manager=m)),
}

first = sys.argv[1]
order = [(x, y, n, p), (y, x, p, n)] if first == "metadata" else [(y, x, p, n), (x, y, n, p)]
wrong = []
for name, call in CALLS.items():
    for a, b, na, nb in order:
        got, want = call(a, b), call(na, nb)
        if got.dtype.metadata != want.dtype.metadata:
            which = "metadata" if a is x else "plain"
            wrong.append(f"{name} on the {which} array: {got.dtype.metadata} where NumPy "
                         f"gives {want.dtype.metadata}")
print("\n".join(wrong) or "ok")
'''


@pytest.mark.parametrize("first", ["metadata", "plain"])
def test_results_keep_numpys_metadata_whichever_dtype_came_first(first):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), first],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok", r.stdout


def test_creation_with_equal_dtypes_in_turn_keeps_each_ones_metadata(m):
    plain = np.dtype("f4")
    for k in range(3):
        meta = np.dtype("f4", metadata={"k": k})
        for dt in (plain, meta, plain):
            for make in (ca.empty, ca.zeros, ca.ones):
                assert make((2, 3), dtype=dt, manager=m).dtype.metadata == dt.metadata
            assert ca.full(4, 2.0, dtype=dt, manager=m).dtype.metadata == dt.metadata


def test_a_field_s_metadata_is_kept(m):
    inner = np.dtype("f8", metadata={"unit": "s"})
    for dt in (np.dtype([("t", "f8")]), np.dtype([("t", inner)]), np.dtype([("t", "f8")])):
        got = ca.zeros(3, dtype=dt, manager=m).dtype
        assert got.fields["t"][0].metadata == dt.fields["t"][0].metadata
