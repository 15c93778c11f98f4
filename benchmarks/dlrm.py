"""DLRM training: step time by phase, loss and table traffic per table kind and distribution.

``--peer torch`` trains the same model in PyTorch from the same weights and data.

    .venv/bin/python benchmarks/dlrm.py --peer torch --table-kinds simple          # vs PyTorch
    .venv/bin/python benchmarks/dlrm.py --table-kinds static dynamic --plot dlrm.png
    .venv/bin/python benchmarks/dlrm.py --table-kinds dynamic --flush-policy second-chance
    .venv/bin/python benchmarks/dlrm.py --peer torch --table-kinds simple static dynamic --iterations 8

Every iteration trains each table kind (and the peer) on the same batch in turn, so all of them
see the same machine load; times are medians over the iterations after the first (which
compiles and allocates), printed with their spread. ``speedup`` is always the other's step time
over ours (> 1: we are faster). Goals: ``dlrm speedup vs torch (<distribution>)`` (whole step)
for the first of the kinds "simple" or "fast" (the peer keeps its tables in DRAM too); with both
"static" and "dynamic", ``static beats dynamic under uniform`` and ``dynamic beats static under
zipf`` (the dissertation's Fig. 5.12 ordering), judged as a policy figure: the loser's table
traffic (bytes each tier read and wrote in lookups, updates, cache fills and write-backs) at
modelled bandwidths (fast DRAM, slow ``--slow-profile``) over the winner's, paired per
iteration. The measured embedding time is printed beside it; on a machine whose slow memory is
DRAM behind a file mapping a cached row is no faster to read, so there only the traffic differs.

The run ends with predictions at small batches (``--predict-batches``, ``--predict-calls``):
``DLRM.predict`` of the simple-table model, and the peer's forward pass without gradients,
per call (see ``predictions``).

Two OpenMP runtimes share the process (PyTorch's bundled libgomp, and the system one under numba
and oneDNN); both wait passively (see cachedarrays/threads.py) and run on ``--threads``.
"""

from __future__ import annotations

import gc
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import _common  # noqa: E402  (first: sets the OpenMP wait policy before any runtime loads)

import numpy as np  # noqa: E402

import cachedarrays as ca  # noqa: E402
from cachedarrays.models.dlrm import configs  # noqa: E402
from cachedarrays import costmodel  # noqa: E402
from cachedarrays.models.dlrm.embedding import (FLUSH_POLICIES, TABLE_KINDS, TRAFFIC_KEYS,  # noqa: E402
                                                traffic_time)
from cachedarrays.models.dlrm.model import PHASES, DLRM, synthetic_dataset  # noqa: E402

#: Defaults that fit a 2-core, 24 GiB machine in a few minutes.
DEFAULTS = {
    "small": dict(scale=0.05, width_scale=1.0, batch_size=8192),
    "large": dict(scale=0.01, width_scale=0.25, batch_size=4096),
    "table56": dict(scale=0.0005, width_scale=0.125, batch_size=512),
    "tiny": dict(scale=1.0, width_scale=1.0, batch_size=256),
}

#: Goal of the comparison with PyTorch (step time ratio, ours faster).
TORCH_TARGET = 1.5
#: Expected winner per distribution between the static and dynamic caches (Fig. 5.12).
ORDERINGS = {"uniform": ("static", "dynamic"), "zipf": ("dynamic", "static")}


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

    def _lookups(self, batch):
        torch = self.torch
        return [bag(torch.from_numpy(i), torch.from_numpy(o))
                for bag, i, o in zip(self.tables, batch.indices, batch.offsets)]

    def _interaction(self, x, ly):
        """The top MLP's input from the bottom MLP's output x and the lookups ly."""
        torch, cfg = self.torch, self.cfg
        if cfg.interaction == "dot":
            tt = torch.cat([x] + ly, dim=1).view(x.shape[0], -1, cfg.featuresize)
            z = torch.bmm(tt, tt.transpose(1, 2))
            return torch.cat([x, z[:, self.li, self.lj]], dim=1)
        return torch.cat([x] + ly, dim=1)

    def predict(self, batch):
        """Click probabilities (B,) without gradients, as ``DLRM.predict``."""
        torch = self.torch
        with torch.no_grad():
            x = self.bottom(torch.from_numpy(batch.dense))
            r = self._interaction(x, self._lookups(batch))
            return torch.sigmoid(self.top(r)).view(-1).numpy()

    def train_step(self, batch, lr=None):
        """One SGD step; returns the loss. Phases are timed like ours (forward + backward)."""
        torch = self.torch
        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        dense = torch.from_numpy(batch.dense)
        labels = torch.from_numpy(batch.labels)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        x = self.bottom(dense)
        t1 = time.perf_counter()
        ly = self._lookups(batch)
        t2 = time.perf_counter()
        r = self._interaction(x, ly)
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


