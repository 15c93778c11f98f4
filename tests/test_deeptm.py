"""DeepTM: Alg. 1's heat and weights, the Aggregator, the greedy placement, the cost model and
the DQN worked out by hand on small steps; β; options; real runs and replays."""

import math

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays.policies import deeptm
from cachedarrays.policies.deeptm import (Aggregator, CostModel, DeepTM, Graph, HeatRow,
                                          Refiner, Table, adapt_weights, heat_table,
                                          plan_greedy, to_table)
from cachedarrays.policies.dqn import Agent, exploit_probability
from cachedarrays.stepprofile import StepProfile
from cachedarrays.trace import Trace

MS = 1e-3


def program(body, steps=3, init=()):
    """A hand-made trace: ``init`` (sid, bytes) allocated before the first step, then ``body``
    every step: ("alloc", sid, bytes), ("free", sid), ("layer",) or ("kernel", reads, writes,
    seconds)."""
    objects, events, kernels, times = {}, [], [], []
    for sid, n in init:
        objects[sid] = n
        events.append(("alloc", sid, n, None))
    for _ in range(steps):
        for item in body:
            if item[0] == "alloc":
                objects[item[1]] = item[2]
                events.append(("alloc", item[1], item[2], None))
            elif item[0] == "kernel":
                k = len(kernels)
                kernels.append(("k", tuple(item[1]), tuple(item[2])))
                times.append(item[3])
                events += [("kernel", k), ("end", k)]
            else:
                events.append(item)
        events.append(("step",))
    return Trace(objects, events, kernels, times, devices=["fast", "slow"])


def graph(trace, step=1):
    return Graph(StepProfile.of(trace, step))


# ---- heat: Alg. 1 ---------------------------------------------------------------------------

# Normalised features (f, r, s, l) of four tensors and their bytes: t0 (1, 0, 0, 1) 100 B;
# t1 (0, 1, 1, 0) 100 B; t2 (.5, .4, .5, .5) 200 B; t3 (.6, 0, .2, .1) 150 B
FEATS = tuple(np.array(v) for v in ([1, 0, .5, .6], [0, 1, .4, 0], [0, 1, .5, .2], [1, 0, .5, .1]))
SIZES = np.array([100.0, 100.0, 200.0, 150.0])


def test_heat_starts_from_unit_weights_and_keeps_them_inside_the_band():
    # H = f - r - s + l: t0 = 2, t1 = -2, t2 = .1, t3 = .5; hot = t0, t2, t3 = 450 B, which is
    # inside [0.9, 1.1] x 450: no weight moves.
    w = dict(w_f=1.0, w_r=1.0, w_s=1.0, w_l=1.0)
    H, hot, it = adapt_weights(FEATS, SIZES, w, budget=450, live_bytes=550)
    np.testing.assert_allclose(H, [2, -2, .1, .5])
    assert hot.tolist() == [True, False, True, True] and it == 0
    assert w == dict(w_f=1.0, w_r=1.0, w_s=1.0, w_l=1.0)


def test_too_hot_below_the_pressure_point_raises_w_r_until_the_band_is_reached():
    # L_D = 250: live 550 < 2.5 x 250, so w_r moves. Hot 450 >= 1.1 x 250 = 275: raise w_r.
    # Without the w_r term t2 has a = .5 + .5 - .5 = .5 and r = .4: hot while w_r <= 1.25;
    # 1.02^11 = 1.243 < 1.25 < 1.02^12 = 1.268, so after 12 steps t2 turns cold and the hot set
    # (t0 + t3 = 250 B) is inside [225, 275]: stop.
    w = dict(w_f=1.0, w_r=1.0, w_s=1.0, w_l=1.0)
    H, hot, it = adapt_weights(FEATS, SIZES, w, budget=250, live_bytes=550)
    assert it == 12 and w["w_r"] == pytest.approx(1.02 ** 12) and w["w_s"] == 1.0
    assert hot.tolist() == [True, False, False, True]
    # H = a - w_r * r: t0 2 - 0, t1 (0 + 0 - 1) - 1.268, t2 .5 - .4 x 1.268, t3 .5 - 0
    np.testing.assert_allclose(H, [2, -1 - 1.02 ** 12, .5 - .4 * 1.02 ** 12, .5])


