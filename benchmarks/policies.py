"""Comparing placement policies on recorded traces (dissertation Fig. 4.10).

    .venv/bin/python benchmarks/policies.py [--models resnet50,vgg16,densenet121,dlrm,vgg11,resnet18]
        [--budgets 10,20,25,50,100] [--profile optane] [--traces DIR] [--record] [--plot out.png]

The compared policies: LRU and its presets CA:0/L/LM/LMP, FirstTouch, memory mode, and the
planning policies Sentinel, DeepTM (greedy; its DQN too on the small graphs VGG-11 and
ResNet-18) and AutoTM's integer program. Besides the table, each model gets: bytes migrated per
step at 20% (Sentinel's Table IV), AutoTM's program size, bound and gap per budget, Sentinel's
characterization and MIL sweep (Fig. 5), the smallest budget reaching 90% and 98% of fast-only
speed (DeepTM's Fig. 17) and DeepTM's beta curve (Fig. 16), and the targets (LM, LMP, the floor;
Sentinel at 20% <= 1.09x, the best policy at 25% <= 1.05x, every planning policy ahead of LRU
and memory mode at 20%).

Each model is run once for ``--steps`` training steps with everything in fast memory and recorded
(``ca.trace``); its kernel times become the median over the steps after the first
(``Trace.median_times``) and the trace is saved to ``--traces DIR`` (default:
``benchmarks/.traces``). Later runs load the saved traces instead of recording again (unless
``--record``, or the settings changed), so a second run prints bit-identical numbers. Then every policy is replayed on the trace
(``ca.replay``: the same manager and heaps, on virtual devices) with fast memory = 10, 20, 25, 50
and 100% of the trace's footprint, and the cost model gives each replay's modelled time, a pure
function of (trace, decisions, device profile). Per model the table lists, for the last
(steady-state) step: modelled time / fast-only time, stall, bytes kernels read and wrote in slow
memory, bytes moved between tiers, peak fast occupancy; then the floor (footprint - budget: at the
peak, at least that many live bytes are outside fast memory, so each step writes them to slow
memory at least once) with LM's slow-memory writes (kernels + evictions) over it, and three
targets, each a line 'goal ...: met|not met'. Memory mode (2LM) keeps every array in slow memory behind a simulated
direct-mapped DRAM cache of the budget's size and uses the ``<profile>-2lm`` device profile
(optane-2lm: the bandwidth Optane reaches in memory mode) when there is one.

The recording policy places everything in fast memory but declares every annotation capability,
so the trace holds every annotation the models make (prefetch, softevict). Each policy replays
the program *it* would have run: annotations the models skip for it are dropped (CA:0/L/LM make
no prefetch calls and no weight soft-evictions) and, for presets without the cleanup switch
(CA:0, CA:L), frees move to the end of their step (nothing is freed before it, as
``train_step`` documents for that case). Lines starting with ``[wall]`` are wall-clock
measurements of this machine (recording and replay speed); every other number is modelled.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time

# This folder holds a script named copy.py, which would shadow the standard library's `copy`
# (numba imports it) when the folder is sys.path[0]; so import from here by file path only.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import cachedarrays as ca  # noqa: E402
from cachedarrays import costmodel  # noqa: E402
from cachedarrays.policies import FastOnly  # noqa: E402
from cachedarrays.registry import resolve  # noqa: E402


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_policies_bench{name}",
                                                  os.path.join(_HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_common = _load("_common")

BUDGETS = (10, 20, 25, 50, 100)
# (label, registered policy name, policy options)
POLICIES = (
    ("LRU", "lru", None),
    ("CA:0", "lru", {"preset": "CA:0"}),
    ("CA:L", "lru", {"preset": "CA:L"}),
    ("CA:LM", "lru", {"preset": "CA:LM"}),
    ("CA:LMP", "lru", {"preset": "CA:LMP"}),
    ("FirstTouch", "firsttouch", None),
    ("MemoryMode", "memorymode", None),
    ("Sentinel", "sentinel", None),
    ("DeepTM", "deeptm", {"mode": "greedy"}),
    ("AutoTM", "autotm", None),
)
# DeepTM's DQN trains only on small graphs (its paper: AlexNet/VGG-sized); the models it runs on.
DQN = ("DeepTM-DQN", "deeptm", {"mode": "dqn"})
DQN_MODELS = ("vgg11", "resnet18")
SEED_POLICIES = ("Sentinel", "DeepTM", "DeepTM-DQN", "AutoTM")
# The compared models (batch 16, 64 px) and a DLRM step; "tinycnn" is for tests and smoke runs.
MODELS = {
    "resnet50": dict(kind="cnn", model="resnet", depth=50, batch=16, image=64, width=1, classes=10,
                     lr=1e-3),
    "vgg16": dict(kind="cnn", model="vgg", depth=16, batch=16, image=64, width=1, classes=10,
                  lr=1e-3),
    "densenet121": dict(kind="cnn", model="densenet", depth=121, batch=16, image=64, width=1,
                        classes=10, lr=1e-3),
    "dlrm": dict(kind="dlrm", config="small", scale=0.02, width_scale=1.0, batch_size=2048,
                 distribution="zipf"),
    # DeepTM's DQN trains on small graphs (its paper: AlexNet/VGG-sized)
    "vgg11": dict(kind="cnn", model="vgg", depth=11, batch=16, image=64, width=1, classes=10,
                  lr=1e-3),
    "resnet18": dict(kind="cnn", model="resnet", depth=18, batch=16, image=64, width=1,
                     classes=10, lr=1e-3),
    "tinycnn": dict(kind="cnn", model="resnet", depth=18, batch=2, image=16, width=8, classes=10,
                    lr=1e-3),
}
# The same CNNs at a second batch size: with the batch-16 traces, a batch family
# (``family``: the model at any batch, sizes and kernel times linear in the batch).
FAMILIES = {name: (name, f"{name}@8") for name in ("resnet50", "vgg16", "densenet121")}
for _name, _second in FAMILIES.values():
    MODELS[_second] = dict(MODELS[_name], batch=8)
DEFAULT_MODELS = ("resnet50", "vgg16", "densenet121", "dlrm", "vgg11", "resnet18")
DEFAULT_TRACES = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".traces")
# (lr 1e-3: VGG-16 without batch norm diverges to NaN within 4 steps of one batch at 1e-2, and
# kernels on NaN or denormal data do not time like a real run's.)
# The policy targets
TARGET_LM_25 = 1.08          # LM at 25%: modelled time <= 1.08x fast-only
TARGET_FLOOR = 1.1           # LM's slow-memory writes <= 1.1x (footprint - budget)


def _size(n):
    return ca.format_size(int(n))


# ---- recording --------------------------------------------------------------------------------

class _Recording(FastOnly):
    """FastOnly (everything in fast memory, nothing moves) that declares every annotation
    capability, so the models make every annotation call and the trace records all of them."""

    name = "fastonly-recording"
    honours_prefetch = True
    honours_softevict = True
    tracks_reads = True


def _onednn():
    from cachedarrays.models.backend import get_backend
    try:
        return get_backend("onednn")
    except Exception:                       # noqa: BLE001 - any failure: not available
        return None


def threads_line():
    """The thread settings the recording runs with."""
    parts = [f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"]
    try:
        import numba
        parts.append(f"numba {numba.get_num_threads()}")
    except Exception:                       # noqa: BLE001 - informational only
        pass
    be = _onednn()
    parts.append(f"oneDNN {be.get_threads()}" if be is not None else "oneDNN unavailable")
    return "threads: " + ", ".join(parts)


def set_threads(n):
    """oneDNN's thread count (numpy/OpenBLAS and numba keep theirs)."""
    be = _onednn()
    if be is not None and n:
        be.set_threads(n)


