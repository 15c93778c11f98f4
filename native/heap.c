/* Heap allocator over one caller-supplied mapping: 64-byte in-heap block headers, exact size
 * classes plus one best-fit overflow class, a two-level bitmap over the classes, split on
 * allocate, coalesce on free, the evictfrom walk, sliding defragmentation and a checker.
 * Nothing here locks: the Python manager serialises every call on one heap.
 */
#define _GNU_SOURCE
#include "ca_native.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Internal flag bits; the low two match the public CA_FLAG_* values. */
#define F_FREE CA_FLAG_FREE         /* proper free block, on the free list of its class */
#define F_EVICTING CA_FLAG_EVICTING /* allocated block currently handed to an evictfrom callback */
#define F_ORPHANED CA_FLAG_ORPHANED /* freed during its own callback; the walk absorbs it */
#define F_ABSORBED 8u               /* range collected by an evictfrom walk, not yet released */

#define NEXACT 65536u               /* exact classes: one per multiple of the granularity */
#define NIL (-1)
#define DEFAULT_GRANULARITY 256u

enum { IDLE = 0, BUSY_EVICT = 1, BUSY_DEFRAG = 2 };

typedef struct {
    uint64_t size;      /* whole block, header included */
    uint64_t backsize;  /* size of the physically previous block; 0 for the first block */
    uint64_t owner;     /* owner id; 0 when free */
    int64_t next;       /* free-list links (offsets), NIL when none */
    int64_t prev;
    uint32_t flags;
    uint32_t spare;
    uint64_t check;     /* magic word derived from the heap salt and the block offset */
    uint64_t spare2;
} hdr_t;

_Static_assert(sizeof(hdr_t) == CA_HEADER, "block header must be exactly CA_HEADER bytes");

struct ca_heap {
    unsigned char *base;
    uint64_t cap;        /* managed bytes, a multiple of gran */
    uint64_t gran;
    unsigned shift;      /* log2(gran) */
    uint64_t salt;       /* per-heap value mixed into every magic word */
    uint32_t over;       /* index of the overflow class (== number of exact classes used) */
    uint32_t nclasses;   /* over + 1 */
    int64_t *heads;      /* free-list head per class */
    uint64_t *bits0;     /* one bit per class: list non-empty */
    uint64_t *bits1;     /* one bit per bits0 word: word non-zero */
    uint32_t nwords0, nwords1;
    uint64_t used;       /* bytes in allocated blocks (evicting ones included, orphans excluded) */
    uint64_t freeb;      /* bytes in free blocks on the lists */
    uint64_t nblocks;    /* headers that tile the heap */
    int nodata;          /* metadata only (a virtual device): defrag moves headers, not data */
    uint64_t nalloc;     /* allocated blocks */
    uint64_t nfree;      /* blocks on the free lists */
    int busy;            /* IDLE, BUSY_EVICT or BUSY_DEFRAG */
};

/* ---------------------------------------------------------------- small helpers */

static inline hdr_t *H(const ca_heap *h, int64_t off) { return (hdr_t *)(h->base + off); }

static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27; x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static inline uint64_t magic(const ca_heap *h, int64_t off)
{
    return mix64(h->salt ^ ((uint64_t)off * 0x9e3779b97f4a7c15ULL)) | 1u;  /* never 0 */
}

static inline uint32_t class_of(const ca_heap *h, uint64_t size)
{
    uint64_t q = size >> h->shift;
    return q <= NEXACT ? (uint32_t)(q - 1) : h->over;
}

static void bit_set(ca_heap *h, uint32_t c)
{
    uint32_t w = c >> 6;
    if (!h->bits0[w]) h->bits1[w >> 6] |= 1ULL << (w & 63);
    h->bits0[w] |= 1ULL << (c & 63);
}

static void bit_clear(ca_heap *h, uint32_t c)
{
    uint32_t w = c >> 6;
    h->bits0[w] &= ~(1ULL << (c & 63));
    if (!h->bits0[w]) h->bits1[w >> 6] &= ~(1ULL << (w & 63));
}

