"""The benchmark conventions (benchmarks/_common.py) and the library's thread settings."""

import ast
import importlib.util
import json
import os
import pathlib
import sys

import pytest

import cachedarrays as ca
from cachedarrays import threads

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))          # as when the script runs: its siblings import
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


common = _load("_common")


def test_the_library_asks_for_passive_openmp_waiting_before_any_runtime_loads(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert threads.prefer_passive_wait() == "PASSIVE" == os.environ["OMP_WAIT_POLICY"]
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")          # the user's choice stands
    assert threads.prefer_passive_wait() == "ACTIVE"
    # cachedarrays/__init__.py calls it before importing anything that may start a runtime
    body = ast.parse((ROOT / "cachedarrays" / "__init__.py").read_text()).body
    stmts = [n for n in body if not isinstance(n, ast.Expr) or isinstance(n.value, ast.Call)]
    first_call = next(i for i, n in enumerate(stmts) if isinstance(n, ast.Expr))
    assert ast.unparse(stmts[first_call]) == "threads.prefer_passive_wait()"
    assert [ast.unparse(n) for n in stmts[:first_call]] == ["from . import threads"]


def test_limit_sets_every_loaded_pool_and_describe_names_them():
    import numba
    before = numba.get_num_threads()
    try:
        s = threads.limit(1)
        assert s["OMP_NUM_THREADS"] == "1" and s["numba"] == 1
        assert all(n == 1 for _, _, _, n in s["pools"])
        line = threads.describe(s)
        assert "OMP_WAIT_POLICY=" in line and "numba 1" in line
    finally:
        threads.limit(before)
    with pytest.raises(ValueError, match="threads >= 1"):
        threads.limit(0)


@pytest.mark.parametrize("bad, error", [
    (True, TypeError), (2.7, TypeError), (1.0, TypeError), ("2", TypeError), (None, TypeError),
    (float("nan"), TypeError), (float("inf"), TypeError), (0, ValueError), (-1, ValueError),
    (10**6, ValueError), (10**30, ValueError)])
def test_limit_refuses_a_bad_thread_count_before_changing_any_pool(monkeypatch, bad, error):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads.settings()          # the first call starts numba's threads, which loads a pool
    before = threads.settings()
    with pytest.raises(error, match="threads"):
        threads.limit(bad)
    assert threads.settings() == before            # nothing half set


def test_limit_restores_omp_num_threads_when_a_pool_refuses(monkeypatch):
    import threadpoolctl

    def refuse(*args, **kwargs):
        raise RuntimeError("pool refused")

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(threadpoolctl, "threadpool_limits", refuse)
    with pytest.raises(RuntimeError, match="pool refused"):
        threads.limit(2)
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_stat_median_spread_and_speedup_direction():
    s = common.Stat([0.003, 0.001, 0.002])
    assert (s.median, s.lo, s.hi, s.n) == (0.002, 0.001, 0.003, 3)
    assert s.fmt(1e3, "ms", 1) == "2.0 ms [1.0-3.0, n=3]"
    assert common.speedup(peer=2.0, ours=1.0) == 2.0          # > 1: we are faster
    assert common.speedups([2.0, 4.0, 3.0], [1.0, 1.0, 1.0]).median == 3.0
    with pytest.raises(ValueError):
        common.Stat([])


def test_interleaved_runs_alternate_direction_so_no_implementation_always_follows_another():
    assert list(common.turn_order(3, 0)) == [0, 1, 2]
    assert list(common.turn_order(3, 1)) == [2, 1, 0]
    calls = []
    samples = common.interleaved_samples([lambda: calls.append("a"), lambda: calls.append("b")],
                                         4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [len(s) for s in samples] == [4, 4]       # each fn's samples stay its own


def test_goal_lines_print_and_record(tmp_path, monkeypatch, capsys):
    path = tmp_path / "results.jsonl"
    monkeypatch.setenv("CA_BENCH_RESULTS", str(path))
    assert common.goal("lookup speedup", 1.25, 1.2) is True
    assert common.goal("extra per call", 4.0, 3.0, higher=False, unit=" us") is False
    common.headline("copy speedup", 1.1)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "goal lookup speedup: 1.25x (target >= 1.2x): met"
    assert out[1] == "goal extra per call: 4.00 us (target <= 3 us): not met"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["kind"], r["met"] if r["kind"] == "goal" else None) for r in rows] == [
        ("goal", True), ("goal", False), ("headline", None)]


def test_help_shows_defaults_and_hidden_choices():
    p = common.parser("Title line.\n\nMore text.")
    p.add_argument("--size", type=int, default=7, help="side")
    p.add_argument("--kind", default="a", choices=("a", "b"), metavar="K", help="which")
    p.add_argument("--said", default=3, help="n (default 3 here)")
    common.add_standard(p)
    text = p.format_help()
    assert "side (default: 7)" in text and "(choices: a, b)" in text
    assert "(default: 3 here)" not in text and text.count("default 3") == 1
    assert "--plot PATH" in text and "--threads" in text and "--no-progress" in text


