"""The default manager, created lazily from environment variables when first needed.

``CACHEDARRAYS_FAST`` (default 1GiB), ``CACHEDARRAYS_SLOW`` (default 4GiB),
``CACHEDARRAYS_SLOW_PATH`` (default: a temporary file) and ``CACHEDARRAYS_POLICY`` (default lru).
"""

import atexit
import os
import threading

from .errors import PinnedError
from .manager import Manager
from .sizes import parse_size

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
            _default = _from_environment()
        return _default


def _from_environment():
    """A Manager built from the CACHEDARRAYS_* variables; an error names the variable to fix
    (the program never passed the value the error is about)."""
    env = {k: os.environ.get(k) for k in ("CACHEDARRAYS_FAST", "CACHEDARRAYS_SLOW",
                                          "CACHEDARRAYS_SLOW_PATH", "CACHEDARRAYS_POLICY")}
    fast, slow, policy = (env[k] for k in ("CACHEDARRAYS_FAST", "CACHEDARRAYS_SLOW",
                                           "CACHEDARRAYS_POLICY"))
    fast = parse_size("1GiB" if fast is None else fast, "CACHEDARRAYS_FAST")
    slow = parse_size("4GiB" if slow is None else slow, "CACHEDARRAYS_SLOW")
    try:
        return Manager(fast=fast, slow=slow, slow_path=env["CACHEDARRAYS_SLOW_PATH"] or None,
                       policy="lru" if policy is None else policy)
    except (ValueError, TypeError, OSError) as e:
        given = ", ".join(f"{k}={v!r}" for k, v in env.items() if v is not None)
        if given:
            e.add_note(f"the default manager is made from the environment ({given}): fix or "
                       "unset the variable, or pass manager= (ca.set_default_manager)")
        raise


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
