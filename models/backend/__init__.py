"""Compute backends: the same float32 NCHW kernels implemented with NumPy and with oneDNN.

Kernels take plain ``numpy.ndarray`` arguments (views handed out by pinned CachedArray access
scopes), write into preallocated outputs, return them, and keep no reference between calls.
"""

from __future__ import annotations

import importlib
from typing import Protocol, Sequence

import numpy as np

_MODULES = {"numpy": "reference", "onednn": "onednn"}


class Backend(Protocol):
    """The kernel interface every backend module implements (float32, NCHW, C-contiguous).

    Geometry arguments (stride, pad, kernel) are an int or an (h, w) pair. Every function
    validates shapes first and raises ValueError naming the operation and expected shapes.
    """

    name: str

    def conv2d_output_shape(self, x_shape, w_shape, stride, pad) -> tuple:
        """(N,K,P,Q) for x (N,C,H,W) and w (K,C,R,S)."""

    def conv2d_forward(self, x, w, b, stride, pad, out) -> np.ndarray:
        """out (N,K,P,Q) = conv(x, w) + b; b (K,) or None."""

    def conv2d_backward_data(self, dy, w, stride, pad, dx) -> np.ndarray:
        """dx (N,C,H,W) from dy (N,K,P,Q)."""

    def conv2d_backward_weights(self, x, dy, stride, pad, dw, db) -> np.ndarray:
        """dw (K,C,R,S) and db (K,) (db may be None); returns dw."""

    def maxpool_state_spec(self, x_shape, out_shape, kernel=None) -> tuple:
        """(shape, dtype) of the state maxpool_forward returns (argmax ids / oneDNN workspace)."""

    def maxpool_forward(self, x, kernel, stride, pad, out, state=None) -> np.ndarray:
        """Max pooling into out; returns the state (written into ``state`` when given)."""

    def maxpool_backward(self, dy, x, state, kernel, stride, pad, dx) -> np.ndarray:
        """dx from dy and the forward state."""

    def avgpool_forward(self, x, kernel, stride, pad, out) -> np.ndarray:
        """Average pooling, padding excluded from the count; global pooling is kernel=(H, W)."""

    def avgpool_backward(self, dy, kernel, stride, pad, dx) -> np.ndarray:
        """dx of average pooling."""

    def batchnorm_forward(self, x, gamma, beta, eps, out, mean_out, var_out) -> np.ndarray:
        """Training batch norm; batch mean and biased variance over N,H,W into mean_out/var_out."""

    def batchnorm_backward(self, dy, x, gamma, mean, var, eps, dx, dgamma, dbeta) -> np.ndarray:
        """dx, dgamma, dbeta of training batch norm; returns dx."""

    def batchnorm_relu_forward(self, x, gamma, beta, eps, out, mean_out, var_out) -> np.ndarray:
        """Training batch norm then ReLU in one kernel: out = max(batchnorm(x), 0)."""

    def batchnorm_relu_backward(self, dy, y, x, gamma, mean, var, eps, dx, dgamma,
                                dbeta, acc=None) -> np.ndarray:
        """dx, dgamma, dbeta of batchnorm_relu_forward given its output y; returns dx. With acc
        (N, >= C, H, W), its first C channels are added to dx (a concatenation's gradient)."""

    def batchnorm_inference(self, x, gamma, beta, mean, var, eps, out) -> np.ndarray:
        """Batch norm with given statistics."""

    def relu_forward(self, x, out) -> np.ndarray:
        """out = max(x, 0)."""

    def relu_backward(self, dy, x, dx) -> np.ndarray:
        """dx = dy * (x > 0)."""

    def dense_forward(self, x, w, b, out, relu=False) -> np.ndarray:
        """out (N,O) = x (N,I) @ w.T (O,I) + b (O,) or None; with relu, max(out, 0) after."""

    def relu_backward_bias(self, dy, y, dx, db) -> np.ndarray:
        """dx (N,O) = dy * (y > 0) (dx may be dy) and db (O,) = sum(dx) over the batch."""

    def dense_backward_data(self, dy, w, dx) -> np.ndarray:
        """dx (N,I) = dy @ w."""

    def dense_backward_weights(self, x, dy, dw, db) -> np.ndarray:
        """dw (O,I) = dy.T @ x, db (O,) = sum(dy) (db may be None); returns dw."""

    def concat_channels(self, xs: Sequence[np.ndarray], out) -> np.ndarray:
        """out = concatenate(xs, axis=1)."""

    def slice_channels(self, x, start, out) -> np.ndarray:
        """out = x[:, start:start + C] for out (N, C, ...)."""

    def place_channels(self, x, start, out) -> np.ndarray:
        """out[:, start:start + C] = x for x (N, C, ...); out's other channels are kept."""

    def split_channels(self, dy, sizes: Sequence[int], outs: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        """outs[i] = dy[:, offset_i : offset_i + sizes[i]]."""

    def add(self, a, b, out) -> np.ndarray:
        """out = a + b."""

    def softmax_cross_entropy(self, logits, labels, dlogits_out) -> float:
        """Mean cross-entropy of softmax(logits) (N,classes) vs int64 labels (N,); gradient into dlogits_out."""

    def sgd_update(self, param, grad, lr) -> np.ndarray:
        """param -= lr * grad in place."""


def get_backend(name: str) -> Backend:
    """The backend module for ``name`` ("numpy" or "onednn"); missing libdnnl raises ImportError."""
    try:
        module = _MODULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(_MODULES)}") from None
    return importlib.import_module(f".{module}", __name__)


def available_backends() -> list[str]:
    """Names of the backends that load in this environment ("numpy" always)."""
    names = []
    for name in _MODULES:
        try:
            get_backend(name)
        except ImportError:
            continue
        names.append(name)
    return names


__all__ = ["Backend", "get_backend", "available_backends"]
