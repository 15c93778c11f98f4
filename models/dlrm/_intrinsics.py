"""LLVM intrinsics for the numba kernels: prefetch hints, a fused multiply-add and row sums
in 512-bit vectors.

``fma`` rounds once, in every kernel and on every CPU alike: kernels that must give
bit-identical sums (a shape-specialised kernel and its generic twin) both call it, instead of
leaving the fusion of ``s += a * b`` to LLVM, which may fuse one and not the other.
"""

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["add_rows1", "add_rows4", "add_rows8", "fma", "FAR_LOCALITY", "far_locality",
           "prefetch_far", "prefetch_read", "prefetch_read_l2", "prefetch_write", "ROW_LANES",
           "ROW_VECTOR_BYTES"]


def _make_prefetch(rw, locality=3):
    @intrinsic
    def prefetch(typingctx, arr, idx):
        sig = types.void(arr, idx)

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]],
                                           wraparound=False)
            i32 = ir.IntType(32)
            # one declaration for every element type: prefetches of several arrays can
            # share an LLVM module once numba inlines the helpers
            ptr = builder.bitcast(ptr, cgutils.voidptr_t)
            fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            builder.call(fn, [ptr, i32(rw), i32(locality), i32(1)])  # data cache
            return context.get_dummy_value()

        return sig, codegen

    return prefetch


#: ``prefetch_read(arr, i)`` / ``prefetch_write(arr, i)``: an ``llvm.prefetch`` hint for
#: ``arr[i]`` into the first-level cache (``prefetcht0`` / ``prefetchw`` on x86); a hint never
#: faults, so no bounds check is needed.
prefetch_read = _make_prefetch(0)
prefetch_write = _make_prefetch(1)
#: ``prefetch_read_l2(arr, i)``: the same hint into the second-level cache (``prefetcht1``).
#: A core has few first-level miss buffers (16 here) and many more second-level ones: random
#: rows fetched far ahead into L2 keep several times more misses in flight, where a
#: ``prefetcht0`` as far ahead stalls on the full buffers.
prefetch_read_l2 = _make_prefetch(0, locality=2)


def far_locality(cpu=None):
    """The ``llvm.prefetch`` locality of a read hint issued far ahead (``prefetch_far``) on the
    CPU that numba compiles for (``cpu``: its LLVM name): 3, the first-level cache, on AMD Zen
    (``znver*``), else 2, the second level.

    On a Zen 5 (two cores, 1M x 64 float32 table, 327,680 indices, paired runs) rows and
    ``where`` entries hinted into L1 made bag lookups 4-8% (uniform) and 3-20% (Zipf) faster
    and cached-table lookups 10-20% faster than hinted into L2; on a Sapphire Rapids Xeon the
    same hints into L1 stall on its full miss buffers (see ``prefetch_read_l2``).  The choice
    follows the CPU name only, which is part of the key of numba's on-disk cache, so a cached
    kernel always carries the hint of the CPU it was compiled for."""
    if cpu is None:
        cpu = numba.config.CPU_NAME
        if not cpu or cpu == "host":
            cpu = llvm.get_host_cpu_name()
    return 3 if str(cpu).startswith("znver") else 2


#: The locality of ``prefetch_far`` on this machine (see ``far_locality``).
FAR_LOCALITY = far_locality()
#: ``prefetch_far(arr, i)``: a read hint for ``arr[i]``, issued dozens of iterations ahead of
#: the read, into the cache level that suits this CPU (``FAR_LOCALITY``).
prefetch_far = _make_prefetch(0, locality=FAR_LOCALITY)


@intrinsic
def fma(typingctx, a, b, c):
    """``fma(a, b, c)``: a * b + c rounded once (``llvm.fma``), for three float32 or three
    float64 values."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        lty = context.get_value_type(signature.return_type)
        name = f"llvm.fma.f{signature.return_type.bitwidth}"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lty, [lty] * 3), name)
        return builder.call(fn, list(args))

    return a(a, b, c), codegen


#: Bytes of the vectors ``add_rows*`` sum in (512 bits); callers sum the rest of a row.
ROW_VECTOR_BYTES = 64
#: Elements per vector of ``add_rows*``, by item size.
ROW_LANES = {4: ROW_VECTOR_BYTES // 4, 8: ROW_VECTOR_BYTES // 8}


def _row_sum_signature(acc, t, rest):
    # contiguous 1-D arrays only: the vectors are loaded from consecutive elements
    if (isinstance(acc, types.Array) and isinstance(t, types.Array)
            and acc.ndim == t.ndim == 1 and acc.layout == t.layout == "C"
            and acc.dtype == t.dtype and acc.dtype in (types.float32, types.float64)
            and all(isinstance(a, types.Integer) for a in rest)):
        return types.void(acc, t, *rest)
    return None


def _row_sum_codegen(k):
    """The code of ``add_rows<k>`` (see ``add_rows8``)."""
    def codegen(context, builder, signature, args):
        aty, tty = signature.args[0], signature.args[1]
        acc = context.make_array(aty)(context, builder, args[0])
        tab = context.make_array(tty)(context, builder, args[1])
        i64 = ir.IntType(64)
        offsets = [context.cast(builder, a, ty, types.uint64)
                   for a, ty in zip(args[2:2 + k], signature.args[2:2 + k])]
        n = context.cast(builder, args[2 + k], signature.args[2 + k], types.uint64)
        size = aty.dtype.bitwidth // 8
        lanes = ROW_LANES[size]
        vty = ir.VectorType(context.get_value_type(aty.dtype), lanes)
        with cgutils.for_range(builder, builder.udiv(n, i64(lanes))) as loop:
            f = builder.mul(loop.index, i64(lanes))
            ap = builder.bitcast(builder.gep(acc.data, [f]), vty.as_pointer())
            v = builder.load(ap, align=size)
            for p in offsets:
                tp = builder.bitcast(builder.gep(tab.data, [builder.add(p, f)]),
                                     vty.as_pointer())
                v = builder.fadd(v, builder.load(tp, align=size))
            builder.store(v, ap, align=size)
        return context.get_dummy_value()
    return codegen


@intrinsic
def add_rows8(typingctx, acc, t, p0, p1, p2, p3, p4, p5, p6, p7, n):
    """``add_rows8(acc, t, p0, .., p7, n)``: acc[f] = acc[f] + t[p0 + f] + ... + t[p7 + f] for
    f < n, in that order (bitwise a scalar loop's sums), in 512-bit vectors.  ``n`` must be
    a multiple of ``ROW_LANES[itemsize]``; acc and t are 1-D float32 or float64 arrays of
    one dtype; the offsets are not checked.

    LLVM's vectoriser prefers 256-bit vectors on this generation of x86 (``prefer-256-bit``);
    written as 512-bit vectors the row sums use the full registers, as FBGEMM's kernels
    (PyTorch's ``EmbeddingBag``) do: a 1M x 64 bag lookup measured 12-21% faster.  Where
    there is no AVX-512, LLVM splits each vector into the widths the CPU has."""
    return _row_sum_signature(acc, t, (p0, p1, p2, p3, p4, p5, p6, p7, n)), _row_sum_codegen(8)


@intrinsic
def add_rows4(typingctx, acc, t, p0, p1, p2, p3, n):
    """``add_rows8`` of four rows."""
    return _row_sum_signature(acc, t, (p0, p1, p2, p3, n)), _row_sum_codegen(4)


@intrinsic
def add_rows1(typingctx, acc, t, p0, n):
    """``add_rows8`` of one row."""
    return _row_sum_signature(acc, t, (p0, n)), _row_sum_codegen(1)
