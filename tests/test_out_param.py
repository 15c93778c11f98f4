"""A CachedArray that a NumPy function writes keeps the write across an eviction.

Every NumPy function with an ``out`` parameter (found by signature, so a new one is covered),
every ufunc, the ufunc methods, the CachedArray methods that forward ``out`` and the in-place
functions are called with a CachedArray as the written argument, given by position and by
name, in fast and in slow memory. The array is then evicted and prefetched, and its values
must equal the same call on plain ndarrays: a write that did not mark the array dirty is
dropped by the eviction (counted as an elided writeback) and the values show it.
"""

import inspect
import re
import warnings

import numpy as np
import pytest

import cachedarrays as ca
from helpers import assert_eq

MODULES = (np, np.linalg, np.fft)


@pytest.fixture(scope="module")
def m():
    mgr = ca.Manager(fast="4MiB", slow="64MiB")
    yield mgr
    mgr.close()


# ---- discovery -------------------------------------------------------------------------------

def _signature(f):
    """The signature of a NumPy function, or of its implementation when only that has one."""
    for g in (f, getattr(f, "_implementation", None), getattr(f, "__wrapped__", None)):
        if g is None:
            continue
        try:
            return inspect.signature(g)
        except (TypeError, ValueError):
            pass
    return None


def _name(mod, name):
    return name if mod is np else f"{mod.__name__.split('.')[-1]}.{name}"


def _functions_with_out():
    """{name: function} for every public NumPy function whose signature has `out`."""
    found = {}
    for mod in MODULES:
        for name in dir(mod):
            f = getattr(mod, name)
            if name.startswith("_") or isinstance(f, (type, np.ufunc)) or not callable(f):
                continue
            sig = _signature(f)
            if sig is not None and "out" in sig.parameters:
                found[_name(mod, name)] = f
    return dict(sorted(found.items()))


def _ufuncs():
    """{name: ufunc} for every ufunc in the NumPy namespaces (aliases once)."""
    found = {}
    for mod in MODULES:
        for name in dir(mod):
            f = getattr(mod, name)
            if isinstance(f, np.ufunc):
                found.setdefault(f.__name__, f)
    return dict(sorted(found.items()))


FUNCTIONS = _functions_with_out()
UFUNCS = _ufuncs()


def _elided(m):
    ev = m.stats()["events"].get("writebacks_elided", 0)
    return ev["count"] if isinstance(ev, dict) else ev


# ---- argument makers (plain NumPy values, by parameter name) ---------------------------------

RNG = np.random.default_rng(7)


def F(*shape):
    """Random floats in [0.1, 0.9), shape (4, 5) unless given."""
    return RNG.uniform(0.1, 0.9, shape or (4, 5))


def _with_specials():
    a = F() * 10
    a[0, 0], a[1, 1], a[2, 2] = np.inf, -np.inf, np.nan
    return a


def _dates():
    return np.datetime64("2024-01-01") + np.arange(6)


def _reduce():
    return {"a": F(), "axis": 0}


def _nan_reduce():
    a = F()
    a[1, 2] = np.nan
    return {"a": a, "axis": 0}


def _percentiles(q):
    return lambda: {"a": F(), "q": q, "axis": 0}


def _fft(complex_input):
    def make():
        a = F(4, 8)
        return {"a": np.fft.rfft(a) if complex_input else a}
    return make


