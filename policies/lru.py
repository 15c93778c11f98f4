"""The default policy: true least-recently-used eviction with a soft-evicted tier.

Every use (``read_use``/``write_use``, which every kernel and access scope reports) moves an
object to the most-recent end. ``softevict`` moves it to a separate tier that is evicted first.
Presets (``LRU(preset=...)``) set the switches as in the dissertation's CachedArrays runs
(Table 4.7):

=========  ============  ===========  =========  =====================================
preset     local_alloc   cleanup      prefetch   and, beyond the dissertation
=========  ============  ===========  =========  =====================================
CA:∅       False         False        False
CA:L       True          False        False
CA:LM      True          True         False      write_allocate, writeback=0.2
CA:LMP     True          True         True       write_allocate, writeback=0.2, lookahead=4
=========  ============  ===========  =========  =====================================

With ``local_alloc=False`` every new array is allocated in slow memory and then cached in fast
memory with a linked slow copy, as a hardware cache would (a compulsory copy on first use).

Three switches use what the policy lab made possible (each off by default):

- ``write_allocate``: an array a kernel is about to write whose data is in slow memory is brought
  into fast memory first (a kernel writing to slow memory runs about twice as long, Fig. 3.4),
  never evicting the kernel's other operands to make room.
- ``writeback``: whenever arrays are released (a kernel ends, a new array is filled), while less
  than this fraction of fast memory is free, the least recently used arrays are evicted in the
  background, so that new arrays find room without waiting for an eviction (write-back overlaps
  the next kernels instead).
- ``lookahead``: learn one step's kernels and prefetch in the background the operands of the
  kernel this many kernels ahead (see ``_Lookahead``).
"""

from bisect import bisect_left
from collections import OrderedDict

import numpy as np

from .._records import LRURecord
from .._records import bind_lru as _bind_lru
from ..manager import Manager, Observer
from ..registry import register_policy
from ..trace import StableIds
from .base import Policy

PRESETS = {
    "CA:0": dict(local_alloc=False, cleanup=False, prefetch=False),
    "CA:L": dict(local_alloc=True, cleanup=False, prefetch=False),
    "CA:LM": dict(local_alloc=True, cleanup=True, prefetch=False, write_allocate=True,
                  writeback=0.2),
    "CA:LMP": dict(local_alloc=True, cleanup=True, prefetch=True, write_allocate=True,
                   writeback=0.2, lookahead=4),
}


class _Kernels(Observer):
    """write_allocate before each kernel and background write-back after it (see the module
    docstring)."""

    def __init__(self, policy):
        self.policy = policy

    def on_acquire(self, name, reads, writes, touched=None):
        p = self.policy
        if not (p.write_allocate and writes):
            return
        m = p.manager
        fast = m.fast
        todo = [o for o in writes if o.primary is not None and o.primary.device is not fast
                and not o.freed and not m.pinned(o) and m.fits(fast, o.nbytes)]
        if not todo:
            return
        p.spare = {o.id for o in (*reads, *writes)}
        try:
            for o in todo:
                if o.primary.device is not fast:
                    Policy.prefetch(p, o, True)
        finally:
            p.spare = ()

    def on_release(self, objs):
        if self.policy.writeback:
            self.policy.write_back()


