"""Long randomized runs of the state machines and the thread tests (``make stress``).

Runs rounds of every hypothesis state machine of the test suite and of the concurrency tests,
with fresh random seeds each round, until both the step target and the time target are met,
then prints what ran. Not part of ``make test``.

    python tests/stress.py --steps 100000 --minutes 5
"""

import argparse
import os
import sys
import time

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import invariant, run_state_machine_as_test

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_array_machine  # noqa: E402
import test_background_copies  # noqa: E402
import test_embedding  # noqa: E402
import test_heap  # noqa: E402
import test_lineage  # noqa: E402
import test_manager  # noqa: E402
import test_threads  # noqa: E402

MACHINES = {
    "ArrayMachine": test_array_machine.ArrayMachine,
    "ManagerMachine": test_manager.ManagerMachine,
    "HeapMachine": test_heap.HeapMachine,
    "CrowdedHeapMachine": test_heap.CrowdedHeapMachine,
    "CachedMatchesSimple": test_embedding.CachedMatchesSimple,
    # background prefetch/evict/cancel over three tiers; data and m.check() after every step
    "BackgroundCopyMachine": test_background_copies.BackgroundCopyMachine,
    # ca.compute, in-place updates, NumPy writes, drop, regenerate, moves and frees
    "LineageMachine": test_lineage.LineageMachine,
}

#: share of each round's examples per machine (the array machine covers the most code)
WEIGHTS = {"ArrayMachine": 4, "ManagerMachine": 2, "HeapMachine": 1, "CrowdedHeapMachine": 1,
           "CachedMatchesSimple": 1, "BackgroundCopyMachine": 2, "LineageMachine": 1}

THREAD_TESTS = [getattr(test_threads, n) for n in dir(test_threads)
                if n.startswith("test_") and callable(getattr(test_threads, n))]


def counted(cls, counter, name):
    """A subclass of machine cls that counts every step (each rule and initialization)."""

    class Counted(cls):
        @invariant()
        def _count_step(self):
            counter[name] = counter.get(name, 0) + 1

    Counted.__name__ = f"Counted{cls.__name__}"
    return Counted


def run_thread_test(fn):
    """Run one concurrency test the way pytest would (its autouse fixture included)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        fn()
    finally:
        sys.setswitchinterval(old)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100_000, help="at least this many steps")
    p.add_argument("--minutes", type=float, default=5.0, help="and at least this long")
    p.add_argument("--examples", type=int, default=40,
                   help="examples per machine and weight unit in one round")
    args = p.parse_args(argv)

    steps, examples, thread_runs = {}, {}, {}
    t0 = time.monotonic()
    rounds = 0
    while sum(steps.values()) < args.steps or time.monotonic() - t0 < args.minutes * 60:
        rounds += 1
        for name, cls in MACHINES.items():
            n = args.examples * WEIGHTS[name]
            base = getattr(cls.TestCase, "settings", None)
            step_count = getattr(base, "stateful_step_count", 40) if base else 40
            run_state_machine_as_test(
                counted(cls, steps, name),
                settings=settings(max_examples=n, stateful_step_count=step_count, deadline=None,
                                  database=None, derandomize=False,
                                  phases=[Phase.generate, Phase.shrink],
                                  suppress_health_check=list(HealthCheck)))
            examples[name] = examples.get(name, 0) + n
        for fn in THREAD_TESTS:
            run_thread_test(fn)
            thread_runs[fn.__name__] = thread_runs.get(fn.__name__, 0) + 1
        done = sum(steps.values())
        print(f"round {rounds}: {done} steps, {time.monotonic() - t0:.0f} s", flush=True)

    elapsed = time.monotonic() - t0
    print(f"\nstress: {rounds} rounds in {elapsed / 60:.1f} min, no failure")
    print(f"{'state machine':<22}{'examples':>10}{'steps':>10}")
    for name in MACHINES:
        print(f"{name:<22}{examples.get(name, 0):>10}{steps.get(name, 0):>10}")
    print(f"{'total':<22}{sum(examples.values()):>10}{sum(steps.values()):>10}")
    for name, n in thread_runs.items():
        print(f"thread test {name}: {n} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
