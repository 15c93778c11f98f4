"""Telemetry: every known event counter exists from the start, and every counted name is known."""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cachedarrays as ca
from cachedarrays.telemetry import EVENTS, format_stats, read_event_log

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


@pytest.mark.parametrize("with_log", [False, True])
@pytest.mark.parametrize("field", ["t", "event"])
def test_an_event_field_may_not_overwrite_the_log_records_own_keys(tmp_path, with_log, field):
    log = tmp_path / "events.jsonl" if with_log else None
    with ca.Manager(fast="1MiB", slow="16MiB", event_log=log) as m:
        with pytest.raises(TypeError, match=f"field '{field}'"):
            m.count("mine", 0, **{field: 1})
        assert m.stats()["events"].get("mine", {"count": 0})["count"] == 0
        m.count("mine", 0, t_=1)
    if with_log:
        assert read_event_log(log)[-1]["event"] == "mine"


def test_an_empty_event_log_path_is_refused(tmp_path):
    for empty in ("", pathlib.Path("")):
        if os.fspath(empty):                  # pathlib.Path("") is ".": a directory
            with pytest.raises(IsADirectoryError, match="event_log"):
                ca.Manager(fast="1MiB", slow="16MiB", event_log=empty)
        else:
            with pytest.raises(ValueError, match="event_log is an empty path"):
                ca.Manager(fast="1MiB", slow="16MiB", event_log=empty)


def _logged(tmp_path, n=20):
    path = tmp_path / "events.jsonl"
    path.unlink(missing_ok=True)
    with ca.Manager(fast="1MiB", slow="16MiB", event_log=path) as m:
        for _ in range(n):
            ca.unsafe_free(ca.ones(10, manager=m))
    return path, path.read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0, 1))
def test_a_log_cut_anywhere_reads_back_as_its_complete_lines(tmp_path, cut):
    path, data = _logged(tmp_path)
    end = int(len(data) * cut)
    path.write_bytes(data[:end])
    complete = data[:end].count(b"\n")
    whole = [json.loads(line) for line in data.splitlines()]
    records = read_event_log(path)
    # the complete lines, and the next record only if the cut left all of it but its newline
    assert records == whole[:len(records)] and len(records) - complete in (0, 1)


def test_a_log_killed_mid_run_reads_back(tmp_path):
    path = tmp_path / "events.jsonl"
    code = ("import os, signal, cachedarrays as ca\n"
            f"m = ca.Manager(fast='1MiB', slow='16MiB', event_log={str(path)!r})\n"
            "for _ in range(3000):\n"
            "    ca.unsafe_free(ca.ones(10, manager=m))\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    subprocess.run([sys.executable, "-c", code], check=False, timeout=120)
    with open(path, "ab") as f:
        f.write(b'{"t": 1.0, "event": "al')      # a write the kill cut short
    records = read_event_log(path)
    assert records and all(r["event"] in ("alloc", "free") for r in records)


def test_a_corrupt_line_inside_the_log_is_named(tmp_path):
    path, data = _logged(tmp_path, 3)
    lines = data.splitlines(keepends=True)
    path.write_bytes(lines[0] + b"not json\n" + b"".join(lines[1:]))
    with pytest.raises(ValueError, match="line 2: not a JSON record"):
        read_event_log(path)


def test_a_manager_appending_to_a_cut_log_starts_a_line_of_its_own(tmp_path):
    path, data = _logged(tmp_path, 3)
    path.write_bytes(data[:-10])                     # the last record cut short
    with ca.Manager(fast="1MiB", slow="16MiB", event_log=path) as m:
        ca.unsafe_free(ca.ones(10, manager=m))
    before = [json.loads(line) for line in data.splitlines()[:-1]]
    records = read_event_log(path)
    assert records[:len(before)] == before
    assert [r["event"] for r in records[len(before):]] == ["alloc", "free"]

