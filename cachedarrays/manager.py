"""The data manager: objects, regions, linking, copies, eviction walks, pinning and telemetry.

This is the mechanism of dissertation Table 4.4. It decides nothing: a policy (``policies/``)
calls these operations. Every operation runs under one re-entrant lock, so the manager is safe
to use from several threads; ``atomic()`` holds it across a sequence of calls. Pin counts and
dirty bits are private to this module: the rest of the library reads and changes them through
``pin``/``unpin``/``acquire``/``release``/``new_pinned``/``run``, ``pinned``/``pin_count`` and
``markdirty``/``markclean``/``isdirty``. Objects freed by the garbage collector are only queued
by their finalizer; the queue drains at the next manager call.
"""

import difflib
import inspect
import itertools
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping

import numpy as np

from . import copyengine, threadkeys
from ._records import ManagerLock, ManagerRecord, ObjectRecord, RegionRecord
from ._records import bind as _bind_records
from ._records import create_fast as _create_fast
from ._records import drain as _drain
from ._records import free_fast as _free_fast
from ._records import object as _new_object
from ._records import region as _new_region
from .devices import DRAM, Device, SlowDevice, VirtualDevice
from .errors import (CachedArraysError, DeviceError, OutOfMemoryError, PinnedError,
                     RecomputeError, UseAfterFreeError, note_policy_error)
from .heap import HEADER, Heap
from .lineage import scratch as _scratch
from .lineage import why_not as _lineage_why_not
from .poison import Poison
from .poison import enabled as debug_enabled
from .profiles import PROFILES, get_profile
from .registry import resolve as resolve_policy
from .sizes import _MAX_TEXT, MAX_SIZE, format_size, parse_size
from .telemetry import MAX_DEVICES, Telemetry, check_event, check_event_log


class Region(RegionRecord):
    """A contiguous block on one device, owned by one object.

    ``Region(device, offset, nbytes, owner, buffer=None)``: offset is the heap block's (-1 for a
    zero-byte region), owner the parent object's id. The fields (``device``, ``offset``,
    ``nbytes``, ``owner``, ``freed``, the dirty bit and the device's mapping, which
    Manager.ndarray reads on the hot path) live in the C record (``_records``).
    """

    __slots__ = ()

    @property
    def data_offset(self):
        """Offset of the first data byte within the device's buffer."""
        return self.offset + HEADER

    @property
    def address(self):
        """Current address of the data (valid only while nothing can move the region)."""
        if self.nbytes == 0:
            return 0
        return self.device.address + self.offset + HEADER

    def __repr__(self):
        state = " freed" if self.freed else (" dirty" if self._dirty else "")
        return (f"<Region {self.device.name} offset={self.offset} {format_size(self.nbytes)} "
                f"object={self.owner}{state}>")


class Object(ObjectRecord):
    """What the program holds: one primary region (newest data) and linked regions elsewhere.

    ``Object(manager_ref, obj_id, nbytes, primary=None, device_name=None)``; manager_ref is a
    weak reference (objects never keep a manager alive). ``regions`` maps device names to
    regions; ``version`` counts the kernels that wrote it; ``dropped``: its data was let go
    (``Manager.drop``) and is rebuilt from its ``chain`` (see ``cachedarrays.lineage``) at its
    next use. The fields and the finalizer live in the C record (``_records``): the finalizer
    only queues the regions (``_deferred``), and the manager frees them at its next call.
    """

    __slots__ = ()

    @property
    def manager(self):
        """The manager that holds this object (None once that manager is gone)."""
        return self._manager()

    @property
    def device(self):
        """Name of the device holding the primary region."""
        if self.freed:
            raise UseAfterFreeError(f"object {self.id} ({format_size(self.nbytes)}) was freed")
        primary = self.primary
        if primary is None:
            m = self._manager()
            if m is None or m.closed:
                raise _closed_error((self,))
            if self.dropped:
                return None
            raise CachedArraysError(f"object {self.id} ({format_size(self.nbytes)}) has no "
                                    "primary region yet; allocate one and set_primary")
        return primary.device.name

    def __repr__(self):
        m = self._manager()
        where = "freed" if self.freed else (self.primary.device.name if self.primary else
                                            "a closed manager" if m is None or m.closed else
                                            "none (dropped)" if self.dropped else "none")
        return f"<Object {self.id} {format_size(self.nbytes)} on {where} pins={self._pins}>"


class _Copy:
    """A background copy of an object (src -> dst region) that no use has waited for yet.

    job is the copy engine's CopyJob, or None on virtual devices (a replay), where copies are
    logical only; the object's state is the same either way, so decisions are the same.
    """

    __slots__ = ("job", "src", "dst")

    def __init__(self, job, src, dst):
        self.job, self.src, self.dst = job, src, dst


_bind_records(*Heap.entry_points(), Region, Object)


def _closed_error(objs=(), manager=None):
    """The error for any use of a closed manager or of its arrays, naming the objects."""
    objs = list({id(o): o for o in objs}.values())
    named = ", ".join(f"object {o.id} ({format_size(o.nbytes)})" for o in objs[:3])
    if manager is None and objs:
        manager = objs[0]._manager()
    if manager is not None and manager._inherited:
        return UseAfterFreeError(
            f"this manager was created in process {manager._pid} and this process is a "
            f"fork of it{f' ({named} belonged to it)' if named else ''}: a forked process "
            "shares the manager's slow memory with its parent, so it cannot use the manager or "
            "its arrays; create a new Manager in this process (ca.default_manager() makes one), "
            "or start processes with the 'spawn' or 'forkserver' method of multiprocessing")
    return UseAfterFreeError(
        f"this manager is closed{f' ({named} belonged to it)' if named else ''}: its arrays "
        "cannot be used any more; create a new Manager, and close a manager only after its "
        "arrays are no longer in use")


def _object_of(x, op):
    """The Object of x (an Object, or an array holding one)."""
    if isinstance(x, Object):
        return x
    inner = getattr(x, "object", None)            # a CachedArray: its object
    if isinstance(inner, Object):
        return inner
    raise TypeError(f"Manager.{op} takes an array or its object, not {type(x).__name__}")


def _describe(obj, shape=None):
    where = obj.primary.device.name if obj.primary is not None else "no device"
    return (f"object {obj.id} ({format_size(obj.nbytes)}"
            f"{f', shape {shape}' if shape is not None else ''}, on {where}, pins={obj._pins})")


def _check_free(dev):
    """DeviceError unless dev can serve a new manager (not closed, no other manager's)."""
    what = f"device {dev.name!r} ({format_size(dev.size)})"
    if dev.closed:
        raise DeviceError(f"{what} is closed (closing its manager closed it): create a new "
                          "device, or pass a size and let the manager make one")
    if dev._pid != os.getpid():
        raise DeviceError(f"{what} was made in process {dev._pid}, of which this process is a "
                          "fork, and shares its memory: create a new device in this process")
    owner = dev._owner() if dev._owner is not None else None
    if owner is not None and not owner.closed:
        raise DeviceError(f"{what} belongs to another manager ({owner!r}); two managers on one "
                          "device overwrite each other's arrays: give each manager its own "
                          "device, or close the other manager first")


def _make_device(spec, name, default_cls, **kw):
    if isinstance(spec, Device):
        return spec
    return default_cls(parse_size(spec, f"{name} memory size"), name=name, **kw)


# Cost-model profile (costmodel.PROFILES) of a tier by its name, when the tier does not say.
TIER_PROFILES = {"fast": "dram", "dram": "dram", "slow": "optane", "pmem": "optane",
                 "optane": "optane", "cxl": "cxl", "ssd": "nvme-ssd", "nvme": "nvme-ssd",
                 "nvme-ssd": "nvme-ssd"}


def _close_made(dev, given):
    """Close dev after a failed construction unless the caller passed it in (for a retry)."""
    if not any(dev is g for g in given):
        dev.close()


def _check_profiles(devs, given):
    """Every tier names a preset profile or gives a Profile; else close the devices made."""
    for i, d in enumerate(devs):
        try:
            get_profile(d.profile)
        except ValueError:
            for x in devs:
                _close_made(x, given)
            raise ValueError(f"tier {i} ({d.name!r}): unknown profile {d.profile!r}; name one of "
                             f"{sorted(PROFILES)} or give a ca.costmodel.Profile(name, read_gbps, "
                             "write_gbps, latency), e.g. tiers=[..., (\"ssd\", \"64GiB\", None, "
                             "\"nvme-ssd\")]") from None


def _tier_error(i, spec, why):
    return ValueError(f"tiers[{i}] = {spec!r}: {why}; write each tier as (name, size) or "
                      "(name, size, path) or (name, size, path, profile), fastest first, e.g. "
                      'tiers=[("dram", "4GiB"), ("pmem", "32GiB", "/mnt/pmem"), '
                      '("ssd", "256GiB", "/data")]')


def _build_tiers(tiers, virtual, **kw):
    """Devices for Manager(tiers=...): the first is fast (DRAM), the others file mappings."""
    if not isinstance(tiers, (list, tuple)):
        raise ValueError(f"tiers must be a list of at least two tiers, fastest first, not "
                         f"{type(tiers).__name__} {tiers!r}; e.g. "
                         'tiers=[("dram", "4GiB"), ("pmem", "32GiB", "/mnt/pmem")]')
    if len(tiers) < 2:
        raise ValueError(f"tiers must list at least two tiers, fastest first, got {tiers!r}; "
                         'e.g. tiers=[("dram", "4GiB"), ("pmem", "32GiB", "/mnt/pmem")]')
    if len(tiers) > MAX_DEVICES:
        raise ValueError(f"tiers lists {len(tiers)} tiers, but a manager has at most "
                         f"{MAX_DEVICES} (telemetry counts that many devices); merge the slowest "
                         "tiers into one, or run two managers")
    devs, names = [], set()
    try:
        for i, spec in enumerate(tiers):
            if isinstance(spec, Device):
                dev = spec
            else:
                if isinstance(spec, (str, bytes)) or not isinstance(spec, (tuple, list)) or \
                        not 2 <= len(spec) <= 4:
                    raise _tier_error(i, spec, "not a tier")
                name, size = spec[0], spec[1]
                path = spec[2] if len(spec) > 2 else None
                profile = spec[3] if len(spec) > 3 else None
                if not isinstance(name, str) or not name:
                    raise _tier_error(i, spec, "the name must be a non-empty string")
                if name in ("fast", "slow") and name != ("fast", "slow")[min(i, 1)] or \
                        name == "slow" and i != 1:
                    raise _tier_error(i, spec, f"{name!r} names tier {0 if name == 'fast' else 1} "
                                      "(the alias every policy uses); choose another name")
                nbytes = parse_size(size, f"size of tier {name!r}")
                if virtual:
                    dev = VirtualDevice(nbytes, name=name, granularity=kw["granularity"])
                elif i == 0:
                    if path is not None:
                        raise _tier_error(i, spec, "the first (fast) tier is DRAM and takes no "
                                          "path")
                    dev = DRAM(nbytes, name=name, **kw)
                else:
                    try:
                        dev = SlowDevice(nbytes, path=path, name=name, populate=kw["populate"],
                                         granularity=kw["granularity"])
                    except DeviceError as e:      # its message speaks of the slow device
                        raise DeviceError(f"tiers[{i}] ({name!r}): {e}") from None
                dev.profile = profile or TIER_PROFILES.get(name)
            if any(dev is d for d in devs):
                raise _tier_error(i, spec, "this device is listed twice; give each tier its own "
                                  "device")
            if dev.name in names:
                raise _tier_error(i, spec, f"two tiers are named {dev.name!r}")
            names.add(dev.name)
            devs.append(dev)
    except BaseException:
        for d in devs:
            _close_made(d, [t for t in tiers if isinstance(t, Device)])
        raise
    return devs


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_NOT_PINNING = ("annotations.py",)          # decorators hold arrays without pinning them
_ENDED_POLL = 0.05      # seconds close() waits at a time while threads holding pins may end


