"""Background copies on real devices: ``prefetch``/``evict`` with ``wait=False``.

The object's state changes when the copy is issued; a use waits for the copy (stall); freeing the
destination cancels it; ``Manager.cancel`` undoes a prefetch; memory still being read by a
background eviction is not handed out until the copy has read it; ``close`` with copies in flight.

Copies are held back with a gate around ``copyengine.copy`` (never with timing alone), and every
wait has a generous bound, so a bug fails a test instead of hanging it.
"""

import gc
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import cachedarrays as ca
from cachedarrays import copyengine as ce
from cachedarrays.errors import UseAfterFreeError

T = 10.0
MiB = 1 << 20
BIG = 2 * ce.DEFAULT_CHUNK + MiB        # a copy of three chunks: a cancel stops it midway


@pytest.fixture
def mgr():
    made = []

    def make(**kw):
        m = ca.Manager(**{"fast": "64MiB", "slow": "256MiB", **kw})
        made.append(m)
        return m

    yield make
    for m in made:
        if not m.closed:
            m.check()
        m.close()


class Gate:
    """Holds every background copy chunk until ``open()`` (or until its job is told to stop),
    so a test decides when copies finish. ``started`` is set when a chunk reaches the gate."""

    def __init__(self, monkeypatch):
        self.opened = threading.Event()
        self.started = threading.Event()
        self.held = 0
        real = ce.copy
        workers = set()

        def gated(dst, src, n, threads=None, persist=False):
            if threading.current_thread().name.startswith("cachedarrays-copy"):
                self.started.set()
                self.held += 1
                deadline = time.monotonic() + T
                while not self.opened.wait(0.001):
                    job = _running_job()
                    if job is not None and job._stop or time.monotonic() > deadline:
                        break
            real(dst, src, n, threads, persist)

        monkeypatch.setattr(ce, "copy", gated)

    @classmethod
    def holding(cls, monkeypatch, issue):
        """A gate, then issue() (a background copy), returned once its first chunk is held."""
        gate = cls(monkeypatch)
        issue()
        assert gate.started.wait(T)
        return gate

    def open(self, after=0.0):
        """Open now, or after `after` seconds from a timer thread."""
        if after:
            t = threading.Timer(after, self.opened.set)
            t.daemon = True
            t.start()
        else:
            self.opened.set()


def _running_job():
    """The CopyJob the calling worker thread runs (found on its stack)."""
    import sys
    f = sys._getframe(1)
    while f is not None:
        job = f.f_locals.get("self")
        if isinstance(job, ce.CopyJob):
            return job
        f = f.f_back
    return None


def values(x):
    with ca.readable(x) as v:
        return v.copy()


def events(m, name):
    return m.stats()["events"][name]["count"]


# ---- data and state ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 1000, (9 * MiB) // 8 + 3])      # one chunk, several chunks
def test_background_evict_then_prefetch_keep_the_data(mgr, n):
    m = mgr()
    want = np.arange(n, dtype=np.float64)
    x = ca.asarray(want, manager=m)
    assert ca.evict(x, wait=False) is None
    assert x.device == "slow"                       # the state changes when the copy is issued
    np.testing.assert_array_equal(values(x), want)
    ca.prefetch(x, wait=False)
    assert x.device == "fast" and set(x.object.regions) == {"fast", "slow"}
    np.testing.assert_array_equal(values(x), want)
    assert m.wait_copies(T)
    s = m.stats()
    assert s["events"]["copy_async"]["count"] == 2
    assert s["moved"]["fast->slow"]["bytes"] == s["moved"]["slow->fast"]["bytes"] == n * 8
    m.check()


