"""Placement policies: the base Policy API, the default LRU, and baselines."""

from ..manager import register_policy
from .base import Policy
from .lru import LRU, MODES
from .simple import FastOnly, FirstTouch, SlowOnly

for _cls in (LRU, FirstTouch, FastOnly, SlowOnly):
    register_policy(_cls.name, _cls)
register_policy("fast-only", FastOnly)
register_policy("slow-only", SlowOnly)
register_policy("first-touch", FirstTouch)

__all__ = ["Policy", "LRU", "FirstTouch", "FastOnly", "SlowOnly", "MODES", "register_policy"]
