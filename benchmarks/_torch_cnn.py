"""PyTorch peer of benchmarks/cnn.py, run in its own process (``--peer torch``).

PyTorch and the oneDNN backend each bring an OpenMP runtime (torch its own libgomp copy); two
runtimes in one process compete for the same cores, so the peer runs here, alone with torch.

    python benchmarks/_torch_cnn.py '{"model": "resnet", "depth": 50, "batch": 16, "image": 64,
                                      "channels": 3, "classes": 100, "width": 1, "threads": 2}'

Builds the same architecture from our model description (cachedarrays.models.cnn, pure Python:
no oneDNN is loaded), trains it with SGD on the same synthetic batch, runs two warm-up steps,
prints one JSON line {"ready": ...} and then answers each line "N" on stdin with
{"times": [seconds of each of N steps], "loss": ...}; "quit" or end of input stops it.
"""

from __future__ import annotations

import json
import os
import sys
import time

# Keep this folder off the import path; _common is loaded by file path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _load_common():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_torch_cnn_common",
                                                  os.path.join(_HERE, "_common.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# First, before torch starts its OpenMP runtime: OMP_WAIT_POLICY=PASSIVE unless the parent set it.
_common = _load_common()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from cachedarrays.models import cnn  # noqa: E402


class _Residual(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.branch = convert(block.branch)
        self.shortcut = convert(block.shortcut) if block.shortcut is not None else None
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        sc = self.shortcut(x) if self.shortcut is not None else x
        return self.relu(self.branch(x) + sc)


class _Dense(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.inner = convert(layer.inner)

    def forward(self, x):
        return torch.cat([x, self.inner(x)], 1)


def convert(u):
    """The torch.nn equivalent of one of our units (same shapes, strides, padding, bias)."""
    if isinstance(u, cnn.Conv2d):
        k, c, r, s = u.w_shape
        return nn.Conv2d(c, k, (r, s), u.stride, u.pad, bias=u.has_bias)
    if isinstance(u, cnn.BatchNorm2d):
        return nn.BatchNorm2d(u.in_shape[1], eps=u.eps)
    if isinstance(u, cnn.ReLU):
        return nn.ReLU(inplace=True)
    if isinstance(u, cnn.MaxPool2d):
        return nn.MaxPool2d(u.kernel, u.stride, u.pad)
    if isinstance(u, cnn.AvgPool2d):
        return nn.AvgPool2d(u.kernel, u.stride, u.pad, count_include_pad=False)
    if isinstance(u, cnn.Flatten):
        return nn.Flatten()
    if isinstance(u, cnn.Dense):
        return nn.Linear(u.w_shape[1], u.w_shape[0], bias=u.has_bias)
    if isinstance(u, cnn.Chain):
        return nn.Sequential(*[convert(v) for v in u.layers])
    if isinstance(u, cnn.ResidualBlock):
        return _Residual(u)
    if isinstance(u, cnn.DenseLayer):
        return _Dense(u)
    raise TypeError(f"no torch equivalent for {u!r}")


def main(argv=None):
    cfg = json.loads((argv or sys.argv[1:])[0])
    threads = int(cfg.get("threads", 1))
    _common.apply_threads(threads)        # torch, its OpenMP and BLAS pools: as the parent's
    torch.set_num_threads(threads)
    model = cnn.build(cfg["model"], int(cfg["depth"]), batch=cfg["batch"], image=cfg["image"],
                      channels=cfg.get("channels", 3), classes=cfg.get("classes", 10),
                      width=cfg.get("width", 1))
    x, y = cnn.synthetic_batch(model)
    torch.manual_seed(0)
    net = nn.Sequential(*[convert(u) for u in model.units])
    opt = torch.optim.SGD(net.parameters(), lr=float(cfg.get("lr", 0.01)))
    lossf = nn.CrossEntropyLoss()
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    loss = [float("nan")]

    def step():
        opt.zero_grad(set_to_none=True)
        out = lossf(net(tx), ty)
        out.backward()
        opt.step()
        loss[0] = float(out.detach())

    for _ in range(int(cfg.get("warmup", 2))):
        step()
    params = sum(p.numel() for p in net.parameters())
    print(json.dumps({"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "params": params, "expected_params": model.param_count(), "pid": os.getpid(),
                      "thread_line": _common.thread_line()}),
          flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if not cmd or cmd == "quit":
            break
        times = []
        for _ in range(int(cmd)):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        print(json.dumps({"times": times, "loss": loss[0]}), flush=True)
    return 0


def _main_or_one_line():
    """main; a failure is one line on stderr (the parent says the peer stopped)."""
    try:
        return main()
    except Exception as e:                  # noqa: BLE001  (the peer's own errors, e.g. torch's)
        print(f"torch peer: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(_common.run(_main_or_one_line))
