"""Capuchin's plan follows the paper's rules on hand-made traces (hidden swaps by free time,
recompute of a cheap tensor a swap cannot hide, Alg. 2's inherited sources, feedback, passive
mode's least recently accessed victims), sqrt(n) checkpointing drops the activations between
checkpoints, and a real CNN run under Capuchin trains bitwise like fast-only and replays its
own decisions."""

import math

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import costmodel
from cachedarrays.policies.capuchin import (FEEDBACK, Capuchin, Checkpointing, SwapOnly,
                                            plan_capuchin, plan_checkpoints)
from cachedarrays.registry import resolve
from cachedarrays.stepprofile import StepProfile
from helpers import built_trace

MiB = 1 << 20
BLOCK = MiB - 64                            # a 1 MiB heap block with its 64-byte header
DRAM, OPTANE = costmodel.get_profile("dram"), costmodel.get_profile("optane")
OUT = MiB / 11e9                            # 1 MiB fast -> slow: min(110, 11) GB/s
IN = MiB / 30e9                             # 1 MiB slow -> fast: min(30, 60) GB/s


def build(objects, resident, items, steps=3, pure=False):
    return built_trace(objects, resident, items, steps, pure=pure)


def plan(trace, fast, **kw):
    return plan_capuchin(StepProfile.of(trace, 1), fast, lambda n: n + 64, DRAM, OPTANE, **kw)


# ---- swaps: free time ------------------------------------------------------------------------

T = 1e-4
SWAP_OBJECTS = {s: BLOCK for s in ("W", "A", "B", "C", "D")}
SWAP_STEP = [("a", "A"), ("k", ["W"], ["A"], T), ("a", "B"), ("k", ["A"], ["B"], T),
             ("a", "C"), ("k", ["B"], ["C"], T), ("a", "D"), ("k", ["C"], ["D"], T), ("f", "C"),
             ("k", ["D", "B"], ["W"], T), ("f", "D"), ("f", "B"),
             ("k", ["W"], [], T), ("k", ["W"], [], T), ("k", ["W"], [], T),
             ("k", ["A"], ["W"], T), ("f", "A")]


def test_the_swap_whose_free_time_hides_it_is_chosen_not_the_one_that_would_stall():
    t = build(SWAP_OBJECTS, ["W"], SWAP_STEP)
    p = plan(t, 4 * MiB)
    # Resident MiB per kernel: W A | +B | +C | +D (5 MiB: the peak window is kernel 3) ...
    assert p.p.curve.tolist() == [x * MiB for x in (2, 3, 4, 5, 4, 2, 2, 2, 2)]
    assert p.peak.tolist() == [False, False, False, True] + [False] * 5
    ft = {(s.sid, s.e, s.b): s.ft for s in p.swap_cands}
    # A: evicted after k1 (ends at 2T), back at k8 (starts at 8T); B: k2 -> k4; W: k0 -> k4.
    assert ft[("A", 1, 8)] == pytest.approx((8 * T - IN) - (2 * T + OUT))
    assert ft[("B", 2, 4)] == pytest.approx((4 * T - IN) - (3 * T + OUT)) and \
        ft[("B", 2, 4)] < 0
    assert ft[("W", 0, 4)] > 0
    # The largest FT that helps is A's; one swap makes the curve fit.
    assert [(s.sid, s.e, s.b) for s in p.swaps] == [("A", 1, 8)] and not p.recomputes
    # In-trigger: the latest kernel that starts at least SwapTime (35 us) before k8: k7.
    assert p.swaps[0].trigger == 7
    assert p.fits() and p.facts()["exposed"] == 0.0

    pol = Capuchin(profile=t)
    run = ca.replay(t, pol, fast=4 * MiB + 4096, profile="optane")
    assert pol.actions[("kernel_end", 1)] == (("send", "A"),)
    assert pol.actions[("kernel", 7)] == (("bring", "A"),)
    assert run.last.moved == {"fast->slow": BLOCK, "slow->fast": BLOCK}
    assert run.last.faults == 0 and pol.info["swaps"] == 1