/* First non-empty class >= c, or -1. */
static int64_t find_ge(const ca_heap *h, uint32_t c)
{
    uint32_t w = c >> 6;
    uint64_t m = h->bits0[w] & (~0ULL << (c & 63));
    if (m) return ((int64_t)w << 6) + __builtin_ctzll(m);
    uint32_t i = w + 1;
    if (i >= h->nwords0) return -1;
    uint32_t ww = i >> 6;
    uint64_t m1 = h->bits1[ww] & (~0ULL << (i & 63));
    while (!m1) {
        if (++ww >= h->nwords1) return -1;
        m1 = h->bits1[ww];
    }
    uint32_t w0 = (ww << 6) + (uint32_t)__builtin_ctzll(m1);
    return ((int64_t)w0 << 6) + __builtin_ctzll(h->bits0[w0]);
}

/* Highest non-empty class, or -1. */
static int64_t find_last(const ca_heap *h)
{
    for (int64_t ww = (int64_t)h->nwords1 - 1; ww >= 0; ww--) {
        uint64_t m1 = h->bits1[ww];
        if (!m1) continue;
        uint32_t w0 = ((uint32_t)ww << 6) + 63u - (uint32_t)__builtin_clzll(m1);
        return ((int64_t)w0 << 6) + 63 - __builtin_clzll(h->bits0[w0]);
    }
    return -1;
}

static void list_push(ca_heap *h, int64_t off)
{
    hdr_t *b = H(h, off);
    uint32_t c = class_of(h, b->size);
    b->prev = NIL;
    b->next = h->heads[c];
    if (b->next != NIL) H(h, b->next)->prev = off;
    else bit_set(h, c);
    h->heads[c] = off;
    h->nfree++;
    h->freeb += b->size;
}

static void list_remove(ca_heap *h, int64_t off)
{
    hdr_t *b = H(h, off);
    uint32_t c = class_of(h, b->size);
    if (b->prev != NIL) H(h, b->prev)->next = b->next;
    else h->heads[c] = b->next;
    if (b->next != NIL) H(h, b->next)->prev = b->prev;
    if (h->heads[c] == NIL) bit_clear(h, c);
    b->next = b->prev = NIL;
    h->nfree--;
    h->freeb -= b->size;
}

static void write_hdr(ca_heap *h, int64_t off, uint64_t size, uint64_t back, uint64_t owner,
                      uint32_t flags)
{
    hdr_t *b = H(h, off);
    memset(b, 0, sizeof *b);
    b->size = size;
    b->backsize = back;
    b->owner = owner;
    b->next = b->prev = NIL;
    b->flags = flags;
    b->check = magic(h, off);
}

/* A header that merged into a neighbour must never validate again (stale handles). */
static inline void invalidate(ca_heap *h, int64_t off) { H(h, off)->check = 0; }

static inline void fix_next_back(ca_heap *h, int64_t off)
{
    uint64_t n = (uint64_t)off + H(h, off)->size;
    if (n < h->cap) H(h, (int64_t)n)->backsize = H(h, off)->size;
}

/* The header at off if a block starts there, else NULL. Checks the magic word and that both
 * physical neighbours agree, so a stale or interior offset is rejected without side effects. */
static hdr_t *valid_block(const ca_heap *h, int64_t off)
{
    if (!h || off < 0 || (uint64_t)off >= h->cap || ((uint64_t)off & (h->gran - 1))) return NULL;
    hdr_t *b = H(h, off);
    if (b->check != magic(h, off)) return NULL;
    uint64_t sz = b->size;
    if (sz == 0 || (sz & (h->gran - 1)) || sz > h->cap - (uint64_t)off) return NULL;
    if (off == 0) {
        if (b->backsize != 0) return NULL;
    } else {
        uint64_t bs = b->backsize;
        if (bs == 0 || bs > (uint64_t)off || (bs & (h->gran - 1))) return NULL;
        hdr_t *p = H(h, off - (int64_t)bs);
        if (p->check != magic(h, off - (int64_t)bs) || p->size != bs) return NULL;
    }
    uint64_t n = (uint64_t)off + sz;
    if (n < h->cap) {
        hdr_t *nb = H(h, (int64_t)n);
        if (nb->check != magic(h, (int64_t)n) || nb->backsize != sz) return NULL;
    }
    return b;
}

/* Turn the block at off (absorbed, orphaned or just freed) into a proper free block, merging
 * with free neighbours. Returns the offset of the resulting free block. */