def test_a_use_waits_for_its_copy_and_counts_stall(mgr, monkeypatch):
    m = mgr()
    want = np.arange(3 * MiB // 8, dtype=np.float64)
    x = ca.asarray(want, manager=m)
    ca.evict(x)
    gate = Gate.holding(monkeypatch, lambda: ca.prefetch(x, wait=False))
    gate.open(after=0.05)
    with ca.kernel("double", [x], []) as (v,):       # must wait for the prefetch
        assert gate.opened.is_set()
        np.testing.assert_array_equal(v, want)
    s = m.stats()
    assert s["stall_seconds"] > 0
    assert s["events"]["copy_stall"]["count"] == 1
    assert s["events"]["copy_stall"]["bytes"] == want.nbytes
    # a second use has nothing to wait for
    np.testing.assert_array_equal(values(x), want)
    assert events(m, "copy_stall") == 1


@pytest.mark.parametrize("use", ["ufunc", "getitem", "setitem", "writable", "asarray"])
def test_every_kind_of_use_waits(mgr, monkeypatch, use):
    m = mgr()
    want = np.arange(MiB // 8, dtype=np.float64)
    x = ca.asarray(want, manager=m)
    gate = Gate.holding(monkeypatch, lambda: ca.evict(x, wait=False))
    gate.open(after=0.02)
    if use == "ufunc":
        y = x + 1
        np.testing.assert_array_equal(values(y), want + 1)
    elif use == "getitem":
        assert float(x[-1]) == want[-1]
    elif use == "setitem":
        x[0] = -1.0
        want[0] = -1.0
    elif use == "writable":
        with ca.writable(x) as v:
            v[1] = -2.0
        want[1] = -2.0
    else:
        np.testing.assert_array_equal(np.asarray(x), want)
    assert gate.opened.is_set() and events(m, "copy_stall") == 1
    np.testing.assert_array_equal(values(x), want)


def _prefetch_held_mid_copy(mgr, monkeypatch):
    """(manager, array, job): a background prefetch of a large array, held mid-copy."""
    m = mgr()
    x = ca.asarray(np.arange(BIG // 8, dtype=np.float64), manager=m)
    ca.evict(x)
    Gate.holding(monkeypatch, lambda: ca.prefetch(x, wait=False))
    return m, x, m._copies[x.object.id].job


def test_free_during_a_copy_cancels_it(mgr, monkeypatch):
    m, x, job = _prefetch_held_mid_copy(mgr, monkeypatch)
    ca.unsafe_free(x)                               # asks the running job to stop
    assert job.done() and job.cancelled()
    s = m.stats()
    assert s["events"]["copy_cancelled"]["count"] == 1 and s["objects"] == 0
    assert m.fast.stats()["used"] == 0 and m.slow.stats()["used"] == 0
    m.check()
    with pytest.raises(UseAfterFreeError):
        values(x)


def test_a_garbage_collected_array_cancels_its_copy(mgr, monkeypatch):
    m, x, job = _prefetch_held_mid_copy(mgr, monkeypatch)
    del x
    gc.collect()
    m.drain()
    assert job.cancelled() and events(m, "copy_cancelled") == 1
    assert m.stats()["objects"] == 0


def test_cancel_a_prefetch_puts_the_array_back(mgr, monkeypatch):
    m = mgr()
    want = np.arange(2 * MiB // 8, dtype=np.float64)
    x = ca.asarray(want, manager=m)
    ca.evict(x)
    obj = x.object
    assert m.cancel(obj) is False                   # no copy in flight
    gate = Gate.holding(monkeypatch, lambda: ca.prefetch(x, wait=False))
    assert x.device == "fast"
    assert m.cancel(obj) is True
    assert x.device == "slow" and set(obj.regions) == {"slow"}
    assert obj.id not in m.policy.tiers()[1]        # LRU forgot the fast copy
    assert m.cancel(obj) is False                   # nothing left to cancel
    assert events(m, "copy_cancelled") == 1 and m.fast.stats()["used"] == 0
    gate.open()
    np.testing.assert_array_equal(values(x), want)
    m.check()


def test_cancel_refuses_a_background_eviction(mgr, monkeypatch):
    m = mgr()
    want = np.arange(MiB // 8, dtype=np.float64)
    x = ca.asarray(want, manager=m)
    gate = Gate.holding(monkeypatch, lambda: ca.evict(x, wait=False))
    assert m.cancel(x.object) is False              # its source is gone: it must complete
    gate.open()
    assert x.device == "slow"
    np.testing.assert_array_equal(values(x), want)


def test_cancel_after_the_copy_finished(mgr):
    m = mgr()
    want = np.arange(1000, dtype=np.float64)
    x = ca.asarray(want, manager=m)
    ca.evict(x)
    ca.prefetch(x, wait=False)
    assert m.wait_copies(T)
    assert m.cancel(x.object) is True and x.device == "slow"
    np.testing.assert_array_equal(values(x), want)


def test_memory_read_by_a_background_eviction_is_not_reused_early(mgr, monkeypatch):
    m = mgr(fast="40MiB")
    n = 32 * MiB // 8
    want = np.arange(n, dtype=np.float64)
    a = ca.asarray(want, manager=m)
    offset = a.object.primary.offset
    gate = Gate.holding(monkeypatch, lambda: ca.evict(a, wait=False))
    gate.open(after=0.05)
    b = ca.full(n, -1.0, manager=m)                 # lands where a was: waits for the read
    assert b.device == "fast" and b.object.primary.offset == offset
    assert gate.opened.is_set() and m.stats()["stall_seconds"] > 0
    np.testing.assert_array_equal(values(a), want)
    assert (values(b) == -1.0).all()
    m.check()


@pytest.mark.parametrize("n,small", [(25, 1), (1000, 10), (5000, 300), (100, 100)])
def test_a_smaller_block_over_an_eviction_source_does_not_corrupt_it(mgr, monkeypatch, n,
                                                                      small):
    """The heap writes the header of a split block's remainder inside the old block: the
    new block must wait for the eviction before the heap touches that memory."""
    m = mgr(fast="1MiB", slow="4MiB", granularity=256)
    want = np.arange(1, n + 1, dtype=np.float64)
    a = ca.asarray(want, manager=m)
    gate = Gate.holding(monkeypatch, lambda: ca.evict(a, wait=False))
    gate.open(after=0.02)
    b = ca.full(small, -1.0, manager=m)             # reuses the start of a's old block
    c = ca.full(small, -2.0, manager=m)
    np.testing.assert_array_equal(values(a), want)
    assert (values(b) == -1.0).all() and (values(c) == -2.0).all()
    m.check()


def test_defrag_waits_for_copies_in_flight(mgr, monkeypatch):
    m = mgr()
    n = 4 * MiB // 8
    want = np.arange(n, dtype=np.float64)
    a = ca.full(1 << 17, 1.0, manager=m)
    x = ca.asarray(want, manager=m)
    c = ca.full(n, 3.0, manager=m)
    ca.unsafe_free(a)
    # c slides over x's old memory
    gate = Gate.holding(monkeypatch, lambda: ca.evict(x, wait=False))
    gate.open(after=0.02)
    assert m.defrag("fast") >= 1
    np.testing.assert_array_equal(values(x), want)
    assert (values(c) == 3.0).all()
    ca.prefetch(x, wait=False)                      # and a prefetch's destination
    m.defrag("fast")
    np.testing.assert_array_equal(values(x), want)


def test_copy_into_a_region_still_being_filled_waits(mgr, monkeypatch):
    """evict(wait=False) right after prefetch(wait=False): the eviction reads the prefetched
    copy only once it is complete (here the clean copy is dropped instead), and a dirty write
    settles first."""
    m = mgr()
    want = np.arange(MiB // 8, dtype=np.float64)
    x = ca.asarray(want, manager=m)
    ca.evict(x)
    gate = Gate.holding(monkeypatch, lambda: ca.prefetch(x, wait=False))
    ca.evict(x, wait=False)                         # clean: the fast copy is just dropped
    assert x.device == "slow" and events(m, "copy_cancelled") == 1
    gate.open()
    ca.prefetch(x, wait=False)
    x[0] = 5.0
    want[0] = 5.0
    ca.evict(x, wait=False)
    ca.prefetch(x, wait=False)
    np.testing.assert_array_equal(values(x), want)


def test_positional_arguments(mgr):
    m = mgr()
    want = np.arange(1000, dtype=np.float64)
    x = ca.asarray(want, manager=m)
    obj = x.object
    assert m.evict(obj, "slow", False) is True and x.device == "slow"
    assert m.prefetch(obj, True, False) is True and x.device == "fast"
    assert m.evict(obj, None, False) is True and x.device == "slow"
    assert m.policy.prefetch(obj, False, False) is True and x.device == "fast"
    assert m.policy.evict(obj, None, False) is True and x.device == "slow"
    np.testing.assert_array_equal(values(x), want)
    assert events(m, "copy_async") == 3 and events(m, "writebacks_elided") == 2   # clean


def test_prefetch_flags_passed_positionally_are_refused(mgr):
    m = mgr()
    x = ca.ones(1000, manager=m)
    ca.evict(x)
    with pytest.raises(TypeError, match="force= and wait= by keyword"):
        ca.prefetch(x, True, False)
    assert events(m, "copy_async") == 0 and x.device == "slow"


# ---- close -----------------------------------------------------------------------------------

def _copy_threads():
    return [t for t in threading.enumerate() if t.name.startswith("cachedarrays-copy")]


def test_close_with_copies_in_flight(monkeypatch):
    before = set(_copy_threads())
    m = ca.Manager(fast="64MiB", slow="256MiB")
    xs = [ca.full(MiB // 8, float(i), manager=m) for i in range(20)]
    gate = Gate(monkeypatch)
    for x in xs:
        ca.evict(x, wait=False)                     # one running, the others queued
    assert gate.started.wait(T)
    gate.open(after=0.02)
    m.close()
    assert m.closed and not set(_copy_threads()) - before
    with pytest.raises(UseAfterFreeError):
        values(xs[0])
    m.close()                                       # idempotent


def test_close_right_after_issuing_copies():
    for _ in range(5):
        m = ca.Manager(fast="64MiB", slow="256MiB")
        xs = [ca.full(2 * MiB // 8, float(i), manager=m) for i in range(10)]
        for i, x in enumerate(xs):
            if i % 2:
                ca.evict(x, wait=False)
            else:
                ca.evict(x)
                ca.prefetch(x, wait=False)
        m.close()
    gc.collect()


def test_a_dropped_manager_with_copies_in_flight():
    m = ca.Manager(fast="64MiB", slow="256MiB")
    xs = [ca.full(MiB // 8, 1.0, manager=m) for _ in range(8)]
    for x in xs:
        ca.evict(x, wait=False)
    del m, xs, x
    gc.collect()
    for t in _copy_threads():
        t.join(T)


EXIT_SCRIPT = """
import sys
import numpy as np
import cachedarrays as ca
m = ca.Manager(fast="64MiB", slow="256MiB")
xs = [ca.full(int(sys.argv[1]), 1.0, manager=m) for _ in range(4)]
for x in xs:
    ca.evict(x, wait=False)
ca.prefetch(xs[0], wait=False)
"""


@pytest.mark.parametrize("n", [1000, 2 * MiB])
def test_the_interpreter_exits_with_copies_in_flight(tmp_path, n):
    """A manager left open with background copies: its close at interpreter exit must not
    wait for copy threads that the exit has already stopped (it hung)."""
    import subprocess
    import sys
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    for _ in range(2):
        r = subprocess.run([sys.executable, str(script), str(n)], capture_output=True,
                           timeout=60, text=True)
        assert r.returncode == 0, r.stderr


# ---- three tiers -------------------------------------------------------------------------------

def test_background_moves_across_three_tiers_keep_the_newest_data(tmp_path):
    with ca.Manager(tiers=[("dram", "16MiB"), ("pmem", "32MiB", str(tmp_path)),
                           ("ssd", "64MiB", str(tmp_path))]) as m:
        want = np.arange(MiB // 8, dtype=np.float64)
        x = ca.asarray(want, manager=m)
        for step, to in enumerate(["ssd", "pmem", None, "ssd", "dram", "pmem", "ssd"]):
            if to == "dram":
                ca.prefetch(x, wait=False)
            else:
                ca.evict(x, to=to, wait=False)
            x[step] = -step                         # a write: older copies are stale
            want[step] = -step
            np.testing.assert_array_equal(values(x), want)
            m.check()
        ca.prefetch(x, wait=False)
        ca.evict(x, to="ssd", wait=False)
        ca.evict(x, to="pmem", wait=False)
        np.testing.assert_array_equal(values(x), want)
        assert m.stats()["moved"]["ssd->pmem"]["copies"] >= 1


# ---- a state machine (also run by tests/stress.py) ----------------------------------------------

class BackgroundCopyMachine(RuleBasedStateMachine):
    """Random arrays, kernels, reads and background/blocking prefetches, evictions (to any of
    three tiers), cancels, frees and defrags, with copies slowed down so that they are still in
    flight at the next step; data and heap invariants are checked after every step."""

    @initialize()
    def setup(self):
        # pmem and ssd: private temporary files (no path: no "not DAX" warning per manager)
        self.m = ca.Manager(tiers=[("dram", "96KiB"), ("pmem", "256KiB"), ("ssd", "1MiB")],
                            granularity=256)
        self.model = {}         # name -> (CachedArray, expected ndarray)
        self.n = 0
        self.real = ce.copy

        def slow_copy(dst, src, n, threads=None, persist=False):
            if threading.current_thread().name.startswith("cachedarrays-copy"):
                time.sleep(0.0005)
            self.real(dst, src, n, threads, persist)

        ce.copy = slow_copy

    def teardown(self):
        try:
            self.m.close()
        finally:
            ce.copy = self.real

    def _pick(self, i):
        names = sorted(self.model)
        return names[i % len(names)] if names else None

    @rule(size=st.integers(1, 4000), value=st.integers(-9, 9))
    def new(self, size, value):
        if len(self.model) >= 12:
            return
        x = ca.full(size, float(value), manager=self.m)
        self.n += 1
        self.model[f"a{self.n}"] = (x, np.full(size, float(value)))

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def kernel(self, i, j):
        (x, wx), (y, wy) = self.model[self._pick(i)], self.model[self._pick(j)]
        if x is y:
            x += 1
            wx += 1
            return
        k = min(wx.size, wy.size)
        with ca.kernel("k", [x], [y]) as (vx, vy):
            vy[:k] += vx[:k]
        wy[:k] += wx[:k]

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99), force=st.booleans(), wait=st.booleans())
    def prefetch(self, i, force, wait):
        ca.prefetch(self.model[self._pick(i)][0], force=force, wait=wait)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99), to=st.sampled_from([None, "pmem", "ssd", "slow"]),
          wait=st.booleans())
    def evict(self, i, to, wait):
        ca.evict(self.model[self._pick(i)][0], to=to, wait=wait)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99))
    def cancel(self, i):
        x = self.model[self._pick(i)][0]
        before = x.device
        if self.m.cancel(x.object):
            assert x.device != before

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99))
    def softevict(self, i):
        ca.softevict(self.model[self._pick(i)][0])

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99), collect=st.booleans())
    def free(self, i, collect):
        x, _ = self.model.pop(self._pick(i))
        if collect:
            del x
            gc.collect()
        else:
            ca.unsafe_free(x)

    @rule(device=st.sampled_from(["dram", "pmem", "ssd"]))
    def defrag(self, device):
        self.m.defrag(device)

    @rule()
    def wait_copies(self):
        assert self.m.wait_copies(T)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 99))
    def read(self, i):
        x, want = self.model[self._pick(i)]
        np.testing.assert_array_equal(values(x), want)      # may wait for a copy in flight

    @invariant()
    def data_and_heaps(self):
        """Heaps always; the data of every array whose copy is not still running (reading the
        others would wait for them, and no copy would stay in flight into the next step)."""
        if not hasattr(self, "m"):
            return
        for x, want in self.model.values():
            c = self.m._copies.get(x.object.id)
            if c is None or c.job is None or c.job.done():
                np.testing.assert_array_equal(values(x), want)
        self.m.check()


BackgroundCopyMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestBackgroundCopyMachine = BackgroundCopyMachine.TestCase
