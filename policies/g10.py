"""G10 (MICRO'23): tensor vitality analysis, smart eviction to SSD or a middle tier, eager
prefetch; and the paper's baselines, on-demand unified memory and FlashNeuron.

Three tiers: ``tiers[0]`` is fast memory (the paper's GPU memory), ``tiers[1]`` a middle tier
(persistent memory or CXL; the paper's host memory) and ``tiers[-1]`` an SSD (a file; cost-model
profile "nvme-ssd"). With two tiers there is no middle tier and everything goes to the SSD.
Every policy here runs kernels in fast memory (``kernels_in_fast``): a kernel's operands are
staged into fast memory before it runs, and each operand fetched that way is a fault.

G10, from a profiled step (``StepProfile``):

- vitality analysis: each object's inactive periods, between consecutive uses, with nothing
  using it in between; an object alive across steps (weights) has a period that wraps from its
  last use to its first use in the next step; an object used last before it is freed has a
  tail period (evicted, never fetched back). A period's length is the sum of the profiled
  kernel times it spans.
- Alg. 1: memory pressure at each kernel = bytes of the live objects that no evicted period
  covers there. While the peak is above capacity, the period with the best benefit/cost is
  evicted: benefit = the pressure area above capacity it removes (over its kernels,
  min(size, excess) * kernel time), cost = eviction + prefetch time over the SSD link. It goes
  to the SSD, or to the middle tier when the SSD write link is busy when the eviction would
  start (or the SSD cannot bring it back in time) and the middle tier has room for it from then
  on. Copies are booked on each link's timeline (one per direction, cyclic over the step); the
  prefetch is booked at the latest safe time, and the pressure falls from the eviction to the
  kernel before which the prefetch is issued.
- eager prefetch: in order of their latest safe prefetch times, each prefetch moves back to the
  earliest kernel from which the object fits under capacity; an eviction whose object fits
  through its whole period is dropped.

The plan runs as ``send(sid, to=tier)`` at ``("kernel_end", last use)`` and
``bring(sid, force=True)`` at ``("kernel", prefetch kernel)``, both in the background; a
wrapped period's prefetch fires in step i for step i+1's first use. A use the plan missed is a
fault (``Policy.stage``); when the kernel's operands already in fast memory split its
free space so that another finds no block, they move out of the way and come back (faults).
``info``: periods and bytes evicted per tier, the predicted peak
pressure, evictions dropped by eager prefetch.

Baselines: ``BaseUVM`` ("uvm") fetches on demand only, evicting the least recently used
objects, to the middle tier while it has room, else to the SSD. ``FlashNeuron``
("flashneuron") offloads intermediates (objects made in the step whose inactive period spans
the forward-to-backward turn, the kernel where the most bytes are alive) to the SSD right
after their last forward use and brings them back at the latest safe time, one after another
on the SSD link, before their backward use; everything else is on demand as in BaseUVM.

What differs from the paper, and why: objects move whole (no 4 KiB pages); link timelines come
from the cost model's profiles (bandwidth min(read of source, write of destination), latency
once per copy); the planning capacity keeps ``headroom`` of fast memory free for heap rounding
and fragmentation, which pages would not suffer.
"""

import heapq
import math
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..errors import OutOfMemoryError
from ..registry import register_policy
from .base import Policy
from .planned import PlannedPolicy

__all__ = ["G10", "BaseUVM", "FlashNeuron", "Period", "Destination", "G10Planner",
           "vitality", "Link"]


# ---- link timelines -----------------------------------------------------------------------------

