"""NEP 18 dispatch: NumPy functions called on CachedArrays.

``implements`` registers a dedicated implementation of NumPy functions (those in
``cachedarrays.routines``, and any a user adds); every other NumPy function runs on pinned views
of the arrays' current bytes (``_call_on_views``), with what it writes (its out, the input an
in-place function changes, or every array given to a function not known to be read-only)
acquired as a write, and its result wrapped as CachedArrays.
Importing this module installs its handler behind ``CachedArray.__array_function__``.
"""

import functools
import inspect

import numpy as np

from ._records import run_read as _run_read
from .array import CachedArray, set_function_handler
from .pinning import SHORT_BYTES, acquire_grouped, first_manager, objects_in, release_grouped
from .wrapping import plain_arrays, wrap

# NumPy functions that call back into Python code: never run under the manager's lock.
_CALLBACKS = {np.apply_along_axis, np.apply_over_axes, np.piecewise}

HANDLED_FUNCTIONS = {}         # NumPy function -> its dedicated implementation
# NumPy functions that write their first argument, always or when a flag has the given truth:
# nan_to_num(x, copy=False) replaces in x, and overwrite_input=True lets the median family
# reorder its input.
_INPLACE_FIRST = {np.copyto, np.put, np.place, np.putmask, np.fill_diagonal,
                  np.put_along_axis}
_INPLACE_WHEN = {np.nan_to_num: ("copy", False),
                 **dict.fromkeys((np.median, np.nanmedian, np.percentile, np.nanpercentile,
                                  np.quantile, np.nanquantile), ("overwrite_input", True))}


def _functions(module, names):
    """The functions of module with these names (those this NumPy version has)."""
    return {getattr(module, n) for n in names.split() if hasattr(module, n)}


# NumPy functions whose writes are known: out=, the target of an in-place function
# (_INPLACE_FIRST, _INPLACE_WHEN), and no other argument. Any other function (recfunctions,
# callbacks such as apply_along_axis, a library's own dispatched function) may write what it is
# given, so its arrays are acquired as writes and marked dirty: no eviction can drop the write.
_WRITES_KNOWN = _functions(np, """
    all allclose amax amin angle any append argmax argmin argpartition argsort argwhere around
    array2string array_equal array_equiv array_repr array_split array_str astype atleast_1d
    atleast_2d atleast_3d average bincount block broadcast_arrays broadcast_to busday_count
    busday_offset can_cast choose clip column_stack common_type compress concat concatenate
    convolve copy corrcoef correlate count_nonzero cov cross cumprod cumsum cumulative_prod
    cumulative_sum datetime_as_string delete diag diag_indices_from diagflat diagonal diff
    digitize dot dsplit dstack ediff1d einsum einsum_path empty_like expand_dims extract fix
    flatnonzero flip fliplr flipud full_like geomspace gradient histogram histogram2d
    histogram_bin_edges histogramdd hsplit hstack i0 imag inner insert interp intersect1d
    is_busday isclose iscomplex iscomplexobj isin isneginf isposinf isreal isrealobj ix_ kron
    lexsort linspace logspace matrix_transpose max may_share_memory mean median meshgrid min
    min_scalar_type moveaxis nan_to_num nanargmax nanargmin nancumprod nancumsum nanmax nanmean
    nanmedian nanmin nanpercentile nanprod nanquantile nanstd nansum nanvar ndim nonzero
    ones_like outer packbits pad partition percentile permute_dims poly polyadd polyder polydiv
    polyfit polyint polymul polysub polyval prod ptp quantile ravel ravel_multi_index real
    real_if_close repeat reshape resize result_type roll rollaxis roots rot90 round save savetxt
    savez savez_compressed searchsorted select setdiff1d setxor1d shape shares_memory sinc size
    sort sort_complex split squeeze stack std sum swapaxes take take_along_axis tensordot tile
    trace transpose trapezoid tril tril_indices_from trim_zeros triu triu_indices_from union1d
    unique unique_all unique_counts unique_inverse unique_values unpackbits unravel_index unstack
    unwrap vander var vdot vsplit vstack where zeros_like""")
