"""The allocation benchmark at tiny sizes: both sections and the fragmentation figure print,
the C churn loops leave the heap as they found it, and a heap too small for the churn is an
error naming the flags to change."""

import mmap
import tempfile

import numpy as np
import pytest

from cachedarrays.heap import Heap

from helpers import load_benchmark

TINY = ["--sizes", "64,4K", "--repeats", "3", "--budget", "0.001", "--ops", "3000", "--live",
        "40", "--max-size", "8K", "--heap", "4M", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("allocator")


@pytest.fixture(scope="module")
def churn(bench):
    with tempfile.TemporaryDirectory() as folder:
        return bench.churn_module(folder)


def test_a_tiny_run_prints_every_section_and_headline(bench, capsys, tmp_path):
    assert bench.main(TINY + ["--plot", str(tmp_path / "alloc.png")]) == 0
    out = capsys.readouterr().out
    table = out.split("2. the native heap")[0].splitlines()
    for call in ("empty", "zeros", "full", "empty, then written"):
        assert sum(line.startswith(f"{call} ") for line in table) == 2
    assert "ca_heap_alloc + ca_heap_free" in out and "malloc + free (glibc)" in out
    assert "native heap speedup vs glibc malloc (churn): " in out
    assert "heap in use at the first fragmentation failure: " in out
    assert (tmp_path / "alloc.png").stat().st_size > 0


def test_the_churn_loops_free_every_block_they_made(bench, churn):
    rng = np.random.default_rng(5)
    n, live = 5000, 64
    sizes = bench.random_sizes(rng, n, 64, 4096)
    assert sizes.min() >= 64 and sizes.max() <= 4096
    slot = rng.integers(0, live, n, dtype=np.int64)
    blocks = np.empty(live, dtype=np.int64)
    ffi, lib = churn.ffi, churn.lib
    mm = mmap.mmap(-1, 1 << 20)
    heap = Heap(mm, 1 << 20, name="t")
    alloc_at, free_at = Heap.entry_points()
    t = lib.churn_heap(heap._addr, alloc_at, free_at, ffi.cast("uint64_t *", sizes.ctypes.data),
                       ffi.cast("int64_t *", slot.ctypes.data), n,
                       ffi.cast("int64_t *", blocks.ctypes.data), live)
    assert t > 0
    heap.check()
    assert heap.stats().used == 0 and heap.stats().nallocated == 0
    ptrs = ffi.new("void *[]", live)
    assert lib.churn_malloc(ffi.cast("uint64_t *", sizes.ctypes.data),
                            ffi.cast("int64_t *", slot.ctypes.data), n, ptrs, live) > 0
    heap.close()


def test_a_heap_too_small_for_the_churn_names_the_flags(bench, capsys):
    with pytest.raises(SystemExit, match="--heap"):
        bench.main(["--sizes", "64", "--repeats", "3", "--budget", "0.001", "--ops", "2000",
                    "--live", "500", "--max-size", "64K", "--heap", "1M", "--no-progress"])


def test_a_fragmentation_run_stops_and_reports_a_share(bench):
    args = type("A", (), dict(seed=1, heap=1 << 20, min_size=256, max_size=32 << 10))()
    used, largest = bench.fill_until_fragmented(args)
    assert 0.5 < used <= 1.0 and 0.0 < largest <= 1.0