static int64_t make_free(ca_heap *h, int64_t off)
{
    hdr_t *b = H(h, off);
    b->flags = F_FREE;
    b->owner = 0;
    uint64_t n = (uint64_t)off + b->size;
    if (n < h->cap && (H(h, (int64_t)n)->flags & F_FREE)) {
        list_remove(h, (int64_t)n);
        b->size += H(h, (int64_t)n)->size;
        invalidate(h, (int64_t)n);
        h->nblocks--;
    }
    if (off > 0) {
        int64_t p = off - (int64_t)b->backsize;
        hdr_t *pb = H(h, p);
        if (pb->flags & F_FREE) {
            list_remove(h, p);
            pb->size += b->size;
            invalidate(h, off);
            h->nblocks--;
            off = p;
            b = pb;
        }
    }
    fix_next_back(h, off);
    list_push(h, off);
    return off;
}

/* Smallest-fitting free block for a block of need bytes, or NIL. */
static int64_t find_fit(const ca_heap *h, uint64_t need)
{
    if (need > h->cap) return NIL;
    uint32_t c = class_of(h, need);
    if (c < h->over) {
        int64_t f = find_ge(h, c);
        if (f < 0) return NIL;
        if ((uint32_t)f < h->over) return h->heads[f];
    }
    int64_t best = NIL;
    uint64_t bestsz = UINT64_MAX;
    for (int64_t o = h->heads[h->over]; o != NIL; o = H(h, o)->next) {
        uint64_t s = H(h, o)->size;
        if (s >= need && (s < bestsz || (s == bestsz && o < best))) {
            best = o;
            bestsz = s;
        }
    }
    return best;
}

/* ---------------------------------------------------------------- create / destroy / alloc */

ca_heap *ca_heap_create(void *base, uint64_t size, uint64_t granularity)
{
    static uint64_t counter;
    if (!base || ((uintptr_t)base & 63)) return NULL;
    if (granularity == 0) granularity = DEFAULT_GRANULARITY;
    if (granularity < 64 || (granularity & (granularity - 1))) return NULL;
    if (size > (UINT64_C(1) << 62)) return NULL;
    uint64_t cap = size & ~(granularity - 1);
    if (cap < granularity) return NULL;

    ca_heap *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->base = base;
    h->cap = cap;
    h->gran = granularity;
    h->shift = (unsigned)__builtin_ctzll(granularity);
    uint64_t units = cap >> h->shift;
    h->over = (uint32_t)(units < NEXACT ? units : NEXACT);
    h->nclasses = h->over + 1;
    h->nwords0 = (h->nclasses + 63) / 64;
    h->nwords1 = (h->nwords0 + 63) / 64;
    h->heads = malloc(sizeof(int64_t) * h->nclasses);
    h->bits0 = calloc(h->nwords0, sizeof(uint64_t));
    h->bits1 = calloc(h->nwords1, sizeof(uint64_t));
    if (!h->heads || !h->bits0 || !h->bits1) {
        ca_heap_destroy(h);
        return NULL;
    }
    for (uint32_t i = 0; i < h->nclasses; i++) h->heads[i] = NIL;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t k = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
    h->salt = mix64((uint64_t)(uintptr_t)h ^ ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^
                    (k * 0xd1b54a32d192ed03ULL));
    write_hdr(h, 0, cap, 0, 0, 0);
    h->nblocks = 1;
    make_free(h, 0);
    return h;
}

void ca_heap_destroy(ca_heap *h)
{
    if (!h) return;
    free(h->heads);
    free(h->bits0);
    free(h->bits1);
    free(h);
}

uint64_t ca_heap_block_size(const ca_heap *h, uint64_t nbytes)
{
    uint64_t g = h->gran;
    if (nbytes > UINT64_MAX - CA_HEADER - g) return UINT64_MAX & ~(g - 1);
    return (nbytes + CA_HEADER + g - 1) & ~(g - 1);
}

