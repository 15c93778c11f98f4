"""The simulated memory-mode (2LM) DRAM cache: hit/miss sequences, traffic per Table 2.2, profiles."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachedarrays.policies.memorymode import (
    PROFILES,
    DeviceProfile,
    MemoryModeCache,
    MemoryModeStats,
    get_profile,
    load_profiles,
    modelled_time,
)

L = 64


class ReferenceCache:
    """Line-by-line pure-Python model of the same cache, written independently of the kernel."""

    def __init__(self, capacity, line_size, write_nofill=False):
        self.ls = line_size
        self.sets = capacity // line_size
        self.nofill = write_nofill
        self.tags = [-1] * self.sets
        self.dirty = [0] * self.sets
        self.c = dict(read_bytes=0, write_bytes=0, read_lines=0, write_lines=0, hits=0, clean_misses=0,
                      dirty_misses=0, slow_read=0, slow_write=0, dram_read=0, dram_write=0)

    def access(self, start, nbytes, write):
        if nbytes == 0:
            return
        c = self.c
        c["write_bytes" if write else "read_bytes"] += nbytes
        for line in range(start // self.ls, (start + nbytes - 1) // self.ls + 1):
            c["write_lines" if write else "read_lines"] += 1
            s = line % self.sets
            c["dram_read"] += 1  # tag check
            if self.tags[s] == line:
                c["hits"] += 1
            else:
                if self.dirty[s]:
                    c["dirty_misses"] += 1
                    c["slow_write"] += 1
                else:
                    c["clean_misses"] += 1
                if not (write and self.nofill):
                    c["slow_read"] += 1
                    c["dram_write"] += 1  # fill
                self.tags[s] = line
                self.dirty[s] = 0
            if write:
                c["dram_write"] += 1  # the data
                self.dirty[s] = 1

    def stats(self):
        c = self.c
        return MemoryModeStats(
            line_size=self.ls, read_bytes=c["read_bytes"], write_bytes=c["write_bytes"],
            read_lines=c["read_lines"], write_lines=c["write_lines"], hits=c["hits"],
            clean_misses=c["clean_misses"], dirty_misses=c["dirty_misses"], flushed_lines=0,
            slow_read_bytes=c["slow_read"] * self.ls, slow_write_bytes=c["slow_write"] * self.ls,
            dram_read_bytes=c["dram_read"] * self.ls, dram_write_bytes=c["dram_write"] * self.ls,
        )


def delta(cache, op):
    """Counters added by running ``op`` on ``cache``."""
    cache.reset(keep_contents=True)
    op()
    return cache.stats()


def test_capacity_is_rounded_down_to_whole_lines():
    c = MemoryModeCache(1000, L)
    assert (c.sets, c.capacity) == (15, 960)
    with pytest.raises(ValueError, match="capacity 10 B holds no 64 B line"):
        MemoryModeCache(10, L)


def test_two_addresses_in_one_set_keep_evicting_each_other():
    c = MemoryModeCache(4 * L, L)
    a, b = 0, 4 * L  # both map to set 0
    for addr in (a, b, a, b):
        c.access(addr, 8, write=False)
    s = c.stats()
    assert (s.hits, s.clean_misses, s.dirty_misses) == (0, 4, 0)
    assert c.contains(b) and not c.contains(a)
    c.access(L, 8, write=False)  # set 1 is untouched by the conflict
    c.access(L, 8, write=False)
    assert c.stats().hits == 1


def test_dirty_eviction_writes_back_exactly_one_line():
    c = MemoryModeCache(4 * L, L)
    c.access(3, 1, write=True)
    assert c.isdirty(0)
    s = delta(c, lambda: c.access(4 * L, 1, write=False))
    assert (s.dirty_misses, s.clean_misses, s.hits) == (1, 0, 0)
    assert s.slow_write_bytes == L and s.slow_read_bytes == L
    assert not c.isdirty(4 * L)


def test_streaming_twice_the_capacity_never_hits_on_the_second_pass():
    c = MemoryModeCache(8 * L, L)
    c.access(0, 16 * L, write=False)
    s = delta(c, lambda: c.access(0, 16 * L, write=False))
    assert (s.hits, s.clean_misses, s.dirty_misses) == (0, 16, 0)
    assert s.amplification == 1.0


def test_streaming_exactly_the_capacity_hits_on_every_line_of_the_second_pass():
    c = MemoryModeCache(8 * L, L)
    c.access(0, 8 * L, write=False)
    s = delta(c, lambda: c.access(0, 8 * L, write=False))
    assert (s.hits, s.misses, s.slow_bytes) == (8, 0, 0)


def test_write_miss_allocates_by_filling_from_slow_memory():
    c = MemoryModeCache(4 * L, L)
    c.access(10, 4, write=True)
    s = c.stats()
    assert c.contains(0) and c.isdirty(0)
    assert (s.clean_misses, s.slow_read_bytes, s.slow_write_bytes, s.write_bytes) == (1, L, 0, 4)


def test_write_nofill_skips_the_fill_but_still_installs_a_dirty_line():
    c = MemoryModeCache(4 * L, L, write_nofill=True)
    c.access(0, L, write=True)
    s = c.stats()
    assert c.isdirty(0)
    assert (s.clean_misses, s.slow_read_bytes, s.dram_read_bytes, s.dram_write_bytes) == (1, 0, L, L)


# Table 2.2: DRAM reads, DRAM writes, PM reads, PM writes and access amplification per LLC request.
TABLE_2_2 = {
    ("read", "hit"): (1, 0, 0, 0, 1),
    ("read", "clean"): (1, 1, 1, 0, 3),
    ("read", "dirty"): (1, 1, 1, 1, 4),
    ("write", "hit"): (1, 1, 0, 0, 2),
    ("write", "clean"): (1, 2, 1, 0, 4),
    ("write", "dirty"): (1, 2, 1, 1, 5),
}


@pytest.mark.parametrize("op, case", sorted(TABLE_2_2))
def test_traffic_per_line_matches_table_2_2(op, case):
    c = MemoryModeCache(4 * L, L)
    if case == "hit":
        c.access(0, L, write=False)
    elif case == "dirty":
        c.access(4 * L, L, write=True)
    s = delta(c, lambda: c.access(0, L, write=(op == "write")))
    expected = TABLE_2_2[op, case]
    got = (s.dram_read_bytes // L, s.dram_write_bytes // L, s.slow_read_bytes // L, s.slow_write_bytes // L,
           s.access_amplification)
    assert got == expected
    assert (s.hits, s.clean_misses, s.dirty_misses) == (
        int(case == "hit"), int(case == "clean"), int(case == "dirty"))


def test_ranges_touch_every_overlapping_line_and_empty_ranges_touch_none():
    c = MemoryModeCache(16 * L, L)
    c.access(L - 1, 2, write=False)  # straddles lines 0 and 1
    c.access(5 * L, 0, write=True)
    s = c.stats()
    assert (s.read_lines, s.write_lines, s.read_bytes, s.write_bytes) == (2, 0, 2, 0)
    assert c.contains(0) and c.contains(L) and not c.contains(5 * L)


def test_flush_writes_back_every_dirty_line_once_and_keeps_lines_resident():
    c = MemoryModeCache(8 * L, L)
    c.access(0, 3 * L, write=True)
    c.access(4 * L, 2 * L, write=False)
    s = delta(c, c.flush)
    assert (s.flushed_lines, s.slow_write_bytes, s.dram_read_bytes) == (3, 3 * L, 3 * L)
    assert c.flush() == 0
    assert c.contains(0) and not c.isdirty(0)


def test_reset_zeroes_counters_and_optionally_keeps_the_contents():
    c = MemoryModeCache(8 * L, L)
    c.access(0, 8 * L, write=True)
    c.reset(keep_contents=True)
    assert c.stats() == MemoryModeStats(line_size=L)
    assert c.isdirty(0)
    c.reset()
    assert not c.contains(0) and c.stats().lines == 0


def test_access_many_equals_a_loop_of_access():
    rng = np.random.default_rng(7)
    starts = rng.integers(0, 64 * L, 300)
    lengths = rng.integers(0, 8 * L, 300)
    writes = rng.random(300) < 0.5
    batched, looped = MemoryModeCache(16 * L, L), MemoryModeCache(16 * L, L)
    batched.access_many(starts, lengths, writes)
    for s, n, w in zip(starts, lengths, writes):
        looped.access(int(s), int(n), bool(w))
    assert batched.stats() == looped.stats()
    assert np.array_equal(batched.tags, looped.tags) and np.array_equal(batched.dirty_lines, looped.dirty_lines)


def test_access_many_takes_one_write_flag_for_all_ranges():
    c = MemoryModeCache(16 * L, L)
    c.access_many([0, 4 * L], [L, L], True)
    assert c.stats().write_lines == 2 and c.isdirty(4 * L)


def test_access_many_rejects_mismatched_or_negative_ranges():
    c = MemoryModeCache(16 * L, L)
    with pytest.raises(ValueError, match="2 starts but 1 lengths"):
        c.access_many([0, 64], [64], False)
    with pytest.raises(ValueError, match="write flags"):
        c.access_many([0, 64], [64, 64], [True, False, True])
    with pytest.raises(ValueError, match="non-negative"):
        c.access_many([-64], [64], False)


def test_a_range_many_times_the_capacity_is_counted_exactly():
    c, ref = MemoryModeCache(8 * L, L), ReferenceCache(8 * L, L)
    for start, n, w in [(3 * L, 4 * L, True), (0, 50 * L + 7, False), (L, 41 * L, True), (5, 30 * L, False)]:
        c.access(start, n, w)
        ref.access(start, n, w)
    assert c.stats() == ref.stats()
    assert list(c.tags) == ref.tags and list(c.dirty_lines) == ref.dirty


def test_coarse_lines_count_traffic_in_whole_coarse_lines():
    c = MemoryModeCache(1 << 20, 4096)
    c.access(100, 10, write=True)
    s = c.stats()
    assert (c.sets, s.write_bytes, s.slow_read_bytes) == (256, 10, 4096)


ranges = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 12), st.integers(0, 60), st.booleans()),
    max_size=25,
)


@settings(deadline=None, max_examples=50)
@given(sets=st.integers(1, 8), line_size=st.sampled_from([1, 8, 64]), nofill=st.booleans(), ops=ranges)
def test_kernel_matches_the_pure_python_reference(sets, line_size, nofill, ops):
    capacity = sets * line_size + line_size // 2  # also exercises rounding down
    c = MemoryModeCache(capacity, line_size, write_nofill=nofill)
    ref = ReferenceCache(capacity, line_size, write_nofill=nofill)
    starts = [s * line_size + off % line_size for s, off, _, _ in ops]
    lengths = [n * line_size // 4 for _, _, n, _ in ops]  # up to 15 lines: past the 3-wrap shortcut
    writes = [w for *_, w in ops]
    c.access_many(np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64), np.array(writes, dtype=bool))
    for s, n, w in zip(starts, lengths, writes):
        ref.access(s, n, w)
    assert c.stats() == ref.stats()
    assert list(c.tags) == ref.tags and list(c.dirty_lines) == ref.dirty


def test_amplification_and_derived_ratios():
    s = MemoryModeStats(line_size=L, read_bytes=600, write_bytes=400, hits=3, clean_misses=1, dirty_misses=1,
                        slow_read_bytes=1000, slow_write_bytes=500, dram_read_bytes=5 * L, dram_write_bytes=4 * L)
    assert s.amplification == 1.5
    assert s.hit_rate == 0.6
    assert s.access_amplification == pytest.approx((9 * L + 1500) / (5 * L))
    assert s.as_dict()["requested_bytes"] == 1000
    assert MemoryModeStats(line_size=L).amplification == 0.0


def test_modelled_time_sums_bytes_over_bandwidth_per_class():
    p = DeviceProfile("t", dram_read_gbps=100, dram_write_gbps=50, slow_read_gbps=20, slow_write_gbps=10)
    s = MemoryModeStats(line_size=L, dram_read_bytes=10**9, dram_write_bytes=10**9,
                        slow_read_bytes=2 * 10**9, slow_write_bytes=10**9)
    assert modelled_time(s, p) == pytest.approx(0.01 + 0.02 + 0.1 + 0.1)
    c = MemoryModeCache(8 * L, L, profile=p)
    c.access(0, 16 * L, write=True)
    assert c.modelled_time() == pytest.approx(modelled_time(c.stats(), p))
    assert c.modelled_time("dram") < c.modelled_time()


def test_optane_profile_uses_the_chapter_2_bandwidths():
    p = get_profile()
    assert p is PROFILES["optane"]
    assert (p.slow_read_gbps, p.slow_write_gbps) == (30.0, 11.0)
    with pytest.raises(KeyError, match="unknown device profile 'nvme'"):
        get_profile("nvme")
    with pytest.raises(ValueError, match="slow_write_gbps=0"):
        DeviceProfile("bad", slow_write_gbps=0)


def test_profiles_load_overrides_from_json(tmp_path):
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"optane": {"slow_write_gbps": 9}, "mine": {"slow_read_gbps": 5}}))
    profiles = load_profiles(path)
    assert profiles["optane"].slow_write_gbps == 9 and profiles["optane"].slow_read_gbps == 30.0
    assert profiles["mine"] == DeviceProfile("mine", slow_read_gbps=5)
    assert PROFILES["optane"].slow_write_gbps == 11.0  # the built-in table is untouched
    path.write_text(json.dumps({"optane": {"slow_wrte_gbps": 9}}))
    with pytest.raises(ValueError, match="unknown fields"):
        load_profiles(path)