class Link:
    """Busy intervals of one copy direction over a cyclic step of `length` seconds.

    Times given and returned are unwrapped (any real number); bookings are kept modulo the
    step, so a copy at the end of one step delays a copy at the start of the next.
    """

    def __init__(self, length):
        if not length > 0:
            raise ValueError(f"a link timeline needs a step length > 0 seconds, got {length!r}")
        self.length = float(length)
        self.starts, self.ends = [], []      # disjoint, sorted, within [0, length]

    def _busy(self, a, b):
        """Unwrapped busy intervals overlapping [a, b), in order."""
        L, out = self.length, []
        for shift in range(math.floor(a / L), math.floor(b / L) + 1):
            lo, hi = a - shift * L, b - shift * L
            i0 = bisect_right(self.ends, lo)
            i1 = bisect_left(self.starts, hi)
            out += [(self.starts[i] + shift * L, self.ends[i] + shift * L) for i in range(i0, i1)]
        return out

    def busy_in(self, a, b):
        """Booked seconds within [a, b)."""
        return sum(min(e, b) - max(s, a) for s, e in self._busy(a, b))

    def earliest(self, t, dur):
        """Earliest start >= t of a free stretch of dur seconds."""
        cand = t
        for s, e in self._busy(t, t + self.length + dur):
            if s - cand >= dur:
                return cand
            cand = max(cand, e)
        return cand

    def latest(self, end, dur, lo):
        """Latest start s >= lo with [s, s + dur) free and s + dur <= end, or None."""
        if end - dur < lo:
            return None
        cand = end
        for s, e in reversed(self._busy(lo, end)):
            if cand - e >= dur:
                break
            cand = min(cand, s)
        return cand - dur if cand - dur >= lo else None

    def book(self, start, dur):
        """Mark [start, start + dur) busy (wrapped into the step)."""
        L = self.length
        dur = min(dur, L)
        s = start % L
        parts = [(s, s + dur)] if s + dur <= L else [(s, L), (0.0, s + dur - L)]
        for a, b in parts:
            i = bisect_left(self.ends, a)           # first interval ending at or after a
            j = bisect_right(self.starts, b)        # intervals starting at or before b
            if i < j:                               # merge the touching ones
                a, b = min(a, self.starts[i]), max(b, self.ends[j - 1])
            self.starts[i:j] = [a]
            self.ends[i:j] = [b]


# ---- vitality analysis --------------------------------------------------------------------------

@dataclass
class Period:
    """An inactive period of one object: after its use at kernel `last`, before its use at
    `next` (None: a tail, freed before any use); `kernels` are the kernels in between, in
    order (wrapping into the next step when `wraps`)."""

    sid: str
    size: int
    last: int
    next: object
    wraps: bool
    kernels: np.ndarray
    # filled in by planning
    tier: object = None               # destination name, or None (stays in fast memory)
    prefetch: int = 0                 # position in kernels before which the prefetch is issued
    latest: int = 0                   # ... at the latest safe time (before eager prefetch)
    prefetch_time: float = 0.0        # latest safe prefetch start (seconds, unwrapped)
    gone: int = 0                     # position in kernels from which its eviction is done
    dropped: bool = False             # evicted by Alg. 1, then kept by eager prefetch

    @property
    def tail(self):
        return self.next is None

    def prefetch_kernel(self):
        """The kernel before which the prefetch is issued (None for a tail)."""
        return None if self.tail else int(self.kernels[self.prefetch])

    def evicted_kernels(self):
        """Kernels during which the object is out of fast memory, as planned."""
        return self.kernels[self.gone:] if self.tail else self.kernels[self.gone:self.prefetch]


def vitality(step):
    """The inactive periods of every object of a StepProfile (see the module docstring)."""
    n = len(step)
    persistent = set(step.persistent)
    out = []
    for sid in step.objects:
        uses = sorted({k for k, _ in step.uses.get(sid, ())})
        if not uses:
            continue
        size = step.objects[sid]
        for a, b in zip(uses, uses[1:]):
            if b - a > 1:
                out.append(Period(sid, size, a, b, False, np.arange(a + 1, b)))
        first, last = uses[0], uses[-1]
        if sid in persistent:
            ks = np.concatenate([np.arange(last + 1, n), np.arange(0, first)])
            if len(ks):
                out.append(Period(sid, size, last, first, True, ks))
        else:
            _, free = step.lifetime(sid)
            if free - last > 1:
                out.append(Period(sid, size, last, None, False, np.arange(last + 1, free)))
    return out


