"""Shared helpers for the benchmark scripts: machine description and robust timing."""

import os
import platform
import statistics
import time


def machine():
    """One line naming the CPU, core count and thread settings."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return (f"machine: {model}, {os.cpu_count()} cpus, python {platform.python_version()}, "
            f"OMP_NUM_THREADS={threads}")


def timeit(fn, number):
    """Seconds per call of fn, over `number` calls."""
    t = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t) / number


def interleaved(fns, repeats, number):
    """Median seconds per call for each fn, timing them in turn in every repetition."""
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            samples[i].append(timeit(fn, number))
    return [statistics.median(s) for s in samples]


def calls_for(fn, budget=0.02):
    """How many calls of fn fit in about `budget` seconds (at least 1)."""
    t = timeit(fn, 1)
    return max(1, min(100000, int(budget / max(t, 1e-7))))