class _Lookahead(Observer):
    """Learns the kernels of one step (their operands' stable ids) and, from the next step on,
    prefetches in the background the operands of the kernel ``depth`` kernels ahead.

    Fired when a kernel ends, so nothing of the next kernels is pinned yet. The evictions that
    make room spare every object the learned step uses before the prefetched one is needed.
    """

    def __init__(self, policy, depth):
        self.policy = policy
        self.depth = depth
        self.ids = StableIds.of(policy.manager)
        self.learned = None           # [(sids of kernel k's operands)] of the last whole step
        self.current = []
        self.k = 0
        self.open = []
        self.until = None             # last kernel whose operands evictions spare, if set
        self.uses = {}                # sid -> kernel indices of the learned step that use it

    def on_acquire(self, name, reads, writes, touched=None):
        sid = self.ids.get
        self.current.append(tuple(sid(o.id) for o in (*reads, *writes)))
        self.open.append(sorted(o.id for o in (*reads, *writes)))
        self.k += 1

    def on_release(self, objs):
        if not self.open or self.open[-1] != sorted(o.id for o in objs):
            return
        self.open.pop()
        plan = self.learned
        if plan is None or self.open:
            return
        k, d = self.k, self.depth
        if k + d > len(plan):
            return
        m = self.policy.manager
        live = self.ids.obj_id

        def objects(kernels):
            return [o for o in (m.object(live[s]) for ks in kernels for s in ks if s in live)
                    if o is not None]

        target = k + d - 1                               # the kernel entering the window
        todo = [o for o in objects(plan[target:target + 1])
                if o.primary is not None and o.primary.device is not m.fast]
        if not todo:
            return
        self.until = target
        try:
            for o in todo:
                p = o.primary
                if p is not None and p.device is not m.fast and not m.pinned(o):
                    self.policy.prefetch(o, True, wait=False)
        finally:
            self.until = None

    def spared(self, oid):
        """True if the learned step uses this object before the kernel being made room for
        (the prefetch target, or else the next ``depth`` kernels): do not evict it."""
        if self.learned is None:
            return False
        hi = self.until if self.until is not None else self.k + self.depth - 1
        return _used_between(self.uses.get(self.ids.sid.get(oid)), self.k, hi)

    def on_mark(self, kind):
        if kind == "step":
            self.learned, self.current, self.k = self.current, [], 0
            uses = {}
            for i, sids in enumerate(self.learned):
                for s in sids:
                    uses.setdefault(s, []).append(i)
            self.uses = uses


def _used_between(indices, lo, hi):
    """True if a sorted list of kernel indices has one in [lo, hi]."""
    if not indices:
        return False
    i = bisect_left(indices, lo)
    return i < len(indices) and indices[i] <= hi


def _touching(self, obj):
    self._touch(obj)


def _is_switch(v):
    """True for True, False (or NumPy's bools, or the ints 0 and 1)."""
    return isinstance(v, (bool, np.bool_)) or (isinstance(v, int) and v in (0, 1))


