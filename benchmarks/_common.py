"""Shared helpers for the benchmark scripts: thread settings, machine line, robust timing,
spread, goals, progress bars and the argument conventions every script follows.

Import this module before NumPy, PyTorch or cachedarrays: it drops thread settings a runtime
would refuse (saying so) and sets ``OMP_WAIT_POLICY=PASSIVE`` (unless the caller chose) while no
OpenMP runtime has started, so ours and the peer's pools run under the same rule
(cachedarrays/threads.py says why).

Conventions: every ratio is ``speedup = peer time / our time`` (> 1: we are faster); a median
is of >= 3 samples and printed with its spread; each goal prints one line
``goal <name>: <value> (target >= <t>): met|not met``. When ``CA_BENCH_RESULTS`` names a file,
goals and headline figures are appended to it as JSON lines (``make bench`` collects them).
"""

import argparse
import errno
import json
import os
import platform
import stat
import statistics
import sys
import tempfile
import time


def _thread_env_ok(name, value):
    """Whether value is one the runtimes read: OMP_NUM_THREADS a comma-separated list of whole
    numbers >= 1 (one per nesting level), the other counts one whole number >= 1, and
    OMP_WAIT_POLICY ACTIVE or PASSIVE."""
    if name == "OMP_WAIT_POLICY":
        return value.strip().upper() in ("ACTIVE", "PASSIVE")
    if name == "GOMP_SPINCOUNT":   # libgomp: a count, with an optional k/M/G/T, or infinite
        v = value.strip().lower()
        return v in ("infinite", "infinity") or (
            v[:-1].strip().isdigit() if v[-1:] in ("k", "m", "g", "t") else v.isdigit())
    parts = value.split(",") if name == "OMP_NUM_THREADS" else [value]
    return all(x.strip().isdigit() and int(x) >= 1 for x in parts)


def check_environment(env=os.environ, warn=None):
    """Drop thread settings in env that a runtime would refuse or misread (numba does not import
    with NUMBA_NUM_THREADS=0), saying so on stderr; then OMP_WAIT_POLICY=PASSIVE unless set."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    for name in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS",
                 "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        value = env.get(name)
        if value is not None and not _thread_env_ok(name, value):
            del env[name]
            if value.strip():
                fix = {"OMP_WAIT_POLICY": "PASSIVE is used; set ACTIVE or PASSIVE",
                       "GOMP_SPINCOUNT": "libgomp's default is used; set a count such as 1000, "
                                         "10k or infinite"}.get(
                    name, "--threads sets the thread counts")
                warn(f"{SCRIPT}: ignoring {name}={value!r} (not a valid setting); {fix}")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


SCRIPT = os.path.splitext(os.path.basename(sys.argv[0]))[0] if sys.argv else "benchmark"
check_environment()


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


EXIT_STATUS = ("exit status: 0 when the run finished, whether its goals were met or not (read\n"
               "the 'goal ...: met|not met' lines); 1 when it failed; 2 for bad arguments;\n"
               "130 when interrupted (Ctrl-C), 143 when terminated (SIGTERM).")


def _once(parser, action):
    """parser.error when a flag that takes values was already given in this parse (the later
    value would silently win)."""
    if action.dest in parser.given:
        parser.error(f"{'/'.join(action.option_strings)} given twice; give it once")
    parser.given.add(action.dest)


class _Once(argparse._StoreAction):
    """store, refusing a second occurrence of the flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        _once(parser, self)
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose value-taking flags may each be given once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.given = set()

    def add_argument(self, *args, **kwargs):
        if args and args[0].startswith("-") and kwargs.get("action") in (None, "store"):
            kwargs["action"] = _Once
        return super().add_argument(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self.given = set()
        return super().parse_known_args(args, namespace)


def parser(doc, **kwargs):
    """An ArgumentParser whose description is the script's docstring, whose --help shows
    every default and choice, whose epilog ends with the exit statuses, and whose flags that
    take values may each be given once."""
    first, _, rest = (doc or "").strip().partition("\n")
    epilog = "\n\n".join(x for x in (rest.strip(), EXIT_STATUS) if x)
    return _Parser(description=first, epilog=epilog, formatter_class=_Formatter, **kwargs)


def whole(lo=1, hi=None):
    """An argparse type: a whole number from lo to hi (inclusive; no upper bound if None)."""
    def check(text):
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"need a whole number, got {text!r}") from None
        if n < lo or (hi is not None and n > hi):
            bound = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"need a whole number {bound}, got {n}")
        return n
    check.__name__ = "whole number"
    return check


