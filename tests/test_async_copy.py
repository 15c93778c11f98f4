"""Asynchronous copy engine: CopyWorkers / CopyJob (ordering, concurrency, cancellation, shutdown).

Ordering and concurrency are checked with gates (events inside a wrapped ``copy``), never with
timing, so the tests do not flake on a loaded machine. Every blocking wait has a generous
timeout so a bug fails the test instead of hanging it.
"""
import concurrent.futures
import gc
import threading

import numpy as np
import pytest

from cachedarrays import copyengine as ce

T = 10.0          # generous bound for waits that should succeed
GUARD = 0xEE


def addr(a):
    return a.ctypes.data


def pair(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, n, dtype=np.uint8), np.full(n, GUARD, dtype=np.uint8)


@pytest.fixture
def workers():
    made = []

    def make(**kw):
        w = ce.CopyWorkers(**kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()


class Gate:
    """Wraps ce.copy: copies into a gated destination range block after `after` chunks until
    released; every call into a watched destination is recorded."""

    def __init__(self, monkeypatch, lo, hi, after=0, until=None):
        self.lo, self.hi, self.after, self.until = lo, hi, after, until
        self.reached, self.release = threading.Event(), threading.Event()
        self.calls = []
        real = ce.copy

        def gated(dst, src, n, threads=None, persist=False):
            if self.lo <= dst < self.hi:
                self.calls.append((dst, n))
                if len(self.calls) > self.after:
                    self.reached.set()
                    if self.until is not None:     # wait for a condition instead of release
                        for _ in range(int(T / 0.001)):
                            if self.until() or self.release.is_set():
                                break
                            self.release.wait(0.001)
                    else:
                        assert self.release.wait(T), "gate never released"
            real(dst, src, n, threads, persist)

        monkeypatch.setattr(ce, "copy", gated)


@pytest.mark.parametrize("n", [0, 1, 7, 4095, 4096, 4097, 3 * 4096 + 5, 100_000])
def test_data_copied_small_chunks(workers, n):
    w = workers(chunk=4096)
    src, dst = pair(n + 16, n)
    job = w.submit("fast->slow", addr(dst) + 8, addr(src) + 8, n)
    assert job.wait(T) and job.done() and not job.cancelled()
    job.result()
    assert job.copied == n and job.nbytes == n and job.key == "fast->slow" and job.seconds >= 0
    assert np.array_equal(dst[8:8 + n], src[8:8 + n])
    assert (dst[:8] == GUARD).all() and (dst[8 + n:] == GUARD).all()


def test_data_copied_default_chunk(workers):
    w = workers()
    assert w.chunk == 8 << 20
    n = (8 << 20) + 12345            # one full chunk and a remainder
    src, dst = pair(n)
    job = w.submit("a", addr(dst), addr(src), n, persist=True, keepalive=(src, dst))
    job.result(T)
    assert np.array_equal(dst, src)


def test_fifo_per_key(workers):
    w = workers(chunk=1000)
    order, bufs = [], []
    for i in range(40):
        src, dst = pair(i * 997, i)
        bufs.append((src, dst))
        w.submit("k", addr(dst), addr(src), src.nbytes).add_done_callback(
            lambda j, i=i: order.append(i))
    assert w.drain(T)
    assert order == list(range(40))
    assert all(np.array_equal(s, d) for s, d in bufs)
    assert w.pending() == 0


def test_keys_run_concurrently(workers, monkeypatch):
    w = workers(chunk=4096)
    a_src, a_dst = pair(1 << 20, 1)
    b_src, b_dst = pair(1 << 16, 2)
    gate = Gate(monkeypatch, addr(a_dst), addr(a_dst) + a_dst.nbytes, after=3)
    ja = w.submit("A", addr(a_dst), addr(a_src), a_dst.nbytes)
    assert gate.reached.wait(T)          # A is running, stuck mid-copy
    jb = w.submit("B", addr(b_dst), addr(b_src), b_dst.nbytes)
    assert jb.wait(T)                    # B finished while A cannot progress
    assert not ja.done() and w.pending("A") == 1 and w.pending("B") == 0 and w.pending() == 1
    assert np.array_equal(b_dst, b_src)
    gate.release.set()
    ja.result(T)
    assert np.array_equal(a_dst, a_src)


def test_cancel_queued_job(workers, monkeypatch):
    w = workers(chunk=4096)
    s1, d1 = pair(8192, 1)
    s2, d2 = pair(8192, 2)
    s3, d3 = pair(8192, 3)
    gate = Gate(monkeypatch, addr(d1), addr(d1) + 1)
    j1 = w.submit("k", addr(d1), addr(s1), 8192)
    assert gate.reached.wait(T)
    calls = []
    j2 = w.submit("k", addr(d2), addr(s2), 8192, keepalive=(s2, d2))
    j2.add_done_callback(lambda j: calls.append(("cb", threading.current_thread().name)))
    j3 = w.submit("k", addr(d3), addr(s3), 8192)
    assert w.pending("k") == 3
    assert j2.cancel() is True and j2.cancelled() and j2.done() and j2.wait(0)
    assert j2.cancel() is True                      # idempotent
    assert w.pending("k") == 2
    with pytest.raises(concurrent.futures.CancelledError):
        j2.result()
    gate.release.set()
    assert w.drain(T)
    assert (d2 == GUARD).all() and j2.copied == 0
    assert np.array_equal(d1, s1) and np.array_equal(d3, s3)
    assert calls == [("cb", "cachedarrays-copy k")]   # once, on the worker thread
    assert j1.cancel() is False and j3.cancel() is False   # finished: nothing to cancel


def test_cancel_running_job(workers, monkeypatch):
    w = workers(chunk=4096)
    n = 64 * 4096
    src, dst = pair(n)
    job = None
    gate = Gate(monkeypatch, addr(dst), addr(dst) + n, after=1, until=lambda: job is not None and job._stop)
    job = w.submit("k", addr(dst), addr(src), n)
    assert gate.reached.wait(T)         # second chunk is in flight, waiting for cancel()
    assert job.cancel() is True         # the chunk in flight completes, then the job stops
    assert job.cancelled() and job.done() and job.copied == 2 * 4096
    ncalls, snapshot = len(gate.calls), dst.copy()
    assert np.array_equal(dst[:2 * 4096], src[:2 * 4096]) and (dst[2 * 4096:] == GUARD).all()
    w.submit("k", 0, 0, 0).result(T)    # FIFO: the worker is past the cancelled job
    assert w.drain(T)
    assert len(gate.calls) == ncalls and np.array_equal(dst, snapshot)


def test_done_callbacks_exactly_once(workers):
    w = workers(chunk=4096)
    src, dst = pair(50_000)
    seen = []
    job = w.submit("k", addr(dst), addr(src), src.nbytes)
    for i in range(3):
        job.add_done_callback(lambda j, i=i: seen.append((i, j)))
    assert w.drain(T)
    job.add_done_callback(lambda j: seen.append(("late", threading.current_thread())))
    assert seen == [(0, job), (1, job), (2, job), ("late", threading.current_thread())]


def test_callback_errors_do_not_kill_worker(workers):
    w = workers()

    def boom(job):
        raise RuntimeError("callback bug")
    w.submit("k", 0, 0, 0).add_done_callback(boom)
    w.submit("k", 0, 0, 0).result(T)


def test_a_callback_on_a_finished_job_raising_is_logged_not_raised(workers, caplog):
    """Whether the job finished before add_done_callback is a race: both ways log the error."""
    w = workers()
    job = w.submit("k", 0, 0, 0)
    job.result(T)

    def boom(job):
        raise RuntimeError("callback bug")
    with caplog.at_level("ERROR", logger="cachedarrays.copyengine"):
        job.add_done_callback(boom)                  # runs now, in this thread
    assert "done callback" in caplog.text and "callback bug" in caplog.text
    w.submit("k", 0, 0, 0).result(T)


def test_wait_timeout_and_waited(workers, monkeypatch):
    w = workers(chunk=4096)
    src, dst = pair(8192)
    gate = Gate(monkeypatch, addr(dst), addr(dst) + 1)
    job = w.submit("k", addr(dst), addr(src), 8192)
    assert gate.reached.wait(T)
    assert job.wait(0.01) is False and not job.done()
    with pytest.raises(TimeoutError):
        job.result(timeout=0)
    assert w.drain(timeout=0.01) is False
    assert job.waited > 0
    gate.release.set()
    assert job.wait() is True and job.result() is None


def test_exception_goes_to_job(workers, monkeypatch):
    w = workers(chunk=4096)
    src, dst = pair(3 * 4096)
    real = ce.copy

    def failing(d, s, n, threads=None, persist=False):
        if d == addr(dst) + 4096:
            raise MemoryError("simulated copy failure")
        real(d, s, n, threads, persist)
    monkeypatch.setattr(ce, "copy", failing)
    job = w.submit("k", addr(dst), addr(src), src.nbytes)
    assert job.wait(T) and job.done() and not job.cancelled()
    assert isinstance(job.exception, MemoryError) and job.copied == 4096
    with pytest.raises(MemoryError, match="simulated"):
        job.result()
    assert job.cancel() is False
    src2, dst2 = pair(5000, 4)                        # the worker survived
    w.submit("k", addr(dst2), addr(src2), 5000).result(T)
    assert np.array_equal(dst2, src2)


def test_submit_validates_arguments(workers):
    w = workers()
    with pytest.raises(ValueError):
        w.submit("k", 0, 0, -1)
    with pytest.raises(ValueError):
        w.submit("k", -5, 0, 1)
    with pytest.raises(TypeError):
        w.submit("k", None, 0, 1)
    with pytest.raises(ValueError):
        w.submit("k", 1 << 64, 0, 1)


def _new_threads(before):
    return [t for t in threading.enumerate() if t not in before]


def test_shutdown_joins_and_is_idempotent():
    before = set(threading.enumerate())
    w = ce.CopyWorkers(chunk=4096)
    src, dst = pair(20_000)
    for key in ("fast->slow", "slow->fast", "x"):
        w.submit(key, addr(dst), addr(src), src.nbytes)
    started = _new_threads(before)
    assert {t.name for t in started} >= {"cachedarrays-copy fast->slow", "cachedarrays-copy x"}
    w.shutdown()
    w.shutdown()
    w.shutdown(cancel=False)
    assert w.closed and not _new_threads(before)
    assert all(not t.is_alive() for t in started)
    with pytest.raises(RuntimeError, match="new CopyWorkers"):
        w.submit("fast->slow", addr(dst), addr(src), 1)


def test_shutdown_cancels_queued_waits_for_running(monkeypatch):
    before = set(threading.enumerate())
    w = ce.CopyWorkers(chunk=4096)
    bufs = [pair(8192, i) for i in range(4)]
    gate = Gate(monkeypatch, addr(bufs[0][1]), addr(bufs[0][1]) + 1)
    jobs = [w.submit("k", addr(d), addr(s), 8192) for s, d in bufs]
    assert gate.reached.wait(T)
    t = threading.Thread(target=w.shutdown)
    t.start()
    assert jobs[1].wait(T) and all(j.cancelled() for j in jobs[1:])
    assert not jobs[0].done()            # the running job is not cancelled
    gate.release.set()
    t.join(T)
    assert not t.is_alive() and not _new_threads(before)
    jobs[0].result()
    assert np.array_equal(bufs[0][0], bufs[0][1])
    assert all((d == GUARD).all() for _, d in bufs[1:])


def test_shutdown_without_cancel_runs_queued():
    w = ce.CopyWorkers(chunk=4096)
    bufs = [pair(30_000, i) for i in range(5)]
    jobs = [w.submit("k", addr(d), addr(s), 30_000) for s, d in bufs]
    w.shutdown(cancel=False)
    assert all(j.done() and not j.cancelled() for j in jobs)
    assert all(np.array_equal(s, d) for s, d in bufs)


def test_garbage_collected_workers_exit():
    before = set(threading.enumerate())
    w = ce.CopyWorkers(chunk=4096)
    src, dst = pair(100_000)
    job = w.submit("a", addr(dst), addr(src), src.nbytes)
    w.submit("b", addr(dst), addr(src), src.nbytes)
    started = _new_threads(before)
    assert len(started) == 2
    del w
    gc.collect()
    for t in started:
        t.join(T)
        assert not t.is_alive()
    assert job.done() and not job.cancelled()       # queued work still completed
    assert np.array_equal(dst, src)


def test_many_jobs_from_many_threads(workers):
    w = workers(chunk=8192)
    keys = ["fast->slow", "slow->fast", "slow->slow"]
    results, errors = [], []

    def client(tid):
        try:
            rng = np.random.default_rng(tid)
            mine = []
            for i in range(60):
                n = int(rng.integers(0, 200_000))
                src, dst = pair(n, tid * 1000 + i)
                job = w.submit(keys[i % 3], addr(dst), addr(src), n, keepalive=(src, dst))
                mine.append((job, src, dst))
                if i % 7 == 3:
                    job.cancel()
            for job, src, dst in mine:
                assert job.wait(T)
                if not job.cancelled():
                    job.result()
                    assert np.array_equal(dst, src)
                else:       # a cancelled job copied a prefix and left the rest untouched
                    k = job.copied
                    assert np.array_equal(dst[:k], src[:k]) and (dst[k:] == GUARD).all()
            results.append(len(mine))
        except BaseException as e:      # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T * 3)
    assert not errors, errors
    assert results == [60] * 4
    assert w.drain(T) and w.pending() == 0


def test_a_callback_added_while_others_run_runs_after_them(workers):
    """The job is done while its first callback runs: one added then still runs second, on
    the worker, not at once in the adding thread."""
    w = workers()
    started, go, seen = threading.Event(), threading.Event(), []

    def first(j):
        started.set()
        go.wait(T)
        seen.append(("first", threading.current_thread()))
    with w._s.cond:     # the worker cannot finish the job before its first callback is added
        job = w.submit("k", 0, 0, 0)
        job.add_done_callback(first)
    assert started.wait(T) and job.done()
    job.add_done_callback(lambda j: seen.append(("second", threading.current_thread())))
    assert seen == []
    go.set()
    assert w.drain(T)
    assert [s for s, _ in seen] == ["first", "second"]
    assert seen[0][1] is seen[1][1] is not threading.current_thread()
    job.add_done_callback(lambda j: seen.append(("late", threading.current_thread())))
    assert seen[-1] == ("late", threading.current_thread())


def test_a_cancelled_jobs_callbacks_run_in_order(workers, monkeypatch):
    w = workers(chunk=4096)
    src, dst = pair(8192)
    gate = Gate(monkeypatch, addr(dst), addr(dst) + 1)
    blocker = w.submit("k", addr(dst), addr(src), 8192)
    assert gate.reached.wait(T)
    job = w.submit("k", 0, 0, 0)
    seen = []
    job.add_done_callback(lambda j: seen.append(1))
    assert job.cancel() and job.done()
    job.add_done_callback(lambda j: seen.append(2))
    gate.release.set()
    blocker.result(T)
    assert w.drain(T) and seen == [1, 2]


# ---- waiting for the workers from their own done callbacks -----------------------------------

def test_done_callbacks_on_two_workers_may_both_shut_down(monkeypatch):
    # each callback's shutdown used to join the other worker, itself stuck in its callback
    w = ce.CopyWorkers(chunk=4096)
    both = threading.Barrier(2, timeout=T)
    src, dst = pair(20_000)
    gate = Gate(monkeypatch, addr(dst), addr(dst) + 20_000)
    returned = []

    def stop(job):
        both.wait()
        w.shutdown()
        returned.append(job.key)

    for i, key in enumerate(("fast->slow", "slow->fast")):
        job = w.submit(key, addr(dst) + 10_000 * i, addr(src) + 10_000 * i, 10_000)
        job.add_done_callback(stop)                  # runs on the worker: the copy is gated
    for _ in range(int(T / 0.001)):                  # both copies started: none is still queued
        if len(gate.calls) == 2:                     # for the shutdown below to cancel
            break
        threading.Event().wait(0.001)
    gate.release.set()
    # a third shutdown at the same time; cancel=False: a job its worker had not yet started
    # (a loaded machine) must still copy, for the data check below
    t = threading.Thread(target=w.shutdown, kwargs={"cancel": False}, daemon=True)
    t.start()
    t.join(T)
    assert not t.is_alive() and sorted(returned) == ["fast->slow", "slow->fast"]
    assert np.array_equal(dst, src)


def test_drain_from_a_done_callback_is_refused_not_a_hang(workers, monkeypatch):
    w = workers(chunk=4096)
    src, dst = pair(10_000)
    got, ran = [], threading.Event()
    gate = Gate(monkeypatch, addr(dst), addr(dst) + 1)

    def drain(job):
        try:
            got.append(w.drain(T))
        except RuntimeError as e:
            got.append(e)
        ran.set()

    job = w.submit("k", addr(dst), addr(src), src.nbytes)
    assert gate.reached.wait(T)
    job.add_done_callback(drain)                      # runs on the worker
    gate.release.set()
    assert ran.wait(2 * T)
    assert isinstance(got[0], RuntimeError) and "own done callbacks" in str(got[0])
    assert w.drain(T)


def test_waiting_from_a_done_callback_for_a_job_behind_it_is_refused(workers, monkeypatch):
    w = workers(chunk=4096)
    bufs = [pair(10_000, i) for i in range(3)]
    gate = Gate(monkeypatch, addr(bufs[0][1]), addr(bufs[0][1]) + 1)
    got, ran = [], threading.Event()

    def wait_for_others(job):
        for other in (later, elsewhere):
            try:
                got.append(other.wait(T))
            except RuntimeError as e:
                got.append(e)
        ran.set()

    first = w.submit("k", addr(bufs[0][1]), addr(bufs[0][0]), 10_000)
    later = w.submit("k", addr(bufs[1][1]), addr(bufs[1][0]), 10_000)      # same worker
    elsewhere = w.submit("j", addr(bufs[2][1]), addr(bufs[2][0]), 10_000)  # another worker
    assert gate.reached.wait(T)
    first.add_done_callback(wait_for_others)          # runs on the worker of "k"
    gate.release.set()
    assert ran.wait(2 * T)
    assert isinstance(got[0], RuntimeError) and "add a done callback" in str(got[0])
    assert got[1] is True
    assert w.drain(T) and all(np.array_equal(s, d) for s, d in bufs)


@pytest.mark.parametrize("key", [[1, 2], {"a": 1}, {1}, ("fast", ["slow"]), np.zeros(2)],
                         ids=lambda k: type(k).__name__)
def test_an_unhashable_key_is_named_and_nothing_is_queued(workers, key):
    w = workers()
    src, dst = pair(64)
    with pytest.raises(TypeError, match="cannot name a worker.*pass a str"):
        w.submit(key, addr(dst), addr(src), 64)
    with pytest.raises(TypeError, match="cannot name a worker.*pass a str"):
        w.pending(key)
    assert w.pending() == 0
    w.submit(("fast", "slow"), addr(dst), addr(src), 64).result(timeout=60)
    np.testing.assert_array_equal(dst, src)


@pytest.mark.parametrize("fn", [None, 3, "print"], ids=repr)
def test_a_done_callback_that_is_not_callable_is_refused_when_added(workers, fn):
    w = workers()
    src, dst = pair(64)
    job = w.submit("k", addr(dst), addr(src), 64)
    with pytest.raises(TypeError, match="not callable"):
        job.add_done_callback(fn)
    job.result(timeout=60)
    with pytest.raises(TypeError, match="not callable"):
        job.add_done_callback(fn)

