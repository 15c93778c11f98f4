"""Traces: what a program asked of the manager, with stable object ids and kernel times.

``with ca.trace(m) as t:`` records, in order: allocations (``alloc``), frees, kernels (their
read and write sets, begin and end, exclusive wall time), the annotations (``prefetch``,
``evict``, ``softevict``) and ``layer``/``step`` marks. Every acquire of arrays is a kernel:
``ca.kernel(name, reads, writes)`` names it, an access scope or a NumPy call gets a generic
name. Alongside, the trace keeps the *decision log* of the policy that ran (regions placed and
released, copies, the operand placement of each kernel), the input of ``cachedarrays.costmodel``.

Object ids (``sid``) are stable across steps: the allocation site (the first frame outside the
library's core) and the ordinal of the object among those made at that site since the last step
mark; objects made before the first mark are ``init:`` ones. A trace is saved to and loaded from
one gzip-compressed JSON file.
"""

import errno
import gzip
import io
import json
import os
import math
import numbers
import secrets
import stat
import statistics
import sys
import threading
import time
import weakref
import zlib
from collections import defaultdict
from dataclasses import asdict

from . import threadkeys
from .costmodel import Profile
from .errors import CachedArraysError
from .heap import HEADER
from .manager import Observer

__all__ = ["Trace", "trace", "StableIds", "KernelClock", "Recorder", "TraceError"]

_FORMAT = "cachedarrays-trace"
_VERSION = 1
_perf = time.perf_counter


class TraceError(CachedArraysError, ValueError):
    """A malformed trace, or one that does not fit the operation asked of it."""


# ---- stable ids --------------------------------------------------------------------------

def _core_module(name):
    """True for the library's own modules (not the bundled models: their sites are sites)."""
    return name == "cachedarrays" or (name.startswith("cachedarrays.") and
                                      not name.startswith("cachedarrays.models"))


_SITE_NAMES = {}            # code object -> its file's base name, or "" for the library's own
_SITE_NAMES_MAX = 1 << 14   # code objects remembered (exec'd code may make new ones forever)


def _site():
    """``file:line`` of the nearest caller outside the library (every new object asks)."""
    f = sys._getframe(2)
    names = _SITE_NAMES
    while f is not None:
        code = f.f_code
        name = names.get(code)
        if name is None:
            name = "" if _core_module(f.f_globals.get("__name__", "")) else \
                os.path.basename(code.co_filename)
            if len(names) >= _SITE_NAMES_MAX:
                names.clear()
            names[code] = name
        if name:
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    return "?"


DEFAULT_GRANULARITY = 256              # the heap's granularity when given 0 (native/heap.c)

_SHARED = weakref.WeakKeyDictionary()  # manager -> {class: its shared observer, attached or not}


class _Shared(Observer):
    """An observer of which a manager has one, shared by its recorders and policies.

    ``of(m)`` attaches it for good (a policy holds it while bound); ``use(m)`` attaches it until
    the matching ``done(m)`` (a recording): when no user is left it detaches, and the manager's
    calls take their fast paths again. A detached one keeps its state for the next user.
    """

    _users = 0          # recordings using it now
    _kept = False       # attached for good (``of``)
    _manager = None

    @classmethod
    def of(cls, manager):
        """The manager's instance, attached from now on."""
        with manager.atomic():
            made = cls._attach(manager)
            made._kept = True
        return made

    @classmethod
    def use(cls, manager):
        """The manager's instance, attached until the matching ``done``."""
        with manager.atomic():
            made = cls._attach(manager)
            made._users += 1
        return made

    def done(self, manager):
        """One user less; detached from manager when none is left and ``of`` never kept it."""
        with manager.atomic():
            self._users = max(0, self._users - 1)
            if not self._users and not self._kept:
                manager.unobserve(self)

    @classmethod
    def _attach(cls, manager):
        """The manager's instance, put first in its observers if it is not there (first: the
        others read its ids and times)."""
        manager = manager._ref()                  # the manager itself, not a policy's proxy
        for o in manager._observers:
            if isinstance(o, cls):
                return o
        mine = _SHARED.setdefault(manager, {})
        made = mine.get(cls)
        if made is None:
            made = mine[cls] = cls()
        else:
            made._resume(manager)
        made._manager = weakref.ref(manager)
        manager._observers = (made,) + manager._observers
        return made

    def _resume(self, manager):
        """Forget what went stale while detached (it saw none of the manager's calls)."""


