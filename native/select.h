/* Element-wise select for np.where's three-argument form (compiled into cachedarrays._records). */
#ifndef CA_SELECT_H
#define CA_SELECT_H

#include <stdint.h>

/* out[i] = cond[i] ? x[i] : y[i] for n elements of itemsize bytes (cond: n bytes, nonzero is
 * true). A step of 0 repeats element 0 of that operand (a scalar), any other step is 1.
 * Branch-free for 1, 2, 4, 8 and 16-byte elements. out may be x or y; no other overlap. */
void ca_select(void *out, const uint8_t *cond, const void *x, int xstep, const void *y,
               int ystep, uint64_t n, uint64_t itemsize);
/* Force the loops' ISA ("avx512", "avx2", "sse2"; for tests): 0, or -1 if this CPU lacks it. */
int ca_select_set_isa(const char *name);
const char *ca_select_isa(void);                  /* "avx512", "avx2" or "sse2" */

#endif
