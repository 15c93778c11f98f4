"""Setups of a training run (dissertation Table 4.7 plus baselines) and a small runner.

A setup names a placement policy and, for the 2LM baselines, a simulated DRAM cache:

=========  ==================================================================================
setup      meaning
=========  ==================================================================================
none       CA:0 — LRU, new arrays start in slow memory and are cached in fast, no cleanup
L          CA:L — LRU with local (fast-only) allocation of new arrays
LM         CA:LM — plus the memory optimisations (cleanup / noescape)
LMP        CA:LMP — plus prefetch annotations
fast-only  FastOnly policy, fast budget = everything (the all-DRAM reference)
2lm        2LM:M — every array in slow memory behind a simulated DRAM cache, with cleanup
2lm-none   2LM:0 — the same without cleanup / noescape
sentinel   Sentinel — profiles one step, then short-lived arena + interval prefetch/eviction
deeptm     DeepTM — profiles one step, then placement by heat (greedy) against its cost model
autotm     AutoTM — profiles one step, then the placement of its integer linear program
=========  ==================================================================================

The CachedArrays setups use the LRU policy's presets (``LRU(preset="CA:LM")``); the 2LM setups
the ``MemoryMode`` policy (SlowOnly placement plus a simulated DRAM cache whose per-kernel
traffic feeds the cost model).
Sizes: ``fast`` is always the manager's fast memory; ``dram_cache`` is the simulated DRAM
cache of the 2LM setups (whose manager keeps every array in slow memory).

Policy figures (modelled time, stall, slow-memory traffic, bytes moved, peak fast occupancy)
come from the cost model: each iteration is recorded with ``ca.trace`` and evaluated with the
kernel times of a fast-only reference run (``fast_only_reference``), never with its own wall
time; see models/cnn/trace.py. Wall times are reported separately.
"""

from __future__ import annotations

import logging
import time

import numpy as np

import cachedarrays as ca
from cachedarrays.copyengine import check_switch
from cachedarrays.policies import LRU, FastOnly, MemoryMode
from cachedarrays.registry import resolve
from cachedarrays.trace import StableIds

from .core import SGD, Session
from .nets import build, train_step
from .trace import evaluate, figures

log = logging.getLogger(__name__)

__all__ = ["SETUPS", "PLANNED", "Trainer", "check_setup", "dram_budget", "fast_only_reference",
           "make_policy", "make_session", "measure_footprint", "parse_budget", "run",
           "synthetic_batch", "REFERENCE_ITERATIONS"]

#: Fast-only iterations of a reference run: the first warms up, the others give the medians.
REFERENCE_ITERATIONS = 4

SETUPS = ("none", "L", "LM", "LMP", "fast-only", "2lm", "2lm-none", "sentinel", "deeptm",
          "autotm")
# Setups that run a planning policy (``cachedarrays.policies.planned``) under its own name.
PLANNED = ("sentinel", "deeptm", "autotm")
_LRU_PRESETS = {"none": "CA:0", "L": "CA:L", "LM": "CA:LM", "LMP": "CA:LMP"}


def check_setup(setup):
    """The canonical setup name; unknown names list the valid ones."""
    for name in SETUPS:
        if str(setup).lower() == name.lower():
            return name
    raise ValueError(f"unknown setup {setup!r}; valid setups: {', '.join(SETUPS)}")


def _is_2lm(setup):
    return setup.startswith("2lm")


def _is_percentage(size):
    return isinstance(size, str) and size.strip().endswith("%")


def parse_budget(size, footprint=None, what="fast memory budget"):
    """Bytes of a budget given as bytes, a size string ("64MiB") or a percentage of the
    measured footprint ("25%"); the one place a CNN budget is parsed."""
    if not _is_percentage(size):
        return ca.parse_size(size, what)
    text = size.strip()[:-1]
    try:
        pct = float(text)
    except ValueError:
        pct = -1.0
    if not 0 <= pct < float("inf"):
        raise ValueError(f"{what} {size!r} is not a percentage; give e.g. '25%', 256MiB or "
                         "a number of bytes")
    if footprint is None:
        raise ValueError(f"{what} {size!r} is a percentage of the footprint, but no footprint "
                         "was given; pass footprint= or give a size such as 256MiB")
    return int(footprint * pct / 100)


