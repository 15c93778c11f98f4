"""NumPy reference backend: im2col + BLAS convolution and vectorised layers on plain ndarrays.

Works for float32 (the training dtype) and float64 (used by the finite-difference tests);
all arrays of one call must share a dtype. Outputs are written into the ``out``-style
arguments, which are also returned. Loops run only over kernel offsets, never over pixels.
"""

from __future__ import annotations

import numpy as np

from . import _checks as ck
from ._checks import conv2d_output_shape as _conv_shape

name = "numpy"


def conv2d_output_shape(x_shape, w_shape, stride=1, pad=0):
    """(N, K, P, Q) of a convolution of x (N,C,H,W) with w (K,C,R,S)."""
    return _conv_shape(x_shape, w_shape, stride, pad)


# --- helpers ------------------------------------------------------------------------------

def _padded(x, ph, pw, value=0.0):
    """x padded by (ph, pw) on each spatial side (x itself when no padding is needed)."""
    if ph == 0 and pw == 0:
        return x
    n, c, h, w = x.shape
    xp = np.full((n, c, h + 2 * ph, w + 2 * pw), value, dtype=x.dtype)
    xp[:, :, ph:ph + h, pw:pw + w] = x
    return xp


def _window(a, i, j, p, q, sh, sw):
    """Strided view of the (p, q) window origins shifted by kernel offset (i, j)."""
    return a[:, :, i:i + sh * (p - 1) + 1:sh, j:j + sw * (q - 1) + 1:sw]


def _im2col(x, r, s, sh, sw, ph, pw, p, q):
    """Columns (C*R*S, N*P*Q) so that conv = w.reshape(K, C*R*S) @ columns."""
    n, c = x.shape[:2]
    xp = _padded(x, ph, pw)
    cols = np.empty((c, r, s, n, p, q), dtype=x.dtype)
    for i in range(r):
        for j in range(s):
            cols[:, i, j] = _window(xp, i, j, p, q, sh, sw).transpose(1, 0, 2, 3)
    return cols.reshape(c * r * s, n * p * q)


def _nchw_to_cm(a):
    """(N,K,P,Q) -> (K, N*P*Q), the GEMM layout of output gradients."""
    n, k, p, q = a.shape
    return np.ascontiguousarray(a.transpose(1, 0, 2, 3)).reshape(k, n * p * q)


def _scatter_windows(dxp, parts, r, s, p, q, sh, sw):
    """Accumulate per-offset window gradients parts(i, j) -> (N,C,P,Q) into padded dxp."""
    for i in range(r):
        for j in range(s):
            _window(dxp, i, j, p, q, sh, sw)[...] += parts(i, j)


# --- convolution --------------------------------------------------------------------------

def conv2d_forward(x, w, b, stride, pad, out):
    """out = conv(x, w) + b (cross-correlation, NCHW / KCRS)."""
    op = "conv2d_forward"
    n, k, p, q = ck.check_conv_forward(op, x, w, b, stride, pad, out)
    sh, sw = ck.pair(stride, "stride", op)
    ph, pw = ck.pair(pad, "pad", op)
    r, s = w.shape[2:]
    cols = _im2col(x, r, s, sh, sw, ph, pw, p, q)
    y = np.matmul(w.reshape(k, -1), cols)
    out[...] = y.reshape(k, n, p, q).transpose(1, 0, 2, 3)
    if b is not None:
        out += b.reshape(1, k, 1, 1)
    return out


def conv2d_backward_data(dy, w, stride, pad, dx):
    """dx = gradient of conv2d_forward with respect to its input x."""
    op = "conv2d_backward_data"
    n, k, p, q = ck.check_conv_backward_data(op, dy, w, stride, pad, dx)
    sh, sw = ck.pair(stride, "stride", op)
    ph, pw = ck.pair(pad, "pad", op)
    c, r, s = w.shape[1:]
    h, wd = dx.shape[2:]
    dcols = np.matmul(w.reshape(k, -1).T, _nchw_to_cm(dy)).reshape(c, r, s, n, p, q)
    dxp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), dtype=dx.dtype)
    _scatter_windows(dxp, lambda i, j: dcols[:, i, j].transpose(1, 0, 2, 3), r, s, p, q, sh, sw)
    dx[...] = dxp[:, :, ph:ph + h, pw:pw + wd]
    return dx


