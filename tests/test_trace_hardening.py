"""Traces, replays and the cost model at their edges: where a trace may be saved, what a
recording leaves attached to its manager, replay budgets and tiers, malformed traces and cost
model inputs, the names the README gives, and kernels of several threads."""

import copy
import gzip
import importlib
import json
import os
import pathlib
import re
import socket
import stat
import threading

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import costmodel
from cachedarrays.manager import Manager
from cachedarrays.replay import evaluate
from cachedarrays.trace import KernelClock, Recorder, StableIds, Trace, TraceError

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture
def m():
    with ca.Manager(fast="1MiB", slow="16MiB", granularity=256) as mgr:
        yield mgr


def program(m, steps=3, n=4096):
    """A small traced program: a named kernel, a ufunc, marks."""
    w = ca.asarray(np.arange(float(n)), manager=m)
    with ca.trace(m) as t:
        for _ in range(steps):
            h = ca.empty(n, manager=m)
            with ca.kernel("mul", reads=(w,), writes=(h,)) as (a, out):
                np.multiply(a, 2.0, out=out)
            ca.mark_layer(m)
            g = np.tanh(h)
            del h, g
            ca.mark_step(m)
    return t


def small():
    """A hand-made trace of two objects and one kernel."""
    return Trace({"a": 4096, "b": 4096},
                 [("alloc", "a", 4096, None), ("alloc", "b", 4096, None), ("kernel", 0),
                  ("end", 0), ("step",)],
                 [("k", ("a",), ("b",))], [1e-3], devices=["fast", "slow"])


def general_calls(monkeypatch):
    """A list that grows by one each time a manager call takes its general path."""
    calls = []
    general = Manager._run_general

    def counted(self, *a, **k):
        calls.append(1)
        return general(self, *a, **k)

    monkeypatch.setattr(Manager, "_run_general", counted)
    return calls


# ---- where a trace may be saved --------------------------------------------------------------

def _fifo(p):
    os.mkfifo(p)


def _socket(p):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()


def _null_device(p):
    try:
        os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(1, 3))     # a private /dev/null
    except PermissionError:
        pytest.skip("making a device node needs root")


@pytest.mark.parametrize("make", [_fifo, _socket, _null_device])
def test_save_refuses_what_is_not_a_regular_file_and_leaves_it_alone(tmp_path, make):
    p = tmp_path / "target"
    make(p)
    before = os.lstat(p)
    with pytest.raises(TraceError, match="pass the path of a regular file"):
        small().save(p)
    after = os.lstat(p)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode)
    assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert os.listdir(tmp_path) == ["target"]              # no temporary file was made


