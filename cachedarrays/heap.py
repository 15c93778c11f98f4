"""Thin Python wrapper over the native heap (one heap over one caller-supplied mapping).

Blocks are named by their header offset from the heap base; the data of a block starts
`HEADER` bytes after it. This is the only module that touches the native heap API.
"""
from __future__ import annotations

import logging
import operator
import threading
from collections import namedtuple
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from cachedarrays._native import ffi, lib
from cachedarrays._records import HeapRecord
from cachedarrays.errors import (
    CachedArraysError,
    HeapCorruptionError,
    OutOfMemoryError,
    UseAfterFreeError,
)

log = logging.getLogger(__name__)

HEADER = lib.CA_HEADER
"""Bytes of in-heap header before each block's data."""

BlockInfo = namedtuple("BlockInfo", "offset size owner free evicting")
BlockInfo.__doc__ = """One block: header offset, size (header included), owner (0 if free), flags."""


@dataclass(frozen=True)
class HeapStats:
    """Occupancy of one heap, in bytes and block counts (headers included)."""

    capacity: int
    granularity: int
    used: int
    free: int
    largest_free: int
    nblocks: int
    nallocated: int


class _Call:
    """State of one evictfrom/defrag call, reached from the C callback through a handle."""

    __slots__ = ("heap", "callback", "error")

    def __init__(self, heap, callback):
        self.heap = heap
        self.callback = callback
        self.error: Optional[BaseException] = None


# Calls in progress on this thread, innermost last. A callback runs synchronously on the thread
# that made the native call, so the innermost call is the one whose callback raised.
_active = threading.local()


def _stash(exc_value) -> None:
    """Record an exception raised in a callback on the call that ran it."""
    stack = getattr(_active, "stack", None)
    if not stack:
        log.error("exception in a heap callback with no call in progress", exc_info=exc_value)
        return
    call = stack[-1]
    if call.error is None:
        call.error = exc_value


def _on_callback_error(exc_type, exc_value, tb):
    """onerror hook: refuse (keep the block where it is) and keep the exception for re-raise."""
    _stash(exc_value)
    return 1


@ffi.def_extern(onerror=_on_callback_error)
def ca_py_evict(ctx, block, owner):
    """evictfrom callback: 0 if the Python callback moved/freed the block, 1 to refuse."""
    call = ffi.from_handle(ctx)
    if call.error is not None:
        return 1  # an earlier callback raised: refuse everything else
    ok = call.callback(int(block), int(owner))
    if ok:
        info = call.heap._info_or_none(int(block))
        if info is not None and info.owner == owner:
            log.warning(
                "evictfrom callback returned True for block %d (owner %d) without freeing it; "
                "treated as a refusal", block, owner)
    return 0 if ok else 1


@ffi.def_extern(onerror=_on_callback_error)
def ca_py_move(ctx, owner, old_block, new_block):
    """defrag callback: 0 to allow moving the block, 1 to keep it where it is."""
    call = ffi.from_handle(ctx)
    if call.error is not None:
        return 1
    return 0 if call.callback(int(owner), int(old_block), int(new_block)) else 1


def _as_pointer(base):
    """(void* cdata, keep-alive object) from an int address, a cffi pointer or a writable buffer."""
    if isinstance(base, int):
        if base <= 0:
            raise ValueError(f"heap base address must be a positive int, got {base}")
        return ffi.cast("void *", base), None
    if isinstance(base, ffi.CData):
        return ffi.cast("void *", base), base
    buf = ffi.from_buffer(base, require_writable=True)
    return ffi.cast("void *", buf), (base, buf)