_WRITES_KNOWN |= _functions(np.linalg, """
    cholesky cond cross det diagonal eig eigh eigvals eigvalsh inv lstsq matmul matrix_norm
    matrix_power matrix_rank matrix_transpose multi_dot norm outer pinv qr slogdet solve svd
    svdvals tensordot tensorinv tensorsolve trace vecdot vector_norm""")
_WRITES_KNOWN |= _functions(np.fft, """
    fft fft2 fftn fftshift hfft ifft ifft2 ifftn ifftshift ihfft irfft irfft2 irfftn rfft rfft2
    rfftn""")
_WRITES_KNOWN |= _functions(np.char, """
    add capitalize center decode encode equal expandtabs greater greater_equal join less
    less_equal ljust lower mod multiply not_equal replace rjust rsplit split splitlines swapcase
    title translate upper zfill""")
_WRITES_KNOWN |= _functions(np.emath, "arccos arcsin arctanh log log10 log2 logn power sqrt")
_WRITES_KNOWN |= _functions(np.lib.stride_tricks, "sliding_window_view")
_WRITES_KNOWN = frozenset(_WRITES_KNOWN | _INPLACE_FIRST)
# NumPy functions reached only through like= (NEP 35); NumPy passes the like= array as self and
# drops the keyword, which the call gets back so its result lands on that array's manager.
_LIKE_ONLY = frozenset(_functions(np, """
    arange array asanyarray asarray ascontiguousarray asfortranarray empty eye frombuffer
    fromfile fromfunction fromiter fromstring full genfromtxt identity loadtxt ones require tri
    zeros"""))


def implements(*numpy_functions):
    """Register a dedicated implementation of NumPy functions for CachedArray."""
    def decorator(fn):
        for f in numpy_functions:
            HANDLED_FUNCTIONS[f] = fn
        return fn
    return decorator


_entries = [0]


def entries():
    """How many times CachedArray.__array_function__ was entered so far (all threads).

    A NumPy function called on CachedArrays enters it once; the difference around a call
    shows whether the implementation dispatched again (benchmarks and tests read it).
    """
    return _entries[0]


def _array_function(self, func, types, args, kwargs):
    """CachedArray.__array_function__: the dedicated implementation, else the general path.

    Types other than CachedArray and ndarray (and their subclasses) get NotImplemented, so NumPy
    tries them next.
    """
    _entries[0] += 1
    for t in types:
        if t is not CachedArray and not (issubclass(t, CachedArray) or issubclass(t, np.ndarray)):
            return NotImplemented
    if func in _LIKE_ONLY:
        self._check_live()              # a freed array is no model for a new one
        kwargs = {**kwargs, "like": self}
    impl = HANDLED_FUNCTIONS.get(func)
    if impl is not None:
        return impl(*args, **kwargs)
    if not kwargs:
        limit = _FLAT.get(func)
        if limit is None:
            limit = _flat_limit(func)
        if len(args) < limit:                   # writes nothing: skip the general preamble
            res = _read_only_call(func, args, _NO_KWARGS)
            if res is not _GENERAL:
                return res
    return _call_on_views(func, args, kwargs)


_FLAT = {}        # NumPy function -> 1 + the number of positional arguments before its out=


def _flat_limit(func):
    """One more than the positional arguments a call of func may have and still write nothing
    (0 for a function whose writes are not known or that writes an input): such calls without
    keywords go to ``_read_only_call`` directly."""
    out_at, target_at = (_WRITES.get(func) or _writes_of(func))[:2]
    if func not in _WRITES_KNOWN or target_at is not None:
        limit = 0
    elif out_at is None or out_at[0] is None:
        limit = 1 << 30
    else:
        limit = out_at[0] + 1
    if len(_FLAT) < 4096:
        _FLAT[func] = limit
    return limit