def test_under_pressure_w_s_moves_and_a_skipped_band_stops_the_loop():
    # L_D = 200: live 550 >= 2.5 x 200, so w_s moves. Without the w_s term: t2 a = .5 + .5 - .4
    # = .6 with s = .5 (hot while w_s <= 1.2), t3 a = .6 + .1 = .7 with s = .2 (w_s <= 3.5).
    # Hot 450 >= 220: raise w_s. After 10 steps (1.02^10 = 1.219) t2 is cold: 250 >= 220,
    # still too hot. t3 turns cold after 64 steps (1.02^63 = 3.48 < 3.5 < 1.02^64 = 3.55): 100 B
    # <= 180 is too cold, and the next step would undo the last: the band lies between steps.
    w = dict(w_f=1.0, w_r=1.0, w_s=1.0, w_l=1.0)
    H, hot, it = adapt_weights(FEATS, SIZES, w, budget=200, live_bytes=550)
    assert it == 64 and w["w_s"] == pytest.approx(1.02 ** 64) and w["w_r"] == 1.0
    assert hot.tolist() == [True, False, False, False]


def test_too_cold_lowers_the_weight_and_an_unreachable_band_stops_at_once():
    # L_D = 600, live 550 < 1500: w_r. Hot 450 <= 540: lower w_r. t1 (a = -1) is never hot, so
    # the largest hot set any weight gives is 450 B <= 540: the band cannot be reached.
    w = dict(w_f=1.0, w_r=1.0, w_s=1.0, w_l=1.0)
    _, hot, it = adapt_weights(FEATS, SIZES, w, budget=600, live_bytes=550)
    assert it == 0 and w["w_r"] == 1.0 and hot.sum() == 3


def _three_kernels(steps=3):
    """W (8 KiB) lives across steps; per step: k0 reads W writes X; k1 reads X writes Y; X is
    freed; k2 reads Y and W and writes W; Y is freed after the step's last kernel."""
    return program([("alloc", "X", 20_000), ("kernel", ["W"], ["X"], 1 * MS),
                    ("alloc", "Y", 40_000), ("kernel", ["X"], ["Y"], 2 * MS),
                    ("free", "X"), ("kernel", ["Y", "W"], ["W"], 1 * MS), ("free", "Y")],
                   steps, init=[("W", 8192)])


def test_the_heat_table_counts_future_uses_and_reuse_distances():
    g = graph(_three_kernels())
    rows, _ = heat_table(g, budget=1e9)
    W, X, Y = (g.index[s] for s in "WXY")
    # k0: W and X alive, each used at k0 and once more: f = 2, r = 0.
    assert rows[0].idx.tolist() == [W, X]
    assert rows[0].f.tolist() == [2, 2] and rows[0].r.tolist() == [0, 0]
    # k1: W next used at k2 (r = 1, f = 1); X at k1 (r = 0, f = 1); Y at k1 and k2 (f = 2).
    assert rows[1].idx.tolist() == [W, X, Y]
    assert rows[1].f.tolist() == [1, 1, 2] and rows[1].r.tolist() == [1, 0, 0]
    # k2: X is freed; W and Y used now and never again in the step.
    assert rows[2].idx.tolist() == [W, Y] and rows[2].f.tolist() == [1, 1]
    # lifetimes: W the whole step (3 kernels), X 2, Y 2 (freed after the last kernel)
    assert g.lifetime()[[W, X, Y]].tolist() == [3, 2, 2]


# ---- the Aggregator -------------------------------------------------------------------------

def _aggregator_trace():
    """Small residents S1 (1 KiB, 3 uses), S2 (2 KiB, 3 uses), S3 (4 KiB, 2 uses), S4 (4 KiB,
    1 use), S5 (5000 B, 3 uses); k0 makes L1, L2, L3 (10 kB each), used again at k3, k2 and
    k4, k2 and k2 respectively; a layer mark after every kernel."""
    init = [("S1", 1024), ("S2", 2048), ("S3", 4096), ("S4", 4096), ("S5", 5000)]
    body = [("alloc", "L1", 10_000), ("alloc", "L2", 10_000), ("alloc", "L3", 10_000),
            ("kernel", ["S1", "S2", "S3", "S4", "S5"], ["L1", "L2", "L3"], MS), ("layer",),
            ("kernel", ["S1", "S2", "S5"], [], MS), ("layer",),
            ("kernel", ["S1", "S2", "S3", "S5", "L2", "L3"], [], MS), ("layer",),
            ("kernel", ["L1"], [], MS), ("layer",),
            ("kernel", ["L2"], [], MS), ("free", "L1"), ("free", "L2"), ("free", "L3")]
    return program(body, init=init)


