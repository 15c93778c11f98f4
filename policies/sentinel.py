"""Sentinel (HPCA'21): short-lived tensors in a fast arena, long-lived ones migrated per interval.

The paper profiles one training step (tensor sizes, lifetimes in layers, main-memory accesses
counted by poisoning page-table entries) and runs every later step from that profile:

- short-lived tensors (allocated and freed in one layer) live in a reserved, reused fast arena
  and never move; the arena is reserved when an interval opens, as large as the short-lived
  bytes the interval has alive at once, and shrinks as they are freed;
- long-lived tensors with the same layer span are co-allocated, most accessed first, so that
  pages hold tensors of one lifetime and one heat;
- a step is cut into intervals of MIL layers; when interval i opens, the long-lived tensors
  interval i+1 uses are prefetched, most accessed first, into fast memory beside the arena; a
  long-lived tensor leaves fast memory as soon as the rest of its interval no longer uses it
  (eager eviction: its room lets the queued prefetches proceed);
- MIL is the candidate whose modelled step is fastest (Eq. 1 first narrows the candidates: an
  interval's tensors must fit in fast memory beside its arena);
- a prefetch still copying when its interval opens (Case 3) is either waited for or cancelled,
  the interval then reading the slow copy, whichever is faster (test-and-trial).

How it maps here. The profile is a ``StepProfile`` (PlannedPolicy). A tensor's access count is
the number of kernels that use it in the step (no page-table poisoning in user space). The
arena is a byte reserve of the plan: short-lived objects are always allocated in fast memory
and are never victims. A walk over the profiled step, with the cost model's rules (copies
serialize per link, kernels wait for their operands' copies, slow operands cost what
``costmodel`` charges), tracks fast-memory bytes and the clock and yields the plan: where each
new object goes, and the prefetches, evictions and cancellations at each trigger point. New
long-lived objects go to fast memory when the plan has room; the room an interval's own new
objects will need is kept free of prefetches. Case 3 is decided per interval by walking the
interval both ways. The walk models every MIL candidate; the best few are replayed
(``ca.replay``: the real manager and heap) on the profile, and the fastest replay wins.

What differs, and why. Regions are per object, so there is no page false sharing: the
co-allocation order only orders prefetches and evictions (``characterize`` shows its effect on
a page map). Case 3 is settled in planning, on the model, instead of by trial steps. Traces
without layer marks use kernels as layers. Evictions are issued before the next kernel, once
its outputs are placed, so a block being written back is not the next one handed out; a tensor
that the interval open at that point prefetches stays. A tensor past its last use in the step
that the program has not freed yet (TensorFlow would have freed it) is evicted only when its
room is needed. A planned prefetch that the heap cannot place for lack of a large enough free
block (pages would not care) makes room in Belady's order.
"""

import math

from .. import costmodel
from ..registry import register_policy
from ..replay import replay
from ..stepprofile import StepProfile
from ..trace import Trace
from .planned import PlannedPolicy, repeat_step

__all__ = ["Sentinel", "characterize", "format_characterization", "mil_sweep",
           "mil_candidates", "PAGE"]

PAGE = 4096                           # bytes of a page (the paper's tensors "under a page")
MAX_SWEPT = 16                        # every MIL up to this is a candidate ...
LARGER = (20, 24, 32, 48, 64)         # ... and these, when the step has that many layers
HOT = 10                              # accesses from which the paper calls a tensor hot
CASE3 = ("trial", "wait", "stay")
_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 9, "2-9"), (10, 99, "10-99"), (100, None, "100+"))


# ---- the profiled step, as Sentinel sees it ---------------------------------------------------

def _units(step):
    """(unit of each kernel, number of units): layers, or kernels when there are no marks."""
    if step.layers > 1:
        return list(step.layer_of), step.layers
    return list(range(len(step))), max(len(step), 1)


def _unit_span(step, unit_of, sid):
    """(first unit, last unit) sid is alive in."""
    n = len(step)
    if not n:
        return 0, 0
    a, f = step.lifetime(sid)
    return unit_of[min(a, n - 1)], unit_of[min(max(a, f - 1), n - 1)]


def _is_short(step, unit_of, sid):
    """Allocated and freed in the same unit (``StepProfile.short_lived`` for layered traces)."""
    if sid not in step.alloc_at or sid not in step.free_at:
        return False
    first, last = _unit_span(step, unit_of, sid)
    return first == last


def _step_events(step):
    """The profiled step's kernels (numbered within the step), allocations, frees and layer
    marks, in order."""
    local = {kid: k for k, kid in enumerate(step.kernel_ids)}
    out, cur = [], 0
    for e in step.trace.events:
        kind = e[0]
        if kind == "step":
            cur += 1
            if cur > step.step:
                break
        elif cur < step.step:
            continue
        elif kind == "kernel":
            out.append(("kernel", local[e[1]]))
        elif kind in ("alloc", "free"):
            out.append((kind, e[1]))
        elif kind == "layer":
            out.append(("layer",))
    return out


