"""oneDNN backend: the common kernel interface executed by oneDNN 3.x primitives through cffi.

Primitives are built once per (operation, shapes, geometry) and cached; their memory objects
hold no buffer (DNNL_MEMORY_NONE) and are re-bound to the caller's ndarrays on every call, so
no pointer survives between calls and arrays may move in between. Caller arrays are float32,
C-contiguous, in plain layouts (nchw / oihw / nc / oi / x), except the input of the batch
norms, which may be a channel slice of a larger NCHW array (a DenseNet block's concatenation
buffer; the numba kernels read it in place). Convolutions (oneDNN's choice) and
batch norm with >= 16 channels (nChw16c) by default run in blocked layouts, reordering to and
from them around each call, which is faster despite the copies; those internal tensors and
all scratchpads live in library-owned grow-only buffers (see ``buffer_bytes``), guarded by the
module's execution lock, so nothing of the caller's is retained. Convolutions run blocked
except large 1x1 ones, which run plain, and large others, which run channels-last (nhwc);
``set_conv_layouts("auto")`` instead times the three on the
first call of each shape and keeps the clearly faster; training batch
norm runs as numba kernels on NCHW directly (``set_numba_batchnorm``; inference batch norm stays
oneDNN's); ``sgd_update`` is a threaded numba pass, bitwise NumPy's float32 result (``_sgd``); the dense
forward and weight gradient run oneDNN's matmul reading the transposed operand in place (the
forward with bias and optional ReLU fused; the bias gradient is a threaded numba column sum,
``_bias``, fused with the ReLU backward pass in ``relu_backward_bias``) and the data gradient its
inner product; ``set_dense_impl("auto")`` times them against NumPy's BLAS
matmul on the first call of each shape and keeps NumPy's when clearly faster. Both measured
choices are off by default: a single timing on a shared machine picked the slower layout often
enough to make ResNet-50 and VGG-16 steps 4-6% slower than the fixed rule, and a choice that
depends on the machine's load would make two runs' floating-point results differ.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time

import llvmlite.binding as llvm
import numpy as np

from cachedarrays import threads as _threads

from . import _checks as ck
from . import _dnnl_api as api
from . import _bias, _bnorm, _sgd
from . import reference as _ref
from ._dnnl_api import OneDNNError, OneDNNNotFoundError, ffi

log = logging.getLogger(__name__)

name = "onednn"

__all__ = ["OneDNNError", "OneDNNNotFoundError", "set_threads", "get_threads", "version",
           "clear_cache", "cache_size", "impl_info", "buffer_bytes", "set_blocked_layouts",
           "set_numba_batchnorm", "set_dense_impl", "dense_choices", "set_conv_layouts",
           "conv_layout_choices", "nhwc_window"]

_lib = api.load_library()
_F32 = {"dtypes": (np.dtype(np.float32),), "contiguous": True}
_NULL = ffi.NULL
_CACHE_LIMIT = 2048

_set_handle = _lib.dnnl_memory_set_data_handle
_primitive_execute = _lib.dnnl_primitive_execute
_stream_wait = _lib.dnnl_stream_wait
# ffi.from_buffer(a) without its Python frame: the backend call it makes ('char[]' cdata).
_from_buffer = functools.partial(ffi._backend.from_buffer, ffi.BCharA)
_SUCCESS = api.SUCCESS

_dnnl_lock = threading.RLock()
_cache: "collections.OrderedDict[tuple, _Primitive]" = collections.OrderedDict()
_scratch = np.empty(0, dtype=np.uint8)
_arena = np.empty(0, dtype=np.uint8)
_blocked = True
_bn_numba = True


def _create_engine_and_stream():
    engine_p = ffi.new("dnnl_engine_t *")
    api.check(_lib, "dnnl_engine_create", engine_p, api.ENGINE_CPU, 0)
    stream_p = ffi.new("dnnl_stream_t *")
    api.check(_lib, "dnnl_stream_create", stream_p, engine_p[0], api.STREAM_DEFAULT_FLAGS)
    # engine, stream and attr live for the whole process: never destroyed, so no primitive
    # or memory object can outlive them during interpreter shutdown.
    return engine_p[0], stream_p[0], _new_attr()


def _new_attr():
    """Primitive attributes with the user scratchpad (``_scratchpad``), kept for the process."""
    attr_p = ffi.new("dnnl_primitive_attr_t *")
    api.check(_lib, "dnnl_primitive_attr_create", attr_p)
    api.check(_lib, "dnnl_primitive_attr_set_scratchpad_mode", attr_p[0], api.SCRATCHPAD_USER)
    return attr_p[0]


_engine, _stream, _attr = _create_engine_and_stream()


def version() -> str:
    """Version string of the loaded oneDNN library."""
    v = _lib.dnnl_version()
    return f"{v.major}.{v.minor}.{v.patch}"


# --- threads ------------------------------------------------------------------------------

_gomp_ffi = None
_gomp = None


def _openmp():
    """The libgomp instance oneDNN runs on (same soname, so the already-loaded copy)."""
    global _gomp_ffi, _gomp
    if _gomp is None:
        import cffi
        _gomp_ffi = cffi.FFI()
        _gomp_ffi.cdef("void omp_set_num_threads(int n); int omp_get_max_threads(void);")
        try:
            _gomp = _gomp_ffi.dlopen("libgomp.so.1")
        except OSError as exc:
            raise RuntimeError(f"cannot set oneDNN threads: libgomp.so.1 not loadable ({exc})") from None
    return _gomp


def set_threads(n: int) -> None:
    """Set the OpenMP thread count oneDNN uses for calls from this thread (default OMP_NUM_THREADS)."""
    if int(n) < 1:
        raise ValueError(f"set_threads: need n >= 1, got {n}")
    _sgd.set_threads(n)     # first: numba's pool, started, sets the OpenMP count to its size
    _openmp().omp_set_num_threads(int(n))


def get_threads() -> int:
    """OpenMP thread count oneDNN will use for calls from this thread."""
    return int(_openmp().omp_get_max_threads())


# Primitives that move little data, and convolutions with little arithmetic (their reorders
# included), run on one OpenMP thread. Under OMP_WAIT_POLICY=PASSIVE each parallel region wakes
# the sleeping threads, about 18 us on the 2-core benchmark machine: more than such a
# primitive's whole work (a 128 KiB reorder took 28 us on two threads and 11 us on one; most
# of DenseNet-121's 4x4 and 2x2 convolutions are 10-25% faster on one). The choice depends on
# shapes alone, so a given call always runs the same way. 0 turns either off.
SERIAL_BYTES = 256 << 10       # a primitive's arguments, in bytes
SERIAL_FLOPS = 20_000_000      # a convolution's or dense layer's multiply-adds times two


class _OneThread:
    """Context: the calling thread's OpenMP parallel regions use one thread (restored after)."""

    __slots__ = ("n", "gomp")

    def __enter__(self):
        self.gomp = gomp = _gomp if _gomp is not None else _openmp()
        self.n = gomp.omp_get_max_threads()
        if self.n != 1:
            gomp.omp_set_num_threads(1)

    def __exit__(self, *exc):
        if self.n != 1:
            self.gomp.omp_set_num_threads(self.n)


# --- descriptors, memories and cached primitives -----------------------------------------

_TAGS = {1: api.TAG_A, 2: api.TAG_AB, 4: api.TAG_ABCD}


def _md(dims, tag=None, dtype=api.DT_F32):
    """A plain (row-major) float32 memory descriptor, destroyed when collected."""
    dims = [int(d) for d in dims]
    tag = _TAGS[len(dims)] if tag is None else tag
    md_p = ffi.new("dnnl_memory_desc_t *")
    api.check(_lib, "dnnl_memory_desc_create_with_tag", md_p, len(dims), ffi.new("dnnl_dims_t", dims),
              dtype, tag, detail=f"dims {dims}")
    return ffi.gc(md_p[0], _lib.dnnl_memory_desc_destroy)


def _dims(values):
    return ffi.new("dnnl_dims_t", [int(v) for v in values])


