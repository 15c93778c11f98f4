"""Capuchin (ASPLOS'20): swap and recompute objects, planned from a profiled step; and sqrt(n)
checkpointing (Chen et al. 2016), the recompute-only baseline it is compared with.

Capuchin assumes the GPU rule: a kernel's operands are in fast memory when it runs
(``kernels_in_fast``). The policy runs in two phases.

- *Passive mode* (the steps up to the profiled one): every new object goes to fast memory;
  operands that are not there are fetched on demand (kernels-in-fast staging), and room is made
  by evicting the least recently accessed objects ("from the start of the access list"). The
  kernel times the profile records exclude those fetches (``KernelClock``).
- *The plan* (Alg. 1 and 2), from the ``StepProfile``: the bytes that must be resident at kernel
  k are those of every object alive at k (heap blocks); the *peak window* is the kernels where
  they exceed ``capacity * (1 - margin)``. A candidate is an inactive interval of an object
  (evicted-access e, back-access b: consecutive kernels using it) that covers part of what is
  still over. Swap: ``SwapTime = bytes / bw + latency`` per direction (link bw = min(read of the
  source, write of the destination), from the tiers' cost-model profiles) and
  ``FT = (t_b - SwapTime_in) - (t_e + SwapTime_out)`` on the profiled kernel clock. Swaps whose
  FT >= 0 are taken first, longest FT first, while the curve does not fit; then each round
  compares the cheapest remaining swap's exposed time (-FT) with the recompute of the largest
  MSPS (bytes saved / recompute seconds; after a recompute is chosen, the candidates it was a
  source of inherit its sources and its time, Alg. 2) and keeps the cheaper. Only objects
  written once in the step, by a pure kernel (``Trace.pure``), whose inputs are alive and
  unchanged at b, are recompute candidates.
- *Running the plan*: after kernel e, a swap-out ``send(wait=False)`` (decoupled: nothing waits
  for it unless its memory is needed) or ``m.drop`` for a recompute (a swap when the manager
  says it cannot be regenerated); before the in-trigger kernel, ``bring(wait=False,
  force=True)``. In-triggers are placed walking back from b to the first kernel that starts at
  least SwapTime before b, out of the peak window when the curve allows it; swap-ins queue on
  the link (one direction at a time, in trigger order). Recomputation is on demand at b (the
  manager regenerates a dropped operand).
- *Feedback*: at every step mark after the plan, the policy's own timeline of the step
  (profiled kernel times, swaps serialized per link direction, waits) finds the swap-ins that
  arrive after their back-access begins; each moves its in-trigger 5% of its swap time
  earlier (one round per step: the plan converges over steps). The timeline is the
  profile's, so a real run and its replay make the same moves.

What differs, and why. Candidates and the target saving come from the curve, not from the bytes
passive mode evicted (reported as ``info["passive_evicted"]``); an object may be swapped in
more than one of its intervals, and a swap a later choice made unnecessary (the plan fits
without it) is left out. The plan is cyclic: an object made before the step and kept after it
(a weight) has one more interval, from its last use in the step to its first use in the next,
its saving counted at the end of the step and at the start of the next; its in-trigger fires
late in the step or early in the next (the first step fetches it if it is not there). Swaps
that hide one by one can still queue on the link and arrive late: after Alg. 1, a swap the
plan's own timeline finds late by more than its recomputation costs becomes a recompute (one at
a time, most bytes per second first, the link timed again after each). An
object the program keeps after its last use (freed later, in the step or the next; TensorFlow
would have freed it) is a candidate too: sent out after its last use, never brought back.
"""

import math
from bisect import bisect_right

import numpy as np

from ..errors import OutOfMemoryError
from ..registry import register_policy
from ..sizes import format_size
from .base import Policy
from .planned import PlannedPolicy

__all__ = ["Capuchin", "SwapOnly", "Checkpointing", "plan_capuchin", "plan_checkpoints",
           "FEEDBACK"]

FEEDBACK = 0.05                   # an in-trigger found late moves this much of its swap earlier
_GB = 1e9


def _fraction(v, what, hi=1.0):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < hi or \
            not math.isfinite(v):
        raise ValueError(f"{what}={v!r}: give a fraction of fast memory in [0, {hi}), "
                         f"e.g. {what}=0.05")
    return float(v)


def _flag(v, what):
    if not isinstance(v, bool):
        raise ValueError(f"{what}={v!r}: give True or False")
    return v


