"""Policy figures of CNN training from the policy lab: traces, fast-only kernel times, cost model.

The CNN has no tracer of its own: ``Session.kernel`` opens ``ca.kernel`` scopes, ``Session.rrule``
marks layers and ``train_step`` marks steps, and the runner records each iteration with
``ca.trace(m)``. The modelled time of an iteration is the deterministic cost model
(``cachedarrays.costmodel``) applied to that trace's decision log, with kernel compute times
taken once from a fast-only run of the same model (the median over its iterations after the
first; ``fast_only_reference`` in the runner) instead of the iteration's own wall times. So the
figures depend on the policy's decisions, the profile and the reference times only: the same
reference gives the same figures, bit for bit, on an idle or a loaded machine.

The 2LM setups keep every array in slow memory behind a simulated DRAM cache (the
``MemoryMode`` policy); its per-kernel traffic goes into the decision log as ``("cache", ...)``
records, which the cost model prices instead of the placement penalty.
"""

from __future__ import annotations

from cachedarrays.replay import evaluate as _evaluate
from cachedarrays.trace import TraceError

__all__ = ["FORMULA", "step_times", "with_reference_times", "evaluate", "figures"]

FORMULA = """Modelled time of one iteration (cachedarrays.costmodel; R = read, W = write bandwidth):
  T = sum over kernels k of (t_k + P_k) + stall (waits for copies a kernel needs)
  t_k = kernel k's compute time in a fast-only run of the model (median over iterations)
  P_k = r_k*(1/R_slow - 1/R_dram)                                 no output in slow memory
  P_k = max(r_k*(1/R_slow - 1/R_dram) + w_k*(1/W_slow - 1/W_dram), (F - 1)*t_k)
                                                                  an output in slow memory (F = 2)
  copies cost bytes/min(R_src, W_dst) and overlap compute unless a kernel waits for them
  2LM: P_k = traffic of the simulated DRAM cache at each device's bandwidth - r_k/R_dram - w_k/W_dram
r_k, w_k: bytes of kernel k's operands in slow memory (whole arrays)."""


def step_times(reference):
    """(kernel names, kernel times) of the last step of a reference trace."""
    groups = reference.step_kernels()
    if not groups:
        raise TraceError("the reference trace has no kernels; record a fast-only iteration")
    last = groups[-1]
    return [reference.kernels[k][0] for k in last], [reference.times[k] for k in last]


def with_reference_times(trace, reference):
    """A copy of trace whose every step gets the kernel times of the reference's last step
    (matched by position); TraceError if a step's kernels differ from the reference's."""
    names, times = step_times(reference)
    out = list(trace.times)
    for i, g in enumerate(trace.step_kernels()):
        got = [trace.kernels[k][0] for k in g]
        if got != names:
            j = next((j for j, (a, b) in enumerate(zip(got, names)) if a != b),
                     min(len(got), len(names)))
            raise TraceError(
                f"step {i} of the trace differs from the reference at kernel {j} "
                f"({got[j] if j < len(got) else 'end'} vs {names[j] if j < len(names) else 'end'}"
                f"; {len(got)} vs {len(names)} kernels): record the reference from the same "
                "model, shapes, backend and fused/unfused setting")
        for k, t in zip(g, times):
            out[k] = t
    t = trace.copy()
    t.times = out
    t.meta["times"] = reference.meta.get("times", "from a reference trace")
    return t


def evaluate(trace, reference, profile=None):
    """``cachedarrays.replay.evaluate`` of trace with the reference's kernel times: a Run whose
    ``result.steps`` are the cost model's StepResults (``last``: the last step).

    profile: None (the tiers' own profiles: dram and optane), a profile name or Profile for
    every tier but the fast one, or a dict per tier (see ``costmodel.tier_profiles``)."""
    return _evaluate(with_reference_times(trace, reference), profile=profile)


def figures(step, memory_mode=None):
    """Policy figures of one StepResult as a dict of plain numbers.

    slow/fast: the second and first tiers. ``s->f``/``f->s``: bytes copied between them;
    ``k_slow_r``/``k_slow_w``: bytes kernels read from/wrote to slow memory (for 2LM, the
    simulated cache's slow traffic); ``slow_r``/``slow_w``: all slow-memory reads/writes
    (copies plus kernels); ``peak_fast``: peak bytes allocated in fast memory.
    """
    fast, slow = step.devices[0], step.devices[1]
    s2f = step.moved.get(f"{slow}->{fast}", 0)
    f2s = step.moved.get(f"{fast}->{slow}", 0)
    kr, kw = step.kernel_read.get(slow, 0), step.kernel_write.get(slow, 0)
    return {"modelled": step.time, "compute": step.compute, "penalty": step.penalty,
            "stall": step.stall, "s->f": s2f, "f->s": f2s, "k_slow_r": kr, "k_slow_w": kw,
            "slow_r": s2f + kr, "slow_w": f2s + kw, "moved": step.bytes_moved,
            "peak_fast": step.peak.get(fast, 0), "peak_slow": step.peak.get(slow, 0),
            "kernels": step.kernels}
