"""Replay: run a policy against a recorded trace without executing kernels.

The replay drives the same manager code (policy calls, linking, ``evictfrom`` walks) and the same
native heap as a real run, on virtual devices: the heaps are real, so fragmentation is real, but
no data is allocated or copied. The decision log it produces goes to ``cachedarrays.costmodel``
for the modelled time. A real run of a policy and the replay of its trace make the same
decisions, so they report the same bytes moved and modelled times.
"""

import numbers
from dataclasses import dataclass, field

from . import costmodel
from .lineage import Recipe
from .manager import Manager
from .sizes import parse_size
from .trace import Recorder, Trace, TraceError

__all__ = ["replay", "Run", "evaluate"]

# Slow memory of a replay when none is given: every object twice over (a slow copy per object
# and room to spare); virtual devices cost only address space.
_SLOW_FACTOR = 2


@dataclass
class Run:
    """What a replay (or a traced real run) gives: decisions, manager telemetry, modelled time."""

    trace: Trace
    decisions: list
    devices: list
    stats: dict
    result: costmodel.Result
    fast_only: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def last(self):
        """The last step (the steady state)."""
        return self.result.last

    @property
    def ratio(self):
        """Modelled time of the last step over its fast-only time."""
        return self.last.time / self.fast_only if self.fast_only else float("nan")


def evaluate(trace, decisions=None, profile=None, devices=None, stats=None,
             slow_output_factor=costmodel.SLOW_OUTPUT_FACTOR, fault_latency=0.0):
    """The modelled time of a trace's decision log (its own, or the decisions given).

    profile: None uses each tier's profile recorded in the trace (dram for the fast tier,
    optane for slow by default), a name or Profile for every slower tier, or a dict per tier.
    fault_latency: seconds charged per on-demand fetch of kernels-in-fast mode.
    """
    devices = list(devices or trace.devices)
    if not devices:
        raise TraceError("the trace names no devices; record it with ca.trace or pass devices=")
    if profile is None:                       # the recorded tiers' profiles; the cost model
        recorded = trace.meta.get("profiles") or {}     # fills in the defaults for the rest
        profile = {d: p for d, p in recorded.items() if d in devices and p}
    decisions = trace.decisions if decisions is None else decisions
    result = costmodel.evaluate(trace.times, decisions, devices, profile, slow_output_factor,
                                fault_latency)
    groups = trace.step_kernels()
    fast_only = sum(trace.times[k] for k in groups[-1]) if groups else 0.0
    return Run(trace, decisions, devices, stats or {}, result, fast_only)


