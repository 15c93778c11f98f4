"""Checks shared by the tests: ``assert_eq`` compares a CachedArray with NumPy's result.

Imported as ``from helpers import assert_eq``: pytest puts this folder on ``sys.path`` for the
test modules and conftest.py (the default "prepend" import mode).
"""

import importlib.util
import pathlib
import threading
import warnings

import numpy as np

import cachedarrays as ca

__all__ = ["assert_eq", "same", "numpy_outcome", "same_outcome", "RTOL", "load_benchmark",
           "layered_program", "layered_steps", "traced_training", "beside_fast_only",
           "built_trace", "run_threads", "close_while_calling", "refuse_general_path"]


def refuse_general_path(monkeypatch, module=None, what="took the general path"):
    """Fail the test if a call leaves its routine for NumPy's general path (``module``'s
    ``_call_on_views``, by default cachedarrays.dispatch's); returns the refusing function, to
    shut other paths a call must not take too (a manager's ``acquire``, which that path pins
    through)."""
    from cachedarrays import dispatch

    def refuse(*args, **kwargs):
        raise AssertionError(what)

    monkeypatch.setattr(dispatch if module is None else module, "_call_on_views", refuse)
    return refuse


def run_threads(work, n=4):
    """work(0) ... work(n-1), each on its own thread, started together and all joined."""
    threads = [threading.Thread(target=work, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def close_while_calling(m, calls, delay, errors=Exception, rounds=100_000):
    """Run calls() up to rounds times on another thread and close m after delay seconds.
    Returns (the thread is still alive, the errors of the listed kinds the calls stopped with):
    a close must neither hang nor crash the caller."""
    import time

    caught, started = [], threading.Event()

    def work():
        started.set()
        try:
            for _ in range(rounds):
                calls()
        except errors as e:
            caught.append(e)

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    time.sleep(delay)
    m.close()
    t.join(30)
    return t.is_alive(), caught


def load_benchmark(name):
    """The module of benchmarks/<name>.py (the benchmarks are scripts, not a package)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

def layered_program(m, n=20_000, arrays=4, steps=4):
    """Arrays used in turn, a layer each, then the first updated, for steps steps (a repeating
    program for plans); returns the final data of the arrays as ndarrays."""
    return [np.asarray(w.copy()) for w in layered_steps(m, n, arrays, steps)]


def layered_steps(m, n=20_000, arrays=4, steps=4):
    """The steps of ``layered_program``; returns the arrays (CachedArrays)."""
    ws = [ca.asarray(np.full(n, float(i)), manager=m) for i in range(arrays)]
    for _ in range(steps):
        h = ca.zeros(n, manager=m)
        for i, w in enumerate(ws):
            with ca.kernel(f"acc{i}", (w,), (h,)) as (a, out):
                out += a
            ca.mark_layer(m)
        with ca.kernel("update", (h,), (ws[0],)) as (a, out):
            out += a / 100
        del h
        ca.mark_step(m)
    return ws


def beside_fast_only(policy, program, fast, slow="8MiB"):
    """Run program under fast-only, then traced under policy (fast bytes); checks the data is
    equal and returns (trace, closed manager) of the policy's run."""
    with ca.Manager(fast="64MiB", slow="1MiB", policy="fastonly") as ref:
        want = program(ref)
    with ca.Manager(fast=fast, slow=slow, policy=policy) as m:
        with ca.trace(m) as t:
            got = program(m)
        m.wait_copies()
        m.check()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    return t, m


def traced_training(setup="LM", budget="96KiB", steps=3, name="resnet", depth=18, shape=None,
                    slow="64MiB"):
    """(model, trace of init + steps CNN training iterations, closed manager, final weights)
    of one setup."""
    from cachedarrays.models import cnn
    model = cnn.build(name, depth, **(shape or dict(batch=2, image=16, classes=5, width=16)))
    m, s = cnn.make_session(setup, slow=slow, backend="numpy", **cnn.dram_budget(setup, budget))
    with m:
        with ca.trace(m) as t:
            model.init(s, seed=3)
            for i in range(steps):
                x, y = cnn.synthetic_batch(model, seed=i)
                cnn.train_step(s, model, x, y, cnn.SGD(0.05))
        m.wait_copies()
        weights = model.weights()
    return model, t, m, weights


# Relative tolerance of inexact comparisons, by the byte size of one real component: a few
# thousand units in the last place, enough for a reordered sum, too little for a wrong value.
RTOL = {2: 1e-3, 4: 1e-6, 8: 1e-12}


def assert_eq(cached, expected, check_manager=True, *, exact=False, rtol=None, atol=0.0):
    """Assert that a CachedArray holds NumPy's result: same dtype, same shape, same values.

    Integers, booleans, strings, dates and structured fields compare exactly; floating and
    complex values compare with a tight relative tolerance (``RTOL``, or ``rtol``/``atol``),
    or exactly with ``exact=True``. NaN equals NaN. With ``check_manager`` the array's manager
    then checks its heaps and records (``m.check()``). The values are read in a read-only
    scope, so the check adds no ``np.asarray`` copy to the manager's telemetry.
    """
    assert isinstance(cached, ca.CachedArray), f"expected a CachedArray, got {type(cached)}"
    assert isinstance(expected, np.ndarray), f"expected must be an ndarray, got {type(expected)}"
    assert cached.dtype == expected.dtype, f"dtype {cached.dtype}, expected {expected.dtype}"
    assert cached.shape == expected.shape, f"shape {cached.shape}, expected {expected.shape}"
    with ca.readable(cached) as got:
        _assert_values(got, expected, exact, rtol, atol)
    if check_manager:
        cached.manager.check()


def _assert_values(got, expected, exact, rtol, atol):
    """Compare two ndarrays of one dtype field by field (padding bytes are not compared)."""
    if expected.dtype.names:
        for name in expected.dtype.names:
            _assert_values(got[name], expected[name], exact, rtol, atol)
    elif exact or expected.dtype.kind not in "fc":
        np.testing.assert_array_equal(got, expected, strict=True)
    else:
        if rtol is None:
            component = expected.dtype.itemsize // (2 if expected.dtype.kind == "c" else 1)
            rtol = RTOL.get(component, RTOL[8])
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True,
                                   strict=True)


def same(got, want):
    """Equal values and matching kinds: CachedArray <-> ndarray (exactly, via assert_eq),
    tuples and lists item by item, anything else <-> a value of the same type (not a
    CachedArray)."""
    if isinstance(want, np.ndarray):
        assert_eq(got, want, exact=True)
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            same(g, w)
    else:
        assert not isinstance(got, ca.CachedArray)
        assert type(got) is type(want), (type(got), type(want))
        np.testing.assert_array_equal(got, want)


def numpy_outcome(f):
    """f()'s result, or the type of the exception it raised (warnings ignored): a call on
    CachedArrays and the same call on ndarrays must have equal outcomes (same_outcome)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return f()
    except Exception as e:        # noqa: BLE001 - compared with NumPy's
        return type(e)


def same_outcome(got, want, exact=False):
    """got (numpy_outcome of a call on CachedArrays) against want (NumPy's): the same
    exception type; for an array, a CachedArray of its shape and dtype with equal values; for a
    scalar, an equal value. exact: bytes equal too, a scalar no CachedArray and of want's
    dtype, and an array laid out as NumPy's (strides of the axes longer than 1, where NumPy's
    is in C or F order: a CachedArray has no other layout)."""
    if isinstance(want, type):
        assert got is want
        return
    if not isinstance(want, np.ndarray):
        if exact:
            assert not isinstance(got, ca.CachedArray) and got == want and \
                np.asarray(got).dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(got, want)
        return
    assert isinstance(got, ca.CachedArray)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    if not exact:
        np.testing.assert_array_equal(np.asarray(got), want)
        return
    if want.size and (want.flags.c_contiguous or want.flags.f_contiguous):
        assert [t for t, d in zip(got.strides, got.shape) if d > 1] == \
            [t for t, d in zip(want.strides, want.shape) if d > 1]
    assert np.asarray(got).tobytes() == want.tobytes()


def built_trace(objects, resident, items, steps=3, devices=("fast", "slow"), pure=False):
    """A hand-made trace of `steps` repetitions of items: ("k", reads, writes, seconds),
    ("a", sid) to allocate, ("f", sid) to free, or "L" (a layer mark); resident objects are
    allocated before the first step. pure: every kernel is a ca.compute one."""
    events = [("alloc", s, objects[s], None) for s in resident]
    kernels, times = [], []
    for _ in range(steps):
        for it in items:
            if it == "L":
                events.append(("layer",))
            elif it[0] == "a":
                events.append(("alloc", it[1], objects[it[1]], None))
            elif it[0] == "f":
                events.append(("free", it[1]))
            else:
                k = len(kernels)
                kernels.append((f"k{k}", tuple(it[1]), tuple(it[2])))
                times.append(it[3])
                events += [("kernel", k), ("end", k)]
        events.append(("step",))
    return ca.Trace(objects, events, kernels, times, devices=list(devices),
                    pure=range(len(kernels)) if pure else ())
