"""Allocation: new CachedArrays against NumPy's, and the native heap against glibc's malloc.

    python benchmarks/allocator.py [--sizes 64,4K,256K,16M,64M] [--repeats 7] [--ops 200000]
        [--plot PATH]

1. New arrays as a user makes them: one call whose result is dropped at once (its memory is
   freed before the next call), ``ca.empty/zeros/full`` against ``np.empty/zeros/full``, and an
   array made and then written in full (``x[...] = 1.0``), at each size of --sizes (float64
   elements). A CachedArray is a record in its manager, placed by the policy, its bytes a block
   of a heap laid over a mapping made once (huge pages where the system has them). NumPy's
   bytes come from malloc, which maps fresh pages for a large array (above its mmap threshold,
   32 MiB at most), so writing a new large array faults in every page there; ``np.zeros`` of
   such an array maps zero pages and touches none (the cost comes with the first write).
2. The native heap under churn, in a C loop (compiled when the benchmark starts, through cffi):
   one random sequence of --ops steps, each freeing the block in a random one of --live slots
   and allocating one of a random size there (log-uniform in [--min-size, --max-size]), run on
   ``ca_heap_alloc``/``ca_heap_free`` over a heap of --heap bytes and on glibc's
   ``malloc``/``free``: the allocators alone, no Python in the loop. Then the heap's
   fragmentation under the same kind of sizes: allocating without freeing until the first
   request fails although the free bytes would hold it (where a policy must evict or
   defragment), the share of the heap in use at that point.

speedup = NumPy's (or malloc's) time / ours (> 1: ours is faster). Medians of interleaved
repetitions with their spread of ours. --plot PATH: the speedups of section 1 against the size.
"""

import importlib
import math
import mmap
import os
import statistics
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import _common  # noqa: E402  (first: thread settings before NumPy loads its pools)
from _common import Stat, machine  # noqa: E402

import numpy as np  # noqa: E402

import cachedarrays as ca  # noqa: E402
from cachedarrays.heap import Heap  # noqa: E402

#: The C loop of section 2: the step of slot[i] frees that slot's block, then allocates
#: sizes[i] bytes there; returns seconds, or -1 when an allocation failed (the heap too small).
_CHURN_C = r"""
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
typedef int64_t (*heap_alloc_fn)(void *, uint64_t, uint64_t);
typedef int (*heap_free_fn)(void *, int64_t, uint64_t);

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

double churn_heap(uintptr_t heap, uintptr_t alloc_at, uintptr_t free_at, const uint64_t *sizes,
                  const int64_t *slot, int64_t n, int64_t *live, int64_t nlive)
{
    heap_alloc_fn alloc = (heap_alloc_fn)alloc_at;
    heap_free_fn release = (heap_free_fn)free_at;
    void *h = (void *)heap;
    for (int64_t k = 0; k < nlive; k++)
        live[k] = -1;
    double t = now(), failed = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = slot[i];
        if (live[s] >= 0 && release(h, live[s], (uint64_t)s + 1) != 0)
            failed = 1;
        live[s] = alloc(h, sizes[i], (uint64_t)s + 1);
        if (live[s] < 0)
            failed = 1;
    }
    t = now() - t;
    for (int64_t k = 0; k < nlive; k++)
        if (live[k] >= 0)
            release(h, live[k], (uint64_t)k + 1);
    return failed ? -1.0 : t;
}

double churn_malloc(const uint64_t *sizes, const int64_t *slot, int64_t n, void **live,
                    int64_t nlive)
{
    for (int64_t k = 0; k < nlive; k++)
        live[k] = NULL;
    double t = now(), failed = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = slot[i];
        free(live[s]);
        live[s] = malloc(sizes[i]);
        if (live[s] == NULL)
            failed = 1;
        else
            *(volatile char *)live[s] = 1;      /* as the heap writes its block header */
    }
    t = now() - t;
    for (int64_t k = 0; k < nlive; k++)
        free(live[k]);
    return failed ? -1.0 : t;
}
"""