def replay(trace, policy="lru", fast=None, slow=None, *, tiers=None, policy_options=None,
           profile=None, slow_output_factor=costmodel.SLOW_OUTPUT_FACTOR, granularity=None,
           fault_latency=0.0):
    """Run policy over trace on virtual devices; returns a Run.

    fast: fast memory size: bytes (an int) or a size string ("256MiB"); a float is a fraction
    of the trace's footprint (0.25, 1.0, 2.0). slow: the same (default twice the footprint).
    tiers: as for Manager, sizes only (the tiers are virtual), each size as fast's. policy: a
    name, a Policy class or a new Policy instance.
    fault_latency: seconds the cost model charges per on-demand fetch under kernels-in-fast
    mode (``policy_options={"kernels_in_fast": True}``; a GPU's unified-memory fault: 45e-6).
    granularity: the heaps' (0: the default); None: the one the trace was recorded with.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"replay takes a Trace (ca.trace or Trace.load), not "
                        f"{type(trace).__name__}")
    if tiers is not None and (fast is not None or slow is not None):
        raise ValueError("pass either tiers=[...] or fast=/slow=, not both: tiers= gives every "
                         "tier its size, e.g. tiers=[('fast', 0.5), ('slow', 4.0)]")
    costmodel.check_options(slow_output_factor, fault_latency)    # before the replay runs
    trace.validate()
    if granularity is None:
        granularity = _recorded_granularity(trace)
    foot = trace.footprint()
    blocks = trace.footprint(granularity)
    recorded = _recorded_profiles(trace) if profile is None else None
    if tiers is not None:
        tiers, budget = _tiers(tiers, foot, granularity, blocks, recorded)
    _check_targets(trace, ["fast", "slow"] if tiers is None else
                   [t.name if hasattr(t, "name") else t[0] for t in tiers])
    if tiers is None:
        budget, fast = _size(fast if fast is not None else 1.0, foot, "fast", granularity, blocks)
        slow = _size(slow, foot, "slow", granularity, blocks)[1] if slow is not None else \
            max(_SLOW_FACTOR * foot, 1 << 20)
        if isinstance(profile, (str, costmodel.Profile)):   # the tiers carry it: policies
            m = Manager(tiers=[("fast", fast, None, "dram"),    # that plan read it there
                               ("slow", slow, None, costmodel.get_profile(profile))],
                        policy=policy, virtual=True, policy_options=policy_options,
                        granularity=granularity)
        elif recorded:                          # the recorded tiers' speeds, as evaluate's
            m = Manager(tiers=[("fast", fast, None, recorded("fast", 0) or "dram"),
                               ("slow", slow, None, recorded("slow", 1))],
                        policy=policy, virtual=True, policy_options=policy_options,
                        granularity=granularity)
        else:
            m = Manager(fast=fast, slow=slow, policy=policy, virtual=True,
                        policy_options=policy_options, granularity=granularity)
    else:
        m = Manager(tiers=tiers, policy=policy, virtual=True, policy_options=policy_options,
                    granularity=granularity)
    with m:
        rec = Recorder(m, events=False)
        m.observe(rec)
        try:
            live = _drive(m, trace, rec)    # the trace's objects stay alive until the stats
            #                                 are taken, as the real run's were when recorded
        finally:
            rec.close()
        stats = m.stats()
        devices = [d.name for d in m.tiers]
        profiles = profile if profile is not None else {d.name: d.profile for d in m.tiers}
    run = evaluate(trace, rec.trace.decisions, profiles, devices, stats, slow_output_factor,
                   fault_latency)
    run.info = {"fast": m.fast.size if budget is None else budget, "footprint": foot,
                "policy": type(m.policy).__name__}
    return run


def _size(spec, footprint, what, granularity=0, blocks=None):
    """(budget, heap size) in bytes of a replay's memory: an int or size string as is; a float
    (Python or NumPy) a fraction of the trace's footprint, never raised to a minimum (an error
    instead), with a heap of that share of blocks (the footprint in heap blocks: headers and
    rounding), so that 1.0 holds every array the trace held at once."""
    if isinstance(spec, numbers.Real) and not isinstance(spec, numbers.Integral):
        share = float(spec)
        if not (share >= 0 and share != float("inf")):
            raise ValueError(f"{what}={spec!r}: a float is a fraction of the trace's footprint "
                             "(0.25, 1.0, 2.0): give a finite number >= 0, or bytes as an int "
                             "or a size string")
        n = int(share * footprint)
        smallest = granularity or 256           # one heap granule
        if share > 0 and n < smallest:
            raise ValueError(f"{what}={spec!r} of the trace's footprint ({footprint} B) is {n} B, "
                             f"less than the smallest memory of {smallest} B (one heap granule); "
                             "give a larger fraction, 0.0 for none, or a size in bytes")
        if blocks is None or not n:
            return n, n
        return n, max(n, -(-int(share * blocks) // smallest) * smallest)
    n = parse_size(spec, f"{what} memory size of the replay")
    return n, n


def _check_targets(trace, names):
    """Every tier the trace's ``ca.evict(x, to=...)`` calls name is one of the replay's."""
    aliases = {"fast", "slow", *names[:2]}
    missing = sorted({e[2] for e in trace.events if e[0] == "evict" and e[2] is not None} -
                     set(names) - aliases)
    if missing:
        recorded = list(trace.meta.get("profiles") or ())
        hint = f" (recorded on {', '.join(recorded)})" if recorded else ""
        raise ValueError(f"the trace moves arrays to tier {', '.join(map(repr, missing))} "
                         f"(ca.evict(x, to=...)), which this replay does not have (its tiers: "
                         f"{', '.join(names)}); replay it with tiers= listing every tier the "
                         f"trace names{hint}, e.g. tiers=[('dram', 0.5), ('pmem', 1.0), "
                         f"('ssd', 4.0)]")


def _recorded_granularity(trace):
    """The heap granularity the trace was recorded with (0: the default)."""
    g = trace.meta.get("granularity", 0)
    if isinstance(g, bool) or not isinstance(g, int) or g < 0:
        raise TraceError(f"the trace's meta gives granularity={g!r}, which is not a heap "
                         "granularity; pass replay(..., granularity=) (0: the default)")
    return g


def _recorded_profiles(trace):
    """The profiles of the tiers the trace was recorded on, as f(name, position) -> profile
    or None (by name, else by position), or None when the trace holds none."""
    rec = trace.meta.get("profiles")
    if not isinstance(rec, dict) or not rec:
        return None
    order = list(rec.values())

    def of(name, i):
        p = rec.get(name) if name in rec else (order[i] if i < len(order) else None)
        return p if isinstance(p, (str, costmodel.Profile)) else None
    return of


def _tiers(tiers, footprint, granularity, blocks=None, recorded=None):
    """Manager tiers from replay's tiers=: (name, size, ...) sequences or Device specs; and
    the first tier's budget (None for a Device). A tier given without a profile gets the one
    it was recorded with (``recorded``, see _recorded_profiles)."""
    form = ("give a list of (name, size) pairs, fastest first, e.g. [('fast', 0.5), "
            "('slow', 4.0)] (a size: bytes, a size string or a float fraction of the "
            "trace's footprint)")
    if isinstance(tiers, (str, bytes)) or not hasattr(tiers, "__iter__"):
        raise ValueError(f"tiers={tiers!r}: {form}")
    out, budgets = [], []
    for i, t in enumerate(tiers):
        if hasattr(t, "name"):
            out.append(t)
            budgets.append(None)
        elif isinstance(t, (tuple, list)) and len(t) >= 2 and isinstance(t[0], str):
            budget, size = _size(t[1], footprint, t[0], granularity, blocks)
            rest = tuple(t[3:])
            if not rest and recorded is not None and recorded(t[0], i) is not None:
                rest = (recorded(t[0], i),)
            out.append((t[0], size, None, *rest))
            budgets.append(budget)
        else:
            raise ValueError(f"tiers: {t!r} is not a tier; {form}")
    return out, budgets[0] if budgets else None


def _drive(m, trace, rec):
    """Issue the trace's events to manager m (whose recorder rec forces the stable ids);
    returns the objects the trace leaves alive (stable id -> object)."""
    live = {}       # stable id -> object
    held = {}       # kernel index -> operands it pins (released at its end, or on an error)
    made = {}       # kernel index -> new objects it keeps pinned until its end
    pending = []    # [new object, kernels of other threads to let pass]: held until the end
    #                 of the next kernel after those
    try:
        _issue(m, trace, rec, held, made, pending, live)
    finally:
        if pending:
            m.release([obj for obj, _ in pending])
        # A failure inside a kernel (an OutOfMemoryError) or a trace that ends inside one
        # leaves pins behind; close() would wait for them and then hide the error.
        for k, objs in reversed(list(held.items())):
            m.release(objs)
            if k in made:
                m.release(made.pop(k))
        for objs in made.values():
            m.release(objs)
    return live


def _recipe(trace, k, live):
    """The recipe of a pure kernel of the trace: no function, its recorded time."""
    part = trace.partial.get(k)
    return Recipe(trace.kernels[k][0], None, seconds=trace.times[k],
                  partial=tuple(live[s].id for s in part) if part else ())


def _issue(m, trace, rec, held, made, pending, live):
    kernels = trace.kernels
    times = trace.times
    ids = rec.ids
    clock = rec.clock
    pure = trace.pure
    for i, e in enumerate(trace.events):
        kind = e[0]
        try:
            if kind == "kernel":
                name, r, w = kernels[e[1]]
                reads, writes = [live[s] for s in r], [live[s] for s in w]
                part = trace.touched.get(e[1])
                clock.force_next(times[e[1]])
                # A ca.compute kernel gets a recipe without a function: the replay's objects
                # get the real run's lineage, and a rerun uses its operands for its time.
                m.acquire(reads, writes, name,
                          {live[s].id: n for s, n in part.items()} if part else None,
                          _recipe(trace, e[1], live) if e[1] in pure else None)
                held[e[1]] = reads + writes
                if pending:                     # new arrays held through this kernel
                    mine = [obj for obj, skip in pending if not skip]
                    pending[:] = [[obj, skip - 1] for obj, skip in pending if skip]
                    if mine:
                        made.setdefault(e[1], []).extend(mine)
            elif kind == "end":
                if e[1] not in held:
                    raise TraceError(f"event {i} {e!r}: ends a kernel that is not open; the "
                                     "trace is malformed (Trace.validate names the first "
                                     "problem)")
                m.release(held.pop(e[1]))
                if e[1] in made:                # released after the operands, as it was
                    m.release(made.pop(e[1]))
            elif kind == "alloc":
                ids.force_next(e[1])
                obj = m.new_pinned(e[2], e[3])
                live[e[1]] = obj
                if len(e) > 4 and e[4] == "next":       # pinned until the next kernel ends
                    pending.append([obj, e[5] if len(e) > 5 else 0])
                elif len(e) > 4 and e[4] and held:      # pinned until its kernel's end: the
                    # last opened, or the one opened e[5] kernels before it (other threads')
                    later = e[5] if len(e) > 5 else 0
                    k = list(held)[-1 - later] if later else next(reversed(held))
                    made.setdefault(k, []).append(obj)
                else:
                    m.release((obj,))
            elif kind == "free":
                obj = live.pop(e[1])
                if not obj.freed:
                    m.free_object(obj)
            elif kind == "prefetch":
                m.prefetch(live[e[1]], e[2], e[3])
            elif kind == "evict":
                m.evict(live[e[1]], e[2], e[3])
            elif kind == "softevict":
                m.softevict(live[e[1]])
            elif kind == "drop":
                m.drop(live[e[1]], True)
            elif kind == "regenerate":
                m.regenerate(live[e[1]], True)
            elif kind in ("layer", "step"):
                m.mark(kind)
            elif kind == "defrag":
                m.defrag(e[1])
            else:
                raise TraceError(f"event {i} {e!r}: unknown event")
        except KeyError as err:
            raise TraceError(f"event {i} {e!r} uses {err.args[0]!r}, which is not live; the "
                             "trace is malformed (Trace.validate names the first problem)") \
                from None
