"""Native heap through cachedarrays.heap.Heap: layouts, errors, evictfrom, defrag and a fuzz."""
import itertools
import logging
import mmap

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachedarrays._native import ffi
from cachedarrays.errors import CachedArraysError, OutOfMemoryError, UseAfterFreeError
from cachedarrays.heap import HEADER, Heap

KiB = 1024
MiB = 1024 * KiB
F = 0  # owner of a free block in layouts


def make(size, granularity=1024):
    """A heap over a fresh anonymous mapping, plus a uint8 view of the mapping."""
    buf = mmap.mmap(-1, max(size, mmap.PAGESIZE))
    return Heap(buf, size, granularity), np.frombuffer(buf, dtype=np.uint8)


def layout(h):
    """[(size, owner)] in address order; owner 0 marks a free block."""
    return [(b.size, b.owner if not b.free else F) for b in h.blocks()]


def fill(mem, h, off, owner):
    """Write a pattern derived from owner over the block's data."""
    n = h.info(off).size - HEADER
    start = off + HEADER
    mem[start:start + n] = (np.arange(n, dtype=np.uint32) * 7 + owner * 13) % 251


def intact(mem, h, off, owner, n=None):
    if n is None:
        n = h.info(off).size - HEADER
    start = off + HEADER
    want = (np.arange(n, dtype=np.uint32) * 7 + owner * 13) % 251
    return np.array_equal(mem[start:start + n], want.astype(np.uint8))


# ---------------------------------------------------------------- fundamentals


def test_new_heap_is_one_free_block_rounded_down_to_the_granularity():
    h, _ = make(4 * KiB + 100)
    assert h.capacity == 4 * KiB and h.granularity == 1024
    assert layout(h) == [(4096, F)]
    st_ = h.stats()
    assert (st_.used, st_.free, st_.largest_free, st_.nblocks, st_.nallocated) == (0, 4096, 4096, 1, 0)
    h.check()


def test_default_granularity_is_256_and_zero_bytes_take_one_granule():
    h, _ = make(64 * KiB, granularity=0)
    assert h.granularity == 256
    assert h.block_size(0) == 256
    assert h.block_size(256 - HEADER) == 256
    assert h.block_size(256 - HEADER + 1) == 512


def test_bad_arguments_are_rejected():
    buf = mmap.mmap(-1, 64 * KiB)
    base = ffi.cast("uintptr_t", ffi.from_buffer(buf))
    with pytest.raises(ValueError, match="64-byte aligned"):
        Heap(int(base) + 8, 32 * KiB)
    with pytest.raises(ValueError, match="power of two"):
        Heap(buf, 32 * KiB, granularity=96)
    with pytest.raises(ValueError, match="power of two"):
        Heap(buf, 32 * KiB, granularity=32)
    with pytest.raises(ValueError, match="at least one granule"):
        Heap(buf, 1000, granularity=1024)
    with pytest.raises(ValueError, match="fewer than the heap size"):
        Heap(buf, 128 * KiB)
    h = Heap(buf, 32 * KiB)
    with pytest.raises(ValueError, match="owner"):
        h.alloc(10, 0)
    with pytest.raises(ValueError, match="nbytes"):
        h.alloc(-1, 1)


def test_alloc_splits_low_part_and_fills_exactly():
    h, _ = make(4 * KiB)
    assert h.alloc(100, 1) == 0
    assert layout(h) == [(1024, 1), (3072, F)]
    assert h.alloc(1000, 2) == 1024            # 1000 + 64 header rounds up to 2 granules
    assert layout(h) == [(1024, 1), (2048, 2), (1024, F)]
    assert h.can_alloc(0) and not h.can_alloc(961)
    assert h.alloc(960, 3) == 3072             # exactly one granule with its header
    assert layout(h) == [(1024, 1), (2048, 2), (1024, 3)]
    assert not h.can_alloc(0)
    assert h.data_address(1024) == h.base_address + 1024 + HEADER
    assert h.data_address(1024) % 64 == 0
    st_ = h.stats()
    assert (st_.used, st_.free, st_.largest_free, st_.nblocks, st_.nallocated) == (4096, 0, 0, 3, 3)
    h.check()


