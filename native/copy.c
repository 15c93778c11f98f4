/* Copy engine: multi-threaded copies over a small persistent worker pool, non-temporal streaming
 * stores (widest ISA found at run time) above a size threshold, cache-line write-back for DAX
 * persistence, and an mbind wrapper. Safe to call from several threads at once.
 */
#define _GNU_SOURCE
#include "ca_native.h"

#include <cpuid.h>
#include <errno.h>
#include <immintrin.h>
#include <pthread.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MT_MIN (UINT64_C(1) << 20)        /* copies below this run on the calling thread only */
#define MAX_THREADS 64
#define CHUNK_MIN (UINT64_C(1) << 20)    /* smallest piece a multi-threaded copy is cut into */
#define DEFAULT_NT (UINT64_C(4) << 20)

#define NT_UNSET UINT64_MAX

static int g_threads = 1;
static uint64_t g_nt = NT_UNSET;      /* resolved at first use: see default_nt() */

/* ---------------------------------------------------------------- ISA dispatch */

typedef void (*stream_fn)(unsigned char *d, const unsigned char *s, uint64_t n);
typedef void (*flush_fn)(unsigned char *p, unsigned char *end);

__attribute__((target("avx512f"))) static void stream_avx512(unsigned char *d,
                                                              const unsigned char *s, uint64_t n)
{
    uint64_t i = 0;
    for (; i + 256 <= n; i += 256) {
        __m512i a = _mm512_loadu_si512((const void *)(s + i));
        __m512i b = _mm512_loadu_si512((const void *)(s + i + 64));
        __m512i c = _mm512_loadu_si512((const void *)(s + i + 128));
        __m512i e = _mm512_loadu_si512((const void *)(s + i + 192));
        _mm512_stream_si512((void *)(d + i), a);
        _mm512_stream_si512((void *)(d + i + 64), b);
        _mm512_stream_si512((void *)(d + i + 128), c);
        _mm512_stream_si512((void *)(d + i + 192), e);
    }
    for (; i < n; i += 64)
        _mm512_stream_si512((void *)(d + i), _mm512_loadu_si512((const void *)(s + i)));
}

/* Large bodies: four 4 KiB pages at a time, interleaving lines of the four pages, which keeps
 * several DRAM pages open at once (the same idea as glibc's large memcpy). */
#define PAGE4 (4 * 4096)
__attribute__((target("avx512f"))) static void stream4_avx512(unsigned char *d,
                                                               const unsigned char *s, uint64_t n)
{
    uint64_t i = 0;
    for (; i + PAGE4 <= n; i += PAGE4) {
        const unsigned char *sp = s + i;
        unsigned char *dp = d + i;
        for (uint64_t l = 0; l < 4096; l += 128) {
            __builtin_prefetch(sp + l + 512);
            __builtin_prefetch(sp + 4096 + l + 512);
            __builtin_prefetch(sp + 8192 + l + 512);
            __builtin_prefetch(sp + 12288 + l + 512);
            __m512i a0 = _mm512_loadu_si512((const void *)(sp + l));
            __m512i a1 = _mm512_loadu_si512((const void *)(sp + l + 64));
            __m512i b0 = _mm512_loadu_si512((const void *)(sp + 4096 + l));
            __m512i b1 = _mm512_loadu_si512((const void *)(sp + 4096 + l + 64));
            __m512i c0 = _mm512_loadu_si512((const void *)(sp + 8192 + l));
            __m512i c1 = _mm512_loadu_si512((const void *)(sp + 8192 + l + 64));
            __m512i e0 = _mm512_loadu_si512((const void *)(sp + 12288 + l));
            __m512i e1 = _mm512_loadu_si512((const void *)(sp + 12288 + l + 64));
            _mm512_stream_si512((void *)(dp + l), a0);
            _mm512_stream_si512((void *)(dp + l + 64), a1);
            _mm512_stream_si512((void *)(dp + 4096 + l), b0);
            _mm512_stream_si512((void *)(dp + 4096 + l + 64), b1);
            _mm512_stream_si512((void *)(dp + 8192 + l), c0);
            _mm512_stream_si512((void *)(dp + 8192 + l + 64), c1);
            _mm512_stream_si512((void *)(dp + 12288 + l), e0);
            _mm512_stream_si512((void *)(dp + 12288 + l + 64), e1);
        }
    }
    stream_avx512(d + i, s + i, n - i);
}