class StableIds(_Shared):
    """Gives every new object of a manager a stable id: site#ordinal within the step.

    One per manager (``StableIds.of(m)``, or ``use``/``done`` while a trace records), shared by
    traces and plans. A replay forces the ids it knows with ``force_next``.
    """

    def __init__(self):
        self.sid = {}                 # object id -> stable id
        self.obj_id = {}              # stable id -> object id (live objects)
        self._live = set()            # stable ids of live objects
        self._ordinal = defaultdict(int)
        self._forced = None
        self.steps = 0
        self._anon = 0

    def _resume(self, manager):
        # Objects freed while detached lose their ids; the ordinals count afresh.
        for oid in [o for o in self.sid if manager.object(o) is None]:
            self.on_free(oid)
        self._ordinal.clear()
        self._forced = None

    def force_next(self, sid):
        """The next new object gets this id (replays)."""
        self._forced = sid

    def on_object(self, obj):
        sid, self._forced = self._forced, None
        if sid is None:
            site = _site()
            if not self.steps:
                site = "init:" + site
            n = self._ordinal[site]
            self._ordinal[site] = n + 1
            sid = f"{site}#{n}"
            if sid in self._live:             # an object of an earlier step is still alive
                sid = f"{sid}@{self.steps}"
        self.sid[obj.id] = sid
        self.obj_id[sid] = obj.id
        self._live.add(sid)

    def get(self, obj_id):
        """The stable id of a live object (objects made outside new_pinned get an anon: id)."""
        sid = self.sid.get(obj_id)
        if sid is None:
            self._anon += 1
            sid = self.sid[obj_id] = f"anon:#{self._anon}"
            self.obj_id[sid] = obj_id
            self._live.add(sid)
        return sid

    def on_free(self, obj_id):
        sid = self.sid.pop(obj_id, None)
        if sid is not None:
            self._live.discard(sid)
            self.obj_id.pop(sid, None)

    def on_mark(self, kind):
        if kind == "step":
            self.steps += 1
            self._ordinal.clear()


class KernelClock(_Shared):
    """Kernel times of a manager: the exclusive seconds of each kernel, measured once.

    One per manager (``KernelClock.of(m)``, or ``use``/``done``), shared by every recorder
    (traces, the profiles of planning policies), so they all see the same figure. A replay
    forces each kernel's recorded time with ``force_next``: what a policy measures in a replay
    is what the trace measured. ``model``, when set to a function ``(name, reads, writes) ->
    seconds``, gives every kernel not otherwise forced its time in place of the wall clock:
    profiles of a live run that do not move with the machine's load.
    """

    _model = None

    @property
    def model(self):
        return self._model

    @model.setter
    def model(self, fn):
        if fn is not None and not callable(fn):
            raise TypeError(f"KernelClock.model must be None or a function (name, reads, "
                            f"writes) -> seconds, not {type(fn).__name__}")
        self._model = fn

    def _modelled(self, name, reads, writes):
        v = self._model(name, reads, writes)
        try:
            seconds = float(v)
        except (TypeError, ValueError):
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"KernelClock.model gave {v!r} seconds for kernel {name!r}; it "
                             f"must return a finite number of seconds >= 0")
        return seconds

    def __init__(self):
        self._stacks = defaultdict(list)   # thread key (threadkeys) -> [[key, start, nested, forced]]
        self._forced = None
        self._last = {}                    # thread key -> seconds of its last ended kernel

    def _resume(self, manager):
        # Kernels that began or ended while detached are not on its stacks.
        self._stacks.clear()
        self._forced = None

    def force_next(self, seconds):
        """The next kernel takes this many seconds, whatever the wall clock says (replays)."""
        self._forced = float(seconds)

    def last(self):
        """Exclusive seconds of the kernel that just ended in this thread."""
        return self._last.get(threadkeys.current(), 0.0)

    def on_acquire(self, name, reads, writes, touched=None):
        m = self._manager() if self._manager is not None else None
        if m is not None and m.recomputing:   # a rerun (regenerate): a replay's recipe carries
            e = m.recompute_entry             # the recorded time; the forced one is the next
            forced = e.seconds if e is not None else None       # kernel's, so it stays
        else:
            forced, self._forced = self._forced, None
            if forced is None and self._model is not None:
                forced = self._modelled(name, reads, writes)
        self._stacks[threadkeys.current()].append(
            [sorted(o.id for o in (*reads, *writes)), _perf(), 0.0, forced])

    def on_release(self, objs):
        tid = threadkeys.current()
        stack = self._stacks.get(tid)
        if not stack or stack[-1][0] != sorted(o.id for o in objs):
            return
        _, start, nested, forced = stack.pop()
        spent = _perf() - start
        self._last[tid] = forced if forced is not None else max(0.0, spent - nested)
        if stack:
            stack[-1][2] += spent


# ---- the trace ---------------------------------------------------------------------------

# event kind -> (fewest, most) fields, the kind included
_EVENT_FIELDS = {"alloc": (4, 6), "free": (2, 2), "kernel": (2, 2), "end": (2, 2),
                 "prefetch": (4, 4), "evict": (4, 4), "softevict": (2, 2), "drop": (2, 2),
                 "regenerate": (2, 2), "layer": (1, 1), "step": (1, 1), "defrag": (2, 2)}
_SID_EVENTS = ("alloc", "free", "prefetch", "evict", "softevict", "drop", "regenerate")


def _whole(n):
    """A byte count: a whole number >= 0 (not a bool)."""
    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 0


def _short(v, n=40):
    """repr(v), cut to n characters (a number of 400 digits in an error message)."""
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def _seconds(t):
    """A kernel time: a finite number of seconds >= 0 (not a bool)."""
    if isinstance(t, bool) or not isinstance(t, numbers.Real):
        return False
    try:
        t = float(t)
    except OverflowError:
        return False
    return math.isfinite(t) and t >= 0


