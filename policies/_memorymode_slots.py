"""The counter slots the memory-mode cache kernels fill (bytes for the first two, lines for
the rest)."""

_READ_BYTES, _WRITE_BYTES, _READ_LINES, _WRITE_LINES = 0, 1, 2, 3
_HITS, _CLEAN, _DIRTY, _FLUSHED = 4, 5, 6, 7
_SLOW_READ, _SLOW_WRITE, _DRAM_READ, _DRAM_WRITE = 8, 9, 10, 11
_NCOUNTERS = 12
