"""One step the routines share: a new, policy-placed CachedArray that a NumPy call fills."""

from ..array import CachedArray, fill_layout, new_filled
from ..pinning import record_new


def into_new(m, fill, operands, objs, shape, dt, name):
    """A new C-order CachedArray of shape and dt placed by m's policy, filled by
    ``fill(*operands, out=view of the result)`` with each CachedArray operand replaced by its
    view and objs (their objects) pinned and reported read: in C (``run_ufunc``, up to 8
    operands) unless the manager is busy, else through Manager.run (traced as ``name``). Short (under
    the manager's lock) when the new array and the operands hold at most SHORT_BYTES."""
    if len(operands) <= 8 and len(objs) <= 8:
        res = new_filled(m, fill, operands, objs, shape, dt)     # in C
        if res is not None:
            return res
    strides, nbytes, short = fill_layout(shape, dt, objs)

    def kernel(obj):                     # the same, while the manager is busy
        record_new(obj)
        res = CachedArray._make(obj, m, shape, dt, strides, 0)
        fill(*[a._kview() if type(a) is CachedArray else a for a in operands],
             out=res._kview())
        return res
    return m.run(kernel, objs, (), nbytes, name, short)