class LRU(Policy, LRURecord):
    """Least-recently-used placement; see the module docstring for the switches.

    ``recent`` and ``soft`` are fields of a C record (``LRURecord``): the manager's C paths
    (a ufunc's result, a free) run ``read_use``, ``new_in_fast`` and ``forget`` on them
    without a Python frame while these methods are LRU's own (``native/records.c``).
    """

    name = "lru"
    fast_first = True                  # with local_alloc (set per instance)
    honours_prefetch = True
    honours_softevict = True
    tracks_reads = True

    def __init__(self, local_alloc=True, prefetch=True, cleanup=True, preset=None, lookahead=0,
                 write_allocate=False, writeback=0.0):
        super().__init__()
        if preset is not None:
            key = preset.upper().replace("∅", "0")
            if not key.startswith("CA:"):
                key = "CA:" + key
            if key not in PRESETS:
                raise ValueError(f"unknown LRU preset {preset!r}; presets are {', '.join(PRESETS)}")
            p = PRESETS[key]
            local_alloc, cleanup, prefetch = p["local_alloc"], p["cleanup"], p["prefetch"]
            lookahead = p.get("lookahead", 0)
            write_allocate = p.get("write_allocate", False)
            writeback = p.get("writeback", 0.0)
        for what, v in (("local_alloc", local_alloc), ("prefetch", prefetch),
                        ("cleanup", cleanup), ("write_allocate", write_allocate)):
            if not _is_switch(v):
                raise ValueError(f"LRU: {what}={v!r} must be True or False")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"lookahead must be a number of kernels >= 0, got {lookahead!r}")
        if isinstance(writeback, bool) or not isinstance(writeback, (int, float)) or \
                not 0 <= writeback < 1:
            raise ValueError(f"writeback must be a fraction of fast memory in [0, 1), got "
                             f"{writeback!r}")
        self.lookahead = lookahead
        self.write_allocate = bool(write_allocate)
        self.writeback = float(writeback)
        self.spare = ()                  # object ids make_room must not evict now
        self._ahead = None
        self._kernels = None
        self.local_alloc = local_alloc
        self.allows_prefetch = bool(prefetch)
        self.allows_cleanup = bool(cleanup)
        self.recent = OrderedDict()      # id -> None, least recent first
        self.soft = OrderedDict()        # soft-evicted tier, evicted before `recent`

    # The tiers are fields of the C record, not of __dict__: copy and pickle carry them
    # explicitly (object's default reduction refuses a type with C fields).
    def __getstate__(self):
        return {**self.__dict__, "recent": self.recent, "soft": self.soft}

    def __setstate__(self, state):
        state = dict(state)
        self.recent = state.pop("recent", OrderedDict())
        self.soft = state.pop("soft", OrderedDict())
        self.__dict__.update(state)

    def bind(self, manager):
        super().bind(manager)
        if (self.write_allocate or self.writeback) and self._kernels is None:
            self._kernels = _Kernels(self)
            manager.observe(self._kernels)
        if self.lookahead and self.allows_prefetch and self._ahead is None:
            self._ahead = _Lookahead(self, self.lookahead)
            manager.observe(self._ahead)

    # ---- allocation ----------------------------------------------------------------------

    @property
    def local_alloc(self):
        """True: new arrays go to fast memory (evicting to make room), else slow memory."""
        return self._local_alloc

    @local_alloc.setter
    def local_alloc(self, value):
        self._local_alloc = bool(value)
        self.fast_first = self._local_alloc and type(self).fast_first and \
            not {"allocate", "alloc_fast"} & self.__dict__.keys()     # none assigned on self

    def allocate(self, nbytes):
        if self._local_alloc:
            obj = self.alloc_fast(nbytes, force=True)
            return obj if obj is not None else self.alloc_slow(nbytes)
        obj = self.alloc_slow(nbytes)
        self.manager.markclean(obj.primary)
        Policy.prefetch(self, obj, force=True)
        return obj

    # ---- usage ---------------------------------------------------------------------------

    def _touch(self, obj):
        oid = obj.id
        if oid in self.recent:
            self.recent.move_to_end(oid)
        elif oid in self.soft:
            del self.soft[oid]
            self.recent[oid] = None

    def read_use(self, obj):
        oid = obj.id                     # _touch, inlined (the per-kernel path)
        if oid in self.recent:
            self.recent.move_to_end(oid)
        elif oid in self.soft:
            del self.soft[oid]
            self.recent[oid] = None

    def write_use(self, obj):
        self.manager.markdirty(obj.primary)
        self.read_use(obj)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "_touch" in cls.__dict__ and "read_use" not in cls.__dict__:
            cls.read_use = _touching          # read_use is _touch inlined: keep the override

    def new_in_fast(self, obj):
        # on_fast + write_use for an object just created (its id is in neither tier yet, and
        # its region is already dirty)
        self.recent[obj.id] = None

    def on_fast(self, obj):
        self.soft.pop(obj.id, None)
        self.recent[obj.id] = None
        self.recent.move_to_end(obj.id)

    def forget(self, obj_id):
        self.recent.pop(obj_id, None)
        if self.soft:
            self.soft.pop(obj_id, None)

    def softevict(self, obj):
        oid = obj.id
        if oid in self.recent:
            del self.recent[oid]
            self.soft[oid] = None
        elif oid in self.soft:
            self.soft.move_to_end(oid)

    # ---- movement ------------------------------------------------------------------------

    def prefetch(self, obj, force=False, wait=True):
        if not self.allows_prefetch:
            return self.in_fast(obj)
        if wait and force and self._ahead is not None and self._ahead.learned is not None:
            # The lookahead brings operands in ahead of use. A copy made now, just before the
            # use, stalls the kernel for longer than reading in place costs; take it only if it
            # needs no evictions.
            force = False
        return super().prefetch(obj, force, wait)

    def select_victims(self, nbytes):
        m = self.manager
        out, later = [], []
        ahead, spare = self._ahead, self.spare
        for table in (self.soft, self.recent):
            for oid in list(table):
                obj = m.object(oid)
                if obj is None or obj.freed:
                    table.pop(oid, None)
                    continue
                if oid in spare:
                    continue
                (later if ahead is not None and ahead.spared(oid) else out).append(obj)
        return out + later

    def evictable(self, obj):
        return obj.id not in self.spare

    def write_back(self):
        """Evict least recently used arrays in the background until the ``writeback`` fraction
        of fast memory is free (called whenever arrays are released)."""
        m = self.manager
        fast = m.fast
        want = int(fast.size * self.writeback)
        if fast.stats()["free"] >= want:
            return
        for v in self._victims(want):
            if v.primary is not None and v.primary.device is fast and not m.pinned(v):
                self.evict(v, wait=False)
                if fast.stats()["free"] >= want:
                    return

    def tiers(self):
        """(soft-evicted ids, regular ids), least recent first: for tests and reports."""
        return list(self.soft), list(self.recent)


register_policy(LRU.name, LRU)
_bind_lru(LRU.read_use, LRU.new_in_fast, LRU.forget, LRU.write_use, Manager.markdirty)
