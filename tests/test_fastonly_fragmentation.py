"""FastOnly compacts fast memory when its free bytes would hold a new array but no free block
does: a replay at fast=1.0 holds what the fast-only run held, the moves are copies within fast
memory that the cost model charges, a real run and its replay agree, data survives and pinned
arrays stay put."""

import numpy as np
import pytest

import cachedarrays as ca
from cachedarrays import costmodel
from cachedarrays.errors import OutOfMemoryError
from cachedarrays.replay import evaluate

KB = 1024
FAST = 128 * KB + 3 * 256        # three blocks of 32, 64 and 32 KiB (headers rounded to 256 B)


def split_program(m):
    """32, 64 and 32 KiB arrays; the outer two freed (64 KiB free in two holes around the
    middle one); then a new 64 KiB array. Returns the middle one, a view of it and the new one."""
    a = ca.full(32 * KB, 1, dtype=np.uint8, manager=m)
    b = ca.asarray(np.arange(64 * KB, dtype=np.uint8), manager=m)
    c = ca.full(32 * KB, 3, dtype=np.uint8, manager=m)
    view = b[::2]
    ca.unsafe_free(a)
    ca.unsafe_free(c)
    d = ca.full(64 * KB, 4, dtype=np.uint8, manager=m)
    return b, view, d


def traced(fast, program=split_program):
    with ca.Manager(fast=fast, slow="1MiB", policy="fastonly") as m:
        with ca.trace(m) as t:
            out = program(m)
        values = [read(x) for x in out]
        stats = m.stats()
        m.check()
    return t, values, stats


def read(x):
    """x's values in an ndarray, without a new array in fast memory."""
    with ca.readable(x) as r:
        return np.array(r)


def copies(decisions):
    return [d for d in decisions if d[0] == "copy"]


def test_the_split_program_fits_its_footprint_only_after_compaction():
    t, _, _ = traced("4MiB")                    # room enough: no compaction when recorded
    assert t.footprint() == 128 * KB and t.footprint(0) == FAST
    assert not copies(t.decisions)
    run = ca.replay(t, "fast-only", fast=1.0)
    assert run.info["fast"] == t.footprint()
    moves = copies(run.decisions)
    assert [(d[2], d[4], d[6]) for d in moves] == [("fast", "fast", 64 * KB)]   # b slid down
    assert run.result.total.moved == {"fast->fast": 64 * KB}
    assert "defrag" not in {e[0] for e in run.trace.events}


def test_a_compaction_is_charged_as_a_copy_within_fast_memory():
    t, _, _ = traced("4MiB")
    run = ca.replay(t, "fast-only", fast=1.0)
    dram = costmodel.get_profile("dram")
    cost = dram.latency + 64 * KB / (min(dram.read_gbps, dram.write_gbps) * 1e9)
    assert run.result.total.stall == pytest.approx(cost, rel=1e-12)


def test_a_real_run_compacts_keeps_the_data_and_agrees_with_its_replay(tmp_path):
    _, want, _ = traced("4MiB")
    t, got, stats = traced(FAST)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)     # the view too: it follows b to its new place
    assert stats["events"]["compaction"] == {"count": 1, "bytes": 64 * KB}
    run = ca.replay(t, "fast-only", fast=FAST)
    assert run.decisions == t.decisions
    assert evaluate(t).result == run.result
    t.save(tmp_path / "t.trace")                # a saved trace keeps the charged moves
    assert evaluate(ca.Trace.load(tmp_path / "t.trace")).result == run.result


def test_a_pinned_array_stays_put_and_the_error_stays():
    with ca.Manager(fast=FAST, slow="1MiB", policy="fastonly") as m:
        a = ca.full(32 * KB, 1, dtype=np.uint8, manager=m)
        b = ca.asarray(np.arange(64 * KB, dtype=np.uint8), manager=m)
        c = ca.full(32 * KB, 3, dtype=np.uint8, manager=m)
        ca.unsafe_free(a)
        ca.unsafe_free(c)
        where = b.object.primary.offset
        with ca.readable(b) as raw:             # b is pinned: the holes stay split
            with pytest.raises(OutOfMemoryError, match=r"FastOnly policy: 64.0 KiB does not "
                               r"fit in fast memory \(64.5 KiB free of 128.8 KiB\)"):
                ca.empty(64 * KB, dtype=np.uint8, manager=m)
            np.testing.assert_array_equal(raw, np.arange(64 * KB, dtype=np.uint8))
        assert b.object.primary.offset == where
        m.check()


def test_a_kernel_operand_is_pinned_so_its_replay_fails_as_the_real_run_would():
    def program(m):
        b, _, _ = split_program(m)
        return (b + 1,)                          # b pinned while its output is placed
    t, _, _ = traced("4MiB", program)
    with pytest.raises(OutOfMemoryError, match="does not fit in fast memory"):
        ca.replay(t, "fast-only", fast=1.0)
    assert ca.replay(t, "fast-only", fast=1.25).result.total.moved == {}     # room enough


def test_no_compaction_when_the_free_bytes_would_not_hold_the_array():
    with ca.Manager(fast=FAST, slow="1MiB", policy="fastonly") as m:
        keep = [ca.zeros(32 * KB, dtype=np.uint8, manager=m) for _ in range(3)]
        ca.unsafe_free(keep[1])
        with pytest.raises(OutOfMemoryError, match=r"96.0 KiB does not fit in fast memory "
                           r"\(64.2 KiB free of 128.8 KiB\)"):
            ca.empty(96 * KB, dtype=np.uint8, manager=m)
        assert m.stats()["events"]["compaction"]["count"] == 0
        assert not m.compact("fast", 96 * KB)
        assert m.compact("fast", 32 * KB)       # fits already: nothing to slide
        assert m.stats()["events"]["compaction"]["count"] == 0


def test_a_program_defrag_stays_an_event_and_each_move_is_charged_like_a_compaction():
    def program(m):
        out = split_program(m)
        m.defrag("fast")
        return out
    t, _, stats = traced("4MiB", program)
    assert ("defrag", "fast") in t.events
    moved = copies(t.decisions)                 # b (64 KiB) and d (64 KiB) slide down
    assert [(d[2], d[4], d[6], d[7]) for d in moved] == [("fast", "fast", 64 * KB, True)] * 2
    assert stats["events"]["defrag_moves"] == {"count": 1, "bytes": 128 * KB}
    assert evaluate(t).result.total.moved == {"fast->fast": 128 * KB}


def test_a_torch_mlp_replays_under_fast_only_at_its_footprint():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 10))
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    t = ca.trace.from_torch(model, x, lambda out: torch.nn.functional.cross_entropy(out, y),
                            steps=2)
    run = ca.replay(t, "fast-only", fast=1.0)   # the free bytes were split before compaction
    assert run.result.total.moved.get("fast->fast", 0) > 0
    assert set(run.result.total.moved) == {"fast->fast"}
