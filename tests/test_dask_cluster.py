"""CachedArray chunks on a real dask.distributed cluster: two worker processes on loopback, each
keeping its chunks in its own manager (ManagerPlugin), chunks that together outgrow each
worker's fast memory, results compared with NumPy, and a worker killed mid-computation."""

import gc
import json
import os
import re
import sys
import time

import numpy as np
import pytest

import cachedarrays as ca

pytest.importorskip("distributed")
import dask.array as da  # noqa: E402
from distributed import Client, LocalCluster, wait  # noqa: E402

from cachedarrays.dask import ManagerPlugin  # noqa: E402
from helpers import load_benchmark  # noqa: E402

# The worker processes cannot import this test module: send its functions (client.run) by
# value.
cloudpickle = pytest.importorskip("cloudpickle")
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# No dashboard, and the scheduler's HTTP routes on a free port (not 8787, which another cluster
# of this run may hold).
QUIET = dict(dashboard_address=None, scheduler_kwargs={"dashboard_address": "127.0.0.1:0"})

FAST = 4 << 20                     # each worker's fast memory: 4 MiB; the arrays are 11 MiB


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      **QUIET) as cluster, Client(cluster) as c:
        c.register_plugin(ManagerPlugin(fast=FAST, slow="256MiB"))
        yield c


@pytest.fixture
def here():
    """The client process's default manager, which receives the results."""
    with ca.Manager(fast="64MiB", slow="256MiB") as m:
        previous = ca.set_default_manager(m)
        try:
            yield m
        finally:
            ca.set_default_manager(previous)


def _worker_report():
    gc.collect()                   # frames of sent chunks let go: their pins are released
    m = ca.default_manager()
    s = m.stats()
    return dict(fast=m.fast.size, moved=sum(v["bytes"] for v in s["moved"].values()),
                sent=s["events"]["dask_sent"]["bytes"], received=s["events"]["dask_received"]["bytes"],
                pinned=len([o for o in m.objects() if m.pinned(o)]))


def _data(chunks):
    x = da.random.RandomState(5).random_sample((1200, 1200), chunks=chunks)
    return x, x.map_blocks(ca.asarray, meta=ca.empty((0, 0)))


@pytest.mark.parametrize("name", ["blockwise", "reduction", "matmul"])
def test_cluster_computations_on_cached_chunks_equal_numpy(client, here, name):
    x, xc = _data((300, 300))
    a = x.compute()
    # The chunks held on the workers at once (11 MiB against 2 x 4 MiB of fast memory): a
    # reduction alone frees each chunk as it goes, and whether a worker then ever fills its
    # fast memory depended on which tests ran before on its cluster.
    xc = xc.persist()
    wait(xc)
    expr, ref = {
        "blockwise": (np.exp(xc) - xc * 2, np.exp(a) - a * 2),
        "reduction": (xc.std(axis=0), a.std(axis=0)),
        "matmul": (xc @ xc.T, a @ a.T),
    }[name]
    got = expr.compute()
    assert isinstance(got, ca.CachedArray) and got.manager is here
    with ca.readable(got) as g:
        np.testing.assert_allclose(g, ref, rtol=1e-10)
    assert here.stats()["events"]["dask_received"]["bytes"] >= got.nbytes
    reports = client.run(_worker_report)
    assert len(reports) == 2
    for r in reports.values():
        assert r["fast"] == FAST
        assert r["pinned"] == 0                              # no pin outlived its frame
    assert sum(r["moved"] for r in reports.values()) > 0    # chunks outgrew fast memory
    assert sum(r["sent"] for r in reports.values()) > 0


def test_a_worker_killed_mid_computation_is_replaced_and_the_result_is_right(client, here):
    x, xc = _data((200, 200))
    a = x.compute()
    # a lambda: dask pickles functions inside a graph by reference unless they cannot be
    slow_exp = lambda c: (time.sleep(0.05), np.exp(c))[1]  # noqa: E731
    future = client.compute((xc.map_blocks(slow_exp) @ xc.T).sum(axis=0))
    time.sleep(0.5)
    victim = sorted(client.scheduler_info()["workers"])[0]
    with pytest.raises(Exception):                 # the worker dies before it answers
        client.run(lambda: os._exit(1), workers=[victim])
    got = future.result(timeout=120)
    with ca.readable(got) as g:
        np.testing.assert_allclose(g, (np.exp(a) @ a.T).sum(axis=0), rtol=1e-10)
    client.wait_for_workers(2, timeout=60)
    reports = client.run(_worker_report)
    assert all(r["fast"] == FAST and r["pinned"] == 0 for r in reports.values())


def test_the_plugin_closes_each_workers_manager_at_shutdown(here):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      **QUIET) as cluster, Client(cluster) as c:  # in this process
        plugin = ManagerPlugin(fast="2MiB", slow="16MiB")
        c.register_plugin(plugin)
        managers = c.run(lambda dask_worker: [
            p.manager for p in dask_worker.plugins.values() if isinstance(p, ManagerPlugin)])
        (m,) = next(iter(managers.values()))
        assert not m.closed and m.fast.size == 2 << 20 and ca.default_manager() is m
    assert m.closed and ca.default_manager() is here      # the previous default is back


def _row(out, name):
    """The cells of one row of the benchmark's table (split on runs of 2+ spaces)."""
    line = next(x for x in out.splitlines() if x.startswith(name))
    return re.split(r"\s{2,}", line[len(name):].strip())


def _bytes(cell):
    number, unit = cell.split()
    return float(number) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def test_the_tiers_benchmark_compares_spilling_with_tiers_in_one_run(tmp_path, monkeypatch,
                                                                     capsys):
    results = tmp_path / "results.jsonl"
    monkeypatch.setenv("CA_BENCH_RESULTS", str(results))
    bench = load_benchmark("dask_tiers")
    assert bench.main(["--workers", "1", "--limit", "4MiB", "--chunk", "1MiB", "--cols", "64",
                       "--repeats", "3", "--no-progress", "--plot", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    spilled, in_place, in_fast = map(_bytes, _row(out, "bytes to the slow tier"))
    unspilled, fetched_in_place, fetched = map(_bytes, _row(out, "bytes back to memory"))
    data = 4 * (4 << 20)
    assert spilled >= data / 2 and unspilled >= data / 2     # distributed pickled chunks out and in
    assert fetched_in_place == 0 and fetched >= data / 2     # kernels-in-fast brings chunks in
    assert "pins held by our workers after the runs: [0, 0]" in out
    heads = [json.loads(x) for x in results.read_text().splitlines()]
    assert [h["name"] for h in heads] == ["dask speedup vs spilling, CachedArray, in place",
                                          "dask speedup vs spilling, CachedArray, kernels in fast"]
    assert all(h["value"] > 0 for h in heads) and (tmp_path / "t.png").stat().st_size > 0


def test_the_tiers_benchmark_asks_each_policy_what_it_can_run(capsys):
    """A policy that keeps everything in fast memory is refused before any cluster starts; one
    that never evicts runs without the kernels-in-fast cluster, which it could not serve."""
    bench = load_benchmark("dask_tiers")
    assert bench.fits("lru", False) and bench.fits("lru", True)
    assert bench.fits("first-touch", False) and not bench.fits("first-touch", True)
    assert not bench.fits("fast-only", False)
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--policy", "fast-only"])
    assert exit_.value.code == 2
    assert "cannot hold data larger than fast memory" in capsys.readouterr().err
