"""DeepTM: tensor heat, a cost model and a DQN decide where tensors live (TPDS'24).

The paper profiles a training step's static graph: per tensor its size s_t and lifetime l_t,
per (tensor, kernel) its future access frequency f_t^k and future reuse distance r_t^k. Its
heat H_t = f·w_f − r·w_r − s·w_s + l·w_l (min-max normalised features, weights from 1) marks
tensors hot at H_t ≥ 0; Alg. 1 rescales w_s (live bytes ≥ 2.5 L_D) or w_r by 2% until the hot
set holds 0.9–1.1 L_D. An optimizer fills a status table a(k, t) = (placement, move) that
minimises C_total = C_e + C_m under Σ(1−p)·s ≤ L_D: a DQN (state [p_t, H_t, D_left, P_left],
reward s_t/Σs − m_nor, episode reward weighing time against the memory's price by β) or, in
the paper's ablation, a greedy placement by heat. An Aggregator batches tensors ≤ 4 KiB into a
reserved DRAM area and adjoins large long-lived tensors by reuse distance, so that a migration
also moves its neighbours with the same distance.

Here the profile is the ``StepProfile`` of a planned step. ``Graph`` indexes it; ``heat_table``
runs Alg. 1 before every kernel; ``Aggregator`` picks the slab and the adjoin groups;
``CostModel`` is a fast simulator of C_e + C_m over the step (``cachedarrays.costmodel``'s
kernel rules and link serialisation, with the devices' profiles). The optimizer —
``plan_greedy`` (mode "greedy") or ``plan_dqn`` (mode "dqn", network in ``policies/dqn.py``) —
decides the placement P[k, t]; the ``Refiner`` then applies the cost model to it (no move
that buys nothing, no round trip where the budget allows keeping a tensor, a tensor leaves
right after its last use and comes back early enough to hide its copy, and again earlier where
the simulator still sees a kernel wait); ``to_table`` turns it into the status table. The
policy runs the table: each new object fast or slow by ``alloc_plan``; after kernel k−1,
``bring`` (in the background) for what kernel k and later need, ``send`` for what leaves;
after kernel k's new objects are placed, ``send`` for dirty tensors whose room they did not
need (else the allocator reuses that room at once and the new object waits for the
write-back).

What differs, and why:

- No pages. The manager places whole regions, so batching cannot share cache lines and
  adjoining cannot make regions contiguous: the slab is a share of the fast budget that its
  members never leave, and adjoin groups decide which tensors move together. The manager has
  no batched multi-region copy: a group's moves are issued back to back, each region still
  one copy record (the cost model charges a per-copy latency only on devices whose profile
  has one).
- Kernel times under each placement come from the cost model, not from timing every DRAM/PM
  combination of operands four times.
- The greedy keeps in DRAM a kernel's operands (the cheapest subset by the cost model when
  they do not fit) and the hot tensors already there; cold tensors leave. A hot tensor in PM
  comes in for its next use rather than as soon as it turns hot: on our traces that moved
  2-3x the bytes for a worse time.
- The plan fills ``headroom`` (80%) of fast memory: the real heap fragments, and a fuller plan
  waited for copies into freed room more than the simulator (which counts bytes, not blocks)
  predicts.
- β: Eq. 13 as printed adds P_normal (Eq. 12), which grows with the price, so a smaller β
  would buy more DRAM, against the paper's Fig. 16 (β = 0.25 is its cheapest). Here the price
  term is the saving 1 − P_normal (still without R_fix): R_epi = β·R_fix·(1 − C_normal) +
  (1 − β)·(1 − P_normal). The greedy mode picks its DRAM budget from a grid of tenths by the
  same objective.
- The DQN decides, at each kernel whose live bytes exceed L_D, the placement of a fixed number
  of candidate tensors (the kernel's operands first, then by heat; tensors larger than L_D
  are not candidates); the others keep their place unless room is needed (coldest first). Its
  state adds to the paper's [p_t, H_t, D_left, P_left] the tensor's size (for the capacity)
  and whether kernel k uses it (the step reward depends on it), then [p, H, s] of the other
  candidates; m_nor is the share of the kernel's window a copy is exposed beyond (Eq. 5), at
  most 1; an OOM ends the episode with −R_fix. It trains for ``episodes`` (default 40, the
  paper 200) with the paper's schedule, replay memory, batch, learning rate and γ. The plan
  kept is the best episode (by reward) of training and of a final greedy rollout. Graphs
  with more than ``DQN_LIMIT`` kernels × tensors are too large for a NumPy DQN: mode "dqn"
  then plans greedily and says so in ``info["dqn"]`` (and the log).
"""

import logging
import math
from bisect import bisect_left
from dataclasses import dataclass, field

import numpy as np

from .. import costmodel
from ..registry import register_policy
from .dqn import Agent, exploit_probability
from .planned import PlannedPolicy

__all__ = ["DeepTM", "Graph", "HeatRow", "Aggregator", "CostModel", "Cost", "Table", "Refiner",
           "Environment", "heat_table", "adapt_weights", "choose_operands", "plan_greedy",
           "plan_dqn", "to_table", "episode_reward", "beta_curve", "BetaRow", "smallest_budget",
           "PRICE_DRAM", "PRICE_PM", "R_FIX", "DQN_LIMIT"]

log = logging.getLogger(__name__)

PAGE = 4096                  # the batching threshold (one page)
PRICE_DRAM = 23.81           # $/GB (paper §VI-D)
PRICE_PM = 7.85              # $/GB
R_FIX = 50.0                 # Table II
BAND = (0.9, 1.1)            # Alg. 1: the hot set should hold 0.9-1.1 L_D
PRESSURE = 2.5               # Alg. 1: live bytes >= 2.5 L_D -> adjust w_s, else w_r
STEP = 0.02                  # Alg. 1: weights move by 2% per iteration
DQN_LIMIT = 100_000          # kernels x tensors of the largest graph mode "dqn" trains on
LEADS = (1.0, 2.0, 4.0)      # bring-early leads (x copy time) the cost model chooses from
HOISTS = 4                   # rounds of bringing earlier what the cost model saw waited for
_GB = 1e9


# ---- the profile ------------------------------------------------------------------------------