# What the backend probe of each model kind runs: a quarter-size ResNet-50 step (the CNNs'
# kernels) and a step of the benchmark's DLRM.
_PROBES = {
    "cnn": dict(kind="cnn", model="resnet", depth=50, batch=16, image=32, width=1, classes=10,
                lr=1e-3),
    "dlrm": None,                           # the model itself (a step takes well under a second)
}


def pick_backend(choice="auto", spec=None, log=print, repeats=3):
    """The backend to record ``spec`` with: the one given, or with "auto" the faster of numpy and
    onednn (onednn only if it loads) on a step of the model kind's probe: one warm-up step each,
    then ``repeats`` steps each, alternating, best of each (load on the machine hits both)."""
    if choice != "auto":
        if choice == "onednn" and _onednn() is None:
            log("backend: onednn unavailable; using numpy")
            return "numpy"
        return choice
    if _onednn() is None:
        log("backend: onednn unavailable; using numpy")
        return "numpy"
    kind = spec["kind"] if spec else "cnn"
    probe = _PROBES.get(kind) or spec
    backends = ("numpy", "onednn")
    runs = []
    try:
        for b in backends:
            runs.append(_stepper(probe, b))
        best = [math.inf] * len(backends)
        for _ in range(repeats):
            for i, (_, step) in enumerate(runs):
                t = time.perf_counter()
                step()
                best[i] = min(best[i], time.perf_counter() - t)
    finally:
        for m, _ in runs:
            m.close()
    pick = backends[best.index(min(best))]
    what = ("quarter-size ResNet-50 step" if kind == "cnn" else f"{kind} step")
    log(f"[wall] backend probe for {kind} ({what}, best of {repeats}): "
        + ", ".join(f"{b} {t * 1e3:.0f} ms" for b, t in zip(backends, best)) + f" -> {pick}")
    return pick


def _stepper(spec, backend):
    """(manager, step()) running training steps of spec on a fast-only manager (one step run)."""
    if spec["kind"] == "cnn":
        from cachedarrays.models import cnn
        from cachedarrays.models.cnn.core import Session
        model = cnn.build(spec["model"], spec["depth"], batch=spec["batch"], image=spec["image"],
                          classes=spec["classes"], width=spec["width"])
        m = ca.Manager(fast=int(model.footprint_estimate() * 1.5) + (64 << 20), slow=1 << 20,
                       policy="fastonly")
        try:
            s = Session(m, backend)
            model.init(s)
            x, y = cnn.synthetic_batch(model)
            opt = cnn.SGD(spec.get("lr", 1e-3))

            def step():
                cnn.train_step(s, model, x, y, opt)
            step()
        except BaseException:
            m.close()
            raise
        return m, step
    from cachedarrays.models.dlrm import DLRM, get_config, synthetic_dataset
    cfg = get_config(spec["config"], scale=spec["scale"], width_scale=spec["width_scale"],
                     batch_size=spec["batch_size"])
    m = ca.Manager(fast=2 * cfg.table_bytes + (512 << 20), slow=1 << 20, policy="fastonly")
    try:
        model = DLRM(cfg, manager=m, table_kind="fast", backend=backend, seed=1)
        batch = next(iter(synthetic_dataset(cfg, spec["distribution"], seed=0, num_batches=1)))

        def step():
            model.train_step(batch)
        step()
    except BaseException:
        m.close()
        raise
    return m, step