# ---- Alg. 1 and eager prefetch ------------------------------------------------------------------

@dataclass
class Destination:
    """Where evicted objects go: bandwidths out of and into fast memory (B/s), latency per
    copy (s), capacity (bytes; None: unbounded)."""

    name: str
    out_bw: float
    in_bw: float
    latency: float = 0.0
    capacity: object = None

    def write_time(self, n):
        return self.latency + n / self.out_bw

    def read_time(self, n):
        return self.latency + n / self.in_bw


@dataclass
class G10Planner:
    """Alg. 1 and eager prefetch over a StepProfile. ssd: the default destination; middle: the
    one used when the SSD link is busy (None: none); block: bytes an object takes in fast
    memory (heap rounding); eager: move prefetches back."""

    step: object
    capacity: int
    ssd: Destination
    middle: object = None
    block: object = None
    eager: bool = True
    periods: list = field(default_factory=list)
    evicted: list = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        step = self.step
        n = len(step)
        block = self.block or (lambda nb: nb)
        self.tk = np.asarray(step.times, dtype=float)
        self.T = np.concatenate([[0.0], np.cumsum(self.tk)])[:n]
        self.L = float(self.tk.sum()) or 1.0
        self.size = {s: int(block(nb)) for s, nb in step.objects.items()}
        pressure = np.zeros(n + 1, dtype=np.int64)
        for s in step.objects:
            a, f = step.lifetime(s)
            if a < f:
                pressure[min(a, n)] += self.size[s]
                pressure[min(f, n)] -= self.size[s]
        self.pressure = np.cumsum(pressure)[:n]
        self.links = {}
        for d in (self.ssd, self.middle):
            if d is not None:
                self.links[d.name] = (Link(self.L), Link(self.L))     # (out, in)
        self.mid_occ = np.zeros(n, dtype=np.int64)
        self.mid_from = {}                # sid -> first kernel of its middle-tier reservation
        self._persistent = set(step.persistent)

    # -- times --------------------------------------------------------------------------------

    def _times(self, per):
        """Unwrapped start time of each kernel of a period."""
        t = self.T[per.kernels]
        if per.wraps:
            t = np.where(per.kernels <= per.last, t + self.L, t)
        return t

    def _use_time(self, per):
        return float(self.T[per.next] + (self.L if per.wraps else 0.0))

    def _evict_time(self, per):
        return float(self.T[per.last] + self.tk[per.last])

    # -- benefit and cost ---------------------------------------------------------------------

    def benefit(self, per, kernels=None):
        """Pressure area above capacity removed by evicting per over kernels (default: every
        kernel but the last, before which a prefetch must be issued at the latest)."""
        ks = (per.kernels if per.tail else per.kernels[:-1]) if kernels is None else kernels
        if not len(ks):
            return 0.0
        excess = self.pressure[ks] - self.capacity
        return float(np.minimum(np.maximum(excess, 0), per.size) @ self.tk[ks])

    def cost(self, per, dest=None):
        d = dest or self.ssd
        c = d.write_time(per.size)
        return c if per.tail else c + d.read_time(per.size)

    # -- one placement ------------------------------------------------------------------------

    def _schedule(self, per, dest):
        """(write start, read start, prefetch position, gone position) of evicting per to
        dest, or None when it cannot be out and back in time; the read start is None for a
        tail. Its room is free once the write is done (a kernel reusing it earlier waits)."""
        out, inn = self.links[dest.name]
        te = self._evict_time(per)
        wdur = dest.write_time(per.size)
        ws = out.earliest(te, wdur)
        times = self._times(per)
        g = int(np.searchsorted(times, ws + wdur, side="left"))
        if per.tail:
            return (ws, None, len(per.kernels), g) if g < len(per.kernels) else None
        rdur = dest.read_time(per.size)
        rs = inn.latest(self._use_time(per), rdur, ws + wdur)
        if rs is None:
            return None
        j = min(int(np.searchsorted(times, rs, side="right")) - 1, len(per.kernels) - 1)
        if j <= g:
            return None
        return ws, rs, j, g

    def _middle_room(self, per):
        d = self.middle
        if d is None:
            return False
        lo = self.mid_from.get(per.sid)
        ks = self._reservation(per)
        if lo is not None:          # already reserved from an earlier period onwards
            ks = ks[~np.isin(ks, self._reservation_from(per.sid, lo))]
        return not len(ks) or int((self.mid_occ[ks] + per.size).max()) <= d.capacity

    def _reservation_from(self, sid, k0):
        n = len(self.step)
        if sid in self._persistent:
            return np.arange(n)
        _, f = self.step.lifetime(sid)
        return np.arange(k0, f)

    def _reservation(self, per):
        """Kernels whose middle-tier bytes include per's object once it goes there: from the
        eviction until the object is freed (a copy stays linked after a prefetch)."""
        return self._reservation_from(per.sid, per.last + 1)

    def choose(self, per):
        """(destination, schedule) for per, by the paper's rule, or None."""
        ssd = self._schedule(per, self.ssd)
        busy = ssd is None or ssd[0] > self._evict_time(per) + 1e-12
        if busy and self._middle_room(per):
            mid = self._schedule(per, self.middle)
            if mid is not None:
                return self.middle, mid
        return (self.ssd, ssd) if ssd is not None else None

    def _apply(self, per, dest, sched):
        ws, rs, j, g = sched
        out, inn = self.links[dest.name]
        out.book(ws, dest.write_time(per.size))
        per.tier, per.prefetch, per.latest, per.gone = dest.name, j, j, g
        if rs is not None:
            inn.book(rs, dest.read_time(per.size))
            per.prefetch_time = rs
        self.pressure[per.evicted_kernels()] -= per.size
        if dest is self.middle:
            lo = self.mid_from.get(per.sid)
            new = self._reservation(per)
            if lo is not None:
                new = new[~np.isin(new, self._reservation_from(per.sid, lo))]
                self.mid_from[per.sid] = min(lo, per.last + 1)
            else:
                self.mid_from[per.sid] = per.last + 1
            self.mid_occ[new] += per.size
        self.evicted.append(per)

    # -- the algorithm ------------------------------------------------------------------------

    def run(self):
        """Plan: fills ``evicted`` (in the order chosen) and ``info``; returns self."""
        step = self.step
        self.periods = vitality(step)
        for per in self.periods:
            per.size = self.size[per.sid]
        peak0 = int(self.pressure.max()) if len(self.pressure) else 0
        heap = []
        for i, per in enumerate(self.periods):
            b = self.benefit(per)
            if b > 0:
                heap.append((-b / self.cost(per), i))
        heapq.heapify(heap)
        while heap and self.pressure.max() > self.capacity:
            _, i = heapq.heappop(heap)
            per = self.periods[i]
            b = self.benefit(per)
            if b <= 0:
                continue
            r = b / self.cost(per)
            if heap and r < -heap[0][0] * (1 - 1e-12):
                heapq.heappush(heap, (-r, i))           # stale: its benefit fell
                continue
            choice = self.choose(per)
            if choice is None:
                continue
            dest, sched = choice
            if self.benefit(per, per.kernels[sched[3]:sched[2]]) <= 0:
                continue
            self._apply(per, dest, sched)
        dropped = self._eager() if self.eager else 0
        self._report(peak0, dropped)
        return self

    def _eager(self):
        """Eager prefetch (see the module docstring); returns the evictions dropped."""
        cap = self.capacity
        dropped = 0
        for per in sorted((p for p in self.evicted if not p.tail),
                          key=lambda p: (p.prefetch_time % self.L, p.sid)):
            j, g = per.prefetch, per.gone
            while j > g and self.pressure[per.kernels[j - 1]] + per.size <= cap:
                j -= 1
            if j == per.prefetch:
                continue
            self.pressure[per.kernels[j:per.prefetch]] += per.size
            per.prefetch = j
            if j == g:
                per.dropped = True
                dropped += 1
        return dropped

    def _report(self, peak0, dropped):
        kept = [p for p in self.evicted if not p.dropped]
        per_tier = {}
        for p in kept:
            e = per_tier.setdefault(p.tier, {"periods": 0, "bytes": 0})
            e["periods"] += 1
            e["bytes"] += p.size
        self.info = {"capacity": int(self.capacity), "peak_before": peak0,
                     "predicted_peak": int(self.pressure.max()) if len(self.pressure) else 0,
                     "periods": len(self.periods), "evicted": len(kept),
                     "dropped_by_eager": dropped, "tiers": per_tier,
                     "tails": sum(p.tail for p in kept)}

    @property
    def plan(self):
        """The kept evictions, in the order chosen."""
        return [p for p in self.evicted if not p.dropped]


