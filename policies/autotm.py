"""AutoTM: an integer linear program that places every tensor at every use.

The paper (Hildebrand's dissertation, chapter 3) profiles each kernel of a static training graph
with its operands in DRAM or PM, builds one network-flow graph per tensor whose paths are the
tensor's possible locations and moves, and lets an ILP solver (Gurobi) pick the paths that
minimise the step time under a DRAM limit at every kernel: the *static* formulation (no moves),
the *synchronous* one (blocking moves next to the kernels that use a tensor) and the
*asynchronous* extension (moves overlapped with kernels). Heap fragmentation is handled by
running the allocator over the solution, lowering the limit of the kernels where it overflowed
and solving again.

Here the graph is one profiled step (``StepProfile``) and a kernel's time under each placement
comes from ``cachedarrays.costmodel`` instead of a profiling run: a slow read adds
n * (1/R(slow) - 1/R(fast)), a slow write makes the kernel take at least ``F`` times its
compute (linearised with one variable per kernel that writes). The flow graphs are written per
use rather than per kernel: a binary location at each use, a binary "kept in fast" for each gap
between consecutive uses, and for a tensor that reaches fast memory at its next use one binary
per candidate prefetch window (the kernels the copy overlaps; exposed time max(0, bytes /
bandwidth - their compute); the window of length 0 is the synchronous move). A tensor leaving
fast memory after a use is written back only if it is dirty (written, or created, and kept in
fast since), in the background while its fast copy stays for as many kernels as the copy takes
(counted in fast memory), then dropped; a clean one is dropped at once. Persistent tensors
(weights) wrap around the step. Fast memory is counted at every kernel, less a margin for heap
fragmentation. ``scipy.optimize.milp`` (HiGHS) solves the program.

The plan runs the solution: each new tensor is created where its first use wants it,
prefetches start in the background at their window, write-backs and drops follow the last fast
use of a gap, synchronous moves wait, and at every step mark the persistent tensors are put
where the solution has them at the step's start. The fragmentation retries replay the profiled
trace under the solution on virtual devices (the allocator pass) and keep the solution whose
replay is fastest. What the program leaves out, and the replay adds: copies on one link
serialise, and the heap may not find a contiguous block where the program counted free bytes
(an unplanned eviction then runs in the background and a prefetch that still does not fit is
forced, evicting by the plan's order).
"""

import math
import time
from dataclasses import dataclass, field

from .. import costmodel
from ..errors import OutOfMemoryError
from ..registry import register_policy
from ..stepprofile import StepProfile
from ..trace import Trace
from .planned import PlannedPolicy, repeat_step

__all__ = ["AutoTM", "Solution", "Move", "solve", "optimum", "MOVES"]

# The paper's three formulations: no moves, blocking moves, and moves overlapped with kernels
# (which include the blocking ones: a prefetch issued at its use).
MOVES = ("static", "sync", "async")
# Candidate prefetch windows per gap: the shortest that hides the copy and a few shorter ones.
_PARTIAL = (0.25, 0.5, 0.75)
# A tie-break in the objective: this fraction of every copy's seconds (fewer moves when equal).
_TIE = 1e-3


@dataclass(frozen=True)
class Move:
    """One planned copy. prefetch: issued before kernel ``at`` (in the background, from the end
    of the kernel before it) for the use at kernel ``use``. evict: after kernel ``at`` ends; a
    dirty tensor is written back in the background and its fast copy dropped when kernel
    ``drop`` ends (the write-back done), a clean one is dropped at once (``drop == at``).
    ``use``: the next use (-1 when none follows). ``wait``: a blocking copy; ``exposed``: the
    modelled seconds it adds to the step."""

    kind: str
    sid: str
    at: int
    use: int
    nbytes: int
    wait: bool = False
    dirty: bool = True
    exposed: float = 0.0
    drop: int = -1


@dataclass
class Solution:
    """What ``solve`` found: where each tensor is at each use, where each new tensor is created,
    the moves, and the program's figures (seconds, sizes, solver status)."""

    placement: dict            # (sid, kernel) -> "fast" | "slow" at each use
    alloc: dict                # sid -> "fast" | "slow": where the tensor is created
    moves: list                # [Move], in issue order
    objective: float           # modelled seconds of the step under this solution
    bound: float               # the solver's lower bound on the optimum (seconds)
    gap: float                 # (objective - bound) / objective
    status: str                # "optimal", "time limit", "node limit", "fallback: ..."
    variables: int = 0
    constraints: int = 0
    nonzeros: int = 0
    seconds: float = 0.0       # solver wall time
    fast_only: float = 0.0     # the step's compute (every tensor in fast memory)
    limit: int = 0             # fast bytes the program may use at each kernel
    penalty: float = 0.0       # modelled seconds of slow operands
    exposed: float = 0.0       # modelled seconds of copies the kernels wait for
    occupancy: list = field(default_factory=list)   # fast bytes the program counts per kernel
    start: dict = field(default_factory=dict)       # persistent sid -> where it is at kernel 0
    program: float = math.nan  # the solver's objective (seconds; a tie-break favours fewer moves)

    @property
    def ratio(self):
        """Modelled step time over the fast-only time."""
        return self.objective / self.fast_only if self.fast_only else float("nan")


