"""Dot-interaction forward kernels specialised for one (features, feature size) shape.

``make_forward(NF, FS)`` returns a jitted closure over the two sizes, so numba compiles them
as constants: LLVM vectorises across pairs on a transposed copy of the sample. Every sum is
added in the order of the generic kernel in ``model`` (pair dots over k in order), so results
are bit-identical to it. The closure captures only integers, so numba's disk cache keys each
shape on its values and reuses it across processes.
"""

import numpy as np
from numba import njit, prange

#: Samples per parallel work item.
SPI = 32


def make_forward(NF, FS):
    """The forward kernel for NF features of FS values each: ``forward(t, r)``."""
    NF, FS = int(NF), int(FS)
    NPAIRS = NF * (NF - 1) // 2
    RW = FS + NPAIRS
    TW = NF * FS

    @njit(parallel=True, fastmath=False, nogil=True, cache=True)
    def forward(t, r):
        """r[b] = [t[b, :FS], dot(t_i, t_j) for i in range(NF) for j in range(i)]."""
        nb = t.shape[0]
        tf = t.reshape(-1)
        rf = r.reshape(-1)
        nitems = (nb + SPI - 1) // SPI
        for it in prange(nitems):
            tt = np.empty(FS * NF, dtype=t.dtype)  # the sample transposed: tt[k * NF + i]
            s = np.empty(NF, dtype=t.dtype)
            for b in range(it * SPI, min(nb, it * SPI + SPI)):
                ti = np.uint64(b) * np.uint64(TW)
                ro = np.uint64(b) * np.uint64(RW)
                for k in range(FS):
                    rf[ro + np.uint64(k)] = tf[ti + np.uint64(k)]
                for i in range(NF):
                    for k in range(FS):
                        tt[k * NF + i] = tf[ti + np.uint64(i * FS + k)]
                p = ro + np.uint64(FS)
                for i in range(1, NF):
                    for j in range(i):
                        s[j] = 0
                    for k in range(FS):
                        a = tt[k * NF + i]
                        for j in range(i):
                            s[j] += a * tt[k * NF + j]
                    for j in range(i):
                        rf[p + np.uint64(j)] = s[j]
                    p += np.uint64(i)

    return forward