def fraction(lo=0.0, hi=1.0):
    """An argparse type: a finite number from lo to hi (inclusive)."""
    def check(text):
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"need a number, got {text!r}") from None
        if not lo <= x <= hi:                      # false for NaN too
            raise argparse.ArgumentTypeError(f"need a number from {lo:g} to {hi:g}, got {text}")
        return x
    check.__name__ = "number"
    return check


def positive(text):
    """An argparse type: a finite number > 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"need a number, got {text!r}") from None
    if not 0 < x < float("inf"):                  # false for NaN too
        raise argparse.ArgumentTypeError(f"need a finite number > 0, got {text}")
    return x


positive.__name__ = "number"


def size(lo=0):
    """An argparse type: a byte count such as 4096, 64K or 1.5GiB, at least lo."""
    def check(text):
        from cachedarrays.sizes import parse_size
        try:
            n = parse_size(text.strip())
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"need a size >= {lo} bytes, got {text}")
        return n
    check.__name__ = "size"
    return check


def listed(item):
    """An argparse type: a comma-separated list of items read by the type ``item``, in order,
    each once; an empty list is refused."""
    def check(text):
        out = []
        for part in text.split(","):
            if not part.strip():
                raise argparse.ArgumentTypeError(f"empty item in {text!r}; separate items "
                                                 "with single commas")
            x = item(part.strip())
            if x not in out:
                out.append(x)
        return out
    check.__name__ = f"list of {getattr(item, '__name__', 'item')}"
    return check


class Unique(argparse.Action):
    """For nargs='+': the values in order, each once (a repeated item would run twice); the
    flag itself once."""

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(parser, _Parser):
            _once(parser, self)
        setattr(namespace, self.dest, list(dict.fromkeys(values)))


def one_of(choices):
    """An argparse type: one of choices (case as given, or any case when unambiguous)."""
    def check(text):
        if text in choices:
            return text
        folded = [c for c in choices if c.lower() == text.lower()]
        if len(folded) == 1:
            return folded[0]
        raise argparse.ArgumentTypeError(f"unknown {text!r}; choose from {', '.join(choices)}")
    check.__name__ = "choice"
    return check


def thread_count(text):
    """An argparse type: a thread count the library accepts (1 to threads.MAX_THREADS)."""
    from cachedarrays.threads import MAX_THREADS
    return whole(1, MAX_THREADS)(text)


thread_count.__name__ = "thread count"

#: The figure formats --plot writes (by the file's extension).
PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


def _existing_kind(path):
    """None when nothing is at path, else 'file', 'link', 'folder' or another kind's name."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    for test, kind in ((stat.S_ISREG, "file"), (stat.S_ISLNK, "link"), (stat.S_ISDIR, "folder"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "named pipe"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return kind
    return "special file"


def _check_folder(folder, path):
    """Refuse a folder that cannot be created or written (its nearest existing ancestor)."""
    probe = folder
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise argparse.ArgumentTypeError(f"{path}: {probe} is not a folder; choose a path "
                                         "under a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{path}: cannot write in {probe} (permission "
                                         "denied); choose a path in a writable folder")


