"""Per-call overhead of CachedArray against plain NumPy for 20 common operations.

    python benchmarks/overhead.py [--sizes 10 1000 100000] [--repeats 7]

Per operation and size: NumPy's time and ours (medians of interleaved repetitions with their
spread, arrays in fast memory), the extra time per call (median of the paired differences) and
the speedup (NumPy time / our time: 1.0 means no overhead at all). Goals: small ufuncs cost at
most 3 us more than NumPy at n=10 and n=1000, the median operation at n=100000 runs at >= 0.952x
NumPy's speed (our time <= 1.05x), a basic slice costs at most 1 us more, and every NumPy function
enters CachedArray.__array_function__ once per call (no nested dispatch).
"""

import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import _common  # noqa: E402,I001  (first: sets the OpenMP wait policy before NumPy loads)

import numpy as np

import cachedarrays as ca

UFUNCS = ("a + b", "a * b", "a - 1.5", "a / b", "np.exp(a)", "np.sqrt(a)", "a > b",
          "np.maximum(a, b)")
SLICE = "a[1:n/2]"
SPEEDUP_TARGET = round(1 / 1.05, 3)      # our time <= 1.05x NumPy's


def operations(np_a, np_b, x, y):
    """(name, numpy callable, cachedarray callable) for 20 common operations."""
    na, nb = np_a, np_b
    idx = slice(1, max(2, na.size // 2))
    return [
        ("a + b", lambda: na + nb, lambda: x + y),
        ("a * b", lambda: na * nb, lambda: x * y),
        ("a - 1.5", lambda: na - 1.5, lambda: x - 1.5),
        ("a / b", lambda: na / nb, lambda: x / y),
        ("np.exp(a)", lambda: np.exp(na), lambda: np.exp(x)),
        ("np.sqrt(a)", lambda: np.sqrt(na), lambda: np.sqrt(x)),
        ("a > b", lambda: na > nb, lambda: x > y),
        ("a += 1", lambda: np.add(na, 1, out=na), lambda: np.add(x, 1, out=x)),
        ("np.maximum(a, b)", lambda: np.maximum(na, nb), lambda: np.maximum(x, y)),
        ("a.sum()", lambda: na.sum(), lambda: x.sum()),
        ("a.mean()", lambda: na.mean(), lambda: x.mean()),
        ("a.max()", lambda: na.max(), lambda: x.max()),
        ("a.argmax()", lambda: na.argmax(), lambda: x.argmax()),
        ("np.cumsum(a)", lambda: np.cumsum(na), lambda: np.cumsum(x)),
        (SLICE, lambda: na[idx], lambda: x[idx]),
        ("a[1:n/2] = 0", lambda: na.__setitem__(idx, 0), lambda: x.__setitem__(idx, 0)),
        ("np.where(a > .5, a, b)", lambda: np.where(na > .5, na, nb),
         lambda: np.where(x > .5, x, y)),
        ("np.concatenate", lambda: np.concatenate([na, nb]), lambda: np.concatenate([x, y])),
        ("np.sort(a)", lambda: np.sort(na), lambda: np.sort(x)),
        ("np.dot(a, b)", lambda: np.dot(na, nb), lambda: np.dot(x, y)),
    ]


def dispatch_checks(x, y):
    """(name, call) of NumPy functions whose __array_function__ entries per call are counted."""
    return [
        ("np.concatenate", lambda: np.concatenate([x, y])),
        ("np.where", lambda: np.where(x > .5, x, y)),
        ("np.stack", lambda: np.stack([x, y])),
        ("np.vstack", lambda: np.vstack([x, y])),
        ("np.hstack", lambda: np.hstack([x, y])),
        ("np.sort", lambda: np.sort(x)),
        ("np.cumsum", lambda: np.cumsum(x)),
        ("np.dot", lambda: np.dot(x, y)),
        ("np.mean", lambda: np.mean(x)),
        ("np.clip", lambda: np.clip(x, .2, .8)),
        ("np.zeros_like", lambda: np.zeros_like(x)),
        ("np.full_like", lambda: np.full_like(x, 2.0)),
        ("np.append", lambda: np.append(x, y)),
        ("np.split", lambda: np.split(x, 2)),
        ("np.median", lambda: np.median(x)),
        ("np.unique", lambda: np.unique(x)),
    ]


def dispatch_entries(checks):
    """Per check, how many times one call entered CachedArray.__array_function__ (counted by
    wrapping it, so any version of the library can be measured)."""
    original = ca.CachedArray.__array_function__
    count = [0]

    def counting(self, func, types, args, kwargs):
        count[0] += 1
        return original(self, func, types, args, kwargs)
    out = []
    ca.CachedArray.__array_function__ = counting
    try:
        for name, call in checks:
            call()                               # warm: caches filled on the first call
            before = count[0]
            call()
            out.append((name, count[0] - before))
    finally:
        ca.CachedArray.__array_function__ = original
    return out


def where_on_a_random_mask(m, n, args, clock):
    """np.where on a mask NumPy's loop cannot predict (the 20 operations' np.where sees a
    mostly predictable one): NumPy's time and ours, interleaved."""
    rng = np.random.default_rng(1)
    na, nb = rng.random(n), rng.random(n)
    mask = rng.random(n) > 0.5
    x, y, c = (ca.asarray(v, manager=m) for v in (na, nb, mask))

    def f_np():
        return np.where(mask, na, nb)

    def f_ca():
        return np.where(c, x, y)
    number = _common.calls_for(f_np, args.budget)
    t_np, t_ca = samples_of([f_np, f_ca], args.repeats, number, clock)
    return dict(n=n, numpy=_common.Stat(t_np), ours=_common.Stat(t_ca),
                speedup=_common.speedups(t_np, t_ca))


def placed_results(m, n, args, clock):
    """NumPy functions and methods whose result the library writes in place (placed by the
    policy, filled by NumPy through out= or assignments, never built in ordinary memory and
    copied in), on n float64 elements: rows of (name, numpy Stat, ours Stat, speedup Stat)."""
    rng = np.random.default_rng(3)
    na, nb = rng.random(n), rng.random(n)
    rows2d = rng.random((max(1, n // 64), 64))
    idx = rng.integers(0, rows2d.shape[0], max(1, rows2d.shape[0] // 10))
    x, y, r2 = (ca.asarray(v, manager=m) for v in (na, nb, rows2d))
    calls = [("x.copy()", lambda: na.copy(), lambda: x.copy()),
             ("x.astype(float32)", lambda: na.astype(np.float32),
              lambda: x.astype(np.float32)),
             ("np.clip(x, .2, .8)", lambda: np.clip(na, .2, .8), lambda: np.clip(x, .2, .8)),
             ("np.round(x, 2)", lambda: np.round(na, 2), lambda: np.round(x, 2)),
             ("np.diff(x)", lambda: np.diff(na), lambda: np.diff(x)),
             ("np.roll(x, 3)", lambda: np.roll(na, 3), lambda: np.roll(x, 3)),
             ("np.tile(x, 2)", lambda: np.tile(na, 2), lambda: np.tile(x, 2)),
             ("np.stack((x, y))", lambda: np.stack((na, nb)), lambda: np.stack((x, y))),
             ("rows[idx] (10% of rows)", lambda: rows2d[idx], lambda: r2[idx])]
    out = []
    for name, f_np, f_ca in calls:
        number = _common.calls_for(f_np, args.budget)
        t_np, t_ca = samples_of([f_np, f_ca], args.repeats, number, clock)
        out.append((name, _common.Stat(t_np), _common.Stat(t_ca),
                    _common.speedups(t_np, t_ca)))
    return out


def kernel_calls(m, args, clock):
    """The cost of running a kernel through the library: fn(a, b, out) on ndarrays, against
    ``ca.compute`` and ``ca.kernel`` on CachedArrays of 10 elements (two reads, one write).
    Returns {name: (numpy Stat, ours Stat, median extra seconds)}."""
    rng = np.random.default_rng(2)
    na, nb, nc = rng.random(10), rng.random(10), np.empty(10)
    x, y, z = (ca.asarray(v, manager=m) for v in (na, nb, nc))

    def fn(a, b, c):
        np.add(a, b, out=c)

    def f_np():
        fn(na, nb, nc)

    def f_compute():
        ca.compute("add", fn, (x, y), (z,))

    def f_kernel():
        with ca.kernel("add", (x, y), (z,)) as (a, b, c):
            fn(a, b, c)
    number = _common.calls_for(f_np, args.budget)
    t_np, t_compute, t_kernel = samples_of([f_np, f_compute, f_kernel], args.repeats, number,
                                           clock)
    return {name: (_common.Stat(t_np), _common.Stat(t), statistics.median(
        c - q for q, c in zip(t_np, t))) for name, t in (("ca.compute", t_compute),
                                                          ("ca.kernel", t_kernel))}


def clock_of(name):
    """The timer: wall (perf_counter) or cpu (thread_time: robust on a busy machine)."""
    return time.perf_counter if name == "wall" else time.thread_time


def samples_of(fns, repeats, number, clock):
    """Per fn, seconds-per-call samples, timing the fns in turn in every repetition (in
    ``_common.turn_order``)."""
    samples = [[] for _ in fns]
    for rep in range(repeats):
        for i in _common.turn_order(len(fns), rep):
            fn = fns[i]
            t = clock()
            for _ in range(number):
                fn()
            samples[i].append((clock() - t) / number)
    return samples


def plot(rows, sizes, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["name"] for r in rows if r["n"] == sizes[0]]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(names) + 1.5))
    height = 0.8 / len(sizes)
    for j, n in enumerate(sizes):
        sp = [r["speedup"].median for r in rows if r["n"] == n]
        ax.barh([i + j * height for i in range(len(names))], sp, height, label=f"n={n}")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))])
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("speedup (numpy time / cachedarrays time); 1.0 = no overhead")
    ax.legend()
    _common.save_plot(fig, path)


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--sizes", type=_common.whole(), nargs="+",
                   action=_common.Unique, default=[10, 1000, 100_000],
                   help="array lengths to measure")
    p.add_argument("--repeats", type=_common.whole(), default=7,
                   help="interleaved repetitions per operation (medians of these)")
    p.add_argument("--budget", type=_common.positive, default=0.02,
                   help="seconds per timed sample (the call count is chosen to fill it)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time; cpu: time this thread ran (steadier on a busy "
                        "machine)")
    _common.add_standard(p)
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error("--repeats must be at least 3 (medians of >= 3 samples)")
    # fast memory of 8 arrays of the largest size, and a few NumPy arrays and results
    _common.check_memory(p, 16 * 8 * max(args.sizes), "--sizes")
    _common.apply_threads(args.threads)
    print(_common.machine())
    print(_common.thread_line())
    clock = clock_of(args.clock)
    largest = max(args.sizes) * 8
    rows = []
    with ca.Manager(fast=max(64 << 20, 8 * largest), slow=max(64 << 20, 2 * largest)) as m:
        print(f"fast memory {ca.format_size(m.fast.size)}; {args.clock} clock; medians of "
              f"{args.repeats} interleaved repetitions [min-max]\n")
        print(f"{'operation':24}{'n':>8}  {'numpy':28}{'cachedarrays':30}{'extra':>10}"
              f"{'speedup':>9}")
        work = [(n, i) for n in args.sizes for i in range(20)]
        bar = _common.progress(total=len(work), desc="operations", disable=args.no_progress)
        for n in args.sizes:
            rng = np.random.default_rng(0)
            na, nb = rng.random(n), rng.random(n)
            x, y = ca.asarray(na, manager=m), ca.asarray(nb, manager=m)
            for name, f_np, f_ca in operations(na, nb, x, y):
                number = _common.calls_for(f_np, args.budget)
                t_np, t_ca = samples_of([f_np, f_ca], args.repeats, number, clock)
                row = dict(name=name, n=n, numpy=_common.Stat(t_np), ours=_common.Stat(t_ca),
                           extra=statistics.median(c - q for q, c in zip(t_np, t_ca)),
                           speedup=_common.speedups(t_np, t_ca))
                rows.append(row)
                bar.update(1)
                print(f"{name:24}{n:>8}  {row['numpy'].fmt(1e6, 'us'):28}"
                      f"{row['ours'].fmt(1e6, 'us'):30}{row['extra'] * 1e6:>7.2f} us"
                      f"{row['speedup'].median:>8.2f}x", flush=True)
            assert x.device == "fast" and y.device == "fast"
        bar.close()
        checks = dispatch_entries(dispatch_checks(x, y))
        where_row = where_on_a_random_mask(m, max(args.sizes), args, clock)
        placed = placed_results(m, max(args.sizes), args, clock)
        kernel_rows = kernel_calls(m, args, clock)

    print("\nsummary (median over the 20 operations):")
    for n in args.sizes:
        sel = [r for r in rows if r["n"] == n]
        extra = statistics.median(r["extra"] * 1e6 for r in sel)
        sp = statistics.median(r["speedup"].median for r in sel)
        print(f"  n={n:>9}: extra {extra:7.2f} us per call, speedup {sp:5.2f}x (numpy time / "
              "ours)")
        _common.headline(f"median extra per call (n={n})", extra, " us")
    print(f"\nnp.where(mask, a, b) on a random mask, n={where_row['n']}: numpy "
          f"{where_row['numpy'].fmt(1e6, 'us')}, ours {where_row['ours'].fmt(1e6, 'us')}")
    _common.headline(f"np.where speedup vs numpy, random mask (n={where_row['n']})",
                     where_row["speedup"].median, "x",
                     detail="a branch-free select against NumPy's loop")
    print(f"\nresults written in place (n={max(args.sizes)} float64; rows: "
          f"{max(1, max(args.sizes) // 64)} x 64):")
    for name, t_np, t_ours, sp in placed:
        print(f"  {name:24} numpy {t_np.fmt(1e6, 'us'):28} ours {t_ours.fmt(1e6, 'us'):28} "
              f"speedup {sp.median:.2f}x")
    _common.headline(f"results written in place, speedup vs numpy (n={max(args.sizes)}, "
                     f"median of {len(placed)} calls)",
                     statistics.median(sp.median for *_, sp in placed), "x",
                     detail="copy, astype, clip, round, diff, roll, tile, stack, row gather")
    print("\na kernel through the library (fn(a, b, out) = np.add, n=10, two reads and one "
          "write):")
    for name, (t_np, t_ours, extra) in kernel_rows.items():
        print(f"  {name:11} {t_ours.fmt(1e6, 'us'):28} fn alone {t_np.fmt(1e6, 'us'):28} "
              f"extra {extra * 1e6:.2f} us")
        _common.headline(f"{name} extra per call (n=10, 2 reads, 1 write)", extra * 1e6, " us")
    print("\n__array_function__ entries per call: " +
          ", ".join(f"{name} {k}" for name, k in checks))
    print()
    for n in (10, 1000):
        sel = [r["extra"] * 1e6 for r in rows if r["n"] == n and r["name"] in UFUNCS]
        if sel:
            _common.goal(f"small ufunc extra (n={n})", statistics.median(sel), 3.0,
                         higher=False, unit=" us",
                         detail=f"median over {len(sel)} ufunc calls")
    sel = [r["speedup"].median for r in rows if r["n"] == 100_000]
    if sel:
        _common.goal("speedup vs numpy (n=100000, median operation)", statistics.median(sel),
                     SPEEDUP_TARGET, detail="numpy time / ours: our time <= 1.05x numpy's")
    sel = [r["extra"] * 1e6 for r in rows if r["name"] == SLICE]
    if sel:
        _common.goal(f"slice extra ({SLICE})", statistics.median(sel), 1.0, higher=False,
                     unit=" us", detail=f"median over sizes {', '.join(map(str, args.sizes))}")
    worst = max(checks, key=lambda c: c[1])
    _common.goal("__array_function__ entries per NumPy call (most of "
                 f"{len(checks)} functions)", worst[1], 1, higher=False, unit="",
                 detail=f"{worst[0]}; more than 1 is nested dispatch")
    if args.plot:
        plot(rows, args.sizes, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
