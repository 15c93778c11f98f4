"""Replay: a real run of a policy and the replay of its trace make the same decisions, move the
same bytes and get the same modelled time; replays touch no data; errors come out as raised."""

import gc
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays.replay import evaluate
from cachedarrays.trace import Trace, TraceError

POLICIES = [("lru", {"preset": "CA:0"}), ("lru", {"preset": "CA:L"}),
            ("lru", {"preset": "CA:LM"}), ("lru", {"preset": "CA:LMP"}),
            ("lru", {}), ("firsttouch", {}), ("fastonly", {}), ("slowonly", {})]
FAST, SLOW, GRAN = 48 * 1024, 4 << 20, 256

# One operation of a random program: (name, array index, args...). Sizes in float64 elements.
op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 3000)),
    st.tuples(st.just("free"), st.integers(0, 99), st.booleans()),
    st.tuples(st.just("kernel"), st.integers(0, 99), st.integers(0, 99)),
    st.tuples(st.just("ufunc"), st.integers(0, 99)),
    st.tuples(st.just("read"), st.integers(0, 99)),
    st.tuples(st.just("prefetch"), st.integers(0, 99), st.booleans(), st.booleans()),
    st.tuples(st.just("evict"), st.integers(0, 99), st.booleans()),
    st.tuples(st.just("softevict"), st.integers(0, 99)),
    st.tuples(st.just("mark"), st.sampled_from(["layer", "step"])),
)

# A random program, or a random step repeated three times (what the lookahead of CA:LMP learns).
program = st.one_of(
    st.lists(op, min_size=5, max_size=40),
    st.lists(op, min_size=3, max_size=15).map(lambda body: (body + [("mark", "step")]) * 3))


def run_program(m, ops):
    """Run ops on manager m; returns the arrays' expected values (checked by the caller)."""
    arrays = []          # [CachedArray, expected ndarray]
    for o in ops:
        kind = o[0]
        if kind == "alloc":
            v = float(len(arrays) % 7)
            arrays.append([ca.full(o[1], v, manager=m), np.full(o[1], v)])
            continue
        if kind == "mark":
            m.mark(o[1])
            continue
        if not arrays:
            continue
        i = o[1] % len(arrays)
        x, want = arrays[i]
        if kind == "free":
            arrays.pop(i)
            if o[2]:
                del x                     # the collector's free, recorded at the next call
            else:
                ca.unsafe_free(x)
        elif kind == "kernel":
            y, wy = arrays[o[2] % len(arrays)]
            if y is x:
                with ca.kernel("inc", [], [x]) as (v,):
                    v += 1
                want += 1
            else:
                k = min(want.size, wy.size)
                with ca.kernel("acc", [x], [y]) as (vx, vy):
                    vy[:k] += vx[:k]
                wy[:k] += want[:k]
        elif kind == "ufunc":
            arrays.append([x * 2, want * 2])
        elif kind == "read":
            with ca.readable(x) as v:
                np.testing.assert_array_equal(v, want)
        elif kind == "prefetch":
            ca.prefetch(x, force=o[2], wait=o[3])
        elif kind == "evict":
            ca.evict(x, wait=o[2])
        elif kind == "evict_to":
            ca.evict(x, to=o[2], wait=o[3])
        elif kind == "softevict":
            ca.softevict(x)
    for x, want in arrays:
        with ca.readable(x) as v:
            np.testing.assert_array_equal(v, want)
    return arrays


def record(ops, policy, options, fast=FAST, **kw):
    with ca.Manager(fast=fast, slow=SLOW, policy=policy, policy_options=options,
                    granularity=GRAN, **kw) as m:
        with ca.trace(m) as t:
            arrays = run_program(m, ops)
            stats = m.stats()       # inside the trace: the frees its drain makes are recorded
        del arrays
    return t, stats


def assert_same_run(real, rep):
    assert rep.decisions == real.decisions
    a, b = real.result, rep.result
    assert b.total.bytes_moved == a.total.bytes_moved
    assert b.total.moved == a.total.moved and b.total.copies == a.total.copies
    assert len(a.steps) == len(b.steps)
    for x, y in zip(a.steps, b.steps):
        assert y.time == pytest.approx(x.time, rel=1e-9, abs=0)
        assert y.stall == pytest.approx(x.stall, rel=1e-9, abs=0)
        assert y.moved == x.moved and y.peak == x.peak
    assert b.total.time == pytest.approx(a.total.time, rel=1e-9, abs=0)


@pytest.mark.parametrize("policy,options", POLICIES,
                         ids=[f"{p}{o.get('preset', '')}" for p, o in POLICIES])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=program)
def test_a_real_run_and_the_replay_of_its_trace_agree(policy, options, ops):
    fast = 4 << 20 if policy == "fastonly" else FAST
    t, stats = record(ops, policy, options, fast=fast)
    t.validate()
    real = evaluate(t)
    rep = ca.replay(t, policy, fast=fast, slow=SLOW, policy_options=options, granularity=GRAN)
    assert_same_run(real, rep)
    assert rep.stats["moved"] == stats["moved"]
    for name in ("copy_async", "copy_cancelled", "writebacks_elided", "prefetch_refused"):
        assert rep.stats["events"][name] == stats["events"][name], name


