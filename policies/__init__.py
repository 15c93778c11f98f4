"""Placement policies: the base Policy API, the default LRU, and baselines."""

from ..registry import register_policy
from .base import Policy
from .lru import LRU, PRESETS
from .simple import FastOnly, FirstTouch, SlowOnly   # each module registers its policies
from .memorymode import MemoryMode
from .planned import PlannedPolicy
from .sentinel import Sentinel
from .autotm import AutoTM
from .deeptm import DeepTM
from .capuchin import Capuchin, Checkpointing, SwapOnly
from .g10 import G10, BaseUVM, FlashNeuron

__all__ = ["Policy", "LRU", "FirstTouch", "FastOnly", "SlowOnly", "MemoryMode", "PlannedPolicy",
           "Sentinel", "DeepTM", "AutoTM", "Capuchin", "SwapOnly", "Checkpointing",
           "G10", "BaseUVM", "FlashNeuron", "PRESETS",
           "register_policy"]