@pytest.mark.parametrize("order", list(itertools.permutations([1, 2, 3])))
def test_free_coalesces_in_every_order(order):
    h, _ = make(4 * KiB)
    offs = {1: h.alloc(100, 1), 2: h.alloc(1000, 2), 3: h.alloc(900, 3)}
    for owner in order:
        h.free(offs[owner], owner)
        h.check()
        lay = layout(h)
        assert sum(size for size, _ in lay) == 4096
        assert all(not (a[1] == F and b[1] == F) for a, b in zip(lay, lay[1:]))
    assert layout(h) == [(4096, F)]


def test_free_merges_with_both_neighbours():
    h, _ = make(8 * KiB)
    a, b, c, d = (h.alloc(900, o) for o in (1, 2, 3, 4))
    h.free(a, 1)
    h.free(c, 3)
    assert layout(h) == [(1024, F), (1024, 2), (1024, F), (1024, 4), (4096, F)]
    h.free(b, 2)
    assert layout(h) == [(3072, F), (1024, 4), (4096, F)]
    h.check()


def test_exhaustion_raises_with_sizes_and_leaves_heap_intact():
    h, _ = make(4 * KiB)
    h.alloc(2000, 1)                            # 3 granules
    before = layout(h)
    with pytest.raises(OutOfMemoryError) as ei:
        h.alloc(1500, 2)
    msg = str(ei.value)
    for needle in ("1500 bytes", "block of 2048 bytes", "1024 of 4096 bytes are free",
                   "largest free block has 1024 bytes"):
        assert needle in msg, msg
    assert isinstance(ei.value, MemoryError)
    assert layout(h) == before
    h.check()
    with pytest.raises(OutOfMemoryError):
        h.alloc(1 << 40, 3)                      # larger than the whole heap
    h.check()


def test_random_fill_until_exhaustion_keeps_counters_right():
    rng = np.random.default_rng(1)
    h, _ = make(256 * KiB, 256)
    owner = 0
    while True:
        n = int(rng.integers(0, 8 * KiB))
        owner += 1
        if not h.can_alloc(n):
            with pytest.raises(OutOfMemoryError):
                h.alloc(n, owner)
            break
        h.alloc(n, owner)
        h.check()
    st_ = h.stats()
    assert st_.used + st_.free == st_.capacity
    assert st_.nallocated == owner - 1
    h.check()


def test_bad_frees_raise_and_change_nothing():
    h, _ = make(8 * KiB)
    a = h.alloc(100, 1)
    b = h.alloc(100, 2)
    c = h.alloc(100, 3)
    h.free(b, 2)
    snapshot = (layout(h), h.stats())
    cases = [
        (a, 2, "belongs to owner 1"),           # wrong owner
        (a, 0, "belongs to owner 1"),
        (b, 2, "already free"),                 # double free
        (a + 64, 1, "no block starts"),         # interior offset
        (a + 1024 + 512, 1, "no block starts"),
        (-1024, 1, "no block starts"),
        (1 << 40, 1, "no block starts"),
        (8 * KiB, 1, "no block starts"),        # one past the end
    ]
    for off, owner, why in cases:
        with pytest.raises(UseAfterFreeError, match=why) as ei:
            h.free(off, owner)
        assert f"offset {off}" in str(ei.value)
        assert (layout(h), h.stats()) == snapshot
        h.check()
    # a header that merged away (stale handle) must not validate
    h.free(c, 3)
    assert layout(h) == [(1024, 1), (7168, F)]
    with pytest.raises(UseAfterFreeError):
        h.free(c, 3)
    with pytest.raises(UseAfterFreeError):
        h.info(c)
    h.check()


def test_zero_byte_blocks_are_distinct_granules():
    h, _ = make(4 * KiB)
    x, y = h.alloc(0, 1), h.alloc(0, 2)
    assert x != y
    assert h.info(x).size == h.info(y).size == 1024
    h.free(x, 1)
    h.free(y, 2)
    assert layout(h) == [(4096, F)]