def _needs_matplotlib(path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError(
            f"{path}: drawing needs matplotlib: pip install 'cachedarrays[plot]', or drop "
            "--plot") from None


def is_folder_target(path):
    """Whether a --plot that takes a folder names one: an existing folder, or a name without a
    figure extension."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return os.path.isdir(path) or ext not in PLOT_FORMATS


def figure_path(text, folder_ok=False):
    """An argparse type for --plot: a new or regular file named .png/.pdf/.svg/.jpg (or, if
    folder_ok, a folder), checked before the run so a bad path fails at once."""
    path = os.path.expanduser(text)
    if not path.strip():
        raise argparse.ArgumentTypeError("empty path; name a file such as fig.png")
    kind = _existing_kind(path)
    if kind == "folder" or (folder_ok and (os.path.isdir(path) or (
            kind is None and is_folder_target(path)))):
        if not folder_ok:
            raise argparse.ArgumentTypeError(f"{path} is a folder; name a file in it, such as "
                                             f"{os.path.join(path, 'figure.png')}")
        _check_folder(os.path.abspath(path), path)
        _needs_matplotlib(path)
        return path
    if kind not in (None, "file", "link"):
        raise argparse.ArgumentTypeError(f"{path} is a {kind}, not a file; name a regular "
                                         "file such as fig.png")
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(
            f"{path}: unsupported figure format {('.' + ext) if ext else '(no extension)'}; "
            f"end the name with one of {', '.join('.' + f for f in PLOT_FORMATS)}")
    _check_folder(os.path.dirname(os.path.abspath(path)), path)
    _needs_matplotlib(path)
    return path


figure_path.__name__ = "figure path"


def figure_or_folder(text):
    """figure_path that also takes a folder (existing, or a new name without an extension)."""
    return figure_path(text, folder_ok=True)


figure_or_folder.__name__ = "figure path or folder"


def available_memory():
    """Bytes of memory available to a new allocation (MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_shortfall(need, flags):
    """The usage error when a run needs more than the available memory (naming the flags to
    lower), or None when it fits or the available memory is unknown."""
    have = available_memory()
    if have is not None and need > have:
        from cachedarrays.sizes import format_size
        return (f"{flags}: the run needs about {format_size(need)} of memory and "
                f"{format_size(have)} is available; choose smaller values")
    return None


def check_memory(p, need, flags):
    """p.error when a run needs more than the available memory, naming the flags to lower."""
    message = memory_shortfall(need, flags)
    if message:
        p.error(message)


def check_peer(p, module="torch", extra="peer"):
    """p.error unless ``module`` imports in a fresh interpreter (the peer's), with the reason
    and the install command; checked before the run, in a child so this process stays as it
    was."""
    import subprocess
    try:
        r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                           text=True, timeout=300)
    except subprocess.TimeoutExpired:
        p.error(f"--peer {module}: importing {module} took over 300 s; check the installation")
    if r.returncode != 0:
        lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
        reason = lines[-1] if lines else f"exit {r.returncode}"
        p.error(f"--peer {module} needs {module}, which does not import here ({reason}); "
                f"install it with pip install 'cachedarrays[{extra}]', or drop --peer")


def data_file(text):
    """An argparse type: a file to read or write (an existing regular file, or a new name in a
    folder that exists or can be made)."""
    path = os.path.expanduser(text)
    if not path.strip():
        raise argparse.ArgumentTypeError("empty path; name a file")
    kind = _existing_kind(path)
    if kind not in (None, "file", "link"):
        raise argparse.ArgumentTypeError(f"{path} is a {kind}, not a file; name a regular file")
    _check_folder(os.path.dirname(os.path.abspath(path)), path)
    return path


data_file.__name__ = "file"


def out_folder(text):
    """An argparse type: a folder to write results in (existing, or one that can be made)."""
    path = os.path.expanduser(text)
    if not path.strip():
        raise argparse.ArgumentTypeError("empty path; name a folder such as bench_results")
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} exists and is not a folder; name a folder "
                                         "(it is made if missing)")
    _check_folder(os.path.abspath(path), path)
    return path


out_folder.__name__ = "folder"


