"""Telemetry: bytes moved per direction, allocations, peaks, copy time, and an optional event log.

These counts are the ground truth for comparing policies on machines without persistent memory.
"""

import json
import logging
import operator
import os
import threading
import time
import weakref
from collections import defaultdict

from ._records import TelemetryRecord

log = logging.getLogger(__name__)

# Every named event the library counts, so stats()["events"] holds each one (zero until it
# happens). A test checks that every count("name", ...) call in the source tree is listed here.
EVENTS = (
    "asarray",                 # np.asarray(cached): a full copy into ordinary memory
    "cnn_iteration",           # one CNN training iteration (marks the event log)
    "compaction",              # a policy slid a heap's regions down to place an array (bytes moved)
    "copy_async",              # a copy issued to run in the background (wait=False)
    "copy_cancelled",          # a background copy cancelled (its destination was dropped)
    "copy_stall",              # a use of an array waited for its background copy
    "dask_received",           # a CachedArray chunk received from another dask process
    "dask_sent",               # a CachedArray chunk sent to another dask process (no copy)
    "debug_stale_writes",      # debug mode: a write into memory its object had left
    "defrag_moves",            # a heap defragmentation pass (bytes moved)
    "evict_skipped_pinned",    # an eviction walk passed over a pinned region
    "drop",                    # an array dropped without write-back (regenerated when used)
    "fault",                   # kernels-in-fast: an operand fetched on demand before a kernel
    "prefetch_refused",        # a prefetch that did not fit in fast memory
    "regenerate",              # a dropped array rebuilt by rerunning its recorded kernels
    "regenerate_before_change",  # a dropped array rebuilt because one of its inputs changes
    "staging_aside",           # kernels-in-fast: an operand moved aside to make a block contiguous
    "plan_missed",             # a planning policy could not do what its plan said (no room)
    "plan_unfired",            # a step ended before points of its plan (kernels it never ran)
    "writebacks_elided",       # a clean eviction that dropped the fast copy without a copy
)


#: Devices whose allocations a Telemetry counts (the C record's counter block holds this many).
MAX_DEVICES = 4
_ALLOCS, _FREES, _CURRENT, _PEAK = (k * MAX_DEVICES for k in range(4))


