"""DLRM training: iteration time by phase, loss and bytes moved per table kind and index
distribution; ``--peer torch`` trains the same model in PyTorch from the same weights and data.

    .venv/bin/python benchmarks/dlrm.py --config small --scale 0.05 --iterations 20 --peer torch
    .venv/bin/python benchmarks/dlrm.py --config table56 --table-kinds simple static dynamic --plot out.png

Two OpenMP runtimes share this process (torch's bundled libgomp, and the system libgomp that
numba and oneDNN use). With the default active waiting, the idle runtime's threads spin on the
two cores while the other one works, slowing both (worst on a loaded machine), so the script
sets ``OMP_WAIT_POLICY=PASSIVE`` before either loads unless the caller set it: both sides then
run under the same, reproducible rule. The report prints OMP_WAIT_POLICY and the load average.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _common import interleaved, machine  # noqa: E402

import numpy as np  # noqa: E402

import cachedarrays as ca  # noqa: E402
from cachedarrays.models.dlrm import configs  # noqa: E402
from cachedarrays.models.dlrm.embedding import TABLE_KINDS  # noqa: E402
from cachedarrays.models.dlrm.model import PHASES, DLRM, synthetic_dataset  # noqa: E402

#: Defaults that fit a 2-core, 24 GiB machine in a few minutes.
DEFAULTS = {
    "small": dict(scale=0.05, width_scale=1.0, batch_size=8192),
    "large": dict(scale=0.01, width_scale=0.25, batch_size=4096),
    "table56": dict(scale=0.0005, width_scale=0.125, batch_size=512),
    "tiny": dict(scale=1.0, width_scale=1.0, batch_size=256),
}


class TorchDLRM:
    """The same DLRM in PyTorch (EmbeddingBag sum + sparse SGD, bmm dot interaction, BCELoss)."""

    def __init__(self, cfg, state):
        import torch
        from torch import nn

        self.torch, self.cfg = torch, cfg

        def mlp(prefix, n, last_relu):
            layers = []
            for i in range(n):
                w = torch.from_numpy(state[f"{prefix}.{i}.weight"].copy())
                lin = nn.Linear(w.shape[1], w.shape[0])
                with torch.no_grad():
                    lin.weight.copy_(w)
                    lin.bias.copy_(torch.from_numpy(state[f"{prefix}.{i}.bias"]))
                layers.append(lin)
                if i < n - 1 or last_relu:
                    layers.append(nn.ReLU())
            return nn.Sequential(*layers)

        self.bottom = mlp("bottom", len(cfg.bottom), True)
        self.top = mlp("top", len(cfg.top), False)
        self.tables = nn.ModuleList()
        for t, n in enumerate(cfg.table_sizes):
            bag = nn.EmbeddingBag(n, cfg.featuresize, mode="sum", sparse=True)
            with torch.no_grad():
                bag.weight.copy_(torch.from_numpy(state[f"emb.{t}"]))
            self.tables.append(bag)
        f = cfg.ntables + 1
        self.li = torch.tensor([i for i in range(f) for j in range(i)])
        self.lj = torch.tensor([j for i in range(f) for j in range(i)])
        self.params = (list(self.bottom.parameters()) + list(self.top.parameters())
                       + list(self.tables.parameters()))
        self.opt = torch.optim.SGD(self.params, lr=cfg.lr)
        self.loss_fn = nn.BCELoss()
        self.timings = {p: [] for p in PHASES}

    def train_step(self, batch, lr=None):
        """One SGD step; returns the loss. Phases are timed like ours (forward + backward)."""
        torch, cfg = self.torch, self.cfg
        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        dense = torch.from_numpy(batch.dense)
        labels = torch.from_numpy(batch.labels)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        x = self.bottom(dense)
        t1 = time.perf_counter()
        ly = [bag(torch.from_numpy(i), torch.from_numpy(o))
              for bag, i, o in zip(self.tables, batch.indices, batch.offsets)]
        t2 = time.perf_counter()
        if cfg.interaction == "dot":
            tt = torch.cat([x] + ly, dim=1).view(x.shape[0], -1, cfg.featuresize)
            z = torch.bmm(tt, tt.transpose(1, 2))
            r = torch.cat([x, z[:, self.li, self.lj]], dim=1)
        else:
            r = torch.cat([x] + ly, dim=1)
        t3 = time.perf_counter()
        p = torch.sigmoid(self.top(r)).view(-1)
        loss = self.loss_fn(p, labels)
        loss.backward()
        t4 = time.perf_counter()
        self.opt.step()
        t5 = time.perf_counter()
        # PyTorch's backward runs all phases in one call: forward phases are timed apart,
        # backward and the optimizer step (dense and sparse) are reported as mlp and update.
        self.timings["mlp"].append((t1 - t0) + (t4 - t3))
        self.timings["lookup"].append(t2 - t1)
        self.timings["interaction"].append(t3 - t2)
        self.timings["update"].append(t5 - t4)
        return float(loss.item())


def _set_threads(n):
    import numba
    numba.set_num_threads(n)
    try:
        from cachedarrays.models.backend import onednn
        onednn.set_threads(n)
    except ImportError:
        pass
    try:
        import torch
        torch.set_num_threads(n)
    except ImportError:
        pass


def _manager_for(cfg, table_kind, cache):
    """Fast memory for MLPs, activations and ("fast" kind) the tables; slow holds the bases."""
    tables = cfg.table_bytes
    dense = 64 * cfg.batch_size * (cfg.interaction_width + (cfg.ntables + 1) * cfg.featuresize
                                   + sum(cfg.bottom) + sum(cfg.top)) * 4
    params = 4 * 4 * sum(a * b for a, b in zip((cfg.dense_features,) + cfg.bottom, cfg.bottom))
    params += 4 * 4 * sum(a * b for a, b in zip((cfg.interaction_width,) + cfg.top, cfg.top))
    fast = dense + params + (2 * tables if table_kind == "fast" else int(tables * (cache + 0.1)) + tables)
    return ca.Manager(fast=max(fast, 64 << 20), slow=max(2 * tables, 64 << 20))


def run(cfg, table_kind, distribution, iterations, cache, backend, seed, peer=None):
    with _manager_for(cfg, table_kind, cache) as m:
        model = DLRM(cfg, manager=m, table_kind=table_kind, cache=cache, backend=backend, seed=seed)
        data = synthetic_dataset(cfg, distribution, seed=seed, num_batches=iterations + 1)
        batches = [data.batch(i) for i in range(iterations + 1)]
        torch_model = TorchDLRM(cfg, model.state_dict()) if peer == "torch" else None
        m.reset_stats()
        ours, theirs = [], []
        gc.disable()
        try:
            for b in batches:                 # interleaved: ours, then the peer, per iteration
                ours.append(model.train_step(b))
                if torch_model is not None:
                    theirs.append(torch_model.train_step(b))
        finally:
            gc.enable()
        result = dict(table_kind=table_kind, distribution=distribution, losses=ours[1:],
                      phases=model.phase_medians(skip=1), tables=model.table_stats(),
                      manager=m.stats())
        if torch_model is not None:
            result["peer_losses"] = theirs[1:]
            result["peer_phases"] = {p: float(np.median(v[1:])) for p, v in
                                     torch_model.timings.items()}
        return result


def _fmt_ms(phases):
    total = sum(phases.values())
    return " ".join(f"{p} {phases[p] * 1e3:7.1f}" for p in PHASES) + f" | total {total * 1e3:7.1f} ms"


def _moved(stats):
    return {k: v["bytes"] for k, v in stats["moved"].items()}


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = sorted({r["distribution"] for r in results})
    fig, axes = plt.subplots(1, len(dists), figsize=(5 * len(dists), 4), squeeze=False)
    for ax, dist in zip(axes[0], dists):
        rows = [r for r in results if r["distribution"] == dist]
        labels = [r["table_kind"] for r in rows]
        bottom = np.zeros(len(rows))
        for phase, label in (("lookup", "Lookup"), ("update", "Update"), ("compute", "Computation")):
            vals = np.array([(r["phases"]["mlp"] + r["phases"]["interaction"]) if phase == "compute"
                             else r["phases"][phase] for r in rows]) * 1e3
            ax.bar(labels, vals, bottom=bottom, label=label)
            bottom += vals
        ax.set_title(f"{dist} indices")
        ax.set_ylabel("ms per iteration")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small", choices=sorted(configs.CONFIGS))
    ap.add_argument("--scale", type=float, default=None, help="table rows multiplier")
    ap.add_argument("--width-scale", type=float, default=None, help="hidden MLP width multiplier")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--table-kinds", nargs="+", default=["simple", "static", "dynamic"],
                    choices=list(TABLE_KINDS))
    ap.add_argument("--distributions", nargs="+", default=["uniform", "zipf"],
                    choices=["uniform", "zipf"])
    ap.add_argument("--cache", type=float, default=0.25, help="cachelower as a table fraction")
    ap.add_argument("--backend", default="onednn", choices=["onednn", "numpy"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer", choices=["torch"], default=None)
    ap.add_argument("--plot", metavar="PNG", default=None)
    args = ap.parse_args(argv)

    _set_threads(args.threads)
    d = dict(DEFAULTS[args.config])
    for key in ("scale", "width_scale", "batch_size"):
        if getattr(args, key) is not None:
            d[key] = getattr(args, key)
    cfg = configs.get_config(args.config, **d)
    if args.lr is not None:
        cfg = cfg.with_(lr=args.lr)
    print(machine() + f", OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"threads: {args.threads} (numba, oneDNN{', torch' if args.peer else ''}); "
          f"backend {args.backend}; config {cfg.name} scale {d['scale']} width_scale "
          f"{d['width_scale']}: {cfg.ntables} tables, {sum(cfg.table_sizes):,} rows, fs "
          f"{cfg.featuresize}, {cfg.table_bytes / 2**20:.0f} MiB of tables, bottom {cfg.bottom}, "
          f"top {cfg.top}, batch {cfg.batch_size}, {cfg.bag_size} lookups per table, lr {cfg.lr}")
    print(f"medians over {args.iterations} iterations (the first, with JIT and allocation, is "
          f"dropped); ours and the peer alternate iteration by iteration")
    results = []
    for dist in args.distributions:
        for table_kind in args.table_kinds:
            r = run(cfg, table_kind, dist, args.iterations, args.cache, args.backend, args.seed,
                    args.peer)
            results.append(r)
            t = r["tables"]
            print(f"\n{table_kind:>7} {dist:>7}: {_fmt_ms(r['phases'])}")
            print(f"   table hit rate {t['hit_rate']:.3f}; rows cached {t.get('rows_cached', 0):,}, "
                  f"flushes {t.get('flushes', 0)}, written back "
                  f"{t.get('bytes_written_back', 0) / 2**20:.1f} MiB; slow reads "
                  f"{t['slow_read_bytes'] / 2**20:.1f} MiB, slow writes "
                  f"{t['slow_write_bytes'] / 2**20:.1f} MiB, fast reads "
                  f"{t['fast_read_bytes'] / 2**20:.1f} MiB")
            print(f"   manager moved: {_moved(r['manager'])}")
            print(f"   loss: first {r['losses'][0]:.5f} last {r['losses'][-1]:.5f}")
            if "peer_losses" in r:
                ours, theirs = np.array(r["losses"]), np.array(r["peer_losses"])
                rel = np.max(np.abs(ours - theirs) / np.abs(theirs))
                tp, to = sum(r["peer_phases"].values()), sum(r["phases"].values())
                print(f"   torch : {_fmt_ms(r['peer_phases'])}")
                print(f"   time ratio torch/ours {tp / to:.2f}x; max relative loss difference "
                      f"{rel:.2e} over {len(ours)} iterations")
                print("   loss curves (ours | torch): " + ", ".join(
                    f"{a:.5f}|{b:.5f}" for a, b in zip(ours, theirs)))
    if args.plot:
        plot(results, args.plot)
        print(f"\nwrote {args.plot}")
    return results


if __name__ == "__main__":
    main()
