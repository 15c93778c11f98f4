"""The allocation benchmark at tiny sizes: both sections and the fragmentation figure print,
the C churn loops leave the heap as they found it, and a heap too small for the churn is an
error naming the flags to change."""

import mmap
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(1, 1 << 40), span=st.integers(0, 1 << 20), seed=st.integers(0, 2**32))
def test_churn_sizes_stay_within_min_size_and_max_size(bench, lo, span, seed):
    hi = lo + span
    sizes = bench.random_sizes(np.random.default_rng(seed), 64, lo, hi)
    assert sizes.dtype == np.uint64
    assert sizes.min() >= lo and sizes.max() <= hi
    assert (bench.random_sizes(np.random.default_rng(seed), 8, lo, lo) == lo).all()


def test_a_heap_too_small_for_the_churn_is_a_usage_error_before_any_timing(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--sizes", "64", "--repeats", "3", "--budget", "0.001", "--ops", "2000",
                    "--live", "500", "--max-size", "64K", "--heap", "1M", "--no-progress"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "--heap" in err and "--live" in err
    assert "1. new arrays" not in out               # nothing was timed


def test_a_fragmentation_run_stops_and_reports_a_share(bench):
    args = type("A", (), dict(seed=1, heap=1 << 20, min_size=256, max_size=32 << 10))()
    used, largest = bench.fill_until_fragmented(args)
    assert 0.5 < used <= 1.0 and 0.0 < largest <= 1.0


def test_equal_sizes_never_fragment_and_the_run_says_so(bench, capsys):
    args = type("A", (), dict(seed=1, heap=1 << 20, min_size=1000, max_size=1000))()
    assert bench.fill_until_fragmented(args) is None
    assert bench.main(["--sizes", "64", "--repeats", "3", "--budget", "0.001", "--ops", "2000",
                       "--live", "10", "--min-size", "1000", "--max-size", "1000", "--heap",
                       "1M", "--threads", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "no allocation found the free bytes enough" in out
    assert "first fragmentation failure" not in out
    heads = [line for line in out.splitlines() if "speedup vs numpy (64 B)" in line]
    assert len(heads) == len(set(heads)) == 2       # one size: each headline once