def _scripts():
    return sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("path", _scripts(), ids=lambda p: p.name)
def test_every_script_follows_the_conventions(path):
    """Help from _common.parser, a help string on every flag, and --plot where it draws."""
    tree = ast.parse(path.read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute)]
    assert any(c.func.attr == "parser" for c in calls), f"{path.name}: use _common.parser"
    flags = [c for c in calls if c.func.attr == "add_argument"]
    for c in flags:
        names = [a.value for a in c.args if isinstance(a, ast.Constant)]
        assert any(k.arg == "help" for k in c.keywords), f"{path.name}: {names} has no help"
    assert "ArgumentParser(" not in path.read_text(), f"{path.name}: use _common.parser"


def test_run_all_writes_a_summary_of_goals(tmp_path, monkeypatch):
    run_all = _load("run_all")
    jobs = [("a", "a.py", ["--x", "1"])]
    results = [
        {"script": "a", "kind": "goal", "name": "g1", "value": 1.3, "target": 1.2,
         "higher": True, "unit": "x", "met": True, "detail": ""},
        {"script": "a", "kind": "goal", "name": "g2", "value": None, "detail": "LM 1.1x",
         "met": False},
        {"script": "a", "kind": "headline", "name": "h", "value": 2.0, "unit": "x", "detail": ""}]
    path = run_all.summary(str(tmp_path), jobs, [(3.0, 0, "python benchmarks/a.py --x 1")],
                           results, "machine: m", "threads: 2")
    text = pathlib.Path(path).read_text()
    assert "## Goals: 1 of 2 met" in text
    assert "| a | g1 | 1.30x | >= 1.2x | met |" in text
    assert "| a | g2 (LM 1.1x) | - | - | **not met** |" in text
    assert "`python benchmarks/a.py --x 1`" in text


# A numba kernel with a parallel loop, run once: it starts numba's pool (for the tests below,
# each in a fresh process, where nothing started it before).
_PARALLEL_KERNEL = (
    "import numpy as np, numba\n"
    "@numba.njit(parallel=True)\n"
    "def f(a):\n"
    "    s = 0.0\n"
    "    for i in numba.prange(a.shape[0]):\n"
    "        s += a[i]\n"
    "    return s\n"
    "f(np.ones(1000))\n")


def _fresh_process(cwd, before, after, **env_vars):
    """Run before, the parallel kernel and after in a fresh interpreter, with the thread
    variables of this one dropped and env_vars set (None: unset)."""
    import subprocess
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("OMP_NUM_THREADS", None)
    env.pop("NUMBA_NUM_THREADS", None)
    env.update({k: v for k, v in env_vars.items() if v is not None})
    return subprocess.run([sys.executable, "-c", before + _PARALLEL_KERNEL + after],
                          capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


def test_a_limit_set_before_numba_starts_its_pool_holds_for_openmp(tmp_path):
    # numba's pool, started, sets the OpenMP thread count to its own size: a fresh process,
    # where limit() is the first to touch numba's threads, oneDNN's OpenMP then the next
    r = _fresh_process(
        tmp_path, "from cachedarrays import threads\nthreads.limit(1)\n",
        "print(sorted({n for _, _, _, n in threads.settings()['pools']}))\n"
        "from cachedarrays.models.backend import onednn\n"
        "onednn.set_threads(1)\n"
        "print(onednn.get_threads())\n")
    lines = r.stdout.split()
    assert r.returncode == 0 or "OneDNN" in r.stderr, r.stderr
    assert lines[0] == "[1]", r.stdout             # every pool, OpenMP's too, on one thread
    if r.returncode == 0:
        assert lines[-1] == "1"                    # and oneDNN's calls from this thread


@pytest.mark.parametrize("omp, numba_env, want", [("1", None, "1 1"), ("1,1", None, "1 1"),
                                                  ("1", "2", "2 2"), ("junk", None, None)])
def test_omp_num_threads_sizes_numba_so_its_pool_keeps_openmp_to_it(tmp_path, omp, numba_env,
                                                                   want):
    r = _fresh_process(
        tmp_path, "import cachedarrays, os\n",
        "from threadpoolctl import threadpool_info\n"
        "omp = [p['num_threads'] for p in threadpool_info() if p['user_api'] == 'openmp']\n"
        "print(numba.get_num_threads(), max(omp) if omp else numba.get_num_threads(),\n"
        "      os.environ.get('NUMBA_NUM_THREADS'))\n",
        OMP_NUM_THREADS=omp, NUMBA_NUM_THREADS=numba_env)
    if omp == "junk":            # not a count: nothing is derived from it
        assert r.stdout.split()[-1] == "None", r.stdout + r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert " ".join(r.stdout.split()[:2]) == want   # numba's pool and OpenMP's count
