/* cachedarrays native layer: a heap allocator over one caller-supplied mapping and a copy engine.
 *
 * The heap keeps every block's metadata in a 64-byte header inside the mapping, right before the
 * block's data. Blocks are named by their offset from the mapping's base (the header's offset),
 * so the Python side never holds a raw pointer. Nothing here takes a lock: the manager serialises
 * every call on one heap.
 */
#ifndef CA_NATIVE_H
#define CA_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#define CA_HEADER 64            /* bytes of header before each block's data */

/* Error codes (returned negated where a function returns an offset). */
#define CA_OK 0
#define CA_ENOMEM 1             /* no free block large enough */
#define CA_EINVAL 2             /* not a live block of this heap, wrong owner, bad argument */
#define CA_EBUSY 3              /* the heap is inside evictfrom and cannot allocate */

/* Block flags as reported by ca_heap_info. */
#define CA_FLAG_FREE 1u
#define CA_FLAG_EVICTING 2u
#define CA_FLAG_ORPHANED 4u     /* freed while handed to an evictfrom callback; the walk absorbs it */

typedef struct ca_heap ca_heap;

typedef struct {
    int64_t offset;     /* header offset from the base */
    uint64_t size;      /* whole block, header included; a multiple of the granularity */
    uint64_t owner;     /* owner id given at allocation; 0 when free */
    uint32_t flags;     /* CA_FLAG_* */
} ca_block_info;

typedef struct {
    uint64_t capacity;       /* bytes the heap manages (a multiple of the granularity) */
    uint64_t granularity;    /* block sizes are multiples of this (a power of two >= 64) */
    uint64_t used;           /* bytes in allocated blocks, headers included */
    uint64_t free;           /* bytes in free blocks */
    uint64_t largest_free;   /* size of the largest free block (header included) */
    uint64_t nblocks;        /* blocks in the heap, free and allocated */
    uint64_t nallocated;     /* allocated blocks */
} ca_heap_stats;

/* Create a heap over [base, base+size). granularity 0 picks a default. NULL on bad arguments
 * (base not 64-byte aligned, size smaller than one granule, granularity not a power of two >= 64). */
ca_heap *ca_heap_create(void *base, uint64_t size, uint64_t granularity);
void ca_heap_destroy(ca_heap *h);

/* The block size an allocation of nbytes takes (header and rounding included). */
uint64_t ca_heap_block_size(const ca_heap *h, uint64_t nbytes);

/* Allocate a block with room for nbytes of data, owned by owner (> 0). Returns the block offset
 * (>= 0), or -CA_ENOMEM / -CA_EINVAL / -CA_EBUSY. Data starts at base + offset + CA_HEADER. */
int64_t ca_heap_alloc(ca_heap *h, uint64_t nbytes, uint64_t owner);

/* Free a block. owner must match the owner given at allocation (guards against stale handles
 * and double frees). Returns CA_OK or CA_EINVAL. During evictfrom, freeing a block that the walk
 * is handing to its callback leaves the block to the walk, which absorbs it. Inside a defrag
 * callback it returns CA_EBUSY (blocks are being moved). */
int ca_heap_free(ca_heap *h, int64_t block, uint64_t owner);

/* Describe a live or free block at offset block. CA_EINVAL if no block starts there. */
int ca_heap_info(const ca_heap *h, int64_t block, ca_block_info *out);

/* Iterate blocks in address order: first block, then next; returns -1 after the last
 * (-CA_EINVAL if block is not a block start). */
int64_t ca_heap_first(const ca_heap *h);
int64_t ca_heap_next(const ca_heap *h, int64_t block);

/* During evictfrom, bytes the walk has collected but not yet released count as neither used nor free. */
void ca_heap_get_stats(const ca_heap *h, ca_heap_stats *out);

/* Would an allocation of nbytes succeed right now? */
int ca_heap_can_alloc(const ca_heap *h, uint64_t nbytes);

