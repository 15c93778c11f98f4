"""Placement policies: the base Policy API, the default LRU, and baselines."""

from ..registry import register_policy
from .base import Policy
from .lru import LRU, PRESETS
from .simple import FastOnly, FirstTouch, SlowOnly   # each module registers its policies
from .memorymode import MemoryMode

__all__ = ["Policy", "LRU", "FirstTouch", "FastOnly", "SlowOnly", "MemoryMode", "PRESETS",
           "register_policy"]
