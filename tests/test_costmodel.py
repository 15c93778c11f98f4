"""The cost model on hand-made decision logs; every expected time is worked out in a comment.

Default tiers ("fast", "slow") get "dram" (110 GB/s read, 60 write) and "optane" (30 read, 11 write).
A copy slow->fast runs at min(30, 60) = 30 GB/s, fast->slow at min(110, 11) = 11 GB/s.
"""

import json
import math

import pytest

from cachedarrays.costmodel import (PROFILES, SLOW_OUTPUT_FACTOR, Profile, Result, StepResult,
                                    evaluate, fast_only_time, get_profile, tier_profiles)

GB = 10**9
TIERS = ("fast", "slow")
# Round numbers for exact checks: copies slow->fast and fast->slow at 1 GB/s.
EXACT = {"fast": Profile("f", 4.0, 4.0), "slow": Profile("s", 1.0, 1.0)}


def kernel(k, *ops):
    return ("kernel", k, tuple(ops))


def copy(sid, src, dst, n, wait=False, so=0, do=0):
    return ("copy", sid, src, so, dst, do, n, wait)


def test_reading_from_slow_costs_the_bandwidth_difference():
    r = evaluate([0.1], [kernel(0, ("a", GB, "slow", False))], TIERS)
    # 0.1 + 1e9 * (1/30e9 - 1/110e9) = 0.1 + 0.0333.. - 0.00909.. = 0.124242..
    assert r.total.time == pytest.approx(0.1 + GB * (1 / 30e9 - 1 / 110e9))
    assert r.total.penalty == pytest.approx(0.0242424, rel=1e-5)
    assert r.total.compute == 0.1 and r.total.stall == 0.0 and r.total.kernels == 1
    assert r.total.kernel_read == {"fast": 0, "slow": GB}
    assert r.total.kernel_write == {"fast": 0, "slow": 0}
    assert r.total.slow_read == GB and r.total.slow_write == 0
    assert len(r.steps) == 1 and r.last == r.total       # a trailing interval with a kernel is a step


