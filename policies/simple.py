"""Baseline policies that never move data: FirstTouch, FastOnly and SlowOnly."""

from ..errors import OutOfMemoryError
from ..registry import register_policy
from ..sizes import format_size
from .base import Policy


class FirstTouch(Policy):
    """Fast memory if the array fits when it is created, else slow; never moves anything."""

    name = "firsttouch"
    honours_prefetch = False

    def prefetch(self, obj, force=False, wait=True):
        return self.in_fast(obj)

    def evict(self, obj, to=None, wait=True):
        return not self.in_fast(obj)


class FastOnly(Policy):
    """Everything in fast memory; running out is an error (the all-DRAM baseline)."""

    name = "fastonly"
    honours_prefetch = False
    fast_first = True       # allocate is alloc_fast or an error: new arrays may take the C path

    def new_in_fast(self, obj):
        """Nothing to note: the new region is already dirty (see fast_first) and this policy
        keeps no order of its own (a subclass that overrides on_fast or write_use gets the
        general form back)."""

    def allocate(self, nbytes):
        """In fast memory; when its free bytes would hold nbytes but no free block does, compact
        it once first (the moves are copies the cost model charges)."""
        obj = self.alloc_fast(nbytes)
        if obj is None and self.manager.compact(self.manager.fast, nbytes):
            obj = self.alloc_fast(nbytes)
        if obj is None:
            free = self.manager.fast.stats()["free"]
            raise OutOfMemoryError(
                f"FastOnly policy: {format_size(nbytes)} does not fit in fast memory "
                f"({format_size(free)} free of {format_size(self.manager.fast.size)}); "
                "use a larger fast= size or a policy that spills to slow memory")
        return obj

    def prefetch(self, obj, force=False, wait=True):
        return True

    def evict(self, obj, to=None, wait=True):
        return False


class SlowOnly(Policy):
    """Everything in slow memory (the all-PMem baseline)."""

    name = "slowonly"
    honours_prefetch = False

    def allocate(self, nbytes):
        return self.alloc_slow(nbytes)

    def prefetch(self, obj, force=False, wait=True):
        return False

    def evict(self, obj, to=None, wait=True):
        return True


for _cls, _alias in ((FirstTouch, "first-touch"), (FastOnly, "fast-only"), (SlowOnly, "slow-only")):
    register_policy(_cls.name, _cls)
    register_policy(_alias, _cls)
