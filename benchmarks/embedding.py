"""Embedding lookup and update throughput: SimpleTable in fast and in slow memory and
CachedEmbeddingTable at several cache sizes, next to torch.nn.EmbeddingBag(mode="sum",
sparse=True) + torch.optim.SGD on the same indices, in one run.

    .venv/bin/python benchmarks/embedding.py                       # 1M x 64 rows, B 8192, 40 per bag
    .venv/bin/python benchmarks/embedding.py --rows 200000 --fs 16 --bag 1 --repeats 31

Every repetition draws a fresh batch and times each implementation in turn (interleaved);
figures are medians. Cached tables run the dissertation's protocol: a lookup caches the rows
it touches (dynamic), ``flush_clean`` after each lookup in the lookup test; in the update test
the lookup that caches the rows is untimed and ``maintain()`` (flush_dirty when full) follows.

Two OpenMP runtimes share this process (torch's bundled libgomp, and the system libgomp that
numba and oneDNN use). With the default active waiting, the idle runtime's threads spin on the
two cores while the other one works, slowing both (worst on a loaded machine), so the script
sets ``OMP_WAIT_POLICY=PASSIVE`` before either loads unless the caller set it: both sides then
run under the same, reproducible rule. The report prints OMP_WAIT_POLICY and the load average.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _common import interleaved, machine  # noqa: E402

import numpy as np  # noqa: E402

import cachedarrays as ca  # noqa: E402
from cachedarrays.models.dlrm import embedding as E  # noqa: E402
from cachedarrays.models.dlrm.data import SyntheticDataset  # noqa: E402


def _set_threads(n):
    import numba
    import torch
    numba.set_num_threads(n)
    torch.set_num_threads(n)


class Ours:
    """One of our tables with lookup/update steps shaped for the benchmark loop."""

    def __init__(self, label, table):
        self.label, self.table = label, table
        self.out = None
        self.flush_seconds = 0.0

    def lookup(self, idx, off):
        return self.table.lookup(idx, off, self.out)

    def after_lookup(self):
        if isinstance(self.table, E.CachedEmbeddingTable):
            t = time.perf_counter()
            self.table.flush_clean()
            self.flush_seconds += time.perf_counter() - t

    def before_update(self, idx, off):
        self.table.lookup(idx, off, self.out)

    def update(self, idx, off, dout, lr):
        self.table.update(idx, off, dout, lr)

    def after_update(self):
        t = time.perf_counter()
        self.table.maintain()
        self.flush_seconds += time.perf_counter() - t


class Torch:
    """torch.nn.EmbeddingBag(sum, sparse) + SGD; the update times backward and step only."""

    label = "torch EmbeddingBag"

    def __init__(self, init, lr):
        import torch
        self.torch = torch
        self.bag = torch.nn.EmbeddingBag(init.shape[0], init.shape[1], mode="sum", sparse=True)
        with torch.no_grad():
            self.bag.weight.copy_(torch.from_numpy(init))
        self.opt = torch.optim.SGD(self.bag.parameters(), lr=lr)
        self.pending = None

    def lookup(self, idx, off):
        with self.torch.no_grad():
            return self.bag(self.torch.from_numpy(idx), self.torch.from_numpy(off))

    def after_lookup(self):
        pass

    def before_update(self, idx, off):
        self.opt.zero_grad(set_to_none=True)
        self.pending = self.bag(self.torch.from_numpy(idx), self.torch.from_numpy(off))

    def update(self, idx, off, dout, lr):
        self.pending.backward(self.torch.from_numpy(dout))
        self.opt.step()

    def after_update(self):
        self.pending = None


def build(args, init, m):
    impls = [Torch(init, args.lr),
             Ours("SimpleTable fast", E.SimpleTable(*init.shape, manager=m, init=init,
                                                    placement="fast", name="fast")),
             Ours("SimpleTable slow", E.SimpleTable(*init.shape, manager=m, init=init,
                                                    placement="slow", name="slow"))]
    for frac in args.cache:
        t = E.CachedEmbeddingTable(*init.shape, manager=m, init=init, cachelower=frac,
                                   cacheslack=args.slack, name=f"cached{frac:.2f}")
        impls.append(Ours(f"Cached {frac:.0%} (+{args.slack:.0%})", t))
    for impl in impls:
        if isinstance(impl, Ours):
            impl.out = ca.empty((args.batch, init.shape[1]), dtype=np.float32, manager=m)
    return impls


def bench(impls, data, repeats, lookup):
    """Median seconds per call for each impl (fresh batch each repetition, interleaved)."""
    samples = [[] for _ in impls]
    rng = np.random.default_rng(1)
    fs = impls[1].table.featuresize
    for rep in range(repeats + 1):                       # repetition 0 warms up (JIT, faults)
        b = data.batch(rep)
        idx, off = b.indices[0], b.offsets[0]
        dout = rng.standard_normal((off.shape[0], fs), dtype=np.float32)
        for k, impl in enumerate(impls):
            gc.disable()
            if lookup:
                t = time.perf_counter()
                impl.lookup(idx, off)
                dt = time.perf_counter() - t
                impl.after_lookup()
            else:
                impl.before_update(idx, off)
                t = time.perf_counter()
                impl.update(idx, off, dout, 1e-3)
                dt = time.perf_counter() - t
                impl.after_update()
            gc.enable()
            if rep:
                samples[k].append(dt)
    return [statistics.median(s) for s in samples]


def check_agreement(impls, data):
    """Largest difference from torch relative to the largest magnitude: outputs, then tables."""
    b = data.batch(10_000)
    ref = impls[0].lookup(b.indices[0], b.offsets[0]).numpy()
    worst = 0.0
    for impl in impls[1:]:
        got = np.asarray(impl.table.lookup(b.indices[0], b.offsets[0], context=None))
        worst = max(worst, float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
    wt = impls[0].bag.weight.detach().numpy()
    tab = max(float(np.max(np.abs(impl.table.snapshot() - wt))) for impl in impls[1:])
    return worst, tab / float(np.max(np.abs(wt)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--fs", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--bag", type=int, default=40, help="lookups per bag (1: non-reducing)")
    ap.add_argument("--cache", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--slack", type=float, default=0.05)
    ap.add_argument("--distributions", nargs="+", default=["uniform", "zipf"],
                    choices=["uniform", "zipf"])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args(argv)

    _set_threads(args.threads)
    print(machine() + f", OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"threads: {args.threads} (numba and torch); table {args.rows:,} x {args.fs} float32 "
          f"({args.rows * args.fs * 4 / 2**20:.0f} MiB), batch {args.batch}, {args.bag} per bag; "
          f"medians of {args.repeats} interleaved repetitions with fresh indices")
    rng = np.random.default_rng(0)
    init = rng.uniform(-0.05, 0.05, (args.rows, args.fs)).astype(np.float32)
    table_bytes = init.nbytes
    fast = int(table_bytes * (2.5 + sum(args.cache) + args.slack * len(args.cache)))
    slow = int(table_bytes * (len(args.cache) + 2.5))
    for dist in args.distributions:
        data = SyntheticDataset(1, [args.rows], args.batch, pooling=args.bag, distribution=dist,
                                seed=7, num_batches=args.repeats + 1)
        with ca.Manager(fast=fast, slow=slow) as m:
            impls = build(args, init, m)
            t_look = bench(impls, data, args.repeats, lookup=True)
            hit = {impl.label: impl.table.stats()["hit_rate"] for impl in impls[1:]}
            t_upd = bench(impls, data, args.repeats, lookup=False)
            diff_out, diff_tab = check_agreement(impls, data)
            print(f"\n{dist} indices (max |ours - torch| / max |torch|: lookup {diff_out:.1e}, "
                  f"tables after {args.repeats + 1} updates {diff_tab:.1e})")
            print(f"{'implementation':<24} {'lookup ms':>10} {'torch/ours':>10} {'update ms':>10} "
                  f"{'torch/ours':>10} {'hit rate':>9} {'flush ms':>9}")
            for k, impl in enumerate(impls):
                hr = f"{hit[impl.label]:.3f}" if k else "-"
                fl = f"{impl.flush_seconds / (2 * (args.repeats + 1)) * 1e3:.2f}" if k else "-"
                print(f"{impl.label:<24} {t_look[k] * 1e3:10.2f} {t_look[0] / t_look[k]:9.2f}x "
                      f"{t_upd[k] * 1e3:10.2f} {t_upd[0] / t_upd[k]:9.2f}x {hr:>9} {fl:>9}")


if __name__ == "__main__":
    main()
