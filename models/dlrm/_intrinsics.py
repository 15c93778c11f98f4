"""LLVM intrinsics for the numba kernels: prefetch hints and a fused multiply-add.

``fma`` rounds once, in every kernel and on every CPU alike: kernels that must give
bit-identical sums (a shape-specialised kernel and its generic twin) both call it, instead of
leaving the fusion of ``s += a * b`` to LLVM, which may fuse one and not the other.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["fma", "prefetch_read", "prefetch_read_l2", "prefetch_write"]


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
