"""The policy lab's corner cases: every move within a device is charged by the cost model,
whichever call made it; a method assigned on a policy object is never skipped; G10 and AutoTM
on three tiers put arrays where there is room and leave no stale copy; a trace's save never
writes through a name it did not make; a plan's unreachable points are reported; a replay
models the tiers and heaps the trace was recorded with."""

import gzip
import json
import os
import secrets
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays import costmodel
from cachedarrays.manager import Observer
from cachedarrays.policies import Policy
from cachedarrays.policies.autotm import AutoTM
from cachedarrays.replay import evaluate
from cachedarrays.trace import TraceError
from cachedarrays.triggers import Plan
from helpers import layered_steps

KB = 1024

# A program: arrays of these KiB; what happens to each (kept, freed, evicted to slow memory);
# then defragmentations and new arrays, which a policy may compact fast memory to place.
PROGRAMS = st.tuples(
    st.lists(st.tuples(st.integers(1, 40), st.sampled_from(["keep", "free", "free", "evict"])),
             min_size=2, max_size=8),
    st.lists(st.sampled_from(["fast", "slow"]), min_size=1, max_size=2),
    st.lists(st.integers(1, 64), max_size=3))


class Moves(Observer):
    """Bytes of every region a defragmentation or a compaction moved (on_compact is a move)."""

    def __init__(self):
        self.nbytes = 0

    def on_move(self, region, old_offset):
        self.nbytes += region.nbytes


def run_program(m, program):
    arrays, defrags, later = program
    made = [ca.full(kib * KB, i % 251, dtype=np.uint8, manager=m)
            for i, (kib, _) in enumerate(arrays)]
    live = []
    for x, (_, fate) in zip(made, arrays):
        if fate == "free":
            ca.unsafe_free(x)
        else:
            live.append(x)
            if fate == "evict":
                ca.evict(x)
    for device in defrags:
        m.defrag(device)
    for x in live:
        with ca.kernel("touch", (x,), ()):
            pass
    for kib in later:
        live.append(ca.full(kib * KB, 7, dtype=np.uint8, manager=m))
    ca.mark_step(m)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=PROGRAMS, policy=st.sampled_from(["lru", "fastonly", "firsttouch"]))
def test_every_byte_moved_within_a_device_is_charged_and_replays_alike(program, policy):
    """m.defrag (the program's) and m.compact (a policy's) move bytes the same way: the cost
    model charges each move as a copy within the device, as many bytes as telemetry counts,
    and a replay of the trace makes and charges the same moves."""
    fast, slow = 160 * KB, 2048 * KB
    moves = Moves()
    with ca.Manager(fast=fast, slow=slow, policy=policy) as m, ca.trace(m) as t:
        m.observe(moves)
        try:
            run_program(m, program)
        except ca.OutOfMemoryError:
            ca.mark_step(m)
        events = m.stats()["events"]
    slid = sum(events.get(e, {}).get("bytes", 0) for e in ("defrag_moves", "compaction"))
    assert slid == moves.nbytes
    result = evaluate(t).result
    within = sum(n for link, n in result.total.moved.items()
                 if link.split("->")[0] == link.split("->")[1])
    assert within == moves.nbytes
    run = ca.replay(t, policy, fast=fast, slow=slow)
    assert run.decisions == t.decisions
    assert run.result == result


def test_a_defragmentation_is_charged_as_a_copy_the_program_waits_for():
    with ca.Manager(fast="1MiB", slow="4MiB", policy="fastonly") as m, ca.trace(m) as t:
        a, b = ca.zeros(20000, manager=m), ca.asarray(np.arange(20000.0), manager=m)
        ca.unsafe_free(a)
        assert m.defrag("fast") == 1                    # b slides over a's block
        np.testing.assert_array_equal(np.asarray(b), np.arange(20000.0))
        ca.mark_step(m)
        assert m.stats()["events"]["defrag_moves"] == {"count": 1, "bytes": 160000}
    total = evaluate(t).result.total
    assert total.moved == {"fast->fast": 160000} and total.copies == {"fast->fast": 1}
    dram = costmodel.get_profile("dram")
    cost = dram.latency + 160000 / (min(dram.read_gbps, dram.write_gbps) * 1e9)
    assert abs(total.stall - cost) <= 1e-12 * cost