def test_swap_only_swaps_what_capuchin_recomputes():
    t = build(CHAIN_OBJECTS, ["S"], CHAIN_STEP, pure=True)
    p = plan(t, 10 * MiB, recompute=False)
    # No swap hides behind 1 us kernels; the cheapest that relieves the peak (k2-k6) is X1's,
    # brought back after the peak (k7), just before its back-access (k8): its swap is exposed.
    assert not p.recomputes and [(s.sid, s.trigger) for s in p.swaps] == [("X1", 7)]
    assert p.fits()
    # k2 needs X1's room: it waits for the swap-out (decoupled swapping syncs only then); the
    # swap-in, issued before k7, then has only k7 to hide behind.
    x1 = p.swaps[0]
    assert p.facts()["exposed"] == pytest.approx(x1.out + x1.into - p.p.times[7])


# ---- recompute: MSPS and Alg. 2 --------------------------------------------------------------

TINY = 1e-6
BIG = 4 * MiB - 64
CHAIN_OBJECTS = {"S": BLOCK, "X1": BIG, "X2": BIG, "X3": BIG, "G": BLOCK}
# S -> X1 -> X2 -> X3 (forward), then the backward uses X3, X2, X1; kernels of about 1 us, so a
# 4 MiB swap (381 us out, 140 us in) cannot hide, and recomputing is cheap.
CHAIN_STEP = [("a", "X1"), ("k", ["S"], ["X1"], TINY), ("a", "X2"),
              ("k", ["X1"], ["X2"], TINY / 2), ("a", "X3"), ("k", ["X2"], ["X3"], TINY),
              ("a", "G"), ("k", ["X3"], ["G"], TINY), ("k", ["G"], ["G"], TINY),
              ("k", ["G"], ["G"], TINY), ("k", ["X3", "G"], ["G"], TINY), ("f", "X3"),
              ("k", ["X2", "G"], ["G"], TINY), ("f", "X2"), ("k", ["X1", "G"], ["G"], TINY),
              ("f", "X1"), ("f", "G")]


def test_a_large_tensor_cheap_to_recompute_with_negative_free_time_is_recomputed():
    t = build(CHAIN_OBJECTS, ["S"], CHAIN_STEP, pure=True)
    p = plan(t, 10 * MiB)
    assert all(s.ft < 0 for s in p.swap_cands)
    rec = {r.sid: r for r in p.rec_cands}
    # X2 has the largest MSPS (4 MiB / 0.5 us): chosen first. X1 is then the only candidate
    # that helps kernel 2 (13 MiB over 10): chosen. X2, dropped from k3 to k7, now starts from
    # X1's source S and redoes X1's kernel too (Alg. 2); so does X3 (X2's dependant).
    assert [r.sid for r in p.recomputes] == ["X2", "X1"] and not p.swaps
    assert rec["X2"].srcs == {"S"} and rec["X2"].rp == pytest.approx(1.5 * TINY)
    assert rec["X3"].srcs == {"S"} and rec["X3"].rp == pytest.approx(2.5 * TINY)
    assert p.fits()

    pol = Capuchin(profile=t)
    run = ca.replay(t, pol, fast=10 * MiB + 4096, profile="optane")
    assert pol.actions[("kernel_end", 1)] == (("drop", "X1"),)
    assert pol.actions[("kernel_end", 2)] == (("drop", "X2"),)
    assert run.last.bytes_moved == 0 and run.last.faults == 0
    # The back-access of X2 (k7) reruns X1's and X2's kernels (X1 stays: collective
    # recomputation), X1's back-access finds it there.
    assert run.last.compute == pytest.approx(sum(t.times[:9]) + 1.5 * TINY)
    assert run.stats["events"]["regenerate"]["count"] == 3


def test_objects_not_made_by_pure_kernels_are_never_recomputed():
    t = build(CHAIN_OBJECTS, ["S"], CHAIN_STEP, pure=False)
    p = plan(t, 10 * MiB)
    assert not p.rec_cands and not p.recomputes and p.swaps


# ---- feedback ----------------------------------------------------------------------------------