def test_batching_fills_the_slab_by_access_count_then_size():
    g = graph(_aggregator_trace())
    # Candidates (<= 4 KiB, >= 2 uses): S1 (3 uses), S2 (3), S3 (2); S4 has 1 use, S5 is too
    # big. Order: S2 (3 uses, 2 KiB), S1 (3, 1 KiB), S3 (2). A 4000 B reserve takes S2 and S1
    # (3072 B, both alive all step); S3 would make 7168 B.
    agg = Aggregator(g, reserve=4000)
    assert [g.sids[i] for i in agg.slab_order] == ["S2", "S1"]
    assert agg.slab_peak == 3072
    assert [g.sids[i] for i in np.flatnonzero(agg.member)] == ["S1", "S2"]
    assert [g.sids[i] for i in Aggregator(g, reserve=8000).slab_order] == ["S2", "S1", "S3"]


def test_adjoining_orders_a_kernels_new_tensors_by_reuse_distance_then_frequency():
    g = graph(_aggregator_trace())
    agg = Aggregator(g, reserve=0)
    # After k0: L1 next used at k3 (r = 2 from k1), uses left 1; L2 at k2 (r = 1), uses left
    # 2 (k2, k4); L3 at k2 (r = 1), uses left 1. Ascending r, ties ascending f: L3, L2, L1.
    assert [g.sids[i] for i in agg.adjoin[0]] == ["L3", "L2", "L1"]
    L1, L2, L3 = (g.index[s] for s in ("L1", "L2", "L3"))
    fast = np.zeros(g.objects, dtype=bool)
    # At k1 L2 and L3 are both 1 kernel from their next use: moving L3 in takes L2 along,
    # not L1 (2 kernels away).
    assert agg.neighbours(L3, 1, fast, True) == [L2]
    assert agg.neighbours(L1, 1, fast, True) == []
    fast[L2] = True                     # a neighbour already in DRAM does not move in again
    assert agg.neighbours(L3, 1, fast, True) == []


# ---- the greedy placement by heat and the refinement -----------------------------------------

def _abc_trace():
    """Residents A, B, C (100 kB each); k0 reads A, k1 reads B, k2 reads C, k3 reads A, 1 ms."""
    body = [("kernel", [s], [], MS) for s in "ABCA"]
    return program(body, init=[(s, 100_000) for s in "ABC"])


def test_greedy_keeps_operands_then_hot_tensors_already_in_dram():
    g = graph(_abc_trace())
    A, B, C = (g.index[s] for s in "ABC")
    agg = Aggregator(g, 0)
    model = CostModel(g, 200_000)
    idx = np.array([A, B, C])
    # Heat by hand: A stays hot (H .5), B and C cold (H -.2, -.3) at every kernel.
    H = np.array([.5, -.2, -.3])
    heat = [HeatRow(idx, H, H >= 0, np.zeros(3), np.zeros(3)) for _ in range(4)]
    P = plan_greedy(g, heat, agg, 200_000, model, alpha=0)
    # Pass 1 from an empty DRAM: k0 {A}; k1 operand B, then A (hot, in DRAM): {A, B};
    # k2 operand C, then A: B (cold) leaves: {A, C}; k3 A: C leaves. Pass 2 starts with {A}
    # and gives the same.
    assert [[g.sids[i] for i in np.flatnonzero(row)] for row in P] == \
        [["A"], ["A", "B"], ["A", "C"], ["A"]]


