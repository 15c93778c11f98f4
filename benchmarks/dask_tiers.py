"""dask.distributed over data larger than memory: NumPy chunks spilled to disk vs CachedArray tiers.

    python benchmarks/dask_tiers.py [--workers 2] [--limit 32MiB] [--ratio 4] [--cols 256]
                                    [--chunk 4MiB] [--repeats 5] [--policy lru] [--plot PNG]

Three LocalClusters of the same shape run side by side on loopback. On each, a tall matrix x
of --ratio times the workers' memory (per worker) is generated and persisted, then the same
computation runs on it --repeats times, the clusters in turn: the Gram matrix x.T @ x (a
chunked matmul) and the column means (a reduction).

- peer: NumPy chunks under distributed's memory limit of --limit per worker. Chunks beyond the
  limit are pickled to the worker's spill folder and read back when a task needs them
  (distributed's SpillBuffer, its target fraction set to 1.0 so that both sides keep --limit of
  chunks in memory; the process-memory thresholds are off, as they count the interpreter's own
  memory, which a small limit cannot hold).
- ours, in place: CachedArray chunks in each worker's Manager (cachedarrays.dask.ManagerPlugin)
  with fast = --limit and the slow device a temporary file; distributed sets no limit and the
  manager's policy moves whole chunks between the tiers; kernels read the slow tier in place.
- ours, kernels in fast: the same with every kernel's operands brought to fast memory first
  (kernels_in_fast=True), as a slow device much slower than DRAM demands. Left out for a
  policy that cannot do that (one that never evicts).

Printed per side: seconds per computation (median of interleaved repetitions with spread),
bytes written to and read from the spill folder (peer) or moved fast->slow and slow->fast
(ours) per computation, and bytes sent between workers. speedup = peer time / our time
(> 1: ours is faster). The slow tiers are files the OS may keep in its page cache on both
sides, so the times compare the software paths, not a real slow device.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import _common  # noqa: E402  (first: thread settings before NumPy loads its pools)
from _common import Stat, machine, speedups  # noqa: E402

import numpy as np  # noqa: E402

import cachedarrays as ca  # noqa: E402


# ---- run on the workers (sent by value: the workers cannot import this script) ----------

def _worker_counters(dask_worker):
    """Cumulative counters of one worker: its spill folder, its manager, its transfers."""
    import gc
    gc.collect()                        # frames of sent chunks let go: their pins released
    out = {"sent": int(dask_worker.transfer_outgoing_bytes_total)}
    metrics = getattr(dask_worker.data, "cumulative_metrics", None)
    if metrics is not None:
        out["spill_write"] = int(metrics.get(("disk-write", "bytes"), 0))
        out["spill_read"] = int(metrics.get(("disk-read", "bytes"), 0))
    plugin = dask_worker.plugins.get("cachedarrays-manager")
    m = getattr(plugin, "manager", None)
    if m is not None and not m.closed:
        s = m.stats()
        out["to_slow"] = int(s["moved"].get("fast->slow", {}).get("bytes", 0))
        out["to_fast"] = int(s["moved"].get("slow->fast", {}).get("bytes", 0))
        out["dask_sent"] = int(s["events"]["dask_sent"]["bytes"])
        out["fast_size"] = int(m.fast.size)
        out["pinned"] = sum(1 for o in m.objects() if m.pinned(o))
    return out


#: The line a worker logs when its heartbeat finds the scheduler gone, as it is when the
#: clusters close (at the end, or on Ctrl-C / SIGTERM while a worker's heartbeat is under way).
HEARTBEAT_LOST = "Failed to communicate with scheduler during heartbeat"


def quiet_heartbeat_loss(record):
    """A logging filter: the lost-heartbeat line keeps its message but not its traceback (the
    scheduler closing first is how a cluster ends, not a failure); every record passes."""
    if record.getMessage().startswith(HEARTBEAT_LOST):
        record.exc_info = None
        record.exc_text = None
    return True


def _warm_up():
    """Import what the tasks use, so that no timed phase pays for it; filter the worker's
    lost-heartbeat traceback (``quiet_heartbeat_loss``)."""
    import logging

    import dask.array  # noqa: F401

    import cachedarrays.dask  # noqa: F401
    log = logging.getLogger("distributed.worker")
    if quiet_heartbeat_loss not in log.filters:
        log.addFilter(quiet_heartbeat_loss)


def _worker_threads():
    from cachedarrays import threads
    return threads.describe()


def _totals(client):
    """Counters summed over the cluster's workers."""
    total = {}
    for r in client.run(_worker_counters).values():
        for k, v in r.items():
            total[k] = total.get(k, 0) + v
    return total