# ---- shared mechanics ---------------------------------------------------------------------------

class _Tiered:
    """Where an object evicted on demand goes: the middle tier while it has room, else the SSD
    (``spill_middle=False``: always the SSD); program prefetches move nothing."""

    kernels_in_fast = True
    spill_middle = True

    def middle(self):
        t = self.manager.tiers
        return t[1] if len(t) > 2 else None

    def ssd(self):
        return self.manager.tiers[-1]

    def tier_for(self, obj, first):
        """The tier (a name) obj leaves fast memory for: first if it has room for obj (or a
        copy of it), else the middle tier, the SSD, then any other; None when none has."""
        m = self.manager
        x = obj.primary
        order = [m._device(first), self.middle(), self.ssd(), *m.tiers[1:]]
        for dev in dict.fromkeys(d for d in order if d is not None and d is not m.fast):
            if m.getlinked(x, dev) is not None or m.can_allocate(dev, x.nbytes):
                return dev.name
        return None

    def evict(self, obj, to=None, wait=True):
        m = self.manager
        if to is None and obj.primary is not None and obj.primary.device is m.fast:
            mid = self.middle()
            to = mid.name if self.spill_middle and mid is not None and \
                m.can_allocate(mid, obj.primary.nbytes) else self.ssd().name
            to = self.tier_for(obj, to) or to     # none has room: OutOfMemoryError naming it
        return Policy.evict(self, obj, to, wait)

    # -- staging: a kernel's own operands never keep it from running ---------------------------

    _stage_ops = ()                   # operands of the kernel being staged, in kernel order

    def stage(self, reads, writes, name="kernel"):
        """Policy.stage, and when the kernel's operands already in fast memory split its free
        space so that another operand finds no block, they move out of the way (``make_room``)
        and are fetched back after it (faults): staging fails only when the operands cannot
        be in fast memory at once."""
        m = self.manager
        ops = list({id(o): o for o in (*reads, *writes)}.values())
        saved = self._stage_ops
        self._stage_ops = ops
        try:
            for _ in range(len(ops) + 1):
                Policy.stage(self, reads, writes, name)
                if all(o.primary is None or o.primary.device is m.fast for o in ops):
                    return
        finally:
            self._stage_ops = saved
        need = sum(m.fast.block_size(o.nbytes) for o in ops)
        raise OutOfMemoryError(self._stage_error(
            name, ops, need, "cannot all be there: moving some out of the way to make a block "
            "for another left no block for them on the way back"))

    def make_room(self, nbytes, wait=True):
        return Policy.make_room(self, nbytes, wait) or self._aside(nbytes, wait)

    def _aside(self, nbytes, wait):
        """While staging: evict the kernel's operands that sit in fast memory, smallest first,
        until a block of nbytes is free (they come back through ``stage``). Returns success."""
        m = self.manager
        fast = m.fast
        if not self._stage_ops:
            return False
        there = [o for o in self._stage_ops if not o.freed and o.primary is not None and
                 o.primary.device is fast and not m.pinned(o)]
        for o in sorted(there, key=lambda o: o.nbytes):     # stable: kernel order on ties
            mid = self.middle()
            to = mid.name if mid is not None and m.can_allocate(mid, o.primary.nbytes) \
                else self.ssd().name
            to = self.tier_for(o, to)
            if to is None:
                continue
            size = o.nbytes
            if not Policy.evict(self, o, to, wait):
                continue
            m.count("staging_aside", size, id=o.id, to=to)
            if Policy.make_room(self, nbytes, wait):
                return True
        return m.can_allocate(fast, nbytes)

    def alloc_slow(self, nbytes):
        """A new object that fast memory cannot take: the middle tier while it has room (and
        ``spill_middle``), else the SSD."""
        m = self.manager
        mid = self.middle()
        if self.spill_middle and mid is not None:
            obj = m.create(mid, nbytes)
            if obj is not None:
                return obj
        obj = m.create(self.ssd(), nbytes)
        return obj if obj is not None else Policy.alloc_slow(self, nbytes)

    def unplanned(self, nbytes, placement=None):
        """Before a plan exists: fast memory, evicting to make room (kernels run there)."""
        obj = self.alloc_fast(nbytes, force=True)
        return obj if obj is not None else self.alloc_slow(nbytes)

    def destination(self, dev):
        """A planning Destination for tier dev (bandwidths from the tiers' profiles)."""
        fast = self.device_profile(self.manager.fast)
        p = self.device_profile(dev)
        g = 1e9
        return Destination(dev.name, min(fast.read_gbps, p.write_gbps) * g,
                           min(p.read_gbps, fast.write_gbps) * g, max(fast.latency, p.latency),
                           dev.size)