class Trace:
    """A recorded program: objects, events, kernels, kernel times and a decision log.

    ``objects``: sid -> bytes; ``events``: tuples (``("alloc", sid, nbytes, placement)``,
    ``("free", sid)``, ``("kernel", k)``, ``("end", k)``, ``("prefetch", sid, force, wait)``,
    ``("evict", sid, to, wait)``, ``("softevict", sid)``, ``("layer",)``, ``("step",)``,
    ``("defrag", device)``); an alloc made inside a kernel that kept the new object pinned
    until the kernel's end (a ufunc's output) ends with True: ``("alloc", sid, nbytes,
    placement, True)``; one made before a kernel and held until that kernel's end (a copy's
    output) ends with "next". When kernels of several threads interleave, a sixth field says
    which kernel: after True, how many kernels opened after the object's own are still open;
    after "next", how many kernels of other threads open between the object and its own.
    ``kernels``: (name, read sids, write sids) per kernel index;
    ``times``: seconds per kernel; ``decisions``: the decision log of the run (see
    ``cachedarrays.costmodel``); ``devices``: the tier names of that run, fastest first;
    ``touched``: kernel index -> {sid: bytes} for kernels that touch only part of an object;
    ``pure``: the indices of the kernels made by ``ca.compute`` (recomputable: a replay gives
    its objects their lineage, and a rerun appears in the decision log as another
    ``("kernel", k, ops)`` of the original index k, never as an event); ``partial``: pure
    kernel index -> the write sids it wrote through a view of part of the object (the rest
    keeps its contents, as for an in-place kernel). ``("drop", sid)`` and
    ``("regenerate", sid)`` events are the program's ``ca.drop``/``ca.regenerate`` calls.
    """

    def __init__(self, objects=None, events=None, kernels=None, times=None, meta=None,
                 decisions=None, devices=None, touched=None, pure=None, partial=None):
        self.objects = dict(objects or {})
        self.events = list(events or [])
        self.kernels = list(kernels or [])
        self.times = list(times or [])
        self.meta = dict(meta or {})
        self.decisions = list(decisions or [])
        self.devices = list(devices or [])
        self.touched = {int(k): dict(v) for k, v in dict(touched or {}).items()}
        self.pure = {int(k) for k in pure or ()}
        self.partial = {int(k): list(v) for k, v in dict(partial or {}).items()}

    # -- facts ----------------------------------------------------------------------------

    @property
    def steps(self):
        """Number of step marks."""
        return sum(1 for e in self.events if e[0] == "step")

    def footprint(self, granularity=None):
        """Peak bytes of live objects (what fast memory needs to hold everything).

        granularity: count each object as the heap block that holds it (its 64-byte header
        and rounding to granularity, 0 for the heap's default) instead of its data."""
        if granularity is not None and not _whole(granularity):
            raise ValueError(f"granularity={granularity!r}: give the heap's granularity in "
                             "bytes (a power of two >= 64, or 0 for the default)")
        g = None if granularity is None else (granularity or DEFAULT_GRANULARITY)
        live, cur, peak = {}, 0, 0
        for e in self.events:
            if e[0] == "alloc":
                n = int(e[2])       # a NumPy unsigned size would wrap when subtracted
                n = n if g is None or not n else -(-(n + HEADER) // g) * g
                cur += n - live.get(e[1], 0)
                live[e[1]] = n
                peak = max(peak, cur)
            elif e[0] == "free":
                cur -= live.pop(e[1], 0)
        return peak

    def step_kernels(self):
        """Kernel indices of each step (the last group: kernels after the last mark, if any)."""
        out, cur = [], []
        for e in self.events:
            if e[0] == "kernel":
                cur.append(e[1])
            elif e[0] == "step":
                out.append(cur)
                cur = []
        if cur:
            out.append(cur)
        return out

    def compute(self, step=-1):
        """Sum of kernel times in one step (the fast-only time of that step)."""
        groups = self.step_kernels()
        return sum(self.times[k] for k in groups[step]) if groups else 0.0

    def validate(self):
        """Raise TraceError if the events do not make a well-formed program (or the tables
        beside them have entries of the wrong kind: sizes are whole bytes >= 0, kernel times
        finite seconds >= 0)."""
        self._validate_tables()
        live = set()
        open_ = {}      # kernel index -> its operands (kernels of several threads interleave)
        for i, e in enumerate(self.events):
            kind = e[0] if isinstance(e, (tuple, list)) and e else None
            where = f"event {i} {e!r}"
            if not isinstance(kind, str) or kind not in _EVENT_FIELDS:
                raise TraceError(f"{where}: unknown event; the kinds are {sorted(_EVENT_FIELDS)}")
            lo, hi = _EVENT_FIELDS[kind]
            if not lo <= len(e) <= hi:
                want = f"{lo} field" + ("" if hi == 1 else "s") if lo == hi else \
                    f"{lo} to {hi} fields"
                raise TraceError(f"{where}: malformed event: {kind!r} events have {want}, "
                                 f"not {len(e)}")
            if kind in _SID_EVENTS and not isinstance(e[1], str):
                raise TraceError(f"{where}: malformed event: object ids are strings, not "
                                 f"{type(e[1]).__name__}")
            if kind == "alloc":
                if not _whole(e[2]):
                    raise TraceError(f"{where}: size {e[2]!r} is not a whole number of bytes >= 0")
                if e[3] not in (None, "fast", "slow"):
                    raise TraceError(f"{where}: placement {e[3]!r} is not None, 'fast' or 'slow'")
                if len(e) > 4 and not (isinstance(e[4], bool) or e[4] == "next"):
                    raise TraceError(f"{where}: the fifth field is True (pinned until its "
                                     f"kernel ends) or 'next', not {e[4]!r}")
                if len(e) > 5 and not (type(e[5]) is int and (
                        0 <= e[5] < len(open_) if e[4] is True else e[4] == "next" and e[5] >= 0)):
                    raise TraceError(f"{where}: the sixth field counts the kernels of other "
                                     f"threads opened after the object's own (with True: still "
                                     f"open, {len(open_)} are) or before it (with 'next')")
                if e[1] in live:
                    raise TraceError(f"{where}: {e[1]!r} is allocated twice")
                live.add(e[1])
            elif kind == "free":
                if e[1] not in live:
                    raise TraceError(f"{where}: frees an object that is not live")
                for k, ops in open_.items():
                    if e[1] in ops:
                        raise TraceError(f"{where}: frees an object in use by kernel {k} "
                                         f"({self.kernels[k][0]!r}), which has not ended")
                live.discard(e[1])
            elif kind == "kernel":
                k = e[1]
                if type(k) is not int or not 0 <= k < len(self.kernels):
                    raise TraceError(f"{where}: no kernel {k!r} in the kernel table")
                if k in open_:
                    raise TraceError(f"{where}: kernel {k} begins twice")
                for sid in (*self.kernels[k][1], *self.kernels[k][2]):
                    if sid not in live:
                        raise TraceError(f"{where}: kernel {self.kernels[k][0]!r} uses {sid!r}, "
                                         "which is not live")
                open_[k] = {*self.kernels[k][1], *self.kernels[k][2]}
            elif kind == "end":
                if type(e[1]) is not int or open_.pop(e[1], None) is None:
                    raise TraceError(f"{where}: ends a kernel that is not open")
            elif kind in ("prefetch", "evict", "softevict", "drop", "regenerate"):
                if e[1] not in live:
                    raise TraceError(f"{where}: {kind} of an object that is not live")
                if kind == "prefetch" and not all(isinstance(x, bool) for x in e[2:]):
                    raise TraceError(f"{where}: a prefetch's force and wait are True or False")
                if kind == "evict" and not ((e[2] is None or isinstance(e[2], str)) and
                                            isinstance(e[3], bool)):
                    raise TraceError(f"{where}: an evict's destination is None or a device "
                                     "name and its wait True or False")
            elif kind == "defrag" and not isinstance(e[1], str):
                raise TraceError(f"{where}: a defrag names its device (a string)")
        return True

    def _validate_tables(self):
        """The tables beside the events: kernels, times, objects, touched, pure, partial."""
        for what, want, kinds in (("events", "a list of event tuples", (list, tuple)),
                                  ("kernels", "a list of (name, reads, writes)", (list, tuple)),
                                  ("times", "a list of seconds", (list, tuple)),
                                  ("devices", "a list of tier names", (list, tuple)),
                                  ("objects", "a dict of id -> bytes", dict),
                                  ("decisions", "a list of decision records", (list, tuple)),
                                  ("meta", "a dict", dict),
                                  ("touched", "a dict of kernel -> {id: bytes}", dict),
                                  ("pure", "a set of kernel indices",
                                   (set, frozenset, list, tuple)),
                                  ("partial", "a dict of kernel -> write ids", dict)):
            v = getattr(self, what)
            if not isinstance(v, kinds):
                raise TraceError(f"Trace.{what} is {type(v).__name__}; it must be {want}")
        ints = [k for k in (*self.touched, *self.pure, *self.partial) if type(k) is not int]
        if ints:
            raise TraceError(f"kernel index {ints[0]!r} in touched, pure or partial: kernel "
                             "indices are ints")
        for k, v in self.touched.items():
            if not isinstance(v, dict):
                raise TraceError(f"touched bytes of kernel {k} are {type(v).__name__}; give a "
                                 "dict of id -> bytes")
        for k, v in self.partial.items():
            if not (isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v)):
                raise TraceError(f"partial writes of kernel {k} are {v!r}; give a list of "
                                 "write ids (strings)")
        nk = len(self.kernels)
        for k, row in enumerate(self.kernels):
            if not (isinstance(row, (tuple, list)) and len(row) == 3 and
                    isinstance(row[0], str) and
                    all(isinstance(x, (tuple, list)) and all(isinstance(s, str) for s in x)
                        for x in row[1:3])):
                raise TraceError(f"kernel {k} {row!r}: a kernel is (name, read ids, write "
                                 "ids), its name and ids strings")
        if len(self.times) != nk:
            raise TraceError(f"{nk} kernels but {len(self.times)} kernel times")
        for k, t in enumerate(self.times):
            if not _seconds(t):
                raise TraceError(f"kernel {k} ({self.kernels[k][0]!r}): time {_short(t)} is not a "
                                 "finite number of seconds >= 0")
        for sid, n in self.objects.items():
            if not (isinstance(sid, str) and _whole(n)):
                raise TraceError(f"object {sid!r}: {n!r} is not a whole number of bytes >= 0 "
                                 "(objects map string ids to sizes)")
        if not all(isinstance(d, str) for d in self.devices) or \
                len(set(self.devices)) != len(self.devices):
            raise TraceError(f"devices {self.devices!r}: give distinct tier names, fastest first")
        for k, part in self.touched.items():
            ops = {*self.kernels[k][1], *self.kernels[k][2]} if 0 <= k < nk else None
            for sid, n in part.items():
                if ops is None or sid not in ops or not _whole(n):
                    raise TraceError(f"touched bytes {sid!r}: {n!r} of kernel {k}: give whole "
                                     "bytes >= 0 of an operand of a kernel in the kernel table")
        bad = sorted(k for k in self.pure if not 0 <= k < nk)
        if bad:
            raise TraceError(f"pure kernels {bad[:5]} are not in the kernel table of "
                             f"{nk} kernels")
        for k, sids in self.partial.items():
            writes = set(self.kernels[k][2]) if 0 <= k < nk else ()
            if not all(s in writes for s in sids):
                raise TraceError(f"partial writes {sids!r} of kernel {k}: give write ids of a "
                                 "kernel in the kernel table")

    # -- kernel times ---------------------------------------------------------------------

    def median_times(self, skip=1):
        """Each kernel's time replaced by the median, over the steps after the first skip ones,
        of the kernel at the same position (steps whose kernel names match the last step's).

        The first steps warm caches and compile kernels, so they are left out when there are
        enough steps. Returns a new Trace.
        """
        if isinstance(skip, bool) or not isinstance(skip, numbers.Integral) or skip < 0:
            raise ValueError(f"median_times: skip={skip!r} must be a whole number of steps >= 0 "
                             "(the first steps left out, e.g. skip=1)")
        skip = int(skip)
        groups = self.step_kernels()
        if not groups:
            return self.copy()
        names = [self.kernels[k][0] for k in groups[-1]]
        same = [g for g in groups if [self.kernels[k][0] for k in g] == names]
        use = same[skip:] if len(same) > skip else same
        med = [statistics.median(self.times[g[i]] for g in use) for i in range(len(names))]
        times = list(self.times)
        for g in same:
            for i, k in enumerate(g):
                times[k] = med[i]
        t = self.copy()
        t.times = times
        t.meta["times"] = f"median of {len(use)} steps"
        return t

    def with_times(self, other):
        """A copy with kernel times taken from another trace of the same program (typically a
        fast-only run), matched by position; TraceError if their kernel names differ."""
        if not isinstance(other, Trace):
            raise TypeError(f"Trace.with_times takes another Trace (of the same program), not "
                            f"{type(other).__name__}")
        a = [k[0] for k in self.kernels]
        b = [k[0] for k in other.kernels]
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise TraceError(f"the traces differ at kernel {i} ({a[i] if i < len(a) else 'end'}"
                             f" vs {b[i] if i < len(b) else 'end'}): record both from the same "
                             "program with the same number of steps")
        t = self.copy()
        t.times = list(other.times)
        t.meta["times"] = other.meta.get("times", "from another trace")
        return t

    def copy(self):
        return Trace(self.objects, self.events, self.kernels, self.times, self.meta,
                     self.decisions, self.devices, self.touched, self.pure, self.partial)

    # -- files ----------------------------------------------------------------------------

    def save(self, path):
        """Write the trace to one gzip-compressed JSON file (atomically: a temporary file is
        renamed over path, which must be a regular file, a symlink or not exist yet).

        The trace is validated first: one that ``load`` would refuse is never written, so it
        cannot replace a good file."""
        path = _path(path, "Trace.save")
        try:
            self.validate()
        except TraceError as e:
            raise TraceError(f"Trace.save: {e}; {path} is left as it was") from None
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = None                         # nothing there yet (or the write will say why)
        if mode is not None and stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Trace.save writes a file, and this is a "
                                    "directory: pass the path of a regular file", path)
        if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise TraceError(f"{path}: is {_file_kind(mode)}, and Trace.save replaces the file at "
                             "its path: pass the path of a regular file")
        meta = dict(self.meta)
        if isinstance(meta.get("profiles"), dict):    # a tier's Profile: as its fields
            meta["profiles"] = {d: asdict(p) if isinstance(p, Profile) else p
                                for d, p in meta["profiles"].items()}
        doc = {"format": _FORMAT, "version": _VERSION, "meta": meta,
               "objects": list(self.objects.items()), "events": self.events,
               "kernels": self.kernels, "times": self.times, "decisions": self.decisions,
               "devices": self.devices,
               "touched": [[k, list(v.items())] for k, v in sorted(self.touched.items())],
               "pure": sorted(self.pure),
               "partial": [[k, v] for k, v in sorted(self.partial.items())]}
        tmp = None
        try:
            fd, tmp = _new_beside(path)
            with os.fdopen(fd, "wb") as raw, \
                    gzip.GzipFile(filename="", mode="wb", compresslevel=6, fileobj=raw) as gz, \
                    io.TextIOWrapper(gz, encoding="utf-8") as f:
                json.dump(doc, f, separators=(",", ":"), default=_json_number)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            if e.errno is None:
                raise
            raise type(e)(e.errno, f"Trace.save cannot write {path}: {e.strerror}; check that its "
                          "directory exists, is writable and has room") from None
        except BaseException:
            _unlink(tmp)
            raise
        return path

    @classmethod
    def load(cls, path):
        """Read a trace written by ``save``; TraceError if the file is not one."""
        path = _path(path, "Trace.load")
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                doc = json.load(f)
        except RecursionError:
            raise TraceError(f"{path}: not a trace file (its JSON nests too deeply); write "
                             "traces with Trace.save") from None
        except (OSError, EOFError, zlib.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TraceError(f"{path}: not a trace file ({e}); write traces with Trace.save") \
                from None
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise TraceError(f"{path}: not a trace file (no {_FORMAT!r} header)")
        if type(doc.get("version")) is int and doc["version"] > _VERSION:
            raise TraceError(f"{path}: trace format version {doc['version']} is newer than this "
                             f"cachedarrays reads (version {_VERSION}): upgrade cachedarrays to "
                             "read it, or record the trace again with this version")
        if type(doc.get("version")) is not int or doc["version"] != _VERSION:
            raise TraceError(f"{path}: trace format version {doc.get('version')}, this library "
                             f"reads version {_VERSION}; record the trace again")
        odd = [k for k in ("objects", "events", "kernels", "times", "decisions", "devices",
                           "touched", "pure", "partial") if not isinstance(doc.get(k, []), list)]
        if odd or not isinstance(doc.get("meta") or {}, dict):
            raise TraceError(f"{path}: malformed trace (the {(odd or ['meta'])[0]!r} section is "
                             "not what Trace.save writes); record the trace again")
        try:
            t = cls({s: n for s, n in doc["objects"]}, [tuple(e) for e in doc["events"]],
                    [(n, tuple(r), tuple(w)) for n, r, w in doc["kernels"]], doc["times"],
                    doc.get("meta"), [_decision(d) for d in doc.get("decisions", ())],
                    doc.get("devices"),
                    {k: {s: n for s, n in v} for k, v in doc.get("touched", ())},
                    doc.get("pure", ()), {k: v for k, v in doc.get("partial", ())})
            profiles = t.meta.get("profiles")
            if isinstance(profiles, dict):
                t.meta["profiles"] = {d: Profile(**p) if isinstance(p, dict) else p
                                      for d, p in profiles.items()}
            t.validate()
        except TraceError as e:
            raise TraceError(f"{path}: malformed trace: {e}") from None
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError,
                RecursionError) as e:
            what = f"no {e.args[0]!r} section" if isinstance(e, KeyError) else e
            raise TraceError(f"{path}: malformed trace ({what}); the file was not written by "
                             "Trace.save or was altered: record the trace again") from None
        return t

    def __repr__(self):
        return (f"<Trace {len(self.objects)} objects, {len(self.kernels)} kernels, "
                f"{self.steps} steps, {len(self.decisions)} decisions>")