def _no_dram_cache(setup, dram_cache):
    return ValueError(f"setup {setup!r} simulates no DRAM cache, so dram_cache={dram_cache!r} "
                      "has no meaning; give its DRAM as fast= (dram_cache is for the 2lm setups)")


def dram_budget(setup, size):
    """Keyword sizes that give setup ``size`` bytes of DRAM: the manager's fast memory, or in
    the 2LM setups the simulated DRAM cache (the manager then has no fast memory)."""
    return {"fast": 0, "dram_cache": size} if _is_2lm(check_setup(setup)) else {"fast": size}


def _need_dram_cache(setup):
    return ValueError(f"setup {setup!r} keeps every array in slow memory behind a "
                      "simulated DRAM cache; give its size as dram_cache= "
                      "(e.g. dram_cache='64MiB')")


def make_policy(setup, dram_cache=None, line_size=64):
    """A fresh policy object for setup; the 2LM setups need the DRAM cache's size.

    2LM: ``MemoryMode`` (SlowOnly placement, a simulated direct-mapped cache of dram_cache
    bytes with line_size-byte lines, ``m.policy.cache``; cleanup on for 2lm and off for
    2lm-none). A cache smaller than one line is no cache: every byte goes to slow memory.
    """
    setup = check_setup(setup)
    if setup in _LRU_PRESETS:
        return LRU(preset=_LRU_PRESETS[setup])
    if setup == "fast-only":
        return FastOnly()
    if setup in PLANNED:
        return resolve(setup)()
    if dram_cache is None:
        raise _need_dram_cache(setup)
    return MemoryMode(line_size=int(line_size),
                      capacity=ca.parse_size(dram_cache, "DRAM cache size"),
                      cleanup=setup == "2lm")


def make_session(setup, fast, slow, backend="numpy", line_size=64, event_log=None,
                 annotations=True, dram_cache=None, stable_ids=True):
    """(manager, session) for setup with ``fast`` bytes of fast memory and ``slow`` of slow.

    dram_cache: the simulated DRAM cache's size, required by (and only by) the 2LM setups
    (``m.policy.cache``). With stable_ids (the default) the manager gives objects stable ids
    from the start, so the weights have allocation-site ids in traces like every other array;
    a run that is never traced can do without them (each new array then skips looking up its
    allocation site).
    """
    setup = check_setup(setup)
    annotations = check_switch(annotations, "make_session: annotations")
    stable_ids = check_switch(stable_ids, "make_session: stable_ids")
    fast = ca.parse_size(fast, "fast memory size")
    if _is_2lm(setup):
        if dram_cache is None:
            raise _need_dram_cache(setup)
    elif dram_cache is not None:
        raise _no_dram_cache(setup, dram_cache)
    m = ca.Manager(fast=fast, slow=slow, policy=make_policy(setup, dram_cache, line_size),
                   event_log=event_log)
    if stable_ids:
        StableIds.of(m)
    s = Session(m, backend, annotations=annotations)
    return m, s


def synthetic_batch(model, seed=0):
    """Normal-distributed images and uniform labels for model's input shape (§4.6)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(model.input_shape, dtype=np.float32)
    y = rng.integers(0, model.classes, size=model.input_shape[0], dtype=np.int64)
    return x, y


def fast_only_reference(model_name, depth, backend="numpy", fused=True,
                        iterations=REFERENCE_ITERATIONS, seed=0, **shape):
    """The kernel times of a model: a trace (``ca.Trace``) of ``iterations`` fast-only training
    iterations whose kernel times are the medians over the iterations after the first
    (``Trace.median_times``). ``meta["footprint"]``: peak bytes in fast memory during the last
    iteration (the measured footprint); ``meta["reference"]``: what was run.

    Every setup's modelled time uses these times (see ``trace.evaluate``); save the trace
    (``Trace.save``) to give later runs the same figures.
    """
    fused = check_switch(fused, "fast_only_reference: fused")
    _check_iterations(iterations)
    model = build(model_name, depth, **shape)
    est = model.footprint_estimate()
    m, s = make_session("fast-only", int(est * 1.5) + (16 << 20), 1 << 20, backend)
    with m:
        model.init(s, seed)
        opt = SGD(0.01)
        with ca.trace(m) as t:
            for i in range(iterations):
                x, y = synthetic_batch(model, seed + i)
                if i == iterations - 1:
                    m.reset_stats()
                train_step(s, model, x, y, opt, fused=fused)
        footprint = m.stats()["devices"]["fast"]["peak_bytes"]
    ref = t.median_times(skip=1)
    ref.meta["footprint"] = footprint
    ref.meta["reference"] = dict(model=model.name, backend=backend if isinstance(backend, str) else
                                 getattr(backend, "__name__", "?"),
                                 fused=bool(fused), iterations=iterations, **shape)
    return ref


def _check_iterations(iterations):
    """Raise ValueError unless iterations is an int >= 1."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be a number of iterations >= 1, got {iterations!r}")