def test_exact_classes_pick_the_smallest_larger_block():
    h, _ = make(64 * KiB)
    blocks = [h.alloc(n * 1024 - HEADER, o + 1) for o, n in enumerate([5, 1, 3, 1, 2, 1])]
    h.free(blocks[0], 1)   # 5 granules
    h.free(blocks[2], 3)   # 3 granules
    h.free(blocks[4], 5)   # 2 granules
    assert h.alloc(2 * 1024 - HEADER, 10) == blocks[4]   # exact
    assert h.alloc(1024 - HEADER, 11) == blocks[2]       # smallest larger: the 3 one, split
    assert h.info(blocks[2]).size == 1024
    assert h.info(blocks[2] + 1024).free and h.info(blocks[2] + 1024).size == 2048
    h.check()


def test_overflow_class_is_best_fit():
    # granularity 64: the exact classes end at 65536 * 64 = 4 MiB; bigger free blocks share one list
    h, _ = make(16 * MiB, 64)
    big = {}
    for owner, size in ((1, 6 * MiB), (2, 4 * MiB + 512 * KiB), (3, 5 * MiB)):
        big[owner] = h.alloc(size - HEADER, owner)
        h.alloc(0, 100 + owner)                    # separator so the gaps stay apart
    for owner in (1, 2, 3):
        h.free(big[owner], owner)
    h.check()
    assert h.stats().largest_free == 6 * MiB
    assert h.alloc(4 * MiB + 256 * KiB - HEADER, 10) == big[2]   # smallest that fits
    assert h.alloc(4 * MiB + 768 * KiB - HEADER, 11) == big[3]
    assert h.alloc(5 * MiB + 512 * KiB - HEADER, 12) == big[1]
    assert not h.can_alloc(4 * MiB)
    h.check()


def test_changing_the_heap_during_blocks_iteration_raises():
    h, _ = make(8 * KiB)
    a, b = h.alloc(100, 1), h.alloc(100, 2)
    it = h.blocks()
    assert next(it).owner == 1
    h.free(b, 2)                                  # block 2 merges into the free tail
    h.free(a, 1)                                  # ...and block 1 too: offset 1024 is gone
    with pytest.raises(CachedArraysError, match="changed during blocks"):
        next(it)


def test_close_is_idempotent_and_closed_heap_raises():
    h, _ = make(4 * KiB)
    h.close()
    h.close()
    assert h.closed
    with pytest.raises(CachedArraysError, match="closed"):
        h.alloc(1, 1)


# ---------------------------------------------------------------- evictfrom

def four_blocks():
    """16 KiB heap of four 4 KiB blocks owned by 1..4 at 0, 4096, 8192, 12288."""
    h, mem = make(16 * KiB)
    offs = [h.alloc(4096 - HEADER, o) for o in (1, 2, 3, 4)]
    assert offs == [0, 4096, 8192, 12288]
    for o, off in zip((1, 2, 3, 4), offs):
        fill(mem, h, off, o)
    return h, mem


class Evictor:
    """evictfrom callback that frees blocks, refuses pinned owners and records the calls."""

    def __init__(self, h, pinned=(), also_free=None, raise_on=None, raise_after_free=False):
        self.h, self.pinned, self.calls = h, set(pinned), []
        self.also_free = also_free or {}
        self.raise_on, self.raise_after_free = raise_on, raise_after_free

    def __call__(self, off, owner):
        self.calls.append(owner)
        if owner == self.raise_on and not self.raise_after_free:
            raise KeyError(f"callback failed on {owner}")
        if owner in self.pinned:
            return False
        self.h.free(off, owner)
        for other_off, other_owner in self.also_free.get(owner, ()):
            self.h.free(other_off, other_owner)
        if owner == self.raise_on:
            raise KeyError(f"callback failed on {owner}")
        return True


def test_evictfrom_forward_one_block():
    h, _ = four_blocks()
    ev = Evictor(h)
    assert h.evictfrom(0, 4096 - HEADER, ev) == 0
    assert ev.calls == [1]
    assert layout(h) == [(4096, F), (4096, 2), (4096, 3), (4096, 4)]
    h.check()


def test_evictfrom_collects_the_whole_block_size_not_just_nbytes():
    h, _ = four_blocks()
    ev = Evictor(h)
    assert h.evictfrom(0, 4096, ev) == 0        # 4096 + header needs a second block
    assert ev.calls == [1, 2]
    assert layout(h) == [(8192, F), (4096, 3), (4096, 4)]
    assert h.can_alloc(4096)


