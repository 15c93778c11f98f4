"""G10 against on-demand unified memory and FlashNeuron on the saved CNN traces (modelled).

Three tiers: DRAM (fast, the paper's GPU memory), a middle tier (Optane profile; the paper's
host memory) and an SSD ("nvme-ssd": 3.2/3.0 GB/s, 20 us); every policy runs kernels in fast
memory and each on-demand fetch costs FAULT seconds. Figures: the fraction of ideal (fast-only
time / modelled last-step time) per model and policy, sweeps of the middle tier's capacity and
of the SSD's bandwidth, and bytes written to the SSD per step. Each function returns
(printable lines, dict of figures); the numbers are a pure function of the traces.
"""

import importlib.util
import os

import cachedarrays as ca
from cachedarrays import costmodel


def _common():
    """benchmarks/_common.py, wherever this file was loaded from."""
    spec = importlib.util.spec_from_file_location(
        "_g10_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "_common.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MODELS = ("resnet50", "vgg16", "densenet121")
POLICIES = (("G10", "g10"), ("BaseUVM", "uvm"), ("FlashNeuron", "flashneuron"))
FAULT = 45e-6
FAST = 0.25                       # fast budget, fraction of the footprint ...
FAST_AT_LEAST = {"vgg16": 0.6}    # ... except where the largest kernel needs more (VGG-16's
#   FC update: 128 MiB of operands, 43% of its footprint: no policy can stage it at 25%)
MIDDLE = 0.25                     # default middle-tier capacity, fraction of the footprint
MIDDLE_SWEEP = (0.0, 0.125, 0.25, 0.5, 1.0)
SSD_SWEEP = (3.2, 6.4, 12.8, 25.6, 32.0)
TRACES = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".traces")


def load(name, folder=TRACES):
    return ca.Trace.load(os.path.join(folder, f"{name}.trace.gz"))


def ssd_profile(read_gbps=3.2):
    """The nvme-ssd profile at another read bandwidth (write scaled the same way)."""
    base = costmodel.PROFILES["nvme-ssd"]
    f = read_gbps / base.read_gbps
    return costmodel.Profile(f"nvme-ssd-{read_gbps:g}", read_gbps, base.write_gbps * f,
                             base.latency)


def fast_fraction(name):
    return max(FAST, FAST_AT_LEAST.get(name, 0.0))


def tiers(name, middle=MIDDLE, ssd=None):
    """Tier specs for ca.replay (sizes as fractions of the footprint; middle 0: no middle)."""
    out = [("dram", fast_fraction(name), None, "dram")]
    if middle > 0:
        out.append(("pmem", middle, None, "optane"))
    out.append(("ssd", 4.0, None, ssd or "nvme-ssd"))
    return out


def run(trace, name, policy, middle=MIDDLE, ssd=None):
    """(fraction of ideal, bytes written to the SSD per step, faults) of the last step."""
    try:
        r = ca.replay(trace, policy, tiers=tiers(name, middle, ssd), fault_latency=FAULT)
    except ca.OutOfMemoryError:       # a kernel's operands could not be staged: no figure
        return float("nan"), 0, -1
    last = r.last
    ssd_w = sum(v for k, v in last.moved.items() if k.endswith("->ssd"))
    return r.fast_only / last.time, ssd_w, last.faults


def main_figure(traces):
    """(a) and (d): fraction of ideal and SSD bytes written per step, per model and policy."""
    lines = [f"G10 vs baselines: fast {FAST:.0%} of the footprint (VGG-16 60%), middle "
             f"{MIDDLE:.0%} (optane), SSD nvme-ssd, fault {FAULT * 1e6:.0f} us",
             f"{'model':12s} " + " ".join(f"{lab:>22s}" for lab, _ in POLICIES)]
    fig = {}
    for name, t in traces.items():
        row = {}
        for lab, pol in POLICIES:
            frac, w, faults = run(t, name, pol)
            row[lab] = {"ideal": frac, "ssd_written": w, "faults": faults}
        fig[name] = row
        lines.append(f"{name:12s} " + " ".join(
            f"{row[lab]['ideal']:6.1%} {row[lab]['ssd_written'] / 2**20:7.1f}MiB {row[lab]['faults']:4d}f"
            for lab, _ in POLICIES))
    mean = {lab: sum(fig[n][lab]["ideal"] for n in fig) / len(fig) for lab, _ in POLICIES}
    lines.append("mean fraction of ideal: " + ", ".join(f"{lab} {v:.1%}" for lab, v in mean.items())
                 + " (paper: G10 90.3%)")
    ok = mean["G10"] >= 0.9 and all(mean["G10"] > mean[lab] for lab, _ in POLICIES[1:])
    lines.append(f"target G10 >= 90% of ideal and above both baselines: {'PASS' if ok else 'FAIL'}")
    fig["mean"] = mean
    return lines, fig


def _sweep(traces, points, title, option):
    """Fraction of ideal of every model and policy at each point (option(p): run's keywords)."""
    lines = [title]
    fig = {}
    for name, t in traces.items():
        fig[name] = {lab: [run(t, name, pol, **option(p))[0] for p in points]
                     for lab, pol in POLICIES}
        for lab, _ in POLICIES:
            lines.append(f"  {name:12s} {lab:12s} " + " ".join(
                f"{p:g}:{v:.1%}" for p, v in zip(points, fig[name][lab])))
    fig["points"] = list(points)
    return lines, fig


def middle_sweep(traces, points=MIDDLE_SWEEP):
    """(b): fraction of ideal against the middle tier's capacity (fraction of footprint)."""
    return _sweep(traces, points, "middle-tier capacity sweep (fraction of footprint -> "
                  "fraction of ideal)", lambda p: {"middle": p})


def ssd_sweep(traces, points=SSD_SWEEP):
    """(c): fraction of ideal against the SSD's read bandwidth (GB/s; write scaled alike)."""
    return _sweep(traces, points, "SSD bandwidth sweep (GB/s -> fraction of ideal)",
                  lambda p: {"ssd": ssd_profile(p)})


def plot(path, middle, ssd):
    """(e): the two sweeps side by side, one line per model and policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, data, xl in ((axes[0], middle, "middle tier capacity (fraction of footprint)"),
                         (axes[1], ssd, "SSD read bandwidth (GB/s)")):
        xs = data["points"]
        for name, row in data.items():
            if name == "points":
                continue
            for lab, ys in row.items():
                ax.plot(xs, ys, marker="o", label=f"{name} {lab}")
        ax.set_xlabel(xl)
        ax.set_ylabel("fraction of ideal")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    _common().save_plot(fig, path, dpi=120, tight=False, announce=False)
    plt.close(fig)
    return path


def main(models=MODELS, folder=TRACES, plot_path=None, out=print):
    traces = {n: load(n, folder) for n in models}
    figs = {}
    for key, fn in (("main", main_figure), ("middle", middle_sweep), ("ssd", ssd_sweep)):
        lines, figs[key] = fn(traces)
        for line in lines:
            out(line)
    if plot_path:
        out(f"plot: {plot(plot_path, figs['middle'], figs['ssd'])}")
    return figs


if __name__ == "__main__":
    import sys
    main(plot_path=sys.argv[1] if len(sys.argv) > 1 else None)
