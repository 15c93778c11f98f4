"""The default manager, created lazily from environment variables when first needed.

``CACHEDARRAYS_FAST`` (default 1GiB), ``CACHEDARRAYS_SLOW`` (default 4GiB),
``CACHEDARRAYS_SLOW_PATH`` (default: a temporary file) and ``CACHEDARRAYS_POLICY`` (default lru).
"""

import atexit
import os
import threading

from .errors import PinnedError
from .manager import Manager

_default_lock = threading.Lock()
_default = None


def default_manager():
    """The manager used when none is given; created on first use."""
    global _default
    m = _default
    if m is not None and not m.closed:
        return m
    with _default_lock:
        if _default is None or _default.closed:
            _default = Manager(
                fast=os.environ.get("CACHEDARRAYS_FAST", "1GiB"),
                slow=os.environ.get("CACHEDARRAYS_SLOW", "4GiB"),
                slow_path=os.environ.get("CACHEDARRAYS_SLOW_PATH") or None,
                policy=os.environ.get("CACHEDARRAYS_POLICY", "lru"),
            )
        return _default


def set_default_manager(manager):
    """Use manager for arrays created without manager=; returns the previous default."""
    global _default
    if manager is not None and not isinstance(manager, Manager):
        raise TypeError(f"expected a Manager or None, got {type(manager).__name__}")
    with _default_lock:
        prev, _default = _default, manager
    return prev


def _forget_in_child():
    """A forked child makes its own default manager (its parent's is refused there)."""
    global _default, _default_lock
    _default_lock = threading.Lock()
    _default = None


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _close_default():
    """At exit, close the default manager unless a thread still uses it (no wait: a daemon
    thread's scope never ends; the process releases everything anyway)."""
    if _default is not None:
        try:
            _default.close(timeout=0)
        except PinnedError:
            pass