# ---- a method assigned on a policy object is honoured like a subclass's override -------------

POLICIES = [ca.policies.Policy, ca.policies.LRU, ca.policies.FirstTouch, ca.policies.FastOnly]


def new_arrays(m):
    """Five new arrays, through the general path and the manager's C paths (a ufunc's
    result, an array function's)."""
    x = ca.asarray(np.arange(64.0), manager=m)
    return [x, ca.empty(64, manager=m), x + 1, np.multiply(x, 2.0), ca.zeros_like(x)]


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", ["allocate", "alloc_fast"])
def test_an_allocation_method_assigned_on_the_policy_places_every_new_array(cls, method):
    policy, calls = cls(), []
    original = getattr(policy, method)

    def counted(nbytes, *args, **kwargs):
        calls.append(nbytes)
        return original(nbytes, *args, **kwargs)

    setattr(policy, method, counted)
    with ca.Manager(fast="1MiB", slow="4MiB", policy=policy) as m:
        made = new_arrays(m)
        assert calls == [x.nbytes for x in made]
        assert [np.asarray(x)[3] for x in made[2:4]] == [4.0, 6.0]


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", ["on_fast", "write_use"])
def test_a_use_hook_assigned_on_the_policy_hears_of_every_new_array_in_fast_memory(cls, method):
    policy, heard = cls(), []
    original = getattr(policy, method)

    def counted(obj):
        heard.append(obj.id)
        return original(obj)

    setattr(policy, method, counted)
    with ca.Manager(fast="1MiB", slow="4MiB", policy=policy) as m:
        made = new_arrays(m)
        assert {x.object.id for x in made} <= set(heard)


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("capability, method", [("honours_prefetch", "prefetch"),
                                                ("honours_softevict", "softevict"),
                                                ("tracks_reads", "read_use")])
def test_an_annotation_hook_assigned_on_the_policy_declares_its_capability(cls, capability,
                                                                          method):
    policy = cls()
    setattr(policy, method, lambda *args, **kwargs: True)
    assert getattr(policy, capability) is True
    assert getattr(cls(), capability) is getattr(cls, capability)   # the class keeps its own


def test_lru_keeps_an_assigned_allocate_when_local_alloc_changes():
    policy, calls = ca.policies.LRU(), []
    policy.allocate = lambda nbytes: calls.append(nbytes) or policy.alloc_slow(nbytes)
    policy.local_alloc = True
    with ca.Manager(fast="1MiB", slow="4MiB", policy=policy) as m:
        x = ca.asarray(np.arange(64.0), manager=m)
        y = x + 1
        assert calls == [512, 512] and y.device == "slow"


# ---- G10 on three tiers: a planned move to a tier without room goes elsewhere --------------

def _layers_trace():
    """Six 800 kB weights, a layer each, over four steps; every kernel 1 ms."""
    with ca.Manager(fast="64MiB", slow="64MiB", policy="fastonly") as m, ca.trace(m) as t:
        layered_steps(m, n=100_000, arrays=6)
    t.times = [1e-3] * len(t.times)
    return t


LAYERS = _layers_trace()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(ssd=st.integers(0, 8 << 10), middle_first=st.booleans())
@example(ssd=781, middle_first=True)           # a weight's block (800256 B) just does not fit
@example(ssd=782, middle_first=True)           # it just fits
def test_g10_sends_an_array_where_there_is_room_when_its_planned_tier_is_full(ssd, middle_first):
    """Either slow tier alone holds every array: whatever the size of the other (the SSD or the
    middle tier), G10 runs; a planned move that found its tier full is counted."""
    small, large = f"{max(ssd, 1)}KiB", "8MiB"
    pmem, nvme = (large, small) if middle_first else (small, large)
    tiers = [("dram", "3MiB"), ("pmem", pmem, None, "optane"), ("ssd", nvme, None, "nvme-ssd")]
    run = ca.replay(LAYERS, "g10", tiers=tiers)
    missed = run.stats["events"]["plan_missed"]["count"]
    total = run.result.total
    assert total.peak["pmem"] <= ca.parse_size(pmem) and \
        total.peak["ssd"] <= ca.parse_size(nvme)
    if max(ssd, 1) * KB < 800_256:              # no weight's block fits on the small tier
        small_tier = "ssd" if middle_first else "pmem"
        assert f"dram->{small_tier}" not in total.moved
        assert missed > 0 or not middle_first   # the plan wanted the SSD, the default