def _manager_for(cfg, table_kind, cache):
    """Fast memory for MLPs, activations and ("fast" kind) the tables; slow holds the bases."""
    tables = cfg.table_bytes
    dense = 64 * cfg.batch_size * (cfg.interaction_width + (cfg.ntables + 1) * cfg.featuresize
                                   + sum(cfg.bottom) + sum(cfg.top)) * 4
    params = 4 * 4 * sum(a * b for a, b in zip((cfg.dense_features,) + cfg.bottom, cfg.bottom))
    params += 4 * 4 * sum(a * b for a, b in zip((cfg.interaction_width,) + cfg.top, cfg.top))
    fast = dense + params + (2 * tables if table_kind == "fast" else int(tables * (cache + 0.1)) + tables)
    return ca.Manager(fast=max(fast, 64 << 20), slow=max(2 * tables, 64 << 20))


def memory_need(cfg, table_kinds, iterations, cache, peer=None):
    """Bytes a run touches, about: per kind its tables (a slow base and a fast pool of
    ``cache`` + slack of each, or the whole table in fast memory) and dense layers, the
    ``iterations + 1`` batches, and the peer's tables with their sparse gradients."""
    tables = cfg.table_bytes
    # activations, their gradients and temporaries: a few float32 per sample and width
    dense = 4 * cfg.batch_size * (cfg.interaction_width + (cfg.ntables + 1) * cfg.featuresize
                                  + sum(cfg.bottom) + sum(cfg.top)) * 4
    params = 4 * 4 * sum(a * b for a, b in zip((cfg.dense_features,) + cfg.bottom, cfg.bottom))
    params += 4 * 4 * sum(a * b for a, b in zip((cfg.interaction_width,) + cfg.top, cfg.top))
    need = 0
    for kind in table_kinds:
        need += dense + params + 16 * max(cfg.table_sizes)       # update histograms
        need += tables
        if kind in ("static", "dynamic"):
            need += int(tables * min(1.0, cache + 0.05))          # the page pools
    per_batch = cfg.batch_size * (cfg.ntables * (cfg.bag_size + 1) * 8 + cfg.dense_features * 4 + 4)
    need += (iterations + 1) * per_batch
    if peer:
        need += 3 * tables + dense + params                     # its tables, a copy, gradients
    return need


def _timed(step, batch, times):
    t = time.perf_counter()
    loss = step(batch)
    times.append(time.perf_counter() - t)
    return loss


_TRAFFIC = TRAFFIC_KEYS + ("dirty_bytes",)


def _traffic(model):
    s = model.table_stats()
    return {k: s.get(k, 0) for k in _TRAFFIC}


