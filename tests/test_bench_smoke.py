"""The benchmark suite (bench/) still runs: `bench/run.py --quick` exits 0 (in about 8 s here) and
prints one report line per benchmark with a ratio and a target.

This checks that the suite works, not how fast the daemon is: the ratios and PASS/MISS
verdicts are deliberately not asserted (they are measurements, reported by the suite itself).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = {
    "connect_bootstrap",
    "exec_true",
    "patch_small_edit",
    "read_file_rate",
    "big_output",
    "replay",
    "idle_rss",
    "holder_launch",
    "stdin_pty",
    "process_start",
}
REPORT_LINE = re.compile(
    r"^BENCH (?P<name>\S+) .* \| ratio (?P<ratio>\d+(\.\d+)?)x \| target (<=|>=) [^|]+ \| (PASS|MISS)\b"
)
# A hang guard, not a speed check: four times the usual run still fits on a machine busy
# with other work (the quick run took over 30 s with six CPU-bound processes on two cores).
QUICK_RUN_LIMIT_S = 120


@pytest.mark.slow
def test_quick_bench_run_reports_every_benchmark():
    completed = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=QUICK_RUN_LIMIT_S,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = [line for line in completed.stdout.splitlines() if line.startswith("BENCH ")]
    matches = [REPORT_LINE.match(line) for line in lines]
    assert all(matches), "\n".join(line for line, m in zip(lines, matches) if not m)
    names = [m["name"] for m in matches]
    assert sorted(names) == sorted(BENCHMARKS), completed.stdout