class Telemetry(TelemetryRecord):
    """Counters kept by the manager. All updates happen under the manager's lock.

    The allocation counters (``allocs``, ``frees``, ``current``, ``peak``: dicts by device,
    built when read) are integers in a C record (``_records``), which the manager's common
    paths update directly; so is the event log's handle."""

    def __init__(self, devices, event_log=None):
        self._devices = list(devices)
        if len(self._devices) > MAX_DEVICES or len(set(self._devices)) != len(self._devices):
            raise ValueError(f"telemetry counts at most {MAX_DEVICES} distinct devices, got "
                             f"{self._devices}")
        self._names = tuple(self._devices)
        self._index = {d: i for i, d in enumerate(self._devices)}
        self._c = memoryview(self).cast("q")    # the C counters: [kind * MAX_DEVICES + device]
        check_event_log(event_log)
        self._log_path = event_log
        self._log = _open_event_log(event_log) if event_log else None
        self.log_error = None                    # why the event log stopped, if it did
        self._log_lock = threading.Lock()
        if self._log is not None:
            _LOGGING.add(self)
        self.t0 = time.perf_counter()
        self.reset()

    def reset(self):
        """Zero every counter (current bytes in use are kept, peaks restart from them)."""
        c = self._c
        for i in range(len(self._devices)):
            c[_ALLOCS + i] = c[_FREES + i] = 0
            c[_PEAK + i] = c[_CURRENT + i]
        self.moved_bytes = defaultdict(int)      # "fast->slow" -> bytes
        self.moved_copies = defaultdict(int)
        self.copy_seconds = 0.0
        self.stall_seconds = 0.0                 # time uses waited for background copies
        self.events = defaultdict(int, dict.fromkeys(EVENTS, 0))   # named counters (EVENTS)
        self.event_bytes = defaultdict(int, dict.fromkeys(EVENTS, 0))

    def _counts(self, kind):
        c = self._c
        return {d: c[kind + i] for d, i in self._index.items()}

    allocs = property(lambda self: self._counts(_ALLOCS),
                      doc="Allocations per device since the last reset.")
    frees = property(lambda self: self._counts(_FREES), doc="Frees per device since the last reset.")
    current = property(lambda self: self._counts(_CURRENT), doc="Bytes in use per device.")
    peak = property(lambda self: self._counts(_PEAK),
                    doc="Most bytes in use per device since the last reset.")

    # Updates -------------------------------------------------------------------------------

    # The manager's common allocation and free paths (native/records.c: create_fast, drain)
    # inline on_alloc and on_free when no event log is open: keep those copies in step.
    def on_alloc(self, device, nbytes, obj_id):
        i, c = self._index[device], self._c
        c[_ALLOCS + i] += 1
        cur = c[_CURRENT + i] = c[_CURRENT + i] + nbytes
        if cur > c[_PEAK + i]:
            c[_PEAK + i] = cur
        if self._log:
            self.emit("alloc", device=device, id=obj_id, nbytes=nbytes, used=cur)

    def on_free(self, device, nbytes, obj_id):
        i, c = self._index[device], self._c
        c[_FREES + i] += 1
        cur = c[_CURRENT + i] = c[_CURRENT + i] - nbytes
        if self._log:
            self.emit("free", device=device, id=obj_id, nbytes=nbytes, used=cur)

    def on_copy(self, src, dst, nbytes, seconds, obj_id):
        key = f"{src}->{dst}"
        self.moved_bytes[key] += nbytes
        self.moved_copies[key] += 1
        self.copy_seconds += seconds
        if self._log:
            self.emit("copy", src=src, dst=dst, id=obj_id, nbytes=nbytes, seconds=seconds)

    def count(self, name, nbytes=0, **fields):
        """Count a named event: one of EVENTS, or any other name a program chooses."""
        self.events[name] += 1
        self.event_bytes[name] += nbytes
        if self._log:
            self.emit(name, nbytes=nbytes, **fields)

    def emit(self, event, **fields):
        if self._log is None:
            return
        rec = {"t": round(time.perf_counter() - self.t0, 9), "event": event, **fields}
        with self._log_lock:
            f = self._log
            if f is None:
                return
            try:
                f.write(json.dumps(rec, default=repr) + "\n")
            except (OSError, ValueError) as e:
                self._stop_log(e)

    def _stop_log(self, e):
        """The event log cannot be written (a full disk): stop logging and say so once.

        Never raised: an event is emitted in the middle of the manager's operations, which an
        exception there would leave half done."""
        f, self._log = self._log, None
        try:
            f.close()
        except (OSError, ValueError):
            pass
        self._report(e)

    def _report(self, e):
        self.log_error = e
        log.warning("event log %r could not be written (%s); event logging stopped and the "
                    "log lacks the events since its last write: free space or pass another "
                    "event_log", self._log_path, getattr(e, "strerror", None) or e)

    def forsake_log(self):
        """In a forked child: let go of the parent's event log without writing to it. The
        child's copy of the file holds the parent's unwritten events, which its flush at exit
        would append a second time, so its descriptor is pointed at /dev/null first."""
        self._log_lock = threading.Lock()         # the child's own
        f, self._log = self._log, None
        if f is None:
            return
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, f.fileno())
            finally:
                os.close(null)
            f.close()
        except (OSError, ValueError):
            pass

    def close(self):
        """Close the event log; a failure to write its last events is logged, never raised."""
        with self._log_lock:
            f, self._log = self._log, None
        if f is not None:
            try:
                f.close()
            except (OSError, ValueError) as e:
                self._report(e)

    # Reports -------------------------------------------------------------------------------

    def snapshot(self, device_stats=None):
        """A plain dict of every counter (safe to keep, print or serialise)."""
        moved = {k: {"bytes": v, "copies": self.moved_copies[k]} for k, v in
                 sorted(self.moved_bytes.items())}
        out = {
            "moved": moved,
            "copy_seconds": self.copy_seconds,
            "stall_seconds": self.stall_seconds,
            "events": {k: {"count": v, "bytes": self.event_bytes[k]} for k, v in
                       sorted(self.events.items())},
            "devices": {},
        }
        allocs, frees, current, peak = self.allocs, self.frees, self.current, self.peak
        for d in self._devices:
            rec = {"allocs": allocs[d], "frees": frees[d],
                   "current_bytes": current[d], "peak_bytes": peak[d]}
            if device_stats and d in device_stats:
                rec.update({"heap_" + k: v for k, v in device_stats[d].items()})
            out["devices"][d] = rec
        return out


_RECORD_START = '{"t": '          # how every record's line begins (json.dumps of rec in emit)


