"""Planning policies: profile one step, plan, and run the plan every step after.

A ``PlannedPolicy`` profiles a step of the running program itself (it records the manager's
events from the moment it is bound, with the kernel times of ``KernelClock``; a replay gives
those the trace's times), or takes the profile as ``profile=`` (a Trace, a path to one or a
``StepProfile``). At the step mark that ends the profiled step it calls ``make_plan(step)``,
which a subclass implements with two tools:

- ``self.alloc_plan[i] = "fast" | "slow"``: where the i-th allocation of every later step goes
  (``StepProfile.allocs[i]``); the program's own placement hints are overridden.
- ``self.schedule(point, action)``: an action at a point of every step (``("kernel", k)``,
  ``("kernel_end", k)``, ``("layer", l)``, ``("use", sid, n)``, ``("step",)``); actions call
  ``self.bring(sid)``/``self.send(sid)`` and the like.

Before the plan exists (the profiled step and those before it), objects go to fast memory
while it has room and nothing moves unless asked. When fast memory must make room, the planned
policy evicts first the objects whose next use in the profiled step is furthest away (Belady's
order, which the profile makes available).
"""

import math

from .. import costmodel
from ..stepprofile import StepProfile
from ..trace import _SID_EVENTS, Recorder, StableIds, Trace
from .base import Policy

__all__ = ["PlannedPolicy"]


