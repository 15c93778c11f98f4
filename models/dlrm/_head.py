"""The backward pass of a one-output layer that reads a ReLU's output, in one pass.

DLRM's top MLP ends in a layer of one output (the click logit) on a ReLU layer. As separate
kernels its backward pass reads that ReLU's output twice (the weight gradient, the ReLU
mask) and writes and rereads the gradient of its input: four passes over a (batch, hidden)
array. ``output_layer_backward`` makes one: per row, the input gradient ``dz[b] * w`` masked
by the ReLU, while summing the weight gradient and both bias gradients. Each product
``dz[b] * w[j]`` rounds once, as the matmul with one inner term it replaces does. Sums run
over fixed chunks of rows into float64 partials, added in chunk order, so the results do not
depend on the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from cachedarrays import threads as _threads
from cachedarrays.layout import readonly_view as _readonly
from cachedarrays.threads import serial_twin

#: Rows per parallel work item (float64 partial sums each); a batch of at most this many rows
#: is one item and runs on the calling thread (a parallel region would only add the wake of a
#: sleeping thread pool).
CHUNK_ROWS = 256


@njit(parallel=True, fastmath=False, nogil=True, cache=True)
def _output_layer_backward(dz, y, w, dx, dw, db, dbp):
    n, h = y.shape
    nchunks = (n + CHUNK_ROWS - 1) // CHUNK_ROWS
    pw = np.zeros((nchunks, h), dtype=np.float64)      # dw partials
    pb = np.zeros((nchunks, h), dtype=np.float64)      # previous layer's db partials
    pz = np.zeros(nchunks, dtype=np.float64)           # db partials
    zero = dx.dtype.type(0)
    for c in prange(nchunks):
        aw = pw[c]
        ab = pb[c]
        s = 0.0
        for i in range(c * CHUNK_ROWS, min(n, (c + 1) * CHUNK_ROWS)):
            g = dz[i]
            g64 = np.float64(g)
            s += g64
            for j in range(h):
                v = y[i, j]
                aw[j] += g64 * v
                d = g * w[j] if v > 0 else zero
                dx[i, j] = d
                ab[j] += d
        pz[c] = s
    for j in range(h):
        sw = 0.0
        sb = 0.0
        for c in range(nchunks):
            sw += pw[c, j]
            sb += pb[c, j]
        dw[j] = sw
        dbp[j] = sb
    s = 0.0
    for c in range(nchunks):
        s += pz[c]
    db[0] = s


_output_layer_backward_serial = serial_twin(_output_layer_backward,
                                            "_output_layer_backward_serial")


def output_layer_backward(dz, y, w, dx, dw, db, dbp):
    """Backward through ``z = y @ w.T + b`` (one output) and the ReLU that made ``y``.

    dz (B, 1): the loss gradient at z; y (B, H): the ReLU's output (the layer's input); w
    (1, H). Writes dw (1, H) and db (1,) of this layer, dx (B, H) = the gradient at the
    ReLU's input, and dbp (H,) = its column sums (the ReLU layer's bias gradient). All
    C-contiguous float32 (checked here). Returns dx.
    """
    if np.ndim(y) != 2:
        raise ValueError(f"output_layer_backward: y must be a (batch, hidden) float32 array, "
                         f"got shape {np.shape(y)}")
    n, h = np.shape(y)
    shapes = {"dz": (dz, (n, 1)), "y": (y, (n, h)), "w": (w, (1, h)), "dx": (dx, (n, h)),
              "dw": (dw, (1, h)), "db": (db, (1,)), "dbp": (dbp, (h,))}
    for name, (a, shape) in shapes.items():
        if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != np.float32 or \
                not a.flags.c_contiguous:
            got = (f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray)
                   else type(a).__name__)
            raise ValueError(f"output_layer_backward: {name} must be a C-contiguous float32 "
                             f"array of shape {shape}, got {got}")
    for name in ("dx", "dw", "db", "dbp"):
        if not shapes[name][0].flags.writeable:
            raise ValueError(f"output_layer_backward: {name} is read-only")
    names = list(shapes)
    for i, out in enumerate(names[3:], 3):          # an output that overlaps another array
        for other in names[:i]:                     # would be read or written out of order
            if np.may_share_memory(shapes[out][0], shapes[other][0]):
                raise ValueError(f"output_layer_backward: {out} shares memory with {other}; "
                                 f"pass separate arrays")
    if n == 0:
        dx[...] = 0
        dw[...] = 0
        db[...] = 0
        dbp[...] = 0
        return dx
    serial = n <= CHUNK_ROWS or _threads.FORKED_AFTER_POOL
    kernel = _output_layer_backward_serial if serial else _output_layer_backward
    kernel(_readonly(dz.reshape(n)), _readonly(y), _readonly(w.reshape(h)), dx, dw.reshape(h),
           db, dbp)
    return dx