def _delta(after, before):
    return {k: after[k] - before.get(k, 0) for k in after}


# ---- the clusters -----------------------------------------------------------------------

#: (kind, column title): the peer first, then ours with kernels reading the slow tier in
#: place, then ours with every kernel's operands brought to fast memory first.
SIDES = (("numpy", "numpy chunks, spilling"),
         ("cached", "CachedArray, in place"),
         ("in-fast", "CachedArray, kernels in fast"))


#: distributed's memory settings on both sides (the peer's SpillBuffer keeps --limit of chunks
#: in memory; the process-memory thresholds, which count the interpreter itself, are off).
MEMORY = {"distributed.worker.memory.target": 1.0, "distributed.worker.memory.spill": False,
          "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": False}


def fits(policy, in_fast):
    """True if the policy runs a few kernels over arrays of 3x its fast memory, with every
    kernel's operands brought to fast memory first (``in_fast``) or not: tried here."""
    options = {"kernels_in_fast": True} if in_fast else {}
    with ca.Manager(fast="1MiB", slow="16MiB", policy=policy, policy_options=options) as m:
        try:
            xs = [ca.zeros(1 << 16, manager=m) for _ in range(6)]     # 512 KiB each
            for x in xs + xs:
                float(x.sum())
        except ca.errors.OutOfMemoryError:
            return False
    return True


def start(sides, args, folder, stack):
    """The clients of the sides' clusters, started together (each start spawns processes that
    spend seconds importing), closed by stack."""
    import dask
    from concurrent.futures import ThreadPoolExecutor
    with dask.config.set(MEMORY), ThreadPoolExecutor(len(sides)) as pool:
        entered = [pool.submit(_enter, cluster(kind, args, folder)) for kind, _ in sides]
        clients = []
        for f in entered:                  # every started cluster is closed, even on failure
            try:
                cm, client = f.result()
            except BaseException as e:     # noqa: PERF203
                error = e
                continue
            stack.push(cm.__exit__)
            clients.append(client)
        if len(clients) < len(sides):
            raise error
    return clients


def _enter(cm):
    return cm, cm.__enter__()


@contextlib.contextmanager
def cluster(kind, args, folder):
    """A LocalCluster with a Client: kind "numpy" (distributed spills beyond its memory limit)
    or "cached"/"in-fast" (each worker's manager holds --limit of fast memory)."""
    from distributed import Client, LocalCluster
    limit = args.limit if kind == "numpy" else 0
    with LocalCluster(n_workers=args.workers, threads_per_worker=args.threads_per_worker,
                      processes=True, host="127.0.0.1", dashboard_address=None,
                      scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                      memory_limit=limit, local_directory=folder) as lc, \
            Client(lc, set_as_default=False) as client:
        if kind != "numpy":
            from cachedarrays.dask import ManagerPlugin
            slow = max(2 * args.ratio * args.limit, 64 << 20)
            options = {"kernels_in_fast": True} if kind == "in-fast" else {}
            client.register_plugin(ManagerPlugin(fast=args.limit, slow=slow,
                                                 slow_path=args.slow_path, policy=args.policy,
                                                 policy_options=options))
        client.run(_warm_up)
        yield client