MAKERS = {
    **dict.fromkeys(["all", "any", "amax", "amin", "max", "min", "argmax", "argmin", "mean",
                     "prod", "ptp", "std", "sum", "var", "cumprod", "cumsum", "median"],
                    _reduce),
    **dict.fromkeys(["nanargmax", "nanargmin", "nancumprod", "nancumsum", "nanmax", "nanmean",
                     "nanmedian", "nanmin", "nanprod", "nanstd", "nansum", "nanvar"],
                    _nan_reduce),
    **dict.fromkeys(["cumulative_prod", "cumulative_sum"], lambda: {"x": F(), "axis": 0}),
    **dict.fromkeys(["around", "round"], lambda: {"a": F() * 10, "decimals": 1}),
    **dict.fromkeys(["fix", "isneginf", "isposinf"], lambda: {"x": _with_specials()}),
    **dict.fromkeys(["percentile", "nanpercentile"], _percentiles(np.array([25.0, 50.0]))),
    **dict.fromkeys(["quantile", "nanquantile"], _percentiles(np.array([0.25, 0.5]))),
    **dict.fromkeys(["concat", "concatenate", "stack"],
                    lambda: {"arrays": [F(), F()], "axis": 0}),
    "clip": lambda: {"a": F(), "a_min": 0.3, "a_max": 0.6},
    "choose": lambda: {"a": RNG.integers(0, 3, (4, 5)), "choices": [F(), F(), F()]},
    "compress": lambda: {"condition": np.array([True, False, True, True]), "a": F(),
                         "axis": 0},
    "dot": lambda: {"a": F(4, 5), "b": F(5, 3)},
    "outer": lambda: {"a": F(4), "b": F(3)},
    "einsum": lambda: {"operands": ("ij,jk->ik", F(4, 5), F(5, 3))},
    "take": lambda: {"a": F(), "indices": np.array([0, 2, 3]), "axis": 1},
    "trace": lambda: {"a": F(3, 3, 4)},
    "busday_count": lambda: {"begindates": _dates(), "enddates": _dates() + 10},
    "busday_offset": lambda: {"dates": _dates(), "offsets": np.arange(6),
                              "roll": "forward"},
    "is_busday": lambda: {"dates": _dates()},
    "linalg.multi_dot": lambda: {"arrays": [F(4, 5), F(5, 3), F(3, 2)]},
    **{f"fft.{n}": _fft(False) for n in ("fft", "fft2", "fftn", "ifft", "ifft2", "ifftn",
                                         "rfft", "rfft2", "rfftn", "ihfft")},
    **{f"fft.{n}": _fft(True) for n in ("hfft", "irfft", "irfft2", "irfftn")},
}

# Functions whose `out` makes no sense with CachedArrays. None so far: every function NumPy
# offers with `out` is covered above. Add a name here only with the reason next to it.
EXCLUDED = {}

# Functions whose `out` NumPy itself never reaches by position: the parameters before it
# (weekmask, holidays, busdaycal) refuse every combination of values.
OUT_NEVER_POSITIONAL = {"busday_count", "busday_offset", "is_busday"}


# ---- calling ---------------------------------------------------------------------------------

def _cached(m, x):
    """x with every ndarray in it copied into a CachedArray."""
    if isinstance(x, np.ndarray):
        return ca.asarray(x, manager=m)
    if isinstance(x, list):
        return [_cached(m, y) for y in x]
    if isinstance(x, tuple):
        return tuple(_cached(m, y) for y in x)
    if isinstance(x, dict):
        return {k: _cached(m, y) for k, y in x.items()}
    return x


def _call(f, sig, values, target, written, target_by_position, rest_by_position=None,
          skip=()):
    """Call f with values (by parameter name) and `written` for parameter `target`.

    target_by_position: every parameter up to and including the target is passed by position
    (defaults fill the gaps). Otherwise the target is named, and so is every other parameter
    that may be, unless rest_by_position (then those before the target go by position).
    written None leaves the target out of the call.
    """
    if rest_by_position is None:
        rest_by_position = target_by_position
    params = [p for p in sig.parameters.values() if p.name not in skip]
    names = [p.name for p in params]
    if target_by_position:
        last = names.index(target)
    elif rest_by_position:
        last = max((i for i, n in enumerate(names[:names.index(target)]) if n in values),
                   default=-1)
    else:
        last = -1
    args, kwargs = [], {}
    for i, p in enumerate(params):
        given = written if p.name == target else values.get(p.name)
        if given is None and p.name not in values:
            given = inspect.Parameter.empty
        if p.kind is p.VAR_POSITIONAL:
            args.extend(given if given is not inspect.Parameter.empty else ())
        elif p.kind is p.VAR_KEYWORD or given is inspect.Parameter.empty and i > last:
            continue
        elif p.kind is p.POSITIONAL_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and i <= last):
            args.append(p.default if given is inspect.Parameter.empty else given)
        else:
            kwargs[p.name] = given
    return f(*args, **kwargs)


