"""Dispatch overhead of CachedArray against plain NumPy for 20 common operations.

    python benchmarks/overhead.py [--sizes 10 1000 100000 10000000] [--repeats 7]

Prints, per operation and size, the NumPy time, the CachedArray time, the extra time per call
and the ratio (medians of interleaved repetitions, arrays in fast memory).
"""

import argparse
import statistics
import sys

import numpy as np

import cachedarrays as ca
from _common import calls_for, interleaved, machine


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
        ("a[1:n/2]", lambda: na[idx], lambda: x[idx]),
        ("a[1:n/2] = 0", lambda: na.__setitem__(idx, 0), lambda: x.__setitem__(idx, 0)),
        ("np.where(a > .5, a, b)", lambda: np.where(na > .5, na, nb),
         lambda: np.where(x > .5, x, y)),
        ("np.concatenate", lambda: np.concatenate([na, nb]), lambda: np.concatenate([x, y])),
        ("np.sort(a)", lambda: np.sort(na), lambda: np.sort(x)),
        ("np.dot(a, b)", lambda: np.dot(na, nb), lambda: np.dot(x, y)),
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10, 1000, 100_000, 10_000_000])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    print(machine())
    largest = max(args.sizes) * 8
    rows = []
    with ca.Manager(fast=max(64 << 20, 8 * largest), slow=max(64 << 20, 2 * largest)) as m:
        print(f"fast memory {ca.format_size(m.fast.size)}; times are medians of "
              f"{args.repeats} interleaved repetitions\n")
        print(f"{'operation':26}{'n':>10}{'numpy us':>12}{'cached us':>12}{'extra us':>11}"
              f"{'ratio':>8}")
        for n in args.sizes:
            rng = np.random.default_rng(0)
            na, nb = rng.random(n), rng.random(n)
            x, y = ca.asarray(na, manager=m), ca.asarray(nb, manager=m)
            for name, f_np, f_ca in operations(na, nb, x, y):
                number = calls_for(f_np)
                t_np, t_ca = interleaved([f_np, f_ca], args.repeats, number)
                rows.append((name, n, t_np, t_ca))
                print(f"{name:26}{n:>10}{t_np * 1e6:>12.2f}{t_ca * 1e6:>12.2f}"
                      f"{(t_ca - t_np) * 1e6:>11.2f}{t_ca / t_np:>8.2f}", flush=True)
            assert x.device == "fast"
    print("\nsummary (median over the 20 operations):")
    for n in args.sizes:
        sel = [r for r in rows if r[1] == n]
        extra = statistics.median((r[3] - r[2]) * 1e6 for r in sel)
        ratio = statistics.median(r[3] / r[2] for r in sel)
        print(f"  n={n:>9}: extra {extra:7.2f} us per call, ratio {ratio:5.2f}x NumPy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