def _check_footprint(footprint):
    """Raise ValueError unless footprint is None or a number of bytes > 0."""
    if footprint is not None and (isinstance(footprint, bool)
                                  or not isinstance(footprint, (int, float, np.integer,
                                                                np.floating))
                                  or not 0 < footprint < float("inf")):
        raise ValueError(f"footprint={footprint!r} must be the measured footprint in bytes "
                         "(> 0), or None to measure it")


def measure_footprint(model_name, depth, backend="numpy", fused=True, **shape):
    """Peak bytes in use during one training iteration with everything in fast memory."""
    return fast_only_reference(model_name, depth, backend, fused, iterations=2,
                               **shape).meta["footprint"]


class Trainer:
    """One model training in one setup, an iteration at a time (so a benchmark can interleave
    setups: each ``step()`` is one iteration; ``close()`` releases the manager's memory).

    fast: the manager's fast memory; dram_cache: the simulated DRAM cache of the 2LM setups.
    Each is bytes, a size string or a percentage of the measured footprint (e.g. "25%"); by
    default the setup's DRAM (fast memory, or the 2LM cache) is 25% of the footprint and a
    2LM manager has no fast memory. fast-only always gets fast memory for everything.
    ``budget`` (and each record's "budget") is the setup's DRAM in bytes.
    fused: apply SGD inside the backward pass (the default; see ``train_step``).

    reference: the fast-only kernel times (``fast_only_reference`` of the same model, shapes,
    backend and fused setting; a saved one loads with ``ca.Trace.load``). By default one is
    measured when first needed: at construction if the footprint is (a percentage budget or
    the fast-only setup, with no ``footprint`` given; the reference's footprint is then the
    measured one), else at the first step. profile: the cost model's profile of the slow tier
    (a name in ``cachedarrays.costmodel.PROFILES`` or a Profile; None: optane).
    """

    def __init__(self, model_name="resnet", depth=18, setup="LM", fast=None, backend="numpy",
                 batch=4, image=16, channels=3, classes=10, width=8, lr=0.01, seed=0,
                 profile=None, slow=None, event_log=None, line_size=64, fused=True,
                 footprint=None, dram_cache=None, reference=None):
        setup = check_setup(setup)
        fused = check_switch(fused, "Trainer: fused")
        _check_footprint(footprint)
        if _is_2lm(setup):
            fast = 0 if fast is None else fast
            dram_cache = "25%" if dram_cache is None else dram_cache
        else:
            if dram_cache is not None:
                raise _no_dram_cache(setup, dram_cache)
            fast = "25%" if fast is None else fast
        shape = dict(batch=batch, image=image, channels=channels, classes=classes, width=width)
        model = build(model_name, depth, **shape)
        self._reference_args = (model_name, depth, backend, fused, shape)
        if footprint is None and reference is not None:
            footprint = reference.meta.get("footprint")
        if footprint is None and (_is_percentage(fast) or _is_percentage(dram_cache)
                                  or setup == "fast-only"):
            reference = fast_only_reference(model_name, depth, backend, fused, **shape)
            footprint = reference.meta["footprint"]
        self._reference = reference
        if setup == "fast-only":
            fast = int(model.footprint_estimate() * 1.5) + (16 << 20)
        else:
            fast = parse_budget(fast, footprint, "fast memory size")
        if dram_cache is not None:
            dram_cache = parse_budget(dram_cache, footprint, "DRAM cache size")
        budget = fast if dram_cache is None else dram_cache
        need = model.footprint_estimate()
        if slow is None:
            slow = 3 * need + (64 << 20)
        slow = ca.parse_size(slow, "slow memory size")
        room = slow + (0 if _is_2lm(setup) else fast)
        if room < need:
            held = (f"slow ({ca.format_size(slow)}) memory holds" if _is_2lm(setup) else
                    f"fast ({ca.format_size(fast)}) plus slow ({ca.format_size(slow)}) memory hold")
            raise MemoryError(
                f"{model.name} with batch {batch} and {image}x{image} images needs about "
                f"{ca.format_size(need)} per training iteration, but {held} only "
                f"{ca.format_size(room)}; use a larger slow size or a smaller batch")
        self.model, self.setup, self.budget, self.footprint = model, setup, budget, footprint
        self.seed, self.profile, self.fused, self.iteration = seed, profile, fused, 0
        self.m, self.s = make_session(setup, fast, slow, backend, line_size=line_size,
                                      event_log=event_log, dram_cache=dram_cache)
        model.init(self.s, seed)
        self.opt = SGD(lr)

    @property
    def reference(self):
        """The fast-only reference trace (measured now if none was given or measured yet)."""
        if self._reference is None:
            name, depth, backend, fused, shape = self._reference_args
            self._reference = fast_only_reference(name, depth, backend, fused, **shape)
        return self._reference

    def step(self):
        """Run one iteration, recorded with ``ca.trace``; returns its record.

        Record keys: iteration, setup, loss, wall (seconds of the training step on this
        machine), budget, footprint, stats (``m.stats()`` of the iteration), trace (its
        ``ca.Trace``: one step), run (``cachedarrays.replay.Run`` of the trace with the
        reference's kernel times), step (the cost model's StepResult), figures (``figures(step)``),
        modelled (= step.time), stall (= step.stall) and memory_mode (the 2LM cache's counters
        of the iteration, or None).
        """
        m, s, it = self.m, self.s, self.iteration
        ref = self.reference
        x, y = synthetic_batch(self.model, self.seed + it)
        m.reset_stats()
        cache = getattr(m.policy, "cache", None)
        if cache is not None:
            cache.reset(keep_contents=True)      # per-iteration counters of a warm cache
        m.count("cnn_iteration", 0, iteration=it)
        with ca.trace(m) as tr:
            t = time.perf_counter()
            loss = train_step(s, self.model, x, y, self.opt, fused=self.fused)
            wall = time.perf_counter() - t
        stats = m.stats()
        self.iteration += 1
        run = evaluate(tr, ref, self.profile)
        step = run.last
        rec = {"iteration": it, "setup": self.setup, "loss": loss, "wall": wall,
               "budget": self.budget, "footprint": self.footprint, "stats": stats,
               "trace": tr, "run": run, "step": step, "figures": figures(step),
               "modelled": step.time, "stall": step.stall,
               "memory_mode": cache.stats().as_dict() if cache is not None else None}
        log.debug("%s setup %s iteration %d: loss %.4f, wall %.3f s, modelled %.3f s",
                  self.model.name, self.setup, it, loss, wall, rec["modelled"])
        return rec

    def close(self):
        """Release the manager (its devices and every array)."""
        self.m.close()


def run(model_name="resnet", depth=18, setup="LM", fast=None, iterations=2, backend="numpy",
        batch=4, image=16, channels=3, classes=10, width=8, lr=0.01, seed=0, profile=None,
        slow=None, callback=None, event_log=None, line_size=64, fused=True, dram_cache=None,
        footprint=None, reference=None):
    """Train a model for some iterations in one setup; returns a list of per-iteration dicts
    (``Trainer.step`` records).

    fast, dram_cache: as for ``Trainer`` (bytes, a size string or a percentage of the measured
    footprint such as "25%"); ``dram_budget(setup, size)`` gives every setup the same DRAM.
    reference: fast-only kernel times (``fast_only_reference``); pass one to several runs to
    give them the same times (and footprint).
    """
    _check_iterations(iterations)
    tr = Trainer(model_name, depth, setup, fast, backend, batch, image, channels, classes, width,
                 lr, seed, profile, slow, event_log, line_size, fused, footprint=footprint,
                 dram_cache=dram_cache, reference=reference)
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