# ---- the tensors of a step ----------------------------------------------------------------

@dataclass
class _Use:
    k: int
    read: int                  # bytes the kernel reads (summed over repeated operands)
    write: int
    writes: bool


@dataclass
class _Gap:
    """The kernels between use i and the next use (index j, at kernel ``nxt``)."""

    i: int
    j: int
    nxt: int
    kernels: list


@dataclass
class _Tensor:
    sid: str
    nbytes: int
    uses: list
    persistent: bool
    made: bool                 # created in the step (dirty wherever it is created)
    head: list                 # kernels from its creation to its first use
    tail: list                 # kernels after its last use while it is alive (not persistent)
    gaps: list

    @property
    def dirtyable(self):
        return self.made or any(u.writes for u in self.uses)


def _tensors(step):
    """The tensors of a step with uses, and the sids of those without any."""
    n = len(step)
    out, unused = [], []
    for sid, nbytes in step.objects.items():
        raw = step.uses.get(sid)
        if not raw:
            unused.append(sid)
            continue
        by = {}
        for k, w in raw:
            u = by.setdefault(k, _Use(k, 0, 0, False))
            nb = 0 if step.kernels[k][0] == "view" else step.operand_bytes(k, sid)
            if w:
                u.write += nb
                u.writes = True
            else:
                u.read += nb
        uses = [by[k] for k in sorted(by)]
        a, f = step.lifetime(sid)
        persistent = sid not in step.alloc_at and sid not in step.free_at
        ks = [u.k for u in uses]
        gaps = [_Gap(i, i + 1, ks[i + 1], list(range(ks[i] + 1, ks[i + 1])))
                for i in range(len(ks) - 1)]
        if persistent:
            gaps.append(_Gap(len(ks) - 1, 0, ks[0],
                             list(range(ks[-1] + 1, n)) + list(range(0, ks[0]))))
        out.append(_Tensor(sid, nbytes, uses, persistent, sid in step.alloc_at,
                           [] if persistent else list(range(a, ks[0])),
                           [] if persistent else list(range(ks[-1] + 1, f)), gaps))
    return out, unused


# ---- the linear program -----------------------------------------------------------------

# The program's units (HiGHS works best with coefficients near 1): milliseconds and MiB.
_MS = 1e3
_MIB = float(1 << 20)


class _Program:
    """Variables, rows and the occupancy of fast memory at every kernel (telescoped: one
    variable O_k per kernel, O_k - O_(k-1) = what starts at k - what ended at k-1). Costs are
    given in seconds and bytes and kept in milliseconds and MiB."""

    def __init__(self, n):
        self.cost, self.hi, self.integer = [], [], []
        self.rows, self.cols, self.vals, self.lo_r, self.hi_r = [], [], [], [], []
        self.constant = 0.0
        self.lo_fixed = None
        self.found = math.nan          # the solver's objective (seconds, with the tie-break)
        self.delta = [dict() for _ in range(n + 1)]
        self.n = n

    def var(self, cost=0.0, hi=1.0, integer=True, tie=0.0):
        self.cost.append((cost + tie) * _MS)
        self.hi.append(hi)
        self.integer.append(1 if integer else 0)
        return len(self.cost) - 1

    def row(self, terms, lo=-math.inf, hi=math.inf):
        r = len(self.lo_r)
        for v, a in terms:
            if a:
                self.rows.append(r)
                self.cols.append(v)
                self.vals.append(a)
        self.lo_r.append(lo)
        self.hi_r.append(hi)

    def occupy(self, v, nbytes, kernels):
        """Variable v holds nbytes of fast memory during these kernels (one or two runs)."""
        for s, e in _runs(kernels):
            d = self.delta[s]
            d[v] = d.get(v, 0.0) + nbytes / _MIB
            d = self.delta[e + 1]
            d[v] = d.get(v, 0.0) - nbytes / _MIB

    def offset(self):
        """A variable fixed at 1 whose cost is the constant part of the objective (so that
        the solver's relative gap is a gap in seconds of the step)."""
        self.var(cost=self.constant, hi=1.0, integer=False)
        self.lo_fixed = len(self.cost) - 1

    def capacity(self, limits):
        """O_k <= limits[k] at every kernel."""
        prev = None
        for k in range(self.n):
            o = self.var(hi=limits[k] / _MIB, integer=False)
            terms = [(o, 1.0)] + [(v, -a) for v, a in sorted(self.delta[k].items())]
            if prev is not None:
                terms.append((prev, -1.0))
            self.row(terms, 0.0, 0.0)
            prev = o


def _runs(kernels):
    """Contiguous (first, last) runs of an ordered list of kernel indices."""
    out = []
    for k in kernels:
        if out and out[-1][1] == k - 1:
            out[-1][1] = k
        else:
            out.append([k, k])
    return [tuple(r) for r in out]