# ---- AutoTM's write-back on three tiers ------------------------------------------------------

@pytest.mark.parametrize("pmem_full", [False, True])
def test_autotm_writes_back_past_a_full_middle_tier_and_never_leaves_a_stale_copy(pmem_full):
    """A written array with an old copy on the SSD: its write-back goes to slow memory (or, when
    that is full, the SSD), the old copy is dropped, and every later move keeps the new values."""
    policy = AutoTM()
    tiers = [("dram", "1MiB"), ("pmem", "64KiB"), ("ssd", "4MiB")]
    with ca.Manager(tiers=tiers, policy=policy) as m:
        filler = ca.asarray(np.ones(7500), manager=m) if pmem_full else None
        if pmem_full:
            ca.evict(filler, to="pmem")
        x = ca.asarray(np.zeros(1000), manager=m)
        ca.evict(x, to="ssd")
        Policy.prefetch(policy, x.object)       # back in fast memory, its SSD copy linked
        with ca.writable(x) as a:
            a[:] = 7.0                          # the SSD copy is stale now
        assert policy.write_back(policy.ids.sid[x.object.id])
        assert sorted(x.object.regions) == ["dram", "ssd" if pmem_full else "pmem"]
        for move in (lambda: ca.evict(x), lambda: Policy.prefetch(policy, x.object),
                     lambda: ca.evict(x, to="ssd"), lambda: Policy.prefetch(policy, x.object),
                     lambda: ca.evict(x)):
            move()
            np.testing.assert_array_equal(np.asarray(x), np.full(1000, 7.0))
        m.check()


# ---- saving a trace never writes through a name someone else made ----------------------------

def _small_trace():
    with ca.Manager(fast="1MiB", slow="4MiB") as m, ca.trace(m) as t:
        x = ca.asarray(np.arange(64.0), manager=m)
        (x + 1).sum()
        ca.mark_step(m)
    return t