def test_feedback_moves_a_late_in_trigger_earlier_by_five_percent_of_its_swap_time():
    # X and Y are evicted after k0 to make room for Z (k1-k5) and come back for k15 (Y) and
    # k16 (X). Their in-triggers, by free time alone: k11 and k12 (the latest kernels starting
    # 35 us before). X's swap-in then queues behind Y's on the link and arrives 25 us late.
    objs = {"W": BLOCK, "X": BLOCK, "Y": BLOCK, "Z": 3 * MiB - 64}
    k = 10e-6
    step = [("a", "X"), ("a", "Y"), ("k", ["W"], ["X", "Y"], k), ("a", "Z")] + \
        [("k", ["Z"], [], k)] * 5 + [("f", "Z")] + [("k", ["W"], [], k)] * 9 + \
        [("k", ["Y"], [], k), ("k", ["X"], [], k), ("f", "X"), ("f", "Y")]
    t = build(objs, ["W"], step)
    p = plan(t, 4 * MiB)
    assert sorted(s.sid for s in p.swaps) == ["X", "Y"] and p.fits()
    x = next(s for s in p.swaps if s.sid == "X")
    assert (x.e, x.b, x.trigger) == (0, 16, 12)
    assert x.ft == pytest.approx(16 * k - IN - (k + OUT))
    _, _, _, late = p.timeline()
    assert [s.sid for s in late] == ["X"]
    rounds = 0
    while x.trigger == 12:
        late_sids, moved = p.feedback()
        rounds += 1
        assert late_sids == ["X"]
    assert x.lead == pytest.approx(rounds * FEEDBACK * x.into)
    assert x.trigger == 11 and moved == ["X"]
    # It moves once its lead passes 160 - 35 - 120 = 5 us, at 1.75 us a round: 3 rounds.
    assert rounds == math.floor((16 * k - x.into - 12 * k) / (FEEDBACK * x.into)) + 1 == 3

    pol = Capuchin(profile=t)          # planned at once; a feedback round at every step mark
    ca.replay(t, pol, fast=4 * MiB, profile="optane")
    moves = pol.info["feedback_moves"]
    assert [r["late"] for r in moves] == [1, 1, 1] and moves[2]["moved"] == ["X"]
    assert pol.actions[("kernel", 11)] == (("bring", "X"), ("bring", "Y"))


# ---- passive mode ------------------------------------------------------------------------------

def test_passive_mode_evicts_the_least_recently_accessed_first():
    objs = {"W0": BLOCK, "W1": BLOCK, "W2": BLOCK, "X": BLOCK}
    step = [("k", ["W0"], [], T), ("k", ["W1"], [], T), ("k", ["W2"], [], T),
            ("k", ["W0"], [], T), ("a", "X"), ("k", ["W2"], ["X"], T), ("f", "X")]
    t = build(objs, ["W0", "W1", "W2"], step)
    pol = Capuchin()                          # profiles its own step 1: step 0 is passive
    run = ca.replay(t, pol, fast=3 * MiB, profile="optane")
    outs = [d[1] for d in run.decisions if d[0] == "copy" and d[2] == "fast"]
    # X needs room: W1 was accessed longest ago (W0 at k3, W2 at k2); Belady would also have
    # said W1 here, but W0 comes next: then W1, W0, W2 ... round-robin like LRU.
    assert outs[0] == "W1"
    assert pol.info["passive_evicted"] >= BLOCK
    assert pol.planned


def test_options_are_checked_and_the_policies_are_registered():
    assert resolve("capuchin") is Capuchin and resolve("swap-only") is SwapOnly
    assert resolve("checkpoint") is Checkpointing
    assert Capuchin.kernels_in_fast and Checkpointing.kernels_in_fast
    for bad in (dict(margin=1.0), dict(margin=-0.1), dict(margin="5%"), dict(recompute="yes"),
                dict(feedback=1)):
        with pytest.raises(ValueError):
            Capuchin(**bad)
    with pytest.raises(ValueError, match="never recomputes"):
        SwapOnly(recompute=True)
    assert SwapOnly().recompute is False


# ---- sqrt(n) checkpointing -------------------------------------------------------------------