def _coallocation(step, unit_of, sids):
    """Long-lived sids in co-allocation order: grouped by unit span, most accessed first."""
    pos = {s: i for i, s in enumerate(step.objects)}
    return sorted(sids, key=lambda s: (_unit_span(step, unit_of, s), -step.access_count(s),
                                       pos[s]))


class _Layout:
    """What planning needs from the profiled step, whatever the MIL."""

    def __init__(self, step, block):
        self.step = step
        self.by_layer = step.layers > 1
        self.unit_of, self.units = _units(step)
        self.events = _step_events(step)
        self.short = {s for s in step.objects if _is_short(step, self.unit_of, s)}
        self.size = {s: block(nb) for s, nb in step.objects.items()}
        self.long = _coallocation(step, self.unit_of,
                                  [s for s in step.objects if s not in self.short])
        self.rank = {s: i for i, s in enumerate(self.long)}
        self.short_live = self._short_live()
        self.largest = max((step.objects[s] for s in self.long), default=0)

    def _short_live(self):
        """Bytes of short-lived objects alive before each event (and after the last)."""
        live, out = 0, []
        for e in self.events:
            out.append(live)
            if e[0] == "alloc" and e[1] in self.short:
                live += self.size[e[1]]
            elif e[0] == "free" and e[1] in self.short:
                live -= self.size[e[1]]
        out.append(live)
        return out

    def prefetch_key(self, sid):
        """Most accessed first; ties in co-allocation order."""
        return -self.step.access_count(sid), self.rank[sid]


# ---- one MIL: intervals, and the plan's walk over the step ------------------------------------