/* Callback for evictfrom: called with an allocated block. Return 0 after moving the block's data
 * elsewhere and calling ca_heap_free on it; return nonzero to refuse (the block is pinned), and
 * the walk continues past it. The callback may free other blocks of this heap; it may not
 * allocate in this heap (ca_heap_alloc returns -CA_EBUSY meanwhile). */
typedef int (*ca_evict_cb)(void *ctx, int64_t block, uint64_t owner);

/* Walk the address space from block start: forward to the end, then backward from start. Free
 * blocks are absorbed; allocated blocks are handed to cb. Stops once the contiguous absorbed
 * range is one free block of at least ca_heap_block_size(nbytes). A refused block splits the
 * range: what was absorbed so far becomes a free block and collection restarts past it.
 * Returns the offset of a free block big enough for nbytes, or -CA_ENOMEM if the walk ended
 * without collecting one (every freed byte is still returned to the heap); -CA_ENOMEM at once,
 * with no callbacks, when ca_heap_block_size(nbytes) exceeds the heap; -CA_EINVAL if start is not
 * a block or cb is NULL; -CA_EBUSY inside another evictfrom or defrag of this heap. A callback
 * that returns 0 without freeing its block counts as a refusal. */
int64_t ca_heap_evictfrom(ca_heap *h, int64_t start, uint64_t nbytes, ca_evict_cb cb, void *ctx);

/* Callback for defrag: block old of owner is about to move to new (both header offsets).
 * Return 0 to allow the move, nonzero to keep the block where it is (pinned). */
typedef int (*ca_move_cb)(void *ctx, uint64_t owner, int64_t old_block, int64_t new_block);

/* Slide allocated blocks down over free space, so free space gathers at the top. Blocks the
 * callback refuses stay put. Returns the number of blocks moved, or -CA_EBUSY inside evictfrom.
 * cb may be NULL (move everything); it may not allocate or free in this heap. */
int64_t ca_heap_defrag(ca_heap *h, ca_move_cb cb, void *ctx);

/* Metadata-only heap (a virtual device whose data is never read): defrag then moves each
 * block's header, not its data. */
void ca_heap_set_nodata(ca_heap *h, int nodata);

/* Verify every invariant: block sizes tile the heap, back-links match, free lists hold exactly
 * the free blocks in their right classes, no two adjacent free blocks, counters agree.
 * Returns CA_OK, or CA_EINVAL with a readable message in msg (NUL-terminated, at most msglen). */
int ca_heap_check(const ca_heap *h, char *msg, size_t msglen);

/* ---- copy engine ---- */

#define CA_COPY_PERSIST 1u      /* write back the destination's cache lines (DAX persistence) */

/* Copy n bytes; nthreads 0 uses the default thread count. Non-temporal stores above the
 * non-temporal threshold, one fence at the end. Safe for any alignment and length. */
void ca_copy(void *dst, const void *src, uint64_t n, int nthreads, unsigned flags);
void ca_copy_set_threads(int nthreads);           /* default thread count (>= 1) */
int ca_copy_get_threads(void);
void ca_copy_set_nt_threshold(uint64_t nbytes);   /* 0 disables non-temporal stores; default: the
                                                     larger of 4 MiB and 1/8 of the L3 cache */
uint64_t ca_copy_get_nt_threshold(void);
const char *ca_copy_isa(void);                    /* "avx512", "avx2" or "sse2" */
/* Force the streaming-store ISA (for tests and benchmarks); CA_EINVAL if this CPU lacks it.
 * Not synchronised with copies running at the same time. */
int ca_copy_set_isa(const char *name);
void ca_flush(void *addr, uint64_t n);            /* cache-line write-back + fence */

/* ---- memory placement ---- */

/* Bind [addr, addr+len) to NUMA node node (mbind MPOL_BIND); addr is rounded down to a page.
 * Returns 0 or an errno. */
int ca_mbind(void *addr, uint64_t len, int node);

#endif