def _positional(sig, target):
    p = sig.parameters[target]
    return p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)


def _unlike(result):
    """Starting contents for an output: every element differs from the result to come."""
    r = np.asarray(result)
    if r.dtype.kind == "b":
        return ~r
    if r.dtype.kind in "fc":
        return np.where(np.isnan(r), -7, r + 1).astype(r.dtype)
    if r.dtype.kind in "mM":
        return r + np.timedelta64(1, np.datetime_data(r.dtype)[0])
    return (r + 1).astype(r.dtype)


def _new_target(m, initial, placement):
    """A CachedArray holding `initial`, clean (its last write already in slow memory), on
    `placement`."""
    c = ca.asarray(initial, manager=m, placement=placement)
    ca.evict(c)
    if placement == "fast":
        ca.prefetch(c, force=True)      # clean in fast memory, linked to its slow copy
    assert c.device == placement
    return c


def _values(c):
    with ca.readable(c) as v:
        return v.copy()


def _survives_eviction(m, c, want):
    """c holds `want` now, and still after an eviction and a prefetch (none of it elided)."""
    assert_eq(c, want, rtol=1e-12, atol=1e-12)
    before = _elided(m)
    ca.evict(c)
    assert _elided(m) == before, "the eviction dropped a write that was not marked dirty"
    ca.prefetch(c, force=True)
    assert_eq(c, want, rtol=1e-12, atol=1e-12)


MODES = ["positional", "keyword"]
PLACES = ["fast", "slow"]


def _function_cases():
    for name, f in FUNCTIONS.items():
        modes = MODES if _positional(_signature(f), "out") and \
            name not in OUT_NEVER_POSITIONAL else ["keyword"]
        for mode in modes:
            for place in PLACES:
                for inputs in ("cached", "plain"):
                    yield pytest.param(name, mode, place, inputs,
                                       id=f"{name}-{mode}-{place}-{inputs}")


# ---- NumPy functions with `out` --------------------------------------------------------------

def test_discovery_finds_the_functions_known_to_take_out():
    assert {"clip", "dot", "cumsum", "around", "sum", "einsum", "linalg.multi_dot",
            "fft.fft"} <= set(FUNCTIONS)
    assert {"add", "matmul", "modf", "divmod"} <= set(UFUNCS)


def test_exclusions_name_discovered_functions():
    assert set(EXCLUDED) <= set(FUNCTIONS), "stale exclusion: NumPy no longer has it with out"
    assert OUT_NEVER_POSITIONAL <= set(FUNCTIONS)


@pytest.mark.parametrize("name", sorted(OUT_NEVER_POSITIONAL))
def test_numpy_still_refuses_positional_out(name):
    f = FUNCTIONS[name]
    values = MAKERS[name]()
    want = np.asarray(_call(f, _signature(f), values, "out", None, False)).copy()
    with pytest.raises((TypeError, ValueError)):
        _call(f, _signature(f), values, "out", want, True)


@pytest.mark.parametrize("name, mode, place, inputs", list(_function_cases()))
def test_function_out_write_survives_eviction(m, name, mode, place, inputs):
    """np.clip(a, 0.3, 0.6, c), np.dot(a, b, out=c), ...; the inputs CachedArrays or not."""
    if name in EXCLUDED:
        pytest.skip(EXCLUDED[name])
    maker = MAKERS.get(name)
    if maker is None:
        pytest.fail(f"numpy {name} takes `out` but this file has no argument maker for it; "
                    "add one to MAKERS (or, with a reason, to EXCLUDED)")
    f = FUNCTIONS[name]
    sig = _signature(f)
    values = maker()
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        initial = _unlike(_call(f, sig, values, "out", None, False))
        c = _new_target(m, initial, place)
        want = initial.copy()
        returned = _call(f, sig, values, "out", want, mode == "positional")
        given = _cached(m, values) if inputs == "cached" else values
        got = _call(f, sig, given, "out", c, mode == "positional")
    _survives_eviction(m, c, want)
    if returned is want:
        assert got is c, f"numpy returns out; got {type(got).__name__}"


