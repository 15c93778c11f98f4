"""Policies by name: the table ``Manager(policy="lru")`` looks a name up in.

It sits below the manager so that the manager never imports the policies: each policy module
registers its classes here when it is imported (importing ``cachedarrays`` imports them all).
"""

_POLICIES = {}


def register_policy(name, factory, replace=False):
    """Make a policy available by name, e.g. ``Manager(policy="lru")``; names ignore case.

    factory is called with the manager's ``policy_options`` as keywords (usually the class).
    A name taken by another factory is refused unless replace=True: otherwise every
    ``Manager(policy=name)`` would silently get the new policy (a built-in's name, say).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_policy: the name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"register_policy({name!r}, ...): the factory must be callable (a "
                        f"Policy subclass), got {type(factory).__name__}")
    key = name.lower()
    old = _POLICIES.get(key)
    if old is not None and not replace and not _same(old, factory):
        raise ValueError(f"policy name {name!r} is taken by {_label(old)}; choose another "
                         f"name for {_label(factory)}, or pass replace=True to stand in for it")
    _POLICIES[key] = factory


def _same(a, b):
    """The same factory, or the same class defined again (a module imported anew)."""
    if a is b:
        return True
    where = [(getattr(f, "__module__", None), getattr(f, "__qualname__", None)) for f in (a, b)]
    return where[0] == where[1] and where[0][1] is not None


def _label(factory):
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', factory)}"


def policy_names():
    """The registered policy names, sorted."""
    return sorted(_POLICIES)


def resolve(name):
    """The factory registered under name; ValueError naming the known policies if there is none."""
    factory = _POLICIES.get(name.lower())
    if factory is None:
        known = ", ".join(policy_names()) or ("none yet (import cachedarrays, which registers "
                                              "the built-in policies)")
        raise ValueError(f"unknown policy {name!r}; known policies: {known}")
    return factory
