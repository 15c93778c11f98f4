"""AutoTM's integer linear program: on small hand-made steps its placements and moves are the
optimum worked out by hand, its objective is the cost model's time, and the replay of its plan
takes exactly that time; the policy validates its options, decides the same way twice and
trains a real model with its data intact."""

import numpy as np
import pytest

import cachedarrays as ca
from helpers import beside_fast_only, layered_program
from cachedarrays.policies import autotm
from cachedarrays.policies.autotm import AutoTM, optimum, solve
from cachedarrays.stepprofile import StepProfile
from cachedarrays.trace import Trace

MB = 1_000_000
# Optane behind DRAM (costmodel.PROFILES): read and write bandwidths, bytes per second.
R_SLOW, W_SLOW, R_FAST, W_FAST = 30e9, 11e9, 110e9, 60e9
READ = 1 / R_SLOW - 1 / R_FAST          # seconds a kernel loses per byte it reads from slow
WRITE = 1 / W_SLOW - 1 / W_FAST         # ... per byte it writes to slow
COPY_IN = 1 / min(R_SLOW, W_FAST)       # seconds per byte of a copy slow -> fast (30 GB/s)
EXACT = dict(mip_gap=0.0)               # the hand cases are solved to the exact optimum


def hand_trace(persistent, body, steps=4):
    """A trace of ``steps`` equal steps. persistent: {sid: bytes} made before the first step
    (weights); body: one step, items ("kernel", name, reads, writes, seconds),
    ("alloc", sid, bytes) and ("free", sid)."""
    objects = dict(persistent)
    events = [("alloc", s, n, None) for s, n in persistent.items()]
    kernels, times = [], []
    for _ in range(steps):
        for item in body:
            if item[0] == "kernel":
                _, name, reads, writes, seconds = item
                k = len(kernels)
                kernels.append((name, tuple(reads), tuple(writes)))
                times.append(seconds)
                events += [("kernel", k), ("end", k)]
            elif item[0] == "alloc":
                objects[item[1]] = item[2]
                events.append(("alloc", item[1], item[2], None))
            else:
                events.append(item)
        events.append(("step",))
    return Trace(objects, events, kernels, times, devices=["fast", "slow"])


def moves(sol):
    return [(m.kind, m.sid, m.at, m.use) for m in sol.moves]


def replayed(trace, fast, **options):
    """(modelled seconds of the last step, policy) of a replay under AutoTM."""
    policy = AutoTM(**options)
    run = ca.replay(trace, policy, fast=fast, profile="optane")
    return run.last.time, policy


# ---- the program's choices, worked out by hand ------------------------------------------

@pytest.mark.parametrize("a_uses", [3, 1])
def test_capacity_forces_one_tensor_out_and_the_cheaper_one_goes_slow(a_uses):
    # a (1 MB) is read by a_uses kernels, b (2 MB) by one; 2.5 MB of fast memory (2.425 MB
    # after the 3% margin) holds one of them. Nothing moves (static formulation):
    #   a slow costs a_uses * 1 MB * READ, b slow costs 2 MB * READ.
    # a_uses=3: 3 MB of slow reads against 2 MB: b goes slow. a_uses=1: a goes slow.
    body = [("kernel", "ka", ["a"], [], 1e-3)] * a_uses + [("kernel", "kb", ["b"], [], 1e-3)]
    t = hand_trace({"a": MB, "b": 2 * MB}, body)
    sol = solve(StepProfile.of(t, 1), 2_500_000, moves="static", **EXACT)
    slow = "b" if a_uses == 3 else "a"
    assert {s for (s, _), w in sol.placement.items() if w == "slow"} == {slow}
    compute = (a_uses + 1) * 1e-3
    assert sol.objective == pytest.approx(compute + min(a_uses * MB, 2 * MB) * READ, rel=1e-12)
    assert sol.fast_only == pytest.approx(compute) and moves(sol) == []
    assert sol.status == "optimal" and sol.bound <= sol.objective * (1 + 1e-9)
    seconds, policy = replayed(t, 2_500_000, moves="static", **EXACT)
    assert seconds == pytest.approx(sol.objective, rel=1e-9)
    assert policy.info["objective"] == pytest.approx(sol.objective)


