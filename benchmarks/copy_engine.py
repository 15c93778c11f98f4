"""Copy bandwidth: cachedarrays' copy engine against np.copyto and libc memcpy on the same buffers.

Three directions: fast->fast (anonymous mappings), fast->slow and slow->fast (slow is a mapping
of a temporary file). One and two threads; the two-thread peers copy the two halves from two
Python threads (numpy and ctypes release the GIL). Medians of interleaved repetitions, with the
spread of ours; speedup = np.copyto's time / ours (> 1: ours is faster).

    python benchmarks/copy_engine.py [--sizes 1M,64M] [--repeats 7] [--quick] [--nt-threshold 4M]
"""
from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time

import _common  # first: thread settings before NumPy loads its pools
from _common import Stat

import numpy as np  # noqa: E402

from cachedarrays import copyengine as ce  # noqa: E402


DIRECTIONS = ("fast->fast", "fast->slow", "slow->fast")


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


class Pair:
    """Two persistent threads that run f(0) and f(1) together (the 2-thread peer)."""

    def __init__(self):
        self.job = None
        self.start = [threading.Semaphore(0), threading.Semaphore(0)]
        self.done = threading.Semaphore(0)
        self.threads = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in (0, 1)]
        for t in self.threads:
            t.start()

    def _loop(self, k):
        while True:
            self.start[k].acquire()
            self.job(k)
            self.done.release()

    def run(self, job):
        self.job = job
        self.start[0].release()
        self.start[1].release()
        self.done.acquire()
        self.done.acquire()


