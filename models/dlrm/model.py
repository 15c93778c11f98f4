"""DLRM on CachedArrays: bottom MLP, embedding ensemble, dot (or concat) interaction, top MLP,
sigmoid + binary cross-entropy, plain SGD.

Weights, biases, activations and gradients are CachedArrays allocated once per batch size and
reused; kernels (oneDNN or NumPy dense layers, numba embedding and interaction kernels) run on
views from pinned access scopes. ``train_step`` times four phases: ``lookup`` (embedding
forward), ``interaction`` (forward and backward), ``mlp`` (both MLPs forward and backward, the
loss and the dense SGD) and ``update`` (embedding SGD plus cache maintenance).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
from numba import njit, prange

import cachedarrays as ca
from cachedarrays import threads as _threads
from cachedarrays.layout import readonly_view as _readonly
from cachedarrays.models.backend import get_backend
from cachedarrays.threads import serial_twin

from . import embedding as emb
from . import kernels
from ._head import output_layer_backward
from ._interaction_kernels import BLOCKS_PER_ITEM, LANES, make_backward, make_forward
from ._intrinsics import fma
from .configs import DLRMConfig, get_config
from .data import Batch, SyntheticDataset

__all__ = ["DLRM", "synthetic_dataset", "dot_interaction", "dot_interaction_backward",
           "bce_with_logits", "PHASES", "demo"]

log = logging.getLogger(__name__)

PHASES = ("lookup", "interaction", "mlp", "update")


def synthetic_dataset(config: DLRMConfig, distribution="uniform", seed=0, num_batches=100,
                      alpha=1.0, batch_size=None):
    """A :class:`SyntheticDataset` shaped for ``config`` (uniform or Zipf + LFSR indices)."""
    if not isinstance(config, DLRMConfig):
        raise TypeError(f"synthetic_dataset takes a DLRMConfig first (configs.small(), "
                        f"configs.large(), ...), got {config!r}")
    b = config.batch_size if batch_size is None else batch_size
    return SyntheticDataset(config.dense_features, config.table_sizes, b,
                            pooling=config.bag_size, distribution=distribution, alpha=alpha,
                            seed=seed, num_batches=num_batches)


# ---- interaction kernels (numba, one sample per parallel item) ----------------------------

@njit(parallel=True, cache=True, fastmath=False, nogil=True)
def _dot_forward(t, nfeat, fs, r):
    """r[b] = [t[b, :fs], dot(t_i, t_j) for i in range(nfeat) for j in range(i)]."""
    for b in prange(t.shape[0]):
        for k in range(fs):
            r[b, k] = t[b, k]
        p = fs
        for i in range(nfeat):
            for j in range(i):
                s = t.dtype.type(0)
                for k in range(fs):
                    s = fma(t[b, i * fs + k], t[b, j * fs + k], s)
                r[b, p] = s
                p += 1


@njit(parallel=True, cache=True, fastmath=False, nogil=True)
def _dot_backward(t, dr, nfeat, fs, dt):
    """Gradient of ``_dot_forward``: dt from dr (both pair terms and the passed-through block)."""
    for b in prange(t.shape[0]):
        for k in range(t.shape[1]):
            dt[b, k] = 0
        for k in range(fs):
            dt[b, k] = dr[b, k]
        p = fs
        for i in range(nfeat):
            for j in range(i):
                g = dr[b, p]
                for k in range(fs):
                    dt[b, i * fs + k] = fma(g, t[b, j * fs + k], dt[b, i * fs + k])
                    dt[b, j * fs + k] = fma(g, t[b, i * fs + k], dt[b, j * fs + k])
                p += 1


_dot_forward_serial = serial_twin(_dot_forward, "_dot_forward_serial")
_dot_backward_serial = serial_twin(_dot_backward, "_dot_backward_serial")

#: Batches of at most this many samples run the interaction on the calling thread (the kernels'
#: serial twins): the specialised kernels hand out this many samples per parallel work item,
#: so a smaller batch is one item, and a parallel region would only add the wake of a
#: sleeping thread pool (40-60 us on a 2-core VM under OMP_WAIT_POLICY=PASSIVE).
SERIAL_SAMPLES = LANES * BLOCKS_PER_ITEM
#: Shapes up to these sizes get interaction kernels specialised per (nfeat, fs).
MAX_SPECIALISED_NFEAT = 128
MAX_SPECIALISED_FS = 512
_use_specialised = True
_kernels = {}             # (nfeat, fs) -> (forward, backward, their serial twins)
_kernels_lock = threading.Lock()


def set_specialised(enabled: bool) -> bool:
    """Use (or not) the shape-specialised interaction kernels; returns the old setting."""
    global _use_specialised
    old, _use_specialised = _use_specialised, bool(enabled)
    return old


def _specialised(nfeat, fs, t, *arrays, backward=False):
    """The forward (or ``backward``) interaction kernel for this shape, or None (generic
    kernels) when the shape is large, the arrays are not C-contiguous (B, width) float arrays of
    t's dtype or specialisation is off. ``arrays`` are r (forward) or dr, dt (backward)."""
    if not (_use_specialised and 1 <= nfeat <= MAX_SPECIALISED_NFEAT
            and 1 <= fs <= MAX_SPECIALISED_FS):
        return None
    for a in (t,) + arrays:
        if not (isinstance(a, np.ndarray) and a.ndim == 2 and a.flags.c_contiguous
                and a.dtype == t.dtype and a.shape[0] == t.shape[0]):
            return None
    if t.shape[1] != nfeat * fs or t.dtype not in (np.float32, np.float64):
        return None
    width = fs + nfeat * (nfeat - 1) // 2
    if any(a.shape[1] != (width if k == 0 else nfeat * fs) for k, a in enumerate(arrays)):
        return None
    key = (nfeat, fs)
    k = _kernels.get(key)
    if k is None:
        with _kernels_lock:
            k = _kernels.get(key)
            if k is None:
                f, b = make_forward(nfeat, fs), make_backward(nfeat, fs)
                k = _kernels[key] = (f, b, serial_twin(f, "forward_serial"),
                                     serial_twin(b, "backward_serial"))
    return k[(1 if backward else 0) + (2 if _serial(t) else 0)]