class _Link:
    """One direction of the link between fast and slow memory: bytes/s and latency."""

    def __init__(self, src, dst):
        self.bw = min(src.read_gbps, dst.write_gbps) * _GB
        self.lat = max(src.latency, dst.latency)

    def time(self, nbytes):
        return self.lat + nbytes / self.bw


class _Profiled:
    """The profiled step as Capuchin sees it: clock, block sizes, the resident-bytes curve,
    the kernels using and writing each object, and which kernels are pure."""

    def __init__(self, step, block, pure=()):
        self.step = step
        n = self.n = len(step)
        self.times = np.asarray(step.times, dtype=float)
        self.end = np.cumsum(self.times)
        self.start = self.end - self.times
        self.start_list = self.start.tolist()
        self.total = float(self.end[-1]) if n else 0.0
        # kernel k + n is kernel k of the next step: the plan is cyclic
        self.start2 = self.start_list + [t + self.total for t in self.start_list]
        self.size = {s: int(block(nb)) for s, nb in step.objects.items()}
        self.pure = {k for k, kid in enumerate(step.kernel_ids) if kid in set(pure)}
        self.used, self.writers = {}, {}
        for s, uses in step.uses.items():
            self.used[s] = sorted({k for k, _ in uses})
            self.writers[s] = sorted({k for k, w in uses if w})
        delta = np.zeros(n + 1, dtype=np.int64)
        for s, nb in self.size.items():
            a, f = step.lifetime(s)
            if a < f:
                delta[min(a, n)] += nb
                delta[min(f, n)] -= nb
        self.curve = np.cumsum(delta[:n])

    def persistent(self, sid):
        """Made before the step and alive after it (weights, optimizer state)."""
        return sid not in self.step.alloc_at and sid not in self.step.free_at

    def alive(self, sid, k):
        a, f = self.step.lifetime(sid)
        return a <= k < f

    def chain(self, sid, e):
        """The kernels that made sid's data as of kernel e (its writes up to e: the first
        overwrites it, the others update it in place), if sid is made in the step and every one
        of them is pure; else None."""
        ws = [k for k in self.writers.get(sid, ()) if k <= e]
        if sid not in self.step.alloc_at or not ws or any(k not in self.pure for k in ws) or \
                sid in self.step.kernels[ws[0]][1]:
            return None
        return ws

    def sources(self, sid, e, b):
        """(inputs, seconds) to rebuild sid, dropped after kernel e, before kernel b: the inputs
        of its chain and the chain's kernel times; None when it cannot be rebuilt there (not
        made by pure kernels, or an input freed or written since: the lineage would refuse)."""
        ws = self.chain(sid, e)
        if ws is None:
            return None
        srcs = set()
        for w in ws:
            _, reads, writes = self.step.kernels[w]
            for y in reads:
                if y == sid:
                    continue
                if y in writes or not self.alive(y, b) or \
                        any(w < k < b for k in self.writers.get(y, ())):
                    return None
                srcs.add(y)
        return srcs, float(self.times[ws].sum())


class _Swap:
    """A swap of sid after kernel e, back before kernel b; b >= n (the step's kernels) is
    kernel b - n of the next step (a persistent object's last use to its first)."""

    __slots__ = ("sid", "size", "e", "b", "out", "into", "ft", "lead", "trigger", "ideal",
                 "cover", "dead", "late_by")

    def __init__(self, sid, size, e, b, out, into, ft):
        self.sid, self.size, self.e, self.b = sid, size, e, b
        self.out, self.into, self.ft = out, into, ft
        self.lead = 0.0               # seconds the feedback moved the in-trigger earlier
        self.trigger = self.ideal = b
        self.cover = 0                # earliest trigger: the peak kernels it was chosen for
        self.dead = False             # no back-access: used last at e, freed before kernel b
        self.late_by = 0.0            # seconds its swap-in arrives after its back-access begins


class _Recompute:
    __slots__ = ("sid", "size", "e", "b", "srcs", "rp", "ext")

    def __init__(self, sid, size, e, b, srcs, rp):
        self.sid, self.size, self.e, self.b = sid, size, e, b
        self.srcs, self.rp, self.ext = set(srcs), rp, 0.0

    def cost(self):
        return self.rp + self.ext

    def msps(self):
        c = self.cost()
        return self.size / c if c > 0 else math.inf

    def dropped_at(self, k):
        """Is this object dropped when kernel k begins?"""
        return self.e < k <= self.b


