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


# The kernels index with unsigned integers (``_u``) instead of slicing a row view per sample:
# numba then neither builds a view nor checks for negative indices in the inner loops, which
# LLVM vectorises whole. At DenseNet's 4x4 and 2x2 planes (rows of 16 and 4 elements) that
# made the backward pass 1.7-1.8x faster, bitwise the same results.
_u = np.uint64


@njit(parallel=True, fastmath=_FM, nogil=True, cache=True)
def _forward(x, xbs, gamma, beta, eps, out, mean_out, var_out, relu):
    n, c, hw = out.shape
    inv_m = 1.0 / (n * hw)
    ubs, uhw = _u(xbs), _u(hw)
    for ch in prange(c):
        uc = _u(ch)
        s = 0.0
        for ii in range(n):
            xo = _u(ii) * ubs + uc * uhw
            for jj in range(hw):
                s += x[xo + _u(jj)]
        mu = s * inv_m
        q = 0.0
        for ii in range(n):
            xo = _u(ii) * ubs + uc * uhw
            for jj in range(hw):
                d = x[xo + _u(jj)] - mu
                q += d * d
        var = q * inv_m
        mu32 = np.float32(mu)
        var32 = np.float32(var)
        scale = np.float32(gamma[ch] / np.sqrt(np.float64(var32) + eps))
        shift = beta[ch]
        for ii in range(n):
            i = _u(ii)
            xo = i * ubs + uc * uhw
            if relu:
                for jj in range(hw):
                    j = _u(jj)
                    out[i, uc, j] = max((x[xo + j] - mu32) * scale + shift, np.float32(0))
            else:
                for jj in range(hw):
                    j = _u(jj)
                    out[i, uc, j] = (x[xo + j] - mu32) * scale + shift
        mean_out[ch] = mu32
        var_out[ch] = var32


@njit(parallel=True, fastmath=_FM, nogil=True, cache=True)
def _backward(dy, x, xbs, gamma, mean, var, eps, dx, dgamma, dbeta):
    n, c, hw = dx.shape
    inv_m = 1.0 / (n * hw)
    ubs, uhw = _u(xbs), _u(hw)
    for ch in prange(c):
        uc = _u(ch)
        mu = mean[ch]
        sdy = 0.0
        sdyx = 0.0
        for ii in range(n):
            i = _u(ii)
            xo = i * ubs + uc * uhw
            for jj in range(hw):
                j = _u(jj)
                d = dy[i, uc, j]
                sdy += d
                sdyx += d * (x[xo + j] - mu)
        invstd = 1.0 / np.sqrt(np.float64(var[ch]) + eps)
        dg = sdyx * invstd
        dgamma[ch] = np.float32(dg)
        dbeta[ch] = np.float32(sdy)
        k = np.float32(gamma[ch] * invstd)
        a = np.float32(sdy * inv_m)
        b = np.float32(dg * invstd * inv_m)
        for ii in range(n):
            i = _u(ii)
            xo = i * ubs + uc * uhw
            for jj in range(hw):
                j = _u(jj)
                dx[i, uc, j] = k * (dy[i, uc, j] - a - (x[xo + j] - mu) * b)