def _path(path, who):
    """A str path from a str, bytes or os.PathLike one."""
    try:
        return os.fsdecode(path)
    except TypeError:
        raise TypeError(f"{who} takes a file path (str, bytes or os.PathLike), not "
                        f"{type(path).__name__}") from None


def _unlink(path):
    """Remove path if it is there (a temporary file of a save that failed)."""
    if path is None:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _new_beside(path):
    """A new file beside path for a save to write and rename: (fd, name). Its name is random and
    short (path's own name may be the longest the file system takes), and it is made
    exclusively: a link or file someone left at a name a save would use is never followed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    for _ in range(16):
        tmp = os.path.join(os.path.dirname(path), f".trace-{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name beside it", path)


def _json_number(v):
    """A NumPy (or other numbers-registered) scalar as the Python number JSON writes; anything
    else a trace file cannot hold is a TypeError naming it."""
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    raise TypeError(f"Trace.save: a trace holds a {type(v).__name__} ({_short(v)}), which a "
                    "trace file cannot store; keep to str, int, float, bool, None, lists and "
                    "dicts (in meta too)")


def _file_kind(mode):
    """What a file that is not regular is, for an error message."""
    for test, name in ((stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _decision(d):
    if d[0] == "kernel":
        return ("kernel", d[1], tuple(tuple(op) for op in d[2]))
    return tuple(d)


# ---- recording ---------------------------------------------------------------------------

class Recorder(Observer):
    """Records a manager's events into a Trace (the observer behind ``ca.trace``).

    events=False records the decision log only (replays write the events themselves). It uses
    the manager's ``StableIds`` and ``KernelClock`` until ``close``.
    """

    def __init__(self, manager, events=True):
        self.m = manager
        self.ids = StableIds.use(manager)
        self.clock = KernelClock.use(manager)
        self._closed = False
        self.record_events = events
        self.trace = Trace(devices=[d.name for d in manager.tiers],
                           meta={"profiles": {d.name: d.profile for d in manager.tiers}})
        if manager.fast.granularity:            # a replay's heaps round as this run's did
            self.trace.meta["granularity"] = manager.fast.granularity
        # thread key (threadkeys) -> [[k, key, {new object id: its alloc event}]]
        self._stacks = defaultdict(list)
        # thread key -> {new object id: (its alloc event, kernels recorded before it)}
        self._loose = defaultdict(dict)
        self._lock = threading.Lock()
        self._traffic = getattr(getattr(manager, "policy", None), "kernel_traffic", None)
        self._ref = weakref.ref(self)           # what recipes keep of this recorder

    def close(self):
        """Stop recording: unobserve the manager, and let go of its stable ids and kernel clock
        (detached when nothing else uses them). Idempotent."""
        m = self.m
        with m.atomic():
            if self._closed:
                return
            self._closed = True
            m.unobserve(self)
            self.clock.done(m)
            self.ids.done(m)

    def _sid(self, obj):
        return self.ids.get(obj.id)

    def on_new(self, obj, placement):
        if self.record_events:
            sid = self._sid(obj)
            self.trace.objects[sid] = obj.nbytes
            self.trace.events.append(("alloc", sid, obj.nbytes, placement))
            tid = threadkeys.current()
            stack = self._stacks.get(tid)
            if stack:                           # made inside a kernel: see on_release
                stack[-1][2][obj.id] = (len(self.trace.events) - 1, self._later(stack[-1][0]))
            else:                               # it may stay pinned through the next kernel
                self._loose[tid][obj.id] = (len(self.trace.events) - 1, len(self.trace.kernels))

    def on_free(self, obj_id):
        sid = self.ids.sid.get(obj_id)
        if sid is not None and self.record_events:
            self.trace.events.append(("free", sid))

    def on_acquire(self, name, reads, writes, touched=None):
        t = self.trace
        m = self.m
        if m.recomputing:                       # a rerun of a recorded kernel (regenerate)
            self._rerun(m.recompute_entry, reads, writes, touched)
            return
        sid = self._sid
        k = len(t.kernels)
        t.kernels.append((name, tuple(sid(o) for o in reads), tuple(sid(o) for o in writes)))
        t.times.append(0.0)
        if self.record_events:
            t.events.append(("kernel", k))
        recipe = m.recipe
        if recipe is not None:                  # a ca.compute kernel: recomputable
            t.pure.add(k)
            recipe.traced += ((self._ref, k),)
            if recipe.partial:
                t.partial[k] = list(dict.fromkeys(sid(o) for o in writes
                                                  if o.id in recipe.partial))
        if touched:
            t.touched[k] = {sid(o): touched[o.id] for o in (*reads, *writes) if o.id in touched}
        t.decisions.append(("kernel", k, self._ops(name, reads, writes, touched)))
        if self._traffic is not None:
            extra = self._traffic(k, reads, writes)
            if extra is not None:
                t.decisions.append(extra)
        key = sorted(o.id for o in (*reads, *writes))
        tid = threadkeys.current()
        loose = self._loose.get(tid)
        carried = {}
        if loose:                               # new arrays not released yet (a copy's output)
            carried, self._loose[tid] = loose, {}
        self._stacks[tid].append([k, key, {}, carried, False])

    def _rerun(self, recipe, reads, writes, touched):
        """A kernel rerun to regenerate an array: its original kernel index again in the
        decision log (the cost model charges its time again); no event, no new kernel."""
        k = recipe.kernel_of(self) if recipe is not None else None
        t = self.trace
        if k is not None:
            t.decisions.append(("kernel", k, self._ops(recipe.name, reads, writes, touched)))
            if self._traffic is not None:
                extra = self._traffic(k, reads, writes)
                if extra is not None:
                    t.decisions.append(extra)
        else:                                   # its original ran before this recording
            t.meta["untraced_reruns"] = t.meta.get("untraced_reruns", 0) + 1
        self._stacks[threadkeys.current()].append(
            [k, sorted(o.id for o in (*reads, *writes)), {}, {}, True])

    def _ops(self, name, reads, writes, touched):
        """The operands of a kernel as the decision log records them: (sid, bytes, device,
        is_write)."""
        sid = self._sid
        if name == "view":                      # reshape and the like: no data is touched
            ops = tuple((sid(o), 0, o.primary.device.name, False) for o in reads)
        elif touched:
            ops = tuple((sid(o), touched.get(o.id, o.nbytes), o.primary.device.name, False)
                        for o in reads) + \
                tuple((sid(o), touched.get(o.id, o.nbytes), o.primary.device.name, True)
                      for o in writes)
        else:
            ops = tuple((sid(o), o.nbytes, o.primary.device.name, False) for o in reads) + \
                tuple((sid(o), o.nbytes, o.primary.device.name, True) for o in writes)
        return ops

    def on_release(self, objs):
        tid = threadkeys.current()
        loose = self._loose.get(tid)
        if loose:
            for o in objs:
                loose.pop(o.id, None)
        stack = self._stacks.get(tid)
        if not stack:
            return
        top = stack[-1]
        if top[1] != sorted(o.id for o in objs):
            for o in objs:                      # a new array's first release: not a kernel
                top[2].pop(o.id, None)
                top[3].pop(o.id, None)
            return
        stack.pop()
        k, _, made, carried, rerun = top
        if rerun:                               # no time of its own, no end event
            return
        self.trace.times[k] = self.clock.last()
        if self.record_events:
            events = self.trace.events
            for i, later in made.values():      # new arrays still pinned: released after the
                # kernel's operands (a ufunc's output); with the number of kernels of other
                # threads opened after this one and still open, when there are any
                events[i] = (*events[i], True, later) if later else (*events[i], True)
            for i, before in carried.values():  # made before the kernel, held through it;
                skip = k - before               # with the kernels of other threads opened in
                #                                 between, when there are any
                events[i] = (*events[i], "next", skip) if skip else (*events[i], "next")
            events.append(("end", k))

    def _later(self, k):
        """Kernels (of any thread) opened after kernel k and not ended yet."""
        if k is None:
            return 0
        return sum(1 for stack in self._stacks.values() for top in stack
                   if not top[4] and top[0] > k)

    def on_annotation(self, op, obj, args):
        if self.record_events:
            self.trace.events.append((op, self._sid(obj), *args))

    def on_mark(self, kind):
        if self.record_events:
            self.trace.events.append((kind,))
        self.trace.decisions.append((kind,))

    def on_defrag(self, device):
        if self.record_events:
            self.trace.events.append(("defrag", device))

    def on_move(self, region, old_offset):
        # A move within a device (a defragmentation or a policy's compaction): the region leaves
        # its old place and takes the new one, and its bytes are copied there while the
        # program waits (costed like any copy).
        sid, dev = self.ids.get(region.owner), region.device.name
        self.trace.decisions.append(("free", sid, dev, old_offset, region.nbytes))
        self.trace.decisions.append(("alloc", sid, dev, region.offset, region.nbytes))
        self.trace.decisions.append(("copy", sid, dev, old_offset, dev, region.offset,
                                     region.nbytes, True))

    def on_region(self, region, live):
        self.trace.decisions.append(("alloc" if live else "free", self.ids.get(region.owner),
                                     region.device.name, _at(region), region.nbytes))

    def on_copy(self, src, dst, wait):
        self.trace.decisions.append(("copy", self.ids.get(src.owner), src.device.name,
                                     _at(src), dst.device.name, _at(dst), src.nbytes,
                                     bool(wait)))

    def on_cancel(self, obj_id, src, dst):
        self.trace.decisions.append(("cancel", self.ids.get(obj_id), src.device.name,
                                     dst.device.name))

    def on_fault(self, obj):
        self.trace.decisions.append(("fault", self.ids.get(obj.id)))


def _at(region):
    """A region's offset in decisions: 0 for an empty one (it has no heap block)."""
    return region.offset if region.nbytes else 0


