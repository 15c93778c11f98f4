"""CNN training on CachedArrays (dissertation §4.6–4.7): setups, traffic, modelled time, PyTorch.

    python benchmarks/cnn.py --model resnet --depth 50 --batch 16 --image 64 --backend onednn \\
        --fast 25% --setup 2lm,LM,fast-only --iterations 4 --threads 2 [--plot DIR] [--sweep] [--peer torch]
    python benchmarks/cnn.py --models resnet50,vgg16,densenet121 --peer torch --peer-only


--fast is the fast memory of the CachedArrays setups and --dram-cache the simulated DRAM cache
of the 2LM setups (by default the --fast size, so every setup has the same DRAM); each is bytes,
a size ("256MiB") or a percentage of the footprint measured by one iteration with everything in
fast memory. --setup (or --mode) takes one setup or a comma-separated list of
2lm, 2lm-none, none (CA:0), L, LM, LMP, fast-only, sentinel, deeptm, autotm (the planning
policies profile the second iteration and run their plan from the third on). Policy figures (bytes moved, modelled time
on a slow-device profile) and wall-clock figures are printed in separate tables: on machines
without persistent memory the slow device is a file mapping the OS keeps in DRAM, so only the
bytes and the modelled time say what a real slow device would cost.

Policy figures come from the policy lab: every iteration is recorded with ``ca.trace`` and its
decision log priced by the deterministic cost model (``cachedarrays.costmodel``) with kernel
times taken once from a fast-only run of the same model (the median over --ref-iterations
iterations after the first). Those times are saved to --times (by default
<outdir>/times/<model and shapes>.trace.gz) and reused by later runs, so running the benchmark
twice prints identical policy figures; --remeasure measures them again.

The setups are interleaved: every setup is built first (each with its own manager and model), then
iteration i runs in every setup before iteration i+1 in any, so machine load hits all setups alike
in the wall-clock table (the fast-only setup's wall time comes from the same run). The first
iteration of each setup warms up; the tables report medians of the others (each figure on its
own). ``--peer torch`` runs the same model in PyTorch in a separate process
(benchmarks/_torch_cnn.py: torch's OpenMP runtime never shares a process with oneDNN's) under
the same thread settings (OMP_WAIT_POLICY, OMP_NUM_THREADS, printed), alternates one step of
ours with one step of PyTorch's and prints speedup = torch step time / our step time (> 1: ours
is faster) with a goal line per model; ``--models`` runs several models one after the other and
``--peer-only`` skips the setups (the comparison alone).

--plot PATH: a folder (created) receives <model>_occupancy.png and <model>_traffic.png (heap
occupancy and slow-memory traffic per setup), <model>_sweep.png with --sweep and
cnn_vs_torch.png with --peer; a PATH ending in .png names the main figure (the speedup chart
with --peer, else the traffic figure) and the others are written next to it as
<PATH stem>_<model>_<figure>.png.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# Keep this folder off the import path (a script here must never shadow a module of the
# standard library or a dependency); what is imported from here is loaded by file path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _load_common():
    spec = importlib.util.spec_from_file_location("_cnn_bench_common", os.path.join(_HERE, "_common.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# First, before NumPy or any OpenMP runtime loads: it sets OMP_WAIT_POLICY=PASSIVE (unless set).
_common = _load_common()
machine = _common.machine

import numpy as np  # noqa: E402

import cachedarrays as ca  # noqa: E402
from cachedarrays.models import cnn  # noqa: E402
from cachedarrays.costmodel import PROFILES  # noqa: E402
from cachedarrays.models.backend import get_backend  # noqa: E402
from cachedarrays.telemetry import read_event_log  # noqa: E402
from cachedarrays.trace import Trace, TraceError  # noqa: E402



SWEEP = (100, 75, 50, 25, 10, 5, 0)
#: The learning rate of the timed steps, ours and PyTorch's: VGG-16 (no batch norm) on the
#: repeated synthetic batch diverged at 0.01 (loss 9.1, 138, 2838, 3e10, then NaN), so its
#: steps timed arithmetic on NaN; at 0.001 its loss falls (9.1 to 1.6 in 13 steps).
LR = 0.001


def _size(n):
    return ca.format_size(int(n))


def parse_args(argv):
    p = _common.parser(__doc__)
    p.add_argument("--model", default="resnet", choices=tuple(cnn.MODELS), help="model family")
    p.add_argument("--depth", type=_common.whole(), default=18,
                   help="model depth (e.g. resnet 18/34/50/101, "
                   "vgg 11/13/16/19, densenet 121/169/201/264)")
    p.add_argument("--models", default=None, metavar="LIST",
                   help="comma-separated models to run one after the other, each a family and a "
                   "depth, e.g. resnet50,vgg16,densenet121 (overrides --model and --depth)")
    p.add_argument("--batch", type=_common.whole(), default=16, help="batch size")
    p.add_argument("--image", type=_common.whole(), default=64,
                   help="image height and width (pixels)")
    p.add_argument("--channels", type=_common.whole(), default=3, help="input channels")
    p.add_argument("--classes", type=_common.whole(), default=100,
                   help="classes of the classifier")
    p.add_argument("--width", type=_common.positive, default=1,
                   help="divide every channel count by this")
    p.add_argument("--backend", default="onednn", choices=("numpy", "onednn"),
                   help="kernel backend of ours")
    p.add_argument("--fast", default="25%", help="fast memory: bytes, a size like 256MiB, or a "
                   "percentage of the footprint")
    p.add_argument("--dram-cache", default=None,
                   help="simulated DRAM cache of the 2lm setups (default: the --fast size)")
    p.add_argument("--slow", default=None, help="slow memory size (default: 3x the estimate)")
    p.add_argument("--setup", "--mode", dest="setup", default="2lm,LM,fast-only",
                   help=f"setups, comma-separated: {', '.join(cnn.SETUPS)}")
    p.add_argument("--iterations", type=_common.whole(), default=4,
                   help="iterations per setup; the first warms up, the rest give medians")
    p.add_argument("--profile", default="optane", choices=tuple(PROFILES),
                   help="slow-device profile of the cost model")
    p.add_argument("--line-size", type=_common.whole(), default=64,
                   help="2LM simulator line size (bytes)")
    p.add_argument("--plot", metavar="PATH", default=None, type=_common.figure_or_folder,
                   help="write the figures: PATH a folder, or a .png for the main figure (others "
                   "next to it); see the description below")
    p.add_argument("--sweep", action="store_true", help="fast-budget sweep 100%%..0%% in setup LM")
    p.add_argument("--peer", default=None, choices=("torch",),
                   help="also time the same training step in this framework (speedup = its "
                   "step time / ours)")
    p.add_argument("--peer-only", action="store_true",
                   help="with --peer: skip the setups and run the comparison alone")
    p.add_argument("--repeats", type=_common.whole(), default=7,
                   help="alternating steps ours/peer for --peer (>= 3; medians)")
    p.add_argument("--unfused", action="store_true",
                   help="apply SGD after the backward pass instead of inside it")
    p.add_argument("--outdir", default="cnn_figures", type=_common.out_folder,
                   help="folder of the saved kernel times (times/) and, without --plot, of the "
                   "--sweep figure")
    p.add_argument("--times", default=None, type=_common.data_file,
                   help="file of the fast-only kernel times (a saved trace); measured and saved "
                   "there when missing (default: <outdir>/times/<model and shapes>.trace.gz)")
    p.add_argument("--remeasure", action="store_true",
                   help="measure the fast-only kernel times again (and save them to --times)")
    p.add_argument("--ref-iterations", type=_common.whole(), default=cnn.REFERENCE_ITERATIONS,
                   help="fast-only iterations measured for the kernel times (the first warms up)")
    _common.add_standard(p, threads=2, plot=False)
    args = p.parse_args(argv)
    if args.peer and args.repeats < 3:
        p.error("--repeats must be >= 3 (medians of at least 3 steps)")
    if args.peer_only and not args.peer:
        p.error("--peer-only needs --peer")
    try:                                # read as the run reads them, before it starts
        for flag, value in (("--fast", args.fast), ("--dram-cache", args.dram_cache)):
            if value is not None:
                cnn.parse_budget(value, 1, flag)
        if args.slow is not None:
            ca.parse_size(args.slow, "--slow")
    except (ValueError, TypeError) as e:
        p.error(str(e))
    if args.peer:
        _common.check_peer(p, args.peer)
    return args


def _model_list(args):
    """[(family, depth)] of --models, or of --model/--depth."""
    if not args.models:
        return [(args.model, args.depth)]
    out = []
    for spec in (x.strip() for x in args.models.split(",")):
        if not spec:
            continue
        family = spec.rstrip("0123456789")
        digits = spec[len(family):]
        if family not in cnn.MODELS or not digits:
            raise ValueError(f"--models: {spec!r} is not a model family and depth such as "
                             f"resnet50; valid families: {', '.join(cnn.MODELS)}")
        out.append((family, int(digits)))
    if not out:
        raise ValueError("--models: no model given")
    return out


def _figure(args, name, kind, main_kind):
    """Where figure `kind` of model `name` goes under --plot PATH (a folder or a .png)."""
    path = args.plot
    if not _common.is_folder_target(path):
        base, ext = os.path.splitext(path)
        return path if kind == main_kind else f"{base}_{name}_{kind}{ext}"
    os.makedirs(path, exist_ok=True)
    return os.path.join(path, f"{name}_{kind}.png")


def _set_threads(backend, n):
    line = _common.apply_threads(n)
    if backend == "onednn":
        get_backend("onednn").set_threads(n)
    return line


def _budget(spec, footprint, flag="--fast"):
    """(bytes, label) of a budget flag, parsed as the trainers parse it."""
    n = cnn.parse_budget(spec, footprint, flag)
    text = str(spec).strip()
    if text.endswith("%"):
        return n, text
    return n, f"{n / footprint:.0%}" if footprint else _size(n)


def _check_slow_room(need, slow, where):
    free = shutil.disk_usage(where).free
    if slow > free:
        raise SystemExit(f"error: the slow device needs {_size(slow)} (one iteration needs about "
                         f"{_size(need)}), but {where} has only {_size(free)} free; use --slow, "
                         "a smaller --batch or --image, or set TMPDIR to a larger file system")


def _dram(args, setup, fast=None):
    """The sizes for setup: --fast as fast memory, or in the 2LM setups --dram-cache (default:
    the --fast size) as the simulated DRAM cache."""
    sizes = cnn.dram_budget(setup, args.fast if fast is None else fast)
    if "dram_cache" in sizes and args.dram_cache is not None:
        sizes["dram_cache"] = args.dram_cache
    return sizes


def make_trainer(args, setup, slow, footprint, event_log=None, fast=None, reference=None):
    """A cnn.Trainer for one setup with the benchmark's model, shapes and options; budgets are
    passed through as given (bytes, a size or a percentage) and parsed by the trainer.
    reference: the fast-only kernel times (``reference_times``)."""
    return cnn.Trainer(args.model, args.depth, setup=setup, **_dram(args, setup, fast),
                       backend=args.backend,
                       batch=args.batch, image=args.image, channels=args.channels,
                       classes=args.classes, width=args.width, profile=args.profile, slow=slow,
                       event_log=event_log, line_size=args.line_size, fused=not args.unfused,
                       footprint=footprint, reference=reference)


def _shape(args):
    return dict(batch=args.batch, image=args.image, channels=args.channels,
                classes=args.classes, width=args.width)


def _reference_key(args):
    """What the kernel times depend on: model, shapes, backend, threads, fused SGD."""
    return dict(model=f"{args.model}{args.depth}", **_shape(args), backend=args.backend,
                threads=args.threads, fused=not args.unfused)


def times_path(args):
    """--times, or the default file for this model, shapes, backend and threads."""
    if args.times:
        return args.times
    k = _reference_key(args)
    name = (f"{k['model']}-b{k['batch']}-i{k['image']}-c{k['channels']}-k{k['classes']}-"
            f"w{k['width']:g}-{k['backend']}-t{k['threads']}-"
            f"{'fused' if k['fused'] else 'unfused'}.trace.gz")
    return os.path.join(args.outdir, "times", name)


def reference_times(args):
    """(reference trace, how it was obtained): loaded from times_path(args), or measured
    (fast-only, --ref-iterations iterations, medians) and saved there."""
    path = times_path(args)
    key = _reference_key(args)
    if os.path.exists(path) and not args.remeasure:
        try:
            ref = Trace.load(path)
        except TraceError as e:
            raise SystemExit(f"error: --times {path}: {e}; use --remeasure to measure again") \
                from None
        got = ref.meta.get("benchmark")
        if got != key:
            raise SystemExit(f"error: --times {path} holds the kernel times of {got}, not of "
                             f"{key}; give another --times file or --remeasure")
        return ref, f"loaded from {path} ({ref.meta.get('times', '?')})"
    ref = cnn.fast_only_reference(args.model, args.depth, args.backend, not args.unfused,
                                  iterations=args.ref_iterations, **_shape(args))
    ref.meta["benchmark"] = key
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ref.save(path)
    return ref, f"measured now ({ref.meta['times']}) and saved to {path}"


def run_interleaved(trainers, iterations, bar=None):
    """Records per trainer: iteration i of every trainer runs before iteration i+1 of any
    (in ``_common.turn_order``)."""
    recs = [[] for _ in trainers]
    for it in range(iterations):
        for k in _common.turn_order(len(trainers), it):
            tr, out = trainers[k], recs[k]
            rec = tr.step()
            out.append(rec)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(setup=tr.setup, loss=f"{rec['loss']:.3f}")
    return recs


_POLICY_FIGURES = ("modelled", "compute", "stall", "s->f", "f->s", "k_slow_r", "k_slow_w",
                   "slow_r", "slow_w", "moved", "peak_fast", "peak_slow")


def _median(values):
    return statistics.median_low(values) if values and isinstance(values[0], int) else \
        statistics.median(values)


def _policy_row(setup, budget, recs):
    """Policy figures (cost model; each the median over the iterations after the first, which
    warms the cache, or for a planning setup after the profiled one) and wall-clock figures of
    one setup."""
    skip = 2 if setup in cnn.PLANNED else 1      # planning setups run their plan from the third
    use = recs[skip:] if len(recs) > skip else recs[-1:]
    r = use[len(use) // 2]
    row = {"setup": setup, "budget": budget, "n": len(use), "loss": r["loss"],
           "wall": statistics.median(x["wall"] for x in use),
           "fast_only": r["run"].fast_only,
           "elided": _median([x["stats"]["events"].get("writebacks_elided", {}).get("bytes", 0)
                              for x in use])}
    for key in _POLICY_FIGURES:
        row[key] = _median([x["figures"][key] for x in use])
    mm = r["memory_mode"]
    if mm:     # the simulated DRAM cache is the setup's fast memory
        row.update(hits=mm["hits"], clean=mm["clean_misses"], dirty=mm["dirty_misses"],
                   amp=mm["access_amplification"], peak_fast=min(budget, row["peak_slow"]))
    return row


def print_policy_table(rows, profile):
    print(f"\npolicy figures per iteration (cost model on the {profile!r} profile, fast-only "
          "kernel times; bytes from the decision log; medians of "
          f"{rows[0]['n']} iterations per setup):")
    head = (f"{'setup':>9} {'budget':>9} {'slow rd':>9} {'slow wr':>9} {'s->f':>9} {'f->s':>9} "
            f"{'k slow rd':>9} {'k slow wr':>9} {'elided':>9} {'peak fast':>9} {'stall':>9} "
            f"{'modelled':>10} {'/fast-only':>10}")
    print(head)
    for r in rows:
        ratio = r["modelled"] / r["fast_only"] if r["fast_only"] else float("nan")
        print(f"{r['setup']:>9} {_size(r['budget']):>9} {_size(r['slow_r']):>9} {_size(r['slow_w']):>9} "
              f"{_size(r['s->f']):>9} {_size(r['f->s']):>9} {_size(r['k_slow_r']):>9} "
              f"{_size(r['k_slow_w']):>9} {_size(r['elided']):>9} {_size(r['peak_fast']):>9} "
              f"{r['stall'] * 1e3:>7.3f}ms {r['modelled'] * 1e3:>8.3f}ms {ratio:>10.4f}")
    for r in rows:
        if "hits" in r:
            lines = r["hits"] + r["clean"] + r["dirty"]
            print(f"  {r['setup']}: DRAM-cache line accesses {lines}, hit rate {r['hits'] / max(lines, 1):.1%}, "
                  f"clean misses {r['clean'] / max(lines, 1):.1%}, dirty misses {r['dirty'] / max(lines, 1):.1%}, "
                  f"access amplification {r['amp']:.2f}")


def print_wall_table(rows):
    print("\nwall-clock figures (this machine; both tiers are DRAM here; medians of "
          f"{rows[0]['n']} interleaved iterations per setup):")
    print(f"{'setup':>9} {'wall/iter':>10} {'loss':>8}")
    for r in rows:
        print(f"{r['setup']:>9} {r['wall'] * 1e3:>8.1f}ms {r['loss']:>8.4f}")


def print_targets(rows, footprint=None):
    by = {r["setup"]: r for r in rows}
    if "LM" in by and ("2lm" in by or "2lm-none" in by):
        base = by.get("2lm") or by["2lm-none"]
        ratio = by["LM"]["slow_w"] / base["slow_w"] if base["slow_w"] else float("inf")
        print(f"target: LM slow-memory writes / 2LM slow-memory writes = {ratio:.3f} (target <= 0.5)")
        if footprint and base["slow_w"]:
            # At the peak, footprint bytes are live and at most the budget is in fast memory;
            # every other live byte (weights are rewritten every step) was written to slow memory
            # once per iteration, whatever the policy: a floor for LM and 2LM alike.
            floor = max(0, footprint - by["LM"]["budget"])
            print(f"  floor for any placement of these arrays: footprint - budget = {_size(floor)} "
                  f"per iteration, i.e. ratio >= {floor / base['slow_w']:.3f}; LM writes "
                  f"{by['LM']['slow_w'] / floor if floor else float('inf'):.2f}x the floor")
    if "LM" in by:
        lm = by["LM"]
        fo = by["fast-only"]["modelled"] if "fast-only" in by else lm["fast_only"]
        print(f"target: LM modelled time / fast-only modelled time = {lm['modelled'] / fo:.4f} "
              f"(target <= 1.08; fast-only {fo * 1e3:.3f} ms = the reference's kernel times)")


def plot_occupancy(path, logs):
    """Fig. 4.6: bytes in use per heap through the last logged iteration of each setup."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for setup, log_path in logs.items():
        events = read_event_log(log_path)
        marks = [i for i, e in enumerate(events) if e["event"] == "cnn_iteration"]
        if not marks:
            continue
        seg = events[marks[-1]:]
        t0 = seg[0]["t"]
        for dev in ("fast", "slow"):
            pts = [(e["t"] - t0, e["used"]) for e in seg
                   if e["event"] in ("alloc", "free") and e.get("device") == dev]
            if pts and (dev == "fast" or setup.startswith("2lm") or max(p[1] for p in pts) > 0):
                t, u = zip(*pts)
                ax.step(t, np.array(u) / 2**20, where="post", label=f"{setup}: {dev} heap")
    ax.set_xlabel("time in iteration (s)")
    ax.set_ylabel("MiB in use")
    ax.set_title("heap occupancy over one training iteration")
    ax.legend(fontsize=7)
    fig.tight_layout()
    _common.save_plot(fig, path, dpi=120, tight=False, announce=False)
    plt.close(fig)