class CapuchinPlan:
    """Alg. 1 and 2 over a profiled step: the swaps (with in-triggers) and recomputes chosen.

    step: a StepProfile; capacity: fast bytes; block: bytes -> heap block bytes; fast, slow:
    the tiers' cost-model Profiles; pure: trace kernel indices of pure kernels.
    """

    def __init__(self, step, capacity, block, fast, slow, margin=0.0, recompute=True,
                 pure=()):
        self.p = p = _Profiled(step, block, pure)
        self.capacity = int(capacity)
        self.limit = capacity * (1.0 - margin)
        self.out_link, self.in_link = _Link(fast, slow), _Link(slow, fast)
        self.recompute = recompute
        self.peak = p.curve > self.limit
        self.peak2 = np.concatenate((self.peak, self.peak))     # this step and the next
        idx = np.where(self.peak2, -1, np.arange(2 * p.n))
        self.calm = np.maximum.accumulate(idx).tolist() if p.n else []  # last k' <= k not over
        self.swaps, self.recomputes = [], []
        self.traded = 0               # late swaps made recomputes (``_trade``)
        self._candidates()
        self._select()
        self.rounds = 0

    # -- candidates -------------------------------------------------------------------------

    def _candidates(self):
        p = self.p
        over = np.concatenate(([0], np.cumsum(self.peak2)))
        self.swap_cands, self.rec_cands = [], []
        for sid, ks in p.used.items():
            pairs = list(zip(ks, ks[1:]))
            if ks and p.persistent(sid):
                pairs.append((ks[-1], ks[0] + p.n))     # across the step mark
            for e, b in pairs:
                if b - e < 2 or over[b] - over[e + 1] == 0:
                    continue                  # no kernel between, or none of them over
                nb = p.size[sid]
                out, into = self.out_link.time(nb), self.in_link.time(nb)
                ft = (p.start2[b] - into) - (float(p.end[e]) + out)
                s = _Swap(sid, nb, e, b, out, into, ft)
                s.ideal = self._latest(s, p.start2[b])
                self.swap_cands.append(s)
                if self.recompute and b < p.n:
                    src = p.sources(sid, e, b)
                    if src is not None:
                        self.rec_cands.append(_Recompute(sid, nb, e, b, *src))
            last = ks[-1] if ks else None
            f = p.step.free_at.get(sid, p.n if sid in p.step.alloc_at else None)
            if last is not None and f is not None and f - last >= 2 and \
                    over[f] - over[last + 1] > 0:
                # used for the last time, freed later by the program (made in the step: in
                # this step or the next): sent out, never back
                nb = p.size[sid]
                s = _Swap(sid, nb, last, f, self.out_link.time(nb), 0.0, math.inf)
                s.ideal = s.trigger = s.cover = f
                s.dead = True
                self.swap_cands.append(s)
        self.swap_cands.sort(key=lambda s: (-s.ft, s.b, s.sid))

    def _latest(self, s, before):
        """The in-trigger of s: the latest kernel in (e, b] starting at least its swap-in time
        (and its feedback lead) before `before`; e + 1 when none does."""
        j = bisect_right(self.p.start2, before - s.into - s.lead) - 1
        return max(s.e + 1, min(j, s.b))

    # -- the resident curve -----------------------------------------------------------------

    def curve(self):
        """Bytes resident at each kernel under the plan (swap-ins count from their trigger; a
        swap across the step mark saves at the end of the step and the start of the next)."""
        n = self.p.n
        delta = np.zeros(2 * n + 1, dtype=np.int64)
        for s in self.swaps:
            if s.trigger > s.e + 1:
                delta[s.e + 1] -= s.size
                delta[s.trigger] += s.size
        for r in self.recomputes:
            delta[r.e + 1] -= r.size
            delta[r.b] += r.size
        saved = np.cumsum(delta[:2 * n])
        return self.p.curve + saved[:n] + saved[n:]

    def fits(self):
        return not bool((self.curve() > self.limit).any())

    # -- Alg. 1 and 2 -----------------------------------------------------------------------

    def _select(self):
        self._choose()
        if self.swaps and self.fits():
            self._prune()
        self._trade()

    def _trade(self):
        """Swaps that hide one by one (FT >= 0) can still arrive late, queued on the link
        behind others. Each round, of the swaps the plan's timeline finds late by more than
        their recomputation costs, the one recomputing the most bytes per second becomes a
        recompute (Alg. 2 as for any chosen recompute); the link is then timed again."""
        if not self.recompute or not self.rec_cands:
            return
        cands = {(r.sid, r.e, r.b): r for r in self.rec_cands}
        for _ in range(len(self.swaps)):
            trade = [(cands[(s.sid, s.e, s.b)], s) for s in self.timeline()[3]
                     if (s.sid, s.e, s.b) in cands and
                     s.late_by > cands[(s.sid, s.e, s.b)].cost()]
            if not trade:
                return
            r, s = max(trade, key=lambda c: (c[0].msps(), -c[0].b, c[0].sid))
            self.swaps.remove(s)
            self.rec_cands.remove(r)
            del cands[(r.sid, r.e, r.b)]
            self._choose_recompute(r)
            self.traded += 1
            self.place()

    def _prune(self):
        """Swaps a later choice made unnecessary (the plan fits without them) are left out,
        the last chosen first."""
        n = self.p.n
        cur = np.tile(self.curve(), 2)
        for s in reversed(list(self.swaps)):
            segs = self._spans(s.e + 1, s.trigger)
            if all(int(cur[x:y].max()) + s.size <= self.limit for x, y in segs):
                self.swaps.remove(s)
                for x, y in segs:
                    cur[x:y] += s.size
        self.place()

    def _spans(self, lo, hi):
        """Kernels lo..hi-1 (hi up to 2n) on the curve of two steps: [(x, y)] slices."""
        n = self.p.n
        out = []
        for off in (-n, 0, n):
            x, y = max(lo + off, 0), min(hi + off, 2 * n)
            if x < y:
                out.append((x, y))
        return out

    def _choose(self):
        chosen = set()
        while True:
            over = self.curve() > self.limit
            if not over.any():
                return
            over = np.concatenate((over, over))
            cum = np.concatenate(([0], np.cumsum(over))).tolist()

            def helps(lo, hi):
                return hi > lo and cum[hi] - cum[lo] > 0

            swap = next((s for s in self.swap_cands
                         if (s.sid, s.e) not in chosen and helps(s.e + 1, s.ideal)), None)
            if swap is not None and swap.ft >= 0:
                pick, cover = swap, 0
            else:
                swap, cover, cost = self._cheapest_swap(chosen, over, helps)
                rec = None
                for r in self.rec_cands:
                    if (r.sid, r.e) not in chosen and helps(r.e + 1, r.b) and \
                            (rec is None or (r.msps(), -r.b) > (rec.msps(), -rec.b)):
                        rec = r
                if swap is None and rec is None:
                    return
                pick = swap if rec is None or swap is not None and cost <= rec.cost() else rec
            if pick is swap:
                pick.cover = cover
            chosen.add((pick.sid, pick.e))
            if isinstance(pick, _Swap):
                self.swaps.append(pick)
                self._place(pick, np.tile(self.curve(), 2))
            else:
                self._choose_recompute(pick)

    def _cheapest_swap(self, chosen, over, helps):
        """(swap, cover, exposed seconds) of the cheapest swap that relieves a kernel still
        over: with its in-trigger by free time when that relieves one (exposed -FT), else
        with its in-trigger after the last such kernel of its interval (cover)."""
        p = self.p
        last = np.where(over, np.arange(2 * p.n), -1)
        last = np.maximum.accumulate(last).tolist()     # last over kernel <= k
        best = (None, 0, math.inf)
        for s in self.swap_cands:
            if (s.sid, s.e) in chosen:
                continue
            if helps(s.e + 1, s.ideal):
                cost, cover = max(0.0, -s.ft), 0
            else:
                lo = last[s.b - 1]
                if lo <= s.e:
                    continue
                cover = lo + 1
                start = max(p.start2[cover], float(p.end[s.e]) + s.out)
                cost = max(0.0, start + s.into - p.start2[s.b])
            if cost < best[2]:
                best = (s, cover, cost)
        return best

    def _choose_recompute(self, t):
        """Alg. 2: t is recomputed; recomputes and candidates that used t as a source while it
        is dropped now start from t's sources and redo t's kernel."""
        for r in (*self.recomputes, *self.rec_cands):
            if r is not t and t.sid in r.srcs and t.dropped_at(r.b):
                r.srcs.discard(t.sid)
                r.srcs |= t.srcs
                r.rp += t.rp
        self.recomputes.append(t)
        for c in self.rec_cands:          # a source of chosen recomputes: they would redo it
            c.ext = c.rp * sum(1 for r in self.recomputes
                               if c.sid in r.srcs and c.dropped_at(r.b))

    def place(self):
        """In-triggers: walking back from b, the first kernel that starts at least SwapTime
        (plus the feedback's lead) before b; one in the peak window moves to the kernel before
        the window when the plan's curve has room for the object there; one that would put a
        kernel before b over the limit moves after the last such kernel (at b: on demand, its
        swap-in exposed). Swap-ins then queue on
        the link in trigger order (``timeline``): a late one is the feedback's to move."""
        cur = np.tile(self.curve(), 2)
        for s in self.swaps:
            self._place(s, cur)

    def _place(self, s, cur):
        """Place s's in-trigger on cur (the plan's curve over two steps; updated)."""
        if s.dead:
            return
        peak = self.peak2
        j = self._latest(s, self.p.start2[s.b])
        if j < s.cover:
            j = s.cover
        elif peak[j]:
            i = max(self.calm[j], s.e + 1, s.cover)
            if not peak[i] and i < j and int(cur[i:j].max()) + s.size <= self.limit:
                j = i
        if j < s.b:                   # no kernel before b goes over the limit because of it
            seg = cur[j:s.b].copy()
            seg[max(s.trigger - j, 0):] -= s.size         # counted from its last trigger
            over = np.nonzero(seg + s.size > self.limit)[0]
            if len(over):
                j = j + int(over[-1]) + 1
        if j != s.trigger:            # the curve the next swaps are placed on
            for x, y in self._spans(*sorted((j, s.trigger))):
                cur[x:y] += s.size if j < s.trigger else -s.size
        s.trigger = j

    # -- the policy's own timeline ----------------------------------------------------------

    def timeline(self):
        """(step seconds, stall, recompute seconds, late swaps) of the plan on the profiled
        clock, in the steady state (two steps are run; the figures are the second's): swap-outs
        run after their evicted-access, one at a time, and the first kernel that needs a
        swapped object's room waits for its swap-out (decoupled swapping); swap-ins start at
        their trigger once the link and the object's swap-out are done; a back-access waits
        for its swap-in and redoes a recompute's kernels."""
        p = self.p
        n = p.n
        trig, back, outs, recs, need = {}, {}, {}, {}, {}
        cur = np.tile(self.curve(), 2)

        def at(where, k, s, key):
            if 0 <= k < 2 * n:
                where.setdefault(k, []).append((s, key))

        for s in sorted(self.swaps, key=lambda s: (s.b, s.sid)):
            seg = np.nonzero(cur[s.e + 1:s.trigger] + s.size > self.limit)[0]
            for off in (-n, 0, n):    # the swap of the step before, this step's, the next's
                key = (s.sid, s.e + off)
                at(outs, s.e + off, s, key)
                if len(seg):          # the kernel that needs its room waits for its swap-out
                    at(need, s.e + 1 + int(seg[0]) + off, s, key)
                if not s.dead:
                    at(trig, s.trigger + off, s, key)
                    at(back, s.b + off, s, key)
        for r in self.recomputes:
            for off in (0, n):
                recs.setdefault(r.b + off, []).append(r)
        t = in_free = out_free = stall = rtime = 0.0
        done, arrive, late = {}, {}, []
        first = (0.0, 0.0, 0.0)
        for k in range(2 * n):
            if k == n:
                first = (t, stall, rtime)
            w = max([t] + [done.get(key, 0.0) for _, key in need.get(k, ())])
            stall += w - t
            t = w
            for s, key in trig.get(k, ()):
                arrive[key] = max(t, in_free, done.get(key, 0.0)) + s.into
                in_free = arrive[key]
            w = t
            for s, key in back.get(k, ()):
                if arrive.get(key, 0.0) > t:
                    if k >= n:
                        s.late_by = arrive[key] - t
                        late.append(s)
                    w = max(w, arrive[key])
            stall += w - t
            t = w
            for r in recs.get(k, ()):
                t += r.rp
                rtime += r.rp
            t += float(p.times[k % n])
            for s, key in outs.get(k, ()):
                done[key] = out_free = max(t, out_free) + s.out
        if n == 0:
            return 0.0, 0.0, 0.0, late
        return t - first[0], stall - first[1], rtime - first[2], late

    def feedback(self):
        """One round: every late swap-in's trigger moves FEEDBACK of its swap time earlier.
        Returns (late sids, sids whose trigger kernel changed)."""
        _, _, _, late = self.timeline()
        before = {(s.sid, s.e): s.trigger for s in self.swaps}
        for s in late:
            s.lead += FEEDBACK * s.into
        self.place()
        self.rounds += 1
        moved = [s.sid for s in self.swaps if s.trigger != before[(s.sid, s.e)]]
        return [s.sid for s in late], moved

    def facts(self):
        t, stall, rtime, late = self.timeline()
        cur = self.curve()
        return {"fast": self.capacity, "limit": int(self.limit),
                "peak": int(self.p.curve.max(initial=0)),
                "peak_planned": int(cur.max(initial=0)),
                "peak_window": int(self.peak.sum()), "fits": self.fits(),
                "swaps": sum(1 for s in self.swaps if not s.dead),
                "swap_bytes": sum(s.size for s in self.swaps if not s.dead),
                "dead_sent": sum(1 for s in self.swaps if s.dead),
                "dead_bytes": sum(s.size for s in self.swaps if s.dead),
                "recomputes": len(self.recomputes), "traded": self.traded,
                "recompute_bytes": sum(r.size for r in self.recomputes),
                "exposed": stall + rtime, "stall": stall, "recompute_seconds": rtime,
                "late": len(late), "compute": float(self.p.times.sum())}