@dataclass
class _Rates:
    """Seconds per byte of the cost model's rules for one pair of tiers."""

    read: float                # slow read penalty per byte
    write: float               # slow write penalty per byte
    factor: float              # F - 1
    into: float                # slow -> fast copy, seconds per byte
    out: float                 # fast -> slow copy
    latency: float

    @classmethod
    def of(cls, fast, slow, factor):
        f, s, g = costmodel.get_profile(fast), costmodel.get_profile(slow), 1e9
        return cls(1 / (s.read_gbps * g) - 1 / (f.read_gbps * g),
                   1 / (s.write_gbps * g) - 1 / (f.write_gbps * g), factor - 1.0,
                   1 / (min(s.read_gbps, f.write_gbps) * g),
                   1 / (min(f.read_gbps, s.write_gbps) * g), max(s.latency, f.latency))

    def copy_in(self, nbytes):
        return self.latency + nbytes * self.into

    def copy_out(self, nbytes):
        return self.latency + nbytes * self.out


def _windows(gap, times, seconds):
    """Candidate prefetch windows of a gap: (position in gap.kernels where the copy starts,
    exposed seconds). Position len(kernels) is a copy issued at the use itself."""
    ks = gap.kernels
    suffix = [0.0] * (len(ks) + 1)
    for p in range(len(ks) - 1, -1, -1):
        suffix[p] = suffix[p + 1] + times[ks[p]]
    hidden = next((p for p in range(len(ks) - 1, -1, -1) if suffix[p] >= seconds), 0)
    picks = {len(ks), hidden}
    for f in _PARTIAL:
        p = next((p for p in range(len(ks) - 1, hidden - 1, -1) if suffix[p] >= f * seconds),
                 None)
        if p is not None:
            picks.add(p)
    return [(p, max(0.0, seconds - suffix[p])) for p in sorted(picks)]


def _buffer(kernels, times, seconds):
    """How many of these kernels start while a copy of this many seconds issued before them
    is still running."""
    t = 0.0
    for q, k in enumerate(kernels):
        if t >= seconds:
            return q
        t += times[k]
    return len(kernels)


class _Builder:
    """Writes the program of one step (see the module docstring)."""

    def __init__(self, step, rates, moves):
        self.step, self.rates, self.moves = step, rates, moves
        self.times = [float(t) for t in step.times]
        self.p = _Program(len(step))
        self.x = {}            # (sid, i) -> location variable at use i
        self.keep = {}         # (sid, gap i) -> kept in fast across the gap
        self.fetch = {}        # (sid, gap i) -> [(var, position, exposed, seconds)]
        self.back = {}         # (sid, gap i or "tail") -> write-back variable
        self.tail = {}         # sid -> kept in fast after its last use
        self.ops = [[] for _ in range(len(step))]     # kernel -> [(x var, use)]

    def build(self, tensors):
        self.p.constant += sum(self.times)
        for t in tensors:
            self.tensor(t)
        for k, ops in enumerate(self.ops):
            self.kernel(k, ops)

    def tensor(self, t):
        p, static = self.p, self.moves == "static"
        one = p.var() if static else None
        xs = [one if static else p.var() for _ in t.uses]
        for i, (u, v) in enumerate(zip(t.uses, xs)):
            self.x[(t.sid, i)] = v
            self.ops[u.k].append((v, u, t.sid))
            p.occupy(v, t.nbytes, [u.k])
        p.occupy(xs[0], t.nbytes, t.head)
        if static:
            for g in t.gaps:
                p.occupy(one, t.nbytes, g.kernels)
            p.occupy(one, t.nbytes, t.tail)
            return
        dirty = self.dirty(t, xs) if t.dirtyable else None
        for g in t.gaps:
            self.gap(t, g, xs, dirty)
        if t.tail:
            self.after_last(t, xs, dirty)

    def dirty(self, t, xs):
        """d_i >= x_i at a write (or the creation); d_j >= d_i + keep(i..j) - 1: the fast
        copy stays dirty while it is kept. Rows for the keeps are added with the gaps."""
        p = self.p
        ds = [p.var(integer=False) for _ in t.uses]
        for i, u in enumerate(t.uses):
            if u.writes or (i == 0 and t.made):
                p.row([(ds[i], 1.0), (xs[i], -1.0)], lo=0.0)
        return ds

    def gap(self, t, g, xs, dirty):
        p, r, sid = self.p, self.rates, t.sid
        keep = p.var()
        self.keep[(sid, g.i)] = keep
        p.row([(keep, 1.0), (xs[g.i], -1.0)], hi=0.0)
        p.row([(keep, 1.0), (xs[g.j], -1.0)], hi=0.0)
        p.occupy(keep, t.nbytes, g.kernels)
        comp = sum(self.times[k] for k in g.kernels)
        out = r.copy_out(t.nbytes)
        back = None
        if dirty is not None:
            p.row([(dirty[g.j], 1.0), (dirty[g.i], -1.0), (keep, -1.0)], lo=-1.0)
            sync = self.moves == "sync"
            exposed = out if sync else max(0.0, out - comp)
            back = p.var(cost=exposed, integer=False, tie=_TIE * out)
            self.back[(sid, g.i)] = back
            p.row([(back, 1.0), (dirty[g.i], -1.0), (keep, 1.0)], lo=0.0)
            if not sync:
                p.occupy(back, t.nbytes, g.kernels[:_buffer(g.kernels, self.times, out)])
        seconds = r.copy_in(t.nbytes)
        cands = [(len(g.kernels), seconds)] if self.moves == "sync" else \
            _windows(g, self.times, seconds)
        fetch = []
        for pos, exposed in cands:
            v = p.var(cost=exposed, tie=_TIE * seconds)
            fetch.append((v, pos, exposed, seconds))
            p.occupy(v, t.nbytes, g.kernels[pos:])
            if back is not None and pos < len(g.kernels) and \
                    sum(self.times[k] for k in g.kernels[:pos]) < out:
                p.row([(v, 1.0), (back, 1.0)], hi=1.0)   # would start before the write-back
        self.fetch[(sid, g.i)] = fetch
        p.row([(xs[g.j], 1.0), (keep, -1.0)] + [(v, -1.0) for v, *_ in fetch], 0.0, 0.0)

    def after_last(self, t, xs, dirty):
        """Dead but not yet freed: kept in fast until freed, or evicted after the last use."""
        p, r, last = self.p, self.rates, len(t.uses) - 1
        keep = p.var()
        self.tail[t.sid] = keep
        p.row([(keep, 1.0), (xs[last], -1.0)], hi=0.0)
        p.occupy(keep, t.nbytes, t.tail)
        if dirty is not None:
            out = r.copy_out(t.nbytes)
            sync = self.moves == "sync"
            back = p.var(cost=out if sync else 0.0, integer=False, tie=_TIE * out)
            self.back[(t.sid, "tail")] = back
            p.row([(back, 1.0), (dirty[last], -1.0), (keep, 1.0)], lo=0.0)
            if not sync:
                p.occupy(back, t.nbytes, t.tail[:_buffer(t.tail, self.times, out)])

    def kernel(self, k, ops):
        """The penalty of kernel k's slow operands (cost model rules, linearised)."""
        p, r = self.p, self.rates
        full = sum(r.read * u.read + r.write * u.write for _, u, _ in ops)
        if not any(u.writes for _, u, _ in ops):
            p.constant += full
            for v, u, _ in ops:
                p.cost[v] -= r.read * u.read * _MS
            return
        pen = p.var(cost=1.0 / _MS, hi=math.inf, integer=False)     # in ms
        p.row([(pen, 1.0)] + [(v, (r.read * u.read + r.write * u.write) * _MS)
                              for v, u, _ in ops], lo=full * _MS)
        floor = r.factor * self.times[k] * _MS
        if floor > 0:
            for v, u, _ in ops:
                if u.writes:
                    p.row([(pen, 1.0), (v, floor)], lo=floor)