def run(cfg, table_kinds, distribution, iterations, cache, backend, seed, peer=None,
        progress=True, slow_profile="optane", flush_policy="oldest"):
    """Train every kind (and the peer) on the same ``iterations + 1`` batches, in turn per
    batch (``_common.turn_order``); one result dict per kind (``peer_*`` entries on each when a peer ran).
    ``modelled_table_times``: per timed iteration, the tables' traffic in seconds at the
    bandwidths of DRAM and of ``slow_profile`` (``embedding.traffic_time``)."""
    data = synthetic_dataset(cfg, distribution, seed=seed, num_batches=iterations + 1)
    batches = [data.batch(i) for i in range(iterations + 1)]
    managers, models = [], []
    try:
        for kind in table_kinds:
            m = _manager_for(cfg, kind, cache)
            managers.append(m)
            models.append(DLRM(cfg, manager=m, table_kind=kind, cache=cache, backend=backend,
                               seed=seed, flush_policy=flush_policy))
        torch_model = TorchDLRM(cfg, models[0].state_dict()) if peer == "torch" else None
        for m in managers:
            m.reset_stats()
        losses = [[] for _ in models]
        steps = [[] for _ in models]
        traffic = [[_traffic(model)] for model in models]   # table bytes after each step
        peer_losses, peer_steps = [], []
        gc.disable()
        try:
            n = len(models) + (torch_model is not None)
            for i, b in enumerate(_common.progress(batches, total=len(batches),
                                                   desc=f"dlrm {distribution}",
                                                   disable=not progress)):
                for k in _common.turn_order(n, i):
                    if k == len(models):
                        peer_losses.append(_timed(torch_model.train_step, b, peer_steps))
                    else:
                        losses[k].append(_timed(models[k].train_step, b, steps[k]))
                        traffic[k].append(_traffic(models[k]))
        finally:
            gc.enable()
        results = []
        for kind, model, m, loss, step, tr in zip(table_kinds, models, managers, losses, steps,
                                                  traffic):
            tables = [lk + up for lk, up in zip(model.timings["lookup"][1:],
                                                 model.timings["update"][1:])]
            modelled = [traffic_time({k: b[k] - a[k] for k in a}, slow_profile)
                        for a, b in zip(tr[1:], tr[2:])]
            r = dict(table_kind=kind, distribution=distribution, losses=loss[1:],
                     steps=step[1:], table_times=tables, modelled_table_times=modelled,
                     slow_device=(f"a file mapping ({m.slow.path})" if m.slow.path else
                                  "anonymous memory"),
                     phases=model.phase_medians(skip=1),
                     tables=model.table_stats(), manager=m.stats())
            if torch_model is not None:
                r["peer_losses"] = peer_losses[1:]
                r["peer_steps"] = peer_steps[1:]
                r["peer_phases"] = {p: float(np.median(v[1:])) for p, v in
                                    torch_model.timings.items()}
            results.append(r)
        return results
    finally:
        for m in managers:
            m.close()


def _fmt_ms(phases):
    return " ".join(f"{p} {phases[p] * 1e3:7.1f}" for p in PHASES) + " ms"


def _moved(stats):
    return {k: v["bytes"] for k, v in stats["moved"].items()}


def _compared(results):
    """The result compared with the peer: the first of kinds "simple", "fast", else the first."""
    for kind in ("simple", "fast"):
        for r in results:
            if r["table_kind"] == kind:
                return r
    return results[0]