def _steps(m, t, step):
    """Run step() and mark the end of the step unless the program marked it itself."""
    n = t.steps
    step()
    if t.steps == n:
        ca.mark_step(m)


def record(spec, backend="numpy", steps=4, log=None):
    """Record ``steps`` training steps of the model ``spec`` on a fast-only manager; returns the
    trace with kernel times = medians over the steps after the first (``median_times``)."""
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    if spec["kind"] == "cnn":
        t = _record_cnn(spec, backend, steps)
    elif spec["kind"] == "dlrm":
        t = _record_dlrm(spec, backend, steps)
    else:
        raise ValueError(f"unknown model kind {spec['kind']!r}")
    t = t.median_times(skip=1)
    be = _onednn() if backend == "onednn" else None
    t.meta.update(spec=dict(spec), backend=backend, recorded_steps=steps,
                  threads=be.get_threads() if be is not None else None)
    if log is not None:
        log(f"[wall] recorded {steps} steps in {time.perf_counter() - t0:.1f} s (load average "
            f"{load0:.2f} before, {os.getloadavg()[0]:.2f} after: kernel times, and so every "
            "ratio, depend on the machine's load while recording)")
    return t


def _record_cnn(spec, backend, steps):
    from cachedarrays.models import cnn
    from cachedarrays.models.cnn.core import Session
    model = cnn.build(spec["model"], spec["depth"], batch=spec["batch"], image=spec["image"],
                      classes=spec["classes"], width=spec["width"])
    fast = int(model.footprint_estimate() * 1.5) + (64 << 20)
    with ca.Manager(fast=fast, slow=1 << 20, policy=_Recording()) as m:
        s = Session(m, backend)
        model.init(s)                       # before tracing: the weights are the trace's inputs
        x, y = cnn.synthetic_batch(model)
        opt = cnn.SGD(spec.get("lr", 1e-3))
        with ca.trace(m) as t:
            for _ in range(steps):
                _steps(m, t, lambda: cnn.train_step(s, model, x, y, opt))
    return t


def _record_dlrm(spec, backend, steps):
    from cachedarrays.models.dlrm import DLRM, get_config, synthetic_dataset
    cfg = get_config(spec["config"], scale=spec["scale"], width_scale=spec["width_scale"],
                     batch_size=spec["batch_size"])
    fast = 2 * cfg.table_bytes + (512 << 20)
    with ca.Manager(fast=fast, slow=1 << 20, policy=_Recording()) as m:
        # Tables of kind "fast" are plain arrays (SimpleTable); made before tracing, they are
        # inputs of the trace with no placement hint, so each policy places them.
        model = DLRM(cfg, manager=m, table_kind="fast", backend=backend, seed=1)
        data = list(synthetic_dataset(cfg, spec["distribution"], seed=0, num_batches=steps))
        with ca.trace(m) as t:
            for b in data:
                _steps(m, t, lambda b=b: model.train_step(b))
    return t


def _trace_path(folder, name):
    return os.path.join(folder, f"{name}.trace.gz")


def load_or_record(name, spec, folder, reuse, backend, steps, log=print):
    """The trace of model ``name``: loaded from ``folder`` when ``reuse`` and it was recorded
    with the same model settings, else recorded (backend picked lazily) and saved there."""
    path = _trace_path(folder, name)
    if reuse and os.path.exists(path):
        from cachedarrays.trace import TraceError
        try:
            t = ca.Trace.load(path)
        except TraceError as e:
            log(f"{name}: {path} is unreadable ({e}); recording again")
        else:
            if t.meta.get("spec") == dict(spec) and t.meta.get("recorded_steps") == steps:
                log(f"{name}: trace {path} (reused; recorded with the {t.meta.get('backend')} "
                    "backend)")
                return t
            log(f"{name}: {path} was recorded with other settings; recording again")
    b = backend(spec) if callable(backend) else backend
    log(f"{name}: recording {steps} steps ({b} backend) ...")
    t = record(spec, b, steps, log=log)
    t.save(path)
    log(f"{name}: trace saved to {path}")
    return t


def family(name, folder=DEFAULT_TRACES, log=print, *, backend="onednn", steps=4, reuse=True):
    """The batch family of a CNN in ``FAMILIES`` (``cachedarrays.batching.BatchFamily``): its
    traces at two batch sizes, loaded from ``folder`` or recorded there. The second trace is
    recorded with the backend and thread count the first one was recorded with, so that their
    kernel times compare."""
    from cachedarrays.batching import BatchFamily
    from cachedarrays.trace import TraceError
    if name not in FAMILIES:
        raise ValueError(f"no batch family {name!r}; choose from {', '.join(FAMILIES)}")
    os.makedirs(folder, exist_ok=True)
    first, second = FAMILIES[name]
    ta = load_or_record(first, MODELS[first], folder, reuse,
                        lambda spec: pick_backend(backend, spec, log=log), steps, log=log)
    threads = ta.meta.get("threads")
    if threads:
        set_threads(threads)
    tb = load_or_record(second, MODELS[second], folder, reuse,
                        ta.meta.get("backend") or backend, steps, log=log)
    try:
        return BatchFamily(ta, MODELS[first]["batch"], tb, MODELS[second]["batch"])
    except TraceError as e:
        if not reuse:
            raise
        log(f"{name}: the saved traces are not the same program ({e}); recording both again")
    return family(name, folder, log, backend=backend, steps=steps, reuse=False)


