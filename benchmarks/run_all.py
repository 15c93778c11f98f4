"""Run every benchmark at sizes that finish in about ten minutes and write one Markdown summary.

    .venv/bin/python benchmarks/run_all.py [--out bench_results] [--only overhead,cnn]

Each script runs in its own process with the same thread settings (OMP_WAIT_POLICY=PASSIVE,
OMP_NUM_THREADS = --threads); its full output goes to ``<out>/<name>.txt`` and every goal and
headline figure it records (``_common.goal`` / ``_common.headline``) to ``<out>/results.jsonl``.
``<out>/SUMMARY.md`` lists every goal (met or not) and headline figure, the machine, the thread
settings and the command of each run. ``make bench`` runs this script.
"""

import json
import os
import subprocess
import sys
import time

import _common

HERE = os.path.dirname(os.path.abspath(__file__))

#: (name, script, arguments): the sizes make bench runs (about 10 minutes in all on 2 cores).
JOBS = [
    ("overhead", "overhead.py", ["--sizes", "10", "1000", "100000", "--repeats", "7"]),
    ("copy_engine", "copy_engine.py", ["--sizes", "1M,16M,64M", "--repeats", "5"]),
    ("allocator", "allocator.py", ["--repeats", "5"]),
    ("matmul", "matmul.py", ["--size", "1500", "--repeats", "5"]),
    ("kernels", "kernels.py", ["--reps", "5", "--no-numpy"]),
    ("cnn", "cnn.py", ["--models", "resnet50,vgg16,densenet121", "--peer", "torch",
                       "--peer-only", "--repeats", "9"]),
    ("embedding", "embedding.py", ["--repeats", "9", "--cache", "1.0", "--warmup", "6"]),
    ("dlrm", "dlrm.py", ["--peer", "torch", "--table-kinds", "simple", "static", "dynamic",
                         "--iterations", "9"]),
    ("dask_tiers", "dask_tiers.py", ["--repeats", "5"]),
    ("policies", "policies.py", ["--models", "resnet50", "--budgets", "20,25,50",
                                 "--sections", "sweep"]),
]


def run(name, script, args, out, env, progress):
    """Run one script; returns (seconds, exit code, command line)."""
    cmd = [sys.executable, os.path.join(HERE, script), *args]
    shown = " ".join(["python", f"benchmarks/{script}", *args])
    t = time.perf_counter()
    path = os.path.join(out, f"{name}.txt")
    if os.path.islink(path):
        os.unlink(path)                  # replaced, not written through
    with open(path, "w") as log:
        log.write(f"$ {shown}\n")
        log.flush()
        try:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        except BaseException:               # Ctrl-C or SIGTERM: the log says it is partial
            log.write("\n[interrupted: this log is incomplete]\n")
            raise
    secs = time.perf_counter() - t
    msg = f"{name}: {'ok' if rc == 0 else f'exit {rc}'} in {secs:.0f} s"
    if progress.disable:
        print(msg, flush=True)
    else:
        progress.write(msg)
    return secs, rc, shown


def summary(out, jobs, runs, results, machine, threads):
    """The Markdown summary: goals first, then headline figures, then the runs."""
    lines = ["# Benchmark summary", "", f"- {machine}", f"- {threads}",
             "- every ratio is a speedup: peer time / our time (> 1: we are faster); figures "
             "are medians of interleaved repetitions (each script's log gives the spread)", ""]
    goals = [r for r in results if r["kind"] == "goal"]
    met = sum(bool(g["met"]) for g in goals)
    lines += [f"## Goals: {met} of {len(goals)} met", "",
              "| script | goal | value | target | met |", "|---|---|---|---|---|"]
    for g in goals:
        value = "-" if g.get("value") is None else f"{g['value']:.2f}{g.get('unit', '')}"
        target = ("-" if g.get("target") is None else
                  f"{'>=' if g.get('higher', True) else '<='} {g['target']:g}{g.get('unit', '')}")
        detail = f" ({g['detail']})" if g.get("detail") else ""
        lines.append(f"| {g['script']} | {g['name']}{detail} | {value} | {target} | "
                     f"{'met' if g['met'] else '**not met**'} |")
    heads = [r for r in results if r["kind"] == "headline"]
    if heads:
        lines += ["", "## Headline figures", "", "| script | figure | value |", "|---|---|---|"]
        for h in heads:
            detail = f" ({h['detail']})" if h.get("detail") else ""
            lines.append(f"| {h['script']} | {h['name']}{detail} | {h['value']:.2f}{h['unit']} |")
    lines += ["", "## Runs", "", "| run | command | seconds | exit |", "|---|---|---|---|"]
    for (name, _, _), (secs, rc, shown) in zip(jobs, runs):
        lines.append(f"| {name} | `{shown}` | {secs:.0f} | {rc} |")
    path = os.path.join(out, "SUMMARY.md")
    _common.write_atomically(path, "\n".join(lines) + "\n")
    return path


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--out", default="bench_results", type=_common.out_folder,
                   help="folder for the logs and SUMMARY.md (made if missing; the files of an "
                   "earlier run there are replaced)")
    p.add_argument("--only", default="", help="comma-separated subset of: "
                   + ", ".join(j[0] for j in JOBS))
    _common.add_standard(p, plot=False)
    args = p.parse_args(argv)
    jobs = JOBS
    if args.only.strip():
        want = [x.strip().lower() for x in args.only.split(",") if x.strip()]
        unknown = sorted(set(want) - {j[0] for j in JOBS})
        if unknown or not want:
            p.error(f"--only: {'unknown ' + ', '.join(unknown) if unknown else 'no name given'}"
                    f"; choose from {', '.join(j[0] for j in JOBS)}")
        jobs = [j for j in JOBS if j[0] in want]
    os.makedirs(args.out, exist_ok=True)
    stale = os.path.join(args.out, "SUMMARY.md")
    if os.path.lexists(stale):
        os.unlink(stale)           # an earlier run's: it must not pass for this run's
    results_path = os.path.abspath(os.path.join(args.out, "results.jsonl"))
    _common.write_atomically(results_path, "")
    env = dict(os.environ, CA_BENCH_RESULTS=results_path, OMP_NUM_THREADS=str(args.threads),
               OMP_WAIT_POLICY=os.environ["OMP_WAIT_POLICY"])
    machine = _common.machine()
    threads = (f"threads: {args.threads} for ours and every peer, "
               f"{_common.wait_settings()} (each script prints its pools)")
    print(machine)
    print(threads)
    runs = []
    bar = _common.progress(jobs, total=len(jobs), desc="benchmarks", disable=args.no_progress)
    for name, script, extra in bar:
        runs.append(run(name, script, extra, args.out, env, bar))
    with open(results_path) as f:
        results = [json.loads(line) for line in f if line.strip()]
    path = summary(args.out, jobs, runs, results, machine, threads)
    print(f"summary: {path}")
    print(open(path).read())
    return 0 if all(rc == 0 for _, rc, _ in runs) else 1


if __name__ == "__main__":
    sys.exit(_common.run(main))