def test_the_refiner_brings_a_tensor_early_where_the_budget_allows():
    g = graph(_abc_trace())
    A, B, C = (g.index[s] for s in "ABC")
    agg = Aggregator(g, 0)
    model = CostModel(g, 200_000)
    P = np.zeros((4, 3), dtype=bool)
    P[:, A] = True
    P[1, B] = P[2, C] = True
    out = Refiner(g, agg, model, 200_000).refine(P, lead=2.0)
    # Keep: B's stay in PM wraps from k2 to k0 (3 kernels) and would need 300 kB at k2: no.
    # Bring early: B's copy takes 100 kB / 30 GB/s = 3.3 us, so 6.7 us of compute ahead:
    # k0 (1 ms, room 100 kB + 100 kB <= 200 kB) suffices. C cannot come at k1 (A + B full).
    assert out[:, B].tolist() == [True, True, False, False]
    assert out[:, C].tolist() == [False, False, True, False]
    t = to_table(g, out, agg, 200_000)
    # Moves: C leaves after k2, B after k1, B comes before k0 (after k3 of the step before),
    # C before k2; no object is made in the step.
    assert [[[g.sids[i] for i in grp] for grp in t.ins[k]] for k in range(4)] == \
        [[["B"]], [], [["C"]], []]
    assert [[[g.sids[i] for i in grp] for grp in (*t.outs[k], *t.late[k])] for k in range(4)] \
        == [[], [], [["B"]], [["C"]]]
    assert t.status(g, 2) == {C: (0, 1), B: (1, 1)}


def test_a_refined_stay_without_a_use_is_pruned_and_a_short_gap_kept():
    g = graph(_abc_trace())
    A, B, C = (g.index[s] for s in "ABC")
    P = np.zeros((4, 3), dtype=bool)
    P[0, A] = P[3, A] = True             # A leaves for k1, k2 and comes back
    P[1, B] = True
    P[3, C] = True                       # C in DRAM at k3, which does not use it
    out = Refiner(g, Aggregator(g, 0), CostModel(g, 300_000), 300_000).refine(P, lead=0)
    assert not out[:, C].any()           # pruned
    assert out[:, A].all()               # the 2-kernel gap costs a copy in; 300 kB room
    # B's stay in PM (k2, k3 and, wrapping around the step, k0) is kept in DRAM too: A + B
    # need 200 kB at those kernels.
    assert out[:, B].all()
    tight = Refiner(g, Aggregator(g, 0), CostModel(g, 150_000), 150_000).refine(P, lead=0)
    # With 150 kB neither gap fits (A + B = 200 kB at k1 for A's, at k0 and k3 for B's); B's
    # last use is k1, so it leaves right after it: unchanged.
    assert tight[:, A].tolist() == [True, False, False, True]
    assert tight[:, B].tolist() == [False, True, False, False]


# ---- the cost model -------------------------------------------------------------------------

def _cost_graph():
    """Residents A (300 kB), B (110 kB), C (1 kB); k0 reads A, writes B (1 ms); k1 reads A and
    B (2 ms); k2 writes C (1 ms)."""
    return graph(program([("kernel", ["A"], ["B"], MS), ("kernel", ["A", "B"], [], 2 * MS),
                          ("kernel", [], ["C"], MS)],
                         init=[("A", 300_000), ("B", 110_000), ("C", 1000)]))


def test_the_cost_model_charges_pm_operands_and_exposed_copies_by_hand():
    g = _cost_graph()
    A, B, C = (g.index[s] for s in "ABC")
    t = Table.empty(g)
    t.start[B] = True                    # B in DRAM, A and C in PM
    t.ins[1], t.outs[1] = [[A]], [[B]]   # before k1: bring A, send B (dirty: k0 wrote it)
    t.want[1] = [A]
    cost = CostModel(g, 1e6).run(t, rounds=1)
    read = 1 / 30e9 - 1 / 110e9          # optane vs dram read, s/B
    k0 = MS + 300_000 * read             # A read from PM
    # Before k1 (t = k0): A comes in (300 kB / 30 GB/s = 10 us) and B goes out (110 kB /
    # 11 GB/s = 10 us), both from t; k1 waits 10 us for both, then reads B from PM.
    k1 = 10e-6 + 2 * MS + 110_000 * read
    # k2 writes C in PM: at least twice its compute (write penalty 1 kB x (1/11 - 1/60) ns
    # is less than 1 ms).
    k2 = 2 * MS
    assert cost.total == pytest.approx(k0 + k1 + k2, rel=1e-12)
    assert cost.exposed == pytest.approx(10e-6)
    assert cost.compute == pytest.approx(4 * MS)
    assert cost.penalty == pytest.approx(300_000 * read + 110_000 * read + MS)
    assert (cost.moved_in, cost.moved_out) == (300_000, 110_000)
    # The next step starts where this one ended: A in DRAM, B in PM. Nothing moves; k0 now
    # writes B in PM (1 ms more) and k1 reads it there.
    again = CostModel(g, 1e6).run(t, rounds=2)
    assert again.moved_in == again.moved_out == 0 and again.exposed == 0
    assert again.penalty == pytest.approx(MS + 110_000 * read + MS)