# ---- what each policy's program looks like -----------------------------------------------------

def program_switches(policy, options=None):
    """(prefetches, softevicts, weight softevicts, cleanup): the annotation calls the models make
    under this policy (``models/cnn/core.py``'s rules) and whether its cleanup switch is on."""
    p = resolve(policy)(**(options or {}))
    prefetches = bool(getattr(p, "allows_prefetch", True) and (
        getattr(p, "honours_prefetch", True) or getattr(p, "tracks_reads", True)))
    softevicts = bool(getattr(p, "honours_softevict", True))
    cleanup = bool(getattr(p, "allows_cleanup", True))
    return prefetches, softevicts, prefetches and softevicts, cleanup


def program_view(trace, switches):
    """The trace as the program would have run under a policy with these switches.

    Prefetch events are dropped without the prefetch switch; softevict events without
    softevicts, and a softevict of an array the last kernel did not read (the weight a
    ``sgd_update`` wrote) without weight softevicts; without cleanup, frees wait for the end of
    their step (just before its ``defrag`` or step mark). Returns ``trace`` itself when nothing
    changes.
    """
    prefetches, softevicts, weights, cleanup = switches
    if prefetches and softevicts and weights and cleanup:
        return trace
    kernels = trace.kernels
    out, pending, last_reads = [], [], ()
    for e in trace.events:
        kind = e[0]
        if kind == "end":
            last_reads = kernels[e[1]][1]
        elif kind == "prefetch" and not prefetches:
            continue
        elif kind == "softevict":
            if not softevicts or (not weights and e[1] not in last_reads):
                continue
        elif kind == "free" and not cleanup:
            pending.append(e)
            continue
        elif kind in ("defrag", "step") and pending:
            out += pending
            pending = []
        out.append(e)
    out += pending
    t = trace.copy()
    t.events = out
    t.meta = dict(trace.meta, view=dict(zip(("prefetches", "softevicts", "weight_softevicts",
                                             "cleanup"), switches)))
    return t


def policies_for(model):
    """The compared policies of a model: POLICIES, plus DeepTM's DQN on the small graphs."""
    return POLICIES + ((DQN,) if model in DQN_MODELS else ())


# ---- the sweep --------------------------------------------------------------------------------

def _cache_profile(profile):
    name = f"{profile}-2lm"
    return name if name in costmodel.PROFILES else profile


def slow_writes(step):
    """Bytes written to memory below the fast tier in a step: kernel writes plus copies into it."""
    fast = step.devices[0] if step.devices else "fast"
    return step.slow_write + sum(n for k, n in step.moved.items() if k.split("->")[1] != fast)


def last_step_peak(decisions, device):
    """Peak bytes allocated on ``device`` during the last step of a decision log.

    Regions are matched by (object, device), not by offset: ``Manager.defrag`` slides regions
    without reporting the move, so the cost model's own peak (which matches frees by offset)
    overcounts after a defragmentation; an object has at most one region per device.
    """
    live, used, peak, last, ran = {}, 0, 0, None, False
    for d in decisions:
        kind = d[0]
        if kind == "alloc" and d[2] == device:
            used += d[4] - live.get(d[1], 0)
            live[d[1]] = d[4]
            peak = max(peak, used)
        elif kind == "free" and d[2] == device:
            used -= live.pop(d[1], 0)
        elif kind == "kernel":
            ran = True
        elif kind == "step":
            last, peak, ran = peak, used, False
    return peak if ran or last is None else last


def sweep(trace, policies=POLICIES, budgets=BUDGETS, profile="optane"):
    """Replay every policy at every budget (percent of ``trace.footprint()``); returns rows.

    Each row: label, pct, budget (bytes), and from the last step ratio (modelled time /
    fast-only), time, fast_only, stall, slow_read, slow_write (kernels), slow_writes (kernels +
    copies into slow memory), moved, peak_fast, copies; or oom=True with the error. ``seconds``
    is the replay's wall time (the only number that is not modelled).
    """
    foot = trace.footprint()
    views = {}
    rows = []
    for label, name, options in policies:
        sw = program_switches(name, options)
        if sw not in views:
            views[sw] = program_view(trace, sw)
        view = views[sw]
        prof = _cache_profile(profile) if name in ("memorymode", "2lm") else profile
        for pct in budgets:
            budget = max(int(foot * pct / 100), 1 << 16)
            row = dict(label=label, policy=name, options=options, pct=pct, budget=budget,
                       profile=prof, steps=trace.steps, oom=False)
            t = time.perf_counter()
            policy = resolve(name)(**(options or {}))
            try:
                run = ca.replay(view, policy, fast=budget, profile=prof)
            except ca.OutOfMemoryError as e:
                row.update(oom=True, error=str(e).split(";")[0], seconds=time.perf_counter() - t)
                rows.append(row)
                continue
            row["seconds"] = time.perf_counter() - t
            last = run.last
            row.update(ratio=run.ratio, time=last.time, fast_only=run.fast_only, stall=last.stall,
                       slow_read=last.slow_read, slow_write=last.slow_write,
                       slow_writes=slow_writes(last), moved=last.bytes_moved,
                       peak_fast=last_step_peak(run.decisions, run.devices[0]),
                       copies=sum(last.copies.values()),
                       cache_records=sum(1 for d in run.decisions if d[0] == "cache"))
            if name in ("memorymode", "2lm"):
                row["peak_fast"] = min(run.info.get("fast", budget), foot)
            if getattr(policy, "info", None):       # what a planning policy found
                row["info"] = dict(policy.info)
            rows.append(row)
    return rows