def conv2d_backward_weights(x, dy, stride, pad, dw, db):
    """dw (and db unless None) = gradients of conv2d_forward with respect to w and b."""
    op = "conv2d_backward_weights"
    n, k, p, q = ck.check_conv_backward_weights(op, x, dy, stride, pad, dw, db)
    sh, sw = ck.pair(stride, "stride", op)
    ph, pw = ck.pair(pad, "pad", op)
    r, s = dw.shape[2:]
    cols = _im2col(x, r, s, sh, sw, ph, pw, p, q)
    dy2 = _nchw_to_cm(dy)
    dw[...] = np.matmul(dy2, cols.T).reshape(dw.shape)
    if db is not None:
        db[...] = dy2.sum(axis=1)
    return dw


# --- pooling ------------------------------------------------------------------------------

def maxpool_state_spec(x_shape, out_shape, kernel=None):
    """(shape, dtype) of the state maxpool_forward returns: argmax offset i*S+j per output."""
    return tuple(int(v) for v in out_shape), np.dtype(np.int32)


def maxpool_forward(x, kernel, stride, pad, out, state=None):
    """Max pooling (padding never wins); returns the argmax state needed by the backward."""
    op = "maxpool_forward"
    n, c, p, q = ck.check_pool_forward(op, x, kernel, stride, pad, out)
    kh, kw = ck.pair(kernel, "kernel", op)
    sh, sw = ck.pair(stride, "stride", op)
    ph, pw = ck.pair(pad, "pad", op)
    shape, dtype = maxpool_state_spec(x.shape, out.shape)
    if state is None:
        state = np.empty(shape, dtype=dtype)
    ck.array(op, "state", state, shape=shape, dtypes=(dtype,), writable=True)
    xp = _padded(x, ph, pw, value=-np.inf)
    out[...] = _window(xp, 0, 0, p, q, sh, sw)
    state[...] = 0
    mask = np.empty(out.shape, dtype=bool)
    for i in range(kh):
        for j in range(kw):
            if i == 0 and j == 0:
                continue
            v = _window(xp, i, j, p, q, sh, sw)
            np.greater(v, out, out=mask)
            np.copyto(out, v, where=mask)
            np.copyto(state, i * kw + j, where=mask)
    return state


def maxpool_backward(dy, x, state, kernel, stride, pad, dx):
    """Route each output gradient to the input that won the max (x is only shape-checked)."""
    op = "maxpool_backward"
    n, c, p, q = ck.check_pool_backward(op, dy, kernel, stride, pad, dx, x=x)
    kh, kw = ck.pair(kernel, "kernel", op)
    sh, sw = ck.pair(stride, "stride", op)
    ph, pw = ck.pair(pad, "pad", op)
    shape, dtype = maxpool_state_spec(dx.shape, dy.shape)
    ck.array(op, "state", state, shape=shape, dtypes=(dtype,))
    h, w = dx.shape[2:]
    dxp = np.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=dx.dtype)
    zero = dx.dtype.type(0)
    _scatter_windows(dxp, lambda i, j: np.where(state == i * kw + j, dy, zero), kh, kw, p, q, sh, sw)
    dx[...] = dxp[:, :, ph:ph + h, pw:pw + w]
    return dx


def _window_counts(size, k, s, pad, out):
    """Number of non-padding positions in each of the out windows along one axis."""
    start = np.arange(out) * s - pad
    return np.minimum(start + k, size) - np.maximum(start, 0)


def _avg_divisor(h, w, kh, kw, sh, sw, ph, pw, p, q, dtype):
    ch = _window_counts(h, kh, sh, ph, p)
    cw = _window_counts(w, kw, sw, pw, q)
    return np.outer(ch, cw).astype(dtype)


def avgpool_forward(x, kernel, stride, pad, out):
    """Average pooling; padding is excluded from each window's count."""
    op = "avgpool_forward"
    n, c, p, q = ck.check_pool_forward(op, x, kernel, stride, pad, out)
    kh, kw = ck.pair(kernel, "kernel", op)
    sh, sw = ck.pair(stride, "stride", op)
    ph, pw = ck.pair(pad, "pad", op)
    h, w = x.shape[2:]
    xp = _padded(x, ph, pw)
    acc = np.zeros(out.shape, dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            acc += _window(xp, i, j, p, q, sh, sw)
    np.divide(acc, _avg_divisor(h, w, kh, kw, sh, sw, ph, pw, p, q, x.dtype), out=out)
    return out


def avgpool_backward(dy, kernel, stride, pad, dx):
    """Spread each output gradient evenly over its window's non-padding inputs."""
    op = "avgpool_backward"
    n, c, p, q = ck.check_pool_backward(op, dy, kernel, stride, pad, dx)
    kh, kw = ck.pair(kernel, "kernel", op)
    sh, sw = ck.pair(stride, "stride", op)
    ph, pw = ck.pair(pad, "pad", op)
    h, w = dx.shape[2:]
    g = dy / _avg_divisor(h, w, kh, kw, sh, sw, ph, pw, p, q, dx.dtype)
    dxp = np.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=dx.dtype)
    _scatter_windows(dxp, lambda i, j: g, kh, kw, p, q, sh, sw)
    dx[...] = dxp[:, :, ph:ph + h, pw:pw + w]
    return dx


