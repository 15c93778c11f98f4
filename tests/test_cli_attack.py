"""The benchmark scripts and the demo as a careless or hostile user runs them: every bad flag,
path or environment gets a one-line error before the run, Ctrl-C exits 130 without a traceback,
and nothing is written outside the paths asked for."""

import argparse
import ast
import gzip
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from helpers import load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))          # as when a script runs: its siblings import
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_"))

common = load_benchmark("_common")


class _Captured(Exception):
    pass


def _parser_of(name, monkeypatch):
    """The ArgumentParser script `name` builds, caught as it starts parsing."""
    seen = []

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise _Captured

    monkeypatch.syspath_prepend(str(BENCH))
    mod = load_benchmark(name)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Captured):
        (mod.parse_args if name == "kernels" else mod.main)([])
    monkeypatch.undo()
    return seen[0]


def _flags(p):
    return {s: a for a in p._actions for s in a.option_strings if s.startswith("--")}


def _run(args, env=None, timeout=120, **kw):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", **(env or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT, **kw)


def _one_line_error(r, *needles):
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "error:" in last and all(n in last for n in needles), last


# ------------------------------------------------------------------------------ flags

@pytest.mark.parametrize("name", SCRIPTS)
def test_every_typed_flag_refuses_nan_inf_negative_and_words_at_parse_time(name, monkeypatch):
    p = _parser_of(name, monkeypatch)
    paths = ("figure path", "figure path or folder", "folder", "slow device path", "file")
    typed = [a for a in _flags(p).values()
             if a.type is not None and getattr(a.type, "__name__", "") not in paths]
    for a in typed:
        for bad in ("nan", "inf", "-1", "1e999", "abc", ""):
            with pytest.raises(argparse.ArgumentTypeError):
                a.type(bad)


@pytest.mark.parametrize("name", SCRIPTS)
def test_numbers_threads_plots_and_paths_go_through_the_shared_checks(name, monkeypatch):
    p = _parser_of(name, monkeypatch)
    flags = _flags(p)
    for a in flags.values():
        assert a.type not in (int, float), f"{name} {a.option_strings}: use a _common type"
        assert type(a).__name__ != "_StoreAction", f"{name} {a.option_strings}: may repeat"
    kinds = {"--plot": ("figure path", "figure path or folder"), "--slow-path":
             ("slow device path",), "--out": ("folder",), "--traces": ("folder",),
             "--outdir": ("folder",), "--times": ("file",)}
    for flag, names in kinds.items():
        if flag in flags:
            assert getattr(flags[flag].type, "__name__", None) in names, f"{name} {flag}"
    if "--threads" in flags and name != "copy_engine":          # copy_engine: a list
        assert flags["--threads"].type.__name__ == "thread count"
    assert "exit status:" in p.format_help() and "130 when interrupted" in p.format_help()
    assert "--no-progress" in flags                # every script takes the standard flags


def test_the_arguments_make_bench_passes_still_parse(monkeypatch):
    run_all = load_benchmark("run_all")
    for name, script, args in run_all.JOBS:
        _parser_of(script[:-3], monkeypatch).parse_args(args)


@pytest.mark.parametrize("name", SCRIPTS)
def test_repeated_items_of_a_list_flag_run_once(name, monkeypatch):
    p = _parser_of(name, monkeypatch)
    for a in _flags(p).values():
        if a.nargs == "+":
            assert type(a).__name__ == "Unique", f"{name} {a.option_strings}"
            ns = argparse.Namespace()
            a(p, ns, ["b", "a", "b"])
            assert getattr(ns, a.dest) == ["b", "a"]


def test_a_flag_given_twice_is_refused_not_silently_overridden(capsys):
    p = common.parser("t")
    p.add_argument("--size", "--side", type=common.whole(), default=1, help="n")
    p.add_argument("--cache", type=common.fraction(), nargs="+", action=common.Unique,
                   help="c")
    p.add_argument("--quick", action="store_true", help="q")
    for argv in (["--size", "1", "--size=2"], ["--size", "1", "--side", "2"],
                 ["--cache", "0.5", "--cache", "1"]):
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        assert e.value.code == 2 and "given twice" in capsys.readouterr().err
    ns = p.parse_args(["--size", "3", "--cache", "1", "1", "--quick", "--quick"])
    assert (ns.size, ns.cache, ns.quick) == (3, [1.0], True)
    assert p.parse_args(["--size", "4"]).size == 4          # each parse starts afresh