def test_slow_output_where_the_factor_dominates():
    ops = [("x", GB // 10, "fast", False), ("y", GB // 10, "slow", True)]
    r = evaluate([1.0], [kernel(0, *ops)], TIERS)
    # writes = 1e8 * (1/11e9 - 1/60e9) = 0.00742; (F-1) * compute = 1.0 dominates: 1.0 + 1.0
    assert r.total.penalty == (SLOW_OUTPUT_FACTOR - 1) * 1.0
    assert r.total.time == 2.0
    assert r.total.kernel_read == {"fast": GB // 10, "slow": 0}
    assert r.total.kernel_write == {"fast": 0, "slow": GB // 10}
    # a factor of 3 doubles the penalty
    assert evaluate([1.0], [kernel(0, *ops)], TIERS, slow_output_factor=3.0).total.time == 3.0


def test_slow_output_where_bandwidth_dominates():
    ops = [("x", GB, "slow", False), ("y", 10 * GB, "slow", True)]
    r = evaluate([0.1], [kernel(0, *ops)], TIERS)
    # reads  = 1e9  * (1/30e9 - 1/110e9) = 0.024242
    # writes = 1e10 * (1/11e9 - 1/60e9)  = 0.909091 - 0.166667 = 0.742424
    # P = max(0.766667, (2-1) * 0.1) = 0.766667; time = 0.1 + 0.766667
    reads = GB * (1 / 30e9 - 1 / 110e9)
    writes = 10 * GB * (1 / 11e9 - 1 / 60e9)
    assert r.total.penalty == pytest.approx(reads + writes)
    assert r.total.time == pytest.approx(0.866667, rel=1e-6)


def test_an_operand_read_and_written_counts_twice():
    r = evaluate([0.5], [kernel(0, ("a", 100, "slow", False), ("a", 100, "slow", True))], TIERS)
    assert r.total.kernel_read["slow"] == 100 and r.total.kernel_write["slow"] == 100
    assert r.total.time == 1.0                           # (F-1) * 0.5 dominates 100 bytes of traffic


def test_fast_only_run_is_the_sum_of_compute_times():
    times = [0.1, 0.2, 0.3]
    log = [kernel(k, ("a", GB, "fast", False), ("b", GB, "fast", True)) for k in range(3)]
    r = evaluate(times, log, TIERS)
    assert r.total.time == fast_only_time(times) == 0.1 + 0.2 + 0.3
    assert r.total.penalty == 0.0 and r.ratio(fast_only_time(times)) == 1.0
    assert fast_only_time([]) == 0.0 and isinstance(fast_only_time([1, 2]), float)


def test_async_prefetch_shorter_than_the_kernel_before_it_hides():
    log = [("alloc", "b", "fast", 0, GB), copy("b", "slow", "fast", GB),
           kernel(0, ("x", 1000, "fast", False)),        # 0.5 s of compute hides the 1/30 s copy
           kernel(1, ("b", GB, "fast", False))]
    r = evaluate([0.5, 0.2], log, TIERS)
    assert r.total.stall == 0.0
    assert r.total.time == 0.5 + 0.2
    assert r.total.moved == {"slow->fast": GB} and r.total.copies == {"slow->fast": 1}
    assert r.total.bytes_moved == GB
    assert r.total.peak == {"fast": GB, "slow": 0}


def test_async_prefetch_longer_than_the_kernel_before_it_stalls():
    log = [copy("b", "slow", "fast", GB), kernel(0, ("x", 1000, "fast", False)),
           kernel(1, ("b", GB, "fast", False))]
    r = evaluate([0.01, 0.2], log, TIERS)
    # the copy ends at 1e9 / 30e9 = 0.0333; kernel 1 starts at 0.01 and waits 0.0233
    assert r.total.stall == pytest.approx(1 / 30 - 0.01)
    assert r.total.time == pytest.approx(1 / 30 + 0.2)


def test_a_synchronous_copy_is_all_stall():
    log = [copy("b", "slow", "fast", GB, wait=True), kernel(0, ("b", GB, "fast", False))]
    r = evaluate([0.1], log, TIERS)
    assert r.total.stall == pytest.approx(1 / 30)
    assert r.total.time == pytest.approx(1 / 30 + 0.1)


def test_copies_on_one_link_serialize():
    log = [copy("a", "slow", "fast", GB), copy("b", "slow", "fast", GB), kernel(0, ("b", GB, "fast", False))]
    r = evaluate([0.1], log, TIERS)
    # b starts when a ends (1/30) and ends at 2/30
    assert r.total.stall == pytest.approx(2 / 30)
    assert r.total.time == pytest.approx(2 / 30 + 0.1)
    assert r.total.moved == {"slow->fast": 2 * GB} and r.total.copies == {"slow->fast": 2}


def test_copies_on_opposite_links_overlap():
    log = [copy("b", "fast", "slow", GB), copy("a", "slow", "fast", GB, do=GB),
           kernel(0, ("a", GB, "fast", False))]
    r = evaluate([0.1], log, TIERS)
    # b: fast->slow, 1/11 s; a: slow->fast (into fast space b is not reading) starts at 0 too, ends at 1/30
    assert r.total.stall == pytest.approx(1 / 30)
    assert r.total.moved == {"fast->slow": GB, "slow->fast": GB}   # sorted keys
    assert list(r.total.moved) == ["fast->slow", "slow->fast"]


def test_a_kernel_on_the_slow_copy_does_not_wait_for_a_prefetch():
    log = [copy("a", "slow", "fast", GB), kernel(0, ("a", GB, "slow", False))]
    assert evaluate([0.1], log, TIERS).total.stall == 0.0


def eviction_then(offset):
    return [("alloc", "a", "fast", 0, GB), ("alloc", "a", "slow", 0, GB),
            copy("a", "fast", "slow", GB),                     # swap-out: reads fast [0, 1e9) until 1/11 s
            ("free", "a", "fast", 0, GB),
            ("alloc", "b", "fast", offset, GB),
            kernel(0, ("b", GB, "fast", True))]


def test_new_object_in_space_being_evicted_waits_for_the_eviction():
    r = evaluate([0.01], eviction_then(0), TIERS)
    # b overlaps the eviction's source range: its kernel starts at 1e9 / 11e9 = 0.0909
    assert r.total.stall == pytest.approx(1 / 11)
    assert r.total.time == pytest.approx(1 / 11 + 0.01)
    assert r.total.peak["fast"] == GB and r.total.peak["slow"] == GB


def test_new_object_elsewhere_does_not_wait_for_the_eviction():
    r = evaluate([0.01], eviction_then(GB), TIERS)
    assert r.total.stall == 0.0 and r.total.time == 0.01
    assert r.total.peak["fast"] == GB


def test_a_copy_into_space_being_evicted_waits_for_the_eviction():
    log = eviction_then(0)[:-1] + [copy("b", "slow", "fast", GB), kernel(0, ("b", GB, "fast", False))]
    r = evaluate([0.01], log, TIERS)
    # the prefetch (own link, idle) starts when the eviction ends (1/11) and takes 1/30
    assert r.total.time == pytest.approx(1 / 11 + 1 / 30 + 0.01)


def test_a_copy_waits_for_its_source_data():
    log = [copy("a", "slow", "fast", GB), copy("a", "fast", "slow", GB, do=5 * GB),
           kernel(0, ("a", GB, "slow", False))]
    r = evaluate([0.0], log, TIERS, profile=EXACT)
    # a reaches fast at 1 s; the copy back starts then and lands in slow at 2 s
    assert r.total.stall == 2.0


def test_cancel_before_start():
    log = [copy("a", "slow", "fast", GB), copy("b", "slow", "fast", GB),
           ("cancel", "b", "slow", "fast"),              # b would run 1..2 s: stops at its start, 1 s
           copy("c", "slow", "fast", GB),                # the link is free at 1 s again: c runs 1..2 s
           kernel(0, ("c", GB, "fast", False), ("b", GB, "slow", False))]
    r = evaluate([0.0], log, TIERS, profile=EXACT)
    assert r.total.stall == 2.0
    assert r.total.moved == {"slow->fast": 2 * GB}       # b moved nothing
    assert r.total.copies == {"slow->fast": 3}           # copies counts issued copies


def test_cancel_midway():
    log = [copy("a", "slow", "fast", GB),                # 0..1 s
           kernel(0, ("x", 8, "fast", False)),           # t = 0.5
           ("cancel", "a", "slow", "fast"),              # stops at 0.5: half the bytes moved
           copy("b", "slow", "fast", GB),                # the link is free at 0.5: b runs 0.5..1.5
           kernel(1, ("a", GB, "fast", False)),          # a's copy was cancelled: no wait
           kernel(2, ("b", GB, "fast", False))]          # waits from 0.5 to 1.5
    r = evaluate([0.5, 0.0, 0.25], log, TIERS, profile=EXACT)
    assert r.total.moved == {"slow->fast": GB // 2 + GB}
    assert r.total.stall == 1.0
    assert r.total.time == 1.5 + 0.25


def test_cancel_after_completion_changes_nothing():
    log = [copy("a", "slow", "fast", GB), kernel(0, ("x", 8, "fast", False)),
           ("cancel", "a", "slow", "fast"), ("cancel", "a", "slow", "fast"),
           kernel(1, ("a", GB, "fast", False))]
    r = evaluate([2.0, 0.0], log, TIERS, profile=EXACT)
    assert r.total.moved == {"slow->fast": GB} and r.total.stall == 0.0 and r.total.time == 2.0


def test_cancel_counts_bytes_in_the_step_that_issued_the_copy():
    log = [copy("a", "slow", "fast", GB), kernel(0, ("x", 8, "fast", False)), ("step",),
           ("cancel", "a", "slow", "fast"), kernel(1, ("x", 8, "fast", False)), ("step",)]
    r = evaluate([0.25, 0.25], log, TIERS, profile=EXACT)
    assert r.steps[0].moved == {"slow->fast": GB // 4} and r.steps[1].moved == {}
    assert r.total.moved == {"slow->fast": GB // 4}


def test_cancel_of_an_unknown_copy_raises():
    with pytest.raises(ValueError, match="never issued"):
        evaluate([], [("cancel", "a", "slow", "fast")], TIERS)


def test_peak_occupancy_per_step():
    log = [("alloc", "a", "fast", 0, 100), ("alloc", "b", "fast", 100, 200), ("free", "a", "fast", 0, 100),
           ("alloc", "c", "fast", 0, 50), kernel(0, ("b", 200, "fast", False)), ("step",),
           # occupancy 250 at the start of step 2
           ("alloc", "d", "slow", 0, 70), ("free", "b", "fast", 100, 200), ("alloc", "e", "fast", 50, 20),
           kernel(1, ("c", 50, "fast", False)), ("layer",), ("step",)]
    r = evaluate([0.5, 0.25], log, TIERS)
    assert [s.peak for s in r.steps] == [{"fast": 300, "slow": 0}, {"fast": 250, "slow": 70}]
    assert r.total.peak == {"fast": 300, "slow": 70}


def test_two_steps():
    log = [kernel(0, ("a", GB, "slow", False)), ("step",), kernel(1, ("a", GB, "fast", False)),
           kernel(2, ("b", GB, "fast", False)), ("step",)]
    r = evaluate([0.1, 0.2, 0.3], log, TIERS)
    p = GB * (1 / 30e9 - 1 / 110e9)
    assert len(r.steps) == 2 and r.last is r.steps[1]
    assert r.steps[0].time == pytest.approx(0.1 + p) and r.steps[0].kernels == 1
    assert r.steps[1].time == pytest.approx(0.5) and r.steps[1].kernels == 2 and r.steps[1].penalty == 0.0
    assert r.total.time == pytest.approx(0.6 + p) and r.total.kernels == 3
    assert r.steps[1].compute == 0.2 + 0.3


def test_a_trailing_interval_is_a_step_only_with_a_kernel():
    assert len(evaluate([0.1], [kernel(0), ("step",), ("alloc", "a", "fast", 0, 8)], TIERS).steps) == 1
    assert len(evaluate([0.1, 0.1], [kernel(0), ("step",), kernel(1)], TIERS).steps) == 2
    empty = evaluate([], [], TIERS)
    assert empty.steps == [] and empty.last == empty.total and empty.total.time == 0.0


def test_nvme_latency_is_added_once_per_copy():
    tiers = ("fast", "ssd")
    r = evaluate([0.0], [copy("a", "ssd", "fast", 32 * GB // 10, wait=True)], tiers, profile="nvme-ssd")
    # min(3.2, 60) GB/s: 3.2e9 bytes in 1 s, plus 20 us latency
    assert r.total.time == pytest.approx(1.0 + 20e-6, abs=1e-12)
    r = evaluate([0.0], [copy("a", "fast", "ssd", 3 * GB, wait=True)] * 2, tiers, profile="nvme-ssd")
    # min(110, 3.0) GB/s: 1 s each, serialized, 20 us each
    assert r.total.time == pytest.approx(2 * (1.0 + 20e-6), abs=1e-12)


def test_memory_mode_cache_record_replaces_the_placement_penalty():
    log = [kernel(0, ("a", GB, "fast", False)),
           # requested 1 GB read; DRAM: tag reads 1 GB, fills 1 GB; slow: 1 GB of misses
           ("cache", 0, GB, 0, GB, GB, GB, 0)]
    r = evaluate([0.1], log, TIERS, profile="optane-2lm")
    # P = 1e9/110e9 + 1e9/60e9 + 1e9/23e9 - 1e9/110e9 = 1/60 + 1/23
    assert r.total.penalty == pytest.approx(1 / 60 + 1 / 23)
    assert r.total.kernel_read == {"fast": GB, "slow": GB}
    assert r.total.kernel_write == {"fast": GB, "slow": 0}
    with pytest.raises(ValueError, match="cache"):
        evaluate([0.1], [("cache", 0, 1, 0, 1, 0, 0, 0)], TIERS)
    with pytest.raises(ValueError, match="same k"):
        evaluate([0.1, 0.1], [kernel(0), ("cache", 1, 1, 0, 1, 0, 0, 0)], TIERS)


def test_tier_profiles_defaults():
    assert tier_profiles(TIERS) == {"fast": PROFILES["dram"], "slow": PROFILES["optane"]}
    assert list(tier_profiles(("a", "b", "c"), "cxl").values()) == [
        PROFILES["dram"], PROFILES["cxl"], PROFILES["cxl"]]
    custom = Profile("mine", 5, 4)
    assert tier_profiles(("a", "b", "c"), {"b": "nvme-ssd", "a": custom}) == {
        "a": custom, "b": PROFILES["nvme-ssd"], "c": PROFILES["optane"]}
    assert list(tier_profiles(("z", "a"))) == ["z", "a"]            # tier order, not sorted
    assert get_profile("cxl") is PROFILES["cxl"] and get_profile(custom) is custom


def test_tier_profiles_errors():
    with pytest.raises(ValueError, match="not tiers"):
        tier_profiles(TIERS, {"ssd": "nvme-ssd"})
    with pytest.raises(ValueError, match="optane-2lm"):                    # lists the known names
        tier_profiles(TIERS, "optane3")
    with pytest.raises(ValueError, match="unknown device profile"):
        get_profile(3)
    for bad in ("fast", (), ("fast", "fast"), ("fast", 2)):
        with pytest.raises(ValueError, match="tier names"):
            tier_profiles(bad)


def test_presets():
    assert {n: (p.read_gbps, p.write_gbps, p.latency) for n, p in PROFILES.items()} == {
        "dram": (110.0, 60.0, 0.0), "optane": (30.0, 11.0, 0.0), "optane-2lm": (23.0, 8.0, 0.0),
        "cxl": (25.0, 20.0, 0.0), "nvme-ssd": (3.2, 3.0, 20e-6)}
    assert all(p.name == n for n, p in PROFILES.items())


@pytest.mark.parametrize("kwargs, field", [
    (dict(read_gbps=0), "read_gbps"), (dict(read_gbps=-1.0), "read_gbps"),
    (dict(write_gbps=math.nan), "write_gbps"), (dict(write_gbps=math.inf), "write_gbps"),
    (dict(write_gbps="11"), "write_gbps"), (dict(read_gbps=True), "read_gbps"),
    (dict(latency=-1e-6), "latency"), (dict(latency=math.inf), "latency"),
])
def test_bad_profile_values_raise(kwargs, field):
    args = {"name": "bad", "read_gbps": 30.0, "write_gbps": 11.0, **kwargs}
    with pytest.raises(ValueError, match=f"'bad': {field}=.*give"):
        Profile(**args)


def test_profile_numbers_become_floats():
    p = Profile("p", 30, 11, 0)
    assert (type(p.read_gbps), type(p.write_gbps), type(p.latency)) == (float, float, float)


def test_bad_records_raise():
    with pytest.raises(ValueError, match="bogus"):
        evaluate([], [("bogus", 1)], TIERS)
    with pytest.raises(ValueError, match="unknown record"):
        evaluate([], [()], TIERS)
    with pytest.raises(ValueError, match="5 fields"):
        evaluate([], [("alloc", "a", "fast", 0)], TIERS)
    with pytest.raises(ValueError, match="'gpu'"):
        evaluate([], [("alloc", "a", "gpu", 0, 8)], TIERS)
    with pytest.raises(ValueError, match="range"):
        evaluate([0.1], [kernel(1)], TIERS)
    with pytest.raises(ValueError, match="slow_output_factor"):
        evaluate([], [], TIERS, slow_output_factor=0.5)


def busy_log():
    return [("alloc", "w", "slow", 0, 3 * GB), ("alloc", "x", "fast", 0, GB),
            copy("w", "slow", "fast", 3 * GB, do=GB), ("alloc", "w", "fast", GB, 3 * GB),
            kernel(0, ("x", GB, "fast", False), ("y", GB // 3, "slow", True)),
            ("cancel", "w", "slow", "fast"), ("step",),
            copy("x", "fast", "slow", GB, do=3 * GB), ("free", "x", "fast", 0, GB),
            ("alloc", "z", "fast", 0, GB // 7),
            kernel(1, ("z", GB // 7, "fast", True), ("w", 3 * GB, "slow", False)),
            copy("z", "fast", "slow", GB // 7, wait=True), ("layer",),
            kernel(2, ("x", GB, "slow", False)), ("step",)]


def test_evaluation_is_deterministic():
    times = [0.013, 0.021, 0.007]
    a = evaluate(times, busy_log(), TIERS, "cxl")
    b = evaluate(list(times), busy_log(), list(TIERS), "cxl")
    assert isinstance(a, Result) and all(isinstance(s, StepResult) for s in a.steps)
    assert a == b and a.as_dict() == b.as_dict()
    assert [s.time for s in a.steps] == [s.time for s in b.steps]   # bit-identical floats
    assert a.time == b.time == a.total.time > fast_only_time(times)
    assert a.ratio(fast_only_time(times)) > 1
    d = a.as_dict()
    assert set(d) == {"steps", "total"} and len(d["steps"]) == 2
    assert d["total"]["slow_read"] == a.total.slow_read and d["total"]["devices"] == ["fast", "slow"]


def test_three_tiers_use_each_tiers_bandwidth():
    tiers = ("fast", "slow", "ssd")
    log = [kernel(0, ("a", GB, "ssd", False), ("b", GB, "slow", False))]
    r = evaluate([0.1], log, tiers, {"ssd": "nvme-ssd"})
    # 1e9 * (1/3.2e9 - 1/110e9) + 1e9 * (1/30e9 - 1/110e9) = 0.303409 + 0.024242
    assert r.total.penalty == pytest.approx(GB * (1 / 3.2e9 - 1 / 110e9) + GB * (1 / 30e9 - 1 / 110e9))
    assert r.total.slow_read == 2 * GB and r.total.kernel_read == {"fast": 0, "slow": GB, "ssd": GB}
    assert list(r.total.peak) == list(tiers)


def test_as_dict_is_plain_json():
    r = evaluate([0.013, 0.021, 0.007], busy_log(), TIERS)
    assert json.loads(json.dumps(r.as_dict())) == r.as_dict()