def report(results, dist, peer, slow_profile="optane"):
    """Print one distribution's results and its goals.  The static/dynamic ordering is a policy
    figure: it is judged on the tables' traffic at modelled bandwidths (``traffic_time``), and
    the measured embedding time is printed beside it (here slow memory is DRAM behind a file
    mapping, where a cached row is no faster to read than an uncached one)."""
    for r in results:
        t = r["tables"]
        print(f"\n{r['table_kind']:>7} {dist:>7}: step {_common.Stat(r['steps']).fmt()}")
        print(f"   phases (medians): {_fmt_ms(r['phases'])}")
        print(f"   table hit rate {t['hit_rate']:.3f}; rows cached {t.get('rows_cached', 0):,}, "
              f"flushes {t.get('flushes', 0)}, written back "
              f"{t.get('bytes_written_back', 0) / 2**20:.1f} MiB; slow reads "
              f"{t['slow_read_bytes'] / 2**20:.1f} MiB, slow writes "
              f"{t['slow_write_bytes'] / 2**20:.1f} MiB, fast reads "
              f"{t['fast_read_bytes'] / 2**20:.1f} MiB")
        print(f"   manager moved: {_moved(r['manager'])}")
        print(f"   loss: first {r['losses'][0]:.5f} last {r['losses'][-1]:.5f}")
    if peer:
        r = _compared(results)
        ours, theirs = np.array(r["losses"]), np.array(r["peer_losses"])
        rel = np.max(np.abs(ours - theirs) / np.abs(theirs))
        sp = _common.speedups(r["peer_steps"], r["steps"])
        print(f"\n  {peer:>5} {dist:>7}: step {_common.Stat(r['peer_steps']).fmt()}")
        print(f"   phases (medians; its backward counts as mlp): {_fmt_ms(r['peer_phases'])}")
        print(f"   speedup ({peer}/ours, {r['table_kind']} tables) {sp.fmt(1, 'x')}; max relative "
              f"loss difference {rel:.2e} over {len(ours)} iterations")
        _common.goal(f"dlrm speedup vs {peer} ({dist})", sp.median, TORCH_TARGET,
                     detail=f"{r['table_kind']} tables, step {_common.Stat(r['steps']).fmt()} vs "
                            f"{_common.Stat(r['peer_steps']).fmt()}")
    by_kind = {r["table_kind"]: r for r in results}
    if "static" in by_kind and "dynamic" in by_kind:
        s, d = by_kind["static"], by_kind["dynamic"]
        wall = _common.speedups(d["table_times"], s["table_times"])  # static over dynamic
        steps = _common.speedups(d["steps"], s["steps"])
        print(f"\n  {dist}: measured embedding time (lookup + update) static "
              f"{_common.Stat(s['table_times']).fmt()} (hit rate {s['tables']['hit_rate']:.3f}) vs "
              f"dynamic {_common.Stat(d['table_times']).fmt()} (hit rate "
              f"{d['tables']['hit_rate']:.3f}); static speedup over dynamic {wall.fmt(1, 'x', 3)}"
              f" (whole step {steps.fmt(1, 'x', 3)}); slow memory here: {s['slow_device']}")
        sm, dm = s["modelled_table_times"], d["modelled_table_times"]
        ratio = _common.speedups(dm, sm)                              # static over dynamic
        winner = "static" if ratio.median >= 1 else "dynamic"
        print(f"  {dist}: {winner} tables win on modelled table traffic (fast DRAM, slow "
              f"{slow_profile}): static {_common.Stat(sm).fmt()} vs dynamic "
              f"{_common.Stat(dm).fmt()}; static speedup over dynamic {ratio.fmt(1, 'x', 3)}")
        if dist in ORDERINGS:
            win, lose = ORDERINGS[dist]
            value = (ratio if win == "static" else _common.speedups(sm, dm)).median
            _common.goal(f"{win} beats {lose} under {dist}", value, 1.0,
                         detail=f"{lose} / {win} modelled table traffic time per iteration "
                                f"(median of per-iteration ratios)")