_NO_KWARGS = {}


def _to_views_recording(x, views):
    """Replace CachedArrays in x by ndarray views (pinned by the caller), noting each pair.

    Views are writable: NumPy runs some kernels (argmax, ...) several times slower on read-only
    arrays. Functions that write an input are the known in-place ones and out= targets, which
    the caller reports as writes.
    """
    if isinstance(x, CachedArray):
        v = x._view()
        views.append((x, v))
        return v
    if isinstance(x, list):
        return [_to_views_recording(y, views) for y in x]
    if isinstance(x, tuple):
        return tuple(_to_views_recording(y, views) for y in x)
    return x


_WRITES = {}      # NumPy function -> where its written arguments sit in a call (_writes_of)


def _writes_of(func):
    """Where func's written arguments sit in a call: (out, target, flag, flag truth).

    out and target (what an in-place function writes) are (position, keyword) pairs read from
    the signature of func or of its implementation, either part None when the argument cannot
    be given that way; target is written when flag (a pair too) has the given truth, or
    always when flag is None. Cached per function, as the signature is slow to read.
    """
    params = None
    for f in (func, getattr(func, "_implementation", None), getattr(func, "__wrapped__", None)):
        if f is not None:
            try:
                params = list(inspect.signature(f).parameters.values())
                break
            except (TypeError, ValueError):
                pass

    def slot(name, index=None):
        for i, p in enumerate(params or ()):
            if p.name == name or i == index:
                positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                named = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                return (i if positional else None, p.name if named else None)
        if params is None or any(p.kind is p.VAR_KEYWORD for p in params):
            return (index, name)                   # unknown layout: as given
        return None

    out = slot("out")
    target = flag = truth = None
    if func in _INPLACE_FIRST or func in _INPLACE_WHEN:
        target = slot(None, 0)
    if func in _INPLACE_WHEN:
        name, truth = _INPLACE_WHEN[func]
        flag = slot(name)
    spec = (out, target, flag, truth)
    if len(_WRITES) < 4096:
        _WRITES[func] = spec
    return spec


def _given(args, kwargs, at, missing=None):
    """The argument at `at` (position, keyword) of a call, or `missing`."""
    pos, name = at
    if pos is not None and pos < len(args):
        return args[pos]
    return kwargs.get(name, missing) if name is not None else missing


def _call_on_views(func, args, kwargs):
    """Run a NumPy function on views of the current primary regions, then wrap the result.

    What the function writes (its out, or the array an in-place function changes), given by
    position or by keyword, is acquired as a write, which marks it dirty; so is every array
    given to a function whose writes are not known (``_WRITES_KNOWN``).
    """
    out_at, target_at, flag_at, truth = _WRITES.get(func) or _writes_of(func)
    out = _given(args, kwargs, out_at) if out_at is not None else None
    target = None
    if target_at is not None and (flag_at is None or
                                  bool(_given(args, kwargs, flag_at, not truth)) is truth):
        target = _given(args, kwargs, target_at)       # an absent flag never writes
    known = func in _WRITES_KNOWN
    if out is None and target is None and known:
        res = _read_only_call(func, args, kwargs)
        if res is not _GENERAL:
            return res
    like = kwargs.pop("like", None)
    written = list(objects_in(out)) if out is not None else []
    if target is not None:
        written += list(objects_in(target))
    rest = args
    if out is not None and out_at[0] is not None and out_at[0] < len(args):
        rest = args[:out_at[0]] + args[out_at[0] + 1:]
    read = list(objects_in(list(rest) + [v for k, v in kwargs.items() if k != "out"]))
    if not known:                                  # it may write any array it is given
        written += read
        read = []
    m = first_manager(list(args) + list(kwargs.values())) or \
        (like._m if isinstance(like, CachedArray) else None)
    done = acquire_grouped(read, written, getattr(func, "__name__", "function"))
    try:
        views = []

        nargs = [_to_views_recording(a, views) for a in args]
        nkwargs = {k: _to_views_recording(v, views) for k, v in kwargs.items()}
        res = func(*nargs, **nkwargs)
        if out is not None:
            if isinstance(out, tuple) and len(out) == 1:
                return out[0]
            return out
        if target is not None:
            for arr, v in views:
                if res is v:
                    return arr                     # NumPy returned the written array itself
        if func in _INPLACE_FIRST:
            return res
        if m is None:
            return res
        plain = [] if like is not None else \
            plain_arrays(list(args) + list(kwargs.values()), [])    # like=: a new CachedArray
        return wrap(m, res, views, plain)
    finally:
        release_grouped(done)