def plot_traffic(path, rows):
    """Fig. 4.8: slow-memory reads and writes per setup."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["slow_r"] / 2**20 for r in rows], 0.4, label="slow reads")
    ax.bar(x + 0.2, [r["slow_w"] / 2**20 for r in rows], 0.4, label="slow writes")
    ax.set_xticks(x, [r["setup"] for r in rows])
    ax.set_ylabel("MiB per iteration")
    ax.set_title("slow-memory traffic per setup")
    ax.legend()
    fig.tight_layout()
    _common.save_plot(fig, path, dpi=120, tight=False, announce=False)
    plt.close(fig)


def plot_sweep(path, rows, fast_only):
    """Fig. 4.10: modelled iteration time against the fast-memory budget (setup LM); the wall
    times (this machine, both tiers DRAM) for comparison."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["pct"] for r in rows], [r["modelled"] * 1e3 for r in rows], "o-", label="LM modelled")
    ax.plot([r["pct"] for r in rows], [r["wall"] * 1e3 for r in rows], "s--", label="LM wall")
    if fast_only is not None:
        ax.axhline(fast_only * 1e3, color="gray", ls=":", label="fast-only modelled")
    ax.invert_xaxis()
    ax.set_xlabel("fast-memory budget (% of footprint)")
    ax.set_ylabel("ms per iteration")
    ax.legend()
    fig.tight_layout()
    _common.save_plot(fig, path, dpi=120, tight=False, announce=False)
    plt.close(fig)


