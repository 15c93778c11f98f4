"""The embedding benchmark at tiny sizes: every implementation agrees with torch, and the cached
table that holds every row hits on every lookup, caches nothing more and is reported against
SimpleTable (the cost of the indirection alone)."""

import re

import numpy as np
import pytest

import cachedarrays as ca

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("embedding")


def test_a_tiny_run_reports_the_every_row_table_with_every_lookup_a_hit(bench, capsys):
    pytest.importorskip("torch")
    bench.main(["--rows", "3000", "--fs", "16", "--batch", "64", "--bag", "4", "--repeats", "3",
                "--warmup", "2", "--cache", "0.5", "1.0", "--distributions", "uniform", "zipf",
                "--small-calls", "5", "--threads", "1", "--no-progress"])
    out = capsys.readouterr().out
    for dist in ("uniform", "zipf"):
        section = out.split(f"{dist} indices")[1]
        row = next(line for line in section.splitlines() if line.startswith(bench.EVERY_ROW))
        assert row.split()[-2] == "1.000"           # hit rate
        assert f"cached lookup vs SimpleTable, every row cached ({dist}): " in out
        agreement = section.split("lookup ")[1].split(",")[0]
        assert float(agreement) < 1e-5              # outputs agree with torch
    small = out.split("\nsmall batches")[1]           # per-call times at small batch sizes
    for nbags in (1, 16, 256):
        rows = [line for line in small.splitlines()
                if re.match(rf"(torch EmbeddingBag|SimpleTable fast|{bench.EVERY_ROW})\s+{nbags} ",
                            line)]
        assert len(rows) == 3, small                # torch, SimpleTable, every-row table
        assert f"small lookup speedup vs torch, SimpleTable fast, {nbags} bag" in out


def test_the_every_row_table_caches_nothing_and_never_flushes(bench):
    rng = np.random.default_rng(3)
    init = rng.uniform(-1, 1, (1500, 8)).astype(np.float32)   # not a whole number of pages
    with ca.Manager(fast=8 * init.nbytes, slow=8 * init.nbytes) as m:
        impl = bench.every_row(init, m)
        every = impl.table
        assert every.npages * every.page_rows > init.shape[0]
        before = every.stats()
        idx = rng.integers(0, init.shape[0], 200, dtype=np.int64)
        off = np.arange(0, 200, 4, dtype=np.int64)
        for _ in range(3):
            got = np.asarray(impl.lookup(idx, off))
            impl.after_lookup()
        after = every.stats()
        assert after["hits"] - before["hits"] == 600 == after["lookups"] - before["lookups"]
        assert after["rows_cached"] == before["rows_cached"] == init.shape[0]
        assert after["flushes"] == before["flushes"]
        want = np.zeros((off.shape[0], init.shape[1]), np.float32)
        for b, start in enumerate(off):          # added in index order, as the kernels do
            for r in idx[start:start + 4]:
                want[b] += init[r]
        np.testing.assert_array_equal(got, want)


def test_a_cache_below_the_hit_rate_shows_its_ratio_and_misses_the_goal(bench, capsys):
    pytest.importorskip("torch")
    bench.main(["--rows", "3000", "--fs", "16", "--batch", "64", "--bag", "4", "--repeats", "3",
                "--warmup", "0", "--cache", "0.01", "--distributions", "uniform",
                "--threads", "1", "--no-progress"])
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("goal cached lookup vs SimpleTable"))
    value = float(line.split(": ")[1].split("x")[0])
    assert value > 0                               # the measured ratio, not a stand-in
    assert "not met" in line and "no cache size reached 80% hits" in line


class _Recorder:
    """A stand-in implementation that records its calls and counts each lookup's indices
    as hits when ``hit`` is set."""

    cached = False

    def __init__(self, name, calls, hit=False):
        self.name, self.calls, self.hit = name, calls, hit
        self.hits = self.lookups = 0
        self.table = type("T", (), {"featuresize": 4})()

    def lookup(self, idx, off):
        self.calls.append((self.name, "lookup", int(idx[0])))
        self.lookups += len(idx)
        self.hits += len(idx) if self.hit else 0

    def after_lookup(self):
        self.calls.append((self.name, "after", None))

    def before_update(self, idx, off):
        self.calls.append((self.name, "lookup", int(idx[0])))

    def update(self, idx, off, dout, lr):
        self.calls.append((self.name, "update", int(idx[0])))

    def after_update(self):
        self.calls.append((self.name, "after", None))

    def counts(self):
        return self.hits, self.lookups


class _Batches:
    """Batch i has indices [i] * 4 and one bag."""

    def batch(self, i):
        return type("B", (), {"indices": [np.full(4, i, np.int64)],
                              "offsets": [np.zeros(1, np.int64)]})()


class _Bar:
    def update(self, n):
        pass


@pytest.mark.parametrize("lookup", [True, False])
def test_every_timed_call_follows_an_untimed_call_of_its_own_implementation(bench, lookup):
    """Interleaving five implementations had torch's lookup always follow one of ours (whose
    caches, TLB entries and thread pool it then paid for); each timed call now follows an
    untimed call of the same implementation, the lookups on another batch, and the hit rate
    counts the timed lookups only."""
    calls = []
    impls = [_Recorder("torch", calls), _Recorder("a", calls, hit=True), _Recorder("b", calls)]
    repeats = 3
    samples, rates = bench.bench(impls, _Batches(), repeats, lookup, _Bar())
    assert [len(s) for s in samples] == [repeats] * 3
    timed = "lookup" if lookup else "update"
    kinds = [(n, k, i) for n, k, i in calls if k != "after"]
    count = 0
    for q, (name, kind, batch) in enumerate(kinds):
        if kind == timed and (not lookup or batch <= repeats):
            prev = kinds[q - 1]
            assert prev[0] == name and prev[1] == "lookup"      # its own call just before
            if lookup:
                assert prev[2] == repeats + 1 + batch             # on another batch
            count += 1
    assert count == 3 * (repeats + 1)
    if lookup:
        assert rates == [0.0, 1.0, 0.0]
        assert impls[1].lookups == 2 * 4 * (repeats + 1)          # untimed ones ran too
