"""The end-to-end demo behind `make demo`: run with ``python -m cachedarrays.models.demo``.

Uses the embedded default slow device (a temporary file) and small sizes so it finishes fast.
"""

import argparse
import sys
import time

import numpy as np

import cachedarrays as ca
from cachedarrays.sizes import format_size as fs
from cachedarrays.telemetry import format_stats

from . import cnn
from .dlrm import demo as dlrm_demo


def matmul_example(n=1500):
    """Listing 4.4: a matrix product with everything in fast memory, then in slow memory."""
    nbytes = n * n * 4
    with ca.Manager(fast=4 * nbytes, slow=4 * nbytes) as m:
        rng = np.random.default_rng(0)
        A = ca.asarray(rng.standard_normal((n, n), dtype=np.float32), manager=m)
        B = ca.asarray(rng.standard_normal((n, n), dtype=np.float32), manager=m)
        C = np.empty_like(A)
        ca.prefetch(A, B, C, force=True)
        np.matmul(A, B, out=C)                      # warm up BLAS
        t = time.perf_counter()
        np.matmul(A, B, out=C)
        t_fast = time.perf_counter() - t
        ca.evict(A, B, C)
        t = time.perf_counter()
        np.matmul(A, B, out=C)
        t_slow = time.perf_counter() - t
        print(f"matmul {n}x{n} float32: all in fast memory {t_fast * 1e3:.1f} ms, "
              f"all in slow memory {t_slow * 1e3:.1f} ms (devices: {A.device}, {C.device})")
        print(format_stats(m.stats()))


def lru_example():
    """Oversubscribe fast memory 4x with a working set of arrays updated in random order."""
    fast = 8 << 20
    with ca.Manager(fast=fast, slow=64 << 20) as m:
        rng = np.random.default_rng(1)
        n = 1 << 17                                  # 1 MiB of float64 per array
        reference = [rng.random(n) for _ in range(32)]   # 32 MiB = 4x fast memory
        arrays = [ca.asarray(r, manager=m) for r in reference]
        m.reset_stats()
        for step in range(300):
            i, j = rng.integers(0, len(arrays), 2)
            if step % 3 == 0:
                ca.prefetch(arrays[i], force=True)
            arrays[i] += arrays[j]
            reference[i] += reference[j]
        for x, r in zip(arrays, reference):
            np.testing.assert_allclose(np.asarray(x), r)
        in_fast = sum(x.device == "fast" for x in arrays)
        print(f"\nLRU with 32 arrays of 1 MiB over {ca.format_size(fast)} of fast memory "
              f"(4x oversubscribed), 300 updates: values match NumPy, {in_fast} arrays now fast")
        print(format_stats(m.stats()))
        m.check()


def cnn_example():
    """ResNet-18 (small images, narrow) trained under a 25% DRAM budget: LM against memory mode.

    Each iteration is recorded with ca.trace; its modelled time is the cost model of that trace
    with kernel times from one fast-only reference run (shared by every setup)."""
    t = time.perf_counter()
    shape = dict(batch=8, image=32, width=4)
    ref = cnn.fast_only_reference("resnet", 18, **shape)
    rows = []
    for setup in ("2lm", "LM", "fast-only"):
        rec = cnn.run("resnet", 18, setup=setup, iterations=2, reference=ref,
                      **cnn.dram_budget(setup, "25%"), **shape)[-1]
        f = rec["figures"]
        rows.append((setup, rec["loss"], f["slow_r"], f["slow_w"], f["stall"], rec["modelled"],
                     rec["modelled"] / rec["run"].fast_only, rec["budget"], rec["footprint"]))
    print(f"\nResNet-18 (batch 8, 32x32, width/4), 2 iterations, DRAM budget "
          f"{fs(rows[0][7])} = 25% of the {fs(rows[0][8])} footprint "
          f"({time.perf_counter() - t:.1f} s):")
    print(f"  {'setup':10}{'loss':>9}{'slow read':>12}{'slow write':>12}{'stall':>10}"
          f"{'modelled':>11}{'/fast-only':>11}")
    for setup, loss, rd, wr, stall, modelled, ratio, _, _ in rows:
        print(f"  {setup:10}{loss:>9.4f}{fs(rd):>12}{fs(wr):>12}{stall * 1e3:>8.2f}ms"
              f"{modelled * 1e3:>9.2f}ms{ratio:>11.3f}")
    print("  (2lm: a simulated hardware DRAM cache of the same size; LM: this library's policy "
          "with annotations; modelled time: the cost model on the Optane profile, with kernel "
          "times from a fast-only run)")


def dlrm_example():
    """A short DLRM run whose embedding tables are CachedEmbeddings (25% of rows cacheable)."""
    t = time.perf_counter()
    r = dlrm_demo()
    losses = ", ".join(f"{x:.4f}" for x in r["losses"])
    phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["phases"].items())
    print(f"\nDLRM ({r['config']} config, {r['table_kind']} CachedEmbeddings) in "
          f"{time.perf_counter() - t:.1f} s: losses {losses}")
    print(f"embedding hit rate {r['hit_rate']:.1%}; median phase times: {phases}")
    print(format_stats(r["manager"]))


def parse_args(argv=None):
    """The demo takes no options but --help; anything else is refused before it starts."""
    first, _, rest = __doc__.strip().partition("\n")
    p = argparse.ArgumentParser(
        prog="python -m cachedarrays.models.demo", description=first,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=rest.strip() + "\n\nexit status: 0 when it finished, 1 when it failed, 2 for "
        "bad arguments,\n130 when interrupted (Ctrl-C).")
    return p.parse_args(argv)


def main(argv=None):
    parse_args(argv)
    t = time.perf_counter()
    try:
        matmul_example()
        lru_example()
        cnn_example()
        dlrm_example()
    except KeyboardInterrupt:
        print("\ndemo: interrupted", file=sys.stderr, flush=True)
        return 130
    print(f"\ndemo finished in {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