int64_t ca_heap_alloc(ca_heap *h, uint64_t nbytes, uint64_t owner)
{
    if (!h || owner == 0) return -CA_EINVAL;
    if (h->busy) return -CA_EBUSY;
    uint64_t need = ca_heap_block_size(h, nbytes);
    int64_t off = find_fit(h, need);
    if (off == NIL) return -CA_ENOMEM;
    list_remove(h, off);
    hdr_t *b = H(h, off);
    if (b->size > need) {
        int64_t rem = off + (int64_t)need;
        write_hdr(h, rem, b->size - need, need, 0, F_FREE);
        b->size = need;
        fix_next_back(h, rem);
        list_push(h, rem);
        h->nblocks++;
    }
    b->owner = owner;
    b->flags = 0;
    h->used += need;
    h->nalloc++;
    return off;
}

int ca_heap_free(ca_heap *h, int64_t block, uint64_t owner)
{
    if (!h) return CA_EINVAL;
    if (h->busy == BUSY_DEFRAG) return CA_EBUSY;
    hdr_t *b = valid_block(h, block);
    if (!b || (b->flags & (F_FREE | F_ABSORBED | F_ORPHANED))) return CA_EINVAL;
    if (owner == 0 || b->owner != owner) return CA_EINVAL;
    h->used -= b->size;
    h->nalloc--;
    if (b->flags & F_EVICTING) {
        b->flags |= F_ORPHANED;     /* the walk that handed it out absorbs it */
        return CA_OK;
    }
    make_free(h, block);
    return CA_OK;
}

int ca_heap_info(const ca_heap *h, int64_t block, ca_block_info *out)
{
    hdr_t *b = valid_block(h, block);
    if (!b || !out) return CA_EINVAL;
    out->offset = block;
    out->size = b->size;
    uint32_t f = b->flags;
    if (f & F_FREE) {
        out->flags = CA_FLAG_FREE;
        out->owner = 0;
    } else if (f & F_ABSORBED) {
        out->flags = CA_FLAG_EVICTING;
        out->owner = 0;
    } else if (f & F_ORPHANED) {
        out->flags = CA_FLAG_EVICTING | CA_FLAG_ORPHANED;
        out->owner = 0;
    } else {
        out->flags = f & CA_FLAG_EVICTING;
        out->owner = b->owner;
    }
    return CA_OK;
}

int64_t ca_heap_first(const ca_heap *h) { return h ? 0 : -CA_EINVAL; }

int64_t ca_heap_next(const ca_heap *h, int64_t block)
{
    hdr_t *b = valid_block(h, block);
    if (!b) return -CA_EINVAL;
    uint64_t n = (uint64_t)block + b->size;
    return n >= h->cap ? -1 : (int64_t)n;
}

static uint64_t largest_free(const ca_heap *h)
{
    int64_t c = find_last(h);
    if (c < 0) return 0;
    if ((uint32_t)c < h->over) return ((uint64_t)c + 1) << h->shift;
    uint64_t best = 0;
    for (int64_t o = h->heads[h->over]; o != NIL; o = H(h, o)->next)
        if (H(h, o)->size > best) best = H(h, o)->size;
    return best;
}

void ca_heap_get_stats(const ca_heap *h, ca_heap_stats *out)
{
    if (!h || !out) return;
    out->capacity = h->cap;
    out->granularity = h->gran;
    out->used = h->used;
    out->free = h->freeb;
    out->largest_free = largest_free(h);
    out->nblocks = h->nblocks;
    out->nallocated = h->nalloc;
}

int ca_heap_can_alloc(const ca_heap *h, uint64_t nbytes)
{
    if (!h || h->busy) return 0;
    return find_fit(h, ca_heap_block_size(h, nbytes)) != NIL;
}

/* ---------------------------------------------------------------- evictfrom */

/* A contiguous collected range [lo, hi): one header at lo flagged F_ABSORBED; empty if lo == hi. */
typedef struct { int64_t lo, hi; } range_t;

/* Append the free or orphaned block at off == r->hi to the range. */
static void absorb_fwd(ca_heap *h, range_t *r, int64_t off)
{
    hdr_t *b = H(h, off);
    if (b->flags & F_FREE) list_remove(h, off);
    if (r->lo == r->hi) {
        b->flags = F_ABSORBED;
        b->owner = 0;
        r->lo = off;
        r->hi = off + (int64_t)b->size;
        return;
    }
    hdr_t *a = H(h, r->lo);
    a->size += b->size;
    invalidate(h, off);
    h->nblocks--;
    r->hi = r->lo + (int64_t)a->size;
    fix_next_back(h, r->lo);
}

