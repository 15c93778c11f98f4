"""Threaded bias gradients for the oneDNN backend: ``db = sum of dy over the batch``, alone or
fused with the ReLU backward pass (``dx = dy * (y > 0)``, then ``db = sum of dx``).

Fused, the column sums cost nothing beyond the ReLU pass itself, which reads dy and writes dx
anyway; oneDNN's inner product computes the bias gradient in its weight-gradient kernel, which
measured slower than a matmul for the weights plus this pass. Rows are split into contiguous
chunks on numba's parallel pool (libgomp, as oneDNN's), each chunk summing into its own float64
row; the chunk rows are added in order, so the result does not depend on the thread count.
"""

from __future__ import annotations

import numpy as np

from cachedarrays import threads as _threads
from cachedarrays.layout import readonly_view as _readonly

CHUNK_ROWS = 256               # rows per work item (a float64 partial row each)
PARALLEL_MIN = 1 << 16         # elements; below this NumPy's serial passes are faster than a launch

try:
    import numba
    from numba import njit, prange
except ImportError:             # pragma: no cover - numba is a dependency of the package
    numba = None


if numba is not None:
    # Three kernels spelled out rather than one shared row loop with a mask switch: that
    # version measured 1.5-2x slower (the switch stayed in the loop).

    @njit(fastmath=False, nogil=True, cache=True)
    def _add_rows(parts, db):
        for j in range(db.shape[0]):
            s = 0.0
            for c in range(parts.shape[0]):
                s += parts[c, j]
            db[j] = s

    @njit(parallel=True, fastmath=False, nogil=True, cache=True)
    def _masked_sums(dy, y, dx, db):
        n, o = dy.shape
        nchunks = (n + CHUNK_ROWS - 1) // CHUNK_ROWS
        parts = np.zeros((nchunks, o), dtype=np.float64)
        for c in prange(nchunks):
            acc = parts[c]
            for i in range(c * CHUNK_ROWS, min(n, (c + 1) * CHUNK_ROWS)):
                for j in range(o):
                    v = dy[i, j] if y[i, j] > 0 else np.float32(0)
                    dx[i, j] = v
                    acc[j] += v
        _add_rows(parts, db)

    @njit(parallel=True, fastmath=False, nogil=True, cache=True)
    def _masked_sums_inplace(d, y, db):
        # d is both read and written: one array argument, so LLVM vectorizes the loop (two
        # arguments naming the same memory fail its overlap check and run the scalar loop,
        # measured 3-5x slower)
        n, o = d.shape
        nchunks = (n + CHUNK_ROWS - 1) // CHUNK_ROWS
        parts = np.zeros((nchunks, o), dtype=np.float64)
        for c in prange(nchunks):
            acc = parts[c]
            for i in range(c * CHUNK_ROWS, min(n, (c + 1) * CHUNK_ROWS)):
                for j in range(o):
                    v = d[i, j] if y[i, j] > 0 else np.float32(0)
                    d[i, j] = v
                    acc[j] += v
        _add_rows(parts, db)

    @njit(parallel=True, fastmath=False, nogil=True, cache=True)
    def _sums(dy, db):
        n, o = dy.shape
        nchunks = (n + CHUNK_ROWS - 1) // CHUNK_ROWS
        parts = np.zeros((nchunks, o), dtype=np.float64)
        for c in prange(nchunks):
            acc = parts[c]
            for i in range(c * CHUNK_ROWS, min(n, (c + 1) * CHUNK_ROWS)):
                for j in range(o):
                    acc[j] += dy[i, j]
        _add_rows(parts, db)


def relu_backward_bias(dy: np.ndarray, y: np.ndarray, dx: np.ndarray, db: np.ndarray) -> None:
    """dx = dy where y > 0 else 0, and db = the column sums of dx (float32 (N,O) arrays,
    C-contiguous, checked by the caller; dx may be dy, or overlap it)."""
    inplace = dx is dy or dx.ctypes.data == dy.ctypes.data
    if numba is None or dy.size < PARALLEL_MIN or _threads.FORKED_AFTER_POOL or \
            (not inplace and np.may_share_memory(dx, dy)):
        np.multiply(dy, y > 0, out=dx)         # NumPy buffers a partly overlapping dx itself
        np.sum(dx, axis=0, out=db)
    elif inplace:
        _masked_sums_inplace(dx, _readonly(y), db)
    else:
        _masked_sums(_readonly(dy), _readonly(y), dx, db)


def bias_grad(dy: np.ndarray, db: np.ndarray) -> None:
    """db = the column sums of dy (float32 (N,O), C-contiguous, checked by the caller)."""
    if numba is None or dy.size < PARALLEL_MIN or _threads.FORKED_AFTER_POOL:
        np.sum(dy, axis=0, out=db)
        return
    _sums(_readonly(dy), db)