def test_save_refuses_a_directory_before_making_a_temporary_file(tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    with pytest.raises(IsADirectoryError, match="regular file"):
        small().save(d)
    assert os.listdir(tmp_path) == ["adir"]


def test_save_replaces_a_symlink_and_a_regular_file(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    link = tmp_path / "link.trace"
    link.symlink_to(target)
    small().save(link)
    assert not link.is_symlink() and target.read_bytes() == b"keep"
    small().save(link)                                       # now a regular file: replaced
    assert Trace.load(link).objects == small().objects


@pytest.mark.parametrize("spell", [str, os.fsencode, pathlib.Path])
def test_save_and_load_take_the_same_path_spellings(tmp_path, spell):
    target = tmp_path / "t.trace"
    back = small().save(spell(str(target)))
    assert back == str(target) and sorted(os.listdir(tmp_path)) == ["t.trace"]
    assert Trace.load(spell(str(target))).events == small().events


def test_save_and_load_refuse_what_is_not_a_path():
    with pytest.raises(TypeError, match="str, bytes or os.PathLike"):
        small().save(123)
    with pytest.raises(TypeError, match="str, bytes or os.PathLike"):
        Trace.load(None)


# ---- what a recording leaves attached ---------------------------------------------------------

def test_a_manager_has_no_observers_and_its_fast_path_after_a_trace(m, monkeypatch):
    x = ca.ones(64, manager=m)
    calls = general_calls(monkeypatch)
    np.add(x, 1.0)
    assert m._observers == () and calls == []
    with ca.trace(m) as t:
        np.add(x, 1.0)
        assert len(calls) == 1                              # observed: the general path
    assert t.kernels and m._observers == ()
    np.add(x, 1.0)
    y = x + 1
    assert len(calls) == 1                                  # the fast path is back
    del y


def test_nested_and_sequential_traces_detach_only_when_the_last_ends(m):
    x = ca.ones(64, manager=m)
    with ca.trace(m) as outer:
        with ca.trace(m) as inner:
            np.add(x, 1.0)
        assert any(isinstance(o, StableIds) for o in m._observers)
        np.add(x, 2.0)
    assert m._observers == ()
    assert len(outer.kernels) == 2 and len(inner.kernels) == 1
    with ca.trace(m) as again:
        np.add(x, 1.0)
    assert m._observers == () and len(again.kernels) == 1


def test_ids_of_live_objects_survive_between_recordings(m):
    with ca.trace(m):
        a = ca.ones(10, manager=m)
    with ca.trace(m) as second:
        pass
    sid = StableIds.of(m).sid[a.object.id]                  # of(): kept from now on
    assert ("alloc", sid, a.nbytes, "fast") in second.events
    assert not sid.startswith("anon:")
    with ca.trace(m):
        pass
    assert [type(o) for o in m._observers] == [StableIds]   # what of() keeps stays


def test_a_clock_kept_with_of_keeps_its_model_after_a_trace(m):
    clock = KernelClock.of(m)
    clock.model = lambda name, reads, writes: 0.5
    x = ca.ones(10, manager=m)
    with ca.trace(m) as t:
        np.add(x, 1.0)
    assert t.times == [0.5] and KernelClock.of(m) is clock and clock in m._observers


def test_a_recorder_closes_once_and_a_failed_start_leaves_nothing():
    mgr = ca.Manager(fast="1MiB", slow="16MiB")
    rec = Recorder(mgr)
    mgr.observe(rec)
    rec.close()
    rec.close()
    assert mgr._observers == ()
    mgr.close()
    with pytest.raises(ca.CachedArraysError):
        with ca.trace(mgr):
            pass
    assert mgr._observers == ()


def test_entering_a_recording_trace_again_is_an_error(m):
    x = ca.ones(10, manager=m)
    tr = ca.trace(m)
    with tr as first:
        with pytest.raises(RuntimeError, match="already recording"):
            with tr:
                pass
        np.add(x, 1.0)
    assert m._observers == ()
    np.add(x, 1.0)
    assert len(first.kernels) == 1                          # nothing recorded after the block
    with tr as second:                                      # one block after another: fine
        np.add(x, 1.0)
    assert len(second.kernels) == 1 and m._observers == ()


# ---- replay budgets and tiers -----------------------------------------------------------------

@pytest.fixture(scope="module")
def recorded():
    with ca.Manager(fast="1MiB", slow="16MiB", policy="fastonly") as mgr:
        return program(mgr)


@pytest.mark.parametrize("share", [0.05, 0.25, 0.5, 1.0, 1.5, 16.0, 17.0,
                                   np.float32(0.5), np.float64(2.0)])
def test_a_float_budget_is_always_that_share_of_the_footprint(recorded, share):
    foot = recorded.footprint()
    run = ca.replay(recorded, "lru", fast=share)
    assert run.info["fast"] == int(float(share) * foot)


@pytest.mark.parametrize("size, want", [(1 << 20, 1 << 20), (np.int64(300_000), 300_000),
                                        ("256KiB", 256 << 10), (0, 0)])
def test_an_int_or_size_string_budget_is_bytes(recorded, size, want):
    assert ca.replay(recorded, "lru", fast=size).info["fast"] == want


def test_a_budget_is_never_raised_to_a_minimum(recorded):
    tiny = 100 / recorded.footprint()                       # 100 bytes: less than a granule
    with pytest.raises(ValueError, match=r"fast=.*is 100 B, less than the smallest"):
        ca.replay(recorded, "lru", fast=tiny)
    with pytest.raises(ValueError, match=r"dram=.*less than the smallest"):
        ca.replay(recorded, "lru", tiers=[("dram", tiny), ("slow", 4.0)])
    assert ca.replay(recorded, "lru", fast=0.0).info["fast"] == 0


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf")])
def test_a_fraction_must_be_finite_and_not_negative(recorded, bad):
    with pytest.raises(ValueError, match="fraction of the trace's footprint"):
        ca.replay(recorded, "lru", fast=bad)


@pytest.mark.parametrize("tiers", ["abc", [("fast",), ("slow", 4.0)], [("fast", 0.5), 7],
                                   [(1, 0.5), ("slow", 4.0)], 5])
def test_malformed_tiers_name_the_expected_form(recorded, tiers):
    with pytest.raises(ValueError, match=r"\(name, size\) pairs"):
        ca.replay(recorded, "lru", tiers=tiers)


def test_tiers_take_fractions_like_fast(recorded):
    foot = recorded.footprint()
    run = ca.replay(recorded, "lru", tiers=[("dram", 0.5), ("pmem", 4.0)])
    assert run.info["fast"] == int(0.5 * foot) and run.devices == ["dram", "pmem"]


# ---- malformed traces -------------------------------------------------------------------------

def _first(d):
    return d["events"][0][1]


MALFORMED = {
    "alloc without size": lambda d: d["events"].append(["alloc", "zz"]),
    "alloc size a string": lambda d: d["events"].append(["alloc", "zz", "abc", None]),
    "alloc size negative": lambda d: d["events"].append(["alloc", "zz", -100, None]),
    "alloc size a float": lambda d: d["events"].append(["alloc", "zz", 8.5, None]),
    "alloc placement unknown": lambda d: d["events"].append(["alloc", "zz", 8, "bogus"]),
    "alloc sixth field": lambda d: d["events"].append(["alloc", "zz", 8, None, True, 3]),
    "alloc id a number": lambda d: d["events"].append(["alloc", 7, 8, None]),
    "prefetch without options": lambda d: d["events"].append(["prefetch", _first(d)]),
    "evict without options": lambda d: d["events"].append(["evict", _first(d)]),
    "evict wait not a bool": lambda d: d["events"].append(["evict", _first(d), None, "x"]),
    "defrag without device": lambda d: d["events"].append(["defrag"]),
    "step with a field": lambda d: d["events"].append(["step", 1]),
    "unknown event": lambda d: d["events"].append(["jump", 1]),
    "empty event": lambda d: d["events"].append([]),
    "end of a list": lambda d: d["events"].append(["end", [1]]),
    "time negative": lambda d: d["times"].__setitem__(0, -5.0),
    "time a string": lambda d: d["times"].__setitem__(0, "abc"),
    "time null": lambda d: d["times"].__setitem__(0, None),
    "time NaN": lambda d: d["times"].__setitem__(0, float("nan")),
    "time infinite": lambda d: d["times"].__setitem__(0, float("inf")),
    "time beyond a float": lambda d: d["times"].__setitem__(0, 10 ** 400),
    "time a bool": lambda d: d["times"].__setitem__(0, True),
    "kernel name a number": lambda d: d["kernels"][0].__setitem__(0, 5),
    "object size negative": lambda d: d["objects"].append(["zz", -1]),
    "objects a dict": lambda d: d.__setitem__("objects", {"ab": 1}),
    "devices a string": lambda d: d.__setitem__("devices", "fs"),
    "devices repeated": lambda d: d.__setitem__("devices", ["fast", "fast"]),
    "meta a list": lambda d: d.__setitem__("meta", [1, 2]),
    "touched negative": lambda d: d.__setitem__("touched", [[0, [[d["kernels"][0][1][0], -1]]]]),
    "touched not an operand": lambda d: d.__setitem__("touched", [[0, [["nosuch", 10]]]]),
    "partial not a write": lambda d: d.__setitem__("partial", [[0, ["nosuch"]]]),
    "version true": lambda d: d.__setitem__("version", True),
}


@pytest.fixture(scope="module")
def saved(recorded, tmp_path_factory):
    p = tmp_path_factory.mktemp("saved") / "good.trace"
    recorded.save(p)
    with gzip.open(p, "rt") as f:
        return json.load(f)


@pytest.mark.parametrize("edit", list(MALFORMED), ids=list(MALFORMED))
def test_load_refuses_a_malformed_trace_with_a_trace_error(saved, tmp_path, edit):
    d = copy.deepcopy(saved)
    MALFORMED[edit](d)
    p = tmp_path / "bad.trace"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps(d))
    with pytest.raises(TraceError, match="bad.trace"):
        Trace.load(p)


def test_load_refuses_deeply_nested_json(tmp_path):
    p = tmp_path / "deep.trace"
    with gzip.open(p, "wt") as f:
        f.write('{"format":"cachedarrays-trace","version":1,"meta":' + "[" * 100_000 +
                "]" * 100_000 + "}")
    with pytest.raises(TraceError, match="nests too deeply"):
        Trace.load(p)


@pytest.mark.parametrize("edit", [
    lambda t: t.events.append(("alloc", "c", -100, None)),
    lambda t: t.events.append(("alloc", "c")),
    lambda t: t.events.append(("prefetch", "a")),
    lambda t: t.events.append(("defrag",)),
    lambda t: t.times.__setitem__(0, -5.0),
    lambda t: t.times.__setitem__(0, float("nan")),
    lambda t: t.objects.__setitem__("a", -100),
], ids=["negative alloc", "short alloc", "short prefetch", "short defrag", "negative time",
        "NaN time", "negative object"])
def test_validate_and_replay_refuse_a_malformed_trace_made_in_python(edit):
    t = small()
    assert t.validate() and ca.replay(t, "lru", fast=1 << 20).last.time > 0
    edit(t)
    with pytest.raises(TraceError):
        t.validate()
    with pytest.raises(TraceError):
        ca.replay(t, "lru", fast=1 << 20)


# ---- the cost model's inputs ------------------------------------------------------------------

@pytest.mark.parametrize("times", [[float("nan")], [-3.0], [float("inf")], ["abc"], [None],
                                   [10 ** 400], [True], None, 5, "abc", {"x": 1}])
def test_the_cost_model_refuses_times_that_are_not_seconds(times):
    with pytest.raises(ValueError, match="times"):
        costmodel.evaluate(times, [("kernel", 0, ())], ["fast", "slow"])


@pytest.mark.parametrize("decisions", [
    [("kernel", 0, (("a", -10 ** 12, "slow", False),))],
    [("kernel", 0, (("a", "many", "slow", False),))],
    [("alloc", "a", "fast", 0, -8)],
    [("copy", "a", "slow", 0, "fast", 0, -8, True)],
    None, 5,
], ids=["operand bytes negative", "operand bytes a string", "alloc negative", "copy negative",
        "None", "a number"])
def test_the_cost_model_refuses_negative_or_missing_bytes(decisions):
    with pytest.raises(ValueError):
        costmodel.evaluate([1.0], decisions, ["fast", "slow"])


# ---- the names the README gives ---------------------------------------------------------------

def _policy_lab_sections():
    text = README.read_text()
    start = text.index("## Comparing policies")
    return text[start:text.index("### The policy benchmark", start)]


def test_every_dotted_name_in_the_policy_lab_sections_resolves():
    text = _policy_lab_sections()
    names = set(re.findall(r"\b(?:cachedarrays|ca)(?:\.[A-Za-z_]\w*)+", text))
    assert names
    for name in sorted(names):
        parts = name.split(".")
        for i in range(len(parts), 1, -1):      # import what is a module, as a reader would
            try:
                importlib.import_module(".".join(["cachedarrays", *parts[1:i]]))
                break
            except ImportError:
                continue
        obj = ca
        for part in parts[1:]:
            assert hasattr(obj, part), f"the README names {name}, which does not resolve"
            obj = getattr(obj, part)


def test_the_documented_evaluate_gives_a_traced_run_its_numbers(recorded):
    assert "from cachedarrays.replay import evaluate" in _policy_lab_sections()
    scope = {}
    exec("from cachedarrays.replay import evaluate", scope)
    run = scope["evaluate"](recorded)
    assert run is not None and run.ratio == evaluate(recorded).ratio


# ---- kernels of several threads ---------------------------------------------------------------

def _traced_threads(m, *bodies):
    """The trace of bodies run each on a thread of its own (none may raise)."""
    errors = []

    def run(body):
        try:
            body()
        except BaseException as e:              # pragma: no cover - reported below
            errors.append(e)

    with ca.trace(m) as t:
        threads = [threading.Thread(target=run, args=(body,)) for body in bodies]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors
    return t


def _kernel_between(m, arr, start, opened, end):
    """A thread's body: once start is set, open kernel "kb" on arr (then set opened) and hold
    it until end is set."""
    def body():
        start.wait(5)
        m.acquire([arr.object], [], "kb")
        opened.set()
        end.wait(5)
        m.release([arr.object])
    return body


def _interleaved(m):
    """Two threads: A's kernel makes an object while B's kernel, opened later, is still open;
    A frees it before B's kernel ends."""
    x, y = ca.ones(512, manager=m), ca.ones(512, manager=m)
    a_open, b_open, a_done = threading.Event(), threading.Event(), threading.Event()

    def a():
        try:
            m.acquire([x.object], [], "ka")
            a_open.set()
            b_open.wait(5)
            out = m.new_pinned(4096)            # made inside ka, pinned until ka's end
            m.release([x.object])
            m.release([out])
            m.free_object(out)
        finally:
            a_done.set()

    return _traced_threads(m, a, _kernel_between(m, y, a_open, b_open, a_done))


def test_an_object_made_inside_a_kernel_of_another_thread_replays_pinned_to_its_own(m):
    t = _interleaved(m)
    made = [e for e in t.events if e[0] == "alloc" and len(e) > 4]
    assert made == [("alloc", made[0][1], 4096, None, True, 1)]   # one kernel opened after
    t.validate()
    run = ca.replay(t, "lru", fast="1MiB", slow="16MiB")
    assert run.decisions == t.decisions
    old = t.copy()                          # without the field: pinned to the last kernel
    old.events = [e[:5] if e == made[0] else e for e in t.events]
    with pytest.raises(ca.CachedArraysError):
        ca.replay(old, "lru", fast="1MiB", slow="16MiB")
    with pytest.raises(TraceError, match="sixth field"):
        bad = t.copy()
        bad.events = [(*e[:5], 2) if e == made[0] else e for e in t.events]
        bad.validate()


def test_one_thread_records_no_sixth_field(m):
    x = ca.ones(100, manager=m)
    with ca.trace(m) as t:
        y = np.sqrt(x)
        with ca.kernel("k", (x,), ()):
            z = x + 1
    assert all(len(e) <= 5 for e in t.events if e[0] == "alloc")
    assert any(len(e) == 5 and e[4] is True for e in t.events if e[0] == "alloc")
    ca.replay(t, "lru", fast=1.0)
    del y, z


def test_an_object_held_through_its_threads_next_kernel_replays_pinned_to_that_kernel(m):
    """A's new object is held through A's next kernel; B opens a kernel in between."""
    x, y = ca.ones(512, manager=m), ca.ones(512, manager=m)
    made, b_open, a_done = threading.Event(), threading.Event(), threading.Event()

    def a():
        try:
            out = m.new_pinned(4096)            # pinned through the next kernel (a copy's)
            made.set()
            b_open.wait(5)
            m.acquire([x.object], [], "copy")
            m.release([x.object])
            m.release([out])
            m.free_object(out)
        finally:
            a_done.set()

    t = _traced_threads(m, a, _kernel_between(m, y, made, b_open, a_done))
    held = [e for e in t.events if e[0] == "alloc" and len(e) > 4]
    assert held == [("alloc", held[0][1], 4096, None, "next", 1)]   # one kernel to let pass
    t.validate()
    run = ca.replay(t, "lru", fast="1MiB", slow="16MiB")
    assert run.decisions == t.decisions
    old = t.copy()                              # without the field: held through B's kernel
    old.events = [e[:5] if e == held[0] else e for e in t.events]
    with pytest.raises(ca.CachedArraysError):
        ca.replay(old, "lru", fast="1MiB", slow="16MiB")