class Graph:
    """A StepProfile as arrays: objects 0..N-1 (residents first, then allocations in order)
    with size, start/end kernel, sorted uses; per kernel its operands and allocations."""

    def __init__(self, step):
        self.step = step
        n = self.n = len(step)
        order = list(dict.fromkeys([*step.resident, *(a[0] for a in step.allocs)]))
        known = set(order)
        order += sorted(s for s in step.objects if s not in known)
        self.sids = order
        self.index = {s: i for i, s in enumerate(order)}
        N = len(order)
        self.size = np.array([step.objects[s] for s in order], dtype=np.float64)
        life = [step.lifetime(s) for s in order]
        self.start = np.array([a for a, _ in life], dtype=np.int64)
        self.end = np.array([f for _, f in life], dtype=np.int64)
        self.resident = np.array([s not in step.alloc_at for s in order])
        self.survivor = np.array([s not in step.free_at for s in order])
        self.persistent = self.resident & self.survivor
        self.uses = [sorted({k for k, _ in step.uses.get(s, ())}) for s in order]
        self.times = np.array(step.times, dtype=np.float64)
        self.ops = []                 # per kernel: (i, bytes touched, is_write)
        self.operands = []            # per kernel: object indices, each once
        for k, (name, reads, writes) in enumerate(step.kernels):
            view = name == "view"
            ops = [(self.index[s], 0 if view else step.operand_bytes(k, s), False) for s in reads]
            ops += [(self.index[s], step.operand_bytes(k, s), True) for s in writes]
            self.ops.append(ops)
            self.operands.append(list(dict.fromkeys(i for i, _, _ in ops)))
        self.allocs_at = [[] for _ in range(n + 1)]
        self.frees_at = [[] for _ in range(n + 1)]
        for i in range(N):
            if not self.resident[i]:
                self.allocs_at[min(self.start[i], n)].append(i)
            if not self.survivor[i]:
                self.frees_at[min(self.end[i], n)].append(i)
        self.ordinal = {self.index[s]: j for j, (s, _, _) in enumerate(step.allocs)}
        layers = step.layer_of if step.layers > 1 else list(range(n))
        self.layer_of = np.array(layers + [layers[-1] if layers else 0], dtype=np.int64)
        self.live_bytes = np.array(step.live_bytes(), dtype=np.float64) if n else np.zeros(0)

    def __len__(self):
        return self.n

    @property
    def objects(self):
        return len(self.sids)

    def lifetime(self):
        """l_t: kernels each object is alive in the step."""
        return (self.end - self.start).astype(np.float64)

    def long_lived(self, i):
        """Alive in more than one layer (kernels stand for layers in traces without marks)."""
        a, f = self.start[i], max(self.start[i], self.end[i] - 1)
        return self.layer_of[min(a, self.n)] != self.layer_of[min(f, self.n)]


def _normalise(x):
    lo, hi = (x.min(), x.max()) if len(x) else (0.0, 0.0)
    return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)


def adapt_weights(feats, sizes, weights, budget, live_bytes, max_iter=200):
    """Alg. 1 at one kernel. feats: normalised (f, r, s, l) arrays of the live tensors;
    weights: dict w_f, w_r, w_s, w_l (updated in place: they carry to the next kernel).
    Rescales w_s (live bytes >= 2.5 L_D) or w_r by (1 ± 0.02) while the hot set (H >= 0) is
    outside [0.9, 1.1]·L_D; stops after max_iter steps, when a step would reverse the last one
    (the band lies between two steps) or when no weight can reach the band. Returns (H, hot,
    iterations)."""
    f, r, s, l = feats
    key = "w_s" if live_bytes >= PRESSURE * budget else "w_r"
    x = s if key == "w_s" else r
    a = f * weights["w_f"] + l * weights["w_l"]
    a = a - (r * weights["w_r"] if key == "w_s" else s * weights["w_s"])
    pos = x > 0
    const = float(sizes[~pos & (a >= 0)].sum())
    crit = a[pos] / x[pos]                       # hot while the weight is <= crit
    order = np.argsort(crit, kind="stable")
    crit = crit[order]
    suffix = np.concatenate([np.cumsum(sizes[pos][order][::-1])[::-1], [0.0]])
    lo_band, hi_band = BAND[0] * budget, BAND[1] * budget

    def hot_bytes(w):
        return const + suffix[bisect_left(crit, w)] if len(crit) else const

    most = hot_bytes(np.nextafter(0.0, 1.0))     # the largest hot set any weight gives
    w = weights[key]
    sh, last, it = hot_bytes(w), 0, 0
    while (sh >= hi_band or sh <= lo_band) and it < max_iter:
        d = 1 if sh >= hi_band else -1
        if d != last and last:
            break
        if (d < 0 and most <= lo_band) or (d > 0 and const >= hi_band):
            break
        w *= (1 + STEP) if d > 0 else (1 - STEP)
        sh, last, it = hot_bytes(w), d, it + 1
    weights[key] = w
    H = a - w * x
    return H, H >= 0, it


@dataclass
class HeatRow:
    """One kernel's live tensors (slab excluded) with their heat and raw features."""

    idx: np.ndarray
    H: np.ndarray
    hot: np.ndarray
    f: np.ndarray
    r: np.ndarray
    iterations: int = 0


def heat_table(g, budget, exclude=None, max_iter=200):
    """Alg. 1 over the step: a HeatRow per kernel. f = uses from kernel k on, r = kernels to
    the next use (for objects alive at the step's end, the first use of the next step; never
    used again: 2n), s = bytes, l = kernels alive; the weights carry from kernel to kernel."""
    n, N = g.n, g.objects
    rem = np.array([len(u) for u in g.uses], dtype=np.float64)
    ptr = np.zeros(N, dtype=np.int64)
    far = np.array([(u[0] + n if (g.survivor[i] and u) else 2 * n) for i, u in enumerate(g.uses)],
                   dtype=np.float64)
    nxt = np.array([u[0] if u else far[i] for i, u in enumerate(g.uses)], dtype=np.float64)
    life = g.lifetime()
    live = g.resident.copy()
    skip = np.zeros(N, dtype=bool) if exclude is None else exclude
    weights = {"w_f": 1.0, "w_r": 1.0, "w_s": 1.0, "w_l": 1.0}
    rows = []
    for k in range(n):
        live[g.allocs_at[k]] = True
        live[g.frees_at[k]] = False
        idx = np.flatnonzero(live & ~skip)
        f, r = rem[idx], nxt[idx] - k
        feats = (_normalise(f), _normalise(r), _normalise(g.size[idx]), _normalise(life[idx]))
        H, hot, it = adapt_weights(feats, g.size[idx], weights, budget, g.live_bytes[k], max_iter)
        rows.append(HeatRow(idx, H, hot, f, r, it))
        for i in g.operands[k]:
            u = g.uses[i]
            ptr[i] += 1
            rem[i] -= 1
            nxt[i] = u[ptr[i]] if ptr[i] < len(u) else far[i]
    return rows, weights


# ---- the Aggregator ---------------------------------------------------------------------------

class Aggregator:
    """Batching: objects <= 4 KiB with >= 2 accesses, by access count (descending; ties by
    size, descending), fill a fast slab of ``reserve`` bytes and never leave it. Adjoining:
    large long-lived objects, grouped by the kernel that allocates them (residents: one group,
    as of kernel 0), ordered by ascending reuse distance after that kernel, ties by ascending
    future frequency."""

    def __init__(self, g, reserve):
        self.g = g
        small = [i for i in range(g.objects) if g.size[i] <= PAGE and len(g.uses[i]) >= 2]
        small.sort(key=lambda i: (-len(g.uses[i]), -g.size[i], i))
        self.slab_order = []
        self.member = np.zeros(g.objects, dtype=bool)
        delta = np.zeros(g.n + 1)
        for i in small:                         # admit while the slab's peak fits the reserve
            a, f = min(g.start[i], g.n), min(max(g.end[i], g.start[i] + 1), g.n)
            trial = delta.copy()
            trial[a] += g.size[i]
            trial[f] -= g.size[i]
            if np.cumsum(trial)[:g.n].max(initial=0.0) <= reserve:
                delta = trial
                self.slab_order.append(i)
                self.member[i] = True
        self.slab_peak = float(np.cumsum(delta)[:g.n].max(initial=0.0)) if g.n else 0.0
        self.group = np.full(g.objects, -1, dtype=np.int64)
        self.adjoin = {}                        # group -> object indices in adjoin order
        self.rank = np.zeros(g.objects, dtype=np.int64)     # place in its group
        by_kernel = {}
        for i in range(g.objects):
            if g.size[i] > PAGE and not self.member[i] and g.long_lived(i):
                by_kernel.setdefault(-1 if g.resident[i] else int(g.start[i]), []).append(i)
        for k, members in sorted(by_kernel.items()):
            at = k + 1                          # the reuse after the kernel that makes them
            members.sort(key=lambda i: (_distance(g, i, at), _frequency(g, i, at), i))
            self.adjoin[k] = members
            self.group[members] = k
            self.rank[members] = np.arange(len(members))

    def neighbours(self, i, k, fast, moving_in):
        """Members of i's adjoin group with i's reuse distance at kernel k and i's placement
        (the contiguous range a migration of i takes along), in adjoin order, i excluded."""
        grp = self.group[i]
        if grp < 0:
            return []
        g, d = self.g, _distance(self.g, i, k)
        return [j for j in self.adjoin[grp] if j != i and fast[j] != moving_in
                and g.start[j] <= k < g.end[j] and _distance(g, j, k) == d]