def plan_capuchin(step, capacity, block, fast, slow, margin=0.0, recompute=True, pure=None):
    """A CapuchinPlan of a StepProfile (pure: the trace's pure kernels, default Trace.pure)."""
    if pure is None:
        pure = getattr(step.trace, "pure", None) or ()
    return CapuchinPlan(step, capacity, block, fast, slow, margin, recompute, pure)


# ---- the policies ---------------------------------------------------------------------------

class _Managed(PlannedPolicy):
    """Shared by Capuchin and Checkpointing: kernels-in-fast, the current kernel's operands
    never victims, actions installed per point."""

    kernels_in_fast = True
    tracks_reads = False

    def __init__(self, profile=None, profile_step=1):
        super().__init__(profile, profile_step)
        self.actions = {}
        self._current = frozenset()

    def stage(self, reads, writes, name="kernel"):
        """Kernels-in-fast staging; when the operands already in fast memory split its free
        space so that a missing one finds no room, they are moved out and every operand is
        staged again (faults: the cost of the fragmentation)."""
        self._current = frozenset(o.id for o in (*reads, *writes))
        try:
            return super().stage(reads, writes, name)
        except OutOfMemoryError:
            m = self.manager
            objs = list({id(o): o for o in (*reads, *writes)}.values())
            there = [o for o in objs if o.primary is not None and
                     o.primary.device is m.fast and not m.pinned(o)]
            if sum(m.fast.block_size(o.nbytes) for o in objs) > m.fast.size or not there or \
                    len(there) == len(objs):
                raise
            for o in there:
                Policy.evict(self, o)
            self._count("restaged")
            return super().stage(reads, writes, name)

    def read_use(self, obj):
        self._current = frozenset()   # the kernel's operands are being pinned
        self.accessed(obj)

    def write_use(self, obj):
        super().write_use(obj)
        self._current = frozenset()
        self.accessed(obj)

    def accessed(self, obj):
        """A kernel uses obj."""

    def evictable(self, obj):
        return obj.id not in self._current

    def _install_actions(self, actions):
        """actions: [(point, op, sid)] -> one trigger per point, ops in the order given."""
        self.plan.clear()
        by_point = {}
        for point, op, sid in actions:
            by_point.setdefault(point, []).append((op, sid))
        self.actions = {pt: tuple(ops) for pt, ops in by_point.items()}
        for pt, ops in self.actions.items():
            self.schedule(pt, lambda m, pt=pt, ops=ops: self._act(m, pt, ops))

    def _act(self, m, point, ops):
        """Run a point's ops; before a kernel, its operands (by the profile) are no victims."""
        step = self.step
        if point[0] == "kernel" and step is not None and point[1] < len(step):
            live = (self.live(sid) for sid in step.operands(point[1]))
            self._current = frozenset(o.id for o in live if o is not None)
        self._run(m, ops)

    def _count(self, key, n=1):
        self.info[key] = self.info.get(key, 0) + n

    def _drop(self, m, sid):
        """Drop sid if the manager can regenerate it; else False."""
        obj = self.live(sid)
        if obj is None or obj.freed or obj.primary is None:
            return True
        if m.pinned(obj) or not hasattr(m, "drop"):
            return False
        if not m.regenerable(obj):
            return False
        m.drop(obj)
        return True