class TorchPeer:
    """benchmarks/_torch_cnn.py in a child process: the same model and SGD step in PyTorch, under
    the same thread settings as ours (``env``: OMP_WAIT_POLICY, OMP_NUM_THREADS, MKL_NUM_THREADS)."""

    def __init__(self, args):
        cfg = dict(model=args.model, depth=args.depth, batch=args.batch, image=args.image,
                   channels=args.channels, classes=args.classes, width=args.width,
                   threads=args.threads, lr=LR)
        self.env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                    "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        self.proc = subprocess.Popen([sys.executable, os.path.join(_HERE, "_torch_cnn.py"),
                                      json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, **self.env))
        self.info = self._read()
        if self.info.get("params") != self.info.get("expected_params"):
            raise RuntimeError(f"torch peer built {self.info.get('params')} parameters, ours has "
                               f"{self.info.get('expected_params')}")

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(f"the torch peer stopped (exit {self.proc.wait()}); its error is "
                            "above")
        return json.loads(line)

    def steps(self, n=1):
        """Seconds of each of n PyTorch training steps (timed in the child)."""
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return self._read()["times"]

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc.wait(timeout=60)


class PeerError(RuntimeError):
    """The peer process stopped before it answered."""


def peer_torch(args):
    """Seconds per training step, ours (fast-only) and PyTorch's, alternating one step each.

    Ours runs in this process (untraced), PyTorch in a child process under the same thread
    settings; neither runs while the other does. Prints both medians with their spread, the
    speedup (torch time / ours, median of the per-step ratios) and the goal line; returns
    (model name, our samples, torch samples).
    """
    load0 = os.getloadavg()
    model = cnn.build(args.model, args.depth, batch=args.batch, image=args.image,
                      channels=args.channels, classes=args.classes, width=args.width)
    x, y = cnn.synthetic_batch(model)
    m, s = cnn.make_session("fast-only", int(model.footprint_estimate() * 1.5) + (16 << 20),
                            1 << 20, args.backend, stable_ids=False)     # never traced
    peer = TorchPeer(args)
    ours_t, theirs_t = [], []
    try:
        model.init(s)
        opt = cnn.SGD(LR)
        fused = not args.unfused
        for _ in range(2):
            cnn.train_step(s, model, x, y, opt, fused=fused)
        for _ in _common.progress(range(args.repeats), total=args.repeats,
                                  desc=f"{model.name} vs torch", disable=args.no_progress):
            t = time.perf_counter()
            cnn.train_step(s, model, x, y, opt, fused=fused)
            ours_t.append(time.perf_counter() - t)
            theirs_t.extend(peer.steps(1))
    finally:
        peer.close()
        m.close()
    load1 = os.getloadavg()
    info = peer.info
    env = " ".join(f"{k}={v}" for k, v in peer.env.items())
    print(f"\npeer: PyTorch {info['torch']} CPU in a separate process ({info['threads']} threads; "
          f"environment {env}); ours: {args.backend} backend, {args.threads} threads, fast-only, "
          f"{'unfused' if args.unfused else 'fused'} SGD; {model.name} batch {args.batch}, image "
          f"{args.image}; {args.repeats} alternating steps; load average {load0[0]:.2f} before, "
          f"{load1[0]:.2f} after")
    if info.get("thread_line"):
        print(f"  peer {info['thread_line']}")
    ours, theirs = _common.Stat(ours_t), _common.Stat(theirs_t)
    sp = _common.speedups(theirs_t, ours_t)
    print(f"  ours  {ours.fmt(1e3, 'ms/step', 1)}")
    print(f"  torch {theirs.fmt(1e3, 'ms/step', 1)}")
    print(f"  speedup (torch/ours) {sp.fmt(1, 'x', 2)} (> 1: ours is faster)")
    _common.goal(f"cnn {model.name} speedup vs torch", sp.median, 1.2,
                 detail=f"batch {args.batch}, {args.image} px, {args.threads} threads")
    return model.name, ours_t, theirs_t