def test_a_fixed_program_agrees_for_every_policy():
    ops = ([("alloc", 3000)] * 6 + [("kernel", i, i + 1) for i in range(5)] +
           [("prefetch", 0, True, False), ("evict", 1, False), ("ufunc", 2), ("mark", "layer"),
            ("softevict", 3), ("kernel", 0, 1), ("free", 2, False), ("free", 0, True),
            ("prefetch", 1, False, True), ("alloc", 2000), ("mark", "step")]) * 3
    for policy, options in POLICIES:
        fast = 4 << 20 if policy == "fastonly" else FAST
        t, _ = record(ops, policy, options, fast=fast)
        rep = ca.replay(t, policy, fast=fast, slow=SLOW, policy_options=options,
                        granularity=GRAN)
        assert_same_run(evaluate(t), rep)
        assert rep.result.total.kernels == len(t.kernels)


def test_replays_are_deterministic():
    ops = [("alloc", 3000)] * 8 + [("kernel", i, (i + 3) % 8) for i in range(8)] + \
        [("prefetch", 2, True, False), ("mark", "step")]
    t, _ = record(ops * 2, "lru", {"preset": "CA:LMP"})
    a = ca.replay(t, "lru", fast=0.3, policy_options={"preset": "CA:LMP"})
    b = ca.replay(t, "lru", fast=0.3, policy_options={"preset": "CA:LMP"})
    assert a.decisions == b.decisions and a.result == b.result


def test_replay_of_a_saved_trace(tmp_path):
    ops = [("alloc", 3000)] * 5 + [("kernel", 0, 4), ("ufunc", 1), ("evict", 2, False),
                                   ("mark", "step")]
    t, _ = record(ops * 3, "lru", {})
    t.save(tmp_path / "t.trace")
    u = Trace.load(tmp_path / "t.trace")
    assert_same_run(ca.replay(t, fast=FAST, granularity=GRAN),
                    ca.replay(u, fast=FAST, granularity=GRAN))
    assert_same_run(evaluate(t), ca.replay(u, fast=FAST, slow=SLOW, granularity=GRAN))


# ---- replays touch no data -------------------------------------------------------------------

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def big_trace(n=4, nbytes=1 << 30):
    """A hand-made trace of n arrays of nbytes each, used by kernels over two steps."""
    objs = {f"x{i}": nbytes for i in range(n)}
    events = [("alloc", s, nbytes, None) for s in objs]
    kernels, times = [], []
    for _ in range(2):
        for i in range(n):
            k = len(kernels)
            kernels.append(("k", (f"x{i}",), (f"x{(i + 1) % n}",)))
            times.append(0.01)
            events += [("kernel", k), ("end", k)]
        events.append(("evict", "x0", None, False))
        events.append(("prefetch", "x0", True, False))
        events.append(("step",))
    return Trace(objs, events, kernels, times, devices=["fast", "slow"])


def test_a_replay_with_an_8_gib_fast_tier_allocates_nothing():
    t = big_trace()
    before = rss()
    start = time.perf_counter()
    run = ca.replay(t, fast="8GiB")
    assert time.perf_counter() - start < 5
    assert rss() - before < 64 << 20
    assert run.info["fast"] == 8 << 30
    assert run.result.total.kernels == 8
    small = ca.replay(t, fast=0.5)                       # 2 GiB: evictions and prefetches
    assert rss() - before < 64 << 20
    assert small.result.total.bytes_moved >= 2 << 30


def test_the_fraction_of_the_footprint():
    t = big_trace(nbytes=1 << 20)
    assert t.footprint() == 4 << 20
    assert ca.replay(t, fast=0.5).info["fast"] == 2 << 20
    assert ca.replay(t, fast="3MiB").info["fast"] == 3 << 20
    assert ca.replay(t, fast=3 << 20).info["fast"] == 3 << 20


# ---- errors ------------------------------------------------------------------------------------

def test_a_replay_out_of_memory_raises_out_of_memory():
    t = big_trace(nbytes=1 << 20)
    start = time.perf_counter()
    with pytest.raises(ca.OutOfMemoryError):
        ca.replay(t, fast="1MiB", slow="2MiB")
    with pytest.raises(ca.OutOfMemoryError):
        ca.replay(t, policy="fastonly", fast="2MiB")
    assert time.perf_counter() - start < 5


def test_out_of_memory_inside_a_kernel_is_not_hidden():
    """The failing allocation happens while the kernel pins its operands: the replay must
    release them and raise the OutOfMemoryError, not wait for the pins at close."""
    t = Trace({"a": 1000, "b": 10 ** 6},
              [("alloc", "a", 1000, None), ("kernel", 0), ("alloc", "b", 10 ** 6, None),
               ("end", 0)], [("k", ("a",), ())], [0.1], devices=["fast", "slow"])
    start = time.perf_counter()
    with pytest.raises(ca.OutOfMemoryError):
        ca.replay(t, fast="64KiB", slow="128KiB")
    assert time.perf_counter() - start < 2