def _frequency(g, i, k):
    """f_t^k: uses of i from kernel k on."""
    return len(g.uses[i]) - bisect_left(g.uses[i], k)


def _distance(g, i, k):
    """r_t^k: kernels from k to i's next use (2n when it has none)."""
    u = g.uses[i]
    j = bisect_left(u, k)
    return u[j] - k if j < len(u) else 2 * g.n


# ---- the status table and the cost model -------------------------------------------------------

@dataclass
class Table:
    """The status table a(k, t) as transitions: before kernel k, ``outs[k]`` move DRAM→PM and
    ``ins[k]`` PM→DRAM (each a list of groups issued back to back), then the objects kernel k
    makes are placed (``alloc_fast[i]``: object i is allocated in DRAM), then ``late[k]`` move
    DRAM→PM; ``want[k]``: operands of kernel k planned in DRAM; ``start``: objects in DRAM
    when the step begins."""

    n: int
    start: np.ndarray
    alloc_fast: np.ndarray
    outs: list = field(default_factory=list)
    ins: list = field(default_factory=list)
    want: list = field(default_factory=list)
    late: list = field(default_factory=list)

    @classmethod
    def empty(cls, g):
        N = g.objects
        return cls(g.n, np.zeros(N, bool), np.zeros(N, bool), [[] for _ in range(g.n)],
                   [[] for _ in range(g.n)], [[] for _ in range(g.n)], [[] for _ in range(g.n)])

    def status(self, g, k):
        """{object: (placement 0 DRAM / 1 PM, moved 0/1)} of kernel k's operands and of the
        objects moved before it (the paper's a(k, t))."""
        moved = {i for grp in (*self.ins[k], *self.outs[k], *self.late[k]) for i in grp}
        fast_ops = set(self.want[k])
        out = {i: (0 if i in fast_ops else 1, int(i in moved)) for i in g.operands[k]}
        for grp in self.ins[k]:
            out.update({i: (0, 1) for i in grp})
        for grp in (*self.outs[k], *self.late[k]):
            out.update({i: (1, 1) for i in grp})
        return out

    def moves(self):
        return sum(len(grp) for groups in (*self.ins, *self.outs, *self.late) for grp in groups)


@dataclass
class Cost:
    """The modelled cost of a table over one step (seconds, bytes)."""

    total: float
    compute: float
    penalty: float
    exposed: float
    moved_in: float
    moved_out: float
    peak_fast: float

    @property
    def c_e(self):
        return self.compute + self.penalty

    @property
    def c_m(self):
        return self.exposed


class CostModel:
    """C_total = C_e + C_m of a Table over a Graph (the rules of ``cachedarrays.costmodel``):

    - C_e: kernel k takes c_k + P_k, where P_k charges each operand in PM its touched bytes at
      1/R(PM) − 1/R(DRAM) (reads) or 1/W(PM) − 1/W(DRAM) (writes), and a written operand in PM
      makes the kernel at least ``slow_output_factor`` times c_k.
    - C_m: a move of s bytes takes latency + s/B on its link (B = min(R(src), W(dst))), copies on
      one link run one after another; async, a move starts when issued (after the previous
      kernel) and only the part a kernel waits for is exposed; sync, every move is waited for
      (Σ m·s/B). A DRAM→PM move of a clean tensor that has a PM copy costs nothing.
    - Capacity: bytes leaving DRAM still occupy it until their copy ends (Eq. 7); a tensor
      placed into that space waits for the copy.
    """

    def __init__(self, g, budget, fast="dram", slow="optane",
                 slow_output_factor=costmodel.SLOW_OUTPUT_FACTOR, sync=False):
        fast, slow = costmodel.get_profile(fast), costmodel.get_profile(slow)
        self.g, self.budget, self.sync, self.F = g, float(budget), sync, float(slow_output_factor)
        rf, wf, rs, ws = (p * _GB for p in (fast.read_gbps, fast.write_gbps, slow.read_gbps,
                                            slow.write_gbps))
        lat = max(fast.latency, slow.latency)
        self.lat = lat
        self.bw_in, self.bw_out = min(rs, wf), min(rf, ws)
        self.read_pen, self.write_pen = 1 / rs - 1 / rf, 1 / ws - 1 / wf
        self.c_min = float(g.times.sum())
        self.c_max = float(sum(self.kernel_time(k, lambda i: False) for k in range(g.n)))

    def move_time(self, nbytes, into_fast=True):
        return self.lat + nbytes / (self.bw_in if into_fast else self.bw_out)

    def kernel_time(self, k, in_fast):
        """c_e^k under a placement (in_fast(i) -> bool)."""
        reads = writes = 0.0
        off_write = False
        for i, nb, w in self.g.ops[k]:
            if in_fast(i):
                continue
            if w:
                writes += nb * self.write_pen
                off_write = True
            else:
                reads += nb * self.read_pen
        c = self.g.times[k]
        return c + (max(reads + writes, (self.F - 1) * c) if off_write else reads)

    def normal(self, total):
        """C_normal (Eq. 11): total between all-DRAM (0) and all-PM (1) kernel times."""
        span = self.c_max - self.c_min
        return (total - self.c_min) / span if span > 0 else 0.0

    def run(self, table, rounds=2, log=None):
        """The Cost of the table's last round; earlier rounds set the step's starting state.
        log: a list that gets (k, object, seconds kernel k waited for it) of the last round."""
        g = self.g
        N, n = g.objects, g.n
        size = g.size
        fast = table.start.copy()
        dirty = np.zeros(N, dtype=bool)
        has_slow = np.ones(N, dtype=bool)
        ready = np.zeros(N)
        out_end = np.zeros(N)
        inflight = []                         # [end, bytes] of copies leaving DRAM
        st = {"t": 0.0, "lin": 0.0, "lout": 0.0, "waited": 0.0}
        used = float(size[fast].sum())
        for rnd in range(rounds):
            t0 = st["t"]
            st["waited"] = 0.0
            comp = pen = exposed = mi = mo = 0.0
            peak = used
            for k in range(n):
                for i in g.frees_at[k]:
                    if fast[i]:
                        fast[i] = False
                        used -= size[i]
                later = []                            # brings first, into free room
                for grp in table.ins[k]:
                    for i in grp:
                        if fast[i] or not g.start[i] <= k < g.end[i]:
                            continue
                        if used + size[i] <= self.budget:
                            mi += self._in(i, used, fast, dirty, has_slow, ready, out_end,
                                           inflight, st)
                            used += size[i]
                        else:
                            later.append(i)
                for grp in table.outs[k]:             # then sends
                    for i in grp:
                        if fast[i]:
                            mo += self._out(i, fast, dirty, has_slow, ready, out_end,
                                            inflight, st)
                            used -= size[i]
                for i in (*later, *table.want[k]):    # then what needed their room
                    if not fast[i] and g.start[i] <= k < g.end[i] and \
                            (g.resident[i] or g.start[i] < k):
                        mi += self._in(i, used, fast, dirty, has_slow, ready, out_end,
                                       inflight, st)
                        used += size[i]
                for i in g.allocs_at[k]:
                    if g.end[i] <= k or fast[i]:      # freed before any kernel ran
                        continue
                    if table.alloc_fast[i]:
                        ready[i] = self._room(size[i], used, inflight, st["t"])
                        fast[i], dirty[i], has_slow[i] = True, True, False
                        used += size[i]
                    else:
                        fast[i], has_slow[i] = False, True
                for grp in table.late[k]:              # sends after the new objects
                    for i in grp:
                        if fast[i]:
                            mo += self._out(i, fast, dirty, has_slow, ready, out_end,
                                            inflight, st)
                            used -= size[i]
                peak = max(peak, used)
                t = st["t"]
                w = t
                for i in g.operands[k]:
                    w = max(w, ready[i] if fast[i] else out_end[i])
                exposed += w - t
                if log is not None and w > t and rnd == rounds - 1:
                    log.extend((k, i, (ready[i] if fast[i] else out_end[i]) - t)
                               for i in g.operands[k]
                               if (ready[i] if fast[i] else out_end[i]) > t)
                c = self.kernel_time(k, fast.__getitem__)
                comp += g.times[k]
                pen += c - g.times[k]
                st["t"] = w + c
                for i, _, wr in g.ops[k]:
                    if wr and fast[i]:
                        dirty[i] = True
            if rnd == rounds - 1:
                return Cost(st["t"] - t0, comp, pen, exposed + st["waited"], mi, mo, peak)
            for i in (*g.frees_at[n], *g.allocs_at[n]):
                if fast[i]:
                    fast[i] = False
                    used -= size[i]
        raise ValueError("rounds must be >= 1")

    def _room(self, nbytes, used, inflight, t):
        """When nbytes fit in DRAM: now, or when enough copies leaving it have ended."""
        inflight[:] = [c for c in inflight if c[0] > t]
        over = used + nbytes + sum(c[1] for c in inflight) - self.budget
        if over <= 0:
            return t
        for end, nb in sorted(inflight):
            over -= nb
            if over <= 0:
                return end
        return t

    def _out(self, i, fast, dirty, has_slow, ready, out_end, inflight, st):
        fast[i] = False
        if has_slow[i] and not dirty[i]:
            return 0.0
        nb = self.g.size[i]
        start = max(st["t"], st["lout"], ready[i])
        end = start + self.move_time(nb, False)
        st["lout"] = out_end[i] = end
        inflight.append([end, nb])
        has_slow[i], dirty[i] = True, False
        if self.sync:
            st["waited"] += max(0.0, end - st["t"])
            st["t"] = max(st["t"], end)
        return nb

    def _in(self, i, used, fast, dirty, has_slow, ready, out_end, inflight, st):
        nb = self.g.size[i]
        start = max(st["t"], st["lin"], out_end[i], self._room(nb, used, inflight, st["t"]))
        end = start + self.move_time(nb, True)
        st["lin"] = ready[i] = end
        fast[i], dirty[i], has_slow[i] = True, False, True
        if self.sync:
            st["waited"] += max(0.0, end - st["t"])
            st["t"] = max(st["t"], end)
        return nb


