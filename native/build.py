"""cffi builder (API mode) for cachedarrays._native: the heap allocator and the copy engine."""
import os
import re

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


def _header_cdef():
    """The declarations of ca_native.h in the form cffi's cdef accepts (one source of truth)."""
    out = []
    with open(os.path.join(HERE, "ca_native.h")) as f:
        for line in f:
            m = re.match(r"\s*#\s*define\s+(CA_\w+)\s+\S", line)
            if m and m.group(1) != "CA_NATIVE_H":
                out.append(f"#define {m.group(1)} ...")
            elif not line.lstrip().startswith("#"):
                out.append(line.rstrip("\n"))
    return "\n".join(out)


CDEF = _header_cdef() + """

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