def _swap_step():
    # c (1 kB, allocated first: at the heap's start) is used by k1 and k3; a (1 MB) by k0;
    # b (1.1 MB) by k2. Fast memory: 1.5 MB, so a and b never fit together.
    body = [("kernel", "k0", ["a"], [], 1e-3), ("kernel", "k1", ["c"], [], 1e-3),
            ("kernel", "k2", ["b"], [], 1e-3), ("kernel", "k3", ["c"], [], 1e-3)]
    return hand_trace({"c": 1000, "a": MB, "b": 1_100_000}, body)


def test_a_prefetch_that_fits_under_a_long_kernel_is_asynchronous_and_free():
    # Asynchronous: a is clean (only read), so it is dropped after k0 and b (1.1 MB / 30 GB/s
    # = 37 us) is fetched under k1 (1 ms); b is dropped after k2 and a fetched under k3.
    # Every copy is hidden: the step takes its compute, 4 ms.
    t = _swap_step()
    sol = solve(StepProfile.of(t, 1), 1_500_000, **EXACT)
    assert moves(sol) == [("evict", "a", 0, 0), ("prefetch", "b", 1, 2),
                          ("evict", "b", 2, 2), ("prefetch", "a", 3, 0)]
    assert not any(m.dirty or m.wait for m in sol.moves)
    assert sol.objective == pytest.approx(4e-3, rel=1e-12) and sol.exposed == 0.0
    seconds, _ = replayed(t, 1_500_000, **EXACT)
    assert seconds == pytest.approx(4e-3, rel=1e-9)


def test_synchronous_moves_cost_more_than_a_slow_operand_so_nothing_moves():
    # Synchronous: a swap costs two blocking copies, (1 + 1.1) MB * COPY_IN = 70 us, more
    # than reading a from slow memory once, 1 MB * READ = 24 us (b, read once too, would
    # cost 1.1 MB * READ). So a stays slow and b fast.
    t = _swap_step()
    sol = solve(StepProfile.of(t, 1), 1_500_000, moves="sync", **EXACT)
    assert moves(sol) == [] and sol.placement[("a", 0)] == "slow"
    assert sol.placement[("b", 2)] == "fast"
    assert sol.objective == pytest.approx(4e-3 + MB * READ, rel=1e-12)
    seconds, _ = replayed(t, 1_500_000, moves="sync", **EXACT)
    assert seconds == pytest.approx(sol.objective, rel=1e-9)


def test_the_clean_tensor_leaves_not_the_dirty_one():
    # c (1 MB) is only read, d (1 MB) is written by k0 and k3; t (1 MB) is made by k1, read
    # by k2 and freed. 2.5 MB of fast memory (2.425 MB usable) holds two of the three. Kernels
    # take 1 us, so no copy hides. Choices for k1..k2:
    #   drop c after k0 (clean: free) and fetch it back for k3: 1 MB * COPY_IN      = 33.3 us
    #   keep c slow at k0 and k3: 2 * 1 MB * READ                                  = 48.5 us
    #   t slow: 1 MB * WRITE (a slow output, more than 1 us) + 1 MB * READ           = 100 us
    #   d out: its write-back (1 MB / 11 GB/s = 91 us) holds its memory during k1..k2: no room
    body = [("kernel", "k0", ["c"], ["d"], 1e-6), ("alloc", "t", MB),
            ("kernel", "k1", [], ["t"], 1e-6), ("kernel", "k2", ["t"], [], 1e-6),
            ("free", "t"), ("kernel", "k3", ["c"], ["d"], 1e-6)]
    t = hand_trace({"c": MB, "d": MB}, body)
    sol = solve(StepProfile.of(t, 1), 2_500_000, **EXACT)
    assert moves(sol) == [("evict", "c", 0, 3), ("prefetch", "c", 3, 3)]
    assert not sol.moves[0].dirty and sol.alloc == {"t": "fast"}
    assert sol.objective == pytest.approx(4e-6 + MB * COPY_IN, rel=1e-12)
    assert sol.exposed == pytest.approx(MB * COPY_IN, rel=1e-12)
    seconds, _ = replayed(t, 2_500_000, **EXACT)
    assert seconds == pytest.approx(sol.objective, rel=1e-9)


