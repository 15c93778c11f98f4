"""Dissertation Listing 4.4: one matrix product with all arrays in fast memory, then in slow.

    python benchmarks/matmul.py [--size 2000] [--repeats 5] [--slow-path PATH] [--plot PNG]

Also times plain NumPy on ordinary arrays (the peer) and numpy.memmap operands (what a user
would otherwise pick for data larger than memory), and prints the bytes each phase moved.
Without persistent memory the slow device is a file mapping the OS keeps in DRAM, so the
fast/slow gap here is small; the traffic figures are what a real slow device would serve.
Every ratio is a speedup: NumPy's time on ordinary arrays / the run's time (> 1: faster).
"""

import os
import sys
import tempfile

import _common  # noqa: F401  (first: thread settings before NumPy loads its pools)
from _common import Stat, interleaved_samples, machine, speedup

import numpy as np  # noqa: E402

import cachedarrays as ca  # noqa: E402


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--size", type=_common.whole(), default=2000,
                   help="matrix side n (n x n float32)")
    p.add_argument("--repeats", type=_common.whole(), default=5,
                   help="interleaved repetitions (>= 3)")
    p.add_argument("--slow-path", default=None, type=_common.slow_path,
                   help="file or folder for the slow device (default: a temporary file)")
    _common.add_standard(p)                     # --no-progress too: it shows no bar
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error("--repeats must be >= 3 (medians are of at least 3 samples)")
    n = args.size
    nbytes = n * n * 4
    _common.check_memory(p, 6 * nbytes, "--size")      # 3 ndarrays, 3 in fast memory
    _common.apply_threads(args.threads)
    print(machine())
    print(_common.thread_line())
    print(f"C = A @ B with {n}x{n} float32 matrices ({ca.format_size(nbytes)} each)\n")
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((n, n), dtype=np.float32)
    b_np = rng.standard_normal((n, n), dtype=np.float32)
    c_np = np.empty_like(a_np)
    room = 4 * (-(-(nbytes + 64) // 4096) * 4096)      # 3 matrices, each with its header
    with ca.Manager(fast=room, slow=room, slow_path=args.slow_path) as m, \
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
        t_fast, t_np = map(Stat, interleaved_samples([fast, plain], args.repeats, 1))
        moved_fast = m.stats()["moved"]
        ca.evict(A, B, C)
        assert A.device == B.device == C.device == "slow"
        m.reset_stats()
        t_slow, t_mm = map(Stat, interleaved_samples([slow, memmap], args.repeats, 1))
        moved_slow = m.stats()["moved"]
        np.testing.assert_allclose(np.asarray(C), a_np @ b_np, rtol=1e-3, atol=1e-2)

    runs = (("numpy (ordinary arrays)", t_np), ("CachedArray, all in fast memory", t_fast),
            ("CachedArray, all in slow memory", t_slow), ("numpy.memmap operands", t_mm))
    print(f"{'run':34}{'seconds: median [min-max, n]':>34}{'speedup vs numpy':>18}")
    for name, t in runs:
        print(f"{name:34}{t.fmt(1, 's', 4):>34}{speedup(t_np, t):>18.2f}")
    _common.headline("matmul fast-memory speedup vs numpy", speedup(t_np, t_fast))
    _common.headline("matmul slow-memory speedup vs numpy.memmap", speedup(t_mm, t_slow))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.barh([r[0] for r in runs], [r[1].median for r in runs],
                xerr=[[r[1].median - r[1].lo for r in runs], [r[1].hi - r[1].median for r in runs]])
        ax.set_xlabel("seconds per product (median, min-max)")
        ax.set_title(f"C = A @ B, {n}x{n} float32")
        _common.save_plot(fig, args.plot)
    print(f"\nbytes moved between devices during the fast runs: {moved_fast or 'none'}")
    print(f"bytes moved between devices during the slow runs: {moved_slow or 'none'}")
    print("kernels read and wrote the slow device in place: "
          f"{ca.format_size(3 * nbytes)} touched per product")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