class trace:
    """``with ca.trace(m) as t:`` records what runs on manager m into the Trace t.

    Objects alive when recording starts appear with an ``alloc`` event at the start (their
    current placement as the first decisions), so the trace replays on its own. Recording is
    meant for one thread at a time (kernels are matched to their release per thread).
    """

    load = staticmethod(Trace.load)

    def __init__(self, manager):
        if not hasattr(manager, "observe"):
            raise TypeError(f"ca.trace takes a Manager, not {type(manager).__name__}")
        self.m = manager
        self.recorder = None
        self._active = False

    def __enter__(self):
        m = self.m
        with m.atomic():
            if self._active:
                raise RuntimeError(f"this ca.trace is already recording (into "
                                   f"{self.recorder.trace!r}); nest a new ca.trace(m) to record "
                                   "into a second trace")
            m._check_open()
            m.drain()
            rec = self.recorder = Recorder(m)
            try:
                for obj in sorted(m.objects(), key=lambda o: o.id):
                    sid = rec.ids.get(obj.id)
                    rec.trace.objects[sid] = obj.nbytes
                    where = obj.primary.device if obj.primary is not None else None
                    # Where it is now, as a placement hint, so that a replay starts the same way.
                    rec.trace.events.append(("alloc", sid, obj.nbytes,
                                             "fast" if where is m.fast else "slow"))
                    for r in obj.regions.values():
                        rec.on_region(r, True)
                m.observe(rec)
            except BaseException:
                rec.close()
                raise
            self._active = True
        return rec.trace

    def __exit__(self, *exc):
        self._active = False
        self.recorder.close()
        return False