def _write_through_temp(path, write, binary=False):
    """Call write(file) on a temporary file beside path, then rename it over path: a reader
    never sees half a file, an interrupted write leaves none, and a symbolic link at path is
    replaced rather than written through."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.splitext(path)[1])
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)             # as open() would have made it
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_atomically(path, text):
    """Write text to path through a temporary file renamed over it."""
    _write_through_temp(path, lambda f: f.write(text))


def slow_path(text):
    """An argparse type for --slow-path: a path the slow device accepts (a folder, a new file
    name or a devdax device), checked by opening a small device there and closing it."""
    from cachedarrays.devices import SlowDevice
    from cachedarrays.errors import DeviceError
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path; name a folder or a new file for the slow "
                                         "device, or leave --slow-path out for a temporary file")
    try:
        SlowDevice(1 << 16, os.path.expanduser(text), name="slow-path check").close()
    except (DeviceError, OSError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


slow_path.__name__ = "slow device path"


def add_standard(p, threads=None, plot=True, progress=True, with_threads=True):
    """--threads N, --plot PATH and --no-progress, the flags every script has."""
    if with_threads:
        p.add_argument("--threads", type=thread_count, default=threads or os.cpu_count() or 1,
                       help="threads for ours and the peer alike (BLAS, OpenMP, numba, PyTorch)")
    if plot:
        p.add_argument("--plot", metavar="PATH", default=None, type=figure_path,
                       help="write a figure to PATH (" + ", ".join(PLOT_FORMATS) + ")")
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
            f"{wait_settings()}, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


def wait_settings():
    """``OMP_WAIT_POLICY=...`` and, when set, ``GOMP_SPINCOUNT=...``: how idle OpenMP threads
    wait, for ours and the peer alike (both runtimes read them when they start)."""
    spin = os.environ.get("GOMP_SPINCOUNT")
    return (f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
            + (f", GOMP_SPINCOUNT={spin}" if spin is not None else ""))


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
    its own. Alternating does not remove that with more than two implementations (among
    five, torch's lookup always followed one of ours), so where calls are short the scripts
    also run an untimed call of the same implementation right before each timed one
    (``embedding.bench``)."""
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
    try:
        with open(path, "a") as f:
            f.write(json.dumps(fields, default=float) + "\n")
    except OSError as e:             # the run's figures still print; say once, then stop trying
        os.environ.pop("CA_BENCH_RESULTS", None)
        print(f"{SCRIPT}: cannot append to CA_BENCH_RESULTS={path} ({e.strerror or e}); the "
              "figures are printed only; point it at a writable file", file=sys.stderr,
              flush=True)


def goal(name, value, target, *, higher=True, unit="x", detail="", counts=True):
    """Print 'goal <name>: <value> (target >= <target>): met|not met' and record it.
    counts=False: the value is shown but cannot meet the goal (a condition of the goal failed;
    say which in detail)."""
    met = counts and (value >= target if higher else value <= target)
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


def save_plot(fig, path, dpi=110, tight=True, announce=True):
    """Write a matplotlib figure to path (folders created) and, if announce, say where.

    The figure goes to a temporary file renamed over path, so an interrupted write leaves no
    half file, and a symbolic link at path is replaced rather than written through."""
    figure_path(path)                       # the checks of --plot, for paths made from it
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    replaced = os.path.lexists(path)
    _write_through_temp(path, lambda f: fig.savefig(
        f, format=ext, dpi=dpi, bbox_inches="tight" if tight else None), binary=True)
    if announce:
        print(f"figure: {path}{' (replaced the previous file)' if replaced else ''}")


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every ``with`` block cleans up."""


def _terminate(signum, frame):
    raise Terminated


def run(main, argv=None):
    """main(argv)'s exit status (0 unless it returns an int), with Ctrl-C a one-line message
    and status 130 (SIGTERM: 143, after the same clean-up), a closed output pipe (``| head``)
    a quiet exit, and a failure to write a file one line naming it."""
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        rc = main(argv) if argv is not None else main()
        return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0
    except KeyboardInterrupt:
        print(f"\n{SCRIPT}: interrupted", file=sys.stderr, flush=True)
        return 130
    except Terminated:
        print(f"\n{SCRIPT}: terminated", file=sys.stderr, flush=True)
        return 143
    except argparse.ArgumentTypeError as e:          # a figure path made from --plot
        print(f"{SCRIPT}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no flush error at exit
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT, errno.EPERM,
                           errno.EISDIR, errno.ENOTDIR, errno.ENOENT):
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"{SCRIPT}: error: {where}{e.strerror or e}", file=sys.stderr, flush=True)
        return 1
