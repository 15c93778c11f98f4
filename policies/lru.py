"""The default policy: true least-recently-used eviction with a soft-evicted tier.

Every use (``read_use``/``write_use``, which every kernel and access scope reports) moves an
object to the most-recent end. ``softevict`` moves it to a separate tier that is evicted first.
Presets (``LRU(preset=...)``) set the switches as in the dissertation's CachedArrays runs
(Table 4.7):

=========  ============  ===========  =========
preset     local_alloc   cleanup      prefetch
=========  ============  ===========  =========
CA:∅       False         False        False
CA:L       True          False        False
CA:LM      True          True         False
CA:LMP     True          True         True
=========  ============  ===========  =========

With ``local_alloc=False`` every new array is allocated in slow memory and then cached in fast
memory with a linked slow copy, as a hardware cache would (a compulsory copy on first use).
"""

from collections import OrderedDict

from ..registry import register_policy
from .base import Policy

PRESETS = {
    "CA:0": dict(local_alloc=False, cleanup=False, prefetch=False),
    "CA:L": dict(local_alloc=True, cleanup=False, prefetch=False),
    "CA:LM": dict(local_alloc=True, cleanup=True, prefetch=False),
    "CA:LMP": dict(local_alloc=True, cleanup=True, prefetch=True),
}


class LRU(Policy):
    """Least-recently-used placement; see the module docstring for the switches."""

    name = "lru"
    honours_prefetch = True
    honours_softevict = True
    tracks_reads = True

    def __init__(self, local_alloc=True, prefetch=True, cleanup=True, preset=None):
        super().__init__()
        if preset is not None:
            key = preset.upper().replace("∅", "0")
            if not key.startswith("CA:"):
                key = "CA:" + key
            if key not in PRESETS:
                raise ValueError(f"unknown LRU preset {preset!r}; presets are {', '.join(PRESETS)}")
            local_alloc, cleanup, prefetch = (PRESETS[key][k] for k in
                                              ("local_alloc", "cleanup", "prefetch"))
        self.local_alloc = bool(local_alloc)
        self.allows_prefetch = bool(prefetch)
        self.allows_cleanup = bool(cleanup)
        self.recent = OrderedDict()      # id -> None, least recent first
        self.soft = OrderedDict()        # soft-evicted tier, evicted before `recent`

    # ---- allocation ----------------------------------------------------------------------

    def allocate(self, nbytes):
        if self.local_alloc:
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
        self._touch(obj)

    def write_use(self, obj):
        self.manager.markdirty(obj.primary)
        self._touch(obj)

    def on_fast(self, obj):
        self.soft.pop(obj.id, None)
        self.recent[obj.id] = None
        self.recent.move_to_end(obj.id)

    def forget(self, obj_id):
        self.recent.pop(obj_id, None)
        self.soft.pop(obj_id, None)

    def softevict(self, obj):
        oid = obj.id
        if oid in self.recent:
            del self.recent[oid]
            self.soft[oid] = None
        elif oid in self.soft:
            self.soft.move_to_end(oid)

    # ---- movement ------------------------------------------------------------------------

    def prefetch(self, obj, force=False):
        if not self.allows_prefetch:
            return self.in_fast(obj)
        return super().prefetch(obj, force)

    def select_victims(self, nbytes):
        m = self.manager
        out = []
        for table in (self.soft, self.recent):
            for oid in list(table):
                obj = m.object(oid)
                if obj is None or obj.freed:
                    table.pop(oid, None)
                    continue
                out.append(obj)
        return out

    def tiers(self):
        """(soft-evicted ids, regular ids), least recent first: for tests and reports."""
        return list(self.soft), list(self.recent)


register_policy(LRU.name, LRU)