def data(kind, args, rows=None):
    """The matrix x to persist (a dask array): NumPy chunks or CachedArray chunks."""
    import dask.array as da
    rows = rows or args.ratio * args.limit * args.workers // (8 * args.cols)
    chunk_rows = max(1, args.chunk // (8 * args.cols))
    x = da.random.RandomState(7).random_sample((rows, args.cols), chunks=(chunk_rows, args.cols))
    if kind != "numpy":
        x = x.map_blocks(ca.asarray, meta=ca.empty((0, 0)))
    return x


def computation(x):
    """The Gram matrix (a chunked matmul) and the column means (a reduction)."""
    return [x.T @ x, x.mean(axis=0)]


class Side:
    """One cluster with its persisted data set, its times and its traffic per computation."""

    def __init__(self, kind, title, client, args):
        from distributed import wait
        self.kind, self.title, self.client = kind, title, client
        client.compute(computation(data(kind, args, rows=args.cols)), sync=True)   # warm-up
        t = time.perf_counter()
        self.x = client.persist(data(kind, args))        # on this cluster, not the default
        with client.as_current():
            wait(self.x)
        self.load = time.perf_counter() - t
        self.exprs = computation(self.x)
        self.times, self.traffic, self.results = [], [], None

    def run(self):
        before = _totals(self.client)
        t = time.perf_counter()
        self.results = self.client.compute(self.exprs, sync=True)
        self.times.append(time.perf_counter() - t)
        self.traffic.append(_delta(_totals(self.client), before))

    def median(self, key):
        """Median over the computations of one traffic counter (bytes)."""
        return int(Stat([t.get(key, 0) for t in self.traffic]).median)

    def to_slow(self):
        return self.median("spill_write" if self.kind == "numpy" else "to_slow")

    def to_fast(self):
        return self.median("spill_read" if self.kind == "numpy" else "to_fast")


def _dense(r):
    if isinstance(r, ca.CachedArray):
        with ca.readable(r) as v:
            return np.array(v)
    return np.asarray(r)


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--workers", type=_common.whole(), default=2,
                   help="worker processes per cluster")
    p.add_argument("--threads-per-worker", type=_common.whole(), default=1,
                   help="task threads per worker (BLAS and OpenMP run 1 thread per worker, "
                        "distributed's default)")
    p.add_argument("--limit", default="32MiB",
                   help="per worker: distributed's memory limit (peer) = fast memory (ours)")
    p.add_argument("--ratio", type=_common.whole(), default=4,
                   help="the data set is RATIO x the limit per worker")
    p.add_argument("--cols", type=_common.whole(), default=256,
                   help="columns of the float64 matrix x")
    p.add_argument("--chunk", default="4MiB", help="bytes per chunk (whole rows)")
    p.add_argument("--repeats", type=_common.whole(), default=5,
                   help="interleaved repetitions (>= 3)")
    p.add_argument("--policy", default="lru", choices=ca.policy_names(), metavar="NAME",
                   help="the workers' placement policy (ours)")
    p.add_argument("--slow-path", default=None, type=_common.slow_path,
                   help="folder for the workers' slow devices, a file each (default: the "
                        "temporary folder)")
    _common.add_standard(p, with_threads=False)
    args = p.parse_args(argv)
    try:
        args.limit = ca.parse_size(args.limit, "--limit")
        args.chunk = ca.parse_size(args.chunk, "--chunk")
    except ValueError as e:
        p.error(str(e))
    if args.repeats < 3:
        p.error("--repeats must be >= 3 (medians are of at least 3 samples)")
    if args.slow_path is not None:
        args.slow_path = os.path.expanduser(args.slow_path)    # the workers see no shell
        if not os.path.isdir(args.slow_path):
            p.error(f"--slow-path {args.slow_path!r} is not a folder: each worker makes its own "
                    "file in a folder; a file or device would be shared by every worker")
    # each worker: a Python process (about 200 MiB with dask) and its --limit of memory
    _common.check_memory(p, args.workers * (args.limit + (200 << 20)), "--workers and --limit")
    if min(args.workers, args.threads_per_worker, args.ratio, args.cols) < 1:
        p.error("--workers, --threads-per-worker, --ratio and --cols must be >= 1")
    if args.chunk < 8 * args.cols or args.chunk * 2 > args.limit:
        p.error(f"--chunk ({ca.format_size(args.chunk)}) must hold one row ({8 * args.cols} B) "
                f"and be at most half of --limit ({ca.format_size(args.limit)}): a task needs "
                "its chunk and its result in memory")
    try:
        import cloudpickle
        import distributed  # noqa: F401
    except ImportError:
        p.error("needs the optional extra [dask]: pip install 'cachedarrays[dask]'")
    if sys.modules.get(__name__) is not None and __name__ != "__main__":
        cloudpickle.register_pickle_by_value(sys.modules[__name__])   # workers cannot import it

    fs = ca.format_size
    if not fits(args.policy, False):
        p.error(f"the {args.policy} policy cannot hold data larger than fast memory; choose "
                "a policy that spills to slow memory (e.g. lru)")
    sides = SIDES
    if not fits(args.policy, True):
        sides = SIDES[:2]
        print(f"note: the {args.policy} policy cannot bring a kernel's operands to a full fast "
              "memory (it does not evict), so the kernels-in-fast cluster is left out")
    print(machine())
    print(f"{len(sides)} clusters of {args.workers} worker processes x "
          f"{args.threads_per_worker} thread(s) on 127.0.0.1; x is "
          f"{fs(args.ratio * args.limit * args.workers)} of float64 in {fs(args.chunk)} "
          f"chunks, {args.ratio}x the {fs(args.limit)} limit per worker; policy {args.policy}")
    print("computation: x.T @ x and x.mean(axis=0) on the persisted x")
    with tempfile.TemporaryDirectory(prefix="dask_tiers_") as folder, \
            contextlib.ExitStack() as stack:
        clients = start(sides, args, folder, stack)
        for (_, title), c in zip(sides, clients):
            print(f"threads ({title}): " + next(iter(c.run(_worker_threads).values())))
        sides = [Side(kind, title, c, args) for (kind, title), c in zip(sides, clients)]
        for _ in _common.progress(range(args.repeats), desc="repetitions",
                                  disable=args.no_progress):
            for s in sides:
                s.run()
        peer, ours = sides[0], sides[1:]
        for s in ours:
            assert all(isinstance(r, ca.CachedArray) for r in s.results), s.title
            for a, b in zip(peer.results, s.results):
                np.testing.assert_allclose(_dense(b), _dense(a), rtol=1e-9)
        final = [_totals(s.client) for s in ours]
    report(args, sides, final)
    return 0