def test_list_types_refuse_empty_items_and_drop_repeats():
    sizes = common.listed(common.size(1))
    assert sizes("4K, 1M,4K") == [4096, 1 << 20]
    for bad, why in ((",", "empty item"), ("0", ">= 1 bytes"), ("-1M", "not a size"),
                     ("4K,,1M", "empty item")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            sizes(bad)
    pick = common.listed(common.one_of(("fast->fast", "LM")))
    assert pick("FAST->FAST,lm,LM") == ["fast->fast", "LM"]
    with pytest.raises(argparse.ArgumentTypeError, match="choose from fast->fast, LM"):
        pick("bogus")


@pytest.mark.parametrize("script, args, needle", [
    ("copy_engine.py", ["--sizes", "0"], "--sizes"),
    ("copy_engine.py", ["--threads", "0"], "--threads"),
    ("copy_engine.py", ["--directions", "up"], "--directions"),
    ("copy_engine.py", ["--nt-threshold=-5"], "--nt-threshold"),
    ("policies.py", ["--models", ","], "--models"),
    ("policies.py", ["--budgets", "nan"], "--budgets"),
    ("policies.py", ["--profile", "bogus"], "--profile"),
    ("policies.py", ["--sections", "capuchin", "--plot", "p.png"], "--plot draws"),
    ("cnn.py", ["--fast", "nan%"], "--fast"),
    ("cnn.py", ["--setup", "bogus"], "unknown setup"),
    ("kernels.py", ["--threads", "0"], "--threads"),
    ("matmul.py", ["--size", "10000000"], "needs about"),
    ("embedding.py", ["--rows", "10000000000"], "needs about"),
    ("overhead.py", ["--sizes", "10", "100000000000"], "needs about"),
    ("dask_tiers.py", ["--workers", "1000000"], "needs about"),
    ("allocator.py", ["--min-size", "2K", "--max-size", "1K"], "--min-size"),
    ("allocator.py", ["--heap", "1K"], "--heap"),
    ("allocator.py", ["--max-size", "1M", "--heap", "1M"], "--max-size"),
    ("allocator.py", ["--max-size", "1T", "--heap", "1M"], "--max-size"),
    ("allocator.py", ["--ops", "100000000000"], "needs about"),
    ("allocator.py", ["--live", "100000000000"], "needs about"),
])
def test_bad_values_of_list_and_size_flags_are_usage_errors(script, args, needle):
    r = _run([str(BENCH / script), *args])
    _one_line_error(r, needle)


@pytest.mark.parametrize("bad", ["0", "-1", "2.5", "nan", "10000000000", "x"])
def test_thread_count_is_refused_with_its_range(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="whole number"):
        common.thread_count(bad)
    assert common.thread_count("1") == 1


def test_number_types_name_their_range():
    assert common.whole(0)("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match=">= 1, got 0"):
        common.whole()("0")
    assert common.fraction()("0.5") == 0.5
    for bad in ("nan", "-0.1", "1.5", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="from 0 to 1"):
            common.fraction()(bad)
    for bad in ("0", "nan", "inf", "-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="finite number > 0"):
            common.positive(bad)


def test_a_bad_flag_is_one_line_before_any_work():
    r = _run([str(BENCH / "embedding.py"), "--batch", "-1", "--cache", "nan"])
    _one_line_error(r, "--batch", ">= 1")
    assert not r.stdout                     # nothing ran


def test_run_all_refuses_an_empty_only_and_reads_names_in_any_case(tmp_path, monkeypatch):
    run_all = load_benchmark("run_all")
    with pytest.raises(SystemExit) as e:
        run_all.main(["--only", ",", "--out", str(tmp_path)])
    assert e.value.code == 2
    calls = []
    monkeypatch.setattr(run_all, "run", lambda name, *a: calls.append(name) or (0.0, 0, name))
    assert run_all.main(["--only", "Overhead, overhead", "--out", str(tmp_path),
                         "--no-progress"]) == 0
    assert calls == ["overhead"]


# ------------------------------------------------------------------------------ output paths

@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "victim"
    v.write_text("precious")
    return v


def test_figure_path_refuses_what_it_cannot_write(tmp_path, victim, monkeypatch):
    (tmp_path / "folder").mkdir()
    bad = {str(tmp_path / "folder"): "is a folder", "/dev/null": "character device",
           str(tmp_path / "x.xyz"): "unsupported figure format", str(tmp_path / "x"):
           "no extension", str(victim / "a.png"): "is not a folder", "": "empty path"}
    for path, why in bad.items():
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            common.figure_path(path)
    assert common.figure_path(str(tmp_path / "new dir" / "é x.PNG"))
    assert common.figure_or_folder(str(tmp_path / "folder")) == str(tmp_path / "folder")
    assert common.figure_or_folder(str(tmp_path / "figs"))          # a new folder
    (tmp_path / "to_folder").symlink_to(tmp_path / "folder")
    assert common.figure_or_folder(str(tmp_path / "to_folder"))
    with pytest.raises(argparse.ArgumentTypeError, match="no extension"):
        common.figure_or_folder(str(victim))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(argparse.ArgumentTypeError, match=r"cachedarrays\[plot\]"):
        common.figure_path(str(tmp_path / "a.png"))


def _fig():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1])
    return fig


def test_save_plot_replaces_a_link_instead_of_writing_through_it(tmp_path, victim, capsys):
    link = tmp_path / "fig.png"
    link.symlink_to(victim)
    common.save_plot(_fig(), str(link))
    assert victim.read_text() == "precious"
    assert not link.is_symlink() and link.read_bytes()[:4] == b"\x89PNG"
    assert "replaced the previous file" in capsys.readouterr().out
    common.save_plot(_fig(), str(tmp_path / "sub" / "new.pdf"))
    assert (tmp_path / "sub" / "new.pdf").read_bytes()[:4] == b"%PDF"
    assert "replaced" not in capsys.readouterr().out


def test_an_interrupted_figure_leaves_no_file(tmp_path, monkeypatch):
    fig = _fig()

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(fig, "savefig", stop)
    with pytest.raises(KeyboardInterrupt):
        common.save_plot(fig, str(tmp_path / "a.png"))
    assert list(tmp_path.iterdir()) == []


def test_every_figure_goes_through_save_plot():
    for path in BENCH.glob("*.py"):
        if path.name != "_common.py":
            assert ".savefig(" not in path.read_text(), f"{path.name}: use _common.save_plot"


def test_plot_to_a_device_or_through_a_link_from_the_command_line(tmp_path, victim):
    r = _run([str(BENCH / "matmul.py"), "--size", "1", "--repeats", "3", "--threads", "1",
              "--plot", "/dev/full"])
    _one_line_error(r, "/dev/full", "not a file")
    link = tmp_path / "m.png"
    link.symlink_to(victim)
    r = _run([str(BENCH / "matmul.py"), "--size", "1", "--repeats", "3", "--threads", "1",
              "--plot", str(link)])
    assert r.returncode == 0, r.stderr          # the smallest size runs, too
    assert victim.read_text() == "precious" and not link.is_symlink()


def test_slow_path_is_checked_by_the_device_before_the_run(tmp_path, victim):
    for bad, why in ((victim, "existing file"), ("/dev/null", "not a DAX device"),
                     (tmp_path / "no" / "x", "does not exist"), ("", "empty path"),
                     ("  ", "empty path")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            common.slow_path(str(bad))
    assert common.slow_path(str(tmp_path)) == str(tmp_path)
    assert sorted(tmp_path.iterdir()) == [victim]          # the check left nothing behind
    assert victim.read_text() == "precious"


def test_data_file_refuses_folders_and_devices(tmp_path, victim):
    for bad, why in ((tmp_path, "is a folder"), ("/dev/null", "character device"),
                     (victim / "x", "is not a folder")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            common.data_file(str(bad))
    assert common.data_file(str(victim)) == str(victim)


def test_out_folder_refuses_a_file(victim):
    with pytest.raises(argparse.ArgumentTypeError, match="not a folder"):
        common.out_folder(str(victim))
    with pytest.raises(argparse.ArgumentTypeError, match="is not a folder"):
        common.out_folder(str(victim / "sub"))


def test_run_all_removes_a_stale_summary_and_writes_none_when_interrupted(tmp_path,
                                                                         monkeypatch):
    run_all = load_benchmark("run_all")
    (tmp_path / "SUMMARY.md").write_text("## Goals: 9 of 9 met\n")
    (tmp_path / "results.jsonl").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_text("keep")
    calls = []

    def run(name, *a):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return 1.0, 0, name

    monkeypatch.setattr(run_all, "run", run)
    rc = common.run(run_all.main, ["--out", str(tmp_path), "--no-progress",
                                   "--only", "overhead,matmul"])
    assert rc == 130 and calls == ["overhead", "matmul"]
    assert not (tmp_path / "SUMMARY.md").exists()
    assert (tmp_path / "elsewhere").read_text() == "keep"


# ------------------------------------------------------------------------------ environment

def test_bad_thread_settings_in_the_environment_are_dropped_and_named():
    env = {"OMP_NUM_THREADS": "abc", "NUMBA_NUM_THREADS": "0", "MKL_NUM_THREADS": "4",
           "OMP_WAIT_POLICY": "garbage", "OPENBLAS_NUM_THREADS": ""}
    said = []
    common.check_environment(env, warn=said.append)
    assert env == {"MKL_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE"}
    assert len(said) == 3 and all("ignoring" in s for s in said)
    env = {"OMP_NUM_THREADS": "2,1", "OMP_WAIT_POLICY": "active"}
    common.check_environment(env, warn=said.append)
    assert env == {"OMP_NUM_THREADS": "2,1", "OMP_WAIT_POLICY": "active"}


@pytest.mark.parametrize("spin, kept", [
    ("1000", True), ("10k", True), (" 3 M ", True), ("infinite", True), ("Infinity", True),
    ("0", True), ("-5", False), ("fast", False), ("1.5k", False), ("k", False), ("10x", False)])
def test_gomp_spincount_is_kept_when_libgomp_reads_it_and_named_when_not(spin, kept):
    env = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": spin}
    said = []
    common.check_environment(env, warn=said.append)
    assert ("GOMP_SPINCOUNT" in env) == kept
    assert not said if kept else ("GOMP_SPINCOUNT" in said[0] and "1000" in said[0])


def test_the_spin_count_is_printed_with_the_wait_policy_when_set(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert common.wait_settings() == "OMP_WAIT_POLICY=PASSIVE"
    assert "GOMP_SPINCOUNT" not in common.machine()
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert common.wait_settings() == "OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=1000"
    assert "OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=1000" in common.machine()
    from cachedarrays import threads
    s = threads.settings()
    assert s["GOMP_SPINCOUNT"] == "1000"
    assert threads.describe(s).startswith("OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=1000, ")
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert "GOMP_SPINCOUNT" not in threads.describe()


def test_a_missing_peer_is_a_usage_error_before_the_run():
    p = common.parser("t")
    with pytest.raises(SystemExit) as e:
        common.check_peer(p, "no_such_module_for_peer")
    assert e.value.code == 2


def test_a_peer_that_stops_is_one_line_and_exit_1(monkeypatch, capsys):
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(BENCH))
    cnn = load_benchmark("cnn")

    def stopped(args):
        raise cnn.PeerError("the torch peer stopped (exit 1); its error is above")

    monkeypatch.setattr(cnn, "peer_torch", stopped)
    assert cnn.main(["--peer", "torch", "--peer-only", "--batch", "2", "--image", "8",
                     "--width", "16", "--repeats", "3", "--threads", "1"]) == 1
    assert capsys.readouterr().err.strip().endswith("error: the torch peer stopped (exit 1); "
                                                    "its error is above")


# ------------------------------------------------------------------------------ interruption

@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_runs_its_main_through_the_shared_wrapper(name):
    tree = ast.parse((BENCH / f"{name}.py").read_text())
    tail = [n for n in tree.body if isinstance(n, ast.If)][-1]
    assert ast.unparse(tail.body[-1]) == "sys.exit(_common.run(main))"


def test_run_turns_interrupts_and_pipes_into_statuses(capsys):
    def interrupted():
        raise KeyboardInterrupt

    def full():
        raise OSError(28, "No space left on device", "/x/out.png")

    assert common.run(interrupted) == 130
    assert common.run(full) == 1
    err = capsys.readouterr().err
    assert "interrupted" in err and "/x/out.png: No space left on device" in err
    assert common.run(lambda: [1, 2]) == 0 and common.run(lambda: 3) == 3


def _ctrl_c_reaches(argv):
    """A benchmark started as from a terminal, where Ctrl-C interrupts it: a test run in the
    background (``make test &``, a runner without job control) inherits SIGINT ignored, and
    Python then installs no handler for it in the child."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_ctrl_c_mid_run_exits_130_without_a_traceback():
    p = _ctrl_c_reaches([sys.executable, str(BENCH / "overhead.py"), "--sizes", "10",
                         "--repeats", "100000", "--budget", "0.001", "--threads", "1"])
    assert p.stdout.readline().startswith("machine:")
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "overhead: interrupted"


def test_run_all_interrupted_in_a_script_leaves_a_marked_log_and_no_summary(tmp_path):
    (tmp_path / "SUMMARY.md").write_text("## Goals: 9 of 9 met\n")
    p = _ctrl_c_reaches([sys.executable, str(BENCH / "run_all.py"), "--only", "overhead",
                         "--out", str(tmp_path), "--threads", "1", "--no-progress"])
    assert p.stdout.readline().startswith("machine:")
    time.sleep(1.0)                             # overhead.py is running
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err
    assert not (tmp_path / "SUMMARY.md").exists()
    assert (tmp_path / "overhead.txt").read_text().endswith(
        "[interrupted: this log is incomplete]\n")


def test_sigterm_mid_run_cleans_up_and_exits_143(tmp_path):
    pytest.importorskip("distributed")
    p = subprocess.Popen([sys.executable, str(BENCH / "dask_tiers.py"), "--workers", "1",
                          "--limit", "1MiB", "--chunk", "64K", "--cols", "8", "--ratio", "1",
                          "--repeats", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT,
                         env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TMPDIR=str(tmp_path)))
    for line in p.stdout:
        if line.startswith("computation"):          # the clusters and their folder are up
            break
    time.sleep(0.5)
    assert any(x.name.startswith("dask_tiers_") for x in tmp_path.iterdir())
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and "dask_tiers: terminated" in err
    assert "Traceback" not in err
    assert not any(x.name.startswith("dask_tiers_") for x in tmp_path.iterdir())


def test_a_lost_heartbeat_at_teardown_logs_one_line(monkeypatch):
    """A worker whose heartbeat finds the scheduler closed (the clusters ending, on SIGTERM
    too) logs the line without distributed's traceback; other errors keep theirs."""
    import io
    import logging
    pytest.importorskip("distributed")
    tiers = load_benchmark("dask_tiers")
    log = logging.getLogger("distributed.worker")
    monkeypatch.setattr(log, "filters", list(log.filters))     # restored after the test
    tiers._warm_up()                    # as each worker runs it
    tiers._warm_up()                    # twice: one filter
    assert log.filters.count(tiers.quiet_heartbeat_loss) == 1
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    log.addHandler(handler)
    try:
        for message in (tiers.HEARTBEAT_LOST + ".", "Unexpected exception during heartbeat."):
            try:
                raise OSError("Stream is closed")
            except OSError:
                log.exception(message)
    finally:
        log.removeHandler(handler)
    lost, other = out.getvalue().split("Unexpected exception", 1)
    assert lost.strip() == tiers.HEARTBEAT_LOST + "."
    assert "Traceback" in other and "Stream is closed" in other


def test_a_corrupt_cached_trace_is_recorded_again(tmp_path, monkeypatch):
    policies = load_benchmark("policies")
    with gzip.open(tmp_path / "m.trace.gz", "wb") as f:
        f.write(b"{half a trace")

    class T:
        meta = {}

        def save(self, path):
            self.saved = path

    t = T()
    monkeypatch.setattr(policies, "record", lambda *a, **k: t)
    said = []
    got = policies.load_or_record("m", {"kind": "x"}, str(tmp_path), True, "numpy", 2,
                                  log=said.append)
    assert got is t and t.saved.endswith("m.trace.gz")
    assert "unreadable" in said[0]


# ------------------------------------------------------------------------------ demo

def test_demo_help_and_bad_options_stop_before_it_runs(monkeypatch, capsys):
    from cachedarrays.models import demo

    def ran():
        raise AssertionError("the demo ran")

    monkeypatch.setattr(demo, "matmul_example", ran)
    for argv, code in ((["--help"], 0), (["--fast", "1"], 2)):
        with pytest.raises(SystemExit) as e:
            demo.main(argv)
        assert e.value.code == code
    assert "exit status" in capsys.readouterr().out


def test_demo_interrupted_exits_130(monkeypatch, capsys):
    from cachedarrays.models import demo

    def stop():
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "matmul_example", stop)
    assert demo.main([]) == 130
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["missing-folder/results.jsonl", "a-folder"])
def test_an_unwritable_results_file_is_named_once_and_the_figures_still_print(
        tmp_path, monkeypatch, capsys, where):
    (tmp_path / "a-folder").mkdir()
    monkeypatch.setenv("CA_BENCH_RESULTS", str(tmp_path / where))
    assert common.goal("g", 1.5, 1.0) is True
    common.headline("h", 2.0)
    out, err = capsys.readouterr()
    assert "goal g: 1.50x" in out and "h: 2.00x" in out
    assert err.count("cannot append to CA_BENCH_RESULTS") == 1
    assert "CA_BENCH_RESULTS" not in os.environ


class _Started(Exception):
    pass


def _main_of(script, monkeypatch, available):
    """benchmarks/<script>.py's main, seeing ``available`` bytes of memory, whose run raises
    _Started instead of running."""
    bench = load_benchmark(script)
    monkeypatch.setattr(bench._common, "available_memory", lambda: available)

    def started(*args, **kwargs):
        raise _Started

    monkeypatch.setattr(bench, "run" if script == "dlrm" else "run_setups", started)
    return bench.main


@pytest.mark.parametrize("script, argv, flag", [
    ("dlrm", ["--scale", "1000"], "--scale"),
    ("dlrm", ["--config", "tiny", "--batch-size", "100000000"], "--batch-size"),
    ("dlrm", ["--config", "tiny", "--iterations", "100000000"], "--iterations"),
    ("dlrm", ["--config", "tiny", "--width-scale", "100000"], "--width-scale"),
    ("cnn", ["--batch", "100000"], "--batch"),
    ("cnn", ["--image", "100000"], "--image"),
    ("cnn", ["--channels", "10000000"], "--channels"),
    ("cnn", ["--classes", "10000000000"], "--classes"),
    ("cnn", ["--width", "0.0001"], "--width"),
])
def test_dlrm_and_cnn_sizes_beyond_the_available_memory_are_usage_errors(
        script, argv, flag, monkeypatch, capsys):
    main = _main_of(script, monkeypatch, 8 << 30)
    with pytest.raises(_Started):           # the defaults fit in 8 GiB and start the run
        main(["--no-progress"] if script == "dlrm" else ["--no-progress", "--setup", "LM"])
    capsys.readouterr()
    try:
        rc = main(argv + ["--no-progress"])
    except SystemExit as e:                 # argparse's p.error
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2
    assert "error:" in err and flag in err and "needs about" in err and "8.0 GiB is available" in err
