"""Triggers: a policy's plan, fired at points of the repeating step.

A plan maps points of a step to actions: the k-th kernel (``("kernel", k)`` fires before it
runs, ``("kernel_end", k)`` after), the l-th layer mark (``("layer", l)``), the n-th use of an
object by its stable id (``("use", sid, n)``, fired before that use; n counts from 1) and the
step mark (``("step",)``). Counters restart at every step mark, so a plan made from one step of
a trace runs every step. Actions are called with the manager's lock held and act through the
policy's own methods (``policy.prefetch(obj, wait=False)``, ``policy.evict(obj)``), never
through ``ca.prefetch``: what a plan does is the policy's decision, not the program's request.
"""

from collections import defaultdict

from .manager import Observer
from .trace import StableIds

__all__ = ["Plan"]

_KINDS = {"kernel": 2, "kernel_end": 2, "layer": 2, "use": 3, "step": 1}


def _count(point, value, least):
    """value as an int >= least (a kernel, layer or use count); bools and others refused."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"plan point {point!r}: {value!r} is not a whole number; counts in a "
                        "point are ints (kernels and layers from 0, uses from 1)")
    value = int(value)
    if value < least:
        raise ValueError(f"plan point {point!r}: {value} would never fire; kernels and layers "
                         f"count from 0, uses from 1")
    return value


def _checked(point):
    """The point with its counts as ints; an error for a count that could never fire."""
    if point[0] == "use":
        return ("use", point[1], _count(point, point[2], 1))
    if len(point) == 2:
        return (point[0], _count(point, point[1], 0))
    return point


class Plan(Observer):
    """Actions keyed by points of the step; attach with ``Plan(manager)``."""

    def __init__(self, manager):
        self.m = manager
        self.ids = StableIds.of(manager)
        self.actions = defaultdict(list)
        self.kernel = 0               # kernels begun in this step
        self.layer = 0                # layer marks in this step
        self.uses = defaultdict(int)  # sid -> uses in this step
        self.fired = 0
        self.unfired = []             # points the last step never reached (see on_mark)
        self._open = []               # kernel index of each acquire not yet released
        manager.observe(self)

    def at(self, point, action):
        """Call action(manager) at point (see the module docstring)."""
        if not isinstance(point, tuple) or point[:1] == () or point[0] not in _KINDS or \
                len(point) != _KINDS[point[0]]:
            raise ValueError(f"plan point {point!r}: write ('kernel', k), ('kernel_end', k), "
                             "('layer', l), ('use', sid, n) or ('step',)")
        point = _checked(point)
        if not callable(action):
            raise TypeError(f"plan action for {point!r} must be callable, got "
                            f"{type(action).__name__}")
        self.actions[point].append(action)

    def clear(self):
        self.actions.clear()

    def detach(self):
        self.m.unobserve(self)

    def _fire(self, point):
        acts = self.actions.get(point)
        if acts:
            for a in acts:
                self.fired += 1
                a(self.m)

    # -- observer hooks -------------------------------------------------------------------

    def on_begin(self, name, reads, writes):
        if self.m.recomputing:        # a rerun of regenerate: not a kernel of the step
            return
        k = self.kernel
        self.kernel = k + 1
        self._fire(("kernel", k))
        key = sorted(o.id for o in (*reads, *writes))
        self._open.append((k, key))
        if self.actions:
            sid = self.ids.get
            for o in (*reads, *writes):
                s = sid(o.id)
                n = self.uses[s] = self.uses[s] + 1
                self._fire(("use", s, n))

    def on_release(self, objs):
        if self.m.recomputing:
            return
        if self._open and self._open[-1][1] == sorted(o.id for o in objs):
            k, _ = self._open.pop()
            self._fire(("kernel_end", k))

    def on_mark(self, kind):
        if kind == "layer":
            self._fire(("layer", self.layer))
            self.layer += 1
        else:
            self._fire(("step",))
            self._note_unfired()
            self.kernel = self.layer = 0
            self.uses.clear()

    def _note_unfired(self):
        """At a step mark: the points past the end of the step that ended (a kernel, layer or
        use it never reached) are in ``unfired`` and counted as the event ``plan_unfired``,
        so a plan that does not fit its step is seen rather than silently idle."""
        reached = {"kernel": self.kernel, "kernel_end": self.kernel, "layer": self.layer}
        unfired = [p for p, acts in self.actions.items() if acts and (
            p[0] in reached and p[1] >= reached[p[0]] or
            p[0] == "use" and p[2] > self.uses.get(p[1], 0))]
        self.unfired = sorted(unfired, key=repr)
        if unfired:
            self.m.count("plan_unfired", 0, points=len(unfired), kernels=self.kernel,
                         first=repr(self.unfired[0]))

    def live(self, sid):
        """The live object with this stable id, or None."""
        oid = self.ids.obj_id.get(sid)
        return None if oid is None else self.m.object(oid)