class Capuchin(_Managed):
    """Capuchin's swap + recompute plan (see the module docstring).

    recompute: False plans swaps only; margin: fraction of fast memory the plan keeps free;
    feedback: move late in-triggers earlier at every step mark; profile, profile_step: as
    PlannedPolicy.
    """

    name = "capuchin"

    def __init__(self, recompute=True, margin=0.0, feedback=True, profile=None,
                 profile_step=1):
        super().__init__(profile, profile_step)
        self.recompute = _flag(recompute, "recompute")
        self.margin = _fraction(margin, "margin")
        self.feedback = _flag(feedback, "feedback")
        self.result = None            # the CapuchinPlan
        self._tick = 0
        self._last = {}               # object id -> tick of its last access (passive mode)
        self.info = {"passive_evicted": 0}

    # -- passive mode -----------------------------------------------------------------------

    def _touch(self, obj):
        self._tick += 1
        self._last[obj.id] = self._tick

    def accessed(self, obj):
        if not self.planned:
            self._touch(obj)

    def forget(self, obj_id):
        self._last.pop(obj_id, None)

    def evict(self, obj, to=None, wait=True):
        m = self.manager
        size = obj.primary.nbytes if obj.primary is not None and \
            obj.primary.device is m.fast else 0
        done = super().evict(obj, to, wait)
        if done and not self.planned:
            self.info["passive_evicted"] += size
        return done

    def unplanned(self, nbytes, placement=None):
        """Every new object goes to fast memory (evicting to make room), slow if it cannot."""
        obj = self.alloc_fast(nbytes, force=True)
        return obj if obj is not None else self.alloc_slow(nbytes)

    def select_victims(self, nbytes):
        """Before the plan: least recently accessed first; after: the plan's Belady order.
        Never the operands of the kernel being staged or started."""
        if self.planned:
            objs = super().select_victims(nbytes)
        else:
            m = self.manager
            objs = [m.parent(r) for r in m.regions_on("fast")]
            objs = [o for o in objs if o is not None and not o.freed]
            last = self._last.get
            objs.sort(key=lambda o: (last(o.id, 0), o.id))
        cur = self._current
        return [o for o in objs if o.id not in cur]

    # -- the plan ---------------------------------------------------------------------------

    def make_plan(self, step):
        m = self.manager
        self.result = plan_capuchin(step, m.fast.capacity, m.fast.block_size,
                                    self.device_profile(m.fast), self.device_profile("slow"),
                                    self.margin, self.recompute)
        self.info.update(self.result.facts())
        self.info["feedback_moves"] = []
        self._schedule_plan()

    def _schedule_plan(self):
        plan = self.result
        acts = []
        n = plan.p.n                  # kernel k >= n: kernel k - n of the next step
        for s in plan.swaps:
            acts.append((("kernel_end", s.e), "send", s.sid))
            if s.e + 1 < s.trigger:
                acts.append((("kernel", (s.e + 1) % n), "send", s.sid))  # if it was pinned
            if not s.dead:
                acts.append((("kernel", s.trigger % n), "bring", s.sid))
        for r in plan.recomputes:
            acts.append((("kernel_end", r.e), "drop", r.sid))
            if r.e + 1 < r.b:
                acts.append((("kernel", r.e + 1), "drop", r.sid))
        acts.sort(key=lambda a: (a[0][1], a[0][0] == "kernel", a[1] == "bring", a[2]))
        self._install_actions(acts)

    def on_step(self):
        was = self.planned
        super().on_step()
        if was and self.feedback and self.result is not None and self.result.swaps:
            late, moved = self.result.feedback()
            self.info["feedback_moves"].append({"round": self.result.rounds,
                                                "late": len(late), "moved": moved})
            if moved:
                self._schedule_plan()
            self.info.update(self.result.facts())

    # -- running the plan -------------------------------------------------------------------

    def _run(self, m, ops):
        for op, sid in ops:
            if op == "bring":
                obj = self.live(sid)
                if obj is not None and obj.primary is not None and \
                        not self.bring(sid, wait=False, force=True):
                    self._count("prefetch_refused")
            elif op == "send":
                self.send(sid, wait=False)
            elif not self._drop(m, sid):
                obj = self.live(sid)
                if obj is not None and obj.primary is not None and not m.pinned(obj):
                    self._count("recompute_fallback")
                    self.send(sid, wait=False)