def test_a_dirty_tensor_is_written_back_under_a_long_kernel_before_it_is_dropped():
    # d (1 MB) is written by k0 and read by k4; t (1 MB) lives from k2 to k3; 1.5 MB of fast
    # memory. d's write-back (91 us) runs under k1 (1 ms), so d stays in fast memory for k1
    # only and is dropped when k1 ends; t is made in fast memory; d comes back for k4 with
    # a copy that no kernel hides (t holds the memory until k4): 1 MB * COPY_IN = 33.3 us.
    body = [("kernel", "k0", [], ["d"], 1e-6), ("kernel", "k1", ["s"], [], 1e-3),
            ("alloc", "t", MB), ("kernel", "k2", [], ["t"], 1e-6),
            ("kernel", "k3", ["t"], [], 1e-6), ("free", "t"), ("kernel", "k4", ["d"], [], 1e-6)]
    t = hand_trace({"d": MB, "s": 1000}, body)
    sol = solve(StepProfile.of(t, 1), 1_500_000, **EXACT)
    evict = [m for m in sol.moves if m.kind == "evict" and m.sid == "d"]
    assert len(evict) == 1 and evict[0].dirty and (evict[0].at, evict[0].drop) == (0, 1)
    assert ("prefetch", "d", 4, 4) in moves(sol) and sol.alloc == {"t": "fast"}
    assert [m for m in moves(sol) if m[1] == "d"] == [("evict", "d", 0, 4), ("prefetch", "d", 4, 4)]
    assert sol.objective == pytest.approx(1e-3 + 4e-6 + MB * COPY_IN, rel=1e-12)
    seconds, _ = replayed(t, 1_500_000, **EXACT)
    assert seconds == pytest.approx(sol.objective, rel=1e-9)


def test_a_slow_output_makes_the_kernel_twice_as_long():
    # y (2 MB) cannot fit in 1.5 MB of fast memory: k0 writes it to slow memory and runs at
    # least F = 2 times its compute: max(2 MB * WRITE = 151 us, (F - 1) * 1 ms) = 1 ms more.
    body = [("alloc", "y", 2 * MB), ("kernel", "k0", ["x"], ["y"], 1e-3), ("free", "y")]
    t = hand_trace({"x": 1000}, body)
    sol = solve(StepProfile.of(t, 1), 1_500_000, **EXACT)
    assert sol.alloc == {"y": "slow"} and sol.penalty == pytest.approx(1e-3)
    assert sol.objective == pytest.approx(2e-3, rel=1e-12)
    seconds, _ = replayed(t, 1_500_000, **EXACT)
    assert seconds == pytest.approx(2e-3, rel=1e-9)


def test_optimum_reports_the_objective_its_bound_and_gap():
    t = _swap_step()
    objective, bound, gap = optimum(t, 1_500_000, **EXACT)
    assert objective == pytest.approx(4e-3) and bound <= objective and 0 <= gap < 1e-6
    fraction = optimum(t, 1_500_000 / t.footprint(), **EXACT)
    assert fraction[0] == pytest.approx(objective)