class PlannedPolicy(Policy):
    """Base class of the policies that plan from a profiled step (see the module docstring).

    profile: None (profile step ``profile_step`` of this run), a Trace or path (plan from its
    step ``profile_step``, counted from 0; -1 = its last) or a StepProfile.
    """

    name = "planned"
    honours_prefetch = False        # the plan decides; the models' annotations are not needed
    honours_softevict = False
    tracks_reads = False

    def __init__(self, profile=None, profile_step=1):
        super().__init__()
        if isinstance(profile_step, bool) or not isinstance(profile_step, int):
            raise ValueError(f"profile_step must be a step number (int), got {profile_step!r}")
        if profile is None and profile_step < 0:
            raise ValueError(f"profile_step={profile_step}: a step of this run counts from 0")
        if profile is not None and not isinstance(profile, (StepProfile, Trace, str)) and \
                not hasattr(profile, "__fspath__"):
            raise TypeError(f"profile must be None, a Trace, a path to a saved trace or a "
                            f"StepProfile, not {type(profile).__name__}")
        self.profile_source = profile
        self.profile_step = profile_step
        self.step = None              # the StepProfile the plan was made from
        self.alloc_plan = {}          # allocation ordinal within a step -> "fast" | "slow"
        self.steps_seen = 0
        self.ordinal = 0              # allocations so far in this step
        self.ids = None
        self._recorder = None
        self.info = {}                # what planning found (for reports)

    def bind(self, manager):
        super().bind(manager)
        self.ids = StableIds.of(manager)
        if self.plan is None:     # observe before later observers (a trace's or replay's
            self.schedule(("step",), lambda m: None)    # recorder), so that actions at a
            self.plan.clear()     # kernel come before the record of its operands
        src = self.profile_source
        if src is None:
            self._recorder = Recorder(manager)
            manager.observe(self._recorder)
        else:
            step = src if isinstance(src, StepProfile) else StepProfile.of(src, self.profile_step)
            self._install(step)

    # ---- planning -------------------------------------------------------------------------

    @property
    def planned(self):
        return self.step is not None

    def make_plan(self, step):
        """Fill ``alloc_plan`` and schedule the actions of a step (subclasses)."""

    def _install(self, step):
        self.step = step
        self.alloc_plan = {}
        self.plan.clear()
        self.make_plan(step)

    def prefetch(self, obj, force=False, wait=True):
        """The program's prefetch requests move nothing: the plan decides (``bring``)."""
        return self.in_fast(obj)

    def on_step(self):
        self.steps_seen += 1
        self.ordinal = 0
        rec = self._recorder
        if rec is not None and self.steps_seen == self.profile_step + 1:
            rec.close()
            self._recorder = None
            self._install(StepProfile(rec.trace, self.profile_step))

    # ---- allocation -----------------------------------------------------------------------

    def place(self, nbytes, placement=None):
        return self._new(nbytes, placement)

    def allocate(self, nbytes):
        return self._new(nbytes, None)

    def _new(self, nbytes, placement):
        """Every new object of the program comes here once (counted for ``alloc_plan``)."""
        i = self.ordinal
        self.ordinal = i + 1
        want = self.alloc_plan.get(i) if self.step is not None else None
        if want is not None:
            return self.allocate_as(want, nbytes)
        return self.unplanned(nbytes, placement)

    def unplanned(self, nbytes, placement=None):
        """Where an allocation the plan says nothing about goes: fast while it has room (the
        hint "fast" evicts to make room), else slow; "slow" goes to slow memory."""
        if placement is not None:
            return super().place(nbytes, placement)
        obj = self.alloc_fast(nbytes)
        return obj if obj is not None else self.alloc_slow(nbytes)

    def allocate_as(self, where, nbytes):
        """A new object of nbytes where the plan says: "fast" (evicting by the plan's order if
        needed; slow when it cannot fit) or "slow"."""
        if where == "fast":
            obj = self.alloc_fast(nbytes, force=True)
            if obj is None:
                self.manager.count("plan_missed", nbytes, what="fast allocation")
                return self.alloc_slow(nbytes)
            return obj
        return self.alloc_slow(nbytes)

    def device_profile(self, device="slow"):
        """The cost-model Profile of a tier (a device or its name; fast: dram, others: optane
        when the tier names none)."""
        m = self.manager
        dev = m._device(device) if isinstance(device, str) else device
        p = getattr(dev, "profile", None)
        return costmodel.get_profile(p or ("dram" if dev is m.fast else "optane"))

    # ---- actions --------------------------------------------------------------------------

    def live(self, sid):
        """The live object with this stable id, or None. In the first step (before the first
        step mark) the program's new objects are ``init:`` ones: a plan made from a later step
        (``profile=``) finds them under the id they will have in every later step."""
        ids = self.ids.obj_id
        oid = ids.get(sid)
        if oid is None and self.steps_seen == 0:
            oid = ids.get("init:" + sid)
        return None if oid is None else self.manager.object(oid)

    def bring(self, sid, wait=False, force=False):
        """Start moving sid into fast memory (in the background unless wait). False when it is
        not live, pinned, or does not fit (force: evict by the plan's order to make room)."""
        obj = self.live(sid)
        if obj is None or obj.freed or obj.primary is None:
            return False
        if obj.primary.device is self.manager.fast:
            return True
        return Policy.prefetch(self, obj, force, wait)

    def send(self, sid, wait=False, to=None):
        """Move sid out of fast memory (in the background unless wait); a clean object is
        dropped (its slow copy is current), not written back."""
        obj = self.live(sid)
        if obj is None or obj.freed or obj.primary is None:
            return False
        if obj.primary.device is not self.manager.fast:
            return True
        return Policy.evict(self, obj, to, wait)

    def in_fast_sid(self, sid):
        obj = self.live(sid)
        return obj is not None and obj.primary is not None and \
            obj.primary.device is self.manager.fast

    # ---- making room ----------------------------------------------------------------------

    def kernel_index(self):
        """The kernel of the step running now (or about to): kernels begun so far - 1, at
        least 0."""
        p = self.plan
        return max(0, p.kernel - 1) if p is not None else 0

    def select_victims(self, nbytes):
        m = self.manager
        objs = [m.parent(r) for r in m.regions_on("fast")]
        objs = [o for o in objs if o is not None and not o.freed]
        step = self.step
        if step is None:
            return objs
        k = self.kernel_index()
        sid = self.ids.sid.get

        def distance(o):
            s = sid(o.id)
            nxt = step.next_use(s, k + 1) if s is not None else None
            return math.inf if nxt is None else nxt

        objs.sort(key=distance, reverse=True)
        return objs


