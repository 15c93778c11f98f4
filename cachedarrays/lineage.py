"""Lineage: which kernel made each object's data, so that a dropped object can be rebuilt.

A ``ca.compute`` kernel leaves a ``Recipe``: its function, the layout of each operand view, the
ids and versions of the objects it read and the ids of those it wrote. Each object keeps its
*chain*: the recipes that made its current data, oldest first. A kernel whose function
overwrites an operand it does not read starts that operand's chain afresh; one that also reads
it (an in-place kernel) extends it. A write by anything else (``ca.kernel``, ``ca.access``,
``ca.writable``, a NumPy call) breaks the chain: the chain then holds that kernel's name (or a
1-tuple with the reason). None: the object still holds the contents it was created with.

Recipes hold object ids, never objects: lineage keeps no array alive, and an input freed since
makes its dependants not regenerable. The manager (``Manager.drop``/``regenerate``) uses this.
"""

import numpy as np

__all__ = ["Recipe", "why_not", "MAX_CHAIN"]

# An object rewritten in place by more recipes than this is not regenerable (its chain would
# grow without bound: an accumulator updated every step).
MAX_CHAIN = 64


class Recipe:
    """One ``ca.compute`` call: enough to run it again on the same operands.

    args: per positional argument of fn, None or (object id, is_write, dtype, shape, strides,
    byte offset). partial: ids of the writes made through a view of part of the object (the
    rest keeps its earlier contents, as for an in-place kernel). fn None: a recipe a replay made for a pure kernel of its trace (virtual
    devices have no data; a rerun only uses the operands). seconds: the kernel's recorded time
    (replays force it on the rerun). traced: ((recorder weak reference, kernel index), ...).
    """

    __slots__ = ("name", "fn", "args", "rng", "touched", "seconds", "reads", "versions",
                 "writes", "traced", "partial")

    def __init__(self, name, fn, args=(), rng=None, touched=None, seconds=None, partial=()):
        self.name = name
        self.fn = fn
        self.args = args
        self.rng = rng                # None or (bit generator class, its state dict)
        self.touched = touched
        self.seconds = seconds
        self.reads = self.versions = self.writes = ()
        self.traced = ()
        self.partial = partial        # ids of writes through a view of part of the object

    def record(self, reads, writes):
        """The kernel is acquired: note its inputs' versions and extend its outputs' chains.

        Called by the manager before the write versions go up."""
        self.reads = rids = [o.id for o in reads]
        self.versions = [o.version for o in reads]
        ids = []
        for o in writes:
            if o.id in ids:
                continue
            ids.append(o.id)
            if o.id in rids or o.id in self.partial:    # in place: the chain goes on
                chain = o.chain
                if type(chain) is list:
                    if len(chain) < MAX_CHAIN:
                        chain.append(self)
                    else:
                        o.chain = (f"more than {MAX_CHAIN} ca.compute kernels in a row rewrote "
                                   f"it in place (the last: {self.name!r})",)
                elif chain is None:
                    o.chain = (f"kernel {self.name!r} updated it in place, but its earlier "
                               "contents were not made by a ca.compute kernel",)
            else:                                 # overwritten: its data is this kernel's
                o.chain = [self]
            o.version += 1
        self.writes = ids

    def kernel_of(self, recorder):
        """The kernel index a recorder gave this recipe's call (None if it did not see it)."""
        for ref, k in self.traced:
            if ref() is recorder:
                return k
        return None

    def rng_for_rerun(self):
        """A fresh np.random.Generator in the state the original call's generator had."""
        cls, state = self.rng
        bg = cls()
        bg.state = state
        return np.random.Generator(bg)

    def __repr__(self):
        return (f"<Recipe {self.name!r} reads={list(self.reads)} writes={list(self.writes)}"
                f"{' (no function)' if self.fn is None else ''}>")