def _modelled(v):
    if isinstance(v, dict):
        return {k: _modelled(x) for k, x in v.items()
                if not (isinstance(k, str) and "seconds" in k)}
    return v


def numbers(rows):
    """The modelled content of rows (everything but wall-clock seconds), for comparisons."""
    return [_modelled(r) for r in rows]


# ---- reporting --------------------------------------------------------------------------------

def _find(rows, label, pct):
    return next((r for r in rows if r["label"] == label and r["pct"] == pct), None)


def table_lines(rows):
    head = (f"{'policy':<11} {'budget':>14} {'time/FO':>8} {'stall':>9} {'k slow rd':>11} "
            f"{'k slow wr':>11} {'moved':>11} {'peak fast':>11}")
    out = [head]
    prev = None
    for r in rows:
        if prev is not None and r["label"] != prev:
            out.append("")
        prev = r["label"]
        budget = f"{r['pct']:>3}% {_size(r['budget']):>9}"
        if r["oom"]:
            out.append(f"{r['label']:<11} {budget:>14} {'OOM':>8}   ({r['error']})")
            continue
        star = "*" if r["policy"] in ("memorymode", "2lm") else " "
        out.append(f"{r['label']:<11} {budget:>14} {r['ratio']:>7.4f}x {r['stall'] * 1e3:>7.2f}ms "
                   f"{_size(r['slow_read']):>11} {_size(r['slow_write']):>11} "
                   f"{_size(r['moved']):>11} {_size(r['peak_fast']):>10}{star}")
    return out


def floor_lines(rows, footprint, lm="CA:LM"):
    out = [f"floor = footprint - budget (bytes some live array must spend outside fast memory, "
           f"written there at least once a step); {lm} slow writes = kernel writes + evictions:",
           f"  {'budget':>5} {'floor':>11} {lm + ' slow wr':>14} {'/ floor':>8}"]
    for r in rows:
        if r["label"] != lm:
            continue
        floor = max(0, footprint - r["budget"])
        if r["oom"]:
            out.append(f"  {r['pct']:>4}% {_size(floor):>11} {'OOM':>14}")
            continue
        ratio = f"{r['slow_writes'] / floor:.3f}x" if floor else "-"
        out.append(f"  {r['pct']:>4}% {_size(floor):>11} {_size(r['slow_writes']):>14} {ratio:>8}")
    return out


def targets(rows, footprint):
    """[(name, passed or None when not measurable, detail)] of the three policy targets."""
    out = []
    lm25 = _find(rows, "CA:LM", 25)
    if lm25 is None:
        out.append(("LM at 25% <= 1.08x fast-only", None, "no CA:LM row at 25%"))
    elif lm25["oom"]:
        out.append(("LM at 25% <= 1.08x fast-only", False, "CA:LM ran out of memory at 25%"))
    else:
        out.append(("LM at 25% <= 1.08x fast-only", lm25["ratio"] <= TARGET_LM_25,
                    f"{lm25['ratio']:.4f}x"))
    pairs, ok = [], True
    for r in rows:
        if r["label"] != "CA:LMP":
            continue
        lm = _find(rows, "CA:LM", r["pct"])
        if lm is None:
            continue
        if r["oom"] or lm["oom"]:
            good = not r["oom"]
            a = "OOM" if r["oom"] else format(r["ratio"], ".4f")
            b = "OOM" if lm["oom"] else format(lm["ratio"], ".4f")
            pairs.append(f"{r['pct']}%: {a} vs {b}")
        else:
            good = r["time"] <= lm["time"]
            pairs.append(f"{r['pct']}%: {r['ratio']:.4f} vs {lm['ratio']:.4f}"
                         + ("" if good else " (worse)"))
        ok = ok and good
    out.append(("LMP <= LM at every budget (LMP vs LM time/FO)", ok if pairs else None,
                "; ".join(pairs) if pairs else "no CA:LM/CA:LMP rows"))
    worst, detail = None, []
    for r in rows:
        floor = max(0, footprint - r["budget"])
        if r["label"] != "CA:LM" or r["oom"] or not floor:
            continue
        q = r["slow_writes"] / floor
        detail.append(f"{r['pct']}%: {q:.3f}x")
        if worst is None or q > worst[0]:
            worst = (q, r["pct"])
    if worst is None:
        out.append(("LM slow writes <= 1.1x floor", None, "no CA:LM row below 100%"))
    else:
        out.append(("LM slow writes <= 1.1x floor", worst[0] <= TARGET_FLOOR,
                    f"worst {worst[0]:.3f}x at {worst[1]}% ({', '.join(detail)})"))
    return out


