"""The policy lab under careless or hostile input: a trace that validates saves and loads to an
equal trace (NumPy numbers included), a broken invariant is a TraceError from validation (and
from save, which never writes it), the cost model refuses records that are not data, a replay
refuses budgets it would ignore and policy options it does not know, and planning policies
refuse a malformed profile."""

import errno
import gzip
import json
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays import costmodel
from cachedarrays.stepprofile import StepProfile
from cachedarrays.trace import Trace, TraceError


# ---- traces made up by hypothesis ------------------------------------------------------------

sizes = st.one_of(st.integers(0, 1 << 40), st.integers(0, 1 << 20).map(np.int64),
                  st.integers(0, 1 << 20).map(np.uint32))
seconds = st.one_of(st.floats(0, 1e3, allow_nan=False), st.floats(0, 1.0).map(np.float32),
                    st.floats(0, 1.0).map(np.float64), st.integers(0, 10))
sid_names = st.text("abcxyz:#@~.0123456789", min_size=1, max_size=8)


@st.composite
def traces(draw):
    """A well-formed program: objects allocated before use and freed once, kernels that begin and
    end, annotations of live objects, marks; with touched bytes, pure and partial kernels."""
    t = Trace(devices=["fast", "slow"], meta={"source": "hypothesis"})
    live, n = [], 0
    for op in draw(st.lists(st.sampled_from(["alloc", "alloc", "free", "kernel", "kernel",
                                             "prefetch", "evict", "softevict", "layer", "step"]),
                            max_size=30)):
        if op == "alloc":
            sid = f"{draw(sid_names)}/{n}"
            n += 1
            size = draw(sizes)
            t.objects[sid] = size
            t.events.append(("alloc", sid, size, draw(st.sampled_from([None, "fast", "slow"]))))
            live.append(sid)
        elif op == "free" and live:
            t.events.append(("free", live.pop(draw(st.integers(0, len(live) - 1)))))
        elif op == "kernel":
            reads = tuple(draw(st.lists(st.sampled_from(live), max_size=3))) if live else ()
            writes = tuple(draw(st.lists(st.sampled_from(live), max_size=2))) if live else ()
            k = len(t.kernels)
            t.kernels.append((draw(st.sampled_from(["mm", "add", "view"])), reads, writes))
            t.times.append(draw(seconds))
            t.events += [("kernel", k), ("end", k)]
            if reads and draw(st.booleans()):
                t.touched[k] = {reads[0]: draw(sizes)}
            if writes and draw(st.booleans()):
                t.pure.add(k)
                t.partial[k] = [writes[0]]
            t.decisions.append(("kernel", k, tuple((s, 8, "fast", False) for s in reads)))
        elif op == "prefetch" and live:
            t.events.append(("prefetch", draw(st.sampled_from(live)), draw(st.booleans()),
                             draw(st.booleans())))
        elif op == "evict" and live:
            t.events.append(("evict", draw(st.sampled_from(live)),
                             draw(st.sampled_from([None, "slow"])), draw(st.booleans())))
        elif op == "softevict" and live:
            t.events.append(("softevict", draw(st.sampled_from(live))))
        elif op in ("layer", "step"):
            t.events.append((op,))
            t.decisions.append((op,))
    return t


def same(a, b):
    """The fields of two traces are equal (a loaded trace has tuples and plain numbers)."""
    return (a.objects == b.objects and list(map(tuple, a.events)) == b.events and
            [(n, tuple(r), tuple(w)) for n, r, w in a.kernels] == b.kernels and
            list(a.times) == b.times and a.devices == b.devices and a.touched == b.touched and
            a.pure == b.pure and a.partial == b.partial and a.meta == b.meta and
            a.decisions == b.decisions)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(t=traces())
