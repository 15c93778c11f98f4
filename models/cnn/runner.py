"""Operating modes (dissertation Table 4.7 plus baselines) and a small training-loop runner.

=========  ==================================================================================
mode       meaning
=========  ==================================================================================
none       CA:0 — LRU, new arrays start in slow memory and are cached in fast, no cleanup
L          CA:L — LRU with local (fast-only) allocation of new arrays
LM         CA:LM — plus the memory optimisations (cleanup / noescape)
LMP        CA:LMP — plus prefetch annotations
fast-only  FastOnly policy, fast budget = everything (the all-DRAM reference)
2lm        2LM:M — every array in slow memory behind a simulated DRAM cache, with cleanup
2lm-none   2LM:0 — the same without cleanup / noescape
=========  ==================================================================================
"""

from __future__ import annotations

import logging
import time

import numpy as np

import cachedarrays as ca
from cachedarrays.policies import LRU, FastOnly, SlowOnly
from cachedarrays.policies.memorymode import MemoryModeCache

from .core import SGD, Session
from .nets import build, train_step
from .trace import KernelTracer, modelled_time

log = logging.getLogger(__name__)

__all__ = ["MODES", "make_policy", "make_session", "measure_footprint", "run", "synthetic_batch"]

MODES = ("none", "L", "LM", "LMP", "fast-only", "2lm", "2lm-none")
_LRU = {"none": "CA:0", "L": "CA:L", "LM": "CA:LM", "LMP": "CA:LMP"}


def check_mode(mode):
    """The canonical mode name; unknown names list the valid ones."""
    for m in MODES:
        if str(mode).lower() == m.lower():
            return m
    raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")


def make_policy(mode):
    """A fresh policy object for mode."""
    mode = check_mode(mode)
    if mode in _LRU:
        return LRU(mode=_LRU[mode])
    if mode == "fast-only":
        return FastOnly()
    p = SlowOnly()
    p.allows_cleanup = mode == "2lm"
    return p


def make_session(mode, fast, slow, backend="numpy", line_size=64, event_log=None,
                 annotations=True):
    """(manager, session) for mode; in the 2LM modes ``fast`` is the simulated cache's size."""
    mode = check_mode(mode)
    fast = ca.parse_size(fast, "fast memory budget")
    cache = None
    if mode.startswith("2lm"):
        cache = MemoryModeCache(max(fast, line_size), line_size)
        fast = 0
    m = ca.Manager(fast=fast, slow=slow, policy=make_policy(mode), event_log=event_log)
    s = Session(m, backend, annotations=annotations, tracer=KernelTracer(m, cache))
    return m, s


def synthetic_batch(model, seed=0):
    """Normal-distributed images and uniform labels for model's input shape (§4.6)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(model.input_shape, dtype=np.float32)
    y = rng.integers(0, model.classes, size=model.input_shape[0], dtype=np.int64)
    return x, y


def measure_footprint(model_name, depth, backend="numpy", **shape):
    """Peak bytes in use during one training iteration with everything in fast memory."""
    model = build(model_name, depth, **shape)
    est = model.footprint_estimate()
    m, s = make_session("fast-only", int(est * 1.5) + (16 << 20), 1 << 20, backend)
    with m:
        model.init(s)
        x, y = synthetic_batch(model)
        train_step(s, model, x, y, SGD(0.01))
        m.reset_stats()
        train_step(s, model, x, y, SGD(0.01))
        return m.stats()["devices"]["fast"]["peak_bytes"]


def run(model_name="resnet", depth=18, mode="LM", fast="25%", iterations=2, backend="numpy",
        batch=4, image=16, channels=3, classes=10, width=8, lr=0.01, seed=0, profile=None,
        slow=None, callback=None, event_log=None, line_size=64):
    """Train a model for some iterations in one mode; returns a list of per-iteration dicts.

    fast: bytes, a size string or a percentage of the measured footprint (e.g. "25%").
    """
    shape = dict(batch=batch, image=image, channels=channels, classes=classes, width=width)
    model = build(model_name, depth, **shape)
    mode = check_mode(mode)
    footprint = None
    if isinstance(fast, str) and fast.strip().endswith("%") or mode == "fast-only":
        footprint = measure_footprint(model_name, depth, backend, **shape)
    if mode == "fast-only":
        budget = int(model.footprint_estimate() * 1.5) + (16 << 20)
    elif isinstance(fast, str) and fast.strip().endswith("%"):
        budget = int(footprint * float(fast.strip()[:-1]) / 100)
    else:
        budget = ca.parse_size(fast, "fast memory budget")
    need = model.footprint_estimate()
    if slow is None:
        slow = 3 * need + (64 << 20)
    slow = ca.parse_size(slow, "slow memory size")
    room = slow + (0 if mode.startswith("2lm") else budget)
    if room < need:
        raise MemoryError(
            f"{model.name} with batch {batch} and {image}x{image} images needs about "
            f"{ca.format_size(need)} per training iteration, but fast ({ca.format_size(budget)}) plus "
            f"slow ({ca.format_size(slow)}) memory hold only {ca.format_size(room)}; "
            "use a larger slow size or a smaller batch")
    m, s = make_session(mode, budget, slow, backend, line_size=line_size, event_log=event_log)
    out = []
    with m:
        model.init(s, seed)
        opt = SGD(lr)
        for it in range(iterations):
            x, y = synthetic_batch(model, seed + it)
            m.reset_stats()
            s.tracer.reset()
            m.count("cnn_iteration", 0, iteration=it)
            t = time.perf_counter()
            loss = train_step(s, model, x, y, opt)
            wall = time.perf_counter() - t
            stats = m.stats()
            rec = {"iteration": it, "loss": loss, "wall": wall, "budget": budget,
                   "footprint": footprint, "stats": stats, "trace": s.tracer.summary(),
                   "modelled": modelled_time(wall, stats, s.tracer, profile)}
            out.append(rec)
            log.debug("%s mode %s iteration %d: loss %.4f, wall %.3f s, modelled %.3f s",
                      model.name, mode, it, loss, wall, rec["modelled"])
            if callback is not None:
                callback(rec)
    return out