TARGET_SENTINEL_20 = 1.09   # Sentinel at 20%: its paper runs 9% below DRAM-only
TARGET_BEST_25 = 1.05       # the best policy at 25%


def seed_targets(rows):
    """[(name, passed or None, detail)] of the seed policies' targets."""
    out = []
    s20 = _find(rows, "Sentinel", 20)
    if s20 is None:
        out.append(("Sentinel at 20% <= 1.09x fast-only", None, "no Sentinel row at 20%"))
    else:
        out.append(("Sentinel at 20% <= 1.09x fast-only",
                    not s20["oom"] and s20["ratio"] <= TARGET_SENTINEL_20,
                    "OOM" if s20["oom"] else f"{s20['ratio']:.4f}x"))
    at25 = [r for r in rows if r["pct"] == 25 and not r["oom"]]
    if not at25:
        out.append(("best policy at 25% <= 1.05x fast-only", None, "no row at 25%"))
    else:
        best = min(at25, key=lambda r: r["ratio"])
        out.append(("best policy at 25% <= 1.05x fast-only", best["ratio"] <= TARGET_BEST_25,
                    f"{best['label']} {best['ratio']:.4f}x"))
    base = [_find(rows, b, 20) for b in ("LRU", "MemoryMode")]
    seeds = [r for r in rows if r["label"] in SEED_POLICIES and r["pct"] == 20]
    if not seeds or any(b is None for b in base):
        out.append(("every seed policy beats LRU and 2LM at 20%", None,
                    "needs LRU, MemoryMode and seed policy rows at 20%"))
    else:
        worst = min((b for b in base if not b["oom"]), key=lambda r: r["ratio"], default=None)
        bad, detail = [], []
        for r in seeds:
            ok = not r["oom"] and (worst is None or r["ratio"] < worst["ratio"])
            detail.append(f"{r['label']} {'OOM' if r['oom'] else format(r['ratio'], '.4f')}")
            if not ok:
                bad.append(r["label"])
        ref = ", ".join(f"{b['label']} {'OOM' if b['oom'] else format(b['ratio'], '.4f')}"
                        for b in base)
        out.append(("every seed policy beats LRU and 2LM at 20%", not bad,
                    f"{'; '.join(detail)} vs {ref}" + (f" (not: {', '.join(bad)})" if bad
                                                       else "")))
    return out


def target_lines(rows, footprint, model=""):
    """One 'goal <model> <target>: <detail>: met|not met' line per target (recorded for the
    Markdown summary of ``make bench``)."""
    out = []
    for name, ok, detail in targets(rows, footprint) + seed_targets(rows):
        status = "n/a" if ok is None else ("met" if ok else "not met")
        out.append(f"goal {model} {name}: {detail}: {status}")
        if ok is not None:
            _common.record("goal", name=f"{model} {name}", value=None, detail=detail, met=ok)
    return out


def describe(name, trace):
    groups = trace.step_kernels()
    steps = len(groups)
    threads = trace.meta.get("threads")
    nc = program_view(trace, (False, True, False, False)).footprint()
    return (f"{name}: {len(groups[-1]) if groups else 0} kernels/step, {len(trace.objects)} objects, "
            f"{steps} steps, footprint {_size(trace.footprint())} (without cleanup "
            f"{_size(nc)}), fast-only step {trace.compute(-1) * 1e3:.1f} ms "
            f"({trace.meta.get('times', 'recorded times')}, {trace.meta.get('backend', '?')} "
            f"backend{f', {threads} threads' if threads else ''})")


def report(name, trace, rows, profile, out=print):
    """Print one model's table, floor lines and targets; returns the target results."""
    foot = trace.footprint()
    out("")
    out(describe(name, trace))
    out(f"profile: {profile} (fast tier dram; MemoryMode's slow tier {_cache_profile(profile)}); "
        "figures of the last step; * = memory mode: fast memory is the DRAM cache")
    for line in table_lines(rows):
        out(line)
    for line in floor_lines(rows, foot):
        out(line)
    for line in migrated_lines(rows):
        out(line)
    for line in autotm_lines(rows):
        out(line)
    if any(r["label"] == "Sentinel" for r in rows):
        for line in sentinel_lines(name, trace, profile):
            out(line)
    if any(r["label"] == "DeepTM" for r in rows):
        for line in deeptm_lines(name, trace, profile):
            out(line)
    for line in target_lines(rows, foot, name):
        out(line)
    secs = [r["seconds"] for r in rows]
    plain = [r for r in rows if r["label"] not in SEED_POLICIES] or rows   # no planning inside
    slow = max(plain, key=lambda r: r["seconds"])
    per_step = slow["seconds"] / max(1, trace.steps)
    out(f"[wall] sweep: {len(rows)} replays in {sum(secs):.2f} s; slowest {slow['label']} at "
        f"{slow['pct']}%: {slow['seconds']:.2f} s for {trace.steps} steps = {per_step:.3f} s/step"
        + (f" ({'PASS' if per_step < 2 else 'FAIL'}: a ResNet-50 step replays in < 2 s)"
           if name == "resnet50" else "") + " (policies that do not plan)")
    return targets(rows, foot) + seed_targets(rows)