def test_sync_migration_waits_for_every_copy_and_c_normal_spans_dram_to_pm():
    g = _cost_graph()
    A, B, _ = (g.index[s] for s in "ABC")
    t = Table.empty(g)
    t.start[B] = True
    t.ins[1] = [[A]]
    model = CostModel(g, 1e6, sync=True)
    cost = model.run(t, rounds=1)
    read = 1 / 30e9 - 1 / 110e9
    assert cost.total == pytest.approx(MS + 300_000 * read + 10e-6 + 2 * MS + 2 * MS)
    assert cost.exposed == pytest.approx(10e-6)
    # C_min: all in DRAM, 4 ms. C_max: all in PM: k0 writes B in PM: max(reads + writes, 1 ms)
    # = 1 ms extra; k1 reads 410 kB from PM; k2 1 ms extra.
    assert model.c_min == pytest.approx(4 * MS)
    assert model.c_max == pytest.approx(4 * MS + MS + 410_000 * read + MS)
    assert model.normal(model.c_min) == 0 and model.normal(model.c_max) == pytest.approx(1)


# ---- the DQN --------------------------------------------------------------------------------

def test_the_exploit_probability_rises_from_0_1_to_1_over_three_quarters_of_training():
    assert exploit_probability(0, 200) == pytest.approx(0.1)
    assert exploit_probability(75, 200) == pytest.approx(0.55)
    assert exploit_probability(150, 200) == 1.0 == exploit_probability(199, 200)


def test_the_agent_learns_a_bandit_and_the_same_seed_gives_the_same_weights():
    def train(seed):
        agent = Agent(inputs=3, lr=1e-2, seed=seed)
        rng = np.random.default_rng(1)
        for _ in range(300):
            s = rng.random(3)
            a = agent.act(s, exploit=0.0)            # explore: uniform actions
            agent.remember(s, a, 1.0 if a == 0 else 0.0, None, True)
            agent.learn()
        return agent

    a, b, c = train(7), train(7), train(8)
    assert np.array_equal(a.net.flat, b.net.flat) and not np.array_equal(a.net.flat, c.net.flat)
    assert a.memory.size == 100 and a.updates == 300 - 31
    q = a.net.q(np.random.default_rng(2).random((20, 3)))
    assert (q[:, 0] > q[:, 1]).all()                  # action 0 pays 1, action 1 nothing
    assert a.losses[-1] < a.losses[0]


def test_dqn_training_on_a_small_graph_is_deterministic_and_keeps_its_best_episode():
    g = graph(_three_kernels())
    agg = Aggregator(g, 0)
    budget = 50_000                      # live bytes reach 68 kB: k1 is a bottleneck kernel
    model = CostModel(g, budget)
    heat, _ = heat_table(g, budget)
    P1, info1 = deeptm.plan_dqn(g, heat, agg, model, budget, episodes=12, seed=3)
    P2, info2 = deeptm.plan_dqn(g, heat, agg, model, budget, episodes=12, seed=3)
    assert np.array_equal(P1, P2) and info1 == info2
    assert len(info1["rewards"]) == 13               # 12 episodes and the greedy rollout
    assert info1["best_episode"] is not None and info1["best_r_epi"] <= deeptm.R_FIX
    assert info1["steps_per_episode"] > 0
    assert (P1.astype(float) @ g.size <= budget).all()


# ---- the policy -----------------------------------------------------------------------------

def test_options_are_checked():
    for bad, match in [(dict(mode="ilp"), "mode="), (dict(beta=1.5), "beta="),
                       (dict(beta="x"), "beta="), (dict(episodes=0), "episodes="),
                       (dict(seed=1.5), "seed="), (dict(candidates=0), "candidates="),
                       (dict(migration="eager"), "migration="), (dict(slab=1.0), "slab="),
                       (dict(headroom=0), "headroom="), (dict(adjoin=1), "adjoin="),
                       (dict(profile_step=-1), "profile_step")]:
        with pytest.raises(ValueError, match=match):
            DeepTM(**bad)
    with pytest.raises(TypeError, match="profile must be"):
        DeepTM(profile=3)
    with pytest.raises(ValueError, match="target="):
        deeptm.smallest_budget(_abc_trace(), target=0)


