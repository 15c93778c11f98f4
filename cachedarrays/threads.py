"""Thread settings of the pools the library runs on: OpenMP (oneDNN, numba), BLAS and PyTorch.

One rule, set once: OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``). A process
here often holds two OpenMP runtimes (the system libgomp under oneDNN and numba, and the copy
bundled with PyTorch); with OpenMP's default active wait, the idle runtime's threads spin on
the cores the busy one needs, which on a two-core machine under load made a VGG-16 step 8x
slower. The variable is read once, when a runtime starts, so importing cachedarrays sets it
unless the user already chose a value; a runtime loaded before that import keeps its own.

The price is a wake-up per parallel region (tens of microseconds on a virtual machine), which
libgomp's ``GOMP_SPINCOUNT`` (a spin before the passive wait, read when the runtime starts)
trades against cores burnt while idle: faster on a quiet machine, slower on a loaded one
(the README's "Threads" section gives the figures). The library leaves it to the user and
reports it with the other settings.

Thread counts go through threadpoolctl (BLAS and OpenMP pools), numba and PyTorch's own calls.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY = "PASSIVE"


def prefer_passive_wait() -> str:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user set it; return the value in force."""
    return os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)


def numba_follows_openmp() -> None:
    """Size numba's pool by ``OMP_NUM_THREADS`` (its first level) when only that is set and
    numba is not loaded yet: numba's OpenMP pool, when it starts, sets the OpenMP thread count
    to its own size (every core by default), which overrode the user's ``OMP_NUM_THREADS`` for
    oneDNN after the first numba kernel."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and int(first) >= 1 and "NUMBA_NUM_THREADS" not in os.environ \
            and "numba" not in sys.modules:
        os.environ["NUMBA_NUM_THREADS"] = str(int(first))


#: The most threads a pool may be given: an OpenMP runtime started with far more threads than
#: it can create aborts the process.
MAX_THREADS = 1024


def _count(threads) -> int:
    """threads as an int in [1, MAX_THREADS]; TypeError or ValueError naming it otherwise."""
    if isinstance(threads, bool) or not hasattr(type(threads), "__index__"):
        raise TypeError(f"threads.limit: threads must be a whole number such as 2, not "
                        f"{type(threads).__name__} {threads!r}")
    n = int(threads)
    if not 1 <= n <= MAX_THREADS:
        raise ValueError(f"threads.limit: need threads >= 1 and at most {MAX_THREADS}, got {n} "
                         f"(this machine has {os.cpu_count()} cores)")
    return n


# ---- forked children and kernels on the calling thread -------------------------------------

#: True in a process forked after its parent started the system OpenMP runtime's thread pool
#: (numba's OpenMP threading layer launched, or a oneDNN primitive ran on several threads).
#: GNU OpenMP cannot start a parallel region there: numba terminates the process ("fork()
#: called from a process already using GNU OpenMP") and oneDNN's primitive never returns. The
#: library's kernels then run on the calling thread (serial twins, one OpenMP thread).
FORKED_AFTER_POOL = False
_POOL = [False]         # a oneDNN primitive ran on several threads in this process


def pool_started() -> None:
    """Note that the system OpenMP runtime's pool may be running (oneDNN's backend calls it
    when a primitive runs on more than one thread)."""
    _POOL[0] = True


def _openmp_pool_started() -> bool:
    if _POOL[0]:
        return True
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if parallel is None or not getattr(parallel, "_is_initialized", False):
        return False
    try:
        return sys.modules["numba"].threading_layer() == "omp"
    except Exception:       # the layer unknown: assume the unsafe one
        return True


def _after_fork_in_child() -> None:
    global FORKED_AFTER_POOL
    if not FORKED_AFTER_POOL and _openmp_pool_started():
        FORKED_AFTER_POOL = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def serial_twin(kernel, name):
    """A numba ``parallel=True`` kernel's twin without ``parallel`` (its ``prange`` loops run
    on the calling thread), compiled on first use as ``name`` with the kernel's other options:
    the same computation in the same order. The library runs twins where a parallel region
    would cost more than it saves (waking a sleeping pool for little work) or cannot run (in
    ``FORKED_AFTER_POOL`` children).

    numba names a cached kernel's files after its function's qualified name and first line.
    A twin made from the same function object would share the parallel kernel's cache
    entries, and whichever of the two compiled first would then serve both: the parallel
    kernel loaded the serial code and ran on one thread.  A copy of the function under its
    own name gets its own files."""
    import types

    from numba import njit
    f = kernel.py_func
    twin = types.FunctionType(f.__code__.replace(co_name=name, co_qualname=name), f.__globals__,
                              name, f.__defaults__, f.__closure__)
    twin.__qualname__ = name
    twin.__module__ = f.__module__
    twin.__doc__ = f.__doc__
    options = {k: v for k, v in kernel.targetoptions.items()
               if k in ("nogil", "fastmath", "boundscheck", "error_model")}
    return njit(cache=type(kernel._cache).__name__ != "NullCache", **options)(twin)


def limit(threads: int) -> dict:
    """Run every pool in this process (BLAS, OpenMP, numba, PyTorch if loaded) on `threads`
    threads; return :func:`settings`. The limit stays until changed. numba's count is the
    calling thread's own (``numba.set_num_threads``): call ``limit`` in each thread that runs
    numba kernels, or set ``NUMBA_NUM_THREADS`` before numba is imported.

    threads: an int from 1 to MAX_THREADS; anything else is refused before any pool changes."""
    n = _count(threads)
    from threadpoolctl import threadpool_limits
    # numba first: the first use of its OpenMP pool sets the OpenMP thread count to the pool's
    # size, which would undo a limit set before it (oneDNN then ran on every core).
    import numba
    was = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        threadpool_limits(limits=n)
    except BaseException:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before
        numba.set_num_threads(was)
        raise
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
    return settings()


def settings() -> dict:
    """The thread settings in force: environment, every threadpoolctl pool, numba and PyTorch."""
    out = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "unset"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
           "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "unset"), "pools": []}
    try:
        from threadpoolctl import threadpool_info
        for info in threadpool_info():
            out["pools"].append((info["user_api"], info["internal_api"],
                                 os.path.basename(info["filepath"]), info["num_threads"]))
    except ImportError:  # pragma: no cover - a listed dependency
        pass
    numba = sys.modules.get("numba")
    if numba is not None:
        out["numba"] = numba.get_num_threads()
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.get_num_threads()
    return out


def describe(s: dict | None = None) -> str:
    """One line naming the thread settings (for benchmark reports)."""
    s = settings() if s is None else s
    pools = ", ".join(f"{lib} {n}" for _, _, lib, n in s["pools"])
    extra = "".join(f", {k} {s[k]}" for k in ("numba", "torch") if k in s)
    return (f"{wait_settings(s)}, OMP_NUM_THREADS={s['OMP_NUM_THREADS']}; "
            f"threads per pool: {pools or 'none loaded'}{extra}")


def wait_settings(s: dict | None = None) -> str:
    """How idle OpenMP threads wait: ``OMP_WAIT_POLICY`` and, when set, ``GOMP_SPINCOUNT``
    (libgomp's spin before a passive wait; see the module's docstring)."""
    s = settings() if s is None else s
    spin = s.get("GOMP_SPINCOUNT", "unset")
    return (f"OMP_WAIT_POLICY={s['OMP_WAIT_POLICY']}"
            + (f", GOMP_SPINCOUNT={spin}" if spin != "unset" else ""))
