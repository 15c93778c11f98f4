"""The MemoryMode (2LM) policy's cost-model records, worked out by hand, and benchmarks/policies.py's
core (record a tiny CNN, replay every policy at every budget) on a small configuration."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import costmodel
from cachedarrays.policies import MemoryMode, SlowOnly
from cachedarrays.registry import resolve
from helpers import load_benchmark

L = 64                       # MemoryMode's default line size
KB = 1024                    # each object of the hand-made case: 16 lines


def _load_benchmark():
    return load_benchmark("policies")


# ---- MemoryMode ---------------------------------------------------------------------------------

def test_memorymode_is_registered_under_both_names_and_moves_nothing():
    assert resolve("memorymode") is MemoryMode and resolve("2lm") is MemoryMode
    assert issubclass(MemoryMode, SlowOnly)
    assert not (MemoryMode.honours_prefetch or MemoryMode.honours_softevict or MemoryMode.tracks_reads)
    with ca.Manager(fast="64KiB", slow="1MiB", policy="2lm", virtual=True) as m:
        assert m.policy.cache.capacity == m.fast.size
        objs = [m.new_pinned(4 * KB, placement) for placement in (None, "fast", "slow")]
        m.release(objs)
        assert all(o.primary.device is m.slow for o in objs)
        assert m.prefetch(objs[0], force=True) is False and objs[0].primary.device is m.slow
        assert m.stats()["devices"]["fast"]["peak_bytes"] == 0


def _offsets():
    """Data offsets on the slow device of three 1 KiB objects made one after another."""
    with ca.Manager(fast="64KiB", slow="1MiB", policy="slowonly", virtual=True) as m:
        objs = [m.new_pinned(KB) for _ in range(3)]
        m.release(objs)
        return [o.primary.data_offset for o in objs]


def _hand_case(capacity):
    """Kernels k0: read A, write B; k1: read B, write A; k2: read C; k3: read A. Returns the
    decision log of a traced run with a cache of ``capacity`` bytes."""
    with ca.Manager(fast=capacity, slow="1MiB", policy="memorymode", virtual=True) as m:
        a, b, c = objs = [m.new_pinned(KB) for _ in range(3)]
        m.release(objs)
        with ca.trace(m) as t:
            for reads, writes in (((a,), (b,)), ((b,), (a,)), ((c,), ()), ((a,), ())):
                m.acquire(reads, writes, "k")
                m.release((*reads, *writes))
            m.mark("step")
        stats = m.policy.stats()
    return t, stats


def test_memorymode_records_the_cache_traffic_of_each_kernel_worked_out_by_hand():
    a, b, c = _offsets()
    assert a % L == 0 and b - a == c - b and b - a >= KB + L   # 16 whole lines each, apart
    d = c - a                  # a cache of d bytes maps C onto A's sets; B's sets are others
    t, stats = _hand_case(d)
    recs = [r for r in t.decisions if r[0] == "cache"]
    # ("cache", k, requested read, requested write, dram read, dram write, slow read, slow write)
    assert recs == [
        # A: 16 clean read misses (tag check, fill from slow); B: 16 clean write misses, which
        # fill too (2LM's write amplification): tag check, fill and the written data in DRAM.
        ("cache", 0, KB, KB, 2 * KB, 3 * KB, 2 * KB, 0),
        # B read hits; A write hits (tag checks, data written to DRAM)
        ("cache", 1, KB, KB, 2 * KB, KB, 0, 0),
        # C evicts A, which k1 dirtied: 16 dirty misses write A back to slow memory
        ("cache", 2, KB, 0, KB, KB, KB, KB),
        # A evicts C, which is clean: 16 clean misses
        ("cache", 3, KB, 0, KB, KB, KB, 0),
    ]
    # each record directly follows its kernel's record (what the cost model requires)
    for i, r in enumerate(t.decisions):
        if r[0] == "cache":
            assert t.decisions[i - 1][:2] == ("kernel", r[1])
    assert (stats.hits, stats.clean_misses, stats.dirty_misses) == (32, 48, 16)


def test_memorymode_records_price_the_kernels_with_the_cache_traffic():
    a, b, c = _offsets()
    t, _ = _hand_case(c - a)
    times = [1e-3] * 4
    res = costmodel.evaluate(times, t.decisions, ["fast", "slow"], "optane-2lm")
    gb = 1e9
    fast_r, fast_w, slow_r, slow_w = 110 * gb, 60 * gb, 23 * gb, 8 * gb
    penalty = 0.0
    for _, _, rr, rw, dr, dw, sr, sw in (r for r in t.decisions if r[0] == "cache"):
        penalty += dr / fast_r + dw / fast_w + sr / slow_r + sw / slow_w - (rr / fast_r + rw / fast_w)
    assert res.total.penalty == pytest.approx(penalty, rel=1e-12)
    assert res.total.time == pytest.approx(sum(times) + penalty, rel=1e-12)
    assert res.total.kernel_write["slow"] == KB and res.total.kernel_read["slow"] == 4 * KB
    assert res.total.bytes_moved == 0


def test_a_cache_smaller_than_a_line_sends_every_byte_to_slow_memory():
    with ca.Manager(fast="64KiB", slow="1MiB", policy=MemoryMode(capacity=0), virtual=True) as m:
        assert m.policy.cache is None
        x, y = objs = [m.new_pinned(KB) for _ in range(2)]
        m.release(objs)
        assert m.policy.kernel_traffic(7, (x,), (y,)) == ("cache", 7, KB, KB, 0, 0, KB, KB)


def test_a_second_recorder_does_not_feed_the_cache_twice():
    with ca.Manager(fast="64KiB", slow="1MiB", policy="memorymode", virtual=True) as m:
        x = m.new_pinned(KB)
        m.release((x,))
        with ca.trace(m) as t1, ca.trace(m) as t2:
            m.acquire((x,), (), "k")
            m.release((x,))
        r1 = [r for r in t1.decisions if r[0] == "cache"]
        r2 = [r for r in t2.decisions if r[0] == "cache"]
        assert r1 == r2 == [("cache", 0, KB, 0, KB, KB, KB, 0)]
        assert m.policy.stats().clean_misses == KB // L
        with ca.trace(m) as t3:             # a new trace: kernel 0 again, now 16 hits
            m.acquire((x,), (), "k")
            m.release((x,))
        assert [r for r in t3.decisions if r[0] == "cache"] == [("cache", 0, KB, 0, KB, 0, 0, 0)]
        assert m.policy.stats().hits == KB // L


def test_a_real_run_and_its_replay_give_the_same_cache_records():
    with ca.Manager(fast="16KiB", slow="4MiB", policy="memorymode") as m:
        with ca.trace(m) as t:
            for step in range(2):
                xs = [ca.full(1000 + 300 * i, float(i), manager=m) for i in range(6)]
                ys = [x * 2.0 for x in xs]              # new arrays: read x, write y
                for x in reversed(xs):
                    x += x                              # in place: read and write x
                ca.unsafe_free(*xs, *ys)
                ca.mark_step(m)
        fast = m.fast.size
    real = [r for r in t.decisions if r[0] == "cache"]
    run = ca.replay(t, "memorymode", fast=fast, profile="optane-2lm")
    again = [r for r in run.decisions if r[0] == "cache"]
    assert real and real == again
    assert any(r[6] for r in real) and any(r[7] for r in real)    # misses and write-backs


# ---- the benchmark's core -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def bench():
    return _load_benchmark()


@pytest.fixture(scope="module")
def tiny_trace(bench):
    return bench.record(bench.MODELS["tinycnn"], "numpy", steps=3)


def test_the_recording_has_steps_annotations_and_median_times(bench, tiny_trace):
    t = tiny_trace
    assert t.validate() and t.steps == 3
    kinds = {e[0] for e in t.events}
    assert {"prefetch", "softevict", "free", "kernel"} <= kinds
    assert t.meta["times"].startswith("median") and t.compute(-1) > 0
    groups = t.step_kernels()
    assert [t.times[k] for k in groups[-1]] == [t.times[k] for k in groups[-2]]


def test_program_views_follow_each_policys_switches(bench, tiny_trace):
    t = tiny_trace
    assert bench.program_switches("lru", {"preset": "CA:LMP"}) == (True, True, True, True)
    assert bench.program_switches("lru", {"preset": "CA:LM"}) == (False, True, False, True)
    assert bench.program_switches("lru", {"preset": "CA:L"}) == (False, True, False, False)
    assert bench.program_switches("memorymode") == (False, False, False, True)
    assert bench.program_view(t, (True, True, True, True)) is t
    lm = bench.program_view(t, bench.program_switches("lru", {"preset": "CA:LM"}))
    assert lm.validate() and not any(e[0] == "prefetch" for e in lm.events)
    assert 0 < sum(e[0] == "softevict" for e in lm.events) < sum(e[0] == "softevict" for e in t.events)
    nc = bench.program_view(t, bench.program_switches("lru", {"preset": "CA:L"}))
    assert nc.validate() and nc.footprint() > t.footprint()
    assert [e for e in nc.events if e[0] == "kernel"] == [e for e in t.events if e[0] == "kernel"]


def test_sweep_rows_are_complete_and_deterministic(bench, tiny_trace):
    budgets = (10, 25, 100)
    rows = bench.sweep(tiny_trace, bench.POLICIES, budgets, "optane")
    assert [(r["label"], r["pct"]) for r in rows] == \
        [(label, pct) for label, _, _ in bench.POLICIES for pct in budgets]
    again = bench.sweep(tiny_trace, bench.POLICIES, (25,), "optane")    # one budget again
    assert bench.numbers([r for r in rows if r["pct"] == 25]) == bench.numbers(again)
    foot = tiny_trace.footprint()
    for r in rows:
        assert not r["oom"] and r["ratio"] >= 1.0 - 1e-12 and r["peak_fast"] <= r["budget"]
    mm = [r for r in rows if r["label"] == "MemoryMode"]
    assert all(r["profile"] == "optane-2lm" and r["moved"] == 0 for r in mm)
    assert all(r["cache_records"] == len(tiny_trace.kernels) for r in mm)
    assert mm[0]["slow_read"] > mm[-1]["slow_read"] > 0          # a smaller cache misses more
    others = [r for r in rows if r["label"] != "MemoryMode"]
    assert all(r["cache_records"] == 0 for r in others)
    lines = bench.table_lines(rows)
    for label, _, _ in bench.POLICIES:
        assert sum(line.startswith(label + " ") for line in lines) == len(budgets)
    assert [name for name, _, _ in bench.targets(rows, foot)] == [
        "LM at 25% <= 1.08x fast-only", "LMP <= LM at every budget (LMP vs LM time/FO)",
        "LM slow writes <= 1.1x floor"]
    assert any("floor" in line for line in bench.floor_lines(rows, foot))


def test_a_replay_out_of_memory_is_an_oom_cell(bench, tiny_trace):
    rows = bench.sweep(tiny_trace, [("FastOnly", "fastonly", None)], (10,), "optane")
    assert rows[0]["oom"] and "OOM" in bench.table_lines(rows)[1]


def test_main_twice_prints_the_same_numbers(bench, tmp_path, monkeypatch):
    # DeepTM's figures at one target and two betas: each searches budgets with a planner
    monkeypatch.setattr(bench, "FIG17", ((0.9, ("deeptm", None), ("lru", None)),))
    monkeypatch.setattr(bench, "BETAS", (0.5, 1.0))
    args = ["--models", "tinycnn", "--budgets", "25", "--steps", "3", "--backend", "numpy",
            "--traces", str(tmp_path), "--plot", str(tmp_path / "sweep.png")]
    outs = []
    for extra in (["--record"], []):         # record and save; then load and replay again
        lines = []
        assert bench.main(args + extra, out=lambda s="": lines.append(s)) == 0
        outs.append([s for s in lines if not s.startswith(("[wall]", "recording ", "machine: "))
                     and not
                     (s.startswith("tinycnn: ") and ("recording" in s or " trace " in s))])
    assert any(s.startswith("goal ") and s.endswith(("met", "n/a")) for s in outs[1])
    assert any(s.startswith("MemoryMode ") for s in outs[1])
    assert any(s.startswith("tinycnn: ") and "kernels/step" in s for s in outs[1])
    assert outs[0] == outs[1]
    assert (tmp_path / "tinycnn.trace.gz").exists() and (tmp_path / "sweep.png").stat().st_size > 1000


def test_the_g10_section_runs_on_a_small_trace_and_repeats_its_numbers(tiny_trace, tmp_path,
                                                                        monkeypatch):
    g10 = load_benchmark("_g10")
    monkeypatch.setitem(g10.FAST_AT_LEAST, "tinycnn", 0.6)   # its largest kernel needs > 25%
    traces = {"tinycnn": tiny_trace}
    lines, fig = g10.main_figure(traces)
    again, _ = g10.main_figure(traces)
    assert lines == again
    assert any(s.startswith("tinycnn") for s in lines)
    for policy in ("G10", "BaseUVM", "FlashNeuron"):
        frac = fig["tinycnn"][policy]["ideal"]
        assert 0 < frac <= 1.0 + 1e-9, (policy, frac)
    mid_lines, mid = g10.middle_sweep(traces, points=(0.0, 0.5))
    ssd_lines, ssd = g10.ssd_sweep(traces, points=(3.2, 32.0))
    assert mid_lines and ssd_lines
    g10.plot(str(tmp_path / "g10.png"), mid, ssd)
    assert (tmp_path / "g10.png").stat().st_size > 1000