class SwapOnly(Capuchin):
    """Capuchin with recomputation off: the swap-only plan."""

    name = "swap-only"

    def __init__(self, margin=0.0, feedback=True, profile=None, profile_step=1,
                 recompute=False):
        if recompute is not False:
            raise ValueError(f"recompute={recompute!r}: the swap-only policy never "
                             "recomputes; use policy 'capuchin' to recompute")
        super().__init__(False, margin, feedback, profile, profile_step)


# ---- sqrt(n) checkpointing --------------------------------------------------------------------

def plan_checkpoints(step, pure=None):
    """sqrt(n) checkpointing of a StepProfile: (drops, facts). The forward activations are the
    objects made in the step by one pure kernel, used at or before the step's memory peak (the
    forward/backward turnaround) and again after it; in forward order, every
    round(sqrt(n))-th is a checkpoint and the others are dropped after their last use before
    the peak. drops: [(kernel e, sid, back-access b)]."""
    if pure is None:
        pure = getattr(step.trace, "pure", None) or ()
    p = _Profiled(step, lambda nb: nb, pure)
    n = p.n
    turn = int(np.argmax(p.curve)) if n else 0
    acts = []
    for sid, ks in p.used.items():
        chain = p.chain(sid, turn)
        if chain is None:
            continue
        w = chain[0]
        i = bisect_right(ks, turn) - 1
        if i < 0 or i + 1 >= len(ks) or ks[i + 1] - ks[i] < 2:
            continue
        e, b = ks[i], ks[i + 1]
        if p.sources(sid, e, b) is None:
            continue
        acts.append((w, sid, e, b))
    acts.sort()
    every = max(1, round(math.sqrt(len(acts)))) if acts else 1
    keep = {a[1] for i, a in enumerate(acts) if i % every == every - 1}
    drops = [(e, sid, b) for _, sid, e, b in acts if sid not in keep]
    facts = {"activations": len(acts), "every": every, "checkpoints": len(keep),
             "dropped": len(drops), "dropped_bytes": sum(step.objects[s] for _, s, _ in drops),
             "turnaround": turn, "peak": int(p.curve.max(initial=0))}
    return drops, facts