__attribute__((target("avx2"))) static void stream_avx2(unsigned char *d, const unsigned char *s,
                                                         uint64_t n)
{
    uint64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
    for (; i < n; i += 32)
        _mm256_stream_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
}

__attribute__((target("avx2"))) static void stream4_avx2(unsigned char *d, const unsigned char *s,
                                                          uint64_t n)
{
    uint64_t i = 0;
    for (; i + PAGE4 <= n; i += PAGE4) {
        const unsigned char *sp = s + i;
        unsigned char *dp = d + i;
        for (uint64_t l = 0; l < 4096; l += 64) {
            __builtin_prefetch(sp + l + 512);
            __builtin_prefetch(sp + 4096 + l + 512);
            __builtin_prefetch(sp + 8192 + l + 512);
            __builtin_prefetch(sp + 12288 + l + 512);
            __m256i a0 = _mm256_loadu_si256((const __m256i *)(sp + l));
            __m256i a1 = _mm256_loadu_si256((const __m256i *)(sp + l + 32));
            __m256i b0 = _mm256_loadu_si256((const __m256i *)(sp + 4096 + l));
            __m256i b1 = _mm256_loadu_si256((const __m256i *)(sp + 4096 + l + 32));
            __m256i c0 = _mm256_loadu_si256((const __m256i *)(sp + 8192 + l));
            __m256i c1 = _mm256_loadu_si256((const __m256i *)(sp + 8192 + l + 32));
            __m256i e0 = _mm256_loadu_si256((const __m256i *)(sp + 12288 + l));
            __m256i e1 = _mm256_loadu_si256((const __m256i *)(sp + 12288 + l + 32));
            _mm256_stream_si256((__m256i *)(dp + l), a0);
            _mm256_stream_si256((__m256i *)(dp + l + 32), a1);
            _mm256_stream_si256((__m256i *)(dp + 4096 + l), b0);
            _mm256_stream_si256((__m256i *)(dp + 4096 + l + 32), b1);
            _mm256_stream_si256((__m256i *)(dp + 8192 + l), c0);
            _mm256_stream_si256((__m256i *)(dp + 8192 + l + 32), c1);
            _mm256_stream_si256((__m256i *)(dp + 12288 + l), e0);
            _mm256_stream_si256((__m256i *)(dp + 12288 + l + 32), e1);
        }
    }
    stream_avx2(d + i, s + i, n - i);
}

static void stream_sse2(unsigned char *d, const unsigned char *s, uint64_t n)
{
    for (uint64_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
}

__attribute__((target("clwb"))) static void flush_clwb(unsigned char *p, unsigned char *end)
{
    for (; p < end; p += 64) _mm_clwb(p);
}

__attribute__((target("clflushopt"))) static void flush_clflushopt(unsigned char *p,
                                                                    unsigned char *end)
{
    for (; p < end; p += 64) _mm_clflushopt(p);
}

static void flush_clflush(unsigned char *p, unsigned char *end)
{
    for (; p < end; p += 64) _mm_clflush(p);
}

static pthread_once_t g_isa_once = PTHREAD_ONCE_INIT;
static stream_fn g_stream = stream_sse2;
static flush_fn g_flush = flush_clflush;
static const char *g_isa = "sse2";

static void detect_isa(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        g_stream = stream4_avx512;
        g_isa = "avx512";
    } else if (__builtin_cpu_supports("avx2")) {
        g_stream = stream4_avx2;
        g_isa = "avx2";
    }
    unsigned a, b, c, d;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        if (b & (1u << 24)) g_flush = flush_clwb;
        else if (b & (1u << 23)) g_flush = flush_clflushopt;
    }
}

/* Default non-temporal threshold: 4 MiB, or an eighth of the last-level cache if that is larger
 * (below it the destination stays in cache and plain stores win; measured crossover on a 480 MiB
 * L3 guest was 32-64 MiB). */
static uint64_t default_nt(void)
{
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    uint64_t nt = DEFAULT_NT;
    if (l3 > 0 && (uint64_t)l3 / 8 > nt) nt = (uint64_t)l3 / 8;
    return nt;
}

