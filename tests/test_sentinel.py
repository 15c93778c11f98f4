"""Sentinel's plan follows the paper's rules on hand-made traces (arena, interval prefetches in
access-count order, eager eviction, MIL choice, Case 3), runs real arrays intact, and its
characterization counts what the paper's motivation figures count."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.policies import sentinel as sn
from cachedarrays.policies.sentinel import Sentinel
from helpers import built_trace, load_benchmark

KiB, MiB = 1 << 10, 1 << 20
R_SLOW, R_FAST = 30e9, 110e9               # optane and dram read bandwidths (B/s)


def build(objects, resident, items, steps=3):
    return built_trace(objects, resident, items, steps)


def planned(trace, fast, **options):
    """Replay trace with a Sentinel planned from its step 1; (policy, run)."""
    p = Sentinel(profile=trace, **options)
    return p, ca.replay(trace, p, fast=fast, profile="optane")


# ---- short-lived objects and the arena -----------------------------------------------------

# Sizes are 64 bytes short of whole KiB: with the heap's 64-byte header each block is exactly
# that many KiB.
ARENA_OBJECTS = {"W": 4 * KiB - 64, "A": 8 * KiB - 64, "T1": 2 * KiB - 64,
                 "T2": 3 * KiB - 64, "T3": 4 * KiB - 64, "T4": 1 * KiB - 64}
ARENA_STEP = [
    ("a", "A"), ("a", "T1"),                       # layer 0
    ("k", ["W"], ["T1"], 1e-4), ("k", ["T1"], ["A"], 1e-4), ("f", "T1"), "L",
    ("a", "T2"), ("a", "T3"),                      # layer 1
    ("k", ["A"], ["T2"], 1e-4), ("k", ["T2"], ["T3"], 1e-4), ("f", "T2"), ("f", "T3"),
    ("a", "T4"), ("k", ["W"], ["T4"], 1e-4), ("f", "T4"),
    ("k", ["A", "W"], ["W"], 1e-4), ("f", "A"),
]


def test_short_lived_objects_go_to_the_arena_sized_by_the_interval_peak():
    t = build(ARENA_OBJECTS, ["W"], ARENA_STEP)
    p, run = planned(t, 256 * KiB, mil=1)
    # T1..T4 are allocated and freed in one layer; A lives across layers 0-1; W is resident.
    assert p.short == {"T1", "T2", "T3", "T4"}
    assert p.info["short_lived"] == 4 and p.info["long_lived"] == 2
    # Allocations of a step, in order: A, T1, T2, T3, T4. Short-lived ones are always fast.
    assert [p.alloc_plan[i] for i in (1, 2, 3, 4)] == ["fast"] * 4
    # The arena of layer 0 is T1 (2 KiB); of layer 1, T2 + T3 alive together (3 + 4 KiB), T4
    # comes after both are freed. The arena is the largest: 7 KiB.
    assert p.info["arena"] == 7 * KiB
    assert "below_lower_bound" not in p.info
    assert run.last.slow_read == 0 and run.last.slow_write == 0


def test_fast_memory_below_the_arena_plus_the_largest_tensor_is_noted_and_still_runs():
    t = build(ARENA_OBJECTS, ["W"], ARENA_STEP)
    # The lower bound: arena 7 KiB + largest long-lived tensor (A, 8 KiB - 64) = 15 KiB - 64.
    p, run = planned(t, 12 * KiB, mil=1)
    assert "below the arena (7168) plus the largest long-lived tensor (8128)" in \
        p.info["below_lower_bound"]
    assert run.ratio >= 1.0


def test_arena_objects_are_never_chosen_as_victims():
    t = build(ARENA_OBJECTS, ["W"], ARENA_STEP)
    p, _ = planned(t, 256 * KiB, mil=1)
    m = p.manager
    objs = [m.parent(r) for r in m.regions_on("fast")]
    assert all(p.ids.sid.get(o.id) not in p.short for o in p.select_victims(1))
    assert all(p.evictable(o) for o in objs)


# ---- intervals: prefetches, their order, eager eviction ----------------------------------

PREFETCH_OBJECTS = {s: 4 * KiB - 64 for s in ("W0", "W1", "W2", "W3", "X", "Z")}
PREFETCH_STEP = [
    ("k", ["W0"], [], 1e-3), "L",                                       # layer 0: k0
    ("k", ["W1", "W0"], [], 1e-3), ("k", ["W1"], [], 1e-3), "L",        # layer 1: k1, k2
    ("k", ["W2", "W3"], [], 1e-3), ("k", ["W3"], [], 1e-3), "L",        # layer 2: k3, k4
    ("k", ["X", "W2"], [], 1e-3), ("k", ["W3"], [], 1e-3),              # layer 3: k5, k6
    ("k", ["Z"], [], 1e-3),                                             #          k7
]


def test_prefetches_at_interval_starts_most_accessed_first_and_eager_evictions():
    t = build(PREFETCH_OBJECTS, list(PREFETCH_OBJECTS), PREFETCH_STEP)
    p, run = planned(t, 256 * KiB, mil=2)
    # MIL 2: interval 0 = layers 0-1 (k0-k2), interval 1 = layers 2-3 (k3-k7).
    # Accesses in the step: W0 2, W1 2, W2 2, W3 3, X 1, Z 1.
    # At the step mark (interval 0 opens), interval 1's tensors come in, most accessed first:
    # W3 (3), W2 (2), then X and Z (1 each; co-allocation order = allocation order). Z, used by
    # the step's last kernel, is also in interval 1 of the next step: it stays in fast memory.
    assert p.actions[("step",)] == (("bring", "W3"), ("bring", "W2"), ("bring", "X"))
    # W0's last use in interval 0 is k1: evicted before k2. W1's is k2, the interval's last
    # kernel, but interval 1 prefetches it for the next step's interval 0: it stays.
    assert p.actions[("kernel", 2)] == (("send", "W0"),)
    # Layer mark 1 opens interval 1: the next step's interval 0 needs W0 and W1 (2 accesses
    # each, allocation order); W1 is still in fast memory.
    assert p.actions[("layer", 1)] == (("bring", "W0"),)
    # Interval 1: W2 and X are last used by k5 (evicted before k6, W2 first: more accesses),
    # W3 by k6 (before k7).
    assert p.actions[("kernel", 6)] == (("send", "W2"), ("send", "X"))
    assert p.actions[("kernel", 7)] == (("send", "W3"),)
    assert set(p.actions) == {("step",), ("kernel", 2), ("layer", 1), ("kernel", 6),
                              ("kernel", 7)}
    # The replay did it: the last step copies W0 in at layer mark 1, then W3, W2, X at the
    # closing step mark (recorded before it), and reads nothing from slow memory (every copy
    # has a layer of 1 ms to finish).
    last = _last_step(run.decisions)
    copies_in = [d[1] for d in last if d[0] == "copy" and d[4] == "fast"]
    assert copies_in == ["W0", "W3", "W2", "X"]
    assert run.last.slow_read == 0 and run.ratio == pytest.approx(1.0)
    assert p.info["intervals"] == 2 and p.info["units"] == "layers"


def _last_step(decisions):
    marks = [i for i, d in enumerate(decisions) if d[0] == "step"]
    return decisions[marks[-2] + 1:marks[-1]]


def test_traces_without_layer_marks_use_kernels_as_layers():
    step = [it for it in PREFETCH_STEP if it != "L"]
    t = build(PREFETCH_OBJECTS, list(PREFETCH_OBJECTS), step)
    p, run = planned(t, 256 * KiB, mil=4)
    # 8 kernels, MIL 4: interval 0 = k0-k3 uses W0, W1, W2, W3; interval 1 = k4-k7 uses W3,
    # X, W2, Z. Interval 0 opens (step mark): of interval 1's W3, W2, X, Z only X is not in
    # fast memory (W2, W3 are used now; Z stayed since the last step's k7).
    assert p.info["units"] == "kernels" and p.info["intervals"] == 2
    assert p.actions[("step",)] == (("bring", "X"),)
    # W0 and W1 are last used by k1 and k2: evicted before k2 and k3. Interval 1 opens before
    # k4 and brings them back for the next step's interval 0 (2 accesses each, allocation
    # order; W3 and W2, also there, never left).
    assert p.actions[("kernel", 2)] == (("send", "W0"),)
    assert p.actions[("kernel", 3)] == (("send", "W1"),)
    assert p.actions[("kernel", 4)] == (("bring", "W0"), ("bring", "W1"))
    # X is last used by k5 and not by interval 0: evicted before k6.
    assert p.actions[("kernel", 6)] == (("send", "X"),)
    assert len(p.actions) == 5 and run.last.slow_read == 0


def test_a_new_long_lived_tensor_goes_to_fast_memory_when_the_plan_has_room():
    objs = {"W": 4 * KiB - 64, "Y": 8 * KiB - 64}
    step = [("a", "Y"), ("k", ["W"], ["Y"], 1e-3), "L", ("k", ["Y"], ["W"], 1e-3), ("f", "Y")]
    t = build(objs, ["W"], step)
    roomy, _ = planned(t, 64 * KiB, mil=1)
    assert roomy.alloc_plan == {0: "fast"}
    # Y's block is 8 KiB: fast memory of 6 KiB has no room for it.
    tight, run = planned(t, 6 * KiB, mil=1)
    assert tight.alloc_plan == {0: "slow"}
    assert run.last.slow_write >= objs["Y"]


# ---- choosing MIL, and Case 3 --------------------------------------------------------------

W_BYTES = MiB - 64                         # a 1 MiB block


def uneven_trace(reads_per_weight=1, steps=3):
    """Layers alternate: a tiny kernel (1 us) on a small X, then 1 ms on weight W_i."""
    objs = {f"W{i}": W_BYTES for i in range(4)}
    objs["X"] = 4 * KiB - 64
    items = []
    for i in range(4):
        items += [("k", ["X"], [], 1e-6), "L"]
        items += [("k", [f"W{i}"], [], 1e-3 / reads_per_weight)] * reads_per_weight
        if i < 3:
            items.append("L")
    return build(objs, list(objs), items, steps)


def test_mil_is_the_fastest_candidate_two_layers_on_a_trace_with_uneven_layers():
    p, run = planned(uneven_trace(), int(2.5 * MiB))
    # MIL 1: W_i's copy (1 MiB / 30 GB/s = 35 us) starts at the tiny layer, 1 us before its
    # kernel: late. Reading it from slow memory instead costs 1 MiB * (1/30 - 1/110) / 1e9
    # = 25.4 us per weight: 4 * 25.4 us over 4 * 1.001 ms, ratio 1.0254.
    # MIL 2 (tiny layer + 1 ms layer per interval): the copy has 1 ms: ratio 1.0.
    model = dict(p.info["mil_model"])
    penalty = W_BYTES * (1 / R_SLOW - 1 / R_FAST)
    assert model[1] == pytest.approx(1 + 4 * penalty / (4 * 1.001e-3), rel=1e-3)
    assert model[2] == pytest.approx(1.0)
    assert p.info["mil"] == 2 and dict(p.info["mil_sweep"])[2] == pytest.approx(1.0)
    assert min(r for _, r in p.info["mil_sweep"]) == pytest.approx(run.ratio)


def test_case3_trial_cancels_a_late_copy_read_once_and_waits_for_one_read_twice():
    once, run = planned(uneven_trace(1), int(2.5 * MiB), mil=1)
    # Interval 2i+1 (W_i's layer) opens 1 us after the copy started: 34 us late. Staying in
    # slow memory costs 25.4 us (one read); waiting costs 34 us: "stay", for each weight.
    assert once.info["case3"] == {1: "stay", 3: "stay", 5: "stay", 7: "stay"}
    assert sum(d[0] == "cancel" for d in _last_step(run.decisions)) == 4
    twice, _ = planned(uneven_trace(2), int(2.5 * MiB), mil=1)
    # Two kernels read W_i: staying costs 2 * 25.4 = 50.8 us, more than the 34 us wait.
    assert twice.info["case3"] == {1: "wait", 3: "wait", 5: "wait", 7: "wait"}
    waited, _ = planned(uneven_trace(1), int(2.5 * MiB), mil=1, case3="wait")
    assert set(waited.info["case3"].values()) == {"wait"}
    assert once.info["modelled"] < waited.info["modelled"]


def test_mil_sweep_replays_each_mil():
    # A run profiles step 1 and plans from step 2: step 3 is the steady state.
    sweep = sn.mil_sweep(uneven_trace(steps=4), int(2.5 * MiB), mils=[1, 2])
    assert [m for m, _ in sweep] == [1, 2]
    assert sweep[1][1] == pytest.approx(1.0) and sweep[0][1] > 1.02
    assert sn.mil_candidates(8) == list(range(1, 9))
    assert sn.mil_candidates(75) == list(range(1, 17)) + [20, 24, 32, 48, 64, 75]


# ---- options, determinism, real runs -------------------------------------------------------

@pytest.mark.parametrize("options, name", [
    ({"mil": 0}, "mil"), ({"mil": 2.5}, "mil"), ({"mil": True}, "mil"),
    ({"candidates": "1,2"}, "candidates"), ({"candidates": []}, "candidates"),
    ({"candidates": [0, 2]}, "candidates"), ({"case3": "maybe"}, "case3"),
    ({"replays": -1}, "replays"), ({"profile_step": "1"}, "profile_step"),
])
def test_bad_options_are_refused_with_the_option_named(options, name):
    with pytest.raises(ValueError, match=name):
        Sentinel(**options)


def test_two_replays_make_identical_decisions():
    t = uneven_trace()
    a, ra = planned(t, int(2.5 * MiB))
    b, rb = planned(t, int(2.5 * MiB))
    assert ra.decisions == rb.decisions and a.info == b.info and a.actions == b.actions


def _program(m, steps=4, n=20_000):
    """Four layers a step: a short-lived temporary and an activation per layer, then an
    update of every weight; returns the weights and the NumPy reference."""
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(n) for _ in range(4)]
    w = [ca.asarray(v, manager=m) for v in init]
    ref = [v.copy() for v in init]
    for _ in range(steps):
        x, rx = ca.ones(n, manager=m), np.ones(n)
        for wi, ri in zip(w, ref):
            tmp, y = ca.empty(n, manager=m), ca.empty(n, manager=m)
            with ca.kernel("mul", (x, wi), (tmp,)) as (a, b, out):
                np.multiply(a, b, out=out)
            with ca.kernel("add", (tmp,), (y,)) as (a, out):
                np.add(a, 1.0, out=out)
            del tmp
            rx = rx * ri + 1.0
            x = y
            ca.mark_layer(m)
        for wi, ri in zip(w, ref):
            with ca.kernel("update", (x,), (wi,)) as (a, b):
                b -= 1e-3 * a
            ri -= 1e-3 * rx
        del x, y
        ca.mark_step(m)
    return w, ref


@pytest.mark.parametrize("mil", [None, 2])
def test_a_real_run_keeps_the_data_intact(mil):
    """A planned run leaves every weight equal to NumPy's and the heap consistent. With MIL 2
    the plan moves arrays between the tiers; the sweep (mil=None) replays candidates on the
    measured kernel times, so which MIL it picks, and whether that MIL's plan moves anything,
    depends on the machine (MIL 3 and no action on a Zen 5, where its kernels ran fastest)."""
    p = Sentinel(mil=mil)
    with ca.Manager(fast=600 * KiB, slow="16MiB", policy=p) as m:
        w, ref = _program(m)
        # Short-lived: each layer's temporary, and the step's first input (freed in layer 0
        # when the first activation replaces it).
        assert p.planned and p.info["mil"] >= 1 and p.info["short_lived"] == 5
        for wi, ri in zip(w, ref):
            with ca.readable(wi) as got:
                np.testing.assert_allclose(got, ri, rtol=1e-12)
        assert sum(v["bytes"] for v in m.stats()["moved"].values()) > 0
        if mil is not None:
            assert p.info["mil"] == mil and p.actions
        m.check()


def test_the_registered_name_runs_and_replays_a_bundled_program():
    bench = load_benchmark("policies")
    t = bench.record(bench.MODELS["tinycnn"], "numpy", steps=4)
    # Kernel times from the bytes each kernel touches (DRAM speed), not the wall clock: the
    # comparison must not move with the machine's load.
    t.times = [2e-6 + sum(t.objects[s] for s in (*reads, *writes)) / 10e9
               for _, reads, writes in t.kernels]
    run = ca.replay(t, "sentinel", fast=0.5, profile="optane")
    lru = ca.replay(t, "lru", fast=0.5, profile="optane")
    assert run.info["policy"] == "Sentinel"
    assert 1.0 <= run.ratio < lru.ratio
    # A quarter of the footprint is below the arena plus the largest weight (147 KiB).
    p = Sentinel()
    ca.replay(t, p, fast=0.25, profile="optane")
    assert "below_lower_bound" in p.info


# ---- characterization ----------------------------------------------------------------------

def test_characterization_counts_by_hand():
    objs = {"H": 3000, "c": 100, "S1": 2000, "L1": 10000}
    step = [("a", "S1"), ("a", "L1"),
            ("k", ["H"], ["S1"], 1e-4), ("k", ["S1", "H"], ["L1"], 1e-4), ("f", "S1"), "L",
            ("k", ["H", "L1"], [], 1e-4), ("k", ["H", "L1"], [], 1e-4)]
    step += [("k", ["H"], [], 1e-4)] * 7 + [("f", "L1"), "L",
                                            ("k", ["H"], [], 1e-4), ("k", ["c"], [], 1e-4)]
    d = sn.characterize(build(objs, ["H", "c"], step))
    # H: 12 kernels (k0-k11), c: 1, S1: 2 (short-lived, layer 0), L1: 3 (layers 0-1).
    assert d["tensors"] == 4 and d["bytes"] == 15100
    assert d["short_lived"]["tensors"] == 1 and d["short_lived"]["bytes"] == 2000
    assert d["short_lived"]["under_page"] == 1
    assert [(b["bucket"], b["tensors"], b["bytes"]) for b in d["histogram"]] == [
        ("0", 0, 0), ("1", 1, 100), ("2-9", 2, 12000), ("10-99", 1, 3000), ("100+", 0, 0)]
    # Allocation order, back to back: H [0, 3000), c [3000, 3100), S1 [3100, 5100),
    # L1 [5100, 15100). Page 0 holds H, c and S1: 13 kernels; pages 1-3 hold L1 (page 1 also
    # S1: k0, k1, k2, k3 = 4 kernels). Hot (>= 10) bytes: 3000 per object, 4096 per page.
    alloc = d["pages"]["allocation_order"]
    assert alloc["pages"] == 4 and alloc["hot_bytes"] == 4096
    assert [b["pages"] for b in alloc["histogram"]] == [0, 0, 3, 1, 0]
    # Sentinel's layout: S1 alone (page 0); L1, span layers 0-1 (pages 1-3); H and c, span
    # 0-2, most accessed first (page 4). c's 100 bytes count as hot either way.
    layout = d["pages"]["sentinel_layout"]
    assert layout["pages"] == 5 and layout["hot_bytes"] == 4096
    assert [b["pages"] for b in layout["histogram"]] == [0, 0, 4, 1, 0]
    lines = sn.format_characterization(d)
    assert lines[1].startswith("short-lived: 1 tensors (25%)")
    assert lines[-1] == ("hot (>= 10 accesses): 0.0 MiB per object, 0.0 MiB per page in "
                         "allocation order, 0.0 MiB per page in Sentinel's layout")
