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

__all__ = ["MODES", "Trainer", "make_policy", "make_session", "measure_footprint", "run",
           "synthetic_batch"]

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


def measure_footprint(model_name, depth, backend="numpy", fused=True, **shape):
    """Peak bytes in use during one training iteration with everything in fast memory."""
    model = build(model_name, depth, **shape)
    est = model.footprint_estimate()
    m, s = make_session("fast-only", int(est * 1.5) + (16 << 20), 1 << 20, backend)
    with m:
        model.init(s)
        x, y = synthetic_batch(model)
        train_step(s, model, x, y, SGD(0.01), fused=fused)
        m.reset_stats()
        train_step(s, model, x, y, SGD(0.01), fused=fused)
        return m.stats()["devices"]["fast"]["peak_bytes"]


class Trainer:
    """One model training in one mode, an iteration at a time (so a benchmark can interleave
    modes: each ``step()`` is one iteration; ``close()`` releases the manager's memory).

    fast: bytes, a size string or a percentage of the measured footprint (e.g. "25%").
    fused: apply SGD inside the backward pass (the default; see ``train_step``).
    """

    def __init__(self, model_name="resnet", depth=18, mode="LM", fast="25%", backend="numpy",
                 batch=4, image=16, channels=3, classes=10, width=8, lr=0.01, seed=0,
                 profile=None, slow=None, event_log=None, line_size=64, fused=True,
                 footprint=None):
        shape = dict(batch=batch, image=image, channels=channels, classes=classes, width=width)
        model = build(model_name, depth, **shape)
        mode = check_mode(mode)
        if footprint is None and (isinstance(fast, str) and fast.strip().endswith("%")
                                  or mode == "fast-only"):
            footprint = measure_footprint(model_name, depth, backend, fused=fused, **shape)
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
                f"{ca.format_size(need)} per training iteration, but fast ({ca.format_size(budget)}) "
                f"plus slow ({ca.format_size(slow)}) memory hold only {ca.format_size(room)}; "
                "use a larger slow size or a smaller batch")
        self.model, self.mode, self.budget, self.footprint = model, mode, budget, footprint
        self.seed, self.profile, self.fused, self.iteration = seed, profile, fused, 0
        self.m, self.s = make_session(mode, budget, slow, backend, line_size=line_size,
                                      event_log=event_log)
        model.init(self.s, seed)
        self.opt = SGD(lr)

    def step(self):
        """Run one iteration; returns its record (loss, wall, stats, trace, modelled, ...)."""
        m, s, it = self.m, self.s, self.iteration
        x, y = synthetic_batch(self.model, self.seed + it)
        m.reset_stats()
        s.tracer.reset()
        m.count("cnn_iteration", 0, iteration=it)
        t = time.perf_counter()
        loss = train_step(s, self.model, x, y, self.opt, fused=self.fused)
        wall = time.perf_counter() - t
        stats = m.stats()
        self.iteration += 1
        rec = {"iteration": it, "mode": self.mode, "loss": loss, "wall": wall,
               "budget": self.budget, "footprint": self.footprint, "stats": stats,
               "trace": s.tracer.summary(),
               "modelled": modelled_time(wall, stats, s.tracer, self.profile),
               "modelled_sum": modelled_time(wall, stats, s.tracer, self.profile, combine="sum")}
        log.debug("%s mode %s iteration %d: loss %.4f, wall %.3f s, modelled %.3f s",
                  self.model.name, self.mode, it, loss, wall, rec["modelled"])
        return rec

    def close(self):
        """Release the manager (its devices and every array)."""
        self.m.close()


def run(model_name="resnet", depth=18, mode="LM", fast="25%", iterations=2, backend="numpy",
        batch=4, image=16, channels=3, classes=10, width=8, lr=0.01, seed=0, profile=None,
        slow=None, callback=None, event_log=None, line_size=64, fused=True):
    """Train a model for some iterations in one mode; returns a list of per-iteration dicts.

    fast: bytes, a size string or a percentage of the measured footprint (e.g. "25%").
    """
    tr = Trainer(model_name, depth, mode, fast, backend, batch, image, channels, classes, width,
                 lr, seed, profile, slow, event_log, line_size, fused)
    out = []
    try:
        for _ in range(iterations):
            rec = tr.step()
            out.append(rec)
            if callback is not None:
                callback(rec)
    finally:
        tr.close()
    return out
