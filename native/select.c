/* Element-wise select (np.where's three-argument form): out[i] = cond[i] ? x[i] : y[i].
 * Part of cachedarrays._records (its ``select``).
 *
 * Branch-free: a mask made from cond picks each element, so the time does not depend on the
 * pattern of cond (a branch per element costs several times more on an unpredictable mask).
 * Elements of 1, 2, 4, 8 and 16 bytes take these loops, compiled for AVX-512, AVX2 and the
 * baseline; other sizes copy element by element. */
#pragma GCC optimize("O3")     /* the loops vectorise at -O3; the extension builds at -O2 */

#include <pthread.h>
#include <string.h>

#include "select.h"

/* out[i] = x[XI] where c[i], else y[YI]; XI/YI are i or 0 (a scalar operand). */
#define SEL_LOOP(T, XI, YI)                                                              \
    do {                                                                                 \
        const T *x_ = (const T *)x, *y_ = (const T *)y;                                  \
        T *o_ = (T *)out;                                                                \
        for (uint64_t i = 0; i < n; i++) {                                               \
            T m_ = (T)0 - (T)(c[i] != 0);                                                \
            o_[i] = (T)((x_[XI] & m_) | (y_[YI] & (T)~m_));                               \
        }                                                                                \
    } while (0)

#define SEL_STEPS(T)                                                                     \
    do {                                                                                 \
        if (xstep && ystep) SEL_LOOP(T, i, i);                                           \
        else if (xstep) SEL_LOOP(T, i, 0);                                               \
        else if (ystep) SEL_LOOP(T, 0, i);                                               \
        else SEL_LOOP(T, 0, 0);                                                          \
    } while (0)

/* 16-byte elements as two 8-byte halves under one mask. */
#define SEL_LOOP16(XI, YI)                                                               \
    do {                                                                                 \
        const uint64_t *x_ = (const uint64_t *)x, *y_ = (const uint64_t *)y;             \
        uint64_t *o_ = (uint64_t *)out;                                                  \
        for (uint64_t i = 0; i < n; i++) {                                               \
            uint64_t m_ = (uint64_t)0 - (uint64_t)(c[i] != 0);                           \
            o_[2 * i] = (x_[2 * (XI)] & m_) | (y_[2 * (YI)] & ~m_);                      \
            o_[2 * i + 1] = (x_[2 * (XI) + 1] & m_) | (y_[2 * (YI) + 1] & ~m_);          \
        }                                                                                \
    } while (0)

#define SEL_BODY                                                                         \
    switch (size) {                                                                      \
    case 1: SEL_STEPS(uint8_t); break;                                                   \
    case 2: SEL_STEPS(uint16_t); break;                                                  \
    case 4: SEL_STEPS(uint32_t); break;                                                  \
    case 8: SEL_STEPS(uint64_t); break;                                                  \
    case 16:                                                                             \
        if (xstep && ystep) SEL_LOOP16(i, i);                                            \
        else if (xstep) SEL_LOOP16(i, 0);                                                \
        else if (ystep) SEL_LOOP16(0, i);                                                \
        else SEL_LOOP16(0, 0);                                                           \
        break;                                                                           \
    }

typedef void (*select_fn)(void *out, const uint8_t *c, const void *x, int xstep, const void *y,
                          int ystep, uint64_t n, uint64_t size);

static void select_base(void *out, const uint8_t *c, const void *x, int xstep, const void *y,
                        int ystep, uint64_t n, uint64_t size)
{
    SEL_BODY
}

__attribute__((target("avx2"))) static void select_avx2(void *out, const uint8_t *c,
                                                        const void *x, int xstep, const void *y,
                                                        int ystep, uint64_t n, uint64_t size)
{
    SEL_BODY
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) static void select_avx512(
    void *out, const uint8_t *c, const void *x, int xstep, const void *y, int ystep, uint64_t n,
    uint64_t size)
{
    SEL_BODY
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static select_fn g_select = select_base;
static const char *g_name = "sse2";

static void detect(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
        g_select = select_avx512;
        g_name = "avx512";
    } else if (__builtin_cpu_supports("avx2")) {
        g_select = select_avx2;
        g_name = "avx2";
    }
}

void ca_select(void *out, const uint8_t *cond, const void *x, int xstep, const void *y,
               int ystep, uint64_t n, uint64_t itemsize)
{
    pthread_once(&g_once, detect);
    if (n == 0 || itemsize == 0) return;
    xstep = xstep != 0;
    ystep = ystep != 0;
    if (itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8 || itemsize == 16) {
        g_select(out, cond, x, xstep, y, ystep, n, itemsize);
        return;
    }
    const unsigned char *xs = (const unsigned char *)x, *ys = (const unsigned char *)y;
    unsigned char *o = (unsigned char *)out;
    for (uint64_t i = 0; i < n; i++)
        memcpy(o + i * itemsize,
               cond[i] ? xs + (xstep ? i * itemsize : 0) : ys + (ystep ? i * itemsize : 0),
               itemsize);
}

int ca_select_set_isa(const char *name)
{
    pthread_once(&g_once, detect);
    __builtin_cpu_init();
    if (!name) return -1;
    if (!strcmp(name, "avx512") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        g_select = select_avx512, g_name = "avx512";
    else if (!strcmp(name, "avx2") && __builtin_cpu_supports("avx2"))
        g_select = select_avx2, g_name = "avx2";
    else if (!strcmp(name, "sse2"))
        g_select = select_base, g_name = "sse2";
    else
        return -1;
    return 0;
}

const char *ca_select_isa(void)
{
    pthread_once(&g_once, detect);
    return g_name;
}