def chain_trace(n=9, size=MiB - 64, steps=3):
    """A forward chain X0..X{n-1} from S (pure kernels), a loss, then the backward using the
    activations in reverse; gradients in G."""
    objs = {"S": size, "G": size, **{f"X{i}": size for i in range(n)}}
    items, prev = [], "S"
    for i in range(n):
        items += [("a", f"X{i}"), ("k", [prev], [f"X{i}"], T)]
        prev = f"X{i}"
    items += [("a", "G"), ("k", [prev], ["G"], T)]
    for i in reversed(range(n)):
        items += [("k", [f"X{i}", "G"], ["G"], T), ("f", f"X{i}")]
    items.append(("f", "G"))
    return build(objs, ["S"], items, steps, pure=True)


def test_checkpointing_keeps_every_sqrt_n_th_activation_and_drops_the_others():
    t = chain_trace()
    drops, facts = plan_checkpoints(StepProfile.of(t, 1))
    # X8 is used by the loss and at once by the backward: no inactive interval. Of the other 8,
    # every round(sqrt(8)) = 3rd is a checkpoint (X2, X5); the others go after their last
    # forward use (the next link of the chain reads them), back at their backward kernel.
    assert facts["activations"] == 8 and facts["every"] == 3 and facts["checkpoints"] == 2
    assert [s for _, s, _ in drops] == ["X0", "X1", "X3", "X4", "X6", "X7"]
    assert drops[0] == (1, "X0", 18) and drops[1] == (2, "X1", 17)

    fast = 9 * MiB
    assert facts["peak"] == 11 * (MiB - 64)     # S, the 9 activations and G
    pol = Checkpointing(profile=t)
    run = ca.replay(t, pol, fast=fast, profile="optane")
    assert run.last.bytes_moved == 0 and run.last.faults == 0
    assert run.last.compute > t.compute()          # the recomputation is charged
    assert pol.info["dropped"] == 6


def test_checkpointing_never_swaps_and_says_when_the_step_does_not_fit():
    t = chain_trace()
    with pytest.raises(ca.OutOfMemoryError, match="checkpointing keeps every array"):
        ca.replay(t, Checkpointing(profile=t), fast=3 * MiB, profile="optane")


# ---- a real training run -------------------------------------------------------------------

def test_a_cnn_under_capuchin_trains_like_fast_only_and_replays_its_own_run():
    from cachedarrays.models import cnn
    from cachedarrays.replay import evaluate
    from cachedarrays.trace import StableIds
    from helpers import traced_training

    shape = dict(batch=2, image=16, channels=3, classes=10, width=8)
    _, ref_t, _, ref = traced_training("fast-only", "64MiB", 3, "resnet", 18, shape)
    foot = ref_t.footprint()
    model = cnn.build("resnet", 18, **shape)
    policy = Capuchin()
    m = ca.Manager(fast=int(foot * 0.5), slow="64MiB", policy=policy)
    StableIds.of(m)
    s = cnn.Session(m, "numpy")
    with m:
        with ca.trace(m) as t:
            model.init(s, seed=3)
            for i in range(3):
                x, y = cnn.synthetic_batch(model, seed=i)
                cnn.train_step(s, model, x, y, cnn.SGD(0.05))
        m.wait_copies()
        weights = model.weights()
        fast, slow = m.fast.size, m.slow.size
    for k in ref:
        assert np.array_equal(ref[k], weights[k]), k
    info = policy.info
    assert info["passive_evicted"] > 0 and info["swaps"] > 0 and info["dead_sent"] > 0, info
    # Weights swapped across the step mark make the plan fit (swaps hide: nothing recomputed)
    assert info["fits"] and info["peak_planned"] <= info["limit"] < info["peak"], info
    real = evaluate(t)
    run = ca.replay(t, Capuchin(), fast=fast, slow=slow)
    assert run.decisions == t.decisions
    assert run.last.bytes_moved == real.last.bytes_moved > 0


# ---- across the step mark ----------------------------------------------------------------------

WEIGHT_OBJECTS = {"W": BLOCK, "I": BLOCK, "A": BLOCK, "B": BLOCK, "C": 2 * MiB - 64, "D": BLOCK}
# W (a weight, made before the step, kept after it) is used by k1 only; the peak is k3-k4 (C
# is 2 MiB), and k0 of the next step does not use W.
WEIGHT_STEP = [("a", "I"), ("a", "A"), ("k", ["I"], ["A"], T), ("f", "I"),
               ("a", "B"), ("k", ["W", "A"], ["B"], T), ("f", "A"), ("k", ["B"], [], T),
               ("a", "C"), ("k", ["B"], ["C"], T), ("f", "B"),
               ("a", "D"), ("k", ["C"], ["D"], T), ("f", "C"),
               ("k", ["D"], [], T), ("f", "D")]