class Checkpointing(_Managed):
    """sqrt(n) checkpointing: drop the forward activations between checkpoints after their last
    forward use; the manager regenerates them on demand. Nothing is swapped: every object lives
    in fast memory (OutOfMemoryError when it cannot). Give the program's profile (profile=) to
    plan before the first step; otherwise steps up to profile_step run unmanaged."""

    name = "checkpoint"

    def __init__(self, profile=None, profile_step=1):
        super().__init__(profile, profile_step)
        self.drops = []

    def make_plan(self, step):
        self.drops, facts = plan_checkpoints(step)
        self.info.update(facts)
        acts = []
        for e, sid, b in self.drops:
            acts.append((("kernel_end", e), "drop", sid))
            if e + 1 < b:
                acts.append((("kernel", e + 1), "drop", sid))
        self._install_actions(acts)

    def unplanned(self, nbytes, placement=None):
        m = self.manager
        obj = self.alloc_fast(nbytes)
        if obj is None:
            free = m.fast.stats()["free"]
            raise OutOfMemoryError(
                f"checkpointing keeps every array in fast memory and {format_size(nbytes)} "
                f"does not fit ({format_size(free)} free of {format_size(m.fast.size)}); "
                "give a larger fast= size or a smaller batch")
        return obj

    def allocate_as(self, where, nbytes):
        return self.unplanned(nbytes)

    def select_victims(self, nbytes):
        return []                     # no swapping

    def make_room(self, nbytes, wait=True):
        """No swapping: room comes only from dropping activations of the plan that are not in
        use, furthest next use first."""
        m = self.manager
        fast = m.fast
        if m.can_allocate(fast, nbytes) or self.step is None:
            return m.can_allocate(fast, nbytes)
        k = self.kernel_index()
        nxt = self.step.next_use
        objs = [(nxt(sid, k + 1), sid) for _, sid, _ in self.drops]
        objs.sort(key=lambda x: (-math.inf if x[0] is None else -x[0], x[1]))
        for _, sid in objs:
            obj = self.live(sid)
            if obj is None or obj.primary is None or obj.primary.device is not fast or \
                    obj.id in self._current or m.pinned(obj) or not m.regenerable(obj):
                continue
            m.drop(obj)
            if m.can_allocate(fast, nbytes):
                return True
        return m.can_allocate(fast, nbytes)

    def _run(self, m, ops):
        for _, sid in ops:
            obj = self.live(sid)
            if obj is not None and obj.primary is not None and not self._drop(m, sid) and \
                    not m.pinned(obj):
                self._count("kept")   # the manager cannot regenerate it: it stays


register_policy(Capuchin.name, Capuchin)
register_policy(SwapOnly.name, SwapOnly)
register_policy(Checkpointing.name, Checkpointing)
