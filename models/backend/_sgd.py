"""Threaded SGD update for the oneDNN backend: ``param -= float32(lr) * grad`` in one pass.

Bitwise the same as NumPy's ``param -= param.dtype.type(lr) * grad`` (float32): each element is
``fl(p - fl(lr32 * g))`` — numba compiles without fastmath, so LLVM neither contracts the
multiply and subtract into an FMA nor reorders anything. Large arrays run on numba's parallel
(OpenMP, the same libgomp oneDNN uses) pool over contiguous chunks; small ones serially (a
parallel launch costs more than the update). Without numba, NumPy's two-pass code runs instead.
"""

from __future__ import annotations

import numpy as np

from cachedarrays import threads as _threads
from cachedarrays.layout import readonly_view as _readonly

PARALLEL_MIN = 1 << 18          # elements; below this the serial kernel is faster

try:
    import numba
    from numba import njit, prange
except ImportError:             # pragma: no cover - numba is a dependency of the package
    numba = None


if numba is not None:
    @njit(fastmath=False, nogil=True, cache=True)
    def _sgd_serial(p, g, lr):
        for i in range(p.size):
            p[i] = p[i] - lr * g[i]

    @njit(parallel=True, fastmath=False, nogil=True, cache=True)
    def _sgd_parallel(p, g, lr, nchunks):
        # Each chunk runs the serial kernel on its slices: LLVM vectorizes that loop, which it
        # does not for the same loop written inline in the prange body (4-5x slower).
        n = p.size
        chunk = ((n + nchunks - 1) // nchunks + 15) // 16 * 16
        for c in prange(nchunks):
            lo = min(n, c * chunk)
            hi = min(n, lo + chunk)
            _sgd_serial(p[lo:hi], g[lo:hi], lr)


def set_threads(n: int) -> None:
    """Threads of the parallel update (capped at numba's pool size)."""
    if numba is not None:
        numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))


def sgd_update(param: np.ndarray, grad: np.ndarray, lr) -> np.ndarray:
    """param -= float32(lr) * grad in place; float32, C-contiguous, same shape (checked by caller)."""
    lr32 = param.dtype.type(lr)
    if numba is None or param.dtype != np.float32:
        param -= lr32 * grad
        return param
    p, g = param.reshape(-1), _readonly(grad.reshape(-1))
    if p.size >= PARALLEL_MIN and not _threads.FORKED_AFTER_POOL:
        _sgd_parallel(p, g, lr32, numba.get_num_threads())
    elif p.size:
        _sgd_serial(p, g, lr32)
    return param
