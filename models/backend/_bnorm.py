"""Training batch norm on plain NCHW float32 arrays with numba, parallel over channels.

oneDNN's batch norm is fast only in blocked layouts (nChw16c), which costs a reorder of every
input and output around each call (three copies for the forward, three for the backward); at
the activation sizes of the CNN benchmarks those copies cost more than the normalisation. These
kernels read NCHW directly, one channel per task (the N x H*W slab of a channel stays in the
cache between its passes), so each call reads its inputs twice from cache and writes once.

Results do not depend on the thread count or scheduling: each channel's reductions run in one
task in a fixed order (fastmath lets LLVM vectorise them, deterministically for one build).
Sums accumulate in float64 lanes, so accuracy is at least that of oneDNN's float32 sums.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_FM = {"nsz", "arcp", "contract", "afn", "reassoc"}   # no nnan/ninf: NaN and inf propagate


@njit(parallel=True, fastmath=_FM, nogil=True, cache=True)
def _forward(x, gamma, beta, eps, out, mean_out, var_out):
    n, c, hw = x.shape
    inv_m = 1.0 / (n * hw)
    for ch in prange(c):
        s = 0.0
        for i in range(n):
            row = x[i, ch]
            for j in range(hw):
                s += row[j]
        mu = s * inv_m
        q = 0.0
        for i in range(n):
            row = x[i, ch]
            for j in range(hw):
                d = row[j] - mu
                q += d * d
        var = q * inv_m
        mu32 = np.float32(mu)
        var32 = np.float32(var)
        scale = np.float32(gamma[ch] / np.sqrt(np.float64(var32) + eps))
        shift = beta[ch]
        for i in range(n):
            row = x[i, ch]
            orow = out[i, ch]
            for j in range(hw):
                orow[j] = (row[j] - mu32) * scale + shift
        mean_out[ch] = mu32
        var_out[ch] = var32


@njit(parallel=True, fastmath=_FM, nogil=True, cache=True)
def _backward(dy, x, gamma, mean, var, eps, dx, dgamma, dbeta):
    n, c, hw = x.shape
    inv_m = 1.0 / (n * hw)
    for ch in prange(c):
        mu = mean[ch]
        sdy = 0.0
        sdyx = 0.0
        for i in range(n):
            drow = dy[i, ch]
            xrow = x[i, ch]
            for j in range(hw):
                d = drow[j]
                sdy += d
                sdyx += d * (xrow[j] - mu)
        invstd = 1.0 / np.sqrt(np.float64(var[ch]) + eps)
        dg = sdyx * invstd
        dgamma[ch] = np.float32(dg)
        dbeta[ch] = np.float32(sdy)
        k = np.float32(gamma[ch] * invstd)
        a = np.float32(sdy * inv_m)
        b = np.float32(dg * invstd * inv_m)
        for i in range(n):
            drow = dy[i, ch]
            xrow = x[i, ch]
            orow = dx[i, ch]
            for j in range(hw):
                orow[j] = k * (drow[j] - a - (xrow[j] - mu) * b)


def _flat(a):
    return a.reshape(a.shape[0], a.shape[1], -1)


def forward(x, gamma, beta, eps, out, mean_out, var_out):
    """Batch mean, biased variance and normalised output (shapes and dtypes checked by caller)."""
    _forward(_flat(x), gamma, beta, float(eps), _flat(out), mean_out, var_out)
    return out


def backward(dy, x, gamma, mean, var, eps, dx, dgamma, dbeta):
    """dx, dgamma, dbeta from the saved batch mean and variance."""
    _backward(_flat(dy), _flat(x), gamma, mean, var, float(eps), _flat(dx), dgamma, dbeta)
    return dx