def _objects_in(v, depth):
    """The objects v refers to: an Object, an array's object, or those in a list or tuple."""
    if isinstance(v, ObjectRecord):
        yield v
    elif isinstance(v, (list, tuple)):
        if depth > 1:
            for x in v[:256]:
                yield from _objects_in(x, depth - 1)
    else:
        o = getattr(v, "_obj", None) if hasattr(type(v), "_obj") else None
        if isinstance(o, ObjectRecord):
            yield o


_MANAGERS = weakref.WeakKeyDictionary()     # live managers, in creation order (mark_step)


class Observer:
    """What the manager reports to observers (``Manager.observe``): traces, plans, replays.

    Each hook runs under the manager's lock, in the thread that made the call; the base class
    ignores everything, so an observer overrides only what it needs.
    """

    def on_object(self, obj):
        """A new object was registered (before its first region is placed)."""

    def on_new(self, obj, placement):
        """A program allocated obj (``new_pinned``), placed by the policy."""

    def on_free(self, obj_id):
        """The object with this id was freed (``unsafe_free``, cleanup or the collector)."""

    def on_begin(self, name, reads, writes):
        """A kernel or access scope begins: before its operands are regenerated or staged into
        fast memory (kernels-in-fast mode) and before ``on_acquire`` (plans act here)."""

    def on_acquire(self, name, reads, writes, touched=None):
        """A kernel or access scope is about to pin and use these objects (before the pins).

        touched: None, or object id -> bytes the kernel touches in it, when less than all (a
        gather from a table)."""

    def on_release(self, objs):
        """Objects pinned by acquire (or new_pinned) were released."""

    def on_annotation(self, op, obj, args):
        """``prefetch``/``evict``/``softevict`` was asked for obj (args: the call's options)."""

    def on_mark(self, kind):
        """A "layer" or "step" mark."""

    def on_region(self, region, live):
        """A region was placed (live True) or released (False): the policy's decisions."""

    def on_copy(self, src, dst, wait):
        """A copy of src's bytes into dst was issued (wait False: asynchronous)."""

    def on_defrag(self, device):
        """The device's heap is about to be defragmented (regions slide down)."""

    def on_move(self, region, old_offset):
        """Defragmentation moved region from old_offset to region.offset (same device): a
        move, and a copy of its bytes within the device."""

    def on_compact(self, region, old_offset):
        """A policy's compaction (``Manager.compact``) moved region from old_offset to
        region.offset: a move, and a copy of its bytes within the device."""
        self.on_move(region, old_offset)

    def on_cancel(self, obj_id, src, dst):
        """The background copy src -> dst of an object was cancelled (dst is being dropped)."""

    def on_fault(self, obj):
        """A kernel used obj while it was not in fast memory, and it was fetched on demand
        (kernels-in-fast mode: ``Policy.stage``)."""