def test_a_solver_without_a_solution_in_time_falls_back_to_the_static_greedy_placement(
        monkeypatch):
    # The fallback keeps tensors in fast memory for their whole life, most penalty saved per
    # byte-kernel first, while they fit: a (1 MB read once) and b (2 MB read once) both save
    # READ / 2 per byte-kernel (each lives both kernels); on the tie a goes first (sid order),
    # then b does not fit next to it (3 MB > 2.425 MB): b is read from slow memory.
    t = hand_trace({"a": MB, "b": 2 * MB}, [("kernel", "ka", ["a"], [], 1e-3),
                                            ("kernel", "kb", ["b"], [], 1e-3)])
    monkeypatch.setattr(autotm, "_run", lambda p, *args: (
        None, "fallback: time limit (no solution yet)", float("-inf"), (0, 0, 0), 1.0))
    sol = solve(StepProfile.of(t, 1), 2_500_000)
    assert sol.status.startswith("fallback") and sol.bound == 0.0 and sol.moves == []
    assert sol.placement == {("a", 0): "fast", ("b", 1): "slow"}
    assert max(sol.occupancy) <= sol.limit
    assert sol.objective == pytest.approx(2e-3 + 2 * MB * READ, rel=1e-12)


# ---- the policy -------------------------------------------------------------------------

@pytest.mark.parametrize("option, value", [
    ("time_limit", 0), ("time_limit", "10"), ("mip_gap", 1.0), ("mip_gap", -0.1),
    ("moves", "lazy"), ("margin", 1.0), ("retries", -1), ("retries", 1.5),
    ("node_limit", 0), ("profile_step", "1")])
def test_bad_options_are_refused_with_the_option_named(option, value):
    with pytest.raises(ValueError, match=option):
        AutoTM(**{option: value})


def test_solve_refuses_what_it_cannot_plan():
    with pytest.raises(TypeError, match="StepProfile or a Trace"):
        solve([], 1 << 20)
    with pytest.raises(ValueError, match="fast_bytes"):
        solve(_swap_step(), -1)


def test_two_replays_decide_the_same():
    t = _swap_step()
    a = ca.replay(t, AutoTM(), fast=1_500_000)
    b = ca.replay(t, "autotm", fast=1_500_000)
    assert a.decisions == b.decisions and a.last.bytes_moved > 0


def test_a_real_run_keeps_the_data_and_its_replay_makes_the_same_decisions():
    def program(m):
        return layered_program(m, n=30_000, arrays=3)

    policy = AutoTM()
    t, m = beside_fast_only(policy, program, "600KiB")
    assert policy.solution is not None and policy.info["status"] == "optimal"
    run = ca.replay(t, AutoTM(), fast=m.fast.size, slow=m.slow.size)
    assert run.decisions == t.decisions


def test_a_bundled_model_replays_under_autotm_close_to_its_program():
    from cachedarrays.models import cnn

    model = cnn.build("vgg", 11, batch=2, image=16, channels=3, classes=10, width=4)
    m, s = cnn.make_session("fast-only", "64MiB", slow="64MiB")
    with m:
        with ca.trace(m) as t:
            model.init(s, seed=1)
            for i in range(3):
                x, y = cnn.synthetic_batch(model, seed=i)
                cnn.train_step(s, model, x, y, cnn.SGD(0.05))
    # Kernel times from the bytes each kernel touches (10 GB/s + 10 us), not the wall clock:
    # the figures below must not move with the machine's load.
    t.times = [1e-5 + sum(t.objects[sid] for sid in (*r, *w)) / 1e10 for _, r, w in t.kernels]
    policy = AutoTM()
    run = ca.replay(t, policy, fast=0.25, profile="optane")
    info = policy.info
    assert info["status"] == "optimal" and info["variables"] > 0
    # The replay pays what the program leaves out: a 2.8 MB heap fragments (about 3% here).
    assert info["ratio"] >= 1.0 and info["ratio"] - 0.005 <= run.ratio < info["ratio"] + 0.05