def plot(results, path, peer=None, slow_profile="optane"):
    """Per distribution: step time per table kind (and the peer), the kinds' measured
    embedding time (lookup + update, where they differ), their modelled table traffic (the
    Fig. 5.12 orderings) and their hit rates."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = list(dict.fromkeys(r["distribution"] for r in results))
    kinds = list(dict.fromkeys(r["table_kind"] for r in results))
    x = np.arange(len(dists))
    fig, (ax, ex, mx, hx) = plt.subplots(1, 4, figsize=(20, 4))

    def bars(axis, names, samples_of, title, ylabel):
        width = 0.8 / len(names)
        for n, name in enumerate(names):
            stats = [_common.Stat(samples_of(name, d)) for d in dists]
            meds = [st.median * 1e3 for st in stats]
            err = [[(st.median - st.lo) * 1e3 for st in stats],
                   [(st.hi - st.median) * 1e3 for st in stats]]
            axis.bar(x + (n - (len(names) - 1) / 2) * width, meds, width, yerr=err, capsize=3,
                     label=name)
        axis.set_xticks(x, [f"{d} indices" for d in dists])
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.legend()

    def row(kind, dist):
        return next(r for r in results if r["distribution"] == dist and r["table_kind"] == kind)

    def steps(name, dist):
        if name == peer:
            return _compared([r for r in results if r["distribution"] == dist])["peer_steps"]
        return row(name, dist)["steps"]

    bars(ax, kinds + ([peer] if peer else []), steps, "DLRM training step",
         "step time, ms (median, min-max)")
    bars(ex, kinds, lambda k, d: row(k, d)["table_times"],
         "Embedding tables (lookup + update), measured", "ms per step (median, min-max)")
    bars(mx, kinds, lambda k, d: row(k, d)["modelled_table_times"],
         f"Table traffic, modelled (DRAM + {slow_profile})", "ms per step (median, min-max)")
    width = 0.8 / len(kinds)
    for n, kind in enumerate(kinds):
        hx.bar(x + (n - (len(kinds) - 1) / 2) * width,
               [row(kind, d)["tables"]["hit_rate"] for d in dists], width, label=kind)
    hx.set_xticks(x, [f"{d} indices" for d in dists])
    hx.set_ylabel("hit rate (lookups served from fast memory)")
    hx.set_ylim(0, 1)
    hx.set_title("Embedding cache hit rate")
    hx.legend()
    fig.tight_layout()
    _common.save_plot(fig, path)
    plt.close(fig)


def predictions(cfg, sizes, calls, backend, seed, peer, bar):
    """Per-call prediction time (``DLRM.predict``, SimpleTables) at the small batch sizes
    ``sizes``, against the peer's forward pass without gradients when a peer is given: each
    call a fresh batch, the implementations in turn (``_common.turn_order``). Such calls are
    mostly fixed costs (Python around 26 tables, kernels too small to share between threads:
    they run on the calling thread)."""
    print(f"\npredictions (simple tables; medians of {calls} calls, each a fresh batch"
          f"{', speedups paired per call' if peer else ''})")
    for size in sizes:
        c = cfg.with_(batch_size=size)
        data = synthetic_dataset(c, "uniform", seed=seed, num_batches=calls + 1)
        with _manager_for(c, "simple", 0.0) as m:
            model = DLRM(c, manager=m, table_kind="simple", backend=backend, seed=seed)
            impls = [model.predict]
            if peer == "torch":
                impls.append(TorchDLRM(c, model.state_dict()).predict)
            times = [[] for _ in impls]
            worst = 0.0
            gc.disable()
            try:
                for i in range(calls + 1):
                    b = data.batch(i)
                    got = []
                    for k in _common.turn_order(len(impls), i):
                        t = time.perf_counter()
                        got.append((k, impls[k](b)))
                        if i:                           # the first call compiles and allocates
                            times[k].append(time.perf_counter() - t)
                    if len(got) > 1:
                        (_, a), (_, z) = got
                        worst = max(worst, float(np.max(np.abs(a - z))))
            finally:
                gc.enable()
        line = f"  batch {size:>5}: ours {_common.Stat(times[0]).fmt(1e6, 'us', 0)}"
        if len(impls) > 1:
            sp = _common.speedups(times[1], times[0])
            line += (f", {peer} {_common.Stat(times[1]).fmt(1e6, 'us', 0)}, speedup "
                     f"{sp.fmt(1, 'x')}; max |ours - {peer}| {worst:.1e}")
            print(line)
            _common.headline(f"dlrm predict speedup vs {peer}, batch {size}", sp.median,
                             detail=f"ours {_common.Stat(times[0]).median * 1e6:.0f} us, {peer} "
                                    f"{_common.Stat(times[1]).median * 1e6:.0f} us")
        else:
            print(line)
        if bar is not None:
            bar.update(1)


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--config", default="small", choices=sorted(configs.CONFIGS),
                   help="model shapes (dissertation Table 5.5/5.6, or tiny)")
    p.add_argument("--scale", type=_common.positive, default=None,
                   help="table rows multiplier (default per config: "
                        + ", ".join(f"{k} {v['scale']}" for k, v in DEFAULTS.items()) + ")")
    p.add_argument("--width-scale", type=_common.positive, default=None,
                   help="hidden MLP width multiplier (default per config: "
                        + ", ".join(f"{k} {v['width_scale']}" for k, v in DEFAULTS.items()) + ")")
    p.add_argument("--batch-size", type=_common.whole(), default=None,
                   help="samples per step (default per config: "
                        + ", ".join(f"{k} {v['batch_size']}" for k, v in DEFAULTS.items()) + ")")
    p.add_argument("--iterations", type=_common.whole(), default=20,
                   help="timed training steps per kind and distribution (after one untimed warm-up step)")
    p.add_argument("--table-kinds", nargs="+",
                   action=_common.Unique, default=["simple", "static", "dynamic"],
                   choices=list(TABLE_KINDS), help="embedding table kinds to train")
    p.add_argument("--distributions", nargs="+",
                   action=_common.Unique, default=["uniform", "zipf"],
                   choices=["uniform", "zipf"], help="index distributions")
    p.add_argument("--cache", type=_common.fraction(), default=0.25,
                   help="cached tables' cachelower as a fraction of each table")
    p.add_argument("--flush-policy", default="oldest", choices=list(FLUSH_POLICIES),
                   help="what the dynamic tables' flush keeps: the newest pages (oldest "
                        "dropped first) or, with second-chance, also the rows looked up since "
                        "they were cached")
    p.add_argument("--backend", default="onednn", choices=["onednn", "numpy"],
                   help="dense-layer backend of our MLPs")
    p.add_argument("--lr", type=_common.positive, default=None,
                   help="learning rate (default: the config's)")
    p.add_argument("--seed", type=_common.whole(0), default=0, help="weights and data seed")
    p.add_argument("--peer", choices=["torch"], default=None,
                   help="also train the same model in this framework, interleaved")
    p.add_argument("--slow-profile", default="optane", choices=sorted(costmodel.PROFILES),
                   help="device profile of slow memory for the modelled table traffic")
    p.add_argument("--predict-batches", type=_common.whole(), nargs="*", action=_common.Unique,
                   default=[1, 16], help="batch sizes of the prediction-time section (none: "
                                         "skip it)")
    p.add_argument("--predict-calls", type=_common.whole(), default=60,
                   help="timed predictions per batch size")
    _common.add_standard(p)
    args = p.parse_args(argv)
    if args.iterations < 3:
        p.error("--iterations must be at least 3 (medians of >= 3 samples)")
    if args.predict_calls < 3:
        p.error("--predict-calls must be at least 3 (medians of >= 3 samples)")
    d = dict(DEFAULTS[args.config])
    for key in ("scale", "width_scale", "batch_size"):
        if getattr(args, key) is not None:
            d[key] = getattr(args, key)
    cfg = configs.get_config(args.config, **d)
    if args.lr is not None:
        cfg = cfg.with_(lr=args.lr)
    _common.check_memory(p, memory_need(cfg, args.table_kinds, args.iterations, args.cache,
                                        args.peer),
                         "--scale, --width-scale, --batch-size, --iterations and --table-kinds")
    if args.peer:
        _common.check_peer(p, args.peer)
    if args.peer == "torch":
        import torch  # noqa: F401  (loaded before the thread limit so it applies to its pool)
    _common.apply_threads(args.threads)
    print(_common.machine())
    print(_common.thread_line())
    print(f"backend {args.backend}; config {cfg.name} scale {d['scale']} width_scale "
          f"{d['width_scale']}: {cfg.ntables} tables, {sum(cfg.table_sizes):,} rows, fs "
          f"{cfg.featuresize}, {cfg.table_bytes / 2**20:.0f} MiB of tables, bottom {cfg.bottom}, "
          f"top {cfg.top}, batch {cfg.batch_size}, {cfg.bag_size} lookups per table, lr {cfg.lr}; "
          f"cached tables: cachelower {args.cache:.0%}, flush policy {args.flush_policy}")
    print(f"step times: medians [min-max, n] over {args.iterations} iterations (one more runs first, "
          f"with JIT and allocation, and is dropped); every kind{' and the peer' if args.peer else ''}"
          f" trains on each batch in turn")
    results = []
    for dist in args.distributions:
        rs = run(cfg, args.table_kinds, dist, args.iterations, args.cache, args.backend,
                 args.seed, args.peer, progress=not args.no_progress,
                 slow_profile=args.slow_profile, flush_policy=args.flush_policy)
        report(rs, dist, args.peer, args.slow_profile)
        results.extend(rs)
    if args.predict_batches:
        with _common.progress(total=len(args.predict_batches), desc="dlrm predictions",
                              disable=args.no_progress) as bar:
            predictions(cfg, args.predict_batches, args.predict_calls, args.backend, args.seed,
                        args.peer, bar)
    if args.plot:
        plot(results, args.plot, args.peer, args.slow_profile)
    return results


if __name__ == "__main__":
    sys.exit(_common.run(main))