# ---- a profiled step, repeated ---------------------------------------------------------------

def _role(sid):
    """A stable id without what tells steps apart (the first step's ``init:``, ``@step``)."""
    sid = sid[5:] if sid.startswith("init:") else sid
    head, at, tail = sid.rpartition("@")
    return head if at and tail.isdigit() else sid


def repeat_step(trace, step, times=1):
    """The trace up to the end of step ``step``, then that step's events again, times times, as
    a recording of those steps would have them: kernels copied under new indices (with their
    touched bytes, and still ``ca.compute`` kernels when they were), the step's frees of the
    previous step's objects applied to this step's own, and an id still in use when the step
    makes its object again given the step's number, as ``StableIds`` would."""
    marks = [i for i, e in enumerate(trace.events) if e[0] == "step"]
    start = marks[step - 1] + 1 if step > 0 else 0
    end = marks[step] + 1 if step < len(marks) else len(trace.events)
    body = trace.events[start:end]
    if not body or body[-1][0] != "step":
        body = body + [("step",)]
    events, kernels, ktimes = list(trace.events[:end]), list(trace.kernels), list(trace.times)
    if events and events[-1][0] != "step":
        events.append(("step",))
    objects, touched = dict(trace.objects), dict(trace.touched)
    pure, partial = set(trace.pure), dict(trace.partial)
    live = set()
    for e in events:
        if e[0] == "alloc":
            live.add(e[1])
        elif e[0] == "free":
            live.discard(e[1])
    # the objects of the step before that this step frees, each with the object this step
    # leaves to the next one in its place (made at the same site)
    made, inherited, kept = set(), [], {}
    for e in body:
        if e[0] == "alloc":
            made.add(e[1])
            kept[e[1]] = True
        elif e[0] == "free":
            if e[1] not in made:
                inherited.append(e[1])
            if e[1] in kept:
                kept[e[1]] = False
    heirs = {}
    for sid in (s for s, alive in kept.items() if alive):
        heirs.setdefault(_role(sid), []).append(sid)
    after = {sid: heirs[_role(sid)][0] for sid in inherited
             if len(heirs.get(_role(sid), ())) == 1}
    names = {sid: sid for sid in made}      # the body's ids -> their names in the last copy
    carry = {}

    def name(sid):
        return names.get(sid) or carry.get(sid, sid)

    for r in range(1, times + 1):
        carry = {old: names[heir] for old, heir in after.items()}
        names = {}
        new = {}
        for e in body:
            if e[0] == "alloc":
                sid = e[1]
                fresh, n = sid if sid not in live else _role(sid), 1
                while fresh in live:            # as StableIds names a site's object anew
                    fresh = f"{_role(sid)}@{step + r}" + (f".{n}" if n > 1 else "")
                    n += 1
                names[sid] = fresh
                objects.setdefault(fresh, e[2])
                live.add(fresh)
                e = ("alloc", fresh, *e[2:])
            elif e[0] in _SID_EVENTS:
                e = (e[0], name(e[1]), *e[2:])
                if e[0] == "free":
                    live.discard(e[1])
            elif e[0] in ("kernel", "end"):
                k = e[1]
                if k not in new:
                    new[k] = len(kernels)
                    kname, reads, writes = trace.kernels[k][:3]
                    kernels.append((kname, tuple(map(name, reads)), tuple(map(name, writes)),
                                    *trace.kernels[k][3:]))
                    ktimes.append(trace.times[k])
                    if k in trace.touched:
                        touched[new[k]] = {name(s): b for s, b in trace.touched[k].items()}
                    if k in trace.pure:           # a ca.compute kernel stays recomputable
                        pure.add(new[k])
                    if k in trace.partial:
                        partial[new[k]] = [name(s) for s in trace.partial[k]]
                e = (e[0], new[k], *e[2:])
            events.append(e)
    return Trace(objects, events, kernels, ktimes, trace.meta, devices=trace.devices,
                 touched=touched, pure=pure, partial=partial)
