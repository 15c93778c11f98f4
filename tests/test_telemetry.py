"""Telemetry: every known event counter exists from the start, and every counted name is known."""

import pathlib
import re

import numpy as np

import cachedarrays as ca
from cachedarrays.telemetry import EVENTS, format_stats

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("cachedarrays", "policies", "models", "benchmarks")
COUNT_CALL = re.compile(r"""\.count\(\s*(["'])(\w+)\1""")


def test_every_event_counter_is_zero_from_the_start(m):
    events = m.stats()["events"]
    for name in EVENTS:
        assert events[name] == {"count": 0, "bytes": 0}
    assert m.stats()["events"]["asarray"]["count"] == 0


def test_every_event_counter_is_zero_after_reset(m):
    x = ca.ones(100, manager=m)
    np.asarray(x)
    assert m.stats()["events"]["asarray"] == {"count": 1, "bytes": 800}
    m.reset_stats()
    events = m.stats()["events"]
    assert {name: events[name] for name in EVENTS} == \
        {name: {"count": 0, "bytes": 0} for name in EVENTS}


def test_a_program_may_count_its_own_events(m):
    m.count("my_step", 10)
    assert m.stats()["events"]["my_step"] == {"count": 1, "bytes": 10}


def test_format_stats_lists_only_events_that_happened(m):
    np.asarray(ca.ones(10, manager=m))
    text = format_stats(m.stats())
    assert "asarray" in text and "writebacks_elided" not in text


def test_every_counted_name_in_the_source_tree_is_a_known_event():
    found = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for match in COUNT_CALL.finditer(path.read_text()):
                found.setdefault(match.group(2), path.relative_to(ROOT))
    assert {"asarray", "writebacks_elided", "prefetch_refused"} <= set(found)
    unknown = {name: str(path) for name, path in found.items() if name not in EVENTS}
    assert not unknown, f"add these counters to cachedarrays.telemetry.EVENTS: {unknown}"
