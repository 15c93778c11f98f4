"""Synthetic DLRM inputs: Zipf or uniform indices scrambled per table by a maximal-length LFSR.

Dissertation §5.6.2: Zipf(α) ranks are mapped to rows through a maximum-length LFSR that starts
at a different phase for every table, so hot rows are spread over the table instead of sitting
at its start.  Batches use the ``embedding_bag`` convention of :mod:`.kernels`.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
from numba import njit

__all__ = [
    "LFSR_MASKS",
    "lfsr_step",
    "lfsr_period",
    "lfsr_is_maximal",
    "LFSRScrambler",
    "ZipfSampler",
    "Batch",
    "SyntheticDataset",
]

log = logging.getLogger(__name__)

#: Feedback masks of right-shift Galois LFSRs with period 2**w - 1, per width w.  Derived by a
#: search over masks with the fewest taps, accepting a mask when the step matrix M over GF(2)
#: satisfies M**(2**w-1) == I and M**((2**w-1)/q) != I for every prime q dividing 2**w-1
#: (:func:`lfsr_is_maximal` repeats that check; the tests also walk the small widths).
LFSR_MASKS = {
    2: 0x3, 3: 0x5, 4: 0x9, 5: 0x12, 6: 0x21, 7: 0x41,
    8: 0xC3, 9: 0x108, 10: 0x204, 11: 0x402, 12: 0x883, 13: 0x1013,
    14: 0x2803, 15: 0x4001, 16: 0x8805, 17: 0x10004, 18: 0x20040, 19: 0x40013,
    20: 0x80004, 21: 0x100002, 22: 0x200001, 23: 0x400010, 24: 0x800043, 25: 0x1000004,
    26: 0x2000023, 27: 0x4000013, 28: 0x8000004, 29: 0x10000002, 30: 0x20400003,
    31: 0x40000004, 32: 0x80200003, 33: 0x100001000, 34: 0x204000003, 35: 0x400000002,
    36: 0x800000400, 37: 0x1000000103, 38: 0x2000001005, 39: 0x4000000008, 40: 0x8400000003,
}


def _integer(value, what: str, low: int | None = None) -> int:
    """``value`` as an int (an integral float counts), refused below ``low``."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        if not (isinstance(value, (float, np.floating)) and float(value).is_integer()):
            raise TypeError(f"{what} must be an integer, got {value!r}") from None
        n = int(value)
    if low is not None and n < low:
        raise ValueError(f"{what} must be >= {low}, got {n}")
    return n


def _table_sizes(table_sizes) -> list:
    """The table sizes as ints >= 1 (a sequence of integers, not a string or a single number)."""
    if isinstance(table_sizes, (str, bytes)) or not hasattr(table_sizes, "__iter__"):
        raise TypeError(f"table_sizes must be a sequence of integers (rows per table), got "
                        f"{table_sizes!r}")
    sizes = [_integer(n, "a table size") for n in table_sizes]
    if any(n < 1 for n in sizes):
        raise ValueError(f"every table needs at least one row, got sizes {sizes}")
    return sizes


def _pooling(pooling) -> tuple:
    """``pooling`` (an int or an inclusive (lo, hi) range) as (lo, hi) with 0 <= lo <= hi."""
    if isinstance(pooling, (int, np.integer, float, np.floating)) and not isinstance(pooling, bool):
        lo = hi = _integer(pooling, "pooling")
    elif isinstance(pooling, (tuple, list, np.ndarray)) and len(pooling) == 2:
        lo, hi = (_integer(v, "pooling") for v in pooling)
    else:
        raise TypeError(f"pooling must be n >= 0 or a range (lo, hi) with 0 <= lo <= hi, "
                        f"got {pooling!r}")
    if not 0 <= lo <= hi:
        raise ValueError(f"pooling must be n >= 0 or a range (lo, hi) with 0 <= lo <= hi, "
                         f"got {pooling!r}")
    return lo, hi


def _mask(width: int, mask: int | None) -> int:
    if mask is not None:
        return mask
    if width not in LFSR_MASKS:
        raise ValueError(f"no LFSR mask for width {width}; supported widths are "
                         f"{min(LFSR_MASKS)}..{max(LFSR_MASKS)} (tables up to 2**40 - 1 rows)")
    return LFSR_MASKS[width]


def lfsr_step(state: int, width: int, mask: int | None = None) -> int:
    """One Galois step: shift right, and XOR the mask in when the bit shifted out was 1."""
    m = _mask(width, mask)
    return (state >> 1) ^ (m if state & 1 else 0)


def lfsr_period(width: int, mask: int | None = None, start: int = 1) -> int:
    """Steps until the LFSR returns to ``start`` (a brute-force walk; for small widths)."""
    m = _mask(width, mask)
    s = lfsr_step(start, width, m)
    n = 1
    while s != start:
        s = (s >> 1) ^ (m if s & 1 else 0)
        n += 1
        if n > (1 << width):
            raise ValueError(f"state {start} is not on a cycle of the width-{width} LFSR")
    return n


# --- GF(2) matrices as lists of column bit-vectors: column i is the image of state 1 << i ---


