"""Training batch norm on plain NCHW float32 arrays with numba, parallel over channels.

oneDNN's batch norm is fast only in blocked layouts (nChw16c), which costs a reorder of every
input and output around each call (three copies for the forward, three for the backward); at
the activation sizes of the CNN benchmarks those copies cost more than the normalisation. These
kernels read NCHW directly, one channel per task (the N x H*W slab of a channel stays in the
cache between its passes), so each call reads its inputs twice from cache and writes once.
Planes of fewer than SMALL_PLANE elements go by blocks of channels instead (see
``_forward_small``): 1.3-2.8x faster at DenseNet-121's 4x4 and 2x2 planes.

Results do not depend on the thread count or scheduling: each channel's reductions run in one
task in a fixed order (fastmath lets LLVM vectorise them, deterministically for one build).
Sums accumulate in float64 lanes, so accuracy is at least that of oneDNN's float32 sums.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from cachedarrays import threads as _threads
from cachedarrays.layout import readonly_view as _readonly
from cachedarrays.threads import serial_twin

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


# Small planes (H*W below SMALL_PLANE: DenseNet-121's 4x4 and 2x2 layers at 64 px) go through
# the kernels below instead: a row of a few elements per sample and channel leaves the loops
# above mostly loop overhead. These take _CB channels per task and stream each sample's
# contiguous _CB*H*W elements at once, with per-element float64 partial sums reduced per
# channel afterwards (a fixed order: results do not depend on the thread count either).
SMALL_PLANE = 32
_CB = 64


@njit(fastmath=_FM, nogil=True, cache=True)
def _spread(values, hw, out):
    """out[ch * hw + j] = values[ch] for every j < hw."""
    for ch in range(values.shape[0]):
        for j in range(hw):
            out[ch * hw + j] = values[ch]


@njit(fastmath=_FM, nogil=True, cache=True)
def _channel_sums(parts, hw, out):
    """out[ch] = the sum of parts[ch * hw:(ch + 1) * hw] (float64)."""
    for ch in range(out.shape[0]):
        t = 0.0
        for j in range(hw):
            t += parts[ch * hw + j]
        out[ch] = t


@njit(parallel=True, fastmath=_FM, nogil=True, cache=True)
def _forward_small(x, xbs, gamma, beta, eps, out, hw, mean_out, var_out, relu):
    n, length = out.shape
    c = length // hw
    inv_m = 1.0 / (n * hw)
    ubs = _u(xbs)
    for blk in prange((c + _CB - 1) // _CB):
        c0 = blk * _CB
        nc = min(c, c0 + _CB) - c0
        lo = _u(c0 * hw)
        m = nc * hw
        acc = np.zeros(m, np.float64)
        for ii in range(n):
            xo = _u(ii) * ubs + lo
            for kk in range(m):
                acc[kk] += x[xo + _u(kk)]
        sums = np.empty(nc, np.float64)
        _channel_sums(acc, hw, sums)
        mu = sums * inv_m
        mu_e = np.empty(m, np.float64)
        _spread(mu, hw, mu_e)
        acc[:] = 0.0
        for ii in range(n):
            xo = _u(ii) * ubs + lo
            for kk in range(m):
                d = x[xo + _u(kk)] - mu_e[kk]
                acc[kk] += d * d
        _channel_sums(acc, hw, sums)
        mu32 = np.empty(nc, np.float32)
        scale = np.empty(nc, np.float32)
        shift = np.empty(nc, np.float32)
        for ch in range(nc):
            var32 = np.float32(sums[ch] * inv_m)
            mu32[ch] = np.float32(mu[ch])
            scale[ch] = np.float32(gamma[c0 + ch] / np.sqrt(np.float64(var32) + eps))
            shift[ch] = beta[c0 + ch]
            mean_out[c0 + ch] = mu32[ch]
            var_out[c0 + ch] = var32
        mu32_e = np.empty(m, np.float32)
        scale_e = np.empty(m, np.float32)
        shift_e = np.empty(m, np.float32)
        _spread(mu32, hw, mu32_e)
        _spread(scale, hw, scale_e)
        _spread(shift, hw, shift_e)
        for ii in range(n):
            i = _u(ii)
            xo = i * ubs + lo
            if relu:
                for kk in range(m):
                    k = _u(kk)
                    out[i, lo + k] = max((x[xo + k] - mu32_e[k]) * scale_e[k] + shift_e[k],
                                         np.float32(0))
            else:
                for kk in range(m):
                    k = _u(kk)
                    out[i, lo + k] = (x[xo + k] - mu32_e[k]) * scale_e[k] + shift_e[k]


@njit(parallel=True, fastmath=_FM, nogil=True, cache=True)
def _backward_small(dy, y, masked, x, xbs, gamma, mean, var, eps, dx, hw, dgamma, dbeta, acc,
                    use_acc):
    """_backward (masked: _backward_masked, with acc when use_acc) on 2-d (N, C*H*W) views."""
    n, length = dx.shape
    c = length // hw
    inv_m = 1.0 / (n * hw)
    ubs = _u(xbs)
    for blk in prange((c + _CB - 1) // _CB):
        c0 = blk * _CB
        nc = min(c, c0 + _CB) - c0
        lo = _u(c0 * hw)
        m = nc * hw
        mu_e = np.empty(m, np.float32)
        _spread(mean[c0:c0 + nc], hw, mu_e)
        sdy = np.zeros(m, np.float64)
        sdyx = np.zeros(m, np.float64)
        for ii in range(n):
            i = _u(ii)
            xo = i * ubs + lo
            if masked:
                for kk in range(m):
                    k = _u(kk)
                    d = dy[i, lo + k] if y[i, lo + k] > 0 else np.float32(0)
                    sdy[kk] += d
                    sdyx[kk] += d * (x[xo + k] - mu_e[k])
            else:
                for kk in range(m):
                    k = _u(kk)
                    d = dy[i, lo + k]
                    sdy[kk] += d
                    sdyx[kk] += d * (x[xo + k] - mu_e[k])
        tdy = np.empty(nc, np.float64)
        tdyx = np.empty(nc, np.float64)
        _channel_sums(sdy, hw, tdy)
        _channel_sums(sdyx, hw, tdyx)
        kc = np.empty(nc, np.float32)
        ac = np.empty(nc, np.float32)
        bc = np.empty(nc, np.float32)
        for ch in range(nc):
            invstd = 1.0 / np.sqrt(np.float64(var[c0 + ch]) + eps)
            dg = tdyx[ch] * invstd
            dgamma[c0 + ch] = np.float32(dg)
            dbeta[c0 + ch] = np.float32(tdy[ch])
            kc[ch] = np.float32(gamma[c0 + ch] * invstd)
            ac[ch] = np.float32(tdy[ch] * inv_m)
            bc[ch] = np.float32(dg * invstd * inv_m)
        k_e = np.empty(m, np.float32)
        a_e = np.empty(m, np.float32)
        b_e = np.empty(m, np.float32)
        _spread(kc, hw, k_e)
        _spread(ac, hw, a_e)
        _spread(bc, hw, b_e)
        for ii in range(n):         # one loop per case: a test inside stays in the loop
            i = _u(ii)
            xo = i * ubs + lo
            if masked and use_acc:
                for kk in range(m):
                    k = _u(kk)
                    d = dy[i, lo + k] if y[i, lo + k] > 0 else np.float32(0)
                    dx[i, lo + k] = k_e[k] * (d - a_e[k] - (x[xo + k] - mu_e[k]) * b_e[k]) + \
                        acc[i, lo + k]
            elif masked:
                for kk in range(m):
                    k = _u(kk)
                    d = dy[i, lo + k] if y[i, lo + k] > 0 else np.float32(0)
                    dx[i, lo + k] = k_e[k] * (d - a_e[k] - (x[xo + k] - mu_e[k]) * b_e[k])
            else:
                for kk in range(m):
                    k = _u(kk)
                    dx[i, lo + k] = k_e[k] * (dy[i, lo + k] - a_e[k] - (x[xo + k] - mu_e[k]) *
                                              b_e[k])


def _flat(a):
    return a.reshape(a.shape[0], a.shape[1], -1)


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


_TWINS = {}


def _run(kernel):
    """kernel, or its serial twin where no parallel region can run (in a process forked after
    the OpenMP pool started: ``threads.FORKED_AFTER_POOL``)."""
    if not _threads.FORKED_AFTER_POOL:
        return kernel
    twin = _TWINS.get(kernel)
    if twin is None:
        name = kernel.py_func.__name__ + "_serial"
        twin = _TWINS[kernel] = serial_twin(kernel, name)
    return twin


# The inputs reach the kernels read-only (``_readonly``, and ``_rows`` for x) whatever the
# caller's flags: one compiled specialisation per dtype and layout, where a model's layers (a
# parameter, a view from a read scope, a fresh gradient) used to compile up to four, several
# seconds each.


def forward(x, gamma, beta, eps, out, mean_out, var_out, relu=False):
    """Batch mean, biased variance and normalised output (shapes and dtypes checked by caller);
    relu: the output goes through max(., 0) in the same pass. x may be a channel slice of a
    larger NCHW array (read in place)."""
    xf, xbs = _rows(x)
    gamma, beta = _readonly(gamma), _readonly(beta)
    hw = _small_plane(out)
    if hw:
        _run(_forward_small)(xf, xbs, gamma, beta, float(eps), _rows2(out), hw, mean_out,
                             var_out, bool(relu))
    else:
        _run(_forward)(xf, xbs, gamma, beta, float(eps), _flat(out), mean_out, var_out,
                       bool(relu))
    return out


def _small_plane(*arrays):
    """H*W of the first array when it is below SMALL_PLANE and every array is C-contiguous
    (the small-plane kernels take them as 2-d views), else 0."""
    a = arrays[0]
    hw = a.size // max(a.shape[0] * a.shape[1], 1)
    if not 0 < hw < SMALL_PLANE:
        return 0
    return hw if all(b is None or b.flags.c_contiguous for b in arrays) else 0


def _rows2(a):
    """An (N, C*H*W) view of a C-contiguous (N, C, H, W) array."""
    return a.reshape(a.shape[0], -1)


def backward(dy, x, gamma, mean, var, eps, dx, dgamma, dbeta, y=None, acc=None):
    """dx, dgamma, dbeta from the saved batch mean and variance; with y (the output of a
    forward with relu=True) the gradient is masked by y > 0 first, in the same passes; with acc
    (needs y; (N, >= C, H, W)) its first C channels are added to dx in the same pass. x may be
    a channel slice of a larger NCHW array (read in place)."""
    xf, xbs = _rows(x)
    if y is None and acc is not None:
        raise ValueError("_bnorm.backward: acc needs y (the masked kernel)")
    gamma, mean, var = _readonly(gamma), _readonly(mean), _readonly(var)
    hw = _small_plane(dx, dy, y, acc)
    if hw:
        fdx = _rows2(dx)
        fdy = _readonly(_rows2(dy))     # y and acc, when absent, are stand-ins the kernel skips
        _run(_backward_small)(fdy, fdy if y is None else _readonly(_rows2(y)), y is not None,
                              xf, xbs, gamma, mean, var, float(eps), fdx, hw, dgamma, dbeta,
                              fdy if acc is None else _readonly(_rows2(acc)), acc is not None)
    elif y is None:
        _run(_backward)(_readonly(_flat(dy)), xf, xbs, gamma, mean, var, float(eps), _flat(dx),
                        dgamma, dbeta)
    else:
        fdx, fdy = _flat(dx), _readonly(_flat(dy))
        _run(_backward_masked)(fdy, _readonly(_flat(y)), xf, xbs, gamma, mean, var, float(eps),
                               fdx, dgamma, dbeta, fdy if acc is None else _readonly(_flat(acc)),
                               acc is not None)
    return dx