# --- batch normalization ------------------------------------------------------------------

_BN_AXES = (0, 2, 3)


def _bcast(v):
    return v.reshape(1, -1, 1, 1)


def batchnorm_forward(x, gamma, beta, eps, out, mean_out, var_out):
    """Training-mode batch norm: batch mean and biased variance over N,H,W."""
    op = "batchnorm_forward"
    ck.check_channels(op, x, [("gamma", gamma, False), ("beta", beta, False),
                              ("mean_out", mean_out, True), ("var_out", var_out, True)])
    ck.check_same_shape(op, "x", x, [("out", out, True)])
    ck.same_dtype(op, x=x, gamma=gamma, beta=beta, mean_out=mean_out, var_out=var_out)
    ck.check_batch_stats(op, x)
    eps = ck.check_eps(op, eps)
    mean = x.mean(axis=_BN_AXES)
    centred = x - _bcast(mean)
    var = np.mean(centred * centred, axis=_BN_AXES)
    scale = gamma / np.sqrt(var + x.dtype.type(eps))
    np.multiply(centred, _bcast(scale), out=out)
    out += _bcast(beta)
    mean_out[...] = mean
    var_out[...] = var
    return out


def batchnorm_backward(dy, x, gamma, mean, var, eps, dx, dgamma, dbeta):
    """Gradients of training-mode batch norm given the saved batch mean and variance."""
    op = "batchnorm_backward"
    ck.check_channels(op, x, [("gamma", gamma, False), ("mean", mean, False), ("var", var, False),
                              ("dgamma", dgamma, True), ("dbeta", dbeta, True)])
    ck.check_same_shape(op, "x", x, [("dy", dy, False), ("dx", dx, True)])
    ck.same_dtype(op, x=x, gamma=gamma, mean=mean, var=var, dgamma=dgamma, dbeta=dbeta)
    ck.check_batch_stats(op, x)
    eps = ck.check_eps(op, eps)
    m = x.shape[0] * x.shape[2] * x.shape[3]
    invstd = 1.0 / np.sqrt(var + x.dtype.type(eps))
    xhat = (x - _bcast(mean)) * _bcast(invstd)
    sum_dy = dy.sum(axis=_BN_AXES)
    sum_dy_xhat = (dy * xhat).sum(axis=_BN_AXES)
    # dx = gamma*invstd * (dy - mean(dy) - xhat*mean(dy*xhat))
    t = xhat * _bcast(sum_dy_xhat / m)
    t += _bcast(sum_dy / m)
    np.subtract(dy, t, out=dx)
    dx *= _bcast(gamma * invstd)
    dgamma[...] = sum_dy_xhat
    dbeta[...] = sum_dy
    return dx


def batchnorm_relu_forward(x, gamma, beta, eps, out, mean_out, var_out):
    """Training batch norm followed by ReLU: out = max(batchnorm(x), 0)."""
    batchnorm_forward(x, gamma, beta, eps, out, mean_out, var_out)
    np.maximum(out, out.dtype.type(0), out=out)
    return out


def batchnorm_relu_backward(dy, y, x, gamma, mean, var, eps, dx, dgamma, dbeta, acc=None):
    """Gradients of batchnorm_relu_forward, given its output y (the ReLU mask is y > 0); with
    acc (N, >= C, H, W), its first C channels are added to dx (a concatenation's gradient)."""
    op = "batchnorm_relu_backward"
    ck.check_same_shape(op, "y", y, [("dy", dy, False)])
    if acc is not None:
        ck.check_acc(op, acc, dx)
    batchnorm_backward(dy * (y > 0), x, gamma, mean, var, eps, dx, dgamma, dbeta)
    if acc is not None:
        dx += acc[:, :dx.shape[1]]
    return dx


def batchnorm_inference(x, gamma, beta, mean, var, eps, out):
    """Batch norm with given (running) statistics."""
    op = "batchnorm_inference"
    ck.check_channels(op, x, [("gamma", gamma, False), ("beta", beta, False),
                              ("mean", mean, False), ("var", var, False)])
    ck.check_same_shape(op, "x", x, [("out", out, True)])
    ck.same_dtype(op, x=x, gamma=gamma, beta=beta, mean=mean, var=var)
    eps = ck.check_eps(op, eps)
    scale = gamma / np.sqrt(var + x.dtype.type(eps))
    np.multiply(x, _bcast(scale), out=out)
    out += _bcast(beta - mean * scale)
    return out