def test_evictfrom_forward_then_backward():
    h, mem = four_blocks()
    ev = Evictor(h)
    assert h.evictfrom(8192, 3 * 4096 - HEADER, ev) == 4096
    assert ev.calls == [3, 4, 2]
    assert layout(h) == [(4096, 1), (12288, F)]
    assert h.alloc(4096 - HEADER, 9) == 4096
    assert intact(mem, h, 0, 1)
    h.check()


def test_evictfrom_absorbs_free_blocks_without_callbacks():
    h, _ = four_blocks()
    h.free(4096, 2)
    ev = Evictor(h)
    assert h.evictfrom(0, 2 * 4096 - HEADER, ev) == 0
    assert ev.calls == [1]
    assert layout(h) == [(8192, F), (4096, 3), (4096, 4)]


def test_evictfrom_refusal_in_the_middle_of_the_forward_walk():
    h, mem = four_blocks()
    ev = Evictor(h, pinned={2})
    assert h.evictfrom(0, 2 * 4096 - HEADER, ev) == 8192
    assert ev.calls == [1, 2, 3, 4]
    assert layout(h) == [(4096, F), (4096, 2), (8192, F)]
    assert intact(mem, h, 4096, 2)
    h.check()


def test_evictfrom_refusal_of_the_start_block():
    h, mem = four_blocks()
    ev = Evictor(h, pinned={2})
    assert h.evictfrom(4096, 2 * 4096 - HEADER, ev) == 8192
    assert ev.calls == [2, 3, 4]
    assert layout(h) == [(4096, 1), (4096, 2), (8192, F)]
    assert intact(mem, h, 0, 1) and intact(mem, h, 4096, 2)
    h.check()


def test_evictfrom_refusal_in_the_backward_walk_ends_without_a_block():
    h, mem = four_blocks()
    ev = Evictor(h, pinned={2})
    assert h.evictfrom(8192, 3 * 4096 - HEADER, ev) is None
    assert ev.calls == [3, 4, 2, 1]
    assert layout(h) == [(4096, F), (4096, 2), (8192, F)]   # every freed byte returned
    assert intact(mem, h, 4096, 2)
    h.check()


def test_evictfrom_refusal_forward_then_success_backward():
    h, mem = four_blocks()
    ev = Evictor(h, pinned={4})
    assert h.evictfrom(4096, 3 * 4096 - HEADER, ev) == 0
    assert ev.calls == [2, 3, 4, 1]
    assert layout(h) == [(12288, F), (4096, 4)]
    assert intact(mem, h, 12288, 4)
    h.check()


def test_evictfrom_with_every_block_pinned_changes_nothing():
    h, mem = four_blocks()
    ev = Evictor(h, pinned={1, 2, 3, 4})
    assert h.evictfrom(4096, 4096 - HEADER, ev) is None
    assert ev.calls == [2, 3, 4, 1]
    assert layout(h) == [(4096, 1), (4096, 2), (4096, 3), (4096, 4)]
    assert all(intact(mem, h, off, o) for o, off in zip((1, 2, 3, 4), (0, 4096, 8192, 12288)))
    h.check()


def test_evictfrom_callback_freeing_the_neighbour_ahead():
    h, _ = four_blocks()
    ev = Evictor(h, also_free={1: [(4096, 2)]})
    assert h.evictfrom(0, 2 * 4096 - HEADER, ev) == 0
    assert ev.calls == [1]
    assert layout(h) == [(8192, F), (4096, 3), (4096, 4)]
    h.check()


def test_evictfrom_callback_freeing_the_neighbour_behind():
    h, _ = four_blocks()
    ev = Evictor(h, also_free={3: [(4096, 2)]})
    assert h.evictfrom(8192, 3 * 4096 - HEADER, ev) == 4096
    assert ev.calls == [3, 4]
    assert layout(h) == [(4096, 1), (12288, F)]
    h.check()


def test_evictfrom_callback_freeing_a_block_it_already_refused():
    h, _ = four_blocks()
    # 2 is refused; then while handling 3 the callback frees 2 after all
    ev = Evictor(h, pinned={2}, also_free={3: [(4096, 2)]})
    assert h.evictfrom(0, 4 * 4096 - HEADER, ev) == 0
    assert ev.calls == [1, 2, 3, 4]
    assert layout(h) == [(16384, F)]
    h.check()