#: Telemetry with an event log open: a fork waits until no thread is writing to one, so a
#: forked child never inherits a file whose internal lock a thread now gone holds (closing it
#: there would wait forever).
_LOGGING = weakref.WeakSet()
_held_at_fork = []


def _before_fork():
    for t in list(_LOGGING):
        lock = t._log_lock
        lock.acquire()
        _held_at_fork.append(lock)


def _after_fork():
    while _held_at_fork:
        _held_at_fork.pop().release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork,
                    after_in_child=_after_fork)


def _open_event_log(path):
    """The event log opened for appending; OSError naming the path and the fix otherwise.

    A last line left unfinished by an earlier writer is ended first, so that the next record
    starts a line of its own and the cut one stays recognisable (read_event_log skips it)."""
    f = None
    try:
        f = open(path, "a", buffering=1 << 16)
        if f.tell() > 0:
            with open(path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    f.write("\n")
        return f
    except OSError as e:
        if f is not None:
            f.close()
        raise type(e)(e.errno, f"cannot open event_log {os.fspath(path)!r}: {e.strerror}; pass "
                      "the path of a file in a writable directory, or None for no log") from None


#: Keys of every event log record; an event's own fields may not take them.
RECORD_KEYS = ("t", "event", "nbytes")


def check_event(name, nbytes, fields=()):
    """nbytes as an int; TypeError unless name is a non-empty str and nbytes a whole number of
    bytes >= 0 (stats() sorts the names and sums the bytes), and no field is a record key."""
    taken = [k for k in fields if k in RECORD_KEYS]
    if taken:
        raise TypeError(f"event {name!r}: field {taken[0]!r} would overwrite the event log's own "
                        f"{taken[0]!r}; name the field otherwise (e.g. {taken[0] + '_'!r})")
    if type(name) is not str or not name:
        raise TypeError(f"an event's name must be a non-empty str such as 'my_event', not "
                        f"{name!r}")
    if type(nbytes) is not int:
        if isinstance(nbytes, bool) or not hasattr(type(nbytes), "__index__"):
            raise TypeError(f"event {name!r}: nbytes must be an int number of bytes, not "
                            f"{type(nbytes).__name__} {nbytes!r}")
        nbytes = operator.index(nbytes)
    if nbytes < 0:
        raise ValueError(f"event {name!r}: nbytes must be >= 0, got {nbytes}")
    return nbytes


def check_event_log(event_log):
    """TypeError unless event_log is None or a path (a str or os.PathLike)."""
    if event_log is not None and not isinstance(event_log, (str, os.PathLike)):
        raise TypeError(f"event_log must be the path of a file to append events to (a str or "
                        f"os.PathLike), or None for no log; got {event_log!r}")
    if event_log is not None and not os.fspath(event_log):
        raise ValueError("event_log is an empty path: pass the path of a file to append events "
                         "to, or None for no log")


def read_event_log(path):
    """Read an event log written by a manager (one JSON record per line).

    A record cut short (its process was killed or the disk filled mid-write) is skipped; any
    other line that is not a JSON record is a ValueError naming it."""
    with open(path) as f:
        lines = f.read().split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as e:
            if i == len(lines) - 1 or line.startswith(_RECORD_START):    # an unfinished write
                continue
            raise ValueError(f"event log {os.fspath(path)!r}, line {i + 1}: not a JSON record "
                             f"({e}); is it a manager's event_log?") from None
    return out


def format_stats(stats):
    """A readable table of a manager's stats() dict (returns text; prints nothing)."""
    from .sizes import format_size

    lines = ["traffic between devices:"]
    if not stats["moved"]:
        lines.append("  (none)")
    for key, rec in stats["moved"].items():
        lines.append(f"  {key:12} {format_size(rec['bytes']):>12} in {rec['copies']} copies")
    lines.append(f"  copy time {stats['copy_seconds'] * 1e3:.1f} ms")
    lines.append("devices:")
    for name, d in stats["devices"].items():
        lines.append(f"  {name:5} in use {format_size(d['current_bytes']):>11}, peak "
                     f"{format_size(d['peak_bytes']):>11}, {d['allocs']} allocations, "
                     f"{d['frees']} frees")
    happened = {name: rec for name, rec in stats["events"].items() if rec["count"]}
    if happened:
        lines.append("events:")
        for name, rec in happened.items():
            extra = f" ({format_size(rec['bytes'])})" if rec["bytes"] else ""
            lines.append(f"  {name:22} {rec['count']:>8}{extra}")
    return "\n".join(lines)