def test_a_trace_that_validates_saves_and_loads_to_an_equal_trace(t, tmp_path):
    assert t.validate()
    back = Trace.load(t.save(tmp_path / "t.trace"))
    assert same(t, back)
    assert back.footprint() == t.footprint() and back.step_kernels() == t.step_kernels()
    assert back.footprint(256) == t.footprint(256)
    if t.kernels:
        a, b = StepProfile.of(t, -1), StepProfile.of(back, -1)
        assert a.live_bytes() == b.live_bytes() and a.peak() == b.peak()


# Each breaks an invariant whatever trace it is applied to.
BROKEN = {
    "a second free": lambda t: t.events.extend([("alloc", "!", 8, None), ("free", "!"),
                                                ("free", "!")]),
    "an alloc of a live id": lambda t: t.events.extend([("alloc", "!", 8, None),
                                                        ("alloc", "!", 8, None)]),
    "a kernel reading a freed object": lambda t: (
        t.kernels.append(("k", ("!",), ())), t.times.append(0.0),
        t.events.extend([("alloc", "!", 8, None), ("free", "!"), ("kernel", len(t.kernels) - 1)])),
    "a kernel reading an unknown id": lambda t: (
        t.kernels.append(("k", ("nosuch!",), ())), t.times.append(0.0),
        t.events.append(("kernel", len(t.kernels) - 1))),
    "a kernel row with a fourth field": lambda t: (t.kernels.append(("k", (), (), "x")),
                                                   t.times.append(0.0)),
    "a kernel row of two fields": lambda t: (t.kernels.append(("k", ())), t.times.append(0.0)),
    "an end of no kernel": lambda t: t.events.append(("end", 10 ** 6)),
    "a negative size": lambda t: t.events.append(("alloc", "!", -8, None)),
    "a NumPy float size": lambda t: t.events.append(("alloc", "!", np.float64(8), None)),
    "a NaN time": lambda t: (t.kernels.append(("k", (), ())), t.times.append(np.float32("nan"))),
    "a negative time": lambda t: (t.kernels.append(("k", (), ())), t.times.append(-1.0)),
    "a missing time": lambda t: t.kernels.append(("k", (), ())),
    "an event that is a number": lambda t: t.events.append(5),
    "a free of an id that is a list": lambda t: t.events.append(("free", ["x"])),
    "partial writes that are lists": lambda t: (
        t.kernels.append(("k", (), ("x",))), t.times.append(0.0),
        t.partial.__setitem__(len(t.kernels) - 1, [["x"]])),
    "touched by a kernel named by a string": lambda t: t.touched.__setitem__("0", {}),
    "touched bytes not a dict": lambda t: (t.kernels.append(("k", (), ())), t.times.append(0.0),
                                           t.touched.__setitem__(len(t.kernels) - 1, 5)),
    "a pure kernel named by a string": lambda t: t.pure.add("a"),
    "events not a list": lambda t: setattr(t, "events", None),
    "kernels not a list": lambda t: setattr(t, "kernels", 7),
    "times not a list": lambda t: setattr(t, "times", None),
    "objects a list": lambda t: setattr(t, "objects", [("a", 8)]),
    "pure a number": lambda t: setattr(t, "pure", 0),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(t=traces(), broken=st.sampled_from(sorted(BROKEN)))
def test_a_broken_invariant_is_a_trace_error_and_is_never_saved(t, broken, tmp_path):
    p = tmp_path / "kept.trace"
    t.save(p)
    before = p.read_bytes()
    BROKEN[broken](t)
    with pytest.raises(TraceError):
        t.validate()
    with pytest.raises(TraceError, match="left as it was"):
        t.save(p)
    assert p.read_bytes() == before and os.listdir(tmp_path) == ["kept.trace"]


# ---- saving ----------------------------------------------------------------------------------

def small():
    return Trace({"a": 8}, [("alloc", "a", 8, None), ("kernel", 0), ("end", 0), ("step",)],
                 [("k", ("a",), ())], [1e-3], devices=["fast", "slow"])


def test_a_trace_saves_under_the_longest_name_the_directory_takes(tmp_path):
    name = "t" * os.pathconf(tmp_path, "PC_NAME_MAX")
    t = small()
    assert same(t, Trace.load(t.save(tmp_path / name)))
    assert os.listdir(tmp_path) == [name]


def test_save_into_a_missing_directory_names_the_path_and_the_fix(tmp_path):
    path = tmp_path / "nosuch" / "t.trace"
    with pytest.raises(FileNotFoundError, match=r"cannot write .*nosuch/t\.trace.*its "
                                                r"directory exists") as e:
        small().save(path)
    assert e.value.errno == errno.ENOENT and ".tmp" not in str(e.value)


def test_meta_a_file_cannot_hold_is_named(tmp_path):
    t = small()
    t.meta["tags"] = {"x"}
    with pytest.raises(TypeError, match="set.*cannot store"):
        t.save(tmp_path / "t.trace")
    assert os.listdir(tmp_path) == []


def test_with_times_takes_a_trace():
    with pytest.raises(TypeError, match="with_times takes another Trace"):
        small().with_times([1.0])


# ---- replay's arguments ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def recorded():
    with ca.Manager(fast="4MiB", slow="64MiB", policy="fastonly") as m:
        w = ca.asarray(np.random.rand(64, 64), manager=m)
        with ca.trace(m) as t:
            for _ in range(3):
                hs = []
                for j in range(3):
                    h = ca.empty((64, 64), manager=m)
                    with ca.kernel(f"mm{j}", reads=(w,), writes=(h,)) as (a, out):
                        np.matmul(a, a, out=out)
                    hs.append(h)
                    ca.mark_layer(m)
                del h, hs
                ca.mark_step(m)
        del w
    return t.median_times()


@pytest.mark.parametrize("budget", [dict(fast=0.1), dict(slow="1MiB"), dict(fast=0, slow=0)])
def test_replay_refuses_fast_or_slow_beside_tiers(recorded, budget):
    with pytest.raises(ValueError, match="either tiers=.* or fast=/slow="):
        ca.replay(recorded, "lru", tiers=[("fast", 0.5), ("slow", 4.0)], **budget)


@pytest.mark.parametrize("granularity", ["abc", 1.5, True])
def test_replay_refuses_a_granularity_that_is_not_bytes(recorded, granularity):
    with pytest.raises(ValueError, match="granularity"):
        ca.replay(recorded, "lru", fast=0.5, granularity=granularity)


@pytest.mark.parametrize("policy,typo,meant", [
    ("lru", "presett", "preset"), ("autotm", "time_limt", "time_limit"),
    ("g10", "headrom", "headroom"), ("capuchin", "recomput", "recompute"),
    ("sentinel", "candidate", "candidates"), ("deeptm", "episode", "episodes"),
    ("memorymode", "linesize", "line_size"), ("fastonly", "preset", None),
    (ca.policies.LRU, "lookahed", "lookahead"),
])
def test_a_policy_option_typo_is_named_with_the_options_there_are(recorded, policy, typo,
                                                                   meant):
    with pytest.raises(TypeError, match=rf"\['{typo}'\] are not options.*its options are") as e:
        ca.replay(recorded, policy, fast=0.5, policy_options={typo: 1})
    assert (f"did you mean {meant!r}" in str(e.value)) == (meant is not None)
    assert "kernels_in_fast" in str(e.value)


# ---- the cost model's records ----------------------------------------------------------------

NOT_DATA = {
    "alloc of infinite bytes": ("alloc", "a", "slow", 0, math.inf),
    "copy of infinite bytes": ("copy", "a", "slow", 0, "fast", 0, math.inf, True),
    "copy beyond a float": ("copy", "a", "slow", 0, "fast", 0, 10 ** 400, True),
    "operand of infinite bytes": ("kernel", 0, (("a", math.inf, "slow", False),)),
    "operand beyond a float": ("kernel", 0, (("a", 10 ** 400, "slow", False),)),
    "operands a number": ("kernel", 0, 5),
    "operand a number": ("kernel", 0, (5,)),
    "operand id a list": ("kernel", 0, ((["a"], 8, "slow", False),)),
    "kernel index a bool": ("kernel", True, ()),
    "free at NaN": ("free", "a", "slow", math.nan, 8),
    "free at a string": ("free", "a", "slow", "x", 8),
    "free of None bytes": ("free", "a", "slow", 0, None),
    "device a list": ("alloc", "a", ["slow"], 0, 8),
    "alloc id a list": ("alloc", ["a"], "slow", 0, 8),
    "cancel id a dict": ("cancel", {}, "slow", "fast"),
}


@pytest.mark.parametrize("record", list(NOT_DATA.values()), ids=list(NOT_DATA))
def test_the_cost_model_refuses_a_record_that_is_not_data(record):
    with pytest.raises(ValueError, match="decision"):
        costmodel.evaluate([1.0, 1.0], [record], ["fast", "slow"])


@pytest.mark.parametrize("value", [math.nan, -1e12, math.inf, "x", None])
def test_a_cache_record_takes_byte_counts_only(value):
    decisions = [("kernel", 0, ()), ("cache", 0, value, 0, 0, 0, 0, 0)]
    with pytest.raises(ValueError, match="cache record's byte counts"):
        costmodel.evaluate([1.0], decisions, ["fast", "slow"])


# ---- planning policies' profiles -------------------------------------------------------------

def _malformed(trace):
    """The trace with a broken event inside its second step (the step a plan profiles)."""
    bad = trace.copy()
    at = [i for i, e in enumerate(bad.events) if e[0] == "step"][0] + 2
    bad.events.insert(at, ("kernel", 999))
    return bad


def test_a_step_profile_of_a_malformed_trace_is_a_trace_error(recorded):
    with pytest.raises(TraceError, match="no kernel 999"):
        StepProfile.of(_malformed(recorded), 1)


@pytest.mark.parametrize("policy", ["g10", "sentinel", "capuchin", "deeptm", "autotm"])
def test_a_planning_policy_refuses_a_malformed_profile(recorded, policy):
    with pytest.raises(TraceError, match="no kernel 999"):
        ca.replay(recorded, policy, fast=0.5, policy_options={"profile": _malformed(recorded)})


# ---- from_torch ------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["sgd", 0.01, object()])
def test_from_torch_names_an_optimizer_that_is_not_one(optimizer):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 3)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        ca.trace.from_torch(model, torch.ones(2, 4), lambda o: o.sum(), optimizer=optimizer)
    assert model.training and torch.is_grad_enabled()


@pytest.mark.parametrize("options", [dict(slow_output_factor=0.5), dict(fault_latency=-1.0),
                                     dict(fault_latency=float("nan")),
                                     dict(slow_output_factor="2")])
def test_replay_refuses_bad_cost_model_options_before_it_runs_the_policy(recorded, options,
                                                                        monkeypatch):
    ran = []
    real = ca.Manager.__init__

    def spy(self, *a, **k):
        ran.append(1)
        real(self, *a, **k)
    monkeypatch.setattr(ca.Manager, "__init__", spy)
    with pytest.raises(ValueError, match="slow_output_factor|fault_latency"):
        ca.replay(recorded, "lru", fast=0.5, **options)
    assert ran == []                          # refused before any replay work


@pytest.mark.parametrize("skip", [-1, 1.5, "1", True, None])
def test_median_times_takes_a_whole_number_of_steps_to_skip(recorded, skip):
    with pytest.raises(ValueError, match="skip="):
        recorded.median_times(skip=skip)
    assert recorded.median_times(skip=np.int64(0)).times    # NumPy integers serve