# ---- solving and reading the solution -----------------------------------------------------

def _check(time_limit, mip_gap, moves, margin, node_limit):
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or \
            not (time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit={time_limit!r}: give the solver's seconds, a positive "
                         "number, e.g. time_limit=100")
    if isinstance(mip_gap, bool) or not isinstance(mip_gap, (int, float)) or \
            not 0 <= mip_gap < 1:
        raise ValueError(f"mip_gap={mip_gap!r}: give the relative optimality gap the solver "
                         "may stop at, in [0, 1), e.g. mip_gap=0.01")
    if moves not in MOVES:
        raise ValueError(f"moves={moves!r}: give one of {', '.join(map(repr, MOVES))} (the "
                         "paper's static, synchronous and asynchronous formulations), "
                         "e.g. moves='async'")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r}: give the fraction of fast memory kept free for "
                         "heap fragmentation, in [0, 1), e.g. margin=0.03")
    if node_limit is not None and (isinstance(node_limit, bool) or
                                   not isinstance(node_limit, int) or node_limit < 1):
        raise ValueError(f"node_limit={node_limit!r}: give a number of branch-and-bound "
                         "nodes >= 1, or None for no limit, e.g. node_limit=2000")


def solve(step, fast_bytes, profile="optane", *, time_limit=100.0, mip_gap=0.001,
          moves="async", margin=0.03, node_limit=None, fast_profile="dram",
          slow_output_factor=costmodel.SLOW_OUTPUT_FACTOR, limits=None):
    """Solve AutoTM's program for one step with fast_bytes of fast memory.

    step: a StepProfile (or a Trace, profiled at its step 1 or its last); profile: the slow
    tier's costmodel Profile or its name; limits: fast bytes per kernel (defaults to
    fast_bytes less the margin). Returns a Solution; a solver that finds nothing in time
    gives the static greedy placement (status "fallback: ...").
    """
    _check(time_limit, mip_gap, moves, margin, node_limit)
    if isinstance(step, Trace):
        step = StepProfile.of(step, min(1, len(step.step_kernels()) - 1))
    if not isinstance(step, StepProfile):
        raise TypeError(f"solve takes a StepProfile or a Trace, not {type(step).__name__}")
    if isinstance(fast_bytes, bool) or not isinstance(fast_bytes, (int, float)) or \
            fast_bytes < 0:
        raise ValueError(f"fast_bytes={fast_bytes!r}: give fast memory in bytes (>= 0), e.g. "
                         "fast_bytes=64 << 20")
    rates = _Rates.of(fast_profile, profile, float(slow_output_factor))
    limit = int(fast_bytes * (1.0 - margin))
    limits = [limit] * len(step) if limits is None else [min(limit, int(v)) for v in limits]
    tensors, unused = _tensors(step)
    b = _Builder(step, rates, moves)
    b.build(tensors)
    b.p.capacity(limits)
    values, status, bound, sizes, seconds = _run(b.p, time_limit, mip_gap, node_limit)
    if values is None:
        values = _greedy(b, tensors, limits)
        bound = -math.inf
    sol = _decode(b, tensors, unused, values, rates, moves)
    sol.status, sol.seconds, sol.limit = status, seconds, limit
    sol.program = b.p.found
    sol.variables, sol.constraints, sol.nonzeros = sizes
    sol.bound = min(bound, sol.objective) if math.isfinite(bound) else 0.0
    sol.gap = (sol.objective - sol.bound) / sol.objective if sol.objective > 0 else 0.0
    return sol