# --- elementwise --------------------------------------------------------------------------

def relu_forward(x, out):
    """out = max(x, 0) (out may be x)."""
    ck.check_same_shape("relu_forward", "x", x, [("out", out, True)])
    np.maximum(x, x.dtype.type(0), out=out)
    return out


def relu_backward(dy, x, dx):
    """dx = dy where x > 0, else 0."""
    ck.check_same_shape("relu_backward", "x", x, [("dy", dy, False), ("dx", dx, True)])
    np.multiply(dy, x > 0, out=dx)
    return dx


def add(a, b, out):
    """out = a + b (residual connections)."""
    ck.check_same_shape("add", "a", a, [("b", b, False), ("out", out, True)])
    np.add(a, b, out=out)
    return out


# --- dense --------------------------------------------------------------------------------

def dense_forward(x, w, b, out, relu=False):
    """out = x @ w.T + b with x (N,I), w (O,I); then out = max(out, 0) when relu."""
    ck.check_dense_forward("dense_forward", x, w, b, out)
    np.matmul(x, w.T, out=out)
    if b is not None:
        out += b
    if relu:
        np.maximum(out, out.dtype.type(0), out=out)
    return out


def relu_backward_bias(dy, y, dx, db):
    """dx = dy where y > 0, else 0, and db = sum of dx over the batch (dx may be dy)."""
    ck.check_relu_backward_bias("relu_backward_bias", dy, y, dx, db)
    np.multiply(dy, y > 0, out=dx)
    np.sum(dx, axis=0, out=db)
    return dx


def dense_backward_data(dy, w, dx):
    """dx = dy @ w."""
    ck.check_dense_backward_data("dense_backward_data", dy, w, dx)
    np.matmul(dy, w, out=dx)
    return dx


def dense_backward_weights(x, dy, dw, db):
    """dw = dy.T @ x and db = sum of dy over the batch (db may be None)."""
    ck.check_dense_backward_weights("dense_backward_weights", x, dy, dw, db)
    np.matmul(dy.T, x, out=dw)
    if db is not None:
        np.sum(dy, axis=0, out=db)
    return dw


# --- DenseNet plumbing, loss and update ----------------------------------------------------

def concat_channels(xs, out):
    """Concatenate NCHW arrays along C into out."""
    ck.check_concat("concat_channels", xs, out)
    c0 = 0
    for a in xs:
        out[:, c0:c0 + a.shape[1]] = a
        c0 += a.shape[1]
    return out


def slice_channels(x, start, out):
    """out = x[:, start:start + C] for out (N, C, ...): one part of a concatenation."""
    start = ck.check_slice("slice_channels", x, start, out)
    out[...] = x[:, start:start + out.shape[1]]
    return out


def place_channels(x, start, out):
    """out[:, start:start + C] = x for x (N, C, ...): one part of a concatenation written in
    place (out's other channels are kept)."""
    start = ck.check_place("place_channels", x, start, out)
    out[:, start:start + x.shape[1]] = x
    return out


def split_channels(dy, sizes, outs):
    """Split dy along C into outs with the given channel counts (inverse of concat)."""
    sizes = ck.check_split("split_channels", dy, sizes, outs)
    c0 = 0
    for s, o in zip(sizes, outs):
        o[...] = dy[:, c0:c0 + s]
        c0 += s
    return outs


def softmax_cross_entropy(logits, labels, dlogits_out):
    """Mean softmax cross-entropy over the batch; writes d(loss)/d(logits) unless None."""
    ck.check_softmax_ce("softmax_cross_entropy", logits, labels, dlogits_out)
    n = logits.shape[0]
    rows = np.arange(n)
    shifted = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    total = e.sum(axis=1, keepdims=True)
    loss = float(np.mean(np.log(total[:, 0]) - shifted[rows, labels]))
    if dlogits_out is not None:
        np.divide(e, total * n, out=dlogits_out)
        dlogits_out[rows, labels] -= logits.dtype.type(1.0 / n)
    return loss


def sgd_update(param, grad, lr):
    """param -= lr * grad, in place."""
    ck.check_same_shape("sgd_update", "param", param, [("grad", grad, False)])
    ck.array("sgd_update", "param", param, writable=True)
    ck.check_lr("sgd_update", lr)
    param -= param.dtype.type(lr) * grad
    return param
