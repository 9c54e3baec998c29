"""The benchmark suite (bench/) still runs: `bench/run.py --quick` exits 0 and prints one report
line per benchmark with a ratio and a target, or, for the rows measured against SWE-ReX when
swe-rex (the `bench` extra) is not installed, a SKIP line saying how to install it.

This checks that the suite works, not how fast the daemon is: the ratios and PASS/MISS
verdicts are deliberately not asserted (they are measurements, reported by the suite itself).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "bench" / "run.py"
MEASURED_AGAINST_SWEREX = {"exec_true_swerex", "output_10mb"}
BENCHMARKS = {
    "first_connect",
    "connect_bootstrap",
    "exec_true",
    "patch_small_edit",
    "read_file_rate",
    "big_output",
    "replay",
    "p99_loaded",
    "idle_rss",
    "stalled_rss",
    "holder_launch",
    "stdin_pty",
    "process_start",
} | MEASURED_AGAINST_SWEREX
REPORT_LINE = re.compile(
    r"^BENCH (?P<name>\S+) .* \| ratio (?P<ratio>\d+(\.\d+)?)x \| target (<=|>=) [^|]+ \| (PASS|MISS)\b"
)
SKIP_LINE = re.compile(r"^BENCH (?P<name>\S+) +SKIP: swe-rex not installed \(pip install -e '\.\[bench\]'\)")
WITHOUT_SWEREX = "SUPERVISOR_BENCH_WITHOUT_SWEREX"  # bench/swerex_peer.py
# A hang guard, not a speed check: several times the usual run (about 35 s here with other
# work on the machine, more with the SWE-ReX rows) still fits on a busy machine.
QUICK_RUN_LIMIT_S = 300


def swerex_installed() -> bool:
    return not os.environ.get(WITHOUT_SWEREX) and importlib.util.find_spec("swerex") is not None


def bench_run(*args: str, env: dict[str, str] | None = None, timeout: float = QUICK_RUN_LIMIT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUN), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_quick_bench_run_reports_every_benchmark() -> None:
    completed = bench_run("--quick")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = [line for line in completed.stdout.splitlines() if line.startswith("BENCH ")]
    reported = {m["name"] for m in map(REPORT_LINE.match, lines) if m}
    skipped = {m["name"] for m in map(SKIP_LINE.match, lines) if m}
    assert len(reported) + len(skipped) == len(lines), completed.stdout
    assert reported | skipped == BENCHMARKS, completed.stdout
    # Only the rows measured against SWE-ReX may skip, and only when it is not installed.
    assert skipped == (set() if swerex_installed() else MEASURED_AGAINST_SWEREX), completed.stdout


def test_a_row_against_swerex_skips_with_the_install_hint_when_it_is_missing() -> None:
    completed = bench_run("--quick", "--only", "exec_true_swerex", env={WITHOUT_SWEREX: "1"}, timeout=60)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = [line for line in completed.stdout.splitlines() if line.startswith("BENCH ")]
    assert len(lines) == 1 and SKIP_LINE.match(lines[0]), completed.stdout
    assert "1 SKIP (exec_true_swerex)" in completed.stdout


def load_run() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_run_under_test", RUN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repeated_runs_report_the_median_run_with_the_range_and_judge_the_median() -> None:
    run = load_run()
    from bench.common import Result  # importable once bench/run.py has put the repository on the path

    def result(ratio: float, target: str = "<= 1.5x") -> Result:
        return Result("row", f"median {ratio} ms", "floor", ratio, target, ratio <= 1.5)

    chosen, summary = run.combine([result(r) for r in (1.2, 1.9, 1.4, 1.6, 1.3)])
    assert chosen.ratio == 1.4 and chosen.passed
    assert summary == "median of 5 runs 1.40x, range 1.20x–1.90x"
    # An even count: the verdict is on the median itself (1.55 > 1.5), not on a run.
    chosen, summary = run.combine([result(r) for r in (1.4, 1.5, 1.6, 1.7)])
    assert chosen.ratio == 1.5 and not chosen.passed
    assert summary.startswith("median of 4 runs 1.55x")
    # An absolute figure (MiB) is what the median is taken of, with its unit.
    rss = [Result("idle_rss", "x", "y", 1.2, "<= 55 MiB absolute", m <= 55, figure=m, figure_unit="MiB") for m in (54.0, 56.0, 55.5)]
    chosen, summary = run.combine(rss)
    assert chosen.judged == 55.5 and not chosen.passed
    assert summary == "median of 3 runs 55.5 MiB, range 54.0 MiB–56.0 MiB"


def test_the_full_run_takes_the_median_of_at_least_five_runs_per_row() -> None:
    run = load_run()
    assert run.FULL_REPEATS >= 5
    completed = bench_run("--list", timeout=60)
    assert completed.returncode == 0, completed.stderr
    listed = {line.split()[0] for line in completed.stdout.splitlines() if line.strip()}
    assert listed == BENCHMARKS