def _run(p, time_limit, mip_gap, node_limit):
    """Solve with HiGHS; (values or None, status, lower bound in seconds, sizes, seconds)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_array

    p.offset()
    nv, nr = len(p.cost), len(p.lo_r)
    lower = np.zeros(nv)
    lower[p.lo_fixed] = 1.0
    A = csr_array((p.vals, (p.rows, p.cols)), shape=(nr, nv))
    sizes = (nv, nr, A.nnz)
    options = {"time_limit": float(time_limit), "mip_rel_gap": float(mip_gap), "disp": False}
    if node_limit is not None:
        options["node_limit"] = int(node_limit)
    t0 = time.perf_counter()
    res = milp(np.array(p.cost), integrality=np.array(p.integer),
               bounds=Bounds(lower, np.array(p.hi)),
               constraints=LinearConstraint(A, np.array(p.lo_r), np.array(p.hi_r)),
               options=options)
    seconds = time.perf_counter() - t0
    status = _status(res)
    if res.x is None:
        return None, f"fallback: {status} ({res.message})", -math.inf, sizes, seconds
    bound = getattr(res, "mip_dual_bound", None)
    bound = float(bound) / _MS if bound is not None and math.isfinite(bound) else -math.inf
    if status == "optimal" and not math.isfinite(bound):
        bound = float(res.fun) / _MS
    values = [float(v) for v in res.x]
    p.found = float(res.fun) / _MS
    return values, status, bound, sizes, seconds


def _status(res):
    """The solver's outcome in words: optimal, time limit, node limit, infeasible, error."""
    message = str(res.message).lower()
    if res.status == 0:
        return "optimal"
    if res.status == 1:
        return "time limit" if "time" in message else "node limit"
    if "limit reached" in message:          # HiGHS reports a node limit as a solution limit
        return "node limit"
    return {2: "infeasible", 3: "unbounded"}.get(res.status, "error")


def _greedy(b, tensors, limits):
    """The fallback: the static placement, tensors in fast memory for their whole life while
    they fit, most penalty saved per byte-kernel first."""
    r, n = b.rates, len(b.times)
    used = [0] * n
    values = [0.0] * len(b.p.cost)

    def life(t):
        ks = set(t.head) | set(t.tail) | {u.k for u in t.uses}
        for g in t.gaps:
            ks.update(g.kernels)
        return sorted(ks)

    def gain(t):
        saved = sum(r.read * u.read + r.write * u.write + (r.factor * b.times[u.k] if u.writes
                                                            else 0.0) for u in t.uses)
        return saved / max(1, t.nbytes * len(life(t)))

    for t in sorted(tensors, key=lambda t: (-gain(t), t.sid)):
        ks = life(t)
        if all(used[k] + t.nbytes <= limits[k] for k in ks):
            for k in ks:
                used[k] += t.nbytes
            for i in range(len(t.uses)):
                values[b.x[(t.sid, i)]] = 1.0
            for g in t.gaps:
                if (t.sid, g.i) in b.keep:
                    values[b.keep[(t.sid, g.i)]] = 1.0
            if t.sid in b.tail:
                values[b.tail[t.sid]] = 1.0
    return values