# ---- ufuncs ----------------------------------------------------------------------------------

_LOOP_PREFERENCE = ("d", "dl", "dq", "di", "q", "l", "?", "M", "m")


def _ufunc_loop(uf):
    """The input type codes of a loop of uf that plain values exercise (floats first)."""
    loops = [t.split("->")[0] for t in uf.types]
    for pref in _LOOP_PREFERENCE:
        for ins in loops:
            if set(ins) == set(pref):
                return ins
    raise AssertionError(f"ufunc {uf.__name__} has no loop on plain types: {uf.types}")


def _ufunc_inputs(uf):
    core = [1] * uf.nin
    if uf.signature:
        ins = uf.signature.split("->")[0]
        core = [len([d for d in g.split(",") if d.strip()]) for g in re.findall(r"\(([^)]*)\)",
                                                                              ins)]
    inputs = []
    for code, ncore in zip(_ufunc_loop(uf), core):
        shape = (4,) + (3,) * ncore if uf.signature else (4, 5)
        dt = np.dtype(code)
        if dt.kind == "f":
            inputs.append(F(*shape))
        elif dt.kind in "iu":
            inputs.append(RNG.integers(1, 5, shape).astype(dt))
        elif dt.kind == "b":
            inputs.append(RNG.integers(0, 2, shape).astype(bool))
        elif dt.kind == "M":
            inputs.append(np.datetime64("2024-01-01") + RNG.integers(0, 9, shape))
        else:
            inputs.append(RNG.integers(0, 9, shape).astype("m8[D]"))
    return inputs


def _ufunc_cases():
    for name in UFUNCS:
        for mode in MODES:
            for place in PLACES:
                yield pytest.param(name, mode, place, id=f"{name}-{mode}-{place}")


def _ufunc_out_call(uf, inputs, outs, mode):
    if mode == "positional":
        with warnings.catch_warnings():         # NumPy 2.4 deprecates np.maximum(a, b, out)
            warnings.simplefilter("ignore", DeprecationWarning)
            return uf(*inputs, *outs)
    return uf(*inputs, out=outs if len(outs) > 1 else outs[0])


@pytest.mark.parametrize("name, mode, place", list(_ufunc_cases()))
def test_ufunc_out_write_survives_eviction(m, name, mode, place):
    uf = UFUNCS[name]
    inputs = _ufunc_inputs(uf)
    with np.errstate(all="ignore"):
        results = uf(*inputs)
        results = results if uf.nout > 1 else (results,)
        cs = tuple(_new_target(m, _unlike(r), place) for r in results)
        want = tuple(_unlike(r) for r in results)
        returned = _ufunc_out_call(uf, inputs, want, mode)
        got = _ufunc_out_call(uf, _cached(m, inputs), cs, mode)
    for c, w in zip(cs, want):
        _survives_eviction(m, c, w)
    if uf.nout > 1:
        assert returned == want and all(g is c for g, c in zip(got, cs))
    else:
        assert got is cs[0]


UFUNC_METHODS = {
    "reduce": lambda uf, a, out: uf.reduce(a, 0, None, out),
    "accumulate": lambda uf, a, out: uf.accumulate(a, 0, None, out),
    "reduceat": lambda uf, a, out: uf.reduceat(a, np.array([0, 2]), 0, None, out),
    "outer": lambda uf, a, out: uf.outer(a[0], a[1], out=out),
}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("method", sorted(UFUNC_METHODS))
@pytest.mark.parametrize("uf", [np.add, np.multiply, np.maximum, np.logical_xor],
                         ids=lambda u: u.__name__)
def test_ufunc_method_positional_out_survives_eviction(m, uf, method, place):
    call = UFUNC_METHODS[method]
    a = F()
    initial = _unlike(call(uf, a, None))
    c = _new_target(m, initial, place)
    want = initial.copy()
    assert call(uf, a, want) is want
    got = call(uf, ca.asarray(a, manager=m), c)
    _survives_eviction(m, c, want)
    assert got is c


# ---- CachedArray methods that forward `out` --------------------------------------------------

