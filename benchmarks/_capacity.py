"""The largest batch that trains in a fast memory budget under a policy (Capuchin's Table 2).

A batch *trains* when the replay of its trace (``BatchFamily.at(batch)``, ``ca.replay`` on
virtual devices) finishes without ``OutOfMemoryError``; under kernels-in-fast mode that is the
GPU rule (every kernel's operands in fast memory). Replays are deterministic, so is the search:
a doubling (or halving) phase from the largest batch whose footprint fits, then bisection.
Only the first ``steps`` steps are replayed (default 2: the first step, where planning policies
measure, and one steady step).
"""

import time

import cachedarrays as ca
from cachedarrays.batching import BatchFamily
from cachedarrays.registry import resolve
from cachedarrays.sizes import format_size, parse_size

__all__ = ["max_batch", "step_ratio", "describe", "STEPS", "MAX_BATCH"]

STEPS = 2
# The largest batch a search tries unless told: a policy that spills to slow memory (without
# kernels-in-fast) never runs out of fast memory, so its search would not end.
MAX_BATCH = 1024


def _fast_bytes(fast):
    if isinstance(fast, float) and not fast.is_integer():
        raise ValueError(f"fast={fast!r}: give fast memory in bytes or as a size such as "
                         "'256MiB' (a fraction of the footprint would change with the batch)")
    return parse_size(fast, "fast memory size")


def _policy_for(policy, policy_options):
    """A function (batch, trace) -> what ``ca.replay`` takes as policy."""
    options = dict(policy_options or {})
    if isinstance(policy, str):
        resolve(policy)                 # an unknown name fails now, not per replay
        return lambda batch, trace: policy, options
    if isinstance(policy, type):
        return lambda batch, trace: policy, options
    if hasattr(policy, "bind"):
        raise TypeError("give the policy as a name, a Policy class or a factory (batch, trace) "
                        "-> new Policy: each replay needs a policy instance of its own")
    if callable(policy):
        extra = sorted(set(options) - {"kernels_in_fast"})
        if extra:
            raise ValueError(f"policy_options {extra} apply to a policy name or class; a factory "
                             "makes its own instance: pass them to it (only kernels_in_fast "
                             "applies to an instance)")
        return policy, options
    raise TypeError(f"policy must be a name, a Policy class or a factory (batch, trace) -> "
                    f"Policy, not {type(policy).__name__}")


def _check(family):
    if not isinstance(family, BatchFamily):
        raise TypeError(f"give a BatchFamily (cachedarrays.batching), not {type(family).__name__}")


def _replay(family, batch, make, options, fast, steps, replay_kw):
    trace = family.at(batch, steps=steps)
    return ca.replay(trace, make(batch, trace), fast=fast, policy_options=options or None,
                     **replay_kw)


def _largest(pred, hi):
    """The largest b in 1..hi with pred(b) true, for pred true up to some batch then false
    (0 if pred(1) is false, hi if pred(hi) is true)."""
    lo, top = 0, hi + 1
    while top - lo > 1:
        mid = (lo + top) // 2
        lo, top = (mid, top) if pred(mid) else (lo, mid)
    return lo


def max_batch(family, policy, fast, *, policy_options=None, steps=None, hi=None, start=None,
              **replay_kw):
    """(batch, info): the largest batch of ``family`` whose replay under ``policy`` in ``fast``
    bytes of fast memory ends without OutOfMemoryError; 0 when batch 1 does not fit.

    policy: a registered name, a Policy class (both with ``policy_options``) or a factory
    ``(batch, trace) -> Policy``. steps: steps replayed (default ``STEPS``; one step is not
    enough: planning policies measure the first). hi: the largest batch tried (default
    ``MAX_BATCH``; info["capped"] is True when it fit). start: the first batch tried (default:
    the largest batch whose footprint fits, at least 1). replay_kw: more ``ca.replay``
    keywords (profile, slow, fault_latency, ...).

    info: tried (list of (batch, fits, seconds)), replays, seconds, footprint_batch (the largest
    batch whose footprint fits in fast memory), error (the message at the smallest failing
    batch tried), steps, fast, capped.
    """
    _check(family)
    fast = _fast_bytes(fast)
    steps = STEPS if steps is None else steps
    make, options = _policy_for(policy, policy_options)
    hi = MAX_BATCH if hi is None else hi
    if isinstance(hi, bool) or not isinstance(hi, int) or hi < 1:
        raise ValueError(f"hi={hi!r}: give the largest batch to try, a whole number >= 1")
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 1):
        raise ValueError(f"start={start!r}: give the first batch to try, a whole number >= 1")
    fits_fp = _largest(lambda b: family.footprint(b) <= fast, hi)
    tried, errors = {}, {}
    t0 = time.perf_counter()

    def fits(b):
        if b not in tried:
            t = time.perf_counter()
            try:
                _replay(family, b, make, options, fast, steps, replay_kw)
                ok = True
            except ca.OutOfMemoryError as e:
                ok = False
                errors[b] = str(e)
            tried[b] = (ok, time.perf_counter() - t)
        return tried[b][0]

    b = min(max(1, fits_fp) if start is None else start, hi)
    if fits(b):                                  # double until a batch fails (or hi fits)
        lo, top = b, None
        while top is None and lo < hi:
            nxt = min(lo * 2, hi)
            if fits(nxt):
                lo = nxt
            else:
                top = nxt
    else:                                        # halve until a batch fits (or 1 fails)
        top = b
        lo = b // 2
        while lo >= 1 and not fits(lo):
            top, lo = lo, lo // 2
    if top is not None:                          # bisect between lo (fits) and top (fails)
        while top - lo > 1:
            mid = (lo + top) // 2
            if fits(mid):
                lo = mid
            else:
                top = mid
    failed = sorted(b for b, (ok, _) in tried.items() if not ok)
    info = dict(batch=lo, tried=[(b, ok, s) for b, (ok, s) in tried.items()],
                replays=len(tried), seconds=time.perf_counter() - t0, footprint_batch=fits_fp,
                error=errors[failed[0]] if failed else None, steps=steps, fast=fast,
                capped=lo == hi)
    return lo, info


def step_ratio(family, batch, policy, fast, *, policy_options=None, steps=None, **replay_kw):
    """Modelled time of the last replayed step of ``family.at(batch)`` under ``policy`` in
    ``fast`` bytes of fast memory, over its fast-only time (the sum of its kernel times).
    OutOfMemoryError when the batch does not train there. Arguments as for ``max_batch``."""
    _check(family)
    fast = _fast_bytes(fast)
    steps = STEPS if steps is None else steps
    make, options = _policy_for(policy, policy_options)
    return _replay(family, batch, make, options, fast, steps, replay_kw).ratio


def describe(name, batch, info):
    """One line of a max-batch search."""
    return (f"{name}: max batch {batch} in {format_size(info['fast'])} of fast memory "
            f"(footprint fits up to batch {info['footprint_batch']}); {info['replays']} replays "
            f"of {info['steps']} steps in {info['seconds']:.1f} s")
