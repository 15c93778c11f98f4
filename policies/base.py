"""The policy API (dissertation Table 4.5) and its default mechanics.

A policy decides where objects live; the manager executes. The base class implements every
operation with the data-manager API (Listings 4.1 and 4.2), so a custom policy overrides only the
decisions it cares about: usually ``allocate``, ``select_victims`` and the use hooks.
"""

import types

from ..errors import OutOfMemoryError, PinnedError, UseAfterFreeError
from ..triggers import Plan
from ..sizes import format_size


# (capability, the method whose behaviour it describes): see Policy.__init_subclass__
_CAPABILITIES = (("honours_prefetch", "prefetch"), ("honours_softevict", "softevict"),
                 ("tracks_reads", "read_use"))
# new_in_fast is on_fast and write_use in one call (LRU's write_use is _touch): an override of
# a part needs the general form
_NEW_IN_FAST_PARTS = ("on_fast", "write_use", "_touch")
# methods whose assignment on an instance undoes a declaration (Policy.__setattr__)
_ASSIGNABLE = frozenset(("allocate", "alloc_fast", *_NEW_IN_FAST_PARTS,
                         *(method for _, method in _CAPABILITIES)))


def _label(dev):
    return f"{dev.name} memory" if dev.name in ("fast", "slow") else f"tier {dev.name!r}"


def _full(m, nbytes):
    """Why nbytes fits on no tier below fast memory, and what to do."""
    free = " and ".join(f"{_label(d)} has {format_size(d.stats()['free'])} free of "
                        f"{format_size(d.size)} (largest free block "
                        f"{format_size(d.stats()['largest_free'])})" for d in m.tiers)
    fix = ("give a slower tier a larger size in Manager(tiers=...)" if len(m.tiers) > 2 else
           "create the Manager with a larger slow= size")
    return (f"cannot allocate {format_size(nbytes)}: {free}. Free arrays "
            f"(ca.unsafe_free / cleanup) or {fix}")