def _decode(b, tensors, unused, values, rates, moves):
    """Placements and moves of a solution, and its modelled seconds recomputed from them."""
    on = lambda v: v is not None and values[v] > 0.5          # noqa: E731
    placement, alloc, out, start = {}, {}, [], {}
    exposed = 0.0
    for t in tensors:
        where = ["fast" if on(b.x[(t.sid, i)]) else "slow" for i in range(len(t.uses))]
        for u, w in zip(t.uses, where):
            placement[(t.sid, u.k)] = w
        if t.made:
            alloc[t.sid] = where[0]
        dirty = _dirty_flags(t, where, b, on)
        for g in t.gaps:
            keep = on(b.keep.get((t.sid, g.i)))
            if moves == "static":
                continue
            if where[g.i] == "fast" and not keep:
                mv = _eviction(b, t, t.uses[g.i].k, g.nxt, g.kernels, dirty[g.i], rates, moves)
                exposed += mv.exposed
                out.append(mv)
            for v, pos, e, _ in b.fetch.get((t.sid, g.i), ()):
                if on(v):
                    at = g.kernels[pos] if pos < len(g.kernels) else g.nxt
                    exposed += e
                    out.append(Move("prefetch", t.sid, at, g.nxt, t.nbytes,
                                    moves == "sync", False, e))
        if t.persistent:
            start[t.sid] = _at_start(t, where, b, on, out)
        if t.tail and moves != "static" and where[-1] == "fast" and not on(b.tail.get(t.sid)):
            mv = _eviction(b, t, t.uses[-1].k, -1, t.tail, dirty[-1], rates, moves)
            exposed += mv.exposed
            out.append(mv)
    for sid in unused:
        if sid in b.step.alloc_at:
            alloc[sid] = "slow"
    penalty = _penalty(b, placement, rates)
    fast_only = sum(b.times)
    occupancy, cur = [], 0.0
    for k in range(len(b.times)):
        cur += sum(a * values[v] for v, a in b.p.delta[k].items()) * _MIB
        occupancy.append(int(round(cur)))
    out.sort(key=lambda m: (m.at, m.kind != "evict", m.use, m.sid))
    return Solution(placement, alloc, out, fast_only + penalty + exposed, 0.0, 0.0, "",
                    fast_only=fast_only, penalty=penalty, exposed=exposed, occupancy=occupancy,
                    start=start)


def _at_start(t, where, b, on, moves):
    """Where a persistent tensor is when the step begins: at its first use if kernel 0 uses
    it or nothing moves, else fast if the gap that wraps round the step keeps it there, a
    prefetch issued in the step before has begun, or its write-back is still running."""
    g = t.gaps[-1]
    if t.uses[0].k == 0 or (t.sid, g.i) not in b.keep:       # used first, or static
        return where[0]
    if on(b.keep.get((t.sid, g.i))):
        return "fast"
    zero = g.kernels.index(0)
    for v, pos, _, _ in b.fetch.get((t.sid, g.i), ()):
        if on(v) and pos <= zero:
            return "fast"
    for mv in moves:
        if mv.kind == "evict" and mv.sid == t.sid and mv.at == t.uses[g.i].k and \
                mv.drop != mv.at and g.kernels.index(mv.drop) >= zero:
            return "fast"
    return "slow"


def _eviction(b, t, at, use, kernels, dirty, rates, moves):
    """The eviction after kernel at, before the kernels of a gap (the next use at use, or -1
    for a dead tensor): a dirty one waits (sync) or is written back while its fast copy stays
    for as many kernels as the write-back takes (async), as the program counts it."""
    out = rates.copy_out(t.nbytes)
    sync = moves == "sync"
    if not dirty:
        return Move("evict", t.sid, at, use, t.nbytes, sync, False, 0.0, at)
    if sync:
        return Move("evict", t.sid, at, use, t.nbytes, True, True, out, at)
    exposed = max(0.0, out - sum(b.times[k] for k in kernels)) if use >= 0 else 0.0
    q = _buffer(kernels, b.times, out)
    return Move("evict", t.sid, at, use, t.nbytes, False, True, exposed,
                kernels[q - 1] if q else at)


def _dirty_flags(t, where, b, on):
    """Is the fast copy dirty after use i (written, or created, and kept in fast since)?"""
    m = len(t.uses)
    dirty = [False] * m
    kept = {g.i: on(b.keep.get((t.sid, g.i))) for g in t.gaps}
    prev = {g.j: g.i for g in t.gaps}
    for _ in range(2 if t.persistent else 1):          # twice round the cycle
        for i in range(m):
            d = where[i] == "fast" and (t.uses[i].writes or (i == 0 and t.made))
            j = prev.get(i)
            if j is not None and kept[j] and dirty[j]:
                d = True
            dirty[i] = d
    return dirty


def _penalty(b, placement, rates):
    """Seconds the kernels lose to slow operands under a placement (the cost model's rule)."""
    total = 0.0
    for k, ops in enumerate(b.ops):
        reads = writes = 0.0
        slow_write = False
        for _, u, sid in ops:
            if placement[(sid, k)] == "fast":
                continue
            reads += rates.read * u.read
            writes += rates.write * u.write
            slow_write = slow_write or u.writes
        total += max(reads + writes, rates.factor * b.times[k]) if slow_write else reads
    return total


# ---- the policy ---------------------------------------------------------------------------