def tiny_cnn():
    """A traced ResNet-18 of width 8 on 16 px images, 4 steps."""
    from cachedarrays.models import cnn
    from cachedarrays.models.cnn.core import Session
    model = cnn.build("resnet", 18, batch=2, image=16, classes=10, width=8)
    with ca.Manager(fast=64 << 20, slow=1 << 20, policy="fastonly") as m:
        s = Session(m, "numpy")
        model.init(s)
        x, y = cnn.synthetic_batch(model)
        with ca.trace(m) as t:
            for _ in range(4):
                cnn.train_step(s, model, x, y, cnn.SGD(1e-3))
    return t


@pytest.fixture(scope="module")
def cnn_trace():
    return tiny_cnn()


def test_replays_of_a_small_cnn_are_deterministic_and_beat_lru(cnn_trace):
    runs = [ca.replay(cnn_trace, DeepTM(), fast=0.25, profile="optane") for _ in range(2)]
    assert runs[0].decisions == runs[1].decisions
    lru = ca.replay(cnn_trace, "lru", fast=0.25, profile="optane")
    assert runs[0].ratio < lru.ratio
    dqn = [ca.replay(cnn_trace, DeepTM(mode="dqn", episodes=2, candidates=2), fast=0.25,
                     profile="optane") for _ in range(2)]
    assert dqn[0].decisions == dqn[1].decisions and math.isfinite(dqn[0].ratio)


def test_a_graph_too_large_for_the_dqn_is_planned_greedily(cnn_trace, monkeypatch):
    monkeypatch.setattr(deeptm, "DQN_LIMIT", 10)
    p = DeepTM(mode="dqn")
    run = ca.replay(cnn_trace, p, fast=0.25, profile="optane")
    assert p.info["dqn"].startswith("too large") and "mode='greedy'" in p.info["dqn"]
    assert run.decisions == ca.replay(cnn_trace, DeepTM(), fast=0.25,
                                      profile="optane").decisions


def test_a_smaller_beta_buys_less_dram(cnn_trace):
    rows = deeptm.beta_curve(cnn_trace, betas=(0.25, 1.0), fast=1.0)
    cheap, fastest = rows
    assert (cheap.beta, fastest.beta) == (0.25, 1.0)
    assert cheap.dram_bytes < fastest.dram_bytes and cheap.cost < fastest.cost
    assert fastest.ratio <= cheap.ratio


def test_the_smallest_budget_reaching_a_share_of_fast_only_speed(cnn_trace):
    grid = (0.05, 0.1, 0.25, 1.0)
    ratios = {x: ca.replay(cnn_trace, DeepTM(), fast=x, profile="optane").ratio for x in grid}
    for target in (0.9, 0.99):
        f = deeptm.smallest_budget(cnn_trace, target=target, grid=grid)
        assert f in grid and ratios[f] <= 1 / target
        assert all(ratios[x] > 1 / target for x in grid if x < f)
    assert deeptm.smallest_budget(cnn_trace, target=0.99, grid=grid) > grid[0]


def test_a_real_run_keeps_the_data_and_follows_the_plan():
    p = DeepTM()
    with ca.Manager(fast="600KiB", slow="16MiB", policy=p) as m:
        w = [ca.asarray(np.full(20_000, float(j)), manager=m) for j in range(4)]   # 160 kB
        for _ in range(4):
            acts, x = [], ca.full(20_000, 1.0, manager=m)
            for j in range(4):
                y = ca.empty(20_000, manager=m)
                with ca.kernel("fwd", (x, w[j]), (y,)) as (a, b, c):
                    c[:] = a + b
                ca.mark_layer(m)
                acts.append(y)
                x = y
            for j in reversed(range(4)):
                g = ca.empty(20_000, manager=m)
                with ca.kernel("bwd", (acts[j],), (g,)) as (a, c):
                    c[:] = a * 0.5
                with ca.kernel("sgd", (g,), (w[j],)) as (a, c):
                    c[:] = c + 0.0 * a
                del g
                ca.mark_layer(m)
            del acts, x, y
            ca.mark_step(m)
        assert p.planned and p.table is not None and p.info["moves"] > 0
        for j in range(4):
            with ca.readable(w[j]) as v:
                assert (v == j).all()
        stats = m.stats()
        assert stats["moved"]["slow->fast"]["bytes"] > 0
        m.check()