# ---- the optimizers ---------------------------------------------------------------------------

def _price(dram_bytes, peak):
    """P_normal (Eq. 12) with L_D' = L_P' = the step's peak and PM holding the rest."""
    pm = max(peak - dram_bytes, 0.0)
    lo, hi = PRICE_PM * peak, PRICE_DRAM * peak
    return (PRICE_PM * pm + PRICE_DRAM * dram_bytes - lo) / (hi - lo) if hi > lo else 0.0


def episode_reward(cost, model, beta, peak):
    """R_epi = β·R_fix·(1 − C_normal) + (1 − β)·(1 − P_normal) (Eq. 13 with the price's
    saving, see the module docstring)."""
    c = model.normal(cost.total)
    return beta * R_FIX * (1 - c) + (1 - beta) * (1 - _price(cost.peak_fast, peak))


def _order_operands(g, k, H_of):
    """Kernel k's operands, most needed first: written ones (a written PM operand doubles the
    kernel), then reads by touched bytes per byte held, then heat."""
    touched = {}
    for i, nb, w in g.ops[k]:
        a, b = touched.get(i, (False, 0.0))
        touched[i] = (a or w, b + nb)
    return sorted(g.operands[k], key=lambda i: (not touched[i][0],
                                                -touched[i][1] / max(g.size[i], 1.0),
                                                -H_of.get(i, 0.0), i))


def choose_operands(model, k, ops, fast, dirty, budget, fresh, slab, limit=8):
    """The operands of kernel k to hold in DRAM when they do not all fit: the subset (of at
    most ``limit`` operands, else by the order given) with the least c_e^k plus the copies it
    implies (bringing a PM operand in, writing a dirty DRAM operand back before the kernel)."""
    size = model.g.size
    if sum(size[i] for i in ops) <= budget:
        return list(ops)
    if len(ops) > limit:
        out, room = [], budget
        for i in ops:
            if size[i] <= room:
                out.append(i)
                room -= size[i]
        return out
    best = None
    for mask in range(1 << len(ops)):
        chosen = [i for j, i in enumerate(ops) if mask >> j & 1]
        total = sum(size[i] for i in chosen)
        if total > budget:
            continue
        inside = set(chosen)
        cost = model.kernel_time(k, lambda i: i in inside or slab[i])
        for i in ops:
            if i in inside and not fast[i] and i not in fresh:
                cost += model.move_time(size[i], True)
            elif i not in inside and fast[i] and dirty[i]:
                cost += model.move_time(size[i], False)
        key = (cost, -total, mask)
        if best is None or key < best[0]:
            best = (key, chosen)
    return best[1] if best else []


def room_ahead(g, model, alpha=1.5):
    """Bytes to keep free before each kernel for the objects the next kernels allocate: the
    largest net demand (allocated minus freed bytes) over the kernels that start sooner than
    alpha times the time it takes to write that demand back to PM (what must be evicted
    early for the allocations not to wait for write-backs)."""
    n = g.n
    net = np.zeros(n + 1)
    for k in range(n):
        net[k] = sum(g.size[i] for i in g.allocs_at[k] if g.end[i] > k) - \
            sum(g.size[i] for i in g.frees_at[k])
    out = np.zeros(n)
    for k in range(n):
        demand, most, t = 0.0, 0.0, 0.0
        for u in range(k + 1, n):
            demand += net[u]
            most = max(most, demand)
            if t >= alpha * model.move_time(max(most, 0.0), False):
                break
            t += g.times[u]
        out[k] = most
    return out