static void detect_all(void)
{
    detect_isa();
    uint64_t unset = NT_UNSET;
    __atomic_compare_exchange_n(&g_nt, &unset, default_nt(), 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

static inline void init_isa(void) { pthread_once(&g_isa_once, detect_all); }

int ca_copy_set_isa(const char *name)
{
    init_isa();
    __builtin_cpu_init();
    if (!name) return CA_EINVAL;
    if (!strcmp(name, "avx512") && __builtin_cpu_supports("avx512f")) g_stream = stream4_avx512;
    else if (!strcmp(name, "avx2") && __builtin_cpu_supports("avx2")) g_stream = stream4_avx2;
    else if (!strcmp(name, "sse2")) g_stream = stream_sse2;
    else return CA_EINVAL;
    g_isa = !strcmp(name, "avx512") ? "avx512" : !strcmp(name, "avx2") ? "avx2" : "sse2";
    return CA_OK;
}

const char *ca_copy_isa(void)
{
    init_isa();
    return g_isa;
}

static void flush_range(void *addr, uint64_t n)
{
    if (n == 0) return;
    unsigned char *p = (unsigned char *)((uintptr_t)addr & ~(uintptr_t)63);
    g_flush(p, (unsigned char *)addr + n);
}

void ca_flush(void *addr, uint64_t n)
{
    init_isa();
    flush_range(addr, n);
    _mm_sfence();
}

/* One thread's share: plain memcpy, or streaming stores over the 64-byte-aligned body of the
 * destination with memcpy for the unaligned head and tail. Ends with a fence when it streamed
 * or flushed, so the data is globally visible before the caller learns the chunk is done. */
static void copy_range(unsigned char *d, const unsigned char *s, uint64_t n, int nt, int persist)
{
    if (nt && n >= 256) {
        uint64_t head = (64 - ((uintptr_t)d & 63)) & 63;
        memcpy(d, s, head);
        uint64_t body = (n - head) & ~UINT64_C(63);
        g_stream(d + head, s + head, body);
        memcpy(d + head + body, s + head + body, n - head - body);
    } else {
        memcpy(d, s, n);
    }
    if (persist) flush_range(d, n);
    if (nt || persist) _mm_sfence();
}

/* ---------------------------------------------------------------- worker pool */

typedef struct job {
    unsigned char *dst;
    const unsigned char *src;
    uint64_t n;
    int nchunks, next, remaining;
    int nt, persist;
    pthread_cond_t done;
    struct job *qnext;
} job_t;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_work = PTHREAD_COND_INITIALIZER;
static job_t *g_queue;          /* jobs with chunks left to hand out, oldest first */
static int g_workers;           /* workers started */
static pthread_once_t g_fork_once = PTHREAD_ONCE_INIT;

static void chunk_bounds(const job_t *j, int c, uint64_t *lo, uint64_t *hi)
{
    /* boundaries on 64-byte-aligned destination addresses, so no cache line is shared */
    uintptr_t d = (uintptr_t)j->dst;
    uint64_t b[2];
    for (int k = 0; k < 2; k++) {
        int i = c + k;
        if (i == 0) { b[k] = 0; continue; }
        if (i == j->nchunks) { b[k] = j->n; continue; }
        uint64_t raw = (uint64_t)((unsigned __int128)j->n * (unsigned)i / (unsigned)j->nchunks);
        uint64_t al = ((d + raw + 63) & ~(uintptr_t)63) - d;
        b[k] = al > j->n ? j->n : al;
    }
    *lo = b[0];
    *hi = b[1];
}

static void run_chunk(job_t *j, int c)
{
    uint64_t lo, hi;
    chunk_bounds(j, c, &lo, &hi);
    if (hi > lo) copy_range(j->dst + lo, j->src + lo, hi - lo, j->nt, j->persist);
}

static void dequeue(job_t *j)
{
    job_t **pp = &g_queue;
    while (*pp && *pp != j) pp = &(*pp)->qnext;
    if (*pp) *pp = j->qnext;
    j->qnext = NULL;
}

/* Take the next chunk of the oldest job (caller holds g_mu); -1 when the queue is empty. */
static int take_chunk(job_t **out)
{
    job_t *j = g_queue;
    if (!j) return -1;
    int c = j->next++;
    if (j->next == j->nchunks) dequeue(j);
    *out = j;
    return c;
}

static void *worker_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g_mu);
    for (;;) {
        job_t *j;
        int c;
        while ((c = take_chunk(&j)) < 0) pthread_cond_wait(&g_work, &g_mu);
        pthread_mutex_unlock(&g_mu);
        run_chunk(j, c);
        pthread_mutex_lock(&g_mu);
        if (--j->remaining == 0) pthread_cond_signal(&j->done);
    }
    return NULL;
}

