"""Policies by name: the table ``Manager(policy="lru")`` looks a name up in.

It sits below the manager so that the manager never imports the policies: each policy module
registers its classes here when it is imported (importing ``cachedarrays`` imports them all).
"""

_POLICIES = {}


def register_policy(name, factory):
    """Make a policy available by name, e.g. ``Manager(policy="lru")``; names ignore case.

    factory is called with the manager's ``policy_options`` as keywords (usually the class).
    """
    _POLICIES[name.lower()] = factory


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