_CHURN_CDEF = """
double churn_heap(uintptr_t heap, uintptr_t alloc_at, uintptr_t free_at, const uint64_t *sizes,
                  const int64_t *slot, int64_t n, int64_t *live, int64_t nlive);
double churn_malloc(const uint64_t *sizes, const int64_t *slot, int64_t n, void **live,
                    int64_t nlive);
"""


def churn_module(folder):
    """The compiled C loops (a cffi module built in folder)."""
    import cffi
    builder = cffi.FFI()
    builder.cdef(_CHURN_CDEF)
    builder.set_source("_ca_churn", _CHURN_C, extra_compile_args=["-O2"])
    builder.compile(tmpdir=folder, verbose=False)
    sys.path.insert(0, folder)
    try:
        return importlib.import_module("_ca_churn")
    finally:
        sys.path.remove(folder)


def random_sizes(rng, n, lo, hi):
    """n sizes log-uniform in [lo, hi] (uint64); exp(log(lo)) may round below lo, and
    truncating it would give lo - 1, so the sizes are clipped to the bounds."""
    s = np.floor(np.exp(rng.uniform(math.log(lo), math.log(hi), n)))
    return np.clip(s, lo, hi).astype(np.uint64)


def check_churn_flags(p, args):
    """p.error, before any work, when the churn cannot run: a block of --max-size larger than
    the whole --heap, or --ops and --live arrays beyond the available memory."""
    mm = mmap.mmap(-1, args.heap)             # not touched: only its first header is written
    heap = Heap(mm, args.heap, name="churn")
    try:
        block, room = heap.block_size(args.max_size), heap.stats().capacity
    finally:
        heap.close()
    if block > room:
        p.error(f"--max-size ({args.max_size} bytes) takes a block of {block} bytes with its "
                f"header, more than the whole --heap ({room} bytes); pass a larger --heap or "
                "a smaller --max-size")
    # sizes and slots (8 bytes each per step), the live blocks' offsets and pointers
    _common.check_memory(p, 6 * max(args.sizes) + 2 * args.heap + 16 * args.ops +
                         16 * args.live, "--sizes, --heap, --ops and --live")