def capture_rng(rng):
    """(bit generator class, state) of a np.random.Generator, for a rerun in the same state."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"ca.compute: rng must be a numpy.random.Generator (its state is "
                        f"captured so that a regeneration draws the same numbers), got "
                        f"{type(rng).__name__}; make one with np.random.default_rng(seed)")
    bg = rng.bit_generator
    return type(bg), bg.state


def _broken(obj, chain):
    if chain is None:
        return (f"its data was not made by a ca.compute kernel (it was created with contents: "
                "ca.asarray, ca.zeros, a NumPy call, ...)")
    if type(chain) is tuple:                      # a reason noted when the chain broke
        return chain[0]
    return (f"kernel {chain!r} wrote it last and is not a ca.compute kernel (a ca.kernel, "
            "ca.access, ca.writable or NumPy call records no recipe)")


def why_not(m, obj, virtual=None, memo=None, writing=(), known=None):
    """Why obj cannot be regenerated from its chain on manager m, in words; None if it can.

    writing: ids of objects a kernel is about to write (an object made from one of them must
    not be dropped now: its input is about to change). known: None, or a set of ids of dropped
    objects known to be regenerable (not walked again); each dropped object found regenerable
    is added to it. The walk keeps its own stack: a chain of any length is checked."""
    if obj.freed:
        return f"object {obj.id} was freed"
    if memo is None:
        memo = {}
    elif obj.id in memo:
        return memo[obj.id]
    if virtual is None:
        virtual = m.fast.virtual
    memo[obj.id] = None                           # no cycles, but never loop if there were
    stack = [(obj, _reasons(m, obj, virtual, writing))]
    sub = None
    while True:
        o, steps = stack[-1]
        try:
            r = steps.send(sub)                   # the next dropped input it needs checked
        except StopIteration as done:
            sub = memo[o.id] = done.value
            stack.pop()
            if sub is None and known is not None and o.dropped:
                known.add(o.id)
            if not stack:
                return sub
            continue
        if r.id in memo:
            sub = memo[r.id]
        elif r.freed:
            sub = f"object {r.id} was freed"
        elif known is not None and r.id in known:
            sub = None
        else:
            memo[r.id] = sub = None
            stack.append((r, _reasons(m, r, virtual, writing)))


def _reasons(m, obj, virtual, writing):
    """The checks of why_not for obj alone, as a generator: it yields each dropped input, is
    sent back that input's reason (None: regenerable), and returns obj's reason."""
    chain = obj.chain
    if type(chain) is not list or not chain:
        return _broken(obj, chain)
    for e in chain:
        if e.fn is None and not virtual:
            return (f"kernel {e.name!r} was recorded without its function (a replay's "
                    "recipe); only a virtual manager can rerun it")
        for rid, v in zip(e.reads, e.versions):
            if rid == obj.id:
                continue
            r = m.object(rid)
            if r is None:
                return f"input object {rid} of kernel {e.name!r} was freed"
            if rid in writing:
                return (f"input object {rid} of kernel {e.name!r} is about to be "
                        "written by the kernel starting now")
            if r.version != v:
                return (f"input object {rid} of kernel {e.name!r} was written since "
                        f"(version {r.version}; the kernel read version {v})")
            if r.dropped:
                sub = yield r
                if sub is not None:
                    return (f"input object {rid} of kernel {e.name!r} was dropped and "
                            f"cannot be regenerated: {sub}")
    return None


def scratch(dtype, shape, strides, offset):
    """A throwaway ndarray with the layout of an operand view (same alignment as a region's
    data), for an output of a rerun kernel that must not be overwritten."""
    itemsize = np.dtype(dtype).itemsize
    hi = offset + itemsize
    for n, s in zip(shape, strides):
        if n == 0:
            return np.empty(shape, dtype)
        if s > 0:
            hi += (n - 1) * s
    raw = np.empty(hi + 64, np.uint8)
    skip = (-raw.ctypes.data) % 64
    return np.ndarray(shape, dtype, raw, skip + offset, strides)
