"""Kernel timings at ResNet-like shapes: oneDNN backend (ours) vs PyTorch CPU, NumPy reference.

Each repetition runs every implementation of an op once, interleaved; the table gives each
median with its spread (min-max over the repetitions) and speedup = torch time / oneDNN time
(> 1: ours is faster), the median of the per-repetition ratios. Ours and PyTorch run in one
process under the same thread settings (printed at the top), with OpenMP threads waiting
passively (OMP_WAIT_POLICY=PASSIVE unless set).

    python benchmarks/kernels.py [--threads N] [--reps R] [--batch B] [--ops conv3x3_fwd,relu_fwd]
"""

from __future__ import annotations

import sys

import _common  # noqa: F401  (first: sets OMP_WAIT_POLICY before any OpenMP runtime starts)

OPS = ("conv3x3_fwd", "conv3x3_bwd_data", "conv3x3_bwd_weights", "batchnorm_fwd", "batchnorm_bwd",
       "relu_fwd", "relu_bwd", "add", "maxpool_fwd", "maxpool_bwd", "global_avgpool_fwd",
       "dense_fwd", "dense_bwd_data", "dense_bwd_weights", "softmax_ce")


def parse_args(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--reps", type=_common.whole(), default=7,
                   help="interleaved repetitions per op (>= 3)")
    p.add_argument("--batch", type=_common.whole(), default=16, help="batch size of every tensor")
    p.add_argument("--ops", default="", help="comma-separated subset of op names "
                   f"({', '.join(OPS)}); empty: all")
    p.add_argument("--no-numpy", action="store_true", help="skip the (slow) NumPy reference")
    _common.add_standard(p)
    args = p.parse_args(argv)
    if args.reps < 3:
        p.error("--reps must be >= 3 (medians of at least 3 samples)")
    args.ops = ",".join(dict.fromkeys(o.strip() for o in args.ops.split(",") if o.strip()))
    unknown = [o for o in args.ops.split(",") if o and o not in OPS]
    if unknown:
        p.error(f"unknown op(s) {', '.join(unknown)}; valid ops: {', '.join(OPS)}")
    return args


ARGS = parse_args() if __name__ == "__main__" else None

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cachedarrays.models.backend import get_backend  # noqa: E402

if ARGS is not None:       # every pool (BLAS, OpenMP, numba, torch) on the same thread count
    _common.apply_threads(ARGS.threads)


def build_cases(batch: int, rng):
    """op name -> dict(numpy=..., onednn=..., torch=...) of zero-argument callables."""
    import torch
    import torch.nn.functional as F

    aten = torch.ops.aten
    f32 = np.float32
    r = lambda *s: rng.standard_normal(s).astype(f32)  # noqa: E731
    t = torch.from_numpy
    cases = {}

    def both(name, make, torch_call):
        cases[name] = {"numpy": make("numpy"), "onednn": make("onednn"), "torch": torch_call}

    # conv 3x3, 64 -> 64 channels, 56x56 (ResNet stage 1)
    x, w, dy = r(batch, 64, 56, 56), r(64, 64, 3, 3), r(batch, 64, 56, 56)
    out, dx, dw, db = np.empty_like(dy), np.empty_like(x), np.empty_like(w), np.empty(64, f32)
    tx, tw, tdy = t(x), t(w), t(dy)
    both("conv3x3_fwd", lambda b: lambda: get_backend(b).conv2d_forward(x, w, None, 1, 1, out),
         lambda: F.conv2d(tx, tw, None, 1, 1))
    both("conv3x3_bwd_data", lambda b: lambda: get_backend(b).conv2d_backward_data(dy, w, 1, 1, dx),
         lambda: aten.convolution_backward(tdy, tx, tw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                           [True, False, False]))
    both("conv3x3_bwd_weights", lambda b: lambda: get_backend(b).conv2d_backward_weights(x, dy, 1, 1, dw, db),
         lambda: aten.convolution_backward(tdy, tx, tw, [64], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                           [False, True, True]))

    # batch norm, relu, residual add on the same activation
    g, beta = r(64), r(64)
    mean, var, dg, dbeta = (np.empty(64, f32) for _ in range(4))
    tg, tbeta = t(g), t(beta)
    both("batchnorm_fwd", lambda b: lambda: get_backend(b).batchnorm_forward(x, g, beta, 1e-5, out, mean, var),
         lambda: aten.native_batch_norm(tx, tg, tbeta, None, None, True, 0.1, 1e-5))
    get_backend("numpy").batchnorm_forward(x, g, beta, 1e-5, out, mean, var)
    tmean, tinv = t(mean.copy()), t((1 / np.sqrt(var + 1e-5)).astype(f32))
    both("batchnorm_bwd",
         lambda b: lambda: get_backend(b).batchnorm_backward(dy, x, g, mean, var, 1e-5, dx, dg, dbeta),
         lambda: aten.native_batch_norm_backward(tdy, tx, tg, None, None, tmean, tinv, True, 1e-5,
                                                 [True, True, True]))
    both("relu_fwd", lambda b: lambda: get_backend(b).relu_forward(x, out), lambda: F.relu(tx))
    both("relu_bwd", lambda b: lambda: get_backend(b).relu_backward(dy, x, dx),
         lambda: aten.threshold_backward(tdy, tx, 0))
    both("add", lambda b: lambda: get_backend(b).add(x, dy, out), lambda: torch.add(tx, tdy))

    # 3x3/2 max pool (ResNet stem, on the 56x56 activation to keep memory small)
    pshape = (batch, 64, 28, 28)
    pout, pdy = np.empty(pshape, f32), r(*pshape)
    states = {b: get_backend(b).maxpool_forward(x, 3, 2, 1, pout) for b in ("numpy", "onednn")}
    _, tidx = F.max_pool2d(tx, 3, 2, 1, return_indices=True)
    tpdy = t(pdy)
    both("maxpool_fwd", lambda b: lambda: get_backend(b).maxpool_forward(x, 3, 2, 1, pout, state=states[b]),
         lambda: F.max_pool2d(tx, 3, 2, 1, return_indices=True))
    both("maxpool_bwd", lambda b: lambda: get_backend(b).maxpool_backward(pdy, x, states[b], 3, 2, 1, dx),
         lambda: aten.max_pool2d_with_indices_backward(tpdy, tx, [3, 3], [2, 2], [1, 1], [1, 1], False, tidx))

    # global average pool 512x7x7 and the classifier 512 -> 1000
    gx, gout = r(batch, 512, 7, 7), np.empty((batch, 512, 1, 1), f32)
    tgx = t(gx)
    both("global_avgpool_fwd", lambda b: lambda: get_backend(b).avgpool_forward(gx, 7, 1, 0, gout),
         lambda: F.adaptive_avg_pool2d(tgx, 1))
    fx, fw, fb, fdy = r(batch, 512), r(1000, 512), r(1000), r(batch, 1000)
    fout, fdx, fdw, fdb = np.empty((batch, 1000), f32), np.empty_like(fx), np.empty_like(fw), np.empty_like(fb)
    tfx, tfw, tfb, tfdy = t(fx), t(fw), t(fb), t(fdy)
    both("dense_fwd", lambda b: lambda: get_backend(b).dense_forward(fx, fw, fb, fout),
         lambda: F.linear(tfx, tfw, tfb))
    both("dense_bwd_data", lambda b: lambda: get_backend(b).dense_backward_data(fdy, fw, fdx),
         lambda: torch.mm(tfdy, tfw))
    both("dense_bwd_weights", lambda b: lambda: get_backend(b).dense_backward_weights(fx, fdy, fdw, fdb),
         lambda: (torch.mm(tfdy.t(), tfx), tfdy.sum(0)))
    labels = rng.integers(0, 1000, batch).astype(np.int64)
    tlab = torch.from_numpy(labels)
    both("softmax_ce", lambda b: lambda: get_backend(b).softmax_cross_entropy(fout, labels, fdy),
         lambda: F.cross_entropy(t(fout).requires_grad_(), tlab))
    return cases