def _check_tiers(policy):
    m = policy.manager
    if len(m.tiers) < 2:
        raise ValueError(f"{type(policy).__name__} needs at least two tiers (fast and SSD)")


# ---- G10 ----------------------------------------------------------------------------------------

class G10(_Tiered, PlannedPolicy):
    """G10's planned migrations (see the module docstring).

    headroom: fraction of fast memory the plan keeps free (heap rounding and fragmentation:
    objects move whole, so a fuller plan makes the heap evict off plan);
    middle_headroom: the same for the middle tier; eager: eager prefetch on or off.
    """

    name = "g10"
    spill_middle = False           # the middle tier's room is the plan's

    def __init__(self, profile=None, profile_step=1, headroom=0.3, middle_headroom=0.05,
                 eager=True):
        super().__init__(profile, profile_step)
        for what, v in (("headroom", headroom), ("middle_headroom", middle_headroom)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"{what}={v!r}: give a fraction in [0, 1), e.g. 0.05")
        if not isinstance(eager, (bool, np.bool_)):
            raise ValueError(f"eager={eager!r}: give True or False")
        self.headroom = float(headroom)
        self.middle_headroom = float(middle_headroom)
        self.eager = bool(eager)
        self.planner = None
        self.returns = {}             # kernel -> sids evicted off plan, brought back there
        self.force_returns = False

    def bind(self, manager):
        Policy.bind(self, manager)
        _check_tiers(self)
        PlannedPolicy.bind(self, manager)

    def make_plan(self, step):
        m = self.manager
        ssd = self.destination(self.ssd())
        mid = self.middle()
        middle = None
        if mid is not None:
            middle = self.destination(mid)
            middle.capacity = int(mid.size * (1 - self.middle_headroom))
        cap = int(m.fast.size * (1 - self.headroom))
        pl = self.planner = G10Planner(step, cap, ssd, middle, block=m.fast.block_size,
                                       eager=self.eager).run()
        for i in range(len(step.allocs)):
            self.alloc_plan[i] = "fast"
        for per in pl.plan:
            self.schedule(("kernel_end", per.last),
                          lambda m, s=per.sid, to=per.tier: self._send(s, to))
            if not per.tail:
                self.schedule(("kernel", per.prefetch_kernel()),
                              lambda m, s=per.sid: self.bring(s, force=True))
        self.info = dict(pl.info)
        self.returns = {}
        for k in range(len(step)):
            self.schedule(("kernel", k), lambda m, k=k: self._repair(k))

    def select_victims(self, nbytes):
        """Belady's order over the repeating step: an object used again only in the next step
        (a weight) is as far as its first use there, not infinitely far."""
        step = self.step
        if step is None:
            return PlannedPolicy.select_victims(self, nbytes)
        m = self.manager
        objs = [m.parent(r) for r in m.regions_on(m.fast.name)]
        objs = [o for o in objs if o is not None and not o.freed]
        k = self.kernel_index()
        n = len(step)
        sid = self.ids.sid.get
        persistent = self.planner._persistent

        def distance(o):
            s = sid(o.id)
            if s is None:
                return math.inf
            nxt = step.next_use(s, k + 1)
            if nxt is None and s in persistent:
                nxt = step.next_use(s, 0)
                return math.inf if nxt is None else nxt + n
            return math.inf if nxt is None else nxt

        objs.sort(key=distance, reverse=True)
        return objs

    def evict(self, obj, to=None, wait=True):
        """Evictions the plan did not make (room the heap's fragmentation needs): the object
        goes to the SSD and comes back at its latest safe time before its next use."""
        m = self.manager
        victim = to is None and self.step is not None and obj.primary is not None and \
            obj.primary.device is m.fast
        done = super().evict(obj, to, wait)
        if victim and done:
            self._return(obj)
        return done

    def make_room(self, nbytes, wait=True):
        """Victims are written back in the background (a kernel that reuses their room waits
        for the copy, as the cost model charges)."""
        return Policy.make_room(self, nbytes, wait=False) or \
            Policy.make_room(self, nbytes, wait) or self._aside(nbytes, wait)

    def _return(self, obj):
        pl, step = self.planner, self.step
        s = self.ids.sid.get(obj.id)
        if s is None:
            return
        k = self.kernel_index()
        n = len(step)
        u = step.next_use(s, k + 1)
        wrap = 0.0
        if u is None:
            if s not in pl._persistent:
                return
            u = step.next_use(s, 0)
            if u is None:
                return
            wrap = pl.L
        t = pl.T[u] + wrap - pl.ssd.read_time(obj.nbytes)
        p = int(np.searchsorted(pl.T, t % pl.L if t >= pl.L else t, side="right")) - 1
        if wrap and t < pl.L:           # still in this step
            p = max(p, k + 1)
        elif not wrap:
            p = max(p, k + 1)
        if p >= n or (not wrap and p >= u):
            return                      # too late to help: the use faults
        self.returns.setdefault(p, []).append(s)
        self.info["returns"] = self.info.get("returns", 0) + 1

    def _repair(self, k):
        for s in self.returns.pop(k, ()):
            self.bring(s, force=self.force_returns)

    def _send(self, sid, to):
        """A planned eviction; to another tier when the planned one lacks a block for it (the
        middle tier, then the SSD), and none when no tier has one (it stays in fast memory)."""
        m = self.manager
        obj = self.live(sid)
        if obj is None or obj.primary is None or obj.primary.device is not m.fast:
            return False
        there = self.tier_for(obj, to)
        if there != to:
            m.count("plan_missed", obj.nbytes, what=f"tier {to!r} full", to=there)
            if there is None:
                return False
        return self.send(sid, to=there)