def test_evictfrom_callback_that_frees_but_refuses_still_gives_up_the_block():
    h, _ = four_blocks()

    def cb(off, owner):
        h.free(off, owner)
        return False

    assert h.evictfrom(0, 4096 - HEADER, cb) == 0
    assert layout(h) == [(4096, F), (4096, 2), (4096, 3), (4096, 4)]
    h.check()


def test_evictfrom_callback_claiming_success_without_freeing_is_a_refusal(caplog):
    h, mem = four_blocks()
    seen = []

    def liar(off, owner):
        seen.append(owner)
        return True

    with caplog.at_level(logging.WARNING, logger="cachedarrays.heap"):
        assert h.evictfrom(0, 4096 - HEADER, liar) is None
    assert seen == [1, 2, 3, 4]
    assert "without freeing" in caplog.text
    assert layout(h) == [(4096, 1), (4096, 2), (4096, 3), (4096, 4)]
    assert intact(mem, h, 0, 1)
    h.check()


@pytest.mark.parametrize("after_free", [False, True])
def test_evictfrom_callback_exception_is_reraised_and_heap_stays_consistent(after_free):
    h, mem = four_blocks()
    ev = Evictor(h, raise_on=2, raise_after_free=after_free)
    with pytest.raises(KeyError, match="callback failed on 2"):
        h.evictfrom(0, 3 * 4096 - HEADER, ev)
    assert ev.calls == [1, 2]                    # nothing else handed out after the error
    h.check()
    if after_free:
        assert layout(h) == [(8192, F), (4096, 3), (4096, 4)]
    else:
        assert layout(h) == [(4096, F), (4096, 2), (4096, 3), (4096, 4)]
        assert intact(mem, h, 4096, 2)
    assert intact(mem, h, 8192, 3) and intact(mem, h, 12288, 4)
    st_ = h.stats()
    assert st_.used + st_.free == st_.capacity
    # the heap is usable again
    assert h.alloc(0, 50) == 0


def test_exception_in_a_nested_walk_on_another_heap_stays_with_that_walk():
    outer, _ = four_blocks()
    inner, _ = four_blocks()
    caught = []

    def inner_cb(off, owner):
        raise ValueError("inner failed")

    def outer_cb(off, owner):
        try:
            inner.evictfrom(0, 10, inner_cb)
        except ValueError as e:
            caught.append(str(e))
        outer.free(off, owner)
        return True

    assert outer.evictfrom(0, 10, outer_cb) == 0
    assert caught == ["inner failed"]
    outer.check()
    inner.check()
    assert layout(inner) == [(4096, 1), (4096, 2), (4096, 3), (4096, 4)]


def test_evictfrom_larger_than_the_heap_returns_none_without_callbacks():
    h, _ = four_blocks()
    ev = Evictor(h)
    assert h.evictfrom(0, 16 * KiB, ev) is None
    assert ev.calls == []
    assert len(layout(h)) == 4


def test_evictfrom_of_the_whole_heap():
    h, _ = four_blocks()
    ev = Evictor(h)
    assert h.evictfrom(8192, 16 * KiB - HEADER, ev) == 0
    assert sorted(ev.calls) == [1, 2, 3, 4]
    assert layout(h) == [(16384, F)]


def test_heap_is_busy_during_evictfrom():
    h, _ = four_blocks()
    errors = []

    def cb(off, owner):
        for attempt in (lambda: h.alloc(10, 99), lambda: h.evictfrom(0, 10, cb),
                        lambda: h.defrag()):
            try:
                attempt()
            except CachedArraysError as e:
                errors.append(str(e))
        h.check()                                  # consistent mid-walk
        h.free(off, owner)
        h.check()
        return True

    assert h.evictfrom(0, 100, cb) == 0
    assert len(errors) == 3
    assert "being evicted" in errors[0]
    assert h.alloc(10, 99) == 0


def test_evictfrom_bad_start_raises():
    h, _ = four_blocks()
    with pytest.raises(UseAfterFreeError, match="not a block"):
        h.evictfrom(100, 10, lambda off, owner: True)


# ---------------------------------------------------------------- defrag