def _create_pd(function: str, *args, detail: str = ""):
    pd_p = ffi.new("dnnl_primitive_desc_t *")
    api.check(_lib, function, pd_p, *args, detail=detail)
    return ffi.gc(pd_p[0], _lib.dnnl_primitive_desc_destroy)


def _md_dtype(md) -> int:
    out = ffi.new("int *")
    api.check(_lib, "dnnl_memory_desc_query", md, api.QUERY_DATA_TYPE, out)
    return out[0]


_scratch_ptr = [None, None]      # (the _scratch array, its 64-byte aligned pointer)
_arena_base = [None, 0]          # (the _arena array, the offset of its first aligned byte)


def _scratchpad(nbytes: int):
    """Pointer to at least nbytes of 64-byte aligned scratch memory (caller holds _dnnl_lock)."""
    global _scratch
    if _scratch.nbytes < nbytes + 64:
        _scratch = np.empty(max(nbytes + 64, 2 * _scratch.nbytes), dtype=np.uint8)
    if _scratch_ptr[0] is not _scratch:          # computed once per buffer (.ctypes is slow)
        _scratch_ptr[:] = _scratch, ffi.cast("void *", (_scratch.ctypes.data + 63) & ~63)
    return _scratch_ptr[1]


def _align(n: int) -> int:
    return (n + 63) & ~63


