"""Run the benchmark suite: `python bench/run.py [--quick] [--only NAME[,NAME…]] [--json FILE]`.

Prints one `BENCH` line per benchmark (what the daemon did, the floor measured in the same
run, the ratio, its target (bench/README.md), and PASS or MISS). A MISS is reported, not
fatal: the exit status is 0 unless a benchmark could not run at all (then 1).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
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

from bench.common import Mode, Result  # noqa: E402

# In run order; each module has NAME and `async def run(mode, workdir) -> Result`.
MODULES = [
    "bench.connect_bootstrap",
    "bench.exec_true",
    "bench.patch_small_edit",
    "bench.read_file_rate",
    "bench.big_output",
    "bench.replay",
    "bench.idle_rss",
    "bench.holder_launch",
    "bench.stdin_pty",
    "bench.process_start",
]


def load() -> dict:
    modules = [importlib.import_module(name) for name in MODULES]
    return {module.NAME: module for module in modules}


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
    parser.add_argument("--quick", action="store_true", help="a few iterations each (a smoke run, < 30 s)")
    parser.add_argument("--only", metavar="NAME", help=f"comma-separated subset of: {', '.join(benchmarks)}")
    parser.add_argument("--json", metavar="FILE", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)

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
    print("# ratio: daemon time / floor time (lower is better), or daemon rate / floor rate (higher is better); every floor is measured in this run", flush=True)

    results: list[Result] = []
    failed = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="supervisor-bench-") as tmp:
        for name in names:
            workdir = Path(tmp) / name
            workdir.mkdir()
            t0 = time.perf_counter()
            try:
                result = trio.run(benchmarks[name].run, mode, workdir)
            except Exception:
                failed.append(name)
                print(f"BENCH {name:<17} ERROR (see traceback on stderr)", flush=True)
                traceback.print_exc()
                continue
            results.append(result)
            print(f"{result.line()} [{time.perf_counter() - t0:.1f} s]", flush=True)

    misses = [result.name for result in results if not result.passed]
    print(
        f"# {len(results)} run, {len(results) - len(misses)} PASS, {len(misses)} MISS"
        + (f" ({', '.join(misses)})" if misses else "")
        + (f", {len(failed)} ERROR ({', '.join(failed)})" if failed else "")
        + f"; {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps([result.as_dict() for result in results], indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