def _method_cases():
    for name in sorted(set(dir(ca.CachedArray)) & set(FUNCTIONS)):
        for mode in MODES:
            for place in PLACES:
                yield pytest.param(name, mode, place, id=f"{name}-{mode}-{place}")


def _receiver(sig):
    return "a" if "a" in sig.parameters else next(iter(sig.parameters))


@pytest.mark.parametrize("name, mode, place", list(_method_cases()))
def test_method_out_write_survives_eviction(m, name, mode, place):
    """x.sum(0, None, c), x.clip(0.3, 0.6, out=c), ... equal np.sum(a, 0, None, c), ...

    (The NumPy function is the reference: ndarray.all and ndarray.any take a dtype by
    position before out, against their documented signature.)
    """
    f = FUNCTIONS[name]
    sig = _signature(f)
    values = MAKERS[name]()
    recv = _receiver(sig)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        initial = _unlike(_call(f, sig, values, "out", None, False, True))
        c = _new_target(m, initial, place)
        want = initial.copy()
        returned = _call(f, sig, values, "out", want, mode == "positional", True)
        x = ca.asarray(values[recv], manager=m)
        got = _call(getattr(x, name), sig, _cached(m, values), "out", c, mode == "positional",
                    True, skip=(recv,))
    _survives_eviction(m, c, want)
    if returned is want:
        assert got is c


# ---- in-place functions ----------------------------------------------------------------------

# The NumPy functions that change an argument in place (not found by signature: listed).
INPLACE = {
    # name: (function, target parameter, values of the other parameters)
    "copyto": (np.copyto, "dst", lambda: {"src": F()}),
    "put": (np.put, "a", lambda: {"ind": np.array([0, 7, 13]), "v": np.array([1.5, 2.5, 3.5])}),
    "place": (np.place, "arr", lambda: {"mask": F() > 0.5, "vals": np.array([4.0, 5.0])}),
    "putmask": (np.putmask, "a", lambda: {"mask": F() > 0.5, "values": np.array([4.0, 5.0])}),
    "fill_diagonal": (np.fill_diagonal, "a", lambda: {"val": 9.0}),
    "put_along_axis": (np.put_along_axis, "arr",
                       lambda: {"indices": np.array([[1], [0], [4], [2]]),
                                "values": np.array([[6.0]]), "axis": 1}),
    "nan_to_num(copy=False)": (np.nan_to_num, "x", lambda: {"copy": False, "nan": 3.0,
                                                            "posinf": 8.0, "neginf": -8.0}),
}


def _inplace_cases():
    for name in INPLACE:
        for mode in MODES:
            for place in PLACES:
                yield pytest.param(name, mode, place, id=f"{name}-{mode}-{place}")


@pytest.mark.parametrize("name, mode, place", list(_inplace_cases()))
def test_inplace_target_write_survives_eviction(m, name, mode, place):
    f, target, maker = INPLACE[name]
    sig = _signature(f)
    values = maker()
    start = _with_specials() if f is np.nan_to_num else F()
    want = start.copy()
    returned = _call(f, sig, values, target, want, mode == "positional")
    c = _new_target(m, start, place)
    got = _call(f, sig, _cached(m, values), target, c, mode == "positional")
    _survives_eviction(m, c, want)
    if returned is want:
        assert got is c
    else:
        assert got is None and returned is None


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("f", [np.median, np.nanmedian, np.percentile, np.nanpercentile,
                               np.quantile, np.nanquantile], ids=lambda f: f.__name__)
def test_overwrite_input_leaves_one_version_of_the_data(m, f, place):
    """overwrite_input=True may reorder the input: what is read before and after an
    eviction must agree (the reordering is either kept or never happened)."""
    q = {"percentile": (50,), "nanpercentile": (50,), "quantile": (0.5,),
         "nanquantile": (0.5,)}.get(f.__name__, ())
    start = RNG.permutation(40).astype(float).reshape(8, 5)
    c = _new_target(m, start, place)
    got = f(c, *q, 0, None, True)
    np.testing.assert_allclose(np.asarray(got), f(start.copy(), *q, axis=0))
    _survives_eviction(m, c, _values(c))