class Policy:
    """Base policy: allocate fast when there is room, otherwise slow; move only when asked.

    Subclass hooks: ``allocate(nbytes)``, ``select_victims(nbytes)`` (which fast objects to evict
    first), ``read_use``/``write_use`` (usage tracking), ``on_fast``/``forget`` (residency).

    What a policy does with the annotations, so that callers (the models) can skip walks that
    would change nothing. Capabilities, declared by the class:

    - ``honours_prefetch``: ``prefetch`` may move an array into fast memory (False for policies
      that never move data on prefetch: FirstTouch, FastOnly, SlowOnly).
    - ``honours_softevict``: ``softevict`` changes which arrays are evicted first.
    - ``tracks_reads``: ``read_use`` records the use (``ca.prefetch`` of an array already in
      fast memory reports one), as LRU does.

    A subclass that overrides one of these methods without declaring the capability gets True
    (the safe answer: the annotation is always made). Switches, set per instance (see LRU):
    ``allows_prefetch`` (False: prefetch moves nothing), ``allows_cleanup`` (False:
    ``cleanup``/``noescape`` free nothing early) and ``kernels_in_fast`` (True: every kernel's
    operands are brought into fast memory before it runs, see ``stage``; the policy option
    ``kernels_in_fast=True`` sets it for any policy).
    """

    name = "base"
    honours_prefetch = True
    honours_softevict = False
    tracks_reads = False
    allows_prefetch = True
    allows_cleanup = True
    kernels_in_fast = False
    # allocate(nbytes) puts a new object in fast memory whenever it fits there without evicting
    # anything (alloc_fast: create, markdirty, on_fast), so the manager may create a kernel's
    # small result there itself and report it with new_in_fast. A subclass that overrides
    # allocate or alloc_fast without declaring it gets False.
    fast_first = True
    _staging = frozenset()            # ids of the operands of the kernel being staged

    def __init_subclass__(cls, **kwargs):
        """A method overridden below the class that declared its capability: assume True
        (fast_first: False; new_in_fast: the general form, if its parts were overridden)."""
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__

        def below(attr, method):
            declared = next(i for i, c in enumerate(mro) if attr in c.__dict__)
            defined = next(i for i, c in enumerate(mro) if method in c.__dict__)
            return defined < declared

        for attr, method in _CAPABILITIES:
            if attr not in cls.__dict__ and below(attr, method):
                setattr(cls, attr, True)
        if "fast_first" not in cls.__dict__ and \
                (below("fast_first", "allocate") or below("fast_first", "alloc_fast")):
            cls.fast_first = False
        if "new_in_fast" not in cls.__dict__ and \
                any(below("new_in_fast", m) for m in _NEW_IN_FAST_PARTS if hasattr(cls, m)):
            cls.new_in_fast = Policy.new_in_fast

    def __init__(self):
        self.manager = None
        self.plan = None              # cachedarrays.triggers.Plan, made by schedule()

    def __setattr__(self, name, value):
        """A method assigned on the instance is honoured like a subclass's override: the
        declarations it would break are undone for this policy (as ``__init_subclass__`` does
        for a class), so no fast path of the manager skips it."""
        if name in _ASSIGNABLE:
            d = self.__dict__
            if name in ("allocate", "alloc_fast"):
                d["fast_first"] = False
            elif name in _NEW_IN_FAST_PARTS:
                d["new_in_fast"] = types.MethodType(Policy.new_in_fast, self)
            for attr, method in _CAPABILITIES:
                if name == method and attr not in d:
                    d[attr] = True
        object.__setattr__(self, name, value)

    def bind(self, manager):
        """Attach to a manager (called once by the manager; a subclass whose __init__ skips
        super().__init__() still binds)."""
        bound = getattr(self, "manager", None)
        if bound is not None and bound is not manager:
            raise ValueError(f"policy {self!r} already belongs to another manager; create a new "
                             "policy object for each manager")
        self.manager = manager

    # ---- allocation ----------------------------------------------------------------------

    def allocate(self, nbytes):
        """Entry point for new arrays: place an object of nbytes somewhere."""
        obj = self.alloc_fast(nbytes)
        return obj if obj is not None else self.alloc_slow(nbytes)

    def place(self, nbytes, placement=None):
        """A new object for a placement hint: None lets ``allocate`` choose; "slow" puts it in
        slow memory; "fast" in fast memory if it fits after forced evictions, else slow."""
        if placement is None:
            return self.allocate(nbytes)
        if placement == "slow":
            return self.alloc_slow(nbytes)
        if placement == "fast":
            obj = self.alloc_fast(nbytes, force=True)
            return obj if obj is not None else self.alloc_slow(nbytes)
        raise ValueError(f"placement must be None, 'fast' or 'slow', not {placement!r}")

    def alloc_fast(self, nbytes, force=False):
        """A new object in fast memory, or None if it does not fit (force: evict to make room)."""
        m = self.manager
        with m.atomic():
            obj = m.create(m.fast, nbytes)
            if obj is None and force and m.fits(m.fast, nbytes) and self.make_room(nbytes):
                obj = m.create(m.fast, nbytes)
            if obj is None:
                return None
            m.markdirty(obj.primary)
            self.on_fast(obj)
            return obj

    def alloc_slow(self, nbytes):
        """A new object in slow memory, else on the first slower tier with room;
        OutOfMemoryError when every tier is full."""
        m = self.manager
        for dev in m.tiers[1:]:
            obj = m.create(dev, nbytes)
            if obj is not None:
                return obj
        raise OutOfMemoryError(_full(m, nbytes))

    # ---- queries and usage -----------------------------------------------------------------

    def in_fast(self, obj):
        m = self.manager
        return m.on_device(m.primary(obj), m.fast)

    def read_use(self, obj):
        """obj was used read-only."""

    def write_use(self, obj):
        """obj was (or is about to be) written: its primary differs from any linked copy."""
        self.manager.markdirty(obj.primary)

    def new_in_fast(self, obj):
        """obj was just created in fast memory, where allocate would have put it (see
        fast_first), and is about to be written: on_fast and write_use in one call."""
        self.on_fast(obj)
        self.write_use(obj)

    def unsafe_free(self, obj):
        """Free obj now (before the garbage collector would)."""
        self.manager.free_object(obj)

    # ---- residency hooks -------------------------------------------------------------------

    def on_fast(self, obj):
        """obj now has its primary in fast memory."""

    def forget(self, obj_id):
        """The object with this id left fast memory or was freed."""

    # ---- movement --------------------------------------------------------------------------

    def prefetch(self, obj, force=False, wait=True):
        """Move obj into fast memory, keeping its other copy linked (Listing 4.2).

        Returns True if obj is in fast memory afterwards. (``ca.prefetch`` on an array already
        in fast memory only reports a ``read_use``; it does not call this method.) wait=False:
        the copy runs in the background and obj is in fast memory as soon as it is issued (a
        kernel that uses obj waits for the copy).
        """
        m = self.manager
        with m.atomic():
            x = m.primary(obj)
            if x is None:
                raise UseAfterFreeError(f"object {obj.id} has no data")
            fast = m.fast
            if x.device is fast:
                self.read_use(obj)
                return True
            if m.pinned(obj):
                return False
            y = m.try_allocate(fast, x.nbytes, obj)
            if y is None and force and m.fits(fast, x.nbytes):
                if self.make_room(x.nbytes) if wait else self.make_room(x.nbytes, wait=False):
                    y = m.try_allocate(fast, x.nbytes, obj)
            if y is None:
                m.count("prefetch_refused", x.nbytes, id=obj.id)
                return False
            self._drop_stale(obj, x)
            m.copyto(y, x, wait=wait)
            m.link(x, y)
            m.set_primary(obj, y)
            m.markclean(y)
            self.on_fast(obj)
            return True

    def evict(self, obj, to=None, wait=True):
        """Move obj out of fast memory (Listing 4.1): reuse a linked copy, skip the copy if clean.

        to: the device to move it to (default the slow device); an object on a slower tier
        moves there too. Returns True if obj's primary is on that device afterwards.
        """
        m = self.manager
        with m.atomic():
            x = m.primary(obj)
            dst = m.slow if to is None else m._device(to)
            if x is None or x.device is dst or to is None and x.device is not m.fast:
                return True
            if m.pinned(obj):
                return False
            y = m.getlinked(x, dst)
            allocated = y is None
            if allocated and to is None and len(m.tiers) > 2:
                y, allocated = self._below(obj, x)
            elif allocated:
                y = m.allocate(dst, x.nbytes, obj)
            if m.isdirty(x) or allocated:
                m.copyto(y, x, wait=wait)
            else:
                m.count("writebacks_elided", x.nbytes, id=obj.id)
            self._drop_stale(obj, x, y)
            if allocated:
                m.link(x, y)
            m.markclean(y)
            m.set_primary(obj, y)
            m.unlink(x, y)
            m.free(x)
            if x.device is m.fast:
                self.forget(obj.id)
            return True

    def _below(self, obj, x):
        """A region for obj leaving fast memory: slow memory's, else the first slower tier's
        with room (a copy already there is reused); and whether it is new."""
        m = self.manager
        for dev in m.tiers[1:]:
            y = m.getlinked(x, dev)
            if y is None:
                y = m.try_allocate(dev, x.nbytes, obj)
                if y is not None:
                    return y, True
            else:
                return y, False
        raise OutOfMemoryError(_full(m, x.nbytes))

    def _drop_stale(self, obj, x, keep=None):
        """x (obj's primary) is about to be copied elsewhere: if it is dirty, copies of obj on
        other tiers are stale; free them (only possible with three tiers or more)."""
        m = self.manager
        if len(obj.regions) > 1 and m.isdirty(x):
            for r in list(obj.regions.values()):
                if r is not x and r is not keep:
                    m.unlink(x, r)
                    m.free(r)

    def softevict(self, obj):
        """Prefer obj for eviction when fast memory runs short (no movement now)."""

    # ---- kernels-in-fast mode ---------------------------------------------------------------

    def stage(self, reads, writes, name="kernel"):
        """Bring every operand of a kernel into fast memory before it runs (kernels-in-fast).

        Each operand not in fast memory is a fault (``Manager.fault``), fetched synchronously;
        room is made by evicting in ``select_victims`` order, never the kernel's own operands.
        OutOfMemoryError when the operands cannot all be in fast memory at once.
        """
        m = self.manager
        fast = m.fast
        objs = list({id(o): o for o in (*reads, *writes)}.values())
        missing = [o for o in objs if o.primary is None or o.primary.device is not fast]
        if not missing:
            return
        need = sum(fast.block_size(o.nbytes) for o in objs)
        if need > fast.size:
            raise OutOfMemoryError(self._stage_error(name, objs, need, "do not fit at once"))
        saved = self._staging
        self._staging = frozenset(o.id for o in objs) | frozenset(saved)
        try:
            for _ in range(len(objs) + 1):      # operands moved aside come back next round
                missing = [o for o in objs if o.primary is not None and
                           o.primary.device is not fast]    # (no data: the manager rebuilds)
                if not missing:
                    return
                for o in missing:
                    if o.primary.device is fast:
                        continue
                    if m.pinned(o) and m.recomputing:    # held by a regeneration
                        raise OutOfMemoryError(self._stage_error(
                            name, objs, need, "cannot all be there while a dropped array is "
                            f"rebuilt: its input (object {o.id}, {format_size(o.nbytes)}) "
                            f"found no room in fast memory"))
                    if m.pinned(o):
                        raise PinnedError(
                            f"kernel {name!r} needs object {o.id} ({format_size(o.nbytes)}) "
                            "in fast memory (kernels-in-fast mode) but an open access scope "
                            f"pins it on {o.primary.device.name}; close that scope first")
                    m.fault(o)
                    if not (Policy.prefetch(self, o, force=True) or
                            self._move_aside(objs, o)):
                        raise OutOfMemoryError(self._stage_error(
                            name, objs, need, f"cannot all be there: the "
                            f"{type(self).__name__} policy could not make room for "
                            f"{format_size(o.nbytes)} (object {o.id}; pinned arrays hold "
                            f"{format_size(self._pinned_fast_bytes())} of fast memory)"))
            raise OutOfMemoryError(self._stage_error(
                name, objs, need, "cannot all be there: moving some out of the way to make a "
                "block for another left no block for them on the way back"))
        finally:
            self._staging = saved

    def _move_aside(self, objs, obj):
        """Staging obj found no block because the kernel's other operands already in fast
        memory split its free space: evict them, smallest first, until obj fits (they are
        fetched back in the next round of ``stage``). Returns success."""
        m = self.manager
        fast = m.fast
        there = sorted((o for o in objs if o is not obj and not o.freed and o.primary is not None
                        and o.primary.device is fast and not m.pinned(o)),
                       key=lambda o: o.nbytes)      # stable: kernel order on ties
        for o in there:
            size = o.nbytes
            if self.evict(o):
                m.count("staging_aside", size, id=o.id)
                if Policy.prefetch(self, obj, force=True):
                    return True
        return False

    def _pinned_fast_bytes(self):
        m = self.manager
        return sum(r.nbytes for r in m.regions_on("fast")
                   if m.parent(r) is not None and m.pinned(m.parent(r)))

    def _stage_error(self, name, objs, need, why):
        m = self.manager
        sizes = ", ".join(format_size(o.nbytes) for o in objs)
        return (f"kernel {name!r} must have its operands in fast memory (kernels-in-fast mode) "
                f"and they {why}: operands {sizes} = {format_size(need)} with heap rounding; "
                f"fast memory is {format_size(m.fast.size)}. Give a larger fast= size, a "
                "smaller batch, or a policy without kernels_in_fast")

    def schedule(self, point, action):
        """Run action(manager) at a point of every step: ("kernel", k), ("kernel_end", k),
        ("layer", l), ("use", sid, n) or ("step",) (see ``cachedarrays.triggers``)."""
        if getattr(self, "plan", None) is None:
            if getattr(self, "manager", None) is None:
                raise ValueError("schedule needs the policy to belong to a manager first")
            self.plan = Plan(self.manager)
        self.plan.at(point, action)

    def on_layer(self):
        """The program marked a layer boundary (``ca.mark_layer``)."""

    def on_step(self):
        """The program marked the end of a step (``ca.mark_step``)."""

    # ---- making room -----------------------------------------------------------------------

    def select_victims(self, nbytes):
        """Fast objects to evict first, most evictable first. The base policy has no order."""
        m = self.manager
        return [m.parent(r) for r in m.regions_on("fast") if m.parent(r) is not None]

    def _victims(self, nbytes):
        """select_victims(nbytes) without None entries; TypeError naming the policy when an
        entry is not an object of this manager (make_room would fail on it obscurely)."""
        ref = self.manager._ref
        victims = [v for v in self.select_victims(nbytes) if v is not None]
        for v in victims:
            if getattr(v, "_manager", None) is not ref:
                what = f"object {v.id} of another manager" if hasattr(v, "_manager") else \
                    type(v).__name__
                raise TypeError(f"{type(self).__name__}.select_victims({nbytes}) returned "
                                f"{what}: it must return objects of this manager (e.g. "
                                "self.manager.parent(r) for r in "
                                "self.manager.regions_on('fast'))")
        return victims

    def evictable(self, obj):
        """May make_room evict obj now? (LRU spares the operands of the kernel it makes room
        for.)"""
        return True

    def make_room(self, nbytes, wait=True):
        """Evict from fast memory until an allocation of nbytes fits. Returns success.

        First evicts victims one by one in policy order (up to one request's worth of bytes);
        if fragmentation still prevents the allocation, walks the heap with evictfrom from
        each victim in turn, so the freed space is contiguous.
        """
        m = self.manager
        fast = m.fast
        if m.can_allocate(fast, nbytes):
            return True
        need = fast.block_size(nbytes)
        victims = self._victims(nbytes)
        evicted = 0
        for v in victims:
            if evicted >= need:
                break
            if v.freed or m.pinned(v) or v.primary is None or \
                    not m.on_device(v.primary, fast) or v.id in self._staging:
                continue
            size = v.primary.nbytes
            if self.evict(v) if wait else self.evict(v, wait=False):
                evicted += size
                if m.can_allocate(fast, nbytes):
                    return True

        def callback(region):
            owner = m.parent(region)
            if owner is None or owner.id in self._staging or not self.evictable(owner):
                return False
            if owner.primary is not region:
                # A fast copy that is not primary breaks the policy invariant; drop it.
                m.unlink(owner.primary, region)
                m.free(region)
                return True
            return self.evict(owner) if wait else self.evict(owner, wait=False)

        # a walk starts at a victim's heap block: an empty array has none (and frees nothing)
        starts = [v.primary for v in victims
                  if not v.freed and v.primary is not None and v.primary.device is fast
                  and v.primary.nbytes > 0]
        starts.append(None)
        for start in starts:
            if start is not None and start.freed:
                continue
            if m.evictfrom(fast, start, nbytes, callback) and m.can_allocate(fast, nbytes):
                return True
        return m.can_allocate(fast, nbytes)

    def __repr__(self):
        return f"<{type(self).__name__} policy>"
