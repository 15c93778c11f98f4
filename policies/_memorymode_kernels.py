"""The memory-mode cache simulation kernels (numba): compiled on first use, so that importing
the policies does not load numba."""

import numpy as np
from numba import njit

from ._memorymode_slots import (_CLEAN, _DIRTY, _DRAM_READ, _DRAM_WRITE, _HITS, _READ_BYTES,
                                _READ_LINES, _SLOW_READ, _SLOW_WRITE, _WRITE_BYTES,
                                _WRITE_LINES)


@njit(cache=True)
def _touch_lines(tags, dirty, line, count, write):
    """Access ``count`` consecutive lines from ``line``; return (hits, clean misses, dirty misses)."""
    nsets = tags.shape[0]
    flag = np.uint8(1) if write else np.uint8(0)
    st = line % nsets
    hits = 0
    clean = 0
    dirt = 0
    done = 0
    while done < count:
        seg = min(count - done, nsets - st)
        for k in range(seg):
            j = st + k
            ln = line + k
            if tags[j] == ln:
                hits += 1
                if write:
                    dirty[j] = flag
            else:
                if dirty[j]:
                    dirt += 1
                else:
                    clean += 1
                tags[j] = ln
                dirty[j] = flag
        done += seg
        line += seg
        st = 0
    return hits, clean, dirt


@njit(cache=True)
def _run(tags, dirty, starts, lengths, writes, line_size, nofill, out):
    """Apply the byte ranges in order to the cache state and add their traffic to ``out``."""
    nsets = tags.shape[0]
    rbytes = 0
    wbytes = 0
    rlines = 0
    wlines = 0
    hits = 0
    clean = 0
    dirt = 0
    slow_r = 0
    slow_w = 0
    dram_r = 0
    dram_w = 0
    for r in range(starts.shape[0]):
        n = lengths[r]
        if n <= 0:
            continue
        write = writes[r] != 0
        first = starts[r] // line_size
        last = (starts[r] + n - 1) // line_size
        count = last - first + 1
        if count > 3 * nsets:
            # Beyond the second wrap every line evicts one this range inserted (dirty iff writing),
            # so the middle wraps are counted without touching the arrays; the last wrap sets the state.
            h, c, d = _touch_lines(tags, dirty, first, 2 * nsets, write)
            middle = count - 3 * nsets
            if write:
                d += middle
            else:
                c += middle
            h2, c2, d2 = _touch_lines(tags, dirty, last - nsets + 1, nsets, write)
            h += h2
            c += c2
            d += d2
        else:
            h, c, d = _touch_lines(tags, dirty, first, count, write)
        misses = c + d
        hits += h
        clean += c
        dirt += d
        dram_r += count  # tag check; it also reads a dirty victim's data
        slow_w += d
        if write:
            wbytes += n
            wlines += count
            dram_w += count  # the written data
            if not nofill:
                slow_r += misses
                dram_w += misses
        else:
            rbytes += n
            rlines += count
            slow_r += misses
            dram_w += misses
    out[_READ_BYTES] += rbytes
    out[_WRITE_BYTES] += wbytes
    out[_READ_LINES] += rlines
    out[_WRITE_LINES] += wlines
    out[_HITS] += hits
    out[_CLEAN] += clean
    out[_DIRTY] += dirt
    out[_SLOW_READ] += slow_r
    out[_SLOW_WRITE] += slow_w
    out[_DRAM_READ] += dram_r
    out[_DRAM_WRITE] += dram_w