def _after_fork_in_child():
    """A forked child shares the slow memory of its parent's managers: none may be used."""
    for m in list(_MANAGERS):
        m._forsake()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _check_options(factory, options, name):
    """TypeError naming the policy_options a policy's constructor does not take (a typo would
    otherwise be an opaque error from inside its __init__), with the ones it does take."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):         # a builtin or an odd callable: let it say
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    known = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        near = difflib.get_close_matches(unknown[0], known, 1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise TypeError(f"policy_options {unknown} are not options of policy {name!r}{hint}; "
                        f"its options are {known + ['kernels_in_fast']}")


class Manager(ManagerRecord):
    """Owns the devices (fast and slow heaps), every object and region, the policy and telemetry.

    ``Manager(fast="256MiB", slow="4GiB", slow_path=None, policy="lru")``; usable as a context
    manager; ``close()`` is idempotent. ``debug=True`` (or ``CACHEDARRAYS_DEBUG=1``) poisons
    memory that objects leave behind and reports writes into it (see ``cachedarrays.poison``).
    A forked child process cannot use the managers of its parent (it makes its own).
    """

    _inherited = False                # in a forked child: the manager is the parent's

    def __init__(self, fast="256MiB", slow="4GiB", slow_path=None, policy="lru", *,
                 tiers=None, virtual=False, granularity=0, populate=False, hugepages=True,
                 numa_node=None, event_log=None, policy_options=None, debug=None):
        self.closed = True
        self._pid = os.getpid()
        self._gate = True             # closing or closed: pins and allocations take the slow path
        self._closing = False
        self._lock = ManagerLock()     # threading.RLock's interface, taken in C without a call
        self._cond = threading.Condition(self._lock)   # notified when pins drop while closing
        self._scopes = {}             # open access scope -> (thread key, ((object, shape), ...));
        #                               thread key None: opened on a thread that has ended
        self._pinned_by = {}          # (thread key, object id) -> (object, count) for pin()
        self._ended = threadkeys.Queue()  # keys of threads that pinned or opened scopes and ended
        self._watched = set()         # keys of the threads whose end appends to _ended
        self._detached = {}           # object id -> count of pin(detached=True) not yet unpinned
        self._fresh = set()           # ids of new_pinned objects not yet released (observed)
        self._dropped = set()         # ids of dropped objects (acquire rebuilds them)
        self._kept = {}               # dropped object id -> the input objects it is rebuilt from
        self._dependents = {}         # input object id -> ids of dropped objects rebuilt from it
        self._regenerable = set()     # ids of dropped objects found regenerable since the last
        #                               write or free of an input of a dropped object
        self._writing = frozenset()   # ids a kernel is about to write (nothing made from them
        #                               may be dropped meanwhile)
        self.recipe = None            # lineage.Recipe of the kernel being acquired (observers)
        self.recomputing = 0          # depth of reruns of recorded kernels (regenerate)
        self.recompute_entry = None   # the Recipe being rerun (observers: not a new kernel)
        self._debug = Poison() if debug_enabled(debug) else None
        self._deferred = deque()
        self._copier = None           # copyengine.CopyWorkers, made at the first background copy
        self._copies = {}             # object id -> _Copy: background copies not yet waited for
        self._reading = []            # (device, start, end, job): freed blocks still being read
        self._unpoisoned = []         # debug mode: (job, region, why) to poison once job read it
        self._ids = itertools.count(1)
        self._last_id = 0
        self._objects = {}            # id -> weakref to the Object (entries leave at free)
        self._ref = weakref.ref(self)
        self._observers = ()
        check_event_log(event_log)
        virtual = copyengine.check_switch(virtual, "Manager: virtual")
        populate = copyengine.check_switch(populate, "Manager: populate")
        hugepages = copyengine.check_switch(hugepages, "Manager: hugepages")
        if policy_options is not None and not isinstance(policy_options, Mapping):
            raise TypeError(f"policy_options must be a dict of the policy's options, e.g. "
                            f"policy_options={{'kernels_in_fast': True}}; got {policy_options!r}")
        given = [d for d in (tiers if isinstance(tiers, (tuple, list)) else (fast, slow))
                 if isinstance(d, Device)]
        for d in given:
            _check_free(d)
        if tiers is not None:
            if (fast, slow, slow_path) != ("256MiB", "4GiB", None):     # not the defaults
                raise ValueError("pass either tiers=[...] or fast=/slow=/slow_path=, not both: "
                                 "tiers= gives every tier its size and path, e.g. "
                                 'tiers=[("dram", "4GiB"), ("pmem", "32GiB", "/mnt/pmem")]')
            devs = _build_tiers(tiers, virtual, populate=populate, hugepages=hugepages,
                                numa_node=numa_node, granularity=granularity)
        elif virtual:
            fast_dev = fast if isinstance(fast, Device) else VirtualDevice(
                parse_size(fast, "fast memory size"), name="fast", granularity=granularity)
            try:
                slow_dev = slow if isinstance(slow, Device) else VirtualDevice(
                    parse_size(slow, "slow memory size"), name="slow", granularity=granularity)
            except BaseException:
                _close_made(fast_dev, given)
                raise
            devs = [fast_dev, slow_dev]
        else:
            fast_dev = _make_device(fast, "fast", DRAM, populate=populate, hugepages=hugepages,
                                    numa_node=numa_node, granularity=granularity)
            try:
                slow_dev = (slow if isinstance(slow, Device) else
                            SlowDevice(parse_size(slow, "slow memory size"), path=slow_path,
                                       name="slow", populate=populate, granularity=granularity))
            except BaseException:
                _close_made(fast_dev, given)
                raise
            devs = [fast_dev, slow_dev]
        if len({d.virtual for d in devs}) > 1:
            for d in devs:
                _close_made(d, given)
            names = ", ".join(f"{d.name!r} ({'virtual' if d.virtual else d.kind}, "
                              f"{format_size(d.size)})" for d in devs)
            raise DeviceError(f"devices {names} mix virtual and real memory: a virtual device "
                              "holds no data, so an array moved onto it would lose its contents; "
                              "make every device virtual (Manager(..., virtual=True), for "
                              "replays) or none")
        if devs[0].virtual:
            self._debug = None                    # no data to poison
        for i, d in enumerate(devs):
            if d.profile is None:
                d.profile = TIER_PROFILES.get(d.name, "dram" if i == 0 else "optane")
        _check_profiles(devs, given)
        for d in devs:
            if "->" in d.name:
                for x in devs:
                    _close_made(x, given)
                raise ValueError(f"device name {d.name!r} holds '->', which joins two device "
                                 "names in m.stats()['moved']; choose another name")
        if len({d.name for d in devs}) != len(devs):
            for d in devs:
                _close_made(d, given)
            raise ValueError(f"two devices share the name {devs[0].name!r}; name them apart "
                             "(a device you make takes name=, e.g. "
                             "SlowDevice(size, name=\"slow\"))")
        self.tiers = devs
        self.devices = {d.name: d for d in devs}
        self.fast, self.slow = devs[0], devs[1]
        self._alias = {"fast": self.fast, "slow": self.slow}
        self._by_offset = {name: {} for name in self.devices}
        try:
            self.telemetry = Telemetry(self.devices, event_log=event_log)
        except BaseException:
            for d in devs:
                _close_made(d, given)
            raise
        for d in devs:
            d._owner = self._ref
        self.closed = self._gate = False
        _MANAGERS[self] = None
        try:
            self.policy = self._resolve_policy(policy, policy_options or {})
        except BaseException:
            self._give_back(given)
            self.close()
            raise

    def _give_back(self, given):
        """A construction failed: devices the caller passed in, still empty, stay open (for a
        retry); close() then releases only the devices the manager made."""
        for d in given:
            if d.heap is None or d.heap.stats().nallocated == 0:
                self.devices = {n: v for n, v in self.devices.items() if v is not d}
                d._owner = None

    @staticmethod
    def open_managers():
        """Every manager that is open now, oldest first."""
        return [m for m in list(_MANAGERS) if not m.closed]

    def _resolve_policy(self, policy, options):
        options = dict(options)
        in_fast = options.pop("kernels_in_fast", None)
        if in_fast is not None and not isinstance(in_fast, bool):
            raise ValueError(f"kernels_in_fast={in_fast!r}: give True (every kernel's operands "
                             "must be in fast memory before it runs) or False")
        if isinstance(policy, str):
            factory = resolve_policy(policy)
            _check_options(factory, options, policy)
            policy = factory(**options)
        elif isinstance(policy, type):
            _check_options(policy, options, policy.__name__)
            policy = policy(**options)
        elif options:
            raise TypeError(f"policy_options {sorted(options)} would be ignored: the policy "
                            f"{policy!r} is an instance, already built; pass the options to its "
                            "constructor, or give policy= as a name or class (kernels_in_fast "
                            "is the one option an instance takes)")
        if not hasattr(policy, "bind"):
            raise TypeError(f"policy must be a name, a Policy subclass or a Policy instance, "
                            f"not {type(policy).__name__}")
        if in_fast is not None:
            policy.kernels_in_fast = in_fast
        # A proxy: a policy (and the observers it attaches) must not keep its manager alive,
        # so that a manager dropped without close() is closed as soon as its last use goes.
        policy.bind(weakref.proxy(self))
        return policy

    # ---- lifetime --------------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self, timeout=10.0):
        """Free every object and release the devices. Safe to call more than once.

        Nothing is released while in use: pins held by other threads (running kernels, open
        access scopes) are waited for, up to timeout seconds (None: no limit), while new uses
        wait for the outcome. If pins remain, or the calling thread itself has an access scope
        open, PinnedError names the pinned objects and the manager stays open and usable.
        From inside a manager operation (a policy, observer or ``evictfrom`` callback, or an
        ``m.atomic()`` block) it raises RuntimeError at once: the operation is still using the
        heaps. After a close, every use of the manager's arrays raises UseAfterFreeError.
        """
        self._close(timeout)
        policy = getattr(self, "policy", None)
        if type(getattr(policy, "manager", None)) is weakref.ProxyType:
            policy.manager = self                 # closed, it holds nothing: the policy may
            #                                       keep it (to read its records afterwards)

    def _close(self, timeout):
        timeout = copyengine.check_timeout(timeout, "close timeout")
        inside = self._lock._is_owned()   # this thread is in a manager operation (a callback)
        with self._lock:
            if inside and not self.closed:
                self._refuse_close_inside()
            while self._closing:                  # another thread is closing: take its outcome
                self._cond.wait()
            if self.closed:
                return
            if self._ended:
                self._release_ended()
            if self._pinned():
                self._wait_unpinned(timeout)
            self._shutdown()

    def _pinned(self):
        return [o for o in self._live_objects() if o._pins]

    def _thread_key(self):
        """The calling thread's key (``threadkeys``), watched so that what the thread still
        holds when it ends is seen to at the manager's next pin, unpin, scope or close, or when
        it next asks whether an object is pinned (making room, moving or freeing it)."""
        key = threadkeys.current()
        if key not in self._watched:
            self._watched.add(key)
            threadkeys.watch(self._ended)
        return key

    def _release_ended(self):
        """Let go of what threads that have ended held (caller holds the lock): their pin()s,
        which only they could unpin, are released; their open access scopes are kept (the scope
        object may still be exited, from any thread) but belong to no thread any more."""
        ended = self._ended
        released = False
        while ended:
            key = ended.pop()
            self._watched.discard(key)
            for k in [k for k in self._pinned_by if k[0] == key]:
                obj, n = self._pinned_by.pop(k)
                obj._pins -= n
                released = True
            for scope, (tid, held) in list(self._scopes.items()):
                if tid == key:
                    self._scopes[scope] = (None, held)
        if released and self._closing:
            self._cond.notify_all()

    def _held_here(self):
        """(object, shape) pairs the calling thread keeps pinned: open access scopes, pin()."""
        if self._ended:
            self._release_ended()
        me = threadkeys.current()
        held = [h for tid, hs in list(self._scopes.values()) if tid == me for h in hs]
        held += [(o, None) for (tid, _), (o, _) in list(self._pinned_by.items()) if tid == me]
        return [(o, shape) for o, shape in held if o._pins]

    def _held_by_calls(self):
        """Pinned objects that library calls on the calling thread's stack hold: the operands
        of a kernel or ``run`` whose code called back into the program (the function given to
        np.apply_along_axis). Read off the frames, so the calls themselves record nothing."""
        pinned = {id(o): o for o in self._pinned()}
        found = []
        f = sys._getframe(1)
        while f is not None and pinned:
            name = f.f_code.co_filename
            if name.startswith(_PACKAGE_DIR) and not name.endswith(_NOT_PINNING):
                for v in f.f_locals.values():
                    for o in _objects_in(v, 3):
                        if id(o) in pinned:
                            found.append(pinned.pop(id(o)))
            f = f.f_back
        return found

    def _pinned_error(self, pinned, here):
        shapes = {id(o): shape for _, held in list(self._scopes.values()) for o, shape in held}
        names = "; ".join(_describe(o, shapes.get(id(o))) for o in pinned[:8])
        more = f" and {len(pinned) - 8} more" if len(pinned) > 8 else ""
        if here:
            why = ("the calling thread pins them (an open ca.readable, ca.writable or ca.access "
                   "scope, Manager.pin, or a call on the arrays whose callback called close()) "
                   "and close() would wait for itself: end the scope (or unpin, or close after "
                   "the call returns) first")
        else:
            why = ("running kernels or access scopes on other threads still pin them: end those "
                   "scopes (or let the kernels finish) first, or pass close(timeout=...) longer")
            orphans = sum(1 for tid, _ in list(self._scopes.values()) if tid is None)
            if orphans:
                why += (f"; {orphans} of those scopes were opened on threads that have ended "
                        "without exiting them: call their __exit__ (from any thread), or keep "
                        "with-blocks inside the thread's function")
        return PinnedError(f"cannot close the manager while {len(pinned)} object(s) are in use "
                           f"({names}{more}); {why}. The manager stays open")

    def _refuse_held_here(self):
        """PinnedError if the calling thread itself pins objects (close would wait for itself)."""
        here = self._held_here() or [(o, None) for o in self._held_by_calls()]
        if here:
            pinned = self._pinned()
            mine = {id(o) for o, _ in here}
            raise self._pinned_error(sorted(pinned, key=lambda o: id(o) not in mine), True)

    def _refuse_close_inside(self):
        """close() called by a thread inside a manager operation (it holds the lock): the
        operation, a movement perhaps, still uses the heaps, and waiting for other threads'
        pins would let them in mid-operation. Refused; the manager stays open."""
        if self._pinned():
            self._refuse_held_here()
        raise RuntimeError(
            "cannot close the manager from within one of its operations (a policy, observer or "
            "evictfrom callback, or an m.atomic() block) while it may be moving data: the "
            "operation still uses the heaps. Return from the callback (or leave the block) and "
            "call close() after the operation ends. The manager stays open")

    def _wait_unpinned(self, timeout):
        """Wait (lock released) until no object is pinned; PinnedError if that cannot happen."""
        self._refuse_held_here()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._closing = True
        self._gate = True
        done = False
        try:
            while True:
                pinned = self._pinned()
                if not pinned:
                    done = True
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._pinned_error(pinned, False)
                if self._watched:     # a thread that ends holding pins notifies nobody
                    left = _ENDED_POLL if left is None else min(left, _ENDED_POLL)
                self._cond.wait(left)
                if self._ended:
                    self._release_ended()
        finally:
            self._closing = False
            if not done:                          # the close failed: let waiting uses go on
                self._gate = self.closed
                self._cond.notify_all()

    def _shutdown(self):
        """Release everything (caller holds the lock and no object is pinned)."""
        if self._copier is not None:
            # Nothing copies into memory being released. At interpreter exit the daemon copy
            # threads may have been stopped holding the engine's lock: waiting would hang the
            # exit (the mappings stay referenced by the jobs, so a copy never faults).
            if not sys.is_finalizing():
                self._copier.shutdown(cancel=True)
            self._copier = None
        self._reading = []
        self._unpoisoned = []
        self._copies.clear()
        self.closed = self._gate = True
        self._drop_records()
        if self._debug is not None:
            self._debug.clear()
        try:
            self.telemetry.close()
            for dev in self.devices.values():
                dev.close()
        finally:
            self._cond.notify_all()

    def _drop_records(self):
        """Forget every object and region: their arrays now raise UseAfterFreeError."""
        for obj in self._live_objects():
            obj.primary = None
            obj.regions = {}
        for table in self._by_offset.values():
            for r in table.values():
                r.freed = True
                r._buffer = None
            table.clear()
        for held in (self._objects, self._kept, self._dependents, self._dropped,
                     self._regenerable, self._deferred, self._scopes, self._pinned_by,
                     self._detached, self._fresh):
            held.clear()

    def _forsake(self):
        """In a forked child: refuse every use of this manager of the parent, and let go
        of its devices without writing to them (the slow mapping, its heap headers included,
        is shared with the parent) or removing the parent's files."""
        self._lock = ManagerLock()                # held at the fork by a thread now gone
        self._cond = threading.Condition(self._lock)
        self._copier = None                       # its worker threads are the parent's
        self._reading = []
        self._unpoisoned = []
        self._copies = {}
        self._closing = False
        was_closed = self.closed
        self.closed = self._gate = True
        if was_closed:
            return
        self._inherited = True
        self.telemetry.forsake_log()
        self._drop_records()
        self._debug = None
        for dev in self.devices.values():
            dev.close()                           # drops the child's references only

    def __del__(self):
        try:
            self._close(timeout=0)
        except Exception:
            pass

    def _check_open(self, objs=()):
        if self.closed:
            raise _closed_error(objs, self)

    def _pass_gate(self, objs=()):
        """Slow path of pin and acquire while the manager is closing or closed.

        A close waiting for pins to drain holds new uses back (so it is not starved) unless the
        calling thread holds pins itself (an open access scope): they keep the close waiting.
        """
        while self._closing and not self._held_here():
            self._cond.wait()
        if self.closed:
            raise _closed_error(objs, self)

    def _pass_alloc_gate(self):
        """Slow path of allocations while closing: wait only if nothing is pinned.

        Allocations also happen inside kernels that hold pins; those must not wait for a close
        that waits for them.
        """
        while self._closing and not self._pinned():
            self._cond.wait()
        if self.closed:
            raise _closed_error((), self)

    def scope_opened(self, key, held):
        """Record an access scope of the calling thread pinning held ((object, shape) pairs).

        close() uses it to name the pinned arrays and to refuse at once instead of waiting for
        a scope on its own thread.
        """
        if self._ended:
            with self._lock:
                self._release_ended()
        self._scopes[key] = (self._thread_key(), held)

    def scope_closed(self, key):
        self._scopes.pop(key, None)

    # ---- objects ---------------------------------------------------------------------------

    def new_object(self, nbytes):
        """Register a new object of nbytes with a unique, increasing id (no region yet)."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"object size must not be negative, got {nbytes}")
        with self._lock:
            if self._gate:
                self._pass_alloc_gate()
            self._drain()
            return self._register(nbytes)

    def _register(self, nbytes):
        oid = self._last_id = next(self._ids)
        obj = _new_object(Object, self._ref, oid, nbytes, None, None)
        self._objects[oid] = weakref.ref(obj)
        for o in self._observers:
            o.on_object(obj)
        return obj

    def create(self, device, nbytes):
        """A new object with its primary region on device, or None if it does not fit now.

        The one-step form of new_object + allocate + set_primary used by policies.
        """
        with self._lock:
            if self._gate:
                self._pass_alloc_gate()
            if self._deferred:
                self._drain()
            dev = device if isinstance(device, Device) else self._device(device)
            if dev is self.fast and type(nbytes) is int and nbytes > 0 and not self._reading \
                    and self._debug is None and not self._observers:
                obj = _create_fast(self, nbytes)    # the same steps, in C
                if obj is not None:
                    obj.primary._dirty = False      # create leaves marking to the policy
                return obj
            if nbytes > 0:
                if self._reading:
                    self._await_readers(dev)
                heap = dev.heap
                offset = None if heap is None else heap.try_alloc(nbytes, self._last_id + 1)
                if offset is None:
                    return None
                if self._debug is not None:
                    self._debug_reuse(dev, offset)
            else:
                offset = -1
            oid = self._last_id = next(self._ids)             # _register, inlined
            obj = _new_object(Object, self._ref, oid, nbytes, None, None)
            self._objects[oid] = weakref.ref(obj)
            if self._observers:
                for o in self._observers:
                    o.on_object(obj)
            name = dev.name
            region = _new_region(Region, dev, offset, nbytes, oid, dev._mm)
            if nbytes:
                self._by_offset[name][offset] = region
            obj.primary = region
            obj.regions[name] = region
            self.telemetry.on_alloc(name, nbytes, oid)
            if self._observers:
                for o in self._observers:
                    o.on_region(region, True)
            return obj

    def _create_fast(self, nbytes):
        """create(fast, nbytes) for a policy that puts new objects in fast memory when they
        fit (``Policy.fast_first``), its region already marked dirty (the policy's alloc_fast
        does so); None if it does not fit without evictions. The caller holds the lock, has
        drained the queue and checked that no observer, debug poisoning or in-flight read of
        a freed block needs the general path."""
        return _create_fast(self, nbytes)        # the body in C (native/records.c)

    def object(self, obj_id):
        """The live object with this id, or None."""
        ref = self._objects.get(obj_id)
        obj = ref() if ref is not None else None
        return None if obj is None or obj.freed else obj

    def _live_objects(self):
        out = []
        for ref in list(self._objects.values()):
            o = ref()
            if o is not None and not o.freed:
                out.append(o)
        return out

    def objects(self):
        """Every live (not freed) object."""
        with self._lock:
            return self._live_objects()

    def last_id(self):
        """The highest object id handed out so far."""
        return self._last_id

    def primary(self, obj):
        """The primary region of obj (the newest data)."""
        self._live(obj)
        return obj.primary

    def set_primary(self, obj, region):
        """Make region (which obj owns) its primary region."""
        with self._lock:
            self._live(obj)
            self._own(obj, region)
            other = obj.regions.get(region.device.name)
            if other is not None and other is not region:
                raise CachedArraysError(
                    f"object {obj.id} already has a region on {region.device.name!r}; free or "
                    "unlink it before making another region there primary")
            obj.regions[region.device.name] = region
            obj.primary = region

    def free_object(self, obj):
        """Free every region of obj now (the policy's unsafe_free). Later use raises."""
        if _free_fast(self, obj):        # in C: one region on a heap, nothing else under way
            return
        try:
            with self._lock:
                if obj.freed:
                    raise UseAfterFreeError(f"object {obj.id} ({format_size(obj.nbytes)}) was "
                                            "already freed")
                self._check_open((obj,))
                if obj._manager is not self._ref:
                    raise self._foreign(obj)
                if self.pinned(obj):
                    raise PinnedError(f"object {obj.id} is pinned by a running kernel or an open "
                                      "access scope; free it after the scope ends")
                if self._dependents and obj.id in self._dependents:
                    self._rescue_writes((obj,))
                try:
                    self._release(obj.id, list(obj.regions.values()), obj.primary)
                finally:
                    if obj.id not in self._objects:     # its regions went, whatever a hook raised
                        obj.freed = True
                        obj.primary = None
                        obj.regions = {}
                        obj.chain = None
                self._drain()
        except Exception as e:
            note_policy_error(e, self.policy)
            raise

    def _release(self, obj_id, regions, primary):
        for r in regions:
            if not r.freed:
                self._free_region(r, "was freed")
        if primary is not None and not primary.freed:
            self._free_region(primary, "was freed")
        self._objects.pop(obj_id, None)
        if self._dropped:
            self._dropped.discard(obj_id)
            self._kept.pop(obj_id, None)
        if self._dependents and self._dependents.pop(obj_id, None) is not None:
            self._regenerable.clear()             # an input of a dropped object went
        self._regenerable.discard(obj_id)
        if not self.closed:
            try:
                self.policy.forget(obj_id)
            finally:
                if self._observers:
                    for o in reversed(self._observers):     # last in, first out: ids go last
                        o.on_free(obj_id)

    def _drain(self):
        """Free the regions of objects whose finalizers ran since the last call.

        The common entry (one region, its primary, on a heap, nothing else under way) is freed
        in C (native/records.c: heap block, offset index, telemetry, the object's entry, the
        policy's forget); any other goes to ``_release``."""
        _drain(self)

    def drain(self):
        """Process queued frees now."""
        with self._lock:
            if not self.closed:
                self._drain()

    def _live(self, obj):
        if obj.freed:
            raise UseAfterFreeError(f"object {obj.id} ({format_size(obj.nbytes)}) was freed; "
                                    "it cannot be used any more")
        if self.closed:
            raise _closed_error((obj,), self)
        if obj._manager is not self._ref:
            raise self._foreign(obj)

    def _foreign(self, obj):
        """The error for an object of another manager given to this one (its ids, blocks and
        offsets mean nothing here: acting on it would corrupt both managers)."""
        return CachedArraysError(
            f"object {obj.id} ({format_size(obj.nbytes)}) belongs to another manager, not "
            f"{self!r}; use it through its own manager (obj.manager)")

    def _mine(self, region):
        """CachedArraysError unless region lies on one of this manager's devices (another
        manager's region: its offset and owner id mean nothing here, and freeing or copying it
        would corrupt that manager's heap)."""
        dev = region.device
        if self.devices.get(dev.name) is not dev:
            raise CachedArraysError(
                f"{region!r} is on a device of another manager, not of {self!r}; use it through "
                "its own manager (the manager of its object)")

    def _region(self, region):
        """region, if it is a Region on one of this manager's devices (a pointer comparison:
        the dirty-bit calls and ndarray run on every use); else TypeError or _mine's error."""
        dev = getattr(region, "device", None)
        if getattr(dev, "_owner", None) is not self._ref:
            if not isinstance(region, Region):
                raise TypeError(f"expected a Region (obj.primary or Manager.allocate's result), "
                                f"not {type(region).__name__} {region!r}")
            self._mine(region)
        return region

    def _own(self, obj, region):
        self._mine(region)
        if region.freed:
            raise UseAfterFreeError(f"{region!r} was freed")
        if region.owner != obj.id:
            raise CachedArraysError(f"{region!r} belongs to object {region.owner}, not {obj.id}")

    # ---- pinning ---------------------------------------------------------------------------

    def atomic(self):
        """The manager's re-entrant lock, for a sequence of calls no other thread may interleave.

        ``with m.atomic(): ...``: a policy checks and moves an object in one step (no other
        thread pins or frees it in between). Every manager operation takes the same lock, so
        calls made inside the block simply nest.
        """
        return self._lock

    def pinned(self, obj):
        """True while anything pins obj (a running kernel, an access scope, pin()): nothing
        moves or frees it then. The pin()s of threads that have ended are released first, so a
        policy making room may move what such a thread left pinned."""
        return self.pin_count(obj) > 0

    def pin_count(self, obj):
        """How many pins obj holds now (each pin, acquire and new_pinned adds one; pin()s of
        threads that have ended are released first)."""
        if obj._pins and self._ended:
            self._release_ended_locked()
        return obj._pins

    def _release_ended_locked(self):
        """_release_ended, taking the lock (re-entrant: a policy asking holds it already)."""
        with self._lock:
            if self._ended:
                self._release_ended()

    def new_pinned(self, nbytes, placement=None):
        """A new object of nbytes placed by the policy, pinned and reported as written.

        The one path for new arrays: the caller fills it at once (so its primary differs from
        any copy the policy links elsewhere) and ends with ``release((obj,))``. placement: None
        lets the policy choose; "fast" or "slow" is a hint (see ``Policy.place``).
        """
        if nbytes > MAX_SIZE:
            raise OutOfMemoryError(
                f"cannot allocate an array of {nbytes} bytes: more than any device can hold "
                f"(at most {_MAX_TEXT}); check the array's shape and dtype")
        with self._lock:
            policy = self.policy
            last = self._last_id
            try:
                obj = policy.allocate(nbytes) if placement is None else \
                    policy.place(nbytes, placement)
                if type(obj) is not Object or obj._manager is not self._ref or obj.id <= last \
                        or obj.nbytes != nbytes or obj._pins or obj.primary is None:
                    self._check_new(obj, nbytes, last, placement)
            except Exception as e:
                note_policy_error(e, policy)
                raise
            obj._pins += 1
            if self._observers:
                self._fresh.add(obj.id)
            try:
                for o in self._observers:
                    o.on_new(obj, placement)
                policy.write_use(obj)
            except BaseException as e:
                self.release((obj,))              # nobody gets obj: its pin goes with it
                note_policy_error(e, policy)
                raise
            return obj

    def _check_new(self, obj, nbytes, last, placement=None):
        """TypeError unless obj, from the policy's allocate (or place), is what it must be: an
        object of this manager made by that call, unpinned, of nbytes, with a region."""
        hook = "allocate" if placement is None else "place"
        if not isinstance(obj, Object):
            why = f"returned {type(obj).__name__}, not an Object"
        elif obj._manager is not self._ref:
            why = f"returned object {obj.id}, which belongs to another manager"
        elif obj.freed:
            why = f"returned object {obj.id}, which was freed"
        elif obj.id <= last:
            why = (f"returned object {obj.id}, made before this call (it may hold another "
                   "array's data)")
        elif obj.nbytes != nbytes:
            why = f"returned an object of {obj.nbytes} bytes for a request of {nbytes}"
        elif obj._pins:
            why = f"returned object {obj.id}, which is pinned"
        elif obj.primary is None:
            why = f"returned object {obj.id}, which has no region"
        else:
            return
        raise TypeError(f"{type(self.policy).__name__}.{hook}({nbytes}) {why}: a policy's "
                        f"{hook} must return a new object of {nbytes} bytes made in that call "
                        "(self.alloc_fast, self.alloc_slow or manager.create)")

    def pin(self, obj, detached=False):
        """Pin obj: nothing moves or frees it until the matching unpin. Re-entrant.

        A pin belongs to the thread that took it: only that thread's ``unpin`` releases it.
        ``detached=True``: a pin that no thread owns, for memory handed to code that lets go of
        it on another thread (a buffer being sent); release it with ``unpin(obj,
        detached=True)`` from any thread. close() waits for it as for other threads' pins."""
        detached = copyengine.check_switch(detached, "Manager.pin: detached")
        with self._lock:
            if self._gate:
                self._pass_gate((obj,))
            if self._deferred:
                self._drain()
            self._live(obj)
            if obj.dropped:
                self.regenerate(obj)
            if self._copies and obj.id in self._copies:
                self._settle(obj)
            obj._pins += 1
            if detached:
                self._detached[obj.id] = self._detached.get(obj.id, 0) + 1
                return
            if self._ended:
                self._release_ended()
            key = (self._thread_key(), obj.id)
            held = self._pinned_by.get(key)
            self._pinned_by[key] = (obj, held[1] + 1 if held else 1)

    def unpin(self, obj, detached=False):
        """Release one pin that the calling thread took with ``pin(obj)`` (or, with
        ``detached=True``, one detached pin, from any thread).

        Refused (CachedArraysError, nothing changes) when there is no such pin: another
        thread's pin, a running kernel's or an open access scope's is not the caller's to
        release (the array could move under that thread's view)."""
        detached = copyengine.check_switch(detached, "Manager.unpin: detached")
        with self._lock:
            if obj._manager is not self._ref:
                raise self._foreign(obj)
            if self._ended:
                self._release_ended()
            if obj._pins <= 0:
                raise CachedArraysError(f"object {obj.id} is not pinned; unpin without pin")
            if detached:
                held = self._detached.get(obj.id, 0)
                if held <= 0:
                    raise self._foreign_unpin(obj, True)
                if held > 1:
                    self._detached[obj.id] = held - 1
                else:
                    del self._detached[obj.id]
            else:
                key = (threadkeys.current(), obj.id)
                held = self._pinned_by.get(key)
                if held is None:
                    raise self._foreign_unpin(obj, False)
                if held[1] > 1:
                    self._pinned_by[key] = (obj, held[1] - 1)
                else:
                    del self._pinned_by[key]
            obj._pins -= 1
            if self._closing:
                self._cond.notify_all()

    def _foreign_unpin(self, obj, detached):
        """The error for an unpin of obj that matches no pin the caller may release."""
        others = sum(n for (tid, oid), (_, n) in self._pinned_by.items() if oid == obj.id)
        loose = self._detached.get(obj.id, 0)
        rest = obj._pins - others - loose
        holders = ", ".join(f"{n} {what}" for n, what in (
            (others, "by pin() on other threads"), (loose, "detached (pin(detached=True))"),
            (rest, "by running kernels or open access scopes")) if n)
        asked = "detached pin" if detached else "pin of this thread"
        return CachedArraysError(
            f"object {obj.id} holds no {asked} to release (its {obj._pins} pin(s): {holders}); "
            "unpin from the thread that called pin(), release a detached pin with "
            "unpin(obj, detached=True), or take pin(obj, detached=True) to hand a pin to "
            "another thread")

    def acquire(self, reads=(), writes=(), name="use", touched=None, recipe=None):
        """Pin every object and report its use to the policy, in one step (for kernels).

        Each object in reads and writes gets one pin; release the same objects afterwards.
        name: the kernel's name, as traces record it; touched: object id -> bytes the kernel
        touches in it when it touches less than all of it (traces and the cost model use it).
        recipe: a ``lineage.Recipe`` when the kernel is a pure function of its operands
        (``ca.compute``): it becomes the lineage of the writes. Each write adds one to the
        object's ``version``; dropped operands are regenerated first.
        """
        with self._lock:
            if self._gate:
                self._pass_gate((*reads, *writes))
            ref = self._ref
            for objs in (reads, writes):
                for o in objs:
                    if o._manager is not ref:
                        raise self._foreign(o)
            if self._deferred:
                self._drain()
            if self._observers and not self.recomputing:  # plans act before the kernel's
                try:                                        # operands are staged (a rerun
                    for ob in self._observers:              # of regenerate is no kernel)
                        ob.on_begin(name, reads, writes)
                except Exception as e:
                    note_policy_error(e, self.policy)
                    raise
            held = None                 # operands pinned while dropped ones are rebuilt
            try:
                if self._dropped:
                    held = self._regenerate_operands(reads, writes)
                if getattr(self.policy, "kernels_in_fast", False):
                    # the operands are fetched before the kernel starts: its time excludes them
                    self.policy.stage(reads, writes, name)
            except BaseException as e:
                if held:
                    self._unhold(held)
                for ob in self._observers:      # the kernel never starts (plans close it)
                    ob.on_release((*reads, *writes))
                note_policy_error(e, self.policy)
                raise
            done = []
            try:
                if self._observers:
                    for o in (*reads, *writes):
                        if o.freed:
                            self._live(o)
                    self.recipe = recipe
                    try:
                        for ob in self._observers:
                            ob.on_acquire(name, reads, writes, touched)
                    finally:
                        self.recipe = None
                if reads:
                    self._pin_all(reads, self.policy.read_use, done)
                if writes:
                    self._pin_all(writes, self.policy.write_use, done)
            except BaseException as e:
                for o in done:
                    o._pins -= 1
                if held:
                    self._unhold(held)
                for ob in self._observers:
                    ob.on_release((*reads, *writes))
                if self._closing:
                    self._cond.notify_all()
                note_policy_error(e, self.policy)
                raise
            if held:
                self._unhold(held)
            if writes and not self.recomputing:
                if self._dependents and any(o.id in self._dependents for o in writes):
                    self._rescue_writes(writes)   # dropped since the check above (staging)
                if recipe is None:                # no recipe: the lineage breaks here
                    for o in writes:
                        o.version += 1
                        o.chain = name
                else:
                    recipe.record(reads, writes)

    def _pin_all(self, objs, use, done):
        for o in objs:
            if o.freed:
                self._live(o)
            if self._copies and o.id in self._copies:
                self._settle(o)
            o._pins += 1
            done.append(o)
            use(o)

    # ---- background copies -----------------------------------------------------------------

    def _settle(self, obj):
        """obj is about to be used: wait for its background copy (the wait is stall)."""
        c = self._copies.pop(obj.id)
        job = c.job
        if job is not None and not job.done():
            t = time.perf_counter()
            job.wait()
            waited = time.perf_counter() - t
            self.telemetry.stall_seconds += waited
            self.telemetry.count("copy_stall", obj.nbytes, id=obj.id, seconds=waited)
        if job is not None and job.exception is not None:
            raise CachedArraysError(f"the background copy of object {obj.id} failed: "
                                    f"{job.exception}") from job.exception

    def _copy_async(self, dst, src):
        """Issue a background copy src -> dst (both regions of one object)."""
        obj = self.object(dst.owner)
        if obj.id in self._copies:
            self._settle(obj)
        job = None
        if not (src.device.virtual or dst.device.virtual):
            if self._copier is None:
                self._copier = copyengine.CopyWorkers()
            job = self._copier.submit(f"{src.device.name}->{dst.device.name}", dst.address,
                                      src.address, src.nbytes, persist=dst.device.dax,
                                      keepalive=(src.device.buffer, dst.device.buffer))
        self._copies[obj.id] = _Copy(job, src, dst)
        self.telemetry.count("copy_async", src.nbytes, id=obj.id)

    def _copy_region_freed(self, region, c):
        """A region with a background copy c is being freed: cancel a copy into it; keep a
        copy out of it safe (new blocks over it wait until the copy has read it). Returns the
        copy still reading it, if any."""
        if c.dst is region:
            del self._copies[region.owner]
            for o in self._observers:
                o.on_cancel(region.owner, c.src, c.dst)
            self.telemetry.count("copy_cancelled", region.nbytes, id=region.owner)
            if c.job is not None:
                c.job.cancel()
        elif c.src is region and c.job is not None and not c.job.done():
            self._reading.append((region.device, region.offset,
                                  region.offset + region.device.block_size(region.nbytes),
                                  c.job))
            return c.job
        return None

    def _await_readers(self, dev):
        """A block is about to be handed out on dev: wait for background copies still reading
        freed memory of dev. (Before the heap allocates: splitting a free block writes the
        remainder's header past the new block, inside memory a copy may still be reading.)"""
        keep = []
        for entry in self._reading:
            d, lo, hi, job = entry
            if job.done():
                continue
            if d is dev:
                t = time.perf_counter()
                job.wait()
                self.telemetry.stall_seconds += time.perf_counter() - t
                continue
            keep.append(entry)
        self._reading = keep
        if self._unpoisoned:
            self._debug_poison_read()

    def cancel(self, obj):
        """Cancel obj's background prefetch: its primary goes back to the copy it came from.

        Returns True if a copy was cancelled; False if obj has none, or if it is a background
        eviction whose source is already gone (that copy always completes).
        """
        obj = _object_of(obj, "cancel")
        with self._lock:
            self._live(obj)
            c = self._copies.get(obj.id)
            if c is None or c.src.freed or obj.primary is not c.dst or \
                    obj.regions.get(c.src.device.name) is not c.src:
                return False
            dst = c.dst
            obj.primary = c.src               # its bytes are the object's data
            self.free(dst)                    # cancels the copy
            if dst.device is self.fast:
                self.policy.forget(obj.id)
            return True

    def wait_copies(self, timeout=None):
        """Wait until every background copy has finished; False on timeout."""
        timeout = copyengine.check_timeout(timeout, "wait_copies timeout")
        copier = self._copier
        return True if copier is None else copier.drain(timeout)

    def release(self, objs):
        """Unpin objects pinned by acquire.

        New objects (``new_pinned``) released together with the operands of the kernel that
        made them (a ufunc's output) are released after the others, in a release of their own:
        observers match each release to its acquire.
        """
        with self._lock:
            ref = self._ref
            for o in objs:
                if o._manager is not ref:
                    raise self._foreign(o)
                if o._pins <= 0:
                    raise CachedArraysError(
                        f"object {o.id} ({format_size(o.nbytes)}) is not pinned; release without "
                        "acquire (release exactly the objects that acquire or new_pinned pinned, "
                        "once)")
            errors = []
            fresh = self._fresh
            if fresh:
                new = [o for o in objs if o.id in fresh]
                if new:
                    fresh.difference_update(o.id for o in new)
                    if len(new) < len(objs):
                        self._unpin_reported([o for o in objs if o not in new], errors)
                        objs = new
            self._unpin_reported(objs, errors)
            if self._closing:
                self._cond.notify_all()
            if errors:                        # every pin went and every observer heard first
                note_policy_error(errors[0], self.policy)
                raise errors[0]

    def _unpin_reported(self, objs, errors):
        """Unpin objs and report it to every observer; errors collects what observers raise
        (a policy's write-back, say), so that one failing observer leaves no pin behind."""
        for o in objs:
            o._pins -= 1
        for ob in self._observers:
            try:
                ob.on_release(objs)
            except BaseException as e:
                errors.append(e)

    def run(self, fn, reads=(), writes=(), nbytes=None, name="use", short=False,
            placement=None):
        """``fn(new)`` with reads and writes pinned and reported as used (``acquire``), and,
        when nbytes is given, a new object of nbytes placed by the policy, pinned and reported
        written (``new_pinned``); new is None otherwise. Returns fn's result; everything is
        released when fn returns or raises (``release``).

        The same pins, use reports, lineage and telemetry as acquire + new_pinned + release, in
        fewer steps. short: fn is brief (a kernel on small arrays): when nothing else is under
        way (no close, observer, background copy, dropped object or kernels-in-fast staging) it
        runs under the manager's lock, so the call takes the lock once.

        ``run_ufunc`` (native/records.c) repeats this common path for the ufunc results that
        cachedarrays.ufuncs makes: keep the two in step.
        """
        if short is not False and short is not True:
            short = copyengine.check_switch(short, "Manager.run: short")
        lock = self._lock
        lock.acquire()
        try:
            if self._gate or self._observers or self._copies or self._dropped or \
                    self._dependents or getattr(self.policy, "kernels_in_fast", False):
                lock.release()
                lock = None
                return self._run_general(fn, reads, writes, nbytes, name, placement)
            if self._deferred:
                self._drain()
            policy = self.policy
            held = []
            try:
                ref = self._ref
                for o in reads:
                    if o.freed or o._manager is not ref:
                        self._live(o)
                    o._pins += 1
                    held.append(o)
                    policy.read_use(o)
                for o in writes:
                    if o.freed or o._manager is not ref:
                        self._live(o)
                    o._pins += 1
                    held.append(o)
                    policy.write_use(o)
                if writes and not self.recomputing:
                    for o in writes:             # no recipe: the lineage breaks here
                        o.version += 1
                        o.chain = name
                new = None
                if nbytes is not None:
                    if nbytes and placement is None and policy.fast_first and \
                            not self._reading and self._debug is None:
                        new = self._create_fast(nbytes)
                    if new is not None:          # where allocate would put it: report both
                        new._pins += 1           # on_fast and write_use in one call
                        held.append(new)
                        policy.new_in_fast(new)
                    else:
                        last = self._last_id
                        new = policy.allocate(nbytes) if placement is None else \
                            policy.place(nbytes, placement)
                        if type(new) is not Object or new._manager is not self._ref or \
                                new.id <= last or new.nbytes != nbytes or new._pins or \
                                new.primary is None:
                            self._check_new(new, nbytes, last, placement)
                        new._pins += 1
                        held.append(new)
                        policy.write_use(new)
            except BaseException as e:
                for o in held:
                    o._pins -= 1
                note_policy_error(e, policy)
                raise
            if short:
                try:
                    return fn(new)
                finally:
                    for o in held:
                        o._pins -= 1
            lock.release()
            try:
                return fn(new)
            finally:
                lock.acquire()
                for o in held:
                    o._pins -= 1
                if self._closing:
                    self._cond.notify_all()
        finally:
            if lock is not None:
                lock.release()

    def _run_general(self, fn, reads, writes, nbytes, name, placement):
        """run() while something else is under way: acquire, new_pinned, fn, release (with
        no operands, only new_pinned and release: no kernel is reported)."""
        objs = (*reads, *writes)
        if objs:
            self.acquire(reads, writes, name)
        try:
            new = None if nbytes is None else self.new_pinned(nbytes, placement)
        except BaseException:
            if objs:
                self.release(objs)
            raise
        try:
            return fn(new)
        finally:
            if new is not None:
                self.release((*objs, new))
            elif objs:
                self.release(objs)

    # ---- lineage: drop and regenerate ------------------------------------------------------

    def why_not_regenerable(self, obj):
        """Why obj's data could not be rebuilt by rerunning the kernels that made it (which
        input changed or was freed, which kernel is not a ``ca.compute`` one); None if it can."""
        obj = _object_of(obj, "why_not_regenerable")
        with self._lock:
            if obj._manager is not self._ref:
                raise self._foreign(obj)
            if self._deferred:
                self._drain()
            return self._why_not(obj, self._writing)

    def regenerable(self, obj):
        """True if obj's data can be rebuilt bitwise from its lineage (so it may be dropped)."""
        return self.why_not_regenerable(obj) is None

    def drop(self, obj, annotation=False):
        """Let obj's data go: free every region without writing back; the object stays, with
        ``dropped`` True, and its next use (or ``regenerate``) rebuilds it from its lineage.

        RecomputeError names the reason when obj cannot be rebuilt; PinnedError while a kernel
        or scope uses it. Returns False if it was dropped already. annotation: the program
        asked for it (``ca.drop``; traces record it, replays repeat it); a policy leaves it off.
        """
        obj = _object_of(obj, "drop")
        if annotation is not False and annotation is not True:
            annotation = copyengine.check_switch(annotation, "Manager.drop: annotation")
        with self._lock:
            self._live(obj)
            if self._deferred:
                self._drain()
            if obj.dropped:
                return False
            if self.pinned(obj):
                raise PinnedError(f"cannot drop {_describe(obj)}: a running kernel or an open "
                                  "access scope pins it; drop it after the scope ends")
            why = self._why_not(obj, self._writing)
            if why is not None:
                raise RecomputeError(
                    f"cannot drop object {obj.id} ({format_size(obj.nbytes)}): it could not be "
                    f"regenerated, because {why}. Make it (and its inputs) with ca.compute "
                    "kernels and keep their inputs unchanged, or evict it instead of dropping")
            if annotation:
                for o in self._observers:
                    o.on_annotation("drop", obj, ())
            self._let_go(obj)
            if not self._writing:
                self._regenerable.add(obj.id)
            self.telemetry.count("drop", obj.nbytes, id=obj.id)
            return True

    def _why_not(self, obj, writing, rebuilding=None):
        """lineage.why_not, skipping the dropped objects found regenerable since the last write
        or free of an input of a dropped object (``_rescue``): a sequence of drops down a chain
        walks each object once, not the whole chain below it each time. While a write is about
        to happen (``_writing``) what is found may not hold after it: then only rebuilding (the
        set one rebuild keeps, under that same writing) is used."""
        if not writing and not self._writing:
            known = self._regenerable
        else:
            known = rebuilding if writing == self._writing else None
        return _lineage_why_not(self, obj, writing=writing, known=known)

    def regenerate(self, obj, annotation=False):
        """Rebuild a dropped obj bitwise by rerunning the kernels that made it (its dropped
        inputs first). Returns False if obj was not dropped.

        obj goes to fast memory if it fits (the policy makes room), else to slow memory.
        Inputs rebuilt on the way stay when they found room in fast memory without evicting
        anything, and are dropped again otherwise, as soon as what is made from them is rebuilt
        (a chain of any length holds only a few arrays at a time). RecomputeError when it
        cannot be done; OutOfMemoryError when its arrays find no room (they stay dropped).
        """
        obj = _object_of(obj, "regenerate")
        if annotation is not False and annotation is not True:
            annotation = copyengine.check_switch(annotation, "Manager.regenerate: annotation")
        with self._lock:
            self._live(obj)
            if self._deferred:
                self._drain()
            if annotation:
                for o in self._observers:
                    o.on_annotation("regenerate", obj, ())
            if not obj.dropped:
                return False
            why = self._why_not(obj, ())
            if why is not None:
                raise RecomputeError(
                    f"cannot regenerate object {obj.id} ({format_size(obj.nbytes)}), which was "
                    f"dropped: {why}. Its data is lost; free it (ca.unsafe_free) and compute it "
                    "again, and drop only arrays that m.regenerable says can be rebuilt")
            t = time.perf_counter()
            held, kept = {}, []
            try:
                self._rebuild(obj, held, kept)
            except BaseException as e:
                for o in held.values():           # half-built: its data is not what it was
                    o._pins -= 1
                    if not o.dropped and not o.freed:
                        self._let_go(o)
                if isinstance(e, OutOfMemoryError) and not self.recomputing:
                    raise OutOfMemoryError(
                        f"cannot regenerate object {obj.id} ({format_size(obj.nbytes)}): its "
                        "rebuild holds it and the operands of one of its kernels at a time, "
                        f"and they found no room ({e}). It stays dropped; free or evict other "
                        "arrays, or give the manager larger devices") from e
                raise
            obj._pins -= 1
            # Inputs kept for the objects rebuilt may go now (when this list goes).
            kept.append(self._kept.pop(obj.id, None))
            if self._closing:
                self._cond.notify_all()
            self.telemetry.count("regenerate", obj.nbytes, id=obj.id,
                                 seconds=time.perf_counter() - t)
            return True

    def _let_go(self, obj):
        """Free obj's regions without a write-back and mark it dropped (it is regenerable)."""
        regions = list(obj.regions.values())
        if obj.primary is not None and obj.primary not in regions:
            regions.append(obj.primary)
        in_fast = any(r.device is self.fast for r in regions)
        for r in regions:
            if not r.freed:
                self._free_region(r, "was dropped")
        obj.primary = None
        obj.regions = {}
        obj.dropped = True
        self._dropped.add(obj.id)
        self._keep_inputs(obj)
        if in_fast:
            self.policy.forget(obj.id)

    def _keep_inputs(self, obj):
        """A dropped obj holds the inputs of its chain: they stay alive (the collector does not
        free them) and a write or a free of one first rebuilds obj (``_rescue``)."""
        kept = []
        for e in obj.chain:
            for rid in e.reads:
                if rid != obj.id:
                    r = self.object(rid)
                    if r is not None:
                        kept.append(r)
                        self._dependents.setdefault(rid, set()).add(obj.id)
        self._kept[obj.id] = kept

    def _rescue(self, obj):
        """obj is about to be written or freed: rebuild the dropped objects made from it first
        (their data would be lost otherwise). Those not rebuilt when one fails stay listed."""
        ids = sorted(self._dependents.pop(obj.id, ()))
        self._regenerable.clear()                 # what was found regenerable may change now
        for i, did in enumerate(ids):
            d = self.object(did)
            if d is not None and d.dropped:
                self.telemetry.count("regenerate_before_change", d.nbytes, id=d.id,
                                     input=obj.id)
                try:
                    self.regenerate(d)
                except BaseException:
                    self._dependents.setdefault(obj.id, set()).update(ids[i:])
                    raise

    def _regenerate_operands(self, reads, writes):
        """Before a kernel: rebuild the dropped objects made from what it writes (their data
        would be lost), then its own dropped operands. Returns the operands, each pinned once
        more, so that no rebuild lets another operand go; the caller unpins them (_unhold)
        once the kernel's own pins are taken. None when nothing was to be done."""
        ops = (*reads, *writes)
        rescue = writes and self._dependents and not self.recomputing and \
            any(o.id in self._dependents for o in writes)
        if not rescue and not any(o.dropped for o in ops):
            return None
        held = []
        try:
            for o in ops:
                if not o.freed and not o.dropped:
                    o._pins += 1
                    held.append(o)
            if rescue:
                self._rescue_writes(writes)
            for o in ops:
                if o.dropped and not o.freed:
                    self.regenerate(o)
                    o._pins += 1
                    held.append(o)
        except BaseException:
            self._unhold(held)
            raise
        return held

    def _rescue_writes(self, writes):
        """Rebuild every dropped object made from what a kernel is about to write; meanwhile
        nothing else made from those may be dropped (``_writing``)."""
        saved = self._writing
        self._writing = saved | {o.id for o in writes}
        try:
            for o in writes:
                if o.id in self._dependents:
                    self._rescue(o)
        finally:
            self._writing = saved

    def _unhold(self, held):
        for o in held:
            o._pins -= 1
        if self._closing:
            self._cond.notify_all()

    def _rebuild(self, obj, held, kept):
        """Rebuild dropped obj: a region first (before its inputs take the room), then its
        dropped inputs from the deepest up, each placed and rerun once its own inputs are
        there. Every object placed is pinned and in held (id -> object); an input is let go
        (``_done``) as soon as the last object made from it is rebuilt, so a chain of any depth
        holds only a few inputs at a time. obj stays pinned and in held.

        In kernels-in-fast mode obj is placed at its turn instead: each rerun stages its
        operands in fast memory, and a rebuild then needs no more room than one kernel did."""
        order, users = self._rebuild_order(obj)
        first = not getattr(self.policy, "kernels_in_fast", False)
        if first:
            self._place(obj, held)
        temps = set()                             # ids of inputs to drop again once used
        found = set()                             # ids found regenerable (while _writing)
        for o, inputs in order:
            if o.dropped:                         # not rebuilt on the way as another output
                if self._place(o, held) is False and o is not obj:
                    temps.add(o.id)
                self._rerun_chain(o, held, temps)
            elif o is obj and first:
                self._rerun_chain(o, held, temps)
            for r in inputs:
                users[r.id] -= 1
            for r in [*inputs, *held.values()]:   # inputs used up, other outputs unused
                if r is not obj and not users.get(r.id) and r.id in held:
                    self._done(r, held, kept, temps, found)

    def _rerun_chain(self, obj, held, temps):
        """Rerun every recipe of obj's chain, oldest first."""
        for e in obj.chain:
            self._rerun(e, obj, held, temps)

    def _rebuild_order(self, obj):
        """The dropped objects obj is rebuilt from, each with its dropped inputs, deepest first
        and obj last (a walk with its own stack); and how many of them read each input."""
        order, users, seen = [], {}, {obj.id}
        stack = [(obj, self._dropped_inputs(obj), [0])]
        while stack:
            o, inputs, at = stack[-1]
            if at[0] == len(inputs):
                stack.pop()
                order.append((o, inputs))
                continue
            r = inputs[at[0]]
            at[0] += 1
            users[r.id] = users.get(r.id, 0) + 1
            if r.id not in seen:
                seen.add(r.id)
                stack.append((r, self._dropped_inputs(r), [0]))
        return order, users

    def _dropped_inputs(self, obj):
        """The dropped objects obj's chain reads (obj aside), each once."""
        out = {}
        for e in obj.chain:
            for rid in e.reads:
                if rid != obj.id and rid not in out:
                    r = self.object(rid)
                    if r is not None and r.dropped:
                        out[rid] = r
        return list(out.values())

    def _done(self, obj, held, kept, temps, found):
        """A rebuilt input is used up: unpin it, and drop it again if it took room from others
        (its id in temps) or went to slow memory and is still regenerable, else let its own
        inputs go. found: the rebuild's ids found regenerable while a write is about to happen."""
        del held[obj.id]
        obj._pins -= 1
        if obj.id in temps and not obj._pins and \
                self._why_not(obj, self._writing, found) is None:
            self._let_go(obj)
            (found if self._writing else self._regenerable).add(obj.id)
            self.telemetry.count("drop", obj.nbytes, id=obj.id)
        else:
            kept.append(self._kept.pop(obj.id, None))

    def _place(self, obj, held):
        """A region for a dropped obj: fast if it fits (the policy makes room), else slow, else
        the first slower tier with room. Returns True when it went to fast memory without
        evicting anything. obj is pinned."""
        n = obj.nbytes
        fast = self.fast
        free_room = True
        r = self.try_allocate(fast, n, obj)
        if r is None:
            free_room = False
            if self.fits(fast, n) and self.policy.make_room(n):
                r = self.try_allocate(fast, n, obj)
            for dev in self.tiers[1:]:            # slow, else a slower tier with room
                if r is None:
                    r = self.try_allocate(dev, n, obj)
            if r is None:
                r = self.allocate(self.tiers[-1], n, obj)     # OutOfMemoryError naming it
        obj.regions[r.device.name] = r
        obj.primary = r
        r._dirty = True                           # no other copy: an eviction must copy it
        obj.dropped = False
        self._dropped.discard(obj.id)
        self._regenerable.discard(obj.id)
        obj._pins += 1                            # its inputs stay kept while it is in held
        held[obj.id] = obj
        if r.device is fast:
            self.policy.on_fast(obj)
        return free_room

    def _rerun(self, e, target, held, temps):
        """Run recipe e again, writing target; its other outputs are written too if they are
        dropped and e alone made them, else into scratch arrays (their data stays)."""
        reads = [self.object(rid) for rid in e.reads]
        writes, scratch = [], set()
        for wid in e.writes:
            w = self.object(wid)
            if w is target:
                writes.append(w)
            elif w is not None and w.dropped and type(w.chain) is list and \
                    len(w.chain) == 1 and w.chain[0] is e:
                if self._place(w, held) is False:
                    temps.add(wid)
                writes.append(w)
            else:
                scratch.add(wid)
        outer = self.recompute_entry
        self.recomputing += 1
        self.recompute_entry = e
        try:
            self.acquire(reads, writes, e.name, e.touched)
            try:
                fn = e.fn
                if fn is not None:
                    args = []
                    for a in e.args:
                        if a is None:
                            args.append(None)
                            continue
                        oid, w, dtype, shape, strides, offset = a
                        if w and oid in scratch:
                            args.append(_scratch(dtype, shape, strides, offset))
                        else:
                            args.append(self.ndarray(self.object(oid).primary, dtype, shape,
                                                     strides, offset, readonly=not w))
                    if e.rng is not None:
                        fn(*args, rng=e.rng_for_rerun())
                    else:
                        fn(*args)
            finally:
                self.release((*reads, *writes))
        finally:
            self.recomputing -= 1
            self.recompute_entry = outer

    # ---- annotations and marks (the doors the array layer and replays use) -----------------

    def prefetch(self, obj, force=False, wait=True):
        """Ask the policy to bring obj into fast memory; True if its primary is there after.

        An object already in fast memory only reports a ``read_use``. wait=False lets the copy
        run in the background (policies that support it; see ``Policy.prefetch``).
        """
        if force is not False and force is not True:
            force = copyengine.check_switch(force, "Manager.prefetch: force")
        if wait is not True and wait is not False:
            wait = copyengine.check_switch(wait, "Manager.prefetch: wait")
        try:
            with self._lock:
                self._live(obj)
                if self._deferred:      # frees queued before the request are recorded before it
                    self._drain()
                for o in self._observers:
                    o.on_annotation("prefetch", obj, (bool(force), bool(wait)))
                if obj.dropped:
                    self.regenerate(obj)
                r = obj.primary
                policy = self.policy
                if r is not None and r.device is self.fast:
                    policy.read_use(obj)
                    return True
                if wait:
                    return policy.prefetch(obj, force)
                return policy.prefetch(obj, force, wait=False)
        except Exception as e:
            note_policy_error(e, self.policy)
            raise

    def evict(self, obj, to=None, wait=True):
        """Ask the policy to move obj out of fast memory (to: a device name; default slow)."""
        if wait is not True and wait is not False:
            wait = copyengine.check_switch(wait, "Manager.evict: wait")
        try:
            with self._lock:
                self._live(obj)
                if to is not None:
                    to = self._device(to).name
                if self._deferred:
                    self._drain()
                for o in self._observers:
                    o.on_annotation("evict", obj, (to, bool(wait)))
                if obj.dropped:                       # no data to move
                    return True
                if to is None and wait:
                    return self.policy.evict(obj)
                return self.policy.evict(obj, to=to, wait=wait)
        except Exception as e:
            note_policy_error(e, self.policy)
            raise

    def fault(self, obj):
        """Report that a kernel needed obj in fast memory and it had to be fetched on demand
        (a policy's ``stage`` calls it before the fetch; the cost model charges a fault)."""
        with self._lock:
            if obj._manager is not self._ref:
                raise self._foreign(obj)
            self.telemetry.count("fault", obj.nbytes, id=obj.id)
            for o in self._observers:
                o.on_fault(obj)

    def softevict(self, obj):
        """Ask the policy to prefer obj for eviction (no movement now)."""
        try:
            with self._lock:
                self._live(obj)
                if self._deferred:
                    self._drain()
                for o in self._observers:
                    o.on_annotation("softevict", obj, ())
                if obj.dropped:
                    return None
                return self.policy.softevict(obj)
        except Exception as e:
            note_policy_error(e, self.policy)
            raise

    def mark(self, kind):
        """A "layer" or "step" mark of the running program: for traces and the policy's plan."""
        if kind not in ("layer", "step"):
            raise ValueError(f"mark kind must be 'layer' or 'step', not {kind!r}")
        with self._lock:
            self._check_open()
            if self._deferred:
                self._drain()
            for o in self._observers:
                o.on_mark(kind)
            hook = getattr(self.policy, "on_layer" if kind == "layer" else "on_step", None)
            if hook is not None:
                try:
                    hook()
                except Exception as e:
                    note_policy_error(e, self.policy)
                    raise

    def observe(self, observer):
        """Report this manager's operations to observer (an ``Observer``) from now on."""
        with self._lock:
            if observer not in self._observers:
                self._observers = self._observers + (observer,)

    def unobserve(self, observer):
        with self._lock:
            self._observers = tuple(o for o in self._observers if o is not observer)

    # ---- regions ---------------------------------------------------------------------------

    def _device(self, device):
        if isinstance(device, Device):
            if self.devices.get(device.name) is not device:
                raise ValueError(f"device {device.name!r} ({format_size(device.size)}) is not one "
                                 f"of this manager's devices: its heap belongs to another manager "
                                 f"(or to none); pass one of this manager's devices or its name "
                                 f"({', '.join(self.devices)})")
            return device
        try:
            return self.devices[device]
        except KeyError:
            dev = self._alias.get(device)
            if dev is not None:
                return dev
            raise ValueError(f"unknown device {device!r}; devices are "
                             f"{', '.join(self.devices)}") from None

    def allocate(self, device, nbytes, obj):
        """Allocate a region of nbytes for obj on device; OutOfMemoryError when it does not fit."""
        with self._lock:
            if self._gate:
                self._pass_alloc_gate()
            self._drain()
            self._live(obj)
            dev = self._device(device)
            nbytes = int(nbytes)
            if nbytes < 0:
                raise ValueError(f"region size must not be negative, got {nbytes}")
            if nbytes == 0:
                region = Region(dev, -1, 0, obj.id)
            else:
                if self._reading:
                    self._await_readers(dev)
                try:
                    offset = dev.alloc(nbytes, obj.id)
                except OutOfMemoryError as e:
                    raise OutOfMemoryError(f"object {obj.id}: {e}") from None
                if self._debug is not None:
                    self._debug_reuse(dev, offset)
                region = Region(dev, offset, nbytes, obj.id)
                self._by_offset[dev.name][offset] = region
            self.telemetry.on_alloc(dev.name, nbytes, obj.id)
            for o in self._observers:
                o.on_region(region, True)
            return region

    def try_allocate(self, device, nbytes, obj):
        """Like allocate, but return None when the device has no room."""
        try:
            return self.allocate(device, nbytes, obj)
        except OutOfMemoryError:
            return None

    def can_allocate(self, device, nbytes):
        with self._lock:
            return nbytes == 0 or self._device(device).can_alloc(nbytes)

    def fits(self, device, nbytes):
        """Could nbytes ever be held by device (if it were empty)?"""
        with self._lock:                          # the heap may not be closed meanwhile
            return nbytes == 0 or self._device(device).fits(nbytes)

    def free(self, region):
        """Free region to its device (and drop it from its object)."""
        with self._lock:
            self._check_open()
            self._mine(region)
            if region.freed:
                raise UseAfterFreeError(f"{region!r} was already freed (double free)")
            obj = self.object(region.owner)
            if obj is not None and obj.primary is region and self.pinned(obj):
                raise PinnedError(f"object {obj.id} is pinned; its primary region cannot be "
                                  "freed until the access scope ends")
            self._free_region(region)

    def _free_region(self, region, why=None):
        dev = region.device
        job = None
        if self._copies:
            c = self._copies.get(region.owner)
            if c is not None:
                job = self._copy_region_freed(region, c)
        if region.nbytes:
            heap = dev.heap
            if heap is not None:
                heap.free(region.offset, region.owner)
            else:
                dev.free(region.offset, region.owner)     # raises: the device has no heap
            self._by_offset[dev.name].pop(region.offset, None)
            if self._debug is not None:
                self._debug_vacate(region, why, job)
        region.freed = True
        region._buffer = None
        self.telemetry.on_free(dev.name, region.nbytes, region.owner)
        if self._observers:
            for o in self._observers:
                o.on_region(region, False)
        ref = self._objects.get(region.owner)
        obj = ref() if ref is not None else None
        if obj is not None:
            if obj.regions.get(dev.name) is region:
                del obj.regions[dev.name]
            if obj.primary is region:
                obj.primary = None

    def _debug_vacate(self, region, why, job=None):
        """Debug mode: poison a region's bytes as they leave their object (once job, a
        background copy still reading them, has read them)."""
        if why is None:
            obj = self.object(region.owner)
            p = obj.primary if obj is not None else None
            why = (f"moved from {region.device.name!r} to {p.device.name!r}"
                   if p is not None and p is not region and p.device is not region.device else
                   f"left its {region.device.name!r} region")
        if job is not None:
            self._unpoisoned.append((job, region, why))
            return
        self._debug.vacate(region.device, region.data_offset, region.nbytes, region.owner,
                           region.nbytes, why)

    def _debug_poison_read(self):
        """Debug mode: poison the freed regions whose background copies have read them."""
        keep = []
        for job, region, why in self._unpoisoned:
            if job.done():
                self._debug_vacate(region, why)
            else:
                keep.append((job, region, why))
        self._unpoisoned = keep

    def _debug_reuse(self, dev, offset):
        """Debug mode: a block was handed out; report writes made into it since it was vacated."""
        for w in self._debug.reuse(dev, offset, dev.heap.info(offset).size):
            self.telemetry.count("debug_stale_writes", w.changed, id=w.owner, device=w.device)

    def link(self, a, b):
        """Link regions a and b (same object, different devices) as copies of each other."""
        with self._lock:
            obj = self._parent_live(a)
            self._own(obj, b)
            if a.device is b.device:
                raise CachedArraysError(f"cannot link {a!r} and {b!r}: same device")
            for r in (a, b):
                cur = obj.regions.get(r.device.name)
                if cur is not None and cur is not r:
                    raise CachedArraysError(f"object {obj.id} already has a region on "
                                            f"{r.device.name!r}")
                obj.regions[r.device.name] = r

    def unlink(self, a, b):
        """Undo link(a, b): the region that is not primary leaves the object (free it next)."""
        with self._lock:
            obj = self._parent_live(a)
            self._own(obj, b)
            for r in (a, b):
                if r is not obj.primary and obj.regions.get(r.device.name) is r:
                    del obj.regions[r.device.name]

    def getlinked(self, region, device):
        """The region linked to region on device, or None."""
        self._mine(region)
        obj = self.object(region.owner)
        if obj is None or region.freed:
            return None
        dev = self._device(device)
        other = obj.regions.get(dev.name)
        if other is None or other is region or obj.regions.get(region.device.name) is not region:
            return None
        return other

    def copyto(self, dst, src, wait=True):
        """Copy src's bytes into dst (counted by direction in telemetry).

        Between virtual devices (a replay) the copy is counted and reported but moves nothing.
        wait=False: the copy may run in the background (see ``Policy.prefetch``).
        """
        if wait is not True and wait is not False:
            wait = copyengine.check_switch(wait, "Manager.copyto: wait")
        with self._lock:
            self._check_open()
            self._mine(dst)
            self._mine(src)
            if dst.freed or src.freed:
                raise UseAfterFreeError(f"copy between freed regions: {dst!r} <- {src!r}")
            if dst.nbytes < src.nbytes:
                raise ValueError(f"copy of {format_size(src.nbytes)} does not fit in "
                                 f"{dst!r}")
            if src.nbytes == 0:
                return
            owner = self.object(src.owner)
            c = self._copies.get(src.owner) if self._copies else None
            if c is not None and c.dst is src:
                self._settle(owner)             # src itself is still being filled
            for o in self._observers:
                o.on_copy(src, dst, wait)
            if not wait and owner is not None and dst.owner == src.owner:
                self._copy_async(dst, src)
                self.telemetry.on_copy(src.device.name, dst.device.name, src.nbytes, 0.0,
                                       src.owner)
                return
            if src.device.virtual or dst.device.virtual:
                seconds = 0.0
            else:
                t = time.perf_counter()
                copyengine.copy(dst.address, src.address, src.nbytes, persist=dst.device.dax)
                seconds = time.perf_counter() - t
            self.telemetry.on_copy(src.device.name, dst.device.name, src.nbytes, seconds,
                                   src.owner)

    def sizeof(self, region):
        return self._region(region).nbytes

    def on_device(self, region, device):
        """True if region is on device (a name or a Device)."""
        return self._region(region).device is self._device(device)

    def markdirty(self, region):
        """region holds data that its linked copies do not (an eviction must copy it back)."""
        self._region(region)._dirty = True

    def markclean(self, region):
        """region equals its linked copy (an eviction may just drop it)."""
        self._region(region)._dirty = False

    def isdirty(self, region):
        return self._region(region)._dirty

    def parent(self, region):
        """The object that owns region (None if it has been freed)."""
        self._mine(region)
        return self.object(region.owner)

    def _parent_live(self, region):
        self._check_open()
        self._mine(region)
        if region.freed:
            raise UseAfterFreeError(f"{region!r} was freed")
        obj = self.object(region.owner)
        if obj is None:
            raise UseAfterFreeError(f"the object owning {region!r} was freed")
        return obj

    # ---- device-wide operations ------------------------------------------------------------

    def evictfrom(self, device, region, nbytes, callback):
        """Free a contiguous range on device big enough for nbytes, walking from region.

        Each occupied region met on the walk is passed to callback(region), which must move or
        free it and return True, or return False to leave it. Pinned objects are skipped without
        asking. Returns True if a large enough free block now exists.
        """
        with self._lock:
            self._check_open()
            self._drain()
            if self._ended:                     # what threads that ended left pinned may go
                self._release_ended()
            dev = self._device(device)
            if dev.heap is None:
                return False
            if region is None:
                start = 0   # the first block always starts at offset 0
            else:
                if region.device is not dev or region.freed or region.nbytes == 0:
                    raise CachedArraysError(f"evictfrom needs a live region on {dev.name!r}, "
                                            f"got {region!r}")
                start = region.offset
            table = self._by_offset[dev.name]

            def visit(offset, owner):
                r = table.get(offset)
                if r is None:
                    return False
                obj = self.object(owner)
                if obj is None:
                    self._free_region(r)   # its object is gone; the free was only queued
                    return True
                if obj._pins:
                    self.telemetry.count("evict_skipped_pinned", r.nbytes)
                    return False
                return bool(callback(r)) and r.freed

            return dev.heap.evictfrom(start, nbytes, visit) is not None

    def defrag(self, device="fast"):
        """Slide regions down so free space gathers at the top; pinned objects stay put."""
        with self._lock:
            self._check_open()
            self._drain()
            dev = self._device(device)
            for o in self._observers:
                o.on_defrag(dev.name)
            if dev.heap is None:
                return 0
            moves = self._slide(dev, "on_move")
            self.telemetry.count("defrag_moves", sum(r.nbytes for r, _ in moves),
                                 device=dev.name, moved=len(moves))
            return len(moves)

    def compact(self, device, nbytes):
        """Make room for nbytes on device by sliding its regions down, when its free bytes would
        hold them but no free block does; True if they fit in one block afterwards.

        A policy's step to place a new array (not a program's ``defrag``: no such event);
        observers see each move through ``on_compact``, a copy within the device. Pinned objects
        stay put, so the room may still be split.
        """
        with self._lock:
            self._check_open()
            self._drain()
            dev = self._device(device)
            heap = dev.heap
            if heap is None or heap.can_alloc(nbytes):
                return heap is not None
            if heap.stats().free < heap.block_size(nbytes):
                return False
            moves = self._slide(dev, "on_compact")
            self.telemetry.count("compaction", sum(r.nbytes for r, _ in moves), device=dev.name,
                                 moved=len(moves))
            return heap.can_alloc(nbytes)

    def _slide(self, dev, hook):
        """Slide the unpinned regions of dev (which has a heap) down; each move reported to
        observers' hook. Returns the moves as (region, old offset)."""
        if self._ended:                       # what threads that ended left pinned may move
            self._release_ended()
        if self._copier is not None:          # nothing slides under a running copy
            self._copier.drain()
            self._reading = []
            if self._unpoisoned:
                self._debug_poison_read()
        table = self._by_offset[dev.name]
        moves = []

        def move(owner, old, new):
            obj = self.object(owner)
            if obj is not None and obj._pins:
                return False
            r = table.pop(old)
            r.offset = new
            table[new] = r
            moves.append((r, old))
            return True

        dev.heap.defrag(move)
        for r, old in moves:
            for o in self._observers:
                getattr(o, hook)(r, old)
        if self._debug is not None and moves:
            self._debug.after_defrag(dev, moves, list(dev.heap.blocks()))
        return moves

    def regions_on(self, device):
        """Every live region on device in address order (for policies and checks)."""
        with self._lock:
            table = self._by_offset[self._device(device).name]
            return [table[k] for k in sorted(table)]

    # ---- data access -----------------------------------------------------------------------

    def ndarray(self, region, dtype, shape, strides=None, offset=0, readonly=False):
        """An ndarray over region's current bytes, offset bytes into its data. Valid only while
        the object is pinned.

        A read-only one is built on the device's read-only buffer, so NumPy refuses to make it
        writable (writes there would bypass the dirty bit and be lost at eviction). Every use of
        a CachedArray comes through here: keep it lean.
        """
        try:
            mine = region.device._owner is self._ref
        except AttributeError:
            mine = False
        if not mine:
            self._region(region)
        buf = region._buffer
        if buf is None:                           # a freed region, or one of zero bytes
            if region.freed:
                raise UseAfterFreeError(f"{region!r} was freed")
            if region.nbytes and region.device.virtual:
                raise DeviceError(
                    f"object {region.owner} ({format_size(region.nbytes)}) is on virtual device "
                    f"{region.device.name!r}, which holds no data (a device of a replay or of a "
                    "Manager(..., virtual=True), which only counts placement and traffic): its "
                    "array cannot be read or written; make arrays you read on a Manager without "
                    "virtual=True")
            # Nothing to read or write; a read-only one sits on an immutable (empty) buffer.
            return np.ndarray(shape, dtype, b"" if readonly else None)
        if readonly:
            buf = region.device.readonly_buffer
        return np.ndarray(shape, dtype, buf, region.offset + HEADER + offset, strides)

    # ---- checks and reports ----------------------------------------------------------------

    def check(self):
        """Verify heap invariants and that the manager's records match the heaps."""
        with self._lock:
            self._check_open()
            self._drain()
            for name, dev in self.devices.items():
                if dev.heap is None:
                    continue
                dev.heap.check()
                table = self._by_offset[name]
                live = {b.offset: b for b in dev.heap.blocks() if not b.free}
                if set(live) != set(table):
                    raise CachedArraysError(
                        f"device {name!r}: heap blocks {sorted(set(live) - set(table))} are "
                        f"unknown to the manager and {sorted(set(table) - set(live))} are lost")
                for off, r in table.items():
                    if live[off].owner != r.owner:
                        raise CachedArraysError(f"{r!r}: heap says owner {live[off].owner}")
            for obj in self._live_objects():
                if obj.primary is not None and obj.regions.get(obj.primary.device.name) is not \
                        obj.primary:
                    raise CachedArraysError(f"object {obj.id}: primary is not among its regions")
                for r in obj.regions.values():
                    if r.freed or r.owner != obj.id:
                        raise CachedArraysError(f"object {obj.id}: holds stale {r!r}")
            if self._debug is not None:
                self._debug_check()
            return True

    def _debug_check(self):
        if self._unpoisoned:
            self._debug_poison_read()
        earlier, found = self._debug.verify(self.devices.values())
        for w in found:                           # those found at reuse were counted there
            self.telemetry.count("debug_stale_writes", w.changed, id=w.owner, device=w.device)
        if earlier or found:
            raise CachedArraysError(
                "debug mode found writes into memory that no longer belongs to its object: "
                + "; ".join(str(w) for w in earlier + found) + ". A view was kept past its "
                "scope: an ndarray from ca.readable, ca.writable or ca.access is valid inside "
                "the with-block only; take a new one (or index the CachedArray) afterwards")

    def stats(self):
        """Telemetry as a dict: bytes and copies per direction, events, per-device use."""
        with self._lock:
            if not self.closed:
                self._drain()
            devs = {n: d.stats() for n, d in self.devices.items()}
            snap = self.telemetry.snapshot(devs)
            snap["objects"] = len(self._live_objects())
            return snap

    def reset_stats(self):
        with self._lock:
            self.telemetry.reset()

    def count(self, name, nbytes=0, **fields):
        """Record a named event in telemetry (used by policies and the array layer)."""
        nbytes = check_event(name, nbytes, fields)
        with self._lock:
            self.telemetry.count(name, nbytes, **fields)

    def __repr__(self):
        with self._lock:                          # the heaps may not be closed meanwhile
            if self.closed:
                return "<Manager closed>"
            parts = []
            for n, d in self.devices.items():
                s = d.stats()
                parts.append(f"{n}: {format_size(s['used'])}/{format_size(d.size)}")
        return f"<Manager {', '.join(parts)}, policy={type(self.policy).__name__}>"
