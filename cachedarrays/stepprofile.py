"""One step of a trace, arranged for planning: kernels, layers, objects, lifetimes and uses.

Training repeats its step, so a plan made from one profiled step runs every step after it (the
premise of Sentinel, DeepTM, Capuchin, G10 and AutoTM). ``StepProfile.of(trace, step)`` indexes
the kernels of that step from 0 (the numbering ``cachedarrays.triggers`` uses) and gives each
object its allocation and free positions, its uses and its bytes:

- ``alloc_at[sid]``: kernels begun in the step before the object was allocated (so it exists
  from kernel ``alloc_at`` on); objects alive when the step begins are ``resident``.
- ``free_at[sid]``: kernels begun before it was freed; objects alive at the step's end are
  ``survivors``. Objects alive at both ends are ``persistent`` (weights, optimizer state).
- ``uses[sid]``: the (kernel, is_write) pairs, in order.
- ``layer_of[k]``: the layer of kernel k (layer marks begun before it), ``layers`` of them.
- ``allocs``: (sid, nbytes, placement) of each allocation of the step, in order; the i-th
  ``new_pinned`` call of any later step makes the object of ``allocs[i]``.

Each object has one lifetime in the step: an id allocated twice in it (or freed and allocated
again) is a TraceError.
"""

from bisect import bisect_right

from .trace import Trace, TraceError

__all__ = ["StepProfile"]


def _step_index(step):
    """step as an int: an integer (or an integral float); anything else is a TypeError."""
    if isinstance(step, float) and step.is_integer():
        return int(step)
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise TypeError(f"StepProfile: the step must be a whole number (a step index, negative "
                        f"from the end), not {step!r}")
    return step.__index__()


def _allocated_again(sid, step, begun, made):
    """The error for an id allocated twice in the profiled step (one lifetime per id)."""
    return TraceError(f"object {sid!r} is allocated again in step {step} (after {begun} of its "
                      f"kernels), having been {'made' if made else 'alive'} earlier in the "
                      f"step: a step profile gives each object one lifetime per step, so give "
                      f"each allocation of the step its own id")