class AutoTM(PlannedPolicy):
    """Places tensors by AutoTM's integer linear program (see the module docstring).

    time_limit: solver seconds per solve (a feasible solution found by then is used and its
    gap reported); mip_gap: relative optimality gap to stop at; moves: "static", "sync" or
    "async"; margin: fraction of fast memory kept free for heap fragmentation; retries: how
    many times the limits of the kernels where the plan overflowed the heap are lowered and
    the program solved again (0: plan once); node_limit: branch-and-bound nodes per solve (a
    limit that does not depend on the clock).
    """

    name = "autotm"
    honours_prefetch = False        # the plan decides (see ``prefetch``)

    def __init__(self, time_limit=100.0, mip_gap=0.001, moves="async", margin=0.03,
                 retries=3, node_limit=None, profile=None, profile_step=1):
        _check(time_limit, mip_gap, moves, margin, node_limit)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries={retries!r}: give how many times to solve again after "
                             "a heap overflow, an int >= 0, e.g. retries=3")
        super().__init__(profile=profile, profile_step=profile_step)
        self.time_limit, self.mip_gap, self.moves = time_limit, mip_gap, moves
        self.margin, self.retries, self.node_limit = margin, retries, node_limit
        self.solution = None
        self._aligning = False
        self._fetches, self._freeing, self._pending = {}, {}, None

    # ---- planning -------------------------------------------------------------------------

    def make_plan(self, step):
        m = self.manager
        options = dict(time_limit=self.time_limit, mip_gap=self.mip_gap, moves=self.moves,
                       margin=self.margin, node_limit=self.node_limit,
                       fast_profile=self.device_profile("fast"))
        slow = self.device_profile("slow")
        limits, best, tries, solving = None, None, [], 0.0
        for attempt in range(self.retries + 1):
            sol = solve(step, m.fast.size, slow, limits=limits, **options)
            solving += sol.seconds
            if self.retries == 0:
                best = (0.0, sol)
                break
            modelled, over = self._probe(step, sol, slow)
            tries.append({"objective": sol.objective, "replayed": modelled,
                          "overflows": len(over), "status": sol.status})
            if best is None or modelled < best[0]:
                best = (modelled, sol)
            if not over:
                break
            limits = _lowered(limits or [sol.limit] * len(step), over)
        self.execute(best[1])
        self.info.update(attempts=tries, solve_seconds_total=solving)
        self.align()

    def execute(self, sol):
        """Schedule a solution: allocations where their first use wants them, write-backs and
        drops after the last fast use of a gap, then the prefetches whose window begins at
        the next kernel."""
        self.solution = sol
        self._fetches, self._freeing, self._pending = {}, {}, None
        for sid, k in self.step.free_at.items():
            self._freeing.setdefault(k, []).append(sid)
        self.schedule(("step",), lambda mm: self.align())
        for i, (sid, _, _) in enumerate(self.step.allocs):
            self.alloc_plan[i] = sol.alloc.get(sid, "slow")
        for mv in sol.moves:
            if mv.kind == "prefetch":
                self._fetches.setdefault(mv.at, []).append((mv.sid, mv.wait))
            elif mv.drop == mv.at:
                self.schedule(("kernel_end", mv.at),
                              lambda mm, s=mv.sid, w=mv.wait: self.send(s, wait=w))
            else:
                self.schedule(("kernel_end", mv.at), lambda mm, s=mv.sid: self.write_back(s))
                self.schedule(("kernel_end", mv.drop), lambda mm, s=mv.sid: self.send(s))
        for k in sorted(self._fetches):
            point = ("kernel_end", k - 1) if k > 0 else ("step",)
            self.schedule(point, lambda mm, k=k: self._start(k))
            self.schedule(("kernel", k), lambda mm: self._flush())
        self.info.update(objective=sol.objective, bound=sol.bound, gap=sol.gap,
                         status=sol.status, variables=sol.variables,
                         constraints=sol.constraints, nonzeros=sol.nonzeros,
                         solve_seconds=sol.seconds, fast_only=sol.fast_only,
                         ratio=sol.ratio, moves=len(sol.moves), missed=0)

    def _probe(self, step, sol, slow):
        """Replay a run like this one under sol on virtual devices of this manager's sizes: (the
        modelled seconds of its last step, {kernel: bytes that did not fit there}). A plan made
        from this run's own profile is replayed after the same unplanned steps, with the
        profiled step run twice more under the plan."""
        from ..replay import replay

        m = self.manager
        if self.profile_source is None:
            trace = repeat_step(step.trace, step.step, 2)
            probe = _Probe(sol, None, step.step)
        else:
            trace, probe = step.trace, _Probe(sol, step, self.profile_step)
        probe.last_step = len(trace.step_kernels()) - 1
        # Slow memory as large as the run's, or the profile's (a profile from another run may
        # need more); virtual devices cost only address space.
        room = max(m.slow.size, 2 * trace.footprint())
        try:
            run = replay(trace, probe, fast=m.fast.size, slow=room, profile=slow,
                         granularity=m.fast.granularity)
        except OutOfMemoryError as e:               # the plan cannot be checked: keep it
            self.info["probe"] = f"not replayable here: {e}"
            return math.inf, {}
        return run.last.time, probe.overflow

    # ---- actions --------------------------------------------------------------------------

    def align(self):
        """At a step's start, move the persistent tensors that are not where the plan has them
        (the placement before the plan, or a move that did not happen): out first, then in,
        largest first (the heap packs them best that way)."""
        start = self.solution.start if self.solution is not None else {}
        self._aligning = True
        try:
            for sid in start:
                if start[sid] == "slow" and self.in_fast_sid(sid):
                    self.send(sid)
                    self.info["aligned"] = self.info.get("aligned", 0) + 1
            todo = [s for s in start if start[s] == "fast" and not self.in_fast_sid(s) and
                    self.live(s) is not None]
            for sid in sorted(todo, key=lambda s: -self.step.objects.get(s, 0)):
                self._bring(sid, False)
                self.info["aligned"] = self.info.get("aligned", 0) + 1
        finally:
            self._aligning = False

    def _start(self, k):
        """The prefetches whose window begins at kernel k: issued once the objects the profile
        frees before kernel k are gone (the program counted their memory as free)."""
        self._flush()
        waiting = {s for s in self._freeing.get(k, ()) if self.live(s) is not None}
        if waiting:
            self._pending = (k, waiting)
        else:
            self._issue(k)

    def _issue(self, k):
        for sid, wait in self._fetches.get(k, ()):
            self._bring(sid, wait)

    def _flush(self):
        """Issue prefetches still waiting for frees (the program went another way)."""
        if self._pending is not None:
            k, self._pending = self._pending[0], None
            self._issue(k)

    def forget(self, obj_id):
        pending = self._pending
        if pending is not None and self.manager.object(obj_id) is None:
            pending[1].discard(self.ids.sid.get(obj_id))
            if not pending[1]:
                self._flush()

    def place(self, nbytes, placement=None):
        self._flush()
        return super().place(nbytes, placement)

    def allocate(self, nbytes):
        self._flush()
        return super().allocate(nbytes)

    def _bring(self, sid, wait):
        if self.bring(sid, wait=wait) or self.live(sid) is None:
            return
        self.overflowed(self.live(sid).primary.nbytes)
        if not self.bring(sid, wait=wait, force=True):
            self.info["missed"] = self.info.get("missed", 0) + 1

    def overflowed(self, nbytes):
        """A planned placement did not fit the heap (the probe records where)."""

    def make_room(self, nbytes, wait=True):
        """Evictions the plan did not foresee (the heap is too fragmented for a planned
        placement) run in the background: a kernel waits only for the copies reading the
        memory its new region takes."""
        if self.planned and not self.manager.can_allocate(self.manager.fast, nbytes):
            self.overflowed(nbytes)
        return super().make_room(nbytes, wait=False)

    def write_back(self, sid):
        """Start copying sid's dirty fast copy to slow memory (when full, the first slower tier
        with room) in the background; the fast copy stays (clean once the copy ends), so a
        later eviction just drops it and no new region is placed over memory the copy is still
        reading. Copies on other tiers are stale and dropped, as an eviction drops them."""
        m = self.manager
        obj = self.live(sid)
        with m.atomic():
            if obj is None or obj.freed or obj.primary is None:
                return False
            x = obj.primary
            if x.device is not m.fast or m.pinned(obj) or not m.isdirty(x):
                return False
            for dev in m.tiers[1:]:
                y = m.getlinked(x, dev)
                new = y is None
                if new:
                    y = m.try_allocate(dev, x.nbytes, obj)
                if y is not None:
                    break
            else:
                return False
            self._drop_stale(obj, x, y)
            if new:
                m.link(x, y)
            m.copyto(y, x, wait=False)
            m.markclean(x)
            return True


