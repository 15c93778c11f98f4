"""Kernel timings at ResNet-like shapes: NumPy reference vs oneDNN backend vs PyTorch CPU.

Each repetition runs every implementation of an op once, interleaved, and the median is
reported with ours/peer ratios (peer = PyTorch, same thread count). Run:
    python benchmarks/kernels.py [--threads N] [--reps R] [--batch B] [--ops conv_fwd,relu_fwd]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every library")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions per op")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ops", default="", help="comma-separated subset of op names")
    p.add_argument("--no-numpy", action="store_true", help="skip the (slow) NumPy reference")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:  # BLAS thread pools read these once, at import
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)

import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from cachedarrays.models.backend import get_backend  # noqa: E402


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}"


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
    import torch

    torch.set_num_threads(args.threads)
    dnnl = get_backend("onednn")
    dnnl.set_threads(args.threads)
    rng = np.random.default_rng(0)
    cases = build_cases(args.batch, rng)
    wanted = [o for o in args.ops.split(",") if o] or list(cases)
    impls = ["onednn", "torch"] + ([] if args.no_numpy else ["numpy"])
    rows = []
    with torch.no_grad():
        for op in wanted:
            fns = cases[op]
            for impl in impls:  # warm-up: primitive creation, JIT, first-touch
                fns[impl]()
            times = {impl: [] for impl in impls}
            for _ in range(args.reps):
                for impl in impls:
                    start = time.perf_counter()
                    fns[impl]()
                    times[impl].append(time.perf_counter() - start)
            med = {impl: statistics.median(v) * 1e3 for impl, v in times.items()}
            rows.append((op, med.get("numpy"), med["onednn"], med["torch"]))
    return rows


def report(args, rows) -> None:
    import torch

    dnnl = get_backend("onednn")
    print(f"machine: {machine()}; load average at end {os.getloadavg()[0]:.2f} (other work skews timings)")
    print(f"threads: {args.threads} (oneDNN {dnnl.version()} sees {dnnl.get_threads()}, "
          f"torch {torch.__version__} {torch.get_num_threads()}), numpy {np.__version__}, batch {args.batch}, "
          f"median of {args.reps} interleaved reps")
    print(f"{'op':22s} {'numpy ms':>10s} {'onednn ms':>10s} {'torch ms':>10s} {'onednn/torch':>13s} {'numpy/torch':>12s}")
    for op, npy, dn, tt in rows:
        npy_s = f"{npy:10.3f}" if npy is not None else f"{'-':>10s}"
        ratio = f"{npy / tt:12.2f}" if npy is not None else f"{'-':>12s}"
        print(f"{op:22s} {npy_s} {dn:10.3f} {tt:10.3f} {dn / tt:13.2f} {ratio}")


def main() -> int:
    args = ARGS or parse_args()
    report(args, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