@pytest.mark.parametrize("planted", ["symlink", "file", "directory"])
def test_save_never_uses_a_temporary_name_someone_left_beside_the_path(tmp_path, monkeypatch,
                                                                       planted):
    """Whatever sits at a name a save would give its temporary file (a link to a victim file, a
    file, a directory; at the name a save by this thread used to take, or at the first random
    one), the victim is untouched, the save succeeds and leaves only the trace."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    names = iter(["a" * 16, "b" * 16])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(names))
    spots = [f".trace-{os.getpid()}-{threading.get_ident()}.tmp", f".trace-{'a' * 16}.tmp"]
    for name in spots:
        spot = tmp_path / name
        if planted == "symlink":
            spot.symlink_to(victim)
        elif planted == "file":
            spot.write_text("someone's")
        else:
            spot.mkdir()
    t = _small_trace()
    assert t.save(tmp_path / "t.trace") == str(tmp_path / "t.trace")
    assert victim.read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == sorted(["victim", "t.trace", *spots])
    assert os.path.isfile(tmp_path / "t.trace") and not os.path.islink(tmp_path / "t.trace")
    assert ca.Trace.load(tmp_path / "t.trace").events == t.events


def test_a_trace_of_a_newer_format_says_to_upgrade(tmp_path):
    p = tmp_path / "new.trace"
    _small_trace().save(p)
    with gzip.open(p, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    doc["version"] += 1
    with gzip.open(p, "wt", encoding="utf-8") as f:
        json.dump(doc, f)
    with pytest.raises(TraceError, match=r"newer than this cachedarrays reads.*upgrade"):
        ca.Trace.load(p)


# ---- a plan's points past the end of the step are reported, not silently idle ---------------

@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(kernels=st.integers(1, 4), layers=st.integers(0, 2),
       points=st.lists(st.one_of(st.tuples(st.sampled_from(["kernel", "kernel_end", "layer"]),
                                           st.integers(0, 6)),
                                 st.tuples(st.just("use"), st.sampled_from(["x", "y"]),
                                           st.integers(1, 6))), min_size=1, max_size=6))
def test_points_a_step_never_reaches_are_listed_and_counted_at_its_mark(kernels, layers, points):
    with ca.Manager(fast="1MiB", slow="4MiB") as m:
        plan = Plan(m)
        x = ca.asarray(np.ones(8), manager=m)
        sid = {"x": plan.ids.sid[x.object.id], "y": "never-made"}
        fired = []
        points = [(p[0], sid[p[1]], p[2]) if p[0] == "use" else p for p in points]
        for p in points:
            plan.at(p, lambda mm, p=p: fired.append(p))
        for _ in range(2):
            for k in range(kernels):
                with ca.kernel("k", (x,), ()):
                    pass
                if k < layers:
                    ca.mark_layer(m)
            ca.mark_step(m)
        reached = {"kernel": kernels, "kernel_end": kernels, "layer": min(layers, kernels)}
        never = sorted({p for p in points if p not in fired}, key=repr)
        uses = {sid["x"]: kernels}
        assert all(p[0] == "use" and p[2] > uses.get(p[1], 0) or
                   p[0] != "use" and p[1] >= reached[p[0]] for p in never)
        assert plan.unfired == never
        assert m.stats()["events"]["plan_unfired"]["count"] == (2 if never else 0)


# ---- a replay models the tiers at the speeds the trace was recorded with ---------------------

@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(slow=st.sampled_from(["optane", "cxl", "nvme-ssd", "optane-2lm"]),
       policy=st.sampled_from(["lru", "CA:0", "firsttouch"]), named=st.booleans(),
       saved=st.booleans())
def test_a_replay_without_a_profile_agrees_with_evaluate_of_the_recorded_run(
        tmp_path_factory, slow, policy, named, saved):
    options = {"preset": policy} if policy.startswith("CA:") else None
    name = "lru" if options else policy
    with ca.Manager(tiers=[("fast", "256KiB"), ("slow", "4MiB", None, slow)], policy=name,
                    policy_options=options) as m, ca.trace(m) as t:
        xs = [ca.asarray(np.ones(10000), manager=m) for _ in range(6)]
        for _ in range(2):
            for x in xs:
                with ca.kernel("k", (x,), (x,)):
                    pass
            ca.mark_step(m)
    if saved:
        t = ca.Trace.load(t.save(tmp_path_factory.mktemp("t") / "t.trace"))
    if named:
        run = ca.replay(t, name, tiers=[("fast", "256KiB"), ("slow", "4MiB")],
                        policy_options=options)
    else:
        run = ca.replay(t, name, fast="256KiB", slow="4MiB", policy_options=options)
    assert run.decisions == t.decisions
    assert run.result == evaluate(t).result


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(granularity=st.sampled_from([0, 64, 1024, 4096]),
       policy=st.sampled_from(["lru", "firsttouch", "fastonly"]), saved=st.booleans())
def test_a_replay_rounds_its_heaps_as_the_recorded_run_did(tmp_path_factory, granularity,
                                                          policy, saved):
    with ca.Manager(fast="96KiB", slow="1MiB", policy=policy, granularity=granularity) as m, \
            ca.trace(m) as t:
        for i in range(3):
            xs = [ca.full(1000 + 300 * j, float(j), manager=m) for j in range(4)]
            with ca.kernel("k", tuple(xs), ()):
                pass
            del xs[1:3]
            ca.mark_step(m)
    if saved:
        t = ca.Trace.load(t.save(tmp_path_factory.mktemp("t") / "t.trace"))
    run = ca.replay(t, policy, fast="96KiB", slow="1MiB")
    assert run.decisions == t.decisions
    assert run.result == evaluate(t).result