def test_a_weight_is_swapped_from_its_last_use_to_its_first_use_in_the_next_step():
    t = build(WEIGHT_OBJECTS, ["W"], WEIGHT_STEP)
    fast = 3 * MiB + MiB // 2
    p = plan(t, fast)
    n = len(p.p.times)
    # W's only inactive interval is k1 -> k1 of the next step (n + 1); the swap hides (FT > 0),
    # its swap-out ends before the peak needs the room, and its in-trigger is k0 of the next
    # step: the first kernel starting its swap-in time (35 us) before k1.
    [w] = p.swaps
    assert (w.sid, w.e, w.b, w.trigger) == ("W", 1, n + 1, n) and w.ft > 0
    assert p.fits() and p.facts()["exposed"] == 0
    # Its saving counts from k2 to the end of the step, and not at k0 (W comes back there).
    size = WEIGHT_OBJECTS["W"] + 64
    assert (p.p.curve - p.curve()).tolist() == [0, 0, size, size, size, size]

    pol = Capuchin(profile=t)
    run = ca.replay(t, pol, fast=fast + 4096, profile="optane")
    assert ("send", "W") in pol.actions[("kernel_end", 1)]
    assert pol.actions[("kernel", 0)] == (("bring", "W"),)     # fires in the next step
    # In the last step W was brought back at k0 and sent out after k1 (clean: dropped, its
    # slow copy is current), and no kernel had to fetch it.
    assert run.last.faults == 0 and run.last.moved == {"slow->fast": WEIGHT_OBJECTS["W"]}
    # The planned resident bytes leave C no room without the swap: without it, fast-only fails.
    with pytest.raises(ca.OutOfMemoryError):
        ca.replay(t, "fast-only", fast=fast + 4096, policy_options={"kernels_in_fast": True})


# ---- late swaps traded for recomputes ----------------------------------------------------------

QUEUE_OBJECTS = {"S": BLOCK, "P": BIG, "Q": BIG, "H": 8 * MiB - 64, "G": BLOCK}
# P and Q, made from S by 1 us kernels, leave for the kernel that needs H and come back for
# k5: each swap hides on its own (FT about 630 us), but both swap-ins start at k4 (150 us
# before k5) and queue on the link, so Q's arrives about 130 us late; recomputing Q costs 1 us.
QUEUE_STEP = [("a", "P"), ("k", ["S"], ["P"], TINY), ("a", "Q"), ("k", ["S"], ["Q"], TINY),
              ("k", ["S"], [], 1000e-6), ("a", "H"), ("k", [], ["H"], TINY), ("f", "H"),
              ("k", ["S"], [], 150e-6), ("a", "G"), ("k", ["P", "Q"], ["G"], TINY),
              ("f", "P"), ("f", "Q"), ("f", "G")]


def test_a_swap_that_hides_alone_but_queues_late_on_the_link_becomes_a_recompute():
    t = build(QUEUE_OBJECTS, ["S"], QUEUE_STEP, pure=True)
    only = plan(t, 11 * MiB, recompute=False)
    assert all(s.ft > 600e-6 for s in only.swap_cands if s.sid in ("P", "Q") and s.b == 5)
    assert sorted(s.sid for s in only.swaps) == ["P", "Q"]
    late = only.timeline()[3]
    assert [s.sid for s in late] == ["Q"] and late[0].late_by > 100e-6
    both = plan(t, 11 * MiB)
    assert [s.sid for s in both.swaps] == ["P"] and [r.sid for r in both.recomputes] == ["Q"]
    assert both.traded == 1 and both.fits() and not both.timeline()[3]
    runs = {}
    for cls in (SwapOnly, Capuchin):
        pol = cls(profile=t)
        runs[cls] = ca.replay(t, pol, fast=11 * MiB + 4096, profile="optane")
    assert runs[Capuchin].last.time < runs[SwapOnly].last.time - 100e-6