class _Probe(AutoTM):
    """Runs a given solution and records, in the last step of the trace, the kernels where
    the plan did not fit the heap (the paper's allocator pass, section 3.4.2)."""

    def __init__(self, solution, profile, profile_step):
        super().__init__(retries=0, profile=profile, profile_step=profile_step)
        self.fixed = solution
        self.overflow = {}
        self.last_step = -1

    def make_plan(self, step):
        self.execute(self.fixed)
        self.align()

    def overflowed(self, nbytes):
        aligning = self._aligning                   # at the mark that begins the next step
        if self.steps_seen + aligning == self.last_step:
            k = 0 if aligning else min(self.plan.kernel, len(self.step) - 1)
            fast = self.manager.fast.stats()
            short = max(nbytes - fast["largest_free"], 1)
            self.overflow[k] = max(self.overflow.get(k, 0), short)


def _lowered(limits, over):
    """The paper's update: lower the limit of each kernel that overflowed (by 2%, or by the
    bytes that did not fit when that is more)."""
    out = list(limits)
    for k, short in over.items():
        out[k] = max(0, min(int(out[k] * 0.98), out[k] - short))
    return out


def optimum(trace, fast, profile="optane", **options):
    """AutoTM's modelled step time for a trace with this much fast memory (bytes, or a
    fraction of the trace's footprint as in ``ca.replay``): (objective seconds, lower bound,
    gap). The reference the other policies are measured against."""
    if isinstance(fast, float) and 0 < fast <= 16:
        fast = max(int(fast * trace.footprint()), 1 << 16)
    sol = solve(trace, fast, profile, **options)
    return sol.objective, sol.bound, sol.gap


register_policy(AutoTM.name, AutoTM)
