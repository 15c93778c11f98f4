"""Debug mode: poison the memory objects leave behind and report writes into it.

With ``Manager(debug=True)`` (or ``CACHEDARRAYS_DEBUG=1``) every region that is freed, or left
behind when its object moves, is filled with a poison byte and remembered with its former owner.
Only a stale pointer writes there afterwards, typically an ndarray made inside a ``ca.writable``
or ``ca.access`` scope from its view and used after the scope ended (the scope's own views
refuse writes by then). Such writes are found when the
memory is handed out again and by ``Manager.check()``.
"""

import bisect
import logging
import os
from collections import namedtuple

import numpy as np

from .heap import HEADER
from .sizes import format_size

log = logging.getLogger("cachedarrays.debug")

ENV = "CACHEDARRAYS_DEBUG"
POISON = 0xDB
"""The byte written over vacated memory (as float64: about -3.2e134, not a common value)."""


_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def enabled(flag=None):
    """Debug mode on? An explicit flag (a bool, 0 or 1) wins; None reads CACHEDARRAYS_DEBUG
    (1/true/yes/on, or 0/false/no/off/empty). Anything else is refused, not guessed."""
    if flag is None:
        value = os.environ.get(ENV, "")
        word = value.strip().lower()
        if word not in _ON + _OFF:
            raise ValueError(f"{ENV}={value!r} is neither on nor off: set it to 1, true, yes or "
                             "on for debug mode, or 0, false, no, off or nothing")
        return word in _ON
    if isinstance(flag, (bool, np.bool_)) or (type(flag) is int and flag in (0, 1)):
        return bool(flag)
    raise TypeError(f"debug must be True, False or None (read {ENV}), not "
                    f"{type(flag).__name__} {flag!r}")


Vacated = namedtuple("Vacated", "start end owner nbytes why")
Vacated.__doc__ = "A poisoned range [start, end) of a device, left by object owner (nbytes)."


class StaleWrite(namedtuple("StaleWrite", "device owner nbytes why start changed first")):
    """A write found in vacated memory: which object left it, how many bytes changed, where."""

    __slots__ = ()

    def __str__(self):
        return (f"object {self.owner} ({format_size(self.nbytes)}) {self.why}, but {self.changed} "
                f"byte(s) of the {self.device!r} memory it left (offset {self.start}) were "
                f"written afterwards, first at offset {self.first}")


def _end(rec):
    return rec.end


class Poison:
    """Poisoned ranges per device, sorted and disjoint; each is checked once, then forgotten."""

    def __init__(self):
        self._recs = {}               # device name -> [Vacated] sorted by start
        self.pending = []             # StaleWrites found at reuse, reported again by check()

    def _span(self, recs, lo, hi):
        """Indices [i, j) of the records overlapping [lo, hi)."""
        i = bisect.bisect_right(recs, lo, key=_end)
        j = i
        while j < len(recs) and recs[j].start < hi:
            j += 1
        return i, j

    def vacate(self, dev, start, nbytes, owner, size, why):
        """Poison [start, start+nbytes) of dev and remember that owner (size bytes) left it."""
        if nbytes <= 0:
            return
        np.ndarray(nbytes, np.uint8, dev.buffer, start).fill(POISON)
        recs = self._recs.setdefault(dev.name, [])
        i, j = self._span(recs, start, start + nbytes)
        recs[i:j] = [Vacated(start, start + nbytes, owner, size, why)]

    def reuse(self, dev, offset, size):
        """The block [offset, offset+size) was just allocated: check and forget what it covers.

        Returns the stale writes found (also logged and kept in ``pending``).
        """
        recs = self._recs.get(dev.name)
        if not recs:
            return []
        i, j = self._span(recs, offset, offset + size)
        if i == j:
            return []
        found = self._check(dev, recs[i:j], (offset, offset + size))
        del recs[i:j]
        for w in found:
            log.warning("debug mode: %s (found when the memory was reused); a view was used "
                        "after its access scope ended", w)
        self.pending.extend(found)
        return found

    def verify(self, devices):
        """Check every poisoned range now: (stale writes found earlier at reuse, found now)."""
        earlier, self.pending = self.pending, []
        found = []
        for dev in devices:
            recs = self._recs.get(dev.name)
            if not recs or dev.heap is None:
                continue
            starts = sorted(b.offset for b in dev.heap.blocks())
            bad = self._check(dev, recs, starts)
            if bad:
                gone = {w.start for w in bad}
                recs[:] = [r for r in recs if r.start not in gone]
                found.extend(bad)
        return earlier, found

    def after_defrag(self, dev, moves, blocks):
        """Defrag slid blocks down: forget ranges now under data, poison what moves left behind.

        moves: (region, old offset) for each block moved; blocks: the heap's blocks afterwards.
        """
        recs = self._recs.setdefault(dev.name, [])
        used = [(b.offset, b.offset + b.size) for b in blocks if not b.free]
        for lo, hi in used:
            i, j = self._span(recs, lo, hi)
            del recs[i:j]
        free = [(b.offset + HEADER, b.offset + b.size) for b in blocks if b.free]
        for region, old in moves:
            lo, hi = old + HEADER, old + HEADER + region.nbytes
            for flo, fhi in free:
                a, b = max(lo, flo), min(hi, fhi)
                if a < b:
                    self.vacate(dev, a, b - a, region.owner, region.nbytes,
                                f"was moved by defrag on {dev.name!r}")

    def clear(self):
        self._recs.clear()
        self.pending = []

    @staticmethod
    def _check(dev, recs, starts):
        """StaleWrites for recs whose bytes are not all poison (heap headers at starts skipped)."""
        out = []
        buf = dev.buffer
        for r in recs:
            a = np.ndarray(r.end - r.start, np.uint8, buf, r.start)
            bad = a != POISON
            if not bad.any():
                continue
            k = bisect.bisect_left(starts, r.start - HEADER + 1)
            while k < len(starts) and starts[k] < r.end:
                lo, hi = max(starts[k], r.start), min(starts[k] + HEADER, r.end)
                bad[lo - r.start:hi - r.start] = False
                k += 1
            n = int(np.count_nonzero(bad))
            if n:
                out.append(StaleWrite(dev.name, r.owner, r.nbytes, r.why, r.start, n,
                                      r.start + int(np.argmax(bad))))
        return out