def plan_greedy(g, heat, agg, budget, model, adjoin=True, alpha=1.5):
    """The paper's ablation, "place by heat": before each kernel, DRAM holds its operands (all,
    or the subset that fits with the least cost, see choose_operands), then the hot tensors
    already there by descending heat while they fit in ``budget`` less the room the next
    kernels' new objects need (room_ahead); cold tensors go to PM. A hot tensor in PM comes in
    for its next use, as early as the Refiner finds worthwhile, not as soon as it turns hot
    (that moved 2-3x the bytes). An operand that moves in takes its adjoin neighbours along.
    Two passes, the second starting from the first's end state; returns the placement P[k, t]
    (True: DRAM) of the second."""
    N, n = g.objects, g.n
    size = g.size
    slab = agg.member
    fast = np.zeros(N, dtype=bool)
    dirty = np.zeros(N, dtype=bool)
    P = np.zeros((n, N), dtype=bool)
    reserve = room_ahead(g, model, alpha) if alpha > 0 else np.zeros(n)
    for _ in range(2):
        for k in range(n):
            fast[g.frees_at[k]] = False
            row = heat[k]
            H_of = dict(zip(row.idx.tolist(), row.H.tolist()))
            new = g.allocs_at[k]
            fast[new] = False
            dirty[new] = True
            ops = [i for i in _order_operands(g, k, H_of) if not slab[i]]
            ops = choose_operands(model, k, ops, fast, dirty, budget, set(new), slab)
            rank = np.argsort(-row.H, kind="stable")
            by_heat = row.idx[rank]
            hot = [i for i in by_heat[row.hot[rank]].tolist() if fast[i]]
            target = np.zeros(N, dtype=bool)
            room = budget
            for i in ops:
                group = [i]
                if adjoin and not fast[i]:
                    group += agg.neighbours(i, k, fast, True)
                for j in group:
                    if size[j] <= room and not target[j] and not slab[j]:
                        target[j] = True
                        room -= size[j]
            room -= reserve[k]
            for i in hot:
                if not target[i] and size[i] <= room:
                    target[i] = True
                    room -= size[i]
            changed = row.idx[fast[row.idx] != target[row.idx]]
            dirty[changed] = False
            dirty[new] = True
            fast[row.idx] = target[row.idx]
            P[k] = fast
            P[k, slab] = True
            for i, _, w in g.ops[k]:
                if w and fast[i]:
                    dirty[i] = True
        fast[g.frees_at[n]] = False
        fast[g.allocs_at[n]] = False
    return P & _live_matrix(g)


def _live_matrix(g):
    """L[k, t]: object t is alive while kernel k runs."""
    k = np.arange(g.n)[:, None]
    return (g.start[None, :] <= k) & (k < g.end[None, :])


class Refiner:
    """The cost model's edits of a placement P[k, t] (shared by both optimizers):

    1. prune: a stay in DRAM without a use of the tensor moves it for nothing; it stays in PM;
    2. keep: a stay in PM between two stays in DRAM costs a copy in (and out, if dirty), and
       one after the last use, until the tensor is freed, a copy out for nothing (if dirty);
       keep the tensor in DRAM instead where the budget allows, shortest stays first;
    3. send early: a tensor leaving DRAM leaves right after its last use there;
    4. bring early: a tensor entering DRAM enters ``lead`` times its copy time (of compute)
       before its first use there, where the budget allows, earliest use first.

    A persistent tensor's placement wraps around the step (the step repeats)."""

    def __init__(self, g, agg, model, budget):
        self.g, self.agg, self.model, self.budget = g, agg, model, budget
        n, N = g.n, g.objects
        self.persistent = g.persistent
        self.used = np.zeros((n, N), dtype=bool)
        self.wrote = np.zeros((n, N), dtype=bool)
        for k, ops in enumerate(g.ops):
            for i, _, w in ops:
                self.used[k, i] = True
                self.wrote[k, i] |= w

    def seq(self, i):
        """Kernels of i's life in order (a persistent tensor's rotated to start a PM stay)."""
        g = self.g
        return np.arange(g.start[i], min(g.end[i], g.n)) if not self.persistent[i] \
            else np.arange(g.n)

    def refine(self, P, lead=2.0, keep=True):
        P = P.copy()
        g, size = self.g, self.g.size
        occ = P.astype(np.float64) @ size
        todo = [i for i in range(g.objects) if not self.agg.member[i]]
        cols = {}
        for i in todo:
            ks = self.seq(i)
            if not len(ks):
                continue
            col = P[ks, i]
            if self.persistent[i] and col.any() and not col.all():
                j = int(np.flatnonzero(~col & np.roll(col, 1))[0])
                ks = np.roll(ks, -j)
                col = P[ks, i]
            cols[i] = ks
            for a, b in _runs(col):                       # 1. prune
                if not self.used[ks[a:b], i].any():
                    P[ks[a:b], i] = False
                    occ[ks[a:b]] -= size[i]
        if keep:                                          # 2. keep
            gaps = []
            for i, ks in cols.items():
                runs = _runs(P[ks, i])
                pairs = [((a, b), (b, c)) for (a, b), (c, _) in zip(runs, runs[1:])]
                if self.persistent[i] and runs and runs[0][0] > 0:
                    pairs.append((runs[-1], (0, runs[0][0])))     # wraps around the step
                if runs and not g.survivor[i] and runs[-1][1] < len(ks):
                    pairs.append((runs[-1], (runs[-1][1], len(ks))))  # a dead tail
                for (a, b), (lo, hi) in pairs:
                    dirty = self.wrote[ks[a:b], i].any() or (a == 0 and not g.resident[i])
                    gaps.append((hi - lo, not dirty, i, lo, hi))
            for _, _, i, lo, hi in sorted(gaps):
                span = cols[i][lo:hi]
                if occ[span].max() + size[i] <= self.budget:
                    P[span, i] = True
                    occ[span] += size[i]
        for i, ks in cols.items():                        # 3. send early
            col = P[ks, i]
            for a, b in _runs(col):
                if b < len(ks) or self.persistent[i]:
                    hits = np.flatnonzero(self.used[ks[a:b], i])
                    if len(hits) and a + hits[-1] + 1 < b and not (b == len(ks) and a == 0):
                        cut = ks[a + hits[-1] + 1:b]
                        P[cut, i] = False
                        occ[cut] -= size[i]
        starts = []                                       # 4. bring early
        for i, ks in cols.items():
            col = P[ks, i]
            for a, b in _runs(col):
                if a == 0 and not self.persistent[i]:
                    continue
                hits = np.flatnonzero(self.used[ks[a:b], i])
                if len(hits):
                    starts.append((int(ks[a + hits[0]]), i, a, a + hits[0]))
        for use, i, a, u in sorted(starts):
            ks = cols[i]
            need = lead * self.model.move_time(size[i], True)
            j = a
            while j > 0 and self._window(ks, j, u) < need and not P[ks[j - 1], i] \
                    and occ[ks[j - 1]] + size[i] <= self.budget:
                j -= 1
                P[ks[j], i] = True
                occ[ks[j]] += size[i]
        return P

    def hoist(self, P, waits, margin=1.5):
        """Bring earlier the tensors a kernel waited for (waits: CostModel.run's log): a stay
        in DRAM that began right before the wait starts earlier by the compute that covers
        ``margin`` times the wait, where the budget allows."""
        g, size = self.g, self.g.size
        P = P.copy()
        occ = P.astype(np.float64) @ size
        n = g.n
        for k, i, wait in sorted(waits, key=lambda w: (w[0], w[1])):
            if not P[k, i] or self.agg.member[i]:
                continue
            cyc = self.persistent[i]
            lo = 0 if cyc else int(g.start[i])
            a, steps = k, 0
            while steps < n and P[(a - 1) % n, i] and (cyc or a - 1 >= lo):
                a, steps = (a - 1) % n if cyc else a - 1, steps + 1
            if steps >= n - 1:
                continue
            need, got = margin * wait, 0.0
            while got < need and steps < n - 1 and (cyc or a - 1 >= lo):
                j = (a - 1) % n
                if P[j, i] or occ[j] + size[i] > self.budget:
                    break
                P[j, i] = True
                occ[j] += size[i]
                got += g.times[j]
                a, steps = j, steps + 1
        return P

    def _window(self, ks, a, u):
        """Compute seconds of the kernels at positions [a, u) of ks."""
        return float(self.g.times[ks[a:u]].sum())