/* Prepend the free or orphaned block at off (ending at r->lo) to the range. */
static void absorb_bwd(ca_heap *h, range_t *r, int64_t off)
{
    hdr_t *b = H(h, off);
    if (b->flags & F_FREE) list_remove(h, off);
    b->flags = F_ABSORBED;
    b->owner = 0;
    if (r->lo != r->hi) {
        b->size += H(h, r->lo)->size;
        invalidate(h, r->lo);
        h->nblocks--;
    }
    r->lo = off;
    r->hi = off + (int64_t)b->size;
    fix_next_back(h, off);
}

static int64_t release(ca_heap *h, range_t *r)
{
    if (r->lo == r->hi) return NIL;
    int64_t off = make_free(h, r->lo);
    r->lo = r->hi = NIL;
    return off;
}

/* Would releasing the range (merging free neighbours) give a block of at least need bytes? */
static int enough(const ca_heap *h, const range_t *r, uint64_t need)
{
    if (r->lo == r->hi) return 0;
    uint64_t total = (uint64_t)(r->hi - r->lo);
    if ((uint64_t)r->hi < h->cap && (H(h, r->hi)->flags & F_FREE)) total += H(h, r->hi)->size;
    if (r->lo > 0) {
        hdr_t *p = H(h, r->lo - (int64_t)H(h, r->lo)->backsize);
        if (p->flags & F_FREE) total += p->size;
    }
    return total >= need;
}

/* Hand the allocated block at off to the callback. Returns 1 if the block was freed meanwhile
 * (orphaned, to be absorbed), 0 if it stays allocated (refused, whatever the callback said). */
static int offer(ca_heap *h, int64_t off, ca_evict_cb cb, void *ctx)
{
    hdr_t *b = H(h, off);
    b->flags |= F_EVICTING;
    (void)cb(ctx, off, b->owner);
    if (b->flags & F_ORPHANED) return 1;
    b->flags &= ~F_EVICTING;
    return 0;
}

/* The block whose bytes include offset pos (pos may be a merged-away header). */
static int64_t block_containing(const ca_heap *h, int64_t pos)
{
    if (valid_block(h, pos)) return pos;
    int64_t off = 0;
    while ((uint64_t)off < h->cap) {
        int64_t n = off + (int64_t)H(h, off)->size;
        if (pos < n) return off;
        off = n;
    }
    return NIL;
}

int64_t ca_heap_evictfrom(ca_heap *h, int64_t start, uint64_t nbytes, ca_evict_cb cb, void *ctx)
{
    if (!h || !cb) return -CA_EINVAL;
    if (h->busy) return -CA_EBUSY;
    if (!valid_block(h, start)) return -CA_EINVAL;
    uint64_t need = ca_heap_block_size(h, nbytes);
    if (need > h->cap) return -CA_ENOMEM;

    h->busy = BUSY_EVICT;
    range_t r = {start, start};
    range_t parked = {start, start};  /* the segment that began at start, kept for the way back */
    int first = 1;                    /* r is still the segment that began at start */
    int parked_live = 0;              /* parked holds absorbed bytes not yet in r */
    int64_t res;

    /* Forward from start to the end of the heap. */
    int64_t off = start;
    while ((uint64_t)off < h->cap) {
        hdr_t *b = H(h, off);
        if ((b->flags & F_FREE) || offer(h, off, cb, ctx)) {
            absorb_fwd(h, &r, off);
            if (enough(h, &r, need)) goto found;
            off = r.hi;
            continue;
        }
        int64_t past = off + (int64_t)b->size;
        if (first) {
            parked = r;
            parked_live = parked.lo != parked.hi;
        } else {
            release(h, &r);
        }
        first = 0;
        off = past;
        r.lo = r.hi = off;
    }

    /* Backward from start. */
    if (!first) {
        release(h, &r);
        r = parked;
        parked_live = 0;
        if (r.lo == r.hi) {
            /* start itself was refused; it may have been freed (and merged) since. */
            int64_t c = block_containing(h, start);
            r.lo = r.hi = c;
            if (H(h, c)->flags & F_FREE) absorb_fwd(h, &r, c);
        }
    }
    for (;;) {
        if (enough(h, &r, need)) goto found;
        if (r.lo == 0) break;
        int64_t p = r.lo - (int64_t)H(h, r.lo)->backsize;
        if ((H(h, p)->flags & F_FREE) || offer(h, p, cb, ctx)) {
            absorb_bwd(h, &r, p);
        } else {
            release(h, &r);
            r.lo = r.hi = p;
        }
    }
    release(h, &r);
    h->busy = IDLE;
    return -CA_ENOMEM;

found:
    if (parked_live) release(h, &parked);   /* first, so r's release merges with it if adjacent */
    res = release(h, &r);
    h->busy = IDLE;
    return res;
}