def _arena_views(sizes):
    """64-byte aligned uint8 views, one per size, of the internal-tensor arena (caller holds _dnnl_lock)."""
    global _arena
    total = sum(_align(n) for n in sizes) + 64
    if _arena.nbytes < total:
        _arena = np.empty(max(total, _arena.nbytes + _arena.nbytes // 2), dtype=np.uint8)
    if _arena_base[0] is not _arena:             # computed once per buffer (.ctypes is slow)
        _arena_base[:] = _arena, (-_arena.ctypes.data) % 64
    offset = _arena_base[1]
    views = []
    for n in sizes:
        views.append(_arena[offset:offset + n])
        offset += _align(n)
    return views


def buffer_bytes() -> int:
    """Bytes held by the library-owned scratchpad and internal-layout buffers."""
    return _scratch.nbytes + _arena.nbytes


def set_blocked_layouts(enabled: bool) -> None:
    """Run convolution and batch norm in blocked layouts with reorders (default) or in plain layouts."""
    global _blocked
    with _dnnl_lock:
        _blocked = bool(enabled)
        clear_cache()
        _conv_choice.clear()


def set_numba_batchnorm(enabled: bool) -> bool:
    """Run training batch norm (forward and backward) with the numba NCHW kernels of ``_bnorm``
    (default: 3-4x faster than oneDNN's blocked kernels plus their reorders at the benchmark
    sizes) or with oneDNN primitives. Returns the previous setting."""
    global _bn_numba
    with _dnnl_lock:
        old, _bn_numba = _bn_numba, bool(enabled)
    return old


def _md_dims(md) -> list:
    """The dimensions of a memory descriptor."""
    n = ffi.new("int *")
    api.check(_lib, "dnnl_memory_desc_query", md, api.QUERY_NDIMS_S32, n)
    dims = ffi.new("dnnl_dim_t **")
    api.check(_lib, "dnnl_memory_desc_query", md, api.QUERY_DIMS, dims)
    return [int(dims[0][i]) for i in range(n[0])]


def _squeezed(md, ndims):
    """md with its last dimensions (all of size 1) dropped down to ndims, or None if oneDNN
    cannot describe it so (a blocked or padded unit dimension)."""
    dims = _md_dims(md)[:ndims]
    out = ffi.new("dnnl_memory_desc_t *")
    if _lib.dnnl_memory_desc_reshape(out, md, ndims, _dims(dims)) != _SUCCESS:
        return None
    return ffi.gc(out[0], _lib.dnnl_memory_desc_destroy)


def _reorder_pd(src, dst, detail=""):
    """A reorder from src to dst. Trailing unit dimensions (a 1x1 kernel's weights) are dropped
    first: oneDNN then picks its blocked-transpose kernel, 6-10x faster for ResNet-50's 1x1
    weights than the generic one it takes for the same memory described in four dimensions."""
    dims = _md_dims(src)
    keep = len(dims)
    while keep > 2 and dims[keep - 1] == 1:
        keep -= 1
    if keep < len(dims):
        s2, d2 = _squeezed(src, keep), _squeezed(dst, keep)
        if s2 is not None and d2 is not None:
            pd_p = ffi.new("dnnl_primitive_desc_t *")
            if _lib.dnnl_reorder_primitive_desc_create(pd_p, s2, _engine, d2, _engine, _attr) == _SUCCESS:
                return ffi.gc(pd_p[0], _lib.dnnl_primitive_desc_destroy)
    return _create_pd("dnnl_reorder_primitive_desc_create", src, _engine, dst, _engine, _attr,
                      detail=detail)


class _Primitive:
    """One primitive, its descriptor, and one unbound memory object per execution argument.

    When ``user_mds`` maps an argument to the caller's plain layout and the primitive chose a
    different one, the argument is reordered into (inputs) or out of (``outputs``) an arena buffer.
    """

    def __init__(self, label: str, pd, arg_ids, user_mds=None, outputs=()):
        self.label = label
        self.reorders = {}
        self._plan = None               # ([arena bytes], ((position, is_output, reorder), ...))
        for arg, user_md in (user_mds or {}).items():
            inner = _lib.dnnl_primitive_desc_query_md(pd, api.QUERY_EXEC_ARG_MD, arg)
            if _lib.dnnl_memory_desc_equal(user_md, inner):
                continue
            src, dst = (inner, user_md) if arg in outputs else (user_md, inner)
            rpd = _reorder_pd(src, dst, detail=f"{label} argument {arg}")
            self.reorders[arg] = (arg in outputs, _Primitive(f"reorder for {label} argument {arg}", rpd,
                                                             [api.ARG_FROM, api.ARG_TO]))
        self.pd = pd
        prim_p = ffi.new("dnnl_primitive_t *")
        api.check(_lib, "dnnl_primitive_create", prim_p, pd, detail=label)
        self.prim = ffi.gc(prim_p[0], _lib.dnnl_primitive_destroy)
        self.arg_ids = tuple(arg_ids)
        self.mems, self.nbytes = [], []
        for arg in self.arg_ids:
            md = _lib.dnnl_primitive_desc_query_md(pd, api.QUERY_EXEC_ARG_MD, arg)
            self.mems.append(self._memory(md))
            self.nbytes.append(int(_lib.dnnl_memory_desc_get_size(md)))
        scratch_md = _lib.dnnl_primitive_desc_query_md(pd, api.QUERY_SCRATCHPAD_MD, 0)
        self.total_bytes = sum(self.nbytes)
        self.scratch_bytes = int(_lib.dnnl_memory_desc_get_size(scratch_md)) if scratch_md != _NULL else 0
        self.scratch_mem = self._memory(scratch_md) if self.scratch_bytes else None
        n = len(self.mems) + (1 if self.scratch_mem is not None else 0)
        self.exec_args = ffi.new("dnnl_exec_arg_t[]", n)
        for i, (arg, mem) in enumerate(zip(self.arg_ids, self.mems)):
            self.exec_args[i].arg = arg
            self.exec_args[i].memory = mem
        if self.scratch_mem is not None:
            self.exec_args[n - 1].arg = api.ARG_SCRATCHPAD
            self.exec_args[n - 1].memory = self.scratch_mem
        log.debug("created %s using %s", label, impl_info_of(pd))

    @staticmethod
    def _memory(md):
        mem_p = ffi.new("dnnl_memory_t *")
        api.check(_lib, "dnnl_memory_create", mem_p, md, _engine, _NULL)
        return ffi.gc(mem_p[0], _lib.dnnl_memory_destroy)

    def md(self, arg: int):
        """The memory descriptor of execution argument arg as the primitive expects it."""
        return _lib.dnnl_primitive_desc_query_md(self.pd, api.QUERY_EXEC_ARG_MD, arg)

    def run(self, *arrays):
        """Execute on the caller's arrays (in arg_ids order), reordering where layouts differ."""
        if not self.reorders:
            return self._execute(arrays)
        with _dnnl_lock:
            plan = self._plan
            if plan is None:                # positions, sizes and reorders never change
                positions = [i for i, arg in enumerate(self.arg_ids) if arg in self.reorders]
                plan = self._plan = ([self.nbytes[i] for i in positions],
                                     tuple((i, *self.reorders[self.arg_ids[i]])
                                           for i in positions))
            views = _arena_views(plan[0])
            inner = list(arrays)
            for (i, is_output, reorder), view in zip(plan[1], views):
                if not is_output:
                    reorder._execute((arrays[i], view))
                inner[i] = view
            self._execute(inner)
            for (i, is_output, reorder), view in zip(plan[1], views):
                if is_output:
                    reorder._execute((view, arrays[i]))

    def _execute(self, arrays):
        """Bind each array (in arg_ids order) to its memory object and execute synchronously."""
        # The hot path of every kernel: bound C functions and ffi.from_buffer (the address of a
        # C-contiguous array's first byte; ~7x cheaper than going through __array_interface__).
        with _dnnl_lock:
            for mem, a, nbytes, arg in zip(self.mems, arrays, self.nbytes, self.arg_ids):
                if a.nbytes != nbytes:
                    raise ValueError(f"{self.label}: argument {arg} has {a.nbytes} bytes (shape {a.shape}), "
                                     f"the primitive expects {nbytes}")
                status = _set_handle(mem, _from_buffer(a))
                if status != _SUCCESS:
                    raise OneDNNError("dnnl_memory_set_data_handle", status, self.label)
            if self.scratch_mem is not None:
                status = _set_handle(self.scratch_mem, _scratchpad(self.scratch_bytes))
                if status != _SUCCESS:
                    raise OneDNNError("dnnl_memory_set_data_handle", status, f"{self.label} scratchpad")
            if self.total_bytes <= SERIAL_BYTES or _threads.FORKED_AFTER_POOL:
                with _OneThread():
                    status = _primitive_execute(self.prim, _stream, len(self.exec_args), self.exec_args)
            else:
                _threads.pool_started()             # a fork from now on cannot run regions
                status = _primitive_execute(self.prim, _stream, len(self.exec_args), self.exec_args)
            if status != _SUCCESS:
                raise OneDNNError("dnnl_primitive_execute", status, self.label)
            status = _stream_wait(_stream)
            if status != _SUCCESS:
                raise OneDNNError("dnnl_stream_wait", status, self.label)


def impl_info_of(pd) -> str:
    """Name of the implementation oneDNN picked for a primitive descriptor (e.g. 'brg:avx512_core')."""
    out = ffi.new("char **")
    status = _lib.dnnl_primitive_desc_query(pd, api.QUERY_IMPL_INFO_STR, 0, out)
    return ffi.string(out[0]).decode() if status == api.SUCCESS and out[0] != _NULL else "?"


def _cached(key, build):
    """The cached primitive for key, built (and the cache trimmed) on first use."""
    with _dnnl_lock:
        prim = _cache.get(key)
        if prim is None:
            if _threads.FORKED_AFTER_POOL:      # made for one thread (see _after_fork_in_child)
                with _OneThread():
                    prim = build()
            else:
                prim = build()
            _cache[key] = prim
            while len(_cache) > _CACHE_LIMIT:
                _cache.popitem(last=False)
        else:
            _cache.move_to_end(key)
        return prim


_parent_primitives = []


def _after_fork_in_child():
    """A forked child gets a lock no parent thread holds; in one forked after the OpenMP pool
    started (``threads.FORKED_AFTER_POOL``) primitives are made and run for one thread from
    then on. oneDNN fixes a primitive's thread count when it makes it, so the parent's cached
    primitives (made for the pool, their parallel regions would never return) are set aside,
    kept alive rather than destroyed in the child."""
    global _dnnl_lock, _cache
    _dnnl_lock = threading.RLock()
    if _threads.FORKED_AFTER_POOL:
        _parent_primitives.append(_cache)
        _cache = collections.OrderedDict()
        if _gomp is not None:
            _gomp.omp_set_num_threads(1)


os.register_at_fork(after_in_child=_after_fork_in_child)


def clear_cache() -> None:
    """Drop every cached primitive and the library-owned buffers (rebuilt on next use)."""
    global _scratch, _arena
    with _dnnl_lock:
        _cache.clear()
        _scratch = np.empty(0, dtype=np.uint8)
        _arena = np.empty(0, dtype=np.uint8)
        _scratch_ptr[:] = None, None            # let the old buffers go
        _arena_base[:] = None, 0


def cache_size() -> int:
    """Number of cached primitives."""
    return len(_cache)


def impl_info() -> dict:
    """Implementation names of all cached primitives, keyed by their cache key."""
    with _dnnl_lock:
        # an entry is a primitive, or (primitive, flag) where the builder chose between two
        return {key: impl_info_of((p[0] if isinstance(p, tuple) else p).pd)
                for key, p in _cache.items()}


# --- convolution --------------------------------------------------------------------------

def conv2d_output_shape(x_shape, w_shape, stride=1, pad=0):
    """(N, K, P, Q) of a convolution of x (N,C,H,W) with w (K,C,R,S)."""
    return ck.conv2d_output_shape(x_shape, w_shape, stride, pad)


def _conv_geometry(stride, pad, op):
    st = ck.pair(stride, "stride", op)
    pd = ck.pair(pad, "pad", op)
    return st, pd


# 1x1 convolutions with at least this many output pixels (P*Q) run in plain layouts when the
# layouts are not measured (``set_conv_layouts("rule")``): there oneDNN's GEMM-based plain
# kernels beat the blocked ones plus the reorders of src, weights and dst (measured on
# ResNet-50's 16x16 and 8x8 bottleneck 1x1 convolutions, 2 threads, AVX-512). 0 disables it.
PLAIN_1X1_MIN_PIXELS = 64
# Below that, down to PLAIN_1X1_NARROW_MIN_PIXELS output pixels, a 1x1 convolution with at most
# PLAIN_1X1_NARROW_MAX_K output channels runs plain too: DenseNet-121's 4x4 bottlenecks (C up
# to 1024 -> 128) were 1-25% faster plain in all three passes, while ResNet-50's 4x4 1x1
# convolutions (256 to 2048 outputs) were up to 1.6x slower plain, and at 2x2 plain is slower
# for every shape measured (2x2 leaves a GEMM of 4 columns per image).
PLAIN_1X1_NARROW_MIN_PIXELS = 16
PLAIN_1X1_NARROW_MAX_K = 128


def nhwc_window(cpu=None):
    """(NHWC_MIN_PIXELS, NHWC_MAX_PIXELS, NHWC_MIN_CHANNELS) by default on the CPU named
    ``cpu`` (LLVM's name; default this machine's): (1024, 0, 16), from 32x32 output pixels
    up, or on AMD Zen (``znver*``) (64, 256, 128), from 8x8 to 16x16."""
    if cpu is None:
        cpu = llvm.get_host_cpu_name()
    return (64, 256, 128) if str(cpu).startswith("znver") else (1024, 0, 16)


# Convolutions (other than 1x1) whose output has NHWC_MIN_PIXELS to NHWC_MAX_PIXELS pixels (0:
# no upper bound), with at least NHWC_MIN_CHANNELS input and output channels, run channels-last
# (nhwc activations), where oneDNN takes other kernels than for nChw16c. Which convolutions gain
# depends on the CPU (measured per pass with the reorders, 2 threads, AVX-512, batch 16):
# - On a Sapphire Rapids Xeon, its brgemm kernels were 10-30% faster in all three passes for
#   VGG-16's 64x64 and 32x32 layers, and not faster at 16x16 and below: from 32x32 up.
# - On a Zen 5, VGG-16's 64x64 layer took 20.1 ms for its weight gradient channels-last
#   against 12.8 ms blocked, and the 32x32 layers were 3-4% slower over their three passes.
#   At 16x16 and 8x8 with 128-512 input channels, channels-last was 6-11% faster forward,
#   6-13% for the data gradient and between 1% slower and 13% faster for the weight gradient,
#   while at 4x4 blocked was 10-15% faster forward and for the data gradient. Below 128
#   channels the gains were small (ResNet-50's 64-channel 16x16 layer: 9% forward, 2% for the
#   data gradient) and DenseNet-121's 3x3 convolutions (32 output channels) made its steps up
#   to 2.6% slower channels-last. So: from 8x8 to 16x16, with 128 channels or more. In paired
#   runs VGG-16 steps were 1.9-2.9% faster than with channels-last off, ResNet-50's and
#   DenseNet-121's the same within 1%.
# NHWC_MIN_PIXELS = 0 disables channels-last.
NHWC_MIN_PIXELS, NHWC_MAX_PIXELS, NHWC_MIN_CHANNELS = nhwc_window()

LAYOUTS = ("blocked", "plain", "nhwc")

# How each convolution picks its layouts: "auto" times each of LAYOUTS (with its reorders) on
# the first call of each (operation, shapes, geometry) and leaves the rule's choice when another
# is clearly faster (_CONV_SWITCH_MARGIN); "rule" applies PLAIN_1X1_MIN_PIXELS and the
# channels-last window alone. Blocked layouts off (set_blocked_layouts) means plain.
_conv_layouts = "rule"
_conv_choice: dict = {}
_CONV_TRIALS = 2
_CONV_SWITCH_MARGIN = 1.1     # another layout must be this many times faster than the rule's


def set_conv_layouts(mode: str) -> str:
    """"auto" (measure each layout once per convolution shape, keep the fastest) or "rule"
    (plain for large 1x1 convolutions, nhwc for others in the CPU's window, else blocked).
    Returns the previous setting."""
    global _conv_layouts
    if mode not in ("auto", "rule"):
        raise ValueError(f"set_conv_layouts: {mode!r} is not one of auto, rule")
    with _dnnl_lock:
        old, _conv_layouts = _conv_layouts, mode
        _conv_choice.clear()
    return old


def conv_layout_choices() -> dict:
    """The layout ("blocked", "plain" or "nhwc") measured best for each convolution
    (operation, shapes) so far."""
    return dict(_conv_choice)


def _rule_layout(xs, ws, st):
    """The fixed rule: plain for 1x1 convolutions with many output pixels (or fewer, with few
    output channels), nhwc for other convolutions with output pixels in the CPU's window and
    enough channels (``nhwc_window``), else blocked."""
    p, q = (xs[2] - 1) // st[0] + 1, (xs[3] - 1) // st[1] + 1      # output pixels (an upper
    if tuple(ws[2:]) == (1, 1):                                    # bound with padding)
        if PLAIN_1X1_MIN_PIXELS and p * q >= PLAIN_1X1_MIN_PIXELS:
            return "plain"
        if PLAIN_1X1_NARROW_MIN_PIXELS and p * q >= PLAIN_1X1_NARROW_MIN_PIXELS and \
                ws[0] <= PLAIN_1X1_NARROW_MAX_K:
            return "plain"
    elif (NHWC_MIN_PIXELS and NHWC_MIN_PIXELS <= p * q
          and (not NHWC_MAX_PIXELS or p * q <= NHWC_MAX_PIXELS)
          and min(xs[1], ws[0]) >= NHWC_MIN_CHANNELS):
        return "nhwc"
    return "blocked"


def _conv_run(key, xs, ws, st, run):
    """run(layout) with the layout chosen for convolution key (timing each the first time), on
    one thread for a small convolution (SERIAL_FLOPS)."""
    p, q = (xs[2] - 1) // st[0] + 1, (xs[3] - 1) // st[1] + 1
    if 2 * xs[0] * p * q * ws[0] * ws[1] * ws[2] * ws[3] <= SERIAL_FLOPS:
        with _OneThread():
            return _conv_choose(key, xs, ws, st, run)
    return _conv_choose(key, xs, ws, st, run)


def _conv_choose(key, xs, ws, st, run):
    if not _blocked:
        return run("plain")
    if _conv_layouts != "auto":
        return run(_rule_layout(xs, ws, st))
    layout = _conv_choice.get(key)
    if layout is None:
        best = {}
        for option in LAYOUTS:
            run(option)                                     # warm-up (primitive creation)
            times = []
            for _ in range(_CONV_TRIALS):
                t = time.perf_counter()
                run(option)
                times.append(time.perf_counter() - t)
            best[option] = min(times)
        # Leave the fixed rule's choice only for a clear gain: one measurement is noisy.
        layout = _rule_layout(xs, ws, st)
        fastest = min(LAYOUTS, key=best.get)
        if best[fastest] * _CONV_SWITCH_MARGIN < best[layout]:
            layout = fastest
        _conv_choice[key] = layout
        log.debug("conv %s: %s (%s)", key, layout,
                  ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in best.items()))
    return run(layout)                                      # the result comes from this run


def _conv_mds(xs, ws, ys, layout):
    """(primitive mds, user mds) of a convolution run in layout (one of LAYOUTS): `any` for
    blocked, channels-last activations with `any` weights for nhwc, the caller's for plain."""
    user = [_md(s) for s in (xs, ws, ys)]
    if layout == "plain":
        return user, user
    act = api.TAG_ANY if layout == "blocked" else api.TAG_NHWC
    return [_md(xs, act), _md(ws, api.TAG_ANY), _md(ys, act)], user


def _conv_fwd(xs, ws, has_bias, st, pd, layout):
    key = ("conv_fwd", xs, ws, has_bias, st, pd, layout)

    def build():
        os_ = ck.conv2d_output_shape(xs, ws, st, pd)
        (src, wei, dst), user = _conv_mds(xs, ws, os_, layout)
        bias = _md((ws[0],)) if has_bias else _NULL
        desc = _create_pd("dnnl_convolution_forward_primitive_desc_create", _engine, api.FORWARD_TRAINING,
                          api.CONVOLUTION_DIRECT, src, wei, bias, dst,
                          _dims(st), _dims((0, 0)), _dims(pd), _dims(pd), _attr, detail=f"conv x {xs} w {ws}")
        args = [api.ARG_SRC, api.ARG_WEIGHTS] + ([api.ARG_BIAS] if has_bias else []) + [api.ARG_DST]
        return _Primitive(f"conv2d_forward x {xs} w {ws} stride {st} pad {pd}", desc, args,
                          dict(zip((api.ARG_SRC, api.ARG_WEIGHTS, api.ARG_DST), user)), {api.ARG_DST})

    return _cached(key, build)


def conv2d_forward(x, w, b, stride, pad, out):
    """out = conv(x, w) + b (cross-correlation, NCHW / KCRS)."""
    op = "conv2d_forward"
    ck.check_conv_forward(op, x, w, b, stride, pad, out, **_F32)
    st, pd = _conv_geometry(stride, pad, op)
    xs, ws, has_bias = x.shape, w.shape, b is not None

    def run(layout):
        prim = _conv_fwd(xs, ws, has_bias, st, pd, layout)
        if b is None:
            prim.run(x, w, out)
        else:
            prim.run(x, w, b, out)

    _conv_run((op, xs, ws, has_bias, st, pd), xs, ws, st, run)
    return out


def conv2d_backward_data(dy, w, stride, pad, dx):
    """dx = gradient of conv2d_forward with respect to its input x."""
    op = "conv2d_backward_data"
    ck.check_conv_backward_data(op, dy, w, stride, pad, dx, **_F32)
    st, pd = _conv_geometry(stride, pad, op)
    xs, ws = dx.shape, w.shape

    def run(layout):
        def build():
            hint = _conv_fwd(xs, ws, False, st, pd, layout).pd
            (dsrc, wei, ddst), user = _conv_mds(xs, ws, dy.shape, layout)
            desc = _create_pd("dnnl_convolution_backward_data_primitive_desc_create", _engine,
                              api.CONVOLUTION_DIRECT, dsrc, wei, ddst,
                              _dims(st), _dims((0, 0)), _dims(pd), _dims(pd), hint, _attr,
                              detail=f"conv bwd data dx {xs} w {ws}")
            return _Primitive(f"{op} dx {xs} w {ws} stride {st} pad {pd}", desc,
                              [api.ARG_DIFF_DST, api.ARG_WEIGHTS, api.ARG_DIFF_SRC],
                              dict(zip((api.ARG_DIFF_SRC, api.ARG_WEIGHTS, api.ARG_DIFF_DST), user)),
                              {api.ARG_DIFF_SRC})

        _cached(("conv_bwd_data", xs, ws, st, pd, layout), build).run(dy, w, dx)

    _conv_run((op, xs, ws, st, pd), xs, ws, st, run)
    return dx


def conv2d_backward_weights(x, dy, stride, pad, dw, db):
    """dw (and db unless None) = gradients of conv2d_forward with respect to w and b."""
    op = "conv2d_backward_weights"
    ck.check_conv_backward_weights(op, x, dy, stride, pad, dw, db, **_F32)
    st, pd = _conv_geometry(stride, pad, op)
    xs, ws, has_bias = x.shape, dw.shape, db is not None

    def run(layout):
        def build():
            hint = _conv_fwd(xs, ws, has_bias, st, pd, layout).pd
            (src, dwei, ddst), user = _conv_mds(xs, ws, dy.shape, layout)
            bias = _md((ws[0],)) if has_bias else _NULL
            desc = _create_pd("dnnl_convolution_backward_weights_primitive_desc_create", _engine,
                              api.CONVOLUTION_DIRECT, src, dwei, bias, ddst,
                              _dims(st), _dims((0, 0)), _dims(pd), _dims(pd), hint, _attr,
                              detail=f"conv bwd weights x {xs} dw {ws}")
            args = [api.ARG_SRC, api.ARG_DIFF_DST, api.ARG_DIFF_WEIGHTS] + ([api.ARG_DIFF_BIAS] if has_bias else [])
            return _Primitive(f"{op} x {xs} dw {ws} stride {st} pad {pd}", desc, args,
                              dict(zip((api.ARG_SRC, api.ARG_DIFF_WEIGHTS, api.ARG_DIFF_DST), user)),
                              {api.ARG_DIFF_WEIGHTS})

        prim = _cached(("conv_bwd_weights", xs, ws, has_bias, st, pd, layout), build)
        if has_bias:
            prim.run(x, dy, dw, db)
        else:
            prim.run(x, dy, dw)

    _conv_run((op, xs, ws, has_bias, st, pd), xs, ws, st, run)
    return dw


# --- pooling ------------------------------------------------------------------------------

def _pool_geometry(kernel, stride, pad, op):
    return ck.pair(kernel, "kernel", op), ck.pair(stride, "stride", op), ck.pair(pad, "pad", op)


def _pool_fwd(alg, xs, kernel, st, pd):
    key = ("pool_fwd", alg, xs, kernel, st, pd)

    def build():
        os_ = ck.pool_output_shape(xs, kernel, st, pd)
        desc = _create_pd("dnnl_pooling_forward_primitive_desc_create", _engine, api.FORWARD_TRAINING, alg,
                          _md(xs), _md(os_), _dims(st), _dims(kernel), _dims((0, 0)), _dims(pd), _dims(pd),
                          _attr, detail=f"pooling x {xs} kernel {kernel}")
        args = [api.ARG_SRC, api.ARG_DST] + ([api.ARG_WORKSPACE] if alg == api.POOLING_MAX else [])
        return _Primitive(f"pool_forward alg {alg} x {xs} kernel {kernel} stride {st} pad {pd}", desc, args)

    return _cached(key, build)


def _pool_bwd(alg, xs, ys, kernel, st, pd):
    key = ("pool_bwd", alg, xs, kernel, st, pd)

    def build():
        hint = _pool_fwd(alg, xs, kernel, st, pd).pd
        desc = _create_pd("dnnl_pooling_backward_primitive_desc_create", _engine, alg, _md(xs), _md(ys),
                          _dims(st), _dims(kernel), _dims((0, 0)), _dims(pd), _dims(pd), hint, _attr,
                          detail=f"pooling bwd dx {xs} kernel {kernel}")
        args = [api.ARG_DIFF_DST, api.ARG_DIFF_SRC] + ([api.ARG_WORKSPACE] if alg == api.POOLING_MAX else [])
        return _Primitive(f"pool_backward alg {alg} dx {xs} kernel {kernel} stride {st} pad {pd}", desc, args)

    return _cached(key, build)


_WS_DTYPES = {api.DT_U8: np.dtype(np.uint8), api.DT_S32: np.dtype(np.int32)}


def maxpool_state_spec(x_shape, out_shape, kernel=None):
    """(shape, dtype) of the oneDNN max-pool workspace: out_shape, uint8 (int32 if kernel area >= 256).

    oneDNN stores the winning offset per output; without ``kernel`` a window of < 256 elements
    is assumed (every CNN here); maxpool_forward checks the spec against the primitive.
    """
    area = 1 if kernel is None else int(np.prod(ck.pair(kernel, "kernel", "maxpool_state_spec")))
    dtype = np.dtype(np.uint8) if area < 256 else np.dtype(np.int32)
    return tuple(int(v) for v in out_shape), dtype


def maxpool_forward(x, kernel, stride, pad, out, state=None):
    """Max pooling; returns the oneDNN workspace (written into ``state`` when given)."""
    op = "maxpool_forward"
    ck.check_pool_forward(op, x, kernel, stride, pad, out, **_F32)
    k, st, pd = _pool_geometry(kernel, stride, pad, op)
    prim = _pool_fwd(api.POOLING_MAX, x.shape, k, st, pd)
    shape, dtype = maxpool_state_spec(x.shape, out.shape, k)
    ws_dtype = _WS_DTYPES.get(_md_dtype(prim.md(api.ARG_WORKSPACE)))
    if ws_dtype != dtype:
        raise OneDNNError("dnnl_pooling_forward_primitive_desc_create", api.SUCCESS,
                          f"workspace dtype {ws_dtype} differs from maxpool_state_spec {dtype}")
    if state is None:
        state = np.empty(shape, dtype=dtype)
    ck.array(op, "state", state, shape=shape, dtypes=(dtype,), contiguous=True, writable=True)
    prim.run(x, out, state)
    return state


def maxpool_backward(dy, x, state, kernel, stride, pad, dx):
    """Route each output gradient to the input recorded in the workspace (x is shape-checked only)."""
    op = "maxpool_backward"
    ck.check_pool_backward(op, dy, kernel, stride, pad, dx, x=x, **_F32)
    k, st, pd = _pool_geometry(kernel, stride, pad, op)
    shape, dtype = maxpool_state_spec(dx.shape, dy.shape, k)
    ck.array(op, "state", state, shape=shape, dtypes=(dtype,), contiguous=True)
    _pool_bwd(api.POOLING_MAX, dx.shape, dy.shape, k, st, pd).run(dy, dx, state)
    return dx


def avgpool_forward(x, kernel, stride, pad, out):
    """Average pooling; padding is excluded from each window's count."""
    op = "avgpool_forward"
    ck.check_pool_forward(op, x, kernel, stride, pad, out, **_F32)
    k, st, pd = _pool_geometry(kernel, stride, pad, op)
    _pool_fwd(api.POOLING_AVG_EXCLUDE_PADDING, x.shape, k, st, pd).run(x, out)
    return out


def avgpool_backward(dy, kernel, stride, pad, dx):
    """Spread each output gradient evenly over its window's non-padding inputs."""
    op = "avgpool_backward"
    ck.check_pool_backward(op, dy, kernel, stride, pad, dx, **_F32)
    k, st, pd = _pool_geometry(kernel, stride, pad, op)
    _pool_bwd(api.POOLING_AVG_EXCLUDE_PADDING, dx.shape, dy.shape, k, st, pd).run(dy, dx)
    return dx


# --- batch normalization ------------------------------------------------------------------

_BN_FLAGS = api.USE_SCALE | api.USE_SHIFT


def _bn_md(xs):
    """Batch-norm tensor layout: nChw16c (JIT kernels) when blocked layouts are on and C >= 16."""
    return _md(xs, api.TAG_NCHW16C if _blocked and xs[1] >= 16 else api.TAG_NCHW)


def _bn_fwd(xs, eps):
    key = ("bn_fwd", xs, eps, _blocked)

    def build():
        md = _bn_md(xs)
        desc = _create_pd("dnnl_batch_normalization_forward_primitive_desc_create", _engine,
                          api.FORWARD_TRAINING, md, md, eps, _BN_FLAGS, _attr, detail=f"bn x {xs}")
        return _Primitive(f"batchnorm_forward x {xs}", desc,
                          [api.ARG_SRC, api.ARG_SCALE, api.ARG_SHIFT, api.ARG_DST, api.ARG_MEAN, api.ARG_VARIANCE],
                          {api.ARG_SRC: _md(xs), api.ARG_DST: _md(xs)}, {api.ARG_DST})

    return _cached(key, build)


_F32_STRIDED = {"dtypes": _F32["dtypes"], "contiguous": False}


def _bn_checks(op, x, eps, per_channel, same_shape):
    """Check a batch norm's arguments; returns x as its kernel reads it. Every argument but x
    must be C-contiguous; x may be a channel slice of a larger NCHW array (a dense block's
    concatenation buffer), which the numba kernels read in place and oneDNN's get as a copy."""
    ck.check_channels(op, x, per_channel, **_F32_STRIDED)
    ck.check_same_shape(op, "x", x, same_shape, **_F32_STRIDED)
    for name, a, _ in (*per_channel, *same_shape):
        ck.array(op, name, a, **_F32)
    ck.check_batch_stats(op, x)
    ck.check_eps(op, eps)
    if not x.flags.c_contiguous and not (_bn_numba and x.ndim == 4):
        x = np.ascontiguousarray(x)
    return x


def batchnorm_forward(x, gamma, beta, eps, out, mean_out, var_out):
    """Training-mode batch norm: batch mean and biased variance over N,H,W."""
    op = "batchnorm_forward"
    x = _bn_checks(op, x, eps, [("gamma", gamma, False), ("beta", beta, False),
                           ("mean_out", mean_out, True), ("var_out", var_out, True)],
                   [("out", out, True)])
    if _bn_numba and x.ndim == 4:
        return _bnorm.forward(x, gamma, beta, eps, out, mean_out, var_out)
    _bn_fwd(x.shape, float(eps)).run(x, gamma, beta, out, mean_out, var_out)
    return out


def batchnorm_backward(dy, x, gamma, mean, var, eps, dx, dgamma, dbeta):
    """Gradients of training-mode batch norm given the saved batch mean and variance."""
    op = "batchnorm_backward"
    x = _bn_checks(op, x, eps, [("gamma", gamma, False), ("mean", mean, False), ("var", var, False),
                           ("dgamma", dgamma, True), ("dbeta", dbeta, True)],
                   [("dy", dy, False), ("dx", dx, True)])
    if _bn_numba and x.ndim == 4:
        return _bnorm.backward(dy, x, gamma, mean, var, eps, dx, dgamma, dbeta)
    xs, eps = x.shape, float(eps)

    def build():
        hint = _bn_fwd(xs, eps).pd
        md = _bn_md(xs)
        desc = _create_pd("dnnl_batch_normalization_backward_primitive_desc_create", _engine, api.BACKWARD,
                          md, md, md, eps, _BN_FLAGS, hint, _attr, detail=f"bn bwd x {xs}")
        return _Primitive(f"{op} x {xs}", desc,
                          [api.ARG_SRC, api.ARG_MEAN, api.ARG_VARIANCE, api.ARG_DIFF_DST, api.ARG_SCALE,
                           api.ARG_DIFF_SRC, api.ARG_DIFF_SCALE, api.ARG_DIFF_SHIFT],
                          {api.ARG_SRC: _md(xs), api.ARG_DIFF_DST: _md(xs), api.ARG_DIFF_SRC: _md(xs)},
                          {api.ARG_DIFF_SRC})

    _cached(("bn_bwd", xs, eps, _blocked), build).run(x, mean, var, dy, gamma, dx, dgamma, dbeta)
    return dx


def batchnorm_relu_forward(x, gamma, beta, eps, out, mean_out, var_out):
    """Training batch norm then ReLU, one pass over the output (numba; or two kernels)."""
    op = "batchnorm_relu_forward"
    x = _bn_checks(op, x, eps, [("gamma", gamma, False), ("beta", beta, False),
                           ("mean_out", mean_out, True), ("var_out", var_out, True)],
                   [("out", out, True)])
    if _bn_numba and x.ndim == 4:
        return _bnorm.forward(x, gamma, beta, eps, out, mean_out, var_out, relu=True)
    batchnorm_forward(x, gamma, beta, eps, out, mean_out, var_out)
    return relu_forward(out, out)


def batchnorm_relu_backward(dy, y, x, gamma, mean, var, eps, dx, dgamma, dbeta, acc=None):
    """Gradients of batchnorm_relu_forward given its output y (the ReLU mask is y > 0); with
    acc (N, >= C, H, W), its first C channels are added to dx in the same pass."""
    op = "batchnorm_relu_backward"
    x = _bn_checks(op, x, eps, [("gamma", gamma, False), ("mean", mean, False), ("var", var, False),
                           ("dgamma", dgamma, True), ("dbeta", dbeta, True)],
                   [("dy", dy, False), ("y", y, False), ("dx", dx, True)])
    if acc is not None:
        ck.check_acc(op, acc, dx, **_F32)
    if _bn_numba and x.ndim == 4:
        return _bnorm.backward(dy, x, gamma, mean, var, eps, dx, dgamma, dbeta, y=y, acc=acc)
    relu_backward(dy, y, dx)
    batchnorm_backward(dx.copy(), x, gamma, mean, var, eps, dx, dgamma, dbeta)
    if acc is not None:
        dx += acc[:, :dx.shape[1]]
    return dx


def batchnorm_inference(x, gamma, beta, mean, var, eps, out):
    """Batch norm with given (running) statistics."""
    op = "batchnorm_inference"
    ck.check_channels(op, x, [("gamma", gamma, False), ("beta", beta, False),
                              ("mean", mean, False), ("var", var, False)], **_F32)
    ck.check_same_shape(op, "x", x, [("out", out, True)], **_F32)
    xs, eps = x.shape, ck.check_eps(op, eps)

    def build():
        md = _bn_md(xs)
        desc = _create_pd("dnnl_batch_normalization_forward_primitive_desc_create", _engine,
                          api.FORWARD_INFERENCE, md, md, eps, _BN_FLAGS | api.USE_GLOBAL_STATS,
                          _attr, detail=f"bn inference x {xs}")
        return _Primitive(f"{op} x {xs}", desc,
                          [api.ARG_SRC, api.ARG_MEAN, api.ARG_VARIANCE, api.ARG_SCALE, api.ARG_SHIFT, api.ARG_DST],
                          {api.ARG_SRC: _md(xs), api.ARG_DST: _md(xs)}, {api.ARG_DST})

    _cached(("bn_inf", xs, eps, _blocked), build).run(x, mean, var, gamma, beta, out)
    return out


# --- elementwise (run on the flat buffer: layout does not matter) -------------------------

def _relu_fwd(size):
    def build():
        md = _md((size,))
        desc = _create_pd("dnnl_eltwise_forward_primitive_desc_create", _engine, api.FORWARD_TRAINING,
                          api.ELTWISE_RELU, md, md, 0.0, 0.0, _attr, detail=f"relu size {size}")
        return _Primitive(f"relu_forward size {size}", desc, [api.ARG_SRC, api.ARG_DST])

    return _cached(("relu_fwd", size), build)


def relu_forward(x, out):
    """out = max(x, 0) (out may be x)."""
    ck.check_same_shape("relu_forward", "x", x, [("out", out, True)], **_F32)
    if x.size:
        _relu_fwd(x.size).run(x, out)
    return out


def relu_backward(dy, x, dx):
    """dx = dy where x > 0, else 0."""
    op = "relu_backward"
    ck.check_same_shape(op, "x", x, [("dy", dy, False), ("dx", dx, True)], **_F32)
    size = x.size
    if not size:
        return dx

    def build():
        md = _md((size,))
        desc = _create_pd("dnnl_eltwise_backward_primitive_desc_create", _engine, api.ELTWISE_RELU,
                          md, md, md, 0.0, 0.0, _relu_fwd(size).pd, _attr, detail=f"relu bwd size {size}")
        return _Primitive(f"{op} size {size}", desc, [api.ARG_SRC, api.ARG_DIFF_DST, api.ARG_DIFF_SRC])

    _cached(("relu_bwd", size), build).run(x, dy, dx)
    return dx


def add(a, b, out):
    """out = a + b (residual connections), with oneDNN's threaded binary primitive."""
    op = "add"
    ck.check_same_shape(op, "a", a, [("b", b, False), ("out", out, True)], **_F32)
    size = a.size
    if not size:
        return out

    def build():
        md = _md((size,))
        desc = _create_pd("dnnl_binary_primitive_desc_create", _engine, api.BINARY_ADD, md, md, md, _attr,
                          detail=f"add size {size}")
        return _Primitive(f"add size {size}", desc, [api.ARG_SRC, api.ARG_SRC_1, api.ARG_DST])

    _cached(("add", size), build).run(a, b, out)
    return out


# --- dense (inner product) ----------------------------------------------------------------

def _ip_fwd(xs, ws, has_bias):
    def build():
        bias = _md((ws[0],)) if has_bias else _NULL
        desc = _create_pd("dnnl_inner_product_forward_primitive_desc_create", _engine, api.FORWARD_TRAINING,
                          _md(xs), _md(ws), bias, _md((xs[0], ws[0])), _attr, detail=f"dense x {xs} w {ws}")
        args = [api.ARG_SRC, api.ARG_WEIGHTS] + ([api.ARG_BIAS] if has_bias else []) + [api.ARG_DST]
        return _Primitive(f"dense_forward x {xs} w {ws}", desc, args)

    return _cached(("ip_fwd", xs, ws, has_bias), build)


# Which implementation runs each dense shape: oneDNN's inner product is slower than NumPy's
# BLAS matmul at some shapes (16x512 -> 1000 on 2 threads: ~550 us vs ~225 us) and faster at
# others, so the first call of each (operation, shapes) times both on the caller's arrays and
# keeps NumPy's when it is clearly faster ("auto": at least _DENSE_NUMPY_MARGIN times, as its
# BLAS threads spin for a while after each call); "onednn" or "numpy" forces one.
_dense_impl = "onednn"
_dense_choice: dict = {}
_DENSE_TRIALS = 3
_DENSE_NUMPY_MARGIN = 1.5     # NumPy must be this many times faster to be chosen


def set_dense_impl(impl: str) -> str:
    """Choose the dense kernels: "auto" (time both once per shape; NumPy when clearly faster), "onednn"
    or "numpy". Returns the previous setting."""
    global _dense_impl
    if impl not in ("auto", "onednn", "numpy"):
        raise ValueError(f"set_dense_impl: {impl!r} is not one of auto, onednn, numpy")
    with _dnnl_lock:
        old, _dense_impl = _dense_impl, impl
        _dense_choice.clear()
    return old


def dense_choices() -> dict:
    """The implementation picked for each dense (operation, shapes) timed so far."""
    return dict(_dense_choice)


def _dense_run(key, run_onednn, run_numpy, flops):
    """Run the dense kernel with the implementation chosen for key (timing both the first
    time); on one OpenMP thread when it has at most SERIAL_FLOPS of arithmetic (a DLRM MLP
    layer at a batch of 16: 6 MFLOP, 40-50 us faster so)."""
    if flops <= SERIAL_FLOPS:
        with _OneThread():
            return _dense_choose(key, run_onednn, run_numpy)
    return _dense_choose(key, run_onednn, run_numpy)


def _dense_choose(key, run_onednn, run_numpy):
    numpy_run = run_numpy

    def run_numpy():            # as quiet as oneDNN's kernels about overflow in float32
        with np.errstate(all="ignore"):
            numpy_run()

    impl = _dense_impl if _dense_impl != "auto" else _dense_choice.get(key)
    if impl is None:
        best = {}
        for name, fn in (("onednn", run_onednn), ("numpy", run_numpy)):
            fn()                                            # warm-up (primitive creation)
            times = []
            for _ in range(_DENSE_TRIALS):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            best[name] = min(times)
        # NumPy's BLAS pool keeps its threads spinning for a while after a call, on the cores
        # oneDNN's next kernels need: take it only when it wins by a clear margin.
        impl = "numpy" if best["numpy"] * _DENSE_NUMPY_MARGIN < best["onednn"] else "onednn"
        _dense_choice[key] = impl
        log.debug("dense %s: %s (onednn %.1f us, numpy %.1f us)", key, impl,
                  best["onednn"] * 1e6, best["numpy"] * 1e6)
    (run_onednn if impl == "onednn" else run_numpy)()       # the result comes from this run


def _smd(dims, strides):
    """A float32 memory descriptor with explicit strides (in elements), destroyed when collected."""
    md_p = ffi.new("dnnl_memory_desc_t *")
    api.check(_lib, "dnnl_memory_desc_create_with_strides", md_p, len(dims), _dims(dims), api.DT_F32,
              _dims(strides), detail=f"dims {tuple(dims)} strides {tuple(strides)}")
    return ffi.gc(md_p[0], _lib.dnnl_memory_desc_destroy)


def _create_relu_attr():
    """Primitive attributes with a ReLU post-op (and the user scratchpad), for the process."""
    attr = _new_attr()
    ops_p = ffi.new("dnnl_post_ops_t *")
    api.check(_lib, "dnnl_post_ops_create", ops_p)
    try:
        api.check(_lib, "dnnl_post_ops_append_eltwise", ops_p[0], api.ELTWISE_RELU, 0.0, 0.0)
        api.check(_lib, "dnnl_primitive_attr_set_post_ops", attr, ops_p[0])
    finally:
        _lib.dnnl_post_ops_destroy(ops_p[0])      # the attributes keep their own copy
    return attr


_relu_attr = _create_relu_attr()


def _optimized(pd) -> bool:
    """False when oneDNN could only offer its reference code (``ref:``) for a primitive: a
    layout its optimized kernels do not take, on this CPU; the caller then uses another."""
    return not impl_info_of(pd).startswith("ref")


def _mm_fwd(xs, ws, has_bias, relu):
    """(primitive, fused): out (N,O) = x (N,I) @ w.T (+ b) (then ReLU, when fused) as a matmul
    reading w (O,I) transposed in place: measured faster than the inner product at DLRM's and
    the CNNs' dense shapes, with the ReLU riding along as a post-op instead of a second pass
    over out. Where the matmul would run oneDNN's reference code, the inner product instead
    (fused False: the caller applies the ReLU)."""
    def build():
        (n, i), (o, _) = xs, ws
        bias = _smd((1, o), (o, 1)) if has_bias else _NULL
        desc = _create_pd("dnnl_matmul_primitive_desc_create", _engine, _smd((n, i), (i, 1)),
                          _smd((i, o), (1, i)), bias, _smd((n, o), (o, 1)),
                          _relu_attr if relu else _attr, detail=f"dense x {xs} w {ws}")
        if not _optimized(desc):
            return _ip_fwd(xs, ws, has_bias), False
        args = [api.ARG_SRC, api.ARG_WEIGHTS] + ([api.ARG_BIAS] if has_bias else []) + [api.ARG_DST]
        return _Primitive(f"dense_forward x {xs} w {ws}{' relu' if relu else ''}", desc, args), True

    return _cached(("mm_fwd", xs, ws, has_bias, relu), build)


def dense_forward(x, w, b, out, relu=False):
    """out = x @ w.T + b with x (N,I), w (O,I); then out = max(out, 0) when relu."""
    ck.check_dense_forward("dense_forward", x, w, b, out, **_F32)
    relu = bool(relu)
    if x.size == 0 or out.size == 0:           # nothing to multiply: oneDNN needs every dim
        return _ref.dense_forward(x, w, b, out, relu)
    prim, fused = _mm_fwd(x.shape, w.shape, b is not None, relu)

    def run():
        if b is None:
            prim.run(x, w, out)
        else:
            prim.run(x, w, b, out)
        if relu and not fused:
            relu_forward(out, out)

    _dense_run(("dense_forward", x.shape, w.shape, b is not None, relu), run,
               lambda: _ref.dense_forward(x, w, b, out, relu), 2 * x.shape[0] * w.size)
    return out


def dense_backward_data(dy, w, dx):
    """dx = dy @ w."""
    op = "dense_backward_data"
    ck.check_dense_backward_data(op, dy, w, dx, **_F32)
    if dy.size == 0 or dx.size == 0:            # nothing to multiply: oneDNN needs every dim
        return _ref.dense_backward_data(dy, w, dx)
    xs, ws = dx.shape, w.shape

    def build():
        desc = _create_pd("dnnl_inner_product_backward_data_primitive_desc_create", _engine, _md(xs), _md(ws),
                          _md(dy.shape), _ip_fwd(xs, ws, False).pd, _attr, detail=f"dense bwd data dx {xs} w {ws}")
        return _Primitive(f"{op} dx {xs} w {ws}", desc, [api.ARG_DIFF_DST, api.ARG_WEIGHTS, api.ARG_DIFF_SRC])

    _dense_run((op, xs, ws), lambda: _cached(("ip_bwd_data", xs, ws), build).run(dy, w, dx),
               lambda: _ref.dense_backward_data(dy, w, dx), 2 * xs[0] * w.size)
    return dx


#: The weight gradient runs as its transpose (dw.T = x.T @ dy into a scratch buffer, then
#: copied into dw) when the batch is at least this many rows and 64 <= fan_in < fan_out, fan_out
#: a multiple of 16. Measured at 20 such shapes (batch 4096-16384, fan_in 96-700, fan_out
#: 128-1024): the direct product took 0.98-1.31x the time, 1.13x at DLRM's top layer (367 ->
#: 512, batch 8192); elsewhere (fan_in >= fan_out, small batches, fan_in 13) it was faster.
WGRAD_TRANSPOSED_MIN_BATCH = 4096


def _wgrad_transposed(n, i, o) -> bool:
    return n >= WGRAD_TRANSPOSED_MIN_BATCH and 64 <= i < o and o % 16 == 0


def dense_backward_weights(x, dy, dw, db):
    """dw = dy.T @ x and db = sum of dy over the batch (db may be None).

    dw is a matmul reading dy transposed in place (or, at the shapes ``_wgrad_transposed``
    names, its transpose), db a threaded column sum (``_bias``): together measured faster than
    oneDNN's inner-product weight gradient, which computes both.
    """
    op = "dense_backward_weights"
    ck.check_dense_backward_weights(op, x, dy, dw, db, **_F32)
    if x.shape[0] == 0 or dw.size == 0:
        return _ref.dense_backward_weights(x, dy, dw, db)
    (n, i), o = x.shape, dy.shape[1]
    if _wgrad_transposed(n, i, o):
        prim = _wgrad_transposed_primitive(n, i, o)
        if prim is not None:
            def run_transposed():
                with _dnnl_lock:            # one scratch buffer per shape
                    prim.run(x, dy, prim.scratch)
                    np.copyto(dw, prim.scratch.T)
                if db is not None:
                    _bias.bias_grad(dy, db)

            _dense_run((op, x.shape, dw.shape, db is not None), run_transposed,
                       lambda: _ref.dense_backward_weights(x, dy, dw, db), 2 * n * dw.size)
            return dw

    def build():
        desc = _create_pd("dnnl_matmul_primitive_desc_create", _engine, _smd((o, n), (1, o)),
                          _smd((n, i), (i, 1)), _NULL, _smd((o, i), (i, 1)), _attr,
                          detail=f"dense bwd weights x {x.shape} dw {dw.shape}")
        if _optimized(desc):
            return _Primitive(f"{op} x {x.shape} dw {dw.shape}", desc,
                              [api.ARG_SRC, api.ARG_WEIGHTS, api.ARG_DST]), True
        # the matmul would run reference code: the inner product's weight gradient instead
        desc = _create_pd("dnnl_inner_product_backward_weights_primitive_desc_create", _engine,
                          _md(x.shape), _md(dw.shape), _NULL, _md(dy.shape),
                          _ip_fwd(x.shape, dw.shape, False).pd, _attr,
                          detail=f"dense bwd weights x {x.shape} dw {dw.shape}")
        return _Primitive(f"{op} x {x.shape} dw {dw.shape}", desc,
                          [api.ARG_SRC, api.ARG_DIFF_DST, api.ARG_DIFF_WEIGHTS]), False

    def run():
        prim, matmul = _cached(("mm_bwd_weights", x.shape, o), build)
        if matmul:
            prim.run(dy, x, dw)
        else:
            prim.run(x, dy, dw)
        if db is not None:
            _bias.bias_grad(dy, db)

    _dense_run((op, x.shape, dw.shape, db is not None), run,
               lambda: _ref.dense_backward_weights(x, dy, dw, db), 2 * n * dw.size)
    return dw


def _wgrad_transposed_primitive(n, i, o):
    """The matmul dw.T (i, o) = x.T @ dy with its scratch output, or None where oneDNN would
    run reference code for it (the direct product is used then)."""
    def build():
        desc = _create_pd("dnnl_matmul_primitive_desc_create", _engine, _smd((i, n), (1, i)),
                          _smd((n, o), (o, 1)), _NULL, _smd((i, o), (o, 1)), _attr,
                          detail=f"dense bwd weights (transposed) x {(n, i)} dw {(o, i)}")
        if not _optimized(desc):
            return False
        prim = _Primitive(f"dense_backward_weights (transposed) x {(n, i)} dw {(o, i)}", desc,
                          [api.ARG_SRC, api.ARG_WEIGHTS, api.ARG_DST])
        prim.scratch = np.empty((i, o), dtype=np.float32)
        return prim

    return _cached(("mm_bwd_weights_t", n, i, o), build) or None


def relu_backward_bias(dy, y, dx, db):
    """dx = dy where y > 0, else 0, and db = sum of dx over the batch, in one threaded pass
    (y is the output of ``dense_forward(..., relu=True)``; dx may be dy). Returns dx."""
    op = "relu_backward_bias"
    ck.check_relu_backward_bias(op, dy, y, dx, db, **_F32)
    _bias.relu_backward_bias(dy, y, dx, db)
    return dx


# --- operations oneDNN has no better kernel for: shared NumPy code, float32 checks ---------

def concat_channels(xs, out):
    """Concatenate NCHW arrays along C into out (memory copies)."""
    ck.check_concat("concat_channels", xs, out, **_F32)
    return _ref.concat_channels(xs, out)


def slice_channels(x, start, out):
    """out = x[:, start:start + C] for out (N, C, ...) (a memory copy)."""
    ck.check_slice("slice_channels", x, start, out, **_F32)
    return _ref.slice_channels(x, start, out)


def place_channels(x, start, out):
    """out[:, start:start + C] = x for x (N, C, ...) (a memory copy of x alone)."""
    ck.check_place("place_channels", x, start, out, **_F32)
    return _ref.place_channels(x, start, out)


def split_channels(dy, sizes, outs):
    """Split dy along C into outs with the given channel counts (inverse of concat)."""
    ck.check_split("split_channels", dy, sizes, outs, **_F32)
    return _ref.split_channels(dy, sizes, outs)


def softmax_cross_entropy(logits, labels, dlogits_out):
    """Mean softmax cross-entropy over the batch; writes d(loss)/d(logits) unless None."""
    ck.check_softmax_ce("softmax_cross_entropy", logits, labels, dlogits_out, **_F32)
    return _ref.softmax_cross_entropy(logits, labels, dlogits_out)


def sgd_update(param, grad, lr):
    """param -= float32(lr) * grad, in place: one threaded pass, bitwise NumPy's result (see _sgd)."""
    ck.check_same_shape("sgd_update", "param", param, [("grad", grad, False)], **_F32)
    ck.array("sgd_update", "param", param, writable=True)
    ck.check_lr("sgd_update", lr)
    return _sgd.sgd_update(param, grad, lr)
