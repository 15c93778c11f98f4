"""Annotated CNN training on CachedArrays: rrule layers, VGG/ResNet/DenseNet, setups and policy
figures from the policy lab (``ca.trace`` and the cost model).

``build(model, depth, batch=, image=, channels=, classes=, width=)`` makes a model;
``Session(manager, backend)`` runs its kernels (``ca.kernel`` scopes, layer marks);
``train_step`` does one SGD iteration (ending with a step mark); ``Trainer``/``run`` record each
iteration with ``ca.trace`` and evaluate it with fast-only kernel times
(``fast_only_reference``).
"""

from __future__ import annotations

import time

from .core import SGD, Param, Session, Unit
from .layers import (AvgPool2d, BatchNorm2d, Chain, Conv2d, Dense, Flatten, MaxPool2d, ReLU, add,
                     softmax_cross_entropy)
from .nets import (DenseLayer, Model, ResidualBlock, build, densenet, resnet, train_step, vgg,
                   MODELS)
from .runner import (PLANNED, REFERENCE_ITERATIONS, SETUPS, Trainer, check_setup, dram_budget,
                     fast_only_reference, make_policy, make_session, measure_footprint,
                     parse_budget, run, synthetic_batch)
from .trace import FORMULA, evaluate, figures, step_times, with_reference_times

__all__ = ["Session", "Param", "Unit", "SGD", "Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d",
           "AvgPool2d", "Flatten", "Dense", "Chain", "add", "softmax_cross_entropy", "Model",
           "ResidualBlock", "DenseLayer", "build", "vgg", "resnet", "densenet", "train_step",
           "MODELS", "PLANNED", "SETUPS", "Trainer", "check_setup", "dram_budget", "make_policy",
           "make_session", "measure_footprint", "parse_budget", "run", "synthetic_batch",
           "fast_only_reference", "REFERENCE_ITERATIONS", "FORMULA", "evaluate",
           "figures", "step_times", "with_reference_times", "demo"]


def demo(model="resnet", depth=18, iterations=2, budget="25%", setup="LM", backend="numpy",
         image=16, batch=8, width=4):
    """A short training run under a 25% DRAM budget (for ``make demo``); returns the last
    iteration's ``m.stats()`` with ``loss``, ``wall``, ``modelled`` (the cost model's time of
    the iteration), ``stall`` and ``budget`` added. ``budget`` is the setup's DRAM: its fast
    memory, or the 2LM setups' simulated DRAM cache."""
    t = time.perf_counter()
    recs = run(model, depth, setup=setup, iterations=iterations, backend=backend,
               batch=batch, image=image, width=width, **dram_budget(setup, budget))
    last = recs[-1]
    stats = dict(last["stats"])
    stats.update(loss=last["loss"], wall=last["wall"], modelled=last["modelled"],
                 stall=last["stall"],
                 budget=last["budget"], footprint=last["footprint"],
                 seconds=time.perf_counter() - t,
                 title=f"{model}{depth} setup {setup}, {iterations} iterations, DRAM budget {budget} "
                       f"of the measured footprint")
    return stats
