"""Dedicated implementations of NumPy functions for CachedArrays, one module per group.

Each module registers its routines with ``cachedarrays.dispatch.implements`` when imported (the
package's ``__init__`` imports this package); NumPy functions without one take the general path
(``cachedarrays.dispatch._call_on_views``).

- ``creation``: the *_like forms and ``like=`` (NEP 35)
- ``joining``: concatenate, stack, vstack, hstack
- ``clipping``: clip
- ``elementwise``: round, around, diff
- ``ordering``: sort, cumsum, cumprod
- ``selection``: where, take
- ``tiling``: roll, tile, outer
- ``describing``: shape, ndim, size (read from the description, as the attributes are)
"""

from . import (clipping, creation, describing, elementwise, joining, ordering, selection,
               tiling)

__all__ = ["clipping", "creation", "describing", "elementwise", "joining", "ordering",
           "selection", "tiling"]