class Heap(HeapRecord):
    """A heap over [base, base+size): allocation by owner id, evictfrom, defrag and check.

    base is an int address, a cffi pointer or a writable buffer (kept alive by the heap); it
    must be 64-byte aligned. granularity 0 picks the native default (256 bytes). Not
    thread-safe: the manager serialises calls.
    """

    def __init__(self, base, size: int, granularity: int = 0, name: str = "heap"):
        self.name = name
        size, granularity = _int_arg(size, "size", name), _int_arg(granularity, "granularity", name)
        if size < 0 or granularity < 0:
            raise ValueError(f"heap {name!r}: size {size} and granularity {granularity} must be >= 0")
        ptr, self._keepalive = _as_pointer(base)
        if isinstance(self._keepalive, tuple) and ffi.sizeof(self._keepalive[1]) < size:
            raise ValueError(f"heap {name!r}: the buffer has {ffi.sizeof(self._keepalive[1])} bytes, "
                             f"fewer than the heap size {size}; pass a smaller size or a larger buffer")
        addr = int(ffi.cast("uintptr_t", ptr))
        if addr % 64:
            raise ValueError(f"heap {name!r}: base address {addr:#x} is not 64-byte aligned; "
                             f"pass an aligned mapping (mmap gives page alignment)")
        if granularity and (granularity < 64 or granularity & (granularity - 1)):
            raise ValueError(f"heap {name!r}: granularity {granularity} must be a power of two >= 64 "
                             f"(or 0 for the default)")
        h = lib.ca_heap_create(ptr, size, granularity)
        if h == ffi.NULL:
            g = granularity or 256
            raise ValueError(f"heap {name!r}: cannot create a heap of {size} bytes at {addr:#x} with "
                             f"granularity {g}: it needs at least one granule ({g} bytes) and at "
                             f"most 2**62 bytes")
        self._h = h
        self._addr = int(ffi.cast("uintptr_t", h))     # the handle for callers in C; 0 once closed
        self._base = addr
        self._in_call = 0
        st = self.stats()
        self.capacity = st.capacity
        self.granularity = st.granularity

    # ------------------------------------------------------------------ basics

    @property
    def base_address(self) -> int:
        """Address of byte 0 of the heap (block offsets are relative to it)."""
        return self._base

    @property
    def closed(self) -> bool:
        return self._h is None

    def _handle(self):
        if self._h is None:
            raise CachedArraysError(f"heap {self.name!r} is closed; create a new Heap")
        return self._h

    def data_address(self, offset: int) -> int:
        """Address of the first data byte of the block at offset."""
        return self._base + offset + HEADER

    def block_size(self, nbytes: int) -> int:
        """Bytes a block for nbytes of data takes (header and rounding included)."""
        return int(lib.ca_heap_block_size(self._handle(), _nonneg(nbytes, "nbytes")))

    def can_alloc(self, nbytes: int) -> bool:
        """Would alloc(nbytes) succeed right now?"""
        return bool(lib.ca_heap_can_alloc(self._handle(), _nonneg(nbytes, "nbytes")))

    def try_alloc(self, nbytes: int, owner: int) -> Optional[int]:
        """Like alloc, but return None instead of raising when no free block is large enough."""
        h = self._h
        if type(nbytes) is int and type(owner) is int and h is not None and 0 <= nbytes < 1 << 64 \
                and 0 < owner < 1 << 64:
            r = lib.ca_heap_alloc(h, nbytes, owner)
            if r >= 0:
                return r
            if r == -lib.CA_ENOMEM:
                return None
        try:
            return self.alloc(nbytes, owner)
        except OutOfMemoryError:
            return None

    def quick_alloc(self, nbytes: int, owner: int) -> Optional[int]:
        """try_alloc for a caller passing ints it made itself (sizes >= 0, owner ids > 0) on an
        open heap: no argument checks on the common path."""
        r = self._lib_alloc(self._h, nbytes, owner)
        if r >= 0:
            return r
        return self.try_alloc(nbytes, owner)

    def quick_free(self, offset: int, owner: int) -> None:
        """free for a caller passing the offset and owner of a block it allocated, on an open
        heap: no argument checks on the common path."""
        if self._lib_free(self._h, offset, owner):
            self.free(offset, owner)                     # raises the reason

    @staticmethod
    def entry_points():
        """Addresses of the native ca_heap_alloc and ca_heap_free, for C callers that hold a
        heap's ``_addr`` (the manager's records module)."""
        return tuple(int(ffi.cast("uintptr_t", ffi.addressof(lib, f)))
                     for f in ("ca_heap_alloc", "ca_heap_free"))

    _lib_alloc = staticmethod(lib.ca_heap_alloc)
    _lib_free = staticmethod(lib.ca_heap_free)

    def alloc(self, nbytes: int, owner: int) -> int:
        """Allocate a block with room for nbytes, owned by owner (> 0); returns its offset."""
        h = self._h
        if type(nbytes) is int and type(owner) is int and h is not None and 0 <= nbytes < 1 << 64 \
                and 0 < owner < 1 << 64:
            r = lib.ca_heap_alloc(h, nbytes, owner)            # fast path
            if r >= 0:
                return r
        h = self._handle()
        nbytes = _nonneg(nbytes, "nbytes")
        owner = _index_or(owner)
        if not isinstance(owner, int) or owner <= 0 or owner >= 1 << 64:
            raise ValueError(f"heap {self.name!r}: owner id must be an int in [1, 2**64), got {owner!r}")
        r = lib.ca_heap_alloc(h, nbytes, owner)
        if r >= 0:
            return int(r)
        if r == -lib.CA_ENOMEM:
            st = self.stats()
            raise OutOfMemoryError(
                f"heap {self.name!r}: cannot allocate {nbytes} bytes for owner {owner}: needs a block "
                f"of {self.block_size(nbytes)} bytes (64-byte header, rounded to {self.granularity}), "
                f"but {st.free} of {st.capacity} bytes are free and the largest free block has "
                f"{st.largest_free} bytes; free or evict objects, defragment, or use a larger device")
        if r == -lib.CA_EBUSY:
            raise CachedArraysError(
                f"heap {self.name!r}: cannot allocate {nbytes} bytes for owner {owner} while the heap "
                f"is being evicted from or defragmented; allocate after evictfrom/defrag returns")
        raise ValueError(f"heap {self.name!r}: bad allocation request ({nbytes} bytes, owner {owner})")

    def free(self, offset: int, owner: int) -> None:
        """Free the block at offset; owner must be the owner it was allocated for."""
        h = self._h
        if type(offset) is int and type(owner) is int and h is not None and 0 <= offset < 1 << 63 \
                and 0 < owner < 1 << 64 and lib.ca_heap_free(h, offset, owner) == 0:
            return                                              # fast path
        h = self._handle()
        offset, owner = _index_or(offset), _index_or(owner)
        if not isinstance(offset, int) or not isinstance(owner, int) or owner < 0 or owner >= 1 << 64:
            raise UseAfterFreeError(f"heap {self.name!r}: cannot free offset {offset!r} for owner "
                                    f"{owner!r}: not a block offset / owner id")
        if offset < -(1 << 63) or offset >= 1 << 63:
            raise UseAfterFreeError(f"heap {self.name!r}: offset {offset} is outside the heap")
        rc = lib.ca_heap_free(h, offset, owner)
        if rc == lib.CA_OK:
            return
        if rc == lib.CA_EBUSY:
            raise CachedArraysError(f"heap {self.name!r}: cannot free block {offset} (owner {owner}) "
                                    f"from inside a defrag callback; free it after defrag returns")
        info = self._info_or_none(offset)
        if info is None:
            why = "no block starts there (stale or interior offset)"
        elif info.free:
            why = "the block is already free (double free?)"
        elif info.evicting and info.owner == 0:
            why = "the block is already freed or collected by a running evictfrom"
        else:
            why = f"the block belongs to owner {info.owner}"
        raise UseAfterFreeError(f"heap {self.name!r}: cannot free block at offset {offset} for owner "
                                f"{owner}: {why}; the heap is unchanged")

    def _info_or_none(self, offset: int) -> Optional[BlockInfo]:
        out = ffi.new("ca_block_info *")
        if lib.ca_heap_info(self._handle(), offset, out) != lib.CA_OK:
            return None
        return _block_info(out)

    def info(self, offset: int) -> BlockInfo:
        """Describe the block at offset (free or allocated)."""
        offset = _index_or(offset)
        b = self._info_or_none(offset) if isinstance(offset, int) and abs(offset) < 1 << 63 else None
        if b is None:
            raise UseAfterFreeError(f"heap {self.name!r}: no block starts at offset {offset!r} "
                                    f"(capacity {self.capacity} bytes)")
        return b

    def blocks(self) -> Iterator[BlockInfo]:
        """Every block in address order (do not alloc or free while iterating)."""
        h = self._handle()
        out = ffi.new("ca_block_info *")
        off = lib.ca_heap_first(h)
        while 0 <= off < self.capacity:
            if lib.ca_heap_info(h, off, out) != lib.CA_OK:
                raise CachedArraysError(f"heap {self.name!r}: no block starts at offset {off} any more; "
                                        f"the heap changed during blocks() (take list(blocks()) first)")
            b = _block_info(out)
            off = b.offset + b.size
            yield b

    def stats(self) -> HeapStats:
        """Capacity, used and free bytes, the largest free block and block counts."""
        s = ffi.new("ca_heap_stats *")
        lib.ca_heap_get_stats(self._handle(), s)
        return HeapStats(int(s.capacity), int(s.granularity), int(s.used), int(s.free),
                         int(s.largest_free), int(s.nblocks), int(s.nallocated))

    def check(self) -> None:
        """Verify every heap invariant; raise HeapCorruptionError with the native message."""
        buf = ffi.new("char[]", 512)
        if lib.ca_heap_check(self._handle(), buf, 512) != lib.CA_OK:
            raise HeapCorruptionError(f"heap {self.name!r}: {ffi.string(buf).decode(errors='replace')}")

    # ------------------------------------------------------------------ walks with callbacks

    def _run(self, callback, fn):
        call = _Call(self, callback)
        handle = ffi.new_handle(call)
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append(call)
        self._in_call += 1
        try:
            result = fn(handle)
        finally:
            self._in_call -= 1
            stack.pop()
        if call.error is not None:
            raise call.error
        return result

    def evictfrom(self, start: int, nbytes: int,
                  callback: Callable[[int, int], bool]) -> Optional[int]:
        """Collect a free block for nbytes starting at block start; returns its offset or None.

        callback(offset, owner) must move the block's data away, call free(offset, owner) and
        return True, or return False to refuse (pinned). An exception in it refuses that block
        and every later one, and is re-raised after the walk (the heap stays consistent and every
        byte freed so far stays free).
        """
        h = self._handle()
        nbytes = _nonneg(nbytes, "nbytes")
        start = _index_or(start)
        if not isinstance(start, int) or not -(1 << 63) <= start < 1 << 63:
            raise UseAfterFreeError(f"heap {self.name!r}: evictfrom start {start!r} is not a block offset")
        r = self._run(callback, lambda hd: lib.ca_heap_evictfrom(h, start, nbytes, lib.ca_py_evict, hd))
        if r >= 0:
            return int(r)
        if r == -lib.CA_ENOMEM:
            return None
        if r == -lib.CA_EBUSY:
            raise CachedArraysError(f"heap {self.name!r}: evictfrom called while the heap is already "
                                    f"being evicted from or defragmented")
        raise UseAfterFreeError(f"heap {self.name!r}: evictfrom start offset {start} is not a block")

    def set_nodata(self, nodata: bool = True) -> None:
        """Mark the heap's data as meaningless (a virtual device): defrag moves headers only."""
        lib.ca_heap_set_nodata(self._handle(), 1 if nodata else 0)

    def defrag(self, callback: Optional[Callable[[int, int, int], bool]] = None) -> int:
        """Slide blocks down over free gaps; callback(owner, old, new) -> True allows each move.

        Returns the number of blocks moved. The callback runs before the bytes move and may not
        alloc or free in this heap. An exception in it pins that block and every later one, and
        is re-raised after the pass (the heap stays consistent, every block keeps its data).
        """
        h = self._handle()
        cb = callback if callback is not None else (lambda owner, old, new: True)
        r = self._run(cb, lambda hd: lib.ca_heap_defrag(h, lib.ca_py_move, hd))
        if r == -lib.CA_EBUSY:
            raise CachedArraysError(f"heap {self.name!r}: defrag called while the heap is being "
                                    f"evicted from or defragmented")
        return int(r)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Destroy the native heap (the mapping itself belongs to the caller). Idempotent."""
        if self._h is None:
            return
        if self._in_call:
            raise CachedArraysError(f"heap {self.name!r}: cannot close from inside an evictfrom or "
                                    f"defrag callback")
        self._addr = 0
        lib.ca_heap_destroy(self._h)
        self._h = None
        self._keepalive = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if getattr(self, "_h", None) is not None and not self._in_call:
                lib.ca_heap_destroy(self._h)
                self._h = None
        except Exception:
            pass

    def __repr__(self):
        if self._h is None:
            return f"<Heap {self.name!r} closed>"
        st = self.stats()
        return (f"<Heap {self.name!r} {st.used}/{st.capacity} bytes used, {st.nallocated} blocks, "
                f"largest free {st.largest_free}>")


def _block_info(out) -> BlockInfo:
    f = int(out.flags)
    return BlockInfo(int(out.offset), int(out.size), int(out.owner),
                     bool(f & lib.CA_FLAG_FREE), bool(f & lib.CA_FLAG_EVICTING))


def _int_arg(n, what, name) -> int:
    """n as an int; TypeError naming the heap for a bool, float or str (never rounded)."""
    if isinstance(n, bool) or not hasattr(type(n), "__index__"):
        raise TypeError(f"heap {name!r}: {what} must be an int number of bytes, not "
                        f"{type(n).__name__} {n!r}")
    return operator.index(n)


def _nonneg(n, what) -> int:
    try:
        v = -1 if isinstance(n, bool) else operator.index(n)
    except TypeError:
        v = -1
    if v < 0 or v >= 1 << 64:
        raise ValueError(f"{what} must be an int in [0, 2**64), got {n!r}")
    return v


def _index_or(x):
    """x as a Python int if it is integer-like (numpy ints included), else x unchanged."""
    try:
        return operator.index(x)
    except TypeError:
        return x