def _runs(col):
    """(start, end) of each run of True in a boolean array."""
    d = np.diff(np.concatenate([[0], col.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


def to_table(g, P, agg, budget=math.inf):
    """The status table of a placement: moves before kernel k where P changes from kernel k-1
    (for a persistent tensor at kernel 0, from the step's last kernel); moves into or out of
    DRAM of one adjoin group with one reuse distance are issued together. A dirty tensor that
    leaves DRAM leaves after kernel k's new objects are placed (``late``), unless its room is
    needed for them: the allocator would otherwise reuse its room at once, and the new object
    would wait for the write-back."""
    t = Table.empty(g)
    n = g.n
    persistent = g.persistent
    t.start = P[0] & g.resident if n else t.start
    size = g.size
    wrote = np.zeros((n, g.objects), dtype=bool)
    for k, ops in enumerate(g.ops):
        for i, _, w in ops:
            wrote[k, i] |= w
    dirty = np.zeros(g.objects, dtype=bool)
    for rnd in range(2):
        for k in range(n):
            prev = P[k - 1] if k else (P[n - 1] & persistent)
            new = g.allocs_at[k]
            fresh = np.zeros(g.objects, dtype=bool)
            fresh[new] = True
            alive = (g.start <= k) & (k < g.end)
            ins = np.flatnonzero(P[k] & ~prev & ~fresh)
            outs = np.flatnonzero(prev & ~P[k] & ~fresh & alive)
            if rnd:
                for i in new:
                    t.alloc_fast[i] = P[k, i] or agg.member[i]
                ops = set(g.operands[k])
                late = [i for i in outs.tolist() if dirty[i] and i not in ops]
                need = float(size[prev & alive & ~fresh].sum() + size[ins].sum()
                             + sum(size[i] for i in new if t.alloc_fast[i])
                             - sum(size[i] for i in outs.tolist() if i not in late)) - budget
                late.sort(key=lambda i: (-size[i], i))
                while need > 0 and late:
                    need -= size[late.pop(0)]
                early = np.array(sorted(set(outs.tolist()) - set(late)), dtype=np.int64)
                t.ins[k] = _grouped(g, agg, ins, k)
                t.outs[k] = _grouped(g, agg, early, k)
                t.late[k] = _grouped(g, agg, np.array(sorted(late), dtype=np.int64), k)
                t.want[k] = [i for i in g.operands[k] if P[k, i] or agg.member[i]]
            dirty[ins] = False
            dirty[outs] = False
            dirty[new] = True
            dirty |= wrote[k] & P[k]
    for i in np.flatnonzero(agg.member & g.resident):
        t.start[i] = True
    return t


def _grouped(g, agg, idx, k):
    """Moves of one kernel as groups: members of an adjoin group with one reuse distance
    together, in adjoin order; others alone."""
    groups, out = {}, []
    for i in idx.tolist():
        grp = agg.group[i]
        if grp < 0:
            out.append([i])
            continue
        key = (int(grp), _distance(g, i, k))
        if key not in groups:
            groups[key] = []
            out.append(groups[key])
        groups[key].append(i)
    for grp in out:
        grp.sort(key=lambda j: agg.rank[j])
    return out


# ---- the DQN ----------------------------------------------------------------------------------

class Environment:
    """DeepTM's DRL environment over the step (see plan_dqn). An episode runs the step's
    kernels in order: where everything alive fits in the budget it is all in DRAM; at the
    other ("bottleneck") kernels the agent places up to ``candidates`` tensors one at a time
    (kernel k's operands first, then by heat), each step rewarded s_t/Σ_{operands} s (a DRAM
    operand) − m_nor (a move); running out of room ends the episode with −R_fix. A complete
    episode's placement goes through the Refiner and the cost model: its R_epi joins the last
    step's reward."""

    def __init__(self, g, heat, agg, model, budget, beta, candidates, peak, lead=2.0):
        self.g, self.heat, self.agg, self.model = g, heat, agg, model
        self.refiner, self.lead = Refiner(g, agg, model, budget), lead
        self.budget, self.beta, self.K, self.peak = budget, beta, candidates, peak
        self.width = 6 + 3 * (candidates - 1)
        self.pm_total = float(g.size.sum())        # P_D: PM that holds every tensor
        self.bottleneck = [k for k in range(g.n) if g.live_bytes[k] > budget]

    def state(self, cands, cur, fast, H_of, used, pm_used, ops):
        """[p_t, H_t, s_t/L_D, t is an operand, D_left, P_left] of the tensor being placed
        (fractions), then [p, H, s/L_D] of the other candidates (zeros for empty slots)."""
        v = np.zeros(self.width)
        i = cands[cur]
        v[:6] = (0.0 if fast[i] else 1.0, H_of.get(i, 0.0), self.g.size[i] / self.budget,
                 1.0 if i in ops else 0.0, (self.budget - used) / self.budget,
                 1.0 - pm_used / self.pm_total if self.pm_total else 0.0)
        at = 6
        for j in cands:
            if j != i:
                v[at:at + 3] = (0.0 if fast[j] else 1.0, H_of.get(j, 0.0),
                                self.g.size[j] / self.budget)
                at += 3
        return v

    def episode(self, agent, exploit, learn=True):
        """One episode; returns (placement P or None on OOM, total reward, Cost or None)."""
        g, agg, size = self.g, self.agg, self.g.size
        N, n = g.objects, g.n
        slab = agg.member
        fast = np.zeros(N, dtype=bool)
        P = np.zeros((n, N), dtype=bool)
        total, pending = 0.0, None
        bottleneck = set(self.bottleneck)
        for k in range(n):
            fast[g.frees_at[k]] = False
            row = self.heat[k]
            H_of = dict(zip(row.idx.tolist(), row.H.tolist()))
            new = set(g.allocs_at[k])
            for i in new:
                fast[i] = False
            if k not in bottleneck:                       # everything fits: all in DRAM
                fast[row.idx] = True
            else:
                ops = [i for i in _order_operands(g, k, H_of) if not slab[i]]
                opset = set(ops)
                rest = [i for i in row.idx[np.argsort(-row.H, kind="stable")].tolist()
                        if i not in opset]
                cands = [i for i in ops + rest if size[i] <= self.budget][:self.K]
                tin = sum(size[i] for i in ops) or 1.0
                decided = set()
                for cur, i in enumerate(cands):
                    used = float(size[fast].sum())
                    s = self.state(cands, cur, fast, H_of, used, g.live_bytes[k] - used, opset)
                    if pending is not None:
                        agent.remember(*pending, s, False)
                        if learn:
                            agent.learn()
                    a = agent.act(s, exploit)
                    r, oom = self._apply(k, i, a, fast, new, opset, decided, row, tin)
                    decided.add(i)
                    total += r
                    if oom:
                        agent.remember(s, a, r - R_FIX, None, True)
                        if learn:
                            agent.learn()
                        return None, total - R_FIX, None
                    pending = (s, a, r)
            P[k] = fast
            P[k, slab] = True
        P &= _live_matrix(g)
        table = to_table(g, self.refiner.refine(P, self.lead), agg, self.budget)
        cost = self.model.run(table)
        r_epi = episode_reward(cost, self.model, self.beta, self.peak)
        total += r_epi
        if pending is not None:
            agent.remember(pending[0], pending[1], pending[2] + r_epi, None, True)
            if learn:
                agent.learn()
        return P, total, cost

    def _apply(self, k, i, a, fast, new, ops, decided, row, tin):
        """Action a (0 DRAM, 1 PM) for tensor i before kernel k: (step reward, OOM). DRAM
        needs room: the coldest tensors leave that are not kernel k's operands and not already
        placed in DRAM at this kernel."""
        g, size = self.g, self.g.size
        is_op = i in ops
        r = size[i] / tin if (a == 0 and is_op) else 0.0
        if a == 1:
            if fast[i]:
                fast[i] = False
                r -= self._m_nor(k, i, False, is_op)
            return r, False
        if fast[i]:
            return r, False
        used = float(size[fast].sum())
        if used + size[i] > self.budget:
            for j in row.idx[np.argsort(row.H, kind="stable")].tolist():
                if used + size[i] <= self.budget:
                    break
                if fast[j] and j not in ops and j not in decided and not self.agg.member[j]:
                    fast[j] = False
                    used -= size[j]
            if used + size[i] > self.budget:
                return r, True
        fast[i] = True
        if i not in new:
            r -= self._m_nor(k, i, True, is_op)
        return r, False

    def _m_nor(self, k, i, into_fast, is_op):
        """The share of kernel k's window the move is exposed beyond (Eq. 5), at most 1."""
        move = self.model.move_time(self.g.size[i], into_fast)
        window = max(self.g.times[k], 1e-12)
        exposed = move if (is_op and into_fast) else max(move - window, 0.0)
        return min(1.0, exposed / window)


def plan_dqn(g, heat, agg, model, budget, beta=1.0, episodes=40, seed=0, candidates=8,
             hidden=64, lr=1e-4, peak=None, lead=2.0):
    """Train DeepTM's DQN offline on the cost model; returns (P, info): the placement of the
    complete episode (of training or of the final greedy rollout) with the best episode reward
    R_epi, i.e. the best by the cost model's objective (None if every episode ran out of
    memory). info["rewards"]: each episode's total reward (steps + R_epi)."""
    peak = float(g.live_bytes.max()) if peak is None else peak
    env = Environment(g, heat, agg, model, budget, beta, candidates, peak, lead)
    agent = Agent(env.width, 2, hidden, lr, 0.99, 100, 32, seed)
    best, best_epi, best_at, rewards = None, -math.inf, None, []
    for e in range(episodes + 1):
        final = e == episodes
        P, reward, cost = env.episode(agent, 1.0 if final else exploit_probability(e, episodes),
                                      learn=not final)
        if not final:
            agent.end_episode()
        rewards.append(reward)
        if P is not None:
            r_epi = episode_reward(cost, model, beta, peak)
            if r_epi > best_epi:
                best, best_epi, best_at = P, r_epi, e
    info = {"episodes": episodes, "rewards": rewards, "best_episode": best_at,
            "best_r_epi": best_epi, "updates": agent.updates,
            "final_loss": agent.losses[-1] if agent.losses else None,
            "steps_per_episode": sum(min(candidates, len(heat[k].idx)) for k in env.bottleneck),
            "weights_checksum": float(np.abs(agent.net.flat).sum())}
    return best, info


# ---- the policy -------------------------------------------------------------------------------

_MODES = ("greedy", "dqn")
_MIGRATIONS = ("async", "sync")


class DeepTM(PlannedPolicy):
    """DeepTM (see the module docstring): heat with dynamic weights, a cost model, and a greedy
    or DQN optimizer; the plan places new tensors and moves the others between kernels.

    mode: "greedy" (placement by heat, the paper's ablation) or "dqn"; beta: weight of time
    against the memory's price (1.0: time only; the paper uses 0.25/0.5/0.75); episodes, seed:
    DQN training; candidates: tensors the DQN places per bottleneck kernel; migration: "async"
    (background copies, exposed part counted) or "sync" (every copy waited for); slab: share of
    the peak reserved for batched small tensors (capped at ``slab_cap`` of the fast budget);
    headroom: share of fast memory the plan fills (the rest absorbs heap fragmentation);
    adjoin: move adjoin groups together. ``info`` gets the plan's modelled cost, budget,
    weights, moves and (dqn) the training rewards; ``table`` is the status table.
    """

    name = "deeptm"
    honours_prefetch = False      # the plan decides (the hints are followed before it exists)

    def __init__(self, mode="greedy", beta=1.0, episodes=40, seed=0, candidates=8,
                 migration="async", slab=0.1, slab_cap=0.1, headroom=0.8, adjoin=True,
                 profile=None, profile_step=1):
        super().__init__(profile=profile, profile_step=profile_step)
        if mode not in _MODES:
            raise ValueError(f"mode={mode!r}: give one of {_MODES}, e.g. mode='greedy'")
        if not _real(beta) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta={beta!r}: give a number in [0, 1], e.g. beta=0.5 "
                             "(1.0 = performance only)")
        for opt, v, lo in (("episodes", episodes, 1), ("candidates", candidates, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{opt}={v!r}: give an integer >= {lo}, e.g. {opt}=40")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed={seed!r}: give an integer, e.g. seed=0")
        if migration not in _MIGRATIONS:
            raise ValueError(f"migration={migration!r}: give one of {_MIGRATIONS}, "
                             "e.g. migration='async'")
        for opt, v in (("slab", slab), ("slab_cap", slab_cap)):
            if not _real(v) or not 0.0 <= v < 1.0:
                raise ValueError(f"{opt}={v!r}: give a fraction in [0, 1), e.g. {opt}=0.1")
        if not _real(headroom) or not 0.0 < headroom <= 1.0:
            raise ValueError(f"headroom={headroom!r}: give a fraction in (0, 1], e.g. "
                             "headroom=0.8")
        if not isinstance(adjoin, bool):
            raise ValueError(f"adjoin={adjoin!r}: give True or False")
        self.mode, self.beta, self.episodes, self.seed = mode, float(beta), episodes, seed
        self.candidates, self.migration, self.adjoin = candidates, migration, adjoin
        self.slab, self.slab_cap, self.headroom = float(slab), float(slab_cap), float(headroom)
        self.table = None             # the status table of the plan
        self.graph = None

    # ---- planning ---------------------------------------------------------------------------

    def make_plan(self, step):
        m = self.manager
        g = Graph(step)
        self.graph = g
        capacity = self.headroom * m.fast.size
        peak = float(g.live_bytes.max()) if g.n else 0.0
        reserve = min(self.slab * peak, self.slab_cap * capacity)
        agg = Aggregator(g, reserve)
        slow = self.device_profile("slow")
        fast = self.device_profile("fast")
        plan, info = self.optimise(g, agg, capacity - agg.slab_peak, fast, slow, peak,
                                   float(m.fast.size))
        self.table = plan
        self.info.update(info, slab=[g.sids[i] for i in agg.slab_order],
                         slab_bytes=agg.slab_peak, fast_budget=capacity)
        self._compile(g, plan, agg)
        self._reconcile(g, plan)

    def optimise(self, g, agg, budget, fast, slow, peak, room):
        """The table for a budget: the greedy or DQN plan. With beta < 1 the greedy mode takes
        the DRAM budget (a tenth to all of it) whose plan has the best R_epi (episode_reward);
        the DQN has the price in its episode reward."""
        sync = self.migration == "sync"
        mode = self.mode
        info = {"mode": mode}
        if mode == "dqn" and g.n * g.objects > DQN_LIMIT:
            info["dqn"] = (f"too large: {g.n} kernels x {g.objects} tensors > {DQN_LIMIT}; "
                           "planned greedily (mode='greedy')")
            log.info("deeptm: %s", info["dqn"])
            mode = "greedy"
        grid = [budget] if self.beta >= 1.0 or mode == "dqn" else \
            [budget * j / 10 for j in range(10, 0, -1)]
        best = None
        for b in grid:
            model = CostModel(g, room * b / budget if budget > 0 else room, fast, slow, sync=sync)
            heat, weights = heat_table(g, b, agg.member)
            dinfo = {}
            P = None
            if mode == "dqn":
                P, dinfo = plan_dqn(g, heat, agg, model, b, self.beta, self.episodes,
                                    self.seed, self.candidates, peak=peak)
                if P is None:
                    dinfo["fallback"] = "no complete episode; planned greedily"
            if P is None:
                P = plan_greedy(g, heat, agg, b, model, self.adjoin)
            refiner = Refiner(g, agg, model, b)
            for lead in LEADS:
                P2 = refiner.refine(P, lead)
                for it in range(HOISTS + 1):
                    waits = []
                    table = to_table(g, P2, agg, b)
                    cost = model.run(table, log=waits)
                    score = episode_reward(cost, model, self.beta, peak)
                    if best is not None and best[-1] == (b, lead) and score <= best[0]:
                        break
                    if best is None or score > best[0]:
                        best = (score, table, cost, model, weights,
                                dict(dinfo, lead=lead, hoists=it), b, (b, lead))
                    if not waits:
                        break
                    P2 = refiner.hoist(P2, waits)
        score, table, cost, model, weights, dinfo, b, _ = best
        info.update(dinfo)
        info.update(budget=b + agg.slab_peak, weights=weights, cost=cost,
                    c_normal=model.normal(cost.total), modelled_ratio=cost.total / model.c_min
                    if model.c_min else 1.0, moves=table.moves(), objective=score)
        return table, info

    def _compile(self, g, table, agg):
        """alloc_plan and the actions: at the end of kernel k-1 (for kernel 0, of the step's
        last kernel) the table's brings and sends before kernel k (see _move); as kernel k
        starts, after its new objects are placed, its late sends."""
        for i, j in g.ordinal.items():
            self.alloc_plan[j] = "fast" if table.alloc_fast[i] or agg.member[i] else "slow"
        sid = g.sids
        wait = self.migration == "sync"
        n = g.n
        for k in range(n):
            outs = [[sid[i] for i in grp] for grp in table.outs[k]]
            ins = [[sid[i] for i in grp] for grp in table.ins[k]]
            made = set(g.allocs_at[k])
            want = [sid[i] for i in table.want[k] if i not in made]
            want += [sid[i] for i in g.operands[k] if agg.member[i] and i not in made
                     and sid[i] not in want]
            if outs or ins or want:
                self.schedule(("kernel_end", (k - 1) % n),
                              lambda m, o=outs, i=ins, w=want: self._move(o, i, w, wait))
            late = [sid[i] for grp in table.late[k] for i in grp]
            if late:
                self.schedule(("kernel", k), lambda m, o=late: self._late(o, wait))

    def _reconcile(self, g, table):
        """Put the objects alive now where the plan starts a step: the plan itself only moves
        what changes place within the step."""
        wait = self.migration == "sync"
        for i in np.flatnonzero(g.resident).tolist():
            if not table.start[i]:
                self.send(g.sids[i], wait=wait)
        for i in np.flatnonzero(g.resident & table.start).tolist():
            self.bring(g.sids[i], wait=wait)

    def _move(self, outs, ins, want, wait):
        """One transition: brings into free room first (so that they do not land on room a
        send is still copying out of), then sends, then the brings that needed their room,
        then operands planned in DRAM that are not there (forced)."""
        later = []
        for grp in ins:
            for s in grp:
                if not self.bring(s, wait=wait) and self.live(s) is not None:
                    later.append(s)
        for grp in outs:
            for s in grp:
                self.send(s, wait=wait)
        for s in later:
            if not self.bring(s, wait=wait):
                self._count("bring_refused")
        for s in want:
            if self.live(s) is not None and not self.bring(s, wait=wait, force=True):
                self._count("operand_refused")

    def _late(self, outs, wait):
        for s in outs:
            self.send(s, wait=wait)

    def _count(self, key):
        self.info[key] = self.info.get(key, 0) + 1


def _real(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---- the β curve and the smallest budget ------------------------------------------------------

@dataclass(frozen=True)
class BetaRow:
    """One point of the cost/performance curve (the paper's Fig. 16)."""

    beta: float
    fast: float
    dram_bytes: int
    ratio: float
    cost: float


def beta_curve(trace, betas=(0.25, 0.5, 0.75, 1.0), fast=1.0, profile="optane",
               **options):
    """Per β: the DRAM DeepTM chooses (peak fast bytes of the last step), the modelled ratio
    to fast-only time and the memory's cost in $ (DRAM and the PM peak at the paper's prices),
    from replays of trace with ``fast`` memory available. ``fast`` may be a list of budgets."""
    from ..replay import replay
    rows = []
    budgets = fast if isinstance(fast, (list, tuple)) else [fast]
    for f in budgets:
        for b in betas:
            run = replay(trace, DeepTM(beta=b, **options), fast=f, profile=profile)
            dram = int(run.last.peak.get("fast", 0))
            pm = int(run.last.peak.get("slow", 0))
            cost = (PRICE_DRAM * dram + PRICE_PM * pm) / _GB
            rows.append(BetaRow(float(b), f, dram, run.ratio, cost))
    return rows


def smallest_budget(trace, target=0.9, profile="optane", mode="greedy", grid=None,
                    policy=None, policy_options=None, **options):
    """The smallest fast fraction of the trace's footprint (grid: 5%..100% by 5%) at which the
    replay reaches ``target`` of fast-only speed (ratio <= 1/target), the paper's Fig. 17;
    None if no fraction does. policy: another policy's name to measure instead of DeepTM."""
    from ..replay import replay
    if not _real(target) or not 0 < target <= 1:
        raise ValueError(f"target={target!r}: give a share of fast-only speed in (0, 1], "
                         "e.g. target=0.9")
    grid = [round(0.05 * j, 2) for j in range(1, 21)] if grid is None else list(grid)
    for f in grid:
        pol = policy if policy is not None else DeepTM(mode=mode, **options)
        run = replay(trace, pol, fast=f, profile=profile, policy_options=policy_options)
        if run.ratio <= 1.0 / target:
            return f
    return None


register_policy(DeepTM.name, DeepTM)
