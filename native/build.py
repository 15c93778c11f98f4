"""cffi builder (API mode) for cachedarrays._native: the heap allocator and the copy engine."""
import os

import cffi

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _rel(path):
    """Paths relative to the repo root when pip builds from there, else absolute."""
    full = os.path.join(HERE, path)
    try:
        rel = os.path.relpath(full, os.getcwd())
    except ValueError:
        return full
    return full if rel.startswith("..") else rel


CDEF = """
#define CA_HEADER ...
#define CA_OK ...
#define CA_ENOMEM ...
#define CA_EINVAL ...
#define CA_EBUSY ...
#define CA_FLAG_FREE ...
#define CA_FLAG_EVICTING ...
#define CA_FLAG_ORPHANED ...
#define CA_COPY_PERSIST ...

typedef struct ca_heap ca_heap;

typedef struct {
    int64_t offset;
    uint64_t size;
    uint64_t owner;
    uint32_t flags;
} ca_block_info;

typedef struct {
    uint64_t capacity;
    uint64_t granularity;
    uint64_t used;
    uint64_t free;
    uint64_t largest_free;
    uint64_t nblocks;
    uint64_t nallocated;
} ca_heap_stats;

ca_heap *ca_heap_create(void *base, uint64_t size, uint64_t granularity);
void ca_heap_destroy(ca_heap *h);
uint64_t ca_heap_block_size(const ca_heap *h, uint64_t nbytes);
int64_t ca_heap_alloc(ca_heap *h, uint64_t nbytes, uint64_t owner);
int ca_heap_free(ca_heap *h, int64_t block, uint64_t owner);
int ca_heap_info(const ca_heap *h, int64_t block, ca_block_info *out);
int64_t ca_heap_first(const ca_heap *h);
int64_t ca_heap_next(const ca_heap *h, int64_t block);
void ca_heap_get_stats(const ca_heap *h, ca_heap_stats *out);
int ca_heap_can_alloc(const ca_heap *h, uint64_t nbytes);

typedef int (*ca_evict_cb)(void *ctx, int64_t block, uint64_t owner);
int64_t ca_heap_evictfrom(ca_heap *h, int64_t start, uint64_t nbytes, ca_evict_cb cb, void *ctx);
typedef int (*ca_move_cb)(void *ctx, uint64_t owner, int64_t old_block, int64_t new_block);
int64_t ca_heap_defrag(ca_heap *h, ca_move_cb cb, void *ctx);
int ca_heap_check(const ca_heap *h, char *msg, size_t msglen);

void ca_copy(void *dst, const void *src, uint64_t n, int nthreads, unsigned flags);
void ca_copy_set_threads(int nthreads);
int ca_copy_get_threads(void);
void ca_copy_set_nt_threshold(uint64_t nbytes);
uint64_t ca_copy_get_nt_threshold(void);
const char *ca_copy_isa(void);
int ca_copy_set_isa(const char *name);
void ca_flush(void *addr, uint64_t n);

int ca_mbind(void *addr, uint64_t len, int node);

/* defined in the module preamble: ca_copy on integer addresses (cheaper to call from Python) */
void ca_copy_u(uintptr_t dst, uintptr_t src, uint64_t n, int nthreads, unsigned flags);

extern "Python" int ca_py_evict(void *, int64_t, uint64_t);
extern "Python" int ca_py_move(void *, uint64_t, int64_t, int64_t);
"""

PREAMBLE = r'''
#include "ca_native.h"
static void ca_copy_u(uintptr_t dst, uintptr_t src, uint64_t n, int nthreads, unsigned flags)
{
    ca_copy((void *)dst, (const void *)src, n, nthreads, flags);
}
'''

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "cachedarrays._native",
    PREAMBLE,
    sources=[_rel("heap.c"), _rel("copy.c")],
    include_dirs=[_rel(".")],
    extra_compile_args=["-O3", "-std=c11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=os.path.join(ROOT, "build", "cffi"), verbose=True)
