"""Dot-interaction kernels (forward and backward) specialised for one (features, feature size)
shape.

``make_forward(NF, FS)`` and ``make_backward(NF, FS)`` return jitted closures over the two
sizes, so numba compiles them as constants and LLVM vectorises the fixed-length loops: the
forward across the samples of a block (four pairs per pass over the values, sums in
registers), the backward across the values of a feature. Every sum is added in the order of
the generic kernels in ``model`` (from zero, in index order, each term one ``fma``: a fused
multiply-add that rounds once, half the vector instructions of a multiply and an add), so
results are bit-identical to them. The closures capture only integers, so numba's disk cache keys each
shape on its values and reuses it across processes.
"""

import numpy as np
from numba import njit, prange, uint64

from ._intrinsics import fma

#: Samples per block (the vector lanes of the pair loop).
LANES = 16
#: Blocks per parallel work item.
BLOCKS_PER_ITEM = 4


def make_forward(NF, FS):
    """The forward kernel for NF features of FS values each: ``forward(t, r)``.

    Samples go in blocks of ``LANES``: each block is transposed so one value of all its samples
    is contiguous, and every pair's dot product runs on all samples of the block at once.
    """
    NF, FS = int(NF), int(FS)
    NPAIRS = NF * (NF - 1) // 2
    TW = NF * FS
    L = LANES
    SPI = L * BLOCKS_PER_ITEM

    @njit(parallel=True, fastmath=False, nogil=True, cache=True)
    def forward(t, r):
        """r[b] = [t[b, :FS], dot(t_i, t_j) for i in range(NF) for j in range(i)]."""
        U = uint64
        z = t.dtype.type(0)
        nb = t.shape[0]
        nitems = (nb + SPI - 1) // SPI
        for it in prange(nitems):
            tb = np.zeros(TW * L, dtype=t.dtype)   # a block transposed: tb[c * L + lane]
            zb = np.empty(NPAIRS * L, dtype=t.dtype)
            for b0 in range(it * SPI, min(nb, it * SPI + SPI), L):
                n = min(L, nb - b0)
                for lane in range(n):
                    for c in range(TW):
                        tb[c * L + lane] = t[b0 + lane, c]
                p = U(0)                               # zb[p * L + lane]: pair p's dot
                for i in range(1, NF):
                    ib = U(i * FS * L)
                    j = 0
                    while j + 4 <= i:                  # four pairs share each load of feature i
                        j0 = U(j * FS * L)
                        j1 = j0 + U(FS * L)
                        j2 = j1 + U(FS * L)
                        j3 = j2 + U(FS * L)
                        pb = p * U(L)
                        for lane in range(L):
                            u = U(lane)
                            s0 = z
                            s1 = z
                            s2 = z
                            s3 = z
                            for k in range(FS):
                                kb = U(k * L) + u
                                a = tb[ib + kb]
                                s0 = fma(a, tb[j0 + kb], s0)
                                s1 = fma(a, tb[j1 + kb], s1)
                                s2 = fma(a, tb[j2 + kb], s2)
                                s3 = fma(a, tb[j3 + kb], s3)
                            zb[pb + u] = s0
                            zb[pb + U(L) + u] = s1
                            zb[pb + U(2 * L) + u] = s2
                            zb[pb + U(3 * L) + u] = s3
                        p += U(4)
                        j += 4
                    while j < i:
                        jb = U(j * FS * L)
                        pb = p * U(L)
                        for lane in range(L):
                            u = U(lane)
                            s = z
                            for k in range(FS):
                                kb = U(k * L) + u
                                s = fma(tb[ib + kb], tb[jb + kb], s)
                            zb[pb + u] = s
                        p += U(1)
                        j += 1
                for lane in range(n):
                    for k in range(FS):
                        r[b0 + lane, k] = t[b0 + lane, k]
                    for q in range(NPAIRS):
                        r[b0 + lane, FS + q] = zb[q * L + lane]

    return forward


def make_backward(NF, FS):
    """The backward kernel for NF features of FS values each: ``backward(t, dr, dt)``.

    Per sample, the pair gradients go into a symmetric NF x NF matrix ``g`` (zero diagonal);
    then ``dt[a, k] = sum over j of g[a, j] * t[j, k]`` (starting from ``dr[k]`` for a = 0, else
    zero), vectorised across k, the sum over j unrolled, three rows a at a time sharing each
    load of t. Sums run in the order of ``model``'s generic backward (j ascending), so results
    are bit-identical to it; the zero diagonal adds an exact zero (a non-finite t[a, k] makes
    dt[a, k] NaN, where the model's loss is already non-finite).
    """
    NF, FS = int(NF), int(FS)
    TW = NF * FS
    SPI = LANES * BLOCKS_PER_ITEM

    @njit(parallel=True, fastmath=False, nogil=True, cache=True)
    def backward(t, dr, dt):
        """dt = gradient of ``forward`` at t given dr."""
        U = uint64
        z = t.dtype.type(0)
        nb = t.shape[0]
        nitems = (nb + SPI - 1) // SPI
        for it in prange(nitems):
            g = np.zeros(NF * NF, dtype=t.dtype)
            for b in range(it * SPI, min(nb, it * SPI + SPI)):
                p = U(FS)
                ub = U(b)
                for i in range(1, NF):
                    ui = U(i)
                    for j in range(i):
                        uj = U(j)
                        v = dr[ub, p + uj]
                        g[ui * U(NF) + uj] = v
                        g[uj * U(NF) + ui] = v
                    p += ui
                for k in range(FS):
                    s = dr[b, k]
                    for j in range(NF):
                        s = fma(g[U(j)], t[b, j * FS + k], s)
                    dt[b, k] = s
                a = 1
                while a + 3 <= NF:                     # three rows share each load of t[j]
                    g0 = U(a * NF)
                    g1 = g0 + U(NF)
                    g2 = g1 + U(NF)
                    for k in range(FS):
                        s0 = z
                        s1 = z
                        s2 = z
                        for j in range(NF):
                            v = t[b, j * FS + k]
                            s0 = fma(g[g0 + U(j)], v, s0)
                            s1 = fma(g[g1 + U(j)], v, s1)
                            s2 = fma(g[g2 + U(j)], v, s2)
                        dt[b, a * FS + k] = s0
                        dt[b, (a + 1) * FS + k] = s1
                        dt[b, (a + 2) * FS + k] = s2
                    a += 3
                while a < NF:
                    ga = U(a * NF)
                    for k in range(FS):
                        s = z
                        for j in range(NF):
                            s = fma(g[ga + U(j)], t[b, j * FS + k], s)
                        dt[b, a * FS + k] = s
                    a += 1
    return backward
