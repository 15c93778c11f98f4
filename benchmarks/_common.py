"""Shared helpers for the benchmark scripts: thread settings, machine line, robust timing,
spread, goals, progress bars and the argument conventions every script follows.

Import this module before NumPy, PyTorch or cachedarrays: it sets ``OMP_WAIT_POLICY=PASSIVE``
(unless the caller chose) while no OpenMP runtime has started, so ours and the peer's pools run
under the same rule (cachedarrays/threads.py says why).

Conventions: every ratio is ``speedup = peer time / our time`` (> 1: we are faster); a median
is of >= 3 samples and printed with its spread; each goal prints one line
``goal <name>: <value> (target >= <t>): met|not met``. When ``CA_BENCH_RESULTS`` names a file,
goals and headline figures are appended to it as JSON lines (``make bench`` collects them).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SCRIPT = os.path.splitext(os.path.basename(sys.argv[0]))[0] if sys.argv else "benchmark"


# ----------------------------------------------------------------------------- arguments

class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help that shows every flag's default and choices."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.choices is not None and action.metavar is not None and "choice" not in text:
            text += (" " if text else "") + "(choices: %(choices)s)"   # else the usage shows them
        if ("default" not in text.lower() and action.default is not argparse.SUPPRESS
                and action.default not in (None, "") and action.option_strings
                and action.nargs != 0):
            text += (" " if text else "") + "(default: %(default)s)"
        return text


def parser(doc, **kwargs):
    """An ArgumentParser whose description is the script's docstring and whose --help shows
    every default and choice."""
    first, _, rest = (doc or "").strip().partition("\n")
    return argparse.ArgumentParser(description=first, epilog=rest.strip() or None,
                                   formatter_class=_Formatter, **kwargs)


def add_standard(p, threads=None, plot=True, progress=True, with_threads=True):
    """--threads N, --plot PATH and --no-progress, the flags every script has."""
    if with_threads:
        p.add_argument("--threads", type=int, default=threads or os.cpu_count(),
                       help="threads for ours and the peer alike (BLAS, OpenMP, numba, PyTorch)")
    if plot:
        p.add_argument("--plot", metavar="PATH", default=None, help="write a figure to PATH (PNG)")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


# ------------------------------------------------------------------------ threads, machine

def apply_threads(n):
    """Run every pool on n threads (ours and the peer's); returns the one-line description."""
    from cachedarrays import threads
    return threads.describe(threads.limit(n))


def thread_line():
    """The thread settings in force, one line."""
    from cachedarrays import threads
    return "threads: " + threads.describe()


def machine():
    """One line naming the CPU, core count, Python and the load average."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "load average unknown"
    return (f"machine: {model}, {os.cpu_count()} cpus, python {platform.python_version()}, "
            f"{load}, empty Python call {python_call_ns():.0f} ns, "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


def python_call_ns(calls=200_000):
    """Nanoseconds per call of an empty Python function (median of 3): how fast this machine
    runs Python right now (about 40-60 ns on an idle modern core), to scale per-call figures."""
    def f():
        pass
    out = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        out.append((time.perf_counter() - t) / calls * 1e9)
    return statistics.median(out)


# ---------------------------------------------------------------------------- timing

def timeit(fn, number):
    """Seconds per call of fn, over `number` calls."""
    t = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t) / number


def turn_order(n, rep):
    """The order in which repetition ``rep`` runs ``n`` interleaved implementations: forward on
    even repetitions, backward on odd ones.  A fixed order has each implementation always
    follow the same one, whose traces (caches and TLBs filled with its data, its thread pool
    just gone to sleep) it then always pays: a SimpleTable lookup measured 2% slower right
    after torch's than after another table's, and torch's 18% slower after ours than after
    its own."""
    return range(n) if rep % 2 == 0 else range(n - 1, -1, -1)


def interleaved_samples(fns, repeats, number=1):
    """Per fn, the list of seconds-per-call samples, timing the fns in turn in every repetition
    (in ``turn_order``)."""
    samples = [[] for _ in fns]
    for rep in range(repeats):
        for i in turn_order(len(fns), rep):
            samples[i].append(timeit(fns[i], number))
    return samples


def interleaved(fns, repeats, number):
    """Median seconds per call for each fn, timing them in turn in every repetition."""
    return [statistics.median(s) for s in interleaved_samples(fns, repeats, number)]


def calls_for(fn, budget=0.02):
    """How many calls of fn fit in about `budget` seconds (at least 1)."""
    t = timeit(fn, 1)
    return max(1, min(100000, int(budget / max(t, 1e-7))))


class Stat:
    """Median and spread (min..max) of a list of samples."""

    def __init__(self, samples):
        self.samples = [float(s) for s in samples]
        if not self.samples:
            raise ValueError("Stat: no samples")
        self.median = statistics.median(self.samples)
        self.lo, self.hi = min(self.samples), max(self.samples)
        self.n = len(self.samples)

    def fmt(self, scale=1e3, unit="ms", digits=2):
        """'12.30 ms [11.90-13.00, n=5]'."""
        f = f"{{:.{digits}f}}"
        return (f"{f.format(self.median * scale)} {unit} "
                f"[{f.format(self.lo * scale)}-{f.format(self.hi * scale)}, n={self.n}]")

    __str__ = fmt


def speedup(peer, ours):
    """peer time / our time (> 1: we are faster). Accepts seconds or Stat medians."""
    peer = peer.median if isinstance(peer, Stat) else peer
    ours = ours.median if isinstance(ours, Stat) else ours
    return peer / ours


def speedups(peer_samples, our_samples):
    """Stat of per-repetition speedups (paired samples of the same repetition)."""
    return Stat([p / o for p, o in zip(peer_samples, our_samples)])


# ---------------------------------------------------------------------------- reporting

def record(kind, **fields):
    """Append one JSON line to $CA_BENCH_RESULTS (if set): the input of the Markdown summary."""
    path = os.environ.get("CA_BENCH_RESULTS")
    if not path:
        return
    fields = {"script": SCRIPT, "kind": kind, **fields}
    with open(path, "a") as f:
        f.write(json.dumps(fields, default=float) + "\n")


def goal(name, value, target, *, higher=True, unit="x", detail=""):
    """Print 'goal <name>: <value> (target >= <target>): met|not met' and record it."""
    met = value >= target if higher else value <= target
    cmp = ">=" if higher else "<="
    extra = f"  ({detail})" if detail else ""
    print(f"goal {name}: {value:.2f}{unit} (target {cmp} {target:g}{unit}): "
          f"{'met' if met else 'not met'}{extra}", flush=True)
    record("goal", name=name, value=value, target=target, higher=higher, unit=unit, met=met,
           detail=detail)
    return met


def headline(name, value, unit="x", detail=""):
    """Record (and print) a headline figure that has no goal."""
    print(f"{name}: {value:.2f}{unit}{'  (' + detail + ')' if detail else ''}", flush=True)
    record("headline", name=name, value=value, unit=unit, detail=detail)


def progress(iterable=None, total=None, desc=None, disable=False):
    """A tqdm progress bar on stderr (disabled when stderr is not a terminal and CA_PROGRESS
    is unset, or when `disable`)."""
    from tqdm import tqdm
    if not disable and not sys.stderr.isatty() and not os.environ.get("CA_PROGRESS"):
        disable = True
    return tqdm(iterable, total=total, desc=desc, disable=disable, file=sys.stderr,
                leave=False, dynamic_ncols=True)


def save_plot(fig, path):
    """Write a matplotlib figure to path (folders created) and say where."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"figure: {path}")