def report(args, sides, final):
    fs = ca.format_size
    times = [Stat(s.times) for s in sides]
    rows = [("seconds per computation", [t.fmt(1, "s", 3) for t in times]),
            ("seconds to generate and persist x once", [f"{s.load:.3f} s" for s in sides]),
            ("bytes to the slow tier", [fs(s.to_slow()) for s in sides]),
            ("bytes back to memory", [fs(s.to_fast()) for s in sides]),
            ("bytes sent between workers", [fs(s.median("sent")) for s in sides])]
    print(f"\n{'per computation (median)':34}" + "".join(f"{s.title:>32}" for s in sides))
    for name, cells in rows:
        print(f"{name:34}" + "".join(f"{c:>32}" for c in cells))
    print("(the peer's slow tier is distributed's spill folder: pickled chunks written and read "
          "back; ours is each worker's slow device: chunks moved by the copy engine)")
    peer = sides[0]
    for s in sides[1:]:
        sp = speedups(peer.times, s.times)
        print(f"\nspeedup, {s.title} (numpy time / ours): {sp.fmt(1, 'x', 2)}")
        _common.headline(f"dask speedup vs spilling, {s.title}", sp.median,
                         detail=f"{args.workers} workers, data {args.ratio}x the limit")
        moved = s.to_slow() + s.to_fast()
        print(f"bytes between tiers per computation: numpy {fs(peer.to_slow() + peer.to_fast())}"
              f", ours {fs(moved)}")
    print(f"\npins held by our workers after the runs: {[f['pinned'] for f in final]}")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.4))
        names = [s.title.replace(", ", ",\n") for s in sides]
        a1.bar(names, [t.median for t in times],
               yerr=[[t.median - t.lo for t in times], [t.hi - t.median for t in times]])
        a1.set_ylabel("seconds per computation")
        mib = 1 << 20
        out = [s.to_slow() / mib for s in sides]
        a2.bar(names, out, label="to the slow tier")
        a2.bar(names, [s.to_fast() / mib for s in sides], bottom=out, label="back to memory")
        a2.set_ylabel("MiB per computation")
        a2.legend()
        fig.suptitle(f"x.T @ x and mean over {fs(args.ratio * args.limit * args.workers)}, "
                     f"{args.workers} workers with {fs(args.limit)} each")
        _common.save_plot(fig, args.plot)


if __name__ == "__main__":
    sys.exit(_common.run(main))