class StepProfile:
    """The kernels and objects of one step of a trace (see the module docstring)."""

    def __init__(self, trace, step):
        if not isinstance(trace, Trace):
            raise TypeError(f"StepProfile takes a Trace, not {type(trace).__name__}")
        step = _step_index(step)
        steps = trace.step_kernels()
        marks = trace.steps
        if not steps:
            raise TraceError("the trace has no kernels to profile")
        n = len(steps)
        if not -n <= step < n:
            raise TraceError(f"step {step} is not in the trace, which has {n} step(s) "
                             f"({marks} step marks); give a step in range({n}) or a negative one")
        self.trace = trace
        self.step = step % n
        self.kernels = []             # (name, reads, writes)
        self.kernel_ids = []          # index of each kernel in the trace
        self.times = []
        self.layer_of = []
        self.layer_start = [0]        # first kernel of each layer
        self.objects = {}             # sid -> nbytes of every object alive during the step
        self.alloc_at, self.free_at = {}, {}
        self.allocs = []
        self.uses = {}
        self.touched = {}             # (kernel, sid) -> bytes, where less than the object
        self.resident = []            # sids alive at the step's start, in allocation order
        live = {}                     # sid -> nbytes
        cur, layer, begun = 0, 0, 0
        for e in trace.events:
            kind = e[0]
            if cur < self.step:
                if kind == "alloc":
                    live[e[1]] = int(e[2])
                elif kind == "free":
                    live.pop(e[1], None)
                elif kind == "step":
                    cur += 1
                    if cur == self.step:
                        self.resident = list(live)
                        self.objects.update(live)
                continue
            if cur > self.step:
                break
            if kind == "step":
                cur += 1
            elif kind == "alloc":
                sid, nbytes = e[1], int(e[2])  # a NumPy unsigned size would wrap in sums
                if sid in self.alloc_at or sid in self.free_at:
                    raise _allocated_again(sid, self.step, begun, sid in self.alloc_at)
                self.objects[sid] = nbytes
                self.alloc_at[sid] = begun
                self.allocs.append((sid, nbytes, e[3]))
                live[sid] = nbytes
            elif kind == "free":
                if e[1] in live:
                    self.free_at[e[1]] = begun
                    live.pop(e[1])
            elif kind == "kernel":
                k = e[1]
                name, reads, writes = trace.kernels[k]
                self.kernels.append((name, tuple(reads), tuple(writes)))
                self.kernel_ids.append(k)
                self.times.append(float(trace.times[k]))
                self.layer_of.append(layer)
                part = trace.touched.get(k, {})
                for sid in reads:
                    self.uses.setdefault(sid, []).append((begun, False))
                for sid in writes:
                    self.uses.setdefault(sid, []).append((begun, True))
                for sid, nb in part.items():
                    self.touched[(begun, sid)] = int(nb)
                begun += 1
            elif kind == "layer":
                layer += 1
                self.layer_start.append(begun)
        if self.step == 0:
            self.resident = [s for s in self.objects if s not in self.alloc_at]
        self.survivors = [s for s in live]
        self.layers = layer + 1
        self.persistent = [s for s in self.resident if s not in self.free_at]
        self._use_index = {s: [k for k, _ in u] for s, u in self.uses.items()}

    @classmethod
    def of(cls, trace, step=-1):
        """The profile of one step of trace (a Trace or a path to a saved one); TraceError if
        the trace is malformed (a loaded one was validated by ``load``)."""
        if isinstance(trace, Trace):
            trace.validate()
        else:
            trace = Trace.load(trace)
        return cls(trace, step)

    # -- facts ------------------------------------------------------------------------------

    def __len__(self):
        return len(self.kernels)

    def lifetime(self, sid):
        """(first kernel it exists at, kernel before which it is freed) in the step: resident
        objects start at 0, survivors end at len(self)."""
        return self.alloc_at.get(sid, 0), self.free_at.get(sid, len(self.kernels))

    def span(self, sid):
        """(first layer, last layer) the object is alive in."""
        a, f = self.lifetime(sid)
        last = max(a, f - 1) if self.kernels else 0
        return self.layer(a), self.layer(last)

    def layer(self, k):
        """The layer of kernel k (the last layer for k == len(self))."""
        if not self.kernels:
            return 0
        return self.layer_of[min(max(k, 0), len(self.kernels) - 1)]

    def short_lived(self, sid):
        """Allocated and freed in the same layer of the step (Sentinel's short-lived class)."""
        if sid not in self.alloc_at or sid not in self.free_at:
            return False
        a, f = self.lifetime(sid)
        return self.layer(a) == self.layer(max(a, f - 1))

    def access_count(self, sid):
        """Kernels of the step that use the object."""
        return len(self.uses.get(sid, ()))

    def next_use(self, sid, k):
        """The first kernel >= k that uses sid, or None."""
        idx = self._use_index.get(sid)
        if not idx:
            return None
        i = bisect_right(idx, k - 1)
        return idx[i] if i < len(idx) else None

    def last_use(self, sid):
        idx = self._use_index.get(sid)
        return idx[-1] if idx else None

    def written(self, sid, lo=0, hi=None):
        """True if a kernel in [lo, hi) writes sid."""
        hi = len(self.kernels) if hi is None else hi
        return any(w and lo <= k < hi for k, w in self.uses.get(sid, ()))

    def operands(self, k):
        """The sids kernel k reads and writes (each once)."""
        _, r, w = self.kernels[k]
        return tuple(dict.fromkeys((*r, *w)))

    def operand_bytes(self, k, sid):
        """Bytes kernel k touches of sid."""
        return self.touched.get((k, sid), self.objects.get(sid, 0))

    def live_bytes(self):
        """Bytes alive during each kernel of the step (a list, one entry per kernel)."""
        n = len(self.kernels)
        delta = [0] * (n + 1)
        for s, nb in self.objects.items():
            a, f = self.lifetime(s)
            if a < f:
                delta[min(a, n)] += nb
                delta[min(f, n)] -= nb
        out, cur = [], 0
        for k in range(n):
            cur += delta[k]
            out.append(cur)
        return out

    def peak(self):
        """Most bytes alive during any kernel of the step."""
        return max(self.live_bytes(), default=0)

    def compute(self):
        """Sum of the step's kernel times (its fast-only time)."""
        return sum(self.times)

    def layer_times(self):
        """Compute seconds of each layer."""
        out = [0.0] * self.layers
        for k, t in enumerate(self.times):
            out[self.layer_of[k]] += t
        return out

    def __repr__(self):
        return (f"<StepProfile step {self.step}: {len(self.kernels)} kernels, {self.layers} "
                f"layers, {len(self.objects)} objects, {len(self.resident)} resident>")
