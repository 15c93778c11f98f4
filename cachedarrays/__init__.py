"""cachedarrays: NumPy arrays larger than fast memory.

Each array lives in a small fast memory (DRAM) or a large slow one (persistent memory, CXL
memory or a file-backed mapping); a pluggable policy decides where, and moves whole arrays.
"""

from . import threads

threads.prefer_passive_wait()  # before numba or oneDNN start an OpenMP runtime (threads.py: why)
threads.numba_follows_openmp()  # before numba loads: its pool sets the OpenMP count at start

from . import errors  # noqa: E402
from .array import CachedArray, check_dtype
from .dispatch import implements
from .scopes import access, compute, kernel, readable, writable
from . import routines, ufuncs  # NumPy dispatch: ufunc handler, dedicated routines
from .annotations import (annotate, arrays_in, cleanup, drop, evict, in_fast, mark_layer,
                          mark_step, noescape, onobjects, prefetch, preserve, regenerate,
                          register_leaf_type, softevict, unsafe_free)
from .creation import (array, asarray, empty, empty_like, full, full_like, ones, ones_like,
                       zeros, zeros_like)
from .defaults import default_manager, set_default_manager
from .devices import DRAM, Device, SlowDevice, VirtualDevice
from .errors import (CachedArraysError, DeviceError, HeapCorruptionError, OutOfMemoryError,
                     PinnedError, RecomputeError, UseAfterFreeError)
from .manager import Manager, Object, Observer, Region
from .trace import Trace, trace
from .torchtrace import from_torch
from .replay import replay
from . import costmodel
from .registry import policy_names, register_policy
from .sizes import format_size, parse_size
from . import policies  # noqa: E402  (registers the built-in policies)

trace.from_torch = staticmethod(from_torch)   # cachedarrays.trace.from_torch(model, ...)

__version__ = "0.1.0"

__all__ = [
    "CachedArray", "Manager", "Object", "Region", "Device", "DRAM", "SlowDevice", "VirtualDevice",
    "Observer", "trace", "Trace", "from_torch", "replay", "costmodel", "kernel", "compute",
    "mark_layer", "mark_step", "drop", "regenerate",
    "asarray", "array", "empty", "zeros", "ones", "full",
    "empty_like", "zeros_like", "ones_like", "full_like",
    "readable", "writable", "access", "prefetch", "evict", "softevict", "in_fast", "unsafe_free",
    "onobjects", "arrays_in", "register_leaf_type", "preserve", "cleanup", "noescape", "annotate",
    "default_manager", "set_default_manager", "policies", "policy_names", "register_policy",
    "check_dtype", "implements", "parse_size", "format_size", "errors",
    "CachedArraysError", "OutOfMemoryError", "DeviceError", "UseAfterFreeError",
    "PinnedError", "HeapCorruptionError", "RecomputeError",
]