class _Intervals:
    """The step cut into intervals of mil units: their events, uses and eviction points."""

    def __init__(self, layout, mil):
        self.layout, self.mil = layout, mil
        step = layout.step
        self.count = -(-layout.units // mil)
        self.of_kernel = [u // mil for u in layout.unit_of]
        self.points, self.starts = self._cut()
        self.last_in = {}                     # (sid, interval) -> last kernel using it there
        for s in layout.long:
            for k, _ in step.uses.get(s, ()):
                self.last_in[(s, self.of_kernel[k])] = k
        self.used = [set() for _ in range(self.count)]
        for s, j in self.last_in:
            self.used[j].add(s)
        resident = set(step.resident)
        self.nxt = [self.used[j + 1] if j + 1 < self.count else self.used[0] & resident
                    for j in range(self.count)]
        self.queue = [sorted(n, key=layout.prefetch_key) for n in self.nxt]
        self.evict_at, self.dead_at = self._evictions()
        self.room = self._room()
        self.arena = self._arena()
        first = [self.starts[j + 1] if j + 1 < len(self.starts) else 0
                 for j in range(self.count)]
        self.ahead = [self.arena[i] + self.room[i] for i in first]
        self.tensor = [sum(layout.size[s] for s in used) for used in self.used]

    def _arena(self):
        """arena[i]: the fast bytes the short-lived objects of event i's interval need from
        event i on (reserved when the interval opens, shrinking as they are freed)."""
        live = self.layout.short_live
        arena = [0] * (len(live))
        for j in range(self.count):
            peak = 0
            for i in reversed(self.segment(j)):
                peak = max(peak, live[i + 1])
                arena[i] = max(peak, live[i])
        return arena

    def eq1(self, capacity):
        """Eq. 1: every interval's long-lived tensors fit beside its arena."""
        return all(t + self.arena[self.starts[j]] < capacity
                   for j, t in enumerate(self.tensor))

    def _cut(self):
        """(trigger point, first event index) of each interval."""
        lay = self.layout
        points, starts = [("step",)], [0]
        layer = k = 0
        for i, e in enumerate(lay.events):
            if e[0] == "layer":
                j = (layer + 1) // self.mil
                if lay.by_layer and (layer + 1) % self.mil == 0 and j < self.count:
                    points.append(("layer", layer))
                    starts.append(i + 1)
                layer += 1
            elif e[0] == "kernel":
                if not lay.by_layer and k and k % self.mil == 0:
                    points.append(("kernel", k))
                    starts.append(i)
                k += 1
        return points, starts

    def segment(self, j):
        end = self.starts[j + 1] if j + 1 < len(self.starts) else len(self.layout.events)
        return range(self.starts[j], end)

    def _evictions(self):
        """(evict, dead): kernel -> long-lived sids to evict once it has ended (their last use
        in their interval, unless the next interval uses them, or the interval open when the
        eviction comes prefetches them), and kernel -> sids it used last in the step that the
        step frees later (dead: evicted only to make room)."""
        step = self.layout.step
        survivors = set(step.survivors)
        n = len(step)
        out, dead = {}, {}
        for (s, j), k in self.last_in.items():
            if s in self.nxt[j]:
                continue
            after = self.of_kernel[k + 1] if k + 1 < n else 0
            if after != j and s in self.nxt[after]:
                continue              # evicted once the next interval opened: it prefetches s
            if step.last_use(s) == k and s not in survivors:
                dead.setdefault(k, []).append(s)
            else:
                out.setdefault(k, []).append(s)
        for table in (out, dead):
            for sids in table.values():
                sids.sort(key=self.layout.rank.get)
        return out, dead

    def _room(self):
        """room[i]: the most bytes the new long-lived objects of event i's interval will add
        from event i on (kept free of prefetches so that they find fast memory)."""
        lay = self.layout
        delta = [0] * len(lay.events)
        for j in range(self.count):
            mine = set()
            for i in self.segment(j):
                e = lay.events[i]
                if e[0] == "alloc" and e[1] not in lay.short and self.wanted(e[1], j):
                    mine.add(e[1])
                    delta[i] += lay.size[e[1]]
                elif e[0] == "kernel" and e[1]:
                    gone = [s for s in self.evict_at.get(e[1] - 1, ()) if s in mine]
                    mine.difference_update(gone)
                    delta[i] -= sum(lay.size[s] for s in gone)
                elif e[0] == "free" and e[1] in mine:
                    mine.discard(e[1])
                    delta[i] -= lay.size[e[1]]
        room = [0] * (len(lay.events) + 1)
        for j in range(self.count):
            nxt = 0
            for i in reversed(self.segment(j)):
                nxt = room[i] = max(0, delta[i] + nxt)
        return room

    def wanted(self, sid, j):
        """Is a new long-lived object worth fast memory: its interval or the next uses it."""
        return sid in self.used[j] or sid in self.nxt[j]


class _Walk:
    """The plan's walk over one step: fast-memory bytes, the cost model's clock, the actions.

    Clock rules as in ``cachedarrays.costmodel``: copies serialize per link at
    min(R(src), W(dst)) plus latency; a kernel waits for copies of its operands; slow operands
    add reads * (1/R(slow) - 1/R(fast)), and a slow output makes the kernel at least F times
    as long. Heap addresses are not modelled (the replay of the plan is).
    """

    def __init__(self, iv, capacity, profiles, factor=costmodel.SLOW_OUTPUT_FACTOR):
        self.iv = iv
        self.lay = iv.layout
        self.cap = capacity
        fast, slow = profiles
        g = 1e9
        self.R = (fast.read_gbps * g, slow.read_gbps * g)
        self.W = (fast.write_gbps * g, slow.write_gbps * g)
        self.bw_in = min(slow.read_gbps, fast.write_gbps) * g
        self.bw_out = min(fast.read_gbps, slow.write_gbps) * g
        self.lat = max(fast.latency, slow.latency)
        self.F = factor
        self.t = self.link_in = self.link_out = 0.0
        self.fast, self.dirty, self.alive = set(), set(), set(self.lay.step.resident)
        self.ready_f, self.ready_s = {}, {}
        self.last_in = None                   # (sid, start) of the link's last copy in
        self.occ = self.short = 0             # fast bytes of long-, short-lived objects
        self.j = self.begun = 0               # interval, kernels begun
        self.pending, self.issued, self.held, self.dead = [], [], {}, []
        self.dead_bytes = 0                   # fast bytes of dead objects (no use left)
        self.smallest = 0                     # smallest pending prefetch
        self.actions, self.alloc, self.choices, self.late = [], {}, {}, {}
        self.ordinal = 0
        self.choice = "wait"

    def clone(self):
        """An independent copy (to walk an interval two ways)."""
        c = object.__new__(_Walk)
        c.__dict__.update(self.__dict__)
        for name in ("fast", "dirty", "alive", "ready_f", "ready_s", "pending", "issued", "dead",
                     "held", "actions", "alloc", "choices", "late"):
            setattr(c, name, type(getattr(self, name))(getattr(self, name)))
        return c

    # -- the clock --------------------------------------------------------------------------

    def _copy_in(self, s):
        """A background copy slow -> fast, after the link's previous copies."""
        start = max(self.t, self.link_in, self.ready_s.get(s, 0.0))
        end = self.link_in = start + self.lat + self.lay.step.objects[s] / self.bw_in
        self.ready_f[s] = end
        self.last_in = (s, start)

    def _copy_out(self, s):
        """A background write-back fast -> slow."""
        start = max(self.t, self.link_out, self.ready_f.get(s, 0.0))
        end = self.link_out = start + self.lat + self.lay.step.objects[s] / self.bw_out
        self.ready_s[s] = end

    def _kernel(self, k):
        """Kernel k: waits for its operands' copies, then runs, slower for slow operands."""
        step = self.lay.step
        name, reads, writes = step.kernels[k]
        w, rd, wr, off_write = self.t, 0.0, 0.0, False
        for s, is_write in [(s, False) for s in reads] + [(s, True) for s in writes]:
            n = 0 if name == "view" else step.operand_bytes(k, s)
            if s in self.fast:
                w = max(w, self.ready_f.get(s, 0.0))
                if is_write:
                    self.dirty.add(s)
            else:
                w = max(w, self.ready_s.get(s, 0.0))
                if is_write:
                    wr += n * (1 / self.W[1] - 1 / self.W[0])
                    off_write = True
                else:
                    rd += n * (1 / self.R[1] - 1 / self.R[0])
        comp = step.times[k]
        self.t = w + comp + (max(rd + wr, (self.F - 1) * comp) if off_write else rd)

    # -- actions ----------------------------------------------------------------------------

    def _bring(self, point, s):
        """Prefetch s (a plan action at point)."""
        self._copy_in(s)
        self.fast.add(s)
        self.dirty.discard(s)
        self.occ += self.lay.size[s]
        self.issued.append(s)
        self.actions.append((point, "bring", s))

    def _send(self, point, s):
        """Evict s (point None: an eviction the runtime makes itself, not a plan action)."""
        if s in self.dirty:
            self._copy_out(s)
        self.fast.discard(s)
        self.dirty.discard(s)
        self.occ -= self.lay.size[s]
        self._undead(s)
        if point is not None:
            self.actions.append((point, "send", s))

    def _cancel(self, point, s):
        """Case 3, "stay": the copy stops and s runs from slow memory (the cost model frees
        the link only when the cancelled copy is its last)."""
        self.fast.discard(s)
        self.occ -= self.lay.size[s]
        if self.last_in is not None and self.last_in[0] == s:
            self.link_in = max(self.t, self.last_in[1])
        self.actions.append((point, "cancel", s))

    def _try_queue(self, point, i, k=None):
        """Prefetch the pending sids that fit (most accessed first). What must stay free from
        event i on: this interval's arena and the room its new objects need, and, when the
        next interval opens, its arena and room."""
        iv, size = self.iv, self.lay.size
        need = max(iv.arena[i] + iv.room[i], iv.ahead[self.j])
        if not self.pending or self.occ - self.dead_bytes + need + self.smallest > self.cap:
            return
        keep = []
        for s in self.pending:
            if s in self.fast:
                continue
            blocked = s not in self.alive or (k is not None and self.held.get(s, -1) >= k) \
                or (k is None and s in self.held)
            if blocked or not self._fits(point, size[s] + need):
                keep.append(s)
                continue
            self._bring(point, s)
        self.pending = keep

    # -- the walk ---------------------------------------------------------------------------

    def late_copies(self):
        """Prefetches issued for the interval starting now that are still copying."""
        return [s for s in self.issued if s in self.fast and self.ready_f.get(s, 0.0) > self.t]

    def interval(self, j, choice="wait"):
        """Walk interval j; choice "stay" cancels the late prefetches at its start."""
        self.choice, self.j = choice, j
        if j == 0 or self.lay.by_layer:
            self._open(j, choice)
        for i in self.iv.segment(j):
            self._event(i, j)
        if j == self.iv.count - 1 and len(self.lay.step):
            self._evict_after(len(self.lay.step) - 1, ("tail",))

    def _open(self, j, choice):
        """The start of interval j: Case 3, then the prefetches for interval j + 1."""
        iv, point = self.iv, self.iv.points[j]
        late = self.late_copies()
        if late:
            self.late[j] = len(late)
            self.choices[j] = choice
        self.held = {}
        if choice == "stay":
            for s in late:
                self._cancel(point, s)
                self.held[s] = iv.last_in.get((s, j), -1)
        self.pending, self.issued = list(iv.queue[j]), []
        self.smallest = min((self.lay.size[s] for s in self.pending), default=0)
        self._try_queue(point, iv.starts[j] + (0 if self.lay.by_layer or not j else 1))

    def _event(self, i, j):
        e = self.lay.events[i]
        kind = e[0]
        if kind == "kernel":
            k = e[1]
            if k:
                self._evict_after(k - 1, ("kernel", k))
            if i == self.iv.starts[j] and not self.lay.by_layer and j:
                self._open(j, self.choice)
            else:
                self._try_queue(("kernel", k), i + 1, k)
            self.begun = k + 1
            self._kernel(k)
        elif kind == "alloc":
            self._new(e[1], i)
        elif kind == "free":
            s = e[1]
            self.alive.discard(s)
            self._undead(s)
            if s in self.fast:
                self.fast.discard(s)
                self.dirty.discard(s)
                if s in self.lay.short:
                    self.short -= self.lay.size[s]
                else:
                    self.occ -= self.lay.size[s]

    def _fits(self, point, nbytes):
        """Do nbytes more fit in fast memory, once dead objects (no use left in the step) are
        evicted if need be (point None: the runtime's forced allocation evicts them)?"""
        if self.occ + nbytes <= self.cap:
            return True
        if self.occ - self.dead_bytes + nbytes > self.cap:
            return False
        while self.occ + nbytes > self.cap:
            self._send(point, self.dead[0])
        return True

    def _evict_after(self, k, point):
        """Evictions of the objects whose interval no longer uses them after kernel k, issued
        before the next kernel: the outputs allocated for that kernel are placed by then, so
        the blocks being written back are not the first ones handed out again."""
        for s in self.iv.evict_at.get(k, ()):
            if s in self.fast:
                self._send(point, s)
            elif s in self.alive:             # in case a run put it in fast meanwhile
                self.actions.append((point, "send", s))
        for s in self.iv.dead_at.get(k, ()):
            if s in self.fast:
                self.dead.append(s)
                self.dead_bytes += self.lay.size[s]

    def _undead(self, s):
        """s left fast memory or was freed: no longer a dead object there."""
        if self.dead_bytes and s in self.dead:
            self.dead.remove(s)
            self.dead_bytes -= self.lay.size[s]

    def _new(self, s, i):
        """A new object: short-lived ones in the arena (fast unless larger than fast memory),
        long-lived ones in fast memory when the interval's arena leaves room for them."""
        n, self.ordinal = self.ordinal, self.ordinal + 1
        self.alive.add(s)
        self.ready_f.pop(s, None)
        self.ready_s.pop(s, None)
        size = self.lay.size[s]
        if s in self.lay.short:
            fast = size <= self.cap
            if fast:
                self.short += size
                self._make_room()
        else:
            fast = self.iv.wanted(s, self.j) and self._fits(None, size + self.iv.arena[i])
            if fast:
                self.occ += size
        self.alloc[n] = "fast" if fast else "slow"
        if fast:
            self.fast.add(s)
            self.dirty.add(s)

    def _make_room(self):
        """The arena outgrew the plan: evict long-lived objects in Belady's order (as the
        forced allocation will)."""
        if self.occ + self.short <= self.cap:
            return
        step, k = self.lay.step, self.begun
        def distance(s):
            nxt = step.next_use(s, k)
            return math.inf if nxt is None else nxt

        victims = sorted((s for s in self.fast if s not in self.lay.short),
                         key=lambda s: (-distance(s), self.lay.rank[s]))
        for s in victims:
            if self.occ + self.short <= self.cap:
                break
            self._send(None, s)

    def step(self, case3):
        """Walk every interval. An interval opening with late prefetches (Case 3) waits or
        stays as case3 says; "trial" walks it both ways and keeps the one that ends it sooner
        (waiting on a tie)."""
        for j in range(self.iv.count):
            if case3 == "trial" and self.late_copies():
                ways = []
                for n, choice in enumerate(("wait", "stay")):
                    w = self.clone()
                    w.interval(j, choice)
                    ways.append((w.t, n, w))
                best = min(ways, key=lambda x: x[:2])[2]
                self.__dict__.update(best.__dict__)
            else:
                self.interval(j, case3 if case3 != "trial" else "wait")
        return self

    def next_step(self):
        """The state a following step starts from (residents keep their place; clocks shift)."""
        lay, t = self.lay, self.t
        w = _Walk.__new__(_Walk)
        w.__dict__.update(self.__dict__)
        resident = set(lay.step.resident)
        w.t = 0.0
        w.link_in, w.link_out = max(0.0, self.link_in - t), max(0.0, self.link_out - t)
        w.last_in = None if self.last_in is None else (self.last_in[0], self.last_in[1] - t)
        w.fast = {s for s in self.fast if s in resident}
        w.dirty = {s for s in self.dirty if s in w.fast}
        w.alive = set(resident)
        w.ready_f = {s: v - t for s, v in self.ready_f.items() if s in resident}
        w.ready_s = {s: v - t for s, v in self.ready_s.items() if s in resident}
        w.occ = sum(lay.size[s] for s in w.fast if s not in lay.short)
        w.short, w.j, w.begun = 0, 0, 0
        w.issued = [s for s in self.issued if s in w.fast]
        w.pending, w.held, w.dead, w.dead_bytes = [], {}, [], 0
        w.actions, w.alloc, w.choices, w.late = [], {}, {}, {}
        w.ordinal = 0
        return w


def _plan(layout, mil, capacity, profiles, case3):
    """The steady-state walk of one MIL: a first step from slow memory, then the next."""
    iv = _Intervals(layout, mil)
    first = _Walk(iv, capacity, profiles).step(case3)
    return first.next_step().step(case3)


def mil_candidates(units, largest=MAX_SWEPT):
    """Every MIL up to largest (and the step), then a few larger ones up to the step."""
    out = list(range(1, min(units, largest) + 1))
    out += [m for m in LARGER if largest < m < units]
    if units > largest:
        out.append(units)
    return out


# ---- the policy -------------------------------------------------------------------------------

class Sentinel(PlannedPolicy):
    """Sentinel's plan: short-lived objects in a fast arena, long-lived ones prefetched an
    interval ahead and evicted after their last use in an interval (see the module docstring).

    mil: layers per migration interval (None: the fastest of the swept candidates);
    candidates: the MILs to sweep (default ``mil_candidates``); case3: what a prefetch that is
    late at its interval's start does: "trial" (per interval, whichever is faster), "wait" or
    "stay" (cancel it; the interval reads the slow copy); replays: how many of the MILs the
    plan's model finds best are replayed to choose among them (0: the model alone).
    """

    name = "sentinel"
    honours_prefetch = False          # the plan moves objects; the program's requests do not

    def __init__(self, mil=None, candidates=None, case3="trial", replays=4, profile=None,
                 profile_step=1):
        super().__init__(profile=profile, profile_step=profile_step)
        if isinstance(replays, bool) or not isinstance(replays, int) or replays < 0:
            raise ValueError(f"replays={replays!r}: give how many of the best-modelled MILs to "
                             "replay, an int >= 0 (0: the model alone), e.g. replays=4")
        self.replays = replays
        self.mil = _check_mil(mil, "mil") if mil is not None else None
        if candidates is not None:
            if isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__iter__"):
                raise ValueError(f"candidates={candidates!r}: give MILs to sweep, e.g. "
                                 "candidates=[2, 4, 8]")
            candidates = sorted({_check_mil(c, "candidates") for c in candidates})
            if not candidates:
                raise ValueError("candidates is empty; give at least one MIL, e.g. "
                                 "candidates=[2, 4, 8]")
        self.candidates = candidates
        if case3 not in CASE3:
            raise ValueError(f"case3={case3!r}: give one of {CASE3}, e.g. case3='trial'")
        self.case3 = case3
        self.short = frozenset()       # sids of the short-lived objects (the arena)
        self.actions = {}             # plan point -> ((op, sid), ...): "bring", "send", "cancel"
        self.skipped = 0

    # -- planning ---------------------------------------------------------------------------

    def make_plan(self, step):
        m = self.manager
        layout = _Layout(step, m.fast.block_size)
        cap = m.fast.capacity
        self.short = frozenset(layout.short)
        profiles = (self.device_profile(m.fast), self.device_profile("slow"))
        mil = self.mil if self.mil is not None else self._sweep(step, layout, cap, profiles)
        mil = min(mil, layout.units)
        walk = _plan(layout, mil, cap, profiles, self.case3)
        self.info.update(self._facts(walk, cap))
        self.alloc_plan = dict(walk.alloc)
        self._install_actions(walk.actions)

    @staticmethod
    def _facts(walk, cap):
        """What planning found, for reports."""
        iv, lay = walk.iv, walk.lay
        arena = max((iv.arena[i] for i in iv.starts), default=0)
        facts = {"mil": iv.mil, "intervals": iv.count,
                 "units": "layers" if lay.by_layer else "kernels", "layers": lay.units,
                 "short_lived": len(lay.short), "long_lived": len(lay.long), "arena": arena,
                 "fast": cap, "largest_long_lived": lay.largest, "modelled": walk.t,
                 "case3": dict(sorted(walk.choices.items())),
                 "late": dict(sorted(walk.late.items())),
                 "access_count": "kernels using the tensor in the step (no page-table "
                                 "poisoning in user space)"}
        need = arena + lay.largest
        if cap < need:
            facts["below_lower_bound"] = (
                f"fast memory ({cap} bytes) is below the arena ({arena}) plus the largest "
                f"long-lived tensor ({lay.largest}): the paper reports losses over 20% here; "
                f"give fast memory of at least {need} bytes")
        return facts

    def _sweep(self, step, layout, cap, profiles):
        """The MIL of the fastest steady-state step. Eq. 1 narrows the candidates (all stay
        when none satisfies it); the plan's walk models each; the best ``replays`` of them
        are replayed on the profile (real manager and heap) and the fastest replay wins."""
        cands = [c for c in self.candidates or mil_candidates(layout.units)
                 if c <= layout.units] or [layout.units]
        fits = [c for c in cands if _Intervals(layout, c).eq1(cap)]
        compute = step.compute() or 1.0
        model = [(c, _plan(layout, c, cap, profiles, self.case3).t / compute)
                 for c in fits or cands]
        self.info.update(eq1=fits, mil_model=model)
        best = sorted(model, key=lambda x: (x[1], x[0]))[:self.replays]
        if not best:
            return best_of(model)
        trace = _steady(step)
        sweep = []
        for c, _ in sorted(best):
            run = replay(trace, Sentinel(mil=c, case3=self.case3, profile=step),
                         fast=self.manager.fast.size, profile=profiles[1])
            sweep.append((c, run.ratio))
        self.info["mil_sweep"] = sweep
        return best_of(sweep)

    def _install_actions(self, actions):
        """One trigger per point; the evictions after the step's last kernel run at the step
        mark, before the first interval opens."""
        by_point = {}
        for point, op, sid in actions:
            by_point.setdefault(point, []).append((op, sid))
        tail = by_point.pop(("tail",), [])
        if tail:
            by_point[("step",)] = tail + by_point.get(("step",), [])
        self.actions = {point: tuple(ops) for point, ops in by_point.items()}
        for point, ops in self.actions.items():
            self.schedule(point, lambda m, ops=ops: self._run(m, ops))
        self.info["actions"] = len(actions)

    # -- running the plan -------------------------------------------------------------------

    def _run(self, m, ops):
        for op, sid in ops:
            if op == "bring":
                if not (self.bring(sid) or self._unfragment(sid)):
                    self.skipped += 1
                    self.info["prefetch_skipped"] = self.skipped
            elif op == "send":
                self.send(sid)
            else:
                obj = self.live(sid)
                if obj is not None and not obj.freed:
                    m.cancel(obj)

    def _unfragment(self, sid):
        """A planned prefetch refused although fast memory has the bytes free: the heap has
        no block that large (pages would not care). Make one, evicting in Belady's order."""
        obj = self.live(sid)
        fast = self.manager.fast
        if obj is None or fast.stats()["free"] < fast.block_size(obj.nbytes):
            return False
        return self.bring(sid, force=True)

    def _arena_object(self, obj):
        return self.ids is not None and self.ids.sid.get(obj.id) in self.short

    def select_victims(self, nbytes):
        """Belady's order over long-lived objects: the arena is never migrated."""
        return [o for o in super().select_victims(nbytes) if not self._arena_object(o)]

    def evictable(self, obj):
        return not self._arena_object(obj)


def best_of(sweep):
    """The MIL of the lowest ratio in [(mil, ratio)] (the smaller MIL on a tie)."""
    return min(sweep, key=lambda x: (x[1], x[0]))[0]


def _check_mil(v, what):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{what}: {v!r} is not a number of layers per interval; give an int "
                         ">= 1, e.g. mil=4")
    return v


def _steady(step):
    """The profile's trace up to the end of the profiled step, then that step once more: a
    plan replayed on it from the start reaches a steady state in that last step. (Step 0
    also makes the program's first objects: it is not repeated.)"""
    trace = step.trace
    if step.step:
        return repeat_step(trace, step.step)
    marks = [i for i, e in enumerate(trace.events) if e[0] == "step"]
    end = marks[0] + 1 if marks else len(trace.events)
    return Trace(trace.objects, trace.events[:end], trace.kernels, trace.times, trace.meta,
                 devices=trace.devices, touched=trace.touched, pure=trace.pure,
                 partial=trace.partial)


def mil_sweep(trace, fast, profile="optane", mils=None):
    """[(mil, ratio)]: the modelled step of Sentinel with each MIL fixed (Fig. 5's analogue).

    trace: a Trace (or path); fast: as for ``ca.replay``; mils: default ``mil_candidates``.
    """
    if not isinstance(trace, Trace):
        trace = Trace.load(trace)
    if mils is None:
        mils = mil_candidates(_units(StepProfile.of(trace, min(1, trace.steps - 1)))[1])
    return [(c, replay(trace, Sentinel(mil=_check_mil(c, "mils")), fast=fast,
                       profile=profile).ratio) for c in mils]


# ---- characterization (the paper's motivation figures) ---------------------------------------

def characterize(trace, step=-1):
    """Sentinel's tensor characterization of one step of a trace (a Trace or path).

    Short-lived tensors (count, bytes, how many under a page), the access-count histogram
    (tensors and bytes per bucket), and the bytes per bucket counted per page (4 KiB) on two
    synthetic page maps: objects packed back to back in allocation order, and Sentinel's
    layout (short-lived objects of one layer together, long-lived ones grouped by span and
    most accessed first, groups page aligned). A page's access count is the number of kernels
    that touch any object on it; more hot bytes per page than per object is false sharing.
    """
    if not isinstance(trace, Trace):
        trace = Trace.load(trace)
    s = StepProfile.of(trace, step)
    unit_of, units = _units(s)
    sids = list(s.objects)
    short = [x for x in sids if _is_short(s, unit_of, x)]
    total = sum(s.objects.values())
    sbytes = sum(s.objects[x] for x in short)
    small = sum(1 for x in short if s.objects[x] < PAGE)
    kernels = {x: {k for k, _ in s.uses.get(x, ())} for x in sids}
    hist = [{"bucket": label, "tensors": 0, "bytes": 0} for _, _, label in _BUCKETS]
    for x in sids:
        b = hist[_bucket(len(kernels[x]))]
        b["tensors"] += 1
        b["bytes"] += s.objects[x]
    alloc_order = [tuple(sids)]
    return {
        "step": s.step, "units": "layers" if s.layers > 1 else "kernels", "layers": units,
        "tensors": len(sids), "bytes": total,
        "short_lived": {"tensors": len(short), "bytes": sbytes, "under_page": small,
                        "tensor_fraction": len(short) / len(sids) if sids else 0.0,
                        "byte_fraction": sbytes / total if total else 0.0,
                        "under_page_fraction": small / len(short) if short else 0.0},
        "histogram": hist,
        "hot_threshold": HOT,
        "pages": {"page": PAGE,
                  "allocation_order": _page_map(s, alloc_order, kernels),
                  "sentinel_layout": _page_map(s, _sentinel_groups(s, unit_of, short),
                                               kernels)},
    }


def _bucket(n):
    for i, (lo, hi, _) in enumerate(_BUCKETS):
        if n >= lo and (hi is None or n <= hi):
            return i
    return len(_BUCKETS) - 1


def _sentinel_groups(s, unit_of, short):
    """Sentinel's co-allocation: page-aligned groups of sids."""
    shorts = {}
    for x in short:
        shorts.setdefault(_unit_span(s, unit_of, x)[0], []).append(x)
    groups = [tuple(shorts[u]) for u in sorted(shorts)]
    shortset = set(short)
    longs = _coallocation(s, unit_of, [x for x in s.objects if x not in shortset])
    cur, key = [], None
    for x in longs:
        k = _unit_span(s, unit_of, x)
        if cur and k != key:
            groups.append(tuple(cur))
            cur = []
        cur.append(x)
        key = k
    if cur:
        groups.append(tuple(cur))
    return groups


def _page_map(s, groups, kernels):
    """Bytes per access bucket counted per page: each group starts on a new page, objects of a
    group back to back; a page's count is the kernels touching any object on it."""
    pages = {}                        # page -> set of kernels (boundary pages only)
    interior = [0] * len(_BUCKETS)    # pages wholly inside one object, per bucket
    addr = 0
    for group in groups:
        addr = -(-addr // PAGE) * PAGE
        for x in group:
            n = s.objects[x]
            if n <= 0:
                continue
            first, last = addr // PAGE, (addr + n - 1) // PAGE
            for p in {first, last}:
                pages.setdefault(p, set()).update(kernels[x])
            if last - first > 1:
                interior[_bucket(len(kernels[x]))] += last - first - 1
            addr += n
    per = list(interior)
    for ks in pages.values():
        per[_bucket(len(ks))] += 1
    out = [{"bucket": label, "pages": per[i], "bytes": per[i] * PAGE}
           for i, (_, _, label) in enumerate(_BUCKETS)]
    hot = sum(b["bytes"] for i, b in enumerate(out) if _BUCKETS[i][0] >= HOT)
    return {"pages": sum(per), "histogram": out, "hot_bytes": hot}


def format_characterization(d):
    """Report lines for ``characterize``'s dict."""
    sl = d["short_lived"]
    mib = 1 << 20
    lines = [f"step {d['step']}: {d['tensors']} tensors, {d['bytes'] / mib:.1f} MiB, "
             f"{d['layers']} {d['units']}",
             f"short-lived: {sl['tensors']} tensors ({sl['tensor_fraction']:.0%}), "
             f"{sl['bytes'] / mib:.1f} MiB ({sl['byte_fraction']:.0%}); under a page: "
             f"{sl['under_page']} ({sl['under_page_fraction']:.0%} of them)",
             "accesses  tensors       MiB  MiB per page (alloc order)  (Sentinel layout)"]
    alloc, layout = d["pages"]["allocation_order"], d["pages"]["sentinel_layout"]
    for b, a, s in zip(d["histogram"], alloc["histogram"], layout["histogram"]):
        lines.append(f"{b['bucket']:>8}  {b['tensors']:7d}  {b['bytes'] / mib:8.1f}  "
                     f"{a['bytes'] / mib:26.1f}  {s['bytes'] / mib:17.1f}")
    hot = sum(b["bytes"] for b, (lo, _, _) in zip(d["histogram"], _BUCKETS)
              if lo >= d["hot_threshold"])
    lines.append(f"hot (>= {d['hot_threshold']} accesses): {hot / mib:.1f} MiB per object, "
                 f"{alloc['hot_bytes'] / mib:.1f} MiB per page in allocation order, "
                 f"{layout['hot_bytes'] / mib:.1f} MiB per page in Sentinel's layout")
    return lines


register_policy(Sentinel.name, Sentinel)