def new_array_calls(m, nbytes):
    """(name, NumPy's call, ours) for one size: each makes an array and drops it."""
    n = max(1, nbytes // 8)

    def np_written():
        a = np.empty(n)
        a[...] = 1.0

    def ca_written():
        x = ca.empty(n, manager=m)
        x[...] = 1.0

    return [("empty", lambda: np.empty(n), lambda: ca.empty(n, manager=m)),
            ("zeros", lambda: np.zeros(n), lambda: ca.zeros(n, manager=m)),
            ("full", lambda: np.full(n, 1.5), lambda: ca.full(n, 1.5, manager=m)),
            ("empty, then written", np_written, ca_written)]


def section_new_arrays(args, bar):
    largest = max(args.sizes)
    rows = []
    fast = max(64 << 20, 4 * largest + (1 << 20))
    with ca.Manager(fast=fast, slow=64 << 20) as m:
        print(f"1. new arrays (float64; fast memory {ca.format_size(fast)}, policy "
              f"{m.policy.name}); median per call [spread of ours]\n")
        print(f"{'call':22}{'bytes':>10}  {'numpy':>12}  {'cachedarrays':32}{'speedup':>8}")
        for nbytes in args.sizes:
            for name, f_np, f_ca in new_array_calls(m, nbytes):
                number = _common.calls_for(f_np, args.budget)
                f_ca()                               # the first call of a size warms up
                t_np, t_ca = _common.interleaved_samples([f_np, f_ca], args.repeats, number)
                sp = _common.speedups(t_np, t_ca)
                rows.append(dict(name=name, nbytes=nbytes, numpy=Stat(t_np), ours=Stat(t_ca),
                                 speedup=sp))
                print(f"{name:22}{ca.format_size(nbytes):>10}  "
                      f"{statistics.median(t_np) * 1e6:9.2f} us  "
                      f"{Stat(t_ca).fmt(1e6, 'us'):32}{sp.median:7.2f}x", flush=True)
                bar.update(1)
    return rows


def churn_loops(args, lib, ffi):
    """(ours, glibc, heap): the two C loops over one random sequence of --ops steps, each
    returning seconds, or -1 when an allocation failed; the sequence is the same every time
    and each loop frees what it made, so a first run that fits means every run fits."""
    rng = np.random.default_rng(args.seed)
    sizes = random_sizes(rng, args.ops, args.min_size, args.max_size)
    slot = rng.integers(0, args.live, args.ops, dtype=np.int64)
    live = np.empty(args.live, dtype=np.int64)
    ptrs = ffi.new("void *[]", args.live)
    mm = mmap.mmap(-1, args.heap)
    heap = Heap(mm, args.heap, name="churn")
    alloc_at, free_at = Heap.entry_points()

    def arrays():                   # the pointers, taken where the closures keep the arrays
        return (ffi.cast("uint64_t *", sizes.ctypes.data), ffi.cast("int64_t *", slot.ctypes.data),
                ffi.cast("int64_t *", live.ctypes.data))

    def ours():
        c_sizes, c_slot, c_live = arrays()
        return lib.churn_heap(heap._addr, alloc_at, free_at, c_sizes, c_slot, args.ops, c_live,
                              args.live)

    def glibc():
        c_sizes, c_slot, _ = arrays()
        t = lib.churn_malloc(c_sizes, c_slot, args.ops, ptrs, args.live)
        if t < 0:
            raise SystemExit("allocator.py: malloc failed; pass a smaller --max-size")
        return t

    return ours, glibc, heap


def heap_too_small(args):
    """The usage error when the churn's --live blocks outgrow its --heap."""
    return (f"--heap ({ca.format_size(args.heap)}) ran out of room for {args.live} live "
            f"blocks of {ca.format_size(args.min_size)}-{ca.format_size(args.max_size)} in "
            "the churn; pass a larger --heap, fewer --live or a smaller --max-size")


def section_churn(args, loops):
    heap_loop, glibc, heap = loops

    def ours():
        t = heap_loop()
        if t < 0:
            raise SystemExit(f"allocator.py: {heap_too_small(args)}")
        return t

    ours(), glibc()                                  # warm up: pages faulted in, bins filled
    t_ours, t_glibc = [], []
    for rep in range(args.repeats):
        for i in _common.turn_order(2, rep):
            (t_ours if i == 0 else t_glibc).append((ours() if i == 0 else glibc()) / args.ops)
    heap.check()
    sp = _common.speedups(t_glibc, t_ours)
    print(f"\n2. the native heap under churn: {args.ops} steps, each freeing one of {args.live} "
          f"blocks and allocating {ca.format_size(args.min_size)}-"
          f"{ca.format_size(args.max_size)} (log-uniform) in its place; heap of "
          f"{ca.format_size(args.heap)}; a C loop, no Python in it")
    print(f"  ca_heap_alloc + ca_heap_free  {Stat(t_ours).fmt(1e9, 'ns per step', 1)}")
    print(f"  malloc + free (glibc)         {Stat(t_glibc).fmt(1e9, 'ns per step', 1)}")
    print(f"  speedup (malloc time / ours)  {sp.fmt(1, 'x')}")
    heap.close()
    return sp


def fill_until_fragmented(args):
    """(share of the heap in use, largest free block / free bytes) when an allocation first
    fails although the free bytes would hold it (allocating random sizes, freeing a random
    live block every other step); None when none failed that way in 4 * --heap / --min-size
    allocations (equal sizes never do)."""
    rng = np.random.default_rng(args.seed + 1)
    mm = mmap.mmap(-1, args.heap)
    heap = Heap(mm, args.heap, name="fragmentation")
    live, owner = [], 0
    try:
        while owner < 4 * args.heap // args.min_size:
            n = int(random_sizes(rng, 1, args.min_size, args.max_size)[0])
            owner += 1
            off = heap.try_alloc(n, owner)
            if off is None:
                st = heap.stats()
                if st.free >= heap.block_size(n):
                    return st.used / st.capacity, st.largest_free / max(st.free, 1)
                if not live:
                    return None                        # a block larger than the whole heap
                k = int(rng.integers(len(live)))       # full, not fragmented: free and go on
                heap.free(*live.pop(k))
                continue
            live.append((off, owner))
            if owner % 2 == 0 and live:
                k = int(rng.integers(len(live)))
                heap.free(*live.pop(k))
        return None                             # never failed that way
    finally:
        heap.close()


def plot(rows, path):
    """Section 1's speedups against the array size, one line per call."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name in dict.fromkeys(r["name"] for r in rows):
        pts = [(r["nbytes"], r["speedup"].median) for r in rows if r["name"] == name]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("array bytes")
    ax.set_ylabel("speedup (numpy time / ours)")
    ax.legend(fontsize=8)
    _common.save_plot(fig, path)


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--sizes", type=_common.listed(_common.size(8)),
                   default=[64, 4 << 10, 256 << 10, 16 << 20, 64 << 20],
                   help="array sizes in bytes for section 1, comma-separated (64,4K,16M)")
    p.add_argument("--repeats", type=_common.whole(), default=7,
                   help="interleaved repetitions per figure (medians of these, >= 3)")
    p.add_argument("--budget", type=_common.positive, default=0.02,
                   help="seconds per timed sample of section 1 (the call count fills it)")
    p.add_argument("--ops", type=_common.whole(), default=200_000,
                   help="steps of the churn of section 2")
    p.add_argument("--live", type=_common.whole(), default=1000,
                   help="blocks live at once in the churn")
    p.add_argument("--min-size", type=_common.size(1), default=64,
                   help="smallest allocation of the churn, in bytes")
    p.add_argument("--max-size", type=_common.size(1), default=64 << 10,
                   help="largest allocation of the churn, in bytes")
    p.add_argument("--heap", type=_common.size(1 << 20), default=256 << 20,
                   help="bytes of the native heap of section 2")
    p.add_argument("--seed", type=_common.whole(0), default=0, help="seed of the random sizes")
    _common.add_standard(p)
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error("--repeats must be >= 3 (medians are of at least 3 samples)")
    if args.min_size > args.max_size:
        p.error(f"--min-size ({args.min_size}) must not exceed --max-size ({args.max_size})")
    check_churn_flags(p, args)
    _common.apply_threads(args.threads)
    print(machine())
    print(_common.thread_line())
    print(f"numpy {np.__version__}; speedup = numpy's (or malloc's) time / ours\n")
    with tempfile.TemporaryDirectory(prefix="cachedarrays-churn-") as folder:
        lib_mod = churn_module(folder)
    loops = churn_loops(args, lib_mod.lib, lib_mod.ffi)
    if loops[0]() < 0:                      # before any timing: the heap must hold the churn
        loops[2].close()
        p.error(heap_too_small(args))
    bar = _common.progress(total=4 * len(args.sizes), desc="new arrays",
                           disable=args.no_progress)
    rows = section_new_arrays(args, bar)
    bar.close()
    churn = section_churn(args, loops)
    frag = fill_until_fragmented(args)
    print(f"\nfragmentation ({ca.format_size(args.min_size)}-{ca.format_size(args.max_size)}, "
          f"a random live block freed every other allocation): ", end="")
    if frag is None:
        print(f"no allocation found the free bytes enough but no free block big enough in "
              f"{4 * args.heap // args.min_size} allocations")
    else:
        print(f"the first allocation that found no free block although the free bytes would "
              f"hold it came with {frag[0]:.2%} of the heap in use; the largest free block was "
              f"then {frag[1]:.1%} of the free bytes")
    print()
    for name in ("empty", "empty, then written"):
        for nbytes in dict.fromkeys((min(args.sizes), max(args.sizes))):
            r = next(r for r in rows if r["name"] == name and r["nbytes"] == nbytes)
            _common.headline(f"{name} speedup vs numpy ({ca.format_size(nbytes)})",
                             r["speedup"].median, "x",
                             detail=f"numpy {r['numpy'].median * 1e6:.2f} us, ours "
                                    f"{r['ours'].median * 1e6:.2f} us per call")
    _common.headline("native heap speedup vs glibc malloc (churn)", churn.median, "x",
                     detail=f"{args.min_size}-{args.max_size} bytes, {args.live} live blocks")
    if frag is not None:
        _common.headline("heap in use at the first fragmentation failure", 100 * frag[0], "%",
                         detail="random sizes, frees at random")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