def gappy():
    """Layout F A1(2) A2 F(2) A3 A4 A5(2) F(rest) in a 16-granule heap, data filled."""
    h, mem = make(16 * KiB)
    sizes = [(9, 1), (1, 2), (2, 1), (8, 2), (3, 1), (4, 1), (5, 2)]
    offs = {}
    for owner, units in sizes:
        offs[owner] = h.alloc(units * 1024 - HEADER, owner)
    h.free(offs.pop(9), 9)
    h.free(offs.pop(8), 8)
    for owner, off in offs.items():
        fill(mem, h, off, owner)
    assert layout(h) == [(1024, F), (2048, 1), (1024, 2), (2048, F), (1024, 3), (1024, 4),
                         (2048, 5), (6144, F)]
    return h, mem


def test_defrag_slides_every_block_down_and_keeps_data():
    h, mem = gappy()
    moves = []

    def cb(owner, old, new):
        moves.append((owner, old, new))
        return True

    assert h.defrag(cb) == 5
    assert moves == [(1, 1024, 0), (2, 3072, 2048), (3, 6144, 3072), (4, 7168, 4096),
                     (5, 8192, 5120)]
    assert layout(h) == [(2048, 1), (1024, 2), (1024, 3), (1024, 4), (2048, 5), (9216, F)]
    for owner, _, new in moves:
        assert intact(mem, h, new, owner)
        assert h.info(new).owner == owner
    h.check()
    assert h.defrag(cb) == 0


def test_defrag_leaves_pinned_blocks_and_their_gaps():
    h, mem = gappy()
    moves = []

    def cb(owner, old, new):
        moves.append(owner)
        return owner != 2

    assert h.defrag(cb) == 4
    assert moves == [1, 2, 3, 4, 5]
    assert layout(h) == [(2048, 1), (1024, F), (1024, 2), (1024, 3), (1024, 4), (2048, 5),
                         (8192, F)]
    where = {b.owner: b.offset for b in h.blocks() if not b.free}
    for owner, off in where.items():
        assert intact(mem, h, off, owner)
    # the stale offset of a moved block no longer names a block
    with pytest.raises(UseAfterFreeError):
        h.free(8192, 5)
    h.check()


def test_defrag_without_callback_and_on_full_or_empty_heaps():
    h, mem = gappy()
    assert h.defrag() == 5
    assert layout(h)[-1] == (9216, F)
    e, _ = make(8 * KiB)
    assert e.defrag() == 0
    full, _ = make(4 * KiB)
    for o in (1, 2, 3, 4):
        full.alloc(0, o)
    assert full.defrag() == 0


def test_defrag_callback_exception_pins_and_is_reraised():
    h, mem = gappy()

    def cb(owner, old, new):
        if owner == 3:
            raise RuntimeError("cannot move 3")
        return True

    with pytest.raises(RuntimeError, match="cannot move 3"):
        h.defrag(cb)
    h.check()
    for b in h.blocks():
        if not b.free:
            assert intact(mem, h, b.offset, b.owner)
    assert h.info(6144).owner == 3                # stayed put


def test_free_inside_defrag_callback_is_refused():
    h, _ = gappy()
    errors = []

    def cb(owner, old, new):
        try:
            h.free(old, owner)
        except CachedArraysError as e:
            errors.append(e)
        return True

    h.defrag(cb)
    assert len(errors) == 5 and "defrag" in str(errors[0])
    h.check()


# ---------------------------------------------------------------- fuzz

class Boom(Exception):
    """Raised by a fuzzed evictfrom callback."""


SMALL = st.integers(0, 6 * KiB)
LARGE = st.integers(4 * MiB - 64 * KiB, 5 * MiB)
# pattern of owner o at byte i is (31*o + i) % 253: a slice of one precomputed ramp
RAMP = (np.arange(5 * MiB + 256, dtype=np.uint32) % 253).astype(np.uint8)