/* ---------------------------------------------------------------- defrag */

void ca_heap_set_nodata(ca_heap *h, int nodata)
{
    if (h) h->nodata = nodata != 0;
}

int64_t ca_heap_defrag(ca_heap *h, ca_move_cb cb, void *ctx)
{
    if (!h) return -CA_EINVAL;
    if (h->busy) return -CA_EBUSY;
    h->busy = BUSY_DEFRAG;
    int64_t moved = 0;
    int64_t off = 0;
    while ((uint64_t)off < h->cap) {
        hdr_t *f = H(h, off);
        if (!(f->flags & F_FREE)) {
            off += (int64_t)f->size;
            continue;
        }
        int64_t a = off + (int64_t)f->size;
        if ((uint64_t)a >= h->cap) break;
        hdr_t *ab = H(h, a);             /* allocated: free blocks are never adjacent */
        uint64_t asz = ab->size;
        if (cb && cb(ctx, ab->owner, a, off) != 0) {
            off = a + (int64_t)asz;       /* pinned: the gap before it stays a free block */
            continue;
        }
        uint64_t fsz = f->size, back = f->backsize;
        list_remove(h, off);
        memmove(h->base + off, h->base + a, h->nodata ? CA_HEADER : asz);
        hdr_t *nb = H(h, off);
        nb->backsize = back;
        nb->check = magic(h, off);
        int64_t nf = off + (int64_t)asz;
        if (a > nf) invalidate(h, a);     /* the old header now lies inside the new gap */
        write_hdr(h, nf, fsz, asz, 0, 0);
        off = make_free(h, nf);
        moved++;
    }
    h->busy = IDLE;
    return moved;
}

/* ---------------------------------------------------------------- check */

static int fail(char *msg, size_t msglen, const char *fmt, ...)
{
    if (msg && msglen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, msglen, fmt, ap);
        va_end(ap);
    }
    return CA_EINVAL;
}