MIL_SWEEP = (1, 2, 4, 8, 16)
TABLE_IV = ("LRU", "CA:LM", "CA:LMP", "MemoryMode", "AutoTM", "Sentinel", "DeepTM",
            "DeepTM-DQN")


def migrated_lines(rows, pct=20):
    """Sentinel's Table IV analogue: bytes moved between the tiers per step at one budget."""
    out = [f"bytes migrated per step at {pct}% (Sentinel's Table IV; memory mode moves lines, "
           "not arrays: its slow traffic is in the table above):"]
    for label in TABLE_IV:
        r = _find(rows, label, pct)
        if r is not None and not r["oom"]:
            out.append(f"  {label:<11} {_size(r['moved']):>11}  ({r['ratio']:.4f}x)")
    return out


def sentinel_lines(name, trace, profile, pct=20, mils=MIL_SWEEP):
    """Sentinel's characterization of the trace and its MIL sweep at one budget (Fig. 5)."""
    from cachedarrays.policies import sentinel
    out = [f"{name}: Sentinel's characterization of the last step:"]
    out += ["  " + line for line in sentinel.format_characterization(
        sentinel.characterize(trace))]
    budget = max(int(trace.footprint() * pct / 100), 1 << 16)
    sweep = sentinel.mil_sweep(trace, budget, profile=profile, mils=mils)
    out.append(f"Sentinel MIL sweep at {pct}% (Fig. 5; layers per interval: modelled time / "
               "fast-only): " + ", ".join(f"{m}: {r:.4f}" for m, r in sweep))
    return out


def autotm_lines(rows):
    """AutoTM's integer program per budget: size, its own modelled step, bound, gap."""
    out = []
    for r in rows:
        info = r.get("info") or {}
        if r["label"] != "AutoTM" or "objective" not in info:
            continue
        fo = info.get("fast_only") or 0
        out.append(f"  {r['pct']:>4}%  {info['variables']:>6} variables {info['constraints']:>6} "
                   f"rows {info['nonzeros']:>7} nonzeros  program {info['ratio']:.4f}x, "
                   f"bound {info['bound'] / fo if fo else float('nan'):.4f}x, gap "
                   f"{info['gap']:.1e} ({info['status']}); replay {r['ratio']:.4f}x")
    if out:
        out.insert(0, "AutoTM's integer linear program (HiGHS), per budget:")
        secs = [(r["pct"], (r.get("info") or {}).get("solve_seconds_total"))
                for r in rows if r["label"] == "AutoTM"]
        out.append("[wall] AutoTM solve seconds (all attempts): " + ", ".join(
            f"{p}% {x:.1f} s" for p, x in secs if x is not None))
    return out


FIG17 = ((0.9, ("deeptm", None), ("sentinel", None), ("lru", {"preset": "CA:LMP"}),
          ("lru", None)),
         (0.98, ("deeptm", None), ("lru", {"preset": "CA:LMP"})))
BETAS = (0.25, 0.5, 0.75, 1.0)


def deeptm_lines(name, trace, profile):
    """DeepTM's figures: the smallest budget reaching a share of fast-only speed (Fig. 17),
    against other policies, and the β curve of DRAM bought against speed (Fig. 16)."""
    from cachedarrays.policies import deeptm
    out = [f"{name}: smallest fast budget (5% steps) reaching a share of fast-only speed "
           "(DeepTM's Fig. 17):"]
    for target, *policies in FIG17:
        cells = []
        for pol, opts in policies:
            sw = program_switches(pol, opts)
            f = deeptm.smallest_budget(program_view(trace, sw), target=target, profile=profile,
                                       policy=pol if pol != "deeptm" else None,
                                       policy_options=opts)
            label = "CA:LMP" if opts else {"lru": "LRU", "deeptm": "DeepTM",
                                           "sentinel": "Sentinel"}[pol]
            cells.append(f"{label} {'none' if f is None else format(f, '.0%')}")
        out.append(f"  {target:.0%} of fast-only: " + ", ".join(cells))
    out.append("DeepTM's beta curve (Fig. 16; all memory available; DRAM the plan uses, "
               "modelled time / fast-only, memory cost at $23.81/GB DRAM, $7.85/GB PM):")
    for row in deeptm.beta_curve(program_view(trace, program_switches("deeptm")), BETAS,
                                 profile=profile):
        out.append(f"  beta {row.beta:.2f}: DRAM {_size(row.dram_bytes):>10}  "
                   f"{row.ratio:.4f}x  ${row.cost:.2f}")
    return out