def plot_peer(path, results):
    """Bar chart of the per-model speedups (torch step time / ours) with their spread."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r[0] for r in results]
    stats = [_common.speedups(r[2], r[1]) for r in results]
    fig, ax = plt.subplots(figsize=(max(4, 1.4 * len(names)), 3.5))
    x = np.arange(len(names))
    med = np.array([st.median for st in stats])
    err = np.array([[st.median - st.lo for st in stats], [st.hi - st.median for st in stats]])
    ax.bar(x, med, yerr=err, capsize=4, color="tab:blue")
    ax.axhline(1.0, color="gray", lw=1, ls="--", label="as fast as torch")
    ax.axhline(1.2, color="tab:green", lw=1, ls=":", label="goal 1.2x")
    ax.set_xticks(x, names)
    ax.set_ylabel("speedup = torch step / our step")
    ax.set_title("CNN training step vs PyTorch (> 1: ours faster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _common.save_plot(fig, path)
    plt.close(fig)


def run_setups(args, model):
    """The setups (and the --sweep) of one model: policy and wall-clock tables, figures."""
    try:
        setups = [cnn.check_setup(x.strip()) for x in args.setup.split(",") if x.strip()]
        if args.ref_iterations < 1:
            raise ValueError(f"--ref-iterations {args.ref_iterations}: measure at least one "
                             "iteration (the default is "
                             f"{cnn.REFERENCE_ITERATIONS}: one warm-up, then medians)")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    need = model.footprint_estimate()
    slow = ca.parse_size(args.slow, "--slow") if args.slow else 3 * need + (64 << 20)
    _check_slow_room(need, slow, tempfile.gettempdir())
    if slow < need:
        raise SystemExit(f"error: {model.name} with batch {args.batch} needs about {_size(need)} "
                         f"per iteration even with all memory slow, but --slow is {_size(slow)}; "
                         "use a larger --slow or a smaller --batch")
    reference, how = reference_times(args)
    footprint = reference.meta["footprint"]
    print(f"kernel times (fast-only): {how}")
    budget, label = _budget(args.fast, footprint)
    cache = ""
    if args.dram_cache is not None and any(s.startswith("2lm") for s in setups):
        size, pct = _budget(args.dram_cache, footprint, "--dram-cache")
        cache = f"; 2LM DRAM cache {_size(size)} ({pct})"
    print(f"measured footprint {_size(footprint)} (estimate {_size(need)}); fast budget {_size(budget)} "
          f"({label}){cache}; slow device {_size(slow)}")
    total = len(setups) * args.iterations + (len(SWEEP) * args.iterations if args.sweep else 0)
    bar = _common.progress(total=total, desc=model.name, disable=args.no_progress)
    rows, logs = [], {}
    main_kind = "vs_torch" if args.peer else "traffic"
    tmp = tempfile.TemporaryDirectory()
    try:
        trainers = []
        try:
            for setup in setups:
                log = os.path.join(tmp.name, f"{setup}.jsonl") if args.plot else None
                trainers.append(make_trainer(args, setup, slow, footprint, log,
                                             reference=reference))
                if log:
                    logs[setup] = log
            all_recs = run_interleaved(trainers, args.iterations, bar)
        finally:
            for tr in trainers:
                tr.close()
        for tr, recs in zip(trainers, all_recs):
            rows.append(_policy_row(tr.setup, tr.budget, recs))
        sweep_rows = []
        if args.sweep:
            for pct in SWEEP:
                tr = make_trainer(args, "LM", slow, footprint, fast=f"{pct}%",
                                  reference=reference)
                try:
                    recs = run_interleaved([tr], args.iterations, bar)[0]
                finally:
                    tr.close()
                r = _policy_row("LM", tr.budget, recs)
                r["pct"] = pct
                sweep_rows.append(r)
        bar.close()
        print_policy_table(rows, args.profile)
        print_wall_table(rows)
        print_targets(rows, footprint)
        if sweep_rows:
            print("\nfast-budget sweep (setup LM, Fig. 4.10):")
            print(f"{'budget':>7} {'bytes':>9} {'slow rd':>9} {'slow wr':>9} {'stall':>9} "
                  f"{'modelled':>10} {'/fast-only':>10} {'wall':>9}")
            for r in sweep_rows:
                print(f"{r['pct']:>6}% {_size(r['budget']):>9} {_size(r['slow_r']):>9} "
                      f"{_size(r['slow_w']):>9} {r['stall'] * 1e3:>7.3f}ms "
                      f"{r['modelled'] * 1e3:>8.3f}ms {r['modelled'] / r['fast_only']:>10.4f} "
                      f"{r['wall'] * 1e3:>7.1f}ms")
        if args.plot:
            p1 = _figure(args, model.name, "occupancy", main_kind)
            p2 = _figure(args, model.name, "traffic", main_kind)
            plot_occupancy(p1, logs)
            plot_traffic(p2, rows)
            print(f"figures: {p1} and {p2}")
        if args.sweep:
            if args.plot:
                p3 = _figure(args, model.name, "sweep", main_kind)
            else:
                os.makedirs(args.outdir, exist_ok=True)
                p3 = os.path.join(args.outdir, f"{model.name}_sweep.png")
            plot_sweep(p3, sweep_rows, sweep_rows[0]["fast_only"])
            print(f"figure: {p3}")
    finally:
        tmp.cleanup()


def memory_need(models, peer=None):
    """Bytes the largest of ``models`` touches in a training iteration (models run one after
    another), twice that with a peer training the same model beside ours."""
    need = max(m.footprint_estimate() for m in models)
    return 2 * need if peer else need


def main(argv=None):
    args = parse_args(argv)
    try:
        models = _model_list(args)
        built = [cnn.build(f, d, batch=args.batch, image=args.image, channels=args.channels,
                           classes=args.classes, width=args.width) for f, d in models]
        if not args.peer_only:
            for x in args.setup.split(","):
                if x.strip():
                    cnn.check_setup(x.strip())
    except ValueError as e:                 # bad --models or --setup: a usage error
        print(f"{_common.SCRIPT}: error: {e}", file=sys.stderr)
        return 2
    short = _common.memory_shortfall(memory_need(built, args.peer),
                                     "--batch, --image, --channels, --classes and --width")
    if short:                               # checked before anything is allocated
        print(f"{_common.SCRIPT}: error: {short}", file=sys.stderr)
        return 2
    _set_threads(args.backend, args.threads)
    print(machine())
    print(_common.thread_line())
    results = []
    for (family, depth), model in zip(models, built):
        args.model, args.depth = family, depth
        print(f"\n{model.name}: batch {args.batch}, {args.image}x{args.image}x{args.channels}, "
              f"{args.classes} classes, width /{args.width:g}, {model.param_count():,} parameters, "
              f"backend {args.backend}, {args.threads} threads, "
              f"{'unfused' if args.unfused else 'fused'} SGD")
        if not args.peer_only:
            print(cnn.FORMULA)
            run_setups(args, model)
        if args.peer == "torch":
            try:
                results.append(peer_torch(args))
            except PeerError as e:
                print(f"{_common.SCRIPT}: error: {e}", file=sys.stderr)
                return 1
    if len(results) > 1:
        print("\nspeedup (torch step time / ours), medians of per-step ratios:")
        for name, ours_t, theirs_t in results:
            print(f"  {name:>12} {_common.speedups(theirs_t, ours_t).fmt(1, 'x', 2)}")
    if results and args.plot:
        plot_peer(_figure(args, "cnn", "vs_torch", "vs_torch"), results)
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