# ---- baselines ----------------------------------------------------------------------------------

class _Recency:
    """Least recently used order of the objects in fast memory, by object id: the policy holds
    no reference to an object, so one the program drops is freed at once (a reference held
    here would keep it alive until evicted, and its free would then happen inside a later
    allocation, where a replay of the trace cannot put it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.order = OrderedDict()      # object id -> None, least recently used first

    def _touch(self, obj):
        self.order[obj.id] = None
        self.order.move_to_end(obj.id)

    def read_use(self, obj):
        self._touch(obj)

    def write_use(self, obj):
        Policy.write_use(self, obj)
        self._touch(obj)

    def on_fast(self, obj):
        self._touch(obj)

    def forget(self, obj_id):
        self.order.pop(obj_id, None)

    def select_victims(self, nbytes):
        """Fast objects the order does not know first, then least recently used first."""
        m = self.manager
        fast = m.fast
        order = self.order
        tracked = []
        for oid in list(order):
            o = m.object(oid)
            if o is None:
                order.pop(oid, None)
            elif o.primary is not None and o.primary.device is fast:
                tracked.append(o)
        seen = {o.id for o in tracked}
        other = [m.parent(r) for r in m.regions_on(fast.name)]
        return [o for o in other if o is not None and o.id not in seen] + tracked


class BaseUVM(_Recency, _Tiered, Policy):
    """On-demand unified memory: operands fetched when a kernel needs them (faults), least
    recently used objects evicted, to the middle tier while it has room, else the SSD."""

    name = "uvm"
    honours_prefetch = False
    honours_softevict = False
    tracks_reads = True

    def bind(self, manager):
        super().bind(manager)
        _check_tiers(self)

    def allocate(self, nbytes):
        obj = self.alloc_fast(nbytes, force=True)
        return obj if obj is not None else self.alloc_slow(nbytes)

    def place(self, nbytes, placement=None):
        return self.allocate(nbytes)

    def prefetch(self, obj, force=False, wait=True):
        return self.in_fast(obj)


class FlashNeuron(_Recency, _Tiered, PlannedPolicy):
    """Intermediates offloaded to the SSD across the forward-to-backward turn, everything else
    on demand (see the module docstring)."""

    name = "flashneuron"
    tracks_reads = True

    def bind(self, manager):
        Policy.bind(self, manager)
        _check_tiers(self)
        PlannedPolicy.bind(self, manager)

    @staticmethod
    def turn(step):
        """The kernel where the most bytes are alive (the forward-to-backward turn)."""
        live = step.live_bytes()
        return max(range(len(live)), key=live.__getitem__) if live else 0

    def offloads(self, step):
        """(sid, last forward use, first backward use) of each intermediate offloaded."""
        k = self.turn(step)
        out = []
        for sid in step.objects:
            if sid not in step.alloc_at:
                continue
            uses = sorted({u for u, _ in step.uses.get(sid, ())})
            before = [u for u in uses if u < k]
            after = [u for u in uses if u >= k]
            if before and after and after[0] - before[-1] > 1:
                out.append((sid, before[-1], after[0]))
        return out

    def make_plan(self, step):
        ssd = self.destination(self.ssd())
        times = np.asarray(step.times, dtype=float)
        T = np.concatenate([[0.0], np.cumsum(times)])
        for i in range(len(step.allocs)):
            self.alloc_plan[i] = "fast"
        todo = self.offloads(step)
        cursor = math.inf            # the SSD read link, filled backwards from the last use
        fetch = {}
        for sid, last, nxt in sorted(todo, key=lambda x: (-x[2], x[0])):
            end = min(T[nxt], cursor)
            start = end - ssd.read_time(step.objects[sid])
            cursor = start
            p = int(np.searchsorted(T[:len(step)], start, side="right")) - 1
            fetch[sid] = min(max(p, last + 1), nxt - 1)
        for sid, last, nxt in todo:
            self.schedule(("kernel_end", last),
                          lambda m, s=sid: self.send(s, to=self.ssd().name))
            self.schedule(("kernel", fetch[sid]), lambda m, s=sid: self.bring(s, force=True))
        self.info = {"offloaded": len(todo),
                     "bytes": sum(step.objects[s] for s, _, _ in todo),
                     "turn": self.turn(step)}


for _cls in (G10, BaseUVM, FlashNeuron):
    register_policy(_cls.name, _cls)
