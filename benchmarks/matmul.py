"""Dissertation Listing 4.4: one matrix product with all arrays in fast memory, then in slow.

    python benchmarks/matmul.py [--size 2000] [--repeats 5] [--slow-path PATH]

Also times plain NumPy on ordinary arrays (the peer) and numpy.memmap operands (what a user
would otherwise pick for data larger than memory), and prints the bytes each phase moved.
Without persistent memory the slow device is a file mapping the OS keeps in DRAM, so the
fast/slow gap here is small; the traffic figures are what a real slow device would serve.
"""

import argparse
import os
import sys
import tempfile

import numpy as np

import cachedarrays as ca
from _common import interleaved, machine


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--slow-path", default=None)
    args = p.parse_args(argv)
    n = args.size
    nbytes = n * n * 4
    print(machine())
    print(f"C = A @ B with {n}x{n} float32 matrices ({ca.format_size(nbytes)} each)\n")
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((n, n), dtype=np.float32)
    b_np = rng.standard_normal((n, n), dtype=np.float32)
    c_np = np.empty_like(a_np)
    with ca.Manager(fast=4 * nbytes, slow=4 * nbytes, slow_path=args.slow_path) as m, \
            tempfile.TemporaryDirectory() as tmp:
        A = ca.asarray(a_np, manager=m)
        B = ca.asarray(b_np, manager=m)
        C = np.empty_like(A)
        mm = []
        for name, src in (("a", a_np), ("b", b_np), ("c", c_np)):
            f = np.memmap(os.path.join(tmp, name), dtype=np.float32, mode="w+", shape=(n, n))
            f[:] = src
            mm.append(f)

        def fast():
            np.matmul(A, B, out=C)

        def slow():
            np.matmul(A, B, out=C)

        def plain():
            np.matmul(a_np, b_np, out=c_np)

        def memmap():
            np.matmul(mm[0], mm[1], out=mm[2])

        ca.prefetch(A, B, C, force=True)
        assert A.device == B.device == C.device == "fast"
        m.reset_stats()
        t_fast, t_np = interleaved([fast, plain], args.repeats, 1)
        moved_fast = m.stats()["moved"]
        ca.evict(A, B, C)
        assert A.device == B.device == C.device == "slow"
        m.reset_stats()
        t_slow, t_mm = interleaved([slow, memmap], args.repeats, 1)
        moved_slow = m.stats()["moved"]
        np.testing.assert_allclose(np.asarray(C), a_np @ b_np, rtol=1e-3, atol=1e-2)

    print(f"{'run':34}{'seconds':>10}{'vs numpy':>10}")
    for name, t in (("numpy (ordinary arrays)", t_np), ("CachedArray, all in fast memory", t_fast),
                    ("CachedArray, all in slow memory", t_slow),
                    ("numpy.memmap operands", t_mm)):
        print(f"{name:34}{t:>10.4f}{t / t_np:>10.2f}")
    print(f"\nbytes moved between devices during the fast runs: {moved_fast or 'none'}")
    print(f"bytes moved between devices during the slow runs: {moved_slow or 'none'}")
    print("kernels read and wrote the slow device in place: "
          f"{ca.format_size(3 * nbytes)} touched per product")
    return 0


if __name__ == "__main__":
    sys.exit(main())
