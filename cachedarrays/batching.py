"""Batch families: the trace of a program at any batch size, from traces at two batch sizes.

A training step's arrays are either independent of the batch (weights, their gradients) or
grow with it (activations, their gradients), and its kernels' times grow about linearly too.
So two traces of the same program, recorded at batches a and b, give every object's size and
every kernel's time at any batch as the line through the two points. ``BatchFamily.at(batch)``
is that trace (events, kernels and ids unchanged; no decision log: a replay makes one), the
input of "the largest batch that trains in this much fast memory" searches.
"""

import math
import numbers
from fractions import Fraction

from .trace import Trace, TraceError

__all__ = ["BatchFamily", "first_steps"]

# Sizes that grow by a fractional number of bytes per batch element are rounded to a multiple of
# this many bytes (at most; less when the two recorded sizes have a smaller common factor).
_ELEMENT = 8


# A batch (or step count) above this gives arrays larger than any device holds (2**62 bytes).
_MOST = 1 << 62


def _batch(batch, what="batch"):
    """batch as an int from 1 to 2**62: an integer (NumPy's too) or an integral float."""
    if isinstance(batch, numbers.Integral) and not isinstance(batch, bool):
        batch = int(batch)
    elif isinstance(batch, numbers.Real) and not isinstance(batch, bool) and \
            float(batch).is_integer():
        batch = int(batch)
    else:
        raise TypeError(f"{what} must be a whole number, not {batch!r}")
    if batch <= 0:
        raise ValueError(f"{what} must be at least 1, not {batch}")
    if batch > _MOST:
        raise ValueError(f"{what} {batch} is more than 2**62: its arrays would outgrow any "
                         "memory; give a batch the program could run")
    return batch


def first_steps(trace, n):
    """The trace cut after its n-th step mark: its events, kernels, kernel times and decision log
    up to there (replaying the first steps of a long trace). The trace itself if it has no more
    than n steps."""
    n = _batch(n, "the number of steps")
    marks = [i for i, e in enumerate(trace.events) if e[0] == "step"]
    if len(marks) <= n:
        return trace
    events = trace.events[:marks[n - 1] + 1]
    used = [e[1] for e in events if e[0] == "kernel"]
    nk = max(used) + 1 if used else 0
    t = trace.copy()
    t.events = events
    t.kernels = trace.kernels[:nk]
    t.times = trace.times[:nk]
    t.touched = {k: v for k, v in trace.touched.items() if k < nk}
    if getattr(trace, "pure", None) is not None:
        t.pure = type(trace.pure)(k for k in trace.pure if k < nk)
    made = {e[1] for e in events if e[0] == "alloc"}
    t.objects = {s: b for s, b in trace.objects.items() if s in made}
    cut, seen = len(trace.decisions), 0
    for i, d in enumerate(trace.decisions):
        if d[0] == "step":
            seen += 1
            if seen == n:
                cut = i + 1
                break
    t.decisions = trace.decisions[:cut]
    t.meta = dict(trace.meta, steps_kept=n)
    return t


def _first_difference(ta, tb):
    """A sentence naming the first way the two traces are not the same program, or None."""
    ea, eb = ta.events, tb.events
    for i, (x, y) in enumerate(zip(ea, eb)):
        if x[0] == "alloc" and y[0] == "alloc":
            if x[1] != y[1] or x[3:] != y[3:]:
                return f"event {i} is {x!r} in one and {y!r} in the other"
        elif x != y:
            return f"event {i} is {x!r} in one and {y!r} in the other"
    if len(ea) != len(eb):
        i = min(len(ea), len(eb))
        extra = (ea if len(ea) > len(eb) else eb)[i]
        return f"one has {len(ea)} events, the other {len(eb)} (first extra: event {i} {extra!r})"
    for k, (x, y) in enumerate(zip(ta.kernels, tb.kernels)):
        if tuple(x[0:1]) != tuple(y[0:1]) or tuple(x[1]) != tuple(y[1]) \
                or tuple(x[2]) != tuple(y[2]):
            return f"kernel {k} is {tuple(x)!r} in one and {tuple(y)!r} in the other"
    if len(ta.kernels) != len(tb.kernels):
        return f"one has {len(ta.kernels)} kernels, the other {len(tb.kernels)}"
    if set(ta.objects) != set(tb.objects):
        odd = sorted(set(ta.objects) ^ set(tb.objects))[0]
        return f"object {odd!r} is in only one of them"
    for k in sorted(set(ta.touched) | set(tb.touched)):
        if set(ta.touched.get(k, ())) != set(tb.touched.get(k, ())):
            return f"kernel {k} touches part of different objects"
    pa, pb = getattr(ta, "pure", None), getattr(tb, "pure", None)
    if set(pa or ()) != set(pb or ()):
        k = min(set(pa) ^ set(pb))
        return f"kernel {k} is pure (made by ca.compute) in only one of them"
    return None