static void atfork_prepare(void) { pthread_mutex_lock(&g_mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_mu); }
static void atfork_child(void)
{
    /* the workers do not exist in the child; start over with an empty pool */
    pthread_mutex_init(&g_mu, NULL);
    pthread_cond_init(&g_work, NULL);
    g_queue = NULL;
    g_workers = 0;
}

static void register_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

/* Start workers until there are want of them (caller holds g_mu). A failure to start one only
 * means the calling thread copies more chunks itself. */
static void ensure_workers(int want)
{
    while (g_workers < want) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &at, worker_main, NULL);
        pthread_attr_destroy(&at);
        if (rc != 0) break;
        g_workers++;
    }
}

void ca_copy(void *dst, const void *src, uint64_t n, int nthreads, unsigned flags)
{
    if (n == 0 || dst == src) {
        if (n && (flags & CA_COPY_PERSIST)) ca_flush(dst, n);
        return;
    }
    init_isa();
    uint64_t ntt = __atomic_load_n(&g_nt, __ATOMIC_RELAXED);
    int nt = ntt != 0 && n >= ntt;
    int persist = (flags & CA_COPY_PERSIST) != 0;
    int t = nthreads > 0 ? nthreads : __atomic_load_n(&g_threads, __ATOMIC_RELAXED);
    if (t > MAX_THREADS) t = MAX_THREADS;
    if (n < MT_MIN || t < 1) t = 1;
    if (t == 1) {
        copy_range(dst, src, n, nt, persist);
        return;
    }

    pthread_once(&g_fork_once, register_atfork);
    /* a few chunks per thread (each >= CHUNK_MIN) so a late or busy worker costs little */
    uint64_t nch = n / CHUNK_MIN;
    if (nch > (uint64_t)(4 * t)) nch = (uint64_t)(4 * t);
    if (nch < (uint64_t)t) nch = (uint64_t)t;
    job_t j = {.dst = dst, .src = src, .n = n, .nchunks = (int)nch, .next = 0, .remaining = (int)nch,
               .nt = nt, .persist = persist, .qnext = NULL};
    pthread_cond_init(&j.done, NULL);
    pthread_mutex_lock(&g_mu);
    ensure_workers(t - 1);
    job_t **pp = &g_queue;
    while (*pp) pp = &(*pp)->qnext;
    *pp = &j;
    pthread_cond_broadcast(&g_work);
    /* the caller works on its own job too, and finishes it alone if every worker is busy */
    while (j.next < j.nchunks) {
        int c = j.next++;
        if (j.next == j.nchunks) dequeue(&j);
        pthread_mutex_unlock(&g_mu);
        run_chunk(&j, c);
        pthread_mutex_lock(&g_mu);
        j.remaining--;
    }
    while (j.remaining > 0) pthread_cond_wait(&j.done, &g_mu);
    pthread_mutex_unlock(&g_mu);
    pthread_cond_destroy(&j.done);
}

void ca_copy_set_threads(int nthreads)
{
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    __atomic_store_n(&g_threads, nthreads, __ATOMIC_RELAXED);
}

int ca_copy_get_threads(void) { return __atomic_load_n(&g_threads, __ATOMIC_RELAXED); }

void ca_copy_set_nt_threshold(uint64_t nbytes)
{
    init_isa();   /* resolve the default first so it never overwrites this setting */
    __atomic_store_n(&g_nt, nbytes, __ATOMIC_RELAXED);
}

uint64_t ca_copy_get_nt_threshold(void)
{
    init_isa();
    return __atomic_load_n(&g_nt, __ATOMIC_RELAXED);
}

/* ---------------------------------------------------------------- memory placement */

int ca_mbind(void *addr, uint64_t len, int node)
{
    enum { MASK_WORDS = 16, MPOL_BIND_ = 2 };
    if (node < 0 || node >= MASK_WORDS * 64) return EINVAL;
    if (len == 0) return 0;
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) page = 4096;
    uintptr_t start = (uintptr_t)addr & ~((uintptr_t)page - 1);   /* mbind wants page alignment */
    uint64_t span = (uint64_t)((uintptr_t)addr - start) + len;
    unsigned long mask[MASK_WORDS] = {0};
    mask[node / 64] = 1UL << (node % 64);
    long rc = syscall(SYS_mbind, (void *)start, (unsigned long)span, MPOL_BIND_, mask,
                      (unsigned long)(MASK_WORDS * 64 + 1), 0UL);
    return rc == 0 ? 0 : errno;
}
