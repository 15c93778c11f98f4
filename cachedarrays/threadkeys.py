"""Keys for threads that no other thread ever gets: what per-thread state (pins, open access
scopes, kernel stacks) is keyed by.

``threading.get_ident()`` values are reused: a thread started after another one ended often gets
the same ident, so state keyed by it would pass from the thread that ended to the new one.
``current()`` gives each thread a key of its own for the life of the process; ``watch(queue)``
appends the calling thread's key to queue (a ``Queue``) when the thread ends. That is all a dying
thread does: whoever holds the queue reads it at its next call, under its own lock. A thread
holds its queues weakly, so a queue whose owner is gone (a closed manager) is forgotten.
"""

import itertools
import threading
import weakref

_local = threading.local()
_count = itertools.count(1)


class Queue(list):
    """The list ``watch`` appends to: a list that can be referenced weakly."""

    __slots__ = ("__weakref__",)


class _Life:
    """Held in one thread's local storage only, so it is collected when that thread ends."""

    __slots__ = ("key", "queues")

    def __init__(self, key):
        self.key = key
        self.queues = weakref.WeakValueDictionary()     # id(queue) -> queue, while it lives

    def __del__(self):
        for q in list(self.queues.values()):
            q.append(self.key)


def _life():
    life = getattr(_local, "life", None)
    if life is None:
        life = _local.life = _Life(next(_count))
    return life


def current():
    """The calling thread's key: an int that no other thread of this process gets."""
    life = getattr(_local, "life", None)
    return life.key if life is not None else _life().key


def watch(queue):
    """Append the calling thread's key to queue (a ``Queue``) when the thread ends, unless the
    queue is gone by then."""
    if not isinstance(queue, Queue):
        raise TypeError(f"threadkeys.watch needs a threadkeys.Queue, not {type(queue).__name__}")
    life = _life()
    if life.queues.get(id(queue)) is not queue:
        life.queues[id(queue)] = queue