def plot(path, curves):
    """Bandwidth against size, one panel per direction and thread count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted(curves)
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = curves[key]
        xs = [p[0] for p in pts]
        for col, label in ((1, "ours"), (2, "np.copyto"), (3, "memcpy")):
            ax.plot(xs, [p[col] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{key[0]}, {key[1]} thread(s)", fontsize=9)
        ax.set_xlabel("bytes")
    axes[0][0].set_ylabel("GB/s (median)")
    axes[0][0].legend(fontsize=8)
    _common.save_plot(fig, path)


def main(argv=None) -> int:
    ap = _common.parser(__doc__)
    ap.add_argument("--sizes", type=_common.listed(_common.size(1)),
                    help="comma-separated sizes (e.g. 4K,1M,64M); default 4 KiB..1 GiB by 4x")
    ap.add_argument("--repeats", type=_common.whole(), default=7,
                    help="interleaved repetitions per cell (median, >= 3)")
    ap.add_argument("--quick", action="store_true", help="stop at 64 MiB")
    ap.add_argument("--threads", default="1,2", type=_common.listed(_common.thread_count),
                    help="thread counts to measure, comma-separated "
                    "(ours: copy-engine threads; the peers: that many Python threads)")
    ap.add_argument("--nt-threshold", type=_common.size(0),
                    help="override the non-temporal store threshold (0 disables)")
    ap.add_argument("--directions", default="fast->fast,fast->slow,slow->fast",
                    type=_common.listed(_common.one_of(DIRECTIONS)),
                    help="comma-separated, from fast->fast, fast->slow, slow->fast")
    _common.add_standard(ap, with_threads=False)
    args = ap.parse_args(argv)
    if args.repeats < 3:
        ap.error("--repeats must be >= 3 (medians are of at least 3 samples)")

    if args.sizes:
        sizes = args.sizes
    else:
        top = 64 << 20 if args.quick else 1 << 30
        sizes = []
        n = 4 << 10
        while n <= top:
            sizes.append(n)
            n *= 4
    if args.nt_threshold is not None:
        ce.set_nt_threshold(args.nt_threshold)
    threads = args.threads
    directions = args.directions
    biggest = max(sizes)

    t0 = time.perf_counter()
    auto = ce.get_threads()   # triggers the automatic calibration
    calib_ms = (time.perf_counter() - t0) * 1e3

    fast_a = mmap.mmap(-1, biggest)
    fast_b = mmap.mmap(-1, biggest)
    fd, path = tempfile.mkstemp(prefix="cachedarrays-copybench-", dir=tempfile.gettempdir())
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    os.ftruncate(fd, biggest)
    slow = mmap.mmap(fd, biggest)
    os.close(fd)
    views = {name: np.frombuffer(m, dtype=np.uint8) for name, m in
             (("fastA", fast_a), ("fastB", fast_b), ("slow", slow))}
    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for v in views.values():      # pre-fault every page (and give the source real data)
        for i in range(0, biggest, len(chunk)):
            v[i:i + len(chunk)] = chunk[:min(len(chunk), biggest - i)]
    pairs = {"fast->fast": ("fastA", "fastB"), "fast->slow": ("fastA", "slow"),
             "slow->fast": ("slow", "fastB")}

    libc = ctypes.CDLL(None)
    memcpy = libc.memcpy
    memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memcpy.restype = ctypes.c_void_p
    pair = Pair()

    print(f"# {_common.machine()}, numpy {np.__version__}")
    print(f"# {_common.thread_line()}")
    print(f"# copy engine: ISA {ce.isa()}, non-temporal threshold {fmt_size(ce.get_nt_threshold()) if ce.get_nt_threshold() else 'off'}, "
          f"automatic default threads {auto} (calibration {calib_ms:.0f} ms)")
    print(f"# slow = file mapping in {tempfile.gettempdir()} (page cache, DRAM); medians of "
          f"{args.repeats} interleaved repetitions")
    head = (f"{'size':>9} {'direction':>10} {'thr':>3} {'ours GB/s [min-max]':>22} {'np.copyto':>10} "
            f"{'memcpy':>8} {'speedup vs np':>14} {'vs memcpy':>10}")
    print(head)
    print("-" * len(head))
    sys.stdout.flush()

    ratios_big, curves = [], {}
    cells = [(n, d, t) for n in sizes for d in directions for t in threads]
    bar = _common.progress(total=len(cells), desc="copy cells", disable=args.no_progress)
    for n in sizes:
        inner = max(1, int(8e-3 * 10e9 / n))   # each sample ~8 ms at 10 GB/s
        for direction in directions:
            s_name, d_name = pairs[direction]
            src, dst = views[s_name][:n], views[d_name][:n]
            sa, da = src.ctypes.data, dst.ctypes.data
            half = (n // 2) & ~63
            for t in threads:
                if t == 1:
                    impls = {
                        "ours": lambda: ce.copy(da, sa, n, threads=1),
                        "np": lambda: np.copyto(dst, src),
                        "memcpy": lambda: memcpy(da, sa, n),
                    }
                else:
                    parts = [(0, half), (half, n)]
                    impls = {
                        "ours": lambda: ce.copy(da, sa, n, threads=t),
                        "np": lambda: pair.run(lambda k: np.copyto(dst[parts[k][0]:parts[k][1]],
                                                                   src[parts[k][0]:parts[k][1]])),
                        "memcpy": lambda: pair.run(lambda k: memcpy(da + parts[k][0], sa + parts[k][0],
                                                                    parts[k][1] - parts[k][0])),
                    }
                samples = {k: [] for k in impls}
                names = list(impls)
                for f in impls.values():   # warm-up
                    f()
                for rep in range(args.repeats):
                    order = names[rep % 3:] + names[:rep % 3]   # rotate who goes first
                    for k in order:
                        f = impls[k]
                        a = time.perf_counter()
                        for _ in range(inner):
                            f()
                        samples[k].append((time.perf_counter() - a) / inner)
                stats = {k: Stat(v) for k, v in samples.items()}
                gbs = {k: n / st.median / 1e9 for k, st in stats.items()}
                ratio = _common.speedup(stats["np"], stats["ours"])
                vs_memcpy = _common.speedup(stats["memcpy"], stats["ours"])
                if n >= 1 << 20:
                    ratios_big.append(ratio)
                curves.setdefault((direction, t), []).append((n, gbs["ours"], gbs["np"], gbs["memcpy"]))
                spread = f"{gbs['ours']:.2f} [{n / stats['ours'].hi / 1e9:.1f}-{n / stats['ours'].lo / 1e9:.1f}]"
                bar.update()
                print(f"{fmt_size(n):>9} {direction:>10} {t:>3} {spread:>22} {gbs['np']:>10.2f} "
                      f"{gbs['memcpy']:>8.2f} {ratio:>14.2f} {vs_memcpy:>10.2f}")
                sys.stdout.flush()
    bar.close()
    if ratios_big:
        print(f"# sizes >= 1 MiB: speedup vs np.copyto min {min(ratios_big):.2f}, "
              f"median {statistics.median(ratios_big):.2f}, max {max(ratios_big):.2f}")
        _common.headline("copy engine speedup vs np.copyto (>= 1 MiB, median)",
                         statistics.median(ratios_big))
    if args.plot:
        plot(args.plot, curves)
    return 0   # the mappings go away with the process; the file is unlinked at exit


if __name__ == "__main__":
    sys.exit(_common.run(main))
