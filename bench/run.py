"""Run the benchmark suite: `python bench/run.py [--quick] [--repeat N] [--only NAME[,NAME…]] [--json FILE]`.

Prints one `BENCH` line per benchmark (what the daemon did, the floor or the peer measured in
the same run, the ratio, its target (bench/README.md), and PASS or MISS). With `--repeat N`
(the full run's default is 5) each benchmark runs N times: each run gets a `RUN` line, and the
`BENCH` line is the run with the median figure, with the range over the runs. A MISS is
reported, not fatal; so is a SKIP (a row whose peer, SWE-ReX, is not installed). The exit status
is 0 unless a benchmark could not run at all (then 1).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, sys.path[0] is bench/ itself; import the suite as the `bench` package from
# the repository root instead (so no module here can shadow a standard-library one).
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from bench.common import Mode, Result, Skipped  # noqa: E402
from bench.machine import cgroup_migration  # noqa: E402

# In run order; each module has NAME, TARGET and `async def run(mode, workdir) -> Result`
# (bench/README.md, "Targets", lists each row and its target).
MODULES = [
    "bench.first_connect",
    "bench.connect_bootstrap",
    "bench.exec_true",
    "bench.exec_true_swerex",
    "bench.patch_small_edit",
    "bench.read_file_rate",
    "bench.output_10mb",
    "bench.big_output",
    "bench.replay",
    "bench.p99_loaded",
    "bench.idle_rss",
    "bench.stalled_rss",
    "bench.holder_launch",
    "bench.stdin_pty",
    "bench.process_start",
]
# Rows whose figure is a rate, a throughput or SWE-ReX's time over the daemon's: higher is
# better, so their target is a lower bound (the others' is an upper bound).
AT_LEAST = {"read_file_rate", "big_output", "exec_true_swerex", "output_10mb"}
FULL_REPEATS = 5  # the "median of at least 5 runs per row"
QUICK_REPEATS = 1
TARGET_TEXT = re.compile(r"^(<=|>=) ([0-9.]+)")


def load() -> dict:
    loaded = [importlib.import_module(name) for name in MODULES]
    return {module.NAME: module for module in loaded}


def target_text(module) -> str:
    for attribute, unit in (("TARGET", "x"), ("TARGET_MIB", " MiB")):
        if hasattr(module, attribute):
            return f"{'>=' if module.NAME in AT_LEAST else '<='} {getattr(module, attribute):g}{unit}"
    return "?"


def combine(runs: list[Result]) -> tuple[Result, str]:
    """The run with the median figure (the lower middle one for an even count), with the
    verdict on the median itself, and the range over the runs."""
    ordered = sorted(runs, key=lambda result: result.judged)
    middle = ordered[(len(ordered) - 1) // 2]
    median = statistics.median(result.judged for result in runs)
    passed = middle.passed
    bound = TARGET_TEXT.match(middle.target)
    if bound:
        limit = float(bound.group(2))
        passed = median <= limit if bound.group(1) == "<=" else median >= limit
    figure = middle.format_figure
    summary = (
        f"median of {len(runs)} runs {figure(median)}, "
        f"range {figure(ordered[0].judged)}–{figure(ordered[-1].judged)}"
    )
    chosen = Result(**{**middle.__dict__, "passed": passed})
    return chosen, summary


def code_revision() -> str:
    """The commit measured, and whether the daemon's sources differ from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "supervisor", "protocol", "testing"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    changed = [line[3:] for line in dirty if line.strip()]
    return head + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


def main(argv: list[str] | None = None) -> int:
    benchmarks = load()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few iterations each, one run (a smoke run)")
    parser.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help=f"run each benchmark N times and report the median (default {FULL_REPEATS}, --quick {QUICK_REPEATS})",
    )
    parser.add_argument("--list", action="store_true", help="print each benchmark's name and target, and exit")
    parser.add_argument("--only", metavar="NAME", help=f"comma-separated subset of: {', '.join(benchmarks)}")
    parser.add_argument("--json", metavar="FILE", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.list:
        for name, module in benchmarks.items():
            print(f"{name:<17} {target_text(module):<10} {(module.__doc__ or '').strip().splitlines()[0]}")
        return 0
    repeats = args.repeat or (QUICK_REPEATS if args.quick else FULL_REPEATS)
    if repeats < 1:
        parser.error("--repeat needs N >= 1")

    names = list(benchmarks)
    if args.only:
        names = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in names if name not in benchmarks]
        if unknown:
            parser.error(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(benchmarks)}")

    mode = Mode(quick=args.quick)
    print(
        f"# sandbox-supervisor benchmarks, {'quick' if mode.quick else 'full'} run, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        flush=True,
    )
    print(
        f"# {platform.node()}: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}",
        flush=True,
    )
    print(f"# code: {code_revision()}", flush=True)
    print(f"# cgroup migration: {cgroup_migration()}", flush=True)
    print("# ratio: daemon time / floor time (lower is better), or daemon rate / floor rate (higher is better); "
          "against SWE-ReX: its time / the daemon's (higher is better); every floor and peer is measured in this run", flush=True)
    print(f"# {repeats} run(s) per benchmark" + (", the median reported" if repeats > 1 else ""), flush=True)

    results: list[Result] = []
    runs_of: dict[str, list[Result]] = {}
    failed = []
    skipped = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="supervisor-bench-") as tmp:
        for name in names:
            t0 = time.perf_counter()
            runs: list[Result] = []
            try:
                for attempt in range(repeats):
                    workdir = Path(tmp) / f"{name}-{attempt}"
                    workdir.mkdir()
                    t1 = time.perf_counter()
                    try:
                        result = trio.run(benchmarks[name].run, mode, workdir)
                    finally:
                        # What a run wrote (spools, patched files, databases) goes with it,
                        # not at the end of the whole run: left in the page cache, it slows
                        # the file writes of the rows after it (bench/README.md, "the page
                        # cache").
                        shutil.rmtree(workdir, ignore_errors=True)
                    runs.append(result)
                    if repeats > 1:
                        print(f"{result.line(f'RUN {attempt + 1}/{repeats}')} [{time.perf_counter() - t1:.1f} s]", flush=True)
            except Skipped as skip:
                skipped.append(name)
                print(f"BENCH {name:<17} SKIP: {skip}", flush=True)
                continue
            except Exception:
                failed.append(name)
                print(f"BENCH {name:<17} ERROR (see traceback on stderr)", flush=True)
                traceback.print_exc()
                continue
            result, summary = combine(runs) if repeats > 1 else (runs[0], "")
            results.append(result)
            runs_of[name] = runs
            print(f"{result.line(repeats=summary)} [{time.perf_counter() - t0:.1f} s]", flush=True)

    misses = [result.name for result in results if not result.passed]
    print(
        f"# {len(results)} run, {len(results) - len(misses)} PASS, {len(misses)} MISS"
        + (f" ({', '.join(misses)})" if misses else "")
        + (f", {len(skipped)} SKIP ({', '.join(skipped)})" if skipped else "")
        + (f", {len(failed)} ERROR ({', '.join(failed)})" if failed else "")
        + f"; {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    if args.json:
        rows = [{**result.as_dict(), "runs": [run.as_dict() for run in runs_of[result.name]]} for result in results]
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