def plot(path, results, profile=None):
    """Fig. 4.10: modelled step time / fast-only against the fast budget, per policy and model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(results)
    cols = min(n, 2)
    rws = (n + cols - 1) // cols
    fig, axes = plt.subplots(rws, cols, figsize=(6 * cols, 4 * rws), squeeze=False)
    for ax, (name, rows) in zip(axes.flat, results.items()):
        for label in dict.fromkeys(r["label"] for r in rows):
            pts = [(r["pct"], r["ratio"]) for r in rows if r["label"] == label and not r["oom"]]
            if pts:
                x, y = zip(*pts)
                ax.plot(x, y, "o-", label=label, ms=4)
        ax.axhline(1.0, color="gray", ls=":", lw=1)
        ax.set_xticks(sorted({r["pct"] for r in rows}))
        ax.invert_xaxis()
        ax.set_title(name)
        ax.set_xlabel("fast memory budget (% of footprint)")
        ax.set_ylabel("modelled step time / fast-only")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if profile:
        fig.suptitle(f"modelled step time vs fast budget (slow tier {profile}; memory mode "
                     f"{_cache_profile(profile)})", fontsize=10)
    fig.tight_layout()
    _common.save_plot(fig, path, dpi=120, tight=False, announce=False)
    plt.close(fig)


# ---- command line -----------------------------------------------------------------------------

SECTIONS = ("sweep", "capuchin", "g10")


def parse_args(argv):
    p = _common.parser(__doc__)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   type=_common.listed(_common.one_of(tuple(MODELS))),
                   help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                   type=_common.listed(_common.whole()),
                   help="fast budgets, percent of the footprint")
    p.add_argument("--profile", default="optane",
                   type=_common.one_of(tuple(sorted(costmodel.PROFILES))),
                   help=f"slow-tier profile: {', '.join(sorted(costmodel.PROFILES))}")
    p.add_argument("--traces", default=DEFAULT_TRACES, type=_common.out_folder,
                   help="folder for the traces (default: benchmarks/.traces); traces found "
                   "there, recorded with the same settings, are replayed instead of recorded "
                   "again")
    p.add_argument("--record", action="store_true", help="record the traces again even if "
                   "--traces holds them")
    p.add_argument("--steps", type=_common.whole(2), default=4, help="steps recorded per model "
                   "(kernel times: median of all but the first)")
    p.add_argument("--backend", default="onednn", choices=("auto", "numpy", "onednn"),
                   help="kernels of the recorded run (default onednn, the faster on full-size "
                   "models; auto: probe both on this machine, which is noisy when it is loaded)")
    p.add_argument("--threads", type=_common.thread_count, default=os.cpu_count() or 1,
                   help="oneDNN threads")
    p.add_argument("--plot", default=None, metavar="PNG", type=_common.figure_path,
                   help="write the Fig. 4.10 sweep (and the G10 sweeps next to it, as "
                   "<name>-g10.png)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   type=_common.listed(_common.one_of(tuple(SECTIONS))),
                   help=f"comma-separated, from {', '.join(SECTIONS)}: the policy sweep, the "
                   "Capuchin max-batch table (batch families of the three CNNs) and the G10 "
                   "three-tier figures")
    _common.add_standard(p, plot=False, with_threads=False)      # --no-progress
    args = p.parse_args(argv)
    if args.plot and not {"sweep", "g10"} & set(args.sections):
        p.error("--plot draws the sweep and g10 sections: add one of them to --sections, or "
                "drop --plot")
    return args


def main(argv=None, out=print):
    args = parse_args(argv)
    names, budgets, sections = args.models, tuple(args.budgets), args.sections
    out(_common.machine())
    folder = args.traces
    os.makedirs(folder, exist_ok=True)
    chosen = {}

    def backend(spec):                      # picked once per model kind, when first needed
        if spec["kind"] not in chosen:
            chosen[spec["kind"]] = pick_backend(args.backend, spec, log=out)
        return chosen[spec["kind"]]

    set_threads(args.threads)
    out(threads_line())

    out(f"profile: {args.profile} (memory mode: {_cache_profile(args.profile)}); budgets "
        f"{', '.join(f'{b}%' for b in budgets)} of each trace's footprint; traces in "
        f"{folder}")
    results, verdicts = {}, {}
    for name in _common.progress(names if "sweep" in sections else (), desc="policy sweep",
                                 disable=args.no_progress):
        t = load_or_record(name, MODELS[name], folder, not args.record, backend,
                           args.steps, log=out)
        t0 = time.perf_counter()
        rows = sweep(t, policies_for(name), budgets, args.profile)
        results[name] = rows
        verdicts[name] = report(name, t, rows, args.profile, out=out)
        out(f"[wall] {name}: sweep of {len(policies_for(name))} policies x {len(budgets)} budgets in "
            f"{time.perf_counter() - t0:.2f} s")
    out("")
    out("summary of the targets:")
    for name, vs in verdicts.items():
        out(f"  {name:<12} " + "  ".join(
            f"{key}: {'n/a' if ok is None else ('met' if ok else 'not met')}"
            for key, (_, ok, _) in zip(("LM@25%", "LMP<=LM", "LM writes/floor",
                                        "Sentinel@20%", "best@25%", "seeds>LRU,2LM"), vs)))
    if args.plot and results:
        plot(args.plot, results, args.profile)
        out(f"wrote {args.plot}")
    cnns = [n for n in names if n in FAMILIES]
    if "capuchin" in sections and cnns:
        out("")
        _capuchin = _load("_capuchin")
        t0 = time.perf_counter()
        _capuchin.main(cnns, folder, out=out)
        out(f"[wall] Capuchin section in {time.perf_counter() - t0:.1f} s")
    if "g10" in sections and cnns:
        out("")
        _g10 = _load("_g10")
        for n in cnns:                      # recorded now if missing
            load_or_record(n, MODELS[n], folder, not args.record, backend, args.steps, log=out)
        t0 = time.perf_counter()
        g10_plot = f"{os.path.splitext(args.plot)[0]}-g10.png" if args.plot else None
        _g10.main(cnns, folder, plot_path=g10_plot, out=out)
        out(f"[wall] G10 section in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