def run(args) -> list[tuple]:
    """Rows (op, {impl: [seconds per repetition]}) timed interleaved, after one warm-up call."""
    _common.apply_threads(args.threads)
    get_backend("onednn").set_threads(args.threads)
    rng = np.random.default_rng(0)
    cases = build_cases(args.batch, rng)
    wanted = [o for o in args.ops.split(",") if o] or list(cases)
    impls = ["onednn", "torch"] + ([] if args.no_numpy else ["numpy"])
    rows = []
    with torch.no_grad():
        for op in _common.progress(wanted, total=len(wanted), desc="ops", disable=args.no_progress):
            fns = cases[op]
            for impl in impls:  # warm-up: primitive creation, JIT, first-touch
                fns[impl]()
            samples = _common.interleaved_samples([fns[i] for i in impls], args.reps)
            rows.append((op, dict(zip(impls, samples))))
    return rows


def report(args, rows) -> None:
    dnnl = get_backend("onednn")
    print(f"oneDNN {dnnl.version()} ({dnnl.get_threads()} threads), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), numpy {np.__version__}; batch {args.batch}; "
          f"medians [min-max] of {args.reps} interleaved repetitions")
    print(f"{'op':20s} {'ours (onednn)':>30s} {'torch':>30s} {'speedup (torch/ours)':>29s} "
          f"{'numpy':>30s}")
    for op, t in rows:
        ours, peer = _common.Stat(t["onednn"]), _common.Stat(t["torch"])
        sp = _common.speedups(t["torch"], t["onednn"])
        npy = _common.Stat(t["numpy"]).fmt(1e3, "ms", 3) if "numpy" in t else "-"
        print(f"{op:20s} {ours.fmt(1e3, 'ms', 3):>30s} {peer.fmt(1e3, 'ms', 3):>30s} "
              f"{sp.fmt(1, 'x', 2):>29s} {npy:>30s}")
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in _common.os.getloadavg())}")


def plot(path, rows) -> None:
    """Bar chart of the per-op speedups (torch time / ours), with their spread."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    stats = [_common.speedups(t["torch"], t["onednn"]) for _, t in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(rows)), 4))
    x = np.arange(len(rows))
    med = np.array([s.median for s in stats])
    err = np.array([[s.median - s.lo for s in stats], [s.hi - s.median for s in stats]])
    ax.bar(x, med, yerr=err, capsize=3, color=["tab:green" if m >= 1 else "tab:red" for m in med])
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xticks(x, [op for op, _ in rows], rotation=60, ha="right")
    ax.set_ylabel("speedup = torch time / oneDNN time")
    ax.set_title(f"kernels vs PyTorch (batch {ARGS.batch if ARGS else '?'}; > 1: ours faster)")
    fig.tight_layout()
    _common.save_plot(fig, path)
    plt.close(fig)


def main() -> int:
    args = ARGS or parse_args()
    print(_common.machine())
    rows = run(args)
    print(_common.thread_line())
    report(args, rows)
    if args.plot:
        plot(args.plot, rows)
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