_GENERAL = object()
_NONE = object()          # _call_wrap's None result (run_read returns None when not taken)


def _read_only_call(func, args, kwargs):
    """The common call: it writes no argument and its arrays belong to one manager (top-level
    arguments, or lists and tuples of arrays). Runs through ``Manager.run``; _GENERAL when the
    call is not of that kind."""
    m = None
    reads = []
    nbytes = 0
    flat = True                 # every CachedArray a top-level argument (keywords: see below)
    for x in (*args, *kwargs.values()) if kwargs else args:
        tx = type(x)
        if tx is CachedArray:
            if m is None:
                m = x._m
            elif x._m is not m:
                return _GENERAL
            o = x._obj
            reads.append(o)
            nbytes += o.nbytes
        elif tx is list or tx is tuple:
            for y in x:
                if type(y) is CachedArray:
                    flat = False
                    if m is None:
                        m = y._m
                    elif y._m is not m:
                        return _GENERAL
                    reads.append(y._obj)
                    nbytes += y._obj.nbytes
                elif isinstance(y, (list, tuple, CachedArray)):
                    return _GENERAL
        elif isinstance(x, CachedArray) or tx is dict:
            return _GENERAL
    if kwargs and flat:         # a CachedArray given by keyword goes through Manager.run
        flat = not any(type(v) is CachedArray for v in kwargs.values())
    if m is None or "like" in kwargs:
        return _GENERAL
    short = nbytes <= SHORT_BYTES and func not in _CALLBACKS
    if flat and len(args) <= 8:     # in C (run_read, 8 inputs at most) unless the manager is busy
        res = _run_read(m, functools.partial(_call_wrap, func, m, args, kwargs), args,
                        tuple(reads), short)
        if res is not None:                        # None: not taken (the manager is busy)
            return None if res is _NONE else res

    def kernel(_):
        views = []
        nargs = [_to_views_recording(a, views) for a in args]
        nkwargs = {k: _to_views_recording(v, views) for k, v in kwargs.items()} \
            if kwargs else kwargs
        return wrap(m, func(*nargs, **nkwargs), views,
                    plain_arrays(list(args) + list(kwargs.values()), []))
    return m.run(kernel, reads, (), None, getattr(func, "__name__", "function"), short)


def _call_wrap(func, m, args, kwargs, *kviews):
    """func on args, each CachedArray replaced by a view of its kernel view (run_read passes
    those, pinned), its result wrapped while they still are. func gets views of its own, as on
    the general path: a NumPy function may change the shape or flags of an array it is given,
    which the cached kernel views must never see."""
    views = [v.view() if type(a) is CachedArray else v for a, v in zip(args, kviews)]
    res = func(*views, **kwargs)
    if res is None:
        return _NONE
    if not isinstance(res, (np.ndarray, list, tuple)):
        return res                                 # a scalar: nothing to wrap
    return wrap(m, res, [(a, v) for a, v in zip(args, views) if type(a) is CachedArray],
                plain_arrays(args, []) + plain_arrays(list(kwargs.values()), []))


set_function_handler(_array_function)