def _apply(cols, x: int) -> int:
    t, b = 0, 0
    while x:
        if x & 1:
            t ^= cols[b]
        x >>= 1
        b += 1
    return t


def _compose(a, b):
    return [_apply(a, c) for c in b]


def _matrix_power(width: int, mask: int, k: int):
    """Columns of M**k where M is the LFSR step (square-and-multiply, O(width**2 log k))."""
    result = [1 << i for i in range(width)]
    base = [(1 << i >> 1) ^ (mask if i == 0 else 0) for i in range(width)]
    while k:
        if k & 1:
            result = _compose(base, result)
        base = _compose(base, base)
        k >>= 1
    return result


def _prime_factors(n: int):
    out, d = set(), 2
    while d * d <= n:
        while n % d == 0:
            out.add(d)
            n //= d
        d += 1 if d == 2 else 2
    if n > 1:
        out.add(n)
    return out


def lfsr_is_maximal(width: int, mask: int | None = None) -> bool:
    """True when the LFSR's step matrix has multiplicative order 2**width - 1."""
    m = _mask(width, mask)
    ident = [1 << i for i in range(width)]
    p = (1 << width) - 1
    if _matrix_power(width, m, p) != ident:
        return False
    return all(_matrix_power(width, m, p // q) != ident for q in _prime_factors(p))


@njit(cache=True, nogil=True)
def _cycle_walk(ranks, n, cols, out):
    for i in range(ranks.shape[0]):
        s = np.uint64(ranks[i] + 1)
        while True:  # apply M**jump until the state lands in 1..n again
            t = np.uint64(0)
            b = 0
            x = s
            while x:
                if x & np.uint64(1):
                    t ^= cols[b]
                x >>= np.uint64(1)
                b += 1
            s = t
            if s <= np.uint64(n):
                break
        out[i] = np.int64(s) - 1


class LFSRScrambler:
    """Bijection of [0, n): rank k -> the state ``jump`` steps after state k + 1 on the
    maximal-length sequence, cycle-walked until it lies in 1..n; row = state - 1.

    The width is the bit length of n (at least 2), so a walk takes < 2 steps on average; the
    per-table ``jump`` (the random phase) is drawn from ``seed``.
    """

    def __init__(self, n: int, seed: int | Sequence[int] = 0):
        n = int(n)
        if n < 1:
            raise ValueError(f"a scrambler needs at least one row, got n={n}")
        self.n = n
        self.width = max(2, n.bit_length())
        self.mask = _mask(self.width, None)
        period = (1 << self.width) - 1
        self.jump = int(np.random.default_rng(seed).integers(1, period)) if period > 1 else 1
        self._cols = np.array(_matrix_power(self.width, self.mask, self.jump), dtype=np.uint64)

    def __call__(self, ranks) -> np.ndarray:
        """Rows of the given 0-based ranks (int64 array of the same shape)."""
        r = np.ascontiguousarray(ranks, dtype=np.int64)
        if r.size and (r.min() < 0 or r.max() >= self.n):
            raise IndexError(f"ranks must lie in [0, {self.n}); got {int(r.min())}..{int(r.max())}")
        out = np.empty(r.shape, dtype=np.int64)
        _cycle_walk(r.reshape(-1), self.n, self._cols, out.reshape(-1))
        return out


class ZipfSampler:
    """Exact Zipf(α) on ranks 1..n by rejection-inversion (Hörmann & Derflinger, 1996).

    P(k) ∝ k**-α for any α >= 0 (α = 1 included) with O(1) memory, so tables of any size work.
    ``sample`` returns 0-based ranks (rank 0 is the most frequent).
    """

    def __init__(self, n: int, alpha: float = 1.0):
        n = _integer(n, "n (the number of ranks)")
        if n < 1:
            raise ValueError(f"Zipf needs n >= 1, got {n}")
        if not alpha >= 0 or not np.isfinite(alpha):
            raise ValueError(f"Zipf exponent must be a finite number >= 0, got {alpha}")
        self.n = int(n)
        self.alpha = float(alpha)
        self._hx1 = self._H(1.5) - 1.0
        self._hn = self._H(self.n + 0.5)
        self._s = 2.0 - self._Hinv(self._H(2.5) - self._h(2.0))

    def _h(self, x):
        return np.exp(-self.alpha * np.log(x))

    def _H(self, x):
        """Integral of h from 1 to x: (x**(1-α) - 1) / (1-α), or log x when α == 1."""
        lx = np.log(x)
        y = (1.0 - self.alpha) * lx
        ratio = np.where(np.abs(y) > 1e-8, np.expm1(y) / np.where(y == 0, 1.0, y), 1.0 + y / 2)
        return ratio * lx

    def _Hinv(self, u):
        t = (1.0 - self.alpha) * u
        ratio = np.where(np.abs(t) > 1e-8, np.log1p(t) / np.where(t == 0, 1.0, t), 1.0 - t / 2)
        return np.exp(ratio * u)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` 0-based ranks drawn with ``rng`` (a ``np.random.Generator``)."""
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"ZipfSampler.sample takes a np.random.Generator, got "
                            f"{type(rng).__name__}; e.g. sample(np.random.default_rng(seed), n)")
        size = _integer(size, "size (how many ranks to draw)", 0)
        out = np.empty(size, dtype=np.int64)
        todo = np.arange(size)
        while todo.size:
            u = self._hn + rng.random(todo.size) * (self._hx1 - self._hn)
            x = self._Hinv(u)
            k = np.clip(np.floor(x + 0.5), 1, self.n)
            ok = (k - x <= self._s) | (u >= self._H(k + 0.5) - self._h(k))
            out[todo[ok]] = k[ok].astype(np.int64) - 1
            todo = todo[~ok]
        return out

    def probability(self, rank: int) -> float:
        """Exact P(0-based rank) (sums the normaliser; for tests and small n)."""
        w = np.arange(1, self.n + 1, dtype=np.float64) ** -self.alpha
        return float(w[rank] / w.sum())


@dataclass
class Batch:
    """One training batch: dense (B, num_dense) float32, per-table int64 ``indices`` and bag
    ``offsets`` (B starts each), and labels (B,) float32 in {0, 1}."""

    dense: np.ndarray
    indices: list
    offsets: list
    labels: np.ndarray

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _row_scores(rows: np.ndarray, salt: int) -> np.ndarray:
    """A fixed pseudo-random score in [-1, 1) for every row id (no per-row storage)."""
    h = _splitmix64(rows.astype(np.uint64) ^ np.uint64(salt))
    return (h >> np.uint64(11)).astype(np.float64) * (2.0 / 2.0**53) - 1.0


class SyntheticDataset:
    """Deterministic synthetic batches for DLRM training and benchmarks.

    ``pooling`` is the number of indices per bag, an int or an inclusive ``(lo, hi)`` range.
    Labels are drawn from a fixed logistic model of the dense features and of a fixed score
    per (table, row), so a model can learn them.  ``batch(i)`` depends only on (seed, i).
    """

    def __init__(self, num_dense: int, table_sizes: Sequence[int], batch_size: int,
                 pooling=1, distribution: str = "uniform", alpha: float = 1.0, seed: int = 0,
                 num_batches: int = 100):
        if distribution not in ("uniform", "zipf"):
            raise ValueError(f"distribution must be 'uniform' or 'zipf', got {distribution!r}")
        self.num_dense = _integer(num_dense, "num_dense", 0)
        self.table_sizes = _table_sizes(table_sizes)
        self.batch_size = _integer(batch_size, "batch_size", 1)
        self.pooling = _pooling(pooling)
        self.distribution = distribution
        self.alpha = float(alpha)
        if distribution == "zipf" and not (self.alpha >= 0 and np.isfinite(self.alpha)):
            raise ValueError(f"alpha (the Zipf exponent) must be a finite number >= 0, got "
                             f"{alpha}")
        self.seed = _integer(seed, "seed", 0)
        self.num_batches = _integer(num_batches, "num_batches", 0)
        model = np.random.default_rng([self.seed, 0x5EED])
        ntab = len(self.table_sizes)
        self._w_dense = model.standard_normal(self.num_dense) / np.sqrt(max(1, self.num_dense))
        self._w_sparse = 1.5 * model.standard_normal(ntab) / np.sqrt(max(1, ntab))
        self._salts = [int(s) for s in model.integers(0, 2**62, ntab)]
        self._bias = float(model.normal(0.0, 0.2))
        if distribution == "zipf":
            self._zipf = [ZipfSampler(n, self.alpha) for n in self.table_sizes]
            self._scramble = [LFSRScrambler(n, [self.seed, 0x1F5A, t])
                              for t, n in enumerate(self.table_sizes)]

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        for i in range(self.num_batches):
            yield self.batch(i)

    def batch(self, i: int) -> Batch:
        """Batch number i (any i >= 0; independent of every other batch)."""
        rng = np.random.default_rng([self.seed, _integer(i, "the batch number", 0)])
        B = self.batch_size
        dense = rng.standard_normal((B, self.num_dense), dtype=np.float32)
        logits = dense.astype(np.float64) @ self._w_dense + self._bias
        lo, hi = self.pooling
        indices, offsets = [], []
        for t, n in enumerate(self.table_sizes):
            lengths = np.full(B, lo, dtype=np.int64) if lo == hi else rng.integers(lo, hi + 1, B)
            off = np.zeros(B, dtype=np.int64)
            np.cumsum(lengths[:-1], out=off[1:])
            count = int(lengths.sum())
            if self.distribution == "zipf":
                rows = self._scramble[t](self._zipf[t].sample(rng, count))
            else:
                rows = rng.integers(0, n, count, dtype=np.int64)
            bags = np.repeat(np.arange(B), lengths)
            score = np.bincount(bags, weights=_row_scores(rows, self._salts[t]), minlength=B)
            logits += self._w_sparse[t] * score / np.maximum(lengths, 1)
            indices.append(rows)
            offsets.append(off)
        p = 1.0 / (1.0 + np.exp(-logits))
        labels = (rng.random(B) < p).astype(np.float32)
        return Batch(dense=dense, indices=indices, offsets=offsets, labels=labels)