def _serial(t):
    """True when the interaction of t's samples runs on the calling thread (see
    SERIAL_SAMPLES, ``threads.FORKED_AFTER_POOL``)."""
    return t.shape[0] <= SERIAL_SAMPLES or _threads.FORKED_AFTER_POOL


def _check_interaction(t, nfeat, fs, what):
    """(nfeat, fs) as ints for a (B, nfeat*fs) float32/float64 ndarray ``t``; the kernels
    index without bounds checks, so a shape that does not match must stop here."""
    for name, v in (("nfeat", nfeat), ("fs", fs)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{what}: {name} must be an integer >= 1, got {v!r}")
    nfeat, fs = int(nfeat), int(fs)
    if not isinstance(t, np.ndarray) or t.dtype not in (np.float32, np.float64):
        got = t.dtype if isinstance(t, np.ndarray) else type(t).__name__
        raise TypeError(f"{what}: t must be a float32 or float64 ndarray, got {got}")
    if t.ndim != 2 or t.shape[1] != nfeat * fs:
        raise ValueError(f"{what}: t has shape {t.shape}, expected (batch, {nfeat * fs}) for "
                         f"{nfeat} features of {fs} values")
    return nfeat, fs


def _check_interaction_output(a, shape, t, name, what, *inputs):
    """``a`` must be an ndarray of ``shape`` and t's dtype; an output (one given ``inputs``)
    must also be writable and apart from them (a kernel writing what it reads goes wrong)."""
    if not isinstance(a, np.ndarray) or a.dtype != t.dtype or a.shape != shape:
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{what}: {name} must be a {t.dtype} ndarray of shape {shape}, got {got}")
    if inputs and not a.flags.writeable:
        raise ValueError(f"{what}: {name} is read-only; pass a writable array")
    for b in inputs:
        if np.may_share_memory(a, b):
            raise ValueError(f"{what}: {name} shares memory with an input; pass a separate array")


def dot_interaction(t, nfeat, fs, out=None):
    """Dot interaction of (B, nfeat*fs) features: the first block and the strictly lower
    triangle of each sample's Gram matrix (PyTorch DLRM order)."""
    nfeat, fs = _check_interaction(t, nfeat, fs, "dot_interaction")
    width = fs + nfeat * (nfeat - 1) // 2
    if out is None:
        out = np.empty((t.shape[0], width), dtype=t.dtype)
    _check_interaction_output(out, (t.shape[0], width), t, "out", "dot_interaction", t)
    t = _readonly(t)                    # one numba type whatever the caller's flags
    k = _specialised(nfeat, fs, t, out)
    if k is not None:
        k(t, out)
    elif _serial(t):
        _dot_forward_serial(t, nfeat, fs, out)
    else:
        _dot_forward(t, nfeat, fs, out)
    return out


def dot_interaction_backward(t, dr, nfeat, fs, dt=None):
    """Gradient of :func:`dot_interaction` with respect to ``t``."""
    nfeat, fs = _check_interaction(t, nfeat, fs, "dot_interaction_backward")
    _check_interaction_output(dr, (t.shape[0], fs + nfeat * (nfeat - 1) // 2), t, "dr",
                              "dot_interaction_backward")
    if dt is None:
        dt = np.empty_like(t)
    _check_interaction_output(dt, t.shape, t, "dt", "dot_interaction_backward", t, dr)
    t, dr = _readonly(t), _readonly(dr)
    k = _specialised(nfeat, fs, t, dr, dt, backward=True)
    if k is not None:
        k(t, dr, dt)
    elif _serial(t):
        _dot_backward_serial(t, dr, nfeat, fs, dt)
    else:
        _dot_backward(t, dr, nfeat, fs, dt)
    return dt


def bce_with_logits(z, y, dz=None):
    """Mean binary cross-entropy of sigmoid(z) (log clamped at -100, as torch.nn.BCELoss);
    writes d(loss)/dz, (sigmoid(z) - y) / B unless saturated, into ``dz`` when given."""
    z64 = z.astype(np.float64).reshape(-1)
    if np.size(y) != z64.shape[0]:
        raise ValueError(f"bce_with_logits: {np.size(y)} labels for {z64.shape[0]} logits; "
                         f"pass one label per logit")
    p = 1.0 / (1.0 + np.exp(-z64))
    p32 = p.astype(np.float32).astype(np.float64)
    with np.errstate(divide="ignore"):
        logp = np.maximum(np.log(p32), -100.0)
        log1p = np.maximum(np.log(1.0 - p32), -100.0)
    yy = y.astype(np.float64).reshape(-1)
    loss = float(-np.mean(yy * logp + (1.0 - yy) * log1p))
    if dz is not None:  # through sigmoid' = p(1-p) as autograd does: zero once p saturates
        s = p32 * (1.0 - p32)
        g = (p32 - yy) / np.maximum(s, 1e-12) * s / yy.shape[0]
        dz[...] = g.astype(dz.dtype).reshape(dz.shape)
    return loss


# ---- the model -----------------------------------------------------------------------------

class _Dense:
    """One dense layer's parameters and gradient buffers (CachedArrays)."""

    def __init__(self, name, fan_in, fan_out, relu, rng, manager):
        self.name, self.relu = name, relu
        std_w = np.sqrt(2.0 / (fan_in + fan_out))
        std_b = np.sqrt(1.0 / fan_out)
        self.w = ca.asarray(rng.normal(0.0, std_w, (fan_out, fan_in)).astype(np.float32),
                            manager=manager)
        self.b = ca.asarray(rng.normal(0.0, std_b, fan_out).astype(np.float32), manager=manager)
        self.dw = ca.zeros((fan_out, fan_in), dtype=np.float32, manager=manager)
        self.db = ca.zeros(fan_out, dtype=np.float32, manager=manager)


def _cache_shares(size, table_bytes, rowbytes, what="cache", name="DLRM"):
    """Each table's cache size for a model's ``size``: a fraction (a float) is every table's
    own fraction; bytes (an int or "64MiB") are the whole model's, split evenly in whole rows,
    a table smaller than its share cached whole and what it leaves split over the others (a
    small table is not refused, and the shares never add up to more than ``size``)."""
    if isinstance(size, (float, np.floating)):
        return [size] * len(table_bytes)
    try:
        total = ca.parse_size(size)
    except (TypeError, ValueError) as e:
        raise ValueError(f"DLRM {name!r}: {what} must be a fraction of each table (float) or a "
                         f"size in bytes for all tables together (int or '64MiB'), got "
                         f"{size!r}") from e
    whole = sum(table_bytes)
    if total > whole:
        raise ValueError(f"DLRM {name!r}: {what} of {total:,} bytes is more than all its tables "
                         f"({len(table_bytes)} tables, {whole:,} bytes); the largest is "
                         f"{whole:,} (or 1.0)")
    shares = [0] * len(table_bytes)
    left = total
    order = sorted(range(len(table_bytes)), key=lambda t: table_bytes[t])
    for k, t in enumerate(order):                 # smallest first: what they leave goes on
        share = min(table_bytes[t], left // (len(order) - k))
        shares[t] = share - share % rowbytes[t]
        left -= shares[t]
    return shares


class DLRM:
    """DLRM whose tables are of ``table_kind`` ("fast", "simple", "static", "dynamic").

    ``cache`` is the cached tables' ``cachelower``: a fraction (float) of each table, or bytes
    (int or "64MiB") for all of them together (``_cache_shares``); ``slack`` their
    ``cacheslack`` in the same way, and ``flush_policy`` their flush policy; ``backend``
    "onednn" or "numpy" runs the MLPs.
    """

    def __init__(self, config, *, manager=None, table_kind="fast", cache=0.25, slack=0.05,
                 backend="onednn", seed=51234, page_rows=emb.DEFAULT_PAGE_ROWS,
                 flush_policy="oldest"):
        if isinstance(config, str):
            config = get_config(config)
        if not isinstance(config, DLRMConfig):
            raise TypeError(f"config must be a DLRMConfig or a config name, got {type(config).__name__}")
        if table_kind not in emb.TABLE_KINDS:
            raise ValueError(f"unknown table kind {table_kind!r}; use one of {emb.TABLE_KINDS}")
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or \
                seed < 0:
            raise ValueError(f"DLRM {config.name!r}: seed must be an integer >= 0, got {seed!r}")
        self.config, self.table_kind = config, table_kind
        self.manager = manager if manager is not None else ca.default_manager()
        self.backend = get_backend(backend)
        rng = np.random.default_rng(seed)
        m, cfg = self.manager, config
        widths = (cfg.dense_features,) + tuple(cfg.bottom)
        self.bottom = [_Dense(f"bottom.{i}", widths[i], widths[i + 1], True, rng, m)
                       for i in range(len(cfg.bottom))]
        widths = (cfg.interaction_width,) + tuple(cfg.top)
        self.top = [_Dense(f"top.{i}", widths[i], widths[i + 1], i < len(cfg.top) - 1, rng, m)
                    for i in range(len(cfg.top))]
        caches = slacks = [None] * cfg.ntables
        if table_kind in ("static", "dynamic"):
            rowbytes = [cfg.featuresize * np.dtype(np.float32).itemsize] * cfg.ntables
            sizes = [n * r for n, r in zip(cfg.table_sizes, rowbytes)]
            caches = _cache_shares(cache, sizes, rowbytes, "cache", cfg.name)
            slacks = _cache_shares(slack, sizes, rowbytes, "slack", cfg.name)
        self.tables = [emb.make_table(table_kind, n, cfg.featuresize, manager=m, cache=caches[t],
                                      slack=slacks[t], page_rows=page_rows, seed=seed + 1 + t,
                                      name=f"emb.{t}", flush_policy=flush_policy)
                       for t, n in enumerate(cfg.table_sizes)]
        fs = cfg.featuresize
        self.columns = np.arange(1, cfg.ntables + 1, dtype=np.int64) * fs
        self._acts = None
        self._acts_batch = None
        self.timings = {p: [] for p in PHASES}
        self.losses = []

    # ---- buffers ---------------------------------------------------------------------

    def _buffers(self, b):
        """Activations and their gradients for batch size b, allocated once and reused."""
        if self._acts_batch == b:
            return self._acts
        if self._acts is not None:
            ca.unsafe_free(*[a for a in self._acts.values() if isinstance(a, ca.CachedArray)]
                           + [a for v in self._acts.values() if isinstance(v, list) for a in v])
        cfg, m = self.config, self.manager
        f = cfg.ntables + 1

        def new(*shape):
            return ca.empty(shape, dtype=np.float32, manager=m)

        acts = {
            "x": new(b, cfg.dense_features),
            "bottom": [new(b, layer.w.shape[0]) for layer in self.bottom],
            "t": new(b, f * cfg.featuresize),
            "top": [new(b, layer.w.shape[0]) for layer in self.top],
            "dtop": [new(b, layer.w.shape[0]) for layer in self.top],
            "dbottom": [new(b, layer.w.shape[0]) for layer in self.bottom],
            "dr": new(b, cfg.interaction_width),
            "dt": new(b, f * cfg.featuresize),
        }
        acts["r"] = new(b, cfg.interaction_width) if cfg.interaction == "dot" else acts["t"]
        self._acts, self._acts_batch = acts, b
        return acts

    # ---- layers ----------------------------------------------------------------------

    def _mlp_forward(self, layers, x, outs):
        be = self.backend
        for layer, y in zip(layers, outs):
            with ca.kernel("dense_forward", (x, layer.w, layer.b), (y,)) as (xv, w, bv, yv):
                be.dense_forward(xv, w, bv, yv, relu=layer.relu)
            x = y
        return x

    def _mlp_backward(self, layers, x0, outs, douts, dx0=None):
        """Back through ``layers``; douts[-1] holds the gradient of the last output on entry.

        A last layer of one output on a ReLU layer (DLRM's click logit) goes back through
        both in one pass (``output_layer_backward``)."""
        be = self.backend
        top = len(layers) - 1
        masked = False          # douts[i] already holds the gradient at layer i's ReLU input
        if top >= 1 and layers[top].w.shape[0] == 1 and not layers[top].relu and \
                layers[top - 1].relu:
            last, prev = layers[top], layers[top - 1]
            with ca.kernel("output_layer_backward", (douts[top], outs[top - 1], last.w),
                           (douts[top - 1], last.dw, last.db, prev.db)) as \
                    (dz, y, w, dx, dw, db, dbp):
                output_layer_backward(dz, y, w, dx, dw, db, dbp)
            top -= 1
            masked = True
        for i in range(top, -1, -1):
            layer, y, dy = layers[i], outs[i], douts[i]
            x = outs[i - 1] if i > 0 else x0
            if layer.relu:
                if not masked:  # in place on dy, with the bias gradient from the same pass
                    with ca.kernel("relu_backward_bias", (y,), (dy, layer.db)) as (yv, dyv, db):
                        be.relu_backward_bias(dyv, yv, dyv, db)
                masked = False
                with ca.kernel("dense_backward_weights", (x, dy), (layer.dw,)) as (xv, dyv, dw):
                    be.dense_backward_weights(xv, dyv, dw, None)
            else:
                with ca.kernel("dense_backward_weights", (x, dy), (layer.dw, layer.db)) as \
                        (xv, dyv, dw, db):
                    be.dense_backward_weights(xv, dyv, dw, db)
            dx = douts[i - 1] if i > 0 else dx0
            if dx is not None:
                with ca.kernel("dense_backward_data", (dy, layer.w), (dx,)) as (dyv, w, dxv):
                    be.dense_backward_data(dyv, w, dxv)

    def _sgd(self, layers, lr):
        """SGD of every weight and bias of layers, in one kernel (the parameters are small:
        one scope instead of one per array)."""
        be = self.backend
        params = [p for layer in layers for p in (layer.w, layer.b)]
        grads = [g for layer in layers for g in (layer.dw, layer.db)]
        with ca.kernel("sgd_update", grads, params) as views:
            n = len(params)
            for gv, pv in zip(views[:n], views[n:]):
                be.sgd_update(pv, gv, lr)

    def _check_batch(self, batch):
        cfg = self.config
        if isinstance(batch, (tuple, list)) and len(batch) == 4:
            batch = Batch(*batch)
        elif isinstance(batch, dict) and set(batch) <= {"dense", "indices", "offsets", "labels"}:
            batch = Batch(**{"offsets": None, "labels": None, **batch})
        if not all(hasattr(batch, f) for f in ("dense", "indices", "offsets", "labels")):
            raise TypeError(f"DLRM {cfg.name!r}: a batch is a data.Batch, a (dense, indices, "
                            f"offsets, labels) tuple or a dict of those names, got "
                            f"{type(batch).__name__}")
        dense = np.asarray(batch.dense)
        if dense.dtype.kind not in "biuf":
            raise TypeError(f"DLRM {cfg.name!r}: dense input must be real numbers, got dtype "
                            f"{dense.dtype}; pass a float32 array")
        if dense.ndim != 2 or dense.shape[1] != cfg.dense_features:
            raise ValueError(f"DLRM {cfg.name!r}: dense input has shape {dense.shape}, expected "
                             f"(batch, {cfg.dense_features})")
        if len(batch.indices) != cfg.ntables:
            raise ValueError(f"DLRM {cfg.name!r}: {len(batch.indices)} index arrays for "
                             f"{cfg.ntables} tables")
        b = dense.shape[0]
        if b == 0:
            raise ValueError(f"DLRM {cfg.name!r}: the batch is empty (dense input of shape "
                             f"{dense.shape}); pass at least one sample")
        if dense.dtype.kind == "f":
            with np.errstate(over="ignore"):            # as the float32 the MLP reads
                finite = np.isfinite(dense.astype(np.float32, copy=False)).all(axis=1)
            if not finite.all():
                raise ValueError(f"DLRM {cfg.name!r}: dense input holds NaN or infinity (or a "
                                 f"number too large for float32) at sample "
                                 f"{int(np.argmax(~finite))}; pass finite numbers")
        offsets = list(batch.offsets) if batch.offsets is not None else [None] * cfg.ntables
        for t, (idx, off) in enumerate(zip(batch.indices, offsets)):
            if off is None:
                n = np.shape(idx)[0] if np.ndim(idx) == 1 else 0
                if n == 0 or n % b:
                    raise ValueError(f"table 'emb.{t}': indices of shape {np.shape(idx)} do not "
                                     f"split into {b} equal bags of at least one; pass offsets")
                offsets[t] = np.arange(0, n, n // b, dtype=np.int64)
        labels = None if batch.labels is None else np.asarray(batch.labels)
        return Batch(dense, list(batch.indices), offsets, labels)

    def _check_labels(self, labels, b):
        """Labels as float (B,) finite numbers, checked before any parameter changes."""
        name = self.config.name
        if labels is None:
            raise TypeError(f"DLRM {name!r}: train_step needs labels, {b} numbers (one per "
                            f"sample); predict() takes a batch without them")
        try:
            y = np.asarray(labels, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"DLRM {name!r}: labels must be {b} numbers (one per sample), got "
                            f"{type(labels).__name__}") from e
        if y.shape != (b,):
            raise ValueError(f"DLRM {name!r}: labels have shape {y.shape} for a batch of {b}; "
                             f"pass one label per sample, shape ({b},)")
        if not np.isfinite(y).all():
            raise ValueError(f"DLRM {name!r}: labels must be finite numbers (0 or 1 for a "
                             f"click), got {y[~np.isfinite(y)][0]}")
        outside = (y < 0) | (y > 1)
        if outside.any():
            raise ValueError(f"DLRM {name!r}: labels are click probabilities between 0 and 1, "
                             f"got {y[outside][0]} at sample {int(np.argmax(outside))}")
        return y

    # ---- forward / training ----------------------------------------------------------

    def _forward(self, batch, times):
        cfg, fs = self.config, self.config.featuresize
        b = batch.dense.shape[0]
        acts = self._buffers(b)
        t0 = time.perf_counter()
        with ca.kernel("load_dense_input", (), (acts["x"],)) as (xv,):
            np.copyto(xv, batch.dense, casting="same_kind")
        bot = self._mlp_forward(self.bottom, acts["x"], acts["bottom"])
        t1 = time.perf_counter()
        with ca.kernel("copy_bottom_features", (bot,), (acts["t"],)) as (bv, tv):
            tv[:, :fs] = bv
        emb.lookup_tables(self.tables, batch.indices, batch.offsets, acts["t"], self.columns)
        t2 = time.perf_counter()
        if cfg.interaction == "dot":
            with ca.kernel("dot_interaction", (acts["t"],), (acts["r"],)) as (tv, rv):
                dot_interaction(tv, cfg.ntables + 1, fs, rv)
        t3 = time.perf_counter()
        z = self._mlp_forward(self.top, acts["r"], acts["top"])
        t4 = time.perf_counter()
        times["mlp"] += (t1 - t0) + (t4 - t3)
        times["lookup"] += t2 - t1
        times["interaction"] += t3 - t2
        return z

    def predict(self, batch):
        """Click probabilities (B,) as an ndarray (no training)."""
        batch = self._check_batch(batch)
        times = dict.fromkeys(PHASES, 0.0)
        z = self._forward(batch, times)
        with ca.readable(z) as zv:
            return 1.0 / (1.0 + np.exp(-zv[:, 0].astype(np.float64)))

    def train_step(self, batch, lr=None):
        """One SGD iteration; returns the loss and appends phase times to ``timings``."""
        # Checked before any layer is touched: a bad rate must not half-update the model.
        lr = kernels.check_lr(self.config.lr if lr is None else lr, "DLRM", np.float32)
        batch = self._check_batch(batch)
        labels = self._check_labels(batch.labels, batch.dense.shape[0])
        cfg, fs = self.config, self.config.featuresize
        times = dict.fromkeys(PHASES, 0.0)
        z = self._forward(batch, times)
        acts = self._acts
        t0 = time.perf_counter()
        with ca.kernel("bce_with_logits", (z,), (acts["dtop"][-1],)) as (zv, dz):
            loss = bce_with_logits(zv, labels, dz)
        self._mlp_backward(self.top, acts["r"], acts["top"], acts["dtop"], acts["dr"])
        t1 = time.perf_counter()
        if cfg.interaction == "dot":
            with ca.kernel("dot_interaction_backward", (acts["t"], acts["dr"]), (acts["dt"],)) as \
                    (tv, drv, dtv):
                dot_interaction_backward(tv, drv, cfg.ntables + 1, fs, dtv)
            dt = acts["dt"]
        else:
            dt = acts["dr"]
        t2 = time.perf_counter()
        with ca.kernel("copy_bottom_gradient", (dt,), (acts["dbottom"][-1],)) as (dtv, dbv):
            dbv[...] = dtv[:, :fs]
        self._mlp_backward(self.bottom, acts["x"], acts["bottom"], acts["dbottom"], None)
        self._sgd(self.bottom + self.top, lr)
        t3 = time.perf_counter()
        emb.update_tables(self.tables, batch.indices, batch.offsets, dt, lr, self.columns)
        for table in self.tables:
            table.maintain()
        ca.mark_step(self.manager)
        t4 = time.perf_counter()
        times["mlp"] += (t1 - t0) + (t3 - t2)
        times["interaction"] += t2 - t1
        times["update"] += t4 - t3
        for p in PHASES:
            self.timings[p].append(times[p])
        self.losses.append(loss)
        return loss

    def train(self, batches, lr=None):
        """``train_step`` over an iterable of batches; returns the losses."""
        return [self.train_step(b, lr) for b in batches]

    # ---- inspection ------------------------------------------------------------------

    def state_dict(self):
        """ndarray copies of every parameter: "bottom.i.weight/bias", "top.i...", "emb.t"."""
        out = {}
        for layer in self.bottom + self.top:
            with ca.readable(layer.w) as w, ca.readable(layer.b) as b:
                out[f"{layer.name}.weight"] = w.copy()
                out[f"{layer.name}.bias"] = b.copy()
        for t in self.tables:
            out[t.name] = t.snapshot()
        return out

    def load_state_dict(self, state):
        """Set every parameter from ``state`` (the keys, shapes and float values of
        ``state_dict()``). Everything is checked first: a missing, extra, misshapen or
        non-finite entry raises and changes nothing."""
        if not isinstance(state, dict):
            raise TypeError(f"DLRM {self.config.name!r}: load_state_dict takes a dict like "
                            f"state_dict() returns, got {type(state).__name__}")
        layers = {f"{layer.name}.{k}": a for layer in self.bottom + self.top
                  for k, a in (("weight", layer.w), ("bias", layer.b))}
        tables = {t.name: t for t in self.tables}
        missing = [k for k in list(layers) + list(tables) if k not in state]
        extra = [k for k in state if k not in layers and k not in tables]
        if missing or extra:
            raise KeyError(f"DLRM {self.config.name!r}: load_state_dict needs exactly the keys of "
                           f"state_dict(); missing {missing}, unexpected {extra}")
        values = {}
        for k, a in layers.items():
            values[k] = emb.finite_values(state[k], a.shape, np.float32,
                                          f"DLRM {self.config.name!r}: {k}")
        for k, t in tables.items():
            values[k] = t._check_values(state[k])
        for k, a in layers.items():
            with ca.writable(a) as w:
                w[...] = values[k]
        for k, t in tables.items():
            t.load(values[k])

    def table_stats(self):
        """Sum of the tables' telemetry plus the overall hit rate."""
        total = {}
        for t in self.tables:
            for k, v in t.stats().items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "hit_rate":
                    total[k] = total.get(k, 0) + v
        total["hit_rate"] = total["hits"] / total["lookups"] if total.get("lookups") else 0.0
        return total

    def phase_medians(self, skip=1):
        """Median seconds per phase over the recorded iterations (skipping the first ``skip``)."""
        return {p: float(np.median(v[skip:] if len(v) > skip else v)) if v else 0.0
                for p, v in self.timings.items()}

    def stats(self):
        """Phase medians, table telemetry and the manager's stats."""
        return {"phases": self.phase_medians(), "tables": self.table_stats(),
                "manager": self.manager.stats()}


def demo(iterations=8, table_kind="dynamic", seed=0):
    """A short DLRM run with CachedEmbeddings: losses, table hit rate and manager stats."""
    from .configs import small

    cfg = small(scale=0.002, width_scale=0.25, batch_size=1024)
    with ca.Manager(fast="256MiB", slow="1GiB") as m:
        model = DLRM(cfg, manager=m, table_kind=table_kind, cache=0.25, backend="onednn", seed=seed)
        data = synthetic_dataset(cfg, "zipf", seed=seed, num_batches=iterations)
        losses = model.train(data)
        return {"config": cfg.name, "table_kind": table_kind, "losses": losses,
                "hit_rate": model.table_stats()["hit_rate"], "tables": model.table_stats(),
                "phases": model.phase_medians(), "manager": m.stats()}