def test_a_trace_ending_inside_a_kernel_replays():
    t = Trace({"a": 1000}, [("alloc", "a", 1000, None), ("kernel", 0)], [("k", ("a",), ())],
              [0.1], devices=["fast", "slow"])
    start = time.perf_counter()
    assert ca.replay(t).result.total.kernels == 1
    assert time.perf_counter() - start < 2


def test_replay_of_a_malformed_trace_raises_trace_error():
    t = Trace({"a": 8}, [("kernel", 0)], [("k", ("a",), ())], [0.1], devices=["fast", "slow"])
    with pytest.raises(TraceError, match="not live"):
        ca.replay(t)
    t = Trace({"a": 8}, [("alloc", "a", 8, None), ("explode",)], [], [],
              devices=["fast", "slow"])
    with pytest.raises(TraceError, match="unknown event"):
        ca.replay(t)
    t = Trace({"a": 8}, [("alloc", "a", 8, None), ("end", 0)], [("k", ("a",), ())], [0.1],
              devices=["fast", "slow"])
    with pytest.raises(TraceError, match="not open"):
        ca.replay(t)
    with pytest.raises(TypeError, match="Trace"):
        ca.replay("a.trace")


# ---- tiers -------------------------------------------------------------------------------------

TIER_OPS = ([("alloc", 2000)] * 6 + [("kernel", i, (i + 1) % 6) for i in range(6)] +
            [("evict3", 0, "ssd", False), ("evict3", 1, "pmem", True), ("prefetch", 0, True,
                                                                          False),
             ("evict3", 2, "ssd", True), ("kernel", 2, 3), ("mark", "step")]) * 3


def run_tiers(m, ops):
    arrays = []
    for o in ops:
        if o[0] == "evict3":
            ca.evict(arrays[o[1]], to=o[2], wait=o[3])
        elif o[0] == "alloc":
            arrays.append(ca.full(o[1], 1.0, manager=m))
        elif o[0] == "kernel":
            with ca.kernel("k", [arrays[o[1]]], [arrays[o[2]]]) as (a, b):
                b += a
        elif o[0] == "prefetch":
            ca.prefetch(arrays[o[1]], force=o[2], wait=o[3])
        else:
            m.mark(o[1])
    return arrays


def test_replay_on_three_tiers_agrees_with_the_real_run(tmp_path):
    spec = [("dram", "48KiB"), ("pmem", "256KiB", str(tmp_path)), ("ssd", "1MiB", str(tmp_path))]
    with ca.Manager(tiers=spec, granularity=GRAN) as m:
        with ca.trace(m) as t:
            arrays = run_tiers(m, TIER_OPS)
        assert [a.device for a in arrays[:3]] != ["dram"] * 3
        del arrays
    assert t.devices == ["dram", "pmem", "ssd"]
    real = evaluate(t)
    rep = ca.replay(t, tiers=[("dram", "48KiB"), ("pmem", "256KiB"), ("ssd", "1MiB")],
                    granularity=GRAN)
    assert_same_run(real, rep)
    assert sum(n for link, n in rep.result.total.moved.items() if link.endswith("->ssd")) > 0
    assert rep.devices == ["dram", "pmem", "ssd"]
    # sizes may be fractions of the footprint too
    frac = ca.replay(t, tiers=[("dram", 0.5), ("pmem", 2.0), ("ssd", 4.0)])
    assert frac.result.total.kernels == len(t.kernels)
    # the trace names the ssd tier: two tiers cannot replay it
    with pytest.raises(ValueError, match="ssd"):
        ca.replay(t)


tier_op = st.one_of(op, st.tuples(st.just("evict_to"), st.integers(0, 99),
                                   st.sampled_from(["pmem", "ssd", "slow"]), st.booleans()))
TIERS3 = [("dram", "48KiB"), ("pmem", "192KiB"), ("ssd", "4MiB")]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(tier_op, min_size=5, max_size=40),
       options=st.sampled_from([{}, {"preset": "CA:0"}, {"preset": "CA:LMP"}]))
def test_random_programs_on_three_tiers_agree(ops, options):
    with ca.Manager(tiers=TIERS3, policy_options=options, granularity=GRAN) as m:
        with ca.trace(m) as t:
            arrays = run_program(m, ops)
        del arrays
    rep = ca.replay(t, tiers=TIERS3, policy_options=options, granularity=GRAN)
    assert_same_run(evaluate(t), rep)


def test_replay_tiers_take_profiles():
    t = big_trace(nbytes=1 << 20)
    a = ca.replay(t, tiers=[("dram", "2MiB"), ("pmem", "8MiB"), ("ssd", "64MiB")])
    b = ca.replay(t, tiers=[("dram", "2MiB"), ("pmem", "8MiB", None, "cxl"), ("ssd", "64MiB")])
    assert a.decisions == b.decisions
    assert a.result.total.time != b.result.total.time       # cxl is not optane


def teardown_module():
    gc.collect()