class HeapMachine(RuleBasedStateMachine):
    """Random alloc/free/evictfrom/defrag against a model of live blocks and their bytes."""

    heap_size, granularity = 12 * MiB, 64         # granularity 64: blocks > 4 MiB use the overflow class

    def __init__(self):
        super().__init__()
        self.h, self.mem = make(self.heap_size, self.granularity)
        self.live = {}                            # owner -> (offset, nbytes)
        self.next_owner = 1

    def _fill(self, owner, off, n):
        s, k = off + HEADER, owner * 31 % 253
        self.mem[s:s + n] = RAMP[k:k + n]

    def _ok(self, owner, off, n):
        s, k = off + HEADER, owner * 31 % 253
        return np.array_equal(self.mem[s:s + n], RAMP[k:k + n])

    @rule(n=st.one_of(SMALL, SMALL, SMALL, LARGE))
    def alloc(self, n):
        owner = self.next_owner
        self.next_owner += 1
        could = self.h.can_alloc(n)
        try:
            off = self.h.alloc(n, owner)
        except OutOfMemoryError:
            assert not could
            return
        assert could
        assert self.h.info(off).size == self.h.block_size(n)
        self.live[owner] = (off, n)
        self._fill(owner, off, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        owner = data.draw(st.sampled_from(sorted(self.live)))
        off, _ = self.live.pop(owner)
        self.h.free(off, owner)
        with pytest.raises(UseAfterFreeError):
            self.h.free(off, owner)

    @rule(data=st.data(), n=st.one_of(SMALL, LARGE), pin_some=st.booleans(),
          free_others=st.booleans(), raise_at=st.one_of(st.none(), st.integers(0, 3)))
    def evictfrom(self, data, n, pin_some, free_others, raise_at):
        blocks = list(self.h.blocks())
        start = data.draw(st.sampled_from(blocks)).offset
        pinned = set()
        if pin_some and self.live:
            pinned = set(data.draw(st.lists(st.sampled_from(sorted(self.live)), max_size=4)))
        extra = data.draw(st.randoms(use_true_random=False))

        calls = []

        def cb(off, owner):
            calls.append(owner)
            assert self.live[owner][0] == off
            assert self._ok(owner, off, self.live[owner][1])
            if owner in pinned:
                if len(calls) - 1 == raise_at:
                    raise Boom(owner)
                return False
            self.h.free(off, owner)
            del self.live[owner]
            if free_others and self.live and extra.random() < 0.3:
                other = extra.choice(sorted(self.live))
                self.h.free(self.live.pop(other)[0], other)
            if len(calls) - 1 == raise_at:
                raise Boom(owner)                 # after freeing: the walk must absorb it
            return True

        try:
            res = self.h.evictfrom(start, n, cb)
        except Boom:
            assert raise_at == len(calls) - 1     # raised exactly once, no callbacks after it
            return
        assert raise_at is None or raise_at >= len(calls)
        need = self.h.block_size(n)
        if res is not None:
            b = self.h.info(res)
            assert b.free and b.size >= need
            assert self.h.can_alloc(n)            # the collected block serves the request
        elif not pinned:
            assert need > self.h.capacity

    @rule(data=st.data())
    def defrag(self, data):
        pinned = set()
        if self.live:
            pinned = set(data.draw(st.lists(st.sampled_from(sorted(self.live)), max_size=3)))

        def cb(owner, old, new):
            assert self.live[owner][0] == old and new < old
            if owner in pinned:
                return False
            self.live[owner] = (new, self.live[owner][1])
            return True

        self.h.defrag(cb)
        if not pinned:
            frees = [b for b in self.h.blocks() if b.free]
            assert len(frees) <= 1 and (not frees or frees[0].offset + frees[0].size == self.h.capacity)

    @invariant()
    def consistent(self):
        self.h.check()
        blocks = {b.offset: b for b in self.h.blocks()}
        assert sum(1 for b in blocks.values() if not b.free) == len(self.live)
        for owner, (off, n) in self.live.items():
            assert blocks[off].owner == owner
            assert self._ok(owner, off, n), f"owner {owner} data damaged at offset {off}"


class CrowdedHeapMachine(HeapMachine):
    """The same rules on a small heap where most requests collide with live blocks."""

    heap_size, granularity = 10 * 6 * KiB, 256


TestHeapFuzz = HeapMachine.TestCase
TestHeapFuzz.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestCrowdedHeapFuzz = CrowdedHeapMachine.TestCase
TestCrowdedHeapFuzz.settings = settings(max_examples=250, stateful_step_count=50, deadline=None)