class BatchFamily:
    """A program at any batch size, from its traces at two batch sizes.

    ``at(batch)``: the trace at that batch; every object's size, every partial touch and every
    kernel's time on the line through the two recorded points. Sizes that do not change stay;
    a size is exact when it grows by a whole number of bytes per sample, else rounded to a
    multiple of its element size (the common factor of the two sizes, at most 8 bytes), and
    never below that. Kernel times stay positive: below the smaller recorded time they are
    clamped to it (scaled down in proportion under the smaller batch). Several steps of noisy
    times are first replaced by their medians (``Trace.median_times``) unless ``median=False``.
    """

    def __init__(self, trace_a, batch_a, trace_b, batch_b, *, median=True):
        for t in (trace_a, trace_b):
            if not isinstance(t, Trace):
                raise TypeError(f"BatchFamily takes two Traces (ca.trace or Trace.load), not "
                                f"{type(t).__name__}")
        batch_a, batch_b = _batch(batch_a, "batch_a"), _batch(batch_b, "batch_b")
        if batch_a == batch_b:
            raise ValueError(f"both traces are of batch {batch_a}: record the program at two "
                             "different batch sizes")
        if batch_a > batch_b:
            trace_a, batch_a, trace_b, batch_b = trace_b, batch_b, trace_a, batch_a
        if median:
            trace_a, trace_b = (t.median_times() if t.steps > 1 else t
                                for t in (trace_a, trace_b))
        diff = _first_difference(trace_a, trace_b)
        if diff is not None:
            raise TraceError(f"the traces of batch {batch_a} and {batch_b} are not the same "
                             f"program: {diff}; record both from the same model, with the same "
                             "number of steps and the same policy, changing only the batch")
        self.a, self.b = batch_a, batch_b
        self.trace_a, self.trace_b = trace_a, trace_b
        # (size at a, size at b) of every alloc event, object and partial touch
        self._pairs = set()
        self._allocs = []                       # (event index, size pair)
        for i, (x, y) in enumerate(zip(trace_a.events, trace_b.events)):
            if x[0] == "alloc":
                self._allocs.append((i, (x[2], y[2])))
                self._pairs.add((x[2], y[2]))
        self._objects = {s: (n, trace_b.objects[s]) for s, n in trace_a.objects.items()}
        self._touched = {k: {s: (n, trace_b.touched[k][s]) for s, n in v.items()}
                         for k, v in trace_a.touched.items()}
        self._pairs.update(self._objects.values())
        for v in self._touched.values():
            self._pairs.update(v.values())
        named = [(f"object {s!r}", p) for s, p in self._objects.items()]
        named += [(f"object {trace_a.events[i][1]!r}", p) for i, p in self._allocs]
        named += [(f"object {s!r} (bytes kernel {k} touches)", p) for k, v in self._touched.items()
                  for s, p in v.items()]
        for what, (na, nb) in named:
            if nb < na:
                raise TraceError(f"{what}: {na} bytes at batch {batch_a} but {nb} at batch "
                                 f"{batch_b}; a batch family needs sizes that grow with the "
                                 "batch or stay (are the traces given with their own batches?)")
        self._times = list(zip(trace_a.times, trace_b.times))

    @property
    def batches(self):
        """The two recorded batch sizes, smaller first."""
        return self.a, self.b

    def _size(self, pair, batch):
        na, nb = pair
        if na == nb:
            return na
        unit = math.gcd(math.gcd(na, nb), _ELEMENT) or 1
        exact = na + Fraction(nb - na, self.b - self.a) * (batch - self.a)
        if exact.denominator == 1 and exact >= 1:      # a whole number of bytes per sample
            return int(exact)
        # else the nearest multiple of unit (half up), at least one unit
        return max(unit, math.floor(exact / unit + Fraction(1, 2)) * unit)

    def _time(self, pair, batch):
        ta, tb = pair
        t = ta + (tb - ta) * (batch - self.a) / (self.b - self.a)
        floor = min(ta, tb) * min(1.0, batch / self.a)
        return max(t, floor)

    def sizes(self, batch):
        """{(bytes at a, bytes at b): bytes at batch} of every recorded size."""
        batch = _batch(batch)
        return {p: self._size(p, batch) for p in self._pairs}

    def at(self, batch, steps=None):
        """The trace at this batch (steps: only its first steps, see ``first_steps``)."""
        batch = _batch(batch)
        src = self.trace_b if steps is None else first_steps(self.trace_b, steps)
        ne, nk = len(src.events), len(src.kernels)
        size = self.sizes(batch)
        t = src.copy()
        events = list(src.events)
        for i, p in self._allocs:
            if i >= ne:
                break
            e = events[i]
            events[i] = (e[0], e[1], size[p], *e[3:])
        t.events = events
        t.objects = {s: size[self._objects[s]] for s in src.objects}
        t.touched = {k: {s: min(size[p], t.objects.get(s, size[p])) for s, p in v.items()}
                     for k, v in self._touched.items() if k < nk}
        t.times = [self._time(p, batch) for p in self._times[:nk]]
        t.decisions = []
        meta = dict(src.meta)
        meta.pop("steps_kept", None)
        if steps is not None and src is not self.trace_b:
            meta["steps_kept"] = steps
        if isinstance(meta.get("spec"), dict) and "batch" in meta["spec"]:
            meta["spec"] = dict(meta["spec"], batch=batch)
        meta["batch"] = batch
        meta["times"] = (f"linear in the batch through batches {self.a} and {self.b} "
                         f"({src.meta.get('times', 'recorded times')})")
        t.meta = meta
        return t

    def footprint(self, batch):
        """Peak bytes of live objects at this batch (``Trace.footprint`` of ``at(batch)``)."""
        size = self.sizes(batch)
        alloc = dict(self._allocs)
        live, cur, peak = {}, 0, 0
        for i, e in enumerate(self.trace_b.events):
            if e[0] == "alloc":
                n = size[alloc[i]]
                cur += n - live.get(e[1], 0)
                live[e[1]] = n
                peak = max(peak, cur)
            elif e[0] == "free":
                cur -= live.pop(e[1], 0)
        return peak

    def operand_peak(self, batch):
        """Bytes of the largest kernel operand set at this batch (distinct objects): what fast
        memory must hold at once when every kernel runs on operands in fast memory."""
        size = self.sizes(batch)
        alloc = dict(self._allocs)
        live, peak = {}, 0
        kernels = self.trace_b.kernels
        for i, e in enumerate(self.trace_b.events):
            if e[0] == "alloc":
                live[e[1]] = size[alloc[i]]
            elif e[0] == "kernel":
                _, r, w = kernels[e[1]]
                peak = max(peak, sum(live[s] for s in {*r, *w}))
        return peak

    def __repr__(self):
        return (f"<BatchFamily batches {self.a} and {self.b}: {len(self.trace_b.objects)} "
                f"objects, {len(self.trace_b.kernels)} kernels, {self.trace_b.steps} steps>")