int ca_heap_check(const ca_heap *h, char *msg, size_t msglen)
{
    if (!h) return fail(msg, msglen, "heap handle is NULL");
    uint64_t used = 0, freeb = 0, nblocks = 0, nalloc = 0, nfree = 0, special = 0;
    uint64_t prevsize = 0;
    int prevfree = 0;
    uint64_t off = 0;
    while (off < h->cap) {
        hdr_t *b = H(h, (int64_t)off);
        if (b->check != magic(h, (int64_t)off))
            return fail(msg, msglen, "block at offset %llu: bad magic word (header overwritten?)",
                        (unsigned long long)off);
        uint64_t sz = b->size;
        if (sz == 0 || (sz & (h->gran - 1)) || sz > h->cap - off)
            return fail(msg, msglen,
                        "block at offset %llu: size %llu is zero, not a multiple of the "
                        "granularity %llu, or runs past the heap end %llu",
                        (unsigned long long)off, (unsigned long long)sz,
                        (unsigned long long)h->gran, (unsigned long long)h->cap);
        if (b->backsize != prevsize)
            return fail(msg, msglen, "block at offset %llu: back-size %llu but previous block has %llu bytes",
                        (unsigned long long)off, (unsigned long long)b->backsize,
                        (unsigned long long)prevsize);
        uint32_t f = b->flags;
        if (f & F_FREE) {
            if (f != F_FREE || b->owner != 0)
                return fail(msg, msglen, "free block at offset %llu has flags %u and owner %llu",
                            (unsigned long long)off, f, (unsigned long long)b->owner);
            if (prevfree)
                return fail(msg, msglen, "free blocks at offsets %llu and %llu are adjacent (not coalesced)",
                            (unsigned long long)(off - prevsize), (unsigned long long)off);
            freeb += sz;
            nfree++;
        } else if (f & F_ABSORBED) {
            if (h->busy != BUSY_EVICT)
                return fail(msg, msglen, "block at offset %llu is marked absorbed outside evictfrom",
                            (unsigned long long)off);
            special++;
        } else if (f & F_ORPHANED) {
            if (h->busy != BUSY_EVICT || !(f & F_EVICTING))
                return fail(msg, msglen, "block at offset %llu is marked orphaned outside evictfrom",
                            (unsigned long long)off);
            special++;
        } else {
            if (f & ~F_EVICTING)
                return fail(msg, msglen, "allocated block at offset %llu has unknown flags %u",
                            (unsigned long long)off, f);
            if ((f & F_EVICTING) && h->busy != BUSY_EVICT)
                return fail(msg, msglen, "block at offset %llu is marked evicting outside evictfrom",
                            (unsigned long long)off);
            if (b->owner == 0)
                return fail(msg, msglen, "allocated block at offset %llu has owner 0",
                            (unsigned long long)off);
            used += sz;
            nalloc++;
        }
        prevfree = (f & F_FREE) != 0;
        prevsize = sz;
        off += sz;
        nblocks++;
    }
    if (nblocks != h->nblocks || nalloc != h->nalloc || used != h->used || freeb != h->freeb ||
        nfree != h->nfree)
        return fail(msg, msglen,
                    "counters disagree with the blocks: blocks %llu/%llu, allocated %llu/%llu, "
                    "used bytes %llu/%llu, free bytes %llu/%llu, free blocks %llu/%llu (walk/counter)",
                    (unsigned long long)nblocks, (unsigned long long)h->nblocks,
                    (unsigned long long)nalloc, (unsigned long long)h->nalloc,
                    (unsigned long long)used, (unsigned long long)h->used,
                    (unsigned long long)freeb, (unsigned long long)h->freeb,
                    (unsigned long long)nfree, (unsigned long long)h->nfree);
    if (h->busy != BUSY_EVICT && used + freeb != h->cap)
        return fail(msg, msglen, "used %llu + free %llu bytes != capacity %llu",
                    (unsigned long long)used, (unsigned long long)freeb, (unsigned long long)h->cap);

    uint64_t listed = 0;
    for (uint32_t c = 0; c < h->nclasses; c++) {
        int nonempty = h->heads[c] != NIL;
        int bit = (h->bits0[c >> 6] >> (c & 63)) & 1;
        if (nonempty != bit)
            return fail(msg, msglen, "class %u: list %s but bitmap bit is %d", c,
                        nonempty ? "non-empty" : "empty", bit);
        int64_t prev = NIL;
        for (int64_t o = h->heads[c]; o != NIL; o = H(h, o)->next) {
            if (++listed > nfree)
                return fail(msg, msglen, "free lists hold more entries than the %llu free blocks (cycle?)",
                            (unsigned long long)nfree);
            if (o < 0 || (uint64_t)o >= h->cap || !valid_block(h, o))
                return fail(msg, msglen, "class %u lists offset %lld, which is not a block",
                            c, (long long)o);
            hdr_t *b = H(h, o);
            if (b->flags != F_FREE)
                return fail(msg, msglen, "class %u lists block %lld with flags %u (not free)",
                            c, (long long)o, b->flags);
            if (class_of(h, b->size) != c)
                return fail(msg, msglen, "block %lld of %llu bytes is on list %u, belongs on %u",
                            (long long)o, (unsigned long long)b->size, c, class_of(h, b->size));
            if (b->prev != prev)
                return fail(msg, msglen, "block %lld: free-list back link %lld, expected %lld",
                            (long long)o, (long long)b->prev, (long long)prev);
            prev = o;
        }
    }
    if (listed != nfree)
        return fail(msg, msglen, "%llu free blocks but %llu on the free lists",
                    (unsigned long long)nfree, (unsigned long long)listed);
    for (uint32_t w = 0; w < h->nwords0; w++) {
        int bit = (h->bits1[w >> 6] >> (w & 63)) & 1;
        if ((h->bits0[w] != 0) != bit)
            return fail(msg, msglen, "bitmap summary bit %u is %d but word is %s", w, bit,
                        h->bits0[w] ? "non-zero" : "zero");
    }
    (void)special;
    if (msg && msglen) msg[0] = '\0';
    return CA_OK;
}