@njit(parallel=True, fastmath=_FM, nogil=True, cache=True)
def _backward_masked(dy, y, x, xbs, gamma, mean, var, eps, dx, dgamma, dbeta, acc, use_acc):
    """_backward of dy * (y > 0) (a ReLU after the batch norm), without forming it; with
    use_acc, dx also gets acc[:, :C] added (acc may have more channels)."""
    n, c, hw = dx.shape
    inv_m = 1.0 / (n * hw)
    ubs, uhw = _u(xbs), _u(hw)
    for ch in prange(c):
        uc = _u(ch)
        mu = mean[ch]
        sdy = 0.0
        sdyx = 0.0
        for ii in range(n):
            i = _u(ii)
            xo = i * ubs + uc * uhw
            for jj in range(hw):
                j = _u(jj)
                d = dy[i, uc, j] if y[i, uc, j] > 0 else np.float32(0)
                sdy += d
                sdyx += d * (x[xo + j] - mu)
        invstd = 1.0 / np.sqrt(np.float64(var[ch]) + eps)
        dg = sdyx * invstd
        dgamma[ch] = np.float32(dg)
        dbeta[ch] = np.float32(sdy)
        k = np.float32(gamma[ch] * invstd)
        a = np.float32(sdy * inv_m)
        b = np.float32(dg * invstd * inv_m)
        for ii in range(n):
            i = _u(ii)
            xo = i * ubs + uc * uhw
            if use_acc:
                for jj in range(hw):
                    j = _u(jj)
                    d = dy[i, uc, j] if y[i, uc, j] > 0 else np.float32(0)
                    dx[i, uc, j] = k * (d - a - (x[xo + j] - mu) * b) + acc[i, uc, j]
            else:
                for jj in range(hw):
                    j = _u(jj)
                    d = dy[i, uc, j] if y[i, uc, j] > 0 else np.float32(0)
                    dx[i, uc, j] = k * (d - a - (x[xo + j] - mu) * b)


def _flat(a):
    return a.reshape(a.shape[0], a.shape[1], -1)


def _readonly(a):
    """A read-only view: x always reaches the kernels as the same numba type (one compiled
    specialisation, so a slice and its copy give bitwise the same results)."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _rows(x):
    """(flat, batch stride) of x (N, C, H, W): channel ch of sample i is
    flat[i * stride + ch * H * W:][:H * W]. A channel slice of a larger C-contiguous NCHW array
    (a dense block's concatenation buffer) is read in place, as one contiguous span; any other
    layout is copied first."""
    n, c = x.shape[:2]
    hw = x.size // max(n * c, 1)
    item = x.itemsize
    if x.flags.c_contiguous:
        return _readonly(x.reshape(-1)), c * hw
    inner = _flat(x)
    if n and c and hw and (inner.strides[2] != item or inner.strides[1] != hw * item
                           or inner.strides[0] % item or inner.strides[0] < c * hw * item):
        return _readonly(np.ascontiguousarray(x).reshape(-1)), c * hw
    bs = inner.strides[0] // item
    span = (n - 1) * bs + c * hw if n and c and hw else 0
    flat = np.lib.stride_tricks.as_strided(inner, shape=(span,), strides=(item,),
                                           writeable=False)
    return flat, bs


def forward(x, gamma, beta, eps, out, mean_out, var_out, relu=False):
    """Batch mean, biased variance and normalised output (shapes and dtypes checked by caller);
    relu: the output goes through max(., 0) in the same pass. x may be a channel slice of a
    larger NCHW array (read in place)."""
    xf, xbs = _rows(x)
    _forward(xf, xbs, gamma, beta, float(eps), _flat(out), mean_out, var_out, bool(relu))
    return out


def backward(dy, x, gamma, mean, var, eps, dx, dgamma, dbeta, y=None, acc=None):
    """dx, dgamma, dbeta from the saved batch mean and variance; with y (the output of a
    forward with relu=True) the gradient is masked by y > 0 first, in the same passes; with acc
    (needs y; (N, >= C, H, W)) its first C channels are added to dx in the same pass. x may be
    a channel slice of a larger NCHW array (read in place)."""
    xf, xbs = _rows(x)
    if y is None:
        if acc is not None:
            raise ValueError("_bnorm.backward: acc needs y (the masked kernel)")
        _backward(_flat(dy), xf, xbs, gamma, mean, var, float(eps), _flat(dx), dgamma, dbeta)
    else:
        fdx = _flat(dx)
        _backward_masked(_flat(dy), _flat(y), xf, xbs, gamma, mean, var, float(eps), fdx,
                         dgamma, dbeta, fdx if acc is None else _flat(acc), acc is not None)
    return dx
