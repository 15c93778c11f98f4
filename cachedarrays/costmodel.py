"""Deterministic cost model: modelled time = f(kernel compute times, decision log, device profiles).

Plain float arithmetic over the decision log of the policy lab (no clocks, no set or dict-order
dependence): the same inputs give bit-identical results. ``devices`` lists the tiers in order;
fast = devices[0]. R(d), W(d) = read, write bandwidth of d in B/s (GB/s * 1e9); F = slow_output_factor.

Rules (t = compute clock, starts at 0; each record updates the current interval and the total):

* link src->dst: bw = min(R(src), W(dst)), lat = max(latency(src), latency(dst)); free[link] starts at 0.
* ready[sid, dev] = end of the latest copy of sid into dev (0 if none).
* ("alloc", sid, dev, off, n): adds the region (occupancy, peak). dep[sid, dev] = the in-flight copies
  (end > t) whose *source* range on dev overlaps [off, off+n): freed space reused while still being read.
* ("free", sid, dev, off, n): removes the region (a region the log never allocated is ignored).
* ("copy", sid, src, so, dst, do, n, wait); src == dst: a defragmentation or compaction moved sid
  within the device:
      start = max(t, free[link], ready[sid, src], ends of in-flight copies whose source range
                  on dst overlaps [do, do+n))
      end = start + lat + n / bw;  free[link] = end;  ready[sid, dst] = end
      if wait: stall += max(0, end - t);  t = max(t, end)
* ("cancel", sid, src, dst): c = the latest copy of sid on src->dst. If c.end <= t (done): no change.
  Else stop = max(t, c.start); done = clamp((stop - c.start - lat) / (n / bw), 0, 1); c.end = stop;
  ready[sid, dst] reverts to the copy before c (if c is still the latest); free[link] = stop if c is the
  link's last copy (later copies keep their times); moved counts int(n * done) bytes instead of n, in
  the interval that issued c; copies still counts c (copies = copies issued).
* ("kernel", k, ops), ops = (sid, nbytes, dev, is_write)...:
      w = max over ops of max(ready[sid, dev], ends of dep[sid, dev]);  if w > t: stall += w - t; t = w
      reads  = sum over reads on d != fast:  nbytes * (1/R(d) - 1/R(fast))
      writes = sum over writes on d != fast: nbytes * (1/W(d) - 1/W(fast))
      P = reads if no write is off fast, else max(reads + writes, (F - 1) * compute[k])
      t += compute[k] + P;  kernel_read/kernel_write[dev] += nbytes per operand
* ("cache", k, rr, rw, dr, dw, sr, sw), only right after ("kernel", k, ...): a simulated 2LM DRAM cache
  over s = devices[1]. Replaces that kernel's P and its kernel traffic:
      P = dr/R(fast) + dw/W(fast) + sr/R(s) + sw/W(s) - (rr/R(fast) + rw/W(fast))
      kernel_read[fast] += dr, kernel_write[fast] += dw, kernel_read[s] += sr, kernel_write[s] += sw
* ("fault", sid): a kernel used sid while it was not in fast memory (kernels-in-fast mode) and it is
  fetched on demand (the copy record follows): t += fault_latency; stall += fault_latency; faults += 1.
* ("step",) closes an interval (a trailing interval counts as a step if it ran a kernel); ("layer",)
  is ignored. Interval time = t at its end - t at its start. Copies in flight at the end add no time.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from .profiles import PROFILES, Profile, get_profile

__all__ = ["Profile", "PROFILES", "get_profile", "tier_profiles", "SLOW_OUTPUT_FACTOR",
           "StepResult", "Result", "evaluate", "fast_only_time"]

_GB = 1e9
# Dissertation Fig. 3.4: a kernel whose output lives in slow memory runs about 2x slower.
SLOW_OUTPUT_FACTOR = 2.0


def _number(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def tier_profiles(devices, profile=None) -> dict[str, Profile]:
    """Device name -> Profile in tier order. ``profile``: None (fast "dram", others "optane"), a name or
    Profile for every tier but the fast one ("dram"), or a dict device -> name/Profile (missing tiers
    get the None defaults)."""
    iterable = hasattr(devices, "__iter__") and not isinstance(devices, (str, bytes))
    names = tuple(devices) if iterable else ()
    if not names or not all(isinstance(d, str) for d in names) or len(set(names)) != len(names):
        raise ValueError(f"devices={devices!r}: give a sequence of one or more distinct tier names (str), "
                         "fast first, e.g. ('fast', 'slow')")
    devices = names
    given, default = {}, "optane"
    if isinstance(profile, Mapping):
        unknown = [k for k in profile if k not in devices]
        if unknown:
            raise ValueError(f"profile names devices {unknown!r} that are not tiers; "
                             f"the tiers are {list(devices)}")
        given = profile
    elif profile is not None:
        default = get_profile(profile)
    return {d: get_profile(given.get(d, "dram" if i == 0 else default)) for i, d in enumerate(devices)}


@dataclass(frozen=True)
class StepResult:
    """Modelled cost of one interval (seconds, bytes, counts); per-device dicts list every tier in order."""

    time: float = 0.0
    compute: float = 0.0
    penalty: float = 0.0
    stall: float = 0.0
    moved: dict = field(default_factory=dict)          # "src->dst" -> bytes, sorted keys
    copies: dict = field(default_factory=dict)         # "src->dst" -> copies issued, sorted keys
    kernel_read: dict = field(default_factory=dict)    # device -> bytes read by kernels
    kernel_write: dict = field(default_factory=dict)   # device -> bytes written by kernels
    peak: dict = field(default_factory=dict)           # device -> peak bytes allocated
    kernels: int = 0
    devices: tuple = ()                                # tier order, fast first
    faults: int = 0                                    # on-demand fetches (kernels-in-fast)

    @property
    def slow_read(self) -> int:
        """Bytes kernels read from every tier but the fast one."""
        return sum(v for d, v in self.kernel_read.items() if d not in self.devices[:1])

    @property
    def slow_write(self) -> int:
        """Bytes kernels wrote to every tier but the fast one."""
        return sum(v for d, v in self.kernel_write.items() if d not in self.devices[:1])

    @property
    def bytes_moved(self) -> int:
        """Bytes moved by copies over all links."""
        return sum(self.moved.values())

    def as_dict(self) -> dict:
        """Fields and derived counts as plain data (for JSON)."""
        d = asdict(self)
        d["devices"] = list(self.devices)
        for key in ("slow_read", "slow_write", "bytes_moved"):
            d[key] = getattr(self, key)
        return d


@dataclass(frozen=True)
class Result:
    """Per-step results and the total of one evaluation."""

    steps: list
    total: StepResult

    @property
    def last(self) -> StepResult:
        """The last step (steady state); the total when there is no step."""
        return self.steps[-1] if self.steps else self.total

    @property
    def time(self) -> float:
        """Modelled seconds of the whole log."""
        return self.total.time

    def ratio(self, fast_only: float) -> float:
        """Modelled time over a fast-only time (e.g. ``fast_only_time(times)``)."""
        if not (_number(fast_only) and fast_only > 0):
            raise ValueError(f"fast_only={fast_only!r}: give a positive number of seconds, "
                             "e.g. fast_only_time(times)")
        return self.total.time / fast_only

    def as_dict(self) -> dict:
        """Steps and total as plain data (for JSON)."""
        return {"steps": [s.as_dict() for s in self.steps], "total": self.total.as_dict()}


def fast_only_time(times) -> float:
    """Modelled time with everything in fast memory: the compute times summed in order."""
    return sum((float(x) for x in times), 0.0)


class _Acc:
    """Mutable counters of one interval."""

    def __init__(self, devices, used, t):
        self.t0 = self.t1 = t
        self.compute = self.penalty = self.stall = 0.0
        self.moved, self.copies, self.kernels, self.faults = {}, {}, 0, 0
        self.kread, self.kwrite = dict.fromkeys(devices, 0), dict.fromkeys(devices, 0)
        self.peak = dict(used)

    def result(self, devices) -> StepResult:
        return StepResult(self.t1 - self.t0, self.compute, self.penalty, self.stall,
                          dict(sorted(self.moved.items())), dict(sorted(self.copies.items())),
                          dict(self.kread), dict(self.kwrite), dict(self.peak), self.kernels, devices,
                          self.faults)


class _Copy:
    __slots__ = ("start", "end", "lat", "dur", "n", "off", "link", "prev", "acc", "cancelled")

    def __init__(self, start, lat, dur, n, off, link, prev, acc):
        self.start, self.lat, self.dur, self.n, self.off, self.link = start, lat, dur, n, off, link
        self.end, self.prev, self.acc, self.cancelled = start + lat + dur, prev, acc, False


_ARITY = {"kernel": 3, "cache": 8, "alloc": 5, "free": 5, "copy": 8, "cancel": 4, "fault": 2, "step": 1,
          "layer": 1}


_SID_KINDS = ("alloc", "free", "copy", "cancel", "fault")


def _hashable(v):
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _kind(rec):
    return rec[0] if isinstance(rec, (tuple, list)) and rec and isinstance(rec[0], str) else None


def _bytes(v):
    """A byte count or offset: a finite number >= 0 that a float holds (not a bool)."""
    if not _number(v):
        return False
    try:
        return math.isfinite(float(v)) and v >= 0
    except OverflowError:               # an int beyond any float
        return False


def _short(v, n=120):
    """repr(v), cut to n characters for an error message."""
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def _overlap(a, m, b, n):
    return a < b + n and b < a + m


def _seconds_list(times):
    """times as floats: finite seconds >= 0, one per kernel."""
    if isinstance(times, (str, bytes, Mapping)) or not hasattr(times, "__iter__"):
        raise ValueError(f"times={times!r}: give a sequence of compute seconds, one per kernel")
    out = []
    for k, x in enumerate(times):
        try:
            v = float(x) if _number(x) else math.nan
        except OverflowError:
            v = math.nan
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"times[{k}]={x!r}: a kernel's compute time is a finite number of "
                             "seconds >= 0")
        out.append(v)
    return out


class _Model:
    def __init__(self, times, profiles, factor, fault_latency=0.0):
        self.times, self.F, self.t = _seconds_list(times), factor, 0.0
        self.fault_latency = fault_latency
        self.devices = tuple(profiles)
        self.fast = self.devices[0]
        self.R = {d: p.read_gbps * _GB for d, p in profiles.items()}
        self.W = {d: p.write_gbps * _GB for d, p in profiles.items()}
        self.lat = {d: p.latency for d, p in profiles.items()}
        self.link_free, self.last_on_link, self.last_copy = {}, {}, {}
        self.ready, self.dep, self.regions = {}, {}, {}   # (sid, dev) -> _Copy / [_Copy] / [(off, n)]
        self.sources = {d: [] for d in self.devices}      # dev -> in-flight copies reading from dev
        self.used = dict.fromkeys(self.devices, 0)
        self.total, self.cur = _Acc(self.devices, self.used, 0.0), _Acc(self.devices, self.used, 0.0)
        self.steps = []

    def _dev(self, rec, *devs):
        for d in devs:
            if not isinstance(d, str) or d not in self.R:
                raise ValueError(f"decision {rec!r} names device {d!r}; the tiers are {list(self.devices)}")

    def _add(self, **amounts):
        for a in (self.cur, self.total):
            for key, v in amounts.items():
                setattr(a, key, getattr(a, key) + v)

    def _prune(self, dev):
        self.sources[dev] = [c for c in self.sources[dev] if c.end > self.t]

    def _ready(self, sid, dev, deps=True):
        c = self.ready.get((sid, dev))
        w = c.end if c is not None else 0.0
        for c in self.dep.get((sid, dev), ()) if deps else ():
            w = max(w, c.end)
        return w

    def run(self, decisions) -> Result:
        if isinstance(decisions, (str, bytes, Mapping)) or not hasattr(decisions, "__iter__"):
            raise ValueError(f"decisions={decisions!r}: give a sequence of decision records")
        decisions = list(decisions)
        i = 0
        while i < len(decisions):
            rec, kind = decisions[i], _kind(decisions[i])
            if kind not in _ARITY:
                raise ValueError(f"decision {i}: unknown record {rec!r}; known kinds: {sorted(_ARITY)}")
            if len(rec) != _ARITY[kind]:
                raise ValueError(f"decision {i}: record {rec!r} should have {_ARITY[kind]} fields")
            if kind in _SID_KINDS and not _hashable(rec[1]):
                raise ValueError(f"decision {i}: record {_short(rec)} names its object by "
                                 f"{type(rec[1]).__name__}; give its id (a str)")
            cache = decisions[i + 1] if kind == "kernel" and i + 1 < len(decisions) else None
            if _kind(cache) != "cache":
                cache = None
            elif len(cache) != _ARITY["cache"]:
                raise ValueError(f"decision {i + 1}: record {cache!r} should have 8 fields")
            if kind == "kernel":
                self.kernel(rec, cache)
            elif kind == "cache":
                raise ValueError(f"decision {i}: {rec!r} does not directly follow its kernel record")
            elif kind == "step":
                self.cur.t1 = self.t
                self.steps.append(self.cur)
                self.cur = _Acc(self.devices, self.used, self.t)
            elif kind != "layer":
                handler = {"alloc": self.alloc, "free": self.free, "copy": self.copy, "cancel": self.cancel,
                           "fault": self.fault}
                handler[kind](rec)
            i += 1 if cache is None else 2
        if self.cur.kernels:
            self.cur.t1 = self.t
            self.steps.append(self.cur)
        self.total.t1 = self.t
        return Result([a.result(self.devices) for a in self.steps], self.total.result(self.devices))

    def _sizes(self, rec, *values):
        for v in values:
            if not _bytes(v):
                raise ValueError(f"decision {_short(rec)}: offsets and byte counts are finite "
                                 f"numbers >= 0, not {_short(v)}")

    def alloc(self, rec):
        _, sid, dev, off, n = rec
        self._dev(rec, dev)
        self._sizes(rec, off, n)
        off, n = int(off), int(n)
        self._prune(dev)
        self.dep[(sid, dev)] = [c for c in self.sources[dev] if _overlap(c.off, c.n, off, n)]
        self.regions.setdefault((sid, dev), []).append((off, n))
        self.used[dev] += n
        for a in (self.cur, self.total):
            a.peak[dev] = max(a.peak[dev], self.used[dev])

    def free(self, rec):
        _, sid, dev, off, n = rec
        self._dev(rec, dev)
        self._sizes(rec, off, n)
        regs = self.regions.get((sid, dev), [])
        if (int(off), int(n)) in regs:
            regs.remove((int(off), int(n)))
            self.used[dev] -= int(n)
        self.dep.pop((sid, dev), None)

    def copy(self, rec):
        _, sid, src, so, dst, do, n, wait = rec
        self._dev(rec, src, dst)
        self._sizes(rec, so, do, n)
        so, do, n, link, name = int(so), int(do), int(n), (src, dst), f"{src}->{dst}"
        self._prune(src)
        self._prune(dst)
        start = max(self.t, self.link_free.get(link, 0.0), self._ready(sid, src, deps=False))
        for c in self.sources[dst]:
            if _overlap(c.off, c.n, do, n):
                start = max(start, c.end)
        c = _Copy(start, max(self.lat[src], self.lat[dst]), n / min(self.R[src], self.W[dst]), n, so, link,
                  self.ready.get((sid, dst)), self.cur)
        self.link_free[link] = c.end
        self.last_on_link[link] = self.last_copy[(sid, src, dst)] = self.ready[(sid, dst)] = c
        self.sources[src].append(c)
        for a in (self.cur, self.total):
            a.moved[name] = a.moved.get(name, 0) + n
            a.copies[name] = a.copies.get(name, 0) + 1
        if wait:
            self._add(stall=max(0.0, c.end - self.t))
            self.t = max(self.t, c.end)

    def fault(self, rec):
        self.t += self.fault_latency
        self._add(stall=self.fault_latency, faults=1)

    def cancel(self, rec):
        _, sid, src, dst = rec
        c = self.last_copy.get((sid, src, dst))
        if c is None:
            raise ValueError(f"decision {rec!r} cancels a copy of {sid!r} on {src}->{dst} "
                             "that the log never issued")
        if c.cancelled or c.end <= self.t:
            return
        stop = max(self.t, c.start)
        done = min(1.0, max(0.0, (stop - c.start - c.lat) / c.dur)) if c.dur > 0 else 0.0
        c.end, c.cancelled = stop, True
        if self.ready.get((sid, dst)) is c:
            self.ready[(sid, dst)] = c.prev                # None: no copy into it any more
        if self.last_on_link.get(c.link) is c:
            self.link_free[c.link] = stop
        for a in (c.acc, self.total):
            a.moved[f"{src}->{dst}"] -= c.n - int(c.n * done)

    def kernel(self, rec, cache):
        _, k, ops = rec
        if isinstance(k, bool) or not (isinstance(k, numbers.Integral) and 0 <= k < len(self.times)):
            raise ValueError(f"decision {rec!r}: kernel index {k!r} is not in range(len(times)) = "
                             f"range({len(self.times)}); give times for every kernel of the log")
        form = "(sid, nbytes, device, is_write), nbytes a finite number >= 0"
        if isinstance(ops, (str, bytes, Mapping)) or not hasattr(ops, "__iter__"):
            raise ValueError(f"decision {_short(rec)}: its operands are a sequence of {form}")
        ops = [tuple(op) if isinstance(op, (tuple, list)) else (op,) for op in ops]
        for op in ops:
            if len(op) != 4 or not _bytes(op[1]) or not _hashable(op[0]):
                raise ValueError(f"decision {_short(rec)}: operand {_short(op)} should be {form}")
            self._dev(rec, op[2])
        w = max([self.t] + [self._ready(sid, dev) for sid, _, dev, _ in ops])
        if w > self.t:
            self._add(stall=w - self.t)
            self.t = w
        comp, fast, R, W = self.times[k], self.fast, self.R, self.W
        reads = writes = 0.0
        off_write, traffic = False, []                      # traffic: (device, read bytes, write bytes)
        if cache is None:
            for _, n, dev, is_write in ops:
                n = int(n)
                traffic.append((dev, 0, n) if is_write else (dev, n, 0))
                if dev != fast and is_write:
                    writes += n * (1 / W[dev] - 1 / W[fast])
                    off_write = True
                elif dev != fast:
                    reads += n * (1 / R[dev] - 1 / R[fast])
            P = max(reads + writes, (self.F - 1) * comp) if off_write else reads
        else:
            _, ck, rr, rw, dr, dw, sr, sw = cache
            if not all(_bytes(v) for v in cache[2:]):
                raise ValueError(f"decision {_short(cache)}: a cache record's byte counts are "
                                 "finite numbers >= 0")
            if ck != k or len(self.devices) < 2:
                raise ValueError(f"decisions {rec!r}, {cache!r}: a cache record follows its own kernel "
                                 "(same k) and needs a second tier (the cached slow memory)")
            s = self.devices[1]
            P = (dr / R[fast] + dw / W[fast] + sr / R[s] + sw / W[s]) - (rr / R[fast] + rw / W[fast])
            traffic = [(fast, int(dr), int(dw)), (s, int(sr), int(sw))]
        self.t += comp + P
        self._add(compute=comp, penalty=P, kernels=1)
        for a in (self.cur, self.total):
            for dev, r, wr in traffic:
                a.kread[dev] += r
                a.kwrite[dev] += wr


def evaluate(times, decisions, devices, profile=None, slow_output_factor=SLOW_OUTPUT_FACTOR,
             fault_latency=0.0) -> Result:
    """Modelled time of a decision log (rules in the module docstring). ``times[k]``: compute seconds of
    kernel k from a fast-only run; ``devices``: tier order, fast first; ``profile``: as tier_profiles;
    ``fault_latency``: seconds charged per on-demand fetch (a GPU's unified-memory fault: 45e-6)."""
    profiles = tier_profiles(devices, profile)
    f, fault_latency = check_options(slow_output_factor, fault_latency)
    return _Model(times, profiles, f, fault_latency).run(decisions)


def check_options(slow_output_factor, fault_latency):
    """(slow_output_factor, fault_latency) as floats; ValueError naming a bad one (callers
    that run a replay first check them before it, not after)."""
    f = slow_output_factor
    if not (_number(f) and math.isfinite(f) and f >= 1):
        raise ValueError(f"slow_output_factor={f!r}: give a finite number >= 1 (1 = no slowdown; "
                         f"default {SLOW_OUTPUT_FACTOR})")
    if not (_number(fault_latency) and math.isfinite(fault_latency) and fault_latency >= 0):
        raise ValueError(f"fault_latency={fault_latency!r}: give a finite number of seconds >= 0, "
                         "e.g. 45e-6 (0.0 charges nothing)")
    return float(f), float(fault_latency)
